//! Descriptor-level I/O on one file: the buffered and `O_DIRECT` descriptors ([`FileIo`]),
//! positional reads and writes in loops that resume after short transfers and `EINTR`, FUA by
//! `pwritev2(RWF_DSYNC)` with its `fdatasync` fallback, and the system call wrappers they
//! share (`cvt`, `cvt_int`, `to_off`, `fdatasync`, `fallocate`, `unsupported`). Used by the
//! synchronous file backend ([`crate::backend::file`]), its host probes, and the asynchronous
//! engines ([`crate::engine`]), which run the same loops or submit the same descriptors.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, RawFd};

use blkq_sync::atomic::{AtomicBool, Ordering};

/// Alignment of offset, length and buffer address for the `O_DIRECT` descriptor to be used.
pub const DIRECT_ALIGN: usize = 4096;

/// The descriptors of one file and what was learnt about them at run time; shared by the
/// synchronous [`crate::backend::FileBackend`] and the asynchronous engines
/// ([`crate::engine`]).
#[derive(Debug)]
pub(crate) struct FileIo {
    pub(crate) buffered: File,
    pub(crate) direct: Option<File>,
    /// Cleared when a direct transfer failed with `EINVAL`.
    pub(crate) direct_ok: AtomicBool,
    /// Cleared when `pwritev2(RWF_DSYNC)` is refused.
    pub(crate) dsync_ok: AtomicBool,
}

fn is_aligned(v: u64) -> bool {
    v & (DIRECT_ALIGN as u64 - 1) == 0
}

pub(crate) fn to_off(offset: u64) -> io::Result<libc::off_t> {
    libc::off_t::try_from(offset).map_err(|_| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("offset {offset} does not fit in off_t"),
        )
    })
}

/// `Err(last_os_error)` for a negative syscall return, else the value.
pub(crate) fn cvt(r: isize) -> io::Result<usize> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r as usize)
    }
}

pub(crate) fn cvt_int(r: libc::c_int) -> io::Result<()> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

pub(crate) fn fdatasync(fd: RawFd) -> io::Result<()> {
    loop {
        // SAFETY: fdatasync takes a plain descriptor and no memory.
        match cvt_int(unsafe { libc::fdatasync(fd) }) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            r => return r,
        }
    }
}

pub(crate) fn fallocate(fd: RawFd, mode: libc::c_int, offset: u64, len: u64) -> io::Result<()> {
    let off = to_off(offset)?;
    let len = to_off(len)?;
    loop {
        // SAFETY: fallocate takes a descriptor and integers, no memory.
        match cvt_int(unsafe { libc::fallocate(fd, mode, off, len) }) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            r => return r,
        }
    }
}

/// Whether `e` says "this operation or flag is not supported here".
pub(crate) fn unsupported(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EOPNOTSUPP) | Some(libc::ENOSYS) | Some(libc::ENOTTY)
    )
}

impl FileIo {
    /// The descriptor for a transfer of `len` bytes at `offset` from/to address `addr`, and
    /// whether it is the direct one.
    #[inline]
    pub(crate) fn pick(&self, offset: u64, addr: usize, len: usize) -> (RawFd, bool) {
        if let Some(d) = &self.direct {
            if len > 0
                && is_aligned(offset)
                && is_aligned(addr as u64)
                && is_aligned(len as u64)
                && self.direct_ok.load(Ordering::Relaxed)
            {
                return (d.as_raw_fd(), true);
            }
        }
        (self.buffered.as_raw_fd(), false)
    }

    /// Reads all of `buf` at `offset`; end of file before that is `UnexpectedEof`.
    pub(crate) fn read(&self, mut buf: &mut [u8], mut offset: u64) -> io::Result<()> {
        while !buf.is_empty() {
            let (fd, direct) = self.pick(offset, buf.as_ptr() as usize, buf.len());
            let off = to_off(offset)?;
            // SAFETY: `buf` is a live, writable slice of `buf.len()` bytes for the whole call.
            let r = cvt(unsafe { libc::pread(fd, buf.as_mut_ptr().cast(), buf.len(), off) });
            match r {
                Ok(0) => {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        format!("end of file at {offset}, {} bytes short", buf.len()),
                    ))
                }
                Ok(n) => {
                    let rest = std::mem::take(&mut buf);
                    let n = n.min(rest.len());
                    buf = &mut rest[n..];
                    offset += n as u64;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if direct && e.raw_os_error() == Some(libc::EINVAL) => {
                    self.direct_ok.store(false, Ordering::Relaxed);
                }
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Writes all of `buf` at `offset`; with `fua`, durable before returning.
    pub(crate) fn write(&self, mut buf: &[u8], mut offset: u64, fua: bool) -> io::Result<()> {
        let mut need_sync = false;
        while !buf.is_empty() {
            let (fd, direct) = self.pick(offset, buf.as_ptr() as usize, buf.len());
            let off = to_off(offset)?;
            let dsync = fua && self.dsync_ok.load(Ordering::Relaxed);
            let r = if dsync {
                let iov = libc::iovec {
                    iov_base: buf.as_ptr() as *mut libc::c_void,
                    iov_len: buf.len(),
                };
                // SAFETY: `iov` describes `buf`, live and readable for the whole call; the
                // kernel only reads through it.
                cvt(unsafe { libc::pwritev2(fd, &iov, 1, off, libc::RWF_DSYNC) })
            } else {
                need_sync |= fua;
                // SAFETY: `buf` is a live, readable slice of `buf.len()` bytes for the call.
                cvt(unsafe { libc::pwrite(fd, buf.as_ptr().cast(), buf.len(), off) })
            };
            match r {
                Ok(0) => {
                    return Err(io::Error::new(
                        io::ErrorKind::WriteZero,
                        format!("write at {offset} wrote nothing, {} bytes left", buf.len()),
                    ))
                }
                Ok(n) => {
                    buf = &buf[n.min(buf.len())..];
                    offset += n as u64;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if dsync && unsupported(&e) => {
                    self.dsync_ok.store(false, Ordering::Relaxed);
                }
                Err(e) if direct && e.raw_os_error() == Some(libc::EINVAL) => {
                    self.direct_ok.store(false, Ordering::Relaxed);
                }
                Err(e) => return Err(e),
            }
        }
        if need_sync {
            self.sync()?;
        }
        Ok(())
    }

    /// `fdatasync`: durable data (and the metadata needed to read it back).
    pub(crate) fn sync(&self) -> io::Result<()> {
        fdatasync(self.buffered.as_raw_fd())
    }

    /// New descriptors for the same open files (`dup`), for an engine.
    pub(crate) fn try_clone(&self) -> io::Result<FileIo> {
        Ok(FileIo {
            buffered: self.buffered.try_clone()?,
            direct: match &self.direct {
                Some(d) => Some(d.try_clone()?),
                None => None,
            },
            direct_ok: AtomicBool::new(self.direct_ok.load(Ordering::Relaxed)),
            dsync_ok: AtomicBool::new(self.dsync_ok.load(Ordering::Relaxed)),
        })
    }
}
