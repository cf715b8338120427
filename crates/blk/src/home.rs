//! Writes received into their home: the write-side mirror of
//! [`Device::splice_read`](crate::Device::splice_read). A device that can
//! ([`Caps::recv_home`](crate::Caps::recv_home): `mem:` with `store=map`) takes a
//! WRITE's payload straight from the socket into the place the bytes live, so the payload is
//! copied once (by the kernel, out of the socket) instead of into a pooled buffer first and
//! then again into the device.
//!
//! The caller owns the socket and its rules (timeouts, progress accounting); the device owns
//! the destination and what protects it. [`RecvSource`] is the seam: the device asks for the
//! socket's descriptor, receives into its own memory, and reports every receive's outcome back
//! to the source, which decides whether to go on.

use std::io;
use std::os::fd::BorrowedFd;

/// Where a payload received into its home comes from (the NBD server's connection).
pub trait RecvSource {
    /// The socket to receive from (a plain stream socket; never a TLS one, whose bytes must
    /// pass through the TLS library).
    fn fd(&self) -> BorrowedFd<'_>;

    /// The outcome of one receive: `Ok(n)` with the bytes it took (0: the peer closed the
    /// connection), or its error (a read timeout shows as `WouldBlock`). `Ok(())` lets the
    /// device receive again (after a timeout the source has checked its own deadlines);
    /// `Err` ends the write with that error. A peer that closed must get `Err`.
    fn received(&mut self, res: io::Result<usize>) -> io::Result<()>;
}
