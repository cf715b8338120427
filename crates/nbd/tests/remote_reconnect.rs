//! `nbd::remote::RemoteDevice` across a lost server: a server killed or stopped and started
//! again on the same socket (the in-process blkq server, and nbdkit killed with SIGKILL), a
//! server gone past the reconnect deadline, and a server back with a different export size.
// A plain threaded test, never a loom model: its own harness (std locks and atomics) is not
// what a model must explore, so it may use std::sync.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]
#![cfg(not(blkq_loom))]

mod common;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use blk::{Bio, BioFlags, Buffer, Op, PendingBio, SECTOR_SHIFT};
use nbd::remote::RemoteDevice;
use nbd::server::Server;
use testkit::io::{flush, read_at, write_at};
use testkit::{pattern, wait_until, wait_until_within};

use common::nbdkit;
use common::served::{device, log, serve, unix_uri};

const MIB: u64 = 1 << 20;

const LEN: usize = 64 << 10;
/// Offsets each writer cycles over.
const PER: u64 = 32;
/// Writes each writer keeps in flight (fewer than `PER`: two writes in flight never overlap).
const WINDOW: usize = 8;
const WRITERS: u64 = 3;

fn seed(t: u64, k: u64) -> u64 {
    (t << 32) | k
}

fn offset(t: u64, k: u64) -> u64 {
    (t * PER + k % PER) * LEN as u64
}

/// Writers that keep `WINDOW` writes in flight each until `stop`; every write must succeed.
/// Returns, per writer, how many writes it made (the last write at each offset is known from
/// that count).
fn write_load(
    dev: &Arc<RemoteDevice>,
    done: &Arc<AtomicU64>,
    stop: &Arc<AtomicBool>,
) -> Vec<std::thread::JoinHandle<u64>> {
    (0..WRITERS)
        .map(|t| {
            let (dev, done, stop) = (dev.clone(), done.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut window = std::collections::VecDeque::new();
                let mut k = 0;
                while !stop.load(Ordering::SeqCst) {
                    if window.len() == WINDOW {
                        let p: PendingBio = window.pop_front().unwrap();
                        let (_, r) = p.wait();
                        r.expect("a write failed across the restart");
                        done.fetch_add(1, Ordering::SeqCst);
                    }
                    let mut b = Buffer::new(LEN);
                    b.as_mut_slice().copy_from_slice(&pattern(seed(t, k), LEN));
                    let mut bio = Bio::with_buf(Op::Write, offset(t, k) >> SECTOR_SHIFT, b);
                    if k % 5 == 0 {
                        bio.flags = BioFlags::FUA;
                    }
                    window.push_back(PendingBio::submit(&*dev, bio));
                    k += 1;
                }
                for p in window {
                    p.wait().1.expect("a write failed across the restart");
                }
                k
            })
        })
        .collect()
}

/// Runs the write load, calls `restart` once some writes are done, lets more writes
/// complete on the new connection, then stops, and checks that every offset reads back its
/// last write.
fn writes_survive(dev: RemoteDevice, restart: impl FnOnce()) {
    let dev = Arc::new(dev);
    let done = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let writers = write_load(&dev, &done, &stop);
    wait_until("writes before the restart", || {
        done.load(Ordering::SeqCst) > 100
    });
    restart();
    wait_until("reconnected", || {
        dev.reconnects() >= 1 && dev.is_connected()
    });
    let after = done.load(Ordering::SeqCst);
    wait_until("writes after the restart", || {
        done.load(Ordering::SeqCst) > after + 100
    });
    stop.store(true, Ordering::SeqCst);
    let counts: Vec<u64> = writers.into_iter().map(|w| w.join().unwrap()).collect();
    for (t, &n) in counts.iter().enumerate() {
        let t = t as u64;
        assert!(n > PER, "writer {t} made {n} writes");
        for k in n - PER..n {
            let got = read_at(&*dev, offset(t, k), LEN).unwrap();
            assert!(
                got == pattern(seed(t, k), LEN),
                "writer {t}: offset {} does not hold write {k}",
                offset(t, k)
            );
        }
    }
    assert_eq!(dev.in_flight(), 0);
}

/// The blkq server stopped and started again on the same socket within the deadline, under a
/// write load with FUA writes mixed in: every write succeeds and reads back.
#[test]
fn a_restarted_blkq_server_loses_no_write() {
    log();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("nbd.sock");
    let disk = device("mem:64M");
    let server = serve(&path, &disk);
    let dev = RemoteDevice::open(&unix_uri(
        &path,
        ",timeout=5,depth=16,reconnect_deadline=20",
    ))
    .unwrap();
    let mut restarted = None;
    writes_survive(dev, || {
        server.shutdown();
        std::thread::sleep(Duration::from_millis(300));
        restarted = Some(serve(&path, &disk));
    });
    restarted.unwrap().shutdown();
}

/// nbdkit (file plugin) killed with SIGKILL mid write load and started again on the same
/// socket: every write succeeds and reads back. Its fua filter hides FUA, so the FUA writes
/// of the load are emulated (a write, then a flush) and some are caught between the two by
/// the kill. Skipped when nbdkit is not installed.
#[test]
fn a_killed_nbdkit_loses_no_write() {
    log();
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("disk.img");
    std::fs::File::create(&img)
        .unwrap()
        .set_len(64 * MIB)
        .unwrap();
    let sock = dir.path().join("kit.sock");
    if !nbdkit::installed() {
        return;
    }
    let mut kit = start_kit(&sock, &img);
    let dev = RemoteDevice::open(&unix_uri(
        &sock,
        ",timeout=5,depth=16,reconnect_deadline=20",
    ))
    .unwrap();
    let mut restarted = None;
    writes_survive(dev, || {
        kit.kill().unwrap();
        kit.wait().unwrap();
        std::thread::sleep(Duration::from_millis(200));
        let _ = std::fs::remove_file(&sock);
        restarted = Some(start_kit(&sock, &img));
    });
    if let Some(mut k) = restarted {
        let _ = k.kill();
        let _ = k.wait();
    }
}

/// nbdkit's file plugin on `img` behind its fua filter, on `sock`.
fn start_kit(sock: &Path, img: &Path) -> std::process::Child {
    nbdkit::spawn(sock, &["--filter=fua", "file", img.to_str().unwrap()])
}

/// A server gone longer than the deadline: waiting requests fail with EIO, new ones fail at
/// once; once it is back the same device object serves again.
#[test]
fn past_the_deadline_requests_fail_then_the_same_device_serves_again() {
    log();
    let dir = tempfile::tempdir().unwrap();
    let path: PathBuf = dir.path().join("nbd.sock");
    let disk = device("mem:16M");
    let server = serve(&path, &disk);
    let dev = RemoteDevice::open(&unix_uri(&path, ",timeout=2,reconnect_deadline=1")).unwrap();
    write_at(&dev, 0, &pattern(1, 4096)).unwrap();
    server.shutdown();
    let t = Instant::now();
    let e = write_at(&dev, 4096, &pattern(2, 4096)).unwrap_err();
    assert_eq!(e.errno(), libc::EIO, "{e}");
    assert!(e.to_string().contains("reconnect_deadline=1s"), "{e}");
    assert!(t.elapsed() < Duration::from_secs(8), "{:?}", t.elapsed());
    assert!(!dev.is_connected());
    // Past the deadline: no waiting.
    let t = Instant::now();
    assert_eq!(read_at(&dev, 0, 4096).unwrap_err().errno(), libc::EIO);
    assert!(t.elapsed() < Duration::from_millis(500));
    let server = serve(&path, &disk);
    // Backoff is at most 2 s apart.
    wait_until_within("reconnected", Duration::from_secs(10), || {
        dev.is_connected()
    });
    assert!(dev.reconnects() >= 1);
    assert_eq!(read_at(&dev, 0, 4096).unwrap(), pattern(1, 4096));
    write_at(&dev, 4096, &pattern(3, 4096)).unwrap();
    assert_eq!(read_at(&dev, 4096, 4096).unwrap(), pattern(3, 4096));
    assert!(!dev.is_broken());
    drop(dev);
    server.shutdown();
}

/// A server back with a different export size: nothing resumes; what waited and everything
/// after fails with EIO, and the error names both sizes.
#[test]
fn a_resized_export_is_not_resumed() {
    log();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("nbd.sock");
    let server = serve(&path, &device("mem:64M"));
    let dev = RemoteDevice::open(&unix_uri(&path, ",timeout=2,reconnect_deadline=30")).unwrap();
    write_at(&dev, 0, &[1; 4096]).unwrap();
    server.shutdown();
    let waiting = PendingBio::submit(&dev, Bio::with_buf(Op::Read, 0, Buffer::new(4096)));
    let server = serve(&path, &device("mem:32M"));
    let (_, r) = waiting
        .wait_until(Instant::now() + Duration::from_secs(15))
        .expect("a request waits for ever on a resized export");
    let e = r.unwrap_err();
    assert_eq!(e.errno(), libc::EIO, "{e}");
    let msg = e.to_string();
    assert!(msg.contains(&(64 * MIB).to_string()), "{msg}");
    assert!(msg.contains(&(32 * MIB).to_string()), "{msg}");
    assert!(msg.contains(&path.display().to_string()), "{msg}");
    assert!(dev.is_broken());
    assert!(!dev.is_connected());
    let e = write_at(&dev, 0, &[2; 4096]).unwrap_err();
    assert_eq!(e.errno(), libc::EIO);
    assert!(e.to_string().contains(&(32 * MIB).to_string()), "{e}");
    server.shutdown();
}

/// Writes acknowledged and not flushed when the connection was lost may be gone with the
/// server's cache: the next flush says so (EIO, once) instead of vouching for them; with
/// nothing unflushed, or only FUA writes, a flush after a reconnection succeeds.
#[test]
fn a_flush_after_losing_unflushed_writes_fails_once() {
    log();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("nbd.sock");
    let disk = device("mem:16M");
    let mut server = serve(&path, &disk);
    let dev = RemoteDevice::open(&unix_uri(&path, ",timeout=5,reconnect_deadline=20")).unwrap();
    let restart = |server: Server| {
        let before = dev.reconnects();
        server.shutdown();
        let s = serve(&path, &disk);
        wait_until("reconnected", || {
            dev.reconnects() > before && dev.is_connected()
        });
        s
    };
    write_at(&dev, 0, &pattern(1, 4096)).unwrap();
    flush(&dev).unwrap();
    server = restart(server);
    flush(&dev).unwrap();

    // An unflushed write, then the connection is lost.
    write_at(&dev, 4096, &pattern(2, 4096)).unwrap();
    server = restart(server);
    let e = flush(&dev).unwrap_err();
    assert_eq!(e.errno(), libc::EIO, "{e}");
    assert!(e.to_string().contains("not been flushed"), "{e}");
    flush(&dev).unwrap();

    // A FUA write is durable by itself.
    let mut bio = Bio::with_buf(Op::Write, 16, {
        let mut b = Buffer::new(4096);
        b.as_mut_slice().copy_from_slice(&pattern(3, 4096));
        b
    });
    bio.flags = BioFlags::FUA;
    blk::submit_wait(&dev, bio).1.unwrap();
    server = restart(server);
    flush(&dev).unwrap();
    assert_eq!(read_at(&dev, 8192, 4096).unwrap(), pattern(3, 4096));
    drop(dev);
    server.shutdown();
}

/// While the server is gone, requests beyond the depth wait for a slot; at the deadline the
/// ones in slots and the ones waiting for a slot all fail. Dropping a device that is
/// reconnecting fails what waits and returns (no wait for the backoff or the deadline).
#[test]
fn the_deadline_fails_slot_waiters_too_and_drop_does_not_wait() {
    log();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("nbd.sock");
    let server = serve(&path, &device("mem:16M"));
    let dev =
        RemoteDevice::open(&unix_uri(&path, ",timeout=10,depth=2,reconnect_deadline=1")).unwrap();
    server.shutdown();
    let pending: Vec<_> = (0..6u64)
        .map(|k| {
            let mut b = Buffer::new(4096);
            b.as_mut_slice().copy_from_slice(&pattern(k, 4096));
            PendingBio::submit(&dev, Bio::with_buf(Op::Write, k * 8, b))
        })
        .collect();
    for p in pending {
        let (_, r) = p
            .wait_until(Instant::now() + Duration::from_secs(10))
            .expect("a request outlives the reconnect deadline");
        assert_eq!(r.unwrap_err().errno(), libc::EIO);
    }
    assert_eq!(dev.in_flight(), 0);

    let dev = RemoteDevice::open(&unix_uri(&path, ",timeout=10,reconnect_deadline=60"));
    assert!(dev.is_err(), "nothing listens: opening fails at once");
    let server = serve(&path, &device("mem:16M"));
    let dev = RemoteDevice::open(&unix_uri(&path, ",timeout=10,reconnect_deadline=60")).unwrap();
    server.shutdown();
    let waiting = PendingBio::submit(&dev, Bio::with_buf(Op::Read, 0, Buffer::new(4096)));
    wait_until("disconnected", || !dev.is_connected());
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        drop(dev);
        let _ = tx.send(());
    });
    rx.recv_timeout(Duration::from_secs(10))
        .expect("dropping a reconnecting device hangs");
    let (_, r) = waiting
        .wait_until(Instant::now() + Duration::from_secs(1))
        .expect("the waiting read was not failed by the drop");
    assert_eq!(r.unwrap_err().errno(), libc::EIO);
}
