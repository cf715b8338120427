//! One connection: the handshake, then the transmission data path.
//!
//! # Threads
//!
//! - The **reader** (the connection's own thread) reads into a 1 MiB buffer, decodes every
//!   whole request in it, *stages* them (bios and reply metadata, in reused vectors), takes the
//!   connection lock once to give each a slot of the in-flight table, submits all the bios with
//!   one [`Device::submit_batch`] (one plug), then flushes replies. It blocks only in `recv`,
//!   in the device's tag wait (backpressure from a full queue), or parked when every slot (or
//!   the in-flight byte budget) is taken.
//! - Device **completion threads** (when the driver has them) run [`EndIo::end_io`]: the bio's
//!   status and read buffer go into its slot; when the request's last bio is done the slot goes
//!   on the ready list, and the completing thread flushes if the writer is idle, without
//!   blocking (`MSG_DONTWAIT`).
//! - The **flusher** (one parked thread per connection) takes over a write that would have
//!   blocked, so that neither the reader nor a driver's completion thread ever waits on a slow
//!   client.
//!
//! # The combining writer
//!
//! The right to write to the socket is a token: `State::writer` holds the writer's scratch
//! (header buffer, segment list, buffers being sent) while nobody writes; whoever takes it out
//! under the lock is the writer. The writer moves every ready slot's reply into its scratch
//! (headers encoded into one buffer, read data as buffers), drops the lock, sends everything
//! with `sendmsg` over up to 128 iovecs at a time, then retakes the lock, frees the slots and
//! looks again; it puts the token back only when the ready list is empty, under the same lock
//! that producers push under, so no reply is ever left behind: a producer either pushes before
//! the writer's last look, or finds the token back in place and writes itself. A send that
//! would block moves the token (with the half-sent scratch) to `State::handoff` and wakes the
//! flusher, which finishes it with blocking sends and goes on as the writer.
//!
//! # In-flight table
//!
//! `State::slots` is preallocated (`Tuning::slots` entries); a bio's `cookie` carries its slot
//! (high 32 bits) and its part of the request (low 32 bits: reads larger than the device's
//! maximum I/O, or split around holes, are several bios). Buffers come from per-connection
//! pools by size class; vectors are reused. After warm-up the data path allocates nothing,
//! except the `Vec` that `Device::extents` returns (one per structured read when the export
//! has sparse reads, and per `NBD_CMD_BLOCK_STATUS`) and the plug `Queue::submit_batch`
//! allocates per batch.

use std::io::{self, IoSlice, IoSliceMut, Read};
use std::net::Shutdown;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;

use blk::Extent as DevExtent;
use blk::{Bio, BioFlags, Buffer, BufferPool, Device, EndIo, Op, SECTOR_SHIFT};
use blkq_sync::atomic::{AtomicBool, Ordering};
use blkq_sync::thread::{self, JoinHandle, Thread};
use blkq_sync::Mutex;
use tracing::{debug, info, warn};

use super::handshake::{self, Ended, Negotiated, BASE_ALLOCATION_ID};
use super::{ExportState, Shared};
use crate::proto::{
    CmdFlags, Command, ReplyFlags, TransmissionMode, NBD_CMD_BLOCK_STATUS, NBD_CMD_READ,
    NBD_EINVAL, NBD_EIO, NBD_ENOMEM, NBD_ENOSPC, NBD_ENOTSUP, NBD_EOVERFLOW, NBD_EPERM,
    NBD_ESHUTDOWN, NBD_STATE_HOLE, NBD_STATE_ZERO,
};
use crate::stream::Stream;
use crate::transmission::SimpleReply;
use crate::transmission::{decode_request, Extent, ExtentExt, ReplyChunk, ReplyTo, Request};
use crate::{Decoded, Error};

/// Extents asked of the device per structured read (more fragmented reads send the rest as
/// data).
const MAX_READ_EXTENTS: usize = 64;
/// Extents per `NBD_CMD_BLOCK_STATUS` reply.
const MAX_STATUS_EXTENTS: usize = 1024;
/// Trim and write-zeroes are split into bios of at most this many bytes (`Bio::len` is 32
/// bits).
const PIECE: u64 = 1 << 30;
/// Largest chunk of a read or write: one bio, one pooled buffer.
const MAX_CHUNK: usize = 1 << 20;
/// `SO_SNDBUF` asked for each connection (capped by the kernel's `wmem_max`).
const SEND_BUFFER: usize = 4 << 20;
/// iovecs per `sendmsg`.
const IOV_WINDOW: usize = 128;
/// A non-blocking writer (reader, completion thread) writes at most this many rounds before it
/// hands the token to the flusher, so that a busy connection cannot keep a driver's completion
/// thread away from its other work.
const MAX_NONBLOCKING_ROUNDS: u32 = 8;

/// Runs a connection to its end: handshake, transmission, teardown.
pub(crate) fn serve(mut stream: Stream, shared: Arc<Shared>, id: u64) {
    let peer = stream.peer();
    let _ = stream.set_nodelay();
    let neg = match handshake::negotiate(&mut stream, &shared) {
        Ok(n) => n,
        Err(Ended::Client(why)) => {
            info!(conn = id, %peer, "connection closed in the handshake: client {why}");
            shared.unregister(id);
            return;
        }
        Err(Ended::Protocol(why)) => {
            warn!(conn = id, %peer, "closing connection during the handshake: {why}");
            shared.unregister(id);
            return;
        }
        Err(Ended::Io(e)) => {
            debug!(conn = id, %peer, "handshake ended: {e}");
            shared.unregister(id);
            return;
        }
    };
    let export = &shared.exports[neg.export];
    let mode = match neg.mode {
        TransmissionMode::Simple => "simple",
        TransmissionMode::Structured => "structured",
        TransmissionMode::Extended => "extended",
    };
    info!(
        conn = id,
        %peer,
        export = %export.cfg.name,
        replies = mode,
        base_allocation = neg.base_allocation,
        via = neg.via,
        "connection open"
    );
    let (reason, stats) = match Conn::new(stream, &shared, export, neg) {
        Ok(mut c) => {
            let reason = c.run();
            c.teardown(&reason);
            (reason, c.stats)
        }
        Err(e) => (format!("could not start: {e}"), Stats::default()),
    };
    info!(
        conn = id,
        %peer,
        export = %export.cfg.name,
        requests = stats.requests,
        errors = stats.errors,
        "connection closed: {reason}"
    );
    shared.unregister(id);
}

/// Per-connection counters for the close log line.
#[derive(Debug, Default, Clone, Copy)]
struct Stats {
    requests: u64,
    errors: u64,
}

/// The NBD error for a block layer error.
fn nbd_errno(e: &blk::Error) -> u32 {
    match e.errno() {
        libc::EPERM | libc::EROFS | libc::EACCES => NBD_EPERM,
        libc::EINVAL => NBD_EINVAL,
        libc::ENOSPC | libc::EDQUOT | libc::EFBIG => NBD_ENOSPC,
        libc::EOVERFLOW => NBD_EOVERFLOW,
        libc::ENOTSUP => NBD_ENOTSUP,
        libc::ENOMEM => NBD_ENOMEM,
        libc::ESHUTDOWN => NBD_ESHUTDOWN,
        _ => NBD_EIO,
    }
}

// ---------------------------------------------------------------------------------------------
// Shared connection state.
// ---------------------------------------------------------------------------------------------

/// One piece of a read: data read by one bio, or a hole sent as `OFFSET_HOLE`.
#[derive(Debug, Default)]
struct Part {
    offset: u64,
    len: u64,
    hole: bool,
    buf: Option<Buffer>,
}

/// One entry of the in-flight table: a request from staging to its reply being written.
#[derive(Debug, Default)]
struct Slot {
    cookie: u64,
    offset: u64,
    length: u64,
    cmd: u16,
    flags: CmdFlags,
    /// NBD error of the reply (the first bio error wins), 0 for success.
    error: u32,
    /// Bios not yet completed.
    pending: u32,
    /// Bytes counted against the in-flight budget.
    bytes: u64,
    /// Reads: the parts, in offset order.
    parts: Vec<Part>,
    /// Block status: the allocation map.
    extents: Vec<DevExtent>,
}

/// What the lock protects.
///
/// | field            | meaning                                                            |
/// |------------------|--------------------------------------------------------------------|
/// | `slots`, `free`  | the in-flight table and its free list (popped by the reader only)   |
/// | `ready`          | slots whose reply can be written, in completion order               |
/// | `writer`         | `Some`: nobody is writing; take it to become the writer             |
/// | `handoff`        | a writer's token and half-sent scratch, for the flusher             |
/// | `reader_waiting` | the reader is parked until a slot (or the budget) frees up          |
struct State {
    slots: Vec<Slot>,
    free: Vec<u32>,
    ready: Vec<u32>,
    bytes: u64,
    writer: Option<Box<Scratch>>,
    handoff: Option<Box<Scratch>>,
    flusher: Option<Thread>,
    stop_flusher: bool,
    reader_waiting: bool,
}

/// The part of a connection that completions and writers share (the `EndIo` of every bio).
struct ConnShared {
    /// The socket handle writers send on (kept open as long as this lives).
    sock: Stream,
    fd: RawFd,
    mode: TransmissionMode,
    min_block: u32,
    /// `thread_slot()` of the reader: its completions (inline, inside `submit_batch`) leave the
    /// flushing to it.
    reader_slot: usize,
    reader: Thread,
    /// A send failed: the client is gone; replies are dropped from now on.
    dead: AtomicBool,
    state: Mutex<State>,
}

/// A piece of the output: encoded headers, or the data of a buffer.
#[derive(Debug, Clone, Copy)]
enum Seg {
    Hdr { start: usize, end: usize },
    Buf { idx: usize, len: usize },
}

/// The writer's scratch: owned by whoever holds the writer token.
#[derive(Default)]
struct Scratch {
    hdr: Vec<u8>,
    segs: Vec<Seg>,
    bufs: Vec<Buffer>,
    /// Slots whose replies are in `segs`, freed once sent.
    done: Vec<u32>,
    /// Send progress: segment and offset in it.
    seg: usize,
    off: usize,
    ext32: Vec<Extent>,
    ext64: Vec<ExtentExt>,
}

impl Scratch {
    fn unsent(&self) -> bool {
        self.seg < self.segs.len()
    }

    fn seg_bytes(&self, s: Seg) -> Option<&[u8]> {
        match s {
            Seg::Hdr { start, end } => self.hdr.get(start..end),
            Seg::Buf { idx, len } => self.bufs.get(idx).and_then(|b| b.as_slice().get(..len)),
        }
    }

    /// Sends what is left; `Ok(false)` if the socket would block (non-blocking mode).
    fn send(&mut self, fd: RawFd, dontwait: bool) -> io::Result<bool> {
        let bad = || io::Error::other("reply segment out of bounds");
        while self.seg < self.segs.len() {
            let mut iov = [IoSlice::new(&[]); IOV_WINDOW];
            let mut k = 0;
            for (i, &s) in self.segs[self.seg..].iter().take(IOV_WINDOW).enumerate() {
                let mut b = self.seg_bytes(s).ok_or_else(bad)?;
                if i == 0 {
                    b = b.get(self.off..).ok_or_else(bad)?;
                }
                iov[k] = IoSlice::new(b);
                k += 1;
            }
            let n = match crate::sys::sendmsg(fd, &iov[..k], dontwait) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
                Err(e) => return Err(e),
            };
            self.advance(n);
        }
        Ok(true)
    }

    fn advance(&mut self, mut n: usize) {
        while n > 0 && self.seg < self.segs.len() {
            let len = self
                .seg_bytes(self.segs[self.seg])
                .map_or(0, |b| b.len())
                .saturating_sub(self.off);
            if n >= len {
                n -= len;
                self.seg += 1;
                self.off = 0;
            } else {
                self.off += n;
                n = 0;
            }
        }
    }

    /// Forgets the sent output (buffers go back to their pools).
    fn reset_output(&mut self) {
        self.hdr.clear();
        self.segs.clear();
        self.bufs.clear();
        self.seg = 0;
        self.off = 0;
    }

    fn push_hdr(&mut self, start: usize) {
        let end = self.hdr.len();
        if end == start {
            return;
        }
        if let Some(Seg::Hdr { end: e, .. }) = self.segs.last_mut() {
            if *e == start {
                *e = end;
                return;
            }
        }
        self.segs.push(Seg::Hdr { start, end });
    }

    fn push_buf(&mut self, b: Buffer, len: usize) {
        self.segs.push(Seg::Buf {
            idx: self.bufs.len(),
            len,
        });
        self.bufs.push(b);
    }

    /// Frees the slots whose replies were sent; whether the reader must be woken.
    fn free_done(&mut self, st: &mut State) -> bool {
        if self.done.is_empty() {
            return false;
        }
        for &i in &self.done {
            if let Some(s) = st.slots.get_mut(i as usize) {
                st.bytes = st.bytes.saturating_sub(s.bytes);
                s.parts.clear();
                s.extents.clear();
                st.free.push(i);
            }
        }
        self.done.clear();
        std::mem::take(&mut st.reader_waiting)
    }

    /// Moves every ready reply into the scratch (or, on a dead connection, just marks them
    /// done).
    fn collect(&mut self, st: &mut State, mode: TransmissionMode, min_block: u32, dead: bool) {
        let State { slots, ready, .. } = st;
        for &i in ready.iter() {
            let Some(s) = slots.get_mut(i as usize) else {
                continue;
            };
            self.done.push(i);
            if dead {
                continue;
            }
            let start = self.hdr.len();
            let (segs, bufs) = (self.segs.len(), self.bufs.len());
            if let Err(e) = self.encode(s, mode, min_block) {
                // A bug of ours, not the client's: answer EIO rather than send garbage.
                warn!("encoding the reply to cookie {:#x}: {e}", s.cookie);
                self.hdr.truncate(start);
                self.segs.truncate(segs);
                self.bufs.truncate(bufs);
                s.error = NBD_EIO;
                s.cmd = u16::MAX;
                if self.encode(s, mode, min_block).is_err() {
                    self.hdr.truncate(start);
                    self.segs.truncate(segs);
                }
            }
        }
        ready.clear();
    }

    /// Encodes the reply of `s`.
    fn encode(
        &mut self,
        s: &mut Slot,
        mode: TransmissionMode,
        min_block: u32,
    ) -> Result<(), Error> {
        let to = ReplyTo {
            cookie: s.cookie,
            offset: s.offset,
        };
        let start = self.hdr.len();
        if s.cmd == NBD_CMD_READ && s.error == 0 {
            // Every data part must have come back with its buffer.
            let ok = s
                .parts
                .iter()
                .all(|p| p.hole || p.buf.as_ref().is_some_and(|b| b.len() as u64 >= p.len));
            if !ok {
                s.error = NBD_EIO;
            }
        }
        if s.error != 0 {
            let simple = match mode {
                TransmissionMode::Simple => true,
                TransmissionMode::Structured => s.cmd != NBD_CMD_READ,
                TransmissionMode::Extended => false,
            };
            if simple {
                SimpleReply {
                    cookie: s.cookie,
                    error: s.error,
                }
                .encode(&mut self.hdr);
            } else {
                let c = ReplyChunk::Error {
                    error: s.error,
                    message: "",
                };
                c.encode(mode, to, ReplyFlags::DONE, &mut self.hdr)?;
            }
            self.push_hdr(start);
            return Ok(());
        }
        match s.cmd {
            NBD_CMD_READ => self.encode_read(s, mode, to),
            NBD_CMD_BLOCK_STATUS => self.encode_status(s, mode, to, min_block),
            _ => {
                if mode == TransmissionMode::Extended {
                    ReplyChunk::None.encode(mode, to, ReplyFlags::DONE, &mut self.hdr)?;
                } else {
                    SimpleReply {
                        cookie: s.cookie,
                        error: 0,
                    }
                    .encode(&mut self.hdr);
                }
                self.push_hdr(start);
                Ok(())
            }
        }
    }

    fn encode_read(
        &mut self,
        s: &mut Slot,
        mode: TransmissionMode,
        to: ReplyTo,
    ) -> Result<(), Error> {
        let start = self.hdr.len();
        if mode == TransmissionMode::Simple {
            SimpleReply {
                cookie: s.cookie,
                error: 0,
            }
            .encode(&mut self.hdr);
            self.push_hdr(start);
            for p in &mut s.parts {
                if let Some(b) = p.buf.take() {
                    self.push_buf(b, p.len as usize);
                }
            }
            return Ok(());
        }
        let n = s.parts.len();
        if n == 0 {
            ReplyChunk::None.encode(mode, to, ReplyFlags::DONE, &mut self.hdr)?;
            self.push_hdr(start);
            return Ok(());
        }
        let mut i = 0;
        while i < n {
            let h = self.hdr.len();
            if s.parts[i].hole {
                let p = &s.parts[i];
                let done = if i + 1 == n {
                    ReplyFlags::DONE
                } else {
                    ReplyFlags::empty()
                };
                let size = u32::try_from(p.len).map_err(|_| Error::ValueTooLarge {
                    field: "hole size",
                    value: p.len,
                    max: u64::from(u32::MAX),
                })?;
                let c = ReplyChunk::OffsetHole {
                    offset: p.offset,
                    size,
                };
                c.encode(mode, to, done, &mut self.hdr)?;
                self.push_hdr(h);
                i += 1;
                continue;
            }
            // A run of data parts is one OFFSET_DATA chunk with one iovec per buffer.
            let mut j = i;
            let mut total = 0u64;
            while j < n && !s.parts[j].hole {
                total += s.parts[j].len;
                j += 1;
            }
            let done = if j == n {
                ReplyFlags::DONE
            } else {
                ReplyFlags::empty()
            };
            let c = ReplyChunk::OffsetData {
                offset: s.parts[i].offset,
                data_len: total,
            };
            c.encode(mode, to, done, &mut self.hdr)?;
            self.push_hdr(h);
            for p in &mut s.parts[i..j] {
                if let Some(b) = p.buf.take() {
                    self.push_buf(b, p.len as usize);
                }
            }
            i = j;
        }
        Ok(())
    }

    fn encode_status(
        &mut self,
        s: &mut Slot,
        mode: TransmissionMode,
        to: ReplyTo,
        min_block: u32,
    ) -> Result<(), Error> {
        let start = self.hdr.len();
        let req_one = s.flags.contains(CmdFlags::REQ_ONE);
        let flags_of = |e: &DevExtent| {
            if e.allocated {
                0
            } else {
                NBD_STATE_HOLE | NBD_STATE_ZERO
            }
        };
        if mode == TransmissionMode::Extended {
            self.ext64.clear();
            for e in s.extents.iter().filter(|e| e.len > 0) {
                self.ext64.push(ExtentExt {
                    length: e.len,
                    flags: u64::from(flags_of(e)),
                });
                if req_one {
                    break;
                }
            }
            if self.ext64.is_empty() {
                self.ext64.push(ExtentExt {
                    length: s.length,
                    flags: 0,
                });
            }
            let c = ReplyChunk::BlockStatusExt {
                context_id: BASE_ALLOCATION_ID,
                extents: &self.ext64,
            };
            c.encode(mode, to, ReplyFlags::DONE, &mut self.hdr)?;
        } else {
            // 32-bit descriptors: a longer extent is cut (to a multiple of the block size)
            // and ends the list, which must stay contiguous from the request's offset.
            let cap = u64::from(u32::MAX / min_block * min_block);
            self.ext32.clear();
            for e in s.extents.iter().filter(|e| e.len > 0) {
                let len = e.len.min(cap);
                self.ext32.push(Extent {
                    length: len as u32,
                    flags: flags_of(e),
                });
                if req_one || len < e.len {
                    break;
                }
            }
            if self.ext32.is_empty() {
                self.ext32.push(Extent {
                    length: s.length.min(cap) as u32,
                    flags: 0,
                });
            }
            let c = ReplyChunk::BlockStatus {
                context_id: BASE_ALLOCATION_ID,
                extents: &self.ext32,
            };
            c.encode(mode, to, ReplyFlags::DONE, &mut self.hdr)?;
        }
        self.push_hdr(start);
        Ok(())
    }
}

impl ConnShared {
    /// Writes ready replies if nobody else is writing. Never blocks on the socket.
    fn flush(&self) {
        let w = {
            let mut g = self.state.lock();
            if g.ready.is_empty() {
                return;
            }
            match g.writer.take() {
                Some(w) => w,
                None => return,
            }
        };
        self.run_writer(w, false);
    }

    /// The writer loop; the caller holds the token `w`. See the module docs.
    fn run_writer(&self, mut w: Box<Scratch>, blocking: bool) {
        let mut rounds = 0u32;
        loop {
            if w.unsent() {
                if !self.dead.load(Ordering::Relaxed) {
                    match w.send(self.fd, !blocking) {
                        Ok(true) => {}
                        Ok(false) => {
                            self.hand_off(w);
                            return;
                        }
                        Err(e) => self.kill(&e),
                    }
                }
                w.reset_output();
            }
            let dead = self.dead.load(Ordering::Relaxed);
            let mut g = self.state.lock();
            let wake = w.free_done(&mut g);
            w.collect(&mut g, self.mode, self.min_block, dead);
            if w.done.is_empty() {
                g.writer = Some(w);
                drop(g);
                if wake {
                    self.reader.unpark();
                }
                return;
            }
            rounds += 1;
            if !blocking && rounds >= MAX_NONBLOCKING_ROUNDS {
                g.handoff = Some(w);
                let f = g.flusher.clone();
                drop(g);
                if wake {
                    self.reader.unpark();
                }
                if let Some(f) = f {
                    f.unpark();
                }
                return;
            }
            drop(g);
            if wake {
                self.reader.unpark();
            }
        }
    }

    fn hand_off(&self, w: Box<Scratch>) {
        let f = {
            let mut g = self.state.lock();
            g.handoff = Some(w);
            g.flusher.clone()
        };
        if let Some(f) = f {
            f.unpark();
        }
    }

    /// The client is gone (a send failed): drop replies from now on, and wake the reader.
    fn kill(&self, e: &io::Error) {
        if !self.dead.swap(true, Ordering::Relaxed) {
            debug!("send failed, dropping replies: {e}");
            let _ = self.sock.shutdown(Shutdown::Both);
        }
    }

    fn flusher_main(self: Arc<Self>) {
        loop {
            let w = {
                let mut g = self.state.lock();
                loop {
                    if let Some(w) = g.handoff.take() {
                        break Some(w);
                    }
                    if g.stop_flusher {
                        break None;
                    }
                    drop(g);
                    thread::park();
                    g = self.state.lock();
                }
            };
            match w {
                Some(w) => self.run_writer(w, true),
                None => return,
            }
        }
    }
}

impl EndIo for ConnShared {
    fn end_io(&self, mut bio: Bio, res: Result<(), blk::Error>) {
        let slot = (bio.cookie >> 32) as usize;
        let part = (bio.cookie & 0xffff_ffff) as usize;
        let mut buf = bio.buf.take();
        {
            let mut g = self.state.lock();
            let st = &mut *g;
            if let Some(s) = st.slots.get_mut(slot) {
                if let Err(e) = &res {
                    if s.error == 0 {
                        s.error = nbd_errno(e);
                    }
                }
                if bio.op == Op::Read {
                    if let Some(p) = s.parts.get_mut(part) {
                        p.buf = buf.take();
                    }
                }
                if s.pending > 0 {
                    s.pending -= 1;
                    if s.pending == 0 {
                        st.ready.push(slot as u32);
                    }
                }
            }
        }
        // Write buffers go back to their pool outside the lock.
        drop(buf);
        if blkq_sync::thread_slot() != self.reader_slot {
            self.flush();
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The reader.
// ---------------------------------------------------------------------------------------------

/// Buffer pools by size class, per connection.
struct Pools {
    sizes: Vec<usize>,
    pools: Vec<BufferPool>,
}

impl Pools {
    fn new(chunk: usize) -> Self {
        let mut sizes = Vec::new();
        let mut pools = Vec::new();
        for (size, keep) in [
            (4 << 10, 256),
            (16 << 10, 128),
            (64 << 10, 64),
            (256 << 10, 32),
        ] {
            if size < chunk {
                sizes.push(size);
                pools.push(BufferPool::new(size, 0, keep));
            }
        }
        sizes.push(chunk);
        pools.push(BufferPool::new(chunk, 0, 32));
        Self { sizes, pools }
    }

    fn get(&self, len: usize) -> Buffer {
        for (s, p) in self.sizes.iter().zip(&self.pools) {
            if len <= *s {
                if let Some(b) = p.get(len) {
                    return b;
                }
            }
        }
        Buffer::new(len)
    }
}

/// A request decoded and checked, waiting for a slot.
#[derive(Debug)]
struct Staged {
    cookie: u64,
    offset: u64,
    length: u64,
    cmd: u16,
    flags: CmdFlags,
    error: u32,
    bytes: u64,
    nparts: usize,
    nbios: usize,
    extents: Option<Vec<DevExtent>>,
}

impl Staged {
    fn of(r: &Request) -> Self {
        Self {
            cookie: r.cookie,
            offset: r.offset,
            length: r.length,
            cmd: r.kind.as_u16(),
            flags: r.flags,
            error: 0,
            bytes: 0,
            nparts: 0,
            nbios: 0,
            extents: None,
        }
    }
}

/// A write whose payload is still arriving: its bios are in `Conn::wbios`.
#[derive(Debug)]
struct PartialWrite {
    meta: Staged,
    bio: usize,
    off: usize,
    remaining: u64,
}

/// Why a parse pass stopped.
enum Stop {
    /// The buffer holds no whole request: read more.
    NeedMore,
    /// The slots or the byte budget are taken: submit, wait, go on.
    Cap,
    /// A write payload continues past the buffer: read it straight into its buffers.
    Partial,
    /// `NBD_CMD_DISC`.
    Disc,
    /// The stream is out of step or the client broke a hard rule: close.
    Fatal(String),
}

struct Conn<'a> {
    c: Arc<ConnShared>,
    end: Arc<dyn EndIo>,
    flusher: Option<JoinHandle<()>>,
    stream: Stream,
    shared: &'a Shared,
    export: &'a ExportState,
    mode: TransmissionMode,
    base_allocation: bool,
    min_block: u64,
    max_block: u64,
    chunk: usize,
    pools: Pools,
    rbuf: Vec<u8>,
    pos: usize,
    len: usize,
    /// Payload bytes still to discard (of a refused write).
    skip: u64,
    staged: Vec<Staged>,
    staged_bytes: u64,
    parts: Vec<(u64, u64, bool)>,
    bios: Vec<Bio>,
    /// Bios of the write being read (`partial`), or being staged.
    wbios: Vec<Bio>,
    partial: Option<PartialWrite>,
    stats: Stats,
}

impl<'a> Conn<'a> {
    fn new(
        stream: Stream,
        shared: &'a Shared,
        export: &'a ExportState,
        neg: Negotiated,
    ) -> io::Result<Self> {
        let t = &shared.tuning;
        let lim = export.cfg.device.limits();
        let min_block = export.min_block;
        let chunk = (lim.max_io_bytes as usize).clamp(min_block as usize, MAX_CHUNK);
        let chunk = chunk / min_block as usize * min_block as usize;
        let sock = stream.try_clone()?;
        let fd = sock.as_raw_fd();
        // Best effort: a bigger send buffer means fewer replies handed to the flusher.
        let _ = crate::sys::set_send_buffer(fd, SEND_BUFFER);
        let slots = (0..t.slots).map(|_| Slot::default()).collect();
        let free = (0..t.slots as u32).rev().collect();
        let c = Arc::new(ConnShared {
            sock,
            fd,
            mode: neg.mode,
            min_block,
            reader_slot: blkq_sync::thread_slot(),
            reader: thread::current(),
            dead: AtomicBool::new(false),
            state: Mutex::new(State {
                slots,
                free,
                ready: Vec::with_capacity(t.slots),
                bytes: 0,
                writer: Some(Box::default()),
                handoff: None,
                flusher: None,
                stop_flusher: false,
                reader_waiting: false,
            }),
        });
        let fc = c.clone();
        let flusher = thread::spawn(move || fc.flusher_main());
        c.state.lock().flusher = Some(flusher.thread().clone());
        let end: Arc<dyn EndIo> = c.clone();
        Ok(Self {
            c,
            end,
            flusher: Some(flusher),
            stream,
            shared,
            export,
            mode: neg.mode,
            base_allocation: neg.base_allocation,
            min_block: u64::from(min_block),
            max_block: u64::from(handshake::block_size(export, t.max_block).max),
            chunk,
            pools: Pools::new(chunk),
            rbuf: vec![0; t.recv_buf],
            pos: 0,
            len: 0,
            skip: 0,
            staged: Vec::with_capacity(t.slots),
            staged_bytes: 0,
            parts: Vec::new(),
            bios: Vec::with_capacity(t.slots),
            wbios: Vec::new(),
            partial: None,
            stats: Stats::default(),
        })
    }

    fn dev(&self) -> &'a dyn Device {
        self.export.cfg.device.as_ref()
    }

    /// The reader loop; returns why it ended.
    fn run(&mut self) -> String {
        loop {
            if self.partial.is_some() {
                if let Err(reason) = self.fill_partial() {
                    return reason;
                }
            }
            let (slots, bytes) = self.capacity();
            let stop = self.parse(slots, bytes);
            self.commit();
            match stop {
                Stop::NeedMore => {
                    if let Err(reason) = self.recv() {
                        return reason;
                    }
                }
                Stop::Cap | Stop::Partial => {}
                Stop::Disc => return "client disconnected (NBD_CMD_DISC)".into(),
                Stop::Fatal(reason) => {
                    warn!(peer = %self.stream, "closing connection: {reason}");
                    self.c.dead.store(true, Ordering::Relaxed);
                    let _ = self.stream.shutdown(Shutdown::Both);
                    return reason;
                }
            }
        }
    }

    /// Waits until the staged requests can make progress: a free slot, and either room in
    /// the byte budget or something already staged. Returns the free slots and budget left.
    fn capacity(&mut self) -> (usize, u64) {
        let budget = self.shared.tuning.max_bytes_in_flight;
        loop {
            {
                let mut g = self.c.state.lock();
                let slots = g.free.len();
                let bytes = budget.saturating_sub(g.bytes);
                if slots > 0 && (bytes > 0 || !self.staged.is_empty()) {
                    return (slots, bytes);
                }
                if g.ready.is_empty() || g.writer.is_none() {
                    // Whoever holds the token (or completes the next request) frees slots
                    // and unparks us (see `Scratch::free_done`).
                    g.reader_waiting = true;
                    drop(g);
                    thread::park();
                    continue;
                }
            }
            self.c.flush();
        }
    }

    /// Reads more bytes into the buffer (blocking).
    fn recv(&mut self) -> Result<(), String> {
        if self.pos > 0 {
            self.rbuf.copy_within(self.pos..self.len, 0);
            self.len -= self.pos;
            self.pos = 0;
        }
        if self.len == self.rbuf.len() {
            return Err("receive buffer full without a whole request".into());
        }
        loop {
            match self.stream.read(&mut self.rbuf[self.len..]) {
                Ok(0) => {
                    return Err(if self.shared.stopping() {
                        "server shutting down".into()
                    } else if self.len > 0 {
                        "client closed the connection in the middle of a request".into()
                    } else {
                        "client closed the connection".into()
                    });
                }
                Ok(n) => {
                    self.len += n;
                    return Ok(());
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(format!("read error: {e}")),
            }
        }
    }

    /// Decodes and stages requests from the buffer, up to the capacity given.
    fn parse(&mut self, cap_slots: usize, cap_bytes: u64) -> Stop {
        let stopping = self.shared.stopping();
        loop {
            if self.staged.len() >= cap_slots || self.staged_bytes >= cap_bytes {
                return Stop::Cap;
            }
            if self.skip > 0 {
                let n = (self.len - self.pos).min(self.skip.min(usize::MAX as u64) as usize);
                self.pos += n;
                self.skip -= n as u64;
                if self.skip > 0 {
                    return Stop::NeedMore;
                }
            }
            let avail = &self.rbuf[self.pos..self.len];
            match decode_request(avail, self.mode) {
                Ok(Decoded::Incomplete(_)) => return Stop::NeedMore,
                Ok(Decoded::Complete { value, consumed }) => {
                    self.pos += consumed;
                    if let Some(stop) = self.request(value, stopping) {
                        return stop;
                    }
                }
                Err(Error::UnknownCommand(u)) => {
                    self.pos += u.header_len;
                    self.stats.requests += 1;
                    self.stats.errors += 1;
                    self.staged.push(Staged {
                        cookie: u.cookie,
                        offset: u.offset,
                        length: u.length,
                        cmd: u.command,
                        flags: u.flags,
                        error: NBD_EINVAL,
                        bytes: 0,
                        nparts: 0,
                        nbios: 0,
                        extents: None,
                    });
                    if let Some(stop) = self.discard(u.payload_len) {
                        return stop;
                    }
                }
                Err(e) => return Stop::Fatal(format!("bad request: {e}")),
            }
        }
    }

    /// Arranges for a refused request's payload to be skipped.
    fn discard(&mut self, payload: u64) -> Option<Stop> {
        if payload > self.shared.tuning.discard_limit {
            return Some(Stop::Fatal(format!(
                "refused a request with a {payload}-byte payload (more than the {} bytes the \
                 server discards)",
                self.shared.tuning.discard_limit
            )));
        }
        self.skip = payload;
        None
    }

    /// The NBD error a request gets before it reaches the device, if any.
    fn validate(&self, r: &Request) -> Option<u32> {
        let mut allowed = CmdFlags::FUA;
        match r.kind {
            Command::Read if self.mode.chunked_replies() => allowed |= CmdFlags::DF,
            Command::Write if self.mode.extended_headers() => allowed |= CmdFlags::PAYLOAD_LEN,
            Command::WriteZeroes => allowed |= CmdFlags::NO_HOLE | CmdFlags::FAST_ZERO,
            Command::BlockStatus => allowed |= CmdFlags::REQ_ONE,
            _ => {}
        }
        if !r.flags.difference(allowed).is_empty() {
            return Some(NBD_EINVAL);
        }
        let writes = matches!(
            r.kind,
            Command::Write | Command::Trim | Command::WriteZeroes
        );
        if writes && self.export.cfg.read_only {
            return Some(NBD_EPERM);
        }
        match r.kind {
            Command::Flush => return None,
            Command::Read
            | Command::Write
            | Command::Trim
            | Command::WriteZeroes
            | Command::Cache
            | Command::BlockStatus => {}
            _ => return Some(NBD_EINVAL),
        }
        if r.kind == Command::BlockStatus && !self.base_allocation {
            return Some(NBD_EINVAL);
        }
        let (off, len) = (r.offset, r.length);
        if len == 0 || off % self.min_block != 0 || len % self.min_block != 0 {
            return Some(NBD_EINVAL);
        }
        if off
            .checked_add(len)
            .is_none_or(|end| end > self.export.size)
        {
            return Some(match r.kind {
                Command::Write | Command::WriteZeroes => NBD_ENOSPC,
                _ => NBD_EINVAL,
            });
        }
        if len > self.max_block {
            match r.kind {
                Command::Read if r.flags.contains(CmdFlags::DF) => return Some(NBD_EOVERFLOW),
                Command::Read | Command::Write => return Some(NBD_EINVAL),
                _ => {}
            }
        }
        None
    }

    /// Stages one decoded request; `Some` stops the parse pass.
    fn request(&mut self, r: Request, stopping: bool) -> Option<Stop> {
        self.stats.requests += 1;
        if r.kind == Command::Disc {
            return Some(Stop::Disc);
        }
        let payload = r.payload_len(self.mode);
        let err = if stopping {
            Some(NBD_ESHUTDOWN)
        } else {
            self.validate(&r)
        };
        if let Some(error) = err {
            self.stats.errors += 1;
            self.staged.push(Staged {
                error,
                ..Staged::of(&r)
            });
            return self.discard(payload);
        }
        match r.kind {
            Command::Read => self.stage_read(&r),
            Command::Write => return self.stage_write(&r),
            Command::Flush => {
                self.bios.push(Bio::new(Op::Flush, 0, 0));
                self.staged.push(Staged {
                    nbios: 1,
                    ..Staged::of(&r)
                });
            }
            Command::Trim => self.stage_range(&r, Op::Discard),
            Command::WriteZeroes => self.stage_range(&r, Op::WriteZeroes),
            Command::BlockStatus => {
                let max = if r.flags.contains(CmdFlags::REQ_ONE) {
                    1
                } else {
                    MAX_STATUS_EXTENTS
                };
                let s = match self.dev().extents(r.offset, r.length, max) {
                    Ok(v) => Staged {
                        extents: Some(v),
                        ..Staged::of(&r)
                    },
                    Err(e) => Staged {
                        error: nbd_errno(&e),
                        ..Staged::of(&r)
                    },
                };
                self.staged.push(s);
            }
            // Cache: nothing to prefetch in a block layer without a page cache.
            _ => self.staged.push(Staged::of(&r)),
        }
        None
    }

    fn bio_flags(r: &Request) -> BioFlags {
        let mut f = BioFlags::NONE;
        if r.flags.contains(CmdFlags::FUA) {
            f = f | BioFlags::FUA;
        }
        if r.flags.contains(CmdFlags::NO_HOLE) {
            f = f | BioFlags::NO_HOLE;
        }
        if r.flags.contains(CmdFlags::FAST_ZERO) {
            f = f | BioFlags::FAST_ZERO;
        }
        f
    }

    /// Trim or write-zeroes: bios of at most [`PIECE`] bytes.
    fn stage_range(&mut self, r: &Request, op: Op) {
        let flags = Self::bio_flags(r);
        let piece = PIECE / self.min_block * self.min_block;
        let (mut at, end) = (r.offset, r.offset + r.length);
        let mut n = 0;
        while at < end {
            let len = (end - at).min(piece);
            let mut b = Bio::new(op, at >> SECTOR_SHIFT, len as u32);
            b.flags = flags;
            self.bios.push(b);
            at += len;
            n += 1;
        }
        self.staged.push(Staged {
            nbios: n,
            ..Staged::of(r)
        });
    }

    fn add_data(&mut self, mut at: u64, len: u64, nparts: &mut usize) {
        let end = at + len;
        while at < end {
            let n = (end - at).min(self.chunk as u64);
            let mut b = Bio::with_buf(Op::Read, at >> SECTOR_SHIFT, self.pools.get(n as usize));
            b.cookie = *nparts as u64;
            self.bios.push(b);
            self.parts.push((at, n, false));
            *nparts += 1;
            at += n;
        }
    }

    fn stage_read(&mut self, r: &Request) {
        let (off, end) = (r.offset, r.offset + r.length);
        let (p0, b0) = (self.parts.len(), self.bios.len());
        let mut nparts = 0;
        let sparse = self.mode.chunked_replies()
            && !r.flags.contains(CmdFlags::DF)
            && self.export.cfg.sparse_reads;
        let mut at = off;
        if sparse {
            if let Ok(ext) = self.dev().extents(off, r.length, MAX_READ_EXTENTS) {
                for e in &ext {
                    if e.offset != at || e.len == 0 {
                        break;
                    }
                    let e_end = e.offset.saturating_add(e.len).min(end);
                    if e.allocated || e_end - at < self.min_block {
                        self.add_data(at, e_end - at, &mut nparts);
                    } else {
                        self.parts.push((at, e_end - at, true));
                        nparts += 1;
                    }
                    at = e_end;
                    if at >= end {
                        break;
                    }
                }
            }
        }
        if at < end {
            self.add_data(at, end - at, &mut nparts);
        }
        self.staged_bytes += r.length;
        self.staged.push(Staged {
            bytes: r.length,
            nparts: self.parts.len() - p0,
            nbios: self.bios.len() - b0,
            ..Staged::of(r)
        });
    }

    /// A write: its payload goes into pooled buffers, from the receive buffer and then, if it
    /// continues past it, straight from the socket.
    fn stage_write(&mut self, r: &Request) -> Option<Stop> {
        let flags = Self::bio_flags(r);
        let (mut at, end) = (r.offset, r.offset + r.length);
        self.wbios.clear();
        while at < end {
            let n = (end - at).min(self.chunk as u64);
            let mut b = Bio::with_buf(Op::Write, at >> SECTOR_SHIFT, self.pools.get(n as usize));
            b.flags = flags;
            self.wbios.push(b);
            at += n;
        }
        let meta = Staged {
            bytes: r.length,
            nbios: self.wbios.len(),
            ..Staged::of(r)
        };
        self.staged_bytes += r.length;
        let mut remaining = r.length;
        let (mut bi, mut off) = (0usize, 0usize);
        while remaining > 0 && self.pos < self.len {
            let Some(buf) = self.wbios.get_mut(bi).and_then(|b| b.buf.as_mut()) else {
                break;
            };
            let dst = &mut buf.as_mut_slice()[off..];
            let n = dst.len().min(self.len - self.pos);
            dst[..n].copy_from_slice(&self.rbuf[self.pos..self.pos + n]);
            self.pos += n;
            off += n;
            remaining -= n as u64;
            if n == dst.len() {
                bi += 1;
                off = 0;
            }
        }
        if remaining == 0 {
            self.bios.append(&mut self.wbios);
            self.staged.push(meta);
            return None;
        }
        self.partial = Some(PartialWrite {
            meta,
            bio: bi,
            off,
            remaining,
        });
        Some(Stop::Partial)
    }

    /// Reads the rest of a write's payload straight into its buffers; the bytes that follow
    /// it (the next requests) land in the receive buffer with the same `readv`.
    fn fill_partial(&mut self) -> Result<(), String> {
        let Some(mut p) = self.partial.take() else {
            return Ok(());
        };
        // Everything buffered was consumed into the payload.
        self.pos = 0;
        self.len = 0;
        let nbios = self.wbios.len();
        while p.remaining > 0 {
            let Some(buf) = self.wbios.get_mut(p.bio).and_then(|b| b.buf.as_mut()) else {
                return Err("internal error: write buffer missing".into());
            };
            let full = buf.len();
            let dst = &mut buf.as_mut_slice()[p.off..];
            let dst_len = dst.len();
            let last = p.bio + 1 == nbios;
            let res = if last {
                let mut iov = [
                    IoSliceMut::new(dst),
                    IoSliceMut::new(&mut self.rbuf[self.len..]),
                ];
                self.stream.read_vectored(&mut iov)
            } else {
                self.stream.read(dst)
            };
            let n = match res {
                Ok(0) => return Err("client closed the connection in the middle of a write".into()),
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(format!("read error: {e}")),
            };
            let into = n.min(dst_len);
            p.remaining -= into as u64;
            p.off += into;
            self.len += n - into;
            if p.off == full {
                p.bio += 1;
                p.off = 0;
            }
        }
        self.bios.append(&mut self.wbios);
        self.staged.push(p.meta);
        Ok(())
    }

    /// Gives staged requests their slots (one lock), then submits their bios as one batch and
    /// flushes replies.
    fn commit(&mut self) {
        if self.staged.is_empty() {
            self.c.flush();
            return;
        }
        let (mut k, mut pc, mut bc) = (0usize, 0usize, 0usize);
        {
            let mut g = self.c.state.lock();
            let st = &mut *g;
            for e in &mut self.staged {
                let Some(i) = st.free.pop() else {
                    break;
                };
                let Some(s) = st.slots.get_mut(i as usize) else {
                    break;
                };
                s.cookie = e.cookie;
                s.offset = e.offset;
                s.length = e.length;
                s.cmd = e.cmd;
                s.flags = e.flags;
                s.error = e.error;
                s.bytes = e.bytes;
                s.pending = e.nbios as u32;
                s.parts.clear();
                for &(offset, len, hole) in &self.parts[pc..pc + e.nparts] {
                    s.parts.push(Part {
                        offset,
                        len,
                        hole,
                        buf: None,
                    });
                }
                if let Some(x) = e.extents.take() {
                    s.extents = x;
                }
                for b in &mut self.bios[bc..bc + e.nbios] {
                    b.cookie |= u64::from(i) << 32;
                }
                st.bytes += e.bytes;
                if e.nbios == 0 {
                    st.ready.push(i);
                }
                pc += e.nparts;
                bc += e.nbios;
                k += 1;
            }
        }
        let staged_bytes: u64 = self.staged[..k].iter().map(|e| e.bytes).sum();
        self.staged_bytes -= staged_bytes;
        self.staged.drain(..k);
        self.parts.drain(..pc);
        if bc > 0 {
            let dev = self.dev();
            dev.submit_batch(&mut self.bios.drain(..bc), &self.end);
        }
        self.c.flush();
    }

    /// Waits for every in-flight request to be answered (or dropped, if the client is gone),
    /// then stops the flusher.
    fn teardown(&mut self, reason: &str) {
        debug!(peer = %self.stream, "tearing down: {reason}");
        // A write still arriving, or staged requests that never got a slot, are dropped.
        self.partial = None;
        self.wbios.clear();
        if !self.staged.is_empty() {
            // Only possible if slots ran out at the very end; answer nothing for them.
            self.staged.clear();
            self.parts.clear();
            self.bios.clear();
        }
        loop {
            self.c.flush();
            let mut g = self.c.state.lock();
            let idle = g.free.len() == g.slots.len()
                && g.writer.is_some()
                && g.handoff.is_none()
                && g.ready.is_empty();
            if idle {
                break;
            }
            if !g.ready.is_empty() && g.writer.is_some() {
                continue;
            }
            g.reader_waiting = true;
            drop(g);
            thread::park();
        }
        {
            let mut g = self.c.state.lock();
            g.stop_flusher = true;
        }
        if let Some(f) = self.flusher.take() {
            f.thread().unpark();
            let _ = f.join();
        }
        let _ = self.stream.shutdown(Shutdown::Both);
    }
}
