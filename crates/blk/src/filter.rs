//! A device stacked on another: [`Filter`]. A filter is a layer over one device (the one
//! below, [`Filter::lower`]) that changes some of what the device does and forwards the rest,
//! as nbdkit's filters sit over a plugin. Every [`Device`] method has a default here that
//! forwards to the device below, and every `Filter` is a `Device` (the blanket impl), so a
//! filter writes only what it changes: the fault device its bio path, the changed-block
//! tracker its writes and its dirty bitmaps, a test's hook the one call it is about.
//!
//! Who owns what: the filter owns the device below (it keeps the `Arc`) and answers for
//! everything it overrides; whatever it does not override is the lower device's answer,
//! unchanged (limits, extents, counters, capabilities, a reconnecting device's checks). So a
//! filter that completes bios itself, or sees them on a path that carries no bio, must say so
//! in what it overrides: the zero-copy paths carry no bio and would pass a bio-path filter
//! by, so such a filter turns them off in its [`Filter::caps`] ([`Caps::bios_only`]) or
//! intercepts them, and a filter whose counts differ from the lower device's hides the lower
//! device's counters ([`Filter::stats`], [`Filter::queue_stats`]).
//!
//! A device over several devices (a mirror over its legs) is not a filter: it has no one
//! device below to forward to, and answers every method itself.

use std::os::fd::BorrowedFd;

use blkq_sync::DynArc as Arc;

use crate::bio::{Bio, EndIo};
use crate::device::{Caps, ConnectCheck, Device, Extent, Limits};
use crate::stats::QueueStats;
use crate::Error;

/// A layer over one device that forwards every [`Device`] method to it unless it overrides
/// it (module docs). Implement `lower` and what the layer changes; the blanket impl makes it
/// a `Device`. Each method means what its [`Device`] namesake says.
///
/// Bring `Filter` into scope only where a filter is implemented: with both traits in scope, a
/// call on a concrete filter (`f.limits()`) names two methods; callers use `Device`.
pub trait Filter: Send + Sync {
    /// The device below.
    fn lower(&self) -> &dyn Device;

    /// [`Device::submit`]; default: the lower device's.
    fn submit(&self, bio: Bio, end: &Arc<dyn EndIo>) {
        self.lower().submit(bio, end)
    }
    /// [`Device::submit_batch`]; default: the lower device's (one batch there).
    fn submit_batch(&self, bios: &mut dyn Iterator<Item = Bio>, end: &Arc<dyn EndIo>) {
        self.lower().submit_batch(bios, end)
    }
    /// [`Device::limits`]; default: the lower device's.
    fn limits(&self) -> Limits {
        self.lower().limits()
    }
    /// [`Device::extents_into`]; default: the lower device's.
    fn extents_into(
        &self,
        offset: u64,
        len: u64,
        max: usize,
        out: &mut Vec<Extent>,
    ) -> Result<(), Error> {
        self.lower().extents_into(offset, len, max, out)
    }
    /// [`Device::caps`]; default: the lower device's.
    fn caps(&self) -> Caps {
        self.lower().caps()
    }
    /// [`Device::splice_read`]; default: the lower device's.
    fn splice_read(&self, offset: u64, len: usize, pipe: BorrowedFd<'_>) -> Result<usize, Error> {
        self.lower().splice_read(offset, len, pipe)
    }
    /// [`Device::recv_home`]; default: the lower device's.
    fn recv_home(
        &self,
        offset: u64,
        len: usize,
        src: &mut dyn crate::RecvSource,
    ) -> Result<(), Error> {
        self.lower().recv_home(offset, len, src)
    }
    /// [`Device::queue_stats`]; default: the lower device's.
    fn queue_stats(&self) -> Option<QueueStats> {
        self.lower().queue_stats()
    }
    /// [`Device::stats`]; default: the lower device's.
    fn stats(&self) -> Option<crate::stats::DiskStats> {
        self.lower().stats()
    }
    /// [`Device::dirty_bitmaps`]; default: the lower device's.
    fn dirty_bitmaps(&self) -> Option<&dyn crate::DirtyBitmaps> {
        self.lower().dirty_bitmaps()
    }
    /// [`Device::check_connections`]; default: the lower device's.
    fn check_connections(&self, check: Option<Arc<dyn ConnectCheck>>) -> bool {
        self.lower().check_connections(check)
    }
    /// [`Device::unavailable`]; default: the lower device's.
    fn unavailable(&self) -> bool {
        self.lower().unavailable()
    }
}

impl<T: Filter> Device for T {
    #[inline]
    fn submit(&self, bio: Bio, end: &Arc<dyn EndIo>) {
        Filter::submit(self, bio, end)
    }
    #[inline]
    fn submit_batch(&self, bios: &mut dyn Iterator<Item = Bio>, end: &Arc<dyn EndIo>) {
        Filter::submit_batch(self, bios, end)
    }
    fn limits(&self) -> Limits {
        Filter::limits(self)
    }
    fn extents_into(
        &self,
        offset: u64,
        len: u64,
        max: usize,
        out: &mut Vec<Extent>,
    ) -> Result<(), Error> {
        Filter::extents_into(self, offset, len, max, out)
    }
    fn caps(&self) -> Caps {
        Filter::caps(self)
    }
    fn splice_read(&self, offset: u64, len: usize, pipe: BorrowedFd<'_>) -> Result<usize, Error> {
        Filter::splice_read(self, offset, len, pipe)
    }
    fn recv_home(
        &self,
        offset: u64,
        len: usize,
        src: &mut dyn crate::RecvSource,
    ) -> Result<(), Error> {
        Filter::recv_home(self, offset, len, src)
    }
    fn queue_stats(&self) -> Option<QueueStats> {
        Filter::queue_stats(self)
    }
    fn stats(&self) -> Option<crate::stats::DiskStats> {
        Filter::stats(self)
    }
    fn dirty_bitmaps(&self) -> Option<&dyn crate::DirtyBitmaps> {
        Filter::dirty_bitmaps(self)
    }
    fn check_connections(&self, check: Option<Arc<dyn ConnectCheck>>) -> bool {
        Filter::check_connections(self, check)
    }
    fn unavailable(&self) -> bool {
        Filter::unavailable(self)
    }
}

#[cfg(test)]
mod tests {
    use blkq_sync::atomic::{AtomicUsize, Ordering};
    use blkq_sync::Mutex;

    use std::os::fd::AsFd;

    use super::*;
    use crate::bio::Op;
    use crate::stats::DiskStats;

    /// A lower device whose every answer is distinct from a `Device`'s defaults, and which
    /// records what reached it.
    #[derive(Default)]
    struct Lower {
        bios: Mutex<Vec<u64>>,
        checks: AtomicUsize,
    }

    impl Device for Lower {
        fn submit(&self, bio: Bio, end: &Arc<dyn EndIo>) {
            self.bios.lock().push(bio.sector);
            end.end_io(bio, Ok(()));
        }
        fn limits(&self) -> Limits {
            Limits {
                capacity: 1 << 20,
                logical_block_size: 4096,
                max_io_bytes: 1 << 16,
            }
        }
        fn extents_into(
            &self,
            offset: u64,
            _len: u64,
            _max: usize,
            out: &mut Vec<Extent>,
        ) -> Result<(), Error> {
            out.clear();
            out.push(Extent {
                offset,
                len: 7,
                allocated: false,
            });
            Ok(())
        }
        fn caps(&self) -> Caps {
            Caps {
                splice: true,
                recv_home: true,
                slow_extents: true,
            }
        }
        fn splice_read(&self, _: u64, len: usize, _: BorrowedFd<'_>) -> Result<usize, Error> {
            Ok(len / 2)
        }
        fn recv_home(&self, _: u64, _: usize, _: &mut dyn crate::RecvSource) -> Result<(), Error> {
            Err(Error::Io(std::io::Error::other("lower recv_home")))
        }
        fn stats(&self) -> Option<DiskStats> {
            Some(DiskStats::default())
        }
        fn check_connections(&self, _: Option<Arc<dyn ConnectCheck>>) -> bool {
            self.checks.fetch_add(1, Ordering::Relaxed);
            true
        }
        fn unavailable(&self) -> bool {
            true
        }
    }

    /// A filter that changes one thing: it fails writes.
    struct FailWrites(Arc<Lower>);

    impl Filter for FailWrites {
        fn lower(&self) -> &dyn Device {
            &*self.0
        }
        fn submit(&self, bio: Bio, end: &Arc<dyn EndIo>) {
            if bio.op == Op::Write {
                end.end_io(bio, Err(Error::Io(std::io::Error::other("injected"))));
            } else {
                self.lower().submit(bio, end)
            }
        }
    }

    /// A source the lower device never reads.
    struct Src(std::fs::File);
    impl crate::RecvSource for Src {
        fn fd(&self) -> BorrowedFd<'_> {
            self.0.as_fd()
        }
        fn received(&mut self, _: std::io::Result<usize>) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// Counts completions.
    #[derive(Default)]
    struct Count(AtomicUsize);
    impl EndIo for Count {
        fn end_io(&self, _: Bio, res: Result<(), Error>) {
            assert!(res.is_ok());
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    #[test]
    fn a_filter_that_overrides_submit_forwards_everything_else() {
        let lower = Arc::new(Lower::default());
        let f = FailWrites(lower.clone());
        let dev: &dyn Device = &f;
        // What it changes.
        assert!(crate::submit_wait(dev, Bio::new(Op::Write, 8, 4096))
            .1
            .is_err());
        assert!(crate::submit_wait(dev, Bio::new(Op::Read, 16, 4096))
            .1
            .is_ok());
        // A batch goes through the lower device's `submit_batch`, which the lower device
        // leaves at the default: its `submit`, not the filter's.
        let done = Arc::new(Count::default());
        let end: Arc<dyn EndIo> = done.clone();
        dev.submit_batch(
            &mut [24, 32].into_iter().map(|s| Bio::new(Op::Read, s, 4096)),
            &end,
        );
        assert_eq!(done.0.load(Ordering::Relaxed), 2);
        assert_eq!(
            *lower.bios.lock(),
            [16, 24, 32],
            "the failed write never reached it"
        );
        // Everything else is the lower device's answer.
        assert_eq!(dev.limits(), lower.limits());
        assert_eq!(dev.extents(0, 4096, 4).unwrap()[0].len, 7);
        assert_eq!(dev.caps(), lower.caps());
        let null = std::fs::File::open("/dev/null").unwrap();
        assert_eq!(dev.splice_read(0, 8192, null.as_fd()).unwrap(), 4096);
        let e = dev.recv_home(0, 4096, &mut Src(null)).unwrap_err();
        assert!(e.to_string().contains("lower recv_home"), "{e}");
        assert!(dev.stats().is_some());
        assert!(dev.check_connections(None));
        assert_eq!(lower.checks.load(Ordering::Relaxed), 1);
        assert!(dev.unavailable());
        assert!(dev.dirty_bitmaps().is_none() && dev.queue_stats().is_none());
    }
}
