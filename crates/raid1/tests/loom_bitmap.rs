//! Loom models of the write-intent bitmap's lock-free counts (`raid1::bitmap`, `chunks`
//! invariants 1-3): a write whose chunk's bit is set and on disk skips the bitmap's mutex,
//! while the clearer marks chunks with no write in flight idle and later clears the ones
//! still marked. The property: a write is never in flight in a chunk whose bit is clear (it
//! would be issued, or still be on a leg, with no record that the legs may differ there).
//!
//! - the clearer marks, flushes and clears while a write starts (counted in shard 1) and ends
//!   (in shard 0, as a leg's completion thread would);
//! - the chunk is already marked and flushed when the write starts: the writer sees the mark
//!   and takes the mutex, or the clear comes first and the writer sets the bit again;
//! - both in the locked twin;
//! - two state changes racing to set the degraded flag (`update_degraded`).
#![cfg(blkq_loom)]

use std::time::Duration;

use blkq_sync::{thread, Arc};
use raid1::{BitmapCounts, WriteIntentBitmap};

const CHUNK: u64 = 64 << 20;

/// One chunk, its bit set and durable (the steady state), two shards.
fn steady(mode: BitmapCounts) -> Arc<WriteIntentBitmap> {
    let b = WriteIntentBitmap::new(CHUNK, CHUNK)
        .unwrap()
        .with_quiet_time(Duration::ZERO)
        .with_shards(mode, 2);
    let set = b.start_write_in(0, 0, 4096).unwrap().unwrap();
    b.mark_durable(set);
    b.end_write_in(0, 0, 4096).unwrap();
    Arc::new(b)
}

/// A write: counted in shard 1, persisted when `start_write` says so (the persist itself is
/// not modelled: `mark_durable` is what follows it), then in flight, then ended in shard 0.
fn write(b: &WriteIntentBitmap) {
    if let Some(set) = b.start_write_in(1, 0, 4096).unwrap() {
        b.mark_durable(set);
    }
    assert!(
        b.is_dirty(0),
        "a write in flight in a chunk whose bit is clear"
    );
    b.end_write_in(0, 0, 4096).unwrap();
}

/// The periodic clearer's two passes with a flush of every leg between them.
fn mark_flush_clear(b: &WriteIntentBitmap) {
    b.clear_quiet(Duration::ZERO, 0);
    let e = b.begin_flush();
    b.flush_done(e);
    b.clear_quiet(Duration::ZERO, 0);
}

fn write_vs_clearer(mode: BitmapCounts, premarked: bool) {
    let b = steady(mode);
    if premarked {
        assert_eq!(b.mark_idle(Duration::ZERO), 1);
        let e = b.begin_flush();
        b.flush_done(e);
    }
    let w = {
        let b = b.clone();
        thread::spawn(move || write(&b))
    };
    if premarked {
        b.clear_quiet(Duration::ZERO, 0);
    } else {
        mark_flush_clear(&b);
    }
    w.join().unwrap();
    // Nothing in flight now: one more mark, flush and clear always clears.
    mark_flush_clear(&b);
    assert!(!b.is_dirty(0), "a quiet, flushed chunk kept its bit");
}

#[test]
fn loom_bitmap_write_vs_mark_and_clear_sharded() {
    blkq_sync::model(|| write_vs_clearer(BitmapCounts::Sharded, false));
}

#[test]
fn loom_bitmap_write_vs_clear_of_a_marked_chunk_sharded() {
    blkq_sync::model(|| write_vs_clearer(BitmapCounts::Sharded, true));
}

#[test]
fn loom_bitmap_write_vs_mark_and_clear_locked() {
    blkq_sync::model(|| write_vs_clearer(BitmapCounts::Locked, false));
}

#[test]
fn loom_bitmap_write_vs_clear_of_a_marked_chunk_locked() {
    blkq_sync::model(|| write_vs_clearer(BitmapCounts::Locked, true));
}

/// Two state changes race (a leg fails while another change, made before it, updates the
/// flag too): the bitmap's degraded flag ends as the legs are, so no bit is cleared while a
/// leg is away. With the flag computed before the bitmap's lock (`set_degraded(degraded())`)
/// the later writer may be the change that saw the array whole, and this model fails.
#[test]
fn loom_bitmap_racing_state_changes_leave_the_degraded_flag_as_the_legs_are() {
    use blkq_sync::atomic::{AtomicBool, Ordering};
    blkq_sync::model(|| {
        let b = steady(BitmapCounts::Sharded);
        let faulty = Arc::new(AtomicBool::new(false));
        let (b1, f1) = (b.clone(), faulty.clone());
        let fail = thread::spawn(move || {
            f1.store(true, Ordering::Release);
            b1.update_degraded(|| f1.load(Ordering::Acquire));
        });
        let (b2, f2) = (b.clone(), faulty.clone());
        let other = thread::spawn(move || b2.update_degraded(|| f2.load(Ordering::Acquire)));
        fail.join().unwrap();
        other.join().unwrap();
        assert!(b.is_degraded(), "a leg failed, the flag says whole");
    });
}
