//! `blkq serve`'s TLS: loads the certificates the checked `[tls]` settings (or `--tls*` flags)
//! name into the server's TLS configuration.

use anyhow::{bail, Context, Result};
use nbd::tls::{TlsMode, TlsSettings};

use super::args::TlsArgs;
use super::config::Source;

/// Loads the certificates that validated TLS settings name: the server's TLS configuration
/// (`None`: off). Errors name the flag (`--tls-certificates`) or the file's `[tls]` key.
pub fn load(s: &TlsArgs, src: &Source) -> Result<Option<TlsSettings>> {
    let (certs_name, mode_name) = if src.is_file() {
        ("[tls] certificates", "[tls] mode")
    } else {
        ("--tls-certificates", "--tls")
    };
    if s.tls == TlsMode::Off {
        if s.tls_certificates.is_some() {
            tracing::warn!("{certs_name} is ignored: TLS is off ({mode_name} on|require)");
        }
        return Ok(None);
    }
    let Some(dir) = &s.tls_certificates else {
        bail!(
            "{mode_name} on|require needs {certs_name} DIR (ca-cert.pem, server-cert.pem, \
             server-key.pem; `blkq certs DIR` makes them)"
        );
    };
    if s.tls == TlsMode::On && s.tls_verify_peer {
        tracing::warn!(
            "TLS on with verify-peer: clients that do not start TLS are still served, without a \
             certificate (TLS require closes that door)"
        );
    }
    let settings = TlsSettings::load(s.tls, dir, s.tls_verify_peer)
        .with_context(|| format!("{certs_name} {}", dir.display()))?;
    Ok(Some(settings))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tls_on_without_a_directory_names_the_flag() {
        for tls in [TlsMode::On, TlsMode::Require] {
            let a = TlsArgs {
                tls,
                ..TlsArgs::default()
            };
            let e = load(&a, &Source::CommandLine).unwrap_err().to_string();
            assert!(e.contains("--tls-certificates"), "{e}");
        }
        assert!(load(&TlsArgs::default(), &Source::CommandLine)
            .unwrap()
            .is_none());
    }
}
