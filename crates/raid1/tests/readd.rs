//! The automatic re-add (`readd=auto`): a leg that failed on I/O errors and answers again is
//! put back and recovered from the bitmap by itself; one whose superblock tells another
//! history is refused, named and left untouched; one failed by hand stays failed. The legs
//! go away and come back through a `Forward` hook that fails every bio while a switch is on.
// A plain threaded test, never a loom model: it may use std::sync.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]
#![cfg(not(blkq_loom))]

mod common;
use common::*;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use blk::{Device, Error, Op, SECTOR_SHIFT};
use raid1::superblock::{Superblock, SB_OFFSET, SB_SIZE};
use raid1::{Raid1, Raid1Config, SyncAction};
use testkit::{wait_until_within, Forward};

const SOON: Duration = Duration::from_secs(30);
const IDLE: Duration = Duration::from_secs(60);

/// A leg over `mem`: every bio fails while `down` is on; `sb_reads` counts superblock reads
/// that reached it while it was up.
struct Flaky {
    down: Arc<AtomicBool>,
    sb_reads: Arc<AtomicU64>,
}

fn flaky(inner: Arc<dyn Device>) -> (Arc<dyn Device>, Flaky) {
    let down = Arc::new(AtomicBool::new(false));
    let sb_reads = Arc::new(AtomicU64::new(0));
    let (d, n) = (down.clone(), sb_reads.clone());
    let dev = Forward::on_submit(inner, move |inner, bio, end| {
        if d.load(Ordering::SeqCst) {
            end.end_io(
                bio,
                Err(Error::Io(std::io::Error::other("leg unreachable"))),
            );
            return;
        }
        if bio.op == Op::Read && bio.sector == SB_OFFSET >> SECTOR_SHIFT {
            n.fetch_add(1, Ordering::SeqCst);
        }
        inner.submit(bio, end)
    });
    (Arc::new(dev), Flaky { down, sb_reads })
}

/// 1 MiB chunks cleared 10 ms after their last write; re-add probes every 20 ms.
fn readd_cfg() -> Raid1Config {
    Raid1Config {
        bitmap_quiet: Duration::from_millis(10),
        readd_interval: Some(Duration::from_millis(20)),
        ..cfg()
    }
}

/// An array over `a` and a flaky leg over `b`, written everywhere and then quiet: every bit
/// is clear, so what is dirty later was written while the flaky leg was away.
fn array(a: Arc<dyn Device>, b: Arc<dyn Device>) -> (Raid1, Flaky) {
    let (leg, f) = flaky(b);
    let r = Raid1::create(vec![a, leg], readd_cfg()).unwrap();
    let cap = r.limits().capacity;
    let mut off = 0;
    while off < cap {
        write(&r, off, &pattern((off / MB) as u8, 64 << 10));
        off += MB;
    }
    flush(&r);
    wait_until_within("every bit cleared", SOON, || nr_dirty(&r) == 0);
    (r, f)
}

/// Takes leg 1 away and writes `chunks` (MiB indexes) through the degraded array.
fn away_and_write(r: &Raid1, f: &Flaky, chunks: &[u64]) {
    f.down.store(true, Ordering::SeqCst);
    for &c in chunks {
        write(r, c * MB + 8192, &pattern(100 + c as u8, 16 << 10));
    }
    flush(r);
    let st = r.leg_status(1).unwrap();
    assert!(st.faulty, "leg 1 failed on its write errors: {st:?}");
    assert!(r.is_degraded());
}

fn check_mismatches(r: &Raid1) -> u64 {
    r.set_sync_action(SyncAction::Check).unwrap();
    assert!(r.wait_sync_idle(IDLE));
    r.sync_progress().mismatch_cnt
}

#[test]
fn a_returning_leg_is_readded_and_recovers_only_the_chunks_written_while_away() {
    let (a, b) = (mem("16M"), mem("16M"));
    let (r, f) = array(a.clone(), b.clone());
    let copied0 = r.sync_progress().chunks_copied;
    away_and_write(&r, &f, &[1, 3, 5]);
    // Still away: the probe's error is kept for `detail`, the leg stays faulty.
    wait_until_within("a failed probe reported", SOON, || {
        r.readd_status(1).unwrap().last_error.is_some()
    });
    let rs = r.readd_status(1).unwrap();
    assert!(
        rs.probing && rs.refused.is_none() && rs.readds == 0,
        "{rs:?}"
    );
    assert!(r.leg_status(1).unwrap().faulty);
    // The array keeps serving while it is away.
    write(&r, 6 * MB, &pattern(106, 4096));
    assert_eq!(read(&r, 6 * MB, 4096), pattern(106, 4096));
    assert_eq!(
        nr_dirty(&r),
        4,
        "chunks 1, 3, 5 and 6 were written while degraded"
    );

    f.down.store(false, Ordering::SeqCst);
    wait_until_within("leg 1 back in sync", SOON, || {
        let st = r.leg_status(1).unwrap();
        st.in_sync && !st.faulty
    });
    assert!(r.wait_sync_idle(IDLE));
    assert_eq!(
        r.sync_progress().chunks_copied - copied0,
        4,
        "only the chunks dirtied while it was away are copied"
    );
    let rs = r.readd_status(1).unwrap();
    assert_eq!(rs.readds, 1);
    assert!(rs.last_error.is_none() && !rs.probing, "{rs:?}");
    assert_eq!(check_mismatches(&r), 0);
    assert_legs_equal(&r, a.as_ref(), b.as_ref());
    assert!(!r.is_degraded());
}

/// Every byte of a 16 MiB leg.
fn whole(leg: &dyn Device) -> Vec<u8> {
    (0..16)
        .flat_map(|m| read(leg, m * MB, MB as usize))
        .collect()
}

/// Writes `sb` as `leg`'s superblock, directly.
fn put_sb(leg: &dyn Device, sb: &Superblock) {
    let mut buf = vec![0u8; SB_SIZE];
    sb.encode_into(&mut buf).unwrap();
    write(leg, SB_OFFSET, &buf);
}

/// Leg 1 comes back carrying `change(its superblock)`: it is refused with a reason that
/// contains `why`, and neither its superblock nor its data are touched. With its own
/// superblock back, it is re-added.
fn refused_when(change: impl FnOnce(&mut Superblock), why: &str) {
    let (a, b) = (mem("16M"), mem("16M"));
    let (r, f) = array(a.clone(), b.clone());
    away_and_write(&r, &f, &[2]);
    let own = Raid1::read_superblock(b.as_ref()).unwrap();
    let mut other = own.clone();
    change(&mut other);
    put_sb(b.as_ref(), &other);
    let before = whole(b.as_ref());
    let reads0 = f.sb_reads.load(Ordering::SeqCst);
    f.down.store(false, Ordering::SeqCst);
    wait_until_within("the refusal", SOON, || {
        r.readd_status(1).unwrap().refused.is_some()
    });
    let refused = r.readd_status(1).unwrap().refused.unwrap();
    assert!(refused.contains(why), "{refused:?} names {why:?}");
    // Probed again and again (a changed superblock would be judged again), never re-added.
    wait_until_within("more probes", SOON, || {
        f.sb_reads.load(Ordering::SeqCst) >= reads0 + 3
    });
    let st = r.leg_status(1).unwrap();
    assert!(st.faulty && r.is_degraded(), "{st:?}");
    assert_eq!(r.readd_status(1).unwrap().readds, 0);
    assert!(whole(b.as_ref()) == before, "a refused leg is not written");
    // Its superblock changes back to this array's: judged again, and re-added.
    put_sb(b.as_ref(), &own);
    wait_until_within("leg 1 back in sync", SOON, || {
        let st = r.leg_status(1).unwrap();
        st.in_sync && !st.faulty
    });
    assert!(r.readd_status(1).unwrap().refused.is_none());
    assert!(r.wait_sync_idle(IDLE));
    assert_eq!(check_mismatches(&r), 0);
    assert_legs_equal(&r, a.as_ref(), b.as_ref());
}

#[test]
fn a_returning_leg_of_another_array_is_refused_and_untouched() {
    refused_when(
        |sb| sb.array_uuid = uuid::Uuid::new_v4(),
        "belongs to array",
    );
}

#[test]
fn a_returning_leg_that_moved_on_without_the_array_is_refused_and_untouched() {
    // It ran on its own (a failover): a new generation of its own, whatever its events.
    refused_when(
        |sb| {
            sb.events += 1;
            sb.lineage.rotate(sb.events);
        },
        "diverged",
    );
}

#[test]
fn a_returning_leg_that_names_another_slot_is_refused_and_untouched() {
    refused_when(
        |sb| sb.role = raid1::superblock::Role::Slot(0),
        "not slot 1's leg",
    );
}

#[test]
fn a_returning_leg_without_a_superblock_is_refused_and_untouched() {
    let (a, b) = (mem("16M"), mem("16M"));
    let (r, f) = array(a, b.clone());
    away_and_write(&r, &f, &[2]);
    write(b.as_ref(), SB_OFFSET, &vec![0u8; SB_SIZE]);
    f.down.store(false, Ordering::SeqCst);
    wait_until_within("the refusal", SOON, || {
        r.readd_status(1).unwrap().refused.is_some()
    });
    let why = r.readd_status(1).unwrap().refused.unwrap();
    assert!(why.contains("no superblock of this array"), "{why}");
    assert!(r.leg_status(1).unwrap().faulty);
    assert!(read(b.as_ref(), SB_OFFSET, SB_SIZE).iter().all(|&x| x == 0));
}

#[test]
fn a_leg_failed_by_hand_is_never_readded() {
    let (a, b, c) = (mem("16M"), mem("16M"), mem("16M"));
    let (leg2, f) = flaky(c);
    let r = Raid1::create(vec![a, b, leg2], readd_cfg()).unwrap();
    r.fail_leg(1).unwrap();
    assert!(!r.readd_status(1).unwrap().probing);
    // Leg 2 fails on errors and comes back: re-added by the same probe passes that never
    // touch leg 1.
    away_and_write(&r, &f, &[1]);
    assert!(r.leg_status(2).unwrap().faulty);
    f.down.store(false, Ordering::SeqCst);
    wait_until_within("leg 2 back in sync", SOON, || {
        let st = r.leg_status(2).unwrap();
        st.in_sync && !st.faulty
    });
    let st = r.leg_status(1).unwrap();
    assert!(st.faulty, "failed by hand: stays failed ({st:?})");
    assert_eq!(r.readd_status(1).unwrap().readds, 0);
}

#[test]
fn without_readd_a_failed_leg_is_not_probed() {
    let (a, b) = (mem("16M"), mem("16M"));
    let (leg, f) = flaky(b);
    let r = Raid1::create(
        vec![a, leg],
        Raid1Config {
            readd_interval: None,
            ..readd_cfg()
        },
    )
    .unwrap();
    away_and_write(&r, &f, &[1]);
    assert_eq!(r.readd_status(1).unwrap(), raid1::ReaddStatus::default());
}

#[test]
fn readd_options_parse() {
    let mut c = Raid1Config::default();
    assert_eq!(c.readd_interval, None);
    c.set_option("readd", "auto").unwrap();
    assert_eq!(c.readd_interval, Some(raid1::DEFAULT_READD_INTERVAL));
    c.set_option("readd_interval_ms", "250").unwrap();
    assert_eq!(c.readd_interval, Some(Duration::from_millis(250)));
    c.set_option("readd", "auto").unwrap();
    assert_eq!(c.readd_interval, Some(Duration::from_millis(250)));
    c.set_option("readd", "off").unwrap();
    assert_eq!(c.readd_interval, None);
    assert!(c.set_option("readd", "maybe").is_err());
    assert!(c.set_option("readd_interval_ms", "0").is_err());
}

#[test]
fn a_leg_that_keeps_failing_its_recovery_is_probed_less_and_less_often() {
    use blk_drivers::fault::{FaultConfig, FaultDevice, OpSet, Rule};
    let a = mem("16M");
    let f = FaultDevice::new(mem("16M"), FaultConfig::default());
    let h = f.handle();
    let b: Arc<dyn Device> = Arc::new(f);
    let r = Raid1::create(vec![a, b.clone()], readd_cfg()).unwrap();
    // A bad area in leg 1's data: its superblock answers, its recovery never gets through.
    let rule = h.add(Rule::fail(OpSet::WRITE).in_range(r.data_offset(), 8 * MB));
    write(&r, 0, &pattern(1, 4096));
    wait_until_within("three re-adds that failed again", SOON, || {
        r.readd_status(1).unwrap().readds >= 3
    });
    let rs = r.readd_status(1).unwrap();
    assert!(!r.leg_status(1).unwrap().in_sync);
    assert!(
        rs.backoff >= 3 && u64::from(rs.backoff) == rs.readds,
        "{rs:?}"
    );
    // Repaired: the next re-add gets through, and the wait is back to one interval.
    h.remove(rule);
    wait_until_within("leg 1 back in sync", SOON, || {
        let st = r.leg_status(1).unwrap();
        st.in_sync && !st.faulty
    });
    wait_until_within("the backoff forgotten", SOON, || {
        r.readd_status(1).unwrap().backoff == 0
    });
    assert!(r.wait_sync_idle(IDLE));
    assert_eq!(check_mismatches(&r), 0);
}

/// A leg the array was assembled without (its device could not be opened then) and that
/// opens later is judged as a returning leg by `readd_absent`: another array's, another
/// slot's or a history that went on without the array is refused and not written; its own
/// is taken back into its slot and recovers only what was written while it was away.
#[test]
fn a_leg_assembled_without_is_judged_when_it_opens_and_taken_back() {
    use raid1::AbsentError;
    let (a, b) = (mem("16M"), mem("16M"));
    let (r, _f) = array(a.clone(), b.clone());
    drop(r);
    let r = Raid1::assemble(
        vec![a.clone()],
        Raid1Config {
            allow_degraded: true,
            ..readd_cfg()
        },
    )
    .unwrap();
    assert!(!r.leg_status(1).unwrap().present);
    let copied0 = r.sync_progress().chunks_copied;
    for c in [2u64, 9] {
        write(&r, c * MB + 4096, &pattern(50 + c as u8, 8192));
    }
    flush(&r);
    let own = Raid1::read_superblock(b.as_ref()).unwrap();
    // What a write to the leg would change: its superblock and bitmap, and the chunks a
    // recovery would copy.
    let doff = r.data_offset();
    let written = || {
        let mut v = read(b.as_ref(), 0, doff as usize);
        for c in [2u64, 9] {
            v.extend(read(b.as_ref(), doff + c * MB, 16 << 10));
        }
        v
    };
    let refused = |change: &dyn Fn(&mut Superblock), why: &str| {
        let mut other = own.clone();
        change(&mut other);
        put_sb(b.as_ref(), &other);
        let before = written();
        match r.readd_absent(b.clone()) {
            Err(AbsentError::Refused(w)) => assert!(w.contains(why), "{w:?} names {why:?}"),
            other => panic!("{other:?}: not refused ({why})"),
        }
        assert!(written() == before, "a refused leg is not written");
        assert!(!r.leg_status(1).unwrap().present);
    };
    refused(
        &|sb| sb.array_uuid = uuid::Uuid::new_v4(),
        "belongs to array",
    );
    refused(
        &|sb| sb.role = raid1::superblock::Role::Slot(0),
        "the slot holds another leg",
    );
    refused(&|sb| sb.role = raid1::superblock::Role::Spare, "a spare's");
    refused(
        &|sb| {
            sb.events += 1;
            sb.lineage.rotate(sb.events);
        },
        "diverged",
    );
    refused(
        &|sb| sb.leg_uuid = uuid::Uuid::new_v4(),
        "the slot names leg",
    );
    put_sb(b.as_ref(), &own);
    assert_eq!(
        r.readd_absent(b.clone()),
        Ok((1, true)),
        "a bitmap recovery"
    );
    assert!(r.wait_sync_idle(IDLE));
    let st = r.leg_status(1).unwrap();
    assert!(st.in_sync && !st.faulty, "{st:?}");
    assert_eq!(r.sync_progress().chunks_copied - copied0, 2);
    assert_eq!(r.readd_status(1).unwrap().readds, 1);
    assert_eq!(check_mismatches(&r), 0);
    assert_legs_equal(&r, a.as_ref(), b.as_ref());
    // Back in its slot: nothing to take back any more.
    assert!(matches!(
        r.readd_absent(b.clone()),
        Err(AbsentError::Gone(_))
    ));
}

/// A leg too small for the array is refused with both sizes: the leg's and the one it needs
/// (the array's data plus its data offset).
#[test]
fn a_too_small_leg_is_refused_with_its_size_and_the_size_it_needs() {
    let r = Raid1::create(vec![mem("16M"), mem("16M")], cfg()).unwrap();
    r.fail_leg(1).unwrap();
    r.remove_leg(1).unwrap();
    let need = r.data_offset() + r.limits().capacity;
    let e = r.add_leg(mem("8M")).unwrap_err().to_string();
    assert!(
        e.contains(&(8u64 << 20).to_string()) && e.contains(&need.to_string()),
        "{e}"
    );
}
