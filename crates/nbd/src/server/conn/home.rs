//! Large writes received into their home (docs/design.md, "Large writes"): the
//! payload of a large WRITE goes from the socket straight into the device's memory
//! ([`blk::Device::recv_home`]: `mem:` with `store=map` receives into its mapping), instead of
//! into a pooled buffer that a bio then copies into the device.
//!
//! Which writes: at least [`BIG_WRITE`] bytes, without FUA (a write that must be durable takes
//! the bio path, where the device's FUA handling lives), on a plaintext connection (TLS
//! payloads pass through rustls), to a device that can ([`blk::Caps::recv_home`]: off
//! with the spec's `splice=0`), and only when none of the payload is already in the receive
//! buffer. While large writes of that kind arrive, the reader asks the socket for one request
//! header at a time (`Connection::home_writes`, `reader.rs`), so that the payload behind the
//! header stays in the socket for the device to take; the first such write after other
//! requests usually has part of its payload buffered already and is copied as before.
//!
//! The write was validated before (range, alignment, read-only export: refused with no byte
//! received). It is staged with no bio and holds its share of the memory budget like a copied
//! write, so the accounting is the same; its reply is ready as soon as the payload is in
//! place. If the client closes or stalls mid-payload, the bytes already received stay in the
//! device (a torn write, allowed for a write never acknowledged), the device releases what it
//! held for the receive, and the connection ends as it does in a copied write's payload.

use std::io;
use std::os::fd::{AsFd, BorrowedFd};
use std::time::Instant;

use blk::RecvSource;

use super::recv::BIG_WRITE;
use super::Connection;
use crate::stream::is_timeout;
use nbd_proto::proto::CmdFlags;
use nbd_proto::transmission::Request;

impl Connection<'_> {
    /// Whether write `r` can be received into its home, buffered bytes aside (module docs).
    pub(super) fn home_capable(&self, r: &Request) -> bool {
        r.length >= BIG_WRITE
            && !r.flags.contains(CmdFlags::FUA)
            && self.core.tls.is_none()
            && self.device().caps().recv_home
    }

    /// Receives `len` payload bytes into the device at `offset`.
    pub(super) fn fill_home(&mut self, offset: u64, len: u64) -> Result<(), HomeFailure> {
        // Nothing of the payload is buffered (checked when it was staged).
        self.recv_pos = 0;
        self.recv_len = 0;
        let dev = self.device();
        let mut src = HomeRecv {
            conn: self,
            reason: None,
            got: 0,
        };
        dev.recv_home(offset, len as usize, &mut src)
            .map_err(|e| match src.reason.take() {
                Some(reason) => HomeFailure::Close(reason),
                None => HomeFailure::Device {
                    error: e,
                    left: len.saturating_sub(src.got),
                },
            })
    }
}

/// Why a write received into its home stopped.
pub(super) enum HomeFailure {
    /// The connection stops (the client closed or stalled, a socket error): the reason.
    Close(String),
    /// The device failed: the write is answered with its error, and the `left` payload bytes
    /// still in the socket are discarded as a refused write's are.
    Device { error: blk::Error, left: u64 },
}

/// The connection as the source of a payload received into its home: the reader's socket,
/// with the reader's timeouts and progress rules applied to each receive.
struct HomeRecv<'c, 'a> {
    conn: &'c mut Connection<'a>,
    /// Why the connection stops (the reader's own words), when it is the source that stopped.
    reason: Option<String>,
    /// Payload bytes taken from the socket so far.
    got: u64,
}

impl HomeRecv<'_, '_> {
    fn stop(&mut self, reason: String) -> io::Error {
        let e = io::Error::other(reason.clone());
        self.reason = Some(reason);
        e
    }
}

impl RecvSource for HomeRecv<'_, '_> {
    fn fd(&self) -> BorrowedFd<'_> {
        self.conn.stream.as_fd()
    }

    fn received(&mut self, res: io::Result<usize>) -> io::Result<()> {
        match res {
            Ok(0) => Err(self.stop(if self.conn.server.stopping() {
                "server shutting down".into()
            } else if self.conn.export.is_removed() {
                "export removed".into()
            } else {
                "client closed the connection in the middle of a write".into()
            })),
            Ok(n) => {
                self.got += n as u64;
                match self.conn.received(n, Instant::now()) {
                    Some(reason) => Err(self.stop(reason)),
                    None => Ok(()),
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => Ok(()),
            Err(e) if is_timeout(&e) => match self.conn.recv_timed_out(true) {
                Some(reason) => Err(self.stop(reason)),
                None => Ok(()),
            },
            Err(e) => Err(self.stop(format!("read error: {e}"))),
        }
    }
}
