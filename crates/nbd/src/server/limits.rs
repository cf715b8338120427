//! The server's resource limits that are code rather than settings (the settings are
//! [`super::Tuning`]; "Limits" in docs/design.md): the defaults derived from the machine, the
//! global memory budget of payload buffers, and a rate-limited log line for floods.

use std::time::{Duration, Instant};

use blkq_sync::atomic::{AtomicU64, Ordering};
use blkq_sync::Mutex;
use waitq::WaitQueue;

/// Descriptors one connection holds: its socket, the registry's handle, the writers' handle,
/// and the two ends of its pipe for zero-copy reads (`conn/splice.rs`).
const FDS_PER_CONNECTION: u64 = 5;
/// Descriptors kept for everything else (listeners, device files, logs, the control socket).
const FDS_RESERVED: u64 = 64;

/// The default connection limit: what the open-files limit leaves room for (five descriptors
/// a connection, 64 kept for the rest), between 16 and 1024. With the usual soft limit of 1024
/// that is 192: accepting more would only fail later, in `accept` or in the connection's setup.
pub fn default_max_connections() -> usize {
    let nofile = crate::sys::open_files_limit().unwrap_or(1024);
    (nofile.saturating_sub(FDS_RESERVED) / FDS_PER_CONNECTION).clamp(16, 1024) as usize
}

/// The default memory budget: an eighth of the machine's memory, between 64 MiB and 4 GiB
/// (256 MiB if the size of memory is unknown). Enough for any one connection's in-flight
/// window, small enough that hostile clients cannot push the machine into swap.
pub fn default_memory_budget() -> u64 {
    crate::sys::physical_memory()
        .map_or(256 << 20, |m| m / 8)
        .clamp(64 << 20, 4 << 30)
}

/// How [`MemoryBudget`] keeps its count: the lock-free counter, or the simple locked version
/// it replaces (kept behind this switch, `blkq serve --budget-impl`, so the two can be compared:
/// `cargo bench -p nbd --bench budget`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BudgetImpl {
    /// One atomic counter, taken with a CAS loop and given back with `fetch_sub`.
    #[default]
    Atomic,
    /// A mutex around the count.
    Locked,
}

impl std::str::FromStr for BudgetImpl {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "atomic" => Ok(Self::Atomic),
            "locked" => Ok(Self::Locked),
            _ => Err(format!(
                "unknown budget implementation {s:?} (atomic or locked)"
            )),
        }
    }
}

/// The global memory budget ([`super::Tuning::memory_budget`]): payload bytes of the reads and
/// writes that all connections have taken in (from the decoding of the request to the
/// sending of its reply). A reader takes a request's bytes before it consumes the request
/// ([`MemoryBudget::try_take`]); if they do not fit it stops reading and waits
/// ([`MemoryBudget::wait_fit`]) until some are given back ([`MemoryBudget::give`], when a
/// reply has been sent or a connection drops what it holds).
///
/// A request bigger than the whole budget is let through when nothing at all is taken, so
/// that it is served alone rather than never.
///
/// Invariants (both implementations): the count is the sum of the bytes taken and not yet
/// given back, exactly; a take never makes it exceed the limit unless it was 0 before; a
/// waiter for room is never left asleep after a give has made its bytes fit (no lost
/// wake-up). Loom models of both: `tests/loom_budget.rs`.
///
/// Ordering (`Atomic`): `used` publishes nothing but itself (the payload buffers are handed
/// over by other means), so its updates are `Relaxed`; the CAS in `try_take` keeps the sum
/// exact and the limit check and the add one step. The wake-up is the wait queue's protocol:
/// a waiter queues itself (`prepare`, a `SeqCst` fence) before it re-checks `used`; a giver
/// subtracts, then `wake_all` fences (`SeqCst`) before it looks for waiters. Both fences are
/// `SeqCst`, so one of them is first in their single total order: either the waiter's re-check
/// comes after the giver's subtraction and sees it, or the giver's look comes after the
/// waiter's queueing and wakes it. (`Locked`: the mutex orders everything; the wake-up is
/// the same protocol.)
pub struct MemoryBudget {
    limit: u64,
    count: Count,
    wake: WaitQueue,
}

enum Count {
    Atomic(AtomicU64),
    Locked(Mutex<u64>),
}

impl MemoryBudget {
    /// A budget of `limit` bytes, the lock-free counter.
    pub fn new(limit: u64) -> Self {
        Self::with_impl(limit, BudgetImpl::Atomic)
    }

    /// A budget of `limit` bytes kept by `imp`.
    pub fn with_impl(limit: u64, imp: BudgetImpl) -> Self {
        Self {
            limit,
            count: match imp {
                BudgetImpl::Atomic => Count::Atomic(AtomicU64::new(0)),
                BudgetImpl::Locked => Count::Locked(Mutex::new(0)),
            },
            wake: WaitQueue::new(),
        }
    }

    fn fits(&self, used: u64, n: u64) -> bool {
        used == 0 || used.saturating_add(n) <= self.limit
    }

    /// Takes `n` bytes if they fit.
    pub fn try_take(&self, n: u64) -> bool {
        match &self.count {
            Count::Atomic(used_a) => {
                let mut used = used_a.load(Ordering::Relaxed);
                loop {
                    if !self.fits(used, n) {
                        return false;
                    }
                    match used_a.compare_exchange_weak(
                        used,
                        used + n,
                        Ordering::Relaxed,
                        Ordering::Relaxed,
                    ) {
                        Ok(_) => return true,
                        Err(now) => used = now,
                    }
                }
            }
            Count::Locked(m) => {
                let mut used = m.lock();
                if !self.fits(*used, n) {
                    return false;
                }
                *used += n;
                true
            }
        }
    }

    /// Gives back `n` bytes taken earlier, and wakes the readers waiting for room.
    pub fn give(&self, n: u64) {
        if n == 0 {
            return;
        }
        match &self.count {
            Count::Atomic(used) => {
                used.fetch_sub(n, Ordering::Relaxed);
            }
            Count::Locked(m) => {
                let mut used = m.lock();
                *used = used.saturating_sub(n);
            }
        }
        self.wake.wake_all();
    }

    /// Waits until `n` bytes would fit (without taking them: the caller tries again) or
    /// `deadline` passes; returns whether they fit.
    pub fn wait_fit(&self, n: u64, deadline: Instant) -> bool {
        self.wake
            .wait_for_until(|| self.fits(self.used(), n).then_some(()), deadline)
            .is_some()
    }

    /// Waits until `n` bytes would fit, with no deadline (the loom models: loom has no time).
    pub fn wait_fit_forever(&self, n: u64) {
        self.wake
            .wait_for(|| self.fits(self.used(), n).then_some(()));
    }

    /// Bytes taken now.
    pub fn used(&self) -> u64 {
        match &self.count {
            Count::Atomic(used) => used.load(Ordering::Relaxed),
            Count::Locked(m) => *m.lock(),
        }
    }

    /// The limit, bytes.
    pub fn limit(&self) -> u64 {
        self.limit
    }
}

/// A log line that a flood must not turn into a flood of lines: at most one a second, saying
/// how many were left out since the last one.
#[derive(Default)]
pub(super) struct RateLimited {
    last: Option<Instant>,
    left_out: u64,
}

impl RateLimited {
    /// `Some(n)`: log now, `n` events were left out before this one; `None`: leave it out.
    pub(super) fn allow(&mut self) -> Option<u64> {
        let now = Instant::now();
        if self
            .last
            .is_some_and(|t| now.duration_since(t) < Duration::from_secs(1))
        {
            self.left_out += 1;
            return None;
        }
        self.last = Some(now);
        Some(std::mem::take(&mut self.left_out))
    }
}
