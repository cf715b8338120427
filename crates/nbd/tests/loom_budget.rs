//! Loom models of the server's memory budget (`nbd::server::MemoryBudget`), both
//! implementations (the lock-free counter and the locked version it replaces):
//!
//! - a reader waiting for room is woken by the give that makes its bytes fit (no lost
//!   wake-up), whether the give lands before, during or after its queueing;
//! - two takers racing for the last room: the count never exceeds the limit, exactly one of
//!   them gets it, and after both give back the count is 0.
#![cfg(blkq_loom)]

use blkq_sync::{thread, Arc};
use nbd::server::{BudgetImpl, MemoryBudget};

fn both(f: impl Fn(BudgetImpl) + Sync + Send + 'static) {
    let f = std::sync::Arc::new(f);
    for imp in [BudgetImpl::Atomic, BudgetImpl::Locked] {
        let f = f.clone();
        loom::model(move || f(imp));
    }
}

#[test]
fn a_waiter_for_room_is_woken_by_the_give() {
    both(|imp| {
        let b = Arc::new(MemoryBudget::with_impl(8, imp));
        assert!(b.try_take(6));
        let b2 = b.clone();
        let giver = thread::spawn(move || b2.give(6));
        // 4 more do not fit while the 6 are held: wait for room, then take it.
        loop {
            if b.try_take(4) {
                break;
            }
            b.wait_fit_forever(4);
        }
        giver.join().unwrap();
        assert_eq!(b.used(), 4);
    });
}

#[test]
fn racing_takers_never_exceed_the_limit() {
    both(|imp| {
        let b = Arc::new(MemoryBudget::with_impl(8, imp));
        assert!(b.try_take(4));
        let b2 = b.clone();
        let other = thread::spawn(move || {
            let got = b2.try_take(3);
            assert!(b2.used() <= 8);
            got
        });
        let mine = b.try_take(3);
        assert!(b.used() <= 8);
        let theirs = other.join().unwrap();
        assert!(
            mine ^ theirs,
            "exactly one of two racing takers gets the last room"
        );
        b.give(3);
        b.give(4);
        assert_eq!(b.used(), 0);
    });
}
