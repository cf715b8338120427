//! `nbd::remote::RemoteDevice` in front of a server whose write is slow: a request that times
//! out is never re-sent (nor recovered by a mirror) while its first copy may still land on
//! the server. The server is the in-process blkq server over a `mem:` disk behind a `Forward`
//! hook that holds the first write whose first byte is a chosen value for a while before it
//! reaches the disk (as a slow backend would), with the client's timeout shorter than that.
// A plain threaded test, never a loom model: its own harness (std locks and atomics) is not
// what a model must explore, so it may use std::sync.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]
#![cfg(not(blkq_loom))]

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use blk::{Device, Op, PendingBio};
use nbd::remote::RemoteDevice;
use nbd::server::{Export, Server, ServerConfig};
use raid1::{Raid1, Raid1Config};
use testkit::io::{flush, read_at, write_at};
use testkit::{wait_until_within, Forward};

use common::served::{device, log, serve, unix_uri};

const MB: u64 = 1 << 20;
/// How long the slow write takes on the server: longer than the client's timeout (1 s).
const SLOW: Duration = Duration::from_millis(2500);
const OLD: u8 = 0x41;
const NEW: u8 = 0x42;
const BLOCK: usize = 4096;

fn mem(size: &str) -> Arc<dyn Device> {
    device(&format!("mem:{size}"))
}

/// The slow write's state: armed until the first write starting with `OLD` arrives, landed
/// once that write has reached the disk.
#[derive(Default)]
struct Slow {
    taken: AtomicBool,
    landed: AtomicBool,
}

impl Slow {
    /// Waits (10 s at most) for the slow write to reach the disk.
    fn wait_landed(&self) {
        wait_until_within("the slow write landed", Duration::from_secs(10), || {
            self.landed.load(Ordering::SeqCst)
        });
    }
}

/// `disk` behind a hook that holds the first write whose first byte is `OLD` for `SLOW`
/// before passing it on (on a thread of its own: the server goes on serving meanwhile).
fn slow_disk(disk: &Arc<dyn Device>) -> (Arc<dyn Device>, Arc<Slow>) {
    let slow = Arc::new(Slow::default());
    let (s, d) = (slow.clone(), disk.clone());
    let dev = Forward::on_submit(disk.clone(), move |inner, bio, end| {
        let first = bio.buf.as_ref().and_then(|b| b.as_slice().first().copied());
        if bio.op != Op::Write || first != Some(OLD) || s.taken.swap(true, Ordering::SeqCst) {
            return inner.submit(bio, end);
        }
        let (s, d, end) = (s.clone(), d.clone(), end.clone());
        std::thread::spawn(move || {
            std::thread::sleep(SLOW);
            let (bio, r) = testkit::io::submit_wait(&*d, bio);
            s.landed.store(true, Ordering::SeqCst);
            end.end_io(bio, r);
        });
    });
    (Arc::new(dev), slow)
}

/// A test's folder, the server's socket in it, a memory disk and that disk behind
/// [`slow_disk`].
struct Scene {
    dir: tempfile::TempDir,
    path: std::path::PathBuf,
    disk: Arc<dyn Device>,
    slow_dev: Arc<dyn Device>,
    slow: Arc<Slow>,
}

/// A [`Scene`] with a disk of `size` (`16M`).
fn scene(size: &str) -> Scene {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("nbd.sock");
    let disk = mem(size);
    let (slow_dev, slow) = slow_disk(&disk);
    Scene {
        dir,
        path,
        disk,
        slow_dev,
        slow,
    }
}

impl Scene {
    /// The server over the slow disk, and a device connected to it with `opts`.
    fn connect(&self, opts: &str) -> (Server, RemoteDevice) {
        let server = serve(&self.path, &self.slow_dev);
        let dev = RemoteDevice::open(&unix_uri(&self.path, opts)).unwrap();
        (server, dev)
    }
}

/// The client's options: a 1 s timeout, and a reconnect deadline (10 s) past the slow write.
const PATIENT: &str = ",timeout=1,reconnect_deadline=10";

/// Flushes `dev` twice: the first flush may say (once) that writes acknowledged on a
/// connection since lost were not flushed; the second vouches for what the server holds.
fn flush_twice(dev: &dyn Device) {
    if let Err(e) = flush(dev) {
        assert!(e.to_string().contains("not been flushed"), "{e}");
    }
    flush(dev).unwrap();
}

/// Block 0 of `disk` once whatever the server still had to do with the old write is done.
fn settled_block(disk: &dyn Device) -> Vec<u8> {
    std::thread::sleep(Duration::from_millis(200));
    read_at(disk, 0, BLOCK).unwrap()
}

/// Waits (15 s at most) for leg 1 of `r` to be back in sync, with nothing left to copy.
fn wait_leg_in_sync(r: &Raid1) {
    wait_until_within("the remote leg in sync", Duration::from_secs(15), || {
        let s = r.leg_status(1).unwrap();
        s.in_sync && !s.faulty && r.wait_sync_idle(Duration::from_millis(10))
    });
}

/// The review's sequence: a write the server is slow to carry out times out on the client,
/// then a newer write to the same block and a flush. The newer data must stay: the old
/// write is not re-sent while its first copy may still land, and when that copy lands it is
/// not after the newer write.
#[test]
fn a_timed_out_write_is_not_overtaken_by_its_own_first_copy() {
    log();
    let sc = scene("16M");
    let (server, dev) = sc.connect(PATIENT);
    let t = Instant::now();
    // A late answer on the old connection is a success.
    write_at(&dev, 0, &[OLD; BLOCK]).unwrap();
    write_at(&dev, 0, &[NEW; BLOCK]).unwrap();
    // The old write was acknowledged on a connection since lost and not flushed.
    flush_twice(&dev);
    assert_eq!(read_at(&dev, 0, BLOCK).unwrap(), [NEW; BLOCK]);
    sc.slow.wait_landed();
    assert!(
        settled_block(&*sc.disk) == [NEW; BLOCK],
        "the first copy of the timed-out write landed after the newer write ({:?} after it \
         was sent)",
        t.elapsed()
    );
    assert_eq!(read_at(&dev, 0, BLOCK).unwrap(), [NEW; BLOCK]);
    assert!(dev.reconnects() >= 1, "the timeout broke the connection");
    drop(dev);
    server.shutdown();
}

/// A write the server is slow to carry out times out, and the drained connection's replies
/// all come: the same server instance still holds the connection, so a flush sent on it
/// before it is left vouches for the writes acknowledged on it. The next flush succeeds
/// (their durability is known, not lost with the connection), and the disk holds the write.
#[test]
fn a_drained_connection_is_sealed_by_a_flush_and_the_next_flush_vouches_for_its_writes() {
    log();
    let sc = scene("16M");
    let (server, dev) = sc.connect(PATIENT);
    write_at(&dev, 0, &[OLD; BLOCK]).unwrap();
    assert!(sc.slow.landed.load(Ordering::SeqCst));
    flush(&dev).unwrap_or_else(|e| {
        panic!("the write's connection drained and was sealed: the flush vouches for it: {e}")
    });
    assert!(dev.reconnects() >= 1, "the timeout broke the connection");
    assert_eq!(read_at(&dev, 0, BLOCK).unwrap(), [OLD; BLOCK]);
    drop(dev);
    server.shutdown();
}

/// The seal fails safe: a server that answers the drained connection's flush with an error,
/// or not at all within the timeout, vouches for nothing. The writes acknowledged on the
/// connection count as lost (the next flush fails), and a seal never answered holds the
/// device no longer than the timeout.
#[test]
fn a_seal_refused_or_unanswered_leaves_the_writes_unvouched() {
    log();
    for swallow in [false, true] {
        let mut sc = scene("16M");
        // The first flush after the slow write is taken (the seal) fails, or is never
        // answered.
        let (s, held) = (sc.slow.clone(), Arc::new(std::sync::Mutex::new(Vec::new())));
        let (h, once) = (held.clone(), AtomicBool::new(false));
        sc.slow_dev = Arc::new(Forward::on_submit(
            sc.slow_dev.clone(),
            move |inner, bio, end| {
                if bio.op != Op::Flush
                    || !s.taken.load(Ordering::SeqCst)
                    || once.swap(true, Ordering::SeqCst)
                {
                    return inner.submit(bio, end);
                }
                if swallow {
                    h.lock().unwrap().push((bio, end.clone()));
                } else {
                    let eio = std::io::Error::from_raw_os_error(libc::EIO);
                    end.end_io(bio, Err(blk::Error::Io(eio)));
                }
            },
        ));
        let (server, dev) = sc.connect(PATIENT);
        write_at(&dev, 0, &[OLD; BLOCK]).unwrap();
        let t = Instant::now();
        wait_until_within("reconnected", Duration::from_secs(5), || {
            dev.reconnects() >= 1 && dev.is_connected()
        });
        assert!(
            t.elapsed() < Duration::from_millis(1800),
            "swallow={swallow}: the seal held the device {:?}",
            t.elapsed()
        );
        // (A server whose disk failed a flush fails what follows on that export too.)
        let e = flush(&dev).unwrap_err();
        assert!(
            !swallow || e.to_string().contains("not been flushed"),
            "swallow={swallow}: {e}"
        );
        for (bio, end) in held.lock().unwrap().drain(..) {
            end.end_io(bio, Ok(()));
        }
        drop(dev);
        server.shutdown();
    }
}

/// 1 MiB bitmap chunks that never clear by themselves during a test; raid1d ticks and
/// probes a failed leg every 50 ms.
fn mirror_cfg() -> Raid1Config {
    Raid1Config {
        bitmap_chunk: MB,
        bitmap_quiet: Duration::from_secs(3600),
        tick: Duration::from_millis(50),
        depth: 16,
        readd_interval: Some(Duration::from_millis(50)),
        ..Raid1Config::default()
    }
}

/// `len` bytes of the data area of leg `leg` of `r` at array offset `off`.
fn leg_read(r: &Raid1, leg: &dyn Device, off: u64, len: usize) -> Vec<u8> {
    read_at(leg, r.data_offset() + off, len).unwrap()
}

/// The same sequence through a mirror of a local leg and a remote one: once the slow copy
/// has landed, both legs hold the newer data, the remote leg is in sync and nothing is left
/// to copy; the remote leg never failed (its drained connection was sealed by a flush).
#[test]
fn through_a_mirror_the_legs_agree_after_the_slow_write_lands() {
    mirror_case(10);
}

/// As above with a reconnect deadline (1 s) shorter than the slow write: the timed-out write
/// fails on the remote leg, which fails; it is re-added and recovered only once the old
/// connection is over, so the late copy does not overwrite its recovery.
#[test]
fn through_a_mirror_a_leg_failed_by_the_deadline_is_recovered_after_the_old_connection() {
    mirror_case(1);
}

fn mirror_case(deadline: u64) {
    log();
    {
        let sc = scene("32M");
        let (server, remote) = sc.connect(&format!(",timeout=1,reconnect_deadline={deadline}"));
        let (local, remote): (_, Arc<dyn Device>) = (mem("32M"), Arc::new(remote));
        let disk = sc.disk.clone();
        let r = Raid1::create(vec![local.clone(), remote.clone()], mirror_cfg()).unwrap();
        write_at(&r, 0, &[OLD; BLOCK]).unwrap();
        write_at(&r, 0, &[NEW; BLOCK]).unwrap();
        flush(&r).unwrap();
        assert_eq!(read_at(&r, 0, BLOCK).unwrap(), [NEW; BLOCK]);
        // With a 1 s deadline the remote leg failed on the write (failed at the deadline): its
        // bits stay set, and it is re-added and recovered once it answers again. With 10 s the
        // write was answered late on the old connection, which drained and was sealed by a
        // flush: nothing on it was lost, and the leg never failed.
        assert_eq!(r.leg_status(1).unwrap().faulty, deadline < 10);
        sc.slow.wait_landed();
        // Back in sync (a failed leg re-added and recovered), nothing left to copy.
        wait_leg_in_sync(&r);
        std::thread::sleep(Duration::from_millis(200));
        let (a, b) = (
            leg_read(&r, &*local, 0, BLOCK),
            leg_read(&r, &*disk, 0, BLOCK),
        );
        assert!(
            a == [NEW; BLOCK] && b == [NEW; BLOCK],
            "reconnect_deadline={deadline}: the legs hold {:#x} (local) and {:#x} (remote)",
            a[0],
            b[0]
        );
        // The whole data areas agree.
        let cap = r.limits().capacity;
        let mut off = 0;
        while off < cap {
            let n = MB.min(cap - off) as usize;
            assert!(
                leg_read(&r, &*local, off, n) == leg_read(&r, &*disk, off, n),
                "reconnect_deadline={deadline}: the legs differ at {off}"
            );
            off += n as u64;
        }
        assert!(!r.is_degraded());
        drop(r);
        drop(remote);
        server.shutdown();
    }
}

/// A remote leg whose server is gone past the reconnect deadline fails even when no request
/// asks anything of it: the mirror marks it faulty without a write, keeps its bits, and
/// re-adds it once the server is back.
#[test]
fn an_expired_reconnect_deadline_fails_an_idle_leg() {
    log();
    let Scene {
        dir: _dir,
        path,
        disk,
        ..
    } = scene("32M");
    let server = serve(&path, &disk);
    let local = mem("32M");
    let remote =
        Arc::new(RemoteDevice::open(&unix_uri(&path, ",timeout=1,reconnect_deadline=1")).unwrap());
    let leg: Arc<dyn Device> = remote.clone();
    // Bits clear 10 ms after their last write: once clean, raid1d sends the legs nothing.
    let cfg = Raid1Config {
        bitmap_quiet: Duration::from_millis(10),
        ..mirror_cfg()
    };
    let r = Raid1::create(vec![local.clone(), leg], cfg).unwrap();
    write_at(&r, 0, &[NEW; BLOCK]).unwrap();
    flush(&r).unwrap();
    wait_until_within("a clean bitmap", Duration::from_secs(5), || {
        r.bitmap().unwrap().dirty_chunks().is_empty()
    });
    std::thread::sleep(Duration::from_millis(100));
    server.shutdown();
    let t = Instant::now();
    wait_until_within("the idle remote leg failed", Duration::from_secs(8), || {
        r.leg_status(1).unwrap().faulty
    });
    assert!(
        t.elapsed() >= Duration::from_millis(900),
        "{:?}",
        t.elapsed()
    );
    // Written while the leg is away: its chunk stays dirty.
    write_at(&r, 3 * MB, &[OLD; BLOCK]).unwrap();
    let server = serve(&path, &disk);
    wait_leg_in_sync(&r);
    assert_eq!(leg_read(&r, &*disk, 3 * MB, BLOCK), [OLD; BLOCK]);
    assert_eq!(leg_read(&r, &*disk, 0, BLOCK), [NEW; BLOCK]);
    drop(r);
    server.shutdown();
}

/// The same through qemu-nbd (when installed), whose image is the slow blkq server (qemu's
/// NBD client): qemu-nbd closes a connection as soon as the client shuts down its sending
/// half, with the slow write still running, so the end of the connection alone does not
/// say its requests are over. The client never shuts it down while a reply may come: it
/// waits for the slow write's reply, and the newer write stays.
#[test]
fn through_qemu_nbd_a_timed_out_write_is_not_overtaken_either() {
    log();
    if std::process::Command::new("qemu-nbd")
        .arg("--version")
        .output()
        .is_err()
    {
        eprintln!("skipped: qemu-nbd is not on PATH");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let back = dir.path().join("back.sock");
    let front = dir.path().join("qemu.sock");
    let disk = mem("16M");
    let (slow_dev, slow) = slow_disk(&disk);
    let server = serve(&back, &slow_dev);
    let mut qemu = std::process::Command::new("qemu-nbd")
        .args(["--persistent", "--shared=4", "--cache=none", "--socket"])
        .arg(&front)
        .arg("--image-opts")
        .arg(format!(
            "driver=nbd,server.type=unix,server.path={}",
            back.display()
        ))
        .spawn()
        .unwrap();
    wait_until_within("qemu-nbd's socket", Duration::from_secs(10), || {
        std::os::unix::net::UnixStream::connect(&front).is_ok()
    });
    let dev = RemoteDevice::open(&unix_uri(&front, PATIENT)).unwrap();
    write_at(&dev, 0, &[OLD; BLOCK]).unwrap();
    write_at(&dev, 0, &[NEW; BLOCK]).unwrap();
    flush_twice(&dev);
    slow.wait_landed();
    let got = settled_block(&*disk);
    drop(dev);
    let _ = qemu.kill();
    let _ = qemu.wait();
    server.shutdown();
    assert!(got == [NEW; BLOCK], "the disk holds {:#x}", got[0]);
}

/// A server that stops reading while the slow write holds its only slot: the client's sends
/// stall behind it past the timeout. They wait for the server to read rather than fail (a
/// send given up halfway could not be finished), the connection drains once everything is
/// answered, every write succeeds, and the newer write at the slow write's block stays.
#[test]
fn sends_stalled_behind_a_slow_write_wait_and_nothing_is_overtaken() {
    log();
    let sc = scene("16M");
    let mut cfg = ServerConfig::new(vec![Export::new("", sc.slow_dev.clone())]);
    cfg.unix = Some(sc.path.clone());
    cfg.tuning.slots = 1;
    let server = Server::start(cfg).unwrap();
    let dev = RemoteDevice::open(&unix_uri(&sc.path, PATIENT)).unwrap();
    const LEN: usize = 64 << 10;
    let mut pending = vec![PendingBio::submit(&dev, write_bio(0, vec![OLD; BLOCK]))];
    for k in 1..48u64 {
        pending.push(PendingBio::submit(
            &dev,
            write_bio(k * LEN as u64, testkit::pattern(k, LEN)),
        ));
    }
    for p in pending {
        let (_, r) = p
            .wait_until(Instant::now() + Duration::from_secs(10))
            .expect("a write stalled behind the slow one never completed");
        r.unwrap();
    }
    write_at(&dev, 0, &[NEW; BLOCK]).unwrap();
    flush_twice(&dev);
    assert!(sc.slow.landed.load(Ordering::SeqCst));
    assert!(settled_block(&*sc.disk) == [NEW; BLOCK]);
    for k in 1..48u64 {
        assert!(read_at(&dev, k * LEN as u64, LEN).unwrap() == testkit::pattern(k, LEN));
    }
    drop(dev);
    server.shutdown();
}

fn write_bio(offset: u64, data: Vec<u8>) -> blk::Bio {
    let mut b = blk::Buffer::new(data.len());
    b.as_mut_slice().copy_from_slice(&data);
    blk::Bio::with_buf(Op::Write, offset >> blk::SECTOR_SHIFT, b)
}

/// With several connections, a write the reconnect deadline failed while its copy may still
/// land keeps the other connections from taking writes until its connection is over: a
/// newer write to the same block fails rather than land before that copy.
#[test]
fn with_several_connections_no_write_goes_out_while_a_failed_one_may_still_land() {
    log();
    let sc = scene("16M");
    let (server, dev) = sc.connect(",timeout=1,reconnect_deadline=1,conns=2");
    assert_eq!(dev.connections(), 2);
    let e = write_at(&dev, 0, &[OLD; BLOCK]).unwrap_err();
    assert_eq!(e.errno(), libc::EIO, "{e}");
    assert!(!sc.slow.landed.load(Ordering::SeqCst));
    // The other connection is up, but the failed write may still land.
    let e = write_at(&dev, 0, &[NEW; BLOCK]).unwrap_err();
    assert_eq!(e.errno(), libc::EIO, "{e}");
    assert!(e.to_string().contains("another connection"), "{e}");
    sc.slow.wait_landed();
    wait_until_within("both connections up", Duration::from_secs(10), || {
        dev.is_connected()
    });
    write_at(&dev, 0, &[NEW; BLOCK]).unwrap();
    assert!(settled_block(&*sc.disk) == [NEW; BLOCK]);
    drop(dev);
    server.shutdown();
}

/// A server that never answers a write and never closes the connection (a hostile one, or
/// one wedged on its disk, over a Unix socket where no keepalive can tell) does not hold the
/// device down for ever: the drain of the connection the client gave up is bounded by ten
/// times the timeout, as TCP keepalive bounds it for a host that cannot be heard, and at
/// least 10 s (a sub-second timeout's ten are shorter than a busy server's stall); then the
/// connection is taken as over, the device reconnects and re-sends, and the write succeeds.
#[test]
fn a_server_that_never_answers_nor_closes_holds_the_device_down_a_bounded_time() {
    log();
    let Scene {
        dir: _dir,
        path,
        disk,
        ..
    } = scene("16M");
    // The first write is swallowed: never carried out, never answered.
    let swallowed = Arc::new(std::sync::Mutex::new(Vec::new()));
    let (sw, taken) = (swallowed.clone(), Arc::new(AtomicBool::new(false)));
    let wedged: Arc<dyn Device> =
        Arc::new(Forward::on_submit(disk.clone(), move |inner, bio, end| {
            if bio.op == Op::Write && !taken.swap(true, Ordering::SeqCst) {
                sw.lock().unwrap().push((bio, end.clone()));
                return;
            }
            inner.submit(bio, end)
        }));
    let server = serve(&path, &wedged);
    let mut spec =
        nbd::remote::RemoteSpec::parse(&unix_uri(&path, ",reconnect_deadline=60")).unwrap();
    spec.timeout = Duration::from_millis(100);
    let dev = RemoteDevice::connect(spec).unwrap();
    let t0 = Instant::now();
    let r = write_at(&dev, 0, &[NEW; BLOCK]);
    let took = t0.elapsed();
    // Let the server's connection end: the swallowed write fails there.
    for (bio, end) in swallowed.lock().unwrap().drain(..) {
        end.end_io(
            bio,
            Err(blk::Error::Io(std::io::Error::from_raw_os_error(libc::EIO))),
        );
    }
    r.unwrap_or_else(|e| panic!("the write failed after {took:?}: {e}"));
    assert!(
        took >= Duration::from_secs(9) && took < Duration::from_secs(15),
        "the write took {took:?}: the drain waits 10 s at least, and not much more"
    );
    assert!(dev.reconnects() >= 1);
    assert_eq!(read_at(&dev, 0, BLOCK).unwrap(), vec![NEW; BLOCK]);
    drop(dev);
    server.shutdown();
}
