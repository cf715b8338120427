//! Property test: random single-threaded sequences of `Sbitmap` operations against a model (the
//! set of owned tags plus the current depth).
//!
//! After every step: `weight()` equals the model's size and `test(t)` agrees with the model for
//! every tag below the capacity (and is false past it). Each allocation hands out tags that are
//! below the depth of the moment and were free; an allocation fails only if the model has no
//! free tag it was allowed to take (deferred clears are folded on demand, so a free tag is
//! always found). Frees of tags not owned (never allocated, already freed, out of range) are
//! refused and change nothing.
// A plain threaded test or benchmark, never a loom model: its own harness (std locks, atomics,
// condition variables, baselines) is not what a model must explore, so it may use std::sync.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]
#![cfg(not(blkq_loom))]

use std::collections::BTreeSet;

use proptest::collection::vec;
use proptest::prelude::*;
use sbitmap::Sbitmap;

#[derive(Debug, Clone)]
enum Op {
    Get,
    GetShallow(u32),
    GetBatch(u32),
    /// Frees the owned tag at this position (modulo the number owned).
    Put(usize),
    /// Frees a tag that is not owned, found from this seed: must be refused.
    PutNotOwned(u32),
    /// Frees again a tag freed earlier (at this position in the history), if not owned now:
    /// a double free, which must be refused even while its deferred clear is pending.
    PutFreedAgain(usize),
    /// Frees the owned tags whose position (modulo 64) has its bit set in the mask; with
    /// `junk`, tags not owned are mixed in and must be skipped.
    PutBatch {
        mask: u64,
        junk: Vec<u32>,
    },
    /// Resizes to this seed modulo `capacity + 1`.
    Resize(u32),
    /// Resizes past the capacity: must fail and change nothing.
    ResizeTooLarge(u32),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => Just(Op::Get),
        2 => (0u32..=33).prop_map(Op::GetShallow),
        2 => (1u32..=33).prop_map(Op::GetBatch),
        5 => any::<usize>().prop_map(Op::Put),
        1 => any::<u32>().prop_map(Op::PutNotOwned),
        1 => any::<usize>().prop_map(Op::PutFreedAgain),
        2 => (any::<u64>(), prop_oneof![3 => Just(vec![]), 1 => vec(any::<u32>(), 1..4)])
            .prop_map(|(mask, junk)| Op::PutBatch { mask, junk }),
        1 => any::<u32>().prop_map(Op::Resize),
        1 => (1u32..100).prop_map(Op::ResizeTooLarge),
    ]
}

/// A tag that the model does not own, from `seed`: below the capacity or up to 64 past it.
fn not_owned(owned: &BTreeSet<u32>, capacity: u32, seed: u32) -> u32 {
    let mut t = seed % (capacity + 64);
    while owned.contains(&t) {
        t += 1;
    }
    t
}

struct Harness {
    sb: Sbitmap,
    capacity: u32,
    bpw: u32,
    depth: u32,
    owned: BTreeSet<u32>,
    /// Every tag freed so far, in order (for double frees).
    freed: Vec<u32>,
}

impl Harness {
    /// Records a fresh allocation of `t`, checking it was allowed.
    fn take(&mut self, t: u32, what: &str) {
        assert!(
            t < self.depth,
            "{what}: tag {t} not below depth {}",
            self.depth
        );
        assert!(self.owned.insert(t), "{what}: tag {t} was already owned");
    }

    fn free_below(&self, limit_in_word: u32) -> Vec<u32> {
        (0..self.depth)
            .filter(|t| t % self.bpw < limit_in_word && !self.owned.contains(t))
            .collect()
    }

    fn step(&mut self, op: &Op) {
        match op {
            Op::Get => match self.sb.get() {
                Some(t) => self.take(t, "get"),
                None => assert_eq!(
                    self.free_below(u32::MAX),
                    Vec::<u32>::new(),
                    "get failed with free tags (depth {})",
                    self.depth
                ),
            },
            &Op::GetShallow(d) => match self.sb.get_shallow(d) {
                Some(t) => {
                    assert!(
                        t % self.bpw < d,
                        "get_shallow({d}): tag {t} has in-word index {} (bpw {})",
                        t % self.bpw,
                        self.bpw
                    );
                    self.take(t, "get_shallow");
                }
                None => assert_eq!(
                    self.free_below(d),
                    Vec::<u32>::new(),
                    "get_shallow({d}) failed with free tags (depth {})",
                    self.depth
                ),
            },
            &Op::GetBatch(n) => match self.sb.get_batch(n) {
                Some(b) => {
                    assert!(
                        (1..=n).contains(&b.len()),
                        "get_batch({n}) returned {} tags",
                        b.len()
                    );
                    assert_eq!(
                        b.base % self.bpw,
                        0,
                        "batch base {} not a word start",
                        b.base
                    );
                    if self.bpw < 32 {
                        assert_eq!(
                            b.mask >> self.bpw,
                            0,
                            "batch mask {:#x} spans words",
                            b.mask
                        );
                    }
                    // Not checked: that it takes `min(n, free tags of the word)`. It takes only
                    // bits whose `alloc` bit is clear and folds deferred clears only when the
                    // word looks full, so it may return fewer (the doc says "up to `n`").
                    let tags: Vec<u32> = b.iter().collect();
                    assert!(tags.windows(2).all(|w| w[0] < w[1]));
                    for t in tags {
                        self.take(t, "get_batch");
                    }
                }
                None => assert_eq!(
                    self.free_below(u32::MAX),
                    Vec::<u32>::new(),
                    "get_batch({n}) failed with free tags (depth {})",
                    self.depth
                ),
            },
            &Op::Put(i) => {
                if self.owned.is_empty() {
                    return;
                }
                let t = *self.owned.iter().nth(i % self.owned.len()).unwrap();
                assert!(self.sb.put(t), "put of owned tag {t} refused");
                self.owned.remove(&t);
                self.freed.push(t);
            }
            &Op::PutNotOwned(seed) => {
                let t = not_owned(&self.owned, self.capacity, seed);
                assert!(!self.sb.put(t), "put of tag {t}, not owned, accepted");
            }
            &Op::PutFreedAgain(i) => {
                if self.freed.is_empty() {
                    return;
                }
                let t = self.freed[i % self.freed.len()];
                if !self.owned.contains(&t) {
                    assert!(!self.sb.put(t), "double free of tag {t} accepted");
                }
            }
            Op::PutBatch { mask, junk } => {
                let owned: Vec<u32> = self.owned.iter().copied().collect();
                let picked: Vec<u32> = owned
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| mask & (1 << (i % 64)) != 0)
                    .map(|(_, &t)| t)
                    .collect();
                let mut tags = picked.clone();
                tags.extend(
                    junk.iter()
                        .map(|&s| not_owned(&self.owned, self.capacity, s)),
                );
                tags.sort_unstable();
                tags.dedup();
                let n = self.sb.put_batch(&tags);
                assert_eq!(
                    n as usize,
                    picked.len(),
                    "put_batch({tags:?}) freed {n}, expected {}",
                    picked.len()
                );
                for t in picked {
                    self.owned.remove(&t);
                    self.freed.push(t);
                }
            }
            &Op::Resize(seed) => {
                let d = seed % (self.capacity + 1);
                self.sb.resize(d).unwrap();
                self.depth = d;
            }
            &Op::ResizeTooLarge(extra) => {
                assert!(self.sb.resize(self.capacity + extra).is_err());
            }
        }
    }

    fn check(&self) {
        assert_eq!(self.sb.depth(), self.depth, "depth");
        assert_eq!(self.sb.weight() as usize, self.owned.len(), "weight");
        for t in 0..self.capacity + 64 {
            assert_eq!(
                self.sb.test(t),
                self.owned.contains(&t),
                "test({t}) disagrees with the model"
            );
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn sbitmap_matches_model(
        depth in 1u32..=200,
        shift in prop_oneof![Just(None), (0u32..=5).prop_map(Some)],
        round_robin in any::<bool>(),
        ops in vec(op(), 1..300),
    ) {
        let sb = Sbitmap::new(depth, shift, round_robin).unwrap();
        let bpw = 1u32 << sb.shift();
        let mut h = Harness {
            sb,
            capacity: depth,
            bpw,
            depth,
            owned: BTreeSet::new(),
            freed: Vec::new(),
        };
        h.check();
        for op in &ops {
            h.step(op);
            h.check();
        }
        // Draining: every tag below the depth is still obtainable, once.
        while let Some(t) = h.sb.get() {
            h.take(t, "drain");
        }
        prop_assert_eq!(h.free_below(u32::MAX), Vec::<u32>::new());
        h.check();
    }
}
