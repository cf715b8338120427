//! The swait-style wait queue.
//!
//! # Shape
//!
//! A FIFO of waiters behind one short lock, plus an `active` count that lets a waker with no
//! one to wake take no lock at all (the kernel's `swait_active()`, crossbeam's `SyncWaker`
//! `is_empty`). Waiters are threads (woken by `unpark`) or async tasks (woken by their
//! `Waker`), on the same queue. Wake-ups are exclusive and oldest-first: `wake_one` wakes the
//! head, `wake_n(n)` the n oldest, `wake_all` everyone queued when it was called.
//!
//! A waker collects what it must wake into a bounded on-stack [`WakeList`] while holding the
//! lock, drops the lock, and only then unparks or calls `Waker::wake` (tokio's `wake_list.rs`):
//! a woken thread never runs straight into the lock its waker still holds, and no user code
//! (a `Waker`) runs under our lock.
//!
//! # The waiting protocol: prepare, re-check, sleep, finish
//!
//! ```text
//!   loop {
//!       if condition() { break }
//!       let w = wq.prepare();        // enqueue, then SeqCst fence
//!       if condition() { w.finish(); break }
//!       w.sleep();                   // park; may return early
//!       w.finish();                  // dequeue if still queued
//!   }
//! ```
//!
//! A waker first makes the condition true, then calls `wake_*`, which starts with a SeqCst
//! fence and reads `active`.
//!
//! # Invariants
//!
//! - `active == inner.waiters.len()` whenever the lock is free; `active` is written only with
//!   the lock held.
//! - An entry is removed from `waiters` exactly once: by a waker (then its target is woken,
//!   after the lock is dropped) or by its own waiter in `finish` (then it is not woken by us).
//!   `finish` therefore tells a waiter whether it was *chosen* by a waker, which matters for
//!   exclusive wake-ups; see "The pass-on rule" below.
//! - Keys increase; a `wake_all` wakes only entries with keys below the `next_key` it saw, so
//!   it terminates even while new waiters keep arriving.
//!
//! # The pass-on rule
//!
//! An exclusive wake-up is meant for one resource (a tag, a slot, a completion count). A
//! waiter that a waker *chose* uses that wake-up only if it checks its condition *after*
//! learning it was chosen and the check succeeds. Every other way of leaving the queue while
//! chosen must pass the wake-up on to the next waiter, or a sleeper can be left behind a free
//! resource:
//!
//! - the waiter gives up (timeout, cancellation, a dropped future), as the kernel's
//!   `abort_exclusive_wait` does;
//! - the waiter's own check had already succeeded when it was chosen (the re-check after
//!   `prepare`, or a poll that found the condition while still queued). The wake-up may then
//!   be for a *second* resource it will not take: its check took the first, which a waker
//!   had meant for an older waiter that then found nothing and queued again.
//!
//! A waiter that was chosen, looked afterwards and found nothing queues again without passing
//! anything on: someone else took what it was woken for, so the wake-up was not wasted.
//!
//! The rule is implemented once, in [`Waiter::finish_and_pass_on`] and
//! [`WaitQueue::finish_async_and_pass_on`] (both go through `WaitQueue::leave_for_good`);
//! plain [`Waiter::finish`] / [`WaitQueue::finish_async`] are for the one case that keeps the
//! wake-up: leaving after a sleep in order to check, then either take or queue again. The
//! pass-on action is a closure because a user of several queues (an `SbitmapQueue`) must
//! pass the wake-up on across all of them, not only to the queue it slept on.
//!
//! # Memory ordering: why no wake-up is lost
//!
//! This is a store-buffer (Dekker) pattern. The waiter stores "I am queued" (`active`, under
//! the lock) and then loads the condition; the waker stores the condition and then loads
//! `active`. Each side puts a `fence(SeqCst)` between its store and its load: the fence at the
//! end of [`WaitQueue::enqueue`] pairs with the fence at the start of [`WaitQueue::wake_n`]. In
//! the single total order of SeqCst fences one comes first; if the waiter's comes first, the
//! waker's load of `active` sees the waiter queued and takes the lock to wake it; if the
//! waker's comes first, the waiter's re-check sees the condition true and does not sleep.
//! Loads and stores around the fences may then be `Relaxed`. (Loom models SeqCst fences, but
//! treats SeqCst loads and stores as AcqRel, so the fences are also what lets loom check it.)
//!
//! An unpark that arrives before the thread parks is kept as the thread's park token, so the
//! window between the re-check and `sleep` loses nothing either.

use std::collections::VecDeque;
use std::task::Waker;
use std::time::Instant;

use blkq_sync::atomic::{fence, AtomicU64, AtomicUsize, Ordering};
use blkq_sync::thread::{self, Thread};
use blkq_sync::{Arc, Mutex};

use crate::hist::LatencyHistogram;

/// How many wake targets a waker holds on its stack before it drops the lock to wake them.
pub const WAKE_LIST_CAP: usize = 32;

/// Who to wake.
#[derive(Debug)]
pub(crate) enum Target {
    Thread(Thread),
    Task(Waker),
}

/// Waiters woken by any wait queue of the process (threads unparked and tasks woken), for
/// metrics. One `Relaxed` add per wake-up, on the slow path only (a queued waiter is being
/// woken: an `unpark` or a `Waker::wake` follows, which costs far more); it orders nothing.
/// Not kept under loom, whose atomics cannot live in a `static`.
#[cfg(not(blkq_loom))]
static WAKEUPS: blkq_sync::atomic::AtomicU64 = blkq_sync::atomic::AtomicU64::new(0);

/// Waiters woken by every [`WaitQueue`] of the process since it started (always 0 under
/// loom).
pub fn wakeups() -> u64 {
    #[cfg(not(blkq_loom))]
    {
        WAKEUPS.load(blkq_sync::atomic::Ordering::Relaxed)
    }
    #[cfg(blkq_loom)]
    {
        0
    }
}

impl Target {
    fn wake(self) {
        #[cfg(not(blkq_loom))]
        WAKEUPS.fetch_add(1, blkq_sync::atomic::Ordering::Relaxed);
        match self {
            Target::Thread(t) => t.unpark(),
            Target::Task(w) => w.wake(),
        }
    }
}

#[derive(Debug)]
struct Entry {
    key: u64,
    target: Target,
    /// Where a waker writes the time of the wake-up, when latency recording is on.
    stamp: Option<Arc<AtomicU64>>,
}

/// The queued waiters, in arrival order, and the key the next one gets (under the queue's lock).
#[derive(Debug, Default)]
struct WaiterList {
    next_key: u64,
    waiters: VecDeque<Entry>,
}

/// A bounded on-stack list of threads and tasks to wake once a lock is dropped: *wake outside
/// the lock*. A waker collects its targets under its lock (never allocating: the list holds at
/// most [`WAKE_LIST_CAP`]), drops the lock, then calls [`WakeList::wake_all`]. The wait queue
/// uses it for its own wake-ups; a structure that must choose its own targets (the tag pool's
/// FIFO hand-off gate, which hands each freed tag to one chosen thread) pushes them with
/// [`WakeList::push_thread`] / [`WakeList::push_task`].
pub struct WakeList {
    items: [Option<(Target, Option<Arc<AtomicU64>>)>; WAKE_LIST_CAP],
    len: usize,
}

impl Default for WakeList {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for WakeList {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WakeList").field("len", &self.len).finish()
    }
}

impl WakeList {
    /// An empty list.
    pub fn new() -> Self {
        Self {
            items: std::array::from_fn(|_| None),
            len: 0,
        }
    }

    /// Whether the list holds [`WAKE_LIST_CAP`] targets (push no more: wake these, then go on).
    pub fn is_full(&self) -> bool {
        self.len == WAKE_LIST_CAP
    }

    /// How many targets the list holds.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the list is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn push_target(&mut self, target: Target, stamp: Option<Arc<AtomicU64>>) {
        assert!(
            !self.is_full(),
            "WakeList is full: wake it before pushing more"
        );
        self.items[self.len] = Some((target, stamp));
        self.len += 1;
    }

    fn push(&mut self, e: Entry) {
        self.push_target(e.target, e.stamp);
    }

    /// Adds a thread to unpark. Panics if the list is full (check [`WakeList::is_full`]).
    pub fn push_thread(&mut self, t: Thread) {
        self.push_target(Target::Thread(t), None);
    }

    /// Adds a task to wake. Panics if the list is full (check [`WakeList::is_full`]).
    pub fn push_task(&mut self, w: Waker) {
        self.push_target(Target::Task(w), None);
    }

    /// Wakes every target (call it with no lock held) and empties the list.
    pub fn wake(&mut self) {
        self.wake_all(None);
    }

    fn wake_all(&mut self, hist: Option<&LatencyHistogram>) {
        let now = hist.map(|h| h.now_ns());
        for slot in &mut self.items[..self.len] {
            if let Some((target, stamp)) = slot.take() {
                if let (Some(stamp), Some(now)) = (stamp, now) {
                    stamp.store(now, Ordering::Relaxed);
                }
                target.wake();
            }
        }
        self.len = 0;
    }
}

/// An swait-style FIFO wait queue for threads and async tasks.
///
/// See the module documentation for the protocol and its ordering rules.
#[derive(Debug, Default)]
pub struct WaitQueue {
    /// Number of queued waiters. Written only under `inner`'s lock; read without it by wakers
    /// after their SeqCst fence (see the module docs).
    active: AtomicUsize,
    inner: Mutex<WaiterList>,
    /// Wake-up latency histogram, when recording is on. `None` costs one predictable branch.
    latency: Option<Box<LatencyHistogram>>,
}

/// The key of an async waiter's queue entry, from [`WaitQueue::prepare_async`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WaitKey(u64);

impl WaitQueue {
    /// An empty queue, latency recording off.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty queue that records the time from each wake-up to the woken thread running.
    pub fn with_latency_recording() -> Self {
        Self {
            latency: Some(Box::new(LatencyHistogram::new())),
            ..Self::default()
        }
    }

    /// The wake-up latency histogram, if recording is on.
    pub fn latency(&self) -> Option<&LatencyHistogram> {
        self.latency.as_deref()
    }

    /// Number of queued waiters (a snapshot).
    pub fn waiters(&self) -> usize {
        self.active.load(Ordering::Relaxed)
    }

    fn enqueue(&self, target: Target) -> (u64, Option<Arc<AtomicU64>>) {
        let stamp = self
            .latency
            .as_ref()
            .map(|_| Arc::new(AtomicU64::new(u64::MAX)));
        let key = {
            let mut inner = self.inner.lock();
            let key = inner.next_key;
            inner.next_key += 1;
            inner.waiters.push_back(Entry {
                key,
                target,
                stamp: stamp.clone(),
            });
            self.active.store(inner.waiters.len(), Ordering::Relaxed);
            key
        };
        // We must order the `active` store above before the caller's re-check of its
        // condition, so that this fence and the one in `wake_n` (after the waker changed the
        // condition) cannot both miss each other: a store-buffer pattern.
        fence(Ordering::SeqCst);
        (key, stamp)
    }

    /// Removes the entry `key` if it is still queued. Returns `true` if it was gone, i.e. a
    /// waker chose it (and has woken or is about to wake its target).
    fn dequeue(&self, key: u64) -> bool {
        let mut inner = self.inner.lock();
        // Entries are in key order, so the search can stop early; queues are short.
        match inner.waiters.iter().position(|e| e.key == key) {
            Some(i) => {
                inner.waiters.remove(i);
                self.active.store(inner.waiters.len(), Ordering::Relaxed);
                false
            }
            None => true,
        }
    }

    /// Queues the current thread. Re-check your condition after this, then
    /// [`Waiter::sleep`], then [`Waiter::finish`].
    pub fn prepare(&self) -> Waiter<'_> {
        let (key, stamp) = self.enqueue(Target::Thread(thread::current()));
        Waiter {
            wq: self,
            key,
            stamp,
            finished: false,
        }
    }

    /// Queues an async task, woken through `waker`. Re-check your condition after this; finish
    /// with [`WaitQueue::finish_async`] (a dropped future must do so too).
    pub fn prepare_async(&self, waker: &Waker) -> WaitKey {
        let (key, _) = self.enqueue(Target::Task(waker.clone()));
        WaitKey(key)
    }

    /// Replaces the waker of a queued async waiter, keeping its place. Returns `false` if the
    /// entry is no longer queued (a waker chose it).
    pub fn update_waker(&self, key: WaitKey, waker: &Waker) -> bool {
        let mut inner = self.inner.lock();
        match inner.waiters.iter_mut().find(|e| e.key == key.0) {
            Some(e) => {
                if let Target::Task(w) = &mut e.target {
                    if !w.will_wake(waker) {
                        w.clone_from(waker);
                    }
                }
                true
            }
            None => false,
        }
    }

    /// Dequeues an async waiter; returns whether a waker had chosen it (see [`Waiter::finish`]).
    /// Only for a waiter that will check its condition next and then either take what it waits
    /// for or queue again; any other exit uses [`WaitQueue::finish_async_and_pass_on`].
    pub fn finish_async(&self, key: WaitKey) -> bool {
        self.dequeue(key.0)
    }

    /// Dequeues an async waiter that leaves for good without using a wake-up it may have been
    /// chosen for, and passes such a wake-up on by calling `pass_on` (usually
    /// `|| wq.wake_one()`). Use it when the future's check succeeded while it was still queued,
    /// or when it gives up (dropped, cancelled). Returns whether it was chosen. See "The
    /// pass-on rule" in the module docs.
    pub fn finish_async_and_pass_on(&self, key: WaitKey, pass_on: impl FnOnce()) -> bool {
        self.leave_for_good(key.0, pass_on)
    }

    /// The pass-on rule, written once (see the module docs): a waiter leaving the queue for
    /// good has no check left that could use an exclusive wake-up spent on it, so if a waker
    /// chose it, the wake-up goes to `pass_on`, or the resource it was meant for may sit free
    /// behind a sleeping waiter.
    fn leave_for_good(&self, key: u64, pass_on: impl FnOnce()) -> bool {
        let chosen = self.dequeue(key);
        if chosen {
            pass_on();
        }
        chosen
    }

    /// Wakes the oldest waiter, if any. Returns whether one was woken.
    #[inline]
    pub fn wake_one(&self) -> bool {
        self.wake_n(1) == 1
    }

    /// Wakes up to `n` of the oldest waiters; returns how many were woken.
    #[inline]
    pub fn wake_n(&self, n: usize) -> usize {
        // We must order the caller's condition change (made before this call) before the load
        // of `active`, pairing with the fence at the end of `enqueue`: either the waiter sees
        // the condition in its re-check, or we see it queued here.
        fence(Ordering::SeqCst);
        if n == 0 || self.active.load(Ordering::Relaxed) == 0 {
            return 0;
        }
        self.wake_slow(n, None)
    }

    /// Wakes every waiter queued at the time of the call; returns how many were woken.
    pub fn wake_all(&self) -> usize {
        fence(Ordering::SeqCst); // pairs with `enqueue`, as in `wake_n`
        if self.active.load(Ordering::Relaxed) == 0 {
            return 0;
        }
        let limit = self.inner.lock().next_key;
        self.wake_slow(usize::MAX, Some(limit))
    }

    #[cold]
    fn wake_slow(&self, n: usize, key_limit: Option<u64>) -> usize {
        let mut woken = 0;
        let mut list = WakeList::new();
        loop {
            let more = {
                let mut inner = self.inner.lock();
                while woken + list.len < n && !list.is_full() {
                    match inner.waiters.front() {
                        Some(e) if key_limit.is_none_or(|l| e.key < l) => {}
                        _ => break,
                    }
                    if let Some(e) = inner.waiters.pop_front() {
                        list.push(e);
                    }
                }
                self.active.store(inner.waiters.len(), Ordering::Relaxed);
                list.is_full()
                    && woken + list.len < n
                    && inner
                        .waiters
                        .front()
                        .is_some_and(|e| key_limit.is_none_or(|l| e.key < l))
            };
            woken += list.len;
            list.wake_all(self.latency.as_deref());
            if !more {
                return woken;
            }
        }
    }

    /// Blocks until `f` returns `Some`, and returns its value. `f` is the condition and the
    /// taking of the resource in one (e.g. "try to allocate a tag").
    pub fn wait_for<T>(&self, mut f: impl FnMut() -> Option<T>) -> T {
        loop {
            if let Some(v) = f() {
                return v;
            }
            let w = self.prepare();
            if let Some(v) = f() {
                // Our re-check succeeded before we could know whether we were chosen.
                w.finish_and_pass_on(|| {
                    self.wake_one();
                });
                return v;
            }
            w.sleep();
            w.finish(); // keeps the wake-up: we check next, then take or queue again
        }
    }

    /// Like [`WaitQueue::wait_for`], giving up at `deadline` (returns `None`).
    pub fn wait_for_until<T>(
        &self,
        mut f: impl FnMut() -> Option<T>,
        deadline: Instant,
    ) -> Option<T> {
        loop {
            if let Some(v) = f() {
                return Some(v);
            }
            let w = self.prepare();
            if let Some(v) = f() {
                w.finish_and_pass_on(|| {
                    self.wake_one();
                });
                return Some(v);
            }
            if w.sleep_until(deadline) {
                // One last look (a wake-up may have raced with the timeout), then leave for
                // good: found or not, the look came before learning whether we were chosen.
                let v = f();
                w.finish_and_pass_on(|| {
                    self.wake_one();
                });
                return v;
            }
            w.finish();
        }
    }

    /// Like [`WaitQueue::wait_for`], giving up with [`crate::Error::Cancelled`] once `token`
    /// is cancelled.
    pub fn wait_for_cancellable<T>(
        &self,
        mut f: impl FnMut() -> Option<T>,
        token: &crate::CancelToken,
    ) -> Result<T, crate::Error> {
        loop {
            if let Some(v) = f() {
                return Ok(v);
            }
            if token.is_cancelled() {
                return Err(crate::Error::Cancelled);
            }
            // Queue on both: the thread sleeps once and either queue's waker unparks it.
            let w = self.prepare();
            let c = token.queue().prepare();
            if let Some(v) = f() {
                c.finish();
                w.finish_and_pass_on(|| {
                    self.wake_one();
                });
                return Ok(v);
            }
            if !token.is_cancelled() {
                w.sleep();
            }
            c.finish();
            if token.is_cancelled() {
                // Last look, then leave for good (the pass-on rule: the look came first).
                let v = f();
                w.finish_and_pass_on(|| {
                    self.wake_one();
                });
                return v.ok_or(crate::Error::Cancelled);
            }
            w.finish();
        }
    }

    /// A future that resolves once `f` returns `Some` (the async [`WaitQueue::wait_for`]).
    pub fn wait_for_async<T, F: FnMut() -> Option<T> + Unpin>(&self, f: F) -> WaitFor<'_, F> {
        WaitFor {
            wq: self,
            f,
            key: None,
        }
    }
}

/// A queued thread waiter, from [`WaitQueue::prepare`].
///
/// Dropping it unfinished finishes it and passes an unused wake-up on to the next waiter.
#[derive(Debug)]
pub struct Waiter<'a> {
    wq: &'a WaitQueue,
    key: u64,
    stamp: Option<Arc<AtomicU64>>,
    finished: bool,
}

impl Waiter<'_> {
    /// Parks until unparked. May return early for no reason: re-check, then [`Waiter::finish`].
    pub fn sleep(&self) {
        thread::park();
    }

    /// Parks until unparked or `deadline`; returns whether the deadline has passed.
    pub fn sleep_until(&self, deadline: Instant) -> bool {
        blkq_sync::park_until(deadline)
    }

    /// Leaves the queue. Returns `true` if a waker chose this waiter (an exclusive wake-up was
    /// spent on it). Only for a waiter that checks its condition next and then either takes
    /// what it waits for or queues again; every other exit uses
    /// [`Waiter::finish_and_pass_on`] (see "The pass-on rule" in the module docs).
    pub fn finish(mut self) -> bool {
        self.finished = true;
        let chosen = self.wq.dequeue(self.key);
        if chosen {
            self.record_latency();
        }
        chosen
    }

    /// Leaves the queue for good, passing an exclusive wake-up spent on this waiter on by
    /// calling `pass_on` (usually `|| wq.wake_one()`). Use it when the caller's check
    /// succeeded while it was still queued (its re-check after [`WaitQueue::prepare`]), or when
    /// it gives up (timeout, cancel). Returns whether it was chosen.
    pub fn finish_and_pass_on(mut self, pass_on: impl FnOnce()) -> bool {
        self.finished = true;
        let chosen = self.wq.leave_for_good(self.key, pass_on);
        if chosen {
            self.record_latency();
        }
        chosen
    }

    fn record_latency(&self) {
        let (Some(hist), Some(stamp)) = (self.wq.latency.as_deref(), self.stamp.as_ref()) else {
            return;
        };
        let at = stamp.load(Ordering::Relaxed);
        if at != u64::MAX {
            hist.record(hist.now_ns().saturating_sub(at));
        }
    }
}

impl Drop for Waiter<'_> {
    fn drop(&mut self) {
        if !self.finished {
            // Giving up (e.g. unwinding): the pass-on rule.
            self.wq.leave_for_good(self.key, || {
                self.wq.wake_one();
            });
        }
    }
}

/// The future of [`WaitQueue::wait_for_async`].
///
/// Dropped while queued, it leaves the queue and passes an unused wake-up on.
#[derive(Debug)]
pub struct WaitFor<'a, F> {
    wq: &'a WaitQueue,
    f: F,
    key: Option<WaitKey>,
}

impl<T, F: FnMut() -> Option<T> + Unpin> std::future::Future for WaitFor<'_, F> {
    type Output = T;

    fn poll(self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<T> {
        let this = self.get_mut();
        // Learn whether a waker chose us *before* looking at the condition: a chosen waiter
        // that then finds what it waits for has used its wake-up, but one that found it before
        // being chosen may have been chosen for something it did not take, and must pass the
        // wake-up on.
        if let Some(key) = this.key {
            if this.wq.update_waker(key, cx.waker()) {
                // Still queued: keep our place (with the fresh waker) unless we are done.
                if let Some(v) = (this.f)() {
                    this.key = None;
                    // We looked before learning whether we were chosen: the pass-on rule.
                    this.wq.finish_async_and_pass_on(key, || {
                        this.wq.wake_one();
                    });
                    return std::task::Poll::Ready(v);
                }
                return std::task::Poll::Pending;
            }
            // Chosen: the check below comes after the choice.
            this.key = None;
        }
        if let Some(v) = (this.f)() {
            return std::task::Poll::Ready(v);
        }
        // Not queued, or chosen but someone else took what we were woken for: queue again.
        let key = this.wq.prepare_async(cx.waker());
        if let Some(v) = (this.f)() {
            // The re-check succeeded before we could know whether we were chosen.
            this.wq.finish_async_and_pass_on(key, || {
                this.wq.wake_one();
            });
            return std::task::Poll::Ready(v);
        }
        this.key = Some(key);
        std::task::Poll::Pending
    }
}

impl<F> Drop for WaitFor<'_, F> {
    fn drop(&mut self) {
        if let Some(key) = self.key.take() {
            // Giving up: the pass-on rule.
            self.wq.finish_async_and_pass_on(key, || {
                self.wq.wake_one();
            });
        }
    }
}
