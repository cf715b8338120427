//! I/O schedulers: `none` (no scheduler: requests go straight to the driver) and `mq-deadline`
//! ([`Deadline`]), with the lock around a scheduler's state in three designs ([`SchedLock`],
//! serialized dispatch with inserter hand-off): `locked` (one mutex for insert and dispatch),
//! `serialized` (one owner at a time; inserters that find it taken leave their requests in
//! per-thread buckets; one dispatcher that finds it taken stands by for the owner's hand-off,
//! the others leave) and `serialized-leave` (every dispatcher that finds it taken leaves).

use std::str::FromStr;

use blkq_sync::atomic::{AtomicU64, Ordering};

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
