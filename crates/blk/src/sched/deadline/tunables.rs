//! mq-deadline's tunables: the shared, run-time settable [`DeadlineTunables`], and the
//! [`TunablesSnapshot`] one insert batch or dispatch call reads once and works with.

use blkq_sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};

use crate::Error;

/// mq-deadline's tunables, read once per insert batch or dispatch call (`Relaxed`: each value
/// stands alone; a change applies from the next batch).
#[derive(Debug)]
pub struct DeadlineTunables {
    read_expire_ns: AtomicU64,
    write_expire_ns: AtomicU64,
    writes_starved: AtomicU32,
    fifo_batch: AtomicU32,
    front_merges: AtomicBool,
    prio_aging_expire_ns: AtomicU64,
    async_depth: AtomicU32,
}

impl Default for DeadlineTunables {
    fn default() -> Self {
        Self {
            read_expire_ns: AtomicU64::new(500_000_000),
            write_expire_ns: AtomicU64::new(5_000_000_000),
            writes_starved: AtomicU32::new(2),
            fifo_batch: AtomicU32::new(16),
            front_merges: AtomicBool::new(true),
            prio_aging_expire_ns: AtomicU64::new(10_000_000_000),
            async_depth: AtomicU32::new(0),
        }
    }
}

fn dur_ns(d: std::time::Duration) -> u64 {
    d.as_nanos().min(u128::from(u64::MAX)) as u64
}

impl DeadlineTunables {
    /// The names [`DeadlineTunables::set`] takes (the kernel's sysfs names).
    pub const NAMES: [&'static str; 7] = [
        "read_expire",
        "write_expire",
        "writes_starved",
        "fifo_batch",
        "front_merges",
        "prio_aging_expire",
        "async_depth",
    ];

    /// Deadline of a read.
    pub fn read_expire(&self) -> std::time::Duration {
        std::time::Duration::from_nanos(self.read_expire_ns.load(Ordering::Relaxed))
    }
    /// Sets the deadline of a read.
    pub fn set_read_expire(&self, d: std::time::Duration) {
        self.read_expire_ns.store(dur_ns(d), Ordering::Relaxed);
    }
    /// Deadline of a write.
    pub fn write_expire(&self) -> std::time::Duration {
        std::time::Duration::from_nanos(self.write_expire_ns.load(Ordering::Relaxed))
    }
    /// Sets the deadline of a write.
    pub fn set_write_expire(&self, d: std::time::Duration) {
        self.write_expire_ns.store(dur_ns(d), Ordering::Relaxed);
    }
    /// Read batches chosen while writes wait before a write batch.
    pub fn writes_starved(&self) -> u32 {
        self.writes_starved.load(Ordering::Relaxed)
    }
    /// Sets `writes_starved`.
    pub fn set_writes_starved(&self, n: u32) {
        self.writes_starved.store(n, Ordering::Relaxed);
    }
    /// Requests per batch.
    pub fn fifo_batch(&self) -> u32 {
        self.fifo_batch.load(Ordering::Relaxed)
    }
    /// Sets `fifo_batch` (0 is taken as 1).
    pub fn set_fifo_batch(&self, n: u32) {
        self.fifo_batch.store(n.max(1), Ordering::Relaxed);
    }
    /// Whether front merges are tried.
    pub fn front_merges(&self) -> bool {
        self.front_merges.load(Ordering::Relaxed)
    }
    /// Sets `front_merges`.
    pub fn set_front_merges(&self, on: bool) {
        self.front_merges.store(on, Ordering::Relaxed);
    }
    /// Wait after which a lower priority class is served first.
    pub fn prio_aging_expire(&self) -> std::time::Duration {
        std::time::Duration::from_nanos(self.prio_aging_expire_ns.load(Ordering::Relaxed))
    }
    /// Sets `prio_aging_expire`.
    pub fn set_prio_aging_expire(&self, d: std::time::Duration) {
        self.prio_aging_expire_ns
            .store(dur_ns(d), Ordering::Relaxed);
    }
    /// `async_depth` as set: the most tags asynchronous requests may hold at once; 0 (the
    /// default) means the kernel's default, 3/4 of the tag pool's depth (module docs).
    pub fn async_depth(&self) -> u32 {
        self.async_depth.load(Ordering::Relaxed)
    }
    /// Sets `async_depth` (0: the default, 3/4 of the depth; the depth or more: no limit).
    /// Applies from the next tag allocation.
    pub fn set_async_depth(&self, n: u32) {
        self.async_depth.store(n, Ordering::Relaxed);
    }
    /// The cap `async_depth` puts on a tag pool of `depth` tags: the value set, or 3/4 of
    /// `depth` for 0; never below 1, never above `depth` (`depth`: no limit).
    pub fn async_depth_for(&self, depth: u32) -> u32 {
        let depth = depth.max(1);
        match self.async_depth() {
            0 => (u64::from(depth) * 3 / 4).max(1) as u32,
            n => n.min(depth),
        }
    }

    /// Sets a tunable by its sysfs name; expiries are in milliseconds, as in sysfs.
    pub fn set(&self, name: &str, value: &str) -> Result<(), Error> {
        let num = || {
            value
                .trim()
                .parse::<u64>()
                .map_err(|_| Error::Config(format!("mq-deadline {name}: bad number {value:?}")))
        };
        let small = || {
            num().and_then(|v| {
                u32::try_from(v)
                    .map_err(|_| Error::Config(format!("mq-deadline {name}: {value} is too large")))
            })
        };
        let ms = |v: u64| std::time::Duration::from_millis(v);
        match name {
            "read_expire" => self.set_read_expire(ms(num()?)),
            "write_expire" => self.set_write_expire(ms(num()?)),
            "writes_starved" => self.set_writes_starved(small()?),
            "fifo_batch" => self.set_fifo_batch(small()?),
            "front_merges" => self.set_front_merges(num()? != 0),
            "prio_aging_expire" => self.set_prio_aging_expire(ms(num()?)),
            "async_depth" => self.set_async_depth(small()?),
            _ => {
                return Err(Error::Config(format!(
                    "unknown mq-deadline tunable {name:?} (expected one of {})",
                    Self::NAMES.join(", ")
                )))
            }
        }
        Ok(())
    }

    pub(super) fn snapshot(&self) -> TunablesSnapshot {
        TunablesSnapshot {
            expire: [
                self.read_expire_ns.load(Ordering::Relaxed),
                self.write_expire_ns.load(Ordering::Relaxed),
            ],
            writes_starved: self.writes_starved.load(Ordering::Relaxed),
            fifo_batch: self.fifo_batch.load(Ordering::Relaxed).max(1),
            front_merges: self.front_merges.load(Ordering::Relaxed),
            aging: self.prio_aging_expire_ns.load(Ordering::Relaxed),
        }
    }
}

/// The tunables one batch works with.
#[derive(Debug, Clone, Copy)]
pub(super) struct TunablesSnapshot {
    pub(super) expire: [u64; 2],
    pub(super) writes_starved: u32,
    pub(super) fifo_batch: u32,
    pub(super) front_merges: bool,
    pub(super) aging: u64,
}
