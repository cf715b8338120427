//! The in-process pieces the remote device's tests stand on: a device from a spec, the
//! blkq server on a Unix socket, the URI that reaches it, and the log.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use blk::Device;
use blk_drivers::spec::{DeviceSpec, QueueOverrides};
use nbd::client::{Client, ClientOptions, Endpoint, Handshake};
use nbd::server::{Export, Server, ServerConfig};

/// A device built from `spec` (`mem:16M`, `null:1G`, ...).
pub fn device(spec: &str) -> Arc<dyn Device> {
    let s: DeviceSpec = spec.parse().unwrap();
    Arc::new(s.build(&QueueOverrides::default()).unwrap())
}

/// The test's log, filtered by `RUST_LOG` (`RUST_LOG=nbd=info,raid1=info`).
pub fn log() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
}

/// The blkq server exporting each (name, disk) on the Unix socket `path`; a shutdown waits
/// at most 200 ms for a request stuck in its device.
pub fn serve_named(path: &Path, exports: &[(&str, &Arc<dyn Device>)]) -> Server {
    let exports = exports
        .iter()
        .map(|(n, d)| Export::new(*n, (*d).clone()))
        .collect();
    let mut cfg = ServerConfig::new(exports);
    cfg.unix = Some(path.to_path_buf());
    cfg.tuning.drain_timeout = Duration::from_millis(200);
    Server::start(cfg).unwrap()
}

/// The blkq server exporting `disk` as the default export on `path` ([`serve_named`]).
pub fn serve(path: &Path, disk: &Arc<dyn Device>) -> Server {
    serve_named(path, &[("", disk)])
}

/// The `nbd:` URI of the default export on `path`, with the device's options `opts`
/// (`,timeout=5,...`).
pub fn unix_uri(path: &Path, opts: &str) -> String {
    format!("nbd+unix:///?socket={}{opts}", path.display())
}

/// The blkq server in a temporary folder of its own, on the Unix socket `nbd.sock` there;
/// shut down when dropped.
pub struct Running {
    server: Option<Server>,
    /// The Unix socket's path.
    pub path: PathBuf,
    /// The Unix socket.
    pub ep: Endpoint,
    _dir: tempfile::TempDir,
}

impl Running {
    /// The server exporting `exports`, its configuration as `tune` leaves it: the socket set,
    /// and a shutdown that waits at most 5 s for a request stuck in its device. Starts the
    /// test's [`log`].
    pub fn start(exports: Vec<Export>, tune: impl FnOnce(&mut ServerConfig)) -> Self {
        log();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nbd.sock");
        let mut cfg = ServerConfig::new(exports);
        cfg.unix = Some(path.clone());
        cfg.tuning.drain_timeout = Duration::from_secs(5);
        tune(&mut cfg);
        Self {
            server: Some(Server::start(cfg).unwrap()),
            ep: Endpoint::Unix(path.clone()),
            path,
            _dir: dir,
        }
    }

    /// The server.
    pub fn server(&self) -> &Server {
        self.server.as_ref().unwrap()
    }

    /// Its TCP listener (which `tune` asked for).
    pub fn tcp(&self) -> Endpoint {
        Endpoint::Tcp(self.server().tcp_addr().unwrap())
    }

    /// A client of its default export over the Unix socket, with `opts`.
    pub fn connect(&self, opts: &ClientOptions) -> Client {
        Client::connect(&self.ep, opts).unwrap()
    }

    /// A handshake begun on the Unix socket.
    pub fn handshake(&self) -> Handshake {
        Handshake::start(self.ep.connect().unwrap()).unwrap()
    }

    /// The server, for a test that shuts it down itself.
    pub fn take(&mut self) -> Server {
        self.server.take().unwrap()
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(s) = self.server.take() {
            s.shutdown();
        }
    }
}
