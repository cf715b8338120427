//! A mirrored write's payload, lent to its legs: one buffer for every leg.
//!
//! With `share_writes=1` (the default) a write does not copy the caller's data for each extra
//! leg: every leg's bio carries a read-only alias of the caller's buffer
//! ([`blk::Buffer::alias`]), and the caller's bio stays in the write's per-I/O slot, in a
//! [`Lent`] that records which legs still hold an alias. Memory per in-flight mirror write is
//! then one payload, except for a write behind (`behind`), whose write-behind legs write a
//! copy the array owns, since the caller gets its buffer back before they complete.
//! `share_writes=0` keeps the copying path (a pooled copy per extra leg, the caller's buffer
//! on the primary leg) as the simple version to compare against.
//!
//! # Invariants
//!
//! 1. **Lent before submitted.** The legs' bits are set ([`Lent::lend`]) when the write's slot
//!    is filled, under the slot's mutex, before the first leg bio is submitted.
//! 2. **Returned after the last read.** A leg's bit is cleared ([`Lent::returned`]) in
//!    `leg_done`, under the slot's mutex, when its bio has come back: a device hands a bio
//!    back (`EndIo::end_io`) only when it no longer reads its buffer, and the alias is dropped
//!    there (dropping one reads nothing and frees nothing).
//! 3. **The owner comes back only when nothing is lent.** [`Lent::take`] and [`Lent::as_mut`]
//!    give nothing while a bit is set, so whichever path completes the caller (the last leg,
//!    a write-behind acknowledgement, raid1d after a superblock write) cannot hand the buffer
//!    back, nor let it be written, while a leg may still read it.
//! 4. **Ordering.** The decision is taken under the slot's mutex, not by an atomic count: a
//!    leg's reads of the payload happen before its `end_io`, which locks the slot to clear
//!    its bit; the completer that then finds no bit set locked the same mutex after that
//!    unlock, so every leg's reads happen before the caller's `end_io` and whatever the caller
//!    then does with the buffer. `tests/loom_lend.rs` models legs completing on several threads
//!    and the caller reusing the buffer (the payload a loom `UnsafeCell`).
//! 5. **No allocation per I/O.** A `Lent` is a field of the preallocated slot; an alias is a
//!    plain value.

/// A value (the caller's bio) kept for its owner while legs (a bit each) read from it.
///
/// # Invariants
///
/// While `legs != 0` the value is neither handed out nor reachable mutably.
#[derive(Debug)]
pub struct Lent<T> {
    value: Option<T>,
    legs: u32,
}

impl<T> Default for Lent<T> {
    fn default() -> Self {
        Self::none()
    }
}

impl<T> Drop for Lent<T> {
    /// A value still lent is leaked, never dropped under a leg that reads it (no path drops
    /// one: a slot is reset only after its value was taken).
    fn drop(&mut self) {
        if self.legs != 0 {
            if let Some(v) = self.value.take() {
                std::mem::forget(v);
            }
        }
    }
}

impl<T> Lent<T> {
    /// Nothing kept.
    pub const fn none() -> Self {
        Self {
            value: None,
            legs: 0,
        }
    }

    /// Keeps `value`, lent to no leg yet.
    pub const fn owned(value: T) -> Self {
        Self {
            value: Some(value),
            legs: 0,
        }
    }

    /// Records that the legs of `mask` read the value (through aliases) until each is
    /// [`Lent::returned`].
    pub fn lend(&mut self, mask: u32) {
        self.legs |= mask;
    }

    /// Leg `leg` no longer reads the value. Whether it held it.
    pub fn returned(&mut self, leg: usize) -> bool {
        let bit = 1u32.checked_shl(leg as u32).unwrap_or(0);
        let had = self.legs & bit != 0;
        self.legs &= !bit;
        had
    }

    /// The legs still reading the value.
    pub fn lent(&self) -> u32 {
        self.legs
    }

    /// Whether a value is kept (lent or not).
    pub fn is_some(&self) -> bool {
        self.value.is_some()
    }

    /// The value, to read (legs may be reading it too).
    pub fn as_ref(&self) -> Option<&T> {
        self.value.as_ref()
    }

    /// The value, to change: none while a leg reads it.
    pub fn as_mut(&mut self) -> Option<&mut T> {
        if self.legs != 0 {
            return None;
        }
        self.value.as_mut()
    }

    /// Gives the value back to its owner: none while a leg reads it (the value stays).
    pub fn take(&mut self) -> Option<T> {
        if self.legs != 0 {
            return None;
        }
        self.value.take()
    }
}

#[cfg(all(test, not(blkq_loom)))]
mod tests {
    use super::*;

    #[test]
    fn nothing_comes_back_while_a_leg_reads() {
        let mut l = Lent::owned(7u32);
        l.lend(0b101);
        assert_eq!(l.take(), None);
        assert!(l.as_mut().is_none());
        assert_eq!(l.as_ref(), Some(&7));
        assert!(l.returned(0));
        assert!(!l.returned(1), "leg 1 was not lent");
        assert_eq!(l.take(), None, "leg 2 still reads");
        assert!(l.returned(2));
        assert_eq!(l.lent(), 0);
        assert_eq!(l.take(), Some(7));
        assert!(!l.is_some());
        assert!(!l.returned(40), "an out-of-range leg holds nothing");
    }

    #[test]
    fn a_value_still_lent_is_leaked_not_dropped() {
        let rc = std::rc::Rc::new(());
        let mut l = Lent::owned(rc.clone());
        l.lend(1);
        drop(l);
        assert_eq!(std::rc::Rc::strong_count(&rc), 2, "dropped while lent");
        let l = Lent::owned(rc.clone());
        drop(l);
        assert_eq!(std::rc::Rc::strong_count(&rc), 2);
    }
}
