//! Nothing acknowledged is lost by `blkq serve --raid1`: a leg failed in the middle of a
//! write load, and the server killed with SIGKILL. The built binary, file legs in a tempdir,
//! `nbd::client` for I/O; bounded waits only (no timing assertions).
// A plain threaded test, never a loom model: the load thread's progress counter is harness
// state, so it may use std::sync.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]

mod common;
use common::*;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nbd::codec::proto::CmdFlags;

const LEG_SIZE: u64 = 64 << 20;
/// Bitmap bits stay set for the whole test (no clearing behind its back).
const QUIET: &str = "bitmap_quiet_ms=600000";

fn leg(dir: &Path, name: &str) -> (PathBuf, String) {
    leg_file(dir, name, LEG_SIZE)
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed as u8) ^ (seed >> 8) as u8 | 1)
        .collect()
}

/// The i-th write of a load: distinct 64 KiB-aligned offsets inside the first 4 MiB (a few
/// bitmap chunks), 4 KiB to 64 KiB long.
fn nth_write(i: u64) -> (u64, Vec<u8>) {
    (i * (64 << 10), pattern(i, 4096 * (1 + (i % 16) as usize)))
}

/// The sync of `v` (`raid status --json`) copied some chunks, and no more than the `dirty`
/// ones (`what`: the sync's verb in the message).
fn assert_copied_some_of(v: &serde_json::Value, dirty: u64, what: &str) {
    let copied = v["sync"]["chunks_copied"].as_u64().unwrap();
    assert!(
        copied > 0 && copied <= dirty,
        "{what} {copied} of {dirty} dirty: {v}"
    );
}

#[test]
fn leg_failed_mid_load_loses_nothing_and_recovers() {
    let d = tempfile::tempdir().unwrap();
    let ((pa, a), (pb, b)) = (leg(d.path(), "a.img"), leg(d.path(), "b.img"));
    let mut s = Server::start(
        d.path(),
        &format!("{a},{b}"),
        // New sparse legs; the bits the load sets are what the re-add must copy.
        &common::create_clean(&["bitmap_chunk=1M", QUIET]),
    );
    // The load runs before, during and after the `fail 1`: at least N writes, and at least
    // AFTER more once the fail was acknowledged (MAX writes at most: 32 MiB of offsets).
    const N: u64 = 64;
    const AFTER: u64 = 16;
    const MAX: u64 = 512;
    let acked = Arc::new(AtomicUsize::new(0));
    let failed_at = Arc::new(AtomicUsize::new(usize::MAX));
    let load = {
        let (acked, failed_at, mut cl) = (acked.clone(), failed_at.clone(), s.client());
        std::thread::spawn(move || {
            let mut i = 0u64;
            loop {
                let f = failed_at.load(Ordering::Acquire) as u64;
                if i >= N && f != usize::MAX as u64 && i >= f + AFTER {
                    return i;
                }
                assert!(i < MAX, "the fail never came");
                let (off, data) = nth_write(i);
                cl.write(off, &data, CmdFlags::empty()).unwrap();
                i += 1;
                acked.store(i as usize, Ordering::Release);
            }
        })
    };
    // Mid-load: fail leg 1 once some writes are acknowledged.
    let t0 = Instant::now();
    while acked.load(Ordering::Acquire) < (N / 4) as usize {
        assert!(t0.elapsed() < Duration::from_secs(60), "load stuck");
        std::thread::sleep(Duration::from_millis(1));
    }
    let m = ok(&["raid", "fail", "1", "--control", s.ctl()]);
    assert!(m.contains("faulty"), "{m}");
    failed_at.store(acked.load(Ordering::Acquire), Ordering::Release);
    let n = load.join().unwrap();
    let check_all = |s: &Server| {
        let mut cl = s.client();
        for i in 0..n {
            let (off, data) = nth_write(i);
            assert!(
                cl.read(off, data.len() as u64).unwrap() == data,
                "write {i} lost"
            );
        }
    };
    check_all(&s);
    let v = s.status_json();
    let dirty = v["bitmap"]["dirty"].as_u64().unwrap();
    let chunks = v["bitmap"]["chunks"].as_u64().unwrap();
    assert!(dirty > 0 && dirty < chunks, "writes confined: {v}");
    ok(&["raid", "remove", "1", "--control", s.ctl()]);
    ok(&["raid", "add", &b, "--control", s.ctl()]);
    let v = s.wait_for(
        &|v| legs_in_sync(v) == 2 && v["sync"]["action"] == "idle",
        "no [UU] after the re-add",
    );
    // The re-add is a bitmap recovery: it copied the chunks written while the leg was out,
    // never more than were dirty, never the whole array.
    assert_copied_some_of(&v, dirty, "copied");
    let (doff, cap) = geometry(&v);
    check_all(&s);
    assert!(s.stop(), "serve did not exit cleanly");
    assert_leg_files_equal(&pa, &pb, doff, cap);
}

#[test]
fn sigkill_mid_load_keeps_flushed_and_fua_writes() {
    let d = tempfile::tempdir().unwrap();
    let ((pa, a), (pb, b)) = (leg(d.path(), "a.img"), leg(d.path(), "b.img"));
    let legs = format!("{a},{b}");
    let mut s = Server::start(
        d.path(),
        &legs,
        // Blank legs, and the test is about what the bitmap holds after a kill: no
        // initial resync setting every bit.
        &common::create_clean(&["bitmap_chunk=1M", QUIET]),
    );
    // Durable before the kill: writes followed by a FLUSH, and FUA writes.
    let mut durable = Vec::new();
    {
        let mut cl = s.client();
        for i in 0..16 {
            let (off, data) = nth_write(i);
            cl.write(off, &data, CmdFlags::empty()).unwrap();
            durable.push((off, data));
        }
        cl.flush().unwrap();
        for i in 16..32 {
            let (off, data) = nth_write(i);
            cl.write(off, &data, CmdFlags::FUA).unwrap();
            durable.push((off, data));
        }
        // Not flushed: may or may not survive, but the legs must agree after the resync.
        for i in 32..48 {
            let (off, data) = nth_write(i);
            cl.write(off, &data, CmdFlags::empty()).unwrap();
        }
    }
    let v = s.status_json();
    let dirty = v["bitmap"]["dirty"].as_u64().unwrap();
    let chunks = v["bitmap"]["chunks"].as_u64().unwrap();
    assert!(dirty > 0 && dirty < chunks, "writes confined: {v}");
    s.kill();
    drop(s);
    let mut s = Server::start(d.path(), &legs, &["--raid1-option", QUIET]);
    let v = s.wait_for(
        &|v| {
            legs_in_sync(v) == 2
                && v["sync"]["action"] == "idle"
                // Bits clear only once the resync copied their chunks (quiet time: QUIET).
                && v["bitmap"]["dirty"] == 0
        },
        "resync did not finish",
    );
    // After the unclean stop only the dirty chunks were resynced.
    assert_copied_some_of(&v, dirty, "resynced");
    let (doff, cap) = geometry(&v);
    {
        let mut cl = s.client();
        for (i, (off, data)) in durable.iter().enumerate() {
            assert!(
                cl.read(*off, data.len() as u64).unwrap() == *data,
                "durable write {i} lost"
            );
        }
    }
    assert!(s.stop(), "serve did not exit cleanly");
    assert_leg_files_equal(&pa, &pb, doff, cap);
}
