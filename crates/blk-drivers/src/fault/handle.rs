//! [`FaultHandle`]: what a test holds to change a fault device's rules at run time, release
//! its stalled I/Os and read its counters ([`FaultCounters`]); its crash model is in `cache`.

use std::fmt;

use blk::EndIo;
use blkq_sync::stat::{Ordering, StatU64};
use blkq_sync::DynArc as Arc;

use super::rules::{Rule, RuleState};
use super::shared::{errno_err, FaultState};

/// A snapshot of a fault device's counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FaultCounters {
    /// I/Os submitted, by class: read, write, flush, discard/write-zeroes.
    pub seen: [u64; 4],
    /// I/Os failed by a rule, by class.
    pub failed: [u64; 4],
    /// I/Os whose completion was delayed.
    pub delayed: u64,
    /// I/Os stalled.
    pub stalled: u64,
    /// I/Os with a bit flipped by a rule that the inner device completed successfully (reads:
    /// flipped in the data returned; writes: in the data stored), by class (only reads and
    /// writes flip).
    pub flipped: [u64; 4],
    /// I/Os failed because the device was crashed.
    pub crashed_io: u64,
    /// Undo reads made (volatile cache).
    pub undo_reads: u64,
    /// Crashes.
    pub crashes: u64,
    /// Writes rolled back by crashes.
    pub writes_lost: u64,
}

/// A handle to a fault device's rules, stall list, crash model and counters (cheap to clone;
/// keeps the device's state alive, not the device, nor the device under it: once the device
/// is dropped, [`release`](Self::release) has nothing to forward and
/// [`crash`](FaultHandle::crash) fails with `ENODEV`).
#[derive(Clone)]
pub struct FaultHandle {
    pub(super) sh: Arc<FaultState>,
    pub(super) completer: Arc<dyn EndIo>,
}

impl fmt::Debug for FaultHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FaultHandle")
            .field("counters", &self.counters())
            .finish()
    }
}

impl FaultHandle {
    /// Adds a rule (after the others); returns its id.
    pub fn add(&self, rule: Rule) -> u64 {
        let mut r = self.sh.rules.lock();
        let id = r.next_id;
        r.next_id += 1;
        r.list.push(RuleState {
            id,
            rule,
            matched: 0,
        });
        id
    }

    /// Removes the rule `id`; returns whether it was there.
    pub fn remove(&self, id: u64) -> bool {
        let mut r = self.sh.rules.lock();
        let n = r.list.len();
        r.list.retain(|s| s.id != id);
        r.list.len() != n
    }

    /// Removes every rule (stalled I/Os stay stalled until [`release`](Self::release)).
    pub fn clear(&self) {
        self.sh.rules.lock().list.clear();
    }

    /// The rules now, in order.
    pub fn list(&self) -> Vec<Rule> {
        self.sh.rules.lock().list.iter().map(|s| s.rule).collect()
    }

    /// Sets the seed of probabilities and jitter.
    pub fn set_seed(&self, seed: u64) {
        self.sh.rules.lock().seed = seed;
    }

    /// I/Os stalled now.
    pub fn stalled(&self) -> usize {
        self.sh.stalled.lock().len()
    }

    /// Forwards every stalled I/O (in submission order), on this thread; returns how many.
    pub fn release(&self) -> usize {
        let inner = self.sh.inner.lock().clone();
        // The stall list and a spare of the same capacity swap places, so stalling and
        // releasing stay allocation-free after warm-up.
        let mut held = std::mem::take(&mut *self.sh.stalled_spare.lock());
        std::mem::swap(&mut *self.sh.stalled.lock(), &mut held);
        let n = held.len();
        for h in held.drain(..) {
            match &inner {
                Some(inner) => self
                    .sh
                    .dispatch(&**inner, h.bio, &h.end, h.v, &self.completer),
                // The device was dropped (which failed what was stalled then): nothing to
                // forward to.
                None => h.end.end_io(h.bio, Err(errno_err(libc::ECANCELED))),
            }
        }
        *self.sh.stalled_spare.lock() = held;
        n
    }

    /// A snapshot of the counters.
    pub fn counters(&self) -> FaultCounters {
        let c = &self.sh.counters;
        let l = |x: &StatU64| x.load(Ordering::Relaxed);
        FaultCounters {
            seen: std::array::from_fn(|i| l(&c.seen[i])),
            failed: std::array::from_fn(|i| l(&c.failed[i])),
            delayed: l(&c.delayed),
            stalled: l(&c.stalled),
            flipped: std::array::from_fn(|i| l(&c.flipped[i])),
            crashed_io: l(&c.crashed_io),
            undo_reads: l(&c.undo_reads),
            crashes: l(&c.crashes),
            writes_lost: l(&c.writes_lost),
        }
    }
}
