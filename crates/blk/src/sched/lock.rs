//! The lock around a scheduler's state, in designs switchable at run time (`locked`, and the
//! "serialized dispatch, contended inserters hand off to the holder" idea in two variants,
//! `serialized` and `serialized-leave`).
//!
//! # `locked`
//!
//! One mutex around all of the state, taken by every insert and every dispatch: what mq-deadline
//! did before dispatch was serialized, and where 70% of the CPU went with four submitters.
//!
//! # `serialized`
//!
//! At most one thread *owns* the state at a time (the `owner` flag). No inserter waits for it:
//!
//! - an **inserter** that finds it owned puts its whole batch into one of N *buckets* (a small
//!   mutex-protected vector, chosen by thread slot, preallocated), marks the bucket in
//!   `pending`, and returns;
//! - a **dispatcher** that finds it owned *stands by* if nobody else does (the `standby` slot):
//!   it spins (yielding now and then) until the owner, at the end of its current round, hands
//!   it ownership directly, and then runs its own rounds; but for at most `STANDBY_SPINS`
//!   checks: then it gives the slot back (a CAS `WAITING -> IDLE` that races `hand_off`'s
//!   `WAITING -> HANDED`, so exactly one of them wins) and leaves as below. Past that bound
//!   the owner is likely off the CPU (more dispatchers than CPUs), and spinning only takes the
//!   CPU it needs: on 2 vCPUs with 8 jobs the unbounded stand-by ran at 0.55x `locked`, the
//!   bounded one at 1.0x-1.5x (docs/bench.md section 7). A dispatcher that finds the slot
//!   taken leaves a note (`RERUN` in `pending`) and returns: the owner (or the one standing
//!   by) runs one more dispatch round for it;
//! - the **owner** drains the buckets into the state before it works on it. At the end of a
//!   dispatch round it hands ownership to the dispatcher standing by, if there is one, and
//!   returns; otherwise it gives ownership up and checks `pending` once more (the re-check
//!   below): if anything was published meanwhile it takes ownership again and drains.
//!
//! So no request waits in a bucket longer than the current owner's round, and no inserter ever
//! waits behind a dispatcher: the only waits left are on a bucket's mutex (held for a `Vec`
//! push or swap), the stand-by's wait of at most one round, and, with a scheduler's `stats`,
//! on the state mutex.
//!
//! **Why the stand-by** (the owner's work for others, bounded). With inline completions (a
//! driver that completes in `queue_rq`), whoever dispatches a request also completes it and
//! runs its submitter's `end_io`. In `serialized-leave` (kept for comparison: every
//! contended dispatcher leaves) the owner runs rounds until the state is
//! empty, dispatching and completing every other submitter's requests while those submitters
//! have already returned: they get their completions back a few at a time, as the owner's
//! rounds reach them, and submit smaller batches (at 4 jobs, 0.96 lock attempts per I/O
//! against 0.31 for `locked`, and 12% fewer IOPS). In `serialized` a contended dispatcher does not return before
//! the state has been worked on after its insert: it takes over at the end of the owner's
//! round, and an owner runs at most one round while someone waits to take over. Only one
//! thread stands by at a time, so at most one thread spins; the others leave as before.
//!
//! The state itself still sits in a [`Mutex`]: in `serialized` mode only the owner takes it,
//! so it is never contended there (one uncontended CAS and one store per round), and it keeps
//! the state's accesses free of `unsafe`. It is also what lets the two modes be switched while
//! I/O is in flight: a `locked` thread and a `serialized` owner exclude each other through it,
//! and `locked` holders drain the buckets too (what a `serialized` inserter left there just
//! before the switch).
//!
//! # State of the atomics
//!
//! | atomic    | value                       | meaning                                           |
//! |-----------|-----------------------------|---------------------------------------------------|
//! | `owner`   | `false`                     | nobody owns the state (`serialized` mode)         |
//! |           | `true`                      | one thread owns it: it alone drains buckets and   |
//! |           |                             | works on the state, until it stores `false`       |
//! | `pending` | bit `i < N` set             | bucket `i` may hold requests (invariant B)        |
//! |           | bit 63 (`RERUN`) set        | a dispatcher left while the state was owned: the  |
//! |           |                             | owner must run one more dispatch round            |
//! |           | `0`                         | nothing published since the last drain            |
//! | `standby` | `IDLE`                      | nobody stands by                                  |
//! |           | `WAITING`                   | one dispatcher stands by for ownership            |
//! |           | `HANDED`                    | the owner handed it ownership (`owner` stays      |
//! |           |                             | `true`): it owns the state from its Acquire load  |
//! | `mode`    | 0 `locked`, 1 `serialized`, | read once per call; may change at any time        |
//! |           | 2 `serialized-leave`        |                                                   |
//!
//! Transitions: `owner` false -> true only by a successful `compare_exchange` (Acquire);
//! true -> false only by the owner's `store` (Release). `standby` `IDLE` -> `WAITING` only by a
//! contended dispatcher's `compare_exchange` (Relaxed: the slot carries nothing yet);
//! `WAITING` -> `HANDED` only by the owner's `compare_exchange` at the end of a dispatch round
//! (Release), after which that thread no longer owns the state and does not touch `owner`;
//! back to `IDLE` only by the thread standing by, once it owns the state (by the `HANDED` load,
//! Acquire, or by taking a free `owner` flag). So `HANDED` is only ever written while `owner`
//! is `true`, and only the thread standing by can then become the owner: ownership passes
//! without `owner` ever being `false`. `pending` bits are set by `fetch_or`
//! (Release) and cleared only by an owner's (or `locked` holder's) `swap(0)` (Acquire), which is
//! followed by draining every bucket whose bit it cleared.
//!
//! **Invariant B.** A bucket holds requests only if its bit is set in `pending`, or the
//! thread that cleared the bit is still between its `swap` and the drain of that bucket. It
//! holds because a punting inserter pushes and sets the bit while holding the bucket's mutex,
//! and the drainer swaps the bit away *before* it takes the bucket's contents (under the same
//! mutex): an item pushed after the swap sets the bit again.
//!
//! # Ordering: the lost-request race and how it is closed
//!
//! The race: an inserter finds the state owned and punts to a bucket just as the owner
//! finishes draining and gives ownership up. Without care, the inserter sees "owned" and
//! leaves, the owner sees "nothing pending" and leaves, and the request stays in the bucket
//! until some later I/O comes by (forever, if none does). It is the store-buffer (Dekker)
//! pattern, closed with a `SeqCst` fence on each side (Relaxed accesses around them):
//!
//! ```text
//!  inserter (or leaving dispatcher)          owner giving up
//!  P: push; pending |= bit   (Release)        R: owner = false    (Release)
//!  F1: fence(SeqCst)                          F2: fence(SeqCst)
//!  T: owner false -> true ?  (CAS)            L: pending != 0 ?   (then CAS owner again)
//! ```
//!
//! F1 and F2 are ordered in the single total order of `SeqCst` fences. If F1 comes first, L
//! reads P's bit (or a later value of `pending`, whose writer, an owner's `swap`, drained the
//! bucket: invariant B). If F2 comes first, T reads R's `false` (or a later value: a newer
//! owner, who runs this same re-check when it gives up). Either the inserter becomes the
//! owner and drains its own bucket, or an owner sees the bit and drains it.
//!
//! A hand-off to the thread standing by does not change this: it writes nothing to `owner`,
//! so the `true` that T read belongs to a chain of owners (one `compare_exchange`, then
//! hand-offs) that ends with one store R and its re-check; that last owner plays the owner's
//! part above. (Every owner of the chain drains when it starts, so the bit is usually drained
//! long before.) The hand-off itself is a Release/Acquire pair on `standby`, which orders the
//! old owner's work on the state before the new owner's, as `owner`'s pair does otherwise. **We must fence
//! between publishing and trying the owner flag so that the owner's re-check, after its own
//! fence, cannot miss the publication; and the owner must fence between releasing and
//! re-checking so that an inserter that still saw "owned" is seen in turn.** (Loom models
//! `SeqCst` fences but treats `SeqCst` loads and stores as `AcqRel`; see docs/design.md.)
//!
//! What the loom model (`tests/loom_deadline.rs`, in `serialized-leave`, where every
//! contended dispatcher leaves) shows about these fences: without F2, or without both F1s (the
//! punting inserter's and the leaving dispatcher's), it finds the lost request. (In
//! `serialized` a two-thread model cannot lose it: the contended dispatcher stands by and
//! becomes the owner itself; the race needs a third thread that finds the slot taken.) Without only the inserter's F1 it does not, because the queue follows every
//! insert with a dispatch, whose "leave a note, F1, try again" repeats the publication; the
//! inserter's F1 is kept so that `insert` is correct on its own and a punting inserter that
//! finds the owner gone drains at once.
//!
//! The `Release` on `fetch_or` and the `Acquire` on the owner's `swap` make what the publisher
//! did before publishing visible to the drainer (a driver that freed room and then asked for a
//! dispatch round: [`crate::Driver::can_queue`]). The requests themselves are handed over by
//! the bucket's mutex, and the state by the state's mutex and by `owner`'s Release/Acquire.
//!
//! # Liveness: every request is dispatched
//!
//! The queue's contract ([`crate::Scheduler`]) is that a thread that inserts then dispatches
//! until a dispatch hands out nothing. A thread stops only (a) after a dispatch round, as
//! owner, that found nothing to hand out and whose release re-check found `pending == 0`; or
//! (b) after leaving a bucket bit or a `RERUN` note that, by the argument above, an owner
//! sees; that owner drains it and runs a dispatch round for it (a dispatcher at once; an
//! inserter in the dispatch that follows its insert); or (c) after handing ownership to the
//! thread standing by, which owns the state from then on and runs at least one round (with
//! its drain) before it stops by (a), (c), or again by handing off. The stand-by itself waits
//! only for the current owner to end its round or its insert: the owner hands off or gives
//! ownership up at the end of every call, and a free flag is taken by the stand-by's own
//! `compare_exchange` (a racing newcomer may take it first: that one too ends its call). Requests that an owner put into the
//! state are seen by every later owner (the state mutex and `owner`'s Release/Acquire).
//! `tests/loom_deadline.rs` checks all of this, and fails when the re-check is removed.

use std::str::FromStr;

use blkq_sync::atomic::{fence, AtomicBool, AtomicU32, AtomicU64, Ordering};
use blkq_sync::{CachePadded, Mutex, MutexGuard};

use crate::Error;
use blkq_sync::stat::ShardedCounters;

/// Bit of `pending` that asks the owner for one more dispatch round.
const RERUN: u64 = 1 << 63;
/// How long a dispatcher stands by before it gives the slot up and leaves (`stand_by`): 256
/// checks, four of them after a yield (2 under loom, so models reach the give-up).
const STANDBY_SPINS: u32 = if cfg!(blkq_loom) { 2 } else { 64 };

/// `standby`: nobody stands by.
const IDLE: u32 = 0;
/// `standby`: a dispatcher stands by for ownership.
const WAITING: u32 = 1;
/// `standby`: the owner has handed ownership to the dispatcher standing by.
const HANDED: u32 = 2;
/// The most buckets (bits 0..MAX_BUCKETS of `pending`).
pub const MAX_BUCKETS: usize = 32;

/// Indices of the statistics counters.
const ATTEMPTS: usize = 0;
const CONTENDED: usize = 1;
const PUNTED: usize = 2;
const LEFT: usize = 3;
const REACQUIRED: usize = 4;
const OWNER_WAITED: usize = 5;
const HANDED_OFF: usize = 6;

/// Which design guards a scheduler's state (`--sched-lock`, spec option `sched_lock=`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LockMode {
    /// One mutex for insert and dispatch (the classic design).
    Locked,
    /// One owner at a time; inserters punt to buckets; one contended dispatcher stands by and
    /// is handed ownership at the end of the owner's round, the others leave (serialized
    /// dispatch with inserter hand-off, the owner's work for others bounded to one round).
    #[default]
    Serialized,
    /// `serialized` as first built: every contended dispatcher leaves, and the owner runs
    /// rounds until nothing is left, whoever's requests they are (for comparison).
    SerializedLeave,
}

impl LockMode {
    /// `locked`, `serialized` or `serialized-leave`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Locked => "locked",
            Self::Serialized => "serialized",
            Self::SerializedLeave => "serialized-leave",
        }
    }
}

impl FromStr for LockMode {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        match s {
            "locked" => Ok(Self::Locked),
            "serialized" => Ok(Self::Serialized),
            "serialized-leave" => Ok(Self::SerializedLeave),
            _ => Err(Error::Config(format!(
                "unknown scheduler lock {s:?} (expected locked, serialized or serialized-leave)"
            ))),
        }
    }
}

/// Counters of a [`SchedLock`] (sums over threads; the figures that judge lock contention).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LockStats {
    /// Inserts and dispatches: each wants the state once.
    pub attempts: u64,
    /// Attempts that found the state taken: `locked`, the mutex's `try_lock` failed and the
    /// thread blocked; `serialized`, the owner flag was set and the thread punted or left.
    pub contended: u64,
    /// `serialized`: insert batches left in a bucket (part of `contended`).
    pub punted: u64,
    /// `serialized`: dispatches that left a note for the owner (part of `contended`).
    pub left: u64,
    /// `serialized`: times an owner found work published after it gave up, and took the state
    /// again to drain it.
    pub reacquired: u64,
    /// `serialized`: times an owner found the state's mutex taken (by a `locked` thread during
    /// a mode switch, or a statistics read). Outside those, 0: the owner flag alone keeps
    /// owners apart (the loom model checks it).
    pub owner_waited: u64,
    /// `serialized`: rounds at whose end the owner handed ownership to the dispatcher standing
    /// by (instead of running more rounds itself).
    pub handed_off: u64,
}

/// What the lock guards: the scheduler's state and the drain's spare vector.
struct Guarded<S, T> {
    state: S,
    /// Swapped with a bucket's vector when draining, so both keep their capacity.
    spare: Vec<T>,
}

/// A scheduler's state `S` behind the two lock designs; `T` is what is inserted (a request
/// token). See the [module docs](self) for the protocol and its ordering argument.
pub struct SchedLock<S, T> {
    mode: AtomicU32,
    owner: CachePadded<AtomicBool>,
    pending: CachePadded<AtomicU64>,
    /// The stand-by slot (`serialized`): `IDLE`, `WAITING` or `HANDED` (module docs).
    standby: CachePadded<AtomicU32>,
    buckets: Box<[CachePadded<Mutex<Vec<T>>>]>,
    inner: Mutex<Guarded<S, T>>,
    stats: ShardedCounters<7>,
    /// The owner's re-check after giving up (always on; off only to show, in the loom test,
    /// that the model catches the lost request without it).
    recheck: bool,
}

impl<S, T> std::fmt::Debug for SchedLock<S, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SchedLock")
            .field("mode", &self.mode())
            .field("buckets", &self.buckets.len())
            .field("stats", &self.stats())
            .finish()
    }
}

impl<S, T> SchedLock<S, T> {
    /// `state` behind a lock in `mode`, with `buckets` insert buckets (rounded up to a power of
    /// two, at most [`MAX_BUCKETS`]).
    pub fn new(state: S, mode: LockMode, buckets: usize) -> Self {
        let n = buckets.clamp(1, MAX_BUCKETS).next_power_of_two();
        let lock = Self {
            mode: AtomicU32::new(0),
            owner: CachePadded(AtomicBool::new(false)),
            pending: CachePadded(AtomicU64::new(0)),
            standby: CachePadded(AtomicU32::new(IDLE)),
            buckets: (0..n)
                .map(|_| CachePadded(Mutex::new(Vec::new())))
                .collect(),
            inner: Mutex::new(Guarded {
                state,
                spare: Vec::new(),
            }),
            stats: ShardedCounters::new(),
            recheck: true,
        };
        lock.set_mode(mode);
        lock
    }

    /// Gives every bucket (and the drain's spare vector) room for `cap` items: the most that
    /// can ever be queued at once (the queue's request count), so that punting never
    /// allocates.
    pub fn reserve(&self, cap: usize) {
        for b in self.buckets.iter() {
            let mut v = b.lock();
            let more = cap.saturating_sub(v.len());
            v.reserve(more);
        }
        let mut g = self.inner.lock();
        let more = cap.saturating_sub(g.spare.len());
        g.spare.reserve(more);
    }

    /// Turns off the owner's re-check after giving up: a broken protocol, for the loom test
    /// that shows the model finds the lost request. Never use it otherwise.
    #[doc(hidden)]
    pub fn without_recheck(mut self) -> Self {
        self.recheck = false;
        self
    }

    /// The current design.
    pub fn mode(&self) -> LockMode {
        match self.mode.load(Ordering::Relaxed) {
            0 => LockMode::Locked,
            1 => LockMode::Serialized,
            _ => LockMode::SerializedLeave,
        }
    }

    /// Switches the design; safe while inserts and dispatches run (module docs).
    pub fn set_mode(&self, m: LockMode) {
        let v = match m {
            LockMode::Locked => 0,
            LockMode::Serialized => 1,
            LockMode::SerializedLeave => 2,
        };
        self.mode.store(v, Ordering::Relaxed);
    }

    /// The counters.
    pub fn stats(&self) -> LockStats {
        LockStats {
            attempts: self.stats.sum(ATTEMPTS),
            contended: self.stats.sum(CONTENDED),
            punted: self.stats.sum(PUNTED),
            left: self.stats.sum(LEFT),
            reacquired: self.stats.sum(REACQUIRED),
            owner_waited: self.stats.sum(OWNER_WAITED),
            handed_off: self.stats.sum(HANDED_OFF),
        }
    }

    /// Items waiting in buckets right now.
    pub fn in_buckets(&self) -> usize {
        self.buckets.iter().map(|b| b.lock().len()).sum()
    }

    /// Runs `f` on the state under the mutex, outside the insert/dispatch protocol (for
    /// statistics and set-up: `f` must not insert or remove items).
    pub fn with_state<R>(&self, f: impl FnOnce(&mut S) -> R) -> R {
        f(&mut self.inner.lock().state)
    }

    /// Inserts `items` into the state with `ins` (which is also what drained bucket items go
    /// through). `serialized`: never waits for the owner.
    pub fn insert<I: Iterator<Item = T>>(&self, items: I, mut ins: impl FnMut(&mut S, T)) {
        self.stats.add(ATTEMPTS, 1);
        if self.mode() == LockMode::Locked {
            let mut g = self.lock_counted();
            let g = &mut *g;
            self.drain(g, &mut ins);
            for t in items {
                ins(&mut g.state, t);
            }
            return;
        }
        if self.try_own() {
            {
                let mut g = self.lock_owned();
                let g = &mut *g;
                self.drain(g, &mut ins);
                for t in items {
                    ins(&mut g.state, t);
                }
            }
            if self.release() {
                self.own_and_drain(&mut ins);
            }
            return;
        }
        self.stats.add(CONTENDED, 1);
        self.stats.add(PUNTED, 1);
        let i = blkq_sync::thread_slot() & (self.buckets.len() - 1);
        {
            let mut b = self.buckets[i].lock();
            b.extend(items);
            // P: the bit is set with the items, under the bucket's mutex (invariant B).
            // Release: what we did before is visible to the owner that swaps it (Acquire).
            self.pending.fetch_or(1 << i, Ordering::Release);
        }
        // F1: we must fence between publishing and trying the owner flag, so that either we
        // see the owner's release (T below) or the owner's re-check (after its fence F2) sees
        // our bit (module docs).
        fence(Ordering::SeqCst);
        if self.try_own() {
            self.own_and_drain(&mut ins);
        }
    }

    /// A dispatch round: drains the buckets with `ins`, then runs `f` on the state (which
    /// takes requests out). `f` may run more than once (after a re-acquisition), and must then
    /// take what is left of its budget. Returns whether `f` ran; `false` means another thread
    /// owns the state and will run a round for us (`serialized`).
    pub fn dispatch(&self, mut ins: impl FnMut(&mut S, T), mut f: impl FnMut(&mut S)) -> bool {
        self.stats.add(ATTEMPTS, 1);
        let mode = self.mode();
        if mode == LockMode::Locked {
            let mut g = self.lock_counted();
            let g = &mut *g;
            self.drain(g, &mut ins);
            f(&mut g.state);
            return true;
        }
        let hand_off = mode == LockMode::Serialized;
        if !self.try_own() {
            self.stats.add(CONTENDED, 1);
            // `serialized`: stand by for the owner's hand-off if nobody else does.
            if !(hand_off && self.stand_by()) {
                // The owner is busy: leave it a note (one RMW, skipped if a note is already
                // there). Release, as for a bucket bit.
                if self.pending.load(Ordering::Relaxed) & RERUN == 0 {
                    self.pending.fetch_or(RERUN, Ordering::Release);
                }
                // F1 again: the note is published before we look at the owner flag (module
                // docs).
                fence(Ordering::SeqCst);
                if !self.try_own() {
                    self.stats.add(LEFT, 1);
                    return false;
                }
            }
        }
        loop {
            {
                let mut g = self.lock_owned();
                let g = &mut *g;
                self.drain(g, &mut ins);
                f(&mut g.state);
            }
            if hand_off && self.hand_off() {
                return true;
            }
            if !self.release() {
                return true;
            }
        }
    }

    /// `serialized`, a dispatcher that found the state owned: takes the stand-by slot if it is
    /// free and waits (spinning, yielding now and then) until it owns the state, handed over
    /// by the owner at the end of its round or found free. Returns `false`, having waited for
    /// nothing, if another thread already stands by.
    fn stand_by(&self) -> bool {
        // Relaxed: the slot only says who waits; ownership and the state are handed over by
        // the `HANDED` store (Release) and its load (Acquire) below, or by `owner`.
        if self.standby.load(Ordering::Relaxed) != IDLE
            || self
                .standby
                .compare_exchange(IDLE, WAITING, Ordering::Relaxed, Ordering::Relaxed)
                .is_err()
        {
            return false;
        }
        let mut spins = 0u32;
        loop {
            // Acquire: pairs with the owner's Release in `hand_off`, so its work on the state
            // happens-before ours (as `owner`'s Release/Acquire does for a free flag).
            if self.standby.load(Ordering::Acquire) == HANDED {
                // We own the state now (`owner` stayed true). Free the slot for the next one.
                self.standby.store(IDLE, Ordering::Relaxed);
                return true;
            }
            if self.try_own() {
                // The owner gave up without seeing us (it read the slot before we took it). Only
                // an owner writes `HANDED`, and none but us is one now: the slot is still ours.
                self.standby.store(IDLE, Ordering::Relaxed);
                return true;
            }
            spins = spins.wrapping_add(1);
            if spins >= STANDBY_SPINS {
                // Waited long enough: the owner is likely off the CPU (more dispatchers than
                // CPUs), and spinning only takes the CPU it needs. Give the slot up, unless the
                // owner handed over meanwhile: the CAS against `hand_off`'s decides which.
                match self.standby.compare_exchange(
                    WAITING,
                    IDLE,
                    Ordering::Relaxed,
                    Ordering::Acquire,
                ) {
                    // Not handed: leave as `serialized-leave` does (the caller's note).
                    Ok(_) => return false,
                    // `HANDED` (only the owner writes it, and only over our `WAITING`): we own
                    // the state; the Acquire failure load pairs with its Release.
                    Err(_) => {
                        self.standby.store(IDLE, Ordering::Relaxed);
                        return true;
                    }
                }
            }
            if cfg!(blkq_loom) || spins.is_multiple_of(64) {
                blkq_sync::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
    }

    /// `serialized`, the owner at the end of a round: if a dispatcher stands by, hands it
    /// ownership (without ever clearing `owner`) and returns `true`; the caller no longer owns
    /// the state.
    #[inline]
    fn hand_off(&self) -> bool {
        if self.standby.load(Ordering::Relaxed) != WAITING {
            return false;
        }
        // Release: our work on the state happens-before the stand-by's (Acquire load).
        if self
            .standby
            .compare_exchange(WAITING, HANDED, Ordering::Release, Ordering::Relaxed)
            .is_err()
        {
            return false;
        }
        self.stats.add(HANDED_OFF, 1);
        true
    }

    /// `locked` mode: the mutex, counting a failed `try_lock` as a contended acquisition.
    #[inline]
    fn lock_counted(&self) -> MutexGuard<'_, Guarded<S, T>> {
        match self.inner.try_lock() {
            Some(g) => g,
            None => {
                self.stats.add(CONTENDED, 1);
                self.inner.lock()
            }
        }
    }

    /// `serialized` mode, as owner: the state's mutex, which nobody else should hold.
    #[inline]
    fn lock_owned(&self) -> MutexGuard<'_, Guarded<S, T>> {
        match self.inner.try_lock() {
            Some(g) => g,
            None => {
                self.stats.add(OWNER_WAITED, 1);
                self.inner.lock()
            }
        }
    }

    /// Takes the owner flag if it is free. The load first keeps a contended flag's line
    /// shared (test and test-and-set). Acquire: pairs with the previous owner's Release in
    /// `release`, so its work on the state happens-before ours.
    #[inline]
    fn try_own(&self) -> bool {
        !self.owner.load(Ordering::Relaxed)
            && self
                .owner
                .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
                .is_ok()
    }

    /// Gives ownership up. Returns whether this thread took it again because something was
    /// published meanwhile: the caller owns the state again and must drain (and, if it is a
    /// dispatcher, run a round).
    #[inline]
    fn release(&self) -> bool {
        // R: Release, so the next owner (Acquire in `try_own`) sees our work on the state.
        self.owner.store(false, Ordering::Release);
        if !self.recheck {
            return false;
        }
        // F2: we must fence between releasing and re-checking, so that an inserter that still
        // saw us owning (its T) is seen here (our L): module docs.
        fence(Ordering::SeqCst);
        if self.pending.load(Ordering::Relaxed) == 0 || !self.try_own() {
            return false;
        }
        self.stats.add(REACQUIRED, 1);
        true
    }

    /// We own the state: drain until a release finds nothing more.
    fn own_and_drain(&self, ins: &mut impl FnMut(&mut S, T)) {
        loop {
            {
                let mut g = self.lock_owned();
                self.drain(&mut g, ins);
            }
            if !self.release() {
                return;
            }
        }
    }

    /// Moves every published bucket's items into the state (caller owns the state: the owner
    /// flag, or the mutex in `locked` mode). Clears `RERUN` too: the caller's round is the
    /// round that was asked for.
    fn drain(&self, g: &mut Guarded<S, T>, ins: &mut impl FnMut(&mut S, T)) {
        // A stale 0 here is fine: the re-check after the release reads `pending` after a fence.
        if self.pending.load(Ordering::Relaxed) == 0 {
            return;
        }
        // Acquire: pairs with the publishers' Release `fetch_or`.
        let mut mask = self.pending.swap(0, Ordering::Acquire) & !RERUN;
        while mask != 0 {
            let i = mask.trailing_zeros() as usize;
            mask &= mask - 1;
            if let Some(b) = self.buckets.get(i) {
                // Swap, not drain, under the bucket's mutex: the inserters of this bucket
                // wait for a pointer swap at most.
                std::mem::swap(&mut *b.lock(), &mut g.spare);
            }
            let Guarded { state, spare } = g;
            for t in spare.drain(..) {
                ins(state, t);
            }
        }
    }
}
