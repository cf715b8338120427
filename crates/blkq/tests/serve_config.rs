//! `blkq serve --config FILE.toml`: the built binary serving from a file, with per-export
//! address allow-lists, read by `nbdinfo --list` (when installed) and `nbd::client`.

mod common;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::{Launch, Running};
use nbd::client::{Endpoint, Handshake};

/// A running `blkq serve --config FILE`, ready once it has printed its URIs and its Unix
/// socket (`DIR/s.sock`) accepts; killed on drop.
struct FromFile {
    proc: Running,
    tcp: SocketAddr,
    sock: PathBuf,
}

impl FromFile {
    fn start(dir: &Path, config: &str) -> Self {
        let file = dir.join("blkq.toml");
        std::fs::write(&file, config).unwrap();
        let sock = dir.join("s.sock");
        let proc = Launch::serve(["--config"])
            .arg(&file)
            .env("RUST_LOG", "info")
            .stderr_to(&dir.join("stderr"))
            .ready_after_line("Ctrl-C")
            .ready_when_connects(&sock)
            .start();
        // The URIs printed at start name the port the kernel chose.
        let tcp = proc
            .stdout_lines()
            .iter()
            .find_map(|l| l.trim().strip_prefix("nbd://"))
            .map(|rest| rest.split('/').next().unwrap().parse().unwrap())
            .unwrap_or_else(|| panic!("no nbd:// URI printed: {}", proc.stderr_text()));
        Self { proc, tcp, sock }
    }
}

fn list(ep: Endpoint) -> Vec<String> {
    let mut h = Handshake::start(ep.connect().unwrap()).unwrap();
    let l = h.list().unwrap().into_iter().map(|(n, _)| n).collect();
    h.abort().unwrap();
    l
}

/// `nbdinfo --list URI`, or `None` when nbdinfo is not installed.
fn nbdinfo_list(uri: &str) -> Option<String> {
    let o = Command::new("nbdinfo")
        .args(["--list", uri])
        .stdin(Stdio::null())
        .output()
        .ok()?;
    assert!(
        o.status.success(),
        "nbdinfo --list {uri}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    Some(String::from_utf8(o.stdout).unwrap())
}

#[test]
fn serves_a_config_file_with_allow_lists() {
    let dir = tempfile::tempdir().unwrap();
    let config = format!(
        r#"
[server]
socket = "{sock}"
listen = "127.0.0.1:0"

[[export]]
name = "open"
device = "mem:1M"

[[export]]
name = "here"
device = "mem:1M"
read_only = true
allow = ["10.0.0.0/8", "127.0.0.1/32"]

[[export]]
name = "there"
device = "mem:1M"
allow = ["10.0.0.0/8"]
"#,
        sock = dir.path().join("s.sock").display()
    );
    let mut s = FromFile::start(dir.path(), &config);

    // Over TCP loopback "there" is invisible and refused; over the Unix socket (governed by
    // its mode) all three are served.
    assert_eq!(list(Endpoint::Tcp(s.tcp)), ["open", "here"]);
    assert_eq!(
        list(Endpoint::Unix(s.sock.clone())),
        ["open", "here", "there"]
    );
    let mut h = Handshake::start(Endpoint::Tcp(s.tcp).connect().unwrap()).unwrap();
    let e = h.go("there").unwrap_err();
    assert_eq!(
        e.option_error(),
        Some(nbd::codec::proto::NBD_REP_ERR_POLICY),
        "{e}"
    );
    let d = h.go("here").unwrap();
    assert!(d.flags.contains(nbd::codec::TransmissionFlags::READ_ONLY));
    drop(h);

    if let Some(out) = nbdinfo_list(&format!("nbd://{}", s.tcp)) {
        assert!(out.contains("open") && out.contains("here"), "{out}");
        assert!(!out.contains("there"), "{out}");
        let unix = nbdinfo_list(&format!("nbd+unix:///?socket={}", s.sock.display())).unwrap();
        assert!(unix.contains("there"), "{unix}");
    } else {
        eprintln!("nbdinfo not installed: listed with nbd::client only");
    }
    assert!(s.proc.stop(Duration::from_secs(60)), "did not stop");
    let log = s.proc.stderr_text();
    assert!(
        log.contains("refused NBD_OPT_GO") && log.contains("address 127.0.0.1"),
        "the log names the rule and the client: {log}"
    );
}

#[test]
fn config_errors_name_the_file_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("bad.toml");
    std::fs::write(
        &f,
        "[server]\nno_tcp = true\n\n[[export]]\ndevice = \"mem:1M\"\nallow = [\"10.0.0.300/8\"]\n",
    )
    .unwrap();
    let err = common::fails_within(
        &["serve", "--config", f.to_str().unwrap()],
        Duration::from_secs(60),
    );
    assert!(err.contains("bad.toml:6: allow"), "{err}");

    std::fs::write(&f, "[server]\nlisten = \"127.0.0.1:0\"\nsockets = \"x\"\n").unwrap();
    let err = common::fails_within(
        &["serve", "--config", f.to_str().unwrap()],
        Duration::from_secs(60),
    );
    assert!(
        err.contains("bad.toml:3:") && err.contains("sockets"),
        "{err}"
    );
}

#[test]
fn config_refuses_other_flags() {
    let err = common::fails_within(
        &[
            "serve",
            "--config",
            "/nonexistent.toml",
            "--device",
            "mem:1M",
        ],
        Duration::from_secs(60),
    );
    assert!(
        err.contains("--config") && err.contains("--device"),
        "{err}"
    );
}

/// A `[[raid1]]` table over blank legs without `create = true` is refused naming that key,
/// not the command line's `--raid1-create`, which `--config` forbids.
#[test]
fn blank_legs_in_a_config_file_name_the_create_key() {
    let dir = tempfile::tempdir().unwrap();
    let (_, a) = common::leg_file(dir.path(), "a.img", 8 << 20);
    let (_, b) = common::leg_file(dir.path(), "b.img", 8 << 20);
    let f = dir.path().join("m.toml");
    std::fs::write(
        &f,
        format!(
            "[server]\nno_tcp = true\nsocket = \"s.sock\"\n\n[[raid1]]\nlegs = [\"{a}\", \
             \"{b}\"]\ncreate = false\n"
        ),
    )
    .unwrap();
    let err = common::fails_within(
        &["serve", "--config", f.to_str().unwrap()],
        Duration::from_secs(60),
    );
    assert!(
        err.contains("create = true") && !err.contains("--raid1-create"),
        "{err}"
    );
}
