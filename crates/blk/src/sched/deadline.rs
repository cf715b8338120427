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
//! within the queue's `max_io_bytes` and its bios within [`QueueCore::max_merge`] (1 for a
//! driver that cannot run a chain: no merges at all). The bio's request joins the queued
//! one's *merge chain* (linked in sector order, see [`crate::queue`]), keeps its own tag, bio
//! and buffer, is never dispatched on its own, and is completed with the chain. A merged
//! request keeps the deadline and FIFO place of the request it joined.
//!
//! When a merge makes a request touch the next (or previous) queued request, the two are
//! merged as well (request-request merge, within the same limits). The survivor is the lower
//! one; it takes the FIFO place and deadline of the other if that one was older.
//!
//! While queued, every request's token (merged ones too) sits in `tokens`, indexed by slot;
//! the chain is linked through [`Request::merged`] when it is dispatched (one pass over the
//! chain), so a merge is O(log n) and allocates nothing.
//!
//! # Why sorted vectors, not a `BTreeMap`
//!
//! A `BTreeMap` allocates a node when a list grows past a node's 11 keys and frees it when
//! it shrinks back, which the lists here do every plug batch: heap traffic per I/O in the
//! steady state. Each sort list is a vector of `(sector, seq, slot)` sorted by binary search,
//! with capacity for every request of the queue reserved in [`Scheduler::attach`]; at the
//! depths a queue has (tens to a few hundred requests) its memmove on insert and removal
//! costs less than a tree's pointer chasing. FIFOs are intrusive doubly linked lists through
//! the per-slot metadata (O(1) removal of any request).
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
//! | `async_depth`       | 0       | informational (below)                                    |
//!
//! `async_depth` is, in the kernel, the most tags that asynchronous requests (writes, and
//! reads not marked sync) may hold, so synchronous reads always find a tag. Here tags are
//! allocated before the scheduler sees a request, by a [`crate::TagPool`] whose pool-full
//! policies do not take a shallow depth yet: the value is stored and reported but **not
//! enforced**. (0 means the whole queue depth, the kernel's default being 3/4 of it.)
//!
//! # Time
//!
//! From a [`Clock`]: the coarse monotonic clock normally, a [`super::ManualClock`] in tests.
//! Read once per insert batch and once per dispatch call.
//!
//! # Locking
//!
//! All of the state is behind a [`SchedLock`], `locked` or `serialized` (serialized dispatch with inserter hand-off), switchable
//! at run time ([`Deadline::set_lock_mode`]). Requests drained from a bucket get their
//! deadline when drained, at most one owner's round after they were punted. Completion
//! counters are sharded atomics, outside the lock.

use std::sync::Arc;

use blkq_sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};

use super::lock::{LockMode, LockStats, SchedLock};
use super::{Clock, MonotonicClock};
use crate::bio::{BioFlags, IoPrio, Op, SECTOR_SHIFT};
use crate::device::Scheduler;
use crate::queue::{QueueCore, Request, RequestToken};
use crate::Error;
use blkq_sync::stat::ShardedCounters;

/// The most requests one dispatch call hands out (they are collected under the lock and
/// handed to the driver after it).
pub const DISPATCH_BATCH: usize = 32;

/// No slot (end of a list).
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

/// mq-deadline's tunables, read once per insert batch or dispatch call (`Relaxed`: each value
/// stands alone; a change applies from the next batch).
#[derive(Debug)]
pub struct DeadlineTunables {
    read_expire_ns: AtomicU64,
    write_expire_ns: AtomicU64,
    writes_starved: AtomicU32,
    fifo_batch: AtomicU32,
    front_merges: AtomicBool,
    prio_aging_expire_ns: AtomicU64,
    async_depth: AtomicU32,
}

impl Default for DeadlineTunables {
    fn default() -> Self {
        Self {
            read_expire_ns: AtomicU64::new(500_000_000),
            write_expire_ns: AtomicU64::new(5_000_000_000),
            writes_starved: AtomicU32::new(2),
            fifo_batch: AtomicU32::new(16),
            front_merges: AtomicBool::new(true),
            prio_aging_expire_ns: AtomicU64::new(10_000_000_000),
            async_depth: AtomicU32::new(0),
        }
    }
}

fn dur_ns(d: std::time::Duration) -> u64 {
    d.as_nanos().min(u128::from(u64::MAX)) as u64
}

impl DeadlineTunables {
    /// The names [`DeadlineTunables::set`] takes (the kernel's sysfs names).
    pub const NAMES: [&'static str; 7] = [
        "read_expire",
        "write_expire",
        "writes_starved",
        "fifo_batch",
        "front_merges",
        "prio_aging_expire",
        "async_depth",
    ];

    /// Deadline of a read.
    pub fn read_expire(&self) -> std::time::Duration {
        std::time::Duration::from_nanos(self.read_expire_ns.load(Ordering::Relaxed))
    }
    /// Sets the deadline of a read.
    pub fn set_read_expire(&self, d: std::time::Duration) {
        self.read_expire_ns.store(dur_ns(d), Ordering::Relaxed);
    }
    /// Deadline of a write.
    pub fn write_expire(&self) -> std::time::Duration {
        std::time::Duration::from_nanos(self.write_expire_ns.load(Ordering::Relaxed))
    }
    /// Sets the deadline of a write.
    pub fn set_write_expire(&self, d: std::time::Duration) {
        self.write_expire_ns.store(dur_ns(d), Ordering::Relaxed);
    }
    /// Read batches chosen while writes wait before a write batch.
    pub fn writes_starved(&self) -> u32 {
        self.writes_starved.load(Ordering::Relaxed)
    }
    /// Sets `writes_starved`.
    pub fn set_writes_starved(&self, n: u32) {
        self.writes_starved.store(n, Ordering::Relaxed);
    }
    /// Requests per batch.
    pub fn fifo_batch(&self) -> u32 {
        self.fifo_batch.load(Ordering::Relaxed)
    }
    /// Sets `fifo_batch` (0 is taken as 1).
    pub fn set_fifo_batch(&self, n: u32) {
        self.fifo_batch.store(n.max(1), Ordering::Relaxed);
    }
    /// Whether front merges are tried.
    pub fn front_merges(&self) -> bool {
        self.front_merges.load(Ordering::Relaxed)
    }
    /// Sets `front_merges`.
    pub fn set_front_merges(&self, on: bool) {
        self.front_merges.store(on, Ordering::Relaxed);
    }
    /// Wait after which a lower priority class is served first.
    pub fn prio_aging_expire(&self) -> std::time::Duration {
        std::time::Duration::from_nanos(self.prio_aging_expire_ns.load(Ordering::Relaxed))
    }
    /// Sets `prio_aging_expire`.
    pub fn set_prio_aging_expire(&self, d: std::time::Duration) {
        self.prio_aging_expire_ns
            .store(dur_ns(d), Ordering::Relaxed);
    }
    /// `async_depth` (informational: module docs).
    pub fn async_depth(&self) -> u32 {
        self.async_depth.load(Ordering::Relaxed)
    }
    /// Sets `async_depth` (informational: module docs).
    pub fn set_async_depth(&self, n: u32) {
        self.async_depth.store(n, Ordering::Relaxed);
    }

    /// Sets a tunable by its sysfs name; expiries are in milliseconds, as in sysfs.
    pub fn set(&self, name: &str, value: &str) -> Result<(), Error> {
        let num = || {
            value
                .trim()
                .parse::<u64>()
                .map_err(|_| Error::Config(format!("mq-deadline {name}: bad number {value:?}")))
        };
        let small = || {
            num().and_then(|v| {
                u32::try_from(v)
                    .map_err(|_| Error::Config(format!("mq-deadline {name}: {value} is too large")))
            })
        };
        let ms = |v: u64| std::time::Duration::from_millis(v);
        match name {
            "read_expire" => self.set_read_expire(ms(num()?)),
            "write_expire" => self.set_write_expire(ms(num()?)),
            "writes_starved" => self.set_writes_starved(small()?),
            "fifo_batch" => self.set_fifo_batch(small()?),
            "front_merges" => self.set_front_merges(num()? != 0),
            "prio_aging_expire" => self.set_prio_aging_expire(ms(num()?)),
            "async_depth" => self.set_async_depth(small()?),
            _ => {
                return Err(Error::Config(format!(
                    "unknown mq-deadline tunable {name:?} (expected one of {})",
                    Self::NAMES.join(", ")
                )))
            }
        }
        Ok(())
    }

    fn snapshot(&self) -> Tun {
        Tun {
            expire: [
                self.read_expire_ns.load(Ordering::Relaxed),
                self.write_expire_ns.load(Ordering::Relaxed),
            ],
            writes_starved: self.writes_starved.load(Ordering::Relaxed),
            fifo_batch: self.fifo_batch.load(Ordering::Relaxed).max(1),
            front_merges: self.front_merges.load(Ordering::Relaxed),
            aging: self.prio_aging_expire_ns.load(Ordering::Relaxed),
        }
    }
}

/// The tunables one batch works with.
#[derive(Debug, Clone, Copy)]
struct Tun {
    expire: [u64; 2],
    writes_starved: u32,
    fifo_batch: u32,
    front_merges: bool,
    aging: u64,
}

/// What one insert batch or dispatch call works with.
#[derive(Debug, Clone, Copy)]
struct Cx {
    now: u64,
    tun: Tun,
    /// The driver runs merge chains (`max_merge > 1`).
    merge: bool,
    max_bytes: u64,
    max_merge: u32,
}

/// Per-slot metadata. The first group describes a queued request (`list != NOT_QUEUED`) and
/// its whole merge chain; the chain links are valid for every member of a queued chain.
#[derive(Debug, Clone, Copy)]
struct Meta {
    start: u64,
    end: u64,
    seq: u64,
    deadline: u64,
    inserted: u64,
    bytes: u64,
    nr_bios: u32,
    /// First and last slot of the merge chain (sector order).
    first: u32,
    last: u32,
    fifo_prev: u32,
    fifo_next: u32,
    list: u8,
    prio: u8,
    op: Op,
    flags: BioFlags,
    chain_prev: u32,
    chain_next: u32,
}

impl Meta {
    const EMPTY: Meta = Meta {
        start: 0,
        end: 0,
        seq: 0,
        deadline: 0,
        inserted: 0,
        bytes: 0,
        nr_bios: 0,
        first: NIL,
        last: NIL,
        fifo_prev: NIL,
        fifo_next: NIL,
        list: NOT_QUEUED,
        prio: 0,
        op: Op::Read,
        flags: BioFlags::NONE,
        chain_prev: NIL,
        chain_next: NIL,
    };
}

/// Sort key: start sector, then insertion number; `slot` rides along.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Key {
    start: u64,
    seq: u64,
    slot: u32,
}

/// An intrusive FIFO through `Meta::fifo_prev/next`.
#[derive(Debug, Clone, Copy)]
struct Fifo {
    head: u32,
    tail: u32,
    len: u32,
}

impl Fifo {
    const EMPTY: Fifo = Fifo {
        head: NIL,
        tail: NIL,
        len: 0,
    };
}

/// Everything behind the lock.
struct State {
    meta: Vec<Meta>,
    /// The token of every queued request and chain member, by slot.
    tokens: Vec<Option<RequestToken>>,
    sort: [Vec<Key>; NLISTS],
    /// The lists' FIFOs, then the direct FIFO.
    fifo: [Fifo; NLISTS + 1],
    /// Sweep position per list: the end of the last request dispatched from it.
    pos: [u64; NLISTS],
    seq: u64,
    last_dir: usize,
    batching: u32,
    starved: u32,
    counts: [[u64; 4]; NPRIO],
}

impl State {
    fn new() -> Self {
        Self {
            meta: Vec::new(),
            tokens: Vec::new(),
            sort: Default::default(),
            fifo: [Fifo::EMPTY; NLISTS + 1],
            pos: [0; NLISTS],
            seq: 0,
            last_dir: 0,
            // No batch running: the first dispatch starts one.
            batching: u32::MAX,
            starved: 0,
            counts: [[0; 4]; NPRIO],
        }
    }

    /// Room for `n` request slots, so that nothing allocates afterwards.
    fn ensure(&mut self, n: usize) {
        if self.meta.len() < n {
            self.meta.resize(n, Meta::EMPTY);
            self.tokens.resize_with(n, || None);
        }
        for s in &mut self.sort {
            let more = n.saturating_sub(s.len());
            s.reserve(more);
        }
    }

    fn m(&self, slot: u32) -> &Meta {
        &self.meta[slot as usize]
    }

    fn mm(&mut self, slot: u32) -> &mut Meta {
        &mut self.meta[slot as usize]
    }

    fn sort_insert(&mut self, l: usize, k: Key) {
        let s = &mut self.sort[l];
        let i = s.partition_point(|x| *x < k);
        s.insert(i, k);
    }

    fn sort_remove(&mut self, l: usize, k: Key) {
        let s = &mut self.sort[l];
        let i = s.partition_point(|x| *x < k);
        if s.get(i) == Some(&k) {
            s.remove(i);
        } else {
            debug_assert!(false, "mq-deadline: key {k:?} not in list {l}");
        }
    }

    fn fifo_push(&mut self, l: usize, slot: u32) {
        let tail = self.fifo[l].tail;
        {
            let m = self.mm(slot);
            m.fifo_prev = tail;
            m.fifo_next = NIL;
        }
        if tail == NIL {
            self.fifo[l].head = slot;
        } else {
            self.mm(tail).fifo_next = slot;
        }
        self.fifo[l].tail = slot;
        self.fifo[l].len += 1;
    }

    fn fifo_unlink(&mut self, l: usize, slot: u32) {
        let (p, n) = (self.m(slot).fifo_prev, self.m(slot).fifo_next);
        if p == NIL {
            self.fifo[l].head = n;
        } else {
            self.mm(p).fifo_next = n;
        }
        if n == NIL {
            self.fifo[l].tail = p;
        } else {
            self.mm(n).fifo_prev = p;
        }
        self.fifo[l].len = self.fifo[l].len.saturating_sub(1);
    }

    /// Puts `new` (not in the FIFO) in `old`'s place, and takes `old` out.
    fn fifo_replace(&mut self, l: usize, old: u32, new: u32) {
        let (p, n) = (self.m(old).fifo_prev, self.m(old).fifo_next);
        {
            let m = self.mm(new);
            m.fifo_prev = p;
            m.fifo_next = n;
        }
        if p == NIL {
            self.fifo[l].head = new;
        } else {
            self.mm(p).fifo_next = new;
        }
        if n == NIL {
            self.fifo[l].tail = new;
        } else {
            self.mm(n).fifo_prev = new;
        }
    }

    fn queued(&self, prio: usize) -> u32 {
        self.fifo[prio * 2].len + self.fifo[prio * 2 + 1].len
    }

    /// Whether queued request `h` can take `bytes` more in `bios` more bios of `op`/`flags`.
    fn mergeable(&self, h: u32, op: Op, flags: BioFlags, bytes: u64, bios: u32, cx: &Cx) -> bool {
        let m = self.m(h);
        m.op == op
            && m.flags == flags
            && m.bytes + bytes <= cx.max_bytes
            && m.nr_bios.saturating_add(bios) <= cx.max_merge
    }

    /// Tries to merge the request `r` (one bio: `start..end`, `len` bytes) into a queued
    /// request of list `l`; on success, whether that also merged two queued requests. Gives
    /// the token back if it did not merge.
    #[allow(clippy::too_many_arguments)]
    fn merge_bio(
        &mut self,
        r: RequestToken,
        l: usize,
        start: u64,
        end: u64,
        len: u64,
        op: Op,
        flags: BioFlags,
        cx: &Cx,
    ) -> Result<bool, RequestToken> {
        let slot = r.index();
        // Back merge: the request starting last before `start`, if it ends at `start`.
        let i = self.sort[l].partition_point(|k| k.start < start);
        if let Some(h) = i.checked_sub(1).map(|j| self.sort[l][j].slot) {
            if self.m(h).end == start && self.mergeable(h, op, flags, len, 1, cx) {
                let last = self.m(h).last;
                self.mm(last).chain_next = slot;
                *self.mm(slot) = Meta {
                    chain_prev: last,
                    chain_next: NIL,
                    ..Meta::EMPTY
                };
                let m = self.mm(h);
                m.last = slot;
                m.end = end;
                m.bytes += len;
                m.nr_bios += 1;
                self.tokens[slot as usize] = Some(r);
                // Bridge: the next request may start where `h` now ends.
                let j = self.sort[l].partition_point(|k| k.start < end);
                if let Some(nx) = self.sort[l].get(j).map(|k| k.slot) {
                    if nx != h && self.m(nx).start == end {
                        return Ok(self.merge_requests(l, h, nx, cx));
                    }
                }
                return Ok(false);
            }
        }
        if !cx.tun.front_merges {
            return Err(r);
        }
        // Front merge: a request starting at `end`.
        let j = self.sort[l].partition_point(|k| k.start < end);
        let Some(k) = self.sort[l].get(j).copied() else {
            return Err(r);
        };
        if k.start != end || !self.mergeable(k.slot, op, flags, len, 1, cx) {
            return Err(r);
        }
        let h = k.slot;
        let first = self.m(h).first;
        self.mm(first).chain_prev = slot;
        *self.mm(slot) = Meta {
            chain_prev: NIL,
            chain_next: first,
            ..Meta::EMPTY
        };
        self.sort[l].remove(j);
        let m = self.mm(h);
        m.first = slot;
        m.start = start;
        m.bytes += len;
        m.nr_bios += 1;
        let key = Key {
            start,
            seq: m.seq,
            slot: h,
        };
        self.sort_insert(l, key);
        self.tokens[slot as usize] = Some(r);
        // Bridge: a request ending where `h` now starts.
        let i = self.sort[l].partition_point(|k| k.start < start);
        if let Some(pv) = i.checked_sub(1).map(|x| self.sort[l][x].slot) {
            if pv != h && self.m(pv).end == start {
                return Ok(self.merge_requests(l, pv, h, cx));
            }
        }
        Ok(false)
    }

    /// Merges queued request `b` into queued request `a` (`a` ends where `b` starts), if the
    /// limits allow.
    fn merge_requests(&mut self, l: usize, a: u32, b: u32, cx: &Cx) -> bool {
        let mb = *self.m(b);
        if !self.mergeable(a, mb.op, mb.flags, mb.bytes, mb.nr_bios, cx) {
            return false;
        }
        let a_last = self.m(a).last;
        self.mm(a_last).chain_next = mb.first;
        self.mm(mb.first).chain_prev = a_last;
        self.sort_remove(
            l,
            Key {
                start: mb.start,
                seq: mb.seq,
                slot: b,
            },
        );
        if mb.deadline < self.m(a).deadline {
            // `a` takes the older request's FIFO place and deadline.
            self.fifo_unlink(l, a);
            self.fifo_replace(l, b, a);
            self.mm(a).deadline = mb.deadline;
        } else {
            self.fifo_unlink(l, b);
        }
        let m = self.mm(a);
        m.last = mb.last;
        m.end = mb.end;
        m.bytes += mb.bytes;
        m.nr_bios += mb.nr_bios;
        m.inserted = m.inserted.min(mb.inserted);
        self.mm(b).list = NOT_QUEUED;
        self.counts[usize::from(mb.prio)][MERGED] += 1;
        true
    }

    /// The first request of list `l` at or after its sweep position.
    fn sweep_next(&self, l: usize) -> Option<u32> {
        let s = &self.sort[l];
        let pos = self.pos[l];
        s.get(s.partition_point(|k| k.start < pos)).map(|k| k.slot)
    }

    /// Chooses the next request to dispatch (module docs), updating the batch state.
    fn select(&mut self, now: u64, t: &Tun) -> Option<u32> {
        let direct = self.fifo[DIRECT].head;
        if direct != NIL {
            return Some(direct);
        }
        let busy = (0..NPRIO).filter(|&p| self.queued(p) > 0).count();
        if busy >= 2 {
            for p in [IoPrio::Be as usize, IoPrio::Idle as usize] {
                let oldest = [self.fifo[p * 2].head, self.fifo[p * 2 + 1].head]
                    .into_iter()
                    .filter(|&h| h != NIL)
                    .min_by_key(|&h| self.m(h).inserted);
                if let Some(h) = oldest {
                    if self.m(h).inserted.saturating_add(t.aging) <= now {
                        self.counts[p][AGED] += 1;
                        return Some(h);
                    }
                }
            }
        }
        let p = (0..NPRIO).find(|&p| self.queued(p) > 0)?;
        if self.batching < t.fifo_batch {
            if let Some(s) = self.sweep_next(p * 2 + self.last_dir) {
                self.batching += 1;
                return Some(s);
            }
        }
        let reads = self.fifo[p * 2].len > 0;
        let writes = self.fifo[p * 2 + 1].len > 0;
        let dir = if reads && !(writes && self.starved >= t.writes_starved) {
            if writes {
                self.starved += 1;
            }
            0
        } else {
            self.starved = 0;
            1
        };
        let l = p * 2 + dir;
        let head = self.fifo[l].head;
        let s = if head != NIL && self.m(head).deadline <= now {
            head
        } else {
            self.sweep_next(l).unwrap_or(head)
        };
        if s == NIL {
            return None;
        }
        self.last_dir = dir;
        self.batching = 1;
        Some(s)
    }

    /// Takes queued request `h` out of its lists and returns the token of its chain's first
    /// request, with the chain linked through [`Request::merged`].
    fn take(&mut self, q: &QueueCore, h: u32) -> Option<RequestToken> {
        let m = *self.m(h);
        let l = usize::from(m.list);
        if l < NLISTS {
            self.sort_remove(
                l,
                Key {
                    start: m.start,
                    seq: m.seq,
                    slot: h,
                },
            );
            self.pos[l] = m.end;
        }
        if l <= DIRECT {
            self.fifo_unlink(l, h);
        }
        self.mm(h).list = NOT_QUEUED;
        self.counts[usize::from(m.prio)][DISPATCHED] += 1;
        // Link the chain back to front: each request's `merged` is the next one's token.
        let mut next: Option<RequestToken> = None;
        let mut s = m.last;
        loop {
            let Some(mut tok) = self.tokens.get_mut(s as usize).and_then(Option::take) else {
                debug_assert!(false, "mq-deadline: no token for slot {s}");
                break;
            };
            q.rq_mut(&mut tok).set_merged(next);
            next = Some(tok);
            if s == m.first {
                break;
            }
            s = self.m(s).chain_prev;
        }
        next
    }
}

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

    fn cx(&self, q: &QueueCore) -> Cx {
        Cx {
            now: self.clock.now_ns(),
            tun: self.tun.snapshot(),
            merge: q.max_merge() > 1,
            max_bytes: u64::from(q.limits().max_io_bytes),
            max_merge: q.max_merge(),
        }
    }

    /// Puts one request into the state: merged into a queued one, or queued itself.
    fn insert_one(st: &mut State, q: &QueueCore, r: RequestToken, cx: &Cx) {
        let slot = r.index();
        if slot as usize >= st.meta.len() {
            // Only if the queue did not call `attach` (cold).
            st.ensure(slot as usize + 1);
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
        let r = if !direct && cx.merge && op.has_data() {
            match st.merge_bio(r, l, start, end, len, op, flags, cx) {
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
        *st.mm(slot) = Meta {
            start,
            end,
            seq,
            deadline: cx.now.saturating_add(cx.tun.expire[dir]),
            inserted: cx.now,
            bytes: len,
            nr_bios: 1,
            first: slot,
            last: slot,
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
            st.sort_insert(l, Key { start, seq, slot });
        }
        st.fifo_push(l, slot);
        st.tokens[slot as usize] = Some(r);
    }
}

impl Scheduler for Deadline {
    fn name(&self) -> &'static str {
        "mq-deadline"
    }

    fn attach(&self, q: &QueueCore) {
        let n = q.nr_requests();
        self.lock.with_state(|st| st.ensure(n));
        self.lock.reserve(n);
    }

    fn insert(&self, q: &QueueCore, rq: RequestToken) {
        self.insert_batch(q, &mut std::iter::once(rq));
    }

    fn insert_batch(&self, q: &QueueCore, rqs: &mut dyn Iterator<Item = RequestToken>) {
        let cx = self.cx(q);
        self.lock
            .insert(rqs, |st, r| Self::insert_one(st, q, r, &cx));
    }

    fn dispatch(&self, q: &QueueCore, max: usize, sink: &mut dyn FnMut(RequestToken)) -> usize {
        let max = max.min(DISPATCH_BATCH);
        if max == 0 {
            return 0;
        }
        let cx = self.cx(q);
        let mut buf: [Option<RequestToken>; DISPATCH_BATCH] = [const { None }; DISPATCH_BATCH];
        let mut n = 0;
        self.lock.dispatch(
            |st, r| Self::insert_one(st, q, r, &cx),
            |st| {
                while n < max {
                    let Some(h) = st.select(cx.now, &cx.tun) else {
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

    fn completed(&self, _q: &QueueCore, rq: &Request) {
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
