//! Hostile clients of the metrics endpoint (`blkq serve --metrics ADDR:PORT`):
//! idle and trickling connections, floods, oversized and malformed requests, and
//! a symlink planted where `--metrics-addr-file` writes. The built binary.
//!
//! The bounds (`crates/blkq/src/metrics.rs`, `listen.rs`): [`SLOTS`] connections are served
//! at once, a thread each; a connection has [`DEADLINE`] in all to send its request and read
//! its reply; when every slot is taken, a new connection evicts the oldest one still waiting on
//! its client, so a scrape always gets through.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::time::{Duration, Instant};

use common::Serving;

/// Connections served at once (`metrics::SLOTS`).
const SLOTS: usize = 8;
/// The whole-request deadline (`metrics::IO_TIMEOUT`).
const DEADLINE: Duration = Duration::from_secs(5);

/// `blkq serve --metrics 127.0.0.1:0`: the server and the endpoint's address.
fn serve(dir: &Path) -> (Serving, String) {
    Serving::with_metrics(dir, "m", &["--device", "mem:1M"], |l| l)
}

/// Sends `req`, returns the reply (everything until the server closes), failing the test if
/// it takes longer than `limit`.
fn exchange_within(addr: &str, req: &[u8], limit: Duration) -> String {
    let t0 = Instant::now();
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(limit)).unwrap();
    // The server may answer (and close) before it has read everything sent.
    let _ = s.write_all(req);
    let mut out = Vec::new();
    let r = s.read_to_end(&mut out);
    assert!(
        r.is_ok() && t0.elapsed() < limit,
        "no whole reply within {limit:?} ({r:?}): {}",
        String::from_utf8_lossy(&out)
    );
    String::from_utf8_lossy(&out).into_owned()
}

fn scrape_within(addr: &str, limit: Duration) {
    let r = exchange_within(addr, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n", limit);
    assert!(r.starts_with("HTTP/1.1 200 OK\r\n"), "{r}");
    assert!(r.ends_with("# EOF\n"), "{r}");
}

/// Bound: slots. With more idle connections than [`SLOTS`] open (they send nothing), a scrape
/// is answered within 2 s (served one at a time, 5 s each, five of them delayed it 25 s).
#[test]
fn a_scrape_answers_while_idle_connections_hold_every_slot() {
    let d = tempfile::tempdir().unwrap();
    let (_s, addr) = serve(d.path());
    let idle: Vec<TcpStream> = (0..2 * SLOTS)
        .map(|_| TcpStream::connect(&addr).unwrap())
        .collect();
    std::thread::sleep(Duration::from_millis(200));
    for _ in 0..3 {
        scrape_within(&addr, Duration::from_secs(2));
    }
    drop(idle);
}

/// Bound: slots. With twice [`SLOTS`] clients trickling a request head a byte every 500 ms
/// (each reconnecting when cut), a scrape is answered within 2 s.
#[test]
fn a_scrape_answers_while_tricklers_hold_every_slot() {
    let d = tempfile::tempdir().unwrap();
    let (_s, addr) = serve(d.path());
    let to = addr.clone();
    let _t = common::Tricklers::start(
        move || TcpStream::connect(&to),
        2 * SLOTS,
        Duration::from_millis(500),
        b'G',
    );
    std::thread::sleep(Duration::from_millis(300));
    for _ in 0..3 {
        scrape_within(&addr, Duration::from_secs(2));
        std::thread::sleep(Duration::from_millis(300));
    }
}

/// Bound: deadline. A client trickling a request head a byte every 500 ms is cut
/// [`DEADLINE`] after it connected, not later.
#[test]
fn a_trickler_is_cut_at_the_deadline() {
    let d = tempfile::tempdir().unwrap();
    let (_s, addr) = serve(d.path());
    let mut c = TcpStream::connect(&addr).unwrap();
    c.set_read_timeout(Some(Duration::from_millis(100)))
        .unwrap();
    common::trickle_until_cut(&mut c, b'G', Duration::from_millis(500), DEADLINE);
}

/// Bounds: slots and memory (threads). Sixty-four connections that send nothing take at most
/// [`SLOTS`] threads of the server, and a scrape answers within 2 s while they are open.
#[test]
fn a_flood_of_idle_connections_takes_slots_not_threads() {
    let d = tempfile::tempdir().unwrap();
    let (s, addr) = serve(d.path());
    let pid = s.id();
    std::thread::sleep(Duration::from_millis(200));
    let before = common::threads_of(pid);
    let idle: Vec<TcpStream> = (0..64)
        .map(|_| TcpStream::connect(&addr).unwrap())
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    let during = common::threads_of(pid);
    assert!(
        during <= before + SLOTS + 1,
        "{} idle connections: {before} threads before, {during} during",
        idle.len()
    );
    scrape_within(&addr, Duration::from_secs(2));
    drop(idle);
}

/// Bound: memory. A request head over 8 KiB is refused (431), bytes that are not UTF-8 or
/// not HTTP get 404/405, and the endpoint keeps serving.
#[test]
fn bad_requests_are_refused() {
    let d = tempfile::tempdir().unwrap();
    let (_s, addr) = serve(d.path());
    let limit = Duration::from_secs(3);
    let mut huge = b"GET /metrics HTTP/1.1\r\nX: ".to_vec();
    huge.resize(64 << 10, b'a');
    let r = exchange_within(&addr, &huge, limit);
    assert!(r.starts_with("HTTP/1.1 431 "), "{r}");
    let r = exchange_within(&addr, b"\xff\xfe\x00 /metrics\r\n\r\n", limit);
    assert!(r.starts_with("HTTP/1.1 405 "), "{r}");
    let r = exchange_within(&addr, b"GET /\xff\xfe HTTP/1.1\r\n\r\n", limit);
    assert!(r.starts_with("HTTP/1.1 404 "), "{r}");
    let r = exchange_within(&addr, b"\r\n\r\n", limit);
    assert!(r.starts_with("HTTP/1.1 405 "), "{r}");
    for _ in 0..32 {
        drop(TcpStream::connect(&addr).unwrap());
    }
    scrape_within(&addr, limit);
}

/// `--metrics-addr-file FILE` with a symlink planted at `FILE.tmp` (the old temporary name):
/// the link's target is not written, and FILE gets the address.
#[test]
fn the_addr_file_is_not_written_through_a_planted_symlink() {
    let d = tempfile::tempdir().unwrap();
    let victim = d.path().join("victim");
    std::fs::write(&victim, "precious\n").unwrap();
    std::os::unix::fs::symlink(&victim, d.path().join("metrics.tmp")).unwrap();
    let (_s, addr) = serve(d.path());
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious\n");
    assert!(std::fs::symlink_metadata(d.path().join("metrics.tmp"))
        .unwrap()
        .file_type()
        .is_symlink());
    let written = std::fs::read_to_string(d.path().join("metrics.addr")).unwrap();
    assert_eq!(written.trim(), addr);
    // Nothing else left behind: the victim, the link, the address, and serve's own files.
    assert_eq!(
        common::names_in(d.path()),
        [
            "m.sock",
            "m.stderr",
            "metrics.addr",
            "metrics.tmp",
            "victim"
        ]
    );
}
