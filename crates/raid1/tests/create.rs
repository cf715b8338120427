//! `Raid1::create_with`: a new array over legs that differ resyncs from its first leg, reads go
//! to that leg meanwhile, and a stop before the resync ends leaves it due for the next
//! assembly; a leg size more than the smallest leg is refused.
// A plain threaded test, never a loom model: it may use std::sync.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]
#![cfg(not(blkq_loom))]

mod common;
use common::*;

use std::sync::Arc;
use std::time::Duration;

use blk::{Device, Op};
use raid1::superblock::ArrayState;
use raid1::{Creation, Raid1};
use testkit::Forward;

const IDLE: Duration = Duration::from_secs(60);

#[test]
fn a_new_array_over_legs_that_differ_resyncs_from_its_first_leg_even_across_a_stop() {
    let (a, b) = (mem("16M"), mem("16M"));
    // Data starts at 1 MiB on these legs: different contents in the data areas.
    write(a.as_ref(), 2 * MB, &pattern(1, 256 << 10));
    write(b.as_ref(), 2 * MB, &pattern(2, 256 << 10));
    write(b.as_ref(), 9 * MB, &pattern(3, 4096));
    // Leg b takes data writes slowly (50 ms each): the resync is still running when the
    // array stops.
    let data_sector = MB >> blk::SECTOR_SHIFT;
    let slow_b: Arc<dyn Device> =
        Arc::new(Forward::on_submit(b.clone(), move |inner, bio, end| {
            if bio.op == Op::Write && bio.sector >= data_sector {
                std::thread::sleep(Duration::from_millis(50));
            }
            inner.submit(bio, end);
        }));
    let how = Creation {
        resync: true,
        leg_size: None,
    };
    {
        let r = Raid1::create_with(vec![a.clone(), slow_b], cfg(), how).unwrap();
        // Whichever leg a read would go to, it reads the first leg's data.
        for _ in 0..8 {
            assert_eq!(read(&r, MB, 256 << 10), pattern(1, 256 << 10));
        }
        drop(r);
    }
    let sb = Raid1::read_superblock(a.as_ref()).unwrap();
    assert_ne!(
        sb.array_state,
        ArrayState::Clean,
        "stopped before its initial resync ended, the array is not clean"
    );
    let r = Raid1::assemble(vec![a.clone(), b.clone()], cfg()).unwrap();
    assert!(r.wait_sync_idle(IDLE));
    assert_legs_equal(&r, a.as_ref(), b.as_ref());
    assert_eq!(read(&r, MB, 256 << 10), pattern(1, 256 << 10));
    r.set_sync_action(raid1::SyncAction::Check).unwrap();
    assert!(r.wait_sync_idle(IDLE));
    assert_eq!(r.sync_progress().mismatch_cnt, 0);
    drop(r);
    let sb = Raid1::read_superblock(a.as_ref()).unwrap();
    assert_eq!(sb.array_state, ArrayState::Clean);
}

#[test]
fn a_leg_size_past_the_smallest_leg_is_refused_and_a_smaller_one_is_used() {
    let how = |n| Creation {
        resync: false,
        leg_size: Some(n),
    };
    assert!(Raid1::create_with(vec![mem("8M"), mem("12M")], cfg(), how(9 * MB)).is_err());
    let r = Raid1::create_with(vec![mem("8M"), mem("12M")], cfg(), how(6 * MB)).unwrap();
    assert_eq!(r.data_offset() + r.limits().capacity, 6 * MB);
}
