//! `SbitmapQueue`: a tag bitmap plus the wait queues its allocators sleep on, with batched
//! wake-ups (counter-based batched wake-ups).
//!
//! # State
//!
//! | field             | meaning                                                             |
//! |-------------------|---------------------------------------------------------------------|
//! | `ws[0..8]`        | eight wait queues; a sleeper picks one round-robin (`next_ws`)       |
//! | `ws_active`       | number of allocators between "about to queue" and "left the queue"  |
//! | `wake_batch`      | wake-ups are issued `wake_batch` waiters at a time                  |
//! | `completion_cnt`  | frees counted while `ws_active != 0`; only ever increases (wraps)   |
//! | `wakeup_cnt`      | `wake_batch` times the batches issued; only ever increases (wraps)  |
//! | `wake_index`      | the queue the next batch starts from, round-robin                   |
//! | `ws[i].wait_cnt`  | legacy algorithm only: frees left before queue `i` gets a batch     |
//!
//! # The counter algorithm (counter-based batched wake-ups)
//!
//! A free adds to `completion_cnt`; then, while `completion_cnt - wakeup_cnt >= wake_batch`,
//! it advances `wakeup_cnt` by `wake_batch` with a CAS and, if the CAS won, wakes up to
//! `wake_batch` waiters across the queues from `wake_index`. Nothing is ever reset, so there
//! is no two-step update for a nested or concurrent free to fall between: a free that loses
//! the CAS simply re-reads both counters and either finds a batch still owed (and issues it)
//! or finds that the winner's batch covered it. Invariant: `wakeup_cnt <= completion_cnt`
//! (as real numbers; they wrap in `u32`, and differences are taken as signed).
//!
//! Ordering of the counters: the CAS on `wakeup_cnt` is AcqRel and its loads Acquire, so a
//! free that reads a `wakeup_cnt` advanced by another free also sees (read-read coherence
//! through happens-before) a `completion_cnt` at least as new as the one that free saw: the
//! signed difference can then not go negative from stale reads. `completion_cnt` itself is
//! Relaxed: it is a counter, and the CAS decides who wakes.
//!
//! # The legacy algorithm (before counter-based batched wake-ups), behind [`WakeAlgo::Legacy`]
//!
//! Each queue has `wait_cnt`, decremented by every free; the free that brings it to zero
//! wakes a batch on that queue, advances `wake_index`, and resets `wait_cnt` to `wake_batch`.
//! Decrement and reset are two steps: a free that arrives in between (on another CPU, or
//! nested on the same one, as a completion interrupting a completion) finds `wait_cnt <= 0`
//! and must either spin until the reset (which never comes if it interrupted the resetter:
//! the kernel's hang) or leave, trusting the pending reset's batch to cover it. We leave, as
//! an early version did, and that loses its wake-up: the loom model and the nested test in
//! `tests/` show a waiter left asleep while a tag is free. Kept only to be measured against.
//!
//! # The chained rule ([`WakeAlgo::Chain`])
//!
//! The counters decide *when* a batch is due exactly as above (so the nested-free cure is
//! kept); what changes is *how many* a due batch wakes. The counter algorithm wakes
//! `wake_batch` sleepers across the queues at once; under the `steal` policy, by the time they
//! run (a wake-up costs ~24 us on a small VM) running allocators have often taken the freed
//! tags, and most of them sleep again: up to one context switch per I/O for nothing. The
//! chained rule wakes the *head* of a chain, one sleeper; a woken sleeper that then takes a tag
//! (`chain_on`) and still sees tags free (`depth - weight`) while someone waits
//! (`ws_active != 0`) wakes as many more as it sees free, at most a batch. So sleepers are
//! woken when, and as many as, tags are left for them at the moment a woken thread actually
//! runs, not when the batch fell due (by then running allocators under `steal` have taken
//! most of them). With a batch of one (depths up to 8 here) every counted free already wakes
//! a sleeper of its own, so there are no links: it is the counter rule.
//!
//! Why no sleeper is left behind a free tag (given, as for the other rules, that tags in
//! flight keep being freed): every free counted towards a batch is covered by the chain it
//! starts or by one already running. Follow a chain: its current link was woken; it either
//! (a) takes no tag: every tag freed so far was taken by an allocator that is running, so it
//! is in flight, and its free will be counted again; or (b) takes a tag and sees none free:
//! the same; or (c) takes one and sees one free: if someone waits it wakes the next link;
//! if the only waiters are between counting themselves in `ws_active` and queuing, their
//! retry after `prepare`'s fence sees the free tag. Orderings: the link's check starts with a
//! `fence(SeqCst)` that pairs with the one ending a sleeper's `prepare`, as a free's does (the
//! free tag it looks at was freed before its wake-up, so before that fence): either the
//! sleeper's retry sees the tag, or the link sees the sleeper counted and queued. Without the
//! fence, loom finds the link reading a stale "no waiters" while the sleeper's retry misses
//! the tag. (A stale "free" from the Relaxed `weight` costs one spare wake-up at most, which
//! the pass-on rule hands on.)
//! Loom: `tests/loom_chain.rs` (two sleepers, one batch of two frees: the second is woken by
//! the first; and the same model without the links deadlocks).
//!
//! # No lost wake-up between a sleeper and a free
//!
//! A sleeper increments `ws_active`, queues (the wait queue's `prepare` ends in a SeqCst
//! fence), then retries the allocation. A free clears its bit, then fences (SeqCst) and reads
//! `ws_active`. The two fences pair: either the sleeper's retry sees the freed bit, or the
//! free sees `ws_active != 0` and counts itself towards a wake-up. Once counted, every
//! `wake_batch` frees issue `wake_batch` wake-ups, oldest sleepers of each queue first.
//!
//! # Spare wake-ups are passed on
//!
//! A sleeper obeys the wait queue's pass-on rule (`waitq`'s "The pass-on rule"): leaving for
//! good while chosen, without a check made after learning it was chosen (its retry after
//! queuing found a tag, an async poll found one while still queued, or a future is dropped),
//! it passes the wake-up on through [`waitq::Waiter::finish_and_pass_on`] /
//! [`WaitQueue::finish_async_and_pass_on`], to the next sleeper on *any* of the queues
//! (`wake_waiters(1)`), since the free that chose it woke across all of them.
//! A sleeper always has `depth` tags in flight ahead of it, and `wake_batch` is computed so
//! that `depth >= 8 * wake_batch` wherever possible: enough frees are always coming.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use blkq_sync::atomic::{fence, AtomicI32, AtomicU32, AtomicUsize, Ordering};
use blkq_sync::CachePadded;
use waitq::{WaitKey, WaitQueue};

use crate::{Error, Sbitmap, TagBatch};

/// Number of wait queues. Under loom it is 2: the algorithms treat any number of queues
/// alike, and each extra queue only multiplies the states a model must explore.
pub const SBQ_WAIT_QUEUES: usize = if cfg!(blkq_loom) { 2 } else { 8 };
/// The largest wake batch.
pub const SBQ_WAKE_BATCH: u32 = 8;

/// Which wake-up algorithm a queue runs (switchable at run time, for comparison).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WakeAlgo {
    /// Ever-increasing completion and wake-up counters (counter-based batched wake-ups), a
    /// due batch waking `wake_batch` sleepers across the queues at once.
    Counter,
    /// A per-queue `wait_cnt` decremented and reset (the algorithm the counters replaced).
    Legacy,
    /// The counters, but a due batch wakes one sleeper, and a woken sleeper that takes a tag
    /// and still sees tags free wakes that many more, at most a batch (see "The chained rule"
    /// in the module docs). The default.
    #[default]
    Chain,
}

impl WakeAlgo {
    fn to_u32(self) -> u32 {
        match self {
            WakeAlgo::Counter => 0,
            WakeAlgo::Legacy => 1,
            WakeAlgo::Chain => 2,
        }
    }

    fn from_u32(v: u32) -> Self {
        match v {
            1 => WakeAlgo::Legacy,
            2 => WakeAlgo::Chain,
            _ => WakeAlgo::Counter,
        }
    }

    /// The name `FromStr` takes.
    pub fn name(self) -> &'static str {
        match self {
            WakeAlgo::Counter => "counter",
            WakeAlgo::Legacy => "legacy",
            WakeAlgo::Chain => "chain",
        }
    }
}

impl std::str::FromStr for WakeAlgo {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        match s {
            "counter" => Ok(WakeAlgo::Counter),
            "legacy" => Ok(WakeAlgo::Legacy),
            "chain" => Ok(WakeAlgo::Chain),
            _ => Err(Error::UnknownAlgo(s.to_string())),
        }
    }
}

#[derive(Debug, Default)]
struct WaitState {
    wq: WaitQueue,
    /// Legacy algorithm only.
    wait_cnt: AtomicI32,
}

/// Computes the wake batch: small enough that the bitmap's usable depth (each word limited
/// to `min_shallow_depth` bits) holds a batch for each of the eight queues, at most
/// [`SBQ_WAKE_BATCH`], at least 1.
pub fn calc_wake_batch(depth: u32, shift: u32, min_shallow_depth: u32) -> u32 {
    let bpw = 1u32 << shift;
    let per_word = bpw.min(min_shallow_depth);
    let usable = (depth >> shift) * per_word + (depth & (bpw - 1)).min(per_word);
    (usable / SBQ_WAIT_QUEUES as u32).clamp(1, SBQ_WAKE_BATCH)
}

/// A tag bitmap whose allocators may sleep until a tag is freed.
#[derive(Debug)]
pub struct SbitmapQueue {
    sb: Sbitmap,
    wake_batch: AtomicU32,
    min_shallow_depth: AtomicU32,
    ws_active: CachePadded<AtomicU32>,
    wake_index: AtomicUsize,
    next_ws: AtomicUsize,
    completion_cnt: CachePadded<AtomicU32>,
    wakeup_cnt: CachePadded<AtomicU32>,
    /// `WakeAlgo` as `to_u32` (Relaxed: a mode switch, every sleeper re-checks).
    algo: AtomicU32,
    /// Test knob: `false` drops the chained rule's links (the model that must fail).
    chain_links: bool,
    ws: Box<[CachePadded<WaitState>]>,
}

impl SbitmapQueue {
    /// A queue over a new [`Sbitmap`] of `depth` tags (`shift`, `round_robin`: see there).
    pub fn new(
        depth: u32,
        shift: Option<u32>,
        round_robin: bool,
        algo: WakeAlgo,
    ) -> Result<Self, Error> {
        let sb = Sbitmap::new(depth, shift, round_robin)?;
        let wake_batch = calc_wake_batch(depth, sb.shift(), u32::MAX);
        let ws: Box<[CachePadded<WaitState>]> = (0..SBQ_WAIT_QUEUES)
            .map(|_| {
                CachePadded(WaitState {
                    wq: WaitQueue::new(),
                    wait_cnt: AtomicI32::new(wake_batch as i32),
                })
            })
            .collect();
        Ok(Self {
            sb,
            wake_batch: AtomicU32::new(wake_batch),
            min_shallow_depth: AtomicU32::new(u32::MAX),
            ws_active: CachePadded(AtomicU32::new(0)),
            wake_index: AtomicUsize::new(0),
            next_ws: AtomicUsize::new(0),
            completion_cnt: CachePadded(AtomicU32::new(0)),
            wakeup_cnt: CachePadded(AtomicU32::new(0)),
            algo: AtomicU32::new(algo.to_u32()),
            chain_links: true,
            ws,
        })
    }

    /// Test-only: a [`WakeAlgo::Chain`] queue whose woken sleepers never wake the next link.
    /// Broken on purpose; the loom test shows a sleeper left behind a free tag.
    #[doc(hidden)]
    pub fn new_chain_without_links(depth: u32) -> Result<Self, Error> {
        let mut q = Self::new(depth, None, false, WakeAlgo::Chain)?;
        q.chain_links = false;
        Ok(q)
    }

    /// The bitmap.
    pub fn bitmap(&self) -> &Sbitmap {
        &self.sb
    }

    /// The wake-up algorithm in use.
    pub fn algo(&self) -> WakeAlgo {
        WakeAlgo::from_u32(self.algo.load(Ordering::Relaxed))
    }

    /// Switches the wake-up algorithm. Meant for use between runs; switching under load is
    /// safe (every sleeper re-checks the bitmap) but may delay a batch.
    pub fn set_algo(&self, algo: WakeAlgo) {
        self.algo.store(algo.to_u32(), Ordering::Relaxed);
        self.wake_all();
    }

    /// The current wake batch.
    pub fn wake_batch(&self) -> u32 {
        self.wake_batch.load(Ordering::Relaxed)
    }

    /// Number of allocators currently waiting (or about to).
    pub fn ws_active(&self) -> u32 {
        self.ws_active.load(Ordering::Relaxed)
    }

    /// `(completion_cnt, wakeup_cnt)`, for tests and statistics.
    pub fn counters(&self) -> (u32, u32) {
        (
            self.completion_cnt.load(Ordering::Relaxed),
            self.wakeup_cnt.load(Ordering::Relaxed),
        )
    }

    fn update_wake_batch(&self) {
        let b = calc_wake_batch(
            self.sb.depth(),
            self.sb.shift(),
            self.min_shallow_depth.load(Ordering::Relaxed),
        );
        if self.wake_batch.swap(b, Ordering::Relaxed) != b {
            // Legacy: let every queue pick the new batch up at its next reset.
            for ws in self.ws.iter() {
                ws.wait_cnt.store(1, Ordering::Relaxed);
            }
        }
    }

    /// Tells the queue the smallest shallow depth its users will pass to
    /// [`SbitmapQueue::get_shallow`], so the wake batch stays reachable.
    pub fn set_min_shallow_depth(&self, depth: u32) {
        self.min_shallow_depth.store(depth, Ordering::Relaxed);
        self.update_wake_batch();
    }

    /// Resizes the bitmap (up to its capacity) and recomputes the wake batch.
    pub fn resize(&self, depth: u32) -> Result<(), Error> {
        self.sb.resize(depth)?;
        self.update_wake_batch();
        // Sleepers may now fit: let them look.
        self.wake_all();
        Ok(())
    }

    /// Allocates a tag without sleeping.
    #[inline]
    pub fn get(&self) -> Option<u32> {
        self.sb.get()
    }

    /// Allocates a tag within `shallow_depth` bits per word, without sleeping.
    #[inline]
    pub fn get_shallow(&self, shallow_depth: u32) -> Option<u32> {
        self.sb.get_shallow(shallow_depth)
    }

    /// Allocates up to `n` tags from one word, without sleeping.
    #[inline]
    pub fn get_batch(&self, n: u32) -> Option<TagBatch> {
        self.sb.get_batch(n)
    }

    fn pick_ws(&self) -> &WaitState {
        &self.ws[self.next_ws.fetch_add(1, Ordering::Relaxed) % SBQ_WAIT_QUEUES]
    }

    /// Allocates a tag, sleeping until one is freed if the bitmap is full.
    pub fn get_or_wait(&self) -> u32 {
        self.get_or_wait_with(|sb| sb.get())
    }

    /// Like [`SbitmapQueue::get_or_wait`] with a custom allocation (e.g. shallow).
    pub fn get_or_wait_with(&self, mut f: impl FnMut(&Sbitmap) -> Option<u32>) -> u32 {
        if let Some(t) = f(&self.sb) {
            return t;
        }
        loop {
            let ws = self.pick_ws();
            // Counted before queuing; the fence at the end of `prepare` orders this increment
            // (and the queue entry) before our retry below. Pairs with the fence in
            // `wake_up`.
            self.ws_active.fetch_add(1, Ordering::Relaxed);
            let w = ws.wq.prepare();
            if let Some(t) = f(&self.sb) {
                // Our retry found a tag before we could know whether a free chose us: a
                // wake-up spent on us is spare and another sleeper may need it.
                w.finish_and_pass_on(|| self.wake_waiters(1));
                self.ws_active.fetch_sub(1, Ordering::Relaxed);
                return t;
            }
            w.sleep();
            w.finish(); // keeps the wake-up: we retry next, then take or queue again
            self.ws_active.fetch_sub(1, Ordering::Relaxed);
            if let Some(t) = f(&self.sb) {
                self.chain_on();
                return t;
            }
            // Chosen, but someone took the tag first: queue again (the tag was used, so the
            // wake-up was not wasted).
        }
    }

    /// Allocates a tag from an async task, waiting if the bitmap is full.
    pub fn get_async(&self) -> GetTag<'_> {
        self.get_async_with(Sbitmap::get)
    }

    /// Like [`SbitmapQueue::get_async`] with a custom allocation (e.g. shallow), as
    /// [`SbitmapQueue::get_or_wait_with`] is to [`SbitmapQueue::get_or_wait`].
    pub fn get_async_with<F: FnMut(&Sbitmap) -> Option<u32> + Unpin>(&self, f: F) -> GetTag<'_, F> {
        GetTag {
            sbq: self,
            f,
            queued: None,
        }
    }

    /// Frees a tag and issues the wake-ups it completes. Returns `false` if `tag` was not
    /// owned (nothing changes then).
    #[inline]
    pub fn put(&self, tag: u32) -> bool {
        if !self.sb.put(tag) {
            return false;
        }
        self.wake_up(1, &mut None);
        true
    }

    /// [`SbitmapQueue::put`], running `interrupt` exactly once: at the point of the wake-up
    /// path where an interrupt is most harmful (between the two steps of the legacy algorithm;
    /// between reading and advancing the counters of the counter algorithm) if the path gets
    /// there, else at its end. It models a completion that runs nested inside another
    /// completion on the same CPU; tests and models use it.
    pub fn put_nested(&self, tag: u32, interrupt: &mut dyn FnMut()) -> bool {
        if !self.sb.put(tag) {
            return false;
        }
        let mut slot = Some(interrupt);
        self.wake_up(1, &mut slot);
        // Not reached (nobody waits, or no batch due): the nested free still happens, last.
        if let Some(f) = slot.take() {
            f();
        }
        true
    }

    /// Frees several tags (one RMW per word) and issues their wake-ups.
    pub fn put_batch(&self, tags: &[u32]) -> u32 {
        let n = self.sb.put_batch(tags);
        if n > 0 {
            self.wake_up(n, &mut None);
        }
        n
    }

    /// Wakes every sleeper (e.g. after a resize); they re-check and sleep again if need be.
    pub fn wake_all(&self) {
        for ws in self.ws.iter() {
            ws.wq.wake_all();
        }
    }

    #[inline]
    fn wake_up(&self, nr: u32, interrupt: &mut Option<&mut dyn FnMut()>) {
        // We must order our free (the bitmap RMW) before the load of `ws_active`, pairing with
        // the SeqCst fence a sleeper executes after raising `ws_active` and queuing (at the end
        // of `WaitQueue::prepare`): either it sees our free, or we see it active.
        fence(Ordering::SeqCst);
        if self.ws_active.load(Ordering::Relaxed) == 0 {
            return; // nobody waits: no counting, no atomics written
        }
        match self.algo() {
            WakeAlgo::Legacy => {
                for _ in 0..nr {
                    self.legacy_wake(interrupt);
                }
            }
            WakeAlgo::Counter => self.counter_wake(nr, interrupt, false),
            WakeAlgo::Chain => self.counter_wake(nr, interrupt, true),
        }
    }

    #[cold]
    fn counter_wake(&self, nr: u32, interrupt: &mut Option<&mut dyn FnMut()>, chain: bool) {
        let batch = self.wake_batch.load(Ordering::Relaxed);
        self.completion_cnt.fetch_add(nr, Ordering::Relaxed);
        // Acquire: see the module docs (a newer wakeup_cnt implies a new-enough completion_cnt).
        let mut wakeups = self.wakeup_cnt.load(Ordering::Acquire);
        loop {
            let completions = self.completion_cnt.load(Ordering::Relaxed);
            if (completions.wrapping_sub(wakeups) as i32) < batch as i32 {
                return;
            }
            if let Some(f) = interrupt.take() {
                f();
            }
            match self.wakeup_cnt.compare_exchange_weak(
                wakeups,
                wakeups.wrapping_add(batch),
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => {
                    // Chained: the batch wakes the head of a chain (`chain_on`).
                    self.wake_waiters(if chain { 1 } else { batch as usize });
                    wakeups = wakeups.wrapping_add(batch);
                    // Loop: batched frees (put_batch) may owe more than one batch.
                }
                Err(now) => wakeups = now,
            }
        }
    }

    /// Wakes up to `n` sleepers across the queues, round-robin from `wake_index`.
    fn wake_waiters(&self, mut n: usize) {
        let start = self.wake_index.load(Ordering::Relaxed);
        let mut index = start;
        for _ in 0..SBQ_WAIT_QUEUES {
            let ws = &self.ws[index % SBQ_WAIT_QUEUES];
            // Advance first, so a queue need not be emptied before the next gets its turn.
            index = (index + 1) % SBQ_WAIT_QUEUES;
            if ws.wq.waiters() > 0 {
                n -= ws.wq.wake_n(n);
                if n == 0 {
                    break;
                }
            }
        }
        if index != start {
            self.wake_index.store(index, Ordering::Relaxed);
        }
    }

    /// The chained rule's next links: called by a sleeper that was woken (chosen) and then took
    /// a tag. If tags are still free and someone waits, wake as many sleepers as there are
    /// free tags, at most a batch.
    #[inline]
    fn chain_on(&self) {
        // With a batch of one every counted free wakes a sleeper of its own: no links.
        if !self.chain_links
            || self.algo.load(Ordering::Relaxed) != WakeAlgo::Chain.to_u32()
            || self.wake_batch.load(Ordering::Relaxed) <= 1
        {
            return;
        }
        // As a free's: pairs with the fence at the end of a sleeper's `prepare`. Either that
        // sleeper's retry sees the free tag (whose free happened before our wake-up, so before
        // this fence), or we see it counted in `ws_active` and queued.
        fence(Ordering::SeqCst);
        if self.ws_active.load(Ordering::Relaxed) != 0 {
            // As many as there are free tags now, at most a batch.
            let free = self.sb.depth().saturating_sub(self.sb.weight());
            let n = free.min(self.wake_batch.load(Ordering::Relaxed));
            if n > 0 {
                self.wake_waiters(n as usize);
            }
        }
    }

    /// The first queue with sleepers, from `wake_index` (legacy).
    fn legacy_wake_ptr(&self) -> Option<&WaitState> {
        let start = self.wake_index.load(Ordering::Relaxed);
        for i in 0..SBQ_WAIT_QUEUES {
            let index = (start + i) % SBQ_WAIT_QUEUES;
            let ws = &self.ws[index];
            if ws.wq.waiters() > 0 {
                if index != start {
                    self.wake_index.store(index, Ordering::Relaxed);
                }
                return Some(ws);
            }
        }
        None
    }

    #[cold]
    fn legacy_wake(&self, interrupt: &mut Option<&mut dyn FnMut()>) {
        let Some(ws) = self.legacy_wake_ptr() else {
            return;
        };
        let left = ws.wait_cnt.fetch_sub(1, Ordering::AcqRel) - 1;
        if left != 0 {
            // > 0: not a batch yet. < 0: another free is between our two steps and its reset
            // is trusted to cover this free: this is where the legacy algorithm loses it.
            return;
        }
        if let Some(f) = interrupt.take() {
            f();
        }
        let batch = self.wake_batch.load(Ordering::Relaxed);
        self.wake_index.store(
            (self.wake_index.load(Ordering::Relaxed) + 1) % SBQ_WAIT_QUEUES,
            Ordering::Relaxed,
        );
        ws.wait_cnt.store(batch as i32, Ordering::Release);
        ws.wq.wake_n(batch as usize);
    }
}

/// The future of [`SbitmapQueue::get_async`] (and [`SbitmapQueue::get_async_with`]):
/// resolves to a tag.
///
/// Dropped while queued, it leaves and passes an unused wake-up on.
pub struct GetTag<'a, F = fn(&Sbitmap) -> Option<u32>> {
    sbq: &'a SbitmapQueue,
    f: F,
    queued: Option<(usize, WaitKey)>,
}

impl<F> std::fmt::Debug for GetTag<'_, F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GetTag")
            .field("queued", &self.queued)
            .finish_non_exhaustive()
    }
}

impl<F> GetTag<'_, F> {
    /// Leaves the queue to check next (then take a tag or queue again): keeps the wake-up.
    fn leave_to_check(&mut self) {
        if let Some((i, key)) = self.queued.take() {
            self.sbq.ws[i].wq.finish_async(key);
            self.sbq.ws_active.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Leaves the queue for good without a check made after learning whether a free chose
    /// us: the pass-on rule (module docs).
    fn leave_for_good(&mut self) {
        if let Some((i, key)) = self.queued.take() {
            let sbq = self.sbq;
            sbq.ws[i]
                .wq
                .finish_async_and_pass_on(key, || sbq.wake_waiters(1));
            sbq.ws_active.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

impl<F: FnMut(&Sbitmap) -> Option<u32> + Unpin> Future for GetTag<'_, F> {
    type Output = u32;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<u32> {
        let this = self.get_mut();
        // Learn whether a free chose us *before* looking at the bitmap (as `waitq::WaitFor`
        // does): only a tag found after learning it was chosen uses the wake-up.
        if let Some((i, key)) = this.queued {
            if this.sbq.ws[i].wq.update_waker(key, cx.waker()) {
                // Still queued (a spurious poll): keep our place unless a tag is free.
                if let Some(t) = (this.f)(&this.sbq.sb) {
                    this.leave_for_good();
                    return Poll::Ready(t);
                }
                return Poll::Pending;
            }
            // Chosen: the look below comes after the choice.
            this.leave_to_check();
            if let Some(t) = (this.f)(&this.sbq.sb) {
                this.sbq.chain_on();
                return Poll::Ready(t);
            }
        } else if let Some(t) = (this.f)(&this.sbq.sb) {
            return Poll::Ready(t);
        }
        // Not queued, or chosen but the tag went to someone else: queue again.
        let i = this.sbq.next_ws.fetch_add(1, Ordering::Relaxed) % SBQ_WAIT_QUEUES;
        // As in `get_or_wait_with`: count, queue (fence), retry.
        this.sbq.ws_active.fetch_add(1, Ordering::Relaxed);
        let key = this.sbq.ws[i].wq.prepare_async(cx.waker());
        this.queued = Some((i, key));
        if let Some(t) = (this.f)(&this.sbq.sb) {
            this.leave_for_good(); // found before we could know whether we were chosen
            return Poll::Ready(t);
        }
        Poll::Pending
    }
}

impl<F> Drop for GetTag<'_, F> {
    fn drop(&mut self) {
        // Giving up: an exclusive wake-up spent on us goes on to the next sleeper.
        self.leave_for_good();
    }
}
