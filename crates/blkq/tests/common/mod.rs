//! Helpers shared by the binary's integration tests: run `blkq` and check its exit, file legs
//! in a tempdir, and a running `blkq serve --raid1 --control` driven through its control
//! socket. Bounded waits only (no timing assertions).
#![allow(dead_code)] // each test file uses its own subset

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use nbd::client::{Client, ClientOptions, Endpoint};

pub const BIN: &str = env!("CARGO_BIN_EXE_blkq");

/// A sparse file of `size` bytes in `dir`: its path and its device spec (`file:PATH`).
pub fn leg_file(dir: &Path, name: &str, size: u64) -> (PathBuf, String) {
    let p = dir.join(name);
    let f = std::fs::File::create(&p).unwrap();
    f.set_len(size).unwrap();
    let spec = format!("file:{}", p.display());
    (p, spec)
}

/// Runs `blkq ARGS` to completion.
pub fn blkq(args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .env("RUST_BACKTRACE", "0")
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

/// Runs `blkq ARGS`, which must succeed; returns its stdout.
pub fn ok(args: &[&str]) -> String {
    let o = blkq(args);
    assert!(
        o.status.success(),
        "blkq {args:?} failed: {}\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8(o.stdout).unwrap()
}

/// Runs `blkq ARGS`, which must fail; returns its stderr.
pub fn fails(args: &[&str]) -> String {
    let o = blkq(args);
    assert!(
        !o.status.success(),
        "blkq {args:?} should have failed: {}",
        String::from_utf8_lossy(&o.stdout)
    );
    String::from_utf8(o.stderr).unwrap()
}

/// A running `blkq serve --raid1 LEGS --control`, on a Unix socket in `dir`; killed on drop.
pub struct Server {
    child: Child,
    nbd: PathBuf,
    ctl: PathBuf,
}

impl Server {
    /// Starts the server and waits until both sockets exist.
    pub fn start(dir: &Path, legs: &str, extra: &[&str]) -> Self {
        let nbd = dir.join("nbd.sock");
        let ctl = dir.join("ctl.sock");
        let _ = std::fs::remove_file(&nbd);
        let _ = std::fs::remove_file(&ctl);
        let mut args = vec![
            "serve".to_string(),
            "--raid1".into(),
            legs.into(),
            "--no-tcp".into(),
            "--socket".into(),
            nbd.display().to_string(),
            "--control".into(),
            ctl.display().to_string(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        let mut child = Command::new(BIN)
            .args(&args)
            .env("RUST_BACKTRACE", "0")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let t0 = Instant::now();
        while !(ctl.exists() && nbd.exists()) {
            if let Some(st) = child.try_wait().unwrap() {
                panic!("blkq serve exited early: {st}");
            }
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "server did not start"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        Self { child, nbd, ctl }
    }

    /// The control socket's path.
    pub fn ctl(&self) -> &str {
        self.ctl.to_str().unwrap()
    }

    /// A new NBD connection to the array.
    pub fn client(&self) -> Client {
        Client::connect(&Endpoint::Unix(self.nbd.clone()), &ClientOptions::default()).unwrap()
    }

    /// `blkq raid status` through the control socket.
    pub fn status(&self) -> String {
        ok(&["raid", "status", "--control", self.ctl()])
    }

    /// `blkq raid status --json` through the control socket.
    pub fn status_json(&self) -> serde_json::Value {
        let out = ok(&["raid", "status", "--json", "--control", self.ctl()]);
        serde_json::from_str(&out).unwrap()
    }

    /// Polls `status --json` until `what` holds (bounded: fails the test with `why`).
    pub fn wait_for(
        &self,
        what: &dyn Fn(&serde_json::Value) -> bool,
        why: &str,
    ) -> serde_json::Value {
        let t0 = Instant::now();
        loop {
            let v = self.status_json();
            if what(&v) {
                return v;
            }
            assert!(t0.elapsed() < Duration::from_secs(120), "{why}: {v}");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// SIGTERM, then a bounded wait for the exit; true if it exited 0.
    pub fn stop(&mut self) -> bool {
        // SAFETY: kill(2) with the pid of our own child process and a valid signal number.
        unsafe {
            libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM);
        }
        let t0 = Instant::now();
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                return st.success();
            }
            if t0.elapsed() > Duration::from_secs(30) {
                let _ = self.child.kill();
                let _ = self.child.wait();
                return false;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// SIGKILL: no clean stop.
    pub fn kill(&mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// A running `blkq serve ARGS --no-tcp --socket DIR/NAME.sock`, its stderr in
/// `DIR/NAME.stderr`; killed on drop.
pub struct Serving {
    pub child: Child,
    pub sock: PathBuf,
    pub stderr: PathBuf,
}

impl Serving {
    /// Starts the server and waits (bounded) until its socket accepts connections.
    pub fn start(dir: &Path, name: &str, args: &[&str]) -> Self {
        let sock = dir.join(format!("{name}.sock"));
        let stderr = dir.join(format!("{name}.stderr"));
        let _ = std::fs::remove_file(&sock);
        let child = Command::new(BIN)
            .arg("serve")
            .args(args)
            .arg("--no-tcp")
            .arg("--socket")
            .arg(&sock)
            .env("RUST_BACKTRACE", "0")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&stderr).unwrap())
            .spawn()
            .unwrap();
        let mut s = Self {
            child,
            sock,
            stderr,
        };
        let t0 = Instant::now();
        // Until a connection is accepted: the socket file appears only once the server is up.
        while std::os::unix::net::UnixStream::connect(&s.sock).is_err() {
            if let Some(st) = s.child.try_wait().unwrap() {
                panic!("blkq serve exited early: {st}: {}", s.stderr_text());
            }
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "server did not start"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        s
    }

    /// A new NBD connection to the default export.
    pub fn client(&self) -> Client {
        Client::connect(
            &Endpoint::Unix(self.sock.clone()),
            &ClientOptions::default(),
        )
        .unwrap()
    }

    /// What the server wrote on stderr so far.
    pub fn stderr_text(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    /// Sends `sig` to the server.
    pub fn signal(&self, sig: libc::c_int) {
        // SAFETY: kill(2) on our own child's pid with a valid signal number has no memory
        // effects.
        unsafe {
            libc::kill(self.child.id() as libc::pid_t, sig);
        }
    }

    /// Waits (bounded by `limit`, then SIGKILL and a panic) for the server to exit.
    pub fn wait_exit(&mut self, limit: Duration) -> std::process::ExitStatus {
        let t0 = Instant::now();
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                return st;
            }
            if t0.elapsed() > limit {
                let _ = self.child.kill();
                let _ = self.child.wait();
                panic!(
                    "blkq serve did not exit within {limit:?}: {}",
                    self.stderr_text()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Serving {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Runs `blkq ARGS` to its end within `limit` (killed, and the test failed with `what`,
/// otherwise): its exit status, stdout and stderr.
pub fn run_within(
    args: &[&str],
    limit: Duration,
    what: &str,
) -> (std::process::ExitStatus, String, String) {
    let mut child = Command::new(BIN)
        .args(args)
        .env("RUST_BACKTRACE", "0")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Drained on threads: a child that fills a pipe must not stall the wait.
    let drain = |mut r: Box<dyn std::io::Read + Send>| {
        std::thread::spawn(move || {
            let mut text = String::new();
            let _ = r.read_to_string(&mut text);
            text
        })
    };
    let out = drain(Box::new(child.stdout.take().unwrap()));
    let err = drain(Box::new(child.stderr.take().unwrap()));
    let t0 = Instant::now();
    let st = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if t0.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("blkq {args:?} {what} within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    (st, out.join().unwrap(), err.join().unwrap())
}

/// Runs `blkq ARGS`, which must succeed within `limit`; returns its stdout.
pub fn ok_within(args: &[&str], limit: Duration) -> String {
    let (st, out, err) = run_within(args, limit, "got no answer");
    assert!(st.success(), "blkq {args:?} failed: {out}\n{err}");
    out
}

/// Runs `blkq ARGS`, which must fail within `limit` (a server that starts instead is killed
/// and the test fails); returns its stderr.
pub fn fails_within(args: &[&str], limit: Duration) -> String {
    let (st, _, err) = run_within(args, limit, "should have failed, and was still running");
    assert!(!st.success(), "blkq {args:?} should have failed");
    err
}

/// Clients that connect with `connect` and send `byte` every `every` (never finishing what
/// they send), reconnecting whenever the server closes on them, until dropped: a hostile
/// load that holds a line server's slots.
pub struct Tricklers {
    stop: blkq_sync::Arc<blkq_sync::atomic::AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Tricklers {
    pub fn start<S: std::io::Write>(
        connect: impl Fn() -> std::io::Result<S> + Clone + Send + 'static,
        n: usize,
        every: Duration,
        byte: u8,
    ) -> Self {
        use blkq_sync::atomic::Ordering;
        let stop = blkq_sync::Arc::new(blkq_sync::atomic::AtomicBool::new(false));
        let threads = (0..n)
            .map(|_| {
                let (stop, connect) = (stop.clone(), connect.clone());
                std::thread::spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        let Ok(mut s) = connect() else {
                            std::thread::sleep(Duration::from_millis(10));
                            continue;
                        };
                        while !stop.load(Ordering::Relaxed) && s.write_all(&[byte]).is_ok() {
                            std::thread::sleep(every);
                        }
                    }
                })
            })
            .collect();
        Self { stop, threads }
    }
}

impl Drop for Tricklers {
    fn drop(&mut self) {
        self.stop.store(true, blkq_sync::atomic::Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}
