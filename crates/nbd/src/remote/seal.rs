//! Sealing a drained connection: before the client leaves a connection it gave up on and
//! drained (every request sent on it answered, the server still holding it open), it sends
//! one flush on it. The server that answers it is the one that acknowledged the connection's
//! writes (a server that restarted closed the connection), and a successful flush vouches
//! for every write it acknowledged before the flush was sent: the writes are durable, and
//! leaving the connection loses nothing (`Durability::connection_lost` then finds them
//! covered, so no flush fails for them and a mirror does not fail the leg).
//!
//! Without the seal, every timeout with unflushed writes on the connection counts as a loss:
//! a leg behind a slow link that times out now and then fails at each timeout and is
//! recovered over and over, although its server lost nothing.
//!
//! # Rules
//!
//! - Only after `Stop::Drained`: the table has no request outstanding on the connection, so
//!   the next reply on it is the seal's, and no sender is writing on it (requests are claimed
//!   only while a connection is up, and every one claimed on it was answered).
//! - The seal covers `Durability::acked` as read before it is sent (the same pairing as any
//!   flush: `table::Durability`); it is recorded only on a success reply to its own cookie.
//! - The whole exchange (send and reply) has one deadline, the device's timeout; the device
//!   closing ends it too. Anything else (no answer in time, an error, a reply for another
//!   cookie, a malformed one, the connection closing) leaves the writes uncovered: the loss
//!   is handled as without a seal. Nothing the server sends makes the client wait longer or
//!   keep more than a reply chunk (`receiver::SCRATCH`).

use std::time::Instant;

use super::receiver::{Receiver, Stop};
use super::send::write_all2;
use super::table::Writer;
use nbd_proto::proto::{Command, TransmissionFlags};
use nbd_proto::transmission::{parse_chunk, Chunk, ReplyHeader, Request};

/// The seal's cookie: no slot's (a slot's cookie has its index in the low half, and no table
/// has 2^32 slots).
const SEAL_COOKIE: u64 = u64::MAX;

/// Why a seal did not hold.
#[derive(Debug, thiserror::Error)]
pub(super) enum Unsealed {
    #[error("the connection cannot be sent on any more")]
    NoStream,
    #[error("sending the flush failed: {0}")]
    Send(std::io::Error),
    #[error("the server answered the flush with error {0}")]
    Refused(u32),
    #[error("{0}")]
    Stopped(Stop),
}

impl Receiver {
    /// Seals the connection just drained, if it has writes a flush must vouch for; returns
    /// how many writes (device-wide) the seal covers, or `None` when nothing needed it.
    pub(super) fn seal(&mut self) -> Option<Result<u64, Unsealed>> {
        let sh = self.sh.clone();
        if !sh.flags().contains(TransmissionFlags::SEND_FLUSH) {
            return None;
        }
        let cover = sh.durability.unflushed()?;
        let deadline = Instant::now() + sh.timeout;
        let r = self.send_seal(deadline).and_then(|()| {
            self.seal_by = Some(deadline);
            let r = self.seal_reply();
            self.seal_by = None;
            r
        });
        Some(r.map(|()| {
            sh.durability
                .flushed
                .fetch_max(cover, blkq_sync::atomic::Ordering::AcqRel);
            cover
        }))
    }

    fn send_seal(&self, deadline: Instant) -> Result<(), Unsealed> {
        let sh = &self.sh;
        let mut w = sh.writer.lock();
        let epoch = sh.table.lock().epoch;
        let Writer {
            stream,
            mode,
            header,
            epoch: current,
            partial,
        } = &mut *w;
        // A request half written (its submitter's send, not finished by the sender thread):
        // a flush header now would land inside it. Unsealed: the conservative answer.
        let Some(stream) = stream
            .as_mut()
            .filter(|_| *current == epoch && partial.is_none())
        else {
            return Err(Unsealed::NoStream);
        };
        let n = Request::new(Command::Flush, SEAL_COOKIE, 0, 0)
            .encode_into(*mode, header)
            .map_err(|e| Unsealed::Send(std::io::Error::other(e)))?;
        write_all2(stream, &header[..n], &[], || {
            sh.is_closing() || Instant::now() >= deadline
        })
        .map_err(Unsealed::Send)
    }

    /// Reads the seal's reply: a simple reply, or chunks until the one marked done (an
    /// error chunk among them fails it).
    fn seal_reply(&mut self) -> Result<(), Unsealed> {
        let mut error = 0;
        loop {
            // At a reply's boundary.
            self.mid_reply = false;
            self.replying = None;
            let header = self.read_header().map_err(Unsealed::Stopped)?;
            let (cookie, done) = match &header {
                ReplyHeader::Simple(r) => (r.cookie, true),
                ReplyHeader::Chunk(h) => (h.cookie, h.is_done()),
            };
            if cookie != SEAL_COOKIE {
                return Err(Unsealed::Stopped(Stop::Malformed(format!(
                    "a reply for cookie {cookie:#x} after the connection drained"
                ))));
            }
            match header {
                ReplyHeader::Simple(r) => error = r.error,
                ReplyHeader::Chunk(h) => {
                    let n = usize::try_from(h.length).unwrap_or(usize::MAX);
                    self.read_scratch(n).map_err(Unsealed::Stopped)?;
                    let payload = self.scratch.get(..n).unwrap_or(&[]);
                    match parse_chunk(&h, payload) {
                        Ok(Chunk::None) => {}
                        Ok(
                            Chunk::Error { error: e, .. }
                            | Chunk::ErrorOffset { error: e, .. }
                            | Chunk::OtherError { error: e, .. },
                        ) => error = error.max(e.max(1)),
                        Ok(other) => {
                            return Err(Unsealed::Stopped(Stop::Malformed(format!(
                                "an unasked-for chunk {other:?} in a flush's reply"
                            ))))
                        }
                        Err(e) => return Err(Unsealed::Stopped(Stop::Malformed(e.to_string()))),
                    }
                }
            }
            if done {
                return match error {
                    0 => Ok(()),
                    e => Err(Unsealed::Refused(e)),
                };
            }
        }
    }
}
