//! TLS (`NBD_OPT_STARTTLS`) against the server: data over TLS on Unix and TCP, `--tls=require`
//! refusing plaintext, client-certificate verification. Certificates are made here (rcgen).
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]
#![cfg(not(blkq_loom))]

mod common;

use std::io::Read;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use blk::Device;
use common::hooks::CountHome;
use common::pki::{ca, leaf, pki};
use common::served::{device, log};
use nbd::client::{ClientError, Endpoint, Handshake};
use nbd::codec::handshake::{ClientOption, ExportRequest};
use nbd::codec::proto::*;
use nbd::codec::transmission::Request;
use nbd::codec::{CmdFlags, Command};
use nbd::server::{Access, Export, Server, ServerConfig};
use nbd::tls::{client_config, TlsMode, TlsSettings};

const MIB: u64 = 1 << 20;

struct TlsServer {
    server: Option<Server>,
    dir: tempfile::TempDir,
    unix: Endpoint,
    tcp: Endpoint,
}

impl TlsServer {
    fn start(mode: TlsMode, verify_peer: bool) -> Self {
        Self::start_with(
            mode,
            verify_peer,
            vec![
                Export::new("", device("mem:64M")),
                Export::new("b", device("mem:16M")),
            ],
        )
    }

    fn start_with(mode: TlsMode, verify_peer: bool, exports: Vec<Export>) -> Self {
        log();
        let dir = tempfile::tempdir().unwrap();
        pki(dir.path());
        let path = dir.path().join("nbd.sock");
        let mut cfg = ServerConfig::new(exports);
        cfg.unix = Some(path.clone());
        cfg.tcp = Some("127.0.0.1:0".parse::<SocketAddr>().unwrap());
        cfg.tuning.drain_timeout = Duration::from_secs(5);
        cfg.tuning.handshake_timeout = Duration::from_secs(10);
        cfg.tls = Some(TlsSettings::load(mode, dir.path(), verify_peer).unwrap());
        let server = Server::start(cfg).unwrap();
        let tcp = Endpoint::Tcp(server.tcp_addr().unwrap());
        Self {
            server: Some(server),
            dir,
            unix: Endpoint::Unix(path),
            tcp,
        }
    }

    fn handshake(&self, ep: &Endpoint) -> Handshake {
        Handshake::start(ep.connect().unwrap()).unwrap()
    }

    /// A client directory with the CA and, if `client`, the client certificate.
    fn client_dir(&self, client: bool) -> tempfile::TempDir {
        let d = tempfile::tempdir().unwrap();
        let src = self.dir.path();
        std::fs::copy(src.join("ca-cert.pem"), d.path().join("ca-cert.pem")).unwrap();
        if client {
            for f in ["client-cert.pem", "client-key.pem"] {
                std::fs::copy(src.join(f), d.path().join(f)).unwrap();
            }
        }
        d
    }
}

impl Drop for TlsServer {
    fn drop(&mut self) {
        if let Some(s) = self.server.take() {
            let problems = s.shutdown().failed;
            assert!(problems.is_empty(), "{problems:?}");
        }
    }
}

fn refused_with(r: Result<impl std::fmt::Debug, ClientError>, want: u32) {
    match r {
        Err(ClientError::OptionRefused { reply_type, .. }) => assert_eq!(reply_type, want),
        other => panic!("wanted option error {want:#x}, got {other:?}"),
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed)
        .collect()
}

/// STARTTLS, GO, then writes and reads of several sizes, many in flight at once.
fn round_trip(srv: &TlsServer, ep: &Endpoint, client_cert: bool) {
    let dir = srv.client_dir(client_cert);
    let cfg = client_config(dir.path()).unwrap();
    let mut hs = srv.handshake(ep);
    hs.start_tls(&cfg, "localhost").unwrap();
    hs.structured_replies().unwrap();
    let d = hs.go("").unwrap();
    assert_eq!(d.size, 64 * MIB);
    let mut c = hs.into_client(d).unwrap();
    // One of each size, read back.
    for (i, len) in [512usize, 4096, 65536, MIB as usize, 3 * MIB as usize]
        .into_iter()
        .enumerate()
    {
        let data = pattern(len, i as u8);
        let off = i as u64 * 4 * MIB;
        c.write(off, &data, CmdFlags::empty()).unwrap();
        assert_eq!(c.read(off, len as u64).unwrap(), data, "size {len}");
    }
    // 64 reads in flight: replies leave through the combining writer, over TLS.
    let data = pattern(4096 * 64, 7);
    c.write(32 * MIB, &data, CmdFlags::FUA).unwrap();
    let mut cookies = Vec::new();
    for i in 0..64u64 {
        let req = Request::new(Command::Read, 0, 32 * MIB + i * 4096, 4096);
        cookies.push(c.send(req, &[]).unwrap());
    }
    let mut got = 0;
    while got < 64 {
        let r = c.recv().unwrap();
        let i = cookies.iter().position(|&k| k == r.cookie).unwrap();
        let i = i * 4096;
        assert_eq!(r.data, data[i..i + 4096]);
        got += 1;
    }
    c.flush().unwrap();
    c.disconnect().unwrap();
}

#[test]
fn data_round_trip_over_tls_on_unix() {
    let srv = TlsServer::start(TlsMode::Require, false);
    round_trip(&srv, &srv.unix.clone(), false);
}

#[test]
fn data_round_trip_over_tls_on_tcp() {
    let srv = TlsServer::start(TlsMode::Require, false);
    round_trip(&srv, &srv.tcp.clone(), false);
}

#[test]
fn tls_on_also_serves_plaintext() {
    let srv = TlsServer::start(TlsMode::On, false);
    let mut hs = srv.handshake(&srv.unix);
    let d = hs.go("").unwrap();
    let mut c = hs.into_client(d).unwrap();
    c.write(0, &[9u8; 4096], CmdFlags::empty()).unwrap();
    assert_eq!(c.read(0, 4096).unwrap(), vec![9u8; 4096]);
    c.disconnect().unwrap();
    round_trip(&srv, &srv.unix.clone(), false);
}

#[test]
fn plaintext_client_against_require_gets_tls_reqd_and_no_data() {
    let srv = TlsServer::start(TlsMode::Require, false);
    let mut hs = srv.handshake(&srv.unix);
    refused_with(hs.list(), NBD_REP_ERR_TLS_REQD);
    refused_with(hs.info(""), NBD_REP_ERR_TLS_REQD);
    refused_with(hs.structured_replies(), NBD_REP_ERR_TLS_REQD);
    refused_with(hs.go(""), NBD_REP_ERR_TLS_REQD);
    refused_with(hs.go("b"), NBD_REP_ERR_TLS_REQD);
    // Five refusals, one connection: counted (and logged) once, as a policy refusal.
    let policy = nbd::server::HandshakeFailure::ALL
        .iter()
        .position(|&r| r == nbd::server::HandshakeFailure::Policy)
        .unwrap();
    let metrics = srv.server.as_ref().unwrap().metrics();
    assert_eq!(metrics.server().handshake_failures[policy], 1);
    // NBD_OPT_EXPORT_NAME cannot be refused with an error: the connection is closed, and not
    // one byte of export data (nor the export's size) comes back.
    hs.send_option(&ClientOption::ExportName("")).unwrap();
    let mut rest = Vec::new();
    let _ = hs.stream().read_to_end(&mut rest);
    assert!(
        rest.is_empty(),
        "got {} bytes after EXPORT_NAME",
        rest.len()
    );
    // ABORT is still answered.
    let hs = srv.handshake(&srv.unix);
    hs.abort().unwrap();
}

#[test]
fn starttls_twice_or_with_data_is_invalid_and_off_is_policy() {
    let srv = TlsServer::start(TlsMode::Require, false);
    let dir = srv.client_dir(false);
    let cfg = client_config(dir.path()).unwrap();
    let mut hs = srv.handshake(&srv.unix);
    // STARTTLS with data.
    hs.send_option(&ClientOption::Other {
        option: NBD_OPT_STARTTLS,
        data: b"x",
    })
    .unwrap();
    let r = hs.read_reply().unwrap();
    assert_eq!(r.reply_type, NBD_REP_ERR_INVALID);
    hs.start_tls(&cfg, "localhost").unwrap();
    refused_with(hs.option(&ClientOption::StartTls), NBD_REP_ERR_INVALID);
    // Still usable after the refusal.
    let d = hs.info("b").unwrap();
    assert_eq!(d.size, 16 * MIB);
    let _ = hs.option(&ClientOption::Go(ExportRequest {
        name: "b",
        info: vec![],
    }));

    // A server without TLS refuses STARTTLS with ERR_POLICY.
    let dir2 = tempfile::tempdir().unwrap();
    let path = dir2.path().join("plain.sock");
    let mut plain = ServerConfig::new(vec![Export::new("", device("mem:1M"))]);
    plain.unix = Some(path.clone());
    let server = Server::start(plain).unwrap();
    let mut hs = Handshake::start(Endpoint::Unix(path).connect().unwrap()).unwrap();
    refused_with(hs.option(&ClientOption::StartTls), NBD_REP_ERR_POLICY);
    hs.abort().unwrap();
    server.shutdown();
}

/// Under --tls-verify-peer: TLS 1.3 finishes the client's side of the handshake before the
/// server has checked its certificate, so the refusal shows as the handshake or the first
/// option failing. Either way the client gets no export.
fn refused_under_verify_peer(srv: &TlsServer, dir: &Path) {
    let cfg = client_config(dir).unwrap();
    let mut hs = srv.handshake(&srv.unix);
    if hs.start_tls(&cfg, "localhost").is_err() {
        return;
    }
    let r = hs.go("");
    assert!(r.is_err(), "the server accepted the client: {r:?}");
}

#[test]
fn verify_peer_refuses_a_client_without_a_certificate() {
    let srv = TlsServer::start(TlsMode::Require, true);
    let dir = srv.client_dir(false);
    refused_under_verify_peer(&srv, dir.path());
}

#[test]
fn verify_peer_refuses_a_certificate_from_another_ca() {
    let srv = TlsServer::start(TlsMode::Require, true);
    let dir = srv.client_dir(false);
    let other = ca("another CA");
    leaf(&other, dir.path(), "client", "mallory", false);
    refused_under_verify_peer(&srv, dir.path());
}

#[test]
fn verify_peer_accepts_a_client_certificate_from_the_ca() {
    let srv = TlsServer::start(TlsMode::Require, true);
    round_trip(&srv, &srv.unix.clone(), true);
    round_trip(&srv, &srv.tcp.clone(), true);
}

/// Key updates while replies are in flight: the server's answering KeyUpdate is queued by its
/// reader and must leave through the writer, in order with the replies (a record sent out of
/// order would fail to decrypt here).
#[test]
fn key_updates_in_the_middle_of_replies() {
    let srv = TlsServer::start(TlsMode::Require, false);
    let dir = srv.client_dir(false);
    let cfg = client_config(dir.path()).unwrap();
    let mut hs = srv.handshake(&srv.tcp);
    hs.start_tls(&cfg, "localhost").unwrap();
    let d = hs.go("").unwrap();
    let mut c = hs.into_client(d).unwrap();
    let data = pattern(64 * 65536, 3);
    c.write(0, &data, CmdFlags::empty()).unwrap();
    for round in 0..20u64 {
        let mut cookies = Vec::new();
        for i in 0..32u64 {
            if i % 8 == round % 8 {
                c.tls_refresh_keys().unwrap();
            }
            let off = ((round * 7 + i) % 64) * 65536;
            let req = Request::new(Command::Read, 0, off, 65536);
            cookies.push((c.send(req, &[]).unwrap(), off as usize));
        }
        for _ in 0..cookies.len() {
            let r = c.recv().unwrap();
            let &(_, off) = cookies.iter().find(|(k, _)| *k == r.cookie).unwrap();
            assert_eq!(r.data, data[off..off + 65536]);
        }
    }
    c.disconnect().unwrap();
}

/// A client that does not read its replies for a while: the server's non-blocking writers hit a
/// full socket and hand the half-sent ciphertext to the flusher, which finishes it in order.
#[test]
fn a_slow_reader_over_tls_gets_every_reply_in_order() {
    let srv = TlsServer::start(TlsMode::Require, false);
    let dir = srv.client_dir(false);
    let cfg = client_config(dir.path()).unwrap();
    let mut hs = srv.handshake(&srv.unix);
    hs.start_tls(&cfg, "localhost").unwrap();
    let d = hs.go("").unwrap();
    let mut c = hs.into_client(d).unwrap();
    let data = pattern(32 * MIB as usize, 11);
    for i in 0..32u64 {
        let off = (i * MIB) as usize;
        c.write(i * MIB, &data[off..off + MIB as usize], CmdFlags::empty())
            .unwrap();
    }
    let mut cookies = Vec::new();
    for round in 0..2u64 {
        for i in 0..32u64 {
            let off = ((i + round * 5) % 32) * MIB;
            let req = Request::new(Command::Read, 0, off, MIB);
            cookies.push((c.send(req, &[]).unwrap(), off as usize));
        }
    }
    // Far more than the socket buffers hold is now waiting on the server.
    std::thread::sleep(Duration::from_millis(300));
    for _ in 0..cookies.len() {
        let r = c.recv().unwrap();
        let &(_, off) = cookies.iter().find(|(k, _)| *k == r.cookie).unwrap();
        assert!(r.data == data[off..off + MIB as usize], "reply at {off}");
    }
    c.disconnect().unwrap();
}

fn only_subjects(s: &[&str]) -> Access {
    Access {
        allow_subjects: s.iter().map(|s| s.to_string()).collect(),
        ..Access::default()
    }
}

/// Subject rules end to end: the subject comes from the client certificate the server
/// verified (CN=client1, made by `pki`), not from a fake identity. The export allowing
/// `CN=client1` is listed and served; the one allowing someone else is invisible and answers
/// `NBD_REP_ERR_POLICY`, on Unix and TCP alike.
#[test]
fn subject_rules_with_a_verified_client_certificate() {
    let srv = TlsServer::start_with(
        TlsMode::Require,
        true,
        vec![
            Export::new("mine", device("mem:4M")).access(only_subjects(&["CN=client1"])),
            Export::new("theirs", device("mem:4M")).access(only_subjects(&["CN=someone-else"])),
        ],
    );
    let dir = srv.client_dir(true);
    let cfg = client_config(dir.path()).unwrap();
    for ep in [srv.unix.clone(), srv.tcp.clone()] {
        let mut hs = srv.handshake(&ep);
        hs.start_tls(&cfg, "localhost").unwrap();
        let names: Vec<String> = hs.list().unwrap().into_iter().map(|(n, _)| n).collect();
        assert_eq!(names, ["mine"]);
        refused_with(hs.info("theirs"), NBD_REP_ERR_POLICY);
        refused_with(hs.go("theirs"), NBD_REP_ERR_POLICY);
        // The refusal leaves the handshake usable: the allowed export is served.
        let d = hs.go("mine").unwrap();
        assert_eq!(d.size, 4 * MIB);
        let mut c = hs.into_client(d).unwrap();
        c.write(0, &pattern(4096, 5), CmdFlags::FUA).unwrap();
        assert_eq!(c.read(0, 4096).unwrap(), pattern(4096, 5));
        c.disconnect().unwrap();
    }
    // Without TLS (--tls=require) not even the list is answered.
    let mut hs = srv.handshake(&srv.unix);
    refused_with(hs.list(), NBD_REP_ERR_TLS_REQD);
}

#[test]
fn large_writes_over_tls_are_copied_never_received_home() {
    let dev = Arc::new(testkit::Forward::with_hook(
        device("mem:64M"),
        CountHome::default(),
    ));
    let srv = TlsServer::start_with(
        TlsMode::On,
        false,
        vec![Export::new("", dev.clone() as Arc<dyn Device>)],
    );
    round_trip(&srv, &srv.unix, false);
    round_trip(&srv, &srv.tcp, false);
    assert_eq!(dev.hook().count(), 0);
    // The same device over plaintext (`--tls=on` serves both) does receive home.
    let mut c = nbd::client::Client::connect(&srv.unix, &Default::default()).unwrap();
    for i in 0..3u64 {
        c.write(i * MIB, &pattern(MIB as usize, i as u8), CmdFlags::empty())
            .unwrap();
    }
    assert!(dev.hook().count() >= 2);
    c.disconnect().unwrap();
}
