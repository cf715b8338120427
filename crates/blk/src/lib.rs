//! `blk`: blkq's block layer core. Bios and buffers, tag sets with preallocated requests,
//! request queues with per-submitter plugging and the pool-full policy (steal, FIFO hand-off,
//! batch ownership), I/O schedulers (`none`, `mq-deadline` with its `locked`/`serialized`
//! lock: [`sched`]), disk statistics, and the seams everything else plugs into: the
//! [`Device`] trait ([`device`]) and the [`Filter`] a device stacked on another implements
//! ([`filter`]), and the queue's callbacks, [`Driver`] ([`queue`]) and
//! [`Scheduler`] ([`sched`]), on top of `sbitmap`'s tags and `waitq`'s wait queues.
//!
//! The drivers (`null`, `mem`, `file` with its io_uring / thread-pool / synchronous engines)
//! and the device-spec parser live in the `blk-drivers` crate: a driver is a user of this
//! crate's public API, exactly as an out-of-tree driver would be.
#![warn(missing_docs)]
#![warn(clippy::too_many_lines)]

pub mod bio;
pub mod device;
pub mod dirty;
pub mod error;
pub mod files;
pub mod filter;
pub mod home;
pub mod queue;
pub mod sched;
pub mod stats;
pub mod tags;

pub use bio::{Bio, BioFlags, Buffer, BufferPool, EndIo, IoPrio, Op, SECTOR_SHIFT, SECTOR_SIZE};
pub use device::{
    submit_wait, submit_wait_until, Caps, ConnectCheck, Device, Extent, Limits, PendingBio,
};
pub use dirty::{DirtyBitmaps, DirtyExtent};
pub use error::Error;
pub use filter::Filter;
pub use home::RecvSource;
pub use queue::{Driver, Plug, Queue, QueueConfig, Request, RequestQueue, RequestToken};
pub use sched::Scheduler;
pub use stats::{QueueStats, SchedStats};
pub use tags::{PoolPolicy, TagPool};
