//! Who may use an export: the client's address (TCP) and TLS certificate subject.
//!
//! Each [`Export`](super::Export) carries an [`Access`] policy. The handshake asks it about
//! the client's [`Identity`] at every point where an export is named: an export the client
//! may not use is left out of `NBD_OPT_LIST`, answers `NBD_REP_ERR_POLICY` to `NBD_OPT_INFO`,
//! `NBD_OPT_GO` and the meta-context options, and closes the connection on
//! `NBD_OPT_EXPORT_NAME` (which cannot answer an error). The identity is read from the socket
//! each time it is needed, not once at accept: a client that upgrades with STARTTLS halfway
//! through the handshake has a certificate subject only from then on. The address rules
//! alone can be asked at accept ([`Access::check_address`]).
//!
//! Rules (both must pass when both are given; an empty list allows everyone):
//! - `allow` (CIDRs): the client's IP address must be in one of them. It applies to TCP
//!   clients only: a Unix-socket client has no address, and who may open the socket is
//!   decided by the socket file's permissions (`--socket-mode`), so address rules never
//!   refuse it. An IPv4 client seen through an IPv6 listener (`::ffff:a.b.c.d`) is matched
//!   as the IPv4 address it is. A TCP client whose address cannot be read (`getpeername`
//!   fails, as it does once the peer has reset the connection) is [`Peer::Unknown`], never
//!   taken for a Unix client: any address rule refuses it ([`Refusal::UnknownAddress`]).
//! - `allow_subjects`: the client must have presented a TLS certificate that the server
//!   verified (`--tls-verify-peer`), and its subject must match one rule. A client without a
//!   verified certificate (plain TCP or Unix, or TLS without a client certificate) matches
//!   none, so is refused.
//!
//! # Subject rules
//!
//! The subject is the text [`subject_of`](crate::tls::subject_of) makes of the certificate
//! (RFC 4514: last RDN first, `,` between RDNs and `+` inside a multi-valued one, no spaces
//! around either; `,` `+` `"` `\` `;` `<` `>`, a leading `#` or space and a trailing space
//! escaped with `\`; a value that is not a string as `#` and its DER in hex; attribute types
//! `CN` `C` `L` `ST` `O` `OU` `STREET` `DC` `UID`, others as dotted OIDs). A rule is one of:
//!
//! - **`SUBJECT`** (the default): matches when the whole subject equals it, byte for byte.
//!   `CN=client1` admits the certificate whose subject is `CN=client1` and nothing else: not
//!   `CN=client1,O=Example`, not a second CN, not `client1` followed by a tab, a newline, a
//!   space or a non-breaking space, not `CN=Client1`. Nothing is trimmed, case-folded or
//!   normalised, on either side.
//! - **`attr:TYPE=VALUE`**: matches when the subject holds exactly one attribute of type
//!   `TYPE`, across all its RDNs (multi-valued ones included), and that attribute's value,
//!   escaped as the subject writes it, equals `VALUE` byte for byte. `attr:CN=client1` admits
//!   `CN=client1,O=Example` but not `CN=client1,CN=mallory` (two CNs) nor `CN=client10`. The
//!   type is compared ignoring ASCII case (`attr:cn=client1` is the same rule), the value
//!   never. An escaped `,` or `+` in the value is part of it (`attr:O=Example\, Inc.`).
//!
//! Rules are checked when the configuration is read ([`parse_subject_rule`]). These are
//! errors: an empty rule; one that begins or ends with whitespace (but for a value's escaped
//! trailing space, `\ `) or holds a control character; an unknown `xxx:` prefix; a part
//! without `=`; an attribute type that subjects never hold (`emailAddress`), and in a
//! whole-subject rule a type in another case than subjects write it (`cn`); a space around
//! `,` `+` `=` or an unescaped one at either end of a value (subjects have none); a lone `\`
//! at the end; an `attr:` rule with more than one attribute. A rule that fails these checks
//! matches nothing if it reaches [`Access`] anyway. `subject_of` writes control characters
//! as they are, so a subject holding one matches no whole-subject rule, only an `attr:` rule
//! on another of its attributes.

use std::fmt;
use std::net::IpAddr;

pub use ipnet::IpNet;

use crate::stream::Stream;

/// An export's access policy (see the module docs). The default allows everyone.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Access {
    /// Client addresses allowed over TCP (empty: any). Unix-socket clients are not affected.
    pub allow: Vec<IpNet>,
    /// TLS certificate subject rules (empty: no certificate needed), in the syntax of
    /// [`parse_subject_rule`] (see "Subject rules" in the module docs). A rule that does not
    /// parse matches nothing.
    pub allow_subjects: Vec<String>,
}

/// Where a client connects from, as far as address rules go.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Peer {
    /// A Unix-socket client: who may connect is up to the socket file's mode, so address
    /// rules never refuse it.
    Unix,
    /// A TCP client, from this address.
    Ip(IpAddr),
    /// A TCP client whose address could not be read (`getpeername` failed). Any address rule
    /// refuses it. The default, so that an identity made up without a peer fails closed.
    #[default]
    Unknown,
}

/// Who a client is, as far as access rules go.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Identity {
    /// Where the client connects from.
    pub peer: Peer,
    /// The subject of the client's verified TLS certificate, if any.
    pub tls_subject: Option<String>,
}

/// Why a client was refused an export: the rule that refused it (for logs and metrics).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Refusal {
    /// The TCP client's address is in none of the export's `allow` CIDRs.
    Address(IpAddr),
    /// The export has `allow` CIDRs and the TCP client's address could not be read.
    UnknownAddress,
    /// The export allows certain certificate subjects and the client presented no verified
    /// certificate.
    NoSubject,
    /// The client's certificate subject matches none of the export's `allow_subjects`.
    Subject(String),
}

impl Identity {
    /// The identity of the client on `stream`: where it connects from (a TCP address, a Unix
    /// socket, or a TCP peer whose address cannot be read) and the subject of its verified TLS
    /// certificate.
    pub fn of(stream: &Stream) -> Self {
        Self {
            peer: match stream.peer_ip() {
                Ok(Some(ip)) => Peer::Ip(ip),
                Ok(None) => Peer::Unix,
                Err(_) => Peer::Unknown,
            },
            tls_subject: stream.tls_subject(),
        }
    }
}

impl Refusal {
    /// A short, stable name of the rule, for metrics labels: `address` or `subject`.
    pub fn reason(&self) -> &'static str {
        match self {
            Refusal::Address(_) | Refusal::UnknownAddress => "address",
            Refusal::NoSubject | Refusal::Subject(_) => "subject",
        }
    }
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Refusal::Address(a) => write!(f, "address {a} is not in the export's allow list"),
            Refusal::UnknownAddress => f.write_str(
                "the export allows only certain addresses and the TCP client's address could \
                 not be read (getpeername failed)",
            ),
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
        self.check_address(who)?;
        if !self.allow_subjects.is_empty() {
            let Some(subject) = &who.tls_subject else {
                return Err(Refusal::NoSubject);
            };
            let matches =
                |rule: &String| parse_subject_rule(rule).is_ok_and(|rule| rule.matches(subject));
            if !self.allow_subjects.iter().any(matches) {
                return Err(Refusal::Subject(subject.clone()));
            }
        }
        Ok(())
    }

    /// The address rules alone (`allow`): a Unix client passes, a TCP client must be in one
    /// of the CIDRs, and one whose address is unknown is refused when there is any. What
    /// [`check`](Self::check) asks first; can be asked at accept, before any option.
    pub fn check_address(&self, who: &Identity) -> Result<(), Refusal> {
        if self.allow.is_empty() {
            return Ok(());
        }
        match who.peer {
            Peer::Unix => Ok(()),
            Peer::Unknown => Err(Refusal::UnknownAddress),
            Peer::Ip(addr) => {
                let addr = addr.to_canonical();
                if self.allow.iter().any(|net| net.contains(&addr)) {
                    Ok(())
                } else {
                    Err(Refusal::Address(addr))
                }
            }
        }
    }
}

// --- Subject rules ---------------------------------------------------------------------------

/// The attribute types [`subject_of`](crate::tls::subject_of) writes by name (its
/// `attr_name`); every other type is written as a dotted OID. A test below checks the two
/// agree.
const SUBJECT_TYPES: [&str; 9] = ["CN", "C", "L", "ST", "O", "OU", "STREET", "DC", "UID"];

/// A parsed certificate subject rule (see "Subject rules" in the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SubjectRule {
    /// `SUBJECT`: the whole subject, byte for byte.
    Exact(String),
    /// `attr:TYPE=VALUE`: exactly one attribute of type `attr` (ASCII case ignored), whose
    /// escaped value is `value` byte for byte.
    Attr {
        /// The attribute type, as the rule spells it.
        attr: String,
        /// The value, escaped as subjects write it.
        value: String,
    },
}

impl SubjectRule {
    /// Whether the subject `subject` (as [`subject_of`](crate::tls::subject_of) writes it)
    /// matches this rule.
    pub fn matches(&self, subject: &str) -> bool {
        match self {
            SubjectRule::Exact(s) => s == subject,
            SubjectRule::Attr { attr, value } => {
                let Ok(attrs) = attributes(subject) else {
                    return false;
                };
                let mut found = attrs.iter().filter(|(t, _)| t.eq_ignore_ascii_case(attr));
                matches!((found.next(), found.next()), (Some((_, v)), None) if v == value)
            }
        }
    }
}

impl fmt::Display for SubjectRule {
    /// The rule as it is written (`CN=client1`, `attr:CN=client1`).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SubjectRule::Exact(s) => f.write_str(s),
            SubjectRule::Attr { attr, value } => write!(f, "attr:{attr}={value}"),
        }
    }
}

impl std::str::FromStr for SubjectRule {
    type Err = SubjectRuleError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        parse_subject_rule(s)
    }
}

/// A subject rule that cannot be used, and why. The text names the rule, not the flag or
/// key it came from: the caller adds that.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SubjectRuleError {
    /// The rule is empty.
    #[error("an empty subject rule matches nothing")]
    Empty,
    /// The rule begins or ends with whitespace (Unicode's, e.g. a non-breaking space).
    #[error(
        "{0:?} begins or ends with whitespace; subject rules match exactly and nothing is \
         trimmed"
    )]
    Whitespace(String),
    /// The rule holds a control character.
    #[error("{rule:?} holds the control character {ch:?}; a subject rule may hold none")]
    Control {
        /// The rule.
        rule: String,
        /// The first control character in it.
        ch: char,
    },
    /// The rule starts with a prefix other than `attr:`.
    #[error(
        "{rule:?}: unknown prefix \"{prefix}:\"; a rule is a whole subject (CN=client1 or \
         CN=client1,O=Example) or attr:TYPE=VALUE"
    )]
    UnknownPrefix {
        /// The rule.
        rule: String,
        /// The prefix, without its colon.
        prefix: String,
    },
    /// A part of the rule (between `,` or `+`) has no `=`.
    #[error(
        "{rule:?}: {part:?} has no '='; a subject is TYPE=VALUE parts joined by ',' (and by \
         '+' inside a multi-valued RDN)"
    )]
    MissingEquals {
        /// The rule.
        rule: String,
        /// The part without `=`.
        part: String,
    },
    /// An attribute type that no subject holds.
    #[error(
        "{rule:?}: unknown attribute type {attr:?}; subjects name CN, C, L, ST, O, OU, \
         STREET, DC and UID, and every other type by its dotted OID (2.5.4.5)"
    )]
    UnknownType {
        /// The rule.
        rule: String,
        /// The type.
        attr: String,
    },
    /// A whole-subject rule spells a type in another case than subjects do.
    #[error(
        "{rule:?}: subjects write the attribute type {attr:?} as {want:?}, and a whole-subject \
         rule matches byte for byte"
    )]
    TypeCase {
        /// The rule.
        rule: String,
        /// The type as the rule spells it.
        attr: String,
        /// The type as subjects spell it.
        want: &'static str,
    },
    /// A space around `,`, `+` or `=`, or an unescaped space at either end of a value.
    #[error(
        "{rule:?}: a space around ',', '+' or '=' in {part:?}; subjects have none there \
         (CN=a,O=b), and a value's own leading or trailing space is escaped ('\\ ')"
    )]
    Space {
        /// The rule.
        rule: String,
        /// The part with the space.
        part: String,
    },
    /// The rule ends in a `\` that escapes nothing.
    #[error("{0:?} ends in a lone '\\'")]
    TrailingBackslash(String),
    /// An `attr:` rule with more than one attribute.
    #[error(
        "{0:?}: attr: takes one TYPE=VALUE (a ',' or '+' in the value is escaped: '\\,', \
         '\\+')"
    )]
    AttrNotOne(String),
}

/// Parses and checks a certificate subject rule: `SUBJECT` (the whole subject, exactly) or
/// `attr:TYPE=VALUE` (exactly one attribute of that type, with exactly that value); see
/// "Subject rules" in the module docs for the syntax and what is refused.
pub fn parse_subject_rule(s: &str) -> Result<SubjectRule, SubjectRuleError> {
    if s.is_empty() {
        return Err(SubjectRuleError::Empty);
    }
    // A value's own trailing space is escaped (`CN=x\ `): that one is not whitespace around
    // the rule.
    let escaped_space = s.ends_with(' ') && !ends_with_unescaped_space(s);
    if s.starts_with(char::is_whitespace) || (s.ends_with(char::is_whitespace) && !escaped_space) {
        return Err(SubjectRuleError::Whitespace(s.into()));
    }
    if let Some(ch) = s.chars().find(|c| c.is_control()) {
        return Err(SubjectRuleError::Control { rule: s.into(), ch });
    }
    // A type holds no ':' (keystrings and dotted OIDs), so a ':' before the first '=' ends a
    // prefix.
    let head = s.split_once('=').map_or(s, |(head, _)| head);
    let (attr_form, dn) = match head.split_once(':') {
        None => (false, s),
        Some(("attr", _)) => (true, &s["attr:".len()..]),
        Some((prefix, _)) => {
            return Err(SubjectRuleError::UnknownPrefix {
                rule: s.into(),
                prefix: prefix.into(),
            })
        }
    };
    let parts = attributes(dn).map_err(|e| match e {
        SplitError::NoEquals(part) => SubjectRuleError::MissingEquals {
            rule: s.into(),
            part: part.into(),
        },
        SplitError::TrailingBackslash => SubjectRuleError::TrailingBackslash(s.into()),
    })?;
    for &(attr, value) in &parts {
        let space = attr.starts_with(' ')
            || attr.ends_with(' ')
            || value.starts_with(' ')
            || ends_with_unescaped_space(value);
        if space {
            return Err(SubjectRuleError::Space {
                rule: s.into(),
                part: format!("{attr}={value}"),
            });
        }
        check_type(s, attr, attr_form)?;
    }
    if !attr_form {
        return Ok(SubjectRule::Exact(s.into()));
    }
    match parts[..] {
        [(attr, value)] => Ok(SubjectRule::Attr {
            attr: attr.into(),
            value: value.into(),
        }),
        _ => Err(SubjectRuleError::AttrNotOne(s.into())),
    }
}

/// Checks an attribute type: one of [`SUBJECT_TYPES`] (ASCII case ignored in an `attr:`
/// rule, exact in a whole-subject one) or a dotted OID.
fn check_type(rule: &str, attr: &str, any_case: bool) -> Result<(), SubjectRuleError> {
    let is_oid = attr.split('.').count() >= 2
        && attr
            .split('.')
            .all(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()));
    if is_oid {
        return Ok(());
    }
    match SUBJECT_TYPES.iter().find(|t| t.eq_ignore_ascii_case(attr)) {
        Some(t) if *t == attr || any_case => Ok(()),
        Some(t) => Err(SubjectRuleError::TypeCase {
            rule: rule.into(),
            attr: attr.into(),
            want: t,
        }),
        None => Err(SubjectRuleError::UnknownType {
            rule: rule.into(),
            attr: attr.into(),
        }),
    }
}

/// Whether `value` ends in a space that no `\\` escapes.
fn ends_with_unescaped_space(value: &str) -> bool {
    let mut escaped = false;
    let mut last_escaped = false;
    for c in value.chars() {
        last_escaped = escaped;
        escaped = c == '\\' && !escaped;
    }
    value.ends_with(' ') && !last_escaped
}

/// Why a name did not split into attributes.
#[derive(Debug)]
enum SplitError<'a> {
    /// This part has no `=`.
    NoEquals(&'a str),
    /// The name ends in a `\` that escapes nothing.
    TrailingBackslash,
}

/// The attributes of an RFC 4514 name, (type, value) in the order written, across all RDNs:
/// split at each `,` and `+` that no `\` escapes, then at each part's first `=` (types hold
/// none). Values stay escaped, as the name writes them.
fn attributes(dn: &str) -> Result<Vec<(&str, &str)>, SplitError<'_>> {
    let mut out = Vec::new();
    let mut start = 0;
    let mut escaped = false;
    let mut parts = Vec::new();
    for (i, c) in dn.char_indices() {
        match c {
            _ if escaped => escaped = false,
            '\\' => escaped = true,
            ',' | '+' => {
                parts.push(&dn[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if escaped {
        return Err(SplitError::TrailingBackslash);
    }
    parts.push(&dn[start..]);
    for part in parts {
        match part.split_once('=') {
            Some(tv) => out.push(tv),
            None => return Err(SplitError::NoEquals(part)),
        }
    }
    Ok(out)
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
            peer: Peer::Ip(a.parse().unwrap()),
            tls_subject: None,
        }
    }

    fn unix() -> Identity {
        Identity {
            peer: Peer::Unix,
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
        assert_eq!(a.check(&unix()), Ok(()));
        assert_eq!(Access::open().check(&tcp("8.8.8.8")), Ok(()));
        // A TCP client whose address is unknown: refused by any address rule, and the
        // default identity is one.
        assert_eq!(a.check(&Identity::default()), Err(Refusal::UnknownAddress));
        assert_eq!(Identity::default().peer, Peer::Unknown);
        assert_eq!(
            a.check_address(&Identity::default()),
            Err(Refusal::UnknownAddress)
        );
        assert_eq!(Refusal::UnknownAddress.reason(), "address");
        assert_eq!(Access::open().check(&Identity::default()), Ok(()));
        // check_address ignores subject rules.
        let both = Access {
            allow_subjects: vec!["CN=a".into()],
            ..a.clone()
        };
        assert_eq!(both.check_address(&tcp("10.0.0.1")), Ok(()));
        assert_eq!(both.check(&tcp("10.0.0.1")), Err(Refusal::NoSubject));
        assert_eq!(
            both.check_address(&tcp("11.0.0.1")),
            Err(Refusal::Address("11.0.0.1".parse().unwrap()))
        );
    }

    #[test]
    fn subjects() {
        let a = Access {
            allow_subjects: vec!["CN=backup".into(), "CN=vm1,O=Example".into()],
            ..Access::default()
        };
        let who = |s: Option<&str>| Identity {
            peer: Peer::Ip("127.0.0.1".parse().unwrap()),
            tls_subject: s.map(str::to_string),
        };
        assert_eq!(a.check(&who(None)), Err(Refusal::NoSubject));
        assert_eq!(a.check(&who(Some("CN=backup"))), Ok(()));
        assert!(a.check(&who(Some("CN=backup,O=Other"))).is_err());
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
        who.peer = Peer::Ip("10.0.0.1".parse().unwrap());
        assert!(matches!(a.check(&who), Err(Refusal::Address(_))));
    }

    /// A client with a (pretend) verified certificate whose subject is `s`, from loopback.
    fn subject(s: &str) -> Identity {
        Identity {
            peer: Peer::Ip("127.0.0.1".parse().unwrap()),
            tls_subject: Some(s.to_string()),
        }
    }

    /// Rule: a plain subject rule matches the whole subject byte for byte. Each subject here
    /// got in under `CN=client1` before (issue 25, finding 2): one component matched, or the
    /// value was trimmed.
    #[test]
    fn plain_rule_refuses_the_reported_bypasses() {
        let a = Access {
            allow_subjects: vec!["CN=client1".into()],
            ..Access::default()
        };
        assert_eq!(a.check(&subject("CN=client1")), Ok(()));
        for s in [
            "CN=client1,O=evil",
            "O=evil,CN=client1",
            "CN=client1,CN=mallory",
            "CN=mallory+CN=client1",
            "CN=client1\t",
            "CN=client1\n",
            "CN=client1\u{a0}",
            "CN=client1 ",
            "CN=client1\\ ",
            " CN=client1",
            "CN=client1\r",
            "CN=client1\u{2003}",
        ] {
            assert_eq!(
                a.check(&subject(s)),
                Err(Refusal::Subject(s.into())),
                "{s:?} must be refused"
            );
        }
    }

    /// Rule: what was refused before stays refused (a longer value, another case, a comma
    /// escaped inside a value).
    #[test]
    fn plain_rule_still_refuses_near_misses() {
        let a = Access {
            allow_subjects: vec!["CN=client1".into()],
            ..Access::default()
        };
        for s in [
            "CN=client10",
            "CN=Client1",
            "cn=client1",
            "CN=x\\,CN=client1",
            "CN=client1\\,O=evil",
        ] {
            assert!(a.check(&subject(s)).is_err(), "{s:?} must be refused");
        }
    }

    /// Rule: a TCP client whose address cannot be read (`getpeername` fails: here the peer
    /// reset the connection) is refused by an address rule, not taken for a Unix client.
    #[test]
    fn tcp_client_with_an_unknown_address_is_refused_by_address_rules() {
        use std::io::Write;
        use std::net::{TcpListener, TcpStream};
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (mut s, _) = l.accept().unwrap();
        // Closing a socket with unread data in it sends a reset, not a FIN.
        s.write_all(b"x").unwrap();
        c.peek(&mut [0u8; 1]).unwrap();
        drop(c); // A reset: the server's socket is closed, and getpeername fails.
        let mut gone = false;
        for _ in 0..200 {
            if s.peer_addr().is_err() {
                gone = true;
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert!(gone, "getpeername still works after the reset");
        let who = Identity::of(&Stream::from(s));
        let a = Access {
            allow: nets(&["10.0.0.0/8"]),
            ..Access::default()
        };
        let r = a.check(&who);
        assert!(
            r.is_err(),
            "an unknown TCP address passed an address rule: {who:?}"
        );
        assert_eq!(who.peer, Peer::Unknown);
        assert_eq!(r, Err(Refusal::UnknownAddress));
        assert_eq!(a.check_address(&who), Err(Refusal::UnknownAddress));
    }

    fn rule(s: &str) -> SubjectRule {
        parse_subject_rule(s).unwrap_or_else(|e| panic!("{s:?}: {e}"))
    }

    /// Rule: `attr:TYPE=VALUE` matches exactly one attribute of the type, anywhere in the
    /// subject (multi-valued RDNs included), with exactly the value; the type's ASCII case is
    /// ignored, the value's never.
    #[test]
    fn attr_rules() {
        let r = rule("attr:CN=client1");
        assert_eq!(
            r,
            SubjectRule::Attr {
                attr: "CN".into(),
                value: "client1".into()
            }
        );
        assert_eq!(r.to_string(), "attr:CN=client1");
        for yes in [
            "CN=client1",
            "CN=client1,O=evil",
            "O=evil,CN=client1",
            "OU=a+CN=client1,C=FR",
        ] {
            assert!(r.matches(yes), "{yes:?}");
        }
        for no in [
            "CN=client1,CN=mallory",
            "CN=mallory,CN=client1",
            "CN=client1+CN=client1",
            "CN=mallory+CN=client1",
            "CN=client1\t",
            "CN=client1\n",
            "CN=client1\u{a0}",
            "CN=client1\\ ",
            "CN=client10",
            "CN=Client1",
            "CN=x\\,CN=client1",
            "CN=x\\+CN=client1",
            "O=client1",
            "",
            "garbage",
        ] {
            assert!(!r.matches(no), "{no:?}");
        }
        assert!(rule("attr:cn=client1").matches("CN=client1"));
        assert!(rule("attr:O=Example\\, Inc.").matches("CN=a,O=Example\\, Inc."));
        assert!(!rule("attr:O=Example").matches("CN=a,O=Example\\, Inc."));
        assert!(rule("attr:2.5.4.42=Ann").matches("CN=a,2.5.4.42=Ann"));
        let a = Access {
            allow_subjects: vec!["attr:CN=client1".into()],
            ..Access::default()
        };
        assert_eq!(a.check(&subject("CN=client1,O=Example")), Ok(()));
        assert!(a.check(&subject("CN=client1,CN=mallory")).is_err());
    }

    /// Rule: plain rules are the whole subject, multi-attribute ones included, as
    /// `subject_of` writes it.
    #[test]
    fn exact_rules() {
        let r = rule("CN=vm1,O=Example\\, Inc.+OU=x,C=FR");
        assert!(r.matches("CN=vm1,O=Example\\, Inc.+OU=x,C=FR"));
        assert!(!r.matches("CN=vm1,O=Example\\, Inc.+OU=x,C=FR,DC=z"));
        assert!(!r.matches("CN=vm1"));
        assert_eq!(r.to_string(), "CN=vm1,O=Example\\, Inc.+OU=x,C=FR");
        assert!(rule("CN=a=b").matches("CN=a=b"));
        assert!(rule("CN=\\ padded\\ ").matches("CN=\\ padded\\ "));
        assert!(rule("CN=#0c03616263").matches("CN=#0c03616263"));
        assert!(rule("CN=").matches("CN="));
        assert!(rule("CN=a:b").matches("CN=a:b"));
        assert_eq!(
            "CN=a".parse::<SubjectRule>(),
            Ok(SubjectRule::Exact("CN=a".into()))
        );
    }

    /// Rule: a rule that could never match, or would match more than it says, is an error
    /// when the configuration is read, and one that reaches `Access` anyway matches nothing.
    #[test]
    fn bad_rules_are_errors() {
        use SubjectRuleError as E;
        let err = |s: &str| parse_subject_rule(s).unwrap_err();
        assert_eq!(err(""), E::Empty);
        for ws in [
            " CN=a",
            "CN=a ",
            "CN=a\t",
            "\u{a0}CN=a",
            "CN=a\u{2003}",
            "\nCN=a",
        ] {
            assert!(matches!(err(ws), E::Whitespace(_)), "{ws:?}: {:?}", err(ws));
        }
        assert!(matches!(err("CN=a\nb"), E::Control { ch: '\n', .. }));
        assert!(matches!(err("CN=a\u{0}b"), E::Control { ch: '\0', .. }));
        assert!(matches!(err("CN=a\u{85}b"), E::Control { .. }));
        assert!(matches!(
            err("exact:CN=a"),
            E::UnknownPrefix { prefix, .. } if prefix == "exact"
        ));
        assert!(matches!(err("ATTR:CN=a"), E::UnknownPrefix { .. }));
        assert!(matches!(err("attrs:CN=a"), E::UnknownPrefix { .. }));
        assert!(matches!(err("client1"), E::MissingEquals { part, .. } if part == "client1"));
        assert!(matches!(err("CN=a,client1"), E::MissingEquals { .. }));
        assert!(matches!(err("attr:client1"), E::MissingEquals { .. }));
        assert!(matches!(err("attr:"), E::MissingEquals { .. }));
        assert!(matches!(err("CN=a,"), E::MissingEquals { .. }));
        assert!(matches!(err("emailAddress=a@b"), E::UnknownType { .. }));
        assert!(matches!(err("=a"), E::UnknownType { .. }));
        assert!(matches!(err("2.5.=a"), E::UnknownType { .. }));
        assert!(matches!(err("cn=a"), E::TypeCase { want: "CN", .. }));
        assert!(matches!(err("CN=a, O=b"), E::Space { .. }));
        assert!(matches!(err("CN=a ,O=b"), E::Space { .. }));
        assert!(matches!(err("CN= a"), E::Space { .. }));
        assert!(matches!(err("CN =a"), E::Space { .. }));
        assert!(matches!(err("attr:CN= a"), E::Space { .. }));
        assert!(matches!(err("CN=a\\"), E::TrailingBackslash(_)));
        assert!(matches!(err("CN=a\\  "), E::Whitespace(_)));
        assert!(matches!(err("CN=a\\\u{a0}"), E::Whitespace(_)));
        assert!(matches!(err("CN=a\\\\ "), E::Whitespace(_)));
        assert!(matches!(err("attr:CN=a,O=b"), E::AttrNotOne(_)));
        assert!(matches!(err("attr:CN=a+O=b"), E::AttrNotOne(_)));
        // The messages name the rule and say what to write.
        let m = err("CN=a, O=b").to_string();
        assert!(m.contains("CN=a, O=b") && m.contains("CN=a,O=b"), "{m}");
        let m = err("foo:CN=a").to_string();
        assert!(m.contains("foo") && m.contains("attr:TYPE=VALUE"), "{m}");
        // A bad rule in an Access matches nothing, even the subject it spells.
        let a = Access {
            allow_subjects: vec!["CN=client1 ".into(), "cn=client1".into()],
            ..Access::default()
        };
        assert!(a.check(&subject("CN=client1 ")).is_err());
        assert!(a.check(&subject("cn=client1")).is_err());
    }

    /// The attribute types rules may name are those `subject_of` writes by name.
    #[test]
    fn subject_types_are_those_subject_of_writes() {
        let oids: [&[u64]; 9] = [
            &[2, 5, 4, 3],
            &[2, 5, 4, 6],
            &[2, 5, 4, 7],
            &[2, 5, 4, 8],
            &[2, 5, 4, 10],
            &[2, 5, 4, 11],
            &[2, 5, 4, 9],
            &[0, 9, 2342, 19200300, 100, 1, 25],
            &[0, 9, 2342, 19200300, 100, 1, 1],
        ];
        let mut p = rcgen::CertificateParams::default();
        p.distinguished_name = rcgen::DistinguishedName::new();
        for oid in oids {
            p.distinguished_name
                .push(rcgen::DnType::CustomDnType(oid.to_vec()), "v");
        }
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = p.self_signed(&key).unwrap();
        let subject = crate::tls::subject_of(cert.der()).unwrap();
        let mut types: Vec<&str> = attributes(&subject)
            .unwrap()
            .into_iter()
            .map(|(t, _)| t)
            .collect();
        types.reverse();
        assert_eq!(types, SUBJECT_TYPES);
        assert!(rule(&subject).matches(&subject));
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
