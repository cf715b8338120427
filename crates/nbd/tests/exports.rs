//! The export table changes while serving (issue 35 item 4): an export added at runtime is
//! listed and served at once, a duplicate name is refused; a removed one disappears at once
//! for new handshakes, while a client attached to it gets its in-flight request answered,
//! then the connection closed; the shutdown drains and reports the exports added at runtime,
//! and not the ones removed.
// A plain threaded test, never a loom model: it may use std::sync.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]
#![cfg(not(blkq_loom))]

use std::sync::Arc;
use std::time::{Duration, Instant};

use blk::Device;
use blk_drivers::fault::{FaultConfig, FaultDevice, FaultHandle, OpSet, Rule};
use blk_drivers::spec::{DeviceSpec, QueueOverrides};
use nbd::client::{Client, ClientOptions, Endpoint, Handshake};
use nbd::codec::proto::NBD_REP_ERR_UNKNOWN;
use nbd::codec::transmission::Request;
use nbd::codec::{CmdFlags, Command};
use nbd::server::{Export, Server, ServerConfig, ServerError};

fn mem(spec: &str) -> Arc<dyn Device> {
    let s: DeviceSpec = spec.parse().unwrap();
    Arc::new(s.build(&QueueOverrides::default()).unwrap())
}

/// A memory device whose I/O a test can stall or fail.
fn faulty() -> (Arc<dyn Device>, FaultHandle) {
    let fault = FaultDevice::new(mem("mem:4M"), FaultConfig::default());
    let rules = fault.handle();
    (Arc::new(fault), rules)
}

fn start(exports: Vec<Export>) -> (Server, Endpoint, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("nbd.sock");
    let mut cfg = ServerConfig::new(exports);
    cfg.unix = Some(path.clone());
    cfg.tuning.drain_timeout = Duration::from_millis(500);
    (Server::start(cfg).unwrap(), Endpoint::Unix(path), dir)
}

fn names(ep: &Endpoint) -> Vec<String> {
    let mut h = Handshake::start(ep.connect().unwrap()).unwrap();
    h.list().unwrap().into_iter().map(|(n, _)| n).collect()
}

fn connect(ep: &Endpoint, export: &str) -> Client {
    let opts = ClientOptions {
        export: export.into(),
        ..ClientOptions::default()
    };
    Client::connect(ep, &opts).unwrap()
}

/// Bounded wait until the device holds `n` stalled requests.
fn until_stalled(rules: &FaultHandle, n: usize) {
    let t0 = Instant::now();
    while rules.stalled() < n {
        assert!(t0.elapsed() < Duration::from_secs(20), "never stalled");
        std::thread::sleep(Duration::from_millis(2));
    }
}

#[test]
fn an_added_export_is_listed_and_served_and_a_duplicate_is_refused() {
    let (server, ep, _dir) = start(vec![Export::new("a", mem("mem:1M"))]);
    server
        .add_export(Export::new("b", mem("mem:2M")).description("added"))
        .unwrap();
    assert_eq!(names(&ep), ["a", "b"]);
    let mut c = connect(&ep, "b");
    assert_eq!(c.details().size, 2 << 20);
    c.write(4096, &[9u8; 4096], CmdFlags::FUA).unwrap();
    assert_eq!(c.read(4096, 4096).unwrap(), vec![9u8; 4096]);
    let dup = server.add_export(Export::new("b", mem("mem:1M")));
    assert!(
        matches!(&dup, Err(ServerError::DuplicateExport(n)) if n == "b"),
        "{dup:?}"
    );
    let bad = server.add_export(Export::new("x\0y", mem("mem:1M")));
    assert!(matches!(bad, Err(ServerError::BadExportName(_))), "{bad:?}");
    let list = server.exports().list().unwrap();
    let b = list.iter().find(|e| e.name == "b").unwrap();
    assert_eq!((b.size, b.connections, b.read_only), (2 << 20, 1, false));
    assert_eq!(b.description, "added");
    drop(c);
    assert!(server.shutdown().is_clean());
}

#[test]
fn a_removed_export_answers_what_is_in_flight_then_closes_and_its_name_is_unknown() {
    let (dev, rules) = faulty();
    let (server, ep, _dir) = start(vec![
        Export::new("keep", mem("mem:1M")),
        Export::new("gone", dev),
    ]);
    let mut c = connect(&ep, "gone");
    c.write(0, &[1u8; 4096], CmdFlags::empty()).unwrap();
    rules.add(Rule::stall(OpSet::WRITE));
    let cookie = c
        .send(Request::new(Command::Write, 0, 8192, 4096), &[2u8; 4096])
        .unwrap();
    until_stalled(&rules, 1);
    let exports = server.exports();
    let removal = std::thread::spawn(move || exports.remove("gone", Duration::from_secs(20)));
    // The name goes at once, while the removal waits for the stalled write.
    let t0 = Instant::now();
    while names(&ep) != ["keep"] {
        assert!(t0.elapsed() < Duration::from_secs(20), "still listed");
        std::thread::sleep(Duration::from_millis(2));
    }
    let mut h = Handshake::start(ep.connect().unwrap()).unwrap();
    let e = h.go("gone").unwrap_err();
    assert_eq!(e.option_error(), Some(NBD_REP_ERR_UNKNOWN), "{e}");
    assert!(
        !removal.is_finished(),
        "the removal did not wait for the write"
    );
    rules.clear();
    rules.release();
    let report = removal.join().unwrap().unwrap();
    assert_eq!(
        (report.connections, report.is_clean()),
        (1, true),
        "{report}"
    );
    // The in-flight write was answered, then the connection closed.
    let reply = c.recv().unwrap();
    assert_eq!((reply.cookie, reply.error), (cookie, 0));
    assert!(c.read(0, 4096).is_err(), "the connection stayed open");
    // The other export is untouched, and the name may be used again.
    assert_eq!(connect(&ep, "keep").read(0, 512).unwrap(), vec![0u8; 512]);
    server
        .add_export(Export::new("gone", mem("mem:1M")))
        .unwrap();
    assert_eq!(names(&ep), ["keep", "gone"]);
    let unknown = server.remove_export("nope", Duration::from_secs(1));
    assert!(
        matches!(unknown, Err(ServerError::UnknownExport(_))),
        "{unknown:?}"
    );
    assert!(server.shutdown().is_clean());
}

#[test]
fn the_shutdown_reports_an_export_added_at_runtime_and_not_one_removed() {
    let (server, ep, _dir) = start(vec![Export::new("a", mem("mem:1M"))]);
    // "bad": a write fails on it (sticky), then it is removed: said by the removal only.
    let (bad, bad_rules) = faulty();
    server.add_export(Export::new("bad", bad)).unwrap();
    bad_rules.add(Rule::fail(OpSet::WRITE));
    let mut c = connect(&ep, "bad");
    assert!(c.write(0, &[1u8; 512], CmdFlags::empty()).is_err());
    let e = server
        .remove_export("bad", Duration::from_millis(500))
        .unwrap_err();
    match &e {
        ServerError::RemovedUnclean(r) => assert!(r.failed && !r.stuck, "{r:?}"),
        other => panic!("{other:?}"),
    }
    assert!(
        e.to_string().contains("\"bad\"") && e.to_string().contains("lost"),
        "{e}"
    );
    drop(c);
    // "hung": added at runtime, a write stuck in it at shutdown.
    let (hung, rules) = faulty();
    server.add_export(Export::new("hung", hung)).unwrap();
    let mut h = connect(&ep, "hung");
    rules.add(Rule::stall(OpSet::WRITE));
    h.send(Request::new(Command::Write, 0, 0, 4096), &[5u8; 4096])
        .unwrap();
    until_stalled(&rules, 1);
    let exports = server.exports();
    let report = server.shutdown();
    assert_eq!(report.stuck, ["hung"]);
    assert_eq!(report.failed, ["hung"]);
    // Stopped: nothing changes any more.
    let late = exports.add(Export::new("late", mem("mem:1M")));
    assert!(matches!(late, Err(ServerError::Stopping)), "{late:?}");
    rules.release();
}

#[test]
fn the_last_export_may_be_removed_and_the_server_then_serves_none() {
    let (server, ep, _dir) = start(vec![Export::new("only", mem("mem:1M"))]);
    let r = server
        .remove_export("only", Duration::from_secs(1))
        .unwrap();
    assert_eq!(r.connections, 0);
    assert!(names(&ep).is_empty());
    let mut h = Handshake::start(ep.connect().unwrap()).unwrap();
    assert_eq!(
        h.go("only").unwrap_err().option_error(),
        Some(NBD_REP_ERR_UNKNOWN)
    );
    assert!(server.shutdown().is_clean());
}

#[test]
fn a_removal_stuck_past_its_timeout_is_an_error_naming_the_export() {
    let (dev, rules) = faulty();
    let (server, ep, _dir) = start(vec![
        Export::new("keep", mem("mem:1M")),
        Export::new("hung", dev),
    ]);
    let mut c = connect(&ep, "hung");
    rules.add(Rule::stall(OpSet::WRITE));
    c.send(Request::new(Command::Write, 0, 0, 4096), &[5u8; 4096])
        .unwrap();
    until_stalled(&rules, 1);
    let e = server
        .remove_export("hung", Duration::from_millis(200))
        .unwrap_err();
    match &e {
        ServerError::RemovedUnclean(r) => {
            assert!(r.stuck && r.failed && r.connections == 1, "{r:?}")
        }
        other => panic!("{other:?}"),
    }
    let msg = e.to_string();
    assert!(msg.contains("\"hung\" removed, but it is stuck"), "{msg}");
    assert_eq!(names(&ep), ["keep"]);
    // Not reported again by the shutdown.
    assert!(server.shutdown().is_clean());
    rules.release();
}
