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

#[cfg(blkq_rbd)]
mod driver;
#[cfg(blkq_rbd)]
mod ffi;
#[cfg(blkq_rbd)]
pub mod poll;

#[cfg(blkq_rbd)]
pub use driver::RbdDriver;

use std::fmt;
use std::path::PathBuf;

use blk::Error;

/// Whether this build has the `rbd` driver (librbd was found at build time).
pub const AVAILABLE: bool = cfg!(blkq_rbd);

/// What opening an `rbd:` spec says when the build has no librbd.
pub const NOT_BUILT: &str = "this blkq was built without librbd, so rbd: devices are not \
     available: install librbd-dev (apt-get install librbd-dev) and rebuild with the `rbd` \
     feature (on by default)";

/// How librbd's completions reach the queue (`completion=`, module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CompletionMode {
    /// One completion thread per device polls them in batches.
    #[default]
    Poll,
    /// librbd's callback completes each request on librbd's own thread.
    Callback,
}

/// An `rbd:` device's target and options (module docs).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RbdConfig {
    /// The pool.
    pub pool: String,
    /// The image.
    pub image: String,
    /// `conf=`: the cluster's configuration file.
    pub conf: Option<PathBuf>,
    /// `id=`: the client's name, without `client.`.
    pub id: Option<String>,
    /// `keyring=`.
    pub keyring: Option<PathBuf>,
    /// `snap=`: a snapshot, opened read-only.
    pub snap: Option<String>,
    /// `ro=1`.
    pub read_only: bool,
    /// `lock=off`: do not take the exclusive lock.
    pub no_lock: bool,
    /// `timeout=SECS`: librados' operation timeout (0 or absent: wait forever).
    pub timeout_secs: Option<u32>,
    /// `completion=poll|callback`.
    pub completion: CompletionMode,
}

impl RbdConfig {
    /// Parses the target of `rbd:POOL/IMAGE`.
    pub fn parse_target(arg: &str) -> Result<Self, Error> {
        match arg.split_once('/') {
            Some((pool, image))
                if !pool.is_empty() && !image.is_empty() && !image.contains('/') =>
            {
                Ok(Self {
                    pool: pool.to_string(),
                    image: image.to_string(),
                    ..Self::default()
                })
            }
            _ => Err(Error::Config(format!(
                "bad rbd target {arg:?}: expected rbd:POOL/IMAGE"
            ))),
        }
    }

    /// Whether the device is opened read-only (`ro=1` or a snapshot).
    pub fn is_read_only(&self) -> bool {
        self.read_only || self.snap.is_some()
    }

    /// Applies one `key=value` option of the spec; `Ok(false)` for a key that is not one of
    /// the rbd options.
    pub fn set(&mut self, k: &str, v: &str) -> Result<bool, Error> {
        let bad = |what: &str| Error::Config(format!("option {k}: {what} {v:?}"));
        match k {
            "conf" => self.conf = Some(PathBuf::from(v)),
            "id" => self.id = Some(v.to_string()),
            "keyring" => self.keyring = Some(PathBuf::from(v)),
            "snap" if !v.is_empty() => self.snap = Some(v.to_string()),
            "timeout" => {
                let n: u32 = v.parse().map_err(|_| bad("bad number of seconds"))?;
                self.timeout_secs = (n > 0).then_some(n);
            }
            "completion" => {
                self.completion = match v {
                    "poll" => CompletionMode::Poll,
                    "callback" => CompletionMode::Callback,
                    _ => return Err(bad("expected poll or callback, not")),
                }
            }
            _ => return Ok(false),
        }
        if [self.id.as_deref(), self.snap.as_deref()]
            .into_iter()
            .flatten()
            .chain([self.pool.as_str(), self.image.as_str()])
            .any(|s| s.contains('\0'))
        {
            return Err(bad("a NUL byte in"));
        }
        Ok(true)
    }
}

impl fmt::Display for RbdConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rbd:{}/{}", self.pool, self.image)?;
        if let Some(s) = &self.snap {
            write!(f, "@{s}")?;
        }
        Ok(())
    }
}

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

#[cfg(all(test, not(blkq_loom)))]
mod tests {
    use super::*;

    #[test]
    fn targets_and_options() {
        let mut c = RbdConfig::parse_target("rbd/img").unwrap();
        assert_eq!((c.pool.as_str(), c.image.as_str()), ("rbd", "img"));
        for bad in ["", "rbd", "rbd/", "/img", "a/b/c"] {
            assert!(RbdConfig::parse_target(bad).is_err(), "{bad}");
        }
        assert!(c.set("conf", "/x/ceph.conf").unwrap());
        assert!(c.set("snap", "s1").unwrap());
        assert!(c.is_read_only());
        assert!(c.set("timeout", "x").is_err());
        assert!(c.set("timeout", "30").unwrap());
        assert_eq!(c.timeout_secs, Some(30));
        assert_eq!(c.completion, CompletionMode::Poll);
        assert!(c.set("completion", "callback").unwrap());
        assert_eq!(c.completion, CompletionMode::Callback);
        assert!(c.set("completion", "thread").is_err());
        assert!(!c.set("engine", "uring").unwrap());
        assert_eq!(c.to_string(), "rbd:rbd/img@s1");
    }
}
