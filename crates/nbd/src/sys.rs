//! The system calls std does not offer in the form the server needs: `sendmsg(2)` over
//! several buffers with per-call flags (`MSG_DONTWAIT` for the completion threads that must
//! never block on a slow client, `MSG_NOSIGNAL` so a vanished client is an `EPIPE`, not a
//! `SIGPIPE` that kills the process), `SO_SNDBUF`, and `shutdown(2)` of a listening socket to
//! wake its acceptor at stop. This is the only module of the crate
//! with `unsafe`.
#![allow(unsafe_code)]

use std::io::{self, IoSlice};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

/// Sends `bufs` with one `sendmsg(2)` and returns the bytes sent (possibly fewer than asked).
///
/// With `dontwait`, a socket whose send buffer is full gives `ErrorKind::WouldBlock` instead of
/// blocking. `EINTR` is retried.
pub(crate) fn sendmsg(fd: RawFd, bufs: &[IoSlice<'_>], dontwait: bool) -> io::Result<usize> {
    sendmsg_more(fd, bufs, dontwait, false)
}

/// [`sendmsg`], with `MSG_MORE` when `more`: more bytes follow at once (a spliced reply's
/// data after its header), so TCP need not send a short segment now.
pub(crate) fn sendmsg_more(
    fd: RawFd,
    bufs: &[IoSlice<'_>],
    dontwait: bool,
    more: bool,
) -> io::Result<usize> {
    // SAFETY: `msghdr` is a plain C struct for which all-zero bytes are a valid value (no name,
    // no control data, no iovecs); the fields we use are set below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    // `IoSlice` is guaranteed to be ABI compatible with `iovec` on Unix; sendmsg only reads
    // through these pointers, so the `*mut` is never used to write.
    msg.msg_iov = bufs.as_ptr() as *mut libc::iovec;
    msg.msg_iovlen = bufs.len() as _;
    let mut flags = libc::MSG_NOSIGNAL;
    if dontwait {
        flags |= libc::MSG_DONTWAIT;
    }
    if more {
        flags |= libc::MSG_MORE;
    }
    loop {
        // SAFETY: `msg` points to `bufs.len()` valid iovecs that borrow live, readable slices
        // for the whole call (`bufs` outlives it); no name or control buffer is given; `fd` is
        // only used as a number (a closed or wrong fd gives EBADF/ENOTSOCK, not UB).
        let n = unsafe { libc::sendmsg(fd, &msg, flags) };
        if n >= 0 {
            return Ok(n as usize);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// The send buffer asked for a connection whose sender writes large payloads (the server's
/// replies, the remote device's requests over a Unix socket): 4 MiB, capped by the kernel's
/// `wmem_max`. A socket's default (`wmem_default`, 208 KiB here) takes a 1 MiB payload in
/// five pieces, each a wait for the peer to read and a wake-up.
pub(crate) const SEND_BUFFER: usize = 4 << 20;

/// Asks for a send buffer of `bytes` (`SO_SNDBUF`; the kernel caps it at `wmem_max` and
/// doubles it for bookkeeping). Replies that fit are written without blocking, so the combining
/// writer hands fewer of them to the flusher thread.
pub(crate) fn set_send_buffer(fd: RawFd, bytes: usize) -> io::Result<()> {
    let v = bytes.min(libc::c_int::MAX as usize) as libc::c_int;
    set_int_option(fd, libc::SOL_SOCKET, libc::SO_SNDBUF, v)
}

/// TCP keepalive on a connected socket: after `idle` without traffic, a probe every
/// `interval`; the kernel gives the connection up (`ETIMEDOUT`) when `count` probes go
/// unanswered (seconds, at most 32767: the kernel's limit), or when data (a FIN too) stays
/// unacknowledged for `user_timeout` (`TCP_USER_TIMEOUT`, in milliseconds: not rounded up to
/// seconds as the probes are, so a sub-second request timeout keeps a sub-second bound).
pub(crate) fn set_keepalive(
    fd: RawFd,
    idle: u32,
    interval: u32,
    count: u32,
    user_timeout: std::time::Duration,
) -> io::Result<()> {
    let secs = |s: u32| s.clamp(1, 32767) as libc::c_int;
    let (idle, interval, count) = (
        secs(idle),
        secs(interval),
        count.clamp(1, 127) as libc::c_int,
    );
    set_int_option(fd, libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1)?;
    set_int_option(fd, libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, idle)?;
    set_int_option(fd, libc::IPPROTO_TCP, libc::TCP_KEEPINTVL, interval)?;
    set_int_option(fd, libc::IPPROTO_TCP, libc::TCP_KEEPCNT, count)?;
    let user_ms = user_timeout.as_millis().clamp(1, libc::c_int::MAX as u128) as libc::c_int;
    set_int_option(fd, libc::IPPROTO_TCP, libc::TCP_USER_TIMEOUT, user_ms)
}

/// `setsockopt(fd, level, name, &v)` for an `int` option.
/// `getsockopt(fd, level, name)` for an `int` option (tests read back what was set).
#[cfg(test)]
pub(crate) fn int_option(
    fd: RawFd,
    level: libc::c_int,
    name: libc::c_int,
) -> io::Result<libc::c_int> {
    let mut v: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: `v` and `len` are live and `len` is the size of `v`; getsockopt writes at most
    // that many bytes into `v`. A bad `fd` gives EBADF/ENOTSOCK.
    let rc = unsafe {
        libc::getsockopt(
            fd,
            level,
            name,
            (&mut v as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(v)
}

fn set_int_option(
    fd: RawFd,
    level: libc::c_int,
    name: libc::c_int,
    v: libc::c_int,
) -> io::Result<()> {
    // SAFETY: `v` is a live c_int and the length passed is its size; setsockopt only reads it.
    // A bad `fd` gives EBADF/ENOTSOCK.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            level,
            name,
            (&v as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// `shutdown(fd, SHUT_RDWR)` on a listening socket. On Linux a thread blocked in `accept(2)` on
/// it wakes at once with `EINVAL`, and every later `accept` fails the same way, for TCP and
/// Unix sockets alike; this is how the server stops its acceptors without connecting to its
/// own socket (whose path may have been removed or replaced).
pub(crate) fn shutdown_listener(fd: RawFd) -> io::Result<()> {
    // SAFETY: shutdown(2) takes no pointers; `fd` is only used as a number (the caller owns a
    // descriptor of the listening socket, so it is not a reused number).
    let rc = unsafe { libc::shutdown(fd, libc::SHUT_RDWR) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// The soft limit on open descriptors (`RLIMIT_NOFILE`), if it can be read and is finite.
pub(crate) fn open_files_limit() -> Option<u64> {
    // SAFETY: an all-zero `rlimit` is a valid value; getrlimit only writes it.
    let mut rl: libc::rlimit = unsafe { std::mem::zeroed() };
    // SAFETY: `rl` is a live, exclusively borrowed rlimit for the call.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut rl) };
    (rc == 0 && rl.rlim_cur != libc::RLIM_INFINITY).then_some(rl.rlim_cur as u64)
}

/// Physical memory of the machine, bytes (`sysconf`), if known.
pub(crate) fn physical_memory() -> Option<u64> {
    // SAFETY: sysconf only reads its argument and returns a number (or -1).
    let (pages, size) = unsafe {
        (
            libc::sysconf(libc::_SC_PHYS_PAGES),
            libc::sysconf(libc::_SC_PAGESIZE),
        )
    };
    (pages > 0 && size > 0).then(|| (pages as u64).saturating_mul(size as u64))
}

/// Moves up to `len` bytes from the pipe `pipe` (read end) into the socket `sock` with
/// `splice(2)`: the pages go to the socket by reference where it takes them so. With
/// `dontwait` a full socket gives `ErrorKind::WouldBlock` instead of blocking (a blocking
/// socket still honours its `SO_SNDTIMEO`); `more` is `SPLICE_F_MORE` (more data follows).
/// `EINTR` is retried. A closed peer is `EPIPE`; splice raises `SIGPIPE` too (there is no
/// `MSG_NOSIGNAL` for it), which Rust programs ignore from the start (the runtime sets it to
/// `SIG_IGN` before `main`).
pub(crate) fn splice_out(
    pipe: RawFd,
    sock: RawFd,
    len: usize,
    dontwait: bool,
    more: bool,
) -> io::Result<usize> {
    let mut flags = libc::SPLICE_F_MOVE;
    if dontwait {
        flags |= libc::SPLICE_F_NONBLOCK;
    }
    if more {
        flags |= libc::SPLICE_F_MORE;
    }
    loop {
        // SAFETY: splice(2) with no offset pointers (both ends are a pipe and a socket); the
        // descriptors are only used as numbers (a wrong one gives EBADF, not UB).
        let n = unsafe {
            libc::splice(
                pipe,
                std::ptr::null_mut(),
                sock,
                std::ptr::null_mut(),
                len,
                flags,
            )
        };
        if n >= 0 {
            return Ok(n as usize);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// A pipe (read end, write end; close-on-exec) with the first of `sizes` that `F_SETPIPE_SZ`
/// grants, else its default size; returns its capacity in bytes too.
pub(crate) fn pipe_sized(sizes: &[usize]) -> io::Result<(OwnedFd, OwnedFd, usize)> {
    let mut fds = [0; 2];
    // SAFETY: `fds` is a writable array of two ints for the kernel to fill.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: pipe2 just returned both descriptors, owned by nothing else.
    let (r, w) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    for &want in sizes {
        let want = libc::c_int::try_from(want).unwrap_or(libc::c_int::MAX);
        // SAFETY: fcntl on a descriptor we own; F_SETPIPE_SZ takes an int.
        let got = unsafe { libc::fcntl(w.as_raw_fd(), libc::F_SETPIPE_SZ, want) };
        if got > 0 {
            return Ok((r, w, got as usize));
        }
    }
    // SAFETY: as above; F_GETPIPE_SZ takes no argument.
    let got = unsafe { libc::fcntl(w.as_raw_fd(), libc::F_GETPIPE_SZ) };
    Ok((r, w, usize::try_from(got).unwrap_or(0).max(4096)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::os::fd::AsRawFd;
    use std::os::unix::net::UnixStream;

    #[test]
    fn sends_several_slices_and_reports_would_block() {
        let (a, mut b) = UnixStream::pair().unwrap();
        let n = sendmsg(
            a.as_raw_fd(),
            &[IoSlice::new(b"ab"), IoSlice::new(b""), IoSlice::new(b"cde")],
            false,
        )
        .unwrap();
        assert_eq!(n, 5);
        let mut got = [0u8; 5];
        b.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"abcde");
        // Fill the socket: a non-blocking send must eventually say WouldBlock.
        let big = vec![0u8; 1 << 20];
        let mut saw_would_block = false;
        for _ in 0..64 {
            match sendmsg(a.as_raw_fd(), &[IoSlice::new(&big)], true) {
                Ok(_) => {}
                Err(e) => {
                    assert_eq!(e.kind(), io::ErrorKind::WouldBlock);
                    saw_would_block = true;
                    break;
                }
            }
        }
        assert!(saw_would_block);
        drop(b);
        let e = sendmsg(a.as_raw_fd(), &[IoSlice::new(b"x")], false).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::BrokenPipe);
    }
}
