//! The receiver thread's outer loop: receive on the connection until it stops; if the client
//! is the one giving it up, drain it until every request sent on it is answered or the server
//! closes it (the old connection is then over: nothing sent on it can still be carried out);
//! then take the connection down, re-establish it with exponential backoff, check that the
//! export is the same, and hand what was in flight to the sender to be sent again; fail what
//! waited past the reconnect deadline; and fail everything for good when the device closes or
//! the export changed under it.
//!
//! # Invariants
//!
//! - Only this thread changes the connection's state (`Table::conn`, `Table::epoch`,
//!   `Table::draining`) and sets a `Lost` status, so nothing fails a request while the
//!   receiver is in the middle of its reply (a submitter or the sender that meets a socket
//!   error only drops the writer's stream and flags it).
//! - Giving a connection up happens under the table lock (requests are claimed only while it
//!   is up, so nothing new is sent on it); cutting it after a malformed reply, taking it
//!   down and bringing a new one up each happen under the writer lock and the table lock
//!   together: no request is ever sent on a connection the table does not call current, and
//!   every request still waiting when a connection comes up is due on it.
//! - No connection is made while the previous one may still carry out a request: `drain`
//!   returns only once every request sent on it is answered, or the server has closed it (or
//!   the socket failed), and only then does `reconnect` dial (see "The old connection" in
//!   `table`). A request failed meanwhile keeps its slot as an orphan until then.
//! - During a reconnection the requests keep their slots, and a write's slot keeps its bio
//!   and buffer: re-sending needs nothing that was given back.

use std::time::{Duration, Instant};

use blkq_sync::atomic::Ordering;

use super::check;
use super::connect::{self, Opened};
use super::receiver::{self, Receiver, Stop};
use super::spec::RemoteSpec;
use super::table::{Conn, LinkState};
use nbd_proto::proto::TransmissionFlags;

/// First wait between reconnection attempts; it doubles after each failed attempt.
const BACKOFF_START: Duration = Duration::from_millis(50);
/// Longest wait between reconnection attempts.
const BACKOFF_MAX: Duration = Duration::from_secs(2);

/// A connection that lived at least this long resets the backoff; one that broke sooner (a
/// server that accepts and then fails at once, or keeps answering `ESHUTDOWN`) is followed
/// by the backoff, so the device never reconnects in a tight loop.
const STABLE: Duration = Duration::from_secs(1);

pub(super) struct Supervisor {
    pub(super) rx: Receiver,
    pub(super) spec: RemoteSpec,
    /// The wait before the next attempt.
    pub(super) backoff: Duration,
    /// When the current connection came up.
    pub(super) up_since: Instant,
    /// The owner's losses of unflushed writes this connection has acted on (`Hook::losses`).
    seen_losses: u64,
}

impl Supervisor {
    pub(super) fn new(rx: Receiver, spec: RemoteSpec) -> Self {
        Self {
            rx,
            spec,
            backoff: BACKOFF_START,
            up_since: Instant::now(),
            seen_losses: 0,
        }
    }
}

impl Supervisor {
    pub(super) fn run(mut self) {
        loop {
            let stop = self.rx.receive();
            if matches!(stop, Stop::Closing) || self.rx.sh.is_closing() {
                self.rx.sh.kill(None);
                return;
            }
            if stop.ended_by_server() {
                tracing::warn!(
                    uri = %self.rx.sh.uri,
                    "the connection to the NBD server broke: {stop}; reconnecting"
                );
            } else {
                tracing::warn!(
                    uri = %self.rx.sh.uri,
                    "the connection to the NBD server broke: {stop}; what was sent on it may \
                     still be carried out: waiting for its replies, or for the server to close \
                     it, before reconnecting"
                );
                let unparseable = stop.unparseable();
                self.give_up(unparseable);
                let end = self.rx.drain(unparseable);
                if matches!(end, Stop::Closing) || self.rx.sh.is_closing() {
                    self.rx.sh.kill(None);
                    return;
                }
                if matches!(end, Stop::Drained) {
                    self.seal();
                }
                tracing::info!(uri = %self.rx.sh.uri, "the old connection is over: {end}");
            }
            self.take_down();
            if !self.reconnect() {
                return;
            }
        }
    }

    /// The client gives up on the connection: nothing new is sent on it (requests are
    /// claimed only while it is up; one already claimed still goes out), but it is not over:
    /// the receiver drains it. Its sending half is shut down only when the rest of the
    /// stream cannot be parsed (`cut`): a server may close a connection at once when it
    /// sees the end of the requests, with requests still running (qemu-nbd does). With no
    /// reconnect deadline, everything waiting fails at once.
    fn give_up(&mut self, cut: bool) {
        let sh = &self.rx.sh;
        if cut {
            // Before the writer lock: a sender blocked on a full socket fails at once.
            sh.cut_socket();
            let back = {
                let mut w = sh.writer.lock();
                let back = sh.drop_stream(&mut w);
                sh.table.lock().go_down(Instant::now());
                back
            };
            if let Some((i, bio)) = back {
                sh.put_back(i, bio);
            }
        } else {
            // Not the writer lock: a sender may be waiting on a full socket, and goes on
            // until the server reads or the deadline passes (`write_request`).
            sh.table.lock().go_down(Instant::now());
        }
        // Relaxed: see `LinkState::up`.
        sh.up.store(false, Ordering::Relaxed);
        if sh.reconnect_deadline.is_zero() {
            sh.expire();
        }
    }

    /// The connection drained: a flush on it vouches for its writes before it is left
    /// (`seal`).
    fn seal(&mut self) {
        match self.rx.seal() {
            None => {}
            Some(Ok(cover)) => tracing::info!(
                uri = %self.rx.sh.uri,
                "a flush on the drained connection vouches for the {cover} writes acknowledged"
            ),
            Some(Err(e)) => tracing::warn!(
                uri = %self.rx.sh.uri,
                "the drained connection could not be sealed by a flush ({e}): its unflushed \
                 writes are taken as lost"
            ),
        }
    }

    /// The old connection is over: nothing is sent until the next one; what has been
    /// outstanding past its budget fails with `ETIMEDOUT`; with no reconnect deadline,
    /// everything waiting fails at once.
    fn take_down(&mut self) {
        let sh = &self.rx.sh;
        sh.shut_socket();
        let back = {
            let mut w = sh.writer.lock();
            let back = sh.drop_stream(&mut w);
            let mut t = sh.table.lock();
            t.disconnect(Instant::now(), sh.timeout + sh.reconnect_deadline);
            back
        };
        if let Some((i, bio)) = back {
            sh.put_back(i, bio);
        }
        // Release: see the field.
        sh.orphaned.store(false, Ordering::Release);
        if sh.flags().contains(TransmissionFlags::SEND_FLUSH) && sh.durability.connection_lost() {
            if sh.hook.lost_writes() {
                // The owner (a mirror) failed the leg: nothing waiting is served from a
                // server that may have rolled back, and no flush needs to fail for it.
                tracing::warn!(
                    uri = %sh.uri,
                    "writes acknowledged and not flushed were on the lost connection: the \
                     server may have lost them; its owner was told, and what waits fails"
                );
                sh.durability.poisoned.store(false, Ordering::Release);
                sh.fail_waiting();
            } else {
                tracing::warn!(
                    uri = %sh.uri,
                    "writes acknowledged and not flushed were on the lost connection: the next \
                     flush fails (their durability is unknown)"
                );
            }
        }
        // Relaxed: see `LinkState::up`.
        sh.up.store(false, Ordering::Relaxed);
        sh.complete_all();
        if sh.reconnect_deadline.is_zero() {
            sh.expire();
        }
    }

    fn expiry(&self) -> Option<Instant> {
        self.rx.sh.expiry()
    }

    fn expire_if_due(&self) {
        self.rx.sh.expire_if_due();
    }

    /// Reconnects until it succeeds (true), or the device closes or the export changed
    /// (false: the device is dead).
    fn reconnect(&mut self) -> bool {
        let mut failures = 0u32;
        let mut wait_first = self.up_since.elapsed() < STABLE;
        if !wait_first {
            self.backoff = BACKOFF_START;
        }
        loop {
            if wait_first {
                self.wait_backoff();
            }
            wait_first = true;
            self.expire_if_due();
            if self.rx.sh.is_closing() {
                self.rx.sh.kill(None);
                return false;
            }
            match self.attempt().and_then(|opened| self.bring_up(opened)) {
                Ok(up) => return up,
                Err(e) => {
                    failures += 1;
                    if failures == 1 {
                        tracing::warn!(uri = %self.rx.sh.uri, "reconnecting: {e}");
                    } else {
                        tracing::debug!(uri = %self.rx.sh.uri, failures, "reconnecting: {e}");
                    }
                }
            }
        }
    }

    /// Waits the backoff (cut short by the deadline's expiry or by closing), then doubles
    /// it.
    fn wait_backoff(&mut self) {
        self.expire_if_due();
        let mut until = Instant::now() + self.backoff;
        if let Some(e) = self.expiry() {
            until = until.min(e);
        }
        let sh = &self.rx.sh;
        sh.backoff_wq
            .wait_for_until(|| sh.is_closing().then_some(()), until);
        self.backoff = (self.backoff * 2).min(BACKOFF_MAX);
    }

    /// One attempt: dial, then negotiate with the socket registered for `Drop` to shut down
    /// (so closing the device does not wait for a silent server's handshake). The whole
    /// attempt (dial, TLS, negotiation, the owner's check) ends by the timeout, or by the
    /// reconnect deadline's expiry if sooner: whatever a server sends, or however slowly,
    /// the deadline fails what waits on time (after the attempt the loop expires it).
    fn attempt(&self) -> Result<Opened, connect::RemoteError> {
        let sh = &self.rx.sh;
        let deadline = connect::attempt_deadline(&self.spec, self.expiry());
        let stream =
            connect::dial(&self.spec.addr, self.spec.timeout, deadline).map_err(|source| {
                connect::RemoteError::Connect {
                    uri: sh.uri.clone(),
                    source,
                }
            })?;
        *sh.sock.lock() = stream.try_clone().ok();
        if sh.is_closing() {
            sh.shut_socket();
        }
        connect::handshake(stream, &self.spec, deadline)
    }

    /// A new connection is negotiated: if the export is the same, make it current, flag
    /// everything waiting as due for the sender, and receive on it (true). If its size or
    /// block sizes changed, or the owner's check refuses it (`check`), the device dies with
    /// an error saying why (false). An error is a failed attempt (the socket is dropped; the
    /// next attempt follows).
    fn bring_up(&mut self, opened: Opened) -> Result<bool, connect::RemoteError> {
        let sh = self.rx.sh.clone();
        if opened.limits != sh.limits {
            let (was, now) = (sh.limits, opened.limits);
            let why = format!(
                "{}: the export changed while reconnecting: size {} bytes (block {}, largest \
                 I/O {}) before, {} bytes (block {}, largest I/O {}) now; not resuming",
                sh.uri,
                was.capacity,
                was.logical_block_size,
                was.max_io_bytes,
                now.capacity,
                now.logical_block_size,
                now.max_io_bytes
            );
            tracing::error!(uri = %sh.uri, "{why}");
            sh.kill(Some(why));
            return Ok(false);
        }
        // The owner's check, before anything is sent on the connection (`check`).
        if let check::Verdict::Refuse(why) = sh.hook.judge(&sh.uri, &opened)? {
            tracing::error!(uri = %sh.uri, "{why}");
            sh.kill(Some(why));
            return Ok(false);
        }
        // After a loss of unflushed writes that the owner took over (on this connection or
        // another of the device's), what waited for this connection was asked of a leg the
        // owner has since failed: it fails rather than be read from the server that may have
        // rolled back. (The owner's own probes then ask again.)
        let losses = sh.hook.losses();
        if losses != self.seen_losses {
            self.seen_losses = losses;
            sh.fail_waiting();
        }
        let Opened {
            stream,
            mode,
            details,
            meta_id,
            ..
        } = opened;
        // The check may have left the socket's timeouts at what was left of the attempt.
        let clones = stream
            .set_read_timeout(Some(self.rx.tick))
            .and_then(|()| stream.set_write_timeout(Some(self.spec.timeout)))
            .and_then(|()| Ok((stream.try_clone()?, stream.try_clone()?)));
        let (reader, sock) = clones.map_err(|source| connect::RemoteError::Connect {
            uri: sh.uri.clone(),
            source,
        })?;
        *sh.sock.lock() = Some(sock);
        // Relaxed: see `LinkState::flags`.
        sh.flags
            .store(u32::from(details.flags.bits()), Ordering::Relaxed);
        {
            let mut w = sh.writer.lock();
            w.stream = Some(stream);
            w.mode = mode;
            let mut t = sh.table.lock();
            t.epoch += 1;
            w.epoch = t.epoch;
            t.meta_id = meta_id;
            t.conn = Conn::Up;
            t.send_needed = true;
            // SeqCst: see the field. Under the writer lock (see the field).
            sh.send_failed.store(false, Ordering::SeqCst);
        }
        // Relaxed: see `LinkState::up`.
        sh.up.store(true, Ordering::Relaxed);
        // Relaxed: a statistic (see the field).
        let n = sh.reconnects.fetch_add(1, Ordering::Relaxed) + 1;
        tracing::info!(uri = %sh.uri, reconnects = n, "reconnected to the NBD server");
        sh.sender_wq.wake_one();
        self.rx.stream = receiver::buffered(reader);
        self.rx.mode = mode;
        self.rx.last_check = Instant::now();
        self.up_since = Instant::now();
        Ok(true)
    }
}

impl LinkState {
    /// The reconnect deadline has passed (whether or not a request waits): everything
    /// waiting fails with `EIO`, and so does every new request until a connection is back;
    /// meanwhile the device reports itself unavailable (`RemoteDevice::unavailable`).
    pub(super) fn expire(&self) {
        {
            let mut t = self.table.lock();
            let Conn::Down {
                since,
                expired: false,
            } = t.conn
            else {
                return;
            };
            t.conn = Conn::Down {
                since,
                expired: true,
            };
            if t.draining && !t.answered() {
                // Release: see the field.
                self.orphaned.store(true, Ordering::Release);
            }
        }
        tracing::warn!(
            uri = %self.uri,
            "not reconnected within reconnect_deadline={:?}: failing requests until the \
             server is back",
            self.reconnect_deadline
        );
        self.fail_waiting();
    }

    /// When the deadline expires, if it has not.
    fn expiry(&self) -> Option<Instant> {
        match self.table.lock().conn {
            Conn::Down {
                since,
                expired: false,
            } => Some(since + self.reconnect_deadline),
            _ => None,
        }
    }

    /// Expires the deadline if it is due (the receiver, between reconnection attempts and
    /// at every tick of a drain).
    pub(super) fn expire_if_due(&self) {
        if self.expiry().is_some_and(|e| e <= Instant::now()) {
            self.expire();
        }
    }
}
