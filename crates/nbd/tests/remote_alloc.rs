//! `RemoteDevice` allocates nothing per request in the steady state: reads, writes and flushes
//! against nbdkit's memory plugin (another process, so that every allocation counted is the
//! device's: the submitting test thread, the receiver and the sender), with FUA native and
//! emulated (nbdkit's fua filter hides it: the receiver, or the sender, sends the flushes),
//! over one connection and two. Skipped without nbdkit.
// A plain threaded test, never a loom model: its own harness may use std::sync.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]
#![cfg(not(blkq_loom))]

mod common;

use blk::{Bio, BioFlags, Buffer, Op};
use common::nbdkit::Kit;
use nbd::remote::RemoteDevice;
use testkit::alloc::CountingAlloc;
use testkit::io::Reused;

#[global_allocator]
static COUNT: CountingAlloc = CountingAlloc::new();

/// Allocations in 2000 rounds of write (every fourth FUA), read, and every sixteenth a
/// flush, against nbdkit with `args`, the device opened with `opts`; `None` without nbdkit.
fn steady_state(args: &[&str], opts: &str) -> Option<u64> {
    let dir = tempfile::tempdir().unwrap();
    let kit = Kit::start(dir.path(), args)?;
    let dev = RemoteDevice::open(&kit.uri(opts)).unwrap();
    let done = Reused::default();
    let mut wbio = Bio::with_buf(Op::Write, 0, Buffer::new(64 << 10));
    let mut rbio = Bio::with_buf(Op::Read, 0, Buffer::new(64 << 10));
    let mut fbio = Bio::new(Op::Flush, 0, 0);
    let mut round = |i: u64| {
        let sector = (i % 512) * 128;
        wbio.sector = sector;
        wbio.flags = if i.is_multiple_of(4) {
            BioFlags::FUA
        } else {
            BioFlags::NONE
        };
        wbio = done.run(
            &dev,
            std::mem::replace(&mut wbio, Bio::new(Op::Flush, 0, 0)),
        );
        rbio.sector = sector;
        rbio = done.run(
            &dev,
            std::mem::replace(&mut rbio, Bio::new(Op::Flush, 0, 0)),
        );
        if i.is_multiple_of(16) {
            fbio = done.run(
                &dev,
                std::mem::replace(&mut fbio, Bio::new(Op::Flush, 0, 0)),
            );
        }
    };
    for i in 0..200 {
        round(i);
    }
    COUNT.start();
    for i in 0..2000 {
        round(i);
    }
    let n = COUNT.stop();
    drop(dev);
    drop(kit);
    Some(n)
}

/// One test, the configurations one after the other: the count is process-wide, so two
/// windows must not overlap.
#[test]
fn no_allocation_per_request() {
    if let Some(n) = steady_state(&["memory", "64M"], "") {
        assert_eq!(
            n, 0,
            "allocations in 2000 rounds of write, read (and flush)"
        );
    }
    // The flush of an emulated FUA write (sent by the receiver) and two connections.
    if let Some(n) = steady_state(&["--filter=fua", "memory", "64M"], ",conns=2") {
        assert_eq!(
            n, 0,
            "allocations in 2000 rounds with FUA emulated, two connections"
        );
    }
}
