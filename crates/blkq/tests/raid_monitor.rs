//! `blkq raid monitor` and the control socket's `monitor`: the built binary, file legs in a
//! tempdir, bounded waits only.

mod common;
use common::*;

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const LEG_SIZE: u64 = 8 << 20;
/// How long an event may take to arrive (bounded waits, not timings).
const WAIT: Duration = Duration::from_secs(20);

fn mirror(dir: &Path) -> (Server, String, String) {
    let (a, b) = (
        leg_file(dir, "a.img", LEG_SIZE).1,
        leg_file(dir, "b.img", LEG_SIZE).1,
    );
    let s = Server::start(
        dir,
        &format!("{a},{b}"),
        &common::create_clean(&["bitmap_chunk=64K"]),
    );
    (s, a, b)
}

/// The next line of `rx` whose JSON `event` is `name`, within [`WAIT`].
fn next_event(rx: &mpsc::Receiver<String>, name: &str) -> serde_json::Value {
    let until = Instant::now() + WAIT;
    loop {
        let left = until.saturating_duration_since(Instant::now());
        let line = rx
            .recv_timeout(left)
            .unwrap_or_else(|_| panic!("no {name:?} event within {WAIT:?}"));
        let v: serde_json::Value = serde_json::from_str(&line).unwrap();
        if v["event"] == name {
            return v;
        }
    }
}

/// `raid monitor` subscribed, then `raid fail 1`: a `leg_failed` line naming slot 1, its spec
/// and its cause arrives, and `--program` runs a script that appends the event to a file.
#[test]
fn monitor_tells_a_failed_leg_and_runs_the_program() {
    let d = tempfile::tempdir().unwrap();
    let (s, _a, b) = mirror(d.path());
    let got = d.path().join("events.txt");
    let prog = d.path().join("prog.sh");
    std::fs::write(
        &prog,
        format!(
            "#!/bin/sh\necho \"$1 $BLKQ_SLOT $BLKQ_LEG\" >> {}\n",
            got.display()
        ),
    )
    .unwrap();
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&prog, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let mut mon = Command::new(BIN)
        .args(["raid", "monitor", "--control", s.ctl(), "--program"])
        .arg(&prog)
        .args(["--program-timeout", "5"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let out = BufReader::new(mon.stdout.take().unwrap());
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for l in out.lines().map_while(Result::ok) {
            if tx.send(l).is_err() {
                break;
            }
        }
    });
    let first = next_event(&rx, "monitoring");
    assert_eq!(first["legs"], "[UU]", "{first}");
    ok(&["raid", "fail", "1", "--control", s.ctl()]);
    let v = next_event(&rx, "leg_failed");
    assert_eq!(v["slot"], 1, "{v}");
    assert_eq!(v["leg"], b.as_str(), "{v}");
    assert!(v["cause"].as_str().unwrap().contains("operator"), "{v}");
    let want = format!("leg_failed 1 {b}");
    let t0 = Instant::now();
    loop {
        let text = std::fs::read_to_string(&got).unwrap_or_default();
        if text.lines().any(|l| l == want) {
            break;
        }
        assert!(
            t0.elapsed() < WAIT,
            "the program did not write {want:?}: {text:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = mon.kill();
    let _ = mon.wait();
}

/// Sends `monitor` on a new connection; returns it and the first line.
fn open_monitor(ctl: &str) -> (UnixStream, serde_json::Value) {
    let mut c = UnixStream::connect(ctl).unwrap();
    c.set_read_timeout(Some(WAIT)).unwrap();
    c.write_all(b"monitor\n").unwrap();
    let mut line = String::new();
    BufReader::new(&c).read_line(&mut line).unwrap();
    (c, serde_json::from_str(&line).unwrap())
}

/// Monitors count against the socket's connections, at most half of them, so commands still
/// get in; one ends when its client goes away (its place is free again), and none holds the
/// server's stop.
#[test]
fn monitors_are_bounded_and_end_with_their_client() {
    let d = tempfile::tempdir().unwrap();
    let (mut s, _, _) = mirror(d.path());
    // MONITORS (4) at once; a fifth is refused, saying why.
    let held: Vec<UnixStream> = (0..4)
        .map(|_| {
            let (c, v) = open_monitor(s.ctl());
            assert_eq!(v["ok"], true, "{v}");
            c
        })
        .collect();
    let (_, v) = open_monitor(s.ctl());
    assert_eq!(v["ok"], false, "{v}");
    assert!(v["error"].as_str().unwrap().contains("monitors"), "{v}");
    assert!(s.status().contains("[UU]"));
    // Their clients go: their places come free (bounded wait).
    drop(held);
    let t0 = Instant::now();
    let _kept = loop {
        let (c, v) = open_monitor(s.ctl());
        if v["ok"] == true {
            break c;
        }
        assert!(t0.elapsed() < WAIT, "monitors gone, still refused: {v}");
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(s.stop(), "serve did not exit cleanly with a monitor open");
}

/// `raid replace`: the new leg's `leg_added` event names its spec, as `raid add`'s does (an
/// operator's program told of it can say which disk took over), and the replaced leg's
/// `leg_removed` names the old one.
#[test]
fn a_replacement_legs_events_name_its_spec() {
    let d = tempfile::tempdir().unwrap();
    let (a, b) = (
        leg_file(d.path(), "a.img", LEG_SIZE).1,
        leg_file(d.path(), "b.img", LEG_SIZE).1,
    );
    let c = leg_file(d.path(), "c.img", LEG_SIZE).1;
    let s = Server::start(
        d.path(),
        &format!("{a},{b}"),
        &common::create_clean(&["bitmap_chunk=64K", "spare_slots=1"]),
    );
    let (mon, first) = open_monitor(s.ctl());
    assert_eq!(first["event"], "monitoring", "{first}");
    ok(&["raid", "replace", "1", &c, "--control", s.ctl()]);
    let mut lines = BufReader::new(&mon).lines();
    let mut next = |name: &str| loop {
        let l = lines
            .next()
            .unwrap_or_else(|| panic!("monitor ended before {name:?}"))
            .unwrap_or_else(|e| panic!("no {name:?} event: {e}"));
        let v: serde_json::Value = serde_json::from_str(&l).unwrap();
        if v["event"] == name {
            return v;
        }
    };
    let added = next("leg_added");
    assert_eq!(added["leg"], c.as_str(), "{added}");
    let removed = next("leg_removed");
    assert_eq!(removed["leg"], b.as_str(), "{removed}");
}
