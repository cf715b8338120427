//! The in-flight table: one [`InFlight`] entry ("slot") per request, from the moment the
//! reader gives it a slot to the moment its reply has been sent; and [`EndIo`] for the
//! connection, which records each bio's result in its slot.
//!
//! Threads: the **reader** fills entries while staging and moves them into the table
//! (`reader.rs`, `commit`); **completion threads** of the device (or the reader itself, for
//! inline completions inside `submit_batch`) run [`ConnState::end_io`]; the **writer** of the
//! moment (`writer.rs`) takes ready slots, shapes and sends their replies and frees them. All of
//! it under the one connection lock ([`Locked`]).
//!
//! "Slot" means exactly one thing in this crate: an index of [`Locked::table`]. A bio names its
//! slot and its part of the request in its `cookie` ([`bio_cookie`], [`split_cookie`]).

use std::os::fd::RawFd;

use blk::stats::DiskCounters;
use blk::{Bio, BioFlags, Buffer, EndIo, Op};
use blkq_sync::atomic::AtomicBool;
use blkq_sync::thread::{self, Thread};
use blkq_sync::Mutex;
use waitq::WaitQueue;

use super::output::Output;
use crate::server::limits::MemoryBudget;
use crate::server::shared::StickyError;
use crate::stream::Stream;
use blkq_sync::DynArc as Arc;
use nbd_proto::proto::{CmdFlags, Command, Errno, TransmissionMode};
use nbd_proto::transmission::{ExtentExt, Request};

/// One piece of a read: data read by one bio, or a hole sent as `OFFSET_HOLE`.
#[derive(Debug, Default)]
pub(super) struct Part {
    /// Export offset of the piece, bytes.
    pub(super) offset: u64,
    /// Length of the piece, bytes.
    pub(super) len: u64,
    /// A hole: no bio, sent as `NBD_REPLY_TYPE_OFFSET_HOLE`.
    pub(super) hole: bool,
    /// The data, once its bio completed.
    pub(super) buf: Option<Buffer>,
    /// Data with no bio and no buffer: the writer splices it from the device straight into
    /// the socket when it sends the reply (`splice.rs`).
    pub(super) spliced: bool,
}

/// A request on its way through the connection: staged by the reader, then a slot of the
/// table until its reply is sent. The same type in both places: the reader stages into spare
/// entries and swaps each into its slot, so nothing is copied field by field and the vectors
/// keep their capacity.
#[derive(Debug, Default)]
pub(super) struct InFlight {
    /// The client's cookie, echoed in the reply.
    pub(super) cookie: u64,
    /// Offset of the request, bytes.
    pub(super) offset: u64,
    /// Length of the request, bytes.
    pub(super) length: u64,
    /// The command; `None` for a command this server does not know (answered with an error).
    pub(super) command: Option<Command>,
    /// The request's flags.
    pub(super) flags: CmdFlags,
    /// The reply's error (the first one wins); `None` for success.
    pub(super) error: Option<Errno>,
    /// Bios submitted and not yet completed; the reply is ready when this reaches 0.
    pub(super) bios_pending: u32,
    /// Bytes counted against the connection's in-flight budget (reads and writes: their
    /// payload; block status: the extents it may answer).
    pub(super) budget_bytes: u64,
    /// Reads: the parts, in offset order.
    pub(super) parts: Vec<Part>,
    /// Block status: the map of each context answered, in the codec's terms, one after the
    /// other.
    pub(super) extents: Vec<ExtentExt>,
    /// Block status: each context answered, in reply order: its id and its number of
    /// extents in `extents`.
    pub(super) contexts: Vec<(u32, u32)>,
    /// When the request reached the device (coarse clock, ns): set only for exports whose
    /// disk counters the server keeps ([`ConnState::disk`]).
    pub(super) start_ns: u64,
}

impl InFlight {
    /// Starts this (recycled, empty) entry over for the request `r`.
    pub(super) fn start(&mut self, r: &Request) {
        self.begin(r.cookie, r.offset, r.length, Some(r.kind), r.flags);
    }

    /// Starts this (recycled, empty) entry over with the raw fields of a request.
    pub(super) fn begin(
        &mut self,
        cookie: u64,
        offset: u64,
        length: u64,
        command: Option<Command>,
        flags: CmdFlags,
    ) {
        self.cookie = cookie;
        self.offset = offset;
        self.length = length;
        self.command = command;
        self.flags = flags;
        self.error = None;
        self.bios_pending = 0;
        self.budget_bytes = 0;
        self.clear_data();
    }

    /// Records an error unless one is already recorded (the first one wins).
    pub(super) fn fail(&mut self, e: Errno) {
        self.error.get_or_insert(e);
    }

    /// Drops the parts (and their buffers, back to their pools) and the extents, keeping the
    /// vectors' capacity.
    pub(super) fn clear_data(&mut self) {
        self.parts.clear();
        self.extents.clear();
        self.contexts.clear();
    }

    /// The block op this request submits, for the server-side disk counters: `None` for
    /// commands that submit no bio (block status, cache, unknown ones). Counted only for
    /// entries that have bios in flight.
    pub(super) fn disk_op(&self) -> Option<Op> {
        Some(match self.command? {
            Command::Read => Op::Read,
            Command::Write => Op::Write,
            Command::Flush => Op::Flush,
            Command::Trim => Op::Discard,
            Command::WriteZeroes => Op::WriteZeroes,
            _ => return None,
        })
    }

    /// Whether this is a read (whose reply carries data, or is an error chunk).
    pub(super) fn is_read(&self) -> bool {
        self.command == Some(Command::Read)
    }
}

/// A bio's cookie: its slot (high 32 bits) and its part of the request (low 32 bits; reads
/// larger than the device's maximum I/O, or split around holes, are several bios).
pub(super) fn bio_cookie(slot: u32, part: u32) -> u64 {
    (u64::from(slot) << 32) | u64::from(part)
}

/// The slot and part a bio's cookie names (see [`bio_cookie`]).
pub(super) fn split_cookie(cookie: u64) -> (usize, usize) {
    ((cookie >> 32) as usize, (cookie & 0xffff_ffff) as usize)
}

/// What the connection lock protects.
///
/// | field              | meaning                                                          |
/// |--------------------|------------------------------------------------------------------|
/// | `table`            | the in-flight table: one [`InFlight`] per slot                   |
/// | `free_slots`       | slots not in use (popped by the reader only)                     |
/// | `ready_slots`      | slots whose reply can be written, in completion order            |
/// | `bytes_in_flight`  | sum of the slots' `budget_bytes`                                 |
/// | `writer_token`     | `Some`: nobody is writing; take it to become the writer          |
/// | `handed_off`       | a writer's token and half-sent output, for the flusher           |
/// | `stop_flusher`     | teardown: the flusher returns once nothing is handed off         |
/// | `reader_waiting`   | the reader sleeps on `reader_wake` until a slot frees up         |
pub(super) struct Locked {
    pub(super) table: Vec<InFlight>,
    pub(super) free_slots: Vec<u32>,
    pub(super) ready_slots: Vec<u32>,
    pub(super) bytes_in_flight: u64,
    pub(super) writer_token: Option<Box<Output>>,
    pub(super) handed_off: Option<Box<Output>>,
    pub(super) stop_flusher: bool,
    pub(super) reader_waiting: bool,
}

impl Locked {
    /// A table of `slots` empty entries, all free, with the writer token in place.
    pub(super) fn new(slots: usize) -> Self {
        Self {
            table: (0..slots).map(|_| InFlight::default()).collect(),
            free_slots: (0..slots as u32).rev().collect(),
            ready_slots: Vec::with_capacity(slots),
            bytes_in_flight: 0,
            writer_token: Some(Box::default()),
            handed_off: None,
            stop_flusher: false,
            reader_waiting: false,
        }
    }

    /// Nothing in flight, nobody writing, nothing handed off.
    pub(super) fn idle(&self) -> bool {
        self.free_slots.len() == self.table.len()
            && self.writer_token.is_some()
            && self.handed_off.is_none()
            && self.ready_slots.is_empty()
    }
}

/// The part of a connection that the reader, completion threads, writers and the flusher
/// share (it is the [`EndIo`] of every bio the connection submits).
pub(super) struct ConnState {
    /// The socket handle writers send on (kept open as long as this lives).
    pub(super) send_sock: Stream,
    /// `send_sock`'s descriptor, for `sendmsg`.
    pub(super) send_fd: RawFd,
    /// The TLS session when the connection speaks TLS (`transport.rs`, `crate::tls`).
    pub(super) tls: Option<blkq_sync::DynArc<crate::tls::TlsSession>>,
    /// Headers and reply types negotiated in the handshake.
    pub(super) mode: TransmissionMode,
    /// The export's block size (block-status extents are cut to multiples of it).
    pub(super) min_block: u32,
    /// The reader's thread: completions it runs inline (inside `submit_batch`) leave the
    /// writing to it, since it flushes right after submitting.
    pub(super) reader_thread: Thread,
    /// A send failed: the client is gone; replies are dropped from now on.
    pub(super) client_gone: AtomicBool,
    /// The reader sleeps here for a free slot (and, at teardown, for the table to drain);
    /// woken by whoever frees slots while `Locked::reader_waiting` is set.
    pub(super) reader_wake: WaitQueue,
    /// The flusher sleeps here until an output is handed off or it is told to stop.
    pub(super) flusher_wake: WaitQueue,
    /// The table and the writer token.
    pub(super) locked: Mutex<Locked>,
    /// The export's sticky write error (shared with every connection to the export).
    pub(super) sticky: Arc<StickyError>,
    /// The server's memory budget: a slot's `budget_bytes` go back to it when the slot is
    /// freed.
    pub(super) budget: Arc<MemoryBudget>,
    /// The export's disk counters kept by the server (a device without its own), counted
    /// when a request's last bio completes; `None` when the device counts.
    pub(super) disk: Option<Arc<DiskCounters>>,
    /// The export's device when large reads are spliced (a plaintext connection to a device
    /// that can: `splice.rs`); `None` otherwise.
    pub(super) splice_dev: Option<Arc<dyn blk::Device>>,
}

/// Whether the caller runs on thread `t`: a [`ThreadId`](std::thread::ThreadId) comparison
/// (never the per-CPU hint slot). Outside loom the caller's id is cached in a thread-local, so
/// a completion pays one TLS read, not a clone of its thread handle.
#[cfg(not(blkq_loom))]
fn runs_on(t: &Thread) -> bool {
    std::thread_local! {
        static MY_ID: std::thread::ThreadId = thread::current().id();
    }
    MY_ID.with(|id| *id == t.id())
}

/// Whether the caller runs on thread `t` (loom: no cache).
#[cfg(blkq_loom)]
fn runs_on(t: &Thread) -> bool {
    thread::current().id() == t.id()
}

impl EndIo for ConnState {
    fn end_io(&self, bio: Bio, res: Result<(), blk::Error>) {
        self.record(bio, res);
        if !runs_on(&self.reader_thread) {
            self.flush();
        }
    }

    /// The reply waits for `end_batch`: the run's replies go out with one writer's pass.
    fn end_io_batched(&self, bio: Bio, res: Result<(), blk::Error>) {
        self.record(bio, res);
    }

    fn end_batch(&self) {
        if !runs_on(&self.reader_thread) {
            self.flush();
        }
    }
}

impl ConnState {
    /// Records a bio's result in its slot; the slot is ready to reply to once its request's
    /// last bio is recorded. Whoever writes next sends the reply (`end_io`: this thread,
    /// unless it is the reader, which flushes after submitting).
    fn record(&self, mut bio: Bio, res: Result<(), blk::Error>) {
        let (slot, part) = split_cookie(bio.cookie);
        let mut buf = bio.buf.take();
        // Error stickiness (see `StickyError`): a failed write or flush marks the export;
        // from then on a FLUSH or FUA write that the device completed still fails with EIO.
        let durable = bio.op == Op::Flush || bio.flags.contains(BioFlags::FUA);
        if let Err(e) = &res {
            if fails_write_back(&bio, e) {
                self.sticky.set();
            }
        }
        let sticky_eio = durable && res.is_ok() && self.sticky.is_set();
        {
            let mut guard = self.locked.lock();
            let locked = &mut *guard;
            if let Some(entry) = locked.table.get_mut(slot) {
                if let Err(e) = &res {
                    entry.fail(Errno::from_errno(e.errno()));
                } else if sticky_eio {
                    entry.fail(Errno::Io);
                }
                if bio.op == Op::Read {
                    if let Some(p) = entry.parts.get_mut(part) {
                        p.buf = buf.take();
                    }
                }
                if entry.bios_pending > 0 {
                    if let (1, Some(d)) = (entry.bios_pending, &self.disk) {
                        // The request's last bio: count the request, failed if any of its
                        // bios failed.
                        if let Some(op) = entry.disk_op() {
                            let sectors = entry.length >> blk::SECTOR_SHIFT;
                            let ok = entry.error.is_none();
                            d.completed(op, sectors, entry.start_ns, blk::stats::batch_ns(), ok);
                        }
                    }
                    entry.bios_pending -= 1;
                    if entry.bios_pending == 0 {
                        locked.ready_slots.push(slot as u32);
                    }
                }
            }
        }
        // Write buffers go back to their pool outside the lock.
        drop(buf);
    }
}

/// Whether a bio's failure is a failed write-back, which fails the export (`StickyError`):
/// any failed write, write-zeroes or flush, but a `FAST_ZERO` write-zeroes refused with
/// `ENOTSUP`. That refusal is the flag's expected answer from a device that cannot zero
/// without writing, and it leaves the device untouched ("fail fast without modifying the
/// disk"; clients such as `qemu-img convert` probe with it and fall back to writing zeros),
/// so no data anyone was promised is lost.
fn fails_write_back(bio: &Bio, err: &blk::Error) -> bool {
    match bio.op {
        Op::Write | Op::Flush => true,
        Op::WriteZeroes => {
            !(bio.flags.contains(BioFlags::FAST_ZERO) && err.errno() == libc::ENOTSUP)
        }
        Op::Read | Op::Discard => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cookies_carry_slot_and_part() {
        let c = bio_cookie(7, 3);
        assert_eq!(split_cookie(c), (7, 3));
        assert_eq!(
            split_cookie(bio_cookie(0, 5) | bio_cookie(u32::MAX, 0)),
            (u32::MAX as usize, 5)
        );
    }

    #[test]
    fn runs_on_compares_threads_not_cpu_slots() {
        let me = thread::current();
        assert!(runs_on(&me));
        let other = std::thread::spawn(move || runs_on(&me)).join().unwrap();
        assert!(!other);
    }

    #[test]
    fn first_error_wins_and_start_resets() {
        let mut e = InFlight::default();
        e.fail(Errno::Io);
        e.fail(Errno::Inval);
        assert_eq!(e.error, Some(Errno::Io));
        e.parts.push(Part::default());
        e.extents.push(ExtentExt {
            length: 1,
            flags: 0,
        });
        e.begin(1, 2, 3, None, CmdFlags::empty());
        assert_eq!(e.error, None);
        assert!(e.parts.is_empty() && e.extents.is_empty());
        assert!(!e.is_read());
    }

    #[test]
    fn a_fresh_table_is_idle() {
        let locked = Locked::new(4);
        assert!(locked.idle());
        assert_eq!(locked.free_slots.last(), Some(&0));
    }
}
