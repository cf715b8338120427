//! The state the server's threads share: the export table and each export's state as the
//! connections see it ([`ExportState`], its sticky write error), the registry of live
//! connections, and the server-wide settings and counters ([`ServerState`]).

// `std`'s `Arc`, not the facade's: `blk::Device` and `blk::EndIo` take `std::sync::Arc`.
use blkq_sync::DynArc as Arc;

use blkq_sync::atomic::{AtomicBool, Ordering};
use blkq_sync::{Mutex, RwLock};

use super::access::Access;
use super::config::{Export, Tuning};
use super::error::ServerError;
use super::limits::MemoryBudget;
use super::stats::ServerCounters;
use crate::stream::Stream;

/// An export as the connections see it: the configuration plus what the handshake sends.
/// Shared by `Arc`: the table holds one, each attached connection another.
pub(crate) struct ExportState {
    /// The export as configured.
    pub(crate) export: Export,
    /// Export size: the device capacity rounded down to the minimum block size.
    pub(crate) size: u64,
    /// Minimum block size (the device's logical block size, at least 512).
    pub(crate) min_block: u32,
    /// Sticky write error (see [`StickyError`]), shared by every connection to the export.
    pub(crate) failed: Arc<StickyError>,
    /// Disk counters kept by the server, for a device that keeps none of its own
    /// ([`blk::Device::stats`] is `None`); `None` when the device counts.
    pub(crate) disk: Option<Arc<blk::stats::DiskCounters>>,
    /// The access rules in force (the export's at start; [`Reloader::set_access`] replaces
    /// them). Read at accept and in the handshake only, never per request. Shared with the
    /// [`Reloader`] alone, not the export: a reloader kept by a thread that outlives the
    /// server (the signal thread) must not keep the devices open.
    ///
    /// [`Reloader`]: super::Reloader
    /// [`Reloader::set_access`]: super::Reloader::set_access
    pub(crate) access: Arc<RwLock<Access>>,
    /// Set (under the registry's lock) when the export is removed from the table: no
    /// handshake attaches to it any more, and its connections drain as at shutdown.
    pub(crate) removed: AtomicBool,
}

impl std::fmt::Debug for ExportState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExportState")
            .field("name", &self.export.name)
            .field("size", &self.size)
            .finish_non_exhaustive()
    }
}

impl ExportState {
    /// The state of export `e`, its name checked.
    pub(super) fn new(e: Export) -> Result<Self, ServerError> {
        if e.name.len() > nbd_proto::proto::NBD_MAX_STRING_LEN || e.name.contains('\0') {
            return Err(ServerError::BadExportName(e.name));
        }
        let lim = e.device.limits();
        let min_block = lim.logical_block_size.clamp(512, 65536);
        let size = lim.capacity / u64::from(min_block) * u64::from(min_block);
        let disk = e
            .device
            .stats()
            .is_none()
            .then(|| Arc::new(blk::stats::DiskCounters::new()));
        Ok(ExportState {
            access: Arc::new(RwLock::new(e.access.clone())),
            export: e,
            size,
            min_block,
            failed: Arc::new(StickyError::default()),
            disk,
            removed: AtomicBool::new(false),
        })
    }

    /// Whether the export was removed from the table (its connections are draining).
    #[inline]
    pub(crate) fn is_removed(&self) -> bool {
        self.removed.load(Ordering::Acquire)
    }
}

/// An export-wide sticky write error: once a write or a flush fails on the export, every
/// later FLUSH and FUA write on it, on every connection, fails with EIO (the data one
/// client believed written may be lost; a later flush must not say it is durable). A
/// `FAST_ZERO` write-zeroes that the device refuses with `ENOTSUP` is not such a failure:
/// the device wrote nothing, as the flag asks (`conn/inflight.rs`, `fails_write_back`).
///
/// Ordering: the flag only ever goes from false to true. It is set with `Release` in the
/// completion path of the failing bio, before that bio's reply is queued; readers load it
/// with `Acquire` in the completion path of a FLUSH / FUA write (and at shutdown). A flush
/// that completes after the failing bio's completion stored the flag sees it; a flush whose
/// completion races with the failing one may still succeed, which is no stronger a promise
/// than the device made (the failing write had not completed when the flush was answered).
#[derive(Default)]
pub(crate) struct StickyError(AtomicBool);

impl StickyError {
    /// Records a failed write or flush.
    pub(crate) fn set(&self) {
        self.0.store(true, Ordering::Release);
    }

    /// Whether a write or flush has failed on the export.
    pub(crate) fn is_set(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }
}

/// The access rules of every export in the table, by name: shared with the [`Reloader`]
/// (which must not hold the exports themselves).
///
/// [`Reloader`]: super::Reloader
pub(super) type AccessTable = Arc<RwLock<Vec<(String, Arc<RwLock<Access>>)>>>;

/// State shared by the acceptors and every connection.
pub(crate) struct ServerState {
    /// The export table (module docs): read at accept, in the handshake and by the metrics;
    /// written by [`Exports::add`] and [`Exports::remove`]. Never read on the data path.
    ///
    /// [`Exports::add`]: super::Exports::add
    /// [`Exports::remove`]: super::Exports::remove
    pub(super) exports: RwLock<Vec<Arc<ExportState>>>,
    /// Each export's access rules, for the [`Reloader`] (kept in step with `exports`).
    ///
    /// [`Reloader`]: super::Reloader
    pub(super) access: AccessTable,
    /// Held by an add, a remove and the shutdown: they run one at a time.
    pub(super) changing: Mutex<()>,
    pub(crate) tuning: Tuning,
    pub(crate) stopping: AtomicBool,
    /// The global memory budget of payload buffers.
    pub(crate) budget: Arc<MemoryBudget>,
    /// TLS settings (`None`: off).
    pub(crate) tls: Option<crate::tls::TlsSettings>,
    /// The rustls configuration new TLS handshakes use: `tls`'s at start,
    /// [`Reloader::set_tls_config`] replaces it (connected clients keep theirs).
    ///
    /// [`Reloader::set_tls_config`]: super::Reloader::set_tls_config
    pub(crate) tls_config: Arc<RwLock<Option<Arc<rustls::ServerConfig>>>>,
    /// Counters for metrics (`stats.rs`).
    pub(crate) counters: ServerCounters,
    /// The live connections (`Registry`).
    pub(super) conns: Mutex<Registry>,
}

impl ServerState {
    /// The export named `name` in the table now.
    pub(crate) fn find(&self, name: &str) -> Option<Arc<ExportState>> {
        self.exports
            .read()
            .iter()
            .find(|e| e.export.name == name)
            .cloned()
    }

    /// The table now (a snapshot: one may be added or removed meanwhile).
    pub(crate) fn exports(&self) -> Vec<Arc<ExportState>> {
        self.exports.read().clone()
    }

    pub(crate) fn stopping(&self) -> bool {
        self.stopping.load(Ordering::Acquire)
    }
}

/// The live connections, their threads and their exports (under `ServerState::conns`).
#[derive(Default)]
pub(super) struct Registry {
    pub(super) next_id: u64,
    /// Live connections: id and a handle on the socket, to shut it down at stop.
    pub(super) live: Vec<(u64, Stream)>,
    /// Connection threads, by connection id (finished ones are pruned on accept). Plain OS
    /// threads: they hold no modelled state of their own (the facade's threads cannot say
    /// `is_finished`).
    pub(super) threads: Vec<(u64, std::thread::JoinHandle<()>)>,
    /// The export of each live connection past its handshake: a removal drains the
    /// connections of its export, a shutdown names the export of a connection that is stuck.
    pub(super) on_export: Vec<(u64, Arc<ExportState>)>,
    /// Connections still in their handshake whose sockets the acceptor shut down to make
    /// room for a newer one (`accept.rs`); they leave `live` when their threads end.
    pub(super) evicted: Vec<u64>,
}

impl ServerState {
    /// Removes connection `id` from the registry (called by its thread when it ends).
    pub(crate) fn unregister(&self, id: u64) {
        let mut registry = self.conns.lock();
        if let Some(i) = registry.live.iter().position(|(conn, _)| *conn == id) {
            registry.live.swap_remove(i);
        }
        if let Some(i) = registry.on_export.iter().position(|(conn, _)| *conn == id) {
            registry.on_export.swap_remove(i);
        }
        if let Some(i) = registry.evicted.iter().position(|conn| *conn == id) {
            registry.evicted.swap_remove(i);
        }
    }

    /// Whether the acceptor closed connection `id` to make room (`accept.rs`).
    pub(crate) fn was_evicted(&self, id: u64) -> bool {
        self.conns.lock().evicted.contains(&id)
    }

    /// Records that connection `id` negotiated `export`. `false` (nothing recorded) when the
    /// export was removed since the handshake found it: the client is answered as for an
    /// unknown export. Checked under the registry's lock, which the removal takes to mark it:
    /// a removal drains every connection that attached before.
    pub(crate) fn attach(&self, id: u64, export: &Arc<ExportState>) -> bool {
        let mut r = self.conns.lock();
        if export.is_removed() {
            return false;
        }
        r.on_export.push((id, export.clone()));
        true
    }
}
