//! Hostile certificate subjects against `allow_subjects` (issue 25, finding 2): real
//! certificates with crafted subjects, made here (rcgen) and signed by the CA the server
//! trusts, presented over STARTTLS with `verify_peer`. A rule matches the whole subject
//! exactly unless it says `attr:`; nothing is trimmed or folded.
// A plain threaded test, never a loom model: it may use std::sync.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]
#![cfg(not(blkq_loom))]

mod common;

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use common::served::{device, log};
use nbd::client::{ClientError, Endpoint, Handshake};
use nbd::codec::proto::NBD_REP_ERR_POLICY;
use nbd::server::{Access, Export, Server, ServerConfig};
use nbd::tls::{client_config, subject_of, TlsMode, TlsSettings};
use rcgen::{DistinguishedName, DnType};

/// The common name's OID as a custom type: rcgen keeps one value per `DnType`, so a second
/// `CN` attribute has to be pushed under this other key (it writes the same OID).
fn second_cn() -> DnType {
    DnType::CustomDnType(vec![2, 5, 4, 3])
}

struct Pki {
    dir: tempfile::TempDir,
    ca: common::pki::Ca,
}

impl Pki {
    /// A CA and a server certificate (`localhost`, 127.0.0.1) in qemu's layout.
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let ca = common::pki::ca("hostile test CA");
        std::fs::write(dir.path().join("ca-cert.pem"), ca.cert.pem()).unwrap();
        common::pki::leaf(&ca, dir.path(), "server", "localhost", true);
        Self { dir, ca }
    }

    /// A client directory (CA, client certificate and key) for a certificate with subject
    /// `dn`, signed by the CA; and the subject as the server renders it.
    fn client(&self, dn: DistinguishedName) -> (tempfile::TempDir, String) {
        let d = tempfile::tempdir().unwrap();
        std::fs::copy(
            self.dir.path().join("ca-cert.pem"),
            d.path().join("ca-cert.pem"),
        )
        .unwrap();
        let cert = common::pki::leaf_with(&self.ca, d.path(), "client", dn, false);
        (d, subject_of(cert.der()).unwrap())
    }
}

/// A subject pushed in issue order (the first attribute is the first RDN, so it is rendered
/// last).
fn dn(attrs: &[(DnType, &str)]) -> DistinguishedName {
    let mut d = DistinguishedName::new();
    for (t, v) in attrs {
        d.push(t.clone(), *v);
    }
    d
}

struct Serving {
    server: Option<Server>,
    tcp: Endpoint,
    pki: Pki,
}

impl Serving {
    /// `--tls require --tls-verify-peer`, one export "x" under `rules`.
    fn start(rules: &[&str]) -> Self {
        log();
        let pki = Pki::new();
        let access = Access {
            allow_subjects: rules.iter().map(|s| s.to_string()).collect(),
            ..Access::default()
        };
        let mut cfg = ServerConfig::new(vec![Export::new("x", device("mem:1M")).access(access)]);
        cfg.tcp = Some("127.0.0.1:0".parse::<SocketAddr>().unwrap());
        cfg.unix = None;
        cfg.tuning.drain_timeout = Duration::from_secs(5);
        cfg.tls = Some(TlsSettings::load(TlsMode::Require, pki.dir.path(), true).unwrap());
        let server = Server::start(cfg).unwrap();
        let tcp = Endpoint::Tcp(server.tcp_addr().unwrap());
        Self {
            server: Some(server),
            tcp,
            pki,
        }
    }

    /// STARTTLS with the client certificate in `dir`, then GO "x": `Ok` if served, the
    /// option error's reply type if refused.
    fn go(&self, dir: &Path) -> Result<(), u32> {
        let cfg = client_config(dir).unwrap();
        let mut h = Handshake::start(self.tcp.connect().unwrap()).unwrap();
        h.start_tls(&cfg, "localhost").unwrap();
        let listed = h.list().unwrap().len();
        match h.go("x") {
            Ok(d) => {
                assert_eq!(listed, 1, "served but not listed");
                h.into_client(d).unwrap().disconnect().unwrap();
                Ok(())
            }
            Err(ClientError::OptionRefused { reply_type, .. }) => {
                assert_eq!(listed, 0, "refused but listed");
                Err(reply_type)
            }
            Err(e) => panic!("GO failed otherwise: {e}"),
        }
    }
}

impl Drop for Serving {
    fn drop(&mut self) {
        if let Some(s) = self.server.take() {
            s.shutdown();
        }
    }
}

/// Rule: `CN=client1` matches only the certificate whose whole subject is `CN=client1`. A
/// second attribute, a second CN (in its own RDN), and a value that ends in a tab, a newline,
/// a non-breaking space or a space are refused at `NBD_OPT_GO` with `NBD_REP_ERR_POLICY`
/// (and the export is not listed); so are the near misses that always were.
#[test]
fn plain_subject_rule_admits_only_the_exact_subject() {
    let s = Serving::start(&["CN=client1"]);
    let (ok, subject) = s.pki.client(dn(&[(DnType::CommonName, "client1")]));
    assert_eq!(subject, "CN=client1");
    assert_eq!(s.go(ok.path()), Ok(()), "the exact subject is admitted");

    let hostile = [
        dn(&[
            (DnType::OrganizationName, "evil"),
            (DnType::CommonName, "client1"),
        ]),
        dn(&[
            (DnType::CommonName, "client1"),
            (DnType::OrganizationName, "evil"),
        ]),
        dn(&[(second_cn(), "mallory"), (DnType::CommonName, "client1")]),
        dn(&[(DnType::CommonName, "client1\t")]),
        dn(&[(DnType::CommonName, "client1\n")]),
        dn(&[(DnType::CommonName, "client1\u{a0}")]),
        dn(&[(DnType::CommonName, "client1 ")]),
        dn(&[(DnType::CommonName, "client10")]),
        dn(&[(DnType::CommonName, "Client1")]),
        dn(&[(DnType::CommonName, "client1,O=evil")]),
    ];
    let mut admitted = Vec::new();
    for d in hostile {
        let (dir, subject) = s.pki.client(d);
        match s.go(dir.path()) {
            Ok(()) => admitted.push(subject),
            Err(t) => assert_eq!(t, NBD_REP_ERR_POLICY, "{subject:?}"),
        }
    }
    assert!(
        admitted.is_empty(),
        "admitted under CN=client1: {admitted:?}"
    );
}

/// Rule: `attr:CN=client1` matches a subject with exactly one CN whose value is `client1`,
/// whatever else the subject holds; two CNs, or a CN with trailing whitespace, are refused.
#[test]
fn attr_rule_matches_one_attribute_exactly() {
    let s = Serving::start(&["attr:CN=client1"]);
    for d in [
        dn(&[(DnType::CommonName, "client1")]),
        dn(&[
            (DnType::OrganizationName, "Example"),
            (DnType::CommonName, "client1"),
        ]),
    ] {
        let (dir, subject) = s.pki.client(d);
        assert_eq!(s.go(dir.path()), Ok(()), "{subject:?} is admitted");
    }
    for d in [
        dn(&[(second_cn(), "mallory"), (DnType::CommonName, "client1")]),
        dn(&[(DnType::CommonName, "client1"), (second_cn(), "client1")]),
        dn(&[(DnType::CommonName, "client1\t")]),
        dn(&[(DnType::CommonName, "client1\u{a0}")]),
        dn(&[(DnType::OrganizationName, "client1")]),
    ] {
        let (dir, subject) = s.pki.client(d);
        assert_eq!(
            s.go(dir.path()),
            Err(NBD_REP_ERR_POLICY),
            "{subject:?} must be refused"
        );
    }
}
