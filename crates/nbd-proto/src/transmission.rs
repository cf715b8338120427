//! The transmission phase: requests, simple replies, structured and extended reply chunks.
//!
//! Server side: [`decode_request`], [`SimpleReply::encode_into`], [`ReplyChunk::encode_into`]
//! (and the `Vec`-appending `encode` twins).
//!
//! Client side: [`Request::encode_into`], [`decode_reply_header`] + [`parse_chunk`].
//!
//! Data payloads (of `NBD_CMD_WRITE` requests, simple read replies and `OFFSET_DATA` chunks)
//! are never copied by this module: decoders report their length, encoders write the headers
//! only, so the caller can read or `writev` the data buffers directly.

use crate::error::UnknownRequest;
use crate::proto::{
    is_reply_error_type, CmdFlags, Command, ReplyFlags, TransmissionMode,
    EXTENDED_REPLY_HEADER_LEN, NBD_CMD_WRITE, NBD_EXTENDED_REPLY_MAGIC, NBD_EXTENDED_REQUEST_MAGIC,
    NBD_REPLY_TYPE_BLOCK_STATUS, NBD_REPLY_TYPE_BLOCK_STATUS_EXT, NBD_REPLY_TYPE_ERROR,
    NBD_REPLY_TYPE_ERROR_OFFSET, NBD_REPLY_TYPE_NONE, NBD_REPLY_TYPE_OFFSET_DATA,
    NBD_REPLY_TYPE_OFFSET_HOLE, NBD_REQUEST_MAGIC, NBD_SIMPLE_REPLY_MAGIC,
    NBD_STRUCTURED_REPLY_MAGIC, SIMPLE_REPLY_LEN, STRUCTURED_REPLY_HEADER_LEN,
};
use crate::wire::{append, check_str, parse_str, Reader, Writer};
use crate::{Decoded, Error};

// ---------------------------------------------------------------------------------------------
// Requests.
// ---------------------------------------------------------------------------------------------

/// A transmission request header, compact or extended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Request {
    /// Command flags, unknown bits included (a server should answer `NBD_EINVAL` to flags it
    /// does not support; see [`CmdFlags::unknown`]).
    pub flags: CmdFlags,
    /// The command.
    pub kind: Command,
    /// The client's opaque cookie (called handle in older texts), echoed in every reply.
    pub cookie: u64,
    /// Offset into the export.
    pub offset: u64,
    /// Length: 32 bits on the wire with compact headers, 64 with extended ones. It is the
    /// payload length for `NBD_CMD_WRITE` (and, with extended headers, whenever
    /// `NBD_CMD_FLAG_PAYLOAD_LEN` is set), else the length of the range the command affects.
    pub length: u64,
}

/// Payload bytes following a request header with these fields.
///
/// With compact headers only `NBD_CMD_WRITE` carries a payload. With extended headers a
/// payload is present when `NBD_CMD_FLAG_PAYLOAD_LEN` is set, and also for `NBD_CMD_WRITE`
/// without the flag: the extension requires writers to set it, and treating a write without
/// it as carrying its data is the only reading that keeps the stream in step.
fn payload_len_of(command: u16, flags: CmdFlags, length: u64, mode: TransmissionMode) -> u64 {
    let has_payload = command == NBD_CMD_WRITE
        || (mode.extended_headers() && flags.contains(CmdFlags::PAYLOAD_LEN));
    if has_payload {
        length
    } else {
        0
    }
}

impl Request {
    /// A request without flags.
    pub const fn new(kind: Command, cookie: u64, offset: u64, length: u64) -> Self {
        Self {
            flags: CmdFlags::empty(),
            kind,
            cookie,
            offset,
            length,
        }
    }

    /// `self` with `flags`.
    pub const fn with_flags(self, flags: CmdFlags) -> Self {
        Self { flags, ..self }
    }

    /// Bytes of payload that follow this request's header in `mode` (see [`decode_request`]).
    pub fn payload_len(&self, mode: TransmissionMode) -> u64 {
        payload_len_of(self.kind.as_u16(), self.flags, self.length, mode)
    }

    /// Writes the request header into the start of `buf` (client side) and returns its length
    /// (28 bytes compact, 32 extended). Any payload is the caller's to send after it.
    ///
    /// With compact headers a `length` above `u32::MAX` gives [`Error::ValueTooLarge`]. Flags
    /// are sent as given: with extended headers a writer should set
    /// [`CmdFlags::PAYLOAD_LEN`] on `NBD_CMD_WRITE`.
    pub fn encode_into(&self, mode: TransmissionMode, buf: &mut [u8]) -> Result<usize, Error> {
        let len = mode.request_header_len();
        let mut w = Writer::new(buf, len)?;
        if mode.extended_headers() {
            w.u32(NBD_EXTENDED_REQUEST_MAGIC);
            w.u16(self.flags.bits());
            w.u16(self.kind.as_u16());
            w.u64(self.cookie);
            w.u64(self.offset);
            w.u64(self.length);
        } else {
            let length = u32::try_from(self.length).map_err(|_| Error::ValueTooLarge {
                field: "request length",
                value: self.length,
                max: u64::from(u32::MAX),
            })?;
            w.u32(NBD_REQUEST_MAGIC);
            w.u16(self.flags.bits());
            w.u16(self.kind.as_u16());
            w.u64(self.cookie);
            w.u64(self.offset);
            w.u32(length);
        }
        w.finish()
    }

    /// Appends the request header to `out`, like [`encode_into`](Self::encode_into).
    pub fn encode(&self, mode: TransmissionMode, out: &mut Vec<u8>) -> Result<(), Error> {
        append(out, mode.request_header_len(), |buf| {
            self.encode_into(mode, buf)
        })
    }
}

/// Decodes a request header (server side) in the negotiated `mode`: 28-byte compact headers
/// unless extended headers were negotiated, 32-byte extended headers then.
///
/// - `Ok(Decoded::Incomplete(n))`: fewer than `n` (the header length) bytes are buffered.
/// - `Ok(Decoded::Complete { value, consumed })`: `consumed` header bytes; then
///   [`Request::payload_len`] bytes of payload follow.
/// - `Err(Error::BadMagic)`: not a request of this mode; fatal, drop the connection. The
///   magic is checked as soon as its 4 bytes are present.
/// - `Err(Error::UnknownCommand(u))`: a well-formed header with an unknown command; not
///   fatal: skip `u.payload_len` bytes, reply `NBD_EINVAL` to `u.cookie`, carry on.
///
/// No policy is applied to `length`: a server must check it against its limits before
/// reading a payload.
pub fn decode_request(buf: &[u8], mode: TransmissionMode) -> Result<Decoded<Request>, Error> {
    let header_len = mode.request_header_len();
    let expected = if mode.extended_headers() {
        NBD_EXTENDED_REQUEST_MAGIC
    } else {
        NBD_REQUEST_MAGIC
    };
    let mut r = Reader::new(buf);
    let Some(magic) = r.u32() else {
        return Ok(Decoded::Incomplete(header_len));
    };
    if magic != expected {
        return Err(Error::BadMagic {
            expected: u64::from(expected),
            found: u64::from(magic),
        });
    }
    if buf.len() < header_len {
        return Ok(Decoded::Incomplete(header_len));
    }
    let fields = (|| {
        let flags = CmdFlags::from_bits(r.u16()?);
        let command = r.u16()?;
        let cookie = r.u64()?;
        let offset = r.u64()?;
        let length = if mode.extended_headers() {
            r.u64()?
        } else {
            u64::from(r.u32()?)
        };
        Some((flags, command, cookie, offset, length))
    })();
    let Some((flags, command, cookie, offset, length)) = fields else {
        return Ok(Decoded::Incomplete(header_len));
    };
    match Command::from_u16(command) {
        Some(kind) => Ok(Decoded::Complete {
            value: Request {
                flags,
                kind,
                cookie,
                offset,
                length,
            },
            consumed: header_len,
        }),
        None => Err(Error::UnknownCommand(UnknownRequest {
            flags,
            command,
            cookie,
            offset,
            length,
            header_len,
            payload_len: payload_len_of(command, flags, length, mode),
        })),
    }
}

// ---------------------------------------------------------------------------------------------
// Simple replies.
// ---------------------------------------------------------------------------------------------

/// A simple reply: an error value (0 for success) for a cookie. For a successful
/// `NBD_CMD_READ`, the data (the request's length) follows and is the caller's to send or
/// read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SimpleReply {
    /// The cookie of the request.
    pub cookie: u64,
    /// The error value (`NBD_E*`, see [`Errno`](crate::Errno)), 0 for success.
    pub error: u32,
}

impl SimpleReply {
    /// Writes the [`SIMPLE_REPLY_LEN`]-byte reply into the start of `buf`. Simple replies must
    /// not be used once extended headers are negotiated.
    pub fn encode_into(&self, buf: &mut [u8]) -> Result<usize, Error> {
        let mut w = Writer::new(buf, SIMPLE_REPLY_LEN)?;
        w.u32(NBD_SIMPLE_REPLY_MAGIC);
        w.u32(self.error);
        w.u64(self.cookie);
        w.finish()
    }

    /// Appends the reply to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&NBD_SIMPLE_REPLY_MAGIC.to_be_bytes());
        out.extend_from_slice(&self.error.to_be_bytes());
        out.extend_from_slice(&self.cookie.to_be_bytes());
    }
}

// ---------------------------------------------------------------------------------------------
// Reply chunks.
// ---------------------------------------------------------------------------------------------

/// The header of a structured (20-byte) or extended (32-byte) reply chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ChunkHeader {
    /// Reply flags.
    pub flags: ReplyFlags,
    /// The raw chunk type (`NBD_REPLY_TYPE_*`, see [`ReplyType`](crate::ReplyType)).
    pub reply_type: u16,
    /// The cookie of the request.
    pub cookie: u64,
    /// The offset of the request (extended headers only; 0 and not sent with structured
    /// replies).
    pub offset: u64,
    /// Bytes of payload following the header (at most `u32::MAX` with structured replies).
    pub length: u64,
}

impl ChunkHeader {
    /// Writes the header into the start of `buf` and returns its length (20 bytes in
    /// structured mode, 32 in extended mode). [`Error::WrongMode`] in simple mode.
    pub fn encode_into(&self, mode: TransmissionMode, buf: &mut [u8]) -> Result<usize, Error> {
        let Some(len) = mode.chunk_header_len() else {
            return Err(Error::WrongMode {
                reason: "reply chunks need structured replies or extended headers",
            });
        };
        let mut w = Writer::new(buf, len)?;
        if mode.extended_headers() {
            w.u32(NBD_EXTENDED_REPLY_MAGIC);
            w.u16(self.flags.bits());
            w.u16(self.reply_type);
            w.u64(self.cookie);
            w.u64(self.offset);
            w.u64(self.length);
        } else {
            let length = u32::try_from(self.length).map_err(|_| Error::ValueTooLarge {
                field: "structured reply length",
                value: self.length,
                max: u64::from(u32::MAX),
            })?;
            w.u32(NBD_STRUCTURED_REPLY_MAGIC);
            w.u16(self.flags.bits());
            w.u16(self.reply_type);
            w.u64(self.cookie);
            w.u32(length);
        }
        w.finish()
    }

    /// Appends the header to `out`, like [`encode_into`](Self::encode_into).
    pub fn encode(&self, mode: TransmissionMode, out: &mut Vec<u8>) -> Result<(), Error> {
        let len = mode.chunk_header_len().unwrap_or(0);
        append(out, len, |buf| self.encode_into(mode, buf))
    }

    /// Whether this is the final chunk of its reply.
    pub fn is_done(&self) -> bool {
        self.flags.contains(ReplyFlags::DONE)
    }
}

/// The request a reply chunk answers: its cookie, and its offset (echoed in extended reply
/// headers).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct ReplyTo {
    /// The request's cookie.
    pub cookie: u64,
    /// The request's offset.
    pub offset: u64,
}

impl From<&Request> for ReplyTo {
    fn from(r: &Request) -> Self {
        Self {
            cookie: r.cookie,
            offset: r.offset,
        }
    }
}

/// A block status descriptor with a 32-bit length (`NBD_REPLY_TYPE_BLOCK_STATUS`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Extent {
    /// Length of the extent (nonzero).
    pub length: u32,
    /// Status flags, defined by the metadata context (`NBD_STATE_*` for `base:allocation`).
    pub flags: u32,
}

/// A block status descriptor with a 64-bit length (`NBD_REPLY_TYPE_BLOCK_STATUS_EXT`).
///
/// The descriptor's second word is carried as 64 bits of status flags. (An earlier draft of
/// the extension split it as 32 bits of zero padding and 32 bits of flags: the wire format is
/// the same as long as the high bits are zero, as they are for every context defined today.)
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ExtentExt {
    /// Length of the extent (nonzero).
    pub length: u64,
    /// Status flags, defined by the metadata context.
    pub flags: u64,
}

/// A reply chunk to encode (server side): the chunk type and its payload fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ReplyChunk<'a> {
    /// `NBD_REPLY_TYPE_NONE`: no payload; the encoder always sets `NBD_REPLY_FLAG_DONE`.
    None,
    /// `NBD_REPLY_TYPE_OFFSET_DATA`, header only: the encoder writes the chunk header and the
    /// 8-byte offset; the caller then sends the `data_len` bytes of data itself (from its own
    /// buffer, e.g. with `writev`).
    OffsetData {
        /// Offset of the data in the export.
        offset: u64,
        /// Bytes of data that will follow (nonzero).
        data_len: u64,
    },
    /// `NBD_REPLY_TYPE_OFFSET_HOLE`.
    OffsetHole {
        /// Offset of the hole in the export.
        offset: u64,
        /// Size of the hole (nonzero).
        size: u32,
    },
    /// `NBD_REPLY_TYPE_BLOCK_STATUS` (at least one extent).
    BlockStatus {
        /// The metadata context id.
        context_id: u32,
        /// The extents, in order.
        extents: &'a [Extent],
    },
    /// `NBD_REPLY_TYPE_BLOCK_STATUS_EXT` (extended headers only; at least one extent). The
    /// descriptor count field is filled in.
    BlockStatusExt {
        /// The metadata context id.
        context_id: u32,
        /// The extents, in order.
        extents: &'a [ExtentExt],
    },
    /// `NBD_REPLY_TYPE_ERROR`.
    Error {
        /// The error value (nonzero).
        error: u32,
        /// A message for display (may be empty).
        message: &'a str,
    },
    /// `NBD_REPLY_TYPE_ERROR_OFFSET`.
    ErrorOffset {
        /// The error value (nonzero).
        error: u32,
        /// A message for display (may be empty).
        message: &'a str,
        /// The offset of the error in the export.
        offset: u64,
    },
}

impl ReplyChunk<'_> {
    /// The raw chunk type.
    pub fn reply_type(&self) -> u16 {
        match self {
            ReplyChunk::None => NBD_REPLY_TYPE_NONE,
            ReplyChunk::OffsetData { .. } => NBD_REPLY_TYPE_OFFSET_DATA,
            ReplyChunk::OffsetHole { .. } => NBD_REPLY_TYPE_OFFSET_HOLE,
            ReplyChunk::BlockStatus { .. } => NBD_REPLY_TYPE_BLOCK_STATUS,
            ReplyChunk::BlockStatusExt { .. } => NBD_REPLY_TYPE_BLOCK_STATUS_EXT,
            ReplyChunk::Error { .. } => NBD_REPLY_TYPE_ERROR,
            ReplyChunk::ErrorOffset { .. } => NBD_REPLY_TYPE_ERROR_OFFSET,
        }
    }

    /// The payload length announced in the chunk header (for `OffsetData` this counts the
    /// data the caller sends separately).
    pub fn payload_len(&self) -> u64 {
        match self {
            ReplyChunk::None => 0,
            ReplyChunk::OffsetData { data_len, .. } => 8u64.saturating_add(*data_len),
            ReplyChunk::OffsetHole { .. } => 12,
            ReplyChunk::BlockStatus { extents, .. } => 4 + 8 * extents.len() as u64,
            ReplyChunk::BlockStatusExt { extents, .. } => 8 + 16 * extents.len() as u64,
            ReplyChunk::Error { message, .. } => 6 + message.len() as u64,
            ReplyChunk::ErrorOffset { message, .. } => 14 + message.len() as u64,
        }
    }

    /// Bytes the encoder writes in `mode`: the header and the payload, except the data of
    /// `OffsetData`. `None` in simple mode.
    pub fn encoded_len(&self, mode: TransmissionMode) -> Option<usize> {
        let header = mode.chunk_header_len()?;
        let body = match self {
            ReplyChunk::OffsetData { .. } => 8,
            ReplyChunk::BlockStatus { extents, .. } => 4 + 8 * extents.len(),
            ReplyChunk::BlockStatusExt { extents, .. } => 8 + 16 * extents.len(),
            ReplyChunk::Error { message, .. } => 6 + message.len(),
            ReplyChunk::ErrorOffset { message, .. } => 14 + message.len(),
            other => other.payload_len() as usize,
        };
        Some(header + body)
    }

    fn check(&self, mode: TransmissionMode) -> Result<(), Error> {
        let invalid = |reason| Err(Error::InvalidArgument { reason });
        match self {
            ReplyChunk::None => {}
            ReplyChunk::OffsetData { data_len, .. } => {
                if *data_len == 0 {
                    return invalid("OFFSET_DATA chunk without data");
                }
                if *data_len > u64::MAX - 8 {
                    return Err(Error::ValueTooLarge {
                        field: "OFFSET_DATA data length",
                        value: *data_len,
                        max: u64::MAX - 8,
                    });
                }
            }
            ReplyChunk::OffsetHole { size, .. } => {
                if *size == 0 {
                    return invalid("OFFSET_HOLE chunk of size 0");
                }
            }
            ReplyChunk::BlockStatus { extents, .. } => {
                if extents.is_empty() {
                    return invalid("BLOCK_STATUS chunk without extents");
                }
                if extents.iter().any(|e| e.length == 0) {
                    return invalid("BLOCK_STATUS extent of length 0");
                }
            }
            ReplyChunk::BlockStatusExt { extents, .. } => {
                if !mode.extended_headers() {
                    return Err(Error::WrongMode {
                        reason: "BLOCK_STATUS_EXT needs extended headers",
                    });
                }
                if extents.is_empty() {
                    return invalid("BLOCK_STATUS_EXT chunk without extents");
                }
                if extents.iter().any(|e| e.length == 0) {
                    return invalid("BLOCK_STATUS_EXT extent of length 0");
                }
                if u32::try_from(extents.len()).is_err() {
                    return invalid("too many BLOCK_STATUS_EXT extents");
                }
            }
            ReplyChunk::Error { error, message }
            | ReplyChunk::ErrorOffset { error, message, .. } => {
                if *error == 0 {
                    return invalid("error chunk with error 0");
                }
                check_str("error message", message)?;
            }
        }
        Ok(())
    }

    /// Writes the chunk (header and payload, but not the data of `OffsetData`) into the start
    /// of `buf` and returns the bytes written ([`encoded_len`](Self::encoded_len)).
    ///
    /// `to` names the request answered; `flags` are the reply flags (pass
    /// [`ReplyFlags::DONE`] on the final chunk). Protocol violations are refused: error 0,
    /// empty block status, zero-length hole or extent, `OffsetData` without data, messages over
    /// 4096 bytes, lengths over 32 bits in structured mode ([`Error::InvalidArgument`],
    /// [`Error::ValueTooLarge`]); `BlockStatusExt` outside extended mode and any chunk in
    /// simple mode ([`Error::WrongMode`]).
    pub fn encode_into(
        &self,
        mode: TransmissionMode,
        to: ReplyTo,
        flags: ReplyFlags,
        buf: &mut [u8],
    ) -> Result<usize, Error> {
        let Some(total) = self.encoded_len(mode) else {
            return Err(Error::WrongMode {
                reason: "reply chunks need structured replies or extended headers",
            });
        };
        self.check(mode)?;
        let flags = match self {
            ReplyChunk::None => flags | ReplyFlags::DONE,
            _ => flags,
        };
        let header = ChunkHeader {
            flags,
            reply_type: self.reply_type(),
            cookie: to.cookie,
            offset: to.offset,
            length: self.payload_len(),
        };
        if buf.len() < total {
            return Err(Error::BufferTooSmall {
                needed: total,
                available: buf.len(),
            });
        }
        let (head, body) = buf.split_at_mut(mode.chunk_header_len().unwrap_or(0));
        header.encode_into(mode, head)?;
        let mut w = Writer::new(body, total - head.len())?;
        match self {
            ReplyChunk::None => {}
            ReplyChunk::OffsetData { offset, .. } => w.u64(*offset),
            ReplyChunk::OffsetHole { offset, size } => {
                w.u64(*offset);
                w.u32(*size);
            }
            ReplyChunk::BlockStatus {
                context_id,
                extents,
            } => {
                w.u32(*context_id);
                for e in *extents {
                    w.u32(e.length);
                    w.u32(e.flags);
                }
            }
            ReplyChunk::BlockStatusExt {
                context_id,
                extents,
            } => {
                w.u32(*context_id);
                w.u32(extents.len() as u32);
                for e in *extents {
                    w.u64(e.length);
                    w.u64(e.flags);
                }
            }
            ReplyChunk::Error { error, message } => {
                w.u32(*error);
                w.u16(message.len() as u16);
                w.bytes(message.as_bytes());
            }
            ReplyChunk::ErrorOffset {
                error,
                message,
                offset,
            } => {
                w.u32(*error);
                w.u16(message.len() as u16);
                w.bytes(message.as_bytes());
                w.u64(*offset);
            }
        }
        Ok(head.len() + w.finish()?)
    }

    /// Appends the chunk to `out`, like [`encode_into`](Self::encode_into); on error nothing
    /// is appended.
    pub fn encode(
        &self,
        mode: TransmissionMode,
        to: ReplyTo,
        flags: ReplyFlags,
        out: &mut Vec<u8>,
    ) -> Result<(), Error> {
        let Some(total) = self.encoded_len(mode) else {
            return Err(Error::WrongMode {
                reason: "reply chunks need structured replies or extended headers",
            });
        };
        append(out, total, |buf| self.encode_into(mode, to, flags, buf))
    }
}

/// A decoded reply header (client side).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReplyHeader {
    /// A simple reply. If it answers a successful `NBD_CMD_READ`, the read's length of data
    /// follows (the client knows it from its request; the reply does not say).
    Simple(SimpleReply),
    /// A structured or extended chunk header; `length` bytes of payload follow, for
    /// [`parse_chunk`].
    Chunk(ChunkHeader),
}

/// Decodes a reply header (client side) in the negotiated `mode`: simple replies only in
/// simple mode, simple replies or structured chunks in structured mode, extended chunks only
/// in extended mode.
///
/// `Incomplete(n)` asks for at least `n` bytes in all (until the magic is known, the shortest
/// header of the mode). A magic not allowed in `mode` is [`Error::BadMagic`] (fatal). The
/// payload length is not checked: a client should drop a server announcing more than it can
/// expect.
pub fn decode_reply_header(
    buf: &[u8],
    mode: TransmissionMode,
) -> Result<Decoded<ReplyHeader>, Error> {
    let mut r = Reader::new(buf);
    let Some(magic) = r.u32() else {
        let min = match mode {
            TransmissionMode::Extended => EXTENDED_REPLY_HEADER_LEN,
            _ => SIMPLE_REPLY_LEN,
        };
        return Ok(Decoded::Incomplete(min));
    };
    let len = match (mode, magic) {
        (TransmissionMode::Simple | TransmissionMode::Structured, NBD_SIMPLE_REPLY_MAGIC) => {
            SIMPLE_REPLY_LEN
        }
        (TransmissionMode::Structured, NBD_STRUCTURED_REPLY_MAGIC) => STRUCTURED_REPLY_HEADER_LEN,
        (TransmissionMode::Extended, NBD_EXTENDED_REPLY_MAGIC) => EXTENDED_REPLY_HEADER_LEN,
        _ => {
            let expected = match mode {
                TransmissionMode::Simple => NBD_SIMPLE_REPLY_MAGIC,
                TransmissionMode::Structured => NBD_STRUCTURED_REPLY_MAGIC,
                TransmissionMode::Extended => NBD_EXTENDED_REPLY_MAGIC,
            };
            return Err(Error::BadMagic {
                expected: u64::from(expected),
                found: u64::from(magic),
            });
        }
    };
    if buf.len() < len {
        return Ok(Decoded::Incomplete(len));
    }
    let header = (|| {
        if magic == NBD_SIMPLE_REPLY_MAGIC {
            let error = r.u32()?;
            let cookie = r.u64()?;
            return Some(ReplyHeader::Simple(SimpleReply { cookie, error }));
        }
        let flags = ReplyFlags::from_bits(r.u16()?);
        let reply_type = r.u16()?;
        let cookie = r.u64()?;
        let (offset, length) = if magic == NBD_EXTENDED_REPLY_MAGIC {
            (r.u64()?, r.u64()?)
        } else {
            (0, u64::from(r.u32()?))
        };
        Some(ReplyHeader::Chunk(ChunkHeader {
            flags,
            reply_type,
            cookie,
            offset,
            length,
        }))
    })();
    match header {
        Some(value) => Ok(Decoded::Complete {
            value,
            consumed: len,
        }),
        None => Ok(Decoded::Incomplete(len)),
    }
}

/// A decoded reply chunk payload (client side), borrowing from the input.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Chunk<'a> {
    /// `NBD_REPLY_TYPE_NONE`.
    None,
    /// `NBD_REPLY_TYPE_OFFSET_DATA`.
    OffsetData {
        /// Offset of the data in the export.
        offset: u64,
        /// The data.
        data: &'a [u8],
    },
    /// `NBD_REPLY_TYPE_OFFSET_HOLE`.
    OffsetHole {
        /// Offset of the hole in the export.
        offset: u64,
        /// Size of the hole.
        size: u32,
    },
    /// `NBD_REPLY_TYPE_BLOCK_STATUS`.
    BlockStatus {
        /// The metadata context id.
        context_id: u32,
        /// The extents.
        extents: Vec<Extent>,
    },
    /// `NBD_REPLY_TYPE_BLOCK_STATUS_EXT`.
    BlockStatusExt {
        /// The metadata context id.
        context_id: u32,
        /// The extents.
        extents: Vec<ExtentExt>,
    },
    /// `NBD_REPLY_TYPE_ERROR`.
    Error {
        /// The error value (nonzero).
        error: u32,
        /// The message.
        message: &'a str,
    },
    /// `NBD_REPLY_TYPE_ERROR_OFFSET`.
    ErrorOffset {
        /// The error value (nonzero).
        error: u32,
        /// The message.
        message: &'a str,
        /// The offset of the error.
        offset: u64,
    },
    /// An error chunk of a type this crate does not know (bit 15 set): the reply has failed,
    /// but the connection can go on.
    OtherError {
        /// The raw chunk type.
        reply_type: u16,
        /// The error value.
        error: u32,
        /// The message.
        message: &'a str,
        /// Type-specific fields after the message.
        rest: &'a [u8],
    },
}

impl Chunk<'_> {
    /// Whether this chunk reports an error.
    pub fn is_error(&self) -> bool {
        matches!(
            self,
            Chunk::Error { .. } | Chunk::ErrorOffset { .. } | Chunk::OtherError { .. }
        )
    }
}

/// An error in a reply chunk's payload.
fn malformed(reason: &'static str) -> Error {
    Error::MalformedReply { reason }
}

/// The payload of a BLOCK_STATUS chunk: a context id and n > 0 extents of 8 bytes, none
/// of length 0.
fn parse_block_status<'a>(r: &mut Reader<'a>) -> Result<Chunk<'a>, Error> {
    let context_id = r
        .u32()
        .ok_or(malformed("BLOCK_STATUS shorter than 4 bytes"))?;
    let n = r.remaining() / 8;
    if n == 0 || n * 8 != r.remaining() {
        return Err(malformed("BLOCK_STATUS length is not 4 + 8n, n > 0"));
    }
    let mut extents = Vec::with_capacity(n);
    while let (Some(length), Some(flags)) = (r.u32(), r.u32()) {
        if length == 0 {
            return Err(malformed("BLOCK_STATUS extent of length 0"));
        }
        extents.push(Extent { length, flags });
    }
    Ok(Chunk::BlockStatus {
        context_id,
        extents,
    })
}

/// The payload of a BLOCK_STATUS_EXT chunk: a context id, a count (0 or n) and n > 0
/// extents of 16 bytes, none of length 0.
fn parse_block_status_ext<'a>(r: &mut Reader<'a>) -> Result<Chunk<'a>, Error> {
    let (Some(context_id), Some(count)) = (r.u32(), r.u32()) else {
        return Err(malformed("BLOCK_STATUS_EXT shorter than 8 bytes"));
    };
    let n = r.remaining() / 16;
    if n == 0 || n * 16 != r.remaining() {
        return Err(malformed("BLOCK_STATUS_EXT length is not 8 + 16n, n > 0"));
    }
    if count != 0 && count as usize != n {
        return Err(malformed("BLOCK_STATUS_EXT count differs from its length"));
    }
    let mut extents = Vec::with_capacity(n);
    while let (Some(length), Some(flags)) = (r.u64(), r.u64()) {
        if length == 0 {
            return Err(malformed("BLOCK_STATUS_EXT extent of length 0"));
        }
        extents.push(ExtentExt { length, flags });
    }
    Ok(Chunk::BlockStatusExt {
        context_id,
        extents,
    })
}

/// Parses the payload of a reply chunk (client side); `payload` is exactly the
/// `header.length` bytes that followed the header.
///
/// Inconsistent chunks give [`Error::MalformedReply`], an unknown non-error chunk type
/// [`Error::UnknownReplyType`]; both are fatal. Unknown error chunk types give
/// [`Chunk::OtherError`].
pub fn parse_chunk<'a>(header: &ChunkHeader, payload: &'a [u8]) -> Result<Chunk<'a>, Error> {
    if payload.len() as u64 != header.length {
        return Err(malformed("payload length differs from the header"));
    }
    let mut r = Reader::new(payload);
    let error_fields = |r: &mut Reader<'a>| -> Result<(u32, &'a str), Error> {
        let (Some(error), Some(msg_len)) = (r.u32(), r.u16()) else {
            return Err(malformed("error chunk shorter than 6 bytes"));
        };
        let message = r
            .take(usize::from(msg_len))
            .ok_or(malformed("error message longer than the chunk"))?;
        Ok((error, parse_str("error message", message)?))
    };
    match header.reply_type {
        NBD_REPLY_TYPE_NONE => {
            if !payload.is_empty() {
                return Err(malformed("NONE chunk with a payload"));
            }
            if !header.is_done() {
                return Err(malformed("NONE chunk without the DONE flag"));
            }
            Ok(Chunk::None)
        }
        NBD_REPLY_TYPE_OFFSET_DATA => {
            let offset = r
                .u64()
                .ok_or(malformed("OFFSET_DATA shorter than 8 bytes"))?;
            if r.remaining() == 0 {
                return Err(malformed("OFFSET_DATA without data"));
            }
            Ok(Chunk::OffsetData {
                offset,
                data: r.rest(),
            })
        }
        NBD_REPLY_TYPE_OFFSET_HOLE => {
            let (Some(offset), Some(size), 0) = (r.u64(), r.u32(), r.remaining()) else {
                return Err(malformed("OFFSET_HOLE length is not 12"));
            };
            if size == 0 {
                return Err(malformed("OFFSET_HOLE of size 0"));
            }
            Ok(Chunk::OffsetHole { offset, size })
        }
        NBD_REPLY_TYPE_BLOCK_STATUS => parse_block_status(&mut r),
        NBD_REPLY_TYPE_BLOCK_STATUS_EXT => parse_block_status_ext(&mut r),
        NBD_REPLY_TYPE_ERROR => {
            let (error, message) = error_fields(&mut r)?;
            if error == 0 {
                return Err(malformed("error chunk with error 0"));
            }
            if r.remaining() != 0 {
                return Err(malformed("ERROR chunk longer than its message"));
            }
            Ok(Chunk::Error { error, message })
        }
        NBD_REPLY_TYPE_ERROR_OFFSET => {
            let (error, message) = error_fields(&mut r)?;
            if error == 0 {
                return Err(malformed("error chunk with error 0"));
            }
            let (Some(offset), 0) = (r.u64(), r.remaining()) else {
                return Err(malformed("ERROR_OFFSET length is not 14 + message"));
            };
            Ok(Chunk::ErrorOffset {
                error,
                message,
                offset,
            })
        }
        t if is_reply_error_type(t) => {
            let (error, message) = error_fields(&mut r)?;
            Ok(Chunk::OtherError {
                reply_type: t,
                error,
                message,
                rest: r.rest(),
            })
        }
        t => Err(Error::UnknownReplyType { reply_type: t }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::{
        Errno, ReplyType, COMPACT_REQUEST_LEN, EXTENDED_REQUEST_LEN, NBD_EINVAL, NBD_EIO,
        NBD_STATE_HOLE, NBD_STATE_ZERO,
    };

    const MODES: [TransmissionMode; 3] = [
        TransmissionMode::Simple,
        TransmissionMode::Structured,
        TransmissionMode::Extended,
    ];

    fn complete<T>(d: Decoded<T>) -> (T, usize) {
        match d {
            Decoded::Complete { value, consumed } => (value, consumed),
            Decoded::Incomplete(n) => panic!("incomplete, needs {n}"),
        }
    }

    #[test]
    fn compact_request_layout() {
        let req = Request::new(Command::Write, 0x0102_0304_0506_0708, 0x1000, 512)
            .with_flags(CmdFlags::FUA);
        let mut buf = [0xaa; 40];
        let n = req
            .encode_into(TransmissionMode::Structured, &mut buf)
            .unwrap();
        assert_eq!(n, COMPACT_REQUEST_LEN);
        let want: [u8; 28] = [
            0x25, 0x60, 0x95, 0x13, 0, 1, 0, 1, 1, 2, 3, 4, 5, 6, 7, 8, 0, 0, 0, 0, 0, 0, 0x10, 0,
            0, 0, 2, 0,
        ];
        assert_eq!(&buf[..28], &want);
        assert_eq!(buf[28], 0xaa);
        assert_eq!(req.payload_len(TransmissionMode::Simple), 512);
    }

    #[test]
    fn extended_request_layout() {
        let req = Request::new(Command::Trim, 9, 1 << 40, 1 << 33);
        let mut v = vec![];
        req.encode(TransmissionMode::Extended, &mut v).unwrap();
        assert_eq!(v.len(), EXTENDED_REQUEST_LEN);
        assert_eq!(&v[..4], &[0x21, 0xe4, 0x1c, 0x71]);
        assert_eq!(&v[24..], &(1u64 << 33).to_be_bytes());
        assert_eq!(req.payload_len(TransmissionMode::Extended), 0);
        // Not representable in a compact header.
        assert!(matches!(
            req.encode(TransmissionMode::Simple, &mut v),
            Err(Error::ValueTooLarge { .. })
        ));
        assert_eq!(v.len(), EXTENDED_REQUEST_LEN);
    }

    #[test]
    fn request_round_trip_all_commands() {
        for mode in MODES {
            for &kind in Command::ALL {
                let req = Request::new(kind, 0xfeed, 4096, 65536)
                    .with_flags(CmdFlags::FUA | CmdFlags::from_bits(0x4000));
                let mut v = vec![];
                req.encode(mode, &mut v).unwrap();
                assert_eq!(complete(decode_request(&v, mode).unwrap()), (req, v.len()));
            }
        }
    }

    #[test]
    fn request_short_buffers() {
        for mode in MODES {
            let mut v = vec![];
            Request::new(Command::Read, 1, 2, 3)
                .encode(mode, &mut v)
                .unwrap();
            for n in 0..v.len() {
                assert_eq!(
                    decode_request(&v[..n], mode),
                    Ok(Decoded::Incomplete(mode.request_header_len()))
                );
            }
            // Extra bytes (a payload, the next request) are left alone.
            v.extend_from_slice(&[1, 2, 3]);
            assert_eq!(complete(decode_request(&v, mode).unwrap()).1, v.len() - 3);
        }
    }

    #[test]
    fn request_bad_magic() {
        let mut v = vec![];
        Request::new(Command::Read, 1, 2, 3)
            .encode(TransmissionMode::Extended, &mut v)
            .unwrap();
        // An extended request where a compact one is expected, and vice versa.
        assert_eq!(
            decode_request(&v[..4], TransmissionMode::Structured),
            Err(Error::BadMagic {
                expected: u64::from(NBD_REQUEST_MAGIC),
                found: u64::from(NBD_EXTENDED_REQUEST_MAGIC)
            })
        );
        let mut c = vec![];
        Request::new(Command::Read, 1, 2, 3)
            .encode(TransmissionMode::Simple, &mut c)
            .unwrap();
        let e = decode_request(&c, TransmissionMode::Extended).unwrap_err();
        assert!(e.is_fatal());
        assert!(matches!(
            decode_request(&[0, 0, 0, 0], TransmissionMode::Simple),
            Err(Error::BadMagic { found: 0, .. })
        ));
        // A reply magic is not a request.
        assert!(decode_request(
            &NBD_SIMPLE_REPLY_MAGIC.to_be_bytes(),
            TransmissionMode::Simple
        )
        .is_err());
    }

    fn raw_request(mode: TransmissionMode, flags: u16, command: u16, length: u64) -> Vec<u8> {
        let mut v = vec![];
        if mode.extended_headers() {
            v.extend_from_slice(&NBD_EXTENDED_REQUEST_MAGIC.to_be_bytes());
        } else {
            v.extend_from_slice(&NBD_REQUEST_MAGIC.to_be_bytes());
        }
        v.extend_from_slice(&flags.to_be_bytes());
        v.extend_from_slice(&command.to_be_bytes());
        v.extend_from_slice(&77u64.to_be_bytes());
        v.extend_from_slice(&5u64.to_be_bytes());
        if mode.extended_headers() {
            v.extend_from_slice(&length.to_be_bytes());
        } else {
            v.extend_from_slice(&(length as u32).to_be_bytes());
        }
        v
    }

    #[test]
    fn unknown_command_is_answerable() {
        let v = raw_request(TransmissionMode::Simple, 0, 42, 100);
        let Err(Error::UnknownCommand(u)) = decode_request(&v, TransmissionMode::Simple) else {
            panic!("expected UnknownCommand");
        };
        assert_eq!(u.command, 42);
        assert_eq!(u.cookie, 77);
        assert_eq!(u.header_len, 28);
        assert_eq!(u.payload_len, 0);
        assert!(!Error::UnknownCommand(u).is_fatal());
        // Extended, with a payload announced.
        let v = raw_request(
            TransmissionMode::Extended,
            CmdFlags::PAYLOAD_LEN.bits(),
            42,
            100,
        );
        let Err(Error::UnknownCommand(u)) = decode_request(&v, TransmissionMode::Extended) else {
            panic!("expected UnknownCommand");
        };
        assert_eq!((u.header_len, u.payload_len, u.length), (32, 100, 100));
        // Without the flag the length is an effect length.
        let v = raw_request(TransmissionMode::Extended, 0, 42, 100);
        let Err(Error::UnknownCommand(u)) = decode_request(&v, TransmissionMode::Extended) else {
            panic!("expected UnknownCommand");
        };
        assert_eq!(u.payload_len, 0);
        // An unknown command still needs the whole header first.
        assert_eq!(
            decode_request(&v[..31], TransmissionMode::Extended),
            Ok(Decoded::Incomplete(32))
        );
    }

    #[test]
    fn payload_lengths() {
        let ext = TransmissionMode::Extended;
        let compact = TransmissionMode::Structured;
        let write = Request::new(Command::Write, 1, 0, 4096);
        assert_eq!(write.payload_len(compact), 4096);
        assert_eq!(write.payload_len(ext), 4096);
        assert_eq!(
            write.with_flags(CmdFlags::PAYLOAD_LEN).payload_len(ext),
            4096
        );
        let bs = Request::new(Command::BlockStatus, 1, 0, 12).with_flags(CmdFlags::PAYLOAD_LEN);
        assert_eq!(bs.payload_len(ext), 12);
        // The flag means nothing in compact mode.
        assert_eq!(bs.payload_len(compact), 0);
        assert_eq!(Request::new(Command::Read, 1, 0, 4096).payload_len(ext), 0);
        let v = raw_request(ext, CmdFlags::PAYLOAD_LEN.bits(), NBD_CMD_WRITE, 1 << 20);
        let (req, _) = complete(decode_request(&v, ext).unwrap());
        assert_eq!(req.payload_len(ext), 1 << 20);
    }

    #[test]
    fn zero_length_requests_decode() {
        for mode in MODES {
            let v = raw_request(mode, 0, NBD_CMD_WRITE, 0);
            let (req, _) = complete(decode_request(&v, mode).unwrap());
            assert_eq!(req.length, 0);
            assert_eq!(req.payload_len(mode), 0);
        }
    }

    #[test]
    fn simple_reply() {
        let r = SimpleReply {
            cookie: 0x1122_3344_5566_7788,
            error: NBD_EIO,
        };
        let mut buf = [0u8; 16];
        assert_eq!(r.encode_into(&mut buf), Ok(16));
        assert_eq!(
            buf,
            [0x67, 0x44, 0x66, 0x98, 0, 0, 0, 5, 0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77, 0x88]
        );
        let mut v = vec![];
        r.encode(&mut v);
        assert_eq!(v, buf);
        assert!(matches!(
            r.encode_into(&mut buf[..15]),
            Err(Error::BufferTooSmall {
                needed: 16,
                available: 15
            })
        ));
        for mode in [TransmissionMode::Simple, TransmissionMode::Structured] {
            for n in 0..16 {
                assert_eq!(
                    decode_reply_header(&v[..n], mode),
                    Ok(Decoded::Incomplete(16))
                );
            }
            assert_eq!(
                complete(decode_reply_header(&v, mode).unwrap()),
                (ReplyHeader::Simple(r), 16)
            );
        }
        assert!(matches!(
            decode_reply_header(&v, TransmissionMode::Extended),
            Err(Error::BadMagic { .. })
        ));
    }

    fn chunk_round_trip(mode: TransmissionMode, chunk: ReplyChunk<'_>, flags: ReplyFlags) {
        let to = ReplyTo {
            cookie: 0xc00c1e,
            offset: 1 << 20,
        };
        let mut v = vec![0xee];
        chunk.encode(mode, to, flags, &mut v).unwrap();
        let v = &v[1..];
        assert_eq!(Some(v.len()), chunk.encoded_len(mode));
        let mut buf = vec![0u8; v.len()];
        assert_eq!(chunk.encode_into(mode, to, flags, &mut buf), Ok(v.len()));
        assert_eq!(buf, v);
        let header_len = mode.chunk_header_len().unwrap();
        for n in 0..header_len {
            let d = decode_reply_header(&v[..n], mode).unwrap();
            assert!(!d.is_complete());
        }
        let (ReplyHeader::Chunk(h), used) = complete(decode_reply_header(v, mode).unwrap()) else {
            panic!("not a chunk");
        };
        assert_eq!(used, header_len);
        assert_eq!(h.reply_type, chunk.reply_type());
        assert_eq!(h.cookie, to.cookie);
        assert_eq!(h.length, chunk.payload_len());
        assert_eq!(
            h.offset,
            if mode.extended_headers() {
                to.offset
            } else {
                0
            }
        );
        let want_flags = if chunk == ReplyChunk::None {
            flags | ReplyFlags::DONE
        } else {
            flags
        };
        assert_eq!(h.flags, want_flags);
        // OFFSET_DATA: append the data the caller would send.
        let mut payload = v[used..].to_vec();
        let data: Vec<u8> = (0..h.length.saturating_sub(payload.len() as u64))
            .map(|i| i as u8)
            .collect();
        payload.extend_from_slice(&data);
        let parsed = parse_chunk(&h, &payload).unwrap();
        let want = match chunk {
            ReplyChunk::None => Chunk::None,
            ReplyChunk::OffsetData { offset, .. } => Chunk::OffsetData {
                offset,
                data: &data,
            },
            ReplyChunk::OffsetHole { offset, size } => Chunk::OffsetHole { offset, size },
            ReplyChunk::BlockStatus {
                context_id,
                extents,
            } => Chunk::BlockStatus {
                context_id,
                extents: extents.to_vec(),
            },
            ReplyChunk::BlockStatusExt {
                context_id,
                extents,
            } => Chunk::BlockStatusExt {
                context_id,
                extents: extents.to_vec(),
            },
            ReplyChunk::Error { error, message } => Chunk::Error { error, message },
            ReplyChunk::ErrorOffset {
                error,
                message,
                offset,
            } => Chunk::ErrorOffset {
                error,
                message,
                offset,
            },
        };
        assert_eq!(parsed, want);
    }

    #[test]
    fn chunks_round_trip() {
        let extents = [
            Extent {
                length: 4096,
                flags: NBD_STATE_HOLE | NBD_STATE_ZERO,
            },
            Extent {
                length: 1 << 20,
                flags: 0,
            },
        ];
        let ext_extents = [ExtentExt {
            length: 1 << 40,
            flags: u64::from(NBD_STATE_ZERO),
        }];
        for mode in [TransmissionMode::Structured, TransmissionMode::Extended] {
            for flags in [ReplyFlags::empty(), ReplyFlags::DONE] {
                chunk_round_trip(mode, ReplyChunk::None, flags);
                chunk_round_trip(
                    mode,
                    ReplyChunk::OffsetData {
                        offset: 512,
                        data_len: 100,
                    },
                    flags,
                );
                chunk_round_trip(
                    mode,
                    ReplyChunk::OffsetHole {
                        offset: 4096,
                        size: 8192,
                    },
                    flags,
                );
                chunk_round_trip(
                    mode,
                    ReplyChunk::BlockStatus {
                        context_id: 1,
                        extents: &extents,
                    },
                    flags,
                );
                chunk_round_trip(
                    mode,
                    ReplyChunk::Error {
                        error: NBD_EINVAL,
                        message: "",
                    },
                    flags,
                );
                chunk_round_trip(
                    mode,
                    ReplyChunk::Error {
                        error: Errno::Shutdown.as_u32(),
                        message: "going away",
                    },
                    flags,
                );
                chunk_round_trip(
                    mode,
                    ReplyChunk::ErrorOffset {
                        error: NBD_EIO,
                        message: "bad sector",
                        offset: 1 << 30,
                    },
                    flags,
                );
            }
        }
        chunk_round_trip(
            TransmissionMode::Extended,
            ReplyChunk::BlockStatusExt {
                context_id: 2,
                extents: &ext_extents,
            },
            ReplyFlags::DONE,
        );
    }

    #[test]
    fn chunk_layouts() {
        let mut v = vec![];
        let to = ReplyTo {
            cookie: 1,
            offset: 0x200,
        };
        ReplyChunk::None
            .encode(
                TransmissionMode::Structured,
                to,
                ReplyFlags::empty(),
                &mut v,
            )
            .unwrap();
        assert_eq!(
            v,
            [0x66, 0x8e, 0x33, 0xef, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0]
        );
        v.clear();
        ReplyChunk::OffsetData {
            offset: 0x200,
            data_len: 3,
        }
        .encode(TransmissionMode::Extended, to, ReplyFlags::DONE, &mut v)
        .unwrap();
        let mut want = vec![0x6e, 0x8a, 0x27, 0x8c, 0, 1, 0, 1];
        want.extend_from_slice(&1u64.to_be_bytes());
        want.extend_from_slice(&0x200u64.to_be_bytes());
        want.extend_from_slice(&11u64.to_be_bytes());
        want.extend_from_slice(&0x200u64.to_be_bytes());
        assert_eq!(v, want);
        v.clear();
        let ext = [ExtentExt {
            length: 5,
            flags: 3,
        }];
        ReplyChunk::BlockStatusExt {
            context_id: 7,
            extents: &ext,
        }
        .encode(TransmissionMode::Extended, to, ReplyFlags::DONE, &mut v)
        .unwrap();
        assert_eq!(&v[24..32], &24u64.to_be_bytes());
        assert_eq!(&v[32..40], &[0, 0, 0, 7, 0, 0, 0, 1]);
        assert_eq!(&v[40..], &[0, 0, 0, 0, 0, 0, 0, 5, 0, 0, 0, 0, 0, 0, 0, 3]);
    }

    /// Each chunk the protocol or the mode forbids is refused with the error that says why,
    /// and leaves the output as it was.
    #[test]
    fn chunk_encoding_refuses_violations() {
        let to = ReplyTo::default();
        let s = TransmissionMode::Structured;
        let f = ReplyFlags::DONE;
        let zero = [Extent {
            length: 0,
            flags: 0,
        }];
        let ext = [ExtentExt {
            length: 1,
            flags: 0,
        }];
        let long = "e".repeat(4097);
        let wrong_mode = |e: &Error| matches!(e, Error::WrongMode { .. });
        let invalid = |e: &Error| matches!(e, Error::InvalidArgument { .. });
        let too_large = |e: &Error| matches!(e, Error::ValueTooLarge { .. });
        let too_long = |e: &Error| matches!(e, Error::StringTooLong { .. });
        type Expect = fn(&Error) -> bool;
        let cases: [(ReplyChunk<'_>, TransmissionMode, Expect); 9] = [
            (ReplyChunk::None, TransmissionMode::Simple, wrong_mode),
            (
                ReplyChunk::Error {
                    error: 0,
                    message: "",
                },
                s,
                invalid,
            ),
            (
                ReplyChunk::BlockStatus {
                    context_id: 1,
                    extents: &[],
                },
                s,
                invalid,
            ),
            (
                ReplyChunk::BlockStatus {
                    context_id: 1,
                    extents: &zero,
                },
                s,
                invalid,
            ),
            (
                ReplyChunk::BlockStatusExt {
                    context_id: 1,
                    extents: &ext,
                },
                s,
                wrong_mode,
            ),
            (ReplyChunk::OffsetHole { offset: 0, size: 0 }, s, invalid),
            (
                ReplyChunk::OffsetData {
                    offset: 0,
                    data_len: 0,
                },
                s,
                invalid,
            ),
            (
                ReplyChunk::OffsetData {
                    offset: 0,
                    data_len: u64::from(u32::MAX),
                },
                s,
                too_large,
            ),
            (
                ReplyChunk::Error {
                    error: 5,
                    message: &long,
                },
                s,
                too_long,
            ),
        ];
        let mut v = vec![1, 2];
        for (i, (c, mode, expect)) in cases.into_iter().enumerate() {
            let e = c.encode(mode, to, f, &mut v).unwrap_err();
            assert!(expect(&e), "case {i}: {e:?}");
        }
        assert_eq!(v, [1, 2]);
    }

    /// What the compact headers refuse, extended headers take; a buffer too short for a
    /// chunk, and a chunk header outside structured replies, are refused.
    #[test]
    fn chunk_encoding_bounds_by_mode_and_buffer() {
        let to = ReplyTo::default();
        let s = TransmissionMode::Structured;
        let f = ReplyFlags::DONE;
        let mut v = Vec::new();
        // Large OFFSET_DATA is fine with extended headers.
        ReplyChunk::OffsetData {
            offset: 0,
            data_len: 1 << 33,
        }
        .encode(TransmissionMode::Extended, to, f, &mut v)
        .unwrap();
        // A short buffer.
        let mut small = [0u8; 27];
        assert!(matches!(
            ReplyChunk::OffsetHole { offset: 0, size: 1 }.encode_into(s, to, f, &mut small),
            Err(Error::BufferTooSmall {
                needed: 32,
                available: 27
            })
        ));
        assert!(matches!(
            ChunkHeader {
                flags: f,
                reply_type: 0,
                cookie: 0,
                offset: 0,
                length: 0
            }
            .encode_into(TransmissionMode::Simple, &mut small),
            Err(Error::WrongMode { .. })
        ));
    }

    fn header(reply_type: u16, flags: ReplyFlags, length: usize) -> ChunkHeader {
        ChunkHeader {
            flags,
            reply_type,
            cookie: 1,
            offset: 0,
            length: length as u64,
        }
    }

    #[test]
    fn malformed_chunks() {
        let mal = |t: u16, f: ReplyFlags, p: &[u8]| {
            matches!(
                parse_chunk(&header(t, f, p.len()), p),
                Err(Error::MalformedReply { .. })
            )
        };
        let d = ReplyFlags::DONE;
        // Length mismatch with the header.
        assert!(matches!(
            parse_chunk(&header(NBD_REPLY_TYPE_NONE, d, 1), &[]),
            Err(Error::MalformedReply { .. })
        ));
        assert!(mal(NBD_REPLY_TYPE_NONE, d, &[0]));
        assert!(mal(NBD_REPLY_TYPE_NONE, ReplyFlags::empty(), &[]));
        assert!(mal(NBD_REPLY_TYPE_OFFSET_DATA, d, &[0; 7]));
        assert!(mal(NBD_REPLY_TYPE_OFFSET_DATA, d, &[0; 8]));
        assert!(!mal(NBD_REPLY_TYPE_OFFSET_DATA, d, &[0; 9]));
        assert!(mal(NBD_REPLY_TYPE_OFFSET_HOLE, d, &[0; 11]));
        assert!(mal(NBD_REPLY_TYPE_OFFSET_HOLE, d, &[0; 13]));
        assert!(mal(NBD_REPLY_TYPE_OFFSET_HOLE, d, &[0; 12]));
        assert!(mal(NBD_REPLY_TYPE_BLOCK_STATUS, d, &[0; 4]));
        assert!(mal(NBD_REPLY_TYPE_BLOCK_STATUS, d, &[0; 11]));
        assert!(mal(NBD_REPLY_TYPE_BLOCK_STATUS, d, &[0; 12]));
        assert!(!mal(
            NBD_REPLY_TYPE_BLOCK_STATUS,
            d,
            &[0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 0]
        ));
        let mut ext = vec![0, 0, 0, 1, 0, 0, 0, 2];
        ext.extend_from_slice(&[0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0]);
        assert!(mal(NBD_REPLY_TYPE_BLOCK_STATUS_EXT, d, &ext));
        ext[7] = 0;
        assert!(!mal(NBD_REPLY_TYPE_BLOCK_STATUS_EXT, d, &ext));
        ext[7] = 1;
        assert!(!mal(NBD_REPLY_TYPE_BLOCK_STATUS_EXT, d, &ext));
        assert!(mal(NBD_REPLY_TYPE_BLOCK_STATUS_EXT, d, &ext[..20]));
        assert!(mal(NBD_REPLY_TYPE_BLOCK_STATUS_EXT, d, &ext[..8]));
        ext[15] = 0;
        assert!(mal(NBD_REPLY_TYPE_BLOCK_STATUS_EXT, d, &ext));
        // Error chunks.
        assert!(mal(NBD_REPLY_TYPE_ERROR, d, &[0, 0, 0, 5, 0]));
        assert!(mal(NBD_REPLY_TYPE_ERROR, d, &[0, 0, 0, 0, 0, 0]));
        assert!(mal(NBD_REPLY_TYPE_ERROR, d, &[0, 0, 0, 5, 0, 2, b'a']));
        assert!(mal(NBD_REPLY_TYPE_ERROR, d, &[0, 0, 0, 5, 0, 0, 9]));
        assert!(!mal(NBD_REPLY_TYPE_ERROR, d, &[0, 0, 0, 5, 0, 1, b'a']));
        assert!(mal(NBD_REPLY_TYPE_ERROR_OFFSET, d, &[0, 0, 0, 5, 0, 0]));
        assert!(matches!(
            parse_chunk(
                &header(NBD_REPLY_TYPE_ERROR, d, 7),
                &[0, 0, 0, 5, 0, 1, 0xff]
            ),
            Err(Error::InvalidString { .. })
        ));
        // Unknown types.
        let e = parse_chunk(&header(3, d, 0), &[]).unwrap_err();
        assert_eq!(e, Error::UnknownReplyType { reply_type: 3 });
        assert!(e.is_fatal());
        let other = parse_chunk(
            &header(0x8005, d, 9),
            &[0, 0, 0, 22, 0, 1, b'x', 0xab, 0xcd],
        )
        .unwrap();
        assert!(other.is_error());
        assert_eq!(
            other,
            Chunk::OtherError {
                reply_type: 0x8005,
                error: 22,
                message: "x",
                rest: &[0xab, 0xcd]
            }
        );
        assert!(mal(0x8005, d, &[0, 0, 0, 22, 0, 9, b'x']));
        assert_eq!(ReplyType::from_u16(0x8005), None);
    }

    #[test]
    fn reply_header_modes() {
        let to = ReplyTo {
            cookie: 3,
            offset: 0,
        };
        let mut structured = vec![];
        ReplyChunk::None
            .encode(
                TransmissionMode::Structured,
                to,
                ReplyFlags::DONE,
                &mut structured,
            )
            .unwrap();
        let mut extended = vec![];
        ReplyChunk::None
            .encode(
                TransmissionMode::Extended,
                to,
                ReplyFlags::DONE,
                &mut extended,
            )
            .unwrap();
        // Structured chunks are not allowed in simple or extended mode.
        assert!(decode_reply_header(&structured, TransmissionMode::Simple).is_err());
        assert!(decode_reply_header(&structured, TransmissionMode::Extended).is_err());
        assert!(decode_reply_header(&extended, TransmissionMode::Structured).is_err());
        assert!(decode_reply_header(&extended, TransmissionMode::Extended).is_ok());
        // Incomplete asks for the full header once the magic is known.
        assert_eq!(
            decode_reply_header(&structured[..4], TransmissionMode::Structured),
            Ok(Decoded::Incomplete(20))
        );
        assert_eq!(
            decode_reply_header(&extended[..3], TransmissionMode::Extended),
            Ok(Decoded::Incomplete(32))
        );
        assert_eq!(
            decode_reply_header(&[], TransmissionMode::Structured),
            Ok(Decoded::Incomplete(16))
        );
    }
}
