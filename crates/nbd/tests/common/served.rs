//! The in-process pieces the remote device's tests stand on: a device from a spec, the
//! blkq server on a Unix socket, the URI that reaches it, and the log.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use blk::Device;
use blk_drivers::spec::{DeviceSpec, QueueOverrides};
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
