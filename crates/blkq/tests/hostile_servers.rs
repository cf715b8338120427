//! The hostile-server suite through the built binary: one `blkq serve` process with a plain
//! export and, for each way a server it dials can misbehave, a proxy export (an `nbd:` device)
//! and a mirror export (a file leg and an `nbd:` leg), each in front of a scriptable hostile
//! server of its own (`nbd/tests/common/hostile_server.rs`). Every server serves honestly
//! (so the process starts) until the test arms it; then it misbehaves on every connection: in
//! its replies (wrong cookies, overlapping, wrapping or huge chunks, trickled replies, no
//! answer) or, once the connection it was serving hangs up, in the handshake of every
//! reconnection (a flood of option replies, 800 MB of them, a trickled handshake, another size, absurd block
//! sizes).
//!
//! Bounds checked, all at once in the one process:
//! - time: a read through each proxy fails within the device's timeout plus its reconnect
//!   deadline and a slack, and a write through each mirror succeeds (on the local leg) within
//!   the same;
//! - memory: the process's peak RSS grows by less than [`RSS_GROWTH`];
//! - the plain export keeps serving throughout, each read well within a second, the mirrors
//!   keep their data, and the process is still running at the end.
//!
//! (STARTTLS refused or followed by plaintext, and a trickled TLS handshake, are checked on
//! the device itself in `nbd/tests/remote_tls.rs` and `remote_hostile.rs`: this process serves
//! no certificates.)
// A plain threaded test, never a loom model: it may use std::sync.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]
#![cfg(not(blkq_loom))]

mod common;
#[allow(dead_code)]
#[path = "../../nbd/tests/common/hostile_server.rs"]
mod hostile_server;

use std::fmt::Write as _;
use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nbd::client::{Client, ClientOptions, Endpoint};
use nbd::codec::proto::*;
use nbd::codec::CmdFlags;

use common::{leg_file, Launch};
use hostile_server::{HostileServer, Peer, FLAGS, SIZE};

/// The devices' options: 1 s timeout, 2 s reconnect deadline.
const DEVICE_OPTS: &str = ",timeout=1,reconnect_deadline=2";
/// How long a request through a hostile export may take: timeout, deadline, and slack for a
/// busy 2-vCPU box.
const REQUEST_LIMIT: Duration = Duration::from_secs(8);
/// How much the process's peak RSS may grow over its RSS before the servers are armed.
const RSS_GROWTH: u64 = 256 << 20;
const IO: usize = 64 << 10;

#[derive(Clone, Copy, Debug)]
enum Misbehaviour {
    WrongCookie,
    OverlappingChunks,
    WrappingChunk,
    HugeChunk,
    TrickledReply,
    Silent,
    OptionFlood,
    TrickledHandshake,
    SizeChange,
    AbsurdBlockSizes,
}

use Misbehaviour::*;

const ALL: [Misbehaviour; 10] = [
    WrongCookie,
    OverlappingChunks,
    WrappingChunk,
    HugeChunk,
    TrickledReply,
    Silent,
    OptionFlood,
    TrickledHandshake,
    SizeChange,
    AbsurdBlockSizes,
];

impl Misbehaviour {
    fn name(self) -> String {
        format!("{self:?}").to_lowercase()
    }

    /// Whether it shows in the handshake of a reconnection (the armed server hangs up on the
    /// next request to cause one).
    fn in_handshake(self) -> bool {
        matches!(
            self,
            OptionFlood | TrickledHandshake | SizeChange | AbsurdBlockSizes
        )
    }

    /// Answers request `r` as this misbehaviour does.
    fn reply(self, p: &mut Peer, r: &Req, disk: &Mutex<Vec<u8>>) -> io::Result<()> {
        let half = vec![0x5a; (r.len as usize / 2).max(1)];
        match self {
            WrongCookie => p.done(r.cookie ^ 0x5a5a_0000),
            OverlappingChunks => {
                p.data(r.cookie, r.offset, &half, false)?;
                p.data(r.cookie, r.offset, &half, true)
            }
            WrappingChunk => p.data(r.cookie, u64::MAX - 8, &half, true),
            HugeChunk => {
                // A data chunk that claims 4 GiB and brings 8 bytes: the client must not wait
                // for, nor make room for, the rest.
                let mut b = Peer::chunk_bytes(
                    NBD_REPLY_FLAG_DONE,
                    NBD_REPLY_TYPE_OFFSET_DATA,
                    r.cookie,
                    &r.offset.to_be_bytes(),
                );
                b[16..20].copy_from_slice(&0xffff_fff0u32.to_be_bytes());
                p.send(&b)?;
                p.swallow()
            }
            TrickledReply => {
                p.trickle(Some(Duration::from_millis(200)));
                let mut d = disk.lock().unwrap();
                p.answer(r, &mut d)
            }
            Silent => p.swallow(),
            _ => Err(io::Error::other("hung up to make the client reconnect")),
        }
    }

    /// The handshake of a reconnection to the armed server.
    fn handshake(self, p: &mut Peer) -> io::Result<()> {
        match self {
            OptionFlood => p.negotiate_with(|p, opt| {
                let mut d = NBD_INFO_DESCRIPTION.to_be_bytes().to_vec();
                d.extend_from_slice(&[b'x'; 4000]);
                for _ in 0..200_000 {
                    p.reply(opt, NBD_REP_INFO, &d)?;
                }
                p.go_replies(opt)
            }),
            TrickledHandshake => {
                p.trickle(Some(Duration::from_millis(300)));
                p.negotiate()
            }
            SizeChange => p.negotiate_with(|p, opt| {
                p.reply(opt, NBD_REP_INFO, &Peer::info_export(SIZE * 4, FLAGS))?;
                p.reply(opt, NBD_REP_ACK, &[])
            }),
            AbsurdBlockSizes => p.negotiate_with(|p, opt| {
                p.reply(opt, NBD_REP_INFO, &Peer::info_export(SIZE, FLAGS))?;
                let mut bs = NBD_INFO_BLOCK_SIZE.to_be_bytes().to_vec();
                for v in [1u32 << 31, 1 << 31, 3] {
                    bs.extend_from_slice(&v.to_be_bytes());
                }
                p.reply(opt, NBD_REP_INFO, &bs)?;
                p.reply(opt, NBD_REP_ACK, &[])
            }),
            _ => p.negotiate(),
        }
    }
}

use hostile_server::Req;

/// A hostile server for `how`: honest until `armed`, on a disk of its own.
fn server(how: Misbehaviour, armed: &Arc<AtomicBool>) -> HostileServer {
    let armed = armed.clone();
    let disk = Arc::new(Mutex::new(vec![0u8; SIZE as usize]));
    HostileServer::start(move |_, p| {
        if armed.load(Ordering::SeqCst) && how.in_handshake() {
            how.handshake(p)?;
        } else {
            p.negotiate()?;
        }
        loop {
            let r = p.request()?;
            if r.cmd == NBD_CMD_DISC {
                return Ok(());
            }
            if armed.load(Ordering::SeqCst) {
                return how.reply(p, &r, &disk);
            }
            let mut d = disk.lock().unwrap();
            p.answer(&r, &mut d)?;
        }
    })
}

/// `VmRSS` or `VmHWM` of process `pid`, in bytes.
fn status_kb(pid: u32, key: &str) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = s.lines().find(|l| l.starts_with(key)).unwrap();
    let kb: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kb << 10
}

fn client(sock: &std::path::Path, export: &str) -> Client {
    let opts = ClientOptions {
        export: export.into(),
        ..ClientOptions::default()
    };
    Client::connect(&Endpoint::Unix(sock.into()), &opts).unwrap()
}

/// Runs `f` on a thread of its own and waits for it at most `limit`: its result and how long
/// it took, or `None` past the limit (the thread is left behind; the test fails).
fn within<T: Send + 'static>(
    limit: Duration,
    f: impl FnOnce() -> T + Send + 'static,
) -> Option<(T, Duration)> {
    let (tx, rx) = mpsc::channel();
    let t = Instant::now();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(limit).ok().map(|v| (v, t.elapsed()))
}

#[test]
fn hostile_servers_neither_hold_a_request_past_its_deadline_nor_grow_the_process() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("blkq.sock");
    let armed = Arc::new(AtomicBool::new(false));
    let mut servers = Vec::new();
    let mut config = format!(
        "[server]\nsocket = \"{}\"\nno_tcp = true\n\n[[export]]\nname = \"plain\"\n\
         device = \"mem:16M\"\n",
        sock.display()
    );
    for how in ALL {
        let (proxy, leg) = (server(how, &armed), server(how, &armed));
        let (_, file) = leg_file(dir.path(), &format!("{}.img", how.name()), SIZE);
        write!(
            config,
            "\n[[export]]\nname = \"proxy-{n}\"\ndevice = \"{p}\"\n\n[[raid1]]\n\
             name = \"mirror-{n}\"\nlegs = [\"{file}\", \"{l}\"]\ncreate = true\n\
             assume_clean = true\n",
            n = how.name(),
            p = proxy.uri(DEVICE_OPTS),
            l = leg.uri(DEVICE_OPTS),
        )
        .unwrap();
        servers.push((proxy, leg));
    }
    let cfg = dir.path().join("blkq.toml");
    std::fs::write(&cfg, &config).unwrap();
    let blkq = Launch::serve(["--config".as_ref(), cfg.as_os_str()])
        .stderr_to(&dir.path().join("serve.stderr"))
        .ready_when_connects(&sock)
        .start();
    let pid = blkq.id();

    // Data on every mirror before the servers turn.
    let data: Vec<u8> = (0..IO).map(|i| (i * 7 % 251) as u8).collect();
    for how in ALL {
        let mut c = client(&sock, &format!("mirror-{}", how.name()));
        c.write(0, &data, CmdFlags::FUA).unwrap();
    }
    let before = status_kb(pid, "VmRSS:");
    armed.store(true, Ordering::SeqCst);

    // The plain export keeps serving meanwhile.
    let stop = Arc::new(AtomicBool::new(false));
    let (s2, sock2) = (stop.clone(), sock.clone());
    let plain = std::thread::spawn(move || {
        let mut c = client(&sock2, "plain");
        let mut slowest = Duration::ZERO;
        let mut n = 0u64;
        while !s2.load(Ordering::SeqCst) {
            let t = Instant::now();
            c.write(n * 4096 % (8 << 20), &[n as u8; 4096], CmdFlags::empty())
                .unwrap();
            c.read(0, 4096).unwrap();
            slowest = slowest.max(t.elapsed());
            n += 1;
            std::thread::sleep(Duration::from_millis(20));
        }
        (n, slowest)
    });

    let mut runs = Vec::new();
    for how in ALL {
        let (s, s2, d) = (sock.clone(), sock.clone(), data.clone());
        runs.push((
            how,
            std::thread::spawn(move || {
                let proxy = std::thread::spawn(move || {
                    within(REQUEST_LIMIT * 2, move || {
                        let mut c = client(&s2, &format!("proxy-{}", how.name()));
                        let t = Instant::now();
                        let r = c.read(0, IO as u64).map(drop).map_err(|e| e.to_string());
                        (r, t.elapsed())
                    })
                });
                let mirror = within(REQUEST_LIMIT * 2, move || {
                    let mut c = client(&s, &format!("mirror-{}", how.name()));
                    let t = Instant::now();
                    let w = c.write(IO as u64, &d, CmdFlags::empty());
                    let took = t.elapsed();
                    let back = c.read(0, 2 * IO as u64);
                    (w.map_err(|e| e.to_string()), took, back.ok())
                });
                (proxy.join().unwrap(), mirror)
            }),
        ));
    }
    let mut report = String::new();
    for (how, h) in runs {
        let (proxy, mirror) = h.join().unwrap();
        let Some(((read, read_took), _)) = proxy else {
            panic!("{how:?}: a read through the proxy never ended");
        };
        assert!(
            read.is_err() && read_took < REQUEST_LIMIT,
            "{how:?}: a read through the proxy ended {read:?} after {read_took:?}"
        );
        let Some(((write, took, back), _)) = mirror else {
            panic!("{how:?}: a write through the mirror never ended");
        };
        assert!(
            write.is_ok() && took < REQUEST_LIMIT,
            "{how:?}: a write through the mirror ended {write:?} after {took:?}"
        );
        let back = back.unwrap_or_else(|| panic!("{how:?}: the mirror's read failed"));
        assert!(
            back[..IO] == data[..] && back[IO..] == data[..],
            "{how:?}: the mirror lost data"
        );
        writeln!(
            report,
            "{how:?}: the proxy's read failed in {read_took:?}, the mirror's write took {took:?}"
        )
        .unwrap();
    }
    stop.store(true, Ordering::SeqCst);
    let (n, slowest) = plain.join().unwrap();
    assert!(n > 0);
    assert!(
        slowest < Duration::from_secs(1),
        "the plain export's slowest write and read took {slowest:?}"
    );
    let peak = status_kb(pid, "VmHWM:");
    eprintln!(
        "{report}plain export: {n} writes and reads, slowest {slowest:?}; RSS {} MiB before, \
         peak {} MiB",
        before >> 20,
        peak >> 20
    );
    assert!(
        peak < before + RSS_GROWTH,
        "the process grew from {} MiB to a peak of {} MiB",
        before >> 20,
        peak >> 20
    );
    let mut blkq = blkq;
    assert!(blkq.try_wait().is_none(), "blkq exited");
    drop(servers);
}
