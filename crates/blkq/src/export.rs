//! `blkq export`: add, remove and list a running server's exports through its control socket
//! (`blkq serve --control PATH`), as qemu-storage-daemon's `block-export-add` and
//! `block-export-del` do. See "Changing exports while serving" in docs/serve.md.

use std::path::PathBuf;

use anyhow::{bail, Result};
use clap::{Args, Subcommand};

use crate::control::client::{request_text_within, wait_ready};
use crate::control::exports::{add_table, ExportCmd};

/// `blkq export` options.
#[derive(Args, Debug, Clone)]
pub struct ExportArgs {
    /// What to do.
    #[command(subcommand)]
    pub cmd: ExportSub,
}

/// Where to send the command.
#[derive(Args, Debug, Clone)]
pub struct At {
    /// The server's control socket (`blkq serve --control PATH`).
    #[arg(long, value_name = "PATH")]
    pub control: PathBuf,
    /// Wait up to SECONDS for the control socket to exist and accept (a server started a
    /// moment ago) before sending.
    #[arg(long, value_name = "SECONDS")]
    pub wait: Option<u64>,
}

/// `blkq export` subcommands.
#[derive(Subcommand, Debug, Clone)]
pub enum ExportSub {
    /// Serve one more device: SPEC is a device spec as `blkq serve --device` takes it
    /// (null:, mem:, file:, rbd:, nbd://..., with its options, bitmaps= included). The
    /// server's queue settings and bitmap options apply; a mirror needs a restart.
    Add {
        /// The export name clients ask for ("" is the default export).
        name: String,
        /// The device spec.
        spec: String,
        /// Export it read-only.
        #[arg(long)]
        read_only: bool,
        /// What clients are told about it (default: the kind of device and its size; the
        /// spec with --describe-paths on the server).
        #[arg(long, value_name = "TEXT")]
        description: Option<String>,
        /// Allow TCP clients from this address or network only (CIDR; repeatable), as
        /// `blkq serve --allow`.
        #[arg(long = "allow", value_name = "CIDR")]
        allow: Vec<String>,
        /// Allow TLS clients with this certificate subject only (repeatable; the server
        /// needs --tls-verify-peer), as `blkq serve --allow-subject`.
        #[arg(long = "allow-subject", value_name = "SUBJECT")]
        allow_subjects: Vec<String>,
        #[command(flatten)]
        at: At,
    },
    /// Stop serving an export: new clients no longer see it at once; connected ones get
    /// their in-flight requests answered, then are closed; then its device is flushed and
    /// closed. Fails (the export is gone all the same) when a request or the flush did not
    /// complete within the timeout, or a write had failed on it.
    Remove {
        /// The export name.
        name: String,
        /// Seconds its clients get to finish their requests, and its flush (default: the
        /// server's --shutdown-timeout).
        #[arg(long, value_name = "SECONDS")]
        timeout: Option<u64>,
        #[command(flatten)]
        at: At,
    },
    /// List the exports: name, size, read-only, device, connected clients.
    List {
        #[command(flatten)]
        at: At,
        /// Print the server's JSON reply.
        #[arg(long)]
        json: bool,
    },
}

/// Runs `blkq export`.
pub fn run(a: ExportArgs) -> Result<()> {
    let (cmd, at, json) = match a.cmd {
        ExportSub::Add {
            name,
            spec,
            read_only,
            description,
            allow,
            allow_subjects,
            at,
        } => {
            let table = add_table(
                &name,
                &spec,
                read_only,
                description.as_deref(),
                &allow,
                &allow_subjects,
            );
            (ExportCmd::Add(table), at, false)
        }
        ExportSub::Remove { name, timeout, at } => {
            if name.chars().any(char::is_whitespace) {
                bail!(
                    "export {name:?}: a name with whitespace cannot be sent on the control socket"
                );
            }
            if timeout.is_some_and(|t| !(1..=86400).contains(&t)) {
                bail!("--timeout: whole seconds from 1 to 86400");
            }
            (ExportCmd::Remove { name, timeout }, at, false)
        }
        ExportSub::List { at, json } => (ExportCmd::List, at, json),
    };
    // A removal waits for the export's clients, then for its flush: each up to its timeout
    // (the server's own when not given: up to a day).
    let within = match &cmd {
        ExportCmd::Remove { timeout, .. } => {
            std::time::Duration::from_secs(timeout.unwrap_or(86400) * 2 + 30)
        }
        _ => crate::control::client::REPLY_TIMEOUT,
    };
    wait_ready(&at.control, at.wait)?;
    let v = request_text_within(&at.control, &cmd.to_string(), "", within)?;
    if json {
        println!("{v}");
        return Ok(());
    }
    if let Some(m) = v.get("message").and_then(|m| m.as_str()) {
        println!("{m}");
    }
    if let (ExportCmd::List, Some(list)) = (&cmd, v.get("exports").and_then(|b| b.as_array())) {
        println!(
            "{:<16} {:>14} {:<3} {:>7} DEVICE",
            "EXPORT", "SIZE", "RO", "CLIENTS"
        );
        for e in list {
            let s = |k: &str| e.get(k).and_then(|x| x.as_str()).unwrap_or("").to_string();
            let n = |k: &str| e.get(k).and_then(|x| x.as_u64()).unwrap_or(0);
            let ro = if e.get("read_only").and_then(|x| x.as_bool()) == Some(true) {
                "yes"
            } else {
                "no"
            };
            let failed = if e.get("failed").and_then(|x| x.as_bool()) == Some(true) {
                " (FAILED: a write or flush failed)"
            } else {
                ""
            };
            println!(
                "{:<16} {:>14} {:<3} {:>7} {}{failed}",
                format!("{:?}", s("name")),
                n("size"),
                ro,
                n("connections"),
                s("device"),
            );
        }
    }
    Ok(())
}
