//! `blkq certs`: makes a CA, a server certificate and optionally a client certificate in the
//! layout qemu and nbdkit read (and `blkq serve --tls-certificates` loads), keeping the CA's
//! key in a directory of its own (see `CERTS_HELP`).

use std::fs;
use std::io::{Read, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Args;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose, SanType,
};
use time::{Duration, OffsetDateTime};
use x509_parser::prelude::{FromDer, X509Certificate};

/// What `blkq certs --help` says after the flags: the layout, and when it refuses.
const CERTS_HELP: &str = "\
Layout: DIR gets ca-cert.pem, server-cert.pem and server-key.pem (what `blkq serve \
--tls-certificates DIR` loads), and with --client also client-cert.pem and client-key.pem (what \
qemu and libnbd load from one directory). The CA's private key never goes into DIR: the CA \
(ca-cert.pem, ca-key.pem) lives in --ca-dir, by default DIR-ca beside DIR: keep it where the \
server cannot read it (another machine, or another user's directory).

Running again: a CA already in --ca-dir is reused, never replaced, so `blkq certs DIR2 --ca-dir \
DIR-ca --client NAME` issues more certificates that the same server accepts. Existing files are \
never overwritten without --force, and every file is checked before any is written. Files are \
created new (O_CREAT|O_EXCL|O_NOFOLLOW): nothing is ever written through a link, and with \
--force a link is removed, not followed.

Directories: DIR and --ca-dir must be real directories (not links), owned by the user running \
blkq and not writable by group or others (`chmod go-w DIR`); missing ones are made 0755 (DIR) \
and 0700 (--ca-dir).

Validity: certificates start 5 minutes before they are made (clock skew) and last --days \
(default 365), never past their CA; a new CA lasts --ca-days (default 3650).";

/// `blkq certs`.
#[derive(Args, Debug)]
#[command(after_long_help = CERTS_HELP)]
pub struct CertsArgs {
    /// Directory the server loads (created 0755 if missing): ca-cert.pem, server-cert.pem,
    /// server-key.pem, and with --client client-cert.pem, client-key.pem. Never the CA's key.
    pub dir: PathBuf,
    /// Directory of the CA: ca-cert.pem and ca-key.pem (created 0700 if missing; default
    /// DIR-ca beside DIR). A CA found there is reused, so several directories can hold
    /// certificates of one CA.
    #[arg(long, value_name = "PATH")]
    pub ca_dir: Option<PathBuf>,
    /// Names and addresses the server certificate is valid for (repeatable; default
    /// localhost, 127.0.0.1 and ::1).
    #[arg(long = "hostname", value_name = "NAME")]
    pub hostnames: Vec<String>,
    /// Also make a client certificate with this common name (for --tls-verify-peer).
    #[arg(long, value_name = "NAME")]
    pub client: Option<String>,
    /// Days the server and client certificates are valid (never past their CA's end).
    #[arg(long, value_name = "N", default_value_t = 365,
          value_parser = clap::value_parser!(u32).range(1..=MAX_DAYS))]
    pub days: u32,
    /// Days a new CA is valid (a reused CA keeps its own validity).
    #[arg(long, value_name = "N", default_value_t = 3650,
          value_parser = clap::value_parser!(u32).range(1..=MAX_DAYS))]
    pub ca_days: u32,
    /// Replace existing files in DIR (a link is removed, never followed), and an incomplete
    /// CA in --ca-dir (ca-cert.pem or ca-key.pem missing, or not a plain file). A complete CA
    /// is never replaced: give another --ca-dir for a new one.
    #[arg(long)]
    pub force: bool,
}

/// The longest `--days` and `--ca-days`: a century.
const MAX_DAYS: i64 = 36_500;

/// How long before "now" certificates start: clients whose clocks run a little behind.
const CLOCK_SKEW: Duration = Duration::minutes(5);

fn euid() -> u32 {
    // SAFETY: geteuid(2) cannot fail and has no memory effects.
    unsafe { libc::geteuid() }
}

/// Refuses a directory that is a link, is not a directory, is not owned by the effective
/// user, or is writable by group or others: anyone who can write it can plant a file or a
/// link where a key is about to go, or swap the key afterwards.
fn check_dir(dir: &Path, what: &str) -> Result<()> {
    let d = dir.display();
    let m = fs::symlink_metadata(dir).with_context(|| format!("{what} {d}"))?;
    if m.file_type().is_symlink() {
        bail!(
            "{what} {d} is a link: name the directory itself (blkq certs never writes through \
             a link)"
        );
    }
    if !m.is_dir() {
        bail!("{what} {d} is not a directory");
    }
    if m.uid() != euid() {
        bail!(
            "{what} {d} is owned by uid {}, not by this user (uid {}): another user could \
             replace the keys; use a directory of your own",
            m.uid(),
            euid()
        );
    }
    if m.mode() & 0o022 != 0 {
        bail!(
            "{what} {d} is writable by group or others (mode {:o}): they could plant a file or \
             a link where a key goes; `chmod go-w {d}`, or use another directory",
            m.mode() & 0o7777
        );
    }
    Ok(())
}

/// Makes `dir` with `mode` if it is missing; then [`check_dir`].
fn make_dir(dir: &Path, mode: u32, what: &str) -> Result<()> {
    if fs::symlink_metadata(dir).is_err() {
        fs::DirBuilder::new()
            .recursive(true)
            .mode(mode)
            .create(dir)
            .with_context(|| format!("creating {what} {}", dir.display()))?;
    }
    check_dir(dir, what)
}

/// Whether anything (a file, a link, dangling or not, a directory) is at `path`.
fn occupied(path: &Path) -> bool {
    fs::symlink_metadata(path).is_ok()
}

/// Reads a plain file, never through a link.
fn read_nofollow(path: &Path) -> Result<String> {
    let mut f = fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
        .with_context(|| format!("reading {}", path.display()))?;
    let mut s = String::new();
    f.read_to_string(&mut s)
        .with_context(|| format!("reading {}", path.display()))?;
    Ok(s)
}

/// Creates `path` new (`O_CREAT|O_EXCL|O_NOFOLLOW`, `mode`) and writes `contents`; with
/// `replace`, whatever is at `path` is removed first (a link itself, never its target).
fn write_new(path: &Path, contents: &str, mode: u32, replace: bool) -> Result<()> {
    if replace {
        match fs::remove_file(path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(e).with_context(|| format!("removing {}", path.display()));
            }
            _ => {}
        }
    }
    let mut f = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .custom_flags(libc::O_NOFOLLOW)
        .mode(mode)
        .open(path)
        .with_context(|| format!("creating {}", path.display()))?;
    // The umask may have narrowed the mode: set it exactly, on the file we opened.
    f.set_permissions(fs::Permissions::from_mode(mode))
        .with_context(|| format!("chmod {}", path.display()))?;
    f.write_all(contents.as_bytes())
        .and_then(|()| f.sync_all())
        .with_context(|| format!("writing {}", path.display()))
}

/// The CA's parameters (the same every time: a reused CA's subject must match them).
fn ca_params(not_before: OffsetDateTime, not_after: OffsetDateTime) -> CertificateParams {
    let mut ca = CertificateParams::default();
    ca.distinguished_name.push(DnType::CommonName, "blkq CA");
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    ca.not_before = not_before;
    ca.not_after = not_after;
    ca
}

/// The CA that signs: its key, its certificate as written (PEM), an rcgen certificate to
/// sign with, and its end of validity.
struct Ca {
    key: KeyPair,
    pem: String,
    issuer: rcgen::Certificate,
    not_after: OffsetDateTime,
}

/// What `--ca-dir` holds.
enum CaFound {
    /// ca-cert.pem and ca-key.pem, plain files: reuse them.
    Complete,
    /// Neither: make a new CA.
    Empty,
    /// Something else (the reason): a new CA only with --force.
    Incomplete(String),
}

fn ca_found(ca_dir: &Path) -> CaFound {
    let mut why = Vec::new();
    let mut present = 0;
    for name in ["ca-cert.pem", "ca-key.pem"] {
        match fs::symlink_metadata(ca_dir.join(name)) {
            Err(_) => why.push(format!("no {name}")),
            Ok(m) if m.file_type().is_symlink() => {
                present += 1;
                why.push(format!("{name} is a link"));
            }
            Ok(m) if !m.is_file() => {
                present += 1;
                why.push(format!("{name} is not a plain file"));
            }
            Ok(_) => present += 1,
        }
    }
    match (present, why.is_empty()) {
        (_, true) => CaFound::Complete,
        (0, _) => CaFound::Empty,
        _ => CaFound::Incomplete(why.join(", ")),
    }
}

/// Reads back the CA in `ca_dir` and checks it is one `blkq certs` made (same subject), that
/// its key is the certificate's, and that it has not expired.
fn load_ca(ca_dir: &Path, now: OffsetDateTime) -> Result<Ca> {
    let (cert_path, key_path) = (ca_dir.join("ca-cert.pem"), ca_dir.join("ca-key.pem"));
    let pem = read_nofollow(&cert_path)?;
    let key = KeyPair::from_pem(&read_nofollow(&key_path)?)
        .with_context(|| format!("{}: not a private key", key_path.display()))?;
    let not_a_cert = || format!("{}: not a certificate", cert_path.display());
    let (_, found) = x509_parser::pem::parse_x509_pem(pem.as_bytes()).with_context(not_a_cert)?;
    let found = found.parse_x509().with_context(not_a_cert)?;
    let issuer = ca_params(now, now)
        .self_signed(&key)
        .context("CA certificate")?;
    let (_, ours) = X509Certificate::from_der(issuer.der()).context("CA certificate")?;
    let fresh = || {
        format!(
            "remove {d}, or give another --ca-dir for a new CA",
            d = ca_dir.display()
        )
    };
    if found.subject().as_raw() != ours.subject().as_raw() {
        bail!(
            "{} was not made by blkq certs (subject {}): {}",
            cert_path.display(),
            found.subject(),
            fresh()
        );
    }
    if found.public_key().raw != key.public_key_der().as_slice() {
        bail!(
            "{} is not the key of {}: {}",
            key_path.display(),
            cert_path.display(),
            fresh()
        );
    }
    let not_after = found.validity().not_after.to_datetime();
    if not_after <= now {
        bail!(
            "the CA in {} expired on {}: {}",
            ca_dir.display(),
            not_after.date(),
            fresh()
        );
    }
    Ok(Ca {
        key,
        pem,
        issuer,
        not_after,
    })
}

/// Where `path` is or would be once made: its nearest existing ancestor resolved (links
/// followed), then the components still missing.
fn resolved(path: &Path) -> Result<PathBuf> {
    let abs = std::path::absolute(path).with_context(|| path.display().to_string())?;
    let mut base = abs.as_path();
    let mut missing = Vec::new();
    while !occupied(base) {
        match (base.parent(), base.file_name()) {
            (Some(parent), Some(name)) => {
                missing.push(name);
                base = parent;
            }
            _ => break,
        }
    }
    let mut p = fs::canonicalize(base).with_context(|| base.display().to_string())?;
    p.extend(missing.iter().rev());
    Ok(p)
}

/// The default `--ca-dir`: `DIR-ca` beside DIR.
fn default_ca_dir(dir: &Path) -> Result<PathBuf> {
    let Some(name) = dir.file_name() else {
        bail!(
            "{} has no name to put a CA directory beside (DIR-ca): give --ca-dir",
            dir.display()
        );
    };
    let mut name = name.to_os_string();
    name.push("-ca");
    Ok(dir.with_file_name(name))
}

fn leaf(cn: &str, not_before: OffsetDateTime, not_after: OffsetDateTime) -> CertificateParams {
    let mut p = CertificateParams::default();
    p.not_before = not_before;
    p.not_after = not_after;
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
    let sans = subject_alt_names(&hostnames)?;
    let dir = &a.dir;
    let ca_dir = prepare_dirs(dir, a.ca_dir.as_deref())?;

    let now = OffsetDateTime::now_utc().replace_nanosecond(0)?;
    let not_before = now - CLOCK_SKEW;
    let new_ca = needs_new_ca(&ca_dir, a.force)?;
    let targets = targets(dir, &ca_dir, new_ca, a.client.is_some());
    check_targets(dir, &ca_dir, new_ca, &targets, a.force)?;

    // The certificates, in memory.
    let ca = if new_ca {
        new_ca_cert(not_before, now + Duration::days(a.ca_days.into()))?
    } else {
        load_ca(&ca_dir, now)?
    };
    let mut not_after = now + Duration::days(a.days.into());
    if not_after > ca.not_after {
        eprintln!(
            "warning: the CA in {} ends on {}: the certificates end with it instead of \
             lasting --days {}",
            ca_dir.display(),
            ca.not_after.date(),
            a.days
        );
        not_after = ca.not_after;
    }
    let mut server = leaf(&hostnames[0], not_before, not_after);
    server.subject_alt_names = sans;
    server.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    let (server_cert, server_key) = sign(server, &ca, "server")?;
    let client = match &a.client {
        Some(name) => {
            let mut client = leaf(name, not_before, not_after);
            client.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
            Some(sign(client, &ca, "client")?)
        }
        None => None,
    };

    // The files, in the order of `targets`.
    let mut contents = Vec::new();
    if new_ca {
        contents.extend([ca.key.serialize_pem(), ca.pem.clone()]);
    }
    contents.extend([ca.pem.clone(), server_cert, server_key]);
    if let Some((cert, key)) = client {
        contents.extend([cert, key]);
    }
    for ((path, mode), text) in targets.iter().zip(&contents) {
        write_new(path, text, *mode, a.force)?;
    }
    report(a, &ca_dir, new_ca, ca.not_after, &hostnames, not_after);
    Ok(())
}

/// The server certificate's subject alternative names: each hostname as an IP address or a
/// DNS name; anything else is refused by name.
fn subject_alt_names(hostnames: &[String]) -> Result<Vec<SanType>> {
    hostnames
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
        .collect()
}

/// Checks DIR and the CA directory (`ca_dir`, or its default beside DIR) before anything is
/// made or written, refuses a CA directory inside DIR, and makes both. Returns the CA
/// directory.
fn prepare_dirs(dir: &Path, ca_dir: Option<&Path>) -> Result<PathBuf> {
    let ca_dir = match ca_dir {
        Some(d) => d.to_path_buf(),
        None => default_ca_dir(dir)?,
    };
    for (d, what) in [(dir, "DIR"), (&ca_dir, "--ca-dir")] {
        if occupied(d) {
            check_dir(d, what)?;
        }
    }
    make_dir(dir, 0o755, "DIR")?;
    let real_dir = fs::canonicalize(dir).with_context(|| format!("DIR {}", dir.display()))?;
    if resolved(&ca_dir)?.starts_with(&real_dir) {
        bail!(
            "--ca-dir {} is inside DIR {}: the server's directory must not hold the CA's key; \
             give --ca-dir a directory outside it",
            ca_dir.display(),
            dir.display()
        );
    }
    make_dir(&ca_dir, 0o700, "--ca-dir")?;
    Ok(ca_dir)
}

/// Whether a new CA is made in `ca_dir`: yes when it holds none; no when it holds a complete
/// one (reused); an incomplete one is replaced only with `--force`, else refused.
fn needs_new_ca(ca_dir: &Path, force: bool) -> Result<bool> {
    match ca_found(ca_dir) {
        CaFound::Complete => Ok(false),
        CaFound::Empty => Ok(true),
        CaFound::Incomplete(why) if force => {
            eprintln!("{}: {why}: --force: making a new CA", ca_dir.display());
            Ok(true)
        }
        CaFound::Incomplete(why) => bail!(
            "{} holds no usable CA ({why}): remove those files, give another --ca-dir, or run \
             again with --force to make a new CA there",
            ca_dir.display()
        ),
    }
}

/// The files to write, with their modes, in the order [`certs`] writes them.
fn targets(dir: &Path, ca_dir: &Path, new_ca: bool, client: bool) -> Vec<(PathBuf, u32)> {
    let mut targets = Vec::new();
    if new_ca {
        targets.extend([
            (ca_dir.join("ca-key.pem"), 0o600),
            (ca_dir.join("ca-cert.pem"), 0o644),
        ]);
    }
    targets.extend([
        (dir.join("ca-cert.pem"), 0o644),
        (dir.join("server-cert.pem"), 0o644),
        (dir.join("server-key.pem"), 0o600),
    ]);
    if client {
        targets.extend([
            (dir.join("client-cert.pem"), 0o644),
            (dir.join("client-key.pem"), 0o600),
        ]);
    }
    targets
}

/// Refuses to overwrite any of `targets` without `--force`, and warns of a CA key left in
/// the server's directory when a new CA is made elsewhere.
fn check_targets(
    dir: &Path,
    ca_dir: &Path,
    new_ca: bool,
    targets: &[(PathBuf, u32)],
    force: bool,
) -> Result<()> {
    let legacy = dir.join("ca-key.pem");
    if new_ca && occupied(&legacy) {
        eprintln!(
            "warning: {} is a CA key in the server's directory (where older versions of blkq \
             certs put it); it is neither used nor removed. To keep issuing under that CA, move \
             it and ca-cert.pem to {} and run again",
            legacy.display(),
            ca_dir.display()
        );
    }
    let taken: Vec<String> = targets
        .iter()
        .filter(|(p, _)| occupied(p))
        .map(|(p, _)| p.display().to_string())
        .collect();
    if !taken.is_empty() && !force {
        bail!(
            "refusing to overwrite {}: run again with --force to replace {}{}",
            taken.join(", "),
            if taken.len() == 1 { "it" } else { "them" },
            if new_ca {
                String::new()
            } else {
                format!(" (the CA in {} is kept either way)", ca_dir.display())
            }
        );
    }
    Ok(())
}

/// A new self-signed CA with a new key, valid from `not_before` to `not_after`.
fn new_ca_cert(not_before: OffsetDateTime, not_after: OffsetDateTime) -> Result<Ca> {
    let key = KeyPair::generate().context("CA key")?;
    let issuer = ca_params(not_before, not_after)
        .self_signed(&key)
        .context("CA certificate")?;
    Ok(Ca {
        pem: issuer.pem(),
        key,
        issuer,
        not_after,
    })
}

/// Signs `params` under the CA with a new key (`what` names it in errors). Returns the
/// certificate's and the key's PEM.
fn sign(params: CertificateParams, ca: &Ca, what: &str) -> Result<(String, String)> {
    let key = KeyPair::generate().with_context(|| format!("{what} key"))?;
    let cert = params
        .signed_by(&key, &ca.issuer, &ca.key)
        .with_context(|| format!("{what} certificate"))?;
    Ok((cert.pem(), key.serialize_pem()))
}

/// Says what was written where, and until when it is valid.
fn report(
    a: &CertsArgs,
    ca_dir: &Path,
    new_ca: bool,
    ca_not_after: OffsetDateTime,
    hostnames: &[String],
    not_after: OffsetDateTime,
) {
    let until = |t: OffsetDateTime| t.date();
    if new_ca {
        println!(
            "{}: ca-cert.pem, ca-key.pem (a new CA, until {}; keep ca-key.pem off the server)",
            ca_dir.display(),
            until(ca_not_after)
        );
    } else {
        println!(
            "{}: the CA there is reused (until {})",
            ca_dir.display(),
            until(ca_not_after)
        );
    }
    println!(
        "{}: ca-cert.pem, server-cert.pem, server-key.pem (for {}, until {})",
        a.dir.display(),
        hostnames.join(", "),
        until(not_after)
    );
    if let Some(name) = &a.client {
        println!(
            "{}: client-cert.pem, client-key.pem (CN={name})",
            a.dir.display()
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::serve::args::TlsArgs;
    use crate::serve::config::Source;
    use nbd::tls::TlsMode;

    /// `blkq certs DIR` with the defaults.
    fn args(dir: &Path) -> CertsArgs {
        CertsArgs {
            dir: dir.to_path_buf(),
            ca_dir: None,
            hostnames: vec![],
            client: None,
            days: 365,
            ca_days: 3650,
            force: false,
        }
    }

    #[test]
    fn the_default_ca_dir_is_beside_dir() {
        let d = |p: &str| default_ca_dir(Path::new(p)).unwrap();
        assert_eq!(d("pki"), Path::new("pki-ca"));
        assert_eq!(d("/etc/blkq/pki/"), Path::new("/etc/blkq/pki-ca"));
        assert!(default_ca_dir(Path::new("..")).is_err());
    }

    #[test]
    fn certs_makes_a_directory_the_server_loads() {
        let dir = tempfile::tempdir().unwrap();
        let pki = dir.path().join("pki");
        certs(&CertsArgs {
            client: Some("client1".into()),
            ..args(&pki)
        })
        .unwrap();
        let ca_key = dir.path().join("pki-ca/ca-key.pem");
        for f in [
            pki.join("server-key.pem"),
            pki.join("client-key.pem"),
            ca_key,
        ] {
            let mode = fs::metadata(&f).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o600, "{}", f.display());
        }
        assert!(!pki.join("ca-key.pem").exists());
        for verify_peer in [false, true] {
            let a = TlsArgs {
                tls: TlsMode::Require,
                tls_certificates: Some(pki.clone()),
                tls_verify_peer: verify_peer,
            };
            let s = crate::serve::tls::load(&a, &Source::CommandLine)
                .unwrap()
                .unwrap();
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
        let pki = dir.path().join("pki");
        let r = certs(&CertsArgs {
            hostnames: vec!["not a hostname!".into()],
            ..args(&pki)
        });
        assert!(r.is_err());
        // Refused before anything is made.
        assert!(!pki.exists());
    }
}
