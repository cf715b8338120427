//! Set-up shared by the tests of bitmaps kept in a sidecar: a file image, the [`Tracked`]
//! device over it with its bitmaps in a sidecar beside it, and a bitmap's dirty runs.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use blk::{Device, DirtyExtent};
use blk_drivers::spec::{DeviceSpec, QueueOverrides};
use blkq_sync::DynArc as Arc;
use cbt::{Bitmaps, Error, Image, Mode, Options, Store, Tracked};

/// A sparse image of `size` bytes, `disk.img` in `dir`.
pub fn image(dir: &Path, size: u64) -> PathBuf {
    let p = dir.join("disk.img");
    std::fs::File::create(&p).unwrap().set_len(size).unwrap();
    p
}

/// The `file:` device of image `img` (of `size` bytes) tracked by the bitmaps of its sidecar
/// (`img` with the extension `bitmaps`), opened with `reset` or not; and the notes the open
/// gave.
pub fn tracked(img: &Path, size: u64, reset: bool) -> Result<(Tracked, Vec<String>), Error> {
    let inner: Arc<dyn Device> = Arc::new(
        format!("file:{}", img.display())
            .parse::<DeviceSpec>()
            .unwrap()
            .build(&QueueOverrides::default())
            .unwrap(),
    );
    let opts = Options {
        store: Store::File {
            path: img.with_extension("bitmaps"),
            image: Image::File(img.to_path_buf()),
        },
        reset,
        mode: Mode::LockFree,
    };
    let (b, notes) = Bitmaps::open(size, &opts)?;
    Ok((Tracked::new(inner, b), notes))
}

/// The dirty runs of bitmap `name` over the whole device (of `size` bytes).
pub fn dirty_runs(t: &Tracked, name: &str, size: u64) -> Vec<DirtyExtent> {
    let mut out = Vec::new();
    t.dirty_bitmaps()
        .unwrap()
        .dirty_extents_into(name, 0, size, 64, &mut out)
        .unwrap();
    out
}
