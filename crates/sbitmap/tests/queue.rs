//! SbitmapQueue: deterministic tests of the wake-up algorithms, including a free nested inside
//! another free's wake-up path (the failure case that counter-based batched wake-ups fix),
//! the pass-on rule for async waiters, and a threaded stress test.
// A plain threaded test or benchmark, never a loom model: its own harness (std locks, atomics,
// condition variables, baselines) is not what a model must explore, so it may use std::sync.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]
#![cfg(not(blkq_loom))]

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};

use sbitmap::{GetTag, SbitmapQueue, WakeAlgo};

struct CountingWaker(AtomicUsize);

impl Wake for CountingWaker {
    fn wake(self: Arc<Self>) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

fn counting_waker() -> (Waker, Arc<CountingWaker>) {
    let c = Arc::new(CountingWaker(AtomicUsize::new(0)));
    (Waker::from(c.clone()), c)
}

fn poll<F: Future + Unpin>(f: &mut F, w: &Waker) -> Poll<F::Output> {
    Pin::new(f).poll(&mut Context::from_waker(w))
}

/// A tag waiter on the full `q`, polled once (it sleeps), with its waker and wake-up count.
fn asleep(q: &SbitmapQueue) -> (GetTag<'_>, Waker, Arc<CountingWaker>) {
    let (w, c) = counting_waker();
    let mut f = q.get_async();
    assert!(poll(&mut f, &w).is_pending());
    (f, w, c)
}

/// Two sleepers, both tags in flight, then the first free is interrupted by the second free
/// (nested on the same thread). Returns how many sleepers were woken, and lets the woken ones
/// take their tags.
fn nested_free(algo: WakeAlgo) -> (usize, u32) {
    let q = SbitmapQueue::new(2, None, false, algo).unwrap();
    assert_eq!(q.wake_batch(), 1);
    let t0 = q.get().unwrap();
    let t1 = q.get().unwrap();
    let (mut f1, w1, c1) = asleep(&q);
    let (mut f2, w2, c2) = asleep(&q);
    assert_eq!(q.ws_active(), 2);

    q.put_nested(t0, &mut || {
        assert!(q.put(t1));
    });

    let woken = c1.0.load(Ordering::SeqCst) + c2.0.load(Ordering::SeqCst);
    let mut got = 0;
    if c1.0.load(Ordering::SeqCst) > 0 {
        assert!(poll(&mut f1, &w1).is_ready());
        got += 1;
    }
    if c2.0.load(Ordering::SeqCst) > 0 {
        assert!(poll(&mut f2, &w2).is_ready());
        got += 1;
    }
    assert_eq!(q.bitmap().weight(), got);
    (woken, 2 - q.bitmap().weight())
}

#[test]
fn counter_algorithm_survives_a_nested_free() {
    let (woken, free) = nested_free(WakeAlgo::Counter);
    assert_eq!(woken, 2, "both sleepers must be woken by two frees");
    assert_eq!(free, 0);
}

/// The expected failure of the legacy path: this test asserts that the bug exists, so that
/// the comparison the benchmarks make is against the real legacy behaviour.
#[test]
fn legacy_algorithm_loses_a_wakeup_on_a_nested_free() {
    let (woken, free) = nested_free(WakeAlgo::Legacy);
    assert_eq!(woken, 1, "legacy: the nested free's wake-up is lost");
    assert_eq!(free, 1, "...while a tag sits free and a sleeper sleeps");
}

#[test]
fn wake_batch_follows_depth_and_shallow_depth() {
    let q = SbitmapQueue::new(64, None, false, WakeAlgo::Counter).unwrap();
    assert_eq!(q.wake_batch(), 8);
    q.set_min_shallow_depth(4); // 4 words x 4 bits = 16 usable -> 2
    assert_eq!(q.wake_batch(), 2);
    let q = SbitmapQueue::new(16, None, false, WakeAlgo::Counter).unwrap();
    assert_eq!(q.wake_batch(), 2);
    q.resize(4).unwrap();
    assert_eq!(q.wake_batch(), 1);
}

#[test]
fn no_counting_without_waiters() {
    let q = SbitmapQueue::new(8, None, false, WakeAlgo::Counter).unwrap();
    for _ in 0..100 {
        let t = q.get().unwrap();
        q.put(t);
    }
    assert_eq!(q.counters(), (0, 0));
}

#[test]
fn batched_wakeups_follow_the_counters() {
    // depth 16 -> wake_batch 2: a sleeper is woken by the second free, not the first.
    let q = SbitmapQueue::new(16, None, false, WakeAlgo::Counter).unwrap();
    assert_eq!(q.wake_batch(), 2);
    let tags: Vec<u32> = (0..16).map(|_| q.get().unwrap()).collect();
    let (mut f, w, c) = asleep(&q);
    q.put(tags[0]);
    assert_eq!(c.0.load(Ordering::SeqCst), 0);
    assert_eq!(q.counters(), (1, 0));
    q.put(tags[1]);
    assert_eq!(c.0.load(Ordering::SeqCst), 1);
    assert_eq!(q.counters(), (2, 2));
    assert!(poll(&mut f, &w).is_ready());
    assert_eq!(q.ws_active(), 0);
}

#[test]
fn put_batch_owing_two_batches_wakes_both() {
    let q = SbitmapQueue::new(16, None, false, WakeAlgo::Counter).unwrap();
    let tags: Vec<u32> = (0..16).map(|_| q.get().unwrap()).collect();
    let wakers: Vec<_> = (0..4).map(|_| counting_waker()).collect();
    let mut futs: Vec<_> = (0..4).map(|_| q.get_async()).collect();
    for (f, (w, _)) in futs.iter_mut().zip(&wakers) {
        assert!(poll(f, w).is_pending());
    }
    let mut sorted = tags[..4].to_vec();
    sorted.sort_unstable();
    assert_eq!(q.put_batch(&sorted), 4);
    let woken: usize = wakers.iter().map(|(_, c)| c.0.load(Ordering::SeqCst)).sum();
    assert_eq!(woken, 4, "4 frees with wake_batch 2 owe two batches");
}

#[test]
fn dropped_async_waiter_passes_its_wakeup_on() {
    let q = SbitmapQueue::new(1, None, false, WakeAlgo::Counter).unwrap();
    let t = q.get().unwrap();
    let (f1, w1, c1) = asleep(&q);
    let (f2, w2, c2) = asleep(&q);
    q.put(t);
    let (first, second) = if c1.0.load(Ordering::SeqCst) == 1 {
        (f1, (f2, w2, c2))
    } else {
        (f2, (f1, w1, c1))
    };
    drop(first); // chosen, but gives up
    let (mut f, w, c) = second;
    assert_eq!(c.0.load(Ordering::SeqCst), 1, "the wake-up was passed on");
    assert_eq!(poll(&mut f, &w), Poll::Ready(t));
}

/// The pass-on rule for async tag waiters, driven by hand (no threads, no timing).
///
/// A and B sleep on a full bitmap of two tags. The free of tag 0 chooses A. Before A runs,
/// B is polled (spuriously, still queued) and its allocation takes tag 0; in the window between
/// that allocation and B leaving the queue (a window other threads fill in a real run; here
/// B's allocation closure fills it), A runs, finds nothing and queues again, and tag 1 is
/// freed, which chooses B, still queued. B's wake-up is then spare: unless B passes it on, A
/// sleeps while tag 1 is free.
#[test]
fn async_waiter_whose_check_succeeded_first_passes_its_wakeup_on() {
    use std::cell::{Cell, RefCell};

    let q = SbitmapQueue::new(2, None, false, WakeAlgo::Counter).unwrap();
    assert_eq!(q.wake_batch(), 1);
    let t0 = q.get().unwrap();
    let t1 = q.get().unwrap();
    let (wa, ca) = counting_waker();
    let (wb, cb) = counting_waker();

    let a = RefCell::new(q.get_async());
    assert!(poll(&mut *a.borrow_mut(), &wa).is_pending());

    let armed = Cell::new(false);
    let mut b = q.get_async_with(|sb| {
        let got = sb.get();
        if got.is_some() && armed.replace(false) {
            // The window between B's successful allocation and B leaving the queue.
            assert!(
                poll(&mut *a.borrow_mut(), &wa).is_pending(),
                "A finds nothing"
            );
            assert!(q.put(t1));
        }
        got
    });
    assert!(poll(&mut b, &wb).is_pending());
    assert_eq!(q.ws_active(), 2);

    assert!(q.put(t0));
    assert_eq!(ca.0.load(Ordering::SeqCst), 1, "the free of tag 0 chose A");
    assert_eq!(cb.0.load(Ordering::SeqCst), 0);

    armed.set(true);
    assert_eq!(poll(&mut b, &wb), Poll::Ready(t0), "B takes tag 0");
    assert_eq!(cb.0.load(Ordering::SeqCst), 1, "the free of tag 1 chose B");
    assert_eq!(q.bitmap().weight(), 1, "tag 1 is free");
    assert_eq!(q.ws_active(), 1, "A sleeps");
    assert_eq!(
        ca.0.load(Ordering::SeqCst),
        2,
        "B passed its spare wake-up on to A, asleep behind the free tag 1"
    );
    assert_eq!(poll(&mut *a.borrow_mut(), &wa), Poll::Ready(t1));
    assert_eq!(q.ws_active(), 0);
}

fn stress(algo: WakeAlgo, depth: u32, threads: usize, iters: usize) {
    let q = Arc::new(SbitmapQueue::new(depth, None, false, algo).unwrap());
    let owners: Arc<Vec<AtomicUsize>> = Arc::new((0..depth).map(|_| AtomicUsize::new(0)).collect());
    let hs: Vec<_> = (0..threads)
        .map(|id| {
            let (q, owners) = (q.clone(), owners.clone());
            std::thread::spawn(move || {
                for _ in 0..iters {
                    let t = q.get_or_wait();
                    assert_eq!(owners[t as usize].swap(id + 1, Ordering::AcqRel), 0);
                    std::hint::spin_loop();
                    assert_eq!(owners[t as usize].swap(0, Ordering::AcqRel), id + 1);
                    assert!(q.put(t));
                }
            })
        })
        .collect();
    for h in hs {
        h.join().unwrap();
    }
    assert_eq!(q.bitmap().weight(), 0);
    assert_eq!(q.ws_active(), 0);
}

#[test]
fn counter_stress_small_depth_many_threads() {
    stress(WakeAlgo::Counter, 2, 6, 5_000);
    stress(WakeAlgo::Counter, 16, 8, 5_000);
}
