//! The state one connection of a [`super::RemoteDevice`] shares between its submitters, its
//! receiver and its sender: the table of requests in flight, the socket's write half, how a
//! request completes, and how the device fails (how one is sent: `send`).

use std::io;
use std::net::Shutdown;
use std::time::{Duration, Instant};

use blk::{Bio, EndIo, Error, Limits};
use blkq_sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use blkq_sync::{DynArc, Mutex};
use waitq::WaitQueue;

use crate::coverage::Coverage;
use crate::stream::Stream;
use nbd_proto::proto::{CmdFlags, Command, TransmissionFlags, TransmissionMode};
use nbd_proto::transmission::Request;

// # The slot table
//
// `Table::slots` has `depth` entries, fixed at connect; `Table::free` holds the indices of the
// free ones (a stack with room for all, so pushing never allocates).
//
// - A cookie is `gen << 32 | index`. `gen` is bumped each time the slot is taken (and when an
//   emulated FUA write turns into its flush), so a reply for an earlier use does not match:
//   the receiver accepts a reply only for a busy slot whose `gen` matches, whose `status` is
//   not yet known and which was sent on the receiver's connection (`sent_epoch == epoch`);
//   anything else is a malformed reply, which breaks the connection.
// - Free: `busy == false`, no bio, no completion; its index is in `free`.
// - Taken by a submitter (under the table lock): `busy`, `status == None`, `end` set, `gen`
//   bumped, `sent_epoch == 0` (not sent). For a request without payload the bio goes into the
//   slot at once; for a write the submitter keeps the bio while it sends the payload from the
//   bio's buffer, then puts it back.
//
// # Who holds a bio, who sends
//
// A bio is either in its slot or *away* with exactly one holder: the submitter (a write it is
// sending), the sender thread (a write it is re-sending) or the receiver (a read whose data it
// is receiving). A slot whose bio is away is never freed, so it is still the holder's slot when
// the holder puts the bio back ([`LinkState::put_back`]).
//
// A send is claimed first: the slot is marked sent on the current connection (`sent_epoch =
// epoch`, under the table lock, by the submitter or the sender while it holds the writer
// lock), then written under the writer lock only if the writer's
// connection is still that one (`Writer::epoch`). Whoever comes second on the same connection
// finds the slot not due and does not send; a claim made for a connection that went away is
// not written, and the slot is due again on the next one. So a request is sent at most once
// per connection, and never on a connection other than the one it is marked with. A request is due when it is busy, without status, and not sent on the
// current connection; it is sent by the submitter (first send), or by the sender thread (after
// a reconnection, the flush of an emulated FUA write, a write whose bio came back while the
// sender looked for it). A write whose bio is away is left to its holder, who flags the sender
// when it puts the bio back and the slot is still due.
//
// # Completion: exactly once
//
// A slot completes when its `status` is known and its bio is in it: whoever supplies the second
// of the two (the receiver with the status, a holder with the bio, a failure) takes the bio
// and completion out and frees the slot under the table lock, so only one of them can, and
// calls `end_io` after dropping every lock. A status is set only on a slot without one, so a
// request is never completed twice: once `status` is set no reply matches the slot, and the
// slot's `gen` changes before it can be matched again.
//
// # The connection's states (`Table::conn`)
//
// - `Up`: requests are sent as they come.
// - `Down { since, expired }`: the connection broke at `since`. Nothing is sent; the requests
//   in the table stay, bios in place. While the old connection drains (below), replies to
//   them are still received and complete them; once it is over, the ones still waiting are
//   sent again (`sent_epoch` is older than the next connection's epoch) when a connection is
//   back. New requests take slots and wait too. `expired` is set `reconnect_deadline` after
//   `since`, whether or not anything waits (the device then reports itself unavailable, so a
//   mirror fails the leg): everything waiting fails with `EIO` and new requests fail at once,
//   until a connection is back (then `Up` again).
// - `Dead`: the device is closing, or the export changed under it (`fatal` says how): every
//   request fails with `EIO`, for good.
//
// # The old connection: no re-send is overtaken by its first copy
//
// A request sent on a connection may still be carried out by the server after the client
// gave up on it, and a write's first copy landing after its re-sent copy, or after a newer
// write to the same blocks, would undo them. So nothing is sent on a new connection while
// the old one may still carry out a request: the old connection is over when every request
// sent on it has its reply, or the server has closed it (end of stream) or reset it, or the
// socket failed. The one assumption about the server: it finishes (or abandons) a
// connection's requests before it closes that connection on its own (blkq's server, nbdkit
// and qemu-nbd do).
//
// - The server closed the connection (or the socket failed): it is over at once.
// - The client gives up on it (a request unanswered for the timeout, `NBD_ESHUTDOWN`, a
//   failed send): the table goes `Down` (`go_down`, under the table lock: requests are
//   claimed only while `Up`, so nothing new is sent; a claimed one still goes out) and
//   `draining`. The socket is left open: a server may close a connection as soon as it sees
//   the end of the requests, with requests still running (qemu-nbd does), so the end of the
//   stream would not say they are over. The receiver keeps receiving: a reply that still
//   comes completes its request (a late success is a success). Once every request sent on
//   the connection is answered (`answered`), or the server closes it, it is over; only then
//   are the requests left without a reply sent again, on a new connection.
// - A reply that cannot be parsed leaves nothing to wait for on the stream: the client shuts
//   down its sending half (`cut_socket`) and reads and drops everything until the server
//   closes the connection; here the rule rests on the server finishing its requests before
//   it closes a connection whose requests have ended.
// - A request failed while its copy may still be carried out (the reconnect deadline
//   passed during the drain) completes, but its slot stays taken as an *orphan*, without
//   bio or completion: a reply for it is received and dropped and frees the slot, and the
//   drain waits for it like any other. Orphans are freed when the old connection is over
//   (`end_old`). Meanwhile the device is down on this connection (new requests fail at
//   once), and with several connections the others take no write either
//   (`LinkState::orphaned`): a newer write there could land before the orphan's copy.
// - A send that cannot progress waits for the server to read (it reads requests as it
//   finishes others), until the deadline passes (over TLS it fails at the socket's send
//   timeout: the record is half sent); a request not written whole is marked not sent (no
//   server carries out a request it did not receive whole) and the stream is not written
//   again.
// - A server that cannot be heard (a cut link, a host gone) leaves the connection draining:
//   the reconnect deadline fails what waits, the device reports itself unavailable (a
//   mirror fails the leg, whose bits stay set) and it does not come back up, so nothing is
//   re-sent or recovered over the leg, until the old connection is over (the replies or the
//   server's close reach the client once the link is back, or the kernel gives the
//   connection up: TCP keepalive, see `connect::keepalive`).
//
// Lock order: the writer lock before the table lock; `sock` and `fatal` are leaves. No
// `end_io` runs under any of them (a bio coming back from `Writer::partial` is put back
// after the writer lock is dropped).

/// How a request ended, once known.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Status {
    Ok,
    /// The server's error value.
    Nbd(u32),
    /// The connection broke (or was not re-established in time): this errno.
    Lost(i32),
    /// A flush that cannot vouch for writes acknowledged on a lost connection (see
    /// `Table::unflushed_lost`).
    Unflushed,
}

/// What a successful reply does to its slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Success {
    /// The request completes with this status.
    Complete(Status),
    /// The write of an emulated FUA write: its flush is due next.
    FlushNext,
}

/// The connection's state (see the comment above).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Conn {
    Up,
    Down { since: Instant, expired: bool },
    Dead,
}

pub(super) struct Slot {
    pub(super) gen: u32,
    pub(super) busy: bool,
    pub(super) status: Option<Status>,
    pub(super) bio: Option<Bio>,
    pub(super) end: Option<DynArc<dyn EndIo>>,
    /// What is sent: the command (a write of an emulated FUA write becomes `Flush` once the
    /// write is answered) and its flags.
    pub(super) cmd: Command,
    pub(super) flags: CmdFlags,
    /// A FUA write to a server with flush but not FUA: a write, then a flush.
    pub(super) fua_flush: bool,
    /// Start and length of the request, bytes.
    pub(super) offset: u64,
    pub(super) len: u64,
    /// When the request was submitted, and last sent.
    pub(super) submitted: Instant,
    pub(super) sent_at: Instant,
    /// The connection it was last sent on (0: never).
    pub(super) sent_epoch: u64,
    /// For a block-status query, descriptor bytes kept.
    pub(super) covered: u64,
    /// For a read, the bytes its reply has filled (data and holes).
    pub(super) filled: Coverage,
    /// The first error chunk's value (structured replies).
    pub(super) error: u32,
    /// A flush: `Table::acked` when it was sent (the writes it covers for sure).
    pub(super) cover: u64,
    /// Completed (failed) while its copy on the old connection may still be carried out:
    /// the slot stays taken, without bio or completion, until its reply comes (received and
    /// dropped) or the old connection is over (see "The old connection").
    pub(super) orphan: bool,
}

impl Slot {
    /// The request to send for this slot, with cookie `gen << 32 | i`.
    pub(super) fn request(&self, i: usize) -> Request {
        let cookie = (u64::from(self.gen) << 32) | i as u64;
        let (offset, len) = if self.cmd == Command::Flush {
            (0, 0)
        } else {
            (self.offset, self.len)
        };
        Request::new(self.cmd, cookie, offset, len).with_flags(self.flags)
    }
}

pub(super) struct Table {
    pub(super) slots: Vec<Slot>,
    pub(super) free: Vec<u32>,
    pub(super) conn: Conn,
    /// The current connection's number (the first is 1).
    pub(super) epoch: u64,
    /// The current connection's `base:allocation` context id, if the server has one.
    pub(super) meta_id: Option<u32>,
    /// Some slot may be due and have no holder to send it: the sender thread looks.
    pub(super) send_needed: bool,
    /// The connection is down but not over: what was sent on it may still be carried out
    /// (see "The old connection").
    pub(super) draining: bool,
}

/// What a flush can vouch for, shared by every connection of a device (with multi-conn a
/// flush on one covers the writes completed on all).
///
/// When a connection to a server with a write cache is lost while writes acknowledged on it
/// are not covered by a flush, the server may have lost them (a crash loses its cache): the
/// next flush to complete cannot say they are durable, and fails with `EIO` instead, once.
/// Re-sending the flush on the new connection would vouch only for what that server holds.
/// Conservative: the counts are device-wide, so a lost connection poisons the next flush if
/// any connection had unflushed writes.
///
/// Orderings: the counters publish no data; what matters is that a write whose reply was
/// received before a flush was sent is counted in that flush's `cover`. The receiver counts
/// the write (`acked`, Release) after receiving its reply, and the flush's sender reads
/// `acked` (Acquire) before sending it: a read that sees the count saw the reply first, and
/// one that does not leaves the write uncovered (conservative). `flushed` only grows
/// (`fetch_max`) and is compared with `acked` when a connection is lost, on the receiver,
/// with the same pairing. `poisoned` is set and taken with `swap` (AcqRel): exactly one flush
/// takes it.
#[derive(Default)]
pub(super) struct Durability {
    /// Writes (trims, zeroes) acknowledged without FUA.
    pub(super) acked: AtomicU64,
    /// How many of them a completed flush covers.
    pub(super) flushed: AtomicU64,
    /// Writes acknowledged and not flushed were on a lost connection.
    pub(super) poisoned: AtomicBool,
}

impl Durability {
    /// The writes acknowledged so far (Acquire: see the type), if some are not covered by a
    /// completed flush: what a flush sent now covers.
    pub(super) fn unflushed(&self) -> Option<u64> {
        let acked = self.acked.load(Ordering::Acquire);
        (acked > self.flushed.load(Ordering::Acquire)).then_some(acked)
    }

    /// A connection to a server with a write cache was lost.
    pub(super) fn connection_lost(&self) -> bool {
        let acked = self.acked.load(Ordering::Acquire);
        if acked > self.flushed.fetch_max(acked, Ordering::AcqRel) {
            self.poisoned.store(true, Ordering::Release);
            return true;
        }
        false
    }
}

/// A completion to deliver once the table lock is dropped.
pub(super) type Done = (Bio, DynArc<dyn EndIo>, Status);

impl Table {
    pub(super) fn new(depth: usize) -> Self {
        let now = Instant::now();
        Self {
            slots: (0..depth)
                .map(|_| Slot {
                    gen: 0,
                    busy: false,
                    status: None,
                    bio: None,
                    end: None,
                    cmd: Command::Flush,
                    flags: CmdFlags::empty(),
                    fua_flush: false,
                    offset: 0,
                    len: 0,
                    submitted: now,
                    sent_at: now,
                    sent_epoch: 0,
                    covered: 0,
                    filled: Coverage::default(),
                    error: 0,
                    cover: 0,
                    orphan: false,
                })
                .collect(),
            // Popped from the end: slot 0 first.
            free: (0..depth as u32).rev().collect(),
            conn: Conn::Up,
            epoch: 1,
            meta_id: None,
            send_needed: false,
            draining: false,
        }
    }

    /// Whether slot `i` is due: busy, unanswered, not sent on the current connection, and the
    /// connection is up.
    pub(super) fn due(&self, i: usize) -> bool {
        self.conn == Conn::Up
            && self
                .slots
                .get(i)
                .is_some_and(|s| s.busy && s.status.is_none() && s.sent_epoch != self.epoch)
    }

    /// The slot a reply's cookie names, if it is awaiting a reply on the current connection
    /// (an orphan too: its reply is received and dropped).
    pub(super) fn lookup(&self, cookie: u64) -> Option<usize> {
        let i = (cookie & 0xffff_ffff) as usize;
        let s = self.slots.get(i)?;
        (s.busy
            && u64::from(s.gen) == cookie >> 32
            && (s.status.is_none() || s.orphan)
            && s.sent_epoch == self.epoch)
            .then_some(i)
    }

    /// Whether slot `i` is an orphan (see `Slot::orphan`).
    pub(super) fn is_orphan(&self, i: usize) -> bool {
        self.slots.get(i).is_some_and(|s| s.busy && s.orphan)
    }

    /// Frees orphan slot `i` (its reply came, or the old connection is over).
    pub(super) fn free_orphan(&mut self, i: usize) {
        if let Some(s) = self.slots.get_mut(i).filter(|s| s.busy && s.orphan) {
            // An orphan completed: its bio and completion went with it.
            debug_assert!(
                s.bio.is_none() && s.end.is_none(),
                "orphan slot {i} holds a bio"
            );
            s.busy = false;
            s.orphan = false;
            s.status = None;
            self.release(i);
        }
    }

    /// Puts slot `i`, just made free, back on the free stack, which has room for every slot
    /// and never holds one twice.
    fn release(&mut self, i: usize) {
        debug_assert!(
            self.free.len() < self.slots.len(),
            "slot {i} freed with every slot already free"
        );
        self.free.push(i as u32);
        #[cfg(debug_assertions)]
        self.check();
    }

    /// The slot table's invariants, checked in debug builds after each slot is freed and after
    /// a reconnection: a free slot is empty (no bio, completion, status, orphan), the free
    /// stack names exactly the free slots, and an orphan has completed (a status, no bio, no
    /// completion).
    #[cfg(debug_assertions)]
    fn check(&self) {
        let free = self.slots.iter().filter(|s| !s.busy).count();
        assert_eq!(
            free,
            self.free.len(),
            "the free stack does not match the free slots"
        );
        for (i, s) in self.slots.iter().enumerate() {
            if !s.busy {
                assert!(
                    s.bio.is_none() && s.end.is_none() && s.status.is_none() && !s.orphan,
                    "free slot {i} is not empty"
                );
            } else if s.orphan {
                assert!(
                    s.status.is_some() && s.bio.is_none() && s.end.is_none(),
                    "orphan slot {i} has not completed"
                );
            }
        }
    }

    /// The old connection is over: nothing drains, and the orphans' slots are free.
    pub(super) fn end_old(&mut self) {
        self.draining = false;
        for i in 0..self.slots.len() {
            self.free_orphan(i);
        }
    }

    /// Whether nothing sent on the current connection awaits a reply (orphans included):
    /// the server holds none of its requests.
    pub(super) fn answered(&self) -> bool {
        !self
            .slots
            .iter()
            .any(|s| s.busy && (s.status.is_none() || s.orphan) && s.sent_epoch == self.epoch)
    }

    /// Takes slot `i`'s completion out and frees the slot, if its status is known and its bio
    /// is in place. A request failed by the client (`Lost`) while its copy on the draining
    /// connection may still be carried out completes, but its slot stays taken as an orphan
    /// until that copy is answered or the connection is over.
    pub(super) fn take_done(&mut self, i: usize) -> Option<Done> {
        let (draining, epoch) = (self.draining, self.epoch);
        let s = self.slots.get_mut(i)?;
        if !s.busy || s.orphan || s.status.is_none() || s.bio.is_none() {
            return None;
        }
        let (bio, end, status) = (s.bio.take()?, s.end.take()?, s.status?);
        if draining && s.sent_epoch == epoch && matches!(status, Status::Lost(_)) {
            s.orphan = true;
            return Some((bio, end, status));
        }
        s.busy = false;
        s.status = None;
        self.release(i);
        Some((bio, end, status))
    }

    /// Sets `status` on every busy slot without one for which `pick` says so.
    pub(super) fn fail_where(&mut self, status: Status, pick: impl Fn(&Slot) -> bool) {
        for s in &mut self.slots {
            if s.busy && !s.orphan && s.status.is_none() && pick(s) {
                s.status = Some(status);
            }
        }
    }

    /// A successful reply to slot `i`: an emulated FUA write's write turns into its flush
    /// (a new cookie, due again); a write counts as acknowledged; a flush covers what was
    /// acknowledged when it was sent, or fails once after unflushed writes were lost.
    pub(super) fn succeeded(&mut self, i: usize, d: &Durability) -> Success {
        let s = &mut self.slots[i];
        // Only a reply that `lookup` matched, to a request still waiting, succeeds.
        debug_assert!(
            s.busy && s.status.is_none() && !s.orphan,
            "a success for slot {i}, which awaits none"
        );
        if s.fua_flush && s.cmd == Command::Write {
            s.cmd = Command::Flush;
            s.flags = CmdFlags::empty();
            s.gen = s.gen.wrapping_add(1);
            s.sent_epoch = 0;
            self.send_needed = true;
            return Success::FlushNext;
        }
        match s.cmd {
            Command::Write | Command::Trim | Command::WriteZeroes
                if !s.flags.contains(CmdFlags::FUA) =>
            {
                // Release: see `Durability`.
                d.acked.fetch_add(1, Ordering::Release);
            }
            Command::Flush => {
                // AcqRel: see `Durability`.
                d.flushed.fetch_max(s.cover, Ordering::AcqRel);
                if !s.fua_flush && d.poisoned.swap(false, Ordering::AcqRel) {
                    return Success::Complete(Status::Unflushed);
                }
            }
            _ => {}
        }
        Success::Complete(Status::Ok)
    }

    /// The connection broke at `now`: it is down (nothing is sent any more), unless it is
    /// already down or dead. Its requests keep their slots, and replies to them are still
    /// matched (the epoch is still its own) while the old connection drains.
    pub(super) fn go_down(&mut self, now: Instant) {
        self.draining = self.conn != Conn::Dead;
        if self.conn == Conn::Up {
            self.conn = Conn::Down {
                since: now,
                expired: false,
            };
        }
    }

    /// The old connection is over (see "The old connection" above): nothing sent on it can
    /// still run on the server. What is still waiting is to be sent again on the next
    /// connection (a read's partial data discarded, an emulated FUA write's flush turned back
    /// into its write), except what has been outstanding longer than `budget` (the timeout
    /// plus the reconnect deadline), which fails with `ETIMEDOUT`.
    pub(super) fn disconnect(&mut self, now: Instant, budget: Duration) {
        if self.conn == Conn::Dead {
            return;
        }
        self.go_down(now);
        self.end_old();
        self.fail_where(Status::Lost(libc::ETIMEDOUT), |s| {
            s.submitted + budget <= now
        });
        for s in &mut self.slots {
            // Over: no orphan is left, and nothing is marked sent on a connection.
            debug_assert!(!s.orphan, "an orphan outlived its connection");
            if s.busy && s.status.is_none() {
                s.covered = 0;
                s.filled.clear();
                s.error = 0;
                if s.fua_flush && s.cmd == Command::Flush {
                    s.cmd = Command::Write;
                }
            }
        }
        #[cfg(debug_assertions)]
        self.check();
    }
}

/// The socket's write half (none while disconnected), the mode its requests are encoded in,
/// and the buffer a request header is encoded into.
pub(super) struct Writer {
    pub(super) stream: Option<Stream>,
    /// The connection `stream` is (`Table::epoch` when it was made current).
    pub(super) epoch: u64,
    pub(super) mode: TransmissionMode,
    pub(super) header: [u8; 32],
    /// A request an inline send wrote only in part (see "Sending inline" in `send`): nothing
    /// else is written on the stream until the sender thread finishes it.
    pub(super) partial: Option<Partial>,
}

/// A request written in part by an inline send; its header is still in `Writer::header`.
pub(super) struct Partial {
    pub(super) slot: usize,
    /// The cookie and connection it was claimed with.
    pub(super) cookie: u64,
    pub(super) epoch: u64,
    /// The header's length, and the bytes of header and payload written so far.
    pub(super) header_len: usize,
    pub(super) written: usize,
    /// A write's bio, away with the writer (its slot is not freed meanwhile), and the
    /// payload's length.
    pub(super) bio: Option<Bio>,
    pub(super) len: usize,
}

/// What one connection of the device (a [`super::link::Link`]) shares between its
/// submitters, its receiver and its sender.
pub(super) struct LinkState {
    pub(super) uri: String,
    pub(super) table: Mutex<Table>,
    pub(super) writer: Mutex<Writer>,
    /// Submitters waiting for a free slot, or for the connection to fail or come back.
    pub(super) slot_freed: WaitQueue,
    /// The sender thread waits here for `Table::send_needed` or closing.
    pub(super) sender_wq: WaitQueue,
    /// The receiver waits here between reconnection attempts (woken by closing).
    pub(super) backoff_wq: WaitQueue,
    /// The export's transmission flags (`TransmissionFlags` bits), as the last handshake
    /// said. Relaxed: a standalone value, read once per request to choose its command; a
    /// request that reads the previous connection's flags is answered by the server (an
    /// error if it no longer supports it), never misread.
    pub(super) flags: AtomicU32,
    pub(super) limits: Limits,
    pub(super) timeout: Duration,
    pub(super) reconnect_deadline: Duration,
    /// Set by `Drop`: the receiver and the sender leave at their next look. Ordering: the flag
    /// publishes no data (the table has its own lock) and only decides whether a broken
    /// connection is logged, re-established, and when the threads stop; `Drop` stores it
    /// before it shuts the socket down and wakes the wait queues, and the threads, woken by
    /// that, load it. SeqCst is more than that needs and costs nothing here (once per wake-up
    /// of those threads, never per I/O).
    pub(super) closing: AtomicBool,
    /// A send on the current connection failed (its writer stream is dropped): the receiver
    /// gives the connection up at its next tick and drains it. Cleared when a connection comes up,
    /// under the writer lock, so a failure on an old connection (whose writer is gone by
    /// then) cannot set it for the new one. SeqCst: a flag between two threads that publishes
    /// no data, read once per tick of the receiver.
    pub(super) send_failed: AtomicBool,
    /// The reconnect deadline failed requests whose copies on this draining connection may
    /// still be carried out (orphans): until the connection is over, the device's other
    /// connections take no write, trim or zeroing either (a newer write there could land
    /// before such a copy). Set and cleared by the receiver (`expire`, `take_down`, `kill`);
    /// Release/Acquire: a caller that saw its write fail, then submits another, sees it.
    pub(super) orphaned: AtomicBool,
    /// Whether the connection is up: a hint for spreading requests over connections, kept
    /// with `Table::conn` (stored after it changes). Relaxed: a request sent to a connection
    /// that just went down waits for its reconnection like any other; nothing is ordered by
    /// it.
    pub(super) up: AtomicBool,
    /// A handle on the current socket to shut it down (the writer's may be held by a stuck
    /// sender).
    pub(super) sock: Mutex<Option<Stream>>,
    /// Connections re-established. Relaxed: a statistic, read by nobody who acts on it.
    pub(super) reconnects: AtomicU64,
    /// Whether submitters may send inline (`send=inline`, and not TLS).
    pub(super) inline: bool,
    /// Requests written whole by their submitter, and by the sender thread (an inline send's
    /// rest included). Relaxed: statistics.
    pub(super) sent_inline: AtomicU64,
    pub(super) sent_by_thread: AtomicU64,
    /// Why the device is dead, when the export changed under it.
    pub(super) fatal: Mutex<Option<String>>,
    /// What a flush can vouch for (shared by the device's connections).
    pub(super) durability: DynArc<Durability>,
    /// The owner's check of each new connection (shared by the device's connections).
    pub(super) hook: DynArc<super::check::Hook>,
}

impl LinkState {
    pub(super) fn flags(&self) -> TransmissionFlags {
        // Relaxed: see the field.
        TransmissionFlags::from_bits(self.flags.load(Ordering::Relaxed) as u16)
    }

    pub(super) fn is_up(&self) -> bool {
        // Relaxed: see the field.
        self.up.load(Ordering::Relaxed)
    }

    pub(super) fn is_closing(&self) -> bool {
        // SeqCst: see the field.
        self.closing.load(Ordering::SeqCst)
    }

    /// The error a bio completes with.
    pub(super) fn result(&self, status: Status) -> Result<(), Error> {
        match status {
            Status::Ok => Ok(()),
            Status::Nbd(e) => Err(nbd_error(e)),
            Status::Unflushed => Err(Error::Io(blk::error::with_context(
                io::Error::from_raw_os_error(libc::EIO),
                format!(
                    "{}: writes acknowledged on a connection that was lost had not been \
                     flushed; the server may have lost them, so this flush cannot vouch for \
                     them",
                    self.uri
                ),
            ))),
            Status::Lost(errno) => {
                let why = match &*self.fatal.lock() {
                    Some(f) => f.clone(),
                    None if errno == libc::ETIMEDOUT => format!(
                        "{}: request unanswered within the timeout and the reconnect deadline",
                        self.uri
                    ),
                    None => format!(
                        "{}: connection to the NBD server lost (reconnect_deadline={:?})",
                        self.uri, self.reconnect_deadline
                    ),
                };
                Err(Error::Io(blk::error::with_context(
                    io::Error::from_raw_os_error(errno),
                    why,
                )))
            }
        }
    }

    pub(super) fn deliver(&self, done: Done) {
        let (bio, end, status) = done;
        end.end_io(bio, self.result(status));
        self.slot_freed.wake_one();
    }

    /// Completes slot `i` if it can be (see the table's invariants).
    pub(super) fn complete(&self, i: usize) {
        let done = self.table.lock().take_done(i);
        if let Some(d) = done {
            self.deliver(d);
        }
    }

    /// Completes every slot that can be.
    pub(super) fn complete_all(&self) {
        let depth = self.table.lock().slots.len();
        for i in 0..depth {
            self.complete(i);
        }
    }

    /// Puts a bio its holder had away back into slot `i`, then completes the slot if its
    /// status is known, or flags the sender if it is due (it was skipped while away).
    pub(super) fn put_back(&self, i: usize, bio: Bio) {
        let (done, wake) = {
            let mut t = self.table.lock();
            if let Some(s) = t.slots.get_mut(i) {
                s.bio = Some(bio);
            }
            let done = t.take_done(i);
            let wake = done.is_none() && t.due(i);
            if wake {
                t.send_needed = true;
            }
            (done, wake)
        };
        if let Some(d) = done {
            self.deliver(d);
        }
        if wake {
            self.sender_wq.wake_one();
        }
    }

    /// Sets slot `i`'s status (if it has none) and, if its bio is in place, takes what
    /// completes it, for the caller to deliver (the receiver: `Receiver::deliver`). An
    /// orphan's reply only frees its slot.
    pub(super) fn finished(&self, i: usize, status: Status) -> Option<Done> {
        let mut t = self.table.lock();
        if t.is_orphan(i) {
            t.free_orphan(i);
            drop(t);
            self.slot_freed.wake_one();
            return None;
        }
        if let Some(s) = t.slots.get_mut(i).filter(|s| s.busy && s.status.is_none()) {
            s.status = Some(status);
        }
        t.take_done(i)
    }

    /// Shuts the current socket down both ways (the device is closing or dead): the receiver
    /// wakes and stops.
    pub(super) fn shut_socket(&self) {
        if let Some(s) = &*self.sock.lock() {
            let _ = s.shutdown(Shutdown::Both);
        }
    }

    /// Cuts the connection from this side after a reply that cannot be parsed: shuts down
    /// only its sending half, so that the server sees the end of the requests and the
    /// receiver can still hear when it closes (see "The old connection" above).
    pub(super) fn cut_socket(&self) {
        if let Some(s) = &*self.sock.lock() {
            let _ = s.shutdown(Shutdown::Write);
        }
    }

    /// Fails every request waiting in the table with `Lost(EIO)`, completes what can be and
    /// wakes every submitter waiting for a slot (they look again, and fail or take one).
    pub(super) fn fail_waiting(&self) {
        self.table
            .lock()
            .fail_where(Status::Lost(libc::EIO), |_| true);
        self.complete_all();
        self.slot_freed.wake_all();
    }

    /// The device is dead for good (closing, or the export changed: `why`): every request
    /// fails, now and later.
    pub(super) fn kill(&self, why: Option<String>) {
        if let Some(w) = why {
            *self.fatal.lock() = Some(w);
        }
        self.shut_socket();
        let back = self.drop_stream(&mut self.writer.lock());
        if let Some((i, bio)) = back {
            self.put_back(i, bio);
        }
        {
            let mut t = self.table.lock();
            t.conn = Conn::Dead;
            t.end_old();
        }
        // Release: see the field.
        self.orphaned.store(false, Ordering::Release);
        // Relaxed: see the field.
        self.up.store(false, Ordering::Relaxed);
        self.fail_waiting();
    }
}

/// NBD error values are Linux errnos; ENOTSUP becomes [`Error::NotSupported`].
pub(super) fn nbd_error(e: u32) -> Error {
    use nbd_proto::proto::*;
    let errno = match e {
        NBD_ENOTSUP => return Error::NotSupported("refused by the remote NBD server"),
        NBD_EPERM => libc::EPERM,
        NBD_ENOMEM => libc::ENOMEM,
        NBD_EINVAL => libc::EINVAL,
        NBD_ENOSPC => libc::ENOSPC,
        NBD_EOVERFLOW => libc::EOVERFLOW,
        NBD_ESHUTDOWN => libc::ESHUTDOWN,
        _ => libc::EIO,
    };
    Error::Io(io::Error::from_raw_os_error(errno))
}

#[cfg(all(test, debug_assertions))]
mod tests {
    use super::*;

    #[test]
    #[should_panic(expected = "freed with every slot already free")]
    fn a_slot_freed_twice_is_caught() {
        let mut t = Table::new(2);
        t.release(0);
    }

    #[test]
    #[should_panic(expected = "the free stack does not match the free slots")]
    fn a_busy_slot_on_the_free_stack_is_caught() {
        let mut t = Table::new(2);
        let i = t.free.pop().unwrap() as usize;
        t.slots[i].busy = true;
        t.release(i);
    }
}
