//! `blkq certs` then `blkq serve --tls require`: the built binary, `nbd::client` over TLS.
//! Certificates are made by the test (never committed).

mod common;

use std::time::Duration;

use common::Serving;
use nbd::client::{ClientError, Endpoint, Handshake};
use nbd::codec::proto::NBD_REP_ERR_TLS_REQD;
use nbd::codec::CmdFlags;

#[test]
fn certs_then_serve_tls_require() {
    let dir = tempfile::tempdir().unwrap();
    let (mut s, pki) = Serving::start_tls(dir.path(), "tls", &["--tls-verify-peer"]);
    let ep = Endpoint::Unix(s.sock.clone());

    // Plaintext: refused before any export is named.
    let mut h = Handshake::start(ep.connect().unwrap()).unwrap();
    match h.go("") {
        Err(ClientError::OptionRefused { reply_type, .. }) => {
            assert_eq!(reply_type, NBD_REP_ERR_TLS_REQD)
        }
        other => panic!("plaintext GO under --tls=require: {other:?}"),
    }
    h.abort().unwrap();

    // TLS with the client certificate: data round trip.
    let cfg = nbd::tls::client_config(&pki).unwrap();
    let mut h = Handshake::start(ep.connect().unwrap()).unwrap();
    h.start_tls(&cfg, "localhost").unwrap();
    let d = h.go("").unwrap();
    assert_eq!(d.size, 16 << 20);
    let mut c = h.into_client(d).unwrap();
    let data: Vec<u8> = (0..(1 << 20)).map(|i| (i * 7) as u8).collect();
    c.write(4096, &data, CmdFlags::FUA).unwrap();
    assert_eq!(c.read(4096, data.len() as u64).unwrap(), data);
    c.disconnect().unwrap();

    s.signal(libc::SIGINT);
    let st = s.wait_exit(Duration::from_secs(30));
    assert!(st.success(), "{}", s.stderr_text());
}

#[test]
fn tls_without_certificates_names_the_flag() {
    let e = common::fails(&["serve", "--device", "mem:1M", "--tls", "on"]);
    assert!(e.contains("--tls-certificates"), "{e}");
}

/// The banner's `nbds://` URI names a host the server's certificate is for: a certificate made
/// for `myhost` fails verification when reached as `127.0.0.1`, so the banner says `myhost`;
/// one made for the default names (localhost, 127.0.0.1, ::1) keeps the address.
#[test]
fn the_banner_names_the_host_the_certificate_is_for() {
    let dir = tempfile::tempdir().unwrap();
    for (name, hostname, want) in [
        ("named", Some("myhost"), "nbds://myhost:"),
        ("default", None, "nbds://127.0.0.1:"),
    ] {
        let pki = dir.path().join(name);
        let pki_s = pki.to_str().unwrap();
        let mut certs = vec!["certs", pki_s];
        if let Some(h) = hostname {
            certs.extend(["--hostname", h]);
        }
        common::ok(&certs);
        let sock = dir.path().join(format!("{name}.sock"));
        let s = common::Launch::serve(["--device", "mem:1M", "--listen", "127.0.0.1:0"])
            .args(["--tls", "require", "--tls-certificates", pki_s, "--socket"])
            .arg(&sock)
            .ready_after_line("Ctrl-C")
            .start();
        let banner = s.stdout_lines().join("\n");
        assert!(
            banner.contains(want),
            "{name}: the banner does not say {want}:\n{banner}"
        );
        if hostname.is_some() {
            assert!(
                !banner.contains("nbds://127.0.0.1"),
                "{name}: the banner offers an address the certificate is not for:\n{banner}"
            );
        }
    }
}
