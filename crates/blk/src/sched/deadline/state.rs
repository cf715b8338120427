//! The state of mq-deadline behind its lock: per-request metadata, the sort lists, the FIFOs,
//! and the insert / merge / select / take operations on them (see the [module docs](super)).

use super::tree::{Node, Tree};
use super::tunables::TunablesSnapshot;
use super::*;

/// What one insert batch or dispatch call works with.
#[derive(Debug, Clone, Copy)]
pub(super) struct BatchContext {
    pub(super) now: u64,
    pub(super) tun: TunablesSnapshot,
    /// The driver runs merge chains (`max_merge > 1`).
    pub(super) merge: bool,
    pub(super) max_bytes: u64,
    pub(super) max_merge: u32,
}

/// Per-request metadata, by request index ([`RequestToken::index`]). The first group describes a
/// queued request (`list != NOT_QUEUED`) and its whole merge chain; the chain links are valid for
/// every member of a queued chain.
#[derive(Debug, Clone, Copy)]
pub(super) struct Meta {
    pub(super) start: u64,
    pub(super) end: u64,
    pub(super) seq: u64,
    pub(super) deadline: u64,
    pub(super) inserted: u64,
    pub(super) bytes: u64,
    pub(super) nr_bios: u32,
    /// First and last request of the merge chain (sector order).
    pub(super) first: u32,
    pub(super) last: u32,
    pub(super) fifo_prev: u32,
    pub(super) fifo_next: u32,
    pub(super) list: u8,
    pub(super) prio: u8,
    pub(super) op: Op,
    pub(super) flags: BioFlags,
    pub(super) chain_prev: u32,
    pub(super) chain_next: u32,
}

impl Meta {
    pub(super) const EMPTY: Meta = Meta {
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

/// An intrusive FIFO through `Meta::fifo_prev/next`.
#[derive(Debug, Clone, Copy)]
pub(super) struct Fifo {
    pub(super) head: u32,
    pub(super) tail: u32,
    pub(super) len: u32,
}

impl Fifo {
    pub(super) const EMPTY: Fifo = Fifo {
        head: NIL,
        tail: NIL,
        len: 0,
    };
}

/// Everything behind the lock.
pub(super) struct State {
    pub(super) meta: Vec<Meta>,
    /// The token of every queued request and chain member, by request index.
    pub(super) tokens: Vec<Option<RequestToken>>,
    /// The sort lists (treaps keyed by `(start, seq)`, over `nodes`: [`super::tree`]).
    pub(super) sort: [Tree; NLISTS],
    /// The sort lists' nodes, by request index.
    pub(super) nodes: Vec<Node>,
    /// The lists' FIFOs, then the direct FIFO.
    pub(super) fifo: [Fifo; NLISTS + 1],
    /// Sweep position per list: the end of the last request dispatched from it.
    pub(super) pos: [u64; NLISTS],
    pub(super) seq: u64,
    pub(super) last_dir: usize,
    pub(super) batching: u32,
    pub(super) starved: u32,
    pub(super) counts: [[u64; 4]; NPRIO],
}

impl State {
    pub(super) fn new() -> Self {
        Self {
            meta: Vec::new(),
            tokens: Vec::new(),
            sort: [Tree::EMPTY; NLISTS],
            nodes: Vec::new(),
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

    /// Room for `n` requests, so that nothing allocates afterwards.
    pub(super) fn ensure(&mut self, n: usize) {
        if self.meta.len() < n {
            self.meta.resize(n, Meta::EMPTY);
            self.tokens.resize_with(n, || None);
        }
        if self.nodes.len() < n {
            self.nodes.resize(n, Node::EMPTY);
        }
    }

    pub(super) fn meta(&self, rq_idx: u32) -> &Meta {
        &self.meta[rq_idx as usize]
    }

    pub(super) fn meta_mut(&mut self, rq_idx: u32) -> &mut Meta {
        &mut self.meta[rq_idx as usize]
    }

    /// Links queued request `rq_idx` into sort list `l` with key `(start, seq)`; the key
    /// must stay what its `Meta` says until [`State::sort_remove`].
    pub(super) fn sort_insert(&mut self, l: usize, rq_idx: u32, start: u64, seq: u64) {
        if rq_idx as usize >= self.nodes.len() {
            // Only if the queue did not call `attach` (cold).
            self.ensure(rq_idx as usize + 1);
        }
        self.sort[l].insert(&mut self.nodes, rq_idx, start, seq);
    }

    pub(super) fn sort_remove(&mut self, l: usize, rq_idx: u32) {
        if !self.sort[l].remove(&mut self.nodes, rq_idx) {
            debug_assert!(false, "mq-deadline: request {rq_idx} not in list {l}");
        }
    }

    /// The queued request of list `l` starting last before sector `start`.
    #[inline]
    pub(super) fn sort_before(&self, l: usize, start: u64) -> Option<u32> {
        self.sort[l].last_before(&self.nodes, start)
    }

    /// The queued request of list `l` starting first at or after sector `start`.
    #[inline]
    pub(super) fn sort_at_or_after(&self, l: usize, start: u64) -> Option<u32> {
        self.sort[l].first_at_or_after(&self.nodes, start)
    }

    pub(super) fn fifo_push(&mut self, l: usize, rq_idx: u32) {
        let tail = self.fifo[l].tail;
        {
            let m = self.meta_mut(rq_idx);
            m.fifo_prev = tail;
            m.fifo_next = NIL;
        }
        if tail == NIL {
            self.fifo[l].head = rq_idx;
        } else {
            self.meta_mut(tail).fifo_next = rq_idx;
        }
        self.fifo[l].tail = rq_idx;
        self.fifo[l].len += 1;
    }

    pub(super) fn fifo_unlink(&mut self, l: usize, rq_idx: u32) {
        let (p, n) = (self.meta(rq_idx).fifo_prev, self.meta(rq_idx).fifo_next);
        if p == NIL {
            self.fifo[l].head = n;
        } else {
            self.meta_mut(p).fifo_next = n;
        }
        if n == NIL {
            self.fifo[l].tail = p;
        } else {
            self.meta_mut(n).fifo_prev = p;
        }
        self.fifo[l].len = self.fifo[l].len.saturating_sub(1);
    }

    /// Puts `new` (not in the FIFO) in `old`'s place, and takes `old` out.
    pub(super) fn fifo_replace(&mut self, l: usize, old: u32, new: u32) {
        let (p, n) = (self.meta(old).fifo_prev, self.meta(old).fifo_next);
        {
            let m = self.meta_mut(new);
            m.fifo_prev = p;
            m.fifo_next = n;
        }
        if p == NIL {
            self.fifo[l].head = new;
        } else {
            self.meta_mut(p).fifo_next = new;
        }
        if n == NIL {
            self.fifo[l].tail = new;
        } else {
            self.meta_mut(n).fifo_prev = new;
        }
    }

    pub(super) fn queued(&self, prio: usize) -> u32 {
        self.fifo[prio * 2].len + self.fifo[prio * 2 + 1].len
    }

    /// Whether queued request `h` can take `bytes` more in `bios` more bios of `op`/`flags`.
    pub(super) fn mergeable(
        &self,
        h: u32,
        op: Op,
        flags: BioFlags,
        bytes: u64,
        bios: u32,
        ctx: &BatchContext,
    ) -> bool {
        let m = self.meta(h);
        m.op == op
            && m.flags == flags
            && m.bytes + bytes <= ctx.max_bytes
            && m.nr_bios.saturating_add(bios) <= ctx.max_merge
    }

    /// Tries to merge the request `r` (one bio: `start..end`, `len` bytes) into a queued
    /// request of list `l`; on success, whether that also merged two queued requests. Gives
    /// the token back if it did not merge.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn merge_bio(
        &mut self,
        r: RequestToken,
        l: usize,
        start: u64,
        end: u64,
        len: u64,
        op: Op,
        flags: BioFlags,
        ctx: &BatchContext,
    ) -> Result<bool, RequestToken> {
        let rq_idx = r.index();
        // Back merge: the request starting last before `start`, if it ends at `start`.
        if let Some(h) = self.sort_before(l, start) {
            if self.meta(h).end == start && self.mergeable(h, op, flags, len, 1, ctx) {
                let last = self.meta(h).last;
                self.meta_mut(last).chain_next = rq_idx;
                *self.meta_mut(rq_idx) = Meta {
                    chain_prev: last,
                    chain_next: NIL,
                    ..Meta::EMPTY
                };
                let m = self.meta_mut(h);
                m.last = rq_idx;
                m.end = end;
                m.bytes += len;
                m.nr_bios += 1;
                self.tokens[rq_idx as usize] = Some(r);
                // Bridge: the next request may start where `h` now ends.
                if let Some(nx) = self.sort_at_or_after(l, end) {
                    if nx != h && self.meta(nx).start == end {
                        return Ok(self.merge_requests(l, h, nx, ctx));
                    }
                }
                return Ok(false);
            }
        }
        if !ctx.tun.front_merges {
            return Err(r);
        }
        // Front merge: a request starting at `end`.
        let Some(h) = self.sort_at_or_after(l, end) else {
            return Err(r);
        };
        if self.meta(h).start != end || !self.mergeable(h, op, flags, len, 1, ctx) {
            return Err(r);
        }
        let first = self.meta(h).first;
        self.meta_mut(first).chain_prev = rq_idx;
        *self.meta_mut(rq_idx) = Meta {
            chain_prev: NIL,
            chain_next: first,
            ..Meta::EMPTY
        };
        // Its key changes: out of the list, then back in under the new start.
        self.sort_remove(l, h);
        let m = self.meta_mut(h);
        m.first = rq_idx;
        m.start = start;
        m.bytes += len;
        m.nr_bios += 1;
        let seq = m.seq;
        self.sort_insert(l, h, start, seq);
        self.tokens[rq_idx as usize] = Some(r);
        // Bridge: a request ending where `h` now starts.
        if let Some(pv) = self.sort_before(l, start) {
            if pv != h && self.meta(pv).end == start {
                return Ok(self.merge_requests(l, pv, h, ctx));
            }
        }
        Ok(false)
    }

    /// Merges queued request `b` into queued request `a` (`a` ends where `b` starts), if the
    /// limits allow.
    pub(super) fn merge_requests(&mut self, l: usize, a: u32, b: u32, ctx: &BatchContext) -> bool {
        let mb = *self.meta(b);
        if !self.mergeable(a, mb.op, mb.flags, mb.bytes, mb.nr_bios, ctx) {
            return false;
        }
        let a_last = self.meta(a).last;
        self.meta_mut(a_last).chain_next = mb.first;
        self.meta_mut(mb.first).chain_prev = a_last;
        self.sort_remove(l, b);
        if mb.deadline < self.meta(a).deadline {
            // `a` takes the older request's FIFO place and deadline.
            self.fifo_unlink(l, a);
            self.fifo_replace(l, b, a);
            self.meta_mut(a).deadline = mb.deadline;
        } else {
            self.fifo_unlink(l, b);
        }
        let m = self.meta_mut(a);
        m.last = mb.last;
        m.end = mb.end;
        m.bytes += mb.bytes;
        m.nr_bios += mb.nr_bios;
        m.inserted = m.inserted.min(mb.inserted);
        self.meta_mut(b).list = NOT_QUEUED;
        self.counts[usize::from(mb.prio)][MERGED] += 1;
        true
    }

    /// The first request of list `l` at or after its sweep position.
    pub(super) fn sweep_next(&self, l: usize) -> Option<u32> {
        self.sort_at_or_after(l, self.pos[l])
    }

    /// Chooses the next request to dispatch (module docs), updating the batch state.
    pub(super) fn select(&mut self, now: u64, t: &TunablesSnapshot) -> Option<u32> {
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
                    .min_by_key(|&h| self.meta(h).inserted);
                if let Some(h) = oldest {
                    if self.meta(h).inserted.saturating_add(t.aging) <= now {
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
        let s = if head != NIL && self.meta(head).deadline <= now {
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
    pub(super) fn take(&mut self, q: &RequestQueue, h: u32) -> Option<RequestToken> {
        let m = *self.meta(h);
        let l = usize::from(m.list);
        if l < NLISTS {
            self.sort_remove(l, h);
            self.pos[l] = m.end;
        }
        if l <= DIRECT {
            self.fifo_unlink(l, h);
        }
        self.meta_mut(h).list = NOT_QUEUED;
        self.counts[usize::from(m.prio)][DISPATCHED] += 1;
        // Link the chain back to front: each request's `merged` is the next one's token.
        let mut next: Option<RequestToken> = None;
        let mut s = m.last;
        loop {
            let Some(mut tok) = self.tokens.get_mut(s as usize).and_then(Option::take) else {
                debug_assert!(false, "mq-deadline: no token for request {s}");
                break;
            };
            q.rq_mut(&mut tok).set_merged(next);
            next = Some(tok);
            if s == m.first {
                break;
            }
            s = self.meta(s).chain_prev;
        }
        next
    }
}
