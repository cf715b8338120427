//! The `rbd:` device against a real single-node Ceph cluster (`testkit::ceph`, started once
//! for this binary by `scripts/ceph-cluster.sh`): every op round-trips through librbd, the
//! image's size and object size are the limits, the exclusive lock refuses a second user, and
//! a snapshot is read-only, in both completion modes (`completion=poll`, the default, and
//! `completion=callback`); the polled completions come in batches. Skips, saying why, where no
//! cluster can be had. A FUA discard or write-zeroes is flushed as a FUA write is, which this
//! binary sees in librbd's calls themselves (see [`librbd_calls`]).
#![cfg(all(not(blkq_loom), blkq_rbd))]
// A plain threaded test binary, never a loom model: its own record of librbd's calls may use
// std::sync.
#![allow(clippy::disallowed_types)]

use blk::{Bio, BioFlags, Buffer, Device, Error, Op, Queue, QueueConfig, SECTOR_SHIFT};
use blk_drivers::rbd::{CompletionMode, RbdConfig, RbdDriver};
use blk_drivers::spec::{DeviceSpec, QueueOverrides};
use blkq_sync::DynArc;
use testkit::ceph::Cluster;
use testkit::io::{flush, read_at, submit_wait, write_at};
use testkit::pattern;

/// What the driver asks of librbd, seen from the calls themselves: this binary defines
/// `rbd_open` and `rbd_aio_flush`, which the linker then uses instead of librbd's for every
/// caller in the binary (the driver included: an executable's symbols come before a shared
/// library's). Each records the call and hands it on to librbd's own, found with
/// `dlsym(RTLD_NEXT)`. Flushes are counted per image handle, and `rbd_open` says which handle
/// is which image, so tests running at once on other images do not mix.
mod librbd_calls {
    use std::ffi::{c_char, c_int, c_void, CStr};
    use std::sync::{Mutex, OnceLock};

    type Open =
        unsafe extern "C" fn(*mut c_void, *const c_char, *mut *mut c_void, *const c_char) -> c_int;
    type Flush = unsafe extern "C" fn(*mut c_void, *mut c_void) -> c_int;

    /// (image handle, image name) of every open, newest last.
    static OPENED: Mutex<Vec<(usize, String)>> = Mutex::new(Vec::new());
    /// The image handle of every flush sent.
    static FLUSHED: Mutex<Vec<usize>> = Mutex::new(Vec::new());

    /// librbd's own `name` (the next definition after this binary's).
    fn next(name: &CStr, cell: &OnceLock<usize>) -> usize {
        *cell.get_or_init(|| {
            // SAFETY: a NUL-terminated symbol name; RTLD_NEXT searches the objects loaded
            // after this executable, librbd among them.
            let f = unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr()) } as usize;
            assert!(f != 0, "dlsym(RTLD_NEXT, {name:?}) found nothing");
            f
        })
    }

    /// librbd's `rbd_open`, recorded.
    #[no_mangle]
    pub unsafe extern "C" fn rbd_open(
        io: *mut c_void,
        name: *const c_char,
        image: *mut *mut c_void,
        snap: *const c_char,
    ) -> c_int {
        static REAL: OnceLock<usize> = OnceLock::new();
        // SAFETY: the address dlsym gave for librbd's `rbd_open`, which has this type.
        let real: Open = unsafe { std::mem::transmute(next(c"rbd_open", &REAL)) };
        // SAFETY: the caller's arguments, handed on unchanged.
        let r = unsafe { real(io, name, image, snap) };
        if r == 0 {
            // SAFETY: on success librbd filled `*image`; `name` is the caller's C string.
            let (h, n) = unsafe { (*image as usize, CStr::from_ptr(name)) };
            let n = n.to_string_lossy().into_owned();
            OPENED
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push((h, n));
        }
        r
    }

    /// librbd's `rbd_aio_flush`, recorded (before it is sent: its completion may complete the
    /// request before the call returns).
    #[no_mangle]
    pub unsafe extern "C" fn rbd_aio_flush(image: *mut c_void, c: *mut c_void) -> c_int {
        static REAL: OnceLock<usize> = OnceLock::new();
        FLUSHED
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(image as usize);
        // SAFETY: the address dlsym gave for librbd's `rbd_aio_flush`, which has this type.
        let real: Flush = unsafe { std::mem::transmute(next(c"rbd_aio_flush", &REAL)) };
        // SAFETY: the caller's arguments, handed on unchanged.
        unsafe { real(image, c) }
    }

    /// The handle of the image named `name` most recently opened.
    pub fn handle(name: &str) -> usize {
        OPENED
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .rev()
            .find(|(_, n)| n == name)
            .map(|(h, _)| *h)
            .unwrap_or_else(|| panic!("no rbd_open of {name} recorded; is the hook linked?"))
    }

    /// Flushes sent so far on image handle `h`.
    pub fn flushes(h: usize) -> usize {
        FLUSHED
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter(|&&x| x == h)
            .count()
    }
}

fn open(spec: &str) -> Result<DynArc<dyn Device>, Error> {
    spec.parse::<DeviceSpec>()?
        .build_device(&QueueOverrides::default())
}

fn zeroed(dev: &dyn Device, op: Op, offset: u64, len: u32, flags: BioFlags) {
    let mut b = Bio::new(op, offset >> SECTOR_SHIFT, len);
    b.flags = flags;
    let (_, r) = submit_wait(dev, b);
    r.unwrap_or_else(|e| panic!("{op:?} at {offset}: {e}"));
    assert!(
        read_at(dev, offset, len as usize)
            .unwrap()
            .iter()
            .all(|&x| x == 0),
        "{op:?} at {offset} left data"
    );
}

#[test]
fn every_op_round_trips_through_librbd_with_polled_completions() {
    let Some(c) = Cluster::or_skip("every_op_round_trips_through_librbd_with_polled_completions")
    else {
        return;
    };
    // The default.
    round_trips(c, "ops-poll", "");
}

#[test]
fn every_op_round_trips_through_librbd_with_callbacks() {
    let Some(c) = Cluster::or_skip("every_op_round_trips_through_librbd_with_callbacks") else {
        return;
    };
    round_trips(c, "ops-callback", ",completion=callback");
}

fn round_trips(c: &Cluster, image: &str, opts: &str) {
    c.create_image(image, "64M");
    let dev = open(&c.spec(image, opts)).unwrap();
    let l = dev.limits();
    assert_eq!(l.capacity, 64 << 20);
    assert_eq!(
        l.max_io_bytes,
        4 << 20,
        "one 4 MiB object per I/O by default"
    );
    // A fresh image is all holes.
    let ext = dev.extents(0, 64 << 20, 16).unwrap();
    assert!(ext.iter().all(|e| !e.allocated), "{ext:?}");

    // Writes of every size up to the largest, across object boundaries, read back.
    for (i, (off, len)) in [
        (0u64, 4096usize),
        (8192, 512),
        ((4 << 20) - 4096, 8192),
        (12 << 20, 4 << 20),
        ((64 << 20) - 65536, 65536),
    ]
    .into_iter()
    .enumerate()
    {
        let data = pattern(i as u64 + 1, len);
        write_at(&*dev, off, &data).unwrap();
        assert_eq!(read_at(&*dev, off, len).unwrap(), data, "at {off}+{len}");
    }
    flush(&*dev).unwrap();

    // FUA: a write then a flush, completed once.
    let data = pattern(9, 65536);
    let mut buf = Buffer::new(data.len());
    buf.as_mut_slice().copy_from_slice(&data);
    let mut b = Bio::with_buf(Op::Write, (20 << 20) >> SECTOR_SHIFT, buf);
    b.flags = BioFlags::FUA;
    submit_wait(&*dev, b).1.unwrap();
    assert_eq!(read_at(&*dev, 20 << 20, data.len()).unwrap(), data);

    // The allocation map: written objects allocated, the rest holes.
    let ext = dev.extents(0, 64 << 20, 64).unwrap();
    assert!(
        ext.iter().any(|e| e.allocated && e.offset <= 12 << 20),
        "{ext:?}"
    );
    assert!(ext.iter().any(|e| !e.allocated), "{ext:?}");
    assert_eq!(ext.iter().map(|e| e.len).sum::<u64>(), 64 << 20, "{ext:?}");
    let two = dev.extents(0, 64 << 20, 2).unwrap();
    assert!(two.len() <= 2, "{two:?}");

    // Discard (a whole object: deallocated) and write-zeroes (with and without a hole).
    zeroed(&*dev, Op::Discard, 12 << 20, 4 << 20, BioFlags::NONE);
    zeroed(&*dev, Op::WriteZeroes, 0, 4096, BioFlags::NONE);
    zeroed(
        &*dev,
        Op::WriteZeroes,
        (4 << 20) - 4096,
        8192,
        BioFlags::NO_HOLE,
    );
    assert_eq!(
        read_at(&*dev, 8192, 512).unwrap(),
        pattern(2, 512),
        "neighbour kept"
    );

    // Beyond the end: refused by the queue, nothing sent.
    let (_, r) = submit_wait(
        &*dev,
        Bio::with_buf(Op::Read, (64 << 20) >> SECTOR_SHIFT, Buffer::new(4096)),
    );
    assert!(r.is_err());

    // Many in flight at once: every one completes with its own data.
    let pending: Vec<_> = (0..64u64)
        .map(|i| {
            let mut buf = Buffer::new(4096);
            buf.as_mut_slice().copy_from_slice(&pattern(100 + i, 4096));
            blk::PendingBio::submit(
                &*dev,
                Bio::with_buf(Op::Write, (i * 8192) >> SECTOR_SHIFT, buf),
            )
        })
        .collect();
    for p in pending {
        p.wait().1.unwrap();
    }
    for i in 0..64u64 {
        assert_eq!(
            read_at(&*dev, i * 8192, 4096).unwrap(),
            pattern(100 + i, 4096)
        );
    }
    drop(dev);
    // Reopened: the data is in the cluster.
    let dev = open(&c.spec(image, opts)).unwrap();
    assert_eq!(read_at(&*dev, 63 * 8192, 4096).unwrap(), pattern(163, 4096));
}

#[test]
fn a_second_user_of_the_image_is_refused_naming_it() {
    let Some(c) = Cluster::or_skip("a_second_user_of_the_image_is_refused_naming_it") else {
        return;
    };
    c.create_image("locked", "16M");
    let first = open(&c.spec("locked", "")).unwrap();
    write_at(&*first, 0, &pattern(1, 4096)).unwrap();
    let e = match open(&c.spec("locked", "")) {
        Ok(_) => panic!("a second open of rbd/locked was allowed"),
        Err(e) => e.to_string(),
    };
    assert!(e.contains("rbd:rbd/locked"), "{e}");
    assert!(e.contains("in use"), "{e}");
    // The first keeps its lock and goes on writing.
    write_at(&*first, 4096, &pattern(2, 4096)).unwrap();
    assert_eq!(read_at(&*first, 4096, 4096).unwrap(), pattern(2, 4096));
    drop(first);
    // Released with the device: the next user gets it.
    let again = open(&c.spec("locked", "")).unwrap();
    assert_eq!(read_at(&*again, 0, 4096).unwrap(), pattern(1, 4096));
}

#[test]
fn a_snapshot_is_read_only_and_errors_name_the_image() {
    let Some(c) = Cluster::or_skip("a_snapshot_is_read_only_and_errors_name_the_image") else {
        return;
    };
    c.create_image("snapped", "16M");
    {
        let dev = open(&c.spec("snapped", "")).unwrap();
        write_at(&*dev, 0, &pattern(5, 4096)).unwrap();
    }
    c.rbd(&["snap", "create", "rbd/snapped@s1"]).unwrap();
    {
        let dev = open(&c.spec("snapped", "")).unwrap();
        write_at(&*dev, 0, &pattern(6, 4096)).unwrap();
    }
    let snap = open(&c.spec("snapped", ",snap=s1,completion=callback")).unwrap();
    assert_eq!(read_at(&*snap, 0, 4096).unwrap(), pattern(5, 4096));
    let e = write_at(&*snap, 0, &pattern(7, 4096)).unwrap_err();
    assert_eq!(e.errno(), libc::EROFS, "{e}");
    flush(&*snap).unwrap();

    let e = open(&c.spec("nosuch", ""))
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("rbd:rbd/nosuch") && e.contains("opening the image"),
        "{e}"
    );
    let e = open("rbd:rbd/x,conf=/nonexistent/ceph.conf")
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(e.contains("/nonexistent/ceph.conf"), "{e}");
    let e = open(&c.spec("snapped", ",completion=sometimes"))
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(e.contains("completion") && e.contains("sometimes"), "{e}");
    let e = open(&c.spec("snapped", ",bogus=1"))
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(e.contains("bogus") && e.contains("rbd"), "{e}");
}

#[test]
fn polled_completions_come_in_batches_under_a_deep_load() {
    let Some(c) = Cluster::or_skip("polled_completions_come_in_batches_under_a_deep_load") else {
        return;
    };
    c.create_image("batched", "64M");
    let mut cfg = RbdConfig::parse_target("rbd/batched").unwrap();
    cfg.conf = Some(c.conf().to_path_buf());
    assert_eq!(cfg.completion, CompletionMode::Poll, "the default");
    let d = RbdDriver::open(&cfg).unwrap();
    let counters = d.batch_counters();
    let mut qc = QueueConfig::new(d.size());
    qc.queue_depth = 64;
    let dev: DynArc<dyn Device> = DynArc::new(Queue::new(qc, Box::new(d)).unwrap());
    // Rounds of 64 writes in flight at once, each with its own data.
    let mut total = 0u64;
    for round in 0..8u64 {
        let pending: Vec<_> = (0..64u64)
            .map(|i| {
                let mut buf = Buffer::new(4096);
                buf.as_mut_slice()
                    .copy_from_slice(&pattern(round * 64 + i, 4096));
                blk::PendingBio::submit(
                    &*dev,
                    Bio::with_buf(Op::Write, (i * 65536) >> SECTOR_SHIFT, buf),
                )
            })
            .collect();
        for p in pending {
            p.wait().1.unwrap();
        }
        total += 64;
        if counters.largest() > 1 {
            break;
        }
    }
    eprintln!(
        "{} completions in {} wake-ups, at most {} in one",
        counters.completions(),
        counters.wakeups(),
        counters.largest()
    );
    assert!(
        counters.completions() >= total,
        "every completion came through the completion thread: {} of {total}",
        counters.completions()
    );
    assert!(
        counters.largest() > 1,
        "one wake-up took more than one completion ({} wake-ups for {} completions)",
        counters.wakeups(),
        counters.completions()
    );
    assert!(counters.wakeups() < counters.completions());
    for i in 0..64u64 {
        let got = read_at(&*dev, i * 65536, 4096).unwrap();
        assert!((0..8).any(|r| got == pattern(r * 64 + i, 4096)), "at {i}");
    }
}

#[test]
fn callbacks_leave_the_completion_thread_unused() {
    let Some(c) = Cluster::or_skip("callbacks_leave_the_completion_thread_unused") else {
        return;
    };
    c.create_image("called", "16M");
    let mut cfg = RbdConfig::parse_target("rbd/called").unwrap();
    cfg.conf = Some(c.conf().to_path_buf());
    cfg.completion = CompletionMode::Callback;
    let d = RbdDriver::open(&cfg).unwrap();
    let counters = d.batch_counters();
    let dev: DynArc<dyn Device> =
        DynArc::new(Queue::new(QueueConfig::new(d.size()), Box::new(d)).unwrap());
    write_at(&*dev, 0, &pattern(3, 4096)).unwrap();
    assert_eq!(read_at(&*dev, 0, 4096).unwrap(), pattern(3, 4096));
    assert_eq!(counters.completions(), 0);
}

/// A write whose buffer is a read-only alias (a mirror's legs share one payload,
/// `Buffer::alias`) writes the owner's bytes. The driver once took a write's address from
/// `as_mut_slice`, which is empty for an alias: librbd then copied from a dangling pointer and
/// the server died (`blkq serve_rbd a_mirror_of_a_local_leg_and_a_write_mostly_rbd_leg`).
#[test]
fn a_write_from_an_aliased_buffer_writes_the_owners_bytes() {
    let Some(c) = Cluster::or_skip("a_write_from_an_aliased_buffer_writes_the_owners_bytes") else {
        return;
    };
    c.create_image("alias", "16M");
    let dev = open(&c.spec("alias", "")).unwrap();
    let data = pattern(9, 1 << 20);
    let mut owner = Buffer::new(data.len());
    owner.as_mut_slice().copy_from_slice(&data);
    // SAFETY: `owner` outlives the alias (the alias is dropped inside `submit_wait`'s
    // returned bio before `owner` goes) and is not written meanwhile.
    let alias = unsafe { owner.alias() };
    let (bio, r) = submit_wait(dev.as_ref(), Bio::with_buf(Op::Write, 2048, alias));
    drop(bio);
    r.unwrap();
    assert!(read_at(dev.as_ref(), 1 << 20, data.len()).unwrap() == data);
}

/// A FUA discard or write-zeroes is durable before it completes, as a FUA write is: its flush
/// (`rbd_aio_flush`, which writes back librbd's cache) is sent once it has completed, and
/// completes the request. Without FUA, no flush. In both completion modes.
#[test]
fn fua_discard_and_write_zeroes_are_flushed_like_a_fua_write() {
    let Some(c) = Cluster::or_skip("fua_discard_and_write_zeroes_are_flushed_like_a_fua_write")
    else {
        return;
    };
    for (image, opts) in [("fua-poll", ""), ("fua-callback", ",completion=callback")] {
        c.create_image(image, "16M");
        let dev = open(&c.spec(image, opts)).unwrap();
        let h = librbd_calls::handle(image);
        let ops = [
            ("write", Op::Write, BioFlags::NONE),
            ("discard", Op::Discard, BioFlags::NONE),
            ("write-zeroes", Op::WriteZeroes, BioFlags::NONE),
            ("write-zeroes NO_HOLE", Op::WriteZeroes, BioFlags::NO_HOLE),
        ];
        for (i, (what, op, flags)) in ops.into_iter().enumerate() {
            let off = i as u64 * (1 << 20);
            for fua in [false, true] {
                write_at(&*dev, off, &pattern(i as u64 + 1, 65536)).unwrap();
                flush(&*dev).unwrap();
                let before = librbd_calls::flushes(h);
                let mut b = if op == Op::Write {
                    let mut buf = Buffer::new(65536);
                    buf.as_mut_slice().copy_from_slice(&pattern(9, 65536));
                    Bio::with_buf(op, off >> SECTOR_SHIFT, buf)
                } else {
                    Bio::new(op, off >> SECTOR_SHIFT, 65536)
                };
                b.flags = if fua { flags | BioFlags::FUA } else { flags };
                submit_wait(&*dev, b)
                    .1
                    .unwrap_or_else(|e| panic!("{image}: {what}: {e}"));
                let sent = librbd_calls::flushes(h) - before;
                assert_eq!(
                    sent,
                    usize::from(fua),
                    "{image}: a {}{what} sent {sent} flushes to librbd before it completed{}",
                    if fua { "FUA " } else { "" },
                    if fua {
                        ": without one it sits in librbd's writeback cache, not durable"
                    } else {
                        ""
                    }
                );
            }
        }
    }
}
