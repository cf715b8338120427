//! Fault schedules found by reviewing the mirror against md's rules, each as the interleaving
//! that broke a promise (docs/design.md, "What the mirror promises"). Every test here failed
//! before its fix; the names say the finding (D: durability, W: a wrong copy, A: availability).
//! Rules that only the simulator checked have a test here too (FUA, reads of a recovering leg,
//! bitmap before data, D2 on a write behind), each seen failing with its rule's line taken out.
//! Deterministic: faults are rules on fault-device legs, interleavings are built with stalls.
// A plain threaded test, never a loom model: it may use std::sync.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]
#![cfg(not(blkq_loom))]

mod common;
use common::*;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use blk::Device;
use blk_drivers::fault::{FaultHandle, OpSet, Rule};
use raid1::superblock::{Superblock, BITMAP_OFFSET, SB_OFFSET, SB_SIZE};
use raid1::{Event, Raid1, Raid1Config, SyncAction, WriteIntentBitmap};
use testkit::io::{flush as try_flush, read_at, write_at};
use testkit::{wait_until_within, Collect, Forward, Hook};

const IDLE: Duration = Duration::from_secs(60);
const SOON: Duration = Duration::from_secs(10);

fn no_bitmap() -> Raid1Config {
    Raid1Config {
        bitmap_chunk: 0,
        ..cfg()
    }
}

/// Which of `pattern(1, _)` and `pattern(2, _)` `v` is, for a failure message.
fn which(v: &[u8]) -> String {
    (1..=2)
        .find(|&p| v == pattern(p, v.len()).as_slice())
        .map_or("neither".to_string(), |p| format!("pattern {p}"))
}

/// Takes the leg in `slot` out (failed, removed) and adds `leg`, which must land in `slot`.
fn swap_leg(r: &Raid1, slot: usize, leg: Arc<dyn Device>) {
    r.fail_leg(slot).unwrap();
    r.remove_leg(slot).unwrap();
    assert_eq!(r.add_leg(leg).unwrap(), slot);
}

/// A power cut: the fault legs behind `legs` lose their volatile caches and `r` stops
/// uncleanly; the legs are then back up.
fn power_cut(r: Raid1, legs: &[&FaultHandle]) {
    for h in legs {
        h.crash().unwrap();
    }
    r.crash_for_test();
    for h in legs {
        h.restart();
    }
}

/// A write bio of `data` at array byte `off`.
fn write_bio(off: u64, data: &[u8]) -> blk::Bio {
    let mut bio = blk::Bio::with_buf(
        blk::Op::Write,
        off >> blk::SECTOR_SHIFT,
        blk::Buffer::new(data.len()),
    );
    bio.buf
        .as_mut()
        .unwrap()
        .as_mut_slice()
        .copy_from_slice(data);
    bio
}

/// Writes onto recovering leg `b` what a recovery from `a` would have copied below 8 MiB,
/// and sets its recovery offset there (slot 1), as a recovery that got that far.
fn pretend_recovered_to_8m(r: &Raid1, a: &dyn Device, b: &dyn Device) {
    let d = r.data_offset();
    for k in 0..8 {
        write(b, d + k * MB, &read(a, d + k * MB, MB as usize));
    }
    r.set_recovery_offset(1, 8 * MB).unwrap();
    r.sync_superblocks().unwrap();
}

/// D1: a write that failed on leg 0 is acknowledged only once the superblock recording leg 0's
/// failure is durable. Here that superblock cannot be written (leg 1, the survivor, fails it),
/// so the write must fail: acknowledged, it would be lost after a crash, because both legs
/// would assemble in sync and the resync would copy from leg 0, which missed it.
#[test]
fn d1_a_write_is_not_acknowledged_before_the_leg_failure_is_durable() {
    let (l0, f0) = fault_leg("16M", false);
    let (l1, f1) = fault_leg("16M", false);
    let off = 5 * MB;
    let r = Raid1::create(vec![l0.clone(), l1.clone()], cfg()).unwrap();
    let d = r.data_offset();
    write(&r, off, &pattern(1, 4096));
    flush(&r);
    r.sync_superblocks().unwrap();
    f0.add(Rule::fail(OpSet::WRITE).in_range(d + off, 4096));
    f1.add(Rule::fail(OpSet::WRITE).in_range(SB_OFFSET, SB_SIZE as u64));
    let res = write_at(&r, off, &pattern(2, 4096));
    assert!(r.leg_status(0).unwrap().faulty);
    assert!(
        res.is_err(),
        "acknowledged although the failure of leg 0 could not be recorded"
    );
    // The array is broken now: no write or flush is acknowledged.
    assert!(write_at(&r, 6 * MB, &pattern(3, 4096)).is_err());
    assert!(try_flush(&r).is_err());
    r.crash_for_test();
    f0.clear();
    f1.clear();
    let r = Raid1::assemble(vec![l0.clone(), l1.clone()], cfg()).unwrap();
    assert!(r.wait_sync_idle(IDLE));
    let got = read(&r, off, 4096);
    assert!(got == pattern(1, 4096) || got == pattern(2, 4096));
    assert_legs_equal(&r, l0.as_ref(), l1.as_ref());
}

/// D1, the other side: when the survivor records the failure, the write is acknowledged and
/// survives a crash (the failed leg comes back faulty).
#[test]
fn d1_a_write_acknowledged_after_a_leg_failure_survives_a_crash() {
    let (l0, f0) = fault_leg("16M", false);
    let l1 = mem("16M");
    let off = 5 * MB;
    let r = Raid1::create(vec![l0.clone(), l1.clone()], cfg()).unwrap();
    let d = r.data_offset();
    write(&r, off, &pattern(1, 4096));
    flush(&r);
    f0.add(Rule::fail(OpSet::WRITE).in_range(d + off, 4096));
    write(&r, off, &pattern(2, 4096));
    r.crash_for_test();
    f0.clear();
    let r = Raid1::assemble(vec![l0, l1], cfg()).unwrap();
    assert!(r.wait_sync_idle(IDLE));
    assert!(r.leg_status(0).unwrap().faulty);
    assert!(read(&r, off, 4096) == pattern(2, 4096));
}

/// D2: only in-sync legs count toward a write's or a flush's success: a recovering leg that
/// took the write does not hide the failure of the only in-sync leg. (Here the failed array
/// decides it as well: the only in-sync leg's failure fails the array, and with it the write
/// and the flush. The write-behind test below tells the D2 rule on its own.)
#[test]
fn d2_a_recovering_legs_success_does_not_hide_the_in_sync_legs_failure() {
    let (a, fa) = fault_leg("16M", false);
    let r = Raid1::create(vec![a.clone(), mem("16M")], cfg()).unwrap();
    let d = r.data_offset();
    let off = 8 * MB;
    write(&r, off, &pattern(1, 4096));
    flush(&r);
    r.set_speed_limits(1, 1);
    swap_leg(&r, 1, mem("16M"));
    fa.add(Rule::fail(OpSet::WRITE).in_range(d + off, 4096));
    let res = write_at(&r, off, &pattern(2, 4096));
    assert!(
        res.is_err(),
        "the only in-sync leg failed the write, yet it was acknowledged"
    );
    assert!(read(&r, off, 4096) == pattern(1, 4096));
    fa.clear();
    fa.add(Rule::fail(OpSet::FLUSH).next(1));
    assert!(
        try_flush(&r).is_err(),
        "the only in-sync leg failed the flush, yet it was acknowledged"
    );
}

/// Counts the data writes (at or past sector `from`) the leg under it completed, once each
/// completion has returned (the mirror's `leg_done`, and any acknowledgement it made, done).
#[derive(Default)]
struct CountDone {
    from: AtomicU64,
    done: Arc<AtomicU64>,
}

struct ThenCount {
    end: Arc<dyn blk::EndIo>,
    done: Arc<AtomicU64>,
}

impl blk::EndIo for ThenCount {
    fn end_io(&self, bio: blk::Bio, res: Result<(), blk::Error>) {
        self.end.end_io(bio, res);
        self.done.fetch_add(1, Ordering::SeqCst);
    }
}

impl Hook for CountDone {
    fn submit(&self, inner: &dyn Device, bio: blk::Bio, end: &Arc<dyn blk::EndIo>) {
        if bio.op == blk::Op::Write && bio.sector >= self.from.load(Ordering::SeqCst) {
            let end: Arc<dyn blk::EndIo> = Arc::new(ThenCount {
                end: end.clone(),
                done: self.done.clone(),
            });
            return inner.submit(bio, &end);
        }
        inner.submit(bio, end)
    }
}

/// Clears the rules of its fault legs and lets their stalled I/Os go on when dropped.
struct ReleaseOnDrop<const N: usize>([FaultHandle; N]);

impl<const N: usize> Drop for ReleaseOnDrop<N> {
    fn drop(&mut self) {
        for h in &self.0 {
            h.clear();
            h.release();
        }
    }
}

/// D2 where the failed array does not decide it: a write behind (`write_behind`). Leg 0 (in
/// sync) fails the write, leg 1 (recovering) takes it, leg 2 (in sync, write-mostly) holds it
/// behind. Leg 2 stays in sync, so leg 0's failure fails only leg 0, and it is recorded before
/// leg 1 completes. A write behind is acknowledged once the legs that are not behind have it
/// and one of them counts: leg 1 does not, or the write is acknowledged while no in-sync leg
/// has it (leg 2 failing or losing power next would lose it). The test above cannot tell:
/// there the only in-sync leg's failure fails the array, and with it the write.
#[test]
fn d2_a_recovering_legs_success_does_not_acknowledge_a_write_behind() {
    let (a, fa) = fault_leg("16M", false);
    let (w, fw) = fault_leg("16M", false);
    let (c, fc) = fault_leg("16M", false);
    let c = Arc::new(Forward::with_hook(c, CountDone::default()));
    let cfg = Raid1Config {
        write_behind: 4,
        // raid1d's tick (which flushes the legs) never comes during the test.
        tick: Duration::from_secs(3600),
        ..cfg()
    };
    let r = Raid1::create(vec![a, mem("16M"), w], cfg).unwrap();
    let d = r.data_offset();
    r.set_write_mostly(2, true).unwrap();
    r.set_sync_action(SyncAction::Frozen).unwrap();
    swap_leg(&r, 1, c.clone());
    // Dropped before the array, whose drop waits for the writes held here: a failed
    // assertion fails the test instead of hanging it.
    let _go_on = ReleaseOnDrop([fc.clone(), fw.clone()]);
    c.hook()
        .from
        .store(d >> blk::SECTOR_SHIFT, Ordering::SeqCst);
    let off = 4 * MB;
    fa.add(Rule::fail(OpSet::WRITE).in_range(d + off, 4096));
    fc.add(Rule::stall(OpSet::WRITE).in_range(d + off, 4096));
    fw.add(Rule::stall(OpSet::WRITE).in_range(d + off, 4096));
    let col = Arc::new(Collect::default());
    submit_write(&r, off, &pattern(2, 4096), &col);
    wait_until_within("leg 0 failed the write, legs 1 and 2 hold it", SOON, || {
        r.leg_status(0).unwrap().faulty && fc.stalled() == 1 && fw.stalled() == 1
    });
    assert_eq!(r.write_behind_outstanding(), 1, "the write is not behind");
    assert!(r.failure().is_none());
    // Another write is acknowledged only once leg 0's failure is on a durable superblock.
    write(&r, off + MB, &pattern(3, 4096));
    let before = c.hook().done.load(Ordering::SeqCst);
    assert_eq!(fc.release(), 1);
    wait_until_within("leg 1 completed the write", SOON, || {
        c.hook().done.load(Ordering::SeqCst) == before + 1
    });
    let early = !col.is_empty();
    assert_eq!(fw.release(), 1);
    assert!(
        !early,
        "acknowledged on the recovering leg's success alone: leg 0 failed the write and \
         leg 2, behind, had not written it"
    );
    let done = col.wait_for(1);
    assert!(done[0].1.is_ok(), "leg 2 took it: {:?}", done[0].1);
    assert!(read(&r, off, 4096) == pattern(2, 4096));
}

/// D3: a write that straddles two 64 MiB barrier units waits for a resync window on either.
/// The recovery's window on the second unit has read the source and its write to the new leg
/// is stalled; the straddling write must not slip in between, or the window's old data lands
/// over the new copy on the new leg.
#[test]
fn d3_a_write_straddling_two_barrier_units_waits_for_both() {
    let a = mem("80M");
    let r = Raid1::create(vec![a.clone(), mem("80M")], no_bitmap()).unwrap();
    let d = r.data_offset();
    let unit = 64 * MB;
    assert!(r.limits().capacity > unit + MB);
    r.fail_leg(1).unwrap();
    r.remove_leg(1).unwrap();
    let (b, fb) = fault_leg("80M", false);
    // The recovery's window at the unit boundary: its write to the new leg waits (a
    // write-zeroes: the source holds zeros there).
    fb.add(
        Rule::stall(OpSet::WRITE | OpSet::DISCARD)
            .in_range(d + unit, 4096)
            .nth(1),
    );
    assert_eq!(r.add_leg(b.clone()).unwrap(), 1);
    wait_until_within("the recovery window stalled", SOON, || fb.stalled() == 1);
    let data = pattern(9, 8192);
    std::thread::scope(|s| {
        let w = s.spawn(|| write_at(&r, unit - 4096, &data));
        std::thread::sleep(Duration::from_millis(200));
        assert_eq!(fb.release(), 1);
        w.join().unwrap().unwrap();
    });
    assert!(r.wait_sync_idle(IDLE));
    assert!(r.leg_status(1).unwrap().in_sync);
    assert!(read(a.as_ref(), d + unit - 4096, 8192) == data);
    assert!(
        read(b.as_ref(), d + unit - 4096, 8192) == data,
        "the recovery's old data landed over the acknowledged write"
    );
}

/// D3 for the large ones: a WRITE_ZEROES over several barrier units, during a recovery, leaves
/// the legs equal (it is admitted on every unit it touches).
#[test]
fn d3_write_zeroes_over_many_units_during_recovery_leaves_the_legs_equal() {
    let a = mem("200M");
    let r = Raid1::create(vec![a.clone(), mem("200M")], no_bitmap()).unwrap();
    let d = r.data_offset();
    let unit = 64 * MB;
    for k in 0..3u64 {
        write(&r, k * unit + unit / 2, &pattern(k as u8, 4096));
        write(&r, (k + 1) * unit - 4096, &pattern(10 + k as u8, 8192));
    }
    r.fail_leg(1).unwrap();
    r.remove_leg(1).unwrap();
    let (b, fb) = fault_leg("200M", false);
    fb.add(
        Rule::stall(OpSet::WRITE)
            .in_range(d + 2 * unit, 4096)
            .nth(1),
    );
    r.add_leg(b.clone()).unwrap();
    wait_until_within("the recovery window stalled", SOON, || fb.stalled() == 1);
    std::thread::scope(|s| {
        let w = s.spawn(|| {
            let mut bio = blk::Bio::new(blk::Op::WriteZeroes, (unit / 2) >> 9, (2 * unit) as u32);
            bio.flags = blk::BioFlags::NONE;
            testkit::io::submit_wait(&r, bio).1
        });
        std::thread::sleep(Duration::from_millis(200));
        fb.release();
        w.join().unwrap().unwrap();
    });
    assert!(r.wait_sync_idle(IDLE));
    assert_legs_equal(&r, a.as_ref(), b.as_ref());
    assert!(read(&r, 2 * unit, 4096) == vec![0u8; 4096]);
}

/// D5: a superblock is written after a flush of its leg (PREFLUSH + FUA): the IN_SYNC mark of
/// a finished recovery never becomes durable before the data the recovery copied.
#[test]
fn d5_a_recovery_is_durable_before_the_mark_that_vouches_for_it() {
    let a = mem("16M");
    let r = Raid1::create(vec![mem("16M"), a.clone()], no_bitmap()).unwrap();
    let off = 2 * MB;
    write(&r, off, &pattern(1, 4096));
    flush(&r);
    let (c, fc) = fault_leg("16M", true);
    swap_leg(&r, 0, c.clone());
    assert!(r.wait_sync_idle(IDLE));
    assert!(r.leg_status(0).unwrap().in_sync);
    // Power cut: the new leg's cache is lost, the array stops uncleanly.
    power_cut(r, &[&fc]);
    let r = Raid1::assemble(vec![c.clone(), a.clone()], no_bitmap()).unwrap();
    assert!(r.wait_sync_idle(IDLE));
    assert!(
        read(&r, off, 4096) == pattern(1, 4096),
        "a flushed write was lost: the leg was marked in sync before its data was durable"
    );
}

/// A FUA write is durable on every leg when it is acknowledged (the mirror passes FUA down to
/// each leg's write). Both legs lose their volatile caches right after the acknowledgement;
/// nothing else flushed them (no bitmap: raid1d never flushes). Each leg still holds the
/// write, and so does the array assembled from them in either order.
#[test]
fn a_fua_write_survives_a_power_cut_of_every_leg() {
    let (a, fa) = fault_leg("16M", true);
    let (b, fb) = fault_leg("16M", true);
    let r = Raid1::create(vec![a.clone(), b.clone()], no_bitmap()).unwrap();
    let d = r.data_offset();
    let off = 3 * MB;
    write(&r, off, &pattern(1, 4096));
    flush(&r);
    let mut bio = write_bio(off, &pattern(2, 4096));
    bio.flags = blk::BioFlags::FUA;
    testkit::io::submit_wait(&r, bio).1.unwrap();
    power_cut(r, &[&fa, &fb]);
    for (i, leg) in [&a, &b].into_iter().enumerate() {
        assert!(
            read(leg.as_ref(), d + off, 4096) == pattern(2, 4096),
            "leg {i} lost an acknowledged FUA write in a power cut"
        );
    }
    for order in [vec![a.clone(), b.clone()], vec![b.clone(), a.clone()]] {
        let r = Raid1::assemble(order, no_bitmap()).unwrap();
        assert!(r.wait_sync_idle(IDLE));
        assert!(read(&r, off, 4096) == pattern(2, 4096));
        r.crash_for_test();
    }
}

/// D6: raid1d's own flushes are not fire-and-forget: a leg whose internal flush failed is
/// failed, as a failed client FLUSH fails it.
#[test]
fn d6_a_failed_internal_flush_fails_the_leg() {
    let (a, fa) = fault_leg("16M", false);
    let r = Raid1::create(vec![a, mem("16M")], cfg()).unwrap();
    write(&r, 0, &pattern(1, 4096));
    fa.add(Rule::fail(OpSet::FLUSH).next(1));
    wait_until_within("raid1d flushed", SOON, || fa.counters().failed[2] == 1);
    wait_until_within("leg 0 failed", SOON, || r.leg_status(0).unwrap().faulty);
}

/// D6 on the last in-sync leg, which cannot be failed: its write-back error is sticky, so the
/// next client FLUSH (and every one after it) fails instead of succeeding.
#[test]
fn d6_a_failed_internal_flush_on_the_last_leg_fails_the_next_client_flush() {
    let (a, fa) = fault_leg("16M", false);
    let (b, fb) = fault_leg("16M", false);
    let r = Raid1::create(vec![a, b], cfg()).unwrap();
    write(&r, 0, &pattern(1, 4096));
    fa.add(Rule::fail(OpSet::FLUSH).next(1));
    fb.add(Rule::fail(OpSet::FLUSH).next(1));
    wait_until_within("raid1d's flushes failed on both legs", SOON, || {
        fa.counters().failed[2] == 1 && fb.counters().failed[2] == 1
    });
    assert!(try_flush(&r).is_err(), "a write-back error was swallowed");
    assert!(
        try_flush(&r).is_err(),
        "a write-back error was reported once"
    );
}

/// W1: bits loaded at assemble stay set (md's NEEDED) until the resync has copied their
/// chunks, however quiet they look; an interrupted resync then resumes from all of them.
#[test]
fn w1_the_bitmap_keeps_chunks_the_resync_has_not_copied() {
    let (a, b) = (mem("32M"), mem("32M"));
    let r = Raid1::create(vec![a.clone(), b.clone()], cfg()).unwrap();
    let d = r.data_offset();
    for k in 0..28u64 {
        write(&r, k * MB + 8192, &pattern(k as u8, 4096));
    }
    r.crash_for_test();
    // The legs differ in every dirty chunk (writes in flight at the crash).
    for k in 0..28u64 {
        write(b.as_ref(), d + k * MB + 8192, &pattern(100 + k as u8, 4096));
    }
    let quick = Raid1Config {
        bitmap_quiet: Duration::from_millis(10),
        ..cfg()
    };
    let r = Raid1::assemble(vec![a.clone(), b.clone()], quick).unwrap();
    r.set_speed_limits(1, 1);
    std::thread::sleep(Duration::from_millis(500));
    let dirty: u64 = r
        .bitmap()
        .unwrap()
        .dirty_chunks()
        .iter()
        .map(|c| c.end - c.first)
        .sum();
    assert!(
        dirty >= 27,
        "raid1d cleared bits of chunks not yet resynced ({dirty} left)"
    );
    r.crash_for_test();
    let r = Raid1::assemble(vec![a.clone(), b.clone()], cfg()).unwrap();
    assert!(r.wait_sync_idle(IDLE));
    assert_legs_equal(&r, a.as_ref(), b.as_ref());
}

/// W2: a resync writes every non-faulty leg but its source, recovering legs included: one that
/// serves reads below its recovery offset must agree there too.
#[test]
fn w2_the_resync_writes_recovering_legs_too() {
    let (a, b, c) = (mem("32M"), mem("32M"), mem("32M"));
    let r = Raid1::create(vec![a.clone(), b.clone(), mem("32M")], cfg()).unwrap();
    let d = r.data_offset();
    r.set_sync_action(SyncAction::Frozen).unwrap();
    swap_leg(&r, 2, c.clone());
    // Every leg is zero below 8 MiB: the new leg may serve reads there.
    r.set_recovery_offset(2, 8 * MB).unwrap();
    r.sync_superblocks().unwrap();
    write(&r, MB + 8192, &pattern(1, 4096));
    r.crash_for_test();
    // The write in flight at the crash reached only the recovering leg in full.
    write(c.as_ref(), d + MB + 8192, &pattern(2, 4096));
    let r = Raid1::assemble(vec![a.clone(), b.clone(), c.clone()], cfg()).unwrap();
    assert_eq!(r.leg_status(2).unwrap().recovery_offset, 8 * MB);
    assert!(r.wait_sync_idle(IDLE));
    assert_legs_equal(&r, a.as_ref(), b.as_ref());
    assert_legs_equal(&r, a.as_ref(), c.as_ref());
}

/// A leg being recovered holds valid data only below its recovery offset: a read that ends
/// above it goes to an in-sync leg. The new leg is in slot 0, which read balancing picks when
/// the legs are equally busy, and above its offset it holds another disk's old bytes.
#[test]
fn a_recovering_leg_serves_no_read_above_its_recovery_offset() {
    let a = mem("16M");
    let r = Raid1::create(vec![mem("16M"), a.clone()], cfg()).unwrap();
    let d = r.data_offset();
    let rec = 4 * MB;
    // 4 KiB blocks: one across the recovery offset, the others above it.
    let blocks: Vec<u64> = std::iter::once(rec - 2048)
        .chain((0..16).map(|k| 8 * MB + k * 65536))
        .collect();
    for (k, &o) in blocks.iter().enumerate() {
        write(&r, o, &pattern(k as u8, 4096));
    }
    flush(&r);
    r.set_sync_action(SyncAction::Frozen).unwrap();
    let c = mem("16M");
    swap_leg(&r, 0, c.clone());
    // Recovered below `rec` (true: nothing was written there but the straddling block's
    // first half, copied here as the recovery would have).
    write(c.as_ref(), d + rec - 2048, &pattern(0, 2048));
    r.set_recovery_offset(0, rec).unwrap();
    // Above: what the new disk held before.
    for (k, &o) in blocks.iter().enumerate() {
        let stale = pattern(100 + k as u8, 4096);
        let from = o.max(rec);
        write(c.as_ref(), d + from, &stale[(from - o) as usize..]);
    }
    assert!(!r.leg_status(0).unwrap().in_sync);
    for (k, &o) in blocks.iter().enumerate() {
        let got = read(&r, o, 4096);
        assert!(
            got == pattern(k as u8, 4096),
            "a read at {o} (recovery offset {rec}) returned the recovering leg's old bytes"
        );
    }
}

/// W4: a write whose bitmap bit could not be made durable on any leg is failed, not issued.
#[test]
fn w4_a_write_whose_bit_cannot_be_persisted_fails() {
    let (a, fa) = fault_leg("16M", false);
    let (b, fb) = fault_leg("16M", false);
    let r = Raid1::create(vec![a, b], cfg()).unwrap();
    let d = r.data_offset();
    let bm = d - BITMAP_OFFSET;
    fa.add(Rule::fail(OpSet::WRITE).in_range(BITMAP_OFFSET, bm));
    fb.add(Rule::fail(OpSet::WRITE).in_range(BITMAP_OFFSET, bm));
    let res = write_at(&r, 3 * MB, &pattern(1, 4096));
    assert!(
        res.is_err(),
        "the data write went ahead with its bitmap bit on no leg"
    );
}

/// A power cut of the fault device under it (its volatile cache is lost) when the first data
/// write (at or past sector `data`) reaches it; it records the bitmap area (`bitmap_len` bytes)
/// its media then holds, and forwards the write.
struct CutAtData {
    fault: FaultHandle,
    data: AtomicU64,
    bitmap_len: AtomicU64,
    media: Mutex<Option<Vec<u8>>>,
}

impl Hook for CutAtData {
    fn submit(&self, inner: &dyn Device, bio: blk::Bio, end: &Arc<dyn blk::EndIo>) {
        if bio.op == blk::Op::Write && bio.sector >= self.data.load(Ordering::SeqCst) {
            let mut media = self.media.lock().unwrap();
            if media.is_none() {
                self.fault.crash().unwrap();
                self.fault.restart();
                let len = self.bitmap_len.load(Ordering::SeqCst) as usize;
                *media = Some(read(inner, BITMAP_OFFSET, len));
            }
        }
        inner.submit(bio, end)
    }
}

/// Bitmap before data: a write's bit is on every leg's media (written and flushed, not in a
/// volatile cache) before its data write reaches that leg. Each leg loses its cache at the
/// moment the data write arrives; the bitmap its media holds then has the write's bit.
#[test]
fn a_writes_bit_is_on_every_legs_media_before_its_data_reaches_it() {
    let legs: Vec<Arc<Forward<CutAtData>>> = (0..2)
        .map(|_| {
            let (f, h) = fault_leg("16M", true);
            Arc::new(Forward::with_hook(
                f,
                CutAtData {
                    fault: h,
                    data: AtomicU64::new(u64::MAX),
                    bitmap_len: AtomicU64::new(0),
                    media: Mutex::new(None),
                },
            ))
        })
        .collect();
    let cfg = Raid1Config {
        // raid1d's tick (which flushes the legs) never comes during the test.
        tick: Duration::from_secs(3600),
        ..cfg()
    };
    let r = Raid1::create(
        legs.iter().map(|l| l.clone() as Arc<dyn Device>).collect(),
        cfg,
    )
    .unwrap();
    assert!(r.wait_sync_idle(IDLE));
    let bm = r.bitmap().unwrap();
    let off = 5 * MB + 8192;
    let chunk = off / bm.chunk_size();
    assert!(!bm.is_dirty(chunk));
    for l in &legs {
        l.hook()
            .bitmap_len
            .store(bm.disk_len() as u64, Ordering::SeqCst);
        l.hook()
            .data
            .store(r.data_offset() >> blk::SECTOR_SHIFT, Ordering::SeqCst);
    }
    write(&r, off, &pattern(1, 4096));
    for (i, l) in legs.iter().enumerate() {
        let media = l.hook().media.lock().unwrap().take();
        let media = media.unwrap_or_else(|| panic!("the data write never reached leg {i}"));
        let on_disk =
            WriteIntentBitmap::new(bm.nr_chunks() * bm.chunk_size(), bm.chunk_size()).unwrap();
        let loaded = on_disk.load(&media);
        assert!(
            loaded.is_ok() && on_disk.is_dirty(chunk),
            "leg {i}: the data write arrived with chunk {chunk}'s bit not on the media \
             (bitmap read back: {loaded:?})"
        );
    }
    assert!(read(&r, off, 4096) == pattern(1, 4096));
}

fn sb_of(leg: &dyn Device) -> Superblock {
    Superblock::decode(&read(leg, SB_OFFSET, SB_SIZE)).unwrap()
}

fn put_sb(leg: &dyn Device, sb: &Superblock) {
    write(leg, SB_OFFSET, &sb.encode().unwrap());
}

/// W5: two superblocks with the same events but different views (a leg failed while they were
/// being written) assemble the same way in any order: the view that records the failure wins.
#[test]
fn w5_equal_events_with_different_views_assemble_the_same_in_any_order() {
    let (a, b) = (mem("16M"), mem("16M"));
    let r = Raid1::create(vec![a.clone(), b.clone()], cfg()).unwrap();
    write(&r, MB, &pattern(1, 4096));
    flush(&r);
    r.crash_for_test();
    // Leg b's superblock records leg a as faulty, leg a's does not; same events.
    let sa = sb_of(a.as_ref());
    let mut sb = sb_of(b.as_ref());
    assert_eq!(sa.events, sb.events);
    sb.legs[0].faulty = true;
    put_sb(b.as_ref(), &sb);
    for order in [vec![a.clone(), b.clone()], vec![b.clone(), a.clone()]] {
        let r = Raid1::assemble(order, cfg()).unwrap();
        assert!(
            r.leg_status(0).unwrap().faulty,
            "leg 0's recorded failure was ignored in one order"
        );
        assert!(r.leg_status(1).unwrap().in_sync);
        assert!(!r.leg_status(1).unwrap().faulty);
        assert!(read(&r, MB, 4096) == pattern(1, 4096));
        r.crash_for_test();
        put_sb(a.as_ref(), &sa);
        put_sb(b.as_ref(), &sb);
    }
}

/// A1: a torn superblock on one leg does not stop the array: it assembles from the others and
/// recovers that leg in full.
#[test]
fn a1_a_torn_superblock_assembles_from_the_others_and_recovers_that_leg() {
    let (a, b) = (mem("16M"), mem("16M"));
    {
        let r = Raid1::create(vec![a.clone(), b.clone()], cfg()).unwrap();
        write(&r, 2 * MB, &pattern(4, 8192));
    }
    // Tear leg b's superblock: its second half from another write.
    let mut raw = read(b.as_ref(), SB_OFFSET, SB_SIZE);
    raw[SB_SIZE / 2..].fill(0x5a);
    write(b.as_ref(), SB_OFFSET, &raw);
    let r = Raid1::assemble(vec![a.clone(), b.clone()], cfg()).unwrap();
    assert!(
        r.assemble_warnings().iter().any(|w| w.contains("leg 1")),
        "the torn superblock was not reported: {:?}",
        r.assemble_warnings()
    );
    assert!(r.wait_sync_idle(IDLE));
    assert!(!r.is_degraded());
    assert!(read(&r, 2 * MB, 8192) == pattern(4, 8192));
    assert_legs_equal(&r, a.as_ref(), b.as_ref());
}

/// A1 with an unreadable superblock (a read error): the same.
#[test]
fn a1_an_unreadable_superblock_assembles_from_the_others() {
    let a = mem("16M");
    let (b, fb) = fault_leg("16M", false);
    {
        let r = Raid1::create(vec![a.clone(), b.clone()], cfg()).unwrap();
        write(&r, 2 * MB, &pattern(4, 8192));
    }
    fb.add(
        Rule::fail(OpSet::READ)
            .in_range(SB_OFFSET, SB_SIZE as u64)
            .nth(1),
    );
    let r = Raid1::assemble(vec![a.clone(), b.clone()], cfg()).unwrap();
    assert!(!r.assemble_warnings().is_empty());
    assert!(r.wait_sync_idle(IDLE));
    assert!(read(&r, 2 * MB, 8192) == pattern(4, 8192));
    assert_legs_equal(&r, a.as_ref(), b.as_ref());
    let _ = read_at(&r, 0, 4096).unwrap();
}

/// A resync that cannot read any source for a window is not forgotten: the array still needs
/// it (a check is refused, the stop does not mark the array clean), and it runs again when
/// asked, making the legs agree. Before, the failed pass cleared `resync_needed` and the legs
/// disagreed silently (found by the simulator as mismatches in a later check).
#[test]
fn a_resync_that_could_not_read_is_still_needed() {
    let (a, fa) = fault_leg("16M", false);
    let (b, fb) = fault_leg("16M", false);
    let r = Raid1::create(vec![a.clone(), b.clone()], cfg()).unwrap();
    let d = r.data_offset();
    write(&r, 3 * MB, &pattern(1, 4096));
    r.crash_for_test();
    write(b.as_ref(), d + 3 * MB, &pattern(2, 4096));
    fa.add(Rule::fail(OpSet::READ).in_range(d + 3 * MB, 4096).next(1));
    fb.add(Rule::fail(OpSet::READ).in_range(d + 3 * MB, 4096).next(1));
    let r = Raid1::assemble(vec![a.clone(), b.clone()], cfg()).unwrap();
    assert!(r.wait_sync_idle(IDLE));
    assert_eq!(fa.counters().failed[0] + fb.counters().failed[0], 2);
    assert!(
        r.set_sync_action(SyncAction::Check).is_err(),
        "the resync failed, yet the array takes a check as if its legs agreed"
    );
    drop(r);
    // Stopped with the resync still due: assembled again, it resyncs.
    let r = Raid1::assemble(vec![a.clone(), b.clone()], cfg()).unwrap();
    assert!(r.wait_sync_idle(IDLE));
    assert_legs_equal(&r, a.as_ref(), b.as_ref());
    // And asked for, it runs again at once.
    write(&r, 3 * MB, &pattern(1, 4096));
    r.crash_for_test();
    write(b.as_ref(), d + 3 * MB, &pattern(3, 4096));
    fa.add(Rule::fail(OpSet::READ).in_range(d + 3 * MB, 4096).next(1));
    fb.add(Rule::fail(OpSet::READ).in_range(d + 3 * MB, 4096).next(1));
    let r = Raid1::assemble(vec![a.clone(), b.clone()], cfg()).unwrap();
    assert!(r.wait_sync_idle(IDLE));
    r.set_sync_action(SyncAction::Resync).unwrap();
    assert!(r.wait_sync_idle(IDLE));
    assert_legs_equal(&r, a.as_ref(), b.as_ref());
}

/// An array of one recovery window (pattern 1), whose new leg in slot 1 (returned) has had
/// that window copied by its recovery pass, now asleep (1 KiB/s) before it ends.
fn recovery_asleep_after_its_window() -> (Raid1, Arc<dyn Device>, u64) {
    let r = Raid1::create(vec![mem("2M"), mem("2M")], cfg()).unwrap();
    let cap = r.limits().capacity;
    assert!(cap <= MB, "one recovery window");
    write(&r, 0, &pattern(1, cap as usize));
    r.set_speed_limits(1, 1);
    let x = mem("2M");
    swap_leg(&r, 1, x.clone());
    wait_until_within("the window copied", SOON, || {
        r.sync_progress().done_bytes == cap
    });
    (r, x, cap)
}

/// A recovery pass belongs to the leg it started on. Its leg is removed and another added
/// into the same slot while the pass sleeps after its last window (a speed limit); the pass
/// then ends. It must not mark the new leg in sync (nor move its recovery offset): the new
/// leg is recovered in full. Found by the simulator (a `replace_leg` after a `remove_leg` of a
/// recovering leg lost acknowledged data: the new leg was marked in sync empty).
#[test]
fn a_recovery_pass_never_finishes_on_a_leg_that_replaced_its_own() {
    let (r, _, cap) = recovery_asleep_after_its_window();
    // Swap the leg under the sleeping pass.
    r.remove_leg(1).unwrap();
    let y = mem("2M");
    assert_eq!(r.add_leg(y.clone()).unwrap(), 1);
    r.set_speed_limits(1000, 200_000);
    assert!(r.wait_sync_idle(IDLE));
    assert!(r.leg_status(1).unwrap().in_sync);
    assert!(
        read(y.as_ref(), r.data_offset(), cap as usize) == pattern(1, cap as usize),
        "the new leg was marked in sync without being recovered"
    );
}

/// A leg taken out of the array is out on disk before the call returns: after `remove_leg`
/// (and so `replace_leg`) the old leg may be pulled at once, and a crash then still
/// assembles from the legs left. Found by the simulator (seed 100268: after a replace and a
/// crash, the new leg's newest superblock still named the old leg in sync and itself
/// recovering: "no in-sync leg: cannot assemble").
#[test]
fn a_removed_leg_is_out_on_disk_when_remove_returns() {
    for round in 0..20u8 {
        let (a, c) = (mem("16M"), mem("16M"));
        let r = Raid1::create(vec![a.clone(), mem("16M")], cfg()).unwrap();
        write(&r, 3 * MB, &pattern(round, 8192));
        let slot = r.replace_leg(1, c.clone()).unwrap();
        for leg in [&a, &c] {
            let sb = sb_of(leg.as_ref());
            assert!(
                sb.legs[1].uuid.is_nil() && sb.legs[slot].in_sync,
                "round {round}: the superblock on disk still has the replaced leg: {:?}",
                sb.legs
            );
        }
        r.crash_for_test();
        let r = Raid1::assemble(vec![c.clone(), a.clone()], cfg()).unwrap();
        assert!(r.leg_status(slot).unwrap().in_sync, "round {round}");
        assert!(read(&r, 3 * MB, 8192) == pattern(round, 8192));
    }
}

/// Simulator seed 2: the last in-sync leg fails its superblock write while another leg is
/// recovering. The array fails, and writes no superblock to the recovering leg (newer events
/// there would make the in-sync leg look stale): after a crash the array assembles from the
/// in-sync leg. Before: "no in-sync leg: cannot assemble".
#[test]
fn seed_2_a_recovering_leg_never_gets_newer_events_than_the_in_sync_ones() {
    let (a, fa) = fault_leg("16M", false);
    let r = Raid1::create(vec![a.clone(), mem("16M")], cfg()).unwrap();
    write(&r, 2 * MB, &pattern(1, 4096));
    flush(&r);
    r.set_speed_limits(1, 1);
    let b = mem("16M");
    swap_leg(&r, 1, b.clone());
    fa.add(Rule::fail(OpSet::WRITE).in_range(SB_OFFSET, SB_SIZE as u64));
    assert!(r.sync_superblocks().is_err());
    assert!(r.failure().is_some());
    assert!(
        r.sync_superblocks().is_err(),
        "a failed array writes no superblock"
    );
    r.crash_for_test();
    fa.clear();
    let r = Raid1::assemble(vec![b, a], cfg()).unwrap();
    assert!(r.leg_status(0).unwrap().in_sync);
    assert!(read(&r, 2 * MB, 4096) == pattern(1, 4096));
}

/// Simulator seed 12: a leg added while the array's superblocks cannot be written (here the
/// array's only in-sync leg fails them) is not left in the array with no superblock of its
/// own; assembly then works from the legs the array really has. Before: the leg stayed in its
/// slot, and assembly refused it ("bad magic").
#[test]
fn seed_12_a_leg_whose_addition_failed_is_not_left_in_the_array() {
    let (a, fa) = fault_leg("16M", false);
    let r = Raid1::create(vec![a.clone(), mem("16M")], cfg()).unwrap();
    write(&r, 2 * MB, &pattern(1, 4096));
    r.fail_leg(1).unwrap();
    r.remove_leg(1).unwrap();
    fa.add(Rule::fail(OpSet::WRITE).in_range(SB_OFFSET, SB_SIZE as u64));
    assert!(r.add_leg(mem("16M")).is_err());
    let st = r.leg_status(1).unwrap();
    assert!(
        !st.present,
        "a leg whose addition failed was left in slot 1: {st:?}"
    );
    r.crash_for_test();
    fa.clear();
    let r = Raid1::assemble(vec![a], cfg()).unwrap();
    assert!(read(&r, 2 * MB, 4096) == pattern(1, 4096));
}

/// The same with the recovery quicker than the superblock write that records the addition: a
/// new leg is not recovered (so never in sync) before its addition is recorded, and is taken
/// out again when the record fails, as md writes the superblocks before a spare's recovery
/// starts. Before: the recovery finished while the record was held, the leg was in sync,
/// and the failed addition left it in its slot with no superblock of its own, so assembly
/// with the legs the array had in memory refused it ("bad magic"). Found by the simulator
/// (seed 46000573: a power cut during an addition's superblock write).
#[test]
fn seed_46000573_a_leg_is_not_recovered_before_its_addition_is_recorded() {
    let (a, fa) = fault_leg("16M", true);
    let r = Raid1::create(vec![a.clone(), mem("16M")], cfg()).unwrap();
    write(&r, 2 * MB, &pattern(1, 4096));
    flush(&r);
    r.fail_leg(1).unwrap();
    r.remove_leg(1).unwrap();
    r.set_speed_limits(1000, 1_000_000);
    fa.add(
        Rule::stall(OpSet::WRITE)
            .in_range(SB_OFFSET, SB_SIZE as u64)
            .nth(1),
    );
    let (idle, held, added) = std::thread::scope(|s| {
        let add = s.spawn(|| r.add_leg(mem("16M")));
        wait_until_within("the addition's superblock write held", SOON, || {
            fa.stalled() > 0
        });
        // Held: the sync thread has nothing it may do yet.
        let idle = r.wait_sync_idle(SOON);
        let held = r.leg_status(1).unwrap();
        // A power cut fails the held write: the array's only in-sync leg took no superblock.
        fa.crash().unwrap();
        (idle, held, add.join().unwrap())
    });
    assert!(
        idle && !held.in_sync && held.recovery_offset == 0,
        "a leg was recovered before its addition was recorded (idle {idle}): {held:?}"
    );
    assert!(added.is_err());
    let st = r.leg_status(1).unwrap();
    assert!(
        !st.present,
        "a leg whose addition failed was left in slot 1: {st:?}"
    );
    r.crash_for_test();
    fa.restart();
    fa.clear();
    let r = Raid1::assemble(vec![a], cfg()).unwrap();
    assert!(read(&r, 2 * MB, 4096) == pattern(1, 4096));
}

/// An unclean stop with one in-sync leg and one recovering leg that already serves reads below
/// its recovery offset: the dirty chunks below that offset are resynced onto it too (the
/// recovery only copies from its offset up). Here a write the in-sync leg failed (which failed
/// the array) landed on the recovering leg only. Found by the simulator (seed 400036: a repair
/// after the recovery counted 2190 mismatched sectors).
#[test]
fn an_unclean_stop_resyncs_a_recovering_leg_below_its_offset() {
    let (a, fa) = fault_leg("16M", false);
    let b = mem("16M");
    let r = Raid1::create(vec![a.clone(), mem("16M")], cfg()).unwrap();
    let d = r.data_offset();
    write(&r, MB, &pattern(1, 8192));
    flush(&r);
    r.set_sync_action(SyncAction::Frozen).unwrap();
    swap_leg(&r, 1, b.clone());
    pretend_recovered_to_8m(&r, a.as_ref(), b.as_ref());
    fa.add(Rule::fail(OpSet::WRITE).in_range(d + MB, 8192));
    assert!(write_at(&r, MB, &pattern(2, 8192)).is_err());
    assert!(r.failure().is_some());
    r.crash_for_test();
    fa.clear();
    let r = Raid1::assemble(vec![a.clone(), b.clone()], cfg()).unwrap();
    assert_eq!(r.leg_status(1).unwrap().recovery_offset, 8 * MB);
    assert!(r.wait_sync_idle(IDLE));
    assert!(r.leg_status(1).unwrap().in_sync);
    assert_legs_equal(&r, a.as_ref(), b.as_ref());
}

/// The same, with the same device added back: a pass works for one placement of a leg, not
/// for a device. The leg is removed while its pass sleeps, misses a write, and is added again
/// into the same slot; the old pass must not mark it in sync. Found by the simulator (seed
/// 600792: a leg removed mid-recovery and added back read an old write after the sync).
#[test]
fn a_recovery_pass_never_finishes_on_its_own_leg_added_back() {
    let (r, x, cap) = recovery_asleep_after_its_window();
    r.remove_leg(1).unwrap();
    write(&r, 0, &pattern(2, cap as usize));
    assert_eq!(r.add_leg(x.clone()).unwrap(), 1);
    r.set_speed_limits(1000, 200_000);
    assert!(r.wait_sync_idle(IDLE));
    assert!(r.leg_status(1).unwrap().in_sync);
    assert!(
        read(x.as_ref(), r.data_offset(), cap as usize) == pattern(2, cap as usize),
        "the leg added back was marked in sync by its earlier placement's pass"
    );
}

/// A failed array's state no longer changes: its superblocks cannot record a change, so a leg
/// removed (or failed, added, replaced) in memory only would be missing from, or wrongly
/// described by, what assembly reads after a crash. The calls are refused and the sync thread
/// stops. Found by the simulator (seeds 500203, 500511, 500785: a replace on a failed array
/// took the old leg out in memory, and assembly without it found no in-sync leg).
#[test]
fn a_failed_array_refuses_leg_changes() {
    let (a, fa) = fault_leg("16M", false);
    let r = Raid1::create(vec![a.clone(), mem("16M")], cfg()).unwrap();
    write(&r, 2 * MB, &pattern(1, 4096));
    r.set_sync_action(SyncAction::Frozen).unwrap();
    let b = mem("16M");
    swap_leg(&r, 1, b.clone());
    fa.add(Rule::fail(OpSet::WRITE).in_range(SB_OFFSET, SB_SIZE as u64));
    assert!(r.sync_superblocks().is_err());
    assert!(r.failure().is_some());
    assert!(r.remove_leg(1).is_err());
    assert!(
        r.leg_status(1).unwrap().present,
        "a failed array took a leg out in memory only"
    );
    assert!(r.fail_leg(1).is_err());
    assert!(!r.leg_status(1).unwrap().faulty);
    assert!(r.add_leg(mem("16M")).is_err());
    assert!(r.replace_leg(0, mem("16M")).is_err());
    assert!(r.set_sync_action(SyncAction::Recover).is_ok());
    assert!(r.wait_sync_idle(IDLE));
    assert!(
        !r.leg_status(1).unwrap().in_sync,
        "a failed array's recovery went on"
    );
    r.crash_for_test();
    fa.clear();
    let r = Raid1::assemble(vec![b, a], cfg()).unwrap();
    assert!(read(&r, 2 * MB, 4096) == pattern(1, 4096));
}

/// Found by the NBD simulator's mirror exports (seed 1081): a re-add whose pass copied dirty
/// chunk 0 and sleeps; the leg fails, a write to chunk 0 reaches the other leg only, the leg is
/// removed and added back (a full recovery now: its superblock says it was recovering). The
/// old pass, holding its old snapshot of the dirty chunks, must not finish the new recovery.
#[test]
fn a_readded_legs_pass_does_not_resume_after_it_fails_and_returns() {
    let (a, b) = (mem("8M"), mem("8M"));
    let chunk = 256 << 10;
    let cfg = Raid1Config {
        bitmap_chunk: chunk,
        ..cfg()
    };
    let r = Raid1::create(vec![a.clone(), b.clone()], cfg).unwrap();
    let s = 456 * 512; // in chunk 0
    write(&r, s, &pattern(1, 4096));
    flush(&r);
    r.set_speed_limits(1, 1);
    r.fail_leg(0).unwrap();
    r.remove_leg(0).unwrap();
    write(&r, 0, &pattern(2, 4096));
    write(&r, 3 * chunk, &pattern(3, 4096));
    // A re-add: the pass copies chunk 0, then sleeps in its throttle.
    assert_eq!(r.add_leg(a.clone()).unwrap(), 0);
    wait_until_within("the re-add copied chunk 0", SOON, || {
        r.leg_status(0).unwrap().recovery_offset >= chunk
    });
    r.fail_leg(0).unwrap();
    write(&r, s, &pattern(4, 4096));
    r.remove_leg(0).unwrap();
    assert_eq!(r.add_leg(a.clone()).unwrap(), 0);
    assert_eq!(r.leg_status(0).unwrap().recovery_offset, 0);
    r.set_speed_limits(1000, 200_000);
    assert!(r.wait_sync_idle(IDLE));
    assert!(r.leg_status(0).unwrap().in_sync);
    assert!(
        read(a.as_ref(), r.data_offset() + s, 4096) == pattern(4, 4096),
        "leg 0, in sync after its recovery, misses the write it missed while out"
    );
}

/// Submits a write of `data` at array byte `off`, completing into `done`.
fn submit_write(r: &Raid1, off: u64, data: &[u8], done: &Arc<Collect>) {
    let end: Arc<dyn blk::EndIo> = done.clone();
    r.submit(write_bio(off, data), &end);
}

/// Found by the simulator (seed 41000657): a leg out of its slot (the array, with its other
/// two legs, counts as whole, so raid1d clears quiet bits), a write X while it is out, and the
/// leg added back. The re-add decided on a bitmap recovery (no bit cleared since the leg
/// left); then, while its placement waited for the I/O in flight, raid1d cleared X's bit, and
/// the recovery's snapshot of the dirty chunks missed X: the leg came back in sync without it.
///
/// Here the re-add's placement waits for a write W held on leg 2; X, held on leg 0 until the
/// re-add has decided (the array is frozen then), can be cleared only after the decision.
/// Then raid1d runs until it has cleared X's bit or made three more passes (each flushes leg
/// 2) after the one that may have begun before X ended: enough to clear a chunk quiet for
/// 10 ms at a 20 ms tick. W goes on, the leg is placed and recovered; it must hold X.
#[test]
fn a_write_made_while_a_leg_was_out_reaches_it_however_raid1d_clears_during_its_readd() {
    const FLUSHES: usize = 2; // FaultCounters' classes: read, write, flush, discard
    let (a, fa) = fault_leg("16M", false);
    let b = mem("16M");
    let (c, fc) = fault_leg("16M", false);
    let cfg = Raid1Config {
        bitmap_quiet: Duration::from_millis(10),
        tick: Duration::from_millis(20),
        ..cfg()
    };
    let r = Raid1::create(vec![a.clone(), b.clone(), c], cfg).unwrap();
    assert!(r.wait_sync_idle(IDLE));
    let d = r.data_offset();
    r.fail_leg(1).unwrap();
    r.remove_leg(1).unwrap();
    assert!(
        !r.is_degraded(),
        "slot 1 empty, legs 0 and 2 in sync: whole, raid1d clears quiet bits"
    );
    let (x_off, w_off) = (2 * MB + 8192, 5 * MB);
    let x_dirty = || {
        r.bitmap()
            .unwrap()
            .dirty_chunks()
            .iter()
            .any(|s| (s.first..s.end).contains(&(x_off / MB)))
    };
    fa.add(Rule::stall(OpSet::WRITE).in_range(d + x_off, 4096));
    fc.add(Rule::stall(OpSet::WRITE).in_range(d + w_off, 4096));
    let acked = Arc::new(Collect::default());
    submit_write(&r, x_off, &pattern(1, 4096), &acked);
    submit_write(&r, w_off, &pattern(2, 4096), &acked);
    let sub = r.subscribe();
    let cleared_in_window = std::thread::scope(|s| {
        // Dropped before the scope joins the re-add, which waits for the writes held here: a
        // failed assertion fails the test instead of hanging it.
        let _go_on = ReleaseOnDrop([fa.clone(), fc.clone()]);
        wait_until_within("X held on leg 0, W on leg 2", SOON, || {
            fa.stalled() == 1 && fc.stalled() == 1
        });
        let readd = s.spawn(|| r.add_leg(b.clone()));
        // Frozen: the re-add has decided, and waits for X and W to place the leg.
        wait_until_within("the re-add waiting for the writes in flight", SOON, || {
            r.barriers().is_frozen()
        });
        assert!(x_dirty(), "X's bit is set while X is in flight");
        fa.clear();
        assert_eq!(fa.release(), 1);
        wait_until_within("X acknowledged", SOON, || acked.len() == 1);
        let passes = fc.counters().seen[FLUSHES];
        wait_until_within(
            "raid1d cleared X's bit or made three more passes",
            SOON,
            || !x_dirty() || fc.counters().seen[FLUSHES] >= passes + 4,
        );
        let cleared = !x_dirty();
        assert!(!readd.is_finished(), "the re-add waits for W");
        fc.clear();
        assert_eq!(fc.release(), 1);
        assert_eq!(readd.join().unwrap().unwrap(), 1);
        cleared
    });
    assert!(acked.wait_for(2).iter().all(|(_, res)| res.is_ok()));
    let mut readd = None;
    while let Some(rec) = sub.try_next() {
        if let Event::LegAdded { slot: 1, readd: k } = rec.event {
            readd = Some(k);
        }
    }
    assert_eq!(
        readd,
        Some(true),
        "a re-add of the slot's leg, with a bitmap recovery"
    );
    assert!(r.wait_sync_idle(IDLE));
    let st = r.leg_status(1).unwrap();
    assert!(st.in_sync && !st.faulty, "{st:?}");
    assert!(
        read(b.as_ref(), d + x_off, 4096) == pattern(1, 4096),
        "leg 1, in sync after its re-add, misses the write X made while it was out \
         (raid1d cleared X's bit while the re-add waited to place the leg: {cleared_in_window})"
    );
    assert_legs_equal(&r, a.as_ref(), b.as_ref());
}

/// Found by the NBD simulator's mirror exports (seed 1167: depth 16, a large read cut into
/// small bios while every leg was down): a hang. A read took its per-I/O slot after its barrier
/// admission, so it could sleep for one while admitted; failed reads keep their slots until
/// raid1d, which freezes the array to fix them, and a freeze waits for every admission: the
/// reader waited for raid1d, raid1d for the reader. Now slots are taken before admission.
///
/// Here (depth 4): raid1d is kept busy by a superblock write held on leg 1 while four reads,
/// failing on both legs, take the four slots and two more readers wait for a slot; then raid1d
/// goes on. All six reads complete, with an error (no leg can read). Hung before the fix.
#[test]
fn failed_reads_holding_every_slot_do_not_hang_the_array() {
    use blk::{Bio, Buffer, EndIo, Op};
    let (a, fa) = fault_leg("8M", false);
    let (b, fb) = fault_leg("8M", false);
    let cfg = Raid1Config {
        bitmap_chunk: 0,
        depth: 4,
        ..cfg()
    };
    let r = Arc::new(Raid1::create(vec![a, b], cfg).unwrap());
    let d = r.data_offset();
    // raid1d busy: a state change makes it write the superblocks, and leg 1 holds its write.
    fb.add(Rule::stall(OpSet::WRITE).in_range(SB_OFFSET, SB_SIZE as u64));
    r.set_write_mostly(0, false).unwrap();
    wait_until_within("raid1d's superblock write is held", SOON, || {
        fb.stalled() > 0
    });
    for h in [&fa, &fb] {
        h.add(Rule::fail(OpSet::READ).in_range(d, 8 << 20));
    }
    let col = Arc::new(testkit::Collect::default());
    let end: Arc<dyn EndIo> = col.clone();
    let rd = |k: u64| Bio::with_buf(Op::Read, k * 8, Buffer::new(4096));
    // Four failed reads hold the four slots, queued for raid1d.
    for k in 0..4 {
        r.submit(rd(k), &end);
    }
    // Two more readers wait for a slot.
    let readers: Vec<_> = (4..6)
        .map(|k| {
            let (r, end) = (r.clone(), end.clone());
            std::thread::spawn(move || r.submit(rd(k), &end))
        })
        .collect();
    std::thread::sleep(Duration::from_millis(200));
    fb.release();
    let deadline = std::time::Instant::now() + SOON;
    while col.len() < 6 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    let done = col.len();
    if done < 6 {
        // The array's drop would wait for the hung I/O: leave it and the readers behind.
        std::mem::forget(r);
        std::mem::forget(readers);
        panic!("only {done} of 6 reads completed: the array hangs");
    }
    for t in readers {
        t.join().unwrap();
    }
    assert!(
        col.take_all().iter().all(|(_, res)| res.is_err()),
        "a read succeeded with no leg able to read"
    );
    fa.clear();
    fb.clear();
}

/// Found by the NBD simulator's mirror exports (seeds 5097, 2491): during a resync, a read
/// past the resync point went to the first usable leg, which could be a recovering leg below
/// its offset, while the resync copies from the first in-sync leg to every other leg: a sector
/// read one value during the resync and another after it, with no write between. Reads there
/// now go to the resync's source.
///
/// Here (80 MiB legs: the resync held in the first barrier unit, the read in the second): leg
/// 0 recovers (its offset past the sector), a write reaches both legs, leg 1's own cache flush
/// makes it durable there only, the power fails, and the array comes back resyncing from leg 1.
#[test]
fn a_read_during_the_resync_reads_what_the_resync_copies() {
    let (a, fa) = fault_leg("80M", true);
    let (b, fb) = fault_leg("80M", true);
    let cfg = Raid1Config {
        bitmap_chunk: 0,
        ..cfg()
    };
    let r = Raid1::create(vec![a.clone(), b.clone()], cfg.clone()).unwrap();
    let unit = 64 * MB;
    let s = unit + MB; // in the second barrier unit
    assert!(r.limits().capacity > s + 2 * MB);
    write(&r, s, &pattern(1, 4096));
    flush(&r);
    r.set_sync_action(SyncAction::Frozen).unwrap();
    swap_leg(&r, 0, a.clone());
    // True: nothing was written while it was out.
    r.set_recovery_offset(0, s + 2 * MB).unwrap();
    r.sync_superblocks().unwrap();
    // Write 2 reaches both legs; leg 1 flushes its cache on its own, leg 0 does not.
    write(&r, s, &pattern(2, 4096));
    flush(b.as_ref());
    power_cut(r, &[&fa, &fb]);
    // The resync's first window (in the first unit) waits on its read of leg 1.
    let d = sb_of(b.as_ref()).data_offset;
    fb.add(Rule::stall(OpSet::READ).in_range(d, 4096));
    let r = Raid1::assemble(vec![a.clone(), b.clone()], cfg).unwrap();
    wait_until_within("the resync reads leg 1", SOON, || fb.stalled() > 0);
    let during = read(&r, s, 4096);
    fb.clear();
    fb.release();
    assert!(r.wait_sync_idle(IDLE));
    let after = read(&r, s, 4096);
    assert!(
        during == after,
        "read {} during the resync and {} after it, with no write between",
        which(&during),
        which(&after)
    );
}

/// A1, a leg whose superblock can be neither read nor written: the array assembles from the
/// other legs and does not use that one (it is failed when its superblock write fails).
#[test]
fn a1_a_leg_that_takes_no_superblock_does_not_stop_the_array() {
    let a = mem("16M");
    let (b, fb) = fault_leg("16M", false);
    {
        let r = Raid1::create(vec![a.clone(), b.clone()], cfg()).unwrap();
        write(&r, 2 * MB, &pattern(4, 8192));
    }
    fb.add(Rule::fail(OpSet::ALL).in_range(SB_OFFSET, SB_SIZE as u64));
    let r = Raid1::assemble(vec![a.clone(), b.clone()], cfg()).unwrap();
    assert!(r.assemble_warnings().iter().any(|w| w.contains("leg 1")));
    assert!(read(&r, 2 * MB, 8192) == pattern(4, 8192));
    for i in 0..r.slots() {
        if r.leg_device(i).is_some_and(|d| Arc::ptr_eq(&d, &b)) {
            assert!(
                r.leg_status(i).unwrap().faulty,
                "slot {i} uses the broken leg"
            );
        }
    }
}

/// After an unclean stop, reads past the resync point go to the resync's source from the
/// moment the array is assembled, and for as long as the resync is due, not only while a
/// resync pass runs (md sets `recovery_cp` at assembly). Here the resync cannot read its
/// first window and stops; slot 0 (the source) is write-mostly, so plain balancing would read
/// slot 1; the legs differ there. A read then, and one after the resync is asked for again,
/// must agree. Found by the NBD simulator's mirror exports (seed 7150: a sector read zeros,
/// then the write the resync copied over them, with no write between).
#[test]
fn reads_go_to_the_resync_source_while_a_resync_is_due() {
    let (a, fa) = fault_leg("16M", false);
    let (b, fb) = fault_leg("16M", false);
    let r = Raid1::create(vec![a.clone(), b.clone()], cfg()).unwrap();
    let d = r.data_offset();
    r.set_write_mostly(0, true).unwrap();
    write(&r, 3 * MB, &pattern(1, 4096));
    r.sync_superblocks().unwrap();
    r.crash_for_test();
    write(b.as_ref(), d + 3 * MB, &pattern(2, 4096));
    fa.add(Rule::fail(OpSet::READ).in_range(d + 3 * MB, 4096).next(1));
    fb.add(Rule::fail(OpSet::READ).in_range(d + 3 * MB, 4096).next(1));
    let r = Raid1::assemble(vec![a.clone(), b.clone()], cfg()).unwrap();
    assert!(r.leg_status(0).unwrap().write_mostly);
    assert!(r.wait_sync_idle(IDLE));
    let before = read(&r, 3 * MB, 4096);
    r.set_sync_action(SyncAction::Resync).unwrap();
    assert!(r.wait_sync_idle(IDLE));
    let after = read(&r, 3 * MB, 4096);
    assert!(
        before == after,
        "read {} while the resync was due and {} after it, with no write between",
        which(&before),
        which(&after)
    );
}

/// A resync's source, and the leg reads go to while it is due, is an in-sync leg that is not
/// write-mostly whenever there is one (md's `raid1_sync_request` takes a write-mostly leg only
/// when no other is in sync): a write-mostly leg is the remote one, behind with write-behind,
/// and after a crash the local leg holds the newer data. Here slot 0 is the write-mostly leg
/// (the first in-sync leg), a write at `s` is behind on it when the power fails (it reached
/// only its volatile cache; leg 1 flushed it), and the array comes back resyncing, held in its
/// first window (in the first barrier unit; `s` is in the second). A read of `s` during the
/// resync, after it, and both legs must hold the newer write.
#[test]
fn a_resync_copies_from_a_leg_that_is_not_write_mostly() {
    let (a, fa) = fault_leg("80M", true);
    let (b, fb) = fault_leg("80M", true);
    // raid1d's tick (bitmap flush epochs flush every leg) never comes: leg 0's cache keeps the
    // write until the power fails.
    let cfg = Raid1Config {
        write_behind: 4,
        tick: Duration::from_secs(3600),
        ..cfg()
    };
    let r = Raid1::create(vec![a.clone(), b.clone()], cfg.clone()).unwrap();
    r.set_write_mostly(0, true).unwrap();
    let unit = 64 * MB;
    let s = unit + MB; // in the second barrier unit
    assert!(r.limits().capacity > s + 2 * MB);
    // Chunk 0 dirty too: the resync's first window, where it is held below.
    write(&r, 0, &pattern(0, 4096));
    write(&r, s, &pattern(1, 8192));
    flush(&r);
    r.sync_superblocks().unwrap();
    // Write 2: acknowledged by leg 1, behind on leg 0; leg 1 flushes its cache on its own.
    write(&r, s, &pattern(2, 8192));
    flush(b.as_ref());
    power_cut(r, &[&fa, &fb]);
    let d = sb_of(b.as_ref()).data_offset;
    assert_eq!(
        read(a.as_ref(), d + s, 8192),
        pattern(1, 8192),
        "the write-mostly leg lost write 2"
    );
    // The resync's first window waits on its read, whichever leg it reads.
    fa.add(Rule::stall(OpSet::READ).in_range(d, 4096));
    fb.add(Rule::stall(OpSet::READ).in_range(d, 4096));
    let r = Raid1::assemble(vec![a.clone(), b.clone()], cfg).unwrap();
    assert!(r.leg_status(0).unwrap().write_mostly);
    wait_until_within("the resync reads its first window", SOON, || {
        fa.stalled() + fb.stalled() > 0
    });
    let during = read(&r, s, 8192);
    fa.clear();
    fb.clear();
    fa.release();
    fb.release();
    assert!(r.wait_sync_idle(IDLE));
    let after = read(&r, s, 8192);
    assert!(
        during == pattern(2, 8192) && after == pattern(2, 8192),
        "read {} during the resync and {} after it: the write-mostly leg's older data won",
        which(&during),
        which(&after)
    );
    assert_legs_equal(&r, a.as_ref(), b.as_ref());
}

/// The other half of md's rule: with only a write-mostly leg in sync, it is the resync's
/// source. Slot 0, write-mostly, is in sync; slot 1 recovers (its offset at 8 MiB) and holds a
/// write below its offset that never reached slot 0 before the crash: the resync copies slot
/// 0 over it.
#[test]
fn a_write_mostly_leg_alone_in_sync_is_still_the_resync_source() {
    let a = mem("16M");
    let b = mem("16M");
    let r = Raid1::create(vec![a.clone(), mem("16M")], cfg()).unwrap();
    let d = r.data_offset();
    r.set_write_mostly(0, true).unwrap();
    write(&r, MB, &pattern(1, 8192));
    flush(&r);
    r.set_sync_action(SyncAction::Frozen).unwrap();
    swap_leg(&r, 1, b.clone());
    pretend_recovered_to_8m(&r, a.as_ref(), b.as_ref());
    r.crash_for_test();
    write(b.as_ref(), d + MB, &pattern(2, 8192));
    let r = Raid1::assemble(vec![a.clone(), b.clone()], cfg()).unwrap();
    assert!(r.leg_status(0).unwrap().write_mostly);
    assert_eq!(r.leg_status(1).unwrap().recovery_offset, 8 * MB);
    assert!(r.wait_sync_idle(IDLE));
    assert!(r.leg_status(1).unwrap().in_sync);
    assert_legs_equal(&r, a.as_ref(), b.as_ref());
    assert_eq!(read(&r, MB, 8192), pattern(1, 8192));
}
