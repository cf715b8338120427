//! The sync thread: resync, recovery, check and repair (md's `md_do_sync` +
//! `raid1_sync_request`), and its control surface (`sync_action`, speed limits, progress).
//!
//! Owns [`SyncAction`], [`SyncProgress`] and the per-array `SyncState`; the `Raid1` methods
//! of `resync/control.rs` are called from any thread (the control socket, tests). The engine (`resync/engine.rs`:
//! what to do next, the passes and their windows) runs on the array's sync thread
//! (`raid1-sync`), one per array, started by `Raid1::launch`; it sleeps on `SyncState::wq` when
//! there is nothing to do (no polling).

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use blkq_sync::atomic::{AtomicU64, Ordering};
use blkq_sync::Mutex;
use waitq::WaitQueue;

mod control;
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
