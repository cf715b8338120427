//! A connected stream socket, TCP or Unix domain, as the kernel gives it: what a plain
//! [`crate::stream::Stream`] is, and what a TLS one speaks through.

use std::io::{self, IoSlice, IoSliceMut, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::os::unix::net::UnixStream;

/// A connected stream socket: TCP or Unix domain.
#[derive(Debug)]
pub enum Socket {
    /// A TCP connection.
    Tcp(TcpStream),
    /// A Unix domain socket connection.
    Unix(UnixStream),
}

impl Socket {
    /// A second handle on the same socket (`dup(2)`).
    pub fn try_clone(&self) -> io::Result<Socket> {
        Ok(match self {
            Socket::Tcp(s) => Socket::Tcp(s.try_clone()?),
            Socket::Unix(s) => Socket::Unix(s.try_clone()?),
        })
    }

    /// Shuts down one or both directions (wakes a thread blocked in `read` on another handle).
    pub fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        match self {
            Socket::Tcp(s) => s.shutdown(how),
            Socket::Unix(s) => s.shutdown(how),
        }
    }

    /// Sets the socket's receive timeout (`SO_RCVTIMEO`; `None`: block for ever). A read that
    /// times out fails with `ErrorKind::WouldBlock`. The timeout belongs to the socket, so it
    /// applies to every handle of it.
    pub fn set_read_timeout(&self, t: Option<std::time::Duration>) -> io::Result<()> {
        match self {
            Socket::Tcp(s) => s.set_read_timeout(t),
            Socket::Unix(s) => s.set_read_timeout(t),
        }
    }

    /// The socket's receive timeout (`SO_RCVTIMEO`; `None`: none).
    pub fn read_timeout(&self) -> io::Result<Option<std::time::Duration>> {
        match self {
            Socket::Tcp(s) => s.read_timeout(),
            Socket::Unix(s) => s.read_timeout(),
        }
    }

    /// Sets the socket's send timeout (`SO_SNDTIMEO`; `None`: block for ever). A blocking send
    /// that sends nothing for that long fails with `ErrorKind::WouldBlock`.
    pub fn set_write_timeout(&self, t: Option<std::time::Duration>) -> io::Result<()> {
        match self {
            Socket::Tcp(s) => s.set_write_timeout(t),
            Socket::Unix(s) => s.set_write_timeout(t),
        }
    }

    /// Disables Nagle's algorithm on TCP (no-op on Unix sockets): replies must leave at once.
    pub fn set_nodelay(&self) -> io::Result<()> {
        match self {
            Socket::Tcp(s) => s.set_nodelay(true),
            Socket::Unix(_) => Ok(()),
        }
    }

    /// The peer's IP address on TCP (for access rules); `None` on a Unix socket; the error
    /// of `getpeername` on a TCP socket whose peer cannot be read (it has reset the
    /// connection, say): not a Unix client, so access rules must not take it for one.
    pub fn peer_ip(&self) -> io::Result<Option<std::net::IpAddr>> {
        match self {
            Socket::Tcp(s) => s.peer_addr().map(|a| Some(a.ip())),
            Socket::Unix(_) => Ok(None),
        }
    }

    /// The peer, for log lines: `tcp:127.0.0.1:53312` or `unix`.
    pub fn peer(&self) -> String {
        match self {
            Socket::Tcp(s) => match s.peer_addr() {
                Ok(a) => format!("tcp:{a}"),
                Err(_) => "tcp:?".to_string(),
            },
            Socket::Unix(_) => "unix".to_string(),
        }
    }
}

impl Read for Socket {
    #[inline]
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Socket::Tcp(s) => s.read(buf),
            Socket::Unix(s) => s.read(buf),
        }
    }

    #[inline]
    fn read_vectored(&mut self, bufs: &mut [IoSliceMut<'_>]) -> io::Result<usize> {
        match self {
            Socket::Tcp(s) => s.read_vectored(bufs),
            Socket::Unix(s) => s.read_vectored(bufs),
        }
    }
}

impl Write for Socket {
    #[inline]
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Socket::Tcp(s) => s.write(buf),
            Socket::Unix(s) => s.write(buf),
        }
    }

    #[inline]
    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        match self {
            Socket::Tcp(s) => s.write_vectored(bufs),
            Socket::Unix(s) => s.write_vectored(bufs),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl AsFd for Socket {
    fn as_fd(&self) -> BorrowedFd<'_> {
        match self {
            Socket::Tcp(s) => s.as_fd(),
            Socket::Unix(s) => s.as_fd(),
        }
    }
}

impl AsRawFd for Socket {
    fn as_raw_fd(&self) -> RawFd {
        match self {
            Socket::Tcp(s) => s.as_raw_fd(),
            Socket::Unix(s) => s.as_raw_fd(),
        }
    }
}
