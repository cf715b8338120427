//! Benchmarks of tag allocation: `Sbitmap` / `SbitmapQueue` against simple baselines.
//!
//! One iteration is one tag taken and given back (get + put) by one thread.
//!
//! 1. `get_put_1t/*`: one thread, 128 tags. `Sbitmap::get`/`put`, `SbitmapQueue::get`/`put`
//!    (the same plus the wake-up path's fence and `ws_active` check), a `Mutex<Vec<u32>>` free
//!    list (pop/push) and a `crossbeam_queue::ArrayQueue<u32>` (pop/push).
//! 2. `get_put_2t/*`: the same loops run by two threads on one structure. In each sample a
//!    second thread runs as many iterations as the bench thread; the time reported is the wall
//!    time from a common start until both are done, divided by the operations of both (so it
//!    is the inverse of the aggregate throughput). See `bench_two_threads` on why
//!    the second thread is not spawned anew for each sample.
//! 3. `sbq_sleep_d2_4t/*`: `SbitmapQueue::get_or_wait`/`put` at depth 2 with four threads:
//!    the counter algorithm (counter-based batched wake-ups) against the legacy `wait_cnt`
//!    one, plus a `Mutex` + `Condvar` tag pool for scale. Time per op is wall time over the operations of all four
//!    threads. On a machine with fewer than four free cores a tight get+put loop seldom finds
//!    both tags taken (a tag is held for a few nanoseconds, and at most one thread per core
//!    runs), so `sbq_sleep_d2_4t_yield/*` repeats it with each worker yielding the CPU while it
//!    holds its tag: then allocators really queue and sleep (about 0.6 to 0.8 waits per
//!    operation on 2 CPUs). The waits per operation are printed at the end of the run.
//!
//!    The legacy algorithm can lose a wake-up (that is why it was replaced). Mid-run, a later
//!    free wakes the sleeper anyway; but once the other threads are done no free is left to do
//!    so, and it would sleep forever. The bench thread watches the workers' progress and, if
//!    nobody progressed for `STALL` (20 ms) while a worker is unfinished, calls `wake_all` and
//!    counts a *kick*; the stalled time stays in the measurement. Kicks are printed at the end
//!    (a loaded machine can also cause the odd kick, by descheduling every worker at once).
//!
//! Everything is behind `cfg(not(blkq_loom))`: under loom the facade's types only work inside
//! a loom model.
// A plain threaded test or benchmark, never a loom model: its own harness (std locks, atomics,
// condition variables, baselines) is not what a model must explore, so it may use std::sync.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]

#[cfg(not(blkq_loom))]
mod benches {
    use std::cell::Cell;
    use std::hint::black_box;
    use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
    use std::sync::{mpsc, Barrier};
    use std::thread;
    use std::time::{Duration, Instant};

    use criterion::measurement::WallTime;
    use criterion::{BenchmarkGroup, Criterion, Throughput};
    use crossbeam_queue::ArrayQueue;
    use sbitmap::{Sbitmap, SbitmapQueue, WakeAlgo};
    use testkit::baseline::{CondvarPool, MutexPool};

    const DEPTH: u32 = 128;

    /// How long no worker may progress before the watchdog kicks the sleepers.
    const STALL: Duration = Duration::from_millis(20);

    thread_local! {
        /// Times this thread queued and slept (or was about to) for a tag.
        static WAITS: Cell<u64> = const { Cell::new(0) };
    }

    fn count_waits(n: u64) {
        WAITS.with(|w| w.set(w.get() + n));
    }

    /// A tag pool: what every benchmarked structure offers.
    trait Pool: Sync {
        fn take(&self) -> u32;
        fn give(&self, tag: u32);
    }

    impl Pool for Sbitmap {
        #[inline]
        fn take(&self) -> u32 {
            self.get().expect("a free tag")
        }
        #[inline]
        fn give(&self, tag: u32) {
            assert!(self.put(tag));
        }
    }

    /// `SbitmapQueue` without sleeping (`get`), or sleeping (`get_or_wait`).
    struct Sbq {
        q: SbitmapQueue,
        wait: bool,
    }

    impl Pool for Sbq {
        #[inline]
        fn take(&self) -> u32 {
            if self.wait {
                // `get_or_wait` calls us once, then per round in its slow path once after
                // queuing and, if that failed, once after sleeping: rounds that slept are
                // `(calls - 1) / 2`.
                let mut calls = 0u64;
                let t = self.q.get_or_wait_with(|sb| {
                    calls += 1;
                    sb.get()
                });
                count_waits((calls - 1) / 2);
                t
            } else {
                self.q.get().expect("a free tag")
            }
        }
        #[inline]
        fn give(&self, tag: u32) {
            assert!(self.q.put(tag));
        }
    }

    /// The textbook free list (shared baseline).
    impl Pool for MutexPool {
        #[inline]
        fn take(&self) -> u32 {
            MutexPool::take(self)
        }
        #[inline]
        fn give(&self, tag: u32) {
            MutexPool::give(self, tag)
        }
    }

    /// A bounded lock-free MPMC queue of free tags.
    struct QueuePool(ArrayQueue<u32>);

    impl QueuePool {
        fn new(depth: u32) -> Self {
            let q = ArrayQueue::new(depth as usize);
            for t in 0..depth {
                q.push(t).unwrap();
            }
            Self(q)
        }
    }

    impl Pool for QueuePool {
        #[inline]
        fn take(&self) -> u32 {
            self.0.pop().expect("a free tag")
        }
        #[inline]
        fn give(&self, tag: u32) {
            self.0.push(tag).expect("room for the tag");
        }
    }

    /// A sleeping tag pool on `Mutex` + `Condvar` (shared baseline for the sleeping benchmark).
    impl Pool for CondvarPool {
        fn take(&self) -> u32 {
            CondvarPool::take(self, || count_waits(1))
        }
        fn give(&self, tag: u32) {
            CondvarPool::give(self, tag)
        }
    }

    #[inline]
    fn get_put<P: Pool>(p: &P) {
        let t = black_box(p).take();
        black_box(p).give(black_box(t));
    }

    /// Tag counts of a sleeping benchmark: operations and waits, over all its runs.
    #[derive(Default)]
    struct Stats {
        ops: AtomicU64,
        waits: AtomicU64,
        kicks: AtomicU64,
    }

    pub fn bench_uncontended(c: &mut Criterion) {
        let mut g = c.benchmark_group("get_put_1t");
        g.throughput(Throughput::Elements(1));
        let sb = Sbitmap::new(DEPTH, None, false).unwrap();
        g.bench_function("sbitmap", |b| b.iter(|| get_put(&sb)));
        let sbq = Sbq {
            q: SbitmapQueue::new(DEPTH, None, false, WakeAlgo::Counter).unwrap(),
            wait: false,
        };
        g.bench_function("sbitmap_queue", |b| b.iter(|| get_put(&sbq)));
        let m = MutexPool::new(DEPTH);
        g.bench_function("mutex_vec", |b| b.iter(|| get_put(&m)));
        let aq = QueuePool::new(DEPTH);
        g.bench_function("array_queue", |b| b.iter(|| get_put(&aq)));
        g.finish();
    }

    /// Benchmarks get+put on `p` by this thread and a second one. The second thread lives as
    /// long as the benchmark, and each sample (`iter_custom`) has it run as many iterations as
    /// this thread, from a common start; the time returned is the wall time until both are
    /// done divided by 2 (criterion divides by `iters`: time per op of either thread).
    ///
    /// One helper for all samples, not one spawned per sample: `Sbitmap` picks a thread's
    /// allocation hint by a per-thread slot handed out in thread-creation order, modulo the
    /// number of hints (4 on a 2-CPU machine), so a helper spawned per sample would share this
    /// thread's hint, and so its word, in one sample out of four: the samples would mix two
    /// different workloads.
    fn bench_two_threads<P: Pool>(g: &mut BenchmarkGroup<'_, WallTime>, name: &str, p: &P) {
        let start = Barrier::new(2);
        let (work_tx, work_rx) = mpsc::channel::<u64>();
        let (done_tx, done_rx) = mpsc::channel::<()>();
        thread::scope(|s| {
            let start = &start;
            s.spawn(move || {
                while let Ok(iters) = work_rx.recv() {
                    start.wait();
                    for _ in 0..iters {
                        get_put(p);
                    }
                    done_tx.send(()).unwrap();
                }
            });
            g.bench_function(name, |b| {
                b.iter_custom(|iters| {
                    work_tx.send(iters).unwrap();
                    start.wait();
                    let t0 = Instant::now();
                    for _ in 0..iters {
                        get_put(p);
                    }
                    done_rx.recv().unwrap();
                    t0.elapsed() / 2
                })
            });
            drop(work_tx); // the helper's loop ends
        });
    }

    pub fn bench_contended(c: &mut Criterion) {
        let mut g = c.benchmark_group("get_put_2t");
        g.throughput(Throughput::Elements(1));
        let sb = Sbitmap::new(DEPTH, None, false).unwrap();
        bench_two_threads(&mut g, "sbitmap", &sb);
        let sbq = Sbq {
            q: SbitmapQueue::new(DEPTH, None, false, WakeAlgo::Counter).unwrap(),
            wait: false,
        };
        bench_two_threads(&mut g, "sbitmap_queue", &sbq);
        bench_two_threads(&mut g, "mutex_vec", &MutexPool::new(DEPTH));
        bench_two_threads(&mut g, "array_queue", &QueuePool::new(DEPTH));
        g.finish();
    }

    /// One worker's progress, on its own cache line.
    #[repr(align(128))]
    #[derive(Default)]
    struct Progress(AtomicU64);

    /// Runs `iters` get+put on each of `threads` workers from a common start, while this thread
    /// watches for stalls (module docs); returns the wall time divided by `threads`. With
    /// `yield_holding`, each worker yields the CPU while it holds its tag.
    fn sleeping<P: Pool>(
        p: &P,
        threads: usize,
        iters: u64,
        yield_holding: bool,
        kick: impl Fn(),
        stats: &Stats,
    ) -> Duration {
        let start = Barrier::new(threads + 1);
        let progress: Vec<Progress> = (0..threads).map(|_| Progress::default()).collect();
        let done = AtomicUsize::new(0);
        thread::scope(|s| {
            for me in progress.iter() {
                let (start, done) = (&start, &done);
                s.spawn(move || {
                    start.wait();
                    for i in 0..iters {
                        let t = black_box(p).take();
                        if yield_holding {
                            thread::yield_now();
                        }
                        black_box(p).give(black_box(t));
                        me.0.store(i + 1, Ordering::Relaxed);
                    }
                    done.fetch_add(1, Ordering::Release);
                    stats
                        .waits
                        .fetch_add(WAITS.with(|w| w.replace(0)), Ordering::Relaxed);
                });
            }
            start.wait();
            let t0 = Instant::now();
            let total = || -> u64 { progress.iter().map(|p| p.0.load(Ordering::Relaxed)).sum() };
            let (mut seen, mut since) = (total(), Instant::now());
            while done.load(Ordering::Acquire) < threads {
                thread::sleep(Duration::from_micros(200));
                let now = total();
                if now != seen {
                    (seen, since) = (now, Instant::now());
                } else if since.elapsed() >= STALL {
                    stats.kicks.fetch_add(1, Ordering::Relaxed);
                    kick();
                    since = Instant::now();
                }
            }
            let wall = t0.elapsed();
            stats
                .ops
                .fetch_add(iters * threads as u64, Ordering::Relaxed);
            wall / threads as u32
        })
    }

    pub fn bench_sleeping(c: &mut Criterion) {
        const THREADS: usize = 4;
        let mut report = vec![];
        for (group, yield_holding) in [("sbq_sleep_d2_4t", false), ("sbq_sleep_d2_4t_yield", true)]
        {
            let mut g = c.benchmark_group(group);
            g.throughput(Throughput::Elements(1));
            for (name, algo) in [("counter", WakeAlgo::Counter), ("legacy", WakeAlgo::Legacy)] {
                let sbq = Sbq {
                    q: SbitmapQueue::new(2, None, false, algo).unwrap(),
                    wait: true,
                };
                let stats = Stats::default();
                g.bench_function(name, |b| {
                    b.iter_custom(|n| {
                        sleeping(&sbq, THREADS, n, yield_holding, || sbq.q.wake_all(), &stats)
                    })
                });
                assert_eq!(sbq.q.bitmap().weight(), 0);
                report.push((format!("{group}/{name}"), stats));
            }
            let cv = CondvarPool::new(2);
            let stats = Stats::default();
            g.bench_function("mutex_condvar", |b| {
                b.iter_custom(|n| {
                    sleeping(&cv, THREADS, n, yield_holding, || cv.wake_all(), &stats)
                })
            });
            report.push((format!("{group}/mutex_condvar"), stats));
            g.finish();
        }
        for (name, st) in report {
            let (ops, waits) = (st.ops.into_inner(), st.waits.into_inner());
            println!(
                "{name}: {ops} ops, {waits} waits ({:.3} per op), {} watchdog kick(s) \
                 (no progress for {STALL:?})",
                waits as f64 / ops.max(1) as f64,
                st.kicks.into_inner()
            );
        }
    }
}

testkit::bench_main!(
    benches::bench_uncontended,
    benches::bench_contended,
    benches::bench_sleeping
);
