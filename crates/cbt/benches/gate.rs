//! What a write pays to be counted in its export's dirty bitmaps, in the steady state (every
//! granule already durable): `Bitmaps::start_write` + `end_write` with the lock-free gate
//! against the locked twin it replaces (`cbt::Mode`), with 0 and 1 bitmaps. One iteration is
//! one write's enter, mark (an `Acquire` load per word per bitmap) and exit. `threads/N`: N
//! threads write at once (distinct granules), as N connections do on the server.
//!
//! Under loom the facade's types only work inside a model: the body is `cfg(not(blkq_loom))`.

#[cfg(not(blkq_loom))]
mod benches {
    use std::hint::black_box;

    use blkq_sync::Arc;
    use cbt::{Bitmaps, Mode, Options};
    use criterion::Criterion;
    use testkit::baseline::threads_wall;

    const CAP: u64 = 1 << 30;

    fn bitmaps(mode: Mode, n: usize) -> Arc<Bitmaps> {
        let (b, _) = Bitmaps::open(
            CAP,
            &Options {
                mode,
                ..Options::memory()
            },
        )
        .unwrap();
        for i in 0..n {
            b.add(&format!("b{i}"), 65536).unwrap();
        }
        // Every granule durable: the steady state.
        for off in (0..CAP).step_by(1 << 20) {
            let (g, r) = b.start_write(off, 1 << 20);
            r.unwrap();
            b.end_write(g);
        }
        Arc::new(b)
    }

    pub fn enter_mark_exit(c: &mut Criterion) {
        let mut g = c.benchmark_group("cbt_write_gate");
        for nbitmaps in [0usize, 1] {
            for threads in [1usize, 2, 4] {
                for (name, mode) in [("lockfree", Mode::LockFree), ("locked", Mode::Locked)] {
                    let b = bitmaps(mode, nbitmaps);
                    g.bench_function(
                        format!("{name}/bitmaps/{nbitmaps}/threads/{threads}"),
                        |bn| {
                            bn.iter_custom(|iters| {
                                let b = b.clone();
                                threads_wall(threads, move |t| {
                                    for i in 0..iters {
                                        let off = ((t << 28) + (i << 12)) % CAP;
                                        let (g, r) = b.start_write(black_box(off), 4096);
                                        r.unwrap();
                                        b.end_write(g);
                                    }
                                })
                            })
                        },
                    );
                }
            }
        }
        g.finish();
    }
}

testkit::bench_main!(benches::enter_mark_exit);
