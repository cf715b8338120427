//! Drivers that push arbitrary bytes through every decoder of the crate, as a peer's byte
//! stream would, and check on the way that whatever decodes re-encodes to the same bytes.
//!
//! They are what the fuzz targets (`crates/nbd-proto/fuzz`) run, and what `tests/corpus.rs` runs
//! on the seed corpus. The first input byte selects what the rest is (see [`handshake`] and
//! [`request`]); an empty input does nothing.
//!
//! The drivers panic only when the codec contradicts itself (a decoded message that does not
//! re-encode to its own bytes, or an error classified inconsistently): that is the bug a
//! fuzzer is looking for.

use crate::handshake::{
    decode_client_flags, decode_export_name_reply, decode_option_header,
    decode_option_reply_header, decode_server_greeting, encode_option_reply, parse_option,
    parse_option_reply, ClientOption, DEFAULT_MAX_OPTION_LEN, DEFAULT_MAX_OPTION_REPLY_LEN,
};
use crate::proto::{HandshakeFlags, TransmissionMode, OPTION_HEADER_LEN};
use crate::transmission::{
    decode_reply_header, decode_request, parse_chunk, Chunk, ChunkHeader, ReplyChunk, ReplyHeader,
    ReplyTo,
};
use crate::{Decoded, Error};

/// What a driver made of its input.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Outcome {
    /// Messages decoded successfully.
    pub messages: usize,
    /// Messages rejected with a non-fatal error (an invalid option, an unknown command, ...)
    /// and skipped, as a server or client would.
    pub rejected: usize,
    /// The fatal error that stopped decoding, if any.
    pub fatal: Option<Error>,
    /// Whether the input ended in the middle of a message.
    pub incomplete: bool,
    /// Input bytes consumed, the selector byte included.
    pub consumed: usize,
}

impl Outcome {
    /// Whether the whole input decoded as valid messages: nothing rejected, no fatal error,
    /// nothing left over.
    pub fn is_clean(&self) -> bool {
        self.rejected == 0 && self.fatal.is_none() && !self.incomplete
    }
}

/// Handshake driver. Selector byte (the first): even, the rest is what a server reads (client
/// flags, then options: headers with at most [`DEFAULT_MAX_OPTION_LEN`] bytes of data, each
/// parsed); odd, what a client reads: `(selector >> 1) % 3` = 0, a greeting then option
/// replies; 1, an `NBD_OPT_EXPORT_NAME` reply with the zeroes; 2, one without.
pub fn handshake(data: &[u8]) -> Outcome {
    let Some((&selector, rest)) = data.split_first() else {
        return Outcome::default();
    };
    let mut out = if selector & 1 == 0 {
        server_side(rest)
    } else {
        match (selector >> 1) % 3 {
            0 => client_side(rest),
            n => export_name_reply(rest, n == 2),
        }
    };
    out.consumed += 1;
    out
}

/// Transmission driver. Selector byte (the first): `(selector >> 1) % 3` picks the mode
/// (simple, structured, extended); an even selector makes the rest a stream of requests as a
/// server reads them (payloads skipped), an odd one a stream of replies as a client reads them
/// (simple replies carry no data here; chunk payloads are parsed).
pub fn request(data: &[u8]) -> Outcome {
    let Some((&selector, rest)) = data.split_first() else {
        return Outcome::default();
    };
    let mode = [
        TransmissionMode::Simple,
        TransmissionMode::Structured,
        TransmissionMode::Extended,
    ][usize::from(selector >> 1) % 3];
    let mut out = if selector & 1 == 0 {
        requests(rest, mode)
    } else {
        replies(rest, mode)
    };
    out.consumed += 1;
    out
}

/// Skips `n` bytes at `pos` if present.
fn skip(buf: &[u8], pos: usize, n: u64) -> Option<usize> {
    let n = usize::try_from(n).ok()?;
    let end = pos.checked_add(n)?;
    (end <= buf.len()).then_some(end)
}

/// The outcome of the opening message (client flags, a server greeting), every error of which
/// is fatal (`what` names it), and whether decoding goes on after it.
fn opening<T>(first: Result<Decoded<T>, Error>, what: &str) -> (Outcome, bool) {
    let mut out = Outcome::default();
    match first {
        Ok(Decoded::Complete { consumed, .. }) => {
            out.messages += 1;
            out.consumed = consumed;
            return (out, true);
        }
        Ok(Decoded::Incomplete(_)) => out.incomplete = true,
        Err(e) => {
            assert!(e.is_fatal(), "{what} errors are fatal: {e:?}");
            out.fatal = Some(e);
        }
    }
    (out, false)
}

fn server_side(buf: &[u8]) -> Outcome {
    let (mut out, go_on) = opening(
        decode_client_flags(buf, HandshakeFlags::KNOWN),
        "client flag",
    );
    if !go_on {
        return out;
    }
    while out.consumed < buf.len() {
        let pos = out.consumed;
        let header = match decode_option_header(&buf[pos..], DEFAULT_MAX_OPTION_LEN) {
            Ok(Decoded::Complete { value, consumed }) => {
                assert_eq!(consumed, OPTION_HEADER_LEN);
                value
            }
            Ok(Decoded::Incomplete(n)) => {
                assert!(n > buf.len() - pos, "Incomplete({n}) with enough input");
                out.incomplete = true;
                break;
            }
            Err(Error::OptionTooLong { length, .. }) => {
                // A server may discard the data and answer NBD_REP_ERR_TOO_BIG.
                match skip(buf, pos + OPTION_HEADER_LEN, u64::from(length)) {
                    Some(end) => {
                        out.rejected += 1;
                        out.consumed = end;
                        continue;
                    }
                    None => {
                        out.incomplete = true;
                        break;
                    }
                }
            }
            Err(e) => {
                assert!(e.is_fatal(), "option header errors are fatal: {e:?}");
                out.fatal = Some(e);
                break;
            }
        };
        let start = pos + OPTION_HEADER_LEN;
        let Some(end) = skip(buf, start, u64::from(header.length)) else {
            out.incomplete = true;
            break;
        };
        match parse_option(header.option, &buf[start..end]) {
            Ok(opt) => {
                out.messages += 1;
                let mut again = Vec::new();
                opt.encode(&mut again)
                    .unwrap_or_else(|e| panic!("parsed option does not re-encode: {e:?}"));
                if opt == ClientOption::Abort {
                    // Data sent with NBD_OPT_ABORT is ignored, so only the code survives.
                    assert_eq!(again.len(), OPTION_HEADER_LEN);
                    assert_eq!(&again[..12], &buf[pos..pos + 12]);
                } else {
                    assert_eq!(again, &buf[pos..end], "option re-encodes differently");
                }
            }
            Err(e) => {
                assert!(!e.is_fatal(), "option data errors are not fatal: {e:?}");
                assert!(e.option_error().is_some(), "no option error for {e:?}");
                out.rejected += 1;
            }
        }
        out.consumed = end;
    }
    out
}

fn client_side(buf: &[u8]) -> Outcome {
    let (mut out, go_on) = opening(decode_server_greeting(buf), "greeting");
    if !go_on {
        return out;
    }
    while out.consumed < buf.len() {
        let pos = out.consumed;
        let header = match decode_option_reply_header(&buf[pos..], DEFAULT_MAX_OPTION_REPLY_LEN) {
            Ok(Decoded::Complete { value, .. }) => value,
            Ok(Decoded::Incomplete(_)) => {
                out.incomplete = true;
                break;
            }
            Err(e) => {
                assert!(e.is_fatal(), "option reply header errors are fatal: {e:?}");
                out.fatal = Some(e);
                break;
            }
        };
        let start = pos + crate::proto::OPTION_REPLY_HEADER_LEN;
        let Some(end) = skip(buf, start, u64::from(header.length)) else {
            out.incomplete = true;
            break;
        };
        match parse_option_reply(header.reply_type, &buf[start..end]) {
            Ok(reply) => {
                out.messages += 1;
                let mut again = Vec::new();
                encode_option_reply(header.option, &reply, &mut again)
                    .unwrap_or_else(|e| panic!("parsed option reply does not re-encode: {e:?}"));
                assert_eq!(again, &buf[pos..end], "option reply re-encodes differently");
            }
            Err(e @ Error::MalformedReply { .. }) => {
                out.fatal = Some(e);
                break;
            }
            Err(e) => {
                assert!(
                    matches!(e, Error::InvalidString { .. } | Error::StringTooLong { .. }),
                    "unexpected option reply error {e:?}"
                );
                out.rejected += 1;
            }
        }
        out.consumed = end;
    }
    out
}

fn export_name_reply(buf: &[u8], no_zeroes: bool) -> Outcome {
    let mut out = Outcome::default();
    match decode_export_name_reply(buf, no_zeroes) {
        Ok(Decoded::Complete { value, consumed }) => {
            let mut again = Vec::new();
            crate::handshake::encode_export_name_reply(value, no_zeroes, &mut again);
            assert_eq!(again.len(), consumed);
            assert_eq!(
                again[..10],
                buf[..10],
                "export name reply re-encodes differently"
            );
            out.messages = 1;
            out.consumed = consumed;
            // Bytes after the reply would belong to the transmission phase: count them as
            // left over.
            if consumed < buf.len() {
                out.rejected = 1;
            }
        }
        Ok(Decoded::Incomplete(_)) => out.incomplete = true,
        Err(e) => out.fatal = Some(e),
    }
    out
}

fn requests(buf: &[u8], mode: TransmissionMode) -> Outcome {
    let mut out = Outcome::default();
    while out.consumed < buf.len() {
        let pos = out.consumed;
        match decode_request(&buf[pos..], mode) {
            Ok(Decoded::Complete { value, consumed }) => {
                assert_eq!(consumed, mode.request_header_len());
                let mut again = Vec::new();
                value
                    .encode(mode, &mut again)
                    .unwrap_or_else(|e| panic!("decoded request does not re-encode: {e:?}"));
                assert_eq!(
                    again,
                    &buf[pos..pos + consumed],
                    "request re-encodes differently"
                );
                match skip(buf, pos + consumed, value.payload_len(mode)) {
                    Some(end) => {
                        out.messages += 1;
                        out.consumed = end;
                    }
                    None => {
                        out.incomplete = true;
                        break;
                    }
                }
            }
            Ok(Decoded::Incomplete(n)) => {
                assert!(n > buf.len() - pos, "Incomplete({n}) with enough input");
                out.incomplete = true;
                break;
            }
            Err(Error::UnknownCommand(u)) => {
                assert_eq!(u.header_len, mode.request_header_len());
                match skip(buf, pos + u.header_len, u.payload_len) {
                    Some(end) => {
                        out.rejected += 1;
                        out.consumed = end;
                    }
                    None => {
                        out.incomplete = true;
                        break;
                    }
                }
            }
            Err(e) => {
                assert!(
                    e.is_fatal(),
                    "request errors other than UnknownCommand are fatal"
                );
                out.fatal = Some(e);
                break;
            }
        }
    }
    out
}

/// Re-encodes a decoded chunk and checks it gives back the bytes it came from (for the
/// chunks whose encoding is canonical).
fn check_chunk_round_trip(
    mode: TransmissionMode,
    header: &ChunkHeader,
    chunk: &Chunk<'_>,
    raw: &[u8],
) {
    let to = ReplyTo {
        cookie: header.cookie,
        offset: header.offset,
    };
    let again = match chunk {
        Chunk::None => ReplyChunk::None,
        Chunk::OffsetData { offset, data } => ReplyChunk::OffsetData {
            offset: *offset,
            data_len: data.len() as u64,
        },
        Chunk::OffsetHole { offset, size } => ReplyChunk::OffsetHole {
            offset: *offset,
            size: *size,
        },
        Chunk::BlockStatus {
            context_id,
            extents,
        } => ReplyChunk::BlockStatus {
            context_id: *context_id,
            extents,
        },
        Chunk::BlockStatusExt {
            context_id,
            extents,
        } => {
            // The encoder always fills in the descriptor count, which a server may leave 0;
            // and the chunk type is only encodable with extended headers.
            let header_len = mode.chunk_header_len().unwrap_or(0);
            let count = raw.get(header_len + 4..header_len + 8);
            if !mode.extended_headers() || count == Some(&[0, 0, 0, 0][..]) {
                return;
            }
            ReplyChunk::BlockStatusExt {
                context_id: *context_id,
                extents,
            }
        }
        Chunk::Error { error, message } => ReplyChunk::Error {
            error: *error,
            message,
        },
        Chunk::ErrorOffset {
            error,
            message,
            offset,
        } => ReplyChunk::ErrorOffset {
            error: *error,
            message,
            offset: *offset,
        },
        _ => return,
    };
    let mut buf = Vec::new();
    again
        .encode(mode, to, header.flags, &mut buf)
        .unwrap_or_else(|e| panic!("decoded chunk does not re-encode: {e:?}"));
    assert_eq!(buf, &raw[..buf.len()], "chunk re-encodes differently");
}

fn replies(buf: &[u8], mode: TransmissionMode) -> Outcome {
    let mut out = Outcome::default();
    while out.consumed < buf.len() {
        let pos = out.consumed;
        let (header, consumed) = match decode_reply_header(&buf[pos..], mode) {
            Ok(Decoded::Complete { value, consumed }) => (value, consumed),
            Ok(Decoded::Incomplete(n)) => {
                assert!(n > buf.len() - pos, "Incomplete({n}) with enough input");
                out.incomplete = true;
                break;
            }
            Err(e) => {
                assert!(e.is_fatal(), "reply header errors are fatal: {e:?}");
                out.fatal = Some(e);
                break;
            }
        };
        match header {
            ReplyHeader::Simple(simple) => {
                let mut again = Vec::new();
                simple.encode(&mut again);
                assert_eq!(again, &buf[pos..pos + consumed]);
                out.messages += 1;
                out.consumed = pos + consumed;
            }
            ReplyHeader::Chunk(h) => {
                let start = pos + consumed;
                let Some(end) = skip(buf, start, h.length) else {
                    out.incomplete = true;
                    break;
                };
                let mut again = Vec::new();
                h.encode(mode, &mut again)
                    .unwrap_or_else(|e| panic!("decoded chunk header does not re-encode: {e:?}"));
                assert_eq!(
                    again,
                    &buf[pos..start],
                    "chunk header re-encodes differently"
                );
                match parse_chunk(&h, &buf[start..end]) {
                    Ok(chunk) => {
                        check_chunk_round_trip(mode, &h, &chunk, &buf[pos..end]);
                        out.messages += 1;
                    }
                    Err(e) if e.is_fatal() => {
                        out.fatal = Some(e);
                        break;
                    }
                    Err(_) => out.rejected += 1,
                }
                out.consumed = end;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_and_tiny_inputs() {
        assert_eq!(handshake(&[]), Outcome::default());
        assert_eq!(request(&[]), Outcome::default());
        for sel in 0..=255u8 {
            let h = handshake(&[sel]);
            assert_eq!(h.consumed, 1);
            let r = request(&[sel]);
            assert!(r.is_clean(), "{sel}: {r:?}");
            assert_eq!(r.messages, 0);
        }
    }
}
