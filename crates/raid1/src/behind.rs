//! Write-behind (md's `--write-behind`, option `write_behind=N`): a write is acknowledged
//! once every leg that is not write-behind has it, with at most N such writes still in
//! flight to the write-behind legs (the write-mostly legs of an array with a bitmap: a remote
//! copy whose round trip the caller should not wait for).
//!
//! # Invariants and orderings
//!
//! 1. **What goes behind.** A plain `Write` without FUA, when write-behind is on, the write
//!    has a write-mostly leg, it has an in-sync leg that is not write-mostly (whose success
//!    acknowledges it), no flush is waiting for a drain (`flush_waiting`, 4.), and a place
//!    among the N is free (`try_reserve`, a CAS that never takes `outstanding` above N).
//!    Anything else waits for every leg, as without write-behind (a write beyond N included).
//! 2. **The caller's buffer** goes to a leg that is not write-behind (`primary`), or, with
//!    `share_writes`, is lent to the legs that are not write-behind (`lend`); the
//!    write-behind legs write copies the array owns (the pooled copy buffers), so the
//!    buffer can be handed back at the acknowledgement. A write behind holds one payload
//!    more than a plain write: that copy.
//! 3. **Acknowledgement early, bookkeeping late.** When the last leg that is not
//!    write-behind completes and one of the counted (in-sync) ones succeeded, with no leg
//!    failure pending a superblock and the array not failed, the caller is completed
//!    (`Io::acked`); the per-I/O slot, the barrier admission, the bitmap's `end_write` (so
//!    the chunk's bit is not quiet, hence never cleared) and the place among the N are kept
//!    until the write-behind legs complete too. If no such leg succeeded, the write waits
//!    for the write-behind legs and their result decides (the acknowledgement rules of a
//!    plain write, `leg_done`).
//! 4. **FLUSH** waits for every behind write acknowledged before it: under `deferred`'s lock
//!    it reads `outstanding`; if writes are behind, it bumps `flush_waiting` (so no new write
//!    goes behind and the count drains) and queues its write-behind legs' flushes, which the
//!    completion that takes `outstanding` to 0 submits (`release`, under the same lock, one
//!    at a time, then `flush_waiting` drops). The other legs are flushed at once. A write
//!    acknowledged before the flush was submitted took its place (`try_reserve`, AcqRel)
//!    before its acknowledgement, so the flush's read under the lock sees it: either it is
//!    still counted, or the completion that released it has done so before the flush looked
//!    (the completion's decrement is AcqRel and its lock release follows it; a flush that
//!    locks later sees it; one that locked first and saw it queues itself, and the completer
//!    then finds it when it locks).
//! 5. **Reads** never return what a behind write is replacing: a read that would go to a
//!    write-mostly leg while writes are behind lets its admission go, waits for `outstanding`
//!    to reach 0 (`wait_drained`, woken by `release`), and chooses again. It never sleeps
//!    admitted (a freeze would wait for it while the writes it waits for wait for nothing).
//!    While it waits it counts in `flush_waiting` too, so no new write goes behind and the
//!    count drains (a read can reach a write-mostly leg while another leg takes writes: the
//!    resync's reads go to the first in-sync leg, whichever it is).
//! 6. **No allocation per I/O**: a counter and a queue preallocated for `depth` flushes.

use std::collections::VecDeque;

use blkq_sync::atomic::{AtomicU32, Ordering};
use blkq_sync::Mutex;
use waitq::WaitQueue;

/// The array's write-behind state.
pub(crate) struct WriteBehind {
    /// N (0: off).
    pub(crate) limit: u32,
    /// Behind writes whose write-behind legs have not all completed: reserved before the
    /// write is submitted, released when every leg has it.
    outstanding: AtomicU32,
    /// Flushes and reads waiting for `outstanding` to reach 0; while non-zero no write goes
    /// behind.
    flush_waiting: AtomicU32,
    /// Those flushes: (per-I/O slot, write-behind legs still to flush).
    deferred: Mutex<VecDeque<(u32, u32)>>,
    /// Reads waiting for `outstanding` to reach 0.
    drained: WaitQueue,
}

impl WriteBehind {
    pub(crate) fn new(limit: u32, depth: usize) -> Self {
        Self {
            limit,
            outstanding: AtomicU32::new(0),
            flush_waiting: AtomicU32::new(0),
            deferred: Mutex::new(VecDeque::with_capacity(depth)),
            drained: WaitQueue::new(),
        }
    }

    /// Behind writes in flight.
    pub(crate) fn outstanding(&self) -> u32 {
        // Acquire: pairs with `release`'s AcqRel decrement (a reader that sees 0 sees the
        // write-behind legs' completions before it).
        self.outstanding.load(Ordering::Acquire)
    }

    /// Takes a place among the N, if one is free and no flush is waiting (invariant 1).
    pub(crate) fn try_reserve(&self) -> bool {
        if self.limit == 0 {
            return false;
        }
        // Acquire: pairs with the flush's AcqRel increment under `deferred` (invariant 4;
        // a write that misses it is concurrent with the flush, which need not wait for it).
        if self.flush_waiting.load(Ordering::Acquire) != 0 {
            return false;
        }
        let mut cur = self.outstanding.load(Ordering::Relaxed);
        loop {
            if cur >= self.limit {
                return false;
            }
            // AcqRel: the reservation is ordered before the write's acknowledgement, so a
            // flush submitted after it reads it (invariant 4).
            match self.outstanding.compare_exchange_weak(
                cur,
                cur + 1,
                Ordering::AcqRel,
                Ordering::Relaxed,
            ) {
                Ok(_) => return true,
                Err(now) => cur = now,
            }
        }
    }

    /// A flush (slot `id`) whose write-behind legs are `legs`: queues them if writes are
    /// behind (returns true: `release` submits them), else returns false (flush them now).
    pub(crate) fn defer_flush(&self, id: u32, legs: u32) -> bool {
        if legs == 0 {
            return false;
        }
        let mut q = self.deferred.lock();
        // Under the lock (invariant 4).
        if self.outstanding.load(Ordering::Acquire) == 0 {
            return false;
        }
        // AcqRel: seen by `try_reserve`'s Acquire load.
        self.flush_waiting.fetch_add(1, Ordering::AcqRel);
        q.push_back((id, legs));
        true
    }

    /// A behind write completed on every leg. When it was the last, hands each deferred
    /// flush to `submit` (one at a time, the lock not held) and wakes waiting reads.
    pub(crate) fn release(&self, mut submit: impl FnMut(u32, u32)) {
        // AcqRel: the write-behind legs' completions happen before a reader or flush that
        // sees the new count (invariants 4 and 5).
        if self.outstanding.fetch_sub(1, Ordering::AcqRel) != 1 {
            return;
        }
        loop {
            let next = {
                let mut q = self.deferred.lock();
                if self.outstanding.load(Ordering::Acquire) != 0 {
                    None // a write went behind meanwhile: its release drains
                } else {
                    q.pop_front()
                }
            };
            let Some((id, legs)) = next else { break };
            // AcqRel: pairs with `try_reserve`'s load; the queue still holds the others.
            self.flush_waiting.fetch_sub(1, Ordering::AcqRel);
            submit(id, legs);
        }
        self.drained.wake_all();
    }

    /// Waits (not admitted) until no write is behind (invariant 5).
    pub(crate) fn wait_drained(&self) {
        // AcqRel: seen by `try_reserve`'s Acquire load (no new write goes behind).
        self.flush_waiting.fetch_add(1, Ordering::AcqRel);
        self.drained
            .wait_for(|| (self.outstanding() == 0).then_some(()));
        self.flush_waiting.fetch_sub(1, Ordering::AcqRel);
    }
}
