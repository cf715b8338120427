//! Per-block checksums (`integrity=crc32c`): a block corrupted on one leg is never returned
//! and is healed from the other; on every leg the read fails; check names the bad leg and
//! repair rewrites it from the good one; a crash leaves torn blocks settled, not reported.

mod common;

use std::time::Duration;

use blk::Device;
use blkq_sync::DynArc as Arc;
use common::*;
use raid1::{Algorithm, Event, Raid1, Raid1Config, SyncAction};

const BLK: usize = 4096;

fn icfg() -> Raid1Config {
    Raid1Config {
        integrity: Some(Algorithm::Crc32c),
        ..cfg()
    }
}

fn legs() -> (Arc<dyn Device>, Arc<dyn Device>) {
    (mem("16M"), mem("16M"))
}

/// Flips one bit of the leg's copy of array byte `at`, behind the array's back.
fn flip(r: &Raid1, leg: &dyn Device, at: u64) {
    let pos = r.data_offset() + at;
    let base = pos / BLK as u64 * BLK as u64;
    let mut b = read(leg, base, BLK);
    b[(pos - base) as usize] ^= 0x20;
    write(leg, base, &b);
}

/// A new array with integrity on `a` and `b` holding `data` from offset 0, stopped cleanly
/// (the sums of `data` on both legs).
fn created_holding(a: &Arc<dyn Device>, b: &Arc<dyn Device>, data: &[u8]) {
    let r = Raid1::create(vec![a.clone(), b.clone()], icfg()).unwrap();
    write(&r, 0, data);
}

/// A new array with integrity on two memory legs, holding `pattern(seed, blocks * BLK)` from
/// offset 0: the legs, the array and the data.
fn holding(seed: u8, blocks: usize) -> (Arc<dyn Device>, Arc<dyn Device>, Raid1, Vec<u8>) {
    let (a, b) = legs();
    let r = Raid1::create(vec![a.clone(), b.clone()], icfg()).unwrap();
    let data = pattern(seed, blocks * BLK);
    write(&r, 0, &data);
    (a, b, r, data)
}

/// The array assembled from `leg` alone (degraded).
fn assemble_alone(leg: &Arc<dyn Device>) -> Raid1 {
    let cfg = Raid1Config {
        allow_degraded: true,
        ..cfg()
    };
    Raid1::assemble(vec![leg.clone()], cfg).unwrap()
}

fn counts(r: &Raid1) -> raid1::IntegrityCounts {
    r.integrity().expect("integrity on").1
}

#[test]
fn an_array_with_integrity_has_4k_blocks_and_says_so() {
    let (a, b) = legs();
    let r = Raid1::create(vec![a.clone(), b], icfg()).unwrap();
    assert_eq!(r.limits().logical_block_size, 4096);
    assert_eq!(r.integrity().unwrap().0, Algorithm::Crc32c);
    assert_eq!(
        Raid1::read_superblock(a.as_ref())
            .unwrap()
            .integrity
            .unwrap()
            .algorithm,
        Algorithm::Crc32c
    );
    let plain = Raid1::create(vec![mem("16M"), mem("16M")], cfg()).unwrap();
    assert!(plain.integrity().is_none());
}

#[test]
fn a_bit_flipped_on_one_leg_is_never_returned_and_is_healed_from_the_other() {
    let (a, b, r, data) = holding(7, 64);
    let sub = r.subscribe();
    // Every read goes to one leg or the other: corrupt both legs, different blocks.
    flip(&r, a.as_ref(), 5 * BLK as u64 + 100);
    flip(&r, b.as_ref(), 9 * BLK as u64 + 7);
    for _ in 0..4 {
        assert!(read(&r, 0, data.len()) == data, "bad data returned");
    }
    assert_eq!(counts(&r).healed, 2);
    assert_eq!(counts(&r).unrecoverable, 0);
    assert_eq!(r.leg_status(0).unwrap().checksum_errors, 1);
    assert_eq!(r.leg_status(1).unwrap().checksum_errors, 1);
    // Healed on the legs themselves, and nobody failed.
    assert!(read(a.as_ref(), r.data_offset(), data.len()) == data);
    assert!(read(b.as_ref(), r.data_offset(), data.len()) == data);
    assert!(r.leg_status(0).unwrap().in_sync && r.leg_status(1).unwrap().in_sync);
    let mut seen = Vec::new();
    while let Some(rec) = sub.try_next() {
        if let Event::Corrupt {
            slot,
            offset,
            blocks,
            healed,
        } = rec.event
        {
            seen.push((slot, offset, blocks, healed));
        }
    }
    seen.sort();
    assert_eq!(
        seen,
        vec![(0, 5 * BLK as u64, 1, true), (1, 9 * BLK as u64, 1, true)]
    );
}

#[test]
fn a_block_bad_on_every_leg_fails_the_read_and_its_neighbours_still_read() {
    let (a, b, r, data) = holding(3, 8);
    flip(&r, a.as_ref(), 2 * BLK as u64);
    flip(&r, b.as_ref(), 2 * BLK as u64 + 1);
    assert!(testkit::io::read_at(&r, 0, data.len()).is_err());
    assert!(testkit::io::read_at(&r, 2 * BLK as u64, BLK).is_err());
    assert!(read(&r, 3 * BLK as u64, 5 * BLK) == data[3 * BLK..]);
    assert!(counts(&r).unrecoverable >= 1);
    // A write of the block makes it whole again.
    write(&r, 2 * BLK as u64, &data[2 * BLK..3 * BLK]);
    assert!(read(&r, 0, data.len()) == data);
}

#[test]
fn check_names_the_bad_leg_and_repair_rewrites_it_from_the_good_one() {
    let (a, b, r, data) = holding(11, 256);
    flush(&r);
    // The source of a check (slot 0) is the bad one: repair must not copy it over slot 1.
    flip(&r, a.as_ref(), 17 * BLK as u64 + 3);
    flip(&r, a.as_ref(), 200 * BLK as u64);
    r.set_sync_action(SyncAction::Check).unwrap();
    assert!(r.wait_sync_idle(Duration::from_secs(20)));
    assert_eq!(r.sync_progress().mismatch_cnt, 16);
    assert_eq!(r.leg_status(0).unwrap().checksum_errors, 2);
    assert_eq!(r.leg_status(1).unwrap().checksum_errors, 0);
    // A check changes nothing.
    assert!(read(a.as_ref(), r.data_offset(), data.len()) != data);
    r.set_sync_action(SyncAction::Repair).unwrap();
    assert!(r.wait_sync_idle(Duration::from_secs(20)));
    assert!(read(a.as_ref(), r.data_offset(), data.len()) == data);
    assert!(read(b.as_ref(), r.data_offset(), data.len()) == data);
    assert_eq!(counts(&r).healed, 2);
    // And the other way: the second leg bad.
    flip(&r, b.as_ref(), 40 * BLK as u64);
    r.set_sync_action(SyncAction::Repair).unwrap();
    assert!(r.wait_sync_idle(Duration::from_secs(20)));
    assert!(read(b.as_ref(), r.data_offset(), data.len()) == data);
    assert_eq!(r.leg_status(1).unwrap().checksum_errors, 1);
}

#[test]
fn the_sums_survive_a_clean_stop_and_catch_corruption_after_assembly() {
    let (a, b) = legs();
    let data = pattern(5, 32 * BLK);
    {
        let r = Raid1::create(vec![a.clone(), b.clone()], icfg()).unwrap();
        write(&r, 4 * BLK as u64, &data);
    }
    let r = Raid1::assemble(vec![a.clone(), b.clone()], cfg()).unwrap();
    assert_eq!(r.limits().logical_block_size, 4096);
    flip(&r, a.as_ref(), 4 * BLK as u64 + 10 * BLK as u64);
    flip(&r, b.as_ref(), 4 * BLK as u64 + 20 * BLK as u64);
    assert!(read(&r, 4 * BLK as u64, data.len()) == data);
    assert_eq!(counts(&r).healed, 2);
}

#[test]
fn once_a_bit_is_cleared_the_sums_of_its_chunk_are_on_the_legs() {
    // Bits clear after 50 ms quiet; a crash afterwards leaves no resync, so only sums
    // written before the clear can catch the corruption.
    let quick = Raid1Config {
        bitmap_quiet: Duration::from_millis(50),
        ..icfg()
    };
    let (a, b) = legs();
    let data = pattern(9, 16 * BLK);
    {
        let r = Raid1::create(vec![a.clone(), b.clone()], quick.clone()).unwrap();
        write(&r, 0, &data);
        let bm = r.bitmap().unwrap();
        testkit::wait_until("the bits to clear", || bm.dirty_chunks().is_empty());
        r.crash_for_test();
    }
    let r = Raid1::assemble(vec![a.clone(), b.clone()], quick).unwrap();
    assert!(r.wait_sync_idle(Duration::from_secs(20)));
    flip(&r, a.as_ref(), 3 * BLK as u64);
    flip(&r, b.as_ref(), 6 * BLK as u64);
    assert!(read(&r, 0, data.len()) == data);
    assert_eq!(counts(&r).healed, 2);
}

#[test]
fn a_torn_write_after_a_crash_is_settled_by_the_resync_and_never_reported() {
    let (a, b) = legs();
    let old = pattern(1, 8 * BLK);
    let new = pattern(2, 8 * BLK);
    created_holding(&a, &b, &old);
    {
        // A write into the same chunk (its bit set and durable, its sums maybe not), then
        // a crash.
        let r = Raid1::assemble(vec![a.clone(), b.clone()], cfg()).unwrap();
        write(&r, 7 * BLK as u64, &new[7 * BLK..]);
        r.crash_for_test();
    }
    // And what the crash left of a later write in flight: its data on one leg only.
    let off = Raid1::read_superblock(a.as_ref()).unwrap().data_offset;
    write(a.as_ref(), off + 2 * BLK as u64, &new[2 * BLK..5 * BLK]);
    let r = Raid1::assemble(vec![a.clone(), b.clone()], cfg()).unwrap();
    assert!(r.wait_sync_idle(Duration::from_secs(20)));
    let got = read(&r, 0, old.len());
    // Either version of each block may be read (the torn write was never acknowledged, the
    // other was not flushed), but the legs agree and nothing was called corrupt.
    for j in 0..8 {
        let blk = &got[j * BLK..(j + 1) * BLK];
        assert!(blk == &old[j * BLK..(j + 1) * BLK] || blk == &new[j * BLK..(j + 1) * BLK]);
    }
    assert_legs_equal(&r, a.as_ref(), b.as_ref());
    assert_eq!(counts(&r).healed + counts(&r).unrecoverable, 0);
    assert_eq!(r.leg_status(0).unwrap().checksum_errors, 0);
    assert_eq!(r.leg_status(1).unwrap().checksum_errors, 0);
    // Settled: each block is checked again, against what the resync kept.
    flip(&r, a.as_ref(), 2 * BLK as u64);
    flip(&r, b.as_ref(), 7 * BLK as u64);
    assert!(read(&r, 0, old.len()) == got);
    assert_eq!(counts(&r).healed, 2);
}

#[test]
fn a_recovered_leg_carries_the_sums_of_what_it_was_given() {
    let (_, _, r, data) = holding(4, 64);
    r.fail_leg(1).unwrap();
    r.remove_leg(1).unwrap();
    let c = mem("16M");
    r.add_leg(c.clone()).unwrap();
    assert!(r.wait_sync_idle(Duration::from_secs(20)));
    assert!(r.leg_status(1).unwrap().in_sync);
    drop(r);
    // Assembled from the new leg alone: its sums are its own.
    let r = assemble_alone(&c);
    flip(&r, c.as_ref(), 33 * BLK as u64);
    assert!(testkit::io::read_at(&r, 33 * BLK as u64, BLK).is_err());
    assert!(read(&r, 0, 33 * BLK) == data[..33 * BLK]);
}

#[test]
fn a_crash_of_a_degraded_array_leaves_what_it_wrote_readable() {
    // While degraded the sums reach the legs only at a clean stop. After a crash the array
    // assembles from its one in-sync leg with no resync to run (no leg to copy to): what it
    // wrote while degraded is still there, and must read back, not fail as corrupt.
    let (a, b) = legs();
    let old = pattern(1, 16 * BLK);
    let new = pattern(2, 16 * BLK);
    created_holding(&a, &b, &old);
    {
        let r = Raid1::assemble(vec![a.clone(), b.clone()], cfg()).unwrap();
        r.fail_leg(1).unwrap();
        write(&r, 0, &new);
        flush(&r);
        // Ticks pass (none writes the sums while degraded), then the power goes.
        std::thread::sleep(Duration::from_millis(100));
        r.crash_for_test();
    }
    let r = assemble_alone(&a);
    assert!(r.wait_sync_idle(Duration::from_secs(20)));
    let got = testkit::io::read_at(&r, 0, new.len());
    assert!(
        got.as_ref().is_ok_and(|g| *g == new),
        "the flushed write made while degraded: {:?}",
        got.map(|g| g == old)
    );
    assert_eq!(counts(&r).unrecoverable, 0);
}

#[test]
fn a_read_no_leg_can_serve_fails_and_leaves_the_legs_as_they_were() {
    use blk_drivers::fault::{OpSet, Rule};
    let ((a, ha), (b, hb)) = (fault_leg("16M", false), fault_leg("16M", false));
    let r = Raid1::create(vec![a.clone(), b.clone()], icfg()).unwrap();
    let data = pattern(8, 16 * BLK);
    write(&r, 0, &data);
    // Every leg fails the read: nothing was read, so nothing may be written back.
    let d = r.data_offset();
    ha.add(Rule::fail(OpSet::READ).in_range(d, data.len() as u64));
    hb.add(Rule::fail(OpSet::READ).in_range(d, data.len() as u64));
    assert!(testkit::io::read_at(&r, 0, data.len()).is_err());
    ha.clear();
    hb.clear();
    assert!(
        read(a.as_ref(), d, data.len()) == data,
        "leg 0 was overwritten"
    );
    assert!(
        read(b.as_ref(), d, data.len()) == data,
        "leg 1 was overwritten"
    );
    assert!(read(&r, 0, data.len()) == data);
}

#[test]
fn after_a_crash_every_leg_gets_the_sums_of_the_chunks_the_resync_settles() {
    // A crash can leave the legs' checksum pages different (one kept a page write the other
    // lost). The resync settles the chunks from the table it loaded; the legs must then all
    // hold that table's pages for them, or a later assembly that loads another leg's page
    // calls a block of a clean chunk corrupt.
    let (a, b) = legs();
    let zeros = vec![0u8; BLK];
    let data = pattern(4, BLK);
    let at = 5 * BLK as u64;
    let page = |d: &dyn Device| {
        let area = Raid1::read_superblock(d).unwrap().integrity.unwrap();
        area.offset + at / BLK as u64 / raid1::integrity::PER_PAGE as u64 * BLK as u64
    };
    {
        // Both legs: zeros over the first bitmap chunk, with their sums.
        let r = Raid1::create(vec![a.clone(), b.clone()], icfg()).unwrap();
        write(&r, 0, &vec![0u8; MB as usize]);
    }
    let old_page = read(b.as_ref(), page(b.as_ref()), BLK);
    {
        // A write whose sum reaches the legs (a flush epoch), then the power goes.
        let r = Raid1::assemble(vec![a.clone(), b.clone()], cfg()).unwrap();
        write(&r, at, &data);
        testkit::wait_until("the new sum on the legs", || {
            read(a.as_ref(), page(a.as_ref()), BLK) != old_page
        });
        r.crash_for_test();
    }
    // What the cut left: the data rolled back on both legs, the new page on `a` only.
    let off = Raid1::read_superblock(a.as_ref()).unwrap().data_offset;
    write(a.as_ref(), off + at, &zeros);
    write(b.as_ref(), off + at, &zeros);
    write(b.as_ref(), page(b.as_ref()), &old_page);
    {
        // The table comes from `b`: its page matches the data, so the resync changes
        // nothing in it; then a clean stop.
        let r = Raid1::assemble(vec![b.clone(), a.clone()], cfg()).unwrap();
        assert!(r.wait_sync_idle(Duration::from_secs(20)));
        assert!(r.bitmap().unwrap().dirty_chunks().is_empty());
        assert!(read(&r, at, BLK) == zeros);
    }
    // `b` is gone: the array runs on `a`, whose table is loaded now.
    let r = assemble_alone(&a);
    let got = testkit::io::read_at(&r, at, BLK);
    assert!(
        got.as_ref().is_ok_and(|g| *g == zeros),
        "the block after the resync and a clean stop, on `a` alone: {:?}",
        got.map(|g| g == data)
    );
}

#[test]
fn a_read_flipped_on_its_way_while_the_resync_settles_a_block_is_not_taken_as_its_data() {
    use blk_drivers::fault::{OpSet, Rule};
    let (a, h) = fault_leg("16M", false);
    let b = mem("16M");
    let x = 3 * BLK as u64;
    {
        let r = Raid1::create(vec![a.clone(), b.clone()], icfg()).unwrap();
        write(&r, 0, &pattern(1, 8 * BLK));
    }
    {
        // Block x's chunk dirty at a crash.
        let r = Raid1::assemble(vec![a.clone(), b.clone()], cfg()).unwrap();
        write(&r, x, &pattern(2, BLK));
        r.crash_for_test();
    }
    // What the crash left there: neither leg's copy matches any sum the legs hold.
    let off = Raid1::read_superblock(b.as_ref()).unwrap().data_offset;
    let on_a = pattern(3, BLK);
    write(a.as_ref(), off + x, &on_a);
    write(b.as_ref(), off + x, &pattern(4, BLK));
    // The resync's first read of block x from the source (leg a) comes back with a bit
    // flipped on the way; the leg itself holds `on_a`.
    h.add(Rule::flip(OpSet::READ).in_range(off + x + 100, 1).nth(1));
    let r = Raid1::assemble(vec![a.clone(), b.clone()], cfg()).unwrap();
    assert!(r.wait_sync_idle(Duration::from_secs(20)));
    assert_eq!(
        h.counters().flipped.iter().sum::<u64>(),
        1,
        "the flip fired"
    );
    assert!(
        read(&r, x, BLK) == on_a,
        "a flipped read became the block's data"
    );
    assert_legs_equal(&r, a.as_ref(), b.as_ref());
}

#[test]
fn a_block_written_since_the_last_stop_and_stored_flipped_is_never_resummed_as_torn() {
    // The crash rule (a block no leg matches is taken as the source has it and summed) is for
    // chunks dirty since before this run: there a crash may have left data and sum out of
    // step. A chunk dirtied by a write since has that write's own sum: a copy that does not
    // match it is corrupt, and is never summed and returned, whether a resync is due (after a
    // crash, or asked for) or not.
    use blk_drivers::fault::{OpSet, Rule};
    let (a, h) = fault_leg("16M", false);
    let b = mem("16M");
    let r = Raid1::create(vec![a.clone(), b], icfg()).unwrap();
    let d = r.data_offset();
    let x = 5 * MB + 3 * BLK as u64;
    let data = pattern(6, BLK);
    // Degraded: the one leg left holds the block with a bit flipped as it was stored.
    r.set_sync_action(SyncAction::Frozen).unwrap();
    r.fail_leg(1).unwrap();
    h.add(Rule::flip(OpSet::WRITE).in_range(d + x, BLK as u64).next(1));
    write(&r, x, &data);
    assert_eq!(
        h.counters().flipped.iter().sum::<u64>(),
        1,
        "the flip fired"
    );
    let stored = read(a.as_ref(), d + x, BLK);
    assert!(stored != data);
    // A resync is due from the start of the array (as after a crash): the read still fails.
    r.set_resync_point(Some(0));
    let got = testkit::io::read_at(&r, x, BLK);
    r.set_resync_point(None);
    assert!(
        got.is_err(),
        "a read while a resync is due: {:?}",
        got.map(|g| if g == stored {
            "the flipped copy"
        } else {
            "other data"
        })
    );
    // A resync asked for settles nothing there either.
    r.set_sync_action(SyncAction::Resync).unwrap();
    assert!(r.wait_sync_idle(Duration::from_secs(20)));
    let got = testkit::io::read_at(&r, x, BLK);
    assert!(
        got.is_err(),
        "a read after a resync: {:?}",
        got.map(|g| if g == stored {
            "the flipped copy"
        } else {
            "other data"
        })
    );
    assert!(counts(&r).unrecoverable >= 1);
}
