//! `nbd::remote::RemoteDevice` over TLS (`nbds://`, `nbds+unix://`) to the in-process blkq
//! server requiring TLS: I/O, a client certificate the server checks, a wrong CA refused, a
//! plaintext URI refused, and a reconnection that negotiates TLS again.
// A plain threaded test, never a loom model: its own harness (std locks and atomics) is not
// what a model must explore, so it may use std::sync.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]
#![cfg(not(blkq_loom))]

mod common;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use blk::Device;
use common::pki::{ca, pki};
use common::served::device;
use nbd::remote::{RemoteDevice, RemoteError};
use nbd::server::{Export, Server, ServerConfig};
use nbd::tls::{TlsMode, TlsSettings};
use testkit::io::{read_at, write_at};
use testkit::{pattern, wait_until_within};

/// A server requiring TLS (and, with `verify_peer`, a client certificate) on `sock` and a
/// TCP port.
fn serve(pki_dir: &Path, sock: &Path, disk: &Arc<dyn Device>, verify_peer: bool) -> Server {
    let mut cfg = ServerConfig::new(vec![Export::new("", disk.clone())]);
    cfg.unix = Some(sock.to_path_buf());
    cfg.tcp = Some("127.0.0.1:0".parse::<SocketAddr>().unwrap());
    cfg.tuning.drain_timeout = Duration::from_millis(200);
    cfg.tls = Some(TlsSettings::load(TlsMode::Require, pki_dir, verify_peer).unwrap());
    Server::start(cfg).unwrap()
}

#[test]
fn tls_over_unix_and_tcp_with_a_client_certificate() {
    let dir = tempfile::tempdir().unwrap();
    pki(dir.path());
    let sock = dir.path().join("nbd.sock");
    let disk = device("mem:16M");
    let server = serve(dir.path(), &sock, &disk, true);
    let certs = dir.path().display().to_string();

    let unix = format!(
        "nbds+unix:///?socket={}&tls-certificates={certs}",
        sock.display()
    );
    let dev = RemoteDevice::open(&format!("{unix},timeout=5")).unwrap();
    let a = pattern(1, 256 << 10);
    write_at(&dev, 0, &a).unwrap();
    assert_eq!(read_at(&dev, 0, a.len()).unwrap(), a);

    let tcp = format!(
        "nbds://{}/?tls-certificates={certs}",
        server.tcp_addr().unwrap()
    );
    let dev2 = RemoteDevice::open(&tcp).unwrap();
    assert_eq!(read_at(&dev2, 0, a.len()).unwrap(), a);
    drop(dev2);

    // Plaintext to a server that requires TLS: refused at the handshake.
    let plain = format!("nbd+unix:///?socket={}", sock.display());
    let e = RemoteDevice::open(&plain).unwrap_err();
    assert!(matches!(e, RemoteError::Handshake { .. }), "{e}");

    // The server restarts: the device reconnects with TLS again.
    server.shutdown();
    let server = serve(dir.path(), &sock, &disk, true);
    wait_until_within("reconnected", Duration::from_secs(10), || {
        dev.reconnects() >= 1 && dev.is_connected()
    });
    let b = pattern(2, 64 << 10);
    write_at(&dev, 1 << 20, &b).unwrap();
    assert_eq!(read_at(&dev, 1 << 20, b.len()).unwrap(), b);
    assert_eq!(read_at(&dev, 0, a.len()).unwrap(), a);
    drop(dev);
    server.shutdown();
}

/// A CA that did not sign the server's certificate: the TLS handshake fails and the device
/// does not open.
#[test]
fn an_untrusted_server_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    pki(dir.path());
    let sock = dir.path().join("nbd.sock");
    let server = serve(dir.path(), &sock, &device("mem:1M"), false);
    let other = tempfile::tempdir().unwrap();
    std::fs::write(other.path().join("ca-cert.pem"), ca("other CA").cert.pem()).unwrap();
    let uri = format!(
        "nbds+unix:///?socket={}&tls-certificates={}",
        sock.display(),
        other.path().display()
    );
    let e = RemoteDevice::open(&uri).unwrap_err();
    assert!(matches!(e, RemoteError::Handshake { .. }), "{e}");
    // A directory without a CA certificate: said so.
    let empty = tempfile::tempdir().unwrap();
    let uri = format!(
        "nbds+unix:///?socket={}&tls-certificates={}",
        sock.display(),
        empty.path().display()
    );
    let e = RemoteDevice::open(&uri).unwrap_err();
    assert!(e.to_string().contains("ca-cert.pem"), "{e}");
    server.shutdown();
}
