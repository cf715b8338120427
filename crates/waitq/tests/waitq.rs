//! Unit tests of `WaitQueue` and `Completion` with plain std threads.
//!
//! Every blocking step is bounded: threads under test report back over an `mpsc` channel that
//! the test reads with `recv_timeout`, and "wait until k waiters are queued" polls with a
//! deadline. A lost wake-up therefore fails a test instead of hanging it.
// A plain threaded test or benchmark, never a loom model: its own harness (std locks, atomics,
// condition variables, baselines) is not what a model must explore, so it may use std::sync.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]
#![cfg(not(blkq_loom))]

use std::future::Future;
use std::pin::pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::thread;
use std::time::{Duration, Instant};

use testkit::wait_until;
use waitq::{CancelToken, Completion, Error, WaitQueue};

/// How long a test waits for something that should happen promptly.
const PROMPT: Duration = Duration::from_secs(1);

/// A thread whose result is awaited with a timeout.
struct Bounded<T> {
    rx: mpsc::Receiver<T>,
    handle: thread::JoinHandle<()>,
}

fn spawn_bounded<T, F>(f: F) -> Bounded<T>
where
    T: Send + 'static,
    F: FnOnce() -> T + Send + 'static,
{
    let (tx, rx) = mpsc::channel();
    let handle = thread::spawn(move || {
        let _ = tx.send(f());
    });
    Bounded { rx, handle }
}

impl<T> Bounded<T> {
    /// The thread's result, or a panic if it does not finish within `within`.
    fn join_within(self, within: Duration) -> T {
        match self.rx.recv_timeout(within) {
            Ok(v) => {
                self.handle.join().expect("thread panicked");
                v
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                // The sender is gone without a value: the thread panicked; show its panic.
                match self.handle.join() {
                    Err(p) => std::panic::resume_unwind(p),
                    Ok(()) => unreachable!("thread ended without sending"),
                }
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {
                panic!("thread did not finish within {within:?} (lost wake-up?)")
            }
        }
    }

    fn join(self) -> T {
        self.join_within(PROMPT)
    }

    /// Whether the thread has produced its result by now (without waiting).
    fn try_result(&self) -> Option<T> {
        self.rx.try_recv().ok()
    }
}

/// Waits until `wq` has exactly `k` queued waiters.
fn wait_for_waiters(wq: &WaitQueue, k: usize) {
    wait_until(&format!("{k} waiters queued"), || wq.waiters() == k);
}

/// Takes one token from `tokens` if there is one (the condition of the `WaitQueue` tests).
fn take_token(tokens: &AtomicUsize) -> Option<()> {
    tokens
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |t| t.checked_sub(1))
        .ok()
        .map(|_| ())
}

/// State shared by the `WaitQueue` tests: a queue and a token counter as its condition.
#[derive(Default)]
struct Tokens {
    wq: WaitQueue,
    tokens: AtomicUsize,
}

impl Tokens {
    /// Adds `n` tokens, then wakes up to `n` waiters; returns how many were woken.
    fn give(&self, n: usize) -> usize {
        self.tokens.fetch_add(n, Ordering::Release);
        self.wq.wake_n(n)
    }
}

/// Spawns `n` threads that each take one token, queued in order 0..n (each thread is queued
/// before the next one starts), recording the order in which they got their token.
fn queue_token_takers(
    s: &Arc<Tokens>,
    n: usize,
    order: &Arc<Mutex<Vec<usize>>>,
) -> Vec<Bounded<()>> {
    (0..n)
        .map(|i| {
            let (s2, order2) = (Arc::clone(s), Arc::clone(order));
            let b = spawn_bounded(move || {
                s2.wq.wait_for(|| take_token(&s2.tokens));
                order2.lock().unwrap().push(i);
            });
            wait_for_waiters(&s.wq, i + 1);
            b
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// WaitQueue
// ---------------------------------------------------------------------------------------------

#[test]
fn wake_one_is_fifo() {
    let s = Arc::new(Tokens::default());
    let order = Arc::new(Mutex::new(Vec::new()));
    let threads = queue_token_takers(&s, 3, &order);

    for k in 1..=3 {
        s.tokens.fetch_add(1, Ordering::Release);
        assert!(s.wq.wake_one(), "wake_one must find a waiter");
        wait_until(&format!("{k} threads woken"), || {
            order.lock().unwrap().len() == k
        });
        assert_eq!(s.wq.waiters(), 3 - k);
    }
    for t in threads {
        t.join();
    }
    assert_eq!(
        *order.lock().unwrap(),
        vec![0, 1, 2],
        "wake_one must wake oldest first"
    );
}

#[test]
fn wake_n_wakes_exactly_n_oldest() {
    let s = Arc::new(Tokens::default());
    let order = Arc::new(Mutex::new(Vec::new()));
    let mut threads = queue_token_takers(&s, 3, &order);

    // The entries are removed under the lock before `wake_n` returns.
    assert_eq!(s.give(2), 2);
    assert_eq!(s.wq.waiters(), 1);
    let last = threads.pop().expect("three threads");
    for t in threads {
        t.join();
    }
    let mut woken = order.lock().unwrap().clone();
    woken.sort_unstable();
    assert_eq!(woken, vec![0, 1], "wake_n(2) must wake the two oldest");

    // The third one is still asleep: give it a moment to (wrongly) run, then check.
    thread::sleep(Duration::from_millis(20));
    assert!(
        last.try_result().is_none(),
        "a third waiter was woken by wake_n(2)"
    );
    assert_eq!(s.wq.waiters(), 1);
    assert_eq!(order.lock().unwrap().len(), 2);

    assert_eq!(s.give(1), 1);
    last.join();
    assert_eq!(order.lock().unwrap().len(), 3);
    assert_eq!(s.wq.waiters(), 0);
}

#[test]
fn wake_n_larger_than_queue_wakes_all_queued() {
    let s = Arc::new(Tokens::default());
    let order = Arc::new(Mutex::new(Vec::new()));
    let threads = queue_token_takers(&s, 2, &order);
    s.tokens.fetch_add(2, Ordering::Release);
    assert_eq!(s.wq.wake_n(5), 2);
    for t in threads {
        t.join();
    }
    assert_eq!(s.wq.waiters(), 0);
}

#[test]
fn wake_all_wakes_all() {
    let wq = Arc::new(WaitQueue::new());
    let go = Arc::new(AtomicBool::new(false));
    let threads: Vec<_> = (0..3)
        .map(|i| {
            let (wq2, go2) = (Arc::clone(&wq), Arc::clone(&go));
            let b = spawn_bounded(move || {
                wq2.wait_for(|| go2.load(Ordering::Acquire).then_some(()));
            });
            wait_for_waiters(&wq, i + 1);
            b
        })
        .collect();

    go.store(true, Ordering::Release);
    assert_eq!(wq.wake_all(), 3);
    assert_eq!(wq.waiters(), 0);
    for t in threads {
        t.join();
    }
}

#[test]
fn wake_with_no_waiters_returns_zero() {
    let wq = WaitQueue::new();
    assert_eq!(wq.waiters(), 0);
    assert!(!wq.wake_one());
    assert_eq!(wq.wake_n(1), 0);
    assert_eq!(wq.wake_n(10), 0);
    assert_eq!(wq.wake_all(), 0);
}

#[test]
fn wake_n_zero_wakes_no_one() {
    let s = Arc::new(Tokens::default());
    let order = Arc::new(Mutex::new(Vec::new()));
    let mut threads = queue_token_takers(&s, 1, &order);
    assert_eq!(s.wq.wake_n(0), 0);
    assert_eq!(s.wq.waiters(), 1);
    assert_eq!(s.give(1), 1);
    threads.pop().expect("one thread").join();
}

#[test]
fn prepare_recheck_finish_without_sleep() {
    // A waiter whose re-check succeeds leaves the queue; `finish` says no waker chose it.
    let wq = WaitQueue::new();
    let w = wq.prepare();
    assert_eq!(wq.waiters(), 1);
    assert!(!w.finish());
    assert_eq!(wq.waiters(), 0);

    // A waiter chosen by a waker before it finishes is told so.
    let w = wq.prepare();
    assert!(wq.wake_one());
    assert_eq!(wq.waiters(), 0);
    w.sleep(); // the unpark is already pending: returns at once
    assert!(w.finish());
}

/// The pass-on rule, written once: `finish_and_pass_on` / `finish_async_and_pass_on` call the
/// pass-on action exactly when a waker chose the waiter, and never otherwise.
#[test]
fn finish_and_pass_on_passes_only_a_spent_wake_up() {
    let wq = WaitQueue::new();
    let passed = std::cell::Cell::new(0);

    let w = wq.prepare();
    assert!(!w.finish_and_pass_on(|| passed.set(passed.get() + 1)));
    assert_eq!(
        (passed.get(), wq.waiters()),
        (0, 0),
        "not chosen: nothing to pass on"
    );

    let w = wq.prepare();
    assert!(wq.wake_one());
    w.sleep(); // the unpark is already pending: returns at once
    assert!(w.finish_and_pass_on(|| passed.set(passed.get() + 1)));
    assert_eq!(passed.get(), 1, "chosen: passed on");

    let waker = futures::task::noop_waker();
    let k = wq.prepare_async(&waker);
    assert!(!wq.finish_async_and_pass_on(k, || passed.set(passed.get() + 1)));
    assert_eq!(passed.get(), 1);
    let k = wq.prepare_async(&waker);
    assert!(wq.wake_one());
    assert!(wq.finish_async_and_pass_on(k, || passed.set(passed.get() + 1)));
    assert_eq!((passed.get(), wq.waiters()), (2, 0));
}

#[test]
fn dropped_chosen_waiter_passes_the_wake_up_on() {
    let s = Arc::new(Tokens::default());
    let order = Arc::new(Mutex::new(Vec::new()));
    // Queue ourselves first, then a thread behind us.
    let w = s.wq.prepare();
    let (s2, order2) = (Arc::clone(&s), Arc::clone(&order));
    let t = spawn_bounded(move || {
        s2.wq.wait_for(|| take_token(&s2.tokens));
        order2.lock().unwrap().push(1);
    });
    wait_for_waiters(&s.wq, 2);
    assert_eq!(s.give(1), 1); // chooses us, the head
    assert_eq!(s.wq.waiters(), 1);
    drop(w); // unfinished and chosen: must wake the thread
    t.join();
    assert_eq!(*order.lock().unwrap(), vec![1]);
}

#[test]
fn wait_for_until_times_out_and_leaves_the_queue() {
    let wq = WaitQueue::new();
    let start = Instant::now();
    let r: Option<()> = wq.wait_for_until(|| None, start + Duration::from_millis(20));
    assert!(r.is_none());
    assert!(start.elapsed() >= Duration::from_millis(20));
    assert_eq!(wq.waiters(), 0);
}

#[test]
fn wait_for_async_on_queue() {
    let s = Arc::new(Tokens::default());
    let s2 = Arc::clone(&s);
    let t = spawn_bounded(move || {
        futures::executor::block_on(s2.wq.wait_for_async(|| take_token(&s2.tokens)));
    });
    wait_for_waiters(&s.wq, 1);
    assert_eq!(s.give(1), 1);
    t.join();
    assert_eq!(s.wq.waiters(), 0);
}

// ---------------------------------------------------------------------------------------------
// Completion
// ---------------------------------------------------------------------------------------------

/// Spawns a thread that runs `f` on `c`, and waits until it is queued on `c`.
fn spawn_waiter<T, F>(c: &Arc<Completion>, queued_before: usize, f: F) -> Bounded<T>
where
    T: Send + 'static,
    F: FnOnce(&Completion) -> T + Send + 'static,
{
    let c2 = Arc::clone(c);
    let b = spawn_bounded(move || f(&c2));
    wait_for_waiters(c.queue(), queued_before + 1);
    b
}

/// A completion with two threads queued on it in `wait`, `a` the older.
fn two_waiters() -> (Arc<Completion>, Bounded<()>, Bounded<()>) {
    let c = Arc::new(Completion::new());
    let a = spawn_waiter(&c, 0, |c| c.wait());
    let b = spawn_waiter(&c, 1, |c| c.wait());
    (c, a, b)
}

#[test]
fn complete_before_wait() {
    let c = Completion::new();
    assert!(!c.is_done());
    assert!(!c.try_wait());
    c.complete();
    assert!(c.is_done());
    c.wait(); // returns at once
    assert!(!c.is_done());
    assert!(!c.try_wait());
}

#[test]
fn wait_then_complete_from_another_thread() {
    let c = Arc::new(Completion::new());
    let t = spawn_waiter(&c, 0, |c| c.wait());
    c.complete();
    t.join();
    assert!(!c.try_wait(), "the wait consumed the completion");
    assert_eq!(c.queue().waiters(), 0);
}

#[test]
fn complete_twice_lets_exactly_two_waits_through() {
    let c = Completion::new();
    c.complete();
    c.complete();
    c.wait();
    c.wait();
    assert!(!c.try_wait());

    // The same with two sleeping waiters.
    let (c, a, b) = two_waiters();
    c.complete();
    c.complete();
    a.join();
    b.join();
    assert!(!c.try_wait());
}

#[test]
fn one_complete_releases_exactly_one_of_two_waiters() {
    let (c, a, b) = two_waiters();
    c.complete();
    a.join(); // FIFO: the older waiter
    thread::sleep(Duration::from_millis(20));
    assert!(
        b.try_result().is_none(),
        "one complete() released two waits"
    );
    c.complete();
    b.join();
    assert!(!c.try_wait());
}

#[test]
fn complete_all_releases_everyone_until_reinit() {
    let c = Arc::new(Completion::new());
    let waiters: Vec<_> = (0..3).map(|i| spawn_waiter(&c, i, |c| c.wait())).collect();
    c.complete_all();
    assert_eq!(c.queue().waiters(), 0);
    for w in waiters {
        w.join();
    }
    // Future waits return at once, any number of times.
    for _ in 0..5 {
        assert!(c.is_done());
        assert!(c.try_wait());
        c.wait();
        assert!(c.wait_timeout(Duration::ZERO));
    }
    // complete() after complete_all() changes nothing.
    c.complete();
    assert!(c.try_wait());

    c.reinit();
    assert!(!c.is_done());
    assert!(!c.try_wait());
    assert!(!c.wait_timeout(Duration::from_millis(5)));
    c.complete();
    assert!(c.try_wait());
    assert!(!c.try_wait());
}

#[test]
fn wait_timeout_times_out() {
    let c = Completion::new();
    let start = Instant::now();
    assert!(!c.wait_timeout(Duration::from_millis(30)));
    assert!(start.elapsed() >= Duration::from_millis(30));
    assert_eq!(c.queue().waiters(), 0);
    // A completion after the timeout is kept for the next wait.
    c.complete();
    assert!(c.wait_timeout(Duration::ZERO));
}

#[test]
fn wait_timeout_returns_true_when_completed_in_time() {
    let c = Arc::new(Completion::new());
    let t = spawn_waiter(&c, 0, |c| {
        let start = Instant::now();
        (c.wait_timeout(Duration::from_secs(10)), start.elapsed())
    });
    c.complete();
    let (ok, took) = t.join();
    assert!(ok);
    assert!(
        took < Duration::from_secs(5),
        "woken by complete, not by the timeout"
    );
    assert!(!c.try_wait());
}

/// A completion, a token, and a thread queued on the completion in `wait_cancellable`.
fn spawn_cancellable_waiter() -> (
    Arc<Completion>,
    Arc<CancelToken>,
    Bounded<Result<(), Error>>,
) {
    let c = Arc::new(Completion::new());
    let token = Arc::new(CancelToken::new());
    let tok2 = Arc::clone(&token);
    let t = spawn_waiter(&c, 0, move |c| c.wait_cancellable(&tok2));
    (c, token, t)
}

#[test]
fn wait_cancellable_is_cancelled_by_another_thread() {
    let (c, token, t) = spawn_cancellable_waiter();
    token.cancel();
    assert_eq!(t.join(), Err(Error::Cancelled));
    assert_eq!(c.queue().waiters(), 0);
    assert!(!c.is_done());

    // A cancelled token fails the next wait at once, unless the completion is there.
    assert_eq!(c.wait_cancellable(&token), Err(Error::Cancelled));
    c.complete();
    assert_eq!(c.wait_cancellable(&token), Ok(()));
    token.reset();
    assert!(!token.is_cancelled());
}

#[test]
fn wait_cancellable_returns_ok_when_completed() {
    let (c, token, t) = spawn_cancellable_waiter();
    c.complete();
    assert_eq!(t.join(), Ok(()));
    assert!(!c.try_wait());
    // Cancelling afterwards affects nothing.
    token.cancel();
    assert!(!c.is_done());
}

#[test]
fn error_errno() {
    assert_eq!(Error::Cancelled.errno(), 4);
    assert_eq!(Error::TimedOut.errno(), 110);
    assert_eq!(Error::Cancelled.to_string(), "wait cancelled");
}

#[test]
fn wait_async_completed_before() {
    let c = Completion::new();
    c.complete();
    futures::executor::block_on(c.wait_async());
    assert!(!c.try_wait());
}

#[test]
fn wait_async_completed_from_another_thread() {
    let c = Arc::new(Completion::new());
    let t = spawn_waiter(&c, 0, |c| futures::executor::block_on(c.wait_async()));
    c.complete();
    t.join();
    assert!(!c.try_wait());
}

#[test]
fn wait_async_and_thread_waiter_on_one_completion() {
    let c = Arc::new(Completion::new());
    let a = spawn_waiter(&c, 0, |c| futures::executor::block_on(c.wait_async()));
    let b = spawn_waiter(&c, 1, |c| c.wait());
    c.complete();
    a.join(); // FIFO: the async waiter was queued first
    thread::sleep(Duration::from_millis(20));
    assert!(
        b.try_result().is_none(),
        "one complete() released two waits"
    );
    c.complete();
    b.join();
    assert!(!c.try_wait());
    assert_eq!(c.queue().waiters(), 0);
}

#[test]
fn dropped_async_wait_chosen_by_a_wake_passes_it_on() {
    let c = Arc::new(Completion::new());
    let waker = futures::task::noop_waker();
    let mut cx = Context::from_waker(&waker);
    {
        // Boxed, so that `drop(fut)` drops the future itself (not just a pinned reference).
        let mut fut = Box::pin(c.wait_async());
        assert!(fut.as_mut().poll(&mut cx).is_pending());
        assert_eq!(c.queue().waiters(), 1);

        // A thread waiter queued behind the future. It uses the untimed `wait`: if the wake-up
        // were not passed on, it would sleep with a completion available and never return.
        let t = spawn_waiter(&c, 1, |c| c.wait());
        c.complete(); // chooses the head: the future
        assert_eq!(
            c.queue().waiters(),
            1,
            "complete() must choose the oldest waiter"
        );
        drop(fut); // not polled again: it must pass the wake-up on
        let r = t.rx.recv_timeout(PROMPT);
        if r.is_err() {
            c.complete(); // release the stuck thread before failing
            panic!("the dropped future did not pass its wake-up on");
        }
        t.handle.join().expect("thread panicked");
    }
    assert!(!c.try_wait(), "the thread waiter consumed the completion");
    assert_eq!(c.queue().waiters(), 0);
}

#[test]
fn dropped_async_wait_not_chosen_just_leaves() {
    let c = Completion::new();
    let waker = futures::task::noop_waker();
    let mut cx = Context::from_waker(&waker);
    {
        let mut fut = pin!(c.wait_async());
        assert!(fut.as_mut().poll(&mut cx).is_pending());
        // Polled again without a completion: keeps its place.
        assert!(fut.as_mut().poll(&mut cx).is_pending());
        assert_eq!(c.queue().waiters(), 1);
    }
    assert_eq!(c.queue().waiters(), 0);
    c.complete();
    assert!(c.try_wait());
}

#[test]
fn async_wait_chosen_then_polled_takes_the_completion() {
    let c = Completion::new();
    let waker = futures::task::noop_waker();
    let mut cx = Context::from_waker(&waker);
    let mut fut = pin!(c.wait_async());
    assert!(fut.as_mut().poll(&mut cx).is_pending());
    c.complete();
    assert_eq!(c.queue().waiters(), 0);
    assert_eq!(fut.as_mut().poll(&mut cx), Poll::Ready(()));
    assert!(!c.try_wait());
}

#[test]
fn latency_recording_counts_a_wake_up() {
    let c = Arc::new(Completion::with_latency_recording());
    let hist = c.queue().latency().expect("recording is on");
    assert_eq!(hist.snapshot().count(), 0);
    let t = spawn_waiter(&c, 0, |c| c.wait());
    // Let the waiter get past its re-check and park, so that this is a real wake-up.
    thread::sleep(Duration::from_millis(20));
    c.complete();
    t.join();
    let snap = c.queue().latency().expect("recording is on").snapshot();
    assert_eq!(snap.count(), 1, "{snap}");
    assert!(snap.max >= snap.mean());

    // Recording is off by default.
    assert!(Completion::new().queue().latency().is_none());
}

// ---------------------------------------------------------------------------------------------
// Regression: a waiter whose re-check succeeds while a waker chooses it for *another*
// resource must pass that wake-up on.
//
// The interleaving, forced with gates inside the condition closures (queue [Y, X]):
//   1. Y sleeps; X queues behind it and stops in its re-check.
//   2. give #1: one token, wakes the head, Y. Y stops before looking at the tokens.
//   3. X's re-check takes token #1; X stops before `finish`.
//   4. Y finds no token, queues again (queue [X, Y]) and sleeps.
//   5. give #2: one token, wakes the head, X, which no longer needs it.
//   6. X finishes (chosen) and returns. Unless X passes the wake-up on, Y sleeps with a token
//      available.
// ---------------------------------------------------------------------------------------------

/// A one-shot gate between the test and a condition closure.
struct Gate(mpsc::Receiver<()>);

impl Gate {
    fn new() -> (mpsc::Sender<()>, Gate) {
        let (tx, rx) = mpsc::channel();
        (tx, Gate(rx))
    }

    fn pass(&self) {
        self.0
            .recv_timeout(PROMPT)
            .expect("the test did not open the gate");
    }
}

/// Y: a thread sleeping in `wait_for` with a gated condition.
struct YSide {
    y: Bounded<()>,
    /// Opens the gate Y waits at in its first look after being woken.
    open: mpsc::Sender<()>,
    /// Y reports that look (which must find no token).
    retried: mpsc::Receiver<()>,
}

/// The controls of X's gated condition.
struct XControls {
    /// X reports reaching its gated call.
    queued: mpsc::Receiver<()>,
    /// Lets X take its token.
    open1: mpsc::Sender<()>,
    /// X reports having taken it.
    took: mpsc::Receiver<()>,
    /// Lets X's condition return.
    open2: mpsc::Sender<()>,
}

/// Step 1: Y asleep on `s.wq` (queued first).
fn sleeping_y(s: &Arc<Tokens>) -> YSide {
    let (open, gate_y) = Gate::new();
    let (retried_tx, retried) = mpsc::channel();
    let s2 = Arc::clone(s);
    let y = spawn_bounded(move || {
        let mut calls = 0;
        s2.wq.wait_for(|| {
            calls += 1;
            if calls == 3 {
                // First look after being woken: wait until X took the token.
                gate_y.pass();
                let r = take_token(&s2.tokens);
                assert!(r.is_none(), "X should have taken token #1");
                let _ = retried_tx.send(());
                return r;
            }
            take_token(&s2.tokens)
        });
    });
    wait_for_waiters(&s.wq, 1);
    thread::sleep(Duration::from_millis(10)); // let Y park
    YSide { y, open, retried }
}

/// X's condition: call `gated_call` reports, waits for `open1`, takes a token, reports, and
/// waits for `open2` before returning it. Other calls just try to take a token.
fn gated_x_condition(
    s: Arc<Tokens>,
    gated_call: usize,
) -> (
    impl FnMut() -> Option<()> + Send + Unpin + 'static,
    XControls,
) {
    let (open1, gate1) = Gate::new();
    let (open2, gate2) = Gate::new();
    let (took_tx, took) = mpsc::channel();
    let (queued_tx, queued) = mpsc::channel();
    let mut calls = 0;
    let f = move || {
        calls += 1;
        if calls == gated_call {
            let _ = queued_tx.send(());
            gate1.pass();
            let r = take_token(&s.tokens);
            assert!(r.is_some(), "token #1 should be there for X");
            let _ = took_tx.send(());
            gate2.pass();
            return r;
        }
        take_token(&s.tokens)
    };
    let controls = XControls {
        queued,
        open1,
        took,
        open2,
    };
    (f, controls)
}

/// Steps 2 to 6, once X (running `x`) is queued behind Y and holds at its gated call.
fn run_steal_interleaving(s: &Arc<Tokens>, y: YSide, xc: XControls, x: Bounded<()>) {
    xc.queued
        .recv_timeout(PROMPT)
        .expect("X reached its gated call");
    assert_eq!(s.wq.waiters(), 2); // [Y, X]
    assert_eq!(s.give(1), 1); // wakes Y, the head
    assert_eq!(s.wq.waiters(), 1); // X
    xc.open1.send(()).unwrap();
    xc.took.recv_timeout(PROMPT).expect("X took its token");
    y.open.send(()).unwrap();
    y.retried.recv_timeout(PROMPT).expect("Y looked again");
    wait_for_waiters(&s.wq, 2); // [X, Y]
    thread::sleep(Duration::from_millis(10)); // let Y park again
    assert_eq!(s.give(1), 1); // wakes X, the head, which holds token #1 already
    xc.open2.send(()).unwrap();
    x.join();
    if y.y.rx.recv_timeout(PROMPT).is_err() {
        s.give(1); // release Y before failing
        panic!("lost wake-up: X was chosen after its re-check succeeded and did not pass it on");
    }
    y.y.handle.join().expect("Y panicked");
    assert_eq!(s.tokens.load(Ordering::Relaxed), 0);
    assert_eq!(s.wq.waiters(), 0);
}

/// Which thread wait of `WaitQueue` X uses.
#[derive(Clone, Copy)]
enum ThreadWait {
    Untimed,
    Until,
    Cancellable,
}

fn thread_waiter_chosen_after_successful_recheck(how: ThreadWait) {
    let s = Arc::new(Tokens::default());
    let y = sleeping_y(&s);
    // X: call 1 (before queueing) finds nothing, call 2 is the re-check after `prepare`.
    let (f, xc) = gated_x_condition(Arc::clone(&s), 2);
    let s2 = Arc::clone(&s);
    let x = spawn_bounded(move || match how {
        ThreadWait::Untimed => s2.wq.wait_for(f),
        ThreadWait::Until => {
            let deadline = Instant::now() + Duration::from_secs(10);
            s2.wq.wait_for_until(f, deadline).expect("X got its token")
        }
        ThreadWait::Cancellable => {
            let token = CancelToken::new();
            s2.wq
                .wait_for_cancellable(f, &token)
                .expect("X got its token")
        }
    });
    run_steal_interleaving(&s, y, xc, x);
}

#[test]
fn wait_for_chosen_after_successful_recheck_passes_wake_up_on() {
    thread_waiter_chosen_after_successful_recheck(ThreadWait::Untimed);
}

#[test]
fn wait_for_until_chosen_after_successful_recheck_passes_wake_up_on() {
    thread_waiter_chosen_after_successful_recheck(ThreadWait::Until);
}

#[test]
fn wait_for_cancellable_chosen_after_successful_recheck_passes_wake_up_on() {
    thread_waiter_chosen_after_successful_recheck(ThreadWait::Cancellable);
}

#[test]
fn async_waiter_chosen_after_successful_recheck_passes_wake_up_on() {
    // As the thread test, with X an async task. Its call 2 is the re-check right after
    // `prepare_async` in its first poll.
    let s = Arc::new(Tokens::default());
    let y = sleeping_y(&s);
    let (f, xc) = gated_x_condition(Arc::clone(&s), 2);
    let s2 = Arc::clone(&s);
    let x = spawn_bounded(move || futures::executor::block_on(s2.wq.wait_for_async(f)));
    run_steal_interleaving(&s, y, xc, x);
}

#[test]
fn async_waiter_chosen_while_repolled_passes_wake_up_on() {
    // X is an async task already queued that is polled again (its waker was not called: a
    // spurious poll, as executors may do) and finds a token in the first check of that poll,
    // while the other waker chooses it. Its call 3 is that check.
    let s = Arc::new(Tokens::default());
    let y = sleeping_y(&s);
    let (f, xc) = gated_x_condition(Arc::clone(&s), 3);
    let s2 = Arc::clone(&s);
    let x = spawn_bounded(move || {
        let fut = s2.wq.wait_for_async(f);
        let mut fut = pin!(fut);
        let waker = futures::task::noop_waker();
        let mut cx = Context::from_waker(&waker);
        assert!(fut.as_mut().poll(&mut cx).is_pending()); // calls 1 and 2: queued
                                                          // Spurious re-poll: call 3 holds at the gate.
        while fut.as_mut().poll(&mut cx).is_pending() {
            thread::yield_now();
        }
    });
    run_steal_interleaving(&s, y, xc, x);
}

#[test]
fn wakeups_count_the_waiters_woken() {
    let wq = Arc::new(WaitQueue::new());
    let go = Arc::new(AtomicBool::new(false));
    let sleeper = {
        let (wq, go) = (wq.clone(), go.clone());
        thread::spawn(move || wq.wait_for(|| go.load(Ordering::Acquire).then_some(())))
    };
    wait_for_waiters(&wq, 1);
    let before = waitq::wakeups();
    go.store(true, Ordering::Release);
    assert!(wq.wake_one());
    sleeper.join().unwrap();
    // Other tests wake too (the count is the process's): at least this one.
    assert!(waitq::wakeups() > before);
}
