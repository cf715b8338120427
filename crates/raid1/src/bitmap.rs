//! The write-intent bitmap: one bit per chunk of the array (default 64 MiB, as mdadm's
//! internal bitmap) saying "legs may differ here".
//!
//! In memory each chunk has its writes in flight, a dirty bit, whether the set bit is known
//! durable on every leg, and whether the clearer marked it idle (when, in which flush epoch).
//! The counts and flags are lock-free (`chunks`: a write to a chunk whose bit is set and on
//! disk takes no lock); the rest is under one mutex. On disk (every leg, between the
//! superblock and the data) it is a 4 KiB header and the bit array, checksummed with crc32c.
//!
//! Protocol (the caller is [`crate::Raid1`], or a resync thread):
//!
//! 1. [`WriteIntentBitmap::start_write`] counts the write in its chunks and sets their bits.
//!    If it returns `Some(chunks)`, some bit is not yet durable: the caller writes the bitmap
//!    ([`WriteIntentBitmap::encode`], under one persist lock so later snapshots land later) to
//!    every leg, flushes every leg, calls [`WriteIntentBitmap::mark_durable`], and only then
//!    issues the data write. `None` (the steady state) costs an add, a fence and a load.
//! 2. [`WriteIntentBitmap::end_write`] when every leg completed the write.
//! 3. Flushes of every leg are bracketed with [`WriteIntentBitmap::begin_flush`] /
//!    [`WriteIntentBitmap::flush_done`].
//! 4. A chunk is cleared in two steps (md's daemon does the same): the clearer marks dirty
//!    chunks with no write in flight idle ([`WriteIntentBitmap::mark_idle`]; the next write
//!    there takes the mutex and takes the mark back); a chunk still marked once a flush begun
//!    after the mark has completed on every leg has had every write before the mark flushed
//!    and none since. [`WriteIntentBitmap::clear_quiet`] (from a periodic thread) clears such
//!    chunks marked at least [`WriteIntentBitmap::quiet_time`] ago, never while the array is
//!    degraded (so a returning leg copies only what it missed), then marks; the caller
//!    persists the bitmap. A clear may reach the disk late; that is the safe direction.
//!
//! Time is passed in as a `Duration` since an arbitrary origin, so tests use a fake clock.

use std::time::Duration;

use blkq_sync::Mutex;

use crate::chunks::{Chunks, DIRTY, DURABLE, IDLE};

/// Default bytes of data per bit (mdadm's internal bitmap default).
pub const DEFAULT_CHUNK_SIZE: u64 = 64 << 20;
/// Default time a chunk must be quiet before its bit is cleared.
pub const DEFAULT_QUIET: Duration = Duration::from_secs(5);
/// The on-disk magic.
pub const BITMAP_MAGIC: [u8; 8] = *b"BLKQBMP1";
/// Size of the on-disk header.
pub const HEADER_SIZE: usize = 4096;

/// Bitmap errors.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BitmapError {
    /// A chunk size that is not a power of two of at least 4 KiB.
    #[error("bad bitmap chunk size {0}")]
    BadChunkSize(u64),
    /// A range outside the array.
    #[error("range {offset}+{len} is outside the bitmap ({size} bytes)")]
    OutOfRange {
        /// Start, bytes.
        offset: u64,
        /// Length, bytes.
        len: u64,
        /// Array size.
        size: u64,
    },
    /// `end_write` without a matching `start_write`.
    #[error("end_write without start_write on chunk {0}")]
    NotStarted(u64),
    /// An on-disk bitmap that is not one, or corrupt, or for another geometry.
    #[error("bad on-disk bitmap: {0}")]
    BadDisk(&'static str),
    /// A `bitmap_counts` that is neither `sharded` nor `locked`.
    #[error("bad bitmap_counts {0:?} (sharded|locked)")]
    BadMode(String),
}

/// A run of chunk indices `first..end`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkSet {
    /// First chunk.
    pub first: u64,
    /// One past the last chunk.
    pub end: u64,
}

/// How writes are counted in their chunks (spec option `bitmap_counts=sharded|locked`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BitmapCounts {
    /// Per thread shard, lock-free; a write to a chunk whose bit is set and on disk takes no
    /// lock (see `chunks`).
    #[default]
    Sharded,
    /// One count per chunk behind the bitmap's mutex, taken twice per write (the simple
    /// version, as md's bitmap spinlock).
    Locked,
}

impl std::str::FromStr for BitmapCounts {
    type Err = BitmapError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "sharded" => Ok(BitmapCounts::Sharded),
            "locked" => Ok(BitmapCounts::Locked),
            _ => Err(BitmapError::BadMode(s.to_string())),
        }
    }
}

/// What the clearer keeps per chunk (under the mutex).
#[derive(Debug, Clone, Copy, Default)]
struct Meta {
    /// md's NEEDED: the legs may differ here for a reason older than this run (a bit loaded
    /// at assemble, or set without a write): only a completed resync or recovery clears it,
    /// never quiet time.
    needed: bool,
    /// The flush epoch begun when the chunk was marked idle.
    mark_epoch: u64,
    /// When it was marked idle.
    mark_time: Duration,
}

/// What the bitmap keeps under its mutex: the clearer's per-chunk marks, the flush epochs and
/// the bit-change counters.
#[derive(Debug)]
struct BitmapState {
    meta: Vec<Meta>,
    degraded: bool,
    /// Flush epochs begun.
    epoch: u64,
    /// Highest flush epoch completed on every leg.
    flushed: u64,
    /// Bumped when a bit changes (for persistence decisions).
    events: u64,
    /// The array's superblock `events` when bits were last cleared (md's `events_cleared`):
    /// a leg whose superblock events are at least this saw every write whose bit was cleared,
    /// so a bitmap recovery (re-add) is enough for it.
    events_cleared: u64,
}

/// The write-intent bitmap of one array. See the module docs.
#[derive(Debug)]
pub struct WriteIntentBitmap {
    size: u64,
    chunk_shift: u32,
    nr_chunks: u64,
    quiet: Duration,
    mode: BitmapCounts,
    /// Flags and writes in flight per chunk (lock-free; see `chunks`).
    chunks: Chunks,
    inner: Mutex<BitmapState>,
}

impl WriteIntentBitmap {
    /// A clean bitmap over `size` bytes of data with `chunk_size` bytes per bit.
    pub fn new(size: u64, chunk_size: u64) -> Result<Self, BitmapError> {
        if chunk_size < 4096 || !chunk_size.is_power_of_two() {
            return Err(BitmapError::BadChunkSize(chunk_size));
        }
        let nr_chunks = size.div_ceil(chunk_size);
        Ok(Self {
            size,
            chunk_shift: chunk_size.trailing_zeros(),
            nr_chunks,
            quiet: DEFAULT_QUIET,
            mode: BitmapCounts::Sharded,
            chunks: Chunks::new(nr_chunks as usize, blkq_sync::stat::shard_count()),
            inner: Mutex::new(BitmapState {
                meta: vec![Meta::default(); nr_chunks as usize],
                degraded: false,
                epoch: 0,
                flushed: 0,
                events: 0,
                events_cleared: 0,
            }),
        })
    }

    /// Sets how long a chunk must be quiet before its bit is cleared.
    pub fn with_quiet_time(mut self, quiet: Duration) -> Self {
        self.quiet = quiet;
        self
    }

    /// Sets how writes are counted (before any is). `Sharded` gets
    /// `blkq_sync::stat::shard_count()` shards.
    pub fn with_counts(self, mode: BitmapCounts) -> Self {
        let shards = match mode {
            BitmapCounts::Sharded => blkq_sync::stat::shard_count(),
            BitmapCounts::Locked => 1,
        };
        self.with_shards(mode, shards)
    }

    /// [`WriteIntentBitmap::with_counts`] with `shards` shards in the sharded mode (a model
    /// gives two threads two shards; loom's threads all have slot 0).
    pub fn with_shards(mut self, mode: BitmapCounts, shards: usize) -> Self {
        self.mode = mode;
        let shards = if mode == BitmapCounts::Locked {
            1
        } else {
            shards
        };
        self.chunks = Chunks::new(self.nr_chunks as usize, shards);
        self
    }

    /// How writes are counted.
    pub fn counts(&self) -> BitmapCounts {
        self.mode
    }

    /// How long a chunk must be quiet before its bit is cleared.
    pub fn quiet_time(&self) -> Duration {
        self.quiet
    }

    /// Bytes per bit.
    pub fn chunk_size(&self) -> u64 {
        1 << self.chunk_shift
    }

    /// Number of chunks.
    pub fn nr_chunks(&self) -> u64 {
        self.nr_chunks
    }

    /// The chunks covering a byte range.
    pub fn chunks_of(&self, offset: u64, len: u64) -> Result<ChunkSet, BitmapError> {
        let end = offset
            .checked_add(len)
            .filter(|&e| e <= self.size && len > 0);
        let Some(end) = end else {
            return Err(BitmapError::OutOfRange {
                offset,
                len,
                size: self.size,
            });
        };
        Ok(ChunkSet {
            first: offset >> self.chunk_shift,
            end: ((end - 1) >> self.chunk_shift) + 1,
        })
    }

    /// Counts a write of `offset..offset+len` in its chunks and sets their bits. Returns the
    /// chunks whose bits are not yet durable: persist the bitmap, flush every leg and call
    /// [`WriteIntentBitmap::mark_durable`] before issuing the write.
    pub fn start_write(&self, offset: u64, len: u64) -> Result<Option<ChunkSet>, BitmapError> {
        self.start_write_in(self.chunks.my_shard(), offset, len)
    }

    /// [`WriteIntentBitmap::start_write`] counting in shard `shard` (what `start_write` does
    /// with the thread's shard; a model uses it to put two threads in two shards).
    pub fn start_write_in(
        &self,
        shard: usize,
        offset: u64,
        len: u64,
    ) -> Result<Option<ChunkSet>, BitmapError> {
        let cs = self.chunks_of(offset, len)?;
        let (first, end) = (cs.first as usize, cs.end as usize);
        match self.mode {
            BitmapCounts::Sharded => {
                if self.chunks.enter(shard, first, end) {
                    return Ok(None);
                }
                let mut g = self.inner.lock();
                Ok(self.set_bits(&mut g, cs))
            }
            BitmapCounts::Locked => {
                let mut g = self.inner.lock();
                self.chunks.enter(0, first, end);
                Ok(self.set_bits(&mut g, cs))
            }
        }
    }

    /// The slow path of a write counted in `cs`: sets the bits, takes back `IDLE` marks, and
    /// returns the chunks whose bits are not durable.
    fn set_bits(&self, g: &mut BitmapState, cs: ChunkSet) -> Option<ChunkSet> {
        let mut need: Option<ChunkSet> = None;
        let mut changed = false;
        for i in cs.first..cs.end {
            let f = self.chunks.flags(i as usize);
            let nf = if f & DIRTY == 0 {
                changed = true;
                DIRTY
            } else {
                f & !IDLE
            };
            if nf != f {
                self.chunks.set_flags(i as usize, nf);
            }
            if nf & DURABLE == 0 {
                need = Some(ChunkSet {
                    first: need.map_or(i, |n| n.first),
                    end: i + 1,
                });
            }
        }
        if changed {
            g.events += 1;
        }
        need
    }

    /// Records that the bits of `set` are on disk on every leg (after the persist + flush
    /// that followed `start_write`).
    pub fn mark_durable(&self, set: ChunkSet) {
        let _g = self.inner.lock();
        let end = set.end.min(self.nr_chunks);
        for i in set.first.min(end)..end {
            let f = self.chunks.flags(i as usize);
            // The write that set the bit is still counted in the chunk, so no clear took it
            // (invariant 2 of `chunks`: a clear needs a mark made with no write in flight).
            assert!(
                f & DIRTY != 0,
                "chunk {i} made durable with its bit clear while its write is in flight"
            );
            self.chunks.set_flags(i as usize, f | DURABLE);
        }
    }

    /// Whether every chunk `len` bytes from `offset` touch has its bit set and durable (what
    /// a write there needs before it is issued).
    pub(crate) fn is_durable(&self, offset: u64, len: u64) -> bool {
        self.chunks_of(offset, len).is_ok_and(|cs| {
            (cs.first..cs.end)
                .all(|i| self.chunks.flags(i as usize) & (DIRTY | DURABLE) == DIRTY | DURABLE)
        })
    }

    /// Ends a write started with [`WriteIntentBitmap::start_write`] (all legs completed it).
    /// The locked mode reports an end without a start; the sharded mode cannot see one.
    pub fn end_write(&self, offset: u64, len: u64) -> Result<(), BitmapError> {
        self.end_write_in(self.chunks.my_shard(), offset, len)
    }

    /// [`WriteIntentBitmap::end_write`] in shard `shard` (any shard; see `start_write_in`).
    pub fn end_write_in(&self, shard: usize, offset: u64, len: u64) -> Result<(), BitmapError> {
        let cs = self.chunks_of(offset, len)?;
        let (first, end) = (cs.first as usize, cs.end as usize);
        match self.mode {
            BitmapCounts::Sharded => self.chunks.exit(shard, first, end),
            BitmapCounts::Locked => {
                let _g = self.inner.lock();
                if let Some(i) = (first..end).find(|&i| self.chunks.in_flight(i) == 0) {
                    return Err(BitmapError::NotStarted(i as u64));
                }
                self.chunks.exit(0, first, end);
            }
        }
        Ok(())
    }

    /// A flush of every leg is starting; returns its epoch for [`WriteIntentBitmap::flush_done`].
    pub fn begin_flush(&self) -> u64 {
        let mut g = self.inner.lock();
        g.epoch += 1;
        g.epoch
    }

    /// The flush `epoch` completed on every leg.
    pub fn flush_done(&self, epoch: u64) {
        let mut g = self.inner.lock();
        assert!(epoch <= g.epoch, "flush epoch {epoch} was never begun");
        g.flushed = g.flushed.max(epoch);
    }

    /// While degraded, no bit is cleared.
    pub fn set_degraded(&self, degraded: bool) {
        self.inner.lock().degraded = degraded;
    }

    /// Sets the degraded flag to what `degraded` answers, asked under the bitmap's lock: of
    /// two state changes racing, the later to take the lock asks last, after both changes
    /// were made, so the flag never ends stale. (Asked before the lock, a change that saw the
    /// array whole could write `false` after one that saw it degraded wrote `true`.)
    pub fn update_degraded(&self, degraded: impl FnOnce() -> bool) {
        let mut g = self.inner.lock();
        g.degraded = degraded();
    }

    /// The degraded flag (see [`WriteIntentBitmap::update_degraded`]).
    pub fn is_degraded(&self) -> bool {
        self.inner.lock().degraded
    }

    /// Clears (in memory) the bits of chunks marked idle (no write since, see
    /// [`WriteIntentBitmap::mark_idle`]) at least the quiet time ago and before a flush that
    /// has completed, then marks the idle ones it did not clear; returns how many it cleared.
    /// Persist the bitmap afterwards when this is not zero. Called periodically, it clears a
    /// chunk one call after it went quiet at the earliest (md's daemon clears in two passes
    /// too). A clear records `events` (the array's) as `events_cleared` under the same lock,
    /// so whoever reads `events_cleared` after it sees it (see
    /// [`WriteIntentBitmap::hold_clears`]).
    pub fn clear_quiet(&self, now: Duration, events: u64) -> u64 {
        let mut g = self.inner.lock();
        if g.degraded {
            return 0;
        }
        let n = self.clear_marked(&mut g, |m| {
            !m.needed && now.saturating_sub(m.mark_time) >= self.quiet
        });
        self.mark(&mut g, now);
        if n > 0 {
            g.events_cleared = g.events_cleared.max(events);
        }
        n
    }

    /// Stops every clear until the next [`WriteIntentBitmap::update_degraded`] (as degraded
    /// does) and returns `events_cleared` as of then, under one lock: a leg's re-add decides
    /// on that value and is placed before any bit can go. Without it raid1d could clear, in
    /// the moment between the decision and the placement, the bits of chunks written while
    /// the leg was out, and the bitmap recovery would miss them.
    pub fn hold_clears(&self) -> u64 {
        let mut g = self.inner.lock();
        g.degraded = true;
        g.events_cleared
    }

    /// Marks the dirty chunks with no write in flight idle, at `now` and the flush epoch begun
    /// last: a flush begun after this and completed lets [`WriteIntentBitmap::clear_synced`]
    /// (or, once quiet, [`WriteIntentBitmap::clear_quiet`]) clear them unless a write comes
    /// first. Returns how many are marked now.
    pub fn mark_idle(&self, now: Duration) -> u64 {
        let mut g = self.inner.lock();
        self.mark(&mut g, now)
    }

    fn mark(&self, g: &mut BitmapState, now: Duration) -> u64 {
        let epoch = g.epoch;
        let mut n = 0;
        for (i, m) in g.meta.iter_mut().enumerate() {
            let f = self.chunks.flags(i);
            if f & DIRTY == 0 {
                continue;
            }
            if f & IDLE != 0 {
                n += 1;
            } else if self.chunks.try_mark_idle(i, f) {
                m.mark_epoch = epoch;
                m.mark_time = now;
                n += 1;
            }
        }
        n
    }

    /// Clears the bits of the chunks marked idle before a completed flush for which `ok`
    /// holds; how many.
    fn clear_marked(&self, g: &mut BitmapState, ok: impl Fn(&Meta) -> bool) -> u64 {
        let flushed = g.flushed;
        let mut n = 0;
        for (i, m) in g.meta.iter_mut().enumerate() {
            let f = self.chunks.flags(i);
            if f & (DIRTY | IDLE) == DIRTY | IDLE && m.mark_epoch < flushed && ok(m) {
                // Locked mode counts writes under this lock and takes IDLE back with it, so a
                // chunk still IDLE has none in flight. (Sharded, a writer may be counted and
                // waiting for this lock: it sets the bit again before it is issued.)
                assert!(
                    self.mode != BitmapCounts::Locked || self.chunks.in_flight(i) == 0,
                    "chunk {i}'s bit cleared with writes in flight"
                );
                self.chunks.set_flags(i, 0);
                m.needed = false;
                n += 1;
            }
        }
        if n > 0 {
            g.events += 1;
        }
        n
    }

    /// Clears (in memory) the bits of chunks marked idle (see
    /// [`WriteIntentBitmap::mark_idle`]) before a flush that has completed, however recently
    /// (after a successful resync or recovery: the legs agree there); returns how many. Never
    /// while degraded. Persist the bitmap afterwards when this is not zero.
    pub fn clear_synced(&self, events: u64) -> u64 {
        let mut g = self.inner.lock();
        if g.degraded {
            return 0;
        }
        let n = self.clear_marked(&mut g, |_| true);
        if n > 0 {
            g.events_cleared = g.events_cleared.max(events);
        }
        n
    }

    /// Records the array events at which bits were cleared (md's `events_cleared`, persisted
    /// in the header); never moves back.
    pub fn set_events_cleared(&self, events: u64) {
        let mut g = self.inner.lock();
        g.events_cleared = g.events_cleared.max(events);
    }

    /// The array events at the last clear (see [`WriteIntentBitmap::set_events_cleared`]):
    /// a leg whose superblock events are below this may have missed writes whose bits are gone.
    pub fn events_cleared(&self) -> u64 {
        self.inner.lock().events_cleared
    }

    /// Marks whole chunks dirty without a write (no readable bitmap at assemble: everything
    /// may differ). They are needed (see [`WriteIntentBitmap::load`]): only
    /// [`WriteIntentBitmap::clear_synced`] clears them.
    pub fn set_dirty(&self, set: ChunkSet) {
        let mut g = self.inner.lock();
        let end = set.end.min(self.nr_chunks);
        for i in set.first.min(end)..end {
            let f = self.chunks.flags(i as usize);
            // Not durable if it was clean; a mark taken back either way (a clear must follow
            // a mark made after this).
            let nf = if f & DIRTY == 0 { DIRTY } else { f & !IDLE };
            self.chunks.set_flags(i as usize, nf);
            g.meta[i as usize].needed = true;
        }
        g.events += 1;
    }

    /// The dirty chunks, as runs (what a resync must copy).
    pub fn dirty_chunks(&self) -> Vec<ChunkSet> {
        let _g = self.inner.lock();
        let mut out: Vec<ChunkSet> = Vec::new();
        for i in 0..self.nr_chunks {
            if self.chunks.flags(i as usize) & DIRTY == 0 {
                continue;
            }
            match out.last_mut() {
                Some(last) if last.end == i => last.end = i + 1,
                _ => out.push(ChunkSet {
                    first: i,
                    end: i + 1,
                }),
            }
        }
        out
    }

    /// Whether chunk `i` is dirty.
    pub fn is_dirty(&self, i: u64) -> bool {
        i < self.nr_chunks && self.chunks.flags(i as usize) & DIRTY != 0
    }

    /// Whether chunk `i` is needed (md's NEEDED, see [`WriteIntentBitmap::load`]): dirty
    /// since before this run, or set without a write; a chunk dirtied by writes since is not.
    pub fn is_needed(&self, i: u64) -> bool {
        i < self.nr_chunks && self.inner.lock().meta[i as usize].needed
    }

    /// A counter bumped whenever a bit changes.
    pub fn events(&self) -> u64 {
        self.inner.lock().events
    }

    /// Bytes of the on-disk form.
    pub fn disk_len(&self) -> usize {
        HEADER_SIZE + (self.nr_chunks.div_ceil(8) as usize).next_multiple_of(4096)
    }

    /// The on-disk form (header + bits) of the current bits.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = vec![0u8; self.disk_len()];
        let (events, cleared) = {
            let g = self.inner.lock();
            for i in 0..self.nr_chunks as usize {
                if self.chunks.flags(i) & DIRTY != 0 {
                    b[HEADER_SIZE + i / 8] |= 1 << (i % 8);
                }
            }
            (g.events, g.events_cleared)
        };
        b[0..8].copy_from_slice(&BITMAP_MAGIC);
        b[8..12].copy_from_slice(&1u32.to_le_bytes());
        b[16..24].copy_from_slice(&self.chunk_size().to_le_bytes());
        b[24..32].copy_from_slice(&self.nr_chunks.to_le_bytes());
        b[32..40].copy_from_slice(&events.to_le_bytes());
        b[40..48].copy_from_slice(&cleared.to_le_bytes());
        let crc = crc32c::crc32c_append(crc32c::crc32c(&b[..HEADER_SIZE - 4]), &b[HEADER_SIZE..]);
        b[HEADER_SIZE - 4..HEADER_SIZE].copy_from_slice(&crc.to_le_bytes());
        b
    }

    /// Loads bits from an on-disk form made by [`WriteIntentBitmap::encode`] for the same
    /// geometry; set bits become dirty, durable (they are on disk) and needed (md's NEEDED:
    /// the legs may differ there since before this run, so [`WriteIntentBitmap::clear_quiet`]
    /// leaves them; only a completed resync or recovery clears them, through
    /// [`WriteIntentBitmap::clear_synced`]). Existing bits are kept (union), so loading every
    /// leg's copy gives the union of their dirty chunks.
    pub fn load(&self, b: &[u8]) -> Result<(), BitmapError> {
        if b.len() < self.disk_len() {
            return Err(BitmapError::BadDisk("too short"));
        }
        let b = &b[..self.disk_len()];
        if b[0..8] != BITMAP_MAGIC {
            return Err(BitmapError::BadDisk("bad magic"));
        }
        let mut crc = [0u8; 4];
        crc.copy_from_slice(&b[HEADER_SIZE - 4..HEADER_SIZE]);
        let computed =
            crc32c::crc32c_append(crc32c::crc32c(&b[..HEADER_SIZE - 4]), &b[HEADER_SIZE..]);
        if u32::from_le_bytes(crc) != computed {
            return Err(BitmapError::BadDisk("checksum mismatch"));
        }
        let mut u = [0u8; 8];
        u.copy_from_slice(&b[16..24]);
        if u64::from_le_bytes(u) != self.chunk_size() {
            return Err(BitmapError::BadDisk("chunk size differs"));
        }
        u.copy_from_slice(&b[24..32]);
        if u64::from_le_bytes(u) != self.nr_chunks {
            return Err(BitmapError::BadDisk("number of chunks differs"));
        }
        u.copy_from_slice(&b[40..48]);
        let cleared = u64::from_le_bytes(u);
        let mut g = self.inner.lock();
        g.events_cleared = g.events_cleared.max(cleared);
        for (i, m) in g.meta.iter_mut().enumerate() {
            if b[HEADER_SIZE + i / 8] & (1 << (i % 8)) != 0 {
                self.chunks.set_flags(i, DIRTY | DURABLE);
                m.needed = true;
            }
        }
        g.events += 1;
        Ok(())
    }
}

#[cfg(all(test, not(blkq_loom)))]
mod tests {
    use super::*;

    const MB: u64 = 1 << 20;

    fn s(secs: u64) -> Duration {
        Duration::from_secs(secs)
    }

    #[test]
    fn first_write_needs_sync_then_steady_state_does_not() {
        let bm = WriteIntentBitmap::new(256 * MB, 64 * MB).unwrap();
        assert_eq!(bm.nr_chunks(), 4);
        let need = bm.start_write(63 * MB, 2 * MB).unwrap();
        assert_eq!(need, Some(ChunkSet { first: 0, end: 2 }));
        // A second writer before durability must sync too.
        assert_eq!(
            bm.start_write(0, 4096).unwrap(),
            Some(ChunkSet { first: 0, end: 1 })
        );
        bm.mark_durable(need.unwrap());
        assert_eq!(bm.start_write(MB, 4096).unwrap(), None);
        assert_eq!(bm.dirty_chunks(), vec![ChunkSet { first: 0, end: 2 }]);
        assert!(bm.start_write(256 * MB, 1).is_err());
        assert!(bm.start_write(0, 0).is_err());
    }

    /// A re-add decides on `events_cleared` and must see every clear made before it, and
    /// none after until its leg is placed. Found by the simulator (seed 41000657): raid1d
    /// cleared, between a re-add's decision and its placement, the bits of a write made
    /// while the leg was out, and recorded `events_cleared` only afterwards; the bitmap
    /// recovery missed the write.
    #[test]
    fn a_clear_records_its_events_at_once_and_a_hold_stops_the_next() {
        let bm = WriteIntentBitmap::new(256 * MB, 64 * MB)
            .unwrap()
            .with_quiet_time(s(5));
        let quiet_chunk = |at: u64| {
            let need = bm.start_write(at, 4096).unwrap();
            if let Some(n) = need {
                bm.mark_durable(n);
            }
            bm.end_write(at, 4096).unwrap();
            bm.mark_idle(s(10));
            let e = bm.begin_flush();
            bm.flush_done(e);
        };
        quiet_chunk(0);
        assert_eq!(bm.clear_quiet(s(100), 7), 1);
        assert_eq!(
            bm.events_cleared(),
            7,
            "the clear's events, recorded with it"
        );
        quiet_chunk(64 * MB);
        assert_eq!(bm.hold_clears(), 7);
        assert_eq!(bm.clear_quiet(s(100), 9), 0, "held");
        assert_eq!(bm.clear_synced(9), 0, "held");
        assert_eq!(bm.dirty_chunks().len(), 1);
        bm.update_degraded(|| false);
        assert_eq!(bm.clear_synced(9), 1);
        assert_eq!(bm.events_cleared(), 9);
    }

    fn bits_clear_only_when_quiet_completed_flushed_and_not_degraded(mode: BitmapCounts) {
        let bm = WriteIntentBitmap::new(256 * MB, 64 * MB)
            .unwrap()
            .with_quiet_time(s(5))
            .with_counts(mode);
        let need = bm.start_write(0, 4096).unwrap().unwrap();
        bm.mark_durable(need);
        // In flight: never marked, never cleared.
        assert_eq!(bm.clear_quiet(s(100), 0), 0);
        assert_eq!(bm.mark_idle(s(100)), 0);
        bm.end_write(0, 4096).unwrap();
        // Ended, but not yet seen idle: this call marks it (at 10 s, flush epoch 0).
        assert_eq!(bm.clear_quiet(s(10), 0), 0);
        // No flush begun since the mark has completed.
        assert_eq!(bm.clear_quiet(s(100), 0), 0);
        let e = bm.begin_flush();
        assert_eq!(bm.clear_quiet(s(100), 0), 0);
        bm.flush_done(e);
        // Not quiet long enough since the mark.
        assert_eq!(bm.clear_quiet(s(12), 0), 0);
        bm.set_degraded(true);
        assert_eq!(bm.clear_quiet(s(100), 0), 0);
        bm.set_degraded(false);
        assert_eq!(bm.clear_quiet(s(15), 0), 1);
        assert!(bm.dirty_chunks().is_empty());
        if mode == BitmapCounts::Locked {
            assert!(matches!(
                bm.end_write(0, 4096),
                Err(BitmapError::NotStarted(0))
            ));
        }
        // After a clear the next write needs a sync again.
        assert!(bm.start_write(0, 4096).unwrap().is_some());
    }

    #[test]
    fn bits_clear_only_when_quiet_completed_flushed_and_not_degraded_sharded() {
        bits_clear_only_when_quiet_completed_flushed_and_not_degraded(BitmapCounts::Sharded);
    }

    #[test]
    fn bits_clear_only_when_quiet_completed_flushed_and_not_degraded_locked() {
        bits_clear_only_when_quiet_completed_flushed_and_not_degraded(BitmapCounts::Locked);
    }

    /// A write after the mark takes it back: the chunk waits for a new mark and a flush after
    /// it, however quiet it was before.
    #[test]
    fn a_write_after_the_mark_takes_it_back() {
        for mode in [BitmapCounts::Sharded, BitmapCounts::Locked] {
            let bm = WriteIntentBitmap::new(256 * MB, 64 * MB)
                .unwrap()
                .with_quiet_time(s(5))
                .with_counts(mode);
            bm.mark_durable(bm.start_write(0, 4096).unwrap().unwrap());
            bm.end_write(0, 4096).unwrap();
            assert_eq!(bm.mark_idle(s(10)), 1);
            // Durable already: no sync, but the mark is gone.
            assert_eq!(bm.start_write(MB, 4096).unwrap(), None);
            let e = bm.begin_flush();
            bm.flush_done(e);
            assert_eq!(bm.clear_quiet(s(100), 0), 0, "{mode:?}: in flight");
            bm.end_write(MB, 4096).unwrap();
            // Marked again now (epoch 1); the flush above came before it.
            assert_eq!(
                bm.clear_quiet(s(100), 0),
                0,
                "{mode:?}: flushed before the mark"
            );
            let e = bm.begin_flush();
            bm.flush_done(e);
            assert_eq!(bm.clear_quiet(s(104), 0), 0, "{mode:?}: quiet 4 s of 5");
            assert_eq!(bm.clear_quiet(s(105), 0), 1, "{mode:?}");
            // A resync's clear needs a mark and a flush too, not quiet time.
            bm.mark_durable(bm.start_write(0, 4096).unwrap().unwrap());
            bm.end_write(0, 4096).unwrap();
            assert_eq!(bm.clear_synced(0), 0, "{mode:?}: never marked");
            bm.mark_idle(s(106));
            let e = bm.begin_flush();
            bm.flush_done(e);
            assert_eq!(bm.clear_synced(0), 1, "{mode:?}");
        }
    }

    #[test]
    fn bitmap_counts_parse() {
        assert_eq!("sharded".parse(), Ok(BitmapCounts::Sharded));
        assert_eq!("locked".parse(), Ok(BitmapCounts::Locked));
        assert!("spin".parse::<BitmapCounts>().is_err());
    }

    #[test]
    fn on_disk_round_trip_and_corruption() {
        let bm = WriteIntentBitmap::new(1 << 30, 4096 * 16).unwrap();
        bm.start_write(5 * 65536, 65536 * 3).unwrap();
        bm.set_dirty(ChunkSet {
            first: 100,
            end: 101,
        });
        let disk = bm.encode();
        assert_eq!(disk.len(), bm.disk_len());
        let other = WriteIntentBitmap::new(1 << 30, 4096 * 16).unwrap();
        other.load(&disk).unwrap();
        assert_eq!(other.dirty_chunks(), bm.dirty_chunks());
        // Loaded bits are durable: a write there needs no sync.
        assert_eq!(other.start_write(5 * 65536, 1).unwrap(), None);
        // ... and needed: quiet time never clears them, a completed resync does.
        other.end_write(5 * 65536, 1).unwrap();
        other.mark_idle(s(1));
        let e = other.begin_flush();
        other.flush_done(e);
        assert_eq!(other.clear_quiet(s(1000), 0), 0);
        let n: u64 = other.dirty_chunks().iter().map(|c| c.end - c.first).sum();
        assert_eq!(other.clear_synced(0), n);
        assert!(other.dirty_chunks().is_empty());
        other.load(&disk).unwrap();
        let mut bad = disk.clone();
        bad[HEADER_SIZE + 3] ^= 0x10;
        assert!(other.load(&bad).is_err());
        assert!(WriteIntentBitmap::new(1 << 30, 1 << 20)
            .unwrap()
            .load(&disk)
            .is_err());
        assert!(other.load(&[0u8; 10]).is_err());
        assert!(WriteIntentBitmap::new(1, 1000).is_err());
    }
}
