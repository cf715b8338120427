//! Drivers: `null` (the small reference driver, modelled on null_blk), the backend driver
//! behind `mem` (each request executed on a [`Backend`]), and the [`FileDriver`] behind `file`
//! (io_uring, a thread pool, or synchronous; see [`file`]).

use std::time::{Duration, Instant};

use blkq_sync::atomic::{fence, AtomicBool, AtomicUsize, Ordering};
use blkq_sync::thread::{self, JoinHandle, Thread};
use std::sync::Arc;

use blkq_sync::Mutex;

use crate::backend::{Backend, Extent};
use crate::bio::{Bio, BioFlags, Op};
use crate::queue::{Driver, QueueCore, RqRef};
use crate::Error;

pub mod file;

pub use file::{FileDriver, FileDriverConfig, FileEngineChoice};

/// Executes a bio on a backend, synchronously. Shared by every backend-based driver.
pub fn exec_on_backend(be: &dyn Backend, bio: &mut Bio) -> Result<(), Error> {
    let off = bio.offset();
    let len = bio.len as usize;
    match bio.op {
        Op::Read => {
            let buf = bio.buf.as_mut().ok_or(Error::NoBuffer)?;
            be.read_at(off, &mut buf.as_mut_slice()[..len])?;
        }
        Op::Write => {
            let buf = bio.buf.as_ref().ok_or(Error::NoBuffer)?;
            be.write_at(
                off,
                &buf.as_slice()[..len],
                bio.flags.contains(BioFlags::FUA),
            )?;
        }
        Op::Flush => be.flush()?,
        Op::Discard => be.discard(off, len as u64)?,
        Op::WriteZeroes => {
            if bio.flags.contains(BioFlags::FAST_ZERO) && !be.fast_zero() {
                return Err(Error::NotSupported("fast zero"));
            }
            be.write_zeroes(off, len as u64, !bio.flags.contains(BioFlags::NO_HOLE))?;
        }
    }
    Ok(())
}

/// When the `null` driver completes a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CompletionMode {
    /// In `queue_rq`, on the submitter's thread (null_blk's `irqmode=0`).
    #[default]
    Inline,
    /// On a completion thread, as soon as it gets to it (`irqmode=1`, softirq).
    Thread,
    /// On a completion thread, `completion_nsec` after submission (`irqmode=2`, timer).
    Timer,
}

impl std::str::FromStr for CompletionMode {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        match s {
            "inline" | "none" | "0" => Ok(Self::Inline),
            "thread" | "softirq" | "1" => Ok(Self::Thread),
            "timer" | "2" => Ok(Self::Timer),
            _ => Err(Error::Config(format!(
                "unknown completion {s:?} (expected inline, thread or timer)"
            ))),
        }
    }
}

/// Options of the `null` driver.
#[derive(Debug, Clone, Default)]
pub struct NullConfig {
    /// When requests complete.
    pub completion: CompletionMode,
    /// Delay of `Timer` completions.
    pub completion_nsec: u64,
    /// Keep the data (in a sparse memory backend) instead of discarding it.
    pub memory: Option<Arc<dyn Backend>>,
}

/// The completion ring of the thread/timer modes.
///
/// | field      | meaning                                                                   |
/// |------------|---------------------------------------------------------------------------|
/// | `pending`  | requests pushed and not yet taken by the completion thread (under `q`)     |
/// | `sleeping` | the completion thread is parked or about to park                          |
///
/// Submitter: push under the lock (raising `pending`), then in `commit` fence (SeqCst) and
/// unpark only if `sleeping`. Completion thread: store `sleeping`, fence (SeqCst), re-check
/// `pending`, park. The fences pair: either the thread sees the push, or the submitter sees
/// it sleeping. One unpark per batch, not per request: waking a thread costs ~24 us here.
#[derive(Debug)]
struct Ring {
    q: Mutex<Vec<(RqRef, Option<Instant>)>>,
    pending: AtomicUsize,
    sleeping: AtomicBool,
    stop: AtomicBool,
    thread: Mutex<Option<Thread>>,
}

/// The `null` driver: no data (unless memory-backed), completions inline, on a thread, or
/// after a timer. Kept small: it is the reference driver.
#[derive(Debug)]
pub struct NullDriver {
    cfg: NullConfig,
    ring: Arc<Ring>,
    worker: Mutex<Option<JoinHandle<()>>>,
}

impl NullDriver {
    /// A null driver.
    pub fn new(cfg: NullConfig) -> Self {
        Self {
            cfg,
            ring: Arc::new(Ring {
                q: Mutex::new(Vec::with_capacity(1024)),
                pending: AtomicUsize::new(0),
                sleeping: AtomicBool::new(false),
                stop: AtomicBool::new(false),
                thread: Mutex::new(None),
            }),
            worker: Mutex::new(None),
        }
    }

    fn run_completions(ring: Arc<Ring>, q: Arc<QueueCore>) {
        let mut local: Vec<(RqRef, Option<Instant>)> = Vec::with_capacity(1024);
        loop {
            {
                let mut g = ring.q.lock();
                std::mem::swap(&mut *g, &mut local);
                ring.pending.store(0, Ordering::Relaxed);
            }
            if local.is_empty() {
                if ring.stop.load(Ordering::Relaxed) {
                    return;
                }
                ring.sleeping.store(true, Ordering::Relaxed);
                // Pairs with the fence in `commit` (see `Ring`).
                fence(Ordering::SeqCst);
                if ring.pending.load(Ordering::Relaxed) == 0 && !ring.stop.load(Ordering::Relaxed) {
                    thread::park();
                }
                ring.sleeping.store(false, Ordering::Relaxed);
                continue;
            }
            for (r, due) in local.drain(..) {
                if let Some(due) = due {
                    wait_until(due);
                }
                q.complete(r, Ok(()));
            }
        }
    }
}

/// Waits for a deadline: spins when it is near (sleeping has ~60 us of slack), sleeps when not.
fn wait_until(due: Instant) {
    loop {
        let now = Instant::now();
        if now >= due {
            return;
        }
        let left = due - now;
        if left > Duration::from_micros(200) {
            std::thread::sleep(left - Duration::from_micros(100));
        } else {
            std::hint::spin_loop();
        }
    }
}

impl Driver for NullDriver {
    fn start(&self, q: &Arc<QueueCore>) {
        if self.cfg.completion == CompletionMode::Inline {
            return;
        }
        let (ring, q) = (self.ring.clone(), q.clone());
        let h = thread::spawn(move || Self::run_completions(ring, q));
        *self.ring.thread.lock() = Some(h.thread().clone());
        *self.worker.lock() = Some(h);
    }

    #[inline]
    fn queue_rq(&self, q: &QueueCore, mut r: RqRef) {
        let mut res = Ok(());
        if let Some(mem) = &self.cfg.memory {
            // Every bio of a merge chain, in sector order.
            res = q.for_each_bio(&mut r, |bio| exec_on_backend(mem.as_ref(), bio));
        }
        match self.cfg.completion {
            CompletionMode::Inline => q.complete(r, res),
            _ if res.is_err() => q.complete(r, res),
            CompletionMode::Thread | CompletionMode::Timer => {
                // The clock is read only in timer mode (~33 ns a read here).
                let due = (self.cfg.completion == CompletionMode::Timer)
                    .then(|| Instant::now() + Duration::from_nanos(self.cfg.completion_nsec));
                let mut g = self.ring.q.lock();
                g.push((r, due));
                self.ring.pending.store(g.len(), Ordering::Relaxed);
            }
        }
    }

    fn commit(&self, _q: &QueueCore) {
        if self.cfg.completion == CompletionMode::Inline {
            return;
        }
        // Pairs with the fence of the completion thread before it parks (see `Ring`).
        fence(Ordering::SeqCst);
        if self.ring.sleeping.load(Ordering::Relaxed) {
            if let Some(t) = self.ring.thread.lock().as_ref() {
                t.unpark();
            }
        }
    }

    fn stop(&self) {
        self.ring.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.ring.thread.lock().as_ref() {
            t.unpark();
        }
        if let Some(h) = self.worker.lock().take() {
            let _ = h.join();
        }
    }

    fn extents(&self, offset: u64, len: u64, max: usize) -> Result<Vec<Extent>, Error> {
        match &self.cfg.memory {
            Some(m) => Ok(m.extents(offset, len, max)?),
            None => Ok(vec![Extent {
                offset,
                len,
                allocated: false,
            }]),
        }
    }

    fn max_merge(&self) -> u32 {
        u32::MAX
    }

    fn describe(&self) -> String {
        format!(
            "null completion={:?} completion_nsec={} memory_backed={}",
            self.cfg.completion,
            self.cfg.completion_nsec,
            self.cfg.memory.is_some()
        )
    }
}

/// A driver that executes each request synchronously on a [`Backend`] in `queue_rq`
/// (`mem:` devices; `file:` devices with `engine=sync` do the same in [`FileDriver`]).
#[derive(Debug)]
pub struct BackendDriver {
    name: &'static str,
    backend: Arc<dyn Backend>,
}

impl BackendDriver {
    /// A driver over `backend`, described as `name`.
    pub fn new(name: &'static str, backend: Arc<dyn Backend>) -> Self {
        Self { name, backend }
    }
}

impl Driver for BackendDriver {
    #[inline]
    fn queue_rq(&self, q: &QueueCore, mut r: RqRef) {
        // Every bio of a merge chain, in sector order; the chain completes with the first
        // error, if any.
        let res = q.for_each_bio(&mut r, |bio| exec_on_backend(self.backend.as_ref(), bio));
        q.complete(r, res);
    }

    fn max_merge(&self) -> u32 {
        u32::MAX
    }

    fn extents(&self, offset: u64, len: u64, max: usize) -> Result<Vec<Extent>, Error> {
        Ok(self.backend.extents(offset, len, max)?)
    }

    fn describe(&self) -> String {
        format!("{} size={}", self.name, self.backend.size())
    }
}
