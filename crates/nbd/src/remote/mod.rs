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

// Files: `spec` (the URI), `table` (what submitters and the receiver share: the slots, the
// socket's write half, completion and breaking), `receiver` (the receiver thread); this file
// opens the connection and submits.
mod receiver;
mod spec;
mod table;

pub use spec::{
    RemoteAddr, RemoteSpec, SpecError, DEFAULT_DEPTH, DEFAULT_TIMEOUT, MAX_DEPTH, MAX_TIMEOUT_SECS,
};

use std::io;
use std::net::{Shutdown, TcpStream, ToSocketAddrs};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use blk::{Bio, BioFlags, Device, EndIo, Error, Extent, Limits, Op};
use blkq_sync::atomic::{AtomicBool, Ordering};
use blkq_sync::{DynArc, Mutex};
use waitq::WaitQueue;

use crate::client::{ClientError, ExportDetails, Handshake};
use crate::proto::{CmdFlags, Command, TransmissionFlags};
use crate::stream::Stream;
use crate::transmission::Request;
use receiver::{Receiver, SCRATCH};
use table::{Shared, Status, Table, Writer};

/// Largest read or write sent when the server gives no maximum (the NBD spec's advice: 32 MiB
/// is what any server accepts).
pub const DEFAULT_MAX_IO: u32 = 32 << 20;

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
        let sent = self.sh.send(&req, payload);
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
