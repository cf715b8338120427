//! `testkit`: the helpers the workspace's tests and benchmarks share (dev-only, never a
//! dependency of a library).
//!
//! - [`pattern`]: deterministic, never-zero data patterns to write and check;
//! - [`wait_until`]: poll a condition with a deadline, failing the test when it passes;
//! - [`loom_child`]: run a loom model that is expected to fail in a child process of the test
//!   binary (loom aborts the process when a failing model unwinds);
//! - [`baseline`]: the `Mutex` + `Condvar` baselines the criterion benches measure against,
//!   and their shared criterion configuration;
//! - [`rng`]: SplitMix64, the simulators' seeded randomness;
//! - [`ceph`]: a single-node Ceph cluster per test binary (`scripts/ceph-cluster.sh`);
//! - `Collect` (feature `blk`): an end-io that collects completed bios;
//! - `io` (feature `blk`): synchronous submit-and-wait, `read_at`, `write_at`, `flush` on any device;
//! - `Forward` (feature `blk`): a device that forwards to another, with a hook for the one
//!   behaviour a test changes (fail, record, panic on some bios; hide the queue).
//!
//! Tests observe the system under test from outside, with the operating system's own
//! primitives, so this crate uses `std::sync` (`Mutex`, `Condvar`) directly rather than the
//! `blkq-sync` facade: these helpers never run inside a loom model, and loom's types would
//! panic outside one.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)] // test support, never inside a loom model (crate docs)
#![warn(missing_docs)]
#![warn(clippy::too_many_lines)]

#[cfg(not(blkq_loom))]
pub mod alloc;
#[cfg(not(blkq_loom))]
pub mod baseline;
pub mod ceph;
#[cfg(feature = "blk")]
mod collect;
#[cfg(feature = "blk")]
mod forward;
#[cfg(feature = "blk")]
pub mod io;
pub mod loom_child;
#[cfg(feature = "blk")]
mod lower;
pub mod rng;
mod wait;

#[cfg(feature = "blk")]
pub use collect::{Collect, Done};
#[cfg(feature = "blk")]
pub use forward::{Forward, Hook, OnSubmit};
#[cfg(feature = "blk")]
pub use lower::Lower;
pub use wait::{wait_until, wait_until_within, PROMPT};

/// The `main` of a criterion bench whose body is `cfg(not(blkq_loom))` (under loom the
/// facade's types only work inside a model): runs the given bench functions through
/// [`baseline::run_benches`], and does nothing under loom.
#[macro_export]
macro_rules! bench_main {
    ($($target:path),+ $(,)?) => {
        #[cfg(not(blkq_loom))]
        fn main() {
            $crate::baseline::run_benches(&[$($target),+]);
        }

        #[cfg(blkq_loom)]
        fn main() {}
    };
}

/// `len` bytes of a pattern derived from `seed` (xorshift64), none of them zero, so that
/// written data, holes and zeroed ranges stay distinguishable.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0; len];
    fill_pattern(seed, &mut v);
    v
}

/// Fills `buf` with [`pattern`]`(seed, buf.len())`, without allocating.
pub fn fill_pattern(seed: u64, buf: &mut [u8]) {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    for b in buf {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = (x >> 24) as u8 | 1;
    }
}

/// Whether `buf` holds [`pattern`]`(seed, buf.len())`; on a mismatch, the first differing
/// offset.
pub fn check_pattern(seed: u64, buf: &[u8]) -> Result<(), usize> {
    let want = pattern(seed, buf.len());
    match buf.iter().zip(&want).position(|(a, b)| a != b) {
        Some(i) => Err(i),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pattern_is_deterministic_never_zero_and_checkable() {
        let a = pattern(7, 4096);
        assert_eq!(a, pattern(7, 4096));
        assert_ne!(a, pattern(8, 4096));
        assert!(a.iter().all(|&b| b != 0));
        assert_eq!(check_pattern(7, &a), Ok(()));
        let mut b = a.clone();
        b[100] ^= 0x80;
        assert_eq!(check_pattern(7, &b), Err(100));
        let mut c = vec![0; 4096];
        fill_pattern(7, &mut c);
        assert_eq!(a, c);
    }

    #[test]
    fn wait_until_returns_once_the_condition_holds() {
        let mut n = 0;
        wait_until("three polls", || {
            n += 1;
            n >= 3
        });
        assert_eq!(n, 3);
    }

    #[test]
    #[should_panic(expected = "timed out waiting for: never")]
    fn wait_until_fails_the_test_at_the_deadline() {
        wait_until_within("never", std::time::Duration::from_millis(5), || false);
    }
}
