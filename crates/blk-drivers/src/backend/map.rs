//! The `mem` driver's default store: the device as one reserved anonymous mapping.
//!
//! [`MapBackend`] maps the whole device once, `mmap(PROT_READ | PROT_WRITE, MAP_PRIVATE |
//! MAP_ANONYMOUS | MAP_NORESERVE)`: address space is reserved, no memory is committed. The
//! kernel allocates a zeroed 4 KiB page on the first write to it, so the resident set grows
//! with the data written and with nothing else (reads of never-written pages are answered
//! with zeros from the allocation bitmap below, without touching the mapping). A read or
//! write is one copy between the mapping and the caller's buffer (a write of a page or more
//! with non-temporal stores, [`super::stream`], unless [`MapBackend::streaming`] turned them
//! off: the spec's `stream=0`); TRIM and zeroing with
//! unmap give whole pages back with `madvise(MADV_DONTNEED)` (the next read of them sees
//! zeros) and zero the partial pages at the edges in place.
//!
//! Transparent huge pages are turned off for the mapping by default (`MADV_NOHUGEPAGE`, the
//! spec's `thp=0`): with them, one written byte commits 2 MiB, so the resident set would
//! follow the data only to 2 MiB. `thp=1` ([`MapBackend::with_huge_pages`]) asks for them
//! (`MADV_HUGEPAGE`) instead: fewer TLB misses and page faults for large sequential I/O, at
//! that cost in memory. Either way the allocation map stays page-granular (it is the bitmap
//! below, not the kernel's residency), and a discard of part of a huge page splits it and
//! gives back the 4 KiB pages it covers.
//!
//! # No data races: striped region locks
//!
//! A block device lets clients issue overlapping I/O concurrently, with undefined
//! *contents*; but two threads copying the same plain bytes at once, one of them writing, is
//! a data race, which Rust makes undefined *behaviour*. So every access to the mapping is
//! made under a lock (but the kernel's, below: zero-copy reads and writes received into the
//! mapping). The device is cut into 1 MiB regions ([`REGION_SIZE`]); region `r` is
//! guarded by reader-writer lock `r % STRIPES` of a fixed table of [`STRIPES`] cache-padded
//! locks (`blkq_sync::RwLock`, so the facade's rules hold). A request is executed region by
//! region, holding one lock at a time: reads and extent queries shared, writes, zeroing and
//! `MADV_DONTNEED` exclusive (the kernel's zeroing of an unmapped page is a write as far as a
//! concurrent copy is concerned). As no thread ever holds two stripes, there is no lock order
//! and no deadlock. A request spanning regions is not atomic as a whole, which no block
//! device promises either; each byte is only ever copied under its region's lock, which is
//! what soundness needs. The cost is one uncontended reader-writer lock (an atomic
//! read-modify-write to take it and one to release it) per MiB, or per request for smaller
//! ones: what the page store paid per 4 KiB page, tens of nanoseconds next to a few hundred
//! for a cache-cold 4 KiB copy and tens of microseconds for 1 MiB (`lock_cost` in
//! `tests/backend_map.rs` prints the figures; `bench/mem.sh` runs it in release).
//!
//! # The allocation map: a bitmap, not `mincore`
//!
//! `mincore(2)` tells which pages are *resident*, which is not which pages hold data: a
//! written page that was swapped out is reported absent (mapping it as a hole would make a
//! sparse-aware client such as `qemu-img convert` skip real data), and a read fault on a
//! never-written page maps the shared zero page, which `mincore` reports present. So the
//! allocation map is a bitmap, one bit per 4 KiB page, set by writes and cleared with the
//! pages given back; it lives in a second `MAP_NORESERVE` mapping (128 MiB of address space
//! per TiB of device, committed only where data was written: a region's 256 bits are four
//! words). A region's words belong to that region alone, so the region's lock guards them
//! too, and they are plain words, not atomics. `mincore` is still used where it is the
//! right question: [`MapBackend::resident_bytes`], the memory the device holds now.
//!
//! # Zero-copy reads
//!
//! [`Backend::splice_read`] hands the device's bytes to a pipe with `vmsplice(2)`: the pipe
//! takes references to the mapping's pages (and to a static page of zeros for holes), and the
//! NBD server's writer `splice`s them into the socket, so a large read costs the kernel's one
//! copy into the socket instead of a `memcpy` into a buffer first. The references are taken
//! region by region under the region's read lock, like a read's copy. The bytes themselves
//! leave later, when the pipe is drained, and a write that lands meanwhile changes what is
//! sent: the read returns the bytes of the moment of sending. That is a block device's
//! contract for a read that overlaps a write in flight, and no other kind of write can land
//! meanwhile (the caller reports the read complete only once the pipe is drained). The
//! kernel's read of the pages is not a Rust access, so it cannot race with a locked
//! `memcpy` in the language's sense; a page given back by `MADV_DONTNEED` stays alive while
//! the pipe holds it, with its old bytes.
//!
//! # Writes received into the mapping
//!
//! [`Backend::recv_at`] takes a write's payload from a socket straight into the mapping
//! (`blk::Device::recv_home`): `recv(2)` into the region's bytes, region by region,
//! each call counted in the region's stripe as a receiver in flight ([`super::home`]) rather
//! than under the region's lock, which a receive the client paces must not hold. The receiver
//! marks the pages it filled allocated as it leaves, under the lock. The kernel's stores are
//! not Rust accesses, and every other access to the mapping is a raw-pointer copy under the
//! lock, so there is no data race; a read or write that overlaps the receive sees undefined
//! bytes, as a block device allows for requests in flight together. What must not happen is a
//! page given back or zeroed under a receive (the bytes already in it would be lost, even those
//! of a neighbouring range sharing the page), so zeroing takes [`super::home::RegionGate::quiet`]:
//! the lock exclusive once the stripe has no receiver in flight. Copying writes need not wait.
//!
//! # Limits
//!
//! The device must fit in the address space (47 bits on x86-64, less what the process
//! uses) and be allowed by the overcommit policy (`vm.overcommit_memory=2` counts even
//! `MAP_NORESERVE` mappings); otherwise [`MapBackend::new`] fails with an error, never a
//! panic. Memory written is committed and stays so until discarded: writing the whole
//! device needs its size in RAM (or swap). `MAP_NORESERVE` means nothing is counted up front,
//! so a device larger than memory that clients fill gets the process OOM-killed when memory
//! runs out, as the page store's allocations would abort it: size devices to the machine.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::ptr::NonNull;

use blk::{Caps, Extent, RecvSource};
use blkq_sync::atomic::{AtomicU64, Ordering};

use super::extents::ExtentBuilder;
use super::home::RegionGate;
use super::store::{check_range, Backend};
use super::stream;

/// Page size of the store and of the allocation map, bytes.
pub const PAGE_SIZE: usize = 4096;
const PAGE_SHIFT: u32 = 12;
const PAGE: u64 = PAGE_SIZE as u64;
/// Bytes guarded by one region lock.
pub const REGION_SIZE: u64 = 1 << REGION_SHIFT;
const REGION_SHIFT: u32 = 20;
/// Number of region locks (a power of two); region `r` uses lock `r % STRIPES`.
pub const STRIPES: usize = 256;
/// Pages `mincore` is asked about per call in [`MapBackend::resident_bytes`] (its vector
/// lives on the stack).
const MINCORE_BATCH: usize = 4096;

// A region's bits are whole bitmap words, so no word is shared between two regions.
const _: () = assert!((REGION_SIZE / PAGE).is_multiple_of(64));

/// Zeros that `vmsplice` lends for holes ("Zero-copy reads"); never written, so the pages it
/// references always read as zeros.
static ZEROS: [u8; 64 * 1024] = [0; 64 * 1024];

/// One private anonymous mapping, reserved and not committed; unmapped on drop.
struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: `Mapping` is an owned allocation, like a `Box<[u8]>`; it hands out only raw
// pointers, and `MapBackend` makes every access through them under the region lock that
// covers the bytes (see the module documentation), so sharing it between threads is sound.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Reserves `len` bytes (a non-zero multiple of the page size) of zeros, with
    /// transparent huge pages where `huge`, else without.
    fn reserve(len: usize, huge: bool) -> io::Result<Mapping> {
        debug_assert!(len > 0 && len.is_multiple_of(PAGE_SIZE));
        // SAFETY: a fresh anonymous mapping at an address of the kernel's choice (no
        // MAP_FIXED): it cannot alias any memory of the process. The arguments are plain
        // values; failure is reported as MAP_FAILED and handled below.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let Some(ptr) = NonNull::new(p.cast::<u8>()) else {
            // Only with vm.mmap_min_addr=0; a null base would make slices of it invalid.
            // SAFETY: the mapping just made, unused.
            unsafe { libc::munmap(p, len) };
            return Err(io::Error::other("mmap returned address 0"));
        };
        // Transparent huge pages or not (see the module docs). Only a hint: a kernel without
        // THP rejects it, and then there are none anyway.
        let advice = if huge {
            libc::MADV_HUGEPAGE
        } else {
            libc::MADV_NOHUGEPAGE
        };
        // SAFETY: the range is exactly the mapping just made; the advice changes no contents.
        unsafe { libc::madvise(p, len, advice) };
        Ok(Mapping { ptr, len })
    }

    #[inline]
    fn base(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: the mapping was made by `reserve` with this address and length and is
        // unmapped only here; `&mut self` means no access to it is in progress.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// A RAM store of `size` bytes over one reserved anonymous mapping; thread-safe, memory
/// committed by page on first write. See the [module documentation](self).
pub struct MapBackend {
    size: u64,
    /// The device's bytes, `size` rounded up to a page (at least one page).
    data: Mapping,
    /// The allocation bitmap: bit `p % 64` of word `p / 64` is page `p`.
    bits: Mapping,
    /// Region `r` is guarded by stripe `r % STRIPES`, which also counts the writes being
    /// received into it ("Writes received into the mapping").
    gate: RegionGate,
    /// Pages whose bit is set. A statistic: changed with `Relaxed` read-modify-writes under
    /// the region locks (which order the bitmap itself), read without; nothing is published
    /// through it, so no ordering is needed.
    allocated_pages: AtomicU64,
    /// Writes of a page or more stream past the caches ([`stream`](super::stream)); on unless
    /// [`streaming(false)`](MapBackend::streaming).
    stream: bool,
}

impl std::fmt::Debug for MapBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MapBackend")
            .field("size", &self.size)
            .field("allocated_bytes", &self.allocated_bytes())
            .finish()
    }
}

/// The mask of bits `[lo, hi)` of a word, `lo < hi <= 64`.
#[inline]
fn word_mask(lo: u64, hi: u64) -> u64 {
    let n = hi - lo;
    let ones = if n == 64 { u64::MAX } else { (1u64 << n) - 1 };
    ones << lo
}

impl MapBackend {
    /// A store of `size` bytes, all reading as zeros, with no memory committed yet and no
    /// transparent huge pages. Fails (an error naming the size) when that much address space
    /// cannot be reserved.
    pub fn new(size: u64) -> io::Result<MapBackend> {
        Self::with_huge_pages(size, false)
    }

    /// As [`new`](Self::new), with transparent huge pages for the data where `huge` (memory
    /// is then committed by 2 MiB where the kernel can; see the module docs).
    pub fn with_huge_pages(size: u64, huge: bool) -> io::Result<MapBackend> {
        let too_big = || {
            io::Error::new(
                io::ErrorKind::OutOfMemory,
                format!("mem device of {size} bytes does not fit in the address space"),
            )
        };
        let pages = size.div_ceil(PAGE).max(1);
        let data_len = pages
            .checked_mul(PAGE)
            .and_then(|l| usize::try_from(l).ok())
            .filter(|&l| l <= isize::MAX as usize)
            .ok_or_else(too_big)?;
        let words = pages.div_ceil(64);
        let bits_len = usize::try_from((words * 8).div_ceil(PAGE) * PAGE).map_err(|_| too_big())?;
        let reserve = |len: usize, what: &str, huge: bool| {
            Mapping::reserve(len, huge).map_err(|e| {
                io::Error::new(
                    e.kind(),
                    format!(
                        "cannot reserve {len} bytes of address space for a mem device's {what} \
                         (size {size}): {e}; the limits are the address space and \
                         vm.overcommit_memory"
                    ),
                )
            })
        };
        let data = reserve(data_len, "data", huge)?;
        let bits = reserve(bits_len, "allocation bitmap", false)?;
        Ok(MapBackend {
            size,
            data,
            bits,
            gate: RegionGate::new(STRIPES),
            allocated_pages: AtomicU64::new(0),
            stream: true,
        })
    }

    /// The store with writes of a page or more streamed past the caches (`true`, the
    /// default: "Streaming writes" in the module docs) or copied as ordinary stores (`false`,
    /// the spec's `stream=0`).
    pub fn streaming(self, on: bool) -> MapBackend {
        MapBackend { stream: on, ..self }
    }

    /// Bytes of data pages allocated now (whole pages, so a multiple of 4096): what the
    /// allocation map calls allocated.
    pub fn allocated_bytes(&self) -> u64 {
        self.allocated_pages.load(Ordering::Relaxed) << PAGE_SHIFT
    }

    /// Bytes of the device resident in RAM now, from `mincore(2)`: at most
    /// [`allocated_bytes`](Self::allocated_bytes) (less when pages were swapped out).
    pub fn resident_bytes(&self) -> io::Result<u64> {
        let mut vec = [0u8; MINCORE_BATCH];
        let pages = self.data.len / PAGE_SIZE;
        let mut resident = 0u64;
        let mut page = 0usize;
        while page < pages {
            let n = (pages - page).min(MINCORE_BATCH);
            // SAFETY: `[page, page + n)` are pages of the data mapping (page-aligned, inside
            // it) and `vec` has room for `n` entries; mincore reads no bytes of the mapping,
            // so no region lock is needed.
            let rc = unsafe {
                libc::mincore(
                    self.data.base().add(page * PAGE_SIZE).cast(),
                    n * PAGE_SIZE,
                    vec.as_mut_ptr().cast(),
                )
            };
            if rc != 0 {
                return Err(io::Error::last_os_error());
            }
            resident += vec[..n].iter().filter(|&&v| v & 1 != 0).count() as u64;
            page += n;
        }
        Ok(resident << PAGE_SHIFT)
    }

    /// The stripe of the region holding byte `pos`.
    #[inline]
    fn stripe(pos: u64) -> usize {
        ((pos >> REGION_SHIFT) as usize) & (STRIPES - 1)
    }

    /// Writes being received into the mapping now ([`Backend::recv_at`]), all regions: 0
    /// whenever none is in flight, including after a client that closed mid-payload.
    pub fn receivers_in_flight(&self) -> u64 {
        self.gate.writers_total()
    }

    /// Runs `f(from, to)` on each region's share of `[offset, offset + len)`, in order, while
    /// `f` returns true. `f` takes the region's lock itself.
    #[inline]
    fn for_regions(&self, offset: u64, len: u64, mut f: impl FnMut(u64, u64) -> bool) {
        let end = offset + len;
        let mut pos = offset;
        while pos < end {
            // No overflow: `pos < end <= size`, and a mapped size is below 2^63.
            let to = (((pos >> REGION_SHIFT) + 1) << REGION_SHIFT).min(end);
            if !f(pos, to) {
                return;
            }
            pos = to;
        }
    }

    /// Bitmap word `i`.
    ///
    /// # Safety
    /// The caller holds the lock of the region whose pages word `i` maps (shared to read
    /// through the pointer, exclusive to write), and `i` is a word of the bitmap.
    #[inline]
    unsafe fn word(&self, i: u64) -> *mut u64 {
        debug_assert!((i as usize) < self.bits.len / 8);
        // SAFETY: `i` is inside the bitmap mapping (the caller's promise), which is
        // page-aligned, so the word is aligned.
        unsafe { self.bits.base().cast::<u64>().add(i as usize) }
    }

    /// Page `from`'s state, and the first page in `(from, to)` whose state differs (or `to`).
    ///
    /// # Safety
    /// `from < to`, both pages of one region whose lock the caller holds (either mode).
    unsafe fn run(&self, from: u64, to: u64) -> (bool, u64) {
        // SAFETY: the caller holds the region's lock; these words are the region's.
        let first = unsafe { *self.word(from / 64) };
        let state = first & (1 << (from % 64)) != 0;
        let mut p = from;
        while p < to {
            // SAFETY: as above; `p < to` is in the region.
            let w = unsafe { *self.word(p / 64) };
            let w = if state { !w } else { w } & (u64::MAX << (p % 64));
            if w != 0 {
                return (state, ((p & !63) + u64::from(w.trailing_zeros())).min(to));
            }
            p = (p | 63) + 1;
        }
        (state, to)
    }

    /// Sets (`set`) or clears the bits of pages `[from, to)`; returns how many changed.
    ///
    /// # Safety
    /// `from <= to`, all pages of one region whose lock the caller holds exclusive.
    unsafe fn mark(&self, from: u64, to: u64, set: bool) -> u64 {
        let mut changed = 0;
        let mut p = from;
        while p < to {
            let base = p & !63;
            let hi = (to - base).min(64);
            let mask = word_mask(p - base, hi);
            // SAFETY: the caller holds the region's lock exclusive; the word is the region's.
            let w = unsafe { &mut *self.word(p / 64) };
            if set {
                changed += u64::from((!*w & mask).count_ones());
                *w |= mask;
            } else {
                changed += u64::from((*w & mask).count_ones());
                *w &= !mask;
            }
            p = base + 64;
        }
        if changed > 0 {
            if set {
                self.allocated_pages.fetch_add(changed, Ordering::Relaxed);
            } else {
                self.allocated_pages.fetch_sub(changed, Ordering::Relaxed);
            }
        }
        changed
    }

    /// Pages touched by bytes `[from, to)`, `from < to`: `[first, end)`.
    #[inline]
    fn pages(from: u64, to: u64) -> (u64, u64) {
        (from >> PAGE_SHIFT, (to - 1) / PAGE + 1)
    }

    /// Reads bytes `[from, to)` of one region into `dst` (its length `to - from`): allocated
    /// runs copied, holes zero-filled, so never-written pages are never touched.
    fn read_region(&self, from: u64, to: u64, dst: &mut [u8]) {
        let _g = self.gate.read(Self::stripe(from));
        let (first, end) = Self::pages(from, to);
        let mut p = first;
        while p < end {
            // SAFETY: pages `[p, end)` are in this region, whose lock is held shared.
            let (allocated, q) = unsafe { self.run(p, end) };
            let a = (p << PAGE_SHIFT).max(from);
            let b = (q << PAGE_SHIFT).min(to);
            let out = &mut dst[(a - from) as usize..(b - from) as usize];
            if allocated {
                // SAFETY: `[a, b)` is inside the device, hence the mapping; no writer of
                // these bytes runs (the region's lock is held shared); `out` is the caller's
                // buffer, which cannot overlap the mapping (it is ours and never handed out).
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        self.data.base().add(a as usize),
                        out.as_mut_ptr(),
                        out.len(),
                    )
                };
            } else {
                out.fill(0);
            }
            p = q;
        }
    }

    /// `vmsplice(2)`s bytes `[from, to)` of one region into `pipe`, as [`Self::read_region`]
    /// reads them: allocated runs from the mapping, holes from [`ZEROS`] (so never-written
    /// pages are still never touched). Returns the bytes moved; stops early when the pipe is
    /// full (`EAGAIN` after some bytes, or `Ok(0)` before any).
    fn splice_region(&self, from: u64, to: u64, pipe: BorrowedFd<'_>) -> io::Result<usize> {
        let _g = self.gate.read(Self::stripe(from));
        let (first, end) = Self::pages(from, to);
        let mut moved = 0usize;
        let mut p = first;
        while p < end {
            // SAFETY: pages `[p, end)` are in this region, whose lock is held shared.
            let (allocated, q) = unsafe { self.run(p, end) };
            let (a, b) = ((p << PAGE_SHIFT).max(from), (q << PAGE_SHIFT).min(to));
            let mut at = a;
            while at < b {
                let (base, n) = if allocated {
                    // SAFETY: `[at, b)` is inside the device, hence the mapping.
                    (
                        unsafe { self.data.base().add(at as usize) }.cast_const(),
                        b - at,
                    )
                } else {
                    (ZEROS.as_ptr(), (b - at).min(ZEROS.len() as u64))
                };
                let iov = libc::iovec {
                    iov_base: base.cast_mut().cast(),
                    iov_len: n as usize,
                };
                // SAFETY: one iovec over `n` readable bytes (the mapping's, which live as
                // long as `self`, or the static zeros); vmsplice only reads through it, taking
                // references to the pages (module docs, "Zero-copy reads").
                let r =
                    unsafe { libc::vmsplice(pipe.as_raw_fd(), &iov, 1, libc::SPLICE_F_NONBLOCK) };
                if r < 0 {
                    let e = io::Error::last_os_error();
                    match e.kind() {
                        io::ErrorKind::Interrupted => continue,
                        io::ErrorKind::WouldBlock => return Ok(moved),
                        _ if moved > 0 => return Ok(moved),
                        _ => return Err(e),
                    }
                }
                let r = r as u64;
                moved += r as usize;
                at += r;
                if r < n {
                    return Ok(moved);
                }
            }
            p = q;
        }
        Ok(moved)
    }

    /// Writes `src` at bytes `[from, to)` of one region.
    fn write_region(&self, from: u64, to: u64, src: &[u8]) {
        let _g = self.gate.write(Self::stripe(from));
        // SAFETY: `[from, to)` is inside the mapping; the region's lock is held exclusive, so
        // nobody else reads or writes these bytes; `src` cannot overlap the mapping.
        // The streamed copy is fenced before it returns, so the lock's release below orders
        // it for the next holder as it does an ordinary copy (`stream.rs`).
        unsafe {
            let dst = self.data.base().add(from as usize);
            if self.stream {
                stream::copy(dst, src);
            } else {
                std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len());
            }
        };
        let (first, end) = Self::pages(from, to);
        // SAFETY: the pages are this region's; its lock is held exclusive.
        unsafe { self.mark(first, end, true) };
    }

    /// Receives bytes `[from, to)` of one region from `src`'s socket straight into the
    /// mapping ("Writes received into the mapping"): each `recv` counted in flight in the
    /// region's stripe, with no lock held while it runs; the pages it filled marked
    /// allocated as it leaves.
    fn recv_region(&self, from: u64, to: u64, src: &mut dyn RecvSource) -> io::Result<()> {
        let mut at = from;
        while at < to {
            let rx = self.gate.enter(Self::stripe(from));
            let want = (to - at) as usize;
            // SAFETY: `[at, to)` is inside the device, hence the mapping, which lives as long
            // as `self`; the kernel stores at most `want` bytes there. No Rust reference to
            // these bytes exists: other threads only copy them through raw pointers under the
            // region's lock, and the kernel's stores are not Rust accesses, so there is no
            // data race; their contents are undefined only to a read or write that overlaps
            // this unacknowledged write, as a block device allows. No page of the range is
            // given back meanwhile: zeroing waits for `rx` to leave (`home.rs`).
            let r = unsafe {
                libc::recv(
                    src.fd().as_raw_fd(),
                    self.data.base().add(at as usize).cast(),
                    want,
                    // The rest of the region's share in one call where the client keeps
                    // sending: one wake-up, one enter and one leave per region rather than per
                    // burst. A timeout, a signal or the peer's close still end it early, with
                    // what came (the source sees each, as without the flag).
                    libc::MSG_WAITALL,
                )
            };
            let res = if r < 0 {
                Err(io::Error::last_os_error())
            } else {
                Ok(r as usize)
            };
            let n = res.as_ref().map_or(0, |&n| n.min(want)) as u64;
            rx.leave(|| {
                if n > 0 {
                    let (first, end) = Self::pages(at, at + n);
                    // SAFETY: the pages are this region's; `leave` runs this under its
                    // lock, exclusive.
                    unsafe { self.mark(first, end, true) };
                }
            });
            let closed = matches!(res, Ok(0));
            src.received(res)?;
            if closed {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
            at += n;
        }
        Ok(())
    }

    /// Whether page `p`'s bytes are all zeros.
    ///
    /// # Safety
    /// The caller holds `p`'s region lock (either mode).
    unsafe fn page_is_zero(&self, p: u64) -> bool {
        // SAFETY: the page is inside the mapping (which is a whole number of pages); the
        // region's lock keeps writers out while the slice lives.
        let page = unsafe {
            std::slice::from_raw_parts(self.data.base().add((p << PAGE_SHIFT) as usize), PAGE_SIZE)
        };
        page.iter().all(|&b| b == 0)
    }

    /// Gives pages `[from, to)` back to the kernel (they read as zeros afterwards) and
    /// clears their bits; nothing to do where none is allocated.
    ///
    /// # Safety
    /// All pages of one region whose lock the caller holds exclusive.
    unsafe fn free_pages(&self, from: u64, to: u64) {
        // SAFETY: the caller's promise.
        let (allocated, q) = unsafe { self.run(from, to) };
        if !allocated && q == to {
            return;
        }
        // SAFETY: `[from, to)` are whole pages of the mapping (page-aligned address and
        // length); the region's lock is held exclusive, so no copy of these bytes is in
        // progress while the kernel replaces them with zero-fill-on-demand pages.
        let base = unsafe { self.data.base().add((from << PAGE_SHIFT) as usize) };
        let len = ((to - from) << PAGE_SHIFT) as usize;
        // SAFETY: as above.
        let rc = unsafe { libc::madvise(base.cast(), len, libc::MADV_DONTNEED) };
        if rc != 0 {
            // E.g. locked pages (mlockall): zero them in place instead; still correct.
            // SAFETY: as above, exclusive access to these bytes.
            unsafe { std::ptr::write_bytes(base, 0, len) };
        }
        // SAFETY: the caller's promise.
        unsafe { self.mark(from, to, false) };
    }

    /// Zeroes bytes `[from, to)` of one region; with `unmap`, gives back the pages it covers
    /// (and partial pages left all zeros), else allocates the pages it touches.
    fn zero_region(&self, from: u64, to: u64, unmap: bool) {
        // Quiet: no receive is copying into the region while pages are zeroed or given back.
        let _g = self.gate.quiet(Self::stripe(from));
        let (first, end) = Self::pages(from, to);
        if !unmap {
            // SAFETY: `[from, to)` is inside the mapping; the region's lock is held exclusive.
            unsafe {
                std::ptr::write_bytes(self.data.base().add(from as usize), 0, (to - from) as usize)
            };
            // SAFETY: this region's pages, lock held exclusive.
            unsafe { self.mark(first, end, true) };
            return;
        }
        // A page is covered when the range holds all of it that lies inside the device.
        let covers =
            |p: u64| from <= p << PAGE_SHIFT && to >= ((p + 1) << PAGE_SHIFT).min(self.size);
        let whole_from = if covers(first) { first } else { first + 1 };
        let whole_to = if covers(end - 1) { end } else { end - 1 };
        // Partial pages at the edges (one or two; the same page when the range is inside
        // one page): zeroed in place where allocated, given back once all zeros.
        let mut edges = [None, None];
        if !covers(first) {
            edges[0] = Some(first);
        }
        if end - 1 != first && !covers(end - 1) {
            edges[1] = Some(end - 1);
        }
        for p in edges.into_iter().flatten() {
            // SAFETY: page `p` is this region's; its lock is held exclusive.
            let (allocated, _) = unsafe { self.run(p, p + 1) };
            if !allocated {
                continue;
            }
            let a = (p << PAGE_SHIFT).max(from);
            let b = ((p + 1) << PAGE_SHIFT).min(to);
            // SAFETY: `[a, b)` is inside the mapping; the lock is held exclusive.
            unsafe { std::ptr::write_bytes(self.data.base().add(a as usize), 0, (b - a) as usize) };
            // SAFETY: as above.
            if unsafe { self.page_is_zero(p) } {
                // SAFETY: as above.
                unsafe { self.free_pages(p, p + 1) };
            }
        }
        if whole_from < whole_to {
            // SAFETY: this region's pages, lock held exclusive.
            unsafe { self.free_pages(whole_from, whole_to) };
        }
    }
}

impl Backend for MapBackend {
    fn size(&self) -> u64 {
        self.size
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        check_range("mem read", offset, buf.len() as u64, self.size)?;
        self.for_regions(offset, buf.len() as u64, |from, to| {
            let dst = &mut buf[(from - offset) as usize..(to - offset) as usize];
            self.read_region(from, to, dst);
            true
        });
        Ok(())
    }

    fn write_at(&self, offset: u64, buf: &[u8], _fua: bool) -> io::Result<()> {
        check_range("mem write", offset, buf.len() as u64, self.size)?;
        self.for_regions(offset, buf.len() as u64, |from, to| {
            let src = &buf[(from - offset) as usize..(to - offset) as usize];
            self.write_region(from, to, src);
            true
        });
        Ok(())
    }

    fn caps(&self) -> Caps {
        Caps {
            splice: true,
            recv_home: true,
            ..Caps::default()
        }
    }

    fn splice_read(&self, offset: u64, len: usize, pipe: BorrowedFd<'_>) -> io::Result<usize> {
        check_range("mem splice", offset, len as u64, self.size)?;
        let mut moved = 0usize;
        let mut res = Ok(());
        self.for_regions(offset, len as u64, |from, to| {
            match self.splice_region(from, to, pipe) {
                Ok(n) => {
                    moved += n;
                    n as u64 == to - from
                }
                Err(e) => {
                    res = Err(e);
                    false
                }
            }
        });
        res.map(|()| moved)
    }

    fn recv_at(&self, offset: u64, len: usize, src: &mut dyn RecvSource) -> io::Result<()> {
        check_range("mem receive", offset, len as u64, self.size)?;
        let mut res = Ok(());
        self.for_regions(offset, len as u64, |from, to| {
            res = self.recv_region(from, to, src);
            res.is_ok()
        });
        res
    }

    fn flush(&self) -> io::Result<()> {
        Ok(())
    }

    fn zero(&self, what: &str, offset: u64, len: u64, unmap: bool) -> io::Result<()> {
        check_range(what, offset, len, self.size)?;
        self.for_regions(offset, len, |from, to| {
            self.zero_region(from, to, unmap);
            true
        });
        Ok(())
    }

    fn extents_into(
        &self,
        offset: u64,
        len: u64,
        max_extents: usize,
        out: &mut Vec<Extent>,
    ) -> io::Result<()> {
        check_range("mem extents", offset, len, self.size)?;
        if len == 0 || max_extents == 0 {
            out.clear();
            return Ok(());
        }
        let mut b = ExtentBuilder::new(out, offset, offset + len, max_extents);
        self.for_regions(offset, len, |from, to| {
            let _g = self.gate.read(Self::stripe(from));
            let (first, end) = Self::pages(from, to);
            let mut p = first;
            while p < end {
                // SAFETY: pages `[p, end)` are this region's; its lock is held shared.
                let (allocated, q) = unsafe { self.run(p, end) };
                if !b.add(p << PAGE_SHIFT, q << PAGE_SHIFT, allocated) {
                    return false;
                }
                p = q;
            }
            true
        });
        Ok(())
    }

    fn fast_zero(&self) -> bool {
        true
    }
}

#[cfg(all(test, not(blkq_loom)))]
mod tests {
    use super::*;

    #[test]
    fn word_masks() {
        assert_eq!(word_mask(0, 64), u64::MAX);
        assert_eq!(word_mask(0, 1), 1);
        assert_eq!(word_mask(3, 5), 0b11000);
        assert_eq!(word_mask(63, 64), 1 << 63);
    }

    #[test]
    fn runs_and_marks_across_words() {
        let m = MapBackend::new(REGION_SIZE).unwrap();
        let _g = m.gate.write(0);
        // SAFETY: (a test) region 0's lock is held exclusive; all pages are region 0's.
        unsafe {
            assert_eq!(m.mark(60, 130, true), 70);
            assert_eq!(m.mark(64, 70, true), 0);
            assert_eq!(m.run(0, 256), (false, 60));
            assert_eq!(m.run(60, 256), (true, 130));
            assert_eq!(m.run(61, 100), (true, 100));
            assert_eq!(m.run(130, 256), (false, 256));
            assert_eq!(m.mark(100, 101, false), 1);
            assert_eq!(m.run(64, 256), (true, 100));
            assert_eq!(m.run(100, 256), (false, 101));
        }
        assert_eq!(m.allocated_bytes(), 69 * PAGE);
    }
}
