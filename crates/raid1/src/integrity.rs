//! Per-block checksums (`integrity=crc32c`, chosen at creation): the array's table of one
//! checksum per 4 KiB block, kept whole in memory and on every leg, in the checksum area
//! between the bitmap and the data (see [`crate::superblock`]).
//!
//! # The table
//!
//! - One `u32` per block of the array, in pages of [`PER_PAGE`] sums: a page is 4 KiB on the
//!   legs (the sums, little-endian, then the crc32c of the page's first 4092 bytes). A page of
//!   zeros is a valid page of unknown sums, so a new array's area needs only zeroing.
//! - [`UNKNOWN`] (0) says the block has no sum: never written since the array was created
//!   with blank legs, trimmed, or on a page no leg could read back. Such a block passes every
//!   check. A real sum of 0 is stored as 1 ([`block_sum`]): no written block is ever unknown.
//! - Memory: 4 bytes per 4 KiB block, 1 GiB per TiB of array, allocated at start-up.
//! - Each page sits under its own lock; the data path takes it once per page an I/O touches
//!   (a 1 MiB I/O, one or two pages). Nothing else is shared.
//!
//! # When sums change, and the crash rule
//!
//! - A write records its blocks' sums in memory when it is submitted, before any leg has the
//!   data; write-zeroes records the sum of a zero block; a discard forgets the sums. The page
//!   is marked dirty.
//! - Dirty pages reach the legs lazily, never on the data path: before every flush epoch of
//!   the bitmap (`Array::flush_legs`), so **before any bitmap bit is cleared the sums of every
//!   write into its chunk are on every leg**, and at a clean stop.
//! - So after a crash, a block whose data and sum may be out of step (its write was in flight,
//!   or its page not yet written) lies in a chunk the bitmap marks dirty, which the resync
//!   settles (`resync/engine.rs`): a block that matches its sum on some leg is copied from that
//!   leg; where none matches, the resync source's data is taken and summed, as md would copy
//!   it. Outside dirty chunks every block matched its sum when the bit was cleared, so a
//!   mismatch there is corruption. Without a bitmap an unclean stop resyncs everything.
//! - Only the chunks dirty at assembly (md's NEEDED) are settled so: a chunk dirtied by writes
//!   since holds their own sums, recorded from the data given, so a copy no leg holds with
//!   its sum there is corruption (a bit flipped as a leg stored it), never summed and
//!   returned (`Array::torn_by_a_crash`).
//! - The legs' pages of those chunks may differ after the crash (a page write kept on some
//!   legs only): the table is loaded from the first in-sync leg that holds each page whole,
//!   and at assembly the pages of the chunks to resync are marked dirty, so every leg holds
//!   the table's pages for them before any of their bits clears.
//!
//! # Reads
//!
//! A read is summed on the leg's completion and compared; a block that does not match sends
//! the read to raid1d (`heal.rs`), which, with the array frozen (so no write to the range is
//! in flight), reads every leg, returns the first copy that matches, rewrites the legs that
//! did not, and counts and names each bad leg. If no copy matches the read fails with EIO:
//! bad data is never returned. Inside a chunk still waiting for its resync, the resync's
//! rule applies instead (the source's data, summed).

mod heal;
pub(crate) mod legs;
mod pass;

use blkq_sync::atomic::{AtomicU64, Ordering};
use blkq_sync::Mutex;

/// The per-block checksums' algorithm (chosen at creation, recorded in the superblock).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Algorithm {
    /// crc32c of each 4 KiB block (hardware-assisted on x86-64 and aarch64).
    Crc32c,
}

impl Algorithm {
    /// Its code in the superblock.
    pub(crate) fn code(self) -> u32 {
        match self {
            Algorithm::Crc32c => 1,
        }
    }
}

impl std::fmt::Display for Algorithm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Algorithm::Crc32c => "crc32c",
        })
    }
}

impl std::str::FromStr for Algorithm {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "crc32c" => Ok(Algorithm::Crc32c),
            _ => Err(format!("unknown integrity algorithm {s:?} (crc32c)")),
        }
    }
}

/// Where a leg keeps the array's per-block checksums.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChecksumArea {
    /// How each block is summed.
    pub algorithm: Algorithm,
    /// Byte offset from the start of the leg (4 KiB aligned).
    pub offset: u64,
    /// Length in bytes (whole 4 KiB pages).
    pub len: u64,
}

/// Bytes per summed block.
pub const BLOCK: u64 = 4096;
/// Sums per 4 KiB page of the table.
pub const PER_PAGE: usize = 1023;
/// Bytes of a page on the legs.
pub const PAGE: usize = 4096;
/// The sum of a block whose contents are not known (it passes every check).
pub const UNKNOWN: u32 = 0;

/// Bytes of checksum area a leg of `leg_size` bytes needs (an upper bound for its data).
pub fn area_len(leg_size: u64) -> u64 {
    leg_size.div_ceil(BLOCK).div_ceil(PER_PAGE as u64) * PAGE as u64
}

/// The stored sum of one 4 KiB block: its crc32c, never [`UNKNOWN`].
#[inline]
pub fn block_sum(block: &[u8]) -> u32 {
    match crc32c::crc32c(block) {
        UNKNOWN => 1,
        c => c,
    }
}

struct Page {
    sums: [u32; PER_PAGE],
    dirty: bool,
}

/// Counters of what the checksums found.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IntegrityCounts {
    /// Blocks read back with a wrong sum and rewritten from a leg that matched.
    pub healed: u64,
    /// Blocks no leg held with their sum: the read failed with EIO.
    pub unrecoverable: u64,
    /// Blocks the resync re-summed because no leg matched (torn by a crash).
    pub resummed: u64,
}

/// The array's per-block checksums (see the module docs).
pub(crate) struct Checksums {
    pub(crate) area: ChecksumArea,
    /// Blocks of the array.
    blocks: u64,
    pages: Box<[Mutex<Page>]>,
    zero_sum: u32,
    pub(crate) healed: AtomicU64,
    pub(crate) unrecoverable: AtomicU64,
    pub(crate) resummed: AtomicU64,
}

impl Checksums {
    /// A table of unknown sums for an array of `capacity` bytes, kept in `area` on the legs.
    pub(crate) fn new(area: ChecksumArea, capacity: u64) -> Self {
        let blocks = capacity / BLOCK;
        let nr_pages = blocks.div_ceil(PER_PAGE as u64) as usize;
        assert!(
            (nr_pages * PAGE) as u64 <= area.len,
            "checksum area of {} bytes for {blocks} blocks",
            area.len
        );
        Self {
            area,
            blocks,
            pages: (0..nr_pages)
                .map(|_| {
                    Mutex::new(Page {
                        sums: [UNKNOWN; PER_PAGE],
                        dirty: false,
                    })
                })
                .collect(),
            zero_sum: block_sum(&[0u8; BLOCK as usize]),
            healed: AtomicU64::new(0),
            unrecoverable: AtomicU64::new(0),
            resummed: AtomicU64::new(0),
        }
    }

    pub(crate) fn counts(&self) -> IntegrityCounts {
        IntegrityCounts {
            healed: self.healed.load(Ordering::Relaxed),
            unrecoverable: self.unrecoverable.load(Ordering::Relaxed),
            resummed: self.resummed.load(Ordering::Relaxed),
        }
    }

    pub(crate) fn nr_pages(&self) -> usize {
        self.pages.len()
    }

    /// Calls `f(page, first index in it, the sums' slice of blocks first..first + n)` for
    /// each page the blocks touch, with the page locked; blocks past the array are left out.
    fn each_page<R>(
        &self,
        first: u64,
        n: u64,
        mut f: impl FnMut(&mut Page, usize, u64) -> Option<R>,
    ) -> Option<R> {
        let end = first.saturating_add(n).min(self.blocks);
        let mut b = first;
        while b < end {
            let p = (b / PER_PAGE as u64) as usize;
            let at = (b % PER_PAGE as u64) as usize;
            let k = (end - b).min((PER_PAGE - at) as u64);
            let mut page = self.pages[p].lock();
            if let Some(r) = f(&mut page, at, k) {
                return Some(r);
            }
            b += k;
        }
        None
    }

    /// Records the sums of `data`, written at array byte `off` (whole blocks).
    pub(crate) fn record(&self, off: u64, data: &[u8]) {
        debug_assert!(off.is_multiple_of(BLOCK) && (data.len() as u64).is_multiple_of(BLOCK));
        let mut blocks = data.chunks_exact(BLOCK as usize);
        self.each_page::<()>(off / BLOCK, data.len() as u64 / BLOCK, |page, at, k| {
            for s in &mut page.sums[at..at + k as usize] {
                *s = blocks.next().map_or(UNKNOWN, block_sum);
            }
            page.dirty = true;
            None
        });
    }

    /// Records zeros over `len` bytes at `off` (`forget`: unknown, as after a discard).
    pub(crate) fn record_fill(&self, off: u64, len: u64, forget: bool) {
        let v = if forget { UNKNOWN } else { self.zero_sum };
        self.each_page::<()>(off / BLOCK, len / BLOCK, |page, at, k| {
            page.sums[at..at + k as usize].fill(v);
            page.dirty = true;
            None
        });
    }

    /// The array byte offset of the first block of `data` (read at `off`) that does not
    /// match its sum, if any.
    pub(crate) fn first_bad(&self, off: u64, data: &[u8]) -> Option<u64> {
        let first = off / BLOCK;
        let mut blocks = data.chunks_exact(BLOCK as usize);
        let mut b = first;
        self.each_page(first, data.len() as u64 / BLOCK, |page, at, k| {
            for &s in &page.sums[at..at + k as usize] {
                let blk = blocks.next()?;
                if s != UNKNOWN && s != block_sum(blk) {
                    return Some(b * BLOCK);
                }
                b += 1;
            }
            None
        })
    }

    /// Whether block `block` (an index) holds `data` by its sum (an unknown sum matches).
    pub(crate) fn block_matches(&self, block: u64, data: &[u8]) -> bool {
        self.expected(block)
            .is_none_or(|s| s == UNKNOWN || s == block_sum(data))
    }

    /// Whether block `block`'s sum is known.
    pub(crate) fn known(&self, block: u64) -> bool {
        self.expected(block).is_some_and(|s| s != UNKNOWN)
    }

    fn expected(&self, block: u64) -> Option<u32> {
        (block < self.blocks).then(|| {
            let page = self.pages[(block / PER_PAGE as u64) as usize].lock();
            page.sums[(block % PER_PAGE as u64) as usize]
        })
    }

    /// The page `p` as the legs keep it.
    pub(crate) fn encode_page(&self, p: usize, clear_dirty: bool) -> [u8; PAGE] {
        let mut out = [0u8; PAGE];
        let mut page = self.pages[p].lock();
        if clear_dirty {
            page.dirty = false;
        }
        for (o, s) in out.chunks_exact_mut(4).zip(page.sums.iter()) {
            o.copy_from_slice(&s.to_le_bytes());
        }
        drop(page);
        let crc = crc32c::crc32c(&out[..PAGE - 4]);
        out[PAGE - 4..].copy_from_slice(&crc.to_le_bytes());
        out
    }

    /// Loads page `p` from its bytes on a leg; false (the page untouched) when they are
    /// torn or foreign. A page of zeros is a valid page of unknown sums.
    pub(crate) fn decode_page(&self, p: usize, b: &[u8]) -> bool {
        if b.len() < PAGE {
            return false;
        }
        let zeros = b[..PAGE].iter().all(|&x| x == 0);
        let crc = u32::from_le_bytes([b[PAGE - 4], b[PAGE - 3], b[PAGE - 2], b[PAGE - 1]]);
        if !zeros && crc != crc32c::crc32c(&b[..PAGE - 4]) {
            return false;
        }
        let mut page = self.pages[p].lock();
        for (s, w) in page.sums.iter_mut().zip(b.chunks_exact(4)) {
            *s = u32::from_le_bytes([w[0], w[1], w[2], w[3]]);
        }
        page.dirty = false;
        true
    }

    /// Marks dirty the pages holding the sums of array bytes `off..off + len` (to be written
    /// to every leg by the next persist).
    pub(crate) fn mark_dirty(&self, off: u64, len: u64) {
        let cap = self.blocks * BLOCK;
        let off = off.min(cap);
        for p in self.pages_of(off, len.min(cap - off)) {
            self.pages[p].lock().dirty = true;
        }
    }

    /// The dirty pages (indices), in order.
    pub(crate) fn dirty_pages(&self) -> Vec<usize> {
        (0..self.pages.len())
            .filter(|&p| self.pages[p].lock().dirty)
            .collect()
    }

    /// The pages holding the sums of array bytes `off..off + len`.
    pub(crate) fn pages_of(&self, off: u64, len: u64) -> std::ops::Range<usize> {
        let first = off / BLOCK / PER_PAGE as u64;
        let end = (off + len).div_ceil(BLOCK).div_ceil(PER_PAGE as u64);
        first as usize..(end as usize).min(self.pages.len())
    }

    /// Byte offset on a leg of page `p`.
    pub(crate) fn leg_offset(&self, p: usize) -> u64 {
        self.area.offset + (p * PAGE) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(blocks: u64) -> Checksums {
        let area = ChecksumArea {
            algorithm: Algorithm::Crc32c,
            offset: 1 << 20,
            len: area_len(blocks * BLOCK),
        };
        Checksums::new(area, blocks * BLOCK)
    }

    #[test]
    fn a_recorded_block_matches_and_a_flipped_bit_does_not() {
        let t = table(3000);
        let mut data = vec![0u8; 3 * BLOCK as usize];
        for (i, x) in data.iter_mut().enumerate() {
            *x = (i * 7) as u8;
        }
        // Across the first page's end (blocks 1022, 1023, 1024).
        let off = 1022 * BLOCK;
        t.record(off, &data);
        assert_eq!(t.first_bad(off, &data), None);
        data[BLOCK as usize + 100] ^= 0x10;
        assert_eq!(t.first_bad(off, &data), Some(off + BLOCK));
        assert!(!t.block_matches(1023, &data[BLOCK as usize..2 * BLOCK as usize]));
        assert!(t.known(1024) && !t.known(1025));
        assert_eq!(t.dirty_pages(), vec![0, 1]);
    }

    #[test]
    fn unknown_sums_pass_and_zeroes_have_the_zero_sum() {
        let t = table(10);
        let junk = vec![0xabu8; BLOCK as usize];
        assert_eq!(t.first_bad(0, &junk), None);
        t.record_fill(0, 2 * BLOCK, false);
        assert_eq!(t.first_bad(0, &junk), Some(0));
        assert_eq!(t.first_bad(0, &[0u8; 2 * BLOCK as usize]), None);
        t.record_fill(0, BLOCK, true);
        assert_eq!(t.first_bad(0, &junk), None);
        assert_eq!(t.first_bad(BLOCK, &junk), Some(BLOCK));
    }

    #[test]
    fn pages_round_trip_and_a_torn_page_is_refused() {
        let t = table(2100);
        let data: Vec<u8> = (0..BLOCK as usize * 4).map(|i| (i % 251) as u8).collect();
        t.record(1020 * BLOCK, &data);
        let b = t.encode_page(1, true);
        assert!(t.dirty_pages() == vec![0]);
        let u = table(2100);
        assert!(u.decode_page(1, &b));
        assert_eq!(u.first_bad(1023 * BLOCK, &data[3 * BLOCK as usize..]), None);
        let mut torn = b;
        torn[17] ^= 1;
        assert!(!u.decode_page(0, &torn));
        assert!(u.decode_page(0, &[0u8; PAGE]));
        assert!(!u.known(0));
    }

    #[test]
    fn the_table_of_a_tib_array_takes_about_a_gib_of_memory() {
        let pages = (1u64 << 40) / BLOCK / PER_PAGE as u64 + 1;
        let bytes = pages * std::mem::size_of::<Mutex<Page>>() as u64;
        // 4 bytes per 4 KiB block, plus a lock and a flag per page of 1023 sums.
        assert!(bytes <= (1u64 << 30) + (10 << 20), "{bytes} bytes per TiB");
        assert!(bytes >= 1 << 30);
    }

    #[test]
    fn the_area_holds_every_block_of_the_leg() {
        for size in [BLOCK, 1 << 20, (1 << 30) + 12345, 1 << 40] {
            let pages = area_len(size) / PAGE as u64;
            assert!(pages * PER_PAGE as u64 >= size / BLOCK);
            assert!((pages - 1) * (PER_PAGE as u64) < size.div_ceil(BLOCK));
        }
        assert_eq!(area_len(1 << 40), 262_401 * PAGE as u64);
    }
}
