//! Read latency under a write flood, with and without mq-deadline's `async_depth` (for
//! docs/bench.md):
//!
//! ```text
//! cargo run --release -p blk --example async_depth_lat -- [SECONDS] [WRITERS] [SVC_US] [HW_DEPTH]
//! ```
//!
//! A model device executes `HW_DEPTH` requests at a time (default 8), each for `SVC_US`
//! microseconds (default 20), on its own completion thread; the queue has 64 tags and
//! mq-deadline. `WRITERS` threads (default 4) submit asynchronous 4 KiB writes as fast as tags
//! allow (a flood: every tag they can take, they hold), while one thread issues synchronous
//! 4 KiB reads one at a time and records each one's latency, submit to completion. Printed:
//! one markdown row per setting, read p50/p99/max, reads and writes per second.
// A benchmark harness, never a loom model: it may use std::sync (see the tests' header).
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use blk::sched::{Deadline, DeadlineTunables, LockMode};
use blk::{Bio, Driver, EndIo, Error, Op, Queue, QueueConfig, RequestQueue, RequestToken};

const TAGS: u32 = 64;

/// The model device: a FIFO of requests and one thread that runs them `hw` at a time.
struct Dev {
    fifo: Mutex<VecDeque<RequestToken>>,
    cv: Condvar,
    /// Requests the device holds (queued or running).
    busy: AtomicUsize,
    hw: usize,
    svc: Duration,
    stop: AtomicBool,
    core: Mutex<Option<Arc<RequestQueue>>>,
    worker: Mutex<Option<std::thread::JoinHandle<()>>>,
}

struct DevDriver(Arc<Dev>);

impl Dev {
    fn run(&self) {
        let q = self.core.lock().unwrap().clone().expect("started");
        let mut running: Vec<RequestToken> = Vec::with_capacity(self.hw);
        loop {
            {
                let mut f = self.fifo.lock().unwrap();
                while f.is_empty() && running.is_empty() {
                    if self.stop.load(Ordering::Relaxed) {
                        return;
                    }
                    f = self
                        .cv
                        .wait_timeout(f, Duration::from_millis(10))
                        .unwrap()
                        .0;
                }
                while running.len() < self.hw {
                    match f.pop_front() {
                        Some(r) => running.push(r),
                        None => break,
                    }
                }
            }
            // `hw` requests in parallel, each taking `svc`: one service time per round.
            let t = Instant::now();
            while t.elapsed() < self.svc {
                std::hint::spin_loop();
            }
            let n = running.len();
            for r in running.drain(..) {
                q.complete(r, Ok(()));
            }
            self.busy.fetch_sub(n, Ordering::SeqCst);
            // Room again: restart dispatch (Driver::can_queue's contract).
            q.run_queue();
        }
    }
}

impl Driver for DevDriver {
    fn start(&self, q: &Arc<RequestQueue>) {
        *self.0.core.lock().unwrap() = Some(q.clone());
        let d = self.0.clone();
        *self.0.worker.lock().unwrap() = Some(std::thread::spawn(move || d.run()));
    }
    fn queue_rq(&self, _q: &RequestQueue, rq: RequestToken) {
        self.0.busy.fetch_add(1, Ordering::SeqCst);
        self.0.fifo.lock().unwrap().push_back(rq);
        self.0.cv.notify_one();
    }
    fn stop(&self) {
        self.0.stop.store(true, Ordering::Relaxed);
        self.0.cv.notify_all();
        if let Some(h) = self.0.worker.lock().unwrap().take() {
            h.join().unwrap();
        }
        self.0.core.lock().unwrap().take();
    }
    fn describe(&self) -> String {
        "model device".into()
    }
    fn can_queue(&self) -> usize {
        // Twice the device's parallelism queued in it at most: the rest waits in the
        // scheduler, where mq-deadline orders it.
        (2 * self.0.hw).saturating_sub(self.0.busy.load(Ordering::SeqCst))
    }
}

struct Count(AtomicU64);

impl EndIo for Count {
    fn end_io(&self, _bio: Bio, _res: Result<(), Error>) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }
}

/// One read's completion flag.
struct Done(Mutex<bool>, Condvar);

impl EndIo for Done {
    fn end_io(&self, _bio: Bio, _res: Result<(), Error>) {
        *self.0.lock().unwrap() = true;
        self.1.notify_one();
    }
}

fn pct(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn run(async_depth: u32, secs: u64, writers: usize, svc: Duration, hw: usize) {
    let dev = Arc::new(Dev {
        fifo: Mutex::new(VecDeque::new()),
        cv: Condvar::new(),
        busy: AtomicUsize::new(0),
        hw,
        svc,
        stop: AtomicBool::new(false),
        core: Mutex::new(None),
        worker: Mutex::new(None),
    });
    let tun = Arc::new(DeadlineTunables::default());
    tun.set_async_depth(async_depth);
    let sched = Deadline::new(LockMode::Serialized).with_tunables(tun.clone());
    let mut cfg = QueueConfig::new(1 << 30);
    cfg.queue_depth = TAGS;
    let q = Arc::new(
        Queue::with_scheduler(cfg, Box::new(DevDriver(dev.clone())), Some(Box::new(sched)))
            .expect("queue"),
    );
    let stop = Arc::new(AtomicBool::new(false));
    let wrote = Arc::new(Count(AtomicU64::new(0)));
    let mut submitted = 0u64;
    let ws: Vec<_> = (0..writers)
        .map(|w| {
            let (q, stop, wrote) = (q.clone(), stop.clone(), wrote.clone());
            std::thread::spawn(move || {
                let end: Arc<dyn EndIo> = wrote;
                let mut n = 0u64;
                let mut s = (w as u64) << 20;
                while !stop.load(Ordering::Relaxed) {
                    s = (s + 8) % (1 << 21);
                    q.submit(Bio::new(Op::Write, s, 4096), &end);
                    n += 1;
                }
                n
            })
        })
        .collect();
    let done = Arc::new(Done(Mutex::new(false), Condvar::new()));
    let end: Arc<dyn EndIo> = done.clone();
    let mut lat = Vec::with_capacity(1 << 20);
    let t0 = Instant::now();
    let mut sector = 0u64;
    while t0.elapsed() < Duration::from_secs(secs) {
        *done.0.lock().unwrap() = false;
        sector = (sector + 4104) % (1 << 21);
        let t = Instant::now();
        q.submit(Bio::new(Op::Read, sector, 4096), &end);
        let mut g = done.0.lock().unwrap();
        while !*g {
            g = done.1.wait(g).unwrap();
        }
        lat.push(t.elapsed().as_nanos() as u64);
    }
    let elapsed = t0.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    for w in ws {
        submitted += w.join().unwrap();
    }
    while wrote.0.load(Ordering::Relaxed) < submitted {
        std::thread::sleep(Duration::from_millis(1));
    }
    lat.sort_unstable();
    let us = |ns: u64| ns as f64 / 1000.0;
    let label = if async_depth >= TAGS {
        format!("off ({TAGS})")
    } else {
        format!("{}", tun.async_depth_for(TAGS))
    };
    println!(
        "| {label} | {:.1} | {:.1} | {:.1} | {:.0} | {:.0} |",
        us(pct(&lat, 0.50)),
        us(pct(&lat, 0.99)),
        us(lat.last().copied().unwrap_or(0)),
        lat.len() as f64 / elapsed,
        submitted as f64 / elapsed,
    );
}

fn main() {
    let args: Vec<u64> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("numeric arguments"))
        .collect();
    let secs = args.first().copied().unwrap_or(3);
    let writers = args.get(1).copied().unwrap_or(4) as usize;
    let svc = Duration::from_micros(args.get(2).copied().unwrap_or(20));
    let hw = args.get(3).copied().unwrap_or(8).max(1) as usize;
    println!(
        "read latency (us) under a write flood: {writers} writers, {TAGS} tags, mq-deadline, \
         device {hw} at a time x {svc:?}, {secs} s per row"
    );
    println!();
    println!("| async_depth | read p50 | read p99 | read max | reads/s | writes/s |");
    println!("|---|---|---|---|---|---|");
    run(TAGS, secs, writers, svc, hw);
    run(0, secs, writers, svc, hw);
}
