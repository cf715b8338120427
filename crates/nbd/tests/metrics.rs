//! The server's counters for metrics (`Server::metrics`), in-process on a temporary Unix
//! socket: connections accepted, refused at the limit and open; handshakes ended by timeout
//! and protocol error; requests and bytes of closed connections; and the disk counters the
//! server keeps for a device that has none of its own, next to a queue's own. Bounded waits
//! only (`testkit::wait_until`), no timing assertions.
// A plain threaded test, never a loom model: its own harness may use std::sync.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]
#![cfg(not(blkq_loom))]

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::Duration;

use blk::Device;
use blk_drivers::spec::{DeviceSpec, QueueOverrides};
use nbd::client::{Client, ClientOptions, Endpoint};
use nbd::codec::CmdFlags;
use nbd::server::{Export, HandshakeFailure, Server, ServerConfig, StatsSource};
use testkit::{wait_until, Forward};

fn queue(spec: &str) -> Arc<dyn Device> {
    let s: DeviceSpec = spec.parse().unwrap();
    Arc::new(s.build(&QueueOverrides::default()).unwrap())
}

fn start(exports: Vec<Export>, max_connections: usize) -> (Server, tempfile::TempDir, Endpoint) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("nbd.sock");
    let mut cfg = ServerConfig::new(exports);
    cfg.unix = Some(path.clone());
    cfg.tuning.recv_buf = 64 << 10;
    cfg.tuning.drain_timeout = Duration::from_secs(5);
    cfg.tuning.handshake_timeout = Duration::from_secs(1);
    cfg.tuning.max_connections = max_connections;
    (Server::start(cfg).unwrap(), dir, Endpoint::Unix(path))
}

fn raw(ep: &Endpoint) -> UnixStream {
    let Endpoint::Unix(p) = ep else {
        unreachable!()
    };
    UnixStream::connect(p).unwrap()
}

/// Reads until the server closes the socket (the read timeout is only a hang guard).
fn wait_closed(s: &mut UnixStream) {
    s.set_read_timeout(Some(testkit::PROMPT)).unwrap();
    let mut buf = [0u8; 256];
    loop {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
    }
}

fn failures(s: &Server, why: HandshakeFailure) -> u64 {
    let i = HandshakeFailure::ALL
        .iter()
        .position(|w| *w == why)
        .unwrap();
    s.metrics().server().handshake_failures[i]
}

#[test]
fn connections_refusals_and_handshake_failures_are_counted() {
    let (server, _dir, ep) = start(vec![Export::new("", queue("mem:16M"))], 2);
    let m = server.metrics();
    let mut c = Client::connect(&ep, &ClientOptions::default()).unwrap();
    // A silent socket holds the second slot.
    let mut silent = raw(&ep);
    wait_until("two connections open", || m.server().open == 2);
    // The third, at the limit, evicts it: the oldest connection still in its handshake.
    let mut third = raw(&ep);
    wait_closed(&mut silent);
    wait_until("the eviction counted", || {
        failures(&server, HandshakeFailure::Evicted) == 1
    });
    // The third, silent too, ends at the deadline.
    wait_closed(&mut third);
    wait_until("the timeout counted", || {
        failures(&server, HandshakeFailure::Timeout) == 1
    });
    // With both slots attached to the export, a new connection is refused at once.
    let c2 = Client::connect(&ep, &ClientOptions::default()).unwrap();
    let mut fourth = raw(&ep);
    wait_closed(&mut fourth);
    wait_until("the refusal counted", || m.server().refused_limit == 1);
    c2.disconnect().unwrap();
    wait_until("the second client gone", || m.server().open == 1);
    // Client flags with unknown bits: a protocol error.
    let mut bad = raw(&ep);
    let mut greeting = [0u8; 18];
    bad.read_exact(&mut greeting).unwrap();
    bad.write_all(&[0xff; 4]).unwrap();
    wait_closed(&mut bad);
    wait_until("the protocol error counted", || {
        failures(&server, HandshakeFailure::Protocol) == 1
    });

    c.write(0, &[1u8; 8192], CmdFlags::empty()).unwrap();
    c.read(0, 4096).unwrap();
    c.disconnect().unwrap();
    wait_until("every connection closed", || m.server().open == 0);
    let s = m.server();
    assert_eq!(s.accepted, 5, "{s:?}");
    assert_eq!(s.transmissions, 2, "{s:?}");
    assert_eq!(s.refused_limit, 1, "{s:?}");
    assert_eq!(s.requests, 4, "write, read, two disconnects: {s:?}");
    assert_eq!((s.bytes_written, s.bytes_read), (8192, 4096), "{s:?}");
    assert_eq!(s.requests_refused, 0, "{s:?}");
    assert_eq!(s.memory_used, 0, "{s:?}");
    assert!(s.memory_budget > 0, "{s:?}");
    assert_eq!(failures(&server, HandshakeFailure::Limit), 0);
    server.shutdown();
}

#[test]
fn the_server_counts_for_a_device_without_counters() {
    // A plain forwarder hides its queue (as a RAID1 mirror has none): the server must count.
    let hidden: Arc<dyn Device> = Arc::new(Forward::new(queue("mem:16M")));
    let (server, _dir, ep) = start(
        vec![
            Export::new("hidden", hidden),
            Export::new("queue", queue("mem:16M")),
        ],
        16,
    );
    for name in ["hidden", "queue"] {
        let opts = ClientOptions {
            export: name.into(),
            ..ClientOptions::default()
        };
        let mut c = Client::connect(&ep, &opts).unwrap();
        for i in 0..3u64 {
            c.write(i * 65536, &[9u8; 65536], CmdFlags::empty())
                .unwrap();
        }
        for i in 0..10u64 {
            c.read(i * 4096, 4096).unwrap();
        }
        c.flush().unwrap();
        c.trim(1 << 20, 1 << 20).unwrap();
        c.disconnect().unwrap();
    }
    let exports = server.metrics().exports();
    assert_eq!(exports.len(), 2);
    for e in &exports {
        let want = if e.name == "hidden" {
            StatsSource::Server
        } else {
            StatsSource::Device
        };
        assert_eq!(e.source, want, "{}", e.name);
        let d = &e.stats;
        assert_eq!(d.ios[0], 10, "{}: {d:?}", e.name);
        assert_eq!(d.sectors[0] * 512, 40960, "{}: {d:?}", e.name);
        assert_eq!(d.writes_completed(), 3, "{}: {d:?}", e.name);
        assert_eq!(d.sectors[1] * 512, 196608, "{}: {d:?}", e.name);
        assert_eq!(d.flush_ios, 1, "{}: {d:?}", e.name);
        assert_eq!(
            (d.discard_ios, d.discard_sectors),
            (1, 2048),
            "{}: {d:?}",
            e.name
        );
        assert_eq!(d.io_now(), 0, "{}: {d:?}", e.name);
        assert_eq!(d.errors, 0, "{}: {d:?}", e.name);
    }
    server.shutdown();
}
