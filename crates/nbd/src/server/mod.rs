//! The NBD server: exports [`blk::Device`]s over TCP and Unix sockets.
//!
//! ```text
//!  acceptor (one thread per listener) --accept--> connection thread (one per client)
//!     connection thread: handshake (blocking, handshake.rs), then it is the *reader*:
//!        recv (1 MiB buffer) -> decode every whole request in it -> stage bios
//!        -> one lock: give each request a slot of the in-flight table
//!        -> Device::submit_batch (one plug)
//!        -> flush replies (combining writer: one sendmsg for everything completed)
//!     completion threads of the device (if any): end_io -> ready list -> flush if nobody writes
//!     flusher thread (one per connection, asleep on a wait queue): finishes a write that
//!        would have blocked
//! ```
//!
//! See `conn/` for the data path (`conn/mod.rs` lists its rooms: reader, in-flight table,
//! reply shaping, the combining writer and its flusher), and `handshake.rs` for option
//! haggling.
//!
//! Limits ([`Tuning`]; "Limits" in docs/design.md): a connection limit, a handshake deadline
//! and bounds on options, an optional idle timeout, a send timeout for clients that stop
//! reading (or stall in mid-request), and one memory budget (`MemoryBudget`) over the
//! payload buffers of all connections.
//!
//! The configuration types ([`Export`], [`Tuning`], [`ServerConfig`]) are in `config.rs`;
//! this file is the server's lifecycle: [`Server::start`], then one of two ways to stop,
//! [`Server::shutdown`] (now) or [`Server::wait`] (once a [`Stopper`] asks), both returning
//! a [`ShutdownReport`]; dropping a server shuts it down the same way.
//!
//! Shutdown always ends:
//! 1. stop accepting: `shutdown(SHUT_RDWR)` on each listening socket (through a descriptor of
//!    its own, duplicated at start) wakes its acceptor out of `accept(2)` with `EINVAL` on
//!    Linux, TCP and Unix alike; nothing connects to the socket path, which may have been
//!    removed or replaced meanwhile;
//! 2. shut the read side of every connection (requests already received are answered;
//!    anything decoded after the stop gets `NBD_ESHUTDOWN`) and wait for in-flight requests
//!    and their replies, up to [`Tuning::drain_timeout`]; then shut the sockets both ways
//!    (a client that does not read its replies) and wait [`STUCK_GRACE`] more. A connection
//!    still open then has a request stuck in its device (a hung disk): its export is reported
//!    stuck ([`ShutdownReport::stuck`]), marked failed, and the connection thread is left
//!    behind;
//! 3. flush every device at once, waiting for the flushes up to `drain_timeout` again; a
//!    flush that fails marks its exports failed, one that does not complete in time marks
//!    them stuck and failed;
//! 4. remove the Unix socket (only if it is still ours).
//!
//! So shutdown takes at most twice `drain_timeout` plus [`STUCK_GRACE`], whatever the devices
//! do. Waiting for a stop goes through a [`waitq::Completion`], and for the final flushes
//! through [`blk::PendingBio`] (a `waitq` wait queue).
//!
//! The export table changes while serving ([`Exports::add`], [`Exports::remove`], in
//! `exports.rs`): it is a `RwLock<Vec<Arc<ExportState>>>` read (briefly, a clone of one `Arc`
//! or of the list) at accept, in the handshake and by the metrics, and written only by an add
//! or a remove. A connection that has entered transmission holds its export's state by `Arc`
//! and never looks at the table again: the data path takes no lock for it. Removing an export
//! takes its name out of the table at once (new handshakes, `NBD_OPT_LIST` included, no longer
//! see it), marks it removed under the registry's lock (a handshake that found it a moment
//! before cannot attach to it any more: it is answered as for an unknown export), then drains
//! the connections attached to it and flushes its device with the code shutdown uses (steps 2
//! and 3 above, for that export's connections only). Adds, removes and the shutdown run one at
//! a time (`Shared::changing`): the shutdown drains, flushes and reports what the table holds
//! when it starts, the exports added at runtime included, none removed.

mod accept;
mod access;
mod config;
mod conn;
mod exports;
mod handshake;
mod limits;
mod stats;

use self::accept::{accept_loop, remove_stale_socket, Listener};
pub use self::access::{
    parse_cidr, parse_subject_rule, Access, CidrError, Identity, IpNet, Peer, Refusal, SubjectRule,
    SubjectRuleError,
};
pub use self::config::{
    Export, ServerConfig, Tuning, DEFAULT_TCP_ADDR, DEFAULT_UNIX_MODE, DEFAULT_UNIX_PATH,
};
pub use self::conn::splice_rule::SpliceRule;
pub use self::exports::{ExportInfo, Exports};
pub use self::limits::{default_max_connections, default_memory_budget, BudgetImpl, MemoryBudget};
pub(crate) use self::stats::ServerCounters;
pub use self::stats::{ExportMetrics, HandshakeFailure, Metrics, ServerSnapshot, StatsSource};

use std::io;
use std::net::{Shutdown, SocketAddr, TcpListener};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
// `std`'s `Arc`, not the facade's: `blk::Device` and `blk::EndIo` take `std::sync::Arc`.
use blkq_sync::DynArc as Arc;
use std::time::{Duration, Instant};

use blk::{Bio, Op, PendingBio};
use blkq_sync::atomic::{AtomicBool, Ordering};
use blkq_sync::{Mutex, RwLock};
use tracing::{info, warn};
use waitq::Completion;

use crate::stream::Stream;

/// Errors of starting a server.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServerError {
    /// A listener could not be bound.
    #[error("binding {addr}: {source}")]
    Bind {
        /// The address or path.
        addr: String,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// The configuration has no exports.
    #[error("no exports configured")]
    NoExports,
    /// Two exports share a name.
    #[error("two exports are named {0:?}")]
    DuplicateExport(String),
    /// An export name is not a valid protocol string.
    #[error("export name {0:?} is not a valid NBD string (at most 4096 bytes, no NUL)")]
    BadExportName(String),
    /// Neither a TCP address nor a Unix socket was given.
    #[error("no listener configured (give a TCP address or a Unix socket path)")]
    NoListener,
    /// Any other I/O error (spawning threads).
    #[error("{0}")]
    Io(#[from] io::Error),
    /// An export was to be added or removed while the server stops (or after it stopped).
    #[error("the server is shutting down: exports no longer change")]
    Stopping,
    /// No export has this name.
    #[error("no export named {0:?}")]
    UnknownExport(String),
    /// An export was removed, but not cleanly: its data may be lost (see [`RemoveReport`]).
    #[error("{0}")]
    RemovedUnclean(RemoveReport),
}

/// What removing an export found ([`Exports::remove`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RemoveReport {
    /// The export's name (gone from the table either way).
    pub name: String,
    /// Connections that were attached to it (drained, then closed).
    pub connections: usize,
    /// Its device was flushed (a writable export; whether the flush succeeded is `failed`).
    pub flushed: bool,
    /// A connection still had a request in the device after the timeout (its thread is left
    /// behind), or the final flush did not complete in time.
    pub stuck: bool,
    /// Data on it may be lost: a write or flush had failed on it (sticky), its final flush
    /// failed or did not complete, or it was stuck.
    pub failed: bool,
}

impl RemoveReport {
    /// Whether its connections drained and its device flushed.
    pub fn is_clean(&self) -> bool {
        !self.stuck && !self.failed
    }
}

impl std::fmt::Display for RemoveReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.connections;
        write!(f, "export {:?} removed", self.name)?;
        if self.is_clean() {
            let flushed = if self.flushed { ", device flushed" } else { "" };
            return write!(f, " ({n} connection(s) drained and closed{flushed})");
        }
        if self.stuck {
            write!(
                f,
                ", but it is stuck: a request of its {n} connection(s) or its final flush did \
                 not complete within the timeout"
            )?;
        } else {
            write!(
                f,
                ", but a write or flush failed on it (or its final flush did)"
            )?;
        }
        f.write_str("; data written to it may be lost")
    }
}

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
    fn new(e: Export) -> Result<Self, ServerError> {
        if e.name.len() > crate::proto::NBD_MAX_STRING_LEN || e.name.contains('\0') {
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

/// After the drain timeout and the forced close of every connection's socket, how long a
/// connection thread gets to notice and end before its export is reported stuck.
pub const STUCK_GRACE: Duration = Duration::from_secs(1);

/// What a shutdown found (see the module docs).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ShutdownReport {
    /// Exports whose data may be lost: a sticky write error, a failed or timed-out final
    /// flush, or a request stuck in the device. Empty when everything is durable.
    pub failed: Vec<String>,
    /// Exports with a request still stuck in the device after the drain timeout, or whose
    /// final flush did not complete in time (a subset of `failed`).
    pub stuck: Vec<String>,
}

impl ShutdownReport {
    /// Whether every export drained and flushed.
    pub fn is_clean(&self) -> bool {
        self.failed.is_empty() && self.stuck.is_empty()
    }
}

/// The access rules of every export in the table, by name: shared with the [`Reloader`]
/// (which must not hold the exports themselves).
type AccessTable = Arc<RwLock<Vec<(String, Arc<RwLock<Access>>)>>>;

/// State shared by the acceptors and every connection.
pub(crate) struct Shared {
    /// The export table (module docs): read at accept, in the handshake and by the metrics;
    /// written by [`Exports::add`] and [`Exports::remove`]. Never read on the data path.
    exports: RwLock<Vec<Arc<ExportState>>>,
    /// Each export's access rules, for the [`Reloader`] (kept in step with `exports`).
    access: AccessTable,
    /// Held by an add, a remove and the shutdown: they run one at a time.
    changing: Mutex<()>,
    pub(crate) tuning: Tuning,
    pub(crate) stopping: AtomicBool,
    /// The global memory budget of payload buffers.
    pub(crate) budget: Arc<MemoryBudget>,
    /// TLS settings (`None`: off).
    pub(crate) tls: Option<crate::tls::TlsSettings>,
    /// The rustls configuration new TLS handshakes use: `tls`'s at start,
    /// [`Reloader::set_tls_config`] replaces it (connected clients keep theirs).
    pub(crate) tls_config: Arc<RwLock<Option<Arc<rustls::ServerConfig>>>>,
    /// Counters for metrics (`stats.rs`).
    pub(crate) counters: ServerCounters,
    conns: Mutex<Registry>,
}

impl Shared {
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

#[derive(Default)]
struct Registry {
    next_id: u64,
    /// Live connections: id and a handle on the socket, to shut it down at stop.
    live: Vec<(u64, Stream)>,
    /// Connection threads, by connection id (finished ones are pruned on accept). Plain OS
    /// threads: they hold no modelled state of their own (the facade's threads cannot say
    /// `is_finished`).
    threads: Vec<(u64, std::thread::JoinHandle<()>)>,
    /// The export of each live connection past its handshake: a removal drains the
    /// connections of its export, a shutdown names the export of a connection that is stuck.
    on_export: Vec<(u64, Arc<ExportState>)>,
    /// Connections still in their handshake whose sockets the acceptor shut down to make
    /// room for a newer one (`accept.rs`); they leave `live` when their threads end.
    evicted: Vec<u64>,
}

impl Shared {
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

/// A running server.
pub struct Server {
    shared: Arc<Shared>,
    acceptors: Vec<std::thread::JoinHandle<()>>,
    /// A descriptor of each listening socket (duplicated: the acceptors own theirs), shut
    /// down to wake the acceptors at stop.
    wakers: Vec<OwnedFd>,
    /// What the shutdown found (set once, by the first `do_shutdown`).
    report: ShutdownReport,
    tcp_addr: Option<SocketAddr>,
    unix_path: Option<PathBuf>,
    /// (device, inode) of the socket we bound: only that file is removed at shutdown.
    unix_ino: Option<(u64, u64)>,
    /// Completed (for everyone) when a [`Stopper`] asks the server to stop.
    stop_requested: Arc<Completion>,
}

/// A handle that asks a server to stop (from a signal-watching thread, say). Cheap to clone.
#[derive(Clone)]
pub struct Stopper(Arc<Completion>);

impl Stopper {
    /// Asks the server to stop; [`Server::wait`] then shuts it down and returns. Asking twice
    /// is harmless.
    pub fn stop(&self) {
        // `complete_all` wakes whoever waits in `Server::wait` now and lets any later wait
        // return at once; the completion's wait queue orders the wake against the waiter's
        // check, so no stop is lost.
        self.0.complete_all();
    }
}

/// A handle that changes, on a running server, what can change without dropping a client:
/// the TLS certificates new handshakes use and the exports' access rules (see
/// [`Server::reloader`]). Cheap to clone. It holds those settings only, never the server
/// or its exports: kept past the server's end, it keeps no device open.
#[derive(Clone)]
pub struct Reloader {
    tls_config: Arc<RwLock<Option<Arc<rustls::ServerConfig>>>>,
    /// Each export's name and access rules (the table's, added and removed exports
    /// included).
    access: AccessTable,
}

impl Reloader {
    fn find(&self, name: &str) -> Option<Arc<RwLock<Access>>> {
        self.access
            .read()
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, a)| a.clone())
    }

    /// New TLS handshakes use `config`; clients already connected keep the session they
    /// have. `false` (nothing changed) when the server runs without TLS.
    pub fn set_tls_config(&self, config: Arc<rustls::ServerConfig>) -> bool {
        let mut cur = self.tls_config.write();
        if cur.is_none() {
            return false;
        }
        *cur = Some(config);
        true
    }

    /// Export `name`'s access rules become `access`, for connections and options that come
    /// after; a client already attached to it stays. `false` when no export has that name.
    pub fn set_access(&self, name: &str, access: Access) -> bool {
        match self.find(name) {
            Some(a) => {
                *a.write() = access;
                true
            }
            None => false,
        }
    }

    /// Export `name`'s access rules in force now (`None`: no such export).
    pub fn access(&self, name: &str) -> Option<Access> {
        self.find(name).map(|a| a.read().clone())
    }
}

impl Server {
    /// A handle to change the certificates and the access rules while serving.
    pub fn reloader(&self) -> Reloader {
        Reloader {
            tls_config: self.shared.tls_config.clone(),
            access: self.shared.access.clone(),
        }
    }

    /// Binds the listeners and starts accepting connections.
    pub fn start(cfg: ServerConfig) -> Result<Server, ServerError> {
        if cfg.exports.is_empty() {
            return Err(ServerError::NoExports);
        }
        if cfg.tcp.is_none() && cfg.unix.is_none() {
            return Err(ServerError::NoListener);
        }
        let mut exports: Vec<Arc<ExportState>> = Vec::with_capacity(cfg.exports.len());
        for e in cfg.exports {
            let state = ExportState::new(e)?;
            if exports.iter().any(|x| x.export.name == state.export.name) {
                return Err(ServerError::DuplicateExport(state.export.name.clone()));
            }
            exports.push(Arc::new(state));
        }
        let access = exports
            .iter()
            .map(|e| (e.export.name.clone(), e.access.clone()))
            .collect();
        let mut tuning = cfg.tuning;
        tuning.recv_buf = tuning.recv_buf.max(64 << 10);
        tuning.slots = tuning.slots.clamp(1, 1 << 20);
        tuning.max_block = tuning.max_block.max(65536);
        tuning.max_connections = tuning.max_connections.max(1);

        let mut listeners = Vec::new();
        let mut tcp_addr = None;
        if let Some(addr) = cfg.tcp {
            let l = TcpListener::bind(addr).map_err(|source| ServerError::Bind {
                addr: addr.to_string(),
                source,
            })?;
            tcp_addr = Some(l.local_addr()?);
            listeners.push(Listener::Tcp(l));
        }
        let mut unix_path = None;
        let mut unix_ino = None;
        if let Some(path) = &cfg.unix {
            let bind_err = |source| ServerError::Bind {
                addr: path.display().to_string(),
                source,
            };
            remove_stale_socket(path).map_err(bind_err)?;
            // Bound in a private directory and given its mode there: the path never exists
            // with another mode (a bind then a chmod left it open to all for a moment).
            let l = crate::unix_listener::bind_private(path, cfg.unix_mode).map_err(bind_err)?;
            let m = std::fs::symlink_metadata(path).map_err(bind_err)?;
            unix_ino = Some((m.dev(), m.ino()));
            unix_path = Some(path.clone());
            listeners.push(Listener::Unix(l));
        }

        let shared = Arc::new(Shared {
            exports: RwLock::new(exports),
            access: Arc::new(RwLock::new(access)),
            changing: Mutex::new(()),
            stopping: AtomicBool::new(false),
            budget: Arc::new(MemoryBudget::with_impl(
                tuning.memory_budget.max(1),
                tuning.budget_impl,
            )),
            tuning,
            tls_config: Arc::new(RwLock::new(
                cfg.tls
                    .as_ref()
                    .filter(|t| t.mode != crate::tls::TlsMode::Off)
                    .map(|t| t.config.clone()),
            )),
            tls: cfg
                .tls
                .clone()
                .filter(|t| t.mode != crate::tls::TlsMode::Off),
            counters: ServerCounters::default(),
            conns: Mutex::new(Registry::default()),
        });
        let mut acceptors = Vec::new();
        let wakers = listeners
            .iter()
            .map(Listener::waker)
            .collect::<io::Result<Vec<_>>>()?;
        for l in listeners {
            let sh = shared.clone();
            acceptors.push(
                std::thread::Builder::new()
                    .name("nbd-accept".into())
                    .spawn(move || accept_loop(l, sh))?,
            );
        }
        Ok(Server {
            shared,
            acceptors,
            wakers,
            report: ShutdownReport::default(),
            tcp_addr,
            unix_path,
            unix_ino,
            stop_requested: Arc::new(Completion::new()),
        })
    }

    /// The bound TCP address (with the real port when port 0 was asked for).
    pub fn tcp_addr(&self) -> Option<SocketAddr> {
        self.tcp_addr
    }

    /// The Unix socket path.
    pub fn unix_path(&self) -> Option<&Path> {
        self.unix_path.as_deref()
    }

    /// Connections currently open (handshake or transmission).
    pub fn connections(&self) -> usize {
        self.shared.conns.lock().live.len()
    }

    /// Bytes of the memory budget taken now (payloads of reads and writes in flight, extents
    /// of block-status requests in flight, across all connections; see
    /// [`Tuning::memory_budget`]).
    pub fn memory_in_use(&self) -> u64 {
        self.shared.budget.used()
    }

    /// A handle on the server's counters (for a metrics endpoint; it outlives
    /// [`Server::wait`]).
    pub fn metrics(&self) -> Metrics {
        Metrics(self.shared.clone())
    }

    /// A handle to ask [`wait`](Self::wait) to return.
    pub fn stopper(&self) -> Stopper {
        Stopper(self.stop_requested.clone())
    }

    /// Blocks until a [`Stopper`] asks the server to stop, then shuts it down as
    /// [`Server::shutdown`] does and returns what the shutdown found.
    pub fn wait(mut self) -> ShutdownReport {
        self.stop_requested.wait();
        self.do_shutdown();
        self.report.clone()
    }

    /// Stops now: stops accepting, lets every connection finish its in-flight requests (up
    /// to [`Tuning::drain_timeout`], then [`STUCK_GRACE`]), flushes every device and removes
    /// the Unix socket (module docs). Returns what it found: the exports that failed and
    /// those left stuck ([`ShutdownReport`]; `failed` is [`Server::failed_exports`] at the
    /// end, the final flush included). Dropping a server does the same, reporting nothing.
    pub fn shutdown(mut self) -> ShutdownReport {
        self.do_shutdown();
        self.report.clone()
    }

    /// Whether export `name` has failed: a write or flush on it returned an error, so every
    /// later FLUSH and FUA write on it fails with EIO (sticky). `None` if no such export.
    pub fn export_failed(&self, name: &str) -> Option<bool> {
        Some(self.shared.find(name)?.failed.is_set())
    }

    /// The names of the exports that have failed (see [`Server::export_failed`]).
    pub fn failed_exports(&self) -> Vec<String> {
        self.shared
            .exports()
            .iter()
            .filter(|e| e.failed.is_set())
            .map(|e| e.export.name.clone())
            .collect()
    }

    fn do_shutdown(&mut self) {
        if self.shared.stopping.swap(true, Ordering::AcqRel) {
            return;
        }
        // An add or a remove under way ends first (a removal within its own timeout); none
        // starts after: both see `stopping`.
        let shared = self.shared.clone();
        let _one = shared.changing.lock();
        let timeout = self.shared.tuning.drain_timeout;
        info!(
            "shutting down: no new connections; finishing in-flight requests (up to {timeout:?})"
        );
        // Wake the acceptors (module docs, step 1); they see `stopping` and return.
        for w in &self.wakers {
            if let Err(e) = crate::sys::shutdown_listener(w.as_raw_fd()) {
                warn!("shutting down a listener: {e}");
            }
        }
        for h in self.acceptors.drain(..) {
            let _ = h.join();
        }
        self.wakers.clear();
        let table = self.shared.exports();
        let mut stuck = drain(&self.shared, None, timeout);
        for e in &stuck {
            warn!(
                export = %e.export.name,
                "export {:?} is stuck: a request is still in its device after the shutdown \
                 timeout ({timeout:?}); giving up on it",
                e.export.name
            );
        }
        for e in flush(&self.shared, &table, timeout) {
            if !stuck.iter().any(|s| Arc::ptr_eq(s, &e)) {
                stuck.push(e);
            }
        }
        for e in &stuck {
            e.failed.set();
        }
        if let (Some(p), Some(ino)) = (&self.unix_path, self.unix_ino) {
            // Remove only our own socket: someone may have replaced the path since.
            match std::fs::symlink_metadata(p) {
                Ok(m) if (m.dev(), m.ino()) == ino => {
                    let _ = std::fs::remove_file(p);
                }
                Ok(_) => warn!(path = %p.display(), "socket path was replaced; leaving it"),
                Err(_) => {}
            }
        }
        self.report = ShutdownReport {
            failed: self.failed_exports(),
            // In the table's order.
            stuck: table
                .iter()
                .filter(|e| stuck.iter().any(|s| Arc::ptr_eq(s, e)))
                .map(|e| e.export.name.clone())
                .collect(),
        };
        if self.report.is_clean() {
            info!("server stopped");
        } else {
            warn!(
                failed = ?self.report.failed,
                stuck = ?self.report.stuck,
                "server stopped; data on the failed exports may be lost"
            );
        }
    }
}

/// Step 2 of the shutdown (module docs), for every connection (`only` is `None`) or for the
/// connections attached to export `only` (its removal): lets them finish, forcing their
/// sockets closed after `timeout`. Returns the exports with a connection still open
/// [`STUCK_GRACE`] after that (their threads are left behind); at shutdown, not the exports
/// removed before (their removal reported them).
fn drain(
    shared: &Shared,
    only: Option<&Arc<ExportState>>,
    timeout: Duration,
) -> Vec<Arc<ExportState>> {
    // The connections drained: by id, `None` for all.
    let ids: Option<Vec<u64>> = only.map(|x| {
        shared
            .conns
            .lock()
            .on_export
            .iter()
            .filter(|(_, e)| Arc::ptr_eq(e, x))
            .map(|(id, _)| *id)
            .collect()
    });
    let chosen = |id: &u64| ids.as_ref().is_none_or(|v| v.contains(id));
    // Shut the read side: each reader sees end-of-file after what it already received,
    // answers it, waits for its in-flight requests and closes.
    let threads: Vec<std::thread::JoinHandle<()>> = {
        let mut r = shared.conns.lock();
        for (_, s) in r.live.iter().filter(|(id, _)| chosen(id)) {
            let _ = s.shutdown(Shutdown::Read);
        }
        let (taken, kept) = std::mem::take(&mut r.threads)
            .into_iter()
            .partition(|(id, _)| chosen(id));
        r.threads = kept;
        taken.into_iter().map(|(_, t)| t).collect()
    };
    let deadline = Instant::now() + timeout;
    let mut forced = false;
    while threads.iter().any(|t| !t.is_finished()) {
        let now = Instant::now();
        if !forced && now >= deadline {
            warn!("connections still busy after the drain timeout; closing their sockets");
            for (_, s) in shared.conns.lock().live.iter().filter(|(id, _)| chosen(id)) {
                let _ = s.shutdown(Shutdown::Both);
            }
            forced = true;
        }
        if forced && now >= deadline + STUCK_GRACE {
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let mut stuck: Vec<Arc<ExportState>> = Vec::new();
    for t in threads {
        if t.is_finished() {
            let _ = t.join();
        }
        // Else: dropping the handle detaches the thread, which ends if its device ever
        // completes the request.
    }
    let r = shared.conns.lock();
    for (id, _) in r.live.iter().filter(|(id, _)| chosen(id)) {
        match r.on_export.iter().find(|(c, _)| c == id) {
            Some((_, e)) if only.is_none() && e.is_removed() => {}
            Some((_, e)) if !stuck.iter().any(|s| Arc::ptr_eq(s, e)) => stuck.push(e.clone()),
            Some(_) => {}
            None => warn!(conn = id, "a connection still in its handshake did not end"),
        }
    }
    stuck
}

/// Step 3 of the shutdown (and of a removal): flushes the device of each of `exports` once
/// (all at once), waiting up to `timeout` for them. A failed flush marks every export of its
/// device failed (in `exports` and in the table). Returns the exports whose flush did not
/// complete in time.
fn flush(
    shared: &Shared,
    exports: &[Arc<ExportState>],
    timeout: Duration,
) -> Vec<Arc<ExportState>> {
    let mut pending: Vec<(usize, PendingBio)> = Vec::new();
    for (i, e) in exports.iter().enumerate() {
        let dev = &e.export.device;
        let seen = exports[..i]
            .iter()
            .any(|o| Arc::ptr_eq(&o.export.device, dev) && !o.export.read_only);
        if e.export.read_only || seen {
            continue;
        }
        pending.push((
            i,
            PendingBio::submit(dev.as_ref(), Bio::new(Op::Flush, 0, 0)),
        ));
    }
    let deadline = Instant::now() + timeout;
    let mut late = Vec::new();
    for (i, flush) in pending {
        let dev = &exports[i].export.device;
        let name = &exports[i].export.name;
        let res = if let Some((_, res)) = flush.wait_until(deadline) {
            res
        } else {
            warn!(
                export = %name,
                "export {name:?} is stuck: its final flush did not complete within {timeout:?}"
            );
            late.extend(
                exports
                    .iter()
                    .filter(|o| Arc::ptr_eq(&o.export.device, dev))
                    .cloned(),
            );
            continue;
        };
        if let Err(err) = res {
            warn!(export = %name, "final flush failed: {err}");
            // Every export on this device shares the failure.
            for o in exports.iter().chain(shared.exports().iter()) {
                if Arc::ptr_eq(&o.export.device, dev) {
                    o.failed.set();
                }
            }
        }
    }
    late
}

impl Drop for Server {
    fn drop(&mut self) {
        self.do_shutdown();
    }
}
