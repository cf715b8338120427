//! `raid1`: a mirror over two or more blkq block devices (legs).
//!
//! - [`barrier`]: md's barrier buckets keeping regular I/O and resync windows apart, with the
//!   lockless fast path (and the locked algorithm as a run-time switch).
#![warn(missing_docs)]

pub mod barrier;

pub use barrier::{BarrierError, BarrierMode, Barriers};
pub mod bitmap;
mod device;
pub mod superblock;

pub use device::{LegStatus, Raid1, Raid1Config, Raid1Error};
