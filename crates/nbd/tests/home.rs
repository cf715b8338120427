//! Large writes received into their home (`server/conn/home.rs`): on a plaintext connection
//! to a `mem:` export, a large write's payload goes from the socket into the device with no
//! bio. The bytes must be the client's in every mode over Unix and TCP; FUA writes, small
//! writes, `splice=0` and TLS-less-capable devices take the bio path; read-only and
//! out-of-range writes take no byte; a client gone mid-payload leaves no receiver counted, no
//! memory budget held, and a trim of the region completes.
// A plain threaded test, never a loom model.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]
#![cfg(not(blkq_loom))]

mod common;

use std::collections::HashMap;
use std::sync::Arc;

use blk::{Device, Queue, QueueConfig, RecvSource};
use blk_drivers::{Backend, BackendDriver, MapBackend};
use common::hooks::CountHome;
use common::modes;
use common::served::{device, Running};
use nbd::client::{Client, ClientError, ClientOptions, Endpoint};
use nbd::codec::transmission::Request;
use nbd::codec::{CmdFlags, Command};
use nbd::server::{Export, Server};
use testkit::{pattern, wait_until, Forward, Hook};

const MIB: u64 = 1 << 20;
const NBD_EPERM: u32 = 1;
const NBD_ENOSPC: u32 = 28;
const NBD_CMD_WRITE: u16 = 1;

/// The server on a Unix socket and on TCP, its export's device counting the writes received
/// home.
struct Setup {
    run: Running,
    unix: Endpoint,
    tcp: Endpoint,
    dev: Arc<Forward<CountHome>>,
}

impl Setup {
    fn new(inner: Arc<dyn Device>, read_only: bool) -> Self {
        Self::with_send_timeout(inner, read_only, None)
    }

    fn with_send_timeout(
        inner: Arc<dyn Device>,
        read_only: bool,
        send_timeout: Option<std::time::Duration>,
    ) -> Self {
        let dev = Arc::new(Forward::with_hook(inner, CountHome::default()));
        let export = Export::new("", dev.clone() as Arc<dyn Device>).read_only(read_only);
        let run = Running::start(vec![export], |cfg| {
            cfg.tcp = Some("127.0.0.1:0".parse().unwrap());
            if let Some(t) = send_timeout {
                cfg.tuning.send_timeout = t;
            }
        });
        Self {
            unix: run.ep.clone(),
            tcp: run.tcp(),
            run,
            dev,
        }
    }

    fn homed(&self) -> usize {
        self.dev.hook().count()
    }

    fn server(&self) -> &Server {
        self.run.server()
    }
}

/// A `mem:` queue over a store the test keeps a handle on.
fn map_device(size: u64) -> (Arc<MapBackend>, Arc<dyn Device>) {
    let be = Arc::new(MapBackend::new(size).unwrap());
    let driver = BackendDriver::new("mem", be.clone() as Arc<dyn Backend>);
    let q = Queue::new(QueueConfig::new(size), Box::new(driver)).unwrap();
    (be, Arc::new(q))
}

fn connect(ep: &Endpoint, opts: &ClientOptions) -> Client {
    Client::connect(ep, opts).unwrap()
}

/// Pipelined writes of `(offset, len, seed)`, all answered without error.
fn write_all(c: &mut Client, writes: &[(u64, u64, u64)], flags: CmdFlags) {
    let mut want = HashMap::new();
    for &(off, len, seed) in writes {
        let mut req = Request::new(Command::Write, 0, off, len);
        req.flags = flags;
        let cookie = c.send(req, &pattern(seed, len as usize)).unwrap();
        want.insert(cookie, off);
    }
    while !want.is_empty() {
        let r = c.recv().unwrap();
        let off = want.remove(&r.cookie).expect("unknown cookie");
        assert_eq!(r.error, 0, "write at {off}");
    }
}

fn check_all(c: &mut Client, writes: &[(u64, u64, u64)], what: &str) {
    for &(off, len, seed) in writes {
        assert!(
            c.read(off, len).unwrap() == pattern(seed, len as usize),
            "{what}: the write at {off}+{len} reads back different"
        );
    }
}

#[test]
fn large_writes_go_home_and_read_back_in_every_mode() {
    let t = Setup::new(device("mem:64M"), false);
    let mut seed = 0;
    for ep in [&t.unix, &t.tcp] {
        for (name, opts) in modes() {
            let what = format!("{ep:?} {name}");
            let mut c = connect(ep, &opts);
            let before = t.homed();
            // Aligned, unaligned (512), several MiB in one write, back to back and pipelined.
            let mut writes = Vec::new();
            for (i, (off, len)) in [
                (0, MIB),
                (MIB + 512, MIB),
                (3 * MIB - 4096, 3 * MIB),
                (7 * MIB, 128 << 10),
                (8 * MIB + 1024, 1536 << 10),
                (12 * MIB, MIB),
            ]
            .into_iter()
            .enumerate()
            {
                seed += 1;
                writes.push((off + (i as u64 % 2) * 512, len, seed));
            }
            write_all(&mut c, &writes, CmdFlags::empty());
            check_all(&mut c, &writes, &what);
            // Every large write after the first is received home (the first may find part
            // of its payload in the receive buffer with its header, and is then copied).
            let homed = t.homed() - before;
            assert!(
                homed >= writes.len() - 1,
                "{what}: {homed} of {} writes received home",
                writes.len()
            );
            c.disconnect().unwrap();
        }
    }
}

#[test]
fn fua_small_and_splice_0_writes_take_the_bio_path() {
    let t = Setup::new(device("mem:64M"), false);
    let mut c = connect(&t.unix, &ClientOptions::default());
    // Into home mode first.
    write_all(&mut c, &[(0, MIB, 1), (MIB, MIB, 2)], CmdFlags::empty());
    let before = t.homed();
    assert!(before >= 1);
    let fua = [(4 * MIB, MIB, 3), (5 * MIB + 512, MIB, 4)];
    write_all(&mut c, &fua, CmdFlags::FUA);
    let small = [(8 * MIB, 64 << 10, 5), (9 * MIB, 4096, 6)];
    write_all(&mut c, &small, CmdFlags::empty());
    assert_eq!(t.homed(), before, "FUA or small writes were received home");
    check_all(&mut c, &fua, "FUA");
    check_all(&mut c, &small, "small");
    c.disconnect().unwrap();

    let t = Setup::new(device("mem:64M,splice=0"), false);
    let mut c = connect(&t.tcp, &ClientOptions::default());
    let writes = [(0, MIB, 7), (MIB, MIB, 8), (2 * MIB + 512, 2 * MIB, 9)];
    write_all(&mut c, &writes, CmdFlags::empty());
    check_all(&mut c, &writes, "splice=0");
    assert_eq!(t.homed(), 0, "splice=0 received a write home");
    c.disconnect().unwrap();
}

#[test]
fn refused_writes_take_no_byte() {
    // Read-only: EPERM, nothing lands; the connection goes on.
    let t = Setup::new(device("mem:16M"), true);
    let mut c = connect(&t.unix, &ClientOptions::default());
    for i in 0..3 {
        let r = c.request(
            Request::new(Command::Write, 0, i * MIB, MIB),
            &pattern(i, MIB as usize),
        );
        assert!(matches!(r, Err(ClientError::Request(NBD_EPERM))), "{r:?}");
    }
    assert!(c.read(0, 3 * MIB).unwrap().iter().all(|&b| b == 0));
    assert_eq!(t.homed(), 0);
    c.disconnect().unwrap();

    // Out of range, in home mode: ENOSPC, nothing lands at the end of the device, and the
    // next write (whose header follows the refused payload) is whole.
    let t = Setup::new(device("mem:16M"), false);
    let mut c = connect(&t.unix, &ClientOptions::default());
    write_all(&mut c, &[(0, MIB, 1), (MIB, MIB, 2)], CmdFlags::empty());
    let r = c.request(
        Request::new(Command::Write, 0, 16 * MIB - MIB / 2, MIB),
        &pattern(3, MIB as usize),
    );
    assert!(matches!(r, Err(ClientError::Request(NBD_ENOSPC))), "{r:?}");
    assert!(c.read(15 * MIB, MIB).unwrap().iter().all(|&b| b == 0));
    write_all(&mut c, &[(4 * MIB, MIB, 4)], CmdFlags::empty());
    check_all(
        &mut c,
        &[(0, MIB, 1), (MIB, MIB, 2), (4 * MIB, MIB, 4)],
        "after",
    );
    c.disconnect().unwrap();
}

#[test]
fn a_client_gone_mid_payload_leaves_no_receiver_and_the_trim_completes() {
    let (be, dev) = map_device(16 * MIB);
    let t = Setup::new(dev, false);
    for ep in [&t.unix, &t.tcp] {
        let mut c = connect(ep, &ClientOptions::default());
        write_all(&mut c, &[(0, MIB, 1), (MIB, MIB, 2)], CmdFlags::empty());
        let before = t.homed();
        let allocated = be.allocated_bytes();
        // A write of 2 MiB at 4 MiB, of which the client sends 300000 bytes, then goes.
        let data = pattern(3, 300_000);
        c.send_raw_request(NBD_CMD_WRITE, CmdFlags::empty(), 4 * MIB, 2 * MIB)
            .unwrap();
        c.send_raw(&data).unwrap();
        drop(c);
        wait_until("the connection to end", || t.server().connections() == 0);
        assert!(t.homed() > before, "the write was not received home");
        assert!(be.allocated_bytes() > allocated, "nothing of it landed");
        assert_eq!(be.receivers_in_flight(), 0, "the receiver count leaked");
        assert_eq!(t.server().memory_in_use(), 0, "the write's budget leaked");
        // The torn write's bytes are there; a trim of the region completes and zeroes them.
        let mut c = connect(ep, &ClientOptions::default());
        let got = c.read(4 * MIB, 299_520).unwrap();
        let landed = got.iter().zip(&data).take_while(|(a, b)| a == b).count();
        assert!(landed > 0, "none of the received bytes landed");
        c.trim(4 * MIB, 2 * MIB).unwrap();
        assert!(c.read(4 * MIB, 2 * MIB).unwrap().iter().all(|&b| b == 0));
        check_all(&mut c, &[(0, MIB, 1), (MIB, MIB, 2)], "the writes before");
        c.disconnect().unwrap();
    }
}

#[test]
fn buffered_file_writes_are_spliced_into_the_page_cache() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("disk.img");
    std::fs::File::create(&img)
        .unwrap()
        .set_len(32 * MIB)
        .unwrap();
    let t = Setup::new(device(&format!("file:{}", img.display())), false);
    let mut seed = 100;
    for ep in [&t.unix, &t.tcp] {
        for (name, opts) in modes() {
            let mut c = connect(ep, &opts);
            let before = t.homed();
            let mut writes = Vec::new();
            for (off, len) in [
                (0, MIB),
                (MIB + 512, 2 * MIB),
                (4 * MIB, 256 << 10),
                (5 * MIB, MIB),
            ] {
                seed += 1;
                writes.push((off, len, seed));
            }
            write_all(&mut c, &writes, CmdFlags::empty());
            check_all(&mut c, &writes, &format!("{ep:?} {name}"));
            // What the file holds, read past the server.
            c.flush().unwrap();
            let on_disk = std::fs::read(&img).unwrap();
            for &(off, len, seed) in &writes {
                assert!(
                    on_disk[off as usize..(off + len) as usize] == pattern(seed, len as usize)[..],
                    "{ep:?} {name}: the file differs at {off}+{len}"
                );
            }
            assert!(t.homed() - before >= writes.len() - 1, "{ep:?} {name}");
            c.disconnect().unwrap();
        }
    }
}

/// Receives the first half of each write received home into the device, then fails: a device
/// error in the middle of a payload.
struct FailsHalfway;

impl Hook for FailsHalfway {
    fn transparent(&self) -> bool {
        true
    }
    fn recv_home(
        &self,
        inner: &dyn Device,
        offset: u64,
        len: usize,
        src: &mut dyn RecvSource,
    ) -> Result<(), blk::Error> {
        inner.recv_home(offset, len / 2, src)?;
        Err(blk::Error::Io(std::io::Error::from_raw_os_error(libc::EIO)))
    }
}

#[test]
fn a_device_failing_mid_payload_answers_the_write_and_the_connection_goes_on() {
    let dev: Arc<dyn Device> = Arc::new(Forward::with_hook(device("mem:16M"), FailsHalfway));
    let mut t = Running::start(vec![Export::new("", dev)], |_| {});
    for (name, opts) in modes() {
        let mut c = connect(&t.ep, &opts);
        // Pipelined: the first may be copied (it succeeds); the next ones are received home
        // and fail with EIO, their second halves discarded; the small writes after them (whose
        // headers follow the discarded bytes) succeed.
        let mut want = HashMap::new();
        for i in 0..4u64 {
            let cookie = c
                .send(
                    Request::new(Command::Write, 0, i * MIB, MIB),
                    &pattern(i, MIB as usize),
                )
                .unwrap();
            want.insert(cookie, i);
        }
        for i in 0..4u64 {
            let small = c
                .send(
                    Request::new(Command::Write, 0, 8 * MIB + i * 4096, 4096),
                    &[7u8; 4096],
                )
                .unwrap();
            want.insert(small, 100);
        }
        let mut failed = 0;
        while !want.is_empty() {
            let r = match c.recv() {
                Ok(r) => r,
                Err(e) => panic!("{name}: {e}"),
            };
            let i = want.remove(&r.cookie).unwrap();
            if i == 100 {
                assert_eq!(r.error, 0, "{name}: a small write failed");
            } else if r.error != 0 {
                assert_eq!(r.error, libc::EIO as u32, "{name}");
                failed += 1;
            }
        }
        assert!(failed >= 3, "{name}: {failed} writes failed");
        assert!(c.read(8 * MIB, 4 * 4096).unwrap().iter().all(|&b| b == 7));
        c.disconnect().unwrap();
    }
    t.take().shutdown();
}

#[test]
fn a_client_stalling_mid_payload_is_timed_out_and_leaves_no_receiver() {
    // The mid-request timeout (the send timeout) applies to a payload received home as to a
    // buffered one: a client that stops halfway and stays connected is closed.
    let (be, dev) = map_device(16 * MIB);
    let t = Setup::with_send_timeout(dev, false, Some(std::time::Duration::from_millis(400)));
    for ep in [&t.unix, &t.tcp] {
        let mut c = connect(ep, &ClientOptions::default());
        write_all(&mut c, &[(0, MIB, 1), (MIB, MIB, 2)], CmdFlags::empty());
        let before = t.homed();
        c.send_raw_request(NBD_CMD_WRITE, CmdFlags::empty(), 4 * MIB, 2 * MIB)
            .unwrap();
        c.send_raw(&pattern(3, 200_000)).unwrap();
        // The client keeps its socket open and sends nothing more.
        wait_until("the server to close the stalled connection", || {
            t.server().connections() == 0
        });
        assert!(t.homed() > before, "the write was not received home");
        assert_eq!(be.receivers_in_flight(), 0, "the receiver count leaked");
        assert_eq!(t.server().memory_in_use(), 0, "the write's budget leaked");
        drop(c);
        let mut c = connect(ep, &ClientOptions::default());
        c.trim(4 * MIB, 2 * MIB).unwrap();
        check_all(&mut c, &[(0, MIB, 1), (MIB, MIB, 2)], "the writes before");
        c.disconnect().unwrap();
    }
}
