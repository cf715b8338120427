//! The array's lifetime against its legs' completions, without a shared count per completion.
//!
//! A leg completes a bio by calling the array's completion handle (`LegEnd`), on whatever
//! thread the leg completes on, and that call may outlive the caller's handle: inside it the
//! mirror ends the caller's I/O, and the caller may drop the array right there (from inside its
//! own completion) or on another thread the moment the I/O is done, while the completion is
//! still in the mirror's bookkeeping. The simple rule, kept as `completion_ref=counted`, upgrades
//! a `Weak` to the array for each completion: two read-modify-writes of the array's one
//! reference count per leg bio, a cache line every completing core of every job writes.
//!
//! [`Retirement`] replaces the count with a count of completions in progress per thread shard
//! (each core writes its own line) and an end of life that needs no wait:
//!
//! - **enter / exit**: a completion counts itself in on its shard before it touches the array
//!   and out after its last touch;
//! - **retire**: the owner's last act (`Raid1`'s `Drop`, after its drain) hands its reference to
//!   the array ([`Retirement::retire`]) instead of dropping it, and closes every shard;
//! - **last out**: each shard is closed exactly once, by the retirer if nobody is inside it then,
//!   or else by the exit that leaves it empty; each close counts `open` down, and whoever counts
//!   it to zero gets the reference back and drops it (the array's memory goes then).
//!
//! Nobody waits, so a drop from inside a completion (the completion is inside its shard, so the
//! retirer cannot close that shard; the completion's own exit does, later) and a drop on another
//! thread while completions finish both free the array after the last of them is out.
//!
//! # Invariants
//!
//! 1. A shard's word is `(count << 1) | CLOSED`. `count` is the completions inside on that
//!    shard; `CLOSED` is set once, by the retirer, and never cleared.
//! 2. No completion enters after retirement began. The owner retires only after its drain:
//!    every leg bio it submitted has been counted back, and every completion's `enter` is
//!    sequenced before that completion releases what the drain waits for (the I/O's slot and
//!    barrier admission), so the retirer's `fetch_or` happens after every `enter`.
//! 3. A shard is closed by exactly one of: the retirer's `fetch_or` that finds `count == 0`,
//!    or the `exit` whose `fetch_sub` takes `count` from 1 to 0 with `CLOSED` set (the read-
//!    modify-writes on the word are totally ordered, so exactly one of them sees that state).
//! 4. `open` starts at shards + 1 (the retirer's own count) when retirement begins; each close
//!    and the retirer's end count it down once, so exactly one party takes it to 0 and drops the
//!    reference. Until then the reference is held, so the array outlives every completion that
//!    entered.
//! 5. After an `exit` that does not close its shard, the completion touches nothing of the
//!    array: another party may free it at once.
//!
//! # Memory orderings
//!
//! - `enter` is `Relaxed`: what makes the retirer see it is invariant 2 (the drain's
//!   acquire of what the completion released after entering), and the `fetch_or` reads the
//!   newest value of the word (coherence), so it sees the count.
//! - `exit` is `AcqRel`: its release publishes the completion's touches of the array; the
//!   read-modify-writes on a word form one release sequence, so whoever closes the shard later
//!   (an exit's acquire, or the retirer's `fetch_or` with `AcqRel`) has every earlier exit's
//!   touches before it.
//! - `open`'s decrements are `AcqRel` for the same reason: the one that reaches zero has every
//!   closer's history, and so every completion's, before the drop.
//! - The retirer stores the reference (under `kept`'s lock) and `open` before its first
//!   `fetch_or` (`AcqRel`); an exit that closes a shard read that word or a later value, so it
//!   sees both.
//!
//! The loom models are in `tests/loom_retire.rs`.

use blkq_sync::atomic::{AtomicUsize, Ordering};
use blkq_sync::{CachePadded, Mutex};

const CLOSED: usize = 1;
const ONE: usize = 2;

/// The completions in progress per thread shard, and the hand-over of the owner's reference
/// to whoever is last out (see the module docs).
pub struct Retirement<T> {
    shards: Box<[CachePadded<AtomicUsize>]>,
    /// Closes still to come once retirement began (shards + the retirer's own).
    open: AtomicUsize,
    /// The owner's reference, from `retire` until the last one out takes it.
    kept: Mutex<Option<T>>,
}

/// A completion's place while it is inside (from [`Retirement::enter`] to
/// [`Retirement::exit`]).
#[must_use = "a completion that entered must exit"]
pub struct Inside(usize);

impl<T> Retirement<T> {
    /// `shards` counts (a power of two: the shard is the thread's slot masked).
    pub fn new(shards: usize) -> Self {
        assert!(shards.is_power_of_two(), "shards must be a power of two");
        Self {
            shards: (0..shards)
                .map(|_| CachePadded(AtomicUsize::new(0)))
                .collect(),
            open: AtomicUsize::new(0),
            kept: Mutex::new(None),
        }
    }

    /// A completion comes in, counted on shard `slot` (masked). Call before the first touch of
    /// what the owner's reference keeps alive.
    #[inline]
    pub fn enter(&self, slot: usize) -> Inside {
        let s = slot & (self.shards.len() - 1);
        // Relaxed: invariant 2 orders it before the retirer's `fetch_or`.
        self.shards[s].fetch_add(ONE, Ordering::Relaxed);
        Inside(s)
    }

    /// The completion is out: after this it touches nothing of the owner's (invariant 5),
    /// unless this returns the reference, which the caller then drops (the last one out).
    #[inline]
    pub fn exit(&self, inside: Inside) -> Option<T> {
        let prev = self.shards[inside.0].fetch_sub(ONE, Ordering::AcqRel);
        if prev != ONE | CLOSED {
            return None;
        }
        // This exit closed its shard (invariant 3).
        self.close()
    }

    /// The owner's end of life: hands over its reference, which comes back here if nothing
    /// is inside (the caller drops it), or is dropped by the last completion out.
    pub fn retire(&self, reference: T) -> Option<T> {
        *self.kept.lock() = Some(reference);
        self.open.store(self.shards.len() + 1, Ordering::Relaxed);
        for s in self.shards.iter() {
            // AcqRel: publishes `kept` and `open` to the exit that closes this shard later;
            // acquires the exits that emptied it.
            let prev = s.fetch_or(CLOSED, Ordering::AcqRel);
            debug_assert_eq!(prev & CLOSED, 0, "retired twice");
            if prev == 0 {
                // Nobody inside: closed here. Not the last: the retirer's own count is left.
                let left = self.open.fetch_sub(1, Ordering::AcqRel);
                debug_assert!(left > 1);
            }
        }
        self.close()
    }

    /// One close (invariant 4): the one that reaches zero takes the reference.
    fn close(&self) -> Option<T> {
        if self.open.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.kept.lock().take()
        } else {
            None
        }
    }

    /// Completions inside now, all shards (a test's and a debug check's view).
    pub fn inside(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.load(Ordering::Acquire) >> 1)
            .sum()
    }
}

#[cfg(all(test, not(blkq_loom)))]
mod tests {
    use super::*;

    #[test]
    fn nothing_inside_gives_the_reference_back_to_the_retirer() {
        let r = Retirement::new(4);
        let i = r.enter(1);
        assert!(r.exit(i).is_none());
        assert_eq!(r.retire(7), Some(7));
    }

    #[test]
    fn the_last_completion_out_gets_the_reference() {
        let r = Retirement::new(4);
        let a = r.enter(0);
        let b = r.enter(2);
        let c = r.enter(2);
        assert!(r.retire("array").is_none());
        assert_eq!(r.inside(), 3);
        assert!(r.exit(c).is_none());
        assert!(r.exit(a).is_none());
        assert_eq!(r.exit(b), Some("array"));
        assert_eq!(r.inside(), 0);
    }

    #[test]
    fn a_retirement_from_inside_a_completion_is_finished_by_its_exit() {
        let r = Retirement::new(2);
        let me = r.enter(5);
        assert!(r.retire(1u8).is_none());
        assert_eq!(r.exit(me), Some(1));
    }
}
