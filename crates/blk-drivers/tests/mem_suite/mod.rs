//! The suite both `mem` stores pass (`MemBackend`, `store=pages`, and `MapBackend`,
//! `store=map`): data round trips, holes, discard / write-zeroes semantics, allocation maps,
//! concurrency, and a randomized comparison against a flat `Vec<u8>` model. Each test binary
//! instantiates it with `suite!(Type)`.

use blk_drivers::backend::{Backend, Extent, MapBackend, MemBackend};
use testkit::pattern;

/// A `mem` store under test.
pub trait Store: Backend + Sized + 'static {
    /// A store of `size` bytes.
    fn create(size: u64) -> Self;
    /// Bytes its allocation map calls allocated.
    fn allocated_bytes(&self) -> u64;
}

impl Store for MemBackend {
    fn create(size: u64) -> Self {
        MemBackend::new(size)
    }
    fn allocated_bytes(&self) -> u64 {
        MemBackend::allocated_bytes(self)
    }
}

impl Store for MapBackend {
    fn create(size: u64) -> Self {
        MapBackend::new(size).unwrap()
    }
    fn allocated_bytes(&self) -> u64 {
        MapBackend::allocated_bytes(self)
    }
}

/// One `#[test]` per suite test, on store type `$s`.
macro_rules! suite {
    ($s:ty) => {
        #[test]
        fn unaligned_round_trip_across_pages() {
            mem_suite::unaligned_round_trip_across_pages::<$s>()
        }
        #[test]
        fn holes_read_as_zeros_and_cost_nothing() {
            mem_suite::holes_read_as_zeros_and_cost_nothing::<$s>()
        }
        #[test]
        fn out_of_range_is_an_error_not_a_panic() {
            mem_suite::out_of_range_is_an_error_not_a_panic::<$s>()
        }
        #[test]
        fn discard_frees_whole_pages_and_zeroes_partial_ones() {
            mem_suite::discard_frees_whole_pages_and_zeroes_partial_ones::<$s>()
        }
        #[test]
        fn write_zeroes_keeps_or_unmaps() {
            mem_suite::write_zeroes_keeps_or_unmaps::<$s>()
        }
        #[test]
        fn extents_clip_to_the_range_and_respect_max() {
            mem_suite::extents_clip_to_the_range_and_respect_max::<$s>()
        }
        #[test]
        fn extents_of_a_huge_sparse_device_are_quick() {
            mem_suite::extents_of_a_huge_sparse_device_are_quick::<$s>()
        }
        #[test]
        fn concurrent_writers_to_disjoint_ranges() {
            mem_suite::concurrent_writers_to_disjoint_ranges::<$s>()
        }
        #[test]
        fn randomized_against_a_flat_model() {
            mem_suite::randomized_against_a_flat_model::<$s>()
        }
    };
}

pub const PAGE: u64 = 4096;

pub fn ext(offset: u64, len: u64, allocated: bool) -> Extent {
    Extent {
        offset,
        len,
        allocated,
    }
}

pub fn read(m: &dyn Backend, offset: u64, len: usize) -> Vec<u8> {
    let mut buf = vec![0xAAu8; len];
    m.read_at(offset, &mut buf).unwrap();
    buf
}

pub fn unaligned_round_trip_across_pages<S: Store>() {
    let m = S::create(1 << 20);
    let data = pattern(1, 10_000);
    m.write_at(4000, &data, false).unwrap();
    assert_eq!(read(&m, 4000, 10_000), data);
    // Pieces straddling the boundaries, and the untouched surroundings.
    assert_eq!(read(&m, 4090, 20), &data[90..110]);
    assert_eq!(read(&m, 8190, 5000), &data[4190..9190]);
    assert!(read(&m, 0, 4000).iter().all(|&b| b == 0));
    assert!(read(&m, 14_000, 4000).iter().all(|&b| b == 0));
    // 4000..14000 touches pages 0..=3.
    assert_eq!(m.allocated_bytes(), 4 * PAGE);
    // Overwrite a piece in the middle, one byte.
    m.write_at(9999, &[0x42], false).unwrap();
    assert_eq!(read(&m, 9998, 3), vec![data[5998], 0x42, data[6000]]);
    // Empty I/O is fine anywhere in range, including at the end.
    m.write_at(1 << 20, &[], false).unwrap();
    m.read_at(1 << 20, &mut []).unwrap();
}

pub fn holes_read_as_zeros_and_cost_nothing<S: Store>() {
    let m = S::create(1 << 40);
    assert_eq!(m.allocated_bytes(), 0);
    assert!(read(&m, (1 << 40) - 70_000, 70_000).iter().all(|&b| b == 0));
    assert_eq!(m.allocated_bytes(), 0);
    assert_eq!(
        m.extents(0, 1 << 40, 16).unwrap(),
        vec![ext(0, 1 << 40, false)]
    );
    assert!(m.fast_zero());
    m.flush().unwrap();
}

pub fn out_of_range_is_an_error_not_a_panic<S: Store>() {
    let m = S::create(10_000);
    let mut buf = [0u8; 16];
    assert!(m.read_at(9_990, &mut buf).is_err());
    assert!(m.write_at(9_990, &buf, false).is_err());
    assert!(m.read_at(u64::MAX - 4, &mut buf).is_err());
    assert!(m.discard(u64::MAX, 2).is_err());
    assert!(m.write_zeroes(5_000, 6_000, true).is_err());
    assert!(m.extents(0, 10_001, 4).is_err());
    let e = m.write_at(u64::MAX, &buf, true).unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput);
    // The last partial page of a size that is not a page multiple works.
    m.write_at(9_990, &buf[..10], false).unwrap();
    assert_eq!(read(&m, 9_990, 10), vec![0; 10]);
    m.write_at(9_990, &[7; 10], false).unwrap();
    assert_eq!(read(&m, 9_990, 10), vec![7; 10]);
    assert_eq!(
        m.extents(0, 10_000, 8).unwrap(),
        vec![ext(0, 8192, false), ext(8192, 10_000 - 8192, true)]
    );
    // Discarding to the end frees that last (partial) page.
    m.discard(8192, 10_000 - 8192).unwrap();
    assert_eq!(m.allocated_bytes(), 0);
}

pub fn discard_frees_whole_pages_and_zeroes_partial_ones<S: Store>() {
    let m = S::create(64 * PAGE);
    let data = pattern(2, 6 * PAGE as usize);
    m.write_at(2 * PAGE, &data, false).unwrap(); // pages 2..8
    assert_eq!(m.allocated_bytes(), 6 * PAGE);
    assert_eq!(
        m.extents(0, 64 * PAGE, 64).unwrap(),
        vec![
            ext(0, 2 * PAGE, false),
            ext(2 * PAGE, 6 * PAGE, true),
            ext(8 * PAGE, 56 * PAGE, false)
        ]
    );
    // From the middle of page 3 to the middle of page 6: pages 4 and 5 go, 3 and 6 are
    // zeroed in part and stay.
    let (from, to) = (3 * PAGE + 100, 6 * PAGE + 200);
    m.discard(from, to - from).unwrap();
    assert_eq!(m.allocated_bytes(), 4 * PAGE);
    let got = read(&m, 2 * PAGE, 6 * PAGE as usize);
    for (i, (&g, &d)) in got.iter().zip(&data).enumerate() {
        let pos = 2 * PAGE + i as u64;
        let want = if (from..to).contains(&pos) { 0 } else { d };
        assert_eq!(g, want, "byte {pos}");
    }
    assert_eq!(
        m.extents(0, 64 * PAGE, 64).unwrap(),
        vec![
            ext(0, 2 * PAGE, false),
            ext(2 * PAGE, 2 * PAGE, true),
            ext(4 * PAGE, 2 * PAGE, false),
            ext(6 * PAGE, 2 * PAGE, true),
            ext(8 * PAGE, 56 * PAGE, false)
        ]
    );
    // A partial discard that leaves a page all zeros frees it.
    m.discard(6 * PAGE + 200, PAGE - 200).unwrap();
    assert_eq!(m.allocated_bytes(), 3 * PAGE);
    // Discarding holes is a no-op.
    m.discard(20 * PAGE + 1, 10 * PAGE).unwrap();
    assert_eq!(m.allocated_bytes(), 3 * PAGE);
}

pub fn write_zeroes_keeps_or_unmaps<S: Store>() {
    let m = S::create(16 * PAGE);
    m.write_at(PAGE, &pattern(3, 2 * PAGE as usize), false)
        .unwrap(); // pages 1, 2
                   // Without unmap: zeros, and the pages stay (holes in range get allocated).
    m.write_zeroes(PAGE / 2, 4 * PAGE, false).unwrap(); // pages 0..=4
    assert!(read(&m, PAGE / 2, 4 * PAGE as usize)
        .iter()
        .all(|&b| b == 0));
    assert_eq!(m.allocated_bytes(), 5 * PAGE);
    assert_eq!(
        m.extents(0, 16 * PAGE, 16).unwrap(),
        vec![ext(0, 5 * PAGE, true), ext(5 * PAGE, 11 * PAGE, false)]
    );
    // With unmap: whole pages go; the partial first page (now all zeros) goes too.
    m.write_zeroes(PAGE / 2, 4 * PAGE, true).unwrap();
    assert_eq!(m.allocated_bytes(), 0);
    assert_eq!(
        m.extents(0, 16 * PAGE, 16).unwrap(),
        vec![ext(0, 16 * PAGE, false)]
    );
    // A partial unmap of a page with data elsewhere zeroes only the range.
    m.write_at(8 * PAGE, &[9; 4096], false).unwrap();
    m.write_zeroes(8 * PAGE + 10, 20, true).unwrap();
    let got = read(&m, 8 * PAGE, 4096);
    assert!(got[..10].iter().all(|&b| b == 9));
    assert!(got[10..30].iter().all(|&b| b == 0));
    assert!(got[30..].iter().all(|&b| b == 9));
    assert_eq!(m.allocated_bytes(), PAGE);
}

pub fn extents_clip_to_the_range_and_respect_max<S: Store>() {
    let m = S::create(1 << 20);
    // Allocated pages 1, 3, 5, 7, 9.
    for p in [1u64, 3, 5, 7, 9] {
        m.write_at(p * PAGE + 7, &[1], false).unwrap();
    }
    // An unaligned range: first and last extents are clipped to it.
    let e = m.extents(PAGE + 100, 4 * PAGE, 100).unwrap();
    assert_eq!(
        e,
        vec![
            ext(PAGE + 100, PAGE - 100, true),
            ext(2 * PAGE, PAGE, false),
            ext(3 * PAGE, PAGE, true),
            ext(4 * PAGE, PAGE, false),
            ext(5 * PAGE, 100, true)
        ]
    );
    // At most 3: the map stops short.
    let e = m.extents(0, 1 << 20, 3).unwrap();
    assert_eq!(
        e,
        vec![
            ext(0, PAGE, false),
            ext(PAGE, PAGE, true),
            ext(2 * PAGE, PAGE, false)
        ]
    );
    assert!(m.extents(0, 1 << 20, 0).unwrap().is_empty());
    assert!(m.extents(77, 0, 5).unwrap().is_empty());
    // Inside one page.
    assert_eq!(
        m.extents(PAGE + 1, 10, 5).unwrap(),
        vec![ext(PAGE + 1, 10, true)]
    );
}

pub fn extents_of_a_huge_sparse_device_are_quick<S: Store>() {
    let size = 1u64 << 40; // 1 TiB: 2^28 pages
    let m = S::create(size);
    m.write_at(size / 2 - 1, &[1, 2], false).unwrap(); // straddles two pages
    m.write_at(size - 1, &[3], false).unwrap();
    // No timing assertion (shared machines): a walk over every page (2^30 of them) would make
    // this test take minutes, which the suite's run time shows; the answer is checked exactly.
    let e = m.extents(0, size, 16).unwrap();
    assert_eq!(
        e,
        vec![
            ext(0, size / 2 - PAGE, false),
            ext(size / 2 - PAGE, 2 * PAGE, true),
            ext(size / 2 + PAGE, size / 2 - 2 * PAGE, false),
            ext(size - PAGE, PAGE, true)
        ]
    );
}

pub fn concurrent_writers_to_disjoint_ranges<S: Store>() {
    const THREADS: u64 = 4;
    const STRIPE: u64 = 3 * PAGE + 777; // unaligned stripes: neighbours share pages
    const ROUNDS: u64 = 64;
    let size = THREADS * STRIPE * ROUNDS;
    let m = std::sync::Arc::new(S::create(size));
    let handles: Vec<_> = (0..THREADS)
        .map(|t| {
            let m = std::sync::Arc::clone(&m);
            std::thread::spawn(move || {
                for r in 0..ROUNDS {
                    let off = (r * THREADS + t) * STRIPE;
                    let data = pattern(off, STRIPE as usize);
                    // In two unequal pieces, the second first.
                    m.write_at(off + 1000, &data[1000..], false).unwrap();
                    m.write_at(off, &data[..1000], false).unwrap();
                    let mut back = vec![0; STRIPE as usize];
                    m.read_at(off, &mut back).unwrap();
                    assert_eq!(back, data, "thread {t} round {r}");
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    for i in 0..THREADS * ROUNDS {
        let off = i * STRIPE;
        assert_eq!(
            read(&*m, off, STRIPE as usize),
            pattern(off, STRIPE as usize)
        );
    }
    assert_eq!(m.allocated_bytes(), size.div_ceil(PAGE) * PAGE);
    assert_eq!(m.extents(0, size, 4).unwrap(), vec![ext(0, size, true)]);
}

/// Random ops against a flat model: data, and extents that never call a page with data a hole.
pub fn randomized_against_a_flat_model<S: Store>() {
    const SIZE: usize = 40 * 4096 + 123;
    let m = S::create(SIZE as u64);
    let mut model = vec![0u8; SIZE];
    let mut x = 0x1234_5678_9abc_def1u64;
    let mut rnd = |n: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % n
    };
    for step in 0..3000u64 {
        let off = rnd(SIZE as u64) as usize;
        let len = rnd((SIZE - off) as u64 + 1).min(3 * 4096 + 500) as usize;
        match rnd(5) {
            0 | 1 => {
                let d = pattern(step, len);
                m.write_at(off as u64, &d, false).unwrap();
                model[off..off + len].copy_from_slice(&d);
            }
            2 => {
                m.discard(off as u64, len as u64).unwrap();
                model[off..off + len].fill(0);
            }
            3 => {
                m.write_zeroes(off as u64, len as u64, rnd(2) == 0).unwrap();
                model[off..off + len].fill(0);
            }
            _ => {
                assert_eq!(
                    read(&m, off as u64, len),
                    &model[off..off + len],
                    "step {step}"
                );
            }
        }
    }
    assert_eq!(read(&m, 0, SIZE), model);
    let map = m.extents(0, SIZE as u64, usize::MAX).unwrap();
    let mut pos = 0u64;
    for e in &map {
        assert_eq!(e.offset, pos, "extents cover the range in order");
        assert!(e.len > 0);
        if !e.allocated {
            let r = e.offset as usize..(e.offset + e.len) as usize;
            assert!(model[r].iter().all(|&b| b == 0), "hole {e:?} has data");
        }
        pos += e.len;
    }
    assert_eq!(pos, SIZE as u64);
    for w in map.windows(2) {
        assert_ne!(w[0].allocated, w[1].allocated, "neighbours are merged");
    }
    let allocated: u64 = map.iter().filter(|e| e.allocated).map(|e| e.len).sum();
    assert!(m.allocated_bytes() >= allocated);
}
