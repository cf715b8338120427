//! Zero-copy large reads (`server/conn/splice.rs`): reads of 64 KiB and more from `mem:` and
//! buffered `file:` exports go from the device through a pipe into the socket. The bytes must
//! be the device's in every mode, over Unix and TCP, with a client that stops reading for a
//! while (the replies then finish on the flusher); a read the device cannot splice is answered
//! with an error, and the connection goes on.
// A plain threaded test, never a loom model.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]
#![cfg(not(blkq_loom))]

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use blk::Device;
use common::modes;
use common::served::{device, Running};
use nbd::client::{Client, ClientError, ClientOptions, Endpoint};
use nbd::codec::transmission::Request;
use nbd::codec::{CmdFlags, Command, TransmissionMode};
use nbd::server::Export;
use testkit::{pattern, Forward, Hook};

const MIB: u64 = 1 << 20;
const NBD_EIO: u32 = 5;

/// A server with a `mem:` export "" and a `file:` export "file", on a Unix socket and TCP.
struct Both {
    _run: Running,
    unix: Endpoint,
    tcp: Endpoint,
    _dir: tempfile::TempDir,
}

impl Both {
    fn start(file_size: u64) -> (Self, std::path::PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let img = dir.path().join("disk.img");
        std::fs::File::create(&img)
            .unwrap()
            .set_len(file_size)
            .unwrap();
        let exports = vec![
            Export::new("", device("mem:64M")),
            Export::new("file", device(&format!("file:{}", img.display()))),
        ];
        let run = Running::start(exports, |cfg| {
            cfg.tcp = Some("127.0.0.1:0".parse().unwrap());
        });
        (
            Self {
                unix: run.ep.clone(),
                tcp: run.tcp(),
                _run: run,
                _dir: dir,
            },
            img,
        )
    }
}

fn connect(ep: &Endpoint, opts: &ClientOptions, export: &str) -> Client {
    let opts = ClientOptions {
        export: export.to_string(),
        ..opts.clone()
    };
    Client::connect(ep, &opts).unwrap()
}

#[test]
fn spliced_reads_are_the_device_bytes_everywhere() {
    let (t, _img) = Both::start(64 * MIB);
    // Data in [0, 6 MiB) of each export, unwritten after: reads cross into holes.
    let data = pattern(42, (6 * MIB) as usize);
    for export in ["", "file"] {
        let mut c = connect(&t.unix, &ClientOptions::default(), export);
        for (i, chunk) in data.chunks(MIB as usize).enumerate() {
            c.write(i as u64 * MIB, chunk, CmdFlags::empty()).unwrap();
        }
        c.disconnect().unwrap();
    }
    let expect = |off: u64, len: u64| -> Vec<u8> {
        let mut v = vec![0u8; len as usize];
        let end = (off + len).min(data.len() as u64);
        if off < end {
            v[..(end - off) as usize].copy_from_slice(&data[off as usize..end as usize]);
        }
        v
    };
    // Aligned, unaligned (257 pages), larger than any pipe, across the end of the data,
    // only a hole, and just above and below the splice threshold.
    let reads = [
        (0, MIB),
        (4096 + 512, MIB),
        (MIB / 2, 3 * MIB),
        (5 * MIB, 2 * MIB),
        (9 * MIB, MIB),
        (123 * 512, 64 << 10),
        (7, (64 << 10) - 512),
    ];
    for export in ["", "file"] {
        for ep in [&t.unix, &t.tcp] {
            for (name, opts) in modes() {
                let mut c = connect(ep, &opts, export);
                // Pipelined, and twice: the pipe is reused from reply to reply.
                let mut want = HashMap::new();
                for round in 0..2 {
                    for &(off, len) in &reads {
                        let off = if round == 1 && off % 512 != 0 {
                            off - 7
                        } else {
                            off
                        };
                        let off = off / 512 * 512;
                        let len = len / 512 * 512;
                        let cookie = c
                            .send(Request::new(Command::Read, 0, off, len), &[])
                            .unwrap();
                        want.insert(cookie, (off, len));
                    }
                }
                while !want.is_empty() {
                    let r = c.recv().unwrap();
                    let (off, len) = want.remove(&r.cookie).expect("unknown cookie");
                    assert_eq!(r.error, 0, "{export:?} {ep:?} {name}: read {off}+{len}");
                    assert!(
                        r.data == expect(off, len),
                        "{export:?} {ep:?} {name}: read {off}+{len} differs"
                    );
                }
                // `DF` in the chunked modes: one data chunk, holes included.
                if c.mode() != TransmissionMode::Simple {
                    let mut req = Request::new(Command::Read, 0, 5 * MIB, 2 * MIB);
                    req.flags = CmdFlags::DF;
                    let r = c.request(req, &[]).unwrap();
                    assert_eq!((r.error, r.data_chunks, r.hole_chunks), (0, 1, 0));
                    assert!(r.data == expect(5 * MIB, 2 * MIB));
                }
                c.disconnect().unwrap();
            }
        }
    }
}

#[test]
fn a_client_that_stops_reading_gets_every_byte_later() {
    let (t, _img) = Both::start(64 * MIB);
    let data = pattern(9, (32 * MIB) as usize);
    for ep in [&t.unix, &t.tcp] {
        let mut c = connect(ep, &ClientOptions::default(), "");
        for (i, chunk) in data.chunks(MIB as usize).enumerate() {
            c.write(i as u64 * MIB, chunk, CmdFlags::empty()).unwrap();
        }
        // 32 MiB of replies queued while the client reads nothing: far more than the socket
        // buffers hold, so the writer hands the half-sent output to the flusher.
        let mut want = HashMap::new();
        for i in 0..32u64 {
            let cookie = c
                .send(Request::new(Command::Read, 0, i * MIB, MIB), &[])
                .unwrap();
            want.insert(cookie, i);
        }
        std::thread::sleep(Duration::from_millis(300));
        while !want.is_empty() {
            let r = c.recv().unwrap();
            let i = want.remove(&r.cookie).unwrap() as usize;
            assert_eq!(r.error, 0);
            assert!(
                r.data[..] == data[i << 20..(i + 1) << 20],
                "MiB {i} differs"
            );
        }
        c.disconnect().unwrap();
    }
}

#[test]
fn a_read_that_cannot_be_spliced_is_answered_with_an_error() {
    let (t, img) = Both::start(8 * MIB);
    {
        let mut c = connect(&t.unix, &ClientOptions::default(), "file");
        c.write(0, &pattern(3, MIB as usize), CmdFlags::FUA)
            .unwrap();
        c.disconnect().unwrap();
    }
    // The image shrinks under the server: its last 7 MiB are gone, and a splice there gives
    // nothing. (A read through a bio would fail too; this one fails before its header left.)
    std::fs::OpenOptions::new()
        .write(true)
        .open(&img)
        .unwrap()
        .set_len(MIB)
        .unwrap();
    for (name, opts) in modes() {
        let mut c = connect(&t.unix, &opts, "file");
        let mut req = Request::new(Command::Read, 0, 4 * MIB, MIB);
        if c.mode() != TransmissionMode::Simple {
            req.flags = CmdFlags::DF;
        }
        match c.request(req, &[]) {
            Err(ClientError::Request(e)) => assert_eq!(e, NBD_EIO, "{name}"),
            Ok(r) => assert_eq!(r.error, NBD_EIO, "{name}: {} bytes", r.data.len()),
            Err(e) => panic!("{name}: {e}"),
        }
        // The connection goes on: a spliced read and a small one of what is left.
        assert!(
            c.read(0, MIB).unwrap() == pattern(3, MIB as usize),
            "{name}"
        );
        assert!(c.read(0, 4096).unwrap()[..] == pattern(3, MIB as usize)[..4096]);
        c.disconnect().unwrap();
    }
}

/// A hook over a `mem:` device whose zero-copy reads starting in `[0, FAIL_BELOW)` put the
/// first `PARTIAL` bytes into the pipe and then fail: a fill that fails after part of it is in
/// the pipe, as `MapBackend::splice_read` can (a region spliced, the next one failing). Bios,
/// batches and the queue are the inner device's.
struct FailsMidSplice;

const FAIL_BELOW: u64 = 4 * MIB;
const PARTIAL: usize = 256 << 10;

impl Hook for FailsMidSplice {
    fn transparent(&self) -> bool {
        true
    }
    fn splice_read(
        &self,
        inner: &dyn Device,
        offset: u64,
        len: usize,
        pipe: std::os::fd::BorrowedFd<'_>,
    ) -> Result<usize, blk::Error> {
        if offset >= FAIL_BELOW {
            return inner.splice_read(offset, len, pipe);
        }
        let n = inner.splice_read(offset, len.min(PARTIAL), pipe)?;
        assert!(n > 0, "the partial splice moved nothing");
        Err(blk::Error::Io(std::io::Error::other(format!(
            "injected: failed after {n} bytes were put in the pipe"
        ))))
    }
}

#[test]
fn a_read_that_fails_after_filling_part_of_the_pipe_leaks_nothing_into_the_next() {
    let dev: Arc<dyn Device> = Arc::new(Forward::with_hook(device("mem:64M"), FailsMidSplice));
    let mut t = Running::start(vec![Export::new("", dev)], |cfg| {
        cfg.tcp = Some("127.0.0.1:0".parse().unwrap());
    });
    let (unix, tcp) = (t.ep.clone(), t.tcp());
    // Different data where the reads fail and where the reads after them go.
    let bad = pattern(1, MIB as usize);
    let good = pattern(2, (2 * MIB) as usize);
    {
        let mut c = connect(&unix, &ClientOptions::default(), "");
        c.write(0, &bad, CmdFlags::empty()).unwrap();
        c.write(8 * MIB, &good[..MIB as usize], CmdFlags::empty())
            .unwrap();
        c.write(9 * MIB, &good[MIB as usize..], CmdFlags::empty())
            .unwrap();
        c.disconnect().unwrap();
    }
    for ep in [&unix, &tcp] {
        for (name, opts) in modes() {
            let mut c = connect(ep, &opts, "");
            for round in 0..3u64 {
                // The failing read: an error reply, nothing else.
                let mut req = Request::new(Command::Read, 0, 0, MIB);
                if c.mode() != TransmissionMode::Simple {
                    req.flags = CmdFlags::DF;
                }
                match c.request(req, &[]) {
                    Err(ClientError::Request(e)) => assert_eq!(e, NBD_EIO, "{name}"),
                    Ok(r) => assert_eq!(r.error, NBD_EIO, "{name}: {} bytes", r.data.len()),
                    Err(e) => panic!("{ep:?} {name}: {e}"),
                }
                // The next spliced reads are exactly the device's bytes at their offsets.
                let off = 8 * MIB + round * 4096;
                let got = c.read(off, MIB).unwrap();
                let at = (off - 8 * MIB) as usize;
                assert!(
                    got[..] == good[at..at + MIB as usize],
                    "{ep:?} {name} round {round}: the read after a failed one differs (first \
                     differing byte at {:?}; begins with the failed read's bytes: {})",
                    got.iter().zip(&good[at..]).position(|(a, b)| a != b),
                    got[..PARTIAL] == bad[..PARTIAL]
                );
                let got = c.read(9 * MIB, 128 << 10).unwrap();
                assert!(
                    got[..] == good[MIB as usize..(MIB as usize) + (128 << 10)],
                    "{ep:?} {name} round {round}: the second read after a failed one differs"
                );
            }
            // And the connection still reads the failing range through bios.
            assert!(c.read(0, 4096).unwrap()[..] == bad[..4096], "{name}");
            c.disconnect().unwrap();
        }
    }
    t.take().shutdown();
}
