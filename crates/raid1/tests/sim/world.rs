//! The simulated world of one seed: the array under test, its legs (fault devices with
//! volatile caches over memory), the model, the schedule so far, and one step per operation.
//!
//! The seed drives the array's shape (2 or 3 legs, bitmap or not, barrier mode, leg size) and
//! every operation, size, offset, fault rule, crash point and leg order at reassembly. In the
//! deterministic mode the sync thread is frozen except inside the operations that run it to
//! completion (and the power cut mid-sync, which lets it run for a seeded few ms at a slow
//! limit), so the schedule and the sync passes replay exactly; raid1d still runs on its
//! own (lazy bitmap clearing, superblock writes after a state change, held writes), and a power
//! cut takes the legs one after the other while the array runs, so what those threads had
//! done by then may differ between replays (it never may change what a read returns; when it
//! does, that is a bug, found at the replay that hits it). In the concurrent
//! mode resync, recovery and check run in the background at seeded speed limits while the
//! operations go on, and batches of writes are in flight together: the schedule replays, the
//! interleaving is the machine's, and the oracle does not depend on it.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use blk::{Bio, BioFlags, Buffer, Device, EndIo, Op, SECTOR_SHIFT};
use blk_drivers::fault::{FaultConfig, FaultDevice, FaultHandle, OpSet, Partial, Rule};
use cbt::{Bitmaps, Identity, Image, Options, Store, Tracked};
use raid1::barrier::BARRIER_UNIT_SECTORS;
use raid1::superblock::{BITMAP_OFFSET, SB_OFFSET, SB_SIZE};
use raid1::{BarrierMode, Raid1, Raid1Config, SyncAction};
use testkit::io::submit_wait;
use testkit::Collect;

use super::common::mem;
use super::model::{stamp, Model, Unsummed, SECTOR};

/// A `sync_speed_max` (KiB/s) that never throttles here: waiting for a sync is no test.
const FAST: u64 = 100_000_000;
/// How long a sync run or a stop may take before the seed fails as a hang.
const HANG: Duration = Duration::from_secs(120);
/// Bytes per checksummed block (an integrity seed's I/O unit).
const BLOCK: u64 = raid1::integrity::BLOCK;

/// The seed's generator ([`testkit::rng::Rng`], its state salted), with chances in per mille.
pub struct Rng(testkit::rng::Rng);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(testkit::rng::Rng(seed ^ 0x5DEE_CE66_D1CE_4E5B))
    }

    pub fn next(&mut self) -> u64 {
        self.0.next()
    }

    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.0.below(n)
    }

    pub fn chance(&mut self, per_mille: u64) -> bool {
        self.0.chance(per_mille, 1000)
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
    /// Every leg's I/Os complete after up to this many µs (0: at once), and a write-mostly
    /// leg's writes after 0.5-2.5 ms more (so write-behind lasts).
    pub latency_us: u64,
    /// With write-behind, for half the seeds: the write-mostly leg is behind a slow link, its
    /// data writes complete 40-80 ms late (0: no slow link), longer than two of raid1d's
    /// ticks and the bitmap's quiet time, so the lazy clearing meets writes still behind.
    pub slow_link_ms: u64,
    /// Changed-block tracking over the array (half the seeds): dirty bitmaps in a sidecar
    /// file, added, rotated, cleared and removed by the schedule, reopened at every assembly.
    pub cbt: bool,
    /// Per-block checksums (`integrity=crc32c`, a third of the seeds): every I/O is 4 KiB
    /// aligned, and fault rules also flip bits of the legs' reads and writes.
    pub integrity: bool,
}

impl Shape {
    pub fn from_rng(rng: &mut Rng) -> Self {
        Self {
            legs: 2 + rng.below(2) as usize,
            // 66 MiB legs cross a 64 MiB barrier unit; 12 MiB ones are quick.
            leg_mib: if rng.chance(250) { 66 } else { 12 },
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
            latency_us: 0,
            slow_link_ms: 0,
            cbt: false,
            integrity: false,
        }
        .with_remote_options(rng)
        .with_integrity(rng)
    }

    /// Per-block checksums, drawn last (so the rest of a seed's shape stays what it was).
    fn with_integrity(mut self, rng: &mut Rng) -> Self {
        self.integrity = rng.chance(333);
        self
    }

    /// The options of a mirror with a leg on another host, drawn after the others (so the
    /// rest of a seed's shape stays what it was).
    fn with_remote_options(mut self, rng: &mut Rng) -> Self {
        if self.bitmap_chunk != 0 && rng.chance(500) {
            self.write_behind = 1 + rng.below(8) as u32;
        }
        self.readd = rng.chance(500);
        self.latency_us = [0, 0, 50, 300][rng.below(4) as usize];
        if self.write_behind > 0 && rng.chance(500) {
            self.slow_link_ms = 40;
        }
        self.cbt = rng.chance(500);
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
            integrity: self.integrity.then_some(raid1::Algorithm::Crc32c),
            ..Raid1Config::default()
        }
    }
}

struct Leg {
    dev: Arc<dyn Device>,
    h: FaultHandle,
}

/// Counters of one run: what happened, and how much of it the oracle could judge.
#[derive(Debug, Default, Clone, Copy)]
pub struct Stats {
    pub ops: u64,
    pub crashes: u64,
    pub syncs: u64,
    pub checks: u64,
    pub faults: u64,
    pub leg_changes: u64,
    pub io_errors: u64,
    /// Operations that began on a degraded array (a leg missing, failed or recovering).
    pub degraded_ops: u64,
    /// Checks that ran to the end on a whole array (the only ones that judge it).
    pub whole_checks: u64,
    /// Power cuts while a resync, recovery or check was running.
    pub crashes_mid_sync: u64,
    /// Power cuts aimed between two legs' superblock writes, and those that landed there
    /// (a superblock write was held when the power went).
    pub sb_cuts: u64,
    pub sb_cuts_held: u64,
    /// I/O errors that were due (a fault rule on every leg that could serve, or a failed
    /// array): the only ones accepted.
    pub errors_due: u64,
    /// Unflushed leg writes a power cut let through whole, and torn.
    pub writes_kept: u64,
    pub writes_torn: u64,
    /// Sectors pinned by a read, and reads of a pinned sector.
    pub pins: u64,
    pub pin_hits: u64,
    /// Dirty bitmap commands run, and granules found dirty as owed (after commands and
    /// reopenings).
    pub bitmap_ops: u64,
    pub granules_checked: u64,
    /// Integrity seeds run; flip rules armed on reads and on writes; flipped I/Os the legs
    /// completed (`FaultCounters::flipped`).
    pub integrity_seeds: u64,
    pub flips_read_armed: u64,
    pub flips_write_armed: u64,
    pub flips_fired: u64,
    /// The arrays' `IntegrityCounts`, summed over every assembly.
    pub healed: u64,
    pub unrecoverable: u64,
    pub resummed: u64,
    /// Read errors accepted as due because every leg's copy of a block may be flipped.
    pub flip_errors_due: u64,
    /// Repairs with no flip rule armed, each followed by a check that judged the legs.
    pub scrubs: u64,
    /// Heal probes: a bit flipped on every leg behind the array's back, then a read.
    pub heal_probes: u64,
    /// Sectors read with a bit flipped where the array had no sum (never written or
    /// trimmed), where the crash rule re-summed them (at a crash of a whole array, of a
    /// degraded one), and written since a crash in a chunk still waiting for its resync.
    pub flips_nosum: u64,
    pub flips_crash: u64,
    pub flips_crash_degraded: u64,
    pub flips_pending: u64,
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
        self.degraded_ops += o.degraded_ops;
        self.whole_checks += o.whole_checks;
        self.crashes_mid_sync += o.crashes_mid_sync;
        self.sb_cuts += o.sb_cuts;
        self.sb_cuts_held += o.sb_cuts_held;
        self.errors_due += o.errors_due;
        self.writes_kept += o.writes_kept;
        self.writes_torn += o.writes_torn;
        self.pins += o.pins;
        self.pin_hits += o.pin_hits;
        self.bitmap_ops += o.bitmap_ops;
        self.granules_checked += o.granules_checked;
        self.integrity_seeds += o.integrity_seeds;
        self.flips_read_armed += o.flips_read_armed;
        self.flips_write_armed += o.flips_write_armed;
        self.flips_fired += o.flips_fired;
        self.healed += o.healed;
        self.unrecoverable += o.unrecoverable;
        self.resummed += o.resummed;
        self.flip_errors_due += o.flip_errors_due;
        self.scrubs += o.scrubs;
        self.heal_probes += o.heal_probes;
        self.flips_nosum += o.flips_nosum;
        self.flips_crash += o.flips_crash;
        self.flips_crash_degraded += o.flips_crash_degraded;
        self.flips_pending += o.flips_pending;
    }
}

/// A fault rule armed on a leg: its operations and its byte range on the leg (None: all);
/// `flip`: it flips bits (never fails an I/O), `id` its id on the leg.
#[derive(Debug, Clone, Copy)]
struct Armed {
    leg: usize,
    ops: OpSet,
    range: Option<(u64, u64)>,
    flip: bool,
    id: u64,
}

/// A dirty bitmap as the oracle knows it: the granules written since it was added or cleared
/// (while it recorded), each of which it (or the bitmap a rotation started from it) must
/// mark dirty, after any crash too.
struct Owed {
    name: String,
    grain: u64,
    recording: bool,
    /// The bitmap `rotate` started from this one.
    successor: Option<String>,
    granules: BTreeSet<u64>,
}

/// The changed-block tracking of a `cbt` seed: the tracked array, its sidecar's directory,
/// and what each bitmap owes.
struct Cbt {
    tracked: Option<Arc<Tracked>>,
    dir: tempfile::TempDir,
    owed: Vec<Owed>,
    next: u32,
}

pub struct World {
    pub seed: u64,
    rng: Rng,
    pub shape: Shape,
    legs: Vec<Leg>,
    r: Option<Arc<Raid1>>,
    cbt: Option<Cbt>,
    model: Model,
    lbs: u64,
    next_w: u32,
    /// The fault rules added since the last clear: an I/O error is due only where they say.
    armed: Vec<Armed>,
    /// The resync source (first in-sync leg, by pool index) when the model's pins were made.
    source: Option<usize>,
    /// Integrity seeds: per pool leg, per block of the array, whether the leg's stored copy
    /// may have a bit flipped (a write flip rule covered it while armed, or the leg was
    /// recovered where every leg serving may have; cleared by a scrub).
    bad: Vec<Vec<bool>>,
    /// Per pool leg, per block: a read flip rule covered it since the last scrub (a recovery
    /// from that leg alone may have copied a flipped read).
    read_flipped: Vec<Vec<bool>>,
    /// Per block: a flip rule ever covered it, or a heal probe flipped it (only such a block
    /// can hold a flipped bit the crash rule re-summed).
    flip_hist: Vec<bool>,
    /// The legs serving at the last step (a leg newly serving was recovered from them).
    prev_serving: Vec<usize>,
    /// The chunks dirty (bitmap) just before the last power cut, and whether the array was
    /// degraded then: the crash rule's reach (`None`: no bitmap, all of it).
    cut_dirty: Option<Vec<(u64, u64)>>,
    cut_degraded: bool,
    /// What the crash rule may still re-sum: the reach of every cut since the last check
    /// that judged a whole array (no resync was due then).
    unsettled: Vec<(u64, u64)>,
    /// `IntegrityCounts` of the arrays assembled before this one.
    counts_before: (u64, u64, u64),
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
            cbt: None,
            model: Model::new(0, false),
            lbs: 512,
            next_w: 1,
            armed: Vec::new(),
            source: None,
            bad: Vec::new(),
            read_flipped: Vec::new(),
            flip_hist: Vec::new(),
            prev_serving: Vec::new(),
            cut_dirty: None,
            cut_degraded: false,
            unsettled: Vec::new(),
            counts_before: (0, 0, 0),
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
        w.model = Model::new(cap / SECTOR as u64, shape.integrity);
        w.model.strict = std::env::var("SIM_SUMS_STRICT").is_ok_and(|v| v.trim() == "1");
        if shape.integrity {
            assert_eq!(w.lbs, BLOCK, "an array with integrity has 4 KiB blocks");
            assert_eq!(cap % BLOCK, 0, "an array with integrity holds whole blocks");
            w.stats.integrity_seeds = 1;
        }
        r.set_speed_limits(1000, FAST);
        w.r = Some(Arc::new(r));
        w.freeze();
        w.slow_links();
        if shape.cbt {
            w.cbt = Some(Cbt {
                tracked: None,
                dir: tempfile::tempdir().expect("a directory for the sidecar"),
                owed: Vec::new(),
                next: 0,
            });
            w.open_bitmaps();
        }
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
        self.base_rules(self.legs.len() - 1);
        dev
    }

    /// A leg's latency rules (added again after every clear of its rules).
    fn base_rules(&self, k: usize) {
        let h = &self.legs[k].h;
        let us = self.shape.latency_us;
        if us > 0 {
            h.add(Rule::delay(
                OpSet::ALL,
                Duration::ZERO,
                Duration::from_micros(us),
            ));
            if self.shape.write_behind > 0 {
                h.add(Rule::delay(
                    OpSet::WRITE,
                    Duration::from_micros(500),
                    Duration::from_millis(2),
                ));
            }
        }
        // A write-mostly leg behind a slow link: its data writes (not its superblock and
        // bitmap, which every state change waits for). Only while it is write-mostly (a leg
        // added back is not), so that syncs to it stay quick.
        if let Some(d) = self.slow_link(k) {
            h.add(
                Rule::delay(
                    OpSet::WRITE,
                    Duration::from_millis(self.shape.slow_link_ms),
                    Duration::from_millis(self.shape.slow_link_ms),
                )
                .in_range(d, u64::MAX - d),
            );
        }
    }

    /// The array's data offset if leg `k` is a write-mostly member behind a slow link.
    fn slow_link(&self, k: usize) -> Option<u64> {
        let r = self.r.as_ref().filter(|_| self.shape.slow_link_ms > 0)?;
        let wm = (0..r.slots()).any(|i| {
            r.leg_status(i).is_some_and(|s| s.write_mostly)
                && r.leg_device(i)
                    .is_some_and(|d| ptr(&d) == ptr(&self.legs[k].dev))
        });
        wm.then(|| r.data_offset())
    }

    /// Puts the slow link's rule on the write-mostly legs (at creation and reassembly, once
    /// the array says which they are).
    fn slow_links(&mut self) {
        for k in 0..self.legs.len() {
            if self.slow_link(k).is_some() {
                self.clear_leg(k);
            }
        }
    }

    /// Blocks of the array.
    fn blocks(&self) -> usize {
        (self.model.sectors() * SECTOR as u64 / BLOCK) as usize
    }

    /// Leg `k`'s per-block flag vector `which` (0: bad, 1: read flipped), sized.
    fn flags(&mut self, which: u8, k: usize) -> &mut Vec<bool> {
        let n = self.blocks();
        let v = if which == 0 {
            &mut self.bad
        } else {
            &mut self.read_flipped
        };
        if v.len() <= k {
            v.resize(k + 1, Vec::new());
        }
        if v[k].len() < n {
            v[k].resize(n, false);
        }
        &mut v[k]
    }

    fn is_bad(&self, k: usize, b: usize) -> bool {
        self.bad
            .get(k)
            .and_then(|v| v.get(b))
            .copied()
            .unwrap_or(false)
    }

    /// A leg that began serving since the last step was recovered from those serving then:
    /// where each of them may have held (or handed out) a flipped copy, it may hold one too,
    /// and so where any of them handed out a flipped read of a block without a sum (nothing
    /// caught it).
    fn track_serving(&mut self) {
        if !self.shape.integrity {
            return;
        }
        let now = self.serving();
        let prev = std::mem::take(&mut self.prev_serving);
        let new: Vec<usize> = now.iter().copied().filter(|k| !prev.contains(k)).collect();
        if !prev.is_empty() && !new.is_empty() {
            let rf = |w: &Self, k: usize, b: usize| {
                w.read_flipped
                    .get(k)
                    .and_then(|v| v.get(b))
                    .copied()
                    .unwrap_or(false)
            };
            let per = BLOCK / SECTOR as u64;
            for b in 0..self.blocks() {
                let all = prev.iter().all(|&k| self.is_bad(k, b) || rf(self, k, b));
                let unsummed =
                    || (b as u64 * per..(b as u64 + 1) * per).any(|s| self.model.unsummed(s));
                if all || prev.iter().any(|&k| rf(self, k, b)) && unsummed() {
                    for &k in &new {
                        self.flags(0, k)[b] = true;
                    }
                }
            }
        }
        self.prev_serving = now;
    }

    /// Clears leg `k`'s fault rules (its latency stays).
    fn clear_leg(&mut self, k: usize) {
        self.legs[k].h.clear();
        self.base_rules(k);
        self.armed.retain(|a| a.leg != k);
    }

    /// The pool indexes of the legs that serve reads and take writes now (in sync, not failed).
    fn serving(&self) -> Vec<usize> {
        let r = self.r();
        (0..r.slots())
            .filter(|&i| {
                r.leg_status(i)
                    .is_some_and(|s| s.present && s.in_sync && !s.faulty)
            })
            .filter_map(|i| {
                let d = r.leg_device(i)?;
                self.legs.iter().position(|l| ptr(&l.dev) == ptr(&d))
            })
            .collect()
    }

    /// The pool index of the resync source: the first leg serving that is not write-mostly,
    /// or the first serving when all are (md's rule: a write-mostly leg may lack writes the
    /// others have, and is copied over them only when nothing else can be read).
    fn source_leg(&self) -> Option<usize> {
        let r = self.r();
        let serving: Vec<(usize, bool)> = (0..r.slots())
            .filter_map(|i| {
                let s = r.leg_status(i)?;
                if !(s.present && s.in_sync && !s.faulty) {
                    return None;
                }
                let d = r.leg_device(i)?;
                let k = self.legs.iter().position(|l| ptr(&l.dev) == ptr(&d))?;
                Some((k, s.write_mostly))
            })
            .collect();
        serving
            .iter()
            .find(|&&(_, wm)| !wm)
            .or(serving.first())
            .map(|&(k, _)| k)
    }

    /// After an assembly, where the legs may differ the array returns what its resync source
    /// holds (reads past the resync point go to it, and the resync copies it to the others):
    /// pins every written sector to what that leg holds now, so a read that later finds
    /// another leg's data (a write-mostly leg copied over it, a clean chunk whose legs
    /// differ) fails.
    fn pin_source(&mut self) {
        self.repin();
        // With checksums a block the source holds against its sum is read from a leg that
        // matches (or re-summed): where the legs differ, what reads return is the sums'
        // choice, pinned by the first read.
        if self.shape.integrity {
            return;
        }
        let Some(k) = self.source else { return };
        let dev = self.legs[k].dev.clone();
        let d = self.r().data_offset();
        let cap = self.model.sectors() * SECTOR as u64;
        let (mut off, mut pinned) = (0, 0u64);
        while off < cap {
            let len = (1 << 20).min(cap - off);
            if self.model.written(off >> 20) {
                let Ok(buf) = testkit::io::read_at(dev.as_ref(), d + off, len as usize) else {
                    return;
                };
                for (j, b) in buf.chunks(SECTOR).enumerate() {
                    let s = off / SECTOR as u64 + j as u64;
                    if let Some(w) = super::model::decode(s, b) {
                        pinned += u64::from(self.model.pin_to(s, w));
                    }
                }
            }
            off += len;
        }
        self.say(format!(
            "pinned {pinned} sectors to leg {k}, the resync source"
        ));
    }

    /// Unpins the model's sectors when what reads return may change without a write: the
    /// resync source (the first in-sync leg) changed, or a read fault is armed (a read error
    /// is corrected from another leg, which may hold other data where they may differ).
    fn repin(&mut self) {
        let source = self.source_leg();
        let read_fault = self.armed.iter().any(|a| a.ops.contains(Op::Read));
        if source != self.source || read_fault {
            self.model.unpin_all();
            self.source = source;
        }
    }

    /// Whether an error of `op` on `off+len` of the array is due: the array failed, or every
    /// leg in `serving` (the legs that could serve it, taken before it was issued) has a rule
    /// armed that may fail it (a read: a read rule on its data, or a leg no longer serving
    /// with another rule armed, which failed it meanwhile; anything else: any rule but a read
    /// one, as a failed superblock or bitmap write fails the leg too).
    fn due(&self, op: Op, off: u64, len: u64, serving: &[usize]) -> bool {
        if self.r().failure().is_some() {
            return true;
        }
        let d = self.r().data_offset();
        let (a, b) = (d + off, d + off + len.max(1));
        // Leg `k` has a failure rule (not a flip) armed that may fail this I/O.
        let fails = |k: usize| {
            self.armed.iter().any(|x| {
                x.leg == k
                    && !x.flip
                    && if op == Op::Read {
                        x.ops.contains(Op::Read) && x.range.is_none_or(|(o, l)| o < b && a < o + l)
                    } else {
                        x.ops.0 & !OpSet::READ.0 != 0
                    }
            })
        };
        // A read's leg may also have left the array while the read was in flight: failed by a
        // rule on another op (a write, its bitmap or superblock area), by the time the read's
        // retry looked for another leg.
        let now = self.serving();
        let left = |k: usize| {
            !now.contains(&k)
                && self
                    .armed
                    .iter()
                    .any(|x| x.leg == k && !x.flip && x.ops.0 & !OpSet::READ.0 != 0)
        };
        !serving.is_empty()
            && serving
                .iter()
                .all(|&k| fails(k) || op == Op::Read && left(k))
            || op == Op::Read && self.flip_due(off, len, serving, &fails)
    }

    /// Whether a read of `off+len` may fail on the checksums: for some block, every leg in
    /// `serving` gives no copy (`fails`), or its copy may have a bit flipped (stored so, or
    /// a read flip rule armed over it, which may flip again when raid1d reads every leg).
    fn flip_due(
        &self,
        off: u64,
        len: u64,
        serving: &[usize],
        fails: &dyn Fn(usize) -> bool,
    ) -> bool {
        if !self.shape.integrity || serving.is_empty() {
            return false;
        }
        let d = self.r().data_offset();
        (off / BLOCK..(off + len).div_ceil(BLOCK)).any(|blk| {
            let (a, b) = (d + blk * BLOCK, d + (blk + 1) * BLOCK);
            serving.iter().all(|&k| {
                fails(k)
                    || self.is_bad(k, blk as usize)
                    || self.armed.iter().any(|x| {
                        x.leg == k
                            && x.flip
                            && x.ops.contains(Op::Read)
                            && x.range.is_none_or(|(o, l)| o < b && a < o + l)
                    })
            })
        })
    }

    /// For a failed read of an integrity seed: per block whose copies do not all match the
    /// sum on the legs, each in-sync leg's write id (`~`: one bit flipped) and whether it
    /// matches the sum its own checksum area holds, and the model's allowed writes.
    fn sums_report(&self, off: u64, len: u64) -> String {
        if !self.shape.integrity {
            return String::new();
        }
        let r = self.r();
        let d = r.data_offset();
        let per = raid1::integrity::PER_PAGE as u64;
        let mut out = String::from("; blocks (leg: write, matches its sum on disk):");
        let mut shown = 0;
        for blk in off / BLOCK..(off + len).div_ceil(BLOCK) {
            let mut line = Vec::new();
            let mut all = true;
            for i in 0..r.slots() {
                let (Some(st), Some(dev)) = (r.leg_status(i), r.leg_device(i)) else {
                    continue;
                };
                if !st.in_sync || st.faulty {
                    continue;
                }
                let Ok(data) = testkit::io::read_at(dev.as_ref(), d + blk * BLOCK, BLOCK as usize)
                else {
                    continue;
                };
                let s0 = blk * BLOCK / SECTOR as u64;
                let ids: Vec<String> = data
                    .chunks(SECTOR)
                    .enumerate()
                    .map(|(j, b)| {
                        let s = s0 + j as u64;
                        super::model::decode(s, b).map_or_else(
                            || {
                                super::model::decode_flipped(s, b)
                                    .map_or("?".into(), |w| format!("~{w}"))
                            },
                            |w| w.to_string(),
                        )
                    })
                    .collect();
                let disk = Raid1::read_superblock(dev.as_ref())
                    .ok()
                    .and_then(|sb| sb.integrity)
                    .and_then(|a| {
                        testkit::io::read_at(dev.as_ref(), a.offset + blk / per * 4096, 4096).ok()
                    })
                    .map(|p| {
                        let k = (blk % per * 4) as usize;
                        u32::from_le_bytes([p[k], p[k + 1], p[k + 2], p[k + 3]])
                    });
                let m = disk.map(|x| x == 0 || x == raid1::integrity::block_sum(&data));
                all &= m == Some(true);
                line.push(format!("slot {i}: {ids:?} {m:?}"));
            }
            if (!all || len == BLOCK) && shown < 3 {
                shown += 1;
                out += &format!(
                    "\n  block at {} ({line:?}); model allows {}",
                    blk * BLOCK,
                    self.model.allowed(blk * BLOCK / SECTOR as u64)
                );
            }
        }
        out
    }

    /// This seed's counters, the model's pins included.
    pub fn stats(&self) -> Stats {
        let (healed, unrecoverable, resummed) = self.integrity_counts();
        Stats {
            pins: self.model.pins,
            pin_hits: self.model.pin_hits,
            flips_fired: self
                .legs
                .iter()
                .map(|l| l.h.counters().flipped.iter().sum::<u64>())
                .sum(),
            healed,
            unrecoverable,
            resummed,
            flips_nosum: self.model.flips_read[Unsummed::NoSum as usize],
            flips_crash: self.model.flips_read[Unsummed::Crash as usize],
            flips_crash_degraded: self.model.flips_read[Unsummed::CrashDegraded as usize],
            flips_pending: self.model.flips_read[Unsummed::Pending as usize],
            ..self.stats
        }
    }

    /// The `IntegrityCounts` of every array of this seed so far (healed, unrecoverable,
    /// resummed).
    fn integrity_counts(&self) -> (u64, u64, u64) {
        let (h, u, r) = self.counts_before;
        match self.r.as_ref().and_then(|r| r.integrity()) {
            Some((_, c)) => (h + c.healed, u + c.unrecoverable, r + c.resummed),
            None => (h, u, r),
        }
    }

    fn r(&self) -> &Raid1 {
        self.r.as_deref().expect("an assembled array")
    }

    /// Where the data path goes: the tracked array in a `cbt` seed, else the array.
    fn dev(&self) -> &dyn Device {
        match self.cbt.as_ref().and_then(|c| c.tracked.as_deref()) {
            Some(t) => t,
            None => self.r(),
        }
    }

    /// A change of `off+len` is about to go down: every recording bitmap owes its granules.
    fn owe(&mut self, off: u64, len: u64) {
        let Some(c) = self.cbt.as_mut() else { return };
        for o in c.owed.iter_mut().filter(|o| o.recording) {
            for g in off / o.grain..(off + len.max(1)).div_ceil(o.grain) {
                o.granules.insert(g);
            }
        }
    }

    /// Opens the bitmaps from the sidecar (at creation: none yet) over the array now
    /// assembled, and checks them against what they owe.
    fn open_bitmaps(&mut self) {
        let cap = self.r().limits().capacity;
        let r: Arc<dyn Device> = self.r.clone().expect("an array");
        let Some(c) = self.cbt.as_mut() else { return };
        let opts = Options {
            store: Store::File {
                path: c.dir.path().join("sim.bitmaps"),
                image: Image::Fixed(Identity {
                    size: cap,
                    uuid: [7; 16],
                }),
            },
            reset: false,
            mode: cbt::Mode::LockFree,
        };
        let (bitmaps, _) = Bitmaps::open(cap, &opts)
            .unwrap_or_else(|e| panic!("the dirty bitmaps did not reopen: {e}"));
        c.tracked = Some(Arc::new(Tracked::new(r, bitmaps)));
        self.check_bitmaps("reopened");
    }

    /// The bitmaps listed are those the oracle knows, recording or frozen as it knows them,
    /// and each granule a bitmap owes is dirty in it or in the bitmap rotated from it.
    fn check_bitmaps(&mut self, when: &str) {
        let Some(c) = self.cbt.as_ref() else { return };
        let Some(t) = c.tracked.as_ref() else { return };
        let bm = t.bitmaps();
        let list = bm.list();
        let have: Vec<(String, bool)> =
            list.iter().map(|i| (i.name.clone(), i.recording)).collect();
        let want: Vec<(String, bool)> = c
            .owed
            .iter()
            .map(|o| (o.name.clone(), o.recording))
            .collect();
        assert_eq!(
            have, want,
            "the dirty bitmaps {when}: listed (name, recording) vs known"
        );
        for o in &c.owed {
            for &g in &o.granules {
                let at = g * o.grain;
                let dirty = bm.is_dirty(&o.name, at).unwrap_or(false)
                    || o.successor
                        .as_ref()
                        .is_some_and(|n| bm.is_dirty(n, at).unwrap_or(false));
                assert!(
                    dirty,
                    "dirty bitmap {:?} ({when}): granule at byte {at} was written since it \
                     was added or cleared, but it is clean (and in its successor {:?})",
                    o.name, o.successor
                );
            }
        }
        self.stats.granules_checked += c.owed.iter().map(|o| o.granules.len() as u64).sum::<u64>();
    }

    /// A bitmap command: add, rotate, clear or remove, then a check of them all.
    fn bitmap_op(&mut self) {
        let Some(c) = self.cbt.as_ref() else {
            return self.read();
        };
        let n = c.owed.len();
        let pick = |w: &mut Self, f: &dyn Fn(&Owed) -> bool| -> Option<usize> {
            let c = w.cbt.as_ref()?;
            let cands: Vec<usize> = (0..c.owed.len()).filter(|&i| f(&c.owed[i])).collect();
            (!cands.is_empty()).then(|| cands[w.rng.below(cands.len() as u64) as usize])
        };
        let what = self.rng.below(4);
        let c = self.cbt.as_ref().expect("cbt");
        let t = c.tracked.clone().expect("tracked bitmaps");
        let bm = t.bitmaps();
        let said = match what {
            0 | 1 if n < 4 || what == 0 && n < 6 => {
                let grain = [64 << 10, 256 << 10, 1 << 20][self.rng.below(3) as usize];
                let c = self.cbt.as_mut().expect("cbt");
                let name = format!("b{}", c.next);
                c.next += 1;
                bm.add(&name, grain).expect("add a bitmap");
                c.owed.push(Owed {
                    name: name.clone(),
                    grain,
                    recording: true,
                    successor: None,
                    granules: BTreeSet::new(),
                });
                format!("bitmap add {name} granularity {grain}")
            }
            1 => match pick(self, &|o| o.recording) {
                Some(i) => {
                    let c = self.cbt.as_mut().expect("cbt");
                    let new = format!("b{}", c.next);
                    c.next += 1;
                    let old = c.owed[i].name.clone();
                    bm.rotate(&old, &new).expect("rotate a bitmap");
                    let grain = c.owed[i].grain;
                    c.owed[i].recording = false;
                    c.owed[i].successor = Some(new.clone());
                    c.owed.push(Owed {
                        name: new.clone(),
                        grain,
                        recording: true,
                        successor: None,
                        granules: BTreeSet::new(),
                    });
                    format!("bitmap rotate {old} -> {new}")
                }
                None => "bitmap rotate: none recording".into(),
            },
            2 => match pick(self, &|_| true) {
                Some(i) => {
                    let c = self.cbt.as_mut().expect("cbt");
                    let name = c.owed[i].name.clone();
                    bm.clear(&name).expect("clear a bitmap");
                    c.owed[i].granules.clear();
                    // A frozen one cleared owes nothing; a recording one from now on.
                    format!("bitmap clear {name}")
                }
                None => "bitmap clear: none".into(),
            },
            _ => match pick(self, &|o| !o.recording) {
                Some(i) => {
                    let c = self.cbt.as_mut().expect("cbt");
                    let name = c.owed.remove(i).name;
                    bm.remove(&name).expect("remove a bitmap");
                    for o in &mut c.owed {
                        if o.successor.as_deref() == Some(name.as_str()) {
                            o.successor = None;
                        }
                    }
                    format!("bitmap remove {name}")
                }
                None => "bitmap remove: none frozen".into(),
            },
        };
        self.say(said);
        self.stats.bitmap_ops += 1;
        self.check_bitmaps("after a command");
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

    /// Leg management may fail while any rule is armed (its superblock writes) or the array
    /// failed.
    fn errors_allowed(&self) -> bool {
        self.armed.iter().any(|a| !a.flip) || self.r().failure().is_some()
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
        self.repin();
        self.track_serving();
        let degraded = self.r().is_degraded();
        self.stats.degraded_ops += u64::from(degraded);
        if self.r().failure().is_some() && self.rng.chance(300) {
            return self.crash();
        }
        // Leg changes make the array whole again more often than they break it, so that it
        // is whole about half the time (checks judge only a whole array).
        let heal = degraded && self.rng.chance(60);
        if heal {
            return self.heal();
        }
        match self.rng.below(1000) {
            0..=329 => self.write(),
            330..=519 => self.read(),
            520..=589 => {
                self.flush();
            }
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
            935..=949 => self.crash_mid_sync(),
            950..=974 if self.shape.integrity => self.heal_probe(),
            950..=974 => self.reads(),
            975..=989 => self.bitmap_op(),
            _ => self.read(),
        }
    }

    fn write(&mut self) {
        let (off, len) = self.range(256 << 10);
        self.write_at(off, len);
    }

    /// A write somewhere in the array's first `end` bytes (sector-aligned to the block).
    fn write_below(&mut self, end: u64) {
        let lbs = self.lbs;
        if end < lbs {
            return;
        }
        let len = (lbs * (1 + self.rng.below(64))).min(end / lbs * lbs);
        let off = self.rng.below((end - len) / lbs + 1) * lbs;
        self.write_at(off, len);
    }

    fn write_at(&mut self, off: u64, len: u64) {
        let fua = self.rng.chance(150);
        let w = self.next_w;
        self.next_w += 1;
        let mut bio = Bio::with_buf(Op::Write, off >> SECTOR_SHIFT, self.stamped(off, len, w));
        if fua {
            bio.flags = BioFlags::FUA;
        }
        let serving = self.serving();
        self.owe(off, len);
        let res = submit_wait(self.dev(), bio).1;
        self.say(format!("write w{w} {off}+{len} fua={fua}: {res:?}"));
        self.record("write", Op::Write, off, len, w, fua, res, &serving);
    }

    /// The answer to write `w` (0: zeroes) of `off+len` goes into the model: acknowledged, or
    /// (allowed only when due, see `due`; `serving`: the legs before it) maybe there. With
    /// integrity, an acknowledged write or write-zeroes has its sums, a discard has none.
    #[allow(clippy::too_many_arguments)]
    fn record(
        &mut self,
        what: &str,
        op: Op,
        off: u64,
        len: u64,
        w: u32,
        fua: bool,
        res: Result<(), blk::Error>,
        serving: &[usize],
    ) {
        let (s, n) = Self::sectors(off, len);
        if self.shape.integrity {
            match (op, &res) {
                (Op::Discard, _) => self.model.set_unsummed(s, n, Unsummed::NoSum),
                (_, Ok(())) => {
                    self.model.set_unsummed(s, n, Unsummed::Summed);
                    for &(a, b) in &self.unsettled {
                        let (a, b) = (a.max(off), b.min(off + len));
                        if a < b {
                            let (s, n) = Self::sectors(a, b - a);
                            self.model.set_unsummed(s, n, Unsummed::Pending);
                        }
                    }
                }
                _ => {}
            }
        }
        match res {
            Ok(()) => self.model.acked(s, n, w, fua),
            Err(e) => {
                self.error_due(Op::Write, off, len, serving, what, &e);
                self.model.maybe(s, n, w);
            }
        }
    }

    /// Fails the seed unless an error of `op` on `off+len` was due.
    fn error_due(
        &mut self,
        op: Op,
        off: u64,
        len: u64,
        serving: &[usize],
        what: &str,
        e: &blk::Error,
    ) {
        self.stats.io_errors += 1;
        assert!(
            self.due(op, off, len, serving),
            "{what} {off}+{len} failed though it was not due (legs that could serve it: \
             {serving:?}; rules armed: {:?}): {e}{}",
            self.armed,
            if op == Op::Read {
                self.sums_report(off, len)
            } else {
                String::new()
            }
        );
        self.stats.errors_due += 1;
        if op == Op::Read && self.flip_due(off, len, serving, &|_| false) {
            self.stats.flip_errors_due += 1;
        }
    }

    fn zeroing(&mut self, op: Op) {
        let (off, len) = self.range(8 << 20);
        let fua = self.rng.chance(150);
        let mut bio = Bio::new(op, off >> SECTOR_SHIFT, len as u32);
        if fua {
            bio.flags = BioFlags::FUA;
        }
        let serving = self.serving();
        self.owe(off, len);
        let res = submit_wait(self.dev(), bio).1;
        self.say(format!("{op:?} {off}+{len} fua={fua}: {res:?}"));
        self.record("zeroing", op, off, len, 0, fua, res, &serving);
    }

    fn read_at(&mut self, off: u64, len: u64) {
        self.repin();
        self.track_serving();
        let serving = self.serving();
        let bio = Bio::with_buf(Op::Read, off >> SECTOR_SHIFT, Buffer::new(len as usize));
        let (b, res) = submit_wait(self.dev(), bio);
        self.read_done(off, len, b, res, &serving);
    }

    /// Checks a read's answer against the model (pinning what it found).
    fn read_done(
        &mut self,
        off: u64,
        len: u64,
        b: Bio,
        res: Result<(), blk::Error>,
        serving: &[usize],
    ) {
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
                self.say(format!("read {off}+{len}: {e}"));
                self.error_due(Op::Read, off, len, serving, "read", &e);
            }
        }
    }

    /// Several reads in flight together (overlapping or not), so that read balancing spreads
    /// them over the legs.
    fn reads(&mut self) {
        let n = 2 + self.rng.below(7) as usize;
        let ranges: Vec<(u64, u64)> = (0..n).map(|_| self.range(256 << 10)).collect();
        self.say(format!("reads {ranges:?}"));
        self.repin();
        self.track_serving();
        let serving = self.serving();
        let col = Arc::new(Collect::default());
        let end: Arc<dyn EndIo> = col.clone();
        for &(off, len) in &ranges {
            let bio = Bio::with_buf(Op::Read, off >> SECTOR_SHIFT, Buffer::new(len as usize));
            self.dev().submit(bio, &end);
        }
        for (bio, res) in col.wait_for(ranges.len()) {
            let len = bio.buf.as_ref().map_or(0, |b| b.len() as u64);
            self.read_done(bio.sector << SECTOR_SHIFT, len, bio, res, &serving);
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

    /// A FLUSH of the array; whether it succeeded.
    fn flush(&mut self) -> bool {
        let serving = self.serving();
        let res = submit_wait(self.dev(), Bio::new(Op::Flush, 0, 0)).1;
        self.say(format!("flush: {res:?}"));
        match res {
            Ok(()) => {
                self.model.flushed();
                true
            }
            Err(e) => {
                self.error_due(Op::Flush, 0, 0, &serving, "flush", &e);
                false
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
        if self.shape.integrity && self.rng.chance(500) {
            return self.add_flip(&m);
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
        let id = self.legs[k].h.add(rule);
        self.armed.push(Armed {
            leg: k,
            ops,
            range,
            flip: false,
            id,
        });
        self.stats.faults += 1;
    }

    /// A flip rule on a leg of an integrity seed (a mirror without sums could not catch it):
    /// reads, writes or both, in a seeded part of the data (now and then all of it), for the
    /// next few I/Os, the nth, or with a probability. Never in the superblock, bitmap or
    /// checksum area.
    fn add_flip(&mut self, m: &[(usize, usize)]) {
        let (slot, k) = m[self.rng.below(m.len() as u64) as usize];
        let d = self.r().data_offset();
        let cap = self.model.sectors() * SECTOR as u64;
        let ops = [OpSet::READ, OpSet::WRITE, OpSet::READ | OpSet::WRITE]
            [[0, 0, 1, 1, 2][self.rng.below(5) as usize]];
        let (off, len) = if self.rng.chance(150) {
            (0, cap)
        } else {
            self.range(1 << 20)
        };
        let mut rule = Rule::flip(ops).in_range(d + off, len);
        let when = match self.rng.below(5) {
            0 | 1 => {
                let n = 1 + self.rng.below(3);
                rule = rule.next(n);
                format!("next {n}")
            }
            2 => {
                let n = 1 + self.rng.below(20);
                rule = rule.nth(n);
                format!("nth {n}")
            }
            _ => {
                let p = 0.02 + self.rng.below(30) as f64 / 100.0;
                rule = rule.prob(p);
                format!("prob {p:.2}")
            }
        };
        self.say(format!(
            "flip on slot {slot} (leg {k}): {ops:?} data {off}+{len} {when}"
        ));
        let id = self.legs[k].h.add(rule);
        self.armed.push(Armed {
            leg: k,
            ops,
            range: Some((d + off, len)),
            flip: true,
            id,
        });
        // Every write to the leg there (the client's, a resync's, a heal's) may store a
        // flipped bit from now on; a read flipped there may be what a recovery copies.
        let blocks = (off / BLOCK) as usize..(off + len).div_ceil(BLOCK) as usize;
        self.note_flipped(blocks.clone());
        if ops.contains(Op::Write) {
            self.flags(0, k)[blocks.clone()].fill(true);
            self.stats.flips_write_armed += 1;
        }
        if ops.contains(Op::Read) {
            self.flags(1, k)[blocks.clone()].fill(true);
            self.stats.flips_read_armed += 1;
            // The crash rule re-sums a block no leg matches as the source's read of it
            // had it, writing nothing back where no other leg is rewritten: a flipped read
            // there leaves a sum no leg's copy matches (every later read of it fails).
            let reach: Vec<(u64, u64)> = self.unsettled.clone();
            for (a, b) in reach {
                let r = (a / BLOCK) as usize..b.div_ceil(BLOCK) as usize;
                let (lo, hi) = (r.start.max(blocks.start), r.end.min(blocks.end));
                for j in 0..self.legs.len() {
                    if lo < hi {
                        self.flags(0, j)[lo..hi].fill(true);
                    }
                }
            }
        }
        self.stats.faults += 1;
    }

    /// Silent corruption behind the array's back, then one read (integrity seeds without
    /// write-behind, a whole array with no rule armed and nothing left to resync): one bit flipped in a different
    /// block of each leg's copy of a range the array holds the sums of, so the read meets a
    /// bad block whichever leg it goes to. It must return the model's data, and raid1d must
    /// have rewritten every bad block from a leg that matched: each leg then holds what the
    /// read returned. A FLUSH then makes the legs' state durable.
    fn heal_probe(&mut self) {
        let serving = self.serving();
        let r = self.r();
        if r.is_degraded()
            || r.failure().is_some()
            || !self.armed.is_empty()
            || !self.unsettled.is_empty()
            || serving.len() < 2
            // A write behind may still be on its way to the write-mostly leg.
            || self.shape.write_behind > 0
        {
            return self.read();
        }
        let d = r.data_offset();
        let n = serving.len() as u64;
        let (off, len) = self.range(256 << 10);
        let blocks = len / BLOCK;
        let (s0, ns) = Self::sectors(off, len);
        let clean = blocks >= n
            && (s0..s0 + ns).all(|s| !self.model.unsummed(s))
            && (off / BLOCK..off / BLOCK + blocks)
                .all(|b| serving.iter().all(|&k| !self.is_bad(k, b as usize)));
        if !clean {
            return self.read();
        }
        let mut flipped = Vec::new();
        for (i, &k) in serving.iter().enumerate() {
            let b = off / BLOCK + i as u64 * (blocks / n) + self.rng.below(blocks / n);
            let byte = self.rng.below(BLOCK);
            let bit = 1u8 << self.rng.below(8);
            let dev = self.legs[k].dev.clone();
            let at = d + b * BLOCK;
            let Ok(mut data) = testkit::io::read_at(dev.as_ref(), at, BLOCK as usize) else {
                return;
            };
            data[byte as usize] ^= bit;
            if testkit::io::write_at(dev.as_ref(), at, &data).is_err() {
                return;
            }
            flipped.push((k, b * BLOCK));
            self.note_flipped(b as usize..b as usize + 1);
        }
        self.say(format!(
            "heal probe: {off}+{len}, a bit flipped on (leg, block) {flipped:?}"
        ));
        self.stats.heal_probes += 1;
        let bio = Bio::with_buf(Op::Read, off >> SECTOR_SHIFT, Buffer::new(len as usize));
        let (b, res) = submit_wait(self.dev(), bio);
        let got = b
            .buf
            .as_ref()
            .map(|x| x.as_slice()[..len as usize].to_vec());
        self.read_done(off, len, b, res, &serving);
        let got = got.expect("a read returns its buffer");
        for &k in &serving {
            let held = testkit::io::read_at(self.legs[k].dev.as_ref(), d + off, len as usize)
                .unwrap_or_default();
            let differ: Vec<u64> = held
                .chunks(BLOCK as usize)
                .zip(got.chunks(BLOCK as usize))
                .enumerate()
                .filter(|(_, (x, y))| x != y)
                .map(|(j, _)| off + j as u64 * BLOCK)
                .collect();
            assert!(
                differ.is_empty(),
                "heal probe {off}+{len}: leg {k} does not hold what the read returned at \
                 blocks {differ:?} (a block raid1d found bad was not rewritten from a leg \
                 that matched; flipped (leg, block): {flipped:?}; integrity counts {:?}){}",
                self.r().integrity(),
                differ
                    .first()
                    .map_or(String::new(), |&x| self.sums_report(x, BLOCK))
            );
        }
        self.flush();
    }

    /// Blocks a flip may have reached (`flip_hist`).
    fn note_flipped(&mut self, blocks: std::ops::Range<usize>) {
        let n = self.blocks();
        self.flip_hist.resize(n, false);
        self.flip_hist[blocks.start.min(n)..blocks.end.min(n)].fill(true);
    }

    /// Removes every flip rule (the other rules stay).
    fn clear_flips(&mut self) {
        for a in self.armed.iter().filter(|a| a.flip) {
            self.legs[a.leg].h.remove(a.id);
        }
        self.armed.retain(|a| !a.flip);
    }

    fn clear_faults(&mut self) {
        for k in 0..self.legs.len() {
            self.clear_leg(k);
        }
        self.say("clear faults".into());
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
        self.clear_leg(k);
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

    /// A check (or repair) of an array that is whole and needs no sync counts no mismatch
    /// (with integrity: unless a leg's copy may have a bit flipped, or a flip rule is
    /// armed). An integrity seed's check is now and then a scrub: a repair with every flip
    /// rule removed, then a check that must count nothing but the blocks every leg may hold
    /// flipped.
    fn check(&mut self) {
        let repair = self.rng.chance(300);
        let scrub = self.shape.integrity && self.rng.chance(150);
        let r = self.r();
        if r.is_degraded() || r.failure().is_some() {
            return;
        }
        if scrub {
            self.clear_flips();
            self.say("scrub: flip rules removed".into());
        }
        let action = if repair || scrub {
            SyncAction::Repair
        } else {
            SyncAction::Check
        };
        let Some((p, judged)) = self.run_check(action) else {
            return;
        };
        if judged && p.mismatch_cnt != 0 && !self.flips_may_differ() {
            let diffs = self.leg_differences(4);
            panic!(
                "{action} of a whole, synced array found {} mismatched sectors \
                 (sectors that differ now, with the write each leg holds: {diffs:?})",
                p.mismatch_cnt
            );
        }
        if judged && p.mismatch_cnt == 0 {
            self.settled();
        }
        if judged && scrub {
            self.after_scrub();
        }
        // Nothing left to resync: a heal probe can judge the heal now.
        if judged && self.shape.integrity && self.rng.chance(500) {
            self.heal_probe();
        }
    }

    /// Runs `action` to its end: its progress, and whether it judged a whole array (None:
    /// it could not start, a resync or recovery is due first).
    fn run_check(&mut self, action: SyncAction) -> Option<(raid1::SyncProgress, bool)> {
        let r = self.r();
        if r.set_sync_action(action).is_err() {
            return None;
        }
        r.set_speed_limits(1000, FAST);
        let idle = r.wait_sync_idle(HANG);
        self.freeze();
        assert!(idle, "the check did not finish within {HANG:?}");
        let p = self.r().sync_progress();
        self.say(format!("{action}: mismatch_cnt {}", p.mismatch_cnt));
        self.stats.checks += 1;
        self.track_serving();
        // A check interrupted by a leg failure (a fault rule) proves nothing.
        let judged = !self.r().is_degraded()
            && self.r().failure().is_none()
            && p.done_bytes >= p.total_bytes;
        self.stats.whole_checks += u64::from(judged);
        if judged {
            // No resync was due: the crash rule has settled all it reached.
            self.unsettled.clear();
        }
        Some((p, judged))
    }

    /// Whether the legs serving may differ by a flipped bit: a flip rule is armed, or a
    /// leg's copy of some block may be flipped.
    fn flips_may_differ(&self) -> bool {
        self.armed.iter().any(|a| a.flip)
            || self
                .serving()
                .iter()
                .any(|&k| self.bad.get(k).is_some_and(|v| v.contains(&true)))
    }

    /// After a check of a whole array that counted nothing (integrity seeds): the legs agree,
    /// and the resync has settled every block the crash rule reached, so a block the legs
    /// hold unflipped has its sum again (one they hold flipped stays re-summed so).
    fn settled(&mut self) {
        if !self.shape.integrity {
            return;
        }
        let legs: Vec<Arc<dyn Device>> = self
            .serving()
            .iter()
            .map(|&k| self.legs[k].dev.clone())
            .collect();
        let d = self.r().data_offset();
        let cap = self.model.sectors() * SECTOR as u64;
        let mut off = 0;
        let per = BLOCK / SECTOR as u64;
        while off < cap {
            let len = (1 << 20).min(cap - off);
            let (s0, n) = Self::sectors(off, len);
            // Where no flip ever reached, nothing flipped was re-summed.
            let mut flipped = false;
            for s in s0..s0 + n {
                if !self.model.crash_marked(s) {
                    continue;
                }
                if self
                    .flip_hist
                    .get((s / per) as usize)
                    .copied()
                    .unwrap_or(false)
                {
                    flipped = true;
                } else {
                    self.model.set_unsummed(s, 1, Unsummed::Summed);
                }
            }
            if flipped {
                let bufs: Vec<Vec<u8>> = legs
                    .iter()
                    .map(|l| {
                        testkit::io::read_at(l.as_ref(), d + off, len as usize).unwrap_or_default()
                    })
                    .collect();
                for j in 0..n {
                    let s = s0 + j;
                    let at = j as usize * SECTOR..(j as usize + 1) * SECTOR;
                    let clean = bufs.iter().all(|b| {
                        b.get(at.clone())
                            .is_some_and(|x| super::model::decode(s, x).is_some())
                    });
                    if clean && self.model.crash_marked(s) {
                        self.model.set_unsummed(s, 1, Unsummed::Summed);
                    }
                }
            }
            off += len;
        }
    }

    /// A scrub's repair ran to its end with no flip rule armed: once a FLUSH makes its
    /// rewrites durable, every block some leg held unflipped is unflipped on every leg
    /// serving, and a check counts only the blocks every leg may hold flipped.
    fn after_scrub(&mut self) {
        if !self.flush() {
            return;
        }
        let serving = self.serving();
        let mut lost = 0u64;
        for b in 0..self.blocks() {
            if serving.iter().any(|&k| !self.is_bad(k, b)) {
                for &k in &serving {
                    if let Some(x) = self.bad.get_mut(k).and_then(|v| v.get_mut(b)) {
                        *x = false;
                    }
                }
            } else {
                lost += 1;
            }
        }
        for &k in &serving {
            if let Some(v) = self.read_flipped.get_mut(k) {
                v.fill(false);
            }
        }
        let Some((p, judged)) = self.run_check(SyncAction::Check) else {
            return;
        };
        if !judged {
            return;
        }
        self.stats.scrubs += 1;
        let most = lost * (BLOCK / SECTOR as u64);
        if p.mismatch_cnt > most {
            let diffs = self.leg_differences(4);
            panic!(
                "the check after a scrub (a repair with no flip rule armed, then a FLUSH) \
                 found {} mismatched sectors, more than the {most} of the {lost} blocks \
                 every leg may hold flipped (sectors that differ now, with the write each \
                 leg holds: {diffs:?})",
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

    /// Makes a degraded array whole: out with a failed leg, in with a leg where one is
    /// missing, then (or, half the time, a few operations later, reads meeting a recovering
    /// leg meanwhile) a sync, which checks the whole array.
    fn heal(&mut self) {
        self.say("heal".into());
        if self.r().failure().is_some() {
            return self.crash();
        }
        if self.slot_where(|s| s.faulty).is_some() {
            self.remove_leg();
        }
        let add = self.members().len() < self.shape.legs;
        if add {
            self.add_leg();
        }
        if !add || self.rng.chance(500) {
            self.sync();
        }
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
        let serving = self.serving();
        for &(off, len, w, fua) in &ranges {
            let mut bio = Bio::with_buf(Op::Write, off >> SECTOR_SHIFT, self.stamped(off, len, w));
            if fua {
                bio.flags = BioFlags::FUA;
            }
            self.owe(off, len);
            self.dev().submit(bio, &end);
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
            self.record("batch write", Op::Write, off, len, w, fua, res, &serving);
        }
    }

    /// What a power cut lets through of each leg's unflushed writes: for a quarter of the
    /// cuts nothing, else a seeded part, whole or torn in 4 KiB units, drawn per leg, so the
    /// legs disagree afterwards where an unclean stop may leave them so.
    fn partials(&mut self) -> Vec<Partial> {
        let keep = [0, 200, 500, 800][self.rng.below(4) as usize];
        (0..self.legs.len())
            .map(|_| Partial {
                seed: self.rng.next(),
                keep,
                tear: if keep == 0 { 0 } else { 300 },
                unit: 4096,
            })
            .collect()
    }

    /// Where the crash rule may re-sum what a leg holds (integrity seeds), taken just before
    /// a power cut: the chunks dirty now (bits only clear once the sums of their writes are
    /// on the legs), all of the array without a bitmap.
    fn note_cut(&mut self) {
        if !self.shape.integrity {
            return;
        }
        let r = self.r();
        let degraded = r.is_degraded();
        let dirty = r.bitmap().map(|bm| {
            let c = bm.chunk_size();
            bm.dirty_chunks()
                .iter()
                .map(|set| (set.first * c, set.end * c))
                .collect()
        });
        self.cut_degraded = degraded;
        self.cut_dirty = dirty;
    }

    /// After a power cut: the blocks of the crash rule's reach lose their sums' protection
    /// until written (what a leg held flipped there may have been re-summed).
    fn apply_cut(&mut self) {
        if !self.shape.integrity {
            return;
        }
        let why = if self.cut_degraded {
            Unsummed::CrashDegraded
        } else {
            Unsummed::Crash
        };
        let cap = self.model.sectors() * SECTOR as u64;
        let ranges = self.cut_dirty.take().unwrap_or_else(|| vec![(0, cap)]);
        for (a, b) in ranges {
            let (a, b) = (a.min(cap), b.min(cap));
            let (s, n) = Self::sectors(a, b - a);
            self.model.set_unsummed(s, n, why);
            self.unsettled.push((a, b));
        }
    }

    /// Every leg's power goes at once; each keeps its seeded part of its volatile cache.
    fn crash_legs(&mut self) {
        self.note_cut();
        let parts = self.partials();
        for (l, p) in self.legs.iter().zip(parts) {
            l.h.release();
            if let Ok(rep) = l.h.crash_partial(p) {
                self.stats.writes_kept += rep.writes_kept;
                self.stats.writes_torn += rep.writes_torn;
            }
        }
    }

    /// Power cut: every leg loses what it had not made durable; the array stops uncleanly
    /// and is assembled again from the legs that were in it, in a seeded order.
    fn crash(&mut self) {
        // A third of the cuts come a moment after the last operation, as on a machine that
        // loses power while idle: raid1d's tick passes first (lazy bit clearing, superblock
        // writes) while writes may still be behind on a slow link.
        if self.shape.slow_link_ms > 0 && self.rng.chance(500) {
            // Half the cuts of a slow link's seed come while a write is behind on it, after
            // raid1d's lazy clearing had time to run (two ticks): its bit must still be set.
            let (off, len) = self.range(256 << 10);
            self.write_at(off, len);
            self.say("idle 50 ms, a write behind".into());
            std::thread::sleep(Duration::from_millis(50));
        } else if self.rng.chance(300) {
            let ms = 25 + self.rng.below(50);
            self.say(format!("idle {ms} ms"));
            std::thread::sleep(Duration::from_millis(ms));
        }
        self.say("crash".into());
        self.crash_legs();
        self.reassemble();
    }

    fn reassemble(&mut self) {
        let mut legs: Vec<usize> = self.members().into_iter().map(|(_, k)| k).collect();
        // The tracking goes with the process: nothing of it is written at a crash (its sidecar
        // keeps what it wrote, as a file does when the process is killed).
        if let Some(c) = self.cbt.as_mut() {
            c.tracked = None;
        }
        let (h, u, rs) = self.integrity_counts();
        self.counts_before = (h, u, rs);
        let r = self.r.take().expect("an array");
        Arc::try_unwrap(r)
            .unwrap_or_else(|_| panic!("the array is still shared at a crash"))
            .crash_for_test();
        for k in 0..self.legs.len() {
            self.clear_leg(k);
            self.legs[k].h.restart();
        }
        self.model.crashed();
        self.apply_cut();
        self.stats.crashes += 1;
        self.add_unrecorded_departures(&mut legs);
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
        self.r = Some(Arc::new(r));
        self.freeze();
        self.slow_links();
        self.open_bitmaps();
        self.pin_source();
        let all = self.rng.chance(100);
        self.verify(all);
    }

    /// Adds to `legs` (the members before the cut) every pool leg the newest superblock among
    /// them still counts in sync: a leg whose failure or removal never reached a superblock
    /// (its superblock write failed and the array failed with it, or the cut came first) is
    /// still part of the array on disk, and an operator assembles with every leg the
    /// superblocks name, as `mdadm --assemble --scan` finds them. Leaving it out is a fork
    /// that assembly rightly refuses without `allow_degraded`.
    fn add_unrecorded_departures(&mut self, legs: &mut Vec<usize>) {
        let newest = legs
            .iter()
            .filter_map(|&k| Raid1::read_superblock(self.legs[k].dev.as_ref()).ok())
            .max_by_key(|sb| sb.events);
        let Some(newest) = newest else { return };
        for k in 0..self.legs.len() {
            if legs.contains(&k) {
                continue;
            }
            let Ok(sb) = Raid1::read_superblock(self.legs[k].dev.as_ref()) else {
                continue;
            };
            let counted = newest
                .legs
                .iter()
                .any(|l| l.uuid == sb.leg_uuid && l.in_sync && !l.faulty);
            if sb.array_uuid == newest.array_uuid && counted {
                self.say(format!(
                    "leg {k} left unrecorded: the superblocks still count it in sync"
                ));
                legs.push(k);
            }
        }
    }

    /// A power cut while a resync, recovery or check runs at a slow speed limit beside a few
    /// operations.
    fn crash_mid_sync(&mut self) {
        if self.r().failure().is_some() {
            return self.crash();
        }
        let max = [2_000, 8_000, 32_000][self.rng.below(3) as usize];
        let ops = self.rng.below(4);
        let wait_ms = 1 + self.rng.below(20);
        let check = self.rng.chance(500);
        self.say(format!(
            "crash mid-sync: limit {max} KiB/s, {ops} operations, {wait_ms} ms"
        ));
        let r = self.r();
        r.set_speed_limits(1000.min(max), max);
        if !self.shape.concurrent {
            let _ = r.set_sync_action(SyncAction::Idle);
        }
        if check && !r.is_degraded() && r.failure().is_none() {
            // Nothing (or a resync) to do: a check then, where one may start.
            let _ = r.set_sync_action(SyncAction::Check);
        }
        for _ in 0..ops {
            if self.rng.chance(600) {
                self.write();
            } else {
                self.read();
            }
        }
        std::thread::sleep(Duration::from_millis(wait_ms));
        let mut p = self.r().sync_progress();
        if p.action == SyncAction::Recover && p.done_bytes > 0 && self.rng.chance(500) {
            // The superblocks record how far the recovery got (as a periodic update would),
            // then writes land in the part it recovered: after the cut, the resync must
            // write them to the recovering leg too, as the recovery will not copy them again.
            let res = self.r().sync_superblocks();
            p = self.r().sync_progress();
            self.say(format!(
                "superblocks mid-recovery at {}: {res:?}",
                p.done_bytes
            ));
            for _ in 0..1 + self.rng.below(3) {
                self.write_below(p.done_bytes);
            }
        }
        let running = matches!(
            p.action,
            SyncAction::Resync | SyncAction::Recover | SyncAction::Check | SyncAction::Repair
        ) && p.done_bytes < p.total_bytes;
        self.say(format!(
            "power cut during {} at {}/{}",
            p.action, p.done_bytes, p.total_bytes
        ));
        self.stats.crashes_mid_sync += u64::from(running);
        self.crash();
    }

    /// A power cut between two legs' superblock writes: one leg's superblock write is held
    /// while a state change writes them all (a plain superblock update, a leg failed, a leg
    /// added, a recovery ending), and the crash comes then.
    fn crash_during_superblock_write(&mut self) {
        let m = self.members();
        if m.len() < 2 || self.r().failure().is_some() {
            return self.crash();
        }
        let (slot, k) = m[self.rng.below(m.len() as u64) as usize];
        let other = m
            .iter()
            .map(|&(i, _)| i)
            .filter(|&i| i != slot)
            .nth(self.rng.below(m.len() as u64 - 1) as usize);
        let change = self.rng.below(4);
        let new = (change == 2 && self.legs.len() < 8).then(|| self.new_leg());
        let parts = self.partials();
        let what = match (change, other, &new) {
            (1, Some(i), _) => format!("fail slot {i}"),
            (2, _, Some(_)) => "add a leg".to_string(),
            (3, _, _) => "run the sync to its end".to_string(),
            _ => "superblock update".to_string(),
        };
        self.say(format!(
            "crash during a superblock write ({what}), held on slot {slot} (leg {k})"
        ));
        self.stats.sb_cuts += 1;
        self.note_cut();
        let h = self.legs[k].h.clone();
        h.add(
            Rule::stall(OpSet::WRITE)
                .in_range(SB_OFFSET, SB_SIZE as u64)
                .nth(1),
        );
        let r = self.r.as_ref().expect("an array");
        r.set_speed_limits(1000, FAST);
        let concurrent = self.shape.concurrent;
        let held = std::thread::scope(|s| {
            let t = s.spawn(|| match (change, other, new) {
                (1, Some(i), _) => drop(r.fail_leg(i)),
                (2, _, Some(dev)) => drop(r.add_leg(dev)),
                (3, _, _) => {
                    if !concurrent {
                        let _ = r.set_sync_action(SyncAction::Idle);
                    }
                    let _ = r.wait_sync_idle(Duration::from_secs(5));
                }
                _ => drop(r.sync_superblocks()),
            });
            let deadline = std::time::Instant::now() + Duration::from_secs(5);
            while h.stalled() == 0 && !t.is_finished() && std::time::Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(1));
            }
            let held = h.stalled() > 0;
            for (l, p) in self.legs.iter().zip(parts) {
                let _ = l.h.crash_partial(p);
            }
            h.release();
            let _ = t.join();
            held
        });
        self.stats.sb_cuts_held += u64::from(held);
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
