//! `nbd://` and `nbd+unix://` device specs (the NBD URI format,
//! <https://github.com/NetworkBlockDevice/nbd/blob/master/doc/uri.md>), with the remote
//! device's own options after commas.
//!
//! ```text
//! nbd://HOST[:PORT][/EXPORT][,timeout=SECS][,depth=N][,reconnect_deadline=SECS]
//! nbd+unix:///[EXPORT]?socket=PATH[,timeout=SECS][,depth=N][,reconnect_deadline=SECS]
//! ```
//!
//! - `timeout=SECS` (1..=86400, default 30): a request unanswered this long on a connection
//!   declares the connection dead; it is broken and re-established. Also the longest a
//!   submitter waits for a free slot (then `ETIMEDOUT`).
//! - `depth=N` (1..=4096, default 64): requests in flight at once (the slot table).
//! - `reconnect_deadline=SECS` (0..=86400, default 15): how long requests wait for a broken
//!   connection to be re-established before they fail with `EIO`; past it, and while still
//!   disconnected, new requests fail at once. The device keeps reconnecting in the
//!   background either way and serves again once connected. `0` fails what is in flight at
//!   once when the connection breaks. The default is long enough for a server process to
//!   restart or a network path to fail over, and short enough that a mirror above this device
//!   marks the leg faulty and goes on serving within seconds instead of stalling its writers;
//!   a request is failed with `ETIMEDOUT` once it has been outstanding for `timeout` plus the
//!   deadline, whatever the reconnections did meanwhile.
//!
//! The port defaults to 10809 and the export name to the empty (default) export; the export
//! and the socket path are percent-decoded. Options are peeled off the end: a trailing
//! `,KEY=VALUE` whose key is a known option is an option, anything before it is the URI (so a
//! comma inside a socket path or an export name stays part of it). `nbds://` and
//! `nbds+unix://` (TLS) are recognised and refused: not yet supported.

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

/// Default request timeout.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);
/// Default number of in-flight slots.
pub const DEFAULT_DEPTH: usize = 64;
/// Most in-flight slots one connection may have.
pub const MAX_DEPTH: usize = 4096;
/// Longest request timeout, seconds (a day).
pub const MAX_TIMEOUT_SECS: u64 = 86_400;
/// Default `reconnect_deadline=` (see the module documentation for why).
pub const DEFAULT_RECONNECT_DEADLINE: Duration = Duration::from_secs(15);

const OPTIONS: [&str; 3] = ["timeout", "depth", "reconnect_deadline"];

/// Errors of [`RemoteSpec::parse`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SpecError {
    /// Not an `nbd://` or `nbd+unix://` URI.
    #[error("{0:?} is not an nbd:// or nbd+unix:// URI")]
    NotRemote(String),
    /// A TLS URI; TLS to a remote export is not supported yet.
    #[error(
        "{0}: TLS to a remote export (nbds://, nbds+unix://) is not supported yet; use \
         nbd:// over a trusted network or a tunnel"
    )]
    TlsNotYet(String),
    /// The host part is missing or malformed.
    #[error("bad host in {uri:?}: {reason}")]
    BadHost {
        /// The URI.
        uri: String,
        /// What is wrong.
        reason: &'static str,
    },
    /// The port is not a number in 1..=65535.
    #[error("bad port {port:?} in {uri:?}")]
    BadPort {
        /// The URI.
        uri: String,
        /// The port text.
        port: String,
    },
    /// `nbd+unix://` without `?socket=PATH`, or with a host.
    #[error("{uri:?}: {reason}")]
    BadUnix {
        /// The URI.
        uri: String,
        /// What is wrong.
        reason: &'static str,
    },
    /// A query parameter this device does not know (TLS ones included).
    #[error("{uri:?}: unsupported query parameter {param:?}")]
    UnsupportedQuery {
        /// The URI.
        uri: String,
        /// The parameter.
        param: String,
    },
    /// A bad `%XX` escape, or an escape that decodes to invalid UTF-8 or a NUL.
    #[error("{uri:?}: bad percent-encoding")]
    BadEscape {
        /// The URI.
        uri: String,
    },
    /// An option's value is out of range or not a number.
    #[error("option {key}={value:?}: {reason}")]
    BadOption {
        /// The option.
        key: &'static str,
        /// Its value.
        value: String,
        /// What is wrong.
        reason: String,
    },
}

/// Where the remote server listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RemoteAddr {
    /// TCP: a host name or address (IPv6 without brackets), and a port.
    Tcp {
        /// Host name or address.
        host: String,
        /// Port.
        port: u16,
    },
    /// A Unix socket.
    Unix(PathBuf),
}

/// A parsed `nbd://` or `nbd+unix://` spec.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteSpec {
    /// Where to connect.
    pub addr: RemoteAddr,
    /// The export name (empty: the server's default export).
    pub export: String,
    /// Each request's timeout (`timeout=SECS`).
    pub timeout: Duration,
    /// In-flight slots (`depth=N`).
    pub depth: usize,
    /// How long requests wait for a reconnection (`reconnect_deadline=SECS`; zero: not at
    /// all).
    pub reconnect_deadline: Duration,
}

impl RemoteSpec {
    /// Whether `s` names a remote export (TLS forms included, which [`RemoteSpec::parse`]
    /// refuses with a clear error): what a caller checks before choosing this parser over
    /// a local device spec's.
    pub fn is_remote(s: &str) -> bool {
        ["nbd://", "nbd+unix://", "nbds://", "nbds+unix://"]
            .iter()
            .any(|p| s.starts_with(p))
    }

    /// Parses a spec (see the module documentation).
    pub fn parse(s: &str) -> Result<Self, SpecError> {
        let mut timeout = DEFAULT_TIMEOUT;
        let mut depth = DEFAULT_DEPTH;
        let mut reconnect_deadline = DEFAULT_RECONNECT_DEADLINE;
        let mut uri = s;
        let mut seen = [false; OPTIONS.len()];
        while let Some((head, tail)) = uri.rsplit_once(',') {
            let Some((k, v)) = tail.split_once('=') else {
                break;
            };
            let Some(i) = OPTIONS.iter().position(|o| *o == k) else {
                break;
            };
            if !seen[i] {
                // The rightmost wins (it was peeled first).
                seen[i] = true;
                match OPTIONS[i] {
                    "timeout" => timeout = parse_timeout(v)?,
                    "depth" => depth = parse_depth(v)?,
                    _ => reconnect_deadline = parse_deadline(v)?,
                }
            }
            uri = head;
        }
        if uri.starts_with("nbds://") || uri.starts_with("nbds+unix://") {
            return Err(SpecError::TlsNotYet(uri.to_string()));
        }
        let (addr, export) = if let Some(rest) = uri.strip_prefix("nbd+unix://") {
            parse_unix(uri, rest)?
        } else if let Some(rest) = uri.strip_prefix("nbd://") {
            parse_tcp(uri, rest)?
        } else {
            return Err(SpecError::NotRemote(s.to_string()));
        };
        Ok(Self {
            addr,
            export,
            timeout,
            depth,
            reconnect_deadline,
        })
    }
}

impl std::str::FromStr for RemoteSpec {
    type Err = SpecError;
    fn from_str(s: &str) -> Result<Self, SpecError> {
        Self::parse(s)
    }
}

/// The URI without options (the export name and socket path as given, unescaped).
impl fmt::Display for RemoteSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.addr {
            RemoteAddr::Tcp { host, port } if host.contains(':') => {
                write!(f, "nbd://[{host}]:{port}/{}", self.export)
            }
            RemoteAddr::Tcp { host, port } => write!(f, "nbd://{host}:{port}/{}", self.export),
            RemoteAddr::Unix(p) => {
                write!(f, "nbd+unix:///{}?socket={}", self.export, p.display())
            }
        }
    }
}

fn parse_timeout(v: &str) -> Result<Duration, SpecError> {
    let bad = |reason: &str| SpecError::BadOption {
        key: "timeout",
        value: v.to_string(),
        reason: reason.to_string(),
    };
    let secs: u64 = v.parse().map_err(|_| bad("expected whole seconds"))?;
    if secs == 0 || secs > MAX_TIMEOUT_SECS {
        return Err(bad(&format!("expected 1..={MAX_TIMEOUT_SECS} seconds")));
    }
    Ok(Duration::from_secs(secs))
}

fn parse_deadline(v: &str) -> Result<Duration, SpecError> {
    match v.parse::<u64>() {
        Ok(n) if n <= MAX_TIMEOUT_SECS => Ok(Duration::from_secs(n)),
        _ => Err(SpecError::BadOption {
            key: "reconnect_deadline",
            value: v.to_string(),
            reason: format!("expected 0..={MAX_TIMEOUT_SECS} whole seconds"),
        }),
    }
}

fn parse_depth(v: &str) -> Result<usize, SpecError> {
    match v.parse::<usize>() {
        Ok(n) if (1..=MAX_DEPTH).contains(&n) => Ok(n),
        _ => Err(SpecError::BadOption {
            key: "depth",
            value: v.to_string(),
            reason: format!("expected 1..={MAX_DEPTH}"),
        }),
    }
}

/// `%XX` decoding (URI components); the result must be UTF-8 without NUL.
fn unescape(uri: &str, s: &str) -> Result<String, SpecError> {
    let bad = || SpecError::BadEscape {
        uri: uri.to_string(),
    };
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = b.get(i + 1..i + 3).ok_or_else(bad)?;
            let hex = std::str::from_utf8(hex).map_err(|_| bad())?;
            out.push(u8::from_str_radix(hex, 16).map_err(|_| bad())?);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    let s = String::from_utf8(out).map_err(|_| bad())?;
    if s.contains('\0') {
        return Err(bad());
    }
    Ok(s)
}

/// Splits `path?query` and decodes the export (the path without its leading `/`).
fn export_and_query<'a>(uri: &str, rest: &'a str) -> Result<(String, Option<&'a str>), SpecError> {
    let (path, query) = match rest.split_once('?') {
        Some((p, q)) => (p, Some(q)),
        None => (rest, None),
    };
    let export = unescape(uri, path.strip_prefix('/').unwrap_or(path))?;
    Ok((export, query))
}

fn parse_tcp(uri: &str, rest: &str) -> Result<(RemoteAddr, String), SpecError> {
    let end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, rest) = rest.split_at(end);
    let bad_host = |reason| SpecError::BadHost {
        uri: uri.to_string(),
        reason,
    };
    if authority.contains('@') {
        return Err(bad_host("user information is not supported"));
    }
    let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
        let (h, after) = v6
            .split_once(']')
            .ok_or(bad_host("unclosed [ in an IPv6 address"))?;
        match after {
            "" => (h, None),
            p => (
                h,
                Some(p.strip_prefix(':').ok_or(bad_host("junk after ]"))?),
            ),
        }
    } else {
        match authority.rsplit_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (authority, None),
        }
    };
    if host.is_empty() {
        return Err(bad_host("no host"));
    }
    let port = match port {
        None => crate::proto::NBD_DEFAULT_PORT,
        Some(p) => match p.parse::<u16>() {
            Ok(n) if n != 0 => n,
            _ => {
                return Err(SpecError::BadPort {
                    uri: uri.to_string(),
                    port: p.to_string(),
                })
            }
        },
    };
    let (export, query) = export_and_query(uri, rest)?;
    if let Some(q) = query.filter(|q| !q.is_empty()) {
        return Err(SpecError::UnsupportedQuery {
            uri: uri.to_string(),
            param: q.split('&').next().unwrap_or(q).to_string(),
        });
    }
    let host = unescape(uri, host)?;
    Ok((RemoteAddr::Tcp { host, port }, export))
}

fn parse_unix(uri: &str, rest: &str) -> Result<(RemoteAddr, String), SpecError> {
    let bad = |reason| SpecError::BadUnix {
        uri: uri.to_string(),
        reason,
    };
    if !(rest.is_empty() || rest.starts_with('/') || rest.starts_with('?')) {
        return Err(bad(
            "nbd+unix:// takes no host (nbd+unix:///EXPORT?socket=PATH)",
        ));
    }
    let (export, query) = export_and_query(uri, rest)?;
    let mut socket = None;
    for param in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        match param.split_once('=') {
            Some(("socket", v)) => socket = Some(unescape(uri, v)?),
            _ => {
                return Err(SpecError::UnsupportedQuery {
                    uri: uri.to_string(),
                    param: param.to_string(),
                })
            }
        }
    }
    let socket = socket
        .filter(|s| !s.is_empty())
        .ok_or(bad("no ?socket=PATH"))?;
    Ok((RemoteAddr::Unix(PathBuf::from(socket)), export))
}

#[cfg(all(test, not(blkq_loom)))]
mod tests {
    use super::*;

    fn tcp(host: &str, port: u16) -> RemoteAddr {
        RemoteAddr::Tcp {
            host: host.into(),
            port,
        }
    }

    #[test]
    fn tcp_forms() {
        let s = RemoteSpec::parse("nbd://127.0.0.1:10810/disk").unwrap();
        assert_eq!(s.addr, tcp("127.0.0.1", 10810));
        assert_eq!(s.export, "disk");
        assert_eq!((s.timeout, s.depth), (DEFAULT_TIMEOUT, DEFAULT_DEPTH));
        assert_eq!(s.reconnect_deadline, DEFAULT_RECONNECT_DEADLINE);
        let s = RemoteSpec::parse("nbd://other").unwrap();
        assert_eq!((s.addr, s.export), (tcp("other", 10809), String::new()));
        let s = RemoteSpec::parse("nbd://[::1]:99/a%20b,timeout=10,depth=32").unwrap();
        assert_eq!(s.addr, tcp("::1", 99));
        assert_eq!(s.export, "a b");
        assert_eq!(s.timeout, Duration::from_secs(10));
        assert_eq!(s.depth, 32);
        assert_eq!(s.to_string(), "nbd://[::1]:99/a b");
        let s = RemoteSpec::parse("nbd://h/d,reconnect_deadline=0,timeout=2").unwrap();
        assert_eq!(s.reconnect_deadline, Duration::ZERO);
        let s = RemoteSpec::parse("nbd://h/d,reconnect_deadline=90").unwrap();
        assert_eq!(s.reconnect_deadline, Duration::from_secs(90));
        let s = RemoteSpec::parse("nbd://h/").unwrap();
        assert_eq!(s.export, "");
    }

    #[test]
    fn unix_forms() {
        let s = RemoteSpec::parse("nbd+unix:///?socket=/tmp/a.sock").unwrap();
        assert_eq!(s.addr, RemoteAddr::Unix("/tmp/a.sock".into()));
        assert_eq!(s.export, "");
        let s = RemoteSpec::parse("nbd+unix:///disk?socket=/tmp/x,y.sock,depth=8").unwrap();
        assert_eq!(s.addr, RemoteAddr::Unix("/tmp/x,y.sock".into()));
        assert_eq!((s.export.as_str(), s.depth), ("disk", 8));
        assert!(matches!(
            RemoteSpec::parse("nbd+unix:///disk"),
            Err(SpecError::BadUnix { .. })
        ));
        assert!(matches!(
            RemoteSpec::parse("nbd+unix://host/disk?socket=/a"),
            Err(SpecError::BadUnix { .. })
        ));
    }

    #[test]
    fn refusals() {
        let e = RemoteSpec::parse("nbds://h/disk").unwrap_err();
        assert!(matches!(e, SpecError::TlsNotYet(_)));
        assert!(e.to_string().contains("not supported yet"), "{e}");
        assert!(RemoteSpec::is_remote("nbds+unix:///?socket=/a"));
        assert!(!RemoteSpec::is_remote("mem:1M"));
        for bad in [
            "nbd://h:0/",
            "nbd://h:x/",
            "nbd://:1/",
            "nbd://u@h/",
            "nbd://h/d?tls-certificates=/x",
            "nbd+unix:///?socket=/a&tls=on",
            "nbd://h/%zz",
            "nbd://h/d,timeout=0",
            "nbd://h/d,timeout=x",
            "nbd://h/d,depth=0",
            "nbd://h/d,depth=100000",
            "nbd://h/d,reconnect_deadline=-1",
            "nbd://h/d,reconnect_deadline=86401",
            "mem:1M",
        ] {
            assert!(RemoteSpec::parse(bad).is_err(), "{bad}");
        }
        // An unknown option is part of the URI, where it does not fit: refused, not ignored.
        assert!(RemoteSpec::parse("nbd+unix:///?socket=/a,bogus=1")
            .is_ok_and(|s| { s.addr == RemoteAddr::Unix("/a,bogus=1".into()) }));
        assert!(RemoteSpec::parse("nbd://h:1,bogus=1").is_err());
    }
}
