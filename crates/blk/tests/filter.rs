//! A [`Filter`] forwards to the device below whatever it does not override.
// A plain threaded test, never a loom model: std atomics are its harness, not what a model
// explores.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]

use std::os::fd::{AsFd, BorrowedFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use blk::{Bio, Device, EndIo, Error, Filter, Op};
use testkit::Lower;

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
impl blk::RecvSource for Src {
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
    assert!(blk::submit_wait(dev, Bio::new(Op::Write, 8, 4096))
        .1
        .is_err());
    assert!(blk::submit_wait(dev, Bio::new(Op::Read, 16, 4096))
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
        lower.sectors(),
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
    assert_eq!(lower.checks(), 1);
    assert!(dev.unavailable());
    assert!(dev.dirty_bitmaps().is_none() && dev.queue_stats().is_none());
}
