//! The state a [`super::RemoteDevice`] shares between its submitters and its receiver: the
//! table of requests in flight, the socket's write half, and how a request completes or the
//! connection breaks.

use std::io::{self, IoSlice, Write};
use std::net::Shutdown;
use std::time::{Duration, Instant};

use blk::{Bio, EndIo, Error, Limits, Op};
use blkq_sync::atomic::AtomicBool;
use blkq_sync::{DynArc, Mutex};
use waitq::WaitQueue;

use crate::proto::{TransmissionFlags, TransmissionMode};
use crate::stream::Stream;
use crate::transmission::Request;

// # The slot table
//
// `Table::slots` has `depth` entries, fixed at connect; `Table::free` holds the indices of the
// free ones (a stack with room for all, so pushing never allocates).
//
// - A cookie is `gen << 32 | index`. `gen` is bumped each time the slot is taken, so a reply
//   for an earlier use of the slot does not match: the receiver accepts a reply only for a
//   busy slot whose `gen` matches and whose `status` is not yet known; anything else is a
//   malformed reply, which breaks the connection.
// - Free: `busy == false`, no bio, no completion; its index is in `free`.
// - Taken by a submitter (under the table lock): `busy`, `status == None`, `end` set, `gen`
//   bumped. For a request without payload the bio goes into the slot at once, before the
//   request is sent; from then on the submitter never touches the slot again (the reply may
//   complete and free it before the submitter's send returns). For a write the submitter
//   keeps the bio (`bio == None` in the slot) while it sends the payload from the bio's
//   buffer, then puts it back; a slot whose bio is away is never freed, so it is still the
//   submitter's slot when it comes back.
// - The receiver takes a read's bio out of its slot while it receives data into the buffer
//   (table lock not held), and puts it back before it looks at anything else.
// - A slot completes when its `status` is known and its bio is in it: whoever supplies the
//   second of the two (the receiver with the status, the submitter with the bio, a break)
//   takes the bio and completion out, frees the slot, and calls `end_io` after dropping the
//   lock, then wakes one submitter waiting for a slot.
// - A break sets `Table::broken` and a status (`Lost`) on every busy slot without one; each
//   slot whose bio is in place completes at once, the others when their holder puts the bio
//   back. With `broken` set, no slot is taken again: every later submit fails at once.

/// How a request ended, once known.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Status {
    Ok,
    /// The server's error value.
    Nbd(u32),
    /// The connection broke: this errno.
    Lost(i32),
}

pub(super) struct Slot {
    pub(super) gen: u32,
    pub(super) busy: bool,
    pub(super) status: Option<Status>,
    pub(super) bio: Option<Bio>,
    pub(super) end: Option<DynArc<dyn EndIo>>,
    pub(super) op: Op,
    /// Start and length of the request, bytes.
    pub(super) offset: u64,
    pub(super) len: u64,
    pub(super) started: Instant,
    /// Read bytes received so far (data and holes).
    pub(super) covered: u64,
    /// The first error chunk's value (structured replies).
    pub(super) error: u32,
}

pub(super) struct Table {
    pub(super) slots: Vec<Slot>,
    pub(super) free: Vec<u32>,
    /// Set once, when the connection breaks: the errno later submits fail with.
    pub(super) broken: Option<i32>,
}

/// A completion to deliver once the table lock is dropped.
pub(super) type Done = (Bio, DynArc<dyn EndIo>, Status);

impl Table {
    pub(super) fn new(depth: usize) -> Self {
        let now = Instant::now();
        Self {
            slots: (0..depth)
                .map(|_| Slot {
                    gen: 0,
                    busy: false,
                    status: None,
                    bio: None,
                    end: None,
                    op: Op::Flush,
                    offset: 0,
                    len: 0,
                    started: now,
                    covered: 0,
                    error: 0,
                })
                .collect(),
            // Popped from the end: slot 0 first.
            free: (0..depth as u32).rev().collect(),
            broken: None,
        }
    }

    /// The slot a reply's cookie names, if it is awaiting a reply.
    pub(super) fn lookup(&self, cookie: u64) -> Option<usize> {
        let i = (cookie & 0xffff_ffff) as usize;
        let s = self.slots.get(i)?;
        (s.busy && u64::from(s.gen) == cookie >> 32 && s.status.is_none()).then_some(i)
    }

    /// Takes slot `i`'s completion out and frees the slot, if its status is known and its bio
    /// is in place.
    pub(super) fn take_done(&mut self, i: usize) -> Option<Done> {
        let s = self.slots.get_mut(i)?;
        if !s.busy || s.status.is_none() || s.bio.is_none() {
            return None;
        }
        let (bio, end, status) = (s.bio.take()?, s.end.take()?, s.status?);
        s.busy = false;
        s.status = None;
        self.free.push(i as u32);
        Some((bio, end, status))
    }

    /// Breaks the connection: every busy slot without a status gets `Lost(errno)`, or
    /// `Lost(ETIMEDOUT)` if it started before `expired_before`.
    pub(super) fn break_all(&mut self, errno: i32, expired_before: Option<Instant>) {
        if self.broken.is_none() {
            self.broken = Some(libc::EIO);
        }
        for s in &mut self.slots {
            if s.busy && s.status.is_none() {
                let timed_out = expired_before.is_some_and(|t| s.started <= t);
                s.status = Some(Status::Lost(if timed_out {
                    libc::ETIMEDOUT
                } else {
                    errno
                }));
            }
        }
    }
}

/// The socket's write half and the buffer a request header is encoded into.
pub(super) struct Writer {
    pub(super) stream: Stream,
    pub(super) header: [u8; 32],
}

pub(super) struct Shared {
    pub(super) uri: String,
    pub(super) table: Mutex<Table>,
    pub(super) writer: Mutex<Writer>,
    /// Submitters waiting for a free slot.
    pub(super) slot_freed: WaitQueue,
    pub(super) mode: TransmissionMode,
    pub(super) flags: TransmissionFlags,
    pub(super) limits: Limits,
    pub(super) timeout: Duration,
    /// Set by `Drop`: the receiver leaves at its next look. Ordering: the flag publishes no
    /// data (the table has its own lock) and only decides whether a broken connection is
    /// logged and when the receiver stops reading; `Drop` stores it before it shuts the socket
    /// down, and the receiver, woken by that shutdown, loads it. SeqCst is more than that
    /// needs and costs nothing here (once per receiver wake-up, never per I/O).
    pub(super) closing: AtomicBool,
    /// A handle on the socket to shut it down (the writer's may be held by a stuck
    /// submitter).
    pub(super) sock: Stream,
}

impl Shared {
    /// The error a bio completes with.
    pub(super) fn result(&self, status: Status) -> Result<(), Error> {
        match status {
            Status::Ok => Ok(()),
            Status::Nbd(e) => Err(nbd_error(e)),
            Status::Lost(errno) => Err(Error::Io(blk::error::with_context(
                io::Error::from_raw_os_error(errno),
                format!("{}: connection to the NBD server lost", self.uri),
            ))),
        }
    }

    pub(super) fn deliver(&self, done: Done) {
        let (bio, end, status) = done;
        end.end_io(bio, self.result(status));
        self.slot_freed.wake_one();
    }

    /// Completes slot `i` if it can be (see the table's invariants).
    pub(super) fn complete(&self, i: usize) {
        let done = self.table.lock().take_done(i);
        if let Some(d) = done {
            self.deliver(d);
        }
    }

    /// Sets slot `i`'s status and completes it if its bio is in place.
    pub(super) fn finish(&self, i: usize, status: Status) {
        let done = {
            let mut t = self.table.lock();
            if let Some(s) = t.slots.get_mut(i) {
                s.status = Some(status);
            }
            t.take_done(i)
        };
        if let Some(d) = done {
            self.deliver(d);
        }
    }

    /// Breaks the connection (see [`Table::break_all`]), completes every slot that can be,
    /// shuts the socket down (the receiver wakes and leaves) and wakes every submitter waiting
    /// for a slot (they fail).
    pub(super) fn break_connection(&self, errno: i32, expired_before: Option<Instant>) {
        let depth = {
            let mut t = self.table.lock();
            t.break_all(errno, expired_before);
            t.slots.len()
        };
        for i in 0..depth {
            self.complete(i);
        }
        let _ = self.sock.shutdown(Shutdown::Both);
        self.slot_freed.wake_all();
    }
}

/// NBD error values are Linux errnos; ENOTSUP becomes [`Error::NotSupported`].
pub(super) fn nbd_error(e: u32) -> Error {
    use crate::proto::*;
    let errno = match e {
        NBD_ENOTSUP => return Error::NotSupported("refused by the remote NBD server"),
        NBD_EPERM => libc::EPERM,
        NBD_ENOMEM => libc::ENOMEM,
        NBD_EINVAL => libc::EINVAL,
        NBD_ENOSPC => libc::ENOSPC,
        NBD_EOVERFLOW => libc::EOVERFLOW,
        NBD_ESHUTDOWN => libc::ESHUTDOWN,
        _ => libc::EIO,
    };
    Error::Io(io::Error::from_raw_os_error(errno))
}

impl Shared {
    /// Sends one request (header, then the payload if any) under the writer lock.
    pub(super) fn send(&self, req: &Request, payload: &[u8]) -> io::Result<()> {
        let mut w = self.writer.lock();
        let Writer { stream, header } = &mut *w;
        let n = req
            .encode_into(self.mode, header)
            .map_err(io::Error::other)?;
        write_all2(stream, &header[..n], payload)
    }
}

/// Writes `a` then `b`, gathered.
fn write_all2(s: &mut Stream, a: &[u8], b: &[u8]) -> io::Result<()> {
    let mut bufs = [IoSlice::new(a), IoSlice::new(b)];
    let mut bufs = &mut bufs[..];
    while !bufs.is_empty() {
        match s.write_vectored(bufs) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => IoSlice::advance_slices(&mut bufs, n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}
