//! `blkq bench` end to end: the built binary, tiny runs (50 ms, a 16 MiB null device), its
//! `--json` lines parsed with serde_json, and the plots it draws. No timing assertions.

mod common;
use common::*;

use std::path::Path;

/// Every key of the documented `--json` interface, nested ones dotted.
const KEYS: &[&str] = &[
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
    "lat_ns.mean",
    "lat_ns.p50",
    "lat_ns.p99",
    "lat_ns.p999",
    "lat_ns.max",
    "lat_ns.samples",
    "lat_ns.sampled_every",
    "tag_wait.count",
    "tag_wait.mean_ns",
    "tag_wait.max_ns",
    "tag_wait.p99_ns",
    "ctx_switches",
    "ctx_switches_per_io",
    "merges",
    "sched_lock_attempts",
    "sched_lock_contended",
    "contended_per_io",
    "seed",
];

fn get<'v>(v: &'v serde_json::Value, key: &str) -> Option<&'v serde_json::Value> {
    key.split('.').try_fold(v, |v, k| v.get(k))
}

/// `blkq bench` of a null device for 50 ms at queue depth 4, with `more`: its stdout.
fn short_bench(more: &[&str]) -> String {
    let mut args = vec![
        "bench",
        "--device",
        "null:16M",
        "--runtime",
        "0.05",
        "--iodepth",
        "4",
    ];
    args.extend(more);
    ok(&args)
}

/// `blkq bench plot --x X SERIES --out OUT JSONL`.
fn plot<'a>(x: &'a str, series: &[&'a str], out: &'a Path, jsonl: &'a Path) -> Vec<&'a str> {
    let mut args = vec!["bench", "plot", "--x", x];
    args.extend(series);
    args.extend(["--out", out.to_str().unwrap(), jsonl.to_str().unwrap()]);
    args
}

/// A swept, repeated `--json` run prints one compact object per run with every documented
/// key, and nothing else on stdout (no progress bar: stderr is not a terminal here either).
/// `blkq bench plot` draws those lines; `--plot` draws the invocation's own runs.
#[test]
fn json_lines_and_plots() {
    let d = tempfile::tempdir().unwrap();
    let out = short_bench(&[
        "--json",
        "--repeat",
        "2",
        "--wake",
        "counter,legacy",
        "--sweep",
        "queue-depth=4,8",
        "--seed",
        "42",
    ]);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 2 * 2 * 2, "{out}");
    for l in &lines {
        assert!(l.contains("\"iops\":") && !l.contains(": "), "{l}");
        let v: serde_json::Value = serde_json::from_str(l).unwrap();
        for k in KEYS {
            assert!(get(&v, k).is_some(), "{k} missing from {l}");
        }
        assert!(v["ios"].as_u64().unwrap() > 0, "{l}");
        assert_eq!(v["errors"], 0);
        assert_eq!(v["seed"], 42);
    }
    let jsonl = d.path().join("runs.jsonl");
    std::fs::write(&jsonl, format!("## a header line\n{out}")).unwrap();
    let svg = d.path().join("wake.svg");
    ok(&plot("queue_depth", &["--series", "wake"], &svg, &jsonl));
    let s = std::fs::read_to_string(&svg).unwrap();
    assert!(s.starts_with("<svg") && s.contains("counter") && s.contains("legacy"));
    // A bad key is an error, not a panic.
    let e = fails(&plot("nope", &[], &svg, &jsonl));
    assert!(e.contains("nope"), "{e}");
    // --plot: the invocation's own sweep; stdout is the usual table.
    let own = d.path().join("own.svg");
    let table = short_bench(&["--sweep", "jobs=1,2", "--plot", own.to_str().unwrap()]);
    assert!(table.contains("| jobs"), "{table}");
    let s = std::fs::read_to_string(&own).unwrap();
    assert!(s.starts_with("<svg") && s.contains("chain/steal"));
}
