//! Which large reads are spliced: per connection, by the rate at which the client takes them
//! (docs/design.md, "Large reads").
//!
//! Splicing (`splice.rs`) saves the server its copy, but the one copy left moves to the
//! client: it now reads the device's own pages, cold, where it read the socket's buffers,
//! just written by the server on another core. A client with a receive thread to spare (a
//! copy tool with several connections, qemu-img) goes faster, because the server no longer
//! takes a core from it; a client with one receiving thread and no core to spare (one fio
//! process, `nbdcopy --threads=1`) goes slower, because the copy it now makes alone is the
//! slower one. Which kind a client is shows in one number the server can see without its
//! help: how fast its large reads arrive, which (the client sends the next read when a reply
//! is in) is how fast it takes the replies.
//!
//! The rule, per connection, on reads of at least [`SPLICE_MIN_BYTES`] to a device that can
//! splice:
//! 1. **Start spliced**, and measure: the bytes of large reads that arrive in a window of at
//!    least [`WINDOW_BYTES`], [`WINDOW_READS`] reads and [`WINDOW_TIME`], over the time they
//!    took to arrive.
//! 2. **Then copy, and measure the same**, and so on, alternating, [`WINDOWS`] windows in all
//!    (a probe). The reads the client has in flight at a switch were answered or staged the
//!    old way, so that many arrivals are skipped before the next window opens: the client's
//!    depth, the most reads the server has seen it have in flight at once (in front of a fast
//!    server they are not in flight at the server but answered, their replies waiting in the
//!    socket buffers, over TCP up to the whole depth), or more if more are in flight now, and
//!    at least [`MIN_SKIP`].
//! 3. **Keep the faster** on the probe's totals (bytes over time, per way); copying must be
//!    more than [`MARGIN_PCT`] percent faster to be kept (splicing spends less of the
//!    server's CPU, so it wins a tie).
//! 4. **Hold it** for [`HOLD_FIRST`] bytes of large reads, then probe again from the held way
//!    (steps 1-3); each time the same way wins the hold doubles, up to [`HOLD_MAX`], so a
//!    steady client pays for ever fewer probes.
//! 5. **A pause is not a rate.** Two arrivals more than [`GAP`] apart (the client stopped, or
//!    did other work) restart the window, in the same way.
//!
//! The rule is the reader's alone (no sharing, no atomics) and allocates nothing.
//! [`SpliceRule::Always`] (`--splice-rule always`) splices every large read, as before.
//!
//! [`SPLICE_MIN_BYTES`]: super::splice::SPLICE_MIN_BYTES

use std::time::{Duration, Instant};

/// Bytes of large reads a window needs before its rate counts.
pub(super) const WINDOW_BYTES: u64 = 8 << 20;
/// Reads a window needs before its rate counts.
pub(super) const WINDOW_READS: u32 = 4;
/// The shortest window: a few scheduler ticks, so that one preemption of the client (or of
/// the server) on a busy machine does not decide alone.
pub(super) const WINDOW_TIME: Duration = Duration::from_millis(10);
/// Windows of a probe, alternating between the two ways from the held one (even: as many of
/// each); the ways are compared on their totals, so drift on the machine during the probe
/// hits both alike.
pub(super) const WINDOWS: u8 = 4;
/// Copying is kept only if its rate beats splicing's by more than this many percent.
pub(super) const MARGIN_PCT: u64 = 5;
/// Bytes of large reads the first decision is held for.
pub(super) const HOLD_FIRST: u64 = 1 << 30;
/// The longest hold.
pub(super) const HOLD_MAX: u64 = 16 << 30;
/// The fewest arrivals a switch skips (rule 2): a client's depth the server has not seen in
/// flight at once (each read answered before the next arrived) still has that many replies
/// queued the old way. Sixteen covers the depths clients use for large reads (fio's and
/// nbdcopy's 8 to 16 requests, qemu-img's 16), and costs a probe 48 reads more.
pub(super) const MIN_SKIP: usize = 16;
/// Two large reads further apart than this: the client paused, the window restarts.
pub(super) const GAP: Duration = Duration::from_millis(20);

/// How large reads are chosen for splicing (`Tuning::splice_rule`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SpliceRule {
    /// Per connection, the faster way for that client (the module's rule).
    #[default]
    Measure,
    /// Every large read is spliced.
    Always,
}

impl std::str::FromStr for SpliceRule {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "measure" => Ok(Self::Measure),
            "always" => Ok(Self::Always),
            _ => Err(format!("unknown splice rule {s:?} (measure, always)")),
        }
    }
}

/// Where the rule stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Measuring the current way: window `window` (from 0) of the [`WINDOWS`] of a probe.
    Measure { window: u8 },
    /// The way is chosen; this many bytes of large reads before measuring again.
    Hold { left: u64 },
}

/// The per-connection state of [`SpliceRule::Measure`].
#[derive(Debug)]
pub(super) struct SpliceChooser {
    rule: SpliceRule,
    splice: bool,
    phase: Phase,
    /// Arrivals still to skip before the window opens (rule 2).
    skip: usize,
    /// The most reads the client has had in flight at once (its depth, as far as the server
    /// can tell): what a switch skips at least (rule 2).
    depth: usize,
    /// The window: its first arrival, the last one, bytes and reads after the first.
    start: Option<Instant>,
    last: Instant,
    bytes: u64,
    reads: u32,
    /// The probe's windows so far, per way (`[copied, spliced]`): bytes and nanoseconds.
    seen: [(u64, u128); 2],
    /// The hold the next decision gets if the same way wins again.
    hold: u64,
    /// Large reads spliced and copied so far (for tests and logs).
    pub(super) spliced_reads: u64,
    pub(super) copied_reads: u64,
}

impl SpliceChooser {
    pub(super) fn new(rule: SpliceRule, now: Instant) -> Self {
        Self {
            rule,
            splice: true,
            phase: Phase::Measure { window: 0 },
            skip: 0,
            depth: 0,
            start: None,
            last: now,
            bytes: 0,
            reads: 0,
            seen: [(0, 0); 2],
            hold: HOLD_FIRST,
            spliced_reads: 0,
            copied_reads: 0,
        }
    }

    /// A large read of `len` bytes arrived at `now`, with `in_flight` requests of the client
    /// (this one excluded) not yet answered: whether to splice it.
    pub(super) fn choose(&mut self, len: u64, now: Instant, in_flight: usize) -> bool {
        if self.rule == SpliceRule::Always {
            self.spliced_reads += 1;
            return true;
        }
        match self.phase {
            Phase::Hold { left } if left > len => {
                self.phase = Phase::Hold { left: left - len };
            }
            Phase::Hold { .. } => {
                self.seen = [(0, 0); 2];
                self.open(0, 0);
            }
            Phase::Measure { window } => self.measure(window, len, now, in_flight),
        }
        if self.splice {
            self.spliced_reads += 1;
        } else {
            self.copied_reads += 1;
        }
        self.splice
    }

    /// Starts window `window` of the current way, after `skip` arrivals.
    fn open(&mut self, window: u8, skip: usize) {
        self.phase = Phase::Measure { window };
        self.skip = skip;
        self.start = None;
    }

    fn measure(&mut self, window: u8, len: u64, now: Instant, in_flight: usize) {
        self.depth = self.depth.max(in_flight);
        if self.skip > 0 {
            self.skip -= 1;
            return;
        }
        let Some(start) = self.start else {
            self.restart(now);
            return;
        };
        if now.saturating_duration_since(self.last) > GAP {
            self.restart(now); // rule 5
            return;
        }
        self.last = now;
        self.bytes += len;
        self.reads += 1;
        let nanos = now.saturating_duration_since(start).as_nanos();
        if self.bytes < WINDOW_BYTES || self.reads < WINDOW_READS || nanos < WINDOW_TIME.as_nanos()
        {
            return;
        }
        let way = &mut self.seen[usize::from(self.splice)];
        way.0 += self.bytes;
        way.1 += nanos;
        if window + 1 < WINDOWS {
            // Rule 2: the other way, after the client's reads already answered or staged
            // this way (its depth: a fast server's replies wait in the socket buffers, not
            // in flight here).
            self.splice = !self.splice;
            self.open(window + 1, in_flight.max(self.depth).max(MIN_SKIP));
            return;
        }
        // Rule 3, on the probe's totals: bytes per nanosecond, compared by cross-multiplying.
        let [(copy_bytes, copy_ns), (splice_bytes, splice_ns)] = self.seen;
        let copy_wins = u128::from(copy_bytes) * splice_ns * 100
            > u128::from(splice_bytes) * copy_ns * (100 + u128::from(MARGIN_PCT));
        // The probe began with the held way, and the windows alternate: an even number of
        // them ends on the other way.
        let held = !self.splice;
        let decided = !copy_wins;
        // Rule 4: the same way again doubles the hold; a change starts it over.
        self.hold = if decided == held {
            (self.hold * 2).min(HOLD_MAX)
        } else {
            HOLD_FIRST
        };
        self.splice = decided;
        self.phase = Phase::Hold { left: self.hold };
    }

    fn restart(&mut self, now: Instant) {
        self.start = Some(now);
        self.last = now;
        self.bytes = 0;
        self.reads = 0;
    }

    /// Whether new large reads are spliced now.
    #[cfg(test)]
    fn splicing(&self) -> bool {
        self.splice
    }

    /// Whether the way is chosen and held.
    #[cfg(test)]
    fn holding(&self) -> bool {
        matches!(self.phase, Phase::Hold { .. })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    /// A client that takes `len`-byte reads at `splice_rate` or `copy_rate` bytes per second,
    /// with `qd` in flight: the reads go through the chooser one after another, each arriving
    /// when the client could have taken the previous reply.
    struct Client {
        now: Instant,
        chooser: SpliceChooser,
        splice_rate: u64,
        copy_rate: u64,
        qd: usize,
        /// A fast server (`Client::fast`): it answers every read at once, so the client's
        /// other reads are not in flight at the server but answered, their replies queued in
        /// the socket buffers ahead of the next, and the client takes each at the rate of
        /// the way it was sent, `qd - 1` choices before.
        queued: Option<std::collections::VecDeque<bool>>,
        sent: usize,
        /// In front of a fast server: whether the server sees the client's first burst in
        /// flight (its reads arrive together), or each read answered before the next arrives.
        burst_seen: bool,
    }

    impl Client {
        fn new(rule: SpliceRule, splice_rate: u64, copy_rate: u64, qd: usize) -> Self {
            let now = Instant::now();
            Self {
                now,
                chooser: SpliceChooser::new(rule, now),
                splice_rate,
                copy_rate,
                qd,
                queued: None,
                sent: 0,
                burst_seen: true,
            }
        }

        /// The same client in front of a fast server (see `queued`).
        fn fast(splice_rate: u64, copy_rate: u64, qd: usize) -> Self {
            let mut c = Self::new(SpliceRule::Measure, splice_rate, copy_rate, qd);
            c.queued = Some(std::collections::VecDeque::new());
            c
        }

        /// Sends 1 MiB reads until the way is chosen (at most 1 GiB of them); returns how
        /// many it took.
        fn probe(&mut self) -> usize {
            let mut n = 0;
            while !self.chooser.holding() {
                assert!(n < 1024, "no decision after 1 GiB");
                self.read(1, MIB);
                n += 1;
            }
            n
        }

        /// Sends `n` reads of `len`; returns how many were spliced.
        fn read(&mut self, n: usize, len: u64) -> usize {
            let mut spliced = 0;
            for _ in 0..n {
                // In front of a fast server only the client's first burst is seen in flight.
                let in_flight = match self.queued {
                    Some(_) if self.burst_seen && self.sent < self.qd => self.sent,
                    Some(_) => 0,
                    None => self.qd - 1,
                };
                self.sent += 1;
                let s = self.chooser.choose(len, self.now, in_flight);
                spliced += usize::from(s);
                let taken = match &mut self.queued {
                    Some(q) => {
                        q.push_back(s);
                        if q.len() < self.qd {
                            continue; // the first burst: nothing taken yet
                        }
                        q.pop_front().unwrap_or(s)
                    }
                    None => s,
                };
                let rate = if taken {
                    self.splice_rate
                } else {
                    self.copy_rate
                };
                self.now += Duration::from_nanos(len * 1_000_000_000 / rate);
            }
            spliced
        }
    }

    #[test]
    fn a_client_that_receives_faster_from_copies_gets_copies() {
        // One fio process: 2.2 GB/s from copies, 1.3 from spliced pages.
        let mut c = Client::new(SpliceRule::Measure, 1300 * MIB, 2200 * MIB, 8);
        let n = c.probe();
        assert!(n <= 128, "decided within 128 MiB, not {n}");
        assert!(!c.chooser.splicing());
        assert_eq!(c.read(512, MIB), 0, "copies while the decision holds");
    }

    /// In front of a fast server a switch leaves the client's other reads answered the old
    /// way, their replies queued in the socket buffers (over TCP loopback, up to the whole
    /// depth): what the next window measures first is how fast the client takes those. The
    /// rule skips the client's depth (the most reads it has had in flight at once), not only
    /// what is in flight at the switch. Seen failing when it skipped only those: a fio
    /// process over TCP, 2.2x faster from copies, kept splicing (peers.sh, bench.md 20).
    #[test]
    fn the_replies_queued_at_a_switch_are_not_measured() {
        for qd in [4, 8, 16] {
            let mut c = Client::fast(1100 * MIB, 2400 * MIB, qd);
            c.probe();
            assert!(!c.chooser.splicing(), "qd {qd}: kept splicing");
            let mut c = Client::fast(2400 * MIB, 1100 * MIB, qd);
            c.probe();
            assert!(c.chooser.splicing(), "qd {qd}: copies");
        }
    }

    /// The same when the server never sees the client's depth in flight (every read answered
    /// before the next arrives): a switch skips at least [`MIN_SKIP`] arrivals.
    #[test]
    fn the_replies_queued_at_a_switch_are_not_measured_when_the_depth_is_unseen() {
        for qd in [4, 8, 16] {
            for (splice, copy, spliced) in [(1100, 2400, false), (2400, 1100, true)] {
                let mut c = Client::fast(splice * MIB, copy * MIB, qd);
                c.burst_seen = false;
                c.probe();
                assert_eq!(c.chooser.splicing(), spliced, "qd {qd}, splice {splice}");
            }
        }
    }

    #[test]
    fn a_client_that_receives_faster_from_spliced_pages_gets_them() {
        let mut c = Client::new(SpliceRule::Measure, 3000 * MIB, 1900 * MIB, 16);
        c.probe();
        assert!(c.chooser.splicing());
        assert_eq!(c.read(512, MIB), 512);
    }

    #[test]
    fn a_tie_within_the_margin_splices() {
        // Copying 4% faster: not enough to give up the server's saving.
        let mut c = Client::new(SpliceRule::Measure, 2000 * MIB, 2080 * MIB, 4);
        c.probe();
        assert!(c.chooser.splicing());
    }

    #[test]
    fn the_reads_in_flight_at_the_switch_are_not_measured() {
        // The switch to copying comes after the splice window; the next `qd - 1` arrivals
        // are skipped, so the copy window opens only after them.
        // 1 MiB per 4 ms: the window's bytes come before its time.
        // A depth above MIN_SKIP, so that what is skipped is the reads in flight.
        let mut c = Client::new(SpliceRule::Measure, 250 * MIB, 500 * MIB, MIN_SKIP + 8);
        let mut n = 0;
        while c.chooser.splicing() {
            c.read(1, MIB);
            n += 1;
        }
        // The first arrival opens the window, then WINDOW_BYTES more.
        assert_eq!(n as u64, 1 + WINDOW_BYTES / MIB);
        assert_eq!(c.chooser.skip, MIN_SKIP + 7);
        c.read(MIN_SKIP + 7, MIB);
        assert_eq!(c.chooser.skip, 0);
        assert!(
            c.chooser.start.is_none(),
            "the window opens at the next arrival"
        );
    }

    #[test]
    fn a_pause_restarts_the_window() {
        let mut c = Client::new(SpliceRule::Measure, 1000 * MIB, 2000 * MIB, 1);
        c.read(4, MIB);
        let before = c.chooser.bytes;
        assert!(before > 0);
        c.now += GAP + Duration::from_millis(1);
        c.read(1, MIB);
        assert_eq!(c.chooser.bytes, 0, "the late arrival starts a new window");
        assert!(!c.chooser.holding());
    }

    #[test]
    fn the_decision_is_measured_again_after_its_hold_and_follows_the_client() {
        let mut c = Client::new(SpliceRule::Measure, 1000 * MIB, 2000 * MIB, 2);
        c.probe();
        assert!(!c.chooser.splicing());
        // The client changes: now spliced pages suit it better.
        c.splice_rate = 4000 * MIB;
        let mut held = 0;
        while c.chooser.holding() {
            assert_eq!(c.read(1, MIB), 0, "copies while the decision holds");
            held += 1;
        }
        assert_eq!(held, HOLD_FIRST / MIB, "measuring again after the hold");
        c.probe();
        assert!(c.chooser.splicing());
        assert_eq!(c.chooser.hold, HOLD_FIRST, "a change starts the hold over");
    }

    #[test]
    fn the_same_way_winning_again_doubles_the_hold_up_to_the_most() {
        let mut c = Client::new(SpliceRule::Measure, 3000 * MIB, 1000 * MIB, 1);
        c.probe();
        assert_eq!(
            c.chooser.hold,
            HOLD_FIRST * 2,
            "splice held, and splice won"
        );
        for _ in 0..8 {
            let hold = c.chooser.hold;
            c.read((hold / MIB) as usize, MIB);
            assert!(!c.chooser.holding(), "probing again after the hold");
            c.probe();
            assert!(c.chooser.splicing());
        }
        assert_eq!(c.chooser.hold, HOLD_MAX);
    }

    #[test]
    fn always_splices_every_read() {
        let mut c = Client::new(SpliceRule::Always, 1000 * MIB, 3000 * MIB, 8);
        assert_eq!(c.read(256, MIB), 256);
        assert_eq!(c.chooser.copied_reads, 0);
    }

    #[test]
    fn the_rule_parses_from_its_flag() {
        assert_eq!("measure".parse::<SpliceRule>(), Ok(SpliceRule::Measure));
        assert_eq!("always".parse::<SpliceRule>(), Ok(SpliceRule::Always));
        assert!("sometimes".parse::<SpliceRule>().is_err());
    }
}
