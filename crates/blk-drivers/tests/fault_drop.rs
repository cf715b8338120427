//! A fault device's drop releases what it holds before it returns: its timer thread and the
//! inner device, so a `file:` device under it has closed its file and given up its `flock`
//! by then, and the same file opens again at once (a RAID leg is opened, formatted, dropped
//! and reopened this way at `--raid1-create`). Also when the last reference to the device is
//! dropped by a completion on the timer thread itself, and when a `FaultHandle` outlives it.
// A plain threaded test, never a loom model: its own harness may use std::sync.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]
#![cfg(not(blkq_loom))]

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use blk::{Bio, Buffer, Device, EndIo, Error, Op, SECTOR_SHIFT};
use blk_drivers::fault::{FaultConfig, FaultDevice};
use blk_drivers::spec::{DeviceSpec, QueueOverrides};
use testkit::io::{flush, read_at, write_at};
use testkit::{pattern, Collect};

/// Rounds of open, I/O, drop, reopen: the race showed in about half of them.
const ROUNDS: usize = 50;

fn image(dir: &Path) -> PathBuf {
    let p = dir.join("leg.img");
    std::fs::File::create(&p).unwrap().set_len(1 << 20).unwrap();
    p
}

fn open(spec: &str) -> Result<Arc<dyn Device>, Error> {
    spec.parse::<DeviceSpec>()?
        .build_device(&QueueOverrides::default())
}

fn latency(us: u64) -> FaultConfig {
    format!("latency_us={us}").parse().unwrap()
}

/// A write, a read and a flush, each completed through the timer thread.
fn some_io(dev: &dyn Device, round: usize) {
    let data = pattern(round as u64, 4096);
    write_at(dev, 8192, &data).unwrap();
    assert_eq!(read_at(dev, 8192, 4096).unwrap(), data);
    flush(dev).unwrap();
}

/// Opens `path` as a plain `file:` device, which fails while anyone holds its lock.
fn reopen(path: &Path, opts: &str, round: usize) {
    let spec = format!("file:{}{opts}", path.display());
    if let Err(e) = open(&spec) {
        panic!("round {round}: {spec} did not open right after the fault device's drop: {e}");
    }
}

#[test]
fn dropping_a_fault_device_over_a_file_releases_the_file_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let path = image(dir.path());
    for engine in ["sync", "pool", "auto"] {
        let opts = format!(",engine={engine}");
        for round in 0..ROUNDS {
            let inner = open(&format!("file:{}{opts}", path.display())).unwrap();
            let f = FaultDevice::new(inner, latency(100));
            let h = f.handle();
            let dev: Arc<dyn Device> = Arc::new(f);
            some_io(&*dev, round);
            assert!(h.counters().delayed >= 3, "{:?}", h.counters());
            drop(h);
            drop(dev);
            reopen(&path, &opts, round);
        }
    }
}

/// The same through a spec's `fault.` options (what `--raid1 "file:A,fault.latency_us=100"`
/// builds).
#[test]
fn a_spec_with_fault_latency_releases_the_file_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let path = image(dir.path());
    let spec = format!("file:{},fault.latency_us=100", path.display());
    for round in 0..ROUNDS {
        let dev = open(&spec).unwrap();
        some_io(&*dev, round);
        drop(dev);
        reopen(&path, "", round);
        // And the wrapped spec again, as a leg is reopened.
        let again = open(&spec).unwrap_or_else(|e| panic!("round {round}: {e}"));
        drop(again);
    }
}

/// A handle kept past the device's drop keeps the rules and counters, not the inner device.
#[test]
fn a_handle_outliving_the_device_does_not_hold_the_inner_device() {
    let dir = tempfile::tempdir().unwrap();
    let path = image(dir.path());
    let mut cfg = latency(100);
    cfg.volatile_cache = true;
    let inner = open(&format!("file:{}", path.display())).unwrap();
    let f = FaultDevice::new(inner, cfg);
    let h = f.handle();
    let dev: Arc<dyn Device> = Arc::new(f);
    some_io(&*dev, 0);
    drop(dev);
    reopen(&path, "", 0);
    // The handle still answers; what needs the device says it is gone.
    assert!(h.counters().delayed >= 3);
    assert_eq!(h.release(), 0);
    let e = h.crash().expect_err("a crash needs the device");
    assert_eq!(e.errno(), libc::ENODEV, "{e}");
}

/// An end-io that holds a reference to the device and drops it when its I/O completes; if
/// that was the last one, it opens the file again right there, on the completing thread.
struct DropOnCompletion {
    dev: Mutex<Option<Arc<dyn Device>>>,
    path: PathBuf,
    /// `None`: the reference dropped was not the last; else what the reopen gave.
    reopened: Mutex<Option<Result<(), String>>>,
    done: Collect,
}

impl EndIo for DropOnCompletion {
    fn end_io(&self, bio: Bio, res: Result<(), Error>) {
        let dev = self.dev.lock().unwrap().take();
        let was_last = dev.as_ref().is_some_and(|d| Arc::strong_count(d) == 1);
        drop(dev);
        if was_last {
            let r = open(&format!("file:{}", self.path.display()))
                .map(drop)
                .map_err(|e| e.to_string());
            *self.reopened.lock().unwrap() = Some(r);
        }
        self.done.end_io(bio, res);
    }
}

/// The last reference dropped by a completion on the timer thread: the drop cannot join that
/// thread (it runs on it), yet must not hang, and must have released the file when it returns.
#[test]
fn a_drop_on_the_timer_thread_releases_the_file_and_does_not_hang() {
    let dir = tempfile::tempdir().unwrap();
    let path = image(dir.path());
    let mut on_timer = 0;
    for round in 0..ROUNDS {
        let inner = open(&format!("file:{},engine=sync", path.display())).unwrap();
        // Long enough that this thread has dropped its reference before the completion.
        let dev: Arc<dyn Device> = Arc::new(FaultDevice::new(inner, latency(20_000)));
        let end = Arc::new(DropOnCompletion {
            dev: Mutex::new(Some(dev.clone())),
            path: path.clone(),
            reopened: Mutex::new(None),
            done: Collect::default(),
        });
        let end_dyn: Arc<dyn EndIo> = end.clone();
        let mut buf = Buffer::new(4096);
        buf.as_mut_slice().fill(7);
        dev.submit(
            Bio::with_buf(Op::Write, 4096 >> SECTOR_SHIFT, buf),
            &end_dyn,
        );
        drop(dev);
        let (_, res) = end.done.wait_for(1).pop().unwrap();
        res.unwrap();
        if let Some(r) = end.reopened.lock().unwrap().take() {
            on_timer += 1;
            if let Err(e) = r {
                panic!("round {round}: reopened on the timer thread right after the drop: {e}");
            }
        }
        reopen(&path, "", round);
    }
    assert!(
        on_timer > 0,
        "no round dropped the device on the timer thread"
    );
}
