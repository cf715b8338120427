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
//! a time (`ServerState::changing`): the shutdown drains, flushes and reports what the table holds
//! when it starts, the exports added at runtime included, none removed.

mod accept;
mod access;
mod config;
mod conn;
mod drain;
mod error;
mod exports;
mod handshake;
mod limits;
mod shared;
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
pub use self::drain::STUCK_GRACE;
use self::drain::{drain, flush};
pub use self::error::{RemoveReport, ServerError};
pub use self::exports::{ExportInfo, Exports};
pub use self::limits::{default_max_connections, default_memory_budget, BudgetImpl, MemoryBudget};
use self::shared::{AccessTable, ExportState, Registry, ServerState};
use self::stats::ServerCounters;
pub use self::stats::{ExportMetrics, HandshakeFailure, ServerSnapshot, StatsSource};

use std::io;
use std::net::{SocketAddr, TcpListener};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
// `std`'s `Arc`, not the facade's: `blk::Device` and `blk::EndIo` take `std::sync::Arc`.
use blkq_sync::DynArc as Arc;
use std::time::Duration;

use blkq_sync::atomic::{AtomicBool, Ordering};
use blkq_sync::{Mutex, RwLock};
use tracing::{info, warn};
use waitq::Completion;

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

/// A running server.
pub struct Server {
    shared: Arc<ServerState>,
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

        let shared = Arc::new(ServerState {
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

impl Drop for Server {
    fn drop(&mut self) {
        self.do_shutdown();
    }
}

/// A handle on a running server's counters, for a metrics endpoint. Cheap to clone; keeps the
/// server's shared state alive (not its threads).
#[derive(Clone)]
pub struct Metrics(pub(crate) Arc<ServerState>);

impl Metrics {
    /// The server's counters now.
    pub fn server(&self) -> ServerSnapshot {
        ServerSnapshot {
            open: self.0.conns.lock().live.len() as u64,
            memory_used: self.0.budget.used(),
            memory_budget: self.0.tuning.memory_budget,
            ..self.0.counters.snapshot()
        }
    }

    /// Every export's disk counters now.
    pub fn exports(&self) -> Vec<ExportMetrics> {
        self.0
            .exports()
            .iter()
            .map(|e| {
                let (stats, source) = match &e.disk {
                    Some(d) => (d.snapshot(), StatsSource::Server),
                    None => (
                        e.export.device.stats().unwrap_or_default(),
                        StatsSource::Device,
                    ),
                };
                ExportMetrics {
                    name: e.export.name.clone(),
                    stats,
                    source,
                    device: e.export.device.clone(),
                }
            })
            .collect()
    }

    /// Counts a connection refused for `why` (the hook for policies decided outside the
    /// handshake code, such as an access list).
    pub fn count_refusal(&self, why: HandshakeFailure) {
        self.0.counters.handshake_failed(why);
    }
}

impl Server {
    /// A handle to add and remove exports while serving.
    pub fn exports(&self) -> Exports {
        Exports(Arc::downgrade(&self.shared))
    }

    /// Adds an export while serving (see [`Exports::add`]).
    pub fn add_export(&self, export: Export) -> Result<(), ServerError> {
        self.exports().add(export)
    }

    /// Removes an export while serving (see [`Exports::remove`]).
    pub fn remove_export(
        &self,
        name: &str,
        timeout: Duration,
    ) -> Result<RemoveReport, ServerError> {
        self.exports().remove(name, timeout)
    }
}
