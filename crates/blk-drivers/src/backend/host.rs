//! What the host says about an open file: its file system (tmpfs or not), a block device's
//! size, block size and write-zeroes support, and the `flock(2)` that keeps a second opener
//! out (with the holder's pid from `/proc/locks`). The file backend's probes, apart from its
//! I/O.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt};

use crate::fd_io::cvt_int;
use blk::error::with_context;

// BLKGETSIZE64 is _IOR(0x12, 114, size_t); BLKSSZGET _IO(0x12, 104).
const BLKGETSIZE64: libc::Ioctl = libc::_IOR::<usize>(0x12, 114);
const BLKSSZGET: libc::Ioctl = libc::_IO(0x12, 104);

/// Whether `fd` is on tmpfs or ramfs (`fstatfs`; false if that fails).
pub(super) fn on_memory_fs(fd: RawFd) -> bool {
    const TMPFS_MAGIC: u64 = 0x0102_1994;
    const RAMFS_MAGIC: u64 = 0x8584_58f6;
    // SAFETY: an all-zero `statfs` is a valid value of this plain C struct.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: `st` is a valid, writable `statfs` for the kernel to fill.
    if unsafe { libc::fstatfs(fd, &mut st) } != 0 {
        return false;
    }
    matches!(st.f_type as u64, TMPFS_MAGIC | RAMFS_MAGIC)
}

pub(super) fn blk_size(fd: RawFd) -> io::Result<u64> {
    let mut size: u64 = 0;
    // SAFETY: BLKGETSIZE64 writes one u64 through the pointer, which is valid and aligned.
    cvt_int(unsafe { libc::ioctl(fd, BLKGETSIZE64, &mut size as *mut u64) })?;
    Ok(size)
}

pub(super) fn blk_logical_block_size(fd: RawFd) -> u64 {
    let mut lbs: libc::c_int = 0;
    // SAFETY: BLKSSZGET writes one int through the pointer, which is valid and aligned.
    let r = unsafe { libc::ioctl(fd, BLKSSZGET, &mut lbs as *mut libc::c_int) };
    if r < 0 || lbs <= 0 {
        512
    } else {
        lbs as u64
    }
}

/// Whether the block device `rdev` advertises write-zeroes (sysfs `write_zeroes_max_bytes`).
pub(super) fn blk_write_zeroes_supported(rdev: u64) -> bool {
    let (major, minor) = (libc::major(rdev), libc::minor(rdev));
    // A partition's directory has no queue/; its parent disk's does.
    ["queue", "../queue"].iter().any(|q| {
        std::fs::read_to_string(format!(
            "/sys/dev/block/{major}:{minor}/{q}/write_zeroes_max_bytes"
        ))
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok())
        .is_some_and(|v| v > 0)
    })
}

/// Takes the open's `flock(2)` lock (module docs): shared when `read_only`, else exclusive;
/// never waits.
/// A block device is retried a few times: udev takes a short `LOCK_SH` on a device while it
/// probes it (and skips a device someone holds `LOCK_EX` on, which is what this lock is for).
pub(super) fn lock(
    file: &File,
    meta: &std::fs::Metadata,
    read_only: bool,
    shown: &str,
) -> io::Result<Option<HeldLock>> {
    let op = if read_only {
        libc::LOCK_SH
    } else {
        libc::LOCK_EX
    };
    let mut retries = if meta.file_type().is_block_device() {
        20
    } else {
        0
    };
    loop {
        // SAFETY: flock(2) takes no pointers; the descriptor is owned by `file` and open for
        // the whole call.
        let rc = unsafe { libc::flock(file.as_raw_fd(), op | libc::LOCK_NB) };
        if rc == 0 {
            return Ok(Some(HeldLock::new(meta.dev(), meta.ino())));
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EINTR) => continue,
            Some(libc::EWOULDBLOCK) if retries > 0 => {
                retries -= 1;
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
            Some(libc::EWOULDBLOCK) => {
                let ours = HeldLock::held_here(meta.dev(), meta.ino());
                let holder = match lock_holder(meta.dev(), meta.ino()) {
                    _ if ours => {
                        "this process (it is already open as another device here)".to_string()
                    }
                    Some(pid) if pid == std::process::id() => {
                        "this process (it is already open as another device here)".to_string()
                    }
                    Some(pid) => format!("another process (pid {pid}, from /proc/locks)"),
                    None => "another process (its pid is not shown in /proc/locks)".to_string(),
                };
                let how = if read_only { "shared" } else { "exclusive" };
                return Err(with_context(
                    e,
                    format!(
                        "{shown} is in use: {holder} holds a lock on it (flock), so it cannot \
                         be opened here with an {how} lock; stop the other user (a second \
                         blkq serve, a raid tool), or give lock=off if sharing it is really \
                         intended"
                    ),
                ));
            }
            // A file system that cannot lock (rare: NFS emulates flock with fcntl locks):
            // the open goes on unlocked, as documented, rather than refuse the file.
            Some(libc::ENOLCK | libc::EOPNOTSUPP) => return Ok(None),
            _ => return Err(with_context(e, format!("flock {shown}"))),
        }
    }
}

/// The locks this process holds, by (device, inode): a refused open names "this process" from
/// here, whatever `/proc/locks` shows. That file cannot be trusted for it: in a pid namespace
/// it shows other pids, and on overlayfs (containers, CI) its device numbers are the upper
/// file system's while `stat` gives the overlay's, so the line is not found at all.
/// Only error messages read it.
#[allow(clippy::disallowed_types)] // A registry for messages, off every I/O path: not modeled.
static HELD: std::sync::Mutex<Vec<(u64, u64)>> = std::sync::Mutex::new(Vec::new());

/// One `flock` this process holds: an entry in [`HELD`] while it lives. The lock itself goes
/// with the descriptors; if the entry outlives them for a moment (or the other way round),
/// only a message changes.
#[derive(Debug)]
pub(super) struct HeldLock {
    key: (u64, u64),
}

impl HeldLock {
    fn new(dev: u64, ino: u64) -> Self {
        let key = (dev, ino);
        HELD.lock().unwrap_or_else(|p| p.into_inner()).push(key);
        HeldLock { key }
    }

    fn held_here(dev: u64, ino: u64) -> bool {
        HELD.lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains(&(dev, ino))
    }
}

impl Drop for HeldLock {
    fn drop(&mut self) {
        let mut held = HELD.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(i) = held.iter().position(|k| *k == self.key) {
            held.swap_remove(i);
        }
    }
}

/// The pid of a process holding a `flock` on the file (device, inode), from `/proc/locks`.
/// Its lines read `N: FLOCK  ADVISORY  WRITE PID MAJ:MIN:INODE 0 EOF`, the device numbers in
/// hex; lines of waiters (`N: -> FLOCK ...`) are skipped.
fn lock_holder(dev: u64, ino: u64) -> Option<u32> {
    let text = std::fs::read_to_string("/proc/locks").ok()?;
    let want = format!("{:02x}:{:02x}:{ino}", libc::major(dev), libc::minor(dev));
    text.lines().find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        if f.get(1) != Some(&"FLOCK") || f.get(5) != Some(&want.as_str()) {
            return None;
        }
        f.get(4)?.parse().ok().filter(|&pid| pid != 0)
    })
}
