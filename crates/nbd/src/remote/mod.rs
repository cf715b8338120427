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
//!   and a request unanswered for `timeout` declares the connection dead. When the connection
//!   breaks, the same thread re-establishes it (`reconnect`).
//! - **One sender thread** sends what no submitter is there to send: the requests waiting
//!   when a connection comes back, and the flush of an emulated FUA write (`sender`).
//!
//! No thread per request and no allocation per request: the table is sized at connect
//! (`depth=`, default 64), and a submitter finding it full waits for a slot, at most the
//! request timeout (then the bio fails with `ETIMEDOUT`): there is no unbounded queue.
//!
//! # A broken connection
//!
//! The connection breaks when the server closes it, the socket fails, a reply is malformed
//! (unknown cookie, a chunk outside its request, bad magic, ...), or a request is unanswered
//! for `timeout` on it, or the server answers `NBD_ESHUTDOWN` (it is going away). Then the
//! requests keep their slots (a write its bio and buffer), and the receiver reconnects with
//! exponential backoff (50 ms doubling, at most 2 s apart; a connection that broke within a
//! second of coming up does not reset it), negotiates again, and, if the export's size and
//! block sizes are unchanged, every request still waiting is sent again on the new
//! connection: the commands used (read, write, flush, trim, write zeroes) are idempotent by
//! offset. If the export changed, the device fails every request, now and later, with `EIO`
//! and an error naming both sizes.
//!
//! Requests wait at most `reconnect_deadline=` (default 15 s) after the break: then they fail
//! with `EIO`, and while still disconnected new requests fail at once. Reconnecting goes on in
//! the background, and once connected the same device serves again (a mirror can take the leg
//! back). A request outstanding for `timeout` plus the deadline, however many times it was
//! sent, fails with `ETIMEDOUT`. [`RemoteDevice::is_connected`] and
//! [`RemoteDevice::reconnects`] report the state. Nothing panics on what the server sends.
//!
//! # FUA
//!
//! A FUA write to a server with `NBD_CMD_FLUSH` but not `NBD_CMD_FLAG_FUA` is emulated: the
//! write is sent without the flag; once it is answered the sender sends a flush on the same
//! slot, and the bio completes when the flush is answered. A server without flush has no write
//! cache: a write is durable when answered, and FUA is dropped.
//!
//! # Extents
//!
//! When the server has structured replies and the `base:allocation` metadata context, it is
//! negotiated and [`Device::extents_into`] asks `NBD_CMD_BLOCK_STATUS`; otherwise every range
//! is reported allocated.
//!
//! # TLS
//!
//! `nbds://` and `nbds+unix://` start TLS (`NBD_OPT_STARTTLS`) before anything else, at
//! connect and at every reconnection, with the certificates of `tls-certificates=DIR` (read
//! again each time). The split works as on a plain socket: the receiver decrypts on its
//! handle, the submitters and the sender encrypt and send on theirs under the writer lock,
//! and the TLS session's own lock is never held across a socket call (see `crate::tls`).
//!
//! Not yet done: several connections (multi-conn).

// Files: `spec` (the URI), `connect` (dialing and negotiating one connection), `table` (what
// the threads share: the slots, the socket's write half, sending, completion, failing),
// `submit` (taking a slot and the first send), `extents` (block status), `receiver` (receiving on one connection),
// `reconnect` (the receiver thread's loop around it), `sender` (the sender thread); this file
// opens the device and maps bios to commands.
mod connect;
mod extents;
mod receiver;
mod reconnect;
mod sender;
mod spec;
mod submit;
mod table;

pub use connect::{RemoteError, DEFAULT_MAX_IO};
pub use spec::{
    RemoteAddr, RemoteSpec, SpecError, TlsSpec, DEFAULT_DEPTH, DEFAULT_RECONNECT_DEADLINE,
    DEFAULT_TIMEOUT, MAX_DEPTH, MAX_TIMEOUT_SECS,
};

use std::io;
use std::time::{Duration, Instant};

use blk::{Bio, BioFlags, Device, EndIo, Error, Extent, Limits, Op};
use blkq_sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use blkq_sync::{DynArc, Mutex};
use waitq::WaitQueue;

use crate::client::ExportDetails;
use crate::proto::{CmdFlags, Command, TransmissionFlags};
use receiver::{Receiver, SCRATCH};
use reconnect::Supervisor;
use submit::Req;
use table::{Conn, Shared, Table, Writer};

/// An export on another NBD server, as a [`blk::Device`] (see the module documentation).
pub struct RemoteDevice {
    sh: DynArc<Shared>,
    receiver: Option<std::thread::JoinHandle<()>>,
    sender: Option<std::thread::JoinHandle<()>>,
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

impl RemoteDevice {
    /// Parses `spec` and connects ([`RemoteDevice::connect`]).
    pub fn open(spec: &str) -> Result<Self, RemoteError> {
        Self::connect(RemoteSpec::parse(spec)?)
    }

    /// Connects, negotiates (structured replies if the server has them, `NBD_OPT_GO` on the
    /// spec's export), and starts the receiver and sender threads. Every step of the
    /// handshake is bounded by the spec's timeout. A server that cannot be reached now is an
    /// error (reconnecting is for a connection that was established once).
    pub fn connect(spec: RemoteSpec) -> Result<Self, RemoteError> {
        let uri = spec.to_string();
        let opened = connect::open(&spec)?;
        let io_err = |e: io::Error| RemoteError::Connect {
            uri: uri.clone(),
            source: e,
        };
        let connect::Opened {
            stream,
            mode,
            details,
            limits,
            meta_id,
        } = opened;
        let mut table = Table::new(spec.depth);
        table.meta_id = meta_id;
        // The receiver wakes every tick to check the requests' ages.
        let tick = (spec.timeout / 4).clamp(Duration::from_millis(50), Duration::from_secs(1));
        stream.set_read_timeout(Some(tick)).map_err(io_err)?;
        let reader = stream.try_clone().map_err(io_err)?;
        let sock = stream.try_clone().map_err(io_err)?;
        let sh = DynArc::new(Shared {
            uri: uri.clone(),
            table: Mutex::new(table),
            writer: Mutex::new(Writer {
                stream: Some(stream),
                mode,
                header: [0; 32],
            }),
            slot_freed: WaitQueue::new(),
            sender_wq: WaitQueue::new(),
            backoff_wq: WaitQueue::new(),
            flags: AtomicU32::new(u32::from(details.flags.bits())),
            limits,
            timeout: spec.timeout,
            reconnect_deadline: spec.reconnect_deadline,
            closing: AtomicBool::new(false),
            sock: Mutex::new(Some(sock)),
            reconnects: AtomicU64::new(0),
            fatal: Mutex::new(None),
        });
        let sup = Supervisor::new(
            Receiver {
                sh: sh.clone(),
                stream: reader,
                mode,
                scratch: vec![0; SCRATCH],
                tick,
                last_check: Instant::now(),
            },
            spec.clone(),
        );
        let sh2 = sh.clone();
        let sender = std::thread::Builder::new()
            .name("blkq-nbd-send".into())
            .spawn(move || sender::run(sh2))
            .map_err(io_err)?;
        let mut dev = Self {
            sh,
            receiver: None,
            sender: Some(sender),
            details,
            spec,
        };
        // On failure `dev`'s drop stops the sender.
        dev.receiver = Some(
            std::thread::Builder::new()
                .name("blkq-nbd-remote".into())
                .spawn(move || sup.run())
                .map_err(io_err)?,
        );
        Ok(dev)
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

    /// Whether the device is dead for good: it is closing, or the export changed under it
    /// while reconnecting (every submit fails).
    pub fn is_broken(&self) -> bool {
        self.sh.table.lock().conn == Conn::Dead
    }

    /// Whether a connection is established now (false while reconnecting, and once dead).
    pub fn is_connected(&self) -> bool {
        self.sh.table.lock().conn == Conn::Up
    }

    /// Connections re-established since the device was opened.
    pub fn reconnects(&self) -> u64 {
        // Relaxed: a statistic (see the field).
        self.sh.reconnects.load(Ordering::Relaxed)
    }

    /// Requests in flight.
    pub fn in_flight(&self) -> usize {
        let t = self.sh.table.lock();
        t.slots.len() - t.free.len()
    }

    /// The command and flags for `bio`, `Ok(None)` when it completes at once without asking
    /// the server (a flush to a server without a write cache), or why it fails.
    fn command(&self, bio: &Bio) -> Result<Option<(Command, CmdFlags, bool)>, Error> {
        let f = self.sh.flags();
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
            } else if bio.op == Op::Write {
                // Emulated: the write, then a flush (see `fua_flush` below).
                Ok(flags)
            } else {
                Err(Error::NotSupported(
                    "FUA on a discard or write zeroes (the server offers flush but not FUA)",
                ))
            }
        };
        let fua_flush = bio.op == Op::Write
            && bio.flags.contains(BioFlags::FUA)
            && has(TransmissionFlags::SEND_FLUSH)
            && !has(TransmissionFlags::SEND_FUA);
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
                (cmd, fua(CmdFlags::empty())?, fua_flush)
            }
            Op::Flush if !has(TransmissionFlags::SEND_FLUSH) => return Ok(None),
            Op::Flush => (Command::Flush, CmdFlags::empty(), false),
            Op::Discard if !has(TransmissionFlags::SEND_TRIM) => {
                return Err(Error::NotSupported("discard (the server does not trim)"))
            }
            Op::Discard => (Command::Trim, fua(CmdFlags::empty())?, false),
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
                (Command::WriteZeroes, fua(flags)?, false)
            }
        }))
    }
}

impl Device for RemoteDevice {
    fn submit(&self, bio: Bio, end: &DynArc<dyn EndIo>) {
        let (cmd, flags, fua_flush) = match self.command(&bio) {
            Ok(Some(c)) => c,
            Ok(None) => return end.end_io(bio, Ok(())),
            Err(e) => return end.end_io(bio, Err(e)),
        };
        let req = Req {
            cmd,
            flags,
            fua_flush,
            offset: bio.offset(),
            len: u64::from(bio.len),
        };
        self.sh.submit(bio, end, req);
    }

    fn limits(&self) -> Limits {
        self.sh.limits
    }

    /// From `NBD_CMD_BLOCK_STATUS` (`base:allocation`) when the server offers it; every
    /// range is allocated otherwise (see `extents`).
    fn extents_into(
        &self,
        offset: u64,
        len: u64,
        max: usize,
        out: &mut Vec<Extent>,
    ) -> Result<(), Error> {
        self.sh.extents_into(offset, len, max, out)
    }
}

impl Drop for RemoteDevice {
    /// Shuts the socket down and joins the receiver, which fails what is still in flight
    /// with `EIO`, then the sender.
    fn drop(&mut self) {
        // SeqCst: see `Shared::closing`.
        self.sh.closing.store(true, Ordering::SeqCst);
        self.sh.shut_socket();
        self.sh.backoff_wq.wake_all();
        self.sh.sender_wq.wake_all();
        if let Some(h) = self.receiver.take() {
            let _ = h.join();
        } else {
            // The receiver never started: nobody else fails what is waiting.
            self.sh.kill(None);
        }
        if let Some(h) = self.sender.take() {
            let _ = h.join();
        }
    }
}
