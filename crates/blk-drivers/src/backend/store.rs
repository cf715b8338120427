//! The [`Backend`] trait (what every store of bytes offers the drivers) and the range check
//! its implementations run on their input.

use std::io;
use std::os::fd::BorrowedFd;

use blk::{Caps, Extent, RecvSource};

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
    /// Zeroes `[offset, offset + len)`: with `unmap` it may become a hole (and free space),
    /// else it stays allocated. `what` names the operation in an error. Not durable by itself:
    /// a FUA one is followed by [`Backend::flush`] ([`exec_on_backend`](super::exec::exec_on_backend)).
    fn zero(&self, what: &str, offset: u64, len: u64, unmap: bool) -> io::Result<()>;
    /// Discards a range: it reads as zeros afterwards and may free space ([`Backend::zero`]
    /// with `unmap`).
    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        self.zero("discard", offset, len, true)
    }
    /// Zeroes a range; with `may_unmap` it may become a hole (NBD's WRITE_ZEROES without
    /// NO_HOLE), else it stays allocated ([`Backend::zero`]).
    fn write_zeroes(&self, offset: u64, len: u64, may_unmap: bool) -> io::Result<()> {
        self.zero("write_zeroes", offset, len, may_unmap)
    }
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
