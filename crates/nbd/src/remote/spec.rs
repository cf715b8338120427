//! `nbd://`, `nbd+unix://`, `nbds://` and `nbds+unix://` device specs (the NBD URI format,
//! <https://github.com/NetworkBlockDevice/nbd/blob/master/doc/uri.md>), with the remote
//! device's own options after commas.
//!
//! ```text
//! nbd://HOST[:PORT][/EXPORT][,timeout=SECS][,depth=N][,reconnect_deadline=SECS][,conns=N]
//!     [,send=inline|thread]
//! nbd+unix:///[EXPORT]?socket=PATH[,OPTIONS]
//! nbds://HOST[:PORT][/EXPORT]?tls-certificates=DIR[&tls-hostname=NAME][,OPTIONS]
//! nbds+unix:///[EXPORT]?socket=PATH&tls-certificates=DIR[&tls-hostname=NAME][,OPTIONS]
//! ```
//!
//! `nbds` is TLS (`NBD_OPT_STARTTLS`, required: a server that refuses it is an error, never a
//! fall-back to plaintext). The query parameters are libnbd's: `tls-certificates=DIR` holds
//! `ca-cert.pem` (the CA the server's certificate must chain to) and, for a client
//! certificate, `client-cert.pem` and `client-key.pem` (the layout `blkq certs`, qemu and
//! nbdkit use); it is read again at every reconnection, so renewed certificates are picked
//! up. `tls-hostname=NAME` is the name checked against the server's certificate (default:
//! the host of the URI; `localhost` for a Unix socket). TLS parameters on a plaintext URI are
//! refused.
//!
//! - `timeout=SECS` (1..=86400, default 30): a request unanswered this long on a connection
//!   declares the connection dead: nothing more is sent on it, and it is re-established
//!   once every request sent on it is answered or the server has closed it (what was sent
//!   on it may still be carried out, so nothing is re-sent before).
//!   Also the longest a submitter waits for a free slot (then `ETIMEDOUT`), and the period
//!   of the TCP keepalive probes (the kernel gives a silent connection up after ten times
//!   it).
//! - `depth=N` (1..=4096, default 64): requests in flight at once on each connection (the
//!   slot table).
//! - `conns=N` (1..=16, default 1): connections to open when the server offers multi-conn
//!   (`NBD_FLAG_CAN_MULTI_CONN`: a flush on one covers writes completed on all); requests
//!   are spread over them round-robin, passing over one that is reconnecting. A server
//!   without multi-conn gets one connection (logged).
//! - `reconnect_deadline=SECS` (0..=86400, default 15): how long requests wait for a broken
//!   connection to be re-established before they fail with `EIO`; past it, and while still
//!   disconnected, new requests fail at once and the device reports itself unavailable (a
//!   mirror fails the leg, even an idle one). The device keeps reconnecting in the background
//!   either way and serves again once connected. `0` fails what is in flight at once when the
//!   connection breaks. The deadline is checked while an old connection drains (every quarter
//!   of `timeout`) and between reconnection attempts, and one attempt (to a server that accepts
//!   and never answers) may take up to `timeout`, so requests fail at most that much after it.
//!   The default is long enough for a server process to restart or a network path to fail over,
//!   and short enough that a mirror above this device marks the leg faulty and goes on serving
//!   within seconds instead of stalling its writers. A request outstanding for `timeout` plus
//!   the deadline when a connection breaks fails with `ETIMEDOUT`, however many times it was
//!   sent.
//! - `send=inline|thread` (default `inline`): who writes a request to the socket. `inline`:
//!   the submitting thread, when the connection's send side is free, with a non-blocking
//!   write; what the socket does not take at once goes to the connection's sender thread.
//!   `thread`: always the sender thread (one more thread wake-up per request; the simple
//!   path, kept to compare with). TLS connections always use the sender thread.
//!
//! The port defaults to 10809 and the export name to the empty (default) export; the export
//! and the socket path are percent-decoded. Options are peeled off the end: a trailing
//! `,KEY=VALUE` whose key is a known option is an option, anything before it is the URI (so a
//! comma inside a socket path or an export name stays part of it).

use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Default request timeout.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);
/// Default number of in-flight slots.
pub const DEFAULT_DEPTH: usize = 64;
/// Most in-flight slots one connection may have.
pub const MAX_DEPTH: usize = 4096;
/// Longest request timeout, seconds (a day).
pub const MAX_TIMEOUT_SECS: u64 = 86_400;
/// Most connections `conns=` may ask for.
pub const MAX_CONNS: usize = 16;
/// Default `reconnect_deadline=` (see the module documentation for why).
pub const DEFAULT_RECONNECT_DEADLINE: Duration = Duration::from_secs(15);

const OPTIONS: [&str; 5] = ["timeout", "depth", "reconnect_deadline", "conns", "send"];
/// The query parameters whose values are paths (`socket=PATH`, `tls-certificates=DIR`): a
/// config file makes them relative to its directory ([`RemoteSpec::rebase`]).
pub const PATH_PARAMS: [&str; 2] = ["socket", "tls-certificates"];

/// Who writes a request to the socket (`send=`; see the module documentation).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SendMode {
    /// The submitting thread when the send side is free (non-blocking), else the sender
    /// thread.
    #[default]
    Inline,
    /// Always the sender thread.
    Thread,
}

/// Errors of [`RemoteSpec::parse`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SpecError {
    /// Not an `nbd://` or `nbd+unix://` URI.
    #[error("{0:?} is not an nbd:// or nbd+unix:// URI")]
    NotRemote(String),
    /// A TLS URI without `tls-certificates=DIR`.
    #[error(
        "{0}: nbds:// needs ?tls-certificates=DIR (holding ca-cert.pem, and client-cert.pem \
         and client-key.pem for a client certificate)"
    )]
    TlsNeedsCertificates(String),
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
    /// TLS (`nbds`): where the certificates are, and the name the server's certificate must
    /// carry.
    pub tls: Option<TlsSpec>,
    /// Connections when the server offers multi-conn (`conns=N`).
    pub conns: usize,
    /// Who writes a request to the socket (`send=inline|thread`).
    pub send: SendMode,
}

/// The TLS part of an `nbds://` or `nbds+unix://` spec.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsSpec {
    /// `tls-certificates=DIR`.
    pub certificates: PathBuf,
    /// `tls-hostname=NAME`, or the URI's host (`localhost` for a Unix socket).
    pub hostname: String,
}

/// What the query string said.
#[derive(Default)]
struct Query {
    socket: Option<String>,
    certificates: Option<String>,
    hostname: Option<String>,
}

impl RemoteSpec {
    /// Whether `s` names a remote export (TLS forms included): what a caller checks before
    /// choosing this parser over a local device spec's.
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
        let mut conns = 1;
        let mut send = SendMode::Inline;
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
                    "conns" => conns = parse_conns(v)?,
                    "send" => send = parse_send(v)?,
                    _ => reconnect_deadline = parse_deadline(v)?,
                }
            }
            uri = head;
        }
        let (tls, unix, rest) = [
            ("nbd+unix://", false, true),
            ("nbd://", false, false),
            ("nbds+unix://", true, true),
            ("nbds://", true, false),
        ]
        .iter()
        .find_map(|(p, tls, unix)| Some((*tls, *unix, uri.strip_prefix(p)?)))
        .ok_or_else(|| SpecError::NotRemote(s.to_string()))?;
        let (addr, export, q) = if unix {
            parse_unix(uri, rest, tls)?
        } else {
            parse_tcp(uri, rest, tls)?
        };
        let tls = match (tls, q.certificates) {
            (false, _) => None,
            (true, None) => return Err(SpecError::TlsNeedsCertificates(uri.to_string())),
            (true, Some(dir)) => Some(TlsSpec {
                certificates: PathBuf::from(dir),
                hostname: q.hostname.unwrap_or_else(|| match &addr {
                    RemoteAddr::Tcp { host, .. } => host.clone(),
                    RemoteAddr::Unix(_) => "localhost".into(),
                }),
            }),
        };
        Ok(Self {
            addr,
            export,
            timeout,
            depth,
            reconnect_deadline,
            tls,
            conns,
            send,
        })
    }
}

impl RemoteSpec {
    /// `spec` with its relative path parameters ([`PATH_PARAMS`]) joined to `dir` (a config
    /// file's directory), written `%XX`-escaped, as the URI's values are read; the rest of
    /// the text as it is.
    pub fn rebase(spec: &str, dir: &Path) -> String {
        let Some(at) = spec.find('?') else {
            return spec.to_string();
        };
        let (head, query) = spec.split_at(at + 1);
        let params: Vec<String> = query
            .split('&')
            .map(|p| match p.split_once('=') {
                Some((k, v))
                    if PATH_PARAMS.contains(&k)
                        && !v.is_empty()
                        && !v.starts_with('/')
                        && !v.to_ascii_lowercase().starts_with("%2f") =>
                {
                    format!("{k}={}/{v}", escape(dir))
                }
                _ => p.to_string(),
            })
            .collect();
        format!("{head}{}", params.join("&"))
    }
}

impl std::str::FromStr for RemoteSpec {
    type Err = SpecError;
    fn from_str(s: &str) -> Result<Self, SpecError> {
        Self::parse(s)
    }
}

/// The URI without options and TLS parameters (the export name and socket path as given,
/// unescaped).
impl fmt::Display for RemoteSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = if self.tls.is_some() { "s" } else { "" };
        match &self.addr {
            RemoteAddr::Tcp { host, port } if host.contains(':') => {
                write!(f, "nbd{s}://[{host}]:{port}/{}", self.export)
            }
            RemoteAddr::Tcp { host, port } => {
                write!(f, "nbd{s}://{host}:{port}/{}", self.export)
            }
            RemoteAddr::Unix(p) => {
                write!(f, "nbd{s}+unix:///{}?socket={}", self.export, p.display())
            }
        }
    }
}

/// Parses a query string: `socket` (Unix only), `tls-certificates` and `tls-hostname` (TLS
/// only); anything else is refused.
fn parse_query(uri: &str, query: Option<&str>, unix: bool, tls: bool) -> Result<Query, SpecError> {
    let mut q = Query::default();
    for param in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        let slot = match param.split_once('=') {
            Some(("socket", v)) if unix => Some((&mut q.socket, v)),
            Some(("tls-certificates", v)) if tls => Some((&mut q.certificates, v)),
            Some(("tls-hostname", v)) if tls => Some((&mut q.hostname, v)),
            _ => None,
        };
        match slot {
            Some((field, v)) => *field = Some(unescape(uri, v)?).filter(|v| !v.is_empty()),
            None => {
                return Err(SpecError::UnsupportedQuery {
                    uri: uri.to_string(),
                    param: param.to_string(),
                })
            }
        }
    }
    Ok(q)
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

fn parse_conns(v: &str) -> Result<usize, SpecError> {
    match v.parse::<usize>() {
        Ok(n) if (1..=MAX_CONNS).contains(&n) => Ok(n),
        _ => Err(SpecError::BadOption {
            key: "conns",
            value: v.to_string(),
            reason: format!("expected 1..={MAX_CONNS}"),
        }),
    }
}

fn parse_send(v: &str) -> Result<SendMode, SpecError> {
    match v {
        "inline" => Ok(SendMode::Inline),
        "thread" => Ok(SendMode::Thread),
        _ => Err(SpecError::BadOption {
            key: "send",
            value: v.to_string(),
            reason: "expected inline or thread".to_string(),
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

/// `%XX`-escapes every byte of a path but unreserved URI characters and `/` ([`unescape`]'s
/// inverse).
fn escape(p: &Path) -> String {
    use std::os::unix::ffi::OsStrExt;
    let mut out = String::new();
    for &b in p.as_os_str().as_bytes() {
        if b.is_ascii_alphanumeric() || b"-._~/".contains(&b) {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
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

fn parse_tcp(uri: &str, rest: &str, tls: bool) -> Result<(RemoteAddr, String, Query), SpecError> {
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
        None => nbd_proto::proto::NBD_DEFAULT_PORT,
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
    let q = parse_query(uri, query, false, tls)?;
    let host = unescape(uri, host)?;
    Ok((RemoteAddr::Tcp { host, port }, export, q))
}

fn parse_unix(uri: &str, rest: &str, tls: bool) -> Result<(RemoteAddr, String, Query), SpecError> {
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
    let mut q = parse_query(uri, query, true, tls)?;
    let socket = q.socket.take().ok_or(bad("no ?socket=PATH"))?;
    Ok((RemoteAddr::Unix(PathBuf::from(socket)), export, q))
}

#[cfg(all(test, not(blkq_loom)))]
mod tests {
    use super::*;

    /// Each path parameter is one the parser reads as a path, and `rebase` joins it to the
    /// directory, escaped so that it parses back to the joined path.
    #[test]
    fn rebase_joins_each_path_param_to_the_directory() {
        let dir = Path::new("/srv/a b&c%d,e");
        for p in PATH_PARAMS {
            let spec =
                format!("nbds+unix:///x?socket=/abs.sock&tls-certificates=/pki&{p}=r%2Ex,depth=4");
            let r = RemoteSpec::parse(&RemoteSpec::rebase(&spec, dir)).unwrap();
            let got = match p {
                "socket" => match r.addr {
                    RemoteAddr::Unix(path) => path,
                    a => panic!("{a:?}"),
                },
                _ => r.tls.unwrap().certificates,
            };
            assert_eq!(got, dir.join("r.x"), "{p}");
            assert_eq!(r.depth, 4, "{p}");
        }
        let abs = "nbds+unix:///?socket=/abs.sock&tls-certificates=%2Fpki&tls-hostname=h";
        assert_eq!(RemoteSpec::rebase(abs, dir), abs);
    }

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
        assert_eq!(s.send, SendMode::Inline);
        let s = RemoteSpec::parse("nbd://h/d,send=thread").unwrap();
        assert_eq!(s.send, SendMode::Thread);
        let s = RemoteSpec::parse("nbd://h/d,reconnect_deadline=90").unwrap();
        assert_eq!(s.reconnect_deadline, Duration::from_secs(90));
        assert_eq!(s.conns, 1);
        assert_eq!(RemoteSpec::parse("nbd://h/d,conns=4").unwrap().conns, 4);
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
    fn tls_forms() {
        let s = RemoteSpec::parse("nbds://h:99/disk?tls-certificates=/etc/pki,depth=4").unwrap();
        assert_eq!(s.addr, tcp("h", 99));
        assert_eq!(s.depth, 4);
        let t = s.tls.clone().unwrap();
        assert_eq!(t.certificates, PathBuf::from("/etc/pki"));
        assert_eq!(t.hostname, "h");
        assert_eq!(s.to_string(), "nbds://h:99/disk");
        let s = RemoteSpec::parse(
            "nbds+unix:///d?socket=/tmp/s&tls-certificates=/c%20d&tls-hostname=srv.example",
        )
        .unwrap();
        assert_eq!(s.addr, RemoteAddr::Unix("/tmp/s".into()));
        let t = s.tls.unwrap();
        assert_eq!(t.certificates, PathBuf::from("/c d"));
        assert_eq!(t.hostname, "srv.example");
        let s = RemoteSpec::parse("nbds+unix:///?tls-certificates=/c&socket=/s").unwrap();
        assert_eq!(s.tls.unwrap().hostname, "localhost");
        assert!(RemoteSpec::parse("nbd://h/d").unwrap().tls.is_none());
    }

    #[test]
    fn refusals() {
        let e = RemoteSpec::parse("nbds://h/disk").unwrap_err();
        assert!(matches!(e, SpecError::TlsNeedsCertificates(_)));
        assert!(e.to_string().contains("tls-certificates=DIR"), "{e}");
        for bad in [
            "nbds+unix:///?socket=/a",
            "nbds://h/d?tls-certificates=",
            "nbds://h/d?tls-certificates=/c&socket=/s",
            "nbds://h/d?tls-certificates=/c&tls-psk-file=/k",
            "nbd+unix:///?socket=/a&tls-certificates=/c",
            "nbd://h/d?tls-hostname=x",
        ] {
            assert!(RemoteSpec::parse(bad).is_err(), "{bad}");
        }
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
            "nbd://h/d,send=maybe",
            "nbd://h/d,depth=100000",
            "nbd://h/d,reconnect_deadline=-1",
            "nbd://h/d,reconnect_deadline=86401",
            "nbd://h/d,conns=0",
            "nbd://h/d,conns=17",
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
