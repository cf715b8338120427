//! mq-deadline's sort lists: intrusive treaps over a node pool indexed by request index.
//!
//! A queued request is in at most one sort list at a time, so every list can share one pool of
//! nodes, `nodes[rq_idx]`, sized once in [`super::Scheduler::attach`] for every request of the
//! queue: inserting and removing link and unlink nodes and never allocate. Each node carries its
//! key, `(start, seq)` (start sector, then the scheduler's insertion number, so keys are
//! unique), its children, and a priority. A list is a *treap*: a binary search tree by key that
//! is also a max-heap by priority. With priorities that behave like random numbers (here a
//! hash of `seq`), its expected depth is O(log n) whatever the insertion order, so insertion,
//! removal and the two searches mq-deadline needs (the first request at or after a sector; the
//! last one before it) are O(log n) with no memmove.
//!
//! Invariants, for every node `x` of a list: the keys of `x.left`'s subtree are below `x`'s,
//! those of `x.right`'s above; the priorities of both subtrees are at most `x`'s; `len` is the
//! number of nodes reachable from `root`. A node not in any list has no meaning (its fields are
//! rewritten by [`Tree::insert`]).

/// No node.
pub(super) const NIL: u32 = u32::MAX;

/// One node of the pool (by request index).
#[derive(Debug, Clone, Copy)]
pub(super) struct Node {
    start: u64,
    seq: u64,
    left: u32,
    right: u32,
    prio: u32,
}

impl Node {
    pub(super) const EMPTY: Node = Node {
        start: 0,
        seq: 0,
        left: NIL,
        right: NIL,
        prio: 0,
    };

    #[inline]
    fn key(&self) -> (u64, u64) {
        (self.start, self.seq)
    }
}

/// The treap priority of insertion number `seq`: the splitmix64 finalizer, so consecutive
/// insertions get unrelated priorities.
#[inline]
fn prio_of(seq: u64) -> u32 {
    let mut z = seq.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    (z ^ (z >> 31)) as u32
}

/// One sort list: the root of a treap in the shared node pool.
#[derive(Debug, Clone, Copy)]
pub(super) struct Tree {
    root: u32,
    len: u32,
}

impl Default for Tree {
    fn default() -> Self {
        Self::EMPTY
    }
}

impl Tree {
    pub(super) const EMPTY: Tree = Tree { root: NIL, len: 0 };

    /// Requests in the list.
    // Used by the unit tests, which are not built under loom.
    #[cfg_attr(any(not(test), blkq_loom), allow(dead_code))]
    pub(super) fn len(&self) -> u32 {
        self.len
    }

    /// Links node `x` with key `(start, seq)` into the list (it must not be in any list).
    pub(super) fn insert(&mut self, nodes: &mut [Node], x: u32, start: u64, seq: u64) {
        nodes[x as usize] = Node {
            start,
            seq,
            left: NIL,
            right: NIL,
            prio: prio_of(seq),
        };
        self.root = Self::insert_at(nodes, self.root, x);
        self.len += 1;
    }

    fn insert_at(nodes: &mut [Node], t: u32, x: u32) -> u32 {
        if t == NIL {
            return x;
        }
        let (xn, tn) = (nodes[x as usize], nodes[t as usize]);
        if xn.prio > tn.prio {
            let (l, r) = Self::split(nodes, t, xn.key());
            let n = &mut nodes[x as usize];
            n.left = l;
            n.right = r;
            return x;
        }
        if xn.key() < tn.key() {
            let l = Self::insert_at(nodes, tn.left, x);
            nodes[t as usize].left = l;
        } else {
            let r = Self::insert_at(nodes, tn.right, x);
            nodes[t as usize].right = r;
        }
        t
    }

    /// Splits subtree `t` into the keys below `key` and the keys above it (`key` itself is
    /// not in it).
    fn split(nodes: &mut [Node], t: u32, key: (u64, u64)) -> (u32, u32) {
        if t == NIL {
            return (NIL, NIL);
        }
        let tn = nodes[t as usize];
        if tn.key() < key {
            let (l, r) = Self::split(nodes, tn.right, key);
            nodes[t as usize].right = l;
            (t, r)
        } else {
            let (l, r) = Self::split(nodes, tn.left, key);
            nodes[t as usize].left = r;
            (l, t)
        }
    }

    /// Joins subtrees `a` and `b`, every key of `a` below every key of `b`.
    fn join(nodes: &mut [Node], a: u32, b: u32) -> u32 {
        if a == NIL {
            return b;
        }
        if b == NIL {
            return a;
        }
        if nodes[a as usize].prio > nodes[b as usize].prio {
            let r = Self::join(nodes, nodes[a as usize].right, b);
            nodes[a as usize].right = r;
            a
        } else {
            let l = Self::join(nodes, a, nodes[b as usize].left);
            nodes[b as usize].left = l;
            b
        }
    }

    /// Unlinks node `x` (which must be in this list). Returns whether it was found.
    pub(super) fn remove(&mut self, nodes: &mut [Node], x: u32) -> bool {
        let key = nodes[x as usize].key();
        // Walk down to `x`, remembering the link that points at it.
        let mut parent = NIL;
        let mut cur = self.root;
        while cur != NIL && cur != x {
            parent = cur;
            let cn = nodes[cur as usize];
            cur = if key < cn.key() { cn.left } else { cn.right };
        }
        if cur == NIL {
            return false;
        }
        let xn = nodes[x as usize];
        let sub = Self::join(nodes, xn.left, xn.right);
        if parent == NIL {
            self.root = sub;
        } else if nodes[parent as usize].left == x {
            nodes[parent as usize].left = sub;
        } else {
            nodes[parent as usize].right = sub;
        }
        self.len -= 1;
        true
    }

    /// The first request (lowest key) whose start sector is at or after `start`.
    #[inline]
    pub(super) fn first_at_or_after(&self, nodes: &[Node], start: u64) -> Option<u32> {
        let mut best = NIL;
        let mut cur = self.root;
        while cur != NIL {
            let n = &nodes[cur as usize];
            if n.start >= start {
                best = cur;
                cur = n.left;
            } else {
                cur = n.right;
            }
        }
        (best != NIL).then_some(best)
    }

    /// The last request (highest key) whose start sector is before `start`.
    #[inline]
    pub(super) fn last_before(&self, nodes: &[Node], start: u64) -> Option<u32> {
        let mut best = NIL;
        let mut cur = self.root;
        while cur != NIL {
            let n = &nodes[cur as usize];
            if n.start < start {
                best = cur;
                cur = n.right;
            } else {
                cur = n.left;
            }
        }
        (best != NIL).then_some(best)
    }
}

#[cfg(all(test, not(blkq_loom)))]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    fn check(nodes: &[Node], t: u32, lo: Option<(u64, u64)>, hi: Option<(u64, u64)>) -> u32 {
        if t == NIL {
            return 0;
        }
        let n = nodes[t as usize];
        assert!(lo.is_none_or(|lo| n.key() > lo));
        assert!(hi.is_none_or(|hi| n.key() < hi));
        for c in [n.left, n.right] {
            if c != NIL {
                assert!(nodes[c as usize].prio <= n.prio);
            }
        }
        1 + check(nodes, n.left, lo, Some(n.key())) + check(nodes, n.right, Some(n.key()), hi)
    }

    /// Random inserts, removals and searches against a `BTreeSet` model.
    #[test]
    fn treap_matches_a_sorted_set() {
        const N: u32 = 256;
        let mut nodes = vec![Node::EMPTY; N as usize];
        let mut t = Tree::EMPTY;
        let mut model: BTreeSet<(u64, u64, u32)> = BTreeSet::new();
        let mut inside = vec![false; N as usize];
        let mut rng = 0x1234_5678_9abc_def0u64;
        let mut next = || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        for seq in 0..20_000u64 {
            let x = (next() % u64::from(N)) as u32;
            if inside[x as usize] {
                let n = nodes[x as usize];
                assert!(t.remove(&mut nodes, x));
                assert!(model.remove(&(n.start, n.seq, x)));
                inside[x as usize] = false;
            } else {
                // Few distinct sectors, so equal starts are common.
                let start = next() % 64;
                t.insert(&mut nodes, x, start, seq);
                model.insert((start, seq, x));
                inside[x as usize] = true;
            }
            assert_eq!(t.len() as usize, model.len());
            assert_eq!(check(&nodes, t.root, None, None) as usize, model.len());
            let probe = next() % 70;
            let want = model.range((probe, 0, 0)..).next().map(|k| k.2);
            assert_eq!(t.first_at_or_after(&nodes, probe), want);
            let want = model.range(..(probe, 0, 0)).next_back().map(|k| k.2);
            assert_eq!(t.last_before(&nodes, probe), want);
        }
    }
}
