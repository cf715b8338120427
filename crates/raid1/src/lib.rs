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
//!   writes and read repair are slow paths and may allocate). A write's legs share the
//!   caller's buffer through read-only aliases ([`lend`], [`Raid1Config::share_writes`]):
//!   one payload per write in flight, plus a copy for the legs of a write behind.
//! - **The array thread** (`raid1d`) also writes superblocks after state changes (`events`
//!   bumped each time) and clears quiet bitmap bits every `tick` after a flush of every leg.
//! - **Write-behind** (`behind.rs`, [`Raid1Config::write_behind`], md's `--write-behind`):
//!   with a bitmap, a write is acknowledged once the legs that are not write-mostly have it,
//!   at most N writes staying behind on the write-mostly legs (their bits stay set until
//!   those legs have them; FUA writes and FLUSH wait for every leg).
//! - **Automatic re-add** (`readd.rs`, [`Raid1Config::readd_interval`]): raid1d probes the
//!   superblock of each leg that failed on an I/O error and re-adds it in place when it
//!   answers as this slot's leg of this array (a bitmap recovery under md's re-add rule); a
//!   leg with another history is refused, named ([`Raid1::readd_status`]) and left untouched.
//!   The same judge runs on every reconnection of a leg that reconnects by itself (a remote
//!   leg), before anything is sent on it, and fails a leg it refuses.
//!
//! # The sync thread ([`sync`])
//!
//! One per array (`raid1-sync`), started by `launch`, asleep on a `WaitQueue` when there is
//! nothing to do. Controlled as md's sysfs: [`Raid1::sync_action`] /
//! [`Raid1::set_sync_action`] ([`SyncAction`]: "idle" stops a check/repair and unfreezes,
//! "frozen" pauses, "check"/"repair" start one, "resync"/"recover" ask for one),
//! [`Raid1::set_speed_limits`] (`sync_speed_min`/`max`, defaults 1000/200000 KiB/s),
//! [`Raid1::sync_progress`] ([`SyncProgress`]: done/total, speed, ETA, `mismatch_cnt`,
//! `chunks_copied`), [`Raid1::wait_sync_idle`], [`Raid1::replace_leg`].
//!
//! Priority: resync, then recovery, then a requested check/repair. A pass walks the array
//! from its start offset in windows (a power of two of at most 1 MiB and the leg I/O limit,
//! within one bitmap chunk: never across a barrier unit). Per window:
//! `barriers().raise_barrier(sector)`, read the source (the first in-sync leg that is not
//! write-mostly, a write-mostly one only when no other is in sync; another in-sync leg on a
//! read error), write the targets (resync: the other in-sync legs; recovery: the recovering
//! leg) or compare them (check/repair: count differing 512-byte sectors into `mismatch_cnt`;
//! repair rewrites the window), `lower_barrier`, update progress, sleep if over the max speed.
//! Regular I/O keeps flowing: only the window's bucket waits, and for one window.
//!
//! - **Resync** after an unclean stop (the newest superblock is not `Clean` at assemble):
//!   the bitmap's dirty chunks (a snapshot at the start of the pass), everything without a
//!   bitmap. Reads at or past the resync point go to the source leg meanwhile.
//! - **Recovery** of a present, non-faulty leg that is not in sync: a re-add (its own
//!   superblock names this array and slot, it was in sync, and its events are not behind the
//!   bitmap's `events_cleared`, md's rule) copies only the dirty chunks; any other leg copies
//!   everything from its `recovery_offset`, which advances per window and is persisted in the
//!   superblocks every 64 windows and when interrupted, so a later `assemble` resumes it.
//!   When done: in sync, `events` bumped, superblocks written.
//! - After a successful resync/recovery the bitmap bits are cleared at once (after a flush of
//!   every leg; never while degraded) and the bitmap persisted with `events_cleared`.
//! - Speed: only the max is enforced (sleeps between windows, woken by a new limit or an
//!   interrupt); the min is reported only: the thread never yields to regular I/O beyond the
//!   barrier, so it is never slowed below it by throttling.
//!
//! Lower-level pieces stay public for tools: [`Raid1::leg_device`] (leg offsets = array
//! offsets + [`Raid1::data_offset`]), [`Raid1::fail_leg`], [`Raid1::remove_leg`],
//! [`Raid1::add_leg`] (re-add or new leg; the sync thread recovers it),
//! [`Raid1::set_recovery_offset`], [`Raid1::set_in_sync`], [`Raid1::set_write_mostly`].
//!
//! Start-up: [`Raid1::create`] formats new legs; [`Raid1::assemble`] restarts an array from its
//! legs' superblocks (newest `events` wins; stale legs come back recovering, faulty ones faulty;
//! a resync starts if it was not stopped cleanly). [`Raid1::crash_for_test`] stops an array
//! without marking it clean.
//!
//! Source files: `config.rs` ([`Raid1Config`] and its options), `error.rs` ([`Raid1Error`]),
//! `device.rs` (types, leg management, `Drop`), `add.rs` (adding a leg: re-add or fresh,
//! diverged or discarded), `generation.rs` (histories), `assemble.rs` (start-up),
//! `placement.rs` (which leg takes which slot: assembly's decision and the re-add rule),
//! `io.rs` (the I/O path), `slots.rs` (the per-I/O slots and the retry queue), `legset.rs` (a
//! set of legs), `legstate.rs` (a leg's state: a snapshot and its named transitions),
//! `failure.rs` (durable leg failures, the failed array) and `failure/durable.rs` (the failure
//! generations, held writes and failed flag they act on), `daemon.rs` (raid1d), `readd.rs`
//! (the automatic re-add's state) and `readd/probe.rs` (its probes and judgement), `behind.rs`
//! (write-behind), `lend.rs` (a write's shared payload), `events.rs` (the events and their
//! hub) and `events/array.rs` (the array's side), `resync.rs` (the sync thread's state),
//! `resync/control.rs` (its control surface) and `resync/engine.rs` (its passes), `integrity.rs`
//! (the checksums' table, algorithm and area) and `integrity/` (its I/O).
//!
//! Each part's state lives in a file that names no `device.rs` item (a leaf), and the
//! `Array` methods that act on it in a child file: no two files name each other's items.
#![warn(clippy::too_many_lines)]
#![warn(missing_docs)]

mod add;
mod assemble;
pub mod barrier;
mod behind;
pub mod bitmap;
mod chunks;
mod config;
mod daemon;
mod device;
mod error;
pub mod events;
mod failure;
pub mod generation;
pub mod integrity;
mod io;
mod legset;
mod legstate;
pub mod lend;
mod placement;
mod readd;
pub mod resync;
pub mod retire;
pub mod slot;
mod slots;
pub mod superblock;

pub use assemble::Creation;
pub use barrier::{BarrierError, BarrierMode, Barriers};
pub use bitmap::{BitmapCounts, ChunkSet, WriteIntentBitmap};
pub use config::{CompletionRef, Raid1Config, DEFAULT_READD_INTERVAL};
pub use device::{LegStatus, Raid1};
pub use error::Raid1Error;
pub use events::{Event, Record, Subscription};
pub use generation::{Kinship, Lineage};
pub use integrity::Algorithm;
pub use integrity::IntegrityCounts;
pub use placement::{Assembly, AssemblyError};
pub use readd::{AbsentError, ReaddStatus};
pub use resync::{ParseSyncActionError, SyncAction, SyncProgress};
