//! A counting global allocator for "allocates nothing in the steady state" tests.
//!
//! A test binary installs it (`#[global_allocator] static A: CountingAlloc =
//! CountingAlloc::new();`), warms up, then brackets the window it checks with
//! [`CountingAlloc::start`] and [`CountingAlloc::stop`], which returns how many allocations
//! and reallocations any thread made inside the window. It forwards everything to the system
//! allocator unchanged.
//!
//! A thread can leave itself out of the count with [`CountingAlloc::exclude_current_thread`]:
//! a test that drives a server in-process excludes its client threads, so that the window
//! counts only the server's allocations.

use std::alloc::{GlobalAlloc, Layout, System};
// The facade's atomics (std's outside loom; this module is not built under loom, where a
// global allocator could not use loom's types). Relaxed throughout: the count is a statistic
// read after the window by the thread that closed it, and nothing else is published by it.
use blkq_sync::atomic::{AtomicBool, AtomicU64, Ordering};

std::thread_local! {
    /// Whether this thread's allocations are left out of the count. A `Cell` with a const
    /// initializer and no destructor: reading it from inside the allocator neither allocates
    /// nor registers anything, on any thread, at any point of its life.
    static EXCLUDED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// The system allocator, counting allocations while switched on.
#[derive(Debug, Default)]
pub struct CountingAlloc {
    on: AtomicBool,
    count: AtomicU64,
}

impl CountingAlloc {
    /// Off, at zero.
    pub const fn new() -> Self {
        Self {
            on: AtomicBool::new(false),
            count: AtomicU64::new(0),
        }
    }

    /// Zeroes the count and starts counting.
    pub fn start(&self) {
        self.count.store(0, Ordering::Relaxed);
        self.on.store(true, Ordering::Relaxed);
    }

    /// Stops counting; returns the allocations (and reallocations) since `start`.
    pub fn stop(&self) -> u64 {
        self.on.store(false, Ordering::Relaxed);
        self.count.load(Ordering::Relaxed)
    }

    /// Leaves the calling thread's allocations out of every count from now on (a test's
    /// client threads, whose allocations are not the code under test's).
    pub fn exclude_current_thread() {
        EXCLUDED.with(|e| e.set(true));
    }

    fn note(&self) {
        if self.on.load(Ordering::Relaxed) && !EXCLUDED.with(|e| e.get()) {
            self.count.fetch_add(1, Ordering::Relaxed);
        }
    }
}

// SAFETY: forwards to the system allocator unchanged; only counts.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        self.note();
        // SAFETY: the caller's contract is `GlobalAlloc::alloc`'s, passed on.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: `p` came from `alloc` above, i.e. from `System`, with layout `l`.
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        self.note();
        // SAFETY: as for `dealloc`; `n` is the caller's new size.
        unsafe { System.realloc(p, l, n) }
    }
}
