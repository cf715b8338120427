//! Zero-copy reads (`Device::splice_read`): what a pipe receives from `mem:` (`vmsplice` of
//! the mapping, zeros for holes) and `file:` (`splice` from the page cache) is what a read
//! returns; a full pipe takes part and then nothing; `splice=0`, `direct=1` and the page
//! store have none; the disk counters count a splice as a read.
#![cfg(not(blkq_loom))]

use std::io::Read;
use std::os::fd::{AsFd, FromRawFd, OwnedFd};

use blk::Device;
use blk_drivers::spec::{DeviceSpec, QueueOverrides};
use blkq_sync::DynArc;
use testkit::{io, pattern};

fn device(spec: &str) -> DynArc<dyn Device> {
    spec.parse::<DeviceSpec>()
        .unwrap()
        .build_device(&QueueOverrides::default())
        .unwrap()
}

/// A pipe (read end, write end) holding up to `size` bytes.
fn pipe(size: usize) -> (std::fs::File, OwnedFd) {
    let mut fds = [0; 2];
    // SAFETY: `fds` is a writable array of two ints.
    assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
    // SAFETY: pipe2 just made both descriptors, and nothing else owns them.
    let (r, w) = unsafe {
        (
            std::fs::File::from_raw_fd(fds[0]),
            OwnedFd::from_raw_fd(fds[1]),
        )
    };
    // SAFETY: fcntl on a descriptor we own; F_SETPIPE_SZ takes an int.
    let got = unsafe { libc::fcntl(fds[1], libc::F_SETPIPE_SZ, size as libc::c_int) };
    assert!(got >= size as i32, "F_SETPIPE_SZ {size}: {got}");
    (r, w)
}

/// Splices `[offset, offset + len)` through a pipe and returns the bytes.
fn splice_all(dev: &dyn Device, offset: u64, len: usize) -> Vec<u8> {
    let (mut r, w) = pipe(1 << 20);
    let mut out = vec![0u8; len];
    let mut done = 0;
    while done < len {
        let n = dev
            .splice_read(offset + done as u64, len - done, w.as_fd())
            .unwrap();
        assert!(n > 0, "an empty pipe took nothing at {done}");
        r.read_exact(&mut out[done..done + n]).unwrap();
        done += n;
    }
    out
}

fn check_device(spec: &str) {
    let dev = device(spec);
    assert!(dev.caps().splice, "{spec}");
    let data = pattern(7, 3 << 20);
    // Written: [64K, 64K + 3M); the rest never written (mem: holes from the bitmap).
    for (i, chunk) in data.chunks(1 << 20).enumerate() {
        io::write_at(dev.as_ref(), (64 << 10) + (i << 20) as u64, chunk).unwrap();
    }
    for (off, len) in [
        (64 << 10, 1 << 20),
        (0, 200 << 10),                      // a hole, then data
        ((1 << 20) + 512, (1 << 20) + 4096), // unaligned, across regions
        ((3 << 20) + (60 << 10), 300 << 10), // data, then a hole at the end
        (8 << 20, 128 << 10),                // only a hole
    ] {
        let mut want = Vec::new();
        for at in (0..len).step_by(1 << 20) {
            let n = (len - at).min(1 << 20);
            want.extend(io::read_at(dev.as_ref(), off + at as u64, n).unwrap());
        }
        let got = splice_all(dev.as_ref(), off, len);
        assert!(
            got == want,
            "{spec}: splice of {off}+{len} differs from a read"
        );
    }
    // The disk counters: one read per splice call.
    let before = dev.stats().unwrap();
    splice_all(dev.as_ref(), 0, 4096);
    let after = dev.stats().unwrap();
    assert_eq!(after.ios[0] - before.ios[0], 1, "{spec}");
    assert_eq!(after.sectors[0] - before.sectors[0], 8, "{spec}");
    // A full pipe takes what it has room for, then nothing (no blocking, no error).
    let (_r, w) = pipe(64 << 10);
    let first = dev.splice_read(64 << 10, 1 << 20, w.as_fd()).unwrap();
    assert!(first > 0 && first <= 64 << 10, "{spec}: {first}");
    let mut more = 0;
    for _ in 0..4 {
        more += dev.splice_read(64 << 10, 1 << 20, w.as_fd()).unwrap();
    }
    assert!(
        first + more <= 64 << 10,
        "{spec}: a full pipe took {more} more"
    );
    // Out of range: an error, not a panic.
    assert!(dev.splice_read(16 << 20, 4096, w.as_fd()).is_err());
}

#[test]
fn mem_map_splices_what_it_reads() {
    check_device("mem:16M");
    check_device("mem:16M,thp=1");
}

#[test]
fn file_splices_what_it_reads() {
    let dir = tempfile::tempdir().unwrap();
    for engine in ["sync", "pool", "auto"] {
        let p = dir.path().join(format!("{engine}.img"));
        std::fs::File::create(&p)
            .unwrap()
            .set_len(16 << 20)
            .unwrap();
        check_device(&format!("file:{},engine={engine}", p.display()));
    }
}

#[test]
fn splice_off_where_asked_or_not_had() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("x.img");
    std::fs::File::create(&p).unwrap().set_len(1 << 20).unwrap();
    for spec in [
        "mem:1M,splice=0".to_string(),
        "mem:1M,store=pages".to_string(),
        "null:1M".to_string(),
        format!("file:{},splice=0", p.display()),
    ] {
        let dev = device(&spec);
        assert!(!dev.caps().splice, "{spec}");
        let (_r, w) = pipe(64 << 10);
        assert!(dev.splice_read(0, 4096, w.as_fd()).is_err(), "{spec}");
    }
    assert!("mem:1M,splice=maybe"
        .parse::<DeviceSpec>()
        .unwrap()
        .build_device(&QueueOverrides::default())
        .is_err());
}
