//! Loom models of the region gate behind writes received into their home
//! (`blk_drivers::backend::home::RegionGate`): receivers count themselves in flight with no
//! lock held across the receive; a zeroer (trim, write-zeroes) waits for them.
//!
//! - a zeroer never runs while a receiver is between its enter and its leave, whichever
//!   comes first, and neither side's wake-up is lost (loom reports a deadlock otherwise);
//! - a receiver that arrives while a zeroer drains waits for it, then goes in;
//! - a receiver dropped without leaving (an error mid-payload) still leaves: the zeroer after
//!   it runs, and the count is 0.
#![cfg(blkq_loom)]

use blk_drivers::backend::home::RegionGate;
use blkq_sync::atomic::{AtomicU32, Ordering};
use blkq_sync::{thread, Arc};

/// The bytes a receive is copying: a counter of receives between enter and leave, bumped
/// outside any lock (as the kernel's copy runs).
fn receive(g: &RegionGate, copying: &AtomicU32) {
    let rx = g.enter(0);
    // SeqCst: a test's own witness, ordered as strongly as loom allows.
    copying.fetch_add(1, Ordering::SeqCst);
    copying.fetch_sub(1, Ordering::SeqCst);
    rx.leave(|| {});
}

fn zero(g: &RegionGate, copying: &AtomicU32) {
    let q = g.quiet(0);
    assert_eq!(
        copying.load(Ordering::SeqCst),
        0,
        "a zeroer ran while a receive was copying"
    );
    drop(q);
}

#[test]
fn a_zeroer_never_runs_under_a_receive() {
    loom::model(|| {
        let g = Arc::new(RegionGate::new(1));
        let copying = Arc::new(AtomicU32::new(0));
        let (g2, c2) = (g.clone(), copying.clone());
        let w = thread::spawn(move || receive(&g2, &c2));
        zero(&g, &copying);
        w.join().unwrap();
        assert_eq!(g.writers(0), 0);
    });
}

#[test]
fn a_receiver_arriving_while_a_zeroer_drains_waits_then_goes_in() {
    loom::model(|| {
        let g = Arc::new(RegionGate::new(1));
        let copying = Arc::new(AtomicU32::new(0));
        // One receive in flight before the zeroer starts: it must drain it.
        let first = g.enter(0);
        let (g2, c2) = (g.clone(), copying.clone());
        let z = thread::spawn(move || zero(&g2, &c2));
        let (g3, c3) = (g.clone(), copying.clone());
        let late = thread::spawn(move || receive(&g3, &c3));
        first.leave(|| {});
        z.join().unwrap();
        late.join().unwrap();
        assert_eq!(g.writers(0), 0);
    });
}

#[test]
fn a_receiver_dropped_mid_payload_still_leaves() {
    loom::model(|| {
        let g = Arc::new(RegionGate::new(1));
        let copying = Arc::new(AtomicU32::new(0));
        let (g2, c2) = (g.clone(), copying.clone());
        let w = thread::spawn(move || {
            let rx = g2.enter(0);
            // SeqCst: as in `receive`.
            c2.fetch_add(1, Ordering::SeqCst);
            c2.fetch_sub(1, Ordering::SeqCst);
            drop(rx); // the error path: no explicit leave
        });
        zero(&g, &copying);
        w.join().unwrap();
        assert_eq!(g.writers(0), 0);
    });
}
