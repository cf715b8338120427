//! Running a loom model that must fail, in a child process of the test binary.
//!
//! When a loom model fails (a deadlock, a failed assertion), loom reports it and then aborts
//! the process while unwinding the model's threads, which `#[should_panic]` cannot catch. So
//! the test re-runs its own binary, filtered to itself, with an environment variable set; in
//! that child the model runs, and the parent checks that the child failed, and returns its
//! stderr for the test to check the reason.

/// The environment variable that marks the child; its value is the test's name.
pub const CHILD_ENV: &str = "BLKQ_TESTKIT_LOOM_CHILD";

/// Runs `model` (through `blkq_sync::model`) in a child process running only the test `test`
/// (its name as `--exact` takes it, e.g. `loom_legacy_nested_free_loses_a_wakeup`, or
/// `module::name` for a test in a module) of the current test binary. The calling test must be
/// that test. In the parent, panics if the child passed (`passed_msg` says what that means),
/// and returns the child's stderr; in the child, runs the model and exits.
pub fn expect_model_failure<F>(test: &str, passed_msg: &str, model: F) -> String
where
    F: Fn() + Sync + Send + 'static,
{
    if std::env::var(CHILD_ENV).is_ok_and(|v| v == test) {
        blkq_sync::model(model);
        // The model passed: say so to the parent through the exit status.
        std::process::exit(0);
    }
    let exe = std::env::current_exe().expect("the test binary's path");
    let out = std::process::Command::new(exe)
        .args(["--exact", test, "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, test)
        .output()
        .expect("running the test binary as a child");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "{passed_msg}");
    stderr
}
