//! [`SpliceGate`]: a driver's switch for zero-copy reads out of its backend.

use std::io;
use std::os::fd::BorrowedFd;

use blk::Error;
use blkq_sync::atomic::{AtomicBool, Ordering};

use super::store::Backend;

/// A driver's zero-copy switch (the spec's `splice=0|1`): on while the backend can splice and
/// no splice has failed. A failed splice turns it off for good, with a warning: a reply whose
/// bytes were half sent when the error came cannot carry it (the NBD server closes that
/// connection), and a client that reconnects then reads through bios, which report the error
/// as the read's.
#[derive(Debug)]
pub(crate) struct SpliceGate {
    /// Zero-copy reads were asked for and the backend has them.
    supported: bool,
    /// And none has failed: what [`SpliceGate::open`] tells new readers.
    on: AtomicBool,
}

impl SpliceGate {
    pub(crate) fn new(on: bool) -> Self {
        Self {
            supported: on,
            on: AtomicBool::new(on),
        }
    }

    #[inline]
    pub(crate) fn open(&self) -> bool {
        // Relaxed: a switch read as a hint; nothing is published through it.
        self.on.load(Ordering::Relaxed)
    }

    /// `be.splice_read` where supported (a read decided before the gate closed still
    /// splices), closing the gate when the splice fails.
    pub(crate) fn splice(
        &self,
        be: &dyn Backend,
        offset: u64,
        len: usize,
        pipe: BorrowedFd<'_>,
    ) -> Result<usize, Error> {
        if !self.supported {
            return Err(Error::Io(io::ErrorKind::Unsupported.into()));
        }
        be.splice_read(offset, len, pipe).map_err(|e| {
            // Relaxed, as the load: only the warning's once-ness rides on it.
            if self.on.swap(false, Ordering::Relaxed) {
                tracing::warn!(
                    "zero-copy reads turned off for {be:?}: splice at {offset}+{len} failed: {e}"
                );
            }
            Error::Io(e)
        })
    }
}
