//! A `RequestToken` belongs to one queue: using it on another is refused (a debug assertion),
//! and its request's identity (tag, pool) is read-only to drivers.
// A plain threaded test or benchmark, never a loom model: its own harness (std locks, atomics,
// condition variables, baselines) is not what a model must explore, so it may use std::sync.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]

use std::sync::{Arc, Mutex};

use blk::{Bio, Driver, EndIo, Error, Op, Queue, QueueConfig, RequestQueue, RequestToken};

/// Keeps every request it is given, for the test to complete.
#[derive(Default)]
struct Hold(Mutex<Vec<RequestToken>>);

struct HoldDriver(Arc<Hold>);

impl Driver for HoldDriver {
    fn queue_rq(&self, _q: &RequestQueue, rq: RequestToken) {
        self.0 .0.lock().unwrap().push(rq);
    }
    fn describe(&self) -> String {
        "hold".into()
    }
}

#[derive(Default)]
struct Count(Mutex<usize>);

impl EndIo for Count {
    fn end_io(&self, _bio: Bio, res: Result<(), Error>) {
        res.unwrap();
        *self.0.lock().unwrap() += 1;
    }
}

fn queue() -> (Queue, Arc<Hold>) {
    let hold = Arc::new(Hold::default());
    let q = Queue::new(
        QueueConfig::new(1 << 20),
        Box::new(HoldDriver(hold.clone())),
    )
    .unwrap();
    (q, hold)
}

fn submit_one(q: &Queue, end: &Arc<dyn EndIo>) {
    q.submit(Bio::new(Op::Flush, 0, 0), end);
}

#[test]
fn a_token_completes_on_its_own_queue() {
    let (q, hold) = queue();
    let count = Arc::new(Count::default());
    let end: Arc<dyn EndIo> = count.clone();
    submit_one(&q, &end);
    let tok = hold.0.lock().unwrap().pop().unwrap();
    let rq = q.core().rq(&tok);
    assert!(rq.tag() < 64, "a tag of the 64-deep pool");
    assert_eq!(rq.hctx(), 0);
    assert!(!rq.reserved());
    assert!(rq.merged().is_none());
    assert_eq!(rq.bio().map(|b| b.op), Some(Op::Flush));
    q.core().complete(tok, Ok(()));
    assert_eq!(*count.0.lock().unwrap(), 1);
}

#[cfg(debug_assertions)]
#[test]
#[should_panic(expected = "does not belong to")]
fn a_token_from_another_queue_is_refused() {
    let (q1, hold1) = queue();
    let (q2, _hold2) = queue();
    let end: Arc<dyn EndIo> = Arc::new(Count::default());
    submit_one(&q1, &end);
    let tok = hold1.0.lock().unwrap().pop().unwrap();
    // Leak the queues: the panic below leaves q1's request in flight forever.
    let q2 = Box::leak(Box::new(q2));
    std::mem::forget(q1);
    q2.core().complete(tok, Ok(()));
}
