//! The expected failure of the legacy wake-up algorithm, shown by loom.
//!
//! Loom reports the lost wake-up as a deadlock and then aborts the process while unwinding
//! its threads, so the model runs in a child process of this test binary and the test checks
//! that the child died reporting a deadlock.
#![cfg(blkq_loom)]

mod common;

const CHILD: &str = "BLKQ_LOOM_LEGACY_CHILD";

#[test]
fn loom_legacy_nested_free_loses_a_wakeup() {
    if std::env::var_os(CHILD).is_some() {
        blkq_sync::model(|| common::two_sleepers_two_frees(sbitmap::WakeAlgo::Legacy, true));
        return;
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "loom_legacy_nested_free_loses_a_wakeup",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, "1")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "the legacy algorithm passed the model"
    );
    assert!(
        stderr.contains("deadlock"),
        "child failed for another reason:\n{stderr}"
    );
}
