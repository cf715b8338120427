//! `nbd-proto`: the NBD (Network Block Device) protocol's types and a codec that does no I/O.
//!
//! Everything here is a pure function over byte slices: decoders take `&[u8]` and say how many
//! bytes they used or how many they still need ([`Decoded`]); encoders append to a `Vec<u8>` or
//! write into a caller's `&mut [u8]`. Servers and clients own their sockets and buffers and
//! call into this crate, which makes the codec easy to test, fuzz and embed in any I/O model.
//! The crate depends on no block layer, no runtime and no synchronisation facade (only
//! `thiserror`); the server and client live in the `nbd` crate, which re-exports this one.
//!
//! The protocol is `doc/proto.md` of the NetworkBlockDevice/nbd repository, fixed newstyle
//! negotiation, with structured replies, metadata contexts, block status and the extended
//! headers extension (64-bit lengths, 32-byte request and reply headers).
//!
//! - [`proto`]: every constant (magics, flags, option / reply / info / command / chunk types,
//!   error values) raw and typed ([`OptionCode`], [`Command`], [`TransmissionFlags`],
//!   [`Errno`] with the one libc-errno-to-NBD mapping, ...).
//! - [`handshake`]: greeting, client flags, options ([`ClientOption`]) and option replies
//!   ([`OptionReply`]), the `NBD_OPT_EXPORT_NAME` reply.
//! - [`transmission`]: [`Request`] headers (compact and extended), [`SimpleReply`], reply chunks
//!   ([`ReplyChunk`] to encode, [`Chunk`] decoded), block-status [`Extent`]s.
//! - [`harness`]: drivers that push arbitrary bytes through every decoder, for the fuzz
//!   targets (`fuzz/`) and the corpus test (`tests/corpus.rs`).
//!
//! Decoders never panic and never allocate more than the input they were given justifies.
#![warn(missing_docs)]
#![forbid(unsafe_code)]
#![warn(clippy::too_many_lines)]

mod error;
pub mod handshake;
pub mod harness;
pub mod proto;
pub mod transmission;
mod wire;

pub use error::{Error, UnknownRequest};
pub use handshake::{
    decode_client_flags, decode_export_name_reply, decode_option_header,
    decode_option_reply_header, decode_server_greeting, encode_client_flags,
    encode_export_name_reply, encode_option_reply, encode_server_greeting, parse_option,
    parse_option_reply, BlockSize, ClientOption, ExportInfo, ExportRequest, Info,
    MetaContextRequest, OptionHeader, OptionReply, OptionReplyHeader, DEFAULT_MAX_OPTION_LEN,
    DEFAULT_MAX_OPTION_REPLY_LEN,
};
pub use proto::{
    ClientFlags, CmdFlags, Command, Errno, HandshakeFlags, InfoType, OptionCode, OptionError,
    OptionReplyType, ReplyFlags, ReplyType, TransmissionFlags, TransmissionMode,
};
pub use transmission::{
    decode_reply_header, decode_request, parse_chunk, Chunk, ChunkHeader, Extent, ExtentExt,
    ReplyChunk, ReplyHeader, ReplyTo, Request, SimpleReply,
};

/// The result of a decoder that may need more input.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[must_use]
pub enum Decoded<T> {
    /// A whole message was decoded from the start of the buffer.
    Complete {
        /// The message.
        value: T,
        /// Bytes of the buffer it occupied; anything after it is left for the next call.
        consumed: usize,
    },
    /// The buffer is too short: it must hold at least this many bytes in all (counted from its
    /// start, not in addition to what it holds) before the decoder can make progress.
    Incomplete(usize),
}

impl<T> Decoded<T> {
    /// Whether a message was decoded.
    pub fn is_complete(&self) -> bool {
        matches!(self, Decoded::Complete { .. })
    }

    /// The message and the bytes it used, if complete.
    pub fn complete(self) -> Option<(T, usize)> {
        match self {
            Decoded::Complete { value, consumed } => Some((value, consumed)),
            Decoded::Incomplete(_) => None,
        }
    }

    /// Applies `f` to the message, if complete.
    pub fn map<U>(self, f: impl FnOnce(T) -> U) -> Decoded<U> {
        match self {
            Decoded::Complete { value, consumed } => Decoded::Complete {
                value: f(value),
                consumed,
            },
            Decoded::Incomplete(n) => Decoded::Incomplete(n),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decoded_helpers() {
        let d: Decoded<u8> = Decoded::Complete {
            value: 2,
            consumed: 3,
        };
        assert!(d.is_complete());
        assert_eq!(d.clone().map(u32::from).complete(), Some((2u32, 3)));
        let i: Decoded<u8> = Decoded::Incomplete(9);
        assert!(!i.is_complete());
        assert_eq!(i.clone().map(|x| x + 1), Decoded::Incomplete(9));
        assert_eq!(i.complete(), None);
    }
}
