//! [`Handshake`]: option haggling, client side, one option at a time (so tests can send
//! anything, including options a real client would not), under one deadline for the whole
//! exchange, with every reply bounded ([`MAX_OPTION_REPLIES`], [`MAX_OPTION_REPLY_BYTES`]).

use std::io::{Read, Write};
use std::time::Instant;

use crate::stream::{Stream, Until};
use nbd_proto::handshake::{
    decode_export_name_reply, decode_option_reply_header, decode_server_greeting,
    encode_client_flags, parse_option_reply, BlockSize, ClientOption, ExportRequest, Info,
    MetaContextRequest, OptionReply, DEFAULT_MAX_OPTION_REPLY_LEN,
};
use nbd_proto::proto::{
    ClientFlags, HandshakeFlags, InfoType, TransmissionFlags, TransmissionMode, NBD_OPT_ABORT,
    OPTION_REPLY_HEADER_LEN,
};
use nbd_proto::Decoded;

use super::error::ClientError;

/// Most non-final replies the client accepts to one option: a server that sends more is
/// answering nothing this client asked (a list of exports, a few details of one, the contexts
/// of a query), and is refused rather than followed for ever.
pub const MAX_OPTION_REPLIES: usize = 1024;

/// Most bytes of reply data the client accepts to one option, its replies together.
pub const MAX_OPTION_REPLY_BYTES: u64 = 1 << 20;
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

/// What the transmission phase starts from: the socket, the mode, the `base:allocation`
/// context's id and the selected contexts (id, name).
pub(super) type Transmission = (Stream, TransmissionMode, Option<u32>, Vec<(u32, String)>);

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
        let mut g = [0u8; nbd_proto::proto::SERVER_GREETING_LEN];
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
            if nbd_proto::proto::is_option_error(reply_type) {
                return Err(ClientError::OptionRefused {
                    option,
                    reply_type,
                    message: String::from_utf8_lossy(&self.rbuf).into_owned(),
                });
            }
            if reply_type == nbd_proto::proto::NBD_REP_ACK {
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
        self.stream
            .connect_tls(config, server_name, self.deadline)?;
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
    /// [`Client`](super::Client) with [`into_client`](Self::into_client). On an error reply the handshake goes
    /// on.
    pub fn go(&mut self, name: &str) -> Result<ExportDetails, ClientError> {
        self.info_or_go(name, true)
    }

    /// What the transmission phase starts from, after a successful [`go`](Self::go): the
    /// socket, the mode, the `base:allocation` id and the selected contexts
    /// ([`Handshake::into_client`] makes the [`Client`](super::Client)).
    pub(super) fn into_transmission(self) -> Transmission {
        (self.stream, self.mode, self.meta_id, self.contexts)
    }

    /// The socket and the negotiated transmission mode, after a successful [`go`](Self::go):
    /// for a caller that runs the transmission phase itself (the remote device splits the
    /// socket between its submitters and one receiver thread).
    pub fn into_parts(self) -> (Stream, TransmissionMode) {
        (self.stream, self.mode)
    }

    /// `NBD_OPT_EXPORT_NAME`, up to the export's details: the transmission phase has begun
    /// (the server closes the connection if the export does not exist).
    pub(super) fn enter_by_name(
        mut self,
        name: &str,
    ) -> Result<(Self, ExportDetails), ClientError> {
        self.send_option(&ClientOption::ExportName(name))?;
        let want = if self.no_zeroes {
            nbd_proto::proto::EXPORT_NAME_REPLY_SHORT_LEN
        } else {
            nbd_proto::proto::EXPORT_NAME_REPLY_LEN
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
        Ok((self, d))
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
