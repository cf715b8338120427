//! The `file` driver's store: a regular file or a block device.
//!
//! - **I/O** is `pread`/`pwrite` in loops that resume after short transfers and `EINTR`
//!   (descriptor-level, in `fd_io.rs`, shared with the asynchronous engines).
//! - **O_DIRECT**: with [`FileOptions::direct`] a second descriptor is opened with `O_DIRECT`
//!   (when the file system accepts it) and used only when the offset, the length and the
//!   buffer address are all multiples of [`DIRECT_ALIGN`]; everything else goes through the
//!   buffered descriptor. The kernel keeps the two coherent (a direct transfer writes back and
//!   invalidates the page cache over its range). If a direct transfer fails with `EINVAL` (a
//!   file system that opens but cannot do it), direct I/O is switched off and the transfer
//!   retried buffered.
//! - **FUA**: `pwritev2(.., RWF_DSYNC)`, which makes just that write durable (a FUA write or a
//!   write plus cache flush at the device); where the kernel refuses the flag (`EOPNOTSUPP`,
//!   `ENOSYS`: before Linux 4.7) it is remembered and the write is followed by `fdatasync`.
//! - **flush**: `fdatasync`.
//! - **FUA discard and write-zeroes**: the operation below, then `fdatasync` (a flush) before
//!   it completes ([`super::exec::exec_on_backend`]): `fallocate` has no `RWF_DSYNC`.
//! - **discard**: `fallocate(PUNCH_HOLE | KEEP_SIZE)`, falling back to writing zeros.
//! - **write_zeroes**: `fallocate(ZERO_RANGE | KEEP_SIZE)`; where unsupported (tmpfs), with
//!   `may_unmap` `PUNCH_HOLE`, without it `PUNCH_HOLE` then a plain `fallocate` to allocate
//!   the range again; last, writing zeros.
//! - **block devices**: size from `BLKGETSIZE64`; discard is `fallocate(PUNCH_HOLE)` (the
//!   kernel turns it into a write-zeroes-with-unmap, which reads back as zeros), falling back
//!   to `ZERO_RANGE` and then to `BLKZEROOUT`/writing zeros. `BLKDISCARD` is *not* used: a
//!   discarded range of a device may read back as anything, and [`Backend::discard`] promises
//!   zeros. Unaligned edges (to the logical block size) are written as zeros.
//! - **extents**: `lseek(SEEK_DATA / SEEK_HOLE)`; a file system or device without it reports
//!   everything allocated. The last data run found is remembered ([`KnownData`]): a query that
//!   lies inside it is answered without a system call. `SEEK_HOLE` costs what the file system
//!   makes it cost: on tmpfs it walks the page cache to the next hole, which in a fully
//!   written 1 GiB image is the end of the file, 256 Ki pages, about 2 ms per call; every
//!   structured read asks for its extents (sparse reads), so without this memory a 4 KiB read
//!   cost two such walks (224 IOPS at queue depth 1 from a 256 MiB image, measured).
//! - **inline I/O** (for the asynchronous engines, [`crate::file`]): a file on a memory file
//!   system (tmpfs, ramfs: [`FileBackend::is_memory_backed`]) never waits on a device, so its
//!   requests are run on the submitter's thread; elsewhere a read is first tried with
//!   `preadv2(RWF_NOWAIT)` ([`FileBackend::read_nowait`]), which copies from the page cache or
//!   refuses at once.
//! - **locking**: at open the file is locked with `flock(2)`, `LOCK_EX` (`LOCK_SH` when
//!   read-only) and `LOCK_NB`, so that a second server, a raid tool or a second device of the
//!   same process (each open is its own open file description) cannot open it for writing
//!   meanwhile and corrupt it: such an open fails at once with an error naming the file and,
//!   when `/proc/locks` shows it, the pid of the holder. Read-only opens share the file.
//!   The lock lives as long as a descriptor of this open does (the engines' duplicates
//!   included). It is advisory: only programs that take it are kept out.
//!   [`FileOptions::no_lock`] (spec option `lock=off`) skips it; on a file system that cannot
//!   lock (`ENOLCK`, `EOPNOTSUPP`) the file is opened unlocked.

use std::fs::OpenOptions;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use blkq_sync::atomic::{AtomicBool, AtomicU32, Ordering};
use blkq_sync::Mutex;

pub use crate::fd_io::DIRECT_ALIGN;
use crate::fd_io::{cvt, fallocate, to_off, unsupported, FileIo};

use super::extents::ExtentBuilder;
use super::host::{
    blk_logical_block_size, blk_size, blk_write_zeroes_supported, lock, on_memory_fs, HeldLock,
};
use super::splice_in::PipePool;
use super::store::{check_range, Backend};
use blk::error::with_context;
use blk::{Caps, Extent, RecvSource};

/// How to open a [`FileBackend`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FileOptions {
    /// Open read-only; writes, discards and zeroing fail with `EROFS`.
    pub read_only: bool,
    /// Also open an `O_DIRECT` descriptor (if the file system allows it) for aligned I/O.
    pub direct: bool,
    /// Create the file if it does not exist, and extend a regular file shorter than this (as
    /// a hole, never shrinking it). Not allowed with `read_only`.
    pub create_size: Option<u64>,
    /// Do not take the `flock(2)` lock at open (see the module docs).
    pub no_lock: bool,
}

/// What the path is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Regular,
    BlockDevice {
        /// Logical block size: the alignment `fallocate` needs on a device.
        lbs: u64,
    },
}

/// A [`Backend`] over a regular file or a block device. See the [module docs](self).
pub struct FileBackend {
    path: PathBuf,
    io: FileIo,
    size: u64,
    read_only: bool,
    kind: Kind,
    /// `fallocate(PUNCH_HOLE)` works (probed at open; cleared on `EOPNOTSUPP`).
    punch_ok: AtomicBool,
    /// `fallocate(ZERO_RANGE)` works (cleared on `EOPNOTSUPP`).
    zero_range_ok: AtomicBool,
    /// `fallocate` mode 0 (allocate) works (cleared on `EOPNOTSUPP`).
    alloc_ok: AtomicBool,
    /// `lseek(SEEK_DATA)` works (cleared on `EINVAL`).
    seek_data_ok: AtomicBool,
    /// Block devices: the device zeroes without writing (from sysfs).
    device_fast_zero: bool,
    /// The last data run `extents` found (see [`KnownData`]).
    known_data: Mutex<KnownData>,
    /// Pipes of writes received into the page cache ([`Backend::recv_at`]).
    pipes: PipePool,
    /// A regular file on tmpfs or ramfs, opened without `O_DIRECT`: its I/O is memory copies.
    memory_backed: bool,
    /// `preadv2(RWF_NOWAIT)` is worth trying (cleared when the file system refuses the flag).
    nowait_ok: AtomicBool,
    /// `RWF_NOWAIT` reads that would have blocked in a row (saturating at [`NOWAIT_SKIP_FROM`]),
    /// and reads not tried since; see [`FileBackend::read_nowait`]. A heuristic: `Relaxed`
    /// loads and stores, nothing is published through them, a lost update only changes which
    /// read is tried next.
    nowait_misses: AtomicU32,
    nowait_skipped: AtomicU32,
    /// This process's record of the `flock` taken at open (for error messages only).
    _held_lock: Option<HeldLock>,
}

/// After this many `RWF_NOWAIT` misses in a row (reads that had to go to the disk), only one
/// read in [`NOWAIT_RETRY_EVERY`] is tried inline, so a cold cache costs at most a few percent
/// extra system calls.
const NOWAIT_SKIP_FROM: u32 = 8;
const NOWAIT_RETRY_EVERY: u32 = 32;

/// The last data run `lseek(SEEK_DATA / SEEK_HOLE)` reported: `[start, end)` held data then.
///
/// Writes only ever turn holes into data, so the run stays data until a discard or zeroing
/// punches a hole; those bump `epoch` before and after they touch the file and forget the run
/// ([`FileBackend::forget_known_data`]). `extents` reads the epoch before it seeks and records
/// what it found only if the epoch is still the same, so a run observed while a punch was in
/// progress is never recorded. Even a stale run would be harmless: it can only make a hole
/// look like data, which `base:allocation` allows (a clear `HOLE` flag means "allocated or
/// unknown") and which a read answers with the bytes themselves, zeros. Another process
/// writing the file (only with `lock=off`) can likewise only turn holes into data, or punch
/// holes this cache does not see: reported as data, still correct.
#[derive(Debug, Default, Clone, Copy)]
struct KnownData {
    start: u64,
    end: u64,
    epoch: u64,
}

impl std::fmt::Debug for FileBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileBackend")
            .field("path", &self.path)
            .field("size", &self.size)
            .field("read_only", &self.read_only)
            .field("direct", &self.is_direct())
            .field("kind", &self.kind)
            .field("fast_zero", &self.fast_zero())
            .finish()
    }
}

// BLKZEROOUT is _IO(0x12, 127).
const BLKZEROOUT: libc::Ioctl = libc::_IO(0x12, 127);

fn erofs(what: &str, path: &Path) -> io::Error {
    with_context(
        io::Error::from_raw_os_error(libc::EROFS),
        format!("{what} {}: opened read-only", path.display()),
    )
}

impl FileBackend {
    /// Opens `path` (a regular file or a block device) as a backend.
    pub fn open(path: impl AsRef<Path>, options: FileOptions) -> io::Result<FileBackend> {
        let path = path.as_ref().to_path_buf();
        let shown = path.display().to_string();
        if options.read_only && options.create_size.is_some() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("open {shown}: create_size with read_only"),
            ));
        }
        let mut oo = OpenOptions::new();
        oo.read(true)
            .write(!options.read_only)
            .create(options.create_size.is_some());
        let buffered = oo
            .open(&path)
            .map_err(|e| with_context(e, format!("open {shown}")))?;
        let meta = buffered
            .metadata()
            .map_err(|e| with_context(e, format!("stat {shown}")))?;
        let held_lock = if options.no_lock {
            None
        } else {
            lock(&buffered, &meta, options.read_only, &shown)?
        };
        let ft = meta.file_type();
        let (kind, size, device_fast_zero) = if ft.is_block_device() {
            let fd = buffered.as_raw_fd();
            let size =
                blk_size(fd).map_err(|e| with_context(e, format!("BLKGETSIZE64 {shown}")))?;
            let lbs = blk_logical_block_size(fd);
            (
                Kind::BlockDevice { lbs },
                size,
                blk_write_zeroes_supported(meta.rdev()),
            )
        } else if ft.is_file() {
            let mut size = meta.len();
            if let Some(want) = options.create_size {
                if size < want {
                    buffered
                        .set_len(want)
                        .map_err(|e| with_context(e, format!("extend {shown} to {want}")))?;
                    size = want;
                }
            }
            (Kind::Regular, size, false)
        } else {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("open {shown}: neither a regular file nor a block device"),
            ));
        };
        let direct = if options.direct {
            let mut od = OpenOptions::new();
            od.read(true)
                .write(!options.read_only)
                .custom_flags(libc::O_DIRECT);
            // A file system without O_DIRECT refuses the open (EINVAL): stay buffered.
            od.open(&path).ok()
        } else {
            None
        };
        let fd = buffered.as_raw_fd();
        // Probe hole punching where it changes nothing: past the end of a regular file.
        let punch_ok = !options.read_only
            && match kind {
                Kind::Regular => fallocate(
                    fd,
                    libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                    size.max(1).next_multiple_of(DIRECT_ALIGN as u64),
                    DIRECT_ALIGN as u64,
                )
                .is_ok(),
                Kind::BlockDevice { .. } => true,
            };
        Ok(FileBackend {
            path,
            io: FileIo {
                buffered,
                direct,
                direct_ok: AtomicBool::new(true),
                dsync_ok: AtomicBool::new(true),
            },
            size,
            read_only: options.read_only,
            kind,
            punch_ok: AtomicBool::new(punch_ok),
            zero_range_ok: AtomicBool::new(!options.read_only),
            alloc_ok: AtomicBool::new(!options.read_only),
            seek_data_ok: AtomicBool::new(kind == Kind::Regular),
            device_fast_zero,
            known_data: Mutex::new(KnownData::default()),
            pipes: PipePool::default(),
            memory_backed: kind == Kind::Regular && !options.direct && on_memory_fs(fd),
            nowait_ok: AtomicBool::new(true),
            nowait_misses: AtomicU32::new(0),
            nowait_skipped: AtomicU32::new(0),
            _held_lock: held_lock,
        })
    }

    /// A regular file on a memory file system (tmpfs, ramfs), opened without `O_DIRECT`: a
    /// transfer is a copy to or from memory and never waits on a device (short of swap), so
    /// an asynchronous engine gains nothing and costs a thread hand-off per request.
    pub fn is_memory_backed(&self) -> bool {
        self.memory_backed
    }

    /// Tries to read all of `buf` at `offset` from the page cache without blocking, with one
    /// `preadv2(.., RWF_NOWAIT)` on the buffered descriptor: `Some(Ok(()))` when it did,
    /// `Some(Err(_))` on a real error, `None` when the read must go to the engine (it would
    /// have blocked, came short, or the file system does not take the flag: then it is never
    /// tried again). After [`NOWAIT_SKIP_FROM`] misses in a row only one read in
    /// [`NOWAIT_RETRY_EVERY`] is tried, until one succeeds again.
    pub fn read_nowait(&self, offset: u64, buf: &mut [u8]) -> Option<io::Result<()>> {
        if !self.nowait_ok.load(Ordering::Relaxed) || buf.is_empty() {
            return None;
        }
        if self.io.direct.is_some() && self.io.direct_ok.load(Ordering::Relaxed) {
            // Aligned transfers go O_DIRECT, past the page cache: nothing to find there.
            return None;
        }
        if self.nowait_misses.load(Ordering::Relaxed) >= NOWAIT_SKIP_FROM {
            let n = self.nowait_skipped.load(Ordering::Relaxed).wrapping_add(1);
            self.nowait_skipped.store(n, Ordering::Relaxed);
            if !n.is_multiple_of(NOWAIT_RETRY_EVERY) {
                return None;
            }
        }
        if check_range("read", offset, buf.len() as u64, self.size).is_err() {
            return None; // the engine reports it
        }
        let off = to_off(offset).ok()?;
        let iov = libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        };
        // SAFETY: `iov` describes `buf`, live and writable for the whole call.
        let r = cvt(unsafe {
            libc::preadv2(self.io.buffered.as_raw_fd(), &iov, 1, off, libc::RWF_NOWAIT)
        });
        match r {
            Ok(n) if n == buf.len() => {
                self.nowait_misses.store(0, Ordering::Relaxed);
                Some(Ok(()))
            }
            Ok(_) => {
                self.note_nowait_miss();
                None
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                self.note_nowait_miss();
                None
            }
            Err(e) if unsupported(&e) || e.raw_os_error() == Some(libc::EINVAL) => {
                self.nowait_ok.store(false, Ordering::Relaxed);
                None
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => None,
            Err(e) => Some(Err(self.ctx(e, "read", offset, buf.len() as u64))),
        }
    }

    fn note_nowait_miss(&self) {
        let m = self.nowait_misses.load(Ordering::Relaxed);
        if m < NOWAIT_SKIP_FROM {
            self.nowait_misses.store(m + 1, Ordering::Relaxed);
        }
    }

    /// Forgets the known data run, before and after a range may become a hole
    /// ([`KnownData`]).
    fn forget_known_data(&self) {
        let mut k = self.known_data.lock();
        k.epoch = k.epoch.wrapping_add(1);
        k.start = 0;
        k.end = 0;
    }

    /// Whether `[offset, end)` lies in the known data run; else the epoch to record under.
    fn known_data_covers(&self, offset: u64, end: u64) -> Result<(), u64> {
        let k = self.known_data.lock();
        if k.start <= offset && end <= k.end && k.start < k.end {
            Ok(())
        } else {
            Err(k.epoch)
        }
    }

    /// Records `[start, end)` as the known data run if no punch started since `epoch`.
    fn remember_data(&self, start: u64, end: u64, epoch: u64) {
        let mut k = self.known_data.lock();
        if k.epoch == epoch && start < end {
            k.start = start;
            k.end = end;
        }
    }

    /// The path it was opened with.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether aligned I/O goes through an `O_DIRECT` descriptor (requested, accepted by the
    /// file system, and not switched off after an `EINVAL`).
    pub fn is_direct(&self) -> bool {
        self.io.direct.is_some() && self.io.direct_ok.load(Ordering::Relaxed)
    }

    /// Whether the path is a block device.
    pub fn is_block_device(&self) -> bool {
        matches!(self.kind, Kind::BlockDevice { .. })
    }

    /// Whether it was opened read-only.
    pub fn is_read_only(&self) -> bool {
        self.read_only
    }

    /// Duplicated descriptors of this file for an asynchronous engine
    /// ([`crate::engine::FileEngine`]), which then does not borrow the backend.
    pub fn engine_files(&self) -> io::Result<crate::engine::EngineFiles> {
        let io = self
            .io
            .try_clone()
            .map_err(|e| with_context(e, format!("dup {}", self.path.display())))?;
        Ok(crate::engine::EngineFiles::from_io(io))
    }

    fn ctx(&self, e: io::Error, what: &str, offset: u64, len: u64) -> io::Error {
        with_context(
            e,
            format!("{what} {} at {offset}+{len}", self.path.display()),
        )
    }

    fn writable(&self, what: &str) -> io::Result<()> {
        if self.read_only {
            Err(erofs(what, &self.path))
        } else {
            Ok(())
        }
    }

    /// Tries `fallocate(mode)`; `Ok(false)` (and remembers it in `flag`) when unsupported.
    fn try_fallocate(
        &self,
        flag: &AtomicBool,
        mode: libc::c_int,
        offset: u64,
        len: u64,
    ) -> io::Result<bool> {
        if !flag.load(Ordering::Relaxed) {
            return Ok(false);
        }
        match fallocate(self.io.buffered.as_raw_fd(), mode, offset, len) {
            Ok(()) => Ok(true),
            Err(e) if unsupported(&e) => {
                flag.store(false, Ordering::Relaxed);
                Ok(false)
            }
            Err(e) => Err(self.ctx(e, "fallocate", offset, len)),
        }
    }

    /// Zeroes by writing zeros (the last resort).
    fn write_zero_bytes(&self, offset: u64, len: u64) -> io::Result<()> {
        const CHUNK: u64 = 1 << 20;
        let zeros = vec![0u8; len.min(CHUNK) as usize];
        let mut pos = offset;
        let end = offset + len;
        while pos < end {
            let n = (end - pos).min(CHUNK) as usize;
            self.io
                .write(&zeros[..n], pos, false)
                .map_err(|e| self.ctx(e, "write zeros", pos, n as u64))?;
            pos += n as u64;
        }
        Ok(())
    }

    /// Zeroes `[offset, offset + len)` of a regular file; with `unmap` preferring holes.
    fn zero_file(&self, offset: u64, len: u64, unmap: bool) -> io::Result<()> {
        const KEEP: libc::c_int = libc::FALLOC_FL_KEEP_SIZE;
        const PUNCH: libc::c_int = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
        const ZERO: libc::c_int = libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE;
        if unmap {
            if self.try_fallocate(&self.punch_ok, PUNCH, offset, len)? {
                return Ok(());
            }
        } else {
            if self.try_fallocate(&self.zero_range_ok, ZERO, offset, len)? {
                return Ok(());
            }
            // tmpfs has no ZERO_RANGE: punch, then allocate the range again.
            // (If the allocation fails the range is zeroed but a hole; writing zeros below
            // allocates it again.)
            if self.try_fallocate(&self.punch_ok, PUNCH, offset, len)?
                && self.try_fallocate(&self.alloc_ok, KEEP, offset, len)?
            {
                return Ok(());
            }
        }
        self.write_zero_bytes(offset, len)
    }

    /// Zeroes `[offset, offset + len)` of a block device; with `unmap` allowing the device
    /// to deallocate. Edges not aligned to the logical block size are written.
    fn zero_device(&self, lbs: u64, offset: u64, len: u64, unmap: bool) -> io::Result<()> {
        let end = offset + len;
        let a_start = offset.next_multiple_of(lbs);
        let a_end = end / lbs * lbs;
        if a_start >= a_end {
            return self.write_zero_bytes(offset, len);
        }
        if a_start > offset {
            self.write_zero_bytes(offset, a_start - offset)?;
        }
        if end > a_end {
            self.write_zero_bytes(a_end, end - a_end)?;
        }
        let (off, n) = (a_start, a_end - a_start);
        const PUNCH: libc::c_int = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
        const ZERO: libc::c_int = libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE;
        if unmap && self.try_fallocate(&self.punch_ok, PUNCH, off, n)? {
            return Ok(());
        }
        if self.try_fallocate(&self.zero_range_ok, ZERO, off, n)? {
            return Ok(());
        }
        // Before Linux 4.9 block devices have no fallocate: BLKZEROOUT.
        let range: [u64; 2] = [off, n];
        // SAFETY: BLKZEROOUT reads two u64s (start, length) through the pointer, which is
        // valid and aligned for the call.
        let r = unsafe { libc::ioctl(self.io.buffered.as_raw_fd(), BLKZEROOUT, range.as_ptr()) };
        if r == 0 {
            return Ok(());
        }
        self.write_zero_bytes(off, n)
    }

    fn seek(&self, offset: u64, whence: libc::c_int) -> io::Result<u64> {
        let off = to_off(offset)?;
        // SAFETY: lseek takes a descriptor and integers, no memory. It moves the shared file
        // position, which nothing here uses (all transfers are positional).
        let r = unsafe { libc::lseek(self.io.buffered.as_raw_fd(), off, whence) };
        if r < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(r as u64)
        }
    }
}

impl Backend for FileBackend {
    fn size(&self) -> u64 {
        self.size
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        check_range("read", offset, buf.len() as u64, self.size)?;
        let len = buf.len() as u64;
        self.io
            .read(buf, offset)
            .map_err(|e| self.ctx(e, "read", offset, len))
    }

    fn write_at(&self, offset: u64, buf: &[u8], fua: bool) -> io::Result<()> {
        self.writable("write")?;
        check_range("write", offset, buf.len() as u64, self.size)?;
        self.io
            .write(buf, offset, fua)
            .map_err(|e| self.ctx(e, "write", offset, buf.len() as u64))
    }

    fn flush(&self) -> io::Result<()> {
        if self.read_only {
            return Ok(());
        }
        self.io
            .sync()
            .map_err(|e| with_context(e, format!("fdatasync {}", self.path.display())))
    }

    fn zero(&self, what: &str, offset: u64, len: u64, unmap: bool) -> io::Result<()> {
        self.writable(what)?;
        check_range(what, offset, len, self.size)?;
        if len == 0 {
            return Ok(());
        }
        // The range may become a hole: forget the known data run before and after.
        self.forget_known_data();
        let res = match self.kind {
            Kind::Regular => self.zero_file(offset, len, unmap),
            Kind::BlockDevice { lbs } => self.zero_device(lbs, offset, len, unmap),
        };
        self.forget_known_data();
        res
    }

    fn extents_into(
        &self,
        offset: u64,
        len: u64,
        max_extents: usize,
        out: &mut Vec<Extent>,
    ) -> io::Result<()> {
        check_range("extents", offset, len, self.size)?;
        let end = offset + len;
        let mut b = ExtentBuilder::new(out, offset, end, max_extents);
        if len == 0 || max_extents == 0 {
            return Ok(());
        }
        let epoch = match self.known_data_covers(offset, end) {
            Ok(()) => {
                b.add(offset, end, true);
                return Ok(());
            }
            Err(epoch) => epoch,
        };
        let mut pos = offset;
        while pos < end {
            if !self.seek_data_ok.load(Ordering::Relaxed) {
                b.add(pos, end, true);
                break;
            }
            let data = match self.seek(pos, libc::SEEK_DATA) {
                Ok(d) => d,
                // No data at or after `pos` (also: the file shrank under us).
                Err(e) if e.raw_os_error() == Some(libc::ENXIO) => end,
                Err(e) if matches!(e.raw_os_error(), Some(libc::EINVAL)) || unsupported(&e) => {
                    self.seek_data_ok.store(false, Ordering::Relaxed);
                    continue;
                }
                Err(e) => return Err(self.ctx(e, "lseek(SEEK_DATA)", pos, end - pos)),
            };
            if data > pos && !b.add(pos, data, false) {
                break;
            }
            if data >= end {
                break;
            }
            let hole = match self.seek(data, libc::SEEK_HOLE) {
                Ok(h) if h > data => h,
                Ok(_) => end,
                Err(e) if e.raw_os_error() == Some(libc::ENXIO) => end,
                Err(e) => return Err(self.ctx(e, "lseek(SEEK_HOLE)", data, end - data)),
            };
            self.remember_data(data, hole, epoch);
            if !b.add(data, hole, true) {
                break;
            }
            pos = hole;
        }
        Ok(())
    }

    /// Buffered files and block devices: `splice(2)` from the page cache. Not with
    /// `direct=1` (its point is to keep the data out of the page cache).
    fn caps(&self) -> Caps {
        Caps {
            splice: !self.is_direct(),
            recv_home: !self.is_direct() && !self.read_only,
            ..Caps::default()
        }
    }

    /// `splice(2)` from the socket through a pipe into the page cache (`splice_in.rs`).
    fn recv_at(&self, offset: u64, len: usize, src: &mut dyn RecvSource) -> io::Result<()> {
        check_range("receive", offset, len as u64, self.size)?;
        if self.read_only {
            return Err(io::ErrorKind::PermissionDenied.into());
        }
        self.pipes
            .recv_into(self.io.buffered.as_fd(), offset, len, src, &|e| {
                with_context(e, format!("splice into {}", self.path.display()))
            })
    }

    fn splice_read(&self, offset: u64, len: usize, pipe: BorrowedFd<'_>) -> io::Result<usize> {
        check_range("splice", offset, len as u64, self.size)?;
        let mut off =
            i64::try_from(offset).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        loop {
            // SAFETY: splice(2) reads the offset through the pointer (a live local) and
            // takes no other pointers; both descriptors are open for the whole call.
            let n = unsafe {
                libc::splice(
                    self.io.buffered.as_raw_fd(),
                    &mut off,
                    pipe.as_raw_fd(),
                    std::ptr::null_mut(),
                    len,
                    libc::SPLICE_F_NONBLOCK,
                )
            };
            if n >= 0 {
                return Ok(n as usize);
            }
            let e = io::Error::last_os_error();
            match e.kind() {
                io::ErrorKind::Interrupted => continue,
                io::ErrorKind::WouldBlock => return Ok(0),
                _ => return Err(with_context(e, format!("splice {}", self.path.display()))),
            }
        }
    }

    fn fast_zero(&self) -> bool {
        if self.read_only {
            return false;
        }
        match self.kind {
            Kind::Regular => self.punch_ok.load(Ordering::Relaxed),
            Kind::BlockDevice { .. } => self.device_fast_zero,
        }
    }
}
