//! Polling a condition with a deadline.

use std::time::{Duration, Instant};

/// How long a test waits for something that should happen promptly before it fails. Generous:
/// the machines that run the tests are shared and slow; the time is only a hang guard, never
/// an assertion about speed.
pub const PROMPT: Duration = Duration::from_secs(30);

/// Polls `cond` (every millisecond) until it holds, failing the test after [`PROMPT`].
pub fn wait_until(what: &str, cond: impl FnMut() -> bool) {
    wait_until_within(what, PROMPT, cond)
}

/// Polls `cond` until it holds, failing the test after `limit`.
pub fn wait_until_within(what: &str, limit: Duration, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}
