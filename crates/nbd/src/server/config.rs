//! What a server is configured with: its exports ([`Export`]), the knobs of its data path
//! and limits ([`Tuning`]), and where it listens ([`ServerConfig`]). The server's lifecycle
//! (start, stop, shutdown) is in `mod.rs`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

// `std`'s `Arc`, not the facade's: `blk::Device` takes `std::sync::Arc`.
use blkq_sync::DynArc as Arc;

use blk::Device;

use super::access::{Access, Identity};
use super::conn::splice_rule::SpliceRule;
use super::limits::{default_max_connections, default_memory_budget, BudgetImpl};
use crate::stream::Stream;

/// The default permission bits of the Unix socket: only the server's user may connect.
pub const DEFAULT_UNIX_MODE: u32 = 0o600;

/// The default TCP address: loopback only, on the IANA NBD port.
pub const DEFAULT_TCP_ADDR: &str = "127.0.0.1:10809";
/// The default Unix socket path (relative to the working directory).
pub const DEFAULT_UNIX_PATH: &str = "./blkq.sock";

/// One exported device.
#[derive(Clone)]
pub struct Export {
    /// The export name clients ask for (`""` is the default export).
    pub name: String,
    /// A description for humans (`NBD_INFO_DESCRIPTION`, `NBD_OPT_LIST`).
    pub description: String,
    /// The device.
    pub device: Arc<dyn Device>,
    /// Refuse writes, trims and zeroes (`NBD_FLAG_READ_ONLY`, `NBD_EPERM`).
    pub read_only: bool,
    /// Who may use the export (default: everyone who can connect); see [`Access`].
    pub access: Access,
}

impl Export {
    /// An export of `device` named `name`, writable.
    pub fn new(name: impl Into<String>, device: Arc<dyn Device>) -> Self {
        Self {
            name: name.into(),
            description: String::new(),
            device,
            read_only: false,
            access: Access::default(),
        }
    }

    /// With an access policy.
    pub fn access(mut self, access: Access) -> Self {
        self.access = access;
        self
    }

    /// With a description.
    pub fn description(mut self, d: impl Into<String>) -> Self {
        self.description = d.into();
        self
    }

    /// Read-only or not.
    pub fn read_only(mut self, ro: bool) -> Self {
        self.read_only = ro;
        self
    }
}

impl std::fmt::Debug for Export {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Export")
            .field("name", &self.name)
            .field("description", &self.description)
            .field("limits", &self.device.limits())
            .field("read_only", &self.read_only)
            .field("access", &self.access)
            .finish()
    }
}

/// Knobs of the data path. The defaults suit the CLI; tests shrink them.
#[derive(Debug, Clone)]
pub struct Tuning {
    /// Bytes of each connection's receive buffer (requests are decoded from it in batches).
    pub recv_buf: usize,
    /// Requests a connection may have in flight (submitted or waiting for their reply to be
    /// written); the reader stops reading when they are all taken.
    pub slots: usize,
    /// Data bytes (read and write payloads) a connection may have in flight.
    pub max_bytes_in_flight: u64,
    /// The maximum block size advertised (largest read or write), bytes.
    pub max_block: u32,
    /// A write payload the server refuses (too long, out of range, read-only) is read and
    /// discarded up to this many bytes; a longer one closes the connection instead.
    pub discard_limit: u64,
    /// At shutdown, how long connections get to finish their in-flight requests before their
    /// sockets are shut down in both directions (a connection still busy [`STUCK_GRACE`]
    /// after that is given up as stuck), and again how long the final flushes get.
    ///
    /// [`STUCK_GRACE`]: super::STUCK_GRACE
    pub drain_timeout: Duration,
    /// Connections open at once (handshake or transmission); a socket accepted beyond it is
    /// closed at once. Default: [`default_max_connections`].
    pub max_connections: usize,
    /// A socket that has not finished option haggling this long after it was accepted is
    /// closed (a deadline over the whole handshake, not per read).
    pub handshake_timeout: Duration,
    /// Options a client may send in one handshake; one more closes the connection.
    pub max_options: u32,
    /// Bytes of option data (skipped over-long options included) a client may send in one
    /// handshake; more closes the connection.
    pub max_option_bytes: u64,
    /// A connection with no request in flight that receives nothing for this long is closed
    /// (`None`: never).
    pub idle_timeout: Option<Duration>,
    /// A client that reads none of its replies for this long, or stops sending in the middle
    /// of a request, is closed and its buffers freed.
    pub send_timeout: Duration,
    /// Bytes of request and reply payload buffers (reads and writes in flight, and the extents
    /// block-status requests in flight may answer) across all connections; a connection that would go over it stops reading requests until memory
    /// is returned. Default: [`default_memory_budget`].
    pub memory_budget: u64,
    /// How the memory budget keeps its count (the lock-free counter, or the locked version
    /// it replaces, for comparison).
    pub budget_impl: BudgetImpl,
    /// Which large reads are spliced, where the device can (docs/design.md, "Large reads"):
    /// per connection the faster way for the client, or all of them.
    pub splice_rule: SpliceRule,
    /// How the handshake learns who a client is, for access rules ([`Access`]): by default
    /// [`Identity::of`] (the peer's address and TLS certificate subject). Called at each
    /// option that names an export, so after STARTTLS it sees the certificate. Tests put a
    /// fake identity here.
    pub identify: fn(&Stream) -> Identity,
}

impl Default for Tuning {
    fn default() -> Self {
        Self {
            recv_buf: 1 << 20,
            slots: 1024,
            max_bytes_in_flight: 256 << 20,
            max_block: 32 << 20,
            discard_limit: 1 << 30,
            drain_timeout: Duration::from_secs(10),
            max_connections: default_max_connections(),
            handshake_timeout: Duration::from_secs(10),
            max_options: 256,
            max_option_bytes: 1 << 20,
            idle_timeout: None,
            send_timeout: Duration::from_secs(30),
            memory_budget: default_memory_budget(),
            budget_impl: BudgetImpl::Atomic,
            splice_rule: SpliceRule::Measure,
            identify: Identity::of,
        }
    }
}

/// What to serve and where.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// The exports (names must be distinct).
    pub exports: Vec<Export>,
    /// TCP address to listen on (`None`: no TCP listener).
    pub tcp: Option<SocketAddr>,
    /// Unix socket path to listen on (`None`: no Unix listener). A stale socket file there is
    /// removed at start; the file is removed at shutdown.
    pub unix: Option<PathBuf>,
    /// Permission bits of the Unix socket (default 0o600: only our user may connect).
    pub unix_mode: u32,
    /// Data path knobs.
    pub tuning: Tuning,
    /// TLS (`NBD_OPT_STARTTLS`): `None` is `--tls=off`.
    pub tls: Option<crate::tls::TlsSettings>,
}

impl ServerConfig {
    /// A configuration serving `exports` with no listener yet.
    pub fn new(exports: Vec<Export>) -> Self {
        Self {
            exports,
            tcp: None,
            unix: None,
            unix_mode: DEFAULT_UNIX_MODE,
            tuning: Tuning::default(),
            tls: None,
        }
    }
}
