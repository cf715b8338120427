//! A small blocking NBD client on top of the codec.
//!
//! [`Handshake`] drives option haggling one option at a time (so tests can send anything,
//! including options a real client would not); [`Client`] is the transmission phase, with
//! pipelining ([`Client::send`] many requests, then [`Client::recv`] their replies in any order)
//! and blocking helpers ([`Client::read`], [`Client::write`], ...). Tests and tools use it,
//! and a remote leg (`remote/`) negotiates its connections with it.
//!
//! The errors are in `error.rs`, option haggling in `handshake.rs`, the transmission phase
//! here.

mod error;
mod handshake;

pub use error::ClientError;
pub use handshake::{
    ExportDetails, Handshake, OptionReplyMsg, MAX_OPTION_REPLIES, MAX_OPTION_REPLY_BYTES,
};

use std::collections::HashMap;
use std::io::{self, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::Instant;

use crate::coverage::Coverage;

use crate::stream::{Stream, Until};
use nbd_proto::proto::{CmdFlags, Command, TransmissionMode};
use nbd_proto::transmission::{decode_reply_header, parse_chunk, Chunk, ReplyHeader, Request};
use nbd_proto::Decoded;

/// Largest reply chunk payload the client accepts.
const MAX_CHUNK_PAYLOAD: u64 = 64 << 20;
/// Where a server listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    /// A TCP address.
    Tcp(SocketAddr),
    /// A Unix socket path.
    Unix(PathBuf),
}

impl Endpoint {
    /// Connects to the endpoint.
    pub fn connect(&self) -> io::Result<Stream> {
        Ok(match self {
            Endpoint::Tcp(a) => {
                let s = TcpStream::connect(a)?;
                s.set_nodelay(true)?;
                Stream::from(s)
            }
            Endpoint::Unix(p) => Stream::from(UnixStream::connect(p)?),
        })
    }
}
impl Handshake {
    /// The transmission phase, after a successful [`go`](Self::go).
    pub fn into_client(self, details: ExportDetails) -> Result<Client, ClientError> {
        let (stream, mode, meta_id, contexts) = self.into_transmission();
        Client::new(stream, mode, details, meta_id, contexts)
    }

    /// `NBD_OPT_EXPORT_NAME`: enters transmission (the server closes the connection if the
    /// export does not exist).
    pub fn export_name(self, name: &str) -> Result<Client, ClientError> {
        let (h, details) = self.enter_by_name(name)?;
        h.into_client(details)
    }
}

/// Options of [`Client::connect`].
#[derive(Debug, Clone)]
pub struct ClientOptions {
    /// The export name.
    pub export: String,
    /// Negotiate structured replies.
    pub structured: bool,
    /// Negotiate extended headers (implies chunked replies).
    pub extended: bool,
    /// Select `base:allocation` (needs structured or extended).
    pub base_allocation: bool,
    /// More metadata contexts to select (e.g. `qemu:dirty-bitmap:NAME`; needs structured or
    /// extended).
    pub contexts: Vec<String>,
    /// Enter transmission with `NBD_OPT_EXPORT_NAME` instead of `NBD_OPT_GO`.
    pub export_name: bool,
}

impl Default for ClientOptions {
    fn default() -> Self {
        Self {
            export: String::new(),
            structured: true,
            extended: false,
            base_allocation: true,
            contexts: Vec::new(),
            export_name: false,
        }
    }
}

/// One context's part of a block-status reply: its name, and its (length, flags)
/// descriptors.
pub type ContextStatus = (String, Vec<(u64, u64)>);

/// A whole reply, as [`Client::recv`] returns it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Reply {
    /// The request's cookie.
    pub cookie: u64,
    /// 0 for success, else the (first) NBD error value.
    pub error: u32,
    /// Read data (holes as zeros), the request's length.
    pub data: Vec<u8>,
    /// Block status descriptors of `base:allocation` (of the only context, when the client
    /// did not select it): (length, flags).
    pub extents: Vec<(u64, u64)>,
    /// Block status descriptors of every context, in the order of the chunks: (context id,
    /// (length, flags) descriptors).
    pub contexts: Vec<(u32, Vec<(u64, u64)>)>,
    /// Data chunks (`OFFSET_DATA`) received.
    pub data_chunks: u32,
    /// Hole chunks (`OFFSET_HOLE`) received.
    pub hole_chunks: u32,
}

struct Pending {
    cmd: Command,
    offset: u64,
    length: u64,
    reply: Reply,
    /// A read's bytes its chunks have filled.
    filled: Coverage,
}

/// The transmission phase.
pub struct Client {
    reader: BufReader<Until<Stream>>,
    writer: Stream,
    mode: TransmissionMode,
    details: ExportDetails,
    meta_id: Option<u32>,
    contexts: Vec<(u32, String)>,
    next_cookie: u64,
    pending: HashMap<u64, Pending>,
    out: Vec<u8>,
}

impl Client {
    /// The transmission phase on a stream negotiated elsewhere (the remote device checks a
    /// new connection with one request before its own threads take the socket).
    pub(crate) fn new(
        stream: Stream,
        mode: TransmissionMode,
        details: ExportDetails,
        meta_id: Option<u32>,
        contexts: Vec<(u32, String)>,
    ) -> Result<Self, ClientError> {
        let writer = stream.try_clone()?;
        Ok(Self {
            reader: BufReader::with_capacity(
                256 << 10,
                Until {
                    sock: stream,
                    deadline: None,
                },
            ),
            writer,
            mode,
            details,
            meta_id,
            contexts,
            next_cookie: 1,
            pending: HashMap::new(),
            out: Vec::new(),
        })
    }

    /// Connects and negotiates as `opts` says.
    pub fn connect(ep: &Endpoint, opts: &ClientOptions) -> Result<Self, ClientError> {
        let mut h = Handshake::start(ep.connect()?)?;
        if opts.extended {
            h.extended_headers()?;
        } else if opts.structured {
            h.structured_replies()?;
        }
        if (opts.base_allocation || !opts.contexts.is_empty()) && (opts.extended || opts.structured)
        {
            let mut queries: Vec<&str> = opts.contexts.iter().map(String::as_str).collect();
            if opts.base_allocation {
                queries.insert(0, "base:allocation");
            }
            h.meta_context(&opts.export, &queries, true)?;
        }
        if opts.export_name {
            h.export_name(&opts.export)
        } else {
            let d = h.go(&opts.export)?;
            h.into_client(d)
        }
    }

    /// From now on every reply must be received whole before `deadline` (`None`: each read
    /// waits as the socket's receive timeout says): a server trickling its reply a byte at a
    /// time runs out of time like a silent one. Used for the check of a new connection,
    /// part of its connection attempt.
    pub fn set_deadline(&mut self, deadline: Option<Instant>) {
        self.reader.get_mut().deadline = deadline;
    }

    /// TLS 1.3: asks for a key update on both sides (sent with the next request).
    pub fn tls_refresh_keys(&mut self) -> Result<(), ClientError> {
        Ok(self.writer.tls_refresh_keys()?)
    }

    /// The export's size.
    pub fn size(&self) -> u64 {
        self.details.size
    }

    /// What the handshake said about the export.
    pub fn details(&self) -> &ExportDetails {
        &self.details
    }

    /// The negotiated transmission mode.
    pub fn mode(&self) -> TransmissionMode {
        self.mode
    }

    /// Requests sent and not yet answered.
    pub fn in_flight(&self) -> usize {
        self.pending.len()
    }

    /// Sends raw bytes (tests: malformed requests).
    pub fn send_raw(&mut self, bytes: &[u8]) -> Result<(), ClientError> {
        self.writer.write_all(bytes)?;
        Ok(())
    }

    /// Sends a request (its cookie is chosen here and returned) with `payload` after it (the
    /// data of a write). Does not wait for the reply.
    pub fn send(&mut self, mut req: Request, payload: &[u8]) -> Result<u64, ClientError> {
        req.cookie = self.next_cookie;
        self.next_cookie += 1;
        if self.mode.extended_headers() && req.kind == Command::Write {
            req.flags |= CmdFlags::PAYLOAD_LEN;
        }
        self.out.clear();
        req.encode(self.mode, &mut self.out)?;
        if payload.len() <= 64 << 10 {
            self.out.extend_from_slice(payload);
            self.writer.write_all(&self.out)?;
        } else {
            self.writer.write_all(&self.out)?;
            self.writer.write_all(payload)?;
        }
        if req.kind != Command::Disc {
            self.pending.insert(
                req.cookie,
                Pending {
                    cmd: req.kind,
                    offset: req.offset,
                    length: req.length,
                    reply: Reply {
                        cookie: req.cookie,
                        ..Reply::default()
                    },
                    filled: Coverage::default(),
                },
            );
        }
        Ok(req.cookie)
    }

    /// Sends a request header with any command number (tests: unknown commands), without
    /// payload; its reply is expected like a flush's (no data).
    pub fn send_raw_request(
        &mut self,
        command: u16,
        flags: CmdFlags,
        offset: u64,
        length: u64,
    ) -> Result<u64, ClientError> {
        let cookie = self.next_cookie;
        self.next_cookie += 1;
        self.out.clear();
        if self.mode.extended_headers() {
            self.out
                .extend_from_slice(&nbd_proto::proto::NBD_EXTENDED_REQUEST_MAGIC.to_be_bytes());
        } else {
            self.out
                .extend_from_slice(&nbd_proto::proto::NBD_REQUEST_MAGIC.to_be_bytes());
        }
        self.out.extend_from_slice(&flags.bits().to_be_bytes());
        self.out.extend_from_slice(&command.to_be_bytes());
        self.out.extend_from_slice(&cookie.to_be_bytes());
        self.out.extend_from_slice(&offset.to_be_bytes());
        if self.mode.extended_headers() {
            self.out.extend_from_slice(&length.to_be_bytes());
        } else {
            self.out.extend_from_slice(&(length as u32).to_be_bytes());
        }
        self.writer.write_all(&self.out)?;
        self.pending.insert(
            cookie,
            Pending {
                cmd: Command::Flush,
                offset,
                length,
                reply: Reply {
                    cookie,
                    ..Reply::default()
                },
                filled: Coverage::default(),
            },
        );
        Ok(cookie)
    }

    fn read_exact(&mut self, n: usize) -> Result<Vec<u8>, ClientError> {
        let mut v = vec![0u8; n];
        self.reader.read_exact(&mut v)?;
        Ok(v)
    }

    /// Reads replies until one request is completely answered, and returns it.
    pub fn recv(&mut self) -> Result<Reply, ClientError> {
        loop {
            let min = match self.mode {
                TransmissionMode::Extended => 32,
                _ => 16,
            };
            let mut hdr = self.read_exact(min)?;
            let header = loop {
                match decode_reply_header(&hdr, self.mode)? {
                    Decoded::Complete { value, .. } => break value,
                    Decoded::Incomplete(n) => {
                        let more = self.read_exact(n.saturating_sub(hdr.len()).max(1))?;
                        hdr.extend_from_slice(&more);
                    }
                }
            };
            match header {
                ReplyHeader::Simple(r) => {
                    let Some(mut p) = self.pending.remove(&r.cookie) else {
                        return Err(ClientError::Unexpected(format!(
                            "reply for unknown cookie {}",
                            r.cookie
                        )));
                    };
                    p.reply.error = r.error;
                    if p.cmd == Command::Read && r.error == 0 {
                        if self.mode != TransmissionMode::Simple {
                            return Err(ClientError::Unexpected(
                                "simple reply with data to a structured read".into(),
                            ));
                        }
                        p.reply.data = self.read_exact(p.length as usize)?;
                    }
                    return Ok(p.reply);
                }
                ReplyHeader::Chunk(h) => {
                    if h.length > MAX_CHUNK_PAYLOAD {
                        return Err(ClientError::Unexpected(format!(
                            "chunk of {} bytes",
                            h.length
                        )));
                    }
                    let payload = self.read_exact(h.length as usize)?;
                    let chunk = parse_chunk(&h, &payload)?;
                    let Some(p) = self.pending.get_mut(&h.cookie) else {
                        return Err(ClientError::Unexpected(format!(
                            "chunk for unknown cookie {}",
                            h.cookie
                        )));
                    };
                    if p.cmd == Command::Read && p.reply.data.is_empty() {
                        p.reply.data = vec![0u8; p.length as usize];
                    }
                    Self::apply(p, chunk, self.meta_id)?;
                    if h.is_done() {
                        if let Some(p) = self.pending.remove(&h.cookie) {
                            // Disjoint pieces: as many bytes as the read is, all of it.
                            if p.cmd == Command::Read
                                && p.reply.error == 0
                                && p.filled.total() != p.length
                            {
                                return Err(ClientError::Unexpected(format!(
                                    "a read of {} bytes answered with {}",
                                    p.length,
                                    p.filled.total()
                                )));
                            }
                            return Ok(p.reply);
                        }
                    }
                }
            }
        }
    }

    fn apply(p: &mut Pending, chunk: Chunk<'_>, meta_id: Option<u32>) -> Result<(), ClientError> {
        let place = |p: &mut Pending, offset: u64, len: u64| -> Result<usize, ClientError> {
            let end = offset.checked_add(len);
            if offset < p.offset || end.is_none_or(|e| e > p.offset + p.length) {
                return Err(ClientError::Unexpected(format!(
                    "chunk {offset}+{len} outside the request {}+{}",
                    p.offset, p.length
                )));
            }
            p.filled
                .add(offset - p.offset, len)
                .map_err(ClientError::Unexpected)?;
            Ok((offset - p.offset) as usize)
        };
        match chunk {
            Chunk::None => {}
            Chunk::OffsetData { offset, data } => {
                let at = place(p, offset, data.len() as u64)?;
                p.reply.data[at..at + data.len()].copy_from_slice(data);
                p.reply.data_chunks += 1;
            }
            Chunk::OffsetHole { offset, size } => {
                let at = place(p, offset, u64::from(size))?;
                p.reply.data[at..at + size as usize].fill(0);
                p.reply.hole_chunks += 1;
            }
            Chunk::BlockStatus {
                context_id,
                extents,
            } => {
                let extents: Vec<_> = extents
                    .iter()
                    .map(|e| (u64::from(e.length), u64::from(e.flags)))
                    .collect();
                if meta_id.is_none_or(|id| id == context_id) {
                    p.reply.extents = extents.clone();
                }
                p.reply.contexts.push((context_id, extents));
            }
            Chunk::BlockStatusExt {
                context_id,
                extents,
            } => {
                let extents: Vec<_> = extents.iter().map(|e| (e.length, e.flags)).collect();
                if meta_id.is_none_or(|id| id == context_id) {
                    p.reply.extents = extents.clone();
                }
                p.reply.contexts.push((context_id, extents));
            }
            Chunk::Error { error, .. }
            | Chunk::ErrorOffset { error, .. }
            | Chunk::OtherError { error, .. } => {
                if p.reply.error == 0 {
                    p.reply.error = error;
                }
            }
            // `Chunk` is non-exhaustive: a chunk kind added to the codec later is not one this
            // client asked for.
            _ => {
                return Err(ClientError::Unexpected(
                    "a reply chunk of a kind this client does not handle".into(),
                ))
            }
        }
        Ok(())
    }

    /// Sends one request and waits for its reply (other replies must not be pending).
    pub fn request(&mut self, req: Request, payload: &[u8]) -> Result<Reply, ClientError> {
        let cookie = self.send(req, payload)?;
        let r = self.recv()?;
        if r.cookie != cookie {
            return Err(ClientError::Unexpected("reply to another request".into()));
        }
        if r.error != 0 {
            return Err(ClientError::Request(r.error));
        }
        Ok(r)
    }

    /// Reads `len` bytes at `offset`.
    pub fn read(&mut self, offset: u64, len: u64) -> Result<Vec<u8>, ClientError> {
        Ok(self
            .request(Request::new(Command::Read, 0, offset, len), &[])?
            .data)
    }

    /// Writes `data` at `offset`.
    pub fn write(&mut self, offset: u64, data: &[u8], flags: CmdFlags) -> Result<(), ClientError> {
        let req = Request::new(Command::Write, 0, offset, data.len() as u64).with_flags(flags);
        self.request(req, data).map(drop)
    }

    /// Flushes.
    pub fn flush(&mut self) -> Result<(), ClientError> {
        self.request(Request::new(Command::Flush, 0, 0, 0), &[])
            .map(drop)
    }

    /// Trims a range.
    pub fn trim(&mut self, offset: u64, len: u64) -> Result<(), ClientError> {
        self.request(Request::new(Command::Trim, 0, offset, len), &[])
            .map(drop)
    }

    /// Zeroes a range.
    pub fn write_zeroes(
        &mut self,
        offset: u64,
        len: u64,
        flags: CmdFlags,
    ) -> Result<(), ClientError> {
        let req = Request::new(Command::WriteZeroes, 0, offset, len).with_flags(flags);
        self.request(req, &[]).map(drop)
    }

    /// Block status of `base:allocation`: (length, flags) descriptors.
    pub fn block_status(
        &mut self,
        offset: u64,
        len: u64,
        flags: CmdFlags,
    ) -> Result<Vec<(u64, u64)>, ClientError> {
        if self.meta_id.is_none() {
            return Err(ClientError::Unexpected(
                "base:allocation was not negotiated".into(),
            ));
        }
        let req = Request::new(Command::BlockStatus, 0, offset, len).with_flags(flags);
        Ok(self.request(req, &[])?.extents)
    }

    /// The contexts the handshake selected: (id, name).
    pub fn contexts(&self) -> &[(u32, String)] {
        &self.contexts
    }

    /// Block status of every selected context: (context name, (length, flags) descriptors),
    /// in the order of the reply's chunks. A chunk for an id the handshake did not give is
    /// an error.
    pub fn block_status_all(
        &mut self,
        offset: u64,
        len: u64,
        flags: CmdFlags,
    ) -> Result<Vec<ContextStatus>, ClientError> {
        let req = Request::new(Command::BlockStatus, 0, offset, len).with_flags(flags);
        let reply = self.request(req, &[])?;
        let mut out = Vec::with_capacity(reply.contexts.len());
        for (id, extents) in reply.contexts {
            let Some((_, name)) = self.contexts.iter().find(|(i, _)| *i == id) else {
                return Err(ClientError::Unexpected(format!(
                    "block status for context id {id}, which the handshake did not select"
                )));
            };
            out.push((name.clone(), extents));
        }
        Ok(out)
    }

    /// Sends `NBD_CMD_DISC` and closes.
    pub fn disconnect(mut self) -> Result<(), ClientError> {
        self.send(Request::new(Command::Disc, 0, 0, 0), &[])?;
        Ok(())
    }
}
