//! Benchmarks of `waitq` against `std::sync::{Mutex, Condvar}` baselines.
//!
//! 1. `ping_pong`: a wake/wait round trip between two threads. The bench thread completes
//!    `ping` and waits on `pong`; a helper thread waits on `ping` and completes `pong`. One
//!    iteration is one full round trip (two wake-ups, normally two sleeps).
//! 2. `uncontended`: `complete()` then `wait()` on one thread (no sleep, no other thread).
//! 3. `wake_no_waiters`: `wake_one` with no one queued (the lock-free fast path) vs
//!    `Condvar::notify_one` with no one waiting.
//!
//! Everything is behind `cfg(not(blkq_loom))`: under loom the facade's types only work inside
//! a loom model.
// A plain threaded test or benchmark, never a loom model: its own harness (std locks, atomics,
// condition variables, baselines) is not what a model must explore, so it may use std::sync.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]

#[cfg(not(blkq_loom))]
mod benches {
    use std::hint::black_box;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Condvar};
    use std::thread;

    use criterion::Criterion;
    use testkit::baseline::CondvarCompletion;
    use waitq::{Completion, WaitQueue};

    /// The bench-facing interface both completions share.
    trait Signal: Default + Send + Sync + 'static {
        fn signal(&self);
        fn await_signal(&self);
    }

    impl Signal for Completion {
        fn signal(&self) {
            self.complete();
        }
        fn await_signal(&self) {
            self.wait();
        }
    }

    impl Signal for CondvarCompletion {
        fn signal(&self) {
            self.complete();
        }
        fn await_signal(&self) {
            self.wait();
        }
    }

    /// Runs the ping-pong round trip for completion type `S`.
    fn ping_pong<S: Signal>(c: &mut Criterion, name: &str) {
        let ping = Arc::new(S::default());
        let pong = Arc::new(S::default());
        let stop = Arc::new(AtomicBool::new(false));
        let helper = {
            let (ping, pong, stop) = (ping.clone(), pong.clone(), stop.clone());
            thread::spawn(move || loop {
                ping.await_signal();
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                pong.signal();
            })
        };
        c.bench_function(name, |b| {
            b.iter(|| {
                ping.signal();
                pong.await_signal();
            })
        });
        stop.store(true, Ordering::Relaxed);
        ping.signal();
        helper.join().unwrap();
    }

    pub fn bench_ping_pong(c: &mut Criterion) {
        ping_pong::<Completion>(c, "ping_pong/waitq_completion");
        ping_pong::<CondvarCompletion>(c, "ping_pong/mutex_condvar");
    }

    pub fn bench_uncontended(c: &mut Criterion) {
        let comp = Completion::new();
        c.bench_function("uncontended/waitq_completion", |b| {
            b.iter(|| {
                black_box(&comp).complete();
                black_box(&comp).wait();
            })
        });
        let base = CondvarCompletion::default();
        c.bench_function("uncontended/mutex_condvar", |b| {
            b.iter(|| {
                black_box(&base).complete();
                black_box(&base).wait();
            })
        });
    }

    pub fn bench_wake_no_waiters(c: &mut Criterion) {
        let wq = WaitQueue::new();
        c.bench_function("wake_no_waiters/waitq_wake_one", |b| {
            b.iter(|| black_box(black_box(&wq).wake_one()))
        });
        let cv = Condvar::new();
        c.bench_function("wake_no_waiters/condvar_notify_one", |b| {
            b.iter(|| black_box(&cv).notify_one())
        });
    }
}

testkit::bench_main!(
    benches::bench_ping_pong,
    benches::bench_uncontended,
    benches::bench_wake_no_waiters
);
