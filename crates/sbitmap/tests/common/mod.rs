//! Models shared by the loom test files.

use blkq_sync::{thread, Arc};
use sbitmap::{SbitmapQueue, WakeAlgo};

/// Depth 2 (wake batch 1), both tags in flight, two workers that sleep for a tag and keep it,
/// then two frees, the second optionally nested inside the first one's wake-up path. If a
/// wake-up is lost, a worker sleeps forever and loom reports a deadlock.
pub fn two_sleepers_two_frees(algo: WakeAlgo, nested: bool) {
    let sbq = Arc::new(SbitmapQueue::new(2, None, false, algo).unwrap());
    let t0 = sbq.get().unwrap();
    let t1 = sbq.get().unwrap();
    // Each worker keeps the tag it gets, so no later free can paper over a lost wake-up.
    let hs: Vec<_> = (0..2)
        .map(|_| {
            let q = sbq.clone();
            thread::spawn(move || q.get_or_wait())
        })
        .collect();
    if nested {
        // The second free runs inside the first one's wake-up path, on this thread.
        let q = sbq.clone();
        assert!(sbq.put_nested(t0, &mut || assert!(q.put(t1))));
    } else {
        assert!(sbq.put(t0));
        assert!(sbq.put(t1));
    }
    // If a wake-up is lost, a worker sleeps forever and loom reports a deadlock.
    let got: Vec<u32> = hs.into_iter().map(|h| h.join().unwrap()).collect();
    assert_ne!(got[0], got[1]);
    assert_eq!(sbq.bitmap().weight(), 2);
}
