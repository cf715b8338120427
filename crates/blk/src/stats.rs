//! Queue statistics: `/sys/block/*/stat`-style disk counters, tag-wait statistics, and what
//! only a request queue counts ([`QueueStats`]).
//!
//! Disk counters are sharded by thread slot ([`blkq_sync::stat::ShardedCounters`]), incremented
//! with `Relaxed` adds by whichever thread submits or completes, and summed on read: a reader may
//! see a snapshot torn between shards, which is fine for statistics. Times use the coarse monotonic
//! clock (a few ns to read, ~1-4 ms resolution, like the kernel's jiffies-based `io_ticks`),
//! because a precise clock costs ~33 ns per read on these machines.
//!
//! # One clock read per batch
//!
//! Even the coarse clock is read at most once per batch, not twice per I/O (as the kernel
//! caches the time in its plug since 6.9, and ends a batch of requests with one time):
//!
//! - **Submission**: a request's start time is its plug's time, read when the first request of
//!   a plug batch takes its tag ([`crate::Plug`]; cleared when the plug is flushed, and re-read
//!   after a tag wait). An unplugged [`crate::Queue::submit`] is a batch of one.
//! - **Completion**: inside a [`ClockBatch`] scope, every [`crate::RequestQueue::complete`] on the
//!   thread shares the time of the scope's first completion ([`batch_ns`]). The queue opens
//!   one around each dispatch (a flushed plug, a scheduler's dispatch round), which covers
//!   drivers that complete inline (`null`, `mem`); a driver's completion thread opens one per
//!   batch it reaps, or passes its own time to [`crate::RequestQueue::complete_at`]. mq-deadline's
//!   clock ([`crate::sched::MonotonicClock`]) reads through [`batch_ns`] as well, so a flushed
//!   plug's insert, dispatch rounds and inline completions share one read.
//!
//! What this changes in the statistics: `ticks_ns` (and `time_in_queue_ns`, `io_ticks_ns`) are
//! measured from the plug's first tag to the completion batch's first completion, instead of
//! from each request's tag to its own completion. The error is bounded by the time a plug
//! takes to fill plus the time a completion batch takes to run; for the in-memory drivers
//! (tens of us for a plug of 32 x 4 KiB) that is far below the coarse clock's own 1-4 ms
//! resolution, so the figures do not change. Drivers whose inline completion is slow (the
//! `file` driver's synchronous engine: a `pread` per request) read the clock per request with
//! [`crate::RequestQueue::complete_at`], so their batches do not stretch the error.

use std::time::Instant;

use crate::bio::Op;
use crate::sched::lock::LockStats;
use blkq_sync::atomic::{AtomicU64, Ordering};
use blkq_sync::stat::{Ordering as StatOrdering, ShardedCounters};
use waitq::{HistogramSnapshot, LatencyHistogram};

/// Coarse monotonic time in ns (CLOCK_MONOTONIC_COARSE).
///
/// Under loom it is always 0: loom does not model time, and a clock read that decides
/// whether an atomic operation happens (the `io_ticks` CAS below, a scheduler's expiries)
/// would make a model's executions differ from run to run, which loom cannot explore.
#[cfg(blkq_loom)]
#[inline]
pub fn coarse_ns() -> u64 {
    0
}

/// Coarse monotonic time in ns (CLOCK_MONOTONIC_COARSE).
#[cfg(not(blkq_loom))]
#[inline]
pub fn coarse_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    #[cfg(debug_assertions)]
    CLOCK_READS.with(|c| c.set(c.get() + 1));
    // SAFETY: `ts` is a valid, writable timespec; the clock id is a constant the kernel knows.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC_COARSE, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

#[cfg(all(debug_assertions, not(blkq_loom)))]
std::thread_local! {
    /// [`coarse_ns`] calls by this thread (debug builds), for [`clock_reads`].
    static CLOCK_READS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// How many times the current thread has read the coarse clock ([`coarse_ns`]), for tests
/// that count clock reads per I/O. Debug builds only: always 0 in release builds and under
/// loom.
pub fn clock_reads() -> u64 {
    #[cfg(all(debug_assertions, not(blkq_loom)))]
    {
        CLOCK_READS.with(|c| c.get())
    }
    #[cfg(not(all(debug_assertions, not(blkq_loom))))]
    {
        0
    }
}

/// [`BATCH_NOW`] outside any [`ClockBatch`]: every completion reads the clock.
#[cfg(not(blkq_loom))]
const OUTSIDE: u64 = u64::MAX;
/// [`BATCH_NOW`] in a [`ClockBatch`] whose first completion has not come yet.
#[cfg(not(blkq_loom))]
const UNREAD: u64 = u64::MAX - 1;

#[cfg(not(blkq_loom))]
std::thread_local! {
    /// The current thread's completion-batch time: [`OUTSIDE`], [`UNREAD`], or the coarse
    /// time read by the batch's first completion (never near `u64::MAX`: that is 584 years of
    /// uptime). A plain `Cell` with a const initializer and no destructor: reading it costs
    /// a TLS access and never allocates (so it is safe on every path, the allocator's too).
    static BATCH_NOW: std::cell::Cell<u64> = const { std::cell::Cell::new(OUTSIDE) };
}

/// A scope in which the current thread's completions share one coarse clock read (module
/// docs): the first [`batch_ns`] inside it reads the clock, the others reuse that time.
/// Scopes nest (an `end_io` that submits again, inside a dispatch): the inner one reads its own
/// time, and the outer one gets its own back when the inner one ends.
///
/// Under loom it does nothing ([`coarse_ns`] is always 0 there).
#[must_use = "the batch ends when the guard is dropped"]
#[derive(Debug)]
pub struct ClockBatch {
    #[cfg(not(blkq_loom))]
    prev: u64,
    /// Thread-bound: the scope is the current thread's.
    _not_send: std::marker::PhantomData<*const ()>,
}

impl ClockBatch {
    /// Opens a batch on the current thread.
    #[inline]
    pub fn enter() -> Self {
        Self {
            #[cfg(not(blkq_loom))]
            prev: BATCH_NOW.with(|c| c.replace(UNREAD)),
            _not_send: std::marker::PhantomData,
        }
    }
}

impl Drop for ClockBatch {
    #[inline]
    fn drop(&mut self) {
        #[cfg(not(blkq_loom))]
        BATCH_NOW.with(|c| c.set(self.prev));
    }
}

/// The coarse time for an event now on this thread: inside a [`ClockBatch`], the batch's one
/// read (taken by its first caller); outside, a fresh [`coarse_ns`].
#[inline]
pub fn batch_ns() -> u64 {
    #[cfg(not(blkq_loom))]
    {
        BATCH_NOW.with(|c| match c.get() {
            OUTSIDE => coarse_ns(),
            UNREAD => {
                let now = coarse_ns();
                c.set(now);
                now
            }
            now => now,
        })
    }
    #[cfg(blkq_loom)]
    {
        coarse_ns()
    }
}

/// Counter indices in [`DiskCounters`]' shards: five per-direction pairs, errors, then the
/// discard and flush groups (`/sys/block/*/stat`'s fields 12-17).
const IOS: usize = 0;
const MERGES: usize = 2;
const SECTORS: usize = 4;
const TICKS_NS: usize = 6;
const SUBMITTED: usize = 8;
const ERRORS: usize = 10;
const DISCARD_IOS: usize = 11;
const DISCARD_SECTORS: usize = 12;
const DISCARD_TICKS_NS: usize = 13;
const FLUSH_IOS: usize = 14;
const FLUSH_TICKS_NS: usize = 15;
const NCOUNTERS: usize = 16;

/// A snapshot of the disk counters, the fields of `/sys/block/*/stat` (index 0 read, 1 write).
///
/// The write direction (index 1) counts every op that is not a read: discards, flushes and
/// write-zeroes are folded into `ios[1]` and `ticks_ns[1]` (`sectors[1]` counts only the
/// sectors of writes that carry data). The discard and flush fields count those ops again on
/// their own, as the kernel's discard and flush columns do, so a reader that wants the
/// kernel's "writes" subtracts them (`writes_completed() ...`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DiskStats {
    /// Completed I/Os.
    pub ios: [u64; 2],
    /// Bios merged into an existing request.
    pub merges: [u64; 2],
    /// Sectors moved.
    pub sectors: [u64; 2],
    /// Time spent by completed I/Os, from allocation to completion, ns (coarse clock).
    pub ticks_ns: [u64; 2],
    /// Requests submitted but not completed.
    pub in_flight: [u64; 2],
    /// Time with at least one I/O in flight, ns.
    pub io_ticks_ns: u64,
    /// Sum over time of the number of I/Os in flight (ns x I/Os).
    pub time_in_queue_ns: u64,
    /// Completed I/Os whose status was an error.
    pub errors: u64,
    /// Completed discards (also counted in `ios[1]`).
    pub discard_ios: u64,
    /// Sectors discarded.
    pub discard_sectors: u64,
    /// Time spent by completed discards, ns (also in `ticks_ns[1]`).
    pub discard_ticks_ns: u64,
    /// Completed flushes (also counted in `ios[1]`).
    pub flush_ios: u64,
    /// Time spent by completed flushes, ns (also in `ticks_ns[1]`).
    pub flush_ticks_ns: u64,
}

impl DiskStats {
    /// Completed writes in the kernel's sense: write direction minus discards and flushes
    /// (write-zeroes stay writes, as in the kernel).
    pub fn writes_completed(&self) -> u64 {
        self.ios[1]
            .saturating_sub(self.discard_ios)
            .saturating_sub(self.flush_ios)
    }

    /// Time of completed writes in the kernel's sense, ns (see [`DiskStats::writes_completed`]).
    pub fn write_ticks_ns(&self) -> u64 {
        self.ticks_ns[1]
            .saturating_sub(self.discard_ticks_ns)
            .saturating_sub(self.flush_ticks_ns)
    }

    /// I/Os in flight, both directions.
    pub fn io_now(&self) -> u64 {
        self.in_flight[0] + self.in_flight[1]
    }
}

/// Sharded disk counters.
#[derive(Debug)]
pub struct DiskCounters {
    counters: ShardedCounters<NCOUNTERS>,
    /// io_ticks accounting: the last time in-flight went non-zero is folded in on completion.
    io_ticks: AtomicU64,
    last_ts: AtomicU64,
}

impl Default for DiskCounters {
    fn default() -> Self {
        Self::new()
    }
}

impl DiskCounters {
    /// Zeroed counters.
    pub fn new() -> Self {
        Self {
            counters: ShardedCounters::new(),
            io_ticks: AtomicU64::new(0),
            last_ts: AtomicU64::new(coarse_ns()),
        }
    }

    /// Counts a submission.
    #[inline]
    pub fn submitted(&self, dir: usize) {
        self.counters.add(SUBMITTED + (dir & 1), 1);
    }

    /// Counts a submission at `now_ns` (coarse clock), and keeps `io_ticks` honest: like the
    /// kernel's `update_io_ticks` at the start of an I/O, the first submission of a clock
    /// tick moves the shared timestamp to now, and adds the time since the last one only if
    /// I/Os were in flight meanwhile (the shard sums are read then, once per tick at most).
    /// Without this an idle gap before a submission would be counted as busy time by the
    /// next completion.
    #[inline]
    pub fn started(&self, dir: usize, now_ns: u64) {
        if let Some(gap) = self.advance_ts(now_ns) {
            if self.in_flight() > 0 {
                self.io_ticks.fetch_add(gap, Ordering::Relaxed);
            }
        }
        self.submitted(dir);
    }

    /// Moves the shared timestamp to `now_ns` if it is later and no other thread moved it
    /// first: the time since the old timestamp, or `None` where this call did not move it.
    #[inline]
    fn advance_ts(&self, now_ns: u64) -> Option<u64> {
        let last = self.last_ts.load(Ordering::Relaxed);
        (now_ns > last
            && self
                .last_ts
                .compare_exchange(last, now_ns, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok())
        .then(|| now_ns - last)
    }

    /// I/Os submitted and not completed (summed over shards; may be torn).
    fn in_flight(&self) -> u64 {
        let c = &self.counters;
        (c.sum(SUBMITTED) + c.sum(SUBMITTED + 1)).saturating_sub(c.sum(IOS) + c.sum(IOS + 1))
    }

    /// Counts a merge.
    #[inline]
    pub fn merged(&self, dir: usize) {
        self.counters.add(MERGES + (dir & 1), 1);
    }

    /// Counts a completion of an `op` over `sectors` that started at `start_ns` (coarse
    /// clock). Only reads and writes add `sectors` to the direction's sectors; a discard's go
    /// to the discard sectors.
    #[inline]
    pub fn completed(&self, op: Op, sectors: u64, start_ns: u64, now_ns: u64, ok: bool) {
        let s = self.counters.local();
        let dir = op.dir();
        let ticks = now_ns.saturating_sub(start_ns);
        s[IOS + dir].fetch_add(1, StatOrdering::Relaxed);
        if op.has_data() {
            s[SECTORS + dir].fetch_add(sectors, StatOrdering::Relaxed);
        }
        s[TICKS_NS + dir].fetch_add(ticks, StatOrdering::Relaxed);
        match op {
            Op::Discard => {
                s[DISCARD_IOS].fetch_add(1, StatOrdering::Relaxed);
                s[DISCARD_SECTORS].fetch_add(sectors, StatOrdering::Relaxed);
                s[DISCARD_TICKS_NS].fetch_add(ticks, StatOrdering::Relaxed);
            }
            Op::Flush => {
                s[FLUSH_IOS].fetch_add(1, StatOrdering::Relaxed);
                s[FLUSH_TICKS_NS].fetch_add(ticks, StatOrdering::Relaxed);
            }
            _ => {}
        }
        if !ok {
            s[ERRORS].fetch_add(1, StatOrdering::Relaxed);
        }
        // io_ticks: advance a shared timestamp at most once per clock tick (the coarse clock
        // changes every few ms), so this shared line is written rarely. A completion always
        // had itself in flight since the timestamp (`started` moved it at or before this
        // I/O's start), so the time is busy time.
        if let Some(gap) = self.advance_ts(now_ns) {
            self.io_ticks.fetch_add(gap, Ordering::Relaxed);
        }
    }

    /// A snapshot.
    pub fn snapshot(&self) -> DiskStats {
        let c = &self.counters;
        let pair = |i: usize| [c.sum(i), c.sum(i + 1)];
        let mut d = DiskStats {
            ios: pair(IOS),
            merges: pair(MERGES),
            sectors: pair(SECTORS),
            ticks_ns: pair(TICKS_NS),
            errors: c.sum(ERRORS),
            discard_ios: c.sum(DISCARD_IOS),
            discard_sectors: c.sum(DISCARD_SECTORS),
            discard_ticks_ns: c.sum(DISCARD_TICKS_NS),
            flush_ios: c.sum(FLUSH_IOS),
            flush_ticks_ns: c.sum(FLUSH_TICKS_NS),
            ..DiskStats::default()
        };
        let submitted = pair(SUBMITTED);
        d.in_flight = [0, 1].map(|dir| submitted[dir].saturating_sub(d.ios[dir]));
        d.io_ticks_ns = self.io_ticks.load(Ordering::Relaxed);
        d.time_in_queue_ns = d.ticks_ns[0] + d.ticks_ns[1];
        d
    }
}

/// Tag-wait statistics: how often submitters slept for a tag, and for how long.
#[derive(Debug, Default)]
pub struct WaitStats {
    hist: LatencyHistogram,
    min: AtomicU64,
}

/// A snapshot of [`WaitStats`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WaitSnapshot {
    /// Number of waits.
    pub count: u64,
    /// Shortest wait, ns (0 if none).
    pub min_ns: u64,
    /// Mean wait, ns.
    pub mean_ns: u64,
    /// Longest wait, ns.
    pub max_ns: u64,
    /// Upper bound of the 99th percentile, ns (log2 buckets).
    pub p99_ns: u64,
    /// The log2 histogram.
    pub hist: HistogramSnapshot,
}

impl WaitStats {
    /// No waits yet.
    pub fn new() -> Self {
        Self {
            hist: LatencyHistogram::new(),
            min: AtomicU64::new(u64::MAX),
        }
    }

    /// Starts timing a wait.
    #[inline]
    pub fn start(&self) -> Instant {
        Instant::now()
    }

    /// Records a wait that started at `t0`.
    #[inline]
    pub fn record(&self, t0: Instant) {
        let ns = t0.elapsed().as_nanos() as u64;
        self.hist.record(ns);
        self.min.fetch_min(ns, Ordering::Relaxed);
    }

    /// A snapshot.
    pub fn snapshot(&self) -> WaitSnapshot {
        let hist = self.hist.snapshot();
        let count = hist.count();
        WaitSnapshot {
            count,
            min_ns: if count == 0 {
                0
            } else {
                self.min.load(Ordering::Relaxed)
            },
            mean_ns: hist.mean(),
            max_ns: hist.max,
            p99_ns: hist.quantile_upper(0.99),
            hist,
        }
    }
}

/// What only a request queue counts, beyond the disk statistics every device may have
/// ([`crate::Device::queue_stats`]).
#[derive(Debug, Clone)]
pub struct QueueStats {
    /// Tag waits, per hardware context (one entry with shared tags).
    pub tag_waits: Vec<WaitSnapshot>,
    /// The scheduler's, if the queue runs one (`None`: `none`).
    pub sched: Option<SchedStats>,
}

/// A queue's scheduler and its lock contention ([`QueueStats::sched`]).
#[derive(Debug, Clone)]
pub struct SchedStats {
    /// The scheduler's name (`mq-deadline`).
    pub name: &'static str,
    /// Its lock's contention.
    pub lock: LockStats,
}

#[cfg(all(test, not(blkq_loom)))]
mod tests {
    use super::*;

    #[test]
    fn discards_and_flushes_have_their_own_columns() {
        let c = DiskCounters::new();
        let t = coarse_ns();
        for (op, sectors) in [
            (Op::Read, 8),
            (Op::Write, 128),
            (Op::Discard, 2048),
            (Op::Flush, 0),
            (Op::WriteZeroes, 16),
        ] {
            c.started(op.dir(), t);
            c.completed(op, sectors, t, t, true);
        }
        let s = c.snapshot();
        assert_eq!(s.ios, [1, 4]);
        assert_eq!(s.sectors, [8, 128]);
        assert_eq!(
            (s.discard_ios, s.discard_sectors, s.flush_ios),
            (1, 2048, 1)
        );
        assert_eq!(s.writes_completed(), 2);
        assert_eq!(s.io_now(), 0);
        assert_eq!(s.errors, 0);
    }

    #[test]
    fn idle_time_is_not_busy_time() {
        let c = DiskCounters::new();
        // Explicit times past the counters' creation: an idle second, then a 5 ns I/O.
        let t = coarse_ns() + 1_000_000_000;
        c.started(0, t);
        assert_eq!(c.snapshot().io_ticks_ns, 0, "the idle gap was counted");
        assert_eq!(c.snapshot().in_flight, [1, 0]);
        c.completed(Op::Read, 8, t, t + 5, true);
        assert_eq!(c.snapshot().io_ticks_ns, 5);
        // Busy across a submission: the time up to it counts.
        c.started(0, t + 10);
        c.started(0, t + 20);
        c.completed(Op::Read, 8, t + 10, t + 30, true);
        c.completed(Op::Read, 8, t + 20, t + 30, true);
        assert_eq!(c.snapshot().io_ticks_ns, 5 + 20);
    }
}
