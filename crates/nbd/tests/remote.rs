//! `nbd::remote::RemoteDevice` against the in-process blkq NBD server (directly, and through a
//! proxy that can hold back, corrupt or cut the server's replies), and against nbdkit when it
//! is installed.
// A plain threaded test, never a loom model: its own harness (std locks and atomics) is not
// what a model must explore, so it may use std::sync.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]
#![cfg(not(blkq_loom))]

mod common;

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use blk::{Bio, BioFlags, Buffer, Device, Op, PendingBio, SECTOR_SHIFT};
use common::nbdkit::Kit;
use common::served::{device, log};
use nbd::remote::{RemoteDevice, RemoteError};
use nbd::server::{Export, Server, ServerConfig};
use testkit::pattern;

const MIB: u64 = 1 << 20;

/// A blkq NBD server on a Unix socket in its own temporary folder.
struct TestServer {
    server: Option<Server>,
    dir: tempfile::TempDir,
    path: PathBuf,
}

impl TestServer {
    fn start() -> Self {
        log();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nbd.sock");
        let mut cfg = ServerConfig::new(vec![
            Export::new("", device("mem:64M")),
            Export::new("ro", device("mem:1M")).read_only(true),
        ]);
        cfg.unix = Some(path.clone());
        cfg.tuning.drain_timeout = Duration::from_secs(2);
        let server = Server::start(cfg).unwrap();
        Self {
            server: Some(server),
            dir,
            path,
        }
    }

    fn uri(&self, export: &str, opts: &str) -> String {
        format!("nbd+unix:///{export}?socket={}{opts}", self.path.display())
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if let Some(s) = self.server.take() {
            s.shutdown();
        }
    }
}

const PASS: u8 = 0;
const HOLD: u8 = 1;
const CORRUPT: u8 = 2;

/// A Unix socket proxy in front of a server: passes the client's bytes through, and the
/// server's as `mode` says (pass, hold back for ever, or corrupt); `cut` shuts every
/// connection down.
struct Proxy {
    path: PathBuf,
    mode: Arc<AtomicU8>,
    socks: Arc<Mutex<Vec<UnixStream>>>,
}

impl Proxy {
    fn start(upstream: &Path, dir: &Path) -> Self {
        let path = dir.join("proxy.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let mode = Arc::new(AtomicU8::new(PASS));
        let socks = Arc::new(Mutex::new(Vec::new()));
        let (m, s, up) = (mode.clone(), socks.clone(), upstream.to_path_buf());
        std::thread::spawn(move || {
            for c in listener.incoming() {
                let Ok(c) = c else { return };
                let u = UnixStream::connect(&up).unwrap();
                s.lock().unwrap().push(c.try_clone().unwrap());
                s.lock().unwrap().push(u.try_clone().unwrap());
                let pass = Arc::new(AtomicU8::new(PASS));
                copy(c.try_clone().unwrap(), u.try_clone().unwrap(), pass);
                copy(u, c, m.clone());
            }
        });
        Self { path, mode, socks }
    }

    fn set(&self, mode: u8) {
        self.mode.store(mode, Ordering::SeqCst);
    }

    fn cut(&self) {
        for s in self.socks.lock().unwrap().iter() {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }

    fn uri(&self, opts: &str) -> String {
        format!("nbd+unix:///?socket={}{opts}", self.path.display())
    }
}

fn copy(mut from: UnixStream, mut to: UnixStream, mode: Arc<AtomicU8>) {
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 256 << 10];
        loop {
            let n = match from.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            match mode.load(Ordering::SeqCst) {
                HOLD => continue,
                CORRUPT => buf[0] ^= 0xff,
                _ => {}
            }
            if to.write_all(&buf[..n]).is_err() {
                break;
            }
        }
        let _ = to.shutdown(std::net::Shutdown::Both);
    });
}

fn buf_of(data: &[u8]) -> Buffer {
    let mut b = Buffer::new(data.len());
    b.as_mut_slice().copy_from_slice(data);
    b
}

fn write(dev: &dyn Device, off: u64, data: &[u8], flags: BioFlags) -> Result<(), blk::Error> {
    let mut bio = Bio::with_buf(Op::Write, off >> SECTOR_SHIFT, buf_of(data));
    bio.flags = flags;
    blk::submit_wait(dev, bio).1
}

fn read(dev: &dyn Device, off: u64, len: usize) -> Result<Vec<u8>, blk::Error> {
    let bio = Bio::with_buf(Op::Read, off >> SECTOR_SHIFT, Buffer::new(len));
    let (bio, r) = blk::submit_wait(dev, bio);
    r.map(|()| bio.buf.unwrap().as_slice().to_vec())
}

fn op(dev: &dyn Device, op: Op, off: u64, len: u32, flags: BioFlags) -> Result<(), blk::Error> {
    let mut bio = Bio::new(op, off >> SECTOR_SHIFT, len);
    bio.flags = flags;
    blk::submit_wait(dev, bio).1
}

#[test]
fn reads_writes_flushes_trims_and_zeroes() {
    let srv = TestServer::start();
    let dev = RemoteDevice::open(&srv.uri("", ",timeout=10,depth=8")).unwrap();
    let l = dev.limits();
    assert_eq!(l.capacity, 64 * MIB);
    assert!(l.logical_block_size >= 512 && l.logical_block_size.is_power_of_two());
    assert!(l.max_io_bytes >= MIB as u32, "{l:?}");
    assert_eq!(dev.spec().depth, 8);

    let a = pattern(1, MIB as usize);
    write(&dev, 0, &a, BioFlags::NONE).unwrap();
    assert_eq!(read(&dev, 0, MIB as usize).unwrap(), a);
    let b = pattern(2, 64 << 10);
    write(&dev, 3 * MIB, &b, BioFlags::FUA).unwrap();
    op(&dev, Op::Flush, 0, 0, BioFlags::NONE).unwrap();
    assert_eq!(read(&dev, 3 * MIB, b.len()).unwrap(), b);

    // Trim, then the range reads as zeros (the mem device frees it).
    op(&dev, Op::Discard, 0, MIB as u32, BioFlags::NONE).unwrap();
    assert!(read(&dev, 0, MIB as usize).unwrap().iter().all(|&x| x == 0));
    // Write zeroes, with and without NO_HOLE.
    write(&dev, 2 * MIB, &a, BioFlags::NONE).unwrap();
    op(&dev, Op::WriteZeroes, 2 * MIB, 4096, BioFlags::NONE).unwrap();
    op(
        &dev,
        Op::WriteZeroes,
        2 * MIB + 8192,
        4096,
        BioFlags::NO_HOLE,
    )
    .unwrap();
    let got = read(&dev, 2 * MIB, 16384).unwrap();
    assert!(got[..4096].iter().all(|&x| x == 0));
    assert_eq!(got[4096..8192], a[4096..8192]);
    assert!(got[8192..12288].iter().all(|&x| x == 0));
    assert_eq!(got[12288..], a[12288..16384]);

    // What blk checks fails before the wire: out of range, misaligned.
    assert!(matches!(
        read(&dev, 64 * MIB, 4096),
        Err(blk::Error::OutOfRange { .. })
    ));
    let e = op(&dev, Op::Read, 0, 0, BioFlags::NONE).unwrap_err();
    assert!(matches!(e, blk::Error::Misaligned { .. }), "{e:?}");
    assert_eq!(dev.extents(0, MIB, 8).unwrap().len(), 1);
    assert_eq!(dev.in_flight(), 0);
    assert!(!dev.is_broken());
}

#[test]
fn over_tcp() {
    let mut cfg = ServerConfig::new(vec![Export::new("disk", device("mem:16M"))]);
    cfg.tcp = Some("127.0.0.1:0".parse().unwrap());
    let server = Server::start(cfg).unwrap();
    let addr = server.tcp_addr().unwrap();
    let dev = RemoteDevice::open(&format!("nbd://{addr}/disk,timeout=5")).unwrap();
    assert_eq!(dev.limits().capacity, 16 * MIB);
    let a = pattern(5, 128 << 10);
    write(&dev, 4096, &a, BioFlags::FUA).unwrap();
    assert_eq!(read(&dev, 4096, a.len()).unwrap(), a);
    drop(dev);
    server.shutdown();
}

#[test]
fn a_read_only_export_refuses_writes() {
    let srv = TestServer::start();
    let dev = RemoteDevice::open(&srv.uri("ro", "")).unwrap();
    assert_eq!(dev.limits().capacity, MIB);
    assert!(matches!(
        write(&dev, 0, &[1; 4096], BioFlags::NONE),
        Err(blk::Error::ReadOnly)
    ));
    assert_eq!(read(&dev, 0, 4096).unwrap(), vec![0; 4096]);
    let e = RemoteDevice::open(&srv.uri("nosuch", "")).unwrap_err();
    assert!(matches!(e, RemoteError::Handshake { .. }), "{e}");
    let e = RemoteDevice::open("nbds://127.0.0.1/x").unwrap_err();
    assert!(e.to_string().contains("tls-certificates=DIR"), "{e}");
}

#[test]
fn many_bios_from_several_threads() {
    let srv = TestServer::start();
    // A depth smaller than what is submitted: submitters wait for slots.
    let dev = Arc::new(RemoteDevice::open(&srv.uri("", ",depth=16")).unwrap());
    common::load::parallel_writes_then_reads(&*dev, 4, 16, 64 << 10, false);
    assert_eq!(dev.in_flight(), 0);
}

/// Submits `n` reads and returns their pending completions.
fn submit_reads(dev: &dyn Device, n: u64) -> Vec<PendingBio> {
    (0..n)
        .map(|k| PendingBio::submit(dev, Bio::with_buf(Op::Read, k * 8, Buffer::new(4096))))
        .collect()
}

/// With `reconnect_deadline=0` a cut fails what is in flight at once, and new requests too
/// while the server cannot be reached; the device reconnects in the background and the same
/// object serves again once the server answers.
#[test]
fn a_cut_connection_with_no_deadline_fails_at_once_then_recovers() {
    let srv = TestServer::start();
    let proxy = Proxy::start(&srv.path, srv.dir.path());
    let dev = RemoteDevice::open(&proxy.uri(",timeout=2,reconnect_deadline=0")).unwrap();
    write(&dev, 0, &[7; 4096], BioFlags::NONE).unwrap();
    proxy.set(HOLD);
    let pending = submit_reads(&dev, 20);
    testkit::wait_until("20 reads in flight", || dev.in_flight() == 20);
    proxy.cut();
    for p in pending {
        let (_, r) = p
            .wait_until(Instant::now() + Duration::from_secs(5))
            .expect("a bio in flight hangs after the cut");
        let e = r.unwrap_err();
        assert_eq!(e.errno(), libc::EIO, "{e}");
    }
    assert!(!dev.is_connected());
    assert!(
        !dev.is_broken(),
        "a lost connection is not the end of the device"
    );
    assert_eq!(dev.in_flight(), 0);
    // The proxy discards the server's handshake: reconnecting fails, requests fail at once.
    let e = read(&dev, 0, 4096).unwrap_err();
    assert_eq!(e.errno(), libc::EIO);
    assert!(e.to_string().contains("connection"), "{e}");
    let e = write(&dev, 0, &[1; 4096], BioFlags::NONE).unwrap_err();
    assert_eq!(e.errno(), libc::EIO);
    assert_eq!(dev.reconnects(), 0);
    // The server answers again: the same device reconnects and serves.
    proxy.set(PASS);
    testkit::wait_until("reconnected", || dev.is_connected());
    assert_eq!(dev.reconnects(), 1);
    assert_eq!(read(&dev, 0, 4096).unwrap(), vec![7; 4096]);
    write(&dev, 4096, &[8; 4096], BioFlags::FUA).unwrap();
    assert_eq!(read(&dev, 4096, 4096).unwrap(), vec![8; 4096]);
}

/// A server that stops answering (its connection otherwise alive): the request is declared
/// lost after the timeout, the connection is dropped and re-dialed, the new handshake is not
/// answered either, and the request fails once the reconnect deadline passes, rather than
/// hanging; new requests then fail at once.
#[test]
fn a_silent_server_fails_requests_after_timeout_and_deadline() {
    let srv = TestServer::start();
    let proxy = Proxy::start(&srv.path, srv.dir.path());
    let dev = RemoteDevice::open(&proxy.uri(",timeout=1,reconnect_deadline=1")).unwrap();
    proxy.set(HOLD);
    let t = Instant::now();
    let e = read(&dev, 0, 4096).unwrap_err();
    let took = t.elapsed();
    assert!([libc::EIO, libc::ETIMEDOUT].contains(&e.errno()), "{e}");
    // timeout (1 s, checked every 250 ms), then the deadline (1 s, checked after a
    // handshake attempt that itself gives up after the 1 s timeout).
    assert!(
        took >= Duration::from_millis(1900) && took < Duration::from_secs(6),
        "{took:?}"
    );
    assert!(!dev.is_connected());
    let t = Instant::now();
    assert!(read(&dev, 0, 4096).is_err());
    assert!(t.elapsed() < Duration::from_millis(500));
}

/// A malformed reply drops the connection; with no reconnect deadline what was in flight
/// fails with EIO, and the device is not dead.
#[test]
fn a_malformed_reply_fails_requests_and_drops_the_connection() {
    let srv = TestServer::start();
    let proxy = Proxy::start(&srv.path, srv.dir.path());
    let dev = RemoteDevice::open(&proxy.uri(",timeout=2,reconnect_deadline=0")).unwrap();
    proxy.set(CORRUPT);
    let pending = submit_reads(&dev, 8);
    for p in pending {
        let (_, r) = p
            .wait_until(Instant::now() + Duration::from_secs(5))
            .expect("a bio hangs after a malformed reply");
        assert_eq!(r.unwrap_err().errno(), libc::EIO);
    }
    assert!(!dev.is_connected());
    proxy.set(PASS);
    testkit::wait_until("reconnected", || dev.is_connected());
    assert_eq!(read(&dev, 0, 4096).unwrap().len(), 4096);
}

#[test]
fn dropping_the_device_fails_what_is_in_flight() {
    let srv = TestServer::start();
    let proxy = Proxy::start(&srv.path, srv.dir.path());
    let dev = RemoteDevice::open(&proxy.uri("")).unwrap();
    proxy.set(HOLD);
    let pending = submit_reads(&dev, 4);
    drop(dev);
    for p in pending {
        let (_, r) = p
            .wait_until(Instant::now() + Duration::from_secs(5))
            .expect("a bio hangs after drop");
        assert!(r.is_err());
    }
}

/// nbdkit's memory plugin as the remote server (skipped when nbdkit is not installed).
#[test]
fn another_server_nbdkit() {
    let dir = tempfile::tempdir().unwrap();
    let Some(kit) = Kit::start(dir.path(), &["memory", "64M"]) else {
        return;
    };
    let dev = RemoteDevice::open(&kit.uri("")).unwrap();
    assert_eq!(dev.limits().capacity, 64 * MIB);
    let a = pattern(9, 256 << 10);
    write(&dev, MIB, &a, BioFlags::FUA).unwrap();
    op(&dev, Op::Flush, 0, 0, BioFlags::NONE).unwrap();
    assert_eq!(read(&dev, MIB, a.len()).unwrap(), a);
    op(&dev, Op::Discard, MIB, 4096, BioFlags::NONE).unwrap();
    op(&dev, Op::WriteZeroes, MIB + 4096, 4096, BioFlags::NONE).unwrap();
    let got = read(&dev, MIB, 12288).unwrap();
    assert!(got[..8192].iter().all(|&x| x == 0));
    assert_eq!(got[8192..], a[8192..12288]);
}

/// The server's block sizes become the limits; a command it does not offer fails with
/// ENOTSUP before the wire; an error it answers fails that request only.
#[test]
fn block_sizes_missing_commands_and_server_errors() {
    let dir = tempfile::tempdir().unwrap();
    let Some(kit) = Kit::start(
        dir.path(),
        &[
            "--filter=error",
            "--filter=blocksize-policy",
            "--filter=nozero",
            "memory",
            "64M",
            "blocksize-minimum=4096",
            "blocksize-preferred=65536",
            "blocksize-maximum=1M",
            "error-pread=ENOSPC",
            "error-pread-rate=100%",
        ],
    ) else {
        return;
    };
    let dev = RemoteDevice::open(&kit.uri("")).unwrap();
    let l = dev.limits();
    assert_eq!(
        (l.capacity, l.logical_block_size, l.max_io_bytes),
        (64 * MIB, 4096, MIB as u32)
    );
    assert_eq!(dev.preferred_block_size(), 65536);
    assert!(matches!(
        write(&dev, 512, &[1; 4096], BioFlags::NONE),
        Err(blk::Error::Misaligned { .. })
    ));
    let e = op(&dev, Op::WriteZeroes, 0, 4096, BioFlags::NONE).unwrap_err();
    assert_eq!(e.errno(), libc::ENOTSUP, "{e}");
    write(&dev, 0, &[1; 4096], BioFlags::FUA).unwrap();
    let e = read(&dev, 0, 4096).unwrap_err();
    assert_eq!(e.errno(), libc::ENOSPC, "{e}");
    // The connection goes on.
    assert!(!dev.is_broken());
    write(&dev, 4096, &[2; 4096], BioFlags::NONE).unwrap();
}

/// A server with flush but not FUA (nbdkit's fua filter in its default mode, which hides FUA;
/// nbdkit 1.32 refuses the explicit `fuamode=none`): a FUA write is sent
/// as a write and then a flush, and completes after the flush; the log filter, outermost,
/// records what the device sent. Skipped when nbdkit is not installed.
#[test]
fn fua_is_emulated_with_a_flush_when_the_server_has_no_fua() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("kit.log");
    let logfile = format!("logfile={}", log.display());
    let Some(kit) = Kit::start(
        dir.path(),
        &["--filter=log", "--filter=fua", "memory", "64M", &logfile],
    ) else {
        return;
    };
    let dev = RemoteDevice::open(&kit.uri("")).unwrap();
    let a = pattern(11, 64 << 10);
    write(&dev, 0, &a, BioFlags::FUA).unwrap();
    // Two sends, the write by its submitter; the flush by the receiver that got the write's
    // reply, inline unless the submitter still held the connection's lock (it counts its send
    // after its bytes are out, and the reply may come first), then by the send thread.
    testkit::wait_until("2 sends counted", || {
        let (a, b) = dev.sends();
        a + b == 2
    });
    assert!(dev.sends().0 >= 1, "{:?}", dev.sends());
    let text = std::fs::read_to_string(&log).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    let w = lines
        .iter()
        .position(|l| l.contains(" Write id="))
        .unwrap_or_else(|| panic!("no write in the log:\n{text}"));
    assert!(lines[w].contains("fua=0"), "{}", lines[w]);
    let wr = lines
        .iter()
        .position(|l| l.contains("...Write id="))
        .unwrap_or_else(|| panic!("no write reply in the log:\n{text}"));
    // The flush is sent after the write's reply, and answered before the bio completes
    // (the log is complete when `write` returns).
    let f = lines
        .iter()
        .position(|l| l.contains(" Flush id="))
        .unwrap_or_else(|| panic!("no flush in the log:\n{text}"));
    assert!(f > wr && wr > w, "{text}");
    assert!(
        lines[f..].iter().any(|l| l.contains("...Flush id=")),
        "{text}"
    );
    assert_eq!(read(&dev, 0, a.len()).unwrap(), a);
    // Several FUA writes at once, and a plain one: each completes, data reads back.
    let pending: Vec<_> = (0..8u64)
        .map(|k| {
            let mut bio = Bio::with_buf(Op::Write, k * 128, buf_of(&pattern(20 + k, 4096)));
            bio.flags = BioFlags::FUA;
            PendingBio::submit(&dev, bio)
        })
        .collect();
    for p in pending {
        p.wait().1.unwrap();
    }
    for k in 0..8u64 {
        assert_eq!(
            read(&dev, k * 128 * 512, 4096).unwrap(),
            pattern(20 + k, 4096)
        );
    }
    // FUA on write zeroes cannot be emulated this way: refused before the wire.
    let e = op(&dev, Op::WriteZeroes, 0, 4096, BioFlags::FUA).unwrap_err();
    assert_eq!(e.errno(), libc::ENOTSUP, "{e}");
}

/// A server answering `NBD_ESHUTDOWN` (going away, per the NBD spec) does not fail the
/// request: the device reconnects and sends it again. nbdkit's error filter answers every
/// write with ESHUTDOWN while a file exists. Skipped when nbdkit is not installed.
#[test]
fn eshutdown_is_retried_on_a_new_connection() {
    let dir = tempfile::tempdir().unwrap();
    let flag = dir.path().join("shutting-down");
    std::fs::write(&flag, b"").unwrap();
    let errfile = format!("error-pwrite-file={}", flag.display());
    let Some(kit) = Kit::start(
        dir.path(),
        &[
            "--filter=error",
            "memory",
            "64M",
            "error-pwrite=ESHUTDOWN",
            "error-pwrite-rate=100%",
            &errfile,
        ],
    ) else {
        return;
    };
    let dev = RemoteDevice::open(&kit.uri(",timeout=5,reconnect_deadline=20")).unwrap();
    let a = pattern(30, 4096);
    let pending = PendingBio::submit(&dev, Bio::with_buf(Op::Write, 0, buf_of(&a)));
    testkit::wait_until("a reconnection", || dev.reconnects() >= 1);
    std::fs::remove_file(&flag).unwrap();
    let (_, r) = pending
        .wait_until(Instant::now() + Duration::from_secs(15))
        .expect("the write hangs");
    r.unwrap();
    assert_eq!(read(&dev, 0, 4096).unwrap(), a);
}

/// Writes `data` at `offset` and reads it back through `dev`.
fn write_then_check(dev: &RemoteDevice, offset: u64, data: &[u8]) {
    let sector = offset >> SECTOR_SHIFT;
    let (_, r) = PendingBio::submit(dev, Bio::with_buf(Op::Write, sector, buf_of(data))).wait();
    r.unwrap();
    let (bio, r) = PendingBio::submit(
        dev,
        Bio::with_buf(Op::Read, sector, Buffer::new(data.len())),
    )
    .wait();
    r.unwrap();
    assert!(bio.buf.unwrap().as_slice() == data, "at {offset}");
}

/// `send=inline` (the default): with the socket free, the submitting thread writes each
/// request itself (none goes through the sender thread); a write larger than the socket takes
/// at once is written in part inline and finished by the sender thread, and reads back whole.
/// `send=thread`: every request is the sender thread's.
#[test]
fn requests_are_sent_inline_unless_send_thread_says_otherwise() {
    let srv = TestServer::start();
    for (opts, inline) in [("", true), (",send=thread", false)] {
        let dev = RemoteDevice::open(&srv.uri("", opts)).unwrap();
        for k in 0..64u64 {
            write_then_check(&dev, k * 4096, &pattern(k, 4096));
        }
        // A send is counted once its bytes are out, which its reply may overtake: wait for
        // the counts to settle (bounded) before reading them.
        testkit::wait_until("128 sends counted", || {
            let (a, b) = dev.sends();
            a + b == 128
        });
        let (by_us, by_thread) = dev.sends();
        if inline {
            assert_eq!((by_us, by_thread), (128, 0), "{opts}");
        } else {
            assert_eq!((by_us, by_thread), (0, 128), "{opts}");
        }
        // 16 MiB writes: more than the socket's send buffer (8 MiB at most: the device asks
        // for 4 MiB, which the kernel doubles) takes at once.
        for k in 0..3u64 {
            write_then_check(&dev, 8 * MIB + k * 16 * MIB, &pattern(100 + k, 16 << 20));
        }
        testkit::wait_until("134 sends counted", || {
            let (a, b) = dev.sends();
            a + b == 128 + 6
        });
        let (by_us2, by_thread2) = dev.sends();
        if inline {
            // A 16 MiB write that the socket cannot take at once goes on from the thread;
            // how many depends on how fast the server drains (the busier the box, the fewer).
            assert!(
                by_thread2 >= 1,
                "the large writes were all inline: {by_thread2}"
            );
        } else {
            assert_eq!(by_us2, 0);
        }
    }
}

/// Collects a batch's completions: each bio and its result, and whether a run of
/// `end_io_batched` calls is open (no `end_batch` since its last one).
#[derive(Default)]
struct Batched {
    done: Mutex<Vec<(Bio, Result<(), blk::Error>)>>,
    open: std::sync::atomic::AtomicBool,
    batched: std::sync::atomic::AtomicUsize,
}

impl blk::EndIo for Batched {
    fn end_io(&self, bio: Bio, res: Result<(), blk::Error>) {
        self.done.lock().unwrap().push((bio, res));
    }

    fn end_io_batched(&self, bio: Bio, res: Result<(), blk::Error>) {
        self.open.store(true, Ordering::SeqCst);
        self.batched.fetch_add(1, Ordering::SeqCst);
        self.end_io(bio, res);
    }

    fn end_batch(&self) {
        self.open.store(false, Ordering::SeqCst);
    }
}

impl Batched {
    /// Waits for `n` completions; returns them in offset order.
    fn wait(&self, n: usize) -> Vec<(Bio, Result<(), blk::Error>)> {
        testkit::wait_until("the batch completed", || {
            self.done.lock().unwrap().len() >= n
        });
        let mut v = std::mem::take(&mut *self.done.lock().unwrap());
        v.sort_by_key(|(b, _)| b.sector);
        v
    }
}

/// A submitter's batch (`Device::submit_batch`, what the server's reader submits with) goes
/// out from the submitting thread, up to 16 requests with one `sendmsg`; a batch of writes
/// larger than the socket takes at once is left in part to the sender thread (the request
/// written in part, and those not written), and every write still lands whole and in place.
/// Reads submitted in one batch come back each with its own data.
#[test]
fn a_batch_is_sent_together_and_what_the_socket_leaves_is_the_senders() {
    let srv = TestServer::start();
    let dev = RemoteDevice::open(&srv.uri("", "")).unwrap();
    for (len, n, base) in [(4096usize, 16u64, 0u64), (1 << 20, 32, 16 * MIB)] {
        let end = Arc::new(Batched::default());
        let dyn_end: Arc<dyn blk::EndIo> = end.clone();
        let (a0, b0) = dev.sends();
        let bios = (0..n).map(|k| {
            let off = base + k * len as u64;
            Bio::with_buf(
                Op::Write,
                off >> SECTOR_SHIFT,
                buf_of(&pattern(k + base, len)),
            )
        });
        dev.submit_batch(&mut bios.collect::<Vec<_>>().into_iter(), &dyn_end);
        for (_, r) in end.wait(n as usize) {
            r.unwrap();
        }
        testkit::wait_until("the batch's sends counted", || {
            let (a, b) = dev.sends();
            a + b - a0 - b0 == n
        });
        let (a, b) = dev.sends();
        if len == 4096 {
            // One batch, and the socket takes 16 small requests at once.
            assert_eq!((a - a0, b - b0), (n, 0), "small writes");
        } else {
            // Two batches of 16 MiB, each more than the socket's send buffer (8 MiB at most)
            // takes at once: the sender finished the rest.
            assert!(
                b - b0 >= 1,
                "no large write went through the sender: {a} {b}"
            );
        }
        let reads = (0..n).map(|k| {
            let off = base + k * len as u64;
            Bio::with_buf(Op::Read, off >> SECTOR_SHIFT, Buffer::new(len))
        });
        dev.submit_batch(&mut reads.collect::<Vec<_>>().into_iter(), &dyn_end);
        for (k, (bio, r)) in end.wait(n as usize).into_iter().enumerate() {
            r.unwrap();
            let want = pattern(k as u64 + base, len);
            assert!(
                bio.buf.unwrap().as_slice() == &want[..],
                "read {k} of {len} bytes"
            );
        }
    }
}

/// The receiver completes the replies one receive brought as one run (`end_io_batched`),
/// and closes every run (`end_batch`) before it waits on the socket again: a submitter that
/// leaves work to the close (the server, which sends the run's replies together) is never
/// left with a completion it was not told to finish.
#[test]
fn the_receiver_closes_every_completion_run_before_it_waits() {
    let srv = TestServer::start();
    let dev = RemoteDevice::open(&srv.uri("", "")).unwrap();
    let end = Arc::new(Batched::default());
    let dyn_end: Arc<dyn blk::EndIo> = end.clone();
    for round in 0..20u64 {
        let bios = (0..32u64).map(|k| {
            let off = (round * 32 + k) * 4096;
            Bio::with_buf(Op::Read, off >> SECTOR_SHIFT, Buffer::new(4096))
        });
        dev.submit_batch(&mut bios.collect::<Vec<_>>().into_iter(), &dyn_end);
        for (_, r) in end.wait(32) {
            r.unwrap();
        }
        // Every completion is followed by a close before the receiver blocks again; it
        // has nothing more to read, so the run is closed (at once, or within a moment).
        testkit::wait_until("the run closed", || !end.open.load(Ordering::SeqCst));
    }
    assert_eq!(
        end.batched.load(Ordering::SeqCst),
        20 * 32,
        "completed outside a run"
    );
}
