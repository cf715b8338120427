//! Incremental backup through real clients, end to end: `blkq serve` of a file image with a
//! control socket, a dirty bitmap added with `blkq bitmap add`, a full copy with `nbdcopy`,
//! random writes by a client, `blkq bitmap rotate`, a copy of only the dirty extents onto the
//! full copy (`scripts/cbt-backup.py`, libnbd), and `qemu-img compare` of the copy against the
//! export. Again with the server SIGKILLed between the writes and the backup, and in the middle
//! of writes: the bitmap read after the restart may be larger than the changes, never smaller
//! (every changed, or acknowledged, granule is dirty), and the copy still compares equal. Skipped (said on stderr) where nbdcopy,
//! qemu-img or python3-libnbd is missing; `scripts/test.sh` installs them.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::{ok, Launch, Running};
use nbd::client::{Client, ClientOptions, Endpoint};
use nbd::codec::proto::CmdFlags;
use nbd::codec::transmission::Request;

/// The export: 64 MiB, bitmaps of the default 64 KiB granularity.
const SIZE: u64 = 64 << 20;
const GRAIN: u64 = 64 << 10;
const BLOCK: u64 = 4096;
/// Random 4 KiB writes per backup round (about 5% of the granules).
const WRITES: usize = 64;
const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../scripts/cbt-backup.py");

/// Whether the real clients this test drives are installed (else it says so and passes).
fn clients_or_skip() -> bool {
    for (program, arg) in [
        ("nbdcopy", "--version"),
        ("qemu-img", "--version"),
        ("/usr/bin/python3", "-c"),
    ] {
        let mut c = Command::new(program);
        c.arg(arg);
        if arg == "-c" {
            c.arg("import nbd");
        }
        if !c.output().is_ok_and(|o| o.status.success()) {
            eprintln!("skipped: {program} (or python3-libnbd) is not installed");
            return false;
        }
    }
    true
}

/// `blkq serve --device file:IMG --control CTL` on a Unix socket in `dir`; ready once both
/// sockets exist.
struct Backup {
    dir: PathBuf,
    img: PathBuf,
    sock: PathBuf,
    ctl: PathBuf,
    server: Option<Running>,
}

impl Backup {
    fn new(dir: &Path) -> Self {
        let (img, _) = common::leg_file(dir, "disk.img", SIZE);
        Self {
            dir: dir.to_path_buf(),
            img,
            sock: dir.join("nbd.sock"),
            ctl: dir.join("ctl.sock"),
            server: None,
        }
    }

    fn start(&mut self) {
        let _ = std::fs::remove_file(&self.sock);
        let _ = std::fs::remove_file(&self.ctl);
        let spec = format!("file:{}", self.img.display());
        let proc = Launch::serve(["--device", &spec, "--no-tcp", "--socket"])
            .arg(&self.sock)
            .arg("--control")
            .arg(&self.ctl)
            .stderr_to(&self.dir.join("serve.stderr"))
            .ready_when_exists(&self.ctl)
            .ready_when_connects(&self.sock)
            .start();
        self.server = Some(proc);
    }

    fn sigkill(&mut self) {
        self.server.take().unwrap().kill();
    }

    fn uri(&self) -> String {
        format!("nbd+unix:///?socket={}", self.sock.display())
    }

    fn bitmap(&self, args: &[&str]) -> String {
        let mut a = vec!["bitmap"];
        a.extend_from_slice(args);
        a.extend_from_slice(&["--control", self.ctl.to_str().unwrap()]);
        ok(&a)
    }

    fn client(&self) -> Client {
        Client::connect(
            &Endpoint::Unix(self.sock.clone()),
            &ClientOptions::default(),
        )
        .unwrap()
    }

    /// `WRITES` random 4 KiB writes (seeded), acknowledged one by one; the granules they
    /// touched.
    fn random_writes(&self, seed: u64) -> Vec<u64> {
        let mut c = self.client();
        let mut x = seed | 1;
        let mut touched = Vec::new();
        for i in 0..WRITES {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let offset = (x % (SIZE / BLOCK)) * BLOCK;
            let data = testkit::pattern(seed + i as u64, BLOCK as usize);
            c.write(offset, &data, CmdFlags::empty()).unwrap();
            touched.push(offset / GRAIN);
        }
        c.disconnect().unwrap();
        touched.sort();
        touched.dedup();
        touched
    }

    /// The dirty granules of bitmap `name`, read by libnbd (the script's `--map`).
    fn dirty_granules(&self, name: &str) -> Vec<u64> {
        let out = run(Command::new(SCRIPT).args(["--bitmap", name, "--map", &self.uri()]));
        let mut g = Vec::new();
        for l in out.lines() {
            let f: Vec<u64> = l.split_whitespace().map(|v| v.parse().unwrap()).collect();
            assert!(
                f[0].is_multiple_of(GRAIN) && f[1].is_multiple_of(GRAIN),
                "{out}"
            );
            g.extend(f[0] / GRAIN..(f[0] + f[1]) / GRAIN);
        }
        g
    }

    /// The full copy, with nbdcopy, into `copy`.
    fn full_copy(&self, copy: &Path) {
        run(Command::new("nbdcopy").arg(self.uri()).arg(copy));
    }

    /// The incremental copy of bitmap `name`'s dirty extents onto `copy`: bytes copied.
    fn incremental(&self, name: &str, copy: &Path) -> u64 {
        let out = Command::new(SCRIPT)
            .args(["--bitmap", name, &self.uri()])
            .arg(copy)
            .output()
            .unwrap();
        assert!(out.status.success(), "cbt-backup.py: {out:?}");
        let stats = String::from_utf8(out.stderr).unwrap();
        let v: serde_json::Value = serde_json::from_str(stats.trim()).unwrap();
        v["bytes"].as_u64().unwrap()
    }

    /// `qemu-img compare` of `copy` against the export: equal, or the test fails.
    fn assert_equal(&self, copy: &Path) {
        run(Command::new("qemu-img")
            .args(["compare", "-f", "raw", "-F", "raw"])
            .arg(copy)
            .arg(self.uri()));
    }
}

/// Runs a client; it must succeed; its stdout.
/// A started server whose export has data everywhere (random writes with `seed`, so that a
/// missed extent cannot hide behind zeroes), a clean bitmap `b0` added after them, and a full
/// copy of the export taken then: the state every incremental test starts from. `None` (the
/// test is skipped) without the clients. The directory lives as long as the test keeps it.
fn backed_up(seed: u64) -> Option<(tempfile::TempDir, Backup, PathBuf)> {
    if !clients_or_skip() {
        return None;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut b = Backup::new(dir.path());
    b.start();
    let copy = dir.path().join("backup.img");
    b.random_writes(seed);
    b.bitmap(&["add", "b0"]);
    b.full_copy(&copy);
    Some((dir, b, copy))
}

fn run(c: &mut Command) -> String {
    let out = c.output().unwrap();
    assert!(out.status.success(), "{c:?}: {out:?}");
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn incremental_backup_of_the_dirty_extents_equals_the_export() {
    let Some((_dir, b, copy)) = backed_up(1) else {
        return;
    };
    let touched = b.random_writes(2);
    // Exactly the touched granules: the bitmap was clean when the writes began.
    assert_eq!(b.dirty_granules("b0"), touched);
    b.bitmap(&["rotate", "b0", "b1"]);
    // Writes after the rotation go to b1 only.
    let later = b.random_writes(3);
    assert_eq!(b.dirty_granules("b0"), touched);
    assert_eq!(b.dirty_granules("b1"), later);
    // b0's extents bring the copy to the export as it was at the rotation; b1's the rest.
    let copied = b.incremental("b0", &copy);
    assert_eq!(copied, touched.len() as u64 * GRAIN);
    b.bitmap(&["rotate", "b1", "b2"]);
    b.incremental("b1", &copy);
    b.assert_equal(&copy);
}

#[test]
fn after_a_sigkill_the_bitmap_still_covers_every_write() {
    let Some((_dir, mut b, copy)) = backed_up(4) else {
        return;
    };
    let touched = b.random_writes(5);
    b.sigkill();
    b.start();
    // Larger than the changes is allowed, smaller never: every touched granule is dirty.
    assert_covered(&b.dirty_granules("b0"), &touched, "written");
    b.bitmap(&["rotate", "b0", "b1"]);
    let copied = b.incremental("b0", &copy);
    assert!(copied >= touched.len() as u64 * GRAIN);
    b.assert_equal(&copy);
}

#[test]
fn a_sigkill_in_the_middle_of_writes_leaves_no_change_uncovered() {
    let Some((_dir, mut b, copy)) = backed_up(6) else {
        return;
    };
    // A writer keeps 8 random writes in flight and reports each acknowledged one; the server
    // is killed under it. A write in flight at the kill may or may not be on disk: if it is,
    // its bit was made durable before it went down, so the copy still compares equal.
    let mut c = b.client();
    let (tx, rx) = std::sync::mpsc::channel();
    let writer = std::thread::spawn(move || {
        let mut in_flight = std::collections::HashMap::new();
        let mut acked = Vec::new();
        let mut x: u64 = 0x2545_f491_4f6c_dd1d;
        for i in 0u64.. {
            while in_flight.len() < 8 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let offset = (x % (SIZE / BLOCK)) * BLOCK;
                let req = Request::new(nbd::codec::Command::Write, 0, offset, BLOCK);
                let Ok(cookie) = c.send(req, &testkit::pattern(i, BLOCK as usize)) else {
                    return acked;
                };
                in_flight.insert(cookie, offset / GRAIN);
            }
            match c.recv() {
                Ok(r) if r.error == 0 => {
                    acked.extend(in_flight.remove(&r.cookie));
                    // The test may have stopped listening: the kill is under way.
                    let _ = tx.send(());
                }
                _ => return acked,
            }
        }
        acked
    });
    for _ in 0..WRITES * 4 {
        rx.recv().unwrap();
    }
    b.sigkill();
    let mut acked = writer.join().unwrap();
    acked.sort();
    acked.dedup();
    assert!(
        acked.len() >= WRITES,
        "{} granules acknowledged",
        acked.len()
    );
    b.start();
    assert_covered(&b.dirty_granules("b0"), &acked, "acknowledged");
    b.bitmap(&["rotate", "b0", "b1"]);
    b.incremental("b0", &copy);
    b.assert_equal(&copy);
}

/// Every granule of `changed` is in `dirty` (sorted): after a crash a bitmap may say
/// more changed, never less.
fn assert_covered(dirty: &[u64], changed: &[u64], what: &str) {
    let missed: Vec<u64> = changed
        .iter()
        .filter(|g| dirty.binary_search(g).is_err())
        .copied()
        .collect();
    assert!(
        missed.is_empty(),
        "granules {what} but clean after the crash: {missed:?}"
    );
}

/// A server whose block status answers a zero-length extent (a protocol error: an extent is
/// never empty) stops the script with an error naming it, instead of asking again for ever.
/// Needs python3 only: libnbd's module is stood in for by one that answers as that server.
#[test]
fn a_zero_length_extent_stops_the_script() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("nbd.py"),
        "class NBD:\n\
         \x20   def add_meta_context(self, c): self.c = c\n\
         \x20   def connect_uri(self, u): pass\n\
         \x20   def can_meta_context(self, c): return True\n\
         \x20   def get_size(self): return 1 << 20\n\
         \x20   def block_status(self, span, offset, cb):\n\
         \x20       cb(self.c, offset, [0, 1, 4096, 0], 0)\n\
         \x20   def shutdown(self): pass\n",
    )
    .unwrap();
    let mut child = Command::new("/usr/bin/python3")
        .args([SCRIPT, "--bitmap", "b", "--map", "nbd://x/"])
        .env("PYTHONPATH", dir.path())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let until = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if std::time::Instant::now() > until {
            child.kill().unwrap();
            child.wait().unwrap();
            panic!("cbt-backup.py still running after 10 s on a zero-length extent");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    let mut err = String::new();
    std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err).unwrap();
    assert!(!status.success(), "{err}");
    assert!(err.contains("zero-length extent at 0"), "{err}");
}

/// A missing target, or a server that does not answer, is said in one line naming it, not
/// with a Python traceback.
#[test]
fn cbt_backup_py_names_a_missing_target_without_a_traceback() {
    if !clients_or_skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("none.sock");
    let uri = format!("nbd+unix:///?socket={}", sock.display());
    let target = dir.path().join("missing.img");
    let target_s = target.to_str().unwrap();
    for (args, says) in [
        (vec!["--bitmap", "b", uri.as_str(), target_s], target_s),
        (vec!["--bitmap", "b", uri.as_str(), "--map"], uri.as_str()),
    ] {
        let out = Command::new("/usr/bin/python3")
            .arg(SCRIPT)
            .args(&args)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?}");
        assert!(
            !err.contains("Traceback") && err.contains("cbt-backup:") && err.contains(says),
            "{args:?}: {err}"
        );
    }
}
