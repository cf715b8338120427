//! `blkq serve --metrics 127.0.0.1:0`: known I/O through `nbd::client` moves each counter by
//! exactly the right amount (scraped with a plain HTTP GET); other paths are 404; a RAID1
//! array shows node_exporter's `node_md_*` shape; `--log-format json` writes one JSON object
//! per line, and a connection's close line carries its bytes and requests. The built binary;
//! bounded waits only, no timing assertions.

mod common;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use common::{http_get as get, Serving};
use nbd::client::{Client, ClientOptions, Endpoint};
use nbd::codec::proto::CmdFlags;

/// `name{labels}` -> value, for every sample of a scrape.
fn scrape(addr: &str) -> HashMap<String, f64> {
    let (status, body) = get(addr, "/metrics");
    assert!(status.contains("200"), "{status}");
    assert!(body.ends_with("# EOF\n"), "{body}");
    body.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| {
            let (k, v) = l.rsplit_once(' ').unwrap();
            (k.to_string(), v.parse::<f64>().unwrap())
        })
        .collect()
}

/// Asserts how far each of the disk counters `moved` (name, by how much) of `export` moved
/// from `before` to `after`, and that `after` has no I/O in flight.
fn assert_disk_moved(
    before: &HashMap<String, f64>,
    after: &HashMap<String, f64>,
    export: &str,
    moved: &[(&str, f64)],
) {
    let e = |name: &str| format!("blkq_disk_{name}{{export=\"{export}\"}}");
    for (name, by) in moved {
        assert_eq!(
            value(after, &e(name)) - value(before, &e(name)),
            *by,
            "{name}"
        );
    }
    assert_eq!(value(after, &e("io_now")), 0.0);
}

fn value(m: &HashMap<String, f64>, key: &str) -> f64 {
    *m.get(key)
        .unwrap_or_else(|| panic!("no {key} in {:#?}", m.keys().collect::<Vec<_>>()))
}

/// Polls the endpoint (bounded) until `ok` holds for a scrape.
#[allow(clippy::type_complexity)]
fn scrape_until(
    addr: &str,
    why: &str,
    ok: impl Fn(&HashMap<String, f64>) -> bool,
) -> HashMap<String, f64> {
    let t0 = Instant::now();
    loop {
        let m = scrape(addr);
        if ok(&m) {
            return m;
        }
        assert!(t0.elapsed() < Duration::from_secs(60), "{why}: {m:#?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn counters_move_by_exactly_the_io_done() {
    let dir = tempfile::tempdir().unwrap();
    let (mut s, addr) = Serving::with_metrics(
        dir.path(),
        "m",
        &["--device", "mem:16M", "--log-format", "json"],
        |l| l,
    );
    // The launcher's readiness probe is a connection too: wait until it is gone.
    let open = "blkq_nbd_connections_open";
    let accepted = "blkq_nbd_connections_accepted_total";
    let before = scrape_until(addr.as_str(), "the probe connection never closed", |m| {
        value(m, open) == 0.0 && value(m, accepted) >= 1.0
    });

    let mut cl = s.client();
    // Written first: a read of a hole is answered without reading the device.
    let data = vec![0x5au8; 65536];
    for i in 0..3u64 {
        cl.write((1 << 20) + i * 65536, &data, CmdFlags::empty())
            .unwrap();
    }
    for i in 0..10u64 {
        cl.read((1 << 20) + i * 4096, 4096).unwrap();
    }
    cl.flush().unwrap();
    cl.trim(4 << 20, 1 << 20).unwrap();
    cl.disconnect().unwrap();

    let after = scrape_until(addr.as_str(), "the client's connection never closed", |m| {
        value(m, open) == 0.0 && value(m, "blkq_nbd_transmissions_total") >= 1.0
    });
    assert_disk_moved(
        &before,
        &after,
        "",
        &[
            ("reads_completed_total", 10.0),
            ("read_bytes_total", 40960.0),
            ("writes_completed_total", 3.0),
            ("written_bytes_total", 196608.0),
            ("flush_requests_total", 1.0),
            ("discards_completed_total", 1.0),
            ("discarded_sectors_total", 2048.0),
            ("errors_total", 0.0),
        ],
    );
    let delta = |k: &str| value(&after, k) - value(&before, k);
    let e = |name: &str| format!("blkq_disk_{name}{{export=\"\"}}");
    for t in [
        "read_time_seconds_total",
        "write_time_seconds_total",
        "discard_time_seconds_total",
        "flush_requests_time_seconds_total",
        "io_time_seconds_total",
    ] {
        assert!(delta(&e(t)) >= 0.0, "{t}");
    }
    assert_eq!(delta(accepted), 1.0);
    assert_eq!(delta("blkq_nbd_transmissions_total"), 1.0);
    // 10 reads, 3 writes, a flush, a trim and the disconnect.
    assert_eq!(delta("blkq_nbd_requests_total"), 16.0);
    assert_eq!(delta("blkq_nbd_requests_refused_total"), 0.0);
    assert_eq!(value(&after, "blkq_nbd_memory_budget_used_bytes"), 0.0);
    assert!(value(&after, "blkq_nbd_memory_budget_bytes") > 0.0);
    assert!(after.contains_key("blkq_tag_waits_total{export=\"\",hctx=\"0\"}"));
    assert!(after.contains_key("blkq_process_context_switches_total{type=\"voluntary\"}"));
    assert!(after.contains_key("blkq_waitq_wakeups_total"));
    assert!(after.contains_key("blkq_nbd_handshake_failures_total{reason=\"timeout\"}"));

    let (status, _) = get(&addr, "/nope");
    assert!(status.contains("404"), "{status}");

    // The log: every line is a JSON object; the client's close line has its totals.
    s.signal(libc::SIGTERM);
    let st = s.wait_exit(Duration::from_secs(120));
    assert!(st.success(), "{st}: {}", s.stderr_text());
    let log = s.stderr_text();
    let lines: Vec<serde_json::Value> = log
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    let close = lines
        .iter()
        .find(|v| {
            v["message"]
                .as_str()
                .is_some_and(|m| m.starts_with("connection closed:"))
                && v["requests"].as_u64().is_some_and(|n| n > 0)
        })
        .unwrap_or_else(|| panic!("no close line: {log}"));
    assert_eq!(close["level"], "INFO", "{close}");
    assert_eq!(close["bytes_read"], 40960, "{close}");
    assert_eq!(close["bytes_written"], 196608, "{close}");
    assert_eq!(close["requests"], 16, "{close}");
    assert_eq!(close["refused"], 0, "{close}");
    assert_eq!(close["export"], "", "{close}");
    assert!(close["duration_s"].as_f64().is_some(), "{close}");
    assert!(close["reason"].as_str().is_some(), "{close}");
    let open_line = lines
        .iter()
        .find(|v| v["message"] == "connection open")
        .unwrap_or_else(|| panic!("no open line: {log}"));
    assert_eq!(open_line["tls"], false, "{open_line}");
    assert!(open_line["replies"].as_str().is_some(), "{open_line}");
}

#[test]
fn raid1_arrays_have_the_md_shape() {
    let dir = tempfile::tempdir().unwrap();
    let leg = |n: &str| common::leg_file(dir.path(), n, 8 << 20).1;
    let (a, b) = (leg("a.img"), leg("b.img"));
    let (s, addr) = Serving::with_metrics(
        dir.path(),
        "r",
        &[
            "--raid1",
            &format!("{a},{b}"),
            "--raid1-create",
            "--export",
            "mirror",
        ],
        |l| l,
    );
    let ep = Endpoint::Unix(s.sock.clone());
    let opts = ClientOptions {
        export: "mirror".into(),
        ..ClientOptions::default()
    };
    let mut cl = Client::connect(&ep, &opts).unwrap();
    let size = cl.size();
    let before = scrape(&addr);
    cl.write(0, &[7u8; 16384], CmdFlags::empty()).unwrap();
    for i in 0..4u64 {
        cl.read(i * 4096, 4096).unwrap();
    }
    cl.flush().unwrap();
    let after = scrape(&addr);
    let dev = |name: &str, state: Option<&str>| match state {
        Some(st) => format!("{name}{{device=\"mirror\",state=\"{st}\"}}"),
        None => format!("{name}{{device=\"mirror\"}}"),
    };
    assert_eq!(value(&after, &dev("node_md_disks", Some("active"))), 2.0);
    assert_eq!(value(&after, &dev("node_md_disks", Some("failed"))), 0.0);
    assert_eq!(value(&after, &dev("node_md_disks_required", None)), 2.0);
    let blocks = value(&after, &dev("node_md_blocks", None));
    assert_eq!(blocks, (size / 1024) as f64);
    let states = ["active", "inactive", "recovering", "resync", "check"];
    let on: f64 = states
        .iter()
        .map(|st| value(&after, &dev("node_md_state", Some(st))))
        .sum();
    assert_eq!(on, 1.0, "exactly one state is 1");
    // Per leg: a round trip once it has served I/O, nothing behind, no re-add.
    let leg = |name: &str, slot: u32| format!("{name}{{device=\"mirror\",slot=\"{slot}\"}}");
    for slot in 0..2 {
        assert!(value(&after, &leg("blkq_raid1_leg_rtt_seconds", slot)) > 0.0);
        assert_eq!(
            value(&after, &leg("blkq_raid1_leg_write_behind", slot)),
            0.0
        );
        assert_eq!(
            value(&after, &leg("blkq_raid1_leg_readds_total", slot)),
            0.0
        );
    }
    // The mirror keeps no disk counters of its own: the server counts its requests.
    assert_disk_moved(
        &before,
        &after,
        "mirror",
        &[
            ("reads_completed_total", 4.0),
            ("read_bytes_total", 16384.0),
            ("writes_completed_total", 1.0),
            ("written_bytes_total", 16384.0),
            ("flush_requests_total", 1.0),
        ],
    );
    cl.disconnect().unwrap();
}

/// A remote export (`--device nbd+unix://...`) reports its connections and reconnections:
/// one up, none re-established; its server restarted, one re-established and up again.
#[test]
fn a_remote_export_reports_its_connection() {
    let dir = tempfile::tempdir().unwrap();
    let back_dir = dir.path().join("back");
    std::fs::create_dir_all(&back_dir).unwrap();
    let back = Serving::start(&back_dir, "back", &["--device", "mem:16M"]);
    let spec = format!(
        "nbd+unix:///?socket={},timeout=10,reconnect_deadline=30",
        back.sock.display()
    );
    let (_front, addr) = Serving::with_metrics(dir.path(), "front", &["--device", &spec], |l| l);
    let up = "blkq_remote_connections_up{export=\"\"}";
    let n = "blkq_remote_connections{export=\"\"}";
    let re = "blkq_remote_reconnects_total{export=\"\"}";
    let m = scrape(&addr);
    assert_eq!(
        (value(&m, n), value(&m, up), value(&m, re)),
        (1.0, 1.0, 0.0)
    );
    drop(back);
    let back = Serving::start(&back_dir, "back", &["--device", "mem:16M"]);
    scrape_until(&addr, "the remote export never reconnected", |m| {
        value(m, re) == 1.0 && value(m, up) == 1.0
    });
    drop(back);
}

/// `blkq_dirty_bitmap_bytes{export,bitmap}` is each bitmap's dirty bytes (whole granules), for
/// every export, and follows writes, `rotate` and `remove`.
#[test]
fn dirty_bitmap_bytes_per_export_and_bitmap() {
    let dir = tempfile::tempdir().unwrap();
    let ctl = dir.path().join("ctl.sock");
    let (s, addr) = Serving::with_metrics(
        dir.path(),
        "cbt",
        &["--device", "mem:16M", "--control", ctl.to_str().unwrap()],
        |l| l.ready_when_exists(&ctl),
    );
    let c = ctl.to_str().unwrap();
    common::ok(&["bitmap", "add", "a", "--control", c]);
    common::ok(&["bitmap", "add", "b", "--granularity", "1M", "--control", c]);
    let mut cl = s.client();
    cl.write(65536, &[1u8; 4096], CmdFlags::empty()).unwrap();
    let key = |b: &str| format!("blkq_dirty_bitmap_bytes{{export=\"\",bitmap=\"{b}\"}}");
    let m = scrape(&addr);
    assert_eq!(value(&m, &key("a")), 65536.0);
    assert_eq!(value(&m, &key("b")), (1 << 20) as f64);
    common::ok(&["bitmap", "rotate", "a", "a2", "--control", c]);
    common::ok(&["bitmap", "remove", "b", "--control", c]);
    cl.write(0, &[1u8; 512], CmdFlags::empty()).unwrap();
    let m = scrape(&addr);
    assert_eq!(value(&m, &key("a")), 65536.0);
    assert_eq!(value(&m, &key("a2")), 65536.0);
    assert!(!m.contains_key(&key("b")), "removed");
}
