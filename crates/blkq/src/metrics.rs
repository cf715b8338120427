//! `blkq serve --metrics ADDR:PORT`: `GET /metrics` in the OpenMetrics text format (which
//! Prometheus scrapes natively; encoded by the `prometheus-client` crate), every counter read
//! on demand from where it already lives, so a scrape adds nothing to the I/O path. The names
//! and units are listed in docs/design.md, "Metrics and logs".
//!
//! Disk counters mirror node_exporter's `node_disk_*` suffixes exactly, with the prefix
//! `blkq_disk_` and an `export` label; RAID1 arrays are described in node_exporter's
//! `node_md_*` shape (those names unprefixed, `device` = the export name), so dashboards made
//! for node_exporter work with a relabel of the prefix. This file holds the endpoint and the
//! families of exports, the NBD server and the process; `metrics/md.rs` the arrays' and
//! `metrics/family.rs` how any family is written.
//!
//! The HTTP side is a minimal GET handler: up to [`SLOTS`] connections at once, a thread
//! each; a request of at most [`MAX_REQUEST`] bytes, which must arrive whole within
//! [`IO_TIMEOUT`] of connecting (408 otherwise) and its reply be taken by then; `Connection:
//! close` after every reply. When every slot is taken, a new connection evicts the oldest one
//! still waiting on its client, so idle or trickling connections cannot keep a scrape out
//! ([`crate::listen`] has the bounds and why evict rather than refuse), and nothing a client
//! sends makes anything grow. 404 for any other path, 405 for any other method.

use std::fmt::Write as _;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::Duration;

use anyhow::{Context, Result};
use blk::stats::DiskStats;
use blkq_sync::atomic::AtomicBool;
use blkq_sync::{thread, Arc};

use nbd::server::{ExportMetrics, HandshakeFailure, Metrics as NbdMetrics, ServerSnapshot};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use prometheus_client::registry::{Registry, Unit};

use crate::control::server::Control;
use crate::listen::{self, Limits, Session};
use crate::serve::devices::Devices;
use family::{counter, family, gauge, seconds, Log2Histogram};
use md::md_families;

mod family;
mod md;

/// Longest request accepted (request line and headers), bytes.
pub const MAX_REQUEST: usize = 8 << 10;
/// The deadline of a scrape's whole request (and its reply, see [`crate::listen`]), from accept.
pub const IO_TIMEOUT: Duration = Duration::from_secs(5);
/// Connections served at once (a thread each).
pub const SLOTS: usize = 8;
/// The content type of the reply.
const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// What the endpoint reports.
#[derive(Clone)]
pub struct Sources {
    /// The NBD server's counters (and its exports' devices).
    pub nbd: NbdMetrics,
    /// A RAID1 array: its export name and its control (reports its state).
    pub raid1: Vec<(String, Arc<Control>)>,
    /// The exports' devices beside the server, as served now (exports added and removed
    /// while serving included): the remote ones (their connections' state) and those with
    /// dirty bitmaps (the bitmaps' dirty bytes).
    pub devices: Arc<Devices>,
}

impl std::fmt::Debug for Sources {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sources")
            .field(
                "raid1",
                &self.raid1.iter().map(|(n, _)| n).collect::<Vec<_>>(),
            )
            .finish_non_exhaustive()
    }
}

/// The running endpoint (its thread lives as long as the process).
pub struct MetricsServer {
    addr: SocketAddr,
}

impl MetricsServer {
    /// Binds `addr` (port 0: any free port) and serves on a thread of its own.
    pub fn start(addr: SocketAddr, sources: Sources) -> Result<Self> {
        let l = TcpListener::bind(addr).with_context(|| format!("--metrics: binding {addr}"))?;
        let addr = l.local_addr()?;
        let registry = registry(sources);
        let handler = Arc::new(move |s: &mut Session<TcpStream>| {
            if let Err(e) = answer(s, &registry) {
                tracing::debug!("metrics: a scrape failed: {e}");
            }
            s.finish();
        });
        let limits = Limits {
            slots: SLOTS,
            deadline: IO_TIMEOUT,
        };
        // The threads live as long as the process (they only read counters).
        thread::spawn(move || {
            let never = AtomicBool::new(false);
            listen::serve(
                "metrics",
                limits,
                || l.accept().map(|(s, _)| s),
                &never,
                handler,
            );
        });
        Ok(Self { addr })
    }

    /// The bound address (with the real port when port 0 was asked for).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

/// `blkq serve --metrics`: starts the endpoint, says where it is (stdout, the log, and
/// `addr_file` if given: see [`write_replacing`]).
pub fn start_for_serve(
    addr: SocketAddr,
    addr_file: Option<&std::path::Path>,
    nbd: NbdMetrics,
    raid1: Vec<(String, Arc<Control>)>,
    devices: Arc<Devices>,
) -> Result<MetricsServer> {
    let m = MetricsServer::start(
        addr,
        Sources {
            nbd,
            raid1,
            devices,
        },
    )?;
    let bound = m.addr();
    if !bound.ip().is_loopback() {
        tracing::warn!(
            addr = %bound,
            "--metrics listens on a non-loopback address: anyone who can reach it reads the \
             export names and traffic counters (there is no authentication)"
        );
    }
    println!("metrics: http://{bound}/metrics");
    tracing::info!(addr = %bound, "metrics endpoint up: http://{bound}/metrics");
    if let Some(p) = addr_file {
        write_replacing(p, &format!("{bound}\n"))
            .with_context(|| format!("--metrics-addr-file {}", p.display()))?;
    }
    Ok(m)
}

/// Writes `text` to `path` so that a reader never sees it half-written and nothing planted
/// beside it is written through ([`blk::files::replace`]: a new file of an unpredictable name
/// created `O_CREAT|O_EXCL|O_NOFOLLOW`, renamed onto `path`, which replaces a link at `path`
/// itself, never its target).
fn write_replacing(path: &std::path::Path, text: &str) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    blk::files::replace(path, 0o666, |f| f.write_all_at(text.as_bytes(), 0)).map(drop)
}

/// The registry: one collector that reads everything at scrape time.
fn registry(sources: Sources) -> Registry {
    let mut r = Registry::default();
    r.register_collector(Box::new(BlkqCollector(sources)));
    r
}

fn encode(r: &Registry) -> Result<String> {
    let mut out = String::with_capacity(16 << 10);
    prometheus_client::encoding::text::encode(&mut out, r).context("encoding metrics")?;
    Ok(out)
}

/// Reads one request (within the session's deadline) and writes its reply.
fn answer(s: &mut Session<TcpStream>, registry: &Registry) -> std::io::Result<()> {
    let mut buf = [0u8; MAX_REQUEST];
    let mut len = 0;
    let head_end = loop {
        if let Some(i) = find(&buf[..len], b"\r\n\r\n").or_else(|| find(&buf[..len], b"\n\n")) {
            break i;
        }
        if len == buf.len() {
            return reply(s, "431 Request Header Fields Too Large", "text/plain", "");
        }
        match s.read(&mut buf[len..]) {
            Ok(0) => return Ok(()),
            Ok(n) => len += n,
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {
                return reply(s, "408 Request Timeout", "text/plain", &format!("{e}\n"));
            }
            Err(e) => return Err(e),
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]);
    let mut words = head.lines().next().unwrap_or("").split_whitespace();
    let (method, target) = (words.next().unwrap_or(""), words.next().unwrap_or(""));
    let path = target.split('?').next().unwrap_or("");
    match (method, path) {
        ("GET" | "HEAD", "/metrics") => match s.work(|| encode(registry))? {
            Ok(body) => reply(
                s,
                "200 OK",
                CONTENT_TYPE,
                if method == "HEAD" { "" } else { &body },
            ),
            Err(e) => reply(
                s,
                "500 Internal Server Error",
                "text/plain",
                &format!("{e:#}\n"),
            ),
        },
        ("GET" | "HEAD", _) => reply(s, "404 Not Found", "text/plain", "try /metrics\n"),
        _ => reply(s, "405 Method Not Allowed", "text/plain", ""),
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

fn reply(s: &mut impl Write, status: &str, ctype: &str, body: &str) -> std::io::Result<()> {
    let mut head = String::with_capacity(128);
    let _ = write!(
        head,
        "HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes())?;
    s.write_all(body.as_bytes())?;
    s.flush()
}

/// Reads every counter at scrape time.
#[derive(Debug)]
struct BlkqCollector(Sources);

/// One `blkq_disk_*` counter family: name, help, unit, its value in a [`DiskStats`], and
/// whether that value is a time in nanoseconds (exposed in seconds).
type DiskCounter = (
    &'static str,
    &'static str,
    Option<Unit>,
    fn(&DiskStats) -> u64,
    bool,
);

/// The counter families of [`disk_families`]: node_exporter's `node_disk_*` ones and
/// blkq's errors.
const DISK_COUNTERS: [DiskCounter; 13] = [
    (
        "blkq_disk_reads_completed",
        "Reads completed successfully or not.",
        None,
        |d| d.ios[0],
        false,
    ),
    (
        "blkq_disk_read",
        "Bytes read.",
        Some(Unit::Bytes),
        |d| d.sectors[0] * 512,
        false,
    ),
    (
        "blkq_disk_read_time",
        "Time spent by reads, from allocation to completion (coarse clock).",
        Some(Unit::Seconds),
        |d| d.ticks_ns[0],
        true,
    ),
    (
        "blkq_disk_writes_completed",
        "Writes completed (write-zeroes included; discards and flushes not).",
        None,
        DiskStats::writes_completed,
        false,
    ),
    (
        "blkq_disk_written",
        "Bytes written (data writes).",
        Some(Unit::Bytes),
        |d| d.sectors[1] * 512,
        false,
    ),
    (
        "blkq_disk_write_time",
        "Time spent by writes (coarse clock).",
        Some(Unit::Seconds),
        DiskStats::write_ticks_ns,
        true,
    ),
    (
        "blkq_disk_discards_completed",
        "Discards completed.",
        None,
        |d| d.discard_ios,
        false,
    ),
    (
        "blkq_disk_discarded_sectors",
        "Sectors (512 bytes) discarded.",
        None,
        |d| d.discard_sectors,
        false,
    ),
    (
        "blkq_disk_discard_time",
        "Time spent by discards (coarse clock).",
        Some(Unit::Seconds),
        |d| d.discard_ticks_ns,
        true,
    ),
    (
        "blkq_disk_flush_requests",
        "Flushes completed.",
        None,
        |d| d.flush_ios,
        false,
    ),
    (
        "blkq_disk_flush_requests_time",
        "Time spent by flushes (coarse clock).",
        Some(Unit::Seconds),
        |d| d.flush_ticks_ns,
        true,
    ),
    (
        "blkq_disk_io_time",
        "Time with at least one I/O in flight (coarse clock ticks).",
        Some(Unit::Seconds),
        |d| d.io_ticks_ns,
        true,
    ),
    (
        "blkq_disk_errors",
        "I/Os completed with an error (blkq's; no node_exporter twin).",
        None,
        |d| d.errors,
        false,
    ),
];

/// node_exporter's `node_disk_*` families (with the `blkq_disk_` prefix), one sample per
/// export.
fn disk_families(
    enc: &mut DescriptorEncoder,
    disks: &[(String, DiskStats)],
) -> Result<(), std::fmt::Error> {
    let ex = |name: &str| vec![("export", name.to_string())];
    for (name, help, unit, pick, is_time) in &DISK_COUNTERS {
        if *is_time {
            family(
                enc,
                name,
                help,
                unit.as_ref(),
                disks.iter().map(|(n, d)| (ex(n), seconds(pick(d)))),
            )?;
        } else {
            family(
                enc,
                name,
                help,
                unit.as_ref(),
                disks.iter().map(|(n, d)| (ex(n), counter(pick(d)))),
            )?;
        }
    }
    family(
        enc,
        "blkq_disk_io_now",
        "I/Os in flight now.",
        None,
        disks.iter().map(|(n, d)| (ex(n), gauge(d.io_now()))),
    )?;
    Ok(())
}

/// The process's context switches (getrusage).
fn context_switches() -> (u64, u64) {
    // SAFETY: an all-zero `rusage` is a valid value (plain integers and timevals).
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `ru` is a valid, writable rusage for the call; RUSAGE_SELF is a valid target.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) } != 0 {
        return (0, 0);
    }
    (ru.ru_nvcsw.max(0) as u64, ru.ru_nivcsw.max(0) as u64)
}

impl Collector for BlkqCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let exports = self.0.nbd.exports();
        let disks: Vec<(String, DiskStats)> = exports
            .iter()
            .map(|e| (e.name.clone(), e.stats.clone()))
            .collect();
        disk_families(&mut enc, &disks)?;
        queue_families(&mut enc, &exports)?;
        remote_families(&mut enc, &self.0.devices)?;
        dirty_bitmap_families(&mut enc, &self.0.devices)?;
        process_families(&mut enc)?;
        nbd_server_families(&mut enc, &self.0.nbd.server())?;
        for (name, ctl) in &self.0.raid1 {
            md_families(&mut enc, name, ctl)?;
        }
        Ok(())
    }
}

/// What only blkq knows of an export's queue: tag waits per hardware context, scheduler lock
/// contention.
fn queue_families(
    enc: &mut DescriptorEncoder,
    exports: &[ExportMetrics],
) -> Result<(), std::fmt::Error> {
    let mut waits = Vec::new();
    let mut locks = Vec::new();
    for e in exports {
        let Some(q) = e.device.queue_stats() else {
            continue;
        };
        for (h, w) in q.tag_waits.into_iter().enumerate() {
            let l = vec![("export", e.name.clone()), ("hctx", h.to_string())];
            waits.push((l, w));
        }
        if let Some(s) = q.sched {
            locks.push((e.name.clone(), s.name, s.lock));
        }
    }
    family(
        enc,
        "blkq_tag_waits",
        "Submitters that slept for a free tag.",
        None,
        waits.iter().map(|(l, w)| (l.clone(), counter(w.count))),
    )?;
    family(
        enc,
        "blkq_tag_wait",
        "How long submitters slept for a tag (log2 buckets).",
        Some(&Unit::Seconds),
        waits.into_iter().map(|(l, w)| (l, Log2Histogram(w.hist))),
    )?;
    let sched = |e: &String, n: &str| vec![("export", e.clone()), ("scheduler", n.to_string())];
    family(
        enc,
        "blkq_sched_lock_attempts",
        "Inserts and dispatches that wanted the scheduler's state.",
        None,
        locks
            .iter()
            .map(|(e, n, s)| (sched(e, n), counter(s.attempts))),
    )?;
    family(
        enc,
        "blkq_sched_lock_contended",
        "Attempts that found the scheduler's state taken.",
        None,
        locks
            .iter()
            .map(|(e, n, s)| (sched(e, n), counter(s.contended))),
    )?;
    Ok(())
}

/// Remote exports (`nbd://` devices): their connections now, and how often they were
/// re-established.
fn remote_families(enc: &mut DescriptorEncoder, devices: &Devices) -> Result<(), std::fmt::Error> {
    let remotes = devices.remotes();
    let remote = |name: &String| vec![("export", name.clone())];
    family(
        enc,
        "blkq_remote_connections",
        "Connections a remote export (nbd:// device) keeps to its server.",
        None,
        remotes
            .iter()
            .map(|(n, d)| (remote(n), gauge(d.connections() as u64))),
    )?;
    family(
        enc,
        "blkq_remote_connections_up",
        "Of those, the ones established now (the others are reconnecting).",
        None,
        remotes
            .iter()
            .map(|(n, d)| (remote(n), gauge(d.connections_up() as u64))),
    )?;
    family(
        enc,
        "blkq_remote_reconnects",
        "Connections of a remote export re-established after they broke.",
        None,
        remotes
            .iter()
            .map(|(n, d)| (remote(n), counter(d.reconnects()))),
    )?;
    Ok(())
}

/// Dirty bitmaps (changed-block tracking): what a backup from each would copy now.
fn dirty_bitmap_families(
    enc: &mut DescriptorEncoder,
    devices: &Devices,
) -> Result<(), std::fmt::Error> {
    let bitmaps: Vec<(String, cbt::Info)> = devices
        .tracked()
        .iter()
        .flat_map(|(n, t)| t.bitmaps().list().into_iter().map(|i| (n.clone(), i)))
        .collect();
    family(
        enc,
        "blkq_dirty_bitmap_bytes",
        "Bytes a dirty bitmap marks changed (whole granules) since it was created or cleared.",
        None,
        bitmaps.iter().map(|(e, i)| {
            (
                vec![("export", e.clone()), ("bitmap", i.name.clone())],
                gauge(i.dirty_bytes),
            )
        }),
    )?;
    Ok(())
}

/// The process's wake-ups: wait queue wakeups and context switches.
fn process_families(enc: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
    family(
        enc,
        "blkq_waitq_wakeups",
        "Waiters woken by the process's wait queues (tag waits, completions, the NBD \
         reader and flusher): each is a thread unparked or a task woken.",
        None,
        [(vec![], counter(waitq::wakeups()))],
    )?;

    let (vol, invol) = context_switches();
    family(
        enc,
        "blkq_process_context_switches",
        "Context switches of the process (getrusage): voluntary ones are mostly wake-ups \
         after a sleep.",
        None,
        [
            (vec![("type", "voluntary".to_string())], counter(vol)),
            (vec![("type", "involuntary".to_string())], counter(invol)),
        ],
    )?;
    Ok(())
}

/// The NBD server's own counters: connections, handshakes, requests, memory budget.
fn nbd_server_families(
    enc: &mut DescriptorEncoder,
    s: &ServerSnapshot,
) -> Result<(), std::fmt::Error> {
    family(
        enc,
        "blkq_nbd_connections_open",
        "NBD connections open now (handshake or transmission).",
        None,
        [(vec![], gauge(s.open))],
    )?;
    family(
        enc,
        "blkq_nbd_connections_accepted",
        "NBD connections accepted.",
        None,
        [(vec![], counter(s.accepted))],
    )?;
    family(
        enc,
        "blkq_nbd_connections_refused",
        "NBD connections closed at once by the server, by reason.",
        None,
        [(
            vec![("reason", "limit".to_string())],
            counter(s.refused_limit),
        )],
    )?;
    family(
        enc,
        "blkq_nbd_transmissions",
        "NBD connections that finished the handshake.",
        None,
        [(vec![], counter(s.transmissions))],
    )?;
    family(
        enc,
        "blkq_nbd_handshake_failures",
        "NBD handshakes that ended without a transmission phase, by reason.",
        None,
        HandshakeFailure::ALL.iter().enumerate().map(|(i, r)| {
            (
                vec![("reason", r.as_str().to_string())],
                counter(s.handshake_failures[i]),
            )
        }),
    )?;
    family(
        enc,
        "blkq_nbd_requests",
        "NBD requests served by connections that have closed.",
        None,
        [(vec![], counter(s.requests))],
    )?;
    family(
        enc,
        "blkq_nbd_requests_refused",
        "NBD requests answered with an error before reaching a device, by closed connections.",
        None,
        [(vec![], counter(s.requests_refused))],
    )?;
    family(
        enc,
        "blkq_nbd_memory_budget_used",
        "Payload bytes of reads and writes in flight, across connections.",
        Some(&Unit::Bytes),
        [(vec![], gauge(s.memory_used))],
    )?;
    family(
        enc,
        "blkq_nbd_memory_budget",
        "The memory budget (--memory-budget).",
        Some(&Unit::Bytes),
        [(vec![], gauge(s.memory_budget))],
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use nbd::server::{Export, Server, ServerConfig};

    fn serving() -> (Server, MetricsServer, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        let spec: blk_drivers::spec::DeviceSpec = "mem:1M".parse().unwrap();
        let q = spec
            .build(&blk_drivers::spec::QueueOverrides::default())
            .unwrap();
        let dev: blkq_sync::DynArc<dyn blk::Device> = blkq_sync::DynArc::new(q);
        let mut cfg = ServerConfig::new(vec![Export::new("e", dev)]);
        cfg.unix = Some(dir.path().join("s.sock"));
        let server = Server::start(cfg).unwrap();
        let m = MetricsServer::start(
            "127.0.0.1:0".parse().unwrap(),
            Sources {
                nbd: server.metrics(),
                raid1: Vec::new(),
                devices: Arc::default(),
            },
        )
        .unwrap();
        (server, m, dir)
    }

    /// Sends `req`, returns the whole reply.
    fn exchange(addr: SocketAddr, req: &[u8]) -> String {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        // The server may answer (and close) before it has read everything sent.
        let _ = s.write_all(req);
        let mut out = Vec::new();
        let _ = s.read_to_end(&mut out);
        String::from_utf8_lossy(&out).into_owned()
    }

    #[test]
    fn http_answers_and_bounds() {
        let (server, m, _dir) = serving();
        let a = m.addr();
        let ok = exchange(a, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
        assert!(ok.starts_with("HTTP/1.1 200 OK\r\n"), "{ok}");
        assert!(
            ok.contains("blkq_disk_reads_completed_total{export=\"e\"} 0"),
            "{ok}"
        );
        assert!(ok.contains("\nblkq_nbd_connections_open 0\n"), "{ok}");
        assert!(ok.ends_with("# EOF\n"), "{ok}");
        let head = exchange(a, b"HEAD /metrics HTTP/1.1\r\n\r\n");
        assert!(head.starts_with("HTTP/1.1 200 OK\r\n"), "{head}");
        assert!(head.ends_with("\r\n\r\n"), "no body for HEAD: {head}");
        let q = exchange(a, b"GET /metrics?x=1 HTTP/1.0\n\n");
        assert!(q.starts_with("HTTP/1.1 200 OK\r\n"), "{q}");
        let nf = exchange(a, b"GET / HTTP/1.1\r\n\r\n");
        assert!(nf.starts_with("HTTP/1.1 404 "), "{nf}");
        let post = exchange(a, b"POST /metrics HTTP/1.1\r\n\r\n");
        assert!(post.starts_with("HTTP/1.1 405 "), "{post}");
        let mut huge = b"GET /metrics HTTP/1.1\r\n".to_vec();
        huge.resize(MAX_REQUEST + 100, b'a');
        let big = exchange(a, &huge);
        assert!(big.starts_with("HTTP/1.1 431 "), "{big}");
        // Still serving after all that.
        let again = exchange(a, b"GET /metrics HTTP/1.1\r\n\r\n");
        assert!(again.starts_with("HTTP/1.1 200 OK\r\n"), "{again}");
        server.shutdown();
    }

    /// Label values come from names users give (exports, bitmaps): escaped as the text
    /// format says, so that no name can end its label and inject a sample.
    #[test]
    fn label_values_are_escaped() {
        #[derive(Debug)]
        struct Hostile;
        impl Collector for Hostile {
            fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
                family(
                    &mut enc,
                    "blkq_dirty_bitmap_bytes",
                    "test",
                    None,
                    [(
                        vec![
                            ("export", "e\\x".to_string()),
                            ("bitmap", "a\"},injected_metric{x=\"1\nz".to_string()),
                        ],
                        gauge(7),
                    )],
                )
            }
        }
        let mut r = Registry::default();
        r.register_collector(Box::new(Hostile));
        let text = encode(&r).unwrap();
        let samples: Vec<&str> = text.lines().filter(|l| !l.starts_with('#')).collect();
        assert_eq!(
            samples,
            [r#"blkq_dirty_bitmap_bytes{export="e\\x",bitmap="a\"},injected_metric{x=\"1\nz"} 7"#],
            "{text}"
        );
    }
}
