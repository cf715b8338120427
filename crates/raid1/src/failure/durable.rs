//! The array's failure and durable state, a part that owns its fields: the failure
//! generations (`fail_gen`, `durable_gen`) and the lock that orders them with the legs' FAULTY
//! bits, the writes held until a failure is durable, the failed array's flag and reason, and
//! the "superblocks need writing" flag. `failure.rs` (failing a leg, failing the array) and
//! `daemon.rs` (the superblock writes) act through the methods below; no other file touches
//! the fields. Its one rule:
//!
//! **A write or flush that completes while a leg failure is not durable is not acknowledged
//! until it is**: until a superblock recording the failure is durable on the survivors
//! (`durable_gen >= fail_gen` as of the failure), a crash would assemble the failed leg back
//! in sync, and a resync could copy its stale data over theirs (md's `MD_SB_CHANGE_PENDING`).
//! Such a write is held ([`DurableState::hold`]) for raid1d, which writes the superblocks and
//! only then completes it.

use std::collections::VecDeque;

use blk::Error;
use blkq_sync::atomic::{AtomicBool, AtomicU64, Ordering};
use blkq_sync::{Mutex, MutexGuard};

/// The failure and durable state (see the module docs).
pub(crate) struct DurableState {
    /// Serialises leg failures (two legs failing at once cannot both see the other as the
    /// survivor) and orders `fail_gen`'s bumps with the FAULTY bits: a failure bumps
    /// `fail_gen` and sets its leg's bit under it, and the superblock writer reads `fail_gen`
    /// under it ([`DurableState::counted_gen`]), so every failure it counts has its bit set
    /// before the superblocks are built from the leg states.
    fail_lock: Mutex<()>,
    /// Leg failures so far: bumped (Release) under `fail_lock` before the FAULTY bit is set
    /// (AcqRel). A submitter that sees FAULTY (Acquire) and so leaves the leg out of a write
    /// therefore sees the bump when it completes ([`DurableState::pending`], Acquire), and
    /// holds the write. Never decreases.
    fail_gen: AtomicU64,
    /// The `fail_gen` that the last fully successful superblock write recorded (AcqRel
    /// `fetch_max`, Acquire loads). Never decreases, never passes `fail_gen`.
    durable_gen: AtomicU64,
    /// Writes and flushes (their slots) that succeeded while a leg failure was not yet
    /// durable: raid1d completes them after the next superblock write (md's
    /// `bio_end_io_list`). Preallocated for `depth`; a slot is on it at most once.
    held: Mutex<VecDeque<u32>>,
    /// Set once the array can no longer keep its promises (see `Array::fail_array`). Never
    /// cleared. Release (swap AcqRel) after `failed_why` is written: a reader that sees it
    /// (Acquire) sees the reason.
    failed: AtomicBool,
    /// Why, for the error and the log (the first reason; written before `failed` is set).
    failed_why: Mutex<Option<&'static str>>,
    /// The superblocks need writing (a state change since the last write): set Release by
    /// the changes, cleared Release by the writer before it builds them (under `persist`), so
    /// a change after the clear is either in the write or sets it again.
    sb_dirty: AtomicBool,
}

/// A leg failure in progress: `fail_lock` held (see [`DurableState::begin_failure`]).
pub(crate) struct Failing<'a> {
    st: &'a DurableState,
    _g: MutexGuard<'a, ()>,
}

impl Failing<'_> {
    /// Counts the failure (bumps `fail_gen`, Release): called before the leg's FAULTY bit is
    /// set, under the same lock.
    pub(crate) fn count(&self) {
        self.st.fail_gen.fetch_add(1, Ordering::Release);
    }
}

impl DurableState {
    /// Nothing failed, nothing held, room for `depth` held writes.
    pub(crate) fn new(depth: usize) -> Self {
        Self {
            fail_lock: Mutex::new(()),
            fail_gen: AtomicU64::new(0),
            durable_gen: AtomicU64::new(0),
            held: Mutex::new(VecDeque::with_capacity(depth)),
            failed: AtomicBool::new(false),
            failed_why: Mutex::new(None),
            sb_dirty: AtomicBool::new(false),
        }
    }

    /// Takes `fail_lock` for a leg failure (the decision and the FAULTY bit under it).
    pub(crate) fn begin_failure(&self) -> Failing<'_> {
        Failing {
            st: self,
            _g: self.fail_lock.lock(),
        }
    }

    /// The superblock writer: the failures counted so far, read under `fail_lock`, so each has
    /// set its FAULTY bit and the superblocks built next record it.
    pub(crate) fn counted_gen(&self) -> u64 {
        let _f = self.fail_lock.lock();
        self.fail_gen.load(Ordering::Acquire)
    }

    /// A superblock write that started at `counted_gen() == gen` completed on every writable
    /// leg: the failures up to `gen` are durable.
    pub(crate) fn mark_durable(&self, gen: u64) {
        assert!(
            gen <= self.fail_gen.load(Ordering::Acquire),
            "durable generation {gen} beyond the failures counted"
        );
        let before = self.durable_gen.fetch_max(gen, Ordering::AcqRel);
        // Superblock writes are serialised (`persist`) and each reads `fail_gen`, which never
        // decreases, after the previous one recorded its own: none records an older one.
        assert!(
            before <= gen,
            "durable generation moving backwards ({before} to {gen})"
        );
    }

    /// Whether a failure is not yet recorded by a durable superblock: a write or flush that
    /// completes now is held.
    #[inline]
    pub(crate) fn pending(&self) -> bool {
        let durable = self.durable_gen.load(Ordering::Acquire);
        let gen = self.fail_gen.load(Ordering::Acquire);
        // `durable_gen` is loaded first: a `mark_durable` between the loads only raises it
        // to a `fail_gen` at most the one loaded second.
        debug_assert!(durable <= gen, "durable generation {durable} beyond {gen}");
        gen > durable
    }

    /// Holds the write or flush in slot `id` for raid1d; `queued` runs under the list's lock
    /// first (its admissions are marked queued there, so raid1d cannot take it before they
    /// are, and a freezer that saw them queued finds it on the list).
    pub(crate) fn hold(&self, id: u32, queued: impl FnOnce()) {
        let mut q = self.held.lock();
        debug_assert!(!q.contains(&id), "slot {id} held twice");
        queued();
        q.push_back(id);
    }

    /// raid1d: every held write and flush, to complete after a superblock write.
    pub(crate) fn take_held(&self) -> Vec<u32> {
        self.held.lock().drain(..).collect()
    }

    /// Whether a write or flush is held.
    pub(crate) fn held_waiting(&self) -> bool {
        !self.held.lock().is_empty()
    }

    /// Fails the array for `why` (the first reason is kept); returns whether it was working.
    pub(crate) fn fail(&self, why: &'static str) -> bool {
        {
            let mut w = self.failed_why.lock();
            if w.is_none() {
                *w = Some(why);
            }
        }
        // Release: a caller that sees the flag sees the reason.
        let was = self.failed.swap(true, Ordering::AcqRel);
        !was
    }

    /// Whether the array has failed.
    #[inline]
    pub(crate) fn is_failed(&self) -> bool {
        self.failed.load(Ordering::Acquire)
    }

    /// Why the array failed, or None while it works.
    pub(crate) fn why(&self) -> Option<&'static str> {
        if !self.is_failed() {
            return None;
        }
        let why = *self.failed_why.lock();
        assert!(why.is_some(), "the array failed without a reason");
        why
    }

    /// The error of a failed array, or None.
    #[inline]
    pub(crate) fn error(&self) -> Option<Error> {
        let why = self.why()?;
        Some(Error::Io(std::io::Error::other(format!(
            "raid1: array failed: {why}"
        ))))
    }

    /// The superblocks need writing.
    pub(crate) fn set_dirty(&self) {
        self.sb_dirty.store(true, Ordering::Release);
    }

    /// The superblock writer, before it builds them: clears the flag.
    pub(crate) fn clear_dirty(&self) {
        self.sb_dirty.store(false, Ordering::Release);
    }

    /// Whether the superblocks need writing.
    pub(crate) fn is_dirty(&self) -> bool {
        self.sb_dirty.load(Ordering::Acquire)
    }
}

#[cfg(all(test, not(blkq_loom)))]
mod tests {
    use super::*;

    #[test]
    fn a_failure_is_pending_until_a_superblock_records_it() {
        let d = DurableState::new(4);
        assert!(!d.pending());
        d.begin_failure().count();
        assert!(d.pending());
        let gen = d.counted_gen();
        d.mark_durable(gen);
        assert!(!d.pending());
    }

    #[test]
    #[should_panic(expected = "beyond the failures counted")]
    fn a_durable_generation_beyond_the_failures_asserts() {
        let d = DurableState::new(4);
        d.begin_failure().count();
        d.mark_durable(2);
    }

    #[test]
    #[should_panic(expected = "moving backwards")]
    fn the_durable_generation_moving_backwards_asserts() {
        let d = DurableState::new(4);
        d.begin_failure().count();
        d.begin_failure().count();
        d.mark_durable(2);
        d.mark_durable(1);
    }
}
