//! The `Mutex` + `Condvar` baselines the criterion benches (waitq's, sbitmap's) measure
//! against, the criterion configuration they share, and their N-threads timing loop.

use std::sync::{Condvar, Mutex};
use std::time::Duration;

use criterion::Criterion;

/// The criterion configuration of the workspace's benches: short, for a shared machine.
pub fn criterion_config() -> Criterion {
    Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(2))
        .sample_size(20)
}

/// A bench binary's `main` (through [`bench_main!`](crate::bench_main)): runs each of
/// `targets` with [`criterion_config`] and the command line's options, then prints criterion's
/// final summary.
pub fn run_benches(targets: &[fn(&mut Criterion)]) {
    let mut c = criterion_config().configure_from_args();
    for target in targets {
        target(&mut c);
    }
    Criterion::default().configure_from_args().final_summary();
}

/// Runs `body(t)` on `threads` threads at once (`t` in `0..threads`) and returns the wall time
/// until the last one is done: the body of a criterion `iter_custom` for "N threads doing
/// `iters` each", whose time per iteration is then the wall time of all of them.
pub fn threads_wall<F>(threads: usize, body: F) -> Duration
where
    F: Fn(u64) + Send + Sync + 'static,
{
    let body = std::sync::Arc::new(body);
    let start = std::time::Instant::now();
    let hs: Vec<_> = (0..threads as u64)
        .map(|t| {
            let body = body.clone();
            std::thread::spawn(move || body(t))
        })
        .collect();
    for h in hs {
        h.join().expect("a benchmark thread panicked");
    }
    start.elapsed()
}

/// A completion on `Mutex<bool>` + `Condvar`, the textbook way. `wait` consumes the flag;
/// every bench waits once per `complete`, so a flag is enough.
#[derive(Debug, Default)]
pub struct CondvarCompletion {
    done: Mutex<bool>,
    cv: Condvar,
}

impl CondvarCompletion {
    /// Sets the flag and wakes one waiter.
    pub fn complete(&self) {
        *self.done.lock().unwrap_or_else(|e| e.into_inner()) = true;
        self.cv.notify_one();
    }

    /// Waits for the flag and consumes it.
    pub fn wait(&self) {
        let mut done = self.done.lock().unwrap_or_else(|e| e.into_inner());
        while !*done {
            done = self.cv.wait(done).unwrap_or_else(|e| e.into_inner());
        }
        *done = false;
    }
}

/// The textbook free list of tags behind a `Mutex` (never sleeps: taking from an empty pool
/// panics).
#[derive(Debug)]
pub struct MutexPool(Mutex<Vec<u32>>);

impl MutexPool {
    /// A pool of the tags `0..depth`.
    pub fn new(depth: u32) -> Self {
        Self(Mutex::new((0..depth).collect()))
    }

    /// Takes a tag; panics if none is free.
    #[inline]
    pub fn take(&self) -> u32 {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pop()
            .expect("a free tag")
    }

    /// Returns a tag.
    #[inline]
    pub fn give(&self, tag: u32) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).push(tag);
    }
}

/// A sleeping tag pool on `Mutex` + `Condvar`.
#[derive(Debug)]
pub struct CondvarPool {
    free: Mutex<Vec<u32>>,
    cv: Condvar,
}

impl CondvarPool {
    /// A pool of the tags `0..depth`.
    pub fn new(depth: u32) -> Self {
        Self {
            free: Mutex::new((0..depth).collect()),
            cv: Condvar::new(),
        }
    }

    /// Takes a tag, sleeping until one is free; calls `on_wait` before each sleep.
    pub fn take(&self, mut on_wait: impl FnMut()) -> u32 {
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(t) = free.pop() {
                return t;
            }
            on_wait();
            free = self.cv.wait(free).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Returns a tag and wakes one sleeper.
    pub fn give(&self, tag: u32) {
        self.free
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(tag);
        self.cv.notify_one();
    }

    /// Wakes every sleeper (they re-check and sleep again if need be).
    pub fn wake_all(&self) {
        self.cv.notify_all();
    }
}
