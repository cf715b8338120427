//! Writes received into the page cache: a buffered `file:` device takes a write's payload from
//! the socket with `splice(2)`, socket to pipe (by reference to the socket's buffers), then
//! pipe to the file at the write's offset (the kernel's one copy, into the page cache), the
//! mirror of the zero-copy read path. Through a buffer the payload is copied twice: socket to
//! buffer (`recv`), buffer to page cache (`pwrite`).
//!
//! The pipes come from a small pool the device keeps ([`PipePool`]): one is taken for the
//! length of a write (by the connection's reader, which receives one write at a time) and put
//! back empty, so the pool holds at most one pipe per connection receiving a write at once.
//! A pipe that may still hold bytes (a splice into the file failed) is closed instead, so its
//! bytes can never land in another write.
//!
//! No lock is held across the receive: the file system orders the page-cache writes against
//! trims (`fallocate`) and other writes of the same pages; bytes of requests in flight together
//! are undefined, as a block device allows.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

use blk::RecvSource;
use blkq_sync::Mutex;

/// Pipe sizes asked for, in order (1 MiB holds a 1 MiB write in one round; an unprivileged
/// process gets at most `fs.pipe-max-size`, 1 MiB by default); failing both, the default size.
const PIPE_BYTES: [libc::c_int; 2] = [1 << 20, 256 << 10];

/// One pipe: read end, write end, capacity.
#[derive(Debug)]
struct Pipe {
    r: OwnedFd,
    w: OwnedFd,
    capacity: usize,
}

impl Pipe {
    fn new() -> io::Result<Pipe> {
        let mut fds = [0; 2];
        // SAFETY: `fds` is a writable array of two ints for the kernel to fill.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: pipe2 just returned both descriptors, owned by nothing else.
        let (r, w) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        let mut capacity = 0;
        for want in PIPE_BYTES {
            // SAFETY: fcntl on a descriptor we own; F_SETPIPE_SZ takes an int.
            let got = unsafe { libc::fcntl(w.as_raw_fd(), libc::F_SETPIPE_SZ, want) };
            if got > 0 {
                capacity = got as usize;
                break;
            }
        }
        if capacity == 0 {
            // SAFETY: as above; F_GETPIPE_SZ takes no argument.
            let got = unsafe { libc::fcntl(w.as_raw_fd(), libc::F_GETPIPE_SZ) };
            capacity = usize::try_from(got).unwrap_or(0).max(4096);
        }
        Ok(Pipe { r, w, capacity })
    }
}

/// The pipes of a device's writes received into the page cache (module docs).
#[derive(Debug, Default)]
pub(crate) struct PipePool {
    /// Empty pipes. Locked only to take or put one, never across a splice.
    free: Mutex<Vec<Pipe>>,
}

impl PipePool {
    /// Receives `len` bytes from `src` into `file` at `offset` (module docs): the caller has
    /// checked the range. A failure of the file's side comes back with `what` as context.
    pub(crate) fn recv_into(
        &self,
        file: BorrowedFd<'_>,
        offset: u64,
        len: usize,
        src: &mut dyn RecvSource,
        what: &dyn Fn(io::Error) -> io::Error,
    ) -> io::Result<()> {
        let pipe = match self.free.lock().pop() {
            Some(p) => p,
            None => Pipe::new()?,
        };
        let mut off =
            i64::try_from(offset).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        let mut left = len;
        while left > 0 {
            // Socket to pipe: the pipe is empty, so this waits only for the socket (and its
            // receive timeout, which the source handles).
            // SAFETY: splice(2) with no offsets (a socket and a pipe); both descriptors are
            // open for the whole call.
            let n = unsafe {
                libc::splice(
                    src.fd().as_raw_fd(),
                    std::ptr::null_mut(),
                    pipe.w.as_raw_fd(),
                    std::ptr::null_mut(),
                    left.min(pipe.capacity),
                    libc::SPLICE_F_MOVE,
                )
            };
            let res = if n < 0 {
                Err(io::Error::last_os_error())
            } else {
                Ok(n as usize)
            };
            let got = res.as_ref().map_or(0, |&n| n);
            let closed = matches!(res, Ok(0));
            if let Err(e) = src.received(res) {
                // Whatever reached the pipe goes with it.
                return Err(e);
            }
            if closed {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
            // Pipe to file, all of it, before the next receive.
            let mut k = got;
            while k > 0 {
                // SAFETY: splice(2) reads and advances the file offset through the pointer
                // (a live local); both descriptors are open for the whole call.
                let m = unsafe {
                    libc::splice(
                        pipe.r.as_raw_fd(),
                        std::ptr::null_mut(),
                        file.as_raw_fd(),
                        &mut off,
                        k,
                        libc::SPLICE_F_MOVE,
                    )
                };
                if m < 0 {
                    let e = io::Error::last_os_error();
                    if e.kind() == io::ErrorKind::Interrupted {
                        continue;
                    }
                    // The pipe may hold the rest: it is closed with it.
                    return Err(what(e));
                }
                if m == 0 {
                    return Err(what(io::ErrorKind::WriteZero.into()));
                }
                k -= m as usize;
            }
            left -= got;
        }
        self.free.lock().push(pipe);
        Ok(())
    }
}
