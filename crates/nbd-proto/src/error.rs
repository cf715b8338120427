//! The crate's error type.

use crate::proto::{CmdFlags, OptionError};

/// A request header whose command this crate does not know.
///
/// The header itself was well formed, so the stream is still in sync: a server skips
/// [`payload_len`](Self::payload_len) bytes after the [`header_len`](Self::header_len) bytes of
/// the header, answers `NBD_EINVAL` with [`cookie`](Self::cookie), and carries on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct UnknownRequest {
    /// The command flags as sent.
    pub flags: CmdFlags,
    /// The unknown command type.
    pub command: u16,
    /// The client's cookie (handle), to be echoed in the error reply.
    pub cookie: u64,
    /// The offset field.
    pub offset: u64,
    /// The length field.
    pub length: u64,
    /// Bytes of the header (28 compact, 32 extended).
    pub header_len: usize,
    /// Bytes of payload following the header. With compact headers a command is only known to
    /// carry a payload if it is `NBD_CMD_WRITE`, so this is 0; with extended headers it is
    /// `length` when `NBD_CMD_FLAG_PAYLOAD_LEN` is set.
    pub payload_len: u64,
}

/// Everything that can go wrong while decoding or encoding NBD messages.
///
/// Decoding errors say whether the connection can go on: see [`Error::is_fatal`], and, for
/// option haggling, [`Error::option_error`] for the reply a server should send.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A magic number was not the one the protocol requires at this point. The byte stream is
    /// out of step with the protocol; the connection must be dropped (fatal).
    #[error("bad magic: expected {expected:#x}, found {found:#x}")]
    BadMagic {
        /// The magic that was expected.
        expected: u64,
        /// The magic that was found.
        found: u64,
    },

    /// The server greeted with the oldstyle negotiation, which this crate does not implement
    /// (fatal).
    #[error("oldstyle negotiation is not supported")]
    OldstyleNegotiation,

    /// The client sent client flags the server does not know, or `NBD_FLAG_C_NO_ZEROES` when
    /// the server did not offer it; the server must drop the connection (fatal).
    #[error("client flags {flags:#x} not supported")]
    UnsupportedClientFlags {
        /// The client flags as sent.
        flags: u32,
    },

    /// An option header announced more data than the configured maximum. The payload has not
    /// been consumed: the server either discards `length` bytes and replies
    /// `NBD_REP_ERR_TOO_BIG`, or drops the connection.
    #[error("option {option} announces {length} bytes, more than the limit of {max}")]
    OptionTooLong {
        /// The raw option code.
        option: u32,
        /// The announced data length.
        length: u32,
        /// The configured maximum.
        max: u32,
    },

    /// An option reply announced more data than the configured maximum (client side). The
    /// payload has not been consumed.
    #[error("option reply {reply_type:#x} announces {length} bytes, more than the limit of {max}")]
    OptionReplyTooLong {
        /// The raw reply type.
        reply_type: u32,
        /// The announced data length.
        length: u32,
        /// The configured maximum.
        max: u32,
    },

    /// The data of an option is malformed (lengths inconsistent with the option length, data
    /// where none is allowed, ...). The option has been consumed entirely, so the server
    /// answers `NBD_REP_ERR_INVALID` and carries on (except after `NBD_OPT_EXPORT_NAME`, which
    /// cannot be answered with an error).
    #[error("invalid data for option {option}: {reason}")]
    InvalidOption {
        /// The raw option code.
        option: u32,
        /// What is wrong.
        reason: &'static str,
    },

    /// A string is longer than the protocol's 4096-byte limit.
    #[error("{what} is {length} bytes long, more than 4096")]
    StringTooLong {
        /// Which string.
        what: &'static str,
        /// Its length.
        length: usize,
    },

    /// A string is not UTF-8, or contains a NUL character.
    #[error("{what} is not a valid protocol string (UTF-8 without NUL)")]
    InvalidString {
        /// Which string.
        what: &'static str,
    },

    /// A request carried a command type this crate does not know. The header was well formed
    /// and the connection can go on: skip the payload and reply `NBD_EINVAL`.
    #[error("unknown command {}", .0.command)]
    UnknownCommand(UnknownRequest),

    /// A reply from the server is malformed (client side, fatal).
    #[error("malformed reply: {reason}")]
    MalformedReply {
        /// What is wrong.
        reason: &'static str,
    },

    /// A reply chunk has a type that is neither known nor an error type; the client must drop
    /// the connection (fatal).
    #[error("unknown reply chunk type {reply_type}")]
    UnknownReplyType {
        /// The raw chunk type.
        reply_type: u16,
    },

    /// A raw number has no typed counterpart (returned by the `TryFrom` conversions).
    #[error("unknown {what} {value:#x}")]
    UnknownValue {
        /// What kind of value.
        what: &'static str,
        /// The raw value.
        value: u64,
    },

    /// A value does not fit the wire field that must carry it (encoding).
    #[error("{field} {value} does not fit (maximum {max})")]
    ValueTooLarge {
        /// The field.
        field: &'static str,
        /// The value.
        value: u64,
        /// The largest value the field can carry.
        max: u64,
    },

    /// An encoder was asked for a message the protocol forbids (an error chunk with error 0, a
    /// block status chunk without descriptors, ...).
    #[error("invalid message: {reason}")]
    InvalidArgument {
        /// What is wrong.
        reason: &'static str,
    },

    /// The message is not allowed in the negotiated transmission mode (for example a reply
    /// chunk when only simple replies were negotiated).
    #[error("not allowed in this transmission mode: {reason}")]
    WrongMode {
        /// What is not allowed.
        reason: &'static str,
    },

    /// The output buffer is too small for the message.
    #[error("buffer too small: {needed} bytes needed, {available} available")]
    BufferTooSmall {
        /// Bytes the message needs.
        needed: usize,
        /// Bytes the buffer has.
        available: usize,
    },
}

impl Error {
    /// Whether the connection cannot go on after this error while decoding peer input: the
    /// byte stream is out of step, or the protocol requires a hard disconnect.
    ///
    /// Non-fatal errors ([`UnknownCommand`](Self::UnknownCommand),
    /// [`InvalidOption`](Self::InvalidOption), string errors inside an option,
    /// [`OptionTooLong`](Self::OptionTooLong) once its data is skipped) can be answered with an
    /// error reply. Encoding errors are reported as not fatal: nothing was sent.
    pub fn is_fatal(&self) -> bool {
        matches!(
            self,
            Error::BadMagic { .. }
                | Error::OldstyleNegotiation
                | Error::UnsupportedClientFlags { .. }
                | Error::MalformedReply { .. }
                | Error::UnknownReplyType { .. }
                | Error::OptionReplyTooLong { .. }
        )
    }

    /// The option error reply a server should send for an error decoding an option, if any.
    pub fn option_error(&self) -> Option<OptionError> {
        match self {
            Error::OptionTooLong { .. } => Some(OptionError::TooBig),
            Error::InvalidOption { .. }
            | Error::StringTooLong { .. }
            | Error::InvalidString { .. } => Some(OptionError::Invalid),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classification() {
        assert!(Error::BadMagic {
            expected: 1,
            found: 2
        }
        .is_fatal());
        let unknown = Error::UnknownCommand(UnknownRequest {
            flags: CmdFlags::empty(),
            command: 77,
            cookie: 1,
            offset: 0,
            length: 0,
            header_len: 28,
            payload_len: 0,
        });
        assert!(!unknown.is_fatal());
        assert_eq!(unknown.to_string(), "unknown command 77");
        assert_eq!(unknown.option_error(), None);
        let inv = Error::InvalidOption {
            option: 6,
            reason: "x",
        };
        assert!(!inv.is_fatal());
        assert_eq!(inv.option_error(), Some(OptionError::Invalid));
        assert_eq!(
            Error::OptionTooLong {
                option: 1,
                length: 2,
                max: 1
            }
            .option_error(),
            Some(OptionError::TooBig)
        );
    }
}
