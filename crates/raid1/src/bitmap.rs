//! The write-intent bitmap: one bit per chunk of the array (default 64 MiB, as mdadm's
//! internal bitmap) saying "legs may differ here".
//!
//! In memory each chunk has a counter of writes in flight, a dirty bit, whether the set bit is
//! known durable on every leg, and when and in which flush epoch its last write ended. On disk
//! (every leg, between the superblock and the data) it is a 4 KiB header and the bit array,
//! checksummed with crc32c.
//!
//! Protocol (the caller is [`crate::Raid1`], or a resync thread):
//!
//! 1. [`WriteIntentBitmap::start_write`] counts the write in its chunks and sets their bits.
//!    If it returns `Some(chunks)`, some bit is not yet durable: the caller writes the bitmap
//!    ([`WriteIntentBitmap::encode`], under one persist lock so later snapshots land later) to
//!    every leg, flushes every leg, calls [`WriteIntentBitmap::mark_durable`], and only then
//!    issues the data write. `None` (the steady state) costs one lock and no allocation.
//! 2. [`WriteIntentBitmap::end_write`] when every leg completed the write.
//! 3. Flushes of every leg are bracketed with [`WriteIntentBitmap::begin_flush`] /
//!    [`WriteIntentBitmap::flush_done`]: a chunk may be cleared only once a flush that began
//!    after its last write ended has completed on every leg.
//! 4. [`WriteIntentBitmap::clear_quiet`] (from a periodic thread) clears, in memory, bits of
//!    chunks with no write in flight, quiet for [`WriteIntentBitmap::quiet_time`], flushed as in
//!    3, and never while the array is degraded (so a returning leg copies only what it missed);
//!    the caller then persists the bitmap. A clear may reach the disk late; that is the safe
//!    direction.
//!
//! Time is passed in as a `Duration` since an arbitrary origin, so tests use a fake clock.

use std::time::Duration;

use blkq_sync::Mutex;

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
}

/// A run of chunk indices `first..end`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkSet {
    /// First chunk.
    pub first: u64,
    /// One past the last chunk.
    pub end: u64,
}

#[derive(Debug, Clone, Copy, Default)]
struct Chunk {
    /// Writes in flight.
    pending: u32,
    /// The bit.
    dirty: bool,
    /// The set bit is on disk on every leg.
    durable: bool,
    /// When the last write ended.
    last_end: Duration,
    /// The flush epoch when the last write ended.
    end_epoch: u64,
    /// md's NEEDED: the legs may differ here for a reason older than this run (a bit loaded
    /// at assemble, or set without a write): only a completed resync or recovery clears it,
    /// never quiet time.
    needed: bool,
}

#[derive(Debug)]
struct Inner {
    chunks: Vec<Chunk>,
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
    inner: Mutex<Inner>,
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
            inner: Mutex::new(Inner {
                chunks: vec![Chunk::default(); nr_chunks as usize],
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
        let cs = self.chunks_of(offset, len)?;
        let mut g = self.inner.lock();
        let mut need: Option<ChunkSet> = None;
        let mut changed = false;
        for i in cs.first..cs.end {
            let c = &mut g.chunks[i as usize];
            c.pending = c.pending.saturating_add(1);
            if !c.dirty {
                c.dirty = true;
                c.durable = false;
                changed = true;
            }
            if !c.durable {
                need = Some(match need {
                    None => ChunkSet {
                        first: i,
                        end: i + 1,
                    },
                    Some(n) => ChunkSet {
                        first: n.first,
                        end: i + 1,
                    },
                });
            }
        }
        if changed {
            g.events += 1;
        }
        Ok(need)
    }

    /// Records that the bits of `set` are on disk on every leg (after the persist + flush
    /// that followed `start_write`).
    pub fn mark_durable(&self, set: ChunkSet) {
        let mut g = self.inner.lock();
        let end = set.end.min(self.nr_chunks);
        for i in set.first.min(end)..end {
            let c = &mut g.chunks[i as usize];
            if c.dirty {
                c.durable = true;
            }
        }
    }

    /// Ends a write started with [`WriteIntentBitmap::start_write`] (all legs completed it).
    pub fn end_write(&self, offset: u64, len: u64, now: Duration) -> Result<(), BitmapError> {
        let cs = self.chunks_of(offset, len)?;
        let mut g = self.inner.lock();
        let epoch = g.epoch;
        if let Some(i) = (cs.first..cs.end).find(|&i| g.chunks[i as usize].pending == 0) {
            return Err(BitmapError::NotStarted(i));
        }
        for i in cs.first..cs.end {
            let c = &mut g.chunks[i as usize];
            c.pending -= 1;
            c.last_end = now;
            c.end_epoch = epoch;
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
        g.flushed = g.flushed.max(epoch);
    }

    /// While degraded, no bit is cleared.
    pub fn set_degraded(&self, degraded: bool) {
        self.inner.lock().degraded = degraded;
    }

    /// Clears (in memory) the bits of quiet, completed and flushed chunks; returns how many.
    /// Persist the bitmap afterwards when this is not zero.
    pub fn clear_quiet(&self, now: Duration) -> u64 {
        let mut g = self.inner.lock();
        if g.degraded {
            return 0;
        }
        let flushed = g.flushed;
        let mut n = 0;
        for c in g.chunks.iter_mut() {
            if c.dirty
                && !c.needed
                && c.pending == 0
                && c.end_epoch < flushed
                && now.saturating_sub(c.last_end) >= self.quiet
            {
                c.dirty = false;
                c.durable = false;
                n += 1;
            }
        }
        if n > 0 {
            g.events += 1;
        }
        n
    }

    /// Clears (in memory) the bits of completed and flushed chunks regardless of how long they
    /// have been quiet (after a successful resync or recovery: the legs agree there); returns
    /// how many. Never while degraded. Persist the bitmap afterwards when this is not zero.
    pub fn clear_synced(&self) -> u64 {
        let mut g = self.inner.lock();
        if g.degraded {
            return 0;
        }
        let flushed = g.flushed;
        let mut n = 0;
        for c in g.chunks.iter_mut() {
            if c.dirty && c.pending == 0 && c.end_epoch < flushed {
                c.dirty = false;
                c.durable = false;
                c.needed = false;
                n += 1;
            }
        }
        if n > 0 {
            g.events += 1;
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
            let c = &mut g.chunks[i as usize];
            if !c.dirty {
                c.dirty = true;
                c.durable = false;
            }
            c.needed = true;
        }
        g.events += 1;
    }

    /// The dirty chunks, as runs (what a resync must copy).
    pub fn dirty_chunks(&self) -> Vec<ChunkSet> {
        let g = self.inner.lock();
        let mut out: Vec<ChunkSet> = Vec::new();
        for (i, c) in g.chunks.iter().enumerate() {
            if !c.dirty {
                continue;
            }
            let i = i as u64;
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
        self.inner
            .lock()
            .chunks
            .get(i as usize)
            .is_some_and(|c| c.dirty)
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
            for (i, c) in g.chunks.iter().enumerate() {
                if c.dirty {
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
        for (i, c) in g.chunks.iter_mut().enumerate() {
            if b[HEADER_SIZE + i / 8] & (1 << (i % 8)) != 0 {
                c.dirty = true;
                c.durable = true;
                c.needed = true;
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

    #[test]
    fn bits_clear_only_when_quiet_completed_flushed_and_not_degraded() {
        let bm = WriteIntentBitmap::new(256 * MB, 64 * MB)
            .unwrap()
            .with_quiet_time(s(5));
        let need = bm.start_write(0, 4096).unwrap().unwrap();
        bm.mark_durable(need);
        // In flight: never cleared.
        assert_eq!(bm.clear_quiet(s(100)), 0);
        bm.end_write(0, 4096, s(10)).unwrap();
        // Not flushed since the write ended.
        assert_eq!(bm.clear_quiet(s(100)), 0);
        let e = bm.begin_flush();
        assert_eq!(bm.clear_quiet(s(100)), 0);
        bm.flush_done(e);
        // Not quiet long enough.
        assert_eq!(bm.clear_quiet(s(12)), 0);
        bm.set_degraded(true);
        assert_eq!(bm.clear_quiet(s(100)), 0);
        bm.set_degraded(false);
        assert_eq!(bm.clear_quiet(s(15)), 1);
        assert!(bm.dirty_chunks().is_empty());
        assert!(matches!(
            bm.end_write(0, 4096, s(16)),
            Err(BitmapError::NotStarted(0))
        ));
        // After a clear the next write needs a sync again.
        assert!(bm.start_write(0, 4096).unwrap().is_some());
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
        other.end_write(5 * 65536, 1, s(1)).unwrap();
        let e = other.begin_flush();
        other.flush_done(e);
        assert_eq!(other.clear_quiet(s(1000)), 0);
        let n: u64 = other.dirty_chunks().iter().map(|c| c.end - c.first).sum();
        assert_eq!(other.clear_synced(), n);
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
