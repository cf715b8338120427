//! The driver side of the queue: what a block driver implements ([`Driver`]). The queue calls
//! it; the drivers themselves live in the `blk-drivers` crate.

use std::os::fd::BorrowedFd;

use blkq_sync::DynArc as Arc;

use super::{RequestQueue, RequestToken};
use crate::device::{Caps, Extent};
use crate::Error;

/// A block driver: executes requests and reports their completion.
pub trait Driver: Send + Sync {
    /// Called once the queue exists: spawn completion threads here (they may keep the `Arc`
    /// until [`Driver::stop`]).
    fn start(&self, _q: &Arc<RequestQueue>) {}
    /// Takes a request; the driver completes it later (or right away) with
    /// [`RequestQueue::complete`].
    fn queue_rq(&self, q: &RequestQueue, rq: RequestToken);
    /// The end of a batch of `queue_rq` calls (ring the doorbell).
    fn commit(&self, _q: &RequestQueue) {}
    /// Stops completion threads; called when the queue is dropped.
    fn stop(&self) {}
    /// The allocation map, for devices that know it (default: everything allocated), into
    /// `out` as [`Device::extents_into`](crate::Device::extents_into) describes: cleared, then
    /// filled, allocating nothing once `out` has room.
    fn extents_into(
        &self,
        offset: u64,
        len: u64,
        max: usize,
        out: &mut Vec<Extent>,
    ) -> Result<(), Error> {
        out.clear();
        if len > 0 && max > 0 {
            out.push(Extent {
                offset,
                len,
                allocated: true,
            });
        }
        Ok(())
    }
    /// What the driver can do beyond requests ([`Device::caps`](crate::Device::caps), which
    /// the queue answers with this): zero-copy reads, writes received into their home, a
    /// costly allocation map. Asked per request where it matters, so a driver may turn one
    /// off at run time. Default: nothing.
    fn caps(&self) -> Caps {
        Caps::default()
    }
    /// Moves up to `len` bytes of the device at `offset` into the pipe whose write end is
    /// `pipe` ([`Device::splice_read`](crate::Device::splice_read) says what that promises);
    /// returns how many it moved.
    fn splice_read(
        &self,
        _offset: u64,
        _len: usize,
        _pipe: BorrowedFd<'_>,
    ) -> Result<usize, Error> {
        Err(Error::Io(std::io::ErrorKind::Unsupported.into()))
    }
    /// Receives `len` bytes from `src` into the device at `offset`
    /// ([`Device::recv_home`](crate::Device::recv_home) says what that promises).
    fn recv_home(
        &self,
        _offset: u64,
        _len: usize,
        _src: &mut dyn crate::RecvSource,
    ) -> Result<(), Error> {
        Err(Error::Io(std::io::ErrorKind::Unsupported.into()))
    }
    /// One line describing the driver and its options.
    fn describe(&self) -> String;
    /// The most bios one request may carry as a merge chain (module docs). The default, 1,
    /// means the driver executes exactly one bio per request and the queue must not merge.
    fn max_merge(&self) -> u32 {
        1
    }
    /// How many more requests the driver takes right now; a scheduler's dispatch stops at 0
    /// and the requests wait in the scheduler (where mq-deadline orders them). A driver that
    /// ever returns a finite number must call [`RequestQueue::run_queue`] once it has room again
    /// (as blk-mq restarts a hardware queue from the completion). Without a scheduler the
    /// queue does not ask. Default: no limit.
    fn can_queue(&self) -> usize {
        usize::MAX
    }
}
