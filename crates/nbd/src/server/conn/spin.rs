//! A short spin before the reader blocks in `recv` (docs/design.md, "Queue depth 1").
//!
//! At queue depth 1 the client sends its next request a few microseconds after it got the
//! last reply. A reader that blocks meanwhile lets its core go idle, and the request then
//! has to wake it: on a virtual machine an idle vCPU halts, and waking a halted vCPU costs
//! the host a round trip, 9 to 12 us per request on the 2-vCPU box (bench.md, section 20),
//! more than the server's own work. So, when the last wait was short, the reader first polls
//! the socket without blocking for up to the spin time, yielding its core between polls (a
//! client on the same core runs meanwhile), and blocks only if nothing came.
//!
//! Rules:
//! 1. **Spin only after a short wait.** The reader spins when the previous receive waited
//!    (blocked, after any spin) less than the spin time: the client is in a tight loop. An
//!    idle connection spins at most once, then blocks until its client comes back.
//! 2. **A failed spin blocks at once**, and the wait it then measures decides the next.
//! 3. **Plaintext only**: a TLS stream may hold decrypted bytes the socket does not show.
//! 4. `--recv-spin 0` turns it off.

use std::io;
use std::os::fd::RawFd;
use std::time::{Duration, Instant};

/// Whether to spin before the next blocking receive, and for how long at most.
#[derive(Debug)]
pub(super) struct RecvSpin {
    max: Duration,
    next: bool,
}

impl RecvSpin {
    pub(super) fn new(max: Duration) -> Self {
        Self {
            max,
            next: !max.is_zero(),
        }
    }

    /// Whether the next receive spins first.
    pub(super) fn armed(&self) -> bool {
        self.next
    }

    /// A blocking receive (after a failed spin, or none) waited `waited` for its bytes
    /// (rule 1).
    pub(super) fn blocked(&mut self, waited: Duration) {
        self.next = !self.max.is_zero() && waited < self.max;
    }

    /// Polls `fd` into `buf` without blocking until bytes come or the spin time is up:
    /// `Some` with what the receive gave, `None` if the time ran out (rule 2: the caller
    /// blocks, and the next spin waits for [`Self::blocked`] to arm it).
    pub(super) fn spin(&mut self, fd: RawFd, buf: &mut [u8]) -> Option<io::Result<usize>> {
        let deadline = Instant::now() + self.max;
        loop {
            match crate::sys::recv_dontwait(fd, buf) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                r => return Some(r),
            }
            if Instant::now() >= deadline {
                self.next = false;
                return None;
            }
            std::thread::yield_now();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_short_wait_arms_the_spin_and_a_long_one_or_a_failed_spin_disarms_it() {
        let mut s = RecvSpin::new(Duration::from_micros(50));
        assert!(s.armed(), "armed from the start");
        s.blocked(Duration::from_millis(5));
        assert!(!s.armed(), "an idle client: no spin");
        s.blocked(Duration::from_micros(20));
        assert!(s.armed(), "a tight loop: spin");
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        let fd = std::os::fd::AsRawFd::as_raw_fd(&a);
        let mut buf = [0u8; 8];
        assert!(s.spin(fd, &mut buf).is_none(), "nothing came");
        assert!(!s.armed(), "a failed spin disarms");
        std::io::Write::write_all(&mut &b, b"abc").unwrap();
        s.blocked(Duration::ZERO);
        match s.spin(fd, &mut buf) {
            Some(Ok(3)) => assert_eq!(&buf[..3], b"abc"),
            r => panic!("the spin should have received 3 bytes: {r:?}"),
        }
    }

    #[test]
    fn zero_never_spins() {
        let mut s = RecvSpin::new(Duration::ZERO);
        assert!(!s.armed());
        s.blocked(Duration::ZERO);
        assert!(!s.armed());
    }
}
