//! Which large reads are spliced (`server/conn/splice_rule.rs`): per connection, the server
//! starts splicing, then copies for a while to compare, then keeps the faster way. The bytes
//! must be the device's whichever way a read goes and across the switches, over Unix and TCP,
//! in every reply mode; `--splice-rule always` splices every large read.
// A plain threaded test, never a loom model.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]
#![cfg(not(blkq_loom))]

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use blk::{Device, Op};
use blk_drivers::spec::{DeviceSpec, QueueOverrides};
use common::modes;
use nbd::client::{Client, ClientOptions, Endpoint};
use nbd::codec::transmission::Request;
use nbd::codec::{CmdFlags, Command};
use nbd::server::{Export, Server, ServerConfig, SpliceRule};
use testkit::{pattern, Forward, Hook};

const MIB: u64 = 1 << 20;
/// The export's written size: every read below is of data.
const DATA: u64 = 16 * MIB;

/// Counts the large reads that went each way: by splice (`splice_read` calls at a read's
/// first byte) or by a bio (read bios of 64 KiB and more). Relaxed: counters read after the
/// connection is closed and the server stopped.
#[derive(Default)]
struct Ways {
    spliced: AtomicU64,
    copied: AtomicU64,
}

struct Counting(Arc<Ways>);

impl Hook for Counting {
    fn transparent(&self) -> bool {
        true
    }
    fn submit_batch(
        &self,
        inner: &dyn Device,
        bios: &mut dyn Iterator<Item = blk::Bio>,
        end: &Arc<dyn blk::EndIo>,
    ) {
        let ways = &self.0;
        let mut counted = bios.inspect(|b| {
            if b.op == Op::Read && b.len >= 64 << 10 {
                ways.copied.fetch_add(1, Ordering::Relaxed);
            }
        });
        inner.submit_batch(&mut counted, end)
    }
    fn splice_read(
        &self,
        inner: &dyn Device,
        offset: u64,
        len: usize,
        pipe: std::os::fd::BorrowedFd<'_>,
    ) -> Result<usize, blk::Error> {
        // A reply of a 1 MiB aligned read is filled at once; count each read once, at its
        // start (the reads below are all MiB-aligned).
        if offset.is_multiple_of(MIB) {
            self.0.spliced.fetch_add(1, Ordering::Relaxed);
        }
        inner.splice_read(offset, len, pipe)
    }
}

fn mem(spec: &str) -> Arc<dyn Device> {
    let s: DeviceSpec = spec.parse().unwrap();
    Arc::new(s.build(&QueueOverrides::default()).unwrap())
}

/// A server of one counted `mem:` export with `rule`, on a Unix socket and TCP, its first
/// `DATA` bytes written with `data`.
fn serve(rule: SpliceRule, data: &[u8]) -> (Server, Vec<Endpoint>, Arc<Ways>, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("nbd.sock");
    let ways = Arc::new(Ways::default());
    let dev: Arc<dyn Device> = Arc::new(Forward::with_hook(mem("mem:64M"), Counting(ways.clone())));
    let mut cfg = ServerConfig::new(vec![Export::new("", dev)]);
    cfg.unix = Some(sock.clone());
    cfg.tcp = Some("127.0.0.1:0".parse().unwrap());
    cfg.tuning.splice_rule = rule;
    let server = Server::start(cfg).unwrap();
    let tcp = Endpoint::Tcp(server.tcp_addr().unwrap());
    let unix = Endpoint::Unix(sock);
    let mut c = Client::connect(&unix, &ClientOptions::default()).unwrap();
    for (i, chunk) in data.chunks(MIB as usize).enumerate() {
        c.write(i as u64 * MIB, chunk, CmdFlags::empty()).unwrap();
    }
    c.disconnect().unwrap();
    (server, vec![unix, tcp], ways, dir)
}

/// Reads `n` MiB-aligned 1 MiB reads over the data, `qd` in flight, and checks every byte.
fn read_all(c: &mut Client, data: &[u8], n: u64, qd: usize, what: &str) {
    let mut want = HashMap::new();
    let mut sent = 0u64;
    while sent < n || !want.is_empty() {
        while sent < n && want.len() < qd {
            // A stride that visits every MiB of the data in a shuffled order.
            let off = (sent * 5 % (DATA / MIB)) * MIB;
            let cookie = c
                .send(Request::new(Command::Read, 0, off, MIB), &[])
                .unwrap();
            want.insert(cookie, off);
            sent += 1;
        }
        let r = c.recv().unwrap();
        let off = want.remove(&r.cookie).expect("unknown cookie");
        assert_eq!(r.error, 0, "{what}: read at {off}");
        let at = off as usize;
        assert!(
            r.data[..] == data[at..at + MIB as usize],
            "{what}: the read at {off} differs (first differing byte at {:?})",
            r.data.iter().zip(&data[at..]).position(|(a, b)| a != b)
        );
    }
}

#[test]
fn reads_are_the_device_bytes_whichever_way_the_rule_sends_them() {
    let data = pattern(7, DATA as usize);
    let (server, eps, ways, _dir) = serve(SpliceRule::Measure, &data);
    for ep in &eps {
        for (name, opts) in modes() {
            let before = (
                ways.spliced.load(Ordering::Relaxed),
                ways.copied.load(Ordering::Relaxed),
            );
            let mut c = Client::connect(ep, &opts).unwrap();
            // The probe alternates windows of at least 8 MiB and 10 ms between the two
            // ways, the first spliced; a pause of the test's own (a loaded machine) restarts
            // a window, so batches of 64 reads go on until both ways have had a whole window
            // (9 reads: the one that opens it and 8 MiB), up to a bound.
            let mut batches = 0;
            loop {
                read_all(&mut c, &data, 64, 4, &format!("{ep:?} {name}"));
                batches += 1;
                let spliced = ways.spliced.load(Ordering::Relaxed) - before.0;
                let copied = ways.copied.load(Ordering::Relaxed) - before.1;
                if (spliced >= 9 && copied >= 9) || batches == 32 {
                    break;
                }
            }
            c.disconnect().unwrap();
            let spliced = ways.spliced.load(Ordering::Relaxed) - before.0;
            let copied = ways.copied.load(Ordering::Relaxed) - before.1;
            assert_eq!(
                spliced + copied,
                64 * batches,
                "{ep:?} {name}: every read went one way"
            );
            assert!(
                spliced >= 9,
                "{ep:?} {name}: {spliced} spliced, fewer than a window"
            );
            assert!(
                copied >= 9,
                "{ep:?} {name}: {copied} copied, fewer than a window"
            );
        }
    }
    server.shutdown();
}

#[test]
fn always_splices_every_large_read() {
    let data = pattern(8, DATA as usize);
    let (server, eps, ways, _dir) = serve(SpliceRule::Always, &data);
    for ep in &eps {
        let mut c = Client::connect(ep, &ClientOptions::default()).unwrap();
        read_all(&mut c, &data, 64, 4, &format!("{ep:?}"));
        c.disconnect().unwrap();
    }
    server.shutdown();
    assert_eq!(ways.spliced.load(Ordering::Relaxed), 128);
    assert_eq!(ways.copied.load(Ordering::Relaxed), 0);
}
