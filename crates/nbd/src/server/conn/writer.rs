//! The combining writer and its flusher: who may write to the socket, and the `sendmsg` loop.
//!
//! The right to write is a token: `Locked::writer_token` holds the writer's [`Output`] while
//! nobody writes; whoever takes it out under the lock is the writer. The writer shapes every
//! ready slot's reply into the output (`reply.rs`), drops the lock, sends everything with
//! `sendmsg` over up to [`IOV_WINDOW`] iovecs at a time, then retakes the lock, frees the sent
//! slots and looks again. It puts the token back only when nothing is ready, under the same
//! lock that producers push under, so no reply is ever left behind: a producer either pushes
//! before the writer's last look, or finds the token back in place and writes itself.
//!
//! Threads: any of the reader (after submitting), a device completion thread (`end_io`) or the
//! flusher may be the writer. The first two never block on the socket (`MSG_DONTWAIT`): a send
//! that would block, or a writer that has gone [`MAX_NONBLOCKING_ROUNDS`] rounds, moves the
//! token (with the half-sent output) to `Locked::handed_off` and wakes the **flusher** (one
//! thread per connection, asleep on `ConnState::flusher_wake`), which finishes with blocking
//! sends and goes on as the writer. So neither the reader nor a driver's completion thread
//! ever waits on a slow client.

use std::io::{self, IoSlice};
use std::net::Shutdown;
use std::os::fd::RawFd;

use blkq_sync::atomic::Ordering;
use tracing::{debug, warn};

use super::inflight::{ConnState, Locked};
use super::output::{Output, Segment};
use super::send::progress;
use crate::tls::TlsSession;

/// iovecs per `sendmsg`.
const IOV_WINDOW: usize = 128;
/// A non-blocking writer (reader, completion thread) writes at most this many rounds before it
/// hands the token to the flusher, so that a busy connection cannot keep a driver's completion
/// thread away from its other work.
const MAX_NONBLOCKING_ROUNDS: u32 = 8;

impl ConnState {
    /// Writes ready replies if nobody else is writing. Never blocks on the socket.
    pub(super) fn flush(&self) {
        let output = {
            let mut locked = self.locked.lock();
            if locked.ready_slots.is_empty() && !self.tls_pending() {
                return;
            }
            match locked.writer_token.take() {
                Some(output) => output,
                None => return,
            }
        };
        self.run_writer(output, false);
    }

    /// The writer loop; the caller holds the token (`output`). See the module docs.
    fn run_writer(&self, mut output: Box<Output>, blocking: bool) {
        let mut rounds = 0u32;
        loop {
            if output.unsent() || (self.tls.is_some() && self.tls_work(&output)) {
                if self.client_gone.load(Ordering::Relaxed) {
                    self.forget_tls_output();
                } else {
                    let dev = self.splice_dev.as_deref();
                    match output.send(self.send_fd, self.tls.as_deref(), dev, !blocking) {
                        Ok(true) => {}
                        Ok(false) => {
                            self.hand_off(output);
                            return;
                        }
                        Err(e) => self.client_is_gone(&e),
                    }
                }
                output.reset();
            }
            let gone = self.client_gone.load(Ordering::Relaxed);
            let mut locked = self.locked.lock();
            let (wake_reader, freed) = output.free_sent(&mut locked);
            output.shape_ready(&mut locked, self, gone);
            // TLS output the reader queued is looked at under this lock (see `crate::tls`).
            if output.shaped_slots.is_empty() && (gone || !self.tls_pending()) {
                locked.writer_token = Some(output);
                drop(locked);
                self.budget.give(freed);
                self.wake_reader_if(wake_reader);
                return;
            }
            rounds += 1;
            if !blocking && rounds >= MAX_NONBLOCKING_ROUNDS {
                locked.handed_off = Some(output);
                drop(locked);
                self.budget.give(freed);
                self.wake_reader_if(wake_reader);
                self.flusher_wake.wake_one();
                return;
            }
            drop(locked);
            self.budget.give(freed);
            self.wake_reader_if(wake_reader);
        }
    }

    /// TLS: the reader left records for the writer to send (see `crate::tls`, invariant 4).
    #[inline]
    fn tls_pending(&self) -> bool {
        self.tls.as_ref().is_some_and(|t| t.pending())
    }

    /// TLS: ciphertext still held by the output (it was handed off half-sent), or records
    /// the reader queued.
    fn tls_work(&self, output: &Output) -> bool {
        output.tls_out.unsent() || self.tls_pending()
    }

    /// TLS, client gone: nothing will be sent any more.
    fn forget_tls_output(&self) {
        if let Some(t) = &self.tls {
            t.output_pending.store(false, Ordering::Relaxed);
        }
    }

    /// Wakes the reader (it set `reader_waiting`, which the caller took, under the lock after
    /// queueing itself on `reader_wake`: so it is queued, or re-checks and sees the freed
    /// slots).
    fn wake_reader_if(&self, reader_waiting: bool) {
        if reader_waiting {
            self.reader_wake.wake_one();
        }
    }

    /// Gives the token and the half-sent output to the flusher.
    fn hand_off(&self, output: Box<Output>) {
        self.locked.lock().handed_off = Some(output);
        self.flusher_wake.wake_one();
    }

    /// The client is gone (a send failed, or made no progress for the send timeout): drop
    /// replies from now on, and shut the socket so the reader stops too. The reader then
    /// waits for the in-flight requests, whose buffers are freed as they complete.
    fn client_is_gone(&self, e: &io::Error) {
        if !self.client_gone.swap(true, Ordering::Relaxed) {
            if e.kind() == io::ErrorKind::TimedOut {
                warn!(
                    peer = %self.send_sock,
                    "closing connection: the client read none of its replies for the send \
                     timeout (--send-timeout)"
                );
            } else {
                debug!("send failed, dropping replies: {e}");
            }
            let _ = self.send_sock.shutdown(Shutdown::Both);
        }
    }

    /// The flusher thread: sleeps until an output is handed off (then writes with blocking
    /// sends, as the writer) or the connection tells it to stop.
    pub(super) fn flusher_main(&self) {
        loop {
            let handed_off = self.flusher_wake.wait_for(|| {
                let mut locked = self.locked.lock();
                match locked.handed_off.take() {
                    Some(output) => Some(Some(output)),
                    None if locked.stop_flusher => Some(None),
                    None => None,
                }
            });
            match handed_off {
                Some(output) => self.run_writer(output, true),
                None => return,
            }
        }
    }
}

impl Output {
    pub(super) fn unsent(&self) -> bool {
        self.next_segment < self.segments.len()
    }

    /// The bytes of a segment in memory (`None` for a spliced one, which is not).
    pub(super) fn segment_bytes(&self, s: Segment) -> Option<&[u8]> {
        match s {
            Segment::Headers { start, end } => self.headers.get(start..end),
            Segment::Data { index, len } => self
                .buffers
                .get(index)
                .and_then(|b| b.as_slice().get(..len)),
            Segment::Spliced { .. } => None,
        }
    }

    fn is_spliced(&self, i: usize) -> bool {
        matches!(self.segments.get(i), Some(Segment::Spliced { .. }))
    }

    /// Sends what is left; `Ok(false)` if the socket would block (non-blocking mode). Over
    /// TLS the bytes go through the session (`transport.rs`). Runs of in-memory segments go
    /// out with `sendmsg`; a spliced segment through the pipe (`splice.rs`), whose pipe is
    /// filled before the run that carries its header.
    fn send(
        &mut self,
        fd: RawFd,
        tls: Option<&TlsSession>,
        dev: Option<&dyn blk::Device>,
        dontwait: bool,
    ) -> io::Result<bool> {
        if let Some(session) = tls {
            return self.send_tls(fd, session, dontwait);
        }
        let bad = || io::Error::other("reply segment out of bounds");
        while self.next_segment < self.segments.len() {
            if self.is_spliced(self.next_segment) {
                if !self.send_spliced(fd, dev, dontwait)? {
                    return Ok(false);
                }
                continue;
            }
            let first = self.next_segment;
            let mut end = first;
            while end < self.segments.len() && end - first < IOV_WINDOW && !self.is_spliced(end) {
                end += 1;
            }
            let more = self.is_spliced(end);
            if more {
                let before = self.segments.len();
                self.prefill(end, dev)?;
                if self.segments.len() != before {
                    // The read failed and its header became an error reply: look again.
                    continue;
                }
            }
            let mut iov = [IoSlice::new(&[]); IOV_WINDOW];
            for (k, &s) in self.segments[first..end].iter().enumerate() {
                let mut bytes = self.segment_bytes(s).ok_or_else(bad)?;
                if k == 0 {
                    bytes = bytes.get(self.sent_of_segment..).ok_or_else(bad)?;
                }
                iov[k] = IoSlice::new(bytes);
            }
            let sent = crate::sys::sendmsg_more(fd, &iov[..end - first], dontwait, more);
            let Some(n) = progress(sent, dontwait)? else {
                return Ok(false);
            };
            self.advance(n);
        }
        Ok(true)
    }

    /// Counts `n` bytes sent from the in-memory segments at `next_segment` on (never into a
    /// spliced one, which `send_spliced` counts itself).
    pub(super) fn advance(&mut self, mut n: usize) {
        while n > 0 && self.next_segment < self.segments.len() {
            let Some(bytes) = self.segment_bytes(self.segments[self.next_segment]) else {
                break;
            };
            let left = bytes.len().saturating_sub(self.sent_of_segment);
            if n >= left {
                n -= left;
                self.next_segment += 1;
                self.sent_of_segment = 0;
            } else {
                self.sent_of_segment += n;
                n = 0;
            }
        }
    }

    /// Forgets the sent output (buffers go back to their pools).
    fn reset(&mut self) {
        // Bytes still in the pipe belong to a reply that will never be sent (the client is
        // gone): the pipe goes with them rather than lead the next reply.
        self.pipe.forget_held();
        self.headers.clear();
        self.segments.clear();
        self.buffers.clear();
        self.next_segment = 0;
        self.sent_of_segment = 0;
    }

    /// Frees the slots whose replies were sent; returns whether the reader was waiting and
    /// the budget bytes the slots held (the caller wakes the reader and gives the bytes back
    /// to the server's memory budget after dropping the lock).
    fn free_sent(&mut self, locked: &mut Locked) -> (bool, u64) {
        if self.shaped_slots.is_empty() {
            return (false, 0);
        }
        let mut freed = 0;
        for &slot in &self.shaped_slots {
            if let Some(entry) = locked.table.get_mut(slot as usize) {
                locked.bytes_in_flight = locked.bytes_in_flight.saturating_sub(entry.budget_bytes);
                freed += std::mem::take(&mut entry.budget_bytes);
                entry.clear_data();
                locked.free_slots.push(slot);
            }
        }
        self.shaped_slots.clear();
        (std::mem::take(&mut locked.reader_waiting), freed)
    }

    /// Shapes every ready reply into the output (or, once the client is gone, just marks the
    /// slots for freeing).
    fn shape_ready(&mut self, locked: &mut Locked, core: &ConnState, client_gone: bool) {
        let Locked {
            table, ready_slots, ..
        } = locked;
        for &slot in ready_slots.iter() {
            let Some(entry) = table.get_mut(slot as usize) else {
                continue;
            };
            self.shaped_slots.push(slot);
            if !client_gone {
                self.shape(entry, core.mode, core.min_block);
            }
        }
        ready_slots.clear();
    }
}
