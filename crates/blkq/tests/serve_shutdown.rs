//! `blkq serve` shutdown always ends: SIGTERM stops it even when its socket path was removed
//! (the acceptors are not woken by connecting to it), the devices are flushed and the exit is
//! 0; a request stuck in a hung device does not hold the shutdown past `--shutdown-timeout`
//! (the stuck export is named, the exit is non-zero); a second signal exits at once. The built
//! binary, `nbd::client`; bounded waits only, no timing assertions.

mod common;

use std::time::{Duration, Instant};

use common::Serving;
use nbd::client::{Client, ClientOptions, Endpoint};
use nbd::codec::proto::{CmdFlags, Command};
use nbd::codec::transmission::Request;

/// How long a test waits for an exit before failing (far above any deadline used here).
const EXIT_LIMIT: Duration = Duration::from_secs(120);

#[test]
fn sigterm_after_the_socket_is_removed_exits_0_with_the_data_flushed() {
    let dir = tempfile::tempdir().unwrap();
    let (path, spec) = common::leg_file(dir.path(), "disk.img", 4 << 20);
    let mut s = Serving::start(
        dir.path(),
        "rm",
        &["--device", &spec, "--shutdown-timeout", "30"],
    );
    let mut cl = s.client();
    let data: Vec<u8> = (0..65536u32).map(|i| (i % 251) as u8).collect();
    cl.write(8192, &data, CmdFlags::empty()).unwrap();
    cl.flush().unwrap();
    // The client stays connected and idle: the drain must end it.
    std::fs::remove_file(&s.sock).unwrap();
    s.signal(libc::SIGTERM);
    let st = s.wait_exit(EXIT_LIMIT);
    assert!(st.success(), "exit status {st}: {}", s.stderr_text());
    let on_disk = std::fs::read(&path).unwrap();
    assert_eq!(&on_disk[8192..8192 + data.len()], &data[..]);
    drop(cl);
}

/// Starts a server whose export "hung" stalls every write, and leaves one write in flight.
fn hung_server(dir: &std::path::Path, name: &str, timeout: &str) -> (Serving, Client) {
    let s = Serving::start(
        dir,
        name,
        &[
            "--device",
            "mem:4M,fault.stall_write=all",
            "--export",
            "hung",
            "--shutdown-timeout",
            timeout,
        ],
    );
    let ep = Endpoint::Unix(s.sock.clone());
    let opts = ClientOptions {
        export: "hung".into(),
        ..ClientOptions::default()
    };
    let mut cl = Client::connect(&ep, &opts).unwrap();
    // A read works; then a write that the device stalls.
    cl.read(0, 4096).unwrap();
    let payload = vec![9u8; 4096];
    cl.send(Request::new(Command::Write, 0, 0, 4096), &payload)
        .unwrap();
    // Wait (bounded) until the server has taken it: a flush queued behind it is not answered
    // either, but reads are; a round trip of a read shows the write was decoded before it.
    cl.read(4096, 4096).unwrap();
    (s, cl)
}

#[test]
fn a_request_stuck_in_a_hung_device_does_not_hang_shutdown() {
    let dir = tempfile::tempdir().unwrap();
    let (mut s, cl) = hung_server(dir.path(), "hung", "1");
    s.signal(libc::SIGTERM);
    let st = s.wait_exit(EXIT_LIMIT);
    let err = s.stderr_text();
    assert!(!st.success(), "a stuck export must fail the exit: {err}");
    assert!(
        err.contains("\"hung\"") && err.contains("stuck"),
        "stderr must name the stuck export: {err}"
    );
    drop(cl);
}

#[test]
fn a_second_signal_forces_the_exit() {
    let dir = tempfile::tempdir().unwrap();
    // A long timeout: only the second signal can end this shutdown soon.
    let (mut s, cl) = hung_server(dir.path(), "twice", "3600");
    s.signal(libc::SIGTERM);
    let t0 = Instant::now();
    while !s.stderr_text().contains("shutting down") {
        assert!(
            t0.elapsed() < EXIT_LIMIT,
            "no shutdown: {}",
            s.stderr_text()
        );
        assert!(s.try_wait().is_none(), "exited too soon");
        std::thread::sleep(Duration::from_millis(20));
    }
    s.signal(libc::SIGTERM);
    let st = s.wait_exit(EXIT_LIMIT);
    assert!(!st.success(), "forced exit must be non-zero: {st}");
    assert_eq!(st.code(), Some(130), "{}", s.stderr_text());
    drop(cl);
}
