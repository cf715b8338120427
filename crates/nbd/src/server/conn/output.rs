//! The writer's output (it travels with the writer token): the replies shaped (`reply.rs`)
//! and not yet sent, as segments of headers and data, with the ciphertext a TLS connection
//! has not sent yet and the pipe of its spliced reads; sent by `writer.rs`, `transport.rs`
//! (TLS) and `splice.rs`.

use std::io::{self, IoSlice};
use std::os::fd::RawFd;

use blk::Buffer;

use super::pipe::SplicePipe;
use super::send::progress;
use nbd_proto::transmission::{Extent, ExtentExt};

/// A piece of the output: encoded headers, or the data of a buffer.
#[derive(Debug, Clone, Copy)]
pub(super) enum Segment {
    /// `Output::headers[start..end]`.
    Headers { start: usize, end: usize },
    /// The first `len` bytes of `Output::buffers[index]`.
    Data { index: usize, len: usize },
    /// `len` bytes of the device at `offset`, spliced into the socket at send time
    /// (`splice.rs`). The reply or chunk header that announces them ends at
    /// `Output::headers[hdr_end]`, in the form `form` (so a failure found before any of it
    /// was sent can turn it into an error reply of the same length).
    Spliced {
        offset: u64,
        len: usize,
        hdr_end: usize,
        form: HeaderForm,
    },
}

/// The header in front of a spliced segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum HeaderForm {
    /// A simple reply (16 bytes).
    Simple,
    /// An `OFFSET_DATA` chunk with a compact (20 bytes) or extended (32 bytes) header, then
    /// the 8-byte offset.
    Chunk { extended: bool },
}

/// The writer's output (it travels with the writer token): replies shaped and not yet sent,
/// and how far sending got.
#[derive(Default)]
pub(super) struct Output {
    /// Encoded reply headers and chunk headers, back to back.
    pub(super) headers: Vec<u8>,
    /// What to send, in order.
    pub(super) segments: Vec<Segment>,
    /// Read buffers being sent (returned to their pools when the output is reset).
    pub(super) buffers: Vec<Buffer>,
    /// Slots whose replies are in `segments`, freed once sent.
    pub(super) shaped_slots: Vec<u32>,
    /// Send progress: the next segment, and bytes of it already sent.
    pub(super) next_segment: usize,
    pub(super) sent_of_segment: usize,
    /// Reused descriptor lists for block-status chunks.
    pub(super) extents32: Vec<Extent>,
    pub(super) extents64: Vec<ExtentExt>,
    /// TLS: ciphertext not yet sent (`transport.rs` sends it).
    pub(super) tls_out: TlsOut,
    /// Zero-copy reads: the pipe spliced segments go through (`splice.rs`).
    pub(super) pipe: SplicePipe,
}

/// Ciphertext taken out of rustls and not yet sent (its buffer is reused).
#[derive(Default)]
pub(super) struct TlsOut {
    pub(super) buf: Vec<u8>,
    sent: usize,
}

impl TlsOut {
    /// Ciphertext is waiting to be sent.
    pub(super) fn unsent(&self) -> bool {
        self.sent < self.buf.len()
    }

    /// Sends what is left; `Ok(false)` if the socket would block (non-blocking mode).
    pub(super) fn send(&mut self, fd: RawFd, dontwait: bool) -> io::Result<bool> {
        while self.sent < self.buf.len() {
            let iov = [IoSlice::new(&self.buf[self.sent..])];
            let sent = crate::sys::sendmsg(fd, &iov, dontwait);
            let Some(n) = progress(sent, dontwait)? else {
                return Ok(false);
            };
            self.sent += n;
        }
        self.buf.clear();
        self.sent = 0;
        Ok(true)
    }
}
