//! mq-deadline allocates nothing per I/O in the steady state, in both lock designs, with
//! merges, and with threads contending (so that `serialized` punts to its buckets): a counting
//! global allocator watches a window of I/O after a warm-up.
// A plain threaded test or benchmark, never a loom model: its own harness (std locks, atomics,
// condition variables, baselines) is not what a model must explore, so it may use std::sync.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]
#![cfg(not(blkq_loom))]

mod common;

use std::sync::{Arc, Barrier, Mutex};
use testkit::alloc::CountingAlloc;

use blk::sched::LockMode;
use blk::{Bio, EndIo, Error, Op, Plug, Queue};

#[global_allocator]
static GLOBAL: CountingAlloc = CountingAlloc::new();

/// Gives completed bios back to their submitter (a vector with room for all of them).
struct Back(Mutex<Vec<Bio>>);

impl EndIo for Back {
    fn end_io(&self, bio: Bio, res: Result<(), Error>) {
        assert!(res.is_ok());
        self.0.lock().unwrap().push(bio);
    }
}

/// One submitter: 32 bios per plug, in runs of 4 contiguous ones (merges), random elsewhere.
fn job(q: &Queue, t: u64, rounds: u64, go: &Barrier, window: &Barrier) {
    let back = Arc::new(Back(Mutex::new(Vec::with_capacity(64))));
    let end: Arc<dyn EndIo> = back.clone();
    let mut free: Vec<Bio> = (0..32).map(|_| Bio::new(Op::Read, 0, 4096)).collect();
    let mut plug = Plug::new(32);
    let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ t;
    go.wait();
    for round in 0..2 * rounds {
        if round == rounds {
            window.wait(); // warm-up over: the main thread starts counting
        }
        let mut i = 0u64;
        while let Some(mut b) = free.pop() {
            if i.is_multiple_of(4) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
            }
            b.op = if round % 2 == 0 { Op::Read } else { Op::Write };
            b.sector = ((x % 4096) * 4 + i % 4) * 8;
            q.submit_plugged(&mut plug, b, &end);
            i += 1;
        }
        q.flush_plug(&mut plug);
        // Completions are inline, but in `serialized` mode on whichever thread dispatched:
        // wait for ours.
        loop {
            {
                let mut g = back.0.lock().unwrap();
                if g.len() == 32 {
                    std::mem::swap(&mut *g, &mut free);
                    break;
                }
            }
            std::thread::yield_now();
        }
    }
}

#[test]
fn steady_state_allocates_nothing() {
    for mode in [LockMode::Locked, LockMode::Serialized] {
        let q = common::deadline_queue("null:64M,sched=mq-deadline,hw_queue_depth=128", mode);
        let threads = 3;
        let go = Arc::new(Barrier::new(threads));
        let window = Arc::new(Barrier::new(threads + 1));
        let hs: Vec<_> = (0..threads as u64)
            .map(|t| {
                let (q, go, window) = (q.clone(), go.clone(), window.clone());
                std::thread::spawn(move || job(&q, t, 2000, &go, &window))
            })
            .collect();
        window.wait();
        GLOBAL.start();
        for h in hs {
            // Joining allocates nothing until the threads end.
            h.join().unwrap();
        }
        let allocs = GLOBAL.stop();
        let d = common::deadline(&q);
        let st = d.stats();
        let merged: u64 = st.prio.iter().map(|p| p.merged).sum();
        assert!(merged > 0, "{st:?}");
        assert!(
            allocs == 0,
            "{mode:?}: {allocs} allocations in {} I/Os; {st:?}",
            threads * 2000 * 32
        );
        eprintln!(
            "{mode:?}: {allocs} allocations over {} I/Os; lock {:?}",
            threads * 2000 * 32,
            st.lock
        );
    }
}
