//! [`SubmitError`]: a batch an engine took only in part.

use std::io;

/// A failed [`UringEngine::submit_batch`](crate::UringEngine::submit_batch) /
/// [`FileEngine::submit_batch`](crate::FileEngine::submit_batch): the first
/// `accepted` ops were taken (each will be called back), the rest were not.
#[derive(Debug, thiserror::Error)]
#[error("submitted {accepted} ops, then: {error}")]
pub struct SubmitError {
    /// How many ops, from the start of the batch, were accepted.
    pub accepted: usize,
    /// Why the next one was not.
    #[source]
    pub error: io::Error,
}

impl From<SubmitError> for io::Error {
    fn from(e: SubmitError) -> io::Error {
        e.error
    }
}
