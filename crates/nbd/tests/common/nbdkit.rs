//! nbdkit as the other NBD server of the remote device's tests: another implementation, in
//! another process. A test that needs it is skipped where it is not installed.

use std::path::{Path, PathBuf};
use std::process::{Child, Command};

use testkit::wait_until;

/// Whether nbdkit is installed; when not, says that the test is skipped.
pub fn installed() -> bool {
    let found = Command::new("nbdkit").arg("--version").output().is_ok();
    if !found {
        eprintln!("skipped: nbdkit is not on PATH");
    }
    found
}

/// nbdkit in the foreground on the Unix socket `sock` with `args` (filters, plugin,
/// parameters), once it accepts connections (the socket exists before nbdkit listens on it).
pub fn spawn(sock: &Path, args: &[&str]) -> Child {
    let child = Command::new("nbdkit")
        .args(["-f", "-U"])
        .arg(sock)
        .args(args)
        .spawn()
        .unwrap();
    wait_until("nbdkit's socket", || {
        std::os::unix::net::UnixStream::connect(sock).is_ok()
    });
    child
}

/// nbdkit on the socket `kit.sock` in a test's folder ([`spawn`]), killed on drop.
pub struct Kit {
    child: Child,
    sock: PathBuf,
}

impl Kit {
    /// nbdkit with `args` on a socket in `dir`; `None` when nbdkit is not installed.
    pub fn start(dir: &Path, args: &[&str]) -> Option<Self> {
        if !installed() {
            return None;
        }
        let sock = dir.join("kit.sock");
        let child = spawn(&sock, args);
        Some(Self { child, sock })
    }

    /// Its socket.
    pub fn sock(&self) -> &Path {
        &self.sock
    }

    /// The `nbd:` URI of its export, with the device's options `opts` (`,conns=2,...`).
    pub fn uri(&self, opts: &str) -> String {
        super::served::unix_uri(&self.sock, opts)
    }
}

impl Drop for Kit {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
