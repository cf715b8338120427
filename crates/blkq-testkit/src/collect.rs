//! `Collect`: an end-io that collects completed bios, to wait on and inspect.

use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use blk::{Bio, EndIo, Error};

use crate::PROMPT;

/// A completed bio and its status.
pub type Done = (Bio, Result<(), Error>);

/// Collects completions; waiters are woken through a condition variable.
#[derive(Default)]
pub struct Collect {
    done: Mutex<Vec<Done>>,
    cv: Condvar,
}

impl EndIo for Collect {
    fn end_io(&self, bio: Bio, res: Result<(), Error>) {
        self.lock().push((bio, res));
        self.cv.notify_all();
    }
}

impl Collect {
    /// The completions so far (a test that panicked while holding the lock does not poison
    /// it for the others).
    pub fn lock(&self) -> MutexGuard<'_, Vec<Done>> {
        self.done.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// How many completions are collected.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether none are.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Takes every completion collected so far, without waiting.
    pub fn take_all(&self) -> Vec<Done> {
        std::mem::take(&mut *self.lock())
    }

    /// Waits until at least `n` completions are collected and takes them all; fails the test
    /// after [`PROMPT`] ("completions missing").
    pub fn wait_for(&self, n: usize) -> Vec<Done> {
        let deadline = Instant::now() + PROMPT;
        let mut g = self.lock();
        while g.len() < n {
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(
                left > Duration::ZERO,
                "completions missing: {} of {n}",
                g.len()
            );
            g = self
                .cv
                .wait_timeout(g, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        std::mem::take(&mut *g)
    }

    /// Waits for at least one completion and takes them all.
    pub fn take(&self) -> Vec<Done> {
        self.wait_for(1)
    }
}
