//! Who may use an export: the client's address (TCP) and TLS certificate subject.
//!
//! Each [`Export`](super::Export) carries an [`Access`] policy. The handshake asks it about
//! the client's [`Identity`] at every point where an export is named: an export the client
//! may not use is left out of `NBD_OPT_LIST`, answers `NBD_REP_ERR_POLICY` to `NBD_OPT_INFO`,
//! `NBD_OPT_GO` and the meta-context options, and closes the connection on
//! `NBD_OPT_EXPORT_NAME` (which cannot answer an error). The identity is read from the socket
//! each time it is needed, not once at accept: a client that upgrades with STARTTLS halfway
//! through the handshake has a certificate subject only from then on.
//!
//! Rules (both must pass when both are given; an empty list allows everyone):
//! - `allow` (CIDRs): the client's IP address must be in one of them. It applies to TCP
//!   clients only: a Unix-socket client has no address, and who may open the socket is
//!   decided by the socket file's permissions (`--socket-mode`), so address rules never
//!   refuse it. An IPv4 client seen through an IPv6 listener (`::ffff:a.b.c.d`) is matched
//!   as the IPv4 address it is.
//! - `allow_subjects`: the client must have presented a TLS certificate that the server
//!   verified (`--tls-verify-peer`), and its subject must match one entry: either the whole
//!   subject as [`Stream::tls_subject`](crate::stream::Stream::tls_subject) spells it, or one
//!   of its comma-separated components (`CN=backup` matches `CN=backup,O=Example`). A client
//!   without a verified certificate (plain TCP or Unix, or TLS without a client certificate)
//!   matches none, so is refused.

use std::fmt;
use std::net::IpAddr;

pub use ipnet::IpNet;

use crate::stream::Stream;

/// An export's access policy (see the module docs). The default allows everyone.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Access {
    /// Client addresses allowed over TCP (empty: any). Unix-socket clients are not affected.
    pub allow: Vec<IpNet>,
    /// TLS certificate subjects allowed (empty: no certificate needed).
    pub allow_subjects: Vec<String>,
}

/// Who a client is, as far as access rules go.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Identity {
    /// The peer's IP address (TCP); `None` on a Unix socket.
    pub addr: Option<IpAddr>,
    /// The subject of the client's verified TLS certificate, if any.
    pub tls_subject: Option<String>,
}

/// Why a client was refused an export: the rule that refused it (for logs and metrics).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Refusal {
    /// The TCP client's address is in none of the export's `allow` CIDRs.
    Address(IpAddr),
    /// The export allows certain certificate subjects and the client presented no verified
    /// certificate.
    NoSubject,
    /// The client's certificate subject matches none of the export's `allow_subjects`.
    Subject(String),
}

impl Identity {
    /// The identity of the client on `stream`: its IP address (TCP) and the subject of its
    /// verified TLS certificate.
    pub fn of(stream: &Stream) -> Self {
        Self {
            addr: stream.peer_ip(),
            tls_subject: stream.tls_subject(),
        }
    }
}

impl Refusal {
    /// A short, stable name of the rule, for metrics labels: `address` or `subject`.
    pub fn reason(&self) -> &'static str {
        match self {
            Refusal::Address(_) => "address",
            Refusal::NoSubject | Refusal::Subject(_) => "subject",
        }
    }
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Refusal::Address(a) => write!(f, "address {a} is not in the export's allow list"),
            Refusal::NoSubject => f.write_str(
                "the export allows only certain TLS certificate subjects and the client \
                 presented no verified certificate",
            ),
            Refusal::Subject(s) => {
                write!(
                    f,
                    "certificate subject {s:?} is not in the export's allow_subjects"
                )
            }
        }
    }
}

impl Access {
    /// Allows everyone.
    pub fn open() -> Self {
        Self::default()
    }

    /// Whether there is any rule at all.
    pub fn is_open(&self) -> bool {
        self.allow.is_empty() && self.allow_subjects.is_empty()
    }

    /// Whether `who` may use the export; the rule that refuses it otherwise.
    pub fn check(&self, who: &Identity) -> Result<(), Refusal> {
        if let (false, Some(addr)) = (self.allow.is_empty(), who.addr) {
            let addr = addr.to_canonical();
            if !self.allow.iter().any(|net| net.contains(&addr)) {
                return Err(Refusal::Address(addr));
            }
        }
        if !self.allow_subjects.is_empty() {
            let Some(subject) = &who.tls_subject else {
                return Err(Refusal::NoSubject);
            };
            if !self
                .allow_subjects
                .iter()
                .any(|rule| subject_matches(rule, subject))
            {
                return Err(Refusal::Subject(subject.clone()));
            }
        }
        Ok(())
    }
}

/// Whether subject rule `rule` matches `subject`: the whole subject, or one of its
/// components (split at commas not escaped with a backslash), spaces around them ignored.
fn subject_matches(rule: &str, subject: &str) -> bool {
    let rule = rule.trim();
    if rule.is_empty() {
        return false;
    }
    if rule == subject.trim() {
        return true;
    }
    let mut start = 0;
    let mut escaped = false;
    for (i, c) in subject.char_indices() {
        match c {
            '\\' if !escaped => escaped = true,
            ',' if !escaped => {
                if subject[start..i].trim() == rule {
                    return true;
                }
                start = i + 1;
            }
            _ => escaped = false,
        }
    }
    subject[start..].trim() == rule
}

/// Parses a CIDR (`10.0.0.0/8`, `fd00::/8`) or a bare address (a host: `/32` or `/128`).
/// Host bits after the prefix are cleared (`10.1.2.3/8` is `10.0.0.0/8`).
pub fn parse_cidr(s: &str) -> Result<IpNet, CidrError> {
    let s = s.trim();
    let net = match s.parse::<IpNet>() {
        Ok(n) => n,
        Err(_) if !s.contains('/') => match s.parse::<IpAddr>() {
            Ok(a) => IpNet::from(a),
            Err(_) => return Err(CidrError(s.to_string())),
        },
        Err(_) => return Err(CidrError(s.to_string())),
    };
    Ok(net.trunc())
}

/// A string that is not a CIDR.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{0:?} is not a CIDR (expected ADDRESS/PREFIX such as 10.0.0.0/8 or fd00::/8, or an address)"
)]
pub struct CidrError(pub String);

#[cfg(test)]
mod tests {
    use super::*;

    fn tcp(a: &str) -> Identity {
        Identity {
            addr: Some(a.parse().unwrap()),
            tls_subject: None,
        }
    }

    fn nets(v: &[&str]) -> Vec<IpNet> {
        v.iter().map(|s| parse_cidr(s).unwrap()).collect()
    }

    #[test]
    fn addresses() {
        let a = Access {
            allow: nets(&["10.0.0.0/8", "192.168.1.7", "fd00::/8"]),
            ..Access::default()
        };
        assert_eq!(a.check(&tcp("10.200.0.1")), Ok(()));
        assert_eq!(a.check(&tcp("192.168.1.7")), Ok(()));
        assert_eq!(a.check(&tcp("fd12::1")), Ok(()));
        assert_eq!(a.check(&tcp("::ffff:10.1.1.1")), Ok(()));
        assert_eq!(
            a.check(&tcp("192.168.1.8")),
            Err(Refusal::Address("192.168.1.8".parse().unwrap()))
        );
        assert_eq!(
            a.check(&tcp("::ffff:127.0.0.1")),
            Err(Refusal::Address("127.0.0.1".parse().unwrap()))
        );
        // Unix clients: governed by the socket's mode.
        assert_eq!(a.check(&Identity::default()), Ok(()));
        assert_eq!(Access::open().check(&tcp("8.8.8.8")), Ok(()));
    }

    #[test]
    fn subjects() {
        let a = Access {
            allow_subjects: vec!["CN=backup".into(), "CN=vm1,O=Example".into()],
            ..Access::default()
        };
        let who = |s: Option<&str>| Identity {
            addr: Some("127.0.0.1".parse().unwrap()),
            tls_subject: s.map(str::to_string),
        };
        assert_eq!(a.check(&who(None)), Err(Refusal::NoSubject));
        assert_eq!(a.check(&who(Some("CN=backup"))), Ok(()));
        assert_eq!(a.check(&who(Some("CN=backup, O=Other"))), Ok(()));
        assert_eq!(a.check(&who(Some("CN=vm1,O=Example"))), Ok(()));
        assert_eq!(
            a.check(&who(Some("CN=vm1,O=Other"))),
            Err(Refusal::Subject("CN=vm1,O=Other".into()))
        );
        // An escaped comma is part of the value, not a separator.
        assert!(a.check(&who(Some("CN=x\\,CN=backup"))).is_err());
        assert_eq!(Refusal::NoSubject.reason(), "subject");
        assert_eq!(Refusal::Address([1, 2, 3, 4].into()).reason(), "address");
    }

    #[test]
    fn both_rules() {
        let a = Access {
            allow: nets(&["127.0.0.0/8"]),
            allow_subjects: vec!["CN=a".into()],
        };
        let mut who = tcp("127.0.0.1");
        assert_eq!(a.check(&who), Err(Refusal::NoSubject));
        who.tls_subject = Some("CN=a".into());
        assert_eq!(a.check(&who), Ok(()));
        who.addr = Some("10.0.0.1".parse().unwrap());
        assert!(matches!(a.check(&who), Err(Refusal::Address(_))));
    }

    #[test]
    fn cidrs() {
        assert_eq!(parse_cidr("10.1.2.3/8").unwrap().to_string(), "10.0.0.0/8");
        assert_eq!(
            parse_cidr(" 127.0.0.1 ").unwrap().to_string(),
            "127.0.0.1/32"
        );
        assert_eq!(parse_cidr("::1").unwrap().to_string(), "::1/128");
        for bad in ["10.0.0/8", "10.0.0.0/33", "", "host", "10.0.0.0/", "::/129"] {
            assert!(parse_cidr(bad).is_err(), "{bad}");
        }
    }
}
