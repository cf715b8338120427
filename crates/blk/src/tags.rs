//! Tag pools and the pool-full policy ("io stalls": who gets the next free request when the
//! pool is full, FIFO hand-off against batch ownership).
//!
//! A [`TagPool`] is an [`SbitmapQueue`] plus a policy for the moment it runs dry:
//!
//! - [`PoolPolicy::Steal`] (today's kernel): a sleeper is woken by the batched wake-ups of
//!   the tag bitmap, and anyone, newcomer or sleeper, may take a freed tag.
//! - [`PoolPolicy::Fifo`]: strict hand-off. While anyone waits, newcomers queue behind them,
//!   and a freed tag is given to the oldest waiter directly (it does not race for it).
//! - [`PoolPolicy::Batch`]: FIFO, plus batch ownership: a waiter that was handed a tag becomes
//!   the *batcher* for its direction (read or write) and may take up to `batch_requests` tags
//!   within `batch_time` without queueing, as long as tags are free. Throughput for whoever
//!   streams; bounded latency for the rest.
//!
//! # The hand-off gate (Fifo, Batch)
//!
//! | field     | meaning                                                             |
//! |-----------|---------------------------------------------------------------------|
//! | `queue`   | waiters, oldest first, each with a hand-off cell on its own stack     |
//! | `waiting` | `queue.len()`, written under the lock, read without it               |
//!
//! A waiter queues under the lock, publishes `waiting`, then (still under the lock) refills:
//! it moves free tags from the bitmap to the oldest waiters. A free puts its tag back in the
//! bitmap, then fences and reads `waiting`; if non-zero it takes the lock and refills. The
//! store of `waiting` and the bitmap RMW of the free are ordered against each other's loads
//! by SeqCst fences on both sides (a store-buffer pattern, like the wait queue's), so either
//! the waiter's refill sees the freed bit or the free sees the waiter and refills for it.
//!
//! A hand-off writes the tag into the waiter's hand-off cell on its stack (Release) after
//! removing the waiter from the queue, under the lock; that store is the waker's last access to
//! the cell. The waiter returns only after reading the cell (Acquire), so the cell outlives
//! every access.
//!
//! # Shallow allocation (a scheduler's `async_depth`)
//!
//! A scheduler may cap the tags that *asynchronous* requests hold at once
//! ([`crate::Scheduler::async_depth`]; mq-deadline's `async_depth`), so that synchronous reads
//! always find a tag under a write flood: the kernel's `dd_limit_depth`. The queue allocates an
//! asynchronous request's tag with [`TagPool::get_shallow`] and frees it with
//! [`TagPool::put_shallow`]. Here the cap is exact: `shallow_in_use` counts the tags held by
//! shallow allocations, and a shallow allocation first reserves room under the cap in it (a
//! CAS loop, `Relaxed`: a count, not a publication; the bitmap orders the request cells), then
//! takes a bit, giving the room back if there is none. (The kernel caps each bitmap word at a
//! share of the depth instead, which is cheaper but only approximate.)
//!
//! | field            | meaning                                                          |
//! |------------------|------------------------------------------------------------------|
//! | `shallow_in_use` | tags held by shallow allocations (room reserved, or bit taken)   |
//! | `shallow_limit`  | the last cap asked for; when it changes, the bitmap's wake batch |
//! |                  | is recomputed for it and every sleeper looks again                |
//!
//! A shallow allocation that finds no room sleeps on the bitmap's wait queues, whatever the
//! pool-full policy (it never queues at the hand-off gate: a write held back by its cap must not
//! stand in front of the reads the cap is for; nor does it use or earn a `batch` allowance). Its wake-up is the ordinary batched one: the
//! free of a shallow tag decrements `shallow_in_use` *before* it frees the bit, and the bitmap's
//! free runs a SeqCst fence before it looks for sleepers, which pairs with the fence a sleeper
//! runs after queueing and before its last retry; so either that retry sees the room or the
//! free sees the sleeper (the store-buffer pattern again; `tests/loom_tags.rs`
//! `loom_shallow_wake_is_not_lost` finds the lost wake-up when the free gives the bit back
//! before the count). A sleeper that finds no room sleeps
//! only while `limit` shallow tags are in flight, whose frees are enough wake-ups because the
//! wake batch is computed for the cap (`set_min_shallow_depth`: per bitmap word, the cap's share
//! of it).
//!
//! The gate is a *targeted* hand-off: each freed tag goes to one chosen thread, with the tag as
//! payload. That is why it keeps its own queue of waiters and wakes the chosen threads through a
//! `waitq::WakeList` (the wait queue's own bounded on-stack list, woken outside the lock) rather than a
//! `waitq::WaitQueue`, whose wake-ups go to its own oldest entries and carry nothing; the
//! sleep itself is the wait queue protocol's shape (publish, fence, re-check, park, re-check).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use blkq_sync::atomic::{fence, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use blkq_sync::thread::{self, Thread, ThreadId};
use blkq_sync::Mutex;
use sbitmap::{SbitmapQueue, WakeAlgo};
use waitq::WakeList;

use crate::stats::{WaitSnapshot, WaitStats};
use crate::Error;

/// Who gets the next free tag when the pool is full.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PoolPolicy {
    /// Anyone may take a freed tag (batched wake-ups from the bitmap).
    #[default]
    Steal,
    /// Strict FIFO hand-off.
    Fifo,
    /// FIFO with batch ownership.
    Batch,
}

impl PoolPolicy {
    fn to_u32(self) -> u32 {
        match self {
            PoolPolicy::Steal => 0,
            PoolPolicy::Fifo => 1,
            PoolPolicy::Batch => 2,
        }
    }

    fn from_u32(v: u32) -> Self {
        match v {
            1 => PoolPolicy::Fifo,
            2 => PoolPolicy::Batch,
            _ => PoolPolicy::Steal,
        }
    }
}

impl std::str::FromStr for PoolPolicy {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        match s {
            "steal" => Ok(PoolPolicy::Steal),
            "fifo" => Ok(PoolPolicy::Fifo),
            "batch" => Ok(PoolPolicy::Batch),
            _ => Err(Error::Config(format!(
                "unknown policy {s:?} (expected steal, fifo or batch)"
            ))),
        }
    }
}

const NO_TAG: u32 = u32::MAX;

struct GateWaiter {
    thread: Thread,
    /// The waiter's hand-off cell: an `AtomicU32` on its stack (see the module docs).
    handoff: *const AtomicU32,
}

// SAFETY: the hand-off pointer is only dereferenced under the gate lock while the waiter is
// queued, and the waiter cannot return (and free its stack cell) before it reads a tag from it.
unsafe impl Send for GateWaiter {}

/// Threads handed a tag, to wake after the gate lock is dropped: the wait queue's bounded
/// on-stack [`WakeList`] (so a refill allocates nothing), and whether more waiters and tags may
/// remain once it is woken (the list was full).
struct HandedOff {
    threads: WakeList,
    more: bool,
}

/// The batch owner of one direction (`Batch` policy).
#[derive(Debug, Default)]
struct BatchOwner {
    /// The owning thread. A `ThreadId`, never `thread_slot()`: the slot is a hint that may be
    /// shared (it is 0 for every thread under loom), and ownership decides who may skip the
    /// gate.
    thread: Option<ThreadId>,
    left: u32,
    until: Option<Instant>,
}

/// A tag pool with its pool-full policy and wait statistics.
#[derive(Debug)]
pub struct TagPool {
    sbq: SbitmapQueue,
    policy: AtomicU32,
    waiting: AtomicUsize,
    queue: Mutex<VecDeque<GateWaiter>>,
    owners: [Mutex<BatchOwner>; 2],
    batch_requests: AtomicU32,
    batch_time_ns: AtomicU64,
    /// Soft limit on tags in use (`max_in_flight`), `NO_LIMIT` when off; only a batch owner
    /// may go past it (up to the bitmap's depth), as batch owners in the classic request
    /// allocator could go past `nr_requests`.
    soft_limit: AtomicU32,
    /// Tags in use, counted only while a soft limit is set.
    in_use: AtomicU32,
    /// Tags held by shallow allocations (module docs).
    shallow_in_use: AtomicU32,
    /// The last shallow cap asked for (`NO_LIMIT`: none yet).
    shallow_limit: AtomicU32,
    waits: WaitStats,
}

const NO_LIMIT: u32 = u32::MAX;

impl std::fmt::Debug for GateWaiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GateWaiter").finish_non_exhaustive()
    }
}

impl TagPool {
    /// A pool of `depth` tags.
    pub fn new(depth: u32, algo: WakeAlgo, policy: PoolPolicy) -> Result<Self, Error> {
        Ok(Self {
            sbq: SbitmapQueue::new(depth, None, false, algo)?,
            policy: AtomicU32::new(policy.to_u32()),
            waiting: AtomicUsize::new(0),
            queue: Mutex::new(VecDeque::new()),
            owners: [
                Mutex::new(BatchOwner::default()),
                Mutex::new(BatchOwner::default()),
            ],
            batch_requests: AtomicU32::new(32),
            batch_time_ns: AtomicU64::new(10_000_000),
            soft_limit: AtomicU32::new(NO_LIMIT),
            in_use: AtomicU32::new(0),
            shallow_in_use: AtomicU32::new(0),
            shallow_limit: AtomicU32::new(NO_LIMIT),
            waits: WaitStats::new(),
        })
    }

    /// The underlying tag bitmap queue.
    pub fn sbq(&self) -> &SbitmapQueue {
        &self.sbq
    }

    /// The policy.
    pub fn policy(&self) -> PoolPolicy {
        PoolPolicy::from_u32(self.policy.load(Ordering::Relaxed))
    }

    /// Switches the policy at run time. Waiters already queued at the gate are served first.
    pub fn set_policy(&self, p: PoolPolicy) {
        self.policy.store(p.to_u32(), Ordering::Relaxed);
        // Let every kind of sleeper look again under the new rules.
        self.sbq.wake_all();
        self.refill();
    }

    /// Batch ownership limits (`Batch` policy): tags per batch and its time window.
    pub fn set_batch(&self, requests: u32, time: Duration) {
        self.batch_requests
            .store(requests.max(1), Ordering::Relaxed);
        self.batch_time_ns
            .store(time.as_nanos() as u64, Ordering::Relaxed);
    }

    /// Sets the soft limit on tags in use (`max_in_flight`; `None` or the depth: off). Only
    /// a batch owner may allocate past it. Meant to be set while the pool is idle: the in-use
    /// count starts from the bitmap's weight at this moment.
    pub fn set_max_in_flight(&self, n: Option<u32>) {
        let depth = self.sbq.bitmap().depth();
        match n {
            Some(n) if n < depth => {
                self.in_use
                    .store(self.sbq.bitmap().weight(), Ordering::Relaxed);
                self.soft_limit.store(n.max(1), Ordering::Relaxed);
            }
            _ => self.soft_limit.store(NO_LIMIT, Ordering::Relaxed),
        }
        self.sbq.wake_all();
        self.refill();
    }

    /// Takes a tag within the soft limit.
    #[inline]
    fn take(&self) -> Option<u32> {
        let limit = self.soft_limit.load(Ordering::Relaxed);
        if limit == NO_LIMIT {
            return self.sbq.get();
        }
        // Reserve room under the limit first, then a bit; give the room back on failure.
        if !reserve_below(&self.in_use, limit) {
            return None;
        }
        let t = self.sbq.get();
        if t.is_none() {
            self.in_use.fetch_sub(1, Ordering::Relaxed);
        }
        t
    }

    /// Takes a tag past the soft limit (batch owners).
    fn take_unlimited(&self) -> Option<u32> {
        let limited = self.soft_limit.load(Ordering::Relaxed) != NO_LIMIT;
        if limited {
            self.in_use.fetch_add(1, Ordering::Relaxed);
        }
        let t = self.sbq.get();
        if t.is_none() && limited {
            self.in_use.fetch_sub(1, Ordering::Relaxed);
        }
        t
    }

    /// Tags held right now by shallow allocations ([`TagPool::get_shallow`]).
    pub fn shallow_in_use(&self) -> u32 {
        self.shallow_in_use.load(Ordering::Relaxed)
    }

    /// Records `limit` as the shallow cap in use; on a change, recomputes the bitmap's wake
    /// batch for it (so `limit` tags in flight are enough wake-ups) and lets every sleeper
    /// look again under the new cap.
    #[inline]
    fn note_shallow_limit(&self, limit: u32) {
        if self.shallow_limit.load(Ordering::Relaxed) == limit {
            return;
        }
        self.shallow_limit.store(limit, Ordering::Relaxed);
        let sb = self.sbq.bitmap();
        let depth = u64::from(sb.depth().max(1));
        let bpw = 1u64 << sb.shift();
        let per_word = (u64::from(limit) * bpw / depth).clamp(1, bpw) as u32;
        self.sbq.set_min_shallow_depth(per_word);
        self.sbq.wake_all();
    }

    /// Takes a tag within the shallow cap `limit` (and the soft limit).
    #[inline]
    fn take_shallow(&self, limit: u32) -> Option<u32> {
        // Reserve room under the cap, then a bit; give the room back on failure.
        if !reserve_below(&self.shallow_in_use, limit) {
            return None;
        }
        let t = self.take();
        if t.is_none() {
            self.shallow_in_use.fetch_sub(1, Ordering::Relaxed);
        }
        t
    }

    /// Allocates a tag for an asynchronous request, holding at most `limit` shallow tags at
    /// once (module docs), without sleeping. Under `fifo` and `batch` a newcomer does not
    /// pass the submitters queued at the gate.
    #[inline]
    pub fn get_shallow_nowait(&self, limit: u32) -> Option<u32> {
        // A cap of 0 would never be met: 1 at least, as the kernel's `async_depth`.
        let limit = limit.max(1);
        self.note_shallow_limit(limit);
        if self.policy() != PoolPolicy::Steal && self.waiting.load(Ordering::Relaxed) != 0 {
            return None;
        }
        self.take_shallow(limit)
    }

    /// Allocates a tag for an asynchronous request, holding at most `limit` shallow tags at
    /// once, sleeping on the bitmap's wait queues until there is room (module docs). Free it
    /// with [`TagPool::put_shallow`].
    pub fn get_shallow(&self, limit: u32) -> u32 {
        let limit = limit.max(1);
        if let Some(t) = self.get_shallow_nowait(limit) {
            return t;
        }
        let t0 = self.waits.start();
        let t = self.sbq.get_or_wait_with(|_| self.take_shallow(limit));
        self.waits.record(t0);
        t
    }

    /// Frees a tag allocated by [`TagPool::get_shallow`] or [`TagPool::get_shallow_nowait`].
    /// Returns `false` if it was not allocated.
    #[inline]
    pub fn put_shallow(&self, tag: u32) -> bool {
        // The room first, then the bit: the bit's free issues the wake-ups, and a woken
        // sleeper must find the room (module docs). Saturating, so a double free (a caller
        // bug, reported by `put`) cannot wrap the count.
        let _ = self
            .shallow_in_use
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
                Some(v.saturating_sub(1))
            });
        self.put(tag)
    }

    /// Tag-wait statistics.
    pub fn wait_stats(&self) -> WaitSnapshot {
        self.waits.snapshot()
    }

    /// Number of submitters queued at the hand-off gate.
    pub fn gate_waiters(&self) -> usize {
        self.waiting.load(Ordering::Relaxed)
    }

    /// Allocates a tag without sleeping (within the soft limit).
    #[inline]
    pub fn try_get(&self) -> Option<u32> {
        self.take()
    }

    /// Allocates a tag for direction `dir` if the policy lets this thread have one without
    /// waiting (a batch owner's allowance, or a free tag with nobody queued at the gate).
    #[inline]
    pub fn get_nowait(&self, dir: usize) -> Option<u32> {
        match self.policy() {
            PoolPolicy::Steal => self.take(),
            _ => {
                if self.may_batch(dir) {
                    if let Some(t) = self.take_unlimited() {
                        return Some(t);
                    }
                }
                if self.waiting.load(Ordering::Relaxed) == 0 {
                    return self.take();
                }
                None
            }
        }
    }

    /// Allocates a tag for direction `dir` (0 read, 1 write), sleeping per the policy if the
    /// pool is full.
    #[inline]
    pub fn get(&self, dir: usize) -> u32 {
        match self.policy() {
            PoolPolicy::Steal => {
                if let Some(t) = self.take() {
                    return t;
                }
                let t0 = self.waits.start();
                let t = self.sbq.get_or_wait_with(|_| self.take());
                self.waits.record(t0);
                t
            }
            p => {
                if self.may_batch(dir) {
                    if let Some(t) = self.take_unlimited() {
                        return t;
                    }
                }
                if self.waiting.load(Ordering::Relaxed) == 0 {
                    if let Some(t) = self.take() {
                        return t;
                    }
                }
                self.get_gate(dir, p)
            }
        }
    }

    /// Whether the current thread owns an unexpired batch for `dir`; consumes one from it.
    fn may_batch(&self, dir: usize) -> bool {
        if self.policy() != PoolPolicy::Batch {
            return false;
        }
        let mut o = self.owners[dir & 1].lock();
        // The thread's identity is read only when there is an allowance left to spend.
        let mine = o.left > 0 && o.thread.is_some_and(|t| t == thread::current().id());
        if !mine || o.until.is_none_or(|u| Instant::now() >= u) {
            return false;
        }
        o.left -= 1;
        true
    }

    #[cold]
    fn get_gate(&self, dir: usize, policy: PoolPolicy) -> u32 {
        let t0 = self.waits.start();
        let handoff = AtomicU32::new(NO_TAG);
        {
            let mut q = self.queue.lock();
            if q.is_empty() {
                if let Some(t) = self.take() {
                    return t;
                }
            }
            q.push_back(GateWaiter {
                thread: thread::current(),
                handoff: &handoff,
            });
            self.waiting.store(q.len(), Ordering::Relaxed);
            // We must order the `waiting` store before the refill's bitmap reads, pairing with
            // the fence in `put` after the free's bitmap RMW (module docs).
            fence(Ordering::SeqCst);
            let handed = self.refill_locked(&mut q);
            drop(q);
            self.unpark_all(handed);
        }
        let tag = loop {
            // Acquire: pairs with the Release store of the hand-off.
            let t = handoff.load(Ordering::Acquire);
            if t != NO_TAG {
                break t;
            }
            thread::park();
        };
        self.waits.record(t0);
        if policy == PoolPolicy::Batch {
            let mut o = self.owners[dir & 1].lock();
            o.thread = Some(thread::current().id());
            o.left = self
                .batch_requests
                .load(Ordering::Relaxed)
                .saturating_sub(1);
            o.until = Some(
                Instant::now() + Duration::from_nanos(self.batch_time_ns.load(Ordering::Relaxed)),
            );
        }
        tag
    }

    /// Hands free tags to the oldest waiters, with the gate lock held; returns whom to
    /// unpark once the lock is dropped (wake outside the lock), and whether more may be due.
    fn refill_locked(&self, q: &mut VecDeque<GateWaiter>) -> HandedOff {
        let mut h = HandedOff {
            threads: WakeList::new(),
            more: false,
        };
        while !q.is_empty() && !h.threads.is_full() {
            if q.is_empty() {
                break;
            }
            let Some(t) = self.take() else {
                break;
            };
            let Some(w) = q.pop_front() else {
                break;
            };
            // SAFETY: `w` was queued until the line above, so its owner is still parked in
            // `get_gate` and its hand-off cell is alive; this store is our last access to it.
            unsafe { (*w.handoff).store(t, Ordering::Release) };
            h.threads.push_thread(w.thread);
        }
        h.more = h.threads.is_full() && !q.is_empty();
        self.waiting.store(q.len(), Ordering::Relaxed);
        h
    }

    fn unpark_all(&self, mut h: HandedOff) {
        h.threads.wake();
        if h.more {
            self.refill();
        }
    }

    fn refill(&self) {
        let h = {
            let mut q = self.queue.lock();
            self.refill_locked(&mut q)
        };
        self.unpark_all(h);
    }

    /// Frees a tag. Returns `false` if it was not allocated.
    #[inline]
    pub fn put(&self, tag: u32) -> bool {
        if self.soft_limit.load(Ordering::Relaxed) != NO_LIMIT {
            // The count first, then the bit: the bit's free issues the wake-ups, and a sleeper
            // woken by it must find the room under the limit (as for the shallow cap: module
            // docs; `loom_soft_limit_wake_is_not_lost` finds the lost wake-up the other way
            // round). Saturating: a tag taken before the limit was set may be freed after. (A
            // bad free, refused below, leaves the count one low: the limit is a soft one.)
            let _ = self
                .in_use
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
                    Some(v.saturating_sub(1))
                });
        }
        if !self.sbq.put(tag) {
            return false;
        }
        if self.policy() != PoolPolicy::Steal || self.waiting.load(Ordering::Relaxed) != 0 {
            // We must order our free before the load of `waiting`, pairing with the fence in
            // `get_gate` (module docs). `SbitmapQueue::put` already ran a SeqCst fence after
            // the bitmap RMW (its own `ws_active` check), which is why the loom model still
            // passes without this one; we keep ours so this argument does not depend on
            // sbitmap's internals. It costs one fence per free, in fifo/batch mode only.
            fence(Ordering::SeqCst);
            if self.waiting.load(Ordering::Relaxed) != 0 {
                self.refill();
            }
        }
        true
    }
}

/// Adds one to `count` if it is below `limit`; false (and `count` unchanged) otherwise.
/// Relaxed: the count is a limit, not a publication; the bitmap orders the data (module
/// docs).
#[inline]
fn reserve_below(count: &AtomicU32, limit: u32) -> bool {
    let mut cur = count.load(Ordering::Relaxed);
    loop {
        if cur >= limit {
            return false;
        }
        match count.compare_exchange_weak(cur, cur + 1, Ordering::Relaxed, Ordering::Relaxed) {
            Ok(_) => return true,
            Err(v) => cur = v,
        }
    }
}
