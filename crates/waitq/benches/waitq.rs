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

#[cfg(not(blkq_loom))]
mod benches {
    use std::hint::black_box;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Condvar, Mutex};
    use std::thread;
    use std::time::Duration;

    use criterion::{criterion_group, Criterion};
    use waitq::{Completion, WaitQueue};

    /// The baseline: a completion on `Mutex<bool>` + `Condvar`, the textbook way. `wait`
    /// consumes the flag; every bench here waits once per `complete`, so a flag is enough.
    #[derive(Default)]
    struct CondvarCompletion {
        done: Mutex<bool>,
        cv: Condvar,
    }

    impl CondvarCompletion {
        fn complete(&self) {
            *self.done.lock().unwrap() = true;
            self.cv.notify_one();
        }

        fn wait(&self) {
            let mut done = self.done.lock().unwrap();
            while !*done {
                done = self.cv.wait(done).unwrap();
            }
            *done = false;
        }
    }

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

    fn bench_ping_pong(c: &mut Criterion) {
        ping_pong::<Completion>(c, "ping_pong/waitq_completion");
        ping_pong::<CondvarCompletion>(c, "ping_pong/mutex_condvar");
    }

    fn bench_uncontended(c: &mut Criterion) {
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

    fn bench_wake_no_waiters(c: &mut Criterion) {
        let wq = WaitQueue::new();
        c.bench_function("wake_no_waiters/waitq_wake_one", |b| {
            b.iter(|| black_box(black_box(&wq).wake_one()))
        });
        let cv = Condvar::new();
        c.bench_function("wake_no_waiters/condvar_notify_one", |b| {
            b.iter(|| black_box(&cv).notify_one())
        });
    }

    fn config() -> Criterion {
        Criterion::default()
            .warm_up_time(Duration::from_secs(1))
            .measurement_time(Duration::from_secs(2))
            .sample_size(20)
    }

    criterion_group! {
        name = all;
        config = config();
        targets = bench_ping_pong, bench_uncontended, bench_wake_no_waiters
    }

    pub fn main() {
        all();
        Criterion::default().configure_from_args().final_summary();
    }
}

#[cfg(not(blkq_loom))]
fn main() {
    benches::main();
}

#[cfg(blkq_loom)]
fn main() {}
