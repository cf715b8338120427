//! A FUA discard or write-zeroes on a `file:` device is durable before it completes, on every
//! engine: the `fallocate` (or the zeros written in its place) is followed by an `fdatasync`
//! of the file, as a FUA write's fallback is. Without FUA no `fdatasync` is paid.
//!
//! The evidence comes from the system calls themselves: this test binary defines `fallocate`
//! and `fdatasync`, which the linker then uses instead of the C library's for every caller in
//! the binary (the driver included). Each records the call against the file's (device, inode)
//! and makes the system call itself. Only this binary is affected, which is why these tests
//! live in a file of their own.
// A plain threaded test, never a loom model: its own harness may use std::sync.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]
#![cfg(not(blkq_loom))]

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use blk::{Bio, BioFlags, Buffer, Op, Queue, SECTOR_SHIFT};
use blk_drivers::engine::UringEngine;
use blk_drivers::spec::{DeviceSpec, QueueOverrides};
use testkit::io::{read_at, submit_wait};
use testkit::pattern;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Call {
    Fallocate,
    Fdatasync,
}

/// Every recorded call: (device, inode, what), in the order they returned.
static CALLS: Mutex<Vec<(u64, u64, Call)>> = Mutex::new(Vec::new());

fn record(fd: libc::c_int, call: Call) {
    // SAFETY: an all-zero `stat` is a valid value of this plain C struct.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `st` is a valid, writable `stat` for the kernel to fill; `fd` is the caller's.
    if unsafe { libc::fstat(fd, &mut st) } == 0 {
        CALLS
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((st.st_dev, st.st_ino, call));
    }
}

/// The C library's `fdatasync`, recorded (see the module docs).
#[no_mangle]
pub extern "C" fn fdatasync(fd: libc::c_int) -> libc::c_int {
    // SAFETY: the raw system call takes a plain descriptor and no memory; like the C
    // library's wrapper it returns -1 and sets errno on failure.
    let r = unsafe { libc::syscall(libc::SYS_fdatasync, fd) } as libc::c_int;
    if r == 0 {
        record(fd, Call::Fdatasync);
    }
    r
}

/// The C library's `fallocate`, recorded (see the module docs).
#[no_mangle]
pub extern "C" fn fallocate(
    fd: libc::c_int,
    mode: libc::c_int,
    offset: libc::off_t,
    len: libc::off_t,
) -> libc::c_int {
    // SAFETY: the raw system call takes a descriptor and integers, no memory; like the C
    // library's wrapper it returns -1 and sets errno on failure.
    let r = unsafe { libc::syscall(libc::SYS_fallocate, fd, mode, offset, len) } as libc::c_int;
    if r == 0 {
        record(fd, Call::Fallocate);
    }
    r
}

/// The calls recorded for `path` so far.
fn calls(path: &Path) -> Vec<Call> {
    let m = std::fs::metadata(path).unwrap();
    CALLS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .filter(|(d, i, _)| *d == m.dev() && *i == m.ino())
        .map(|(_, _, c)| *c)
        .collect()
}

/// The engines to test here: io_uring only where it works.
fn engines() -> Vec<&'static str> {
    let mut v = vec!["pool", "sync", "auto"];
    match UringEngine::available() {
        Ok(()) => v.insert(0, "uring"),
        Err(e) => eprintln!("note: io_uring unavailable here ({e}); testing pool and sync only"),
    }
    v
}

fn image(dir: &Path, name: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::File::create(&p).unwrap().set_len(4 << 20).unwrap();
    p
}

fn queue(path: &Path, opts: &str) -> Queue {
    let spec = format!("file:{}{opts}", path.display());
    spec.parse::<DeviceSpec>()
        .and_then(|s| s.build(&QueueOverrides::default()))
        .unwrap_or_else(|e| panic!("{spec}: {e}"))
}

/// The zeroing bios under test: discard, write-zeroes that may unmap, write-zeroes with
/// NO_HOLE.
const ZEROING: [(&str, Op, BioFlags); 3] = [
    ("discard", Op::Discard, BioFlags::NONE),
    ("write-zeroes", Op::WriteZeroes, BioFlags::NONE),
    ("write-zeroes NO_HOLE", Op::WriteZeroes, BioFlags::NO_HOLE),
];

/// Fills `[off, off + len)` with data and flushes it, so the zeroing has something to do.
fn fill(q: &Queue, off: u64, len: usize) {
    let mut buf = Buffer::new(len);
    buf.as_mut_slice().copy_from_slice(&pattern(off, len));
    submit_wait(q, Bio::with_buf(Op::Write, off >> SECTOR_SHIFT, buf))
        .1
        .unwrap();
    submit_wait(q, Bio::new(Op::Flush, 0, 0)).1.unwrap();
}

/// Runs each zeroing bio on `q` (over `path`) and returns, per bio, the calls it made.
fn run_zeroing(q: &Queue, path: &Path, extra: BioFlags) -> Vec<(&'static str, Vec<Call>)> {
    let mut out = Vec::new();
    for (i, (what, op, flags)) in ZEROING.into_iter().enumerate() {
        let off = (64 << 10) + (i as u64) * (64 << 10);
        let mut bio = Bio::new(op, off >> SECTOR_SHIFT, 16 << 10);
        bio.flags = flags | extra;
        fill(q, off, 16 << 10);
        let before = calls(path).len();
        let (_, r) = submit_wait(q, bio);
        r.unwrap_or_else(|e| panic!("{what}: {e}"));
        let back = read_at(q, off, 16 << 10).unwrap();
        assert!(back.iter().all(|&b| b == 0), "{what}: zeros read back");
        out.push((what, calls(path)[before..].to_vec()));
    }
    out
}

#[test]
fn fua_discard_and_write_zeroes_are_synced_on_every_engine() {
    for e in engines() {
        for inline in [1, 0] {
            let dir = tempfile::tempdir().unwrap();
            let path = image(dir.path(), "fua.img");
            let q = queue(&path, &format!(",engine={e},inline={inline}"));
            for (what, seen) in run_zeroing(&q, &path, BioFlags::FUA) {
                let last_fallocate = seen.iter().rposition(|c| *c == Call::Fallocate);
                // Where fallocate could not zero, the backend writes zeros: still synced.
                let last_sync = seen.iter().rposition(|c| *c == Call::Fdatasync);
                assert!(
                    matches!((last_fallocate, last_sync), (Some(f), Some(s)) if s > f)
                        || (last_fallocate.is_none() && last_sync.is_some()),
                    "engine={e} inline={inline}: FUA {what} must be durable before it \
                     completes (an fdatasync after the fallocate); calls: {seen:?}"
                );
            }
        }
    }
}

#[test]
fn zeroing_without_fua_pays_no_sync() {
    for e in engines() {
        let dir = tempfile::tempdir().unwrap();
        let path = image(dir.path(), "nofua.img");
        let q = queue(&path, &format!(",engine={e}"));
        let results = run_zeroing(&q, &path, BioFlags::NONE);
        for (what, seen) in &results {
            assert!(
                !seen.contains(&Call::Fdatasync),
                "engine={e}: {what} without FUA: {seen:?}"
            );
        }
        // The hooks are in place: this binary's fallocate saw the driver's calls.
        assert!(
            results.iter().any(|(_, s)| s.contains(&Call::Fallocate)),
            "engine={e}: no fallocate recorded; is the hook linked? {results:?}"
        );
    }
}

/// The backend alone: `exec_on_backend`, the one place a bio's flags meet a backend.
#[test]
fn exec_on_backend_syncs_after_a_fua_discard() {
    use blk_drivers::backend::file::{FileBackend, FileOptions};
    use blk_drivers::backend::{exec_on_backend, Backend};
    let dir = tempfile::tempdir().unwrap();
    let path = image(dir.path(), "be.img");
    let be = FileBackend::open(&path, FileOptions::default()).unwrap();
    be.write_at(0, &pattern(1, 8192), false).unwrap();
    let before = calls(&path).len();
    let mut bio = Bio::new(Op::Discard, 0, 8192);
    bio.flags = BioFlags::FUA;
    exec_on_backend(&be, &mut bio).unwrap();
    let seen = calls(&path)[before..].to_vec();
    assert_eq!(seen.last(), Some(&Call::Fdatasync), "{seen:?}");
    // And on a memory backend, which has no cache to flush, it simply succeeds.
    let mem = blk_drivers::backend::MapBackend::new(1 << 20).unwrap();
    let mut bio = Bio::new(Op::WriteZeroes, 0, 4096);
    bio.flags = BioFlags::FUA;
    exec_on_backend(&mem, &mut bio).unwrap();
}
