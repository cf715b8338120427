//! Loom models of `waitq`.
//!
//! Run them with
//!
//! ```text
//! RUSTFLAGS="--cfg blkq_loom" LOOM_MAX_PREEMPTIONS=2 CARGO_TARGET_DIR=target/loom \
//!     cargo test --profile loom -p waitq --test loom_waitq
//! ```
//!
//! Everything comes from the `blkq-sync` facade, so without `--cfg blkq_loom` each model runs
//! once on std threads: a smoke test. A lost wake-up shows under loom as a deadlock (every
//! thread parked), which loom reports as a failure.
//!
//! Under loom a timed sleep never sleeps: it yields and reports the deadline as passed (see
//! `blkq_sync::park_until`), so the timed models explore "the timeout fired here" at every
//! point a timed wait can sleep.

use std::future::Future;
use std::task::Context;
use std::time::Duration;

use blkq_sync::atomic::{AtomicBool, Ordering};
use blkq_sync::thread::JoinHandle;
use blkq_sync::{thread, Arc};
use waitq::{CancelToken, Completion, Error, WaitQueue};

/// The timeout of timed waits. Under loom every timed sleep times out anyway; on std threads
/// it is short so the smoke run never waits long for a completion that went elsewhere.
const TIMEOUT: Duration = Duration::from_millis(10);

/// Drives a future to completion: loom's `block_on` under loom (its waker is a modelled
/// notification, so a missing wake-up is a deadlock), `futures`' otherwise.
fn block_on<F: Future>(f: F) -> F::Output {
    #[cfg(blkq_loom)]
    return loom::future::block_on(f);
    #[cfg(not(blkq_loom))]
    return futures::executor::block_on(f);
}

/// Runs `body` as a model on a fresh completion, then checks that no waiter is left queued on
/// it.
fn model_completion<F>(body: F)
where
    F: Fn(&Arc<Completion>) + Sync + Send + 'static,
{
    blkq_sync::model(move || {
        let c = Arc::new(Completion::new());
        body(&c);
        assert_eq!(c.queue().waiters(), 0);
    });
}

/// A thread running `f` on `c`.
fn spawn_on<T, F>(c: &Arc<Completion>, f: F) -> JoinHandle<T>
where
    T: Send + 'static,
    F: FnOnce(&Completion) -> T + Send + 'static,
{
    let c = c.clone();
    thread::spawn(move || f(&c))
}

/// Two threads waiting on `c` (`wait`).
fn two_waiters(c: &Arc<Completion>) -> [JoinHandle<()>; 2] {
    [spawn_on(c, |c| c.wait()), spawn_on(c, |c| c.wait())]
}

/// (a) No lost wake-up on the bare queue: one thread sets a flag and calls `wake_one`, the
/// other waits for the flag with the prepare / re-check / sleep / finish loop of `wait_for`.
#[test]
fn wait_queue_no_lost_wake_up() {
    blkq_sync::model(|| {
        let wq = Arc::new(WaitQueue::new());
        let flag = Arc::new(AtomicBool::new(false));

        let (wq2, flag2) = (wq.clone(), flag.clone());
        let waker = thread::spawn(move || {
            flag2.store(true, Ordering::Relaxed);
            wq2.wake_one();
        });

        wq.wait_for(|| flag.load(Ordering::Relaxed).then_some(()));
        assert!(flag.load(Ordering::Relaxed));
        waker.join().unwrap();
        assert_eq!(wq.waiters(), 0);
    });
}

/// (b) `complete` vs `wait`: the wait returns and consumes the completion.
#[test]
fn completion_complete_vs_wait() {
    model_completion(|c| {
        let completer = spawn_on(c, |c| c.complete());
        c.wait();
        completer.join().unwrap();
        assert!(!c.try_wait(), "one complete() let two waits through");
    });
}

/// (c) `complete` vs `wait_timeout`. Whatever the interleaving, exactly one of: the waiter got
/// the completion, or the completion is still there afterwards (it was neither lost nor
/// consumed twice).
#[test]
fn completion_complete_vs_wait_timeout() {
    model_completion(|c| {
        let completer = spawn_on(c, |c| c.complete());
        let got = c.wait_timeout(TIMEOUT);
        completer.join().unwrap();
        let left = c.try_wait();
        assert!(got ^ left, "got = {got}, left = {left}");
        assert!(!c.try_wait());
    });
}

/// (d) `complete` vs `wait_cancellable` vs `cancel`: the waiter returns (cancel or complete
/// always wakes it), and got `Ok` exactly when the completion is no longer there.
#[test]
fn completion_complete_vs_wait_cancellable_vs_cancel() {
    model_completion(|c| {
        let token = Arc::new(CancelToken::new());
        let token2 = token.clone();
        let waiter = spawn_on(c, move |c| c.wait_cancellable(&token2));
        let canceller = thread::spawn(move || token.cancel());

        c.complete();
        let r = waiter.join().unwrap();
        canceller.join().unwrap();
        let left = c.try_wait();
        match r {
            Ok(()) => assert!(!left, "Ok, but the completion is still there"),
            Err(Error::Cancelled) => assert!(left, "Cancelled, and the completion is gone"),
            Err(e) => panic!("unexpected error {e:?}"),
        }
    });
}

/// (e) `complete_all` releases two waiters, and later waits too.
#[test]
fn completion_complete_all_two_waiters() {
    model_completion(|c| {
        let waiters = two_waiters(c);
        c.complete_all();
        for w in waiters {
            w.join().unwrap();
        }
        assert!(c.try_wait());
        assert!(c.is_done());
    });
}

/// (f) An async waiter and a thread waiter on one completion, two `complete` calls: both
/// finish, and both completions are consumed.
#[test]
fn completion_async_and_thread_waiters() {
    model_completion(|c| {
        let task = spawn_on(c, |c| block_on(c.wait_async()));
        let waiter = spawn_on(c, |c| c.wait());
        c.complete();
        c.complete();
        task.join().unwrap();
        waiter.join().unwrap();
        assert!(!c.try_wait());
    });
}

/// (f') Two thread waiters, two `complete` calls: both finish. A waiter whose re-check
/// succeeded may meanwhile have been chosen by the *other* `complete`; it must pass that
/// wake-up on, or the other waiter sleeps with a completion available.
#[test]
fn completion_two_thread_waiters_two_completes() {
    model_completion(|c| {
        let waiters = two_waiters(c);
        c.complete();
        c.complete();
        for w in waiters {
            w.join().unwrap();
        }
        assert!(!c.try_wait());
    });
}

/// (f'') A pending async wait that is dropped after a `complete` may have chosen it must pass
/// the wake-up on to the thread waiter behind it.
#[test]
fn completion_dropped_async_waiter_passes_wake_up_on() {
    model_completion(|c| {
        let waiter = spawn_on(c, |c| c.wait());
        let completer = spawn_on(c, |c| c.complete());

        let waker = futures::task::noop_waker();
        let mut cx = Context::from_waker(&waker);
        let mut fut = Box::pin(c.wait_async());
        let took = fut.as_mut().poll(&mut cx).is_ready();
        drop(fut); // never polled again
        completer.join().unwrap();
        // The future consumed the one completion: release the thread waiter.
        release_if(c, took, waiter);
    });
}

/// Completes `c` once more if `took` (another waiter consumed the one completion), then
/// joins `waiter`, which must return, and checks that no completion is left.
fn release_if(c: &Completion, took: bool, waiter: JoinHandle<()>) {
    if took {
        c.complete();
    }
    waiter.join().unwrap();
    assert!(!c.try_wait());
}

/// (g) Exclusive wake-up pass-on: a `wait_timeout` waiter that gives up must not leave the
/// other waiter asleep while a completion remains. One `complete`; if the timed waiter took
/// it, the main thread completes once more for the untimed waiter (which must then still
/// return). Either way the untimed waiter must finish: a stranded wake-up is a deadlock.
#[test]
fn completion_timed_waiter_passes_wake_up_on() {
    model_completion(|c| {
        let timed = spawn_on(c, |c| c.wait_timeout(TIMEOUT));
        let untimed = spawn_on(c, |c| c.wait());
        c.complete();
        release_if(c, timed.join().unwrap(), untimed);
    });
}

/// (g') The same with a cancelled waiter instead of a timed-out one: two waiters, one of them
/// cancellable; `complete` and `cancel` race.
#[test]
fn completion_cancelled_waiter_passes_wake_up_on() {
    model_completion(|c| {
        let token = Arc::new(CancelToken::new());
        let token2 = token.clone();
        let cancellable = spawn_on(c, move |c| c.wait_cancellable(&token2));
        let untimed = spawn_on(c, |c| c.wait());
        c.complete();
        token.cancel();
        release_if(c, cancellable.join().unwrap().is_ok(), untimed);
    });
}
