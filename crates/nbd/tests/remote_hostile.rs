//! `nbd::remote::RemoteDevice` against a hostile server (`common::hostile_server`): what a
//! server it dials sends must not make the client use unbounded memory, nor hold a request or
//! a connection attempt past its deadline, nor hand out bytes no reply wrote.
// A plain threaded test, never a loom model: its own harness (std locks and atomics) is not
// what a model must explore, so it may use std::sync.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]
#![cfg(not(blkq_loom))]

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nbd::codec::proto::*;
use nbd::remote::RemoteDevice;

use common::hostile_server::{HostileServer, Peer};
use common::served::log;

/// Replies the flooding server sends to `NBD_OPT_GO` before its real answer.
const FLOOD: usize = 20_000;

/// H1: a server that answers `NBD_OPT_GO` with a flood of `NBD_REP_INFO` replies (4000-byte
/// descriptions, 80 MB in all) before the export's: the client processes each as it arrives
/// and gives the attempt up once the replies pass the per-option bound, rather than keeping
/// them all.
#[test]
fn a_flood_of_option_replies_fails_the_attempt_within_the_bound() {
    log();
    let sent = Arc::new(AtomicUsize::new(0));
    let s2 = sent.clone();
    let srv = HostileServer::start(move |_, p: &mut Peer| {
        p.greet()?;
        loop {
            let (opt, _) = p.option()?;
            if opt != NBD_OPT_GO {
                p.reply(opt, NBD_REP_ACK, &[])?;
                continue;
            }
            let mut d = NBD_INFO_DESCRIPTION.to_be_bytes().to_vec();
            d.extend_from_slice(&[b'x'; 4000]);
            for _ in 0..FLOOD {
                p.reply(opt, NBD_REP_INFO, &d)?;
                s2.fetch_add(1, Ordering::SeqCst);
            }
            p.go_replies(opt)?;
            return p.swallow();
        }
    });
    let r = RemoteDevice::connect(srv.spec(Duration::from_secs(5), Duration::from_secs(1)));
    let n = sent.load(Ordering::SeqCst);
    let e = match r {
        Ok(_) => panic!("connected after the server sent {n} replies to one option"),
        Err(e) => e.to_string(),
    };
    assert!(e.contains("replies"), "{e}");
    // What the client read before it gave up, and what the socket's buffers held.
    assert!(n < FLOOD / 10, "the server sent {n} replies");
}

/// How often the trickling server sends its next byte: well inside the request timeout and
/// the receiver's tick (a quarter of it), so no single read waits long enough to time out.
const DRIP: Duration = Duration::from_millis(100);
const TIMEOUT: Duration = Duration::from_secs(1);
const DEADLINE: Duration = Duration::from_millis(500);

fn read_bio(offset: u64, len: usize) -> blk::Bio {
    blk::Bio::with_buf(
        blk::Op::Read,
        offset >> blk::SECTOR_SHIFT,
        blk::Buffer::new(len),
    )
}

/// Submits a read of `len` bytes at 0 and waits at most `limit` for it to end: how long it
/// took and how it ended (`None`: still pending).
fn read_within(
    dev: &RemoteDevice,
    len: usize,
    limit: Duration,
) -> (Duration, Option<Result<Vec<u8>, blk::Error>>) {
    let t = Instant::now();
    let p = blk::PendingBio::submit(dev, read_bio(0, len));
    let r = p
        .wait_until(t + limit)
        .map(|(bio, r)| r.map(|()| bio.buf.unwrap().as_slice().to_vec()));
    (t.elapsed(), r)
}

/// H2: a server that answers a read one byte every 100 ms (each socket read returns within
/// the receiver's 250 ms tick): the request's deadline runs from its send to its whole reply, so
/// the connection is declared dead at the timeout and the read fails at the reconnect
/// deadline, not when the trickle ends (7 minutes later).
#[test]
fn a_trickled_reply_does_not_hold_a_read_past_its_deadline() {
    log();
    let srv = HostileServer::start(|_, p: &mut Peer| {
        p.negotiate()?;
        let r = p.request()?;
        p.trickle(Some(DRIP));
        p.data(r.cookie, r.offset, &vec![0x5a; r.len as usize], true)?;
        p.swallow()
    });
    let dev = RemoteDevice::connect(srv.spec(TIMEOUT, DEADLINE)).unwrap();
    let (took, r) = read_within(&dev, 4096, Duration::from_secs(4));
    let Some(r) = r else {
        panic!("the trickled read was still pending after {took:?}");
    };
    let e = r.expect_err("the trickled read succeeded");
    assert!(
        matches!(e.errno(), libc::EIO | libc::ETIMEDOUT),
        "{e} after {took:?}"
    );
    // Timeout, a tick, the reconnect deadline; and slack for a loaded machine.
    assert!(
        took < TIMEOUT + DEADLINE + Duration::from_secs(1),
        "{took:?}"
    );
}

/// H2: the connection breaks with a read in flight, and every attempt to reconnect meets a
/// server that trickles its handshake one byte every 100 ms: the reconnect deadline fails
/// the read whatever the attempt is doing, and each attempt is bounded as a whole.
#[test]
fn a_trickled_handshake_does_not_hold_a_reconnect_past_its_deadline() {
    log();
    let srv = HostileServer::start(|k, p: &mut Peer| {
        if k == 0 {
            p.negotiate()?;
            // The read arrives; the server goes away without answering it.
            p.request().map(drop)
        } else {
            p.trickle(Some(DRIP));
            p.negotiate()?;
            p.serve(&mut vec![0; common::hostile_server::SIZE as usize])
        }
    });
    let dev = RemoteDevice::connect(srv.spec(TIMEOUT, DEADLINE)).unwrap();
    let (took, r) = read_within(&dev, 4096, Duration::from_secs(4));
    let Some(r) = r else {
        panic!("the read was still pending after {took:?} (a trickled handshake)");
    };
    let e = r.expect_err("the read succeeded");
    assert_eq!(e.errno(), libc::EIO, "{e} after {took:?}");
    assert!(took < DEADLINE + Duration::from_secs(1), "{took:?}");
}

/// H2: the first connection's handshake, trickled one byte every 100 ms, is bounded as a
/// whole by the timeout (1 s), not read by read (a handshake of about 150 bytes would
/// take 15 s).
#[test]
fn a_trickled_handshake_fails_the_connection_attempt_at_its_timeout() {
    log();
    let srv = HostileServer::start(|_, p: &mut Peer| {
        p.trickle(Some(DRIP));
        p.negotiate()?;
        p.swallow()
    });
    let (took, r) = connect_within(srv.spec(TIMEOUT, DEADLINE), Duration::from_secs(4));
    let Some(r) = r else {
        panic!("still connecting after {took:?}");
    };
    assert!(r.is_err(), "connected after {took:?}");
    assert!(took < TIMEOUT + Duration::from_secs(1), "{took:?}");
}

/// H2: `nbds:` to a server that acknowledges `NBD_OPT_STARTTLS` and then trickles its TLS
/// flight (a record announced 16 KiB long, a byte every 100 ms): the TLS handshake is part
/// of the attempt and ends with it, at the timeout.
#[test]
fn a_trickled_tls_handshake_fails_the_connection_attempt_at_its_timeout() {
    log();
    let certs = tempfile::tempdir().unwrap();
    common::pki::pki(certs.path());
    let srv = HostileServer::start(|_, p: &mut Peer| {
        p.greet()?;
        let (opt, _) = p.option()?;
        p.reply(opt, NBD_REP_ACK, &[])?;
        p.trickle(Some(DRIP));
        // A handshake record header (TLS 1.2 framing, 16384 bytes), then its body, slowly.
        p.send(&[0x16, 0x03, 0x03, 0x40, 0x00])?;
        p.send(&[0u8; 16384])
    });
    let mut spec = nbd::remote::RemoteSpec::parse(&format!(
        "nbds+unix:///?socket={}&tls-certificates={}",
        srv.path().display(),
        certs.path().display()
    ))
    .unwrap();
    spec.timeout = TIMEOUT;
    let (took, r) = connect_within(spec, Duration::from_secs(4));
    let Some(r) = r else {
        panic!("still connecting after {took:?}");
    };
    assert!(r.is_err(), "connected after {took:?}");
    assert!(
        took < TIMEOUT + Duration::from_secs(1),
        "{took:?}: {:?}",
        r.err()
    );
}

/// Connects on a thread of its own and waits at most `limit`: how long it took, and its
/// result (`None`: still connecting; the thread is left to end when the server goes away).
fn connect_within(
    spec: nbd::remote::RemoteSpec,
    limit: Duration,
) -> (
    Duration,
    Option<Result<RemoteDevice, nbd::remote::RemoteError>>,
) {
    let t = Instant::now();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(RemoteDevice::connect(spec));
    });
    let r = rx.recv_timeout(limit).ok();
    (t.elapsed(), r)
}

/// A server whose every read reply is `pieces` (offset within the request, length) as data
/// chunks holding the pattern byte of their offset (the last chunk carries the done flag);
/// anything else is answered honestly.
fn piecewise(pieces: &'static [(u64, u64)]) -> HostileServer {
    HostileServer::start(move |_, p: &mut Peer| {
        p.negotiate()?;
        loop {
            let r = p.request()?;
            if r.cmd != NBD_CMD_READ {
                p.done(r.cookie)?;
                continue;
            }
            for (k, &(at, len)) in pieces.iter().enumerate() {
                let data: Vec<u8> = (at..at + len).map(byte_at).collect();
                p.data(r.cookie, r.offset + at, &data, k + 1 == pieces.len())?;
            }
        }
    })
}

/// The byte the piecewise server holds at offset `o` of a read.
fn byte_at(o: u64) -> u8 {
    (o / 512) as u8 ^ 0x5a
}

/// L1: an 8 KiB read answered with its first half twice: the chunks' lengths add up to the
/// request's, but the second half was never written. The reply is malformed (chunks
/// overlap): the read fails, and its buffer's bytes no reply wrote are never handed out.
#[test]
fn a_read_answered_with_its_first_half_twice_fails() {
    log();
    let srv = piecewise(&[(0, 4096), (0, 4096)]);
    let dev = RemoteDevice::connect(srv.spec(TIMEOUT, DEADLINE)).unwrap();
    let (took, r) = read_within(&dev, 8192, Duration::from_secs(4));
    let Some(r) = r else {
        panic!("the read was still pending after {took:?}");
    };
    match r {
        Ok(data) => panic!(
            "the read succeeded; its second half holds {:#x}.. (no reply wrote it)",
            data[4096]
        ),
        Err(e) => assert_eq!(e.errno(), libc::EIO, "{e}"),
    }
}

/// L1, what must still pass: a read answered in pieces out of order, none overlapping, that
/// together fill it, reads exactly what they hold.
#[test]
fn a_read_answered_in_pieces_out_of_order_succeeds() {
    log();
    let srv = piecewise(&[(4096, 2048), (0, 1024), (6144, 2048), (1024, 3072)]);
    let dev = RemoteDevice::connect(srv.spec(TIMEOUT, DEADLINE)).unwrap();
    let (took, r) = read_within(&dev, 8192, Duration::from_secs(4));
    let data = r
        .unwrap_or_else(|| panic!("still pending after {took:?}"))
        .unwrap();
    let want: Vec<u8> = (0..8192).map(byte_at).collect();
    assert!(
        data == want,
        "the read does not hold what the chunks carried"
    );
}

/// L1, the blocking client too (a mirror's check of a new connection reads through it): a
/// read answered with its first half twice is an error, not a buffer half zeros.
#[test]
fn the_blocking_client_refuses_a_read_answered_with_its_first_half_twice() {
    log();
    let srv = piecewise(&[(0, 4096), (0, 4096)]);
    let ep = nbd::client::Endpoint::Unix(srv.path().to_path_buf());
    let mut c = nbd::client::Client::connect(&ep, &nbd::client::ClientOptions::default()).unwrap();
    match c.read(0, 8192) {
        Ok(data) => panic!(
            "the read succeeded; its second half holds {:#x}.. (no reply wrote it)",
            data[4096]
        ),
        Err(e) => assert!(e.to_string().contains("overlaps"), "{e}"),
    }
    // And pieces out of order that fill it are fine.
    let srv = piecewise(&[(4096, 2048), (0, 1024), (6144, 2048), (1024, 3072)]);
    let ep = nbd::client::Endpoint::Unix(srv.path().to_path_buf());
    let mut c = nbd::client::Client::connect(&ep, &nbd::client::ClientOptions::default()).unwrap();
    let want: Vec<u8> = (0..8192).map(byte_at).collect();
    assert!(c.read(0, 8192).unwrap() == want);
}

/// H2 through a mirror: a remote leg whose server starts trickling its replies (a 4 KiB
/// error message, a byte every 100 ms) fails by the timeout plus the reconnect deadline, as
/// the README promises, and the mirror's write completes on the other leg meanwhile rather
/// than wait for the trickle.
#[test]
fn a_trickling_remote_leg_fails_by_its_deadlines_and_the_mirror_goes_on() {
    use std::sync::atomic::AtomicBool;
    use std::sync::Mutex;
    log();
    let disk = Arc::new(Mutex::new(vec![0u8; common::hostile_server::SIZE as usize]));
    let slow = Arc::new(AtomicBool::new(false));
    let (d2, s2) = (disk.clone(), slow.clone());
    let srv = HostileServer::start(move |_, p: &mut Peer| {
        p.negotiate()?;
        loop {
            let r = p.request()?;
            if s2.load(Ordering::SeqCst) {
                p.trickle(Some(DRIP));
                return p.error(r.cookie, NBD_EIO, &[b'x'; 4000]);
            }
            p.answer(&r, &mut d2.lock().unwrap())?;
        }
    });
    let r = mirror_over(&srv);
    assert!(!r.is_degraded());
    slow.store(true, Ordering::SeqCst);
    let took = write_0x22_within(&r, Duration::from_secs(6), "a trickling remote leg");
    assert!(
        took < TIMEOUT + DEADLINE + Duration::from_millis(1500),
        "{took:?}"
    );
    assert!(r.leg_status(1).unwrap().faulty);
    assert_eq!(testkit::io::read_at(&r, 4096, 4096).unwrap(), [0x22; 4096]);
}

/// A mirror of a local memory leg and a remote leg on `srv` (bitmap chunk 1 MiB, 50 ms tick),
/// with 0x11 written at offset 0.
fn mirror_over(srv: &HostileServer) -> raid1::Raid1 {
    let local = common::served::device("mem:32M");
    let remote: Arc<dyn blk::Device> =
        Arc::new(RemoteDevice::connect(srv.spec(TIMEOUT, DEADLINE)).unwrap());
    let cfg = raid1::Raid1Config {
        bitmap_chunk: 1 << 20,
        tick: Duration::from_millis(50),
        depth: 16,
        ..raid1::Raid1Config::default()
    };
    let r = raid1::Raid1::create(vec![local, remote], cfg).unwrap();
    testkit::io::write_at(&r, 0, &[0x11; 4096]).unwrap();
    r
}

/// Writes 0x22 to sector 8 of the mirror `r`, failing the test unless the write succeeds
/// within `limit` (`why`: what would hold it); the time it took.
fn write_0x22_within(r: &raid1::Raid1, limit: Duration, why: &str) -> Duration {
    let t = Instant::now();
    let mut b = blk::Buffer::new(4096);
    b.as_mut_slice().fill(0x22);
    let p = blk::PendingBio::submit(r, blk::Bio::with_buf(blk::Op::Write, 8, b));
    let Some((_, res)) = p.wait_until(t + limit) else {
        panic!(
            "the mirror's write was still pending after {:?} ({why})",
            t.elapsed()
        );
    };
    let took = t.elapsed();
    res.unwrap();
    took
}

/// H2, the owner's check of a new connection is part of its attempt: a remote mirror leg's
/// server goes away with a write in flight, and the server that answers the reconnection
/// negotiates promptly but trickles its answer to the mirror's check (the superblock read).
/// The attempt ends at the reconnect deadline, the leg fails, and the mirror's write
/// completes on the other leg.
#[test]
fn a_trickled_answer_to_the_mirrors_check_does_not_hold_the_reconnection() {
    use std::sync::atomic::AtomicBool;
    use std::sync::Mutex;
    log();
    let disk = Arc::new(Mutex::new(vec![0u8; common::hostile_server::SIZE as usize]));
    let die = Arc::new(AtomicBool::new(false));
    let (d2, die2) = (disk.clone(), die.clone());
    let srv = HostileServer::start(move |k, p: &mut Peer| {
        p.negotiate()?;
        loop {
            let r = p.request()?;
            if k == 0 && die2.load(Ordering::SeqCst) {
                // Gone, the request unanswered.
                return Ok(());
            }
            if k > 0 {
                p.trickle(Some(DRIP));
            }
            p.answer(&r, &mut d2.lock().unwrap())?;
        }
    });
    let r = mirror_over(&srv);
    // Flushed: the connection is lost with nothing unflushed on it, so the leg is not failed
    // for lost writes at once, and the write below waits for the reconnection's check.
    testkit::io::flush(&r).unwrap();
    die.store(true, Ordering::SeqCst);
    let took = write_0x22_within(&r, Duration::from_secs(5), "a trickled check");
    assert!(took < DEADLINE + Duration::from_millis(1500), "{took:?}");
    assert!(srv.accepted() >= 2, "no reconnection was tried");
    assert!(r.leg_status(1).unwrap().faulty);
}

/// A server that negotiates, then never reads a request: the socket's send buffer fills
/// with the first writes. Every submit still returns at once (the send is non-blocking: what
/// the socket does not take waits for the sender thread), so a submitting thread is never
/// held by a server that stops reading; the writes fail once the device gives the connection
/// up, or when it is dropped.
#[test]
fn a_server_that_stops_reading_does_not_hold_a_submitter() {
    log();
    let srv = HostileServer::start(|_, p: &mut Peer| {
        p.negotiate()?;
        // Reads nothing more; ends when the client goes away.
        p.swallow_never()
    });
    let mut spec = srv.spec(Duration::from_secs(2), Duration::from_secs(2));
    spec.depth = 64;
    let dev = RemoteDevice::connect(spec).unwrap();
    let end: Arc<testkit::Collect> = Arc::default();
    let end_dyn: blkq_sync::DynArc<dyn blk::EndIo> = end.clone();
    // 64 writes of 256 KiB: 16 MiB, more than the socket's send buffer (8 MiB at most).
    let len = 256 << 10;
    let mut slowest = Duration::ZERO;
    for k in 0..64u64 {
        let mut buf = blk::Buffer::new(len);
        buf.as_mut_slice().fill(k as u8);
        let bio = blk::Bio::with_buf(blk::Op::Write, k * (len as u64 >> blk::SECTOR_SHIFT), buf);
        let t = Instant::now();
        blk::Device::submit(&dev, bio, &end_dyn);
        slowest = slowest.max(t.elapsed());
    }
    assert!(
        slowest < Duration::from_millis(500),
        "a submit to a server that stopped reading took {slowest:?}"
    );
    assert!(
        end.is_empty(),
        "a write completed with the server not reading"
    );
    drop(dev);
    let done = end.wait_for(64);
    assert!(done.iter().all(|(_, r)| r.is_err()));
}
