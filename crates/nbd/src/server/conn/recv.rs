//! The reader's receive rules: how much it asks the socket for after a large write, and when
//! a client that stalls in the middle of a request has timed out.

use std::time::{Duration, Instant};

/// A write at least this large makes the reader ask the socket for at most
/// [`RECV_AFTER_BIG_WRITE`] bytes at a time (`Connection::big_writes`), until a smaller write
/// comes. With the whole receive buffer (1 MiB) offered, one `recv` takes a 1 MiB write's
/// header *and* most of its payload into `recv_buf`, which `stage_write` then copies into the
/// payload's buffers: two user-space copies per byte (socket to `recv_buf`, `recv_buf` to the
/// buffer) before the device's own. Asking for 16 KiB leaves the payload in the socket, and
/// `fill_partial_write` reads it straight into its buffers; at most 16 KiB of each write (the
/// bytes that arrived with its header) is copied, 1.6% of a 1 MiB write.
pub(super) const BIG_WRITE: u64 = 128 << 10;
/// See [`BIG_WRITE`].
pub(super) const RECV_AFTER_BIG_WRITE: usize = 16 << 10;

/// Bytes of one request that restart its mid-request clock: a request must be finished, or
/// this much more of it received, within the send timeout (a floor of 64 KiB per send timeout
/// on a client's rate in the middle of a request; 2 KiB/s with the default 30 s).
pub(super) const PROGRESS_QUANTUM: u64 = 64 << 10;

/// The request the reader is in the middle of, for the mid-request timeout.
///
/// A plain socket's read returns each byte as it comes, so "nothing received for the send
/// timeout" alone lets a client that sends one byte a second hold a half-sent request (and
/// under TLS a half-sent record shows no bytes at all). The clock here starts with a
/// request's first byte (or its TLS record's) and restarts only every [`PROGRESS_QUANTUM`]
/// bytes, or after the reader's own waits (slots, memory budget): time the client was not
/// asked for bytes is not its fault.
#[derive(Debug, Default)]
pub(super) struct MidRequest {
    /// When the request in progress began, or last made a quantum of progress; `None`
    /// between requests.
    since: Option<Instant>,
    /// Bytes received since then.
    bytes: u64,
}

impl MidRequest {
    /// The reader is at a request boundary: no request is in progress.
    pub(super) fn end(&mut self) {
        self.since = None;
        self.bytes = 0;
    }

    /// `n` bytes received at `now`: when the request in progress began, or last made a
    /// quantum of progress (`None`: it began with these bytes, or just made a quantum).
    pub(super) fn received(&mut self, n: usize, now: Instant) -> Option<Instant> {
        let Some(since) = self.since else {
            self.since = Some(now);
            self.bytes = n as u64;
            return None;
        };
        self.bytes += n as u64;
        if self.bytes >= PROGRESS_QUANTUM {
            self.since = Some(now);
            self.bytes = 0;
            return None;
        }
        Some(since)
    }

    /// The reader waited `waited` (slots, memory budget) without asking the client for
    /// bytes: that time does not count against a request in progress.
    pub(super) fn excuse(&mut self, waited: Duration) {
        if let Some(since) = &mut self.since {
            *since += waited;
        }
    }

    /// When the request in progress began; `first_byte` if none was (e.g. its first bytes are
    /// in a TLS record not yet whole).
    pub(super) fn started(&mut self, first_byte: Instant) -> Instant {
        *self.since.get_or_insert(first_byte)
    }
}
