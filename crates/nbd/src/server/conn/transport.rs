//! The TLS branch of the writer's send (`Output::send` picks it when the connection speaks
//! TLS; the plaintext path is untouched). The rules are in [`crate::tls`]'s module docs; here:
//!
//! - the writer (token holder) first sends the ciphertext it still holds
//!   (`TlsOut`, part of the output, so it travels with the token to the flusher);
//! - then, under the session lock and for at most [`ENCRYPT_BATCH`] plaintext bytes, it
//!   encrypts reply segments (vectored, so records are packed full across replies) and drains every queued record (the reader's too) into that
//!   buffer, drops the lock, and sends it with `sendmsg`, blocking or not as the caller asks;
//! - it is done when every segment is encrypted and sent and the session had nothing queued
//!   at its last drain.

use std::io::{self, IoSlice, Write};
use std::os::fd::RawFd;

use super::output::Output;
use crate::tls::{drain, TlsSession, ENCRYPT_BATCH};

/// Segments per vectored write into rustls.
const IOV_WINDOW: usize = 64;

impl Output {
    /// The TLS send: see the module docs. `Ok(false)` if the socket would block.
    pub(super) fn send_tls(
        &mut self,
        fd: RawFd,
        session: &TlsSession,
        dontwait: bool,
    ) -> io::Result<bool> {
        let bad = || io::Error::other("reply segment out of bounds");
        loop {
            if !self.tls_out.send(fd, dontwait)? {
                return Ok(false);
            }
            if !self.unsent() && !session.pending() {
                return Ok(true);
            }
            // Under the session lock: memory work only, never a socket call.
            let mut conn = session.conn.lock();
            let was_unsent = self.unsent();
            let mut budget = ENCRYPT_BATCH;
            while budget > 0 && self.unsent() {
                // Segments go to rustls as one vectored write, so that records are packed
                // full across reply boundaries (not one record per header).
                let (n, total) = {
                    let mut iov = [IoSlice::new(&[]); IOV_WINDOW];
                    let (mut k, mut total) = (0, 0);
                    let window = self.segments[self.next_segment..].iter().take(IOV_WINDOW);
                    for (i, &s) in window.enumerate() {
                        let mut bytes = self.segment_bytes(s).ok_or_else(bad)?;
                        if i == 0 {
                            bytes = bytes.get(self.sent_of_segment..).ok_or_else(bad)?;
                        }
                        let bytes = &bytes[..bytes.len().min(budget - total)];
                        iov[k] = IoSlice::new(bytes);
                        k += 1;
                        total += bytes.len();
                        if total == budget {
                            break;
                        }
                    }
                    (conn.writer().write_vectored(&iov[..k])?, total)
                };
                self.advance(n);
                budget -= n;
                if n < total || total == 0 {
                    break;
                }
            }
            drain(session, &mut conn, &mut self.tls_out.buf);
            drop(conn);
            if was_unsent && budget == ENCRYPT_BATCH && self.tls_out.buf.is_empty() {
                // rustls took nothing and has nothing to send (closed, or out of sequence
                // numbers): stop rather than spin.
                return Err(io::Error::other("the TLS session takes no more data"));
            }
        }
    }
}
