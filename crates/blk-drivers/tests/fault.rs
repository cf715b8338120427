//! The fault-injection device over a `mem` device: every rule kind, seeded determinism, the
//! crash model (exactly the unflushed writes are lost), stalls, and no panic on any config.
//! Deterministic: no timing assertions.
// A plain threaded test or benchmark, never a loom model: its own harness (std locks, atomics,
// condition variables, baselines) is not what a model must explore, so it may use std::sync.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]
#![cfg(not(blkq_loom))]

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use blk::{Bio, BioFlags, Buffer, Device, EndIo, Error, Op};
use blk_drivers::fault::{Action, FaultConfig, FaultDevice, FaultHandle, OpSet, Rule, When};
use blk_drivers::spec::{DeviceSpec, QueueOverrides};
use testkit::Forward;
use waitq::WaitQueue;

const K4: u64 = 4096;

/// Collects completions; a test waits for them on the wait queue (the one way to sleep).
#[derive(Default)]
struct Collect(Mutex<Vec<(Bio, Result<(), Error>)>>, WaitQueue);

impl EndIo for Collect {
    fn end_io(&self, bio: Bio, res: Result<(), Error>) {
        self.0.lock().unwrap().push((bio, res));
        self.1.wake_all(); // after the lock is dropped
    }
}

impl Collect {
    fn len(&self) -> usize {
        self.0.lock().unwrap().len()
    }

    /// Waits (without a time limit worth asserting on: 60 s means "lost") for `n`.
    fn wait_for(&self, n: usize) -> Vec<(Bio, Result<(), Error>)> {
        let deadline = Instant::now() + Duration::from_secs(60);
        let got = self.1.wait_for_until(
            || {
                let mut v = self.0.lock().unwrap();
                (v.len() >= n).then(|| std::mem::take(&mut *v))
            },
            deadline,
        );
        got.expect("completions lost")
    }
}

fn mem(size: &str) -> Arc<dyn Device> {
    Arc::new(
        format!("mem:{size}")
            .parse::<DeviceSpec>()
            .unwrap()
            .build(&QueueOverrides::default())
            .unwrap(),
    )
}

fn fault(cfg: FaultConfig) -> (Arc<dyn Device>, Arc<dyn Device>, FaultHandle) {
    let inner = mem("4M");
    let f = FaultDevice::new(inner.clone(), cfg);
    let h = f.handle();
    (Arc::new(f), inner, h)
}

fn io(dev: &dyn Device, bio: Bio) -> (Bio, Result<(), Error>) {
    let c = Arc::new(Collect::default());
    let end: Arc<dyn EndIo> = c.clone();
    dev.submit(bio, &end);
    c.wait_for(1).pop().unwrap()
}

fn fill(byte: u8, len: u64) -> Buffer {
    let mut b = Buffer::new(len as usize);
    b.as_mut_slice().fill(byte);
    b
}

fn write(dev: &dyn Device, off: u64, byte: u8, len: u64) -> Result<(), Error> {
    io(dev, Bio::with_buf(Op::Write, off >> 9, fill(byte, len))).1
}

fn write_fua(dev: &dyn Device, off: u64, byte: u8, len: u64) -> Result<(), Error> {
    let mut b = Bio::with_buf(Op::Write, off >> 9, fill(byte, len));
    b.flags = BioFlags::FUA;
    io(dev, b).1
}

fn read(dev: &dyn Device, off: u64, len: u64) -> Result<Vec<u8>, Error> {
    let (b, r) = io(
        dev,
        Bio::with_buf(Op::Read, off >> 9, Buffer::new(len as usize)),
    );
    r.map(|()| b.buf.unwrap().as_slice().to_vec())
}

fn flush(dev: &dyn Device) -> Result<(), Error> {
    io(dev, Bio::new(Op::Flush, 0, 0)).1
}

fn errno(r: Result<(), Error>) -> i32 {
    r.expect_err("expected a failure").errno()
}

#[test]
fn fail_by_range_any_overlap_and_errno() {
    let (dev, inner, h) = fault(FaultConfig::default());
    h.add(Rule::fail(OpSet::WRITE).in_range(K4, K4));
    h.add(
        Rule::fail(OpSet::READ)
            .in_range(3 * K4, 512)
            .errno(libc::ENOSPC),
    );
    write(&*dev, 0, 1, K4).unwrap();
    assert_eq!(errno(write(&*dev, K4, 2, K4)), libc::EIO);
    assert_eq!(errno(write(&*dev, K4 - 512, 2, 1024)), libc::EIO); // overlaps the start
    assert_eq!(errno(write(&*dev, 2 * K4 - 512, 2, 1024)), libc::EIO); // overlaps the end
    write(&*dev, 2 * K4, 3, K4).unwrap(); // touches, does not overlap
                                          // A failed write is never forwarded.
    assert!(read(&*inner, K4, K4).unwrap().iter().all(|&b| b == 0));
    assert_eq!(read(&*inner, 0, K4).unwrap(), vec![1; K4 as usize]);
    let e = read(&*dev, 3 * K4 + 512, 512).unwrap(); // next to the read range
    assert!(e.iter().all(|&b| b == 0));
    let r = io(
        &*dev,
        Bio::with_buf(Op::Read, 0, Buffer::new(16 * K4 as usize)),
    )
    .1;
    assert_eq!(errno(r), libc::ENOSPC);
    // Flushes have no range: range rules never match them.
    flush(&*dev).unwrap();
    let c = h.counters();
    assert_eq!(c.failed, [1, 3, 0, 0]);
    assert_eq!(c.seen, [2, 5, 1, 0]);
    h.clear();
    write(&*dev, K4, 2, K4).unwrap();
}

#[test]
fn fail_by_count_nth_next_after() {
    let (dev, _, h) = fault(FaultConfig::default());
    let reads = |n: usize| -> Vec<bool> {
        (0..n)
            .map(|i| read(&*dev, (i as u64 % 8) * K4, K4).is_err())
            .collect()
    };
    let id = h.add(Rule::fail(OpSet::READ).nth(3));
    assert_eq!(reads(6), [false, false, true, false, false, false].to_vec());
    assert!(h.remove(id));
    h.add(Rule::fail(OpSet::READ).next(2));
    assert_eq!(reads(4), [true, true, false, false].to_vec());
    h.clear();
    h.add(Rule::fail(OpSet::READ).after(2));
    assert_eq!(reads(5), [false, false, true, true, true].to_vec());
    // Counting only counts matching I/Os: writes do not advance a read rule.
    h.clear();
    h.add(Rule::fail(OpSet::READ).nth(2));
    write(&*dev, 0, 9, K4).unwrap();
    write(&*dev, 0, 9, K4).unwrap();
    assert_eq!(reads(3), [false, true, false].to_vec());
    assert_eq!(h.counters().failed[0], 1 + 2 + 3 + 1);
}

#[test]
fn fail_flush_discard_and_write_zeroes() {
    let cfg = FaultConfig::parse("fail_flush_nth=2,fail_discard=8K+4K,errno=EROFS").unwrap();
    let (dev, _, h) = fault(cfg);
    flush(&*dev).unwrap();
    assert_eq!(errno(flush(&*dev)), libc::EROFS);
    flush(&*dev).unwrap();
    write(&*dev, 8 * 1024, 5, K4).unwrap();
    assert_eq!(
        errno(io(&*dev, Bio::new(Op::Discard, 16, 4096)).1),
        libc::EROFS
    );
    assert_eq!(
        errno(io(&*dev, Bio::new(Op::WriteZeroes, 16, 4096)).1),
        libc::EROFS
    );
    io(&*dev, Bio::new(Op::WriteZeroes, 0, 4096)).1.unwrap();
    assert_eq!(read(&*dev, 8 * 1024, K4).unwrap(), vec![5; 4096]);
    assert_eq!(h.counters().failed, [0, 0, 1, 2]);
}

fn prob_pattern(seed: u64) -> Vec<bool> {
    let cfg = FaultConfig::parse(&format!("seed={seed},fail_read_prob=0.3")).unwrap();
    let (dev, _, _) = fault(cfg);
    (0..200)
        .map(|i| read(&*dev, (i % 64) * K4, K4).is_err())
        .collect()
}

#[test]
fn same_seed_same_faults_different_seed_different() {
    let a = prob_pattern(7);
    let b = prob_pattern(7);
    let c = prob_pattern(8);
    assert_eq!(a, b);
    assert_ne!(a, c);
    let n = a.iter().filter(|&&x| x).count();
    assert!(n > 20 && n < 120, "{n} of 200 at p=0.3");
    // Probability 0 and 1 are exact.
    let (dev, _, h) = fault(FaultConfig::default());
    h.add(Rule::fail(OpSet::READ).prob(0.0));
    h.add(Rule::fail(OpSet::WRITE).prob(1.0));
    for i in 0..50 {
        read(&*dev, i * K4, K4).unwrap();
        write(&*dev, i * K4, 1, K4).unwrap_err();
    }
}

#[test]
fn latency_is_on_the_timer_thread_not_the_submitter() {
    // An hour of latency: `submit` returning at all shows the submitter did not sleep.
    let (dev, _, h) = fault(FaultConfig::default());
    h.add(Rule::delay(
        OpSet::ALL,
        Duration::from_secs(3600),
        Duration::ZERO,
    ));
    let c = Arc::new(Collect::default());
    let end: Arc<dyn EndIo> = c.clone();
    for i in 0..8u64 {
        let mut b = Bio::with_buf(Op::Write, i * 8, fill(i as u8 + 1, K4));
        b.cookie = 1000 + i;
        dev.submit(b, &end);
    }
    assert_eq!(c.len(), 0);
    assert_eq!(h.counters().delayed, 8);
    // Dropping the device makes the timer deliver what it holds.
    drop(dev);
    let mut done = c.wait_for(8);
    done.sort_by_key(|(b, _)| b.cookie);
    for (i, (b, r)) in done.into_iter().enumerate() {
        r.unwrap();
        assert_eq!(
            b.cookie,
            1000 + i as u64,
            "the submitter's cookie comes back"
        );
    }
}

#[test]
fn timer_wakes_for_an_earlier_deadline() {
    // The timer thread sleeps towards the read's deadline an hour away; the write queued
    // after it, due sooner, must wake it (a wake-up lost between its look and its sleep
    // would leave the write waiting for an hour, and this test failing at its 60 s guard).
    let (dev, _, h) = fault(FaultConfig::default());
    h.add(Rule::delay(
        OpSet::READ,
        Duration::from_secs(3600),
        Duration::ZERO,
    ));
    h.add(Rule::delay(
        OpSet::WRITE,
        Duration::from_micros(100),
        Duration::ZERO,
    ));
    let c = Arc::new(Collect::default());
    let end: Arc<dyn EndIo> = c.clone();
    dev.submit(Bio::with_buf(Op::Read, 0, Buffer::new(4096)), &end);
    for round in 0..50u64 {
        dev.submit(Bio::with_buf(Op::Write, 8, fill(round as u8, K4)), &end);
        let (b, r) = c.wait_for(1).pop().unwrap();
        r.unwrap();
        assert_eq!(b.op, Op::Write);
    }
    assert_eq!(c.len(), 0, "the read still waits for its hour");
    drop(dev);
    let (b, r) = c.wait_for(1).pop().unwrap();
    r.unwrap();
    assert_eq!(b.op, Op::Read);
    assert_eq!(h.counters().delayed, 51);
}

#[test]
fn absurd_latency_does_not_panic() {
    let (dev, _, h) = fault(FaultConfig::default());
    h.add(Rule::delay(OpSet::READ, Duration::MAX, Duration::MAX));
    h.add(Rule::delay(OpSet::READ, Duration::MAX, Duration::ZERO));
    let c = Arc::new(Collect::default());
    let end: Arc<dyn EndIo> = c.clone();
    dev.submit(Bio::with_buf(Op::Read, 0, Buffer::new(4096)), &end);
    assert_eq!(c.len(), 0);
    drop(dev);
    c.wait_for(1).pop().unwrap().1.unwrap();
}

#[test]
fn small_latency_with_jitter_completes_everything() {
    let cfg = FaultConfig::parse("seed=3,latency_us=50,jitter_us=200").unwrap();
    let (dev, _, h) = fault(cfg);
    let c = Arc::new(Collect::default());
    let end: Arc<dyn EndIo> = c.clone();
    for i in 0..64u64 {
        dev.submit(Bio::with_buf(Op::Write, i * 8, fill(i as u8, K4)), &end);
    }
    for (_, r) in c.wait_for(64) {
        r.unwrap();
    }
    for i in 0..64u64 {
        assert_eq!(read(&*dev, i * K4, K4).unwrap(), vec![i as u8; 4096]);
    }
    assert_eq!(h.counters().delayed, 128);
}

#[test]
fn stall_holds_until_release() {
    let (dev, inner, h) = fault(FaultConfig::parse("stall_write=all").unwrap());
    let c = Arc::new(Collect::default());
    let end: Arc<dyn EndIo> = c.clone();
    for i in 0..3u64 {
        dev.submit(Bio::with_buf(Op::Write, i * 8, fill(7, K4)), &end);
    }
    assert_eq!(h.stalled(), 3);
    assert_eq!(c.len(), 0);
    // Reads are not stalled, and the writes have not reached the inner device.
    assert!(read(&*dev, 0, 3 * K4).unwrap().iter().all(|&b| b == 0));
    assert!(read(&*inner, 0, 3 * K4).unwrap().iter().all(|&b| b == 0));
    h.clear();
    assert_eq!(h.release(), 3);
    for (_, r) in c.wait_for(3) {
        r.unwrap();
    }
    assert_eq!(h.stalled(), 0);
    assert_eq!(read(&*dev, 0, 3 * K4).unwrap(), vec![7; 3 * 4096]);
    assert_eq!(h.counters().stalled, 3);
}

#[test]
fn dropping_the_device_fails_stalled_ios() {
    let (dev, _, _) = fault(FaultConfig::parse("stall_read=0+4K").unwrap());
    let c = Arc::new(Collect::default());
    let end: Arc<dyn EndIo> = c.clone();
    dev.submit(Bio::with_buf(Op::Read, 0, Buffer::new(4096)), &end);
    assert_eq!(c.len(), 0);
    drop(dev);
    let (_, r) = c.wait_for(1).pop().unwrap();
    assert_eq!(errno(r), libc::ECANCELED);
}

#[test]
fn crash_loses_exactly_the_unflushed_writes() {
    let (dev, inner, h) = fault(FaultConfig::parse("volatile_cache=on").unwrap());
    let d = &*dev;
    // Durable by a flush.
    write(d, 0, 0xA1, 2 * K4).unwrap();
    write(d, 32 * K4, 0xF1, 2 * K4).unwrap();
    flush(d).unwrap();
    // Unflushed, over nothing and over durable data.
    write(d, 4 * K4, 0xB1, K4).unwrap();
    write(d, K4, 0xB2, K4).unwrap();
    // Overlapping unflushed writes: roll back to the last durable content.
    write(d, 8 * K4, 0xC1, 4 * K4).unwrap();
    write(d, 10 * K4, 0xC2, 4 * K4).unwrap();
    write(d, 9 * K4, 0xC3, K4).unwrap();
    // A FUA write on top of an unflushed one: the FUA part survives, the rest is lost.
    write(d, 16 * K4, 0xD1, 4 * K4).unwrap();
    write_fua(d, 17 * K4, 0xD2, K4).unwrap();
    // A FUA write alone survives.
    write_fua(d, 24 * K4, 0xE1, K4).unwrap();
    // Unflushed write-zeroes and discard over durable data.
    io(d, Bio::new(Op::WriteZeroes, 32 * 8, 4096)).1.unwrap();
    io(d, Bio::new(Op::Discard, 33 * 8, 4096)).1.unwrap();
    // Before the crash everything reads back as written.
    assert_eq!(read(d, K4, K4).unwrap(), vec![0xB2; 4096]);
    assert_eq!(read(d, 32 * K4, K4).unwrap(), vec![0; 4096]);

    assert_eq!(h.unflushed_writes(), 8);
    let rep = h.crash().unwrap();
    assert_eq!(rep.writes_lost, 8);
    assert_eq!(h.unflushed_writes(), 0);
    assert!(h.is_crashed());
    // Everything fails until restart, without reaching the inner device.
    assert_eq!(errno(write(d, 0, 1, K4)), libc::EIO);
    assert_eq!(errno(read(d, 0, K4).map(drop)), libc::EIO);
    h.restart();

    let expect = |off: u64, len: u64, byte: u8| {
        assert_eq!(
            read(&*inner, off, len).unwrap(),
            vec![byte; len as usize],
            "at {off}"
        );
        assert_eq!(read(d, off, len).unwrap(), vec![byte; len as usize]);
    };
    expect(0, K4, 0xA1);
    expect(K4, K4, 0xA1); // rolled back to the flushed data
    expect(4 * K4, K4, 0);
    expect(8 * K4, 6 * K4, 0);
    expect(16 * K4, K4, 0);
    expect(17 * K4, K4, 0xD2);
    expect(18 * K4, 2 * K4, 0);
    expect(24 * K4, K4, 0xE1);
    expect(32 * K4, 2 * K4, 0xF1);
    let c = h.counters();
    assert_eq!(c.crashes, 1);
    assert_eq!(c.writes_lost, 8);
    assert_eq!(c.crashed_io, 2);
}

#[test]
fn flush_covers_only_writes_acknowledged_before_it() {
    let (dev, inner, h) = fault(FaultConfig::parse("crash=1").unwrap());
    let d = &*dev;
    write(d, 0, 1, K4).unwrap();
    flush(d).unwrap();
    write(d, 0, 2, K4).unwrap();
    write(d, K4, 3, K4).unwrap();
    // A failed flush makes nothing durable.
    h.add(Rule::fail(OpSet::FLUSH).nth(1));
    assert!(flush(d).is_err());
    h.crash().unwrap();
    h.restart();
    assert_eq!(read(&*inner, 0, K4).unwrap(), vec![1; 4096]);
    assert_eq!(read(&*inner, K4, K4).unwrap(), vec![0; 4096]);
    // After the restart the device works and models the cache again.
    write(d, 0, 4, K4).unwrap();
    flush(d).unwrap();
    write(d, 0, 5, K4).unwrap();
    assert_eq!(h.crash().unwrap().writes_lost, 1);
    h.restart();
    assert_eq!(read(d, 0, K4).unwrap(), vec![4; 4096]);
}

#[test]
fn crash_fails_stalled_and_delayed_ios() {
    let (dev, _, h) = fault(FaultConfig::parse("volatile_cache=on").unwrap());
    write(&*dev, 0, 1, K4).unwrap();
    flush(&*dev).unwrap();
    h.add(Rule::stall(OpSet::WRITE).in_range(0, K4));
    h.add(Rule::delay(OpSet::WRITE, Duration::from_secs(3600), Duration::ZERO).in_range(K4, K4));
    let c = Arc::new(Collect::default());
    let end: Arc<dyn EndIo> = c.clone();
    dev.submit(Bio::with_buf(Op::Write, 0, fill(2, K4)), &end);
    dev.submit(Bio::with_buf(Op::Write, 8, fill(3, K4)), &end);
    assert_eq!(c.len(), 0);
    let rep = h.crash().unwrap();
    assert_eq!(rep.stalled_failed, 1);
    // The delayed write reached the disk but was never acknowledged: rolled back.
    assert_eq!(rep.writes_lost, 1);
    h.restart();
    h.clear();
    drop(dev); // delivers the delayed completion: it fails (pre-crash epoch)
    for (_, r) in c.wait_for(2) {
        assert_eq!(errno(r), libc::EIO);
    }
}

#[test]
fn crash_needs_the_volatile_cache() {
    let (_, _, h) = fault(FaultConfig::default());
    assert!(matches!(h.crash(), Err(Error::NotSupported(_))));
    assert!(!h.is_crashed());
}

#[test]
fn batches_are_forwarded_and_completions_routed() {
    let (dev, _, h) = fault(FaultConfig::default());
    h.add(Rule::fail(OpSet::WRITE).nth(3));
    let c = Arc::new(Collect::default());
    let end: Arc<dyn EndIo> = c.clone();
    let mut bios = (0..8u64).map(|i| {
        let mut b = Bio::with_buf(Op::Write, i * 8, fill(i as u8 + 1, K4));
        b.cookie = i;
        b
    });
    dev.submit_batch(&mut bios, &end);
    let mut done = c.wait_for(8);
    done.sort_by_key(|(b, _)| b.cookie);
    for (i, (b, r)) in done.into_iter().enumerate() {
        assert_eq!(b.cookie, i as u64);
        assert_eq!(r.is_err(), i == 2, "bio {i}");
    }
    assert_eq!(read(&*dev, 2 * K4, K4).unwrap(), vec![0; 4096]);
    assert_eq!(read(&*dev, 3 * K4, K4).unwrap(), vec![4; 4096]);
}

#[test]
fn config_parses_and_errors_name_the_option() {
    let cfg =
        FaultConfig::parse("seed=7,fail_write=0+1M,fail_read_prob=0.01,latency_us=100,errno=EIO")
            .unwrap();
    assert_eq!(cfg.seed, 7);
    assert_eq!(cfg.rules.len(), 3);
    assert_eq!(cfg.rules[0].range, Some((0, 1 << 20)));
    assert_eq!(cfg.rules[0].action, Action::Fail { errno: libc::EIO });
    assert_eq!(cfg.rules[1].when, When::Prob(0.01));
    assert_eq!(
        cfg.rules[2].action,
        Action::Delay {
            base: Duration::from_micros(100),
            jitter: Duration::ZERO
        }
    );
    let cfg: FaultConfig = "errno=ENOSPC,fail_any_after=5,crash".parse().unwrap();
    assert!(cfg.volatile_cache);
    assert_eq!(
        cfg.rules[0].action,
        Action::Fail {
            errno: libc::ENOSPC
        }
    );
    for (s, key) in [
        ("seed=x", "seed"),
        ("fail_write=12", "fail_write"),
        ("fail_write=1Q+4K", "fail_write"),
        ("fail_bogus=all", "fail_bogus"),
        ("fail_read_prob=1.5", "fail_read_prob"),
        ("fail_read_prob=nan", "fail_read_prob"),
        ("fail_read_nth=0", "fail_read_nth"),
        ("fail_read_often=3", "fail_read_often"),
        ("errno=EWHAT", "errno"),
        ("latency_us=-1", "latency_us"),
        ("stall_write=99999999999999999999T+1", "stall_write"),
        ("volatile_cache=maybe", "volatile_cache"),
        ("frobnicate=1", "frobnicate"),
    ] {
        let e = FaultConfig::parse(s).expect_err(s).to_string();
        assert!(e.contains(&format!("{key:?}")), "{s}: {e}");
    }
}

/// A small xorshift for the no-panic sweep.
struct Xs(u64);
impl Xs {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

#[test]
fn no_panic_on_any_config_or_bio() {
    let words = [
        "seed",
        "errno",
        "fail_",
        "read",
        "write",
        "flush",
        "discard",
        "any",
        "_nth",
        "_next",
        "_after",
        "_prob",
        "stall_",
        "flip_",
        "latency_us",
        "jitter_us",
        "crash",
        "=",
        ",",
        "+",
        "0",
        "1",
        "4K",
        "1M",
        "0.5",
        "all",
        "EIO",
        "-",
        "x",
        "18446744073709551615",
        "T",
        "",
    ];
    let mut x = Xs(0x1234_5678);
    for _ in 0..3000 {
        let n = (x.next() % 8) as usize;
        let s: String = (0..n)
            .map(|_| words[(x.next() % words.len() as u64) as usize])
            .collect();
        let _ = FaultConfig::parse(&s);
    }
    // Odd rules and bad bios: every bio completes, nothing panics.
    let (dev, _, h) = fault(FaultConfig::parse("volatile_cache=on,seed=1").unwrap());
    h.add(Rule::fail(OpSet::ALL).in_range(u64::MAX - 1, u64::MAX));
    h.add(Rule::fail(OpSet::READ).nth(0));
    h.add(Rule::fail(OpSet::WRITE).prob(f64::NAN));
    h.add(Rule::delay(OpSet::READ, Duration::ZERO, Duration::MAX).prob(0.0));
    h.add(Rule::fail(OpSet::DISCARD).next(u64::MAX).errno(-5));
    h.add(Rule::flip(OpSet::ALL).in_range(u64::MAX - 1, u64::MAX));
    h.add(Rule::flip(OpSet::ALL).prob(0.5));
    let c = Arc::new(Collect::default());
    let end: Arc<dyn EndIo> = c.clone();
    let ops = [Op::Read, Op::Write, Op::Flush, Op::Discard, Op::WriteZeroes];
    let mut sent = 0;
    for i in 0..300u64 {
        let op = ops[(x.next() % 5) as usize];
        let sector = match i % 4 {
            0 => u64::MAX - (x.next() % 4),
            _ => x.next() % 9000,
        };
        let len = match i % 3 {
            0 => (x.next() % 5000) as u32,
            _ => 512 * (1 + (x.next() % 16) as u32),
        };
        let mut b = Bio::new(op, sector, len);
        if x.next() & 3 != 0 && op.has_data() {
            b.buf = Some(Buffer::new(len as usize));
        }
        dev.submit(b, &end);
        sent += 1;
    }
    c.wait_for(sent);
    let _ = h.crash();
    h.restart();
    flush(&*dev).unwrap();
}

fn null_threaded() -> Arc<dyn Device> {
    Arc::new(
        "null:4M,completion=thread,memory_backed=1"
            .parse::<DeviceSpec>()
            .unwrap()
            .build(&QueueOverrides::default())
            .unwrap(),
    )
}

#[test]
fn concurrent_submitters_with_completions_on_another_thread() {
    let f = FaultDevice::new(
        null_threaded(),
        FaultConfig::parse("seed=11,fail_write_prob=0.2,stall_read=0+4K").unwrap(),
    );
    let h = f.handle();
    let dev: Arc<dyn Device> = Arc::new(f);
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            let dev = dev.clone();
            std::thread::spawn(move || {
                let c = Arc::new(Collect::default());
                let end: Arc<dyn EndIo> = c.clone();
                for i in 0..200u64 {
                    let op = if i % 2 == 0 { Op::Write } else { Op::Read };
                    let sector = 8 * (1 + t * 200 + i); // never the stalled first 4K
                    let mut b = Bio::with_buf(op, sector, fill(t as u8, K4));
                    b.cookie = (t << 32) | i;
                    dev.submit(b, &end);
                }
                let done = c.wait_for(200);
                let mut cookies: Vec<u64> = done.iter().map(|(b, _)| b.cookie).collect();
                cookies.sort_unstable();
                assert_eq!(cookies, (0..200).map(|i| (t << 32) | i).collect::<Vec<_>>());
                done.iter().filter(|(_, r)| r.is_err()).count() as u64
            })
        })
        .collect();
    let failed: u64 = threads.into_iter().map(|t| t.join().unwrap()).sum();
    let c = h.counters();
    assert_eq!(c.seen, [400, 400, 0, 0]);
    assert_eq!(c.failed, [0, failed, 0, 0]);
    assert!(failed > 0 && failed < 400);
    assert_eq!(c.stalled, 0);
}

#[test]
fn crash_waits_for_inner_completions_on_another_thread() {
    let inner = null_threaded();
    let f = FaultDevice::new(inner.clone(), FaultConfig::parse("crash=on").unwrap());
    let h = f.handle();
    let dev: Arc<dyn Device> = Arc::new(f);
    write(&*dev, 0, 1, 8 * K4).unwrap();
    flush(&*dev).unwrap();
    let c = Arc::new(Collect::default());
    let end: Arc<dyn EndIo> = c.clone();
    for i in 0..8u64 {
        dev.submit(Bio::with_buf(Op::Write, i * 8, fill(2, K4)), &end);
    }
    // Some of these may be acknowledged before the crash, some failed by it; none survives.
    let rep = h.crash().unwrap();
    assert_eq!(rep.writes_lost, 8);
    assert_eq!(c.wait_for(8).len(), 8);
    h.restart();
    assert_eq!(read(&*inner, 0, 8 * K4).unwrap(), vec![1; 8 * 4096]);
}

#[test]
fn fault_devices_stack() {
    let inner = mem("1M");
    let lower = FaultDevice::new(inner, FaultConfig::parse("fail_read_nth=2").unwrap());
    let lh = lower.handle();
    let upper = FaultDevice::new(
        Arc::new(lower),
        FaultConfig::parse("fail_write=0+4K,errno=ENOSPC").unwrap(),
    );
    let dev: Arc<dyn Device> = Arc::new(upper);
    assert_eq!(errno(write(&*dev, 0, 1, K4)), libc::ENOSPC);
    write(&*dev, K4, 2, K4).unwrap();
    let mut b = Bio::with_buf(Op::Read, 8, Buffer::new(4096));
    b.cookie = 77;
    let (b, r) = io(&*dev, b);
    r.unwrap();
    assert_eq!(b.cookie, 77);
    let (b, r) = io(&*dev, {
        let mut b = Bio::with_buf(Op::Read, 8, Buffer::new(4096));
        b.cookie = 78;
        b
    });
    assert_eq!(errno(r), libc::EIO);
    assert_eq!(b.cookie, 78);
    assert_eq!(lh.counters().seen, [2, 1, 0, 0]);
}

// A counting allocator for `steady_state_allocates_nothing`. Counting is per thread (the other
// tests of this file run on other threads at the same time).
struct Counting;

thread_local! {
    static COUNT_HERE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    /// `delayed_steady_state_allocates_nothing`'s flag (its own counter: the two tests may
    /// run at the same time).
    static COUNT_DELAYED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    /// `flip_rules_allocate_only_for_a_flipped_write`'s flag.
    static COUNT_FLIP: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}
static ALLOCS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
static DELAYED_ALLOCS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
static FLIP_ALLOCS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

fn note_alloc() {
    if COUNT_HERE.try_with(|c| c.get()).unwrap_or(false) {
        ALLOCS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
    if COUNT_DELAYED.try_with(|c| c.get()).unwrap_or(false) {
        DELAYED_ALLOCS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
    if COUNT_FLIP.try_with(|c| c.get()).unwrap_or(false) {
        FLIP_ALLOCS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
}

// SAFETY: forwards to the system allocator unchanged; only counts.
unsafe impl std::alloc::GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: std::alloc::Layout) -> *mut u8 {
        note_alloc();
        // SAFETY: the caller's contract is `GlobalAlloc::alloc`'s, passed on.
        unsafe { std::alloc::System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: std::alloc::Layout) {
        // SAFETY: `p` came from `alloc` above, i.e. from `System`, with layout `l`.
        unsafe { std::alloc::System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: std::alloc::Layout, n: usize) -> *mut u8 {
        note_alloc();
        // SAFETY: as for `dealloc`; `n` is the caller's new size.
        unsafe { std::alloc::System.realloc(p, l, n) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Gives completed bios back (a vector with room for all of them).
struct Back(Mutex<Vec<Bio>>);

impl EndIo for Back {
    fn end_io(&self, bio: Bio, _res: Result<(), Error>) {
        self.0.lock().unwrap().push(bio);
    }
}

/// A `null:64M` queue behind a plain forwarder, which hides the queue's own `submit_batch`
/// (which makes a plug per call) behind single submits, so that the count below is the
/// fault device's alone.
fn null_one_by_one() -> Arc<dyn Device> {
    let q = "null:64M"
        .parse::<DeviceSpec>()
        .unwrap()
        .build(&QueueOverrides::default())
        .unwrap();
    Arc::new(Forward::new(Arc::new(q)))
}

#[test]
fn steady_state_allocates_nothing() {
    let inner = null_one_by_one();
    let f = FaultDevice::new(
        inner,
        FaultConfig::parse("seed=5,fail_read_prob=0.1,fail_write_after=100,fail_discard=0+1M")
            .unwrap(),
    );
    let h = f.handle();
    h.add(Rule::stall(OpSet::FLUSH));
    let back = Arc::new(Back(Mutex::new(Vec::with_capacity(64))));
    let end: Arc<dyn EndIo> = back.clone();
    let mut free: Vec<Bio> = (0..32).map(|_| Bio::new(Op::Read, 0, 4096)).collect();
    let ops = [Op::Read, Op::Write, Op::Flush, Op::Discard];
    let rounds = 400;
    for round in 0..2 * rounds {
        if round == rounds {
            ALLOCS.store(0, std::sync::atomic::Ordering::Relaxed);
            COUNT_HERE.with(|c| c.set(true));
        }
        for (i, b) in free.iter_mut().enumerate() {
            b.op = ops[(i + round) % 4];
            b.sector = ((i * 7 + round * 13) % 4096) as u64 * 8;
        }
        if round % 2 == 0 {
            for b in free.drain(..) {
                f.submit(b, &end);
            }
        } else {
            f.submit_batch(&mut free.drain(..), &end);
        }
        assert_eq!(h.release(), 8);
        let mut g = back.0.lock().unwrap();
        assert_eq!(g.len(), 32, "inline completions");
        std::mem::swap(&mut *g, &mut free);
    }
    COUNT_HERE.with(|c| c.set(false));
    let allocs = ALLOCS.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(allocs, 0, "allocations in {} I/Os", rounds * 32);
    assert!(h.counters().failed[0] > 0);
}

/// Flip rules cost no allocation but the copy of a write they flip: a flipped read is
/// flipped in place, and a write rule that does not fire (out of its range, or by count)
/// forwards the submitter's buffer.
#[test]
fn flip_rules_allocate_only_for_a_flipped_write() {
    let inner = null_one_by_one();
    let f = FaultDevice::new(inner, FaultConfig::parse("seed=3,flip_read=all").unwrap());
    let h = f.handle();
    h.add(Rule::flip(OpSet::WRITE).in_range(60 << 20, K4));
    let nth = h.add(Rule::flip(OpSet::WRITE).nth(1_000_000));
    let back = Arc::new(Back(Mutex::new(Vec::with_capacity(64))));
    let end: Arc<dyn EndIo> = back.clone();
    let mut free: Vec<Bio> = (0..32)
        .map(|_| Bio::with_buf(Op::Read, 0, Buffer::new(4096)))
        .collect();
    let rounds = 200;
    let mut count = |on: bool| {
        FLIP_ALLOCS.store(0, std::sync::atomic::Ordering::Relaxed);
        COUNT_FLIP.with(|c| c.set(on));
        for round in 0..rounds {
            for (i, b) in free.iter_mut().enumerate() {
                b.op = [Op::Read, Op::Write][(i + round) % 2];
                b.sector = ((i * 7 + round * 13) % 4096) as u64 * 8;
            }
            for b in free.drain(..) {
                f.submit(b, &end);
            }
            let mut g = back.0.lock().unwrap();
            assert_eq!(g.len(), 32, "inline completions");
            std::mem::swap(&mut *g, &mut free);
        }
        COUNT_FLIP.with(|c| c.set(false));
        FLIP_ALLOCS.load(std::sync::atomic::Ordering::Relaxed)
    };
    count(false);
    assert_eq!(count(true), 0, "allocations in {} I/Os", rounds * 32);
    let c = h.counters();
    assert_eq!(c.flipped, [2 * rounds as u64 * 16, 0, 0, 0]);
    // A write that is flipped allocates its copy.
    h.remove(nth);
    h.add(Rule::flip(OpSet::WRITE).next(5));
    assert!(count(true) >= 5);
    assert_eq!(h.counters().flipped[1], 5);
}

/// Takes completions on the fault device's timer thread, wakes the submitter through a wait
/// queue, and once `measure` is set counts that thread's allocations too.
struct TimerBack {
    v: Mutex<Vec<Bio>>,
    wq: WaitQueue,
    measure: std::sync::atomic::AtomicBool,
}

impl EndIo for TimerBack {
    fn end_io(&self, bio: Bio, _res: Result<(), Error>) {
        if self.measure.load(std::sync::atomic::Ordering::Relaxed) {
            COUNT_DELAYED.with(|c| c.set(true));
        }
        self.v.lock().unwrap().push(bio);
        self.wq.wake_all(); // after the lock is dropped
    }
}

#[test]
fn delayed_steady_state_allocates_nothing() {
    // Delayed completions: the submitter queues them for the timer thread and sleeps on a wait
    // queue; the timer thread sleeps on its own wait queue until a deadline or a push. After a
    // warm-up, neither thread allocates (the timer thread counts from its first measured
    // delivery on).
    let inner = null_one_by_one();
    let f = FaultDevice::new(
        inner,
        FaultConfig::parse("seed=9,latency_us=1,jitter_us=50").unwrap(),
    );
    let h = f.handle();
    let back = Arc::new(TimerBack {
        v: Mutex::new(Vec::with_capacity(64)),
        wq: WaitQueue::new(),
        measure: std::sync::atomic::AtomicBool::new(false),
    });
    let end: Arc<dyn EndIo> = back.clone();
    let mut free: Vec<Bio> = (0..32).map(|_| Bio::new(Op::Read, 0, 4096)).collect();
    let ops = [Op::Read, Op::Write];
    let rounds = 200;
    for round in 0..2 * rounds {
        if round == rounds {
            DELAYED_ALLOCS.store(0, std::sync::atomic::Ordering::Relaxed);
            back.measure
                .store(true, std::sync::atomic::Ordering::Relaxed);
            COUNT_DELAYED.with(|c| c.set(true));
        }
        for (i, b) in free.iter_mut().enumerate() {
            b.op = ops[(i + round) % 2];
            b.sector = ((i * 7 + round * 13) % 4096) as u64 * 8;
        }
        for b in free.drain(..) {
            f.submit(b, &end);
        }
        let deadline = Instant::now() + Duration::from_secs(60);
        let back_all = back.wq.wait_for_until(
            || {
                let mut g = back.v.lock().unwrap();
                (g.len() == 32).then(|| std::mem::swap(&mut *g, &mut free))
            },
            deadline,
        );
        assert!(back_all.is_some(), "completions lost");
    }
    COUNT_DELAYED.with(|c| c.set(false));
    back.measure
        .store(false, std::sync::atomic::Ordering::Relaxed);
    let allocs = DELAYED_ALLOCS.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(allocs, 0, "allocations in {} delayed I/Os", rounds * 32);
    assert_eq!(h.counters().delayed, 2 * rounds as u64 * 32);
}

/// `fault.`-prefixed options of a device spec build a wrapped device that injects.
#[test]
fn spec_fault_options_wrap_the_device() {
    let overrides = QueueOverrides::default();
    let spec: DeviceSpec = "mem:1M,fault.seed=7,fault.fail_read=all".parse().unwrap();
    let cfg = spec.fault_config().unwrap().expect("fault options");
    assert_eq!(cfg.seed, 7);
    let dev = spec.build_device(&overrides).unwrap();
    write(&*dev, 0, 3, K4).unwrap();
    assert_eq!(errno(read(&*dev, 0, K4).map(drop)), libc::EIO);
    // A bare queue cannot carry them; a spec without them builds an unwrapped device.
    assert!(spec.build(&overrides).is_err());
    let plain: DeviceSpec = "mem:1M".parse().unwrap();
    assert!(plain.fault_config().unwrap().is_none());
    let dev = plain.build_device(&overrides).unwrap();
    write(&*dev, 0, 3, K4).unwrap();
    assert_eq!(read(&*dev, 0, K4).unwrap(), vec![3u8; K4 as usize]);
}

/// A bad fault option is refused, and the error names it.
#[test]
fn spec_bad_fault_option_is_named() {
    let overrides = QueueOverrides::default();
    for (spec, name) in [
        ("null:1M,fault.bogus=1", "fault.bogus"),
        ("mem:1M,fault.seed=x", "fault.seed"),
        (
            "mem:1M,fault.seed=1,fault.fail_read_prob=nope",
            "fault.fail_read_prob",
        ),
    ] {
        let s: DeviceSpec = spec.parse().unwrap();
        let e = s.build_device(&overrides).err().expect(spec).to_string();
        assert!(e.contains(name), "{spec}: {e}");
    }
}

#[test]
fn crash_partial_keeps_a_seeded_part_newest_wins() {
    use blk_drivers::fault::Partial;
    // Durable base 0xAA over 16 units; A (0xA1) over units 0..8, then B (0xB2) over 4..12.
    let run = |p: Partial| {
        let (dev, inner, h) = fault(FaultConfig::parse("volatile_cache=on").unwrap());
        let d = &*dev;
        write(d, 0, 0xAA, 16 * K4).unwrap();
        flush(d).unwrap();
        write(d, 0, 0xA1, 8 * K4).unwrap();
        write(d, 4 * K4, 0xB2, 8 * K4).unwrap();
        let rep = h.crash_partial(p).unwrap();
        h.restart();
        let data = read(&*inner, 0, 16 * K4).unwrap();
        let units: Vec<u8> = data
            .chunks(K4 as usize)
            .map(|u| {
                assert!(u.iter().all(|&b| b == u[0]), "a unit torn inside: {u:?}");
                u[0]
            })
            .collect();
        (rep, units)
    };
    let p = |seed, keep, tear| Partial {
        seed,
        keep,
        tear,
        unit: K4,
    };
    // Nothing kept: the plain crash.
    let (rep, u) = run(p(1, 0, 0));
    assert_eq!((rep.writes_lost, rep.writes_kept), (2, 0));
    assert_eq!(u, vec![0xAA; 16]);
    // Everything kept: what was written, the newer write on top.
    let (rep, u) = run(p(1, 1000, 0));
    assert_eq!((rep.writes_lost, rep.writes_kept), (0, 2));
    let mut want = vec![0xA1; 4];
    want.extend([0xB2; 8]);
    want.extend([0xAA; 4]);
    assert_eq!(u, want);
    // Any part: each unit holds its base or a write to it, and an older write never covers
    // a unit that the newer one reached (the newer one's undo holds A there: A or B only).
    let mut seen = std::collections::BTreeSet::new();
    for seed in 0..48 {
        let (rep, u) = run(p(seed, 400, 500));
        assert_eq!(run(p(seed, 400, 500)).1, u, "seed {seed} replays");
        for (i, &b) in u.iter().enumerate() {
            let ok: &[u8] = match i {
                0..=3 => &[0xAA, 0xA1],
                4..=7 => &[0xAA, 0xA1, 0xB2],
                8..=11 => &[0xAA, 0xB2],
                _ => &[0xAA],
            };
            assert!(ok.contains(&b), "seed {seed} unit {i} holds {b:#x}");
        }
        seen.insert((rep.writes_kept, rep.writes_torn, u));
    }
    // The seeds reach whole, torn and lost writes, and several media.
    assert!(seen.iter().any(|s| s.0 == 2) && seen.iter().any(|s| s.0 == 0 && s.1 == 0));
    assert!(seen.iter().any(|s| s.1 > 0));
    assert!(seen.len() >= 8, "{} distinct outcomes", seen.len());
}
