//! A [`blk::Device`] backed by an export on another NBD server: [`RemoteDevice`], opened from
//! an `nbd://` or `nbd+unix://` spec ([`RemoteSpec`]).
//!
//! # Shape
//!
//! One connection, negotiated with the blocking client's [`Handshake`] (structured replies
//! when the server has them, `NBD_OPT_GO` with block-size information), then split:
//!
//! - **Submitters** (any thread calling [`Device::submit`]) take a free slot of a fixed table,
//!   then send the request header and, for a write, the payload straight from the bio's
//!   buffer, holding the mutex around the socket's write half only while they send.
//! - **One receiver thread** reads replies (simple and structured), finds each reply's slot by
//!   its cookie, receives read data straight into the bio's buffer, and completes the bio.
//!   It also enforces the request timeout: the socket's receive timeout wakes it every tick,
//!   and a request in flight longer than `timeout` breaks the connection.
//!
//! No thread per request and no allocation per request: the table is sized at connect
//! (`depth=`, default 64), and a submitter finding it full waits for a slot, at most the
//! request timeout (then the bio fails with `ETIMEDOUT`): there is no unbounded queue.
//!
//! # A broken connection
//!
//! The connection breaks when the server closes it, the socket fails, a reply is malformed
//! (unknown cookie, a chunk outside its request, bad magic, ...), or a request times out. Then
//! every request in flight completes with `EIO` (`ETIMEDOUT` for those that timed out), the
//! receiver thread exits, and every later submit fails at once with `EIO`. Nothing panics on
//! what the server sends.
//!
//! Not yet done (later steps): reconnecting with backoff and re-sending what was in flight
//! (`reconnect_deadline=`); several connections (multi-conn); TLS (`nbds://`); block status
//! for [`Device::extents_into`] (every range is reported allocated).

mod spec;

pub use spec::{
    RemoteAddr, RemoteSpec, SpecError, DEFAULT_DEPTH, DEFAULT_TIMEOUT, MAX_DEPTH, MAX_TIMEOUT_SECS,
};

use std::io::{self, IoSlice, Read, Write};
use std::net::{Shutdown, TcpStream, ToSocketAddrs};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use blk::{Bio, BioFlags, Device, EndIo, Error, Extent, Limits, Op};
use blkq_sync::atomic::{AtomicBool, Ordering};
use blkq_sync::{DynArc, Mutex};
use waitq::WaitQueue;

use crate::client::{ClientError, ExportDetails, Handshake};
use crate::proto::{
    CmdFlags, Command, TransmissionFlags, TransmissionMode, NBD_REPLY_TYPE_OFFSET_DATA,
    SIMPLE_REPLY_LEN,
};
use crate::stream::Stream;
use crate::transmission::{decode_reply_header, parse_chunk, Chunk, ReplyHeader, Request};
use crate::Decoded;

/// Largest read or write sent when the server gives no maximum (the NBD spec's advice: 32 MiB
/// is what any server accepts).
pub const DEFAULT_MAX_IO: u32 = 32 << 20;

/// Bytes of a non-data reply chunk the receiver accepts (an error chunk's message is at most
/// 4 KiB); a longer one is a malformed reply.
const SCRATCH: usize = 8 << 10;

/// Errors of [`RemoteDevice::connect`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RemoteError {
    /// The spec does not parse.
    #[error(transparent)]
    Spec(#[from] SpecError),
    /// The server cannot be reached.
    #[error("{uri}: cannot connect: {source}")]
    Connect {
        /// The URI.
        uri: String,
        /// Why.
        source: io::Error,
    },
    /// The handshake failed (the export does not exist, the server refused, ...).
    #[error("{uri}: handshake: {source}")]
    Handshake {
        /// The URI.
        uri: String,
        /// Why.
        source: ClientError,
    },
    /// The export's constraints cannot be met.
    #[error("{uri}: {reason}")]
    Unusable {
        /// The URI.
        uri: String,
        /// Why.
        reason: String,
    },
}

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
enum Status {
    Ok,
    /// The server's error value.
    Nbd(u32),
    /// The connection broke: this errno.
    Lost(i32),
}

struct Slot {
    gen: u32,
    busy: bool,
    status: Option<Status>,
    bio: Option<Bio>,
    end: Option<DynArc<dyn EndIo>>,
    op: Op,
    /// Start and length of the request, bytes.
    offset: u64,
    len: u64,
    started: Instant,
    /// Read bytes received so far (data and holes).
    covered: u64,
    /// The first error chunk's value (structured replies).
    error: u32,
}

struct Table {
    slots: Vec<Slot>,
    free: Vec<u32>,
    /// Set once, when the connection breaks: the errno later submits fail with.
    broken: Option<i32>,
}

/// A completion to deliver once the table lock is dropped.
type Done = (Bio, DynArc<dyn EndIo>, Status);

impl Table {
    fn new(depth: usize) -> Self {
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
    fn lookup(&self, cookie: u64) -> Option<usize> {
        let i = (cookie & 0xffff_ffff) as usize;
        let s = self.slots.get(i)?;
        (s.busy && u64::from(s.gen) == cookie >> 32 && s.status.is_none()).then_some(i)
    }

    /// Takes slot `i`'s completion out and frees the slot, if its status is known and its bio
    /// is in place.
    fn take_done(&mut self, i: usize) -> Option<Done> {
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
    fn break_all(&mut self, errno: i32, expired_before: Option<Instant>) {
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
struct Writer {
    stream: Stream,
    header: [u8; 32],
}

struct Shared {
    uri: String,
    table: Mutex<Table>,
    writer: Mutex<Writer>,
    /// Submitters waiting for a free slot.
    slot_freed: WaitQueue,
    mode: TransmissionMode,
    flags: TransmissionFlags,
    limits: Limits,
    timeout: Duration,
    /// Set by `Drop`: the receiver leaves at its next look.
    closing: AtomicBool,
    /// A handle on the socket to shut it down (the writer's may be held by a stuck
    /// submitter).
    sock: Stream,
}

impl Shared {
    /// The error a bio completes with.
    fn result(&self, status: Status) -> Result<(), Error> {
        match status {
            Status::Ok => Ok(()),
            Status::Nbd(e) => Err(nbd_error(e)),
            Status::Lost(errno) => Err(Error::Io(blk::error::with_context(
                io::Error::from_raw_os_error(errno),
                format!("{}: connection to the NBD server lost", self.uri),
            ))),
        }
    }

    fn deliver(&self, done: Done) {
        let (bio, end, status) = done;
        end.end_io(bio, self.result(status));
        self.slot_freed.wake_one();
    }

    /// Completes slot `i` if it can be (see the table's invariants).
    fn complete(&self, i: usize) {
        let done = self.table.lock().take_done(i);
        if let Some(d) = done {
            self.deliver(d);
        }
    }

    /// Sets slot `i`'s status and completes it if its bio is in place.
    fn finish(&self, i: usize, status: Status) {
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
    fn break_connection(&self, errno: i32, expired_before: Option<Instant>) {
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
fn nbd_error(e: u32) -> Error {
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

/// An export on another NBD server, as a [`blk::Device`] (see the module documentation).
pub struct RemoteDevice {
    sh: DynArc<Shared>,
    receiver: Option<std::thread::JoinHandle<()>>,
    details: ExportDetails,
    spec: RemoteSpec,
}

impl std::fmt::Debug for RemoteDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteDevice")
            .field("uri", &self.sh.uri)
            .field("limits", &self.sh.limits)
            .finish()
    }
}

/// Connects to `addr`, each attempt bounded by `timeout` (TCP) where the host allows.
fn dial(addr: &RemoteAddr, timeout: Duration) -> io::Result<Stream> {
    match addr {
        RemoteAddr::Unix(p) => Ok(Stream::Unix(UnixStream::connect(p)?)),
        RemoteAddr::Tcp { host, port } => {
            let mut last = io::Error::new(io::ErrorKind::NotFound, "the host has no address");
            for a in (host.as_str(), *port).to_socket_addrs()? {
                match TcpStream::connect_timeout(&a, timeout) {
                    Ok(s) => {
                        s.set_nodelay(true)?;
                        return Ok(Stream::Tcp(s));
                    }
                    Err(e) => last = e,
                }
            }
            Err(last)
        }
    }
}

/// The export's constraints as [`Limits`]: the logical block is the server's minimum block
/// (at least 512 bytes), the largest I/O its maximum payload (at most [`DEFAULT_MAX_IO`]).
fn limits_of(details: &ExportDetails) -> Result<Limits, String> {
    let (min, max) = details
        .block_size
        .map_or((1, u32::MAX), |b| (b.min.max(1), b.max));
    let lbs = min.max(512);
    if !lbs.is_power_of_two() {
        return Err(format!(
            "the minimum block size {min} is not a power of two"
        ));
    }
    let max_io = max.min(DEFAULT_MAX_IO) / lbs * lbs;
    if max_io == 0 {
        return Err(format!(
            "the maximum payload {max} is smaller than the block size {lbs}"
        ));
    }
    Ok(Limits {
        capacity: details.size,
        logical_block_size: lbs,
        max_io_bytes: max_io,
    })
}

impl RemoteDevice {
    /// Parses `spec` and connects ([`RemoteDevice::connect`]).
    pub fn open(spec: &str) -> Result<Self, RemoteError> {
        Self::connect(RemoteSpec::parse(spec)?)
    }

    /// Connects, negotiates (structured replies if the server has them, `NBD_OPT_GO` on the
    /// spec's export), and starts the receiver thread. Every step of the handshake is bounded
    /// by the spec's timeout.
    pub fn connect(spec: RemoteSpec) -> Result<Self, RemoteError> {
        let uri = spec.to_string();
        let stream = dial(&spec.addr, spec.timeout).map_err(|source| RemoteError::Connect {
            uri: uri.clone(),
            source,
        })?;
        let hs_err = |source: ClientError| RemoteError::Handshake {
            uri: uri.clone(),
            source,
        };
        let io_err = |e: io::Error| hs_err(ClientError::Io(e));
        stream
            .set_read_timeout(Some(spec.timeout))
            .map_err(io_err)?;
        stream
            .set_write_timeout(Some(spec.timeout))
            .map_err(io_err)?;
        let mut hs = Handshake::start(stream).map_err(hs_err)?;
        match hs.structured_replies() {
            Ok(()) => {}
            // A server without structured replies: simple replies do.
            Err(e) if e.option_error().is_some() => {}
            Err(e) => return Err(hs_err(e)),
        }
        let details = hs.go(&spec.export).map_err(hs_err)?;
        let (stream, mode) = hs.into_parts();
        let limits = limits_of(&details).map_err(|reason| RemoteError::Unusable {
            uri: uri.clone(),
            reason,
        })?;
        // The receiver wakes every tick to check the requests' ages.
        let tick = (spec.timeout / 4).clamp(Duration::from_millis(50), Duration::from_secs(1));
        stream.set_read_timeout(Some(tick)).map_err(io_err)?;
        let reader = stream.try_clone().map_err(io_err)?;
        let sock = stream.try_clone().map_err(io_err)?;
        let sh = DynArc::new(Shared {
            uri: uri.clone(),
            table: Mutex::new(Table::new(spec.depth)),
            writer: Mutex::new(Writer {
                stream,
                header: [0; 32],
            }),
            slot_freed: WaitQueue::new(),
            mode,
            flags: details.flags,
            limits,
            timeout: spec.timeout,
            closing: AtomicBool::new(false),
            sock,
        });
        let rx = Receiver {
            sh: sh.clone(),
            stream: reader,
            scratch: vec![0; SCRATCH],
            tick,
            last_check: Instant::now(),
        };
        let receiver = std::thread::Builder::new()
            .name("blkq-nbd-remote".into())
            .spawn(move || rx.run())
            .map_err(io_err)?;
        Ok(Self {
            sh,
            receiver: Some(receiver),
            details,
            spec,
        })
    }

    /// What the handshake said about the export (size, flags, block sizes, name).
    pub fn details(&self) -> &ExportDetails {
        &self.details
    }

    /// The spec it was opened with.
    pub fn spec(&self) -> &RemoteSpec {
        &self.spec
    }

    /// The server's preferred block size (`NBD_INFO_BLOCK_SIZE`; 4096 if it sent none).
    pub fn preferred_block_size(&self) -> u32 {
        self.details.block_size.map_or(4096, |b| b.preferred)
    }

    /// Whether the connection is broken (every submit fails).
    pub fn is_broken(&self) -> bool {
        self.sh.table.lock().broken.is_some()
    }

    /// Requests in flight.
    pub fn in_flight(&self) -> usize {
        let t = self.sh.table.lock();
        t.slots.len() - t.free.len()
    }

    /// The command and flags for `bio`, `Ok(None)` when it completes at once without asking
    /// the server (a flush to a server without a write cache), or why it fails.
    fn command(&self, bio: &Bio) -> Result<Option<(Command, CmdFlags)>, Error> {
        let f = self.sh.flags;
        let has = |x| f.contains(x);
        self.sh.limits.validate(bio)?;
        if bio.op != Op::Read && bio.op != Op::Flush && has(TransmissionFlags::READ_ONLY) {
            return Err(Error::ReadOnly);
        }
        let fua = |flags: CmdFlags| -> Result<CmdFlags, Error> {
            if !bio.flags.contains(BioFlags::FUA) {
                Ok(flags)
            } else if has(TransmissionFlags::SEND_FUA) {
                Ok(flags | CmdFlags::FUA)
            } else if !has(TransmissionFlags::SEND_FLUSH) {
                // No write cache: every write is durable when acknowledged.
                Ok(flags)
            } else {
                Err(Error::NotSupported(
                    "FUA (the server offers flush but not FUA)",
                ))
            }
        };
        Ok(Some(match bio.op {
            Op::Read | Op::Write => {
                if bio.buf.is_none() {
                    return Err(Error::NoBuffer);
                }
                let cmd = if bio.op == Op::Read {
                    Command::Read
                } else {
                    Command::Write
                };
                (cmd, fua(CmdFlags::empty())?)
            }
            Op::Flush if !has(TransmissionFlags::SEND_FLUSH) => return Ok(None),
            Op::Flush => (Command::Flush, CmdFlags::empty()),
            Op::Discard if !has(TransmissionFlags::SEND_TRIM) => {
                return Err(Error::NotSupported("discard (the server does not trim)"))
            }
            Op::Discard => (Command::Trim, fua(CmdFlags::empty())?),
            Op::WriteZeroes => {
                if !has(TransmissionFlags::SEND_WRITE_ZEROES) {
                    return Err(Error::NotSupported(
                        "write zeroes (not offered by the server)",
                    ));
                }
                let mut flags = CmdFlags::empty();
                if bio.flags.contains(BioFlags::NO_HOLE) {
                    flags |= CmdFlags::NO_HOLE;
                }
                if bio.flags.contains(BioFlags::FAST_ZERO) {
                    if !has(TransmissionFlags::SEND_FAST_ZERO) {
                        return Err(Error::NotSupported("fast zero"));
                    }
                    flags |= CmdFlags::FAST_ZERO;
                }
                (Command::WriteZeroes, fua(flags)?)
            }
        }))
    }

    /// Sends one request (header, then the payload if any) under the writer lock.
    fn send(&self, req: &Request, payload: &[u8]) -> io::Result<()> {
        let mut w = self.sh.writer.lock();
        let Writer { stream, header } = &mut *w;
        let n = req
            .encode_into(self.sh.mode, header)
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

impl Device for RemoteDevice {
    fn submit(&self, bio: Bio, end: &DynArc<dyn EndIo>) {
        let (cmd, flags) = match self.command(&bio) {
            Ok(Some(c)) => c,
            Ok(None) => return end.end_io(bio, Ok(())),
            Err(e) => return end.end_io(bio, Err(e)),
        };
        let op = bio.op;
        let (offset, len) = (bio.offset(), u64::from(bio.len));
        let keep = op == Op::Write;
        let mut held = Some(bio);
        let deadline = Instant::now() + self.sh.timeout;
        let taken = self.sh.slot_freed.wait_for_until(
            || {
                let mut t = self.sh.table.lock();
                if let Some(errno) = t.broken {
                    return Some(Err(errno));
                }
                let i = t.free.pop()? as usize;
                let s = &mut t.slots[i];
                s.gen = s.gen.wrapping_add(1);
                s.busy = true;
                s.status = None;
                s.end = Some(end.clone());
                (s.op, s.offset, s.len) = (op, offset, len);
                s.started = Instant::now();
                s.covered = 0;
                s.error = 0;
                if !keep {
                    s.bio = held.take();
                }
                Some(Ok((i, (u64::from(s.gen) << 32) | i as u64)))
            },
            deadline,
        );
        let (i, cookie) = match taken {
            Some(Ok(t)) => t,
            Some(Err(errno)) => {
                if let Some(bio) = held {
                    end.end_io(bio, self.sh.result(Status::Lost(errno)));
                }
                return;
            }
            None => {
                if let Some(bio) = held {
                    let e = io::Error::from_raw_os_error(libc::ETIMEDOUT);
                    let e = blk::error::with_context(
                        e,
                        format!("{}: no free request slot within the timeout", self.sh.uri),
                    );
                    end.end_io(bio, Err(Error::Io(e)));
                }
                return;
            }
        };
        let req = Request::new(cmd, cookie, offset, len).with_flags(flags);
        let payload = held
            .as_ref()
            .and_then(|b| b.buf.as_ref())
            .and_then(|b| b.as_slice().get(..len as usize))
            .unwrap_or(&[]);
        let sent = self.send(&req, payload);
        if keep {
            // Still our slot: it is not freed while its bio is away.
            self.sh.table.lock().slots[i].bio = held.take();
        }
        if let Err(e) = sent {
            tracing::warn!(uri = %self.sh.uri, "sending a request failed: {e}");
            self.sh.break_connection(libc::EIO, None);
        } else if keep {
            self.sh.complete(i);
        }
    }

    fn limits(&self) -> Limits {
        self.sh.limits
    }

    /// Reports the whole range as one allocated extent: block status (`base:allocation`) is
    /// not asked of the server yet, so holes are not known here.
    fn extents_into(
        &self,
        offset: u64,
        len: u64,
        max: usize,
        out: &mut Vec<Extent>,
    ) -> Result<(), Error> {
        out.clear();
        let cap = self.sh.limits.capacity;
        if offset.checked_add(len).is_none_or(|e| e > cap) {
            return Err(Error::OutOfRange {
                offset,
                len,
                capacity: cap,
            });
        }
        if len > 0 && max > 0 {
            out.push(Extent {
                offset,
                len,
                allocated: true,
            });
        }
        Ok(())
    }
}

impl Drop for RemoteDevice {
    /// Shuts the socket down and joins the receiver, which fails what is still in flight
    /// with `EIO`.
    fn drop(&mut self) {
        self.sh.closing.store(true, Ordering::SeqCst);
        let _ = self.sh.sock.shutdown(Shutdown::Both);
        if let Some(h) = self.receiver.take() {
            let _ = h.join();
        }
    }
}

/// Why the receiver stopped.
#[derive(Debug, thiserror::Error)]
enum Stop {
    /// The server closed the connection.
    #[error("the server closed the connection")]
    Closed,
    /// The device is being dropped.
    #[error("closing")]
    Closing,
    /// A socket error.
    #[error("socket error: {0}")]
    Io(io::Error),
    /// A malformed reply.
    #[error("malformed reply: {0}")]
    Malformed(String),
    /// Requests started at or before this instant timed out.
    #[error("a request timed out")]
    TimedOut(Instant),
}

struct Receiver {
    sh: DynArc<Shared>,
    stream: Stream,
    scratch: Vec<u8>,
    tick: Duration,
    last_check: Instant,
}

impl Receiver {
    fn run(mut self) {
        let stop = loop {
            if let Err(s) = self.one_reply() {
                break s;
            }
        };
        let (errno, expired) = match &stop {
            Stop::TimedOut(t) => (libc::EIO, Some(*t)),
            _ => (libc::EIO, None),
        };
        if !self.sh.closing.load(Ordering::SeqCst) {
            tracing::warn!(uri = %self.sh.uri, "the connection to the NBD server broke: {stop}");
        }
        self.sh.break_connection(errno, expired);
    }

    /// Fails if the device is closing or a request has been in flight longer than the
    /// timeout.
    fn check(&mut self) -> Result<(), Stop> {
        self.last_check = Instant::now();
        if self.sh.closing.load(Ordering::SeqCst) {
            return Err(Stop::Closing);
        }
        let Some(limit) = self.last_check.checked_sub(self.sh.timeout) else {
            return Ok(());
        };
        let t = self.sh.table.lock();
        if t.slots
            .iter()
            .any(|s| s.busy && s.status.is_none() && s.started <= limit)
        {
            return Err(Stop::TimedOut(limit));
        }
        Ok(())
    }

    /// Reads exactly `buf.len()` bytes, checking the timeouts at every tick.
    fn read_full(&mut self, buf: &mut [u8]) -> Result<(), Stop> {
        let mut at = 0;
        while at < buf.len() {
            match self.stream.read(&mut buf[at..]) {
                Ok(0) => return Err(Stop::Closed),
                Ok(n) => at += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) =>
                {
                    self.check()?
                }
                Err(e) => return Err(Stop::Io(e)),
            }
        }
        Ok(())
    }

    fn read_scratch(&mut self, n: usize) -> Result<(), Stop> {
        let mut s = std::mem::take(&mut self.scratch);
        let r = match s.get_mut(..n) {
            Some(b) => self.read_full(b),
            None => Err(Stop::Malformed(format!("a reply chunk of {n} bytes"))),
        };
        self.scratch = s;
        r
    }

    /// Receives `n` bytes straight into slot `i`'s bio buffer at `at`.
    fn read_into_bio(&mut self, i: usize, at: u64, n: u64) -> Result<(), Stop> {
        let bio = self
            .sh
            .table
            .lock()
            .slots
            .get_mut(i)
            .and_then(|s| s.bio.take());
        let Some(mut bio) = bio else {
            return Err(Stop::Malformed(
                "read data for a slot without its bio".into(),
            ));
        };
        let range = usize::try_from(at)
            .ok()
            .zip(usize::try_from(at + n).ok())
            .and_then(|(a, b)| bio.buf.as_mut()?.as_mut_slice().get_mut(a..b));
        let r = match range {
            Some(dst) => self.read_full(dst),
            None => Err(Stop::Malformed("read data outside the buffer".into())),
        };
        self.sh.table.lock().slots[i].bio = Some(bio);
        r
    }

    fn lookup(&self, cookie: u64) -> Result<(usize, Op, u64, u64), Stop> {
        let t = self.sh.table.lock();
        let i = t.lookup(cookie).ok_or_else(|| {
            Stop::Malformed(format!(
                "a reply for cookie {cookie:#x}, which is not in flight"
            ))
        })?;
        let s = &t.slots[i];
        Ok((i, s.op, s.offset, s.len))
    }

    fn one_reply(&mut self) -> Result<(), Stop> {
        if self.last_check.elapsed() >= self.tick {
            self.check()?;
        }
        let mut hdr = [0u8; 32];
        self.read_full(&mut hdr[..SIMPLE_REPLY_LEN])?;
        let mut have = SIMPLE_REPLY_LEN;
        let header = loop {
            match decode_reply_header(&hdr[..have], self.sh.mode) {
                Ok(Decoded::Complete { value, .. }) => break value,
                Ok(Decoded::Incomplete(n)) if n > have && n <= hdr.len() => {
                    let mut more = [0u8; 32];
                    self.read_full(&mut more[..n - have])?;
                    hdr[have..n].copy_from_slice(&more[..n - have]);
                    have = n;
                }
                Ok(Decoded::Incomplete(n)) => {
                    return Err(Stop::Malformed(format!("a reply header of {n} bytes")))
                }
                Err(e) => return Err(Stop::Malformed(e.to_string())),
            }
        };
        match header {
            ReplyHeader::Simple(r) => {
                let (i, op, _, len) = self.lookup(r.cookie)?;
                if r.error != 0 {
                    self.sh.finish(i, Status::Nbd(r.error));
                } else {
                    if op == Op::Read {
                        if self.sh.mode != TransmissionMode::Simple {
                            return Err(Stop::Malformed(
                                "a simple reply to a successful read in structured mode".into(),
                            ));
                        }
                        self.read_into_bio(i, 0, len)?;
                    }
                    self.sh.finish(i, Status::Ok);
                }
            }
            ReplyHeader::Chunk(h) => {
                let (i, op, off, len) = self.lookup(h.cookie)?;
                let inside = |o: u64, n: u64| -> Result<u64, Stop> {
                    match (o.checked_sub(off), o.checked_add(n)) {
                        (Some(at), Some(e)) if op == Op::Read && e <= off + len => Ok(at),
                        _ => Err(Stop::Malformed(format!(
                            "data {o}+{n} outside the request {off}+{len}"
                        ))),
                    }
                };
                if h.reply_type == NBD_REPLY_TYPE_OFFSET_DATA {
                    if h.length <= 8 {
                        return Err(Stop::Malformed("a data chunk without data".into()));
                    }
                    let mut o = [0u8; 8];
                    self.read_full(&mut o)?;
                    let n = h.length - 8;
                    let at = inside(u64::from_be_bytes(o), n)?;
                    self.read_into_bio(i, at, n)?;
                    self.sh.table.lock().slots[i].covered += n;
                } else {
                    let n = usize::try_from(h.length).unwrap_or(usize::MAX);
                    self.read_scratch(n)?;
                    let payload = self.scratch.get(..n).unwrap_or(&[]);
                    let (error, hole) = match parse_chunk(&h, payload) {
                        Ok(Chunk::None) => (0, None),
                        Ok(Chunk::OffsetHole { offset, size }) => (0, Some((offset, size))),
                        Ok(
                            Chunk::Error { error, .. }
                            | Chunk::ErrorOffset { error, .. }
                            | Chunk::OtherError { error, .. },
                        ) => (error.max(1), None),
                        Ok(other) => {
                            return Err(Stop::Malformed(format!("an unasked-for chunk {other:?}")))
                        }
                        Err(e) => return Err(Stop::Malformed(e.to_string())),
                    };
                    if let Some((o, size)) = hole {
                        let at = inside(o, u64::from(size))? as usize;
                        let mut t = self.sh.table.lock();
                        let s = &mut t.slots[i];
                        let dst = s
                            .bio
                            .as_mut()
                            .and_then(|b| b.buf.as_mut())
                            .and_then(|b| b.as_mut_slice().get_mut(at..at + size as usize));
                        let Some(dst) = dst else {
                            return Err(Stop::Malformed("a hole outside the buffer".into()));
                        };
                        dst.fill(0);
                        s.covered += u64::from(size);
                    }
                    if error != 0 {
                        let mut t = self.sh.table.lock();
                        if t.slots[i].error == 0 {
                            t.slots[i].error = error;
                        }
                    }
                }
                if h.is_done() {
                    let (error, covered) = {
                        let t = self.sh.table.lock();
                        (t.slots[i].error, t.slots[i].covered)
                    };
                    let status = if error != 0 {
                        Status::Nbd(error)
                    } else if op == Op::Read && covered != len {
                        return Err(Stop::Malformed(format!(
                            "a read of {len} bytes answered with {covered}"
                        )));
                    } else {
                        Status::Ok
                    };
                    self.sh.finish(i, status);
                }
            }
        }
        Ok(())
    }
}
