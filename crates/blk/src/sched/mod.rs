//! I/O schedulers: `none` (no scheduler: requests go straight to the driver) and `mq-deadline`
//! ([`Deadline`]), with the lock around a scheduler's state in three designs ([`SchedLock`],
//! serialized dispatch with inserter hand-off): `locked` (one mutex for insert and dispatch),
//! `serialized` (one owner at a time; inserters that find it taken leave their requests in
//! per-thread buckets; one dispatcher that finds it taken stands by for the owner's hand-off,
//! the others leave) and `serialized-leave` (every dispatcher that finds it taken leaves).
//! [`Scheduler`] is the trait the queue calls a scheduler through.

use std::str::FromStr;

use blkq_sync::atomic::{AtomicU64, Ordering};

use crate::queue::{Request, RequestQueue, RequestToken};
use crate::Error;

pub mod deadline;
pub mod lock;

pub use deadline::{Deadline, DeadlineStats, DeadlineTunables, PrioStats};
pub use lock::{LockMode, LockStats, SchedLock};

/// Which scheduler a queue runs (`--sched`, spec option `sched=`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SchedChoice {
    /// No scheduler.
    #[default]
    None,
    /// mq-deadline.
    MqDeadline,
}

impl SchedChoice {
    /// The spelling of `--sched`: `none` or `mq-deadline`.
    pub fn name(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::MqDeadline => "mq-deadline",
        }
    }
}

impl FromStr for SchedChoice {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        match s {
            "none" => Ok(Self::None),
            "mq-deadline" | "deadline" | "mq_deadline" => Ok(Self::MqDeadline),
            _ => Err(Error::Config(format!(
                "unknown scheduler {s:?} (expected none or mq-deadline)"
            ))),
        }
    }
}

/// Where a scheduler reads the time: [`MonotonicClock`] normally, [`ManualClock`] in tests.
pub trait Clock: Send + Sync {
    /// Now, in ns, on a clock that never goes back.
    fn now_ns(&self) -> u64;
}

/// The coarse monotonic clock (`CLOCK_MONOTONIC_COARSE`: a few ns per read, a resolution of
/// 1-4 ms, like the kernel's jiffies that mq-deadline's expiries are counted in), read through
/// [`crate::stats::batch_ns`]: inside a dispatch the queue has opened a
/// [`crate::stats::ClockBatch`] for, the scheduler's insert and dispatch share the batch's one
/// read with its completions (its expiries, hundreds of ms, are far above the error).
#[derive(Debug, Clone, Copy, Default)]
pub struct MonotonicClock;

impl Clock for MonotonicClock {
    #[inline]
    fn now_ns(&self) -> u64 {
        crate::stats::batch_ns()
    }
}

/// A clock that moves only when told to (tests).
#[derive(Debug, Default)]
pub struct ManualClock {
    ns: AtomicU64,
}

impl ManualClock {
    /// A clock at `ns`.
    pub fn new(ns: u64) -> Self {
        Self {
            ns: AtomicU64::new(ns),
        }
    }

    /// Moves the clock forward by `d`.
    pub fn advance(&self, d: std::time::Duration) {
        self.ns.fetch_add(
            d.as_nanos().min(u128::from(u64::MAX)) as u64,
            Ordering::Relaxed,
        );
    }

    /// Sets the clock (it must not go back: callers' business).
    pub fn set_ns(&self, ns: u64) {
        self.ns.store(ns, Ordering::Relaxed);
    }
}

impl Clock for ManualClock {
    fn now_ns(&self) -> u64 {
        self.ns.load(Ordering::Relaxed)
    }
}

/// An I/O scheduler, between the plug and the driver (`none` is no scheduler at all: requests
/// go straight to the driver). mq-deadline implements this ([`crate::sched::Deadline`]).
///
/// # Contract
///
/// The queue calls [`Scheduler::insert_batch`] with every batch (a flushed plug, or one bio of
/// [`crate::Queue::submit`]) and then [`Scheduler::dispatch`] until it returns 0 or the driver has
/// no room ([`Driver::can_queue`](crate::Driver::can_queue)). A scheduler may return 0 while it
/// still holds requests only if another thread is inside its insert or dispatch and will
/// dispatch them (mq-deadline's `serialized` lock), or the driver has no room. `sink` runs the
/// driver: never call it while holding a lock that `insert_batch`, `dispatch` or `completed`
/// take, since the driver may complete inline and the completion may submit again.
pub trait Scheduler: Send + Sync {
    /// The scheduler's name (`--sched`).
    fn name(&self) -> &'static str;
    /// Called once, when the queue that owns the scheduler is built: size per-request state
    /// here ([`RequestQueue::nr_requests`]), so that inserting allocates nothing.
    fn attach(&self, _q: &RequestQueue) {}
    /// Takes one request of a batch being flushed.
    fn insert(&self, q: &RequestQueue, rq: RequestToken);
    /// Takes a batch of requests (default: [`Scheduler::insert`] for each).
    fn insert_batch(&self, q: &RequestQueue, rqs: &mut dyn Iterator<Item = RequestToken>) {
        for r in rqs {
            self.insert(q, r);
        }
    }
    /// Hands up to `max` requests to `sink`, in dispatch order; returns how many. Called after
    /// every batch of inserts, until it hands out nothing.
    fn dispatch(&self, q: &RequestQueue, max: usize, sink: &mut dyn FnMut(RequestToken)) -> usize;
    /// The most tags of a pool of `depth` that *asynchronous* requests ([`crate::Op::is_sync`]
    /// false: writes without FUA/SYNC, discards, write-zeroes) may hold at once, so that
    /// synchronous ones always find a tag under a write flood (the kernel's `limit_depth`
    /// hook; mq-deadline's `async_depth`). Read by the queue for every asynchronous request
    /// before it allocates the tag, so a change applies to the next allocation. `None`, or
    /// `depth` or more: no limit (the default).
    fn async_depth(&self, _depth: u32) -> Option<u32> {
        None
    }
    /// Called by [`RequestQueue::complete`] for every request it completes (each request of a
    /// merge chain), before its bio is handed back. Must not block.
    fn completed(&self, _q: &RequestQueue, _rq: &Request) {}
    /// Acquisitions of the scheduler's lock, and how many found it taken.
    fn lock_stats(&self) -> LockStats {
        LockStats::default()
    }
    /// The scheduler as `Any`, to reach its own statistics (`None`: not supported).
    fn as_any(&self) -> Option<&dyn std::any::Any> {
        None
    }
}
