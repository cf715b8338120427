//! `FileBackend` over temp files (buffered and `O_DIRECT`), allocation maps through
//! `SEEK_HOLE`, FUA, read-only opens, and the asynchronous engines (thread pool always;
//! io_uring where the kernel and container allow it), checked to produce the same bytes.
#![cfg(not(blkq_loom))]

use std::collections::HashMap;
use std::io;
use std::path::Path;
use std::sync::mpsc;
use std::time::Duration;

use blk_drivers::backend::{os_error_code, Backend, Extent, FileBackend, FileOptions};
use blk_drivers::engine::{EngineKind, FileEngine, PoolEngine, UringEngine, UringOp};
use testkit::pattern;

const K: u64 = 1024;

/// A zeroed buffer of `len` bytes at a 4096-aligned address (inside an over-sized `Vec`).
struct Aligned {
    v: Vec<u8>,
    at: usize,
    len: usize,
}

impl Aligned {
    fn new(len: usize) -> Aligned {
        let v = vec![0u8; len + 4096];
        let at = v.as_ptr().align_offset(4096);
        Aligned { v, at, len }
    }
    fn buf(&mut self) -> &mut [u8] {
        &mut self.v[self.at..self.at + self.len]
    }
}

fn create(dir: &Path, name: &str, size: u64, direct: bool) -> FileBackend {
    open(dir, name, false, direct, Some(size))
}

/// The file `name` in `dir`, opened with these options.
fn open(
    dir: &Path,
    name: &str,
    read_only: bool,
    direct: bool,
    create_size: Option<u64>,
) -> FileBackend {
    FileBackend::open(
        dir.join(name),
        FileOptions {
            read_only,
            direct,
            create_size,
            ..FileOptions::default()
        },
    )
    .unwrap()
}

fn read(b: &dyn Backend, offset: u64, len: usize) -> Vec<u8> {
    let mut buf = vec![0xAAu8; len];
    b.read_at(offset, &mut buf).unwrap();
    buf
}

#[test]
fn buffered_round_trip_at_unaligned_offsets() {
    let dir = tempfile::tempdir().unwrap();
    let f = create(dir.path(), "a.img", 1 << 20, false);
    assert_eq!(f.size(), 1 << 20);
    assert!(!f.is_direct());
    assert!(!f.is_block_device());
    let data = pattern(1, 10_000);
    f.write_at(4000, &data, false).unwrap();
    assert_eq!(read(&f, 4000, 10_000), data);
    assert_eq!(read(&f, 8190, 3000), &data[4190..7190]);
    assert!(read(&f, 0, 4000).iter().all(|&b| b == 0));
    assert!(read(&f, 14_000, 50_000).iter().all(|&b| b == 0));
    f.flush().unwrap();
    // Reopening sees the data and the size; create_size never shrinks.
    drop(f);
    let f = create(dir.path(), "a.img", 4096, false);
    assert_eq!(f.size(), 1 << 20);
    assert_eq!(read(&f, 4000, 10_000), data);
    // Out of range: errors, not panics.
    let mut b = [0u8; 8];
    assert!(f.read_at((1 << 20) - 4, &mut b).is_err());
    assert!(f.write_at(u64::MAX - 2, &b, false).is_err());
    assert!(f.discard(1 << 20, 1).is_err());
    assert!(f.extents(0, (1 << 20) + 1, 4).is_err());
}

#[test]
fn open_errors_carry_context() {
    let dir = tempfile::tempdir().unwrap();
    let e = FileBackend::open(dir.path().join("missing"), FileOptions::default()).unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::NotFound);
    assert!(e.to_string().contains("missing"), "{e}");
    assert_eq!(os_error_code(&e), Some(libc::ENOENT));
    // A directory is neither a file nor a block device.
    assert!(FileBackend::open(dir.path(), FileOptions::default()).is_err());
    let ro_create = FileOptions {
        read_only: true,
        create_size: Some(1),
        ..Default::default()
    };
    assert!(FileBackend::open(dir.path().join("x"), ro_create).is_err());
}

#[test]
fn direct_io_round_trip_and_coherence_with_buffered() {
    let dir = tempfile::tempdir().unwrap();
    let f = create(dir.path(), "d.img", 4 << 20, true);
    if !f.is_direct() {
        eprintln!(
            "note: O_DIRECT refused by the file system of {:?}; testing the buffered path only",
            dir.path()
        );
    }
    // Aligned: through the direct descriptor.
    let mut a = Aligned::new(64 * K as usize);
    a.buf().copy_from_slice(&pattern(2, 64 * K as usize));
    f.write_at(128 * K, a.buf(), false).unwrap();
    let mut back = Aligned::new(64 * K as usize);
    f.read_at(128 * K, back.buf()).unwrap();
    assert_eq!(back.buf(), a.buf());
    // Unaligned reads (buffered) see what the direct write wrote...
    assert_eq!(read(&f, 128 * K + 1, 1000), &a.buf()[1..1001]);
    // ...and aligned (direct) reads see buffered writes.
    let small = pattern(3, 777);
    f.write_at(128 * K + 4096 + 5, &small, false).unwrap();
    f.read_at(128 * K, back.buf()).unwrap();
    assert_eq!(&back.buf()[4101..4101 + 777], &small[..]);
    // Aligned offset and length but an unaligned buffer: buffered, still correct.
    let mut v = vec![0u8; 8192 + 1];
    f.read_at(128 * K, &mut v[1..]).unwrap();
    assert_eq!(&v[1..], &back.buf()[..8192]);
    // FUA through the direct descriptor.
    f.write_at(1 << 20, a.buf(), true).unwrap();
    f.read_at(1 << 20, back.buf()).unwrap();
    assert_eq!(back.buf(), a.buf());
}

#[test]
fn fua_write_and_flush() {
    let dir = tempfile::tempdir().unwrap();
    let f = create(dir.path(), "fua.img", 256 * K, false);
    let d = pattern(4, 5000);
    f.write_at(333, &d, true).unwrap();
    assert_eq!(read(&f, 333, 5000), d);
    f.flush().unwrap();
    // The bytes are in the file (another descriptor sees them).
    let raw = std::fs::read(dir.path().join("fua.img")).unwrap();
    assert_eq!(&raw[333..5333], &d[..]);
}

#[test]
fn read_only_refuses_writes_with_erofs() {
    let dir = tempfile::tempdir().unwrap();
    let f = create(dir.path(), "ro.img", 64 * K, false);
    f.write_at(0, b"hello", false).unwrap();
    drop(f);
    let f = open(dir.path(), "ro.img", true, true, None);
    assert!(f.is_read_only());
    assert_eq!(read(&f, 0, 5), b"hello");
    for e in [
        f.write_at(0, b"x", false).unwrap_err(),
        f.discard(0, 4096).unwrap_err(),
        f.write_zeroes(0, 4096, false).unwrap_err(),
    ] {
        assert_eq!(os_error_code(&e), Some(libc::EROFS), "{e}");
    }
    assert!(!f.fast_zero());
    f.flush().unwrap();
}

fn alloc(extents: &[Extent], offset: u64) -> bool {
    extents
        .iter()
        .find(|e| e.offset <= offset && offset < e.offset + e.len)
        .map(|e| e.allocated)
        .unwrap()
}

fn check_covers(extents: &[Extent], offset: u64, len: u64) {
    let mut pos = offset;
    for e in extents {
        assert_eq!(e.offset, pos, "{extents:?}");
        assert!(e.len > 0);
        pos += e.len;
    }
    assert_eq!(pos, offset + len, "{extents:?}");
    for w in extents.windows(2) {
        assert_ne!(w[0].allocated, w[1].allocated, "unmerged: {extents:?}");
    }
}

#[test]
fn extents_via_seek_hole_and_discard_semantics() {
    let dir = tempfile::tempdir().unwrap();
    let size = 4 << 20;
    let f = create(dir.path(), "sparse.img", size, false);
    let whole = f.extents(0, size, 64).unwrap();
    check_covers(&whole, 0, size);
    if whole.len() == 1 && whole[0].allocated {
        eprintln!("note: file system reports no holes (no SEEK_HOLE); skipping hole checks");
        return;
    }
    assert_eq!(
        whole,
        vec![Extent {
            offset: 0,
            len: size,
            allocated: false
        }]
    );
    // Data at 1 MiB..1 MiB+64 KiB and 3 MiB..3 MiB+4 KiB.
    f.write_at(1 << 20, &pattern(5, 64 * K as usize), false)
        .unwrap();
    f.write_at(3 << 20, &pattern(6, 4096), false).unwrap();
    let e = f.extents(0, size, 64).unwrap();
    check_covers(&e, 0, size);
    assert!(!alloc(&e, 0));
    assert!(alloc(&e, 1 << 20));
    assert!(alloc(&e, (1 << 20) + 64 * K - 1));
    assert!(!alloc(&e, 2 << 20));
    assert!(alloc(&e, 3 << 20));
    assert!(!alloc(&e, size - 1));
    // A sub-range starting inside data is clipped to it; max_extents stops short.
    let e = f.extents((1 << 20) + 100, 2 << 20, 64).unwrap();
    check_covers(&e, (1 << 20) + 100, 2 << 20);
    assert!(e[0].allocated && e[0].offset == (1 << 20) + 100);
    let e = f.extents(0, size, 2).unwrap();
    assert_eq!(e.len(), 2);
    assert_eq!(e[1].offset, 1 << 20);

    // Discard punches a hole that reads as zeros.
    assert!(f.fast_zero(), "ext4/xfs/btrfs/tmpfs punch holes");
    f.discard(1 << 20, 32 * K).unwrap();
    assert!(read(&f, 1 << 20, 32 * K as usize).iter().all(|&b| b == 0));
    assert_eq!(
        read(&f, (1 << 20) + 32 * K, 32 * K as usize),
        &pattern(5, 64 * K as usize)[32 * K as usize..]
    );
    let e = f.extents(0, size, 64).unwrap();
    check_covers(&e, 0, size);
    assert!(!alloc(&e, 1 << 20));
    assert!(alloc(&e, (1 << 20) + 32 * K));
    // Unaligned discard: zeros exactly there.
    f.discard((1 << 20) + 40 * K + 3, 5000).unwrap();
    let got = read(&f, (1 << 20) + 32 * K, 32 * K as usize);
    let want = &pattern(5, 64 * K as usize)[32 * K as usize..];
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let inside = (8 * K as usize + 3..8 * K as usize + 3 + 5000).contains(&i);
        assert_eq!(g, if inside { 0 } else { w }, "byte {i}");
    }
    // write_zeroes with and without unmap read back as zeros.
    f.write_zeroes(3 << 20, 4096, false).unwrap();
    assert!(read(&f, 3 << 20, 4096).iter().all(|&b| b == 0));
    f.write_at(3 << 20, &[1; 10], false).unwrap();
    f.write_zeroes((3 << 20) + 1, 4096, true).unwrap();
    assert_eq!(read(&f, 3 << 20, 3), vec![1, 0, 0]);
    let e = f.extents(0, size, 64).unwrap();
    check_covers(&e, 0, size);
    // Nothing is reported as data where nothing was ever written.
    assert!(!alloc(&e, 0) && !alloc(&e, 2 << 20) && !alloc(&e, size - 1));
}

// ---------------------------------------------------------------------------------------------
// Engines
// ---------------------------------------------------------------------------------------------

type Done = mpsc::Receiver<(u64, io::Result<u32>)>;

fn callback() -> (blk_drivers::engine::Callback, Done) {
    let (tx, rx) = mpsc::channel();
    (
        Box::new(move |ud, r| {
            let _ = tx.send((ud, r));
        }),
        rx,
    )
}

fn wait_all(rx: &Done, n: usize) -> HashMap<u64, io::Result<u32>> {
    let mut out = HashMap::new();
    while out.len() < n {
        let (ud, r) = rx
            .recv_timeout(Duration::from_secs(30))
            .expect("engine completion timed out");
        assert!(out.insert(ud, r).is_none(), "op {ud} completed twice");
    }
    out
}

/// One workload: writes at assorted alignments (some direct-eligible, some FUA) in one
/// batch larger than a small ring, an fsync, then reads of everything back through the engine,
/// plus a read running past end of file. Returns the file's bytes.
fn run_engine(engine: &FileEngine, rx: &Done, f: &FileBackend) -> Vec<u8> {
    // (offset, len, fua)
    let mut layout = Vec::new();
    for i in 0..40u64 {
        layout.push((i * 24 * K, 8 * K as usize, i % 5 == 0)); // aligned
        layout.push((i * 24 * K + 9 * K + 17, 5000, i % 7 == 0)); // unaligned
    }
    let mut bufs: Vec<Aligned> = layout
        .iter()
        .enumerate()
        .map(|(i, &(_, len, _))| {
            let mut a = Aligned::new(len);
            a.buf().copy_from_slice(&pattern(100 + i as u64, len));
            a
        })
        .collect();
    let ops: Vec<(UringOp, u64)> = layout
        .iter()
        .zip(bufs.iter_mut())
        .enumerate()
        .map(|(i, (&(off, len, fua), b))| {
            let buf = b.buf();
            // SAFETY: `bufs` lives, unread and unwritten, until every completion is in.
            (
                unsafe { UringOp::write(off, buf.as_ptr(), len as u32, fua) },
                i as u64,
            )
        })
        .collect();
    engine.submit_batch(&ops).unwrap();
    for (ud, r) in wait_all(rx, ops.len()) {
        let (_, len, _) = layout[ud as usize];
        assert_eq!(r.unwrap(), len as u32, "write {ud}");
    }
    engine.submit(UringOp::fsync(), 9999).unwrap();
    let (ud, r) = rx.recv_timeout(Duration::from_secs(30)).unwrap();
    assert_eq!((ud, r.unwrap()), (9999, 0));
    engine.submit(UringOp::nop(), 7777).unwrap();
    let (ud, r) = rx.recv_timeout(Duration::from_secs(30)).unwrap();
    assert_eq!((ud, r.unwrap()), (7777, 0));

    // Read it all back through the engine.
    let mut rbufs: Vec<Aligned> = layout
        .iter()
        .map(|&(_, len, _)| Aligned::new(len))
        .collect();
    let ops: Vec<(UringOp, u64)> = layout
        .iter()
        .zip(rbufs.iter_mut())
        .enumerate()
        .map(|(i, (&(off, len, _), b))| {
            // SAFETY: as above, `rbufs` outlives the completions.
            (
                unsafe { UringOp::read(off, b.buf().as_mut_ptr(), len as u32) },
                i as u64,
            )
        })
        .collect();
    engine.submit_batch(&ops).unwrap();
    for (ud, r) in wait_all(rx, ops.len()) {
        assert_eq!(r.unwrap(), layout[ud as usize].1 as u32, "read {ud}");
    }
    for (i, (r, w)) in rbufs.iter_mut().zip(bufs.iter_mut()).enumerate() {
        assert_eq!(r.buf(), w.buf(), "op {i} read back");
    }
    // And through the synchronous backend.
    for (i, &(off, len, _)) in layout.iter().enumerate() {
        assert_eq!(
            read(f, off, len),
            pattern(100 + i as u64, len),
            "backend {i}"
        );
    }

    // A read running past the end of the file: an error, not a silent short read.
    let mut tail = Aligned::new(8192);
    let end = std::fs::metadata(f.path()).unwrap().len();
    // SAFETY: `tail` outlives the completion.
    let op = unsafe { UringOp::read(end - 4096, tail.buf().as_mut_ptr(), 8192) };
    engine.submit(op, 4242).unwrap();
    let (ud, r) = rx.recv_timeout(Duration::from_secs(30)).unwrap();
    assert_eq!(ud, 4242);
    assert_eq!(r.unwrap_err().kind(), io::ErrorKind::UnexpectedEof);
    // A zero-length transfer completes at once.
    // SAFETY: zero bytes are touched.
    let op = unsafe { UringOp::read(0, tail.buf().as_mut_ptr(), 0) };
    engine.submit(op, 4343).unwrap();
    let (ud, r) = rx.recv_timeout(Duration::from_secs(30)).unwrap();
    assert_eq!((ud, r.unwrap()), (4343, 0));

    std::fs::read(f.path()).unwrap()
}

fn engine_file(dir: &Path, name: &str) -> FileBackend {
    create(dir, name, 1 << 20, true)
}

#[test]
fn pool_engine_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let f = engine_file(dir.path(), "pool.img");
    let (cb, rx) = callback();
    let engine = FileEngine::new(f.engine_files().unwrap(), EngineKind::Pool, 16, 3, cb).unwrap();
    assert_eq!(engine.name(), "pool");
    run_engine(&engine, &rx, &f);
    // Dropping with queued ops lets them finish first.
    let mut bufs: Vec<Aligned> = (0..32).map(|_| Aligned::new(4096)).collect();
    let ops: Vec<_> = bufs
        .iter_mut()
        .enumerate()
        .map(|(i, b)| {
            // SAFETY: `bufs` outlives the engine, which joins its workers on drop.
            let op = unsafe { UringOp::read(i as u64 * 4096, b.buf().as_mut_ptr(), 4096) };
            (op, i as u64)
        })
        .collect();
    engine.submit_batch(&ops).unwrap();
    drop(engine);
    assert_eq!(rx.try_iter().count(), 32);
}

#[test]
fn pool_engine_direct() {
    let dir = tempfile::tempdir().unwrap();
    let f = engine_file(dir.path(), "pool2.img");
    let (cb, rx) = callback();
    let engine = PoolEngine::new(f.engine_files().unwrap(), 2, cb).unwrap();
    assert_eq!(engine.threads(), 2);
    let mut a = Aligned::new(16 * K as usize);
    a.buf().copy_from_slice(&pattern(9, 16 * K as usize));
    // SAFETY: `a` outlives the completion, awaited below.
    let op = unsafe { UringOp::write(64 * K, a.buf().as_ptr(), 16 * K as u32, true) };
    engine.submit(op, 1).unwrap();
    assert_eq!(
        rx.recv_timeout(Duration::from_secs(30)).unwrap().1.unwrap(),
        16 * K as u32
    );
    assert_eq!(
        read(&f, 64 * K, 16 * K as usize),
        pattern(9, 16 * K as usize)
    );
}

#[test]
fn engine_kind_parses() {
    assert_eq!("auto".parse::<EngineKind>().unwrap(), EngineKind::Auto);
    assert_eq!("uring".parse::<EngineKind>().unwrap(), EngineKind::Uring);
    assert_eq!("pool".parse::<EngineKind>().unwrap(), EngineKind::Pool);
    assert_eq!("sync".parse::<EngineKind>().unwrap(), EngineKind::Sync);
    assert_eq!("io_uring".parse::<EngineKind>().unwrap(), EngineKind::Uring);
    assert!("aio".parse::<EngineKind>().is_err());
    for k in [
        EngineKind::Auto,
        EngineKind::Uring,
        EngineKind::Pool,
        EngineKind::Sync,
    ] {
        assert_eq!(k.name().parse::<EngineKind>().unwrap(), k);
    }
}

#[test]
fn the_sync_engine_kind_has_no_asynchronous_engine() {
    let dir = tempfile::tempdir().unwrap();
    let f = engine_file(dir.path(), "sync.img");
    let (cb, _rx) = callback();
    let e = FileEngine::new(f.engine_files().unwrap(), EngineKind::Sync, 8, 2, cb).unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
}

#[test]
fn auto_engine_picks_something_that_works() {
    let dir = tempfile::tempdir().unwrap();
    let f = engine_file(dir.path(), "auto.img");
    let (cb, rx) = callback();
    let engine = FileEngine::new(f.engine_files().unwrap(), EngineKind::Auto, 8, 2, cb).unwrap();
    let want = if UringEngine::available().is_ok() {
        "uring"
    } else {
        "pool"
    };
    assert_eq!(engine.name(), want);
    run_engine(&engine, &rx, &f);
}

#[test]
fn uring_engine_round_trip_and_same_bytes_as_pool() {
    if let Err(e) = UringEngine::available() {
        eprintln!("SKIPPED uring_engine_round_trip_and_same_bytes_as_pool: io_uring unavailable here: {e}");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    // A small ring (8 entries) so the 80-op batches have to wait for room.
    let fu = engine_file(dir.path(), "uring.img");
    let (cb, rx) = callback();
    let engine = FileEngine::new(fu.engine_files().unwrap(), EngineKind::Uring, 8, 0, cb).unwrap();
    assert_eq!(engine.name(), "uring");
    let via_uring = run_engine(&engine, &rx, &fu);
    drop(engine);

    let fp = engine_file(dir.path(), "pool.img");
    let (cb, rx) = callback();
    let engine = FileEngine::new(fp.engine_files().unwrap(), EngineKind::Pool, 8, 4, cb).unwrap();
    let via_pool = run_engine(&engine, &rx, &fp);
    assert_eq!(via_uring.len(), via_pool.len());
    assert!(
        via_uring == via_pool,
        "io_uring and pool engines wrote different bytes"
    );
}

#[test]
fn uring_engine_from_several_threads() {
    if let Err(e) = UringEngine::available() {
        eprintln!("SKIPPED uring_engine_from_several_threads: io_uring unavailable here: {e}");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let f = engine_file(dir.path(), "mt.img");
    let (cb, rx) = callback();
    let engine = UringEngine::new(f.engine_files().unwrap(), 4, cb).unwrap();
    assert_eq!(engine.capacity(), 4);
    const PER: u64 = 50;
    let data: Vec<Vec<Vec<u8>>> = (0..4u64)
        .map(|t| (0..PER).map(|i| pattern(t * 1000 + i, 3000)).collect())
        .collect();
    std::thread::scope(|s| {
        for (t, mine) in data.iter().enumerate() {
            let engine = &engine;
            s.spawn(move || {
                for (i, d) in mine.iter().enumerate() {
                    let n = t as u64 * PER + i as u64;
                    // SAFETY: `data` outlives every completion (awaited below).
                    let op = unsafe { UringOp::write(n * 3000, d.as_ptr(), 3000, false) };
                    engine.submit(op, n).unwrap();
                }
            });
        }
    });
    let done = wait_all(&rx, 4 * PER as usize);
    let bad: Vec<_> = done
        .iter()
        .filter(|(_, r)| !matches!(r, Ok(3000)))
        .collect();
    assert!(bad.is_empty(), "{bad:?}");
    for t in 0..4u64 {
        for i in 0..PER {
            let off = (t * PER + i) * 3000;
            assert_eq!(read(&f, off, 3000), pattern(t * 1000 + i, 3000));
        }
    }
}

/// Errors come back through the callback (a write to a read-only file: `EBADF`), and an
/// engine dropped with ops in flight completes them first. Both engines (io_uring if here).
#[test]
fn engines_report_errors_and_drain_on_drop() {
    let dir = tempfile::tempdir().unwrap();
    let f = engine_file(dir.path(), "rw.img");
    drop(f);
    let ro = open(dir.path(), "rw.img", true, true, None);
    let mut kinds = vec![EngineKind::Pool];
    match UringEngine::available() {
        Ok(()) => kinds.push(EngineKind::Uring),
        Err(e) => {
            eprintln!("SKIPPED the io_uring half of engines_report_errors_and_drain_on_drop: {e}")
        }
    }
    for kind in kinds {
        let (cb, rx) = callback();
        let engine = FileEngine::new(ro.engine_files().unwrap(), kind, 4, 2, cb).unwrap();
        let mut a = Aligned::new(4096);
        // SAFETY: `a` outlives the completion, awaited below.
        let op = unsafe { UringOp::write(0, a.buf().as_ptr(), 4096, false) };
        engine.submit(op, 1).unwrap();
        let (ud, r) = rx.recv_timeout(Duration::from_secs(30)).unwrap();
        assert_eq!(ud, 1);
        let e = r.unwrap_err();
        assert_eq!(os_error_code(&e), Some(libc::EBADF), "{kind:?}: {e}");

        let mut bufs: Vec<Aligned> = (0..64).map(|_| Aligned::new(4096)).collect();
        let ops: Vec<_> = bufs
            .iter_mut()
            .enumerate()
            .map(|(i, b)| {
                let off = (i as u64 % 16) * 4096 + (i as u64 % 3);
                // SAFETY: `bufs` outlives the engine, which completes everything on drop.
                let op = unsafe { UringOp::read(off, b.buf().as_mut_ptr(), 4096) };
                (op, i as u64)
            })
            .collect();
        engine.submit_batch(&ops).unwrap();
        drop(engine);
        let done: Vec<_> = rx.try_iter().collect();
        assert_eq!(done.len(), 64, "{kind:?}");
        assert!(done.iter().all(|(_, r)| matches!(r, Ok(4096))), "{kind:?}");
    }
}

/// The remembered data run answers queries inside it, and a discard or zeroing inside it is
/// seen at once (the run is forgotten), on the file system of the temporary directory and on
/// tmpfs.
#[test]
fn known_data_run_is_forgotten_by_discard_and_zeroing() {
    let tmp = tempfile::tempdir().unwrap();
    let shm = Path::new("/dev/shm")
        .is_dir()
        .then(|| tempfile::tempdir_in("/dev/shm").unwrap());
    let dirs = [Some(tmp.path()), shm.as_ref().map(|d| d.path())];
    for dir in dirs.into_iter().flatten() {
        let size = 2 << 20;
        let f = create(dir, "known.img", size, false);
        let whole = f.extents(0, size, 64).unwrap();
        if whole.len() == 1 && whole[0].allocated {
            eprintln!("note: no SEEK_HOLE in {}; skipped", dir.display());
            continue;
        }
        f.write_at(0, &pattern(7, 1 << 20), false).unwrap();
        // Fills the run [0, 1 MiB), then answers from it.
        for _ in 0..2 {
            let e = f.extents(4096, 4096, 8).unwrap();
            assert_eq!(
                e,
                vec![Extent {
                    offset: 4096,
                    len: 4096,
                    allocated: true
                }]
            );
        }
        f.discard(64 * K, 64 * K).unwrap();
        let e = f.extents(64 * K, 4096, 8).unwrap();
        assert!(
            !e[0].allocated,
            "{}: discard not seen: {e:?}",
            dir.display()
        );
        // The run is found again, then zeroing with unmap punches inside it.
        assert!(f.extents(512 * K, 4096, 8).unwrap()[0].allocated);
        f.write_zeroes(512 * K, 64 * K, true).unwrap();
        let e = f.extents(512 * K, 4096, 8).unwrap();
        assert!(
            !e[0].allocated,
            "{}: zeroing not seen: {e:?}",
            dir.display()
        );
        // Past the data: a hole, whatever was remembered.
        assert!(!f.extents(size - 4096, 4096, 8).unwrap()[0].allocated);
        assert!(read(&f, 64 * K, 4096).iter().all(|&b| b == 0));
    }
}

/// `read_nowait` reads what the page cache holds, and never claims a read it did not do.
#[test]
fn read_nowait_from_the_page_cache() {
    let dir = tempfile::tempdir().unwrap();
    let f = create(dir.path(), "nowait.img", 1 << 20, false);
    f.write_at(8192, &pattern(9, 8192), false).unwrap();
    let mut buf = vec![0u8; 8192];
    for _ in 0..4 {
        match f.read_nowait(8192, &mut buf) {
            Some(r) => {
                r.unwrap();
                assert_eq!(buf, pattern(9, 8192));
            }
            None => eprintln!("note: RWF_NOWAIT read refused or would block here"),
        }
    }
    // Out of range: left to the normal path, which reports it.
    assert!(f.read_nowait(1 << 20, &mut buf).is_none());
}
