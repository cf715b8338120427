//! The fault device's timer: delayed completions, queued by whichever thread completes an I/O
//! and delivered by the device's own timer thread (spawned on the first delayed completion).
//! What an item is and how it is delivered are the device's: the timer only keeps items until
//! they are due and hands each to the delivery its thread runs (`Timer::run`).
//!
//! # Waiting
//!
//! The timer thread sleeps on `Timer::wq` (a `waitq::WaitQueue`), never on a bare park.
//! Its condition is "the queue changed since I looked": it remembers `TimerQ::n` (bumped by
//! every push) and re-checks `n` and `stop` under the timer lock after queueing itself, so a
//! push between its look and its sleep is never lost (the wait queue's prepare / re-check /
//! sleep / finish protocol). It sleeps until its earliest deadline, or without a deadline when
//! the queue is empty. Pushers and the device's drop change the queue under the lock, drop the
//! lock, then `wake_one` (a fence and a load when the thread is not asleep). Only the timer
//! thread ever waits there, so the exclusive wake-up always reaches it.
//!
//! The device's drop sets `stop` (the thread delivers everything it holds at once, then
//! exits; later completions are delivered by whoever completes them) and joins the thread,
//! unless the drop runs on it (`join`).
//!
//! The queue is a vector with the capacity of the device's warm-up; `wake_one` and the wait
//! queue's own entry reuse their storage, so a delayed I/O allocates nothing in steady state.

use std::time::Instant;

use blkq_sync::thread;
use blkq_sync::Mutex;
use waitq::WaitQueue;

struct Delayed<T> {
    due: Instant,
    n: u64,
    item: T,
}

struct TimerQ<T> {
    items: Vec<Delayed<T>>,
    /// Pushes so far (also the FIFO tie-break among equal deadlines).
    n: u64,
    /// Set by the device's drop: deliver everything now, then exit.
    stop: bool,
    /// Whether the timer thread was spawned.
    spawned: bool,
    /// The timer thread, for the device's drop to join (taken by [`Timer::stop`]).
    thread: Option<thread::JoinHandle<()>>,
}

/// Items of type `T` waiting for their deadline, and the wait queue of the thread that
/// delivers them.
pub(super) struct Timer<T> {
    q: Mutex<TimerQ<T>>,
    /// The timer thread sleeps here (condition: `TimerQ::n` or `TimerQ::stop` changed, or its
    /// earliest deadline passed); woken by [`Timer::push`] after queueing and by
    /// [`Timer::stop`].
    wq: WaitQueue,
}

impl<T> Timer<T> {
    /// An empty queue with room for `n` delayed completions before it grows.
    pub(super) fn with_capacity(n: usize) -> Self {
        Self {
            q: Mutex::new(TimerQ {
                items: Vec::with_capacity(n),
                n: 0,
                stop: false,
                spawned: false,
                thread: None,
            }),
            wq: WaitQueue::new(),
        }
    }

    /// Queues `item` for `due`; `spawn` starts the timer thread (which must run
    /// [`Timer::run`]) on the first push. `Err(item)` once the timer is stopped: the caller
    /// delivers it now.
    pub(super) fn push(
        &self,
        due: Instant,
        item: T,
        spawn: impl FnOnce() -> thread::JoinHandle<()>,
    ) -> Result<(), T> {
        let mut q = self.q.lock();
        if q.stop {
            return Err(item);
        }
        let n = q.n;
        q.n += 1;
        q.items.push(Delayed { due, n, item });
        if q.spawned {
            drop(q);
            self.wq.wake_one();
        } else {
            q.spawned = true;
            // Spawned under the lock (once per device), so that `stop`, which takes the
            // handle under it, never sees a thread spawned without its handle. The thread's
            // first look waits for this lock.
            q.thread = Some(spawn());
        }
        Ok(())
    }

    /// Tells the timer thread to deliver what it holds and exit, and makes every later
    /// completion be delivered at once (the device's drop). Returns the thread to join, if
    /// it was spawned.
    pub(super) fn stop(&self) -> Option<thread::JoinHandle<()>> {
        let t = {
            let mut q = self.q.lock();
            q.stop = true;
            q.thread.take()
        };
        self.wq.wake_one();
        t
    }

    /// The timer thread's loop: hands what is due to `deliver` (earliest first, FIFO among
    /// equals), sleeps on `wq` until the next deadline or a change of the queue.
    pub(super) fn run(&self, deliver: impl Fn(T)) {
        loop {
            let (next, seen) = {
                let mut q = self.q.lock();
                let now = Instant::now();
                let min = q
                    .items
                    .iter()
                    .enumerate()
                    .min_by_key(|(_, d)| (d.due, d.n))
                    .map(|(i, d)| (i, d.due));
                let next = match min {
                    None if q.stop => return,
                    None => None,
                    Some((i, due)) if due <= now || q.stop => Some(Ok(q.items.swap_remove(i))),
                    Some((_, due)) => Some(Err(due)),
                };
                (next, q.n)
            };
            // The re-check: anything pushed (or a stop) since the look above.
            let changed = || {
                let q = self.q.lock();
                (q.n != seen || q.stop).then_some(())
            };
            match next {
                Some(Ok(d)) => deliver(d.item),
                None => self.wq.wait_for(changed),
                Some(Err(due)) => {
                    // `None` (the deadline passed) and `Some` (a change) both mean: look again.
                    let _ = self.wq.wait_for_until(changed, due);
                }
            }
        }
    }
}

/// Waits for the timer thread `t` to exit, unless this is the timer thread (a completion it
/// delivered dropped the device): it exits when that completion returns.
pub(super) fn join(t: thread::JoinHandle<()>) {
    if t.thread().id() != thread::current().id() {
        // A panic there was an end-io's, and reported on that thread already.
        let _ = t.join();
    }
}
