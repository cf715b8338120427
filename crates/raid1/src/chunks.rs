//! The part of the write-intent bitmap that every write touches: per chunk a flags word
//! (dirty, durable, idle) and the chunk's writes in flight, counted per thread shard, so that
//! a write to a chunk whose bit is set and on disk costs an add to its own shard's counter, a
//! fence and a load of a line nobody writes (md takes the bitmap's spinlock twice per write;
//! on many cores that lock was the mirror's cap). Everything else about the bitmap lives in
//! [`crate::bitmap`], under its mutex.
//!
//! # State
//!
//! | what | written by | read by |
//! |---|---|---|
//! | `flags[c]`: `DIRTY`, `DURABLE`, `IDLE` | only with the bitmap's mutex held (slow paths, the clearer, persist) | writers, lock-free |
//! | `counts[s][c]`: writes counted into chunk `c` by threads of shard `s`, minus writes ended there (wrapping) | writers, lock-free (`fetch_add` on start, `fetch_sub` on end, any shard) | the clearer, summed over shards |
//!
//! A chunk's writes in flight are the wrapping sum of its counts over the shards: a write may
//! end on another thread (a leg's completion) than the one that started it, so one shard's
//! count may wrap below zero; only the sum means anything.
//!
//! # Invariants
//!
//! 1. A write whose [`Chunks::enter`] saw `DIRTY | DURABLE` without `IDLE` in each of its
//!    chunks may be issued at once: its bits are on disk, and they stay set until it ends.
//! 2. A chunk's bit is cleared only if it was marked `IDLE` by [`Chunks::try_mark_idle`]
//!    (which saw no write in flight there after setting `IDLE`), and `IDLE` is still set:
//!    every writer that saw `IDLE` (or no `DIRTY`) took the bitmap's mutex, which removes
//!    `IDLE` or sets the bit again and makes it durable before the write is issued.
//! 3. So between the marking and the clear no write was counted into the chunk without going
//!    through the mutex, and every write counted before the marking had ended by then.
//!
//! # Orderings
//!
//! Invariant 3 is a store-buffering (Dekker) pair: a writer adds to its count, then loads the
//! flags; the marker stores `IDLE`, then loads the counts. Each side puts a `SeqCst` fence
//! between its two accesses, so the fences are ordered one way or the other in the single
//! total order: if the marker's fence comes first, the writer's load sees `IDLE` (or a later
//! value); if the writer's comes first, the marker's load of that shard sees the add. Either
//! the marker sees the write in flight (and takes `IDLE` back) or the writer sees `IDLE` (and
//! takes the mutex the marker holds). The accesses themselves are `Relaxed`: the fences
//! order them. (Loom treats `SeqCst` accesses as `AcqRel`; fences are what it models right.)
//!
//! A writer's flags load is also `Acquire`, paired with the `Release` store that set
//! `DURABLE` after the bitmap reached every leg: a write that skips the mutex is issued after
//! the persist it relies on. A write's end is a `Release` subtraction and the marker's loads
//! are `Acquire`: a marker that saw the write end sees everything before it, the legs'
//! completions among them, so the flush the clear waits for begins after them.
//!
//! The flags are written only under the bitmap's mutex, so a read-modify-write there may be a
//! load and a store.
//!
//! # Locked mode
//!
//! With one shard and every call made with the bitmap's mutex held
//! ([`crate::bitmap::BitmapCounts::Locked`]) this is the simple version: a count per chunk
//! behind one lock, the fence a formality.

use blkq_sync::atomic::{fence, AtomicU32, Ordering};

/// The chunk's bit is set (in memory).
pub(crate) const DIRTY: u32 = 1;
/// The set bit is on disk on every leg.
pub(crate) const DURABLE: u32 = 2;
/// Marked by the clearer with no write in flight; the next write takes the mutex.
pub(crate) const IDLE: u32 = 4;
/// The state in which a write needs nothing but its count.
const STEADY: u32 = DIRTY | DURABLE;

/// Counters one thread shard may hold at most, over all shards (4 MiB of `u32`).
const MAX_COUNTERS: usize = 1 << 20;

/// Per-chunk flags and sharded counts of writes in flight. See the module docs.
#[derive(Debug)]
pub(crate) struct Chunks {
    flags: Box<[AtomicU32]>,
    /// `shards` runs of `stride` counters, each run starting on its own cache lines.
    counts: Box<[AtomicU32]>,
    stride: usize,
    shards: usize,
}

impl Chunks {
    /// `nr` chunks, clean, with `shards` shards (rounded down to a power of two, and fewer
    /// where `shards x nr` counters would pass 4 MiB).
    pub(crate) fn new(nr: usize, shards: usize) -> Self {
        // 32 counters = two cache lines: a shard's run never shares a line pair with another's.
        let stride = nr.max(1).next_multiple_of(32);
        let mut shards = shards.max(1);
        shards = 1 << (usize::BITS - 1 - shards.leading_zeros());
        while shards > 1 && shards * stride > MAX_COUNTERS {
            shards /= 2;
        }
        Self {
            flags: (0..nr).map(|_| AtomicU32::new(0)).collect(),
            counts: (0..shards * stride).map(|_| AtomicU32::new(0)).collect(),
            stride,
            shards,
        }
    }

    /// The current thread's shard (a hint: any shard is correct).
    #[inline]
    pub(crate) fn my_shard(&self) -> usize {
        blkq_sync::thread_slot() & (self.shards - 1)
    }

    #[inline]
    fn count(&self, shard: usize, i: usize) -> &AtomicU32 {
        &self.counts[(shard & (self.shards - 1)) * self.stride + i]
    }

    /// Counts a write into chunks `first..end` in `shard`; whether every one of them was
    /// steady (invariant 1: the write needs nothing more). When not, the caller takes the
    /// bitmap's mutex; the write stays counted either way.
    #[inline]
    pub(crate) fn enter(&self, shard: usize, first: usize, end: usize) -> bool {
        for i in first..end {
            // Relaxed: the fence below orders it before the flags loads (module docs).
            self.count(shard, i).fetch_add(1, Ordering::Relaxed);
        }
        fence(Ordering::SeqCst);
        // Acquire: pairs with the Release store of DURABLE (module docs).
        (first..end).all(|i| self.flags[i].load(Ordering::Acquire) & (STEADY | IDLE) == STEADY)
    }

    /// Ends a write counted by [`Chunks::enter`] into `first..end` (in any shard).
    #[inline]
    pub(crate) fn exit(&self, shard: usize, first: usize, end: usize) {
        for i in first..end {
            // Release: a marker that sees this end sees what came before it (module docs).
            self.count(shard, i).fetch_sub(1, Ordering::Release);
        }
    }

    /// Writes in flight in chunk `i` (a snapshot; exact with the writers shut out).
    pub(crate) fn in_flight(&self, i: usize) -> u32 {
        (0..self.shards).fold(0u32, |a, s| {
            // Acquire: pairs with `exit`'s Release (module docs).
            a.wrapping_add(self.count(s, i).load(Ordering::Acquire))
        })
    }

    /// Chunk `i`'s flags.
    #[inline]
    pub(crate) fn flags(&self, i: usize) -> u32 {
        self.flags[i].load(Ordering::Acquire)
    }

    /// Sets chunk `i`'s flags. Only with the bitmap's mutex held (the flags' one writer).
    #[inline]
    pub(crate) fn set_flags(&self, i: usize, f: u32) {
        // Release: a writer that sees DURABLE sees the persist before it.
        self.flags[i].store(f, Ordering::Release);
    }

    /// Marks dirty chunk `i` (flags `f`, without `IDLE`) idle if no write is in flight there;
    /// whether it did. Only with the bitmap's mutex held. See invariant 3.
    pub(crate) fn try_mark_idle(&self, i: usize, f: u32) -> bool {
        self.flags[i].store(f | IDLE, Ordering::Relaxed);
        // Between the IDLE store and the counts' loads (module docs: the Dekker pair).
        fence(Ordering::SeqCst);
        if self.in_flight(i) == 0 {
            return true;
        }
        self.flags[i].store(f, Ordering::Relaxed);
        false
    }
}

#[cfg(all(test, not(blkq_loom)))]
mod tests {
    use super::*;

    #[test]
    fn shards_are_a_power_of_two_and_bounded() {
        assert_eq!(Chunks::new(4, 6).shards, 4);
        assert_eq!(Chunks::new(4, 0).shards, 1);
        // 1M chunks: one shard's run is already the whole budget.
        assert_eq!(Chunks::new(1 << 20, 64).shards, 1);
        assert_eq!(Chunks::new(1 << 16, 64).shards, 16);
    }

    #[test]
    fn a_write_ended_on_another_shard_leaves_nothing_in_flight() {
        let c = Chunks::new(4, 4);
        assert!(!c.enter(1, 0, 2), "a clean chunk is not steady");
        assert_eq!(c.in_flight(0), 1);
        c.exit(3, 0, 2);
        assert_eq!((c.in_flight(0), c.in_flight(1)), (0, 0));
        c.set_flags(0, DIRTY | DURABLE);
        assert!(c.enter(2, 0, 1));
        assert!(!c.try_mark_idle(0, DIRTY | DURABLE), "a write is in flight");
        assert_eq!(c.flags(0), DIRTY | DURABLE);
        c.exit(0, 0, 1);
        assert!(c.try_mark_idle(0, DIRTY | DURABLE));
        assert!(
            !c.enter(1, 0, 1),
            "an idle chunk sends the writer to the mutex"
        );
    }
}
