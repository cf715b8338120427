//! The array thread (md's raid1d): read-error repair (`fix_read`, with the array frozen),
//! superblock writes after state changes, bitmap persistence, the lazy clearing of quiet
//! bitmap bits, and the probes of the automatic re-add (`readd.rs`).
//!
//! `daemon` runs on the `raid1d` thread. `write_superblocks`, `persist_bitmap` and
//! `flush_legs` are slow paths also called from the caller's thread (start-up, leg
//! management) and from the sync thread; `persist` serialises them.

use std::time::Instant;

use blk::{submit_wait, Bio, BioFlags, Buffer, Device, Op, SECTOR_SHIFT};
use blkq_sync::atomic::Ordering;
use uuid::Uuid;

use crate::barrier::paired;
use crate::device::{eio, Array};
use crate::error::Raid1Error;
use crate::events::Event;
use crate::slots::IoKind;
use crate::superblock::{ArrayState, LegInfo, Role, Superblock, SB_OFFSET};

impl Array {
    /// raid1d's handling of a failed read: with the array frozen, read the range from another
    /// leg, rewrite it on the legs that failed (failing a leg whose rewrite fails or whose
    /// error count passes the limit), and complete the read.
    pub(crate) fn fix_read(&self, id: u32) {
        let (mut orig, end, mut tried, err) = {
            let mut io = self.slots.take(id);
            // Only failed reads are queued for a retry (`read_done`).
            assert_eq!(io.kind, IoKind::Read, "slot {id} retried but not a read");
            (io.orig.take(), io.end.take(), io.tried, io.err.take())
        };
        self.slots.put(id);
        let Some(mut o) = orig.take() else { return };
        if let Some(t) = &self.sums {
            return self.heal_read(t, o, end, id);
        }
        let sector = o.sector;
        paired(self.barriers.unqueue_io(sector));
        self.barriers.freeze_array(1);
        let failed = tried;
        let end_byte = o.offset() + u64::from(o.len);
        let mut good = None;
        while let Some(leg) = self.choose_read_leg(sector, end_byte, tried) {
            tried.insert(leg);
            let Some(dev) = self.legs[leg].dev() else {
                continue;
            };
            let buf = o.buf.take().unwrap_or_else(|| Buffer::new(o.len as usize));
            let lb = self.leg_bio(&o, Some(buf), id);
            let (back, r) = submit_wait(dev.as_ref(), lb);
            o.buf = back.buf;
            if r.is_ok() {
                good = Some(leg);
                break;
            }
            self.note_read_error(leg);
        }
        if good.is_some() {
            for leg in failed.iter().take_while(|&l| l < self.legs.len()) {
                self.note_read_error(leg);
                let st = self.legs[leg].state.load();
                let Some(dev) = self.legs[leg].dev().filter(|_| st.writable()) else {
                    continue;
                };
                let Some(src) = o.buf.as_ref() else { break };
                self.repair_write(leg, dev.as_ref(), &o, src.as_slice(), id);
            }
        }
        paired(self.barriers.unfreeze_array());
        paired(self.barriers.allow_barrier(sector));
        let res = match good {
            Some(_) => Ok(()),
            None => Err(err.unwrap_or_else(|| eio("raid1: no leg could read"))),
        };
        if let Some(e) = end {
            e.end_io(o, res);
        }
    }

    /// Writes `data` (a read's range `o`, good on another leg) over leg `leg`'s copy, with
    /// the array frozen; a leg whose rewrite fails is failed.
    pub(crate) fn repair_write(&self, leg: usize, dev: &dyn Device, o: &Bio, data: &[u8], id: u32) {
        let mut copy = Buffer::new(o.len as usize);
        copy.as_mut_slice().copy_from_slice(&data[..o.len as usize]);
        let mut wb = self.leg_bio(o, Some(copy), id);
        wb.op = Op::Write;
        wb.flags = BioFlags::NONE;
        if submit_wait(dev, wb).1.is_err() {
            self.leg_write_failed(
                leg,
                "a read repair's write failed",
                "the last in-sync leg failed a read repair",
            );
        }
    }

    pub(crate) fn note_read_error(&self, leg: usize) {
        let n = self.legs[leg].read_errors.fetch_add(1, Ordering::AcqRel) + 1;
        if n > self.cfg.read_error_limit {
            self.fail_leg(leg, "more read errors than read_error_limit");
        }
    }

    pub(crate) fn superblock_for(&self, i: usize) -> Superblock {
        let meta = self.meta.lock();
        let bitmap = crate::superblock::BitmapLocation {
            offset: crate::superblock::BITMAP_OFFSET,
            len: self.bitmap.as_ref().map_or(0, |b| b.disk_len() as u64),
            chunk_size: self.bitmap.as_ref().map_or(0, |b| b.chunk_size()),
        };
        let legs = self
            .legs
            .iter()
            .map(|l| {
                let st = l.state.load();
                let present = st.is_present();
                LegInfo {
                    uuid: if present { *l.uuid.lock() } else { Uuid::nil() },
                    in_sync: st.in_sync(),
                    faulty: st.is_faulty(),
                    write_mostly: st.is_write_mostly(),
                    recovery_offset: (present && !st.in_sync() && !st.is_faulty())
                        .then(|| l.recovery_offset.load(Ordering::Acquire)),
                }
            })
            .collect();
        // A clean stop is clean degraded or not: what needs no resync (the legs in sync agree,
        // a recovering one agrees below its offset and resumes there). Running, a degraded
        // array says so.
        let state = if meta.state == ArrayState::Clean {
            ArrayState::Clean
        } else if self.is_degraded() {
            ArrayState::Degraded
        } else {
            ArrayState::Active
        };
        Superblock {
            array_uuid: meta.array_uuid,
            leg_uuid: *self.legs[i].uuid.lock(),
            role: Role::Slot(i as u32),
            array_state: state,
            data_offset: self.data_offset,
            data_size: self.capacity,
            events: meta.events,
            bitmap,
            legs,
            lineage: meta.lineage.clone(),
            integrity: self.sums.as_ref().map(|t| t.area),
        }
    }

    /// The slots whose leg is present, in sync and not faulty (a bit per slot).
    pub(crate) fn in_sync_mask(&self) -> u64 {
        self.legs
            .iter()
            .enumerate()
            .filter(|(_, l)| l.state.load().is_member())
            .fold(0, |m, (i, _)| m | 1 << i)
    }

    /// Bumps `events` for a superblock write; when a slot of the current generation is no
    /// longer in sync, starts a new generation at these events (see `generation`): the leg
    /// that left keeps the old one, which the new history remembers.
    fn next_events(&self) {
        let in_sync = self.in_sync_mask();
        let mut m = self.meta.lock();
        m.events += 1;
        if m.members & !in_sync != 0 {
            let events = m.events;
            let before = m.lineage.current.id;
            m.lineage.rotate(events);
            let generation = m.lineage.current.id;
            m.members = in_sync;
            drop(m);
            self.emit(Event::GenerationChanged {
                generation,
                previous: before,
                in_sync,
            });
            return;
        }
        m.members = in_sync;
    }

    pub(crate) fn write_superblocks_state(&self, state: ArrayState) -> Result<(), Raid1Error> {
        self.meta.lock().state = state;
        self.write_superblocks()
    }

    /// Bumps `events` and writes every present, non-faulty leg's superblock, each after a
    /// flush of its leg and with FUA (md's PREFLUSH + FUA: what the superblock vouches for, a
    /// recovery's copy or a clean stop's data, is durable before it is). A leg whose write
    /// fails is failed and the superblocks are written again, so the failure is recorded too;
    /// Ok means every leg left writable holds the new superblock durably, and records every
    /// leg failure up to its start (`durable_gen`, see `Array::fail_leg`). When the last
    /// in-sync leg fails it, the array fails (`Array::fail_array`) and this is an error.
    ///
    /// In-sync legs are written first, and a round whose in-sync part failed the array writes
    /// no other leg; a failed array writes no superblock at all. A recovering leg must never
    /// carry newer events than every in-sync leg: assembly trusts the newest superblock, and
    /// one that only a recovering leg holds leaves no leg to assemble from (found by the
    /// simulator: the last in-sync leg lost power first, a recovering one took two more rounds).
    pub(crate) fn write_superblocks(&self) -> Result<(), Raid1Error> {
        let _g = self.persist.lock();
        self.durable.clear_dirty();
        self.refuse_if_failed()?;
        // Each round fails at least one leg or ends; a leg is failed once.
        for _ in 0..=self.legs.len() {
            // Under `fail_lock`: every failure counted here has set its FAULTY bit, so the
            // superblocks built below record it.
            let gen = self.durable.counted_gen();
            self.next_events();
            let mut first_err = None;
            // One look at the states: the in-sync legs, then the others.
            let mut order: Vec<(bool, usize)> = (0..self.legs.len())
                .map(|i| {
                    let st = self.legs[i].state.load();
                    (!st.in_sync() || st.is_faulty(), i)
                })
                .collect();
            order.sort_unstable();
            for (recovering, i) in order {
                let l = &self.legs[i];
                if recovering && self.durable.is_failed() {
                    break;
                }
                if !l.state.load().writable() {
                    continue;
                }
                let Some(dev) = l.dev() else { continue };
                let sb = self.superblock_for(i);
                let mut buf = Buffer::new(crate::superblock::SB_SIZE);
                sb.encode_into(buf.as_mut_slice())?;
                let mut b = Bio::with_buf(Op::Write, SB_OFFSET >> SECTOR_SHIFT, buf);
                b.flags = BioFlags::FUA;
                let r = submit_wait(dev.as_ref(), Bio::new(Op::Flush, 0, 0))
                    .1
                    .and_then(|()| submit_wait(dev.as_ref(), b).1);
                if let Err(e) = r {
                    self.leg_write_failed(
                        i,
                        "a superblock write failed",
                        "the last in-sync leg failed a superblock write",
                    );
                    first_err.get_or_insert(Raid1Error::Leg { leg: i, source: e });
                }
            }
            if let Err(failed) = self.refuse_if_failed() {
                return Err(first_err.unwrap_or(failed));
            }
            if first_err.is_none() {
                self.durable.mark_durable(gen);
                return Ok(());
            }
            // A leg failed: write again, recording it.
        }
        Err(Raid1Error::Config(
            "raid1: superblock writes kept failing".into(),
        ))
    }

    /// Writes the bitmap to every writable leg and flushes them. Under `persist`, so a later
    /// snapshot always lands after an earlier one.
    pub(crate) fn persist_bitmap(&self) -> Result<(), Raid1Error> {
        let Some(bm) = &self.bitmap else {
            return Ok(());
        };
        let _g = self.persist.lock();
        let bytes = bm.encode();
        let mut ok = 0;
        let mut first_err = None;
        for (i, l) in self.legs.iter().enumerate() {
            if !l.state.load().writable() {
                continue;
            }
            let Some(dev) = l.dev() else { continue };
            let mut buf = Buffer::new(bytes.len());
            buf.as_mut_slice().copy_from_slice(&bytes);
            let b = Bio::with_buf(
                Op::Write,
                crate::superblock::BITMAP_OFFSET >> SECTOR_SHIFT,
                buf,
            );
            let r = submit_wait(dev.as_ref(), b)
                .1
                .and_then(|()| submit_wait(dev.as_ref(), Bio::new(Op::Flush, 0, 0)).1);
            match r {
                Ok(()) => ok += 1,
                Err(e) => {
                    self.leg_write_failed(
                        i,
                        "a bitmap write failed",
                        "the last in-sync leg failed a bitmap write",
                    );
                    first_err.get_or_insert(Raid1Error::Leg { leg: i, source: e });
                }
            }
        }
        match first_err {
            Some(e) if ok == 0 || self.durable.is_failed() => Err(e),
            _ => Ok(()),
        }
    }

    /// Flushes every writable leg (a bitmap flush epoch). A leg whose flush fails is failed,
    /// as a failed client FLUSH fails it: the kernel reports a write-back error once, so it is
    /// never dropped (on the last in-sync leg the array fails, and every later flush with it).
    pub(crate) fn flush_legs(&self) -> bool {
        // The checksums of the writes this epoch covers go with them (see `integrity`).
        self.persist_sums();
        let mut all = true;
        for (i, l) in self.legs.iter().enumerate() {
            if !l.state.load().writable() {
                continue;
            }
            if let Some(dev) = l.dev() {
                if submit_wait(dev.as_ref(), Bio::new(Op::Flush, 0, 0))
                    .1
                    .is_err()
                {
                    all = false;
                    self.leg_write_failed(
                        i,
                        "a flush failed (write-back error)",
                        "the last in-sync leg failed a flush (write-back error)",
                    );
                }
            }
        }
        all
    }

    /// The background thread (md's raid1d): read retries, superblock updates, lazy bitmap
    /// clearing.
    pub(crate) fn daemon(&self) {
        let mut next_tick = Instant::now() + self.cfg.tick;
        loop {
            let stop = self.stop.load(Ordering::Acquire);
            let next = self.slots.next_retry();
            if let Some(id) = next {
                self.fix_read(id);
                continue;
            }
            // Writes and flushes waiting for a leg failure to be recorded (before a stop too:
            // the stop's freeze counts them as queued).
            self.complete_held();
            if stop {
                return;
            }
            if self.durable.is_dirty() {
                let _ = self.write_superblocks();
            }
            let tick = Instant::now() >= next_tick;
            if tick {
                self.fail_unavailable_legs();
            }
            if tick || self.readd.done.load(Ordering::Acquire) {
                self.probe_legs();
            }
            if tick {
                next_tick = Instant::now() + self.cfg.tick;
                if let Some(bm) = &self.bitmap {
                    if !bm.dirty_chunks().is_empty() && !self.is_degraded() {
                        let e = bm.begin_flush();
                        if self.flush_legs() {
                            bm.flush_done(e);
                        }
                        let events = self.meta.lock().events;
                        if bm.clear_quiet(self.bitmap_now(), events) > 0 {
                            let _ = self.persist_bitmap();
                        }
                    }
                }
            }
            let _ = self.daemon_wq.wait_for_until(
                || {
                    (self.stop.load(Ordering::Acquire)
                        || self.durable.is_dirty()
                        || self.readd.done.load(Ordering::Acquire)
                        || self.slots.retry_waiting()
                        || self.durable.held_waiting())
                    .then_some(())
                },
                next_tick,
            );
        }
    }
}
