//! What the server counts for an operator (metrics, see "Metrics and logs" in docs/design.md):
//! connections accepted, refused at the limit and open, handshakes that ended without a
//! transmission phase by reason, requests refused before reaching a device, and, for exports
//! whose device keeps no disk counters of its own ([`blk::Device::stats`] is `None`: a RAID1
//! mirror), the disk counters of the export counted here.
//!
//! Everything here is read by a scraper, never by the data path, and changed only off the
//! data path (accept, handshake, connection close, a refused request), except the per-export
//! disk counters: those are sharded ([`blk::stats::DiskCounters`]) and cost what the block
//! layer's own cost, plus one coarse clock read per commit batch and one per completed request
//! (only for exports that need them).
//!
//! Ordering: every counter is a statistic that publishes nothing else; all updates and reads
//! are `Relaxed` (a scrape may see one counter ahead of another).

use blkq_sync::atomic::{AtomicU64, Ordering};
use blkq_sync::DynArc as Arc;

use blk::stats::DiskStats;
use blk::Device;

/// Why a connection ended before its transmission phase (or was refused an export).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum HandshakeFailure {
    /// The handshake deadline passed (`--handshake-timeout`).
    Timeout,
    /// The client went over a handshake bound (options, option bytes).
    Limit,
    /// The client broke the protocol.
    Protocol,
    /// The client aborted (`NBD_OPT_ABORT`) or hung up between options: often not a failure
    /// at all (`nbdinfo --list`), counted apart.
    ClientAbort,
    /// The socket failed.
    Io,
    /// An access rule refused the client an export: each `NBD_REP_ERR_POLICY` answer to
    /// INFO/GO, and each EXPORT_NAME that closes the connection (from outside the server:
    /// [`Metrics::count_refusal`]).
    ///
    /// [`Metrics::count_refusal`]: super::Metrics::count_refusal
    Policy,
    /// The server was at `--max-connections` and closed this connection, the oldest still
    /// in its handshake, to make room for a new one.
    Evicted,
}

impl HandshakeFailure {
    /// Every reason, in the order of [`ServerSnapshot::handshake_failures`].
    pub const ALL: [HandshakeFailure; 7] = [
        HandshakeFailure::Timeout,
        HandshakeFailure::Limit,
        HandshakeFailure::Protocol,
        HandshakeFailure::ClientAbort,
        HandshakeFailure::Io,
        HandshakeFailure::Policy,
        HandshakeFailure::Evicted,
    ];

    /// The reason as a label value (`timeout`, `limit`, `protocol`, `client_abort`, `io`,
    /// `policy`, `evicted`).
    pub fn as_str(self) -> &'static str {
        match self {
            HandshakeFailure::Timeout => "timeout",
            HandshakeFailure::Limit => "limit",
            HandshakeFailure::Protocol => "protocol",
            HandshakeFailure::ClientAbort => "client_abort",
            HandshakeFailure::Io => "io",
            HandshakeFailure::Policy => "policy",
            HandshakeFailure::Evicted => "evicted",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// The server-wide counters (see the module docs for their ordering).
#[derive(Debug, Default)]
pub(crate) struct ServerCounters {
    accepted: AtomicU64,
    refused_limit: AtomicU64,
    handshake_failures: [AtomicU64; 7],
    transmissions: AtomicU64,
    requests: AtomicU64,
    requests_refused: AtomicU64,
    bytes_read: AtomicU64,
    bytes_written: AtomicU64,
}

impl ServerCounters {
    pub(crate) fn accepted(&self) {
        self.accepted.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn refused_limit(&self) {
        self.refused_limit.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn handshake_failed(&self, why: HandshakeFailure) {
        self.handshake_failures[why.index()].fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn transmission(&self) {
        self.transmissions.fetch_add(1, Ordering::Relaxed);
    }

    /// A connection's totals, added when it closes.
    pub(crate) fn closed(&self, requests: u64, refused: u64, read: u64, written: u64) {
        self.requests.fetch_add(requests, Ordering::Relaxed);
        self.requests_refused.fetch_add(refused, Ordering::Relaxed);
        self.bytes_read.fetch_add(read, Ordering::Relaxed);
        self.bytes_written.fetch_add(written, Ordering::Relaxed);
    }

    /// The counters now, in a snapshot whose `open`, `memory_used` and `memory_budget` the
    /// caller fills in (they are not counters).
    pub(crate) fn snapshot(&self) -> ServerSnapshot {
        let ld = |a: &AtomicU64| a.load(Ordering::Relaxed);
        ServerSnapshot {
            accepted: ld(&self.accepted),
            refused_limit: ld(&self.refused_limit),
            transmissions: ld(&self.transmissions),
            handshake_failures: std::array::from_fn(|i| ld(&self.handshake_failures[i])),
            requests: ld(&self.requests),
            requests_refused: ld(&self.requests_refused),
            bytes_read: ld(&self.bytes_read),
            bytes_written: ld(&self.bytes_written),
            ..ServerSnapshot::default()
        }
    }
}

/// A snapshot of the server's counters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ServerSnapshot {
    /// Connections accepted (given a thread), since start.
    pub accepted: u64,
    /// Connections closed at once because `max_connections` were open.
    pub refused_limit: u64,
    /// Connections open now (handshake or transmission).
    pub open: u64,
    /// Connections that reached the transmission phase.
    pub transmissions: u64,
    /// Handshakes that ended without a transmission phase, by [`HandshakeFailure::ALL`].
    pub handshake_failures: [u64; 7],
    /// Requests served by connections that have closed.
    pub requests: u64,
    /// Requests answered with an error before reaching a device, by closed connections.
    pub requests_refused: u64,
    /// Bytes clients asked to read, by closed connections.
    pub bytes_read: u64,
    /// Bytes clients wrote, by closed connections.
    pub bytes_written: u64,
    /// Bytes of the memory budget taken now.
    pub memory_used: u64,
    /// The memory budget, bytes.
    pub memory_budget: u64,
}

/// Where an export's disk counters come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StatsSource {
    /// The device's own ([`blk::Device::stats`]): the block layer counted them.
    Device,
    /// The device keeps none: the NBD server counted the export's requests.
    Server,
}

/// One export's counters.
#[derive(Clone)]
pub struct ExportMetrics {
    /// The export name.
    pub name: String,
    /// The disk counters.
    pub stats: DiskStats,
    /// Who counted them.
    pub source: StatsSource,
    /// The device (for what only it knows: its queue's tag waits, its scheduler).
    pub device: Arc<dyn Device>,
}
