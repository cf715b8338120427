//! Hostile clients against the NBD listener (TCP, Unix, TLS): slow and trickling clients at
//! every stage, floods at the connection limit, clients outside the rules. Each test names
//! the bound it checks. Certificates are made here (rcgen), never committed.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]
#![cfg(not(blkq_loom))]

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use common::served::{device, log};
use common::trickle::Trickle;
use nbd::client::{ClientError, Endpoint, Handshake};
use nbd::codec::handshake::{ClientOption, ExportRequest};
use nbd::codec::proto::*;
use nbd::codec::transmission::Request;
use nbd::codec::{CmdFlags, Command};
use nbd::server::{parse_cidr, Access, Export, Server, ServerConfig, Tuning};
use nbd::tls::{client_config, TlsMode, TlsSettings};

/// A server on 127.0.0.1 (and a Unix socket), TLS required with client certificates when
/// `tls`, its tuning adjusted by `tune`.
struct Hostile {
    server: Option<Server>,
    dir: tempfile::TempDir,
    tcp: SocketAddr,
}

impl Hostile {
    fn start(tls: bool, exports: Vec<Export>, tune: impl FnOnce(&mut Tuning)) -> Self {
        log();
        let dir = tempfile::tempdir().unwrap();
        common::pki::pki(dir.path());
        let mut cfg = ServerConfig::new(exports);
        cfg.unix = Some(dir.path().join("nbd.sock"));
        cfg.tcp = Some("127.0.0.1:0".parse().unwrap());
        cfg.tuning.drain_timeout = Duration::from_secs(5);
        tune(&mut cfg.tuning);
        if tls {
            cfg.tls = Some(TlsSettings::load(TlsMode::Require, dir.path(), true).unwrap());
        }
        let server = Server::start(cfg).unwrap();
        let tcp = server.tcp_addr().unwrap();
        Self {
            server: Some(server),
            dir,
            tcp,
        }
    }

    fn one_export(tls: bool, tune: impl FnOnce(&mut Tuning)) -> Self {
        Self::start(tls, vec![Export::new("", device("mem:16M"))], tune)
    }

    fn client_tls(&self) -> Arc<rustls::ClientConfig> {
        client_config(self.dir.path()).unwrap()
    }

    /// A legitimate client: STARTTLS with the client certificate (when TLS), GO, then a
    /// written and read-back block. Panics with what failed.
    fn legitimate(&self, ep: &Endpoint, tls: bool) {
        let mut h = Handshake::start(ep.connect().unwrap()).expect("greeting");
        if tls {
            h.start_tls(&self.client_tls(), "localhost").expect("TLS");
        }
        let d = h.go("").expect("GO");
        let mut c = h.into_client(d).unwrap();
        let data = vec![0x5a; 4096];
        c.write(0, &data, CmdFlags::FUA).unwrap();
        assert_eq!(c.read(0, 4096).unwrap(), data);
        c.disconnect().unwrap();
    }
}

impl Drop for Hostile {
    fn drop(&mut self) {
        if let Some(s) = self.server.take() {
            s.shutdown();
        }
    }
}

/// Connects over TCP, reads the greeting, sends the client flags and `NBD_OPT_STARTTLS`,
/// reads its ACK: the raw socket, ready for a ClientHello.
fn starttls_raw(addr: SocketAddr) -> TcpStream {
    let s = TcpStream::connect(addr).unwrap();
    s.set_nodelay(true).unwrap();
    let mut h = Handshake::start(nbd::stream::Stream::from(s.try_clone().unwrap())).unwrap();
    h.send_option(&ClientOption::StartTls).unwrap();
    let r = h.read_reply().unwrap();
    assert_eq!(r.reply_type, NBD_REP_ACK, "STARTTLS not acknowledged");
    s
}

/// A real ClientHello for `localhost`, as rustls would send it.
fn client_hello(cfg: &Arc<rustls::ClientConfig>) -> Vec<u8> {
    let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
    let mut conn = rustls::ClientConnection::new(cfg.clone(), name).unwrap();
    let mut out = Vec::new();
    while conn.wants_write() {
        conn.write_tls(&mut out).unwrap();
    }
    out
}

/// Sends `bytes` one per `interval` on `s` until the peer closes; when it closed (`None` if
/// every byte went out and the peer was still there `linger` after).
fn trickle_until_closed(
    mut s: TcpStream,
    bytes: &[u8],
    interval: Duration,
    linger: Duration,
) -> Option<Instant> {
    s.set_read_timeout(Some(Duration::from_millis(1))).unwrap();
    let closed = |s: &mut TcpStream| {
        let mut b = [0u8; 64];
        matches!(s.read(&mut b), Ok(0))
            || matches!(s.read(&mut b), Err(e) if e.kind() != std::io::ErrorKind::WouldBlock)
    };
    for b in bytes {
        if s.write_all(&[*b]).is_err() || closed(&mut s) {
            return Some(Instant::now());
        }
        thread::sleep(interval);
    }
    let end = Instant::now() + linger;
    while Instant::now() < end {
        if closed(&mut s) {
            return Some(Instant::now());
        }
        thread::sleep(Duration::from_millis(20));
    }
    None
}

/// Bound: `handshake_timeout` over the whole handshake, the TLS handshake included. A client
/// that acknowledges STARTTLS and sends a real ClientHello one byte every 100 ms is closed at
/// the 1 s deadline (asserted: before 2.5 s), not when it runs out of bytes.
#[test]
fn a_tls_handshake_trickled_a_byte_at_a_time_is_cut_at_the_deadline() {
    let srv = Hostile::one_export(true, |t| t.handshake_timeout = Duration::from_secs(1));
    let hello = client_hello(&srv.client_tls());
    let start = Instant::now();
    let s = starttls_raw(srv.tcp);
    let closed = trickle_until_closed(s, &hello, Duration::from_millis(100), Duration::ZERO)
        .expect("still connected after the whole trickled ClientHello");
    let held = closed - start;
    assert!(
        held < Duration::from_millis(2500),
        "the trickled TLS handshake held its connection {held:?} against a 1 s deadline"
    );
}

/// Bound: the handshake deadline also covers options sent inside TLS. After a full-speed TLS
/// handshake, an `NBD_OPT_LIST` whose TLS record arrives a byte every 100 ms is closed at the
/// 2 s deadline (asserted: before 3.5 s from connecting).
#[test]
fn an_option_trickled_inside_tls_is_cut_at_the_deadline() {
    let srv = Hostile::one_export(true, |t| t.handshake_timeout = Duration::from_secs(2));
    let proxy = Trickle::to(srv.tcp, Duration::from_millis(100));
    let start = Instant::now();
    let mut h = Handshake::start(Endpoint::Tcp(proxy.addr).connect().unwrap()).unwrap();
    h.start_tls(&srv.client_tls(), "localhost").unwrap();
    proxy.slow_down();
    thread::spawn(move || {
        let _ = h.list();
    });
    let closed = proxy
        .server_closed_within(Duration::from_secs(6))
        .expect("the server still waits for the trickled option after 6 s");
    let held = closed - start;
    assert!(
        held < Duration::from_millis(3500),
        "a trickled option inside TLS held its connection {held:?} against a 2 s deadline"
    );
}

/// Bound: in the middle of a request, a client must finish it (or send 64 KiB of it) within
/// `send_timeout`. A 4 KiB write whose TLS record arrives one byte every 50 ms is closed
/// after the 1 s send timeout (asserted: within 3 s of slowing down).
#[test]
fn a_request_trickled_inside_a_tls_record_is_cut_after_the_send_timeout() {
    let srv = Hostile::one_export(true, |t| t.send_timeout = Duration::from_secs(1));
    let proxy = Trickle::to(srv.tcp, Duration::from_millis(50));
    let mut h = Handshake::start(Endpoint::Tcp(proxy.addr).connect().unwrap()).unwrap();
    h.start_tls(&srv.client_tls(), "localhost").unwrap();
    let d = h.go("").unwrap();
    let mut c = h.into_client(d).unwrap();
    c.write(0, &[1u8; 4096], CmdFlags::empty()).unwrap();
    proxy.slow_down();
    let slowed = Instant::now();
    c.send(Request::new(Command::Write, 0, 0, 4096), &[2u8; 4096])
        .unwrap();
    let closed = proxy
        .server_closed_within(Duration::from_secs(6))
        .expect("the server still waits for the trickled request after 6 s");
    let held = closed - slowed;
    assert!(
        held < Duration::from_secs(3),
        "a trickled TLS record held its connection {held:?} against a 1 s send timeout"
    );
}

/// Bound: the same mid-request rule on plain TCP: a write request and its payload sent a
/// byte every 50 ms (each byte on time, the request never done) is closed after the 1 s send
/// timeout (asserted: within 3 s).
#[test]
fn a_request_trickled_on_plain_tcp_is_cut_after_the_send_timeout() {
    let srv = Hostile::one_export(false, |t| t.send_timeout = Duration::from_secs(1));
    let mut h = Handshake::start(Endpoint::Tcp(srv.tcp).connect().unwrap()).unwrap();
    let d = h.go("").unwrap();
    let mut c = h.into_client(d).unwrap();
    c.write(0, &[1u8; 4096], CmdFlags::empty()).unwrap();
    drop(c);
    // A fresh connection, trickled from its first request on.
    let mut h = Handshake::start(Endpoint::Tcp(srv.tcp).connect().unwrap()).unwrap();
    h.go("").unwrap();
    let s = match h.stream() {
        nbd::stream::Stream::Plain(nbd::socket::Socket::Tcp(s)) => s.try_clone().unwrap(),
        _ => unreachable!(),
    };
    let mut req = Vec::new();
    req.extend_from_slice(&NBD_REQUEST_MAGIC.to_be_bytes());
    req.extend_from_slice(&0u16.to_be_bytes()); // flags
    req.extend_from_slice(&1u16.to_be_bytes()); // NBD_CMD_WRITE
    req.extend_from_slice(&7u64.to_be_bytes()); // cookie
    req.extend_from_slice(&0u64.to_be_bytes()); // offset
    req.extend_from_slice(&4096u32.to_be_bytes());
    req.extend(std::iter::repeat_n(3u8, 4096));
    let start = Instant::now();
    let closed = trickle_until_closed(s, &req, Duration::from_millis(50), Duration::ZERO)
        .expect("still connected after the whole trickled request");
    let held = closed - start;
    assert!(
        held < Duration::from_secs(3),
        "a trickled request held its connection {held:?} against a 1 s send timeout"
    );
}

/// Bound: `max_connections` slots, and a legitimate client always gets one. Twenty clients
/// trickling TLS handshakes hold all twenty slots (the deadline is 30 s, far away); a client
/// with a valid certificate still gets in (the oldest handshake is evicted for it) and its
/// data round trip works within 5 s.
#[test]
fn twenty_trickling_tls_handshakes_do_not_lock_out_a_legitimate_client() {
    let srv = Hostile::one_export(true, |t| {
        t.handshake_timeout = Duration::from_secs(30);
        t.max_connections = 20;
    });
    let hello = client_hello(&srv.client_tls());
    let mut holders = Vec::new();
    for _ in 0..20 {
        let s = starttls_raw(srv.tcp);
        let hello = hello.clone();
        holders.push(thread::spawn(move || {
            trickle_until_closed(s, &hello, Duration::from_millis(200), Duration::ZERO)
        }));
    }
    thread::sleep(Duration::from_millis(300));
    let start = Instant::now();
    srv.legitimate(&Endpoint::Tcp(srv.tcp), true);
    assert!(start.elapsed() < Duration::from_secs(5));
    // And over the Unix socket too (same limit).
    srv.legitimate(&Endpoint::Unix(srv.dir.path().join("nbd.sock")), true);
}

/// Bound: slots held by clients in transmission are never evicted. With a limit of 3 and
/// three clients attached to the export, ten more connections are each closed before the
/// greeting, and the three attached clients go on working.
#[test]
fn a_flood_at_the_limit_does_not_evict_attached_clients() {
    let srv = Hostile::one_export(false, |t| t.max_connections = 3);
    let ep = Endpoint::Tcp(srv.tcp);
    let mut attached: Vec<_> = (0..3)
        .map(|_| {
            let mut h = Handshake::start(ep.connect().unwrap()).unwrap();
            let d = h.go("").unwrap();
            h.into_client(d).unwrap()
        })
        .collect();
    for _ in 0..10 {
        let mut s = TcpStream::connect(srv.tcp).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut g = [0u8; 18];
        assert!(
            s.read_exact(&mut g).is_err(),
            "a connection over the limit got a greeting"
        );
    }
    for (i, c) in attached.iter_mut().enumerate() {
        let data = vec![i as u8; 4096];
        c.write(i as u64 * 4096, &data, CmdFlags::empty()).unwrap();
        assert_eq!(c.read(i as u64 * 4096, 4096).unwrap(), data);
    }
}

/// Bound: the handshake deadline on plaintext too (held already; kept closed): the client
/// flags and an option trickled a byte every 100 ms are cut at the 1 s deadline.
#[test]
fn a_plaintext_handshake_trickled_is_cut_at_the_deadline() {
    let srv = Hostile::one_export(false, |t| t.handshake_timeout = Duration::from_secs(1));
    let start = Instant::now();
    let mut s = TcpStream::connect(srv.tcp).unwrap();
    let mut g = [0u8; 18];
    s.read_exact(&mut g).unwrap();
    let mut bytes = vec![0, 0, 0, 3];
    ClientOption::List.encode(&mut bytes).unwrap();
    bytes.extend(std::iter::repeat_n(0u8, 64));
    let closed = trickle_until_closed(s, &bytes, Duration::from_millis(100), Duration::ZERO)
        .expect("still connected");
    assert!(closed - start < Duration::from_millis(2500));
}

/// Rule: `allow` is checked at accept. A TCP client whose address no export allows is closed
/// before the greeting: it never takes a slot for the handshake's length.
#[test]
fn an_address_no_export_allows_is_closed_at_accept() {
    let only_ten = Access {
        allow: vec![parse_cidr("10.0.0.0/8").unwrap()],
        ..Access::default()
    };
    let srv = Hostile::start(
        false,
        vec![Export::new("", device("mem:1M")).access(only_ten)],
        |_| {},
    );
    let mut s = TcpStream::connect(srv.tcp).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut g = [0u8; 18];
    assert!(
        s.read_exact(&mut g).is_err(),
        "a client outside every allow list got the greeting"
    );
    // A Unix-socket client is governed by the socket's mode, not by addresses.
    let mut h = Handshake::start(
        Endpoint::Unix(srv.dir.path().join("nbd.sock"))
            .connect()
            .unwrap(),
    )
    .unwrap();
    h.go("").unwrap();
}

/// Rule: a refused client cannot tell an export it may not use from one that does not exist:
/// INFO, GO and SET_META_CONTEXT answer both the same way (same error, same message apart
/// from the name).
#[test]
fn refused_clients_cannot_confirm_export_names() {
    let only_ten = Access {
        allow: vec![parse_cidr("10.0.0.0/8").unwrap()],
        ..Access::default()
    };
    let srv = Hostile::start(
        false,
        vec![
            Export::new("", device("mem:1M")),
            Export::new("secret", device("mem:1M")).access(only_ten),
        ],
        |_| {},
    );
    let mut h = Handshake::start(Endpoint::Tcp(srv.tcp).connect().unwrap()).unwrap();
    h.structured_replies().unwrap();
    let answer = |h: &mut Handshake, opt: ClientOption<'_>, name: &str| -> (u32, String) {
        match h.option(&opt) {
            Err(ClientError::OptionRefused {
                reply_type,
                message,
                ..
            }) => (reply_type, message.replace(name, "NAME")),
            other => panic!("{name}: wanted a refusal, got {other:?}"),
        }
    };
    let (a, b) = ("secret", "missing");
    {
        let info = |n| ClientOption::Info(ExportRequest::new(n, &[]));
        let go = |n| ClientOption::Go(ExportRequest::new(n, &[]));
        let set = |n| {
            ClientOption::SetMetaContext(nbd::codec::handshake::MetaContextRequest {
                name: n,
                queries: vec!["base:allocation"],
            })
        };
        assert_eq!(answer(&mut h, info(a), a), answer(&mut h, info(b), b));
        assert_eq!(answer(&mut h, go(a), a), answer(&mut h, go(b), b));
        assert_eq!(answer(&mut h, set(a), a), answer(&mut h, set(b), b));
    }
}
