//! The request queue: bio -> tag -> preallocated request -> driver -> completion.
//!
//! ```text
//!  submit(bio) -- validate --> tag (TagPool: may sleep per policy; asynchronous requests
//!                                   take it shallowly under a scheduler's async_depth)
//!     -> request cell of that tag (preallocated; no allocation per I/O)
//!     -> [plug: collect up to plug_limit] -> driver.queue_rq(rq) ... driver.commit()
//!  driver ... complete(rq, status) -> stats -> tag freed (batched wake-ups) -> end_io(bio)
//! ```
//!
//! # Ownership of a request cell
//!
//! Request cell `i` belongs to whoever holds its tag. The tag is taken with an Acquire RMW on the
//! bitmap and freed with a Release RMW (see `sbitmap`), so each owner's accesses happen-after
//! the previous owner's. Inside blk, ownership travels as a [`RequestToken`]: a non-`Clone` token
//! created when the tag is allocated and consumed by [`RequestQueue::complete`]. Only the holder
//! of the token can reach the cell, so the `UnsafeCell` access is exclusive.
//!
//! # Completion order
//!
//! `complete` takes the bio out of the cell, frees the tag, then calls `end_io`. Freeing
//! first means an `end_io` that submits again (or that runs inline, nested inside `submit`)
//! never waits for the tag its own request still holds.
//!
//! # Merged requests
//!
//! A scheduler may merge requests whose bios are contiguous (mq-deadline does, at insert). The
//! queue splits nothing and joins no buffers: each bio keeps its own request, tag and buffer,
//! and the requests are linked in sector order through [`Request::merged`], which holds the
//! *token* of the next request of the chain. Whoever holds the first token therefore owns the
//! whole chain; the driver gets the first request only and executes every bio of the chain
//! ([`RequestQueue::for_each_bio`]); `complete` of the first completes every request of the chain,
//! in chain order, with the same status. The link lives in the preallocated cell, so merging
//! allocates nothing and has no length bound other than the scheduler's (the queue's
//! `max_io_bytes` for the chain, and [`Driver::max_merge`] bios).
//!
//! A driver that cannot execute a chain (the `file` driver's asynchronous engines, which give
//! each request one engine op) says so with `max_merge() == 1`, the default: a driver that
//! does not know about chains must never receive one, since `complete` would report the bios
//! it did not execute as done.

mod driver;
mod plug;
mod request;

pub use self::driver::Driver;
pub use self::plug::Plug;
use self::plug::{with_thread_plug, PlugTail};
use self::request::RequestCell;
pub use self::request::{Request, RequestToken};

use std::fmt;
use std::os::fd::BorrowedFd;

use blkq_sync::DynArc as Arc;

use blkq_sync::{CachePadded, UnsafeCell};
use sbitmap::WakeAlgo;

use crate::bio::{Bio, EndIo, Op, SECTOR_SHIFT};
use crate::device::{Caps, Device, Extent, Limits};
use crate::sched::Scheduler;
use crate::stats::{
    batch_ns, ClockBatch, DiskCounters, DiskStats, QueueStats, SchedStats, WaitSnapshot,
};
use crate::tags::{PoolPolicy, TagPool};
use crate::Error;

/// How to build a queue.
#[derive(Debug, Clone)]
pub struct QueueConfig {
    /// Hardware contexts (submission queues).
    pub nr_hw_queues: u16,
    /// Tags per hardware context (or in all, with `shared_tags`).
    pub queue_depth: u32,
    /// One tag bitmap shared by every hardware context (the shared-tag-set experiment: many
    /// hardware queues on one bitmap).
    pub shared_tags: bool,
    /// Extra tags per pool kept for bios flagged [`crate::BioFlags::RESERVED`] (internal
    /// commands that must not wait behind ordinary I/O), as blk-mq's reserved tags.
    pub reserved_tags: u32,
    /// Wake-up algorithm of the tag bitmaps.
    pub wake: WakeAlgo,
    /// Pool-full policy.
    pub policy: PoolPolicy,
    /// Requests a plug collects before it flushes to the driver.
    pub plug_limit: usize,
    /// Device limits.
    pub limits: Limits,
}

impl QueueConfig {
    /// Defaults for a device of `capacity` bytes: one hardware queue of depth 64.
    pub fn new(capacity: u64) -> Self {
        Self {
            nr_hw_queues: 1,
            queue_depth: 64,
            shared_tags: false,
            reserved_tags: 0,
            wake: WakeAlgo::Counter,
            policy: PoolPolicy::Steal,
            plug_limit: 32,
            limits: Limits {
                capacity,
                logical_block_size: 512,
                max_io_bytes: 1 << 20,
            },
        }
    }
}

/// A request queue: its tags, requests, driver and scheduler, shared by its owner ([`Queue`])
/// and the driver, which is handed it to complete requests and restart the queue.
pub struct RequestQueue {
    limits: Limits,
    depth: u32,
    shared: bool,
    pools: Box<[Arc<TagPool>]>,
    /// Reserved pools, one per entry of `pools` (empty without reserved tags).
    reserved: Box<[Arc<TagPool>]>,
    reserved_depth: u32,
    requests: Box<[CachePadded<RequestCell>]>,
    driver: Box<dyn Driver>,
    sched: Option<Box<dyn Scheduler>>,
    stats: DiskCounters,
    plug_limit: usize,
    /// `driver.max_merge()`, read once.
    max_merge: u32,
}

impl fmt::Debug for RequestQueue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RequestQueue")
            .field("limits", &self.limits)
            .field("depth", &self.depth)
            .field("hw_queues", &self.pools.len())
            .field("shared", &self.shared)
            .field("driver", &self.driver.describe())
            .finish()
    }
}

impl RequestQueue {
    #[inline]
    fn pool_index(&self, hctx: u16) -> usize {
        if self.shared {
            0
        } else {
            hctx as usize
        }
    }

    /// Request cells: every ordinary tag of every pool first, then every reserved tag.
    #[inline]
    fn request_index(&self, hctx: u16, tag: u32, reserved: bool) -> u32 {
        let p = self.pool_index(hctx) as u32;
        if reserved {
            self.pools.len() as u32 * self.depth + p * self.reserved_depth + tag
        } else {
            p * self.depth + tag
        }
    }

    #[inline]
    fn pool_of(&self, hctx: u16, reserved: bool) -> &TagPool {
        let p = self.pool_index(hctx);
        if reserved {
            &self.reserved[p]
        } else {
            &self.pools[p]
        }
    }

    /// This queue's identity, as debug builds record it in every [`RequestToken`]: the
    /// address of its request table, unique among live queues.
    #[cfg(debug_assertions)]
    #[inline]
    fn id(&self) -> usize {
        self.requests.as_ptr() as usize
    }

    /// Makes the token of request `idx` (the one place besides [`RequestQueue::token_from_index`]
    /// where tokens are born).
    #[inline]
    fn make_token(&self, idx: u32) -> RequestToken {
        RequestToken {
            idx,
            #[cfg(debug_assertions)]
            queue: self.id(),
        }
    }

    /// Debug builds: `r` belongs to this queue.
    #[inline]
    fn check_token(&self, r: &RequestToken) {
        #[cfg(debug_assertions)]
        assert_eq!(
            r.queue,
            self.id(),
            "RequestToken {} used on a queue it does not belong to",
            r.idx
        );
        let _ = r;
    }

    /// Rebuilds the token of request `idx`, for a driver that carried a request through an
    /// asynchronous engine as its bare [`RequestToken::index`] (an io_uring `user_data`):
    /// the driver gives the token up when it hands the index to the engine (dropping or
    /// forgetting it), and rebuilds it once, in the engine's completion.
    ///
    /// # Safety
    ///
    /// `idx` must be the index of a request in flight on *this* queue whose token the caller
    /// owns: one given up by whoever held it and rebuilt at most once. A second live token
    /// for the same request would alias the `&mut Request` of [`RequestQueue::rq_mut`], and
    /// completing both would free one tag twice.
    #[inline]
    pub unsafe fn token_from_index(&self, idx: u32) -> RequestToken {
        debug_assert!(
            (idx as usize) < self.requests.len(),
            "request index {idx} out of range"
        );
        self.make_token(idx)
    }

    /// Read access to a request.
    #[inline]
    pub fn rq<'a>(&'a self, r: &'a RequestToken) -> &'a Request {
        self.check_token(r);
        // SAFETY: the holder of `r` owns the cell (module docs); the shared borrow is tied to
        // `&r`, so no `&mut` from `rq_mut` can coexist with it.
        self.requests[r.idx as usize].0 .0.with(|p| unsafe { &*p })
    }

    /// Write access to a request (its fields stay private: see [`Request`]).
    #[inline]
    #[allow(clippy::mut_from_ref)] // exclusivity comes from `&mut RequestToken`, the owning token
    pub fn rq_mut<'a>(&'a self, r: &'a mut RequestToken) -> &'a mut Request {
        self.check_token(r);
        // SAFETY: as in `rq`; `&mut r` makes this borrow exclusive for as long as it lives.
        self.requests[r.idx as usize]
            .0
             .0
            .with_mut(|p| unsafe { &mut *p })
    }

    /// Runs `f` on the bio of every request of `r`'s merge chain, in chain (sector) order,
    /// stopping at the first error, which it returns. What drivers that execute bios one by
    /// one call to honour merges (module docs).
    #[inline]
    pub fn for_each_bio(
        &self,
        r: &mut RequestToken,
        mut f: impl FnMut(&mut Bio) -> Result<(), Error>,
    ) -> Result<(), Error> {
        let mut cur = r;
        loop {
            let rq = self.rq_mut(cur);
            if let Some(b) = rq.bio.as_mut() {
                f(b)?;
            }
            match rq.merged.as_mut() {
                Some(next) => cur = next,
                None => return Ok(()),
            }
        }
    }

    /// The queue's limits.
    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// Requests of the queue (every tag of every pool, reserved ones included):
    /// [`RequestToken::index`] is below this.
    pub fn nr_requests(&self) -> usize {
        self.requests.len()
    }

    /// The most bios one request may carry ([`Driver::max_merge`]).
    pub fn max_merge(&self) -> u32 {
        self.max_merge
    }

    /// Counts a bio merged into another request (the `merges` column of the disk stats).
    #[inline]
    pub fn account_merge(&self, dir: usize) {
        self.stats.merged(dir);
    }

    /// Runs the scheduler's dispatch (no-op without one): what a driver whose
    /// [`Driver::can_queue`] went to 0 calls once it has room again.
    pub fn run_queue(&self) {
        if let Some(s) = &self.sched {
            self.run_dispatch(s.as_ref());
        }
    }

    /// Completes a request with `res`: frees its tag, then hands the bio back to its submitter.
    /// Then the same for every request of its merge chain, in chain order, with the same
    /// status (module docs). The link to the next request is read out before the tag is freed.
    ///
    /// The completion time of the statistics is [`crate::stats::batch_ns`]: inside a
    /// [`ClockBatch`] (every dispatch of the queue opens one, so inline completions share it)
    /// the batch's one clock read, else a fresh read. [`RequestQueue::complete_at`] takes it
    /// from the caller instead.
    #[inline]
    pub fn complete(&self, r: RequestToken, res: Result<(), Error>) {
        self.complete_at(r, res, batch_ns());
    }

    /// [`RequestQueue::complete`] with the completion time given: `now_ns` on the coarse clock
    /// ([`crate::stats::coarse_ns`]), e.g. read once for a whole batch of completions by a driver's
    /// completion thread, or once per request by a driver whose requests are slow.
    #[inline]
    pub fn complete_at(&self, r: RequestToken, mut res: Result<(), Error>, now_ns: u64) {
        let now = now_ns;
        let mut cur = r;
        loop {
            let mut r = cur;
            let rq = self.rq_mut(&mut r);
            if let Some(s) = &self.sched {
                s.completed(self, rq);
            }
            let bio = rq.bio.take();
            let end = rq.end.take();
            let next = rq.merged.take();
            let (hctx, tag, start, reserved, shallow) =
                (rq.hctx, rq.tag, rq.start_ns, rq.reserved, rq.shallow);
            // INVARIANT: ownership of the cell ends here. The token is consumed and the cell is
            // not touched again; `put` below frees the tag `prepare` stored (the fields are
            // private, so it is the tag this token was made from), and its Release hands the
            // cell to the next owner.
            let RequestToken { .. } = r;
            // The last request of the chain takes `res` itself; the others get copies.
            let this = match (&next, &res) {
                (Some(_), Ok(())) => Ok(()),
                (Some(_), Err(e)) => Err(e.duplicate()),
                (None, _) => std::mem::replace(&mut res, Ok(())),
            };
            if let Some(b) = &bio {
                // Reads' and writes' sectors, and discards' (their own column); `completed`
                // sorts them. A flush's `len` means nothing.
                let sectors = if b.op == Op::Flush {
                    0
                } else {
                    u64::from(b.len) >> SECTOR_SHIFT
                };
                self.stats
                    .completed(b.op, sectors, start, now, this.is_ok());
            }
            let pool = self.pool_of(hctx, reserved);
            if shallow {
                pool.put_shallow(tag);
            } else {
                pool.put(tag);
            }
            if let (Some(b), Some(e)) = (bio, end) {
                // A panic in a submitter's completion must not take the completing thread (a
                // driver's completion thread serves every submitter) or the rest of the merge
                // chain with it: the tag is already free; the chain goes on. The submitter
                // whose `end_io` panicked is the one affected (its own containment decides).
                // Zero cost unless it unwinds.
                if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| e.end_io(b, this)))
                    .is_err()
                {
                    tracing::error!(
                        "a bio's end_io panicked; the request is lost to its submitter"
                    );
                }
            }
            match next {
                Some(n) => cur = n,
                None => return,
            }
        }
    }

    /// Back-merges `r` into the last plugged request when there is no scheduler (a scheduler
    /// merges at insert instead) and the driver takes chains: same op, flags and priority,
    /// contiguous, within `max_io_bytes` and `max_merge` bios. Otherwise records `r` as the
    /// new tail and gives it back to be plugged on its own.
    fn plug_merge(&self, plug: &mut Plug, r: RequestToken) -> Result<(), RequestToken> {
        let Some(b) = self.rq(&r).bio.as_ref() else {
            plug.tail = None;
            return Err(r);
        };
        let (op, flags, prio, sector, len) = (b.op, b.flags, b.prio, b.sector, u64::from(b.len));
        let end_sector = sector + (len >> SECTOR_SHIFT);
        let mergeable = self.sched.is_none()
            && self.max_merge > 1
            && op.has_data()
            && plug.tail.is_some_and(|t| {
                t.op == op
                    && t.flags == flags
                    && t.prio == prio
                    && t.end_sector == sector
                    && t.bytes + len <= u64::from(self.limits.max_io_bytes)
                    && t.bios < self.max_merge
            });
        let last = match plug.rqs.last_mut() {
            Some(last) if mergeable => last,
            _ => {
                plug.tail = Some(PlugTail {
                    op,
                    flags,
                    prio,
                    end_sector,
                    bytes: len,
                    bios: 1,
                });
                return Err(r);
            }
        };
        // Append to the end of the last request's chain (chains in a plug are short).
        let mut cur = last;
        loop {
            let rq = self.rq_mut(cur);
            match rq.merged {
                Some(ref mut next) => cur = next,
                None => {
                    rq.merged = Some(r);
                    break;
                }
            }
        }
        if let Some(t) = plug.tail.as_mut() {
            t.end_sector = end_sector;
            t.bytes += len;
            t.bios += 1;
        }
        self.account_merge(op.dir());
        Ok(())
    }

    fn flush(&self, plug: &mut Plug) {
        plug.tail = None;
        // The next request starts a new batch, with a new time.
        plug.now_ns = None;
        if plug.rqs.is_empty() {
            return;
        }
        // Inline completions of this batch share one clock read.
        let _clock = ClockBatch::enter();
        match &self.sched {
            None => {
                for r in plug.rqs.drain(..) {
                    self.driver.queue_rq(self, r);
                }
                self.driver.commit(self);
            }
            Some(s) => {
                s.insert_batch(self, &mut plug.rqs.drain(..));
                // Inside this flush's clock batch: insert, dispatch and inline completions
                // share one read.
                self.dispatch_rounds(s.as_ref());
            }
        }
    }

    /// [`RequestQueue::dispatch_rounds`] in a clock batch of its own.
    fn run_dispatch(&self, s: &dyn Scheduler) {
        let _clock = ClockBatch::enter();
        self.dispatch_rounds(s);
    }

    /// Dispatches until the scheduler hands out nothing or the driver has no room.
    fn dispatch_rounds(&self, s: &dyn Scheduler) {
        loop {
            let room = self.driver.can_queue();
            if room == 0 {
                return;
            }
            let n = s.dispatch(self, room.min(32), &mut |r| self.driver.queue_rq(self, r));
            if n == 0 {
                return;
            }
            self.driver.commit(self);
        }
    }

    fn hctx_for_thread(&self) -> u16 {
        (blkq_sync::thread_slot() % self.pools.len().max(1)) as u16
    }

    /// Validates, allocates a tag (may sleep) and fills the request. On a validation error
    /// the bio is completed at once with it. Before sleeping for a tag it flushes `plug`:
    /// the tags held by plugged requests may be the ones it would wait for (blk-mq flushes
    /// the plug on schedule for the same reason).
    #[inline]
    fn prepare(
        &self,
        bio: Bio,
        end: &Arc<dyn EndIo>,
        plug: Option<&mut Plug>,
    ) -> Option<RequestToken> {
        if let Err(e) = self.limits.validate(&bio) {
            end.end_io(bio, Err(e));
            return None;
        }
        let hctx = if self.shared {
            0
        } else {
            self.hctx_for_thread()
        };
        let dir = bio.op.dir();
        let reserved = bio.flags.contains(crate::BioFlags::RESERVED) && !self.reserved.is_empty();
        let pool = self.pool_of(hctx, reserved);
        let shallow = if reserved {
            None
        } else {
            self.async_depth(bio.op, bio.flags)
        };
        let got = match shallow {
            None => pool.get_nowait(dir),
            Some(limit) => pool.get_shallow_nowait(limit),
        };
        let mut plug = plug;
        let tag = match got {
            Some(t) => t,
            None => {
                // Flushing also clears the plug's time: the request that waited (and the ones
                // after it) start a new batch, timed after the wait.
                if let Some(p) = plug.as_deref_mut() {
                    self.flush(p);
                }
                match shallow {
                    None => pool.get(dir),
                    Some(limit) => pool.get_shallow(limit),
                }
            }
        };
        // INVARIANT: ownership of the cell begins here. We hold `tag` (allocated by the
        // Acquire RMW above), and cell `request_index(hctx, tag, reserved)` belongs to that
        // tag alone, so this is the only token for it until `complete` frees the tag.
        let mut r = self.make_token(self.request_index(hctx, tag, reserved));
        // One clock read per plug batch (read by its first request); unplugged: per request.
        let now = match plug {
            Some(p) => *p.now_ns.get_or_insert_with(batch_ns),
            None => batch_ns(),
        };
        self.stats.started(dir, now);
        let rq = self.rq_mut(&mut r);
        rq.bio = Some(bio);
        rq.end = Some(end.clone());
        rq.start_ns = now;
        rq.hctx = hctx;
        rq.tag = tag;
        rq.reserved = reserved;
        rq.shallow = shallow.is_some();
        Some(r)
    }

    /// The shallow cap for a request of `op` with `flags`: the scheduler's
    /// [`Scheduler::async_depth`] for an asynchronous request, if below the pool's depth.
    #[inline]
    fn async_depth(&self, op: Op, flags: crate::BioFlags) -> Option<u32> {
        if op.is_sync(flags) {
            return None;
        }
        self.sched
            .as_ref()?
            .async_depth(self.depth)
            .filter(|&l| l < self.depth)
    }
}

/// The owner of a [`RequestQueue`], through which bios are submitted.
///
/// Dropping it stops the driver (joining its completion threads); drop it only once every
/// submitted bio has completed.
#[derive(Debug)]
pub struct Queue {
    core: Arc<RequestQueue>,
}

impl Queue {
    /// A queue in front of `driver`, without a scheduler.
    pub fn new(cfg: QueueConfig, driver: Box<dyn Driver>) -> Result<Self, Error> {
        Self::with_scheduler(cfg, driver, None)
    }

    /// A queue in front of `driver`, with an I/O scheduler (`None`: `none`).
    pub fn with_scheduler(
        cfg: QueueConfig,
        driver: Box<dyn Driver>,
        sched: Option<Box<dyn Scheduler>>,
    ) -> Result<Self, Error> {
        if cfg.nr_hw_queues == 0 || cfg.queue_depth == 0 {
            return Err(Error::Config(
                "hw_queues and queue_depth must be at least 1".into(),
            ));
        }
        let lbs = cfg.limits.logical_block_size;
        if !lbs.is_power_of_two() || lbs < 512 {
            return Err(Error::Config(format!(
                "logical block size {lbs} is not a power of two >= 512"
            )));
        }
        let npools = if cfg.shared_tags {
            1
        } else {
            cfg.nr_hw_queues as usize
        };
        let pools = (0..npools)
            .map(|_| TagPool::new(cfg.queue_depth, cfg.wake, cfg.policy).map(Arc::new))
            .collect::<Result<Box<[_]>, _>>()?;
        let reserved = (0..if cfg.reserved_tags > 0 { npools } else { 0 })
            .map(|_| TagPool::new(cfg.reserved_tags, cfg.wake, PoolPolicy::Fifo).map(Arc::new))
            .collect::<Result<Box<[_]>, _>>()?;
        let nrequests = npools * (cfg.queue_depth + cfg.reserved_tags) as usize;
        let requests = (0..nrequests)
            .map(|_| CachePadded(RequestCell(UnsafeCell::new(Request::default()))))
            .collect();
        let max_merge = driver.max_merge().max(1);
        let core = Arc::new(RequestQueue {
            limits: cfg.limits,
            depth: cfg.queue_depth,
            shared: cfg.shared_tags,
            pools,
            reserved,
            reserved_depth: cfg.reserved_tags,
            requests,
            driver,
            sched,
            stats: DiskCounters::new(),
            plug_limit: cfg.plug_limit.max(1),
            max_merge,
        });
        if let Some(s) = &core.sched {
            s.attach(&core);
        }
        core.driver.start(&core);
        Ok(Self { core })
    }

    /// The shared core (what drivers see).
    pub fn core(&self) -> &Arc<RequestQueue> {
        &self.core
    }

    /// Submits one bio and dispatches it at once (through the scheduler, if there is one).
    #[inline]
    pub fn submit(&self, bio: Bio, end: &Arc<dyn EndIo>) {
        if let Some(r) = self.core.prepare(bio, end, None) {
            match &self.core.sched {
                None => {
                    let _clock = ClockBatch::enter();
                    self.core.driver.queue_rq(&self.core, r);
                    self.core.driver.commit(&self.core);
                }
                Some(s) => {
                    let _clock = ClockBatch::enter();
                    s.insert_batch(&self.core, &mut std::iter::once(r));
                    self.core.dispatch_rounds(s.as_ref());
                }
            }
        }
    }

    /// Submits a bio under `plug`: it is dispatched when the plug fills or is flushed.
    #[inline]
    pub fn submit_plugged(&self, plug: &mut Plug, bio: Bio, end: &Arc<dyn EndIo>) {
        if let Some(r) = self.core.prepare(bio, end, Some(plug)) {
            if let Err(r) = self.core.plug_merge(plug, r) {
                plug.rqs.push(r);
                if plug.rqs.len() >= self.core.plug_limit {
                    self.flush_plug(plug);
                }
            }
        }
    }

    /// Dispatches everything `plug` holds, as one batch.
    pub fn flush_plug(&self, plug: &mut Plug) {
        self.core.flush(plug);
    }

    /// Disk statistics.
    pub fn stats(&self) -> DiskStats {
        self.core.stats.snapshot()
    }

    /// What only a queue counts ([`QueueStats`]): every hardware context's tag waits, the
    /// scheduler's lock contention. Allocates; read off the I/O path.
    pub fn queue_stats(&self) -> QueueStats {
        QueueStats {
            tag_waits: self.core.pools.iter().map(|p| p.wait_stats()).collect(),
            sched: self.core.sched.as_deref().map(|s| SchedStats {
                name: s.name(),
                lock: s.lock_stats(),
            }),
        }
    }

    /// Tag-wait statistics of hardware context `hctx` (0 with shared tags).
    pub fn wait_stats(&self, hctx: usize) -> Option<WaitSnapshot> {
        self.core.pools.get(hctx).map(|p| p.wait_stats())
    }

    /// The tag pools (one, or one per hardware context).
    pub fn pools(&self) -> &[Arc<TagPool>] {
        &self.core.pools
    }

    /// Switches every pool's policy.
    pub fn set_policy(&self, p: PoolPolicy) {
        for pool in self.core.pools.iter() {
            pool.set_policy(p);
        }
    }

    /// Switches every pool's wake-up algorithm.
    pub fn set_wake(&self, w: WakeAlgo) {
        for pool in self.core.pools.iter() {
            pool.sbq().set_algo(w);
        }
    }

    /// The I/O scheduler (`None`: `none`).
    pub fn scheduler(&self) -> Option<&dyn Scheduler> {
        self.core.sched.as_deref()
    }

    /// The driver's description.
    pub fn describe(&self) -> String {
        self.core.driver.describe()
    }
}

impl Drop for Queue {
    fn drop(&mut self) {
        self.core.driver.stop();
    }
}

impl Device for Queue {
    fn submit(&self, bio: Bio, end: &Arc<dyn EndIo>) {
        Queue::submit(self, bio, end)
    }

    /// One plug for the whole batch: the calling thread's own, reused from call to call, so
    /// that a batch allocates nothing (`with_thread_plug` says why a thread-local).
    fn submit_batch(&self, bios: &mut dyn Iterator<Item = Bio>, end: &Arc<dyn EndIo>) {
        with_thread_plug(self.core.plug_limit, |plug| {
            for b in bios {
                self.submit_plugged(plug, b, end);
            }
            self.flush_plug(plug);
        });
    }

    fn limits(&self) -> Limits {
        self.core.limits
    }

    fn extents_into(
        &self,
        offset: u64,
        len: u64,
        max: usize,
        out: &mut Vec<Extent>,
    ) -> Result<(), Error> {
        self.core.driver.extents_into(offset, len, max, out)
    }

    /// The driver's (asked each time: a driver may turn one off at run time).
    fn caps(&self) -> Caps {
        self.core.driver.caps()
    }

    /// The driver's splice, counted as one read of the bytes moved (started and completed
    /// at this batch's clock: the time it takes is the driver's call, not a queue wait).
    fn splice_read(&self, offset: u64, len: usize, pipe: BorrowedFd<'_>) -> Result<usize, Error> {
        let start = batch_ns();
        let dir = Op::Read.dir();
        self.core.stats.started(dir, start);
        let res = self.core.driver.splice_read(offset, len, pipe);
        let moved = res.as_ref().map_or(0, |n| *n as u64);
        self.core.stats.completed(
            Op::Read,
            moved >> SECTOR_SHIFT,
            start,
            batch_ns(),
            res.is_ok(),
        );
        res
    }
    /// The driver's receive, counted as one write of `len` bytes (its sectors counted only
    /// when it completes; started and completed around the driver's call, which includes the
    /// time the client takes to send the payload, as a buffered write's would not).
    fn recv_home(
        &self,
        offset: u64,
        len: usize,
        src: &mut dyn crate::RecvSource,
    ) -> Result<(), Error> {
        let start = batch_ns();
        self.core.stats.started(Op::Write.dir(), start);
        let res = self.core.driver.recv_home(offset, len, src);
        let sectors = if res.is_ok() {
            len as u64 >> SECTOR_SHIFT
        } else {
            0
        };
        self.core
            .stats
            .completed(Op::Write, sectors, start, batch_ns(), res.is_ok());
        res
    }

    fn stats(&self) -> Option<DiskStats> {
        Some(Queue::stats(self))
    }

    fn queue_stats(&self) -> Option<QueueStats> {
        Some(Queue::queue_stats(self))
    }
}
