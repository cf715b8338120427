//! A small blocking NBD client on top of the codec.
//!
//! [`Handshake`] drives option haggling one option at a time (so tests can send anything,
//! including options a real client would not); [`Client`] is the transmission phase, with
//! pipelining ([`Client::send`] many requests, then [`Client::recv`] their replies in any order)
//! and blocking helpers ([`Client::read`], [`Client::write`], ...). It is meant for tests and
//! tools now, and as the transport of a remote RAID leg later.

use std::collections::HashMap;
use std::io::{self, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::Instant;

use crate::coverage::Coverage;
use crate::handshake::{
    decode_export_name_reply, decode_option_reply_header, decode_server_greeting,
    encode_client_flags, parse_option_reply, BlockSize, ClientOption, ExportRequest, Info,
    MetaContextRequest, OptionReply, DEFAULT_MAX_OPTION_REPLY_LEN,
};
use crate::proto::{
    ClientFlags, CmdFlags, Command, HandshakeFlags, InfoType, TransmissionFlags, TransmissionMode,
    NBD_OPT_ABORT, OPTION_REPLY_HEADER_LEN,
};
use crate::stream::{Stream, Until};
use crate::transmission::{decode_reply_header, parse_chunk, Chunk, ReplyHeader, Request};
use crate::Decoded;

/// Most non-final replies the client accepts to one option: a server that sends more is
/// answering nothing this client asked (a list of exports, a few details of one, the contexts
/// of a query), and is refused rather than followed for ever.
pub const MAX_OPTION_REPLIES: usize = 1024;

/// Most bytes of reply data the client accepts to one option, its replies together.
pub const MAX_OPTION_REPLY_BYTES: u64 = 1 << 20;

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
                Stream::Tcp(s)
            }
            Endpoint::Unix(p) => Stream::Unix(UnixStream::connect(p)?),
        })
    }
}

/// Errors of the client.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    /// The socket failed (or the server closed it).
    #[error("I/O error: {0}")]
    Io(#[from] io::Error),
    /// The server sent something the codec rejects.
    #[error("protocol error: {0}")]
    Protocol(#[from] crate::Error),
    /// An option was answered with an error reply.
    #[error(
        "option {} refused with {}: {message}",
        option_name(*option),
        option_error_name(*reply_type)
    )]
    OptionRefused {
        /// The option.
        option: u32,
        /// The raw error reply type (`NBD_REP_ERR_*`).
        reply_type: u32,
        /// The server's message.
        message: String,
    },
    /// A request was answered with an error.
    #[error("the server answered error {}", request_error_name(*.0))]
    Request(u32),
    /// The server did something this client does not expect.
    #[error("unexpected reply: {0}")]
    Unexpected(String),
}

/// An option code by its name (`NBD_OPT_GO (7)`), or its number when unknown.
fn option_name(option: u32) -> String {
    match crate::proto::option_name(option) {
        "unknown" => option.to_string(),
        name => format!("{name} ({option})"),
    }
}

/// An option error reply by its name and meaning (`NBD_REP_ERR_UNKNOWN (no such export)`), or
/// its number when unknown.
fn option_error_name(reply_type: u32) -> String {
    match crate::proto::option_error_name(reply_type) {
        Some((name, meaning)) => format!("{name} ({meaning})"),
        None => format!("reply type {reply_type:#x}"),
    }
}

/// A request's error by its name (`NBD_EIO (5)`), or its number when unknown.
fn request_error_name(e: u32) -> String {
    match crate::proto::error_name(e) {
        "unknown" => e.to_string(),
        name => format!("{name} ({e})"),
    }
}

impl ClientError {
    /// The NBD error value of a failed request, if that is what this is.
    pub fn nbd_error(&self) -> Option<u32> {
        match self {
            ClientError::Request(e) => Some(*e),
            _ => None,
        }
    }

    /// The option error reply type, if an option was refused.
    pub fn option_error(&self) -> Option<u32> {
        match self {
            ClientError::OptionRefused { reply_type, .. } => Some(*reply_type),
            _ => None,
        }
    }
}

/// One option reply, owned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OptionReplyMsg {
    /// The option it answers.
    pub option: u32,
    /// The raw reply type.
    pub reply_type: u32,
    /// The reply data.
    pub data: Vec<u8>,
}

/// What `NBD_OPT_INFO` / `NBD_OPT_GO` / `NBD_OPT_EXPORT_NAME` said about an export.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExportDetails {
    /// Size in bytes.
    pub size: u64,
    /// Transmission flags.
    pub flags: TransmissionFlags,
    /// Block size constraints, if sent.
    pub block_size: Option<BlockSize>,
    /// Canonical name, if sent.
    pub name: Option<String>,
    /// Description, if sent.
    pub description: Option<String>,
}

/// Option haggling, client side.
pub struct Handshake {
    stream: Stream,
    server_flags: HandshakeFlags,
    no_zeroes: bool,
    mode: TransmissionMode,
    meta_id: Option<u32>,
    /// The contexts the last SET selected: (id, name).
    contexts: Vec<(u32, String)>,
    buf: Vec<u8>,
    /// The option reply being read (one at a time).
    rbuf: Vec<u8>,
    /// When the whole handshake must be over (see [`Handshake::start_by`]).
    deadline: Option<Instant>,
}

impl Handshake {
    /// Reads the greeting and answers with client flags (fixed newstyle, and no zeroes when
    /// offered).
    pub fn start(stream: Stream) -> Result<Self, ClientError> {
        Self::start_by(stream, None)
    }

    /// [`start`](Self::start), with the whole handshake (this greeting, every option and
    /// reply, the TLS handshake) bounded by `deadline`: every read and write first sets what
    /// is left of it as the socket's timeouts, so a server that trickles its bytes runs out of
    /// time like a silent one (an I/O error of kind `TimedOut`). The socket's timeouts are left
    /// at whatever was left; the caller sets its own once the handshake is over.
    pub fn start_by(mut stream: Stream, deadline: Option<Instant>) -> Result<Self, ClientError> {
        let mut g = [0u8; crate::proto::SERVER_GREETING_LEN];
        Until {
            sock: &mut stream,
            deadline,
        }
        .read_exact(&mut g)?;
        let server_flags = match decode_server_greeting(&g)? {
            Decoded::Complete { value, .. } => value,
            Decoded::Incomplete(_) => return Err(ClientError::Unexpected("short greeting".into())),
        };
        let no_zeroes = server_flags.contains(HandshakeFlags::NO_ZEROES);
        let mut flags = ClientFlags::FIXED_NEWSTYLE;
        if no_zeroes {
            flags |= ClientFlags::NO_ZEROES;
        }
        let mut out = Vec::new();
        encode_client_flags(flags, &mut out);
        Until {
            sock: &mut stream,
            deadline,
        }
        .write_all(&out)?;
        Ok(Self {
            stream,
            server_flags,
            no_zeroes,
            mode: TransmissionMode::Simple,
            meta_id: None,
            contexts: Vec::new(),
            buf: Vec::new(),
            rbuf: Vec::new(),
            deadline,
        })
    }

    /// The server's handshake flags.
    pub fn server_flags(&self) -> HandshakeFlags {
        self.server_flags
    }

    /// The socket (to send raw bytes in tests).
    pub fn stream(&mut self) -> &mut Stream {
        &mut self.stream
    }

    /// The socket, bounded by the handshake's deadline.
    fn io(&mut self) -> Until<&mut Stream> {
        Until {
            sock: &mut self.stream,
            deadline: self.deadline,
        }
    }

    /// Sends one option.
    pub fn send_option(&mut self, opt: &ClientOption<'_>) -> Result<(), ClientError> {
        self.buf.clear();
        opt.encode(&mut self.buf)?;
        Until {
            sock: &mut self.stream,
            deadline: self.deadline,
        }
        .write_all(&self.buf)?;
        Ok(())
    }

    /// Reads one option reply.
    pub fn read_reply(&mut self) -> Result<OptionReplyMsg, ClientError> {
        let (option, reply_type) = self.read_reply_data()?;
        Ok(OptionReplyMsg {
            option,
            reply_type,
            data: self.rbuf.clone(),
        })
    }

    /// Reads one option reply's header, and its data into `rbuf` (reused: one reply's worth,
    /// at most [`DEFAULT_MAX_OPTION_REPLY_LEN`]); returns (option, reply type).
    fn read_reply_data(&mut self) -> Result<(u32, u32), ClientError> {
        let mut h = [0u8; OPTION_REPLY_HEADER_LEN];
        self.io().read_exact(&mut h)?;
        let header = match decode_option_reply_header(&h, DEFAULT_MAX_OPTION_REPLY_LEN)? {
            Decoded::Complete { value, .. } => value,
            Decoded::Incomplete(_) => return Err(ClientError::Unexpected("short reply".into())),
        };
        self.rbuf.clear();
        self.rbuf.resize(header.length as usize, 0);
        Until {
            sock: &mut self.stream,
            deadline: self.deadline,
        }
        .read_exact(&mut self.rbuf)?;
        Ok((header.option, header.reply_type))
    }

    /// Sends an option and reads replies up to the final one (an ACK or an error), handing
    /// each non-final reply to `each` (reply type, data) as it arrives: nothing is kept
    /// here. An error reply becomes [`ClientError::OptionRefused`]. A server that sends more
    /// than [`MAX_OPTION_REPLIES`] replies, or more than [`MAX_OPTION_REPLY_BYTES`] bytes of
    /// reply data, to one option is a protocol error ([`ClientError::Unexpected`]): no
    /// option this client sends has a legitimate answer that long.
    pub fn option_each(
        &mut self,
        opt: &ClientOption<'_>,
        mut each: impl FnMut(u32, &[u8]) -> Result<(), ClientError>,
    ) -> Result<(), ClientError> {
        self.send_option(opt)?;
        let (mut replies, mut bytes) = (0usize, 0u64);
        loop {
            let (option, reply_type) = self.read_reply_data()?;
            if option != opt.option() {
                return Err(ClientError::Unexpected(format!(
                    "reply to option {option} while waiting for {}",
                    opt.option()
                )));
            }
            if crate::proto::is_option_error(reply_type) {
                return Err(ClientError::OptionRefused {
                    option,
                    reply_type,
                    message: String::from_utf8_lossy(&self.rbuf).into_owned(),
                });
            }
            if reply_type == crate::proto::NBD_REP_ACK {
                return Ok(());
            }
            replies += 1;
            bytes += self.rbuf.len() as u64;
            if replies > MAX_OPTION_REPLIES || bytes > MAX_OPTION_REPLY_BYTES {
                return Err(ClientError::Unexpected(format!(
                    "option {option} drew more than {MAX_OPTION_REPLIES} replies or \
                     {MAX_OPTION_REPLY_BYTES} bytes of replies ({replies} replies, {bytes} \
                     bytes so far)"
                )));
            }
            each(reply_type, &self.rbuf)?;
        }
    }

    /// Sends an option and reads replies up to the final one (an ACK or an error), returning
    /// the non-final ones (bounded as [`option_each`](Self::option_each) says); an error
    /// reply becomes [`ClientError::OptionRefused`].
    pub fn option(&mut self, opt: &ClientOption<'_>) -> Result<Vec<OptionReplyMsg>, ClientError> {
        let mut out = Vec::new();
        let option = opt.option();
        self.option_each(opt, |reply_type, data| {
            out.push(OptionReplyMsg {
                option,
                reply_type,
                data: data.to_vec(),
            });
            Ok(())
        })?;
        Ok(out)
    }

    /// `NBD_OPT_STARTTLS`, then the TLS handshake (`config` from [`crate::tls::client_config`];
    /// `server_name` is checked against the server certificate). Everything after speaks TLS.
    pub fn start_tls(
        &mut self,
        config: &blkq_sync::DynArc<rustls::ClientConfig>,
        server_name: &str,
    ) -> Result<(), ClientError> {
        self.option(&ClientOption::StartTls)?;
        crate::tls::connect_by(&mut self.stream, config, server_name, self.deadline)?;
        Ok(())
    }

    /// `NBD_OPT_LIST`: (name, description) of every export.
    pub fn list(&mut self) -> Result<Vec<(String, String)>, ClientError> {
        let mut out = Vec::new();
        self.option_each(&ClientOption::List, |reply_type, data| {
            match parse_option_reply(reply_type, data)? {
                OptionReply::Server { name, details } => {
                    out.push((name.to_string(), details.to_string()))
                }
                other => return Err(ClientError::Unexpected(format!("{other:?} in a list"))),
            }
            Ok(())
        })?;
        Ok(out)
    }

    /// `NBD_OPT_STRUCTURED_REPLY`.
    pub fn structured_replies(&mut self) -> Result<(), ClientError> {
        self.option(&ClientOption::StructuredReply)?;
        if self.mode == TransmissionMode::Simple {
            self.mode = TransmissionMode::Structured;
        }
        Ok(())
    }

    /// `NBD_OPT_EXTENDED_HEADERS`.
    pub fn extended_headers(&mut self) -> Result<(), ClientError> {
        self.option(&ClientOption::ExtendedHeaders)?;
        self.mode = TransmissionMode::Extended;
        Ok(())
    }

    /// `NBD_OPT_SET_META_CONTEXT` (or LIST with `set == false`): the (id, name) pairs replied.
    pub fn meta_context(
        &mut self,
        export: &str,
        queries: &[&str],
        set: bool,
    ) -> Result<Vec<(u32, String)>, ClientError> {
        let req = MetaContextRequest {
            name: export,
            queries: queries.to_vec(),
        };
        let opt = if set {
            ClientOption::SetMetaContext(req)
        } else {
            ClientOption::ListMetaContext(req)
        };
        let mut out = Vec::new();
        self.option_each(&opt, |reply_type, data| {
            match parse_option_reply(reply_type, data)? {
                OptionReply::MetaContext { id, name } => out.push((id, name.to_string())),
                other => return Err(ClientError::Unexpected(format!("{other:?} for a context"))),
            }
            Ok(())
        })?;
        if set {
            self.meta_id = out
                .iter()
                .find(|(_, n)| n == "base:allocation")
                .map(|(id, _)| *id);
            self.contexts = out.clone();
        }
        Ok(out)
    }

    fn info_or_go(&mut self, name: &str, go: bool) -> Result<ExportDetails, ClientError> {
        let req = ExportRequest::new(
            name,
            &[InfoType::Name, InfoType::Description, InfoType::BlockSize],
        );
        let opt = if go {
            ClientOption::Go(req)
        } else {
            ClientOption::Info(req)
        };
        let mut d = ExportDetails::default();
        let mut have_export = false;
        self.option_each(&opt, |reply_type, data| {
            if let OptionReply::Info(i) = parse_option_reply(reply_type, data)? {
                match i {
                    Info::Export(e) => {
                        d.size = e.size;
                        d.flags = e.flags;
                        have_export = true;
                    }
                    Info::Name(n) => d.name = Some(n.to_string()),
                    Info::Description(s) => d.description = Some(s.to_string()),
                    Info::BlockSize(b) => d.block_size = Some(b),
                    _ => {}
                }
            }
            Ok(())
        })?;
        if !have_export {
            return Err(ClientError::Unexpected("no NBD_INFO_EXPORT".into()));
        }
        Ok(d)
    }

    /// `NBD_OPT_INFO`.
    pub fn info(&mut self, name: &str) -> Result<ExportDetails, ClientError> {
        self.info_or_go(name, false)
    }

    /// `NBD_OPT_GO`. On success the transmission phase has begun: turn the handshake into a
    /// [`Client`] with [`into_client`](Self::into_client). On an error reply the handshake goes
    /// on.
    pub fn go(&mut self, name: &str) -> Result<ExportDetails, ClientError> {
        self.info_or_go(name, true)
    }

    /// The transmission phase, after a successful [`go`](Self::go).
    pub fn into_client(self, details: ExportDetails) -> Result<Client, ClientError> {
        Client::new(self.stream, self.mode, details, self.meta_id, self.contexts)
    }

    /// The socket and the negotiated transmission mode, after a successful [`go`](Self::go):
    /// for a caller that runs the transmission phase itself (the remote device splits the
    /// socket between its submitters and one receiver thread).
    pub fn into_parts(self) -> (Stream, TransmissionMode) {
        (self.stream, self.mode)
    }

    /// `NBD_OPT_EXPORT_NAME`: enters transmission (the server closes the connection if the
    /// export does not exist).
    pub fn export_name(mut self, name: &str) -> Result<Client, ClientError> {
        self.send_option(&ClientOption::ExportName(name))?;
        let want = if self.no_zeroes {
            crate::proto::EXPORT_NAME_REPLY_SHORT_LEN
        } else {
            crate::proto::EXPORT_NAME_REPLY_LEN
        };
        let mut b = vec![0u8; want];
        self.io().read_exact(&mut b)?;
        let info = match decode_export_name_reply(&b, self.no_zeroes)? {
            Decoded::Complete { value, .. } => value,
            Decoded::Incomplete(_) => return Err(ClientError::Unexpected("short reply".into())),
        };
        let d = ExportDetails {
            size: info.size,
            flags: info.flags,
            ..ExportDetails::default()
        };
        Client::new(self.stream, self.mode, d, self.meta_id, self.contexts)
    }

    /// `NBD_OPT_ABORT`, then closes.
    pub fn abort(mut self) -> Result<(), ClientError> {
        self.send_option(&ClientOption::Other {
            option: NBD_OPT_ABORT,
            data: &[],
        })?;
        // The reply is optional; a closed socket is fine too.
        let _ = self.read_reply();
        Ok(())
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
                .extend_from_slice(&crate::proto::NBD_EXTENDED_REQUEST_MAGIC.to_be_bytes());
        } else {
            self.out
                .extend_from_slice(&crate::proto::NBD_REQUEST_MAGIC.to_be_bytes());
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::{NBD_EIO, NBD_OPT_GO, NBD_REP_ERR_TLS_REQD, NBD_REP_ERR_UNKNOWN};

    #[test]
    fn refusals_name_the_option_and_the_reply_type() {
        let e = ClientError::OptionRefused {
            option: NBD_OPT_GO,
            reply_type: NBD_REP_ERR_UNKNOWN,
            message: "no export \"x\"".into(),
        }
        .to_string();
        assert!(
            e.contains("NBD_OPT_GO")
                && e.contains("NBD_REP_ERR_UNKNOWN")
                && e.contains("no such export"),
            "{e}"
        );
        let e = ClientError::OptionRefused {
            option: NBD_OPT_GO,
            reply_type: NBD_REP_ERR_TLS_REQD,
            message: String::new(),
        }
        .to_string();
        assert!(
            e.contains("NBD_REP_ERR_TLS_REQD") && e.contains("TLS"),
            "{e}"
        );
        // An unknown one keeps its number.
        let e = ClientError::OptionRefused {
            option: 99,
            reply_type: 0x8000_00ff,
            message: String::new(),
        }
        .to_string();
        assert!(e.contains("99") && e.contains("0x800000ff"), "{e}");
        let e = ClientError::Request(NBD_EIO).to_string();
        assert!(e.contains("NBD_EIO"), "{e}");
    }
}
