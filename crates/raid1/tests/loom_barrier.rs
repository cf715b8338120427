//! Loom models of the barrier buckets, for both modes.
//!
//! - a regular write and a resync window on the same bucket never run together (an RMW
//!   counter checks overlap in the interleaving; a loom `UnsafeCell` checks that the two are
//!   ordered by happens-before, i.e. the data of one is visible to the other);
//! - a freeze returns only when no unqueued I/O is pending, and queued I/O does not hold it;
//! - `try_wait_barrier` (a write's later barrier units) excludes a resync window and a freeze
//!   as `wait_barrier` does, and a refusal leaves no count behind (a raiser or freezer that
//!   waited for it is woken: the model terminates, and the counters end at zero);
//! - nobody is left asleep (loom reports a deadlock otherwise);
//! - without the fence after the `nr_pending` increment (rule 1) the exclusion model fails
//!   (run in a child process, as `crates/sbitmap/tests/loom_legacy.rs` does).
#![cfg(blkq_loom)]

use blkq_sync::atomic::{AtomicUsize, Ordering};
use blkq_sync::{thread, Arc, UnsafeCell};
use raid1::barrier::{BarrierMode, Barriers};

struct Shared {
    b: Barriers,
    /// Number of parties inside a critical section (RMWs see the latest value).
    inside: AtomicUsize,
    /// The "data" both sides write: loom flags unordered accesses.
    data: UnsafeCell<u64>,
}

fn shared(b: Barriers) -> Arc<Shared> {
    Arc::new(Shared {
        b,
        inside: AtomicUsize::new(0),
        data: UnsafeCell::new(0),
    })
}

fn critical(s: &Shared, v: u64) {
    let before = s.inside.fetch_add(1, Ordering::Relaxed);
    assert_eq!(before, 0, "mutual exclusion violated");
    // SAFETY: the barrier protocol under test excludes the other writer; loom checks it.
    s.data.with_mut(|p| unsafe { *p = v });
    s.inside.fetch_sub(1, Ordering::Relaxed);
}

fn write_vs_resync(b: Barriers) {
    let s = shared(b);
    let t = {
        let s = s.clone();
        thread::spawn(move || {
            s.b.wait_barrier(0);
            critical(&s, 1);
            s.b.allow_barrier(0).unwrap();
        })
    };
    s.b.raise_barrier(0);
    critical(&s, 2);
    s.b.lower_barrier(0).unwrap();
    t.join().unwrap();
}

#[test]
fn loom_write_and_resync_exclude_lockless() {
    blkq_sync::model(|| write_vs_resync(Barriers::new(BarrierMode::Lockless)));
}

#[test]
fn loom_write_and_resync_exclude_locked() {
    blkq_sync::model(|| write_vs_resync(Barriers::new(BarrierMode::Locked)));
}

/// Three parties: a write and a read against a resync window. The read is never held by the
/// barrier (only the write is excluded), and every sleeper is woken (the model terminates).
fn write_read_vs_resync(b: Barriers) {
    let s = shared(b);
    let w = {
        let s = s.clone();
        thread::spawn(move || {
            s.b.wait_barrier(0);
            critical(&s, 1);
            s.b.allow_barrier(0).unwrap();
        })
    };
    let r = {
        let s = s.clone();
        thread::spawn(move || {
            s.b.wait_read_barrier(0);
            s.b.allow_barrier(0).unwrap();
        })
    };
    s.b.raise_barrier(0);
    critical(&s, 2);
    s.b.lower_barrier(0).unwrap();
    w.join().unwrap();
    r.join().unwrap();
    assert_eq!(s.b.snapshot(0), Default::default());
}

#[test]
fn loom_write_read_and_resync_lockless() {
    blkq_sync::model(|| write_read_vs_resync(Barriers::new(BarrierMode::Lockless)));
}

#[test]
fn loom_write_read_and_resync_locked() {
    blkq_sync::model(|| write_read_vs_resync(Barriers::new(BarrierMode::Locked)));
}

/// A write admitted with `try_wait_barrier` against a resync window and a freeze.
fn try_write_vs_resync_and_freeze(mode: BarrierMode, freeze: bool) {
    let s = shared(Barriers::new(mode));
    let t = {
        let s = s.clone();
        thread::spawn(move || {
            if s.b.try_wait_barrier(0) {
                critical(&s, 1);
                s.b.allow_barrier(0).unwrap();
            }
        })
    };
    if freeze {
        s.b.freeze_array(0);
        critical(&s, 2);
        s.b.unfreeze_array().unwrap();
    } else {
        s.b.raise_barrier(0);
        critical(&s, 2);
        s.b.lower_barrier(0).unwrap();
    }
    t.join().unwrap();
    assert_eq!(s.b.snapshot(0), Default::default());
}

#[test]
fn loom_try_write_and_resync_exclude_lockless() {
    blkq_sync::model(|| try_write_vs_resync_and_freeze(BarrierMode::Lockless, false));
}

#[test]
fn loom_try_write_and_resync_exclude_locked() {
    blkq_sync::model(|| try_write_vs_resync_and_freeze(BarrierMode::Locked, false));
}

#[test]
fn loom_try_write_and_freeze_exclude_lockless() {
    blkq_sync::model(|| try_write_vs_resync_and_freeze(BarrierMode::Lockless, true));
}

#[test]
fn loom_try_write_and_freeze_exclude_locked() {
    blkq_sync::model(|| try_write_vs_resync_and_freeze(BarrierMode::Locked, true));
}

/// A read passes a raised barrier, but not a freeze; a freeze waits for active I/O.
fn freeze_waits_for_active_io(mode: BarrierMode, read: bool) {
    let s = shared(Barriers::new(mode));
    let t = {
        let s = s.clone();
        thread::spawn(move || {
            if read {
                s.b.wait_read_barrier(0);
            } else {
                s.b.wait_barrier(0);
            }
            critical(&s, 1);
            s.b.allow_barrier(0).unwrap();
        })
    };
    s.b.freeze_array(0);
    // No unqueued I/O is pending: the other side is either done or not admitted.
    critical(&s, 2);
    s.b.unfreeze_array().unwrap();
    t.join().unwrap();
}

#[test]
fn loom_freeze_excludes_write_lockless() {
    blkq_sync::model(|| freeze_waits_for_active_io(BarrierMode::Lockless, false));
}

#[test]
fn loom_freeze_excludes_read_lockless() {
    blkq_sync::model(|| freeze_waits_for_active_io(BarrierMode::Lockless, true));
}

#[test]
fn loom_freeze_excludes_read_locked() {
    blkq_sync::model(|| freeze_waits_for_active_io(BarrierMode::Locked, true));
}

#[test]
fn loom_freeze_excludes_write_locked() {
    blkq_sync::model(|| freeze_waits_for_active_io(BarrierMode::Locked, false));
}

/// Queued I/O does not hold a freeze: the freezer returns with the other I/O still pending
/// but queued, and everyone terminates.
fn freeze_passes_queued_io(mode: BarrierMode) {
    let b = Arc::new(Barriers::new(mode));
    let t = {
        let b = b.clone();
        thread::spawn(move || {
            b.wait_barrier(0);
            b.queue_io(0);
        })
    };
    b.freeze_array(0);
    b.unfreeze_array().unwrap();
    t.join().unwrap();
    // The "retry thread" finishes the queued I/O.
    b.unqueue_io(0).unwrap();
    b.allow_barrier(0).unwrap();
    assert_eq!(b.snapshot(0), Default::default());
}

#[test]
fn loom_freeze_passes_queued_io_lockless() {
    blkq_sync::model(|| freeze_passes_queued_io(BarrierMode::Lockless));
}

#[test]
fn loom_freeze_passes_queued_io_locked() {
    blkq_sync::model(|| freeze_passes_queued_io(BarrierMode::Locked));
}

/// The exclusion model over the broken fast path (no fence after the `nr_pending` increment)
/// must fail: loom finds the store-buffer interleaving in which both proceed.
#[test]
fn loom_without_pending_fence_fails() {
    let stderr = testkit::loom_child::expect_model_failure(
        "loom_without_pending_fence_fails",
        "the fast path without its fence passed the model",
        || write_vs_resync(Barriers::new_without_pending_fence()),
    );
    assert!(
        stderr.contains("mutual exclusion violated") || stderr.contains("Causality violation"),
        "child failed for another reason:\n{stderr}"
    );
}
