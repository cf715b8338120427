//! `Completion`: the kernel's completion on top of the swait-style [`WaitQueue`] (the
//! "swait completions" design: completions built on simple wait queues).
//!
//! # State of `done`
//!
//! | value            | meaning                                                          |
//! |------------------|------------------------------------------------------------------|
//! | `0`              | not completed: waits sleep                                       |
//! | `1..=DONE_ALL-1` | that many `complete()` calls not yet consumed by a wait          |
//! | `DONE_ALL`       | `complete_all()`: every wait, current and future, returns at once |
//!
//! A wait consumes one count with a CAS (`try_wait`); `DONE_ALL` is never consumed, only reset
//! by `reinit`. Counting saturates at `DONE_ALL - 1` (the kernel's `UINT_MAX` trick, here with
//! the full 32 bits rather than the halved field of the swait-completions design).
//!
//! # Ordering
//!
//! `complete` raises `done` with Release and `try_wait` takes it with Acquire, so everything
//! the completer wrote before `complete()` is visible to the waiter that returns. The no-lost-
//! wake-up argument is the wait queue's (its module docs): `complete` changes the condition
//! (`done`), then `wake_one` fences and reads `active`; a waiter queues, fences, re-checks.
//!
//! A waiter chosen by `complete()`'s exclusive wake-up that then times out or is cancelled
//! passes the wake-up on (`WaitQueue::wait_for_until`), so a count is never left behind with
//! a sleeper that nobody will wake.

use std::future::Future;
use std::time::{Duration, Instant};

use blkq_sync::atomic::{AtomicBool, AtomicU32, Ordering};

use crate::{Error, WaitQueue};

/// The `done` value that means "completed for everyone".
pub const DONE_ALL: u32 = u32::MAX;

/// A one-shot or counting completion, with the kernel's semantics.
#[derive(Debug, Default)]
pub struct Completion {
    done: AtomicU32,
    wq: WaitQueue,
}

impl Completion {
    /// A completion not yet completed.
    pub fn new() -> Self {
        Self::default()
    }

    /// A completion whose wait queue records wake-up latency.
    pub fn with_latency_recording() -> Self {
        Self {
            done: AtomicU32::new(0),
            wq: WaitQueue::with_latency_recording(),
        }
    }

    /// The wait queue (for its latency histogram and waiter count).
    pub fn queue(&self) -> &WaitQueue {
        &self.wq
    }

    /// Lets exactly one `wait` (current or future) return.
    pub fn complete(&self) {
        let mut cur = self.done.load(Ordering::Relaxed);
        loop {
            if cur == DONE_ALL {
                return; // everyone is released already; nobody sleeps
            }
            let new = if cur == DONE_ALL - 1 { cur } else { cur + 1 };
            // Release: the completer's writes happen-before the Acquire in `try_wait`.
            match self
                .done
                .compare_exchange_weak(cur, new, Ordering::Release, Ordering::Relaxed)
            {
                Ok(_) => break,
                Err(v) => cur = v,
            }
        }
        self.wq.wake_one();
    }

    /// Releases every current and future wait until [`Completion::reinit`].
    pub fn complete_all(&self) {
        self.done.store(DONE_ALL, Ordering::Release);
        self.wq.wake_all();
    }

    /// Consumes one completion without sleeping; returns whether there was one.
    #[inline]
    pub fn try_wait(&self) -> bool {
        let mut cur = self.done.load(Ordering::Acquire);
        loop {
            match cur {
                0 => return false,
                DONE_ALL => return true,
                _ => {}
            }
            match self.done.compare_exchange_weak(
                cur,
                cur - 1,
                Ordering::Acquire,
                Ordering::Acquire,
            ) {
                Ok(_) => return true,
                Err(v) => cur = v,
            }
        }
    }

    /// Whether a wait would return at once (there is a completion to consume).
    #[inline]
    pub fn is_done(&self) -> bool {
        self.done.load(Ordering::Acquire) != 0
    }

    /// Back to "not completed". Like the kernel's `reinit_completion`, call it only when no
    /// one waits.
    pub fn reinit(&self) {
        self.done.store(0, Ordering::Relaxed);
    }

    fn take(&self) -> Option<()> {
        self.try_wait().then_some(())
    }

    /// Sleeps until completed, and consumes the completion.
    pub fn wait(&self) {
        self.wq.wait_for(|| self.take())
    }

    /// Like [`Completion::wait`], for at most `timeout`; returns whether it completed.
    pub fn wait_timeout(&self, timeout: Duration) -> bool {
        self.wait_deadline(Instant::now() + timeout)
    }

    /// Like [`Completion::wait`], until `deadline`; returns whether it completed.
    pub fn wait_deadline(&self, deadline: Instant) -> bool {
        self.wq.wait_for_until(|| self.take(), deadline).is_some()
    }

    /// Like [`Completion::wait`], until another thread cancels `token`
    /// ([`Error::Cancelled`]): the userspace meaning of the kernel's interruptible and
    /// killable waits.
    pub fn wait_cancellable(&self, token: &CancelToken) -> Result<(), Error> {
        self.wq.wait_for_cancellable(|| self.take(), token)
    }

    /// Waits from an async task.
    pub fn wait_async(&self) -> impl Future<Output = ()> + '_ {
        self.wq.wait_for_async(move || self.take())
    }
}

/// Cancels waits from another thread ([`Completion::wait_cancellable`],
/// [`WaitQueue::wait_for_cancellable`]).
///
/// `cancelled` is the condition of its own wait queue: `cancel` stores it and then wakes
/// every waiter through the queue (whose fence orders the store before the `active` load).
#[derive(Debug, Default)]
pub struct CancelToken {
    cancelled: AtomicBool,
    wq: WaitQueue,
}

impl CancelToken {
    /// A token not yet cancelled.
    pub fn new() -> Self {
        Self::default()
    }

    /// Cancels: every wait using this token returns `Err(Cancelled)` unless what it waits for
    /// is already there.
    pub fn cancel(&self) {
        self.cancelled.store(true, Ordering::Relaxed);
        self.wq.wake_all();
    }

    /// Whether [`CancelToken::cancel`] was called (since the last reset).
    #[inline]
    pub fn is_cancelled(&self) -> bool {
        self.cancelled.load(Ordering::Relaxed)
    }

    /// Makes the token usable again.
    pub fn reset(&self) {
        self.cancelled.store(false, Ordering::Relaxed);
    }

    pub(crate) fn queue(&self) -> &WaitQueue {
        &self.wq
    }
}
