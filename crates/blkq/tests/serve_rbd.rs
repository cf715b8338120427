//! `blkq serve --device rbd:POOL/IMAGE` against a real single-node Ceph cluster (started once
//! for this binary by `scripts/ceph-cluster.sh`, through `testkit::ceph`), driven by clients
//! nobody here wrote: qemu-img convert + compare, qemu-io patterns, nbdcopy, fio with crc32c
//! verification. Then a second server on the same image (refused), the OSD SIGKILLed under a
//! verified write load and restarted (the requests wait and complete, nothing acknowledged
//! is lost), and the same with `timeout=` (requests fail, and what was acknowledged before
//! is still there). The client and OSD-kill tests run once per completion mode
//! (`completion=poll`, the default, and `completion=callback`). Skips, saying why, where no
//! cluster can be had. The tests share the
//! cluster and one of them kills its OSD, so they run one at a time.
#![cfg(not(blkq_loom))]

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
#[allow(clippy::disallowed_types)] // TURN, below
use std::sync::Mutex;
use std::time::Duration;

use common::{serve_fails, Serving};
use nbd::codec::CmdFlags;
use testkit::ceph::Cluster;
use testkit::pattern;

/// The tests take turns on the cluster (one kills the OSD). A std `Mutex`: test scaffolding,
/// never inside a loom model.
#[allow(clippy::disallowed_types)]
static TURN: Mutex<()> = Mutex::new(());

/// The cluster, or `None` after saying why the test skips (no cluster, or a blkq built
/// without librbd).
fn cluster(test: &str) -> Option<&'static Cluster> {
    if !blk_drivers::rbd::AVAILABLE {
        eprintln!("SKIPPED {test}: {}", blk_drivers::rbd::NOT_BUILT);
        return None;
    }
    Cluster::or_skip(test)
}

fn have(tool: &str) -> bool {
    Command::new(tool)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok()
}

fn uri(sock: &Path) -> String {
    format!("nbd+unix:///?socket={}", sock.display())
}

/// Runs a client tool, which must succeed; its stdout and stderr.
fn run(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{cmd:?} failed: {text}");
    text
}

/// fio's nbd engine on `uri`: random 4 KiB writes over `size`, each block verified by crc32c
/// after the writes (in `dir`, no state file left).
fn fio_verify(dir: &Path, uri: &str, size: &str) -> Command {
    let mut c = Command::new("fio");
    c.current_dir(dir).args([
        "--name=rbd-verify",
        "--ioengine=nbd",
        &format!("--uri={uri}"),
        "--rw=randwrite",
        "--bs=4k",
        "--iodepth=16",
        &format!("--size={size}"),
        "--verify=crc32c",
        "--do_verify=1",
        "--verify_fatal=1",
        "--verify_state_save=0",
    ]);
    c
}

#[test]
fn real_clients_through_an_rbd_export() {
    real_clients("real_clients_through_an_rbd_export", "clients", "");
}

#[test]
fn real_clients_through_an_rbd_export_with_callbacks() {
    real_clients(
        "real_clients_through_an_rbd_export_with_callbacks",
        "clients-cb",
        ",completion=callback",
    );
}

/// The client tools against an export of `image` served with the spec options `opts`.
fn real_clients(test: &str, image: &str, opts: &str) {
    let Some(c) = cluster(test) else {
        return;
    };
    let missing: Vec<_> = ["qemu-img", "qemu-io", "nbdcopy", "fio"]
        .into_iter()
        .filter(|t| !have(t))
        .collect();
    if !missing.is_empty() {
        eprintln!("SKIPPED {test}: missing {missing:?} (scripts/test.sh installs them)");
        return;
    }
    let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    c.create_image(image, "64M");
    let dir = tempfile::tempdir().unwrap();
    let srv = Serving::start(dir.path(), "rbd", &["--device", &c.spec(image, opts)]);
    let u = uri(&srv.sock);

    // qemu-img convert a 64 MiB image with data and holes in, then compare.
    let src = dir.path().join("src.img");
    {
        let f = std::fs::File::create(&src).unwrap();
        f.set_len(64 << 20).unwrap();
        use std::os::unix::fs::FileExt;
        for i in 0..24u64 {
            f.write_all_at(&pattern(i, 256 << 10), i * (2 << 20) + (i % 3) * 4096)
                .unwrap();
        }
    }
    run(Command::new("qemu-img")
        .args(["convert", "-n", "-f", "raw", "-O", "raw"])
        .arg(&src)
        .arg(&u));
    let cmp = run(Command::new("qemu-img")
        .args(["compare", "-f", "raw", "-F", "raw"])
        .arg(&src)
        .arg(&u));
    assert!(cmp.contains("Images are identical"), "{cmp}");

    // qemu-io patterns, FUA included, across an object boundary.
    let io = run(Command::new("qemu-io").args(["-f", "raw"]).arg(&u).args([
        "-c",
        "write -P 0xab 4190208 1M",
        "-c",
        "write -f -P 0xcd 40M 64k",
        "-c",
        "discard 48M 4M",
        "-c",
        "write -z 52M 1M",
        "-c",
        "read -P 0xab 4190208 1M",
        "-c",
        "read -P 0xcd 40M 64k",
        "-c",
        "read -P 0 48M 5M",
        "-c",
        "flush",
    ]));
    assert!(!io.contains("Pattern verification failed"), "{io}");
    assert!(io.contains("read 1048576/1048576"), "{io}");

    // Block status from librbd's diff: the discarded object (48M..52M) is a hole, the
    // written ones data.
    if have("nbdinfo") {
        let map = run(Command::new("nbdinfo").arg("--map").arg(&u));
        let kind_at = |off: u64| {
            map.lines()
                .filter_map(|l| {
                    let f: Vec<&str> = l.split_whitespace().collect();
                    let (o, n) = (
                        f.first()?.parse::<u64>().ok()?,
                        f.get(1)?.parse::<u64>().ok()?,
                    );
                    (o <= off && off < o + n).then(|| l.to_string())
                })
                .next()
                .unwrap_or_default()
        };
        assert!(kind_at(48 << 20).contains("hole"), "{map}");
        assert!(kind_at(40 << 20).contains("data"), "{map}");
    }

    // nbdcopy out, then compared with the export by qemu-img.
    let out = dir.path().join("out.img");
    run(Command::new("nbdcopy")
        .args(["--requests", "32"])
        .arg(&u)
        .arg(&out));
    let cmp = run(Command::new("qemu-img")
        .args(["compare", "-f", "raw", "-F", "raw"])
        .arg(&out)
        .arg(&u));
    assert!(cmp.contains("Images are identical"), "{cmp}");

    // fio: random writes, every block verified.
    let text = run(&mut fio_verify(dir.path(), &u, "16m"));
    assert!(text.contains("err= 0"), "{text}");
}

#[test]
fn a_second_server_on_the_same_image_is_refused() {
    let Some(c) = cluster("a_second_server_on_the_same_image_is_refused") else {
        return;
    };
    let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    c.create_image("twice", "16M");
    let dir = tempfile::tempdir().unwrap();
    let spec = c.spec("twice", "");
    let mut first = Serving::start(dir.path(), "first", &["--device", &spec]);
    let other = dir.path().join("second.sock");
    let err = serve_fails(&spec, &other, Duration::from_secs(120));
    assert!(err.contains("rbd:rbd/twice"), "{err}");
    assert!(err.contains("in use") && err.contains("lock"), "{err}");
    // The first still serves.
    let mut cl = first.client();
    cl.write(0, &pattern(1, 4096), CmdFlags::FUA).unwrap();
    assert_eq!(cl.read(0, 4096).unwrap(), pattern(1, 4096));
    drop(cl);
    assert!(
        first.stop(Duration::from_secs(60)),
        "{}",
        first.stderr_text()
    );
}

#[test]
fn the_osd_killed_under_verified_writes() {
    osd_killed("the_osd_killed_under_verified_writes", "killed", "");
}

#[test]
fn the_osd_killed_under_verified_writes_with_callbacks() {
    osd_killed(
        "the_osd_killed_under_verified_writes_with_callbacks",
        "killed-cb",
        ",completion=callback",
    );
}

/// The OSD killed under a verified write load against `image` served with the spec options
/// `opts`, without and with `timeout=`.
fn osd_killed(test: &str, image: &str, opts: &str) {
    let Some(c) = cluster(test) else {
        return;
    };
    if !have("fio") {
        eprintln!("SKIPPED {test}: fio is missing");
        return;
    }
    let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    c.create_image(image, "64M");
    let dir = tempfile::tempdir().unwrap();
    let pool_image = format!("rbd/{image}");

    // No timeout: the requests wait for the OSD and complete; fio verifies every block.
    {
        let mut srv = Serving::start(dir.path(), "wait", &["--device", &c.spec(image, opts)]);
        let fio = fio_verify(dir.path(), &uri(&srv.sock), "32m")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // Let writes be in flight, then kill the OSD under them, and bring it back.
        let mut cl = srv.client();
        testkit::wait_until("writes reach the image", || {
            c.rbd(&["du", "--format", "json", &pool_image])
                .is_ok_and(|s| s.contains("\"used_size\":") && !s.contains("\"used_size\":0"))
        });
        c.kill_osd();
        std::thread::sleep(Duration::from_secs(2));
        c.start_osd();
        let out = fio.wait_with_output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "fio: {text}");
        assert!(text.contains("err= 0"), "{text}");
        // And the server still serves.
        cl.write(48 << 20, &pattern(3, 4096), CmdFlags::FUA)
            .unwrap();
        assert_eq!(cl.read(48 << 20, 4096).unwrap(), pattern(3, 4096));
        drop(cl);
        // A clean stop releases the image's lock for the next server.
        assert!(srv.stop(Duration::from_secs(60)), "{}", srv.stderr_text());
    }

    // With timeout=: a request the dead OSD cannot serve fails (EIO to the client) once the
    // timeout passes; what was acknowledged before is still there afterwards.
    let srv = Serving::start(
        dir.path(),
        "timeout",
        &["--device", &c.spec(image, &format!("{opts},timeout=3"))],
    );
    let mut cl = srv.client();
    cl.write(60 << 20, &pattern(4, 65536), CmdFlags::FUA)
        .unwrap_or_else(|e| panic!("{e:?}: {}", srv.stderr_text()));
    c.kill_osd();
    let r = cl.write(61 << 20, &pattern(5, 4096), CmdFlags::FUA);
    assert!(r.is_err(), "a write to a dead OSD succeeded with timeout=3");
    c.start_osd();
    // Until the OSD is back and the image's watch and lock are re-established, requests time
    // out in their turn; then a write goes through. (Not FUA: after the failed write the
    // export's sticky error fails every FLUSH and FUA write with EIO, as the server's docs say.)
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    while let Err(e) = srv
        .client()
        .write(62 << 20, &pattern(6, 4096), CmdFlags::empty())
    {
        assert!(
            std::time::Instant::now() < deadline,
            "writes still fail ({e:?}) 120 s after the OSD restarted: {}",
            srv.stderr_text()
        );
    }
    let mut cl = srv.client();
    assert_eq!(
        cl.read(60 << 20, 65536).unwrap(),
        pattern(4, 65536),
        "acknowledged, then lost"
    );
    assert_eq!(cl.read(62 << 20, 4096).unwrap(), pattern(6, 4096));
    assert!(
        cl.flush().is_err(),
        "a flush after a failed write must not claim durability"
    );
}

#[test]
fn a_mirror_of_a_local_leg_and_a_write_mostly_rbd_leg() {
    let Some(c) = cluster("a_mirror_of_a_local_leg_and_a_write_mostly_rbd_leg") else {
        return;
    };
    let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    c.create_image("mirror", "64M");
    let dir = tempfile::tempdir().unwrap();
    let (_, local) = common::leg_file(dir.path(), "local.img", 64 << 20);
    let remote = c.spec("mirror", "");
    common::ok(&[
        "raid",
        "create",
        &local,
        &remote,
        "--write-mostly",
        "1",
        "--bitmap-chunk",
        "1M",
        // A new image and a new file: blank, and the test counts what a recovery copies.
        "--assume-clean",
    ]);
    let mut s = common::Server::start(dir.path(), &format!("{local},{remote}"), &[]);
    let detail = common::ok(&["raid", "detail", "--control", s.ctl()]);
    let row = detail
        .lines()
        .find(|l| l.contains("rbd:rbd/mirror"))
        .unwrap_or("");
    assert!(
        row.contains(" W "),
        "the RBD leg is write-mostly (WM column): {detail}"
    );
    let a = pattern(1, 1 << 20);
    let b = pattern(2, 1 << 20);
    if let Err(e) = s.client().write(0, &a, CmdFlags::FUA) {
        panic!("a write to the mirror: {e}; serve: {}", s.stderr_text());
    }

    // The RBD leg fails; writes go on to the local leg, the bitmap marks them.
    common::ok(&["raid", "fail", "1", "--control", s.ctl()]);
    if let Err(e) = s.client().write(8 << 20, &b, CmdFlags::FUA) {
        panic!(
            "a write to the degraded mirror: {e}; serve: {}",
            s.stderr_text()
        );
    }
    common::ok(&["raid", "remove", "1", "--control", s.ctl()]);
    // Re-added (its image lock released with the removed leg): recovered from the bitmap.
    let m = common::ok(&["raid", "add", &remote, "--control", s.ctl()]);
    assert!(m.contains("slot 1"), "{m}");
    let v = s.wait_for(
        &|v| {
            v["legs"][0]["state"] == "in_sync"
                && v["legs"][1]["state"] == "in_sync"
                && v["sync"]["action"] == "idle"
        },
        "the RBD leg back in sync",
    );
    // From the bitmap: only the chunks written while it was out were copied.
    let copied = v["sync"]["chunks_copied"].as_u64().unwrap();
    assert!((1..63).contains(&copied), "{v}");
    // The local leg fails: every read now comes from the RBD leg, which has it all.
    common::ok(&["raid", "fail", "0", "--control", s.ctl()]);
    let mut cl = s.client();
    assert_eq!(cl.read(0, 1 << 20).unwrap(), a);
    assert_eq!(cl.read(8 << 20, 1 << 20).unwrap(), b);
    drop(cl);
    assert!(s.stop(), "serve did not exit cleanly: {}", s.stderr_text());
}
