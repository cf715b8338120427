//! The memory budget's two implementations (`nbd::server::BudgetImpl`): the lock-free counter
//! against the locked version it replaces. One iteration is what a request costs the budget:
//! a `try_take` of 4 KiB by the reader and a `give` of it after the reply (which also looks
//! for waiters to wake). `threads/N`: N threads do it at once on one budget, as N connections
//! do on the server.
//!
//! Under loom the facade's types only work inside a model: the body is `cfg(not(blkq_loom))`.

#[cfg(not(blkq_loom))]
mod benches {
    use std::hint::black_box;

    use blkq_sync::Arc;
    use criterion::Criterion;
    use nbd::server::{BudgetImpl, MemoryBudget};
    use testkit::baseline::threads_wall;

    pub fn take_give(c: &mut Criterion) {
        let mut g = c.benchmark_group("budget_take_give");
        for threads in [1usize, 2, 4] {
            for (name, imp) in [
                ("atomic", BudgetImpl::Atomic),
                ("locked", BudgetImpl::Locked),
            ] {
                g.bench_function(format!("{name}/threads/{threads}"), |b| {
                    b.iter_custom(|iters| {
                        let budget = Arc::new(MemoryBudget::with_impl(64 << 20, imp));
                        threads_wall(threads, move |_| {
                            for _ in 0..iters {
                                assert!(budget.try_take(black_box(4096)));
                                budget.give(black_box(4096));
                            }
                        })
                    })
                });
            }
        }
        g.finish();
    }
}

testkit::bench_main!(benches::take_give);
