//! Loom models of a shared write's payload (`raid1::lend`, invariants 1-4): the legs of a
//! write read the caller's buffer through aliases and complete on several threads; the leg
//! whose completion finds nothing lent gives the buffer back to the caller, who writes it at
//! once (its next request). The payload is a loom `UnsafeCell`, so any leg read not ordered
//! before the caller's write is reported.
//!
//! - three legs, each completing on its own thread: the caller gets its buffer exactly once,
//!   after every leg's read;
//! - write-behind: two legs share the caller's payload, a write-behind leg reads its own copy
//!   and completes after the acknowledgement (as `leg_done` does: the caller is acknowledged
//!   when the legs that are not write-behind are done);
//! - the same with the write-behind leg reading the caller's payload without being lent it
//!   (the bug the copy prevents): the model fails.
#![cfg(blkq_loom)]

use blkq_sync::{thread, Arc, Mutex, UnsafeCell};
use raid1::lend::Lent;

/// A payload's bytes.
struct Payload(UnsafeCell<u8>);

// SAFETY: the model under test orders every access; loom checks that it does.
unsafe impl Sync for Payload {}
// SAFETY: as above.
unsafe impl Send for Payload {}

const DATA: u8 = 0x11;
const SCRIBBLE: u8 = 0xEE;

/// A leg's device reads its bio's buffer.
fn leg_reads(p: &Payload) {
    // SAFETY: the model under test: loom reports a read racing the caller's write.
    let v = p.0.with(|b| unsafe { *b });
    assert_eq!(v, DATA, "a leg wrote what the caller scribbled");
}

/// The write's slot (`Io`): the caller's payload, lent, and the legs' count.
struct Slot {
    orig: Lent<Arc<Payload>>,
    remaining: u32,
    /// Legs that are not write-behind still to complete (`sync_left`).
    sync_left: u32,
    wb_legs: u32,
    acked: bool,
}

struct Shared {
    io: Mutex<Slot>,
    /// Times the caller got its buffer back.
    returned: Mutex<u32>,
}

/// The caller's `end_io`: it has its buffer back and writes it at once.
fn caller_end_io(s: &Shared, p: Arc<Payload>) {
    *s.returned.lock() += 1;
    // SAFETY: the model under test: loom reports this write racing a leg's read.
    p.0.with_mut(|b| unsafe { *b = SCRIBBLE });
}

/// `leg_done`'s accounting for a write: the leg's alias is dropped and its bit cleared, then
/// the caller is completed by the last leg, or acknowledged early once the legs that are not
/// write-behind are done.
fn leg_done(s: &Shared, leg: usize) {
    let mut io = s.io.lock();
    io.orig.returned(leg);
    io.remaining -= 1;
    if io.wb_legs & (1 << leg) == 0 {
        io.sync_left -= 1;
    }
    let give = if io.remaining == 0 {
        io.orig.take()
    } else if io.wb_legs != 0 && !io.acked && io.sync_left == 0 {
        let p = io.orig.take();
        io.acked = p.is_some();
        p
    } else {
        None
    };
    drop(io);
    if let Some(p) = give {
        caller_end_io(s, p);
    }
}

/// A write over `legs` legs, the last `wb` of them write-behind reading `wb_reads` (their own
/// copy, or, broken, the caller's payload), the others lent the caller's payload. Legs
/// complete on their own threads (the first on the model's thread).
fn model(legs: usize, wb: usize, behind_reads_the_callers_payload: bool) {
    let caller = Arc::new(Payload(UnsafeCell::new(DATA)));
    let copy = Arc::new(Payload(UnsafeCell::new(DATA)));
    let wb_legs = ((1u32 << wb) - 1) << (legs - wb);
    let lent = ((1u32 << legs) - 1) & !wb_legs;
    let mut orig = Lent::owned(caller.clone());
    orig.lend(lent);
    let s = Arc::new(Shared {
        io: Mutex::new(Slot {
            orig,
            remaining: legs as u32,
            sync_left: (legs - wb) as u32,
            wb_legs,
            acked: false,
        }),
        returned: Mutex::new(0),
    });
    // Each leg's bio: an alias of the caller's payload, or the behind leg's copy.
    let bufs: Vec<Arc<Payload>> = (0..legs)
        .map(|i| {
            if wb_legs & (1 << i) != 0 && !behind_reads_the_callers_payload {
                copy.clone()
            } else {
                caller.clone()
            }
        })
        .collect();
    let threads: Vec<_> = (1..legs)
        .map(|i| {
            let (s, b) = (s.clone(), bufs[i].clone());
            thread::spawn(move || {
                leg_reads(&b);
                leg_done(&s, i);
            })
        })
        .collect();
    leg_reads(&bufs[0]);
    leg_done(&s, 0);
    for t in threads {
        t.join().unwrap();
    }
    assert_eq!(*s.returned.lock(), 1, "the caller got its buffer back once");
    assert_eq!(s.io.lock().orig.lent(), 0);
}

#[test]
fn loom_lend_three_legs_complete_on_three_threads() {
    blkq_sync::model(|| model(3, 0, false));
}

#[test]
fn loom_lend_write_behind_leg_reads_its_copy_after_the_acknowledgement() {
    blkq_sync::model(|| model(3, 1, false));
}

/// A write-behind leg reading the caller's payload without being lent it: the acknowledgement
/// gives the buffer back while that leg may still read it, and loom reports the race.
#[test]
fn loom_lend_a_behind_leg_on_the_callers_payload_fails() {
    let stderr = testkit::loom_child::expect_model_failure(
        "loom_lend_a_behind_leg_on_the_callers_payload_fails",
        "a write-behind leg reading the caller's payload passed the model",
        || model(2, 1, true),
    );
    assert!(
        stderr.contains("Causality violation") || stderr.contains("a leg wrote what the caller"),
        "child failed for another reason:\n{stderr}"
    );
}
