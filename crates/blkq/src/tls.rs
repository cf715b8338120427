//! `blkq serve`'s TLS flags (nbdkit's meaning) and `blkq certs`, which makes a CA, a server
//! certificate and optionally a client certificate in the layout qemu and nbdkit read.

use std::fs;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Args;
use nbd::tls::{TlsMode, TlsSettings};

use crate::config::{self, Source, TlsMode as TlsFlag};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose, SanType,
};

/// TLS flags of `blkq serve` (`[tls]` in a `--config` file: mode, certificates, verify_peer).
#[derive(Args, Debug, Clone, Default)]
pub struct TlsArgs {
    /// TLS: off, on (offered) or require (no option but STARTTLS and ABORT before it).
    #[arg(long, value_enum, default_value_t = TlsFlag::Off, value_name = "off|on|require")]
    pub tls: TlsFlag,
    /// Directory holding ca-cert.pem, server-cert.pem and server-key.pem (qemu's and
    /// nbdkit's layout; `blkq certs DIR` makes one).
    #[arg(long, value_name = "DIR")]
    pub tls_certificates: Option<PathBuf>,
    /// Require a client certificate signed by the directory's ca-cert.pem.
    #[arg(long)]
    pub tls_verify_peer: bool,
}

#[cfg(test)]
impl TlsArgs {
    /// The flags as the configuration's validated settings (what `[tls]` gives too).
    pub fn checked(&self) -> config::TlsSettings {
        config::TlsSettings {
            mode: self.tls,
            certificates: self.tls_certificates.clone(),
            verify_peer: self.tls_verify_peer,
        }
    }

    /// The server's TLS settings (`None`: off); see [`load`].
    pub fn settings(&self) -> Result<Option<TlsSettings>> {
        load(&self.checked(), &Source::CommandLine)
    }
}

/// Loads the certificates that validated TLS settings name: the server's TLS configuration
/// (`None`: off). Errors name the flag (`--tls-certificates`) or the file's `[tls]` key.
pub fn load(s: &config::TlsSettings, src: &Source) -> Result<Option<TlsSettings>> {
    let file = matches!(src, Source::File { .. });
    let (certs_name, mode_name) = if file {
        ("[tls] certificates", "[tls] mode")
    } else {
        ("--tls-certificates", "--tls")
    };
    let mode = match s.mode {
        TlsFlag::Off => {
            if s.certificates.is_some() {
                tracing::warn!("{certs_name} is ignored: TLS is off ({mode_name} on|require)");
            }
            return Ok(None);
        }
        TlsFlag::On => TlsMode::On,
        TlsFlag::Require => TlsMode::Require,
    };
    let Some(dir) = &s.certificates else {
        bail!(
            "{mode_name} on|require needs {certs_name} DIR (ca-cert.pem, server-cert.pem, \
             server-key.pem; `blkq certs DIR` makes them)"
        );
    };
    if mode == TlsMode::On && s.verify_peer {
        tracing::warn!(
            "TLS on with verify-peer: clients that do not start TLS are still served, without a \
             certificate (TLS require closes that door)"
        );
    }
    let settings = TlsSettings::load(mode, dir, s.verify_peer)
        .with_context(|| format!("{certs_name} {}", dir.display()))?;
    Ok(Some(settings))
}

/// `blkq certs`.
#[derive(Args, Debug)]
pub struct CertsArgs {
    /// Directory to write into (created if missing): ca-cert.pem, ca-key.pem,
    /// server-cert.pem, server-key.pem, and with --client client-cert.pem, client-key.pem.
    pub dir: PathBuf,
    /// Names and addresses the server certificate is valid for (repeatable; default
    /// localhost, 127.0.0.1 and ::1).
    #[arg(long = "hostname", value_name = "NAME")]
    pub hostnames: Vec<String>,
    /// Also make a client certificate with this common name (for --tls-verify-peer).
    #[arg(long, value_name = "NAME")]
    pub client: Option<String>,
}

fn write_file(path: &Path, contents: &str, mode: u32) -> Result<()> {
    let mut f = fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .open(path)
        .with_context(|| format!("writing {}", path.display()))?;
    f.write_all(contents.as_bytes())
        .with_context(|| format!("writing {}", path.display()))?;
    // An existing file keeps its mode through open: set it.
    fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(mode))
        .with_context(|| format!("chmod {}", path.display()))?;
    Ok(())
}

fn leaf(cn: &str) -> CertificateParams {
    let mut p = CertificateParams::default();
    p.distinguished_name.push(DnType::CommonName, cn);
    p.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    p
}

/// A DNS name as a certificate may carry: dot-separated labels of letters, digits and
/// hyphens (not at either end), 1 to 63 bytes each; a leading `*.` wildcard label allowed.
fn valid_dns_name(h: &str) -> bool {
    let h = h.strip_prefix("*.").unwrap_or(h);
    !h.is_empty()
        && h.len() <= 253
        && h.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && !l.starts_with('-')
                && !l.ends_with('-')
                && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
        })
}

/// Makes the certificates (see [`CertsArgs`]).
pub fn certs(a: &CertsArgs) -> Result<()> {
    let hostnames = if a.hostnames.is_empty() {
        vec!["localhost".into(), "127.0.0.1".into(), "::1".into()]
    } else {
        a.hostnames.clone()
    };

    let mut ca = CertificateParams::default();
    ca.distinguished_name.push(DnType::CommonName, "blkq CA");
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let ca_key = KeyPair::generate().context("CA key")?;
    let ca_cert = ca.self_signed(&ca_key).context("CA certificate")?;

    let mut server = leaf(&hostnames[0]);
    server.subject_alt_names = hostnames
        .iter()
        .map(|h| match h.parse::<std::net::IpAddr>() {
            Ok(ip) => Ok(SanType::IpAddress(ip)),
            Err(_) if !valid_dns_name(h) => {
                bail!("--hostname {h:?} is neither an IP address nor a DNS name")
            }
            Err(_) => Ok(SanType::DnsName(
                h.clone()
                    .try_into()
                    .with_context(|| format!("--hostname {h:?}"))?,
            )),
        })
        .collect::<Result<_>>()?;
    server.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    let server_key = KeyPair::generate().context("server key")?;
    let server_cert = server
        .signed_by(&server_key, &ca_cert, &ca_key)
        .context("server certificate")?;

    let dir = &a.dir;
    fs::create_dir_all(&a.dir).with_context(|| format!("creating {}", a.dir.display()))?;
    write_file(&dir.join("ca-cert.pem"), &ca_cert.pem(), 0o644)?;
    write_file(&dir.join("ca-key.pem"), &ca_key.serialize_pem(), 0o600)?;
    write_file(&dir.join("server-cert.pem"), &server_cert.pem(), 0o644)?;
    write_file(
        &dir.join("server-key.pem"),
        &server_key.serialize_pem(),
        0o600,
    )?;
    println!(
        "{}: ca-cert.pem, server-cert.pem, server-key.pem (for {})",
        dir.display(),
        hostnames.join(", ")
    );
    if let Some(name) = &a.client {
        let mut client = leaf(name);
        client.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let client_key = KeyPair::generate().context("client key")?;
        let client_cert = client
            .signed_by(&client_key, &ca_cert, &ca_key)
            .context("client certificate")?;
        write_file(&dir.join("client-cert.pem"), &client_cert.pem(), 0o644)?;
        write_file(
            &dir.join("client-key.pem"),
            &client_key.serialize_pem(),
            0o600,
        )?;
        println!(
            "{}: client-cert.pem, client-key.pem (CN={name})",
            dir.display()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn tls_on_without_a_directory_names_the_flag() {
        for tls in [TlsFlag::On, TlsFlag::Require] {
            let a = TlsArgs {
                tls,
                ..TlsArgs::default()
            };
            let e = a.settings().unwrap_err().to_string();
            assert!(e.contains("--tls-certificates"), "{e}");
        }
        assert!(TlsArgs::default().settings().unwrap().is_none());
    }

    #[test]
    fn certs_makes_a_directory_the_server_loads() {
        let dir = tempfile::tempdir().unwrap();
        let pki = dir.path().join("pki");
        certs(&CertsArgs {
            dir: pki.clone(),
            hostnames: vec![],
            client: Some("client1".into()),
        })
        .unwrap();
        for f in ["server-key.pem", "client-key.pem", "ca-key.pem"] {
            let mode = fs::metadata(pki.join(f)).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o600, "{f}");
        }
        for verify_peer in [false, true] {
            let a = TlsArgs {
                tls: TlsFlag::Require,
                tls_certificates: Some(pki.clone()),
                tls_verify_peer: verify_peer,
            };
            let s = a.settings().unwrap().unwrap();
            assert_eq!(s.mode, TlsMode::Require);
        }
        // The client side loads the same directory (with its client certificate).
        nbd::tls::client_config(&pki).unwrap();
        let cert = nbd::tls::load_certs(&pki.join("client-cert.pem")).unwrap();
        assert_eq!(
            nbd::tls::subject_of(cert[0].as_ref()).as_deref(),
            Some("CN=client1")
        );
    }

    #[test]
    fn a_bad_hostname_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let r = certs(&CertsArgs {
            dir: dir.path().join("pki"),
            hostnames: vec!["not a hostname!".into()],
            client: None,
        });
        assert!(r.is_err());
    }
}
