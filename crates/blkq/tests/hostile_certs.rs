//! `blkq certs` against a hostile or careless filesystem: the built
//! binary, run twice, with links planted at its file names, in directories others can write, and
//! the validity of what it writes. Certificates are made by the test (never committed).

mod common;

use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use common::Serving;
use nbd::client::{Endpoint, Handshake};
use x509_parser::prelude::{FromDer, X509Certificate};

const DAY: i64 = 86_400;

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// A new directory `parent/name` with mode `mode` (set after mkdir: no umask).
fn dir_with_mode(parent: &Path, name: &str, mode: u32) -> PathBuf {
    let d = parent.join(name);
    fs::create_dir(&d).unwrap();
    fs::set_permissions(&d, fs::Permissions::from_mode(mode)).unwrap();
    d
}

/// A file another user may care about, the target of the links the tests plant.
fn victim(parent: &Path) -> PathBuf {
    let v = parent.join("victim");
    fs::write(&v, "victim\n").unwrap();
    v
}

fn mode_of(p: &Path) -> u32 {
    fs::symlink_metadata(p).unwrap().permissions().mode() & 0o7777
}

fn is_root() -> bool {
    // SAFETY: geteuid(2) cannot fail and has no memory effects.
    unsafe { libc::geteuid() == 0 }
}

/// (not before, not after) of the first certificate of a PEM file, in Unix seconds.
fn validity(path: &Path) -> (i64, i64) {
    let der = nbd::tls::load_certs(path).unwrap().remove(0);
    let (_, c) = X509Certificate::from_der(der.as_ref()).unwrap();
    (
        c.validity().not_before.timestamp(),
        c.validity().not_after.timestamp(),
    )
}

fn now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

/// Checks that `path`'s certificate starts a little before `t0` (clock skew, not 1975) and
/// lasts `days` days (give or take the skew allowance).
fn assert_valid_for(path: &Path, t0: i64, days: i64) {
    let (nb, na) = validity(path);
    assert!(
        nb <= t0 && nb >= t0 - 3600,
        "{}: not before {nb}, made at {t0}",
        path.display()
    );
    assert!(
        (na - nb - days * DAY).abs() <= 3600,
        "{}: valid {} s, not {days} days",
        path.display(),
        na - nb
    );
}

/// Run twice on the same directory, `blkq certs` refuses (naming the files and `--force`)
/// and the CA certificate is byte-identical afterwards; with `--force` it makes new server and
/// client certificates, under the same CA (the CA is reused, never replaced).
#[test]
fn running_twice_refuses_and_keeps_the_ca() {
    let t = tempfile::tempdir().unwrap();
    let pki = t.path().join("pki");
    common::ok(&["certs", s(&pki), "--client", "client1"]);
    let ca = fs::read(pki.join("ca-cert.pem")).unwrap();
    let key = fs::read(pki.join("server-key.pem")).unwrap();

    let e = common::fails(&["certs", s(&pki), "--client", "client1"]);
    assert!(
        e.contains("--force") && e.contains("server-key.pem") && e.contains("client-key.pem"),
        "{e}"
    );
    assert_eq!(fs::read(pki.join("ca-cert.pem")).unwrap(), ca);
    assert_eq!(fs::read(pki.join("server-key.pem")).unwrap(), key);

    common::ok(&["certs", s(&pki), "--client", "client1", "--force"]);
    assert_eq!(fs::read(pki.join("ca-cert.pem")).unwrap(), ca);
    assert_ne!(fs::read(pki.join("server-key.pem")).unwrap(), key);
}

/// A link at DIR/server-key.pem (to an existing file, and a dangling one) is refused and not
/// followed: the victim is unchanged and the dangling target is not created. With `--force`
/// the link itself is replaced by a new 0600 file; the victim is still unchanged.
#[test]
fn a_link_at_the_server_key_is_never_followed() {
    let t = tempfile::tempdir().unwrap();
    let v = victim(t.path());
    let dangling = t.path().join("made-through-a-link");
    for (i, target) in [&v, &dangling].into_iter().enumerate() {
        let pki = dir_with_mode(t.path(), &format!("pki{i}"), 0o755);
        let link = pki.join("server-key.pem");
        std::os::unix::fs::symlink(target, &link).unwrap();
        let e = common::fails(&["certs", s(&pki)]);
        assert!(e.contains("server-key.pem") && e.contains("--force"), "{e}");
        assert_eq!(fs::read_to_string(&v).unwrap(), "victim\n");
        assert!(!dangling.exists());
        assert!(fs::symlink_metadata(&link)
            .unwrap()
            .file_type()
            .is_symlink());

        common::ok(&["certs", s(&pki), "--force"]);
        assert_eq!(fs::read_to_string(&v).unwrap(), "victim\n");
        assert!(!dangling.exists());
        let m = fs::symlink_metadata(&link).unwrap();
        assert!(m.file_type().is_file(), "server-key.pem is still a link");
        assert_eq!(mode_of(&link), 0o600);
    }
}

/// A link at the CA key's path (DIR-ca/ca-key.pem, and one at DIR/ca-key.pem where older
/// versions put the key) is refused and not followed, with or without `--force`: the victim is
/// unchanged; with `--force` a new CA replaces the link in DIR-ca with a 0600 file.
#[test]
fn a_link_at_the_ca_key_is_never_followed() {
    let t = tempfile::tempdir().unwrap();
    let v = victim(t.path());
    let pki = dir_with_mode(t.path(), "pki", 0o755);
    let ca = dir_with_mode(t.path(), "pki-ca", 0o700);
    let link = ca.join("ca-key.pem");
    std::os::unix::fs::symlink(&v, &link).unwrap();
    std::os::unix::fs::symlink(&v, pki.join("ca-key.pem")).unwrap();

    let e = common::fails(&["certs", s(&pki)]);
    assert!(e.contains("ca-key.pem") && e.contains("--force"), "{e}");
    assert_eq!(fs::read_to_string(&v).unwrap(), "victim\n");

    common::ok(&["certs", s(&pki), "--force"]);
    assert_eq!(fs::read_to_string(&v).unwrap(), "victim\n");
    assert!(fs::symlink_metadata(&link).unwrap().file_type().is_file());
    assert_eq!(mode_of(&link), 0o600);
    assert!(fs::symlink_metadata(pki.join("ca-key.pem"))
        .unwrap()
        .file_type()
        .is_symlink());
}

/// A directory others can write (0777, and sticky 1777) is refused, for the certificates and
/// for the CA, with a message that says so and how to fix it (`chmod go-w`); a key file planted
/// there by another user (uid 65534, when the test runs as root) is not written to.
#[test]
fn a_directory_writable_by_others_is_refused() {
    let t = tempfile::tempdir().unwrap();
    for mode in [0o777, 0o1777, 0o775] {
        let shared = dir_with_mode(t.path(), &format!("shared-{mode:o}"), mode);
        let planted = shared.join("server-key.pem");
        if is_root() {
            fs::write(&planted, "planted\n").unwrap();
            fs::set_permissions(&planted, fs::Permissions::from_mode(0o666)).unwrap();
            std::os::unix::fs::chown(&planted, Some(65534), Some(65534)).unwrap();
        }
        let ca = t.path().join(format!("shared-{mode:o}-ca"));
        let e = common::fails(&["certs", s(&shared)]);
        assert!(e.contains("writable") && e.contains("chmod go-w"), "{e}");
        if is_root() {
            assert_eq!(fs::read_to_string(&planted).unwrap(), "planted\n");
            assert_eq!(fs::metadata(&planted).unwrap().uid(), 65534);
        }
        assert!(!shared.join("ca-cert.pem").exists());
        assert!(!ca.join("ca-key.pem").exists());
        assert!(!shared.join("ca-key.pem").exists());
    }

    // The CA directory too.
    let pki = t.path().join("pki");
    let open_ca = dir_with_mode(t.path(), "open-ca", 0o777);
    let e = common::fails(&["certs", s(&pki), "--ca-dir", s(&open_ca)]);
    assert!(e.contains("writable") && e.contains("chmod go-w"), "{e}");
    assert!(!open_ca.join("ca-key.pem").exists());
    assert!(!pki.join("server-key.pem").exists());
}

/// A directory that is a link, or (as root) one owned by another user, is refused and left
/// empty.
#[test]
fn a_linked_or_foreign_directory_is_refused() {
    let t = tempfile::tempdir().unwrap();
    let real = dir_with_mode(t.path(), "real", 0o755);
    let link = t.path().join("link");
    std::os::unix::fs::symlink(&real, &link).unwrap();
    let e = common::fails(&["certs", s(&link)]);
    assert!(e.contains("link"), "{e}");
    assert_eq!(fs::read_dir(&real).unwrap().count(), 0);

    if is_root() {
        let foreign = dir_with_mode(t.path(), "foreign", 0o755);
        std::os::unix::fs::chown(&foreign, Some(65534), Some(65534)).unwrap();
        let e = common::fails(&["certs", s(&foreign)]);
        assert!(e.contains("owned"), "{e}");
        assert_eq!(fs::read_dir(&foreign).unwrap().count(), 0);
    }
}

/// The CA key is written to the CA directory (default: DIR-ca, 0700), never to DIR (0755),
/// which holds exactly what the server and clients load; the server loads DIR and a client
/// certificate made later in another directory under the same `--ca-dir` gets in with
/// `--tls-verify-peer`. `--ca-dir DIR` itself is refused.
#[test]
fn the_ca_key_stays_out_of_the_server_directory() {
    let t = tempfile::tempdir().unwrap();
    let pki = t.path().join("pki");
    let ca = t.path().join("pki-ca");
    common::ok(&["certs", s(&pki), "--client", "client1"]);
    assert!(!pki.join("ca-key.pem").exists());
    assert_eq!(mode_of(&ca.join("ca-key.pem")), 0o600);
    assert_eq!(mode_of(&ca), 0o700);
    assert_eq!(mode_of(&pki), 0o755);
    assert_eq!(
        common::names_in(&pki),
        [
            "ca-cert.pem",
            "client-cert.pem",
            "client-key.pem",
            "server-cert.pem",
            "server-key.pem"
        ]
    );
    assert_eq!(
        fs::read(ca.join("ca-cert.pem")).unwrap(),
        fs::read(pki.join("ca-cert.pem")).unwrap()
    );

    // More certificates under the same CA, in another directory.
    let pki2 = t.path().join("pki2");
    common::ok(&["certs", s(&pki2), "--ca-dir", s(&ca), "--client", "client2"]);
    assert_eq!(
        fs::read(pki2.join("ca-cert.pem")).unwrap(),
        fs::read(pki.join("ca-cert.pem")).unwrap()
    );
    assert!(!pki2.join("ca-key.pem").exists());

    let mut srv = Serving::start(
        t.path(),
        "tls",
        &[
            "--device",
            "mem:1M",
            "--tls",
            "require",
            "--tls-certificates",
            s(&pki),
            "--tls-verify-peer",
        ],
    );
    let ep = Endpoint::Unix(srv.sock.clone());
    for dir in [&pki, &pki2] {
        let cfg = nbd::tls::client_config(dir).unwrap();
        let mut h = Handshake::start(ep.connect().unwrap()).unwrap();
        h.start_tls(&cfg, "localhost").unwrap();
        let d = h.go("").unwrap();
        assert_eq!(d.size, 1 << 20);
        h.into_client(d).unwrap().disconnect().unwrap();
    }
    srv.signal(libc::SIGINT);
    assert!(srv.wait_exit(Duration::from_secs(30)).success());

    let pki3 = t.path().join("pki3");
    let e = common::fails(&["certs", s(&pki3), "--ca-dir", s(&pki3)]);
    assert!(e.contains("--ca-dir"), "{e}");
}

/// Validity: server and client certificates last `--days` (default 365), the CA `--ca-days`
/// (default 3650), all from a few minutes before they were made (not 1975 to 4096); a
/// certificate issued under a reused CA never outlives it; `--days 0` is refused.
#[test]
fn validity_follows_days_and_ca_days() {
    let t = tempfile::tempdir().unwrap();
    let t0 = now();
    let pki = t.path().join("pki");
    common::ok(&["certs", s(&pki), "--client", "client1"]);
    assert_valid_for(&pki.join("server-cert.pem"), t0, 365);
    assert_valid_for(&pki.join("client-cert.pem"), t0, 365);
    assert_valid_for(&pki.join("ca-cert.pem"), t0, 3650);

    let short = t.path().join("short");
    common::ok(&[
        "certs",
        s(&short),
        "--client",
        "c",
        "--days",
        "30",
        "--ca-days",
        "100",
    ]);
    assert_valid_for(&short.join("server-cert.pem"), t0, 30);
    assert_valid_for(&short.join("client-cert.pem"), t0, 30);
    assert_valid_for(&short.join("ca-cert.pem"), t0, 100);

    // Under the 100-day CA, a 365-day certificate ends with the CA.
    let long = t.path().join("long");
    let o = common::blkq(&[
        "certs",
        s(&long),
        "--ca-dir",
        s(&t.path().join("short-ca")),
        "--days",
        "365",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let (_, ca_end) = validity(&short.join("ca-cert.pem"));
    assert_eq!(validity(&long.join("server-cert.pem")).1, ca_end);

    let e = common::fails(&["certs", s(&t.path().join("zero")), "--days", "0"]);
    assert!(e.contains("--days"), "{e}");
}
