//! Times a full `check` pass (read every leg and compare) of a fresh mirror over two `mem`
//! legs, after writing a pattern over the whole array through the mirror; prints MiB/s of
//! array capacity per second. The speed limit is lifted (md's `sync_speed_max` would cap the
//! pass at 200 000 KiB/s otherwise). Used by bench/raid1.sh:
//!   cargo run --release -p raid1 --example check_speed -- [SIZE_MIB] [check|repair] [crc32c]
//! (`crc32c`: an array with per-block checksums, whose check also verifies every block).
// A plain threaded benchmark, never a loom model: its harness may use std::sync.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]

#[cfg(blkq_loom)]
fn main() {}

#[cfg(not(blkq_loom))]
fn main() {
    use std::sync::{Arc, Condvar, Mutex};
    use std::time::{Duration, Instant};

    use blk::{Bio, Buffer, Device, EndIo, Error, Op, SECTOR_SHIFT};
    use blk_drivers::spec::{DeviceSpec, QueueOverrides};
    use raid1::{Raid1, Raid1Config, SyncAction};

    struct Wait(Mutex<Option<Result<(), Error>>>, Condvar);
    impl EndIo for Wait {
        fn end_io(&self, _bio: Bio, res: Result<(), Error>) {
            *self.0.lock().unwrap() = Some(res);
            self.1.notify_all();
        }
    }

    let mut args = std::env::args().skip(1);
    let mib: u64 = args.next().map_or(256, |s| s.parse().expect("SIZE_MIB"));
    let action: SyncAction = args
        .next()
        .unwrap_or_else(|| "check".into())
        .parse()
        .expect("check or repair");
    let integrity = args.next().map(|s| s.parse().expect("crc32c"));
    let leg = || -> Arc<dyn Device> {
        Arc::new(
            format!("mem:{}M", mib + 1)
                .parse::<DeviceSpec>()
                .unwrap()
                .build(&QueueOverrides::default())
                .unwrap(),
        )
    };
    let cfg = Raid1Config {
        integrity,
        ..Raid1Config::default()
    };
    let r = Raid1::create(vec![leg(), leg()], cfg).expect("create");
    let cap = r.limits().capacity;
    let chunk = 128u64 << 10;
    let w = Arc::new(Wait(Mutex::new(None), Condvar::new()));
    let end: Arc<dyn EndIo> = w.clone();
    let mut off = 0;
    while off + chunk <= cap {
        let mut b = Buffer::new(chunk as usize);
        b.as_mut_slice().fill((off >> 17) as u8 | 1);
        r.submit(Bio::with_buf(Op::Write, off >> SECTOR_SHIFT, b), &end);
        let mut g = w.0.lock().unwrap();
        while g.is_none() {
            g = w.1.wait(g).unwrap();
        }
        g.take().unwrap().expect("write");
        off += chunk;
    }
    r.set_speed_limits(u64::MAX / 2, u64::MAX / 2);
    let t0 = Instant::now();
    r.set_sync_action(action).expect("start the pass");
    while !r.wait_sync_idle(Duration::from_millis(100)) {}
    let secs = t0.elapsed().as_secs_f64();
    let p = r.sync_progress();
    println!(
        "{action:?}: {} MiB in {secs:.3} s = {:.0} MiB/s, mismatch_cnt {}",
        cap >> 20,
        (cap as f64 / (1 << 20) as f64) / secs,
        p.mismatch_cnt
    );
}
