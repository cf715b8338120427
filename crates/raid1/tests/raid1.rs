//! The `Raid1` device over `mem` legs and a fake failing leg: mirrored writes, degradation
//! without losing acknowledged writes, read-error repair, read balancing, leg management.
// A plain threaded test or benchmark, never a loom model: its own harness (std locks, atomics,
// condition variables, baselines) is not what a model must explore, so it may use std::sync.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]
#![cfg(not(blkq_loom))]

mod common;
use common::*;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use blk::{Bio, BioFlags, Buffer, Device, EndIo, Error, Op, SECTOR_SHIFT};
use raid1::barrier::BarrierMode;
use raid1::superblock::{Superblock, SB_OFFSET, SB_SIZE};
use raid1::{Raid1, Raid1Config, SyncAction};
use testkit::{Forward, Hook};

/// One bio, submitted and waited for (the suite's deadline fails the test if it hangs).
use testkit::io::submit_wait as io;

fn write(dev: &dyn Device, sector: u64, data: &[u8]) -> Result<(), Error> {
    let mut b = Buffer::new(data.len());
    b.as_mut_slice().copy_from_slice(data);
    io(dev, Bio::with_buf(Op::Write, sector, b)).1
}

fn read(dev: &dyn Device, sector: u64, len: usize) -> Result<Vec<u8>, Error> {
    let (b, r) = io(dev, Bio::with_buf(Op::Read, sector, Buffer::new(len)));
    r.map(|()| b.buf.unwrap().as_slice().to_vec())
}

/// A leg that fails chosen ranges (in leg sectors) of reads or writes, or everything: the
/// hook of a [`Forward`] leg ([`Flaky::new`]).
#[derive(Default)]
struct Flaky {
    bad_reads: Mutex<Vec<(u64, u64)>>,
    dead: AtomicBool,
}

impl Flaky {
    fn new(inner: Arc<dyn Device>) -> Arc<Forward<Self>> {
        Arc::new(Forward::with_hook(inner, Self::default()))
    }
}

impl Hook for Flaky {
    fn submit(&self, inner: &dyn Device, bio: Bio, end: &Arc<dyn EndIo>) {
        let bad_read = bio.op == Op::Read
            && self
                .bad_reads
                .lock()
                .unwrap()
                .iter()
                .any(|&(s, e)| bio.sector < e && bio.end_sector() > s);
        if self.dead.load(Ordering::SeqCst) || bad_read {
            end.end_io(bio, Err(Error::Io(std::io::Error::other("injected"))));
        } else {
            inner.submit(bio, end);
        }
    }
}

fn cfg(mode: BarrierMode) -> Raid1Config {
    Raid1Config {
        barrier: mode,
        bitmap_chunk: 1 << 20,
        bitmap_quiet: Duration::from_millis(10),
        tick: Duration::from_millis(20),
        depth: 16,
        ..Raid1Config::default()
    }
}

#[test]
fn mirror_writes_land_on_every_leg_in_both_barrier_modes() {
    for mode in [BarrierMode::Lockless, BarrierMode::Locked] {
        let legs = [mem("16M"), mem("16M")];
        let r = Raid1::create(legs.to_vec(), cfg(mode)).unwrap();
        let doff = r.data_offset() >> SECTOR_SHIFT;
        assert!(r.limits().capacity > 8 << 20);
        let data = pattern(7, 64 << 10);
        write(&r, 100, &data).unwrap();
        assert_eq!(read(&r, 100, data.len()).unwrap(), data);
        for leg in &legs {
            assert_eq!(read(leg.as_ref(), doff + 100, data.len()).unwrap(), data);
        }
        // FUA write and FLUSH go through.
        let mut b = Buffer::new(4096);
        b.as_mut_slice().fill(9);
        let mut bio = Bio::with_buf(Op::Write, 8, b);
        bio.flags = BioFlags::FUA;
        io(&r, bio).1.unwrap();
        io(&r, Bio::new(Op::Flush, 0, 0)).1.unwrap();
        for leg in &legs {
            assert!(read(leg.as_ref(), doff + 8, 4096)
                .unwrap()
                .iter()
                .all(|&x| x == 9));
        }
        // Bad bios are refused, never panic.
        assert!(io(&r, Bio::with_buf(Op::Write, 1, Buffer::new(100)))
            .1
            .is_err());
        assert!(io(&r, Bio::new(Op::Read, 0, 4096)).1.is_err());
        assert!(write(&r, r.limits().capacity >> SECTOR_SHIFT, &[0; 4096]).is_err());
        // The write's chunk is dirty in the bitmap until quiet, completed and flushed.
        assert!(!r.is_degraded());
        // Superblocks are on every leg, same array, own leg UUID.
        let sbs: Vec<Superblock> = legs
            .iter()
            .map(|l| {
                Superblock::decode(&read(l.as_ref(), SB_OFFSET >> SECTOR_SHIFT, SB_SIZE).unwrap())
                    .unwrap()
            })
            .collect();
        assert_eq!(sbs[0].array_uuid, sbs[1].array_uuid);
        assert_ne!(sbs[0].leg_uuid, sbs[1].leg_uuid);
        assert_eq!(sbs[0].data_offset, r.data_offset());
    }
}

#[test]
fn failed_leg_degrades_without_losing_acknowledged_writes() {
    let bad = Flaky::new(mem("16M"));
    let good = mem("16M");
    let r = Raid1::create(
        vec![bad.clone() as Arc<dyn Device>, good.clone()],
        cfg(BarrierMode::Lockless),
    )
    .unwrap();
    let a = pattern(1, 8192);
    write(&r, 0, &a).unwrap();
    bad.hook().dead.store(true, Ordering::SeqCst);
    let b = pattern(2, 8192);
    let sector_b = 3 << 11; // 3 MiB: chunk 3
    write(&r, sector_b, &b).unwrap();
    let st = r.leg_status(0).unwrap();
    assert!(st.faulty);
    assert!(r.is_degraded());
    assert_eq!(read(&r, 0, a.len()).unwrap(), a);
    assert_eq!(read(&r, sector_b, b.len()).unwrap(), b);
    // The last in-sync leg is never failed: its errors reach the caller.
    assert!(r.fail_leg(1).is_err());
    // While degraded the written chunk stays dirty, so a returning leg copies it.
    std::thread::sleep(Duration::from_millis(100));
    let bm = r.bitmap().unwrap();
    assert!(bm.is_dirty(3));
    // The survivor's superblock records the failure (eventually written by raid1d).
    r.sync_superblocks().unwrap();
    let sb = Superblock::decode(&read(good.as_ref(), SB_OFFSET >> SECTOR_SHIFT, SB_SIZE).unwrap())
        .unwrap();
    assert!(sb.legs[0].faulty);
    assert_eq!(sb.array_state, raid1::superblock::ArrayState::Degraded);
}

#[test]
fn read_errors_retry_another_leg_and_are_repaired() {
    let under = mem("16M");
    let flaky = Flaky::new(under.clone());
    let r = Raid1::create(
        vec![flaky.clone() as Arc<dyn Device>, mem("16M")],
        cfg(BarrierMode::Lockless),
    )
    .unwrap();
    let doff = r.data_offset() >> SECTOR_SHIFT;
    let data = pattern(3, 16384);
    write(&r, 64, &data).unwrap();
    // Corrupt leg 0 underneath and make its reads of the range fail (a media error).
    write(under.as_ref(), doff + 64, &vec![0xEE; data.len()]).unwrap();
    flaky
        .hook()
        .bad_reads
        .lock()
        .unwrap()
        .push((doff + 64, doff + 64 + 32));
    // With no requests in flight, leg 0 is chosen first.
    assert_eq!(read(&r, 64, data.len()).unwrap(), data);
    // The range was rewritten on leg 0 from the good leg.
    assert_eq!(read(under.as_ref(), doff + 64, data.len()).unwrap(), data);
    let st = r.leg_status(0).unwrap();
    assert_eq!(st.read_errors, 1);
    assert!(!st.faulty);
}

#[test]
fn read_error_limit_fails_the_leg_and_total_failure_is_an_error() {
    let f0 = Flaky::new(mem("16M"));
    let f1 = Flaky::new(mem("16M"));
    let mut c = cfg(BarrierMode::Locked);
    c.read_error_limit = 0;
    let r = Raid1::create(vec![f0.clone() as Arc<dyn Device>, f1.clone()], c).unwrap();
    write(&r, 0, &pattern(4, 4096)).unwrap();
    f0.hook().bad_reads.lock().unwrap().push((0, u64::MAX));
    assert_eq!(read(&r, 0, 4096).unwrap(), pattern(4, 4096));
    assert!(r.leg_status(0).unwrap().faulty);
    f1.hook().bad_reads.lock().unwrap().push((0, u64::MAX));
    assert!(read(&r, 0, 4096).is_err());
}

#[test]
fn write_mostly_leg_is_read_only_when_nothing_else_can() {
    let f0 = Flaky::new(mem("16M"));
    let r = Raid1::create(
        vec![f0.clone() as Arc<dyn Device>, mem("16M")],
        cfg(BarrierMode::Lockless),
    )
    .unwrap();
    write(&r, 0, &pattern(5, 4096)).unwrap();
    r.set_write_mostly(0, true).unwrap();
    f0.hook().bad_reads.lock().unwrap().push((0, u64::MAX));
    for _ in 0..4 {
        assert_eq!(read(&r, 0, 4096).unwrap(), pattern(5, 4096));
    }
    assert_eq!(r.leg_status(0).unwrap().read_errors, 0);
}

#[test]
fn legs_can_be_failed_removed_and_added() {
    let r = Raid1::create(vec![mem("16M"), mem("16M")], cfg(BarrierMode::Lockless)).unwrap();
    let doff = r.data_offset() >> SECTOR_SHIFT;
    assert!(r.remove_leg(1).is_err()); // in sync
    r.fail_leg(1).unwrap();
    r.remove_leg(1).unwrap();
    assert!(!r.leg_status(1).unwrap().present);
    let fresh = mem("16M");
    let slot = r.add_leg(fresh.clone()).unwrap();
    let st = r.leg_status(slot).unwrap();
    assert!(st.present && !st.in_sync && !st.faulty);
    // New writes reach the recovering leg; reads do not use it yet.
    let d = pattern(6, 4096);
    write(&r, 16, &d).unwrap();
    assert_eq!(read(fresh.as_ref(), doff + 16, 4096).unwrap(), d);
    assert_eq!(read(&r, 16, 4096).unwrap(), d);
    r.set_in_sync(slot).unwrap();
    assert!(!r.is_degraded());
}

/// The mirror's capabilities: no zero-copy path (its I/O reaches the legs as bios), and a
/// costly allocation map exactly while a leg's is (a remote leg: its extents are asked of
/// the leg the read balancing picks), following the legs as they leave and return.
#[test]
fn the_mirror_declares_a_slow_map_while_a_leg_has_one() {
    /// A leg that says its map is slow (a stand-in for a remote leg).
    struct SlowMap;
    impl Hook for SlowMap {
        fn transparent(&self) -> bool {
            true
        }
        fn caps(&self, inner: &dyn Device) -> blk::Caps {
            blk::Caps {
                slow_extents: true,
                ..inner.caps()
            }
        }
    }
    let local = Raid1::create(vec![mem("16M"), mem("16M")], cfg(BarrierMode::Lockless)).unwrap();
    assert!(mem("16M").caps().splice, "mem legs splice");
    assert_eq!(local.caps(), blk::Caps::default());
    let slow: Arc<dyn Device> = Arc::new(Forward::with_hook(mem("16M"), SlowMap));
    let r = Raid1::create(vec![mem("16M"), slow], cfg(BarrierMode::Lockless)).unwrap();
    let caps = r.caps();
    assert!(
        caps.slow_extents && !caps.splice && !caps.recv_home,
        "{caps:?}"
    );
    r.fail_leg(1).unwrap();
    r.remove_leg(1).unwrap();
    assert!(!r.caps().slow_extents, "the slow leg is gone");
    let back: Arc<dyn Device> = Arc::new(Forward::with_hook(mem("16M"), SlowMap));
    r.add_leg(back).unwrap();
    assert!(r.caps().slow_extents, "a slow leg came back");
}

#[test]
fn concurrent_writers_and_readers() {
    let r =
        Arc::new(Raid1::create(vec![mem("16M"), mem("16M")], cfg(BarrierMode::Lockless)).unwrap());
    let ts: Vec<_> = (0..4u64)
        .map(|t| {
            let r = r.clone();
            std::thread::spawn(move || {
                for n in 0..50u64 {
                    let sector = (t * 50 + n) * 8;
                    let d = pattern((t * 50 + n) as u8, 4096);
                    write(r.as_ref(), sector, &d).unwrap();
                    assert_eq!(read(r.as_ref(), sector, 4096).unwrap(), d);
                }
            })
        })
        .collect();
    for t in ts {
        t.join().unwrap();
    }
}

#[test]
fn arrays_reassemble_from_their_superblocks() {
    let l0 = Flaky::new(mem("16M"));
    let l1 = mem("16M");
    let d = pattern(8, 8192);
    {
        let r = Raid1::create(
            vec![l0.clone() as Arc<dyn Device>, l1.clone()],
            cfg(BarrierMode::Lockless),
        )
        .unwrap();
        write(&r, 40, &d).unwrap();
    }
    // Clean stop: both legs current, any order.
    {
        let r = Raid1::assemble(
            vec![l1.clone(), l0.clone() as Arc<dyn Device>],
            cfg(BarrierMode::Locked),
        )
        .unwrap();
        assert!(!r.is_degraded());
        assert_eq!(read(&r, 40, d.len()).unwrap(), d);
        // Leg 0 fails while assembled: the survivor's superblock records it.
        l0.hook().dead.store(true, Ordering::SeqCst);
        write(&r, 40, &pattern(9, 8192)).unwrap();
        assert!(r.leg_status(0).unwrap().faulty);
    }
    l0.hook().dead.store(false, Ordering::SeqCst);
    let r = Raid1::assemble(
        vec![l0.clone() as Arc<dyn Device>, l1.clone()],
        cfg(BarrierMode::Lockless),
    )
    .unwrap();
    let st = r.leg_status(0).unwrap();
    assert!(st.present && st.faulty && !st.in_sync);
    assert!(r.is_degraded());
    assert_eq!(read(&r, 40, 8192).unwrap(), pattern(9, 8192));
    // The chunk written while degraded is dirty for the resync.
    assert!(!r.bitmap().unwrap().dirty_chunks().is_empty());
    drop(r);
    // A device that is not a leg of any array is refused with a typed error.
    assert!(matches!(
        Raid1::assemble(vec![mem("16M")], cfg(BarrierMode::Lockless)),
        Err(raid1::Raid1Error::Superblock(
            raid1::superblock::SuperblockError::BadMagic
        ))
    ));
}

#[test]
fn reads_past_the_resync_point_go_to_the_resync_source() {
    let f0 = Flaky::new(mem("16M"));
    let f1 = Flaky::new(mem("16M"));
    let r = Raid1::create(
        vec![f0.clone() as Arc<dyn Device>, f1.clone()],
        cfg(BarrierMode::Lockless),
    )
    .unwrap();
    write(&r, 0, &pattern(10, 4096)).unwrap();
    // Leg 0 is write-mostly and the only leg in sync; leg 1 recovers, past the sector, and
    // fails every read. Plain balancing would read leg 1 (not write-mostly, recovered there);
    // with the resync point at 0 reads go to the resync's source, leg 0 (a write-mostly leg is
    // the source when no other is in sync), and leg 1 is never tried.
    r.set_write_mostly(0, true).unwrap();
    r.set_sync_action(SyncAction::Frozen).unwrap();
    r.fail_leg(1).unwrap();
    let dev = r.remove_leg(1).unwrap();
    assert_eq!(r.add_leg(dev).unwrap(), 1);
    r.set_recovery_offset(1, 8 << 20).unwrap();
    f1.hook().bad_reads.lock().unwrap().push((0, u64::MAX));
    r.set_resync_point(Some(0));
    for _ in 0..4 {
        assert_eq!(read(&r, 0, 4096).unwrap(), pattern(10, 4096));
    }
    assert_eq!(r.leg_status(1).unwrap().read_errors, 0);
    r.set_resync_point(None);
}

/// A leg that records the (op, sector) of every bio it is given: the hook of a [`Forward`] leg.
#[derive(Default)]
struct Recorder {
    log: Mutex<Vec<(Op, u64)>>,
}

impl Hook for Recorder {
    fn submit(&self, inner: &dyn Device, bio: Bio, end: &Arc<dyn EndIo>) {
        self.log.lock().unwrap().push((bio.op, bio.sector));
        inner.submit(bio, end);
    }
}

#[test]
fn bitmap_bit_is_durable_on_every_leg_before_the_first_write_and_clears_when_quiet() {
    let legs: Vec<Arc<Forward<Recorder>>> = (0..2)
        .map(|_| Arc::new(Forward::with_hook(mem("16M"), Recorder::default())))
        .collect();
    let r = Raid1::create(
        legs.iter().map(|l| l.clone() as Arc<dyn Device>).collect(),
        cfg(BarrierMode::Lockless),
    )
    .unwrap();
    let doff = r.data_offset() >> SECTOR_SHIFT;
    let bitmap_sector = raid1::superblock::BITMAP_OFFSET >> SECTOR_SHIFT;
    for l in &legs {
        l.hook().log.lock().unwrap().clear();
    }
    write(&r, 2048, &pattern(11, 4096)).unwrap(); // chunk 1
    for l in &legs {
        let log = l.hook().log.lock().unwrap().clone();
        let data = log
            .iter()
            .position(|&(op, s)| op == Op::Write && s == doff + 2048)
            .expect("data write reached the leg");
        let bm = log[..data]
            .iter()
            .position(|&(op, s)| op == Op::Write && s == bitmap_sector)
            .expect("bitmap written before the data");
        assert!(
            log[bm..data].iter().any(|&(op, _)| op == Op::Flush),
            "no flush between the bitmap write and the data write: {log:?}"
        );
    }
    // A second write into the same chunk needs no bitmap write.
    for l in &legs {
        l.hook().log.lock().unwrap().clear();
    }
    write(&r, 2056, &pattern(12, 4096)).unwrap();
    for l in &legs {
        assert!(!l
            .hook()
            .log
            .lock()
            .unwrap()
            .iter()
            .any(|&(_, s)| s == bitmap_sector));
    }
    // Quiet, completed, flushed: raid1d clears the bit (polled, generous deadline).
    let bm = r.bitmap().unwrap();
    let t0 = std::time::Instant::now();
    while bm.is_dirty(1) {
        assert!(t0.elapsed() < Duration::from_secs(20), "bit never cleared");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn read_repairs_under_concurrent_io_do_not_deadlock() {
    for mode in [BarrierMode::Lockless, BarrierMode::Locked] {
        let f0 = Flaky::new(mem("16M"));
        let mut c = cfg(mode);
        c.read_error_limit = u32::MAX;
        c.depth = 4; // few slots: submitters also wait for slots
        let r =
            Arc::new(Raid1::create(vec![f0.clone() as Arc<dyn Device>, mem("16M")], c).unwrap());
        let doff = r.data_offset() >> SECTOR_SHIFT;
        // Every read of leg 0's first 512 KiB of data fails.
        f0.hook()
            .bad_reads
            .lock()
            .unwrap()
            .push((doff, doff + 1024));
        let ts: Vec<_> = (0..4u64)
            .map(|t| {
                let r = r.clone();
                std::thread::spawn(move || {
                    for n in 0..40u64 {
                        let sector = ((t * 40 + n) % 128) * 8;
                        let d = pattern((t + n) as u8, 4096);
                        if t % 2 == 0 {
                            write(r.as_ref(), sector + 1024 * (t / 2 + 1), &d).unwrap();
                        }
                        // Reads of the failing range go through retry + repair.
                        read(r.as_ref(), sector, 4096).unwrap();
                    }
                })
            })
            .collect();
        for t in ts {
            t.join().unwrap();
        }
        assert!(!r.leg_status(0).unwrap().faulty);
    }
}

#[test]
fn config_options_parse() {
    let mut c = Raid1Config::default();
    c.set_option("barrier", "locked").unwrap();
    c.set_option("bitmap_chunk", "4M").unwrap();
    c.set_option("depth", "32").unwrap();
    c.set_option("max_io", "256K").unwrap();
    assert_eq!(c.barrier, BarrierMode::Locked);
    assert_eq!(c.bitmap_chunk, 4 << 20);
    assert_eq!(c.depth, 32);
    assert_eq!(c.max_io_bytes, 256 << 10);
    c.set_option("bitmap_chunk", "none").unwrap();
    assert_eq!(c.bitmap_chunk, 0);
    assert!(c.set_option("barrier", "maybe").is_err());
    assert!(c.set_option("depth", "x").is_err());
    assert!(c.set_option("nope", "1").is_err());
    // An array without a bitmap works too.
    let r = Raid1::create(
        vec![mem("16M"), mem("16M")],
        Raid1Config {
            bitmap_chunk: 0,
            ..cfg(BarrierMode::Locked)
        },
    )
    .unwrap();
    assert!(r.bitmap().is_none());
    write(&r, 0, &pattern(13, 4096)).unwrap();
    assert_eq!(read(&r, 0, 4096).unwrap(), pattern(13, 4096));
}

/// A caller may drop the array from inside its own I/O's completion, on the leg's completion
/// thread, while the mirror's bookkeeping for that leg bio is still on the stack: the drop
/// finishes (its drain does not wait for the completion it runs in) and the array lives until
/// that completion is out (`retire`; `completion_ref=counted` keeps it by its `Weak` upgrade).
/// Run in both modes, many times, with the caller's last reference let go first or last. The
/// drop is a crash's (`crash_for_test`): a clean stop writes the superblocks, and a write to a
/// leg whose completion thread is the one waiting would wait for itself. The test keeps the
/// legs, so their completion threads outlive the array.
#[test]
fn the_array_may_be_dropped_from_inside_its_own_completion() {
    struct DropInside {
        array: Mutex<Option<Arc<Raid1>>>,
        done: std::sync::mpsc::Sender<Result<(), Error>>,
    }
    impl EndIo for DropInside {
        fn end_io(&self, _bio: Bio, res: Result<(), Error>) {
            let last = self.array.lock().unwrap().take();
            if let Some(Ok(r)) = last.map(Arc::try_unwrap) {
                r.crash_for_test();
            }
            let _ = self.done.send(res);
        }
    }
    let leg = "null:16M,completion=timer,completion_nsec=100000,memory_backed=1";
    for mode in ["sharded", "counted"] {
        for i in 0..40 {
            let mut c = cfg(BarrierMode::Lockless);
            c.set_option("completion_ref", mode).unwrap();
            let legs = [spec(leg), spec(leg)];
            let r = Arc::new(Raid1::create(legs.to_vec(), c).unwrap());
            let (tx, rx) = std::sync::mpsc::channel();
            let end: Arc<dyn EndIo> = Arc::new(DropInside {
                array: Mutex::new(Some(r.clone())),
                done: tx,
            });
            let mut b = Buffer::new(4096);
            b.as_mut_slice().fill(0x5a);
            r.submit(Bio::with_buf(Op::Write, 8, b), &end);
            let mut caller = Some(r);
            if i % 2 == 0 {
                // The completion (a timer 100 us out) holds the last reference.
                drop(caller.take());
            }
            let res = rx.recv_timeout(Duration::from_secs(20));
            assert!(
                matches!(res, Ok(Ok(()))),
                "{mode}, round {i}: the write's completion: {res:?}"
            );
            // Otherwise the caller lets go last.
            drop(caller);
            drop(legs);
        }
    }
}
