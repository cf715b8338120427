//! A deterministic simulator of the mirror (in the spirit of FoundationDB's simulation tests
//! and TigerBeetle's VOPR): one seed drives the array's shape (with, for half the seeds,
//! write-behind to a write-mostly last leg, and the automatic re-add), every operation (reads,
//! writes, FUA writes, FLUSH, TRIM, WRITE_ZEROES of seeded sizes and offsets, many straddling
//! bitmap chunks and barrier units), leg management (fail, remove, add, re-add, replace),
//! check and repair, speed limits, fault rules on any leg (failed reads, writes, flushes and
//! discards, in the data, the superblock or the bitmap), and power cuts (every leg's volatile
//! cache lost at once, a seeded part of it kept: between operations, with writes in flight,
//! during a resync, recovery or check at a slow speed limit, or between two legs' superblock
//! writes), each followed by reassembly from the legs in a seeded order. Half the seeds track
//! changed blocks over the array (`cbt::Tracked`, dirty bitmaps in a sidecar file added,
//! rotated, cleared and removed by the schedule, reopened at every assembly). A third keep
//! per-block checksums (`integrity=crc32c`): their I/O is 4 KiB aligned, and half their fault
//! rules flip a bit of a leg's reads or writes instead (in a seeded part of the data, for the
//! next few I/Os, the nth, or with a probability), silent corruption the sums must catch.
//!
//! The oracle (`sim/model.rs`) is what a block device promises, checked on every read, after
//! every crash (the whole array) and after every sync (the whole array, then a check): a
//! write acknowledged before a successful FLUSH, or with FUA, reads back after any crash; a
//! read returns, per sector, the last acknowledged data or data written there and not
//! acknowledged, never another offset's bytes, and the same as the last read of it until the
//! next write there (reads pin); a check of a whole array after its sync counts no mismatch;
//! an I/O fails only when due (every leg that could serve it has a fault rule armed that may
//! fail it, or the array failed). A power cut keeps a seeded part of each leg's unflushed
//! writes, whole or torn, so the legs disagree afterwards where an unclean stop leaves them
//! so; leg changes heal the array about as often as they break it, so checks judge a whole
//! array. At every assembly, reads are pinned to what the resync source (the first in-sync leg
//! that is not write-mostly) holds. Every granule written since a dirty bitmap was added or
//! cleared is dirty in it or in the bitmap rotated from it, after any command and any crash.
//!
//! With checksums the oracle also says where a flipped bit may reach a client: nowhere the
//! array holds the block's sum. It may only where the array has none (never written since
//! creation, or trimmed), or where the crash rule may have re-summed what a leg held (in a
//! chunk dirty at a power cut, or anywhere without a bitmap, until written again; and a block
//! written since, while its chunk still waits for the resync); `SIM_SUMS_STRICT=1` refuses
//! those too, to find where that happens. A read fails only when due as before, or when for
//! some block every leg that could serve it may hold it flipped (a write flip rule covered it
//! while armed, or the leg was recovered where each source might) or has a read flip armed
//! over it. A check of a whole array counts no mismatch unless a flip rule is armed or a
//! leg's copy may be flipped; a scrub (a repair with every flip rule removed, then a FLUSH)
//! leaves a check counting only the blocks every leg may hold flipped. A heal probe flips a
//! bit behind the array's back in a different block of every leg's copy of a summed range,
//! then reads it once: the read returns the model's data and every leg then holds it.
//!
//! `cargo test --release -p raid1 --test sim` runs 12 fixed seeds and 4 from a base that
//! changes daily, printing both (CI runs them in its debug build); `SIM_SEEDS=N
//! SIM_SEED_BASE=S` runs N seeds from S instead (`S=daily`: today's base) and `SIM_OPS=K` sets
//! the operations per seed. The summary counts what the oracle could judge (coverage), and a
//! run of `FLOOR_SEEDS` seeds or more fails below its floors. `SIM_KEEP_GOING=1` runs every
//! seed and prints `caught K/N` (`scripts/mutants.sh`). `SIM_WHERE=write_behind,slow_link,...`
//! runs only the seeds whose shape has each named trait (`write_behind`, `slow_link`,
//! `concurrent`, `bitmap`, `cbt`, `readd`, `latency`, `three_legs`, `integrity`; to hunt a
//! failure of one shape), counting the others as skipped. A failure prints the seed, the
//! array's shape and the schedule so far, and `SIM_SEEDS=1 SIM_SEED_BASE=<seed>` replays its
//! schedule (the array's own threads keep their timing, so a failure that depends on it may
//! take a few replays; see `sim/world.rs`). Every failing seed found becomes a named
//! deterministic test in `faults.rs` (`seed_*` and the tests that say "found by the
//! simulator", and in `integrity.rs`): a change of the simulator changes what a seed
//! generates, a built schedule does not.
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

use world::{Rng, Shape, Stats, World};

/// Operations per seed unless `SIM_OPS` says otherwise.
const OPS: u64 = 300;
/// The fixed seeds CI runs (1..=CI_SEEDS: reproducible), and the rotating ones it runs beside
/// them (from a base that changes every day: new schedules every day, printed to replay).
const CI_SEEDS: u64 = 12;
const CI_ROTATING: u64 = 4;
/// A run of at least this many seeds must reach the coverage floors (`floors`).
const FLOOR_SEEDS: u64 = 100;

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.trim().parse().ok())
}

/// Today's rotating seed base: days since 1970 (UTC) spread over 2^32, above the fixed seeds.
fn daily_base() -> u64 {
    let days = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() / 86_400);
    1_000_000 + (days.wrapping_mul(0x9E37_79B9) & 0xFFFF_FFFF)
}

/// Whether seed `seed`'s shape has every trait `SIM_WHERE` names (none named: every seed).
fn shape_wanted(seed: u64, traits: &[String]) -> bool {
    let s = Shape::from_rng(&mut Rng::new(seed));
    traits.iter().all(|t| match t.as_str() {
        "write_behind" => s.write_behind > 0,
        "slow_link" => s.slow_link_ms > 0,
        "concurrent" => s.concurrent,
        "bitmap" => s.bitmap_chunk > 0,
        "cbt" => s.cbt,
        "readd" => s.readd,
        "latency" => s.latency_us > 0,
        "three_legs" => s.legs == 3,
        "integrity" => s.integrity,
        other => panic!("SIM_WHERE: unknown trait {other:?}"),
    })
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
    w.stats()
}

/// The share of `part` in `whole`, in percent.
fn pct(part: u64, whole: u64) -> f64 {
    100.0 * part as f64 / whole.max(1) as f64
}

/// What a long run must reach, or the oracle judges too little of what it ran: (what, got,
/// floor), a failure when got < floor.
fn floors(t: &Stats, seeds: u64) -> Vec<(&'static str, f64, f64)> {
    let per_seed = |n: u64| n as f64 / seeds as f64;
    vec![
        (
            "whole operations %",
            100.0 - pct(t.degraded_ops, t.ops),
            35.0,
        ),
        (
            "checks of a whole array per seed",
            per_seed(t.whole_checks),
            4.0,
        ),
        (
            "crashes mid-sync per seed",
            per_seed(t.crashes_mid_sync),
            1.0,
        ),
        (
            "superblock cuts that held %",
            pct(t.sb_cuts_held, t.sb_cuts),
            40.0,
        ),
        ("reads pinned per seed", per_seed(t.pins), 1000.0),
        (
            "leg writes kept at a cut per seed",
            per_seed(t.writes_kept),
            10.0,
        ),
    ]
}

#[test]
fn sim() {
    let ops = env_u64("SIM_OPS").unwrap_or(OPS);
    // SIM_SEEDS=N runs N seeds from SIM_SEED_BASE (default 1; `SIM_SEED_BASE=daily`: today's
    // rotating base); otherwise the fixed CI seeds and today's rotating ones.
    let base_env = std::env::var("SIM_SEED_BASE").ok();
    let daily = daily_base();
    let runs: Vec<(u64, u64)> = match env_u64("SIM_SEEDS") {
        Some(n) => {
            let base = match base_env.as_deref().map(str::trim) {
                Some("daily") => daily,
                Some(b) => b.parse().unwrap_or(1),
                None => 1,
            };
            vec![(base, n)]
        }
        None => vec![(1, CI_SEEDS), (daily, CI_ROTATING)],
    };
    let n: u64 = runs.iter().map(|r| r.1).sum();
    for &(base, k) in &runs {
        println!(
            "sim: seeds {base}..{} (replay one: SIM_SEEDS=1 SIM_SEED_BASE=<seed>; these: \
             SIM_SEEDS={k} SIM_SEED_BASE={base})",
            base + k - 1
        );
    }
    // SIM_KEEP_GOING=1: run every seed and count the failing ones (scripts/mutants.sh).
    let keep_going = env_u64("SIM_KEEP_GOING").unwrap_or(0) != 0;
    let traits: Vec<String> = std::env::var("SIM_WHERE")
        .unwrap_or_default()
        .split(',')
        .map(|t| t.trim().to_string())
        .filter(|t| !t.is_empty())
        .collect();
    let t0 = Instant::now();
    let mut total = Stats::default();
    let mut failed = Vec::new();
    let mut skipped = 0u64;
    for &(base, k) in &runs {
        for seed in base..base + k {
            if !shape_wanted(seed, &traits) {
                skipped += 1;
                continue;
            }
            if keep_going {
                match catch_unwind(|| run_seed(seed, ops)) {
                    Ok(st) => total += st,
                    Err(_) => failed.push(seed),
                }
            } else {
                total += run_seed(seed, ops);
            }
        }
    }
    let t = &total;
    // The seeds run (those SIM_WHERE left out are not judged).
    let n = n - skipped;
    if skipped > 0 {
        println!(
            "sim: {skipped} seeds skipped (SIM_WHERE={})",
            traits.join(",")
        );
    }
    println!(
        "sim: {n} seeds, {} operations ({} crashes, {} syncs, {} checks, {} fault rules, {} leg \
         changes, {} I/O errors) in {:.1} s",
        t.ops,
        t.crashes,
        t.syncs,
        t.checks,
        t.faults,
        t.leg_changes,
        t.io_errors,
        t0.elapsed().as_secs_f64()
    );
    println!(
        "sim coverage: degraded {:.0}% of operations, {} checks of a whole array, {} crashes \
         mid-sync, {}/{} superblock cuts held, {} errors accepted as due, {} leg writes kept \
         and {} torn at a cut, {} sectors pinned by a read and {} reads of a pinned one, {} \
         dirty bitmap commands and {} granules found dirty as owed",
        pct(t.degraded_ops, t.ops),
        t.whole_checks,
        t.crashes_mid_sync,
        t.sb_cuts_held,
        t.sb_cuts,
        t.errors_due,
        t.writes_kept,
        t.writes_torn,
        t.pins,
        t.pin_hits,
        t.bitmap_ops,
        t.granules_checked
    );
    println!(
        "sim integrity: {} seeds with checksums, flip rules armed {} on reads and {} on \
         writes, {} leg I/Os flipped, {} blocks healed, {} unrecoverable, {} re-summed, {} \
         read errors due to flipped copies, {} scrubs judged, {} heal probes, sectors read \
         flipped where \
         no sum could catch it: {} never written or trimmed, {} re-summed at a crash, {} \
         re-summed at a crash of a degraded array, {} written since a crash before the \
         resync",
        t.integrity_seeds,
        t.flips_read_armed,
        t.flips_write_armed,
        t.flips_fired,
        t.healed,
        t.unrecoverable,
        t.resummed,
        t.flip_errors_due,
        t.scrubs,
        t.heal_probes,
        t.flips_nosum,
        t.flips_crash,
        t.flips_crash_degraded,
        t.flips_pending
    );
    if keep_going {
        println!(
            "sim: caught {}/{n} (failing seeds {failed:?})",
            failed.len()
        );
        assert!(failed.is_empty(), "{} of {n} seeds failed", failed.len());
    }
    // A filtered run judges one kind of shape: the floors are for the mix.
    if n >= FLOOR_SEEDS && ops >= OPS && traits.is_empty() {
        let low: Vec<_> = floors(t, n)
            .into_iter()
            .filter(|&(_, got, floor)| got < floor)
            .collect();
        assert!(
            low.is_empty(),
            "coverage below its floor (what, got, floor): {low:?}"
        );
    }
}
