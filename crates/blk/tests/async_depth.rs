//! mq-deadline's `async_depth`: under a flood of asynchronous writes that a driver holds (so
//! their tags stay taken), synchronous reads still get tags and complete when the cap is below
//! the depth, and cannot get one without it. No timing: every wait is a hang guard.
// A plain threaded test or benchmark, never a loom model: its own harness (std locks, atomics,
// condition variables, baselines) is not what a model must explore, so it may use std::sync.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]
#![cfg(not(blkq_loom))]

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use blk::sched::{Deadline, DeadlineTunables, LockMode};
use blk::{
    Bio, BioFlags, Driver, EndIo, Op, PoolPolicy, Queue, QueueConfig, RequestQueue, RequestToken,
};
use testkit::{wait_until, Collect};

const DEPTH: u32 = 16;
const WRITES: usize = 40;
const READS: usize = 50;

/// Completes reads (and anything synchronous) inline; holds asynchronous writes, so their tags
/// stay taken, until the test lets them go.
#[derive(Default)]
struct Flood {
    held: Mutex<Vec<RequestToken>>,
    release: AtomicBool,
}

struct FloodDriver(Arc<Flood>);

impl Driver for FloodDriver {
    fn queue_rq(&self, q: &RequestQueue, rq: RequestToken) {
        let hold = q.rq(&rq).bio().is_some_and(|b| !b.op.is_sync(b.flags));
        if hold {
            let mut held = self.0.held.lock().unwrap();
            if !self.0.release.load(Ordering::SeqCst) {
                held.push(rq);
                return;
            }
        }
        q.complete(rq, Ok(()));
    }
    fn describe(&self) -> String {
        "flood".into()
    }
}

impl Flood {
    fn held(&self) -> usize {
        self.held.lock().unwrap().len()
    }

    /// Completes every held write and every later one.
    fn let_go(&self, q: &RequestQueue) {
        let held = {
            let mut h = self.held.lock().unwrap();
            self.release.store(true, Ordering::SeqCst);
            std::mem::take(&mut *h)
        };
        for r in held {
            q.complete(r, Ok(()));
        }
    }
}

struct Rig {
    q: Arc<Queue>,
    flood: Arc<Flood>,
    tun: Arc<DeadlineTunables>,
    reads: Arc<Collect>,
    writes: Arc<Collect>,
    /// Writes whose `submit` returned (the writer thread's progress).
    submitted: Arc<AtomicUsize>,
}

impl Rig {
    fn new(mode: LockMode, policy: PoolPolicy, async_depth: u32) -> Rig {
        let flood = Arc::new(Flood::default());
        let tun = Arc::new(DeadlineTunables::default());
        tun.set_async_depth(async_depth);
        let sched = Deadline::new(mode).with_tunables(tun.clone());
        let mut cfg = QueueConfig::new(1 << 30);
        cfg.queue_depth = DEPTH;
        cfg.policy = policy;
        let q = Queue::with_scheduler(
            cfg,
            Box::new(FloodDriver(flood.clone())),
            Some(Box::new(sched)),
        )
        .unwrap();
        Rig {
            q: Arc::new(q),
            flood,
            tun,
            reads: Arc::new(Collect::default()),
            writes: Arc::new(Collect::default()),
            submitted: Arc::new(AtomicUsize::new(0)),
        }
    }

    /// A thread that submits `WRITES` asynchronous 4 KiB writes, one at a time.
    fn writer(&self) -> std::thread::JoinHandle<()> {
        let (q, end, n) = (self.q.clone(), self.writes.clone(), self.submitted.clone());
        std::thread::spawn(move || {
            let end: Arc<dyn EndIo> = end;
            for i in 0..WRITES {
                q.submit(Bio::new(Op::Write, i as u64 * 8, 4096), &end);
                n.fetch_add(1, Ordering::SeqCst);
            }
        })
    }

    fn read(&self, i: usize) {
        let end: Arc<dyn EndIo> = self.reads.clone();
        self.q
            .submit(Bio::new(Op::Read, 1_000_000 + i as u64 * 8, 4096), &end);
    }

    fn finish(&self, writer: std::thread::JoinHandle<()>) {
        self.flood.let_go(self.q.core());
        writer.join().unwrap();
        wait_until("every write completes", || self.writes.len() == WRITES);
        assert!(self.writes.lock().iter().all(|(_, r)| r.is_ok()));
        assert_eq!(self.q.pools()[0].shallow_in_use(), 0);
        assert_eq!(self.q.pools()[0].sbq().bitmap().weight(), 0);
    }
}

const POLICIES: [PoolPolicy; 3] = [PoolPolicy::Steal, PoolPolicy::Fifo, PoolPolicy::Batch];
const MODES: [LockMode; 2] = [LockMode::Locked, LockMode::Serialized];

#[test]
fn sync_reads_get_tags_under_a_write_flood_with_async_depth() {
    for mode in MODES {
        for policy in POLICIES {
            // async_depth 0: the default cap, 3/4 of the depth.
            let r = Rig::new(mode, policy, 0);
            let cap = (DEPTH * 3 / 4) as usize;
            assert_eq!(r.tun.async_depth_for(DEPTH), cap as u32);
            let writer = r.writer();
            // The writes fill the cap, then the writer sleeps for a shallow tag.
            wait_until("the writes fill the cap", || r.flood.held() == cap);
            let pool = &r.q.pools()[0];
            assert_eq!(pool.shallow_in_use(), cap as u32);
            // Reads get the tags the cap keeps back, over and over, and complete, while the
            // writes stay held and the writer stays blocked.
            for i in 0..READS {
                r.read(i);
            }
            // (A read that found the writer still owning the scheduler's state is dispatched
            // by it, just after our submit returned: wait for it, never for a write.)
            wait_until("the reads complete", || r.reads.len() == READS);
            assert!(r.reads.lock().iter().all(|(_, res)| res.is_ok()));
            // A FUA write is synchronous: not capped either.
            let end: Arc<dyn EndIo> = r.reads.clone();
            let mut fua = Bio::new(Op::Write, 2_000_000, 4096);
            fua.flags = BioFlags::FUA;
            r.q.submit(fua, &end);
            wait_until("the FUA write completes", || r.reads.len() == READS + 1);
            assert_eq!(r.flood.held(), cap, "{mode:?} {policy:?}");
            assert_eq!(r.submitted.load(Ordering::SeqCst), cap);
            assert!(r.writes.is_empty());
            r.finish(writer);
        }
    }
}

#[test]
fn without_the_cap_a_write_flood_takes_every_tag() {
    for mode in MODES {
        // async_depth = the depth: no limit.
        let r = Rig::new(mode, PoolPolicy::Steal, DEPTH);
        let writer = r.writer();
        wait_until("the writes take every tag", || {
            r.flood.held() == DEPTH as usize
        });
        let pool = &r.q.pools()[0];
        assert_eq!(pool.shallow_in_use(), 0);
        // No tag is left for a read: it would wait for a write's completion.
        assert_eq!(pool.try_get(), None);
        let reader = {
            let (q, end) = (r.q.clone(), r.reads.clone());
            std::thread::spawn(move || {
                let end: Arc<dyn EndIo> = end;
                q.submit(Bio::new(Op::Read, 1_000_000, 4096), &end);
            })
        };
        // Nothing can complete the read while every tag is held (no timing: it cannot).
        assert!(r.reads.is_empty());
        r.finish(writer);
        reader.join().unwrap();
        wait_until("the read completes", || r.reads.len() == 1);
    }
}

#[test]
fn async_depth_values() {
    let t = DeadlineTunables::default();
    assert_eq!(t.async_depth(), 0);
    assert_eq!(t.async_depth_for(64), 48);
    assert_eq!(t.async_depth_for(1), 1);
    assert_eq!(t.async_depth_for(2), 1);
    t.set("async_depth", "5").unwrap();
    assert_eq!(t.async_depth_for(64), 5);
    assert_eq!(t.async_depth_for(4), 4);
    assert!(Op::Read.is_sync(BioFlags::NONE));
    assert!(Op::Flush.is_sync(BioFlags::NONE));
    assert!(!Op::Write.is_sync(BioFlags::NONE));
    assert!(Op::Write.is_sync(BioFlags::FUA));
    assert!(Op::Write.is_sync(BioFlags::SYNC));
    assert!(!Op::Discard.is_sync(BioFlags::NONE));
}
