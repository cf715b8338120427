//! `blkq bench`: an in-process fio. Jobs are threads; each keeps `iodepth` bios in flight
//! against one queue built from a device spec, submitting under a plug and reaping whatever
//! completed, until the runtime is over.
//!
//! With `--raid1 LEG,LEG[,...]` the jobs drive a RAID1 mirror (a bio-based `blk::Device`)
//! instead of a queue: a new array is created on the legs (the bench owns them) and each job
//! hands each iodepth refill to `submit_batch` as one batch. The statistics are the same
//! (IOPS, latency histogram, `--json` fields); `tag_wait_*`, `merges` and the scheduler-lock
//! counts are 0 there (the mirror has no tags or scheduler of its own and the legs' are not
//! summed), `ctx_switches` is still the jobs' own. `--sweep barrier=locked,lockless` runs
//! each barrier design in turn.
//!
//! `--json` lines are a `serde` struct (`report::Report`, compact `serde_json`); offsets come
//! from `rand`'s `SmallRng` per job, seeded from `--seed`; latencies go into a pre-sized
//! `hdrhistogram`; the progress bar (`indicatif`) is drawn on stderr only when it is a terminal
//! and never with `--json`. `--plot FILE.svg` draws the invocation's runs (IOPS against the
//! sweep, one line per row, error bars over the repeats) and `blkq bench plot` draws `--json`
//! lines collected from several invocations (see `plot`).
//!
//! This file is the sweep/repeat driver (`run`); the options, the job loop, the latency
//! statistics, the output and the plots live in the files beside it.

mod args;
mod format;
mod hist;
mod job;
mod plot;
mod report;
mod stats;

use std::time::Duration;

use anyhow::{bail, Context, Result};
use blk::sched::{LockMode, SchedChoice};
use blk::PoolPolicy;
use blk_drivers::spec::parse_size;
use sbitmap::WakeAlgo;

use args::{apply, list, RunCfg};
pub use args::{BenchArgs, BenchCmd};
use format::thousands_or_millions;
use job::{run_once, verify};
use report::{policy_name, print_human, print_table, to_json, wake_name};
use stats::mean_sd;

/// Runs `blkq bench`.
pub fn run(a: BenchArgs) -> Result<()> {
    if let Some(BenchCmd::Plot(p)) = &a.cmd {
        return plot::run(p);
    }
    if a.iodepth == 0 || a.jobs == 0 || a.repeat == 0 || a.lat_sample == 0 {
        bail!("--iodepth, --jobs, --repeat and --lat-sample must be at least 1");
    }
    let wakes: Vec<WakeAlgo> = list(&a.wake, "--wake")?;
    let policies: Vec<PoolPolicy> = list(&a.policy, "--policy")?;
    let scheds: Vec<SchedChoice> = list(&a.sched, "--sched")?;
    let locks: Vec<LockMode> = list(&a.sched_lock, "--sched-lock")?;
    let sched_rows = sched_rows(&scheds, &locks);
    let base = base_cfg(&a, wakes[0], policies[0], sched_rows[0])?;
    if a.verify {
        return verify(&base);
    }
    let sweep = Sweep::parse(a.sweep.as_deref())?;
    // rows: (wake, policy, scheduler); columns: sweep values; cells: mean and sd of iops
    let mut table: Vec<(String, Vec<(f64, f64)>)> = vec![];
    // the same rows, cells: iops of each repeat (for --plot)
    let mut runs: Vec<plot::Series> = vec![];
    // the same rows, cells: contended scheduler-lock acquisitions per I/O
    let mut contention: Vec<(String, Vec<(f64, f64)>)> = vec![];
    let mut progress = Progress {
        run_no: 0,
        total: wakes.len() * policies.len() * sched_rows.len() * sweep.vals.len() * a.repeat,
    };
    for &w in &wakes {
        for &p in &policies {
            for &(sc, lk) in &sched_rows {
                let mut cfg = base.clone();
                cfg.wake = w;
                cfg.policy = p;
                cfg.sched = sc;
                cfg.sched_lock = lk;
                let row = run_row(&a, &cfg, &sweep, &mut progress)?;
                let mut name = format!("{}/{}", wake_name(w), policy_name(p));
                if sched_rows.len() > 1 || sc != SchedChoice::None {
                    name = match sc {
                        SchedChoice::None => format!("{name}/none"),
                        _ => format!("{name}/{}/{}", sc.name(), lk.name()),
                    };
                }
                if sc != SchedChoice::None {
                    contention.push((name.clone(), row.contention));
                }
                runs.push(plot::Series {
                    name: name.clone(),
                    points: row.cells,
                });
                table.push((name, row.iops));
            }
        }
    }
    if !a.json && (sweep.key.is_some() || a.repeat > 1 || table.len() > 1) {
        let key = sweep.key.as_deref().unwrap_or("-");
        print_table(key, &sweep.vals, &table, &thousands_or_millions);
        if !contention.is_empty() {
            println!("\ncontended scheduler-lock acquisitions per I/O (mean (sd)):");
            print_table(key, &sweep.vals, &contention, &|x| format!("{x:.4}"));
        }
    }
    if let Some(path) = &a.plot {
        let title = a.plot_title.clone().unwrap_or_else(|| {
            format!(
                "{} {} bs={} iodepth={} jobs={}",
                base.device,
                base.rw.name(),
                base.bs,
                base.iodepth,
                base.jobs
            )
        });
        plot::write_svg(
            &sweep_plot(title, sweep.key.as_deref(), &sweep.vals, runs),
            path,
            plot::ErrBars::Minmax,
        )?;
    }
    Ok(())
}

/// The rows of schedulers: `none` once, mq-deadline once per lock design.
fn sched_rows(scheds: &[SchedChoice], locks: &[LockMode]) -> Vec<(SchedChoice, LockMode)> {
    let mut rows: Vec<(SchedChoice, LockMode)> = vec![];
    for &s in scheds {
        match s {
            SchedChoice::None => rows.push((s, locks[0])),
            _ => rows.extend(locks.iter().map(|&l| (s, l))),
        }
    }
    rows
}

/// The run configuration the options give, with the first of each listed choice (wake,
/// policy, scheduler row); each row of the table sets its own over it.
fn base_cfg(
    a: &BenchArgs,
    wake: WakeAlgo,
    policy: PoolPolicy,
    (sched, sched_lock): (SchedChoice, LockMode),
) -> Result<RunCfg> {
    let mut base = RunCfg {
        device: a.device.clone(),
        rw: a.rw.parse()?,
        rwmixread: a.rwmixread.min(100),
        bs: u32::try_from(parse_size(&a.bs)?).context("--bs too large")?,
        iodepth: a.iodepth,
        jobs: a.jobs,
        runtime: Duration::from_secs_f64(a.runtime.max(0.1)),
        hw_queues: a.hw_queues,
        queue_depth: a.queue_depth,
        shared_tags: a.shared_tags,
        wake,
        policy,
        sched,
        sched_lock,
        max_in_flight: a.max_in_flight,
        batch_requests: a.batch_requests,
        batch_time: Duration::from_micros(a.batch_time_us),
        size: a.size.as_deref().map(parse_size).transpose()?,
        lat_sample: a.lat_sample,
        seed: a.seed,
        raid1: a.raid1.clone(),
        raid1_options: a.raid1_options.clone(),
        as_leg: a.as_leg,
        dirty_bitmaps: a
            .dirty_bitmaps
            .as_deref()
            .map(args::parse_dirty_bitmaps)
            .transpose()?,
        dirty_bitmaps_gate: a
            .dirty_bitmaps_gate
            .parse()
            .map_err(|e| anyhow::anyhow!("--dirty-bitmaps-gate: {e}"))?,
    };
    if base.raid1.is_some() || base.dirty_bitmaps.is_some() {
        base.device = base.label();
    }
    Ok(base)
}

/// `--sweep key=v1,v2,...`: the option swept and its values (the columns of the table);
/// without it, one unnamed column.
struct Sweep {
    key: Option<String>,
    vals: Vec<String>,
}

impl Sweep {
    fn parse(sweep: Option<&str>) -> Result<Self> {
        Ok(match sweep {
            Some(s) => {
                let (k, v) = s.split_once('=').context("--sweep expects key=v1,v2,...")?;
                Self {
                    key: Some(k.to_string()),
                    vals: v.split(',').map(str::to_string).collect(),
                }
            }
            None => Self {
                key: None,
                vals: vec![String::new()],
            },
        })
    }
}

/// Which run of how many is under way (for the progress bar's label).
struct Progress {
    run_no: usize,
    total: usize,
}

/// One row of the table: per sweep value, the mean and sd of IOPS and of contended
/// scheduler-lock acquisitions per I/O, and each repeat's IOPS.
struct Row {
    iops: Vec<(f64, f64)>,
    contention: Vec<(f64, f64)>,
    cells: Vec<Vec<f64>>,
}

/// Runs one row (`row_cfg`: its wake, policy and scheduler) over every sweep value, each
/// `--repeat` times, printing each run's `--json` line or (a single run) its report.
fn run_row(a: &BenchArgs, row_cfg: &RunCfg, sweep: &Sweep, progress: &mut Progress) -> Result<Row> {
    let mut row = Row {
        iops: vec![],
        contention: vec![],
        cells: vec![],
    };
    for v in &sweep.vals {
        let mut cfg = row_cfg.clone();
        if let Some(k) = &sweep.key {
            apply(&mut cfg, k, v)?;
        }
        if cfg.raid1.is_some() {
            cfg.device = cfg.label();
        }
        let mut iops = vec![];
        let mut cont = vec![];
        for rep in 0..a.repeat {
            progress.run_no += 1;
            // A progress bar on stderr when it is a terminal, never with --json.
            let label = (!a.json).then(|| {
                let mut l = format!("[{}/{}]", progress.run_no, progress.total);
                if let Some(k) = &sweep.key {
                    l.push_str(&format!(" {k}={v}"));
                }
                l
            });
            let r = run_once(&cfg, label.as_deref())?;
            if a.json {
                println!("{}", to_json(&cfg, &r, rep));
            } else if sweep.key.is_none() && a.repeat == 1 {
                print_human(&cfg, &r);
            }
            iops.push(r.iops);
            cont.push(r.contended_per_io());
        }
        row.iops.push(mean_sd(&iops));
        row.contention.push(mean_sd(&cont));
        row.cells.push(iops);
    }
    Ok(row)
}

/// The chart of one invocation: IOPS against the sweep values, one line per row (wake,
/// policy, scheduler); without a sweep, the rows side by side as the x categories.
fn sweep_plot(
    title: String,
    sweep_key: Option<&str>,
    sweep_vals: &[String],
    runs: Vec<plot::Series>,
) -> plot::PlotData {
    match sweep_key {
        Some(k) => plot::PlotData {
            title,
            x_desc: k.to_string(),
            y_desc: "IOPS".into(),
            ticks: sweep_vals.to_vec(),
            series: runs,
        },
        None => plot::PlotData {
            title,
            x_desc: "wake/policy/scheduler".into(),
            y_desc: "IOPS".into(),
            ticks: runs.iter().map(|s| s.name.clone()).collect(),
            series: vec![plot::Series {
                name: "IOPS".into(),
                points: runs.into_iter().flat_map(|s| s.points).collect(),
            }],
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn series(name: &str, points: Vec<Vec<f64>>) -> plot::Series {
        plot::Series {
            name: name.into(),
            points,
        }
    }

    /// With a sweep the rows are the lines; without one they become the x categories of a
    /// single line.
    #[test]
    fn sweep_plot_rows_and_columns() {
        let runs = vec![
            series("counter/steal", vec![vec![1.0, 2.0], vec![3.0]]),
            series("legacy/steal", vec![vec![4.0], vec![5.0]]),
        ];
        let vals = vec!["2".to_string(), "4".to_string()];
        let d = sweep_plot("t".into(), Some("queue-depth"), &vals, runs);
        assert_eq!(d.ticks, vals);
        assert_eq!(d.x_desc, "queue-depth");
        assert_eq!(d.series.len(), 2);
        let runs = vec![
            series("counter/steal/none", vec![vec![1.0, 2.0]]),
            series("counter/steal/mq-deadline/locked", vec![vec![3.0]]),
        ];
        let d = sweep_plot("t".into(), None, &[String::new()], runs);
        assert_eq!(
            d.ticks,
            ["counter/steal/none", "counter/steal/mq-deadline/locked"]
        );
        assert_eq!(d.series.len(), 1);
        assert_eq!(d.series[0].points, [vec![1.0, 2.0], vec![3.0]]);
    }
}
