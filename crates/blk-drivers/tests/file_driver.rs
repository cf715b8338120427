//! `file:` devices through a `Queue` built from a spec, on every engine: io_uring (where the
//! kernel and container allow it), the thread pool, and synchronous. Data round trips from
//! several threads with many bios in flight, FUA, flush, discard and write-zeroes, errors
//! (out of range, read-only, end of file), and the spec options.
// A plain threaded test or benchmark, never a loom model: its own harness (std locks, atomics,
// condition variables, baselines) is not what a model must explore, so it may use std::sync.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]
#![cfg(not(blkq_loom))]

use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use blk::{Bio, BioFlags, Buffer, Device, EndIo, Error, Op, Queue, SECTOR_SHIFT};
use blk_drivers::engine::UringEngine;
use blk_drivers::spec::{DeviceSpec, QueueOverrides};
use testkit::{pattern, Collect};

const DEV_SIZE: u64 = 8 << 20;

/// The engines to test here: io_uring only where it works.
fn engines() -> Vec<&'static str> {
    let mut v = vec!["pool", "sync", "auto"];
    match UringEngine::available() {
        Ok(()) => v.insert(0, "uring"),
        Err(e) => eprintln!("note: io_uring unavailable here ({e}); testing pool and sync only"),
    }
    v
}

fn image(dir: &Path, name: &str, size: u64) -> PathBuf {
    let p = dir.join(name);
    let f = std::fs::File::create(&p).unwrap();
    f.set_len(size).unwrap();
    p
}

fn build(spec: &str) -> Result<Queue, Error> {
    spec.parse::<DeviceSpec>()?
        .build(&QueueOverrides::default())
}

fn queue(path: &Path, opts: &str) -> Queue {
    let spec = format!("file:{}{opts}", path.display());
    build(&spec).unwrap_or_else(|e| panic!("{spec}: {e}"))
}

/// Runs one bio to completion.
fn run(q: &Queue, bio: Bio) -> (Bio, Result<(), Error>) {
    let c = Arc::new(Collect::default());
    let end: Arc<dyn EndIo> = c.clone();
    q.submit(bio, &end);
    let mut v = c.take();
    assert_eq!(v.len(), 1);
    v.pop().unwrap()
}

fn write(q: &Queue, off: u64, data: &[u8], flags: BioFlags) {
    let mut buf = Buffer::new(data.len());
    buf.as_mut_slice().copy_from_slice(data);
    let mut bio = Bio::with_buf(Op::Write, off >> SECTOR_SHIFT, buf);
    bio.flags = flags;
    let (_, r) = run(q, bio);
    r.unwrap_or_else(|e| panic!("write at {off}: {e}"));
}

fn read(q: &Queue, off: u64, len: usize) -> Vec<u8> {
    let mut buf = Buffer::new(len);
    buf.as_mut_slice().fill(0xAA);
    let (bio, r) = run(q, Bio::with_buf(Op::Read, off >> SECTOR_SHIFT, buf));
    r.unwrap_or_else(|e| panic!("read at {off}: {e}"));
    bio.buf.unwrap().as_slice().to_vec()
}

/// Block `i`'s offset and length: 4 KiB-aligned 8 KiB blocks (direct-eligible) and 1536-byte
/// blocks at 512-byte alignment (buffered), interleaved, never overlapping.
fn block(i: u64) -> (u64, usize) {
    let base = i * 16 * 1024;
    if i.is_multiple_of(2) {
        (base, 8192)
    } else {
        (base + 8192 + 512, 1536)
    }
}

const BLOCKS: u64 = 256;
const IODEPTH: usize = 8;

/// Thread `t` of `threads`: writes (or reads and checks) its blocks with `IODEPTH` bios in
/// flight, submitted in plugged batches.
fn stream(q: &Queue, t: u64, threads: u64, op: Op) {
    let c = Arc::new(Collect::default());
    let end: Arc<dyn EndIo> = c.clone();
    let mut todo: Vec<u64> = (0..BLOCKS).filter(|i| i % threads == t).collect();
    todo.reverse();
    let mut in_flight = 0usize;
    let mut plug = blk::Plug::new(IODEPTH);
    while !todo.is_empty() || in_flight > 0 {
        while in_flight < IODEPTH {
            let Some(i) = todo.pop() else { break };
            let (off, len) = block(i);
            let mut buf = Buffer::new(len);
            if op == Op::Write {
                buf.as_mut_slice().copy_from_slice(&pattern(i, len));
            } else {
                buf.as_mut_slice().fill(0xAA);
            }
            let mut bio = Bio::with_buf(op, off >> SECTOR_SHIFT, buf);
            bio.cookie = i;
            // Every fourth write is FUA.
            if op == Op::Write && i % 4 == 1 {
                bio.flags = BioFlags::FUA;
            }
            q.submit_plugged(&mut plug, bio, &end);
            in_flight += 1;
        }
        q.flush_plug(&mut plug);
        for (bio, r) in c.take() {
            in_flight -= 1;
            let i = bio.cookie;
            r.unwrap_or_else(|e| panic!("{op:?} of block {i}: {e}"));
            if op == Op::Read {
                let (_, len) = block(i);
                assert!(
                    bio.buf.as_ref().unwrap().as_slice() == pattern(i, len).as_slice(),
                    "block {i} read back wrong"
                );
            }
        }
    }
}

fn round_trip(engine: &str, direct: bool) {
    round_trip_in(engine, direct, true, None);
}

/// The round trip with inline I/O on or off, in `dir` (a temporary directory if `None`).
fn round_trip_in(engine: &str, direct: bool, inline: bool, dir: Option<&Path>) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = dir.unwrap_or(tmp.path());
    let path = image(dir, "rt.img", DEV_SIZE);
    let opts = format!(
        ",engine={engine},direct={},queue_depth=16,inline={}",
        u8::from(direct),
        u8::from(inline)
    );
    let q = Arc::new(queue(&path, &opts));
    let d = q.describe();
    if engine != "auto" {
        assert!(d.contains(&format!("engine={engine}")), "{d}");
    }
    for op in [Op::Write, Op::Read] {
        std::thread::scope(|s| {
            for t in 0..2 {
                let q = &q;
                s.spawn(move || stream(q, t, 2, op));
            }
        });
    }
    // A flush, then the same bytes through the file system.
    let (_, r) = run(&q, Bio::new(Op::Flush, 0, 0));
    r.unwrap();
    let disk = std::fs::read(&path).unwrap();
    for i in 0..BLOCKS {
        let (off, len) = block(i);
        assert_eq!(
            &disk[off as usize..off as usize + len],
            pattern(i, len).as_slice(),
            "{engine}: block {i} on disk"
        );
    }
    // Unwritten space reads back as zeros.
    assert!(read(&q, BLOCKS * 16 * 1024, 4096).iter().all(|&b| b == 0));
    let st = q.stats();
    assert!(st.ios[0] >= BLOCKS && st.ios[1] >= BLOCKS, "{st:?}");
}

#[test]
fn pattern_round_trip_from_two_threads_every_engine() {
    for e in engines() {
        round_trip(e, false);
    }
}

#[test]
fn pattern_round_trip_without_inline_io_every_engine() {
    for e in engines() {
        round_trip_in(e, false, false, None);
    }
}

/// On tmpfs every request of an asynchronous engine runs inline (the file is memory).
#[test]
fn pattern_round_trip_on_tmpfs_every_engine() {
    let shm = Path::new("/dev/shm");
    if !shm.is_dir() {
        eprintln!("note: no /dev/shm here; skipped");
        return;
    }
    let dir = tempfile::tempdir_in(shm).unwrap();
    for e in engines() {
        round_trip_in(e, false, true, Some(dir.path()));
        std::fs::remove_file(dir.path().join("rt.img")).unwrap();
    }
}

#[test]
fn pattern_round_trip_direct_every_engine() {
    for e in engines() {
        round_trip(e, true);
    }
}

#[test]
fn fua_flush_discard_write_zeroes() {
    for e in engines() {
        let dir = tempfile::tempdir().unwrap();
        let path = image(dir.path(), "z.img", DEV_SIZE);
        let q = queue(&path, &format!(",engine={e}"));
        let data = pattern(7, 64 * 1024);
        write(&q, 1 << 20, &data, BioFlags::FUA);
        assert_eq!(read(&q, 1 << 20, data.len()), data, "{e}: FUA write");
        let (_, r) = run(&q, Bio::new(Op::Flush, 0, 0));
        r.unwrap_or_else(|err| panic!("{e}: flush: {err}"));

        // Discard the middle 16 KiB: zeros there, the data around it intact.
        let (_, r) = run(&q, Bio::new(Op::Discard, ((1 << 20) + 8192) >> 9, 16384));
        r.unwrap_or_else(|err| panic!("{e}: discard: {err}"));
        let back = read(&q, 1 << 20, data.len());
        assert_eq!(&back[..8192], &data[..8192], "{e}");
        assert!(back[8192..24576].iter().all(|&b| b == 0), "{e}: discard");
        assert_eq!(&back[24576..], &data[24576..], "{e}");

        // Write-zeroes, with and without NO_HOLE, on unaligned-to-4K sectors.
        for (i, flags) in [BioFlags::NONE, BioFlags::NO_HOLE].into_iter().enumerate() {
            let off = (1 << 20) + 32768 + i as u64 * 8192 + 512;
            let mut bio = Bio::new(Op::WriteZeroes, off >> 9, 3072);
            bio.flags = flags;
            let (_, r) = run(&q, bio);
            r.unwrap_or_else(|err| panic!("{e}: write_zeroes {flags:?}: {err}"));
            let back = read(&q, off - 512, 4096);
            assert_eq!(
                &back[..512],
                &data[(off - 512 - (1 << 20)) as usize..][..512]
            );
            assert!(back[512..3584].iter().all(|&b| b == 0), "{e}: write_zeroes");
            assert_eq!(
                &back[3584..],
                &data[(off + 3072 - (1 << 20)) as usize..][..512]
            );
        }
    }
}

#[test]
fn out_of_range_and_bad_bios_get_einval() {
    for e in engines() {
        let dir = tempfile::tempdir().unwrap();
        let path = image(dir.path(), "r.img", 1 << 20);
        let q = queue(&path, &format!(",engine={e}"));
        let cases = [
            Bio::with_buf(Op::Read, (1 << 20) >> 9, Buffer::new(512)), // past the end
            Bio::with_buf(Op::Write, ((1 << 20) - 512) >> 9, Buffer::new(1024)), // straddles
            Bio::new(Op::Discard, (1 << 20) >> 9, 4096),
            Bio::new(Op::Read, 0, 4096), // no buffer
        ];
        for bio in cases {
            let desc = format!("{e}: {bio:?}");
            let (_, r) = run(&q, bio);
            assert_eq!(r.expect_err(&desc).errno(), libc::EINVAL, "{desc}");
        }
    }
}

#[test]
fn read_past_a_shrunk_file_is_an_error_not_a_short_read() {
    for e in engines() {
        let dir = tempfile::tempdir().unwrap();
        let path = image(dir.path(), "s.img", 1 << 20);
        let q = queue(&path, &format!(",engine={e}"));
        write(&q, 0, &pattern(3, 8192), BioFlags::NONE);
        // Shrink the file under the device: the queue still thinks it is 1 MiB.
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(4096)
            .unwrap();
        let (_, r) = run(&q, Bio::with_buf(Op::Read, 0, Buffer::new(8192)));
        let err = r.expect_err(e);
        assert_eq!(err.errno(), libc::EIO, "{e}: {err}");
        // A read entirely past the new end, too.
        let (_, r) = run(&q, Bio::with_buf(Op::Read, 16, Buffer::new(4096)));
        assert!(r.is_err(), "{e}");
    }
}

#[test]
fn read_only_devices_refuse_writes_with_erofs() {
    for e in engines() {
        let dir = tempfile::tempdir().unwrap();
        let path = image(dir.path(), "ro.img", 1 << 20);
        std::fs::write(&path, pattern(9, 1 << 20)).unwrap();
        let q = queue(&path, &format!(",engine={e},ro=1"));
        assert!(q.describe().contains("ro=1"), "{}", q.describe());
        assert_eq!(read(&q, 4096, 4096), &pattern(9, 1 << 20)[4096..8192]);
        for bio in [
            Bio::with_buf(Op::Write, 0, Buffer::new(4096)),
            Bio::new(Op::Discard, 0, 4096),
            Bio::new(Op::WriteZeroes, 0, 4096),
        ] {
            let desc = format!("{e}: {bio:?}");
            let (_, r) = run(&q, bio);
            assert_eq!(r.expect_err(&desc).errno(), libc::EROFS, "{desc}");
        }
        let (_, r) = run(&q, Bio::new(Op::Flush, 0, 0));
        r.unwrap();
    }
}

/// An `EndIo` that submits the next bio from inside the completion (on the engine's reaper or
/// worker), until `left` runs out; with a ring smaller than the queue's tags.
struct Chain {
    q: Mutex<Option<Arc<Queue>>>,
    left: Mutex<u64>,
    me: Mutex<Option<Arc<dyn EndIo>>>,
    finished: Mutex<u64>,
    cv: Condvar,
    errors: Mutex<Vec<String>>,
}

impl EndIo for Chain {
    fn end_io(&self, mut bio: Bio, res: Result<(), Error>) {
        if let Err(e) = res {
            self.errors.lock().unwrap().push(e.to_string());
        }
        let next = {
            let mut l = self.left.lock().unwrap();
            if *l == 0 {
                None
            } else {
                *l -= 1;
                Some(*l)
            }
        };
        match next {
            Some(n) => {
                let q = self.q.lock().unwrap().clone().unwrap();
                let me = self.me.lock().unwrap().clone().unwrap();
                bio.sector = (n % 64) * 8;
                bio.op = if n % 3 == 0 { Op::Write } else { Op::Read };
                q.submit(bio, &me);
            }
            None => {
                *self.finished.lock().unwrap() += 1;
                self.cv.notify_all();
            }
        }
    }
}

#[test]
fn resubmitting_from_completions_with_a_tiny_ring() {
    for e in engines() {
        if e == "sync" {
            continue; // inline completion: the chain would recurse
        }
        let dir = tempfile::tempdir().unwrap();
        let path = image(dir.path(), "c.img", 1 << 20);
        let q = Arc::new(queue(
            &path,
            // inline=0: completions must come from the engine (an inline completion that
            // submits again would recurse, as with engine=sync).
            &format!(",engine={e},entries=2,workers=2,queue_depth=32,inline=0"),
        ));
        let chain = Arc::new(Chain {
            q: Mutex::new(Some(q.clone())),
            left: Mutex::new(2000),
            me: Mutex::new(None),
            finished: Mutex::new(0),
            cv: Condvar::new(),
            errors: Mutex::new(vec![]),
        });
        let me: Arc<dyn EndIo> = chain.clone();
        *chain.me.lock().unwrap() = Some(me.clone());
        const CHAINS: u64 = 24;
        let mut plug = blk::Plug::new(CHAINS as usize);
        for i in 0..CHAINS {
            q.submit_plugged(
                &mut plug,
                Bio::with_buf(Op::Read, i * 8, Buffer::new(4096)),
                &me,
            );
        }
        q.flush_plug(&mut plug);
        {
            let g = chain.finished.lock().unwrap();
            let (_g, t) = chain
                .cv
                .wait_timeout_while(g, Duration::from_secs(60), |f| *f < CHAINS)
                .unwrap();
            assert!(!t.timed_out(), "{e}: chains did not finish");
        }
        assert!(
            chain.errors.lock().unwrap().is_empty(),
            "{e}: {:?}",
            chain.errors.lock().unwrap()
        );
        // Break the cycle chain -> queue before dropping the queue.
        *chain.me.lock().unwrap() = None;
        chain.q.lock().unwrap().take();
        drop(me);
        let st = q.stats();
        assert_eq!(st.ios[0] + st.ios[1], CHAINS + 2000, "{e}: {st:?}");
        drop(q);
    }
}

#[test]
fn spec_options_and_errors() {
    let dir = tempfile::tempdir().unwrap();
    let path = image(dir.path(), "o.img", 1 << 20);
    let p = path.display();
    // Defaults: auto picks io_uring where it works, with one entry per tag.
    // One queue at a time: each open locks the file (flock), a second open of it is refused.
    let d = build(&format!("file:{p},queue_depth=48,hw_queues=2"))
        .unwrap()
        .describe();
    if UringEngine::available().is_ok() {
        assert!(
            d.contains("engine=uring") && d.contains("entries=128"),
            "{d}"
        );
        let q = build(&format!("file:{p},engine=uring,entries=100")).unwrap();
        assert!(q.describe().contains("entries=128"), "{}", q.describe());
    } else {
        assert!(d.contains("engine=pool"), "{d}");
    }
    assert!(d.contains(&format!("path={p}")), "{d}");
    let q = build(&format!("file:{p},engine=pool,workers=3")).unwrap();
    assert!(q.describe().contains("engine=pool"), "{}", q.describe());
    assert!(q.describe().contains("workers=3"), "{}", q.describe());
    drop(q);
    let q = build(&format!("file:{p},engine=sync,direct=1")).unwrap();
    assert!(q.describe().contains("engine=sync"), "{}", q.describe());
    drop(q);
    for bad in [
        "engine=bogus",
        "engine=",
        "workers=0",
        "workers=many",
        "entries=0",
        "entries=-1",
        "entries=99999999",
        "direct=maybe",
        "bogus=1",
    ] {
        match build(&format!("file:{p},{bad}")) {
            Err(Error::Config(msg)) => assert!(!msg.is_empty()),
            other => panic!("{bad}: expected a config error, got {other:?}"),
        }
    }
    let Err(Error::Config(msg)) = build(&format!("file:{p},engine=bogus")) else {
        unreachable!()
    };
    assert!(msg.contains("bogus") && msg.contains("uring"), "{msg}");
    // engine= belongs to file devices only.
    assert!(matches!(build("mem:1M,engine=pool"), Err(Error::Config(_))));
}

#[test]
fn extents_through_the_driver() {
    for e in engines() {
        let dir = tempfile::tempdir().unwrap();
        let path = image(dir.path(), "x.img", 1 << 20);
        let q = queue(&path, &format!(",engine={e}"));
        write(&q, 64 * 1024, &pattern(1, 4096), BioFlags::NONE);
        let ext = q.extents(0, 1 << 20, 16).unwrap();
        assert_eq!(ext.first().unwrap().offset, 0);
        let end = ext.last().map(|x| x.offset + x.len).unwrap();
        assert_eq!(end, 1 << 20, "{e}: {ext:?}");
        assert!(
            ext.iter()
                .any(|x| x.allocated && x.offset <= 64 * 1024 && x.offset + x.len > 64 * 1024),
            "{e}: {ext:?}"
        );
    }
}
