//! Region locks with a count of writers receiving in flight: what lets `store=map` take a
//! WRITE's payload from the socket straight into its mapping ([`blk::Device::recv_home`])
//! without holding a lock across a receive the client paces.
//!
//! [`RegionGate`] is a fixed table of stripes (region `r` uses stripe `r % stripes`), each a
//! reader-writer lock, as `map.rs` describes, plus two counters:
//!
//! | field      | what it counts                                   | changed under           |
//! |------------|--------------------------------------------------|-------------------------|
//! | `writers`  | receivers between [`RegionGate::enter`] and leave | shared lock (enter), exclusive lock (leave) |
//! | `draining` | zeroers ([`RegionGate::quiet`]) waiting for `writers` to reach 0 | exclusive lock |
//!
//! A receiver holds no lock while the kernel copies the payload into the mapping; it only
//! counts itself in `writers`, which is what a zeroer (a trim, a write-zeroes) waits on before
//! it zeroes bytes in place or gives pages back with `MADV_DONTNEED`: a page given back under
//! a receive would lose the bytes that had already landed in it, even those of a neighbouring
//! range the trim does not cover (a partial page at the trim's edge).
//!
//! # Invariants
//!
//! 1. While a [`Quiet`] guard lives, its stripe's `writers` is 0 and stays 0: the guard holds
//!    the exclusive lock, and `writers` only grows under the shared one.
//! 2. While `draining > 0`, `writers` does not grow ([`RegionGate::enter`] waits), so a zeroer
//!    waits only for the receives already in flight, each bounded by its client's payload
//!    (and the server's mid-request timeout): writers cannot starve a trim.
//! 3. Every [`Receiving`] leaves exactly once (explicitly, or on drop after an error or a
//!    panic), so `writers` returns to 0 once no receive is in flight: a client that
//!    disconnects mid-payload leaks nothing.
//!
//! # Memory ordering
//!
//! Every change of both counters happens with the stripe's lock held (shared for an enter,
//! exclusive otherwise), and every read that decides something happens with it held too. So
//! the lock orders them all: an exclusive acquisition happens-after every earlier release,
//! shared ones included, and the counters' own operations may be `Relaxed` (atomics only
//! because several shared holders may enter at once). The sleeps go through one
//! [`WaitQueue`], whose `wait_for` re-checks after queueing and whose wakes fence, so the two
//! wake-ups cannot be lost:
//!
//! - a zeroer sleeps until `writers == 0`; the receiver that takes it to 0 sees
//!   `draining > 0` (stored under the lock before the zeroer released it) and wakes all,
//!   after releasing the lock;
//! - a receiver sleeps until `draining == 0`; the zeroer that takes it to 0 wakes all when
//!   its guard drops, after releasing the lock.
//!
//! Either side's re-check takes the lock, so it sees the other's change if it comes after it
//! in the lock's order, and if it comes before, the sleeper was queued before the waker took
//! the lock, and the waker's wake finds it (waitq's fence pairing).
//!
//! `tests/loom_home.rs` models enter/leave against a zeroer.

use blkq_sync::atomic::{AtomicU32, Ordering};
use blkq_sync::{CachePadded, RwLock, RwLockReadGuard, RwLockWriteGuard};
use waitq::WaitQueue;

/// One stripe: its lock and its counters (module docs).
#[derive(Debug, Default)]
struct Stripe {
    lock: RwLock<()>,
    writers: AtomicU32,
    draining: AtomicU32,
}

/// A table of region locks that also counts receivers in flight (module docs).
#[derive(Debug)]
pub struct RegionGate {
    stripes: Box<[CachePadded<Stripe>]>,
    /// Zeroers waiting for receivers, and receivers waiting for zeroers.
    wq: WaitQueue,
}

impl RegionGate {
    /// A table of `n` stripes (at least one).
    pub fn new(n: usize) -> Self {
        Self {
            stripes: (0..n.max(1))
                .map(|_| CachePadded(Stripe::default()))
                .collect(),
            wq: WaitQueue::new(),
        }
    }

    fn stripe(&self, i: usize) -> &Stripe {
        &self.stripes[i % self.stripes.len()]
    }

    /// Stripe `i`'s lock, shared: reads, extent queries, zero-copy reads.
    pub fn read(&self, i: usize) -> RwLockReadGuard<'_, ()> {
        self.stripe(i).lock.read()
    }

    /// Stripe `i`'s lock, exclusive, receivers or not: copying writes. A copy that overlaps
    /// a receive in flight leaves those bytes undefined, as two overlapping writes in flight
    /// may; it changes no page's mapping, so it need not wait.
    pub fn write(&self, i: usize) -> RwLockWriteGuard<'_, ()> {
        self.stripe(i).lock.write()
    }

    /// Stripe `i`'s lock, exclusive, once no receiver is in flight in it (invariant 1): for
    /// zeroing in place and giving pages back. Waits for the receives in flight, letting no
    /// new one in meanwhile (invariant 2).
    pub fn quiet(&self, i: usize) -> Quiet<'_> {
        let s = self.stripe(i);
        let g = s.lock.write();
        // Relaxed: read under the exclusive lock, which orders it after every enter's
        // increment and every leave's decrement (module docs).
        if s.writers.load(Ordering::Relaxed) == 0 {
            return Quiet {
                guard: Some(g),
                gate: self,
                drained: false,
            };
        }
        // Relaxed, under the exclusive lock: a receiver's enter reads it under the shared
        // lock, after this release.
        s.draining.fetch_add(1, Ordering::Relaxed);
        drop(g);
        let g = self.wq.wait_for(|| {
            let g = s.lock.write();
            // Relaxed: under the lock, as above.
            (s.writers.load(Ordering::Relaxed) == 0).then_some(g)
        });
        // Relaxed, under the exclusive lock; receivers waiting for it are woken when the
        // guard drops (after the lock is released).
        s.draining.fetch_sub(1, Ordering::Relaxed);
        Quiet {
            guard: Some(g),
            gate: self,
            drained: true,
        }
    }

    /// Counts a receiver in flight in stripe `i` until the [`Receiving`] leaves; waits while
    /// a zeroer drains the stripe (invariant 2). Holds no lock once it returns.
    pub fn enter(&self, i: usize) -> Receiving<'_> {
        let s = self.stripe(i);
        let admit = || {
            let _g = s.lock.read();
            // Relaxed, both: under the shared lock, ordered after every change of `draining`
            // (made under the exclusive one) and before the next exclusive holder's reads.
            (s.draining.load(Ordering::Relaxed) == 0).then(|| {
                s.writers.fetch_add(1, Ordering::Relaxed);
            })
        };
        if admit().is_none() {
            self.wq.wait_for(admit);
        }
        Receiving {
            gate: self,
            stripe: i,
            left: false,
        }
    }

    /// Receivers in flight in stripe `i` now (tests, diagnostics).
    pub fn writers(&self, i: usize) -> u32 {
        let s = self.stripe(i);
        let _g = s.lock.read();
        // Relaxed: under the lock.
        s.writers.load(Ordering::Relaxed)
    }

    /// Receivers in flight in all stripes now (tests, diagnostics).
    pub fn writers_total(&self) -> u64 {
        (0..self.stripes.len())
            .map(|i| u64::from(self.writers(i)))
            .sum()
    }
}

/// Stripe lock held exclusive with no receiver in flight ([`RegionGate::quiet`]).
#[must_use = "the stripe is quiet only while the guard lives"]
pub struct Quiet<'a> {
    guard: Option<RwLockWriteGuard<'a, ()>>,
    gate: &'a RegionGate,
    /// It had to drain: receivers may be waiting for it.
    drained: bool,
}

impl Drop for Quiet<'_> {
    fn drop(&mut self) {
        drop(self.guard.take());
        if self.drained {
            // After the release: a receiver woken here finds the lock free.
            self.gate.wq.wake_all();
        }
    }
}

/// A receiver counted in flight in a stripe ([`RegionGate::enter`]); leaves on
/// [`Receiving::leave`] or on drop (invariant 3).
#[must_use = "a receiver is in flight only while this lives"]
pub struct Receiving<'a> {
    gate: &'a RegionGate,
    stripe: usize,
    left: bool,
}

impl Receiving<'_> {
    /// Leaves, running `f` under the stripe's exclusive lock first (marking the pages the
    /// receive filled as allocated).
    pub fn leave(mut self, f: impl FnOnce()) {
        self.leave_with(f);
    }

    fn leave_with(&mut self, f: impl FnOnce()) {
        if std::mem::replace(&mut self.left, true) {
            return;
        }
        let s = self.gate.stripe(self.stripe);
        let g = s.lock.write();
        f();
        // Relaxed, both: under the exclusive lock (module docs).
        let before = s.writers.fetch_sub(1, Ordering::Relaxed);
        let wake = before == 1 && s.draining.load(Ordering::Relaxed) > 0;
        drop(g);
        if wake {
            self.gate.wq.wake_all();
        }
    }
}

impl Drop for Receiving<'_> {
    fn drop(&mut self) {
        self.leave_with(|| {});
    }
}
