//! `nbd::remote::RemoteDevice::extents_into` from `NBD_CMD_BLOCK_STATUS`, checked against
//! what the device wrote and against `nbdinfo --map` on the same export (skipped when
//! nbdinfo or nbdkit is not installed).
// A plain threaded test, never a loom model: its own harness (std locks and atomics) is not
// what a model must explore, so it may use std::sync.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]
#![cfg(not(blkq_loom))]

mod common;

use blk::{Device, Extent};
use common::nbdkit::Kit;
use common::served::device;
use nbd::remote::RemoteDevice;
use nbd::server::{Export, Server, ServerConfig};
use testkit::io::write_at;
use testkit::pattern;

const MIB: u64 = 1 << 20;

/// `nbdinfo --map` of `uri` as extents (hole and zero together: unallocated), merged;
/// `None` when nbdinfo is not installed.
fn nbdinfo_map(uri: &str) -> Option<Vec<Extent>> {
    let out = match std::process::Command::new("nbdinfo")
        .args(["--map", uri])
        .output()
    {
        Ok(o) => o,
        Err(_) => {
            eprintln!("skipped the nbdinfo comparison: nbdinfo is not on PATH");
            return None;
        }
    };
    assert!(out.status.success(), "{out:?}");
    let mut v: Vec<Extent> = Vec::new();
    for line in String::from_utf8(out.stdout).unwrap().lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        let (offset, len, ty): (u64, u64, u32) = (
            f[0].parse().unwrap(),
            f[1].parse().unwrap(),
            f[2].parse().unwrap(),
        );
        let allocated = ty & 3 != 3;
        match v.last_mut() {
            Some(l) if l.allocated == allocated => l.len += len,
            _ => v.push(Extent {
                offset,
                len,
                allocated,
            }),
        }
    }
    Some(v)
}

/// Where the extents say `allocated`, as a sorted list of ranges.
fn allocated(ext: &[Extent]) -> Vec<(u64, u64)> {
    ext.iter()
        .filter(|e| e.allocated)
        .map(|e| (e.offset, e.len))
        .collect()
}

/// The extents tile `[offset, offset + len)` without gaps.
fn assert_tiles(ext: &[Extent], offset: u64, len: u64) {
    let mut at = offset;
    for e in ext {
        assert_eq!(e.offset, at, "{ext:?}");
        assert!(e.len > 0, "{ext:?}");
        at += e.len;
    }
    assert_eq!(at, offset + len, "{ext:?}");
}

#[test]
fn block_status_from_a_blkq_export_matches_nbdinfo() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("nbd.sock");
    let mut cfg = ServerConfig::new(vec![Export::new("", device("mem:64M"))]);
    cfg.unix = Some(path.clone());
    let server = Server::start(cfg).unwrap();
    let uri = format!("nbd+unix:///?socket={}", path.display());
    let dev = RemoteDevice::open(&uri).unwrap();
    write_at(&dev, MIB, &pattern(1, 64 << 10)).unwrap();
    write_at(&dev, 8 * MIB, &pattern(2, 4096)).unwrap();
    let ext = dev.extents(0, 64 * MIB, 1000).unwrap();
    assert_tiles(&ext, 0, 64 * MIB);
    let alloc = allocated(&ext);
    // What was written is allocated, and not much more (the mem device's granularity).
    assert_eq!(alloc.len(), 2, "{ext:?}");
    assert!(alloc[0].0 <= MIB && alloc[0].0 + alloc[0].1 >= MIB + (64 << 10));
    assert!(alloc[1].0 <= 8 * MIB && alloc[1].0 + alloc[1].1 >= 8 * MIB + 4096);
    assert!(alloc.iter().map(|a| a.1).sum::<u64>() <= 4 * MIB, "{ext:?}");
    if let Some(map) = nbdinfo_map(&uri) {
        assert_eq!(ext, map);
    }
    // A window in the middle, clipped to it.
    let part = dev.extents(MIB + 4096, 8 * MIB, 1000).unwrap();
    assert_tiles(&part, MIB + 4096, 8 * MIB);
    assert!(part[0].allocated);
    // At most `max`.
    let two = dev.extents(0, 64 * MIB, 2).unwrap();
    assert_eq!(two.len(), 2);
    assert_eq!(two[..], ext[..2]);
    // Past the end: refused.
    assert!(dev.extents(60 * MIB, 8 * MIB, 10).is_err());
    drop(dev);
    server.shutdown();
}

/// nbdkit's data plugin with data at known places and holes between: the same map as
/// nbdinfo's, and more extents than one query's worth of descriptors.
#[test]
fn block_status_from_nbdkit_matches_nbdinfo() {
    let dir = tempfile::tempdir().unwrap();
    // 2000 runs of 4 KiB of data every 64 KiB: 4000 extents, more than one query holds.
    let data = "( 1 * 4096 @^65536 ) * 2000";
    let Some(kit) = Kit::start(dir.path(), &["data", data, "size=131072000"]) else {
        return;
    };
    let dev = RemoteDevice::open(&kit.uri("")).unwrap();
    let cap = dev.limits().capacity;
    let ext = dev.extents(0, cap, 10_000).unwrap();
    assert_tiles(&ext, 0, cap);
    let alloc = allocated(&ext);
    assert_eq!(alloc.len(), 2000, "{:?}", &ext[..8]);
    // The plugin allocates whole pages (32 KiB): each run covers its 4 KiB of data.
    for (k, a) in alloc.iter().enumerate() {
        assert_eq!(a.0, k as u64 * 65536, "{a:?}");
        assert!(a.1 >= 4096 && a.1 < 65536, "{a:?}");
    }
    if let Some(map) = nbdinfo_map(&kit.uri("")) {
        assert_eq!(ext, map);
    }
}

/// A server without structured replies has no block status: everything is allocated.
#[test]
fn without_block_status_everything_is_allocated() {
    let dir = tempfile::tempdir().unwrap();
    let Some(kit) = Kit::start(dir.path(), &["--no-sr", "memory", "16M"]) else {
        return;
    };
    let dev = RemoteDevice::open(&kit.uri("")).unwrap();
    let ext = dev.extents(0, 16 * MIB, 100).unwrap();
    assert_eq!(
        ext,
        vec![Extent {
            offset: 0,
            len: 16 * MIB,
            allocated: true
        }]
    );
}
