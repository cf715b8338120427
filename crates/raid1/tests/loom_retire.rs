//! Loom models of `retire::Retirement`, the array's lifetime against its legs' completions
//! without a reference count per completion (see `crates/raid1/src/retire.rs`):
//!
//! - the owner drops the array on another thread while completions (on two shards, or two on
//!   one shard) are still inside: the array is freed exactly once, after every completion's
//!   last touch (loom's `UnsafeCell` flags a free not ordered after a touch);
//! - the owner drops it from inside a completion (once its drain saw every I/O end), beside
//!   another completion on another shard: the same;
//! - the naive rule (free right after the drain) fails the model.
#![cfg(blkq_loom)]

use blkq_sync::atomic::{AtomicUsize, Ordering};
use blkq_sync::{thread, Arc, UnsafeCell};
use raid1::retire::Retirement;

const LIVE: u64 = 1;
const DEAD: u64 = 0;

/// The "array": what completions touch, the drain's count, and the frees.
struct Shared {
    data: UnsafeCell<u64>,
    /// I/Os ended (what the owner's drain waits for).
    ended: AtomicUsize,
    freed: AtomicUsize,
    r: Retirement<Token>,
}

/// The owner's reference: dropping it frees the "array".
struct Token(Arc<Shared>);

impl Drop for Token {
    fn drop(&mut self) {
        // The free: a write that must come after every completion's touch.
        // SAFETY: loom checks the access (the model's subject).
        self.0.data.with_mut(|p| unsafe { *p = DEAD });
        self.0.freed.fetch_add(1, Ordering::Relaxed);
    }
}

fn shared(shards: usize) -> Arc<Shared> {
    Arc::new(Shared {
        data: UnsafeCell::new(LIVE),
        ended: AtomicUsize::new(0),
        freed: AtomicUsize::new(0),
        r: Retirement::new(shards),
    })
}

fn touch(s: &Shared) {
    // SAFETY: loom checks the access (the model's subject).
    s.data
        .with(|p| assert_eq!(unsafe { *p }, LIVE, "a completion touched a freed array"));
}

/// A leg completion on `shard`: in, a touch, its I/O ends (the drain's count), a touch after
/// (the mirror's bookkeeping past the caller's completion), out.
fn completion(s: &Arc<Shared>, shard: usize) {
    let inside = s.r.enter(shard);
    touch(s);
    s.ended.fetch_add(1, Ordering::Release);
    touch(s);
    drop(s.r.exit(inside));
}

/// The owner: drains (waits until `n` I/Os ended), then retires.
fn owner(s: &Arc<Shared>, n: usize) {
    while s.ended.load(Ordering::Acquire) < n {
        thread::yield_now();
    }
    drop(s.r.retire(Token(s.clone())));
}

fn two_completions_and_an_owner(shards: [usize; 2]) {
    let s = shared(2);
    let ts: Vec<_> = shards
        .iter()
        .map(|&shard| {
            let s = s.clone();
            thread::spawn(move || completion(&s, shard))
        })
        .collect();
    owner(&s, 2);
    for t in ts {
        t.join().unwrap();
    }
    assert_eq!(s.freed.load(Ordering::Relaxed), 1, "freed once, not leaked");
    assert_eq!(s.r.inside(), 0);
}

#[test]
fn loom_retire_owner_drops_while_completions_on_two_shards_finish() {
    blkq_sync::model(|| two_completions_and_an_owner([0, 1]));
}

#[test]
fn loom_retire_owner_drops_while_completions_on_one_shard_finish() {
    blkq_sync::model(|| two_completions_and_an_owner([1, 1]));
}

#[test]
fn loom_retire_dropped_from_inside_a_completion() {
    blkq_sync::model(|| {
        let s = shared(2);
        let other = {
            let s = s.clone();
            thread::spawn(move || completion(&s, 1))
        };
        // The owner's drop runs inside this completion once the other I/O has ended too.
        let inside = s.r.enter(0);
        touch(&s);
        s.ended.fetch_add(1, Ordering::Release);
        while s.ended.load(Ordering::Acquire) < 2 {
            thread::yield_now();
        }
        drop(s.r.retire(Token(s.clone())));
        touch(&s);
        drop(s.r.exit(inside));
        other.join().unwrap();
        assert_eq!(s.freed.load(Ordering::Relaxed), 1, "freed once, not leaked");
    });
}

/// The naive rule: the owner frees as soon as its drain is done. A completion still in its
/// bookkeeping then touches a freed array: loom reports it.
#[test]
fn loom_retire_free_after_the_drain_alone_fails() {
    let stderr = testkit::loom_child::expect_model_failure(
        "loom_retire_free_after_the_drain_alone_fails",
        "freeing right after the drain passed the model",
        || {
            let s = shared(1);
            let t = {
                let s = s.clone();
                thread::spawn(move || {
                    touch(&s);
                    s.ended.fetch_add(1, Ordering::Release);
                    touch(&s);
                })
            };
            while s.ended.load(Ordering::Acquire) < 1 {
                thread::yield_now();
            }
            drop(Token(s.clone()));
            t.join().unwrap();
        },
    );
    assert!(
        stderr.contains("a completion touched a freed array")
            || stderr.contains("Causality violation"),
        "child failed for another reason:\n{stderr}"
    );
}
