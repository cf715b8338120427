//! Storage backends: where the bytes of the `mem` and `file` drivers live: [`MapBackend`]
//! (`mem:` devices' default, `store=map`), [`MemBackend`] (`store=pages`), [`FileBackend`].
//!
//! A backend is synchronous and thread-safe: the driver decides on which thread (the
//! submitter's, a completion thread, io_uring's reaper) each operation runs. Offsets and
//! lengths are in bytes; callers have validated them against [`Backend::size`].

use std::io;
use std::os::fd::BorrowedFd;

use blkq_sync::atomic::{AtomicBool, Ordering};

pub mod file;
pub mod home;
mod host;
pub mod map;
pub mod mem;
mod splice_in;

pub use file::{FileBackend, FileOptions};
pub use map::MapBackend;
pub use mem::MemBackend;

pub use blk::error::os_error_code;
pub(crate) use blk::error::with_context;
pub use blk::Extent;
use blk::{Bio, BioFlags, Caps, Error, Op, RecvSource};

/// Executes a bio on a backend, synchronously. Shared by every backend-based driver.
///
/// FUA: a write passes it to [`Backend::write_at`] (which makes just that write durable); a
/// discard or write-zeroes, which have no such flag of their own (`fallocate` has none), is
/// followed by [`Backend::flush`] before it completes: the same `fdatasync` a FUA write
/// falls back to where `RWF_DSYNC` is refused.
pub fn exec_on_backend(be: &dyn Backend, bio: &mut Bio) -> Result<(), Error> {
    let off = bio.offset();
    let len = bio.len as usize;
    let fua = bio.flags.contains(BioFlags::FUA);
    match bio.op {
        Op::Read => {
            let buf = bio.buf.as_mut().ok_or(Error::NoBuffer)?;
            be.read_at(off, &mut buf.as_mut_slice()[..len])?;
        }
        Op::Write => {
            let buf = bio.buf.as_ref().ok_or(Error::NoBuffer)?;
            be.write_at(off, &buf.as_slice()[..len], fua)?;
        }
        Op::Flush => be.flush()?,
        Op::Discard => {
            be.discard(off, len as u64)?;
            if fua {
                be.flush()?;
            }
        }
        Op::WriteZeroes => {
            if bio.flags.contains(BioFlags::FAST_ZERO) && !be.fast_zero() {
                return Err(Error::NotSupported("fast zero"));
            }
            be.write_zeroes(off, len as u64, !bio.flags.contains(BioFlags::NO_HOLE))?;
            if fua {
                be.flush()?;
            }
        }
    }
    Ok(())
}

/// A byte-addressed store.
pub trait Backend: Send + Sync + std::fmt::Debug {
    /// Size in bytes.
    fn size(&self) -> u64;
    /// Reads `buf.len()` bytes at `offset`.
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()>;
    /// Writes `buf` at `offset`; with `fua`, durable before returning.
    fn write_at(&self, offset: u64, buf: &[u8], fua: bool) -> io::Result<()>;
    /// Makes every completed write durable.
    fn flush(&self) -> io::Result<()>;
    /// Discards a range: it reads as zeros afterwards and may free space. Not durable by
    /// itself: a FUA discard is followed by [`Backend::flush`] ([`exec_on_backend`]).
    fn discard(&self, offset: u64, len: u64) -> io::Result<()>;
    /// Zeroes a range; with `may_unmap` it may become a hole (NBD's WRITE_ZEROES without
    /// NO_HOLE), else it stays allocated. Not durable by itself, as [`Backend::discard`].
    fn write_zeroes(&self, offset: u64, len: u64, may_unmap: bool) -> io::Result<()>;
    /// The allocation map of `[offset, offset + len)`, in order, covering the range, merged
    /// where neighbours agree; at most `max_extents` entries (the last may stop short). `out`
    /// is cleared first; the request path reuses it, so a call allocates nothing once it has
    /// room (except the `pages` store's walk over a mostly sparse range).
    fn extents_into(
        &self,
        offset: u64,
        len: u64,
        max_extents: usize,
        out: &mut Vec<Extent>,
    ) -> io::Result<()>;
    /// [`Backend::extents_into`] into a new vector (tests and tools; allocates).
    fn extents(&self, offset: u64, len: u64, max_extents: usize) -> io::Result<Vec<Extent>> {
        let mut out = Vec::new();
        self.extents_into(offset, len, max_extents, &mut out)?;
        Ok(out)
    }
    /// Whether zeroing is fast (no data written), for NBD's FAST_ZERO.
    fn fast_zero(&self) -> bool;
    /// What the backend can do beyond reads and writes through buffers: [`Backend::splice_read`]
    /// (`splice`), [`Backend::recv_at`] (`recv_home`); the driver over it declares the
    /// device's from these ([`blk::Device::caps`]). Default: nothing. Asked each time (a
    /// backend may turn one off at run time).
    fn caps(&self) -> Caps {
        Caps::default()
    }
    /// Moves up to `len` bytes at `offset` into the pipe `pipe` by reference, without
    /// blocking on the pipe: how many it moved, 0 when the pipe was full
    /// ([`blk::Device::splice_read`] says what the caller must do with them).
    fn splice_read(&self, _offset: u64, _len: usize, _pipe: BorrowedFd<'_>) -> io::Result<usize> {
        Err(io::ErrorKind::Unsupported.into())
    }
    /// Receives `len` bytes from `src`'s socket straight into the store at `offset`
    /// ([`blk::Device::recv_home`] says what it promises, torn writes on an error included).
    fn recv_at(&self, _offset: u64, _len: usize, _src: &mut dyn RecvSource) -> io::Result<()> {
        Err(io::ErrorKind::Unsupported.into())
    }
}

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

/// Checks `[offset, offset + len)` against `size`, for backends' "no panic on any input".
pub(crate) fn check_range(what: &str, offset: u64, len: u64, size: u64) -> io::Result<()> {
    match offset.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{what}: range {offset}+{len} is outside the backend's {size} bytes"),
        )),
    }
}

/// Accumulates an allocation map clipped to `[start, end)`, merging neighbours that agree,
/// stopping at `max` extents.
pub(crate) struct ExtentBuilder<'a> {
    out: &'a mut Vec<Extent>,
    max: usize,
    start: u64,
    end: u64,
}

impl<'a> ExtentBuilder<'a> {
    /// An empty map of `[start, end)` in `out` (cleared here), at most `max` extents.
    pub(crate) fn new(out: &'a mut Vec<Extent>, start: u64, end: u64, max: usize) -> Self {
        out.clear();
        ExtentBuilder {
            out,
            max,
            start,
            end,
        }
    }

    /// Adds `[from, to)` (clipped); returns `false` once a new extent would exceed `max`.
    pub(crate) fn add(&mut self, from: u64, to: u64, allocated: bool) -> bool {
        let from = from.max(self.start);
        let to = to.min(self.end);
        if from >= to {
            return true;
        }
        if let Some(last) = self.out.last_mut() {
            if last.allocated == allocated && last.offset + last.len == from {
                last.len += to - from;
                return true;
            }
        }
        if self.out.len() >= self.max {
            return false;
        }
        self.out.push(Extent {
            offset: from,
            len: to - from,
            allocated,
        });
        true
    }
}
