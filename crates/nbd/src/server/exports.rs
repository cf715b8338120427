//! The export table's changes while serving: [`Exports`] (a weak handle to the server) adds,
//! removes and lists exports; a removal drains the export's connections and flushes its
//! device with the shutdown's code (see the server's module docs).

use std::time::Duration;

use blkq_sync::atomic::Ordering;
// `std`'s `Arc`, not the facade's: `blk::Device` and `blk::EndIo` take `std::sync::Arc`.
use blkq_sync::DynArc as Arc;
use tracing::{info, warn};

use super::config::Export;
use super::drain::{drain, flush};
use super::error::{RemoveReport, ServerError};
use super::shared::{ExportState, ServerState};

/// One export of the table, as [`Exports::list`] shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportInfo {
    /// Its name.
    pub name: String,
    /// Its size in bytes, as clients see it.
    pub size: u64,
    /// Read-only.
    pub read_only: bool,
    /// What clients are told.
    pub description: String,
    /// Connections attached to it now.
    pub connections: usize,
    /// A write or flush failed on it (sticky).
    pub failed: bool,
}

/// A handle that adds and removes exports while the server runs (see the module docs): for
/// a control socket. Cheap to clone. It holds the server weakly: once the server and its
/// metrics are gone, every call answers [`ServerError::Stopping`], and a handle kept longer
/// keeps no device open.
#[derive(Clone)]
pub struct Exports(pub(super) std::sync::Weak<ServerState>);

impl Exports {
    fn shared(&self) -> Result<Arc<ServerState>, ServerError> {
        self.0.upgrade().ok_or(ServerError::Stopping)
    }

    /// Adds `export`: new handshakes (and `NBD_OPT_LIST`) see it at once. Refused when its
    /// name is not a valid NBD string, when an export has that name already, or when the
    /// server stops.
    pub fn add(&self, export: Export) -> Result<(), ServerError> {
        let shared = self.shared()?;
        let _one = shared.changing.lock();
        if shared.stopping() {
            return Err(ServerError::Stopping);
        }
        let state = Arc::new(ExportState::new(export)?);
        let name = state.export.name.clone();
        let mut table = shared.exports.write();
        if table.iter().any(|e| e.export.name == name) {
            return Err(ServerError::DuplicateExport(name));
        }
        shared
            .access
            .write()
            .push((name.clone(), state.access.clone()));
        table.push(state);
        drop(table);
        info!(export = %name, "export {name:?} added");
        Ok(())
    }

    /// Removes export `name`: the name is gone at once for new handshakes; the connections
    /// attached to it finish their in-flight requests and are closed, as at shutdown, within
    /// `timeout` (then their sockets are shut, and [`STUCK_GRACE`](super::STUCK_GRACE) later
    /// any still open is left behind); then its device is flushed (up to `timeout`). The
    /// export is gone either way; [`ServerError::RemovedUnclean`] says when its data may be
    /// lost (a connection stuck in the device, a failed or late flush, an earlier write
    /// error).
    pub fn remove(&self, name: &str, timeout: Duration) -> Result<RemoveReport, ServerError> {
        let shared = self.shared()?;
        let _one = shared.changing.lock();
        if shared.stopping() {
            return Err(ServerError::Stopping);
        }
        let state = {
            let mut table = shared.exports.write();
            let i = table
                .iter()
                .position(|e| e.export.name == name)
                .ok_or_else(|| ServerError::UnknownExport(name.to_string()))?;
            table.remove(i)
        };
        shared.access.write().retain(|(n, _)| n != name);
        let connections = {
            // Under the registry's lock, which `ServerState::attach` takes: every connection that
            // attached to it is counted (and drained), none attaches after.
            let r = shared.conns.lock();
            state.removed.store(true, Ordering::Release);
            r.on_export
                .iter()
                .filter(|(_, e)| Arc::ptr_eq(e, &state))
                .count()
        };
        info!(
            export = %name,
            connections,
            "removing export {name:?}: no new handshakes; finishing the in-flight requests of \
             its {connections} connection(s) (up to {timeout:?})"
        );
        let mut stuck = !drain(&shared, Some(&state), timeout).is_empty();
        if stuck {
            warn!(
                export = %name,
                "export {name:?} is stuck: a request is still in its device after the timeout \
                 ({timeout:?}); giving up on it"
            );
        }
        stuck |= !flush(&shared, std::slice::from_ref(&state), timeout).is_empty();
        if stuck {
            state.failed.set();
            // A device with a request stuck in it is never dropped (a drop may wait for it,
            // as a mirror's does): left behind, as a stuck connection's thread is.
            std::mem::forget(state.clone());
        }
        let report = RemoveReport {
            name: name.to_string(),
            connections,
            flushed: !state.export.read_only,
            stuck,
            failed: state.failed.is_set(),
        };
        if report.is_clean() {
            info!(export = %name, "{report}");
            Ok(report)
        } else {
            warn!(export = %name, "{report}");
            Err(ServerError::RemovedUnclean(report))
        }
    }

    /// The exports in the table now, in the order they were added.
    pub fn list(&self) -> Result<Vec<ExportInfo>, ServerError> {
        let shared = self.shared()?;
        let table = shared.exports();
        let r = shared.conns.lock();
        Ok(table
            .iter()
            .map(|e| ExportInfo {
                name: e.export.name.clone(),
                size: e.size,
                read_only: e.export.read_only,
                description: e.export.description.clone(),
                connections: r
                    .on_export
                    .iter()
                    .filter(|(_, x)| Arc::ptr_eq(x, e))
                    .count(),
                failed: e.failed.is_set(),
            })
            .collect())
    }
}
