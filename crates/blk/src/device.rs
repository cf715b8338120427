//! What a block device offers: [`Device`] (what the NBD server exports and RAID1 stacks on),
//! its [`Limits`] and [`Extent`] map, and the one way to submit a bio and wait for it
//! ([`submit_wait`], [`PendingBio`]). A [`crate::Queue`] is a `Device`; the traits it calls
//! back, [`crate::Driver`] and [`crate::Scheduler`], live beside it ([`crate::queue`],
//! [`crate::sched`]).

use std::os::fd::BorrowedFd;
use std::time::Instant;

use blkq_sync::DynArc as Arc;
use blkq_sync::Mutex;
use waitq::WaitQueue;

use crate::bio::{Bio, EndIo, Op, SECTOR_SHIFT};
use crate::stats::QueueStats;
use crate::Error;

/// One extent of an allocation map: `len` bytes from `offset`, allocated or a hole.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    /// Start, bytes.
    pub offset: u64,
    /// Length, bytes.
    pub len: u64,
    /// `false`: never written, or discarded (reads as zeros).
    pub allocated: bool,
}

/// What a device can do beyond the bio path, and what its answers cost: one value, declared by
/// the device ([`Device::caps`]) and forwarded unchanged by a filter that does not change it
/// ([`crate::Filter`]). `Default`: nothing (a local device that serves bios only).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Caps {
    /// [`Device::splice_read`] works: zero-copy reads.
    pub splice: bool,
    /// [`Device::recv_home`] works: writes received into their home.
    pub recv_home: bool,
    /// Asking the allocation map ([`Device::extents_into`]) costs I/O: a round trip to a
    /// remote server (or, for a mirror, possibly to a leg that is one). The NBD server then
    /// does not ask it on every read (sparse reads off: holes reach the client as zeros), as
    /// the synchronous ask would stall the connection's reader behind each read.
    pub slow_extents: bool,
}

impl Caps {
    /// What a layer that sees only bios leaves of `self`: the zero-copy paths carry no bio
    /// and would pass it by, so they are off; the rest stands.
    pub fn bios_only(self) -> Self {
        Self {
            splice: false,
            recv_home: false,
            ..self
        }
    }
}

/// Limits a device advertises and the queue enforces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Size in bytes.
    pub capacity: u64,
    /// Smallest addressable unit, bytes (a power of two, >= 512).
    pub logical_block_size: u32,
    /// Largest read or write, bytes.
    pub max_io_bytes: u32,
}

impl Limits {
    /// Checks a bio against the limits.
    pub fn validate(&self, bio: &Bio) -> Result<(), Error> {
        if bio.op == Op::Flush {
            return Ok(());
        }
        let lbs = u64::from(self.logical_block_size);
        let off = bio
            .sector
            .checked_mul(1 << SECTOR_SHIFT)
            .ok_or(Error::OutOfRange {
                offset: u64::MAX,
                len: u64::from(bio.len),
                capacity: self.capacity,
            })?;
        let len = u64::from(bio.len);
        if len == 0 || off % lbs != 0 || len % lbs != 0 {
            return Err(Error::Misaligned {
                offset: off,
                len,
                block: self.logical_block_size,
            });
        }
        if off.checked_add(len).is_none_or(|end| end > self.capacity) {
            return Err(Error::OutOfRange {
                offset: off,
                len,
                capacity: self.capacity,
            });
        }
        if bio.op.has_data() {
            if bio.len > self.max_io_bytes {
                return Err(Error::TooLarge {
                    len,
                    max: self.max_io_bytes,
                });
            }
            if let Some(b) = &bio.buf {
                if b.len() < bio.len as usize {
                    return Err(Error::BufferTooSmall {
                        len,
                        buf: b.len() as u64,
                    });
                }
            }
        }
        Ok(())
    }
}

/// A bio-level block device: what the NBD server exports and what RAID1 stacks on.
pub trait Device: Send + Sync {
    /// Submits a bio; `end.end_io` is called exactly once with its status (possibly before
    /// this returns, possibly on another thread).
    fn submit(&self, bio: Bio, end: &Arc<dyn EndIo>);
    /// Submits several bios as one batch (drivers see them together).
    fn submit_batch(&self, bios: &mut dyn Iterator<Item = Bio>, end: &Arc<dyn EndIo>) {
        for b in bios {
            self.submit(b, end);
        }
    }
    /// The device's limits.
    fn limits(&self) -> Limits;
    /// The allocation map of `[offset, offset + len)` into a caller-owned vector: `out` is
    /// cleared, then filled in order with at most `max` extents (the last may stop short of
    /// the range's end). What the request path calls (NBD block status and sparse reads),
    /// with one vector per connection reused from call to call, so that a call allocates
    /// nothing once the vector has grown to `max` (the `pages` store's walk over a mostly
    /// sparse range is the exception: it collects and sorts the allocated pages).
    fn extents_into(
        &self,
        offset: u64,
        len: u64,
        max: usize,
        out: &mut Vec<Extent>,
    ) -> Result<(), Error>;

    /// The allocation map of a range, in a new vector: [`Device::extents_into`] for callers
    /// off the request path (tests, tools). Allocates.
    fn extents(&self, offset: u64, len: u64, max: usize) -> Result<Vec<Extent>, Error> {
        let mut out = Vec::new();
        self.extents_into(offset, len, max, &mut out)?;
        Ok(out)
    }

    /// What the device can do beyond the bio path, and what its answers cost ([`Caps`];
    /// default: nothing, a local device). Asked per request where it matters (a read asks
    /// whether to splice, a write whether to receive into its home): a device may turn a
    /// capability off at run time (after a failed splice), and the next ask sees it off.
    fn caps(&self) -> Caps {
        Caps::default()
    }

    /// A zero-copy read: moves up to `len` bytes of the device at `offset` into
    /// the pipe whose write end is `pipe`, by reference where the host allows (`splice(2)`
    /// from a file's page cache, `vmsplice(2)` from a memory device's mapping), and returns
    /// how many bytes it moved (fewer when the pipe is full; 0 only for `len` 0).
    ///
    /// What the pipe then holds are references to pages that stay the device's: the bytes
    /// that reach the reader are those of the moment the pipe is drained, not of this call.
    /// So a caller must drain the pipe before it reports the read complete, as the NBD
    /// server does (a reply is complete only once the client has all of it): any write that
    /// completed before this call is in the bytes, and only writes concurrent with the read
    /// can show, which a block device leaves undefined. No bio: no tag, no scheduler; the
    /// queue counts it in the disk statistics as one read.
    fn splice_read(
        &self,
        _offset: u64,
        _len: usize,
        _pipe: BorrowedFd<'_>,
    ) -> Result<usize, Error> {
        Err(Error::Io(std::io::ErrorKind::Unsupported.into()))
    }

    /// A write received into its home ([`crate::home`]): receives `len` bytes from
    /// `src`'s socket straight into the device at `offset`, with no buffer in between, and
    /// returns once all of them are in place (visible to reads, as a completed write is).
    ///
    /// The range is the caller's to validate first (in range, aligned, the export writable):
    /// no byte may land outside it. No bio: no tag, no scheduler; the queue counts it in the
    /// disk statistics as one write. Not durable by itself (no FUA): a caller that needs
    /// durability sends such writes through bios. On an error (the peer closed halfway, a
    /// timeout) the bytes received so far are in the device: a torn write, which a block
    /// device allows for a write it never acknowledged; whatever the device holds to protect
    /// its memory from concurrent trims is released either way.
    fn recv_home(
        &self,
        _offset: u64,
        _len: usize,
        _src: &mut dyn crate::RecvSource,
    ) -> Result<(), Error> {
        Err(Error::Io(std::io::ErrorKind::Unsupported.into()))
    }

    /// The device's own disk counters (`/sys/block/*/stat`), read on demand (a snapshot
    /// summed over shards, never on the I/O path). Default: none, which tells a user such as
    /// the NBD server to count at its own layer; a queue has them, and a filter forwards the
    /// lower device's ([`crate::Filter`]).
    fn stats(&self) -> Option<crate::stats::DiskStats> {
        None
    }
    /// The statistics only a request queue keeps (tag waits per hardware context, the
    /// scheduler's lock contention), read on demand off the I/O path. Default: none (the
    /// device is no queue); a filter forwards the lower device's.
    fn queue_stats(&self) -> Option<QueueStats> {
        None
    }
    /// The device's named dirty bitmaps (changed-block tracking), if it keeps any. Default:
    /// none. A wrapping device forwards its inner device's.
    fn dirty_bitmaps(&self) -> Option<&dyn crate::DirtyBitmaps> {
        None
    }
    /// For a device that connects again to what backs it (a remote export whose server went
    /// away and came back): has `check` judge every later connection before the device
    /// serves on it, before anything (a request waiting, a re-send) is sent on it; `None`
    /// removes it. Returns whether the device reconnects at all (default: it does not, and
    /// `check` is dropped). A wrapping device forwards it.
    fn check_connections(&self, _check: Option<Arc<dyn ConnectCheck>>) -> bool {
        false
    }
    /// Whether the device knows, with no I/O asked of it, that it cannot serve now: a remote
    /// device whose connection has been down past its reconnect deadline (every request then
    /// fails at once). A mirror fails such a leg at its next tick, as if a write had failed
    /// on it, so that the leg's bits stay set and its return is a re-add. Read off the I/O
    /// path (a mirror's background thread). Default: no.
    fn unavailable(&self) -> bool {
        false
    }
}

/// What a device that reconnects asks of each new connection before it serves on it
/// ([`Device::check_connections`]): the owner reads who answers. A mirror installs one on each
/// remote leg, so a leg's server that comes back with another array's leg, another slot's, or
/// a history that went on without the mirror is refused instead of served.
pub trait ConnectCheck: Send + Sync {
    /// The bytes to read through the new connection: (offset, length), in bytes.
    fn range(&self) -> (u64, usize);
    /// Judges those bytes: `Ok` serves on the connection; `Err(why)` refuses it, and the
    /// device then fails every request, now and later, with `why` in the errors. Called on
    /// the device's own thread: it must not wait for the device's I/O.
    fn check(&self, bytes: &[u8]) -> Result<(), String>;
    /// A connection broke with writes on it that the server acknowledged and no flush
    /// covered: the server may have lost them (a restart that emptied its cache), so what it
    /// serves may have rolled back. Called before anything more is served: returns whether
    /// the owner takes this over (a mirror fails the leg, whose bits stay set, so its return
    /// is a recovery); the device then fails every request that waits for a connection
    /// instead of serving it. Called on the device's own thread: no I/O of the device. Default:
    /// not taken (the device's next flush fails instead, once).
    fn lost_writes(&self) -> bool {
        false
    }
}

/// A bio submitted by a thread that will wait for it: [`PendingBio::submit`], then
/// [`PendingBio::wait`] or [`PendingBio::wait_until`]. For slow paths (superblock and bitmap
/// I/O, resync, repair, tools, shutdown flushes, tests): each one allocates its completion.
/// Submitting several, then waiting for each, has them in flight together.
///
/// The wait sleeps on a [`WaitQueue`] (waitq is the one way to sleep): `end_io` stores the
/// result under the lock, drops the lock, then wakes; the waiter's `wait_for` arms before its
/// re-check, so a completion that lands between the check and the sleep is not lost.
#[must_use = "a submitted bio is waited for with `wait` or `wait_until`"]
pub struct PendingBio {
    end: Arc<WaitEnd>,
}

/// The completion a [`PendingBio`] waits on. A waiter that gave up (`wait_until`) leaves it
/// to the device, which drops it after `end_io`.
#[derive(Default)]
struct WaitEnd {
    out: Mutex<Option<(Bio, Result<(), Error>)>>,
    wq: WaitQueue,
}

impl EndIo for WaitEnd {
    fn end_io(&self, bio: Bio, res: Result<(), Error>) {
        *self.out.lock() = Some((bio, res));
        // Woken outside the lock. `self` stays alive through the device's clone of the `Arc`
        // until this returns, even if the waiter has already taken the result and left.
        self.wq.wake_one();
    }
}

impl PendingBio {
    /// Submits `bio` to `dev`.
    pub fn submit(dev: &dyn Device, bio: Bio) -> Self {
        let end = Arc::new(WaitEnd::default());
        let e: Arc<dyn EndIo> = end.clone();
        dev.submit(bio, &e);
        Self { end }
    }

    /// Waits for the completion; returns the bio (with its buffer) and its status.
    pub fn wait(self) -> (Bio, Result<(), Error>) {
        self.end.wq.wait_for(|| self.end.out.lock().take())
    }

    /// Like [`PendingBio::wait`], giving up at `deadline` (`None`: still in flight; the device
    /// completes it later into nothing).
    pub fn wait_until(self, deadline: Instant) -> Option<(Bio, Result<(), Error>)> {
        self.end
            .wq
            .wait_for_until(|| self.end.out.lock().take(), deadline)
    }
}

/// Submits `bio` to `dev` and waits for its completion; returns the bio (with its buffer) and
/// its status. A slow-path helper: it allocates ([`PendingBio`]).
pub fn submit_wait(dev: &dyn Device, bio: Bio) -> (Bio, Result<(), Error>) {
    PendingBio::submit(dev, bio).wait()
}

/// Like [`submit_wait`], giving up at `deadline` (`None`: the bio is still in flight).
pub fn submit_wait_until(
    dev: &dyn Device,
    bio: Bio,
    deadline: Instant,
) -> Option<(Bio, Result<(), Error>)> {
    PendingBio::submit(dev, bio).wait_until(deadline)
}
