//! `file:` devices lock their file with `flock` at open: exclusive for read-write, shared for
//! read-only, so a second writer (another device of this process, another server) is refused
//! with an error naming the file and the holder; `lock=off` opts out.
#![cfg(not(blkq_loom))]

use std::path::{Path, PathBuf};

use blk::{Device, Error};
use blk_drivers::backend::file::{FileBackend, FileOptions};
use blk_drivers::spec::{DeviceSpec, QueueOverrides};
use blkq_sync::DynArc;

fn image(dir: &Path) -> PathBuf {
    let p = dir.join("locked.img");
    std::fs::File::create(&p).unwrap().set_len(1 << 20).unwrap();
    p
}

fn open(path: &Path, opts: &str) -> Result<DynArc<dyn Device>, Error> {
    format!("file:{}{opts}", path.display())
        .parse::<DeviceSpec>()?
        .build_device(&QueueOverrides::default())
}

fn refused(path: &Path, opts: &str) -> String {
    match open(path, opts) {
        Ok(_) => panic!("second open of {} ({opts}) was allowed", path.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn a_second_writer_is_refused_with_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let path = image(dir.path());
    for engine in ["sync", "pool", "auto"] {
        let opts = format!(",engine={engine}");
        let first = open(&path, &opts).unwrap();
        let e = refused(&path, &opts);
        assert!(e.contains(&path.display().to_string()), "{e}");
        assert!(e.contains("lock"), "{e}");
        assert!(e.contains("this process"), "the holder is us: {e}");
        // Nor may a reader open it while it is written.
        let e = refused(&path, ",ro=1");
        assert!(e.contains("lock"), "{e}");
        // Closing the first releases the lock (the engine's descriptors included).
        drop(first);
        let again = open(&path, &opts).unwrap();
        drop(again);
    }
}

#[test]
fn readers_share_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = image(dir.path());
    let a = open(&path, ",ro=1").unwrap();
    let b = open(&path, ",ro=1,engine=pool").unwrap();
    let e = refused(&path, "");
    assert!(e.contains("lock"), "a writer waits for no reader: {e}");
    drop((a, b));
    open(&path, "").unwrap();
}

#[test]
fn lock_off_opts_out() {
    let dir = tempfile::tempdir().unwrap();
    let path = image(dir.path());
    let a = open(&path, ",lock=off").unwrap();
    let b = open(&path, ",lock=off").unwrap();
    // A locked open next to unlocked ones is allowed too: they hold no lock.
    let c = open(&path, "").unwrap();
    assert!(open(&path, ",lock=maybe").is_err());
    drop((a, b, c));
    // The backend API: `no_lock`.
    let x = FileBackend::open(&path, FileOptions::default()).unwrap();
    assert!(FileBackend::open(&path, FileOptions::default()).is_err());
    let y = FileBackend::open(
        &path,
        FileOptions {
            no_lock: true,
            ..FileOptions::default()
        },
    )
    .unwrap();
    drop((x, y));
}
