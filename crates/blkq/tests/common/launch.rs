//! The one launcher of the built `blkq` for tests that keep it running: [`Launch`] says how to
//! start it and how it shows that it is ready; [`Running`] is the process, killed on drop.

use std::ffi::OsStr;
use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use super::BIN;

/// How long a launched `blkq` may take to become ready before the test fails.
const READY_LIMIT: Duration = Duration::from_secs(60);

/// One sign of readiness; [`Launch::start`] waits for all of them, in the order given.
enum Ready {
    /// A Unix socket that accepts a connection (the probe is a connection the server sees).
    Connects(PathBuf),
    /// A path that exists (no connection made).
    Exists(PathBuf),
    /// A file whose text ends with a newline (an address file written whole).
    Written(PathBuf),
    /// A TCP address that accepts a connection from inside a network namespace.
    TcpIn(PathBuf, std::net::SocketAddr),
}

impl Ready {
    fn holds(&self) -> bool {
        match self {
            Ready::Connects(p) => std::os::unix::net::UnixStream::connect(p).is_ok(),
            Ready::Exists(p) => p.exists(),
            Ready::Written(p) => std::fs::read_to_string(p).is_ok_and(|t| t.ends_with('\n')),
            Ready::TcpIn(ns, addr) => connects_in(ns, *addr),
        }
    }
}

/// Makes `cmd` run in the network namespace `ns` (opened here; `setns(2)` between fork and
/// exec).
pub fn enter_netns(cmd: &mut Command, ns: &Path) {
    use std::os::fd::{AsRawFd, OwnedFd};
    let fd: OwnedFd = std::fs::File::open(ns)
        .unwrap_or_else(|e| panic!("open {}: {e}", ns.display()))
        .into();
    // SAFETY: setns(2) is a plain system call (async-signal-safe) on a descriptor the
    // closure owns, which stays open until the Command (and so the closure) is dropped.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setns(fd.as_raw_fd(), libc::CLONE_NEWNET) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// Whether a TCP connection to `addr` succeeds from the network namespace `ns` (on a thread
/// of its own: a namespace is per thread).
fn connects_in(ns: &Path, addr: std::net::SocketAddr) -> bool {
    use std::os::fd::AsRawFd;
    let Ok(f) = std::fs::File::open(ns) else {
        return false;
    };
    std::thread::spawn(move || {
        // SAFETY: setns(2) on a descriptor this thread owns; it moves only this thread.
        if unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
            return false;
        }
        std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(500)).is_ok()
    })
    .join()
    .unwrap_or(false)
}

/// A builder for a long-running `blkq ARGS`: its arguments and environment (always
/// `RUST_BACKTRACE=0`, stdin and stdout `/dev/null`), where its stderr goes, and what it must
/// show before [`Launch::start`] returns: a stdout line ([`Launch::ready_after_line`]), a
/// socket that accepts, a path that exists, a file written whole. Bounded: the test fails if
/// `blkq` exits or is not ready within 60 s.
pub struct Launch {
    cmd: Command,
    what: String,
    stderr: Option<PathBuf>,
    line: Option<String>,
    ready: Vec<Ready>,
    poll: Duration,
}

impl Launch {
    /// `blkq ARGS`.
    pub fn new<S: AsRef<OsStr>>(args: impl IntoIterator<Item = S>) -> Self {
        Self::program(BIN, args)
    }

    /// Another program (a peer server such as nbdkit), started and awaited the same way.
    pub fn program<S: AsRef<OsStr>>(
        program: impl AsRef<OsStr>,
        args: impl IntoIterator<Item = S>,
    ) -> Self {
        let program = program.as_ref();
        let mut cmd = Command::new(program);
        cmd.env("RUST_BACKTRACE", "0")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let what = Path::new(program)
            .file_name()
            .unwrap_or(program)
            .to_string_lossy()
            .into_owned();
        Self {
            cmd,
            what,
            stderr: None,
            line: None,
            ready: Vec::new(),
            poll: Duration::from_millis(20),
        }
        .args(args)
    }

    /// `blkq serve ARGS`.
    pub fn serve<S: AsRef<OsStr>>(args: impl IntoIterator<Item = S>) -> Self {
        Self::new(["serve"]).args(args)
    }

    /// More arguments.
    pub fn args<S: AsRef<OsStr>>(mut self, args: impl IntoIterator<Item = S>) -> Self {
        for a in args {
            let a = a.as_ref();
            self.what.push(' ');
            self.what.push_str(&a.to_string_lossy());
            self.cmd.arg(a);
        }
        self
    }

    /// One more argument.
    pub fn arg(self, a: impl AsRef<OsStr>) -> Self {
        self.args([a])
    }

    /// An environment variable.
    pub fn env(mut self, key: &str, val: &str) -> Self {
        self.cmd.env(key, val);
        self
    }

    /// Writes stderr to the file `path` (created or truncated), to read with
    /// [`Running::stderr_text`] and to show when the start fails.
    pub fn stderr_to(mut self, path: &Path) -> Self {
        self.cmd.stderr(std::fs::File::create(path).unwrap());
        self.stderr = Some(path.to_path_buf());
        self
    }

    /// Runs `blkq` under `umask(mask)`.
    pub fn umask(mut self, mask: libc::mode_t) -> Self {
        // SAFETY: umask(2) is async-signal-safe and cannot fail, so it may run between fork
        // and exec.
        unsafe {
            self.cmd.pre_exec(move || {
                libc::umask(mask);
                Ok(())
            });
        }
        self
    }

    /// Runs the program in the network namespace `ns` (a path such as `/run/netns/NAME`).
    pub fn in_netns(mut self, ns: &Path) -> Self {
        enter_netns(&mut self.cmd, ns);
        self
    }

    /// Ready once stdout has shown a line starting with `prefix`: stdout is a pipe, and the
    /// lines up to that one are kept ([`Running::stdout_lines`]). Checked before the others.
    pub fn ready_after_line(mut self, prefix: &str) -> Self {
        self.cmd.stdout(Stdio::piped());
        self.line = Some(prefix.into());
        self
    }

    /// Ready once the Unix socket `path` accepts a connection.
    pub fn ready_when_connects(mut self, path: &Path) -> Self {
        self.ready.push(Ready::Connects(path.into()));
        self
    }

    /// Ready once `path` exists (without connecting to it).
    pub fn ready_when_exists(mut self, path: &Path) -> Self {
        self.ready.push(Ready::Exists(path.into()));
        self
    }

    /// Ready once `addr` accepts a TCP connection from the network namespace `ns` (the probe
    /// is a connection the server sees).
    pub fn ready_when_tcp_in(mut self, ns: &Path, addr: &str) -> Self {
        self.ready
            .push(Ready::TcpIn(ns.into(), addr.parse().expect("an IP:PORT")));
        self
    }

    /// Ready once the file `path` holds text ending with a newline.
    pub fn ready_when_written(mut self, path: &Path) -> Self {
        self.ready.push(Ready::Written(path.into()));
        self
    }

    /// How often readiness is polled (default 20 ms).
    pub fn poll_every(mut self, every: Duration) -> Self {
        self.poll = every;
        self
    }

    /// Starts `blkq` and waits until it is ready (every condition given holds).
    pub fn start(mut self) -> Running {
        let child = self.cmd.spawn().unwrap();
        let mut r = Running {
            child,
            what: self.what,
            stderr: self.stderr,
            _stdout: None,
            lines: Vec::new(),
        };
        if let Some(prefix) = self.line {
            let mut out = BufReader::new(r.child.stdout.take().unwrap());
            loop {
                let mut line = String::new();
                if out.read_line(&mut line).unwrap() == 0 {
                    let st = r.child.wait().unwrap();
                    panic!(
                        "{} closed stdout before a line starting with {prefix:?} ({st}): {:?}\n{}",
                        r.what,
                        r.lines,
                        r.stderr_text()
                    );
                }
                let line = line.trim_end_matches('\n').to_string();
                let done = line.starts_with(&prefix);
                r.lines.push(line);
                if done {
                    break;
                }
            }
            r._stdout = Some(out.into_inner());
        }
        let t0 = Instant::now();
        // In order, and a sign that held is not looked at again: a probe that connects is a
        // connection the server counts, and tests that count connections expect exactly one.
        let mut pending = std::mem::take(&mut self.ready).into_iter().peekable();
        while let Some(next) = pending.peek() {
            if next.holds() {
                pending.next();
                continue;
            }
            if let Some(st) = r.try_wait() {
                panic!("{} exited early: {st}: {}", r.what, r.stderr_text());
            }
            assert!(
                t0.elapsed() < READY_LIMIT,
                "{} was not ready within {READY_LIMIT:?}: {}",
                r.what,
                r.stderr_text()
            );
            std::thread::sleep(self.poll);
        }
        r
    }
}

/// A running `blkq` from [`Launch::start`]; killed (and reaped) on drop if still running.
pub struct Running {
    child: Child,
    what: String,
    stderr: Option<PathBuf>,
    /// Kept open once read from: later lines must not meet a closed pipe.
    _stdout: Option<ChildStdout>,
    lines: Vec<String>,
}

impl Running {
    /// The process id.
    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// Its exit status, if it has exited (without waiting).
    pub fn try_wait(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().unwrap()
    }

    /// The stdout lines read while waiting for [`Launch::ready_after_line`]'s, that one last.
    pub fn stdout_lines(&self) -> &[String] {
        &self.lines
    }

    /// What it wrote on stderr so far ([`Launch::stderr_to`]; empty otherwise).
    pub fn stderr_text(&self) -> String {
        self.stderr
            .as_ref()
            .and_then(|p| std::fs::read_to_string(p).ok())
            .unwrap_or_default()
    }

    /// Sends `sig`.
    pub fn signal(&self, sig: libc::c_int) {
        // SAFETY: kill(2) on our own child's pid with a valid signal number has no memory
        // effects.
        unsafe {
            libc::kill(self.child.id() as libc::pid_t, sig);
        }
    }

    /// Waits (bounded by `limit`, then SIGKILL and a panic) for it to exit.
    pub fn wait_exit(&mut self, limit: Duration) -> ExitStatus {
        match self.wait_within(limit) {
            Some(st) => st,
            None => panic!(
                "{} did not exit within {limit:?}: {}",
                self.what,
                self.stderr_text()
            ),
        }
    }

    /// SIGTERM, then a wait bounded by `limit` (then SIGKILL); true if it exited 0 in time.
    pub fn stop(&mut self, limit: Duration) -> bool {
        self.signal(libc::SIGTERM);
        self.wait_within(limit).is_some_and(|st| st.success())
    }

    /// SIGKILL: no clean stop.
    pub fn kill(&mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }

    /// Its exit status within `limit`; `None`, and killed, if it is still running then.
    fn wait_within(&mut self, limit: Duration) -> Option<ExitStatus> {
        let t0 = Instant::now();
        loop {
            if let Some(st) = self.try_wait() {
                return Some(st);
            }
            if t0.elapsed() > limit {
                let _ = self.child.kill();
                let _ = self.child.wait();
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
