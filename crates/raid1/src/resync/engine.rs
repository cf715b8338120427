//! The sync thread's engine (md's `md_do_sync` + `raid1_sync_request`): what to do next by
//! md's priority, the passes (resync, recovery, check, repair) and their windows, the speed
//! throttle. Runs on the array's sync thread; the control surface is `sync.rs`.

use blkq_sync::DynArc as StdArc;
use std::time::{Duration, Instant};

use blk::{submit_wait, Bio, Buffer, Device, Op, SECTOR_SHIFT};
use blkq_sync::atomic::Ordering;

use super::{should_yield, Ctl, SyncAction, MAX_YIELD};
use crate::barrier::paired;
use crate::device::Array;
use crate::events::Event;
use crate::legset::LegSet;
use crate::superblock::MAX_LEGS;

/// One pass of the sync thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Job {
    Resync,
    /// Recover the leg in this slot.
    Recover(usize),
    Check,
    Repair,
}

/// How a pass ended.
enum PassEnd {
    Done,
    /// Interrupted (idle, frozen, stop, target gone): resumable.
    Interrupted,
    /// No source could be read.
    Failed,
}

impl PassEnd {
    /// How an event tells it.
    fn word(&self) -> &'static str {
        match self {
            PassEnd::Done => "done",
            PassEnd::Interrupted => "interrupted",
            PassEnd::Failed => "failed",
        }
    }
}

/// A job as events name it: its action, and the leg a recovery copies to.
fn job_event(job: Job) -> (SyncAction, Option<usize>) {
    match job {
        Job::Resync => (SyncAction::Resync, None),
        Job::Recover(t) => (SyncAction::Recover, Some(t)),
        Job::Check => (SyncAction::Check, None),
        Job::Repair => (SyncAction::Repair, None),
    }
}

impl Array {
    /// The lowest slot holding a present, non-faulty leg that is not in sync.
    pub(crate) fn recovering_leg(&self) -> Option<usize> {
        self.legs
            .iter()
            .position(|l| l.state.load().is_recovering())
    }

    /// Whether a resync has legs to make agree: an in-sync source and another leg that serves
    /// reads somewhere, in sync or recovering with some of it recovered (below its offset the
    /// recovery will not copy again, so the resync must). With checksums an in-sync source is
    /// enough: the resync also settles the sums a crash left out of step with the data (the
    /// crash rule in `integrity`), which a degraded array never wrote before the crash.
    fn resync_has_targets(&self) -> bool {
        let mut in_sync = 0;
        let mut partial = 0;
        for l in self.legs.iter() {
            let st = l.state.load();
            if st.is_member() {
                in_sync += 1;
            } else if st.writable() && l.recovery_offset.load(Ordering::Acquire) > 0 {
                partial += 1;
            }
        }
        in_sync >= 1 && (in_sync + partial >= 2 || self.sums.is_some())
    }

    /// What the sync thread should do next, by md's priority: resync, then recovery, then a
    /// requested check/repair. Pure (no side effects): called from wait conditions.
    pub(crate) fn next_job(&self, c: &Ctl) -> Option<Job> {
        // A failed array's state no longer changes: nothing to sync.
        if self.durable.is_failed() {
            return None;
        }
        if c.resync_needed && !c.resync_blocked && self.resync_has_targets() {
            return Some(Job::Resync);
        }
        if !c.recovery_blocked {
            // Not before its placement is recorded (`Leg::unrecorded`).
            let recorded = |&i: &usize| !self.legs[i].unrecorded.load(Ordering::Acquire);
            if let Some(i) = self.recovering_leg().filter(recorded) {
                return Some(Job::Recover(i));
            }
        }
        match c.requested {
            Some(SyncAction::Check) => Some(Job::Check),
            Some(SyncAction::Repair) => Some(Job::Repair),
            _ => None,
        }
    }

    /// The sync thread (`raid1-sync`): sleeps on `sync.wq` until there is a job and the
    /// array is not frozen, runs it, and goes back to sleep.
    pub(crate) fn sync_thread(&self) {
        let s = &self.sync;
        loop {
            let job = s.wq.wait_for(|| {
                let mut c = s.ctl.lock();
                if c.stop {
                    return Some(None);
                }
                if c.frozen {
                    return None;
                }
                if c.resync_needed && !self.resync_has_targets() {
                    // Nothing to make agree: the recovery of the other legs copies it all.
                    c.resync_needed = false;
                    c.resync_offset = 0;
                    self.set_resync_point_inner(None);
                }
                let job = self.next_job(&c)?;
                c.interrupt = false;
                if matches!(job, Job::Check | Job::Repair) {
                    c.requested = None;
                }
                let action = match job {
                    Job::Resync => SyncAction::Resync,
                    Job::Recover(_) => SyncAction::Recover,
                    Job::Check => SyncAction::Check,
                    Job::Repair => SyncAction::Repair,
                };
                s.action.store(action.to_u64(), Ordering::Release);
                Some(Some(job))
            });
            let Some(job) = job else { return };
            let (action, slot) = job_event(job);
            self.emit(Event::SyncStarted { action, slot });
            let end = self.run_job(job);
            let mismatches = matches!(job, Job::Check | Job::Repair)
                .then(|| s.mismatch_cnt.load(Ordering::Relaxed));
            self.emit(Event::SyncFinished {
                action,
                slot,
                end: end.word(),
                mismatches,
            });
            s.action.store(SyncAction::Idle.to_u64(), Ordering::Release);
            s.eta_secs.store(u64::MAX, Ordering::Relaxed);
            s.idle_wq.wake_all();
        }
    }

    /// Runs one job; how its pass ended.
    fn run_job(&self, job: Job) -> PassEnd {
        let s = &self.sync;
        match job {
            Job::Resync => {
                let start = s.ctl.lock().resync_offset;
                self.set_resync_point_inner(Some(start));
                let end = self.pass(job, start, None, 0);
                // Interrupted or failed, the resync is still due: reads past its point keep
                // going to its source (md's `recovery_cp`), so what they return does not
                // change when it copies there.
                match end {
                    PassEnd::Done => {
                        {
                            let mut c = s.ctl.lock();
                            c.resync_needed = false;
                            c.resync_offset = 0;
                        }
                        self.set_resync_point_inner(None);
                        self.clear_synced_bits();
                        let _ = self.write_superblocks();
                    }
                    PassEnd::Interrupted => {}
                    PassEnd::Failed => {
                        // Still needed (the legs may differ), not retried until asked for.
                        s.ctl.lock().resync_blocked = true;
                    }
                }
                end
            }
            Job::Recover(t) => {
                // The leg and its offset, read together: add and remove change a slot with
                // the array frozen, so under a freeze the two belong to one leg. The pass
                // then works for that leg only (`Array::still_target`).
                self.barriers.freeze_array(0);
                let target = self.legs[t].dev().map(|d| (t, d));
                let gen = self.legs[t].gen.load(Ordering::Acquire);
                let start = self.legs[t].recovery_offset.load(Ordering::Acquire);
                paired(self.barriers.unfreeze_array());
                let Some(target) = target else {
                    return PassEnd::Interrupted;
                };
                let end = self.pass(job, start, Some(&target), gen);
                match end {
                    PassEnd::Done => {
                        // Marked in sync only if the slot still holds the leg the pass
                        // copied to (frozen: nothing changes it meanwhile).
                        self.barriers.freeze_array(0);
                        let ours = !self.durable.is_failed() && self.still_target(&target, gen);
                        if ours {
                            let l = &self.legs[t];
                            l.bitmap_recovery.store(false, Ordering::Release);
                            l.recovery_offset.store(0, Ordering::Release);
                        }
                        let marked = ours && self.mark_in_sync(t);
                        paired(self.barriers.unfreeze_array());
                        if marked {
                            self.state_changed();
                            self.clear_synced_bits();
                        }
                        // events bumped, new state on every leg.
                        let _ = self.write_superblocks();
                    }
                    PassEnd::Interrupted => {
                        // Keep the offset: an interrupted recovery resumes there.
                        let _ = self.write_superblocks();
                    }
                    PassEnd::Failed => {
                        s.ctl.lock().recovery_blocked = true;
                        let _ = self.write_superblocks();
                    }
                }
                end
            }
            Job::Check | Job::Repair => {
                s.mismatch_cnt.store(0, Ordering::Relaxed);
                self.pass(job, 0, None, 0)
            }
        }
    }

    fn set_resync_point_inner(&self, offset: Option<u64>) {
        self.resync_point
            .store(offset.unwrap_or(u64::MAX), Ordering::Release);
    }

    /// After a successful resync/recovery: mark the chunks with no write in flight idle, flush
    /// every leg (a bitmap flush epoch) and clear the bits of the chunks still marked (never
    /// while degraded), then persist.
    fn clear_synced_bits(&self) {
        let Some(bm) = &self.bitmap else { return };
        if self.is_degraded() {
            return;
        }
        // Marked before the flush: the clear covers chunks with no write since the mark.
        bm.mark_idle(self.bitmap_now());
        let e = bm.begin_flush();
        if !self.flush_legs() {
            return;
        }
        bm.flush_done(e);
        let events = self.meta.lock().events;
        if bm.clear_synced(events) > 0 {
            let _ = self.persist_bitmap();
        }
    }

    /// The slot of a pass's source, skipping `tried`: the first in-sync leg that is not
    /// write-mostly, or, when every in-sync leg left to try is write-mostly, the first of
    /// those (md's `raid1_sync_request`). A write-mostly leg is the remote one: with
    /// write-behind it may lack writes the others have, so it is never copied over them while
    /// another in-sync leg can be read. Reads past the resync point go here too
    /// (`choose_read_leg`), so they read what the resync copies.
    pub(crate) fn source_slot(&self, tried: LegSet) -> Option<usize> {
        let mut mostly = None;
        for (i, l) in self.legs.iter().enumerate() {
            let st = l.state.load();
            if tried.contains(i) || !st.is_member() {
                continue;
            }
            if !st.is_write_mostly() {
                return Some(i);
            }
            mostly.get_or_insert(i);
        }
        mostly
    }

    /// The source's slot and device ([`Array::source_slot`]), skipping `tried`.
    fn source_leg(&self, mut tried: LegSet) -> Option<(usize, StdArc<dyn Device>)> {
        loop {
            let i = self.source_slot(tried)?;
            if let Some(d) = self.legs[i].dev() {
                return Some((i, d));
            }
            tried.insert(i);
        }
    }

    /// Synchronous leg I/O of `len` bytes at array byte `pos` with `buf` (reused).
    fn leg_rw(
        &self,
        dev: &dyn Device,
        op: Op,
        pos: u64,
        len: u32,
        buf: &mut Option<Buffer>,
    ) -> Result<(), blk::Error> {
        let mut b = Bio::new(op, (pos + self.data_offset) >> SECTOR_SHIFT, len);
        b.buf = buf.take();
        let (back, r) = submit_wait(dev, b);
        *buf = back.buf;
        if buf.is_none() {
            *buf = Some(Buffer::new(len as usize));
        }
        r
    }

    /// A sync write of the window in `buf` to a leg: a write-zeroes when the window is all
    /// `zeros` (falling back to writing them where the leg does not support it).
    fn leg_write(
        &self,
        dev: &dyn Device,
        zeros: bool,
        pos: u64,
        len: u32,
        buf: &mut Option<Buffer>,
    ) -> Result<(), blk::Error> {
        if zeros {
            let b = Bio::new(
                Op::WriteZeroes,
                (pos + self.data_offset) >> SECTOR_SHIFT,
                len,
            );
            match submit_wait(dev, b).1 {
                Err(blk::Error::NotSupported(_)) => {}
                r => return r,
            }
        }
        self.leg_rw(dev, Op::Write, pos, len, buf)
    }

    fn interrupted(&self) -> bool {
        let c = self.sync.ctl.lock();
        c.interrupt || c.stop || self.durable.is_failed()
    }

    /// Whether slot `t` still holds `target`'s leg as placed then (`gen`: the same device
    /// removed and added back is another placement, with writes it missed meanwhile),
    /// recovering (neither in sync nor faulty). Stable while the caller holds a raised window
    /// or a freeze.
    fn still_target(&self, target: &(usize, StdArc<dyn Device>), gen: u64) -> bool {
        let (t, d) = target;
        let l = &self.legs[*t];
        l.gen.load(Ordering::Acquire) == gen
            && l.dev().is_some_and(|cur| StdArc::ptr_eq(&cur, d))
            && l.state.load().is_recovering()
    }

    /// A pass's window size and the bitmap's chunk size: windows are a power of two (so none
    /// crosses a barrier unit), at most 1 MiB and the largest leg I/O, and within one bitmap
    /// chunk.
    fn pass_window(&self) -> (u64, Option<u64>) {
        let mut win = (1u64 << 20).min(u64::from(self.max_io));
        win = 1 << (63 - win.max(4096).leading_zeros());
        let chunk = self.bitmap.as_ref().map(|b| b.chunk_size());
        if let Some(c) = chunk {
            win = win.min(c);
        }
        (win, chunk)
    }

    /// What a pass of `job` needs to copy, when only the bitmap's dirty chunks: a snapshot of
    /// them (chunks dirtied later are written to every leg by the writes themselves). `None`:
    /// everything.
    fn dirty_chunks(&self, job: Job) -> Option<Vec<bool>> {
        let only_dirty = match job {
            Job::Resync => true,
            Job::Recover(t) => self.legs[t].bitmap_recovery.load(Ordering::Acquire),
            Job::Check | Job::Repair => false,
        };
        match (&self.bitmap, only_dirty) {
            (Some(bm), true) => Some((0..bm.nr_chunks()).map(|i| bm.is_dirty(i)).collect()),
            _ => None,
        }
    }

    /// Tells every tenth of the array a pass crosses from `pos` to `wend` (`events`).
    fn tell_tenths(&self, job: Job, pos: u64, wend: u64) {
        let cap = self.capacity;
        let tenth = |p: u64| (u128::from(p) * 10 / u128::from(cap.max(1))) as u8;
        if tenth(wend) > tenth(pos) && tenth(wend) < 10 {
            let (action, slot) = job_event(job);
            self.emit(Event::SyncProgress {
                action,
                slot,
                percent: tenth(wend) * 10,
            });
        }
    }

    /// The pass's speed and time left, for its report: `io_bytes` copied or compared since
    /// `t0`, from `start` to `pos`.
    fn note_speed(&self, t0: Instant, io_bytes: u64, start: u64, pos: u64) {
        let s = &self.sync;
        let el = t0.elapsed().as_secs_f64().max(1e-6);
        let speed = (io_bytes as f64 / 1024.0 / el) as u64;
        s.speed_kib_s.store(speed, Ordering::Relaxed);
        let rate = (pos - start) as f64 / el;
        if rate > 0.0 {
            s.eta_secs.store(
                ((self.capacity - pos) as f64 / rate) as u64,
                Ordering::Relaxed,
            );
        }
    }

    /// Walks the array from `start` in windows (a recovery: for `target` only). See the crate
    /// docs.
    fn pass(
        &self,
        job: Job,
        start: u64,
        target: Option<&(usize, StdArc<dyn Device>)>,
        gen: u64,
    ) -> PassEnd {
        let s = &self.sync;
        let cap = self.capacity;
        let (win, chunk) = self.pass_window();
        let dirty = self.dirty_chunks(job);
        s.total_bytes.store(cap, Ordering::Relaxed);
        s.done_bytes.store(start, Ordering::Relaxed);
        s.speed_kib_s.store(0, Ordering::Relaxed);
        s.eta_secs.store(u64::MAX, Ordering::Relaxed);
        let t0 = Instant::now();
        let mut io_bytes = 0u64;
        let mut last_chunk = u64::MAX;
        let mut windows = 0u64;
        let mut src_buf = Some(Buffer::new(win as usize));
        let mut cmp_buf = Some(Buffer::new(win as usize));
        let mut pos = start;
        while pos < cap {
            if self.interrupted() {
                return PassEnd::Interrupted;
            }
            let wend = ((pos / win + 1) * win).min(cap);
            let len = (wend - pos) as u32;
            // Skip chunks the bitmap says agree.
            if let (Some(d), Some(c)) = (&dirty, chunk) {
                let idx = pos / c;
                if !d.get(idx as usize).copied().unwrap_or(true) {
                    pos = ((idx + 1) * c).min(cap);
                    self.advance(job, pos);
                    continue;
                }
            }
            let sector = pos >> SECTOR_SHIFT;
            self.barriers.raise_barrier(sector);
            // Under the raised window the slot cannot change (add and remove freeze, and a
            // freeze waits for the window): the target is checked, and its offset moved, here.
            if target.is_some_and(|t| !self.still_target(t, gen)) {
                paired(self.barriers.lower_barrier(sector));
                return PassEnd::Interrupted; // failed, removed or replaced meanwhile
            }
            let w0 = Instant::now();
            let r = self.window(job, pos, len, target, &mut src_buf, &mut cmp_buf);
            if r {
                if let Some((t, _)) = target {
                    // Release, after the window's writes completed (submit_wait waited for them);
                    // the Acquire load in `choose_read_leg` then admits reads below it to this
                    // leg, and any read submitted after that load reaches the leg after those
                    // writes. Regular writes above it already go to the leg, so nothing below
                    // it goes stale.
                    self.legs[*t].recovery_offset.store(wend, Ordering::Release);
                }
            }
            paired(self.barriers.lower_barrier(sector));
            let last_window = w0.elapsed();
            if !r {
                return PassEnd::Failed;
            }
            if matches!(job, Job::Resync | Job::Recover(_)) {
                let counted = match chunk {
                    Some(c) => {
                        let idx = pos / c;
                        let new = idx != last_chunk;
                        last_chunk = idx;
                        new
                    }
                    None => true,
                };
                if counted {
                    s.chunks_copied.fetch_add(1, Ordering::Relaxed);
                }
            }
            io_bytes += u64::from(len);
            windows += 1;
            self.tell_tenths(job, pos, wend);
            pos = wend;
            self.advance(job, pos);
            if matches!(job, Job::Recover(_)) && windows.is_multiple_of(64) {
                // Persist the recovery offset now and then (resume after a stop).
                let _ = self.write_superblocks();
            }
            self.note_speed(t0, io_bytes, start, pos);
            self.throttle(t0, io_bytes, last_window);
        }
        PassEnd::Done
    }

    /// Records that array bytes below `pos` are done.
    fn advance(&self, job: Job, pos: u64) {
        self.sync.done_bytes.store(pos, Ordering::Relaxed);
        match job {
            // A recovery's offset moves inside its window only (see `pass`); a skipped clean
            // chunk moves it at the next window.
            Job::Recover(_) => {}
            Job::Resync => {
                self.sync.ctl.lock().resync_offset = pos;
                self.set_resync_point_inner(Some(pos));
            }
            Job::Check | Job::Repair => {}
        }
    }

    /// Sleeps between windows, md's policy: never above `sync_speed_max`; above
    /// `sync_speed_min`, also give way while regular I/O is in flight (the array is not idle),
    /// by pausing as long as the last window took, so a busy array's resync gets about half
    /// the time until its average speed falls to the min, and never less than the min. Woken
    /// early by an interrupt, a stop, or a new limit.
    fn throttle(&self, t0: Instant, io_bytes: u64, last_window: Duration) {
        let s = &self.sync;
        let mut yielded = Duration::ZERO;
        loop {
            let max = s.speed_max.load(Ordering::Relaxed).max(1);
            let min = s.speed_min.load(Ordering::Relaxed);
            let el = t0.elapsed();
            let rate = io_bytes as f64 / 1024.0 / el.as_secs_f64().max(1e-6);
            // At most a day per sleep computation (no overflow on absurd limits).
            let secs = (io_bytes as f64 / 1024.0 / max as f64).min(86_400.0);
            let Some(max_due) = t0.checked_add(Duration::from_secs_f64(secs)) else {
                return;
            };
            let now = Instant::now();
            let due = if now < max_due {
                max_due
            } else if yielded < last_window && should_yield(rate, min, self.regular_io_busy()) {
                // One pause of the window's length per window (re-checked after it).
                now + (last_window - yielded).min(MAX_YIELD)
            } else {
                return;
            };
            let r = s.wq.wait_for_until(
                || {
                    (self.interrupted()
                        || s.speed_max.load(Ordering::Relaxed).max(1) != max
                        || s.speed_min.load(Ordering::Relaxed) != min)
                        .then_some(())
                },
                due,
            );
            if now >= max_due {
                s.yields.fetch_add(1, Ordering::Relaxed);
                yielded += Instant::now().saturating_duration_since(now);
            }
            if r.is_some() || self.interrupted() {
                return;
            }
        }
    }

    /// Whether regular I/O is in flight on any leg (md's "not idle").
    fn regular_io_busy(&self) -> bool {
        self.legs.iter().any(|l| l.pending() != 0)
    }

    /// One window, with its barrier raised: read the source, then write (resync/recover) or
    /// compare (check/repair) the others. False when no source could be read.
    fn window(
        &self,
        job: Job,
        pos: u64,
        len: u32,
        target: Option<&(usize, StdArc<dyn Device>)>,
        src_buf: &mut Option<Buffer>,
        cmp_buf: &mut Option<Buffer>,
    ) -> bool {
        let Some(src) = self.read_source(pos, len, src_buf) else {
            return false;
        };
        let src_fix = self.check_window_source(job, src, pos, len, src_buf);
        let others = self.window_legs(job, target, src, src_fix);
        // A window the source reads as zeros is written as a write-zeroes that may unmap, so
        // a recovery onto a sparse file (or a thin device) keeps the holes it can; a leg that
        // cannot zero takes the zeros as data.
        let zeros = job != Job::Check
            && src_buf
                .as_ref()
                .is_some_and(|b| all_zero(&b.as_slice()[..len as usize]));
        if let (Job::Recover(_), true, Some(d)) = (job, src_fix, self.legs[src].dev()) {
            // The recovery's source had blocks it lacked: they go back to it too.
            if self
                .leg_write(d.as_ref(), zeros, pos, len, src_buf)
                .is_err()
            {
                self.leg_write_failed(
                    src,
                    "a checksum repair's write failed",
                    "the last in-sync leg failed a checksum repair",
                );
            }
        }
        for (i, d) in others.iter().enumerate() {
            let Some(d) = d else { continue };
            let write = match job {
                Job::Resync | Job::Recover(_) => true,
                Job::Repair if i == src => true,
                Job::Check | Job::Repair => {
                    if self
                        .leg_rw(d.as_ref(), Op::Read, pos, len, cmp_buf)
                        .is_err()
                    {
                        // md rewrites unreadable blocks during check/repair too.
                        self.note_read_error(i);
                        true
                    } else {
                        let (Some(a), Some(b)) = (src_buf.as_ref(), cmp_buf.as_ref()) else {
                            continue;
                        };
                        let n = len as usize;
                        self.compare_copy(job, i, pos, &a.as_slice()[..n], &b.as_slice()[..n])
                    }
                }
            };
            if write
                && job != Job::Check
                && self
                    .leg_write(d.as_ref(), zeros, pos, len, src_buf)
                    .is_err()
            {
                self.leg_write_failed(
                    i,
                    "a resync write failed",
                    "the last in-sync leg failed a resync write",
                );
            }
            // A recovered leg's own sums are stale where its data was: they follow it.
            if let (Job::Recover(_), true) = (job, write) {
                if self.write_sums_to(d.as_ref(), pos, u64::from(len)).is_err() {
                    self.leg_write_failed(
                        i,
                        "a checksum write failed",
                        "the last in-sync leg failed a checksum write",
                    );
                }
            }
        }
        true
    }

    /// Reads the window from a source leg into `src_buf`, trying the next one after a read
    /// error (counted against the leg): the source's slot, or `None` when no leg could be read.
    fn read_source(&self, pos: u64, len: u32, src_buf: &mut Option<Buffer>) -> Option<usize> {
        let mut tried = LegSet::EMPTY;
        loop {
            let (i, d) = self.source_leg(tried)?;
            tried.insert(i);
            if self.leg_rw(d.as_ref(), Op::Read, pos, len, src_buf).is_ok() {
                return Some(i);
            }
            self.note_read_error(i);
        }
    }

    /// With integrity, checks the source's blocks in `src_buf` first: a bad one is taken
    /// from a leg that matches, and the source is rewritten with the rest (see `integrity`).
    /// True when the source itself must be written (it had blocks replaced).
    fn check_window_source(
        &self,
        job: Job,
        src: usize,
        pos: u64,
        len: u32,
        src_buf: &mut Option<Buffer>,
    ) -> bool {
        let (Some(t), Some(b)) = (&self.sums, src_buf.as_mut()) else {
            return false;
        };
        let c = self.check_source(
            t,
            src,
            pos,
            &mut b.as_mut_slice()[..len as usize],
            job == Job::Resync,
            job != Job::Check,
        );
        if matches!(job, Job::Check | Job::Repair) {
            // The legs differ where the source was bad (md's count, in sectors).
            self.sync.mismatch_cnt.fetch_add(
                (c.replaced + c.lost) * (crate::integrity::BLOCK >> SECTOR_SHIFT),
                Ordering::Relaxed,
            );
        }
        c.replaced > 0 && job != Job::Check
    }

    /// The legs a window writes or compares, by slot (no allocation: one slot per leg): a
    /// recovery's target; else every leg but the source (the source too when `src_fix`)
    /// that a resync writes or a check or repair compares.
    fn window_legs(
        &self,
        job: Job,
        target: Option<&(usize, StdArc<dyn Device>)>,
        src: usize,
        src_fix: bool,
    ) -> [Option<StdArc<dyn Device>>; MAX_LEGS] {
        let mut others: [Option<StdArc<dyn Device>>; MAX_LEGS] = Default::default();
        match (job, target) {
            (Job::Recover(_), Some((t, d))) => others[*t] = Some(d.clone()),
            _ => {
                // A resync writes every leg but its source that is not faulty, recovering
                // ones too (md's rule): one below its recovery offset serves reads and must
                // agree there. A check or repair compares the in-sync legs.
                for (i, l) in self.legs.iter().enumerate() {
                    let st = l.state.load();
                    let target = match job {
                        Job::Resync => st.writable(),
                        _ => st.is_member(),
                    };
                    if (i != src || src_fix) && target {
                        others[i] = l.dev();
                    }
                }
            }
        }
        others
    }

    /// Compares leg `i`'s copy of the window with the source's: counts the 512-byte sectors
    /// that differ (md's `mismatch_cnt`) and, with integrity, the copy's bad blocks. True when
    /// a repair must rewrite the copy.
    fn compare_copy(&self, job: Job, i: usize, pos: u64, src: &[u8], copy: &[u8]) -> bool {
        let bad = self.sums.as_ref().map_or(0, |t| {
            self.count_bad_copy(t, i, pos, copy, job == Job::Repair)
        });
        let diff = src
            .chunks(512)
            .zip(copy.chunks(512))
            .filter(|(x, y)| x != y)
            .count() as u64;
        self.sync.mismatch_cnt.fetch_add(diff, Ordering::Relaxed);
        (diff > 0 || bad > 0) && job == Job::Repair
    }
}

/// Whether every byte of `b` is zero (eight at a time).
fn all_zero(b: &[u8]) -> bool {
    let mut words = b.chunks_exact(8);
    words.all(|w| u64::from_ne_bytes([w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]]) == 0)
        && words.remainder().iter().all(|&x| x == 0)
}
