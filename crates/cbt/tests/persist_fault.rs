//! A write whose new bit cannot be made durable fails, and never reaches the device: the
//! bitmap on disk is never a subset of what was written. Injected with a sink that fails its
//! sync (an fdatasync error) until told otherwise; the bit stays not durable, so the next write
//! to that granule persists again and succeeds once the sink does.

use blk::{Device, Op};
use blk_drivers::spec::{DeviceSpec, QueueOverrides};
use blkq_sync::atomic::{AtomicBool, AtomicU64, Ordering};
use blkq_sync::DynArc as Arc;
use cbt::sink::Sink;
use cbt::{Bitmaps, Mode, Tracked};
use testkit::io::{read_at, write_at};
use testkit::Forward;

#[derive(Default)]
struct Flaky {
    failing: AtomicBool,
    syncs: AtomicU64,
}

impl Sink for Flaky {
    fn write_pages(&self, _: u64, _: &[u8]) -> std::io::Result<()> {
        Ok(())
    }
    fn sync(&self) -> std::io::Result<()> {
        self.syncs.fetch_add(1, Ordering::Relaxed);
        if self.failing.load(Ordering::Relaxed) {
            return Err(std::io::Error::from_raw_os_error(libc::EIO));
        }
        Ok(())
    }
    fn describe(&self) -> String {
        "the flaky sidecar".into()
    }
}

#[test]
fn a_write_whose_bit_cannot_be_persisted_fails_and_is_not_forwarded() {
    let mem: Arc<dyn Device> = Arc::new(
        "mem:4M"
            .parse::<DeviceSpec>()
            .unwrap()
            .build(&QueueOverrides::default())
            .unwrap(),
    );
    let writes_below = Arc::new(AtomicU64::new(0));
    let seen = writes_below.clone();
    let inner: Arc<dyn Device> = Arc::new(Forward::on_submit(mem, move |inner, bio, end| {
        if bio.op == Op::Write {
            seen.fetch_add(1, Ordering::Relaxed);
        }
        inner.submit(bio, end)
    }));
    let sink = Arc::new(Flaky::default());
    let b = Bitmaps::with_sink(4 << 20, Mode::LockFree, sink.clone());
    b.add("a", 65536).unwrap();
    let t = Tracked::new(inner, b);

    sink.failing.store(true, Ordering::Relaxed);
    let e = write_at(&t, 65536, &[9u8; 4096]).unwrap_err();
    assert!(
        e.to_string().contains("the flaky sidecar") && e.to_string().contains("\"a\""),
        "{e}"
    );
    assert_eq!(
        writes_below.load(Ordering::Relaxed),
        0,
        "the write went down"
    );
    assert_eq!(read_at(&t, 65536, 4096).unwrap(), vec![0u8; 4096]);

    sink.failing.store(false, Ordering::Relaxed);
    let before = sink.syncs.load(Ordering::Relaxed);
    write_at(&t, 65536, &[9u8; 4096]).unwrap();
    assert_eq!(
        sink.syncs.load(Ordering::Relaxed),
        before + 1,
        "the failed bit was persisted again"
    );
    assert_eq!(writes_below.load(Ordering::Relaxed), 1);
    assert!(t.bitmaps().is_dirty("a", 65536).unwrap());
    // Reads and flushes never touch the bitmaps.
    sink.failing.store(true, Ordering::Relaxed);
    read_at(&t, 0, 4096).unwrap();
    testkit::io::flush(&t).unwrap();
}
