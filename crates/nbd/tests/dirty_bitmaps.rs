//! Dirty bitmaps over NBD (`qemu:dirty-bitmap:NAME`): what `NBD_OPT_LIST_META_CONTEXT` and
//! `NBD_OPT_SET_META_CONTEXT` answer for an export whose device keeps bitmaps, and what
//! `NBD_CMD_BLOCK_STATUS` answers for them, alone or beside `base:allocation`, with 32-bit and
//! 64-bit descriptors and with `REQ_ONE`; a bitmap removed under a connection fails that
//! connection's requests for it and nothing else.
//!
//! The device is changed-block tracking (`cbt::Tracked`, bitmaps in memory, 64 KiB granules;
//! `common::tracking`) over a memory device: its writes, trims and zeroes mark the granules
//! they touch in every recording bitmap.
// A plain threaded test, never a loom model: its harness may use std::sync.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]
#![cfg(not(blkq_loom))]

mod common;

use common::served::{device, Running};
use common::tracking::{tracked, GRAIN};
use nbd::client::{Client, ClientError, ClientOptions, Endpoint};
use nbd::codec::proto::*;
use nbd::codec::CmdFlags;
use nbd::server::Export;
use testkit::pattern;

const MIB: u64 = 1 << 20;
const BASE: &str = "base:allocation";

fn start(exports: Vec<Export>) -> Running {
    Running::start(exports, |_| {})
}

/// A client of `export` with extended headers or not, asking for the metadata `contexts`.
fn client(t: &Running, export: &str, extended: bool, contexts: &[&str]) -> Client {
    t.connect(&ClientOptions {
        export: export.into(),
        extended,
        base_allocation: false,
        contexts: contexts.iter().map(|c| c.to_string()).collect(),
        ..ClientOptions::default()
    })
}

fn names(v: Vec<(u32, String)>) -> Vec<String> {
    v.into_iter().map(|(_, n)| n).collect()
}

/// One flag per granule of `[offset, offset + len)` from `extents` (which must cover it
/// exactly, contiguously, in granule multiples): bit 0 of each extent's flags.
fn per_granule(extents: &[(u64, u64)], len: u64) -> Vec<bool> {
    let mut out = Vec::new();
    for &(l, flags) in extents {
        assert!(l > 0 && l.is_multiple_of(GRAIN), "extent of {l} bytes");
        out.extend(std::iter::repeat_n(flags & 1 == 1, (l / GRAIN) as usize));
    }
    assert_eq!(out.len() as u64, len / GRAIN, "extents {extents:?}");
    out
}

fn dirty_at(len: u64, granules: &[u64]) -> Vec<bool> {
    let mut v = vec![false; (len / GRAIN) as usize];
    for g in granules {
        v[*g as usize] = true;
    }
    v
}

#[test]
fn list_and_set_meta_context_name_every_bitmap() {
    let dev = tracked("mem:64M", &["daily", "weekly"]);
    let t = start(vec![
        Export::new("", dev.clone()),
        Export::new("plain", device("mem:16M")),
    ]);
    let mut h = t.handshake();
    let all = vec![
        BASE.to_string(),
        "qemu:dirty-bitmap:daily".to_string(),
        "qemu:dirty-bitmap:weekly".to_string(),
    ];
    // No query: every context of the export, with id 0 (LIST gives no ids).
    let listed = h.meta_context("", &[], false).unwrap();
    assert!(listed.iter().all(|(id, _)| *id == 0));
    assert_eq!(names(listed), all);
    // The bitmap namespace and the qemu namespace: every bitmap; a whole name: that one.
    for q in ["qemu:dirty-bitmap:", "qemu:"] {
        assert_eq!(names(h.meta_context("", &[q], false).unwrap()), all[1..]);
    }
    assert_eq!(
        names(
            h.meta_context(
                "",
                &["qemu:dirty-bitmap:weekly", "qemu:dirty-bitmap:nope"],
                false
            )
            .unwrap()
        ),
        all[2..]
    );
    // Each context once, however many queries name it.
    assert_eq!(
        names(
            h.meta_context("", &["qemu:", "qemu:dirty-bitmap:daily", "base:"], false)
                .unwrap()
        ),
        all
    );
    // An export without bitmaps lists base:allocation alone.
    assert_eq!(
        names(h.meta_context("plain", &[], false).unwrap()),
        all[..1]
    );

    // SET selects whole names only, each once, with distinct non-zero ids.
    h.structured_replies().unwrap();
    assert!(h
        .meta_context(
            "",
            &["qemu:dirty-bitmap:", "qemu:", "qemu:dirty-bitmap:x"],
            true
        )
        .unwrap()
        .is_empty());
    let set = h
        .meta_context(
            "",
            &[
                "qemu:dirty-bitmap:weekly",
                BASE,
                "qemu:dirty-bitmap:weekly",
                "qemu:dirty-bitmap:daily",
            ],
            true,
        )
        .unwrap();
    let mut ids: Vec<u32> = set.iter().map(|(id, _)| *id).collect();
    assert!(ids.iter().all(|id| *id != 0));
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 3, "{set:?}");
    let mut got = names(set);
    got.sort();
    assert_eq!(got, all);
    // And a block status then answers each of them.
    let d = h.go("").unwrap();
    let mut c = h.into_client(d).unwrap();
    let status = c.block_status_all(0, MIB, CmdFlags::empty()).unwrap();
    let mut answered: Vec<String> = status.into_iter().map(|(n, _)| n).collect();
    answered.sort();
    assert_eq!(answered, all);
    c.disconnect().unwrap();
}

#[test]
fn block_status_reports_the_writes_in_both_descriptor_forms() {
    let dev = tracked("mem:64M", &["a", "b"]);
    let t = start(vec![Export::new("", dev.clone())]);
    let size = 64 * MIB;
    for extended in [false, true] {
        for name in ["a", "b"] {
            dev.bitmaps().clear(name).unwrap();
        }
        let ctx = [BASE, "qemu:dirty-bitmap:a", "qemu:dirty-bitmap:b"];
        let mut c = client(&t, "", extended, &ctx);
        // Nothing written yet: clean everywhere.
        for (name, extents) in c.block_status_all(0, size, CmdFlags::empty()).unwrap() {
            if name != BASE {
                assert_eq!(per_granule(&extents, size), dirty_at(size, &[]), "{name}");
            }
        }
        // A write inside granule 3, one across granules 10 and 11, a trim of 12, zeroes at
        // the last granule.
        c.write(3 * GRAIN + 4096, &pattern(1, 4096), CmdFlags::empty())
            .unwrap();
        c.write(11 * GRAIN - 4096, &pattern(2, 8192), CmdFlags::empty())
            .unwrap();
        c.trim(12 * GRAIN, GRAIN).unwrap();
        c.write_zeroes(size - 4096, 4096, CmdFlags::empty())
            .unwrap();
        let last = size / GRAIN - 1;
        let want = dirty_at(size, &[3, 10, 11, 12, last]);
        let status = c.block_status_all(0, size, CmdFlags::empty()).unwrap();
        // One chunk per context, in the order of the ids the handshake gave.
        let order: Vec<&str> = status.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(order, ctx, "extended {extended}");
        for (name, extents) in &status[1..] {
            assert_eq!(
                per_granule(extents, size),
                want,
                "{name}, extended {extended}"
            );
        }
        // base:allocation in the same reply: the written granules are data.
        let base = &status[0].1;
        let mut at = 0;
        let mut data_at_3 = false;
        for &(len, flags) in base {
            if (at..at + len).contains(&(3 * GRAIN + 4096)) {
                data_at_3 = flags & u64::from(NBD_STATE_HOLE) == 0;
            }
            at += len;
        }
        assert!(data_at_3, "base:allocation {base:?}");
        // Clearing one bitmap leaves the other.
        dev.bitmaps().clear("b").unwrap();
        let status = c.block_status_all(0, size, CmdFlags::empty()).unwrap();
        assert_eq!(per_granule(&status[1].1, size), want);
        assert_eq!(per_granule(&status[2].1, size), dirty_at(size, &[]));
        // A range that starts mid-run: the first extent starts at the request's offset.
        let part = c
            .block_status_all(2 * GRAIN, 2 * GRAIN, CmdFlags::empty())
            .unwrap();
        assert_eq!(
            part[1].1,
            vec![(GRAIN, 0), (GRAIN, u64::from(NBD_STATE_DIRTY))]
        );
        // REQ_ONE: exactly one extent for every context, starting at the offset.
        let one = c
            .block_status_all(3 * GRAIN, size - 3 * GRAIN, CmdFlags::REQ_ONE)
            .unwrap();
        assert_eq!(one.len(), 3);
        for (name, extents) in &one {
            assert_eq!(extents.len(), 1, "{name}: {extents:?}");
        }
        assert_eq!(one[1].1, vec![(GRAIN, u64::from(NBD_STATE_DIRTY))]);
        assert_eq!(one[2].1[0].1, 0);
        c.disconnect().unwrap();
    }
}

#[test]
fn a_bitmap_alone_is_enough_for_block_status() {
    // As qemu's reader negotiates it (x-dirty-bitmap): the bitmap, without base:allocation.
    let dev = tracked("mem:16M", &["only"]);
    let t = start(vec![Export::new("", dev.clone())]);
    for extended in [false, true] {
        dev.bitmaps().clear("only").unwrap();
        let mut c = client(&t, "", extended, &["qemu:dirty-bitmap:only"]);
        assert_eq!(c.contexts().len(), 1);
        c.write(5 * GRAIN, &pattern(3, 512), CmdFlags::empty())
            .unwrap();
        let status = c.block_status_all(0, 16 * MIB, CmdFlags::empty()).unwrap();
        assert_eq!(status.len(), 1);
        assert_eq!(status[0].0, "qemu:dirty-bitmap:only");
        assert_eq!(
            per_granule(&status[0].1, 16 * MIB),
            dirty_at(16 * MIB, &[5])
        );
        c.disconnect().unwrap();
    }
}

#[test]
fn a_run_longer_than_32_bits_needs_extended_headers() {
    // 8 GiB, all clean: one run. Compact requests are at most 4 GiB - 1, and their one
    // descriptor covers the request; an extended request covers the whole run in one.
    let dev = tracked("null:8G", &["big"]);
    let t = start(vec![Export::new("", dev)]);
    let size = 8u64 << 30;
    let mut c = client(&t, "", false, &["qemu:dirty-bitmap:big"]);
    let most = u64::from(u32::MAX) / 4096 * 4096;
    let status = c.block_status_all(4096, most, CmdFlags::empty()).unwrap();
    assert_eq!(status[0].1, vec![(most, 0)]);
    c.disconnect().unwrap();
    let mut c = client(&t, "", true, &["qemu:dirty-bitmap:big"]);
    let status = c.block_status_all(0, size, CmdFlags::empty()).unwrap();
    assert_eq!(status[0].1, vec![(size, 0)]);
    c.disconnect().unwrap();
}

#[test]
fn a_removed_bitmap_fails_its_requests_and_the_connection_goes_on() {
    let dev = tracked("mem:16M", &["gone", "kept"]);
    let t = start(vec![Export::new("", dev.clone())]);
    let mut both = client(
        &t,
        "",
        true,
        &["qemu:dirty-bitmap:gone", "qemu:dirty-bitmap:kept"],
    );
    let mut kept = client(&t, "", false, &[BASE, "qemu:dirty-bitmap:kept"]);
    both.write(0, &pattern(4, 4096), CmdFlags::empty()).unwrap();
    assert_eq!(
        both.block_status_all(0, MIB, CmdFlags::empty())
            .unwrap()
            .len(),
        2
    );
    dev.bitmaps().remove("gone").unwrap();
    match both.block_status_all(0, MIB, CmdFlags::empty()) {
        Err(ClientError::Request(e)) => assert_eq!(e, NBD_EINVAL),
        other => panic!("block status of a removed bitmap: {other:?}"),
    }
    // The same connection still reads and writes.
    both.write(GRAIN, &pattern(5, 4096), CmdFlags::empty())
        .unwrap();
    assert_eq!(both.read(GRAIN, 4096).unwrap(), pattern(5, 4096));
    both.disconnect().unwrap();
    // A connection that did not select it is untouched.
    let status = kept.block_status_all(0, MIB, CmdFlags::empty()).unwrap();
    assert_eq!(per_granule(&status[1].1, MIB), dirty_at(MIB, &[0, 1]));
    kept.disconnect().unwrap();
    // And a new handshake no longer offers it.
    let mut h = t.handshake();
    assert_eq!(
        names(h.meta_context("", &["qemu:"], false).unwrap()),
        vec!["qemu:dirty-bitmap:kept".to_string()]
    );
}

/// Runs a client nobody here wrote; `None` (the check skipped, said on stderr) when it is not
/// installed.
fn run_client(program: &str, args: &[&str]) -> Option<String> {
    let out = match std::process::Command::new(program).args(args).output() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("skipped the {program} check: {e}");
            return None;
        }
    };
    assert!(out.status.success(), "{program} {args:?}: {out:?}");
    Some(String::from_utf8(out.stdout).unwrap())
}

/// Dirty granules of `size` bytes from (offset, length, dirty) runs, which must tile it.
fn granules_of(runs: &[(u64, u64, bool)], size: u64) -> Vec<bool> {
    let mut at = 0;
    let mut out = Vec::new();
    for &(offset, len, dirty) in runs {
        assert_eq!(offset, at, "{runs:?}");
        assert!(len.is_multiple_of(GRAIN), "{runs:?}");
        out.extend(std::iter::repeat_n(dirty, (len / GRAIN) as usize));
        at += len;
    }
    assert_eq!(at, size, "{runs:?}");
    out
}

#[test]
fn real_clients_read_the_writes_from_the_bitmap() {
    let dev = tracked("mem:64M", &["backup"]);
    let t = start(vec![Export::new("", dev.clone())]);
    let Endpoint::Unix(sock) = &t.ep else {
        unreachable!()
    };
    let sock = sock.to_str().unwrap();
    let size = 64 * MIB;
    // Writes of every shape: inside a granule, across two, a whole run of them, the last.
    let mut c = client(&t, "", false, &[]);
    let mut touched = Vec::new();
    for (i, (offset, len)) in [
        (4096, 512),
        (7 * GRAIN - 4096, 8192),
        (20 * GRAIN, 10 * GRAIN),
        (size - GRAIN, GRAIN),
    ]
    .into_iter()
    .enumerate()
    {
        c.write(offset, &pattern(i as u64, len as usize), CmdFlags::empty())
            .unwrap();
        touched.extend(offset / GRAIN..=(offset + len - 1) / GRAIN);
    }
    c.disconnect().unwrap();
    let want = dirty_at(size, &touched);
    let context = "qemu:dirty-bitmap:backup";
    let uri = format!("nbd+unix:///?socket={sock}");

    // nbdinfo --map: "OFFSET LENGTH TYPE DESCRIPTION", type bit 0 dirty.
    if let Some(out) = run_client("nbdinfo", &[&format!("--map={context}"), &uri]) {
        let runs: Vec<(u64, u64, bool)> = out
            .lines()
            .map(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                let ty: u32 = f[2].parse().unwrap();
                (f[0].parse().unwrap(), f[1].parse().unwrap(), ty & 1 == 1)
            })
            .collect();
        assert_eq!(granules_of(&runs, size), want, "nbdinfo:\n{out}");
    }

    // qemu's own reader: with x-dirty-bitmap, a dirty extent reads as `"data": false`.
    let opts = format!("driver=nbd,server.type=unix,server.path={sock},x-dirty-bitmap={context}");
    let qemu = ["map", "--output=json", "--image-opts", &opts];
    if let Some(out) = run_client("qemu-img", &qemu) {
        let field = |l: &str, k: &str| -> String {
            let at = l.find(&format!("\"{k}\": ")).unwrap() + k.len() + 4;
            l[at..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric())
                .collect()
        };
        let runs: Vec<(u64, u64, bool)> = out
            .lines()
            .filter(|l| l.contains("\"start\""))
            .map(|l| {
                let data = field(l, "data");
                (
                    field(l, "start").parse().unwrap(),
                    field(l, "length").parse().unwrap(),
                    data == "false",
                )
            })
            .collect();
        assert_eq!(granules_of(&runs, size), want, "qemu-img map:\n{out}");
    }

    // libnbd's block_status (Python), through the backup script's map: dirty runs only.
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../../scripts/cbt-backup.py");
    if let Some(out) = run_client(script, &["--bitmap", "backup", "--map", &uri]) {
        let mut runs = Vec::new();
        let mut at = 0;
        for l in out.lines() {
            let f: Vec<u64> = l.split_whitespace().map(|v| v.parse().unwrap()).collect();
            if f[0] > at {
                runs.push((at, f[0] - at, false));
            }
            runs.push((f[0], f[1], true));
            at = f[0] + f[1];
        }
        if at < size {
            runs.push((at, size - at, false));
        }
        assert_eq!(granules_of(&runs, size), want, "libnbd:\n{out}");
    }
}
