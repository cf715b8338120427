//! The errors of starting a server and of changing its exports, and what removing an export
//! found.

use std::io;

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
///
/// [`Exports::remove`]: super::Exports::remove
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
