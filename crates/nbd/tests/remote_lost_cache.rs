//! A mirror's remote leg whose server restarts and loses its volatile cache: writes it
//! acknowledged and never flushed are gone from the leg, while the front, which never
//! stopped, acknowledged them to its client. The front must never serve the leg's rolled-back
//! data: the remote device tells the mirror, when the connection breaks with unflushed
//! writes on it, and the mirror fails the leg before anything more is read from it (its bits
//! stay set, so its return is a bitmap recovery).
// A plain threaded test, never a loom model: it may use std::sync.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]
#![cfg(not(blkq_loom))]

mod common;

use std::sync::Arc;
use std::time::Duration;

use blk::Device;
use blk_drivers::fault::{FaultConfig, FaultDevice};
use nbd::remote::RemoteDevice;
use raid1::{Raid1, Raid1Config};
use testkit::io::{flush, read_at, write_at};
use testkit::{pattern, wait_until_within};

use common::served::{device, log, serve};

const MIB: u64 = 1 << 20;
const SOON: Duration = Duration::from_secs(10);

/// The remote leg in slot 0 (reads go to it), and raid1d's tick never comes: its lazy bitmap
/// clearing would flush the legs, making the writes durable on host b before it goes down.
#[test]
fn a_leg_whose_server_lost_acknowledged_writes_is_failed_before_it_is_read() {
    log();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("leg.sock");
    // Host b's disk: a write cache that a power cut empties.
    let b = FaultDevice::new(
        device("mem:16M"),
        FaultConfig {
            volatile_cache: true,
            ..FaultConfig::default()
        },
    );
    let power = b.handle();
    let b: Arc<dyn Device> = Arc::new(b);
    let server = serve(&path, &b);
    let uri = format!(
        "nbd+unix:///?socket={},timeout=2,reconnect_deadline=60",
        path.display()
    );
    let leg = Arc::new(RemoteDevice::open(&uri).unwrap());
    let a = device("mem:16M");
    let front = Raid1::create(
        vec![leg.clone(), a.clone()],
        Raid1Config {
            bitmap_chunk: MIB,
            tick: Duration::from_secs(3600),
            ..Raid1Config::default()
        },
    )
    .unwrap();
    let (old, new) = (pattern(1, 64 << 10), pattern(2, 64 << 10));
    write_at(&front, 0, &old).unwrap();
    flush(&front).unwrap();
    // Acknowledged by both legs, flushed by neither.
    write_at(&front, 0, &new).unwrap();

    // Host b goes down (its connections reset, its cache lost) and comes back.
    let lost = power.crash().unwrap();
    assert!(
        lost.writes_lost > 0,
        "host b's cache held the write: {lost:?}"
    );
    server.shutdown();
    power.restart();
    let server = serve(&path, &b);

    // The front still owes its client the acknowledged write, whichever leg it reads.
    for _ in 0..8 {
        let got = read_at(&front, 0, new.len()).unwrap();
        assert!(
            got == new,
            "the front read {} after host b lost its cache (legs {:?}, {:?})",
            if got == old {
                "the older, rolled-back write"
            } else {
                "neither write"
            },
            front.leg_status(0),
            front.leg_status(1),
        );
    }
    wait_until_within("the leg that lost writes failed", SOON, || {
        front.leg_status(0).unwrap().faulty
    });
    assert!(
        front
            .bitmap()
            .is_some_and(|bm| !bm.dirty_chunks().is_empty()),
        "the failed leg's chunks must stay dirty for its recovery"
    );
    // The front goes on with its own data; a flush succeeds on the leg left.
    write_at(&front, 4 * MIB, &pattern(3, 4096)).unwrap();
    flush(&front).unwrap();
    assert_eq!(read_at(&front, 0, new.len()).unwrap(), new);
    drop(front);
    server.shutdown();
}
