//! Helpers shared by raid1's integration tests: memory legs, synchronous byte I/O on any
//! device (through `testkit::io`), a leg's data area, and the array configuration the sync
//! and loss tests use.
#![allow(dead_code)] // each test file uses its own subset

use std::time::Duration;

use blk::Device;
use blk_drivers::fault::{FaultConfig, FaultDevice, FaultHandle};
use blk_drivers::spec::{DeviceSpec, QueueOverrides};
use blkq_sync::DynArc as Arc;
use raid1::{Raid1, Raid1Config};

pub const MB: u64 = 1 << 20;

/// A `mem:` device of `size` (e.g. "64M").
pub fn mem(size: &str) -> Arc<dyn Device> {
    format!("mem:{size}")
        .parse::<DeviceSpec>()
        .unwrap()
        .build_device(&QueueOverrides::default())
        .unwrap()
}

/// Any device from its spec (e.g. "null:16M,completion=timer,completion_nsec=200000").
pub fn spec(s: &str) -> Arc<dyn Device> {
    s.parse::<DeviceSpec>()
        .unwrap()
        .build_device(&QueueOverrides::default())
        .unwrap()
}

/// `len` bytes of a never-zero pattern for `seed`.
pub fn pattern(seed: u8, len: usize) -> Vec<u8> {
    testkit::pattern(u64::from(seed) + 1, len)
}

/// Writes `data` at byte `offset`; panics on error.
pub fn write(dev: &dyn Device, offset: u64, data: &[u8]) {
    testkit::io::write_at(dev, offset, data).unwrap();
}

/// A fault leg over `mem:SIZE` (`volatile`: a write cache that a crash empties), and its
/// handle.
pub fn fault_leg(size: &str, volatile: bool) -> (Arc<dyn Device>, FaultHandle) {
    let f = FaultDevice::new(
        mem(size),
        FaultConfig {
            volatile_cache: volatile,
            ..FaultConfig::default()
        },
    );
    let h = f.handle();
    (Arc::new(f), h)
}

/// Reads `len` bytes at byte `offset`; panics on error.
pub fn read(dev: &dyn Device, offset: u64, len: usize) -> Vec<u8> {
    testkit::io::read_at(dev, offset, len).unwrap()
}

/// Flushes; panics on error.
pub fn flush(dev: &dyn Device) {
    testkit::io::flush(dev).unwrap();
}

/// The data area of a leg of `r`.
pub fn leg_data(r: &Raid1, leg: &dyn Device) -> Vec<u8> {
    let cap = r.limits().capacity;
    let mut out = Vec::with_capacity(cap as usize);
    let mut pos = 0;
    while pos < cap {
        let n = MB.min(cap - pos);
        out.extend(read(leg, r.data_offset() + pos, n as usize));
        pos += n;
    }
    out
}

/// The two legs' data areas are equal.
pub fn assert_legs_equal(r: &Raid1, a: &dyn Device, b: &dyn Device) {
    assert!(leg_data(r, a) == leg_data(r, b), "legs differ");
}

/// 1 MiB bitmap chunks that never clear by themselves during a test.
pub fn cfg() -> Raid1Config {
    Raid1Config {
        bitmap_chunk: MB,
        bitmap_quiet: Duration::from_secs(3600),
        tick: Duration::from_millis(20),
        depth: 16,
        ..Raid1Config::default()
    }
}

/// How many chunks of `r`'s write-intent bitmap are dirty.
pub fn nr_dirty(r: &Raid1) -> u64 {
    r.bitmap()
        .unwrap()
        .dirty_chunks()
        .iter()
        .map(|c| c.end - c.first)
        .sum()
}
