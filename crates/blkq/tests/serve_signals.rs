//! `blkq serve` and SIGHUP: the built binary. SIGHUP never stops the server; it reloads what
//! can change without dropping a client (TLS certificates, exports' access rules from the
//! configuration file) and keeps the old ones when the new ones do not load.

mod common;

use std::path::Path;
use std::time::Duration;

use common::Serving;
use nbd::codec::CmdFlags;

/// `blkq serve --config FILE` with `RUST_LOG=log`, its stderr in `dir`, once `sock` accepts.
fn serve_config(file: &Path, dir: &Path, sock: &Path, log: &str) -> common::Running {
    common::Launch::serve(["--config"])
        .arg(file)
        .env("RUST_LOG", log)
        .stderr_to(&dir.join("stderr"))
        .ready_when_connects(sock)
        .start()
}

#[test]
fn sighup_does_not_stop_the_server_and_a_connected_client_keeps_working() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = Serving::launch(dir.path(), "hup", &["--device", "mem:4M"], |l| {
        l.env("RUST_LOG", "info")
    });
    let mut cl = s.client();
    cl.write(0, &[7u8; 4096], CmdFlags::FUA).unwrap();
    s.signal(libc::SIGHUP);
    // The log line that says the reload ran (bounded wait), then the process must be alive.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !s.stderr_text().contains("SIGHUP") && std::time::Instant::now() < deadline {
        if s.try_wait().is_some() {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        s.try_wait().is_none(),
        "SIGHUP stopped the server: {}",
        s.stderr_text()
    );
    assert_eq!(cl.read(0, 4096).unwrap(), vec![7u8; 4096]);
    let mut cl2 = s.client();
    assert_eq!(cl2.read(0, 4096).unwrap(), vec![7u8; 4096]);
    s.signal(libc::SIGTERM);
    let st = s.wait_exit(Duration::from_secs(30));
    assert!(st.success(), "{}", s.stderr_text());
}

/// Waits (bounded) until the server's stderr holds `n` lines containing `what`.
fn wait_log(s: &common::Running, what: &str, n: usize) -> String {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let t = s.stderr_text();
        if t.matches(what).count() >= n || std::time::Instant::now() > deadline {
            return t;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn config(sock: &std::path::Path, pki: &std::path::Path, allow: &str) -> String {
    format!(
        r#"
[server]
socket = "{sock}"
no_tcp = true

[tls]
mode = "require"
certificates = "{pki}"
verify_peer = true

[[export]]
name = "disk"
device = "mem:1M"
allow_subjects = [{allow}]
"#,
        sock = sock.display(),
        pki = pki.display()
    )
}

#[test]
fn sighup_reloads_certificates_and_access_rules_and_keeps_them_when_the_file_is_broken() {
    use nbd::client::{Endpoint, Handshake};
    let dir = tempfile::tempdir().unwrap();
    let pki = dir.path().join("pki");
    common::ok(&["certs", pki.to_str().unwrap(), "--client", "client1"]);
    let sock = dir.path().join("s.sock");
    let file = dir.path().join("blkq.toml");
    std::fs::write(&file, config(&sock, &pki, "\"CN=client1\"")).unwrap();
    let mut s = serve_config(&file, dir.path(), &sock, "info");
    let cfg = nbd::tls::client_config(&pki).unwrap();
    let ep = Endpoint::Unix(sock.clone());
    let connect = || {
        let mut h = Handshake::start(ep.connect().unwrap()).unwrap();
        h.start_tls(&cfg, "localhost").unwrap();
        h.go("disk")
            .map(|d| h.into_client(d).unwrap())
            .map_err(|e| e.to_string())
    };
    let mut kept = connect().unwrap();
    kept.write(0, &[5u8; 4096], CmdFlags::FUA).unwrap();

    // Only another subject is allowed now: a new connection is refused, the connected one
    // keeps working.
    std::fs::write(&file, config(&sock, &pki, "\"CN=someone-else\"")).unwrap();
    s.signal(libc::SIGHUP);
    let log = wait_log(&s, "SIGHUP: reloaded", 1);
    assert!(log.contains("TLS certificates read again"), "{log}");
    assert!(log.contains("CN=someone-else"), "{log}");
    assert!(s.try_wait().is_none(), "{log}");
    let e = connect().err().expect("the new rule must refuse client1");
    assert!(
        e.to_lowercase().contains("polic") || e.contains("refused"),
        "{e}"
    );
    assert_eq!(kept.read(0, 4096).unwrap(), vec![5u8; 4096]);

    // A broken file: logged, the rules in force stay.
    std::fs::write(&file, "[server\nthis is not toml").unwrap();
    s.signal(libc::SIGHUP);
    let log = wait_log(&s, "reload refused", 1);
    assert!(log.contains("reload refused, nothing changed"), "{log}");
    assert!(s.try_wait().is_none(), "{log}");
    assert!(connect().is_err(), "the old rule must stay in force");

    // Back to client1: admitted again.
    std::fs::write(&file, config(&sock, &pki, "\"CN=client1\"")).unwrap();
    s.signal(libc::SIGHUP);
    wait_log(&s, "SIGHUP: reloaded", 2);
    let mut again = connect().unwrap();
    assert_eq!(again.read(0, 4096).unwrap(), vec![5u8; 4096]);
    drop((kept, again));
    s.signal(libc::SIGTERM);
    let st = s.wait_exit(Duration::from_secs(30));
    assert!(st.success(), "{}", s.stderr_text());
}

/// A configuration with the given `(name, device)` exports on a Unix socket.
fn exports_config(sock: &std::path::Path, exports: &[(&str, &str)]) -> String {
    let mut s = format!(
        "[server]\nsocket = \"{}\"\nno_tcp = true\nshutdown_timeout = 5\n",
        sock.display()
    );
    for (name, dev) in exports {
        s.push_str(&format!(
            "\n[[export]]\nname = \"{name}\"\ndevice = \"{dev}\"\n"
        ));
    }
    s
}

/// SIGHUP applies the export set of the file: an export it gained is served, one it lost is
/// removed (a client attached to it has its write answered, then is closed), and the others
/// keep their clients.
#[test]
fn sighup_serves_the_exports_the_file_gained_and_removes_the_ones_it_lost() {
    use nbd::client::{Endpoint, Handshake};
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("s.sock");
    let file = dir.path().join("blkq.toml");
    std::fs::write(
        &file,
        exports_config(&sock, &[("stay", "mem:1M"), ("old", "mem:1M")]),
    )
    .unwrap();
    let mut s = serve_config(&file, dir.path(), &sock, "info");
    let ep = Endpoint::Unix(sock.clone());
    let connect = |name: &str| {
        let mut h = Handshake::start(ep.connect().unwrap()).unwrap();
        h.go(name)
            .map(|d| h.into_client(d).unwrap())
            .map_err(|e| e.to_string())
    };
    let mut stay = connect("stay").unwrap();
    stay.write(0, &[1u8; 4096], CmdFlags::FUA).unwrap();
    let mut old = connect("old").unwrap();
    old.write(0, &[2u8; 4096], CmdFlags::FUA).unwrap();
    assert!(connect("new").is_err());

    std::fs::write(
        &file,
        exports_config(&sock, &[("stay", "mem:1M"), ("new", "mem:2M")]),
    )
    .unwrap();
    s.signal(libc::SIGHUP);
    let log = wait_log(&s, "SIGHUP: reloaded", 1);
    assert!(s.try_wait().is_none(), "{log}");
    assert!(
        log.contains("export \"new\" added") && log.contains("new in the configuration"),
        "{log}"
    );
    assert!(log.contains("gone from the configuration"), "{log}");
    assert!(!log.contains("needs a restart"), "{log}");
    let mut new = connect("new").expect("the export the file gained is served");
    assert_eq!(new.size(), 2 << 20);
    new.write(0, &[3u8; 4096], CmdFlags::FUA).unwrap();
    let e = connect("old")
        .err()
        .expect("the export the file lost is gone");
    assert!(e.contains("UNKNOWN") || e.contains("unknown"), "{e}");
    assert!(old.read(0, 4096).is_err(), "its client was closed");
    assert_eq!(stay.read(0, 4096).unwrap(), vec![1u8; 4096]);
    drop((stay, new, old));
    s.signal(libc::SIGTERM);
    let st = s.wait_exit(Duration::from_secs(30));
    assert!(st.success(), "{}", s.stderr_text());
}

/// `log_level` in the file sets what is logged, and SIGHUP applies a changed one: at `warn`
/// a connection is not logged, at `info` (after the reload) it is.
#[test]
fn sighup_applies_a_changed_log_level() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("s.sock");
    let file = dir.path().join("blkq.toml");
    let write = |level: &str| {
        let c = exports_config(&sock, &[("d", "mem:1M")]).replace(
            "no_tcp = true\n",
            &format!("no_tcp = true\nlog_level = \"{level}\"\n"),
        );
        std::fs::write(&file, c).unwrap();
    };
    write("warn");
    let mut s = serve_config(&file, dir.path(), &sock, "");
    let ep = nbd::client::Endpoint::Unix(sock.clone());
    let connect = || {
        let mut h = nbd::client::Handshake::start(ep.connect().unwrap()).unwrap();
        let d = h.go("d").unwrap();
        h.into_client(d).unwrap()
    };
    // A request answered: the server is past the point where it logs a connection.
    let mut first = connect();
    first.write(0, &[1u8; 512], CmdFlags::empty()).unwrap();
    let log = s.stderr_text();
    assert!(!log.contains("connection open"), "logged at warn: {log}");
    drop(first);
    write("info");
    s.signal(libc::SIGHUP);
    // The reload's own line comes after the new level is in force.
    let log = wait_log(&s, "SIGHUP: reloaded", 1);
    assert!(log.contains("log level now \"info\""), "{log}");
    let mut c = connect();
    c.write(0, &[1u8; 512], CmdFlags::empty()).unwrap();
    let log = wait_log(&s, "connection open conn=2", 1);
    assert!(log.contains("connection open conn=2"), "{log}");
    // A bad filter is refused by name, and the level in force stays.
    write("info,=[");
    s.signal(libc::SIGHUP);
    let log = wait_log(&s, "reload refused", 1);
    assert!(log.contains("log_level"), "{log}");
    drop(c);
    s.signal(libc::SIGTERM);
    let st = s.wait_exit(Duration::from_secs(30));
    assert!(st.success(), "{}", s.stderr_text());
}
