//! Automatic re-add of a returning leg (`readd=auto`): raid1d probes every leg that failed
//! on an I/O error and whose device the array still holds, and puts it back when it answers
//! with this array's superblock.
//!
//! # The probe
//!
//! An interval after the failure, then every `readd_interval` (the first wait doubles each
//! time a re-added leg fails again before it is back in sync, up to 64 intervals: a local
//! disk with a bad sector is not re-added in a loop), raid1d reads the superblock of each
//! such leg with one bio of its own (never more than one per leg in flight; its completion wakes raid1d, which never
//! waits for it, so a leg that hangs holds up nothing). A probe still unanswered after an
//! interval is reported as such and no other is sent until it ends. A read error leaves the
//! leg faulty, silently; the last one is kept for `detail` ([`Raid1::readd_status`](crate::Raid1::readd_status)).
//!
//! # The verdict
//!
//! The returned superblock is judged against the array's own (another slot's, as assembly
//! would see both: [`Assembly::decide`]):
//! - another array, another slot, another leg of this slot, no superblock at all, or events
//!   past the array's (it was assembled and written without this array: it moved on) is a
//!   *different history*: the leg is refused and not touched, one line names it and why, the
//!   refusal shows in `status`/`detail`, and it is not judged again until its superblock
//!   changes (the probe keeps reading it, and compares the bytes);
//! - else it is this slot's leg: re-added in place as [`Raid1::add_leg`] re-adds (recovering,
//!   recovery offset 0, its write-mostly flag kept), with a recovery of only the bitmap's
//!   dirty chunks when the re-add rule holds ([`readd_covers`]: it was in sync when it left
//!   and no bit was cleared since: md's events rule within a generation, the generation's
//!   end across them), in full otherwise. A leg whose history diverged from the array's
//!   (`generation`) is refused: only the operator discards a side (`add_leg_discarding`).
//!
//! Bits are never cleared while the array is degraded, so the dirty chunks cover every write
//! the leg missed while it was away.
//!
//! # What is never re-added automatically
//!
//! A leg failed by the operator ([`Raid1::fail_leg`]) or found faulty at assembly (nobody
//! knows then why it failed) stays faulty until it is removed and added. The rule is per
//! placement: a new device in the slot (`gen`) starts afresh.
//!
//! # A leg that reconnects by itself
//!
//! A remote leg's device re-establishes a lost connection on its own, and a leg that never
//! failed (nothing was sent to it while its server was away) would be served again as it
//! answers then: the failover's branch, another array's leg. So the same verdict
//! ([`Array::identify`]) judges every new connection of every placed leg before anything is
//! sent on it ([`blk::Device::check_connections`], `LegConnections`), against an in-sync
//! leg's view or, with none, another slot's: a leg refused is failed, the refusal named in
//! the log and in `status`/`detail` (`on reconnection: ...`), and its device fails every
//! request from then on, so nothing the array writes reaches it; it comes back only by
//! `remove` and `add`. (A reconnection in the moment between assembly's or `add`'s read of
//! the superblock and the placement is not judged: that read was.)

use std::time::Instant;

use blk::{Bio, EndIo, Error};
use blkq_sync::atomic::AtomicBool;
use blkq_sync::DynArc as StdArc;
use blkq_sync::Mutex;

mod probe;

/// What the automatic re-add knows of a slot ([`Raid1::readd_status`](crate::Raid1::readd_status)).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReaddStatus {
    /// The leg is faulty and probed (not failed by the operator or found faulty at assembly).
    pub probing: bool,
    /// Why the last probe found no answer (a read error, or no answer within the interval).
    pub last_error: Option<String>,
    /// Why the returning leg was refused (a different history); cleared when its superblock
    /// changes. A refusal at a reconnection (`on reconnection: ...`) stays until the leg is
    /// removed: its device serves no more.
    pub refused: Option<String>,
    /// Automatic re-adds of this slot since the array started.
    pub readds: u64,
    /// Automatic re-adds since the leg was last in sync: each doubles the wait before the
    /// first probe after its next failure (up to 64 intervals).
    pub backoff: u32,
}

/// Why [`Raid1::readd_absent`](crate::Raid1::readd_absent) did not take back a leg the array started without.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AbsentError {
    /// It opens but could not be read or recorded now (a read error): try it again later.
    #[error("{0}")]
    Down(String),
    /// Its superblock tells another history (another array, another slot's or another leg,
    /// no superblock, a history that went on without the array): refused, not written.
    #[error("refused: {0}")]
    Refused(String),
    /// The slot holds a leg again (the operator added one), or the array failed: nothing to
    /// take back any more.
    #[error("{0}")]
    Gone(String),
}

/// The completion of one probe: raid1d reads `out` on its next pass.
struct ProbeEnd {
    out: Mutex<Option<(Bio, Result<(), Error>)>>,
    /// Tells raid1d, after `out` is stored: sets `ReaddState::done` (Release: raid1d's Acquire
    /// swap of `done` then finds the result stored; it also takes `out`'s lock, which orders
    /// it on its own) and wakes it (see `readd/probe.rs`, which holds the array weakly).
    notify: Box<dyn Fn() + Send + Sync>,
}

impl EndIo for ProbeEnd {
    fn end_io(&self, bio: Bio, res: Result<(), Error>) {
        *self.out.lock() = Some((bio, res));
        (self.notify)();
    }
}

struct InFlight {
    end: StdArc<ProbeEnd>,
    since: Instant,
    timed_out: bool,
}

/// One slot's probe state (raid1d's; `status` reads it).
#[derive(Default)]
struct Probe {
    /// The placement (`Leg::gen`) this state belongs to; another one resets it.
    gen: u64,
    /// Never probed: failed by the operator or found faulty at assembly.
    manual: bool,
    in_flight: Option<InFlight>,
    next: Option<Instant>,
    last_error: Option<String>,
    /// The refused superblock's bytes and why.
    refused: Option<(Vec<u8>, String)>,
    readds: u64,
    /// Re-adds since the leg was last in sync: the first probe after a failure waits
    /// `interval << backoff` (at most 64 intervals).
    backoff: u32,
}

impl Probe {
    /// Makes this the state of placement `gen`: another placement starts afresh but keeps
    /// the re-add count and the backoff, which outlive a placement.
    fn renew(&mut self, gen: u64) {
        if self.gen != gen {
            *self = Probe {
                gen,
                readds: self.readds,
                backoff: self.backoff,
                ..Probe::default()
            };
        }
    }
}

/// The array's re-add state: one [`Probe`] per slot.
pub(crate) struct ReaddState {
    probes: Box<[Mutex<Probe>]>,
    /// A probe completed since raid1d last looked.
    pub(crate) done: AtomicBool,
}

impl ReaddState {
    pub(crate) fn new(slots: usize) -> Self {
        Self {
            probes: (0..slots).map(|_| Mutex::new(Probe::default())).collect(),
            done: AtomicBool::new(false),
        }
    }
}
