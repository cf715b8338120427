//! The sync passes' checksum rules (`resync/engine.rs` calls them per window): the source's
//! blocks are checked before they are copied or compared, a bad one is taken from another
//! in-sync leg that matches, and a resync settles what a crash left out of step.

use blk::{submit_wait, Bio, Buffer, Op, SECTOR_SHIFT};
use blkq_sync::atomic::Ordering;

use super::{Checksums, BLOCK};
use crate::device::Array;
use crate::events::Event;

/// What checking a window's source found.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct SourceCheck {
    /// Blocks of the source that did not match and were taken from another leg: the source
    /// is rewritten too.
    pub(crate) replaced: u64,
    /// Blocks no leg held with their sum (left as the source has them).
    pub(crate) lost: u64,
}

impl Array {
    /// Checks the window `buf` read from leg `src` at array byte `pos` against the sums.
    /// `settle` (a resync): a block with an unknown sum, or that no leg matches in a chunk
    /// dirty before this run (`Array::torn_by_a_crash`), is taken as the source has it and
    /// summed (the crash rule in the module docs). `heals`: the pass
    /// rewrites the source's replaced blocks (not a check).
    pub(crate) fn check_source(
        &self,
        t: &Checksums,
        src: usize,
        pos: u64,
        buf: &mut [u8],
        settle: bool,
        heals: bool,
    ) -> SourceCheck {
        let mut out = SourceCheck::default();
        let b = BLOCK as usize;
        let mut first_bad = None;
        for (j, blk) in buf.chunks_exact_mut(b).enumerate() {
            let at = pos + (j * b) as u64;
            let block = at / BLOCK;
            if !t.known(block) {
                if settle {
                    t.record(at, blk);
                }
                continue;
            }
            if t.block_matches(block, blk) {
                continue;
            }
            if settle && self.torn_by_a_crash(at) {
                // A resync's chunk dirty before this run: data and sum may be out of step
                // from a crash, which is no corruption. A leg that matches gives the block,
                // else the source's data is summed as it is. (A chunk dirtied by writes
                // since holds their sums: a mismatch there is corruption, below.)
                if self.block_from_other_leg(t, src, at, blk) {
                    out.replaced += 1;
                } else {
                    self.settle_block(t, src, at, blk);
                }
                continue;
            }
            first_bad.get_or_insert(at);
            if self.block_from_other_leg(t, src, at, blk) {
                out.replaced += 1;
                if heals {
                    t.healed.fetch_add(1, Ordering::Relaxed);
                }
            } else {
                out.lost += 1;
            }
        }
        if let Some(offset) = first_bad {
            let bad = out.replaced + out.lost;
            self.legs[src]
                .checksum_errors
                .fetch_add(bad, Ordering::Relaxed);
            t.unrecoverable.fetch_add(out.lost, Ordering::Relaxed);
            self.emit(Event::Corrupt {
                slot: src,
                offset,
                blocks: bad,
                healed: heals && out.lost == 0,
            });
        }
        out
    }

    /// A block of a chunk the crash rule settles that no leg's copy matched: `blk`, read from
    /// leg `leg`, is read again until two reads agree (or one matches the sum), and that is
    /// summed. A read that came back wrong once (a bit flipped on the way) must not become the
    /// block's data and sum, and be copied to the other legs.
    pub(crate) fn settle_block(&self, t: &Checksums, leg: usize, at: u64, blk: &mut [u8]) {
        if let Some(dev) = self.legs[leg].dev() {
            for _ in 0..2 {
                let b = Bio::with_buf(
                    Op::Read,
                    (at + self.data_offset) >> SECTOR_SHIFT,
                    Buffer::new(BLOCK as usize),
                );
                let (back, r) = submit_wait(dev.as_ref(), b);
                let Some(got) = back.buf.filter(|_| r.is_ok()) else {
                    break;
                };
                if t.block_matches(at / BLOCK, got.as_slice()) {
                    blk.copy_from_slice(got.as_slice());
                    return;
                }
                if got.as_slice() == &blk[..] {
                    break;
                }
                blk.copy_from_slice(got.as_slice());
            }
        }
        t.record(at, blk);
        t.resummed.fetch_add(1, Ordering::Relaxed);
    }

    /// Reads block `at` from the other in-sync legs until one matches its sum, into `blk`.
    fn block_from_other_leg(&self, t: &Checksums, src: usize, at: u64, blk: &mut [u8]) -> bool {
        for (i, l) in self.legs.iter().enumerate() {
            let st = l.state.load();
            if i == src || !st.in_sync() || !st.writable() {
                continue;
            }
            let Some(dev) = l.dev() else { continue };
            let b = Bio::with_buf(
                Op::Read,
                (at + self.data_offset) >> SECTOR_SHIFT,
                Buffer::new(BLOCK as usize),
            );
            let (back, r) = submit_wait(dev.as_ref(), b);
            if let (Ok(()), Some(got)) = (r, back.buf) {
                if t.block_matches(at / BLOCK, got.as_slice()) {
                    blk.copy_from_slice(got.as_slice());
                    return true;
                }
            }
        }
        false
    }

    /// A check's or repair's copy of the window from leg `leg`: its blocks that do not match
    /// their sums, counted and named (a repair rewrites the window from the checked source).
    pub(crate) fn count_bad_copy(
        &self,
        t: &Checksums,
        leg: usize,
        pos: u64,
        data: &[u8],
        heals: bool,
    ) -> u64 {
        let b = BLOCK as usize;
        let mut first = None;
        let mut n = 0;
        for (j, blk) in data.chunks_exact(b).enumerate() {
            let at = pos + (j * b) as u64;
            if !t.block_matches(at / BLOCK, blk) {
                first.get_or_insert(at);
                n += 1;
            }
        }
        if let Some(offset) = first {
            self.legs[leg]
                .checksum_errors
                .fetch_add(n, Ordering::Relaxed);
            self.emit(Event::Corrupt {
                slot: leg,
                offset,
                blocks: n,
                healed: heals,
            });
            if heals {
                t.healed.fetch_add(n, Ordering::Relaxed);
            }
        }
        n
    }
}
