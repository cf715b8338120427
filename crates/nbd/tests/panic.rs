//! Panic containment (issue 13 item 4): a panic on a connection's thread (here, in the
//! device's `submit`, which runs on the reader) fails that connection only; its descriptors,
//! flusher thread and registry entry are released, and the other connections and the device
//! keep working.
// A plain threaded test, never a loom model: it may use std::sync.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]
#![cfg(not(blkq_loom))]

use std::sync::Arc;
use std::time::{Duration, Instant};

use blk::Device;
use blk_drivers::spec::{DeviceSpec, QueueOverrides};
use nbd::client::{Client, ClientOptions, Endpoint};
use nbd::codec::CmdFlags;
use nbd::server::{Export, Server, ServerConfig};
use testkit::{Forward, Hook};

/// The byte offset whose bios make `submit` panic.
const POISON: u64 = 1 << 20;

/// A device that panics in `submit` for a bio at `POISON`: a buggy driver.
fn panic_device(inner: Arc<dyn Device>) -> Forward<impl Hook> {
    Forward::on_submit(inner, |inner, bio, end| {
        if bio.offset() == POISON {
            panic!("injected: a driver bug in submit");
        }
        inner.submit(bio, end);
    })
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "timed out: {what}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn a_panic_on_a_connection_fails_that_connection_only() {
    let spec: DeviceSpec = "mem:4M".parse().unwrap();
    let inner: Arc<dyn Device> = Arc::new(spec.build(&QueueOverrides::default()).unwrap());
    let dev: Arc<dyn Device> = Arc::new(panic_device(inner));
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("nbd.sock");
    let mut cfg = ServerConfig::new(vec![Export::new("", dev)]);
    cfg.unix = Some(path.clone());
    let server = Server::start(cfg).unwrap();
    let ep = Endpoint::Unix(path);
    let opts = ClientOptions::default();

    let mut b = Client::connect(&ep, &opts).unwrap();
    b.write(0, &[7u8; 4096], CmdFlags::empty()).unwrap();
    wait_for("one connection", || server.connections() == 1);
    let fds = open_fds();

    for round in 0..3u8 {
        let mut a = Client::connect(&ep, &opts).unwrap();
        a.write(8192, &[round; 512], CmdFlags::empty()).unwrap();
        // A write: a read of a hole would be answered from the allocation map, unsubmitted.
        // On its own thread, so that a connection left open (the failure) fails the test
        // instead of hanging it.
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let r = a.write(POISON, &[1u8; 4096], CmdFlags::empty());
            let _ = tx.send(r.is_err());
        });
        let failed = rx
            .recv_timeout(Duration::from_secs(20))
            .expect("the panicking connection was never closed");
        assert!(failed, "the poisoned write got an answer");
        // The panicking connection is closed; the other one works throughout.
        assert_eq!(b.read(0, 4096).unwrap(), vec![7u8; 4096]);
        assert_eq!(b.read(8192, 512).unwrap(), vec![round; 512]);
        wait_for("the failed connection gone", || server.connections() == 1);
    }
    // Its socket, its flusher and the registry's handle are gone: no descriptor left over.
    wait_for("descriptors back to the baseline", || open_fds() <= fds);
    let mut c = Client::connect(&ep, &opts).unwrap();
    assert_eq!(c.read(0, 4096).unwrap(), vec![7u8; 4096]);
    drop((b, c));
    server.shutdown();
}
