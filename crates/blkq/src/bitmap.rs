//! `blkq bitmap`: manage a running server's dirty bitmaps (changed-block tracking) through its
//! control socket (`blkq serve --control PATH`). See docs/cbt.md.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Args, Subcommand};

use crate::control::bitmap::{BitmapCmd, BitmapLine};
use crate::control::client::request_text;

/// `blkq bitmap` options.
#[derive(Args, Debug, Clone)]
pub struct BitmapArgs {
    /// What to do.
    #[command(subcommand)]
    pub cmd: BitmapSub,
}

/// Where and on which export.
#[derive(Args, Debug, Clone)]
pub struct Target {
    /// The server's control socket (`blkq serve --control PATH`).
    #[arg(long, value_name = "PATH")]
    pub control: PathBuf,
    /// Wait up to SECONDS for the control socket to exist and accept (a server started a
    /// moment ago) before sending.
    #[arg(long, value_name = "SECONDS")]
    pub wait: Option<u64>,
    /// The export (default: the default export "").
    #[arg(long, value_name = "NAME")]
    pub export: Option<String>,
}

/// `blkq bitmap` subcommands.
#[derive(Subcommand, Debug, Clone)]
pub enum BitmapSub {
    /// Add a clean dirty bitmap that records every write, trim and zeroing from now on.
    Add {
        /// Its name (clients ask for the context qemu:dirty-bitmap:NAME).
        name: String,
        /// Bytes per bit: a power of two from 4K to 64M (default 64K).
        #[arg(long, value_name = "SIZE")]
        granularity: Option<String>,
        #[command(flatten)]
        at: Target,
    },
    /// Remove a dirty bitmap.
    Remove {
        /// Its name.
        name: String,
        #[command(flatten)]
        at: Target,
    },
    /// Clear a dirty bitmap (durably: a crash afterwards never brings back less than what was
    /// written since).
    Clear {
        /// Its name.
        name: String,
        #[command(flatten)]
        at: Target,
    },
    /// Freeze OLD and start NEW at one instant (no write counted in neither or both); returns
    /// once every write counted in OLD is complete, so a backup may read OLD at once.
    Rotate {
        /// The recording bitmap to freeze.
        old: String,
        /// The bitmap to start.
        new: String,
        #[command(flatten)]
        at: Target,
    },
    /// Stop counting writes in a dirty bitmap, keeping its bits (qemu's
    /// block-dirty-bitmap-disable); returns once the writes it counted have completed.
    Disable {
        /// Its name.
        name: String,
        #[command(flatten)]
        at: Target,
    },
    /// Count writes in a disabled (or rotated-away) dirty bitmap again.
    Enable {
        /// Its name.
        name: String,
        #[command(flatten)]
        at: Target,
    },
    /// Set in TARGET every granule dirty in each SOURCE (the union; granularities may differ,
    /// rounded out to TARGET's), durably before it returns. The sources are unchanged.
    Merge {
        /// The bitmap that gains the bits.
        target: String,
        /// The bitmaps read.
        #[arg(required = true)]
        sources: Vec<String>,
        #[command(flatten)]
        at: Target,
    },
    /// List the dirty bitmaps (every export's, unless --export).
    List {
        #[command(flatten)]
        at: Target,
        /// Print the server's JSON reply.
        #[arg(long)]
        json: bool,
    },
}

/// Runs `blkq bitmap`.
pub fn run(a: BitmapArgs) -> Result<()> {
    let (cmd, at, json) = match a.cmd {
        BitmapSub::Add {
            name,
            granularity,
            at,
        } => {
            let granularity = granularity
                .map(|g| {
                    blk_drivers::spec::parse_size(&g)
                        .with_context(|| format!("--granularity {g:?}"))
                })
                .transpose()?;
            (BitmapCmd::Add { name, granularity }, at, false)
        }
        BitmapSub::Remove { name, at } => (BitmapCmd::Remove(name), at, false),
        BitmapSub::Clear { name, at } => (BitmapCmd::Clear(name), at, false),
        BitmapSub::Rotate { old, new, at } => (BitmapCmd::Rotate { old, new }, at, false),
        BitmapSub::Disable { name, at } => (BitmapCmd::Record { name, on: false }, at, false),
        BitmapSub::Enable { name, at } => (BitmapCmd::Record { name, on: true }, at, false),
        BitmapSub::Merge {
            target,
            sources,
            at,
        } => (BitmapCmd::Merge { target, sources }, at, false),
        BitmapSub::List { at, json } => (BitmapCmd::List, at, json),
    };
    // Checked here, by the server's rule: a name with a space would be split on the one-line
    // protocol and answered with the protocol's usage, not with what is wrong with it.
    let names: Vec<&String> = match &cmd {
        BitmapCmd::Add { name, .. }
        | BitmapCmd::Remove(name)
        | BitmapCmd::Clear(name)
        | BitmapCmd::Record { name, .. } => vec![name],
        BitmapCmd::Merge { target, sources } => std::iter::once(target).chain(sources).collect(),
        BitmapCmd::Rotate { old, new } => vec![old, new],
        BitmapCmd::List => vec![],
    };
    for n in names {
        cbt::check_name(n)?;
    }
    if let Some(e) = &at.export {
        if e.chars().any(char::is_whitespace) {
            anyhow::bail!(
                "--export {e:?}: a name with whitespace cannot be sent on the control socket"
            );
        }
    }
    let line = BitmapLine {
        cmd: cmd.clone(),
        export: at.export.clone(),
    };
    crate::control::client::wait_ready(&at.control, at.wait)?;
    let v = request_text(&at.control, &line.to_string(), "")?;
    if json {
        println!("{v}");
        return Ok(());
    }
    if let Some(m) = v.get("message").and_then(|m| m.as_str()) {
        println!("{m}");
    }
    if let (BitmapCmd::List, Some(list)) = (&cmd, v.get("bitmaps").and_then(|b| b.as_array())) {
        println!(
            "{:<16} {:<24} {:>12} {:<9} {:>16}",
            "EXPORT", "BITMAP", "GRANULARITY", "STATE", "DIRTY BYTES"
        );
        for b in list {
            let s = |k: &str| b.get(k).and_then(|x| x.as_str()).unwrap_or("").to_string();
            let n = |k: &str| b.get(k).and_then(|x| x.as_u64()).unwrap_or(0);
            let state = if b.get("recording").and_then(|x| x.as_bool()) == Some(true) {
                "recording"
            } else {
                "frozen"
            };
            println!(
                "{:<16} {:<24} {:>12} {:<9} {:>16}",
                format!("{:?}", s("export")),
                s("name"),
                n("granularity"),
                state,
                n("dirty_bytes")
            );
        }
    }
    Ok(())
}
