//! Hooks ([`testkit::Forward`]) the tests put between the server and its device.

use std::sync::atomic::{AtomicUsize, Ordering};

use blk::{Device, RecvSource};
use testkit::Hook;

/// Forwards everything to the device, counting the writes received into their home
/// (`recv_home`).
#[derive(Default)]
pub struct CountHome(AtomicUsize);

impl CountHome {
    /// The writes received home so far.
    pub fn count(&self) -> usize {
        // Relaxed: a test counter, read after the replies came.
        self.0.load(Ordering::Relaxed)
    }
}

impl Hook for CountHome {
    fn transparent(&self) -> bool {
        true
    }
    fn recv_home(
        &self,
        inner: &dyn Device,
        offset: u64,
        len: usize,
        src: &mut dyn RecvSource,
    ) -> Result<(), blk::Error> {
        // Relaxed: a test counter, read after the replies came.
        self.0.fetch_add(1, Ordering::Relaxed);
        inner.recv_home(offset, len, src)
    }
}
