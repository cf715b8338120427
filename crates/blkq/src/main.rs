//! The `blkq` binary: `serve`, `bench`, `raid`, `bitmap`, `export` and `certs` front-ends
//! over the blkq crates.

use clap::{Parser, Subcommand};

mod bench;
mod bitmap;
mod certs;
mod control;
mod export;
mod listen;
mod logs;
mod metrics;
mod raid;
mod serve;

#[derive(Parser, Debug)]
#[command(
    name = "blkq",
    version,
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
        Command::Export(a) => export::run(a),
    }
}
