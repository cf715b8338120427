//! The per-I/O slots (md's r1bio pool): `depth` preallocated [`Io`] records, the set of the
//! free ones, the wait for one, and the retry queue of the failed reads that keep theirs until
//! raid1d has handled them. The fields are private: `io.rs`, `daemon.rs` and the rest take,
//! fill, lock and give back slots through the methods below.
//!
//! A slot's life: [`Slots::get`] (waiting, never while admitted by the barrier: see there),
//! [`Slots::start`] (the I/O's record, its bios carry the slot's index as their cookie), the
//! leg completions lock it ([`Slots::by_cookie`]), and then either the I/O ends (the record is
//! reset to [`IoKind::Free`] and [`Slots::put`] gives the slot back) or a failed read waits on the
//! retry queue ([`Slots::queue_retry`]) for raid1d ([`Slots::next_retry`]), which resets and
//! gives it back. No allocation: the records, the free set and the queue are sized for `depth`
//! at start-up (a slot is on the queue at most once).
//!
//! (Not to be confused with `slot.rs`, a leg slot's device cell.)

use std::collections::VecDeque;

use blk::{Bio, EndIo, Error};
use blkq_sync::DynArc as StdArc;
use blkq_sync::{CachePadded, Mutex, MutexGuard};
use sbitmap::Sbitmap;
use waitq::WaitQueue;

use crate::legset::LegSet;
use crate::lend::Lent;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) enum IoKind {
    #[default]
    Free,
    Read,
    Write,
    Flush,
}

/// Per-I/O state, preallocated (md's r1bio).
#[derive(Default)]
pub(crate) struct Io {
    pub(crate) kind: IoKind,
    /// The caller's bio; with `share_writes`, its buffer is lent to the write's legs (see
    /// `lend`) and comes back only when none still reads it.
    pub(crate) orig: Lent<Bio>,
    pub(crate) end: Option<StdArc<dyn EndIo>>,
    pub(crate) remaining: u32,
    pub(crate) ok: u32,
    pub(crate) err: Option<Error>,
    /// Legs a read was tried on.
    pub(crate) tried: LegSet,
    /// Legs whose success makes a write or flush succeed: the in-sync legs when it was
    /// submitted (md's rule: a recovering leg's copy does not count).
    pub(crate) counted: LegSet,
    /// The leg whose bio carries the original buffer (`usize::MAX`: none, e.g. a shared
    /// write, whose buffer stays in `orig`).
    pub(crate) primary: usize,
    /// Write-behind legs of this write or flush (see `behind`).
    pub(crate) wb_legs: LegSet,
    /// A write holding a place among the N (see `behind`).
    pub(crate) behind: bool,
    /// Legs not write-behind still to complete.
    pub(crate) sync_left: u32,
    /// Legs whose completion of this write the write-behind order table counts (invariant
    /// 7 of `behind`): `leg_done` calls `ordered_done` for them.
    pub(crate) ordered: LegSet,
    /// The caller was completed before the write-behind legs (`orig` is gone: `span` says
    /// what the write covered).
    pub(crate) acked: bool,
    /// A write's first sector and length, for its late bookkeeping.
    pub(crate) span: (u64, u32),
    /// When its leg bios were submitted (`blk::stats::batch_ns`), for the legs' round trips.
    pub(crate) sent_ns: u64,
}

/// The per-I/O slots (see the module docs).
pub(crate) struct Slots {
    /// One line pair each: neighbouring slots are used by different submitters at once.
    ios: Box<[CachePadded<Mutex<Io>>]>,
    /// The free slots (indices into `ios`): a scalable tag bitmap with per-thread hints, so
    /// that taking and giving back a slot shares no lock or line between submitters.
    /// Invariant: a slot is in the set exactly when no I/O owns it, and then its record is
    /// [`IoKind::Free`].
    free: Sbitmap,
    /// Submitters waiting for a free slot.
    free_wq: WaitQueue,
    /// Failed reads waiting for raid1d (each keeps its slot meanwhile; at most once each).
    retry: Mutex<VecDeque<u32>>,
}

impl Slots {
    /// `depth` free slots.
    pub(crate) fn new(depth: usize) -> Result<Self, sbitmap::Error> {
        let free = Sbitmap::new(depth as u32, None, false)?;
        Ok(Self {
            ios: (0..depth)
                .map(|_| CachePadded(Mutex::new(Io::default())))
                .collect(),
            free,
            free_wq: WaitQueue::new(),
            retry: Mutex::new(VecDeque::with_capacity(depth)),
        })
    }

    /// A free slot, waiting for one if all are in use. Never called holding a barrier
    /// admission: failed reads keep their slots until raid1d, which freezes the array to fix
    /// them, gives them back, and a freeze waits for every admission, so an admitted waiter
    /// for a slot would wait for raid1d while raid1d waits for it.
    pub(crate) fn get(&self) -> u32 {
        let id = self.free_wq.wait_for(|| self.free.get());
        debug_assert!((id as usize) < self.ios.len(), "slot {id} beyond the depth");
        id
    }

    /// Gives slot `id` back (its record reset to [`IoKind::Free`] by its last user).
    pub(crate) fn put(&self, id: u32) {
        // The record is free before the slot is: the next owner finds it so (`start`). The
        // caller holds no slot lock here (every caller drops it before).
        debug_assert_eq!(
            self.ios[id as usize].lock().kind,
            IoKind::Free,
            "slot {id} given back while its I/O is in use"
        );
        // `put` orders the slot's last use before its next owner's `get` (Release, see
        // `sbitmap`); `wake_one`'s fence orders the free bit before its look for waiters.
        let r = self.free.put(id);
        debug_assert!(r, "slot {id} given back twice");
        self.free_wq.wake_one();
    }

    /// Fills the record of slot `id` (just taken with [`Slots::get`]) with `io`, returning
    /// it locked.
    pub(crate) fn start(&self, id: u32, io: Io) -> MutexGuard<'_, Io> {
        debug_assert_ne!(io.kind, IoKind::Free, "slot {id} started with no I/O");
        let mut g = self.ios[id as usize].lock();
        // A slot taken from the free set is free (the set never hands one out twice).
        debug_assert_eq!(g.kind, IoKind::Free, "slot {id} taken while in use");
        *g = io;
        g
    }

    /// Takes the record out of slot `id` (leaving it [`IoKind::Free`]): its I/O is done with
    /// the slot, which [`Slots::put`] may now give back.
    pub(crate) fn take(&self, id: u32) -> Io {
        let io = std::mem::take(&mut *self.ios[id as usize].lock());
        debug_assert_ne!(io.kind, IoKind::Free, "slot {id} emptied while free");
        io
    }

    /// The slot a leg bio's cookie names, with its index (None: not one of ours).
    #[inline]
    pub(crate) fn by_cookie(&self, cookie: u64) -> Option<(u32, &Mutex<Io>)> {
        let slot = self.ios.get(usize::try_from(cookie).ok()?)?;
        Some((cookie as u32, slot))
    }

    /// Puts the failed read in slot `id` on raid1d's retry queue; `queued` runs under the
    /// queue's lock first (the read's admission is marked queued there, so raid1d cannot take
    /// it before it is, and a freezer that saw it queued finds it on the queue).
    pub(crate) fn queue_retry(&self, id: u32, queued: impl FnOnce()) {
        let mut q = self.retry.lock();
        debug_assert!(!q.contains(&id), "slot {id} queued for a retry twice");
        queued();
        q.push_back(id);
    }

    /// raid1d: the next failed read to retry.
    pub(crate) fn next_retry(&self) -> Option<u32> {
        self.retry.lock().pop_front()
    }

    /// Whether a failed read waits for raid1d.
    pub(crate) fn retry_waiting(&self) -> bool {
        !self.retry.lock().is_empty()
    }
}

#[cfg(all(test, not(blkq_loom)))]
mod tests {
    use super::*;

    #[test]
    #[cfg_attr(debug_assertions, should_panic(expected = "given back twice"))]
    fn a_slot_given_back_twice_asserts_in_debug_builds() {
        let s = Slots::new(4).unwrap();
        let id = s.get();
        s.put(id);
        s.put(id);
    }

    #[test]
    #[cfg_attr(
        debug_assertions,
        should_panic(expected = "given back while its I/O is in use")
    )]
    fn a_slot_given_back_in_use_asserts_in_debug_builds() {
        let s = Slots::new(4).unwrap();
        let id = s.get();
        drop(s.start(
            id,
            Io {
                kind: IoKind::Read,
                ..Io::default()
            },
        ));
        s.put(id);
    }
}
