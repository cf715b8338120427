//! `blkq serve` readiness: `--ready-fd N` and `NOTIFY_SOCKET` (sd_notify). When READY=1
//! arrives every listener accepts already. The built binary.

mod common;

use std::io::Read;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::{UnixDatagram, UnixStream};
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::Duration;

struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn serve(
    dir: &std::path::Path,
    extra: impl FnOnce(&mut Command),
) -> (Child, std::path::PathBuf, std::path::PathBuf) {
    let sock = dir.join("s.sock");
    let ctl = dir.join("c.sock");
    let mut cmd = Command::new(common::BIN);
    cmd.args(["serve", "--device", "mem:1M", "--no-tcp", "--socket"])
        .arg(&sock)
        .arg("--control")
        .arg(&ctl)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    extra(&mut cmd);
    (Child(cmd.spawn().unwrap()), sock, ctl)
}

#[test]
fn ready_fd_says_ready_once_the_sockets_accept() {
    let dir = tempfile::tempdir().unwrap();
    let mut fds = [0; 2];
    // SAFETY: `fds` is a valid out-array of two descriptors.
    assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
    // SAFETY: pipe2 returned two new descriptors this test owns.
    let (rd, wr) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    let w = wr.as_raw_fd();
    let (_child, sock, ctl) = serve(dir.path(), |cmd| {
        cmd.arg("--ready-fd").arg("7");
        // SAFETY: dup2 is async-signal-safe; it gives the child descriptor 7 (not close-on-exec).
        unsafe {
            cmd.pre_exec(move || {
                if libc::dup2(w, 7) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    });
    drop(wr);
    let mut got = String::new();
    std::fs::File::from(rd).read_to_string(&mut got).unwrap();
    assert_eq!(got, "READY=1\n");
    UnixStream::connect(&sock).expect("the NBD socket accepts at READY=1");
    UnixStream::connect(&ctl).expect("the control socket accepts at READY=1");
}

#[test]
fn notify_socket_gets_ready_then_stopping() {
    let dir = tempfile::tempdir().unwrap();
    let ns = dir.path().join("notify");
    let d = UnixDatagram::bind(&ns).unwrap();
    d.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let (child, sock, ctl) = serve(dir.path(), |cmd| {
        cmd.env("NOTIFY_SOCKET", &ns);
    });
    let mut buf = [0u8; 512];
    let n = d.recv(&mut buf).unwrap();
    let msg = String::from_utf8_lossy(&buf[..n]).to_string();
    assert!(msg.contains("READY=1") && msg.contains("STATUS="), "{msg}");
    UnixStream::connect(&sock).expect("the NBD socket accepts at READY=1");
    UnixStream::connect(&ctl).expect("the control socket accepts at READY=1");
    // SAFETY: kill(2) on the child's pid.
    unsafe { libc::kill(child.0.id() as i32, libc::SIGTERM) };
    let n = d.recv(&mut buf).unwrap();
    let msg = String::from_utf8_lossy(&buf[..n]).to_string();
    assert!(msg.contains("STOPPING=1"), "{msg}");
}

#[test]
fn a_control_command_with_wait_started_with_the_server_finds_the_socket() {
    let dir = tempfile::tempdir().unwrap();
    let (_child, _sock, ctl) = serve(dir.path(), |_| {});
    // At once: the socket is not there yet; --wait waits for it.
    common::ok(&[
        "bitmap",
        "add",
        "b1",
        "--control",
        ctl.to_str().unwrap(),
        "--wait",
        "20",
    ]);
    let list = common::ok(&["bitmap", "list", "--control", ctl.to_str().unwrap()]);
    assert!(list.contains("b1"), "{list}");
    // Without a server, --wait gives up in time and says so.
    let none = dir.path().join("none.sock");
    let e = common::fails(&[
        "bitmap",
        "list",
        "--control",
        none.to_str().unwrap(),
        "--wait",
        "1",
    ]);
    assert!(e.contains("did not accept in time"), "{e}");
}
