//! A connected socket, TCP or Unix, plain or TLS: what the server and the client read and
//! write. The plain socket is [`Socket`]; the TLS variant and its rules live in [`crate::tls`].

use std::borrow::BorrowMut;
use std::fmt;
use std::io::{self, IoSlice, IoSliceMut, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::time::Instant;

use blkq_sync::DynArc;

use crate::socket::Socket;
use crate::tls::{self, TlsStream};

/// A connected stream socket: TCP or Unix domain, plain or TLS.
#[derive(Debug)]
pub enum Stream {
    /// A TCP or Unix domain connection.
    Plain(Socket),
    /// Either of them after `NBD_OPT_STARTTLS` (see [`crate::tls`]).
    Tls(Box<TlsStream>),
}

impl From<TcpStream> for Stream {
    fn from(s: TcpStream) -> Self {
        Stream::Plain(Socket::Tcp(s))
    }
}

impl From<UnixStream> for Stream {
    fn from(s: UnixStream) -> Self {
        Stream::Plain(Socket::Unix(s))
    }
}

impl Stream {
    /// The socket underneath (under TLS, the one the records travel on).
    pub fn socket(&self) -> &Socket {
        match self {
            Stream::Plain(s) => s,
            Stream::Tls(s) => s.sock(),
        }
    }

    /// A second handle on the same socket (`dup(2)`).
    pub fn try_clone(&self) -> io::Result<Stream> {
        Ok(match self {
            Stream::Plain(s) => Stream::Plain(s.try_clone()?),
            Stream::Tls(s) => Stream::Tls(Box::new(s.try_clone()?)),
        })
    }

    /// Shuts down one or both directions (wakes a thread blocked in `read` on another handle).
    pub fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        self.socket().shutdown(how)
    }

    /// Sets the socket's receive timeout (`SO_RCVTIMEO`; `None`: block for ever). A read that
    /// times out fails with `ErrorKind::WouldBlock`. The timeout belongs to the socket, so it
    /// applies to every handle of it.
    pub fn set_read_timeout(&self, t: Option<std::time::Duration>) -> io::Result<()> {
        self.socket().set_read_timeout(t)
    }

    /// The socket's receive timeout (`SO_RCVTIMEO`; `None`: none).
    pub fn read_timeout(&self) -> io::Result<Option<std::time::Duration>> {
        self.socket().read_timeout()
    }

    /// When the partial TLS record received so far began (`None`: not TLS, or the bytes
    /// received end at a record boundary).
    pub(crate) fn partial_record_since(&self) -> Option<std::time::Instant> {
        match self {
            Stream::Tls(s) => s.partial_record_since(),
            Stream::Plain(_) => None,
        }
    }

    /// Sets the socket's send timeout (`SO_SNDTIMEO`; `None`: block for ever). A blocking send
    /// that sends nothing for that long fails with `ErrorKind::WouldBlock`.
    pub fn set_write_timeout(&self, t: Option<std::time::Duration>) -> io::Result<()> {
        self.socket().set_write_timeout(t)
    }

    /// Disables Nagle's algorithm on TCP (no-op on Unix sockets): replies must leave at once.
    pub fn set_nodelay(&self) -> io::Result<()> {
        self.socket().set_nodelay()
    }

    /// The peer's IP address on TCP (for access rules); `None` on a Unix socket; the error
    /// of `getpeername` on a TCP socket whose peer cannot be read (it has reset the
    /// connection, say): not a Unix client, so access rules must not take it for one.
    pub fn peer_ip(&self) -> io::Result<Option<std::net::IpAddr>> {
        self.socket().peer_ip()
    }

    /// The peer, for log lines: `tcp:127.0.0.1:53312` or `unix`.
    pub fn peer(&self) -> String {
        self.socket().peer()
    }

    /// Whether the stream speaks TLS.
    pub fn is_tls(&self) -> bool {
        matches!(self, Stream::Tls(_))
    }

    /// The verified client certificate's subject, RFC 4514 style (`CN=client1`), for access
    /// rules; `None` without TLS or without a client certificate.
    pub fn tls_subject(&self) -> Option<String> {
        match self {
            Stream::Tls(s) => s.subject().map(str::to_string),
            Stream::Plain(_) => None,
        }
    }

    /// The TLS session, shared by every handle of the connection.
    pub(crate) fn tls_session(&self) -> Option<&DynArc<tls::TlsSession>> {
        match self {
            Stream::Tls(s) => Some(s.session()),
            Stream::Plain(_) => None,
        }
    }

    /// TLS 1.3: queues a KeyUpdate asking the peer to update its keys too (it leaves with the
    /// next write on this connection). Not TLS: an error.
    pub fn tls_refresh_keys(&self) -> io::Result<()> {
        match self {
            Stream::Tls(s) => s.refresh_keys(),
            Stream::Plain(_) => Err(io::Error::other("not a TLS stream")),
        }
    }

    /// Sends TLS `close_notify` (no-op on a plain stream). Best effort, blocking: call it only
    /// where no writer can be sending on another handle.
    pub fn close_notify(&mut self) {
        if let Stream::Tls(s) = self {
            s.close_notify();
        }
    }

    /// Server side of STARTTLS: the TLS handshake on this (plain) stream, which then speaks
    /// TLS; it must end before `deadline` (the NBD handshake's).
    pub(crate) fn accept_tls(
        &mut self,
        config: &DynArc<rustls::ServerConfig>,
        deadline: Instant,
    ) -> io::Result<()> {
        self.start_tls(|| tls::server_connection(config), Some(deadline))
    }

    /// Client side of STARTTLS, after the server acknowledged `NBD_OPT_STARTTLS`: the TLS
    /// handshake on this (plain) stream, which then speaks TLS; with a `deadline`, the whole
    /// handshake must end before it.
    pub fn connect_tls(
        &mut self,
        config: &DynArc<rustls::ClientConfig>,
        server_name: &str,
        deadline: Option<Instant>,
    ) -> io::Result<()> {
        self.start_tls(|| tls::client_connection(config, server_name), deadline)
    }

    /// Runs the TLS handshake of the connection `conn` makes and turns this plain stream into
    /// a [`Stream::Tls`].
    ///
    /// With a `deadline`, the whole handshake must end before it: every receive and send
    /// first sets what is left of it as the socket's timeout, so a peer that trickles its
    /// flight a byte at a time runs out of time like a silent one (`TimedOut`). Without one,
    /// the socket's timeouts stand as the caller set them.
    fn start_tls(
        &mut self,
        conn: impl FnOnce() -> io::Result<rustls::Connection>,
        deadline: Option<Instant>,
    ) -> io::Result<()> {
        let Stream::Plain(plain) = self else {
            return Err(io::Error::other("TLS already started"));
        };
        let conn = conn()?;
        let sock = plain.try_clone()?;
        let io = Until {
            sock: &mut *self,
            deadline,
        };
        let tls = tls::handshake(io, sock, conn)?;
        *self = Stream::Tls(Box::new(tls));
        Ok(())
    }
}

/// A stream whose reads and writes together must end before a deadline (a whole handshake,
/// a whole connection attempt): each first sets what is left of it as the socket's timeouts,
/// so a peer that trickles its bytes runs out of time like a silent one (`TimedOut`). With
/// no deadline the socket's timeouts stand as the caller set them.
#[derive(Debug)]
pub(crate) struct Until<S> {
    pub(crate) sock: S,
    pub(crate) deadline: Option<std::time::Instant>,
}

impl<S: BorrowMut<Stream>> Until<S> {
    /// Sets what is left of the deadline as the socket's timeouts; `TimedOut` when nothing is.
    pub(crate) fn arm(&self) -> io::Result<()> {
        let Some(deadline) = self.deadline else {
            return Ok(());
        };
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the deadline passed",
            ));
        }
        let s: &Stream = self.sock.borrow();
        s.set_read_timeout(Some(left))?;
        s.set_write_timeout(Some(left))
    }

    /// A socket timeout reads as `WouldBlock` (`EAGAIN`): under a deadline it is `TimedOut`.
    pub(crate) fn timed_out(&self, e: io::Error) -> io::Error {
        if self.deadline.is_some() && e.kind() == io::ErrorKind::WouldBlock {
            io::Error::new(io::ErrorKind::TimedOut, "the deadline passed")
        } else {
            e
        }
    }
}

impl<S: BorrowMut<Stream>> Read for Until<S> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.arm()?;
        self.sock
            .borrow_mut()
            .read(buf)
            .map_err(|e| self.timed_out(e))
    }
}

impl<S: BorrowMut<Stream>> Write for Until<S> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.arm()?;
        self.sock
            .borrow_mut()
            .write(buf)
            .map_err(|e| self.timed_out(e))
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Read for Stream {
    #[inline]
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Plain(s) => s.read(buf),
            Stream::Tls(s) => s.read(buf),
        }
    }

    #[inline]
    fn read_vectored(&mut self, bufs: &mut [IoSliceMut<'_>]) -> io::Result<usize> {
        match self {
            Stream::Plain(s) => s.read_vectored(bufs),
            Stream::Tls(s) => s.read_vectored(bufs),
        }
    }
}

impl Write for Stream {
    #[inline]
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Plain(s) => s.write(buf),
            Stream::Tls(s) => s.write(buf),
        }
    }

    #[inline]
    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        match self {
            Stream::Plain(s) => s.write_vectored(bufs),
            Stream::Tls(s) => s.write_vectored(bufs),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl AsFd for Stream {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.socket().as_fd()
    }
}

impl AsRawFd for Stream {
    fn as_raw_fd(&self) -> RawFd {
        self.socket().as_raw_fd()
    }
}

impl fmt::Display for Stream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.peer())
    }
}

/// A socket timeout (`SO_RCVTIMEO` or `SO_SNDTIMEO` expired): `EAGAIN`, which std calls
/// `WouldBlock`, or `TimedOut`.
pub(crate) fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}
