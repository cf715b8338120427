//! A seeded simulator of the mirror across hosts: a [`raid1::Raid1`] over a local leg and a
//! remote one (an `nbd:` [`RemoteDevice`] dialling, through a [`Link`] the test controls, an
//! in-process blkq server on "host b"), driven through the failures a network and a far host
//! produce while staying within what NBD allows a server to do.
//!
//! **Host b** exports a `mem:` leg under the fault device with its volatile write cache on,
//! behind a hold hook. The schedule, one seed deciding everything, mixes:
//! - writes (some FUA), reads and FLUSHes on the array, most of them on a small hot region so
//!   that they overlap;
//! - **late writes**: the next one to three writes host b receives are held before they
//!   execute, in a seeded order: for 1.2 to 4 times the client's timeout (a write runs after
//!   the client gave up on its connection), or a third of the time for 0.2 to 0.9 times it
//!   (replies and execution out of order on a live connection);
//! - **partitions** of the link, shorter than the timeout, longer, or longer than the timeout
//!   and the reconnect deadline together (the leg fails and the array goes on alone); nothing
//!   sent is lost, it crosses when the link heals;
//! - **host b going down**: every connection ends, the held writes never run, the leg's
//!   volatile cache is lost, and its server starts again;
//! - **settling**: a FLUSH, then a wait until the remote leg is back in the array, in sync,
//!   with nothing held, nothing behind and no sync running; then the two legs' data areas are
//!   compared sector by sector.
//!
//! The shape: the remote leg in slot 0 or 1 (so reads go to it or not), write-behind to it as
//! a write-mostly leg for about a third of the seeds, bitmap chunk 64K or 256K, timeout 100 to
//! 300 ms and reconnect deadline 300 to 1,000 ms (set on the spec directly: the URI takes
//! whole seconds), `readd=auto`.
//!
//! **The oracle.** The local leg never fails, so the array never may: every write, read and
//! FLUSH succeeds. The test thread issues one request at a time, so every sector has exactly
//! one right value, the last write's: a read returns it, always. And once settled, the legs
//! hold the same bytes everywhere: a leg that silently holds an older write than the array
//! acknowledged (a re-sent write overtaken by its original, a late copy landing after a
//! newer write, a recovery that copied while an old copy was still on its way) fails the
//! seed, with the sectors, the writes each leg holds and the bitmap's bit.
//!
//! `cargo test --release -p nbd --test sim_remote` runs the CI seeds; `SIM_SEEDS=N
//! SIM_SEED_BASE=S SIM_OPS=K` runs others, and prints the totals (`-- --nocapture`). A
//! failure prints the seed, the shape and the schedule; `SIM_SEEDS=1 SIM_SEED_BASE=<seed>`
//! replays the schedule (the timing is the machine's: a failure that depends on it may need
//! a few replays).
// A plain threaded test, never a loom model: it may use std::sync.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]
#![cfg(not(blkq_loom))]

mod common;

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use blk::{Bio, BioFlags, Buffer, Device, EndIo, Op};
use blk_drivers::fault::{FaultConfig, FaultDevice, FaultHandle};
use nbd::remote::{RemoteAddr, RemoteDevice, RemoteSpec};
use nbd::server::Server;
use raid1::{Raid1, Raid1Config, SyncAction};
use testkit::io::{flush, read_at, submit_wait};
use testkit::{Forward, Hook};

use common::link::Link;
use common::served::{device, log, serve};
use common::stamp::{decode_sector, stamp_sector, SECTOR};
use testkit::rng::Rng;

/// Seeds CI runs (`SIM_SEEDS`), from `SIM_SEED_BASE`, `SIM_OPS` operations each.
const CI_SEEDS: u64 = 4;
const OPS: u64 = 120;
const LEG_SPEC: &str = "mem:8M";
/// Sectors of the hot region most requests go to.
const HOT: u64 = 256;
/// How long a settle waits for the remote leg to be back and in sync.
const SETTLE_LIMIT: Duration = Duration::from_secs(20);

type Res<T> = Result<T, String>;

// ---------------------------------------------------------------------------------------
// Host b's hold hook: writes that execute late.

struct Held {
    at: Instant,
    bio: Bio,
    end: Arc<dyn EndIo>,
}

#[derive(Default)]
struct HoldState {
    /// How long each of the next writes is held (front first), and whether only a write to
    /// the array's data (not its superblock or bitmap) is.
    arm: VecDeque<(Duration, bool)>,
    held: Vec<Held>,
}

/// Holds the writes it is armed for, and executes them when their time comes, from its own
/// thread (so they run whatever the client does meanwhile).
struct HoldShared {
    inner: Arc<dyn Device>,
    st: Mutex<HoldState>,
    stop: AtomicBool,
    /// The first sector of the array's data on the leg.
    data_from: AtomicU64,
    /// Writes held, and held writes executed.
    held: AtomicU64,
    released: AtomicU64,
}

#[derive(Clone)]
struct HoldHook(Arc<HoldShared>);

impl Hook for HoldHook {
    fn submit(&self, inner: &dyn Device, bio: Bio, end: &Arc<dyn EndIo>) {
        if matches!(bio.op, Op::Write | Op::WriteZeroes | Op::Discard) {
            let mut st = self.0.st.lock().unwrap();
            let data_from = self.0.data_from.load(Ordering::SeqCst);
            let takes = |&(_, data_only): &(Duration, bool)| !data_only || bio.sector >= data_from;
            if st.arm.front().is_some_and(takes) {
                let (d, _) = st.arm.pop_front().unwrap_or_default();
                self.0.held.fetch_add(1, Ordering::SeqCst);
                st.held.push(Held {
                    at: Instant::now() + d,
                    bio,
                    end: end.clone(),
                });
                return;
            }
        }
        inner.submit(bio, end)
    }
}

impl HoldShared {
    fn new(inner: Arc<dyn Device>) -> Arc<Self> {
        let sh = Arc::new(HoldShared {
            inner,
            st: Mutex::new(HoldState::default()),
            stop: AtomicBool::new(false),
            data_from: AtomicU64::new(0),
            held: AtomicU64::new(0),
            released: AtomicU64::new(0),
        });
        let s2 = sh.clone();
        std::thread::spawn(move || {
            while !s2.stop.load(Ordering::SeqCst) {
                let due: Vec<Held> = {
                    let mut st = s2.st.lock().unwrap();
                    let now = Instant::now();
                    let mut due = Vec::new();
                    let mut i = 0;
                    while i < st.held.len() {
                        if st.held[i].at <= now {
                            due.push(st.held.swap_remove(i));
                        } else {
                            i += 1;
                        }
                    }
                    due
                };
                for h in due {
                    s2.released.fetch_add(1, Ordering::SeqCst);
                    s2.inner.submit(h.bio, &h.end);
                }
                std::thread::sleep(Duration::from_millis(2));
            }
        });
        sh
    }

    fn arm(&self, holds: &[(Duration, bool)]) {
        self.st.lock().unwrap().arm.extend(holds.iter().copied());
    }

    /// Host b holds no more writes from now on (the ones held still run when due); returns
    /// how many holds were armed and not taken.
    fn disarm(&self) -> usize {
        let mut st = self.st.lock().unwrap();
        let n = st.arm.len();
        st.arm.clear();
        n
    }

    /// Writes held and not executed yet.
    fn pending(&self) -> usize {
        self.st.lock().unwrap().held.len()
    }

    /// The host went down: held writes never run (they fail, for the server's sake), and
    /// nothing is armed any more.
    fn drop_all(&self) -> usize {
        let (held, n) = {
            let mut st = self.st.lock().unwrap();
            st.arm.clear();
            let h = std::mem::take(&mut st.held);
            let n = h.len();
            (h, n)
        };
        for h in held {
            h.end.end_io(
                h.bio,
                Err(blk::Error::Io(std::io::Error::from_raw_os_error(5))),
            );
        }
        n
    }
}

// ---------------------------------------------------------------------------------------
// The world.

#[derive(Debug, Clone)]
struct Shape {
    remote_slot: usize,
    local_slot: usize,
    write_behind: u32,
    chunk: u64,
    timeout: Duration,
    deadline: Duration,
}

#[derive(Default, Clone, Copy)]
struct Stats {
    ops: u64,
    writes: u64,
    reads: u64,
    flushes: u64,
    held: u64,
    released_late: u64,
    partitions: u64,
    long_partitions: u64,
    host_downs: u64,
    failovers: u64,
    refusals: u64,
    front_restarts: u64,
    settles: u64,
    leg_failures: u64,
    reconnects: u64,
}

impl std::ops::AddAssign for Stats {
    fn add_assign(&mut self, o: Self) {
        self.ops += o.ops;
        self.writes += o.writes;
        self.reads += o.reads;
        self.flushes += o.flushes;
        self.held += o.held;
        self.released_late += o.released_late;
        self.partitions += o.partitions;
        self.long_partitions += o.long_partitions;
        self.host_downs += o.host_downs;
        self.failovers += o.failovers;
        self.refusals += o.refusals;
        self.front_restarts += o.front_restarts;
        self.settles += o.settles;
        self.leg_failures += o.leg_failures;
        self.reconnects += o.reconnects;
    }
}

struct World {
    rng: Rng,
    shape: Shape,
    log: Vec<String>,
    stats: Stats,
    _dir: tempfile::TempDir,
    back: PathBuf,
    local: Arc<dyn Device>,
    rdev: Arc<dyn Device>,
    rfault: FaultHandle,
    hold: Arc<HoldShared>,
    export: Arc<dyn Device>,
    server: Option<Server>,
    link: Link,
    remote: Arc<RemoteDevice>,
    spec: RemoteSpec,
    array: Option<Arc<Raid1>>,
    /// The array's configuration (for a restart of the front).
    cfg: Raid1Config,
    /// Per sector of the array, the id of the write it must hold (0: zeros).
    want: Vec<u64>,
    next_id: u64,
    remote_was_faulty: bool,
}

impl World {
    fn new(seed: u64) -> Self {
        let mut rng = Rng(seed);
        let remote_slot = rng.below(2) as usize;
        let shape = Shape {
            remote_slot,
            local_slot: 1 - remote_slot,
            write_behind: if rng.chance(1, 3) {
                1 + rng.below(8) as u32
            } else {
                0
            },
            chunk: if rng.chance(1, 2) {
                64 << 10
            } else {
                256 << 10
            },
            timeout: Duration::from_millis(100 + rng.below(201)),
            deadline: Duration::from_millis(300 + rng.below(701)),
        };
        let dir = tempfile::tempdir().unwrap();
        let back = dir.path().join("b.sock");
        let local: Arc<dyn Device> = Arc::new(FaultDevice::new(
            device(LEG_SPEC),
            FaultConfig {
                seed,
                volatile_cache: true,
                ..FaultConfig::default()
            },
        ));
        let rf = FaultDevice::new(
            device(LEG_SPEC),
            FaultConfig {
                seed: seed ^ 1,
                volatile_cache: true,
                ..FaultConfig::default()
            },
        );
        let rfault = rf.handle();
        let rdev: Arc<dyn Device> = Arc::new(rf);
        let hold = HoldShared::new(rdev.clone());
        let export: Arc<dyn Device> =
            Arc::new(Forward::with_hook(rdev.clone(), HoldHook(hold.clone())));
        let server = serve(&back, &export);
        let link = Link::start(&dir.path().join("front.sock"), &back);
        // A TCP link would be given up by the client's kernel after ten timeouts of unacked
        // data (`TCP_USER_TIMEOUT`, as blkq sets it): what it held then never crosses.
        link.set_user_timeout(shape.timeout * 10);
        let spec = RemoteSpec {
            addr: RemoteAddr::Unix(link.front().to_path_buf()),
            export: String::new(),
            timeout: shape.timeout,
            depth: 16,
            reconnect_deadline: shape.deadline,
            tls: None,
            conns: 1,
            send: Default::default(),
        };
        // The first dial, retried as an operator would: a busy machine can take longer than
        // the short timeouts here for a whole handshake (each attempt has one deadline).
        let t0 = Instant::now();
        let remote = loop {
            match RemoteDevice::connect(spec.clone()) {
                Ok(d) => break Arc::new(d),
                Err(e) if t0.elapsed() > SETTLE_LIMIT => panic!("dialling host b: {e}"),
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        };
        let mut cfg = Raid1Config {
            bitmap_chunk: shape.chunk,
            bitmap_quiet: Duration::from_millis(20),
            tick: Duration::from_millis(10),
            readd_interval: Some(Duration::from_millis(100)),
            write_behind: shape.write_behind,
            ..Raid1Config::default()
        };
        cfg.allow_degraded = true;
        let remote_dyn: Arc<dyn Device> = remote.clone();
        let legs = if shape.remote_slot == 0 {
            vec![remote_dyn, local.clone()]
        } else {
            vec![local.clone(), remote_dyn]
        };
        let r = Raid1::create(legs, cfg.clone()).unwrap();
        hold.data_from
            .store(r.data_offset() / SECTOR as u64, Ordering::SeqCst);
        if shape.write_behind > 0 {
            r.set_write_mostly(shape.remote_slot, true).unwrap();
        }
        let sectors = r.limits().capacity / SECTOR as u64;
        World {
            rng,
            shape,
            log: Vec::new(),
            stats: Stats::default(),
            _dir: dir,
            back,
            local,
            rdev,
            rfault,
            hold,
            export,
            server: Some(server),
            link,
            remote,
            spec,
            array: Some(Arc::new(r)),
            cfg,
            want: vec![0; sectors as usize],
            next_id: 1,
            remote_was_faulty: false,
        }
    }

    fn r(&self) -> &Raid1 {
        self.array.as_ref().unwrap()
    }

    fn say(&mut self, s: String) {
        self.log.push(format!("{:>4} {s}", self.stats.ops));
    }

    /// A seeded range: mostly in the hot region, up to 64 sectors.
    fn range(&mut self) -> (u64, u64) {
        let total = self.want.len() as u64;
        let n = 1 + self.rng.below(64);
        let first = if self.rng.chance(3, 4) {
            self.rng.below(HOT)
        } else {
            self.rng.below(total)
        };
        let first = first.min(total - n);
        (first, n)
    }

    fn describe(&self) -> String {
        let r = self.r();
        let legs: Vec<String> = (0..r.slots())
            .map(|i| match r.leg_status(i) {
                Some(s) if s.present => {
                    let who = if i != self.shape.local_slot {
                        "remote"
                    } else {
                        "local"
                    };
                    let st = common::mirror::leg_state(&s);
                    format!("{who}:{st}")
                }
                _ => "-".into(),
            })
            .collect();
        let refused = r
            .readd_status(self.shape.remote_slot)
            .and_then(|s| s.refused.or(s.last_error))
            .map(|why| format!(" (remote leg: {why})"))
            .unwrap_or_default();
        format!(
            "[{}] connected={} held={} behind={}{refused}",
            legs.join(" "),
            self.remote.is_connected(),
            self.hold.pending(),
            r.write_behind_outstanding()
        )
    }

    fn step(&mut self) -> Res<()> {
        self.stats.ops += 1;
        let p = self.rng.below(1000);
        match p {
            0..=519 => self.write()?,
            520..=769 => self.read()?,
            770..=849 => self.flush()?,
            850..=899 => self.arm_holds(),
            900..=924 => self.partition(),
            925..=939 => self.host_down()?,
            940..=947 => self.failover()?,
            _ => self.settle()?,
        }
        self.watch_leg();
        Ok(())
    }

    /// Counts the remote leg's failures as the array sees them.
    fn watch_leg(&mut self) {
        let faulty = self
            .r()
            .leg_status(self.shape.remote_slot)
            .is_none_or(|s| !s.present || s.faulty);
        if faulty && !self.remote_was_faulty {
            self.stats.leg_failures += 1;
            let d = self.describe();
            self.say(format!("the remote leg failed: {d}"));
        }
        self.remote_was_faulty = faulty;
    }

    fn write(&mut self) -> Res<()> {
        let (first, n) = self.range();
        self.write_at(first, n)
    }

    fn write_at(&mut self, first: u64, n: u64) -> Res<()> {
        let fua = self.rng.chance(1, 8);
        let id = self.next_id;
        self.next_id += 1;
        let mut b = Buffer::new((n as usize) * SECTOR);
        for (k, s) in b.as_mut_slice().chunks_exact_mut(SECTOR).enumerate() {
            stamp_sector(s, id, first + k as u64);
        }
        let mut bio = Bio::with_buf(Op::Write, first, b);
        if fua {
            bio.flags = BioFlags::FUA;
        }
        self.say(format!(
            "write w{id} sectors {first}+{n}{}",
            if fua { " FUA" } else { "" }
        ));
        let t = Instant::now();
        let (_, res) = submit_wait(self.r(), bio);
        self.stats.writes += 1;
        if let Err(e) = res {
            return Err(format!(
                "write w{id} failed: {e}; the local leg never fails"
            ));
        }
        if t.elapsed() > Duration::from_millis(50) {
            let d = self.describe();
            self.say(format!("  (took {:?}) {d}", t.elapsed()));
        }
        for s in first..first + n {
            self.want[s as usize] = id;
        }
        Ok(())
    }

    fn read(&mut self) -> Res<()> {
        let (first, n) = self.range();
        self.say(format!("read sectors {first}+{n}"));
        self.stats.reads += 1;
        let data = read_at(self.r(), first * SECTOR as u64, n as usize * SECTOR)
            .map_err(|e| format!("read of sectors {first}+{n} failed: {e}"))?;
        for (k, sec) in data.chunks_exact(SECTOR).enumerate() {
            let s = first + k as u64;
            let want = self.want[s as usize];
            match decode_sector(sec, s) {
                Ok(v) if v == want => {}
                got => {
                    return Err(format!(
                        "sector {s} reads {got:?}, not w{want} (the last acknowledged write); \
                         {}{}",
                        self.describe(),
                        self.explain(s)
                    ))
                }
            }
        }
        Ok(())
    }

    fn flush(&mut self) -> Res<()> {
        self.say("flush".into());
        self.stats.flushes += 1;
        flush(self.r()).map_err(|e| format!("flush failed: {e}; {}", self.describe()))
    }

    fn arm_holds(&mut self) {
        let k = 1 + self.rng.below(3);
        // Mostly past the timeout (the client gives the connection up while the write may
        // still run); a third of the time within it (replies and execution out of order on a
        // live connection: a write behind acknowledged early, then overtaken on host b by a
        // later write over the same bytes unless the mirror orders them).
        let holds: Vec<(Duration, bool)> = (0..k)
            .map(|_| {
                let f = if self.rng.chance(1, 3) {
                    0.2 + self.rng.below(70) as f64 / 100.0
                } else {
                    1.2 + self.rng.below(280) as f64 / 100.0
                };
                (self.shape.timeout.mul_f64(f), self.rng.chance(4, 5))
            })
            .collect();
        self.say(format!("host b holds its next writes for {holds:?}"));
        self.stats.held += k;
        self.hold.arm(&holds);
    }

    fn partition(&mut self) {
        let t = self.shape.timeout;
        let d = match self.rng.below(3) {
            0 => t / 2,
            1 => t * 2 + t / 2,
            _ => {
                self.stats.long_partitions += 1;
                t + self.shape.deadline + Duration::from_millis(200)
            }
        };
        self.stats.partitions += 1;
        self.say(format!("partition for {d:?}"));
        self.link.partition(d);
    }

    /// Host b goes down and comes back: its connections end, held writes never run, its
    /// volatile cache is lost, its server starts again.
    fn host_down(&mut self) -> Res<()> {
        self.stats.host_downs += 1;
        self.link.reset();
        let dropped = self.hold.drop_all();
        let report = self
            .rfault
            .crash()
            .map_err(|e| format!("crashing host b's leg: {e}"))?;
        if let Some(s) = self.server.take() {
            s.shutdown();
        }
        self.rfault.restart();
        self.server = Some(serve(&self.back, &self.export));
        self.say(format!(
            "host b went down ({dropped} held writes never ran, {} writes lost from its cache) \
             and is back",
            report.writes_lost
        ));
        Ok(())
    }

    /// A failover: host b loses host a, serves its leg alone (a degraded array of that one
    /// leg) and takes writes, then its leg server comes back. The front, still running, must
    /// refuse the leg at its reconnection (another history) and serve none of b's branch; the
    /// operator then removes it and adds it back discarding b's side, and the recovery makes
    /// the legs agree again.
    fn failover(&mut self) -> Res<()> {
        let before = self
            .r()
            .readd_status(self.shape.remote_slot)
            .and_then(|r| r.refused);
        self.link.reset();
        self.hold.drop_all();
        if let Some(s) = self.server.take() {
            s.shutdown();
        }
        let cfg = Raid1Config {
            allow_degraded: true,
            bitmap_chunk: self.shape.chunk,
            ..Raid1Config::default()
        };
        let b = match Raid1::assemble(vec![self.rdev.clone()], cfg) {
            Ok(b) => b,
            Err(e) => {
                // Host b's leg was not in sync (failed or recovering): b cannot take over.
                self.say(format!("failover refused by host b: {e}"));
                self.server = Some(serve(&self.back, &self.export));
                return Ok(());
            }
        };
        self.stats.failovers += 1;
        let n = 1 + self.rng.below(4);
        let mut ids = Vec::new();
        let mut b_writes = Vec::new();
        for _ in 0..n {
            let (first, len) = self.range();
            let id = self.next_id;
            self.next_id += 1;
            let mut buf = Buffer::new(len as usize * SECTOR);
            for (k, sec) in buf.as_mut_slice().chunks_exact_mut(SECTOR).enumerate() {
                stamp_sector(sec, id, first + k as u64);
            }
            let (_, res) = submit_wait(&b, Bio::with_buf(Op::Write, first, buf));
            res.map_err(|e| format!("host b alone: write w{id} failed: {e}"))?;
            ids.push(format!("w{id}@{first}+{len}"));
            b_writes.push((first, len, id));
        }
        flush(&b).map_err(|e| format!("host b alone: flush failed: {e}"))?;
        drop(b);
        self.server = Some(serve(&self.back, &self.export));
        self.say(format!(
            "failover: host b ran alone and wrote {}; its leg server is back",
            ids.join(" ")
        ));
        // The front must refuse the leg, by name, at its reconnection: a leg that ran alone
        // carries a generation the array's history does not hold, and taking it back (even to
        // copy the front's data over it) would discard writes host b acknowledged on its own.
        // A leg that failed and then came back present and not faulty was taken back.
        let slot = self.shape.remote_slot;
        let t0 = Instant::now();
        let mut failed = false;
        let why = loop {
            let refused = self.r().readd_status(slot).and_then(|r| r.refused);
            if let Some(why) = refused.filter(|w| Some(w) != before.as_ref()) {
                break why;
            }
            let st = self.r().leg_status(slot);
            let present = st.is_some_and(|s| s.present && !s.faulty);
            failed |= !present;
            if (failed && present) || t0.elapsed() > SETTLE_LIMIT {
                return Err(format!(
                    "the front took host b's leg back from a failover, or never refused it \
                     (now {}), refusal {:?}",
                    self.describe(),
                    self.r().readd_status(slot)
                ));
            }
            // Anything sent meanwhile is judged by the oracle like any request.
            self.read()?;
            std::thread::sleep(Duration::from_millis(5));
        };
        self.stats.refusals += 1;
        self.say(format!("the front refused the leg: {why}"));
        if self.rng.chance(1, 2) {
            return self.restart_front_after_split(&b_writes);
        }
        let r = self.array.clone().unwrap();
        r.remove_leg(slot)
            .map_err(|e| format!("removing the refused leg: {e}"))?;
        // The operator dials host b again.
        let remote = self.dial()?;
        let at = r
            .add_leg_discarding(remote.clone())
            .map_err(|e| format!("add --discard of host b's leg: {e}; {}", self.describe()))?;
        self.shape.remote_slot = at;
        self.remote = remote;
        self.say(format!("added back discarding host b's side, in slot {at}"));
        Ok(())
    }

    /// After a failover the front stops too, and its operator starts it on both legs: the
    /// assembly must refuse, naming both sides (each ran without the other; whichever holds
    /// more events, neither is the other's past). The operator then starts the front's side
    /// alone and adds host b's leg discarding its side: the front's data everywhere.
    ///
    /// One exception, by the rules: when the front never recorded the leg's departure (it
    /// left and came back before the front sent it anything, and the front stopped before
    /// the refusal's failure reached its superblock), host b's history descends from the
    /// front's on disk, and assembly takes it, host b's writes (`b_writes`) included. That
    /// loses nothing the front acknowledged: a write after the departure would have waited
    /// for it to be recorded. The oracle then holds host b's writes, and every read checks
    /// that the front lost none of its own.
    fn restart_front_after_split(&mut self, b_writes: &[(u64, u64, u64)]) -> Res<()> {
        self.stats.front_restarts += 1;
        let slot = self.shape.remote_slot;
        drop(self.array.take());
        let remote = self.dial()?;
        let remote_dyn: Arc<dyn Device> = remote.clone();
        let legs = if slot == 0 {
            vec![remote_dyn.clone(), self.local.clone()]
        } else {
            vec![self.local.clone(), remote_dyn.clone()]
        };
        // How the two sides' histories relate on disk (what assembly must go by).
        let kin = match (
            Raid1::read_superblock(&*self.local),
            Raid1::read_superblock(&*remote_dyn),
        ) {
            (Ok(a), Ok(b)) => Some(a.lineage.kinship(&b.lineage)),
            _ => None,
        };
        match Raid1::assemble(legs, self.cfg.clone()) {
            Ok(_) if kin != Some(raid1::Kinship::Descendant) => {
                return Err(format!(
                    "the front restarted on both legs after a failover and assembled them, \
                     with host b's history {kin:?} to the front's on disk: one side's writes \
                     were silently discarded"
                ))
            }
            Err(raid1::Raid1Error::Assembly(e @ raid1::AssemblyError::Diverged { .. })) => {
                self.say(format!("the front restarted on both legs: refused: {e}"));
            }
            Err(e) => {
                return Err(format!(
                    "the front restarted on both legs: refused, but not as a split: {e}"
                ))
            }
            Ok(r) => {
                for &(first, len, id) in b_writes {
                    for s in first..first + len {
                        self.want[s as usize] = id;
                    }
                }
                self.remote = remote;
                self.array = Some(Arc::new(r));
                self.say(
                    "the front restarted on both legs: host b's side descends from the front's \
                     on disk (its departure never recorded): assembled, host b's writes kept"
                        .into(),
                );
                return Ok(());
            }
        }
        let r = Raid1::assemble(vec![self.local.clone()], self.cfg.clone())
            .map_err(|e| format!("the front restarted alone: {e}"))?;
        let at = r
            .add_leg_discarding(remote_dyn)
            .map_err(|e| format!("add --discard of host b's leg after the restart: {e}"))?;
        self.shape.local_slot = 0;
        self.shape.remote_slot = at;
        self.remote = remote;
        self.array = Some(Arc::new(r));
        self.say(format!(
            "the front restarted alone and added host b's leg back discarding its side, in slot {at}"
        ));
        Ok(())
    }

    /// A new connection to host b (through a partition that may still be healing), retried
    /// as an operator would.
    fn dial(&self) -> Res<Arc<RemoteDevice>> {
        let t0 = Instant::now();
        loop {
            match RemoteDevice::connect(self.spec.clone()) {
                Ok(d) => return Ok(Arc::new(d)),
                Err(e) if t0.elapsed() > SETTLE_LIMIT => {
                    return Err(format!("reconnecting to host b: {e}"))
                }
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    }

    /// A FLUSH, then a wait for the remote leg to be back, in sync, with nothing held or
    /// behind and no sync running; then the legs must hold the same data.
    fn settle(&mut self) -> Res<()> {
        self.stats.settles += 1;
        self.say("settle".into());
        // A settle heals, as a link's cut ends: holds armed while the leg was failed would
        // otherwise be taken by its recovery's writes, one more timeout, failure and probe
        // (seconds each) per hold, past the limit (seed 23000162: three such, the mirror
        // converging, slowly, as it should).
        let dropped = self.hold.disarm();
        if dropped > 0 {
            self.say(format!(
                "host b holds no more writes ({dropped} armed holds dropped)"
            ));
        }
        self.flush()?;
        let t0 = Instant::now();
        loop {
            let r = self.r();
            let whole = [self.shape.local_slot, self.shape.remote_slot]
                .iter()
                .all(|&i| {
                    r.leg_status(i)
                        .is_some_and(|s| s.present && s.in_sync && !s.faulty)
                });
            if whole
                && self.hold.pending() == 0
                && r.write_behind_outstanding() == 0
                && r.sync_action() == SyncAction::Idle
                && self.remote.in_flight() == 0
                && !self.link.is_cut()
            {
                break;
            }
            if t0.elapsed() > SETTLE_LIMIT {
                return Err(format!(
                    "not settled after {SETTLE_LIMIT:?}: {}, sync {}, {} in flight on the \
                     remote device, link cut {}",
                    self.describe(),
                    r.sync_action(),
                    self.remote.in_flight(),
                    self.link.is_cut()
                ));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        // Once more, so that what a recovery copied is flushed too; then compare.
        self.flush()?;
        self.compare()
    }

    /// Both legs' data areas, sector by sector.
    fn compare(&mut self) -> Res<()> {
        let r = self.r();
        let base = r.data_offset();
        let total = self.want.len() as u64 * SECTOR as u64;
        let piece = 1u64 << 20;
        let mut bad = Vec::new();
        let mut off = 0;
        while off < total {
            let len = piece.min(total - off) as usize;
            let a = read_at(&*self.local, base + off, len).map_err(|e| e.to_string())?;
            let b = read_at(&*self.rdev, base + off, len).map_err(|e| e.to_string())?;
            for (k, (x, y)) in a
                .chunks_exact(SECTOR)
                .zip(b.chunks_exact(SECTOR))
                .enumerate()
            {
                if x != y {
                    let s = off / SECTOR as u64 + k as u64;
                    bad.push(s);
                }
            }
            off += len as u64;
        }
        if bad.is_empty() {
            return Ok(());
        }
        let s = bad[0];
        Err(format!(
            "the legs differ in {} sectors once settled (first {:?}); {}{}",
            bad.len(),
            &bad[..bad.len().min(8)],
            self.describe(),
            self.explain(s)
        ))
    }

    /// What each leg holds at `sector`, what the array must hold there, and the bitmap's bit.
    fn explain(&self, s: u64) -> String {
        let r = self.r();
        let at = r.data_offset() + s * SECTOR as u64;
        let show = |d: &dyn Device| match read_at(d, at, SECTOR) {
            Ok(b) => match decode_sector(&b, s) {
                Ok(0) => "zeros".to_string(),
                Ok(v) => format!("w{v}"),
                Err(e) => e,
            },
            Err(e) => format!("unreadable: {e}"),
        };
        let mut out = format!(
            "\n  sector {s}: the array must hold w{}; the local leg holds {}, host b's {}",
            self.want[s as usize],
            show(&*self.local),
            show(&*self.rdev)
        );
        if let Some(bm) = r.bitmap() {
            let chunk = s * SECTOR as u64 / bm.chunk_size();
            out.push_str(&format!(
                "\n  bitmap chunk {chunk} dirty: {}",
                bm.is_dirty(chunk)
            ));
        }
        out
    }

    fn finish(&mut self) {
        self.stats.released_late = self.hold.released.load(Ordering::SeqCst);
        self.stats.reconnects = self.remote.reconnects();
    }
}

impl Drop for World {
    fn drop(&mut self) {
        self.hold.stop.store(true, Ordering::SeqCst);
        self.hold.drop_all();
        self.array.take();
        if let Some(s) = self.server.take() {
            s.shutdown();
        }
    }
}

// ---------------------------------------------------------------------------------------
// The runner.

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.trim().parse().ok())
}

fn run_seed(seed: u64, ops: u64) -> Res<Stats> {
    // `RUST_LOG=nbd=info,raid1=info` shows what the array and the remote device said.
    log();
    let mut w = World::new(seed);
    let mut res = Ok(());
    for _ in 0..ops {
        res = w.step();
        if res.is_err() {
            break;
        }
    }
    if res.is_ok() {
        res = w.settle();
    }
    w.finish();
    match res {
        Ok(()) => Ok(w.stats),
        Err(e) => {
            let from = w.log.len().saturating_sub(300);
            let mut out = format!(
                "sim_remote: seed {seed} FAILED after {} operations; shape {:?}\n{e}\nschedule:\n",
                w.stats.ops, w.shape
            );
            for l in &w.log[from..] {
                out.push_str(&format!("  {l}\n"));
            }
            out.push_str(&format!(
                "replay: SIM_SEEDS=1 SIM_SEED_BASE={seed} cargo test --release -p nbd --test \
                 sim_remote -- --nocapture\n"
            ));
            // The array's stop may wait on what the failure left; don't hang on it.
            std::mem::forget(w);
            Err(out)
        }
    }
}

#[test]
fn the_mirror_across_hosts_loses_nothing() {
    let n = env_u64("SIM_SEEDS").unwrap_or(CI_SEEDS);
    let base = env_u64("SIM_SEED_BASE").unwrap_or(1);
    let ops = env_u64("SIM_OPS").unwrap_or(OPS);
    let keep_going = std::env::var_os("SIM_KEEP_GOING").is_some();
    let t0 = Instant::now();
    let mut total = Stats::default();
    let mut failed = Vec::new();
    for seed in base..base + n {
        match run_seed(seed, ops) {
            Ok(s) => total += s,
            Err(e) => {
                eprintln!("{e}");
                failed.push(seed);
                if !keep_going {
                    break;
                }
            }
        }
    }
    println!(
        "sim_remote: {n} seeds from {base}, {} operations ({} writes, {} reads, {} flushes; {} \
         writes held, {} ran late; {} partitions, {} past the deadline; {} host restarts; {} \
         failovers, {} refused at reconnection, {} fronts restarted on both legs; \
         {} settles; {} leg failures, {} reconnects) in {:.1} s; failed seeds {failed:?}",
        total.ops,
        total.writes,
        total.reads,
        total.flushes,
        total.held,
        total.released_late,
        total.partitions,
        total.long_partitions,
        total.host_downs,
        total.failovers,
        total.refusals,
        total.front_restarts,
        total.settles,
        total.leg_failures,
        total.reconnects,
        t0.elapsed().as_secs_f64()
    );
    if keep_going {
        // What scripts/mutants.sh reads.
        println!("sim_remote: caught {}/{n}", failed.len());
    }
    assert!(failed.is_empty(), "failed seeds: {failed:?}");
}
