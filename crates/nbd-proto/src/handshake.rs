//! The handshake phase: greeting, client flags, options and option replies.
//!
//! Server side: [`encode_server_greeting`], [`decode_client_flags`], [`decode_option_header`] +
//! [`parse_option`], [`encode_option_reply`] and [`encode_export_name_reply`].
//!
//! Client side: [`decode_server_greeting`], [`encode_client_flags`], [`ClientOption::encode`],
//! [`decode_option_reply_header`] + [`parse_option_reply`] and [`decode_export_name_reply`].
//!
//! Only fixed newstyle negotiation is implemented (the oldstyle greeting is recognised and
//! rejected with [`Error::OldstyleNegotiation`]).

use crate::proto::{
    is_option_error, ClientFlags, HandshakeFlags, InfoType, OptionCode, OptionError,
    TransmissionFlags, EXPORT_NAME_REPLY_LEN, EXPORT_NAME_REPLY_SHORT_LEN, IHAVEOPT, NBDMAGIC,
    NBD_CLISERV_MAGIC, NBD_INFO_BLOCK_SIZE, NBD_INFO_DESCRIPTION, NBD_INFO_EXPORT, NBD_INFO_NAME,
    NBD_OPT_ABORT, NBD_OPT_EXPORT_NAME, NBD_OPT_EXTENDED_HEADERS, NBD_OPT_GO, NBD_OPT_INFO,
    NBD_OPT_LIST, NBD_OPT_LIST_META_CONTEXT, NBD_OPT_SET_META_CONTEXT, NBD_OPT_STARTTLS,
    NBD_OPT_STRUCTURED_REPLY, NBD_REP_ACK, NBD_REP_INFO, NBD_REP_MAGIC, NBD_REP_META_CONTEXT,
    NBD_REP_SERVER, OPTION_HEADER_LEN, OPTION_REPLY_HEADER_LEN, SERVER_GREETING_LEN,
};
use crate::wire::{append, check_str, len_u32, parse_str, Reader, Writer};
use crate::{Decoded, Error};

/// A default for the largest option data a server accepts: room for an `NBD_OPT_GO` with a
/// maximal name and every information request, or a metadata context request with a dozen
/// maximal queries.
pub const DEFAULT_MAX_OPTION_LEN: u32 = 64 * 1024;

/// A default for the largest option reply data a client accepts.
pub const DEFAULT_MAX_OPTION_REPLY_LEN: u32 = 64 * 1024;

// ---------------------------------------------------------------------------------------------
// Greeting and client flags.
// ---------------------------------------------------------------------------------------------

/// Appends the newstyle greeting ([`SERVER_GREETING_LEN`] bytes): `NBDMAGIC`, `IHAVEOPT` and
/// the handshake flags.
pub fn encode_server_greeting(flags: HandshakeFlags, out: &mut Vec<u8>) {
    out.extend_from_slice(&NBDMAGIC.to_be_bytes());
    out.extend_from_slice(&IHAVEOPT.to_be_bytes());
    out.extend_from_slice(&flags.bits().to_be_bytes());
}

/// Decodes the server greeting (client side). Bad magics are reported as soon as the bytes that
/// carry them are present; an oldstyle greeting gives [`Error::OldstyleNegotiation`]. Unknown
/// handshake flags are kept (a client should ignore them).
pub fn decode_server_greeting(buf: &[u8]) -> Result<Decoded<HandshakeFlags>, Error> {
    let mut r = Reader::new(buf);
    let Some(magic) = r.u64() else {
        return Ok(Decoded::Incomplete(SERVER_GREETING_LEN));
    };
    if magic != NBDMAGIC {
        return Err(Error::BadMagic {
            expected: NBDMAGIC,
            found: magic,
        });
    }
    let Some(magic) = r.u64() else {
        return Ok(Decoded::Incomplete(SERVER_GREETING_LEN));
    };
    if magic == NBD_CLISERV_MAGIC {
        return Err(Error::OldstyleNegotiation);
    }
    if magic != IHAVEOPT {
        return Err(Error::BadMagic {
            expected: IHAVEOPT,
            found: magic,
        });
    }
    let Some(flags) = r.u16() else {
        return Ok(Decoded::Incomplete(SERVER_GREETING_LEN));
    };
    Ok(Decoded::Complete {
        value: HandshakeFlags::from_bits(flags),
        consumed: SERVER_GREETING_LEN,
    })
}

/// Appends the 32-bit client flags.
pub fn encode_client_flags(flags: ClientFlags, out: &mut Vec<u8>) {
    out.extend_from_slice(&flags.bits().to_be_bytes());
}

/// Decodes the client flags (server side) and checks them against the handshake flags the
/// server `offered`: a client flag the server does not know, or one whose handshake
/// counterpart was not offered, gives [`Error::UnsupportedClientFlags`] (the server must then
/// drop the connection).
pub fn decode_client_flags(
    buf: &[u8],
    offered: HandshakeFlags,
) -> Result<Decoded<ClientFlags>, Error> {
    let Some(raw) = Reader::new(buf).u32() else {
        return Ok(Decoded::Incomplete(4));
    };
    // Client flag bit n answers handshake flag bit n.
    let allowed = u32::from(offered.bits()) & ClientFlags::KNOWN.bits();
    if raw & !allowed != 0 {
        return Err(Error::UnsupportedClientFlags { flags: raw });
    }
    Ok(Decoded::Complete {
        value: ClientFlags::from_bits(raw),
        consumed: 4,
    })
}

// ---------------------------------------------------------------------------------------------
// Options (client to server).
// ---------------------------------------------------------------------------------------------

/// The fixed part of an option: `IHAVEOPT`, the option code and its data length.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct OptionHeader {
    /// The raw option code (unknown codes must be answered with `NBD_REP_ERR_UNSUP`).
    pub option: u32,
    /// Bytes of option data following the header.
    pub length: u32,
}

impl OptionHeader {
    /// The typed option code, if known.
    pub fn code(&self) -> Option<OptionCode> {
        OptionCode::from_u32(self.option)
    }

    /// Appends the [`OPTION_HEADER_LEN`]-byte header.
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&IHAVEOPT.to_be_bytes());
        out.extend_from_slice(&self.option.to_be_bytes());
        out.extend_from_slice(&self.length.to_be_bytes());
    }
}

/// Decodes an option header (server side).
///
/// A wrong magic is reported as soon as its 8 bytes are present. A length above `max_len`
/// gives [`Error::OptionTooLong`] without waiting for the data (which has not been consumed).
/// On success, `consumed` is [`OPTION_HEADER_LEN`]; the option's `length` bytes of data follow
/// and go to [`parse_option`].
pub fn decode_option_header(buf: &[u8], max_len: u32) -> Result<Decoded<OptionHeader>, Error> {
    let mut r = Reader::new(buf);
    let Some(magic) = r.u64() else {
        return Ok(Decoded::Incomplete(OPTION_HEADER_LEN));
    };
    if magic != IHAVEOPT {
        return Err(Error::BadMagic {
            expected: IHAVEOPT,
            found: magic,
        });
    }
    let (Some(option), Some(length)) = (r.u32(), r.u32()) else {
        return Ok(Decoded::Incomplete(OPTION_HEADER_LEN));
    };
    if length > max_len {
        return Err(Error::OptionTooLong {
            option,
            length,
            max: max_len,
        });
    }
    Ok(Decoded::Complete {
        value: OptionHeader { option, length },
        consumed: OPTION_HEADER_LEN,
    })
}

/// The data of `NBD_OPT_INFO` and `NBD_OPT_GO`: an export name and information requests.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct ExportRequest<'a> {
    /// The export name (empty: the default export).
    pub name: &'a str,
    /// The raw information types requested, in order (unknown ones must be ignored by the
    /// server, so they are kept raw).
    pub info: Vec<u16>,
}

impl<'a> ExportRequest<'a> {
    /// A request for `name` asking for the information types `info`.
    pub fn new(name: &'a str, info: &[InfoType]) -> Self {
        Self {
            name,
            info: info.iter().map(|t| t.as_u16()).collect(),
        }
    }

    /// Whether the client asked for information type `t`.
    pub fn requests(&self, t: InfoType) -> bool {
        self.info.contains(&t.as_u16())
    }

    fn data_len(&self) -> usize {
        4 + self.name.len() + 2 + 2 * self.info.len()
    }

    fn check(&self) -> Result<(), Error> {
        check_str("export name", self.name)?;
        if self.info.len() > usize::from(u16::MAX) {
            return Err(Error::ValueTooLarge {
                field: "information request count",
                value: self.info.len() as u64,
                max: u64::from(u16::MAX),
            });
        }
        Ok(())
    }

    fn write(&self, w: &mut Writer<'_>) {
        w.u32(self.name.len() as u32);
        w.bytes(self.name.as_bytes());
        w.u16(self.info.len() as u16);
        for &t in &self.info {
            w.u16(t);
        }
    }

    fn parse(option: u32, data: &'a [u8]) -> Result<Self, Error> {
        let invalid = |reason| Error::InvalidOption { option, reason };
        if data.len() < 6 {
            return Err(invalid("shorter than 6 bytes"));
        }
        let mut r = Reader::new(data);
        let name_len = r.u32().ok_or(invalid("shorter than 6 bytes"))?;
        // The name length MUST be no larger than the option data length - 6.
        if u64::from(name_len) > (data.len() - 6) as u64 {
            return Err(invalid("export name longer than the option"));
        }
        let name = r
            .take(name_len as usize)
            .ok_or(invalid("export name longer than the option"))?;
        let name = parse_str("export name", name)?;
        let count = r
            .u16()
            .ok_or(invalid("missing information request count"))?;
        if r.remaining() != 2 * usize::from(count) {
            return Err(invalid(
                "information request count inconsistent with the option length",
            ));
        }
        let mut info = Vec::with_capacity(usize::from(count));
        while let Some(t) = r.u16() {
            info.push(t);
        }
        Ok(Self { name, info })
    }
}

/// The data of `NBD_OPT_LIST_META_CONTEXT` and `NBD_OPT_SET_META_CONTEXT`: an export name and
/// metadata context queries.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct MetaContextRequest<'a> {
    /// The export name.
    pub name: &'a str,
    /// The queries (each should be `namespace:leaf`; not checked here).
    pub queries: Vec<&'a str>,
}

impl<'a> MetaContextRequest<'a> {
    fn data_len(&self) -> usize {
        4 + self.name.len() + 4 + self.queries.iter().map(|q| 4 + q.len()).sum::<usize>()
    }

    fn check(&self) -> Result<(), Error> {
        check_str("export name", self.name)?;
        for q in &self.queries {
            check_str("metadata context query", q)?;
        }
        len_u32("metadata context query count", self.queries.len()).map(drop)
    }

    fn write(&self, w: &mut Writer<'_>) {
        w.u32(self.name.len() as u32);
        w.bytes(self.name.as_bytes());
        w.u32(self.queries.len() as u32);
        for q in &self.queries {
            w.u32(q.len() as u32);
            w.bytes(q.as_bytes());
        }
    }

    fn parse(option: u32, data: &'a [u8]) -> Result<Self, Error> {
        let invalid = |reason| Error::InvalidOption { option, reason };
        if data.len() < 8 {
            return Err(invalid("shorter than 8 bytes"));
        }
        let mut r = Reader::new(data);
        let name_len = r.u32().ok_or(invalid("shorter than 8 bytes"))?;
        if u64::from(name_len) > (data.len() - 8) as u64 {
            return Err(invalid("export name longer than the option"));
        }
        let name = r
            .take(name_len as usize)
            .ok_or(invalid("export name longer than the option"))?;
        let name = parse_str("export name", name)?;
        let count = r.u32().ok_or(invalid("missing query count"))?;
        // Every query takes at least its 4-byte length.
        if u64::from(count) > (r.remaining() / 4) as u64 {
            return Err(invalid("query count inconsistent with the option length"));
        }
        let mut queries = Vec::with_capacity(count as usize);
        for _ in 0..count {
            let len = r.u32().ok_or(invalid("query length beyond the option"))?;
            let bytes = r
                .take(len as usize)
                .ok_or(invalid("query longer than the option"))?;
            queries.push(parse_str("metadata context query", bytes)?);
        }
        if r.remaining() != 0 {
            return Err(invalid("trailing bytes after the queries"));
        }
        Ok(Self { name, queries })
    }
}

/// An option with its parsed data, borrowing strings from the input.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ClientOption<'a> {
    /// `NBD_OPT_EXPORT_NAME` with the export name (empty: the default export).
    ExportName(&'a str),
    /// `NBD_OPT_ABORT` (any data is ignored, as the specification asks of servers).
    Abort,
    /// `NBD_OPT_LIST`.
    List,
    /// `NBD_OPT_STARTTLS`.
    StartTls,
    /// `NBD_OPT_INFO`.
    Info(ExportRequest<'a>),
    /// `NBD_OPT_GO`.
    Go(ExportRequest<'a>),
    /// `NBD_OPT_STRUCTURED_REPLY`.
    StructuredReply,
    /// `NBD_OPT_LIST_META_CONTEXT`.
    ListMetaContext(MetaContextRequest<'a>),
    /// `NBD_OPT_SET_META_CONTEXT`.
    SetMetaContext(MetaContextRequest<'a>),
    /// `NBD_OPT_EXTENDED_HEADERS`.
    ExtendedHeaders,
    /// An option code this crate does not parse, with its raw data. A server answers
    /// `NBD_REP_ERR_UNSUP`. (A client may also use this to send arbitrary data.)
    Other {
        /// The raw option code.
        option: u32,
        /// The raw data.
        data: &'a [u8],
    },
}

impl ClientOption<'_> {
    /// The raw option code.
    pub fn option(&self) -> u32 {
        match self {
            ClientOption::ExportName(_) => NBD_OPT_EXPORT_NAME,
            ClientOption::Abort => NBD_OPT_ABORT,
            ClientOption::List => NBD_OPT_LIST,
            ClientOption::StartTls => NBD_OPT_STARTTLS,
            ClientOption::Info(_) => NBD_OPT_INFO,
            ClientOption::Go(_) => NBD_OPT_GO,
            ClientOption::StructuredReply => NBD_OPT_STRUCTURED_REPLY,
            ClientOption::ListMetaContext(_) => NBD_OPT_LIST_META_CONTEXT,
            ClientOption::SetMetaContext(_) => NBD_OPT_SET_META_CONTEXT,
            ClientOption::ExtendedHeaders => NBD_OPT_EXTENDED_HEADERS,
            ClientOption::Other { option, .. } => *option,
        }
    }

    /// Bytes of option data (after the header).
    pub fn data_len(&self) -> usize {
        match self {
            ClientOption::ExportName(name) => name.len(),
            ClientOption::Info(r) | ClientOption::Go(r) => r.data_len(),
            ClientOption::ListMetaContext(r) | ClientOption::SetMetaContext(r) => r.data_len(),
            ClientOption::Other { data, .. } => data.len(),
            ClientOption::Abort
            | ClientOption::List
            | ClientOption::StartTls
            | ClientOption::StructuredReply
            | ClientOption::ExtendedHeaders => 0,
        }
    }

    /// Appends the option, header included (client side). Strings are checked against the
    /// protocol's limits; on error nothing is appended.
    pub fn encode(&self, out: &mut Vec<u8>) -> Result<(), Error> {
        match self {
            ClientOption::ExportName(name) => check_str("export name", name)?,
            ClientOption::Info(r) | ClientOption::Go(r) => r.check()?,
            ClientOption::ListMetaContext(r) | ClientOption::SetMetaContext(r) => r.check()?,
            _ => {}
        }
        let data_len = self.data_len();
        let length = len_u32("option length", data_len)?;
        let total = OPTION_HEADER_LEN + data_len;
        append(out, total, |buf| {
            let mut w = Writer::new(buf, total)?;
            w.u64(IHAVEOPT);
            w.u32(self.option());
            w.u32(length);
            match self {
                ClientOption::ExportName(name) => w.bytes(name.as_bytes()),
                ClientOption::Info(r) | ClientOption::Go(r) => r.write(&mut w),
                ClientOption::ListMetaContext(r) | ClientOption::SetMetaContext(r) => {
                    r.write(&mut w)
                }
                ClientOption::Other { data, .. } => w.bytes(data),
                _ => {}
            }
            w.finish()
        })
    }
}

/// Parses the `data` of option `option` (server side); `data` is exactly the `length` bytes
/// announced by the [`OptionHeader`].
///
/// Errors are [`Error::InvalidOption`], [`Error::StringTooLong`] or [`Error::InvalidString`]:
/// the option has been consumed, so the server answers `NBD_REP_ERR_INVALID`
/// ([`Error::option_error`]) and carries on. Unknown option codes are not an error: they give
/// [`ClientOption::Other`].
pub fn parse_option(option: u32, data: &[u8]) -> Result<ClientOption<'_>, Error> {
    let no_data = |opt: ClientOption<'static>| {
        if data.is_empty() {
            Ok(opt)
        } else {
            Err(Error::InvalidOption {
                option,
                reason: "option takes no data",
            })
        }
    };
    match option {
        NBD_OPT_EXPORT_NAME => Ok(ClientOption::ExportName(parse_str("export name", data)?)),
        NBD_OPT_ABORT => Ok(ClientOption::Abort),
        NBD_OPT_LIST => no_data(ClientOption::List),
        NBD_OPT_STARTTLS => no_data(ClientOption::StartTls),
        NBD_OPT_INFO => Ok(ClientOption::Info(ExportRequest::parse(option, data)?)),
        NBD_OPT_GO => Ok(ClientOption::Go(ExportRequest::parse(option, data)?)),
        NBD_OPT_STRUCTURED_REPLY => no_data(ClientOption::StructuredReply),
        NBD_OPT_LIST_META_CONTEXT => Ok(ClientOption::ListMetaContext(MetaContextRequest::parse(
            option, data,
        )?)),
        NBD_OPT_SET_META_CONTEXT => Ok(ClientOption::SetMetaContext(MetaContextRequest::parse(
            option, data,
        )?)),
        NBD_OPT_EXTENDED_HEADERS => no_data(ClientOption::ExtendedHeaders),
        _ => Ok(ClientOption::Other { option, data }),
    }
}

// ---------------------------------------------------------------------------------------------
// Option replies (server to client).
// ---------------------------------------------------------------------------------------------

/// Block size constraints (`NBD_INFO_BLOCK_SIZE`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BlockSize {
    /// Minimum block size (a power of two, at most 64 KiB).
    pub min: u32,
    /// Preferred block size (a power of two, at least `max(min, 512)`).
    pub preferred: u32,
    /// Maximum block size (a multiple of `min`, or `0xffff_ffff` for no limit).
    pub max: u32,
}

/// The size and transmission flags of an export, as sent by `NBD_INFO_EXPORT` and in reply to
/// `NBD_OPT_EXPORT_NAME`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ExportInfo {
    /// Export size in bytes.
    pub size: u64,
    /// Transmission flags.
    pub flags: TransmissionFlags,
}

/// One information item of an `NBD_REP_INFO` reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Info<'a> {
    /// `NBD_INFO_EXPORT`.
    Export(ExportInfo),
    /// `NBD_INFO_NAME`: the canonical export name.
    Name(&'a str),
    /// `NBD_INFO_DESCRIPTION`: a human-readable description.
    Description(&'a str),
    /// `NBD_INFO_BLOCK_SIZE`.
    BlockSize(BlockSize),
    /// An information type this crate does not know (a client must ignore it).
    Other {
        /// The raw information type.
        info_type: u16,
        /// Its raw payload.
        data: &'a [u8],
    },
}

impl Info<'_> {
    fn info_type(&self) -> u16 {
        match self {
            Info::Export(_) => NBD_INFO_EXPORT,
            Info::Name(_) => NBD_INFO_NAME,
            Info::Description(_) => NBD_INFO_DESCRIPTION,
            Info::BlockSize(_) => NBD_INFO_BLOCK_SIZE,
            Info::Other { info_type, .. } => *info_type,
        }
    }

    /// Bytes of the reply data, the 2-byte type included.
    fn data_len(&self) -> usize {
        2 + match self {
            Info::Export(_) => 10,
            Info::Name(s) | Info::Description(s) => s.len(),
            Info::BlockSize(_) => 12,
            Info::Other { data, .. } => data.len(),
        }
    }
}

/// An option reply with its parsed data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum OptionReply<'a> {
    /// `NBD_REP_ACK`.
    Ack,
    /// `NBD_REP_SERVER`: an export name and optional details for display.
    Server {
        /// The export name.
        name: &'a str,
        /// Implementation-specific details, a human-readable string (may be empty).
        details: &'a str,
    },
    /// `NBD_REP_INFO`.
    Info(Info<'a>),
    /// `NBD_REP_META_CONTEXT`.
    MetaContext {
        /// The context id (zero in replies to `NBD_OPT_LIST_META_CONTEXT`).
        id: u32,
        /// The context name.
        name: &'a str,
    },
    /// A known error reply, with its message (may be empty).
    Error {
        /// The error.
        error: OptionError,
        /// A message for display.
        message: &'a str,
    },
    /// A reply type this crate does not know. If bit 31 is set ([`is_option_error`]) it is an
    /// error, which a client must treat as such.
    Other {
        /// The raw reply type.
        reply_type: u32,
        /// The raw data.
        data: &'a [u8],
    },
}

impl OptionReply<'_> {
    /// The raw reply type.
    pub fn reply_type(&self) -> u32 {
        match self {
            OptionReply::Ack => NBD_REP_ACK,
            OptionReply::Server { .. } => NBD_REP_SERVER,
            OptionReply::Info(_) => NBD_REP_INFO,
            OptionReply::MetaContext { .. } => NBD_REP_META_CONTEXT,
            OptionReply::Error { error, .. } => error.as_u32(),
            OptionReply::Other { reply_type, .. } => *reply_type,
        }
    }

    /// Whether this is an error reply (known or not).
    pub fn is_error(&self) -> bool {
        is_option_error(self.reply_type())
    }

    /// Bytes of reply data (after the header).
    pub fn data_len(&self) -> usize {
        match self {
            OptionReply::Ack => 0,
            OptionReply::Server { name, details } => 4 + name.len() + details.len(),
            OptionReply::Info(info) => info.data_len(),
            OptionReply::MetaContext { name, .. } => 4 + name.len(),
            OptionReply::Error { message, .. } => message.len(),
            OptionReply::Other { data, .. } => data.len(),
        }
    }

    fn check(&self) -> Result<(), Error> {
        match self {
            OptionReply::Server { name, details } => {
                check_str("export name", name)?;
                check_str("export details", details)
            }
            OptionReply::Info(Info::Name(s)) => check_str("export name", s),
            OptionReply::Info(Info::Description(s)) => check_str("export description", s),
            OptionReply::MetaContext { name, .. } => check_str("metadata context name", name),
            OptionReply::Error { message, .. } => check_str("error message", message),
            _ => Ok(()),
        }
    }

    fn write(&self, w: &mut Writer<'_>) {
        match self {
            OptionReply::Ack => {}
            OptionReply::Server { name, details } => {
                w.u32(name.len() as u32);
                w.bytes(name.as_bytes());
                w.bytes(details.as_bytes());
            }
            OptionReply::Info(info) => {
                w.u16(info.info_type());
                match info {
                    Info::Export(e) => {
                        w.u64(e.size);
                        w.u16(e.flags.bits());
                    }
                    Info::Name(s) | Info::Description(s) => w.bytes(s.as_bytes()),
                    Info::BlockSize(b) => {
                        w.u32(b.min);
                        w.u32(b.preferred);
                        w.u32(b.max);
                    }
                    Info::Other { data, .. } => w.bytes(data),
                }
            }
            OptionReply::MetaContext { id, name } => {
                w.u32(*id);
                w.bytes(name.as_bytes());
            }
            OptionReply::Error { message, .. } => w.bytes(message.as_bytes()),
            OptionReply::Other { data, .. } => w.bytes(data),
        }
    }
}

/// Appends an option reply to option `option` (server side): the
/// [`OPTION_REPLY_HEADER_LEN`]-byte header and the reply data. Strings are checked against the
/// protocol's limits; on error nothing is appended.
pub fn encode_option_reply(
    option: u32,
    reply: &OptionReply<'_>,
    out: &mut Vec<u8>,
) -> Result<(), Error> {
    reply.check()?;
    let data_len = reply.data_len();
    let length = len_u32("option reply length", data_len)?;
    let total = OPTION_REPLY_HEADER_LEN + data_len;
    append(out, total, |buf| {
        let mut w = Writer::new(buf, total)?;
        w.u64(NBD_REP_MAGIC);
        w.u32(option);
        w.u32(reply.reply_type());
        w.u32(length);
        reply.write(&mut w);
        w.finish()
    })
}

/// The fixed part of an option reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct OptionReplyHeader {
    /// The option this replies to.
    pub option: u32,
    /// The raw reply type.
    pub reply_type: u32,
    /// Bytes of reply data following the header.
    pub length: u32,
}

/// Decodes an option reply header (client side). A length above `max_len` gives
/// [`Error::OptionReplyTooLong`] without waiting for the data.
pub fn decode_option_reply_header(
    buf: &[u8],
    max_len: u32,
) -> Result<Decoded<OptionReplyHeader>, Error> {
    let mut r = Reader::new(buf);
    let Some(magic) = r.u64() else {
        return Ok(Decoded::Incomplete(OPTION_REPLY_HEADER_LEN));
    };
    if magic != NBD_REP_MAGIC {
        return Err(Error::BadMagic {
            expected: NBD_REP_MAGIC,
            found: magic,
        });
    }
    let (Some(option), Some(reply_type), Some(length)) = (r.u32(), r.u32(), r.u32()) else {
        return Ok(Decoded::Incomplete(OPTION_REPLY_HEADER_LEN));
    };
    if length > max_len {
        return Err(Error::OptionReplyTooLong {
            reply_type,
            length,
            max: max_len,
        });
    }
    Ok(Decoded::Complete {
        value: OptionReplyHeader {
            option,
            reply_type,
            length,
        },
        consumed: OPTION_REPLY_HEADER_LEN,
    })
}

/// Parses the data of an option reply of type `reply_type` (client side); `data` is exactly
/// the `length` bytes announced by the [`OptionReplyHeader`]. Inconsistent lengths give
/// [`Error::MalformedReply`]. Unknown reply and information types are not errors.
pub fn parse_option_reply(reply_type: u32, data: &[u8]) -> Result<OptionReply<'_>, Error> {
    let malformed = |reason| Error::MalformedReply { reason };
    let mut r = Reader::new(data);
    match reply_type {
        NBD_REP_ACK => {
            if !data.is_empty() {
                return Err(malformed("NBD_REP_ACK with data"));
            }
            Ok(OptionReply::Ack)
        }
        NBD_REP_SERVER => {
            let name_len = r
                .u32()
                .ok_or(malformed("NBD_REP_SERVER shorter than 4 bytes"))?;
            let name = r
                .take(name_len as usize)
                .ok_or(malformed("NBD_REP_SERVER name longer than the reply"))?;
            Ok(OptionReply::Server {
                name: parse_str("export name", name)?,
                details: parse_str("export details", r.rest())?,
            })
        }
        NBD_REP_INFO => {
            let info_type = r
                .u16()
                .ok_or(malformed("NBD_REP_INFO shorter than 2 bytes"))?;
            let info = match info_type {
                NBD_INFO_EXPORT => {
                    let (Some(size), Some(flags), 0) = (r.u64(), r.u16(), r.remaining()) else {
                        return Err(malformed("NBD_INFO_EXPORT length is not 12"));
                    };
                    Info::Export(ExportInfo {
                        size,
                        flags: TransmissionFlags::from_bits(flags),
                    })
                }
                NBD_INFO_NAME => Info::Name(parse_str("export name", r.rest())?),
                NBD_INFO_DESCRIPTION => {
                    Info::Description(parse_str("export description", r.rest())?)
                }
                NBD_INFO_BLOCK_SIZE => {
                    let (Some(min), Some(preferred), Some(max), 0) =
                        (r.u32(), r.u32(), r.u32(), r.remaining())
                    else {
                        return Err(malformed("NBD_INFO_BLOCK_SIZE length is not 14"));
                    };
                    Info::BlockSize(BlockSize {
                        min,
                        preferred,
                        max,
                    })
                }
                _ => Info::Other {
                    info_type,
                    data: r.rest(),
                },
            };
            Ok(OptionReply::Info(info))
        }
        NBD_REP_META_CONTEXT => {
            let id = r
                .u32()
                .ok_or(malformed("NBD_REP_META_CONTEXT shorter than 4 bytes"))?;
            Ok(OptionReply::MetaContext {
                id,
                name: parse_str("metadata context name", r.rest())?,
            })
        }
        _ => match OptionError::from_u32(reply_type) {
            Some(error) => Ok(OptionReply::Error {
                error,
                message: parse_str("error message", data)?,
            }),
            None => Ok(OptionReply::Other { reply_type, data }),
        },
    }
}

// ---------------------------------------------------------------------------------------------
// The reply to NBD_OPT_EXPORT_NAME.
// ---------------------------------------------------------------------------------------------

/// Appends the reply to `NBD_OPT_EXPORT_NAME`: export size, transmission flags and, unless
/// `no_zeroes` (both sides set `NO_ZEROES`), 124 zero bytes.
pub fn encode_export_name_reply(info: ExportInfo, no_zeroes: bool, out: &mut Vec<u8>) {
    out.extend_from_slice(&info.size.to_be_bytes());
    out.extend_from_slice(&info.flags.bits().to_be_bytes());
    if !no_zeroes {
        out.resize(
            out.len() + (EXPORT_NAME_REPLY_LEN - EXPORT_NAME_REPLY_SHORT_LEN),
            0,
        );
    }
}

/// Decodes the reply to `NBD_OPT_EXPORT_NAME` (client side); `no_zeroes` says whether
/// `NO_ZEROES` was negotiated. The reserved zero bytes are skipped unchecked.
pub fn decode_export_name_reply(buf: &[u8], no_zeroes: bool) -> Result<Decoded<ExportInfo>, Error> {
    let total = if no_zeroes {
        EXPORT_NAME_REPLY_SHORT_LEN
    } else {
        EXPORT_NAME_REPLY_LEN
    };
    if buf.len() < total {
        return Ok(Decoded::Incomplete(total));
    }
    let mut r = Reader::new(buf);
    let (Some(size), Some(flags)) = (r.u64(), r.u16()) else {
        return Ok(Decoded::Incomplete(total));
    };
    Ok(Decoded::Complete {
        value: ExportInfo {
            size,
            flags: TransmissionFlags::from_bits(flags),
        },
        consumed: total,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::NBD_OPT_PEEK_EXPORT;

    fn complete<T>(d: Decoded<T>) -> (T, usize) {
        match d {
            Decoded::Complete { value, consumed } => (value, consumed),
            Decoded::Incomplete(n) => panic!("incomplete, needs {n}"),
        }
    }

    fn option_bytes(option: u32, data: &[u8]) -> Vec<u8> {
        let mut v = Vec::new();
        OptionHeader {
            option,
            length: data.len() as u32,
        }
        .encode(&mut v);
        v.extend_from_slice(data);
        v
    }

    #[test]
    fn greeting_round_trip() {
        let mut v = Vec::new();
        let flags = HandshakeFlags::FIXED_NEWSTYLE | HandshakeFlags::NO_ZEROES;
        encode_server_greeting(flags, &mut v);
        assert_eq!(v.len(), SERVER_GREETING_LEN);
        assert_eq!(&v[..16], b"NBDMAGICIHAVEOPT");
        assert_eq!(&v[16..], &[0, 3]);
        for n in 0..v.len() {
            assert_eq!(
                decode_server_greeting(&v[..n]),
                Ok(Decoded::Incomplete(SERVER_GREETING_LEN))
            );
        }
        assert_eq!(complete(decode_server_greeting(&v).unwrap()), (flags, 18));
        // Trailing bytes are not consumed.
        v.push(7);
        assert_eq!(complete(decode_server_greeting(&v).unwrap()).1, 18);
    }

    #[test]
    fn greeting_bad_magic_and_oldstyle() {
        let mut v = b"NBDMAGIX".to_vec();
        assert!(matches!(
            decode_server_greeting(&v),
            Err(Error::BadMagic {
                expected: NBDMAGIC,
                ..
            })
        ));
        v = b"NBDMAGIC".to_vec();
        v.extend_from_slice(&NBD_CLISERV_MAGIC.to_be_bytes());
        assert_eq!(decode_server_greeting(&v), Err(Error::OldstyleNegotiation));
        v.truncate(8);
        v.extend_from_slice(b"IHAVEOPS");
        assert!(matches!(
            decode_server_greeting(&v),
            Err(Error::BadMagic {
                expected: IHAVEOPT,
                ..
            })
        ));
    }

    #[test]
    fn client_flags() {
        let offered = HandshakeFlags::FIXED_NEWSTYLE | HandshakeFlags::NO_ZEROES;
        let mut v = Vec::new();
        encode_client_flags(ClientFlags::FIXED_NEWSTYLE | ClientFlags::NO_ZEROES, &mut v);
        assert_eq!(v, [0, 0, 0, 3]);
        assert_eq!(
            decode_client_flags(&v[..3], offered),
            Ok(Decoded::Incomplete(4))
        );
        assert_eq!(
            complete(decode_client_flags(&v, offered).unwrap()).0,
            ClientFlags::KNOWN
        );
        // NO_ZEROES not offered.
        assert_eq!(
            decode_client_flags(&v, HandshakeFlags::FIXED_NEWSTYLE),
            Err(Error::UnsupportedClientFlags { flags: 3 })
        );
        // Unknown bit.
        assert_eq!(
            decode_client_flags(&[0x80, 0, 0, 1], offered),
            Err(Error::UnsupportedClientFlags { flags: 0x8000_0001 })
        );
        assert_eq!(
            complete(decode_client_flags(&[0, 0, 0, 0], offered).unwrap()).0,
            ClientFlags::empty()
        );
    }

    #[test]
    fn option_header() {
        let v = option_bytes(NBD_OPT_GO, &[0; 10]);
        for n in 0..OPTION_HEADER_LEN {
            assert_eq!(
                decode_option_header(&v[..n], 100),
                Ok(Decoded::Incomplete(OPTION_HEADER_LEN))
            );
        }
        let (h, used) = complete(decode_option_header(&v, 100).unwrap());
        assert_eq!(used, 16);
        assert_eq!(
            h,
            OptionHeader {
                option: NBD_OPT_GO,
                length: 10
            }
        );
        assert_eq!(h.code(), Some(OptionCode::Go));
        // Exactly at the limit is fine, one above is not (and needs no data).
        assert!(decode_option_header(&v[..16], 10).is_ok());
        assert_eq!(
            decode_option_header(&v[..16], 9),
            Err(Error::OptionTooLong {
                option: NBD_OPT_GO,
                length: 10,
                max: 9
            })
        );
        let huge = option_bytes(NBD_OPT_INFO, &[]);
        let mut huge = huge[..12].to_vec();
        huge.extend_from_slice(&u32::MAX.to_be_bytes());
        assert!(matches!(
            decode_option_header(&huge, DEFAULT_MAX_OPTION_LEN),
            Err(Error::OptionTooLong {
                length: u32::MAX,
                ..
            })
        ));
        // Bad magic is seen with only 8 bytes.
        assert!(matches!(
            decode_option_header(b"IHAVEOPX", 100),
            Err(Error::BadMagic { .. })
        ));
        assert!(matches!(
            decode_option_header(&NBD_REP_MAGIC.to_be_bytes(), 100),
            Err(Error::BadMagic { .. })
        ));
    }

    fn round_trip(opt: ClientOption<'_>) {
        let mut v = Vec::new();
        opt.encode(&mut v).unwrap();
        assert_eq!(v.len(), OPTION_HEADER_LEN + opt.data_len());
        let (h, used) = complete(decode_option_header(&v, u32::MAX).unwrap());
        assert_eq!(h.option, opt.option());
        assert_eq!(h.length as usize, opt.data_len());
        let parsed = parse_option(h.option, &v[used..]).unwrap();
        assert_eq!(parsed, opt);
    }

    #[test]
    fn options_round_trip() {
        round_trip(ClientOption::ExportName(""));
        round_trip(ClientOption::ExportName("disk0"));
        round_trip(ClientOption::Abort);
        round_trip(ClientOption::List);
        round_trip(ClientOption::StartTls);
        round_trip(ClientOption::StructuredReply);
        round_trip(ClientOption::ExtendedHeaders);
        round_trip(ClientOption::Info(ExportRequest::new("", &[])));
        round_trip(ClientOption::Go(ExportRequest::new(
            "export",
            &[InfoType::Name, InfoType::BlockSize, InfoType::Description],
        )));
        round_trip(ClientOption::Go(ExportRequest {
            name: "x",
            info: vec![0x1234, 0],
        }));
        round_trip(ClientOption::ListMetaContext(MetaContextRequest {
            name: "",
            queries: vec![],
        }));
        round_trip(ClientOption::SetMetaContext(MetaContextRequest {
            name: "disk",
            queries: vec!["base:allocation", "", "qemu:dirty-bitmap:b0"],
        }));
        round_trip(ClientOption::Other {
            option: 0xdead,
            data: b"payload",
        });
    }

    #[test]
    fn option_encoding_is_exact() {
        let mut v = Vec::new();
        ClientOption::Go(ExportRequest::new("ab", &[InfoType::BlockSize]))
            .encode(&mut v)
            .unwrap();
        let mut want = b"IHAVEOPT".to_vec();
        want.extend_from_slice(&[0, 0, 0, 7, 0, 0, 0, 10]);
        want.extend_from_slice(&[0, 0, 0, 2, b'a', b'b', 0, 1, 0, 3]);
        assert_eq!(v, want);
        v.clear();
        ClientOption::SetMetaContext(MetaContextRequest {
            name: "e",
            queries: vec!["base:"],
        })
        .encode(&mut v)
        .unwrap();
        let mut want = b"IHAVEOPT".to_vec();
        want.extend_from_slice(&[0, 0, 0, 10, 0, 0, 0, 18]);
        want.extend_from_slice(&[0, 0, 0, 1, b'e', 0, 0, 0, 1, 0, 0, 0, 5]);
        want.extend_from_slice(b"base:");
        assert_eq!(v, want);
    }

    #[test]
    fn option_encoding_rejects_bad_strings() {
        let long = "n".repeat(4097);
        let mut v = vec![1];
        assert!(matches!(
            ClientOption::ExportName(&long).encode(&mut v),
            Err(Error::StringTooLong { .. })
        ));
        assert!(matches!(
            ClientOption::Info(ExportRequest::new("a\0b", &[])).encode(&mut v),
            Err(Error::InvalidString { .. })
        ));
        assert!(matches!(
            ClientOption::Go(ExportRequest {
                name: "",
                info: vec![0; 70_000]
            })
            .encode(&mut v),
            Err(Error::ValueTooLarge { .. })
        ));
        assert_eq!(v, [1]);
    }

    #[test]
    fn abort_ignores_data_others_reject_it() {
        assert_eq!(
            parse_option(NBD_OPT_ABORT, b"junk"),
            Ok(ClientOption::Abort)
        );
        for opt in [
            NBD_OPT_LIST,
            NBD_OPT_STARTTLS,
            NBD_OPT_STRUCTURED_REPLY,
            NBD_OPT_EXTENDED_HEADERS,
        ] {
            let e = parse_option(opt, b"x").unwrap_err();
            assert!(matches!(e, Error::InvalidOption { option, .. } if option == opt));
            assert_eq!(e.option_error(), Some(OptionError::Invalid));
        }
        assert_eq!(
            parse_option(NBD_OPT_PEEK_EXPORT, b"x"),
            Ok(ClientOption::Other {
                option: NBD_OPT_PEEK_EXPORT,
                data: b"x"
            })
        );
    }

    #[test]
    fn export_name_strings() {
        assert_eq!(
            parse_option(NBD_OPT_EXPORT_NAME, b""),
            Ok(ClientOption::ExportName(""))
        );
        assert!(matches!(
            parse_option(NBD_OPT_EXPORT_NAME, b"a\0"),
            Err(Error::InvalidString { .. })
        ));
        assert!(matches!(
            parse_option(NBD_OPT_EXPORT_NAME, &[0xc3]),
            Err(Error::InvalidString { .. })
        ));
        assert!(matches!(
            parse_option(NBD_OPT_EXPORT_NAME, &[b'a'; 5000]),
            Err(Error::StringTooLong { length: 5000, .. })
        ));
    }

    fn info_data(name_len: u32, name: &[u8], count: u16, reqs: &[u16]) -> Vec<u8> {
        let mut v = name_len.to_be_bytes().to_vec();
        v.extend_from_slice(name);
        v.extend_from_slice(&count.to_be_bytes());
        for r in reqs {
            v.extend_from_slice(&r.to_be_bytes());
        }
        v
    }

    #[test]
    fn info_malformed() {
        let invalid = |data: &[u8]| {
            matches!(
                parse_option(NBD_OPT_INFO, data),
                Err(Error::InvalidOption {
                    option: NBD_OPT_INFO,
                    ..
                })
            )
        };
        // Too short to hold the fixed fields.
        assert!(invalid(&[]));
        assert!(invalid(&[0, 0, 0, 0, 0]));
        // Name longer than the option.
        assert!(invalid(&info_data(5, b"abc", 0, &[])));
        assert!(invalid(&info_data(u32::MAX, b"abc", 0, &[])));
        // Name length eats into the count.
        assert!(invalid(&[0, 0, 0, 1, b'a', 0]));
        // Count says 2, one present; count says 1, two present.
        assert!(invalid(&info_data(1, b"a", 2, &[3])));
        assert!(invalid(&info_data(1, b"a", 1, &[3, 1])));
        // Odd trailing byte.
        let mut odd = info_data(0, b"", 0, &[]);
        odd.push(0);
        assert!(invalid(&odd));
        // Zero-length name with zero requests is valid.
        assert_eq!(
            parse_option(NBD_OPT_GO, &info_data(0, b"", 0, &[])),
            Ok(ClientOption::Go(ExportRequest::default()))
        );
        // A bad name is a string error.
        assert!(matches!(
            parse_option(NBD_OPT_GO, &info_data(2, &[0xff, 0xfe], 0, &[])),
            Err(Error::InvalidString { .. })
        ));
        let data = info_data(1, b"a", 2, &[3, 99]);
        let ok = parse_option(NBD_OPT_INFO, &data).unwrap();
        let ClientOption::Info(req) = ok else {
            panic!("not info")
        };
        assert!(req.requests(InfoType::BlockSize));
        assert!(!req.requests(InfoType::Name));
        assert_eq!(req.info, [3, 99]);
    }

    fn meta_data(name: &[u8], count: u32, queries: &[&[u8]]) -> Vec<u8> {
        let mut v = (name.len() as u32).to_be_bytes().to_vec();
        v.extend_from_slice(name);
        v.extend_from_slice(&count.to_be_bytes());
        for q in queries {
            v.extend_from_slice(&(q.len() as u32).to_be_bytes());
            v.extend_from_slice(q);
        }
        v
    }

    #[test]
    fn meta_context_malformed() {
        let invalid = |data: &[u8]| {
            matches!(
                parse_option(NBD_OPT_SET_META_CONTEXT, data),
                Err(Error::InvalidOption { .. })
            )
        };
        assert!(invalid(&[]));
        assert!(invalid(&[0, 0, 0, 0, 0, 0, 0]));
        assert!(invalid(&[0, 0, 0, 9, 0, 0, 0, 0]));
        assert!(invalid(&meta_data(b"e", 1, &[])));
        assert!(invalid(&meta_data(b"e", u32::MAX, &[b"base:"])));
        assert!(invalid(&meta_data(b"e", 0, &[b"base:"])));
        // Query length beyond the option.
        let mut v = meta_data(b"e", 1, &[]);
        v.extend_from_slice(&[0, 0, 0, 10, b'b']);
        assert!(invalid(&v));
        // Truncated query length.
        let mut v = meta_data(b"e", 2, &[b"a:"]);
        v.extend_from_slice(&[0, 0, 0, 0]);
        v.truncate(v.len() - 1);
        assert!(invalid(&v));
        assert!(matches!(
            parse_option(NBD_OPT_LIST_META_CONTEXT, &meta_data(b"e", 1, &[b"a\0"])),
            Err(Error::InvalidString { .. })
        ));
        assert_eq!(
            parse_option(NBD_OPT_LIST_META_CONTEXT, &meta_data(b"", 0, &[])),
            Ok(ClientOption::ListMetaContext(MetaContextRequest::default()))
        );
    }

    fn reply_round_trip(option: u32, reply: OptionReply<'_>) -> Vec<u8> {
        let mut v = Vec::new();
        encode_option_reply(option, &reply, &mut v).unwrap();
        assert_eq!(v.len(), OPTION_REPLY_HEADER_LEN + reply.data_len());
        for n in 0..OPTION_REPLY_HEADER_LEN {
            assert_eq!(
                decode_option_reply_header(&v[..n], u32::MAX),
                Ok(Decoded::Incomplete(OPTION_REPLY_HEADER_LEN))
            );
        }
        let (h, used) = complete(decode_option_reply_header(&v, u32::MAX).unwrap());
        assert_eq!(used, OPTION_REPLY_HEADER_LEN);
        assert_eq!(h.option, option);
        assert_eq!(h.reply_type, reply.reply_type());
        assert_eq!(h.length as usize, v.len() - used);
        assert_eq!(parse_option_reply(h.reply_type, &v[used..]), Ok(reply));
        v
    }

    #[test]
    fn option_replies_round_trip() {
        let v = reply_round_trip(NBD_OPT_ABORT, OptionReply::Ack);
        let mut want = NBD_REP_MAGIC.to_be_bytes().to_vec();
        want.extend_from_slice(&[0, 0, 0, 2, 0, 0, 0, 1, 0, 0, 0, 0]);
        assert_eq!(v, want);
        reply_round_trip(
            NBD_OPT_LIST,
            OptionReply::Server {
                name: "disk",
                details: "",
            },
        );
        reply_round_trip(
            NBD_OPT_LIST,
            OptionReply::Server {
                name: "",
                details: "a scratch disk",
            },
        );
        let v = reply_round_trip(
            NBD_OPT_GO,
            OptionReply::Info(Info::Export(ExportInfo {
                size: 1 << 40,
                flags: TransmissionFlags::HAS_FLAGS | TransmissionFlags::SEND_FLUSH,
            })),
        );
        assert_eq!(&v[16..20], &[0, 0, 0, 12]);
        assert_eq!(&v[20..], &[0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 5]);
        reply_round_trip(NBD_OPT_GO, OptionReply::Info(Info::Name("canonical")));
        reply_round_trip(NBD_OPT_INFO, OptionReply::Info(Info::Description("")));
        let v = reply_round_trip(
            NBD_OPT_GO,
            OptionReply::Info(Info::BlockSize(BlockSize {
                min: 512,
                preferred: 4096,
                max: 32 << 20,
            })),
        );
        assert_eq!(&v[16..20], &[0, 0, 0, 14]);
        reply_round_trip(
            NBD_OPT_GO,
            OptionReply::Info(Info::Other {
                info_type: 77,
                data: b"?",
            }),
        );
        reply_round_trip(
            NBD_OPT_SET_META_CONTEXT,
            OptionReply::MetaContext {
                id: 1,
                name: "base:allocation",
            },
        );
        for &error in OptionError::ALL {
            reply_round_trip(NBD_OPT_GO, OptionReply::Error { error, message: "" });
            let r = OptionReply::Error {
                error,
                message: "no such export",
            };
            assert!(r.is_error());
            reply_round_trip(NBD_OPT_GO, r);
        }
        let unknown_err = OptionReply::Other {
            reply_type: 0x8000_0042,
            data: b"msg",
        };
        assert!(unknown_err.is_error());
        reply_round_trip(99, unknown_err);
        let unknown = OptionReply::Other {
            reply_type: 42,
            data: b"",
        };
        assert!(!unknown.is_error());
        reply_round_trip(99, unknown);
    }

    #[test]
    fn option_reply_encoding_rejects_bad_strings() {
        let mut v = Vec::new();
        let long = "m".repeat(4097);
        assert!(encode_option_reply(
            1,
            &OptionReply::Error {
                error: OptionError::Invalid,
                message: &long
            },
            &mut v
        )
        .is_err());
        assert!(
            encode_option_reply(1, &OptionReply::MetaContext { id: 0, name: "a\0" }, &mut v)
                .is_err()
        );
        assert!(v.is_empty());
    }

    #[test]
    fn option_reply_malformed() {
        let mal =
            |t, d: &[u8]| matches!(parse_option_reply(t, d), Err(Error::MalformedReply { .. }));
        assert!(mal(NBD_REP_ACK, b"x"));
        assert!(mal(NBD_REP_SERVER, b"abc"));
        assert!(mal(NBD_REP_SERVER, &[0, 0, 0, 2, b'a']));
        assert!(mal(NBD_REP_INFO, &[0]));
        assert!(mal(NBD_REP_INFO, &[0, 0, 1, 2, 3]));
        let mut export = vec![0, 0];
        export.extend_from_slice(&[0; 10]);
        assert!(parse_option_reply(NBD_REP_INFO, &export).is_ok());
        export.push(0);
        assert!(mal(NBD_REP_INFO, &export));
        assert!(mal(NBD_REP_INFO, &[0, 3, 0, 0, 2, 0, 0, 0, 16, 0, 0, 0, 0]));
        assert!(mal(NBD_REP_META_CONTEXT, &[0, 0, 1]));
        assert!(matches!(
            parse_option_reply(NBD_REP_META_CONTEXT, &[0, 0, 0, 1, 0xff]),
            Err(Error::InvalidString { .. })
        ));
        let mut v = Vec::new();
        encode_option_reply(1, &OptionReply::Ack, &mut v).unwrap();
        v[0] ^= 1;
        assert!(matches!(
            decode_option_reply_header(&v, 10),
            Err(Error::BadMagic { .. })
        ));
        v[0] ^= 1;
        v[19] = 11;
        assert_eq!(
            decode_option_reply_header(&v, 10),
            Err(Error::OptionReplyTooLong {
                reply_type: NBD_REP_ACK,
                length: 11,
                max: 10
            })
        );
    }

    #[test]
    fn export_name_reply() {
        let info = ExportInfo {
            size: 0x1_0000_0000,
            flags: TransmissionFlags::HAS_FLAGS | TransmissionFlags::READ_ONLY,
        };
        for no_zeroes in [false, true] {
            let mut v = Vec::new();
            encode_export_name_reply(info, no_zeroes, &mut v);
            let want_len = if no_zeroes { 10 } else { 134 };
            assert_eq!(v.len(), want_len);
            assert_eq!(&v[..10], &[0, 0, 0, 1, 0, 0, 0, 0, 0, 3]);
            assert!(v[10..].iter().all(|&b| b == 0));
            assert_eq!(
                decode_export_name_reply(&v[..want_len - 1], no_zeroes),
                Ok(Decoded::Incomplete(want_len))
            );
            assert_eq!(
                complete(decode_export_name_reply(&v, no_zeroes).unwrap()),
                (info, want_len)
            );
        }
    }
}
