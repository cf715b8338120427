//! `sbitmap`: the scalable tag bitmap of blk-mq and its wait queues (counter-based batched
//! wake-ups).
//!
//! - [`Sbitmap`]: a cache line per word, per-thread allocation hints, deferred clearing,
//!   shallow and batch allocation, resize, round-robin mode.
//! - [`SbitmapQueue`]: the bitmap plus eight wait queues, woken in batches driven by
//!   ever-increasing completion and wake-up counters ([`WakeAlgo::Counter`]), with the legacy
//!   `wait_cnt` algorithm ([`WakeAlgo::Legacy`]) kept behind a run-time switch for comparison.
#![warn(missing_docs)]
#![warn(clippy::too_many_lines)]

mod bitmap;
mod queue;

pub use bitmap::{default_shift, Sbitmap, TagBatch, MAX_BITS_PER_WORD, MAX_DEPTH};
pub use queue::{calc_wake_batch, GetTag, SbitmapQueue, WakeAlgo, SBQ_WAIT_QUEUES, SBQ_WAKE_BATCH};

/// Errors of the tag bitmap.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The requested depth is larger than supported (or than the capacity, for `resize`).
    #[error("depth {depth} is larger than the maximum {max}")]
    DepthTooLarge {
        /// What was asked for.
        depth: u32,
        /// The limit.
        max: u32,
    },
    /// Words may hold at most `1 << max` bits.
    #[error("shift {shift} is larger than the maximum {max} (at most 32 bits per word)")]
    BadShift {
        /// What was asked for.
        shift: u32,
        /// The limit.
        max: u32,
    },
    /// A wake-up algorithm name that is neither `counter` nor `legacy`.
    #[error("unknown wake-up algorithm {0:?} (expected counter or legacy)")]
    UnknownAlgo(String),
}

impl Error {
    /// The errno this maps to (all are invalid arguments).
    pub fn errno(&self) -> i32 {
        22 // EINVAL
    }
}
