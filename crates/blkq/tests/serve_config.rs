//! `blkq serve --config FILE.toml`: the built binary serving from a file, with per-export
//! address allow-lists, read by `nbdinfo --list` (when installed) and `nbd::client`.

mod common;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nbd::client::{Endpoint, Handshake};

/// A running `blkq serve --config FILE`; killed on drop.
struct FromFile {
    child: Child,
    tcp: SocketAddr,
    sock: PathBuf,
    stderr: PathBuf,
}

impl FromFile {
    fn start(dir: &Path, config: &str) -> Self {
        let file = dir.join("blkq.toml");
        std::fs::write(&file, config).unwrap();
        let stderr = dir.join("stderr");
        let mut child = Command::new(common::BIN)
            .arg("serve")
            .arg("--config")
            .arg(&file)
            .env("RUST_BACKTRACE", "0")
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&stderr).unwrap())
            .spawn()
            .unwrap();
        // The URIs printed at start name the port the kernel chose.
        let out = BufReader::new(child.stdout.take().unwrap());
        let mut tcp = None;
        for line in out.lines() {
            let line = line.unwrap();
            if let Some(rest) = line.trim().strip_prefix("nbd://") {
                let addr = rest.split('/').next().unwrap();
                tcp = Some(addr.parse().unwrap());
            }
            if line.starts_with("Ctrl-C") {
                break;
            }
        }
        let tcp = tcp.unwrap_or_else(|| {
            panic!(
                "no nbd:// URI printed: {}",
                std::fs::read_to_string(&stderr).unwrap_or_default()
            )
        });
        let sock = dir.join("s.sock");
        let t0 = Instant::now();
        while std::os::unix::net::UnixStream::connect(&sock).is_err() {
            assert!(t0.elapsed() < Duration::from_secs(60), "no socket");
            std::thread::sleep(Duration::from_millis(20));
        }
        Self {
            child,
            tcp,
            sock,
            stderr,
        }
    }

    fn stop(&mut self) -> bool {
        // SAFETY: kill(2) on our own child's pid with a valid signal number.
        unsafe {
            libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM);
        }
        let t0 = Instant::now();
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                return st.success();
            }
            assert!(t0.elapsed() < Duration::from_secs(60), "did not stop");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for FromFile {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
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
        Some(nbd::proto::NBD_REP_ERR_POLICY),
        "{e}"
    );
    let d = h.go("here").unwrap();
    assert!(d.flags.contains(nbd::TransmissionFlags::READ_ONLY));
    drop(h);

    if let Some(out) = nbdinfo_list(&format!("nbd://{}", s.tcp)) {
        assert!(out.contains("open") && out.contains("here"), "{out}");
        assert!(!out.contains("there"), "{out}");
        let unix = nbdinfo_list(&format!("nbd+unix:///?socket={}", s.sock.display())).unwrap();
        assert!(unix.contains("there"), "{unix}");
    } else {
        eprintln!("nbdinfo not installed: listed with nbd::client only");
    }
    assert!(s.stop());
    let log = std::fs::read_to_string(&s.stderr).unwrap();
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
