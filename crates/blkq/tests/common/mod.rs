//! Helpers shared by the binary's integration tests: run `blkq` and check its exit, file legs
//! in a tempdir, the one launcher of a `blkq` that keeps running ([`Launch`], [`Running`]),
//! and on it a running `blkq serve` on a socket ([`Serving`]) and a `blkq serve --raid1
//! --control` driven through its control socket ([`Server`]). Bounded waits only (no timing
//! assertions).
#![allow(dead_code, unused_imports)] // each test file uses its own subset

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use nbd::client::{Client, ClientOptions, Endpoint};

pub const BIN: &str = env!("CARGO_BIN_EXE_blkq");

mod hosts;
mod launch;
mod load;
pub use hosts::{hosts_or_skip, Hosts, BACK_IP, FRONT_IP};
pub use launch::{enter_netns, Launch, Running};
pub use load::{blocks_in, Ledger, Load, BLOCK};

/// `--raid1-create --raid1-assume-clean`, then `--raid1-option O` for each of `options`: a
/// new mirror over legs taken as equal (new sparse files) with no initial resync, so what a
/// recovery copies or a bitmap holds is only what the test writes.
pub fn create_clean<'a>(options: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec!["--raid1-create", "--raid1-assume-clean"];
    for o in options {
        args.extend(["--raid1-option", o]);
    }
    args
}

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

/// Runs `blkq ARGS` to completion in the network namespace `ns`; it must succeed.
pub fn ok_in(ns: &Path, args: &[&str]) -> String {
    let mut cmd = Command::new(BIN);
    cmd.args(args)
        .env("RUST_BACKTRACE", "0")
        .stdin(Stdio::null());
    enter_netns(&mut cmd, ns);
    succeeded(args, cmd.output().unwrap())
}

/// The stdout of `blkq ARGS`, which must have succeeded.
fn succeeded(args: &[&str], o: Output) -> String {
    assert!(
        o.status.success(),
        "blkq {args:?} failed: {}\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8(o.stdout).unwrap()
}

/// Runs `blkq ARGS`, which must succeed; returns its stdout.
pub fn ok(args: &[&str]) -> String {
    succeeded(args, blkq(args))
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

/// Runs `blkq raid status ARGS`, which must answer (exit 0 in sync, 1 degraded, 2 failed; 4
/// is no answer); returns its stdout.
pub fn raid_status(args: &[&str]) -> String {
    let mut all = vec!["raid", "status"];
    all.extend_from_slice(args);
    let o = blkq(&all);
    assert!(
        matches!(o.status.code(), Some(0..=2)),
        "blkq {all:?} did not answer ({}): {}\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8(o.stdout).unwrap()
}

/// Fixtures that hold their process in a field `proc`: they are that [`Running`] too
/// (`Deref`), for its signals, waits and stderr.
macro_rules! holds_running {
    ($($t:ty),*) => {$(
        impl std::ops::Deref for $t {
            type Target = Running;
            fn deref(&self) -> &Running {
                &self.proc
            }
        }

        impl std::ops::DerefMut for $t {
            fn deref_mut(&mut self) -> &mut Running {
                &mut self.proc
            }
        }
    )*};
}

holds_running!(Server, Serving);

/// A running `blkq serve --raid1 LEGS --control`, on a Unix socket in `dir`, its stderr in
/// `DIR/serve.stderr`; killed on drop. The process is its [`Running`] (`Deref`).
pub struct Server {
    proc: Running,
    nbd: PathBuf,
    ctl: PathBuf,
}

impl Server {
    /// Starts the server and waits until both sockets exist (without connecting to them).
    pub fn start(dir: &Path, legs: &str, extra: &[&str]) -> Self {
        Self::launch(dir, legs, extra, |l| l)
    }

    /// As [`Server::start`], with more settings (a network namespace, ...) from `more`.
    pub fn launch(
        dir: &Path,
        legs: &str,
        extra: &[&str],
        more: impl FnOnce(Launch) -> Launch,
    ) -> Self {
        let nbd = dir.join("nbd.sock");
        let ctl = dir.join("ctl.sock");
        let _ = std::fs::remove_file(&nbd);
        let _ = std::fs::remove_file(&ctl);
        let l = Launch::serve(["--raid1", legs, "--no-tcp", "--socket"])
            .arg(&nbd)
            .arg("--control")
            .arg(&ctl)
            .args(extra)
            .stderr_to(&dir.join("serve.stderr"))
            .ready_when_exists(&ctl)
            .ready_when_exists(&nbd)
            .poll_every(Duration::from_millis(50));
        let proc = more(l).start();
        Self { proc, nbd, ctl }
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
        raid_status(&["--control", self.ctl()])
    }

    /// `blkq raid status --json` through the control socket.
    pub fn status_json(&self) -> serde_json::Value {
        let out = raid_status(&["--json", "--control", self.ctl()]);
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

    /// SIGTERM, then a bounded wait (30 s) for the exit; true if it exited 0.
    pub fn stop(&mut self) -> bool {
        self.proc.stop(Duration::from_secs(30))
    }
}

/// A running `blkq serve ARGS --no-tcp --socket DIR/NAME.sock`, its stderr in
/// `DIR/NAME.stderr`; killed on drop. The process is its [`Running`] (`Deref`).
pub struct Serving {
    proc: Running,
    pub sock: PathBuf,
}

impl Serving {
    /// Starts the server and waits (bounded) until its socket accepts connections (the
    /// socket file appears only once the server is up).
    pub fn start(dir: &Path, name: &str, args: &[&str]) -> Self {
        Self::launch(dir, name, args, |l| l)
    }

    /// Makes certificates with `blkq certs DIR/pki --client client1`, then starts `blkq serve
    /// --device mem:16M --tls require` over them, with `more_args`: the server and the
    /// certificates' directory.
    pub fn start_tls(dir: &Path, name: &str, more_args: &[&str]) -> (Self, PathBuf) {
        let pki = dir.join("pki");
        let pki_s = pki.to_str().unwrap();
        ok(&["certs", pki_s, "--client", "client1"]);
        let mut args = vec![
            "--device",
            "mem:16M",
            "--tls",
            "require",
            "--tls-certificates",
            pki_s,
        ];
        args.extend(more_args);
        (Self::start(dir, name, &args), pki)
    }

    /// As [`Serving::start`], with more conditions of readiness (or settings) from `more`.
    pub fn launch(
        dir: &Path,
        name: &str,
        args: &[&str],
        more: impl FnOnce(Launch) -> Launch,
    ) -> Self {
        let sock = dir.join(format!("{name}.sock"));
        let _ = std::fs::remove_file(&sock);
        let l = Launch::serve(args)
            .args(["--no-tcp", "--socket"])
            .arg(&sock)
            .stderr_to(&dir.join(format!("{name}.stderr")))
            .ready_when_connects(&sock);
        Self {
            proc: more(l).start(),
            sock,
        }
    }

    /// As [`Serving::launch`], with the metrics endpoint on: `--metrics 127.0.0.1:0
    /// --metrics-addr-file DIR/metrics.addr` after `args` (one such server a directory),
    /// ready once the address is written. The server and the endpoint's address.
    pub fn with_metrics(
        dir: &Path,
        name: &str,
        args: &[&str],
        more: impl FnOnce(Launch) -> Launch,
    ) -> (Self, String) {
        let file = dir.join("metrics.addr");
        let mut args = args.to_vec();
        args.extend([
            "--metrics",
            "127.0.0.1:0",
            "--metrics-addr-file",
            file.to_str().unwrap(),
        ]);
        let s = Self::launch(dir, name, &args, |l| more(l.ready_when_written(&file)));
        (s, written_addr(&file))
    }

    /// A new NBD connection to the default export.
    pub fn client(&self) -> Client {
        Client::connect(
            &Endpoint::Unix(self.sock.clone()),
            &ClientOptions::default(),
        )
        .unwrap()
    }
}

/// `blkq serve --device SPEC` on TCP `addr` only, in the network namespace `ns` (a host of
/// [`Hosts`]), its stderr in `DIR/NAME.stderr`; ready once it printed its banner.
pub fn serve_on(ns: &Path, dir: &Path, name: &str, spec: &str, addr: &str) -> Running {
    Launch::serve(["--device", spec, "--no-unix", "--listen", addr])
        .stderr_to(&dir.join(format!("{name}.stderr")))
        .in_netns(ns)
        .ready_after_line("Ctrl-C")
        .start()
}

/// The data areas of two leg files compare equal (superblock and bitmap region skipped):
/// `data_offset` and `capacity` as `raid status --json` gives them ([`geometry`]).
pub fn assert_leg_files_equal(a: &Path, b: &Path, data_offset: u64, capacity: u64) {
    use std::os::unix::fs::FileExt;
    const MB: u64 = 1 << 20;
    let (fa, fb) = (
        std::fs::File::open(a).unwrap(),
        std::fs::File::open(b).unwrap(),
    );
    let (mut ba, mut bb) = (vec![0u8; MB as usize], vec![0u8; MB as usize]);
    let mut pos = 0;
    while pos < capacity {
        let n = MB.min(capacity - pos) as usize;
        fa.read_exact_at(&mut ba[..n], data_offset + pos).unwrap();
        fb.read_exact_at(&mut bb[..n], data_offset + pos).unwrap();
        assert!(ba[..n] == bb[..n], "legs differ in the MiB at {pos}");
        pos += n as u64;
    }
}

/// `data_offset` and `capacity` of an array's `raid status --json`.
pub fn geometry(v: &serde_json::Value) -> (u64, u64) {
    (
        v["data_offset"].as_u64().unwrap(),
        v["capacity"].as_u64().unwrap(),
    )
}

/// How many legs of an array's `raid status --json` are in sync.
pub fn legs_in_sync(v: &serde_json::Value) -> usize {
    v["legs"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|l| l["state"] == "in_sync")
        .count()
}

/// The state of leg `slot` in an array's `raid status --json` (`?` when there is none).
pub fn leg_state(v: &serde_json::Value, slot: usize) -> String {
    v["legs"][slot]["state"].as_str().unwrap_or("?").to_string()
}

/// Both legs of a two-leg array in sync, and no sync running.
pub fn in_sync_and_idle(v: &serde_json::Value) -> bool {
    leg_state(v, 0) == "in_sync" && leg_state(v, 1) == "in_sync" && v["sync"]["action"] == "idle"
}

/// The names in the folder `dir`, sorted.
pub fn names_in(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    names
}

/// Runs `blkq serve --device SPEC --no-tcp --socket SOCKET`, which must fail within
/// `limit` (a device another server holds); returns its stderr.
pub fn serve_fails(spec: &str, socket: &Path, limit: Duration) -> String {
    let socket = socket.to_str().unwrap();
    fails_within(
        &["serve", "--device", spec, "--no-tcp", "--socket", socket],
        limit,
    )
}

/// The address in a file `blkq` wrote whole (`--metrics-addr-file`; wait for it with
/// [`Launch::ready_when_written`]), without its newline.
pub fn written_addr(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap().trim().to_string()
}

/// A plain HTTP/1.0 GET of `path` from `addr` (a `--metrics` endpoint): status line and body.
pub fn http_get(addr: &str, path: &str) -> (String, String) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let (head, body) = out.split_once("\r\n\r\n").unwrap();
    (head.lines().next().unwrap().to_string(), body.to_string())
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

/// Sends `byte` on `c` every `every` (never finishing a request) and keeps what comes back,
/// until the server closes the connection: returns what was read. Fails the test if the connection is still open after twice
/// `deadline`, and unless it was cut within half a second before to 2 s after `deadline`.
/// `c` has a read timeout of about 100 ms, so that the bytes go out on time.
pub fn trickle_until_cut<S: std::io::Read + std::io::Write>(
    c: &mut S,
    byte: u8,
    every: Duration,
    deadline: Duration,
) -> Vec<u8> {
    let t0 = Instant::now();
    let mut got = Vec::new();
    let mut next_byte = t0;
    let cut = loop {
        if Instant::now() >= next_byte {
            if c.write_all(&[byte]).is_err() {
                break t0.elapsed();
            }
            next_byte += every;
        }
        let mut b = [0u8; 512];
        match c.read(&mut b) {
            Ok(0) => break t0.elapsed(),
            Ok(n) => got.extend_from_slice(&b[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(_) => break t0.elapsed(),
        }
        assert!(
            t0.elapsed() < deadline * 2,
            "a trickler is still connected after {:?}",
            t0.elapsed()
        );
    };
    assert!(
        cut >= deadline - Duration::from_millis(500) && cut < deadline + Duration::from_secs(2),
        "cut after {cut:?}, the deadline is {deadline:?}"
    );
    got
}

/// Threads of process `pid` (from /proc).
pub fn threads_of(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .count()
}

/// `qemu-io -f raw -c CMD URI`: whether it succeeded, and its output. `None` when qemu-io is
/// not installed.
pub fn qemu_io(uri: &str, cmd: &str) -> Option<(bool, String)> {
    let out = Command::new("qemu-io")
        .args(["-f", "raw", "-c", cmd, uri])
        .stdin(Stdio::null())
        .output()
        .ok()?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // qemu-io exits 0 on some I/O errors: its output says so.
    let failed = !out.status.success() || text.contains("failed") || text.contains("error");
    Some((!failed, text))
}
