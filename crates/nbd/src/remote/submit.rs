//! Submitting a request: taking a free slot (waiting for one at most the timeout, failing at
//! once when the device is dead or past its reconnect deadline) and the first send: inline
//! when the send side is free, else by the sender thread (see "Sending inline" in `send`).

use std::io;
use std::time::Instant;

use blk::{Bio, EndIo, Error};
use blkq_sync::DynArc;

use super::table::{Conn, LinkState, Status};
use nbd_proto::proto::{CmdFlags, Command};

/// What to send for a bio.
#[derive(Debug, Clone, Copy)]
pub(super) struct Req {
    pub(super) cmd: Command,
    pub(super) flags: CmdFlags,
    /// An emulated FUA write: a write, then a flush.
    pub(super) fua_flush: bool,
    /// The range, bytes (not the bio's for a block-status query, whose buffer receives the
    /// descriptors).
    pub(super) offset: u64,
    pub(super) len: u64,
}

impl LinkState {
    /// Takes a slot for `bio` and sends `req` if the connection is up; else the request
    /// waits in its slot (a write with its bio) and the sender sends it once a connection is
    /// back. `end` is called exactly once.
    pub(super) fn submit(&self, bio: Bio, end: &DynArc<dyn EndIo>, req: Req) {
        let keep = req.cmd == Command::Write;
        let mut held = Some(bio);
        let now = Instant::now();
        let deadline = now + self.timeout;
        let taken = self.slot_freed.wait_for_until(
            || {
                let mut t = self.table.lock();
                match t.conn {
                    Conn::Dead | Conn::Down { expired: true, .. } => return Some(Err(libc::EIO)),
                    Conn::Up | Conn::Down { expired: false, .. } => {}
                }
                let i = t.free.pop()? as usize;
                let s = &mut t.slots[i];
                debug_assert!(
                    !s.busy && s.bio.is_none() && s.end.is_none() && !s.orphan,
                    "slot {i} taken from the free stack is not free"
                );
                s.gen = s.gen.wrapping_add(1);
                s.busy = true;
                s.status = None;
                s.end = Some(end.clone());
                (s.cmd, s.flags, s.fua_flush) = (req.cmd, req.flags, req.fua_flush);
                (s.offset, s.len) = (req.offset, req.len);
                s.submitted = now;
                s.sent_epoch = 0;
                s.covered = 0;
                s.filled.clear();
                s.error = 0;
                if !keep {
                    s.bio = held.take();
                }
                // Claimed by whoever sends it: this thread if the send side is free, else
                // the sender thread (now, or once a connection is back).
                Some(Ok(i))
            },
            deadline,
        );
        let i = match taken {
            Some(Ok(t)) => t,
            Some(Err(errno)) => {
                if let Some(bio) = held {
                    end.end_io(bio, self.result(Status::Lost(errno)));
                }
                return;
            }
            None => {
                if let Some(bio) = held {
                    let e = io::Error::from_raw_os_error(libc::ETIMEDOUT);
                    let e = blk::error::with_context(
                        e,
                        format!("{}: no free request slot within the timeout", self.uri),
                    );
                    end.end_io(bio, Err(Error::Io(e)));
                }
                return;
            }
        };
        let sent = self.try_send_inline(i, &mut held, req.len as usize);
        if let Some(bio) = held.take() {
            // Still our slot: it is not freed while its bio is away. Flags the sender if
            // the write is still due.
            self.put_back(i, bio);
        } else if !sent {
            self.hand_off(i);
        }
    }
}
