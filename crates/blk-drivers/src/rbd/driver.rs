//! [`RbdDriver`]: the cluster connection, the open image, and the request slots whose
//! addresses librbd's completions carry (the module docs of [`super`] describe the data path).

use std::ffi::{c_char, c_int, c_void, CString};
use std::io;
use std::ptr;

use std::sync::OnceLock;

use blkq_sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use blkq_sync::DynArc;
use waitq::WaitQueue;

use blk::error::with_context;
use blk::{BioFlags, Driver, Error, Extent, Op, RequestQueue, RequestToken};

use super::config::{CompletionMode, RbdConfig};
use super::ffi;
use super::poll::{BatchCounters, Poller};

/// One request's slot: what a completion's callback argument points to.
struct Slot {
    /// The driver's shared state (it outlives every completion: see `RbdState::drain`).
    shared: *const RbdState,
    /// The request's index ([`RequestToken::index`]).
    idx: u32,
    /// A FUA write, discard or write-zeroes whose flush is still to be sent. Ordering: written by `queue_rq` before it
    /// hands the write to librbd and read when that write completes (its callback, or the
    /// completion thread); librbd's hand-off from the submitting thread to its completion
    /// thread (or its completion queue) goes through its own locks, which order the two, so
    /// Relaxed suffices; the atomic only makes the cell shareable.
    then_flush: AtomicBool,
}

// SAFETY: `shared` points into the `DynArc` that owns the slot (the slots are a field of that
// same `RbdState`), and what it points to is `Sync`; the other fields are `Send + Sync`.
unsafe impl Send for Slot {}
// SAFETY: as for `Send`: the slot is only read through `&`, its one mutable field an atomic.
unsafe impl Sync for Slot {}

/// The cluster handles and the open image.
struct Handles {
    cluster: ffi::rados_t,
    ioctx: ffi::rados_ioctx_t,
    image: ffi::rbd_image_t,
}

impl Handles {
    /// Closes whatever is open, innermost first.
    fn close(&mut self) {
        // SAFETY: each handle is either null or one this driver opened and has not closed
        // (nulled right after closing); no request is in flight (`RbdState::drain` ran or no
        // request was ever submitted), so librbd uses none of them any more.
        unsafe {
            if !self.image.is_null() {
                ffi::rbd_close(self.image);
                self.image = ptr::null_mut();
            }
            if !self.ioctx.is_null() {
                ffi::rados_ioctx_destroy(self.ioctx);
                self.ioctx = ptr::null_mut();
            }
            if !self.cluster.is_null() {
                ffi::rados_shutdown(self.cluster);
                self.cluster = ptr::null_mut();
            }
        }
    }
}

/// What an [`RbdDriver`] shares with its requests' completions (librbd's callbacks or the
/// poller): the open image, the queue, the slots and the count in flight.
struct RbdState {
    name: String,
    image: ffi::rbd_image_t,
    read_only: bool,
    /// How completions come back (`completion=`): with `Poll`, completions are created
    /// without a callback and the [`Poller`] takes them.
    mode: CompletionMode,
    /// The queue, set by `start` before any request arrives (a `OnceLock`: its `get` sees
    /// what `set` published). Not an `Arc`: the queue owns this driver, and it outlives every
    /// request in flight (it drains them through `stop` before it goes).
    core: OnceLock<CorePtr>,
    /// One per request of the queue, allocated by `start` (set once, before any request).
    slots: OnceLock<Box<[Slot]>>,
    /// Requests handed to librbd and not yet completed. Ordering: AcqRel when a completion (a
    /// callback, or the completion thread) decrements it and SeqCst when the drain reads it, so
    /// the drain that sees 0 also sees every completion's last access to the slots and the
    /// queue; SeqCst where `queue_rq`
    /// increments it (against `stop`, see there).
    in_flight: AtomicUsize,
    /// Woken when `in_flight` drops to 0 (the drain waits there).
    idle: WaitQueue,
    handles: blkq_sync::Mutex<Handles>,
}

/// The queue's address (see `RbdState::core`).
struct CorePtr(*const RequestQueue);

// SAFETY: a shared reference to the queue, which is `Sync`, valid while requests are in
// flight (see `RbdState::core`).
unsafe impl Send for CorePtr {}
// SAFETY: as for `Send`.
unsafe impl Sync for CorePtr {}

// SAFETY: `image` is a librbd handle, which librbd allows to be used from any thread
// (its calls take the image's own locks); the rest are thread-safe types.
unsafe impl Send for RbdState {}
// SAFETY: as for `Send`.
unsafe impl Sync for RbdState {}

/// The `rbd` driver (see the [module docs](super)).
pub struct RbdDriver {
    /// A `DynArc` (always std's `Arc`): the completion callback takes counts of it from its
    /// raw pointer.
    shared: DynArc<RbdState>,
    size: u64,
    obj_size: u64,
    /// Set once by `stop`; `queue_rq` fails requests from then on (orderings: there).
    stopped: AtomicBool,
    /// The completion thread (`completion=poll`), stopped by `stop` after the drain.
    poller: blkq_sync::Mutex<Option<Poller>>,
    /// The completion thread's counts (all zero with `completion=callback`).
    counters: blkq_sync::Arc<BatchCounters>,
}

impl std::fmt::Debug for RbdDriver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RbdDriver")
            .field("image", &self.shared.name)
            .field("size", &self.size)
            .finish()
    }
}

fn cstr(what: &str, s: &str) -> Result<CString, Error> {
    CString::new(s).map_err(|_| Error::Config(format!("{what} {s:?} holds a NUL byte")))
}

/// librbd's negative errno as an error naming `name` and the call.
fn rbd_error(name: &str, call: &str, r: c_int) -> Error {
    Error::Io(with_context(
        io::Error::from_raw_os_error(-r),
        format!("{name}: {call}"),
    ))
}

impl RbdDriver {
    /// Connects to the cluster, opens the image and, unless told otherwise, takes its
    /// exclusive lock (module docs). Errors name the image and the step that failed.
    pub fn open(cfg: &RbdConfig) -> Result<Self, Error> {
        let name = cfg.to_string();
        let mut h = Handles {
            cluster: ptr::null_mut(),
            ioctx: ptr::null_mut(),
            image: ptr::null_mut(),
        };
        match Self::open_handles(cfg, &name, &mut h) {
            Ok((size, obj_size)) => Self {
                shared: DynArc::new(RbdState {
                    name,
                    image: h.image,
                    read_only: cfg.is_read_only(),
                    mode: cfg.completion,
                    core: OnceLock::new(),
                    slots: OnceLock::new(),
                    in_flight: AtomicUsize::new(0),
                    idle: WaitQueue::new(),
                    handles: blkq_sync::Mutex::new(h),
                }),
                size,
                obj_size,
                stopped: AtomicBool::new(false),
                poller: blkq_sync::Mutex::new(None),
                counters: blkq_sync::Arc::new(BatchCounters::default()),
            }
            .start_poller(),
            Err(e) => {
                h.close();
                Err(e)
            }
        }
    }

    fn open_handles(cfg: &RbdConfig, name: &str, h: &mut Handles) -> Result<(u64, u64), Error> {
        let id = cfg.id.as_deref().map(|s| cstr("id", s)).transpose()?;
        let pool = cstr("pool", &cfg.pool)?;
        let image = cstr("image", &cfg.image)?;
        let snap = cfg.snap.as_deref().map(|s| cstr("snap", s)).transpose()?;
        let fail = |call: &str, r: c_int| rbd_error(name, call, r);
        // SAFETY: `h.cluster` is a valid out-pointer; `id` is null or a NUL-terminated string
        // that outlives the call.
        let r = unsafe {
            ffi::rados_create(
                &mut h.cluster,
                id.as_ref().map_or(ptr::null(), |s| s.as_ptr()),
            )
        };
        if r < 0 {
            h.cluster = ptr::null_mut();
            return Err(fail("rados_create", r));
        }
        let conf = match &cfg.conf {
            Some(p) => Some(cstr("conf", &p.to_string_lossy())?),
            None => None,
        };
        // SAFETY: `h.cluster` was created above; `conf` is null (librados searches its default
        // places) or a NUL-terminated path that outlives the call.
        let r = unsafe {
            ffi::rados_conf_read_file(h.cluster, conf.as_ref().map_or(ptr::null(), |s| s.as_ptr()))
        };
        if r < 0 {
            let what = match &cfg.conf {
                Some(p) => format!("reading the configuration {}", p.display()),
                None => "reading the configuration ($CEPH_CONF, /etc/ceph/ceph.conf; or give \
                         conf=PATH)"
                    .to_string(),
            };
            return Err(fail(&what, r));
        }
        let set = |k: &str, v: &str| -> Result<(), Error> {
            let (ck, cv) = (cstr("option", k)?, cstr("value", v)?);
            // SAFETY: `h.cluster` is a created, not yet connected handle; both strings are
            // NUL-terminated and outlive the call.
            let r = unsafe { ffi::rados_conf_set(h.cluster, ck.as_ptr(), cv.as_ptr()) };
            if r < 0 {
                return Err(fail(&format!("setting {k}={v}"), r));
            }
            Ok(())
        };
        if let Some(k) = &cfg.keyring {
            set("keyring", &k.to_string_lossy())?;
        }
        if let Some(t) = cfg.timeout_secs {
            set("rados_osd_op_timeout", &t.to_string())?;
            set("rados_mon_op_timeout", &t.to_string())?;
            set("client_mount_timeout", &t.to_string())?;
        }
        // SAFETY: a created, configured handle.
        let r = unsafe { ffi::rados_connect(h.cluster) };
        if r < 0 {
            return Err(fail("connecting to the cluster", r));
        }
        // SAFETY: a connected handle, a NUL-terminated pool name, a valid out-pointer.
        let r = unsafe { ffi::rados_ioctx_create(h.cluster, pool.as_ptr(), &mut h.ioctx) };
        if r < 0 {
            h.ioctx = ptr::null_mut();
            return Err(fail(&format!("opening pool {:?}", cfg.pool), r));
        }
        let snap_ptr = snap.as_ref().map_or(ptr::null(), |s| s.as_ptr());
        // SAFETY: a valid I/O context, NUL-terminated names (or a null snapshot), a valid
        // out-pointer.
        let r = unsafe {
            if cfg.is_read_only() {
                ffi::rbd_open_read_only(h.ioctx, image.as_ptr(), &mut h.image, snap_ptr)
            } else {
                ffi::rbd_open(h.ioctx, image.as_ptr(), &mut h.image, snap_ptr)
            }
        };
        if r < 0 {
            h.image = ptr::null_mut();
            return Err(fail("opening the image", r));
        }
        // SAFETY: `rbd_image_info_t` is plain data, valid all-zero.
        let mut info: ffi::rbd_image_info_t = unsafe { std::mem::zeroed() };
        // SAFETY: an open image; `info` is a valid out-pointer of the size given.
        let r = unsafe {
            ffi::rbd_stat(
                h.image,
                &mut info,
                std::mem::size_of::<ffi::rbd_image_info_t>(),
            )
        };
        if r < 0 {
            return Err(fail("rbd_stat", r));
        }
        if !cfg.is_read_only() && !cfg.no_lock {
            lock(h.image, name)?;
        }
        Ok((info.size, info.obj_size))
    }

    /// With `completion=poll`, registers the eventfd and starts the completion thread (before
    /// any request can be submitted: from then on completions without a callback are polled).
    /// On failure `self` is dropped, which closes the image.
    fn start_poller(self) -> Result<Self, Error> {
        if self.shared.mode != CompletionMode::Poll {
            return Ok(self);
        }
        let sh = DynArc::clone(&self.shared);
        let p = Poller::start(
            self.shared.image,
            blkq_sync::Arc::clone(&self.counters),
            move |batch| {
                for &c in batch {
                    // SAFETY: `c` is a completion `rbd_poll_io_events` just handed out (once:
                    // this thread alone polls), created by `submit` with a slot's address as
                    // its argument; released exactly once, here.
                    let (arg, ret) = unsafe {
                        let arg = ffi::rbd_aio_get_arg(c);
                        let ret = ffi::rbd_aio_get_return_value(c);
                        ffi::rbd_aio_release(c);
                        (arg, ret)
                    };
                    // SAFETY: `arg` is the address of a slot of `sh.slots`, which `sh` (held by
                    // this thread) keeps alive.
                    let slot = unsafe { &*(arg as *const Slot) };
                    sh.completed(slot, ret);
                }
            },
        )
        .map_err(|e| {
            Error::Io(with_context(
                e,
                format!(
                    "{}: starting the completion thread (rbd_set_image_notification)",
                    self.shared.name
                ),
            ))
        })?;
        *self.poller.lock() = Some(p);
        Ok(self)
    }

    /// The completion thread's counts: completions per wake-up (`completion=poll`).
    pub fn batch_counters(&self) -> blkq_sync::Arc<BatchCounters> {
        blkq_sync::Arc::clone(&self.counters)
    }

    /// The image's size, bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The image's object size, bytes.
    pub fn object_size(&self) -> u64 {
        self.obj_size
    }

    /// Completes a request that never reached librbd.
    fn fail_now(&self, q: &RequestQueue, r: RequestToken, e: Error) {
        q.complete(r, Err(e));
    }
}

/// Takes the image's exclusive lock; a refusal names the image and its owner.
fn lock(image: ffi::rbd_image_t, name: &str) -> Result<(), Error> {
    let mut features = 0u64;
    // SAFETY: an open image, a valid out-pointer.
    let r = unsafe { ffi::rbd_get_features(image, &mut features) };
    if r < 0 {
        return Err(rbd_error(name, "rbd_get_features", r));
    }
    if features & ffi::RBD_FEATURE_EXCLUSIVE_LOCK == 0 {
        return Err(Error::Config(format!(
            "{name}: the image has no exclusive-lock feature, so blkq cannot keep a second \
             user out: enable it (rbd feature enable POOL/IMAGE exclusive-lock) or give \
             lock=off"
        )));
    }
    // SAFETY: an open image.
    let r = unsafe { ffi::rbd_lock_acquire(image, ffi::RBD_LOCK_MODE_EXCLUSIVE) };
    if r == 0 {
        return Ok(());
    }
    let owners = lock_owners(image);
    Err(Error::Io(with_context(
        io::Error::from_raw_os_error(libc::EBUSY),
        format!(
            "{name}: the image is in use: its exclusive lock is held by {} ({}); \
             stop that user, or give lock=off to share the image",
            if owners.is_empty() {
                "another client".to_string()
            } else {
                owners
            },
            io::Error::from_raw_os_error(-r),
        ),
    )))
}

/// The exclusive lock's owners, as librbd names them (empty when it cannot tell).
fn lock_owners(image: ffi::rbd_image_t) -> String {
    let mut mode: c_int = 0;
    let mut owners: [*mut c_char; 8] = [ptr::null_mut(); 8];
    let mut n = owners.len();
    // SAFETY: an open image; `owners` has room for `n` pointers, which librbd fills with
    // strings it allocates and `rbd_lock_get_owners_cleanup` frees.
    let r = unsafe { ffi::rbd_lock_get_owners(image, &mut mode, owners.as_mut_ptr(), &mut n) };
    if r < 0 {
        return String::new();
    }
    let n = n.min(owners.len());
    let names: Vec<String> = owners[..n]
        .iter()
        .filter(|p| !p.is_null())
        .map(|&p| {
            // SAFETY: librbd filled the first `n` entries with NUL-terminated strings.
            unsafe { std::ffi::CStr::from_ptr(p) }
                .to_string_lossy()
                .into_owned()
        })
        .collect();
    // SAFETY: the `n` entries librbd filled, freed once.
    unsafe { ffi::rbd_lock_get_owners_cleanup(owners.as_mut_ptr(), n) };
    names.join(", ")
}

/// librbd's completion callback: `arg` is the request's [`Slot`].
unsafe extern "C" fn on_complete(c: ffi::rbd_completion_t, arg: *mut c_void) {
    // SAFETY: `arg` is the address of a slot of `RbdState::slots` that `submit` gave this
    // completion; the slots live until `RbdState::drain` has seen this request finish, which is
    // after this callback returns.
    let slot = unsafe { &*(arg as *const Slot) };
    // A strong count of this callback's own, so that `RbdState` (and `slot` in it) outlives
    // this call even once the drain has seen the request finish and the driver has gone:
    // completing the request is not this callback's last access to them.
    // SAFETY: `slot.shared` is the pointer of the driver's `DynArc<RbdState>`, which is alive:
    // this request is still counted in `in_flight`, and the driver keeps its `DynArc` until
    // the drain has seen the count reach 0. The count taken here is given back by the
    // `from_raw` value's drop.
    let sh = unsafe {
        DynArc::increment_strong_count(slot.shared);
        DynArc::from_raw(slot.shared)
    };
    // SAFETY: `c` is the completion librbd calls back for, released exactly once, here.
    let ret = unsafe {
        let ret = ffi::rbd_aio_get_return_value(c);
        ffi::rbd_aio_release(c);
        ret
    };
    sh.completed(slot, ret);
}

/// Pointer to one of the diff callback's accumulators.
struct DiffState<'a> {
    offset: u64,
    end: u64,
    max: usize,
    out: &'a mut Vec<Extent>,
    /// The next byte not yet described.
    next: u64,
    unordered: bool,
}

/// Sentinel: the caller's `max` extents are filled.
const DIFF_FULL: c_int = -libc::ECANCELED;

impl DiffState<'_> {
    fn push(&mut self, offset: u64, len: u64, allocated: bool) -> bool {
        if len == 0 {
            return true;
        }
        if let Some(last) = self.out.last_mut() {
            if last.allocated == allocated && last.offset + last.len == offset {
                last.len += len;
                return true;
            }
        }
        if self.out.len() == self.max {
            return false;
        }
        self.out.push(Extent {
            offset,
            len,
            allocated,
        });
        true
    }
}

unsafe extern "C" fn on_diff(off: u64, len: usize, exists: c_int, arg: *mut c_void) -> c_int {
    // SAFETY: `arg` is the `DiffState` that `extents_into` passed and that outlives the
    // synchronous `rbd_diff_iterate2` call from which this is called.
    let st = unsafe { &mut *(arg as *mut DiffState<'_>) };
    let start = off.max(st.offset);
    let end = off.saturating_add(len as u64).min(st.end);
    if start >= end {
        return 0;
    }
    if start < st.next {
        st.unordered = true;
        return DIFF_FULL;
    }
    let next = st.next;
    if !st.push(next, start - next, false) || !st.push(start, end - start, exists != 0) {
        return DIFF_FULL;
    }
    st.next = end;
    0
}

impl RbdState {
    fn slot(&self, idx: u32) -> Option<&Slot> {
        self.slots.get()?.get(idx as usize)
    }

    /// Hands one op of the request of `slot` to librbd; the negative errno if librbd refused
    /// it (then no callback will come).
    fn submit(
        &self,
        slot: &Slot,
        op: Op,
        flags: BioFlags,
        off: u64,
        len: u64,
        buf: *mut u8,
    ) -> Result<(), c_int> {
        let zero_flags = if flags.contains(BioFlags::NO_HOLE) {
            ffi::RBD_WRITE_ZEROES_FLAG_THICK_PROVISION
        } else {
            0
        };
        let mut c: ffi::rbd_completion_t = ptr::null_mut();
        // Without a callback, librbd queues the completion for the completion thread (the
        // eventfd was registered before any request was submitted).
        let cb: ffi::rbd_callback_t = match self.mode {
            CompletionMode::Callback => Some(on_complete),
            CompletionMode::Poll => None,
        };
        // SAFETY: `slot` lives until the completion has been handled (`drain`); `on_complete`
        // matches librbd's callback type; `c` is a valid out-pointer.
        let r = unsafe {
            ffi::rbd_aio_create_completion(slot as *const Slot as *mut c_void, cb, &mut c)
        };
        if r < 0 {
            return Err(r);
        }
        let image = self.image;
        // SAFETY: `image` is open until `drain` has seen every request finish; `buf` points to
        // the bio's buffer of at least `len` bytes, which stays in the request cell, untouched
        // by anyone, until the request completes (the token is given up meanwhile).
        let r = unsafe {
            match op {
                Op::Read => ffi::rbd_aio_read(image, off, len as usize, buf.cast(), c),
                Op::Write => ffi::rbd_aio_write(image, off, len as usize, buf.cast(), c),
                Op::Flush => ffi::rbd_aio_flush(image, c),
                Op::Discard => ffi::rbd_aio_discard(image, off, len, c),
                Op::WriteZeroes => {
                    ffi::rbd_aio_write_zeroes(image, off, len as usize, c, zero_flags, 0)
                }
            }
        };
        if r < 0 {
            // SAFETY: librbd refused the op, so the completion is still ours alone.
            unsafe { ffi::rbd_aio_release(c) };
            return Err(r);
        }
        Ok(())
    }

    /// One op of the request of `slot` has completed with `ret`: a FUA write's (discard's,
    /// write-zeroes') flush is sent now, anything else completes the request.
    fn completed(&self, slot: &Slot, ret: isize) {
        if ret >= 0 && slot.then_flush.swap(false, Ordering::Relaxed) {
            // The FUA write (discard, write-zeroes) is done: its flush completes the request. `submit` counts this
            // second op nowhere: the request is still the one in flight.
            if let Err(r) = self.submit(slot, Op::Flush, BioFlags::NONE, 0, 0, ptr::null_mut()) {
                self.finish(slot, r as isize);
            }
            return;
        }
        self.finish(slot, ret);
    }

    /// Completes the request of `slot` with librbd's result.
    fn finish(&self, slot: &Slot, ret: isize) {
        let Some(core) = self.core.get() else {
            debug_assert!(false, "rbd completion before start");
            return;
        };
        // SAFETY: `start` set `core` before any request was submitted, and the queue outlives
        // every request in flight (it drains us in `stop` before it goes).
        let q = unsafe { &*core.0 };
        // SAFETY: the slot's request was given up to librbd by `queue_rq` as its bare index;
        // librbd calls back exactly once for it, and this is the one rebuild.
        let r = unsafe { q.token_from_index(slot.idx) };
        let res = if ret >= 0 {
            Ok(())
        } else {
            Err(rbd_error(&self.name, "I/O", ret as c_int))
        };
        // The completion thread's clock batch, or a fresh clock read (a callback).
        q.complete(r, res);
        if self.in_flight.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.idle.wake_all();
        }
    }

    /// Waits until no request is in flight.
    fn drain(&self) {
        self.idle
            .wait_for(|| (self.in_flight.load(Ordering::SeqCst) == 0).then_some(()));
    }
}

impl Driver for RbdDriver {
    fn start(&self, q: &DynArc<RequestQueue>) {
        let base = DynArc::as_ptr(&self.shared);
        let n = q.nr_requests() as u32;
        let _ = self.shared.slots.set(
            (0..n)
                .map(|idx| Slot {
                    shared: base,
                    idx,
                    then_flush: AtomicBool::new(false),
                })
                .collect(),
        );
        let _ = self.shared.core.set(CorePtr(DynArc::as_ptr(q)));
    }

    fn queue_rq(&self, q: &RequestQueue, mut r: RequestToken) {
        let sh = &*self.shared;
        let Some(slot) = sh.slot(r.index()) else {
            return self.fail_now(q, r, Error::Io(io::Error::other("rbd driver not started")));
        };
        let rq = q.rq_mut(&mut r);
        let Some(bio) = rq.bio_mut() else {
            return q.complete(r, Ok(()));
        };
        let (op, flags) = (bio.op, bio.flags);
        let (off, len) = (bio.sector << blk::SECTOR_SHIFT, u64::from(bio.len));
        if sh.read_only && op != Op::Read {
            if op == Op::Flush {
                return q.complete(r, Ok(()));
            }
            let e = Error::Io(with_context(
                io::Error::from_raw_os_error(libc::EROFS),
                format!("{}: read-only", sh.name),
            ));
            return self.fail_now(q, r, e);
        }
        let buf = match (op.has_data(), bio.buf.as_mut()) {
            // A write only reads its buffer, which may be a read-only alias (a mirror's legs
            // share one payload, `Buffer::alias`, whose `as_mut_slice` is empty): its address
            // comes from `as_slice`. librbd reads a write's bytes and never writes them.
            (true, Some(b)) if op == Op::Write => b.as_slice().as_ptr().cast_mut(),
            (true, Some(b)) => b.as_mut_slice().as_mut_ptr(),
            (true, None) => {
                return self.fail_now(
                    q,
                    r,
                    Error::Io(io::Error::new(
                        io::ErrorKind::InvalidInput,
                        "rbd: a read or write without a buffer",
                    )),
                )
            }
            (false, _) => ptr::null_mut(),
        };
        // FUA on anything that changes the image: a discard or write-zeroes sits in librbd's
        // writeback cache as a write does, so each is followed by its flush alike.
        let fua = matches!(op, Op::Write | Op::Discard | Op::WriteZeroes)
            && bio.flags.contains(BioFlags::FUA);
        slot.then_flush.store(fua, Ordering::Relaxed);
        // Counted before `stopped` is read, and `stop` sets `stopped` before it reads the
        // count (both SeqCst: a store-then-load on each side, so at least one sees the
        // other): a request either fails here, or is counted and drained before the image
        // is closed.
        sh.in_flight.fetch_add(1, Ordering::SeqCst);
        if self.stopped.load(Ordering::SeqCst) {
            if sh.in_flight.fetch_sub(1, Ordering::AcqRel) == 1 {
                sh.idle.wake_all();
            }
            return self.fail_now(q, r, Error::Io(io::Error::other("rbd driver is stopped")));
        }
        // The token is given up: the slot (its index) carries the request from here on.
        {
            let _given_up: RequestToken = r;
        }
        if let Err(e) = sh.submit(slot, op, flags, off, len, buf) {
            slot.then_flush.store(false, Ordering::Relaxed);
            sh.finish(slot, e as isize);
        }
    }

    fn stop(&self) {
        // SeqCst: see `queue_rq`.
        if self.stopped.swap(true, Ordering::SeqCst) {
            return;
        }
        // The shutdown order of `super::poll`: drain, stop the completion thread, close.
        self.shared.drain();
        let poller = self.poller.lock().take();
        drop(poller);
        self.shared.handles.lock().close();
    }

    fn extents_into(
        &self,
        offset: u64,
        len: u64,
        max: usize,
        out: &mut Vec<Extent>,
    ) -> Result<(), Error> {
        out.clear();
        if len == 0 || max == 0 {
            return Ok(());
        }
        let end = offset.saturating_add(len).min(self.size);
        let mut st = DiffState {
            offset,
            end,
            max,
            out,
            next: offset,
            unordered: false,
        };
        let h = self.shared.handles.lock();
        if h.image.is_null() {
            return Err(Error::Io(io::Error::other("rbd driver is stopped")));
        }
        // SAFETY: an open image (held open by the lock on the handles); `on_diff` matches the
        // callback type, and `st` outlives this synchronous call.
        let r = unsafe {
            ffi::rbd_diff_iterate2(
                h.image,
                ptr::null(),
                offset,
                end - offset,
                1,
                0,
                Some(on_diff),
                &mut st as *mut DiffState<'_> as *mut c_void,
            )
        };
        drop(h);
        if st.unordered {
            // Not in order: say everything is allocated (always true to say).
            st.out.clear();
            st.out.push(Extent {
                offset,
                len: end - offset,
                allocated: true,
            });
            return Ok(());
        }
        if r < 0 && r != DIFF_FULL {
            return Err(rbd_error(&self.shared.name, "rbd_diff_iterate2", r));
        }
        if r == 0 {
            let next = st.next;
            st.push(next, end - next, false);
        }
        Ok(())
    }

    fn describe(&self) -> String {
        format!(
            "rbd {} ({} bytes, {} KiB objects)",
            self.shared.name,
            self.size,
            self.obj_size >> 10
        )
    }
}

impl Drop for RbdDriver {
    fn drop(&mut self) {
        self.stop();
    }
}
