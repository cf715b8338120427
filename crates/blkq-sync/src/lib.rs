//! The one sync facade of blkq.
//!
//! Every crate of the workspace takes its atomics, locks, `Arc`, `UnsafeCell` and thread
//! parking from here, never from `std::sync` directly. Built normally these are the `std`
//! types; built with `RUSTFLAGS="--cfg blkq_loom"` they are loom's, so a loom model of an upper
//! layer (raid1, blk) runs the real `sbitmap` and `waitq` code underneath it, not a mock.
//! This is the shape of crossbeam's `primitive` module and tokio's `src/loom/`.
//!
//! Two things loom does not model are mapped deliberately:
//! - **time**: [`park_until`] under loom does not sleep; it yields and reports the deadline as
//!   passed, so a model explores "the timeout fired here" at every point a timed wait can
//!   sleep. Woken-before-timeout is what the untimed models cover.
//! - **thread slots** ([`thread_slot`]): a small per-thread number used to spread per-thread
//!   hints over an array (the userspace stand-in for per-CPU data). Under loom every thread
//!   gets slot 0: hints are only hints, and correctness must not depend on them.
#![warn(missing_docs)]
// The one crate allowed to name `std::sync` (the workspace's clippy.toml forbids it elsewhere).
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]
#![warn(clippy::too_many_lines)]

use core::ops::{Deref, DerefMut};

// Built normally, the facade's names are type aliases and thin wrapper functions rather than
// re-exports: an alias has a name of its own, so the workspace's `clippy.toml`
// (`disallowed-types` / `disallowed-methods` on `std::sync` atomics, `Mutex`, `Arc`, `fence`
// and `thread::park`) flags a direct use of `std::sync` anywhere outside this crate, and not the
// facade's own names, which resolve to the same `std` types.
#[cfg(not(blkq_loom))]
mod imp {
    /// `std::sync::Arc`, or loom's under `--cfg blkq_loom`.
    pub type Arc<T> = std::sync::Arc<T>;

    /// Atomics: `std::sync::atomic`, or loom's under `--cfg blkq_loom`.
    pub mod atomic {
        pub use std::sync::atomic::Ordering;

        /// `std::sync::atomic::AtomicBool`, or loom's.
        pub type AtomicBool = std::sync::atomic::AtomicBool;
        /// `std::sync::atomic::AtomicI32`, or loom's.
        pub type AtomicI32 = std::sync::atomic::AtomicI32;
        /// `std::sync::atomic::AtomicI64`, or loom's.
        pub type AtomicI64 = std::sync::atomic::AtomicI64;
        /// `std::sync::atomic::AtomicU32`, or loom's.
        pub type AtomicU32 = std::sync::atomic::AtomicU32;
        /// `std::sync::atomic::AtomicU64`, or loom's.
        pub type AtomicU64 = std::sync::atomic::AtomicU64;
        /// `std::sync::atomic::AtomicUsize`, or loom's.
        pub type AtomicUsize = std::sync::atomic::AtomicUsize;

        /// `std::sync::atomic::fence`, or loom's (which models `SeqCst` fences).
        #[inline(always)]
        pub fn fence(order: Ordering) {
            std::sync::atomic::fence(order)
        }
    }

    /// Threads: `std::thread`, or loom's under `--cfg blkq_loom`.
    pub mod thread {
        pub use std::thread::{current, spawn, yield_now, JoinHandle, Thread, ThreadId};

        /// `std::thread::park`, or loom's.
        #[inline]
        pub fn park() {
            std::thread::park()
        }
    }

    pub(crate) type RawMutex<T> = std::sync::Mutex<T>;
    pub(crate) type RawGuard<'a, T> = std::sync::MutexGuard<'a, T>;

    pub(crate) type RawRwLock<T> = std::sync::RwLock<T>;
    pub(crate) type RawReadGuard<'a, T> = std::sync::RwLockReadGuard<'a, T>;
    pub(crate) type RawWriteGuard<'a, T> = std::sync::RwLockWriteGuard<'a, T>;

    /// `std::cell::UnsafeCell` with loom's closure-based access API.
    #[derive(Debug, Default)]
    pub struct UnsafeCell<T>(std::cell::UnsafeCell<T>);

    impl<T> UnsafeCell<T> {
        /// Wraps `value`.
        pub const fn new(value: T) -> Self {
            Self(std::cell::UnsafeCell::new(value))
        }
        /// Runs `f` with a shared raw pointer to the value.
        #[inline(always)]
        pub fn with<R>(&self, f: impl FnOnce(*const T) -> R) -> R {
            f(self.0.get())
        }
        /// Runs `f` with a mutable raw pointer to the value.
        #[inline(always)]
        pub fn with_mut<R>(&self, f: impl FnOnce(*mut T) -> R) -> R {
            f(self.0.get())
        }
    }

    pub fn park_until(deadline: std::time::Instant) -> bool {
        let now = std::time::Instant::now();
        if now >= deadline {
            return true;
        }
        std::thread::park_timeout(deadline - now);
        std::time::Instant::now() >= deadline
    }

    pub fn thread_slot() -> usize {
        use std::cell::Cell;
        // The id source is not modelled state: it only names threads.
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        thread_local! {
            static SLOT: Cell<usize> = const { Cell::new(usize::MAX) };
        }
        SLOT.with(|s| {
            let v = s.get();
            if v != usize::MAX {
                return v;
            }
            let v = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            s.set(v);
            v
        })
    }
}

#[cfg(blkq_loom)]
mod imp {
    pub use loom::sync::Arc;

    /// Atomics: `std::sync::atomic`, or loom's under `--cfg blkq_loom`.
    pub mod atomic {
        pub use loom::sync::atomic::{
            fence, AtomicBool, AtomicI32, AtomicI64, AtomicU32, AtomicU64, AtomicUsize, Ordering,
        };
    }

    /// Threads: `std::thread`, or loom's under `--cfg blkq_loom`.
    pub mod thread {
        pub use loom::thread::{current, park, spawn, yield_now, JoinHandle, Thread, ThreadId};
    }

    pub(crate) type RawMutex<T> = loom::sync::Mutex<T>;
    pub(crate) type RawGuard<'a, T> = loom::sync::MutexGuard<'a, T>;

    pub(crate) type RawRwLock<T> = loom::sync::RwLock<T>;
    pub(crate) type RawReadGuard<'a, T> = loom::sync::RwLockReadGuard<'a, T>;
    pub(crate) type RawWriteGuard<'a, T> = loom::sync::RwLockWriteGuard<'a, T>;

    pub use loom::cell::UnsafeCell;

    pub fn park_until(_deadline: std::time::Instant) -> bool {
        loom::thread::yield_now();
        true
    }

    pub fn thread_slot() -> usize {
        0
    }
}

pub use imp::{atomic, thread, Arc, UnsafeCell};

// The raw locks of either implementation, poisoning ignored: a panic while holding one of our
// locks leaves state that every path re-validates (queues of waiters, counters); poisoning
// would only turn one panic into many.

fn raw_lock<T>(m: &imp::RawMutex<T>) -> imp::RawGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn raw_try_lock<T>(m: &imp::RawMutex<T>) -> Option<imp::RawGuard<'_, T>> {
    match m.try_lock() {
        Ok(g) => Some(g),
        Err(std::sync::TryLockError::Poisoned(e)) => Some(e.into_inner()),
        Err(std::sync::TryLockError::WouldBlock) => None,
    }
}

fn raw_read<T>(l: &imp::RawRwLock<T>) -> imp::RawReadGuard<'_, T> {
    l.read().unwrap_or_else(|e| e.into_inner())
}

fn raw_write<T>(l: &imp::RawRwLock<T>) -> imp::RawWriteGuard<'_, T> {
    l.write().unwrap_or_else(|e| e.into_inner())
}

/// `std::sync::Arc`, under loom too: the handle for shared **trait objects** (`Arc<dyn
/// Device>`, `Arc<dyn EndIo>`). Loom's `Arc` cannot hold an unsized value, and a reference count
/// only decides when a value is freed, never what another thread sees of it, so nothing a model
/// must explore goes through it. Use [`Arc`] for everything else.
pub type DynArc<T> = std::sync::Arc<T>;

/// Statistics counters: always `std` atomics, also under loom. Nothing may decide anything on
/// them (they are read only for reports), so they carry no ordering worth modelling, and as
/// loom atomics they multiplied model run times. The one sanctioned exception to "every atomic
/// from the facade is loom's under `--cfg blkq_loom`".
///
/// Also the one sharded-counter type of the workspace ([`stat::ShardedCounters`]) and the one
/// function that sizes per-thread shard arrays ([`stat::shard_count`]).
pub mod stat {
    pub use std::sync::atomic::Ordering;

    /// A statistics counter (`std::sync::atomic::AtomicU64`, under loom too).
    pub type StatU64 = std::sync::atomic::AtomicU64;

    use crate::CachePadded;

    /// How many shards a per-thread sharded array gets: the machine's parallelism rounded up
    /// to a power of two (so a shard is picked with a mask), at most 64; 1 under loom, where
    /// every thread has slot 0 anyway. Index with `thread_slot() & (shard_count() - 1)`.
    pub fn shard_count() -> usize {
        if cfg!(blkq_loom) {
            1
        } else {
            std::thread::available_parallelism()
                .map_or(4, |n| n.get())
                .next_power_of_two()
                .min(64)
        }
    }

    /// `N` statistics counters, sharded by thread slot (one cache-line pair per shard) so that
    /// counting adds no shared line per I/O. `Relaxed` adds, summed on read: a snapshot may be
    /// torn between shards, which is fine for statistics.
    #[derive(Debug)]
    pub struct ShardedCounters<const N: usize> {
        shards: Box<[CachePadded<[StatU64; N]>]>,
    }

    impl<const N: usize> Default for ShardedCounters<N> {
        fn default() -> Self {
            Self::new()
        }
    }

    impl<const N: usize> ShardedCounters<N> {
        /// Zeroed counters, [`shard_count`] shards.
        pub fn new() -> Self {
            Self {
                shards: (0..shard_count())
                    .map(|_| CachePadded(std::array::from_fn(|_| StatU64::new(0))))
                    .collect(),
            }
        }

        /// The current thread's shard, for several adds in a row (the thread slot is a hint:
        /// any shard is correct, a thread's own is merely uncontended).
        #[inline]
        pub fn local(&self) -> &[StatU64; N] {
            &self.shards[crate::thread_slot() & (self.shards.len() - 1)]
        }

        /// Adds `v` to counter `i` (no-op for `i >= N`).
        #[inline]
        pub fn add(&self, i: usize, v: u64) {
            if let Some(c) = self.local().get(i) {
                c.fetch_add(v, Ordering::Relaxed);
            }
        }

        /// The sum of counter `i` over every shard (0 for `i >= N`).
        pub fn sum(&self, i: usize) -> u64 {
            self.shards
                .iter()
                .map(|s| s.get(i).map_or(0, |c| c.load(Ordering::Relaxed)))
                .sum()
        }
    }
}

/// Parks the current thread until it is unparked or `deadline` passes; returns whether the
/// deadline has passed. Like `park`, it may return early for no reason: callers re-check.
///
/// Under loom it yields and always reports the deadline as passed (see the crate docs).
#[inline]
pub fn park_until(deadline: std::time::Instant) -> bool {
    imp::park_until(deadline)
}

/// A small dense number naming the current thread, for indexing per-thread hint arrays.
#[inline]
pub fn thread_slot() -> usize {
    imp::thread_slot()
}

/// A mutex that does not poison: the facade's `std::sync::Mutex` or loom's.
#[derive(Debug, Default)]
pub struct Mutex<T>(imp::RawMutex<T>);

/// The guard of [`Mutex`].
pub struct MutexGuard<'a, T>(imp::RawGuard<'a, T>);

impl<T> Mutex<T> {
    /// A new unlocked mutex holding `value`.
    pub fn new(value: T) -> Self {
        Self(imp::RawMutex::new(value))
    }

    /// Locks, blocking until the lock is free.
    #[inline]
    pub fn lock(&self) -> MutexGuard<'_, T> {
        MutexGuard(raw_lock(&self.0))
    }

    /// Locks if the lock is free right now.
    #[inline]
    pub fn try_lock(&self) -> Option<MutexGuard<'_, T>> {
        raw_try_lock(&self.0).map(MutexGuard)
    }
}

impl<T> Deref for MutexGuard<'_, T> {
    type Target = T;
    #[inline]
    fn deref(&self) -> &T {
        &self.0
    }
}

impl<T> DerefMut for MutexGuard<'_, T> {
    #[inline]
    fn deref_mut(&mut self) -> &mut T {
        &mut self.0
    }
}

/// A reader-writer lock that does not poison: the facade's `std::sync::RwLock` or loom's.
/// Which of readers and writers std favours is the platform's choice (futex-based on Linux:
/// a waiting writer blocks new readers, so writers are not starved).
#[derive(Debug, Default)]
pub struct RwLock<T>(imp::RawRwLock<T>);

/// The shared guard of [`RwLock`].
pub struct RwLockReadGuard<'a, T>(imp::RawReadGuard<'a, T>);

/// The exclusive guard of [`RwLock`].
pub struct RwLockWriteGuard<'a, T>(imp::RawWriteGuard<'a, T>);

impl<T> RwLock<T> {
    /// A new unlocked lock holding `value`.
    pub fn new(value: T) -> Self {
        Self(imp::RawRwLock::new(value))
    }

    /// Locks shared, blocking while a writer holds it.
    #[inline]
    pub fn read(&self) -> RwLockReadGuard<'_, T> {
        RwLockReadGuard(raw_read(&self.0))
    }

    /// Locks exclusive, blocking while anyone holds it.
    #[inline]
    pub fn write(&self) -> RwLockWriteGuard<'_, T> {
        RwLockWriteGuard(raw_write(&self.0))
    }
}

impl<T> Deref for RwLockReadGuard<'_, T> {
    type Target = T;
    #[inline]
    fn deref(&self) -> &T {
        &self.0
    }
}

impl<T> Deref for RwLockWriteGuard<'_, T> {
    type Target = T;
    #[inline]
    fn deref(&self) -> &T {
        &self.0
    }
}

impl<T> DerefMut for RwLockWriteGuard<'_, T> {
    #[inline]
    fn deref_mut(&mut self) -> &mut T {
        &mut self.0
    }
}

/// Pads and aligns `T` to 128 bytes: one value per cache line (two 64-byte lines, since x86's
/// adjacent-line prefetcher pulls pairs; crossbeam chooses the same).
#[derive(Debug, Default)]
#[repr(align(128))]
pub struct CachePadded<T>(pub T);

impl<T> Deref for CachePadded<T> {
    type Target = T;
    #[inline(always)]
    fn deref(&self) -> &T {
        &self.0
    }
}

impl<T> DerefMut for CachePadded<T> {
    #[inline(always)]
    fn deref_mut(&mut self) -> &mut T {
        &mut self.0
    }
}

/// Runs `f` as a loom model (explores interleavings) under `--cfg blkq_loom`, and once
/// otherwise. Lets a model test double as a plain smoke test.
///
/// Under loom the body runs on the model's first thread, whose stack loom makes 32 KiB. A
/// model whose body needs more calls [`model_deep`].
pub fn model<F>(f: F)
where
    F: Fn() + Sync + Send + 'static,
{
    #[cfg(blkq_loom)]
    loom::model(f);
    #[cfg(not(blkq_loom))]
    f();
}

/// [`model`] for a body that needs a deeper stack than loom's first thread has: under loom it
/// runs on a thread of the model with a stack of [`MODEL_STACK_WORDS`]. A build without
/// cross-crate inlining (the `loom` profile: no LTO, so the models build in half the CPU time)
/// overflows 32 KiB in the deeper models (cbt's rotations). The first thread only waits for
/// it, which adds no interleaving that matters: it has nothing else to run. The thread costs
/// a stack allocated and freed in every execution, so only the models that need it use it.
pub fn model_deep<F>(f: F)
where
    F: Fn() + Sync + Send + 'static,
{
    #[cfg(blkq_loom)]
    {
        // Plain `std::sync::Arc`: it carries the closure into each execution, outside what
        // the model checks.
        let f = std::sync::Arc::new(f);
        loom::model(move || {
            let f = f.clone();
            loom::thread::Builder::new()
                .stack_size(MODEL_STACK_WORDS)
                .spawn(move || f())
                .expect("spawn the model's thread")
                .join()
                .expect("the model's thread panicked");
        });
    }
    #[cfg(not(blkq_loom))]
    f();
}

/// The stack of a [`model_deep`] body under loom, in words (loom hands the size to its
/// coroutines, which count words): 512 KiB.
pub const MODEL_STACK_WORDS: usize = 1 << 16;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mutex_locks_and_try_lock_fails_while_held() {
        let m = Mutex::new(1);
        let mut g = m.lock();
        *g += 1;
        assert!(m.try_lock().is_none());
        drop(g);
        assert_eq!(*m.lock(), 2);
    }

    #[test]
    fn rwlock_shares_readers_and_excludes_writers() {
        let l = RwLock::new(1);
        {
            let a = l.read();
            let b = l.read();
            assert_eq!(*a + *b, 2);
        }
        *l.write() += 1;
        assert_eq!(*l.read(), 2);
    }

    #[test]
    fn cache_padded_is_aligned() {
        assert_eq!(core::mem::align_of::<CachePadded<u8>>(), 128);
    }

    #[cfg(not(blkq_loom))]
    #[test]
    fn sharded_counters_sum_over_threads() {
        let c = Arc::new(stat::ShardedCounters::<2>::new());
        c.add(0, 2);
        c.add(5, 1); // out of range: ignored
        let c2 = Arc::clone(&c);
        std::thread::spawn(move || c2.add(0, 3)).join().unwrap();
        assert_eq!(c.sum(0), 5);
        assert_eq!(c.sum(1), 0);
        assert_eq!(c.sum(9), 0);
        assert!(stat::shard_count().is_power_of_two());
    }

    #[cfg(not(blkq_loom))]
    #[test]
    fn thread_slots_differ_between_threads() {
        let a = thread_slot();
        assert_eq!(a, thread_slot());
        let b = std::thread::spawn(thread_slot).join().unwrap();
        assert_ne!(a, b);
    }
}
