//! Nothing acknowledged is lost: a leg crashes (fault device with a volatile cache) while the
//! other survives and the array stops uncleanly; a stale leg (older events) is never read
//! before its recovery; a leg of another array is refused at assemble.
//! Deterministic: no timing assertions beyond generous deadlines.
// A plain threaded test, never a loom model: its own harness (std locks, condition variables)
// is not what a model must explore, so it may use std::sync.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]
#![cfg(not(blkq_loom))]

mod common;
use common::*;

use std::sync::Arc;
use std::time::Duration;

use blk::Device;
use blk_drivers::{FaultConfig, FaultDevice};
use raid1::superblock::{Superblock, SB_OFFSET, SB_SIZE};
use raid1::{Raid1, SyncAction};

const IDLE: Duration = Duration::from_secs(60);

/// Every acknowledged write reads back (later writes win where they overlap).
fn assert_acked(dev: &dyn Device, acked: &[(u64, Vec<u8>)]) {
    for (i, (off, data)) in acked.iter().enumerate() {
        let got = read(dev, *off, data.len());
        for (k, b) in got.iter().enumerate() {
            let pos = *off + k as u64;
            let want = acked[i..]
                .iter()
                .rev()
                .find(|(o, d)| pos >= *o && pos < *o + d.len() as u64)
                .map(|(o, d)| d[(pos - o) as usize])
                .unwrap();
            assert!(*b == want, "byte {pos} lost");
        }
    }
}

/// Leg 0 (a volatile write cache) crashes, losing what it had not made durable; the array
/// stops uncleanly. Reassembled, the surviving leg (newer events) is the source: every
/// acknowledged write, flushed or not, reads back, and leg 0 is recovered to equal it.
#[test]
fn crashed_leg_is_recovered_from_the_survivor() {
    let inner0 = mem("16M");
    let fault = Arc::new(FaultDevice::new(
        inner0.clone(),
        FaultConfig {
            volatile_cache: true,
            ..FaultConfig::default()
        },
    ));
    let handle = fault.handle();
    let leg0: Arc<dyn Device> = fault.clone();
    let leg1 = mem("16M");
    let mut acked: Vec<(u64, Vec<u8>)> = Vec::new();
    {
        let r = Raid1::create(vec![leg0.clone(), leg1.clone()], cfg()).unwrap();
        // Durable on both legs.
        for i in 0..4u64 {
            let data = pattern(i as u8, 16 << 10);
            write(&r, i * 3 * MB + 4096, &data);
            acked.push((i * 3 * MB + 4096, data));
        }
        flush(&r);
        // Acknowledged but not flushed: leg 0 loses them in its crash.
        for i in 0..4u64 {
            let data = pattern(100 + i as u8, 8192);
            write(&r, i * 3 * MB + MB + 512, &data);
            acked.push((i * 3 * MB + MB + 512, data));
        }
        // Overwrite part of a flushed write without a flush.
        let data = pattern(77, 4096);
        write(&r, 8192, &data);
        acked.push((8192, data));
        assert!(
            handle.unflushed_writes() > 0,
            "leg 0 holds unflushed writes"
        );
        handle.crash().unwrap();
        // The next write fails on leg 0 (crashed), so the array fails it; leg 1 takes it and
        // records the failure in its superblock (newer events).
        let data = pattern(55, 4096);
        write(&r, 10 * MB, &data);
        acked.push((10 * MB, data));
        assert!(r.leg_status(0).unwrap().faulty, "leg 0 failed");
        assert_acked(&r, &acked);
        r.crash_for_test();
    }
    handle.restart();
    let r = Raid1::assemble(vec![leg0.clone(), leg1.clone()], cfg()).unwrap();
    assert!(r.wait_sync_idle(IDLE));
    // The survivor is the source; leg 0 comes back faulty (its failure was recorded).
    assert!(r.leg_status(1).unwrap().in_sync);
    assert!(!r.leg_status(1).unwrap().faulty);
    assert_acked(&r, &acked);
    assert!(r.leg_status(0).unwrap().faulty, "leg 0 comes back faulty");
    assert!(r.is_degraded());
    // Recover leg 0: remove it and add it back.
    r.remove_leg(0).unwrap();
    assert_eq!(r.add_leg(leg0.clone()).unwrap(), 0, "back in its slot");
    assert!(r.wait_sync_idle(IDLE));
    assert!(!r.is_degraded(), "both legs in sync after the recovery");
    assert!(r.leg_status(0).unwrap().in_sync);
    assert_acked(&r, &acked);
    assert_legs_equal(&r, leg0.as_ref(), leg1.as_ref());
}

fn events_of(leg: &dyn Device) -> u64 {
    Superblock::decode(&read(leg, SB_OFFSET, SB_SIZE))
        .unwrap()
        .events
}

/// A leg whose events lag (it is put back to its state from before the last writes and
/// superblock updates, as a leg restored from an old copy would be) is assembled back as
/// recovering; while the recovery is held back (frozen, tiny speed limit) every read returns
/// the fresh data, never the stale leg's; then the recovery brings it up to date.
#[test]
fn stale_leg_is_never_read_before_its_recovery() {
    let (a, b) = (mem("16M"), mem("16M"));
    let fresh: Vec<(u64, Vec<u8>)> = (0..15u64)
        .map(|i| (i * MB + 4096, pattern(150 + i as u8, 32 << 10)))
        .collect();
    let snapshot: Vec<Vec<u8>>;
    {
        let r = Raid1::create(vec![a.clone(), b.clone()], cfg()).unwrap();
        for i in 0..15u64 {
            write(&r, i * MB, &pattern(i as u8, 64 << 10));
        }
        flush(&r);
        r.sync_superblocks().unwrap();
        snapshot = (0..16)
            .map(|i| read(b.as_ref(), i * MB, MB as usize))
            .collect();
        for (off, data) in &fresh {
            write(&r, *off, data);
        }
        flush(&r);
        r.sync_superblocks().unwrap();
    }
    // b goes back to its old contents: stale data, older events.
    for (i, piece) in snapshot.iter().enumerate() {
        write(b.as_ref(), i as u64 * MB, piece);
    }
    assert!(
        events_of(b.as_ref()) < events_of(a.as_ref()),
        "b's events lag"
    );
    let r = Raid1::assemble(vec![b.clone(), a.clone()], cfg()).unwrap();
    r.set_speed_limits(1, 1);
    r.set_sync_action(SyncAction::Frozen).unwrap();
    for round in 0..4 {
        for (off, data) in &fresh {
            assert!(
                &read(&r, *off, data.len()) == data,
                "round {round} at {off}"
            );
        }
    }
    r.set_sync_action(SyncAction::Idle).unwrap();
    r.set_speed_limits(1000, 10_000_000);
    assert!(r.wait_sync_idle(IDLE));
    assert!(!r.is_degraded(), "the stale leg is recovered");
    for (off, data) in &fresh {
        assert!(&read(&r, *off, data.len()) == data, "at {off}");
    }
    assert_legs_equal(&r, a.as_ref(), b.as_ref());
}

/// A leg that belongs to another array is refused at assemble.
#[test]
fn leg_of_another_array_is_refused() {
    let (a, b) = (mem("16M"), mem("16M"));
    let (c, d) = (mem("16M"), mem("16M"));
    drop(Raid1::create(vec![a.clone(), b], cfg()).unwrap());
    drop(Raid1::create(vec![c.clone(), d], cfg()).unwrap());
    assert!(Raid1::assemble(vec![a, c], cfg()).is_err());
}
