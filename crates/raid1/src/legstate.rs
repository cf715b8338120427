//! A leg's state: the atomic word of a slot ([`LegStateCell`], `Leg::state`) and a snapshot
//! read from it ([`LegState`]). Every question about a leg (present? a member? writable?) is
//! a method of the snapshot; every change is a named transition of the cell, which
//! `debug_assert!`s the state it expects (in debug builds, the simulator's included).
//
// Leg state: one `AtomicU32` per slot (`Leg::state`), read without a lock on every I/O
// (`LegState::writable`, `choose_read_leg`) and changed only by the control paths:
//
// | state                         | meaning                                                |
// |-------------------------------|--------------------------------------------------------|
// | 0                             | empty slot                                             |
// | PRESENT                       | a leg, recovering: readable below `recovery_offset`    |
// | PRESENT + IN_SYNC             | a full member: written and read                        |
// | PRESENT + FAULTY (+ IN_SYNC)  | failed: neither read nor written until removed         |
// | + WRITE_MOSTLY                | with any of the above: read only when nothing else can |
//
// Orderings: every change is a Release store or an AcqRel RMW, and every I/O-path load is
// Acquire, so an I/O that sees a state also sees what was published before it: the leg's
// `recovery_offset` (stored Release before `IN_SYNC` is set) and the device behind the leg's
// lock. Transitions never lose one another: `add_leg` and `remove_leg` store a whole word
// with the array frozen (no I/O admitted); `fail_leg` sets FAULTY with an RMW under
// `fail_lock` (two legs failing at once cannot both see the other as the survivor);
// `Array::mark_in_sync` (the sync thread, `set_in_sync`) sets IN_SYNC with a CAS that
// requires PRESENT and not FAULTY, so a leg removed or failed meanwhile is never made a
// member. An I/O that read the state just before a leg was marked faulty may still send one
// bio to it: that bio fails or succeeds on its own, as in md, and the freeze in `remove_leg`
// waits for it before the slot is emptied.

use blkq_sync::atomic::{AtomicU32, Ordering};

/// Leg state bit: the slot holds a leg.
const PRESENT: u32 = 1;
/// Leg state bit: the leg is a full member (else it is recovering).
const IN_SYNC: u32 = 2;
/// Leg state bit: the leg failed.
const FAULTY: u32 = 4;
/// Leg state bit: read only when no other leg can serve.
const WRITE_MOSTLY: u32 = 8;

/// One reading of a leg's state word.
#[repr(transparent)]
#[derive(Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct LegState(u32);

impl LegState {
    /// A present leg, recovering (not in sync, not faulty, not write-mostly).
    pub(crate) const RECOVERING: Self = Self(PRESENT);
    /// A present, in-sync, non-faulty leg.
    pub(crate) const MEMBER: Self = Self(PRESENT | IN_SYNC);

    /// The slot holds a leg.
    #[inline]
    pub(crate) const fn is_present(self) -> bool {
        self.0 & PRESENT != 0
    }

    /// The in-sync bit (a faulty leg may keep it).
    #[inline]
    pub(crate) const fn in_sync(self) -> bool {
        self.0 & IN_SYNC != 0
    }

    #[inline]
    pub(crate) const fn is_faulty(self) -> bool {
        self.0 & FAULTY != 0
    }

    #[inline]
    pub(crate) const fn is_write_mostly(self) -> bool {
        self.0 & WRITE_MOSTLY != 0
    }

    /// Present and not faulty: written (recovering legs included).
    #[inline]
    pub(crate) const fn writable(self) -> bool {
        self.0 & (PRESENT | FAULTY) == PRESENT
    }

    /// Present, in sync and not faulty: a full member.
    #[inline]
    pub(crate) const fn is_member(self) -> bool {
        self.0 & (PRESENT | IN_SYNC | FAULTY) == PRESENT | IN_SYNC
    }

    /// Present, not in sync and not faulty: a leg to recover.
    #[inline]
    pub(crate) const fn is_recovering(self) -> bool {
        self.0 & (PRESENT | IN_SYNC | FAULTY) == PRESENT
    }

    /// Present and faulty.
    #[inline]
    pub(crate) const fn is_failed(self) -> bool {
        self.0 & (PRESENT | FAULTY) == PRESENT | FAULTY
    }

    /// With the faulty bit set.
    #[inline]
    #[must_use]
    pub(crate) const fn faulty(self) -> Self {
        Self(self.0 | FAULTY)
    }

    /// With the write-mostly bit set.
    #[inline]
    #[must_use]
    pub(crate) const fn write_mostly(self) -> Self {
        Self(self.0 | WRITE_MOSTLY)
    }

    /// With the in-sync bit set (a state built at assembly).
    #[inline]
    #[must_use]
    pub(crate) const fn synced(self) -> Self {
        Self(self.0 | IN_SYNC)
    }
}

impl core::fmt::Debug for LegState {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        if !self.is_present() {
            return f.write_str("Empty");
        }
        f.write_str(if self.in_sync() {
            "InSync"
        } else {
            "Recovering"
        })?;
        if self.is_faulty() {
            f.write_str("+Faulty")?;
        }
        if self.is_write_mostly() {
            f.write_str("+WriteMostly")?;
        }
        Ok(())
    }
}

/// A slot's state word. Loads are Acquire, changes Release stores or AcqRel RMWs (see the
/// orderings above).
pub(crate) struct LegStateCell(AtomicU32);

impl LegStateCell {
    pub(crate) fn new() -> Self {
        Self(AtomicU32::new(0))
    }

    /// A snapshot (Acquire: see the orderings above).
    #[inline]
    pub(crate) fn load(&self) -> LegState {
        LegState(self.0.load(Ordering::Acquire))
    }

    /// Puts a leg in an empty slot, or re-places a leg that is not a writable member (a
    /// failed leg re-added, a recovering one restarted): a whole-word store, with the array
    /// frozen or before it runs. Expects `to` present.
    #[inline]
    pub(crate) fn place(&self, to: LegState) {
        debug_assert!(to.is_present(), "placing a leg as {to:?}");
        self.0.store(to.0, Ordering::Release);
    }

    /// Empties the slot (a whole-word store, with the array frozen). Expects no full member
    /// (a member is failed first).
    #[inline]
    pub(crate) fn remove(&self) {
        let st = self.load();
        debug_assert!(!st.is_member(), "removing a leg in state {st:?}");
        self.0.store(0, Ordering::Release);
    }

    /// Marks the leg faulty (AcqRel RMW, under `fail_lock`); returns the state before.
    /// Expects a present leg.
    #[inline]
    pub(crate) fn fail(&self) -> LegState {
        let was = LegState(self.0.fetch_or(FAULTY, Ordering::AcqRel));
        debug_assert!(was.is_present(), "failing a leg in state {was:?}");
        was
    }

    /// Sets or clears the write-mostly bit (AcqRel RMW, with the array frozen). Expects a
    /// present leg.
    #[inline]
    pub(crate) fn set_write_mostly(&self, on: bool) {
        let was = if on {
            self.0.fetch_or(WRITE_MOSTLY, Ordering::AcqRel)
        } else {
            self.0.fetch_and(!WRITE_MOSTLY, Ordering::AcqRel)
        };
        debug_assert!(
            LegState(was).is_present(),
            "write-mostly set on {:?}",
            LegState(was)
        );
    }

    /// Ends a recovery: sets IN_SYNC if the leg is present and not faulty (a CAS, not a check
    /// then a `fetch_or`: the leg may be failed or removed between the look and the update);
    /// returns whether it did. What it sets was a recovering leg (or already a member).
    #[inline]
    pub(crate) fn finish_recovery(&self) -> bool {
        let mut st = self.0.load(Ordering::Acquire);
        loop {
            if !LegState(st).writable() {
                return false;
            }
            match self.0.compare_exchange_weak(
                st,
                st | IN_SYNC,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(was) => {
                    debug_assert!(
                        LegState(was).writable(),
                        "recovery finished on {:?}",
                        LegState(was)
                    );
                    return true;
                }
                Err(now) => st = now,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{LegState, LegStateCell};

    #[test]
    fn transitions_and_questions() {
        let c = LegStateCell::new();
        assert_eq!(c.load(), LegState::default());
        assert!(!c.load().is_present() && !c.load().writable());
        assert!(!c.finish_recovery(), "an empty slot never becomes a member");
        c.place(LegState::RECOVERING.write_mostly());
        let st = c.load();
        assert!(st.is_recovering() && st.writable() && st.is_write_mostly() && !st.in_sync());
        assert!(c.finish_recovery());
        assert!(c.load().is_member());
        c.set_write_mostly(false);
        assert_eq!(c.load(), LegState::MEMBER);
        let was = c.fail();
        assert!(was.is_member());
        let st = c.load();
        assert!(st.is_failed() && st.in_sync() && !st.writable() && !st.is_member());
        assert!(!c.finish_recovery(), "a faulty leg never becomes a member");
        assert_eq!(format!("{st:?}"), "InSync+Faulty");
        c.remove();
        assert_eq!(c.load(), LegState::default());
    }

    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "removing a leg in state InSync")]
    fn removing_a_member_is_refused_in_debug() {
        let c = LegStateCell::new();
        c.place(LegState::MEMBER);
        c.remove();
    }

    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "failing a leg in state Empty")]
    fn failing_an_empty_slot_is_refused_in_debug() {
        LegStateCell::new().fail();
    }
}
