//! mq-deadline: sector-sorted lists and deadline FIFOs per direction and priority class.
//!
//! # Lists
//!
//! Per priority class (RT, BE, IDLE) and direction (read; write, which also takes discards
//! and write-zeroes) there is a list of queued requests kept twice: sorted by start sector
//! (the *sort* list, keyed by `(sector, seq)`: `seq` is a per-scheduler insertion number, so
//! keys are unique) and in insertion order with a deadline each (the *FIFO*: insertion time
//! plus `read_expire` or `write_expire`). Flushes and bios flagged
//! [`BioFlags::RESERVED`] skip the lists: they go to a *direct* FIFO that is dispatched first,
//! in arrival order.
//!
//! # Dispatch, one request at a time
//!
//! 1. The direct FIFO, if it holds anything.
//! 2. **Aging**: if requests of two or more classes are queued, the oldest request of BE, then
//!    of IDLE, that has waited `prio_aging_expire` or longer is dispatched now, ahead of any
//!    higher class (so a lower class is never starved for longer than that).
//! 3. Otherwise the highest class with queued requests, alone (lower classes wait):
//!    - **batch**: while the current batch has dispatched fewer than `fifo_batch` requests,
//!      the next one is the queued request of the batch's direction at or after the end of
//!      the previous one (an ascending elevator sweep);
//!    - else a new batch starts. **Direction**: reads, unless writes wait too and reads have
//!      been chosen `writes_starved` times in a row while they did; then writes. **First
//!      request**: the FIFO's head if its deadline has passed (expired requests first), or if
//!      nothing is queued at or after the sweep's position; otherwise the sweep goes on.
//!
//! An expired request therefore waits at most for the end of the current batch.
//!
//! # Merges, at insert
//!
//! A read or write bio is merged into a queued request of the same list (so the same class
//! and direction) with the same op and flags when it is contiguous: at the request's end
//! (back merge) or, if `front_merges`, at its start (front merge); the chain's bytes must stay
//! within the queue's `max_io_bytes` and its bios within [`RequestQueue::max_merge`] (1 for a
//! driver that cannot run a chain: no merges at all). The bio's request joins the queued
//! one's *merge chain* (linked in sector order, see [`crate::queue`]), keeps its own tag, bio
//! and buffer, is never dispatched on its own, and is completed with the chain. A merged
//! request keeps the deadline and FIFO place of the request it joined.
//!
//! When a merge makes a request touch the next (or previous) queued request, the two are
//! merged as well (request-request merge, within the same limits). The survivor is the lower
//! one; it takes the FIFO place and deadline of the other if that one was older.
//!
//! While queued, every request's token (merged ones too) sits in `tokens`, indexed by request
//! index; the chain is linked through [`Request::merged`] when it is dispatched (one pass over the
//! chain), so a merge is O(log n) and allocates nothing.
//!
//! # Sort lists: intrusive treaps, not sorted vectors or a `BTreeMap`
//!
//! A `BTreeMap` allocates a node when a list grows past a node's 11 keys and frees it when
//! it shrinks back, which the lists here do every plug batch: heap traffic per I/O in the
//! steady state. Sorted vectors would allocate nothing but pay a memmove of half the list on every insert
//! and removal (about a tenth of the scheduler's cost at one job, measured). Each sort list is
//! a treap (`tree.rs`) whose nodes are preallocated, one per request
//! index, in [`Scheduler::attach`] and shared by all lists (a request is in one list at a
//! time): insert, removal and the sweep's and merges' searches are O(log n) expected, with
//! no memmove and no allocation. FIFOs are intrusive doubly linked lists through the
//! per-request metadata (O(1) removal of any request).
//!
//! # Tunables ([`DeadlineTunables`]), the kernel's, settable at run time
//!
//! | name                | default | meaning                                                  |
//! |---------------------|---------|----------------------------------------------------------|
//! | `read_expire`       | 500 ms  | deadline of a read                                       |
//! | `write_expire`      | 5 s     | deadline of a write                                      |
//! | `writes_starved`    | 2       | read batches chosen while writes wait, before a write one|
//! | `fifo_batch`        | 16      | requests per batch                                       |
//! | `front_merges`      | 1       | whether front merges are tried                           |
//! | `prio_aging_expire` | 10 s    | wait after which a lower class goes first                |
//! | `async_depth`       | 0 (3/4) | most tags asynchronous requests hold at once (below)     |
//!
//! `async_depth` is the most tags of a tag pool that *asynchronous* requests may hold at once,
//! so that synchronous ones always find a tag under a write flood (the kernel's
//! `dd_limit_depth`). Asynchronous is the kernel's `!op_is_sync` ([`Op::is_sync`]): writes,
//! discards and write-zeroes not flagged [`BioFlags::FUA`] or [`BioFlags::SYNC`]; reads and
//! flushes are synchronous and never limited, nor are reserved-tag requests. Tags are
//! allocated by the queue before the scheduler sees a request, so the queue asks the scheduler
//! first ([`Scheduler::async_depth`]) and takes an asynchronous request's tag with a *shallow*
//! allocation ([`crate::TagPool::get_shallow`]): exact, whatever the pool-full policy.
//!
//! The default (0) follows the kernel's rule since Linux 5.14, `max(1, 3 * nr_requests / 4)`,
//! with the tag pool's depth (per hardware queue, or of the shared pool) as `nr_requests`: a
//! quarter of the tags is kept for synchronous requests. A value of 1 or more is the cap
//! itself (clamped to the depth); the depth or more turns the limit off. (The kernel limits
//! every request but synchronous reads, sync writes included; here FUA and SYNC writes are
//! synchronous too, as `op_is_sync` says.)
//!
//! # Time
//!
//! From a [`Clock`]: the coarse monotonic clock normally, a [`super::ManualClock`] in tests.
//! Read once per insert batch and once per dispatch call.
//!
//! # Locking
//!
//! All of the state is behind a [`SchedLock`], `locked`, `serialized` (serialized dispatch with
//! inserter hand-off, and one contended dispatcher standing by for the owner's hand-off at the
//! end of its round) or `serialized-leave` (the same without the stand-by, kept for comparison),
//! switchable at run time ([`Deadline::set_lock_mode`]). Requests drained from
//! a bucket get their deadline when drained, at most one owner's round after they were punted.
//! Completion counters are sharded atomics, outside the lock.

use blkq_sync::DynArc as Arc;

use super::lock::{LockMode, LockStats, SchedLock};
use super::{Clock, MonotonicClock};
use crate::bio::{BioFlags, IoPrio, Op, SECTOR_SHIFT};
use crate::queue::{Request, RequestQueue, RequestToken};
use crate::sched::Scheduler;

mod state;
mod tree;
mod tunables;

use blkq_sync::stat::ShardedCounters;
use state::{BatchContext, Meta, State};
pub use tunables::DeadlineTunables;

/// The most requests one dispatch call hands out (they are collected under the lock and
/// handed to the driver after it).
pub const DISPATCH_BATCH: usize = 32;

/// No request (end of a list).
const NIL: u32 = u32::MAX;
/// Priority classes.
const NPRIO: usize = 3;
/// Sorted lists: `prio * 2 + dir`.
const NLISTS: usize = NPRIO * 2;
/// The direct FIFO's index in `fifo`.
const DIRECT: usize = NLISTS;
/// `Meta::list` of a request that is not queued on its own (a merge chain member, or not in
/// the scheduler at all).
const NOT_QUEUED: u8 = u8::MAX;

/// Per-priority counters kept under the lock.
const INSERTED: usize = 0;
const MERGED: usize = 1;
const DISPATCHED: usize = 2;
const AGED: usize = 3;

/// Counters of one priority class.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrioStats {
    /// Requests (bios) inserted.
    pub inserted: u64,
    /// Requests merged into another (bio merges and request-request merges).
    pub merged: u64,
    /// Requests handed to the driver (a merge chain counts once).
    pub dispatched: u64,
    /// Requests completed (every request of a chain).
    pub completed: u64,
    /// Requests dispatched ahead of a higher class by aging.
    pub aged: u64,
    /// Requests queued now (chains count once), reads and writes.
    pub queued: [u64; 2],
}

/// A snapshot of mq-deadline's counters. When nothing is in flight,
/// `inserted == dispatched + merged` and `completed == inserted` per class.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeadlineStats {
    /// Per class: RT, BE, IDLE.
    pub prio: [PrioStats; NPRIO],
    /// Flushes and reserved requests queued in the direct FIFO.
    pub direct_queued: u64,
    /// Requests waiting in insert buckets (`serialized`).
    pub in_buckets: u64,
    /// The lock's counters.
    pub lock: LockStats,
}

/// The mq-deadline scheduler. See the [module docs](self).
pub struct Deadline {
    lock: SchedLock<State, RequestToken>,
    tun: Arc<DeadlineTunables>,
    clock: Arc<dyn Clock>,
    completed: ShardedCounters<NPRIO>,
}

impl std::fmt::Debug for Deadline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Deadline")
            .field("lock", &self.lock)
            .field("tunables", &self.tun)
            .finish()
    }
}

/// Default insert buckets: one per shard of the per-thread arrays (a power of two; the lock
/// keeps at most 32); 2 under loom, so the models see a punt land in another bucket.
fn default_buckets() -> usize {
    if cfg!(blkq_loom) {
        2
    } else {
        blkq_sync::stat::shard_count()
    }
}

impl Deadline {
    /// mq-deadline with default tunables, the coarse monotonic clock, and `mode` locking.
    pub fn new(mode: LockMode) -> Self {
        Self {
            lock: SchedLock::new(State::new(), mode, default_buckets()),
            tun: Arc::new(DeadlineTunables::default()),
            clock: Arc::new(MonotonicClock),
            completed: ShardedCounters::new(),
        }
    }

    /// Reads the time from `clock` instead.
    pub fn with_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// Uses `tun` (shared with whoever changes them at run time).
    pub fn with_tunables(mut self, tun: Arc<DeadlineTunables>) -> Self {
        self.tun = tun;
        self
    }

    /// The broken protocol of [`SchedLock::without_recheck`], for the loom test only.
    #[doc(hidden)]
    pub fn without_recheck(mut self) -> Self {
        self.lock = self.lock.without_recheck();
        self
    }

    /// The tunables, settable at run time.
    pub fn tunables(&self) -> &Arc<DeadlineTunables> {
        &self.tun
    }

    /// The lock design in use.
    pub fn lock_mode(&self) -> LockMode {
        self.lock.mode()
    }

    /// Switches the lock design, also while I/O runs.
    pub fn set_lock_mode(&self, m: LockMode) {
        self.lock.set_mode(m);
    }

    /// A snapshot of the counters (takes the state's mutex briefly).
    pub fn stats(&self) -> DeadlineStats {
        let mut out = DeadlineStats::default();
        self.lock.with_state(|st| {
            for (p, ps) in out.prio.iter_mut().enumerate() {
                ps.inserted = st.counts[p][INSERTED];
                ps.merged = st.counts[p][MERGED];
                ps.dispatched = st.counts[p][DISPATCHED];
                ps.aged = st.counts[p][AGED];
                ps.queued = [
                    u64::from(st.fifo[p * 2].len),
                    u64::from(st.fifo[p * 2 + 1].len),
                ];
            }
            out.direct_queued = u64::from(st.fifo[DIRECT].len);
        });
        for (p, ps) in out.prio.iter_mut().enumerate() {
            ps.completed = self.completed.sum(p);
        }
        out.in_buckets = self.lock.in_buckets() as u64;
        out.lock = self.lock.stats();
        out
    }

    fn batch_context(&self, q: &RequestQueue) -> BatchContext {
        BatchContext {
            now: self.clock.now_ns(),
            tun: self.tun.snapshot(),
            merge: q.max_merge() > 1,
            max_bytes: u64::from(q.limits().max_io_bytes),
            max_merge: q.max_merge(),
        }
    }

    /// Puts one request into the state: merged into a queued one, or queued itself.
    fn insert_one(st: &mut State, q: &RequestQueue, r: RequestToken, ctx: &BatchContext) {
        let rq_idx = r.index();
        if rq_idx as usize >= st.meta.len() {
            // Only if the queue did not call `attach` (cold).
            st.ensure(rq_idx as usize + 1);
        }
        let (op, flags, prio, start, len) = match q.rq(&r).bio() {
            Some(b) => (b.op, b.flags, b.prio, b.sector, u64::from(b.len)),
            None => (Op::Flush, BioFlags::NONE, IoPrio::Be, 0, 0),
        };
        let p = prio as usize;
        st.counts[p][INSERTED] += 1;
        let direct = op == Op::Flush || flags.contains(BioFlags::RESERVED);
        let dir = op.dir();
        let end = if direct {
            start
        } else {
            start.saturating_add(len >> SECTOR_SHIFT)
        };
        let l = if direct { DIRECT } else { p * 2 + dir };
        let r = if !direct && ctx.merge && op.has_data() {
            match st.merge_bio(r, l, start, end, len, op, flags, ctx) {
                Ok(bridged) => {
                    st.counts[p][MERGED] += 1;
                    q.account_merge(dir);
                    if bridged {
                        q.account_merge(dir);
                    }
                    return;
                }
                Err(r) => r,
            }
        } else {
            r
        };
        let seq = st.seq;
        st.seq += 1;
        *st.meta_mut(rq_idx) = Meta {
            start,
            end,
            seq,
            deadline: ctx.now.saturating_add(ctx.tun.expire[dir]),
            inserted: ctx.now,
            bytes: len,
            nr_bios: 1,
            first: rq_idx,
            last: rq_idx,
            fifo_prev: NIL,
            fifo_next: NIL,
            list: l as u8,
            prio: p as u8,
            op,
            flags,
            chain_prev: NIL,
            chain_next: NIL,
        };
        if !direct {
            st.sort_insert(l, rq_idx, start, seq);
        }
        st.fifo_push(l, rq_idx);
        st.tokens[rq_idx as usize] = Some(r);
    }
}

impl Scheduler for Deadline {
    fn name(&self) -> &'static str {
        "mq-deadline"
    }

    fn attach(&self, q: &RequestQueue) {
        let n = q.nr_requests();
        self.lock.with_state(|st| st.ensure(n));
        self.lock.reserve(n);
    }

    fn insert(&self, q: &RequestQueue, rq: RequestToken) {
        self.insert_batch(q, &mut std::iter::once(rq));
    }

    fn insert_batch(&self, q: &RequestQueue, rqs: &mut dyn Iterator<Item = RequestToken>) {
        let ctx = self.batch_context(q);
        self.lock
            .insert(rqs, |st, r| Self::insert_one(st, q, r, &ctx));
    }

    fn dispatch(&self, q: &RequestQueue, max: usize, sink: &mut dyn FnMut(RequestToken)) -> usize {
        let max = max.min(DISPATCH_BATCH);
        if max == 0 {
            return 0;
        }
        let ctx = self.batch_context(q);
        let mut buf: [Option<RequestToken>; DISPATCH_BATCH] = [const { None }; DISPATCH_BATCH];
        let mut n = 0;
        self.lock.dispatch(
            |st, r| Self::insert_one(st, q, r, &ctx),
            |st| {
                while n < max {
                    let Some(h) = st.select(ctx.now, &ctx.tun) else {
                        break;
                    };
                    match st.take(q, h) {
                        Some(r) => {
                            buf[n] = Some(r);
                            n += 1;
                        }
                        None => break,
                    }
                }
            },
        );
        // The driver runs outside the lock: it may complete inline, and the completion may
        // submit again (and so insert and dispatch).
        for r in buf.iter_mut().take(n).filter_map(Option::take) {
            sink(r);
        }
        n
    }

    fn async_depth(&self, depth: u32) -> Option<u32> {
        Some(self.tun.async_depth_for(depth))
    }

    fn completed(&self, _q: &RequestQueue, rq: &Request) {
        let p = rq.bio().map_or(IoPrio::Be, |b| b.prio) as usize;
        self.completed.add(p, 1);
    }

    fn lock_stats(&self) -> LockStats {
        self.lock.stats()
    }

    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }
}
