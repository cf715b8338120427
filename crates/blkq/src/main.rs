//! The `blkq` binary: `serve`, `bench`, `raid`, `bitmap`, `export` and `certs` front-ends
//! over the blkq crates.
#![warn(clippy::too_many_lines)]

use std::path::PathBuf;

use anyhow::Context;
use clap::{CommandFactory, Parser, Subcommand};

mod bench;
mod bitmap;
mod certs;
mod control;
mod export;
mod listen;
mod logs;
mod metrics;
mod open;
mod raid;
mod serve;

/// The version, and the features built in: `+rbd` when the `rbd:` device is (the `rbd`
/// feature, and librbd found at build time), `-rbd` when not.
fn version() -> &'static str {
    if blk_drivers::rbd::AVAILABLE {
        concat!(env!("CARGO_PKG_VERSION"), " (features: +rbd)")
    } else {
        concat!(
            env!("CARGO_PKG_VERSION"),
            " (features: -rbd: built without librbd)"
        )
    }
}

#[derive(Parser, Debug)]
#[command(
    name = "blkq",
    version = version(),
    about = "A userspace multi-queue block I/O stack served over NBD"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Export block devices over NBD: with no arguments, a 1 GiB memory disk on ./blkq.sock
    /// and 127.0.0.1:10809.
    Serve(Box<serve::args::ServeArgs>),
    /// Drive a device in-process, like fio: IOPS, latency, tag waits, context switches.
    Bench(Box<bench::BenchArgs>),
    /// Create, inspect and drive RAID1 arrays (offline on the legs, or online with --control).
    Raid(Box<raid::RaidArgs>),
    /// Make TLS certificates for `serve --tls`: a CA, a server certificate and key, and
    /// optionally a client certificate and key (qemu's and nbdkit's file names).
    Certs(certs::CertsArgs),
    /// Manage a running server's dirty bitmaps (changed-block tracking for incremental
    /// backups) through its control socket.
    Bitmap(bitmap::BitmapArgs),
    /// Print a shell completion script, generated from these definitions (bash: save it as
    /// /usr/share/bash-completion/completions/blkq).
    Completions {
        /// The shell.
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Write a man page per command (blkq.1, blkq-serve.1, blkq-raid-status.1, ...) into DIR,
    /// generated from these definitions (e.g. /usr/local/share/man/man1).
    Man {
        /// Where the pages go (it must exist).
        dir: PathBuf,
    },
    /// Add, remove and list a running server's exports through its control socket.
    Export(export::ExportArgs),
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Serve(a) => serve::run::run(*a),
        Command::Bench(a) => bench::run(*a),
        Command::Raid(a) => raid::run(*a),
        Command::Certs(a) => certs::certs(&a),
        Command::Bitmap(a) => bitmap::run(a),
        Command::Completions { shell } => {
            clap_complete::generate(shell, &mut Cli::command(), "blkq", &mut std::io::stdout());
            Ok(())
        }
        Command::Man { dir } => clap_mangen::generate_to(Cli::command(), &dir)
            .with_context(|| format!("writing the man pages into {}", dir.display())),
        Command::Export(a) => export::run(a),
    }
}
