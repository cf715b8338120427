//! Access rules in the handshake: address allow-lists over TCP loopback, Unix clients, and
//! certificate subjects through a fake identity (`Tuning::identify`).
// A plain threaded test, never a loom model: it may use std::sync.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]
#![cfg(not(blkq_loom))]

mod common;

use common::served::{device, Running};
use nbd::client::{ClientError, Endpoint, Handshake};
use nbd::codec::proto::NBD_REP_ERR_POLICY;
use nbd::codec::CmdFlags;
use nbd::server::{parse_cidr, Access, Export, Identity, Peer, Tuning};
use nbd::stream::Stream;

fn allow(cidrs: &[&str]) -> Access {
    Access {
        allow: cidrs.iter().map(|c| parse_cidr(c).unwrap()).collect(),
        ..Access::default()
    }
}

fn subjects(s: &[&str]) -> Access {
    Access {
        allow_subjects: s.iter().map(|s| s.to_string()).collect(),
        ..Access::default()
    }
}

/// Exports: "open" (no rule), "local" (127.0.0.1/32), "remote" (10.0.0.0/8).
fn exports() -> Vec<Export> {
    vec![
        Export::new("open", device("mem:4M")),
        Export::new("local", device("mem:4M")).access(allow(&["10.0.0.0/8", "127.0.0.1/32"])),
        Export::new("remote", device("mem:4M")).access(allow(&["10.0.0.0/8"])),
    ]
}

/// The server with `exports` on its Unix socket and on TCP (127.0.0.1), then `tune`.
fn serving(exports: Vec<Export>, tune: impl FnOnce(&mut Tuning)) -> Running {
    Running::start(exports, |cfg| {
        cfg.tcp = Some("127.0.0.1:0".parse().unwrap());
        tune(&mut cfg.tuning);
    })
}

fn handshake(ep: &Endpoint) -> Handshake {
    Handshake::start(ep.connect().unwrap()).unwrap()
}

fn names(h: &mut Handshake) -> Vec<String> {
    h.list().unwrap().into_iter().map(|(n, _)| n).collect()
}

fn is_policy(r: Result<impl std::fmt::Debug, ClientError>) -> bool {
    match r {
        Err(e) => e.option_error() == Some(NBD_REP_ERR_POLICY),
        Ok(v) => panic!("expected ERR_POLICY, got {v:?}"),
    }
}

#[test]
fn tcp_client_outside_the_allow_list_sees_nothing_and_is_refused() {
    let s = serving(exports(), |_| {});
    let mut h = handshake(&s.tcp());
    assert_eq!(names(&mut h), ["open", "local"]);
    assert!(is_policy(h.info("remote")));
    assert!(is_policy(h.meta_context(
        "remote",
        &["base:allocation"],
        false
    )));
    assert!(is_policy(h.go("remote")));
    // The handshake goes on after a refusal: an allowed export still works.
    let d = h.go("local").unwrap();
    let mut c = h.into_client(d).unwrap();
    c.write(0, &[7u8; 4096], CmdFlags::empty()).unwrap();
    assert_eq!(c.read(0, 4096).unwrap(), vec![7u8; 4096]);

    // NBD_OPT_EXPORT_NAME cannot answer an error: the server closes the connection.
    let h = handshake(&s.tcp());
    assert!(h.export_name("remote").is_err());
    let h = handshake(&s.tcp());
    assert!(h.export_name("open").is_ok());

    // Counted: INFO, the meta context, GO, then EXPORT_NAME (which closed its connection).
    let policy = nbd::server::HandshakeFailure::Policy;
    let i = nbd::server::HandshakeFailure::ALL
        .iter()
        .position(|&r| r == policy)
        .unwrap();
    let metrics = s.server().metrics();
    let mut counted = 0;
    for _ in 0..100 {
        counted = metrics.server().handshake_failures[i];
        if counted == 4 {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert_eq!(counted, 4, "policy refusals counted");
}

#[test]
fn unix_clients_are_not_subject_to_address_rules() {
    let s = serving(exports(), |_| {});
    let mut h = handshake(&s.ep);
    assert_eq!(names(&mut h), ["open", "local", "remote"]);
    let d = h.go("remote").unwrap();
    let mut c = h.into_client(d).unwrap();
    assert_eq!(c.read(0, 512).unwrap(), vec![0u8; 512]);
}

#[test]
fn subject_rules_without_tls_refuse_everyone() {
    let s = serving(
        vec![
            Export::new("open", device("mem:1M")),
            Export::new("certs", device("mem:1M")).access(subjects(&["CN=backup"])),
        ],
        |_| {},
    );
    for ep in [&s.tcp(), &s.ep] {
        let mut h = handshake(ep);
        assert_eq!(names(&mut h), ["open"]);
        assert!(is_policy(h.go("certs")));
    }
}

/// A client whose (pretend) verified certificate says `CN=backup,O=Example`.
fn backup_client(stream: &Stream) -> Identity {
    Identity {
        tls_subject: Some("CN=backup,O=Example".into()),
        ..Identity::of(stream)
    }
}

#[test]
fn subject_rules_with_a_fake_identity() {
    let s = serving(
        vec![
            Export::new("backup", device("mem:1M")).access(subjects(&["attr:CN=backup"])),
            Export::new("exact", device("mem:1M")).access(subjects(&["CN=backup,O=Example"])),
            Export::new("vm", device("mem:1M")).access(subjects(&["CN=vm1,O=Example"])),
            // A plain rule is the whole subject: one attribute of it is not enough.
            Export::new("cn", device("mem:1M")).access(subjects(&["CN=backup"])),
            // Both rules: the address must match too.
            Export::new("far", device("mem:1M")).access(Access {
                allow_subjects: vec!["attr:CN=backup".into()],
                ..allow(&["10.0.0.0/8"])
            }),
        ],
        |t| t.identify = backup_client,
    );
    let mut h = handshake(&s.tcp());
    assert_eq!(names(&mut h), ["backup", "exact"]);
    assert!(is_policy(h.info("vm")));
    assert!(is_policy(h.info("cn")));
    assert!(is_policy(h.info("far")));
    h.info("backup").unwrap();
    let d = h.go("backup").unwrap();
    h.into_client(d).unwrap().flush().unwrap();
    // Over the Unix socket the address rule does not apply: "far" is open to this subject.
    let mut h = handshake(&s.ep);
    assert_eq!(names(&mut h), ["backup", "exact", "far"]);
}

/// A TCP client whose address cannot be read (`getpeername` failed), with the certificate
/// subject the export wants.
fn unknown_tcp_client(_: &Stream) -> Identity {
    Identity {
        peer: Peer::Unknown,
        tls_subject: Some("CN=backup".into()),
    }
}

/// Rule: a TCP client whose address is unknown is refused by any address rule (it is not
/// taken for a Unix client, which address rules do not govern): it sees no such export and
/// gets `NBD_REP_ERR_POLICY` at INFO and GO; exports with no address rule still serve it.
#[test]
fn tcp_client_with_an_unknown_address_is_refused_by_address_rules() {
    let s = serving(
        vec![
            Export::new("open", device("mem:1M")),
            Export::new("everywhere", device("mem:1M")).access(allow(&["0.0.0.0/0", "::/0"])),
            Export::new("subject", device("mem:1M")).access(subjects(&["CN=backup"])),
        ],
        |t| t.identify = unknown_tcp_client,
    );
    let mut h = handshake(&s.tcp());
    assert_eq!(names(&mut h), ["open", "subject"]);
    assert!(is_policy(h.info("everywhere")));
    assert!(is_policy(h.go("everywhere")));
    let d = h.go("subject").unwrap();
    h.into_client(d).unwrap().flush().unwrap();
}
