//! Resolving a remote device's host name within its connection attempt's deadline. The
//! system resolver (`getaddrinfo`) takes no deadline: with a name server that never answers it
//! returns only after its own timeouts (`options timeout:5 attempts:2` by default, per name
//! server), whatever the device's `timeout=` says. So the lookup runs on a thread of its own
//! and the attempt waits for its answer until the attempt's deadline at most; a lookup that
//! outlives it finishes on its own, and its answer is dropped.
//!
//! Bounded: at most [`MAX_LOOKUPS`] lookups run at once in the process (a name nobody
//! answers, tried again at every reconnection by many devices, cannot pile up threads); past
//! it an attempt fails at once, saying so, and the next one tries again. An address given as
//! such (`10.0.0.2`, `::1`) is never looked up.

use std::io;
use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::time::Instant;

use blkq_sync::atomic::{AtomicUsize, Ordering};
use blkq_sync::{Arc, Mutex};
use waitq::WaitQueue;

/// Lookups that may run at once in the process.
pub(super) const MAX_LOOKUPS: usize = 16;

/// Lookups running. A count of threads, not a guard of data: Relaxed would do for the bound;
/// AcqRel keeps it exact under racing attempts (each claim sees every release before it).
#[cfg(not(blkq_loom))]
static RUNNING: AtomicUsize = AtomicUsize::new(0);

/// One lookup's answer, and the queue its waiter sleeps on.
#[derive(Default)]
struct Answer {
    got: Mutex<Option<io::Result<Vec<SocketAddr>>>>,
    wq: WaitQueue,
}

/// The addresses of `host`:`port`, looked up before `deadline` (see the module docs).
pub(super) fn resolve(host: &str, port: u16, deadline: Instant) -> io::Result<Vec<SocketAddr>> {
    if let Ok(ip) = host.parse::<IpAddr>() {
        return Ok(vec![SocketAddr::new(ip, port)]);
    }
    #[cfg(blkq_loom)]
    let running = AtomicUsize::new(0);
    #[cfg(blkq_loom)]
    let running = &running;
    #[cfg(not(blkq_loom))]
    let running = &RUNNING;
    if running.fetch_add(1, Ordering::AcqRel) >= MAX_LOOKUPS {
        running.fetch_sub(1, Ordering::AcqRel);
        return Err(io::Error::new(
            io::ErrorKind::WouldBlock,
            format!("{MAX_LOOKUPS} name lookups are running already; not looking up {host} now"),
        ));
    }
    let answer = Arc::new(Answer::default());
    let (a, name) = (answer.clone(), host.to_owned());
    let spawned = std::thread::Builder::new()
        .name("blkq-resolve".into())
        .spawn(move || {
            let r = (name.as_str(), port)
                .to_socket_addrs()
                .map(|it| it.collect::<Vec<_>>());
            #[cfg(not(blkq_loom))]
            RUNNING.fetch_sub(1, Ordering::AcqRel);
            *a.got.lock() = Some(r);
            a.wq.wake_all();
        });
    if let Err(e) = spawned {
        running.fetch_sub(1, Ordering::AcqRel);
        return Err(e);
    }
    answer
        .wq
        .wait_for_until(|| answer.got.lock().take(), deadline)
        .unwrap_or_else(|| {
            Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("looking up {host}: no answer within the connection attempt's deadline"),
            ))
        })
}

#[cfg(all(test, not(blkq_loom)))]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn an_address_is_not_looked_up_and_a_name_is() {
        let soon = Instant::now() + Duration::from_secs(5);
        let a = resolve("10.1.2.3", 10809, soon).unwrap();
        assert_eq!(a, vec!["10.1.2.3:10809".parse().unwrap()]);
        let a = resolve("::1", 1, soon).unwrap();
        assert_eq!(a, vec!["[::1]:1".parse().unwrap()]);
        let a = resolve("localhost", 10809, soon).unwrap();
        assert!(
            a.iter().all(|s| s.ip().is_loopback() && s.port() == 10809),
            "{a:?}"
        );
    }

    #[test]
    fn a_passed_deadline_fails_at_once() {
        // The lookup may have been quicker than the first look at its answer: in time too.
        if let Err(e) = resolve("localhost", 1, Instant::now()) {
            assert_eq!(e.kind(), io::ErrorKind::TimedOut, "{e}");
        }
    }
}
