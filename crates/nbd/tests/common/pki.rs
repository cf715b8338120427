//! Certificates for the TLS tests, made with rcgen (never committed): a CA, server and client
//! certificates in qemu's and nbdkit's layout.

use std::path::Path;

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, SanType,
};

/// A certificate authority: its certificate and key.
pub struct Ca {
    pub cert: rcgen::Certificate,
    pub key: KeyPair,
}

/// A self-signed CA with common name `name`.
pub fn ca(name: &str) -> Ca {
    let mut p = CertificateParams::default();
    p.distinguished_name.push(DnType::CommonName, name);
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let key = KeyPair::generate().unwrap();
    let cert = p.self_signed(&key).unwrap();
    Ca { cert, key }
}

/// Writes `prefix-cert.pem` and `prefix-key.pem` signed by `ca` into `dir`: a server
/// certificate for localhost and 127.0.0.1, or a client certificate, with common name `cn`.
pub fn leaf(ca: &Ca, dir: &Path, prefix: &str, cn: &str, server: bool) {
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, cn);
    leaf_with(ca, dir, prefix, dn, server);
}

/// [`leaf`] with any subject `dn`; the certificate made.
pub fn leaf_with(
    ca: &Ca,
    dir: &Path,
    prefix: &str,
    dn: DistinguishedName,
    server: bool,
) -> rcgen::Certificate {
    let mut p = CertificateParams::default();
    p.distinguished_name = dn;
    if server {
        p.subject_alt_names = vec![
            SanType::DnsName("localhost".try_into().unwrap()),
            SanType::IpAddress("127.0.0.1".parse().unwrap()),
        ];
        p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    } else {
        p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    }
    let key = KeyPair::generate().unwrap();
    let cert = p.signed_by(&key, &ca.cert, &ca.key).unwrap();
    std::fs::write(dir.join(format!("{prefix}-cert.pem")), cert.pem()).unwrap();
    std::fs::write(dir.join(format!("{prefix}-key.pem")), key.serialize_pem()).unwrap();
    cert
}

/// A directory in qemu's layout: ca-cert.pem, server-*, and client-* (CN=client1).
pub fn pki(dir: &Path) {
    let ca = ca("test CA");
    std::fs::write(dir.join("ca-cert.pem"), ca.cert.pem()).unwrap();
    leaf(&ca, dir, "server", "localhost", true);
    leaf(&ca, dir, "client", "client1", false);
}
