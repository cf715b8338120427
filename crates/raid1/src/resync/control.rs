//! The sync thread's control surface on [`Raid1`]: `sync_action`, the speed limits,
//! progress, `wait_sync_idle`, `replace_leg` (see `sync.rs` for the state they act on).

use blkq_sync::DynArc as StdArc;
use std::time::{Duration, Instant};

use blk::Device;
use blkq_sync::atomic::Ordering;

use super::{SyncAction, SyncProgress, SyncState};
use crate::device::Raid1;
use crate::error::Raid1Error;

impl Raid1 {
    /// What the sync thread does now (md's `sync_action` read).
    pub fn sync_action(&self) -> SyncAction {
        let s = self.sync_state();
        let a = s.action();
        if a == SyncAction::Idle && s.ctl.lock().frozen {
            SyncAction::Frozen
        } else {
            a
        }
    }

    /// md's `sync_action` write: `idle` stops a running check/repair (and unfreezes),
    /// `frozen` pauses whatever runs (a resync/recovery resumes where it stopped when
    /// unfrozen), `check`/`repair` start one (refused while a resync/recovery is needed or
    /// runs), `resync`/`recover` ask for one (the array starts them itself when needed).
    pub fn set_sync_action(&self, action: SyncAction) -> Result<(), Raid1Error> {
        self.request_sync_action(action)
    }

    /// A snapshot of the sync progress.
    pub fn sync_progress(&self) -> SyncProgress {
        let s = self.sync_state();
        let eta = s.eta_secs.load(Ordering::Relaxed);
        SyncProgress {
            action: self.sync_action(),
            done_bytes: s.done_bytes.load(Ordering::Relaxed),
            total_bytes: s.total_bytes.load(Ordering::Relaxed),
            speed_kib_s: s.speed_kib_s.load(Ordering::Relaxed),
            eta_secs: (eta != u64::MAX).then_some(eta),
            mismatch_cnt: s.mismatch_cnt.load(Ordering::Relaxed),
            chunks_copied: s.chunks_copied.load(Ordering::Relaxed),
            yields: s.yields.load(Ordering::Relaxed),
        }
    }

    /// Sets md's `sync_speed_min` / `sync_speed_max`, KiB/s (0 keeps the current value; the
    /// max is raised to the min if below it).
    pub fn set_speed_limits(&self, min_kib_s: u64, max_kib_s: u64) {
        let s = self.sync_state();
        if min_kib_s != 0 {
            s.speed_min.store(min_kib_s, Ordering::Relaxed);
        }
        if max_kib_s != 0 {
            s.speed_max.store(max_kib_s, Ordering::Relaxed);
        }
        let min = s.speed_min.load(Ordering::Relaxed);
        if s.speed_max.load(Ordering::Relaxed) < min {
            s.speed_max.store(min, Ordering::Relaxed);
        }
        // A throttled pass re-reads the limit.
        s.wq.wake_all();
    }

    /// `(sync_speed_min, sync_speed_max)`, KiB/s (md's defaults 1000 and 200000).
    pub fn speed_limits(&self) -> (u64, u64) {
        let s = self.sync_state();
        (
            s.speed_min.load(Ordering::Relaxed),
            s.speed_max.load(Ordering::Relaxed),
        )
    }

    /// Waits until the sync thread is idle (or frozen) with nothing left to do; false on
    /// timeout.
    pub fn wait_sync_idle(&self, timeout: Duration) -> bool {
        self.wait_idle(timeout)
    }

    /// Replaces the leg in slot `old`: adds `new` into a free slot, recovers it fully, then
    /// fails and removes the old leg. Blocks until done (a frozen array holds it; a recovery
    /// that fails, or a new leg that fails or is removed meanwhile, ends it with an error and
    /// leaves `old` in place); returns the new leg's slot. Needs a free slot
    /// (`spare_slots`).
    pub fn replace_leg(&self, old: usize, new: StdArc<dyn Device>) -> Result<usize, Raid1Error> {
        self.replace(old, new, None)
    }

    /// [`Raid1::replace_leg`], naming the new leg `name` (its device spec:
    /// [`Raid1::set_leg_name`]) from its first event on.
    pub fn replace_named_leg(
        &self,
        old: usize,
        new: StdArc<dyn Device>,
        name: Option<String>,
    ) -> Result<usize, Raid1Error> {
        self.replace(old, new, name)
    }
}

impl Raid1 {
    pub(crate) fn sync_state(&self) -> &SyncState {
        &self.inner.sync
    }

    fn request_sync_action(&self, action: SyncAction) -> Result<(), Raid1Error> {
        let s = self.sync_state();
        let mut c = s.ctl.lock();
        match action {
            SyncAction::Idle => {
                c.frozen = false;
                if matches!(s.action(), SyncAction::Check | SyncAction::Repair) {
                    c.interrupt = true;
                }
                if matches!(c.requested, Some(SyncAction::Check | SyncAction::Repair)) {
                    c.requested = None;
                }
            }
            SyncAction::Frozen => {
                c.frozen = true;
                c.interrupt = true;
            }
            SyncAction::Check | SyncAction::Repair => {
                let busy = matches!(s.action(), SyncAction::Resync | SyncAction::Recover)
                    || c.resync_needed
                    || self.inner.recovering_leg().is_some();
                if busy {
                    return Err(Raid1Error::Busy("a resync or recovery is pending"));
                }
                c.frozen = false;
                c.requested = Some(action);
            }
            SyncAction::Resync => {
                c.frozen = false;
                c.resync_needed = true;
                c.resync_blocked = false;
            }
            SyncAction::Recover => {
                c.frozen = false;
                c.recovery_blocked = false;
            }
        }
        drop(c);
        s.wq.wake_all();
        Ok(())
    }

    fn wait_idle(&self, timeout: Duration) -> bool {
        let s = self.sync_state();
        let inner = &self.inner;
        s.idle_wq
            .wait_for_until(
                || {
                    let c = s.ctl.lock();
                    let idle = s.action() == SyncAction::Idle
                        && (c.frozen || c.stop || inner.next_job(&c).is_none());
                    idle.then_some(())
                },
                Instant::now() + timeout,
            )
            .is_some()
    }

    fn replace(
        &self,
        old: usize,
        new: StdArc<dyn Device>,
        name: Option<String>,
    ) -> Result<usize, Raid1Error> {
        let st = self
            .leg_status(old)
            .ok_or(Raid1Error::Slot(old, "no such slot"))?;
        if !st.present || st.faulty {
            return Err(Raid1Error::Slot(old, "not a working leg"));
        }
        let slot = self.add_named_leg(new, false, name)?;
        let inner = &self.inner;
        // Wait for its recovery; give up if it failed or was taken out.
        inner.sync.idle_wq.wait_for(|| {
            let l = &inner.legs[slot];
            let st = l.state.load();
            let c = inner.sync.ctl.lock();
            let done = st.in_sync()
                || !st.writable()
                || c.stop
                || c.recovery_blocked
                || inner.durable.is_failed();
            done.then_some(())
        });
        let st = inner.legs[slot].state.load();
        if !st.is_member() {
            return Err(Raid1Error::Slot(slot, "replacement did not recover"));
        }
        self.fail_leg_for(old, "replaced")?;
        self.remove_leg(old)?;
        Ok(slot)
    }

    /// Stops the sync thread (array stop): interrupts a running pass (a recovery keeps its
    /// offset in the superblocks) and joins.
    pub(crate) fn stop_sync_thread(&mut self) {
        {
            let mut c = self.inner.sync.ctl.lock();
            c.stop = true;
            c.interrupt = true;
        }
        self.inner.sync.wq.wake_all();
        self.inner.sync.idle_wq.wake_all();
        if let Some(t) = self.syncer.take() {
            let _ = t.join();
        }
    }
}
