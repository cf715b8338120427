//! A mirror's remote leg (`nbd::remote::RemoteDevice` over the in-process blkq server) whose
//! server goes away and comes back serving something else: the leg's branch after a failover
//! (run alone, degraded, and written), another slot's leg of the same array, another array's
//! leg. Every reconnection reads the leg's superblock before anything is sent on it, and the
//! mirror refuses what is not its slot's leg at a point of its history: the leg fails, the
//! refusal is named, the front keeps serving its own data, and nothing it writes (its
//! superblocks above all) reaches the leg.
// A plain threaded test, never a loom model: it may use std::sync.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]
#![cfg(not(blkq_loom))]

mod common;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use blk::Device;
use nbd::remote::RemoteDevice;
use raid1::superblock::{SB_OFFSET, SB_SIZE};
use raid1::{Raid1, Raid1Config};
use testkit::io::{flush, read_at, write_at};
use testkit::{pattern, wait_until_within};

use common::served::{device, log, serve_named};

const MIB: u64 = 1 << 20;
const SOON: Duration = Duration::from_secs(10);

/// Export `name` on `path` as a remote leg; requests wait for a reconnection (never past the
/// test), so only the check fails the leg.
fn remote(path: &Path, name: &str) -> Arc<RemoteDevice> {
    let uri = format!(
        "nbd+unix:///{name}?socket={},timeout=2,reconnect_deadline=60",
        path.display()
    );
    Arc::new(RemoteDevice::open(&uri).unwrap())
}

/// Served arrays re-add returning legs by themselves: so does this one (the probe must not
/// undo a refusal either).
fn cfg() -> Raid1Config {
    Raid1Config {
        bitmap_chunk: MIB,
        tick: Duration::from_millis(20),
        depth: 16,
        readd_interval: Some(Duration::from_millis(50)),
        ..Raid1Config::default()
    }
}

fn superblock(dev: &dyn Device) -> Vec<u8> {
    read_at(dev, SB_OFFSET, SB_SIZE).unwrap()
}

/// Waits until slot `i` of `r` is failed with a refusal, and returns the refusal.
fn refused(r: &Raid1, i: usize) -> String {
    wait_until_within("the reconnected leg refused", SOON, || {
        r.leg_status(i).unwrap().faulty && r.readd_status(i).unwrap().refused.is_some()
    });
    r.readd_status(i).unwrap().refused.unwrap()
}

/// The README's failover: the leg's server goes away, the leg is served alone as the array
/// (`--raid1-degraded`) and written, and its server comes back on the same address. The front
/// must not take that branch back as its in-sync leg: it refuses the leg (naming the
/// divergence), reads its own data, and the leg keeps its own superblock and data.
#[test]
fn a_leg_back_from_a_failover_with_writes_is_refused_and_left_untouched() {
    log();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("leg.sock");
    let (a, b) = (device("mem:16M"), device("mem:16M"));
    let server = serve_named(&path, &[("", &b)]);
    let leg = remote(&path, "");
    let front = Raid1::create(vec![a.clone(), leg.clone()], cfg()).unwrap();
    let ours = pattern(1, 64 << 10);
    write_at(&front, 0, &ours).unwrap();
    flush(&front).unwrap();
    let doff = front.data_offset();

    // The leg's host: its server stops, the leg runs alone (a new generation) and is written.
    server.shutdown();
    let theirs = pattern(2, 64 << 10);
    {
        let back = Raid1::assemble(
            vec![b.clone()],
            Raid1Config {
                allow_degraded: true,
                ..cfg()
            },
        )
        .unwrap();
        write_at(&back, 0, &theirs).unwrap();
        flush(&back).unwrap();
    }
    let branch_sb = superblock(b.as_ref());

    // Its server comes back on the same address.
    let server = serve_named(&path, &[("", &b)]);
    let why = refused(&front, 1);
    assert!(why.contains("without this array"), "{why}");
    wait_until_within("the refused connection dropped", SOON, || leg.is_broken());
    // The front's data, never the branch's.
    for _ in 0..8 {
        assert_eq!(read_at(&front, 0, ours.len()).unwrap(), ours);
    }
    // The front goes on (a write, a state change, a clean stop): nothing reaches the leg.
    write_at(&front, 4 * MIB, &pattern(3, 4096)).unwrap();
    flush(&front).unwrap();
    drop(front);
    assert!(
        superblock(b.as_ref()) == branch_sb,
        "the leg's superblock was written over"
    );
    assert_eq!(read_at(b.as_ref(), doff, theirs.len()).unwrap(), theirs);
    server.shutdown();
}

/// A leg's server back with another slot's leg of the same array, then another array's leg:
/// each refused at reconnection, naming why; a leg back with its own superblock is taken.
#[test]
fn a_leg_back_as_another_slot_or_another_array_is_refused() {
    log();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("legs.sock");
    let (a, b, c) = (device("mem:16M"), device("mem:16M"), device("mem:16M"));
    let server = serve_named(&path, &[("b", &b), ("c", &c)]);
    let (leg_b, leg_c) = (remote(&path, "b"), remote(&path, "c"));
    let front = Raid1::create(vec![a.clone(), leg_b.clone(), leg_c.clone()], cfg()).unwrap();
    write_at(&front, 0, &pattern(1, 4096)).unwrap();
    flush(&front).unwrap();

    // Export "b" now serves slot 2's leg; "c" its own.
    server.shutdown();
    let server = serve_named(&path, &[("b", &c), ("c", &c)]);
    let why = refused(&front, 1);
    assert!(why.contains("slot 2"), "{why}");
    wait_until_within("slot 2 reconnected", SOON, || leg_c.is_connected());
    let st = front.leg_status(2).unwrap();
    assert!(
        st.in_sync && !st.faulty,
        "its own leg is taken back: {st:?}"
    );

    // Export "c" now serves a leg of another array.
    let (other, other_uuid) = {
        let (d, e) = (device("mem:16M"), device("mem:16M"));
        let r = Raid1::create(vec![d.clone(), e], cfg()).unwrap();
        let uuid = r.superblock(0).unwrap().array_uuid;
        drop(r);
        (d, uuid)
    };
    let other_sb = superblock(other.as_ref());
    server.shutdown();
    let server = serve_named(&path, &[("b", &c), ("c", &other)]);
    let why = refused(&front, 2);
    assert!(why.contains(&other_uuid.to_string()), "{why}");
    assert!(!front.leg_status(0).unwrap().faulty);
    write_at(&front, MIB, &pattern(2, 4096)).unwrap();
    flush(&front).unwrap();
    assert_eq!(read_at(&front, 0, 4096).unwrap(), pattern(1, 4096));
    drop(front);
    assert!(
        superblock(other.as_ref()) == other_sb,
        "the other array's leg was written over"
    );
    server.shutdown();
}

/// A leg still in the array whose connection breaks and comes back carries the array's own
/// history at the array's events, but its superblock may hold a view the array has since
/// changed in memory (a change whose superblock write had not reached it). Assembly's
/// tie-break between two views at equal events would take the leg's as the newer; a live
/// array knows better (it wrote every superblock the leg holds), so the leg is taken back,
/// not refused as "written without this array". Found by `sim_remote` (seed 110: a
/// write-mostly leg refused with "its events (11) are past the array's (11)").
#[test]
fn a_leg_back_with_the_arrays_events_and_an_older_view_is_taken_back() {
    log();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("legs.sock");
    let (a, b) = (device("mem:16M"), device("mem:16M"));
    let server = serve_named(&path, &[("b", &b)]);
    let leg_b = remote(&path, "b");
    let front = Raid1::create(vec![a.clone(), leg_b.clone()], cfg()).unwrap();
    write_at(&front, 0, &pattern(1, 4096)).unwrap();
    flush(&front).unwrap();
    server.shutdown();
    // The leg's superblock at the array's events, with a view that records slot 0 failed:
    // the tie-break's "the view recording the failure" picks it.
    let mut sb = raid1::superblock::Superblock::decode(&superblock(b.as_ref())).unwrap();
    assert_eq!(sb.events, front.superblock(0).unwrap().events);
    sb.legs[0].in_sync = false;
    sb.legs[0].faulty = true;
    write_at(b.as_ref(), SB_OFFSET, &sb.encode().unwrap()).unwrap();
    flush(b.as_ref()).unwrap();
    let server = serve_named(&path, &[("b", &b)]);
    wait_until_within("the leg reconnected", SOON, || {
        leg_b.is_connected() || front.readd_status(1).unwrap().refused.is_some()
    });
    std::thread::sleep(Duration::from_millis(200));
    let st = front.leg_status(1).unwrap();
    assert!(
        st.in_sync && !st.faulty,
        "the array's own leg is taken back: {st:?}, refused {:?}",
        front.readd_status(1).unwrap().refused
    );
    write_at(&front, MIB, &pattern(2, 4096)).unwrap();
    flush(&front).unwrap();
    drop(front);
    server.shutdown();
}
