//! `MapBackend` allocates nothing on the request path: reads, writes, discards and both kinds
//! of write-zeroes (unaligned, across regions, into holes and over data), watched by a
//! counting global allocator. (`extents` returns its `Vec` and is not on the data path.)
// A plain test with its own global allocator, never a loom model: it may use std::sync.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]
#![cfg(not(blkq_loom))]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use blk_drivers::backend::{Backend, MapBackend};

struct Counting;

static COUNTING: AtomicBool = AtomicBool::new(false);
static ALLOCS: AtomicU64 = AtomicU64::new(0);

// SAFETY: forwards to the system allocator unchanged; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        if COUNTING.load(Ordering::Relaxed) {
            ALLOCS.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: the caller's contract is `GlobalAlloc::alloc`'s, passed on.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: `p` came from `alloc` above, i.e. from `System`, with layout `l`.
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        if COUNTING.load(Ordering::Relaxed) {
            ALLOCS.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: as for `dealloc`; `n` is the caller's new size.
        unsafe { System.realloc(p, l, n) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

#[test]
fn the_request_path_allocates_nothing() {
    let m = MapBackend::new(8 << 20).unwrap();
    let mut buf = vec![0x5Au8; 3 << 20];
    COUNTING.store(true, Ordering::Relaxed);
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
    COUNTING.store(false, Ordering::Relaxed);
    assert_eq!(ALLOCS.load(Ordering::Relaxed), 0);
}
