//! Storage backends: where the bytes of the `mem` and `file` drivers live: [`MapBackend`]
//! (`mem:` devices' default, `store=map`), [`MemBackend`] (`store=pages`), [`FileBackend`].
//!
//! A backend is synchronous and thread-safe: the driver decides on which thread (the
//! submitter's, a completion thread, io_uring's reaper) each operation runs. Offsets and
//! lengths are in bytes; callers have validated them against [`Backend::size`].

// Files: `store` (the `Backend` trait and the range check of its implementations), `exec` (a
// bio run on a backend), `extents` (building an allocation map), `splice_gate` (a driver's
// zero-copy switch), `stream` (copies that bypass the caches), then the stores: `map`, `mem`
// (with `home`, the region gate of the receivers writing straight into them), `file` (with
// `host` and `splice_in`).
mod exec;
mod extents;
pub mod file;
pub mod home;
mod host;
pub mod map;
pub mod mem;
mod splice_gate;
mod splice_in;
mod store;
mod stream;

pub use exec::exec_on_backend;
pub use file::{FileBackend, FileOptions};
pub use map::MapBackend;
pub use mem::MemBackend;
pub(crate) use splice_gate::SpliceGate;
pub use store::Backend;

pub use blk::error::os_error_code;
pub use blk::Extent;
