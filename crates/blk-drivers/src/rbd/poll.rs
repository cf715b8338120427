//! The `rbd` driver's completion thread for `completion=poll`: one per device, it waits on
//! the eventfd librbd signals (`rbd_set_image_notification`), takes the completed
//! completions in batches (`rbd_poll_io_events`) and hands each batch to the driver.
//!
//! # Invariants
//!
//! - **Who owns a slot.** From `queue_rq`'s submit until the driver's batch handler finishes
//!   the request, the request's slot (and the request, given up as its bare index) belongs to
//!   the librbd completion that carries the slot's address as its argument; once librbd has
//!   completed it, to this thread, which alone takes it out of librbd's queue
//!   (`rbd_poll_io_events` hands each completion out once). A FUA write's flush is submitted
//!   from this thread and carries the same slot: the request stays owned until the flush is
//!   polled.
//! - **Wake-ups coalesce.** librbd writes 1 to the eventfd per completion it queues, and one
//!   `read` takes (and zeroes) the sum, so one wake-up may stand for many completions, and a
//!   completion polled in an earlier drain may leave a wake-up with nothing to take. Each
//!   wake-up therefore polls until `rbd_poll_io_events` returns 0: librbd queues a completion
//!   before it signals, so one queued after that last empty poll has signalled the eventfd
//!   again and the next `read` returns.
//! - **Shutdown order.** The driver's `stop` first waits until no request is in flight (every
//!   completion, flushes of FUA writes included, has been polled and finished here), then
//!   [`Poller::stop`] sets `stop`, signals the eventfd and joins this thread, and only then is
//!   the image closed: no completion is left pending in librbd, and none is polled from a
//!   closed image.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::ptr;

use blkq_sync::atomic::{AtomicBool, AtomicU64, Ordering};
use blkq_sync::Arc;
use std::thread::JoinHandle;

use super::ffi;

/// Completions taken by one `rbd_poll_io_events` call at most (the thread's array).
pub const POLL_BATCH: usize = 32;

/// How the completion thread's wake-ups went: completions per wake-up, for tests and figures.
/// Every counter is Relaxed: each is a statistic on its own, read after the I/O it counts
/// has completed (that completion orders the read after the count).
#[derive(Debug, Default)]
pub struct BatchCounters {
    wakeups: AtomicU64,
    completions: AtomicU64,
    largest: AtomicU64,
}

impl BatchCounters {
    /// Wake-ups that found at least one completion.
    pub fn wakeups(&self) -> u64 {
        self.wakeups.load(Ordering::Relaxed)
    }

    /// Completions taken in all.
    pub fn completions(&self) -> u64 {
        self.completions.load(Ordering::Relaxed)
    }

    /// The most completions one wake-up took.
    pub fn largest(&self) -> u64 {
        self.largest.load(Ordering::Relaxed)
    }

    /// Counts `got` more completions of a wake-up that has now taken `took` (`got` of them
    /// included); before they are completed, so that a request's completion is counted by the
    /// time its submitter sees it.
    fn record(&self, got: u64, took: u64) {
        // Relaxed: see the type's docs (only this thread writes them).
        if took == got {
            self.wakeups.fetch_add(1, Ordering::Relaxed);
        }
        self.completions.fetch_add(got, Ordering::Relaxed);
        self.largest.fetch_max(took, Ordering::Relaxed);
    }
}

/// What the thread and the driver share.
struct Wake {
    efd: OwnedFd,
    /// Set by [`Poller::stop`] before it signals the eventfd. Release there, Acquire in the
    /// thread: the thread that sees it also sees that the driver has drained every request.
    stop: AtomicBool,
}

/// The image handle, as the thread holds it.
struct Image(ffi::rbd_image_t);

// SAFETY: librbd allows an image handle to be used from any thread; the driver keeps the image
// open until this thread has been joined (module docs, shutdown order).
unsafe impl Send for Image {}

/// The completion thread and its eventfd (module docs).
pub(super) struct Poller {
    wake: Arc<Wake>,
    thread: Option<JoinHandle<()>>,
}

impl Poller {
    /// Registers an eventfd with `image` (from now on, completions created without a callback
    /// are queued for polling) and starts the thread, which calls `on_batch` with each batch
    /// of completed completions (each to be released by `on_batch`).
    pub(super) fn start(
        image: ffi::rbd_image_t,
        counters: Arc<BatchCounters>,
        on_batch: impl FnMut(&[ffi::rbd_completion_t]) + Send + 'static,
    ) -> io::Result<Self> {
        // SAFETY: no pointers; a new descriptor or -1.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just created and is owned by nothing else.
        let efd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: an open image and an eventfd that stays open as long as the image does (the
        // driver closes the image before it drops this `Poller`).
        let r = unsafe {
            ffi::rbd_set_image_notification(image, efd.as_raw_fd(), ffi::EVENT_TYPE_EVENTFD)
        };
        if r < 0 {
            return Err(io::Error::from_raw_os_error(-r));
        }
        let wake = Arc::new(Wake {
            efd,
            stop: AtomicBool::new(false),
        });
        let w2 = Arc::clone(&wake);
        let img = Image(image);
        let thread = std::thread::Builder::new()
            .name("blkq-rbd-poll".into())
            .spawn(move || run(&w2, &img, &counters, on_batch))?;
        Ok(Self {
            wake,
            thread: Some(thread),
        })
    }

    /// Stops and joins the thread; the caller has drained every request first (module docs).
    pub(super) fn stop(&mut self) {
        let Some(t) = self.thread.take() else {
            return;
        };
        // Release: see `Wake::stop`.
        self.wake.stop.store(true, Ordering::Release);
        signal(&self.wake.efd);
        if t.thread().id() == std::thread::current().id() {
            // Not reached through the driver (its drain, before this, would wait for the very
            // request this thread is completing); joining itself would fail, so detach.
            return;
        }
        let _ = t.join();
    }
}

impl Drop for Poller {
    fn drop(&mut self) {
        self.stop();
    }
}

fn signal(efd: &OwnedFd) {
    let one = 1u64;
    // SAFETY: writes 8 bytes from a live u64 to an eventfd we own; it can only fail if the
    // counter would overflow, which then wakes the reader anyway.
    unsafe { libc::write(efd.as_raw_fd(), (&one as *const u64).cast(), 8) };
}

/// The thread: wait, drain, repeat (module docs).
fn run(
    wake: &Wake,
    image: &Image,
    counters: &BatchCounters,
    mut on_batch: impl FnMut(&[ffi::rbd_completion_t]),
) {
    let mut comps: [ffi::rbd_completion_t; POLL_BATCH] = [ptr::null_mut(); POLL_BATCH];
    loop {
        let mut n = 0u64;
        // SAFETY: reads 8 bytes into a live u64 from an eventfd we own (blocking until it is
        // non-zero).
        let r = unsafe {
            libc::read(
                wake.efd.as_raw_fd(),
                (&mut n as *mut u64).cast(),
                std::mem::size_of::<u64>(),
            )
        };
        if r < 0 && io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
            // Nothing to do but try again; do not spin.
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        // One clock read for every completion of this wake-up (`blk::stats`).
        let clock = blk::stats::ClockBatch::enter();
        let mut took = 0u64;
        loop {
            // SAFETY: the image is open (shutdown order); `comps` has room for `POLL_BATCH`.
            let got = unsafe {
                ffi::rbd_poll_io_events(image.0, comps.as_mut_ptr(), POLL_BATCH as libc::c_int)
            };
            let Ok(got) = usize::try_from(got) else { break };
            if got == 0 {
                break;
            }
            took += got as u64;
            counters.record(got as u64, took);
            on_batch(&comps[..got.min(POLL_BATCH)]);
        }
        drop(clock);
        // Acquire: see `Wake::stop`.
        if wake.stop.load(Ordering::Acquire) {
            return;
        }
    }
}
