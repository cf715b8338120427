//! `blkq serve`'s readiness: `--ready-fd N` gets "READY=1\n" and is closed once every listener
//! is bound; with `NOTIFY_SOCKET` set (systemd's `Type=notify`), the sd_notify datagrams
//! `READY=1` with a `STATUS=`, and `STOPPING=1` when a shutdown starts. The datagram is a few
//! bytes on a Unix datagram socket (a leading `@` names an abstract one); no library needed.

use std::io::Write;
use std::os::fd::FromRawFd;
use std::os::unix::net::UnixDatagram;

use anyhow::{bail, Context, Result};

/// Sends `msg` to `NOTIFY_SOCKET`, if set. A failure is logged, not fatal: the service runs.
pub fn sd_notify(msg: &str) {
    let Some(path) = std::env::var_os("NOTIFY_SOCKET") else {
        return;
    };
    if let Err(e) = send(&path, msg) {
        tracing::warn!("NOTIFY_SOCKET {}: {e:#}", path.to_string_lossy());
    }
}

fn send(path: &std::ffi::OsStr, msg: &str) -> Result<()> {
    let sock = UnixDatagram::unbound().context("socket")?;
    let bytes = path.as_encoded_bytes();
    if let Some(name) = bytes.strip_prefix(b"@") {
        use std::os::linux::net::SocketAddrExt;
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name)?;
        sock.send_to_addr(msg.as_bytes(), &addr)?;
    } else {
        sock.send_to(msg.as_bytes(), std::path::Path::new(path))?;
    }
    Ok(())
}

/// Writes "READY=1\n" to descriptor `fd` and closes it.
pub fn ready_fd(fd: i32) -> Result<()> {
    if fd < 0 {
        bail!("--ready-fd {fd}: not a descriptor");
    }
    // SAFETY: `--ready-fd` hands this descriptor to the server, which owns it from here: it is
    // written once and closed when the File drops; nothing else in the process uses it.
    let mut f = unsafe { std::fs::File::from_raw_fd(fd) };
    f.write_all(b"READY=1\n")
        .with_context(|| format!("--ready-fd {fd}"))?;
    Ok(())
}
