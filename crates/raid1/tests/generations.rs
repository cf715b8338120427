//! Generations (DRBD's generation UUIDs): two legs that each ran without the other hold
//! writes the other lacks, whatever their `events` say. Assembly and `add_leg` refuse to pick
//! a side and name both; the operator's `add_leg_discarding` resyncs the discarded side from
//! the union of both sides' dirty chunks; a leg whose history is an earlier point of the
//! array's is recovered as before. Memory legs, a 1 MiB bitmap chunk that never clears by
//! itself.

mod common;
use common::*;

use blk::{Bio, Buffer, Device, Op, SECTOR_SHIFT};
use blkq_sync::DynArc as Arc;
use raid1::superblock::{Superblock, BITMAP_OFFSET, SB_OFFSET, SB_SIZE};
use raid1::{Kinship, Raid1, Raid1Config, Raid1Error};

fn alone() -> Raid1Config {
    Raid1Config {
        allow_degraded: true,
        ..cfg()
    }
}

fn superblock(dev: &dyn Device) -> Superblock {
    Raid1::read_superblock(dev).unwrap()
}

/// Rewrites `dev`'s superblock with `events` (a side that restarted many times).
fn set_events(dev: &dyn Device, events: u64) {
    let mut sb = superblock(dev);
    sb.events = events;
    let mut buf = Buffer::new(SB_SIZE);
    sb.encode_into(buf.as_mut_slice()).unwrap();
    let (_, r) = blk::submit_wait(
        dev,
        Bio::with_buf(Op::Write, SB_OFFSET >> SECTOR_SHIFT, buf),
    );
    r.unwrap();
}

/// An array over `a` and `b` with `pattern(1)` in its first chunk, stopped cleanly; then `a`
/// runs alone and writes `pattern(2)` into chunk 5, and `b` runs alone and writes
/// `pattern(3)` into chunk 9, restarting twice more so that its events pass `a`'s.
fn split() -> (Arc<dyn Device>, Arc<dyn Device>) {
    let (a, b) = (mem("16M"), mem("16M"));
    let r = Raid1::create(vec![a.clone(), b.clone()], cfg()).unwrap();
    write(&r, 0, &pattern(1, MB as usize));
    flush(&r);
    drop(r);
    let ra = Raid1::assemble(vec![a.clone()], alone()).unwrap();
    write(&ra, 5 * MB, &pattern(2, MB as usize));
    flush(&ra);
    drop(ra);
    for _ in 0..3 {
        let rb = Raid1::assemble(vec![b.clone()], alone()).unwrap();
        write(&rb, 9 * MB, &pattern(3, MB as usize));
        flush(&rb);
        drop(rb);
    }
    let (sa, sb) = (superblock(a.as_ref()), superblock(b.as_ref()));
    assert!(sb.events > sa.events, "{sb} / {sa}");
    assert_eq!(sa.lineage.kinship(&sb.lineage), Kinship::Diverged);
    (a, b)
}

#[test]
fn a_one_leg_start_of_a_two_leg_array_needs_allow_degraded() {
    let (a, b) = (mem("16M"), mem("16M"));
    drop(Raid1::create(vec![a.clone(), b], cfg()).unwrap());
    let err = Raid1::assemble(vec![a.clone()], cfg()).unwrap_err();
    assert!(err.to_string().contains("allow_degraded"), "{err}");
    let before = superblock(a.as_ref()).lineage;
    drop(Raid1::assemble(vec![a.clone()], alone()).unwrap());
    // Running alone is a new generation, after the one both legs shared.
    let after = superblock(a.as_ref()).lineage;
    assert_eq!(after.kinship(&before), Kinship::Ancestor);
}

#[test]
fn two_legs_that_each_ran_alone_are_refused_and_both_named() {
    let (a, b) = split();
    let err = Raid1::assemble(vec![a.clone(), b.clone()], cfg()).unwrap_err();
    let text = err.to_string();
    assert!(text.contains("diverged"), "{text}");
    assert!(text.contains("leg 0") && text.contains("leg 1"), "{text}");
    // Nothing was written to either: each still reads as its own side.
    let ra = Raid1::assemble(vec![a], alone()).unwrap();
    assert_eq!(read(&ra, 5 * MB, 4096), pattern(2, MB as usize)[..4096]);
    assert!(read(&ra, 9 * MB, 4096).iter().all(|&x| x == 0));
    drop(ra);
    let rb = Raid1::assemble(vec![b], alone()).unwrap();
    assert_eq!(read(&rb, 9 * MB, 4096), pattern(3, MB as usize)[..4096]);
}

#[test]
fn a_leg_that_ran_alone_is_not_re_added_over_its_writes() {
    let (a, b) = split();
    let ra = Raid1::assemble(vec![a], alone()).unwrap();
    let err = ra.add_leg(b.clone()).unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, Raid1Error::Diverged { .. }), "{text}");
    assert!(text.contains("discard"), "{text}");
    // Untouched: b still holds its own writes and its own history.
    assert_eq!(
        read(b.as_ref(), ra.data_offset() + 9 * MB, 4096),
        pattern(3, MB as usize)[..4096]
    );
    assert_ne!(
        superblock(b.as_ref()).lineage.current,
        superblock(ra.leg_device(0).unwrap().as_ref())
            .lineage
            .current
    );
}

#[test]
fn discarding_a_side_copies_the_union_of_both_sides_dirty_chunks() {
    let (a, b) = split();
    let ra = Raid1::assemble(vec![a.clone()], alone()).unwrap();
    let slot = ra.add_leg_discarding(b.clone()).unwrap();
    assert_eq!(slot, 1);
    assert!(ra.wait_sync_idle(std::time::Duration::from_secs(60)));
    let p = ra.sync_progress();
    // Chunk 5 (written by a alone), chunk 9 (by b alone) and chunk 0 (written before the
    // split; bits never clear by themselves in these tests): nothing else.
    assert_eq!(p.chunks_copied, 3, "{p:?}");
    assert!(ra.leg_status(1).unwrap().in_sync);
    assert_legs_equal(&ra, a.as_ref(), b.as_ref());
    // The surviving side's data: b's write to chunk 9 is gone, a's is on both.
    assert!(read(&ra, 9 * MB, MB as usize).iter().all(|&x| x == 0));
    assert_eq!(read(&ra, 5 * MB, MB as usize), pattern(2, MB as usize));
    assert_eq!(read(&ra, 0, MB as usize), pattern(1, MB as usize));
}

#[test]
fn the_side_that_went_on_wins_over_one_that_stopped_without_noticing() {
    let (a, b) = (mem("16M"), mem("16M"));
    let r = Raid1::create(vec![a.clone(), b.clone()], cfg()).unwrap();
    write(&r, 3 * MB, &pattern(1, 4096));
    flush(&r);
    // The front dies with both legs in sync in its view.
    r.crash_for_test();
    // The back is started alone (failover) and takes writes.
    let rb = Raid1::assemble(vec![b.clone()], alone()).unwrap();
    write(&rb, 9 * MB, &pattern(3, 4096));
    flush(&rb);
    drop(rb);
    // However often the old front's superblock was rewritten, its history is an earlier
    // point of the back's: the back's view wins and the front is recovered.
    set_events(a.as_ref(), 1000);
    let r = Raid1::assemble(vec![a.clone(), b.clone()], cfg()).unwrap();
    assert!(r.wait_sync_idle(std::time::Duration::from_secs(60)));
    assert!(r.leg_status(0).unwrap().in_sync && r.leg_status(1).unwrap().in_sync);
    assert_legs_equal(&r, a.as_ref(), b.as_ref());
    assert_eq!(read(&r, 9 * MB, 4096), pattern(3, 4096));
    assert_eq!(read(&r, 3 * MB, 4096), pattern(1, 4096));
}

#[test]
fn a_write_mostly_leg_added_back_stays_write_mostly() {
    let (a, b) = (mem("16M"), mem("16M"));
    let r = Raid1::create(vec![a, b.clone()], cfg()).unwrap();
    r.set_write_mostly(1, true).unwrap();
    // On the leg's own superblock before it fails (raid1d writes it).
    testkit::wait_until("the write-mostly flag on the leg's superblock", || {
        superblock(b.as_ref()).legs[1].write_mostly
    });
    write(&r, MB, &pattern(4, 4096));
    r.fail_leg(1).unwrap();
    r.remove_leg(1).unwrap();
    write(&r, 2 * MB, &pattern(5, 4096));
    assert_eq!(r.add_leg(b).unwrap(), 1, "back in its slot");
    assert!(r.wait_sync_idle(std::time::Duration::from_secs(60)));
    let st = r.leg_status(1).unwrap();
    assert!(st.in_sync, "{st:?}");
    // Its own superblock says write-mostly (a remote leg stays one when it comes back).
    assert!(st.write_mostly, "{st:?}");
}

/// An array over `a` and `b` with `pattern(1)` in chunk 0 whose front dies with a write in
/// flight in chunk 5 that reached only `a`, and whose bit only `a`'s own bitmap would hold;
/// `a`'s bitmap is torn in the same crash. Then `b` runs alone and writes `pattern(3)` into
/// chunk 9: `a`'s generation is an ancestor of `b`'s, and the array's bitmap (`b`'s) marks
/// chunks 0 and 9, not 5. Built on the legs directly: the write and the tear as a power cut
/// leaves them.
fn ancestor_with_a_torn_bitmap() -> (Arc<dyn Device>, Arc<dyn Device>) {
    let (a, b) = (mem("16M"), mem("16M"));
    let r = Raid1::create(vec![a.clone(), b.clone()], cfg()).unwrap();
    let doff = r.data_offset();
    write(&r, 0, &pattern(1, MB as usize));
    flush(&r);
    r.crash_for_test();
    write(a.as_ref(), doff + 5 * MB, &pattern(7, 4096));
    // The bit array's first sector: the header's checksum no longer matches.
    write(a.as_ref(), BITMAP_OFFSET + 4096, &[0xFF; 512]);
    let rb = Raid1::assemble(vec![b.clone()], alone()).unwrap();
    write(&rb, 9 * MB, &pattern(3, 4096));
    flush(&rb);
    drop(rb);
    let (sa, sb) = (superblock(a.as_ref()), superblock(b.as_ref()));
    assert_eq!(sb.lineage.kinship(&sa.lineage), Kinship::Ancestor);
    (a, b)
}

/// After the full recovery of [`ancestor_with_a_torn_bitmap`]'s leg `a`: the write only `a`
/// took is gone, and the legs are equal.
fn assert_the_ancestor_lost_its_own_write(r: &Raid1, a: &Arc<dyn Device>, b: &Arc<dyn Device>) {
    assert!(
        read(a.as_ref(), r.data_offset() + 5 * MB, 4096)
            .iter()
            .all(|&x| x == 0),
        "the leg kept a write the array never had"
    );
    assert_legs_equal(r, a.as_ref(), b.as_ref());
}

/// A leg that only stopped comes back with a bitmap recovery of the array's dirty chunks and
/// its own (writes it took that the array may lack). When its own bitmap cannot be read, the
/// array's alone may miss a chunk it changed, so it is recovered in full, as a diverged side
/// whose bitmap cannot show every change is.
#[test]
fn an_ancestor_leg_whose_own_bitmap_is_torn_is_added_back_with_a_full_recovery() {
    let (a, b) = ancestor_with_a_torn_bitmap();
    let r = Raid1::assemble(vec![b.clone()], alone()).unwrap();
    assert_eq!(r.add_leg(a.clone()).unwrap(), 0, "back in its slot");
    assert!(r.wait_sync_idle(std::time::Duration::from_secs(60)));
    let nr_chunks = r.bitmap().unwrap().nr_chunks();
    assert_eq!(
        r.sync_progress().chunks_copied,
        nr_chunks,
        "a full recovery"
    );
    assert!(r.leg_status(0).unwrap().in_sync);
    assert_the_ancestor_lost_its_own_write(&r, &a, &b);
}

/// The same leg given back at assembly.
#[test]
fn an_ancestor_leg_whose_own_bitmap_is_torn_is_assembled_with_a_full_recovery() {
    let (a, b) = ancestor_with_a_torn_bitmap();
    let r = Raid1::assemble(vec![a.clone(), b.clone()], cfg()).unwrap();
    assert!(r.wait_sync_idle(std::time::Duration::from_secs(60)));
    assert!(r.leg_status(0).unwrap().in_sync && r.leg_status(1).unwrap().in_sync);
    assert_the_ancestor_lost_its_own_write(&r, &a, &b);
    assert_eq!(read(&r, 9 * MB, 4096), pattern(3, 4096));
}
