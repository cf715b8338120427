//! One dirty bitmap in memory: a name, a granularity and two arrays of atomic words, `dirty`
//! (the bits as the export sees them) and `durable` (the bits known to be on disk).
//!
//! # Invariants and orderings
//!
//! - A bit is never cleared in place: `clear` and `rotate` start a fresh [`Bitmap`] object
//!   (see `tracked.rs`). So both arrays only grow, and `durable ⊆ dirty` at all times.
//! - `dirty[w]` is set with `fetch_or(Relaxed)` by a writer before it asks the committer to
//!   persist the word's page; the committer's mutex orders that store before the leader's
//!   snapshot (the writer pushes its page under the lock after the `fetch_or`, the leader takes
//!   the batch under the same lock before it loads the words). Readers of extents load with
//!   `Acquire`, pairing with nothing in particular: a concurrent write may or may not show, and
//!   a write that completed before the read shows because its completion is ordered after its
//!   `fetch_or` by the device's completion path (and `rotate` orders it through the gate).
//! - `durable[w]` is set with `fetch_or(Release)` by the leader only after the page that holds
//!   those bits was written and synced. A writer's fast path loads it with `Acquire`: seeing
//!   its bits there means the persist that put them on disk happened before, so the write may
//!   go down at once. That load is the whole steady-state cost per word.

use blkq_sync::atomic::{AtomicU64, Ordering};

/// Bits of one word.
pub const WORD_BITS: u64 = 64;

/// Smallest granularity, bytes.
pub const MIN_GRANULARITY: u64 = 4096;
/// Largest granularity, bytes.
pub const MAX_GRANULARITY: u64 = 64 << 20;
/// Default granularity, bytes.
pub const DEFAULT_GRANULARITY: u64 = 64 << 10;

/// Checks a granularity: a power of two from [`MIN_GRANULARITY`] to [`MAX_GRANULARITY`].
pub fn check_granularity(g: u64) -> Result<u32, crate::Error> {
    if !(MIN_GRANULARITY..=MAX_GRANULARITY).contains(&g) || !g.is_power_of_two() {
        return Err(crate::Error::BadGranularity(g));
    }
    Ok(g.trailing_zeros())
}

/// One named dirty bitmap (see the module docs).
#[derive(Debug)]
pub struct Bitmap {
    name: String,
    shift: u32,
    capacity: u64,
    nbits: u64,
    /// First page of its region in the sidecar (0 for a bitmap kept in memory only).
    region: u64,
    dirty: Box<[AtomicU64]>,
    durable: Box<[AtomicU64]>,
}

/// `n` bits of clean words, or `None` when the memory cannot be had (allocated fallibly: a
/// huge export once aborted the whole process here).
fn words(n: u64) -> Option<Box<[AtomicU64]>> {
    let n = usize::try_from(n.div_ceil(WORD_BITS)).ok()?;
    let mut v = Vec::new();
    v.try_reserve_exact(n).ok()?;
    v.resize_with(n, || AtomicU64::new(0));
    Some(v.into_boxed_slice())
}

impl Bitmap {
    /// A clean bitmap over `capacity` bytes, `1 << shift` bytes per bit, stored from page
    /// `region` of its sidecar. Its memory (two bits per granule) is allocated fallibly:
    /// [`crate::Error::NoMemory`], naming the size, when it cannot be had.
    pub fn new(name: &str, capacity: u64, shift: u32, region: u64) -> Result<Self, crate::Error> {
        let nbits = capacity.div_ceil(1 << shift);
        let no_memory = || crate::Error::NoMemory {
            name: name.to_string(),
            capacity,
            granularity: 1 << shift,
            bytes: nbits.div_ceil(WORD_BITS).saturating_mul(16),
        };
        let dirty = words(nbits).ok_or_else(no_memory)?;
        let durable = words(nbits).ok_or_else(no_memory)?;
        Ok(Self {
            name: name.to_string(),
            shift,
            capacity,
            nbits,
            region,
            dirty,
            durable,
        })
    }

    /// The name.
    pub fn name(&self) -> &str {
        &self.name
    }
    /// Bytes per bit.
    pub fn granularity(&self) -> u64 {
        1 << self.shift
    }
    /// log2 of the granularity.
    pub fn shift(&self) -> u32 {
        self.shift
    }
    /// Number of bits.
    pub fn nbits(&self) -> u64 {
        self.nbits
    }
    /// Number of words.
    pub fn nwords(&self) -> usize {
        self.dirty.len()
    }
    /// First page of the region in the sidecar.
    pub fn region(&self) -> u64 {
        self.region
    }

    /// The bits `[first, end)` of the bytes `[offset, offset + len)` (clamped to the device).
    fn bit_range(&self, offset: u64, len: u64) -> Option<(u64, u64)> {
        let end = offset.saturating_add(len).min(self.capacity);
        if len == 0 || offset >= end {
            return None;
        }
        Some((offset >> self.shift, ((end - 1) >> self.shift) + 1))
    }

    /// Sets the bits of `[offset, offset + len)`; returns the word range `[w0, w1)` whose bits
    /// are not all durable yet (`None`: nothing to persist, the steady state, one `Acquire`
    /// load per word).
    pub fn mark(&self, offset: u64, len: u64) -> Option<(usize, usize)> {
        let (first, end) = self.bit_range(offset, len)?;
        let mut need: Option<(usize, usize)> = None;
        let (w0, w1) = ((first / WORD_BITS) as usize, (end - 1) / WORD_BITS + 1);
        for w in w0..w1 as usize {
            let m = mask(first, end, w);
            if self.durable[w].load(Ordering::Acquire) & m == m {
                continue;
            }
            // Relaxed: the committer's lock orders this before its snapshot (module docs).
            self.dirty[w].fetch_or(m, Ordering::Relaxed);
            need = Some(match need {
                None => (w, w + 1),
                Some((a, _)) => (a, w + 1),
            });
        }
        need
    }

    /// Whether every bit of `[offset, offset + len)` is durable (after a persist, to tell
    /// whether it reached the disk).
    pub fn is_durable(&self, offset: u64, len: u64) -> bool {
        let Some((first, end)) = self.bit_range(offset, len) else {
            return true;
        };
        let (w0, w1) = (
            (first / WORD_BITS) as usize,
            ((end - 1) / WORD_BITS + 1) as usize,
        );
        (w0..w1).all(|w| {
            let m = mask(first, end, w);
            self.durable[w].load(Ordering::Acquire) & m == m
        })
    }

    /// Word `w` of the dirty bits (a snapshot for the committer and the encoder).
    pub fn dirty_word(&self, w: usize) -> u64 {
        self.dirty[w].load(Ordering::Acquire)
    }

    /// Records that the bits `v` of word `w` are on disk (after the sync that put them there).
    pub fn set_durable(&self, w: usize, v: u64) {
        // Release: pairs with the Acquire of `mark`'s fast path (module docs).
        self.durable[w].fetch_or(v, Ordering::Release);
    }

    /// Loads word `w` from disk: dirty and durable at once (it is on disk).
    pub fn load_word(&self, w: usize, v: u64) {
        self.dirty[w].fetch_or(v, Ordering::Relaxed);
        self.durable[w].fetch_or(v, Ordering::Release);
    }

    /// Marks every bit dirty (in memory; the caller persists).
    pub fn set_all(&self) {
        let n = self.nwords();
        for w in 0..n {
            let m = mask(0, self.nbits, w);
            self.dirty[w].fetch_or(m, Ordering::Relaxed);
        }
    }

    /// Whether bit `i` is dirty.
    pub fn is_dirty(&self, i: u64) -> bool {
        i < self.nbits && self.dirty_word((i / WORD_BITS) as usize) & (1 << (i % WORD_BITS)) != 0
    }

    /// Bytes marked dirty (granules times granularity, the last granule cut at the device's
    /// end).
    pub fn dirty_bytes(&self) -> u64 {
        let ones: u64 = (0..self.nwords())
            .map(|w| u64::from(self.dirty_word(w).count_ones()))
            .sum();
        let mut bytes = ones << self.shift;
        let tail = self.nbits << self.shift;
        if tail > self.capacity && self.is_dirty(self.nbits - 1) {
            bytes -= tail - self.capacity;
        }
        bytes
    }

    /// The first bit at or after `i` (and before `end`) whose state is not `state`; `end` if
    /// none. Skips whole words.
    fn next_change(&self, mut i: u64, end: u64, state: bool) -> u64 {
        while i < end {
            let w = (i / WORD_BITS) as usize;
            #[cfg(all(test, not(blkq_loom)))]
            tests::SCANNED.with(|c| c.set(c.get() + 1));
            let mut v = self.dirty_word(w);
            if state {
                v = !v;
            }
            v &= !0u64 << (i % WORD_BITS);
            if v != 0 {
                let j = (w as u64) * WORD_BITS + u64::from(v.trailing_zeros());
                return j.min(end);
            }
            i = (w as u64 + 1) * WORD_BITS;
        }
        end
    }

    /// The dirty runs of `[offset, offset + len)` (see [`blk::DirtyBitmaps::dirty_extents_into`]).
    pub fn extents_into(&self, offset: u64, len: u64, max: usize, out: &mut Vec<blk::DirtyExtent>) {
        out.clear();
        let end = offset.saturating_add(len).min(self.capacity);
        if offset >= end {
            return;
        }
        // The scan stops at the range's last bit, not the bitmap's: a 4 KiB request at the
        // start of a large clean bitmap once read every word of it.
        let end_bit = ((end - 1) >> self.shift) + 1;
        let mut pos = offset;
        while pos < end && out.len() < max {
            let bit = pos >> self.shift;
            let dirty = self.is_dirty(bit);
            let next_bit = self.next_change(bit, end_bit, dirty);
            let run_end = (next_bit << self.shift).min(end);
            out.push(blk::DirtyExtent {
                len: run_end - pos,
                dirty,
            });
            pos = run_end;
        }
    }
}

/// The mask of the bits `[first, end)` that fall in word `w`.
#[inline]
fn mask(first: u64, end: u64, w: usize) -> u64 {
    let base = w as u64 * WORD_BITS;
    let lo = first.max(base) - base;
    let hi = end.min(base + WORD_BITS) - base;
    if hi <= lo {
        return 0;
    }
    let ones = if hi - lo == WORD_BITS {
        !0
    } else {
        (1u64 << (hi - lo)) - 1
    };
    ones << lo
}

#[cfg(all(test, not(blkq_loom)))]
mod tests {
    use super::*;
    use blk::DirtyExtent;

    thread_local! {
        /// Words `next_change` looked at on this thread.
        pub(super) static SCANNED: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
    }

    #[test]
    fn extents_look_at_the_words_of_the_range_asked_only() {
        // 1 GiB at 4 KiB: 4096 words, all clean.
        let b = Bitmap::new("a", 1 << 30, 12, 0).unwrap();
        let mut out = Vec::new();
        SCANNED.with(|c| c.set(0));
        b.extents_into(0, 4096, 16, &mut out);
        assert_eq!(
            out,
            [DirtyExtent {
                len: 4096,
                dirty: false
            }]
        );
        let n = SCANNED.with(|c| c.get());
        assert!(n <= 1, "a 4 KiB request looked at {n} words");
        // A range across two words, and one at the end.
        SCANNED.with(|c| c.set(0));
        b.extents_into(63 * 4096, 2 * 4096, 16, &mut out);
        assert_eq!(SCANNED.with(|c| c.get()), 2);
        SCANNED.with(|c| c.set(0));
        b.extents_into((1 << 30) - 4096, 4096, 16, &mut out);
        assert_eq!(SCANNED.with(|c| c.get()), 1);
    }

    #[test]
    fn granularity_bounds() {
        assert_eq!(check_granularity(4096).unwrap(), 12);
        assert_eq!(check_granularity(64 << 20).unwrap(), 26);
        for bad in [0, 2048, 4097, 128 << 20, 3 << 12] {
            assert!(matches!(
                check_granularity(bad),
                Err(crate::Error::BadGranularity(g)) if g == bad
            ));
        }
    }

    #[test]
    fn mark_then_durable_then_fast_path() {
        let b = Bitmap::new("a", 10 << 20, 16, 0).unwrap();
        assert_eq!(b.nbits(), 160);
        assert_eq!(b.mark(65536 * 63, 65536 * 2), Some((0, 2)));
        assert!(!b.is_durable(65536 * 63, 1));
        b.set_durable(0, b.dirty_word(0));
        b.set_durable(1, b.dirty_word(1));
        assert_eq!(b.mark(65536 * 63, 4096), None, "durable: one load");
        assert!(b.is_durable(65536 * 63, 65536 * 2));
        assert_eq!(b.dirty_bytes(), 2 * 65536);
        // Out of range: clamped, never a panic.
        assert_eq!(b.mark(u64::MAX - 5, 10), None);
        assert_eq!(b.mark(0, 0), None);
    }

    #[test]
    fn extents_are_runs_of_equal_state() {
        let b = Bitmap::new("a", 1 << 20, 12, 0).unwrap(); // 256 bits
        b.mark(8192, 4096);
        b.mark(64 * 4096, 70 * 4096);
        let mut out = Vec::new();
        b.extents_into(0, 1 << 20, 16, &mut out);
        let d = |len, dirty| DirtyExtent { len, dirty };
        assert_eq!(
            out,
            [
                d(8192, false),
                d(4096, true),
                d(61 * 4096, false),
                d(70 * 4096, true),
                d((256 - 134) * 4096, false)
            ]
        );
        b.extents_into(100, 8192, 1, &mut out);
        assert_eq!(out, [d(8092, false)]);
        b.extents_into(9000, 1000, 5, &mut out);
        assert_eq!(out, [d(1000, true)]);
    }

    #[test]
    fn partial_last_granule_counts_only_the_device() {
        let b = Bitmap::new("a", 65536 + 4096, 16, 0).unwrap();
        b.set_all();
        assert_eq!(b.dirty_bytes(), 65536 + 4096);
        let mut out = Vec::new();
        b.extents_into(0, u64::MAX, 8, &mut out);
        assert_eq!(
            out,
            [DirtyExtent {
                len: 65536 + 4096,
                dirty: true
            }]
        );
    }
}
