//! Bios: what a submitter asks of a block device, and the buffers that carry the data.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ptr::NonNull;

use blkq_sync::DynArc as Arc;

use blkq_sync::Mutex;

use crate::Error;

/// Sector size of all bio addressing (the kernel's 512-byte sectors).
pub const SECTOR_SIZE: u64 = 512;
/// `log2(SECTOR_SIZE)`.
pub const SECTOR_SHIFT: u32 = 9;

/// What a bio does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    /// Read `len` bytes into the buffer.
    Read,
    /// Write the buffer's `len` bytes.
    Write,
    /// Make completed writes durable. `sector` and `len` are ignored.
    Flush,
    /// Discard (trim): the range may read as zeros afterwards.
    Discard,
    /// Zero the range (unmapping it unless [`BioFlags::NO_HOLE`]).
    WriteZeroes,
}

impl Op {
    /// The statistics direction: 0 read, 1 write (flush, discard and write-zeroes count as
    /// writes, as `/sys/block/*/stat`'s discard and flush columns are folded in here).
    #[inline]
    pub fn dir(self) -> usize {
        match self {
            Op::Read => 0,
            _ => 1,
        }
    }

    /// Whether the op moves data through a buffer.
    #[inline]
    pub fn has_data(self) -> bool {
        matches!(self, Op::Read | Op::Write)
    }

    /// Whether a request of this op with `flags` is *synchronous*, the kernel's `op_is_sync`:
    /// reads and flushes always (a flush is the kernel's `REQ_PREFLUSH`), anything else only
    /// when flagged [`BioFlags::SYNC`] or [`BioFlags::FUA`]. Everything else is asynchronous,
    /// and a scheduler may allocate it tags shallowly ([`crate::Scheduler::async_depth`]).
    #[inline]
    pub fn is_sync(self, flags: BioFlags) -> bool {
        matches!(self, Op::Read | Op::Flush)
            || flags.contains(BioFlags::SYNC)
            || flags.contains(BioFlags::FUA)
    }
}

/// Bio flags (a bit set).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub struct BioFlags(pub u32);

impl BioFlags {
    /// No flags.
    pub const NONE: Self = Self(0);
    /// Force unit access: the write is durable when it completes.
    pub const FUA: Self = Self(1);
    /// Write-zeroes must leave the range allocated.
    pub const NO_HOLE: Self = Self(2);
    /// Write-zeroes must fail fast (NBD `FAST_ZERO`) rather than write zeros slowly.
    pub const FAST_ZERO: Self = Self(4);
    /// Synchronous I/O (a hint for schedulers).
    pub const SYNC: Self = Self(8);
    /// Allocate from the queue's reserved tags (internal commands).
    pub const RESERVED: Self = Self(16);

    /// Whether every flag of `other` is set.
    #[inline]
    pub fn contains(self, other: Self) -> bool {
        self.0 & other.0 == other.0
    }
}

impl std::ops::BitOr for BioFlags {
    type Output = Self;
    fn bitor(self, rhs: Self) -> Self {
        Self(self.0 | rhs.0)
    }
}

/// I/O priority class, as `ioprio_set(2)`'s.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash, PartialOrd, Ord)]
pub enum IoPrio {
    /// Real time.
    Rt = 0,
    /// Best effort (the default).
    #[default]
    Be = 1,
    /// Idle.
    Idle = 2,
}

/// A block I/O.
///
/// A bio is moved, never shared: the submitter hands it to the device and gets it back, with
/// its buffer, in [`EndIo::end_io`].
#[derive(Debug)]
pub struct Bio {
    /// The operation.
    pub op: Op,
    /// Start, in 512-byte sectors.
    pub sector: u64,
    /// Length in bytes (for `Read`/`Write`, at most the buffer's length).
    pub len: u32,
    /// Flags.
    pub flags: BioFlags,
    /// Priority class.
    pub prio: IoPrio,
    /// The data, for reads and writes. `None` is allowed for `null` devices and benchmarks
    /// that do not look at data.
    pub buf: Option<Buffer>,
    /// The submitter's own number for this bio (e.g. an NBD cookie slot); blk never reads it.
    pub cookie: u64,
}

impl Bio {
    /// A bio without data.
    pub fn new(op: Op, sector: u64, len: u32) -> Self {
        Self {
            op,
            sector,
            len,
            flags: BioFlags::NONE,
            prio: IoPrio::Be,
            buf: None,
            cookie: 0,
        }
    }

    /// A read or write carrying `buf` (its full length).
    pub fn with_buf(op: Op, sector: u64, buf: Buffer) -> Self {
        let mut b = Self::new(op, sector, buf.len() as u32);
        b.buf = Some(buf);
        b
    }

    /// Start in bytes.
    #[inline]
    pub fn offset(&self) -> u64 {
        self.sector << SECTOR_SHIFT
    }

    /// One past the last sector.
    #[inline]
    pub fn end_sector(&self) -> u64 {
        self.sector + (u64::from(self.len) >> SECTOR_SHIFT)
    }
}

/// Where a submitter learns that its bios completed. Registered once per submitter (one
/// `Arc` cloned per I/O, never a boxed closure per I/O).
///
/// `end_io` may run on any thread: the submitter's own (inline completion, possibly nested
/// inside its `submit` call), a driver's completion thread, or io_uring's reaper.
///
/// A completer that finishes several bios in a row (a remote device's receiver parsing the
/// replies one receive brought) may complete them with [`EndIo::end_io_batched`] and close the
/// run with [`EndIo::end_batch`] before it blocks or turns to other work, so that what
/// batching amortises (a server's replies, coalesced into one send) is done once for the run.
pub trait EndIo: Send + Sync {
    /// The bio is done; `res` is its status.
    fn end_io(&self, bio: Bio, res: Result<(), Error>);

    /// The bio is done, as one of a run the caller closes with [`EndIo::end_batch`] on this
    /// same `EndIo` before it blocks or does other work: what the completion would do once
    /// per run may wait for that call. Default: [`EndIo::end_io`].
    fn end_io_batched(&self, bio: Bio, res: Result<(), Error>) {
        self.end_io(bio, res);
    }

    /// Closes a run of [`EndIo::end_io_batched`] calls. Default: nothing.
    fn end_batch(&self) {}
}

/// Alignment of every pooled buffer: enough for O_DIRECT on any device we meet.
pub const BUF_ALIGN: usize = 4096;

/// An aligned, zero-initialised byte buffer, returned to its pool when dropped.
///
/// A buffer either owns its bytes, or is a read-only *alias* of another buffer's bytes
/// ([`Buffer::alias`]): a mirror lends the caller's payload to each leg of a write that way,
/// instead of copying it.
///
/// # Invariants
///
/// `ptr` points to `cap` bytes; `len <= cap`. Unless `alias`, they are owned by this value:
/// allocated with `Layout(cap, BUF_ALIGN)`, or, when `mapped`, an anonymous private mapping
/// of `cap` bytes (page-aligned, so `BUF_ALIGN`-aligned). An alias owns nothing: its owner
/// outlives it and nobody writes the bytes while it lives (the contract of
/// [`Buffer::alias`]); it never writes them itself ([`Buffer::as_mut_slice`] is empty) and
/// never frees them.
pub struct Buffer {
    ptr: NonNull<u8>,
    len: usize,
    cap: usize,
    /// Memory from `mmap` (see [`Buffer::new_mapped`]): released with `munmap`.
    mapped: bool,
    /// Borrowed bytes (see [`Buffer::alias`]): read-only, never freed.
    alias: bool,
    pool: Option<Arc<PoolInner>>,
}

// SAFETY: a Buffer owns its allocation exclusively (see Invariants); moving it to another
// thread moves that ownership. An alias only reads bytes that nobody writes while it lives
// (the contract of `Buffer::alias`), from whichever thread.
unsafe impl Send for Buffer {}
// SAFETY: shared references only allow reads of the bytes.
unsafe impl Sync for Buffer {}

impl std::fmt::Debug for Buffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Buffer")
            .field("len", &self.len)
            .field("cap", &self.cap)
            .finish()
    }
}

impl Buffer {
    /// A new buffer of `len` zero bytes, not pooled.
    pub fn new(len: usize) -> Self {
        let cap = len.max(1).next_multiple_of(BUF_ALIGN);
        let layout = Layout::from_size_align(cap, BUF_ALIGN).expect("buffer layout");
        // SAFETY: `layout` has non-zero size.
        let p = unsafe { alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(p) else {
            std::alloc::handle_alloc_error(layout);
        };
        Self {
            ptr,
            len,
            cap,
            mapped: false,
            alias: false,
            pool: None,
        }
    }

    /// A new buffer of `len` zero bytes whose memory is committed only as it is written: an
    /// anonymous mapping, whose pages the kernel provides (zeroed) on first touch. For buffers
    /// that may wait long, partly filled, for data from a network peer: a stalled peer costs
    /// only the pages it sent. Creating and dropping one costs system calls and page faults,
    /// so keep them in a [`BufferPool::new_mapped`] pool.
    pub fn new_mapped(len: usize) -> Self {
        let cap = len.max(1).next_multiple_of(BUF_ALIGN);
        // SAFETY: an anonymous private mapping of `cap` bytes; no file, no fixed address. The
        // result is checked against MAP_FAILED before use.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                cap,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        let ptr = if p == libc::MAP_FAILED {
            None
        } else {
            NonNull::new(p.cast::<u8>())
        };
        let Some(ptr) = ptr else {
            // Out of address space or mappings: fall back to the heap.
            return Self::new(len);
        };
        Self {
            ptr,
            len,
            cap,
            mapped: true,
            alias: false,
            pool: None,
        }
    }

    /// A read-only alias of this buffer's bytes (its length included): a buffer that reads
    /// them without owning them, for a bio that only reads its buffer (a write). Dropping it
    /// frees nothing; [`Buffer::as_mut_slice`] on it is empty. Allocates nothing.
    ///
    /// # Safety
    ///
    /// Until the alias (and every alias made from it) is dropped, `self` is neither dropped
    /// nor written (no `as_mut_slice`, no `set_len` beyond what readers expect): the caller
    /// keeps `self` where nothing else reaches it, and takes it back only after the last
    /// alias is gone. A mirror keeps the caller's bio in its per-I/O slot and gives it back
    /// once every leg that was lent an alias has completed its bio (`raid1::lend`).
    pub unsafe fn alias(&self) -> Buffer {
        Buffer {
            ptr: self.ptr,
            len: self.len,
            cap: self.cap,
            mapped: self.mapped,
            alias: true,
            pool: None,
        }
    }

    /// Whether this is an alias of another buffer's bytes ([`Buffer::alias`]).
    #[inline]
    pub fn is_alias(&self) -> bool {
        self.alias
    }

    /// Length in bytes.
    #[inline]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer is empty.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Capacity in bytes.
    #[inline]
    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// Sets the length (at most the capacity; clamped).
    #[inline]
    pub fn set_len(&mut self, len: usize) {
        self.len = len.min(self.cap);
    }

    /// The bytes.
    #[inline]
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` is valid for `cap >= len` initialised bytes (zeroed at allocation),
        // owned by `self` (Invariants).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The bytes, mutably; empty for an alias ([`Buffer::alias`]), whose bytes other aliases
    /// may be reading (only a read fills its buffer, and reads are never lent aliases).
    #[inline]
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        if self.alias {
            return &mut [];
        }
        // SAFETY: as in `as_slice`, and `&mut self` makes the access exclusive: an owner is
        // not written while aliases of it live (the contract of `alias`), and this is not one.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        if self.alias {
            return; // borrowed bytes: the owner frees them
        }
        if let Some(pool) = self.pool.take() {
            let mut free = pool.free.lock();
            if free.len() < pool.max_free && self.cap == pool.buf_size {
                free.push(Buffer {
                    ptr: self.ptr,
                    len: 0,
                    cap: self.cap,
                    mapped: self.mapped,
                    alias: false,
                    pool: None,
                });
                return;
            }
        }
        if self.mapped {
            // SAFETY: `ptr`/`cap` is the mapping made in `new_mapped`, owned by us and no
            // longer referenced (we are being dropped).
            unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.cap) };
            return;
        }
        let layout = Layout::from_size_align(self.cap, BUF_ALIGN).expect("buffer layout");
        // SAFETY: allocated in `Buffer::new` with this exact layout, and owned by us.
        unsafe { dealloc(self.ptr.as_ptr(), layout) };
    }
}

#[derive(Debug)]
struct PoolInner {
    buf_size: usize,
    max_free: usize,
    /// New buffers are [`Buffer::new_mapped`].
    mapped: bool,
    free: Mutex<Vec<Buffer>>,
}

/// A pool of equal-sized aligned buffers: after warm-up, taking and returning a buffer
/// allocates nothing.
#[derive(Debug, Clone)]
pub struct BufferPool {
    inner: Arc<PoolInner>,
}

impl BufferPool {
    /// A pool of buffers of `buf_size` bytes, `prealloc` of them made now, keeping at most
    /// `max_free` when they come back.
    pub fn new(buf_size: usize, prealloc: usize, max_free: usize) -> Self {
        Self::build(buf_size, prealloc, max_free, false)
    }

    /// Like [`BufferPool::new`], with buffers whose memory is committed only as it is written
    /// ([`Buffer::new_mapped`]; a buffer back from use keeps the pages it touched).
    pub fn new_mapped(buf_size: usize, prealloc: usize, max_free: usize) -> Self {
        Self::build(buf_size, prealloc, max_free, true)
    }

    fn build(buf_size: usize, prealloc: usize, max_free: usize, mapped: bool) -> Self {
        let buf_size = buf_size.max(1).next_multiple_of(BUF_ALIGN);
        let make = |n| {
            if mapped {
                Buffer::new_mapped(n)
            } else {
                Buffer::new(n)
            }
        };
        let free = (0..prealloc).map(|_| make(buf_size)).collect();
        Self {
            inner: Arc::new(PoolInner {
                buf_size,
                max_free: max_free.max(prealloc),
                mapped,
                free: Mutex::new(free),
            }),
        }
    }

    /// Size of each buffer.
    pub fn buf_size(&self) -> usize {
        self.inner.buf_size
    }

    /// Takes a buffer of `len` bytes (at most the pool's size) from the pool, or allocates
    /// one if the pool is empty. Its content is whatever the last user left.
    pub fn get(&self, len: usize) -> Option<Buffer> {
        if len > self.inner.buf_size {
            return None;
        }
        let mut b = self.inner.free.lock().pop().unwrap_or_else(|| {
            if self.inner.mapped {
                Buffer::new_mapped(self.inner.buf_size)
            } else {
                Buffer::new(self.inner.buf_size)
            }
        });
        b.len = len;
        b.pool = Some(self.inner.clone());
        Some(b)
    }

    /// Buffers currently free in the pool.
    pub fn free_count(&self) -> usize {
        self.inner.free.lock().len()
    }
}

#[cfg(all(test, not(blkq_loom)))]
mod tests {
    use super::*;

    #[test]
    fn pool_recycles_without_allocating() {
        let pool = BufferPool::new(4096, 2, 2);
        let mut a = pool.get(100).unwrap();
        a.as_mut_slice()[0] = 7;
        let pa = a.as_slice().as_ptr();
        drop(a);
        assert_eq!(pool.free_count(), 2);
        let b = pool.get(4096).unwrap();
        let c = pool.get(1).unwrap();
        assert!(b.as_slice().as_ptr() == pa || c.as_slice().as_ptr() == pa);
        assert!(pool.get(4097).is_none());
        assert_eq!(b.as_slice().as_ptr() as usize % BUF_ALIGN, 0);
    }

    #[test]
    fn mapped_buffers_are_zeroed_aligned_and_recycled() {
        let mut a = Buffer::new_mapped(1 << 20);
        assert_eq!(a.len(), 1 << 20);
        assert!(a.as_slice().iter().all(|&b| b == 0));
        a.as_mut_slice()[12345] = 9;
        drop(a);
        let pool = BufferPool::new_mapped(256 << 10, 0, 1);
        let mut b = pool.get(1000).unwrap();
        assert_eq!(b.as_slice().as_ptr() as usize % BUF_ALIGN, 0);
        b.as_mut_slice()[999] = 1;
        let pb = b.as_slice().as_ptr();
        drop(b);
        let c = pool.get(256 << 10).unwrap();
        assert_eq!(c.as_slice().as_ptr(), pb);
        assert_eq!(c.as_slice()[999], 1, "a pooled buffer keeps its content");
        let d = pool.get(10).unwrap();
        drop((c, d));
        assert_eq!(pool.free_count(), 1);
    }

    #[test]
    fn an_alias_reads_the_owners_bytes_and_frees_nothing() {
        let pool = BufferPool::new(4096, 1, 1);
        let mut owner = pool.get(512).unwrap();
        owner.as_mut_slice().fill(0x5A);
        // SAFETY: `owner` is neither written nor dropped until both aliases are.
        let (mut a, b) = unsafe { (owner.alias(), owner.alias()) };
        assert!(a.is_alias() && !owner.is_alias());
        assert_eq!(a.as_slice().as_ptr(), owner.as_slice().as_ptr());
        assert_eq!(b.as_slice(), owner.as_slice());
        assert!(a.as_mut_slice().is_empty(), "an alias is read-only");
        drop((a, b));
        assert_eq!(
            pool.free_count(),
            0,
            "dropping aliases returns nothing to the pool"
        );
        assert!(owner.as_slice().iter().all(|&x| x == 0x5A));
        drop(owner);
        assert_eq!(pool.free_count(), 1);
    }
}
