//! The sync thread over `mem` legs: resync after an unclean stop, bitmap and full recovery,
//! re-add, check/repair, regular I/O during a resync, the speed limit, replace, resume.
//! Deterministic: no timing assertions beyond generous deadlines.
// A plain threaded test or benchmark, never a loom model: its own harness (std locks, atomics,
// condition variables, baselines) is not what a model must explore, so it may use std::sync.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]
#![cfg(not(blkq_loom))]

mod common;
use common::*;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use blk::{Device, Error, Op, SECTOR_SHIFT};
use raid1::barrier::BarrierMode;
use raid1::{Raid1, Raid1Config, SyncAction};
use testkit::Forward;

const IDLE: Duration = Duration::from_secs(60);

#[test]
fn sync_action_names_are_mds() {
    for (a, n) in [
        (SyncAction::Idle, "idle"),
        (SyncAction::Resync, "resync"),
        (SyncAction::Recover, "recover"),
        (SyncAction::Check, "check"),
        (SyncAction::Repair, "repair"),
        (SyncAction::Frozen, "frozen"),
    ] {
        assert_eq!(a.to_string(), n);
        assert_eq!(n.parse::<SyncAction>().unwrap(), a);
    }
    assert!("scrub".parse::<SyncAction>().is_err());
    let r = Raid1::create(vec![mem("8M"), mem("8M")], cfg()).unwrap();
    assert_eq!(r.speed_limits(), (1000, 200_000));
    r.set_speed_limits(10, 20);
    assert_eq!(r.speed_limits(), (10, 20));
    assert!(r.wait_sync_idle(IDLE));
    assert_eq!(r.sync_action(), SyncAction::Idle);
}

#[test]
fn unclean_stop_resyncs_only_the_dirty_chunks() {
    let (a, b) = (mem("16M"), mem("16M"));
    let doff;
    {
        let r = Raid1::create(vec![a.clone(), b.clone()], cfg()).unwrap();
        doff = r.data_offset();
        for (i, off) in [0, 5 * MB, 9 * MB + 4096].into_iter().enumerate() {
            write(&r, off, &pattern(i as u8, 64 << 10));
        }
        assert_eq!(nr_dirty(&r), 3);
        r.crash_for_test();
    }
    // A write that reached only leg 1 before the crash, inside a dirty chunk.
    write(b.as_ref(), doff + 5 * MB, &pattern(99, 8192));
    let r = Raid1::assemble(vec![a.clone(), b.clone()], cfg()).unwrap();
    assert!(r.wait_sync_idle(IDLE));
    let p = r.sync_progress();
    assert_eq!(p.chunks_copied, 3, "only the dirty chunks are copied");
    assert_eq!(p.action, SyncAction::Idle);
    assert_legs_equal(&r, a.as_ref(), b.as_ref());
    assert_eq!(read(&r, 5 * MB, 64 << 10), pattern(1, 64 << 10));
    assert_eq!(nr_dirty(&r), 0, "bits cleared after the resync");
    drop(r);
    // Stopped cleanly now: no resync next time.
    let r = Raid1::assemble(vec![a, b], cfg()).unwrap();
    assert!(r.wait_sync_idle(IDLE));
    assert_eq!(r.sync_progress().chunks_copied, 0);
}

#[test]
fn unclean_stop_without_bitmap_resyncs_everything() {
    let c = Raid1Config {
        bitmap_chunk: 0,
        ..cfg()
    };
    let (a, b) = (mem("8M"), mem("8M"));
    let doff;
    {
        let r = Raid1::create(vec![a.clone(), b.clone()], c.clone()).unwrap();
        doff = r.data_offset();
        write(&r, MB, &pattern(3, 4096));
        r.crash_for_test();
    }
    write(b.as_ref(), doff + 3 * MB, &pattern(7, 4096));
    let r = Raid1::assemble(vec![a.clone(), b.clone()], c).unwrap();
    assert!(r.wait_sync_idle(IDLE));
    assert!(r.sync_progress().chunks_copied >= r.limits().capacity / MB);
    assert_legs_equal(&r, a.as_ref(), b.as_ref());
}

#[test]
fn readded_leg_recovers_only_the_dirty_chunks() {
    let (a, b) = (mem("16M"), mem("16M"));
    let r = Raid1::create(vec![a.clone(), b.clone()], cfg()).unwrap();
    write(&r, 0, &pattern(1, 4096));
    r.fail_leg(1).unwrap();
    let dev = r.remove_leg(1).unwrap();
    // Writes leg 1 misses.
    write(&r, 3 * MB, &pattern(2, 128 << 10));
    write(&r, 7 * MB + 512, &pattern(3, 4096));
    let dirty = nr_dirty(&r);
    assert_eq!(dirty, 3);
    assert_eq!(r.add_leg(dev).unwrap(), 1, "re-added into its old slot");
    assert!(r.wait_sync_idle(IDLE));
    let p = r.sync_progress();
    assert_eq!(p.chunks_copied, dirty);
    let st = r.leg_status(1).unwrap();
    assert!(st.in_sync && !st.faulty);
    assert!(!r.is_degraded());
    assert_legs_equal(&r, a.as_ref(), b.as_ref());
    assert_eq!(nr_dirty(&r), 0, "bits cleared after the recovery");
    // The recovered leg serves reads correctly on its own.
    r.fail_leg(0).unwrap();
    assert_eq!(read(&r, 3 * MB, 128 << 10), pattern(2, 128 << 10));
}

#[test]
fn new_leg_recovers_fully() {
    let (a, b, c) = (mem("16M"), mem("16M"), mem("16M"));
    let r = Raid1::create(vec![a.clone(), b], cfg()).unwrap();
    write(&r, 2 * MB, &pattern(5, 256 << 10));
    r.fail_leg(1).unwrap();
    r.remove_leg(1).unwrap();
    let slot = r.add_leg(c.clone()).unwrap();
    assert!(r.wait_sync_idle(IDLE));
    let nr_chunks = r.bitmap().unwrap().nr_chunks();
    assert_eq!(r.sync_progress().chunks_copied, nr_chunks);
    assert!(r.leg_status(slot).unwrap().in_sync);
    assert_legs_equal(&r, a.as_ref(), c.as_ref());
}

#[test]
fn check_counts_mismatches_and_repair_fixes_them() {
    let (a, b) = (mem("8M"), mem("8M"));
    let r = Raid1::create(vec![a.clone(), b.clone()], cfg()).unwrap();
    write(&r, MB, &pattern(1, 64 << 10));
    r.set_sync_action(SyncAction::Check).unwrap();
    assert!(r.wait_sync_idle(IDLE));
    assert_eq!(r.sync_progress().mismatch_cnt, 0);
    // Corrupt 3 sectors of leg 1 directly (2 in one place, 1 elsewhere).
    let doff = r.data_offset();
    write(b.as_ref(), doff + MB + 4096, &[0xAA; 1024]);
    write(b.as_ref(), doff + 6 * MB, &[0x55; 512]);
    r.set_sync_action(SyncAction::Check).unwrap();
    assert!(r.wait_sync_idle(IDLE));
    assert_eq!(r.sync_progress().mismatch_cnt, 3);
    assert!(
        leg_data(&r, a.as_ref()) != leg_data(&r, b.as_ref()),
        "check changes nothing"
    );
    r.set_sync_action(SyncAction::Repair).unwrap();
    assert!(r.wait_sync_idle(IDLE));
    assert_eq!(r.sync_progress().mismatch_cnt, 3);
    assert_legs_equal(&r, a.as_ref(), b.as_ref());
    r.set_sync_action(SyncAction::Check).unwrap();
    assert!(r.wait_sync_idle(IDLE));
    assert_eq!(r.sync_progress().mismatch_cnt, 0);
}

#[test]
fn tiny_speed_limit_holds_a_check_back_and_idle_stops_it() {
    let r = Raid1::create(vec![mem("8M"), mem("8M")], cfg()).unwrap();
    r.set_speed_limits(1, 1);
    r.set_sync_action(SyncAction::Check).unwrap();
    // At 1 KiB/s the first window alone takes over 15 minutes: not done "instantly".
    assert!(!r.wait_sync_idle(Duration::from_millis(300)));
    assert_eq!(r.sync_action(), SyncAction::Check);
    let p = r.sync_progress();
    assert!(p.done_bytes < p.total_bytes);
    // Frozen pauses it, idle stops it.
    r.set_sync_action(SyncAction::Frozen).unwrap();
    assert!(r.wait_sync_idle(IDLE));
    assert_eq!(r.sync_action(), SyncAction::Frozen);
    r.set_sync_action(SyncAction::Idle).unwrap();
    assert!(r.wait_sync_idle(IDLE));
    assert_eq!(r.sync_action(), SyncAction::Idle);
    // A raised limit lets a new check finish.
    r.set_speed_limits(1000, 10_000_000);
    r.set_sync_action(SyncAction::Check).unwrap();
    assert!(r.wait_sync_idle(IDLE));
    assert_eq!(r.sync_progress().done_bytes, r.limits().capacity);
}

/// md's min-vs-busy rule: above `sync_speed_min` a pass pauses for regular I/O in flight; at
/// a min it cannot reach it never does. Legs with 200 us of latency and a reader that keeps
/// one read in flight make the array busy for the whole pass.
fn check_yields_under_load(min_kib_s: u64) -> u64 {
    let leg = "null:16M,completion=timer,completion_nsec=200000";
    let r = Arc::new(Raid1::create(vec![spec(leg), spec(leg)], cfg()).unwrap());
    assert!(r.wait_sync_idle(IDLE));
    r.set_speed_limits(min_kib_s, 10_000_000);
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let load = {
        let (r, stop, done) = (r.clone(), stop.clone(), done.clone());
        std::thread::spawn(move || {
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let _ = read(r.as_ref(), (i % 4000) * 4096, 4096);
                done.fetch_add(1, Ordering::Relaxed);
                i += 1;
            }
        })
    };
    while done.load(Ordering::Relaxed) < 10 {
        std::thread::sleep(Duration::from_millis(1));
    }
    let before = r.sync_progress().yields;
    r.set_sync_action(SyncAction::Check).unwrap();
    assert!(r.wait_sync_idle(IDLE));
    stop.store(true, Ordering::Relaxed);
    load.join().unwrap();
    assert_eq!(r.sync_progress().done_bytes, r.limits().capacity);
    r.sync_progress().yields - before
}

#[test]
fn busy_array_pass_gives_way_above_the_min_only() {
    assert!(
        check_yields_under_load(1) > 0,
        "a pass above its min paused for regular I/O"
    );
    assert_eq!(
        check_yields_under_load(1 << 40),
        0,
        "a pass below its min never pauses"
    );
}

#[test]
fn regular_io_keeps_working_during_a_resync() {
    for mode in [BarrierMode::Lockless, BarrierMode::Locked] {
        io_during_resync(mode);
    }
}

fn io_during_resync(mode: BarrierMode) {
    let c = Raid1Config {
        bitmap_chunk: 0,
        barrier: mode,
        ..cfg()
    };
    let (a, b) = (mem("16M"), mem("16M"));
    let doff;
    {
        let r = Raid1::create(vec![a.clone(), b.clone()], c.clone()).unwrap();
        doff = r.data_offset();
        r.crash_for_test();
    }
    // The legs disagree everywhere the test reads before the resync gets there.
    for i in 0..14u64 {
        write(b.as_ref(), doff + i * MB, &pattern(200, 4096));
    }
    let r = Arc::new(Raid1::assemble(vec![a.clone(), b.clone()], c).unwrap());
    // Hold the resync after its first window.
    r.set_speed_limits(1, 1);
    let seen_resync = Arc::new(AtomicBool::new(false));
    let ops = Arc::new(AtomicU64::new(0));
    let cap = r.limits().capacity;
    let mut ts = Vec::new();
    for t in 0..2u8 {
        let (r, seen, ops) = (r.clone(), seen_resync.clone(), ops.clone());
        ts.push(std::thread::spawn(move || {
            for i in 0..40u64 {
                let off = ((i * 7 + u64::from(t) * 3) % (cap / MB)) * MB + u64::from(t) * 8192;
                let data = pattern(t * 50 + i as u8, 8192);
                write(r.as_ref(), off, &data);
                if r.sync_action() == SyncAction::Resync {
                    seen.store(true, Ordering::Relaxed);
                }
                assert_eq!(read(r.as_ref(), off, 8192), data);
                // Reads anywhere are consistent (the same leg answers past the resync point).
                let x = read(r.as_ref(), (i % (cap / MB)) * MB + 65536, 4096);
                let y = read(r.as_ref(), (i % (cap / MB)) * MB + 65536, 4096);
                assert_eq!(x, y);
                ops.fetch_add(1, Ordering::Relaxed);
            }
        }));
    }
    for t in ts {
        t.join().unwrap();
    }
    assert!(
        seen_resync.load(Ordering::Relaxed),
        "I/O ran during the resync"
    );
    assert_eq!(r.sync_action(), SyncAction::Resync);
    r.set_speed_limits(1000, 10_000_000);
    assert!(r.wait_sync_idle(IDLE));
    assert_eq!(ops.load(Ordering::Relaxed), 80);
    assert_legs_equal(&r, a.as_ref(), b.as_ref());
}

#[test]
fn replace_moves_the_data_to_the_new_leg() {
    let (a, b, c) = (mem("16M"), mem("16M"), mem("16M"));
    let r = Raid1::create(vec![a, b.clone()], cfg()).unwrap();
    write(&r, 4 * MB, &pattern(9, 64 << 10));
    let slot = r.replace_leg(0, c.clone()).unwrap();
    assert_eq!(slot, 2);
    assert!(!r.leg_status(0).unwrap().present);
    assert!(r.leg_status(slot).unwrap().in_sync);
    assert!(!r.is_degraded());
    assert_legs_equal(&r, b.as_ref(), c.as_ref());
    assert_eq!(read(&r, 4 * MB, 64 << 10), pattern(9, 64 << 10));
}

#[test]
fn interrupted_recovery_resumes_from_its_offset() {
    let (a, b, c) = (mem("16M"), mem("16M"), mem("16M"));
    let nr_chunks;
    let offset;
    {
        let r = Raid1::create(vec![a.clone(), b], cfg()).unwrap();
        write(&r, 10 * MB, &pattern(4, 4096));
        r.fail_leg(1).unwrap();
        r.remove_leg(1).unwrap();
        r.set_speed_limits(1, 1);
        r.add_leg(c.clone()).unwrap();
        // Held after its first window.
        assert!(!r.wait_sync_idle(Duration::from_millis(300)));
        nr_chunks = r.bitmap().unwrap().nr_chunks();
        drop(r);
        let sb = {
            let buf = read(
                c.as_ref(),
                raid1::superblock::SB_OFFSET,
                raid1::superblock::SB_SIZE,
            );
            raid1::superblock::Superblock::decode(&buf).unwrap()
        };
        offset = sb.legs[1].recovery_offset.expect("recovering");
        assert!(offset > 0 && offset < 16 * MB);
    }
    let r = Raid1::assemble(vec![a.clone(), c.clone()], cfg()).unwrap();
    assert!(r.wait_sync_idle(IDLE));
    assert_eq!(r.sync_progress().chunks_copied, nr_chunks - offset / MB);
    assert!(r.leg_status(1).unwrap().in_sync);
    assert_legs_equal(&r, a.as_ref(), c.as_ref());
}

#[test]
fn odd_sized_array_recovers_and_checks_its_tail() {
    let (a, b, c) = (mem("9100K"), mem("9100K"), mem("9100K"));
    let r = Raid1::create(vec![a.clone(), b], cfg()).unwrap();
    let cap = r.limits().capacity;
    assert!(!cap.is_multiple_of(MB), "the last window is short");
    write(&r, cap - 4096, &pattern(6, 4096));
    r.fail_leg(1).unwrap();
    r.remove_leg(1).unwrap();
    r.add_leg(c.clone()).unwrap();
    assert!(r.wait_sync_idle(IDLE));
    assert_eq!(r.sync_progress().done_bytes, cap);
    assert_legs_equal(&r, a.as_ref(), c.as_ref());
    r.set_sync_action(SyncAction::Check).unwrap();
    assert!(r.wait_sync_idle(IDLE));
    assert_eq!(r.sync_progress().mismatch_cnt, 0);
}

#[test]
fn leg_missing_at_assemble_is_readded_with_a_bitmap_recovery() {
    let (a, b) = (mem("16M"), mem("16M"));
    {
        let r = Raid1::create(vec![a.clone(), b.clone()], cfg()).unwrap();
        write(&r, 0, &pattern(1, 4096));
    }
    // b is missing at the next start (allowed: a new generation); writes it misses.
    let alone = Raid1Config {
        allow_degraded: true,
        ..cfg()
    };
    let r = Raid1::assemble(vec![a.clone()], alone).unwrap();
    assert!(r.is_degraded());
    write(&r, 2 * MB, &pattern(2, 4096));
    write(&r, 5 * MB, &pattern(3, 4096));
    let dirty = nr_dirty(&r);
    assert!(dirty < r.bitmap().unwrap().nr_chunks());
    assert_eq!(r.add_leg(b.clone()).unwrap(), 1, "back in its slot");
    assert!(r.wait_sync_idle(IDLE));
    assert_eq!(r.sync_progress().chunks_copied, dirty);
    assert!(!r.is_degraded());
    assert_legs_equal(&r, a.as_ref(), b.as_ref());
}

#[test]
fn replace_with_a_failing_leg_keeps_the_old_one() {
    let (a, b) = (mem("16M"), mem("16M"));
    let r = Raid1::create(vec![a, b.clone()], cfg()).unwrap();
    write(&r, MB, &pattern(8, 4096));
    // A leg whose writes into the data area fail (its superblock area still works).
    let from_sector = r.data_offset() >> SECTOR_SHIFT;
    let bad: Arc<dyn Device> = Arc::new(Forward::on_submit(mem("16M"), move |inner, bio, end| {
        if bio.op == Op::Write && bio.end_sector() > from_sector {
            end.end_io(bio, Err(Error::Io(std::io::Error::other("injected"))));
        } else {
            inner.submit(bio, end);
        }
    }));
    assert!(r.replace_leg(0, bad).is_err());
    let st0 = r.leg_status(0).unwrap();
    assert!(st0.present && st0.in_sync && !st0.faulty);
    assert!(r.leg_status(2).unwrap().faulty);
    assert!(r.wait_sync_idle(IDLE));
    assert_eq!(read(&r, MB, 4096), pattern(8, 4096));
    // The faulty replacement goes; the array is whole again.
    r.remove_leg(2).unwrap();
    assert!(!r.is_degraded());
}

/// The bytes a file occupies on disk (its allocated blocks).
fn allocated(path: &std::path::Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).unwrap().blocks() * 512
}

#[test]
fn a_recovery_onto_a_sparse_file_keeps_the_holes_of_the_source() {
    let dir = tempfile::tempdir().unwrap();
    let path = |n: &str| dir.path().join(n);
    for n in ["a.img", "b.img", "c.img"] {
        std::fs::File::create(path(n))
            .unwrap()
            .set_len(32 * MB)
            .unwrap();
    }
    let leg = |n: &str| spec(&format!("file:{}", path(n).display()));
    let (a, b, c) = (leg("a.img"), leg("b.img"), leg("c.img"));
    let probe = path("probe");
    std::fs::write(&probe, vec![1u8; 1 << 20]).unwrap();
    if allocated(&probe) < 1 << 20 {
        eprintln!("skipped: this file system does not report allocated blocks");
        return;
    }
    let r = Raid1::create(vec![a.clone(), b], cfg()).unwrap();
    write(&r, 2 * MB, &pattern(5, 1 << 20));
    r.fail_leg(1).unwrap();
    r.remove_leg(1).unwrap();
    let slot = r.add_leg(c.clone()).unwrap();
    assert!(r.wait_sync_idle(IDLE));
    assert!(r.leg_status(slot).unwrap().in_sync);
    assert_legs_equal(&r, a.as_ref(), c.as_ref());
    let (src, dst) = (allocated(&path("a.img")), allocated(&path("c.img")));
    assert!(
        dst <= src + 2 * MB,
        "the recovered leg holds {dst} bytes on disk, its source {src}: the recovery \
         wrote the source's holes as data"
    );
}

/// A check tells its progress every tenth of the array, as a recovery and a resync do, so an
/// operator watching `blkq raid monitor` sees a long check advance.
#[test]
fn a_check_tells_its_progress_every_tenth() {
    let r = Raid1::create(vec![mem("16M"), mem("16M")], cfg()).unwrap();
    assert!(r.wait_sync_idle(IDLE));
    let sub = r.subscribe();
    r.set_sync_action(SyncAction::Check).unwrap();
    assert!(r.wait_sync_idle(IDLE));
    let mut percents = Vec::new();
    let mut finished = false;
    while let Some(rec) = sub.next_until(std::time::Instant::now() + Duration::from_secs(5)) {
        match rec.event.name() {
            "check_progress" => percents.push(rec.to_string()),
            "check_finished" => {
                finished = true;
                break;
            }
            _ => {}
        }
    }
    assert!(finished, "no check_finished event");
    assert_eq!(percents.len(), 9, "one per tenth, 10% to 90%: {percents:?}");
}
