//! The fault device's timer: delayed completions, queued by whichever thread completes an I/O
//! and delivered by the device's own timer thread (spawned on the first delayed completion).
//!
//! # Waiting
//!
//! The timer thread sleeps on `Shared::timer_wq` (a `waitq::WaitQueue`), never on a bare park.
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
//! unless the drop runs on it (`join_timer`).
//!
//! The queue is a vector with the capacity of the device's warm-up; `wake_one` and the wait
//! queue's own entry reuse their storage, so a delayed I/O allocates nothing in steady state.

use std::time::{Duration, Instant};

use blk::{Bio, EndIo, Error};
use blkq_sync::thread;
use blkq_sync::DynArc as Arc;

use super::{bump, Ack, Shared};

struct Delayed {
    due: Instant,
    n: u64,
    bio: Bio,
    res: Result<(), Error>,
    end: Arc<dyn EndIo>,
    ack: Ack,
}

#[derive(Default)]
pub(super) struct TimerQ {
    items: Vec<Delayed>,
    /// Pushes so far (also the FIFO tie-break among equal deadlines).
    n: u64,
    /// Set by the device's drop: deliver everything now, then exit.
    stop: bool,
    /// Whether the timer thread was spawned.
    spawned: bool,
    /// The timer thread, for the device's drop to join (taken by `stop_timer`).
    thread: Option<thread::JoinHandle<()>>,
}

impl TimerQ {
    /// An empty queue with room for `n` delayed completions before it grows.
    pub(super) fn with_capacity(n: usize) -> Self {
        Self {
            items: Vec::with_capacity(n),
            ..Self::default()
        }
    }
}

impl Shared {
    /// Delivers now, or after `ack.delay` on the timer thread.
    pub(super) fn complete(
        self: &Arc<Self>,
        bio: Bio,
        res: Result<(), Error>,
        end: Arc<dyn EndIo>,
        ack: Ack,
    ) {
        if ack.delay.is_zero() {
            self.deliver(bio, res, &end, ack);
            return;
        }
        bump(&self.counters.delayed);
        // Absurd delays (a `Duration::MAX` rule) are clamped, never a panic.
        let now = Instant::now();
        let due = now
            .checked_add(ack.delay)
            .or_else(|| now.checked_add(Duration::from_secs(1 << 32)))
            .unwrap_or(now);
        let mut q = self.timer.lock();
        if q.stop {
            drop(q);
            self.deliver(bio, res, &end, ack);
            return;
        }
        let n = q.n;
        q.n += 1;
        q.items.push(Delayed {
            due,
            n,
            bio,
            res,
            end,
            ack,
        });
        if q.spawned {
            drop(q);
            self.timer_wq.wake_one();
        } else {
            q.spawned = true;
            let sh = self.clone();
            // Spawned under the lock (once per device), so that `stop_timer`, which takes the
            // handle under it, never sees a thread spawned without its handle. The thread's
            // first look waits for this lock.
            q.thread = Some(thread::spawn(move || sh.run_timer()));
        }
    }

    /// Tells the timer thread to deliver what it holds and exit, and makes every later
    /// completion be delivered at once (the device's drop). Returns the thread to join, if
    /// it was spawned.
    pub(super) fn stop_timer(&self) -> Option<thread::JoinHandle<()>> {
        let t = {
            let mut q = self.timer.lock();
            q.stop = true;
            q.thread.take()
        };
        self.timer_wq.wake_one();
        t
    }

    /// Waits for the timer thread to exit, unless this is the timer thread (a completion it
    /// delivered dropped the device): it exits when that completion returns.
    pub(super) fn join_timer(&self, t: thread::JoinHandle<()>) {
        if t.thread().id() != thread::current().id() {
            // A panic there was an end-io's, and reported on that thread already.
            let _ = t.join();
        }
    }

    /// The timer thread's loop: delivers what is due (earliest first, FIFO among equals),
    /// sleeps on `timer_wq` until the next deadline or a change of the queue.
    fn run_timer(&self) {
        loop {
            let (next, seen) = {
                let mut q = self.timer.lock();
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
                let q = self.timer.lock();
                (q.n != seen || q.stop).then_some(())
            };
            match next {
                Some(Ok(d)) => self.deliver(d.bio, d.res, &d.end, d.ack),
                None => self.timer_wq.wait_for(changed),
                Some(Err(due)) => {
                    // `None` (the deadline passed) and `Some` (a change) both mean: look again.
                    let _ = self.timer_wq.wait_for_until(changed, due);
                }
            }
        }
    }
}
