//! The gate: which bitmaps a write is counted in, switched atomically by `add`, `remove`,
//! `clear` and `rotate`, with a wait for the writes counted under the old set.
//!
//! A write [`Gate::enter`]s, reads the published set of recording bitmaps, sets its bits in
//! each (persisting them when new), goes down to the device, and [`Gate::exit`]s when the
//! device completed it. A publisher ([`Gate::publish`], serialized by the caller) installs a
//! new set and returns once every write counted under the old one has exited. So each write is
//! counted in exactly one published set (never none, never two), and once `publish` returns,
//! every write counted in the old set is complete: a backup that reads a frozen bitmap's runs
//! after `rotate` sees every write it counts.
//!
//! # State
//!
//! | field | meaning |
//! |---|---|
//! | `gen` | the published generation; only the publisher stores it |
//! | `inflight[g & 1][s]` | writes counted under generation `g` by threads of shard `s` (`thread_slot() % SHARDS`) and not yet exited, plus writers that looked at a stale generation and are about to back off; a generation's count is the sum over its shards |
//! | `sets[g & 1]` | the set of generation `g`; written only by the publisher, while no writer can read it |
//!
//! # Orderings (a store-buffer pattern, hence `SeqCst` fences)
//!
//! - A writer increments `inflight[g & 1]`, then re-loads `gen`; the publisher stores `gen`,
//!   then loads `inflight[old & 1]`. With a `SeqCst` fence between the two accesses on each
//!   side (not just `SeqCst` accesses: loom models fences, and treats `SeqCst` accesses as
//!   `AcqRel`, under which its model of this gate fails), one of them sees the other: either
//!   the writer sees the new generation (and backs off, decrementing: it was counted in no set)
//!   or the publisher sees the writer's count (and waits for its exit). A writer that re-loads
//!   the generation it started with is counted in that generation's set, which cannot change
//!   until its count is gone.
//! - The counts are sharded by thread (percpu-refcount's idea): a write touches only its own
//!   shard's cache line, so writers on many cores do not bounce one line. The argument above
//!   holds per shard: the publisher loads every shard after its fence, and a counted writer's
//!   increment is visible in its shard until its exit; a writer that increments a shard after
//!   the publisher read it re-loads the generation after its fence, which then follows the
//!   publisher's, so it sees the new generation and backs off. So once every shard was seen
//!   at zero after the store, no write counted under the old generation is left. A token
//!   returned by [`Gate::enter`] names the generation and the shard, for [`Gate::exit`].
//! - Before writing `sets[next & 1]`, the publisher waits for `inflight[next & 1] == 0`: the
//!   writers of generation `next - 2` are gone (the previous publish waited for them), and a
//!   writer still holding a stale `gen` that increments that counter now will see `gen !=` its
//!   value and back off without reading the set. The `Release` of the `gen` store (part of
//!   `SeqCst`) publishes the set; the writer's `SeqCst` re-load acquires it.
//! - A writer's exit decrements (`SeqCst`), then loads `gen` (`SeqCst`): when it took the count
//!   to zero and the generation moved on, a publisher may be waiting, so it wakes the drain
//!   queue. If the load misses the publisher's store, the publisher's check (after its store)
//!   sees the zero. The queue's own arm/re-check protocol covers the sleep itself.
//!
//! The locked twin ([`Mode::Locked`]) takes a mutex around the same steps instead of relying
//! on the orderings: it is what the lock-free path replaces, kept to compare (`blkq bench`
//! and crates/cbt/benches).

use blkq_sync::atomic::{fence, AtomicU64, Ordering};
use blkq_sync::{CachePadded, Mutex, UnsafeCell};
use waitq::WaitQueue;

/// How writers enter the gate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Mode {
    /// Atomics only: a load, an increment and a load per write (the default).
    #[default]
    LockFree,
    /// A mutex per enter and exit (the simple version, for comparison).
    Locked,
}

impl std::str::FromStr for Mode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "lockfree" | "lock-free" => Ok(Mode::LockFree),
            "locked" => Ok(Mode::Locked),
            _ => Err(format!("unknown gate mode {s:?} (lockfree | locked)")),
        }
    }
}

/// Shards of each generation's count (the locked twin uses the first only).
pub const SHARDS: usize = 16;
/// Bits of a token that name the shard.
const SHARD_BITS: u32 = 8;

type Counts = [CachePadded<AtomicU64>; SHARDS];

fn counts() -> Counts {
    std::array::from_fn(|_| CachePadded(AtomicU64::new(0)))
}

/// See the module docs.
pub struct Gate<S> {
    mode: Mode,
    gen: CachePadded<AtomicU64>,
    inflight: [Counts; 2],
    sets: [UnsafeCell<S>; 2],
    /// The locked twin's lock (also held by the publisher while it switches, in that mode).
    lock: Mutex<()>,
    drained: WaitQueue,
}

// SAFETY: `sets` is the only non-Sync field; a set is written only by the publisher while no
// writer can be reading it, and read by writers only while their count pins it (module docs),
// so `&Gate` may be shared when `S` itself may be sent and shared.
unsafe impl<S: Send + Sync> Sync for Gate<S> {}
// SAFETY: owning a Gate owns its sets.
unsafe impl<S: Send> Send for Gate<S> {}

impl<S> Gate<S> {
    /// A gate whose generation 0 publishes `initial`; `spare` fills the other slot.
    pub fn new(mode: Mode, initial: S, spare: S) -> Self {
        Self {
            mode,
            gen: CachePadded(AtomicU64::new(0)),
            inflight: [counts(), counts()],
            sets: [UnsafeCell::new(initial), UnsafeCell::new(spare)],
            lock: Mutex::new(()),
            drained: WaitQueue::new(),
        }
    }

    /// The mode.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// Counts a write in the published set and runs `f` on it; returns the token to
    /// [`Gate::exit`] with (its generation and shard), and `f`'s result. Never blocks on a
    /// publisher.
    pub fn enter<R>(&self, f: impl FnOnce(&S) -> R) -> (u64, R) {
        if self.mode == Mode::Locked {
            let g = {
                let _l = self.lock.lock();
                let g = self.gen.load(Ordering::Relaxed);
                // Relaxed under the lock: the publisher reads the counters under it too.
                self.inflight[(g & 1) as usize][0].fetch_add(1, Ordering::Relaxed);
                g
            };
            return (g << SHARD_BITS, self.read(g, f));
        }
        self.enter_in(blkq_sync::thread_slot(), f)
    }

    /// [`Gate::enter`] counting in shard `shard % SHARDS` (the lock-free mode; what `enter`
    /// does with the thread's slot, and what a model uses to put two threads in two shards,
    /// since under loom every thread has slot 0).
    pub fn enter_in<R>(&self, shard: usize, f: impl FnOnce(&S) -> R) -> (u64, R) {
        let shard = shard % SHARDS;
        loop {
            let g = self.gen.load(Ordering::SeqCst);
            let c = &self.inflight[(g & 1) as usize][shard];
            // SeqCst and the fence: the store-buffer pair with `publish` (module docs).
            c.fetch_add(1, Ordering::SeqCst);
            fence(Ordering::SeqCst);
            let token = (g << SHARD_BITS) | shard as u64;
            if self.gen.load(Ordering::SeqCst) == g {
                return (token, self.read(g, f));
            }
            // Stale: counted in no set. Back off and retry on the new generation.
            self.exit(token);
        }
    }

    fn read<R>(&self, g: u64, f: impl FnOnce(&S) -> R) -> R {
        // SAFETY: our count in `inflight[g & 1]` with `gen == g` pins `sets[g & 1]`: the
        // publisher writes it only after that counter was seen at zero while `gen != g`
        // (module docs).
        self.sets[(g & 1) as usize].with(|p| f(unsafe { &*p }))
    }

    /// Ends a write counted with `token` (from [`Gate::enter`]).
    pub fn exit(&self, token: u64) {
        let g = token >> SHARD_BITS;
        let shard = (token & ((1 << SHARD_BITS) - 1)) as usize;
        let c = &self.inflight[(g & 1) as usize][shard];
        if self.mode == Mode::Locked {
            let last = {
                let _l = self.lock.lock();
                c.fetch_sub(1, Ordering::Relaxed) == 1 && self.gen.load(Ordering::Relaxed) != g
            };
            if last {
                self.drained.wake_all();
            }
            return;
        }
        // SeqCst + fence: pairs with the publisher's store of `gen`, its fence and its check
        // (module docs). Only the exit that reaches zero can be the one a publisher waits for.
        if c.fetch_sub(1, Ordering::SeqCst) == 1 {
            fence(Ordering::SeqCst);
            if self.gen.load(Ordering::SeqCst) != g {
                self.drained.wake_all();
            }
        }
    }

    fn wait_zero(&self, i: usize) {
        self.drained.wait_for(|| {
            let zero = if self.mode == Mode::Locked {
                let _l = self.lock.lock();
                self.inflight[i][0].load(Ordering::Relaxed) == 0
            } else {
                // Every shard seen at zero after the publisher's fence (module docs).
                self.inflight[i]
                    .iter()
                    .all(|c| c.load(Ordering::SeqCst) == 0)
            };
            zero.then_some(())
        });
    }

    /// Publishes `set` and waits until every write counted under the previous set has exited.
    /// The old set stays in its slot until the next publish overwrites it. Callers serialize
    /// publishes.
    pub fn publish(&self, set: S) {
        let g = self.gen.load(Ordering::Relaxed); // only publishers store it, serialized
        let next = g + 1;
        let slot = (next & 1) as usize;
        self.wait_zero(slot);
        // SAFETY: no writer reads `sets[slot]`: its counter was zero with `gen == g`, and any
        // writer that counts there now holds a stale generation and backs off unread.
        self.sets[slot].with_mut(|p| unsafe { *p = set });
        if self.mode == Mode::Locked {
            let _l = self.lock.lock();
            self.gen.store(next, Ordering::Relaxed);
        } else {
            // SeqCst: publishes the set; the fence is the store-buffer pair with `enter`'s and
            // `exit`'s.
            self.gen.store(next, Ordering::SeqCst);
            fence(Ordering::SeqCst);
        }
        self.wait_zero((g & 1) as usize);
    }

    /// The published generation (tests, metrics).
    pub fn generation(&self) -> u64 {
        self.gen.load(Ordering::SeqCst)
    }
}
