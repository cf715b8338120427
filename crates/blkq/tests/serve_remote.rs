//! `blkq serve` with a device on another NBD server: a proxy in front of another `blkq serve`
//! driven by qemu-io, a mirror with a remote leg, and the spec checks. The built binary.

mod common;

use std::process::Command;

use common::Serving;
use nbd::client::{Client, ClientOptions, Endpoint, Handshake};
use nbd::codec::CmdFlags;

fn have(tool: &str) -> bool {
    Command::new(tool).arg("--version").output().is_ok()
}

fn remote(sock: &std::path::Path) -> String {
    format!("nbd+unix:///?socket={}", sock.display())
}

#[test]
fn a_proxy_in_front_of_another_server() {
    let dir = tempfile::tempdir().unwrap();
    let back = Serving::start(dir.path(), "back", &["--device", "mem:64M"]);
    let spec = format!("{},timeout=10,depth=32", remote(&back.sock));
    let front = Serving::start(dir.path(), "front", &["--device", &spec]);

    // The front tells the kind, and the back's size.
    let stream = Endpoint::Unix(front.sock.clone()).connect().unwrap();
    let mut h = Handshake::start(stream).unwrap();
    let info = h.info("").unwrap();
    h.abort().unwrap();
    assert_eq!(info.size, 64 << 20);
    assert!(
        info.description.as_deref().unwrap_or("").contains("nbd"),
        "{info:?}"
    );

    if have("qemu-io") {
        let out = Command::new("qemu-io")
            .args(["-f", "raw"])
            .arg(remote(&front.sock))
            .args(["-c", "write -P 0xab 0 1M", "-c", "read -P 0xab 0 1M"])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{text}");
        assert!(!text.contains("verification failed"), "{text}");
        assert!(text.contains("read 1048576/1048576"), "{text}");
        // It went through to the back.
        let mut c = back.client();
        assert_eq!(c.read(0, 1 << 20).unwrap(), vec![0xab; 1 << 20]);
    } else {
        eprintln!("qemu-io is not on PATH: the proxy is driven by nbd::client only");
    }

    // nbd::client through the front: FUA write, flush, trim, read back at the back.
    let mut c = front.client();
    c.write(2 << 20, &[0x5a; 8192], CmdFlags::FUA).unwrap();
    c.flush().unwrap();
    c.trim(2 << 20, 4096).unwrap();
    let mut b = back.client();
    let got = b.read(2 << 20, 8192).unwrap();
    assert!(got[..4096].iter().all(|&x| x == 0));
    assert!(got[4096..].iter().all(|&x| x == 0x5a));
}

#[test]
fn a_mirror_with_a_remote_leg() {
    let dir = tempfile::tempdir().unwrap();
    let back = Serving::start(dir.path(), "leg", &["--device", "mem:64M"]);
    let legs = format!("mem:64M,{},timeout=10", remote(&back.sock));
    let front = Serving::start(dir.path(), "mirror", &["--raid1", &legs, "--raid1-create"]);
    let mut c = front.client();
    let data: Vec<u8> = (0..1 << 20).map(|i| (i % 251) as u8).collect();
    c.write(0, &data, CmdFlags::FUA).unwrap();
    assert_eq!(c.read(0, 1 << 20).unwrap(), data);
    // The remote leg carries the array's superblock (somewhere in its first MiBs).
    let mut b: Client = Client::connect(
        &Endpoint::Unix(back.sock.clone()),
        &ClientOptions::default(),
    )
    .unwrap();
    let head = b.read(0, 4 << 20).unwrap();
    assert!(head.iter().any(|&x| x != 0), "the remote leg got nothing");
}

#[test]
fn remote_specs_are_checked_before_anything_starts() {
    let out = common::fails(&["serve", "--no-tcp", "--device", "nbds://127.0.0.1/x"]);
    assert!(out.contains("tls-certificates=DIR"), "{out}");
    let out = common::fails(&["serve", "--no-tcp", "--device", "nbd://h:0/x"]);
    assert!(out.contains("bad port"), "{out}");
    let out = common::fails(&["serve", "--no-tcp", "--device", "nbd+unix:///x"]);
    assert!(out.contains("socket"), "{out}");
    let out = common::fails(&[
        "serve",
        "--no-tcp",
        "--device",
        "nbd+unix:///?socket=/nonexistent/blkq.sock",
    ]);
    assert!(out.contains("cannot connect"), "{out}");
}

/// A plaintext proxy in front of `blkq serve --tls require` (certificates from `blkq certs`),
/// reaching it with `nbds+unix://...&tls-certificates=DIR`; the same back reached without TLS
/// is refused.
#[test]
fn a_proxy_in_front_of_a_tls_server() {
    let dir = tempfile::tempdir().unwrap();
    let (back, pki) = Serving::start_tls(dir.path(), "back", &[]);
    let spec = format!(
        "nbds+unix:///?socket={}&tls-certificates={},timeout=10",
        back.sock.display(),
        pki.display()
    );
    let front = Serving::start(dir.path(), "front", &["--device", &spec]);
    let mut c = front.client();
    let data: Vec<u8> = (0..256 << 10).map(|i| (i % 253) as u8).collect();
    c.write(1 << 20, &data, CmdFlags::FUA).unwrap();
    c.flush().unwrap();
    assert_eq!(c.read(1 << 20, data.len() as u64).unwrap(), data);
    drop(c);
    drop(front);
    // Plaintext to the TLS-only back: refused at the handshake.
    let out = common::fails(&["serve", "--no-tcp", "--device", &remote(&back.sock)]);
    assert!(out.contains("handshake"), "{out}");
}

/// A mirror whose remote leg's server is killed (SIGKILL) and started again on the same
/// socket and file within the reconnect deadline: a write through the mirror meanwhile waits
/// and succeeds, the leg never goes faulty, and the data is on the remote leg.
#[test]
fn a_mirror_rides_out_a_remote_leg_restart() {
    let dir = tempfile::tempdir().unwrap();
    let back_dir = dir.path().join("back");
    let front_dir = dir.path().join("front");
    std::fs::create_dir_all(&back_dir).unwrap();
    std::fs::create_dir_all(&front_dir).unwrap();
    let img = back_dir.join("leg.img");
    std::fs::File::create(&img)
        .unwrap()
        .set_len(64 << 20)
        .unwrap();
    let dev = format!("file:{}", img.display());
    let mut back = Serving::start(&back_dir, "leg", &["--device", &dev]);
    let legs = format!(
        "mem:64M,{},timeout=10,reconnect_deadline=30",
        remote(&back.sock)
    );
    let front = common::Server::start(&front_dir, &legs, &["--raid1-create"]);
    let mut c = front.client();
    let a: Vec<u8> = (0..1 << 20).map(|i| (i % 249) as u8).collect();
    c.write(0, &a, CmdFlags::FUA).unwrap();

    back.kill();
    let b: Vec<u8> = (0..1 << 20).map(|i| (i % 241) as u8).collect();
    let writer = {
        let b = b.clone();
        std::thread::spawn(move || {
            c.write(4 << 20, &b, CmdFlags::FUA).unwrap();
            c
        })
    };
    std::thread::sleep(std::time::Duration::from_millis(300));
    let back = Serving::start(&back_dir, "leg", &["--device", &dev]);
    let mut c = writer.join().unwrap();
    assert_eq!(c.read(4 << 20, 1 << 20).unwrap(), b);
    // Back in sync: at once, or (when the killed server took writes no flush covered with
    // it, so the leg failed) once it is re-added and recovered.
    let t0 = std::time::Instant::now();
    loop {
        let status = front.status_json();
        if common::legs_in_sync(&status) == 2 {
            break;
        }
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(60),
            "{status}"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    // Both writes reached the remote leg (behind its superblock area: find them by content).
    let mut r = back.client();
    let head = r.read(0, 8 << 20).unwrap();
    let has = |d: &[u8]| head.windows(4096).any(|w| w == &d[..4096]);
    assert!(has(&a) && has(&b), "the remote leg misses a write");
}

/// Through a proxy, reads ask the remote server for no block status (sparse reads are off
/// for a remote export: each would cost a round trip); a client's own block status is
/// answered from the remote's (`base:allocation`). nbdkit's log filter, behind the proxy,
/// records what the proxy sends. Skipped without nbdkit.
#[test]
fn a_proxy_reads_without_block_status_and_maps_from_the_remote() {
    if !have("nbdkit") {
        eprintln!("skipped: nbdkit is not on PATH");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("kit.sock");
    let log = dir.path().join("kit.log");
    let mut kit = Command::new("nbdkit")
        .args(["-f", "-U"])
        .arg(&sock)
        .args(["--filter=log", "memory", "16M"])
        .arg(format!("logfile={}", log.display()))
        .spawn()
        .unwrap();
    let t = std::time::Instant::now();
    while std::os::unix::net::UnixStream::connect(&sock).is_err() {
        assert!(t.elapsed().as_secs() < 10, "nbdkit did not start");
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let front = Serving::start(dir.path(), "front", &["--device", &remote(&sock)]);
    let mut c = front.client();
    c.write(1 << 20, &[7; 65536], CmdFlags::empty()).unwrap();
    for k in 0..16u64 {
        c.read(k * 65536, 65536).unwrap();
    }
    let statuses = || {
        std::fs::read_to_string(&log)
            .unwrap()
            .lines()
            .filter(|l| l.contains(" Extents id="))
            .count()
    };
    assert_eq!(
        statuses(),
        0,
        "a read through the proxy asked for block status"
    );
    // The client's own map comes from the remote: a hole, the data, a hole.
    let map = c.block_status(0, 4 << 20, CmdFlags::empty()).unwrap();
    assert!(statuses() >= 1);
    let hole = u64::from(nbd::codec::proto::NBD_STATE_HOLE);
    assert!(map[0].1 & hole != 0, "{map:?}");
    let mut at = 0;
    let data = map.iter().find(|(len, flags)| {
        let here = at;
        at += len;
        flags & hole == 0 && here <= 1 << 20
    });
    assert!(data.is_some(), "{map:?}");
    drop(c);
    drop(front);
    let _ = kit.kill();
    let _ = kit.wait();
}

/// A remote device's host name is resolved within its connection attempt's deadline: with a
/// name server that never answers (a UDP socket on 127.0.0.1:53 that reads and drops, in a
/// network namespace of the test's own, named by a resolv.conf bound over the system's in a
/// mount namespace of blkq's own), `serve` fails after the device's `timeout=`, not after the
/// resolver's own timeouts (5 s, three times).
#[test]
fn a_name_server_that_never_answers_fails_the_attempt_at_its_timeout() {
    use blkq_sync::atomic::{AtomicBool, Ordering};
    use std::time::{Duration, Instant};
    let Some(hosts) = common::hosts_or_skip("a_name_server_that_never_answers") else {
        return;
    };
    let ns = hosts.front();
    let dir = tempfile::tempdir().unwrap();
    let resolv = dir.path().join("resolv.conf");
    std::fs::write(
        &resolv,
        "nameserver 127.0.0.1\noptions timeout:5 attempts:3\n",
    )
    .unwrap();
    // The name server: reads every query, answers none.
    let stop = blkq_sync::Arc::new(AtomicBool::new(false));
    let (st, ns2) = (stop.clone(), ns.clone());
    let (tx, rx) = std::sync::mpsc::channel();
    let dns = std::thread::spawn(move || {
        use std::os::fd::AsRawFd;
        let f = std::fs::File::open(&ns2).unwrap();
        // SAFETY: setns(2) on a descriptor this thread owns; it moves only this thread.
        assert_eq!(unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) }, 0);
        let s = std::net::UdpSocket::bind("127.0.0.1:53").unwrap();
        s.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
        tx.send(()).unwrap();
        let (mut queries, mut b) = (0, [0u8; 512]);
        while !st.load(Ordering::SeqCst) {
            if s.recv(&mut b).is_ok() {
                queries += 1;
            }
        }
        queries
    });
    rx.recv().unwrap();
    let mut cmd = Command::new("unshare");
    cmd.args(["--mount", "sh", "-c"])
        .arg(format!(
            "mount --bind {} /etc/resolv.conf && exec {} serve --no-unix --listen 127.0.0.1:0 \
             --device nbd://slow.blkq.test:10809/x,timeout=1",
            resolv.display(),
            common::BIN
        ))
        .env("RUST_BACKTRACE", "0");
    common::enter_netns(&mut cmd, &ns);
    let t = Instant::now();
    let out = cmd.output().unwrap();
    let took = t.elapsed();
    stop.store(true, Ordering::SeqCst);
    let queries = dns.join().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        queries > 0,
        "the resolver never asked the name server: {err}"
    );
    assert!(err.contains("slow.blkq.test"), "{err}");
    assert!(
        took < Duration::from_secs(4),
        "serve gave up after {took:?} (timeout=1): {err}"
    );
}
