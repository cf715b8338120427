//! Output of `blkq bench`: the JSON lines, the human-readable summary and the sweep table.

use std::fmt::Write as _;

use blk::sched::SchedChoice;
use blk::PoolPolicy;
use sbitmap::WakeAlgo;

use super::args::RunCfg;
use super::job::RunResult;

pub(super) fn json_str(s: &str) -> String {
    let mut o = String::with_capacity(s.len() + 2);
    o.push('"');
    for c in s.chars() {
        match c {
            '"' => o.push_str("\\\""),
            '\\' => o.push_str("\\\\"),
            c if (c as u32) < 0x20 => {
                let _ = write!(o, "\\u{:04x}", c as u32);
            }
            c => o.push(c),
        }
    }
    o.push('"');
    o
}

pub(super) fn wake_name(w: WakeAlgo) -> &'static str {
    match w {
        WakeAlgo::Counter => "counter",
        WakeAlgo::Legacy => "legacy",
    }
}

pub(super) fn policy_name(p: PoolPolicy) -> &'static str {
    match p {
        PoolPolicy::Steal => "steal",
        PoolPolicy::Fifo => "fifo",
        PoolPolicy::Batch => "batch",
    }
}

pub(super) fn to_json(cfg: &RunCfg, r: &RunResult, repeat: usize) -> String {
    format!(
        concat!(
            "{{\"device\":{},\"rw\":\"{}\",\"bs\":{},\"iodepth\":{},\"jobs\":{},",
            "\"runtime_s\":{:.3},\"hw_queues\":{},\"queue_depth\":{},\"shared_tags\":{},",
            "\"wake\":\"{}\",\"policy\":\"{}\",\"sched\":\"{}\",\"sched_lock\":{},",
            "\"max_in_flight\":{},",
            "\"repeat\":{},\"ios\":{},\"errors\":{},\"iops\":{:.0},\"bw_bytes\":{:.0},",
            "\"lat_ns\":{{\"mean\":{},\"p50\":{},\"p99\":{},\"p999\":{},\"max\":{},",
            "\"samples\":{},\"sampled_every\":{}}},",
            "\"tag_wait\":{{\"count\":{},\"mean_ns\":{},\"max_ns\":{},\"p99_ns\":{}}},",
            "\"ctx_switches\":{},\"ctx_switches_per_io\":{:.4},\"merges\":{},",
            "\"sched_lock_attempts\":{},\"sched_lock_contended\":{},",
            "\"contended_per_io\":{:.4}}}"
        ),
        json_str(&cfg.device),
        cfg.rw.name(),
        cfg.bs,
        cfg.iodepth,
        cfg.jobs,
        r.secs,
        cfg.hw_queues.map_or("null".into(), |v| v.to_string()),
        cfg.queue_depth.map_or("null".into(), |v| v.to_string()),
        cfg.shared_tags,
        wake_name(cfg.wake),
        policy_name(cfg.policy),
        cfg.sched.name(),
        match cfg.sched {
            SchedChoice::None => "null".to_string(),
            _ => format!("\"{}\"", cfg.sched_lock.name()),
        },
        cfg.max_in_flight.map_or("null".into(), |v| v.to_string()),
        repeat,
        r.ios,
        r.errors,
        r.iops,
        r.bw_bytes,
        r.lat.mean,
        r.lat.p50,
        r.lat.p99,
        r.lat.p999,
        r.lat.max,
        r.lat.samples,
        cfg.lat_sample,
        r.tag_wait_count,
        r.tag_wait_mean_ns,
        r.tag_wait_max_ns,
        r.tag_wait_p99_ns,
        r.ctx_switches,
        r.ctx_switches as f64 / r.ios.max(1) as f64,
        r.merges,
        r.lock_attempts,
        r.lock_contended,
        r.contended_per_io(),
    )
}

pub(super) fn mean_sd(v: &[f64]) -> (f64, f64) {
    let n = v.len().max(1) as f64;
    let m = v.iter().sum::<f64>() / n;
    let var = v.iter().map(|x| (x - m).powi(2)).sum::<f64>() / (n - 1.0).max(1.0);
    (m, var.sqrt())
}

pub(super) fn kfmt(x: f64) -> String {
    if x >= 1e6 {
        format!("{:.2}M", x / 1e6)
    } else {
        format!("{:.1}K", x / 1e3)
    }
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
        kfmt(r.iops),
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
            raid1: None,
            raid1_options: vec![],
        };
        let j = to_json(&cfg, &RunResult::default(), 1);
        for key in [
            "device",
            "rw",
            "bs",
            "iodepth",
            "jobs",
            "runtime_s",
            "hw_queues",
            "queue_depth",
            "shared_tags",
            "wake",
            "policy",
            "sched",
            "sched_lock",
            "max_in_flight",
            "repeat",
            "ios",
            "errors",
            "iops",
            "bw_bytes",
            "lat_ns",
            "mean",
            "p50",
            "p99",
            "p999",
            "max",
            "samples",
            "sampled_every",
            "tag_wait",
            "count",
            "mean_ns",
            "max_ns",
            "p99_ns",
            "ctx_switches",
            "ctx_switches_per_io",
            "merges",
            "sched_lock_attempts",
            "sched_lock_contended",
            "contended_per_io",
        ] {
            assert!(j.contains(&format!("\"{key}\":")), "{key} missing from {j}");
        }
        assert!(j.starts_with("{\"device\":\"null:1M,\\\"q\\\"\","), "{j}");
        assert_eq!(j.matches('{').count(), j.matches('}').count(), "{j}");
    }
}
