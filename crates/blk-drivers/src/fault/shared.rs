//! The state a fault device shares between its submitters, the inner device's completion
//! threads, its timer thread and its handles ([`FaultState`]), what a forwarded I/O keeps in its
//! slot, and the few facts about a bio they all read.

use std::time::Duration;

use blk::{Bio, Buffer, Device, EndIo, Error, Op, SECTOR_SHIFT};
use blkq_sync::stat::{Ordering, StatU64};
use blkq_sync::DynArc as Arc;
use blkq_sync::Mutex;
use waitq::WaitQueue;

use super::rules::{Flip, Rules, Verdict};
use super::timer::Timer;
use super::undo::State;

#[derive(Debug, Default)]
pub(super) struct Counters {
    pub(super) seen: [StatU64; 4],
    pub(super) failed: [StatU64; 4],
    pub(super) delayed: StatU64,
    pub(super) stalled: StatU64,
    pub(super) flipped: [StatU64; 4],
    pub(super) crashed_io: StatU64,
    pub(super) undo_reads: StatU64,
    pub(super) crashes: StatU64,
    pub(super) writes_lost: StatU64,
}

pub(super) fn class_index(op: Op) -> usize {
    match op {
        Op::Read => 0,
        Op::Write => 1,
        Op::Flush => 2,
        Op::Discard | Op::WriteZeroes => 3,
    }
}

// Counters are statistics only: nothing decides anything on them, so Relaxed everywhere.
#[inline]
pub(super) fn bump(c: &StatU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

/// What a completion still needs, kept in a slot while the I/O is in the inner device.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Ack {
    pub(super) delay: Duration,
    /// Acknowledgements before a FLUSH was forwarded.
    pub(super) flush_mark: u64,
    /// The I/O's undo entry.
    pub(super) undo: Option<u64>,
    /// The crash epoch when forwarded: a completion of an older epoch fails.
    pub(super) epoch: u64,
    /// The bit a flip rule flips: in a read's data at completion, or, for a write, the one
    /// flipped in the copy forwarded (`None` when there was no data to flip).
    pub(super) flip: Option<Flip>,
}

pub(super) struct Slot {
    pub(super) end: Option<Arc<dyn EndIo>>,
    pub(super) cookie: u64,
    pub(super) ack: Ack,
    /// A flipped write's own buffer, while the inner device has the flipped copy.
    pub(super) orig: Option<Buffer>,
}

#[derive(Default)]
pub(super) struct Slots {
    pub(super) v: Vec<Slot>,
    pub(super) free: Vec<u32>,
}

/// A completion the timer thread delivers once its delay has passed.
pub(super) struct Late {
    pub(super) bio: Bio,
    pub(super) res: Result<(), Error>,
    pub(super) end: Arc<dyn EndIo>,
    pub(super) ack: Ack,
}

pub(super) struct Held {
    pub(super) bio: Bio,
    pub(super) end: Arc<dyn EndIo>,
    pub(super) v: Verdict,
}

/// What a fault device shares between its submitters, the inner device's completions, its
/// timer thread and its handles.
pub(super) struct FaultState {
    /// The inner device, for the handles' `release` and `crash` (the device submits through
    /// its own reference, without this lock). Taken by the device's drop: a handle that
    /// outlives the device keeps its rules and counters, not the inner device.
    pub(super) inner: Mutex<Option<Arc<dyn Device>>>,
    pub(super) volatile: bool,
    pub(super) rules: Mutex<Rules>,
    pub(super) slots: Mutex<Slots>,
    pub(super) state: Mutex<State>,
    pub(super) stalled: Mutex<Vec<Held>>,
    /// An empty list with the stall list's capacity (see `release`).
    pub(super) stalled_spare: Mutex<Vec<Held>>,
    /// Delayed completions and the timer thread that delivers them (`timer`'s docs).
    pub(super) timer: Timer<Late>,
    /// Held by `crash` from start to end, and by `restart`: a restart never ends a crash
    /// whose roll back is still running.
    pub(super) crash_lock: Mutex<()>,
    /// A crash waits here for `State::in_flight` to reach 0; woken by `on_inner_done` when the
    /// last forwarded I/O comes back.
    pub(super) idle_wq: WaitQueue,
    pub(super) counters: Counters,
}

pub(super) fn errno_err(errno: i32) -> Error {
    Error::Io(std::io::Error::from_raw_os_error(errno))
}

pub(super) fn bio_range(bio: &Bio) -> (u64, u64) {
    (
        bio.sector.saturating_mul(1 << SECTOR_SHIFT),
        u64::from(bio.len),
    )
}

pub(super) fn modifies(op: Op) -> bool {
    matches!(op, Op::Write | Op::Discard | Op::WriteZeroes)
}
