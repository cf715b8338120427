//! Dirty bitmaps on `blkq serve` (changed-block tracking), through the built binary: `blkq
//! bitmap add|list|rotate|clear|remove|disable|enable|merge --control PATH` against a running server, with the
//! errors named (duplicate name, unknown bitmap or export, bad granularity); a server killed
//! with SIGKILL under writes from a real client (qemu-io) leaves a sidecar in which every
//! acknowledged write's granule is dirty, and serves it again; a torn sidecar stops the
//! server with its path named, and `--bitmaps-reset` starts it with every bit dirty.

mod common;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::{fails, fails_within, ok, Serving};
use nbd::codec::proto::CmdFlags;

const MIB: u64 = 1 << 20;

fn serve_file(dir: &Path, name: &str, img: &Path, extra: &[&str]) -> Serving {
    let spec = format!("file:{}", img.display());
    let ctl = dir.join("ctl.sock");
    let _ = std::fs::remove_file(&ctl);
    let mut args = vec!["--device", &spec, "--control", ctl.to_str().unwrap()];
    args.extend_from_slice(extra);
    Serving::launch(dir, name, &args, |l| l.ready_when_exists(&ctl))
}

fn bitmap(dir: &Path, args: &[&str]) -> String {
    let ctl = dir.join("ctl.sock");
    let mut a = vec!["bitmap"];
    a.extend_from_slice(args);
    a.extend_from_slice(&["--control", ctl.to_str().unwrap()]);
    ok(&a)
}

fn bitmap_fails(dir: &Path, args: &[&str]) -> String {
    let ctl = dir.join("ctl.sock");
    let mut a = vec!["bitmap"];
    a.extend_from_slice(args);
    a.extend_from_slice(&["--control", ctl.to_str().unwrap()]);
    fails(&a)
}

/// `blkq bitmap list --json`: (name, granularity, recording, dirty bytes) of each bitmap.
fn list(dir: &Path) -> Vec<(String, u64, bool, u64)> {
    let v: serde_json::Value = serde_json::from_str(&bitmap(dir, &["list", "--json"])).unwrap();
    v["bitmaps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| {
            (
                b["name"].as_str().unwrap().to_string(),
                b["granularity"].as_u64().unwrap(),
                b["recording"].as_bool().unwrap(),
                b["dirty_bytes"].as_u64().unwrap(),
            )
        })
        .collect()
}

#[test]
fn the_bitmap_cli_manages_bitmaps_and_names_its_errors() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (img, _) = common::leg_file(d, "disk.img", 64 * MIB);
    let s = serve_file(d, "cli", &img, &[]);
    assert!(bitmap(d, &["add", "daily"]).contains("\"daily\" added (granularity 65536)"));
    bitmap(d, &["add", "big", "--granularity", "1M"]);
    let e = bitmap_fails(d, &["add", "daily"]);
    assert!(e.contains("dirty bitmap \"daily\" already exists"), "{e}");
    let e = bitmap_fails(d, &["add", "x", "--granularity", "3000"]);
    assert!(e.contains("bad granularity 3000"), "{e}");
    let e = bitmap_fails(d, &["add", "x", "--granularity", "128M"]);
    assert!(e.contains("bad granularity 134217728"), "{e}");
    let e = bitmap_fails(d, &["remove", "nope"]);
    assert!(e.contains("no dirty bitmap \"nope\""), "{e}");
    let e = bitmap_fails(d, &["clear", "nope"]);
    assert!(e.contains("no dirty bitmap \"nope\""), "{e}");
    let e = bitmap_fails(d, &["list", "--export", "other"]);
    assert!(e.contains("no export \"other\""), "{e}");

    let mut c = s.client();
    c.write(3 * MIB, &[7u8; 4096], CmdFlags::empty()).unwrap();
    c.write(40 * MIB, &vec![7u8; 128 << 10], CmdFlags::empty())
        .unwrap();
    let want = |daily| {
        vec![
            ("daily".to_string(), 65536, true, daily),
            ("big".to_string(), MIB, true, 2 * MIB),
        ]
    };
    assert_eq!(list(d), want(3 * 65536));
    let table = bitmap(d, &["list"]);
    assert!(
        table.contains("daily") && table.contains("recording"),
        "{table}"
    );

    bitmap(d, &["rotate", "daily", "daily2"]);
    let e = bitmap_fails(d, &["rotate", "daily", "daily3"]);
    assert!(e.contains("frozen"), "{e}");
    c.write(5 * MIB, &[1u8; 512], CmdFlags::empty()).unwrap();
    let l = list(d);
    assert_eq!(l[0], ("daily".to_string(), 65536, false, 3 * 65536));
    assert_eq!(l[2], ("daily2".to_string(), 65536, true, 65536));
    bitmap(d, &["clear", "big"]);
    bitmap(d, &["remove", "daily"]);
    let l = list(d);
    assert_eq!(
        l,
        [
            ("big".to_string(), MIB, true, 0),
            ("daily2".to_string(), 65536, true, 65536)
        ]
    );

    // disable / enable / merge (qemu's block-dirty-bitmap-disable/-enable/-merge).
    assert!(bitmap(d, &["disable", "daily2"]).contains("\"daily2\" disabled"));
    c.write(9 * MIB, &[2u8; 512], CmdFlags::empty()).unwrap();
    assert_eq!(list(d)[1], ("daily2".to_string(), 65536, false, 65536));
    bitmap(d, &["enable", "daily2"]);
    c.write(11 * MIB, &[2u8; 512], CmdFlags::empty()).unwrap();
    assert_eq!(list(d)[1], ("daily2".to_string(), 65536, true, 2 * 65536));
    // big (cleared before the write at 5M; 1 MiB granules) has 9M and 11M dirty; daily2 5M
    // and 11M at 64K: the union is 64K at 5M and the two whole MiB.
    let m = bitmap(d, &["merge", "daily2", "big"]);
    assert!(m.contains("\"daily2\" merged with [\"big\"]"), "{m}");
    assert_eq!(
        list(d)[1],
        ("daily2".to_string(), 65536, true, 2 * MIB + 65536)
    );
    let e = bitmap_fails(d, &["merge", "daily2", "nope"]);
    assert!(e.contains("no dirty bitmap \"nope\""), "{e}");
    let e = bitmap_fails(d, &["merge", "daily2", "daily2"]);
    assert!(e.contains("cannot be merged into itself"), "{e}");
    let e = bitmap_fails(d, &["enable", "nope"]);
    assert!(e.contains("no dirty bitmap \"nope\""), "{e}");
    drop(c);
}

/// qemu-io writing 4 KiB at each of `offsets` (one command each), its stdout piped.
fn qemu_io_writes(sock: &Path, offsets: &[u64]) -> std::process::Child {
    let mut cmd = Command::new("qemu-io");
    cmd.args(["-f", "raw"]);
    for o in offsets {
        cmd.args(["-c", &format!("write -P 0x5a {o} 4k")]);
    }
    cmd.arg(format!("nbd+unix:///?socket={}", sock.display()))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("qemu-io (qemu-utils) is installed")
}

#[test]
fn sigkill_under_writes_leaves_every_acknowledged_granule_dirty() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let size = 256 * MIB;
    let (img, _) = common::leg_file(d, "disk.img", size);
    let mut s = serve_file(d, "kill", &img, &[]);
    bitmap(d, &["add", "b", "--granularity", "64K"]);
    // Scattered writes: most hit a clean granule, so most pay a persist.
    let offsets: Vec<u64> = (0..4000u64)
        .map(|i| (i.wrapping_mul(0x9E37_79B9) % (size / 4096)) * 4096)
        .collect();
    let mut q = qemu_io_writes(&s.sock, &offsets);
    let mut acked = Vec::new();
    let mut lines = BufReader::new(q.stdout.take().unwrap()).lines();
    for line in lines.by_ref() {
        let line = line.unwrap();
        if let Some(rest) = line.strip_prefix("wrote 4096/4096 bytes at offset ") {
            acked.push(rest.trim().parse::<u64>().unwrap());
            if acked.len() == 500 {
                s.signal(libc::SIGKILL);
                break;
            }
        }
    }
    // What qemu-io still reports was acknowledged before the kill.
    for line in lines {
        if let Some(rest) = line
            .unwrap()
            .strip_prefix("wrote 4096/4096 bytes at offset ")
        {
            acked.push(rest.trim().parse::<u64>().unwrap());
        }
    }
    let _ = q.wait();
    s.wait_exit(Duration::from_secs(60));
    assert!(
        acked.len() >= 500 && acked.len() < offsets.len(),
        "{}",
        acked.len()
    );

    // The sidecar as a restart reads it.
    let (b, notes) = cbt::Bitmaps::open(
        size,
        &cbt::Options {
            store: cbt::Store::File {
                path: d.join("disk.img.bitmaps"),
                image: cbt::Image::File(img.clone()),
            },
            reset: false,
            mode: cbt::Mode::LockFree,
        },
    )
    .unwrap();
    assert!(notes.is_empty(), "{notes:?}");
    for o in &acked {
        assert!(
            b.is_dirty("b", *o).unwrap(),
            "write at {o} was acknowledged but its granule is clean after SIGKILL"
        );
    }
    drop(b);
    // And the server takes it back.
    let s = serve_file(d, "again", &img, &[]);
    let l = list(d);
    assert_eq!(l.len(), 1);
    assert!(l[0].3 >= 65536 * 400, "{l:?}");
    drop(s);
}

#[test]
fn a_torn_sidecar_stops_the_server_naming_it_and_reset_makes_it_all_dirty() {
    use std::os::unix::fs::FileExt;
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (img, spec) = common::leg_file(d, "disk.img", 16 * MIB);
    {
        let _s = serve_file(d, "first", &img, &[]);
        bitmap(d, &["add", "nightly"]);
    }
    let side = d.join("disk.img.bitmaps");
    let f = std::fs::OpenOptions::new().write(true).open(&side).unwrap();
    f.write_all_at(&[0xff; 16], 2 * 4096 + 8).unwrap();
    drop(f);
    let sock = d.join("torn.sock");
    let e = fails_within(
        &[
            "serve",
            "--device",
            &spec,
            "--no-tcp",
            "--socket",
            sock.to_str().unwrap(),
        ],
        Duration::from_secs(60),
    );
    assert!(
        e.contains(&side.display().to_string()) && e.contains("torn"),
        "{e}"
    );
    let s = serve_file(d, "reset", &img, &["--bitmaps-reset"]);
    assert_eq!(list(d), [("nightly".to_string(), 65536, true, 16 * MIB)]);
    assert!(
        s.stderr_text().contains("--bitmaps-reset"),
        "{}",
        s.stderr_text()
    );
}

/// A mirror's bitmaps persist beside each of its file legs, matched to the array, and its
/// control socket answers both `blkq bitmap` and `blkq raid`.
#[test]
fn a_mirror_keeps_its_bitmaps_beside_every_file_leg() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (a, sa) = common::leg_file(d, "a.img", 32 * MIB);
    let (_, sb) = common::leg_file(d, "b.img", 32 * MIB);
    let legs = format!("{sa},{sb}");
    let mut s = common::Server::start(d, &legs, &["--raid1-create"]);
    bitmap(d, &["add", "m"]);
    let mut c = s.client();
    c.write(MIB, &[3u8; 4096], CmdFlags::empty()).unwrap();
    c.flush().unwrap();
    drop(c);
    assert_eq!(list(d), [("m".to_string(), 65536, true, 65536)]);
    assert!(s.status().contains("[UU]"), "{}", s.status());
    assert!(d.join("a.img.bitmaps").exists(), "{}", a.display());
    assert!(d.join("b.img.bitmaps").exists(), "{}", a.display());
    assert!(s.stop(), "{}", s.stderr_text());
    let s = common::Server::start(d, &legs, &[]);
    assert_eq!(list(d), [("m".to_string(), 65536, true, 65536)]);
    drop(s);
}

/// A mirror's bitmaps belong to the array, not to the leg named first: served with its legs in
/// the other order it has the same bitmaps, and the writes made then are in them when the
/// first order returns. (They once lived beside the first `file:` leg named: the other order
/// started with none, silently, and its writes were missing from `b0` afterwards.)
#[test]
fn a_mirrors_bitmaps_are_the_same_with_its_legs_in_any_order() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (_, sa) = common::leg_file(d, "a.img", 32 * MIB);
    let (_, sb) = common::leg_file(d, "b.img", 32 * MIB);
    let (ab, ba) = (format!("{sa},{sb}"), format!("{sb},{sa}"));
    let b0 = |bytes| [("b0".to_string(), 65536, true, bytes)];
    let write = |s: &common::Server, at: u64| {
        let mut c = s.client();
        c.write(at, &[5u8; 4096], CmdFlags::empty()).unwrap();
        c.flush().unwrap();
    };
    let mut s = common::Server::start(d, &ab, &["--raid1-create"]);
    bitmap(d, &["add", "b0"]);
    write(&s, MIB);
    assert!(s.stop(), "{}", s.stderr_text());
    let mut s = common::Server::start(d, &ba, &[]);
    write(&s, 8 * MIB);
    assert!(s.stop(), "{}", s.stderr_text());
    for legs in [&ab, &ba] {
        let mut s = common::Server::start(d, legs, &[]);
        assert_eq!(
            list(d),
            b0(2 * 65536),
            "legs {legs}: b0 marks both writes, the one made with the legs in the other order \
             too; {}",
            s.stderr_text()
        );
        assert!(s.stop(), "{}", s.stderr_text());
    }
}

/// A leg's sidecar that the array went on without (the mirror served degraded, without that
/// leg) is stale: when the leg returns, even named first, it is refused by name, not used, and
/// the bitmaps are the array's current ones.
#[test]
fn a_stale_sidecar_of_a_leg_the_array_went_on_without_is_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (_, sa) = common::leg_file(d, "a.img", 32 * MIB);
    let (_, sb) = common::leg_file(d, "b.img", 32 * MIB);
    let write = |s: &common::Server, at: u64| {
        let mut c = s.client();
        c.write(at, &[6u8; 4096], CmdFlags::empty()).unwrap();
        c.flush().unwrap();
    };
    let mut s = common::Server::start(d, &format!("{sa},{sb}"), &["--raid1-create"]);
    bitmap(d, &["add", "b0"]);
    write(&s, MIB);
    assert!(s.stop(), "{}", s.stderr_text());
    // Without b: its sidecar misses the write made now.
    let mut s = common::Server::start(d, &sa, &["--raid1-degraded"]);
    write(&s, 8 * MIB);
    assert!(s.stop(), "{}", s.stderr_text());
    let mut s = common::Server::start(d, &format!("{sb},{sa}"), &[]);
    assert_eq!(
        list(d),
        [("b0".to_string(), 65536, true, 2 * 65536)],
        "b0 marks the write made without b; {}",
        s.stderr_text()
    );
    let stale = d.join("b.img.bitmaps").display().to_string();
    let err = s.stderr_text();
    assert!(
        err.lines()
            .any(|l| l.contains(&stale) && l.contains("stale")),
        "the stale sidecar {stale} is named in the log: {err}"
    );
    assert!(s.stop(), "{}", s.stderr_text());
}

/// A bitmap name the server would refuse is refused before anything is sent, with the rule it
/// breaks (a name with a space was split on the one-line protocol and answered with its usage).
#[test]
fn a_bad_bitmap_name_is_refused_with_the_rule_it_breaks() {
    let dir = tempfile::tempdir().unwrap();
    let ctl = dir.path().join("ctl.sock");
    let ctl = ctl.to_str().unwrap();
    let long = "x".repeat(96);
    for args in [
        vec!["bitmap", "add", "bad name", "--control", ctl],
        vec!["bitmap", "add", long.as_str(), "--control", ctl],
        vec!["bitmap", "clear", "", "--control", ctl],
        vec!["bitmap", "rotate", "a", "b\tc", "--control", ctl],
    ] {
        let e = common::fails(&args);
        assert!(
            e.contains("bad dirty bitmap name") && e.contains("no spaces") && !e.contains("usage"),
            "{args:?}: {e}"
        );
    }
}
