//! How a [`super::RemoteDevice`]'s requests are sent on its connection: claimed in the table,
//! then written inline by the submitter (one non-blocking `sendmsg`) or by the sender thread
//! (a blocking write, an inline send's rest included), and unclaimed when not sent whole.

use std::io::{self, IoSlice, Write};
use std::os::fd::AsRawFd;
use std::time::Instant;

use blk::Bio;
use blkq_sync::atomic::Ordering;

use crate::stream::{is_timeout, Stream};
use nbd_proto::proto::Command;
use nbd_proto::transmission::Request;

use super::submit::{Pending, BATCH};
use super::table::{Conn, LinkState, Partial, Table, Writer};

// # Sending inline (`send=inline`, plain sockets)
//
// A submitter that has taken its slot tries the writer lock (`try_lock`, never a wait). It
// writes only if it gets it, the stream is up, nothing is half written (`Writer::partial`)
// and the slot is still due; it then claims the slot (under the table lock, inside the
// writer lock) and writes header and payload with one `sendmsg(MSG_DONTWAIT)`:
//
// - all of it taken: sent (`sent_inline`);
// - nothing taken (`EAGAIN`): unclaimed, flagged for the sender thread (`send_needed`);
// - part of it taken: the rest is recorded in `Writer::partial` (the header stays in
//   `Writer::header`; a write's bio goes with it, away from its slot, so the slot is not
//   freed) and the sender thread is flagged. Until the sender has written the rest, nobody
//   else writes on the stream: inline senders and `send_slot` see `partial` and leave their
//   request due (flagged), the seal refuses to send. Dropping the stream (`drop_stream`: the
//   connection given up or over, the device killed) drops the partial request with it:
//   unclaimed, it is not sent (due again on the next connection) and its bio goes back;
// - a socket error: as `write_request`'s (the stream is dropped, the receiver drains).
//
// The rules this keeps: a request is claimed in the table (its reply can be matched, a
// reconnection re-sends or seals it by the rules below) before any byte of it is written;
// a request's bytes are contiguous on the wire (one writer at a time, and a half-written
// one is finished before any other); no submitter waits for the server (the only waits on
// the socket are the sender thread's, as before). What it does not keep is a global order
// between requests submitted concurrently: one handed to the sender can be overtaken by a
// later inline one. NBD orders nothing between requests in flight (a server may run them in
// any order), and a flush covers only writes completed before it is sent (`Durability`),
// so nothing depends on it. With `send=thread` (or TLS) every first send is the sender's.

impl LinkState {
    /// Marks slot `i` sent on the current connection and returns its request (a flush also
    /// records what it covers). Under the table lock, by whoever is about to send it.
    pub(super) fn claim(&self, t: &mut Table, i: usize) -> (u64, Request) {
        // Claimed only while due (busy, waiting, not sent on this connection, which is up):
        // a request is sent at most once per connection.
        debug_assert!(t.due(i), "slot {i} claimed while not due");
        let epoch = t.epoch;
        let s = &mut t.slots[i];
        s.sent_epoch = epoch;
        s.sent_at = Instant::now();
        if s.cmd == Command::Flush {
            // Acquire: see `Durability`.
            s.cover = self.durability.acked.load(Ordering::Acquire);
        }
        (epoch, s.request(i))
    }

    /// Sends slot `i` from the submitting thread, if the send side is free at once (a
    /// `try_lock`, never a wait) and nothing is half written: claims it and writes it with one
    /// non-blocking `sendmsg` (`held`: a write's bio, whose buffer is the payload). `false`:
    /// nothing of it was written, and it is still due for the sender thread (the caller flags
    /// it). A request the socket took in part is the sender thread's to finish (`Partial`; a
    /// write's bio goes with it, out of `held`), and counts as sent. See "Sending inline".
    pub(super) fn try_send_inline(&self, i: usize, held: &mut Option<Bio>, len: usize) -> bool {
        let mut one = [Pending {
            slot: i,
            bio: held.take(),
            len,
        }];
        let sent = self.try_send_batch(&mut one);
        *held = one[0].bio.take();
        sent == 1
    }

    /// Sends a batch's requests from the submitting thread with one non-blocking `sendmsg`
    /// (`Batch` in `submit`; `try_send_inline` is a batch of one), by the rules of "Sending
    /// inline": only if the send side is free at once and nothing is half written, each
    /// claimed before any byte is written.
    /// Returns how many of `ps`, from the first, are sent: wholly, or the last of them in part
    /// (then the sender thread's to finish, `Partial`, with a write's bio out of its
    /// `Pending`). The rest are not claimed (a request not due ends the claimed run; one the
    /// socket did not take is unclaimed), still due for the sender thread.
    pub(super) fn try_send_batch(&self, ps: &mut [Pending]) -> usize {
        if !self.inline {
            return 0;
        }
        let Some(mut w) = self.writer.try_lock() else {
            return 0;
        };
        let Writer {
            stream,
            mode,
            header,
            epoch: current,
            partial,
        } = &mut *w;
        let fd = match stream {
            Some(s) if partial.is_none() && !matches!(s, Stream::Tls(_)) => s.as_raw_fd(),
            _ => return 0,
        };
        let hlen = mode.request_header_len();
        let mut headers = [0u8; BATCH * 32];
        let mut cookies = [0u64; BATCH];
        let mut epoch = 0;
        let mut n = 0;
        {
            let mut t = self.table.lock();
            if t.epoch != *current {
                return 0;
            }
            for p in ps.iter().take(BATCH) {
                if !t.due(p.slot) {
                    break;
                }
                let (e, req) = self.claim(&mut t, p.slot);
                let at = n * 32;
                if !matches!(req.encode_into(*mode, &mut headers[at..at + 32]), Ok(l) if l == hlen)
                {
                    // Never for a request the device built; unclaimed, it is the sender's.
                    if let Some(s) = t.slots.get_mut(p.slot) {
                        s.sent_epoch = 0;
                    }
                    break;
                }
                epoch = e;
                cookies[n] = req.cookie;
                n += 1;
            }
        }
        if n == 0 {
            return 0;
        }
        let mut iov = [IoSlice::new(&[]); 2 * BATCH];
        for (k, p) in ps[..n].iter().enumerate() {
            iov[2 * k] = IoSlice::new(&headers[k * 32..k * 32 + hlen]);
            iov[2 * k + 1] = IoSlice::new(payload(p));
        }
        let r = crate::sys::sendmsg(fd, &iov[..2 * n], true);
        let taken = match r {
            Ok(k) => k,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => 0,
            Err(e) => {
                tracing::debug!(uri = %self.uri, "sending requests failed: {e}");
                *stream = None;
                for c in &cookies[..n] {
                    self.unclaim(epoch, *c);
                }
                // SeqCst: see the field.
                self.send_failed.store(true, Ordering::SeqCst);
                return 0;
            }
        };
        // Whole requests first, then at most one in part; the rest were not written.
        let mut left = taken;
        let (mut sent, mut whole) = (0, 0);
        for (k, p) in ps[..n].iter_mut().enumerate() {
            let size = hlen + payload(p).len();
            if left >= size {
                left -= size;
                sent += 1;
                whole += 1;
            } else if left > 0 {
                header[..hlen].copy_from_slice(&headers[k * 32..k * 32 + hlen]);
                *partial = Some(Partial {
                    slot: p.slot,
                    cookie: cookies[k],
                    epoch,
                    header_len: hlen,
                    written: left,
                    bio: p.bio.take(),
                    len: p.len,
                });
                left = 0;
                sent += 1;
            } else {
                self.unclaim(epoch, cookies[k]);
            }
        }
        // Relaxed: see the field. One written in part counts as the sender's, which ends it.
        self.sent_inline.fetch_add(whole, Ordering::Relaxed);
        if partial.is_some() {
            self.table.lock().send_needed = true;
            drop(w);
            self.sender_wq.wake_one();
        }
        sent
    }

    /// Flags slot `i` for the sender thread if it is due (a request no submitter sent).
    pub(super) fn hand_off(&self, i: usize) {
        let due = {
            let mut t = self.table.lock();
            let due = t.due(i);
            t.send_needed |= due;
            due
        };
        if due {
            self.sender_wq.wake_one();
        }
    }

    /// The sender thread finishes the request an inline send wrote in part, if any (a
    /// blocking write, as `write_request`'s). Returns a write's bio to put back into its slot
    /// once the writer lock is dropped.
    pub(super) fn finish_partial(&self, w: &mut Writer) -> (io::Result<()>, Option<(usize, Bio)>) {
        let Some(p) = w.partial.take() else {
            return (Ok(()), None);
        };
        let back = p.bio.as_ref().map(|_| p.slot);
        let Writer {
            stream,
            header,
            epoch: current,
            ..
        } = w;
        let r = match stream.as_mut().filter(|_| *current == p.epoch) {
            None => {
                self.unclaim(p.epoch, p.cookie);
                Ok(())
            }
            Some(s) => {
                let payload = p
                    .bio
                    .as_ref()
                    .and_then(|b| b.buf.as_ref())
                    .and_then(|b| b.as_slice().get(..p.len))
                    .unwrap_or(&[]);
                let h = &header[p.written.min(p.header_len)..p.header_len];
                let d = payload
                    .get(p.written.saturating_sub(p.header_len)..)
                    .unwrap_or(&[]);
                let give_up = || {
                    self.is_closing()
                        || matches!(
                            self.table.lock().conn,
                            Conn::Dead | Conn::Down { expired: true, .. }
                        )
                };
                match write_all2(s, h, d, give_up) {
                    Ok(()) => {
                        // Relaxed: see the field.
                        self.sent_by_thread.fetch_add(1, Ordering::Relaxed);
                        Ok(())
                    }
                    Err(e) => {
                        *stream = None;
                        self.unclaim(p.epoch, p.cookie);
                        // SeqCst: see the field.
                        self.send_failed.store(true, Ordering::SeqCst);
                        Err(e)
                    }
                }
            }
        };
        (r, back.zip(p.bio))
    }

    /// Drops the writer's stream (the connection is given up or over), and a request written
    /// in part on it, which is then not sent (due again on the next connection). Returns a
    /// write's bio to put back once the writer lock is dropped.
    pub(super) fn drop_stream(&self, w: &mut Writer) -> Option<(usize, Bio)> {
        w.stream = None;
        let p = w.partial.take()?;
        self.unclaim(p.epoch, p.cookie);
        Some(p.slot).zip(p.bio)
    }

    /// Sends slot `i` if it is due (the sender's path): claimed under the table lock while
    /// the writer lock is held, so the connection cannot change in between.
    pub(super) fn send_slot(&self, i: usize, payload: &[u8]) -> io::Result<bool> {
        let mut w = self.writer.lock();
        // A request half written by a submitter goes first: the sender finishes it at the
        // start of its next pass (the submitter flagged it).
        if w.stream.is_none() || w.partial.is_some() {
            return Ok(false);
        }
        let claimed = {
            let mut t = self.table.lock();
            t.due(i).then(|| self.claim(&mut t, i))
        };
        match claimed {
            Some((epoch, req)) => {
                let r = self.write_request(&mut w, epoch, &req, payload);
                if matches!(r, Ok(true)) {
                    // Relaxed: see the field.
                    self.sent_by_thread.fetch_add(1, Ordering::Relaxed);
                }
                r
            }
            None => Ok(false),
        }
    }

    /// Writes `req` (and a write's `payload`) on `w`'s stream if it is connection `epoch`.
    /// A send that makes no progress for the socket's send timeout goes on waiting (the
    /// server reads requests as it finishes others) until the device closes or the reconnect
    /// deadline has passed. A request not written, or not wholly, is marked not sent (due
    /// again on the next connection: no server carries out a request it did not receive
    /// whole). On a socket error the stream is dropped (a partial request must not be
    /// followed by another) and flagged for the receiver, which drains the connection.
    fn write_request(
        &self,
        w: &mut Writer,
        epoch: u64,
        req: &Request,
        payload: &[u8],
    ) -> io::Result<bool> {
        let Writer {
            stream: current_stream,
            mode,
            header,
            epoch: current,
            ..
        } = w;
        let Some(stream) = current_stream.as_mut().filter(|_| *current == epoch) else {
            self.unclaim(epoch, req.cookie);
            return Ok(false);
        };
        let payload = if req.kind == Command::Write {
            payload
        } else {
            &[]
        };
        let give_up = || {
            self.is_closing()
                || matches!(
                    self.table.lock().conn,
                    Conn::Dead | Conn::Down { expired: true, .. }
                )
        };
        let r = req
            .encode_into(*mode, header)
            .map_err(io::Error::other)
            .and_then(|n| write_all2(stream, &header[..n], payload, give_up));
        match r {
            Ok(()) => Ok(true),
            Err(e) => {
                *current_stream = None;
                self.unclaim(epoch, req.cookie);
                // SeqCst: see the field.
                self.send_failed.store(true, Ordering::SeqCst);
                Err(e)
            }
        }
    }

    /// The request with `cookie`, claimed for connection `epoch`, was not sent (or not
    /// wholly): it is due again on the next connection.
    fn unclaim(&self, epoch: u64, cookie: u64) {
        let mut t = self.table.lock();
        if let Some(s) = t.slots.get_mut((cookie & 0xffff_ffff) as usize) {
            if s.busy && u64::from(s.gen) == cookie >> 32 && s.sent_epoch == epoch {
                s.sent_epoch = 0;
            }
        }
    }
}

/// A batched write's payload (empty for any other request).
fn payload(p: &Pending) -> &[u8] {
    p.bio
        .as_ref()
        .and_then(|b| b.buf.as_ref())
        .and_then(|b| b.as_slice().get(..p.len))
        .unwrap_or(&[])
}

/// Writes `a` then `b`, gathered. A write that times out (the socket's send timeout) is
/// tried again unless `give_up` says otherwise; not on TLS, whose write has then consumed
/// the plaintext and sent part of its record (the stream cannot go on).
pub(super) fn write_all2(
    s: &mut Stream,
    a: &[u8],
    b: &[u8],
    give_up: impl Fn() -> bool,
) -> io::Result<()> {
    let mut bufs = [IoSlice::new(a), IoSlice::new(b)];
    let mut bufs = &mut bufs[..];
    while !bufs.is_empty() {
        match s.write_vectored(bufs) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => IoSlice::advance_slices(&mut bufs, n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if is_timeout(&e) && !matches!(s, Stream::Tls(_)) && !give_up() => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}
