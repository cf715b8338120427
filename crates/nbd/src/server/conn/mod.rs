//! One connection: the handshake, then the transmission data path. This file owns the
//! [`Connection`] (what the reader thread holds) and says who runs what; the rooms:
//!
//! | file          | owns                                                    | run by             |
//! |---------------|---------------------------------------------------------|--------------------|
//! | `mod.rs`      | `serve`, [`Connection`]: setup, the reader loop, waiting for slots, teardown | reader |
//! | `reader.rs`   | recv, decode, validate, stage, commit + submit           | reader             |
//! | `recv.rs`, `parse_state.rs`, `pools.rs` | the reader's receive rules (large writes, the mid-request timeout), what a parse pass leaves, the payload buffer pools | reader |
//! | `block_status.rs` | a block-status request's budget and its staging (the extent maps) | reader |
//! | `inflight.rs` | the in-flight table (one `InFlight` per slot), `end_io` | reader, completion threads, writers |
//! | `output.rs`   | the writer's `Output` (segments, buffers, TLS ciphertext, the splice pipe of `pipe.rs`) | the writer |
//! | `reply.rs`    | reply shaping: an entry's reply as headers + data segments | the writer       |
//! | `writer.rs`   | the combining writer (token, `sendmsg`) and its flusher  | reader, completion threads, flusher |
//! | `transport.rs`, `splice.rs`, `send.rs` | the TLS and the spliced branches of the send, what a send achieved | the writer |
//!
//! A READ, top to bottom: [`Connection::run`] → `reader.rs` (`recv`, `parse`, `stage_read`,
//! `commit`: slot + `submit_batch`) → `inflight.rs` (`end_io`: the buffer into its part, the
//! slot onto the ready list) → `writer.rs` (`flush`, `run_writer`: shape with `reply.rs`,
//! `sendmsg`, free the slot).
//!
//! # Threads
//!
//! - The **reader** (the connection's own thread) reads into a receive buffer, decodes every
//!   whole request in it, stages them, takes the connection lock once to give each a slot of
//!   the in-flight table, submits all the bios with one [`Device::submit_batch`](blk::Device::submit_batch) (one plug),
//!   then flushes replies.
//! - Device **completion threads** (when the driver has them) run `end_io`: the bio's status
//!   and read buffer go into its slot; when the request's last bio is done the slot goes on the
//!   ready list, and the completing thread flushes if nobody is writing, without blocking.
//! - The **flusher** (one sleeping thread per connection) takes over a write that would have
//!   blocked, so that neither the reader nor a driver's completion thread ever waits on a slow
//!   client.
//!
//! Every wait goes through a [`waitq::WaitQueue`] of the connection's `ConnState`: the reader
//! on `reader_wake` (for a slot, or at teardown for the table to drain), the flusher on
//! `flusher_wake`.
//!
//! # Allocation
//!
//! The table is preallocated (`Tuning::slots` entries) and staging recycles the entries it
//! swaps out of the table; buffers come from per-connection pools by size class; vectors are
//! reused. After warm-up the data path allocates nothing, except the `Vec` that
//! `Device::extents` returns (one per structured read of a device whose allocation map costs
//! no I/O, `Caps::slow_extents`, and
//! per `NBD_CMD_BLOCK_STATUS`) and the plug `Queue::submit_batch` allocates per batch.

mod block_status;
mod home;
mod inflight;
mod output;
mod parse_state;
mod pipe;
mod pools;
mod reader;
mod recv;
mod reply;
mod send;
mod splice;
pub(super) mod splice_rule;
mod transport;
mod writer;

use std::io;
use std::net::Shutdown;
use std::os::fd::AsRawFd;
use std::panic::AssertUnwindSafe;
use std::time::{Duration, Instant};
// `std`'s `Arc`, not the facade's: `blk::Device` and `blk::EndIo` take `std::sync::Arc`.
use blkq_sync::DynArc as Arc;

use blk::{Bio, EndIo};
use blkq_sync::atomic::{AtomicBool, Ordering};
use blkq_sync::thread::{self, JoinHandle};
use blkq_sync::Mutex;
use tracing::{debug, error, info, warn};
use waitq::WaitQueue;

use self::inflight::{ConnState, InFlight, Locked};
use self::parse_state::{ParseStop, PartialWrite};
use self::pools::BufferPools;
use self::recv::MidRequest;
use super::handshake::{self, Deadlined, Ended, Negotiated};
use super::shared::{ExportState, ServerState};
use super::stats::HandshakeFailure;
use crate::stream::Stream;
use nbd_proto::proto::TransmissionMode;

/// Largest piece of a read or write: one bio, one pooled buffer.
const MAX_BIO_BYTES: usize = 1 << 20;

/// Runs a connection to its end: handshake, transmission, teardown.
pub(crate) fn serve(mut stream: Stream, server: Arc<ServerState>, id: u64) {
    let peer = stream.peer();
    let started = Instant::now();
    let _ = stream.set_nodelay();
    let deadline = started + server.tuning.handshake_timeout;
    let negotiated =
        match handshake::negotiate(&mut Deadlined::new(&mut stream, deadline), &server, id) {
            Ok(n) => n,
            Err(ended) => {
                handshake_ended(&server, id, &peer, ended);
                server.unregister(id);
                return;
            }
        };
    server.counters.transmission();
    // Held by `Arc` for the connection's life: the table may lose it meanwhile (a removal
    // drains this connection first).
    let export = negotiated.export.clone();
    let export = &*export;
    let tls = stream.is_tls();
    let replies = match negotiated.mode {
        TransmissionMode::Simple => "simple",
        TransmissionMode::Structured => "structured",
        TransmissionMode::Extended => "extended",
    };
    info!(
        conn = id,
        %peer,
        export = %export.export.name,
        replies,
        base_allocation = negotiated.contexts.base_allocation,
        dirty_bitmaps = negotiated.contexts.bitmaps.len(),
        via = negotiated.via,
        tls,
        "connection open"
    );
    let base_allocation = negotiated.contexts.base_allocation;
    let (reason, stats) = match Connection::new(stream, &server, export, negotiated) {
        // A panic on the reader (a bug here, or in a device's `submit`, which runs on this
        // thread) fails this connection only: `Connection`'s `Drop` closes its socket, stops
        // its flusher and gives back its budget; the registry entry goes below. The other
        // connections and the device carry on.
        Ok(mut conn) => match std::panic::catch_unwind(AssertUnwindSafe(|| conn.run())) {
            Ok(reason) => {
                conn.teardown(&reason);
                (reason, conn.stats)
            }
            Err(p) => {
                let what = p
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| p.downcast_ref::<String>().cloned())
                    .unwrap_or_default();
                let reason = format!("internal error (panic: {what})");
                error!(conn = id, %peer, export = %export.export.name, "closing connection: {reason}");
                let stats = conn.stats;
                drop(conn);
                (reason, stats)
            }
        },
        Err(e) => (format!("could not start: {e}"), Stats::default()),
    };
    server.counters.closed(
        stats.requests,
        stats.refused,
        stats.bytes_read,
        stats.bytes_written,
    );
    info!(
        conn = id,
        %peer,
        export = %export.export.name,
        replies,
        base_allocation,
        tls,
        requests = stats.requests,
        refused = stats.refused,
        bytes_read = stats.bytes_read,
        bytes_written = stats.bytes_written,
        spliced_reads = stats.spliced_reads,
        copied_large_reads = stats.copied_large_reads,
        duration_s = started.elapsed().as_secs_f64(),
        reason = %reason,
        "connection closed: {reason}"
    );
    server.unregister(id);
}

/// A handshake that ended without a transmission phase: counted by reason, and logged with
/// it (`reason`, the same word as the `blkq_nbd_handshake_failures_total` label).
fn handshake_ended(server: &ServerState, id: u64, peer: &str, ended: Ended) {
    let why = match &ended {
        _ if server.was_evicted(id) => HandshakeFailure::Evicted,
        Ended::Client(_) => HandshakeFailure::ClientAbort,
        Ended::Timeout => HandshakeFailure::Timeout,
        Ended::Limit(_) => HandshakeFailure::Limit,
        Ended::Protocol(_) => HandshakeFailure::Protocol,
        Ended::Io(_) => HandshakeFailure::Io,
        Ended::Refused { .. } => HandshakeFailure::Policy,
    };
    server.counters.handshake_failed(why);
    let reason = why.as_str();
    match ended {
        _ if why == HandshakeFailure::Evicted => info!(
            conn = id,
            %peer,
            reason,
            "connection closed in the handshake to make room for a newer one \
             (--max-connections)"
        ),
        Ended::Client(what) => {
            info!(conn = id, %peer, reason, "connection closed in the handshake: client {what}");
        }
        Ended::Timeout => info!(
            conn = id,
            %peer,
            reason,
            "closing connection: handshake not finished within {:?}",
            server.tuning.handshake_timeout
        ),
        Ended::Limit(what) | Ended::Protocol(what) => {
            warn!(conn = id, %peer, reason, "closing connection during the handshake: {what}");
        }
        Ended::Refused { export, refusal } => {
            warn!(
                conn = id,
                %peer,
                export = %export,
                reason,
                rule = refusal.reason(),
                "closing connection: NBD_OPT_EXPORT_NAME refused: {refusal}"
            );
        }
        Ended::Io(e) => {
            debug!(conn = id, %peer, reason, "handshake ended: {e}");
        }
    }
}

/// Per-connection counters for the close log line (and the server's totals).
#[derive(Debug, Default, Clone, Copy)]
struct Stats {
    requests: u64,
    /// Bytes of the READs decoded and staged (not refused).
    bytes_read: u64,
    /// Bytes of the WRITEs decoded and staged (not refused).
    bytes_written: u64,
    /// Requests answered with an error before reaching the device (unknown command, bad
    /// range or flags); errors the device returns are not counted here.
    refused: u64,
    /// Large reads spliced and copied by the splice rule's choice (`splice_rule.rs`).
    spliced_reads: u64,
    copied_large_reads: u64,
}

/// What the reader thread holds: the receive side, staging, and a handle on the shared core.
struct Connection<'a> {
    /// What the reader shares with completions, writers and the flusher.
    core: Arc<ConnState>,
    /// `core` as the `EndIo` of every bio.
    end_io: Arc<dyn EndIo>,
    flusher: Option<JoinHandle<()>>,
    /// The socket, read by the reader (writers send on their own handle, `core.send_sock`).
    stream: Stream,
    server: &'a ServerState,
    export: &'a ExportState,
    mode: TransmissionMode,
    /// The metadata contexts selected: what `NBD_CMD_BLOCK_STATUS` answers.
    contexts: handshake::Selection,
    min_block: u64,
    max_block: u64,
    /// Largest bio (and pooled buffer), a multiple of the block size.
    max_bio_bytes: usize,
    buffers: BufferPools,
    recv_buf: Vec<u8>,
    /// Decoded up to here; `recv_buf[recv_pos..recv_len]` is waiting.
    recv_pos: usize,
    recv_len: usize,
    /// Payload bytes still to skip (of a refused request).
    discard_left: u64,
    /// The refused request whose payload is being skipped: staged (its error reply sent)
    /// once `discard_left` reaches 0.
    discarding: Option<InFlight>,
    /// Requests decoded and checked, waiting for a slot (in order).
    staged: Vec<InFlight>,
    /// Budget bytes of `staged`.
    staged_bytes: u64,
    /// Empty entries to stage into: what `commit` swapped out of the table.
    spare_entries: Vec<InFlight>,
    /// Bios of the staged entries, in order.
    bios: Vec<Bio>,
    /// Bios of the write being read (`partial_write`), or being staged.
    write_bios: Vec<Bio>,
    /// The device's extents for a block status or a sparse read, reused from request to
    /// request (it grows to the largest map asked for, then allocates no more).
    extents_buf: Vec<blk::Extent>,
    /// The same for a dirty bitmap's runs.
    dirty_buf: Vec<blk::DirtyExtent>,
    partial_write: Option<PartialWrite>,
    /// The last write staged was a large one (`reader.rs`, [`recv::BIG_WRITE`]): the next
    /// reads ask the socket for less, so that the payloads that follow land in their own
    /// buffers rather than in `recv_buf` (from which they would be copied once more).
    big_writes: bool,
    /// The last request staged was a write received into its home (`home.rs`): the next
    /// reads ask the socket for one request header, leaving the payload behind it there.
    home_writes: bool,
    /// When the reader last received bytes (or last started listening after a wait of its
    /// own): the idle timeout counts from here.
    last_recv: Instant,
    /// The request in progress (`reader.rs`, [`MidRequest`]): the mid-request
    /// timeout counts from its start, not from its last byte.
    mid: MidRequest,
    stats: Stats,
    /// Which large reads are spliced (`splice_rule.rs`).
    splice_chooser: splice_rule::SpliceChooser,
    /// Requests of this connection in flight (slots taken) when the parse pass began.
    in_flight: usize,
    /// `teardown` ran (the normal end); `Drop` cleans up after a panic otherwise.
    torn_down: bool,
}

impl Drop for Connection<'_> {
    /// After a panic unwound out of `run` (`teardown` did not run): close the socket, so that
    /// the flusher and any reply still being written fail fast instead of waiting on the
    /// client; stop and join the flusher; give back the budget of what was never submitted.
    /// Requests already in the device complete into the shared core, which lives until the
    /// last of them, and give back their budget as their replies fail to send.
    fn drop(&mut self) {
        if self.torn_down {
            return;
        }
        let _ = self.stream.shutdown(Shutdown::Both);
        let mut dropped = self.partial_write.take().map_or(0, |p| p.budget_bytes());
        dropped += self.staged.iter().map(|e| e.budget_bytes).sum::<u64>();
        self.server.budget.give(dropped);
        self.core.locked.lock().stop_flusher = true;
        self.core.flusher_wake.wake_one();
        if let Some(f) = self.flusher.take() {
            let _ = f.join();
        }
    }
}

/// A zero duration means "no timeout" to a socket: use a millisecond instead.
fn nonzero(d: Duration) -> Duration {
    d.max(Duration::from_millis(1))
}

/// How long a blocked read may sleep before the reader looks at its timeouts: the shorter of
/// the idle timeout and the send timeout (which also bounds a stall in mid-request).
fn recv_tick(t: &super::config::Tuning) -> Duration {
    nonzero(
        t.idle_timeout
            .map_or(t.send_timeout, |i| i.min(t.send_timeout)),
    )
}

impl<'a> Connection<'a> {
    fn new(
        stream: Stream,
        server: &'a ServerState,
        export: &'a ExportState,
        negotiated: Negotiated,
    ) -> io::Result<Self> {
        let tuning = &server.tuning;
        let limits = export.export.device.limits();
        let min_block = export.min_block;
        let max_bio_bytes = (limits.max_io_bytes as usize).clamp(min_block as usize, MAX_BIO_BYTES);
        let max_bio_bytes = max_bio_bytes / min_block as usize * min_block as usize;
        let send_sock = stream.try_clone()?;
        let send_fd = send_sock.as_raw_fd();
        // Socket timeouts for transmission (they belong to the socket, so both handles have
        // them): a blocking send that makes no progress for `send_timeout` fails (the client
        // stopped reading its replies); a read wakes up at least every `recv_tick` so the
        // reader can apply the idle and mid-request timeouts (`Connection::recv_timed_out`).
        stream.set_write_timeout(Some(nonzero(tuning.send_timeout)))?;
        stream.set_read_timeout(Some(recv_tick(tuning)))?;
        // Best effort: a bigger send buffer means fewer replies handed to the flusher.
        let _ = crate::sys::set_send_buffer(send_fd, crate::sys::SEND_BUFFER);
        let tls = send_sock.tls_session().cloned();
        let core = Arc::new(ConnState {
            tls: tls.clone(),
            send_sock,
            send_fd,
            mode: negotiated.mode,
            min_block,
            reader_thread: thread::current(),
            client_gone: AtomicBool::new(false),
            reader_wake: WaitQueue::new(),
            flusher_wake: WaitQueue::new(),
            locked: Mutex::new(Locked::new(tuning.slots)),
            sticky: export.failed.clone(),
            budget: server.budget.clone(),
            disk: export.disk.clone(),
            splice_dev: (tls.is_none() && export.export.device.caps().splice)
                .then(|| export.export.device.clone()),
        });
        let flusher_core = core.clone();
        // A failed spawn (out of threads) fails the connection, which is then closed.
        #[cfg(not(blkq_loom))]
        let flusher = std::thread::Builder::new()
            .name("nbd-flush".into())
            .spawn(move || flusher_core.flusher_main())?;
        #[cfg(blkq_loom)]
        let flusher = thread::spawn(move || flusher_core.flusher_main());
        let end_io: Arc<dyn EndIo> = core.clone();
        Ok(Self {
            core,
            end_io,
            flusher: Some(flusher),
            stream,
            server,
            export,
            mode: negotiated.mode,
            contexts: negotiated.contexts,
            min_block: u64::from(min_block),
            max_block: u64::from(handshake::block_size(export, tuning.max_block).max),
            max_bio_bytes,
            buffers: BufferPools::new(max_bio_bytes),
            recv_buf: vec![0; tuning.recv_buf],
            recv_pos: 0,
            recv_len: 0,
            discard_left: 0,
            discarding: None,
            staged: Vec::with_capacity(tuning.slots),
            staged_bytes: 0,
            spare_entries: Vec::with_capacity(tuning.slots),
            bios: Vec::with_capacity(tuning.slots),
            write_bios: Vec::new(),
            extents_buf: Vec::new(),
            dirty_buf: Vec::new(),
            partial_write: None,
            big_writes: false,
            home_writes: false,
            last_recv: Instant::now(),
            mid: MidRequest::default(),
            stats: Stats::default(),
            splice_chooser: splice_rule::SpliceChooser::new(tuning.splice_rule, Instant::now()),
            in_flight: 0,
            torn_down: false,
        })
    }

    /// The reader loop; returns why it ended.
    fn run(&mut self) -> String {
        loop {
            if self.core.client_gone.load(Ordering::Relaxed) {
                return "replies could not be sent (the client stopped reading them, or is gone)"
                    .into();
            }
            if self.partial_write.is_some() {
                if let Err(reason) = self.fill_partial_write() {
                    return reason;
                }
            }
            let (free_slots, budget_left) = self.wait_for_room();
            self.in_flight = self.server.tuning.slots.saturating_sub(free_slots);
            let stop = self.parse(free_slots, budget_left);
            self.commit();
            match stop {
                ParseStop::NeedMore => {
                    if let Err(reason) = self.recv() {
                        return reason;
                    }
                }
                ParseStop::Full | ParseStop::PartialWrite => {}
                ParseStop::NoBudget(need) => self.wait_for_budget(need),
                ParseStop::Disconnect => return "client disconnected (NBD_CMD_DISC)".into(),
                ParseStop::Fatal(reason) => {
                    warn!(peer = %self.stream, "closing connection: {reason}");
                    self.core.client_gone.store(true, Ordering::Relaxed);
                    let _ = self.stream.shutdown(Shutdown::Both);
                    return reason;
                }
            }
        }
    }

    /// Waits until staging can make progress: a free slot, and either room in the byte
    /// budget or something already staged. Returns the free slots and the budget left.
    fn wait_for_room(&mut self) -> (usize, u64) {
        let budget = self.server.tuning.max_bytes_in_flight;
        let nothing_staged = self.staged.is_empty();
        let room = |locked: &Locked| {
            let free = locked.free_slots.len();
            let left = budget.saturating_sub(locked.bytes_in_flight);
            (free > 0 && (left > 0 || !nothing_staged)).then_some((free, left))
        };
        let waiting = Instant::now();
        let room = self.reader_wait(room);
        // Time spent waiting here is not the client's silence.
        self.last_recv = Instant::now();
        self.mid.excuse(self.last_recv - waiting);
        room
    }

    /// Waits until `need` bytes fit in the global memory budget (the reader stops reading
    /// meanwhile), or the connection has no reason to wait any more (the client is gone, the
    /// server stops: the next pass finds out).
    fn wait_for_budget(&mut self, need: u64) {
        const SLICE: Duration = Duration::from_millis(100);
        let budget = &self.server.budget;
        let waiting = Instant::now();
        while !budget.wait_fit(need, Instant::now() + SLICE) {
            if self.core.client_gone.load(Ordering::Relaxed)
                || self.server.stopping()
                || self.export.is_removed()
            {
                break;
            }
        }
        self.last_recv = Instant::now();
        self.mid.excuse(self.last_recv - waiting);
    }

    /// A read gave up (nothing received for a `recv_tick`, or a TLS record still partial after
    /// one): `Some(reason)` to close the connection. Closed when a request in progress (a
    /// partial request, payload or TLS record) has not been finished, nor
    /// [`recv::PROGRESS_QUANTUM`] bytes of it received, within the send timeout of its start;
    /// or when nothing is in flight and nothing came for the idle timeout.
    pub(super) fn recv_timed_out(&mut self, mid_request: bool) -> Option<String> {
        let partial_record = self.stream.partial_record_since();
        if mid_request || partial_record.is_some() {
            let started = self
                .mid
                .started(partial_record.unwrap_or_else(Instant::now));
            return self.overdue(started, Instant::now());
        }
        let quiet = self.last_recv.elapsed();
        let idle = self.server.tuning.idle_timeout?;
        if quiet < idle || !self.staged.is_empty() || !self.core.locked.lock().idle() {
            return None;
        }
        Some(format!("idle for {idle:?} (--idle-timeout)"))
    }

    /// Bytes came at `now`: `Some(reason)` to close the connection if the request in progress
    /// is overdue all the same (a client trickling its request never lets a read time out).
    pub(super) fn received(&mut self, n: usize, now: Instant) -> Option<String> {
        self.last_recv = now;
        let started = self.mid.received(n, now)?;
        self.overdue(started, now)
    }

    /// `Some(reason)` when a request in progress since `started` has gone past the send
    /// timeout at `now`.
    fn overdue(&self, started: Instant, now: Instant) -> Option<String> {
        let send_timeout = self.server.tuning.send_timeout;
        let took = now.saturating_duration_since(started);
        (took >= send_timeout).then(|| {
            format!(
                "a request begun {took:?} ago is still not received (less than {} KiB of it \
                 came within the send timeout, {send_timeout:?})",
                recv::PROGRESS_QUANTUM >> 10,
            )
        })
    }

    /// The reader's one way to wait for the table: returns `check`'s value once it is `Some`.
    /// When it is `None` and replies are ready with nobody writing, the reader writes them
    /// itself (that frees slots); otherwise it sleeps on `reader_wake` with `reader_waiting`
    /// set, until whoever frees slots wakes it (`writer.rs`).
    ///
    /// The protocol is the wait queue's prepare / re-check / sleep / finish: the reader queues
    /// itself, then re-checks and sets `reader_waiting` under the connection lock; a writer
    /// frees slots and takes `reader_waiting` under that lock, then wakes. So either the
    /// re-check sees the freed slots, or the writer sees the flag (and the reader queued).
    fn reader_wait<T>(&self, mut check: impl FnMut(&Locked) -> Option<T>) -> T {
        // Replies are ready and nobody is writing: the reader can free slots itself.
        let can_write =
            |locked: &Locked| !locked.ready_slots.is_empty() && locked.writer_token.is_some();
        loop {
            let locked = self.core.locked.lock();
            if let Some(v) = check(&locked) {
                return v;
            }
            if can_write(&locked) {
                drop(locked);
                self.core.flush();
                continue;
            }
            drop(locked);
            let waiter = self.core.reader_wake.prepare();
            let mut locked = self.core.locked.lock();
            if let Some(v) = check(&locked) {
                drop(locked);
                waiter.finish();
                return v;
            }
            if can_write(&locked) {
                // Go round and write.
                drop(locked);
            } else {
                locked.reader_waiting = true;
                drop(locked);
                waiter.sleep();
            }
            waiter.finish();
        }
    }

    /// Waits for every in-flight request to be answered (or dropped, if the client is gone),
    /// then stops the flusher.
    fn teardown(&mut self, reason: &str) {
        self.torn_down = true;
        self.stats.spliced_reads = self.splice_chooser.spliced_reads;
        self.stats.copied_large_reads = self.splice_chooser.copied_reads;
        debug!(peer = %self.stream, "tearing down: {reason}");
        // A write still arriving, or staged requests that never got a slot, are dropped,
        // and the memory budget they took is given back.
        let mut dropped = 0;
        if let Some(p) = self.partial_write.take() {
            dropped += p.budget_bytes();
        }
        self.write_bios.clear();
        self.discarding = None;
        if !self.staged.is_empty() {
            // Only possible if slots ran out at the very end; answer nothing for them.
            dropped += self.staged.iter().map(|e| e.budget_bytes).sum::<u64>();
            self.staged.clear();
            self.bios.clear();
        }
        self.server.budget.give(dropped);
        self.core.flush();
        self.reader_wait(|locked| locked.idle().then_some(()));
        self.core.locked.lock().stop_flusher = true;
        self.core.flusher_wake.wake_one();
        if let Some(f) = self.flusher.take() {
            let _ = f.join();
        }
        if !self.core.client_gone.load(Ordering::Relaxed) {
            // No writer can be active now (nothing in flight, the flusher joined).
            self.stream.close_notify();
        }
        let _ = self.stream.shutdown(Shutdown::Both);
    }
}
