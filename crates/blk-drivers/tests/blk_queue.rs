//! blk's request queue, driven through the drivers (built from device specs): validation
//! errors, data round trips, completion modes, and the promise of each pool-full policy.
// A plain threaded test or benchmark, never a loom model: its own harness (std locks, atomics,
// condition variables, baselines) is not what a model must explore, so it may use std::sync.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]
#![cfg(not(blkq_loom))]

use std::sync::mpsc;
use std::sync::Mutex;
use std::time::Duration;

use blk::{Bio, BioFlags, Buffer, EndIo, Error, Op, PoolPolicy, Queue, TagPool};
use blk_drivers::spec::{DeviceSpec, QueueOverrides};
use sbitmap::WakeAlgo;
use std::sync::Arc;
use testkit::{wait_until, Collect};

fn queue(spec: &str) -> Queue {
    spec.parse::<DeviceSpec>()
        .unwrap()
        .build(&QueueOverrides::default())
        .unwrap()
}

fn submit_one(q: &Queue, bio: Bio) -> (Bio, Result<(), Error>) {
    let c = Arc::new(Collect::default());
    let end: Arc<dyn EndIo> = c.clone();
    q.submit(bio, &end);
    c.wait_for(1).pop().unwrap()
}

#[test]
fn bad_bios_complete_with_errors_and_never_panic() {
    let q = queue("mem:4M");
    let cases: Vec<(Bio, i32)> = vec![
        (
            Bio::with_buf(Op::Read, 8192, Buffer::new(512)),
            libc::EINVAL,
        ), // past the end
        (
            Bio::with_buf(Op::Write, 8191, Buffer::new(1024)),
            libc::EINVAL,
        ), // straddles it
        (Bio::new(Op::Read, 0, 100), libc::EINVAL), // misaligned length
        (Bio::new(Op::Discard, 0, 0), libc::EINVAL), // empty
        (Bio::new(Op::Read, u64::MAX, 512), libc::EINVAL), // sector overflow
        (Bio::new(Op::Read, 0, 2 << 20), libc::EOVERFLOW), // over max_io
        (Bio::new(Op::Read, 0, 512), libc::EINVAL), // no buffer
    ];
    for (bio, errno) in cases {
        let desc = format!("{bio:?}");
        let (_, res) = submit_one(&q, bio);
        let e = res.expect_err(&desc);
        assert_eq!(e.errno(), errno, "{desc}: {e}");
    }
    let mut short = Bio::with_buf(Op::Read, 0, Buffer::new(512));
    short.len = 1024;
    let (_, res) = submit_one(&q, short);
    assert!(matches!(res, Err(Error::BufferTooSmall { .. })));
    // The queue still works afterwards.
    let (_, res) = submit_one(&q, Bio::new(Op::Flush, 0, 0));
    res.unwrap();
    assert_eq!(q.stats().in_flight, [0, 0]);
}

#[test]
fn mem_device_round_trip_and_zeroes() {
    let q = queue("mem:4M");
    let mut w = Buffer::new(8192);
    for (i, b) in w.as_mut_slice().iter_mut().enumerate() {
        *b = (i % 251) as u8;
    }
    submit_one(&q, Bio::with_buf(Op::Write, 7, w)).1.unwrap();
    let (r, res) = submit_one(&q, Bio::with_buf(Op::Read, 7, Buffer::new(8192)));
    res.unwrap();
    let r = r.buf.unwrap();
    assert!(r
        .as_slice()
        .iter()
        .enumerate()
        .all(|(i, &b)| b == (i % 251) as u8));
    submit_one(&q, Bio::new(Op::WriteZeroes, 8, 1024))
        .1
        .unwrap();
    let (r, _) = submit_one(&q, Bio::with_buf(Op::Read, 8, Buffer::new(1024)));
    assert!(r.buf.unwrap().as_slice().iter().all(|&b| b == 0));
    let mut fz = Bio::new(Op::WriteZeroes, 0, 512);
    fz.flags = BioFlags::FAST_ZERO | BioFlags::NO_HOLE;
    submit_one(&q, fz).1.unwrap();
    let s = q.stats();
    assert_eq!(s.ios, [2, 3]);
    assert_eq!(s.sectors[1], 16);
}

fn pump(spec: &str, n: usize) {
    let q = queue(spec);
    let c = Arc::new(Collect::default());
    let end: Arc<dyn EndIo> = c.clone();
    let mut plug = blk::Plug::new(16);
    for i in 0..n {
        q.submit_plugged(
            &mut plug,
            Bio::new(Op::Read, (i as u64 * 8) % 2048, 4096),
            &end,
        );
    }
    q.flush_plug(&mut plug);
    let done = c.wait_for(n);
    assert_eq!(done.len(), n);
    assert!(done.iter().all(|(_, r)| r.is_ok()));
    assert_eq!(q.stats().ios[0], n as u64);
}

#[test]
fn null_completion_modes() {
    pump("null:1M", 1000);
    pump("null:1M,completion=thread,hw_queue_depth=8", 1000);
    pump(
        "null:1M,completion=timer,completion_nsec=20000,hw_queue_depth=16",
        200,
    );
    pump(
        "null:1M,submit_queues=3,shared_tags=1,hw_queue_depth=4",
        100,
    );
}

/// FIFO: a newcomer may not overtake a waiter, and freed tags go oldest-first.
#[test]
fn fifo_hands_off_in_order_and_newcomers_queue() {
    let pool = Arc::new(TagPool::new(1, WakeAlgo::Counter, PoolPolicy::Fifo).unwrap());
    let t = pool.get(0);
    let (tx, rx) = mpsc::channel();
    let spawn = |name: &'static str| {
        let (pool, tx) = (pool.clone(), tx.clone());
        std::thread::spawn(move || {
            let t = pool.get(0);
            tx.send(name).unwrap();
            std::thread::sleep(Duration::from_millis(20));
            pool.put(t);
        })
    };
    let a = spawn("a");
    wait_until("a queued", || pool.gate_waiters() == 1);
    let b = spawn("b");
    wait_until("b queued", || pool.gate_waiters() == 2);
    pool.put(t);
    // A newcomer now must not take the tag while a and b wait.
    let newcomer = spawn("newcomer");
    let order: Vec<_> = (0..3).map(|_| rx.recv().unwrap()).collect();
    assert_eq!(&order[..2], &["a", "b"]);
    for h in [a, b, newcomer] {
        h.join().unwrap();
    }
    assert_eq!(pool.wait_stats().count, 3);
}

/// Batch: a waiter handed a tag becomes the batch owner and takes more tags past the soft
/// limit without queueing, while an older... later waiter keeps waiting.
#[test]
fn batch_owner_gets_its_batch() {
    let pool = Arc::new(TagPool::new(4, WakeAlgo::Counter, PoolPolicy::Batch).unwrap());
    pool.set_batch(3, Duration::from_secs(60));
    pool.set_max_in_flight(Some(2));
    let held = [pool.get(1), pool.get(1)];
    assert_eq!(pool.try_get(), None, "soft limit reached");
    let (tx, rx) = mpsc::channel();
    let p = pool.clone();
    let owner = std::thread::spawn(move || {
        let first = p.get(0);
        // Now the batch owner: two more, past the soft limit, without queueing.
        let more = [p.get(0), p.get(0)];
        tx.send(()).unwrap();
        [first, more[0], more[1]]
    });
    wait_until("owner queued", || pool.gate_waiters() == 1);
    let p = pool.clone();
    let late = std::thread::spawn(move || p.get(0));
    wait_until("late queued", || pool.gate_waiters() == 2);
    pool.put(held[0]);
    rx.recv_timeout(Duration::from_secs(10))
        .expect("batch owner got its batch");
    let got = owner.join().unwrap();
    assert_eq!(pool.gate_waiters(), 1, "the late waiter still waits");
    for t in got {
        pool.put(t);
    }
    let t = late.join().unwrap();
    pool.put(t);
    pool.put(held[1]);
}

/// Without batching (FIFO) the same thread queues behind the later waiter.
#[test]
fn fifo_has_no_batch_owner() {
    let pool = Arc::new(TagPool::new(4, WakeAlgo::Counter, PoolPolicy::Fifo).unwrap());
    pool.set_max_in_flight(Some(2));
    let held = [pool.get(1), pool.get(1)];
    let p = pool.clone();
    let first = std::thread::spawn(move || p.get(0));
    wait_until("first queued", || pool.gate_waiters() == 1);
    pool.put(held[0]);
    let t = first.join().unwrap();
    // Soft limit reached again: a second get from anyone must queue.
    let p = pool.clone();
    let second = std::thread::spawn(move || p.get(0));
    wait_until("second queued", || pool.gate_waiters() == 1);
    pool.put(t);
    let t2 = second.join().unwrap();
    pool.put(t2);
    pool.put(held[1]);
}

#[test]
fn steal_policy_with_sleepers_completes() {
    for wake in [WakeAlgo::Counter] {
        let q = Arc::new(
            "null:1M,hw_queue_depth=2,completion=thread"
                .parse::<DeviceSpec>()
                .unwrap()
                .build(&QueueOverrides {
                    wake: Some(wake),
                    ..Default::default()
                })
                .unwrap(),
        );
        let hs: Vec<_> = (0..4)
            .map(|_| {
                let q = q.clone();
                std::thread::spawn(move || pump_on(&q, 500))
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
        assert_eq!(q.stats().ios[0], 2000);
        assert!(
            q.wait_stats(0).unwrap().count > 0,
            "submitters should have slept"
        );
    }
}

fn pump_on(q: &Queue, n: usize) {
    let c = Arc::new(Collect::default());
    let end: Arc<dyn EndIo> = c.clone();
    for i in 0..n {
        q.submit(Bio::new(Op::Read, (i as u64 * 8) % 2048, 4096), &end);
    }
    c.wait_for(n);
}

#[test]
fn policies_switch_at_run_time() {
    let q = queue("null:1M,completion=thread,hw_queue_depth=4");
    for p in [PoolPolicy::Fifo, PoolPolicy::Batch, PoolPolicy::Steal] {
        q.set_policy(p);
        pump_on(&q, 200);
    }
    q.set_wake(WakeAlgo::Legacy);
    pump_on(&q, 50);
}

/// What the hold driver holds.
#[derive(Default)]
struct Held {
    held: Mutex<Vec<blk::RequestToken>>,
    order: Mutex<Vec<u64>>,
}

/// A driver that holds requests until the test completes them.
#[derive(Default, Clone)]
struct HoldDriver(Arc<Held>);

impl std::ops::Deref for HoldDriver {
    type Target = Held;
    fn deref(&self) -> &Held {
        &self.0
    }
}

impl blk::Driver for HoldDriver {
    fn queue_rq(&self, q: &blk::RequestQueue, rq: blk::RequestToken) {
        let sector = q.rq(&rq).bio().map_or(0, |b| b.sector);
        self.order.lock().unwrap().push(sector);
        self.held.lock().unwrap().push(rq);
    }
    fn describe(&self) -> String {
        "hold".into()
    }
}

impl HoldDriver {
    fn complete_all(&self, q: &Queue) {
        let held = std::mem::take(&mut *self.held.lock().unwrap());
        for r in held {
            q.core().complete(r, Ok(()));
        }
    }
}

#[test]
fn reserved_tags_do_not_wait_behind_ordinary_io() {
    let hold = HoldDriver::default();
    let mut cfg = blk::QueueConfig::new(1 << 20);
    cfg.queue_depth = 1;
    cfg.reserved_tags = 1;
    let q = Arc::new(Queue::new(cfg, Box::new(hold.clone())).unwrap());
    let c = Arc::new(Collect::default());
    let end: Arc<dyn EndIo> = c.clone();
    q.submit(Bio::new(Op::Read, 0, 512), &end); // holds the only ordinary tag
    let (tx, rx) = mpsc::channel();
    let (q2, end2) = (q.clone(), end.clone());
    let h = std::thread::spawn(move || {
        let mut flush = Bio::new(Op::Flush, 0, 0);
        flush.flags = BioFlags::RESERVED;
        q2.submit(flush, &end2);
        tx.send(()).unwrap();
    });
    rx.recv_timeout(Duration::from_secs(10))
        .expect("a reserved bio must not wait for ordinary tags");
    h.join().unwrap();
    assert_eq!(hold.held.lock().unwrap().len(), 2);
    hold.complete_all(&q);
    assert_eq!(c.wait_for(2).len(), 2);
}

/// A scheduler that dispatches in reverse order: proves requests go through it.
#[derive(Default)]
struct Lifo(Mutex<Vec<blk::RequestToken>>);

impl blk::Scheduler for Lifo {
    fn name(&self) -> &'static str {
        "lifo"
    }
    fn insert(&self, _q: &blk::RequestQueue, rq: blk::RequestToken) {
        self.0.lock().unwrap().push(rq);
    }
    fn dispatch(
        &self,
        _q: &blk::RequestQueue,
        max: usize,
        sink: &mut dyn FnMut(blk::RequestToken),
    ) -> usize {
        let mut n = 0;
        while n < max {
            let Some(r) = self.0.lock().unwrap().pop() else {
                break;
            };
            sink(r);
            n += 1;
        }
        n
    }
}

#[test]
fn a_scheduler_sees_every_plugged_request_and_orders_dispatch() {
    let hold = HoldDriver::default();
    let q = Queue::with_scheduler(
        blk::QueueConfig::new(1 << 20),
        Box::new(hold.clone()),
        Some(Box::new(Lifo::default())),
    )
    .unwrap();
    let c = Arc::new(Collect::default());
    let end: Arc<dyn EndIo> = c.clone();
    let mut plug = blk::Plug::new(8);
    for s in 0..5u64 {
        q.submit_plugged(&mut plug, Bio::new(Op::Read, s * 8, 4096), &end);
    }
    q.flush_plug(&mut plug);
    assert_eq!(*hold.order.lock().unwrap(), vec![32, 24, 16, 8, 0]);
    hold.complete_all(&q);
    assert_eq!(c.wait_for(5).len(), 5);
}

/// Without a scheduler, contiguous bios plugged together merge into one request (drivers that
/// take chains), and every bio still completes with its own data.
#[test]
fn plugged_contiguous_bios_merge() {
    let q = queue("mem:1M");
    let c = Arc::new(Collect::default());
    let end: Arc<dyn EndIo> = c.clone();
    let mut plug = blk::Plug::new(16);
    for i in 0..4u64 {
        let mut b = Buffer::new(4096);
        b.as_mut_slice().fill(i as u8 + 1);
        q.submit_plugged(&mut plug, Bio::with_buf(Op::Write, 16 + i * 8, b), &end);
    }
    // Not contiguous: a request of its own.
    q.submit_plugged(
        &mut plug,
        Bio::with_buf(Op::Write, 200, Buffer::new(512)),
        &end,
    );
    assert_eq!(plug.len(), 2, "four contiguous writes make one request");
    q.flush_plug(&mut plug);
    let done = c.wait_for(5);
    assert!(done.iter().all(|(_, r)| r.is_ok()));
    assert_eq!(q.stats().merges[1], 3);
    let (r, res) = submit_one(&q, Bio::with_buf(Op::Read, 16, Buffer::new(4 * 4096)));
    res.unwrap();
    let r = r.buf.unwrap();
    for i in 0..4 {
        assert!(r.as_slice()[i * 4096..(i + 1) * 4096]
            .iter()
            .all(|&x| x == i as u8 + 1));
    }
}
