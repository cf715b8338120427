//! `Sbitmap`: the scalable tag bitmap.
//!
//! # Layout
//!
//! The bitmap is split into words of `1 << shift` bits (at most 32), each word alone on its
//! own cache line ([`CachePadded`]), so allocations that land in different words never bounce
//! a line between CPUs. Each word is **one `AtomicU64` holding two masks**:
//!
//! | bits   | name      | meaning of bit `i`                                             |
//! |--------|-----------|----------------------------------------------------------------|
//! | 0..32  | `alloc`   | tag `i` of this word is taken (or freed but not yet folded)     |
//! | 32..64 | `cleared` | tag `i` was freed with a deferred clear and awaits folding      |
//!
//! A tag is **owned** iff its `alloc` bit is set and its `cleared` bit is not. Freeing sets
//! the `cleared` bit (deferred clearing: the word's `alloc` half is left alone, so the hot
//! allocation bits are not disturbed on every free); an allocator that finds no free `alloc`
//! bit in the range it may use *folds* the word (`alloc &= !cleared; cleared = 0`) in one CAS,
//! then retries.
//!
//! ## Why one atomic and not two (a departure from the kernel)
//!
//! The kernel keeps `word` and `cleared` as two longs in the same cache line and folds with
//! `xchg(cleared, 0)` followed by `andnot(word, mask)`. Between those two steps the freed bits
//! are in neither mask: a concurrent allocator sees the word full and `cleared` empty, fails,
//! and may go to sleep while a tag is free, with the wake-up for that free already spent. That
//! is the hang fixed upstream by "sbitmap: fix io hung due to race on sbitmap_word::cleared",
//! which added a spinlock around the fold. Packing both masks into one 64-bit atomic makes the
//! fold a single CAS with no intermediate state, so there is nothing to lock; the price is at
//! most 32 bits per word, which costs nothing in cache traffic (the two masks shared a line
//! anyway) and at most twice the words for deep bitmaps.
//!
//! # Ordering
//!
//! Every modification of a word is a read-modify-write, so each one continues the release
//! sequence of the ones before it.
//! - A free is `fetch_or(cleared bit, Release)` (deferred) or `fetch_and(!bit, Release)`
//!   (`put_batch`): the owner's writes to whatever the tag indexes (a request) are released.
//! - An allocation is `fetch_or(alloc bit, Acquire)`: it reads a value in the release sequence
//!   of the free that made the bit available (directly, or through a fold CAS), so the previous
//!   owner's writes happen-before the new owner's accesses. The fold CAS needs no ordering of
//!   its own for that; it is `AcqRel` only to keep the argument local.
//! - Hints are `Relaxed`: they are guesses, and every guess is validated by the RMW above.

use blkq_sync::atomic::{AtomicU32, AtomicU64, Ordering};
use blkq_sync::CachePadded;

use crate::Error;

/// The largest supported `1 << shift`.
pub const MAX_BITS_PER_WORD: u32 = 32;
const MAX_SHIFT: u32 = 5;
/// The largest supported depth.
pub const MAX_DEPTH: u32 = 1 << 24;

#[inline]
fn low_mask(bits: u32) -> u32 {
    if bits >= 32 {
        u32::MAX
    } else {
        (1u32 << bits) - 1
    }
}

#[inline]
fn split(v: u64) -> (u32, u32) {
    (v as u32, (v >> 32) as u32)
}

/// The default word size for `depth`, as the kernel chooses it: as wide as allowed, narrowed
/// for small maps so that the bits spread over at least four words (four cache lines).
pub fn default_shift(depth: u32) -> u32 {
    let mut shift = MAX_SHIFT;
    if depth >= 4 {
        while shift > 0 && (4u32 << shift) > depth {
            shift -= 1;
        }
    }
    shift
}

/// A set of tags from one word, from [`Sbitmap::get_batch`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TagBatch {
    /// The tag of bit 0 of `mask`.
    pub base: u32,
    /// Which tags, relative to `base`.
    pub mask: u32,
}

impl TagBatch {
    /// Number of tags in the batch.
    pub fn len(&self) -> u32 {
        self.mask.count_ones()
    }

    /// Whether the batch is empty.
    pub fn is_empty(&self) -> bool {
        self.mask == 0
    }

    /// The tags, in increasing order.
    pub fn iter(&self) -> impl Iterator<Item = u32> {
        let (base, mut m) = (self.base, self.mask);
        std::iter::from_fn(move || {
            if m == 0 {
                return None;
            }
            let b = m.trailing_zeros();
            m &= m - 1;
            Some(base + b)
        })
    }
}

/// A scalable bitmap of tags.
///
/// # Invariants
///
/// - `words.len() << shift >= capacity >= depth`; bits at or past `depth` are never handed
///   out (a tag held across a shrinking `resize` may still be freed).
/// - A bit's `cleared` bit is set only while its `alloc` bit is set (see the module docs).
#[derive(Debug)]
pub struct Sbitmap {
    depth: AtomicU32,
    capacity: u32,
    shift: u32,
    round_robin: bool,
    words: Box<[CachePadded<AtomicU64>]>,
    /// Per-thread allocation hints (indexed by `thread_slot() & (len - 1)`).
    hints: Box<[CachePadded<AtomicU32>]>,
}

impl Sbitmap {
    /// A bitmap of `depth` bits, with `1 << shift` bits per word (`None`: [`default_shift`]).
    /// `round_robin` hands tags out in strict rotating order instead of cache-hot reuse.
    pub fn new(depth: u32, shift: Option<u32>, round_robin: bool) -> Result<Self, Error> {
        if depth > MAX_DEPTH {
            return Err(Error::DepthTooLarge {
                depth,
                max: MAX_DEPTH,
            });
        }
        let shift = shift.unwrap_or_else(|| default_shift(depth));
        if shift > MAX_SHIFT {
            return Err(Error::BadShift {
                shift,
                max: MAX_SHIFT,
            });
        }
        let nwords = depth.div_ceil(1 << shift).max(1) as usize;
        let nhints = if cfg!(blkq_loom) {
            1
        } else {
            let cpus = std::thread::available_parallelism().map_or(4, |n| n.get());
            (cpus * 2).next_power_of_two().min(256)
        };
        let hints = (0..nhints)
            .map(|i| {
                // Spread the threads' starting points over the map, as the kernel seeds its
                // per-CPU hints at random.
                let h = if depth == 0 {
                    0
                } else {
                    ((i as u64 * 0x9e37_79b9) % depth as u64) as u32
                };
                CachePadded(AtomicU32::new(h))
            })
            .collect();
        Ok(Self {
            depth: AtomicU32::new(depth),
            capacity: depth,
            shift,
            round_robin,
            words: (0..nwords)
                .map(|_| CachePadded(AtomicU64::new(0)))
                .collect(),
            hints,
        })
    }

    /// The current depth (number of usable tags).
    #[inline]
    pub fn depth(&self) -> u32 {
        self.depth.load(Ordering::Relaxed)
    }

    /// The depth given at creation: the most `resize` may grow back to.
    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    /// `log2` of the bits per word.
    pub fn shift(&self) -> u32 {
        self.shift
    }

    /// Whether tags are handed out round-robin.
    pub fn round_robin(&self) -> bool {
        self.round_robin
    }

    #[inline]
    fn word_depth(&self, index: usize, depth: u32) -> u32 {
        let start = (index as u32) << self.shift;
        if start >= depth {
            0
        } else {
            (depth - start).min(1 << self.shift)
        }
    }

    #[inline]
    fn map_nr(&self, depth: u32) -> usize {
        depth.div_ceil(1 << self.shift) as usize
    }

    #[inline]
    fn hint_slot(&self) -> &AtomicU32 {
        &self.hints[blkq_sync::thread_slot() & (self.hints.len() - 1)]
    }

    /// Folds deferred clears of a word whose usable range looked full. Returns whether any
    /// bit was folded (the caller should look again).
    #[inline]
    fn fold(word: &AtomicU64, seen: u64) -> bool {
        let (alloc, cleared) = split(seen);
        if cleared == 0 {
            return false;
        }
        // One CAS: there is no moment where a freed bit is in neither mask (module docs).
        // On failure someone changed the word; the caller looks again either way.
        let _ = word.compare_exchange(
            seen,
            u64::from(alloc & !cleared),
            Ordering::AcqRel,
            Ordering::Relaxed,
        );
        true
    }

    /// Takes one free bit of a word, among the low `limit` bits, searching from `hint` and, if
    /// `wrap`, then from 0.
    #[inline]
    fn get_word(word: &AtomicU64, limit: u32, hint: u32, wrap: bool) -> Option<u32> {
        let usable = low_mask(limit);
        let from = if hint >= 32 { 0 } else { u32::MAX << hint };
        loop {
            let v = word.load(Ordering::Relaxed);
            let free = !(v as u32) & usable;
            let mut cand = free & from;
            if cand == 0 && wrap {
                cand = free;
            }
            if cand == 0 {
                if free == 0 && Self::fold(word, v) {
                    continue;
                }
                return None;
            }
            let bit = 1u32 << cand.trailing_zeros();
            // Acquire: synchronizes with the Release of the free that made this bit available
            // (module docs), so the previous owner's writes are visible to us.
            let prev = word.fetch_or(u64::from(bit), Ordering::Acquire);
            if prev as u32 & bit == 0 {
                return Some(bit.trailing_zeros());
            }
            // Lost the race for this bit: look again.
        }
    }

    fn get_inner(&self, shallow: u32) -> Option<u32> {
        let depth = self.depth();
        if depth == 0 || shallow == 0 {
            return None;
        }
        let slot = self.hint_slot();
        let mut hint = slot.load(Ordering::Relaxed);
        if hint >= depth {
            hint = 0;
        }
        let map_nr = self.map_nr(depth);
        let first = (hint >> self.shift) as usize;
        let mut bit_hint = hint & ((1 << self.shift) - 1);
        // Round-robin visits the first word twice: from the hint to its end first, and from
        // its start last, so tags come out in strict rotating order.
        let visits = if self.round_robin { map_nr + 1 } else { map_nr };
        for i in 0..visits {
            let index = (first + i) % map_nr;
            let limit = self.word_depth(index, depth).min(shallow);
            if let Some(b) = Self::get_word(&self.words[index], limit, bit_hint, !self.round_robin)
            {
                let tag = ((index as u32) << self.shift) | b;
                if self.round_robin || tag == hint {
                    let next = if tag + 1 >= depth { 0 } else { tag + 1 };
                    slot.store(next, Ordering::Relaxed);
                }
                return Some(tag);
            }
            bit_hint = 0;
        }
        None
    }

    /// Allocates a free tag, or `None` if every tag is taken. Wait-free when a tag is free in
    /// the hinted word; lock-free always.
    #[inline]
    pub fn get(&self) -> Option<u32> {
        self.get_inner(u32::MAX)
    }

    /// Allocates using at most the low `shallow_depth` bits of each word (the kernel's shallow
    /// allocation, which lets a scheduler keep some tags back, e.g. for reads).
    #[inline]
    pub fn get_shallow(&self, shallow_depth: u32) -> Option<u32> {
        self.get_inner(shallow_depth)
    }

    /// Allocates up to `n` (1..=32) free tags from a single word in one CAS.
    pub fn get_batch(&self, n: u32) -> Option<TagBatch> {
        let depth = self.depth();
        if depth == 0 || n == 0 {
            return None;
        }
        let map_nr = self.map_nr(depth);
        let hint = self.hint_slot().load(Ordering::Relaxed);
        let first = if hint < depth {
            (hint >> self.shift) as usize
        } else {
            0
        };
        for i in 0..map_nr {
            let index = (first + i) % map_nr;
            let word = &self.words[index];
            let usable = low_mask(self.word_depth(index, depth));
            loop {
                let v = word.load(Ordering::Relaxed);
                let free = !(v as u32) & usable;
                if free == 0 {
                    if Self::fold(word, v) {
                        continue;
                    }
                    break;
                }
                // The lowest `n` free bits.
                let mut take = 0u32;
                let mut rest = free;
                for _ in 0..n.min(32) {
                    if rest == 0 {
                        break;
                    }
                    let low = rest & rest.wrapping_neg();
                    take |= low;
                    rest &= !low;
                }
                // Acquire, as in `get_word`; the CAS fails if any bit changed meanwhile.
                if word
                    .compare_exchange_weak(
                        v,
                        v | u64::from(take),
                        Ordering::Acquire,
                        Ordering::Relaxed,
                    )
                    .is_ok()
                {
                    return Some(TagBatch {
                        base: (index as u32) << self.shift,
                        mask: take,
                    });
                }
            }
        }
        None
    }

    #[inline]
    fn locate(&self, tag: u32) -> Option<(&AtomicU64, u32)> {
        let word = self.words.get((tag >> self.shift) as usize)?;
        Some((word, 1u32 << (tag & ((1 << self.shift) - 1))))
    }

    /// Frees `tag` with a deferred clear. Returns `false` (and changes nothing) if `tag` is out
    /// of range or not currently owned: a double free is the caller's bug, reported, not fatal
    /// (two racing frees of one tag are not detected).
    #[inline]
    pub fn put(&self, tag: u32) -> bool {
        let Some((word, bit)) = self.locate(tag) else {
            return false;
        };
        // A double free is the caller's bug: detect it before touching the word, so a stray
        // `cleared` bit can never make a free bit look owned (or an owned one free). The load
        // is on the line we are about to write anyway.
        let (alloc, cleared) = split(word.load(Ordering::Relaxed));
        if alloc & bit == 0 || cleared & bit != 0 {
            return false;
        }
        // Release: publishes the owner's writes to the next allocator (module docs).
        word.fetch_or(u64::from(bit) << 32, Ordering::Release);
        if !self.round_robin && tag < self.depth() {
            // Hand the cache-hot tag to this thread's next allocation.
            self.hint_slot().store(tag, Ordering::Relaxed);
        }
        true
    }

    /// Frees several tags, clearing their `alloc` bits directly, one RMW per word touched.
    /// Tags out of range or not owned are skipped. Returns how many tags were freed.
    pub fn put_batch(&self, tags: &[u32]) -> u32 {
        let mut freed = 0;
        let mut i = 0;
        while i < tags.len() {
            let index = tags[i] >> self.shift;
            let mut mask = 0u32;
            while i < tags.len() && tags[i] >> self.shift == index {
                mask |= 1 << (tags[i] & ((1 << self.shift) - 1));
                i += 1;
            }
            if let Some(word) = self.words.get(index as usize) {
                // Only owned bits are cleared (see `put` on double frees).
                let (alloc, cleared) = split(word.load(Ordering::Relaxed));
                let owned = alloc & !cleared & mask;
                if owned != 0 {
                    // Release, as in `put`.
                    word.fetch_and(!u64::from(owned), Ordering::Release);
                }
                freed += owned.count_ones();
            }
        }
        freed
    }

    /// Whether `tag` is currently owned (a snapshot).
    pub fn test(&self, tag: u32) -> bool {
        self.locate(tag).is_some_and(|(word, bit)| {
            let (alloc, cleared) = split(word.load(Ordering::Relaxed));
            alloc & bit != 0 && cleared & bit == 0
        })
    }

    /// Number of owned tags (a snapshot; exact when quiescent).
    pub fn weight(&self) -> u32 {
        self.words
            .iter()
            .map(|w| {
                let (alloc, cleared) = split(w.load(Ordering::Relaxed));
                (alloc & !cleared).count_ones()
            })
            .sum()
    }

    /// Changes the usable depth, up to the capacity given at creation. Tags held past the new
    /// depth stay owned until freed. Folds every word's deferred clears.
    pub fn resize(&self, depth: u32) -> Result<(), Error> {
        if depth > self.capacity {
            return Err(Error::DepthTooLarge {
                depth,
                max: self.capacity,
            });
        }
        for w in self.words.iter() {
            let mut v = w.load(Ordering::Relaxed);
            while split(v).1 != 0 {
                let (alloc, cleared) = split(v);
                match w.compare_exchange(
                    v,
                    u64::from(alloc & !cleared),
                    Ordering::AcqRel,
                    Ordering::Relaxed,
                ) {
                    Ok(_) => break,
                    Err(now) => v = now,
                }
            }
        }
        self.depth.store(depth, Ordering::Relaxed);
        Ok(())
    }
}

#[cfg(all(test, not(blkq_loom)))]
mod tests {
    use super::*;

    #[test]
    fn shift_defaults_like_the_kernel() {
        assert_eq!(default_shift(1), 5);
        assert_eq!(default_shift(2), 5);
        assert_eq!(default_shift(4), 0);
        assert_eq!(default_shift(8), 1);
        assert_eq!(default_shift(64), 4);
        assert_eq!(default_shift(128), 5);
        assert_eq!(default_shift(1 << 16), 5);
    }

    #[test]
    fn gets_every_tag_once_then_none() {
        for depth in [1, 2, 3, 7, 31, 32, 33, 64, 100, 1000] {
            let sb = Sbitmap::new(depth, None, false).unwrap();
            let mut seen = vec![false; depth as usize];
            for _ in 0..depth {
                let t = sb.get().expect("free tag");
                assert!(!seen[t as usize], "tag {t} handed out twice");
                seen[t as usize] = true;
            }
            assert_eq!(sb.get(), None);
            assert_eq!(sb.weight(), depth);
        }
    }

    #[test]
    fn deferred_clear_is_folded_when_the_word_looks_full() {
        let sb = Sbitmap::new(4, Some(2), false).unwrap();
        let tags: Vec<u32> = (0..4).map(|_| sb.get().unwrap()).collect();
        assert!(sb.put(tags[2]));
        assert_eq!(sb.weight(), 3);
        // The freed bit sits in `cleared` until an allocation folds it.
        assert_eq!(sb.get(), Some(tags[2]));
        assert_eq!(sb.get(), None);
    }

    #[test]
    fn double_put_is_rejected() {
        let sb = Sbitmap::new(8, None, false).unwrap();
        let t = sb.get().unwrap();
        assert!(sb.put(t));
        assert!(!sb.put(t), "double free must be refused");
        assert!(!sb.put(5), "never allocated");
        assert!(!sb.put(1000), "out of range");
        assert_eq!(sb.weight(), 0);
        assert_eq!(
            std::iter::from_fn(|| sb.get()).count(),
            8,
            "all tags still usable"
        );
    }

    #[test]
    fn shallow_uses_only_low_bits_of_each_word() {
        let sb = Sbitmap::new(64, Some(4), false).unwrap();
        let mut got = vec![];
        while let Some(t) = sb.get_shallow(2) {
            got.push(t);
        }
        assert_eq!(got.len(), 8); // 4 words x 2 bits
        assert!(got.iter().all(|t| t % 16 < 2));
    }

    #[test]
    fn batch_get_and_put() {
        let sb = Sbitmap::new(64, Some(4), false).unwrap();
        let b = sb.get_batch(5).unwrap();
        assert_eq!(b.len(), 5);
        let tags: Vec<u32> = b.iter().collect();
        assert!(tags.iter().all(|&t| sb.test(t)));
        assert_eq!(sb.put_batch(&tags), 5);
        assert_eq!(sb.weight(), 0);
    }

    #[test]
    fn round_robin_rotates() {
        let sb = Sbitmap::new(8, Some(1), true).unwrap();
        let mut order = vec![];
        for _ in 0..16 {
            let t = sb.get().unwrap();
            order.push(t);
            sb.put(t);
        }
        for w in order.windows(2) {
            assert_eq!(w[1], (w[0] + 1) % 8, "order {order:?}");
        }
    }

    #[test]
    fn resize_limits_and_restores() {
        let sb = Sbitmap::new(16, None, false).unwrap();
        sb.resize(4).unwrap();
        let got: Vec<_> = std::iter::from_fn(|| sb.get()).collect();
        assert_eq!(got.len(), 4);
        assert!(got.iter().all(|&t| t < 4));
        assert!(sb.resize(17).is_err());
        sb.resize(16).unwrap();
        assert_eq!(std::iter::from_fn(|| sb.get()).count(), 12);
    }

    #[test]
    fn threads_never_share_a_tag() {
        use blkq_sync::atomic::AtomicBool as StdBool;
        let sb = blkq_sync::DynArc::new(Sbitmap::new(32, None, false).unwrap());
        let owned: blkq_sync::DynArc<Vec<StdBool>> =
            blkq_sync::DynArc::new((0..32).map(|_| StdBool::new(false)).collect());
        let hs: Vec<_> = (0..4)
            .map(|_| {
                let (sb, owned) = (sb.clone(), owned.clone());
                std::thread::spawn(move || {
                    for _ in 0..20_000 {
                        if let Some(t) = sb.get() {
                            assert!(!owned[t as usize].swap(true, Ordering::AcqRel));
                            owned[t as usize].store(false, Ordering::Release);
                            assert!(sb.put(t));
                        }
                    }
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
        assert_eq!(sb.weight(), 0);
    }
}
