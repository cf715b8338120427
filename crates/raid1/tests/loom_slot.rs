//! Loom models of `slot::AdmittedCell`, the lock-free read of a leg's device on the regular
//! I/O path (see `crates/raid1/src/slot.rs`):
//!
//! - a submitter that holds its own admission while it uses the device never overlaps a leg
//!   replacement done with the array frozen, and sees either the old or the new device (loom's
//!   `UnsafeCell` flags any access pair not ordered by happens-before);
//! - the same when the I/O's own admission ends inside the submission (an inline completion
//!   ending it, or queueing it for a retry);
//! - without the submitter's own admission (only the I/O's, ended inline), the model fails.
#![cfg(blkq_loom)]

use blkq_sync::atomic::{AtomicUsize, Ordering};
use blkq_sync::{thread, Arc, Mutex};
use raid1::barrier::{BarrierMode, Barriers};
use raid1::slot::AdmittedCell;

/// A "device": `alive` is cleared when it is retired; a user asserts it is alive.
struct Dev {
    id: usize,
    alive: AtomicUsize,
}

struct Shared {
    b: Barriers,
    slot: AdmittedCell<Option<Arc<Dev>>>,
    lock: Mutex<()>,
}

fn shared(mode: BarrierMode) -> Arc<Shared> {
    let mut slot = AdmittedCell::new(None);
    slot.set(Some(Arc::new(Dev {
        id: 1,
        alive: AtomicUsize::new(1),
    })));
    Arc::new(Shared {
        b: Barriers::new(mode),
        slot,
        lock: Mutex::new(()),
    })
}

/// How the I/O's own admission ends during the submission.
#[derive(Clone, Copy)]
enum Inline {
    /// Completes inline: `allow_barrier` inside the submission.
    Complete,
    /// Fails inline and is queued for a retry: `queue_io` inside the submission (the retry
    /// thread ends it later).
    Queue,
}

/// A submitter: admitted, optionally its own hold, uses the device (during which the I/O's
/// admission ends inline), then drops its hold.
fn submitter(s: &Shared, own_hold: bool, inline: Inline) {
    s.b.wait_read_barrier(0);
    if own_hold {
        s.b.hold(0);
    }
    // SAFETY: the model under test (the broken variant is expected to fail in loom).
    let seen = unsafe {
        s.slot.with_admitted(|d| {
            // The I/O's admission ends inside the device's submit.
            match inline {
                Inline::Complete => s.b.allow_barrier(0).unwrap(),
                Inline::Queue => s.b.queue_io(0),
            }
            d.as_ref().map(|d| {
                assert_eq!(d.alive.load(Ordering::Relaxed), 1, "used a retired device");
                d.id
            })
        })
    };
    assert!(matches!(seen, Some(1) | Some(2)));
    if own_hold {
        s.b.allow_barrier(0).unwrap();
    }
    if let Inline::Queue = inline {
        // The retry thread finishes the queued I/O.
        s.b.unqueue_io(0).unwrap();
        s.b.allow_barrier(0).unwrap();
    }
}

/// A leg replacement: freeze, swap under the lock, retire the old device, unfreeze.
fn replace(s: &Shared) {
    s.b.freeze_array(0);
    let old = {
        let _g = s.lock.lock();
        // SAFETY: frozen, and the lock orders writers.
        unsafe {
            s.slot.replace_frozen(Some(Arc::new(Dev {
                id: 2,
                alive: AtomicUsize::new(1),
            })))
        }
    };
    if let Some(old) = old {
        old.alive.store(0, Ordering::Relaxed);
    }
    s.b.unfreeze_array().unwrap();
}

fn model(mode: BarrierMode, own_hold: bool, inline: Inline) {
    let s = shared(mode);
    let t = {
        let s = s.clone();
        thread::spawn(move || submitter(&s, own_hold, inline))
    };
    replace(&s);
    t.join().unwrap();
    assert_eq!(s.b.snapshot(0), Default::default());
}

#[test]
fn loom_slot_replace_vs_submit_inline_completion_lockless() {
    blkq_sync::model(|| model(BarrierMode::Lockless, true, Inline::Complete));
}

#[test]
fn loom_slot_replace_vs_submit_inline_queue_lockless() {
    blkq_sync::model(|| model(BarrierMode::Lockless, true, Inline::Queue));
}

#[test]
fn loom_slot_replace_vs_submit_locked() {
    blkq_sync::model(|| model(BarrierMode::Locked, true, Inline::Complete));
}

/// Without the submitter's own admission, an inline completion lets the freezer pass while the
/// submitter still uses the device: loom reports the unordered access (or the retired device).
#[test]
fn loom_slot_without_own_hold_fails() {
    let stderr = testkit::loom_child::expect_model_failure(
        "loom_slot_without_own_hold_fails",
        "the submission without its own admission passed the model",
        || model(BarrierMode::Lockless, false, Inline::Complete),
    );
    assert!(
        stderr.contains("used a retired device") || stderr.contains("Causality violation"),
        "child failed for another reason:\n{stderr}"
    );
}
