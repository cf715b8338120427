//! `waitq`: an swait-style wait queue and the kernel's `Completion`, for threads and async
//! tasks (swait completions: completions built on simple wait queues).
//!
//! - [`WaitQueue`]: a FIFO of waiters with exclusive, oldest-first wake-ups (`wake_one`,
//!   `wake_n`, `wake_all`), a prepare / re-check / sleep / finish protocol that cannot lose a
//!   wake-up, no lock taken by a wake with no waiters, and wakers woken outside the lock.
//! - [`Completion`]: `complete`, `complete_all`, `wait`, `wait_timeout`, `wait_cancellable`,
//!   `try_wait`, `is_done`, `reinit`, `wait_async`.
//! - [`LatencyHistogram`]: optional wake-up latency recording, off (one branch) by default.
#![warn(missing_docs)]
#![warn(clippy::too_many_lines)]

mod completion;
mod hist;
mod queue;

pub use completion::{CancelToken, Completion, DONE_ALL};
pub use hist::{bucket_of, HistogramSnapshot, LatencyHistogram, BUCKETS};
pub use queue::{wakeups, WaitFor, WaitKey, WaitQueue, Waiter, WakeList, WAKE_LIST_CAP};

/// Why a wait returned without what it waited for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Another thread cancelled the wait through its [`CancelToken`].
    #[error("wait cancelled")]
    Cancelled,
    /// The deadline passed first.
    #[error("wait timed out")]
    TimedOut,
}

impl Error {
    /// The errno a kernel wait would return for this.
    pub fn errno(self) -> i32 {
        match self {
            Error::Cancelled => 4,  // EINTR
            Error::TimedOut => 110, // ETIMEDOUT
        }
    }
}
