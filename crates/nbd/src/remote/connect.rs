//! Opening one connection to the remote export: dialing, the handshake (structured replies
//! and the `base:allocation` metadata context when the server has them, `NBD_OPT_GO` with
//! block-size information), and the limits the export's constraints give. Used at connect and at every reconnection.

use std::io;
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use blk::Limits;

use super::spec::{RemoteAddr, RemoteSpec, SpecError};
use crate::client::{ClientError, ExportDetails, Handshake};
use crate::stream::Stream;
use nbd_proto::proto::TransmissionMode;

/// Largest read or write sent when the server gives no maximum (the NBD spec's advice: 32 MiB
/// is what any server accepts).
pub const DEFAULT_MAX_IO: u32 = 32 << 20;

/// The metadata context block status is asked for.
const BASE_ALLOCATION: &str = "base:allocation";

/// Errors of [`super::RemoteDevice::connect`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RemoteError {
    /// The spec does not parse.
    #[error(transparent)]
    Spec(#[from] SpecError),
    /// The server cannot be reached.
    #[error("{uri}: cannot connect: {source}")]
    Connect {
        /// The URI.
        uri: String,
        /// Why.
        source: io::Error,
    },
    /// The handshake failed (the export does not exist, the server refused, ...).
    #[error("{uri}: handshake: {source}")]
    Handshake {
        /// The URI.
        uri: String,
        /// Why.
        source: ClientError,
    },
    /// The export's constraints cannot be met.
    #[error("{uri}: {reason}")]
    Unusable {
        /// The URI.
        uri: String,
        /// Why.
        reason: String,
    },
}

/// A negotiated connection, in transmission phase.
pub(super) struct Opened {
    pub(super) stream: Stream,
    pub(super) mode: TransmissionMode,
    pub(super) details: ExportDetails,
    pub(super) limits: Limits,
    /// The `base:allocation` context id, when the server has structured replies and the
    /// context.
    pub(super) meta_id: Option<u32>,
    /// When the connection attempt that opened it must be over (the owner's check of a new
    /// connection is part of it: `check`).
    pub(super) deadline: Instant,
}

/// The deadline of a connection attempt starting now: the spec's timeout from now, or
/// `cut` if sooner (the reconnect deadline's expiry: it fails what waits whatever an attempt
/// is doing).
pub(super) fn attempt_deadline(spec: &RemoteSpec, cut: Option<Instant>) -> Instant {
    let d = Instant::now() + spec.timeout;
    cut.map_or(d, |c| c.min(d))
}

/// What is left before `deadline`; `TimedOut` when nothing is.
fn left(deadline: Instant) -> io::Result<Duration> {
    let l = deadline.saturating_duration_since(Instant::now());
    if l.is_zero() {
        return Err(io::Error::new(
            io::ErrorKind::TimedOut,
            "the connection attempt's deadline passed",
        ));
    }
    Ok(l)
}

/// Connects to `addr` before `deadline` (TCP: the name looked up and every address tried in
/// what is left, `resolve`). `timeout` is the spec's (keepalive).
pub(super) fn dial(addr: &RemoteAddr, timeout: Duration, deadline: Instant) -> io::Result<Stream> {
    match addr {
        RemoteAddr::Unix(p) => {
            let s = UnixStream::connect(p)?;
            // Best effort: a large write goes out with one send, not five waits for the
            // server to read (`sys::SEND_BUFFER`). Not over TCP, whose own tuning of the
            // buffer an explicit size would turn off.
            let _ = crate::sys::set_send_buffer(s.as_raw_fd(), crate::sys::SEND_BUFFER);
            Ok(Stream::from(s))
        }
        RemoteAddr::Tcp { host, port } => {
            let mut last = io::Error::new(io::ErrorKind::NotFound, "the host has no address");
            for a in super::resolve::resolve(host, *port, deadline)? {
                match TcpStream::connect_timeout(&a, left(deadline)?) {
                    Ok(s) => {
                        s.set_nodelay(true)?;
                        keepalive(&s, timeout)?;
                        return Ok(Stream::from(s));
                    }
                    Err(e) => last = e,
                }
            }
            Err(last)
        }
    }
}

/// Unanswered keepalive probes after which the kernel gives a TCP connection up.
const KEEPALIVE_PROBES: u32 = 9;

/// TCP keepalive on a connection to the server: a probe after `timeout` of silence, then
/// every `timeout` (whole seconds, at least one); after [`KEEPALIVE_PROBES`] unanswered, or
/// data or a FIN unacknowledged for ten times the timeout (`TCP_USER_TIMEOUT`, exact to the
/// millisecond), the kernel gives the connection up and stops sending what it held: so it is
/// given up before the drain's own bound (ten timeouts from the give-up, itself a timeout
/// after the oldest request), and nothing the client abandoned crosses later. That bounds how
/// long the device waits for an old connection it gave up to end when the server cannot be
/// heard at all (a cut link, a host gone): see "The old connection" in `table`. A live
/// server's host answers the probes, so a server still busy with a request is waited for.
fn keepalive(s: &TcpStream, timeout: Duration) -> io::Result<()> {
    let t = u32::try_from(timeout.as_secs()).unwrap_or(u32::MAX).max(1);
    crate::sys::set_keepalive(
        s.as_raw_fd(),
        t,
        t,
        KEEPALIVE_PROBES,
        timeout * (KEEPALIVE_PROBES + 1),
    )
}

/// Negotiates on a dialed `stream`, the whole of it (TLS included) before `deadline`; the
/// stream's timeouts are left at the spec's timeout.
pub(super) fn handshake(
    stream: Stream,
    spec: &RemoteSpec,
    deadline: Instant,
) -> Result<Opened, RemoteError> {
    let uri = spec.to_string();
    let hs_err = |source: ClientError| RemoteError::Handshake {
        uri: uri.clone(),
        source,
    };
    let io_err = |e: io::Error| hs_err(ClientError::Io(e));
    let timeouts = |s: &Stream| {
        s.set_read_timeout(Some(spec.timeout))?;
        s.set_write_timeout(Some(spec.timeout))
    };
    timeouts(&stream).map_err(io_err)?;
    let mut hs = Handshake::start_by(stream, Some(deadline)).map_err(hs_err)?;
    if let Some(tls) = &spec.tls {
        let config =
            crate::tls::client_config(&tls.certificates).map_err(|e| RemoteError::Unusable {
                uri: uri.clone(),
                reason: format!("TLS certificates in {}: {e}", tls.certificates.display()),
            })?;
        hs.start_tls(&config, &tls.hostname).map_err(hs_err)?;
    }
    let structured = match hs.structured_replies() {
        Ok(()) => true,
        // A server without structured replies: simple replies do.
        Err(e) if e.option_error().is_some() => false,
        Err(e) => return Err(hs_err(e)),
    };
    let mut meta_id = None;
    if structured {
        match hs.meta_context(&spec.export, &[BASE_ALLOCATION], true) {
            Ok(ctx) => {
                meta_id = ctx
                    .iter()
                    .find(|(_, n)| n == BASE_ALLOCATION)
                    .map(|(id, _)| *id);
            }
            // A server without block status: every range reads as allocated.
            Err(e) if e.option_error().is_some() => {}
            Err(e) => return Err(hs_err(e)),
        }
    }
    let details = hs.go(&spec.export).map_err(hs_err)?;
    let (stream, mode) = hs.into_parts();
    timeouts(&stream).map_err(io_err)?;
    let limits = limits_of(&details).map_err(|reason| RemoteError::Unusable {
        uri: uri.clone(),
        reason,
    })?;
    Ok(Opened {
        stream,
        mode,
        details,
        limits,
        meta_id,
        deadline,
    })
}

/// Dials and negotiates, the whole attempt bounded by the spec's timeout.
pub(super) fn open(spec: &RemoteSpec) -> Result<Opened, RemoteError> {
    let deadline = attempt_deadline(spec, None);
    let stream =
        dial(&spec.addr, spec.timeout, deadline).map_err(|source| RemoteError::Connect {
            uri: spec.to_string(),
            source,
        })?;
    handshake(stream, spec, deadline)
}

/// The export's constraints as [`Limits`]: the logical block is the server's minimum block
/// (at least 512 bytes), the largest I/O its maximum payload (at most [`DEFAULT_MAX_IO`]).
pub(super) fn limits_of(details: &ExportDetails) -> Result<Limits, String> {
    let (min, max) = details
        .block_size
        .map_or((1, u32::MAX), |b| (b.min.max(1), b.max));
    let lbs = min.max(512);
    if !lbs.is_power_of_two() {
        return Err(format!(
            "the minimum block size {min} is not a power of two"
        ));
    }
    let max_io = max.min(DEFAULT_MAX_IO) / lbs * lbs;
    if max_io == 0 {
        return Err(format!(
            "the maximum payload {max} is smaller than the block size {lbs}"
        ));
    }
    Ok(Limits {
        capacity: details.size,
        logical_block_size: lbs,
        max_io_bytes: max_io,
    })
}

#[cfg(all(test, not(blkq_loom)))]
mod tests {
    use super::*;
    use std::net::TcpListener;

    /// The kernel gives a connection with unacknowledged data up after ten request timeouts
    /// exactly, before the drain's own bound of ten timeouts from the give-up: with a
    /// sub-second timeout too (rounded up to whole seconds, a 100 ms timeout gave the kernel
    /// ten seconds, and bytes the drain had abandoned could still cross after it).
    #[test]
    fn the_kernel_gives_unacknowledged_data_up_after_ten_timeouts_to_the_millisecond() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let s = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        keepalive(&s, Duration::from_millis(100)).unwrap();
        let v = crate::sys::int_option(s.as_raw_fd(), libc::IPPROTO_TCP, libc::TCP_USER_TIMEOUT)
            .unwrap();
        assert_eq!(v, 1000, "TCP_USER_TIMEOUT in ms");
    }
}
