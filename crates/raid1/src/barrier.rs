//! Barrier buckets: keeping regular I/O and resync I/O apart, and freezing the array.
//!
//! The array is cut into barrier units of [`BARRIER_UNIT_SECTORS`] (64 MiB, as md), hashed to
//! [`BARRIER_BUCKETS`] buckets (1024; 2 under loom so that models collide). Each bucket has:
//!
//! | counter      | meaning                                                              |
//! |--------------|----------------------------------------------------------------------|
//! | `nr_pending` | regular I/O admitted in the bucket, plus one per raised resync window |
//! | `nr_waiting` | regular I/O asleep in the slow path of `wait_*barrier`                |
//! | `nr_queued`  | admitted I/O parked on a retry list (counted in `nr_pending` too)     |
//! | `barrier`    | resync windows raised in the bucket                                   |
//!
//! plus the array-wide `array_frozen` (a count of freezers), `total_barriers` (raised, waiting or
//! not) and `nr_sync_pending` (windows that passed `raise_barrier`, at most [`RESYNC_DEPTH`];
//! counting the passed ones rather than the raised ones, as later md does, means raisers that
//! have not passed can never hold each other up).
//!
//! What each operation waits for:
//!
//! | operation              | proceeds when                                                   |
//! |------------------------|-----------------------------------------------------------------|
//! | `wait_barrier`         | bucket `barrier == 0` and not frozen                            |
//! | `wait_read_barrier`    | not frozen (reads never race resync: read balance avoids stale) |
//! | `raise_barrier`        | first `nr_waiting == 0`; then, with its barrier raised: not frozen, bucket `nr_pending == 0`, `nr_sync_pending < RESYNC_DEPTH` |
//! | `freeze_array(extra)`  | sum over buckets of `nr_pending - nr_queued == extra`           |
//! | `try_wait_barrier`     | never waits: admitted when `wait_barrier` would not wait, else false |
//! | `hold` (a second admission by an admitted caller) | never waits                    |
//! | `allow_barrier`, `lower_barrier`, `unfreeze_array`, `queue_io`, `unqueue_io` | never wait |
//!
//! # Two implementations, chosen at construction ([`BarrierMode`])
//!
//! **Locked** is the algorithm before md's lockless change: every operation takes the resync
//! lock, so the order of the counter updates inside it does not matter. It is kept as the
//! reference and as a run-time switch (`barrier=locked`).
//!
//! **Lockless**: regular I/O touches only atomics unless a barrier or a freeze is active on its
//! bucket. Fast path of `wait_barrier`: increment `nr_pending`, `fence(SeqCst)`, read
//! `array_frozen` and `barrier`; both zero means admitted. Otherwise the slow path takes the
//! resync lock, moves itself from `nr_pending` to `nr_waiting`, wakes (a raiser or freezer may
//! be waiting for `nr_pending` to drop), sleeps until the condition holds, and moves back.
//!
//! # Ordering rules (the review of the lockless patch, in words)
//!
//! 1. **`nr_pending` before `barrier`** (regular side): the increment of `nr_pending` must be
//!    visible before `barrier` (and `array_frozen`) is read. Otherwise a raiser could increment
//!    `barrier` just after our read and then read `nr_pending` as zero just before our
//!    increment lands, and both would proceed. A `fence(SeqCst)` after the increment.
//! 2. **`barrier` before `nr_pending`** (resync side, the mirror of rule 1): in
//!    `raise_barrier` the increment of `barrier` must be visible before `nr_pending` is read; in
//!    `freeze_array` the increment of `array_frozen` before the `nr_pending` sums are read. A
//!    `fence(SeqCst)` after the increment. Rules 1 and 2 together are a store-buffer (Dekker)
//!    pattern: with a SeqCst fence on both sides at least one side sees the other's increment.
//!    (Loom models SeqCst fences but not SeqCst loads/stores as such, so this is written with
//!    fences, as everywhere in blkq.)
//! 3. **Changes before wake-ups**: every change a waiter waits for (`nr_pending` decrement in
//!    `allow_barrier`/`lower_barrier` and in the slow path, `barrier` decrement, `array_frozen`
//!    decrement, `nr_waiting` decrement, `nr_queued` increment) is made before the
//!    `WaitQueue::wake_all` that follows it. The wake-up's own `fence(SeqCst)` pairs with the
//!    fence the waiter does after queueing itself (`WaitQueue::prepare`), so either the waiter's
//!    re-check sees the change, or the waker sees the waiter queued.
//! 4. **`nr_queued` before the wake-up**: `freeze_array` may wait for `nr_queued` to catch up
//!    with `nr_pending`; `queue_io` increments and then wakes. Nothing waits for a decrement of
//!    `nr_queued`, so `unqueue_io` does not wake.
//! 5. **Happens-before for the data**: admission must order the admitted I/O after whatever the
//!    other side did before it left. Decrements of `nr_pending` and `barrier` are Release
//!    (AcqRel RMWs, which also continue release sequences), and the loads that admit are
//!    Acquire, so a resync that sees `nr_pending == 0` sees every write of the regular I/O that
//!    left, and a regular write that sees `barrier == 0` sees the resync's writes.
//!
//! The condition waits of the slow paths run under the resync lock, sleeping on the project's
//! [`WaitQueue`] with the lock released (prepare while locked, unlock, re-check, sleep, finish,
//! relock): wakers that change state without the lock are caught by rule 3.
//!
//! # Caller contract
//!
//! A resync thread raises at most one window per bucket at a time (a second `raise_barrier` on
//! a bucket whose window it holds would wait for its own `nr_pending`). `lower_barrier` pairs
//! with `raise_barrier`, `allow_barrier` with `wait_barrier`/`wait_read_barrier`,
//! `unfreeze_array` with `freeze_array`, `unqueue_io` with `queue_io`; unpaired calls are
//! refused with [`BarrierError`] where they would underflow.

use blkq_sync::atomic::{fence, AtomicUsize, Ordering};
use blkq_sync::{CachePadded, Mutex, MutexGuard};
use waitq::WaitQueue;

/// log2 of the barrier unit in sectors: 2^17 sectors = 64 MiB, as md.
pub const BARRIER_UNIT_SECTOR_BITS: u32 = 17;
/// Sectors per barrier unit.
pub const BARRIER_UNIT_SECTORS: u64 = 1 << BARRIER_UNIT_SECTOR_BITS;
/// Number of barrier buckets (1024; 2 under loom, so models hit the same bucket).
#[cfg(not(blkq_loom))]
pub const BARRIER_BUCKETS: usize = 1024;
/// Number of barrier buckets (1024; 2 under loom, so models hit the same bucket).
#[cfg(blkq_loom)]
pub const BARRIER_BUCKETS: usize = 2;
/// Most resync windows raised at once over the whole array.
pub const RESYNC_DEPTH: usize = 32;

/// Which barrier implementation (spec option `barrier=locked|lockless`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BarrierMode {
    /// Atomics on the regular I/O path; the resync lock only when a barrier or freeze is active.
    #[default]
    Lockless,
    /// One lock around every barrier operation (the algorithm before md's lockless change).
    Locked,
}

impl std::str::FromStr for BarrierMode {
    type Err = BarrierError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "lockless" => Ok(BarrierMode::Lockless),
            "locked" => Ok(BarrierMode::Locked),
            _ => Err(BarrierError::BadMode(s.to_string())),
        }
    }
}

/// Checks the result of a call that ends an admission, a window or a freeze: an unpaired call
/// is a bug in the caller (the kernel `BUG_ON`s it). On the hot path (`allow_barrier`, once per
/// I/O) a debug assertion, so the tests and the simulator's debug seeds catch it; off it
/// (`lower_barrier`, `unfreeze_array`, `unqueue_io`) an assertion in every build.
#[track_caller]
pub(crate) fn paired(r: Result<(), BarrierError>) {
    match r {
        Ok(()) => {}
        Err(e @ BarrierError::NotPending(_)) => debug_assert!(false, "unpaired barrier call: {e}"),
        Err(e) => panic!("unpaired barrier call: {e}"),
    }
}

/// Misuse of the barrier API.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BarrierError {
    /// `lower_barrier` without a raised barrier on the bucket.
    #[error("no barrier raised on the bucket of sector {0}")]
    NotRaised(u64),
    /// `unfreeze_array` on an array that is not frozen.
    #[error("array is not frozen")]
    NotFrozen,
    /// `unqueue_io` without a queued I/O on the bucket.
    #[error("no I/O queued on the bucket of sector {0}")]
    NotQueued(u64),
    /// `allow_barrier` without pending I/O on the bucket.
    #[error("no I/O pending on the bucket of sector {0}")]
    NotPending(u64),
    /// An unknown `barrier=` value.
    #[error("unknown barrier mode {0:?} (locked, lockless)")]
    BadMode(String),
}

#[derive(Debug, Default)]
struct Bucket {
    nr_pending: AtomicUsize,
    nr_waiting: AtomicUsize,
    nr_queued: AtomicUsize,
    barrier: AtomicUsize,
}

/// A snapshot of one bucket's counters (for tests and reports).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BucketSnapshot {
    /// Admitted regular I/O plus raised windows.
    pub nr_pending: usize,
    /// Regular I/O asleep.
    pub nr_waiting: usize,
    /// Admitted I/O on a retry list.
    pub nr_queued: usize,
    /// Raised resync windows.
    pub barrier: usize,
}

/// The barrier buckets of one array. See the module docs.
#[derive(Debug)]
pub struct Barriers {
    mode: BarrierMode,
    /// Test knob: leave out the rule-1 fence (the model that must fail).
    skip_pending_fence: bool,
    buckets: Box<[CachePadded<Bucket>]>,
    /// Number of active freezers (0: not frozen).
    array_frozen: AtomicUsize,
    total_barriers: AtomicUsize,
    /// Windows that passed `raise_barrier` and are not lowered yet (changed under the resync
    /// lock when raised; decremented before the wake-up when lowered, rule 3).
    nr_sync_pending: AtomicUsize,
    resync_lock: Mutex<()>,
    wq: WaitQueue,
}

/// The bucket of a sector: the barrier unit index, multiplicatively hashed (as `hash_long`).
#[inline]
pub fn bucket_of(sector: u64) -> usize {
    let unit = sector >> BARRIER_UNIT_SECTOR_BITS;
    let bits = BARRIER_BUCKETS.trailing_zeros();
    (unit.wrapping_mul(0x61C8_8646_80B5_83EB) >> (64 - bits)) as usize
}

impl Barriers {
    /// Buckets for one array, all counters zero.
    pub fn new(mode: BarrierMode) -> Self {
        Self::build(mode, false)
    }

    /// Test-only: a lockless instance WITHOUT the fence after the `nr_pending` increment of
    /// the regular fast path (rule 1). Broken on purpose; the loom test shows it fails.
    #[doc(hidden)]
    pub fn new_without_pending_fence() -> Self {
        Self::build(BarrierMode::Lockless, true)
    }

    fn build(mode: BarrierMode, skip_pending_fence: bool) -> Self {
        Self {
            mode,
            skip_pending_fence,
            buckets: (0..BARRIER_BUCKETS)
                .map(|_| CachePadded::default())
                .collect(),
            array_frozen: AtomicUsize::new(0),
            total_barriers: AtomicUsize::new(0),
            nr_sync_pending: AtomicUsize::new(0),
            resync_lock: Mutex::new(()),
            wq: WaitQueue::new(),
        }
    }

    /// The implementation in use.
    pub fn mode(&self) -> BarrierMode {
        self.mode
    }

    #[inline]
    fn bucket(&self, sector: u64) -> &Bucket {
        &self.buckets[bucket_of(sector)]
    }

    /// Waits, with the resync lock held in `g`, until `cond` holds; returns the guard. The lock
    /// is released while asleep. `cond` reads atomics only.
    fn wait_locked<'a>(
        &'a self,
        mut g: MutexGuard<'a, ()>,
        cond: impl Fn() -> bool,
    ) -> MutexGuard<'a, ()> {
        while !cond() {
            // Queue while still holding the lock: a waker that changes state under the lock
            // does so after we are queued; one that changes it without the lock is caught by
            // the re-check below (prepare's fence pairs with the wake-up's, rule 3).
            let w = self.wq.prepare();
            drop(g);
            if !cond() {
                w.sleep();
            }
            // All barrier wake-ups are wake_all: there is no exclusive wake-up to pass on.
            w.finish();
            g = self.resync_lock.lock();
        }
        g
    }

    /// Admits a regular write on `sector`'s bucket: waits while a barrier is raised on the
    /// bucket or the array is frozen. Pair with [`Barriers::allow_barrier`].
    pub fn wait_barrier(&self, sector: u64) {
        self.wait_regular(sector, true)
    }

    /// Admits a regular read: waits only while the array is frozen. Pair with
    /// [`Barriers::allow_barrier`].
    pub fn wait_read_barrier(&self, sector: u64) {
        self.wait_regular(sector, false)
    }

    /// The lockless fast path of an admission: count ourselves pending, then look. On false
    /// the count is still there (the caller waits or undoes it).
    #[inline]
    fn pend_then_look(&self, b: &Bucket, clear: impl Fn() -> bool) -> bool {
        b.nr_pending.fetch_add(1, Ordering::AcqRel);
        // Rule 1: our nr_pending increment must be visible before we read barrier and
        // array_frozen; pairs with the fence after the barrier/frozen increment in
        // raise_barrier/freeze_array.
        if !self.skip_pending_fence {
            fence(Ordering::SeqCst);
        }
        clear()
    }

    fn wait_regular(&self, sector: u64, write: bool) {
        let b = self.bucket(sector);
        // Acquire: see rule 5 (admission orders us after the resync that left).
        let clear = || {
            self.array_frozen.load(Ordering::Acquire) == 0
                && (!write || b.barrier.load(Ordering::Acquire) == 0)
        };
        match self.mode {
            BarrierMode::Lockless => {
                if !self.pend_then_look(b, clear) {
                    self.wait_regular_slow(b, clear);
                }
            }
            BarrierMode::Locked => {
                let mut g = self.resync_lock.lock();
                let waited = !clear();
                if waited {
                    b.nr_waiting.fetch_add(1, Ordering::Relaxed);
                    g = self.wait_locked(g, clear);
                    b.nr_waiting.fetch_sub(1, Ordering::Release);
                }
                b.nr_pending.fetch_add(1, Ordering::AcqRel);
                drop(g);
                if waited {
                    // Rule 3: the nr_waiting decrement is what a raiser's first wait waits for.
                    self.wq.wake_all();
                }
            }
        }
    }

    #[cold]
    fn wait_regular_slow(&self, b: &Bucket, clear: impl Fn() -> bool) {
        let g = self.resync_lock.lock();
        // Under the lock, every raiser/freezer reads nr_pending after we leave it: move our
        // count from pending to waiting (waiting first, so a raiser that sees pending drop also
        // sees us waiting and lets us in first once the barrier drops).
        b.nr_waiting.fetch_add(1, Ordering::Relaxed);
        b.nr_pending.fetch_sub(1, Ordering::AcqRel);
        // Rule 3: a raiser or freezer may be asleep waiting for nr_pending to drop.
        self.wq.wake_all();
        let g = self.wait_locked(g, clear);
        // Still under the lock: raisers and freezers read nr_pending under it, so no fence is
        // needed between this increment and their reads.
        b.nr_pending.fetch_add(1, Ordering::AcqRel);
        b.nr_waiting.fetch_sub(1, Ordering::Release);
        drop(g);
        // Rule 3: the nr_waiting decrement is what a raiser's first wait waits for.
        self.wq.wake_all();
    }

    /// Admits a regular write on `sector`'s bucket if that needs no wait (no barrier raised
    /// there, not frozen); otherwise leaves the counters as they were and returns false. For a
    /// write that spans several barrier units and already holds the earlier ones: it must not
    /// sleep holding them (a freezer waits for every admission to end), so on false it lets
    /// them go and waits for this one alone (`Array::admit_write`). Pair a true with
    /// [`Barriers::allow_barrier`].
    pub fn try_wait_barrier(&self, sector: u64) -> bool {
        let b = self.bucket(sector);
        // Acquire: rule 5, as in `wait_regular`.
        let clear = || {
            self.array_frozen.load(Ordering::Acquire) == 0 && b.barrier.load(Ordering::Acquire) == 0
        };
        match self.mode {
            BarrierMode::Lockless => {
                if self.pend_then_look(b, clear) {
                    return true;
                }
                // Not admitted: undo. Release (rule 5 needs nothing here: we did no I/O), and
                // rule 3: a raiser or freezer may be asleep waiting for nr_pending to drop.
                b.nr_pending.fetch_sub(1, Ordering::AcqRel);
                self.wq.wake_all();
                false
            }
            BarrierMode::Locked => {
                let _g = self.resync_lock.lock();
                if !clear() {
                    return false;
                }
                b.nr_pending.fetch_add(1, Ordering::AcqRel);
                true
            }
        }
    }

    /// Ends a regular I/O admitted by `wait_barrier`/`wait_read_barrier` on `sector`.
    pub fn allow_barrier(&self, sector: u64) -> Result<(), BarrierError> {
        let b = self.bucket(sector);
        let g = match self.mode {
            BarrierMode::Locked => Some(self.resync_lock.lock()),
            BarrierMode::Lockless => None,
        };
        // Release (rule 5): our I/O happens before a raiser that reads the smaller count. One
        // fetch_sub, not a CAS loop, on this hot counter; an unpaired call is undone below.
        let prev = b.nr_pending.fetch_sub(1, Ordering::AcqRel);
        if prev == 0 {
            b.nr_pending.fetch_add(1, Ordering::Relaxed);
            return Err(BarrierError::NotPending(sector));
        }
        drop(g);
        // Rule 3: the decrement comes before the wake-up.
        self.wq.wake_all();
        Ok(())
    }

    /// A second admission on `sector`'s bucket for a caller that already holds one there (a
    /// submitter's own hold while it submits, see `slot`). No wait and no fence: the count
    /// cannot be zero meanwhile, so no raiser or freezer can have passed on it since the first
    /// admission, and one that reads the sum later sees at least the first. Pair with
    /// [`Barriers::allow_barrier`].
    #[inline]
    pub fn hold(&self, sector: u64) {
        let b = self.bucket(sector);
        let _g = match self.mode {
            BarrierMode::Locked => Some(self.resync_lock.lock()),
            BarrierMode::Lockless => None,
        };
        let prev = b.nr_pending.fetch_add(1, Ordering::AcqRel);
        // The caller's first admission is counted (and not ended before this one is).
        debug_assert!(
            prev > 0,
            "hold without an admission on the bucket of {sector}"
        );
    }

    /// Raises a resync window on `sector`'s bucket: waits for sleeping regular I/O to go
    /// first, raises the barrier (new regular writes now wait), then waits until the array is
    /// not frozen, no regular I/O is pending on the bucket and at most [`RESYNC_DEPTH`] windows
    /// are raised. The window counts as one pending I/O until [`Barriers::lower_barrier`].
    pub fn raise_barrier(&self, sector: u64) {
        let b = self.bucket(sector);
        let g = self.resync_lock.lock();
        let g = self.wait_locked(g, || b.nr_waiting.load(Ordering::Acquire) == 0);
        b.barrier.fetch_add(1, Ordering::AcqRel);
        self.total_barriers.fetch_add(1, Ordering::AcqRel);
        // Rule 2: our barrier increment must be visible before we read nr_pending; pairs with
        // the fence after the nr_pending increment of the regular fast path (rule 1). (Locked
        // mode takes the lock on every path; the fence is then redundant but harmless.)
        fence(Ordering::SeqCst);
        let g = self.wait_locked(g, || {
            self.array_frozen.load(Ordering::Acquire) == 0
                && b.nr_pending.load(Ordering::Acquire) == 0
                && self.nr_sync_pending.load(Ordering::Acquire) < RESYNC_DEPTH
        });
        b.nr_pending.fetch_add(1, Ordering::AcqRel);
        let windows = self.nr_sync_pending.fetch_add(1, Ordering::AcqRel);
        // Raised under the resync lock after the wait saw fewer; lowering only decrements.
        assert!(
            windows < RESYNC_DEPTH,
            "more than RESYNC_DEPTH resync windows raised"
        );
        drop(g);
    }

    /// Lowers the resync window raised on `sector`'s bucket and wakes waiters.
    pub fn lower_barrier(&self, sector: u64) -> Result<(), BarrierError> {
        let b = self.bucket(sector);
        let g = match self.mode {
            BarrierMode::Locked => Some(self.resync_lock.lock()),
            BarrierMode::Lockless => None,
        };
        // Release (rule 5): the resync's I/O happens before a regular write that reads 0.
        let r = b
            .barrier
            .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |v| v.checked_sub(1));
        if r.is_ok() {
            let total = self.total_barriers.fetch_sub(1, Ordering::AcqRel);
            let windows = self.nr_sync_pending.fetch_sub(1, Ordering::AcqRel);
            let pending = b.nr_pending.fetch_sub(1, Ordering::AcqRel);
            // A raised window counts in all three until it is lowered (`raise_barrier`): a
            // barrier lowered while none of them counts it was not raised (or not yet: its
            // raise is still waiting, and the lower is not its own).
            assert!(
                total > 0 && windows > 0 && pending > 0,
                "a resync window lowered on the bucket of {sector} that was not raised"
            );
        }
        drop(g);
        // Rule 3: all three decrements come before the wake-up.
        self.wq.wake_all();
        r.map(|_| ()).map_err(|_| BarrierError::NotRaised(sector))
    }

    /// Pending minus queued I/O over all buckets.
    fn unqueued_pending(&self) -> usize {
        let mut pending = 0usize;
        let mut queued = 0usize;
        for b in self.buckets.iter() {
            pending = pending.wrapping_add(b.nr_pending.load(Ordering::Acquire));
            queued = queued.wrapping_add(b.nr_queued.load(Ordering::Acquire));
        }
        pending.wrapping_sub(queued)
    }

    /// Freezes the array: new regular I/O and resync wait, and this returns once every
    /// pending I/O but `extra` (the caller's own) is queued (`queue_io`), i.e. not active.
    /// Pair with [`Barriers::unfreeze_array`].
    pub fn freeze_array(&self, extra: usize) {
        let g = self.resync_lock.lock();
        self.array_frozen.fetch_add(1, Ordering::AcqRel);
        // Rule 2 for freezes: array_frozen visible before nr_pending is read; pairs with the
        // fence of the regular fast path (rule 1).
        fence(Ordering::SeqCst);
        let g = self.wait_locked(g, || self.unqueued_pending() == extra);
        drop(g);
    }

    /// Ends a freeze and wakes waiters.
    pub fn unfreeze_array(&self) -> Result<(), BarrierError> {
        let g = self.resync_lock.lock();
        let r = self
            .array_frozen
            .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |v| v.checked_sub(1));
        drop(g);
        // Rule 3: the decrement comes before the wake-up.
        self.wq.wake_all();
        r.map(|_| ()).map_err(|_| BarrierError::NotFrozen)
    }

    /// Whether a freeze is active.
    pub fn is_frozen(&self) -> bool {
        self.array_frozen.load(Ordering::Acquire) != 0
    }

    /// Marks one admitted I/O on `sector`'s bucket as queued for retry (not active).
    pub fn queue_io(&self, sector: u64) {
        let b = self.bucket(sector);
        let g = match self.mode {
            BarrierMode::Locked => Some(self.resync_lock.lock()),
            BarrierMode::Lockless => None,
        };
        b.nr_queued.fetch_add(1, Ordering::AcqRel);
        drop(g);
        // Rule 4: nr_queued before the wake-up (a freezer may be waiting for it).
        self.wq.wake_all();
    }

    /// Takes one queued I/O off `sector`'s bucket (it is active again, or about to end).
    /// Nothing waits for this, so it does not wake.
    pub fn unqueue_io(&self, sector: u64) -> Result<(), BarrierError> {
        let b = self.bucket(sector);
        let _g = match self.mode {
            BarrierMode::Locked => Some(self.resync_lock.lock()),
            BarrierMode::Lockless => None,
        };
        b.nr_queued
            .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |v| v.checked_sub(1))
            .map(|_| ())
            .map_err(|_| BarrierError::NotQueued(sector))
    }

    /// Whether regular I/O is asleep on `sector`'s bucket (a resync thread backs off briefly
    /// before raising the next window, as md does).
    pub fn has_waiters(&self, sector: u64) -> bool {
        self.bucket(sector).nr_waiting.load(Ordering::Relaxed) != 0
    }

    /// The counters of `sector`'s bucket (a snapshot).
    pub fn snapshot(&self, sector: u64) -> BucketSnapshot {
        let b = self.bucket(sector);
        BucketSnapshot {
            nr_pending: b.nr_pending.load(Ordering::Relaxed),
            nr_waiting: b.nr_waiting.load(Ordering::Relaxed),
            nr_queued: b.nr_queued.load(Ordering::Relaxed),
            barrier: b.barrier.load(Ordering::Relaxed),
        }
    }

    /// Number of raised resync windows.
    pub fn total_barriers(&self) -> usize {
        self.total_barriers.load(Ordering::Relaxed)
    }
}

#[cfg(all(test, not(blkq_loom)))]
mod tests {
    use super::*;

    #[test]
    #[should_panic(expected = "unpaired barrier call")]
    fn an_unpaired_lower_is_a_bug_that_asserts() {
        let b = Barriers::new(BarrierMode::Lockless);
        paired(b.lower_barrier(0));
    }

    #[test]
    #[cfg_attr(debug_assertions, should_panic(expected = "unpaired barrier call"))]
    fn an_unpaired_allow_asserts_in_debug_builds() {
        let b = Barriers::new(BarrierMode::Locked);
        paired(b.allow_barrier(0));
    }
    use blkq_sync::atomic::AtomicBool;
    use blkq_sync::Arc;
    use std::time::Duration;

    #[test]
    #[cfg_attr(debug_assertions, should_panic(expected = "hold without an admission"))]
    fn a_hold_without_an_admission_asserts_in_debug_builds() {
        let b = Barriers::new(BarrierMode::Lockless);
        b.hold(0);
        // Release builds: the count went up all the same.
        assert_eq!(b.snapshot(0).nr_pending, 1);
    }

    fn both() -> [BarrierMode; 2] {
        [BarrierMode::Lockless, BarrierMode::Locked]
    }

    #[test]
    fn buckets_are_in_range_and_units_share_a_bucket() {
        for s in [
            0u64,
            1,
            BARRIER_UNIT_SECTORS - 1,
            BARRIER_UNIT_SECTORS,
            u64::MAX,
        ] {
            assert!(bucket_of(s) < BARRIER_BUCKETS);
        }
        assert_eq!(bucket_of(0), bucket_of(BARRIER_UNIT_SECTORS - 1));
    }

    #[test]
    fn fast_path_counts_and_unpaired_calls_are_refused() {
        for m in both() {
            let b = Barriers::new(m);
            b.wait_barrier(10);
            b.wait_read_barrier(10);
            assert_eq!(b.snapshot(10).nr_pending, 2);
            b.allow_barrier(10).unwrap();
            b.allow_barrier(10).unwrap();
            assert_eq!(b.allow_barrier(10), Err(BarrierError::NotPending(10)));
            assert_eq!(b.lower_barrier(10), Err(BarrierError::NotRaised(10)));
            assert_eq!(b.unfreeze_array(), Err(BarrierError::NotFrozen));
            assert_eq!(b.unqueue_io(10), Err(BarrierError::NotQueued(10)));
            assert_eq!(b.snapshot(10), BucketSnapshot::default());
        }
    }

    #[test]
    fn mode_parses() {
        assert_eq!("locked".parse::<BarrierMode>(), Ok(BarrierMode::Locked));
        assert_eq!("lockless".parse::<BarrierMode>(), Ok(BarrierMode::Lockless));
        assert!("x".parse::<BarrierMode>().is_err());
    }

    #[test]
    fn write_waits_for_raised_barrier_read_does_not() {
        for m in both() {
            let b = Arc::new(Barriers::new(m));
            b.raise_barrier(0);
            b.wait_read_barrier(0); // reads pass a barrier
            b.allow_barrier(0).unwrap();
            let done = Arc::new(AtomicBool::new(false));
            let t = {
                let (b, done) = (b.clone(), done.clone());
                std::thread::spawn(move || {
                    b.wait_barrier(0);
                    done.store(true, blkq_sync::atomic::Ordering::SeqCst);
                    b.allow_barrier(0).unwrap();
                })
            };
            // Wait until it sleeps in the slow path.
            while !b.has_waiters(0) {
                std::thread::yield_now();
            }
            assert!(!done.load(blkq_sync::atomic::Ordering::SeqCst));
            b.lower_barrier(0).unwrap();
            t.join().unwrap();
            assert!(done.load(blkq_sync::atomic::Ordering::SeqCst));
            assert_eq!(b.snapshot(0), BucketSnapshot::default());
        }
    }

    #[test]
    fn raise_waits_for_pending_io() {
        for m in both() {
            let b = Arc::new(Barriers::new(m));
            b.wait_barrier(5);
            let raised = Arc::new(AtomicBool::new(false));
            let t = {
                let (b, raised) = (b.clone(), raised.clone());
                std::thread::spawn(move || {
                    b.raise_barrier(5);
                    raised.store(true, blkq_sync::atomic::Ordering::SeqCst);
                    b.lower_barrier(5).unwrap();
                })
            };
            while b.snapshot(5).barrier == 0 {
                std::thread::yield_now();
            }
            std::thread::sleep(Duration::from_millis(10));
            assert!(!raised.load(blkq_sync::atomic::Ordering::SeqCst));
            b.allow_barrier(5).unwrap();
            t.join().unwrap();
            assert!(raised.load(blkq_sync::atomic::Ordering::SeqCst));
        }
    }

    #[test]
    fn at_most_resync_depth_windows_pass() {
        for m in both() {
            let b = Arc::new(Barriers::new(m));
            // RESYNC_DEPTH + 1 units in distinct buckets.
            let mut units: Vec<u64> = Vec::new();
            let mut u = 0u64;
            while units.len() <= RESYNC_DEPTH {
                let s = u * BARRIER_UNIT_SECTORS;
                if units.iter().all(|&x| bucket_of(x) != bucket_of(s)) {
                    units.push(s);
                }
                u += 1;
            }
            for &s in &units[..RESYNC_DEPTH] {
                b.raise_barrier(s);
            }
            let last = units[RESYNC_DEPTH];
            let passed = Arc::new(AtomicBool::new(false));
            let t = {
                let (b, passed) = (b.clone(), passed.clone());
                std::thread::spawn(move || {
                    b.raise_barrier(last);
                    passed.store(true, blkq_sync::atomic::Ordering::SeqCst);
                    b.lower_barrier(last).unwrap();
                })
            };
            while b.total_barriers() <= RESYNC_DEPTH {
                std::thread::yield_now();
            }
            std::thread::sleep(Duration::from_millis(10));
            assert!(!passed.load(blkq_sync::atomic::Ordering::SeqCst));
            b.lower_barrier(units[0]).unwrap();
            t.join().unwrap();
            assert!(passed.load(blkq_sync::atomic::Ordering::SeqCst));
            for &s in &units[1..RESYNC_DEPTH] {
                b.lower_barrier(s).unwrap();
            }
            assert_eq!(b.total_barriers(), 0);
        }
    }

    #[test]
    fn freeze_counts_queued_io_as_inactive() {
        for m in both() {
            let b = Barriers::new(m);
            b.wait_barrier(1);
            b.queue_io(1);
            b.freeze_array(0); // the only pending I/O is queued
            assert!(b.is_frozen());
            b.unqueue_io(1).unwrap();
            b.allow_barrier(1).unwrap();
            b.unfreeze_array().unwrap();
            b.wait_barrier(2);
            b.freeze_array(1); // the caller's own I/O is the extra one
            b.unfreeze_array().unwrap();
            b.allow_barrier(2).unwrap();
        }
    }

    #[test]
    fn stress_regular_and_resync_exclude_each_other() {
        for m in both() {
            let b = Arc::new(Barriers::new(m));
            let regular = Arc::new(blkq_sync::atomic::AtomicUsize::new(0));
            let resync = Arc::new(blkq_sync::atomic::AtomicUsize::new(0));
            let mut ts = Vec::new();
            for i in 0..3u64 {
                let (b, regular, resync) = (b.clone(), regular.clone(), resync.clone());
                ts.push(std::thread::spawn(move || {
                    use blkq_sync::atomic::Ordering::SeqCst;
                    for n in 0..2000u64 {
                        let s = (n + i) % 3 * BARRIER_UNIT_SECTORS;
                        if n % 2 == 0 {
                            b.wait_read_barrier(s);
                        } else {
                            b.wait_barrier(s);
                            if bucket_of(s) == bucket_of(0) {
                                regular.fetch_add(1, SeqCst);
                                assert_eq!(resync.load(SeqCst), 0);
                                regular.fetch_sub(1, SeqCst);
                            }
                        }
                        b.allow_barrier(s).unwrap();
                    }
                }));
            }
            {
                let (b, regular, resync) = (b.clone(), regular.clone(), resync.clone());
                ts.push(std::thread::spawn(move || {
                    use blkq_sync::atomic::Ordering::SeqCst;
                    for _ in 0..500 {
                        // All three units hash somewhere; hold one window on unit 0's bucket
                        // and check no regular write of that bucket is inside.
                        b.raise_barrier(0);
                        resync.fetch_add(1, SeqCst);
                        assert_eq!(regular.load(SeqCst), 0);
                        resync.fetch_sub(1, SeqCst);
                        b.lower_barrier(0).unwrap();
                        if b.has_waiters(0) {
                            std::thread::yield_now();
                        }
                    }
                }));
            }
            for t in ts {
                t.join().unwrap();
            }
            for s in 0..3 {
                assert_eq!(
                    b.snapshot(s * BARRIER_UNIT_SECTORS),
                    BucketSnapshot::default()
                );
            }
        }
    }
}
