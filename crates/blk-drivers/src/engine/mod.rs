//! Asynchronous engines for the `file` driver: io_uring, and a thread pool fallback.
//!
//! Both take [`UringOp`]s tagged with a caller's `user_data` and report each one, exactly
//! once, through the completion callback given at construction:
//! `callback(user_data, Ok(bytes))` (`bytes` is the op's full length for reads and writes, 0
//! for fsync and nop) or `callback(user_data, Err(e))`.
//!
//! - [`UringEngine`]: one ring; submitters serialize on a mutex around the submission queue and
//!   make one `io_uring_enter` per batch; a reaper thread waits for completions and runs the
//!   callback. Short reads and writes are **resubmitted** for the remainder (the caller only ever
//!   sees whole transfers or an error); a read reaching end of file reports `UnexpectedEof`. FUA
//!   writes carry `RWF_DSYNC` (falling back to write + `fdatasync` if the kernel refuses the flag).
//!   Aligned transfers use the `O_DIRECT` descriptor, as in [`crate::backend::FileBackend`]. At
//!   most `sq_entries` ops are in flight (the completion queue is twice that, so it never
//!   overflows); [`UringEngine::submit_batch`] waits for room. Registered buffers and files are not
//!   used: the driver's buffers come and go per request, so registering them would cost more than
//!   the page pinning it saves.
//! - [`PoolEngine`]: N worker threads doing `pread`/`pwrite` (the same loops as the
//!   synchronous backend), for kernels or containers without io_uring.
//! - [`FileEngine`]: picks one ([`EngineKind`]: `uring`, `pool`, `auto`; `sync` is the
//!   driver running requests itself, without an engine).
//!
//! The kernel cancels (`ECANCELED`) the in-flight requests of a thread that exits; the
//! io_uring engine resubmits those from its reaper (positional transfers and fsync are
//! idempotent), so submitting threads may come and go.
//!
//! Callbacks run on the reaper or a worker thread; they must not panic, and should be quick.
//! They may submit more ops; from the io_uring reaper, a submission that would have to wait
//! for room fails with `WouldBlock` instead (the reaper is what makes room).

use std::io;

use blk::Error;

// Files: `op` (an op and its completion callback), `files` (the descriptors), `error` (a
// batch taken in part), the two engines `uring` and `pool`; this file picks one.
mod error;
mod files;
mod op;
pub mod pool;
pub mod uring;

pub use error::SubmitError;
pub use files::EngineFiles;
pub use op::{Callback, UringOp, UringOpKind};
pub use pool::PoolEngine;
use uring::TryNew;
pub use uring::UringEngine;

/// Which engine a `file` device runs on (spec option `engine=`), and which one
/// [`FileEngine::new`] builds. The one engine enum of the crate: the driver's choice and the
/// asynchronous engines' kind are the same thing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EngineKind {
    /// io_uring if it works here, else the thread pool.
    #[default]
    Auto,
    /// io_uring, or fail.
    Uring,
    /// The thread pool (`pread`/`pwrite` on worker threads).
    Pool,
    /// Synchronous `pread`/`pwrite` in `queue_rq`, on the submitter's thread (no
    /// asynchronous engine: [`FileEngine::new`] refuses it).
    Sync,
}

impl EngineKind {
    /// The spec spelling: `auto`, `uring`, `pool` or `sync`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Uring => "uring",
            Self::Pool => "pool",
            Self::Sync => "sync",
        }
    }
}

impl std::str::FromStr for EngineKind {
    type Err = Error;

    /// `auto`, `uring` (or `io_uring`), `pool`, `sync`.
    fn from_str(s: &str) -> Result<EngineKind, Error> {
        match s {
            "auto" => Ok(EngineKind::Auto),
            "uring" | "io_uring" => Ok(EngineKind::Uring),
            "pool" => Ok(EngineKind::Pool),
            "sync" => Ok(EngineKind::Sync),
            _ => Err(Error::Config(format!(
                "option engine: unknown engine {s:?} (expected auto, uring, pool or sync)"
            ))),
        }
    }
}

/// The file driver's asynchronous engine: io_uring or the thread pool.
#[derive(Debug)]
pub enum FileEngine {
    /// io_uring.
    Uring(UringEngine),
    /// The thread pool.
    Pool(PoolEngine),
}

impl FileEngine {
    /// Builds the engine `kind` asks for: with [`EngineKind::Auto`], io_uring (a ring of
    /// `depth` entries) when it works here, else a pool of `threads` workers.
    pub fn new(
        files: EngineFiles,
        kind: EngineKind,
        depth: u32,
        threads: usize,
        callback: Callback,
    ) -> io::Result<FileEngine> {
        match kind {
            EngineKind::Sync => Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "engine sync runs in queue_rq: it has no asynchronous engine",
            )),
            EngineKind::Pool => PoolEngine::new(files, threads, callback).map(FileEngine::Pool),
            EngineKind::Uring => UringEngine::new(files, depth, callback).map(FileEngine::Uring),
            EngineKind::Auto => match UringEngine::try_new(files, depth, callback) {
                Ok(u) => Ok(FileEngine::Uring(u)),
                Err(TryNew::Unavailable(_, files, callback)) => {
                    PoolEngine::new(files, threads, callback).map(FileEngine::Pool)
                }
                Err(TryNew::Failed(e)) => Err(e),
            },
        }
    }

    /// `"uring"` or `"pool"`.
    pub fn name(&self) -> &'static str {
        match self {
            FileEngine::Uring(_) => "uring",
            FileEngine::Pool(_) => "pool",
        }
    }

    /// Submits one op.
    pub fn submit(&self, op: UringOp, user_data: u64) -> io::Result<()> {
        match self {
            FileEngine::Uring(u) => u.submit(op, user_data),
            FileEngine::Pool(p) => p.submit(op, user_data),
        }
    }

    /// Submits a batch (see [`UringEngine::submit_batch`]).
    pub fn submit_batch(&self, ops: &[(UringOp, u64)]) -> Result<(), SubmitError> {
        match self {
            FileEngine::Uring(u) => u.submit_batch(ops),
            FileEngine::Pool(p) => p.submit_batch(ops),
        }
    }
}
