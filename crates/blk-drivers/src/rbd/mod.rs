//! The `rbd` driver: a Ceph RBD image as a block device, through librbd's asynchronous C API.
//!
//! A spec `rbd:POOL/IMAGE` with options `conf=PATH` (the cluster's `ceph.conf`; default:
//! librados' own search, `$CEPH_CONF` then `/etc/ceph/ceph.conf`), `id=NAME` (the client's
//! name, default `admin`), `keyring=PATH`, `snap=NAME` (open that snapshot, read-only),
//! `ro=0|1`, `lock=on|off`, `timeout=SECS` and `completion=poll|callback`.
//!
//! # Data path
//!
//! `queue_rq` hands the request's bio to librbd (`rbd_aio_read`, `rbd_aio_write`,
//! `rbd_aio_discard`, `rbd_aio_write_zeroes`, `rbd_aio_flush`) with a completion whose
//! callback argument is the request's *slot*: one per request of the queue, allocated when the
//! queue starts, so nothing of ours is allocated per I/O (librbd allocates its own
//! completion). The request's token is given up to the slot as its bare index, and the bio
//! stays in its request cell, so a read lands straight in the bio's buffer and a write is
//! sent from it. How the completions come back is the `completion=` option:
//!
//! - `poll` (the default): the completions are created without a callback, and librbd queues
//!   them and signals an eventfd registered with the image (`rbd_set_image_notification`). One
//!   completion thread per device waits on it and takes them in batches of up to
//!   [`poll::POLL_BATCH`] (`rbd_poll_io_events`, into an array the thread owns), completing each
//!   batch's requests under one clock read of the queue's statistics ([`blk::stats::ClockBatch`],
//!   as every driver's completion thread does). [`poll`]'s docs state the invariants.
//! - `callback`: librbd calls our callback once per completion, on its own finisher thread,
//!   which rebuilds the token and completes that one request there. The simpler path, kept
//!   beside the batched one.
//!
//! Either way no thread per request. A FUA write (or discard, or write-zeroes) is that op, then
//! a flush issued when it has completed (from the completion thread, or from the op's
//! callback); the request completes with the flush. A flush is `rbd_aio_flush` (librbd's cache, when the cluster's
//! configuration turns it on, is written back; the OSDs acknowledge a write once it is
//! durable).
//!
//! # Limits
//!
//! The device's capacity is the image's size; the largest I/O defaults to the image's object
//! size (`max_io=` overrides it).
//!
//! # One user at a time
//!
//! Unless `lock=off` (or read-only), the driver takes the image's exclusive lock
//! (`rbd_lock_acquire`, which needs the image's `exclusive-lock` feature, on by default)
//! right after opening it, and keeps it until the device is closed: a lock taken this way is
//! not handed over when another client asks for it, so a second blkq (or any librbd client
//! that writes) on the same image is refused, as `file:` refuses a second user with `flock`.
//!
//! # Timeouts
//!
//! By default a request waits as long as the cluster takes (an OSD that restarts: the request
//! is resent to it and completes). With `timeout=SECS` librados gives up after that long
//! (`rados_osd_op_timeout`) and the request fails with `ETIMEDOUT`.
//!
//! # Allocation map
//!
//! [`blk::Device::extents_into`] asks librbd (`rbd_diff_iterate2` since the image's creation):
//! ranges that librbd reports hold no data are holes.
//!
//! # Building
//!
//! The driver is compiled when the crate's `rbd` feature is on and `build.rs` finds librbd's
//! header and library (`cfg(blkq_rbd)`); otherwise the spec still parses, and opening it fails
//! with [`NOT_BUILT`].

// Files: `config` (the target and options), `driver` (the driver), `ffi` (librbd's C API),
// `poll` (the completion thread); this file opens the driver for a spec.
mod config;
#[cfg(blkq_rbd)]
mod driver;
#[cfg(blkq_rbd)]
mod ffi;
#[cfg(blkq_rbd)]
pub mod poll;

pub use config::{CompletionMode, RbdConfig};
#[cfg(blkq_rbd)]
pub use driver::RbdDriver;

use blk::Error;

/// Whether this build has the `rbd` driver (librbd was found at build time).
pub const AVAILABLE: bool = cfg!(blkq_rbd);

/// What opening an `rbd:` spec says when the build has no librbd.
pub const NOT_BUILT: &str = "this blkq was built without librbd, so rbd: devices are not \
     available: install librbd-dev (apt-get install librbd-dev) and rebuild with the `rbd` \
     feature (on by default)";

/// The `rbd:POOL/IMAGE` kind ([`crate::spec::KINDS`]): `conf=` and `keyring=` are paths, and
/// `snap=` opens the image read-only.
pub(crate) const KIND: crate::kind_options::Kind = crate::kind_options::Kind {
    name: "rbd",
    form: "rbd:POOL/IMAGE",
    parse: |_, arg, read_only| {
        let target = RbdConfig::parse_target(arg)?;
        Ok(Box::new(SpecOptions::new(target, read_only)))
    },
    arg_is_path: false,
    path_options: &["conf", "keyring"],
    read_only_options: &["snap"],
    warning: None,
};

/// An `rbd:` spec's options: `ro` (`read_only`), `lock`, and the target's own
/// ([`RbdConfig::set`]).
pub(crate) struct SpecOptions(RbdConfig);

impl SpecOptions {
    /// The target's defaults (`read_only`: the command line's `--read-only`).
    pub(crate) fn new(target: RbdConfig, read_only: bool) -> Self {
        Self(RbdConfig {
            read_only,
            ..target
        })
    }
}

impl crate::kind_options::KindOptions for SpecOptions {
    fn set(&mut self, k: &str, v: &str) -> Result<bool, Error> {
        match k {
            "ro" | "read_only" => self.0.read_only |= crate::kind_options::parse_bool(k, v)?,
            "lock" => self.0.no_lock = !crate::kind_options::parse_bool(k, v)?,
            k => return self.0.set(k, v),
        }
        Ok(true)
    }

    fn open(
        self: Box<Self>,
        cfg: &mut blk::QueueConfig,
        max_io_given: bool,
    ) -> Result<Box<dyn blk::Driver>, Error> {
        let (driver, size, obj_size) = open(&self.0)?;
        cfg.limits.capacity = size;
        if !max_io_given {
            // One object per I/O by default, at least a block, at most u32.
            cfg.limits.max_io_bytes = u32::try_from(obj_size)
                .unwrap_or(u32::MAX)
                .max(cfg.limits.logical_block_size);
        }
        Ok(driver)
    }
}

/// The driver of `cfg`, opened (connects to the cluster, opens the image, takes the lock), and
/// the image's size and object size. Fails with [`NOT_BUILT`] in a build without librbd.
#[cfg(blkq_rbd)]
pub fn open(cfg: &RbdConfig) -> Result<(Box<dyn blk::Driver>, u64, u64), Error> {
    let d = RbdDriver::open(cfg)?;
    let (size, obj) = (d.size(), d.object_size());
    Ok((Box::new(d), size, obj))
}

/// The driver of `cfg`: in this build (without librbd), always the error [`NOT_BUILT`].
#[cfg(not(blkq_rbd))]
pub fn open(cfg: &RbdConfig) -> Result<(Box<dyn blk::Driver>, u64, u64), Error> {
    Err(Error::Config(format!("{cfg}: {NOT_BUILT}")))
}
