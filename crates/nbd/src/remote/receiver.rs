//! What the receiver thread of a [`super::RemoteDevice`] does on one connection: reads the
//! server's replies, receives read data into the bios' buffers, completes requests (or hands
//! an emulated FUA write's flush to the sender), and stops on a timeout, a malformed reply, a
//! closed or failed socket; and drains a connection the client gave up, until every request
//! sent on it is answered or the server closes it (see "The old connection" in `table`).
//! What happens after it stops is `reconnect`'s.

use std::io::{self, BufReader, Read};
use std::time::{Duration, Instant};

use blk::Bio;
use blkq_sync::atomic::Ordering;
use blkq_sync::DynArc;

use super::table::{Done, LinkState, Status, Success};
use crate::stream::{is_timeout, Stream};
use blk::EndIo;
use nbd_proto::proto::{
    Command, TransmissionMode, NBD_ESHUTDOWN, NBD_REPLY_TYPE_BLOCK_STATUS,
    NBD_REPLY_TYPE_OFFSET_DATA, SIMPLE_REPLY_LEN,
};
use nbd_proto::transmission::{decode_reply_header, parse_chunk, Chunk, ReplyHeader};
use nbd_proto::Decoded;

/// Bytes of a non-data reply chunk the receiver accepts (an error chunk's message is at most
/// 4 KiB); a longer one is a malformed reply.
pub(super) const SCRATCH: usize = 8 << 10;

/// The receive buffer: one `recv` takes up to this much of what the server sent, so a reply's
/// header, its chunk's offset and a small read's data (and, with requests pipelined, the
/// next replies) cost one system call, not one each. A read into a bio of at least this much
/// with nothing buffered goes straight into the bio's buffer (`BufReader`'s rule), so a large
/// read is copied once more only for its first `RECV_BUF` bytes at most.
pub(super) const RECV_BUF: usize = 64 << 10;

/// The receiver's buffered half of connection `stream` (see [`RECV_BUF`]); a new connection
/// gets a new one, so nothing buffered from the old one is ever parsed as the new one's.
pub(super) fn buffered(stream: Stream) -> BufReader<Stream> {
    BufReader::with_capacity(RECV_BUF, stream)
}

/// Why the receiver stopped.
#[derive(Debug, thiserror::Error)]
pub(super) enum Stop {
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
    /// The server answered `NBD_ESHUTDOWN`: it is shutting down, and the request is to be
    /// sent again on the next connection.
    #[error("the server is shutting down (it answered ESHUTDOWN)")]
    ShuttingDown,
    /// A request sent on this connection went unanswered for the timeout.
    #[error("a request was unanswered for {0:?}: the connection is declared dead")]
    TimedOut(Duration),
    /// Sending a request on this connection failed.
    #[error("sending a request failed")]
    SendFailed,
    /// Draining: every request sent on the connection has its reply.
    #[error("every request sent on it was answered")]
    Drained,
    /// The connection stopped (a request timed out, a send failed) in the middle of a reply:
    /// where the next reply begins is unknown, so the rest of the stream cannot be parsed.
    #[error("{0}, in the middle of a reply")]
    MidReply(Box<Stop>),
    /// Draining: the server neither answered nor closed the connection for this long
    /// ([`drain_bound`]): the client takes it as over.
    #[error("the server neither answered nor closed it for {0:?}: taken as over, what it did not answer as abandoned")]
    Abandoned(Duration),
}

/// How many timeouts the drain of a connection the client gave up waits at most for the
/// server to answer or close it: ten, as TCP keepalive bounds it for a host that cannot be
/// heard (`connect::keepalive`). A server that keeps the connection open and answers nothing
/// (hostile, or wedged on its disk; over a Unix socket no keepalive can tell) would
/// otherwise hold the device down for ever. Past it, a request the server still carries out
/// is taken to be abandoned (see "The old connection" in `table`).
pub(super) const DRAIN_TIMEOUTS: u32 = 10;

/// The least the drain waits, whatever the timeout: with a sub-second timeout ten of them
/// are shorter than an ordinary stall of a busy server (a write held a second on its disk),
/// and a request the drain took as abandoned would then land after its re-send or the
/// leg's recovery (sim_remote seed 5700022: a write-behind copy held 0.5 s past a 1.1 s
/// partition, with a 130 ms timeout, landed over a newer write). A hostile server still
/// holds the device down no longer than this.
pub(super) const DRAIN_FLOOR: Duration = Duration::from_secs(10);

/// How long the drain of a connection the client gave up waits at most: [`DRAIN_TIMEOUTS`]
/// times the timeout, and at least [`DRAIN_FLOOR`]. The kernel gives a TCP connection with
/// unacknowledged data up sooner (`TCP_USER_TIMEOUT`, ten timeouts from the data's send:
/// `connect::keepalive`), so what it held never crosses after the drain ends.
pub(super) fn drain_bound(timeout: Duration) -> Duration {
    (timeout * DRAIN_TIMEOUTS).max(DRAIN_FLOOR)
}

impl Stop {
    /// Whether the server ended the connection (it closed or reset it, or the socket
    /// failed): nothing sent on it can still be carried out. Otherwise the client is the one
    /// breaking it, and the old connection drains first (see "The old connection" in
    /// `table`).
    pub(super) fn ended_by_server(&self) -> bool {
        matches!(self, Stop::Closed | Stop::Io(_))
    }

    /// Whether the rest of the stream cannot be parsed (a malformed reply): the connection
    /// is cut (its sending half shut down) and drained by reading and dropping everything.
    pub(super) fn unparseable(&self) -> bool {
        matches!(self, Stop::Malformed(_) | Stop::MidReply(_))
    }
}

pub(super) struct Receiver {
    pub(super) sh: DynArc<LinkState>,
    pub(super) stream: BufReader<Stream>,
    pub(super) mode: TransmissionMode,
    pub(super) scratch: Vec<u8>,
    pub(super) tick: Duration,
    pub(super) last_check: Instant,
    /// The client gave the connection up and is draining it: no request times out any more
    /// (the wait is the old connection's), and the reconnect deadline is checked each tick.
    pub(super) draining: bool,
    /// When the drain began (meaningful while `draining`).
    pub(super) drain_since: Instant,
    /// Part of a reply has been read and not the rest (a stop now leaves the stream
    /// unparseable).
    pub(super) mid_reply: bool,
    /// When the first byte of the reply being read arrived (meaningful while `mid_reply`).
    pub(super) reply_since: Instant,
    /// The slot the reply being read answers, once its header is read.
    pub(super) replying: Option<usize>,
    /// Sealing the drained connection: the seal's reply is due by then (`seal`).
    pub(super) seal_by: Option<Instant>,
    /// The last `check_mid_reply` that looked (at most one a tick: a long reply arriving
    /// fast does not take the table lock on every read).
    pub(super) mid_check: Instant,
    /// The completion run open (`deliver`): the submitter whose bios were completed with
    /// `end_io_batched` since the receiver last read from the socket.
    pub(super) batch: Option<DynArc<dyn EndIo>>,
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.close_batch();
    }
}

impl Receiver {
    /// Completes `d` here, as one of a run (`EndIo::end_io_batched`) that `close_batch` closes
    /// before the receiver next reads from the socket (or stops): the replies one receive
    /// brought are completed together, and a server relaying them sends them with one
    /// writer's pass. A completion for another submitter closes the run first.
    fn deliver(&mut self, (bio, end, status): Done) {
        let other =
            |b: &DynArc<dyn EndIo>| !std::ptr::addr_eq(DynArc::as_ptr(b), DynArc::as_ptr(&end));
        if self.batch.as_ref().is_some_and(other) {
            self.close_batch();
        }
        end.end_io_batched(bio, self.sh.result(status));
        self.batch.get_or_insert(end);
        self.sh.slot_freed.wake_one();
    }

    /// Closes the completion run, if one is open (see `deliver`).
    pub(super) fn close_batch(&mut self) {
        if let Some(end) = self.batch.take() {
            end.end_batch();
        }
    }

    /// Sets slot `i`'s status and, once its bio is in place, completes it here
    /// (`LinkState::finished`, then `deliver`).
    fn finish(&mut self, i: usize, status: Status) {
        if let Some(d) = self.sh.finished(i, status) {
            self.deliver(d);
        }
    }

    /// Receives replies on the current connection until it stops, and says why.
    pub(super) fn receive(&mut self) -> Stop {
        loop {
            if let Err(s) = self.one_reply() {
                self.close_batch();
                let mid = std::mem::take(&mut self.mid_reply);
                return match s {
                    Stop::TimedOut(_) | Stop::SendFailed if mid => Stop::MidReply(Box::new(s)),
                    s => s,
                };
            }
        }
    }

    /// Drains the connection the client gave up on (nothing new is sent on it): receives
    /// what the server still answers, completing requests as usual (an orphan's reply is
    /// dropped), until every request sent on it has its reply, or the server closes the
    /// connection (or resets it, or the socket fails). When `unparseable` (or after a reply
    /// that cannot be parsed), the sending half is shut down and everything is read and
    /// dropped until the server closes it. Returns why it ended: `Closing` if the device
    /// closes meanwhile. The reconnect deadline is checked each tick (`check`).
    pub(super) fn drain(&mut self, unparseable: bool) -> Stop {
        self.draining = true;
        self.drain_since = Instant::now();
        let stop = if unparseable {
            self.discard()
        } else {
            loop {
                if self.sh.table.lock().answered() {
                    break Stop::Drained;
                }
                match self.one_reply() {
                    Ok(()) | Err(Stop::ShuttingDown) => {}
                    Err(Stop::Malformed(why)) => {
                        tracing::warn!(
                            uri = %self.sh.uri,
                            "malformed reply while draining ({why}): dropping the rest"
                        );
                        self.sh.cut_socket();
                        break self.discard();
                    }
                    Err(s) => break s,
                }
            }
        };
        self.draining = false;
        self.close_batch();
        stop
    }

    /// Reads and drops everything until the connection ends.
    fn discard(&mut self) -> Stop {
        self.close_batch();
        loop {
            let mut s = std::mem::take(&mut self.scratch);
            let r = self.stream.read(&mut s);
            self.scratch = s;
            match r {
                Ok(0) => return Stop::Closed,
                // A server that keeps sending (slowly or not) is checked at every tick too.
                Ok(_) => {
                    if self.last_check.elapsed() >= self.tick {
                        if let Err(s) = self.check() {
                            return s;
                        }
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if is_timeout(&e) => {
                    if let Err(s) = self.check() {
                        return s;
                    }
                }
                Err(e) => return Stop::Io(e),
            }
        }
    }

    /// Fails if the device is closing, a send failed, or a request sent on this connection
    /// has been unanswered longer than the timeout. While draining, only closing stops it,
    /// and an expired reconnect deadline fails what waits. While sealing, only closing and
    /// the seal's deadline stop it.
    fn check(&mut self) -> Result<(), Stop> {
        self.last_check = Instant::now();
        if self.sh.closing.load(Ordering::SeqCst) {
            return Err(Stop::Closing);
        }
        if let Some(by) = self.seal_by {
            self.sh.expire_if_due();
            return match self.last_check >= by {
                true => Err(Stop::TimedOut(self.sh.timeout)),
                false => Ok(()),
            };
        }
        if self.draining {
            self.sh.expire_if_due();
            if self.sh.table.lock().answered() {
                return Err(Stop::Drained);
            }
            let waited = self.drain_since.elapsed();
            if waited >= drain_bound(self.sh.timeout) {
                return Err(Stop::Abandoned(waited));
            }
            return Ok(());
        }
        // SeqCst: see the field.
        if self.sh.send_failed.load(Ordering::SeqCst) {
            return Err(Stop::SendFailed);
        }
        let Some(limit) = self.last_check.checked_sub(self.sh.timeout) else {
            return Ok(());
        };
        let t = self.sh.table.lock();
        let epoch = t.epoch;
        if t.slots
            .iter()
            .any(|s| s.busy && s.status.is_none() && s.sent_epoch == epoch && s.sent_at <= limit)
        {
            return Err(Stop::TimedOut(self.sh.timeout));
        }
        Ok(())
    }

    /// An error reply to slot `i`: it completes with the error, except `NBD_ESHUTDOWN` (the
    /// server is going away, as the NBD spec has it, and a reconnection may succeed): the
    /// slot stays waiting and the connection is taken down, to send it again on the next.
    /// The request is answered on this connection (the server holds no copy of it), so it
    /// is marked not sent: the drain does not wait for it (a server that answers ESHUTDOWN
    /// may keep the connection open), and it is due on the next connection.
    fn failed(&mut self, i: usize, error: u32) -> Result<(), Stop> {
        if error == NBD_ESHUTDOWN {
            if let Some(s) = self.sh.table.lock().slots.get_mut(i) {
                s.sent_epoch = 0;
            }
            return Err(Stop::ShuttingDown);
        }
        self.finish(i, Status::Nbd(error));
        Ok(())
    }

    /// A successful reply to slot `i`: it completes, unless it is the write of an emulated
    /// FUA write, which becomes its flush (a new cookie, due again). The receiver sends that
    /// flush itself only the way a submitter does (`try_send_inline`: the writer lock if free
    /// at once, one non-blocking `sendmsg`), else it is the sender's: the receiver never
    /// waits to send (it must keep reading whatever the server's send buffer holds, or a
    /// server blocked on sending replies and a receiver blocked on it deadlock).
    fn succeeded(&mut self, i: usize) {
        let what = {
            let mut t = self.sh.table.lock();
            // An orphan: nobody waits for it any more, `finish` frees its slot.
            (!t.is_orphan(i)).then(|| t.succeeded(i, &self.sh.durability))
        };
        match what {
            None => self.finish(i, Status::Ok),
            Some(Success::FlushNext) => {
                // `succeeded` flagged the sender; a flush sent here leaves it nothing to do.
                if !self.sh.try_send_inline(i, &mut None, 0) {
                    self.sh.sender_wq.wake_one();
                }
            }
            Some(Success::Complete(status)) => self.finish(i, status),
        }
    }

    /// Reads exactly `buf.len()` bytes, checking the timeouts at every tick: when the socket
    /// has nothing for a tick, and when it keeps giving bytes (a server trickling a reply
    /// must not keep its request past the timeout: the deadline runs to the whole reply).
    fn read_full(&mut self, buf: &mut [u8]) -> Result<(), Stop> {
        let mut at = 0;
        while at < buf.len() {
            if self.stream.buffer().is_empty() {
                // The next read goes to the socket, and may wait.
                self.close_batch();
            }
            match self.stream.read(&mut buf[at..]) {
                Ok(0) => return Err(Stop::Closed),
                Ok(n) => {
                    at += n;
                    if !self.mid_reply {
                        self.mid_reply = true;
                        self.reply_since = Instant::now();
                    } else {
                        self.check_mid_reply()?;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if is_timeout(&e) => self.check()?,
                Err(e) => return Err(Stop::Io(e)),
            }
        }
        Ok(())
    }

    /// The checks while a reply keeps coming (bytes arrive, slowly or not): the device
    /// closing, the drain's bounds, and the deadline of the request it answers, from its send
    /// to its whole reply (a server trickling a reply does not keep it past the timeout).
    /// While its header is still arriving (which request it answers is not known yet), after
    /// a tick of it, every request's. Other requests' timeouts wait for the reply's end (the
    /// next reply's start checks them): stopping in the middle of a reply that comes leaves
    /// the rest of the stream unparseable.
    fn check_mid_reply(&mut self) -> Result<(), Stop> {
        let now = Instant::now();
        if now.duration_since(self.last_check) < self.tick
            || now.duration_since(self.mid_check) < self.tick
        {
            return Ok(());
        }
        self.mid_check = now;
        if self.draining || self.seal_by.is_some() {
            return self.check();
        }
        if self.sh.closing.load(Ordering::SeqCst) {
            return Err(Stop::Closing);
        }
        match self.replying {
            None if now.duration_since(self.reply_since) >= self.tick => self.check(),
            None => Ok(()),
            Some(i) => {
                let t = self.sh.table.lock();
                let epoch = t.epoch;
                let late = t.slots.get(i).is_some_and(|s| {
                    s.busy
                        && s.status.is_none()
                        && s.sent_epoch == epoch
                        && now.duration_since(s.sent_at) >= self.sh.timeout
                });
                if late {
                    return Err(Stop::TimedOut(self.sh.timeout));
                }
                Ok(())
            }
        }
    }

    /// Reads and drops `n` bytes.
    fn skip(&mut self, n: u64) -> Result<(), Stop> {
        let mut rest = n;
        while rest > 0 {
            let k = rest.min(SCRATCH as u64) as usize;
            self.read_scratch(k)?;
            rest -= k as u64;
        }
        Ok(())
    }

    pub(super) fn read_scratch(&mut self, n: usize) -> Result<(), Stop> {
        let mut s = std::mem::take(&mut self.scratch);
        let r = match s.get_mut(..n) {
            Some(b) => self.read_full(b),
            None => Err(Stop::Malformed(format!("a reply chunk of {n} bytes"))),
        };
        self.scratch = s;
        r
    }

    /// Receives `n` bytes straight into slot `i`'s bio buffer at `at` (an orphan's are read
    /// and dropped).
    fn read_into_bio(&mut self, i: usize, at: u64, n: u64) -> Result<(), Stop> {
        let bio = {
            let mut t = self.sh.table.lock();
            if t.is_orphan(i) {
                drop(t);
                return self.skip(n);
            }
            t.slots.get_mut(i).and_then(|s| s.bio.take())
        };
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
        self.sh.put_back(i, bio);
        r
    }

    /// A block-status chunk for slot `i` (`length` bytes: the context id, then descriptors of
    /// 8 bytes): the descriptors go into the bio's buffer after those already received, as
    /// many as fit, followed by a zero descriptor when there is room (the end mark); the rest
    /// is read and dropped (the caller asked for at most that many extents).
    fn block_status(&mut self, i: usize, cmd: Command, length: u64) -> Result<(), Stop> {
        if cmd != Command::BlockStatus || length < 4 || !(length - 4).is_multiple_of(8) {
            return Err(Stop::Malformed(format!(
                "a block status chunk of {length} bytes for {cmd:?}"
            )));
        }
        let mut id = [0u8; 4];
        self.read_full(&mut id)?;
        if self.sh.table.lock().is_orphan(i) {
            return self.skip(length - 4);
        }
        let (bio, at, meta) = {
            let mut t = self.sh.table.lock();
            let meta = t.meta_id;
            let s = &mut t.slots[i];
            (s.bio.take(), s.covered as usize, meta)
        };
        let Some(mut bio) = bio else {
            return Err(Stop::Malformed(
                "block status for a slot without its bio".into(),
            ));
        };
        let r = if meta != Some(u32::from_be_bytes(id)) {
            Err(Stop::Malformed(format!(
                "block status for context {}, which was not asked for",
                u32::from_be_bytes(id)
            )))
        } else {
            self.descriptors_into(&mut bio, at, length - 4)
        };
        self.sh.put_back(i, bio);
        let kept = r?;
        self.sh.table.lock().slots[i].covered += kept as u64;
        Ok(())
    }

    /// Reads `n` bytes of descriptors, keeping what fits in `bio`'s buffer from `at`; returns
    /// the bytes kept.
    fn descriptors_into(&mut self, bio: &mut Bio, at: usize, n: u64) -> Result<usize, Stop> {
        let buf = bio.buf.as_mut().map_or(&mut [][..], |b| b.as_mut_slice());
        let room = buf.len().saturating_sub(at) / 8 * 8;
        let keep = usize::try_from(n).unwrap_or(usize::MAX).min(room);
        self.read_full(&mut buf[at..at + keep])?;
        if let Some(end) = buf.get_mut(at + keep..at + keep + 8) {
            end.fill(0);
        }
        self.skip(n - keep as u64)?;
        Ok(keep)
    }

    /// Records `n` bytes of slot `i`'s read filled at `at` (relative to its start): a
    /// malformed reply if they overlap bytes already filled (`Coverage`).
    fn fill(&self, i: usize, at: u64, n: u64) -> Result<(), Stop> {
        let mut t = self.sh.table.lock();
        match t.slots.get_mut(i) {
            Some(s) => s.filled.add(at, n).map_err(Stop::Malformed),
            None => Err(Stop::Malformed("a reply for no slot".into())),
        }
    }

    fn lookup(&self, cookie: u64) -> Result<(usize, Command, u64, u64), Stop> {
        let t = self.sh.table.lock();
        let i = t.lookup(cookie).ok_or_else(|| {
            Stop::Malformed(format!(
                "a reply for cookie {cookie:#x}, which is not in flight"
            ))
        })?;
        let s = &t.slots[i];
        Ok((i, s.cmd, s.offset, s.len))
    }

    /// Reads one reply header (simple, or a chunk's in structured or extended mode).
    pub(super) fn read_header(&mut self) -> Result<ReplyHeader, Stop> {
        let mut hdr = [0u8; 32];
        self.read_full(&mut hdr[..SIMPLE_REPLY_LEN])?;
        let mut have = SIMPLE_REPLY_LEN;
        loop {
            match decode_reply_header(&hdr[..have], self.mode) {
                Ok(Decoded::Complete { value, .. }) => return Ok(value),
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
        }
    }

    fn one_reply(&mut self) -> Result<(), Stop> {
        // At a reply's boundary (`read_full` sets it once a byte of this one is read).
        self.mid_reply = false;
        self.replying = None;
        if self.last_check.elapsed() >= self.tick {
            self.check()?;
        }
        match self.read_header()? {
            ReplyHeader::Simple(r) => {
                let (i, cmd, _, len) = self.lookup(r.cookie)?;
                self.replying = Some(i);
                if r.error != 0 {
                    self.failed(i, r.error)?;
                } else {
                    if cmd == Command::BlockStatus {
                        return Err(Stop::Malformed(
                            "a simple reply to a successful block status".into(),
                        ));
                    }
                    if cmd == Command::Read {
                        if self.mode != TransmissionMode::Simple {
                            return Err(Stop::Malformed(
                                "a simple reply to a successful read in structured mode".into(),
                            ));
                        }
                        self.read_into_bio(i, 0, len)?;
                    }
                    self.succeeded(i);
                }
            }
            ReplyHeader::Chunk(h) => {
                let (i, cmd, off, len) = self.lookup(h.cookie)?;
                self.replying = Some(i);
                let inside = |o: u64, n: u64| -> Result<u64, Stop> {
                    match (o.checked_sub(off), o.checked_add(n)) {
                        (Some(at), Some(e)) if cmd == Command::Read && e <= off + len => Ok(at),
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
                    // Recorded before the data is read: an overlap writes nothing.
                    self.fill(i, at, n)?;
                    self.read_into_bio(i, at, n)?;
                } else if h.reply_type == NBD_REPLY_TYPE_BLOCK_STATUS {
                    self.block_status(i, cmd, h.length)?;
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
                        let at = inside(o, u64::from(size))?;
                        self.fill(i, at, u64::from(size))?;
                        let at = at as usize;
                        let mut t = self.sh.table.lock();
                        let orphan = t.is_orphan(i);
                        let s = &mut t.slots[i];
                        if !orphan {
                            let dst = s
                                .bio
                                .as_mut()
                                .and_then(|b| b.buf.as_mut())
                                .and_then(|b| b.as_mut_slice().get_mut(at..at + size as usize));
                            let Some(dst) = dst else {
                                return Err(Stop::Malformed("a hole outside the buffer".into()));
                            };
                            dst.fill(0);
                        }
                    }
                    if error != 0 {
                        let mut t = self.sh.table.lock();
                        if t.slots[i].error == 0 {
                            t.slots[i].error = error;
                        }
                    }
                }
                if h.is_done() {
                    let (error, filled) = {
                        let t = self.sh.table.lock();
                        (t.slots[i].error, t.slots[i].filled.total())
                    };
                    if error != 0 {
                        self.failed(i, error)?;
                    } else if cmd == Command::Read && filled != len {
                        // The pieces are disjoint: all of it filled is exactly `len` bytes.
                        return Err(Stop::Malformed(format!(
                            "a read of {len} bytes answered with {filled}"
                        )));
                    } else {
                        self.succeeded(i);
                    }
                }
            }
        }
        Ok(())
    }
}
