//! The NBD server, in-process on a temporary Unix socket, driven by `nbd::client`.
// A plain threaded test or benchmark, never a loom model: its own harness (std locks, atomics,
// condition variables, baselines) is not what a model must explore, so it may use std::sync.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]
#![cfg(not(blkq_loom))]

mod common;

use std::io::{Read, Write};
use std::sync::Arc;
use std::time::Duration;

use blk::{Bio, BioFlags, Device, Op};
use common::modes;
use common::served::{device, Running};
use nbd::client::{Client, ClientError, ClientOptions, Endpoint};
use nbd::codec::handshake::{ClientOption, ExportRequest};
use nbd::codec::proto::*;
use nbd::codec::transmission::Request;
use nbd::codec::{CmdFlags, Command, TransmissionFlags, TransmissionMode};
use nbd::server::{Export, Server, ServerConfig, Tuning};
use testkit::{pattern, Forward, Hook};

const MIB: u64 = 1 << 20;

/// A device wrapper that fails fast zeroes with ENOTSUP (as a backend that cannot zero
/// quickly would) and reads of the first sector of `eio_at` with EIO.
fn picky(inner: Arc<dyn Device>, eio_at: u64) -> Forward<impl Hook> {
    Forward::on_submit(inner, move |inner, bio, end| {
        if bio.op == Op::WriteZeroes && bio.flags.contains(BioFlags::FAST_ZERO) {
            end.end_io(bio, Err(blk::Error::NotSupported("fast zero")));
        } else if bio.op == Op::Read && bio.offset() == eio_at {
            end.end_io(
                bio,
                Err(blk::Error::Io(
                    std::io::Error::from_raw_os_error(libc_eio()),
                )),
            );
        } else {
            inner.submit(bio, end);
        }
    })
}

fn libc_eio() -> i32 {
    5
}

/// The server with this file's tuning: 64 KiB receive buffers, a 64 MiB discard limit.
/// The server with this file's tuning (64 KiB receive buffers, a 64 MiB discard limit).
fn serve(exports: Vec<Export>) -> Running {
    serve_tuned(exports, |_| {})
}

/// [`serve`], then `tune`.
fn serve_tuned(exports: Vec<Export>, tune: impl FnOnce(&mut Tuning)) -> Running {
    // RUST_LOG=debug shows the server's log lines.
    Running::start(exports, |cfg| {
        cfg.tuning.recv_buf = 64 << 10;
        cfg.tuning.discard_limit = 64 << 20;
        tune(&mut cfg.tuning);
    })
}

fn default_server() -> Running {
    serve(vec![
        Export::new("", device("mem:64M")).description("scratch"),
        Export::new("ro", device("mem:16M"))
            .description("read-only")
            .read_only(true),
        Export::new("picky", Arc::new(picky(device("mem:16M"), 8 * MIB))),
    ])
}

fn expect_err(r: Result<impl std::fmt::Debug, ClientError>, want: u32, what: &str) {
    match r {
        Err(ClientError::Request(e)) => assert_eq!(e, want, "{what}: wrong error"),
        other => panic!("{what}: expected error {want}, got {other:?}"),
    }
}

#[test]
fn handshake_variants() {
    let t = default_server();

    // LIST.
    let mut h = t.handshake();
    assert!(h
        .server_flags()
        .contains(nbd::codec::HandshakeFlags::FIXED_NEWSTYLE));
    assert!(h
        .server_flags()
        .contains(nbd::codec::HandshakeFlags::NO_ZEROES));
    let mut list = h.list().unwrap();
    list.sort();
    assert_eq!(
        list,
        vec![
            ("".to_string(), "scratch".to_string()),
            ("picky".to_string(), String::new()),
            ("ro".to_string(), "read-only".to_string()),
        ]
    );

    // INFO: size, flags, block sizes, name, description.
    let d = h.info("").unwrap();
    assert_eq!(d.size, 64 * MIB);
    let want = TransmissionFlags::HAS_FLAGS
        | TransmissionFlags::SEND_FLUSH
        | TransmissionFlags::SEND_FUA
        | TransmissionFlags::SEND_TRIM
        | TransmissionFlags::SEND_WRITE_ZEROES
        | TransmissionFlags::SEND_FAST_ZERO
        | TransmissionFlags::SEND_CACHE
        | TransmissionFlags::CAN_MULTI_CONN;
    assert_eq!(d.flags, want, "no DF before structured replies");
    let bs = d.block_size.unwrap();
    assert_eq!((bs.min, bs.preferred, bs.max), (512, 4096, 32 << 20));
    assert_eq!(d.name.as_deref(), Some(""));
    assert_eq!(d.description.as_deref(), Some("scratch"));
    let ro = h.info("ro").unwrap();
    assert!(ro.flags.contains(TransmissionFlags::READ_ONLY));

    // Unknown option: ERR_UNSUP, and the handshake goes on.
    let e = h
        .option(&ClientOption::Other {
            option: 0x4242,
            data: b"xyz",
        })
        .unwrap_err();
    assert_eq!(e.option_error(), Some(NBD_REP_ERR_UNSUP));
    // STARTTLS: ERR_POLICY.
    let e = h.option(&ClientOption::StartTls).unwrap_err();
    assert_eq!(e.option_error(), Some(NBD_REP_ERR_POLICY));
    // Unknown export: ERR_UNKNOWN for INFO and GO.
    let e = h.info("nope").unwrap_err();
    assert_eq!(e.option_error(), Some(NBD_REP_ERR_UNKNOWN));
    let e = h.go("nope").unwrap_err();
    assert_eq!(e.option_error(), Some(NBD_REP_ERR_UNKNOWN));
    // SET_META_CONTEXT before structured replies: ERR_INVALID.
    let e = h.meta_context("", &["base:allocation"], true).unwrap_err();
    assert_eq!(e.option_error(), Some(NBD_REP_ERR_INVALID));
    // LIST_META_CONTEXT: base:allocation, for no query and for "base:".
    assert_eq!(
        h.meta_context("", &[], false).unwrap(),
        vec![(0, "base:allocation".to_string())]
    );
    assert_eq!(
        h.meta_context("", &["base:", "x-other:thing"], false)
            .unwrap(),
        vec![(0, "base:allocation".to_string())]
    );
    // A malformed option (LIST with data) is ERR_INVALID.
    let e = h
        .option(&ClientOption::Other {
            option: NBD_OPT_LIST,
            data: b"junk",
        })
        .unwrap_err();
    assert_eq!(e.option_error(), Some(NBD_REP_ERR_INVALID));
    // Then GO works.
    h.structured_replies().unwrap();
    let ids = h
        .meta_context("", &["base:allocation", "base:"], true)
        .unwrap();
    assert_eq!(ids, vec![(1, "base:allocation".to_string())]);
    let d = h.go("").unwrap();
    assert!(d.flags.contains(TransmissionFlags::SEND_DF));
    let mut c = h.into_client(d).unwrap();
    c.write(0, &[7u8; 4096], CmdFlags::empty()).unwrap();
    assert_eq!(c.read(0, 4096).unwrap(), vec![7u8; 4096]);
    assert_eq!(c.block_status(0, 8192, CmdFlags::empty()).unwrap().len(), 2);
    c.disconnect().unwrap();

    // EXPORT_NAME, with and without structured replies.
    for structured in [false, true] {
        let mut c = t.connect(&ClientOptions {
            structured,
            base_allocation: false,
            export_name: true,
            ..ClientOptions::default()
        });
        assert_eq!(c.size(), 64 * MIB);
        assert_eq!(c.read(0, 4096).unwrap(), vec![7u8; 4096]);
        c.disconnect().unwrap();
    }
    // EXPORT_NAME of an unknown export: the server closes the connection.
    let mut h = t.handshake();
    h.send_option(&ClientOption::ExportName("nope")).unwrap();
    let mut b = [0u8; 1];
    assert_eq!(h.stream().read(&mut b).unwrap(), 0);

    // Extended headers, then GO.
    let mut h = t.handshake();
    h.extended_headers().unwrap();
    let e = h.option(&ClientOption::StructuredReply).unwrap_err();
    assert_eq!(e.option_error(), Some(NBD_REP_ERR_EXT_HEADER_REQD));
    h.meta_context("", &["base:allocation"], true).unwrap();
    let d = h.go("").unwrap();
    let mut c = h.into_client(d).unwrap();
    assert_eq!(c.mode(), TransmissionMode::Extended);
    assert_eq!(c.read(0, 4096).unwrap(), vec![7u8; 4096]);
    c.disconnect().unwrap();

    // ABORT.
    let h = t.handshake();
    h.abort().unwrap();
}

#[test]
fn round_trips_pipelined_in_every_mode() {
    let t = default_server();
    // Sizes up to 3 MiB: larger than the device's 1 MiB maximum I/O, so split into bios, and
    // larger than the 64 KiB receive buffer, so read straight into their buffers.
    let sizes = [512u64, 4096, 8192, 65536, 131072, 1 << 20, 3 << 20];
    for (m, (name, opts)) in modes().into_iter().enumerate() {
        let mut c = t.connect(&opts);
        let base = m as u64 * 20 * MIB;
        let mut at = base;
        let mut regions = Vec::new();
        for i in 0..120u64 {
            let len = sizes[(i as usize * 7) % sizes.len()];
            regions.push((at, len, pattern(i + 1000 * m as u64, len as usize)));
            at += len + 4096;
        }
        assert!(at < base + 20 * MIB, "{name}: regions overflow");
        // All writes pipelined, replies in any order.
        let mut cookies = std::collections::HashSet::new();
        for (off, len, data) in &regions {
            let req = Request::new(Command::Write, 0, *off, *len);
            cookies.insert(c.send(req, data).unwrap());
        }
        while !cookies.is_empty() {
            let r = c.recv().unwrap();
            assert_eq!(r.error, 0, "{name}: write failed");
            assert!(cookies.remove(&r.cookie));
        }
        // All reads pipelined; check data by cookie.
        let mut want = std::collections::HashMap::new();
        for (i, (off, len, _)) in regions.iter().enumerate() {
            let cookie = c
                .send(Request::new(Command::Read, 0, *off, *len), &[])
                .unwrap();
            want.insert(cookie, i);
        }
        while !want.is_empty() {
            let r = c.recv().unwrap();
            let i = want.remove(&r.cookie).expect("unknown cookie");
            assert_eq!(r.error, 0, "{name}: read failed");
            assert!(r.data == regions[i].2, "{name}: region {i} differs");
        }
        // A read spanning written data and the unwritten gap after it.
        let (off, len, data) = &regions[1];
        let got = c.read(*off, len + 4096).unwrap();
        assert_eq!(&got[..*len as usize], &data[..]);
        assert!(got[*len as usize..].iter().all(|&b| b == 0));
        c.disconnect().unwrap();
    }
}

#[test]
fn sparse_reads_and_block_status() {
    let t = default_server();
    let mut c = t.connect(&ClientOptions::default());
    let off = 32 * MIB;
    c.write(off + 4096, &[1u8; 8192], CmdFlags::FUA).unwrap();
    // Hole, data, hole: three chunks, holes sent as OFFSET_HOLE.
    let r = c
        .request(Request::new(Command::Read, 0, off, 65536), &[])
        .unwrap();
    assert_eq!(r.hole_chunks, 2);
    assert_eq!(r.data_chunks, 1);
    assert!(r.data[..4096].iter().all(|&b| b == 0));
    assert!(r.data[4096..12288].iter().all(|&b| b == 1));
    assert!(r.data[12288..].iter().all(|&b| b == 0));
    // DF: one data chunk, zeros included.
    let r = c
        .request(
            Request::new(Command::Read, 0, off, 65536).with_flags(CmdFlags::DF),
            &[],
        )
        .unwrap();
    assert_eq!((r.data_chunks, r.hole_chunks), (1, 0));
    assert!(r.data[4096..12288].iter().all(|&b| b == 1));
    // Block status.
    let hole = u64::from(NBD_STATE_HOLE | NBD_STATE_ZERO);
    let ext = c.block_status(off, 65536, CmdFlags::empty()).unwrap();
    assert_eq!(ext, vec![(4096, hole), (8192, 0), (65536 - 12288, hole)]);
    let one = c.block_status(off, 65536, CmdFlags::REQ_ONE).unwrap();
    assert_eq!(one, vec![(4096, hole)]);
    // Trim and zero read back as zeros.
    c.trim(off + 4096, 4096).unwrap();
    c.write_zeroes(off + 8192, 4096, CmdFlags::NO_HOLE).unwrap();
    assert!(c.read(off, 65536).unwrap().iter().all(|&b| b == 0));
    c.write_zeroes(off, MIB, CmdFlags::FAST_ZERO).unwrap();
    c.flush().unwrap();
    c.request(Request::new(Command::Cache, 0, off, 65536), &[])
        .unwrap();
    c.disconnect().unwrap();

    // Extended headers: 64-bit block status over the whole disk.
    let mut c = t.connect(&ClientOptions {
        extended: true,
        ..ClientOptions::default()
    });
    let ext = c.block_status(0, 64 * MIB, CmdFlags::empty()).unwrap();
    assert_eq!(ext.iter().map(|e| e.0).sum::<u64>(), 64 * MIB);
    c.disconnect().unwrap();
}

/// A device whose allocation map costs I/O ([`blk::Caps::slow_extents`]: a remote export)
/// is never asked it on a read: its holes reach the client as data (zeros). Block status
/// still asks it. A filter over `mem:` that declares the cost and counts the asks.
#[test]
fn a_device_with_a_slow_map_gets_no_sparse_reads() {
    use blk::{Caps, Extent, Filter};
    use std::sync::atomic::{AtomicUsize, Ordering};

    struct SlowMap(Arc<dyn Device>, AtomicUsize);
    impl Filter for SlowMap {
        fn lower(&self) -> &dyn Device {
            self.0.as_ref()
        }
        fn caps(&self) -> Caps {
            Caps {
                slow_extents: true,
                ..self.0.caps()
            }
        }
        fn extents_into(
            &self,
            offset: u64,
            len: u64,
            max: usize,
            out: &mut Vec<Extent>,
        ) -> Result<(), blk::Error> {
            self.1.fetch_add(1, Ordering::Relaxed);
            self.0.extents_into(offset, len, max, out)
        }
    }

    let dev = Arc::new(SlowMap(device("mem:16M"), AtomicUsize::new(0)));
    let t = serve(vec![Export::new("", dev.clone())]);
    let mut c = t.connect(&ClientOptions::default());
    c.write(4096, &[1u8; 8192], CmdFlags::FUA).unwrap();
    let r = c
        .request(Request::new(Command::Read, 0, 0, 65536), &[])
        .unwrap();
    assert_eq!((r.data_chunks, r.hole_chunks), (1, 0), "holes read as data");
    assert!(r.data[4096..12288].iter().all(|&b| b == 1));
    assert!(r.data[12288..].iter().all(|&b| b == 0));
    assert_eq!(dev.1.load(Ordering::Relaxed), 0, "a read asked for the map");
    let ext = c.block_status(0, 65536, CmdFlags::empty()).unwrap();
    assert_eq!(ext.iter().map(|e| e.0).sum::<u64>(), 65536);
    assert!(
        dev.1.load(Ordering::Relaxed) >= 1,
        "block status asks for the map"
    );
    c.disconnect().unwrap();
}

#[test]
fn every_error_then_the_connection_still_works() {
    let t = default_server();
    for (name, opts) in modes() {
        let mut c = t.connect(&opts);
        let size = c.size();
        let ok = |c: &mut Client| {
            c.write(4096, &[9u8; 4096], CmdFlags::empty()).unwrap();
            assert_eq!(c.read(4096, 4096).unwrap(), vec![9u8; 4096]);
        };
        let rd = |off, len| Request::new(Command::Read, 0, off, len);
        expect_err(
            c.request(rd(size, 4096), &[]),
            NBD_EINVAL,
            "read past the end",
        );
        ok(&mut c);
        expect_err(
            c.request(rd(size - 512, 1024), &[]),
            NBD_EINVAL,
            "read over the end",
        );
        ok(&mut c);
        expect_err(c.request(rd(0, 0), &[]), NBD_EINVAL, "zero-length read");
        ok(&mut c);
        expect_err(c.request(rd(100, 512), &[]), NBD_EINVAL, "misaligned read");
        ok(&mut c);
        expect_err(
            c.request(rd(0, 512).with_flags(CmdFlags::REQ_ONE), &[]),
            NBD_EINVAL,
            "read with a block status flag",
        );
        ok(&mut c);
        expect_err(
            c.request(rd(0, 512).with_flags(CmdFlags::from_bits(0x8000)), &[]),
            NBD_EINVAL,
            "unknown flag",
        );
        ok(&mut c);
        if name == "simple" {
            expect_err(
                c.request(rd(0, 512).with_flags(CmdFlags::DF), &[]),
                NBD_EINVAL,
                "DF without structured replies",
            );
            ok(&mut c);
        }
        expect_err(
            c.write(size - 4096, &[1u8; 8192], CmdFlags::empty()),
            NBD_ENOSPC,
            "write past the end",
        );
        ok(&mut c);
        expect_err(
            c.write(512 + 3, &[1u8; 512], CmdFlags::empty()),
            NBD_EINVAL,
            "misaligned write",
        );
        ok(&mut c);
        expect_err(
            c.write_zeroes(size, 4096, CmdFlags::empty()),
            NBD_ENOSPC,
            "zeroes past the end",
        );
        ok(&mut c);
        expect_err(c.trim(size - 512, 4096), NBD_EINVAL, "trim past the end");
        ok(&mut c);
        // Longer than the maximum block size (32 MiB).
        let long = 32 * MIB + 512;
        expect_err(c.request(rd(0, long), &[]), NBD_EINVAL, "over-long read");
        ok(&mut c);
        if name != "simple" {
            expect_err(
                c.request(rd(0, long).with_flags(CmdFlags::DF), &[]),
                NBD_EOVERFLOW,
                "over-long DF read",
            );
            ok(&mut c);
        }
        // An over-long write: refused, payload discarded, connection fine. With extended
        // headers the server disconnects instead (the extension's SHOULD).
        let r = c.write(0, &vec![3u8; long as usize], CmdFlags::empty());
        if name == "extended" {
            assert!(
                matches!(r, Err(ClientError::Io(_) | ClientError::Unexpected(_))),
                "over-long extended write: {r:?}"
            );
            c = t.connect(&opts);
        } else {
            expect_err(r, NBD_EINVAL, "over-long write");
        }
        ok(&mut c);
        // Unknown command.
        c.send_raw_request(77, CmdFlags::empty(), 0, 4096).unwrap();
        let r = c.recv().unwrap();
        assert_eq!(r.error, NBD_EINVAL, "{name}: unknown command");
        ok(&mut c);
        // Block status without a negotiated context.
        if name == "simple" {
            let req = Request::new(Command::BlockStatus, 0, 0, 4096);
            expect_err(c.request(req, &[]), NBD_EINVAL, "block status w/o context");
            ok(&mut c);
        }
        c.disconnect().unwrap();

        // EPERM on the read-only export; reads work.
        let mut r = t.connect(&ClientOptions {
            export: "ro".into(),
            ..opts.clone()
        });
        expect_err(
            r.write(0, &[1u8; 512], CmdFlags::empty()),
            NBD_EPERM,
            "ro write",
        );
        expect_err(r.trim(0, 4096), NBD_EPERM, "ro trim");
        expect_err(
            r.write_zeroes(0, 4096, CmdFlags::empty()),
            NBD_EPERM,
            "ro zeroes",
        );
        assert_eq!(r.read(0, 512).unwrap(), vec![0u8; 512]);
        r.flush().unwrap();
        r.disconnect().unwrap();

        // ENOTSUP for a fast zero the device cannot do fast; EIO from the device.
        let mut p = t.connect(&ClientOptions {
            export: "picky".into(),
            ..opts.clone()
        });
        expect_err(
            p.write_zeroes(0, 4096, CmdFlags::FAST_ZERO),
            NBD_ENOTSUP,
            "slow fast zero",
        );
        p.write_zeroes(0, 4096, CmdFlags::empty()).unwrap();
        p.write(8 * MIB, &[5u8; 4096], CmdFlags::empty()).unwrap();
        expect_err(p.read(8 * MIB, 4096), NBD_EIO, "device EIO");
        assert_eq!(p.read(8 * MIB + 512, 512).unwrap(), vec![5u8; 512]);
        p.disconnect().unwrap();
    }
}

#[test]
fn over_long_write_beyond_the_discard_limit_closes_only_that_connection() {
    let t = default_server();
    let mut other = t.connect(&ClientOptions::default());
    let mut c = t.connect(&ClientOptions {
        structured: false,
        base_allocation: false,
        ..ClientOptions::default()
    });
    // 100 MiB announced, more than the 64 MiB the test server discards: closed at once,
    // without the server reading (or buffering) the payload.
    let req = Request::new(Command::Write, 0, 0, 100 * MIB);
    let mut hdr = Vec::new();
    req.encode(TransmissionMode::Simple, &mut hdr).unwrap();
    c.send_raw(&hdr).unwrap();
    // An error reply may come first (the write is also out of range), then the close.
    let mut replies = 0;
    loop {
        match c.recv() {
            Ok(r) => {
                assert_ne!(r.error, 0);
                replies += 1;
                assert!(replies <= 1);
            }
            Err(ClientError::Unexpected(_)) => {}
            Err(ClientError::Io(_)) => break,
            Err(e) => panic!("{e}"),
        }
    }
    // The other connection, and new ones, are fine.
    other.write(0, &[1u8; 4096], CmdFlags::empty()).unwrap();
    let mut n = t.connect(&ClientOptions::default());
    assert_eq!(n.read(0, 4096).unwrap(), vec![1u8; 4096]);
}

#[test]
fn malformed_handshakes_close_only_their_connection() {
    let t = default_server();
    let mut live = t.connect(&ClientOptions::default());
    live.write(0, &[2u8; 512], CmdFlags::empty()).unwrap();

    // Bad option magic.
    let mut h = t.handshake();
    h.stream().write_all(b"NOTMAGIC\0\0\0\x07\0\0\0\0").unwrap();
    let mut b = [0u8; 64];
    assert_eq!(h.stream().read(&mut b).unwrap(), 0, "closed");

    // Unknown client flags.
    let mut s = t.ep.connect().unwrap();
    let mut g = [0u8; 18];
    s.read_exact(&mut g).unwrap();
    s.write_all(&0x8000_0001u32.to_be_bytes()).unwrap();
    assert_eq!(s.read(&mut b).unwrap(), 0, "closed");

    // Garbage instead of the client flags, then hang up half-way through an option.
    let mut s = t.ep.connect().unwrap();
    s.read_exact(&mut g).unwrap();
    s.write_all(&1u32.to_be_bytes()).unwrap();
    s.write_all(b"IHAVEOPT\0\0\0\x07\0\0\0\x10abc").unwrap();
    drop(s);

    // A GO whose data is inconsistent: ERR_INVALID, and the handshake continues.
    let mut h = t.handshake();
    let e = h
        .option(&ClientOption::Other {
            option: NBD_OPT_GO,
            data: &[0, 0, 0, 9, b'x', 0],
        })
        .unwrap_err();
    assert_eq!(e.option_error(), Some(NBD_REP_ERR_INVALID));
    let d = h.go("").unwrap();
    let mut c = h.into_client(d).unwrap();
    assert_eq!(c.read(0, 512).unwrap(), vec![2u8; 512]);

    // The established connection never noticed.
    assert_eq!(live.read(0, 512).unwrap(), vec![2u8; 512]);
}

#[test]
fn bad_magic_in_transmission_closes_only_that_connection() {
    let t = default_server();
    let mut good = t.connect(&ClientOptions::default());
    let mut bad = t.connect(&ClientOptions::default());
    let mut junk = vec![0xde, 0xad, 0xbe, 0xef];
    junk.resize(28, 0);
    bad.send_raw(&junk).unwrap();
    assert!(matches!(bad.recv(), Err(ClientError::Io(_))));
    good.write(0, &[4u8; 512], CmdFlags::empty()).unwrap();
    assert_eq!(good.read(0, 512).unwrap(), vec![4u8; 512]);
}

#[test]
fn multi_conn_writes_are_visible_after_flush() {
    let t = default_server();
    let mut a = t.connect(&ClientOptions::default());
    let mut b = t.connect(&ClientOptions {
        extended: true,
        ..ClientOptions::default()
    });
    assert!(a
        .details()
        .flags
        .contains(TransmissionFlags::CAN_MULTI_CONN));
    let data = pattern(7, 65536);
    a.write(MIB, &data, CmdFlags::empty()).unwrap();
    a.flush().unwrap();
    assert_eq!(b.read(MIB, 65536).unwrap(), data);
}

/// A device whose bios complete on a timer thread: replies are written by the completion
/// thread (or, when the socket is full, by the flusher), not by the reader.
#[test]
fn completions_on_other_threads_and_small_tables() {
    for spec in [
        "null:256M,memory_backed=1,completion=thread",
        "null:256M,memory_backed=1,completion=timer,completion_nsec=200000",
    ] {
        // 16 slots and an 8 MiB budget: the reader waits for replies to free them.
        let t = serve_tuned(vec![Export::new("", device(spec))], |tu| {
            tu.slots = 16;
            tu.max_bytes_in_flight = 8 << 20;
        });
        for (name, opts) in modes() {
            let mut c = t.connect(&opts);
            let mut want = std::collections::HashMap::new();
            for i in 0..64u64 {
                let len = if i % 8 == 0 { 2 << 20 } else { 16384 };
                let data = pattern(i, len);
                let off = i * (3 << 20);
                let cookie = c
                    .send(Request::new(Command::Write, 0, off, len as u64), &data)
                    .unwrap();
                want.insert(cookie, ());
                let _ = (off, data);
            }
            while !want.is_empty() {
                let r = c.recv().unwrap();
                assert_eq!(r.error, 0, "{spec} {name}");
                want.remove(&r.cookie);
            }
            let mut reads = std::collections::HashMap::new();
            for i in 0..64u64 {
                let len = if i % 8 == 0 { 2 << 20 } else { 16384 };
                let off = i * (3 << 20);
                let cookie = c
                    .send(Request::new(Command::Read, 0, off, len as u64), &[])
                    .unwrap();
                reads.insert(cookie, (i, len));
            }
            while !reads.is_empty() {
                let r = c.recv().unwrap();
                let (i, len) = reads.remove(&r.cookie).unwrap();
                assert_eq!(r.error, 0);
                assert!(r.data == pattern(i, len), "{spec} {name}: read {i} differs");
            }
            c.disconnect().unwrap();
        }
    }
}

#[test]
fn disc_with_requests_in_flight_answers_them_first() {
    // Timer completions 2 ms out: every request is still in flight when DISC arrives.
    let t = serve(vec![Export::new(
        "",
        device("null:64M,memory_backed=1,completion=timer,completion_nsec=2000000"),
    )]);
    let mut c = t.connect(&ClientOptions::default());
    let mut pending = std::collections::HashSet::new();
    for i in 0..32u64 {
        let data = pattern(i, 4096);
        pending.insert(
            c.send(Request::new(Command::Write, 0, i * 4096, 4096), &data)
                .unwrap(),
        );
        pending.insert(
            c.send(Request::new(Command::Read, 0, i * 4096 + MIB, 4096), &[])
                .unwrap(),
        );
    }
    c.send(Request::new(Command::Disc, 0, 0, 0), &[]).unwrap();
    while !pending.is_empty() {
        let r = c.recv().unwrap();
        assert_eq!(r.error, 0);
        assert!(pending.remove(&r.cookie));
    }
    // Then the server closes.
    assert!(matches!(c.recv(), Err(ClientError::Io(_))));
}

#[test]
fn shutdown_finishes_in_flight_requests_and_removes_the_socket() {
    let mut t = serve(vec![Export::new(
        "",
        device("null:64M,memory_backed=1,completion=timer,completion_nsec=2000000"),
    )]);
    let mut c = t.connect(&ClientOptions::default());
    // An idle connection in the handshake, too.
    let _idle = t.handshake();
    let mut pending = std::collections::HashSet::new();
    for i in 0..16u64 {
        pending.insert(
            c.send(
                Request::new(Command::Write, 0, i * 4096, 4096),
                &[1u8; 4096],
            )
            .unwrap(),
        );
    }
    // Make sure the server has read them before it stops.
    std::thread::sleep(Duration::from_millis(50));
    let path = match &t.ep {
        Endpoint::Unix(p) => p.clone(),
        Endpoint::Tcp(_) => unreachable!(),
    };
    let server = t.take();
    let stopper = server.stopper();
    let h = std::thread::spawn(move || server.wait());
    stopper.stop();
    while !pending.is_empty() {
        let r = c.recv().unwrap();
        assert_eq!(r.error, 0);
        pending.remove(&r.cookie);
    }
    h.join().unwrap();
    assert!(!path.exists(), "socket file removed");
    assert!(matches!(c.recv(), Err(ClientError::Io(_))));
}

#[test]
fn tcp_listener_on_an_ephemeral_port() {
    let mut cfg = ServerConfig::new(vec![Export::new("", device("mem:1M"))]);
    cfg.tcp = Some("127.0.0.1:0".parse().unwrap());
    let server = Server::start(cfg).unwrap();
    let addr = server.tcp_addr().unwrap();
    assert_ne!(addr.port(), 0);
    let mut c = Client::connect(&Endpoint::Tcp(addr), &ClientOptions::default()).unwrap();
    c.write(0, &[8u8; 4096], CmdFlags::FUA).unwrap();
    assert_eq!(c.read(0, 4096).unwrap(), vec![8u8; 4096]);
    // A second server on the same port fails with a clear error.
    let mut cfg2 = ServerConfig::new(vec![Export::new("", device("mem:1M"))]);
    cfg2.tcp = Some(addr);
    let e = Server::start(cfg2).err().unwrap();
    assert!(
        e.to_string().starts_with(&format!("binding {addr}:")),
        "{e}"
    );
    c.disconnect().unwrap();
    server.shutdown();
}

#[test]
fn info_request_list_is_honoured() {
    let t = default_server();
    let mut h = t.handshake();
    // GO asking for nothing still gets INFO_EXPORT (and block sizes, which we always send).
    h.send_option(&ClientOption::Go(ExportRequest::new("", &[])))
        .unwrap();
    let mut types = Vec::new();
    loop {
        let r = h.read_reply().unwrap();
        if r.reply_type == NBD_REP_ACK {
            break;
        }
        assert_eq!(r.reply_type, NBD_REP_INFO);
        types.push(u16::from_be_bytes([r.data[0], r.data[1]]));
    }
    assert!(types.contains(&NBD_INFO_EXPORT));
    assert!(!types.contains(&NBD_INFO_NAME));
}

#[test]
fn submit_wait_returns_each_bio_status() {
    let dev = device("mem:1M");
    blk::submit_wait(dev.as_ref(), Bio::new(Op::Flush, 0, 0))
        .1
        .unwrap();
    let picky = picky(dev, 0);
    let mut zeroes = Bio::new(Op::WriteZeroes, 0, 4096);
    zeroes.flags = BioFlags::FAST_ZERO;
    let err = blk::submit_wait(&picky, zeroes).1.unwrap_err();
    assert_eq!(err.errno(), libc::ENOTSUP);
    assert_eq!(Errno::from_errno(err.errno()), Errno::NotSup);
}

#[test]
fn stop_before_wait_returns_at_once() {
    let mut t = default_server();
    let server = t.take();
    let stopper = server.stopper();
    stopper.stop();
    // A second stop is harmless; `wait` must not sleep for a stop that already happened.
    stopper.stop();
    server.wait();
}

#[test]
fn a_refused_write_is_answered_only_after_its_payload() {
    let t = default_server();
    let mut h = t.handshake();
    h.go("").unwrap();
    let mut s = h.stream().try_clone().unwrap();
    drop(h);
    // Over the 32 MiB maximum: refused, but the reply must wait for the whole payload (a
    // client still sending cannot match it yet).
    let long = 32 * MIB + 512;
    let mut req = Vec::new();
    Request::new(Command::Write, 9, 0, long)
        .encode(TransmissionMode::Simple, &mut req)
        .unwrap();
    s.write_all(&req).unwrap();
    s.write_all(&vec![1u8; (long - 512) as usize]).unwrap();
    s.set_read_timeout(Some(Duration::from_millis(300)))
        .unwrap();
    let mut reply = [0u8; 16];
    let early = s.read(&mut reply);
    assert!(
        matches!(&early, Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
        "a reply before the payload was all sent: {early:?}"
    );
    s.write_all(&[1u8; 512]).unwrap();
    s.set_read_timeout(Some(testkit::PROMPT)).unwrap();
    s.read_exact(&mut reply).unwrap();
    assert_eq!(reply[..4], NBD_SIMPLE_REPLY_MAGIC.to_be_bytes());
    assert_eq!(reply[4..8], NBD_EINVAL.to_be_bytes());
    assert_eq!(reply[8..16], 9u64.to_be_bytes());
}
