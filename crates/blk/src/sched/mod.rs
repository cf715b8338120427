//! I/O schedulers: `none` (no scheduler: requests go straight to the driver) and
//! `mq-deadline` ([`Deadline`]), with the lock around a scheduler's state in two designs
//! ([`SchedLock`], seed 002): `locked` (one mutex for insert and dispatch) and `serialized`
//! (one owner at a time; inserters that find it taken leave their requests in per-thread
//! buckets, dispatchers that find it taken leave).

use std::str::FromStr;

use blkq_sync::atomic::{AtomicU64, Ordering};
use blkq_sync::CachePadded;

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
/// 1-4 ms, like the kernel's jiffies that mq-deadline's expiries are counted in).
#[derive(Debug, Clone, Copy, Default)]
pub struct MonotonicClock;

impl Clock for MonotonicClock {
    #[inline]
    fn now_ns(&self) -> u64 {
        crate::stats::coarse_ns()
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

/// Statistics counters sharded by thread slot (one cache line pair per shard), `N` counters
/// per shard. `Relaxed` adds, summed on read: a snapshot may be torn between shards, which is
/// fine for statistics. Used where a counter is bumped outside the scheduler's lock (on
/// completion, on a contended acquisition), so that counting adds no shared line per I/O.
///
/// These are `std` atomics even under loom, the one deliberate exception to the facade rule:
/// no code decides anything on them (only tests and reports read them), and as loom atomics
/// each add would be one more interleaving point on every insert and dispatch, which made the
/// three-thread model of the scheduler lock run 3x longer without exploring anything of the
/// protocol.
#[derive(Debug)]
pub(crate) struct Sharded<const N: usize> {
    shards: Box<[CachePadded<[StatU64; N]>]>,
}

// Not modelled by loom (see `Sharded` and `blkq_sync::stat`).
use blkq_sync::stat::StatU64;

impl<const N: usize> Sharded<N> {
    pub(crate) fn new() -> Self {
        let n = if cfg!(blkq_loom) {
            1
        } else {
            std::thread::available_parallelism()
                .map_or(4, |n| n.get())
                .next_power_of_two()
                .min(64)
        };
        Self {
            shards: (0..n)
                .map(|_| CachePadded(std::array::from_fn(|_| StatU64::new(0))))
                .collect(),
        }
    }

    #[inline]
    pub(crate) fn add(&self, i: usize, v: u64) {
        let s = &self.shards[blkq_sync::thread_slot() & (self.shards.len() - 1)];
        if let Some(c) = s.get(i) {
            c.fetch_add(v, blkq_sync::stat::Ordering::Relaxed);
        }
    }

    pub(crate) fn sum(&self, i: usize) -> u64 {
        self.shards
            .iter()
            .map(|s| {
                s.get(i)
                    .map_or(0, |c| c.load(blkq_sync::stat::Ordering::Relaxed))
            })
            .sum()
    }
}
