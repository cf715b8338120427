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
//!    count drains (a read can reach a write-mostly leg while another leg takes writes: when
//!    it is the only in-sync leg, the resync's reads go to it).
//! 6. **No allocation per I/O**: a counter, a queue preallocated for `depth` flushes, and
//!    the order table of 7 (a queue of `depth` entries and `depth` x legs parked bios).
//! 7. **Overlapping writes reach a leg in order** (md's CollisionCheck). Acknowledged before
//!    a write-mostly leg has it, a write behind could be overtaken there by a later write
//!    over the same bytes (the caller's next write, issued after the acknowledgement): that
//!    leg would end with the older data while the bitmap bit clears, and a check would count
//!    mismatches. So, while write-behind is on (`limit > 0`), `order` runs for every write
//!    (any op that changes data) before any of its leg bios is submitted, under `order`'s
//!    lock, holding the write's per-I/O slot lock (so its `Io` is set up, and `Io::ordered`
//!    set, before any of its bios can complete):
//!    - a write behind enters the table (in submission order) with its write-mostly legs
//!      as `issued` (those that must wait, next, as `parked`);
//!    - a write (behind or not) whose range overlaps an entry still `issued` or `parked` on
//!      one of its legs does not get that leg's bio submitted: the bio is parked in the
//!      table, the write enters it (if not in already) with those legs as `parked`;
//!    - when a leg completes a bio the table counts (`Io::ordered`; `ordered_done`, before
//!      the completion's own bookkeeping), that leg's bit leaves its entry (the entry
//!      leaves the table when it has no bit left), and every parked bio on that leg with
//!      no earlier overlapping entry still issued or parked there is moved to `issued` and
//!      handed back to be submitted, one at a time, the lock not held.
//!
//!    Hence on each leg, of two overlapping writes the later one is submitted only after
//!    the earlier one completed there, when the earlier one was behind or itself waited;
//!    writes that do not overlap, and legs with nothing in flight over the range (the
//!    legs that are not write-mostly), are never held back. A write not behind that
//!    overlaps nothing in the table is not entered: it is acknowledged only once every leg
//!    has it, so any later write the caller issues follows it on every leg. Only the bio is
//!    parked: the caller's acknowledgement of a write behind still comes with the legs that
//!    are not write-behind (3.), its place among the N is held until the parked copy
//!    completed (so a FLUSH waits for it, 4., and a read waits for it, 5.), and its slot,
//!    admission and bitmap `end_write` too (so the chunk's bit stays set until the last of
//!    the overlapping writes reached every leg). A parked write holds its admission: a
//!    freeze waits for it, and for the earlier write it waits for, which is in flight on
//!    the leg and needs nothing from the freezer. Checking every leg of the write (not only
//!    the write-mostly ones) keeps the order when a leg's write-mostly flag is cleared
//!    while writes are behind on it. The table holds at most one entry per slot in use.

use std::collections::VecDeque;

use blk::Bio;
use blkq_sync::atomic::{AtomicU32, Ordering};
use blkq_sync::Mutex;
use waitq::WaitQueue;

use crate::legset::LegSet;

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
    deferred: Mutex<VecDeque<(u32, LegSet)>>,
    /// Reads waiting for `outstanding` to reach 0.
    drained: WaitQueue,
    /// The order of overlapping writes on each leg (invariant 7).
    order: Mutex<Order>,
    /// Slots of the array (the parked bios' stride).
    legs: usize,
}

/// A write in the order table (invariant 7).
#[derive(Debug, Clone, Copy)]
struct Entry {
    /// Its per-I/O slot.
    id: u32,
    /// Array bytes [start, end).
    start: u64,
    end: u64,
    /// Legs its bio is in flight on.
    issued: LegSet,
    /// Legs whose bio waits in `Order::bios`.
    parked: LegSet,
}

/// The order table (invariant 7).
struct Order {
    /// In submission order; at most one per slot.
    entries: VecDeque<Entry>,
    /// Parked bios, at `id * legs + leg`.
    bios: Vec<Option<Bio>>,
}

impl Order {
    /// The first parked bio on `leg` that no earlier overlapping entry holds back there:
    /// marked issued and taken.
    fn next_ready(&mut self, leg: usize, legs: usize) -> Option<Bio> {
        let j = (0..self.entries.len()).find(|&j| {
            let e = self.entries[j];
            e.parked.contains(leg)
                && !self.entries.iter().take(j).any(|p| {
                    (p.issued | p.parked).contains(leg) && p.start < e.end && e.start < p.end
                })
        })?;
        let e = &mut self.entries[j];
        e.parked.remove(leg);
        e.issued.insert(leg);
        let at = e.id as usize * legs + leg;
        self.bios.get_mut(at).and_then(Option::take)
    }
}

impl WriteBehind {
    /// N = `limit`, for `depth` per-I/O slots and `legs` leg slots.
    pub(crate) fn new(limit: u32, depth: usize, legs: usize) -> Self {
        // The order table only when write-behind is on.
        let (entries, parked) = if limit > 0 {
            (depth, depth * legs)
        } else {
            (0, 0)
        };
        Self {
            limit,
            outstanding: AtomicU32::new(0),
            flush_waiting: AtomicU32::new(0),
            deferred: Mutex::new(VecDeque::with_capacity(depth)),
            drained: WaitQueue::new(),
            order: Mutex::new(Order {
                entries: VecDeque::with_capacity(entries),
                bios: (0..parked).map(|_| None).collect(),
            }),
            legs,
        }
    }

    /// A write in slot `id` over array bytes [start, end), about to be submitted to `legs`
    /// (`bios[i]` for leg i), behind on `behind_legs` (0: not behind): parks the bios that
    /// must wait for an earlier overlapping write (taken out of `bios`) and returns the legs
    /// whose completion must call `ordered_done` (invariant 7). Called with the slot's `Io`
    /// set up and its lock held.
    pub(crate) fn order(
        &self,
        id: u32,
        (start, end): (u64, u64),
        legs: LegSet,
        behind_legs: LegSet,
        bios: &mut [Option<Bio>],
    ) -> LegSet {
        if self.limit == 0 {
            return LegSet::EMPTY;
        }
        let mut o = self.order.lock();
        let wait = o
            .entries
            .iter()
            .filter(|e| e.start < end && start < e.end)
            .fold(LegSet::EMPTY, |w, e| w | ((e.issued | e.parked) & legs));
        let tracked = behind_legs | wait;
        if tracked.is_empty() {
            return LegSet::EMPTY;
        }
        if o.entries.len() == o.entries.capacity() {
            // Cannot happen (one entry per slot in use); rather than grow, order nothing.
            return LegSet::EMPTY;
        }
        let base = id as usize * self.legs;
        for i in wait {
            let b = bios.get_mut(i).and_then(Option::take);
            if let Some(p) = o.bios.get_mut(base + i) {
                *p = b;
            }
        }
        o.entries.push_back(Entry {
            id,
            start,
            end,
            issued: behind_legs - wait,
            parked: wait,
        });
        tracked
    }

    /// Leg `leg` completed the bio of slot `id` that `order` counted: hands each parked bio
    /// on that leg this lets go to `issue`, one at a time, the lock not held (invariant 7).
    pub(crate) fn ordered_done(&self, id: u32, leg: usize, mut issue: impl FnMut(Bio)) {
        let mut next = {
            let mut o = self.order.lock();
            if let Some(p) = o.entries.iter().position(|e| e.id == id) {
                let e = &mut o.entries[p];
                e.issued.remove(leg);
                if (e.issued | e.parked).is_empty() {
                    let _ = o.entries.remove(p);
                }
            }
            o.next_ready(leg, self.legs)
        };
        while let Some(b) = next {
            issue(b);
            next = self.order.lock().next_ready(leg, self.legs);
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
    pub(crate) fn defer_flush(&self, id: u32, legs: LegSet) -> bool {
        if legs.is_empty() {
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
    pub(crate) fn release(&self, mut submit: impl FnMut(u32, LegSet)) {
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
