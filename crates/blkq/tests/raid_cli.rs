//! `blkq raid` and `blkq serve --raid1 --control`: the built binary, file legs in a tempdir,
//! bounded waits only (no timing assertions).

mod common;
use common::*;

use std::path::Path;
use std::time::{Duration, Instant};

use nbd::codec::proto::CmdFlags;

const LEG_SIZE: u64 = 8 << 20;

fn leg(dir: &Path, name: &str) -> String {
    leg_file(dir, name, LEG_SIZE).1
}

/// Creates an array on blank legs, for tests not about creation (no initial resync).
fn create(a: &str, b: &str) {
    ok(&[
        "raid",
        "create",
        a,
        b,
        "--bitmap-chunk",
        "64K",
        "--assume-clean",
    ]);
}

/// Writes `data` at byte `at` of the file `dir/name`.
fn write_file_at(dir: &Path, name: &str, at: u64, data: &[u8]) {
    use std::os::unix::fs::FileExt;
    std::fs::OpenOptions::new()
        .write(true)
        .open(dir.join(name))
        .unwrap()
        .write_all_at(data, at)
        .unwrap();
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

#[test]
fn create_then_detail_and_status() {
    let d = tempfile::tempdir().unwrap();
    let (a, b) = (leg(d.path(), "a.img"), leg(d.path(), "b.img"));
    let out = ok(&[
        "raid",
        "create",
        &a,
        &b,
        "--bitmap-chunk",
        "64K",
        "--write-mostly",
        &b,
    ]);
    assert!(out.contains("created raid1 array"), "{out}");
    // Legs are matched by content, not order.
    let detail = ok(&["raid", "detail", &b, &a]);
    assert!(detail.contains("in_sync"), "{detail}");
    assert!(detail.contains(&a) && detail.contains(&b), "{detail}");
    assert!(detail.contains("64 KiB chunks"), "{detail}");
    let status = ok(&["raid", "status", &a, &b]);
    assert!(status.contains("[UU]"), "{status}");
    assert!(status.contains("b.img[1](W)"), "{status}");
    let json: serde_json::Value =
        serde_json::from_str(&ok(&["raid", "status", "--json", &a, &b])).unwrap();
    assert_eq!(json["raid_disks"], 2);
    assert_eq!(json["legs"][0]["state"], "in_sync");
    assert_eq!(json["legs"][1]["write_mostly"], true);
    // A second create over the same legs is refused.
    let e = fails(&["raid", "create", &a, &b]);
    assert!(e.contains("already carries a raid1 superblock"), "{e}");
}

#[test]
fn foreign_leg_is_refused() {
    let d = tempfile::tempdir().unwrap();
    let (a, b) = (leg(d.path(), "a.img"), leg(d.path(), "b.img"));
    let (c, e) = (leg(d.path(), "c.img"), leg(d.path(), "e.img"));
    create(&a, &b);
    create(&c, &e);
    let err = fails(&["raid", "assemble", &a, &b, &c]);
    assert!(err.contains("another array"), "{err}");
    assert!(err.contains("c.img"), "{err}");
    let sock = d.path().join("x.sock");
    let sock = sock.to_str().unwrap();
    let err = fails(&[
        "serve",
        "--raid1",
        &format!("{a},{c}"),
        "--no-tcp",
        "--socket",
        sock,
    ]);
    assert!(err.contains("another array"), "{err}");
    // Blank legs need --raid1-create; a blank leg in an array is named.
    let (f, g) = (leg(d.path(), "f.img"), leg(d.path(), "g.img"));
    let err = fails(&[
        "serve",
        "--raid1",
        &format!("{f},{g}"),
        "--no-tcp",
        "--socket",
        sock,
    ]);
    assert!(err.contains("--raid1-create"), "{err}");
    let err = fails(&[
        "serve",
        "--raid1",
        &format!("{a},{b}"),
        "--raid1-create",
        "--no-tcp",
        "--socket",
        sock,
    ]);
    assert!(err.contains("refusing to overwrite"), "{err}");
    let err = fails(&["raid", "assemble", &a, &f]);
    assert!(
        err.contains("f.img") && err.contains("no raid1 superblock"),
        "{err}"
    );
}

#[test]
fn serve_fail_remove_add() {
    let d = tempfile::tempdir().unwrap();
    let (a, b, c) = (
        leg(d.path(), "a.img"),
        leg(d.path(), "b.img"),
        leg(d.path(), "c.img"),
    );
    let mut s = Server::start(
        d.path(),
        &format!("{a},{b}"),
        &["--raid1-create", "--raid1-option", "bitmap_chunk=64K"],
    );
    assert!(s.status().contains("[UU]"));
    let data = pattern(7, 256 << 10);
    {
        let mut cl = s.client();
        cl.write(0, &data, CmdFlags::empty()).unwrap();
        cl.write(3 << 20, &data, CmdFlags::FUA).unwrap();
        cl.flush().unwrap();
    }
    let m = ok(&["raid", "fail", "1", "--control", s.ctl()]);
    assert!(m.contains("faulty"), "{m}");
    let st = s.status();
    assert!(st.contains("[U_]"), "{st}");
    assert!(st.contains("(F)"), "{st}");
    {
        let mut cl = s.client();
        assert_eq!(cl.read(0, data.len() as u64).unwrap(), data);
        assert_eq!(cl.read(3 << 20, data.len() as u64).unwrap(), data);
    }
    // The last in-sync leg cannot be failed; an in-sync leg cannot be removed.
    let e = fails(&["raid", "fail", "0", "--control", s.ctl()]);
    assert!(e.contains("last in-sync leg"), "{e}");
    let e = fails(&["raid", "remove", "0", "--control", s.ctl()]);
    assert!(e.contains("fail 0"), "{e}");
    ok(&["raid", "remove", "1", "--control", s.ctl()]);
    let m = ok(&["raid", "add", &c, "--control", s.ctl()]);
    assert!(m.contains("slot 1"), "{m}");
    let detail = ok(&["raid", "detail", "--control", s.ctl()]);
    assert!(detail.contains("c.img"), "{detail}");
    // A leg already in the array cannot be added again.
    let e = fails(&["raid", "add", &a, "--control", s.ctl()]);
    assert!(e.contains("already in the array"), "{e}");
    // Bad commands get clear errors, and the socket stays usable.
    let e = fails(&["raid", "remove", "9", "--control", s.ctl()]);
    assert!(e.contains("no such slot"), "{e}");
    // The real range of this 3-slot array, 0 to 2 (never 0..3, read as including 3).
    let e = fails(&["raid", "fail", "9", "--control", s.ctl()]);
    assert!(e.contains("slots 0 to 2") && !e.contains("0.."), "{e}");
    assert!(s.status().contains("c.img"));
    assert!(s.stop(), "serve did not exit cleanly");
    assert!(!Path::new(s.ctl()).exists(), "control socket left behind");
}

#[test]
fn recovery_brings_back_uu() {
    let d = tempfile::tempdir().unwrap();
    let (a, b, c) = (
        leg(d.path(), "a.img"),
        leg(d.path(), "b.img"),
        leg(d.path(), "c.img"),
    );
    create(&a, &b);
    let mut s = Server::start(d.path(), &format!("{a},{b}"), &[]);
    let data = pattern(3, 128 << 10);
    s.client().write(1 << 20, &data, CmdFlags::FUA).unwrap();
    ok(&["raid", "fail", "1", "--control", s.ctl()]);
    ok(&["raid", "remove", "1", "--control", s.ctl()]);
    // Slow the copy down so that the progress line can be seen, then let it go.
    let m = ok(&["raid", "speed-limit", "1", "1", "--control", s.ctl()]);
    assert!(m.contains("1..1 KiB/s"), "{m}");
    ok(&["raid", "add", &c, "--control", s.ctl()]);
    let t0 = Instant::now();
    loop {
        let st = s.status();
        if st.contains("recover = ") {
            assert!(st.contains("speed=") && st.contains("[U_]"), "{st}");
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "no recovery progress line: {st}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    ok(&[
        "raid",
        "speed-limit",
        "1000",
        "200000",
        "--control",
        s.ctl(),
    ]);
    let t0 = Instant::now();
    loop {
        let st = s.status();
        if st.contains("[UU]") {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "no [UU] after recovery: {st}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    // The new leg alone holds the data: fail the old one and read back.
    ok(&["raid", "fail", "0", "--control", s.ctl()]);
    assert!(s.status().contains("[_U]"));
    assert_eq!(s.client().read(1 << 20, data.len() as u64).unwrap(), data);
    assert!(s.stop());
    let st = raid_status(&[&c, &a]);
    assert!(st.contains("[_U]"), "{st}");
}

#[test]
fn offline_check_and_repair() {
    let d = tempfile::tempdir().unwrap();
    let (a, b) = (leg(d.path(), "a.img"), leg(d.path(), "b.img"));
    create(&a, &b);
    let out = ok(&["raid", "check", &a, &b]);
    assert!(out.contains("mismatch_cnt = 0"), "{out}");
    // Corrupt 4 KiB of b's data area (data starts at 1 MiB on these legs).
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(d.path().join("b.img"))
            .unwrap();
        f.write_all_at(&[0xa5; 4096], (1 << 20) + (2 << 20))
            .unwrap();
    }
    let out = ok(&["raid", "check", "--json", &a, &b]);
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert!(v["mismatch_cnt"].as_u64().unwrap() > 0, "{out}");
    ok(&["raid", "repair", &a, &b]);
    let out = ok(&["raid", "check", &a, &b]);
    assert!(out.contains("mismatch_cnt = 0"), "{out}");
}

#[test]
fn stale_leg_is_named() {
    let d = tempfile::tempdir().unwrap();
    let (a, b) = (leg(d.path(), "a.img"), leg(d.path(), "b.img"));
    create(&a, &b);
    let mut s = Server::start(d.path(), &format!("{a},{b}"), &[]);
    ok(&["raid", "fail", "1", "--control", s.ctl()]);
    s.client()
        .write(0, &pattern(1, 64 << 10), CmdFlags::FUA)
        .unwrap();
    assert!(s.stop());
    let out = ok(&["raid", "assemble", &b, &a]);
    assert!(out.contains("stale"), "{out}");
    assert!(
        out.lines()
            .any(|l| l.contains("stale") && l.contains("b.img")),
        "{out}"
    );
    let st = raid_status(&[&a, &b]);
    assert!(st.contains("[U_]"), "{st}");
}

#[test]
fn control_line_over_4k_is_refused() {
    use std::io::{Read, Write};
    let d = tempfile::tempdir().unwrap();
    let (a, b) = (leg(d.path(), "a.img"), leg(d.path(), "b.img"));
    let s = Server::start(d.path(), &format!("{a},{b}"), &["--raid1-create"]);
    let mut u = std::os::unix::net::UnixStream::connect(s.ctl()).unwrap();
    u.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let long = format!("add file:{}\n", "x".repeat(5000));
    let _ = u.write_all(long.as_bytes());
    let mut r = String::new();
    let _ = u.read_to_string(&mut r);
    assert!(r.contains("longer than 4096"), "{r}");
    assert!(s.status().contains("[UU]"));
}

#[test]
fn online_check_and_replace() {
    let d = tempfile::tempdir().unwrap();
    let (a, b, c) = (
        leg(d.path(), "a.img"),
        leg(d.path(), "b.img"),
        leg(d.path(), "c.img"),
    );
    create(&a, &b);
    let mut s = Server::start(d.path(), &format!("{a},{b}"), &[]);
    let data = pattern(9, 128 << 10);
    s.client().write(2 << 20, &data, CmdFlags::FUA).unwrap();
    let m = ok(&["raid", "check", "--control", s.ctl()]);
    assert!(m.contains("check"), "{m}");
    let wait_for = |what: &dyn Fn(&serde_json::Value) -> bool, why: &str| {
        let t0 = Instant::now();
        loop {
            let out = raid_status(&["--json", "--control", s.ctl()]);
            let v: serde_json::Value = serde_json::from_str(&out).unwrap();
            if what(&v) {
                return v;
            }
            assert!(t0.elapsed() < Duration::from_secs(120), "{why}: {out}");
            std::thread::sleep(Duration::from_millis(100));
        }
    };
    let v = wait_for(&|v| v["sync"]["action"] == "idle", "check did not finish");
    assert_eq!(v["sync"]["mismatch_cnt"], 0);
    let m = ok(&["raid", "replace", "1", &c, "--control", s.ctl()]);
    assert!(m.contains("replacing"), "{m}");
    wait_for(
        &|v| {
            v["legs"]
                .as_array()
                .unwrap()
                .iter()
                .any(|l| l["device"] == c.as_str() && l["state"] == "in_sync")
                && !v["legs"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|l| l["device"] == b.as_str())
        },
        "replace did not finish",
    );
    let st = s.status();
    assert!(st.contains("[UU]"), "{st}");
    assert_eq!(s.client().read(2 << 20, data.len() as u64).unwrap(), data);
    assert!(s.stop());
    // The array now assembles from a and c, and was stopped cleanly.
    let out = ok(&["raid", "assemble", &c, &a]);
    assert!(out.contains("[UU]"), "{out}");
    let detail = ok(&["raid", "detail", &a, &c]);
    assert!(detail.contains("State : clean"), "{detail}");
}

/// A leg holding a filesystem (an ext4 superblock's magic at byte 1080) is refused, naming
/// the leg and what it holds, and taken with --force; so is a leg with data where the
/// superblock goes. Through `serve --raid1-create` too.
#[test]
fn create_refuses_a_leg_that_holds_data_unless_forced() {
    let d = tempfile::tempdir().unwrap();
    let (a, b) = (leg(d.path(), "a.img"), leg(d.path(), "b.img"));
    write_file_at(d.path(), "b.img", 1080, &[0x53, 0xef]);
    let e = fails(&["raid", "create", &a, &b]);
    assert!(
        e.contains("b.img") && e.contains("ext2/3/4 filesystem") && e.contains("--force"),
        "{e}"
    );
    assert!(!e.contains("a.img"), "{e}");
    let sock = d.path().join("x.sock");
    let e = fails(&[
        "serve",
        "--raid1",
        &format!("{a},{b}"),
        "--raid1-create",
        "--no-tcp",
        "--socket",
        sock.to_str().unwrap(),
    ]);
    assert!(
        e.contains("b.img") && e.contains("ext2/3/4") && e.contains("--raid1-force"),
        "{e}"
    );
    // Nothing was written: a is still blank, b still holds its magic.
    let e = fails(&["raid", "status", &a, &b]);
    assert!(e.contains("no leg carries a raid1 superblock"), "{e}");
    // No signature, but data where the bitmap goes.
    let c = leg(d.path(), "c.img");
    write_file_at(d.path(), "c.img", 10 << 10, b"old bytes");
    let e = fails(&["raid", "create", &a, &c]);
    assert!(
        e.contains("c.img") && e.contains("non-zero byte at offset 10240"),
        "{e}"
    );
    let out = ok(&["raid", "create", &a, &b, "--force"]);
    assert!(out.contains("created raid1 array"), "{out}");
    assert!(ok(&["raid", "status", &a, &b]).contains("[UU]"));
}

/// Legs that differ are made to agree: the new array resyncs from its first leg, so a check
/// right after creation counts no mismatch and the legs compare equal.
#[test]
fn create_resyncs_legs_that_differ() {
    let d = tempfile::tempdir().unwrap();
    let (a, b) = (leg(d.path(), "a.img"), leg(d.path(), "b.img"));
    // Data past the superblock and bitmap (these legs' data starts at 1 MiB): not refused.
    write_file_at(d.path(), "a.img", 2 << 20, &pattern(1, 256 << 10));
    write_file_at(d.path(), "b.img", 5 << 20, &pattern(2, 64 << 10));
    let out = ok(&["raid", "create", &a, &b, "--bitmap-chunk", "64K"]);
    assert!(out.contains("a resync is due"), "{out}");
    let st = ok(&["raid", "status", &a, &b]);
    assert!(st.contains("a resync is due"), "{st}");
    let out = ok(&["raid", "check", &a, &b]);
    assert!(out.contains("mismatch_cnt = 0"), "{out}");
    let v: serde_json::Value =
        serde_json::from_str(&ok(&["raid", "status", "--json", &a, &b])).unwrap();
    assert_eq!(v["state"], "clean", "{v}");
    let (off, cap) = geometry(&v);
    assert_leg_files_equal(&d.path().join("a.img"), &d.path().join("b.img"), off, cap);
    // The first leg's data is what the array holds.
    let f = std::fs::read(d.path().join("b.img")).unwrap();
    assert_eq!(
        &f[2 << 20..(2 << 20) + (256 << 10)],
        &pattern(1, 256 << 10)[..]
    );
}

/// `serve --raid1-create` resyncs at once while it serves: reads during the resync come from
/// the first leg, and once it is done a check counts no mismatch.
#[test]
fn serve_create_resyncs_while_serving() {
    let d = tempfile::tempdir().unwrap();
    let (a, b) = (leg(d.path(), "a.img"), leg(d.path(), "b.img"));
    write_file_at(d.path(), "a.img", 2 << 20, &pattern(3, 128 << 10));
    write_file_at(d.path(), "b.img", 2 << 20, &pattern(4, 128 << 10));
    let s = Server::start(d.path(), &format!("{a},{b}"), &["--raid1-create"]);
    // Array byte 1 MiB is leg byte 2 MiB: the first leg's, whichever leg answers.
    for _ in 0..4 {
        assert_eq!(
            s.client().read(1 << 20, 128 << 10).unwrap(),
            pattern(3, 128 << 10)
        );
    }
    s.wait_for(
        &|v| v["sync"]["action"] == "idle" && v["sync"]["chunks_copied"].as_u64() > Some(0),
        "the initial resync did not finish",
    );
    ok(&["raid", "check", "--control", s.ctl()]);
    let v = s.wait_for(&|v| v["sync"]["action"] == "idle", "check did not finish");
    assert_eq!(v["sync"]["mismatch_cnt"], 0, "{v}");
}

/// --assume-clean: no resync runs, so legs that differ stay different (what a check then
/// counts), as md's --assume-clean on legs that were not blank.
#[test]
fn assume_clean_runs_no_resync() {
    let d = tempfile::tempdir().unwrap();
    let (a, b) = (leg(d.path(), "a.img"), leg(d.path(), "b.img"));
    write_file_at(d.path(), "b.img", 3 << 20, &pattern(5, 16 << 10));
    let out = ok(&["raid", "create", &a, &b, "--assume-clean"]);
    assert!(!out.contains("resync"), "{out}");
    let detail = ok(&["raid", "detail", &a, &b]);
    assert!(detail.contains("State : clean"), "{detail}");
    let out = ok(&["raid", "check", "--json", &a, &b]);
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["mismatch_cnt"], 32, "{out}");
}

/// Legs of different sizes are refused, naming both; `--size` uses that much of each.
#[test]
fn legs_of_different_sizes_need_a_size() {
    let d = tempfile::tempdir().unwrap();
    let a = leg(d.path(), "a.img");
    let b = leg_file(d.path(), "b.img", LEG_SIZE + (4 << 20)).1;
    let e = fails(&["raid", "create", &a, &b]);
    assert!(
        e.contains("a.img")
            && e.contains("8 MiB (8388608 bytes)")
            && e.contains("b.img")
            && e.contains("12 MiB (12582912 bytes)")
            && e.contains("--size"),
        "{e}"
    );
    let e = fails(&["raid", "create", &a, &b, "--size", "9M"]);
    assert!(e.contains("more than leg") && e.contains("a.img"), "{e}");
    ok(&["raid", "create", &a, &b, "--size", "8M", "--assume-clean"]);
    let v: serde_json::Value =
        serde_json::from_str(&ok(&["raid", "status", "--json", &a, &b])).unwrap();
    let (off, cap) = geometry(&v);
    assert_eq!(off + cap, LEG_SIZE, "{v}");
}

/// The exit status of `blkq raid status` (mdadm's `--detail --test`).
fn status_code(args: &[&str]) -> Option<i32> {
    let mut all = vec!["raid", "status"];
    all.extend_from_slice(args);
    blkq(&all).status.code()
}

/// `blkq raid status` exits as `mdadm --detail --test` does: 0 with every leg in sync, 1
/// degraded, 2 failed (writes fail), 4 when it cannot answer (no server at the control socket).
#[test]
fn status_exit_says_ok_degraded_failed_or_no_answer() {
    let d = tempfile::tempdir().unwrap();
    let (a, b) = (leg(d.path(), "a.img"), leg(d.path(), "b.img"));
    // Leg a fails writes to its last MiB: with b failed, a write there fails the array.
    let s = Server::start(
        d.path(),
        &format!("{a},fault.fail_write=7M+1M,{b}"),
        &common::create_clean(&["bitmap_chunk=64K"]),
    );
    let ctl = ["--control", s.ctl()];
    assert_eq!(status_code(&ctl), Some(0), "in sync");
    ok(&["raid", "fail", "1", "--control", s.ctl()]);
    assert_eq!(status_code(&ctl), Some(1), "degraded");
    let (offset, capacity) = geometry(&s.status_json());
    let at = (7 << 20) - offset;
    assert!(at + 4096 <= capacity, "{offset} {capacity}");
    assert!(s.client().write(at, &[1; 4096], CmdFlags::FUA).is_err());
    assert_eq!(status_code(&ctl), Some(2), "failed: {}", s.status());
    let none = d.path().join("none.sock");
    assert_eq!(
        status_code(&["--control", none.to_str().unwrap()]),
        Some(4),
        "no server"
    );
}

/// The lines of `path` that hold every one of `words`.
fn lines_with(path: &Path, words: &[&str]) -> Vec<String> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter(|l| words.iter().all(|w| l.contains(w)))
        .map(str::to_string)
        .collect()
}

/// Each change of a leg is logged once, naming its slot and its device: a failure with its
/// cause at WARN (an operator must act), a removal, an addition and the recovery's start and
/// end at INFO.
#[test]
fn leg_changes_are_logged_naming_the_leg() {
    let d = tempfile::tempdir().unwrap();
    let (a, b, c) = (
        leg(d.path(), "a.img"),
        leg(d.path(), "b.img"),
        leg(d.path(), "c.img"),
    );
    create(&a, &b);
    let mut s = Server::start(d.path(), &format!("{a},{b}"), &[]);
    let log = d.path().join("serve.stderr");
    ok(&["raid", "fail", "1", "--control", s.ctl()]);
    ok(&["raid", "remove", "1", "--control", s.ctl()]);
    ok(&["raid", "add", &c, "--control", s.ctl()]);
    s.wait_for(&|v| v["state"] == "active", "recovery did not finish");
    assert!(s.stop());
    let all = std::fs::read_to_string(&log).unwrap();
    for (words, why) in [
        (
            &["WARN", "slot 1", "failed", "operator", "b.img"][..],
            "the failure, its cause and the leg",
        ),
        (&["INFO", "slot 1", "removed", "b.img"], "the removal"),
        (&["INFO", "slot 1", "added", "c.img"], "the addition"),
        (
            &["INFO", "recovery of slot 1 started", "c.img"],
            "the recovery's start",
        ),
        (
            &["INFO", "recovery", "slot 1", "done", "c.img"],
            "the recovery's end",
        ),
    ] {
        assert_eq!(
            lines_with(&log, words).len(),
            1,
            "{why}: {words:?} in\n{all}"
        );
    }
}

/// A leg failed while the array went on is not told: alone, offline, its own superblock still
/// says every leg in sync, so it reads `[_U]` where the server said `[U_]`. The offline report
/// says that the given legs may be stale and how to see the array's view.
#[test]
fn offline_status_of_some_legs_says_a_given_leg_may_be_stale() {
    let d = tempfile::tempdir().unwrap();
    let (a, b) = (leg(d.path(), "a.img"), leg(d.path(), "b.img"));
    create(&a, &b);
    let mut s = Server::start(d.path(), &format!("{a},{b}"), &[]);
    ok(&["raid", "fail", "1", "--control", s.ctl()]);
    assert!(s.status().contains("[U_]"));
    assert!(s.stop(), "serve did not exit cleanly");
    let alone = raid_status(&[&b]);
    assert!(alone.contains("[_U]"), "{alone}");
    assert!(
        alone.contains("may be stale") && alone.contains("every leg"),
        "offline status of a leg alone does not say it may be stale:\n{alone}"
    );
    // With every leg, offline agrees with the server.
    let all = raid_status(&[&a, &b]);
    assert!(all.contains("[U_]"), "{all}");
    assert!(!all.contains("may be stale"), "{all}");
}

/// A mirror's export is smaller than its legs by the superblock and bitmap at the start of
/// each: the banner says how much, beside the export's size.
#[test]
fn the_banner_says_what_the_superblock_and_bitmap_take() {
    let d = tempfile::tempdir().unwrap();
    let (a, b) = (leg(d.path(), "a.img"), leg(d.path(), "b.img"));
    create(&a, &b);
    let v: serde_json::Value = serde_json::from_str(&raid_status(&["--json", &a, &b])).unwrap();
    let (offset, capacity) = geometry(&v);
    let s = Launch::serve(["--raid1", &format!("{a},{b}"), "--no-tcp", "--socket"])
        .arg(d.path().join("nbd.sock"))
        .ready_after_line("Ctrl-C")
        .start();
    let banner = s.stdout_lines().join("\n");
    assert_eq!(offset + capacity, LEG_SIZE);
    let want = format!("{capacity} bytes");
    assert!(banner.contains(&want), "{banner}");
    assert!(
        banner.contains(&format!(
            "each leg's first {offset} bytes hold its superblock and bitmap"
        )),
        "the banner does not say what the legs' first {offset} bytes hold:\n{banner}"
    );
}
