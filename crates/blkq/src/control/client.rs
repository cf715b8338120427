//! The control socket's client: sends one [`Command`] and reads the JSON reply.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};

use super::protocol::{Command, MAX_LINE, MAX_REPLY};
use crate::raid::report::ArrayReport;

/// Write timeout of a request.
const IO_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a reply may take (a command that changes the array may wait its turn).
pub const REPLY_TIMEOUT: Duration = Duration::from_secs(60);

/// With `--wait SECONDS` (`wait`): waits, bounded, until the control socket at `path` exists
/// and accepts a connection (a server started in the background a moment ago). `None`: no
/// wait, the request fails at once if the socket is not there.
pub fn wait_ready(path: &Path, wait: Option<u64>) -> Result<()> {
    let Some(secs) = wait else {
        return Ok(());
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(secs);
    loop {
        match UnixStream::connect(path) {
            Ok(_) => return Ok(()),
            Err(e) if std::time::Instant::now() >= deadline => {
                bail!(
                    "--wait {secs}: the control socket {} did not accept in time ({e})",
                    path.display()
                )
            }
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}

/// Sends `line` and returns the reply as it came (one line), waiting up to `within` for it.
fn request_line(path: &Path, line: &str, within: Duration) -> Result<String> {
    if line.len() >= MAX_LINE {
        bail!("command longer than {MAX_LINE} bytes");
    }
    let mut s = UnixStream::connect(path).context("connecting")?;
    s.set_read_timeout(Some(within))?;
    s.set_write_timeout(Some(IO_TIMEOUT))?;
    s.write_all(line.as_bytes())?;
    s.write_all(b"\n")?;
    let mut out = String::new();
    (&s).take(MAX_REPLY).read_to_string(&mut out)?;
    if out.is_empty() {
        bail!("the server closed the connection without a reply");
    }
    Ok(out)
}

/// Sends `cmd`; returns the JSON reply's body, or the error the server reported.
pub fn request(path: &Path, cmd: &Command) -> Result<serde_json::Value> {
    request_text(path, &cmd.to_string(), "--raid1 ... ")
}

/// Sends the command line `line`; returns the JSON reply's body, or the error the server
/// reported. `hint` is what the server needs on its command line besides `--control`.
pub fn request_text(path: &Path, line: &str, hint: &str) -> Result<serde_json::Value> {
    request_text_within(path, line, hint, REPLY_TIMEOUT)
}

/// [`request_text`], waiting up to `within` for the reply (a command that waits on clients).
pub fn request_text_within(
    path: &Path,
    line: &str,
    hint: &str,
    within: Duration,
) -> Result<serde_json::Value> {
    let reply = request_line(path, line, within).with_context(|| {
        format!(
            "control socket {}: is `blkq serve {hint}--control {}` running?",
            path.display(),
            path.display()
        )
    })?;
    let v: serde_json::Value = serde_json::from_str(reply.trim())
        .with_context(|| format!("control socket {}: bad reply {reply:?}", path.display()))?;
    if v.get("ok").and_then(|o| o.as_bool()) != Some(true) {
        let e = v
            .get("error")
            .and_then(|e| e.as_str())
            .unwrap_or("unknown error");
        bail!("{e}");
    }
    Ok(v)
}

/// The array's report (`status` or `detail`).
pub fn report(path: &Path, detail: bool) -> Result<ArrayReport> {
    let cmd = if detail {
        Command::Detail
    } else {
        Command::Status
    };
    let v = request(path, &cmd)?;
    let r = v
        .get("report")
        .cloned()
        .ok_or_else(|| anyhow!("control reply without a report"))?;
    Ok(serde_json::from_value(r)?)
}

/// Sends `cmd` and prints the server's message.
pub fn run(path: &Path, cmd: &Command) -> Result<()> {
    let v = request(path, cmd)?;
    if let Some(m) = v.get("message").and_then(|m| m.as_str()) {
        println!("{m}");
    }
    Ok(())
}
