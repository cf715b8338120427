//! `nbd::remote::RemoteDevice` with several connections (`conns=N`): opened when the server
//! offers multi-conn, one connection otherwise; requests spread over them.
// A plain threaded test, never a loom model: its own harness (std locks and atomics) is not
// what a model must explore, so it may use std::sync.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]
#![cfg(not(blkq_loom))]

mod common;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use blk::Device;
use common::nbdkit::Kit;
use common::served::device;
use nbd::remote::RemoteDevice;
use nbd::server::{Export, Server, ServerConfig};
use testkit::io::read_at;
use testkit::{pattern, wait_until};

fn serve(path: &Path, disk: &Arc<dyn Device>) -> Server {
    let mut cfg = ServerConfig::new(vec![Export::new("", disk.clone())]);
    cfg.unix = Some(path.to_path_buf());
    cfg.tuning.drain_timeout = Duration::from_millis(200);
    Server::start(cfg).unwrap()
}

/// 4 threads × 32 writes of 64 KiB, all in flight, a flush, then the same reads checked.
fn load(dev: &Arc<RemoteDevice>) {
    common::load::parallel_writes_then_reads(&**dev, 4, 32, 64 << 10, true);
}

#[test]
fn four_connections_to_a_multi_conn_server() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("nbd.sock");
    let server = serve(&path, &device("mem:64M"));
    let uri = format!("nbd+unix:///?socket={},conns=4,depth=8", path.display());
    let dev = Arc::new(RemoteDevice::open(&uri).unwrap());
    assert_eq!(dev.connections(), 4);
    assert!(dev.is_connected());
    wait_until("4 connections at the server", || server.connections() == 4);
    load(&dev);
    assert_eq!(dev.in_flight(), 0);
    // The server goes away and comes back: every connection reconnects, the device serves.
    server.shutdown();
    let server = serve(&path, &device("mem:64M"));
    wait_until("all reconnected", || dev.is_connected());
    assert!(dev.reconnects() >= 4, "{}", dev.reconnects());
    load(&dev);
    drop(dev);
    server.shutdown();
}

/// nbdkit with multi-conn hidden (its multi-conn filter): one connection, and it works.
/// Skipped when nbdkit is not installed.
#[test]
fn a_server_without_multi_conn_gets_one_connection() {
    let dir = tempfile::tempdir().unwrap();
    let Some(kit) = Kit::start(
        dir.path(),
        &[
            "--filter=multi-conn",
            "memory",
            "64M",
            "multi-conn-mode=disable",
        ],
    ) else {
        return;
    };
    let dev = Arc::new(RemoteDevice::open(&kit.uri(",conns=4")).unwrap());
    assert_eq!(dev.connections(), 1);
    load(&dev);
    assert_eq!(
        read_at(&*dev, 0, 4096).unwrap(),
        pattern(0, 64 << 10)[..4096]
    );
    drop(dev);
    drop(kit);
}
