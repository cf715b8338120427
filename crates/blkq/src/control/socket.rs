//! The control socket's server: [`ControlServer`] listens on a Unix stream socket, mode 0600
//! (only the user who runs the server may drive the array), speaking [`super::protocol`], and
//! hands each line to a [`Handle`] (a mirror's [`super::server::Control`], or the server's
//! handler); a `monitor` line keeps its connection for the mirror's events.
//!
//! Up to [`SLOTS`] connections are served at once, a thread each, and a connection has
//! [`DEADLINE`] in all to send its line and read the reply (not per read: a client trickling
//! a byte at a time is cut then). When every slot is taken, a new connection evicts the
//! oldest one still waiting on its client, so a trickler cannot keep `status` out (see
//! [`crate::listen`] for why evict rather than refuse). The socket is mode 0600 from its
//! first moment ([`nbd::unix_listener::bind_private`]), and its file is removed when the
//! server stops ([`ControlServer::shutdown`], also on drop).

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::UnixListener;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use blkq_sync::atomic::{AtomicBool, Ordering};
use blkq_sync::{thread, Arc};
use serde_json::json;

use super::protocol::MAX_LINE;
use super::server::Handle;
use crate::listen::{self, Limits, Session};

fn accept(l: &UnixListener) -> std::io::Result<UnixStream> {
    l.accept().map(|(s, _)| s)
}

/// Connections served at once (a thread each).
pub const SLOTS: usize = 8;
/// From accept to the whole command line received and the reply taken.
pub const DEADLINE: Duration = Duration::from_secs(5);

/// Monitor connections a control socket serves at once (each holds one of its [`SLOTS`]).
pub const MONITORS: usize = SLOTS / 2;
/// How often a monitor connection looks whether its client went away or the server stops.
const MONITOR_LOOK: Duration = Duration::from_millis(200);

/// One event as a `monitor` line: `event` (its name), `seq`, `slot` and `leg` (the leg's
/// spec) when it is about one, `message` (in words), and its own fields.
pub fn event_json(r: &raid1::Record) -> serde_json::Value {
    use raid1::Event as E;
    let mut v = json!({
        "event": r.event.name(),
        "seq": r.seq,
        "message": r.to_string(),
    });
    if let Some(s) = r.event.slot() {
        v["slot"] = json!(s);
    }
    if let Some(l) = &r.leg {
        v["leg"] = json!(l);
    }
    match &r.event {
        E::LegFailed { cause, .. } => v["cause"] = json!(cause),
        E::LegAdded { readd, .. } => v["readd"] = json!(readd),
        E::ReaddRefused { why, .. } => v["why"] = json!(why),
        E::SyncStarted { action, .. } => v["action"] = json!(action.as_str()),
        E::SyncProgress {
            action, percent, ..
        } => {
            v["action"] = json!(action.as_str());
            v["percent"] = json!(percent);
        }
        E::SyncFinished {
            action,
            end,
            mismatches,
            ..
        } => {
            v["action"] = json!(action.as_str());
            v["end"] = json!(end);
            if let Some(m) = mismatches {
                v["mismatch_cnt"] = json!(m);
            }
        }
        E::GenerationChanged {
            generation,
            previous,
            in_sync,
        } => {
            v["generation"] = json!(format!("{generation:016x}"));
            v["previous"] = json!(format!("{previous:016x}"));
            v["in_sync"] = json!(format!("{in_sync:#b}"));
        }
        E::ArrayFailed { why } => v["why"] = json!(why),
        E::Dropped { count } => v["count"] = json!(count),
        _ => {}
    }
    v
}

/// Serves a `monitor` connection: the first line, then a line per event, until the client
/// goes away, a write to it fails (a client that reads nothing for
/// [`listen::HELD_WRITE_TIMEOUT`]), or the server stops. Refused when [`MONITORS`] are served.
fn monitor(ctl: &dyn Handle, s: &mut Session<UnixStream>) {
    let refuse = |s: &mut Session<UnixStream>, e: String| {
        if writeln!(s, "{}", json!({ "ok": false, "error": e }))
            .and_then(|()| s.flush())
            .is_ok()
        {
            s.finish();
        }
    };
    match s.hold(MONITORS) {
        Ok(true) => {}
        Ok(false) => {
            return refuse(
                s,
                format!("already {MONITORS} monitors on this socket: refused"),
            )
        }
        Err(_) => return,
    }
    let Some((sub, first)) = ctl.subscribe() else {
        return refuse(s, "this server has no mirror: nothing to monitor".into());
    };
    if writeln!(s, "{first}").and_then(|()| s.flush()).is_err() {
        return;
    }
    while !s.stopping() && !s.client_gone() {
        let Some(r) = sub.next_until(std::time::Instant::now() + MONITOR_LOOK) else {
            continue;
        };
        if writeln!(s, "{}", event_json(&r))
            .and_then(|()| s.flush())
            .is_err()
        {
            return;
        }
    }
}

/// The listening socket and its thread.
pub struct ControlServer {
    path: PathBuf,
    stop: Arc<AtomicBool>,
    thread: Option<thread::JoinHandle<()>>,
}

/// Reads one line of at most [`MAX_LINE`] bytes. `Err` with a message for the client when
/// it is longer, not UTF-8 or not complete by the deadline; `Ok(None)` when the connection was
/// evicted (no reply: its socket is shut).
fn read_line(s: &mut Session<UnixStream>) -> std::result::Result<Option<String>, String> {
    let mut r = BufReader::new(s.take(MAX_LINE as u64 + 1));
    let mut buf = Vec::with_capacity(256);
    match r.read_until(b'\n', &mut buf) {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionAborted => return Ok(None),
        Err(e) => return Err(format!("reading the command: {e}")),
    }
    if buf.len() > MAX_LINE || (buf.len() == MAX_LINE && buf.last() != Some(&b'\n')) {
        return Err(format!(
            "command line longer than {MAX_LINE} bytes: refused"
        ));
    }
    String::from_utf8(buf)
        .map(Some)
        .map_err(|_| "command is not UTF-8".to_string())
}

/// Serves one connection: one line, one reply (see [`crate::listen`] for the bounds); or a
/// `monitor`, which keeps it.
fn serve_one(ctl: &dyn Handle, s: &mut Session<UnixStream>) {
    let reply = match read_line(s) {
        Ok(Some(line)) if line.trim() == "monitor" => return monitor(ctl, s),
        Ok(Some(line)) => match s.work(|| ctl.handle(&line)) {
            Ok(r) => r,
            Err(_) => return,
        },
        Ok(None) => return,
        Err(e) => json!({ "ok": false, "error": e }),
    };
    if writeln!(s, "{reply}").and_then(|()| s.flush()).is_err() {
        return;
    }
    s.finish();
}

impl ControlServer {
    /// Binds `path` (mode 0600; a stale socket file is replaced, a live one or any other file
    /// is an error) and serves `ctl` on a thread.
    pub fn start(path: &Path, ctl: Arc<dyn Handle>) -> Result<Self> {
        if let Ok(md) = std::fs::symlink_metadata(path) {
            if !md.file_type().is_socket() {
                bail!(
                    "--control {}: exists and is not a socket; choose another path",
                    path.display()
                );
            }
            if UnixStream::connect(path).is_ok() {
                bail!(
                    "--control {}: another server is listening there",
                    path.display()
                );
            }
            std::fs::remove_file(path)
                .with_context(|| format!("removing the stale socket {}", path.display()))?;
        }
        // Mode 0600 from the moment the path exists (bound in a private directory, then
        // linked into place): a bind then a chmod left it open to all for a moment.
        let l = nbd::unix_listener::bind_private(path, 0o600)
            .with_context(|| format!("--control {}: cannot listen", path.display()))?;
        let stop = Arc::new(AtomicBool::new(false));
        let t = {
            let stop = stop.clone();
            let limits = Limits {
                slots: SLOTS,
                deadline: DEADLINE,
            };
            let handler = Arc::new(move |s: &mut Session<UnixStream>| serve_one(ctl.as_ref(), s));
            thread::spawn(move || {
                // The stop flag is stored with Release in `shutdown`, and looked at after each
                // accept (the wake-up connection carries no data).
                listen::serve("control", limits, || accept(&l), &stop, handler);
            })
        };
        Ok(Self {
            path: path.to_path_buf(),
            stop,
            thread: Some(t),
        })
    }

    /// Stops the thread (after the connections being served end: evicted if they wait on
    /// their client) and removes the socket file.
    pub fn shutdown(mut self) {
        self.stop_now();
    }

    fn stop_now(&mut self) {
        if let Some(t) = self.thread.take() {
            self.stop.store(true, Ordering::Release);
            // Wake the accept() with a connection of our own.
            let _ = UnixStream::connect(&self.path);
            let _ = t.join();
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

impl Drop for ControlServer {
    fn drop(&mut self) {
        self.stop_now();
    }
}
