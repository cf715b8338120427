//! A value read on the regular I/O path without a lock, written only with the array frozen:
//! how a leg's device reaches a submitter without a per-I/O lock or reference count.
//!
//! Each leg keeps its device twice: behind a mutex (`Leg::dev`, for the slow paths: raid1d,
//! the sync thread, flushes, tools) and in an [`AdmittedCell`] (for `submit_read` and
//! `submit_write`). Before, every regular I/O locked the leg's mutex and cloned the `Arc`:
//! four atomic read-modify-writes on two cache lines that every submitter of the array shares,
//! per leg, per I/O. Now a submitter only reads the cell.
//!
//! # The rule: the barrier is the lock
//!
//! | side   | may touch the cell while                                                    |
//! |--------|------------------------------------------------------------------------------|
//! | reader | it holds a barrier admission on some bucket that is not queued (`nr_pending`  |
//! |        | counts it, `nr_queued` does not), for the whole time it uses the reference   |
//! | writer | it has frozen the array with `freeze_array(0)` and holds the leg's mutex      |
//!
//! `freeze_array(0)` returns only once every pending admission is queued, and holds new ones
//! off until `unfreeze_array`; so a writer never overlaps a reader, and writers are ordered by
//! the mutex. Happens-before comes from the barrier's own orderings: a reader's last use of the
//! reference precedes its `allow_barrier` (a Release decrement), which precedes the freezer's
//! Acquire read of the sum; the writer's store precedes `unfreeze_array` (Release), which the
//! next reader's Acquire load of `array_frozen` observes. A reader that passed the fast path on
//! the `array_frozen == 0` from before the freeze is seen by the freezer (rules 1 and 2 of
//! `barrier`: the Dekker pair of SeqCst fences) and waited for.
//!
//! # The trap: the I/O's admission can end before the submitter is done with the reference
//!
//! A leg may complete a bio inline, inside `Device::submit`: the completion then ends the
//! I/O's admission (`allow_barrier`) or queues it for a retry (`queue_io`) while the submitter
//! is still inside the leg's `submit`, holding a reference into the cell. A freezer could then
//! pass and the writer drop the device under it. So the submitter takes an admission of its own
//! for the duration of the submission ([`crate::Barriers::hold`], a second count on the bucket
//! it is already admitted to) and ends it after the last `submit` returns. The loom models in
//! `tests/loom_slot.rs` check both rules, and that the model without the submitter's own
//! admission fails.

use blkq_sync::UnsafeCell;

/// A value read by barrier-admitted I/O without a lock, replaced only with the array frozen.
/// See the module docs for the rule.
#[derive(Debug, Default)]
pub struct AdmittedCell<T> {
    cell: UnsafeCell<T>,
}

// SAFETY: shared access to the value is only through `with_admitted` (which hands out `&T`,
// so `T: Sync` is needed) and replacement moves a `T` across threads (`T: Send`); the barrier
// protocol in the module docs keeps readers and writers apart.
unsafe impl<T: Send + Sync> Sync for AdmittedCell<T> {}

impl<T> AdmittedCell<T> {
    /// A cell holding `value`.
    pub fn new(value: T) -> Self {
        Self {
            cell: UnsafeCell::new(value),
        }
    }

    /// Runs `f` with the value.
    ///
    /// # Safety
    ///
    /// The caller holds, for the whole call, a barrier admission of the array this cell
    /// belongs to that is not queued (see the module docs), so no writer runs meanwhile.
    #[inline]
    pub unsafe fn with_admitted<R>(&self, f: impl FnOnce(&T) -> R) -> R {
        // SAFETY: by the caller's admission no `replace_frozen` overlaps this call, and the
        // barrier's orderings make the last replacement happen before it (module docs).
        self.cell.with(|p| f(unsafe { &*p }))
    }

    /// Replaces the value, returning the old one.
    ///
    /// # Safety
    ///
    /// The caller has frozen the array with `freeze_array(0)` (not yet unfrozen) and holds the
    /// lock that orders writers of this cell, so no reader and no other writer runs meanwhile.
    pub unsafe fn replace_frozen(&self, value: T) -> T {
        // SAFETY: the freeze excludes every reader and the caller's lock every other writer.
        self.cell
            .with_mut(|p| std::mem::replace(unsafe { &mut *p }, value))
    }

    /// Replaces the value through exclusive access (construction).
    pub fn set(&mut self, value: T) {
        // SAFETY: `&mut self`: nobody else can reach the cell.
        self.cell.with_mut(|p| unsafe { *p = value });
    }
}
