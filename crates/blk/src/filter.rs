//! A device stacked on another: [`Filter`]. A filter is a layer over one device (the one
//! below, [`Filter::lower`]) that changes some of what the device does and forwards the rest,
//! as nbdkit's filters sit over a plugin. Every [`Device`] method has a default here that
//! forwards to the device below, and every `Filter` is a `Device` (the blanket impl), so a
//! filter writes only what it changes: the fault device its bio path, the changed-block
//! tracker its writes and its dirty bitmaps, a test's hook the one call it is about.
//!
//! Who owns what: the filter owns the device below (it keeps the `Arc`) and answers for
//! everything it overrides; whatever it does not override is the lower device's answer,
//! unchanged (limits, extents, counters, capabilities, a reconnecting device's checks). So a
//! filter that completes bios itself, or sees them on a path that carries no bio, must say so
//! in what it overrides: the zero-copy paths carry no bio and would pass a bio-path filter
//! by, so such a filter turns them off in its [`Filter::caps`] ([`Caps::bios_only`]) or
//! intercepts them, and a filter whose counts differ from the lower device's hides the lower
//! device's counters ([`Filter::stats`], [`Filter::queue_stats`]).
//!
//! A device over several devices (a mirror over its legs) is not a filter: it has no one
//! device below to forward to, and answers every method itself.

use std::os::fd::BorrowedFd;

use blkq_sync::DynArc as Arc;

use crate::bio::{Bio, EndIo};
use crate::device::{Caps, ConnectCheck, Device, Extent, Limits};
use crate::stats::QueueStats;
use crate::Error;

/// A layer over one device that forwards every [`Device`] method to it unless it overrides
/// it (module docs). Implement `lower` and what the layer changes; the blanket impl makes it
/// a `Device`. Each method means what its [`Device`] namesake says.
///
/// Bring `Filter` into scope only where a filter is implemented: with both traits in scope, a
/// call on a concrete filter (`f.limits()`) names two methods; callers use `Device`.
pub trait Filter: Send + Sync {
    /// The device below.
    fn lower(&self) -> &dyn Device;

    /// [`Device::submit`]; default: the lower device's.
    fn submit(&self, bio: Bio, end: &Arc<dyn EndIo>) {
        self.lower().submit(bio, end)
    }
    /// [`Device::submit_batch`]; default: the lower device's (one batch there).
    fn submit_batch(&self, bios: &mut dyn Iterator<Item = Bio>, end: &Arc<dyn EndIo>) {
        self.lower().submit_batch(bios, end)
    }
    /// [`Device::limits`]; default: the lower device's.
    fn limits(&self) -> Limits {
        self.lower().limits()
    }
    /// [`Device::extents_into`]; default: the lower device's.
    fn extents_into(
        &self,
        offset: u64,
        len: u64,
        max: usize,
        out: &mut Vec<Extent>,
    ) -> Result<(), Error> {
        self.lower().extents_into(offset, len, max, out)
    }
    /// [`Device::caps`]; default: the lower device's.
    fn caps(&self) -> Caps {
        self.lower().caps()
    }
    /// [`Device::splice_read`]; default: the lower device's.
    fn splice_read(&self, offset: u64, len: usize, pipe: BorrowedFd<'_>) -> Result<usize, Error> {
        self.lower().splice_read(offset, len, pipe)
    }
    /// [`Device::recv_home`]; default: the lower device's.
    fn recv_home(
        &self,
        offset: u64,
        len: usize,
        src: &mut dyn crate::RecvSource,
    ) -> Result<(), Error> {
        self.lower().recv_home(offset, len, src)
    }
    /// [`Device::queue_stats`]; default: the lower device's.
    fn queue_stats(&self) -> Option<QueueStats> {
        self.lower().queue_stats()
    }
    /// [`Device::stats`]; default: the lower device's.
    fn stats(&self) -> Option<crate::stats::DiskStats> {
        self.lower().stats()
    }
    /// [`Device::dirty_bitmaps`]; default: the lower device's.
    fn dirty_bitmaps(&self) -> Option<&dyn crate::DirtyBitmaps> {
        self.lower().dirty_bitmaps()
    }
    /// [`Device::check_connections`]; default: the lower device's.
    fn check_connections(&self, check: Option<Arc<dyn ConnectCheck>>) -> bool {
        self.lower().check_connections(check)
    }
    /// [`Device::unavailable`]; default: the lower device's.
    fn unavailable(&self) -> bool {
        self.lower().unavailable()
    }
}

impl<T: Filter> Device for T {
    #[inline]
    fn submit(&self, bio: Bio, end: &Arc<dyn EndIo>) {
        Filter::submit(self, bio, end)
    }
    #[inline]
    fn submit_batch(&self, bios: &mut dyn Iterator<Item = Bio>, end: &Arc<dyn EndIo>) {
        Filter::submit_batch(self, bios, end)
    }
    fn limits(&self) -> Limits {
        Filter::limits(self)
    }
    fn extents_into(
        &self,
        offset: u64,
        len: u64,
        max: usize,
        out: &mut Vec<Extent>,
    ) -> Result<(), Error> {
        Filter::extents_into(self, offset, len, max, out)
    }
    fn caps(&self) -> Caps {
        Filter::caps(self)
    }
    fn splice_read(&self, offset: u64, len: usize, pipe: BorrowedFd<'_>) -> Result<usize, Error> {
        Filter::splice_read(self, offset, len, pipe)
    }
    fn recv_home(
        &self,
        offset: u64,
        len: usize,
        src: &mut dyn crate::RecvSource,
    ) -> Result<(), Error> {
        Filter::recv_home(self, offset, len, src)
    }
    fn queue_stats(&self) -> Option<QueueStats> {
        Filter::queue_stats(self)
    }
    fn stats(&self) -> Option<crate::stats::DiskStats> {
        Filter::stats(self)
    }
    fn dirty_bitmaps(&self) -> Option<&dyn crate::DirtyBitmaps> {
        Filter::dirty_bitmaps(self)
    }
    fn check_connections(&self, check: Option<Arc<dyn ConnectCheck>>) -> bool {
        Filter::check_connections(self, check)
    }
    fn unavailable(&self) -> bool {
        Filter::unavailable(self)
    }
}
