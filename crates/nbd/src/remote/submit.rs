//! Submitting a request: taking a free slot (waiting for one at most the timeout, failing at
//! once when the device is dead or past its reconnect deadline) and the first send: inline
//! when the send side is free, else by the sender thread (see "Sending inline" in `send`);
//! and a submitter's batch, whose requests go out together (`Batch`).

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

/// Requests a batch's submitter sends with one `sendmsg` at most (`Batch`).
pub(super) const BATCH: usize = 16;

/// A request taken by a batch and not yet sent: its slot, a write's bio (away from its slot
/// while its payload is written: the slot is not freed meanwhile) and the payload's length.
#[derive(Default)]
pub(super) struct Pending {
    pub(super) slot: usize,
    pub(super) bio: Option<Bio>,
    pub(super) len: usize,
}

impl LinkState {
    /// Takes a free slot for `req`: a non-write's bio goes into it, a write's stays in `held`
    /// (sent from there, then put back). At once, or with `wait` for at most the timeout.
    /// `None` when there is none: `held`'s bio is then completed, failed, if `wait` (no slot
    /// within the timeout) or the device takes no request now, and left in `held` otherwise
    /// (no slot free at once).
    fn take_slot(
        &self,
        held: &mut Option<Bio>,
        end: &DynArc<dyn EndIo>,
        req: &Req,
        now: Instant,
        wait: bool,
    ) -> Option<usize> {
        let keep = req.cmd == Command::Write;
        let mut take = || {
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
        };
        let taken = if wait {
            self.slot_freed.wait_for_until(take, now + self.timeout)
        } else {
            take()
        };
        match taken {
            Some(Ok(i)) => Some(i),
            Some(Err(errno)) => {
                if let Some(bio) = held.take() {
                    end.end_io(bio, self.result(Status::Lost(errno)));
                }
                None
            }
            None if wait => {
                if let Some(bio) = held.take() {
                    let e = io::Error::from_raw_os_error(libc::ETIMEDOUT);
                    let e = blk::error::with_context(
                        e,
                        format!("{}: no free request slot within the timeout", self.uri),
                    );
                    end.end_io(bio, Err(Error::Io(e)));
                }
                None
            }
            None => None,
        }
    }

    /// After the first send of slot `i`: a write's bio back into its slot (which flags the
    /// sender if the write is still due), or a request not sent flagged for the sender.
    fn after_send(&self, i: usize, bio: Option<Bio>, sent: bool) {
        if let Some(bio) = bio {
            self.put_back(i, bio);
        } else if !sent {
            self.hand_off(i);
        }
    }

    /// Takes a slot for `bio` and sends `req` if the connection is up; else the request
    /// waits in its slot (a write with its bio) and the sender sends it once a connection is
    /// back. `end` is called exactly once.
    pub(super) fn submit(&self, bio: Bio, end: &DynArc<dyn EndIo>, req: Req) {
        let mut held = Some(bio);
        let Some(i) = self.take_slot(&mut held, end, &req, Instant::now(), true) else {
            return;
        };
        let sent = self.try_send_inline(i, &mut held, req.len as usize);
        self.after_send(i, held.take(), sent);
    }
}

/// A submitter's run of requests (`Device::submit_batch`): each takes its slot as it comes,
/// and they are sent together, up to [`BATCH`] with one `sendmsg` (`try_send_batch`), when
/// the batch is full, when a request has to wait for a slot (what the batch holds is sent
/// first: a batch never waits holding requests it has not sent), and at its end (`send`, or
/// the drop). What a send leaves is the sender thread's, as for one request.
pub(super) struct Batch<'a> {
    sh: &'a LinkState,
    end: &'a DynArc<dyn EndIo>,
    now: Instant,
    pending: [Pending; BATCH],
    n: usize,
}

impl<'a> Batch<'a> {
    pub(super) fn new(sh: &'a LinkState, end: &'a DynArc<dyn EndIo>) -> Self {
        Self {
            sh,
            end,
            now: Instant::now(),
            pending: std::array::from_fn(|_| Pending::default()),
            n: 0,
        }
    }

    /// Takes a slot for `bio` (`end` is called exactly once for it).
    pub(super) fn add(&mut self, bio: Bio, req: Req) {
        if self.n == BATCH {
            self.send();
        }
        let mut held = Some(bio);
        let slot = match self
            .sh
            .take_slot(&mut held, self.end, &req, self.now, false)
        {
            Some(i) => i,
            None if held.is_none() => return,
            None => {
                self.send();
                self.now = Instant::now();
                match self.sh.take_slot(&mut held, self.end, &req, self.now, true) {
                    Some(i) => i,
                    None => return,
                }
            }
        };
        self.pending[self.n] = Pending {
            slot,
            bio: held,
            len: req.len as usize,
        };
        self.n += 1;
    }

    /// Sends what the batch holds.
    pub(super) fn send(&mut self) {
        let n = std::mem::take(&mut self.n);
        let ps = &mut self.pending[..n];
        if ps.is_empty() {
            return;
        }
        let sent = self.sh.try_send_batch(ps);
        for (k, p) in ps.iter_mut().enumerate() {
            self.sh.after_send(p.slot, p.bio.take(), k < sent);
        }
    }
}

impl Drop for Batch<'_> {
    fn drop(&mut self) {
        self.send();
    }
}
