//! Error stickiness (issue 13 item 1): once a write or flush fails on an export, every later
//! FLUSH and FUA write on it, on every connection, fails with EIO.
// A plain threaded test, never a loom model: it may use std::sync.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]
#![cfg(not(blkq_loom))]

use std::sync::Arc;
use std::time::Duration;

use blk::Device;
use blk_drivers::fault::{FaultConfig, FaultDevice, FaultHandle, OpSet, Rule};
use blk_drivers::spec::{DeviceSpec, QueueOverrides};
use nbd::client::{Client, ClientError, ClientOptions, Endpoint};
use nbd::codec::CmdFlags;
use nbd::server::{Export, Server, ServerConfig};

const EIO: u32 = 5;
const ENOTSUP: u32 = 95;

fn mem(spec: &str) -> Arc<dyn Device> {
    let s: DeviceSpec = spec.parse().unwrap();
    Arc::new(s.build(&QueueOverrides::default()).unwrap())
}

fn expect_eio(r: Result<(), ClientError>, what: &str) {
    match r {
        Err(ClientError::Request(e)) => assert_eq!(e, EIO, "{what}: wrong error"),
        other => panic!("{what}: expected EIO, got {other:?}"),
    }
}

/// A 4 MiB memory device behind a fault device with no rules yet, and the handle that adds
/// them.
fn faulty() -> (Arc<dyn Device>, FaultHandle) {
    let fault = FaultDevice::new(mem("mem:4M"), FaultConfig::default());
    let rules = fault.handle();
    (Arc::new(fault), rules)
}

fn start(exports: Vec<Export>) -> (Server, tempfile::TempDir, Endpoint) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("nbd.sock");
    let mut cfg = ServerConfig::new(exports);
    cfg.unix = Some(path.clone());
    cfg.tuning.drain_timeout = Duration::from_secs(5);
    (Server::start(cfg).unwrap(), dir, Endpoint::Unix(path))
}

/// Two connections to the default export.
fn two_clients(ep: &Endpoint) -> (Client, Client) {
    let opts = ClientOptions::default();
    (
        Client::connect(ep, &opts).unwrap(),
        Client::connect(ep, &opts).unwrap(),
    )
}

#[test]
fn a_failed_flush_fails_every_later_flush_on_every_connection() {
    let (dev, rules) = faulty();
    let (server, _dir, ep) = start(vec![
        Export::new("", dev),
        Export::new("other", mem("mem:1M")),
    ]);
    let (mut a, mut b) = two_clients(&ep);
    a.write(0, &[7u8; 4096], CmdFlags::empty()).unwrap();
    a.flush().unwrap();
    assert_eq!(server.export_failed(""), Some(false));

    let id = rules.add(Rule::fail(OpSet::FLUSH));
    expect_eio(a.flush(), "the failing flush");
    assert_eq!(server.export_failed(""), Some(true));
    assert_eq!(server.export_failed("other"), Some(false));
    assert_eq!(server.export_failed("nope"), None);
    expect_eio(b.flush(), "flush on the other connection");
    expect_eio(
        b.write(4096, &[1u8; 4096], CmdFlags::FUA),
        "FUA write after the failure",
    );
    // Plain reads and writes still work.
    assert_eq!(a.read(0, 4096).unwrap(), vec![7u8; 4096]);
    b.write(8192, &[2u8; 4096], CmdFlags::empty()).unwrap();

    // The fault is gone, the error is not.
    assert!(rules.remove(id));
    expect_eio(a.flush(), "flush after the rule is removed");
    expect_eio(b.flush(), "flush on b after the rule is removed");
    let mut c = Client::connect(&ep, &ClientOptions::default()).unwrap();
    expect_eio(c.flush(), "flush on a new connection");
    expect_eio(
        c.write(0, &[3u8; 4096], CmdFlags::FUA),
        "FUA write on a new connection",
    );
    // The other export is unaffected.
    let mut o = Client::connect(
        &ep,
        &ClientOptions {
            export: "other".into(),
            ..ClientOptions::default()
        },
    )
    .unwrap();
    o.flush().unwrap();
    drop((a, b, c, o));
    assert_eq!(server.shutdown().failed, vec![String::new()]);
}

#[test]
fn a_failed_write_is_sticky_too() {
    let (dev, rules) = faulty();
    let (server, _dir, ep) = start(vec![Export::new("", dev)]);
    let (mut a, mut b) = two_clients(&ep);
    let id = rules.add(Rule::fail(OpSet::WRITE).next(1));
    expect_eio(a.write(0, &[1u8; 4096], CmdFlags::empty()), "failing write");
    rules.remove(id);
    expect_eio(b.flush(), "flush after a lost write");
    assert_eq!(server.failed_exports(), vec![String::new()]);
    drop((a, b));
    assert_eq!(server.shutdown().failed, vec![String::new()]);
}

#[test]
fn a_refused_fast_zero_is_not_a_failed_write_back() {
    // A device that cannot zero fast refuses a FAST_ZERO write-zeroes with ENOTSUP and
    // writes nothing (what the flag asks for; qemu-img convert probes with it): no data was
    // lost, so the export must not fail.
    let (dev, rules) = faulty();
    let (server, _dir, ep) = start(vec![Export::new("", dev)]);
    let (mut a, mut b) = two_clients(&ep);
    a.write(0, &[7u8; 4096], CmdFlags::empty()).unwrap();
    let id = rules.add(Rule::fail(OpSet::DISCARD).errno(libc::ENOTSUP));
    match a.write_zeroes(0, 4096, CmdFlags::FAST_ZERO) {
        Err(ClientError::Request(e)) => assert_eq!(e, ENOTSUP, "the refusal"),
        other => panic!("expected ENOTSUP, got {other:?}"),
    }
    assert!(rules.remove(id));
    assert_eq!(server.export_failed(""), Some(false));
    a.flush().unwrap();
    b.flush().unwrap();
    b.write(4096, &[1u8; 4096], CmdFlags::FUA).unwrap();
    // The client's fallback: zeroing the slow way.
    a.write_zeroes(0, 4096, CmdFlags::empty()).unwrap();
    assert_eq!(a.read(0, 8192).unwrap()[..4096], [0u8; 4096]);
    // Any other failure of a write-zeroes still fails the export.
    let id = rules.add(Rule::fail(OpSet::DISCARD).next(1));
    expect_eio(
        a.write_zeroes(0, 4096, CmdFlags::empty()),
        "a failed write-zeroes",
    );
    assert!(rules.remove(id));
    expect_eio(b.flush(), "flush after a failed write-zeroes");
    drop((a, b));
    assert_eq!(server.shutdown().failed, vec![String::new()]);
}

#[test]
fn a_failed_final_flush_is_reported() {
    let (dev, rules) = faulty();
    let (server, _dir, ep) = start(vec![Export::new("x", dev)]);
    let mut a = Client::connect(
        &ep,
        &ClientOptions {
            export: "x".into(),
            ..ClientOptions::default()
        },
    )
    .unwrap();
    a.write(0, &[1u8; 4096], CmdFlags::empty()).unwrap();
    a.flush().unwrap();
    drop(a);
    rules.add(Rule::fail(OpSet::FLUSH));
    assert_eq!(server.failed_exports(), Vec::<String>::new());
    assert_eq!(server.shutdown().failed, vec!["x".to_string()]);
}

#[test]
fn a_clean_server_reports_nothing() {
    let (server, _dir, ep) = start(vec![Export::new("", mem("mem:1M"))]);
    let mut a = Client::connect(&ep, &ClientOptions::default()).unwrap();
    a.write(0, &[1u8; 4096], CmdFlags::FUA).unwrap();
    a.flush().unwrap();
    drop(a);
    assert!(server.shutdown().failed.is_empty());
}

mod socket {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn cfg(path: &std::path::Path) -> ServerConfig {
        let mut cfg = ServerConfig::new(vec![Export::new("", mem("mem:1M"))]);
        cfg.unix = Some(path.to_path_buf());
        cfg
    }

    fn start_err(c: ServerConfig) -> String {
        match Server::start(c) {
            Ok(_) => panic!("the server started"),
            Err(e) => e.to_string(),
        }
    }

    fn mode(p: &std::path::Path) -> u32 {
        std::fs::symlink_metadata(p).unwrap().permissions().mode() & 0o777
    }

    #[test]
    fn the_socket_is_private_unless_widened() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("s");
        let s = Server::start(cfg(&p)).unwrap();
        assert_eq!(mode(&p), 0o600);
        s.shutdown();
        assert!(!p.exists());
        let mut c = cfg(&p);
        c.unix_mode = 0o660;
        let s = Server::start(c).unwrap();
        assert_eq!(mode(&p), 0o660);
        s.shutdown();
    }

    #[test]
    fn a_stale_socket_is_replaced_anything_else_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("s");
        // A stale socket: bound, then its listener closed (connect gets ECONNREFUSED).
        drop(std::os::unix::net::UnixListener::bind(&p).unwrap());
        assert!(p.exists());
        let s = Server::start(cfg(&p)).unwrap();
        // A live server's socket is not taken over.
        let err = start_err(cfg(&p));
        assert!(err.contains(&p.display().to_string()), "{err}");
        s.shutdown();
        // A regular file is never replaced, and the error names it.
        let f = dir.path().join("file");
        std::fs::write(&f, b"keep me").unwrap();
        let err = start_err(cfg(&f));
        assert!(err.contains(&f.display().to_string()), "{err}");
        assert_eq!(std::fs::read(&f).unwrap(), b"keep me");
    }
}
