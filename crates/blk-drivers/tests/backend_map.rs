//! `MapBackend` (`store=map`, one reserved mapping): the `mem` stores' suite (`mem_suite`: data
//! round trips, holes, discard / write-zeroes semantics, allocation maps, concurrency, a flat
//! `Vec<u8>` model), then: the same random operations on both stores agree exactly
//! (data, extents, allocated bytes), resident memory follows the data, sizes that cannot be
//! mapped are errors, overlapping concurrent I/O across regions.
// A plain threaded test or benchmark, never a loom model: its own harness (std locks, atomics,
// condition variables, baselines) is not what a model must explore, so it may use std::sync.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]
#![cfg(not(blkq_loom))]

#[macro_use]
mod mem_suite;

use blk_drivers::backend::{Backend, MapBackend, MemBackend};
use blk_drivers::spec::{DeviceSpec, QueueOverrides};
use mem_suite::{ext, read, PAGE};
use testkit::pattern;

suite!(MapBackend);

/// A small xorshift generator, so failures reproduce.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n.max(1)
    }
}

/// The same random operations on the map store and the page store: data, extents (over the
/// whole device and random unaligned sub-ranges, with and without a cap) and allocated bytes
/// agree exactly after every step. Ranges cross the 1 MiB region boundaries and the partial
/// last page; writes of a page or more stream past the caches (the default), from unaligned
/// offsets and with partial lines at both ends.
#[test]
fn map_and_pages_agree_on_random_ops() {
    agree_with_pages(false, true);
}

/// The same with transparent huge pages (`thp=1`): the map stays page-granular.
#[test]
fn map_with_huge_pages_agrees_with_pages() {
    agree_with_pages(true, true);
}

/// The same with every write an ordinary copy (`stream=0`).
#[test]
fn map_without_streaming_agrees_with_pages() {
    agree_with_pages(false, false);
}

fn agree_with_pages(huge: bool, stream: bool) {
    const SIZE: u64 = 3 * (1 << 20) + 5 * PAGE + 123;
    let map = MapBackend::with_huge_pages(SIZE, huge)
        .unwrap()
        .streaming(stream);
    let pages = MemBackend::new(SIZE);
    let mut rng = Rng(0x2545_f491_4f6c_dd1d);
    for step in 0..2500u64 {
        // Mostly near a region boundary or the end, so the edges are exercised.
        let off = match rng.below(3) {
            0 => rng.below(SIZE),
            1 => ((1 + rng.below(3)) << 20).saturating_sub(rng.below(3 * PAGE)),
            _ => SIZE - rng.below(3 * PAGE),
        }
        .min(SIZE);
        let max_len = if rng.below(10) == 0 {
            1 << 21
        } else {
            3 * PAGE + 500
        };
        let len = rng.below((SIZE - off).min(max_len) + 1);
        match rng.below(7) {
            0 | 1 => {
                let d = pattern(step, len as usize);
                map.write_at(off, &d, false).unwrap();
                pages.write_at(off, &d, false).unwrap();
            }
            2 => {
                map.discard(off, len).unwrap();
                pages.discard(off, len).unwrap();
            }
            3 => {
                let unmap = rng.below(2) == 0;
                map.write_zeroes(off, len, unmap).unwrap();
                pages.write_zeroes(off, len, unmap).unwrap();
            }
            4 => {
                let cap = 1 + rng.below(6) as usize;
                assert_eq!(
                    map.extents(off, len, cap).unwrap(),
                    pages.extents(off, len, cap).unwrap(),
                    "step {step}: extents {off}+{len} max {cap}"
                );
            }
            _ => {
                let mut a = vec![0xAA; len as usize];
                let mut b = vec![0x55; len as usize];
                map.read_at(off, &mut a).unwrap();
                pages.read_at(off, &mut b).unwrap();
                assert!(a == b, "step {step}: read {off}+{len} differs");
            }
        }
        assert_eq!(
            map.allocated_bytes(),
            pages.allocated_bytes(),
            "step {step}"
        );
    }
    assert_eq!(
        map.extents(0, SIZE, usize::MAX).unwrap(),
        pages.extents(0, SIZE, usize::MAX).unwrap()
    );
    assert!(
        read(&map, 0, SIZE as usize) == {
            let mut b = vec![0; SIZE as usize];
            pages.read_at(0, &mut b).unwrap();
            b
        }
    );
}

/// RSS follows the data: reads of holes commit nothing, writes commit their pages, discards
/// give them back (`resident_bytes` is `mincore`'s count; it can only be lower than the
/// allocation map's, e.g. after swapping).
#[test]
fn resident_memory_follows_the_data() {
    let m = MapBackend::new(64 << 20).unwrap();
    assert_eq!(m.resident_bytes().unwrap(), 0);
    assert!(read(&m, 0, 4 << 20).iter().all(|&b| b == 0));
    assert_eq!(
        m.resident_bytes().unwrap(),
        0,
        "reading holes commits nothing"
    );
    m.write_at(10 << 20, &pattern(5, 16 * PAGE as usize), false)
        .unwrap();
    m.write_at(40 << 20, &[1], false).unwrap();
    assert_eq!(m.allocated_bytes(), 17 * PAGE);
    assert!(m.resident_bytes().unwrap() <= 17 * PAGE);
    m.discard(0, 64 << 20).unwrap();
    assert_eq!(m.allocated_bytes(), 0);
    assert_eq!(
        m.resident_bytes().unwrap(),
        0,
        "discard gives the pages back"
    );
    assert!(read(&m, 10 << 20, 16 * PAGE as usize)
        .iter()
        .all(|&b| b == 0));
}

/// With huge pages, a discard of 4 KiB inside a 2 MiB page gives back just that page: zeros
/// there, data around it, the map page-granular.
#[test]
fn huge_pages_discard_page_granular() {
    let m = MapBackend::with_huge_pages(8 << 20, true).unwrap();
    let data = pattern(9, 4 << 20);
    m.write_at(2 << 20, &data, false).unwrap();
    let hole = (3 << 20) + 5 * PAGE;
    m.discard(hole, PAGE).unwrap();
    assert_eq!(m.allocated_bytes(), (4 << 20) - PAGE);
    let mut want = data.clone();
    want[(hole - (2 << 20)) as usize..][..PAGE as usize].fill(0);
    assert!(read(&m, 2 << 20, 4 << 20) == want);
    assert_eq!(
        m.extents(0, 8 << 20, 8).unwrap(),
        vec![
            ext(0, 2 << 20, false),
            ext(2 << 20, hole - (2 << 20), true),
            ext(hole, PAGE, false),
            ext(hole + PAGE, (6 << 20) - hole - PAGE, true),
            ext(6 << 20, 2 << 20, false),
        ]
    );
    m.discard(0, 8 << 20).unwrap();
    assert_eq!(m.resident_bytes().unwrap(), 0);
}

#[test]
fn sizes_that_cannot_be_mapped_are_errors() {
    for size in [u64::MAX, 1 << 63, 1 << 62] {
        let e = MapBackend::new(size).unwrap_err();
        assert!(e.to_string().contains(&size.to_string()), "{e}");
    }
    // A zero-sized device works: every non-empty request is out of range.
    let z = MapBackend::new(0).unwrap();
    z.read_at(0, &mut []).unwrap();
    assert!(z.write_at(0, &[1], false).is_err());
    assert!(z.extents(0, 0, 4).unwrap().is_empty());
    assert_eq!(z.resident_bytes().unwrap(), 0);
}

#[test]
fn mem_specs_pick_the_store() {
    let overrides = QueueOverrides::default();
    let desc = |s: &str| {
        s.parse::<DeviceSpec>()
            .unwrap()
            .build(&overrides)
            .map(|q| q.describe())
    };
    assert!(desc("mem:1M")
        .unwrap()
        .contains("mem store=map size=1048576"));
    assert!(desc("mem:1M,store=map").unwrap().contains("mem store=map"));
    assert!(desc("mem:1M,store=pages")
        .unwrap()
        .contains("mem store=pages"));
    let e = desc("mem:1M,store=tree").unwrap_err().to_string();
    assert!(e.contains("store") && e.contains("tree"), "{e}");
    // Too large to reserve (2^62 bytes): an error naming the size, not a panic.
    let e = desc("mem:4194304T").unwrap_err().to_string();
    assert!(e.contains("4611686018427387904"), "{e}");
    // The page store reserves nothing up front.
    assert!(desc("mem:4194304T,store=pages").is_ok());
    // `store` is a mem option only.
    assert!(desc("null:1M,store=map").is_err());
    // Transparent huge pages: store=map only.
    assert!(desc("mem:1M,thp=1")
        .unwrap()
        .contains("mem store=map thp=1"));
    assert!(desc("mem:1M,thp=0,store=map")
        .unwrap()
        .contains("mem store=map size"));
    let e = desc("mem:1M,store=pages,thp=1").unwrap_err().to_string();
    assert!(e.contains("thp"), "{e}");
    assert!(desc("mem:1M,thp=maybe").is_err());
    // Streaming writes: on by default, store=map only, named in the description when off,
    // whatever the order of the options.
    assert!(desc("mem:1M,stream=0")
        .unwrap()
        .contains("mem store=map stream=0 size"));
    assert!(desc("mem:1M,stream=off,thp=1,store=map")
        .unwrap()
        .contains("mem store=map thp=1 stream=0 size"));
    assert!(desc("mem:1M,stream=1")
        .unwrap()
        .contains("mem store=map size"));
    let e = desc("mem:1M,stream=1,store=pages").unwrap_err().to_string();
    assert!(e.contains("stream") && e.contains("store=map"), "{e}");
    assert!(desc("mem:1M,store=pages,stream=0")
        .unwrap()
        .contains("mem store=pages"));
    assert!(desc("mem:1M,stream=2").is_err());
}

/// Overlapping concurrent writes, reads, discards and extent queries on shared ranges that
/// cross region boundaries (contents there are undefined; nothing may crash), while each
/// thread also owns a private range whose data must come back exactly.
#[test]
fn concurrent_overlapping_io_across_regions() {
    const THREADS: u64 = 4;
    const SHARED: u64 = 3 << 20; // regions 0..3, shared by all
    const PRIVATE: u64 = 40_017; // one unaligned range per thread, across a region boundary
    let private = |t: u64| SHARED + ((t + 1) << 20) - 20_000;
    let size = SHARED + ((THREADS + 1) << 20);
    let m = std::sync::Arc::new(MapBackend::new(size).unwrap());
    let handles: Vec<_> = (0..THREADS)
        .map(|t| {
            let m = std::sync::Arc::clone(&m);
            std::thread::spawn(move || {
                let mut rng = Rng(0x9E37_79B9 + t);
                let mine = private(t);
                let mut buf = vec![0u8; 256 << 10];
                for i in 0..200u64 {
                    // Around the boundaries at 1 and 2 MiB.
                    let off =
                        (1 << 20) - PAGE * 8 + rng.below(PAGE * 16) + rng.below(2) * (1 << 20);
                    let len = 1 + rng.below(buf.len() as u64);
                    let b = &mut buf[..len as usize];
                    match rng.below(6) {
                        0 | 1 => m.write_at(off, b, false).unwrap(),
                        2 => m.read_at(off, b).unwrap(),
                        3 => m.discard(off, len).unwrap(),
                        4 => m.write_zeroes(off, len, rng.below(2) == 0).unwrap(),
                        _ => {
                            m.extents(0, SHARED, 64).unwrap();
                        }
                    }
                    // The private range: written in two pieces, read back whole.
                    let data = pattern(t * 1000 + i, PRIVATE as usize);
                    m.write_at(mine + 5000, &data[5000..], false).unwrap();
                    m.write_at(mine, &data[..5000], false).unwrap();
                    let mut back = vec![0u8; PRIVATE as usize];
                    m.read_at(mine, &mut back).unwrap();
                    assert!(back == data, "thread {t} iteration {i}");
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    for t in 0..THREADS {
        let got = read(&*m, private(t), PRIVATE as usize);
        assert!(
            got == pattern(t * 1000 + 199, PRIVATE as usize),
            "thread {t}"
        );
    }
}

/// What the striped locks cost, for `bench/mem.sh` (run in release with `--ignored
/// --nocapture`; prints, asserts nothing about time): an uncontended facade `RwLock` taken
/// and released shared and exclusive, next to the copies it guards, and `MapBackend` reads
/// and writes of 4 KiB and 1 MiB next to bare `memcpy`s of the same size.
#[test]
#[ignore = "a measurement: bench/mem.sh runs it in release"]
fn lock_cost() {
    use std::hint::black_box;
    use std::time::Instant;
    fn ns_per(n: u64, f: impl FnMut()) -> f64 {
        let mut f = f;
        let t = Instant::now();
        for _ in 0..n {
            f();
        }
        t.elapsed().as_nanos() as f64 / n as f64
    }
    let l = blkq_sync::RwLock::new(());
    let read_lock = ns_per(1 << 22, || drop(black_box(l.read())));
    let write_lock = ns_per(1 << 22, || drop(black_box(l.write())));
    println!("facade RwLock, uncontended: read {read_lock:.1} ns, write {write_lock:.1} ns");
    // Both sides walk 64 MiB, so neither runs from the cache while the other does not; the
    // buffers are bio buffers (`blk::Buffer`, 4096-aligned), as on the request path: with a
    // destination 16 bytes past a page boundary, the copy out of the page-aligned mapping
    // meets 4K aliasing and the figures say more about memmove than about the locks.
    const SPAN: u64 = 64 << 20;
    let m = MapBackend::new(SPAN).unwrap();
    let mut plain = blk::Buffer::new(SPAN as usize);
    plain.as_mut_slice().fill(7);
    let plain = plain.as_slice();
    m.write_at(0, plain, false).unwrap(); // committed: no faults below
    let mut src = blk::Buffer::new(1 << 20);
    src.as_mut_slice().fill(1);
    let src = src.as_slice();
    let mut dst = blk::Buffer::new(1 << 20);
    let dst = dst.as_mut_slice();
    for (bs, n) in [(4096usize, 1u64 << 20), (1 << 20, 1 << 12)] {
        let mut off = 0u64;
        let mut next = || {
            off = (off + bs as u64) % SPAN;
            off as usize
        };
        let copy = ns_per(n, || {
            let at = next();
            dst[..bs].copy_from_slice(black_box(&plain[at..at + bs]));
            black_box(&*dst);
        });
        let mut next = || {
            off = (off + bs as u64) % SPAN;
            off
        };
        let rd = ns_per(n, || m.read_at(next(), &mut dst[..bs]).unwrap());
        let wr = ns_per(n, || m.write_at(next(), &src[..bs], false).unwrap());
        println!(
            "{bs:>8} B: memcpy {copy:.0} ns, MapBackend read {rd:.0} ns ({:.2}x), write {wr:.0} ns ({:.2}x)",
            rd / copy,
            wr / copy
        );
    }
}
