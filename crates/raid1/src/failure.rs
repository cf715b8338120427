//! Durable failures and the failed array: a leg failure is acknowledged to no write or flush
//! before a superblock records it (md's `MD_SB_CHANGE_PENDING`), and the last in-sync leg's
//! failure fails the whole array (md's `MD_BROKEN`). Called from completion contexts, raid1d,
//! the sync thread and the control paths. The rules: "Durable failures and the failed array"
//! in docs/design.md, and the comments below.

use blk::Error;

use crate::device::Array;
use crate::error::Raid1Error;
use crate::events::Event;

pub(crate) mod durable;

impl Array {
    /// Marks leg `i` faulty unless it is the last in-sync leg. Returns whether it did. The
    /// first time it does, the failure is told (`events`) with its `cause`.
    ///
    /// # Durable failures (md's `MD_SB_CHANGE_PENDING`)
    ///
    /// A failed leg missed writes from then on; until a superblock that records the failure is
    /// durable on the survivors, a crash would assemble it back in sync, and a resync could copy
    /// its stale data over theirs. So no write or flush is acknowledged while a failure is not
    /// durable: `fail_gen` counts failures and `durable_gen` the failures the last complete
    /// superblock write recorded; a write or flush that completes with `fail_gen >
    /// durable_gen` is held (`held`) for raid1d, which writes the superblocks and only then
    /// completes it.
    ///
    /// Orderings: `fail_gen` is bumped (Release) before FAULTY is set (AcqRel), both under
    /// `fail_lock`. A submitter that sees FAULTY (Acquire) and so leaves the leg out of a write
    /// therefore sees the bump when it completes, and holds the write. `write_superblocks`
    /// reads `fail_gen` under `fail_lock`, so every failure it counts has set its bit before the
    /// superblocks are built from the leg states. The fields and their rules: `durable`.
    pub(crate) fn fail_leg(&self, i: usize, cause: &'static str) -> bool {
        // Serialised, so two legs failing at once cannot both see the other as the survivor.
        let g = self.durable.begin_failure();
        let l = &self.legs[i];
        let others = self
            .legs
            .iter()
            .enumerate()
            .filter(|&(j, o)| j != i && o.state.load().is_member())
            .count();
        let st = l.state.load();
        if !st.is_present() || (st.in_sync() && others == 0) {
            return false;
        }
        g.count();
        let was = l.state.fail();
        // The decision above, under the lock that orders every failure: an in-sync leg is
        // failed only with another member left.
        assert!(
            !st.in_sync() || self.legs.iter().any(|o| o.state.load().is_member()),
            "leg {i}'s failure left no in-sync leg"
        );
        drop(g);
        self.state_changed();
        if !was.is_faulty() {
            self.emit(Event::LegFailed { slot: i, cause });
        }
        true
    }

    /// `Raid1Error::Failed` once the array has failed (leg management is refused then).
    pub(crate) fn refuse_if_failed(&self) -> Result<(), Raid1Error> {
        match self.durable.why() {
            Some(why) => Err(Raid1Error::Failed(why)),
            None => Ok(()),
        }
    }

    /// Whether a failure is not yet recorded by a durable superblock (see `fail_leg`).
    #[inline]
    pub(crate) fn failure_pending(&self) -> bool {
        self.durable.pending()
    }

    /// # The failed array (md's `MD_BROKEN`)
    ///
    /// Once a promise cannot be kept (a superblock recording a leg failure cannot be written
    /// on any survivor, or the last in-sync leg reported a write-back error that cannot fail
    /// it), the array fails: every later write and flush fails with EIO, for every caller, until
    /// it is stopped; reads still work. The first reason is kept.
    pub(crate) fn fail_array(&self, why: &'static str) {
        if self.durable.fail(why) {
            self.emit(Event::ArrayFailed { why });
        }
        // A running pass stops, and whoever waits for one (replace_leg) looks again.
        self.sync.wq.wake_all();
        self.sync.idle_wq.wake_all();
    }

    /// The error of a failed array, or None.
    #[inline]
    pub(crate) fn failed_error(&self) -> Option<Error> {
        self.durable.error()
    }

    /// raid1d, every tick: a leg whose device says it cannot serve (a remote leg past its
    /// reconnect deadline) fails as if a write had failed on it, even when no I/O asked
    /// anything of it, so that its bits stay set and its return is a re-add (never the last
    /// in-sync leg: `fail_leg` refuses it, and its I/O errors decide).
    pub(crate) fn fail_unavailable_legs(&self) {
        for (i, l) in self.legs.iter().enumerate() {
            let st = l.state.load();
            if !st.writable() {
                continue;
            }
            if l.dev().is_some_and(|d| d.unavailable()) {
                self.fail_leg(
                    i,
                    "its device reports it cannot serve (a remote leg not reconnected within \
                     its reconnect deadline)",
                );
            }
        }
    }

    /// A write or flush failed on leg `leg` (`cause`, for the leg's failure): fail the leg; if
    /// it is the last in-sync leg, which cannot be failed, the array fails (`why`, see
    /// `Array::fail_array`).
    pub(crate) fn leg_write_failed(&self, leg: usize, cause: &'static str, why: &'static str) {
        if self.fail_leg(leg, cause) {
            return;
        }
        let st = self.legs[leg].state.load();
        if st.is_member() {
            self.fail_array(why);
        }
    }
}
