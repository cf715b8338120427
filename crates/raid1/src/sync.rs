//! The sync thread: resync, recovery, check and repair (md's `md_do_sync` +
//! `raid1_sync_request`), and its control surface (`sync_action`, speed limits, progress).
//!
//! Owns [`SyncAction`], [`SyncProgress`] and the per-array `SyncState`; the `Raid1` methods
//! here are called from any thread (the control socket, tests). The engine (`sync/engine.rs`:
//! what to do next, the passes and their windows) runs on the array's sync thread
//! (`raid1-sync`), one per array, started by `Raid1::launch`; it sleeps on `SyncState::wq` when
//! there is nothing to do (no polling).

use blkq_sync::DynArc as StdArc;
use std::fmt;
use std::str::FromStr;
use std::time::{Duration, Instant};

use blk::Device;
use blkq_sync::atomic::{AtomicU64, Ordering};
use blkq_sync::Mutex;
use waitq::WaitQueue;

use crate::device::{Raid1, Raid1Error};

mod engine;

/// md's `sync_speed_min` default, KiB/s.
pub const DEFAULT_SPEED_MIN: u64 = 1000;
/// md's `sync_speed_max` default, KiB/s.
pub const DEFAULT_SPEED_MAX: u64 = 200_000;
/// Longest single pause given to regular I/O between two windows.
const MAX_YIELD: Duration = Duration::from_millis(100);

/// md's rule between two sync windows: a pass running faster than `sync_speed_min` (KiB/s)
/// gives way to regular I/O when there is some; at or below the min it never does.
pub fn should_yield(rate_kib_s: f64, min_kib_s: u64, regular_io_busy: bool) -> bool {
    regular_io_busy && rate_kib_s > min_kib_s as f64
}

/// What the sync thread does (md's `sync_action`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SyncAction {
    /// Nothing.
    Idle,
    /// Making the in-sync legs agree after an unclean stop.
    Resync,
    /// Copying data to a returning, new or replacement leg.
    Recover,
    /// Comparing the legs, counting mismatches.
    Check,
    /// Comparing the legs and rewriting mismatches from the source (the first in-sync leg that
    /// is not write-mostly, a write-mostly one only when no other is in sync).
    Repair,
    /// Paused: nothing runs until another action is set.
    Frozen,
}

impl SyncAction {
    /// md's name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Idle => "idle",
            Self::Resync => "resync",
            Self::Recover => "recover",
            Self::Check => "check",
            Self::Repair => "repair",
            Self::Frozen => "frozen",
        }
    }

    pub(crate) fn to_u64(self) -> u64 {
        match self {
            Self::Idle => 0,
            Self::Resync => 1,
            Self::Recover => 2,
            Self::Check => 3,
            Self::Repair => 4,
            Self::Frozen => 5,
        }
    }

    pub(crate) fn from_u64(v: u64) -> Self {
        match v {
            1 => Self::Resync,
            2 => Self::Recover,
            3 => Self::Check,
            4 => Self::Repair,
            5 => Self::Frozen,
            _ => Self::Idle,
        }
    }
}

impl fmt::Display for SyncAction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An unknown `sync_action` name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown sync action {0:?} (idle, resync, recover, check, repair, frozen)")]
pub struct ParseSyncActionError(pub String);

impl FromStr for SyncAction {
    type Err = ParseSyncActionError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(match s.trim() {
            "idle" => Self::Idle,
            "resync" => Self::Resync,
            "recover" => Self::Recover,
            "check" => Self::Check,
            "repair" => Self::Repair,
            "frozen" => Self::Frozen,
            other => return Err(ParseSyncActionError(other.to_string())),
        })
    }
}

/// A snapshot of the sync thread's progress (md's `sync_completed`, `sync_speed`,
/// `mismatch_cnt`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SyncProgress {
    /// What runs now.
    pub action: SyncAction,
    /// Bytes of the array walked by the current (or last) run.
    pub done_bytes: u64,
    /// Bytes the current (or last) run walks.
    pub total_bytes: u64,
    /// Average speed of the current (or last) run, KiB/s.
    pub speed_kib_s: u64,
    /// Estimated seconds left (None when idle or unknown).
    pub eta_secs: Option<u64>,
    /// Sectors (512 bytes) found different by the last check or repair.
    pub mismatch_cnt: u64,
    /// Bitmap chunks (windows without a bitmap) copied by resync/recovery since start.
    pub chunks_copied: u64,
    /// Pauses the sync thread gave to regular I/O while above `sync_speed_min`, since start.
    pub yields: u64,
}

/// The sync thread's shared state. Counters are independent statistics: Relaxed is enough
/// for them (no other data is published through them); `action` and `cancel` are read with
/// Acquire and written with Release so a reader that sees a new value also sees the state
/// written before it.
pub(crate) struct SyncState {
    /// Current `SyncAction` (as `to_u64`).
    pub(crate) action: AtomicU64,
    /// Requests from `set_sync_action`, read by the sync thread.
    pub(crate) ctl: Mutex<Ctl>,
    /// Wakes the sync thread (requests, state changes, stop) and its throttle sleeps.
    pub(crate) wq: WaitQueue,
    /// Wakes `wait_sync_idle` callers when a run ends.
    pub(crate) idle_wq: WaitQueue,
    pub(crate) done_bytes: AtomicU64,
    pub(crate) total_bytes: AtomicU64,
    pub(crate) speed_kib_s: AtomicU64,
    /// u64::MAX: none.
    pub(crate) eta_secs: AtomicU64,
    pub(crate) mismatch_cnt: AtomicU64,
    pub(crate) chunks_copied: AtomicU64,
    pub(crate) speed_min: AtomicU64,
    pub(crate) speed_max: AtomicU64,
    /// Pauses given to regular I/O (`throttle`), since start.
    pub(crate) yields: AtomicU64,
}

/// Control requests (under `SyncState::ctl`).
#[derive(Debug, Default)]
pub(crate) struct Ctl {
    /// A check/repair/resync/recover asked for.
    pub(crate) requested: Option<SyncAction>,
    /// `frozen`: nothing runs.
    pub(crate) frozen: bool,
    /// Ask the running pass to stop (idle, frozen, array stop).
    pub(crate) interrupt: bool,
    /// The array needs a resync (unclean stop); cleared when one completes.
    pub(crate) resync_needed: bool,
    /// Where an interrupted resync goes on (array bytes; in memory only: after a restart a
    /// resync starts over, from the bitmap).
    pub(crate) resync_offset: u64,
    /// A recovery failed for lack of a readable source: not retried until a leg is added or
    /// `recover` is requested (no busy loop).
    pub(crate) recovery_blocked: bool,
    /// A resync failed for lack of a readable source: still needed (`resync_needed` stays,
    /// so no check runs and the stop does not mark the array clean), but not retried until
    /// `resync` is requested or the array is assembled again (no busy loop).
    pub(crate) resync_blocked: bool,
    /// The sync thread must exit.
    pub(crate) stop: bool,
}

impl SyncState {
    pub(crate) fn new() -> Self {
        Self {
            action: AtomicU64::new(SyncAction::Idle.to_u64()),
            ctl: Mutex::new(Ctl::default()),
            wq: WaitQueue::new(),
            idle_wq: WaitQueue::new(),
            done_bytes: AtomicU64::new(0),
            total_bytes: AtomicU64::new(0),
            speed_kib_s: AtomicU64::new(0),
            eta_secs: AtomicU64::new(u64::MAX),
            mismatch_cnt: AtomicU64::new(0),
            chunks_copied: AtomicU64::new(0),
            speed_min: AtomicU64::new(DEFAULT_SPEED_MIN),
            speed_max: AtomicU64::new(DEFAULT_SPEED_MAX),
            yields: AtomicU64::new(0),
        }
    }

    pub(crate) fn action(&self) -> SyncAction {
        SyncAction::from_u64(self.action.load(Ordering::Acquire))
    }
}

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
