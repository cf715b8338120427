//! The expected failure of the legacy wake-up algorithm, shown by loom.
//!
//! Loom reports the lost wake-up as a deadlock and then aborts the process while unwinding
//! its threads, so the model runs in a child process of this test binary and the test checks
//! that the child died reporting a deadlock.
#![cfg(blkq_loom)]

mod common;

#[test]
fn loom_legacy_nested_free_loses_a_wakeup() {
    let stderr = testkit::loom_child::expect_model_failure(
        "loom_legacy_nested_free_loses_a_wakeup",
        "the legacy algorithm passed the model",
        || common::two_sleepers_two_frees(sbitmap::WakeAlgo::Legacy, true),
    );
    assert!(
        stderr.contains("deadlock"),
        "child failed for another reason:\n{stderr}"
    );
}
