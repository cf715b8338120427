//! Changed-block tracking as seen from above a device: an export's named dirty bitmaps, each
//! recording which ranges were written, trimmed or zeroed since it was created or last cleared.
//! The device that keeps them implements [`DirtyBitmaps`] and hands it out through
//! [`crate::Device::dirty_bitmaps`]; the NBD server answers `qemu:dirty-bitmap:NAME` block
//! status queries from it and never learns how the bits are kept.

use crate::Error;

/// One run of equal state in a dirty bitmap's answer: `len` bytes, dirty or clean.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DirtyExtent {
    /// Length in bytes.
    pub len: u64,
    /// Whether any byte of the run was changed since the bitmap was created or cleared (the
    /// whole granule is reported: a bitmap may say more than was written, never less).
    pub dirty: bool,
}

/// The named dirty bitmaps of one device.
pub trait DirtyBitmaps: Send + Sync {
    /// The bitmaps' names, in creation order (a snapshot: bitmaps may be added or removed at
    /// any time). Called at negotiation, not on the request path.
    fn names(&self) -> Vec<String>;

    /// The state of bitmap `name` over `[offset, offset + len)` into a caller-owned vector:
    /// `out` is cleared, then filled in order with at most `max` runs, contiguous from
    /// `offset`, adjacent runs never of equal state; the last may stop short of the range's
    /// end. Allocates nothing once `out` has grown to `max`. A bitmap that no longer exists is
    /// [`Error::NotFound`].
    fn dirty_extents_into(
        &self,
        name: &str,
        offset: u64,
        len: u64,
        max: usize,
        out: &mut Vec<DirtyExtent>,
    ) -> Result<(), Error>;
}
