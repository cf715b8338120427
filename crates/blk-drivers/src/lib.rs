//! `blk-drivers`: the block drivers of blkq, on top of the `blk` core.
//!
//! - [`null`]: the reference driver (null_blk's model): no data, completions inline, on a
//!   thread, or after a timer. Read it first.
//! - [`mem`]: requests executed on an in-memory store: one reserved mapping
//!   ([`backend::MapBackend`], the default) or sparse pages ([`backend::MemBackend`]).
//! - [`file`](mod@file): a regular file or block device through one of the engines of [`engine`]
//!   (io_uring, a thread pool, or synchronous; one [`EngineKind`] picks).
//! - [`rbd`]: a Ceph RBD image through librbd's asynchronous API (in builds with librbd).
//! - [`backend`]: where the bytes live (memory, file), synchronous and thread-safe.
//! - [`spec`]: the device-spec parser (`null:1G,completion=thread`, `file:/path,engine=pool`)
//!   that builds a queue with one of these drivers.
//!
//! Drivers use only `blk`'s public API ([`blk::Driver`], [`blk::RequestQueue`],
//! [`blk::RequestToken`]); nothing here reaches into the core's internals.
#![warn(missing_docs)]
#![warn(clippy::too_many_lines)]

pub mod backend;
pub mod engine;
pub mod fault;
mod fd_io;
pub mod file;
mod kind_options;
pub mod mem;
pub mod null;
pub mod rbd;
pub mod spec;

pub use backend::{exec_on_backend, Backend, FileBackend, FileOptions, MapBackend, MemBackend};
pub use engine::{EngineKind, FileEngine, PoolEngine, UringEngine};
pub use fault::{FaultConfig, FaultDevice, FaultHandle};
pub use file::{FileDriver, FileDriverConfig};
pub use mem::{BackendDriver, MemStore};
pub use null::{CompletionMode, NullConfig, NullDriver};
pub use spec::{parse_size, DeviceSpec, QueueOverrides};
