//! `NBD_CMD_BLOCK_STATUS` on the reader's side: what a request holds of the memory budget
//! (the most extents it may answer, for every selected context), and staging it: the maps of
//! `base:allocation` and of the dirty bitmaps, as the codec's extents.

use blk::DirtyExtent;
use blk::Extent as DevExtent;

use super::inflight::InFlight;
use super::Connection;
use crate::server::handshake::{BASE_ALLOCATION_ID, FIRST_BITMAP_ID};
use nbd_proto::proto::{CmdFlags, Errno, NBD_STATE_DIRTY, NBD_STATE_HOLE, NBD_STATE_ZERO};
use nbd_proto::transmission::{ExtentExt, Request};

/// Extents per `NBD_CMD_BLOCK_STATUS` reply.
const MAX_STATUS_EXTENTS: usize = 1024;

/// The codec's view of one of the device's extents (`base:allocation`: an unallocated range
/// reads as zeros, so it is a hole that reads zero). The one place where `blk`'s extents
/// become NBD's.
pub(super) fn nbd_extent(e: &DevExtent) -> ExtentExt {
    ExtentExt {
        length: e.len,
        flags: if e.allocated {
            0
        } else {
            u64::from(NBD_STATE_HOLE | NBD_STATE_ZERO)
        },
    }
}

/// The codec's view of a run of a dirty bitmap (`qemu:dirty-bitmap:NAME`: bit 0 is
/// `NBD_STATE_DIRTY`).
fn dirty_extent(e: &DirtyExtent) -> ExtentExt {
    ExtentExt {
        length: e.len,
        flags: u64::from(if e.dirty { NBD_STATE_DIRTY } else { 0 }),
    }
}

impl Connection<'_> {
    /// The most extents a block-status request may answer per context.
    fn status_max(r: &Request) -> usize {
        if r.flags.contains(CmdFlags::REQ_ONE) {
            1
        } else {
            MAX_STATUS_EXTENTS
        }
    }

    /// Bytes a block-status request holds while in flight: the extents it may answer, for
    /// every selected context (what `stage_block_status` reserves).
    pub(super) fn status_bytes(&self, r: &Request) -> u64 {
        let nctx = usize::from(self.contexts.base_allocation) + self.contexts.bitmaps.len();
        let bound = self.extent_bound(r.length, Self::status_max(r));
        (bound * nctx * std::mem::size_of::<ExtentExt>()) as u64
    }

    /// Block status: the map of each selected context, in the order of their ids
    /// (`base:allocation`, then the dirty bitmaps), one after the other in `entry.extents`,
    /// with their ids and lengths in `entry.contexts`. A context that fails (a bitmap removed
    /// since the handshake: `EINVAL`) fails the request; the connection goes on.
    pub(super) fn stage_block_status(&mut self, r: &Request, entry: &mut InFlight) {
        let max = Self::status_max(r);
        // Taken from the memory budget when it was parsed (`budget_need`), given back with
        // its slot.
        entry.budget_bytes = self.status_bytes(r);
        self.staged_bytes += entry.budget_bytes;
        // Into the connection's reused vectors, and then the entry's (recycled with it): all
        // reserve the most this request's shape can need, so that they stop growing once
        // warm, however fragmented the device or the bitmaps become.
        let bound = self.extent_bound(r.length, max);
        let nctx = usize::from(self.contexts.base_allocation) + self.contexts.bitmaps.len();
        entry.extents.reserve(bound * nctx);
        entry.contexts.reserve(nctx);
        let device = self.device();
        if self.contexts.base_allocation {
            let mut ext = std::mem::take(&mut self.extents_buf);
            ext.clear();
            ext.reserve(bound);
            match device.extents_into(r.offset, r.length, max, &mut ext) {
                Ok(()) => {
                    entry.extents.extend(ext.iter().map(nbd_extent));
                    entry.contexts.push((BASE_ALLOCATION_ID, ext.len() as u32));
                }
                Err(e) => entry.fail(Errno::from_errno(e.errno())),
            }
            self.extents_buf = ext;
        }
        if self.contexts.bitmaps.is_empty() || entry.error.is_some() {
            return;
        }
        let Some(bitmaps) = device.dirty_bitmaps() else {
            // The device no longer keeps bitmaps at all: every one selected is gone.
            entry.fail(Errno::Inval);
            return;
        };
        let mut dirty = std::mem::take(&mut self.dirty_buf);
        dirty.reserve(bound);
        for (i, name) in self.contexts.bitmaps.iter().enumerate() {
            dirty.clear();
            if let Err(e) = bitmaps.dirty_extents_into(name, r.offset, r.length, max, &mut dirty) {
                entry.fail(Errno::from_errno(e.errno()));
                break;
            }
            entry.extents.extend(dirty.iter().map(dirty_extent));
            entry
                .contexts
                .push((FIRST_BITMAP_ID + i as u32, dirty.len() as u32));
        }
        self.dirty_buf = dirty;
    }
}
