//! Zero-copy large reads: the writer moves a read's bytes from the device into the socket
//! through a pipe, by page reference, instead of a bio copying them into a buffer that
//! `sendmsg` copies again (docs/design.md, "Large reads").
//!
//! A read of at least [`SPLICE_MIN_BYTES`] on a plaintext connection to a device that can
//! ([`blk::Caps::splice`]: `mem:` with `store=map`, buffered `file:`) is staged with no
//! bio and no buffer: its data parts are marked spliced and the entry is ready at once. When
//! the writer reaches such a part ([`Segment::Spliced`]) it asks the device to put the bytes
//! in the connection's pipe ([`blk::Device::splice_read`]: `vmsplice` of the mapping under the
//! region lock, or `splice` from the page cache) and `splice`s the pipe into the socket. The
//! kernel copies once, into the socket (Unix and TCP sockets take spliced pages as they are
//! since Linux 6.5; older kernels copy there instead, still once).
//!
//! Rules, and why they hold:
//! 1. **Only the writer touches the pipe.** It lives in the [`Output`], which travels with the
//!    writer token (`writer.rs`), so there is never a second thread at it, and the bytes in it
//!    always belong to the first spliced segment not yet sent: [`SplicePipe::held`] bytes of
//!    segment [`SplicePipe::held_for`]. A pipe is only filled for the segment being sent or,
//!    before the run of headers in front of it is sent, for the next one (rule 3).
//! 2. **What the client gets.** The bytes are those of the moment the device fills the pipe
//!    (or, for pages the pipe references, of the moment the socket takes them), after the
//!    request was received: every write completed before the read arrived is in them, and
//!    only writes in flight with the read can show, which NBD leaves undefined. The reply is
//!    complete for the client only once all of it is sent, so no later write can tear a read
//!    the client already has.
//! 3. **Errors are answered while they can be.** A reply's header goes out before its data,
//!    so the pipe is filled for a spliced segment before the headers in front of it are sent
//!    (`prefill`). If that fails, the header, still unsent, is rewritten in place into an error
//!    reply of the same length (a simple reply's error field; an `OFFSET_DATA` chunk becomes an
//!    `ERROR` chunk with a two-byte message) and the data is dropped: the client gets the
//!    device's error and the connection goes on. A fill that fails may already have put part
//!    of its bytes in the pipe (`mem:` splices region by region, and a later region can
//!    fail), so a failed fill closes the pipe with them (`SplicePipe::fill`): the next
//!    spliced reply goes through a new pipe and starts with its own bytes. A failure after
//!    part of the data was sent (a read larger than the pipe, or an unaligned 1 MiB one,
//!    refills it) cannot be told to the client any more: the connection is closed, and the
//!    device turns zero-copy reads off (`SpliceGate`), so a client that reconnects reads
//!    through bios and gets the error as the read's.
//! 4. **Never blocks where the writer may not.** The device's fill never waits for the pipe
//!    (`SPLICE_F_NONBLOCK`: it takes what fits); the drain into the socket uses
//!    `SPLICE_F_NONBLOCK` for a non-blocking writer, which hands the output, pipe and all, to
//!    the flusher when the socket is full, like a half-sent `sendmsg`.
//!
//! Descriptors: the pipe (two) is made at the connection's first spliced read and closed with
//! it; `limits.rs` counts five descriptors a connection.

use std::io;
use std::os::fd::{AsRawFd, RawFd};

use blk::Device;
use tracing::warn;

use super::output::{HeaderForm, Output, Segment};
use super::send::progress;
use nbd_proto::proto::{Errno, NBD_REPLY_TYPE_ERROR};

/// Reads at least this long are spliced. Below, the extra system calls (a `sendmsg` for the
/// header, the fill and the drain) cost more than the copy they save.
pub(super) const SPLICE_MIN_BYTES: u64 = 64 << 10;

impl Output {
    /// Fills the pipe for spliced segment `index` before the headers in front of it are sent
    /// (rule 3). On failure the header becomes an error reply and the segment is removed;
    /// `Err` only when that is no longer possible (the header is already partly sent).
    pub(super) fn prefill(&mut self, index: usize, dev: Option<&dyn Device>) -> io::Result<()> {
        let Some(Segment::Spliced {
            offset,
            len,
            hdr_end,
            form,
        }) = self.segments.get(index).copied()
        else {
            return Ok(());
        };
        if self.pipe.held_for == index && self.pipe.held > 0 {
            return Ok(());
        }
        let Some(dev) = dev else {
            return Err(io::Error::other(
                "a spliced reply on a connection without a device",
            ));
        };
        let err = match self.pipe.fill(dev, index, offset, len, 0) {
            Ok(_) => return Ok(()),
            Err(e) => e,
        };
        warn!("zero-copy read of {offset}+{len} failed, answered as an error: {err}");
        if !self.header_unsent(index, hdr_end, form) {
            return Err(io::Error::other(format!("zero-copy read failed: {err}")));
        }
        patch_error(
            &mut self.headers[..hdr_end],
            form,
            Errno::from_errno(err.errno()),
        );
        self.segments.remove(index);
        Ok(())
    }

    /// Whether the header of spliced segment `index` (ending at `hdr_end`) is entirely
    /// unsent: it is the end of the headers segment right before, which is not yet sent or
    /// sent only up to before the header.
    fn header_unsent(&self, index: usize, hdr_end: usize, form: HeaderForm) -> bool {
        let Some(hdr_start) = hdr_end.checked_sub(header_len(form)) else {
            return false;
        };
        let Some(prev) = index.checked_sub(1) else {
            return false;
        };
        match self.segments.get(prev) {
            Some(&Segment::Headers { start, end }) if end == hdr_end && start <= hdr_start => {
                if prev > self.next_segment {
                    true
                } else if prev == self.next_segment {
                    start + self.sent_of_segment <= hdr_start
                } else {
                    false
                }
            }
            _ => false,
        }
    }

    /// Sends spliced segment `next_segment` (rule 4): `Ok(false)` if the socket would block
    /// (non-blocking mode), `Ok(true)` once all of it is sent.
    pub(super) fn send_spliced(
        &mut self,
        fd: RawFd,
        dev: Option<&dyn Device>,
        dontwait: bool,
    ) -> io::Result<bool> {
        let index = self.next_segment;
        let Some(Segment::Spliced { offset, len, .. }) = self.segments.get(index).copied() else {
            return Err(io::Error::other("not a spliced segment"));
        };
        let Some(dev) = dev else {
            return Err(io::Error::other(
                "a spliced reply on a connection without a device",
            ));
        };
        loop {
            let sent = self.sent_of_segment;
            if sent >= len {
                self.next_segment += 1;
                self.sent_of_segment = 0;
                self.pipe.held = 0;
                return Ok(true);
            }
            let held = self.pipe.fill(dev, index, offset, len, sent).map_err(|e| {
                io::Error::other(format!(
                    "zero-copy read of {offset}+{len} failed after {sent} bytes of its reply \
                     were sent, so the connection is closed: {e}"
                ))
            })?;
            let r = self.pipe.ends()?.0.as_raw_fd();
            let more = held < len - sent;
            let sent = crate::sys::splice_out(r, fd, held, dontwait, more);
            let Some(n) = progress(sent, dontwait)? else {
                return Ok(false);
            };
            self.sent_of_segment += n;
            self.pipe.held -= n;
        }
    }
}

/// Bytes of the header in front of a spliced segment.
fn header_len(form: HeaderForm) -> usize {
    match form {
        HeaderForm::Simple => 16,
        HeaderForm::Chunk { extended: false } => 20 + 8,
        HeaderForm::Chunk { extended: true } => 32 + 8,
    }
}

/// Rewrites the header that ends `headers` into an error reply of the same length (rule 3).
fn patch_error(headers: &mut [u8], form: HeaderForm, error: Errno) {
    let n = headers.len();
    match form {
        // magic, error, cookie.
        HeaderForm::Simple => headers[n - 12..n - 8].copy_from_slice(&error.as_u32().to_be_bytes()),
        HeaderForm::Chunk { extended } => {
            // magic, flags, type, cookie, [offset], length; then the chunk's 8 bytes: the
            // data's offset, now error, message length 2, message "io".
            let h = n - header_len(form);
            headers[h + 6..h + 8].copy_from_slice(&NBD_REPLY_TYPE_ERROR.to_be_bytes());
            if extended {
                headers[h + 24..h + 32].copy_from_slice(&8u64.to_be_bytes());
            } else {
                headers[h + 16..h + 20].copy_from_slice(&8u32.to_be_bytes());
            }
            let body = &mut headers[n - 8..];
            body[..4].copy_from_slice(&error.as_u32().to_be_bytes());
            body[4..6].copy_from_slice(&2u16.to_be_bytes());
            body[6..8].copy_from_slice(b"io");
        }
    }
}
