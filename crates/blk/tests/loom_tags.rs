//! Loom model of the FIFO hand-off gate of the tag pool: a freed tag is moved to the oldest
//! waiter's hand-off cell under the gate lock. Checks that no hand-off is lost (every waiter
//! finishes: loom reports a deadlock otherwise) and that a tag never has two owners (an
//! `UnsafeCell` per tag: loom reports unordered accesses). Runs once without loom.

use blk::{PoolPolicy, TagPool};
use blkq_sync::{thread, Arc, UnsafeCell};
use sbitmap::WakeAlgo;

struct Owned(UnsafeCell<u32>);

// SAFETY: the cell is only touched by the current owner of tag 0 (what the model checks).
unsafe impl Sync for Owned {}

fn use_tag(o: &Owned, me: u32) {
    // SAFETY: we hold the only tag; loom flags the access if ownership is not exclusive.
    o.0.with_mut(|p| unsafe { *p = me });
}

fn handoff(policy: PoolPolicy) {
    let pool = Arc::new(TagPool::new(1, WakeAlgo::Counter, policy).unwrap());
    let owned = Arc::new(Owned(UnsafeCell::new(0)));
    let t = pool.get(0);
    let hs: Vec<_> = (1..=2)
        .map(|me| {
            let (pool, owned) = (pool.clone(), owned.clone());
            thread::spawn(move || {
                let t = pool.get(0);
                use_tag(&owned, me);
                assert!(pool.put(t));
            })
        })
        .collect();
    use_tag(&owned, 3);
    assert!(pool.put(t));
    for h in hs {
        h.join().unwrap();
    }
    assert_eq!(pool.gate_waiters(), 0);
    assert_eq!(pool.sbq().bitmap().weight(), 0);
}

#[test]
fn loom_fifo_handoff_loses_nothing() {
    blkq_sync::model(|| handoff(PoolPolicy::Fifo));
}

/// Batch ownership belongs to a thread, named by its `ThreadId`: under loom every thread has
/// `thread_slot()` 0, so an owner recorded by slot would let any thread spend the allowance.
/// A waiter handed a tag at the gate becomes the owner and may go past the soft limit; another
/// thread (here the main one) may not.
fn batch_owner_is_a_thread() {
    let pool = Arc::new(TagPool::new(4, WakeAlgo::Counter, PoolPolicy::Batch).unwrap());
    pool.set_batch(8, std::time::Duration::from_secs(3600));
    pool.set_max_in_flight(Some(1));
    let held = pool.get(1);
    let p = pool.clone();
    let owner = thread::spawn(move || {
        let first = p.get(0); // the soft limit is reached: queue at the gate
        let second = p
            .get_nowait(0)
            .expect("the batch owner goes past the soft limit");
        [first, second]
    });
    while pool.gate_waiters() != 1 {
        thread::yield_now();
    }
    assert!(pool.put(held));
    let tags = owner.join().unwrap();
    assert_eq!(
        pool.get_nowait(0),
        None,
        "not the batch owner: the soft limit holds"
    );
    for t in tags {
        assert!(pool.put(t));
    }
}

#[test]
fn loom_batch_owner_is_a_thread() {
    blkq_sync::model(batch_owner_is_a_thread);
}

/// Shallow allocation (a scheduler's `async_depth`): with a cap of 1 shallow tag out of 2, a
/// second shallow allocation sleeps while a bit is still free (which a synchronous allocation
/// can take meanwhile), and the free of the first shallow tag wakes it: the count is given back
/// before the bit, and the bitmap's fences order it against the sleeper's last look (tags
/// module docs). Loom reports a deadlock if the wake-up is lost, and unordered accesses if two
/// threads own one tag at once (one cell per tag: the count orders nothing, the bitmap does).
fn shallow_wake() {
    let pool = Arc::new(TagPool::new(2, WakeAlgo::Counter, PoolPolicy::Steal).unwrap());
    let owned = Arc::new([Owned(UnsafeCell::new(0)), Owned(UnsafeCell::new(0))]);
    let t = pool.get_shallow_nowait(1).expect("room under the cap");
    let w = {
        let (pool, owned) = (pool.clone(), owned.clone());
        thread::spawn(move || {
            let t = pool.get_shallow(1);
            use_tag(&owned[t as usize], 1);
            assert!(pool.put_shallow(t));
        })
    };
    // The cap holds back asynchronous requests only: a synchronous one finds the free bit.
    let s = pool
        .try_get()
        .expect("a tag kept back for synchronous requests");
    use_tag(&owned[s as usize], 2);
    assert!(pool.put(s));
    use_tag(&owned[t as usize], 3);
    assert!(pool.put_shallow(t));
    w.join().unwrap();
    assert_eq!(pool.shallow_in_use(), 0);
    assert_eq!(pool.sbq().bitmap().weight(), 0);
}

#[test]
fn loom_shallow_wake_is_not_lost() {
    blkq_sync::model(shallow_wake);
}

/// The soft limit (`max_in_flight`) under `steal`: with 1 tag in flight allowed out of 2, a
/// second allocation sleeps while a bit is free, and the free of the first tag must wake it:
/// like the shallow cap, the free gives the count back before the bit.
fn soft_limit_wake() {
    let pool = Arc::new(TagPool::new(2, WakeAlgo::Counter, PoolPolicy::Steal).unwrap());
    pool.set_max_in_flight(Some(1));
    let owned = Arc::new([Owned(UnsafeCell::new(0)), Owned(UnsafeCell::new(0))]);
    let t = pool.get(0);
    let w = {
        let (pool, owned) = (pool.clone(), owned.clone());
        thread::spawn(move || {
            let t = pool.get(0);
            use_tag(&owned[t as usize], 1);
            assert!(pool.put(t));
        })
    };
    use_tag(&owned[t as usize], 2);
    assert!(pool.put(t));
    w.join().unwrap();
    assert_eq!(pool.sbq().bitmap().weight(), 0);
}

#[test]
fn loom_soft_limit_wake_is_not_lost() {
    blkq_sync::model(soft_limit_wake);
}
