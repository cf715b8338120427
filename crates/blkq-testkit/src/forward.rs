//! `Forward`: a test device that forwards to an inner one and lets a [`Hook`] change only
//! the behaviour a test is about (fail, count, record, panic on some bios; hide the counters).

use std::os::fd::BorrowedFd;
use std::sync::Arc;

use blk::stats::DiskStats;
use blk::{Bio, Caps, Device, EndIo, Error, Filter, QueueStats, RecvSource};

/// The part of a [`Forward`] device a test changes. Every method has a default, so a hook
/// implements only what it intercepts; `inner` is the wrapped device.
///
/// The defaults make the wrapper see every bio and stand for itself, not for the device
/// under it: a batch is split into single [`Hook::submit`]s, zero-copy reads are off (they
/// carry no bio, so they would pass the hook by), and the inner device's counters are hidden
/// (they would miss the bios the hook completes itself), so a user such as the NBD server counts at
/// its own layer. A hook that says it is [`Hook::transparent`] stands for the device under it
/// instead: batches, zero-copy paths and the counters go to the inner device by default, and it
/// overrides only what it intercepts (a count, an injected failure).
pub trait Hook: Send + Sync {
    /// Whether the defaults below forward batches, zero-copy reads, writes received into their
    /// home and the counters to the inner device (default: no). A transparent hook sees no single
    /// bio of a batch unless it overrides [`Hook::submit_batch`] too.
    fn transparent(&self) -> bool {
        false
    }
    /// One bio (default: to the inner device).
    fn submit(&self, inner: &dyn Device, bio: Bio, end: &Arc<dyn EndIo>) {
        inner.submit(bio, end)
    }
    /// A batch (default: each bio through [`Hook::submit`]; transparent: the inner device's).
    fn submit_batch(
        &self,
        inner: &dyn Device,
        bios: &mut dyn Iterator<Item = Bio>,
        end: &Arc<dyn EndIo>,
    ) {
        if self.transparent() {
            return inner.submit_batch(bios, end);
        }
        for b in bios {
            self.submit(inner, b, end);
        }
    }
    /// What the device can do (default: the inner device's, less the zero-copy paths, which
    /// carry no bio; transparent: the inner device's).
    fn caps(&self, inner: &dyn Device) -> Caps {
        if self.transparent() {
            inner.caps()
        } else {
            inner.caps().bios_only()
        }
    }
    /// A zero-copy read (default: the inner device's where [`Hook::caps`] allows,
    /// unsupported otherwise).
    fn splice_read(
        &self,
        inner: &dyn Device,
        offset: u64,
        len: usize,
        pipe: BorrowedFd<'_>,
    ) -> Result<usize, Error> {
        if self.caps(inner).splice {
            inner.splice_read(offset, len, pipe)
        } else {
            Err(Error::Io(std::io::ErrorKind::Unsupported.into()))
        }
    }
    /// A write received into its home (default: the inner device's where [`Hook::caps`]
    /// allows, unsupported otherwise).
    fn recv_home(
        &self,
        inner: &dyn Device,
        offset: u64,
        len: usize,
        src: &mut dyn RecvSource,
    ) -> Result<(), Error> {
        if self.caps(inner).recv_home {
            inner.recv_home(offset, len, src)
        } else {
            Err(Error::Io(std::io::ErrorKind::Unsupported.into()))
        }
    }
    /// Whether the inner device's counters (disk and queue statistics) stand for the wrapper
    /// (default: no, see the trait's docs; transparent: yes).
    fn counts_below(&self) -> bool {
        self.transparent()
    }
}

/// The hook that changes nothing: a plain forwarder, with [`Hook`]'s defaults.
impl Hook for () {}

/// A [`Hook`] made of a closure over [`Hook::submit`] ([`Forward::on_submit`]).
pub struct OnSubmit<F>(F);

impl<F> Hook for OnSubmit<F>
where
    F: Fn(&dyn Device, Bio, &Arc<dyn EndIo>) + Send + Sync,
{
    fn submit(&self, inner: &dyn Device, bio: Bio, end: &Arc<dyn EndIo>) {
        (self.0)(inner, bio, end)
    }
}

/// A [`Device`] that forwards every call to `inner`, through a [`Hook`] that changes what a
/// test is about: a [`Filter`], so limits, extents and whatever the hook has no say in are
/// always the inner device's.
///
/// ```ignore
/// // Fail every write; everything else reaches `mem`.
/// let dev = Forward::on_submit(mem, |inner, bio, end| {
///     if bio.op == Op::Write {
///         end.end_io(bio, Err(Error::Io(std::io::Error::other("injected"))));
///     } else {
///         inner.submit(bio, end);
///     }
/// });
/// ```
pub struct Forward<H = ()> {
    inner: Arc<dyn Device>,
    hook: H,
}

impl Forward {
    /// A plain forwarder: `inner`'s bio path, with its queue and zero-copy reads hidden
    /// ([`Hook`]'s defaults).
    pub fn new(inner: Arc<dyn Device>) -> Self {
        Self::with_hook(inner, ())
    }
}

impl<F> Forward<OnSubmit<F>>
where
    F: Fn(&dyn Device, Bio, &Arc<dyn EndIo>) + Send + Sync,
{
    /// A forwarder whose bios go through `f(inner, bio, end)`, which completes them itself or
    /// passes them on with `inner.submit(bio, end)`.
    pub fn on_submit(inner: Arc<dyn Device>, f: F) -> Self {
        Self::with_hook(inner, OnSubmit(f))
    }
}

impl<H: Hook> Forward<H> {
    /// A forwarder through `hook`.
    pub fn with_hook(inner: Arc<dyn Device>, hook: H) -> Self {
        Self { inner, hook }
    }

    /// The hook, to reach its state (what it recorded, what it should fail next).
    pub fn hook(&self) -> &H {
        &self.hook
    }

    /// The wrapped device.
    pub fn inner(&self) -> &Arc<dyn Device> {
        &self.inner
    }
}

/// Everything the hook does not change is the inner device's ([`Filter`]'s defaults): limits,
/// extents, dirty bitmaps, a reconnecting device's checks.
impl<H: Hook> Filter for Forward<H> {
    fn lower(&self) -> &dyn Device {
        self.inner.as_ref()
    }
    fn submit(&self, bio: Bio, end: &Arc<dyn EndIo>) {
        self.hook.submit(self.inner.as_ref(), bio, end)
    }
    fn submit_batch(&self, bios: &mut dyn Iterator<Item = Bio>, end: &Arc<dyn EndIo>) {
        self.hook.submit_batch(self.inner.as_ref(), bios, end)
    }
    fn caps(&self) -> Caps {
        self.hook.caps(self.inner.as_ref())
    }
    fn splice_read(&self, offset: u64, len: usize, pipe: BorrowedFd<'_>) -> Result<usize, Error> {
        self.hook
            .splice_read(self.inner.as_ref(), offset, len, pipe)
    }
    fn recv_home(&self, offset: u64, len: usize, src: &mut dyn RecvSource) -> Result<(), Error> {
        self.hook.recv_home(self.inner.as_ref(), offset, len, src)
    }
    fn stats(&self) -> Option<DiskStats> {
        self.hook
            .counts_below()
            .then(|| self.inner.stats())
            .flatten()
    }
    fn queue_stats(&self) -> Option<QueueStats> {
        self.hook
            .counts_below()
            .then(|| self.inner.queue_stats())
            .flatten()
    }
}

#[cfg(test)]
mod tests {
    use blkq_sync::Mutex;

    use std::sync::Arc;

    // Not `Filter`: with it in scope too, a call on a `Forward` would be ambiguous.
    use blk::{Bio, Caps, Device, EndIo, Error, Op, SECTOR_SHIFT};

    use super::{Forward, Hook};
    use crate::io::submit_wait;
    use crate::Lower;

    fn inner() -> (Arc<Lower>, Arc<dyn Device>) {
        let i = Arc::new(Lower::default());
        (i.clone(), i)
    }

    #[test]
    fn a_hook_sees_each_bio_and_forwarding_reaches_the_inner_device() {
        let (seen_inside, dev) = inner();
        let seen_by_hook = Arc::new(Mutex::new(Vec::new()));
        let log = seen_by_hook.clone();
        let f = Forward::on_submit(dev, move |inner, bio, end| {
            log.lock().push((bio.op, bio.sector));
            if bio.sector == 8 {
                end.end_io(bio, Err(Error::Io(std::io::Error::other("injected"))));
            } else {
                inner.submit(bio, end);
            }
        });
        assert!(submit_wait(&f, Bio::new(Op::Read, 1, 512)).1.is_ok());
        assert!(submit_wait(&f, Bio::new(Op::Write, 8, 512)).1.is_err());
        let done = Arc::new(crate::Collect::default());
        let end: Arc<dyn EndIo> = done.clone();
        f.submit_batch(
            &mut [2, 3].into_iter().map(|s| Bio::new(Op::Read, s, 512)),
            &end,
        );
        assert_eq!(done.wait_for(2).len(), 2);
        assert_eq!(
            *seen_by_hook.lock(),
            [(Op::Read, 1), (Op::Write, 8), (Op::Read, 2), (Op::Read, 3)],
            "the hook sees every bio, a batch's one by one"
        );
        assert_eq!(seen_inside.sectors(), [1, 2, 3], "all but the failed one");
        assert_eq!(f.limits(), seen_inside.limits());
        assert_eq!(f.extents(1 << SECTOR_SHIFT, 4096, 4).unwrap()[0].len, 7);
    }

    #[test]
    fn a_plain_forwarder_hides_the_queue_and_zero_copy_reads_and_writes() {
        let (seen_inside, dev) = inner();
        let f = Forward::new(dev);
        assert!(submit_wait(&f, Bio::new(Op::Read, 5, 512)).1.is_ok());
        assert_eq!(seen_inside.sectors(), [5]);
        assert!(f.queue_stats().is_none() && f.stats().is_none());
        let caps = f.caps();
        assert!(!caps.splice && !caps.recv_home, "{caps:?}");
        assert!(
            caps.slow_extents,
            "what the hook has no say in is the inner device's"
        );
        assert!(Arc::ptr_eq(f.inner(), &(seen_inside as Arc<dyn Device>)));
    }

    #[test]
    fn a_hook_struct_keeps_its_state_and_may_turn_zero_copy_reads_on() {
        #[derive(Default)]
        struct Count(Mutex<usize>);
        impl Hook for Count {
            fn submit(&self, inner: &dyn Device, bio: Bio, end: &Arc<dyn EndIo>) {
                *self.0.lock() += 1;
                inner.submit(bio, end)
            }
            fn caps(&self, inner: &dyn Device) -> Caps {
                Caps {
                    recv_home: false,
                    ..inner.caps()
                }
            }
        }
        let (_, dev) = inner();
        let f = Forward::with_hook(dev, Count::default());
        submit_wait(&f, Bio::new(Op::Flush, 0, 0)).1.unwrap();
        assert_eq!(*f.hook().0.lock(), 1);
        assert!(f.caps().splice && !f.caps().recv_home);
    }
}
