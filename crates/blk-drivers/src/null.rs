//! The `null` driver, modelled on null_blk: the reference driver, small enough to read in one
//! sitting. It moves no data (unless memory-backed) and completes each request inline, on a
//! completion thread, or after a timer.

use std::time::{Duration, Instant};

use blkq_sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use blkq_sync::thread::{self, JoinHandle};
use blkq_sync::DynArc as Arc;
use blkq_sync::Mutex;

use blk::{Driver, Error, Extent, Op, RequestQueue, RequestToken};

use waitq::WaitQueue;

use crate::backend::mem::MemBackend;
use crate::backend::{exec_on_backend, Backend};
use crate::kind_options::{device_size, parse_bool, parse_num, Kind, KindOptions};

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

/// The `null:SIZE` kind ([`crate::spec::KINDS`]).
pub(crate) const KIND: Kind = Kind {
    name: "null",
    form: "null:SIZE",
    parse: |spec, arg, _| Ok(Box::new(SpecOptions::new(device_size(spec, arg)?))),
    arg_is_path: false,
    path_options: &[],
    read_only_options: &[],
    warning: None,
};

/// A `null:` spec's options: `completion` (`irqmode`), `completion_nsec`, `memory_backed`.
pub(crate) struct SpecOptions {
    size: u64,
    cfg: NullConfig,
    memory_backed: bool,
}

impl SpecOptions {
    /// The defaults, for a device of `size` bytes.
    pub(crate) fn new(size: u64) -> Self {
        Self {
            size,
            cfg: NullConfig::default(),
            memory_backed: false,
        }
    }
}

impl KindOptions for SpecOptions {
    fn set(&mut self, k: &str, v: &str) -> Result<bool, Error> {
        match k {
            "completion" | "irqmode" => self.cfg.completion = v.parse()?,
            "completion_nsec" => self.cfg.completion_nsec = parse_num(k, v)?,
            "memory_backed" => self.memory_backed = parse_bool(k, v)?,
            _ => return Ok(false),
        }
        Ok(true)
    }

    fn open(
        self: Box<Self>,
        cfg: &mut blk::QueueConfig,
        _: bool,
    ) -> Result<Box<dyn Driver>, Error> {
        cfg.limits.capacity = self.size;
        let mut null = self.cfg;
        if self.memory_backed {
            null.memory = Some(Arc::new(MemBackend::new(self.size)));
        }
        Ok(Box::new(NullDriver::new(null)))
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
/// | field     | meaning                                                                    |
/// |-----------|----------------------------------------------------------------------------|
/// | `q`       | requests pushed by `queue_rq`, not yet taken by the completion thread       |
/// | `pending` | `q.len()`, written under `q`'s lock, read without it by the thread's check |
/// | `stop`    | the driver is stopping: the thread drains `q` and exits                    |
/// | `idle`    | where the completion thread sleeps while `pending` is 0                    |
///
/// The sleep is the wait queue's protocol (`waitq`): the thread checks `pending` (and `stop`),
/// prepares, re-checks, sleeps. The submitter pushes under the lock (raising `pending`) and in
/// `commit` wakes the queue, whose SeqCst fence pairs with the one the thread's prepare
/// issues: either the re-check sees the push, or the waker sees the thread queued. An idle
/// queue costs the waker a fence and a load, no lock. One wake-up per batch, not per request:
/// waking a thread costs ~24 us here.
#[derive(Debug)]
struct Ring {
    q: Mutex<Vec<(RequestToken, Option<Instant>)>>,
    pending: AtomicUsize,
    stop: AtomicBool,
    idle: WaitQueue,
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
                stop: AtomicBool::new(false),
                idle: WaitQueue::new(),
            }),
            worker: Mutex::new(None),
        }
    }

    fn run_completions(ring: Arc<Ring>, q: Arc<RequestQueue>) {
        let mut local: Vec<(RequestToken, Option<Instant>)> = Vec::with_capacity(1024);
        loop {
            // Sleep until there is work or the driver stops (see `Ring`).
            let stop = ring.idle.wait_for(|| {
                if ring.pending.load(Ordering::Relaxed) > 0 {
                    Some(false)
                } else if ring.stop.load(Ordering::Relaxed) {
                    Some(true)
                } else {
                    None
                }
            });
            {
                let mut g = ring.q.lock();
                std::mem::swap(&mut *g, &mut local);
                ring.pending.store(0, Ordering::Relaxed);
            }
            if stop && local.is_empty() {
                return;
            }
            // One clock read for the batch (`thread` mode); in `timer` mode a request that
            // waited for its due time is timed after the wait, and starts a new batch.
            let mut clock = blk::stats::ClockBatch::enter();
            for (r, due) in local.drain(..) {
                if let Some(due) = due {
                    if wait_until(due) {
                        drop(clock);
                        clock = blk::stats::ClockBatch::enter();
                    }
                }
                q.complete(r, Ok(()));
            }
            drop(clock);
        }
    }
}

/// Waits for a deadline: spins when it is near (sleeping has ~60 us of slack), sleeps when not.
/// Returns whether it waited at all.
fn wait_until(due: Instant) -> bool {
    let mut waited = false;
    loop {
        let now = Instant::now();
        if now >= due {
            return waited;
        }
        waited = true;
        let left = due - now;
        if left > Duration::from_micros(200) {
            std::thread::sleep(left - Duration::from_micros(100));
        } else {
            std::hint::spin_loop();
        }
    }
}

impl Driver for NullDriver {
    fn start(&self, q: &Arc<RequestQueue>) {
        if self.cfg.completion == CompletionMode::Inline {
            return;
        }
        let (ring, q) = (self.ring.clone(), q.clone());
        let h = thread::spawn(move || Self::run_completions(ring, q));
        *self.worker.lock() = Some(h);
    }

    #[inline]
    fn queue_rq(&self, q: &RequestQueue, mut r: RequestToken) {
        let res = if let Some(mem) = &self.cfg.memory {
            // Every bio of a merge chain, in sector order.
            q.for_each_bio(&mut r, |bio| exec_on_backend(mem.as_ref(), bio))
        } else {
            // No data, but a read must return what block status claims: zeroes (not what the
            // buffer held before, a previous payload of the same client). Only the bio's
            // length is cleared.
            q.for_each_bio(&mut r, |bio| {
                if bio.op == Op::Read {
                    let len = bio.len as usize;
                    if let Some(b) = bio.buf.as_mut() {
                        let s = b.as_mut_slice();
                        let n = len.min(s.len());
                        s[..n].fill(0);
                    }
                }
                Ok(())
            })
        };
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

    fn commit(&self, _q: &RequestQueue) {
        if self.cfg.completion == CompletionMode::Inline {
            return;
        }
        // The wait queue's fence pairs with the completion thread's prepare (see `Ring`).
        self.ring.idle.wake_one();
    }

    fn stop(&self) {
        self.ring.stop.store(true, Ordering::Relaxed);
        self.ring.idle.wake_all();
        if let Some(h) = self.worker.lock().take() {
            let _ = h.join();
        }
    }

    fn extents_into(
        &self,
        offset: u64,
        len: u64,
        max: usize,
        out: &mut Vec<Extent>,
    ) -> Result<(), Error> {
        match &self.cfg.memory {
            Some(m) => Ok(m.extents_into(offset, len, max, out)?),
            None => {
                out.clear();
                out.push(Extent {
                    offset,
                    len,
                    allocated: false,
                });
                Ok(())
            }
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
