//! A deterministic simulator of the mirror (in the spirit of FoundationDB's simulation tests
//! and TigerBeetle's VOPR): one seed drives the array's shape (with, for half the seeds,
//! write-behind to a write-mostly last leg, and the automatic re-add), every operation (reads,
//! writes, FUA writes, FLUSH, TRIM, WRITE_ZEROES of seeded sizes and offsets, many straddling
//! bitmap chunks and barrier units), leg management (fail, remove, add, re-add, replace),
//! check and repair, speed limits, fault rules on any leg (failed reads, writes, flushes and
//! discards, in the data, the superblock or the bitmap), and power cuts (every leg's volatile
//! cache lost at once: between operations, with writes in flight, or between two legs'
//! superblock writes), each followed by reassembly from the legs in a seeded order.
//!
//! The oracle (`sim/model.rs`) is what a block device promises, checked on every read, after
//! every crash (the whole array) and after every sync (the whole array, then a check): a
//! write acknowledged before a successful FLUSH, or with FUA, reads back after any crash; a
//! read returns, per sector, the last acknowledged data or data written there and not
//! acknowledged, never another offset's bytes; a check of a whole array after its sync counts
//! no mismatch; an I/O fails only while a fault rule is armed or the array has failed.
//!
//! `cargo test --release -p raid1 --test sim` runs the fixed seeds (CI runs them in its debug
//! build); `SIM_SEEDS=N SIM_SEED_BASE=S` runs N seeds from S instead and `SIM_OPS=K` sets the
//! operations per seed. A failure prints the seed, the array's shape and the schedule so far,
//! and `SIM_SEEDS=1 SIM_SEED_BASE=<seed>` replays its schedule (the array's own threads keep
//! their timing, so a failure that depends on it may take a few replays; see `sim/world.rs`).
//! Every failing seed found becomes a named deterministic test in `faults.rs` (`seed_*` and
//! the tests that say "found by the simulator"): a change of the simulator changes what a
//! seed generates, a built schedule does not.
// A plain threaded test, never a loom model: it may use std::sync.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]
#![cfg(not(blkq_loom))]

mod common;
#[path = "sim/model.rs"]
mod model;
#[path = "sim/world.rs"]
mod world;

use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::time::Instant;

use world::{Stats, World};

/// Operations per seed unless `SIM_OPS` says otherwise.
const OPS: u64 = 300;
/// The seeds CI runs (within its time budget in a debug build).
const CI_SEEDS: u64 = 16;

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.trim().parse().ok())
}

/// Runs one seed for `ops` operations; on a failed promise prints the seed, the shape and
/// the schedule, then fails.
fn run_seed(seed: u64, ops: u64) -> Stats {
    let mut w = World::new(seed);
    let r = catch_unwind(AssertUnwindSafe(|| {
        for _ in 0..ops {
            w.step();
        }
    }));
    if let Err(p) = r {
        let log = &w.log;
        let from = log.len().saturating_sub(400);
        eprintln!(
            "\nsim: seed {} FAILED after {} operations; shape {:?}\nschedule{}:",
            w.seed,
            w.stats.ops,
            w.shape,
            if from > 0 {
                format!(" (last {} of {})", log.len() - from, log.len())
            } else {
                String::new()
            }
        );
        for line in &log[from..] {
            eprintln!("  {line}");
        }
        eprintln!(
            "replay: SIM_SEEDS=1 SIM_SEED_BASE={seed} cargo test --release -p raid1 --test sim\n"
        );
        // The array's stop may wait on what the failure left; don't hang on it.
        std::mem::forget(w);
        resume_unwind(p);
    }
    w.stats
}

#[test]
fn sim() {
    let n = env_u64("SIM_SEEDS").unwrap_or(CI_SEEDS);
    let base = env_u64("SIM_SEED_BASE").unwrap_or(1);
    let ops = env_u64("SIM_OPS").unwrap_or(OPS);
    let t0 = Instant::now();
    let mut total = Stats::default();
    for seed in base..base + n {
        total += run_seed(seed, ops);
    }
    println!(
        "sim: {n} seeds from {base}, {} operations ({} crashes, {} syncs, {} checks, {} fault \
         rules, {} leg changes, {} I/O errors) in {:.1} s",
        total.ops,
        total.crashes,
        total.syncs,
        total.checks,
        total.faults,
        total.leg_changes,
        total.io_errors,
        t0.elapsed().as_secs_f64()
    );
}
