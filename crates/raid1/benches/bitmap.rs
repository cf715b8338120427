//! What a mirror write pays the write-intent bitmap in the steady state (its chunk's bit set
//! and on disk): `start_write` + `end_write` with the sharded, lock-free counts against the
//! locked twin (`raid1::BitmapCounts`). One iteration is one write's start and end.
//! `threads/N`: N threads write at once, to chunks of their own (`distinct`) or all to one
//! chunk (`same`: the counts of one chunk, each thread in its own shard).
//!
//! Under loom the facade's types only work inside a model: the body is `cfg(not(blkq_loom))`.

#[cfg(not(blkq_loom))]
mod benches {
    use std::hint::black_box;

    use blkq_sync::Arc;
    use criterion::Criterion;
    use raid1::{BitmapCounts, WriteIntentBitmap};
    use testkit::baseline::threads_wall;

    const CAP: u64 = 1 << 30;
    const CHUNK: u64 = 64 << 20;

    fn bitmap(mode: BitmapCounts) -> Arc<WriteIntentBitmap> {
        let b = WriteIntentBitmap::new(CAP, CHUNK)
            .unwrap()
            .with_counts(mode);
        // Every chunk's bit set and durable: the steady state.
        for off in (0..CAP).step_by(CHUNK as usize) {
            if let Some(set) = b.start_write(off, 4096).unwrap() {
                b.mark_durable(set);
            }
            b.end_write(off, 4096).unwrap();
        }
        Arc::new(b)
    }

    pub fn start_end(c: &mut Criterion) {
        let mut g = c.benchmark_group("raid1_bitmap_write");
        for spread in ["distinct", "same"] {
            for threads in [1usize, 2, 4] {
                for (name, mode) in [
                    ("sharded", BitmapCounts::Sharded),
                    ("locked", BitmapCounts::Locked),
                ] {
                    let b = bitmap(mode);
                    g.bench_function(format!("{name}/{spread}/threads/{threads}"), |bn| {
                        bn.iter_custom(|iters| {
                            let b = b.clone();
                            threads_wall(threads, move |t| {
                                let base = if spread == "same" { 0 } else { t * CHUNK };
                                for i in 0..iters {
                                    let off = base + ((i << 12) % CHUNK);
                                    let r = b.start_write(black_box(off), 4096);
                                    assert_eq!(r, Ok(None));
                                    b.end_write(off, 4096).unwrap();
                                }
                            })
                        })
                    });
                }
            }
        }
        g.finish();
    }
}

testkit::bench_main!(benches::start_end);
