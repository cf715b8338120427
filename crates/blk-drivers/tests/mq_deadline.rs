//! mq-deadline with a manual clock: deadline order once requests expire, no write starvation
//! past `writes_starved`, batches of `fifo_batch`, priority classes and aging, merges (sectors,
//! data and status of every merged bio), and both lock designs under threads.
// A plain threaded test or benchmark, never a loom model: its own harness (std locks, atomics,
// condition variables, baselines) is not what a model must explore, so it may use std::sync.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]
#![cfg(not(blkq_loom))]

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use blk::sched::{Deadline, DeadlineTunables, LockMode, ManualClock};
use blk::{
    Bio, BioFlags, Buffer, EndIo, Error, IoPrio, Op, Plug, Queue, QueueConfig, RequestQueue,
};
use blk_drivers::backend::mem::MemBackend;
use blk_drivers::exec_on_backend;
use testkit::Collect;

/// One dispatched request: the sectors of its chain's bios, in chain order.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Seen {
    op: Op,
    prio: IoPrio,
    sectors: Vec<u64>,
}

#[derive(Default)]
struct GateInner {
    /// Requests the driver takes before the scheduler must hold the rest.
    room: AtomicUsize,
    seen: Mutex<Vec<Seen>>,
    memory: Option<MemBackend>,
    max_merge: u32,
    /// Fail every request whose chain covers this sector.
    fail_sector: Option<u64>,
}

/// A test driver: a budget of requests ([`blk::Driver::can_queue`]), a log of what it was
/// given, optional memory, inline completion.
#[derive(Clone)]
struct Gate(Arc<GateInner>);

impl blk::Driver for Gate {
    fn queue_rq(&self, q: &RequestQueue, mut r: blk::RequestToken) {
        let _ = self
            .0
            .room
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
        let mut seen = Seen {
            op: Op::Read,
            prio: IoPrio::Be,
            sectors: vec![],
        };
        let mut fail = false;
        let mut res = q.for_each_bio(&mut r, |b| {
            seen.op = b.op;
            seen.prio = b.prio;
            seen.sectors.push(b.sector);
            fail |= Some(b.sector) == self.0.fail_sector;
            match &self.0.memory {
                Some(m) => exec_on_backend(m, b),
                None => Ok(()),
            }
        });
        if fail {
            res = Err(Error::Io(std::io::Error::from_raw_os_error(libc::EIO)));
        }
        self.0.seen.lock().unwrap().push(seen);
        q.complete(r, res);
    }
    fn describe(&self) -> String {
        "gate".into()
    }
    fn max_merge(&self) -> u32 {
        self.0.max_merge
    }
    fn can_queue(&self) -> usize {
        self.0.room.load(Ordering::Relaxed)
    }
}

struct Rig {
    q: Queue,
    gate: Gate,
    clock: Arc<ManualClock>,
    tun: Arc<DeadlineTunables>,
    done: Arc<Collect>,
    end: Arc<dyn EndIo>,
}

impl Rig {
    fn new(mode: LockMode, room: usize, memory: bool, max_merge: u32) -> Rig {
        Self::with(mode, room, memory, max_merge, None, 1 << 20)
    }

    fn with(
        mode: LockMode,
        room: usize,
        memory: bool,
        max_merge: u32,
        fail_sector: Option<u64>,
        max_io: u32,
    ) -> Rig {
        let gate = Gate(Arc::new(GateInner {
            room: AtomicUsize::new(room),
            memory: memory.then(|| MemBackend::new(1 << 20)),
            max_merge,
            fail_sector,
            ..Default::default()
        }));
        let clock = Arc::new(ManualClock::new(1_000_000_000));
        let tun = Arc::new(DeadlineTunables::default());
        let sched = Deadline::new(mode)
            .with_clock(clock.clone())
            .with_tunables(tun.clone());
        let mut cfg = QueueConfig::new(1 << 20);
        cfg.queue_depth = 64;
        cfg.limits.max_io_bytes = max_io;
        let q = Queue::with_scheduler(cfg, Box::new(gate.clone()), Some(Box::new(sched))).unwrap();
        let done = Arc::new(Collect::default());
        let end: Arc<dyn EndIo> = done.clone();
        Rig {
            q,
            gate,
            clock,
            tun,
            done,
            end,
        }
    }

    fn deadline(&self) -> &Deadline {
        common::deadline(&self.q)
    }

    /// Submits `bios` under one plug (inserted together, then a dispatch round).
    fn submit(&self, bios: impl IntoIterator<Item = Bio>) {
        let mut plug = Plug::new(64);
        for b in bios {
            self.q.submit_plugged(&mut plug, b, &self.end);
        }
        self.q.flush_plug(&mut plug);
    }

    /// Lets the driver take `n` more requests, one dispatch round at a time, and returns what
    /// it was given.
    fn step(&self, n: usize) -> Vec<Seen> {
        let before = self.gate.0.seen.lock().unwrap().len();
        for _ in 0..n {
            self.gate.0.room.store(1, Ordering::Relaxed);
            self.q.core().run_queue();
        }
        self.gate.0.room.store(0, Ordering::Relaxed);
        // The ordering tests expect every bio to be valid and to succeed.
        for (b, res) in self.done.lock().iter() {
            assert!(res.is_ok(), "{b:?}: {res:?}");
        }
        self.gate.0.seen.lock().unwrap()[before..].to_vec()
    }

    fn first_sectors(seen: &[Seen]) -> Vec<u64> {
        seen.iter().map(|s| s.sectors[0]).collect()
    }
}

fn bio(op: Op, sector: u64, prio: IoPrio) -> Bio {
    let mut b = Bio::new(op, sector, 4096);
    b.prio = prio;
    b
}

fn reads(sectors: &[u64]) -> Vec<Bio> {
    sectors
        .iter()
        .map(|&s| bio(Op::Read, s, IoPrio::Be))
        .collect()
}

const MODES: [LockMode; 2] = [LockMode::Locked, LockMode::Serialized];

#[test]
fn sector_order_until_requests_expire_then_fifo_order() {
    for mode in MODES {
        // Not expired: one ascending sweep.
        let r = Rig::new(mode, 0, false, 1);
        r.tun.set_fifo_batch(1);
        r.tun.set_read_expire(Duration::from_millis(100));
        r.submit(reads(&[800, 400, 0, 1200]));
        assert_eq!(Rig::first_sectors(&r.step(4)), [0, 400, 800, 1200]);

        // All expired: FIFO (insertion) order.
        let r = Rig::new(mode, 0, false, 1);
        r.tun.set_fifo_batch(1);
        r.tun.set_read_expire(Duration::from_millis(100));
        r.submit(reads(&[800, 400, 0, 1200]));
        r.clock.advance(Duration::from_millis(101));
        assert_eq!(Rig::first_sectors(&r.step(4)), [800, 400, 0, 1200]);

        // The two old ones expired, the two new ones not: the expired go first, then the
        // sweep goes on upwards from where the last one ended, then wraps.
        let r = Rig::new(mode, 0, false, 1);
        r.tun.set_fifo_batch(1);
        r.tun.set_read_expire(Duration::from_millis(100));
        r.submit(reads(&[800, 400]));
        r.clock.advance(Duration::from_millis(60));
        r.submit(reads(&[0, 1200]));
        r.clock.advance(Duration::from_millis(60));
        assert_eq!(Rig::first_sectors(&r.step(4)), [800, 400, 1200, 0]);
        let st = r.deadline().stats();
        assert_eq!(st.prio[1].dispatched, 4);
        assert_eq!(st.prio[1].completed, 4);
        assert_eq!(st.prio[1].queued, [0, 0]);
    }
}

#[test]
fn writes_are_not_starved_past_writes_starved() {
    for mode in MODES {
        for starved in [0u32, 1, 2, 3] {
            let r = Rig::new(mode, 0, false, 1);
            r.tun.set_fifo_batch(1);
            r.tun.set_writes_starved(starved);
            let mut bios = reads(&(0..12).map(|i| i * 16).collect::<Vec<_>>());
            bios.extend((0..3).map(|i| bio(Op::Write, 1000 + i * 16, IoPrio::Be)));
            r.submit(bios);
            let seen = r.step(15);
            let dirs: String = seen
                .iter()
                .map(|s| if s.op == Op::Read { 'R' } else { 'W' })
                .collect();
            // One request per batch: a read batch while writes wait raises `starved`; at
            // `writes_starved` a write batch goes instead.
            let (mut r_left, mut w_left, mut st) = (12, 3, 0u32);
            let mut expect = String::new();
            while r_left + w_left > 0 {
                if r_left > 0 && !(w_left > 0 && st >= starved) {
                    st += u32::from(w_left > 0);
                    r_left -= 1;
                    expect.push('R');
                } else {
                    st = 0;
                    w_left -= 1;
                    expect.push('W');
                }
            }
            // Never more than `writes_starved` reads in a row while a write waits.
            let longest = expect[..expect.rfind('W').unwrap()]
                .split('W')
                .map(str::len)
                .max()
                .unwrap();
            assert!(longest <= starved as usize);
            assert_eq!(dirs, expect, "{mode:?} writes_starved={starved}");
        }
    }
}

#[test]
fn batches_run_in_sector_order_up_to_fifo_batch() {
    for mode in MODES {
        // All expired. A batch starts at the FIFO's head and sweeps up for fifo_batch
        // requests; the next batch starts at the (new) FIFO head.
        let order = |fifo_batch: u32| {
            let r = Rig::new(mode, 0, false, 1);
            r.tun.set_fifo_batch(fifo_batch);
            r.tun.set_read_expire(Duration::from_millis(1));
            r.submit(reads(&[0, 1000, 16, 32, 48, 64]));
            r.clock.advance(Duration::from_millis(2));
            Rig::first_sectors(&r.step(6))
        };
        assert_eq!(order(3), [0, 16, 32, 1000, 48, 64]);
        assert_eq!(order(16), [0, 16, 32, 48, 64, 1000]);
        assert_eq!(order(1), [0, 1000, 16, 32, 48, 64]);
    }
}

#[test]
fn priority_classes_and_aging() {
    for mode in MODES {
        let r = Rig::new(mode, 0, false, 1);
        r.submit([
            bio(Op::Read, 0, IoPrio::Be),
            bio(Op::Read, 16, IoPrio::Idle),
            bio(Op::Read, 32, IoPrio::Rt),
        ]);
        let seen = r.step(3);
        let prios: Vec<_> = seen.iter().map(|s| s.prio).collect();
        assert_eq!(prios, [IoPrio::Rt, IoPrio::Be, IoPrio::Idle]);

        // Aging: an IDLE request that has waited prio_aging_expire goes before RT ones.
        let r = Rig::new(mode, 0, false, 1);
        r.tun.set_prio_aging_expire(Duration::from_secs(1));
        r.submit([bio(Op::Read, 1500, IoPrio::Idle)]);
        r.clock.advance(Duration::from_millis(500));
        r.submit((0..4).map(|i| bio(Op::Read, i * 16, IoPrio::Rt)));
        let seen = r.step(2);
        assert!(seen.iter().all(|s| s.prio == IoPrio::Rt), "{seen:?}");
        r.clock.advance(Duration::from_millis(600));
        r.submit([bio(Op::Read, 1800, IoPrio::Be)]);
        // The IDLE request has waited 1.1 s: it goes before the RT ones.
        let seen = r.step(1);
        assert_eq!(seen[0].prio, IoPrio::Idle, "{:?}", r.deadline().stats());
        // Now the BE one waits 1.1 s too.
        r.clock.advance(Duration::from_millis(1100));
        let seen = r.step(3);
        assert_eq!(
            seen.iter().map(|s| s.prio).collect::<Vec<_>>(),
            [IoPrio::Be, IoPrio::Rt, IoPrio::Rt]
        );
        let st = r.deadline().stats();
        assert_eq!(st.prio[2].aged, 1);
        assert_eq!(st.prio[1].aged, 1);
        assert_eq!(st.prio[0].aged, 0);
    }
}

/// The byte a test writes at byte `i` of sector `s`.
fn pattern(s: u64, i: usize) -> u8 {
    (s.wrapping_mul(31).wrapping_add(i as u64 * 7) >> 1) as u8
}

fn wbio(sector: u64, len: usize, flags: BioFlags) -> Bio {
    let mut buf = Buffer::new(len);
    for (i, x) in buf.as_mut_slice().iter_mut().enumerate() {
        *x = pattern(sector + (i as u64 >> 9), i & 511);
    }
    let mut b = Bio::with_buf(Op::Write, sector, buf);
    b.flags = flags;
    b
}

fn rbio(sector: u64, len: usize) -> Bio {
    let mut b = Bio::with_buf(Op::Read, sector, Buffer::new(len));
    if let Some(buf) = b.buf.as_mut() {
        buf.as_mut_slice().fill(0xEE);
    }
    b
}

fn check(bio: &Bio) {
    let buf = bio.buf.as_ref().unwrap();
    for (i, &x) in buf.as_slice().iter().enumerate() {
        let s = bio.sector + (i as u64 >> 9);
        assert_eq!(x, pattern(s, i & 511), "sector {s} byte {}", i & 511);
    }
}

#[test]
fn merges_build_the_right_chains_and_every_bio_completes_with_its_data() {
    for mode in MODES {
        for front in [true, false] {
            // max_io 16K: a chain holds at most 4 bios of 4K.
            let r = Rig::with(mode, usize::MAX, true, u32::MAX, None, 16 << 10);
            r.tun.set_front_merges(front);
            let k4 = 4096;
            r.submit([
                // back merges
                wbio(0, k4, BioFlags::NONE),
                wbio(8, k4, BioFlags::NONE),
                wbio(16, k4, BioFlags::NONE),
                // front merge (92 ends at 100)
                wbio(100, k4, BioFlags::NONE),
                wbio(92, k4, BioFlags::NONE),
                // a bio bridging two queued requests: 208 back-merges into 200, then 216
                // joins (request-request merge)
                wbio(200, k4, BioFlags::NONE),
                wbio(216, k4, BioFlags::NONE),
                wbio(208, k4, BioFlags::NONE),
                // different flags: no merge
                wbio(300, k4, BioFlags::FUA),
                wbio(308, k4, BioFlags::NONE),
                // the size limit: 4 bios, then a new request
                wbio(400, k4, BioFlags::NONE),
                wbio(408, k4, BioFlags::NONE),
                wbio(416, k4, BioFlags::NONE),
                wbio(424, k4, BioFlags::NONE),
                wbio(432, k4, BioFlags::NONE),
                // a 1K bio between two 4K ones: sizes may differ
                wbio(500, k4, BioFlags::NONE),
                wbio(508, 1024, BioFlags::NONE),
                wbio(510, k4, BioFlags::NONE),
            ]);
            let mut chains: Vec<Vec<u64>> = r
                .gate
                .0
                .seen
                .lock()
                .unwrap()
                .iter()
                .map(|s| s.sectors.clone())
                .collect();
            chains.sort();
            let mut expect: Vec<Vec<u64>> = vec![
                vec![0, 8, 16],
                vec![200, 208, 216],
                vec![300],
                vec![308],
                vec![400, 408, 416, 424],
                vec![432],
                vec![500, 508, 510],
            ];
            if front {
                expect.push(vec![92, 100]);
            } else {
                expect.push(vec![92]);
                expect.push(vec![100]);
            }
            expect.sort();
            assert_eq!(chains, expect, "{mode:?} front_merges={front}");
            let done = r.done.take_all();
            assert_eq!(done.len(), 18);
            assert!(done.iter().all(|(_, res)| res.is_ok()));
            let merged = 18 - expect.len() as u64;
            let st = r.deadline().stats();
            assert_eq!(st.prio[1].merged, merged);
            assert_eq!(st.prio[1].inserted, 18);
            assert_eq!(st.prio[1].dispatched, expect.len() as u64);
            assert_eq!(st.prio[1].completed, 18);
            assert_eq!(r.q.stats().merges, [0, merged]);
            assert_eq!(r.q.stats().ios, [0, 18]);
            assert_eq!(r.q.stats().in_flight, [0, 0]);

            // Read everything back, merged the same way, and check each bio's bytes.
            let sectors = [
                0u64, 8, 16, 92, 100, 200, 208, 216, 300, 308, 400, 408, 416, 424, 432, 500, 510,
            ];
            let mut rb: Vec<Bio> = sectors.iter().map(|&s| rbio(s, k4)).collect();
            rb.push(rbio(508, 1024));
            r.submit(rb);
            let done = r.done.take_all();
            assert_eq!(done.len(), 18);
            for (b, res) in &done {
                assert!(res.is_ok(), "{b:?}: {res:?}");
                check(b);
            }
            assert!(r.q.stats().merges[0] > 0);
        }
    }
}

#[test]
fn a_failed_chain_fails_every_merged_bio() {
    for mode in MODES {
        let r = Rig::with(mode, usize::MAX, true, u32::MAX, Some(8), 1 << 20);
        r.submit([
            wbio(0, 4096, BioFlags::NONE),
            wbio(8, 4096, BioFlags::NONE),
            wbio(16, 4096, BioFlags::NONE),
            wbio(64, 4096, BioFlags::NONE),
        ]);
        let done = r.done.take_all();
        assert_eq!(done.len(), 4);
        for (b, res) in &done {
            if b.sector < 64 {
                let e = res.as_ref().expect_err("merged with the failing bio");
                assert_eq!(e.errno(), libc::EIO, "{b:?}");
            } else {
                assert!(res.is_ok());
            }
        }
        // In chain order: 0, 8, 16.
        let order: Vec<u64> = done
            .iter()
            .filter(|(b, _)| b.sector < 64)
            .map(|(b, _)| b.sector)
            .collect();
        assert_eq!(order, [0, 8, 16]);
        assert_eq!(r.q.stats().errors, 3);
    }
}

#[test]
fn a_driver_that_runs_one_bio_per_request_gets_no_merges() {
    let r = Rig::new(LockMode::Serialized, usize::MAX, false, 1);
    r.submit(reads(&[0, 8, 16, 24]));
    let seen = r.gate.0.seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 4);
    assert!(seen.iter().all(|s| s.sectors.len() == 1));
    assert_eq!(r.deadline().stats().prio[1].merged, 0);
}

#[test]
fn flushes_go_first() {
    let r = Rig::new(LockMode::Locked, 0, false, 1);
    r.submit(reads(&[0, 16]));
    r.submit([Bio::new(Op::Flush, 0, 0)]);
    let seen = r.step(3);
    assert_eq!(
        seen.iter().map(|s| s.op).collect::<Vec<_>>(),
        [Op::Flush, Op::Read, Op::Read]
    );
}

#[test]
fn unplugged_submit_goes_through_the_scheduler() {
    let r = Rig::new(LockMode::Serialized, 0, false, 1);
    for s in [48u64, 32, 16] {
        r.q.submit(bio(Op::Read, s, IoPrio::Be), &r.end);
    }
    assert!(r.gate.0.seen.lock().unwrap().is_empty());
    assert_eq!(r.deadline().stats().prio[1].queued, [3, 0]);
    assert_eq!(Rig::first_sectors(&r.step(3)), [16, 32, 48]);
}

/// Threads submitting through both lock designs (switched while they run), with merges and
/// a completion thread: every bio completes, and the counters add up.
#[test]
fn threads_in_both_lock_designs_complete_everything() {
    for mode in MODES {
        let q = common::deadline_queue(
            "null:64M,sched=mq-deadline,completion=thread,hw_queue_depth=32",
            mode,
        );
        let total = Arc::new(AtomicUsize::new(0));
        let hs: Vec<_> = (0..4u64)
            .map(|t| {
                let (q, total) = (q.clone(), total.clone());
                std::thread::spawn(move || {
                    let done = Arc::new(Collect::default());
                    let end: Arc<dyn EndIo> = done.clone();
                    let mut plug = Plug::new(16);
                    let mut n = 0;
                    for round in 0..200u64 {
                        for i in 0..8u64 {
                            // Sequential within a round (merges), a region per thread.
                            let s = (t << 14) + (round * 8 + i) * 8;
                            let op = if round % 3 == 0 { Op::Write } else { Op::Read };
                            q.submit_plugged(&mut plug, Bio::new(op, s, 4096), &end);
                            n += 1;
                        }
                        q.flush_plug(&mut plug);
                    }
                    let all = done.wait_for(n); // fails the test if requests are lost
                    assert!(all.iter().all(|(_, r)| r.is_ok()));
                    total.fetch_add(n, Ordering::Relaxed);
                })
            })
            .collect();
        let d = common::deadline(&q);
        for i in 0..20 {
            std::thread::sleep(Duration::from_millis(1));
            d.set_lock_mode(if i % 2 == 0 { LockMode::Locked } else { mode });
        }
        d.set_lock_mode(mode);
        for h in hs {
            h.join().unwrap();
        }
        let n = total.load(Ordering::Relaxed) as u64;
        let st = d.stats();
        let p = st.prio[1];
        assert_eq!(p.inserted, n);
        assert_eq!(p.completed, n);
        assert_eq!(p.dispatched + p.merged, n);
        assert_eq!(p.queued, [0, 0]);
        assert_eq!(st.in_buckets, 0);
        assert!(p.merged > 0);
        assert!(st.lock.attempts > 0);
        let ds = q.stats();
        assert_eq!(ds.merges[0] + ds.merges[1], p.merged);
        assert_eq!(ds.in_flight, [0, 0]);
    }
}
