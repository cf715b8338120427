//! Protocol constants and typed views of them.
//!
//! Every number the protocol puts on the wire is available twice: as a raw `NBD_*` constant
//! (named as in the specification, so that it can be grepped against `doc/proto.md`), and
//! through a typed enum or flag set with a lossless conversion to and from the raw value.
//! Typed conversions from raw numbers are partial (`from_u16` / `from_u32` / `TryFrom`),
//! because a peer may send values this crate does not know; the raw value is always kept by the
//! decoders so a caller can answer with the error the protocol prescribes.

use core::fmt;

// ---------------------------------------------------------------------------------------------
// Magic numbers.
// ---------------------------------------------------------------------------------------------

/// `NBDMAGIC` (ASCII "NBDMAGIC"), the first 8 bytes the server sends (also called `INIT_PASSWD`).
pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
/// `IHAVEOPT` (ASCII "IHAVEOPT"): the newstyle greeting magic, also the magic of every option
/// the client sends during option haggling.
pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
/// `cliserv_magic`: the second magic of the (unsupported) oldstyle negotiation.
pub const NBD_CLISERV_MAGIC: u64 = 0x0000_4202_8186_1253;
/// Magic of every option reply sent by a fixed-newstyle server.
pub const NBD_REP_MAGIC: u64 = 0x0003_e889_0455_65a9;
/// Magic of a compact (28-byte) transmission request, `NBD_REQUEST_MAGIC`.
pub const NBD_REQUEST_MAGIC: u32 = 0x2560_9513;
/// Magic of an extended (32-byte) transmission request, `NBD_EXTENDED_REQUEST_MAGIC`.
pub const NBD_EXTENDED_REQUEST_MAGIC: u32 = 0x21e4_1c71;
/// Magic of a simple reply, `NBD_SIMPLE_REPLY_MAGIC` (formerly `NBD_REPLY_MAGIC`).
pub const NBD_SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
/// Magic of a structured reply chunk, `NBD_STRUCTURED_REPLY_MAGIC`.
pub const NBD_STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;
/// Magic of an extended reply chunk, `NBD_EXTENDED_REPLY_MAGIC`.
pub const NBD_EXTENDED_REPLY_MAGIC: u32 = 0x6e8a_278c;

/// The IANA-registered TCP port for newstyle negotiation.
pub const NBD_DEFAULT_PORT: u16 = 10809;
/// Longest string (export name, error message, metadata context name, ...) the protocol allows,
/// in bytes.
pub const NBD_MAX_STRING_LEN: usize = 4096;

// ---------------------------------------------------------------------------------------------
// Message sizes.
// ---------------------------------------------------------------------------------------------

/// Bytes of the newstyle server greeting: `NBDMAGIC`, `IHAVEOPT`, 16 bits of handshake flags.
pub const SERVER_GREETING_LEN: usize = 18;
/// Bytes of the client flags field that answers the greeting.
pub const CLIENT_FLAGS_LEN: usize = 4;
/// Bytes of an option header: `IHAVEOPT`, 32-bit option, 32-bit length.
pub const OPTION_HEADER_LEN: usize = 16;
/// Bytes of an option reply header: magic, option, reply type, length.
pub const OPTION_REPLY_HEADER_LEN: usize = 20;
/// Bytes of the reply to `NBD_OPT_EXPORT_NAME` without the 124 bytes of zeroes.
pub const EXPORT_NAME_REPLY_SHORT_LEN: usize = 10;
/// Bytes of the reply to `NBD_OPT_EXPORT_NAME` including the 124 bytes of zeroes.
pub const EXPORT_NAME_REPLY_LEN: usize = 134;
/// Bytes of a compact request header.
pub const COMPACT_REQUEST_LEN: usize = 28;
/// Bytes of an extended request header.
pub const EXTENDED_REQUEST_LEN: usize = 32;
/// Bytes of a simple reply header.
pub const SIMPLE_REPLY_LEN: usize = 16;
/// Bytes of a structured reply chunk header.
pub const STRUCTURED_REPLY_HEADER_LEN: usize = 20;
/// Bytes of an extended reply chunk header.
pub const EXTENDED_REPLY_HEADER_LEN: usize = 32;

// ---------------------------------------------------------------------------------------------
// Handshake, client and transmission flags.
// ---------------------------------------------------------------------------------------------

/// Handshake flag bit 0: the server supports fixed newstyle negotiation.
pub const NBD_FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
/// Handshake flag bit 1: the server may omit the 124 zero bytes after `NBD_OPT_EXPORT_NAME`.
pub const NBD_FLAG_NO_ZEROES: u16 = 1 << 1;

/// Client flag bit 0: the client speaks fixed newstyle negotiation.
pub const NBD_FLAG_C_FIXED_NEWSTYLE: u32 = 1 << 0;
/// Client flag bit 1: the server must not send the 124 zero bytes after `NBD_OPT_EXPORT_NAME`.
pub const NBD_FLAG_C_NO_ZEROES: u32 = 1 << 1;

/// Transmission flag bit 0: always set.
pub const NBD_FLAG_HAS_FLAGS: u16 = 1 << 0;
/// Transmission flag bit 1: the export is read-only.
pub const NBD_FLAG_READ_ONLY: u16 = 1 << 1;
/// Transmission flag bit 2: the server supports `NBD_CMD_FLUSH`.
pub const NBD_FLAG_SEND_FLUSH: u16 = 1 << 2;
/// Transmission flag bit 3: the server supports `NBD_CMD_FLAG_FUA`.
pub const NBD_FLAG_SEND_FUA: u16 = 1 << 3;
/// Transmission flag bit 4: the export behaves like a rotational medium.
pub const NBD_FLAG_ROTATIONAL: u16 = 1 << 4;
/// Transmission flag bit 5: the server supports `NBD_CMD_TRIM`.
pub const NBD_FLAG_SEND_TRIM: u16 = 1 << 5;
/// Transmission flag bit 6: the server supports `NBD_CMD_WRITE_ZEROES` and
/// `NBD_CMD_FLAG_NO_HOLE`.
pub const NBD_FLAG_SEND_WRITE_ZEROES: u16 = 1 << 6;
/// Transmission flag bit 7: the server supports `NBD_CMD_FLAG_DF` on reads.
pub const NBD_FLAG_SEND_DF: u16 = 1 << 7;
/// Transmission flag bit 8: the server's caching is coherent across connections.
pub const NBD_FLAG_CAN_MULTI_CONN: u16 = 1 << 8;
/// Transmission flag bit 9: the server supports `NBD_CMD_RESIZE` (experimental extension).
pub const NBD_FLAG_SEND_RESIZE: u16 = 1 << 9;
/// Transmission flag bit 10: the server understands `NBD_CMD_CACHE`.
pub const NBD_FLAG_SEND_CACHE: u16 = 1 << 10;
/// Transmission flag bit 11: the server supports `NBD_CMD_FLAG_FAST_ZERO`.
pub const NBD_FLAG_SEND_FAST_ZERO: u16 = 1 << 11;
/// Transmission flag bit 12: the server accepts a payload (a filter of metadata context ids)
/// on `NBD_CMD_BLOCK_STATUS` with `NBD_CMD_FLAG_PAYLOAD_LEN` (extended headers only).
pub const NBD_FLAG_BLOCK_STAT_PAYLOAD: u16 = 1 << 12;

// ---------------------------------------------------------------------------------------------
// Options and option replies.
// ---------------------------------------------------------------------------------------------

/// Option 1: choose an export and enter transmission (no error reply possible).
pub const NBD_OPT_EXPORT_NAME: u32 = 1;
/// Option 2: abort negotiation.
pub const NBD_OPT_ABORT: u32 = 2;
/// Option 3: list exports.
pub const NBD_OPT_LIST: u32 = 3;
/// Option 4: withdrawn `PEEK_EXPORT` extension; not in use.
pub const NBD_OPT_PEEK_EXPORT: u32 = 4;
/// Option 5: upgrade the connection to TLS.
pub const NBD_OPT_STARTTLS: u32 = 5;
/// Option 6: ask for information about an export.
pub const NBD_OPT_INFO: u32 = 6;
/// Option 7: like `NBD_OPT_INFO`, then enter transmission on success.
pub const NBD_OPT_GO: u32 = 7;
/// Option 8: negotiate structured replies.
pub const NBD_OPT_STRUCTURED_REPLY: u32 = 8;
/// Option 9: list metadata contexts.
pub const NBD_OPT_LIST_META_CONTEXT: u32 = 9;
/// Option 10: select metadata contexts.
pub const NBD_OPT_SET_META_CONTEXT: u32 = 10;
/// Option 11: negotiate extended (64-bit) transmission headers.
pub const NBD_OPT_EXTENDED_HEADERS: u32 = 11;

/// The name of an option number, for log lines (`"unknown"` for one this codec does not know).
pub fn option_name(option: u32) -> &'static str {
    match option {
        NBD_OPT_EXPORT_NAME => "NBD_OPT_EXPORT_NAME",
        NBD_OPT_ABORT => "NBD_OPT_ABORT",
        NBD_OPT_LIST => "NBD_OPT_LIST",
        NBD_OPT_PEEK_EXPORT => "NBD_OPT_PEEK_EXPORT",
        NBD_OPT_STARTTLS => "NBD_OPT_STARTTLS",
        NBD_OPT_INFO => "NBD_OPT_INFO",
        NBD_OPT_GO => "NBD_OPT_GO",
        NBD_OPT_STRUCTURED_REPLY => "NBD_OPT_STRUCTURED_REPLY",
        NBD_OPT_LIST_META_CONTEXT => "NBD_OPT_LIST_META_CONTEXT",
        NBD_OPT_SET_META_CONTEXT => "NBD_OPT_SET_META_CONTEXT",
        NBD_OPT_EXTENDED_HEADERS => "NBD_OPT_EXTENDED_HEADERS",
        _ => "unknown",
    }
}

/// The name and meaning of an option error reply type, for messages (`None` for one this
/// codec does not know).
pub fn option_error_name(reply_type: u32) -> Option<(&'static str, &'static str)> {
    match reply_type {
        NBD_REP_ERR_UNSUP => Some(("NBD_REP_ERR_UNSUP", "option not supported")),
        NBD_REP_ERR_POLICY => Some(("NBD_REP_ERR_POLICY", "forbidden by the server's policy")),
        NBD_REP_ERR_INVALID => Some(("NBD_REP_ERR_INVALID", "invalid option")),
        NBD_REP_ERR_PLATFORM => Some((
            "NBD_REP_ERR_PLATFORM",
            "not supported on the server's platform",
        )),
        NBD_REP_ERR_TLS_REQD => Some(("NBD_REP_ERR_TLS_REQD", "the server requires TLS")),
        NBD_REP_ERR_UNKNOWN => Some(("NBD_REP_ERR_UNKNOWN", "no such export")),
        NBD_REP_ERR_SHUTDOWN => Some(("NBD_REP_ERR_SHUTDOWN", "the server is shutting down")),
        NBD_REP_ERR_BLOCK_SIZE_REQD => Some((
            "NBD_REP_ERR_BLOCK_SIZE_REQD",
            "block size information must be requested",
        )),
        NBD_REP_ERR_TOO_BIG => Some(("NBD_REP_ERR_TOO_BIG", "request or reply too large")),
        NBD_REP_ERR_EXT_HEADER_REQD => {
            Some(("NBD_REP_ERR_EXT_HEADER_REQD", "extended headers required"))
        }
        _ => None,
    }
}

/// The name of a request's error value, for messages (`"unknown"` for one this codec does
/// not know).
pub fn error_name(error: u32) -> &'static str {
    match error {
        NBD_EPERM => "NBD_EPERM",
        NBD_EIO => "NBD_EIO",
        NBD_ENOMEM => "NBD_ENOMEM",
        NBD_EINVAL => "NBD_EINVAL",
        NBD_ENOSPC => "NBD_ENOSPC",
        NBD_EOVERFLOW => "NBD_EOVERFLOW",
        NBD_ENOTSUP => "NBD_ENOTSUP",
        NBD_ESHUTDOWN => "NBD_ESHUTDOWN",
        _ => "unknown",
    }
}

/// Bit 31 of an option reply type marks an error reply.
pub const NBD_REP_FLAG_ERROR: u32 = 1 << 31;
/// Option reply 1: option accepted / list finished.
pub const NBD_REP_ACK: u32 = 1;
/// Option reply 2: one export description (reply to `NBD_OPT_LIST`).
pub const NBD_REP_SERVER: u32 = 2;
/// Option reply 3: one information item (reply to `NBD_OPT_INFO` / `NBD_OPT_GO`).
pub const NBD_REP_INFO: u32 = 3;
/// Option reply 4: one metadata context.
pub const NBD_REP_META_CONTEXT: u32 = 4;
/// Option error reply: the option is unknown to the server.
pub const NBD_REP_ERR_UNSUP: u32 = NBD_REP_FLAG_ERROR | 1;
/// Option error reply: forbidden by server policy.
pub const NBD_REP_ERR_POLICY: u32 = NBD_REP_FLAG_ERROR | 2;
/// Option error reply: syntactically or semantically invalid.
pub const NBD_REP_ERR_INVALID: u32 = NBD_REP_FLAG_ERROR | 3;
/// Option error reply: not supported on this platform.
pub const NBD_REP_ERR_PLATFORM: u32 = NBD_REP_FLAG_ERROR | 4;
/// Option error reply: TLS is required first.
pub const NBD_REP_ERR_TLS_REQD: u32 = NBD_REP_FLAG_ERROR | 5;
/// Option error reply: the export does not exist.
pub const NBD_REP_ERR_UNKNOWN: u32 = NBD_REP_FLAG_ERROR | 6;
/// Option error reply: the server is shutting down.
pub const NBD_REP_ERR_SHUTDOWN: u32 = NBD_REP_FLAG_ERROR | 7;
/// Option error reply: the client must request `NBD_INFO_BLOCK_SIZE` first.
pub const NBD_REP_ERR_BLOCK_SIZE_REQD: u32 = NBD_REP_FLAG_ERROR | 8;
/// Option error reply: the request or the reply is too large.
pub const NBD_REP_ERR_TOO_BIG: u32 = NBD_REP_FLAG_ERROR | 9;
/// Option error reply: the client must negotiate extended headers first.
pub const NBD_REP_ERR_EXT_HEADER_REQD: u32 = NBD_REP_FLAG_ERROR | 10;

/// Information type 0: export size and transmission flags.
pub const NBD_INFO_EXPORT: u16 = 0;
/// Information type 1: canonical export name.
pub const NBD_INFO_NAME: u16 = 1;
/// Information type 2: human-readable export description.
pub const NBD_INFO_DESCRIPTION: u16 = 2;
/// Information type 3: block size constraints.
pub const NBD_INFO_BLOCK_SIZE: u16 = 3;

// ---------------------------------------------------------------------------------------------
// Transmission: commands, command flags, reply flags and types, errors.
// ---------------------------------------------------------------------------------------------

/// Command 0: read.
pub const NBD_CMD_READ: u16 = 0;
/// Command 1: write (the request carries a payload).
pub const NBD_CMD_WRITE: u16 = 1;
/// Command 2: disconnect (no reply).
pub const NBD_CMD_DISC: u16 = 2;
/// Command 3: flush.
pub const NBD_CMD_FLUSH: u16 = 3;
/// Command 4: trim (discard).
pub const NBD_CMD_TRIM: u16 = 4;
/// Command 5: cache (prefetch).
pub const NBD_CMD_CACHE: u16 = 5;
/// Command 6: write zeroes.
pub const NBD_CMD_WRITE_ZEROES: u16 = 6;
/// Command 7: block status query.
pub const NBD_CMD_BLOCK_STATUS: u16 = 7;
/// Command 8: resize (experimental extension).
pub const NBD_CMD_RESIZE: u16 = 8;

/// Command flag bit 0: force unit access.
pub const NBD_CMD_FLAG_FUA: u16 = 1 << 0;
/// Command flag bit 1: `NBD_CMD_WRITE_ZEROES` must not punch a hole.
pub const NBD_CMD_FLAG_NO_HOLE: u16 = 1 << 1;
/// Command flag bit 2: "don't fragment" a structured read reply.
pub const NBD_CMD_FLAG_DF: u16 = 1 << 2;
/// Command flag bit 3: one extent per metadata context in a block status reply.
pub const NBD_CMD_FLAG_REQ_ONE: u16 = 1 << 3;
/// Command flag bit 4: fail `NBD_CMD_WRITE_ZEROES` fast unless it is faster than a write.
pub const NBD_CMD_FLAG_FAST_ZERO: u16 = 1 << 4;
/// Command flag bit 5: the extended header's length is a payload length (extended headers
/// only).
pub const NBD_CMD_FLAG_PAYLOAD_LEN: u16 = 1 << 5;

/// Reply chunk flag bit 0: this is the final chunk of the reply.
pub const NBD_REPLY_FLAG_DONE: u16 = 1 << 0;

/// Bit 15 of a reply chunk type marks an error chunk.
pub const NBD_REPLY_TYPE_ERROR_BIT: u16 = 1 << 15;
/// Reply chunk type 0: no payload, final chunk.
pub const NBD_REPLY_TYPE_NONE: u16 = 0;
/// Reply chunk type 1: data at an offset.
pub const NBD_REPLY_TYPE_OFFSET_DATA: u16 = 1;
/// Reply chunk type 2: a hole (reads as zeroes) at an offset.
pub const NBD_REPLY_TYPE_OFFSET_HOLE: u16 = 2;
/// Reply chunk type 5: block status extents with 32-bit lengths.
pub const NBD_REPLY_TYPE_BLOCK_STATUS: u16 = 5;
/// Reply chunk type 6: block status extents with 64-bit lengths (extended headers only).
pub const NBD_REPLY_TYPE_BLOCK_STATUS_EXT: u16 = 6;
/// Reply chunk type 2^15 + 1: an error with an optional message.
pub const NBD_REPLY_TYPE_ERROR: u16 = NBD_REPLY_TYPE_ERROR_BIT | 1;
/// Reply chunk type 2^15 + 2: an error at an offset, with an optional message.
pub const NBD_REPLY_TYPE_ERROR_OFFSET: u16 = NBD_REPLY_TYPE_ERROR_BIT | 2;

/// Error value 1: operation not permitted.
pub const NBD_EPERM: u32 = 1;
/// Error value 5: input/output error.
pub const NBD_EIO: u32 = 5;
/// Error value 12: cannot allocate memory.
pub const NBD_ENOMEM: u32 = 12;
/// Error value 22: invalid argument.
pub const NBD_EINVAL: u32 = 22;
/// Error value 28: no space left on device.
pub const NBD_ENOSPC: u32 = 28;
/// Error value 75: value too large.
pub const NBD_EOVERFLOW: u32 = 75;
/// Error value 95: operation not supported.
pub const NBD_ENOTSUP: u32 = 95;
/// Error value 108: the server is shutting down.
pub const NBD_ESHUTDOWN: u32 = 108;

/// `base:allocation` status flag bit 0: the extent is a hole.
pub const NBD_STATE_HOLE: u32 = 1 << 0;
/// `base:allocation` status flag bit 1: the extent reads as zeroes.
pub const NBD_STATE_ZERO: u32 = 1 << 1;
/// `qemu:dirty-bitmap:NAME` status flag bit 0: the extent changed since the bitmap was
/// created or cleared.
pub const NBD_STATE_DIRTY: u32 = 1 << 0;

// ---------------------------------------------------------------------------------------------
// Flag sets.
// ---------------------------------------------------------------------------------------------

macro_rules! flag_set {
    (
        $(#[$meta:meta])*
        $name:ident: $ty:ty {
            $( $(#[$fmeta:meta])* $flag:ident = $value:expr; )*
        }
    ) => {
        $(#[$meta])*
        #[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
        pub struct $name($ty);

        impl $name {
            $( $(#[$fmeta])* pub const $flag: Self = Self($value); )*

            /// Every flag this crate knows about.
            pub const KNOWN: Self = Self(0 $(| $value)*);

            /// No flag set.
            pub const fn empty() -> Self {
                Self(0)
            }

            /// The flags of a raw value, unknown bits included.
            pub const fn from_bits(bits: $ty) -> Self {
                Self(bits)
            }

            /// The raw value.
            pub const fn bits(self) -> $ty {
                self.0
            }

            /// Whether every flag of `other` is set in `self`.
            pub const fn contains(self, other: Self) -> bool {
                self.0 & other.0 == other.0
            }

            /// Whether no flag is set.
            pub const fn is_empty(self) -> bool {
                self.0 == 0
            }

            /// `self` with the flags of `other` added.
            pub const fn union(self, other: Self) -> Self {
                Self(self.0 | other.0)
            }

            /// `self` with the flags of `other` removed.
            pub const fn difference(self, other: Self) -> Self {
                Self(self.0 & !other.0)
            }

            /// The set bits this crate does not know.
            pub const fn unknown(self) -> Self {
                Self(self.0 & !Self::KNOWN.0)
            }

            /// Sets or clears the flags of `other`.
            pub fn set(&mut self, other: Self, on: bool) {
                if on {
                    self.0 |= other.0;
                } else {
                    self.0 &= !other.0;
                }
            }
        }

        impl core::ops::BitOr for $name {
            type Output = Self;
            fn bitor(self, rhs: Self) -> Self {
                self.union(rhs)
            }
        }

        impl core::ops::BitOrAssign for $name {
            fn bitor_assign(&mut self, rhs: Self) {
                self.0 |= rhs.0;
            }
        }

        impl core::ops::BitAnd for $name {
            type Output = Self;
            fn bitand(self, rhs: Self) -> Self {
                Self(self.0 & rhs.0)
            }
        }

        impl From<$ty> for $name {
            fn from(bits: $ty) -> Self {
                Self(bits)
            }
        }

        impl From<$name> for $ty {
            fn from(flags: $name) -> $ty {
                flags.0
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}(", stringify!($name))?;
                let mut first = true;
                $(
                    if self.0 & $value != 0 {
                        if !first {
                            f.write_str(" | ")?;
                        }
                        f.write_str(stringify!($flag))?;
                        first = false;
                    }
                )*
                let unknown = self.unknown().0;
                if unknown != 0 {
                    if !first {
                        f.write_str(" | ")?;
                    }
                    write!(f, "{unknown:#x}")?;
                }
                f.write_str(")")
            }
        }
    };
}

flag_set! {
    /// The 16 bits of handshake flags the server sends in its greeting.
    HandshakeFlags: u16 {
        /// `NBD_FLAG_FIXED_NEWSTYLE`.
        FIXED_NEWSTYLE = NBD_FLAG_FIXED_NEWSTYLE;
        /// `NBD_FLAG_NO_ZEROES`.
        NO_ZEROES = NBD_FLAG_NO_ZEROES;
    }
}

flag_set! {
    /// The 32 bits of client flags the client sends after the greeting.
    ClientFlags: u32 {
        /// `NBD_FLAG_C_FIXED_NEWSTYLE`.
        FIXED_NEWSTYLE = NBD_FLAG_C_FIXED_NEWSTYLE;
        /// `NBD_FLAG_C_NO_ZEROES`.
        NO_ZEROES = NBD_FLAG_C_NO_ZEROES;
    }
}

flag_set! {
    /// The 16 bits of per-export transmission flags.
    TransmissionFlags: u16 {
        /// `NBD_FLAG_HAS_FLAGS` (always set).
        HAS_FLAGS = NBD_FLAG_HAS_FLAGS;
        /// `NBD_FLAG_READ_ONLY`.
        READ_ONLY = NBD_FLAG_READ_ONLY;
        /// `NBD_FLAG_SEND_FLUSH`.
        SEND_FLUSH = NBD_FLAG_SEND_FLUSH;
        /// `NBD_FLAG_SEND_FUA`.
        SEND_FUA = NBD_FLAG_SEND_FUA;
        /// `NBD_FLAG_ROTATIONAL`.
        ROTATIONAL = NBD_FLAG_ROTATIONAL;
        /// `NBD_FLAG_SEND_TRIM`.
        SEND_TRIM = NBD_FLAG_SEND_TRIM;
        /// `NBD_FLAG_SEND_WRITE_ZEROES`.
        SEND_WRITE_ZEROES = NBD_FLAG_SEND_WRITE_ZEROES;
        /// `NBD_FLAG_SEND_DF`.
        SEND_DF = NBD_FLAG_SEND_DF;
        /// `NBD_FLAG_CAN_MULTI_CONN`.
        CAN_MULTI_CONN = NBD_FLAG_CAN_MULTI_CONN;
        /// `NBD_FLAG_SEND_RESIZE`.
        SEND_RESIZE = NBD_FLAG_SEND_RESIZE;
        /// `NBD_FLAG_SEND_CACHE`.
        SEND_CACHE = NBD_FLAG_SEND_CACHE;
        /// `NBD_FLAG_SEND_FAST_ZERO`.
        SEND_FAST_ZERO = NBD_FLAG_SEND_FAST_ZERO;
        /// `NBD_FLAG_BLOCK_STAT_PAYLOAD`.
        BLOCK_STAT_PAYLOAD = NBD_FLAG_BLOCK_STAT_PAYLOAD;
    }
}

flag_set! {
    /// The 16 bits of command flags of a transmission request.
    CmdFlags: u16 {
        /// `NBD_CMD_FLAG_FUA`.
        FUA = NBD_CMD_FLAG_FUA;
        /// `NBD_CMD_FLAG_NO_HOLE`.
        NO_HOLE = NBD_CMD_FLAG_NO_HOLE;
        /// `NBD_CMD_FLAG_DF`.
        DF = NBD_CMD_FLAG_DF;
        /// `NBD_CMD_FLAG_REQ_ONE`.
        REQ_ONE = NBD_CMD_FLAG_REQ_ONE;
        /// `NBD_CMD_FLAG_FAST_ZERO`.
        FAST_ZERO = NBD_CMD_FLAG_FAST_ZERO;
        /// `NBD_CMD_FLAG_PAYLOAD_LEN`.
        PAYLOAD_LEN = NBD_CMD_FLAG_PAYLOAD_LEN;
    }
}

flag_set! {
    /// The 16 bits of flags of a structured or extended reply chunk.
    ReplyFlags: u16 {
        /// `NBD_REPLY_FLAG_DONE`.
        DONE = NBD_REPLY_FLAG_DONE;
    }
}

// ---------------------------------------------------------------------------------------------
// Typed enums.
// ---------------------------------------------------------------------------------------------

macro_rules! wire_enum {
    (
        $(#[$meta:meta])*
        $name:ident: $ty:ty, $from:ident, $as:ident, $what:literal {
            $( $(#[$vmeta:meta])* $variant:ident = $value:expr, )*
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[non_exhaustive]
        pub enum $name {
            $( $(#[$vmeta])* $variant, )*
        }

        impl $name {
            /// Every value, in protocol order.
            pub const ALL: &'static [Self] = &[$(Self::$variant),*];

            /// The value for a raw number, or `None` if this crate does not know it.
            pub const fn $from(raw: $ty) -> Option<Self> {
                $( if raw == $value { return Some(Self::$variant); } )*
                None
            }

            /// The raw number on the wire.
            pub const fn $as(self) -> $ty {
                match self {
                    $( Self::$variant => $value, )*
                }
            }
        }

        impl TryFrom<$ty> for $name {
            type Error = $crate::Error;
            fn try_from(raw: $ty) -> Result<Self, $crate::Error> {
                Self::$from(raw).ok_or($crate::Error::UnknownValue {
                    what: $what,
                    value: u64::from(raw),
                })
            }
        }

        impl From<$name> for $ty {
            fn from(v: $name) -> $ty {
                v.$as()
            }
        }
    };
}

wire_enum! {
    /// An option code of the handshake phase (`NBD_OPT_*`).
    OptionCode: u32, from_u32, as_u32, "option" {
        /// `NBD_OPT_EXPORT_NAME`.
        ExportName = NBD_OPT_EXPORT_NAME,
        /// `NBD_OPT_ABORT`.
        Abort = NBD_OPT_ABORT,
        /// `NBD_OPT_LIST`.
        List = NBD_OPT_LIST,
        /// `NBD_OPT_STARTTLS`.
        StartTls = NBD_OPT_STARTTLS,
        /// `NBD_OPT_INFO`.
        Info = NBD_OPT_INFO,
        /// `NBD_OPT_GO`.
        Go = NBD_OPT_GO,
        /// `NBD_OPT_STRUCTURED_REPLY`.
        StructuredReply = NBD_OPT_STRUCTURED_REPLY,
        /// `NBD_OPT_LIST_META_CONTEXT`.
        ListMetaContext = NBD_OPT_LIST_META_CONTEXT,
        /// `NBD_OPT_SET_META_CONTEXT`.
        SetMetaContext = NBD_OPT_SET_META_CONTEXT,
        /// `NBD_OPT_EXTENDED_HEADERS`.
        ExtendedHeaders = NBD_OPT_EXTENDED_HEADERS,
    }
}

wire_enum! {
    /// An error reply type of option haggling (`NBD_REP_ERR_*`).
    OptionError: u32, from_u32, as_u32, "option error reply type" {
        /// `NBD_REP_ERR_UNSUP`: unknown option.
        Unsup = NBD_REP_ERR_UNSUP,
        /// `NBD_REP_ERR_POLICY`: forbidden by policy.
        Policy = NBD_REP_ERR_POLICY,
        /// `NBD_REP_ERR_INVALID`: invalid option.
        Invalid = NBD_REP_ERR_INVALID,
        /// `NBD_REP_ERR_PLATFORM`: unsupported on this platform.
        Platform = NBD_REP_ERR_PLATFORM,
        /// `NBD_REP_ERR_TLS_REQD`: TLS required.
        TlsReqd = NBD_REP_ERR_TLS_REQD,
        /// `NBD_REP_ERR_UNKNOWN`: no such export.
        Unknown = NBD_REP_ERR_UNKNOWN,
        /// `NBD_REP_ERR_SHUTDOWN`: shutting down.
        Shutdown = NBD_REP_ERR_SHUTDOWN,
        /// `NBD_REP_ERR_BLOCK_SIZE_REQD`: block size information must be requested.
        BlockSizeReqd = NBD_REP_ERR_BLOCK_SIZE_REQD,
        /// `NBD_REP_ERR_TOO_BIG`: request or reply too large.
        TooBig = NBD_REP_ERR_TOO_BIG,
        /// `NBD_REP_ERR_EXT_HEADER_REQD`: extended headers required.
        ExtHeaderReqd = NBD_REP_ERR_EXT_HEADER_REQD,
    }
}

/// An option reply type (`NBD_REP_*`), successful or error.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum OptionReplyType {
    /// `NBD_REP_ACK`.
    Ack,
    /// `NBD_REP_SERVER`.
    Server,
    /// `NBD_REP_INFO`.
    Info,
    /// `NBD_REP_META_CONTEXT`.
    MetaContext,
    /// One of the `NBD_REP_ERR_*` values.
    Error(OptionError),
}

impl OptionReplyType {
    /// The reply type for a raw number, or `None` if this crate does not know it.
    pub const fn from_u32(raw: u32) -> Option<Self> {
        match raw {
            NBD_REP_ACK => Some(Self::Ack),
            NBD_REP_SERVER => Some(Self::Server),
            NBD_REP_INFO => Some(Self::Info),
            NBD_REP_META_CONTEXT => Some(Self::MetaContext),
            _ => match OptionError::from_u32(raw) {
                Some(e) => Some(Self::Error(e)),
                None => None,
            },
        }
    }

    /// The raw number on the wire.
    pub const fn as_u32(self) -> u32 {
        match self {
            Self::Ack => NBD_REP_ACK,
            Self::Server => NBD_REP_SERVER,
            Self::Info => NBD_REP_INFO,
            Self::MetaContext => NBD_REP_META_CONTEXT,
            Self::Error(e) => e.as_u32(),
        }
    }

    /// Whether this is an error reply.
    pub const fn is_error(self) -> bool {
        matches!(self, Self::Error(_))
    }
}

impl TryFrom<u32> for OptionReplyType {
    type Error = crate::Error;
    fn try_from(raw: u32) -> Result<Self, crate::Error> {
        Self::from_u32(raw).ok_or(crate::Error::UnknownValue {
            what: "option reply type",
            value: u64::from(raw),
        })
    }
}

impl From<OptionError> for OptionReplyType {
    fn from(e: OptionError) -> Self {
        Self::Error(e)
    }
}

/// Whether a raw option reply type is an error reply (bit 31 set), known or not.
pub const fn is_option_error(raw: u32) -> bool {
    raw & NBD_REP_FLAG_ERROR != 0
}

wire_enum! {
    /// An information type requested by / sent in reply to `NBD_OPT_INFO` and `NBD_OPT_GO`.
    InfoType: u16, from_u16, as_u16, "information type" {
        /// `NBD_INFO_EXPORT`.
        Export = NBD_INFO_EXPORT,
        /// `NBD_INFO_NAME`.
        Name = NBD_INFO_NAME,
        /// `NBD_INFO_DESCRIPTION`.
        Description = NBD_INFO_DESCRIPTION,
        /// `NBD_INFO_BLOCK_SIZE`.
        BlockSize = NBD_INFO_BLOCK_SIZE,
    }
}

wire_enum! {
    /// A transmission command (`NBD_CMD_*`).
    Command: u16, from_u16, as_u16, "command" {
        /// `NBD_CMD_READ`.
        Read = NBD_CMD_READ,
        /// `NBD_CMD_WRITE`.
        Write = NBD_CMD_WRITE,
        /// `NBD_CMD_DISC`.
        Disc = NBD_CMD_DISC,
        /// `NBD_CMD_FLUSH`.
        Flush = NBD_CMD_FLUSH,
        /// `NBD_CMD_TRIM`.
        Trim = NBD_CMD_TRIM,
        /// `NBD_CMD_CACHE`.
        Cache = NBD_CMD_CACHE,
        /// `NBD_CMD_WRITE_ZEROES`.
        WriteZeroes = NBD_CMD_WRITE_ZEROES,
        /// `NBD_CMD_BLOCK_STATUS`.
        BlockStatus = NBD_CMD_BLOCK_STATUS,
        /// `NBD_CMD_RESIZE`.
        Resize = NBD_CMD_RESIZE,
    }
}

wire_enum! {
    /// A structured / extended reply chunk type (`NBD_REPLY_TYPE_*`).
    ReplyType: u16, from_u16, as_u16, "reply chunk type" {
        /// `NBD_REPLY_TYPE_NONE`.
        None = NBD_REPLY_TYPE_NONE,
        /// `NBD_REPLY_TYPE_OFFSET_DATA`.
        OffsetData = NBD_REPLY_TYPE_OFFSET_DATA,
        /// `NBD_REPLY_TYPE_OFFSET_HOLE`.
        OffsetHole = NBD_REPLY_TYPE_OFFSET_HOLE,
        /// `NBD_REPLY_TYPE_BLOCK_STATUS`.
        BlockStatus = NBD_REPLY_TYPE_BLOCK_STATUS,
        /// `NBD_REPLY_TYPE_BLOCK_STATUS_EXT`.
        BlockStatusExt = NBD_REPLY_TYPE_BLOCK_STATUS_EXT,
        /// `NBD_REPLY_TYPE_ERROR`.
        Error = NBD_REPLY_TYPE_ERROR,
        /// `NBD_REPLY_TYPE_ERROR_OFFSET`.
        ErrorOffset = NBD_REPLY_TYPE_ERROR_OFFSET,
    }
}

/// Whether a raw reply chunk type is an error chunk (bit 15 set), known or not.
pub const fn is_reply_error_type(raw: u16) -> bool {
    raw & NBD_REPLY_TYPE_ERROR_BIT != 0
}

wire_enum! {
    /// An error value of a reply (`NBD_E*`).
    Errno: u32, from_u32, as_u32, "error value" {
        /// `NBD_EPERM`.
        Perm = NBD_EPERM,
        /// `NBD_EIO`.
        Io = NBD_EIO,
        /// `NBD_ENOMEM`.
        NoMem = NBD_ENOMEM,
        /// `NBD_EINVAL`.
        Inval = NBD_EINVAL,
        /// `NBD_ENOSPC`.
        NoSpc = NBD_ENOSPC,
        /// `NBD_EOVERFLOW`.
        Overflow = NBD_EOVERFLOW,
        /// `NBD_ENOTSUP`.
        NotSup = NBD_ENOTSUP,
        /// `NBD_ESHUTDOWN`.
        Shutdown = NBD_ESHUTDOWN,
    }
}

impl Errno {
    /// The NBD error for an operating-system error number (`errno`, as `io::Error::raw_os_error`
    /// or the block layer reports it). This is the one place that maps libc errors to the wire:
    /// the specification's list is short, so everything it does not name reads as `NBD_EIO`.
    ///
    /// | errno                         | NBD error       |
    /// |-------------------------------|-----------------|
    /// | `EPERM`, `EROFS`, `EACCES`    | `NBD_EPERM`     |
    /// | `EINVAL`                      | `NBD_EINVAL`    |
    /// | `ENOSPC`, `EDQUOT`, `EFBIG`   | `NBD_ENOSPC`    |
    /// | `EOVERFLOW`                   | `NBD_EOVERFLOW` |
    /// | `ENOTSUP` (`EOPNOTSUPP`)      | `NBD_ENOTSUP`   |
    /// | `ENOMEM`                      | `NBD_ENOMEM`    |
    /// | `ESHUTDOWN`                   | `NBD_ESHUTDOWN` |
    /// | anything else                 | `NBD_EIO`       |
    pub const fn from_errno(errno: i32) -> Self {
        match errno {
            libc::EPERM | libc::EROFS | libc::EACCES => Self::Perm,
            libc::EINVAL => Self::Inval,
            libc::ENOSPC | libc::EDQUOT | libc::EFBIG => Self::NoSpc,
            libc::EOVERFLOW => Self::Overflow,
            libc::ENOTSUP => Self::NotSup,
            libc::ENOMEM => Self::NoMem,
            libc::ESHUTDOWN => Self::Shutdown,
            _ => Self::Io,
        }
    }

    /// The error a client should assume for a raw nonzero value: unknown values read as
    /// `NBD_EINVAL`, as the specification asks. Zero (success) gives `None`.
    pub const fn from_u32_lossy(raw: u32) -> Option<Self> {
        if raw == 0 {
            return None;
        }
        match Self::from_u32(raw) {
            Some(e) => Some(e),
            None => Some(Self::Inval),
        }
    }
}

/// Which transmission headers were negotiated during the handshake.
///
/// This decides the request header layout (compact unless [`Extended`](Self::Extended)), the
/// reply headers the server may send, and which chunk types are allowed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum TransmissionMode {
    /// Neither structured replies nor extended headers: compact requests, simple replies only.
    #[default]
    Simple,
    /// `NBD_OPT_STRUCTURED_REPLY` succeeded: compact requests; simple replies or 20-byte
    /// structured chunks.
    Structured,
    /// `NBD_OPT_EXTENDED_HEADERS` succeeded: 32-byte requests and 32-byte extended chunks only.
    Extended,
}

impl TransmissionMode {
    /// Whether requests and reply chunks use the 32-byte extended headers.
    pub const fn extended_headers(self) -> bool {
        matches!(self, Self::Extended)
    }

    /// Whether reply chunks (structured or extended) may be sent.
    pub const fn chunked_replies(self) -> bool {
        !matches!(self, Self::Simple)
    }

    /// Length of a request header in this mode.
    pub const fn request_header_len(self) -> usize {
        if self.extended_headers() {
            EXTENDED_REQUEST_LEN
        } else {
            COMPACT_REQUEST_LEN
        }
    }

    /// Length of a reply chunk header in this mode (`None` in [`Simple`](Self::Simple) mode,
    /// where there are no chunks).
    pub const fn chunk_header_len(self) -> Option<usize> {
        match self {
            Self::Simple => None,
            Self::Structured => Some(STRUCTURED_REPLY_HEADER_LEN),
            Self::Extended => Some(EXTENDED_REPLY_HEADER_LEN),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn magics_match_their_ascii() {
        assert_eq!(&NBDMAGIC.to_be_bytes(), b"NBDMAGIC");
        assert_eq!(&IHAVEOPT.to_be_bytes(), b"IHAVEOPT");
        assert_eq!(NBD_REP_MAGIC, 0x3e889045565a9);
    }

    #[test]
    fn option_codes_round_trip() {
        for &c in OptionCode::ALL {
            assert_eq!(OptionCode::from_u32(c.as_u32()), Some(c));
            assert_eq!(OptionCode::try_from(c.as_u32()), Ok(c));
        }
        assert_eq!(OptionCode::from_u32(NBD_OPT_PEEK_EXPORT), None);
        assert!(OptionCode::try_from(0).is_err());
    }

    #[test]
    fn reply_types_round_trip() {
        for raw in [1u32, 2, 3, 4] {
            assert_eq!(
                OptionReplyType::from_u32(raw).map(|t| t.as_u32()),
                Some(raw)
            );
        }
        for &e in OptionError::ALL {
            let t = OptionReplyType::from(e);
            assert!(t.is_error());
            assert!(is_option_error(t.as_u32()));
            assert_eq!(OptionReplyType::try_from(t.as_u32()), Ok(t));
        }
        assert_eq!(OptionError::ExtHeaderReqd.as_u32(), 0x8000_000a);
        assert!(OptionReplyType::try_from(0x8000_00ff).is_err());
        assert!(OptionReplyType::from_u32(5).is_none());
    }

    #[test]
    fn commands_and_chunk_types_round_trip() {
        for &c in Command::ALL {
            assert_eq!(Command::try_from(c.as_u16()), Ok(c));
        }
        assert_eq!(Command::from_u16(9), None);
        for &t in ReplyType::ALL {
            assert_eq!(ReplyType::from_u16(t.as_u16()), Some(t));
            assert_eq!(
                is_reply_error_type(t.as_u16()),
                matches!(t, ReplyType::Error | ReplyType::ErrorOffset)
            );
        }
        assert_eq!(ReplyType::Error.as_u16(), 32769);
        for &i in InfoType::ALL {
            assert_eq!(InfoType::try_from(i.as_u16()), Ok(i));
        }
    }

    #[test]
    fn errno_values() {
        let want = [1u32, 5, 12, 22, 28, 75, 95, 108];
        let got: Vec<u32> = Errno::ALL.iter().map(|e| e.as_u32()).collect();
        assert_eq!(got, want);
        assert_eq!(Errno::from_u32_lossy(0), None);
        assert_eq!(Errno::from_u32_lossy(5), Some(Errno::Io));
        assert_eq!(Errno::from_u32_lossy(4242), Some(Errno::Inval));
        assert_eq!(Errno::from_errno(libc::EROFS), Errno::Perm);
        assert_eq!(Errno::from_errno(libc::EDQUOT), Errno::NoSpc);
        assert_eq!(Errno::from_errno(libc::EOVERFLOW), Errno::Overflow);
        assert_eq!(Errno::from_errno(libc::ESHUTDOWN), Errno::Shutdown);
        assert_eq!(Errno::from_errno(libc::EBADF), Errno::Io);
        assert_eq!(Errno::from_errno(0), Errno::Io);
    }

    #[test]
    fn flag_sets() {
        let f = TransmissionFlags::HAS_FLAGS | TransmissionFlags::SEND_FLUSH;
        assert_eq!(f.bits(), 0b101);
        assert!(f.contains(TransmissionFlags::SEND_FLUSH));
        assert!(!f.contains(TransmissionFlags::READ_ONLY));
        assert_eq!(TransmissionFlags::KNOWN.bits(), 0x1fff);
        assert_eq!(CmdFlags::KNOWN.bits(), 0x3f);
        let odd = CmdFlags::from_bits(0x8001);
        assert_eq!(odd.unknown().bits(), 0x8000);
        assert_eq!(format!("{odd:?}"), "CmdFlags(FUA | 0x8000)");
        assert_eq!(format!("{:?}", ReplyFlags::empty()), "ReplyFlags()");
        let mut c = ClientFlags::empty();
        c.set(ClientFlags::NO_ZEROES, true);
        assert_eq!(c.bits(), 2);
        c.set(ClientFlags::NO_ZEROES, false);
        assert!(c.is_empty());
        assert_eq!(
            (HandshakeFlags::KNOWN.difference(HandshakeFlags::NO_ZEROES)),
            HandshakeFlags::FIXED_NEWSTYLE
        );
    }

    #[test]
    fn modes() {
        assert_eq!(TransmissionMode::Simple.request_header_len(), 28);
        assert_eq!(TransmissionMode::Structured.request_header_len(), 28);
        assert_eq!(TransmissionMode::Extended.request_header_len(), 32);
        assert_eq!(TransmissionMode::Simple.chunk_header_len(), None);
        assert_eq!(TransmissionMode::Structured.chunk_header_len(), Some(20));
        assert_eq!(TransmissionMode::Extended.chunk_header_len(), Some(32));
    }
}
