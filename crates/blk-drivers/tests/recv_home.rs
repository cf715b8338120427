//! Writes received into their home on `store=map` (`Backend::recv_at`, `Device::recv_home`,
//! `backend/home.rs`): bytes from a socket land where reads find them, across regions and
//! unaligned; a peer that closes mid-payload leaves no receiver counted, so a trim of the
//! region then completes; trims racing receives in the same region (sharing edge pages, never
//! the same bytes) never lose a received byte; `splice=0` and the page store turn it off.
//! Buffered `file:` devices splice the payload through a pipe into the page cache.
// A plain threaded test, never a loom model.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]
#![cfg(not(blkq_loom))]

use std::io::{self, Write};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::thread;

use blk::Device;
use blk_drivers::spec::{DeviceSpec, QueueOverrides};
use blk_drivers::{Backend, MapBackend};
use testkit::io::SocketSource;
use testkit::pattern;

const MIB: u64 = 1 << 20;

fn pair() -> (UnixStream, SocketSource) {
    let (a, b) = UnixStream::pair().unwrap();
    (a, SocketSource(b))
}

#[test]
fn received_bytes_are_where_reads_find_them() {
    let m = MapBackend::new(8 * MIB).unwrap();
    // Unaligned, across three regions.
    let (off, len) = (MIB - 1000, 2 * MIB + 777);
    let data = pattern(7, len as usize);
    let (mut tx, mut rx) = pair();
    let sender = {
        let data = data.clone();
        thread::spawn(move || {
            // In pieces, so that the receive takes several `recv`s.
            for c in data.chunks(100_000) {
                tx.write_all(c).unwrap();
            }
        })
    };
    m.recv_at(off, len as usize, &mut rx).unwrap();
    sender.join().unwrap();
    assert_eq!(m.receivers_in_flight(), 0);
    let mut got = vec![0u8; len as usize + 8192];
    m.read_at(off - 4096, &mut got).unwrap();
    assert!(
        got[..4096].iter().all(|&b| b == 0),
        "bytes before the write"
    );
    assert!(
        got[4096..4096 + len as usize] == data[..],
        "the received bytes"
    );
    assert!(got[4096 + len as usize..].iter().all(|&b| b == 0));
    // The pages it touched are allocated, and only those.
    let first = off / 4096 * 4096;
    let end = (off + len).div_ceil(4096) * 4096;
    assert_eq!(m.allocated_bytes(), end - first);
    let ext = m.extents(0, 8 * MIB, 16).unwrap();
    assert_eq!(
        ext.iter()
            .filter(|e| e.allocated)
            .map(|e| (e.offset, e.len))
            .collect::<Vec<_>>(),
        [(first, end - first)]
    );
}

#[test]
fn out_of_range_receives_take_no_byte() {
    let m = MapBackend::new(MIB).unwrap();
    let (mut tx, mut rx) = pair();
    tx.write_all(&[1u8; 8192]).unwrap();
    let e = m.recv_at(MIB - 4096, 8192, &mut rx).unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
    assert_eq!(m.allocated_bytes(), 0);
    // The bytes are still in the socket.
    m.recv_at(0, 8192, &mut rx).unwrap();
    assert_eq!(m.allocated_bytes(), 8192);
}

#[test]
fn a_peer_closing_mid_payload_leaves_no_receiver_and_the_trim_completes() {
    let m = Arc::new(MapBackend::new(4 * MIB).unwrap());
    let (mut tx, mut rx) = pair();
    let data = pattern(3, MIB as usize);
    let m2 = m.clone();
    let receiver = thread::spawn(move || m2.recv_at(MIB, MIB as usize, &mut rx));
    // Part of it, then the peer closes: the receive takes what came, then sees the end.
    tx.write_all(&data[..300_000]).unwrap();
    drop(tx);
    let e = receiver.join().unwrap().unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
    assert_eq!(m.receivers_in_flight(), 0, "the receiver count leaked");
    // A torn write: what came is there.
    let mut got = vec![0u8; 300_000];
    m.read_at(MIB, &mut got).unwrap();
    assert!(got == data[..300_000]);
    // A trim of the region completes (it would wait forever for a leaked receiver).
    m.discard(MIB, MIB).unwrap();
    assert_eq!(m.allocated_bytes(), 0);
}

#[test]
fn trims_racing_receives_in_the_same_region_lose_no_received_byte() {
    // Receives into [0, 6144) of region 0 (page 0 and half of page 1), trims of
    // [6144, 1 MiB) (the other half of page 1 and the rest): the trim's edge page is one the
    // receive is filling. A trim that zeroed that page, found it all zeros and gave it back
    // while the receive was filling it would lose the received bytes.
    let m = Arc::new(MapBackend::new(2 * MIB).unwrap());
    let len = 6144usize;
    let rounds = 300u64;
    let (mut tx, mut rx) = pair();
    let m2 = m.clone();
    let trimmer = thread::spawn(move || {
        for _ in 0..rounds * 4 {
            m2.discard(6144, MIB - 6144).unwrap();
            m2.write_zeroes(6144, 2048, true).unwrap();
        }
    });
    let sender = thread::spawn(move || {
        for r in 0..rounds {
            let data = pattern(r, len);
            // Two halves, so that receives stop halfway through page 1.
            tx.write_all(&data[..len - 1000]).unwrap();
            thread::yield_now();
            tx.write_all(&data[len - 1000..]).unwrap();
        }
    });
    for r in 0..rounds {
        m.recv_at(0, len, &mut rx).unwrap();
        let mut got = vec![0u8; len];
        m.read_at(0, &mut got).unwrap();
        assert!(
            got == pattern(r, len),
            "round {r}: received bytes were lost"
        );
    }
    sender.join().unwrap();
    trimmer.join().unwrap();
    assert_eq!(m.receivers_in_flight(), 0);
}

fn device(spec: &str) -> Arc<dyn Device> {
    let s: DeviceSpec = spec.parse().unwrap();
    Arc::new(s.build(&QueueOverrides::default()).unwrap())
}

#[test]
fn the_device_receives_home_where_the_spec_allows() {
    assert!(device("mem:4M").caps().recv_home);
    assert!(device("mem:4M,store=map,thp=1").caps().recv_home);
    assert!(!device("mem:4M,splice=0").caps().recv_home);
    assert!(!device("mem:4M,store=pages").caps().recv_home);
    assert!(!device("null:4M").caps().recv_home);
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("f.img");
    std::fs::File::create(&img)
        .unwrap()
        .set_len(4 * MIB)
        .unwrap();
    assert!(device(&format!("file:{}", img.display())).caps().recv_home);
    assert!(
        !device(&format!("file:{},splice=0", img.display()))
            .caps()
            .recv_home
    );
    assert!(
        !device(&format!("file:{},ro=1", img.display()))
            .caps()
            .recv_home
    );

    // Through the queue: counted as one write of the bytes, visible to bios.
    let dev = device("mem:4M");
    let data = pattern(11, MIB as usize);
    let (mut tx, mut rx) = pair();
    let d2 = data.clone();
    let sender = thread::spawn(move || tx.write_all(&d2).unwrap());
    dev.recv_home(MIB, MIB as usize, &mut rx).unwrap();
    sender.join().unwrap();
    let st = dev.stats().unwrap();
    assert_eq!(
        (st.ios[1], st.sectors[1], st.in_flight[1]),
        (1, MIB >> 9, 0)
    );
    let (bio, res) = blk::submit_wait(
        dev.as_ref(),
        blk::Bio::with_buf(blk::Op::Read, MIB >> 9, blk::Buffer::new(MIB as usize)),
    );
    res.unwrap();
    assert!(bio.buf.unwrap().as_slice() == &data[..]);
    // And refused where off.
    let (_tx, mut rx) = pair();
    assert!(device("mem:4M,splice=0")
        .recv_home(0, 4096, &mut rx)
        .is_err());
}

#[test]
fn a_file_device_splices_received_bytes_into_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("f.img");
    std::fs::File::create(&img)
        .unwrap()
        .set_len(8 * MIB)
        .unwrap();
    for engine in ["sync", "pool"] {
        let dev = device(&format!("file:{},engine={engine}", img.display()));
        // Unaligned, larger than a pipe, sent in pieces; then a second write reusing the pipe.
        for (seed, off, len) in [(1u64, MIB + 512, 3 * MIB + 4096), (2, 0, MIB)] {
            let data = pattern(seed, len as usize);
            let (mut tx, mut rx) = pair();
            let d2 = data.clone();
            let sender = thread::spawn(move || {
                for c in d2.chunks(70_000) {
                    tx.write_all(c).unwrap();
                }
            });
            dev.recv_home(off, len as usize, &mut rx).unwrap();
            sender.join().unwrap();
            // Through the device's own reads (the first MiB of it).
            let (bio, res) = blk::submit_wait(
                dev.as_ref(),
                blk::Bio::with_buf(blk::Op::Read, off >> 9, blk::Buffer::new(MIB as usize)),
            );
            res.unwrap();
            assert!(
                bio.buf.unwrap().as_slice() == &data[..MIB as usize],
                "{engine}: {off}+{len}"
            );
        }
        // What the file holds, read past the server.
        let on_disk = std::fs::read(&img).unwrap();
        assert!(on_disk[0..MIB as usize] == pattern(2, MIB as usize)[..]);
        let a = (MIB + 512) as usize;
        assert!(
            on_disk[a..a + (3 * MIB + 4096) as usize] == pattern(1, (3 * MIB + 4096) as usize)[..]
        );
        // A peer gone mid-payload: an error, the torn bytes in the file, and the next receive
        // (through a fresh pipe or a clean one) lands whole.
        let (mut tx, mut rx) = pair();
        tx.write_all(&pattern(3, 100_000)).unwrap();
        drop(tx);
        let e = dev.recv_home(4 * MIB, MIB as usize, &mut rx).unwrap_err();
        assert!(
            matches!(&e, blk::Error::Io(io) if io.kind() == io::ErrorKind::UnexpectedEof),
            "{e}"
        );
        let data = pattern(4, MIB as usize);
        let (mut tx, mut rx) = pair();
        let d2 = data.clone();
        let sender = thread::spawn(move || tx.write_all(&d2).unwrap());
        dev.recv_home(6 * MIB, MIB as usize, &mut rx).unwrap();
        sender.join().unwrap();
        let on_disk = std::fs::read(&img).unwrap();
        assert!(on_disk[6 * MIB as usize..7 * MIB as usize] == data[..]);
        assert!(on_disk[4 * MIB as usize..4 * MIB as usize + 100_000] == pattern(3, 100_000)[..]);
    }
}
