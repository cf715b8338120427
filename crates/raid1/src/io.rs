//! The regular I/O path: validation, read balancing, mirrored writes, flushes, and the
//! completion of leg bios (`leg_done`).
//!
//! `submit*` run on the submitter's thread; `leg_done` runs wherever a leg completes its bio
//! (a leg's completion thread, or inline in `submit`). A failed read is handed to raid1d
//! (`daemon.rs`). No heap allocation in the steady state: per-I/O state comes from the
//! preallocated slots (`slots`); a write's legs read the caller's buffer through aliases (`lend`),
//! and copies (`share_writes=0`, write-behind legs) come from the pool.

use blkq_sync::DynArc as StdArc;

use blk::{Bio, BioFlags, Buffer, Device, EndIo, Error, Limits, Op, SECTOR_SHIFT};
use blkq_sync::atomic::Ordering;
use blkq_sync::MutexGuard;

use crate::barrier::{paired, BARRIER_UNIT_SECTOR_BITS};
use crate::device::{eio, Array};
use crate::legset::LegSet;
use crate::lend::Lent;
use crate::slots::{Io, IoKind};
use crate::superblock::MAX_LEGS;

/// The barrier units (as the first sector of each) that `len` bytes from `sector` touch: a
/// write is admitted on every one of them (md splits at the unit boundary instead; admitting
/// on each keeps one r1bio per write). A flush (len 0) has the unit of `sector`.
fn units(sector: u64, len: u64) -> impl Iterator<Item = u64> {
    let first = sector >> BARRIER_UNIT_SECTOR_BITS;
    let last = (sector + (len.max(1) - 1) / blk::SECTOR_SIZE) >> BARRIER_UNIT_SECTOR_BITS;
    (first..=last).map(|u| u << BARRIER_UNIT_SECTOR_BITS)
}

/// The legs a write goes to ([`Array::write_legs`]).
struct WriteLegs {
    /// Present and not faulty: every leg written.
    mask: LegSet,
    /// Of those, the in-sync legs: only their successes count.
    counted: LegSet,
    /// Of those, the write-mostly legs.
    mostly: LegSet,
}

/// The sector a flush is admitted on (flushes wait only for a freeze, as reads).
const FLUSH_SECTOR: u64 = 0;

impl Array {
    /// md's read balance: a sequential stream stays on its leg; otherwise the leg with the
    /// fewest requests in flight; write-mostly legs only when nothing else can serve.
    pub(crate) fn choose_read_leg(
        &self,
        sector: u64,
        end_byte: u64,
        tried: LegSet,
    ) -> Option<usize> {
        // During a resync, a read at or past the resync point goes to the resync's source
        // (`source_slot`: the first in-sync leg that is not write-mostly, a write-mostly one
        // only when no other is in sync), as md's `choose_first`, so it reads what the resync
        // copies. Not a recovering leg, even below its offset: it may differ there until the
        // resync has written it. Only if no in-sync leg is left to try does the read fall back
        // to the others.
        if end_byte > self.resync_point.load(Ordering::Acquire) {
            if let Some(src) = self.source_slot(tried) {
                return Some(src);
            }
        }
        let mut best: Option<(usize, u64)> = None;
        let mut mostly = None;
        for (i, l) in self.legs.iter().enumerate() {
            let st = l.state.load();
            if !st.writable() || tried.contains(i) {
                continue;
            }
            if !st.in_sync() && end_byte > l.recovery_offset.load(Ordering::Acquire) {
                continue;
            }
            if st.is_write_mostly() {
                mostly.get_or_insert(i);
                continue;
            }
            if l.head.load(Ordering::Relaxed) == sector {
                return Some(i);
            }
            let p = l.pending();
            if best.is_none_or(|(_, bp)| p < bp) {
                best = Some((i, p));
            }
        }
        best.map(|(i, _)| i).or(mostly)
    }

    pub(crate) fn leg_bio(&self, orig: &Bio, buf: Option<Buffer>, slot: u32) -> Bio {
        let mut b = Bio::new(
            orig.op,
            orig.sector + (self.data_offset >> SECTOR_SHIFT),
            orig.len,
        );
        b.flags = orig.flags;
        b.prio = orig.prio;
        b.buf = buf;
        b.cookie = u64::from(slot);
        b
    }

    pub(crate) fn submit(&self, bio: Bio, end: &StdArc<dyn EndIo>) {
        let lim = Limits {
            capacity: self.capacity,
            logical_block_size: self.logical_block_size,
            max_io_bytes: self.max_io,
        };
        let checked = lim.validate(&bio).and_then(|()| {
            if !bio.op.has_data() {
                return Ok(());
            }
            match &bio.buf {
                None => Err(Error::NoBuffer),
                Some(b) if (b.len() as u64) < u64::from(bio.len) => Err(Error::BufferTooSmall {
                    len: u64::from(bio.len),
                    buf: b.len() as u64,
                }),
                Some(_) => Ok(()),
            }
        });
        if let Err(e) = checked {
            end.end_io(bio, Err(e));
            return;
        }
        match bio.op {
            Op::Read => self.submit_read(bio, end),
            Op::Write | Op::Discard | Op::WriteZeroes => self.submit_write(bio, end),
            Op::Flush => self.submit_flush(bio, end),
        }
    }

    pub(crate) fn submit_read(&self, mut bio: Bio, end: &StdArc<dyn EndIo>) {
        let sector = bio.sector;
        // The slot before the admission: never sleep for a slot while admitted (see
        // `Slots::get`).
        let id = self.slots.get();
        let leg = loop {
            self.barriers.wait_read_barrier(sector);
            let Some(leg) =
                self.choose_read_leg(sector, bio.offset() + u64::from(bio.len), LegSet::EMPTY)
            else {
                paired(self.barriers.allow_barrier(sector));
                self.slots.put(id);
                end.end_io(bio, Err(eio("raid1: no readable leg")));
                return;
            };
            // Never a write-mostly leg while writes to it are behind: wait for them, not
            // admitted, and choose again (invariant 5 of `behind`).
            if self.wb.limit > 0
                && self.legs[leg].state.load().is_write_mostly()
                && self.wb.outstanding() > 0
            {
                paired(self.barriers.allow_barrier(sector));
                self.wb.wait_drained();
                continue;
            }
            break leg;
        };
        // The submitter's own admission, held until the leg's `submit` has returned: the
        // read's may end inside it (see `slot`).
        self.barriers.hold(sector);
        let l = &self.legs[leg];
        // SAFETY: admitted twice on `sector`'s bucket; ours is neither queued nor ended before
        // the closure returns.
        let bio = unsafe {
            l.with_dev(|dev| {
                let Some(dev) = dev else {
                    return Some(bio);
                };
                let buf = bio.buf.take();
                let lb = self.leg_bio(&bio, buf, id);
                drop(self.slots.start(
                    id,
                    Io {
                        kind: IoKind::Read,
                        sent_ns: blk::stats::batch_ns(),
                        orig: Lent::owned(bio),
                        end: Some(end.clone()),
                        remaining: 1,
                        tried: LegSet::one(leg),
                        primary: leg,
                        ..Io::default()
                    },
                ));
                l.head.store(
                    lb.end_sector() - (self.data_offset >> SECTOR_SHIFT),
                    Ordering::Relaxed,
                );
                l.inc_pending();
                dev.submit(lb, self.leg_end(leg));
                None
            })
        };
        paired(self.barriers.allow_barrier(sector));
        if let Some(bio) = bio {
            // Cannot happen while admitted (state and slot change together, frozen); handled
            // as a failed read all the same.
            paired(self.barriers.allow_barrier(sector));
            self.slots.put(id);
            end.end_io(bio, Err(eio("raid1: leg vanished")));
        }
    }

    /// Admits a write on every barrier unit it touches, in order. It never sleeps holding an
    /// admission (a freezer waits for all of them to end): a later unit that would wait makes
    /// it let the earlier ones go, wait for that unit alone, and start over.
    fn admit_write(&self, sector: u64, len: u64) {
        'again: loop {
            let mut held = 0u64;
            for (k, u) in units(sector, len).enumerate() {
                if k == 0 {
                    self.barriers.wait_barrier(u);
                } else if !self.barriers.try_wait_barrier(u) {
                    for v in units(sector, len).take(held as usize) {
                        paired(self.barriers.allow_barrier(v));
                    }
                    self.barriers.wait_barrier(u);
                    paired(self.barriers.allow_barrier(u));
                    continue 'again;
                }
                held += 1;
            }
            return;
        }
    }

    /// Ends a write's admissions (every unit it touches).
    fn release_write(&self, sector: u64, len: u64) {
        for u in units(sector, len) {
            paired(self.barriers.allow_barrier(u));
        }
    }

    pub(crate) fn submit_write(&self, mut bio: Bio, end: &StdArc<dyn EndIo>) {
        if let Some(e) = self.failed_error() {
            end.end_io(bio, Err(e));
            return;
        }
        let sector = bio.sector;
        let (off, len) = (bio.offset(), u64::from(bio.len));
        // The slot before the admission (see `Slots::get`).
        let id = self.slots.get();
        self.admit_write(sector, len);
        if let Err(e) = self.mark_write_intent(off, len, sector, id) {
            end.end_io(bio, Err(e));
            return;
        }
        // Bitmap before data (docs/design.md's promises): the write is counted in its chunks,
        // so no clear can take their bits until it ends.
        debug_assert!(
            self.bitmap
                .as_ref()
                .is_none_or(|bm| bm.is_durable(off, len)),
            "a write at {off} issued before its bitmap bits are durable"
        );
        // The new sums before any leg has the data (see `integrity`).
        if let Some(t) = &self.sums {
            match (bio.op, bio.buf.as_ref()) {
                (Op::Write, Some(b)) => t.record(off, &b.as_slice()[..len as usize]),
                (Op::WriteZeroes, _) => t.record_fill(off, len, false),
                (Op::Discard, _) => t.record_fill(off, len, true),
                _ => {}
            }
        }
        let WriteLegs {
            mask,
            counted,
            mostly,
        } = self.write_legs();
        if mask.is_empty() {
            self.write_finished(off, len, sector);
            self.slots.put(id);
            end.end_io(bio, Err(eio("raid1: no writable leg")));
            return;
        }
        // Write-behind (invariant 1 of `behind`): the write-mostly legs may complete after
        // the acknowledgement, if a counted leg that is not write-mostly takes it first.
        let wb_legs = if self.wb.limit > 0 {
            mask & mostly
        } else {
            LegSet::EMPTY
        };
        let behind = !wb_legs.is_empty()
            && bio.op == Op::Write
            && !bio.flags.contains(BioFlags::FUA)
            && !(counted - wb_legs).is_empty()
            && self.wb.try_reserve();
        let wb_legs = if behind { wb_legs } else { LegSet::EMPTY };
        // The caller's buffer goes to a leg that is not write-mostly when there is one: a
        // write-behind leg writes a copy the array owns (invariant 2).
        let primary = (mask - mostly).first().or(mask.first()).unwrap_or(0);
        // Shared (`share_writes`, see `lend`): every leg that is not write-behind reads the
        // caller's buffer through an alias, the caller's bio stays in the slot until none
        // does. Otherwise, and for the write-behind legs, copies for the extra legs, and the
        // original buffer goes to the primary.
        let share = self.cfg.share_writes && bio.op == Op::Write && bio.buf.is_some();
        let mut bios: [Option<Bio>; MAX_LEGS] = Default::default();
        let lent = self.write_leg_bios(&mut bio, &mut bios, mask, wb_legs, primary, share, id);
        {
            let mut orig = Lent::owned(bio);
            orig.lend(lent.bits());
            let mut io = self.slots.start(
                id,
                Io {
                    kind: IoKind::Write,
                    sent_ns: blk::stats::batch_ns(),
                    span: (sector, len as u32),
                    orig,
                    end: Some(end.clone()),
                    remaining: mask.len(),
                    sync_left: (mask - wb_legs).len(),
                    wb_legs,
                    behind,
                    primary: if share { usize::MAX } else { primary },
                    counted,
                    ..Io::default()
                },
            );
            // Overlapping writes reach each leg in order: a bio that must wait for an earlier
            // write on its leg is parked (invariant 7 of `behind`), under the slot's lock so
            // that `ordered` is set before any of its bios can complete.
            io.ordered = self
                .wb
                .order(id, (off, off + len), mask, wb_legs, &mut bios);
        }
        self.submit_write_legs(sector, &mut bios);
    }

    /// A write's step after its admission: with a write-intent bitmap, marks the chunks it
    /// touches dirty, and when a bit is newly set, puts it on disk on every leg before the
    /// data write is issued. On an error the write's slot and admission are given back and
    /// the error to end the bio with is returned: the write is not issued.
    #[inline]
    fn mark_write_intent(&self, off: u64, len: u64, sector: u64, id: u32) -> Result<(), Error> {
        let Some(bm) = &self.bitmap else {
            return Ok(());
        };
        match bm.start_write(off, len) {
            Ok(None) => Ok(()),
            Ok(Some(set)) => {
                // The bit must be on disk on every leg before the data write is issued; on
                // no leg at all, the write is not issued.
                match self.persist_bitmap() {
                    Ok(()) => {
                        bm.mark_durable(set);
                        Ok(())
                    }
                    Err(e) => {
                        self.write_finished(off, len, sector);
                        self.slots.put(id);
                        Err(Error::Io(std::io::Error::other(e.to_string())))
                    }
                }
            }
            Err(e) => {
                self.release_write(sector, len);
                self.slots.put(id);
                Err(Error::Config(e.to_string()))
            }
        }
    }

    /// The legs a write goes to: present and not faulty (recovering legs included). A leg's
    /// state and its slot change together with the array frozen, so while admitted a present
    /// leg's slot holds its device (an empty one is still handled, as a failed write). Only
    /// the in-sync legs' successes count (D2 in docs/design.md).
    #[inline]
    fn write_legs(&self) -> WriteLegs {
        let mut legs = WriteLegs {
            mask: LegSet::EMPTY,
            counted: LegSet::EMPTY,
            mostly: LegSet::EMPTY,
        };
        for (i, l) in self.legs.iter().enumerate() {
            let st = l.state.load();
            if st.writable() {
                legs.mask.insert(i);
                if st.in_sync() {
                    legs.counted.insert(i);
                }
                if st.is_write_mostly() {
                    legs.mostly.insert(i);
                }
            }
        }
        legs
    }

    /// Fills `bios` with a write's bio for each leg of `mask`: shared, an alias of the
    /// caller's buffer for each leg not in `wb_legs`; otherwise, and for the write-behind
    /// legs, a copy (from the pool) for each leg but the `primary`, which takes the caller's
    /// buffer out of `bio`. Returns the legs lent the caller's buffer.
    #[inline]
    #[allow(clippy::too_many_arguments)]
    fn write_leg_bios(
        &self,
        bio: &mut Bio,
        bios: &mut [Option<Bio>; MAX_LEGS],
        mask: LegSet,
        wb_legs: LegSet,
        primary: usize,
        share: bool,
        id: u32,
    ) -> LegSet {
        let mut lent = LegSet::EMPTY;
        for (i, slot) in bios.iter_mut().enumerate().take(self.legs.len()) {
            if !mask.contains(i) || (!share && i == primary) {
                continue;
            }
            let buf = match &bio.buf {
                Some(src) if share && !wb_legs.contains(i) => {
                    lent.insert(i);
                    // SAFETY: `bio` goes into the slot's `Lent` (`submit_write`) with leg
                    // i's bit set before this leg bio is submitted, and the `Lent` neither
                    // gives it back nor lets it be written (nor drops it) until leg i's bio
                    // has come back to `leg_done` (invariants 1-3 of `lend`).
                    Some(unsafe { src.alias() })
                }
                Some(src) if bio.op == Op::Write => {
                    let mut c = self
                        .pool
                        .get(src.len())
                        .unwrap_or_else(|| Buffer::new(src.len()));
                    c.as_mut_slice().copy_from_slice(src.as_slice());
                    Some(c)
                }
                _ => None,
            };
            *slot = Some(self.leg_bio(bio, buf, id));
        }
        if !share {
            let buf = bio.buf.take();
            bios[primary] = Some(self.leg_bio(bio, buf, id));
        }
        lent
    }

    /// Submits a write's leg bios (the slot set up), under the submitter's own admission on
    /// `sector` (see `slot`): the write's may end inside the last leg's `submit`. A leg whose
    /// device has vanished completes its bio with an error.
    #[inline]
    fn submit_write_legs(&self, sector: u64, bios: &mut [Option<Bio>; MAX_LEGS]) {
        self.barriers.hold(sector);
        for (i, b) in bios.iter_mut().enumerate().take(self.legs.len()) {
            let Some(b) = b.take() else { continue };
            let l = &self.legs[i];
            l.inc_pending();
            // SAFETY: admitted twice on `sector`'s bucket; ours is neither queued nor ended
            // before the closure returns.
            let vanished = unsafe {
                l.with_dev(|dev| match dev {
                    Some(d) => {
                        d.submit(b, self.leg_end(i));
                        None
                    }
                    None => Some(b),
                })
            };
            if let Some(b) = vanished {
                self.leg_done(i, b, Err(eio("raid1: leg vanished")));
            }
        }
        paired(self.barriers.allow_barrier(sector));
    }

    pub(crate) fn submit_flush(&self, bio: Bio, end: &StdArc<dyn EndIo>) {
        if let Some(e) = self.failed_error() {
            end.end_io(bio, Err(e));
            return;
        }
        // Admitted (it waits only for a freeze), so a freeze, and the array's stop, waits for
        // flushes in flight too, and one held for a superblock write is counted as queued.
        // The slot first (see `Slots::get`).
        let id = self.slots.get();
        self.barriers.wait_read_barrier(FLUSH_SECTOR);
        let mut mask = LegSet::EMPTY;
        let mut counted = LegSet::EMPTY;
        let mut mostly = LegSet::EMPTY;
        let mut devs: [Option<StdArc<dyn Device>>; MAX_LEGS] = Default::default();
        for (i, l) in self.legs.iter().enumerate() {
            let st = l.state.load();
            if st.writable() {
                if let Some(d) = l.dev() {
                    devs[i] = Some(d);
                    mask.insert(i);
                    if st.in_sync() {
                        counted.insert(i);
                    }
                    if st.is_write_mostly() {
                        mostly.insert(i);
                    }
                }
            }
        }
        if mask.is_empty() {
            paired(self.barriers.allow_barrier(FLUSH_SECTOR));
            self.slots.put(id);
            end.end_io(bio, Err(eio("raid1: no leg to flush")));
            return;
        }
        drop(self.slots.start(
            id,
            Io {
                kind: IoKind::Flush,
                orig: Lent::owned(bio),
                end: Some(end.clone()),
                remaining: mask.len(),
                primary: usize::MAX,
                counted,
                ..Io::default()
            },
        ));
        // The write-mostly legs' flushes wait for the writes behind (invariant 4 of
        // `behind`); after the `Io` is set up, since `release` may submit them at once.
        let wb_legs = if self.wb.limit > 0 {
            mask & mostly
        } else {
            LegSet::EMPTY
        };
        let deferred = if self.wb.defer_flush(id, wb_legs) {
            wb_legs
        } else {
            LegSet::EMPTY
        };
        for (i, d) in devs.iter_mut().enumerate() {
            if deferred.contains(i) {
                continue;
            }
            if let Some(d) = d.take() {
                let mut b = Bio::new(Op::Flush, 0, 0);
                b.cookie = u64::from(id);
                self.legs[i].inc_pending();
                d.submit(b, self.leg_end(i));
            }
        }
    }

    /// A behind write completed on every leg: its place among the N is free; the last one
    /// out submits the flushes that waited (see `behind`).
    fn wb_release(&self) {
        self.wb.release(|id, legs| {
            for i in legs.iter().take_while(|&i| i < self.legs.len()) {
                let mut b = Bio::new(Op::Flush, 0, 0);
                b.cookie = u64::from(id);
                self.submit_to_leg(i, b);
            }
        });
    }

    /// Submits a leg bio outside the submitter's path (a deferred flush, a parked write),
    /// through the leg's lock: the I/O it belongs to is admitted, but its admission may end
    /// inside `submit` (see `slot`).
    fn submit_to_leg(&self, i: usize, b: Bio) {
        let l = &self.legs[i];
        l.inc_pending();
        match l.dev() {
            Some(d) => d.submit(b, self.leg_end(i)),
            None => self.leg_done(i, b, Err(eio("raid1: leg vanished"))),
        }
    }

    pub(crate) fn write_finished(&self, off: u64, len: u64, sector: u64) {
        if let Some(bm) = &self.bitmap {
            // Sharded counts cannot see an end without its start; the locked mode can.
            let r = bm.end_write(off, len);
            debug_assert!(r.is_ok(), "a write's bitmap end without its start: {r:?}");
        }
        self.release_write(sector, len);
    }

    /// Marks a write's (or flush's) admissions as queued or not (held for raid1d).
    fn set_queued(&self, kind: IoKind, orig: &Bio, queued: bool) {
        let (sector, len) = match kind {
            IoKind::Flush => (FLUSH_SECTOR, 0),
            _ => (orig.sector, u64::from(orig.len)),
        };
        for u in units(sector, len) {
            if queued {
                self.barriers.queue_io(u);
            } else {
                paired(self.barriers.unqueue_io(u));
            }
        }
    }

    /// A write or flush that succeeded while a leg failure is not yet durable: raid1d
    /// completes it after the next superblock write (see `Array::fail_leg`). Its admissions
    /// are queued, so a freeze does not wait for it; they are queued under the list's lock,
    /// so raid1d cannot take it before they are, and a freezer that saw them queued (the
    /// array's stop) finds it on the list.
    fn hold_for_superblock(&self, id: u32, kind: IoKind, orig: &Bio) {
        self.durable.hold(id, || self.set_queued(kind, orig, true));
        self.daemon_wq.wake_all();
    }

    /// raid1d: writes the superblocks, then completes the held writes and flushes (with the
    /// error if the superblocks could not be written: the array has failed then).
    pub(crate) fn complete_held(&self) {
        let ids = self.durable.take_held();
        if ids.is_empty() {
            return;
        }
        let r = self.write_superblocks();
        for id in ids {
            let (kind, orig, end) = {
                let mut io = self.slots.take(id);
                (io.kind, io.orig.take(), io.end.take())
            };
            // Only writes and flushes are held (`write_complete`).
            assert!(
                matches!(kind, IoKind::Write | IoKind::Flush),
                "slot {id} held but a {kind:?}"
            );
            let Some(o) = orig else { continue };
            self.set_queued(kind, &o, false);
            let res = match (&r, self.failed_error()) {
                (Ok(()), None) => Ok(()),
                (_, Some(e)) => Err(e),
                (Err(e), None) => Err(Error::Io(std::io::Error::other(e.to_string()))),
            };
            self.finish(id, kind, Some(o), end, res);
        }
    }

    /// A leg bio completed.
    pub(crate) fn leg_done(&self, leg: usize, bio: Bio, res: Result<(), Error>) {
        self.legs[leg].dec_pending();
        let Some((id, slot)) = self.slots.by_cookie(bio.cookie) else {
            return; // not ours: cannot happen, and nothing to complete
        };
        let mut io = slot.lock();
        if io.ordered.contains(leg) {
            // Before this completion's bookkeeping, its slot lock not held: the writes that
            // waited for this one on this leg go now (invariant 7 of `behind`). The slot
            // stays this write's meanwhile (`remaining` still counts this leg).
            io.ordered.remove(leg);
            drop(io);
            self.wb
                .ordered_done(id, leg, |b| self.submit_to_leg(leg, b));
            io = slot.lock();
        }
        if matches!(io.kind, IoKind::Read | IoKind::Write) {
            self.legs[leg].note_rtt(id, blk::stats::batch_ns().saturating_sub(io.sent_ns));
        }
        // Every leg bio of an I/O completes before its slot is given back (`remaining`).
        debug_assert_ne!(
            io.kind,
            IoKind::Free,
            "leg {leg} completed a bio of free slot {id}"
        );
        match io.kind {
            IoKind::Free => {}
            IoKind::Read => self.read_done(id, io, bio, res),
            IoKind::Write | IoKind::Flush => self.write_done(leg, id, io, bio, res),
        }
    }

    /// A read's leg bio came back (`io`: its slot, locked): the caller's read ends, or on an
    /// error it is queued for raid1d to retry on another leg and repair.
    #[inline]
    fn read_done(&self, id: u32, mut io: MutexGuard<'_, Io>, mut bio: Bio, res: Result<(), Error>) {
        if let Some(o) = io.orig.as_mut() {
            o.buf = bio.buf.take();
        }
        // With integrity, data that does not match its sums is handled as a failed read.
        let res = res.and_then(|()| match (&self.sums, io.orig.as_ref()) {
            (Some(t), Some(o)) => match o.buf.as_ref() {
                Some(b)
                    if t.first_bad(o.offset(), &b.as_slice()[..o.len as usize])
                        .is_some() =>
                {
                    Err(eio("raid1: data does not match its checksum"))
                }
                _ => Ok(()),
            },
            _ => Ok(()),
        });
        match res {
            Ok(()) => {
                let orig = io.orig.take();
                let end = io.end.take();
                *io = Io::default();
                drop(io);
                self.finish(id, IoKind::Read, orig, end, Ok(()));
            }
            Err(e) => {
                // Retry on another leg and repair, in raid1d, with the array frozen.
                if io.err.is_none() {
                    io.err = Some(e);
                }
                let sector = io.orig.as_ref().map_or(0, |o| o.sector);
                drop(io);
                // Queued under the list's lock (see `hold_for_superblock`).
                self.slots
                    .queue_retry(id, || self.barriers.queue_io(sector));
                self.daemon_wq.wake_all();
            }
        }
    }

    /// A write's or flush's leg bio came back from `leg` (`io`: its slot, locked): the
    /// leg's result is counted (a failed write fails the leg), a write-behind write is
    /// acknowledged once the legs that are not write-behind have it, and the last leg ends it
    /// ([`write_complete`](Self::write_complete)).
    #[inline]
    fn write_done(
        &self,
        leg: usize,
        id: u32,
        mut io: MutexGuard<'_, Io>,
        mut bio: Bio,
        res: Result<(), Error>,
    ) {
        if leg == io.primary {
            if let Some(o) = io.orig.as_mut() {
                o.buf = bio.buf.take();
            }
        }
        // A shared write's leg: its device no longer reads the alias (it handed the
        // bio back); drop it, then the leg's bit (invariant 2 of `lend`).
        if LegSet::from_bits(io.orig.lent()).contains(leg) {
            bio.buf = None;
            io.orig.returned(leg);
        }
        match res {
            // Only legs in sync when it was submitted count (md's rule).
            Ok(()) if io.counted.contains(leg) => io.ok += 1,
            Ok(()) => {}
            Err(e) => {
                if io.err.is_none() {
                    io.err = Some(e);
                }
                // A failed write makes the leg stale: fail it; the last in-sync leg
                // cannot be, and then the array fails.
                self.leg_write_failed(
                    leg,
                    "a write or flush failed",
                    "the last in-sync leg failed a write or flush",
                );
            }
        }
        debug_assert!(
            io.remaining > 0,
            "slot {id}: leg {leg} completed past its I/O's legs"
        );
        io.remaining -= 1;
        if !io.wb_legs.contains(leg) {
            // Each leg of a write not write-behind completes once: its count never goes below
            // zero (a flush does not count them: 0 throughout).
            debug_assert!(
                io.kind != IoKind::Write || io.sync_left > 0,
                "slot {id}: sync_left below zero (leg {leg})"
            );
            io.sync_left = io.sync_left.saturating_sub(1);
        }
        if io.remaining > 0 {
            // Write-behind: acknowledged once the legs that are not write-behind
            // have it and a counted one succeeded (invariant 3 of `behind`).
            if io.behind
                && !io.acked
                && io.sync_left == 0
                && io.ok > 0
                && self.failed_error().is_none()
                && !self.failure_pending()
            {
                if let Some(o) = io.orig.take() {
                    let end = io.end.take();
                    io.acked = true;
                    drop(io);
                    if let Some(e) = end {
                        e.end_io(o, Ok(()));
                    }
                }
            }
            return;
        }
        self.write_complete(id, io);
    }

    /// A write's or flush's last leg bio came back (`io`: its slot, locked): the late
    /// bookkeeping of an acknowledged write-behind write, or the caller's bio ends (held for
    /// raid1d while a leg's failure is not yet recorded in the superblocks).
    #[inline]
    fn write_complete(&self, id: u32, mut io: MutexGuard<'_, Io>) {
        if io.acked {
            // The write-behind legs have it too: the late bookkeeping.
            let (sector, len) = io.span;
            *io = Io::default();
            drop(io);
            self.slots.put(id);
            self.write_finished(sector << SECTOR_SHIFT, u64::from(len), sector);
            self.wb_release();
            return;
        }
        let behind = io.behind;
        let kind = io.kind;
        let res = match self.failed_error() {
            Some(e) => Err(e),
            None if io.ok > 0 => Ok(()),
            None => Err(io.err.take().unwrap_or_else(|| eio("raid1: write failed"))),
        };
        if res.is_ok() && self.failure_pending() {
            if let Some(o) = io.orig.as_ref() {
                // Completed later by raid1d; the slot keeps the request meanwhile.
                self.hold_for_superblock(id, kind, o);
                drop(io);
                if behind {
                    self.wb_release();
                }
                return;
            }
        }
        let orig = io.orig.take();
        let end = io.end.take();
        *io = Io::default();
        drop(io);
        if behind {
            self.wb_release();
        }
        self.finish(id, kind, orig, end, res);
    }

    /// Ends a read, write or flush: bitmap, barrier, slot, caller.
    pub(crate) fn finish(
        &self,
        id: u32,
        kind: IoKind,
        orig: Option<Bio>,
        end: Option<StdArc<dyn EndIo>>,
        res: Result<(), Error>,
    ) {
        self.slots.put(id);
        let Some(o) = orig else { return };
        match kind {
            IoKind::Flush => {
                paired(self.barriers.allow_barrier(FLUSH_SECTOR));
            }
            _ if o.op == Op::Read => {
                paired(self.barriers.allow_barrier(o.sector));
            }
            _ => self.write_finished(o.offset(), u64::from(o.len), o.sector),
        }
        if let Some(e) = end {
            e.end_io(o, res);
        }
    }
}
