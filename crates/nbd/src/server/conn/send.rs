//! What a send to the socket achieved, read the same way by every sender of the output
//! (`writer.rs`, `transport.rs`, `splice.rs`).

use std::io;

/// What a send to the socket (`sendmsg`, or a splice from the pipe) achieved: `Some(bytes)`;
/// `None` when a non-blocking send would block; an error for a send that took nothing (the
/// peer is gone) or a blocking one that sent nothing for `SO_SNDTIMEO` (the send timeout).
pub(super) fn progress(sent: io::Result<usize>, dontwait: bool) -> io::Result<Option<usize>> {
    match sent {
        Ok(0) => Err(io::ErrorKind::WriteZero.into()),
        Ok(n) => Ok(Some(n)),
        Err(e) if e.kind() == io::ErrorKind::WouldBlock && dontwait => Ok(None),
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => Err(io::ErrorKind::TimedOut.into()),
        Err(e) => Err(e),
    }
}
