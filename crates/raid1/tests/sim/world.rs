//! The simulated world of one seed: the array under test, its legs (fault devices with
//! volatile caches over memory), the model, the schedule so far, and one step per operation.
//!
//! The seed drives the array's shape (2 or 3 legs, bitmap or not, barrier mode, leg size) and
//! every operation, size, offset, fault rule, crash point and leg order at reassembly. In the
//! deterministic mode the sync thread is frozen except inside the operations that run it to
//! completion, so the schedule and the sync passes replay exactly; raid1d still runs on its
//! own (lazy bitmap clearing, superblock writes after a state change, held writes), and a power
//! cut takes the legs one after the other while the array runs, so what those threads had
//! done by then may differ between replays (it never may change what a read returns; when it
//! does, that is a bug, found at the replay that hits it). In the concurrent
//! mode resync, recovery and check run in the background at seeded speed limits while the
//! operations go on, and batches of writes are in flight together: the schedule replays, the
//! interleaving is the machine's, and the oracle does not depend on it.

use std::sync::Arc;
use std::time::Duration;

use blk::{Bio, BioFlags, Buffer, Device, EndIo, Op, SECTOR_SHIFT};
use blk_drivers::fault::{FaultConfig, FaultDevice, FaultHandle, OpSet, Rule};
use raid1::barrier::BARRIER_UNIT_SECTORS;
use raid1::superblock::{BITMAP_OFFSET, SB_OFFSET, SB_SIZE};
use raid1::{BarrierMode, Raid1, Raid1Config, SyncAction};
use testkit::io::submit_wait;
use testkit::Collect;

use super::common::mem;
use super::model::{stamp, Model, SECTOR};

/// A `sync_speed_max` (KiB/s) that never throttles here: waiting for a sync is no test.
const FAST: u64 = 100_000_000;
/// How long a sync run or a stop may take before the seed fails as a hang.
const HANG: Duration = Duration::from_secs(120);

/// SplitMix64: small, seedable, and the same everywhere.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed ^ 0x5DEE_CE66_D1CE_4E5B)
    }

    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    pub fn chance(&mut self, per_mille: u64) -> bool {
        self.below(1000) < per_mille
    }
}

/// The array's shape, from the seed.
#[derive(Debug, Clone)]
pub struct Shape {
    pub legs: usize,
    pub leg_mib: u64,
    pub bitmap_chunk: u64,
    pub barrier: BarrierMode,
    pub concurrent: bool,
    /// `write_behind=N` with the last leg write-mostly (with a bitmap only; 0: off).
    pub write_behind: u32,
    /// `readd=auto`: legs failed by fault rules come back by themselves when they answer.
    pub readd: bool,
}

impl Shape {
    pub fn from_rng(rng: &mut Rng) -> Self {
        Self {
            legs: 2 + rng.below(2) as usize,
            // 66 MiB legs cross a 64 MiB barrier unit; 12 MiB ones are quick.
            leg_mib: if rng.chance(400) { 66 } else { 12 },
            bitmap_chunk: match rng.below(3) {
                0 => 0,
                1 => 256 << 10,
                _ => 1 << 20,
            },
            barrier: if rng.chance(500) {
                BarrierMode::Lockless
            } else {
                BarrierMode::Locked
            },
            concurrent: rng.chance(500),
            write_behind: 0,
            readd: false,
        }
        .with_remote_options(rng)
    }

    /// The options of a mirror with a leg on another host, drawn after the others (so the
    /// rest of a seed's shape stays what it was).
    fn with_remote_options(mut self, rng: &mut Rng) -> Self {
        if self.bitmap_chunk != 0 && rng.chance(500) {
            self.write_behind = 1 + rng.below(8) as u32;
        }
        self.readd = rng.chance(500);
        self
    }

    fn cfg(&self) -> Raid1Config {
        Raid1Config {
            barrier: self.barrier,
            bitmap_chunk: self.bitmap_chunk,
            bitmap_quiet: Duration::from_millis(10),
            tick: Duration::from_millis(20),
            depth: 32,
            spare_slots: 1,
            write_behind: self.write_behind,
            readd_interval: self.readd.then_some(Duration::from_millis(30)),
            ..Raid1Config::default()
        }
    }
}

struct Leg {
    dev: Arc<dyn Device>,
    h: FaultHandle,
}

/// Counters of one run.
#[derive(Debug, Default, Clone, Copy)]
pub struct Stats {
    pub ops: u64,
    pub crashes: u64,
    pub syncs: u64,
    pub checks: u64,
    pub faults: u64,
    pub leg_changes: u64,
    pub io_errors: u64,
}

impl std::ops::AddAssign for Stats {
    fn add_assign(&mut self, o: Self) {
        self.ops += o.ops;
        self.crashes += o.crashes;
        self.syncs += o.syncs;
        self.checks += o.checks;
        self.faults += o.faults;
        self.leg_changes += o.leg_changes;
        self.io_errors += o.io_errors;
    }
}

pub struct World {
    pub seed: u64,
    rng: Rng,
    pub shape: Shape,
    legs: Vec<Leg>,
    r: Option<Raid1>,
    model: Model,
    lbs: u64,
    next_w: u32,
    /// A fault rule was added since the last clear: I/O errors are allowed.
    armed: bool,
    pub log: Vec<String>,
    pub stats: Stats,
}

fn ptr(d: &Arc<dyn Device>) -> *const u8 {
    Arc::as_ptr(d) as *const u8
}

impl World {
    pub fn new(seed: u64) -> Self {
        let mut rng = Rng::new(seed);
        let shape = Shape::from_rng(&mut rng);
        let mut w = Self {
            seed,
            rng,
            shape: shape.clone(),
            legs: Vec::new(),
            r: None,
            model: Model::new(0),
            lbs: 512,
            next_w: 1,
            armed: false,
            log: Vec::new(),
            stats: Stats::default(),
        };
        let devs: Vec<Arc<dyn Device>> = (0..shape.legs).map(|_| w.new_leg()).collect();
        let r = Raid1::create(devs, shape.cfg()).expect("create");
        if shape.write_behind > 0 {
            r.set_write_mostly(shape.legs - 1, true)
                .expect("write-mostly");
        }
        let cap = r.limits().capacity;
        w.lbs = u64::from(r.limits().logical_block_size);
        w.model = Model::new(cap / SECTOR as u64);
        r.set_speed_limits(1000, FAST);
        w.r = Some(r);
        w.freeze();
        w.say(format!("create {shape:?} capacity {cap}"));
        w
    }

    fn new_leg(&mut self) -> Arc<dyn Device> {
        let f = FaultDevice::new(
            mem(&format!("{}M", self.shape.leg_mib)),
            FaultConfig {
                volatile_cache: true,
                ..FaultConfig::default()
            },
        );
        let h = f.handle();
        let dev: Arc<dyn Device> = Arc::new(f);
        self.legs.push(Leg {
            dev: dev.clone(),
            h,
        });
        dev
    }

    fn r(&self) -> &Raid1 {
        self.r.as_ref().expect("an assembled array")
    }

    fn say(&mut self, s: String) {
        self.log.push(format!("#{} {s}", self.stats.ops));
    }

    /// The pool index of the leg in each slot.
    fn members(&self) -> Vec<(usize, usize)> {
        let r = self.r();
        (0..r.slots())
            .filter_map(|i| {
                let d = r.leg_device(i)?;
                let k = self.legs.iter().position(|l| ptr(&l.dev) == ptr(&d))?;
                Some((i, k))
            })
            .collect()
    }

    fn freeze(&self) {
        if !self.shape.concurrent {
            let _ = self.r().set_sync_action(SyncAction::Frozen);
        }
    }

    fn errors_allowed(&self) -> bool {
        self.armed || self.r().failure().is_some()
    }

    /// A range of `1..=max` bytes, sector-aligned to the logical block, near the places
    /// where bugs live: bitmap chunk and barrier unit boundaries, the start and the end.
    fn range(&mut self, max: u64) -> (u64, u64) {
        let cap = self.model.sectors() * SECTOR as u64;
        let lbs = self.lbs;
        let len = match self.rng.below(10) {
            0..=5 => lbs * (1 + self.rng.below(16)),
            6..=8 => lbs * (1 + self.rng.below(max / lbs)),
            _ => max,
        }
        .min(max)
        .min(cap);
        let chunk = if self.shape.bitmap_chunk > 0 {
            self.shape.bitmap_chunk
        } else {
            1 << 20
        };
        let unit = BARRIER_UNIT_SECTORS << SECTOR_SHIFT;
        let anchor = match self.rng.below(10) {
            0..=3 => self.rng.below(cap),
            4 | 5 => self.rng.below(cap / chunk + 1) * chunk,
            6 | 7 if cap > unit => unit,
            8 => 0,
            _ => cap,
        };
        let jitter = self.rng.below(2 * len + 1);
        let off = (anchor + jitter).saturating_sub(len);
        let off = off.min(cap - len) / lbs * lbs;
        (off, len)
    }

    fn sectors(off: u64, len: u64) -> (u64, u64) {
        (off / SECTOR as u64, len / SECTOR as u64)
    }

    fn stamped(&self, off: u64, len: u64, w: u32) -> Buffer {
        let mut b = Buffer::new(len as usize);
        for (k, s) in b.as_mut_slice().chunks_mut(SECTOR).enumerate() {
            stamp(w, off / SECTOR as u64 + k as u64, s);
        }
        b
    }

    /// One operation, chosen by the seed.
    pub fn step(&mut self) {
        self.stats.ops += 1;
        if self.r().failure().is_some() && self.rng.chance(300) {
            return self.crash();
        }
        match self.rng.below(1000) {
            0..=329 => self.write(),
            330..=519 => self.read(),
            520..=589 => self.flush(),
            590..=629 => self.zeroing(Op::Discard),
            630..=669 => self.zeroing(Op::WriteZeroes),
            670..=704 => self.add_fault(),
            705..=719 => self.clear_faults(),
            720..=744 => self.fail_leg(),
            745..=764 => self.remove_leg(),
            765..=789 => self.add_leg(),
            790..=814 => self.sync(),
            815..=834 => self.check(),
            835..=842 => self.replace(),
            843..=854 if self.shape.concurrent => self.speed(),
            855..=889 => self.batch(false),
            890..=912 => self.crash(),
            913..=924 => self.batch(true),
            925..=934 => self.crash_during_superblock_write(),
            _ => self.read(),
        }
    }

    fn write(&mut self) {
        let (off, len) = self.range(256 << 10);
        let fua = self.rng.chance(150);
        let w = self.next_w;
        self.next_w += 1;
        let mut bio = Bio::with_buf(Op::Write, off >> SECTOR_SHIFT, self.stamped(off, len, w));
        if fua {
            bio.flags = BioFlags::FUA;
        }
        let res = submit_wait(self.r(), bio).1;
        self.say(format!("write w{w} {off}+{len} fua={fua}: {res:?}"));
        self.record("write", off, len, w, fua, res);
    }

    /// The answer to write `w` (0: zeroes) of `off+len` goes into the model: acknowledged, or
    /// (allowed only with a fault armed or the array failed) maybe there.
    fn record(
        &mut self,
        what: &str,
        off: u64,
        len: u64,
        w: u32,
        fua: bool,
        res: Result<(), blk::Error>,
    ) {
        let (s, n) = Self::sectors(off, len);
        match res {
            Ok(()) => self.model.acked(s, n, w, fua),
            Err(e) => {
                self.stats.io_errors += 1;
                assert!(
                    self.errors_allowed(),
                    "{what} failed with no fault armed: {e}"
                );
                self.model.maybe(s, n, w);
            }
        }
    }

    fn zeroing(&mut self, op: Op) {
        let (off, len) = self.range(8 << 20);
        let fua = self.rng.chance(150);
        let mut bio = Bio::new(op, off >> SECTOR_SHIFT, len as u32);
        if fua {
            bio.flags = BioFlags::FUA;
        }
        let res = submit_wait(self.r(), bio).1;
        self.say(format!("{op:?} {off}+{len} fua={fua}: {res:?}"));
        self.record("zeroing", off, len, 0, fua, res);
    }

    fn read_at(&mut self, off: u64, len: u64) {
        let bio = Bio::with_buf(Op::Read, off >> SECTOR_SHIFT, Buffer::new(len as usize));
        let (b, res) = submit_wait(self.r(), bio);
        match res {
            Ok(()) => {
                let buf = b.buf.expect("a read returns its buffer");
                if let Err(e) = self
                    .model
                    .check(off / SECTOR as u64, &buf.as_slice()[..len as usize])
                {
                    panic!("read {off}+{len}: {e}");
                }
            }
            Err(e) => {
                self.stats.io_errors += 1;
                self.say(format!("read {off}+{len}: {e}"));
                assert!(self.armed, "read failed with no fault armed: {e}");
            }
        }
    }

    fn read(&mut self) {
        let (off, len) = self.range(1 << 20);
        self.say(format!("read {off}+{len}"));
        self.read_at(off, len);
    }

    /// Reads the whole array and checks every sector (`all`), or only the MiBs ever written.
    fn verify(&mut self, all: bool) {
        let cap = self.model.sectors() * SECTOR as u64;
        self.say(format!("verify {}", if all { "all" } else { "written" }));
        let mut off = 0;
        while off < cap {
            let len = (1 << 20).min(cap - off);
            if all || self.model.written(off >> 20) {
                self.read_at(off, len);
            }
            off += len;
        }
    }

    fn flush(&mut self) {
        let res = submit_wait(self.r(), Bio::new(Op::Flush, 0, 0)).1;
        self.say(format!("flush: {res:?}"));
        match res {
            Ok(()) => self.model.flushed(),
            Err(e) => {
                self.stats.io_errors += 1;
                assert!(
                    self.errors_allowed(),
                    "flush failed with no fault armed: {e}"
                );
            }
        }
    }

    /// A failure rule on a leg of the array: reads, writes, flushes or discards, in the data,
    /// the superblock or the bitmap, for the next few I/Os or with a probability.
    fn add_fault(&mut self) {
        let m = self.members();
        if m.is_empty() {
            return;
        }
        let (slot, k) = m[self.rng.below(m.len() as u64) as usize];
        let d = self.r().data_offset();
        let ops = [
            OpSet::READ,
            OpSet::WRITE,
            OpSet::FLUSH,
            OpSet::DISCARD,
            OpSet::ALL,
        ][self.rng.below(5) as usize];
        let mut rule = Rule::fail(ops);
        let (what, range) = match self.rng.below(4) {
            0 => ("superblock", Some((SB_OFFSET, SB_SIZE as u64))),
            1 => ("bitmap", Some((BITMAP_OFFSET, d - BITMAP_OFFSET))),
            2 => {
                let (off, len) = self.range(1 << 20);
                ("data", Some((d + off, len)))
            }
            _ => ("anywhere", None),
        };
        if let Some((o, l)) = range {
            rule = rule.in_range(o, l);
        }
        rule = if self.rng.chance(500) {
            rule.next(1 + self.rng.below(3))
        } else {
            rule.prob(0.05 + self.rng.below(30) as f64 / 100.0)
        };
        self.say(format!(
            "fault on slot {slot} (leg {k}): {ops:?} {what} {range:?}"
        ));
        self.legs[k].h.add(rule);
        self.armed = true;
        self.stats.faults += 1;
    }

    fn clear_faults(&mut self) {
        for l in &self.legs {
            l.h.clear();
        }
        self.say("clear faults".into());
        // I/O already failed may still be reported (held writes): allowed until next step.
        self.armed = false;
    }

    fn slot_where(&mut self, f: impl Fn(raid1::LegStatus) -> bool) -> Option<usize> {
        let r = self.r();
        let cands: Vec<usize> = (0..r.slots())
            .filter(|&i| r.leg_status(i).is_some_and(|s| s.present && f(s)))
            .collect();
        (!cands.is_empty()).then(|| cands[self.rng.below(cands.len() as u64) as usize])
    }

    fn fail_leg(&mut self) {
        let Some(i) = self.slot_where(|s| !s.faulty) else {
            return;
        };
        let res = self.r().fail_leg(i);
        self.say(format!("fail slot {i}: {res:?}"));
        self.stats.leg_changes += 1;
    }

    fn remove_leg(&mut self) {
        let Some(i) = self.slot_where(|s| s.faulty || !s.in_sync) else {
            return;
        };
        let res = self.r().remove_leg(i).map(|_| ());
        self.say(format!("remove slot {i}: {res:?}"));
        self.stats.leg_changes += 1;
        match res {
            Ok(()) => {}
            // In the concurrent mode its recovery may have finished since we looked.
            Err(raid1::Raid1Error::Slot(_, "in sync: fail it first")) if self.shape.concurrent => {}
            // Out all the same; the error is the superblock write's (or the array failed).
            Err(e) => assert!(self.errors_allowed(), "remove_leg: {e}"),
        }
    }

    fn add_leg(&mut self) {
        let inside: Vec<usize> = self.members().into_iter().map(|(_, k)| k).collect();
        let out: Vec<usize> = (0..self.legs.len())
            .filter(|k| !inside.contains(k))
            .collect();
        let (k, dev) = if !out.is_empty() && (self.rng.chance(600) || self.legs.len() >= 8) {
            let k = out[self.rng.below(out.len() as u64) as usize];
            (k, self.legs[k].dev.clone())
        } else {
            let dev = self.new_leg();
            (self.legs.len() - 1, dev)
        };
        self.legs[k].h.clear();
        let res = self.r().add_leg(dev);
        self.say(format!("add leg {k}: {res:?}"));
        self.stats.leg_changes += 1;
        if let Err(e) = res {
            assert!(
                self.errors_allowed() || e.to_string().contains("no free slot"),
                "add_leg: {e}"
            );
        }
    }

    /// Lets the sync thread run to idle (resync, recovery, a requested check).
    fn run_sync(&mut self) {
        let r = self.r();
        if !self.shape.concurrent {
            let _ = r.set_sync_action(SyncAction::Idle);
        }
        let idle = r.wait_sync_idle(HANG);
        self.freeze();
        assert!(idle, "the sync thread did not go idle within {HANG:?}");
    }

    fn sync(&mut self) {
        self.say("sync".into());
        // Slow limits matter while operations run beside the sync, not while we wait for it.
        self.r().set_speed_limits(1000, FAST);
        self.run_sync();
        self.stats.syncs += 1;
        let all = self.rng.chance(250);
        self.verify(all);
        self.check();
    }

    /// A check (or repair) of an array that is whole and needs no sync counts no mismatch.
    fn check(&mut self) {
        let repair = self.rng.chance(300);
        let r = self.r();
        if r.is_degraded() || r.failure().is_some() {
            return;
        }
        let action = if repair {
            SyncAction::Repair
        } else {
            SyncAction::Check
        };
        if r.set_sync_action(action).is_err() {
            return; // a resync or recovery is due first
        }
        r.set_speed_limits(1000, FAST);
        let idle = r.wait_sync_idle(HANG);
        self.freeze();
        assert!(idle, "the check did not finish within {HANG:?}");
        let p = self.r().sync_progress();
        self.say(format!("{action}: mismatch_cnt {}", p.mismatch_cnt));
        self.stats.checks += 1;
        // A check interrupted by a leg failure (a fault rule) proves nothing.
        if !self.r().is_degraded()
            && self.r().failure().is_none()
            && p.done_bytes >= p.total_bytes
            && p.mismatch_cnt != 0
        {
            let diffs = self.leg_differences(4);
            panic!(
                "{action} of a whole, synced array found {} mismatched sectors \
                 (sectors that differ now, with the write each leg holds: {diffs:?})",
                p.mismatch_cnt
            );
        }
    }

    /// Up to `max` sectors where the in-sync legs differ now: (sector, write id per leg).
    fn leg_differences(&self, max: usize) -> Vec<(u64, Vec<Option<u32>>)> {
        let r = self.r();
        let legs: Vec<Arc<dyn Device>> = (0..r.slots())
            .filter(|&i| r.leg_status(i).is_some_and(|s| s.in_sync && !s.faulty))
            .filter_map(|i| r.leg_device(i))
            .collect();
        let cap = self.model.sectors() * SECTOR as u64;
        let mut out = Vec::new();
        let mut off = 0;
        while off < cap && out.len() < max {
            let len = (1 << 20).min(cap - off) as usize;
            let bufs: Vec<Vec<u8>> = legs
                .iter()
                .map(|l| {
                    testkit::io::read_at(l.as_ref(), r.data_offset() + off, len).unwrap_or_default()
                })
                .collect();
            for k in 0..len / SECTOR {
                let at = |b: &Vec<u8>| b.get(k * SECTOR..(k + 1) * SECTOR).map(<[u8]>::to_vec);
                let first = at(&bufs[0]);
                if bufs.iter().any(|b| at(b) != first) && out.len() < max {
                    let s = off / SECTOR as u64 + k as u64;
                    let ids = bufs
                        .iter()
                        .map(|b| at(b).and_then(|x| super::model::decode(s, &x)))
                        .collect();
                    out.push((s, ids));
                }
            }
            off += len as u64;
        }
        out
    }

    fn replace(&mut self) {
        let Some(old) = self.slot_where(|s| s.in_sync && !s.faulty) else {
            return;
        };
        if self.legs.len() >= 8 {
            return;
        }
        let dev = self.new_leg();
        let r = self.r();
        r.set_speed_limits(1000, FAST);
        if !self.shape.concurrent {
            let _ = r.set_sync_action(SyncAction::Idle);
        }
        let res = r.replace_leg(old, dev).map(|_| ());
        self.freeze();
        self.say(format!("replace slot {old}: {res:?}"));
        self.stats.leg_changes += 1;
    }

    fn speed(&mut self) {
        let max = [1000, 20_000, 200_000, FAST][self.rng.below(4) as usize];
        self.say(format!("speed limit max {max} KiB/s"));
        self.r().set_speed_limits(1000.min(max), max);
    }

    /// Non-overlapping writes in flight together; with `crash`, a power cut before they are
    /// all answered (their outcome is then unknown).
    fn batch(&mut self, crash: bool) {
        let n = 2 + self.rng.below(7) as usize;
        let mut ranges: Vec<(u64, u64, u32, bool)> = Vec::new();
        for _ in 0..n * 3 {
            if ranges.len() == n {
                break;
            }
            let (off, len) = self.range(128 << 10);
            if ranges
                .iter()
                .any(|&(o, l, _, _)| off < o + l && o < off + len)
            {
                continue;
            }
            let w = self.next_w;
            self.next_w += 1;
            ranges.push((off, len, w, self.rng.chance(150)));
        }
        let col = Arc::new(Collect::default());
        let end: Arc<dyn EndIo> = col.clone();
        self.say(format!("batch crash={crash} {ranges:?}"));
        for &(off, len, w, fua) in &ranges {
            let mut bio = Bio::with_buf(Op::Write, off >> SECTOR_SHIFT, self.stamped(off, len, w));
            if fua {
                bio.flags = BioFlags::FUA;
            }
            self.r().submit(bio, &end);
        }
        if crash {
            for &(off, len, w, _) in &ranges {
                let (s, n) = Self::sectors(off, len);
                self.model.maybe(s, n, w);
            }
            self.crash_legs();
            let _ = col.wait_for(ranges.len());
            return self.reassemble();
        }
        for (bio, res) in col.wait_for(ranges.len()) {
            let &(off, len, w, fua) = ranges
                .iter()
                .find(|r| r.0 >> SECTOR_SHIFT == bio.sector)
                .expect("a completion of this batch");
            self.record("batch write", off, len, w, fua, res);
        }
    }

    /// Every leg's volatile cache is lost at once.
    fn crash_legs(&mut self) {
        for l in &self.legs {
            l.h.release();
            let _ = l.h.crash();
        }
    }

    /// Power cut: every leg loses what it had not made durable; the array stops uncleanly
    /// and is assembled again from the legs that were in it, in a seeded order.
    fn crash(&mut self) {
        self.say("crash".into());
        self.crash_legs();
        self.reassemble();
    }

    fn reassemble(&mut self) {
        let mut legs: Vec<usize> = self.members().into_iter().map(|(_, k)| k).collect();
        self.r.take().expect("an array").crash_for_test();
        for l in &self.legs {
            l.h.clear();
            l.h.restart();
        }
        self.armed = false;
        self.model.crashed();
        self.stats.crashes += 1;
        // A seeded order (Fisher-Yates).
        for i in (1..legs.len()).rev() {
            let j = self.rng.below(i as u64 + 1) as usize;
            legs.swap(i, j);
        }
        let devs: Vec<Arc<dyn Device>> = legs.iter().map(|&k| self.legs[k].dev.clone()).collect();
        let r = Raid1::assemble(devs.clone(), self.shape.cfg()).unwrap_or_else(|e| {
            let sbs: Vec<String> = devs
                .iter()
                .map(|d| {
                    Raid1::read_superblock(d.as_ref())
                        .map_or_else(|e| e.to_string(), |sb| sb.to_string())
                })
                .collect();
            panic!("assemble after a crash (legs {legs:?}): {e}; superblocks {sbs:#?}")
        });
        self.say(format!(
            "assembled from legs {legs:?}: warnings {:?}",
            r.assemble_warnings()
        ));
        r.set_speed_limits(1000, FAST);
        self.r = Some(r);
        self.freeze();
        let all = self.rng.chance(250);
        self.verify(all);
    }

    /// A power cut between two legs' superblock writes: one leg's superblock write is held
    /// while a state change writes them all, and the crash comes then.
    fn crash_during_superblock_write(&mut self) {
        let m = self.members();
        if m.len() < 2 {
            return self.crash();
        }
        let (slot, k) = m[self.rng.below(m.len() as u64) as usize];
        self.say(format!(
            "crash during a superblock write, held on slot {slot} (leg {k})"
        ));
        let h = self.legs[k].h.clone();
        h.add(
            Rule::stall(OpSet::WRITE)
                .in_range(SB_OFFSET, SB_SIZE as u64)
                .nth(1),
        );
        let r = self.r.as_ref().expect("an array");
        std::thread::scope(|s| {
            let t = s.spawn(|| r.sync_superblocks());
            let deadline = std::time::Instant::now() + Duration::from_secs(5);
            while h.stalled() == 0 && !t.is_finished() && std::time::Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(1));
            }
            for l in &self.legs {
                let _ = l.h.crash();
            }
            h.release();
            let _ = t.join();
        });
        self.reassemble();
    }
}

impl Drop for World {
    fn drop(&mut self) {
        // A stalled I/O would hold the array's stop forever.
        for l in &self.legs {
            l.h.clear();
            l.h.release();
        }
    }
}
