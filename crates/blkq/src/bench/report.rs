//! Output of `blkq bench`: the JSON lines, the human-readable summary and the sweep table.

use std::fmt::Write as _;

use serde::Serialize;

use blk::sched::SchedChoice;
use blk::PoolPolicy;
use sbitmap::WakeAlgo;

use super::args::RunCfg;
use super::format::thousands_or_millions;
use super::job::RunResult;

pub(super) fn wake_name(w: WakeAlgo) -> &'static str {
    match w {
        WakeAlgo::Counter => "counter",
        WakeAlgo::Legacy => "legacy",
        WakeAlgo::Chain => "chain",
    }
}

pub(super) fn policy_name(p: PoolPolicy) -> &'static str {
    match p {
        PoolPolicy::Steal => "steal",
        PoolPolicy::Fifo => "fifo",
        PoolPolicy::Batch => "batch",
    }
}

/// `lat_ns` of a JSON line: the sampled I/O latencies, ns.
#[derive(Debug, Serialize)]
pub(super) struct LatJson {
    pub(super) mean: u64,
    pub(super) p50: u64,
    pub(super) p99: u64,
    pub(super) p999: u64,
    pub(super) max: u64,
    pub(super) samples: u64,
    /// One I/O in this many was timed (`--lat-sample`).
    pub(super) sampled_every: u64,
}

/// `tag_wait` of a JSON line: the waits for a free tag, summed over the pools.
#[derive(Debug, Serialize)]
pub(super) struct TagWaitJson {
    pub(super) count: u64,
    pub(super) mean_ns: u64,
    pub(super) max_ns: u64,
    pub(super) p99_ns: u64,
}

/// One `blkq bench --json` line: the parameters of a run, then what it measured. Keys and
/// their order are the interface of /work/shared/DESIGN.md and bench/*.sh (which grep
/// `"iops":`): add keys at the end, never rename or drop one. Rates are rounded as the
/// hand-written lines had them (IOPS and bytes/s to integers, per-I/O ratios to 4 decimals,
/// the runtime to ms); `serde_json::to_string` writes it compact (no spaces).
#[derive(Debug, Serialize)]
pub(super) struct Report<'a> {
    pub(super) device: &'a str,
    pub(super) rw: &'static str,
    pub(super) bs: u32,
    pub(super) iodepth: usize,
    pub(super) jobs: usize,
    pub(super) runtime_s: f64,
    pub(super) hw_queues: Option<u16>,
    pub(super) queue_depth: Option<u32>,
    pub(super) shared_tags: bool,
    pub(super) wake: &'static str,
    pub(super) policy: &'static str,
    pub(super) sched: &'static str,
    /// The scheduler lock design; null without a scheduler.
    pub(super) sched_lock: Option<&'static str>,
    pub(super) max_in_flight: Option<u32>,
    /// Which of the `--repeat` runs of this configuration (from 0).
    pub(super) repeat: usize,
    pub(super) ios: u64,
    pub(super) errors: u64,
    pub(super) iops: u64,
    pub(super) bw_bytes: u64,
    pub(super) lat_ns: LatJson,
    pub(super) tag_wait: TagWaitJson,
    pub(super) ctx_switches: u64,
    pub(super) ctx_switches_per_io: f64,
    pub(super) merges: u64,
    pub(super) sched_lock_attempts: u64,
    pub(super) sched_lock_contended: u64,
    pub(super) contended_per_io: f64,
    /// `--seed` (added after the original keys).
    pub(super) seed: u64,
}

/// Rounds to `digits` decimals (what the JSON line shows of a ratio).
fn round_to(x: f64, digits: i32) -> f64 {
    let m = 10f64.powi(digits);
    if x.is_finite() {
        (x * m).round() / m
    } else {
        0.0
    }
}

impl<'a> Report<'a> {
    pub(super) fn new(cfg: &'a RunCfg, r: &RunResult, repeat: usize) -> Self {
        Report {
            device: &cfg.device,
            rw: cfg.rw.name(),
            bs: cfg.bs,
            iodepth: cfg.iodepth,
            jobs: cfg.jobs,
            runtime_s: round_to(r.secs, 3),
            hw_queues: cfg.hw_queues,
            queue_depth: cfg.queue_depth,
            shared_tags: cfg.shared_tags,
            wake: wake_name(cfg.wake),
            policy: policy_name(cfg.policy),
            sched: cfg.sched.name(),
            sched_lock: match cfg.sched {
                SchedChoice::None => None,
                _ => Some(cfg.sched_lock.name()),
            },
            max_in_flight: cfg.max_in_flight,
            repeat,
            ios: r.ios,
            errors: r.errors,
            iops: r.iops.round() as u64,
            bw_bytes: r.bw_bytes.round() as u64,
            lat_ns: LatJson {
                mean: r.lat.mean,
                p50: r.lat.p50,
                p99: r.lat.p99,
                p999: r.lat.p999,
                max: r.lat.max,
                samples: r.lat.samples,
                sampled_every: cfg.lat_sample,
            },
            tag_wait: TagWaitJson {
                count: r.tag_wait_count,
                mean_ns: r.tag_wait_mean_ns,
                max_ns: r.tag_wait_max_ns,
                p99_ns: r.tag_wait_p99_ns,
            },
            ctx_switches: r.ctx_switches,
            ctx_switches_per_io: round_to(r.ctx_switches as f64 / r.ios.max(1) as f64, 4),
            merges: r.merges,
            sched_lock_attempts: r.lock_attempts,
            sched_lock_contended: r.lock_contended,
            contended_per_io: round_to(r.contended_per_io(), 4),
            seed: cfg.seed,
        }
    }
}

/// The `--json` line of one run.
pub(super) fn to_json(cfg: &RunCfg, r: &RunResult, repeat: usize) -> String {
    // A struct of plain fields, strings and options: serialization cannot fail.
    serde_json::to_string(&Report::new(cfg, r, repeat)).unwrap_or_default()
}

pub(super) fn print_human(cfg: &RunCfg, r: &RunResult) {
    println!(
        "{} {} bs={} iodepth={} jobs={} wake={} policy={} sched={}{}",
        cfg.device,
        cfg.rw.name(),
        cfg.bs,
        cfg.iodepth,
        cfg.jobs,
        wake_name(cfg.wake),
        policy_name(cfg.policy),
        cfg.sched.name(),
        match cfg.sched {
            SchedChoice::None => String::new(),
            _ => format!(" sched_lock={}", cfg.sched_lock.name()),
        }
    );
    println!(
        "  iops={} bw={:.1}MiB/s ios={} errors={} ({:.2}s)",
        thousands_or_millions(r.iops),
        r.bw_bytes / (1 << 20) as f64,
        r.ios,
        r.errors,
        r.secs
    );
    println!(
        "  lat(ns, 1 in {}): mean={} p50={} p99={} p99.9={} max={}",
        cfg.lat_sample, r.lat.mean, r.lat.p50, r.lat.p99, r.lat.p999, r.lat.max
    );
    println!(
        "  tag waits={} mean={}ns p99<={}ns max={}ns  ctx switches={} ({:.4}/io)",
        r.tag_wait_count,
        r.tag_wait_mean_ns,
        r.tag_wait_p99_ns,
        r.tag_wait_max_ns,
        r.ctx_switches,
        r.ctx_switches as f64 / r.ios.max(1) as f64
    );
    if cfg.sched != SchedChoice::None {
        println!(
            "  sched: merges={} lock acquisitions={} contended={} ({:.4}/io)",
            r.merges,
            r.lock_attempts,
            r.lock_contended,
            r.contended_per_io()
        );
    }
}

pub(super) fn print_table(
    key: &str,
    vals: &[String],
    table: &[(String, Vec<(f64, f64)>)],
    fmt: &dyn Fn(f64) -> String,
) {
    let w = table
        .iter()
        .map(|(n, _)| n.len())
        .chain([key.len(), 16])
        .max()
        .unwrap_or(16);
    let mut out = String::new();
    let _ = write!(out, "| {key:<w$} |");
    for v in vals {
        let _ = write!(out, " {v:>17} |");
    }
    out.push('\n');
    let _ = write!(out, "|{}|", "-".repeat(w + 2));
    for _ in vals {
        let _ = write!(out, "{}|", "-".repeat(19));
    }
    out.push('\n');
    for (name, row) in table {
        let _ = write!(out, "| {name:<w$} |");
        for (m, sd) in row {
            let _ = write!(out, " {:>17} |", format!("{} ({})", fmt(*m), fmt(*sd)));
        }
        out.push('\n');
    }
    if table.len() == 2 {
        let _ = write!(out, "| {:<w$} |", "ratio row1/row2");
        for (a, b) in table[0].1.iter().zip(&table[1].1) {
            let r = if b.0 > 0.0 {
                format!("{:.3}", a.0 / b.0)
            } else {
                "-".to_string()
            };
            let _ = write!(out, " {r:>17} |");
        }
        out.push('\n');
    }
    print!("{out}");
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use blk::sched::{LockMode, SchedChoice};
    use blk::PoolPolicy;
    use sbitmap::WakeAlgo;

    use super::*;

    /// `blkq bench --json` keeps every field (scripts parse them).
    #[test]
    fn json_line_has_every_field() {
        let cfg = RunCfg {
            device: "null:1M,\"q\"".into(),
            rw: "randread".parse().unwrap(),
            rwmixread: 50,
            bs: 4096,
            iodepth: 8,
            jobs: 2,
            runtime: Duration::from_secs(1),
            hw_queues: Some(2),
            queue_depth: None,
            shared_tags: false,
            wake: WakeAlgo::Counter,
            policy: PoolPolicy::Fifo,
            sched: SchedChoice::None,
            sched_lock: LockMode::Serialized,
            max_in_flight: None,
            batch_requests: 1,
            batch_time: Duration::ZERO,
            size: None,
            lat_sample: 8,
            seed: 7,
            raid1: None,
            raid1_options: vec![],
            as_leg: false,
            dirty_bitmaps: None,
            dirty_bitmaps_gate: cbt::Mode::LockFree,
        };
        let r = RunResult {
            ios: 3000,
            errors: 0,
            secs: 1.000_4,
            iops: 2998.8,
            bw_bytes: 2998.8 * 4096.0,
            ctx_switches: 7,
            ..RunResult::default()
        };
        let j = to_json(&cfg, &r, 1);
        // Compact, one line, the device first and escaped (as the hand-written lines were).
        assert!(!j.contains(": ") && !j.contains('\n'), "{j}");
        assert!(j.starts_with("{\"device\":\"null:1M,\\\"q\\\"\","), "{j}");
        assert!(j.contains("\"iops\":2999,"), "{j}"); // what bench/*.sh grep
        let v: serde_json::Value = serde_json::from_str(&j).unwrap();
        let num = |k: &str| {
            v[k].as_f64()
                .unwrap_or_else(|| panic!("{k} missing from {j}"))
        };
        for key in [
            "bs",
            "iodepth",
            "jobs",
            "runtime_s",
            "hw_queues",
            "repeat",
            "ios",
            "errors",
            "iops",
            "bw_bytes",
            "ctx_switches",
            "ctx_switches_per_io",
            "merges",
            "sched_lock_attempts",
            "sched_lock_contended",
            "contended_per_io",
            "seed",
        ] {
            num(key);
        }
        for key in ["queue_depth", "sched_lock", "max_in_flight"] {
            assert!(v[key].is_null(), "{key} in {j}");
        }
        assert_eq!(v["device"], "null:1M,\"q\"");
        assert_eq!(v["rw"], "randread");
        assert_eq!(v["shared_tags"], false);
        assert_eq!(v["wake"], "counter");
        assert_eq!(v["policy"], "fifo");
        assert_eq!(v["sched"], "none");
        assert_eq!(num("iops"), 2999.0);
        assert_eq!(num("bw_bytes"), (2998.8f64 * 4096.0).round());
        assert_eq!(num("runtime_s"), 1.0);
        assert_eq!(num("ctx_switches_per_io"), 0.0023);
        assert_eq!(num("repeat"), 1.0);
        assert_eq!(num("seed"), 7.0);
        for key in [
            "mean",
            "p50",
            "p99",
            "p999",
            "max",
            "samples",
            "sampled_every",
        ] {
            assert!(v["lat_ns"][key].is_u64(), "lat_ns.{key} missing from {j}");
        }
        assert_eq!(v["lat_ns"]["sampled_every"], 8);
        for key in ["count", "mean_ns", "max_ns", "p99_ns"] {
            assert!(
                v["tag_wait"][key].is_u64(),
                "tag_wait.{key} missing from {j}"
            );
        }
        // A scheduler puts its lock design in; the keys' order is the documented one.
        let mut dl = cfg.clone();
        dl.sched = SchedChoice::MqDeadline;
        let j = to_json(&dl, &r, 0);
        let v: serde_json::Value = serde_json::from_str(&j).unwrap();
        assert_eq!(v["sched"], "mq-deadline");
        assert_eq!(v["sched_lock"], "serialized");
        let pos = |k: &str| j.find(&format!("\"{k}\":")).unwrap();
        assert!(
            pos("device") < pos("rw") && pos("repeat") < pos("iops"),
            "{j}"
        );
        assert!(
            pos("iops") < pos("lat_ns") && pos("lat_ns") < pos("tag_wait"),
            "{j}"
        );
        assert!(pos("tag_wait") < pos("ctx_switches") && pos("contended_per_io") < pos("seed"));
    }
}
