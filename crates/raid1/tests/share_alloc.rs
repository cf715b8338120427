//! A shared mirror write (`share_writes=1`) allocates nothing per I/O in the steady state:
//! writes (some FUA), reads and flushes through a mirror of three memory legs, counted
//! process-wide (the submitting test thread, the legs' completions, raid1d). The copying path
//! (`share_writes=0`) is counted too: its copies come from the array's pool.
// A plain threaded test, never a loom model: its own harness may use std::sync.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]
#![cfg(not(blkq_loom))]

mod common;
use common::*;

use std::time::Duration;

use blk::{Bio, BioFlags, Buffer, Op};
use raid1::{Raid1, Raid1Config};
use testkit::alloc::CountingAlloc;
use testkit::io::Reused;

#[global_allocator]
static COUNT: CountingAlloc = CountingAlloc::new();

/// Allocations in 2000 rounds of a 64 KiB write (every fourth FUA), a read of it, and every
/// sixteenth round a flush, after a warm-up round over every offset (the first write to a
/// bitmap chunk persists the bitmap, a slow path that allocates).
fn steady_state(share: bool) -> u64 {
    let r = Raid1::create(
        vec![mem("64M"), mem("64M"), mem("64M")],
        Raid1Config {
            share_writes: share,
            // raid1d's tick (bitmap clearing) never comes during the window.
            tick: Duration::from_secs(3600),
            ..cfg()
        },
    )
    .unwrap();
    let done = Reused::default();
    let mut wbio = Bio::with_buf(Op::Write, 0, Buffer::new(64 << 10));
    let mut rbio = Bio::with_buf(Op::Read, 0, Buffer::new(64 << 10));
    let mut fbio = Bio::new(Op::Flush, 0, 0);
    let mut round = |i: u64| {
        let sector = (i % 256) * 128;
        wbio.sector = sector;
        wbio.buf.as_mut().unwrap().as_mut_slice()[0] = i as u8;
        wbio.flags = if i.is_multiple_of(4) {
            BioFlags::FUA
        } else {
            BioFlags::NONE
        };
        let take = |b: &mut Bio| std::mem::replace(b, Bio::new(Op::Flush, 0, 0));
        wbio = done.run(&r, take(&mut wbio));
        rbio.sector = sector;
        rbio = done.run(&r, take(&mut rbio));
        assert_eq!(rbio.buf.as_ref().unwrap().as_slice()[0], i as u8);
        if i.is_multiple_of(16) {
            fbio = done.run(&r, take(&mut fbio));
        }
    };
    for i in 0..256 {
        round(i);
    }
    COUNT.start();
    for i in 0..2000 {
        round(i);
    }
    COUNT.stop()
}

/// One test, the modes one after the other: the count is process-wide, so two windows must
/// not overlap.
#[test]
fn a_shared_mirror_write_allocates_nothing() {
    assert_eq!(steady_state(true), 0, "share_writes=1");
    assert_eq!(steady_state(false), 0, "share_writes=0");
}
