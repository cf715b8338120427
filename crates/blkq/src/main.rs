//! The `blkq` binary: `serve`, `bench` and `raid` front-ends over the blkq crates.

use clap::{Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(
    name = "blkq",
    version,
    about = "A userspace multi-queue block I/O stack served over NBD"
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Print the version and the layers this build contains.
    Version,
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Some(Command::Version) | None => {
            println!("blkq {}", env!("CARGO_PKG_VERSION"));
            println!("layers: waitq, sbitmap");
        }
    }
    Ok(())
}
