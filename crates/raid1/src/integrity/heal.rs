//! Healing a read whose data did not match its checksums (or failed), in raid1d with the
//! array frozen: every readable leg is read, each block is taken from a leg that matches its
//! sum, the legs that did not are rewritten, and a block no leg holds fails the read.

use blk::{submit_wait, Bio, Buffer, EndIo};
use blkq_sync::atomic::Ordering;
use blkq_sync::DynArc as StdArc;

use super::{Checksums, BLOCK};
use crate::barrier::paired;
use crate::device::{eio, Array};
use crate::events::Event;
use crate::legset::LegSet;
use crate::superblock::MAX_LEGS;

/// What the blocks of one read came to.
struct Verdict {
    /// Per leg read: its bad blocks (count) and the first one's array offset.
    bad: [(u64, u64); MAX_LEGS],
    /// Legs whose read failed or that hold a bad block: rewritten.
    rewrite: LegSet,
    /// Blocks no leg held (the read fails).
    lost: u64,
}

impl Array {
    /// raid1d's handling of a read that failed its checksums or its I/O, with integrity on.
    pub(crate) fn heal_read(
        &self,
        t: &Checksums,
        mut o: Bio,
        end: Option<StdArc<dyn EndIo>>,
        id: u32,
    ) {
        let sector = o.sector;
        paired(self.barriers.unqueue_io(sector));
        // Frozen: no write into the range is in flight (a write behind keeps its admission
        // until its write-mostly legs have it too), so the sums and the legs agree unless a
        // leg is corrupt.
        self.barriers.freeze_array(1);
        let (off, len) = (o.offset(), o.len as usize);
        let end_byte = off + len as u64;
        // Every readable leg's copy, the first (best) leg first.
        let mut copies: Vec<(usize, Buffer)> = Vec::new();
        let mut failed = LegSet::EMPTY;
        let mut tried = LegSet::EMPTY;
        while let Some(leg) = self.choose_read_leg(sector, end_byte, tried) {
            tried.insert(leg);
            let Some(dev) = self.legs[leg].dev() else {
                continue;
            };
            let lb = self.leg_bio(&o, Some(Buffer::new(len)), id);
            let (back, r) = submit_wait(dev.as_ref(), lb);
            match (r, back.buf) {
                (Ok(()), Some(b)) => copies.push((leg, b)),
                _ => {
                    failed.insert(leg);
                    self.note_read_error(leg);
                }
            }
        }
        let mut out = o.buf.take().unwrap_or_else(|| Buffer::new(len));
        let v = self.choose_blocks(t, off, &copies, &mut out.as_mut_slice()[..len]);
        // With no copy, `out` holds nothing read: nothing goes back to any leg.
        let rewrite = if copies.is_empty() {
            LegSet::EMPTY
        } else {
            v.rewrite | failed
        };
        for (leg, &(n, first)) in v.bad.iter().enumerate() {
            if n == 0 {
                continue;
            }
            self.legs[leg]
                .checksum_errors
                .fetch_add(n, Ordering::Relaxed);
            self.emit(Event::Corrupt {
                slot: leg,
                offset: first,
                blocks: n,
                healed: v.lost == 0,
            });
        }
        if v.lost > 0 {
            t.unrecoverable.fetch_add(v.lost, Ordering::Relaxed);
        }
        // The blocks that were good somewhere go back to the legs that lacked them (a block
        // no leg holds is rewritten as read: no worse, and the read fails all the same).
        for leg in rewrite.iter().take_while(|&l| l < self.legs.len()) {
            let st = self.legs[leg].state.load();
            let Some(dev) = self.legs[leg].dev().filter(|_| st.writable()) else {
                continue;
            };
            self.repair_write(leg, dev.as_ref(), &o, out.as_slice(), id);
        }
        paired(self.barriers.unfreeze_array());
        paired(self.barriers.allow_barrier(sector));
        o.buf = Some(out);
        let res = if copies.is_empty() {
            Err(eio("raid1: no leg could read"))
        } else if v.lost > 0 {
            Err(eio("raid1: no leg holds data matching its checksum"))
        } else {
            Ok(())
        };
        if let Some(e) = end {
            e.end_io(o, res);
        }
    }

    /// Fills `out` block by block from the first copy that matches the block's sum; counts
    /// the bad blocks of each copy. A block no copy matches is taken from the resync source
    /// and summed when its chunk still waits for a resync (the crash rule), else it is lost.
    fn choose_blocks(
        &self,
        t: &Checksums,
        off: u64,
        copies: &[(usize, Buffer)],
        out: &mut [u8],
    ) -> Verdict {
        let mut v = Verdict {
            bad: [(0, 0); MAX_LEGS],
            rewrite: LegSet::EMPTY,
            lost: 0,
        };
        let b = BLOCK as usize;
        let source = self.source_slot(LegSet::EMPTY);
        for (j, dst) in out.chunks_exact_mut(b).enumerate() {
            let at = off + (j * b) as u64;
            let block = at / BLOCK;
            fn block_of(c: &Buffer, j: usize, b: usize) -> &[u8] {
                &c.as_slice()[j * b..(j + 1) * b]
            }
            let part = |c| block_of(c, j, b);
            let good = copies.iter().find(|(_, c)| t.block_matches(block, part(c)));
            let taken = match good {
                Some((_, c)) => c,
                None => {
                    // The resync source's copy (or the first).
                    let Some((l, c)) = copies
                        .iter()
                        .find(|(l, _)| Some(*l) == source)
                        .or(copies.first())
                    else {
                        continue;
                    };
                    if self.unsettled(at) {
                        // Torn by a crash, not corrupt: what the resync would take (read
                        // again until two reads agree, then summed).
                        dst.copy_from_slice(part(c));
                        self.settle_block(t, *l, at, dst);
                        continue;
                    }
                    v.lost += 1;
                    c
                }
            };
            dst.copy_from_slice(part(taken));
            // In a chunk waiting for its resync a copy that differs was torn by a crash, not
            // corrupted: it is settled (rewritten) without a count.
            let torn = self.unsettled(at);
            for (leg, c) in copies {
                if t.block_matches(block, part(c)) {
                    continue;
                }
                if good.is_some() {
                    v.rewrite.insert(*leg);
                }
                if torn {
                    continue;
                }
                let e = &mut v.bad[*leg];
                if e.0 == 0 {
                    e.1 = at;
                }
                e.0 += 1;
                if good.is_some() {
                    t.healed.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        v
    }

    /// Whether array byte `at` lies in a chunk still waiting for its resync after an unclean
    /// stop (its data and sums may be out of step on every leg).
    pub(crate) fn unsettled(&self, at: u64) -> bool {
        let point = self.resync_point.load(Ordering::Acquire);
        point != u64::MAX && at >= point && self.torn_by_a_crash(at)
    }

    /// Whether the crash rule may take array byte `at`'s block as a leg holds it: its chunk
    /// was dirty before this run (md's NEEDED: a bit loaded at assembly, or set without a
    /// write), or there is no bitmap. A chunk dirtied only by writes since holds their own
    /// sums, recorded from the data given: a copy that does not match one is corrupt (a bit
    /// flipped as a leg stored it), not torn, and summing it would hand it to every reader.
    pub(crate) fn torn_by_a_crash(&self, at: u64) -> bool {
        self.bitmap
            .as_ref()
            .is_none_or(|bm| bm.is_needed(at / bm.chunk_size()))
    }
}
