//! Options of `blkq bench`: the command line (`BenchArgs`), one run's configuration
//! (`RunCfg`) and the sweep values applied to it.

use std::str::FromStr;
use std::time::Duration;

use anyhow::{bail, Result};
use blk::sched::{LockMode, SchedChoice};
use blk::PoolPolicy;
use blk_drivers::spec::parse_size;
use clap::{Args, Subcommand};
use sbitmap::WakeAlgo;

/// Access pattern.
#[allow(clippy::enum_variant_names)] // fio's names
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rw {
    Read,
    Write,
    RandRead,
    RandWrite,
    RandRw,
}

impl FromStr for Rw {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s {
            "read" => Rw::Read,
            "write" => Rw::Write,
            "randread" => Rw::RandRead,
            "randwrite" => Rw::RandWrite,
            "randrw" => Rw::RandRw,
            _ => bail!("unknown --rw {s:?} (read, write, randread, randwrite, randrw)"),
        })
    }
}

impl Rw {
    pub(super) fn name(self) -> &'static str {
        match self {
            Rw::Read => "read",
            Rw::Write => "write",
            Rw::RandRead => "randread",
            Rw::RandWrite => "randwrite",
            Rw::RandRw => "randrw",
        }
    }
}

/// `blkq bench` options (or, with the `plot` subcommand, a plot of collected `--json` runs).
#[derive(Args, Debug, Clone)]
#[command(args_conflicts_with_subcommands = true)]
pub struct BenchArgs {
    #[command(subcommand)]
    pub cmd: Option<BenchCmd>,
    /// Device spec: null:SIZE, mem:SIZE, file:PATH or rbd:POOL/IMAGE, with ,key=value options.
    #[arg(long, default_value = "null:1G", conflicts_with = "raid1")]
    pub device: String,
    /// Bench a RAID1 mirror over these legs instead of --device: device specs,
    /// comma-separated (the same syntax and builder as `blkq serve --raid1`). The bench owns
    /// its legs: a new array is created on them, overwriting what they hold.
    #[arg(long, value_name = "LEG,LEG[,...]")]
    pub raid1: Option<String>,
    /// A raid1 option KEY=VALUE (repeatable), e.g. barrier=locked|lockless.
    #[arg(long = "raid1-option", value_name = "KEY=VALUE")]
    pub raid1_options: Vec<String>,
    /// Drive --device as a --raid1 leg is driven: bio-based (built as a leg is), one bio per
    /// submit (no batch, no plug), with data buffers. The baseline of what a mirror costs
    /// over one leg.
    #[arg(long, conflicts_with = "raid1")]
    pub as_leg: bool,
    /// read, write, randread, randwrite or randrw.
    #[arg(long, default_value = "randread")]
    pub rw: String,
    /// Percentage of reads for randrw.
    #[arg(long, default_value_t = 50)]
    pub rwmixread: u32,
    /// Block size (e.g. 4K).
    #[arg(long, default_value = "4K")]
    pub bs: String,
    /// Bios in flight per job.
    #[arg(long, default_value_t = 32)]
    pub iodepth: usize,
    /// Jobs (submitting threads).
    #[arg(long, default_value_t = 1)]
    pub jobs: usize,
    /// Seconds per run.
    #[arg(long, default_value_t = 5.0)]
    pub runtime: f64,
    /// Hardware queues.
    #[arg(long)]
    pub hw_queues: Option<u16>,
    /// Tags per hardware queue (or in all, with --shared-tags).
    #[arg(long)]
    pub queue_depth: Option<u32>,
    /// One tag bitmap shared by all hardware queues.
    #[arg(long)]
    pub shared_tags: bool,
    /// Wake-up algorithm(s): counter, legacy, chain, or a comma list ("counter,legacy,chain").
    #[arg(long, default_value = "chain")]
    pub wake: String,
    /// Pool-full policy(ies): steal, fifo, batch, or a comma list.
    #[arg(long, default_value = "steal")]
    pub policy: String,
    /// I/O scheduler(s): none, mq-deadline, or both as "none,mq-deadline".
    #[arg(long, default_value = "none")]
    pub sched: String,
    /// mq-deadline's lock design(s): locked, serialized, or both as "locked,serialized".
    #[arg(long, default_value = "serialized")]
    pub sched_lock: String,
    /// Cap on tags in use (batch/fifo experiments).
    #[arg(long)]
    pub max_in_flight: Option<u32>,
    /// Batch policy: tags a batch owner may take.
    #[arg(long, default_value_t = 32)]
    pub batch_requests: u32,
    /// Batch policy: how long a batch lasts, microseconds.
    #[arg(long, default_value_t = 10_000)]
    pub batch_time_us: u64,
    /// Drive the device through changed-block tracking (as `blkq serve` wraps its exports):
    /// `bare` drives the device as a bio-based device without the wrapper (the baseline),
    /// N wraps it with N dirty bitmaps in memory (64K granularity, every granule dirty and
    /// durable before the run: the steady state).
    #[arg(long, value_name = "bare|N")]
    pub dirty_bitmaps: Option<String>,
    /// With --dirty-bitmaps N: how writes find their bitmaps, lockfree or locked (its simple
    /// twin, to compare with).
    #[arg(long, value_name = "IMPL", default_value = "lockfree")]
    pub dirty_bitmaps_gate: String,
    /// Write a pattern over the region, read it back and check it.
    #[arg(long)]
    pub verify: bool,
    /// Bytes of the device to use (default: all, capped at 1G for --verify).
    #[arg(long)]
    pub size: Option<String>,
    /// One JSON object per run on stdout.
    #[arg(long)]
    pub json: bool,
    /// Runs per configuration (mean and stddev are reported).
    #[arg(long, default_value_t = 1)]
    pub repeat: usize,
    /// Sweep one parameter: queue-depth=2,4,8 | iodepth=.. | jobs=.. | hw-queues=.. | bs=..
    #[arg(long)]
    pub sweep: Option<String>,
    /// Time one I/O in N for latency (the clock costs ~33 ns a read here).
    #[arg(long, default_value_t = 8)]
    pub lat_sample: u64,
    /// Seed of the jobs' offset generators (job j's stream is derived from it and j), so
    /// random patterns are reproducible run to run.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Draw what this invocation measured as an SVG: IOPS against the --sweep values, one
    /// line per wake/policy/scheduler row, error bars from min to max of the --repeat runs
    /// (without --sweep: one point per row).
    #[arg(long, value_name = "FILE.svg")]
    pub plot: Option<std::path::PathBuf>,
    /// The title of the --plot (default: the device, pattern, block size, iodepth and jobs).
    #[arg(long, value_name = "TEXT")]
    pub plot_title: Option<String>,
}

/// `blkq bench` subcommands.
#[derive(Subcommand, Debug, Clone)]
pub enum BenchCmd {
    /// Plot `blkq bench --json` lines collected from several runs (files, or stdin) as an
    /// SVG: one line per --series value, a point per --x value, error bars over the runs
    /// that share both (the repeats).
    Plot(super::plot::PlotArgs),
}

/// One run's configuration.
#[derive(Debug, Clone)]
pub(super) struct RunCfg {
    pub(super) device: String,
    pub(super) rw: Rw,
    pub(super) rwmixread: u32,
    pub(super) bs: u32,
    pub(super) iodepth: usize,
    pub(super) jobs: usize,
    pub(super) runtime: Duration,
    pub(super) hw_queues: Option<u16>,
    pub(super) queue_depth: Option<u32>,
    pub(super) shared_tags: bool,
    pub(super) wake: WakeAlgo,
    pub(super) policy: PoolPolicy,
    pub(super) sched: SchedChoice,
    pub(super) sched_lock: LockMode,
    pub(super) max_in_flight: Option<u32>,
    pub(super) batch_requests: u32,
    pub(super) batch_time: Duration,
    pub(super) size: Option<u64>,
    pub(super) lat_sample: u64,
    /// `--seed`: the jobs' generators derive from it.
    pub(super) seed: u64,
    /// `--raid1` legs (then `device` is only the label of the run).
    pub(super) raid1: Option<String>,
    /// `--raid1-option`s, in order (a later one wins).
    pub(super) raid1_options: Vec<String>,
    /// `--as-leg`: `device` built as a mirror's leg and driven through its bio path, a bio per
    /// submit, with data buffers.
    pub(super) as_leg: bool,
    /// `--dirty-bitmaps`: `None` not given; `Some(None)` bare; `Some(Some(n))` n bitmaps.
    pub(super) dirty_bitmaps: Option<Option<usize>>,
    /// `--dirty-bitmaps-gate`.
    pub(super) dirty_bitmaps_gate: cbt::Mode,
}

/// Parses a `--dirty-bitmaps` value.
pub(super) fn parse_dirty_bitmaps(v: &str) -> Result<Option<usize>> {
    match v {
        "bare" => Ok(None),
        n => Ok(Some(n.parse().map_err(|_| {
            anyhow::anyhow!("--dirty-bitmaps {n:?}: bare or a number of bitmaps")
        })?)),
    }
}

impl RunCfg {
    /// The label of the device in the output: the spec, or `raid1:LEGS [OPTIONS]`.
    pub(super) fn label(&self) -> String {
        let base = match &self.raid1 {
            None => {
                // The spec alone (a label given before is dropped).
                let spec = self.device.split(" [").next().unwrap_or_default();
                if self.as_leg {
                    format!("{spec} [as leg]")
                } else {
                    spec.to_string()
                }
            }
            Some(legs) if self.raid1_options.is_empty() => format!("raid1:{legs}"),
            Some(legs) => format!("raid1:{legs} [{}]", self.raid1_options.join(" ")),
        };
        match self.dirty_bitmaps {
            None => base,
            Some(None) => format!("{base} [bare]"),
            Some(Some(n)) => format!(
                "{base} [dirty bitmaps {n}, {}]",
                match self.dirty_bitmaps_gate {
                    cbt::Mode::LockFree => "lockfree",
                    cbt::Mode::Locked => "locked",
                }
            ),
        }
    }
}

pub(super) fn list<T: FromStr>(s: &str, what: &str) -> Result<Vec<T>>
where
    T::Err: std::fmt::Display,
{
    s.split(',')
        .map(|x| {
            x.trim()
                .parse::<T>()
                .map_err(|e| anyhow::anyhow!("bad {what} {x:?}: {e}"))
        })
        .collect()
}

/// Applies one sweep value to a config.
pub(super) fn apply(cfg: &mut RunCfg, key: &str, val: &str) -> Result<()> {
    match key {
        "queue-depth" | "queue_depth" => cfg.queue_depth = Some(val.parse()?),
        "iodepth" => cfg.iodepth = val.parse()?,
        "jobs" => cfg.jobs = val.parse()?,
        "hw-queues" | "hw_queues" => cfg.hw_queues = Some(val.parse()?),
        "bs" => cfg.bs = parse_size(val)? as u32,
        "max-in-flight" | "max_in_flight" => cfg.max_in_flight = Some(val.parse()?),
        "barrier" | "share_writes" if cfg.raid1.is_some() => {
            cfg.raid1_options.push(format!("{key}={val}"))
        }
        "dirty-bitmaps" | "dirty_bitmaps" => {
            cfg.dirty_bitmaps = Some(parse_dirty_bitmaps(val)?);
            cfg.device = cfg.label();
        }
        _ => {
            bail!(
                "cannot sweep {key:?} (queue-depth, iodepth, jobs, hw-queues, bs, max-in-flight, \
                 barrier and share_writes with --raid1, dirty-bitmaps)"
            )
        }
    }
    Ok(())
}
