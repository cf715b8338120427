//! Exports that keep dirty bitmaps, for the server's tests: a device built from a spec,
//! wrapped in changed-block tracking (`cbt::Tracked`) with bitmaps in memory, of [`GRAIN`]
//! bytes per bit.

use std::sync::Arc;

use blk::Device;
use blk_drivers::spec::{DeviceSpec, QueueOverrides};
use cbt::{Bitmaps, Options, Tracked};

/// The bitmaps' granularity.
pub const GRAIN: u64 = 64 << 10;

/// The device of `spec`, tracked, with (clean) bitmaps `names`; manage them through
/// `Tracked::bitmaps` (add, remove, clear, rotate).
pub fn tracked(spec: &str, names: &[&str]) -> Arc<Tracked> {
    let s: DeviceSpec = spec.parse().unwrap();
    let inner: Arc<dyn Device> = Arc::new(s.build(&QueueOverrides::default()).unwrap());
    let (bitmaps, _) = Bitmaps::open(inner.limits().capacity, &Options::memory()).unwrap();
    for n in names {
        bitmaps.add(n, GRAIN).unwrap();
    }
    Arc::new(Tracked::new(inner, bitmaps))
}
