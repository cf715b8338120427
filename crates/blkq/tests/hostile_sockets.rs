//! The Unix sockets of `blkq serve` are never open to others, not even for a moment after
//! start: the server runs under `umask 000`, which would make a
//! freshly bound socket 0777, while a process running as an unprivileged user (uid/gid
//! 65534) connects to both paths in a loop and a thread of the test `lstat`s them in a loop.
//!
//! Bound checked: permissions. At no moment is the NBD `--socket` (`--socket-mode 0600`) or the
//! `--control` socket reachable by another user, or visible with a mode wider than 0600.
//!
//! Needs root (to become uid 65534); prints a note and passes otherwise. The unprivileged
//! connector is a `fork`ed child that makes only raw system calls (`socket`, `connect`,
//! `write`, `close`), so forking the multi-threaded test process is safe.

mod common;

use blkq_sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use blkq_sync::{Arc, Mutex};
use std::io::Read;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::{Launch, Running};

/// Starts of the server per test: the unfixed code (bind, then chmod) let the connector in
/// or showed a wide mode on most of them.
const STARTS: usize = 12;
/// The unprivileged user and group.
const NOBODY: libc::uid_t = 65534;

fn is_root() -> bool {
    // SAFETY: geteuid(2) has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// A test directory others may traverse (0755), so that only the sockets' own modes keep
/// the unprivileged connector out.
fn open_dir() -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    std::fs::set_permissions(d.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    d
}

/// As root: an [`open_dir`], the paths of the NBD socket `s.sock` and the control socket
/// `c.sock` in it, and a [`Connector`] trying both; `None` (the test skipped) when not root.
fn connector_scene() -> Option<(tempfile::TempDir, PathBuf, PathBuf, Connector)> {
    if !is_root() {
        eprintln!("note: not root, cannot run a connector as another user: skipped");
        return None;
    }
    let dir = open_dir();
    let sock = dir.path().join("s.sock");
    let ctl = dir.path().join("c.sock");
    let conn = Connector::spawn(&[&sock, &ctl]);
    Some((dir, sock, ctl, conn))
}

/// A child process running as uid/gid 65534 that connects to each of `paths` in a loop and
/// writes the path's index (one byte) to a pipe for every connection that succeeds.
struct Connector {
    pid: libc::pid_t,
    successes: OwnedFd,
}

fn sockaddr(p: &Path) -> (libc::sockaddr_un, libc::socklen_t) {
    use std::os::unix::ffi::OsStrExt;
    // SAFETY: `sockaddr_un` is a plain C struct; all-zero bytes are a valid value.
    let mut a: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    a.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let b = p.as_os_str().as_bytes();
    assert!(b.len() < a.sun_path.len(), "socket path too long: {p:?}");
    for (d, s) in a.sun_path.iter_mut().zip(b) {
        *d = *s as libc::c_char;
    }
    (
        a,
        std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t,
    )
}

impl Connector {
    fn spawn(paths: &[&Path]) -> Self {
        // Everything the child needs is made before fork: after it, only system calls.
        let addrs: Vec<(libc::sockaddr_un, libc::socklen_t)> =
            paths.iter().map(|p| sockaddr(p)).collect();
        let mut fds = [0 as libc::c_int; 2];
        // SAFETY: `fds` is a valid array of two ints for pipe2(2) to fill.
        let r = unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) };
        assert_eq!(r, 0, "pipe2");
        // SAFETY: pipe2 returned two new descriptors that nothing else owns.
        let (rd, wr) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        // A full pipe drops successes instead of blocking the child (one is enough to fail).
        // SAFETY: fcntl(2) on a descriptor we own, with a valid command and flags.
        unsafe { libc::fcntl(wr.as_raw_fd(), libc::F_SETFL, libc::O_NONBLOCK) };
        let parent = std::process::id() as libc::pid_t;
        // SAFETY: the child runs only async-signal-safe system calls on memory prepared before
        // the fork (`addrs`, the descriptors) and leaves with `_exit`, never returning into
        // the test harness.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork");
        if pid == 0 {
            // SAFETY: see above; each call is a plain system call with valid arguments.
            unsafe {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                if libc::getppid() != parent
                    || libc::setgroups(0, std::ptr::null()) != 0
                    || libc::setgid(NOBODY) != 0
                    || libc::setuid(NOBODY) != 0
                    || libc::geteuid() != NOBODY
                {
                    libc::_exit(3);
                }
                // At most a minute, whatever the parent does.
                let mut t0: libc::timespec = std::mem::zeroed();
                libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut t0);
                let mut n: u64 = 0;
                loop {
                    for (i, (a, len)) in addrs.iter().enumerate() {
                        let fd = libc::socket(libc::AF_UNIX, libc::SOCK_STREAM, 0);
                        if fd < 0 {
                            continue;
                        }
                        if libc::connect(fd, (a as *const libc::sockaddr_un).cast(), *len) == 0 {
                            let tag = i as u8;
                            libc::write(wr.as_raw_fd(), (&tag as *const u8).cast(), 1);
                        }
                        libc::close(fd);
                    }
                    n += 1;
                    if n.is_multiple_of(4096) {
                        let mut t: libc::timespec = std::mem::zeroed();
                        libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut t);
                        if t.tv_sec - t0.tv_sec > 60 {
                            libc::_exit(0);
                        }
                    }
                }
            }
        }
        drop(wr);
        // SAFETY: fcntl(2) on a descriptor we own.
        unsafe { libc::fcntl(rd.as_raw_fd(), libc::F_SETFL, libc::O_NONBLOCK) };
        Self { pid, successes: rd }
    }

    /// Successes since the last call, per path index.
    fn take(&self, n: usize) -> Vec<usize> {
        let mut counts = vec![0; n];
        let mut f = std::fs::File::from(self.successes.try_clone().unwrap());
        let mut buf = [0u8; 4096];
        while let Ok(k) = f.read(&mut buf) {
            if k == 0 {
                break;
            }
            for &b in &buf[..k] {
                counts[b as usize] += 1;
            }
        }
        counts
    }

    /// Whether it still runs (it exits 3 if it could not drop its privileges).
    fn alive(&self) -> bool {
        let mut st = 0;
        // SAFETY: waitpid(2) on our own child, WNOHANG.
        unsafe { libc::waitpid(self.pid, &mut st, libc::WNOHANG) == 0 }
    }
}

impl Drop for Connector {
    fn drop(&mut self) {
        // SAFETY: kill(2) and waitpid(2) on our own child.
        unsafe {
            libc::kill(self.pid, libc::SIGKILL);
            libc::waitpid(self.pid, std::ptr::null_mut(), 0);
        }
    }
}

/// A thread that `lstat`s `paths` in a tight loop and records every mode wider than 0600 it
/// sees, with the start it saw it in.
struct Poller {
    stop: Arc<AtomicBool>,
    start: Arc<AtomicUsize>,
    seen: Arc<Mutex<Vec<(usize, PathBuf, u32)>>>,
    thread: Option<std::thread::JoinHandle<u64>>,
}

impl Poller {
    fn spawn(paths: Vec<PathBuf>) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let start = Arc::new(AtomicUsize::new(0));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let thread = {
            let (stop, start, seen) = (stop.clone(), start.clone(), seen.clone());
            std::thread::spawn(move || {
                let mut looks = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    for p in &paths {
                        if let Ok(m) = std::fs::symlink_metadata(p) {
                            let mode = m.permissions().mode() & 0o777;
                            if mode & !0o600 != 0 {
                                seen.lock()
                                    .push((start.load(Ordering::Relaxed), p.clone(), mode));
                            }
                        }
                        looks += 1;
                    }
                }
                looks
            })
        };
        Self {
            stop,
            start,
            seen,
            thread: Some(thread),
        }
    }

    fn finish(mut self) -> (u64, Vec<(usize, PathBuf, u32)>) {
        self.stop.store(true, Ordering::Relaxed);
        let looks = self.thread.take().unwrap().join().unwrap();
        let seen = std::mem::take(&mut *self.seen.lock());
        (looks, seen)
    }
}

/// `blkq serve` (a mirror of two memory legs, so that it has a control socket) under
/// `umask 000`, `--socket-mode MODE`; returns once root can connect to both sockets. Killed
/// on drop.
fn start(dir: &Path, sock: &Path, ctl: &Path, mode: &str) -> Running {
    Launch::serve(["--raid1", "mem:4M,mem:4M", "--raid1-create", "--no-tcp"])
        .arg("--socket")
        .arg(sock)
        .args(["--socket-mode", mode])
        .arg("--control")
        .arg(ctl)
        .stderr_to(&dir.join("serve.stderr"))
        .umask(0)
        .ready_when_connects(sock)
        .ready_when_connects(ctl)
        .poll_every(Duration::from_millis(1))
        .start()
}

/// Bound: permissions. Over [`STARTS`] starts under `umask 000` with `--socket-mode 0600`, the
/// unprivileged connector never connects to the NBD socket or the control socket, and
/// neither path is ever seen with a mode wider than 0600.
#[test]
fn sockets_are_private_from_the_first_moment() {
    let Some((dir, sock, ctl, conn)) = connector_scene() else {
        return;
    };
    let poll = Poller::spawn(vec![sock.clone(), ctl.clone()]);
    let mut bad_starts = Vec::new();
    for i in 0..STARTS {
        poll.start.store(i, Ordering::Relaxed);
        let mut srv = start(dir.path(), &sock, &ctl, "0600");
        // Let the connector try the finished sockets too.
        std::thread::sleep(Duration::from_millis(20));
        srv.kill();
        let got = conn.take(2);
        let wide = poll.seen.lock().iter().any(|(s, ..)| *s == i);
        if got.iter().any(|&n| n > 0) || wide {
            bad_starts.push((i, got, wide));
        }
    }
    assert!(conn.alive(), "the connector could not become uid {NOBODY}");
    let (looks, seen) = poll.finish();
    assert!(looks > 1000, "the poller barely ran ({looks} looks)");
    assert!(
        bad_starts.is_empty() && seen.is_empty(),
        "{} of {STARTS} starts were open to others (start, [nbd, control] connections by \
         uid {NOBODY}, wide mode seen): {bad_starts:?}; wide modes seen: {:?}",
        bad_starts.len(),
        &seen[..seen.len().min(10)]
    );
}

/// The control of the test above: in the same setup, a socket the server makes 0777 on
/// purpose (`--socket-mode 0777`) IS reached by the unprivileged connector, so the directory
/// is traversable and the connector really runs as another user.
#[test]
fn the_connector_reaches_a_socket_made_0777() {
    let Some((dir, sock, ctl, conn)) = connector_scene() else {
        return;
    };
    let mut srv = start(dir.path(), &sock, &ctl, "0777");
    let t0 = Instant::now();
    let mut got = [0, 0];
    while got[0] == 0 && t0.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(20));
        for (g, n) in got.iter_mut().zip(conn.take(2)) {
            *g += n;
        }
    }
    assert!(conn.alive(), "the connector could not become uid {NOBODY}");
    srv.kill();
    got[1] += conn.take(2)[1];
    assert!(
        got[0] > 0,
        "uid {NOBODY} never reached a 0777 socket: the test proves nothing"
    );
    assert_eq!(got[1], 0, "uid {NOBODY} reached the 0600 control socket");
}
