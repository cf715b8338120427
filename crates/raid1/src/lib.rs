//! `raid1`: a mirror (md RAID1) over two or more blkq block devices ("legs").
//!
//! # Pieces
//!
//! - [`barrier`]: md's barrier buckets, keeping regular I/O and resync windows apart and
//!   freezing the array, with the lockless fast path (regular I/O touches only atomics unless
//!   a barrier or freeze is active on its bucket) and the locked algorithm as a run-time
//!   switch ([`BarrierMode`], spec option `barrier=locked`). Every ordering rule of the review
//!   of md's lockless patch is written next to the code; loom models in
//!   `tests/loom_barrier.rs` check both modes, and that the fast path fails without its fence.
//! - [`superblock`]: one 4 KiB superblock per leg at 4 KiB (md 1.2's place), explicit
//!   little-endian fields and crc32c; data from a 1 MiB-aligned offset after the bitmap.
//! - [`bitmap`]: the write-intent bitmap (default 64 MiB chunks): a bit is set and durable on
//!   every leg before the first write into its chunk is issued; bits are cleared lazily (quiet,
//!   completed, flushed on every leg) and never while degraded, so a returning leg copies only
//!   the dirty chunks.
//! - [`Raid1`]: the `blk::Device`.
//!
//! # The device
//!
//! - **Writes** (and discard / write-zeroes) pass `wait_barrier`, then the bitmap (persisting
//!   it synchronously when a bit is new), then go to every present, non-faulty leg (recovering
//!   legs included): the first leg gets the caller's buffer, the others copies from a
//!   [`blk::BufferPool`]. They complete when every leg has; a leg whose write fails is marked
//!   faulty and the write succeeds if any leg took it (the last in-sync leg is never failed:
//!   its error reaches the caller). FUA is kept on every leg bio; FLUSH goes to every leg.
//! - **Reads** pass `wait_read_barrier` and go to one leg: the leg whose last read ended where
//!   this one starts (a sequential stream stays put), else the leg with the fewest requests in
//!   flight; write-mostly legs only when nothing else can serve; a recovering leg only below
//!   its recovery offset. A failed read is queued (`queue_io`) for the array thread (md's
//!   raid1d), which freezes the array (`freeze_array(1)`), reads the range from another leg,
//!   rewrites it on the legs that failed (failing a leg whose rewrite fails), counts the read
//!   error against the leg (over `read_error_limit` the leg is failed), unfreezes and
//!   completes the read.
//! - **Per-I/O state** comes from a preallocated pool of `depth` slots (the bio cookie of each
//!   leg bio names the slot; one preallocated completion object per leg); no heap allocation
//!   per I/O in the steady state (copy buffers are pooled; the bitmap persist, superblock
//!   writes and read repair are slow paths and may allocate).
//! - **The array thread** (`raid1d`) also writes superblocks after state changes (`events`
//!   bumped each time) and clears quiet bitmap bits every `tick` after a flush of every leg.
//!
//! # For the resync thread and the control socket (built on top)
//!
//! Resync of a window: `barriers().raise_barrier(sector)`; read from a good leg and write the
//! others with [`Raid1::leg_device`] (leg offsets = array offsets + [`Raid1::data_offset`]);
//! `barriers().lower_barrier(sector)`; one window per bucket at a time. What to copy after a
//! leg returns: [`bitmap::WriteIntentBitmap::dirty_chunks`] (a fresh leg needs everything).
//! Leg management at run time: [`Raid1::fail_leg`], [`Raid1::remove_leg`] (faulty or
//! recovering legs, under a freeze), [`Raid1::add_leg`] (into an empty slot, as recovering),
//! [`Raid1::set_recovery_offset`], [`Raid1::set_in_sync`], [`Raid1::set_write_mostly`].
//!
//! Start-up: [`Raid1::create`] formats new legs; [`Raid1::assemble`] restarts an array from its
//! legs' superblocks (newest `events` wins; stale legs come back recovering, faulty ones faulty).
//!
//! Not here yet: resync/recovery/check/repair threads, the `blkq raid` tools, the control socket.
#![warn(missing_docs)]

mod assemble;
pub mod barrier;
pub mod bitmap;
mod daemon;
mod device;
mod io;
pub mod superblock;
pub mod sync;

pub use barrier::{BarrierError, BarrierMode, Barriers};
pub use bitmap::{ChunkSet, WriteIntentBitmap};
pub use device::{LegStatus, Raid1, Raid1Config, Raid1Error};
pub use sync::{ParseSyncActionError, SyncAction, SyncProgress};
