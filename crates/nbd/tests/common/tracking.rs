//! A test device that keeps dirty bitmaps: a device built from a spec whose writes, trims
//! and zeroes mark the granules they touch in every bitmap, the bitmaps held as one flag per
//! granule. It answers `blk::DirtyBitmaps` as the trait asks (runs of equal state, clipped
//! to the range, at most `max`, nothing allocated once `out` has grown), standing in for the
//! real tracker in the server's tests.

use std::sync::{Arc, Mutex};

use blk::{Bio, Device, DirtyBitmaps, DirtyExtent, EndIo, Extent, Limits, Op, SECTOR_SHIFT};
use blk_drivers::spec::{DeviceSpec, QueueOverrides};

/// The tracker's granule.
pub const GRAIN: u64 = 64 << 10;

/// A memory device that tracks writes in named bitmaps of [`GRAIN`]-byte granules.
pub struct Tracking {
    inner: Arc<dyn Device>,
    size: u64,
    bitmaps: Mutex<Vec<(String, Vec<bool>)>>,
}

impl Tracking {
    /// The device of `spec`, with (clean) bitmaps `names`.
    pub fn new(spec: &str, names: &[&str]) -> Arc<Self> {
        let s: DeviceSpec = spec.parse().unwrap();
        let inner: Arc<dyn Device> = Arc::new(s.build(&QueueOverrides::default()).unwrap());
        let size = inner.limits().capacity;
        let grains = size.div_ceil(GRAIN) as usize;
        let bitmaps = names
            .iter()
            .map(|n| (n.to_string(), vec![false; grains]))
            .collect();
        Arc::new(Self {
            inner,
            size,
            bitmaps: Mutex::new(bitmaps),
        })
    }

    /// Removes bitmap `name`.
    pub fn remove(&self, name: &str) {
        self.bitmaps.lock().unwrap().retain(|(n, _)| n != name);
    }

    /// Clears bitmap `name`.
    pub fn clear(&self, name: &str) {
        for (n, bits) in self.bitmaps.lock().unwrap().iter_mut() {
            if n == name {
                bits.fill(false);
            }
        }
    }
}

impl Device for Tracking {
    fn submit(&self, bio: Bio, end: &Arc<dyn EndIo>) {
        if matches!(bio.op, Op::Write | Op::Discard | Op::WriteZeroes) && bio.len > 0 {
            let start = bio.sector << SECTOR_SHIFT;
            let (first, last) = (start / GRAIN, (start + u64::from(bio.len) - 1) / GRAIN);
            for (_, bits) in self.bitmaps.lock().unwrap().iter_mut() {
                for g in first..=last {
                    bits[g as usize] = true;
                }
            }
        }
        self.inner.submit(bio, end)
    }
    fn limits(&self) -> Limits {
        self.inner.limits()
    }
    fn extents_into(
        &self,
        offset: u64,
        len: u64,
        max: usize,
        out: &mut Vec<Extent>,
    ) -> Result<(), blk::Error> {
        self.inner.extents_into(offset, len, max, out)
    }
    fn dirty_bitmaps(&self) -> Option<&dyn DirtyBitmaps> {
        Some(self)
    }
}

impl DirtyBitmaps for Tracking {
    fn names(&self) -> Vec<String> {
        let maps = self.bitmaps.lock().unwrap();
        maps.iter().map(|(n, _)| n.clone()).collect()
    }

    fn dirty_extents_into(
        &self,
        name: &str,
        offset: u64,
        len: u64,
        max: usize,
        out: &mut Vec<DirtyExtent>,
    ) -> Result<(), blk::Error> {
        out.clear();
        let maps = self.bitmaps.lock().unwrap();
        let Some((_, bits)) = maps.iter().find(|(n, _)| n == name) else {
            return Err(blk::Error::NotFound {
                kind: "dirty bitmap",
                name: name.to_string(),
            });
        };
        let end = (offset + len).min(self.size);
        let mut at = offset;
        while at < end && out.len() < max {
            let dirty = bits[(at / GRAIN) as usize];
            let mut next = (at / GRAIN + 1) * GRAIN;
            while next < end && bits[(next / GRAIN) as usize] == dirty {
                next += GRAIN;
            }
            let next = next.min(end);
            out.push(DirtyExtent {
                len: next - at,
                dirty,
            });
            at = next;
        }
        Ok(())
    }
}
