//! `blkq raid monitor`: the array's events as they happen (mdadm's `--monitor`), through the
//! control socket's `monitor` command (see [`crate::control::protocol`]): one JSON line each
//! on stdout, and with `--program CMD` the program run once per event, one at a time, each
//! within `--program-timeout` (killed past it), with the event in its arguments and
//! environment. While the program runs, the server queues the events (bounded: a monitor that
//! falls behind is told how many it lost, by a `dropped` event).

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;

use crate::control::protocol::{self, MAX_REPLY};

/// `blkq raid monitor` options.
#[derive(Args, Debug)]
pub struct MonitorArgs {
    /// Control socket of a running `blkq serve --raid1`.
    #[arg(long, value_name = "PATH", required = true)]
    control: PathBuf,
    /// Run this program once per event (after the first line), one at a time: its arguments
    /// are the event's name, the control socket and the leg (its spec, or its slot; empty
    /// when none); its environment has BLKQ_EVENT, BLKQ_SLOT, BLKQ_LEG, BLKQ_MESSAGE,
    /// BLKQ_CONTROL and BLKQ_JSON (the whole line).
    #[arg(long, value_name = "CMD")]
    program: Option<PathBuf>,
    /// Seconds a --program run may take; it is killed past them.
    #[arg(long, value_name = "SECS", default_value_t = 30)]
    program_timeout: u64,
}

/// How long the server may take for the first line.
const FIRST_LINE: Duration = Duration::from_secs(10);
/// How often a running program is looked at.
const PROGRAM_LOOK: Duration = Duration::from_millis(20);

/// Runs `blkq raid monitor` until the server closes the connection (an error: the monitor
/// ends with the server).
pub fn run(a: MonitorArgs) -> Result<()> {
    let path = &a.control;
    let s = UnixStream::connect(path).with_context(|| {
        format!(
            "control socket {}: is `blkq serve --raid1 ... --control {}` running?",
            path.display(),
            path.display()
        )
    })?;
    s.set_write_timeout(Some(FIRST_LINE))?;
    (&s).write_all(format!("{}\n", protocol::Command::Monitor).as_bytes())?;
    s.set_read_timeout(Some(FIRST_LINE))?;
    let mut r = BufReader::new(&s);
    let first = read_line(&mut r)?.context("the server closed the connection without a reply")?;
    let v: serde_json::Value = serde_json::from_str(first.trim())
        .with_context(|| format!("control socket {}: bad reply {first:?}", path.display()))?;
    if v.get("ok").and_then(|o| o.as_bool()) != Some(true) {
        bail!(
            "{}",
            v.get("error")
                .and_then(|e| e.as_str())
                .unwrap_or("unknown error")
        );
    }
    print_line(&first)?;
    // Events come when they come.
    s.set_read_timeout(None)?;
    let timeout = Duration::from_secs(a.program_timeout);
    while let Some(line) = read_line(&mut r)? {
        print_line(&line)?;
        if let Some(p) = &a.program {
            run_program(p, path, &line, timeout);
        }
    }
    bail!("the server closed the monitor connection (it stopped?)")
}

/// One line (without its newline), at most [`MAX_REPLY`] bytes; `None` at the end.
fn read_line<R: BufRead>(r: &mut R) -> Result<Option<String>> {
    let mut line = String::new();
    let n = <&mut R as std::io::Read>::take(r, MAX_REPLY)
        .read_line(&mut line)
        .context("reading the monitor connection")?;
    if n == 0 {
        return Ok(None);
    }
    if !line.ends_with('\n') {
        bail!("monitor line over {MAX_REPLY} bytes or cut short");
    }
    line.pop();
    Ok(Some(line))
}

fn print_line(line: &str) -> Result<()> {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{line}")?;
    out.flush()?;
    Ok(())
}

/// Runs `program` for the event `line`, waiting for it at most `timeout` (then killed). Its
/// failures are reported on stderr; the monitor goes on.
fn run_program(program: &Path, control: &Path, line: &str, timeout: Duration) {
    let v: serde_json::Value = serde_json::from_str(line).unwrap_or_default();
    let field = |k: &str| match v.get(k) {
        Some(serde_json::Value::String(s)) => s.clone(),
        Some(serde_json::Value::Null) | None => String::new(),
        Some(x) => x.to_string(),
    };
    let (event, slot, leg) = (field("event"), field("slot"), field("leg"));
    let who = if leg.is_empty() { &slot } else { &leg };
    let child = Command::new(program)
        .arg(&event)
        .arg(control)
        .arg(who)
        .env("BLKQ_EVENT", &event)
        .env("BLKQ_SLOT", &slot)
        .env("BLKQ_LEG", &leg)
        .env("BLKQ_MESSAGE", field("message"))
        .env("BLKQ_CONTROL", control)
        .env("BLKQ_JSON", line)
        .stdin(Stdio::null())
        .spawn();
    let mut child = match child {
        Ok(c) => c,
        Err(e) => {
            eprintln!("blkq raid monitor: cannot run {}: {e}", program.display());
            return;
        }
    };
    let until = Instant::now() + timeout;
    loop {
        match child.try_wait() {
            Ok(Some(st)) if st.success() => return,
            Ok(Some(st)) => {
                eprintln!("blkq raid monitor: {} for {event}: {st}", program.display());
                return;
            }
            Ok(None) if Instant::now() < until => std::thread::sleep(PROGRAM_LOOK),
            Ok(None) | Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                eprintln!(
                    "blkq raid monitor: {} for {event} still ran after {} s: killed",
                    program.display(),
                    timeout.as_secs()
                );
                return;
            }
        }
    }
}
