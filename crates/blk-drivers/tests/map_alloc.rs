//! `MapBackend` allocates nothing on the request path: reads, writes, discards and both kinds
//! of write-zeroes (unaligned, across regions, into holes and over data), watched by a
//! counting global allocator. (`extents` returns its `Vec` and is not on the data path.)
// A plain test with its own global allocator, never a loom model: it may use std::sync.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]
#![cfg(not(blkq_loom))]

use testkit::alloc::CountingAlloc;

use blk_drivers::backend::{Backend, MapBackend};

#[global_allocator]
static GLOBAL: CountingAlloc = CountingAlloc::new();

#[test]
fn the_request_path_allocates_nothing() {
    let m = MapBackend::new(8 << 20).unwrap();
    let mut buf = vec![0x5Au8; 3 << 20];
    let round = |buf: &mut Vec<u8>| {
        for i in 0..200u64 {
            let off = (i * 77_777) % (5 << 20);
            let len = [1usize, 4096, 10_000, 1 << 20, 3 << 20][(i % 5) as usize];
            m.write_at(off, &buf[..len], false).unwrap();
            m.read_at(off + 13, &mut buf[..len]).unwrap();
            m.discard(off + 4096, len as u64 / 2).unwrap();
            m.write_zeroes(off + 100, len as u64 / 3, i % 2 == 0)
                .unwrap();
            m.read_at(off, &mut buf[..len]).unwrap();
            m.flush().unwrap();
        }
    };
    // The steady state: the same operations once before the window, so that what the process
    // sets up once (lazily, on a first use) is not counted as the request path's.
    round(&mut buf);
    GLOBAL.start();
    round(&mut buf);
    assert_eq!(GLOBAL.stop(), 0);
}
