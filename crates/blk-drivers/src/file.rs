//! The `file` driver: a regular file or a block device, through an asynchronous engine
//! (io_uring, or a thread pool where io_uring is unavailable or not wanted), or synchronously.
//!
//! # Data path (engines `uring` and `pool`)
//!
//! - `queue_rq` turns the request's bio into a [`UringOp`] (read, write with FUA, or `fdatasync`
//!   for a flush) whose `user_data` is the request's [`RequestToken::index`], and appends it to the
//!   driver's pending batch. The `RequestToken` itself is given up there: the op carries the
//!   ownership of the request from then on.
//! - `commit` takes the whole pending batch (whatever every submitter queued since the last
//!   commit) and hands it to the engine at once: one `io_uring_enter` for a plug's worth of
//!   requests. The batch lock is not held while submitting, so a submitter that waits for
//!   room in the ring never blocks the others' `queue_rq`, nor a completion callback that
//!   submits again.
//! - The engine's completion callback (registered once, at construction) rebuilds the
//!   `RequestToken` from `user_data` and calls [`RequestQueue::complete`]. It reaches the queue
//!   through a `OnceLock` filled in [`Driver::start`]; [`Driver::stop`] shuts the engine down
//!   (which waits for every op in flight) and so drops the callback and, with it, the queue.
//! - Discards and write-zeroes run synchronously on the [`FileBackend`] in `queue_rq` (via
//!   [`exec_on_backend`]): the backend's `fallocate` fallbacks (punch, zero range, plain
//!   writes, `BLKZEROOUT`) would each need an op of their own, and io_uring's fallocate is
//!   an optional opcode. A FUA one is followed there by `fdatasync` before it completes.
//!   Writes and flushes on a read-only device run there too (they fail with `EROFS`, or
//!   succeed trivially, exactly as with `engine=sync`), and so do bios without a buffer.
//!
//! # Inline I/O: no hand-off when there is nothing to wait for
//!
//! A request that goes through the engine is completed on another thread (io_uring's
//! reaper, or a pool worker; for a buffered write or a tmpfs read io_uring itself first
//! punts it to an io-wq worker), so the reply leaves from a thread that had to be woken: one
//! or two thread hand-offs per request, which dominate at queue depth 1. So `queue_rq` runs
//! a request on the submitter's thread, as `engine=sync` would, when it cannot wait on a
//! device or when nothing else would wait for it:
//!
//! - a file on tmpfs or ramfs ([`FileBackend::is_memory_backed`]): every request (a read or
//!   write there is a memory copy, like the `mem` driver's);
//! - a read the page cache holds: one `preadv2(RWF_NOWAIT)` ([`FileBackend::read_nowait`]);
//!   a miss (it would block) goes to the engine, and after a run of misses only one read in
//!   32 is tried, so a cold cache costs few extra system calls;
//! - a write (not FUA) while the engine has nothing in flight (`FileState::in_engine` is 0): at
//!   queue depth 1 the submitter would only wait for the reply anyway. A request that
//!   arrives meanwhile waits for the write to finish, as it would behind a busy device; a
//!   batch of writes runs inline one after the other (buffered writes to one file take the
//!   inode's lock in the kernel, so the engine would run them one at a time as well).
//!   Buffered writes cannot be tried with `RWF_NOWAIT` (ext4 and tmpfs refuse the flag for
//!   them, `EOPNOTSUPP`), hence the in-flight test instead. FUA writes and flushes wait on
//!   the device (milliseconds on a disk, against microseconds for the hand-off) and go to
//!   the engine, so the reader keeps receiving meanwhile.
//!
//! With `direct=1` neither reads nor writes are tried inline: a direct transfer always
//! waits on the device, and a batch of them must be in the ring at once, not run one after
//! the other on the submitter's thread.
//!
//! # The ring never fills
//!
//! Every op belongs to a request, which holds a tag, so at most "tags of the queue" ops are
//! in flight. The spec builder sizes the ring to that by default (`entries=`), so a
//! submission never waits for room. With a smaller ring, submitters wait for room; but a
//! completion callback that submits again runs on the io_uring reaper, which cannot wait for
//! itself, and the engine refuses it with `WouldBlock`. The ops it could not place are
//! *deferred*: kept aside, and submitted by the next completion callbacks on the reaper.
//! There always is a next one: the ring was full, so every one of its slots belonged to an
//! op whose callback had not run yet. (Running them synchronously instead would recurse
//! without bound through callbacks that keep submitting, and stall the reaper.)
//!
//! # Engine `sync`
//!
//! Every request runs in `queue_rq` on the submitter's thread, as [`crate::mem::BackendDriver`]
//! does.
//!
//! # Merges
//!
//! With `engine=sync` the driver runs a scheduler's merge chains (every bio in turn), so
//! [`Driver::max_merge`] is unlimited. With `uring` and `pool` it is 1: each request is one
//! engine op whose `user_data` is the request's index, and completing a chain would need one
//! op per bio and a count of the ops still out. Merging for these engines belongs in one
//! vectored op per chain (`readv`/`writev` over the chain's buffers), which is where a merge
//! would save system calls; until then the queue does not merge for them. Should a chain
//! arrive anyway, it runs synchronously.

use std::fmt;
use std::io;
use std::os::fd::BorrowedFd;
use std::sync::OnceLock;

use blkq_sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use blkq_sync::{Arc, Mutex};

use blk::error::{os_error_code, with_context};
use blk::{BioFlags, Caps, Driver, Error, Extent, Op, RequestQueue, RequestToken};

use crate::backend::file::{FileBackend, FileOptions};
use crate::backend::{exec_on_backend, Backend, SpliceGate};
use crate::engine::{Callback, EngineKind, FileEngine, UringOp};
use crate::kind_options::{parse_bool, parse_num, Kind, KindOptions};

/// Worker threads of the pool engine when `workers=` is not given.
pub const DEFAULT_WORKERS: usize = 4;
/// The largest io_uring submission queue (`IORING_MAX_ENTRIES`).
pub const MAX_ENTRIES: u32 = 32768;
/// The most pool workers a spec may ask for.
pub const MAX_WORKERS: usize = 1024;

/// Options of the [`FileDriver`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileDriverConfig {
    /// The engine.
    pub engine: EngineKind,
    /// io_uring submission entries (the kernel rounds up to a power of two): the most ops in
    /// flight. Size it to the queue's tags (what the spec builder does) so that submissions
    /// never wait for room.
    pub entries: u32,
    /// Worker threads of the pool engine.
    pub workers: usize,
    /// Run requests that need not wait on the submitter's thread (module docs, "Inline
    /// I/O"); off, every request of `uring` and `pool` goes through the engine.
    pub inline: bool,
    /// Zero-copy reads (`splice=0|1`, [`blk::Device::splice_read`]): `splice(2)` from the
    /// buffered descriptor's page cache into a pipe. Never with `direct=1`, whose point is
    /// to keep the data out of the page cache.
    pub splice: bool,
}

impl Default for FileDriverConfig {
    fn default() -> Self {
        Self {
            engine: EngineKind::Auto,
            entries: 64,
            workers: DEFAULT_WORKERS,
            inline: true,
            splice: true,
        }
    }
}

/// An op for the engine, and the `user_data` (request index) it carries.
type PendingOp = (UringOp, u64);

/// The submission side, under one lock.
struct State {
    /// Ops queued by `queue_rq` since the last `commit`.
    pending: Vec<PendingOp>,
    /// Ops a completion callback could not place in a full ring (`WouldBlock`); submitted
    /// again by the next completion callbacks (module docs).
    deferred: Vec<PendingOp>,
    /// Emptied batches, reused so that steady state allocates nothing.
    spare: Vec<Vec<PendingOp>>,
    /// `None` once stopped. Cloned for the length of one submission (outside the lock).
    engine: Option<Arc<FileEngine>>,
}

/// What the driver and the completion callback share.
struct FileState {
    state: Mutex<State>,
    /// `deferred` is not empty (checked by every completion without taking the lock).
    has_deferred: AtomicBool,
    /// Ops queued and not yet called back (or failed): incremented by `queue_rq` before it
    /// queues an op, decremented before the op's request is completed. A heuristic for inline
    /// writes (module docs): `Relaxed`, as nothing is published through it; a stale read
    /// only runs one write inline, or one through the engine, that the other rule would have
    /// placed differently; both are correct.
    in_engine: AtomicUsize,
}

/// What the completion callback holds: the queue (filled in [`Driver::start`]) and the
/// submission side.
struct Completer {
    core: OnceLock<blkq_sync::DynArc<RequestQueue>>,
    shared: Arc<FileState>,
}

struct AsyncEngine {
    shared: Arc<FileState>,
    /// Taken by `start`, which fills it in; held by the callback from then on.
    completer: Mutex<Option<Arc<Completer>>>,
    name: &'static str,
    /// Ring entries (uring) or worker threads (pool).
    size: usize,
    /// [`FileDriverConfig::inline`].
    inline: bool,
}

enum Mode {
    Sync,
    Async(AsyncEngine),
}

/// Where `queue_rq` runs a request (module docs, "Inline I/O").
enum Inline {
    /// Done on this thread already (a read from the page cache): complete it.
    Done(Result<(), Error>),
    /// Run it synchronously on this thread.
    Run,
    /// Queue it for the engine.
    Engine,
}

/// The `file` driver. See the [module docs](self).
pub struct FileDriver {
    backend: FileBackend,
    mode: Mode,
    splice: SpliceGate,
    /// Writes received into the page cache ([`blk::Device::recv_home`]): buffered, writable,
    /// and not turned off by the spec's `splice=0`.
    home: bool,
}

impl fmt::Debug for FileDriver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FileDriver")
            .field("backend", &self.backend)
            .field("engine", &self.engine_name())
            .finish()
    }
}

/// Maps an engine result to the block layer's.
#[inline]
fn to_result(r: io::Result<u32>) -> Result<(), Error> {
    r.map(drop).map_err(Error::Io)
}

/// A copy of `e` (which `io::Error` cannot clone), errno kept, for each op it failed.
fn copy_error(e: &io::Error) -> io::Error {
    match os_error_code(e) {
        Some(code) => with_context(io::Error::from_raw_os_error(code), e.to_string()),
        None => io::Error::new(e.kind(), e.to_string()),
    }
}

/// Completes ops that will never reach the engine with `err`.
fn fail(q: &RequestQueue, shared: &FileState, ops: &[PendingOp], err: &io::Error) {
    for &(_, user_data) in ops {
        shared.in_engine.fetch_sub(1, Ordering::Relaxed);
        // SAFETY: `user_data` is the index of a request whose token `queue_rq` gave up to
        // this op; the engine did not accept the op, so it will never call back for it, and
        // the op is dropped here: this is the only rebuild.
        let r = unsafe { q.token_from_index(user_data as u32) };
        q.complete(r, Err(Error::Io(copy_error(err))));
    }
}

impl FileState {
    /// Hands `batch` to `engine`. Ops refused because the ring is full (only ever on the
    /// io_uring reaper, which cannot wait for itself) are deferred to the next completion;
    /// ops refused for any other reason fail.
    fn submit(&self, q: &RequestQueue, engine: Option<Arc<FileEngine>>, batch: &[PendingOp]) {
        let Some(engine) = engine else {
            return fail(q, self, batch, &io::Error::other("file driver is stopped"));
        };
        let Err(e) = engine.submit_batch(batch) else {
            return;
        };
        let rest = &batch[e.accepted.min(batch.len())..];
        if e.error.kind() == io::ErrorKind::WouldBlock {
            let mut st = self.state.lock();
            st.deferred.extend_from_slice(rest);
            self.has_deferred.store(true, Ordering::Release);
        } else {
            fail(q, self, rest, &e.error);
        }
    }

    /// Takes `pending` (or `deferred`) as a batch, with the engine to submit it to.
    fn take(&self, deferred: bool) -> Option<(Vec<PendingOp>, Option<Arc<FileEngine>>)> {
        let mut st = self.state.lock();
        let st = &mut *st;
        let from = if deferred {
            self.has_deferred.store(false, Ordering::Relaxed);
            &mut st.deferred
        } else {
            &mut st.pending
        };
        if from.is_empty() {
            return None;
        }
        let mut batch = st.spare.pop().unwrap_or_default();
        std::mem::swap(&mut batch, from);
        Some((batch, st.engine.clone()))
    }

    /// Takes a batch, submits it, and keeps the emptied vector for reuse.
    fn flush(&self, q: &RequestQueue, deferred: bool) {
        let Some((mut batch, engine)) = self.take(deferred) else {
            return;
        };
        self.submit(q, engine, &batch);
        batch.clear();
        self.state.lock().spare.push(batch);
    }
}

/// The `file:PATH` kind ([`crate::spec::KINDS`]): its argument is a path.
pub(crate) const KIND: Kind = Kind {
    name: "file",
    form: "file:PATH",
    // An empty path is no file spec at all: the spec's parser says so, naming every form.
    parse: |_, path, read_only| Ok(Box::new(SpecOptions::new(path.into(), read_only))),
    arg_is_path: true,
    path_options: &[],
    read_only_options: &[],
    warning: None,
};

/// A `file:` spec's options: `direct`, `lock`, `ro` (`read_only`), `engine`, `workers`,
/// `entries`, `inline`, `splice`.
pub(crate) struct SpecOptions {
    path: std::path::PathBuf,
    opts: FileOptions,
    cfg: FileDriverConfig,
    /// `entries`, when given (else one per tag).
    entries: Option<u32>,
}

impl SpecOptions {
    /// The defaults, for the file at `path` (`read_only`: the command line's `--read-only`).
    pub(crate) fn new(path: std::path::PathBuf, read_only: bool) -> Self {
        Self {
            path,
            opts: FileOptions {
                read_only,
                ..FileOptions::default()
            },
            cfg: FileDriverConfig::default(),
            entries: None,
        }
    }
}

impl KindOptions for SpecOptions {
    fn set(&mut self, k: &str, v: &str) -> Result<bool, Error> {
        match k {
            "direct" => self.opts.direct = parse_bool(k, v)?,
            "lock" => self.opts.no_lock = !parse_bool(k, v)?,
            "ro" | "read_only" => self.opts.read_only = parse_bool(k, v)?,
            "engine" => self.cfg.engine = v.parse()?,
            "workers" => self.cfg.workers = parse_num(k, v)?,
            "entries" => self.entries = Some(parse_num(k, v)?),
            "inline" => self.cfg.inline = parse_bool(k, v)?,
            "splice" => self.cfg.splice = parse_bool(k, v)?,
            _ => return Ok(false),
        }
        Ok(true)
    }

    fn open(
        self: Box<Self>,
        cfg: &mut blk::QueueConfig,
        _: bool,
    ) -> Result<Box<dyn Driver>, Error> {
        let be = FileBackend::open(&self.path, self.opts)?;
        cfg.limits.capacity = be.size();
        // Default: one entry per tag, so the ring never fills (module docs).
        let pools = if cfg.shared_tags {
            1
        } else {
            u32::from(cfg.nr_hw_queues)
        };
        let mut fc = self.cfg;
        fc.entries = self
            .entries
            .unwrap_or_else(|| pools.saturating_mul(cfg.queue_depth).clamp(2, MAX_ENTRIES));
        Ok(Box::new(FileDriver::new(be, fc)?))
    }
}

impl FileDriver {
    /// A driver over `backend` with the engine `cfg` asks for. Fails with the reason when
    /// `engine=uring` is asked for where io_uring does not work, or an engine cannot be set
    /// up (threads, descriptors); `Auto` falls back to the pool instead.
    pub fn new(backend: FileBackend, cfg: FileDriverConfig) -> Result<Self, Error> {
        let caps = backend.caps();
        let splice = SpliceGate::new(cfg.splice && caps.splice);
        let home = cfg.splice && caps.recv_home;
        let kind = match cfg.engine {
            EngineKind::Sync => {
                return Ok(Self {
                    backend,
                    mode: Mode::Sync,
                    splice,
                    home,
                })
            }
            kind => kind,
        };
        if cfg.entries == 0 || cfg.entries > MAX_ENTRIES {
            return Err(Error::Config(format!(
                "option entries: {} is not in 1..={MAX_ENTRIES}",
                cfg.entries
            )));
        }
        if cfg.workers == 0 || cfg.workers > MAX_WORKERS {
            return Err(Error::Config(format!(
                "option workers: {} is not in 1..={MAX_WORKERS}",
                cfg.workers
            )));
        }
        let shared = Arc::new(FileState {
            state: Mutex::new(State {
                pending: Vec::with_capacity(64),
                deferred: Vec::new(),
                spare: Vec::new(),
                engine: None,
            }),
            has_deferred: AtomicBool::new(false),
            in_engine: AtomicUsize::new(0),
        });
        let completer = Arc::new(Completer {
            core: OnceLock::new(),
            shared: Arc::clone(&shared),
        });
        let cb_completer = Arc::clone(&completer);
        let callback: Callback = Box::new(move |user_data, res| {
            let Some(core) = cb_completer.core.get() else {
                // No op is submitted before `start` fills this in.
                debug_assert!(false, "file driver completion before start");
                return;
            };
            let Ok(idx) = u32::try_from(user_data) else {
                debug_assert!(false, "file driver op with a bad user_data {user_data}");
                return;
            };
            // SAFETY: every op this driver gives its engine carries as `user_data` the index
            // of a request whose `RequestToken` `queue_rq` gave up for it (the request stays in
            // flight until completed here), and the engine calls back exactly once per
            // accepted op: this is the only token for that request, and `core` is the queue
            // the request was submitted on (the one `start` gave this driver).
            let r = unsafe { core.token_from_index(idx) };
            cb_completer
                .shared
                .in_engine
                .fetch_sub(1, Ordering::Relaxed);
            core.complete(r, to_result(res));
            // This op's slot in the ring is free now: place what a full ring refused.
            if cb_completer.shared.has_deferred.load(Ordering::Acquire) {
                cb_completer.shared.flush(core, true);
            }
        });
        let files = backend.engine_files().map_err(Error::Io)?;
        let engine =
            FileEngine::new(files, kind, cfg.entries, cfg.workers, callback).map_err(|e| {
                Error::Io(with_context(
                    e,
                    format!(
                        "engine={} for {}",
                        cfg.engine.name(),
                        backend.path().display()
                    ),
                ))
            })?;
        let size = match &engine {
            FileEngine::Uring(u) => u.capacity() as usize,
            FileEngine::Pool(p) => p.threads(),
        };
        let name = engine.name();
        shared.state.lock().engine = Some(Arc::new(engine));
        Ok(Self {
            backend,
            mode: Mode::Async(AsyncEngine {
                shared,
                completer: Mutex::new(Some(completer)),
                name,
                size,
                inline: cfg.inline,
            }),
            splice,
            home,
        })
    }

    /// The engine that runs: `"uring"`, `"pool"` or `"sync"`.
    pub fn engine_name(&self) -> &'static str {
        match &self.mode {
            Mode::Sync => "sync",
            Mode::Async(a) => a.name,
        }
    }

    /// The backend.
    pub fn backend(&self) -> &FileBackend {
        &self.backend
    }

    /// Runs the request (every bio of its merge chain) synchronously on the backend and
    /// completes it. Timed with a clock read of its own, after the I/O: a batch of file I/O
    /// may take longer than a tick of the coarse clock, so the batch's shared time
    /// (`blk::stats` module docs) would under-count the later requests' service time.
    fn run_sync(&self, q: &RequestQueue, mut r: RequestToken) {
        let res = q.for_each_bio(&mut r, |bio| exec_on_backend(&self.backend, bio));
        q.complete_at(r, res, blk::stats::coarse_ns());
    }

    /// Where a request of an asynchronous engine runs (module docs, "Inline I/O").
    #[inline]
    fn inline_rule(&self, q: &RequestQueue, r: &mut RequestToken, a: &AsyncEngine) -> Inline {
        if !a.inline {
            return Inline::Engine;
        }
        let rq = q.rq_mut(r);
        if rq.merged().is_some() {
            return Inline::Engine; // `op_for` runs chains synchronously anyway
        }
        let Some(bio) = rq.bio_mut() else {
            return Inline::Engine;
        };
        match bio.op {
            Op::Read => {
                let (off, len) = (bio.offset(), bio.len as usize);
                let Some(buf) = bio.buf.as_mut().filter(|b| b.len() >= len) else {
                    return Inline::Engine;
                };
                match self
                    .backend
                    .read_nowait(off, &mut buf.as_mut_slice()[..len])
                {
                    Some(res) => Inline::Done(res.map_err(Error::Io)),
                    None => Inline::Engine,
                }
            }
            // Not a FUA write nor a flush: those wait on the device (milliseconds on a disk,
            // against the few microseconds a hand-off costs), and the reader should go on
            // receiving meanwhile.
            // Nor with O_DIRECT: a batch of direct writes would wait on the device one after
            // the other here, instead of all at once in the ring.
            Op::Write
                if !bio.flags.contains(BioFlags::FUA)
                    && !self.backend.is_direct()
                    && a.shared.in_engine.load(Ordering::Relaxed) == 0 =>
            {
                Inline::Run
            }
            _ => Inline::Engine,
        }
    }

    /// The engine op for the request, or `None` if it runs synchronously.
    #[inline]
    fn op_for(&self, q: &RequestQueue, r: &mut RequestToken) -> Option<UringOp> {
        let writable = !self.backend.is_read_only();
        let rq = q.rq_mut(r);
        if rq.merged().is_some() {
            return None; // a merge chain: run synchronously (module docs)
        }
        let bio = rq.bio_mut()?;
        let (off, len) = (bio.offset(), bio.len);
        match bio.op {
            Op::Read => {
                let buf = bio.buf.as_mut().filter(|b| b.len() >= len as usize)?;
                let ptr = buf.as_mut_slice().as_mut_ptr();
                // SAFETY: the buffer has at least `len` bytes (checked just above; also by
                // `Limits::validate`). It lives in the bio, inside the request's cell, which
                // belongs to the request until `RequestQueue::complete` takes the bio out. The
                // request's `RequestToken` is given up to this op (`queue_rq`), so nobody reaches
                // the request until the engine's completion callback rebuilds the token, and the
                // engine is done with the memory before it calls back: only then, inside the
                // callback, does `complete` hand the bytes to the bio's submitter. The heap
                // allocation does not move when the bio does.
                Some(unsafe { UringOp::read(off, ptr, len) })
            }
            Op::Write if writable => {
                let fua = bio.flags.contains(BioFlags::FUA);
                let buf = bio.buf.as_ref().filter(|b| b.len() >= len as usize)?;
                let ptr = buf.as_slice().as_ptr();
                // SAFETY: as for reads: at least `len` bytes, in the request that the op owns and
                // nobody touches until its completion callback calls `complete`.
                Some(unsafe { UringOp::write(off, ptr, len, fua) })
            }
            Op::Flush if writable => Some(UringOp::fsync()),
            _ => None,
        }
    }
}

impl Driver for FileDriver {
    fn start(&self, q: &blkq_sync::DynArc<RequestQueue>) {
        if let Mode::Async(a) = &self.mode {
            if let Some(c) = a.completer.lock().take() {
                let _ = c.core.set(q.clone());
            }
        }
    }

    #[inline]
    fn queue_rq(&self, q: &RequestQueue, mut r: RequestToken) {
        let Mode::Async(a) = &self.mode else {
            return self.run_sync(q, r);
        };
        if a.inline && self.backend.is_memory_backed() {
            return self.run_sync(q, r);
        }
        match self.inline_rule(q, &mut r, a) {
            Inline::Done(res) => return q.complete(r, res),
            Inline::Run => return self.run_sync(q, r),
            Inline::Engine => {}
        }
        let Some(op) = self.op_for(q, &mut r) else {
            return self.run_sync(q, r);
        };
        a.shared.in_engine.fetch_add(1, Ordering::Relaxed);
        let user_data = u64::from(r.index());
        // The token `r` ends here (it has no destructor): the op carries the request's ownership,
        // by index, until its completion callback (or `fail`) rebuilds it.
        a.shared.state.lock().pending.push((op, user_data));
    }

    fn commit(&self, q: &RequestQueue) {
        if let Mode::Async(a) = &self.mode {
            a.shared.flush(q, false);
        }
    }

    fn stop(&self) {
        if let Mode::Async(a) = &self.mode {
            let engine = a.shared.state.lock().engine.take();
            // Dropping the engine waits for every op in flight (their callbacks complete
            // them), joins its threads, and drops the callback, which holds the queue: the
            // `Arc` cycle queue -> driver -> engine -> callback -> queue ends here. (A
            // `commit` still running elsewhere, which the queue's contract rules out, would
            // hold the last clone and shut the engine down itself.)
            drop(engine);
            // If `start` never ran.
            a.completer.lock().take();
        }
    }

    fn extents_into(
        &self,
        offset: u64,
        len: u64,
        max: usize,
        out: &mut Vec<Extent>,
    ) -> Result<(), Error> {
        Ok(self.backend.extents_into(offset, len, max, out)?)
    }

    /// Zero-copy reads while no splice has failed ([`SpliceGate`]); writes received into
    /// their home while the backend still has them (a direct transfer that failed turns
    /// direct I/O off at run time: asked each time).
    fn caps(&self) -> Caps {
        Caps {
            splice: self.splice.open(),
            recv_home: self.home && self.backend.caps().recv_home,
            ..Caps::default()
        }
    }

    fn splice_read(&self, offset: u64, len: usize, pipe: BorrowedFd<'_>) -> Result<usize, Error> {
        self.splice.splice(&self.backend, offset, len, pipe)
    }

    fn recv_home(
        &self,
        offset: u64,
        len: usize,
        src: &mut dyn blk::RecvSource,
    ) -> Result<(), Error> {
        if !self.home {
            return Err(Error::Io(std::io::ErrorKind::Unsupported.into()));
        }
        Ok(self.backend.recv_at(offset, len, src)?)
    }

    fn max_merge(&self) -> u32 {
        match self.mode {
            Mode::Sync => u32::MAX,
            Mode::Async(_) => 1,
        }
    }

    fn describe(&self) -> String {
        let mut s = format!(
            "file path={} size={} engine={} direct={}",
            self.backend.path().display(),
            self.backend.size(),
            self.engine_name(),
            u8::from(self.backend.is_direct()),
        );
        if let Mode::Async(a) = &self.mode {
            match a.name {
                "uring" => s.push_str(&format!(" entries={}", a.size)),
                _ => s.push_str(&format!(" workers={}", a.size)),
            }
            if !a.inline {
                s.push_str(" inline=0");
            } else if self.backend.is_memory_backed() {
                s.push_str(" inline=all");
            }
        }
        if self.backend.is_read_only() {
            s.push_str(" ro=1");
        }
        s
    }
}
