//! The client's errors ([`ClientError`]), each naming the option, reply or error code it is
//! about.

use std::io;

/// Errors of the client.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    /// The socket failed (or the server closed it).
    #[error("I/O error: {0}")]
    Io(#[from] io::Error),
    /// The server sent something the codec rejects.
    #[error("protocol error: {0}")]
    Protocol(#[from] nbd_proto::Error),
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
    match nbd_proto::proto::option_name(option) {
        "unknown" => option.to_string(),
        name => format!("{name} ({option})"),
    }
}

/// An option error reply by its name and meaning (`NBD_REP_ERR_UNKNOWN (no such export)`), or
/// its number when unknown.
fn option_error_name(reply_type: u32) -> String {
    match nbd_proto::proto::option_error_name(reply_type) {
        Some((name, meaning)) => format!("{name} ({meaning})"),
        None => format!("reply type {reply_type:#x}"),
    }
}

/// A request's error by its name (`NBD_EIO (5)`), or its number when unknown.
fn request_error_name(e: u32) -> String {
    match nbd_proto::proto::error_name(e) {
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
#[cfg(test)]
mod tests {
    use super::*;
    use nbd_proto::proto::{NBD_EIO, NBD_OPT_GO, NBD_REP_ERR_TLS_REQD, NBD_REP_ERR_UNKNOWN};

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
