//! The owner's check of each new connection ([`blk::Device::check_connections`]): before a
//! reconnection is made current, and so before any request (a re-send, a write waiting) is
//! sent on it, the bytes the check asks for are read through it and judged. A refusal kills
//! the device (every request fails with `EIO` naming the refusal, for good), as an export whose
//! size changed does: the server that answered is not the one the device was serving. The
//! refusal is kept, and every later connection of the device (another of its `conns=`) is
//! refused with it; a connection that never broke stays with the server it was opened on.

use blk::ConnectCheck;
use blkq_sync::atomic::{AtomicU64, Ordering};
use blkq_sync::{DynArc, Mutex};

use super::connect::{Opened, RemoteError};
use crate::client::Client;

/// The check installed on a device, shared by its connections.
#[derive(Default)]
pub(super) struct Hook {
    check: Mutex<Option<DynArc<dyn ConnectCheck>>>,
    /// The first refusal (already naming the URI).
    refused: Mutex<Option<String>>,
    /// How many losses of unflushed writes the owner took over (`lost_writes`): a connection
    /// that comes up after one fails what waits on it (`Supervisor::bring_up`).
    lost: AtomicU64,
}

/// What the check says of a new connection.
pub(super) enum Verdict {
    /// Serve on it (no check installed, or the check accepts it).
    Accept,
    /// Refused: why (naming the URI).
    Refuse(String),
}

impl Hook {
    /// Installs `check` (or removes it); waits for a check running now to end.
    pub(super) fn set(&self, check: Option<DynArc<dyn ConnectCheck>>) {
        *self.check.lock() = check;
    }

    /// A connection broke with unflushed writes on it: tells the owner's check (not held
    /// across the call); whether the owner took it over (`ConnectCheck::lost_writes`).
    pub(super) fn lost_writes(&self) -> bool {
        let Some(check) = self.check.lock().clone() else {
            return false;
        };
        if !check.lost_writes() {
            return false;
        }
        // Release: a connection that reads the new count (Acquire, in `bring_up`) comes up
        // after the owner was told.
        self.lost.fetch_add(1, Ordering::Release);
        true
    }

    /// The losses taken over so far (`lost_writes`).
    pub(super) fn losses(&self) -> u64 {
        self.lost.load(Ordering::Acquire)
    }

    /// Runs the check on `opened` (negotiated, nothing sent on it yet), its read bounded by
    /// the attempt's deadline. An error is a failed attempt (the read did not complete): the next
    /// attempt follows.
    pub(super) fn judge(&self, uri: &str, opened: &Opened) -> Result<Verdict, RemoteError> {
        if let Some(why) = self.refused.lock().clone() {
            return Ok(Verdict::Refuse(why));
        }
        // Not held across the read (it waits for the server).
        let Some(check) = self.check.lock().clone() else {
            return Ok(Verdict::Accept);
        };
        let (offset, len) = check.range();
        let read_err = |reason: String| RemoteError::Unusable {
            uri: uri.to_string(),
            reason: format!("reading {len} bytes at {offset} to check who answers: {reason}"),
        };
        // A client of its own over a second handle on the socket: one request, its whole
        // reply read, so nothing is left in the socket for the receiver.
        let stream = opened
            .stream
            .try_clone()
            .map_err(|e| read_err(e.to_string()))?;
        let mut client = Client::new(
            stream,
            opened.mode,
            opened.details.clone(),
            None,
            Vec::new(),
        )
        .map_err(|e| read_err(e.to_string()))?;
        // Part of the connection attempt: its reply must come whole within the attempt's
        // deadline, however the server paces it.
        client.set_deadline(Some(opened.deadline));
        let bytes = client
            .read(offset, len as u64)
            .map_err(|e| read_err(e.to_string()))?;
        // Judged under the lock, so that once `set` returns no check it replaced still runs
        // (a mirror removes its check before it goes away). The check does no I/O.
        let current = self.check.lock();
        let verdict = match current.as_ref() {
            None => return Ok(Verdict::Accept),
            Some(c) if DynArc::ptr_eq(c, &check) => c.check(&bytes),
            Some(_) => return Err(read_err("the check was replaced meanwhile".into())),
        };
        drop(current);
        Ok(match verdict {
            Ok(()) => Verdict::Accept,
            Err(why) => {
                let why = format!(
                    "{uri}: the server that answered after a reconnection was refused: {why}; \
                     not resuming"
                );
                *self.refused.lock() = Some(why.clone());
                Verdict::Refuse(why)
            }
        })
    }
}
