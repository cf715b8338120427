//! The block layer's error type, and the `io::Error` context helpers that keep an errno
//! readable through a line of context (used by the drivers' backends and by
//! [`Error::duplicate`]).

use std::io;

/// Errors of the block layer. Each maps to an errno ([`Error::errno`]), which the NBD layer
/// turns into its error replies.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The range is not inside the device.
    #[error("range {offset}+{len} is outside the device ({capacity} bytes)")]
    OutOfRange {
        /// Start, bytes.
        offset: u64,
        /// Length, bytes.
        len: u64,
        /// Device size, bytes.
        capacity: u64,
    },
    /// Offset or length is not a multiple of the logical block size (or the length is zero).
    #[error("range {offset}+{len} is not aligned to the {block}-byte block size")]
    Misaligned {
        /// Start, bytes.
        offset: u64,
        /// Length, bytes.
        len: u64,
        /// Logical block size.
        block: u32,
    },
    /// A read or write longer than the device's maximum.
    #[error("I/O of {len} bytes is larger than the maximum {max}")]
    TooLarge {
        /// Length asked for.
        len: u64,
        /// The limit.
        max: u32,
    },
    /// The bio's buffer is shorter than its length.
    #[error("buffer of {buf} bytes is shorter than the I/O ({len} bytes)")]
    BufferTooSmall {
        /// Length of the I/O.
        len: u64,
        /// Length of the buffer.
        buf: u64,
    },
    /// A read or write without a buffer on a device that moves data.
    #[error("read or write without a data buffer")]
    NoBuffer,
    /// The device cannot do this (e.g. a fast zero that would not be fast).
    #[error("not supported: {0}")]
    NotSupported(&'static str),
    /// Writing to a read-only device.
    #[error("device is read-only")]
    ReadOnly,
    /// A named object (e.g. a dirty bitmap) that does not exist.
    #[error("no such {kind}: {name}")]
    NotFound {
        /// What was looked for ("dirty bitmap").
        kind: &'static str,
        /// Its name.
        name: String,
    },
    /// The backend failed.
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),
    /// A bad configuration or device spec.
    #[error("{0}")]
    Config(String),
    /// The tag bitmap refused the configuration.
    #[error("tags: {0}")]
    Tags(#[from] sbitmap::Error),
}

impl Error {
    /// A copy of the error (what `Clone` would give; `std::io::Error` has none): the errno
    /// and message of an I/O error are kept. Used to complete every request of a merge chain
    /// with the same status.
    pub fn duplicate(&self) -> Error {
        match self {
            Error::OutOfRange {
                offset,
                len,
                capacity,
            } => Error::OutOfRange {
                offset: *offset,
                len: *len,
                capacity: *capacity,
            },
            Error::Misaligned { offset, len, block } => Error::Misaligned {
                offset: *offset,
                len: *len,
                block: *block,
            },
            Error::TooLarge { len, max } => Error::TooLarge {
                len: *len,
                max: *max,
            },
            Error::BufferTooSmall { len, buf } => Error::BufferTooSmall {
                len: *len,
                buf: *buf,
            },
            Error::NoBuffer => Error::NoBuffer,
            Error::NotSupported(s) => Error::NotSupported(s),
            Error::ReadOnly => Error::ReadOnly,
            Error::NotFound { kind, name } => Error::NotFound {
                kind,
                name: name.clone(),
            },
            Error::Io(e) => Error::Io(match os_error_code(e) {
                Some(code) => with_context(std::io::Error::from_raw_os_error(code), e.to_string()),
                None => std::io::Error::new(e.kind(), e.to_string()),
            }),
            Error::Config(s) => Error::Config(s.clone()),
            Error::Tags(e) => Error::Tags(e.clone()),
        }
    }

    /// The errno for this error.
    pub fn errno(&self) -> i32 {
        match self {
            Error::OutOfRange { .. }
            | Error::Misaligned { .. }
            | Error::BufferTooSmall { .. }
            | Error::NoBuffer
            | Error::Config(_)
            | Error::NotFound { .. }
            | Error::Tags(_) => libc::EINVAL,
            Error::TooLarge { .. } => libc::EOVERFLOW,
            Error::NotSupported(_) => libc::ENOTSUP,
            Error::ReadOnly => libc::EPERM,
            Error::Io(e) => os_error_code(e).unwrap_or(libc::EIO),
        }
    }
}

/// An [`io::Error`] with a line of context in front, keeping the original's kind and, through
/// `source`, its errno (see [`os_error_code`]).
#[derive(Debug, thiserror::Error)]
#[error("{context}: {source}")]
struct Context {
    context: String,
    #[source]
    source: io::Error,
}

/// Wraps `err` with `context` ("pread /dev/sdb at 4096"), keeping its kind and errno.
pub fn with_context(err: io::Error, context: impl Into<String>) -> io::Error {
    io::Error::new(
        err.kind(),
        Context {
            context: context.into(),
            source: err,
        },
    )
}

/// The errno behind `err`, looking through the context this module's backends add, for
/// drivers that report errnos (NBD's error field).
pub fn os_error_code(err: &io::Error) -> Option<i32> {
    if let Some(code) = err.raw_os_error() {
        return Some(code);
    }
    err.get_ref()
        .and_then(|inner| inner.downcast_ref::<Context>())
        .and_then(|c| os_error_code(&c.source))
}
