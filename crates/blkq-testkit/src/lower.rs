//! `Lower`: a device to stack a filter or a [`crate::Forward`] on, whose every answer is
//! distinct from a [`Device`]'s defaults, so a test sees which answers were forwarded.

use blkq_sync::atomic::{AtomicUsize, Ordering};
use std::os::fd::BorrowedFd;
use std::sync::{Arc, Mutex};

use blk::stats::DiskStats;
use blk::{Bio, Caps, ConnectCheck, Device, EndIo, Error, Extent, Limits, RecvSource};

/// A device that records the sector of every bio and completes it at once, and answers every
/// other [`Device`] method with something no default gives: limits of 1 MiB in 4 KiB blocks,
/// one unallocated extent of 7 bytes, every capability, half a splice, a failed
/// `recv_home` ("lower recv_home"), disk statistics, counted connection checks that say
/// yes, and unavailable.
#[derive(Default)]
pub struct Lower {
    bios: Mutex<Vec<u64>>,
    checks: AtomicUsize,
}

impl Lower {
    /// The sectors of the bios submitted so far, in order.
    pub fn sectors(&self) -> Vec<u64> {
        self.bios.lock().unwrap().clone()
    }
    /// How many times [`Device::check_connections`] was called.
    pub fn checks(&self) -> usize {
        // Relaxed: a test counter, read after the calls returned.
        self.checks.load(Ordering::Relaxed)
    }
}

impl Device for Lower {
    fn submit(&self, bio: Bio, end: &Arc<dyn EndIo>) {
        self.bios.lock().unwrap().push(bio.sector);
        end.end_io(bio, Ok(()));
    }
    fn limits(&self) -> Limits {
        Limits {
            capacity: 1 << 20,
            logical_block_size: 4096,
            max_io_bytes: 1 << 16,
        }
    }
    fn extents_into(
        &self,
        offset: u64,
        _len: u64,
        _max: usize,
        out: &mut Vec<Extent>,
    ) -> Result<(), Error> {
        out.clear();
        out.push(Extent {
            offset,
            len: 7,
            allocated: false,
        });
        Ok(())
    }
    fn caps(&self) -> Caps {
        Caps {
            splice: true,
            recv_home: true,
            slow_extents: true,
        }
    }
    fn splice_read(&self, _: u64, len: usize, _: BorrowedFd<'_>) -> Result<usize, Error> {
        Ok(len / 2)
    }
    fn recv_home(&self, _: u64, _: usize, _: &mut dyn RecvSource) -> Result<(), Error> {
        Err(Error::Io(std::io::Error::other("lower recv_home")))
    }
    fn stats(&self) -> Option<DiskStats> {
        Some(DiskStats::default())
    }
    fn check_connections(&self, _: Option<Arc<dyn ConnectCheck>>) -> bool {
        // Relaxed: a test counter, read after the call returned.
        self.checks.fetch_add(1, Ordering::Relaxed);
        true
    }
    fn unavailable(&self) -> bool {
        true
    }
}
