//! Shutdown always ends (issue 13 item 3): the acceptors are woken without connecting to the
//! listeners (the Unix socket path may be gone), and a request stuck in a hung device is
//! given up after the drain timeout, its export reported stuck and failed.
// A plain threaded test, never a loom model: it may use std::sync.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]
#![cfg(not(blkq_loom))]

use std::sync::Arc;
use std::time::{Duration, Instant};

use blk::Device;
use blk_drivers::fault::{FaultConfig, FaultDevice, OpSet, Rule};
use blk_drivers::spec::{DeviceSpec, QueueOverrides};
use nbd::client::{Client, ClientOptions, Endpoint};
use nbd::codec::transmission::Request;
use nbd::codec::{CmdFlags, Command};
use nbd::server::{Export, Server, ServerConfig, ShutdownReport};

fn mem(spec: &str) -> Arc<dyn Device> {
    let s: DeviceSpec = spec.parse().unwrap();
    Arc::new(s.build(&QueueOverrides::default()).unwrap())
}

#[test]
fn shutdown_ends_with_the_socket_path_removed_on_tcp_and_unix() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("nbd.sock");
    let mut cfg = ServerConfig::new(vec![Export::new("", mem("mem:1M"))]);
    cfg.unix = Some(path.clone());
    cfg.tcp = Some("127.0.0.1:0".parse().unwrap());
    let server = Server::start(cfg).unwrap();
    let tcp = server.tcp_addr().unwrap();
    let mut a = Client::connect(&Endpoint::Unix(path.clone()), &ClientOptions::default()).unwrap();
    a.write(0, &[1u8; 4096], CmdFlags::empty()).unwrap();
    let mut b = Client::connect(&Endpoint::Tcp(tcp), &ClientOptions::default()).unwrap();
    assert_eq!(b.read(0, 4096).unwrap(), vec![1u8; 4096]);
    std::fs::remove_file(&path).unwrap();
    let stopper = server.stopper();
    stopper.stop();
    let report = server.wait();
    assert_eq!(report, ShutdownReport::default());
    assert!(report.is_clean());
    // Nobody listens any more.
    assert!(std::net::TcpStream::connect(tcp).is_err());
    drop((a, b));
}

#[test]
fn a_request_stuck_in_the_device_is_given_up_and_reported() {
    let fault = FaultDevice::new(mem("mem:4M"), FaultConfig::default());
    let rules = fault.handle();
    let dev: Arc<dyn Device> = Arc::new(fault);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("nbd.sock");
    let mut cfg = ServerConfig::new(vec![
        Export::new("hung", dev),
        Export::new("fine", mem("mem:1M")),
    ]);
    cfg.unix = Some(path.clone());
    cfg.tuning.drain_timeout = Duration::from_millis(200);
    let server = Server::start(cfg).unwrap();
    let ep = Endpoint::Unix(path);
    let mut fine = Client::connect(
        &ep,
        &ClientOptions {
            export: "fine".into(),
            ..ClientOptions::default()
        },
    )
    .unwrap();
    fine.write(0, &[3u8; 4096], CmdFlags::empty()).unwrap();
    let mut hung = Client::connect(
        &ep,
        &ClientOptions {
            export: "hung".into(),
            ..ClientOptions::default()
        },
    )
    .unwrap();
    rules.add(Rule::stall(OpSet::WRITE));
    hung.send(Request::new(Command::Write, 0, 0, 4096), &[5u8; 4096])
        .unwrap();
    // Bounded wait until the device holds it.
    let t0 = Instant::now();
    while rules.stalled() == 0 {
        assert!(t0.elapsed() < Duration::from_secs(60), "never stalled");
        std::thread::sleep(Duration::from_millis(5));
    }
    let report = server.shutdown();
    assert_eq!(report.stuck, vec!["hung".to_string()]);
    assert_eq!(report.failed, vec!["hung".to_string()]);
    // The stalled write may complete later: nothing breaks.
    rules.release();
    drop((fine, hung));
}
