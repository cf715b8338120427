//! Clock reads per I/O: one coarse clock read per plug batch on the
//! submission side and one per completion batch, not two per I/O. Counted with the debug
//! builds' per-thread counter ([`blk::stats::clock_reads`]), so these tests run in debug only.
//! Also: the per-thread plug of `Device::submit_batch` is left clean by a batch that panics.
// A plain threaded test, never a loom model: it may use std::sync.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]
#![cfg(all(debug_assertions, not(blkq_loom)))]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use blk::stats::{clock_reads, ClockBatch};
use blk::{
    Bio, Device, Driver, EndIo, Error, Op, Plug, Queue, QueueConfig, RequestQueue, RequestToken,
};

/// Completes every request inline, in `queue_rq` (as `null` and `mem` do).
struct Inline;

impl Driver for Inline {
    fn queue_rq(&self, q: &RequestQueue, rq: RequestToken) {
        q.complete(rq, Ok(()));
    }
    fn describe(&self) -> String {
        "inline".into()
    }
}

/// Keeps its requests for the test to complete (a completion thread's batch).
struct Hold(Arc<Mutex<Vec<RequestToken>>>);

impl Driver for Hold {
    fn queue_rq(&self, _q: &RequestQueue, rq: RequestToken) {
        self.0.lock().unwrap().push(rq);
    }
    fn describe(&self) -> String {
        "hold".into()
    }
}

#[derive(Default)]
struct Count(AtomicUsize);

impl EndIo for Count {
    fn end_io(&self, _bio: Bio, res: Result<(), Error>) {
        res.unwrap();
        self.0.fetch_add(1, Ordering::Relaxed);
    }
}

fn read(i: u64) -> Bio {
    Bio::new(Op::Read, i * 8, 4096)
}

#[test]
fn a_plugged_batch_of_inline_completions_reads_the_clock_twice() {
    let mut cfg = QueueConfig::new(1 << 30);
    cfg.plug_limit = 32;
    let q = Queue::new(cfg, Box::new(Inline)).unwrap();
    let count = Arc::new(Count::default());
    let end: Arc<dyn EndIo> = count.clone();
    // Non-contiguous bios (no merges), several batches of 32.
    let batches = 10u64;
    let before = clock_reads();
    for b in 0..batches {
        q.submit_batch(&mut (0..32).map(|i| read((b * 32 + i) * 2)), &end);
    }
    let reads = clock_reads() - before;
    assert_eq!(count.0.load(Ordering::Relaxed), 320);
    // One read when the plug's first request takes its tag, one at the batch's first
    // completion: 2 per batch of 32 (it was 2 per I/O, 640).
    assert_eq!(
        reads,
        2 * batches,
        "clock reads for {batches} batches of 32"
    );
    let s = q.stats();
    assert_eq!(s.ios[0], 320);
}

#[test]
fn a_plug_that_fills_starts_a_new_batch() {
    let mut cfg = QueueConfig::new(1 << 30);
    cfg.plug_limit = 8;
    let q = Queue::new(cfg, Box::new(Inline)).unwrap();
    let end: Arc<dyn EndIo> = Arc::new(Count::default());
    let mut plug = Plug::new(8);
    let before = clock_reads();
    for i in 0..32 {
        q.submit_plugged(&mut plug, read(i * 2), &end);
    }
    q.flush_plug(&mut plug);
    // 4 plug batches of 8: 2 reads each.
    assert_eq!(clock_reads() - before, 8);
}

#[test]
fn a_completion_thread_batch_reads_the_clock_once() {
    let held = Arc::new(Mutex::new(Vec::new()));
    let q = Queue::new(QueueConfig::new(1 << 30), Box::new(Hold(held.clone()))).unwrap();
    let count = Arc::new(Count::default());
    let end: Arc<dyn EndIo> = count.clone();
    q.submit_batch(&mut (0..16).map(|i| read(i * 2)), &end);
    let rqs: Vec<_> = std::mem::take(&mut *held.lock().unwrap());
    assert_eq!(rqs.len(), 16);
    let before = clock_reads();
    {
        let _batch = ClockBatch::enter();
        for r in rqs {
            q.core().complete(r, Ok(()));
        }
    }
    assert_eq!(clock_reads() - before, 1);
    assert_eq!(count.0.load(Ordering::Relaxed), 16);
    // Outside a batch, each completion reads the clock.
    q.submit_batch(&mut (0..4).map(|i| read(i * 2)), &end);
    let rqs: Vec<_> = std::mem::take(&mut *held.lock().unwrap());
    let before = clock_reads();
    for r in rqs {
        q.core().complete(r, Ok(()));
    }
    assert_eq!(clock_reads() - before, 4);
}

#[test]
fn unplugged_submissions_read_once_per_io_and_per_completion() {
    let q = Queue::new(QueueConfig::new(1 << 30), Box::new(Inline)).unwrap();
    let end: Arc<dyn EndIo> = Arc::new(Count::default());
    let before = clock_reads();
    for i in 0..10 {
        q.submit(read(i), &end);
    }
    // A batch of one: a read at the tag, one at the completion.
    assert_eq!(clock_reads() - before, 20);
}

#[test]
fn mq_deadline_shares_the_batch_read_with_insert_and_dispatch() {
    use blk::sched::{Deadline, LockMode};
    let mut cfg = QueueConfig::new(1 << 30);
    cfg.plug_limit = 32;
    let sched = Deadline::new(LockMode::Serialized);
    let q = Queue::with_scheduler(cfg, Box::new(Inline), Some(Box::new(sched))).unwrap();
    let count = Arc::new(Count::default());
    let end: Arc<dyn EndIo> = count.clone();
    let before = clock_reads();
    for b in 0..4u64 {
        q.submit_batch(&mut (0..32).map(|i| read((b * 32 + i) * 2)), &end);
    }
    assert_eq!(count.0.load(Ordering::Relaxed), 128);
    // Per batch: the plug's read, and one shared by the scheduler's insert, its dispatch
    // rounds and the inline completions.
    assert_eq!(clock_reads() - before, 2 * 4);
}

#[test]
fn a_batch_that_panics_leaves_no_request_in_the_thread_plug() {
    let bad = Queue::new(QueueConfig::new(1 << 30), Box::new(Inline)).unwrap();
    let end: Arc<dyn EndIo> = Arc::new(Count::default());
    // The caller's iterator panics after five bios are plugged (not flushed yet).
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        bad.submit_batch(
            &mut (0..8).map(|i| {
                assert!(i < 5, "iterator bug");
                read(i * 2)
            }),
            &end,
        );
    }));
    assert!(r.is_err());
    // The next batch on this thread, on another queue, gets a clean plug: none of `bad`'s five
    // requests is flushed into it (a token of another queue fails a debug assertion).
    let good = Queue::new(QueueConfig::new(1 << 30), Box::new(Inline)).unwrap();
    let count = Arc::new(Count::default());
    let end2: Arc<dyn EndIo> = count.clone();
    good.submit_batch(&mut (0..8).map(|i| read(i * 2)), &end2);
    assert_eq!(count.0.load(Ordering::Relaxed), 8);
    // `bad` holds five tags for ever: never dropped (its driver's stop would be fine, but the
    // requests are lost, as they were with a local plug).
    std::mem::forget(bad);
}
