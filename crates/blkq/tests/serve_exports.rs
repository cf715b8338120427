//! Exports added and removed while serving (issue 35 item 4), through the built binary:
//! `blkq export add|list|remove --control PATH` against a running `blkq serve`, a real client
//! (qemu-io) writing and reading an added export and failing once it is removed, a client
//! attached at removal closed after its requests, the removed export's file closed (added
//! again at once: its lock is free), and the errors named (a duplicate name, a mirror, an
//! unknown export).

mod common;

use std::path::Path;

use common::{fails, ok, qemu_io, Serving};
use nbd::client::{Client, ClientOptions, Endpoint};

const MIB: u64 = 1 << 20;

fn export(ctl: &Path, args: &[&str]) -> String {
    let mut a = vec!["export"];
    a.extend_from_slice(args);
    a.extend_from_slice(&["--control", ctl.to_str().unwrap()]);
    ok(&a)
}

fn export_fails(ctl: &Path, args: &[&str]) -> String {
    let mut a = vec!["export"];
    a.extend_from_slice(args);
    a.extend_from_slice(&["--control", ctl.to_str().unwrap()]);
    fails(&a)
}

/// `blkq export list --json`: (name, size, read-only, connections) of each export.
fn list(ctl: &Path) -> Vec<(String, u64, bool, u64)> {
    let v: serde_json::Value = serde_json::from_str(&export(ctl, &["list", "--json"])).unwrap();
    v["exports"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            (
                e["name"].as_str().unwrap().to_string(),
                e["size"].as_u64().unwrap(),
                e["read_only"].as_bool().unwrap(),
                e["connections"].as_u64().unwrap(),
            )
        })
        .collect()
}

#[test]
fn exports_are_added_served_listed_and_removed_while_serving() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let ctl = d.join("ctl.sock");
    let (s, addr) = Serving::with_metrics(
        d,
        "exports",
        &[
            "--device",
            "mem:1M",
            "--export",
            "a",
            "--control",
            ctl.to_str().unwrap(),
        ],
        |l| l.ready_when_exists(&ctl),
    );
    let metrics = || common::http_get(&addr, "/metrics").1;
    let (img, spec) = common::leg_file(d, "b.img", 4 * MIB);
    let m = export(&ctl, &["add", "b", &spec, "--description", "the b disk"]);
    assert!(m.contains("export \"b\" added: 4194304 bytes"), "{m}");
    export(&ctl, &["add", "ro", "mem:2M", "--read-only"]);
    assert_eq!(
        list(&ctl),
        [
            ("a".to_string(), MIB, false, 0),
            ("b".to_string(), 4 * MIB, false, 0),
            ("ro".to_string(), 2 * MIB, true, 0)
        ]
    );
    let human = export(&ctl, &["list"]);
    assert!(human.contains(&img.display().to_string()), "{human}");
    // Errors named.
    let e = export_fails(&ctl, &["add", "b", "mem:1M"]);
    assert!(e.contains("an export named \"b\" is served already"), "{e}");
    let e = export_fails(&ctl, &["add", "m", "raid1:file:/x,file:/y"]);
    assert!(e.contains("a mirror cannot be added while serving"), "{e}");
    let e = export_fails(&ctl, &["remove", "nope"]);
    assert!(e.contains("no export named \"nope\""), "{e}");

    // A real client writes and reads the added export.
    let uri = format!("nbd+unix:///b?socket={}", s.sock.display());
    let qemu = qemu_io(&uri, "write -P 0x5a 65536 65536");
    match &qemu {
        Some((ok, out)) => {
            assert!(ok, "{out}");
            let (ok, out) = qemu_io(&uri, "read -P 0x5a 65536 65536").unwrap();
            assert!(ok, "{out}");
        }
        None => eprintln!("skipped the qemu-io part: qemu-io is not installed"),
    }
    // Bitmaps: the added export has them as one given at start.
    let bm = ok(&[
        "bitmap",
        "add",
        "daily",
        "--export",
        "b",
        "--control",
        ctl.to_str().unwrap(),
    ]);
    assert!(bm.contains("\"daily\" added"), "{bm}");
    // The metrics count it: its disk counters and its bitmap.
    let m = metrics();
    assert!(
        m.contains("blkq_disk_reads_completed_total{export=\"b\"}"),
        "{m}"
    );
    assert!(
        m.contains("blkq_dirty_bitmap_bytes{export=\"b\",bitmap=\"daily\"}"),
        "{m}"
    );

    // A client attached at removal: closed after it; the name is gone for a new one.
    let opts = ClientOptions {
        export: "b".into(),
        ..ClientOptions::default()
    };
    let ep = Endpoint::Unix(s.sock.clone());
    let mut c = Client::connect(&ep, &opts).unwrap();
    c.write(0, &[7u8; 4096], nbd::codec::proto::CmdFlags::empty())
        .unwrap();
    assert_eq!(list(&ctl)[1].3, 1, "the attached client is counted");
    let m = export(&ctl, &["remove", "b", "--timeout", "5"]);
    assert!(
        m.contains("export \"b\" removed (1 connection(s) drained and closed, device flushed)"),
        "{m}"
    );
    assert!(
        c.read(0, 4096).is_err(),
        "the removed export's client stayed"
    );
    assert!(Client::connect(&ep, &opts).is_err());
    if qemu.is_some() {
        let (ok, out) = qemu_io(&uri, "read 0 4096").unwrap();
        assert!(!ok, "qemu-io read a removed export: {out}");
    }
    let names: Vec<String> = list(&ctl).into_iter().map(|e| e.0).collect();
    assert_eq!(names, ["a", "ro"]);
    let m = metrics();
    assert!(!m.contains("export=\"b\""), "{m}");
    // Written and flushed to the file, which is closed: it may be served again at once.
    let data = std::fs::read(&img).unwrap();
    assert_eq!(&data[..4096], &[7u8; 4096][..]);
    if qemu.is_some() {
        assert!(data[65536..131072].iter().all(|&b| b == 0x5a));
    }
    export(&ctl, &["add", "b", &spec]);
    assert_eq!(list(&ctl).len(), 3);
    // A read-only export has nothing to flush.
    let m = export(&ctl, &["remove", "ro"]);
    assert!(
        m.contains("\"ro\" removed (0 connection(s) drained and closed)"),
        "{m}"
    );
    drop(s);
}

#[test]
fn the_last_export_may_be_removed_and_the_server_stops_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let ctl = d.join("ctl.sock");
    let mut s = Serving::launch(
        d,
        "last",
        &[
            "--device",
            "mem:1M",
            "--export",
            "only",
            "--control",
            ctl.to_str().unwrap(),
        ],
        |l| l.ready_when_exists(&ctl),
    );
    export(&ctl, &["add", "added", "mem:1M"]);
    export(&ctl, &["remove", "only"]);
    export(&ctl, &["remove", "added"]);
    assert!(list(&ctl).is_empty());
    let ep = Endpoint::Unix(s.sock.clone());
    let mut h = nbd::client::Handshake::start(ep.connect().unwrap()).unwrap();
    assert!(h.list().unwrap().is_empty());
    // Served again once one is added.
    export(&ctl, &["add", "", "mem:1M"]);
    assert_eq!(list(&ctl)[0].0, "");
    let mut c = Client::connect(&ep, &ClientOptions::default()).unwrap();
    assert_eq!(c.read(0, 512).unwrap(), vec![0u8; 512]);
    drop(c);
    assert!(s.stop(std::time::Duration::from_secs(30)), "unclean stop");
}
