//! Changed-block tracking: named, persistent dirty bitmaps over any blkq block device.
//!
//! A backup tool asks which blocks changed since its last backup and copies only those. An
//! export's [`Bitmaps`] record, per name, every granule written, trimmed or zeroed since the
//! bitmap was created or last cleared; [`Tracked`] is the [`blk::Device`] wrapper that counts
//! the writes and answers [`blk::Device::dirty_bitmaps`] for the NBD server's
//! `qemu:dirty-bitmap:NAME` context.
//!
//! The discipline is the write-intent bitmap's (crates/raid1/src/bitmap.rs): **set, make
//! durable, then write**. A write to a clean granule first persists the page of the sidecar
//! holding its bit (pwrite + fdatasync, concurrent first writes batched into one sync); a write
//! to a granule already durable costs one atomic load per bitmap. So after a SIGKILL or a power
//! loss the bitmap on disk is a superset of the changes, never a subset. Unlike the
//! write-intent bitmap, bits are never cleared behind the user's back: only `clear`, `remove`
//! and `rotate` start afresh, which is why a bitmap here is atomic words and not a locked chunk
//! table.
//!
//! The pieces, one file each:
//! - `bits.rs`: one bitmap in memory (atomic `dirty` and `durable` words);
//! - `gate.rs`: which bitmaps a write counts in, switched atomically by management, with the
//!   wait that makes `rotate` exact; a locked twin behind [`Mode`];
//! - `commit.rs`: group commit of newly set bits to the store;
//! - `sink.rs`: the store the committer writes to (the sidecar, or nothing in memory);
//! - `sidecar.rs`: the on-disk format (double-buffered header, checksummed pages), and the
//!   copies of a mirror's sidecar kept together (`Sidecars`);
//! - `identity.rs`: which image a sidecar belongs to;
//! - `bitmaps.rs`: management (`add`, `remove`, `clear`, `rotate`, `list`) and the order of its
//!   durable steps; `bitmaps/open.rs`: opening them (a sidecar loaded or reset, a mirror's
//!   copies);
//! - `tracked.rs`: the device wrapper.
#![warn(missing_docs)]
#![warn(clippy::too_many_lines)]

pub mod bitmaps;
pub mod bits;
pub mod commit;
pub mod gate;
pub mod identity;
pub mod sidecar;
pub mod sink;
pub mod tracked;

use std::path::PathBuf;

pub use bitmaps::{check_name, Bitmaps, Image, Info, Options, Store};
pub use bits::{DEFAULT_GRANULARITY, MAX_GRANULARITY, MIN_GRANULARITY};
pub use gate::Mode;
pub use sidecar::Identity;
pub use tracked::Tracked;

/// Errors of changed-block tracking. Each names the bitmap or the sidecar it is about.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// `add` or `rotate` to a name already taken.
    #[error("dirty bitmap {0:?} already exists")]
    Exists(String),
    /// No bitmap of that name.
    #[error("no dirty bitmap {0:?}")]
    NotFound(String),
    /// A name that is empty, too long, or has spaces or control characters.
    #[error(
        "bad dirty bitmap name {0:?}: 1 to {max} bytes, no spaces or control characters",
        max = sidecar::MAX_NAME
    )]
    BadName(String),
    /// A granularity outside the allowed range.
    #[error("bad granularity {0}: a power of two from 4 KiB to 64 MiB")]
    BadGranularity(u64),
    /// `rotate` from a bitmap that is already frozen.
    #[error("dirty bitmap {0:?} is frozen (rotated away); rotate from the recording one")]
    Frozen(String),
    /// Too many bitmaps on one export.
    #[error("too many dirty bitmaps on this export (at most {0})")]
    TooMany(usize),
    /// The image had bitmaps but their sidecar is gone.
    #[error(
        "bitmap sidecar {0} is missing, but the image had dirty bitmaps: restore it, or start \
         with --bitmaps-reset to begin without them (the next backups must be full ones)"
    )]
    Missing(PathBuf),
    /// The sidecar fails its checks (a torn write, a truncated file).
    #[error(
        "bitmap sidecar {0} is torn: {1}; start with --bitmaps-reset to replace it with \
         all-dirty bitmaps (the next backups are full ones)"
    )]
    Torn(PathBuf, String),
    /// The sidecar belongs to another image.
    #[error(
        "bitmap sidecar {0} belongs to another image: {1}; start with --bitmaps-reset to \
         replace it with all-dirty bitmaps (the next backups are full ones)"
    )]
    Foreign(PathBuf, String),
    /// A bitmap's memory (two bits per granule) cannot be allocated.
    #[error(
        "dirty bitmap {name:?}: {bytes} bytes of memory for {capacity} bytes at {granularity} \
         bytes per bit cannot be allocated; give a larger granularity"
    )]
    NoMemory {
        /// The bitmap.
        name: String,
        /// The export's size, bytes.
        capacity: u64,
        /// Bytes per bit.
        granularity: u64,
        /// The memory it needs, bytes.
        bytes: u64,
    },
    /// Bits a merge set could not be made durable (the store failed).
    #[error("{0}")]
    Persist(String),
    /// `merge` of a bitmap into itself.
    #[error("dirty bitmap {0:?} cannot be merged into itself")]
    SelfMerge(String),
    /// Reading or writing the sidecar (or the image's attribute) failed.
    #[error("bitmap sidecar {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What failed.
        #[source]
        source: std::io::Error,
    },
}

impl Error {
    /// The errno for this error (NBD replies, the control socket).
    pub fn errno(&self) -> i32 {
        match self {
            Error::Exists(_) => libc::EEXIST,
            Error::NoMemory { .. } => libc::ENOMEM,
            Error::NotFound(_) | Error::Missing(_) => libc::ENOENT,
            Error::Io { source, .. } => source.raw_os_error().unwrap_or(libc::EIO),
            Error::Persist(_) => libc::EIO,
            _ => libc::EINVAL,
        }
    }
}
