//! Loom models of the tag bitmap and its wait queues. Under `--cfg blkq_loom` each explores
//! the interleavings (bounded by LOOM_MAX_PREEMPTIONS); otherwise each runs once as a smoke
//! test. Ownership of a tag is checked with an `UnsafeCell` per tag: loom reports any two
//! accesses not ordered by happens-before, so these also check the Acquire/Release pairing
//! between a free and the next allocation of the same tag.

use blkq_sync::{thread, Arc, UnsafeCell};
use sbitmap::{Sbitmap, SbitmapQueue, WakeAlgo};

mod common;
use common::two_sleepers_two_frees;

struct Slots(Vec<UnsafeCell<u32>>);

// SAFETY: every access to a slot is made by the current owner of its tag; the models check
// that ownership is exclusive (loom flags a racy access as a failure).
unsafe impl Sync for Slots {}
// SAFETY: as above; the cells hold plain integers.
unsafe impl Send for Slots {}

impl Slots {
    fn new(n: u32) -> Self {
        Self((0..n).map(|_| UnsafeCell::new(0)).collect())
    }
    /// Writes as the owner of `tag`; returns what the previous owner left.
    fn own(&self, tag: u32, me: u32) -> u32 {
        // SAFETY: we own `tag`, so no other thread touches this cell concurrently (checked by
        // loom under the model).
        self.0[tag as usize].with_mut(|p| unsafe { std::mem::replace(&mut *p, me) })
    }
}

fn worker(sbq: &SbitmapQueue, slots: &Slots, me: u32) {
    let t = sbq.get_or_wait();
    slots.own(t, me);
    assert!(sbq.put(t));
}

#[test]
fn loom_bitmap_never_two_owners() {
    blkq_sync::model(|| {
        let sb = Arc::new(Sbitmap::new(2, Some(1), false).unwrap());
        let slots = Arc::new(Slots::new(2));
        let hs: Vec<_> = (1..=2)
            .map(|me| {
                let (sb, slots) = (sb.clone(), slots.clone());
                thread::spawn(move || {
                    if let Some(t) = sb.get() {
                        slots.own(t, me);
                        assert!(sb.put(t));
                    }
                })
            })
            .collect();
        if let Some(t) = sb.get() {
            slots.own(t, 3);
            assert!(sb.put(t));
        }
        for h in hs {
            h.join().unwrap();
        }
        assert_eq!(sb.weight(), 0);
    });
}

#[test]
fn loom_deferred_clear_never_loses_a_tag() {
    blkq_sync::model(|| {
        // One word of two bits: every allocation after the first frees must fold.
        let sb = Arc::new(Sbitmap::new(2, Some(1), false).unwrap());
        let a = sb.get().unwrap();
        let b = sb.get().unwrap();
        let sb1 = sb.clone();
        let h = thread::spawn(move || {
            assert!(sb1.put(a));
            sb1.get()
        });
        assert!(sb.put(b));
        let mine = sb.get();
        let theirs = h.join().unwrap();
        // Two tags were freed and two allocations raced for them: both must succeed, with
        // different tags, and nothing is left over.
        let (Some(x), Some(y)) = (mine, theirs) else {
            panic!("a freed tag was lost: {mine:?} {theirs:?}");
        };
        assert_ne!(x, y);
        assert_eq!(sb.get(), None);
    });
}

#[test]
fn loom_batch_get_and_put() {
    blkq_sync::model(|| {
        let sb = Arc::new(Sbitmap::new(4, Some(2), false).unwrap());
        let slots = Arc::new(Slots::new(4));
        let (sb1, slots1) = (sb.clone(), slots.clone());
        let h = thread::spawn(move || {
            if let Some(batch) = sb1.get_batch(3) {
                let tags: Vec<u32> = batch.iter().collect();
                for &t in &tags {
                    slots1.own(t, 1);
                }
                assert_eq!(sb1.put_batch(&tags), tags.len() as u32);
            }
        });
        for _ in 0..2 {
            if let Some(t) = sb.get() {
                slots.own(t, 2);
                assert!(sb.put(t));
            }
        }
        h.join().unwrap();
        assert_eq!(sb.weight(), 0);
    });
}

#[test]
fn loom_sleeper_gets_the_freed_tag_depth1() {
    blkq_sync::model(|| {
        let sbq = Arc::new(SbitmapQueue::new(1, None, false, WakeAlgo::Counter).unwrap());
        let slots = Arc::new(Slots::new(1));
        let t = sbq.get().unwrap();
        let (q1, s1) = (sbq.clone(), slots.clone());
        let h = thread::spawn(move || worker(&q1, &s1, 1));
        slots.own(t, 2);
        assert!(sbq.put(t));
        h.join().unwrap();
        assert_eq!(sbq.bitmap().weight(), 0);
    });
}

#[test]
fn loom_counter_two_sleepers_two_frees() {
    blkq_sync::model(|| two_sleepers_two_frees(WakeAlgo::Counter, false));
}

#[test]
fn loom_counter_nested_free() {
    blkq_sync::model(|| two_sleepers_two_frees(WakeAlgo::Counter, true));
}

#[test]
fn loom_async_and_thread_sleepers() {
    blkq_sync::model(|| {
        let sbq = Arc::new(SbitmapQueue::new(1, None, false, WakeAlgo::Counter).unwrap());
        let t = sbq.get().unwrap();
        let q1 = sbq.clone();
        let h = thread::spawn(move || {
            let t = block_on(q1.get_async());
            assert!(q1.put(t));
        });
        let q2 = sbq.clone();
        let h2 = thread::spawn(move || {
            let t = q2.get_or_wait();
            assert!(q2.put(t));
        });
        assert!(sbq.put(t));
        h.join().unwrap();
        h2.join().unwrap();
        assert_eq!(sbq.bitmap().weight(), 0);
    });
}

#[cfg(blkq_loom)]
fn block_on<F: std::future::Future>(f: F) -> F::Output {
    loom::future::block_on(f)
}

#[cfg(not(blkq_loom))]
fn block_on<F: std::future::Future>(f: F) -> F::Output {
    futures::executor::block_on(f)
}
