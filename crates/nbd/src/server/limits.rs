//! The server's resource limits that are code rather than settings (the settings are
//! [`super::Tuning`]; "Limits" in docs/design.md): the defaults derived from the machine, the
//! global memory budget of payload buffers, and a rate-limited log line for floods.

use std::time::{Duration, Instant};

use blkq_sync::atomic::{AtomicU64, Ordering};
use waitq::WaitQueue;

/// Descriptors one connection holds: its socket, the registry's handle and the writers'
/// handle.
const FDS_PER_CONNECTION: u64 = 3;
/// Descriptors kept for everything else (listeners, device files, logs, the control socket).
const FDS_RESERVED: u64 = 64;

/// The default connection limit: what the open-files limit leaves room for (three descriptors
/// a connection, 64 kept for the rest), between 16 and 1024. With the usual soft limit of 1024
/// that is 320: accepting more would only fail later, in `accept` or in the connection's setup.
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
/// Ordering: `used` publishes nothing but itself, so its updates are `Relaxed` (the CAS
/// keeps the sum exact). The wake-up is the wait queue's protocol: a waiter queues itself
/// (`prepare`, a `SeqCst` fence) before it re-checks `used`; a giver subtracts, then
/// `wake_all` fences (`SeqCst`) before it looks for waiters. So either the waiter's re-check
/// sees the bytes given back, or the giver sees the waiter and wakes it.
pub(crate) struct MemoryBudget {
    limit: u64,
    used: AtomicU64,
    wake: WaitQueue,
}

impl MemoryBudget {
    pub(crate) fn new(limit: u64) -> Self {
        Self {
            limit,
            used: AtomicU64::new(0),
            wake: WaitQueue::new(),
        }
    }

    fn fits(&self, used: u64, n: u64) -> bool {
        used == 0 || used.saturating_add(n) <= self.limit
    }

    /// Takes `n` bytes if they fit.
    pub(crate) fn try_take(&self, n: u64) -> bool {
        let mut used = self.used.load(Ordering::Relaxed);
        loop {
            if !self.fits(used, n) {
                return false;
            }
            match self.used.compare_exchange_weak(
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

    /// Gives back `n` bytes taken earlier, and wakes the readers waiting for room.
    pub(crate) fn give(&self, n: u64) {
        if n > 0 {
            self.used.fetch_sub(n, Ordering::Relaxed);
            self.wake.wake_all();
        }
    }

    /// Waits until `n` bytes would fit (without taking them: the caller tries again) or
    /// `deadline` passes; returns whether they fit.
    pub(crate) fn wait_fit(&self, n: u64, deadline: Instant) -> bool {
        let fit = || {
            self.fits(self.used.load(Ordering::Relaxed), n)
                .then_some(())
        };
        self.wake.wait_for_until(fit, deadline).is_some()
    }

    /// Bytes taken now.
    pub(crate) fn used(&self) -> u64 {
        self.used.load(Ordering::Relaxed)
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
