//! A [`blk::Device`] backed by an export on another NBD server: [`RemoteDevice`], opened from
//! an `nbd://`, `nbd+unix://`, `nbds://` or `nbds+unix://` spec ([`RemoteSpec`]).
//!
//! # Shape
//!
//! A connection (one by default, see "Several connections"), negotiated with the blocking
//! client's [`Handshake`](crate::client::Handshake) (TLS for `nbds`, structured replies and
//! `base:allocation` when the server has them, `NBD_OPT_GO` with block-size information),
//! then split:
//!
//! - **Submitters** (any thread calling [`Device::submit`]) take a free slot of a fixed table,
//!   then, when the socket's write half is free at once (`try_lock`), send the request header
//!   and, for a write, the payload straight from the bio's buffer with one non-blocking
//!   `sendmsg`; what the socket does not take at once is the sender thread's ("Sending
//!   inline" in `send`; `send=thread` always hands over). A submitter never waits for the
//!   server to read.
//!   A batch (`Device::submit_batch`) goes out together: up to 16 requests with one
//!   `sendmsg` by the same rules (`Batch` in `submit`).
//! - **One receiver thread** reads replies (simple and structured) through a buffer (one
//!   `recv` for what the server has sent, `receiver::RECV_BUF`), finds each reply's slot by
//!   its cookie, receives read data into the bio's buffer (a large read straight from the
//!   socket), and completes the bio: as one of a run (`EndIo::end_io_batched`) closed
//!   (`EndIo::end_batch`) before it next reads from the socket.
//!   It also enforces the request timeout: the socket's receive timeout wakes it every tick,
//!   and a request not wholly answered `timeout` after it was sent (a reply still arriving,
//!   however slowly, counts as unanswered) declares the connection dead. When the connection
//!   breaks, the same thread re-establishes it (`reconnect`).
//! - **One sender thread** sends what no submitter is there to send: the requests waiting
//!   when a connection comes back, the flush of an emulated FUA write, a request whose
//!   submitter found the write half busy or the socket full, and the rest of one the socket
//!   took in part (`sender`).
//!
//! No thread per request and no allocation per request: the table is sized at connect
//! (`depth=`, default 64), and a submitter finding it full waits for a slot, at most the
//! request timeout (then the bio fails with `ETIMEDOUT`): there is no unbounded queue.
//!
//! # A broken connection
//!
//! The connection breaks when the server closes it, the socket fails, a reply is malformed
//! (unknown cookie, a chunk outside its request, bad magic, ...), or a request is unanswered
//! for `timeout` on it, or the server answers `NBD_ESHUTDOWN` (it is going away), or a send
//! fails. Then the requests keep their slots (a write its bio and buffer).
//!
//! A request the client gave up on may still be carried out by the server, and its first
//! copy must not land after its re-sent copy or after a newer write. So when the client is
//! the one giving the connection up, it sends nothing more on it but leaves it open and
//! keeps receiving: a reply that still comes completes its request (a late success is a
//! success), until every request sent on it is answered or the server closes it. Only then,
//! the old connection over, does the receiver reconnect. This assumes a server finishes (or
//! abandons) a connection's requests before it closes it on its own, as blkq's own server,
//! nbdkit and qemu-nbd do (the client never closes it first: qemu-nbd closes a connection
//! whose client shut it down with requests still running). A server that cannot be heard (a
//! cut link) keeps the device down: the reconnect deadline fails what waits and the device
//! reports itself unavailable, until the replies or the server's close reach it or the
//! kernel gives the TCP connection up (keepalive: ten times `timeout` without an answer).
//! See "The old connection" in `table`.
//!
//! The receiver reconnects with exponential backoff (50 ms doubling, at most 2 s apart; a
//! connection that broke within a second of coming up does not reset it), negotiates again,
//! and, if the export's size and block sizes are unchanged, every request still waiting is
//! sent again on the new connection: the commands used (read, write, flush, trim, write
//! zeroes) are idempotent by offset. If the export changed, the device fails every request,
//! now and later, with `EIO` and an error naming both sizes.
//!
//! The device's owner may also have every new connection judged before it serves
//! ([`blk::Device::check_connections`]: a mirror reads its leg's superblock): the bytes it
//! asks for are read through the new connection before anything else is sent on it, and a
//! refusal fails the device the same way, with the owner's reason in the errors.
//!
//! Re-sending cannot bring back what a server lost: writes it acknowledged on the lost
//! connection and had not flushed may have been in a cache that died with it. So when a
//! connection to a server with a write cache is lost with such writes, the next flush fails
//! with `EIO` (once) instead of vouching for them (`Durability` in `table`). FUA writes, and
//! writes a completed flush covers, are not affected.
//!
//! Each connection attempt (dialing, TLS, negotiation, the owner's check below) has one
//! deadline for the whole of it: the timeout, or the reconnect deadline's expiry if sooner; a
//! server that trickles its handshake runs out of time like a silent one.
//!
//! Requests wait at most `reconnect_deadline=` (default 15 s) after the break: then they fail
//! with `EIO`, while still disconnected new requests fail at once, and the device reports
//! itself unavailable ([`blk::Device::unavailable`]: a mirror fails the leg even if nothing was
//! asked of it). Reconnecting goes on in the background, and once connected the same device
//! serves again (a mirror can take the leg back). A request outstanding for `timeout` plus the
//! deadline, however many times it was sent, fails with `ETIMEDOUT`.
//! [`RemoteDevice::is_connected`] and [`RemoteDevice::reconnects`] report the state. Nothing
//! panics on what the server sends.
//!
//! # FUA
//!
//! A FUA write to a server with `NBD_CMD_FLUSH` but not `NBD_CMD_FLAG_FUA` is emulated: the
//! write is sent without the flag; once it is answered a flush goes on the same slot (sent
//! by the receiver if the send side is free at once, else by the sender), and the bio completes when the flush is answered. A server without flush has no write
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
//! Over TLS every request goes through the sender thread: a TLS write that the socket takes
//! in part has consumed its plaintext into a record, so it cannot be left half done for
//! another thread the way a plain `sendmsg` can.
//!
//! # Several connections
//!
//! With `conns=N` and a server offering multi-conn, the device opens N connections, each a
//! `link` with its own slot table, receiver and sender, reconnecting on its own. Requests go
//! round-robin, passing over a connection that is down. An emulated FUA write's flush goes on
//! the connection of its write; a flush on any connection covers the writes completed on all
//! (what multi-conn promises).

// Files: `spec` (the URI), `connect` (dialing and negotiating one connection), `check` (the
// owner's check of a new connection), `table` (what the threads share: the slots, the
// socket's write half, completion, failing), `send` (how a request is sent: inline by its
// submitter or by the sender thread), `link` (one connection's shared state and threads),
// `submit` (taking a slot and the first send), `extents` (block status), `receiver` (receiving on one connection), `reconnect` (the
// receiver thread's loop around it), `sender` (the sender thread); this file opens the
// device's connections, spreads requests over them and maps bios to commands.
mod check;
mod connect;
mod extents;
mod link;
mod receiver;
mod reconnect;
mod resolve;
mod seal;
mod send;
mod sender;
mod spec;
mod submit;
mod table;

pub use connect::{RemoteError, DEFAULT_MAX_IO};
pub use spec::{
    RemoteAddr, RemoteSpec, SendMode, SpecError, TlsSpec, DEFAULT_DEPTH,
    DEFAULT_RECONNECT_DEADLINE, DEFAULT_TIMEOUT, MAX_CONNS, MAX_DEPTH, MAX_TIMEOUT_SECS,
    PATH_PARAMS,
};

use blk::{Bio, BioFlags, Device, EndIo, Error, Extent, Limits, Op};
use blkq_sync::atomic::{AtomicUsize, Ordering};
use blkq_sync::DynArc;

use crate::client::ExportDetails;
use link::Link;
use nbd_proto::proto::{CmdFlags, Command, TransmissionFlags};
use submit::{Batch, Req};
use table::{Conn, Durability, LinkState};

/// An export on another NBD server, as a [`blk::Device`] (see the module documentation).
pub struct RemoteDevice {
    /// One per connection (`conns=`); never empty.
    links: Vec<Link>,
    /// Round-robin over `links`. Relaxed: only spreads requests, orders nothing.
    next: AtomicUsize,
    details: ExportDetails,
    spec: RemoteSpec,
}

impl std::fmt::Debug for RemoteDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteDevice")
            .field("uri", &self.links[0].sh.uri)
            .field("limits", &self.links[0].sh.limits)
            .field("conns", &self.links.len())
            .finish()
    }
}

impl RemoteDevice {
    /// Parses `spec` and connects ([`RemoteDevice::connect`]).
    pub fn open(spec: &str) -> Result<Self, RemoteError> {
        Self::connect(RemoteSpec::parse(spec)?)
    }

    /// Connects, negotiates (structured replies if the server has them, `NBD_OPT_GO` on the
    /// spec's export), and starts the receiver and sender threads. The whole attempt (dial,
    /// TLS, negotiation) is bounded by the spec's timeout. A server that cannot be reached now is an
    /// error (reconnecting is for a connection that was established once).
    pub fn connect(spec: RemoteSpec) -> Result<Self, RemoteError> {
        let uri = spec.to_string();
        let first = connect::open(&spec)?;
        let details = first.details.clone();
        let limits = first.limits;
        let mut n = spec.conns;
        if n > 1 && !details.flags.contains(TransmissionFlags::CAN_MULTI_CONN) {
            tracing::warn!(
                uri = %uri,
                "conns={n}: the server does not offer multi-conn (NBD_FLAG_CAN_MULTI_CONN); \
                 using one connection"
            );
            n = 1;
        }
        let durability = DynArc::new(Durability::default());
        let hook = DynArc::new(check::Hook::default());
        let mut links = Vec::with_capacity(n);
        links.push(Link::start(&spec, first, 0, &durability, &hook)?);
        for k in 1..n {
            let more = connect::open(&spec)?;
            if more.limits != limits {
                return Err(RemoteError::Unusable {
                    uri,
                    reason: format!(
                        "connection {k} sees the export as {:?}, the first as {limits:?}",
                        more.limits
                    ),
                });
            }
            links.push(Link::start(&spec, more, k, &durability, &hook)?);
        }
        Ok(Self {
            links,
            next: AtomicUsize::new(0),
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

    /// Whether the device is dead for good: it is closing, or the export changed under one
    /// of its connections while reconnecting (every submit fails).
    pub fn is_broken(&self) -> bool {
        self.links
            .iter()
            .any(|l| l.sh.table.lock().conn == Conn::Dead)
    }

    /// Whether every connection is established now (false while one is reconnecting, and
    /// once dead).
    pub fn is_connected(&self) -> bool {
        self.connections_up() == self.links.len()
    }

    /// Connections established now (of [`RemoteDevice::connections`]).
    pub fn connections_up(&self) -> usize {
        self.links
            .iter()
            .filter(|l| l.sh.table.lock().conn == Conn::Up)
            .count()
    }

    /// Connections the device keeps (`conns=`, or 1 when the server has no multi-conn).
    pub fn connections(&self) -> usize {
        self.links.len()
    }

    /// Connections re-established since the device was opened (all of them together).
    pub fn reconnects(&self) -> u64 {
        // Relaxed: a statistic (see the field).
        self.links
            .iter()
            .map(|l| l.sh.reconnects.load(Ordering::Relaxed))
            .sum()
    }

    /// Requests written whole by their submitting thread (`send=inline`), and by the
    /// connections' sender threads (re-sends, emulated FUA flushes, the rest of a request the
    /// socket took in part, and every request with `send=thread` or TLS), since the device
    /// was opened.
    pub fn sends(&self) -> (u64, u64) {
        // Relaxed: statistics (see the fields).
        self.links.iter().fold((0, 0), |(a, b), l| {
            (
                a + l.sh.sent_inline.load(Ordering::Relaxed),
                b + l.sh.sent_by_thread.load(Ordering::Relaxed),
            )
        })
    }

    /// Requests in flight.
    pub fn in_flight(&self) -> usize {
        self.links
            .iter()
            .map(|l| {
                let t = l.sh.table.lock();
                t.slots.len() - t.free.len()
            })
            .sum()
    }

    /// Whether a connection holds requests failed by the reconnect deadline whose copies may
    /// still be carried out (`LinkState::orphaned`).
    fn orphaned(&self) -> bool {
        // Acquire: see the field.
        self.links
            .iter()
            .any(|l| l.sh.orphaned.load(Ordering::Acquire))
    }

    /// The connection for the next request: round-robin, passing over a connection that is
    /// not up when another is (its requests would wait for its reconnection).
    fn pick(&self) -> &LinkState {
        let n = self.links.len();
        // Relaxed: see the field.
        let start = self.next.fetch_add(1, Ordering::Relaxed) % n;
        if n > 1 {
            for k in 0..n {
                let l = &self.links[(start + k) % n];
                if l.sh.is_up() {
                    return &l.sh;
                }
            }
        }
        &self.links[start].sh
    }

    /// The command and flags for `bio`, `Ok(None)` when it completes at once without asking
    /// the server (a flush to a server without a write cache), or why it fails.
    fn command(
        &self,
        sh: &LinkState,
        bio: &Bio,
    ) -> Result<Option<(Command, CmdFlags, bool)>, Error> {
        let f = sh.flags();
        let has = |x| f.contains(x);
        sh.limits.validate(bio)?;
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

impl RemoteDevice {
    /// What `bio` asks of link `sh`, or `None` when it is completed here already (refused,
    /// or nothing to send: a flush to a server without a write cache).
    fn prepare(&self, sh: &LinkState, bio: Bio, end: &DynArc<dyn EndIo>) -> Option<(Bio, Req)> {
        if self.links.len() > 1
            && matches!(bio.op, Op::Write | Op::Discard | Op::WriteZeroes)
            && self.orphaned()
        {
            let e = blk::error::with_context(
                std::io::Error::from_raw_os_error(libc::EIO),
                format!(
                    "{}: a write failed on another connection may still be carried out by \
                     the server; no write until that connection is over",
                    self.links[0].sh.uri
                ),
            );
            end.end_io(bio, Err(Error::Io(e)));
            return None;
        }
        let (cmd, flags, fua_flush) = match self.command(sh, &bio) {
            Ok(Some(c)) => c,
            Ok(None) => {
                end.end_io(bio, Ok(()));
                return None;
            }
            Err(e) => {
                end.end_io(bio, Err(e));
                return None;
            }
        };
        let req = Req {
            cmd,
            flags,
            fua_flush,
            offset: bio.offset(),
            len: u64::from(bio.len),
        };
        Some((bio, req))
    }
}

impl Device for RemoteDevice {
    fn submit(&self, bio: Bio, end: &DynArc<dyn EndIo>) {
        let sh = self.pick();
        if let Some((bio, req)) = self.prepare(sh, bio, end) {
            sh.submit(bio, end, req);
        }
    }

    /// The batch goes to one connection, its requests sent together (`Batch` in `submit`).
    fn submit_batch(&self, bios: &mut dyn Iterator<Item = Bio>, end: &DynArc<dyn EndIo>) {
        let sh = self.pick();
        let mut batch = Batch::new(sh, end);
        for bio in bios {
            if let Some((bio, req)) = self.prepare(sh, bio, end) {
                batch.add(bio, req);
            }
        }
        batch.send();
    }

    /// Every connection re-established from now on is judged by `check` before it serves
    /// (`check`).
    fn check_connections(&self, check: Option<DynArc<dyn blk::ConnectCheck>>) -> bool {
        // One hook for all the connections.
        self.links[0].sh.hook.set(check);
        true
    }

    fn limits(&self) -> Limits {
        self.links[0].sh.limits
    }

    /// No zero-copy path; the allocation map is a block-status round trip to the server.
    fn caps(&self) -> blk::Caps {
        blk::Caps {
            slow_extents: true,
            ..blk::Caps::default()
        }
    }

    /// No connection is up and one is past its reconnect deadline (or the device is dead).
    fn unavailable(&self) -> bool {
        let conns = || self.links.iter().map(|l| l.sh.table.lock().conn);
        !conns().any(|c| c == Conn::Up)
            && conns().any(|c| matches!(c, Conn::Dead | Conn::Down { expired: true, .. }))
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
        self.pick().extents_into(offset, len, max, out)
    }
}
