//! The server's resource limits against hostile clients, in-process on a temporary Unix
//! socket: the handshake deadline, the connection limit, the idle timeout, bounded handshake
//! options, the global memory budget with the send timeout, and WRITE payloads that commit
//! memory only as they arrive.
//!
//! The tests measure this process's descriptors (`/proc/self/fd`) and resident memory
//! (`/proc/self/statm`), so they run one at a time (one lock); their only time limits are
//! generous deadlines (`testkit::wait_until`), never assertions about speed.
// A plain threaded test, never a loom model: its own harness may use std::sync.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]
#![cfg(not(blkq_loom))]

mod common;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread;
use std::time::Duration;

use common::served::{device, Running};
use nbd::client::{Client, ClientError, ClientOptions, Handshake};
use nbd::codec::handshake::ClientOption;
use nbd::codec::transmission::Request;
use nbd::codec::{CmdFlags, Command, TransmissionMode};
use nbd::server::{Export, Tuning};
use testkit::{wait_until, wait_until_within};

const MIB: u64 = 1 << 20;

/// One test at a time: they measure the whole process.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// Raises the soft open-files limit to the hard one (hundreds of sockets, both ends here).
fn raise_nofile() {
    // SAFETY: plain getrlimit/setrlimit on a live, exclusively borrowed struct.
    unsafe {
        let mut rl: libc::rlimit = std::mem::zeroed();
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut rl) == 0 && rl.rlim_cur < rl.rlim_max {
            rl.rlim_cur = rl.rlim_max.min(65536);
            libc::setrlimit(libc::RLIMIT_NOFILE, &rl);
        }
    }
}

/// Open descriptors of this process.
fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count())
}

/// Resident memory of this process, bytes.
fn rss() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: u64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    // SAFETY: sysconf only reads its argument.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as u64;
    pages * page
}

/// Samples the RSS every few milliseconds until dropped; `max()` is the highest seen.
struct RssWatch {
    max: Arc<std::sync::atomic::AtomicU64>,
    stop: Arc<std::sync::atomic::AtomicBool>,
    t: Option<thread::JoinHandle<()>>,
}

impl RssWatch {
    fn start() -> Self {
        use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
        let max = Arc::new(AtomicU64::new(rss()));
        let stop = Arc::new(AtomicBool::new(false));
        let (m, s) = (max.clone(), stop.clone());
        let t = thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                m.fetch_max(rss(), Ordering::Relaxed);
                thread::sleep(Duration::from_millis(5));
            }
        });
        Self {
            max,
            stop,
            t: Some(t),
        }
    }

    fn max(&self) -> u64 {
        self.max.load(std::sync::atomic::Ordering::Relaxed)
    }
}

impl Drop for RssWatch {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(t) = self.t.take() {
            let _ = t.join();
        }
    }
}

/// The server exporting a `dev` (`mem:16M`, ...) with 64 KiB receive buffers, then `tune`.
fn start(dev: &str, tune: impl FnOnce(&mut Tuning)) -> Running {
    // RUST_LOG=info shows the server's log lines.
    raise_nofile();
    Running::start(vec![Export::new("", device(dev))], |cfg| {
        cfg.tuning.recv_buf = 64 << 10;
        tune(&mut cfg.tuning);
    })
}

impl Running {
    fn simple(&self) -> Client {
        self.connect(&ClientOptions {
            structured: false,
            base_allocation: false,
            ..ClientOptions::default()
        })
    }

    /// A normal client writes and reads back.
    fn check_served(&self, seed: u8) {
        let mut c = self.connect(&ClientOptions::default());
        let data = vec![seed; 8192];
        c.write(MIB, &data, CmdFlags::empty()).unwrap();
        assert_eq!(c.read(MIB, 8192).unwrap(), data);
        c.disconnect().unwrap();
    }

    fn raw(&self) -> UnixStream {
        UnixStream::connect(&self.path).unwrap()
    }
}

/// Reads until end-of-file or an error (the server closed the socket); the read timeout is
/// only a hang guard.
fn wait_closed(s: &mut UnixStream) {
    s.set_read_timeout(Some(testkit::PROMPT)).unwrap();
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return,
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                panic!("the server did not close the socket")
            }
            Err(_) => return,
        }
    }
}

#[test]
fn silent_and_dripping_sockets_are_closed_at_the_handshake_deadline() {
    let _g = serial();
    let t = start("mem:16M", |tu| {
        tu.handshake_timeout = Duration::from_secs(1);
        tu.max_connections = 1000;
    });
    t.check_served(1);
    let base_fds = open_fds();

    // A client that sends its flags and then an option one byte at a time, slower than the
    // deadline allows for the whole option (it would take a minute).
    let mut drip = t.raw();
    let mut greeting = [0u8; 18];
    drip.read_exact(&mut greeting).unwrap();
    let mut dripper = drip.try_clone().unwrap();
    let drip_thread = thread::spawn(move || {
        let mut opt = Vec::new();
        ClientOption::List.encode(&mut opt).unwrap();
        let bytes: Vec<u8> = [0u8, 0, 0, 3].iter().chain(&opt).copied().collect();
        for _ in 0..4 {
            for b in &bytes {
                if dripper.write_all(&[*b]).is_err() {
                    return;
                }
                thread::sleep(Duration::from_millis(500));
            }
        }
    });

    let mut silent: Vec<UnixStream> = (0..300).map(|_| t.raw()).collect();
    // Served meanwhile.
    t.check_served(2);
    for s in &mut silent {
        wait_closed(s);
    }
    wait_closed(&mut drip);
    drip_thread.join().unwrap();
    drop(silent);
    drop(drip);
    wait_until("the server's connections to end", || {
        t.server().connections() == 0
    });
    wait_until("descriptors back to the baseline", || {
        open_fds() <= base_fds + 8
    });
    t.check_served(3);
}

#[test]
fn connections_over_the_limit_are_closed_at_once() {
    let _g = serial();
    let t = start("mem:16M", |tu| tu.max_connections = 4);
    let mut clients: Vec<Client> = (0..4).map(|_| t.simple()).collect();
    // The fifth is accepted and closed before the greeting.
    let mut extra = t.raw();
    extra.set_read_timeout(Some(testkit::PROMPT)).unwrap();
    let mut buf = [0u8; 18];
    assert_eq!(
        extra.read(&mut buf).unwrap_or(0),
        0,
        "no greeting past the limit"
    );
    // The four are served.
    for c in &mut clients {
        c.write(0, &[7u8; 512], CmdFlags::empty()).unwrap();
    }
    // One leaves: a new one is served.
    clients.pop().unwrap().disconnect().unwrap();
    wait_until("a connection slot to free up", || {
        t.server().connections() < 4
    });
    t.check_served(4);
    assert!(t.server().connections() <= 4);
}

#[test]
fn idle_connections_are_closed_after_the_idle_timeout() {
    let _g = serial();
    let t = start("mem:16M", |tu| {
        tu.idle_timeout = Some(Duration::from_millis(500));
    });
    let mut c = t.simple();
    c.write(0, &[1u8; 4096], CmdFlags::empty()).unwrap();
    wait_until("the idle connection to be closed", || {
        t.server().connections() == 0
    });
    assert!(c.read(0, 4096).is_err(), "the server closed it");
    t.check_served(5);
}

/// A raw option: NBD_OPT magic, `option`, `len` bytes of data.
fn raw_option(option: u32, len: usize) -> Vec<u8> {
    let mut v = Vec::with_capacity(16 + len);
    v.extend_from_slice(&nbd::codec::proto::IHAVEOPT.to_be_bytes());
    v.extend_from_slice(&option.to_be_bytes());
    v.extend_from_slice(&(len as u32).to_be_bytes());
    v.resize(16 + len, b'x');
    v
}

#[test]
fn too_many_options_or_option_bytes_close_the_connection() {
    let _g = serial();
    let t = start("mem:16M", |tu| {
        tu.max_options = 8;
        tu.max_option_bytes = 100 << 10;
    });
    // Eight unknown options are answered; the ninth closes the connection.
    let mut h = Handshake::start(t.ep.connect().unwrap()).unwrap();
    for _ in 0..8 {
        let e = h.option(&ClientOption::Other {
            option: 0x4242,
            data: b"abc",
        });
        assert!(matches!(e, Err(ClientError::OptionRefused { .. })), "{e:?}");
    }
    let e = h.option(&ClientOption::Other {
        option: 0x4242,
        data: b"abc",
    });
    assert!(matches!(e, Err(ClientError::Io(_))), "{e:?}");

    // 60 KiB options: the second goes over 100 KiB and closes the connection, before the
    // server reads its data.
    let mut h = Handshake::start(t.ep.connect().unwrap()).unwrap();
    h.stream().write_all(&raw_option(0x4242, 60 << 10)).unwrap();
    assert!(h.read_reply().is_ok());
    h.stream().write_all(&raw_option(0x4242, 60 << 10)).unwrap();
    assert!(h.read_reply().is_err());

    // An over-long option announced (skipped, normally) counts too.
    let mut h = Handshake::start(t.ep.connect().unwrap()).unwrap();
    h.stream().write_all(&raw_option(0x4242, 0)[..12]).unwrap();
    h.stream().write_all(&(1u32 << 24).to_be_bytes()).unwrap();
    assert!(h.read_reply().is_err());

    t.check_served(6);
}

#[test]
fn clients_that_never_read_their_replies_are_bounded_and_closed() {
    let _g = serial();
    const BUDGET: u64 = 256 * MIB;
    let t = start("mem:64M", |tu| {
        tu.memory_budget = BUDGET;
        tu.send_timeout = Duration::from_millis(500);
        tu.max_connections = 1000;
    });
    // Real data on the device, so that reads fill their buffers.
    let mut w = t.simple();
    let data = vec![0x5au8; 4 * MIB as usize];
    for i in 0..8 {
        w.write(i * 4 * MIB, &data, CmdFlags::empty()).unwrap();
    }
    w.disconnect().unwrap();
    let base = rss();
    let watch = RssWatch::start();

    let mut hostile: Vec<Client> = (0..32).map(|_| t.simple()).collect();
    for c in &mut hostile {
        for _ in 0..2 {
            c.send(Request::new(Command::Read, 0, 0, 32 * MIB), &[])
                .unwrap();
        }
    }
    wait_until("the server to close the clients that do not read", || {
        t.server().connections() == 0
    });
    wait_until("the memory budget to be given back", || {
        t.server().memory_in_use() == 0
    });
    let peak = watch.max().saturating_sub(base);
    drop(watch);
    eprintln!("peak RSS growth {} MiB", peak / MIB);
    // Without the budget: 32 connections x 64 MiB of replies. The margin is the connections'
    // fixed costs (about 2 MiB each: tables, receive buffers, thread stacks, allocator arenas).
    assert!(
        peak < BUDGET + 160 * MIB,
        "RSS grew by {} MiB with a {} MiB budget",
        peak / MIB,
        BUDGET / MIB
    );
    for mut c in hostile {
        // Whatever was in the socket, then the end.
        while c.recv().is_ok() {}
    }
    t.check_served(7);
}

#[test]
fn stalled_write_payloads_commit_only_what_arrived() {
    let _g = serial();
    let t = start("mem:64M", |tu| {
        tu.max_connections = 1000;
        // Nothing closes them during the test.
        tu.send_timeout = Duration::from_secs(600);
        tu.memory_budget = 1 << 40;
        tu.slots = 64;
    });
    t.check_served(8);
    let base = rss();
    let mut stalled = Vec::new();
    for _ in 0..200 {
        let mut c = t.simple();
        let mut req = Vec::new();
        Request::new(Command::Write, 0, 0, 32 * MIB)
            .encode(TransmissionMode::Simple, &mut req)
            .unwrap();
        req.extend_from_slice(&[0xa5u8; 4096]);
        c.send_raw(&req).unwrap();
        stalled.push(c);
    }
    // Every header is taken in (its budget reserved), its payload partly received.
    wait_until_within(
        "the server to take in every stalled write",
        Duration::from_secs(60),
        || t.server().memory_in_use() == 200 * 32 * MIB,
    );
    // Let the payload bytes land.
    thread::sleep(Duration::from_millis(200));
    let grown = rss().saturating_sub(base);
    eprintln!("RSS growth {} MiB", grown / MIB);
    assert!(
        grown < 64 * MIB,
        "200 stalled 32 MiB writes grew the server by {} MiB",
        grown / MIB
    );
    drop(stalled);
    wait_until("the stalled connections to end", || {
        t.server().connections() == 0
    });
    assert_eq!(t.server().memory_in_use(), 0);
    t.check_served(9);
}

#[test]
fn a_payload_stalled_past_the_send_timeout_closes_the_connection() {
    let _g = serial();
    let t = start("mem:64M", |tu| {
        tu.send_timeout = Duration::from_millis(300);
    });
    let mut c = t.simple();
    let mut req = Vec::new();
    Request::new(Command::Write, 0, 0, 4 * MIB)
        .encode(TransmissionMode::Simple, &mut req)
        .unwrap();
    req.extend_from_slice(&[1u8; 1000]);
    c.send_raw(&req).unwrap();
    wait_until("the stalled write's connection to be closed", || {
        t.server().connections() == 0
    });
    assert_eq!(t.server().memory_in_use(), 0);
    t.check_served(10);
}

/// Sets the soft open-files limit; returns the old one.
fn set_nofile(soft: u64) -> u64 {
    // SAFETY: plain getrlimit/setrlimit on a live, exclusively borrowed struct.
    unsafe {
        let mut rl: libc::rlimit = std::mem::zeroed();
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut rl), 0);
        let old = rl.rlim_cur;
        rl.rlim_cur = soft.min(rl.rlim_max);
        assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &rl), 0);
        old
    }
}

#[test]
fn out_of_descriptors_refuses_new_connections_and_keeps_serving() {
    let _g = serial();
    let t = start("mem:16M", |_| {});
    let mut live = t.simple();
    live.write(0, &[3u8; 4096], CmdFlags::empty()).unwrap();
    let base = open_fds();
    // Room for a couple of descriptors more: new connections run out of them somewhere
    // (the client's socket, the server's accept, or the server's handle on the connection).
    let old = set_nofile(base as u64 + 3);
    let extra: Vec<UnixStream> = (0..6)
        .filter_map(|_| UnixStream::connect(&t.path).ok())
        .collect();
    // Give the acceptor time to run into the limit (and log it); nothing to assert on time.
    thread::sleep(Duration::from_millis(300));
    // The existing connection is served throughout.
    live.write(8192, &[4u8; 4096], CmdFlags::empty()).unwrap();
    assert_eq!(live.read(0, 4096).unwrap(), vec![3u8; 4096]);
    set_nofile(old);
    drop(extra);
    assert_eq!(live.read(8192, 4096).unwrap(), vec![4u8; 4096]);
    live.disconnect().unwrap();
    t.check_served(11);
    wait_until("the refused connections' descriptors to be closed", || {
        t.server().connections() == 0 && open_fds() <= base
    });
}

/// Block-status requests take memory for the extents they may answer (1024 per context,
/// reserved before the device is asked): they count in the memory budget as reads do. A
/// client that stops reading after a 32 MiB read, then queues a thousand block-status
/// requests, holds the read's 32 MiB and, for the block-status requests, at most what is
/// left of the budget.
#[test]
fn block_status_requests_count_in_the_memory_budget() {
    let _g = serial();
    const BUDGET: u64 = 36 * MIB;
    let t = start("mem:64M", |tu| {
        tu.memory_budget = BUDGET;
        tu.send_timeout = Duration::from_secs(600);
    });
    // Real data, so that the read's reply carries it (a hole would be a few bytes).
    let mut w = t.simple();
    let data = vec![0x5au8; 4 * MIB as usize];
    for i in 0..8 {
        w.write(i * 4 * MIB, &data, CmdFlags::empty()).unwrap();
    }
    w.disconnect().unwrap();
    let mut c = Client::connect(&t.ep, &ClientOptions::default()).unwrap();
    // In one send (the server's connection thread stops reading while a reply it cannot send
    // blocks it): a read whose reply fills the socket, so that the replies after it wait in
    // the server, in flight; then the block-status requests.
    let mut batch = Vec::new();
    Request::new(Command::Read, 1, 0, 32 * MIB)
        .encode(c.mode(), &mut batch)
        .unwrap();
    for k in 0..1000 {
        Request::new(Command::BlockStatus, 2 + k, 0, 64 * MIB)
            .encode(c.mode(), &mut batch)
            .unwrap();
    }
    c.send_raw(&batch).unwrap();
    let mut most = 0;
    let until = std::time::Instant::now() + Duration::from_secs(5);
    while most <= 32 * MIB && std::time::Instant::now() < until {
        most = most.max(t.server().memory_in_use());
        thread::sleep(Duration::from_millis(10));
    }
    assert!(
        most > 32 * MIB,
        "1000 queued block-status requests: {most} bytes of the budget in use (the read's 32 \
         MiB only)"
    );
    thread::sleep(Duration::from_millis(200));
    let now = t.server().memory_in_use();
    assert!(
        now <= BUDGET,
        "{now} bytes of a {BUDGET}-byte budget in use"
    );
    // The client goes away: the server gives everything back.
    drop(c);
    wait_until("the memory budget to be given back", || {
        t.server().memory_in_use() == 0
    });
    t.check_served(12);
}
