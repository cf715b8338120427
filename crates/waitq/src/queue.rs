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
//!   exclusive wake-ups: a chosen waiter that gives up (timeout, cancel) must pass the wake-up
//!   on, as the kernel's `abort_exclusive_wait` does, or a wake-up is lost. So must a waiter
//!   chosen *after* its condition check had already succeeded: that wake-up may be for a
//!   second resource it will not take (its check took the first, which a waker had meant
//!   for an older waiter that then found nothing and went back to sleep). Only a check made
//!   after learning it was chosen uses the wake-up.
//! - Keys increase; a `wake_all` wakes only entries with keys below the `next_key` it saw, so
//!   it terminates even while new waiters keep arriving.
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

impl Target {
    fn wake(self) {
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

#[derive(Debug, Default)]
struct Inner {
    next_key: u64,
    waiters: VecDeque<Entry>,
}

/// A bounded on-stack list of targets to wake once the lock is dropped.
struct WakeList {
    items: [Option<(Target, Option<Arc<AtomicU64>>)>; WAKE_LIST_CAP],
    len: usize,
}

impl WakeList {
    fn new() -> Self {
        Self {
            items: std::array::from_fn(|_| None),
            len: 0,
        }
    }

    fn is_full(&self) -> bool {
        self.len == WAKE_LIST_CAP
    }

    fn push(&mut self, e: Entry) {
        debug_assert!(!self.is_full());
        self.items[self.len] = Some((e.target, e.stamp));
        self.len += 1;
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
    inner: Mutex<Inner>,
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
    pub fn finish_async(&self, key: WaitKey) -> bool {
        self.dequeue(key.0)
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
                if w.finish() {
                    // Chosen after our re-check succeeded: the wake-up may be for a resource
                    // we did not take. Pass it on (see "chosen" in the module docs).
                    self.wake_one();
                }
                return v;
            }
            w.sleep();
            w.finish();
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
                if w.finish() {
                    self.wake_one(); // chosen after the re-check succeeded: pass it on
                }
                return Some(v);
            }
            let timed_out = w.sleep_until(deadline);
            let chosen = w.finish();
            if timed_out {
                // One last look: a wake-up may have raced with the timeout.
                let v = f();
                if v.is_none() && chosen {
                    // We were chosen for an exclusive wake-up we will not use: pass it on.
                    self.wake_one();
                }
                return v;
            }
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
                if w.finish() {
                    self.wake_one(); // chosen after the re-check succeeded: pass it on
                }
                return Ok(v);
            }
            if !token.is_cancelled() {
                w.sleep();
            }
            c.finish();
            let chosen = w.finish();
            if token.is_cancelled() {
                if let Some(v) = f() {
                    return Ok(v);
                }
                if chosen {
                    self.wake_one(); // pass the unused exclusive wake-up on
                }
                return Err(crate::Error::Cancelled);
            }
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
    /// spent on it): a caller that then gives up without taking what it waited for must pass
    /// the wake-up on with `wake_one`.
    pub fn finish(mut self) -> bool {
        self.finished = true;
        let chosen = self.wq.dequeue(self.key);
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
        if !self.finished && self.wq.dequeue(self.key) {
            self.wq.wake_one();
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
                    if this.wq.finish_async(key) {
                        this.wq.wake_one(); // chosen after we looked: pass it on
                    }
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
            if this.wq.finish_async(key) {
                this.wq.wake_one(); // chosen after the re-check succeeded: pass it on
            }
            return std::task::Poll::Ready(v);
        }
        this.key = Some(key);
        std::task::Poll::Pending
    }
}

impl<F> Drop for WaitFor<'_, F> {
    fn drop(&mut self) {
        if let Some(key) = self.key.take() {
            if self.wq.finish_async(key) {
                self.wq.wake_one();
            }
        }
    }
}
