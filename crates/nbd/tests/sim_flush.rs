//! A seeded simulator of the NBD server's durability rules: sticky write-back errors and
//! FLUSH across connections, over a single device or a mirror.
//!
//! **Two kinds of export**, picked by the seed (about half each; a hash of the seed decides,
//! so a fault-device seed draws its schedule exactly as before the mirror kind existed;
//! `SIM_KIND=fault` or `SIM_KIND=raid1` runs every seed as that kind):
//! - **fault**: a `mem:` device under the fault device with its volatile write cache on
//!   (`blk_drivers::fault`, "The crash model": a crash drops every write no FLUSH or FUA made
//!   durable);
//! - **raid1**: a [`raid1::Raid1`] over 2 or 3 such fault devices (`mem:8M` legs; a seeded
//!   bitmap chunk of 256K, 1M or none, barrier mode, slot depth and `sync_speed_max`; `tick`
//!   20 ms, `bitmap_quiet` 10 ms), so the array's own threads (raid1d's superblock writes and
//!   lazy bitmap clearing, the sync thread's resync and recovery) run beside the requests.
//!
//! Clients are the in-tree [`Client`] over a Unix socket. One `u64` seed decides
//! everything: how many connections (1 to 4) and in which transmission mode, the device's
//! largest I/O (so requests split into several bios or not), whether completions are delayed
//! onto the fault device's timer thread, and the schedule: writes, FUA writes, flushes, reads,
//! trims and write-zeroes of random sizes and offsets on random connections; failures injected
//! into the next I/O (the whole request or its Nth bio, `EIO` or `ENOSPC`; a device that
//! cannot zero fast refuses a `FAST_ZERO` write-zeroes with `ENOTSUP`); clients that send a
//! request, or part of a write's payload, and vanish without reading the reply; crashes of
//! the device, with a few requests sent while it is down, followed either by the device
//! coming back under the live server or by a power cycle (a new server on the same device);
//! and clean restarts of the server.
//!
//! For a **raid1** export the schedule differs in these steps:
//! - a failure is injected on one leg (a seeded pick among the present, non-faulty legs), as a
//!   fault-device rule armed for the one request and removed after its reply: the request's
//!   own kind of I/O or every kind, within the request's range on the leg or anywhere (the
//!   superblock, the bitmap, a resync's I/O), for the next 1 to 3 matching leg I/Os or with a
//!   probability of 5% to 50%, `EIO` or `ENOSPC`;
//! - leg management between requests, as an administrator does it: fail an in-sync or
//!   recovering leg ([`raid1::Raid1::fail_leg`], refused for the last in-sync one), remove a
//!   faulty (sometimes a recovering) leg, add a removed leg back (a re-add that recovers the
//!   bitmap's dirty chunks) or, now and then, a fresh one (a full recovery); so requests run
//!   while the array is degraded and while it recovers;
//! - a crash is always a power cycle: every leg's fault device crashes, the requests sent
//!   while down fail or not, the server stops, the array stops uncleanly
//!   ([`raid1::Raid1::crash_for_test`]), the legs restart and are assembled again in a seeded
//!   order ([`raid1::Raid1::assemble`], which resyncs), a new server starts, and every sector
//!   of the export is read back;
//! - a clean reassembly: a clean server stop, a clean stop of the array (its drop marks it
//!   clean) and an assembly of its legs in a seeded order under a new server; a clean
//!   restart of the server over a failed array ([`raid1::Raid1::failure`]: it stays failed
//!   until stopped) is one too.
//!
//! **Determinism.** Requests are issued by the one test thread, connection after connection,
//! each waiting for its reply before the next is sent (a vanished client's request is waited
//! for too: the next step starts only once the server has closed that connection, by which
//! time the request has run or been dropped). For a fault export nothing else submits I/O, so
//! the schedule is a pure function of the seed and replays bit for bit, and so do the fault
//! device's injected failures (rules added right before the request they are for, removed
//! right after). What timing may still change is left open by the protocol and accepted either
//! way by the oracle: whether a vanished client's request ran, and which of two errors a
//! request of several bios reports when one failed and another met the export's new failure.
//! For a raid1 export the schedule replays too, but the array's threads issue leg I/O of their
//! own on their own clocks (a resync's progress, a bitmap flush), so which leg I/O an injected
//! rule hits, and so which leg fails, may differ from run to run; the oracle judges only what
//! the export answered and what it holds, never the legs' counters.
//!
//! **The oracle.** Every sector of every write carries a stamp, (write id, sector number) and
//! a pattern derived from both, so a read tells exactly which write, if any, put each sector
//! there, and whether it belongs to another offset or is torn. Per sector the oracle keeps the
//! values a read may return now (`cur`), those a crash must leave at the least (`durable`: its
//! contents at the last FLUSH, or the last FUA write) and those written since (`pending`: a
//! crash may keep or drop them). A request whose outcome is unknown (it failed, or its client
//! vanished) adds its data as possible without removing the old. The rules checked:
//! - **(a)** a FLUSH acknowledged on one connection covers every write acknowledged on any
//!   connection before it was sent: after a crash every sector reads as its `durable` value or
//!   one written since ("durable or pending");
//! - **(b)** after a failed write-back (the device failed a write, write-zeroes or flush, a
//!   `FAST_ZERO` refusal aside) every later FLUSH and FUA request on every connection fails
//!   with `EIO` until the server restarts, and the server's [`Server::export_failed`] says so;
//!   before it, nothing fails that the device did not fail; a clean shutdown reports the
//!   export failed exactly when it is. For a raid1 export "the device failed" is judged from
//!   the array's answers (a leg's failure that another in-sync leg covered is no failure of
//!   the export): a write-back request answered with an error fails the export; a request
//!   may fail only while a rule is armed on a leg, while the legs are down, or once the array
//!   has failed ([`raid1::Raid1::failure`]); never while another present, in-sync,
//!   non-faulty leg than the one with the rule could serve it, and the array does not fail
//!   then either;
//! - **(c)** a read returns, per 512-byte sector, a value the oracle allows now: the last
//!   acknowledged data, or data written there whose outcome is unknown; never another
//!   offset's bytes, never a torn sector. A read narrows the allowed values to what it saw
//!   (so a sector does not change without a write), with two exceptions on a raid1 export:
//!   where a request that modified the sector failed (the legs may then disagree, and which
//!   leg a read goes to is the array's choice), until an acknowledged write covers it again;
//!   and where a crash left the legs free to disagree (a write neither durable nor lost for
//!   sure) while a leg that was in sync at the assembly has been lost before the resync
//!   ended (a double failure: the resync's source is gone, the other legs keep their own
//!   versions), a read may return another of the values that crash allowed, until the sync
//!   thread has run a pass to its end.
//!
//! A failure prints the seed, what went wrong and the schedule so far (on a raid1 export a
//! bad read also shows what every leg holds there, the bitmap bit and the superblocks), and
//! replays with `SIM_KIND=<kind> SIM_SEEDS=1 SIM_SEED_BASE=<seed> cargo test --release -p nbd
//! --test sim_flush` (a raid1 seed replays its schedule, not always its timing: run it a few
//! times). `SIM_SEEDS=N SIM_SEED_BASE=S` runs N seeds from S; by default a fixed set small
//! enough for a debug build runs (18 of its 40 seeds raid1). The totals (seeds, operations,
//! crashes, ...) are printed at the end (`-- --nocapture` to see them); `SIM_SCHEDULE=1`
//! prints every seed's schedule and outcomes too (two runs of a fault-kind seed print the
//! same). For long runs, `SIM_KEEP_GOING=1` prints each seed's outcome and each failure
//! (with the end of its schedule) and goes on, failing at the end; `SIM_STALL_SECS=N` makes
//! the watchdog give up on a hung seed after N seconds instead of 120.
//!
//! The mirror bugs the raid1 kind found live on as deterministic tests of the array alone in
//! `crates/raid1/tests/faults.rs` (`a_readded_legs_pass_does_not_resume_after_it_fails_and_returns`,
//! `failed_reads_holding_every_slot_do_not_hang_the_array`,
//! `a_read_during_the_resync_reads_what_the_resync_copies`).
// A plain threaded test, never a loom model: it may use std::sync.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]
#![cfg(not(blkq_loom))]

mod common;

use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use blk::Device;
use blk_drivers::fault::{FaultConfig, FaultCounters, FaultDevice, FaultHandle, OpSet, Rule};
use blk_drivers::spec::{DeviceSpec, QueueOverrides};
use nbd::client::{Client, ClientOptions, Endpoint, Reply};
use nbd::codec::transmission::Request;
use nbd::codec::{CmdFlags, Command, TransmissionMode};
use nbd::server::{Export, Server, ServerConfig};
use raid1::{BarrierMode, Raid1, Raid1Config, SyncAction};

use common::stamp::{decode_sector, stamp_sector};
use testkit::rng::Rng;

/// Seeds run by default (`SIM_SEEDS`), from `DEFAULT_SEED_BASE` (`SIM_SEED_BASE`).
const DEFAULT_SEEDS: u64 = 40;
const DEFAULT_SEED_BASE: u64 = 1;

const SECTOR: u64 = 512;
/// The fault kind's device.
const DEV_BYTES: u64 = 4 << 20;
const SECTORS: u64 = DEV_BYTES / SECTOR;
/// The raid1 kind's legs (the export is smaller by the superblock and bitmap area).
const LEG_SPEC: &str = "mem:8M";
/// At most this many legs in a raid1 seed's pool (fresh legs replace removed ones beyond).
const MAX_POOL: usize = 5;
/// A `sync_speed_max` (KiB/s) that never throttles.
const FAST: u64 = 100_000_000;
/// Salt of the hash of the seed that picks the export kind (not drawn from the schedule's
/// generator, so that a fault-kind seed's schedule is what it was before the raid1 kind).
const KIND_SALT: u64 = 0x7261_6964_315f_6b64; // "raid1_kd"
/// Sectors of the region most requests go to, so that they overlap.
const HOT: u64 = 512;

// NBD error numbers.
const NBD_EIO: u32 = 5;
const NBD_ENOSPC: u32 = 28;
const NBD_ENOTSUP: u32 = 95;

/// The watchdog ends the process (printing the seed and schedule) when a step takes longer
/// (`SIM_STALL_SECS` sets another limit).
const STALL_LIMIT: Duration = Duration::from_secs(120);

// ---------------------------------------------------------------------------------------
// The oracle.

/// A small set of sector values (0: zeros, else a write id).
#[derive(Clone, Default, PartialEq)]
struct Set(Vec<u64>);

impl Set {
    fn one(v: u64) -> Self {
        Set(vec![v])
    }
    fn add(&mut self, v: u64) {
        if !self.0.contains(&v) {
            self.0.push(v);
        }
    }
    fn union(&mut self, o: &Set) {
        for &v in &o.0 {
            self.add(v);
        }
    }
    fn has(&self, v: u64) -> bool {
        self.0.contains(&v)
    }
}

impl fmt::Debug for Set {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<String> = self
            .0
            .iter()
            .map(|&v| {
                if v == 0 {
                    "zeros".to_string()
                } else {
                    format!("w{v}")
                }
            })
            .collect();
        write!(f, "{{{}}}", names.join(", "))
    }
}

struct Oracle {
    /// What a read may return now.
    cur: Vec<Set>,
    /// What a crash must leave (or something from `pending`).
    durable: Vec<Set>,
    /// Written since `durable` was fixed: a crash may keep any of it.
    pending: Vec<Set>,
    /// Sectors where `pending` is not empty or `cur` differs from `durable`.
    dirty: Vec<u64>,
    is_dirty: Vec<bool>,
    /// Sectors a failed request modified on a raid1 export, until an acknowledged write
    /// covers them: the legs may disagree there, so a read does not narrow `cur`.
    unsettled: Vec<bool>,
    /// Raid1: per sector that a crash left with more than one allowed value, those values,
    /// until the resync after it has run to its end (`settle_crash`) or an acknowledged write
    /// covers the sector. The legs may hold different ones of them until the resync makes
    /// them agree; if a leg is lost meanwhile (a double failure), a read may go from one to
    /// another (`check_read`'s `disturbed`).
    crash_set: Vec<Option<Set>>,
    crash_marked: Vec<u64>,
    /// Track `crash_set` (a raid1 export).
    track_crashes: bool,
    /// Reads that went from one of a crash's values to another after a double failure.
    flips: u64,
    /// The export has failed (rule b).
    sticky: bool,
}

impl Oracle {
    fn new(sectors: u64, track_crashes: bool) -> Self {
        let n = sectors as usize;
        Oracle {
            cur: vec![Set::one(0); n],
            durable: vec![Set::one(0); n],
            pending: vec![Set::default(); n],
            dirty: Vec::new(),
            is_dirty: vec![false; n],
            unsettled: vec![false; n],
            crash_set: vec![None; n],
            crash_marked: Vec::new(),
            track_crashes,
            flips: 0,
            sticky: false,
        }
    }

    /// Whether a crash left sectors the resync has not settled yet.
    fn has_crash_marks(&self) -> bool {
        !self.crash_marked.is_empty()
    }

    /// The resync after the crashes has run to its end: the legs agree.
    fn settle_crash(&mut self) {
        for s in std::mem::take(&mut self.crash_marked) {
            self.crash_set[s as usize] = None;
        }
    }

    /// Whether `v`, not allowed now in sector `i`, is one a crash left there and a double
    /// failure may bring back.
    fn crash_allows(&mut self, i: usize, v: u64, disturbed: bool) -> bool {
        let ok = disturbed && self.crash_set[i].as_ref().is_some_and(|c| c.has(v));
        if ok {
            self.flips += 1;
        }
        ok
    }

    /// A failed request modified these sectors on a mirror: which value a read returns may
    /// depend on the leg it goes to.
    fn unsettle(&mut self, first: u64, n: u64) {
        for s in first..first + n {
            self.unsettled[s as usize] = true;
        }
    }

    fn touch(&mut self, s: u64) {
        if !self.is_dirty[s as usize] {
            self.is_dirty[s as usize] = true;
            self.dirty.push(s);
        }
    }

    /// An acknowledged write of `value` (a write id, or 0 for zeros).
    fn written(&mut self, first: u64, n: u64, value: u64, fua: bool) {
        for s in first..first + n {
            let i = s as usize;
            self.cur[i] = Set::one(value);
            self.unsettled[i] = false;
            self.crash_set[i] = None;
            if fua {
                self.durable[i] = Set::one(value);
                self.pending[i] = Set::default();
            } else {
                self.pending[i].add(value);
            }
            self.touch(s);
        }
    }

    /// A write of `value` whose outcome is unknown (it failed, or its client vanished).
    fn maybe_written(&mut self, first: u64, n: u64, value: u64) {
        for s in first..first + n {
            let i = s as usize;
            self.cur[i].add(value);
            self.pending[i].add(value);
            if let Some(c) = &mut self.crash_set[i] {
                c.add(value);
            }
            self.touch(s);
        }
    }

    /// An acknowledged FLUSH (or a clean final flush): everything readable now is durable.
    fn flushed(&mut self) {
        for s in std::mem::take(&mut self.dirty) {
            let i = s as usize;
            self.durable[i] = self.cur[i].clone();
            self.pending[i] = Set::default();
            self.is_dirty[i] = false;
        }
    }

    /// The device crashed: a read may return what was durable or anything written since.
    fn crashed(&mut self) {
        for &s in &self.dirty {
            let i = s as usize;
            let mut after = self.durable[i].clone();
            after.union(&self.pending[i]);
            if self.track_crashes && after.0.len() > 1 {
                match &mut self.crash_set[i] {
                    Some(c) => c.union(&after),
                    None => {
                        self.crash_set[i] = Some(after.clone());
                        self.crash_marked.push(s);
                    }
                }
            }
            self.cur[i] = after;
        }
    }

    /// Rule (c): `data`, read at sector `first`, holds values the oracle allows; a read
    /// narrows `cur` to what it saw. An error names the first sector that broke it.
    ///
    /// `disturbed` (raid1): a leg was lost since the assembly after a crash, before the resync
    /// ended, so a value that crash allowed may come back (`crash_set`).
    fn check_read(
        &mut self,
        first: u64,
        data: &[u8],
        disturbed: bool,
    ) -> Result<(), (u64, String)> {
        for (k, chunk) in data.chunks(SECTOR as usize).enumerate() {
            let s = first + k as u64;
            let i = s as usize;
            let v = decode_sector(chunk, s)
                .map_err(|e| (s, format!("rule (c): sector {s} holds {e}")))?;
            if !self.cur[i].has(v) && !self.crash_allows(i, v, disturbed) {
                return Err((
                    s,
                    format!(
                        "rule (c): sector {s} reads {:?}, allowed {:?} (durable {:?}, pending \
                         {:?}{})",
                        Set::one(v),
                        self.cur[i],
                        self.durable[i],
                        self.pending[i],
                        match &self.crash_set[i] {
                            Some(c) => format!(
                                "; a crash left {c:?} not yet resynced, a leg lost since: \
                                 {disturbed}"
                            ),
                            None => String::new(),
                        }
                    ),
                ));
            }
            if !self.unsettled[i] {
                self.cur[i] = Set::one(v);
            } else {
                self.cur[i].add(v);
            }
        }
        Ok(())
    }

    /// Rule (a), after a crash: the whole device, read back in `data`; then what it holds is
    /// what is durable.
    fn check_after_crash(&mut self, data: &[u8], disturbed: bool) -> Result<(), String> {
        for (k, chunk) in data.chunks(SECTOR as usize).enumerate() {
            let s = k as u64;
            let i = s as usize;
            let v = decode_sector(chunk, s)
                .map_err(|e| format!("after a crash, sector {s} holds {e}"))?;
            if !self.cur[i].has(v) && !self.crash_allows(i, v, disturbed) {
                return Err(format!(
                    "rule (a): after a crash sector {s} reads {:?}; the last FLUSH or FUA \
                     left {:?}, written since {:?}",
                    Set::one(v),
                    self.durable[i],
                    self.pending[i]
                ));
            }
            if self.unsettled[i] {
                self.cur[i].add(v);
                self.durable[i] = self.cur[i].clone();
            } else {
                self.cur[i] = Set::one(v);
                self.durable[i] = Set::one(v);
            }
            self.pending[i] = Set::default();
        }
        for s in std::mem::take(&mut self.dirty) {
            self.is_dirty[s as usize] = false;
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------
// Steps.

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Write { id: u64 },
    Read { df: bool },
    Flush,
    Trim,
    WriteZeroes { no_hole: bool, fast: bool },
}

/// One request: on connection `conn`, `sectors` sectors from `sector`.
#[derive(Clone, Copy, PartialEq, Eq)]
struct Io {
    conn: usize,
    kind: Kind,
    sector: u64,
    sectors: u64,
    fua: bool,
}

impl fmt::Debug for Io {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let fua = if self.fua { " FUA" } else { "" };
        let range = format!("{}+{}", self.sector, self.sectors);
        match self.kind {
            Kind::Write { id } => write!(f, "c{} WRITE{fua} w{id} sectors {range}", self.conn),
            Kind::Read { df } => {
                let df = if df { " DF" } else { "" };
                write!(f, "c{} READ{df} sectors {range}", self.conn)
            }
            Kind::Flush => write!(f, "c{} FLUSH", self.conn),
            Kind::Trim => write!(f, "c{} TRIM{fua} sectors {range}", self.conn),
            Kind::WriteZeroes { no_hole, fast } => {
                let nh = if no_hole { " NO_HOLE" } else { "" };
                let fz = if fast { " FAST_ZERO" } else { "" };
                write!(
                    f,
                    "c{} WRITE_ZEROES{fua}{nh}{fz} sectors {range}",
                    self.conn
                )
            }
        }
    }
}

impl Io {
    fn modifies(&self) -> bool {
        matches!(
            self.kind,
            Kind::Write { .. } | Kind::Trim | Kind::WriteZeroes { .. }
        )
    }

    /// Whether a failure of it at the device is a failed write-back (rule b).
    fn writes_back(&self) -> bool {
        matches!(
            self.kind,
            Kind::Write { .. } | Kind::WriteZeroes { .. } | Kind::Flush
        )
    }

    /// Whether it promises durability (a FLUSH, or FUA).
    fn durable(&self) -> bool {
        self.kind == Kind::Flush || (self.fua && self.modifies())
    }

    /// The fault device's op class of its bios.
    fn class(&self) -> usize {
        match self.kind {
            Kind::Read { .. } => 0,
            Kind::Write { .. } => 1,
            Kind::Flush => 2,
            Kind::Trim | Kind::WriteZeroes { .. } => 3,
        }
    }

    /// The value its sectors get (0 for zeros).
    fn value(&self) -> u64 {
        match self.kind {
            Kind::Write { id } => id,
            _ => 0,
        }
    }

    fn request(&self, mode: TransmissionMode) -> Request {
        let (off, len) = (self.sector * SECTOR, self.sectors * SECTOR);
        let mut flags = CmdFlags::empty();
        if self.fua {
            flags |= CmdFlags::FUA;
        }
        let cmd = match self.kind {
            Kind::Write { .. } => Command::Write,
            Kind::Read { df } => {
                if df && mode != TransmissionMode::Simple {
                    flags |= CmdFlags::DF;
                }
                Command::Read
            }
            Kind::Flush => return Request::new(Command::Flush, 0, 0, 0),
            Kind::Trim => Command::Trim,
            Kind::WriteZeroes { no_hole, fast } => {
                if no_hole {
                    flags |= CmdFlags::NO_HOLE;
                }
                if fast {
                    flags |= CmdFlags::FAST_ZERO;
                }
                Command::WriteZeroes
            }
        };
        Request::new(cmd, 0, off, len).with_flags(flags)
    }

    fn payload(&self) -> Vec<u8> {
        let Kind::Write { id } = self.kind else {
            return Vec::new();
        };
        let mut v = vec![0u8; (self.sectors * SECTOR) as usize];
        for (k, s) in v.chunks_exact_mut(SECTOR as usize).enumerate() {
            stamp_sector(s, id, self.sector + k as u64);
        }
        v
    }
}

/// A failure injected into the next request's bios.
#[derive(Debug, Clone, Copy)]
struct Inject {
    /// Which of its bios fails (1-based); 0: all of them.
    nth: u64,
    errno: i32,
}

/// A failure armed on one leg of a raid1 export for the time of one request.
#[derive(Debug, Clone, Copy)]
struct LegFault {
    /// Which leg: a pick among the present, non-faulty legs when the request runs.
    pick: u64,
    /// Every kind of leg I/O, or only the request's kind.
    all_ops: bool,
    /// Only leg I/O overlapping the request's range (else anywhere: superblock, bitmap, a
    /// resync's I/O too).
    in_range: bool,
    when: LegWhen,
    errno: i32,
}

#[derive(Debug, Clone, Copy)]
enum LegWhen {
    /// The next `k` matching leg I/Os.
    Next(u64),
    /// Each matching leg I/O with this probability, in percent.
    Percent(u64),
}

#[derive(Debug, Clone)]
enum Step {
    Io(Io, Option<Inject>),
    /// Raid1: a request with a failure armed on one leg.
    LegIo(Io, LegFault),
    /// Raid1 leg management (`pick` chooses): add back a leg that is out of the array (or a
    /// fresh one), else remove a faulty leg (or a recovering one), else fail a leg.
    Leg {
        pick: u64,
    },
    /// Raid1: a clean stop of the server and of the array, and the legs assembled again in a
    /// seeded order under a new server.
    Reassemble,
    /// The client sends the request (or, with `Some(n)`, a write's header and `n` bytes of
    /// its payload) and vanishes without reading; a new client takes its place.
    Vanish {
        io: Io,
        partial: Option<u64>,
    },
    /// A clean disconnect and a new client in `mode`.
    Reconnect {
        conn: usize,
        mode: usize,
    },
    /// The device crashes; `down` is sent while it is down; then it comes back under the
    /// live server, or the server restarts on it (`power_cycle`); the device is read back.
    Crash {
        down: Vec<Io>,
        power_cycle: bool,
    },
    /// A clean shutdown of the server and a new one on the same device.
    Restart,
}

const MODES: [&str; 3] = ["simple", "structured", "extended"];

fn options(mode: usize) -> ClientOptions {
    match mode {
        0 => ClientOptions {
            structured: false,
            base_allocation: false,
            ..ClientOptions::default()
        },
        1 => ClientOptions::default(),
        _ => ClientOptions {
            extended: true,
            ..ClientOptions::default()
        },
    }
}

/// The schedule's generator.
struct Gen {
    rng: Rng,
    conns: usize,
    next_id: u64,
    /// The export's size.
    sectors: u64,
    /// A raid1 export (its steps are drawn too).
    mirror: bool,
}

impl Gen {
    fn range(&mut self) -> (u64, u64) {
        let r = self.rng.below(100);
        let mut n = if r < 60 {
            1 + self.rng.below(8)
        } else if r < 85 {
            9 + self.rng.below(120)
        } else if r < 97 {
            129 + self.rng.below(384)
        } else {
            513 + self.rng.below(1536)
        };
        let mut s = if self.rng.chance(1, 2) {
            self.rng.below(HOT)
        } else {
            self.rng.below(self.sectors)
        };
        if self.rng.chance(1, 3) {
            // 4 KiB aligned.
            s &= !7;
            n = n.div_ceil(8) * 8;
        }
        n = n.min(self.sectors);
        s = s.min(self.sectors - n);
        (s, n)
    }

    fn io(&mut self) -> Io {
        let conn = self.rng.below(self.conns as u64) as usize;
        let r = self.rng.below(80);
        let (sector, sectors) = self.range();
        let fua = self.rng.chance(1, 5);
        let kind = if r < 32 {
            self.next_id += 1;
            Kind::Write { id: self.next_id }
        } else if r < 57 {
            Kind::Read {
                df: self.rng.chance(1, 3),
            }
        } else if r < 69 {
            Kind::Flush
        } else if r < 74 {
            Kind::Trim
        } else {
            Kind::WriteZeroes {
                no_hole: self.rng.chance(1, 2),
                fast: self.rng.chance(1, 3),
            }
        };
        let (sector, sectors, fua) = if kind == Kind::Flush {
            (0, 0, false)
        } else if matches!(kind, Kind::Read { .. }) {
            (sector, sectors, false)
        } else {
            (sector, sectors, fua)
        };
        Io {
            conn,
            kind,
            sector,
            sectors,
            fua,
        }
    }

    fn inject(&mut self, io: &Io) -> Inject {
        if let Kind::WriteZeroes { fast: true, .. } = io.kind {
            if self.rng.chance(1, 2) {
                // A device that cannot zero fast refuses every bio of it.
                return Inject {
                    nth: 0,
                    errno: libc::ENOTSUP,
                };
            }
        }
        let nth = if self.rng.chance(1, 2) {
            0
        } else {
            1 + self.rng.below(4)
        };
        let errno = if self.rng.chance(1, 5) {
            libc::ENOSPC
        } else {
            libc::EIO
        };
        Inject { nth, errno }
    }

    fn leg_fault(&mut self) -> LegFault {
        LegFault {
            pick: self.rng.next(),
            all_ops: self.rng.chance(1, 4),
            in_range: self.rng.chance(1, 2),
            when: if self.rng.chance(1, 2) {
                LegWhen::Next(1 + self.rng.below(3))
            } else {
                LegWhen::Percent(5 + self.rng.below(46))
            },
            errno: if self.rng.chance(1, 5) {
                libc::ENOSPC
            } else {
                libc::EIO
            },
        }
    }

    fn step(&mut self) -> Step {
        let r = self.rng.below(1000);
        if r < 20 {
            let mut io = self.io();
            let partial = match io.kind {
                Kind::Write { .. } if self.rng.chance(1, 2) => {
                    Some(self.rng.below(io.sectors * SECTOR))
                }
                Kind::Read { .. } if self.rng.chance(1, 2) => {
                    // Mostly writes: they are what can go missing.
                    self.next_id += 1;
                    io.kind = Kind::Write { id: self.next_id };
                    None
                }
                _ => None,
            };
            Step::Vanish { io, partial }
        } else if r < 30 {
            Step::Reconnect {
                conn: self.rng.below(self.conns as u64) as usize,
                mode: self.rng.below(3) as usize,
            }
        } else if r < 45 {
            let n = self.rng.below(3);
            let down = (0..n).map(|_| self.io()).collect();
            Step::Crash {
                down,
                power_cycle: self.rng.chance(2, 3),
            }
        } else if r < 60 {
            Step::Restart
        } else if self.mirror && r < 80 {
            Step::Leg {
                pick: self.rng.next(),
            }
        } else if self.mirror && r < 86 {
            Step::Reassemble
        } else if self.mirror {
            let io = self.io();
            if self.rng.chance(1, 20) {
                Step::LegIo(io, self.leg_fault())
            } else {
                Step::Io(io, None)
            }
        } else {
            let io = self.io();
            let inject = self.rng.chance(1, 60).then(|| self.inject(&io));
            Step::Io(io, inject)
        }
    }
}

// ---------------------------------------------------------------------------------------
// The run of one seed.

/// What a run did, summed over seeds.
#[derive(Debug, Default, Clone, Copy)]
struct Totals {
    seeds: u64,
    ops: u64,
    writes: u64,
    flushes_ok: u64,
    flushes_failed: u64,
    reads: u64,
    injected: u64,
    fast_zero_refused: u64,
    sticky_episodes: u64,
    vanished: u64,
    crashes: u64,
    power_cycles: u64,
    restarts: u64,
    sectors_verified: u64,
    /// Raid1 seeds among `seeds`, and their operations.
    mirror_seeds: u64,
    mirror_ops: u64,
    /// Raid1: failure rules armed on a leg, leg I/Os that failed meanwhile (any thread's),
    /// requests the array answered with an error, leg changes made (fail, remove, add), clean
    /// reassemblies.
    leg_rules: u64,
    leg_ios_failed: u64,
    array_errors: u64,
    leg_changes: u64,
    reassemblies: u64,
    /// Reads of a sector a crash left different on the legs that changed after a double
    /// failure (a leg lost before the resync ended).
    flips: u64,
}

impl Totals {
    fn add(&mut self, o: &Totals) {
        self.seeds += o.seeds;
        self.ops += o.ops;
        self.writes += o.writes;
        self.flushes_ok += o.flushes_ok;
        self.flushes_failed += o.flushes_failed;
        self.reads += o.reads;
        self.injected += o.injected;
        self.fast_zero_refused += o.fast_zero_refused;
        self.sticky_episodes += o.sticky_episodes;
        self.vanished += o.vanished;
        self.crashes += o.crashes;
        self.power_cycles += o.power_cycles;
        self.restarts += o.restarts;
        self.sectors_verified += o.sectors_verified;
        self.mirror_seeds += o.mirror_seeds;
        self.mirror_ops += o.mirror_ops;
        self.leg_rules += o.leg_rules;
        self.leg_ios_failed += o.leg_ios_failed;
        self.array_errors += o.array_errors;
        self.leg_changes += o.leg_changes;
        self.reassemblies += o.reassemblies;
        self.flips += o.flips;
    }
}

/// The schedule so far, and progress, shared with the watchdog.
#[derive(Default)]
struct Log {
    seed: AtomicU64,
    progress: AtomicU64,
    lines: Mutex<Vec<String>>,
}

impl Log {
    fn push(&self, line: String) {
        self.progress.fetch_add(1, Ordering::Relaxed);
        if let Ok(mut l) = self.lines.lock() {
            l.push(line);
        }
    }

    fn schedule(&self) -> String {
        match self.lines.lock() {
            Ok(l) => l.join("\n"),
            Err(p) => p.into_inner().join("\n"),
        }
    }

    fn reset(&self, seed: u64) {
        self.seed.store(seed, Ordering::Relaxed);
        self.progress.fetch_add(1, Ordering::Relaxed);
        match self.lines.lock() {
            Ok(mut l) => l.clear(),
            Err(p) => p.into_inner().clear(),
        }
    }
}

fn mem(spec: &str) -> Result<Arc<dyn Device>, String> {
    let s: DeviceSpec = spec.parse().map_err(|e| format!("{spec}: {e}"))?;
    Ok(Arc::new(
        s.build(&QueueOverrides::default())
            .map_err(|e| format!("{spec}: {e}"))?,
    ))
}

fn counters_delta(a: &FaultCounters, b: &FaultCounters, class: usize) -> (u64, u64) {
    (
        b.failed[class] - a.failed[class],
        b.crashed_io - a.crashed_io,
    )
}

/// What a seed exports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ExportKind {
    /// One fault device.
    Fault,
    /// A raid1 mirror over fault devices.
    Raid1,
}

impl ExportKind {
    /// The seed's kind: half each, from a hash of the seed that the schedule never draws.
    fn of_seed(seed: u64) -> Self {
        if Rng(seed ^ KIND_SALT).next() >> 63 == 1 {
            ExportKind::Raid1
        } else {
            ExportKind::Fault
        }
    }

    fn name(self) -> &'static str {
        match self {
            ExportKind::Fault => "fault",
            ExportKind::Raid1 => "raid1",
        }
    }
}

/// One leg of a raid1 export: a fault device with a volatile cache over `mem:`.
struct Leg {
    dev: Arc<dyn Device>,
    h: FaultHandle,
}

fn same_dev(a: &Arc<dyn Device>, b: &Arc<dyn Device>) -> bool {
    std::ptr::addr_eq(Arc::as_ptr(a), Arc::as_ptr(b))
}

/// A raid1 export: the array and the pool of legs it was built from (in it or out of it).
struct Mirror {
    /// Shared with the server's export; recovered with `take_array` once the server is gone.
    array: Option<Arc<Raid1>>,
    legs: Vec<Leg>,
    leg_spec: String,
    cfg: Raid1Config,
    speed_max: u64,
    delayed: bool,
    fault_seed: u64,
    /// Run-time picks of the seed: the order of the legs at each assembly.
    rng: Rng,
    /// The in-sync legs (pool indices) of the last assembly, and whether one of them was
    /// lost while a crash's sectors were not resynced yet (`Oracle::crash_set`).
    resync_legs: Vec<usize>,
    disturbed: bool,
}

impl Mirror {
    /// A new leg in the pool; returns its index.
    fn new_leg(&mut self) -> Res<usize> {
        let k = self.legs.len();
        let f = FaultDevice::new(
            mem(&self.leg_spec)?,
            FaultConfig {
                seed: self.fault_seed.wrapping_add(k as u64),
                volatile_cache: true,
                ..FaultConfig::default()
            },
        );
        let h = f.handle();
        self.legs.push(Leg {
            dev: Arc::new(f),
            h,
        });
        self.arm_delay(k);
        Ok(k)
    }

    /// The seed's delayed completions, if any, on leg `k` (after its rules were cleared).
    fn arm_delay(&self, k: usize) {
        if self.delayed {
            self.legs[k].h.add(Rule::delay(
                OpSet::ALL,
                Duration::ZERO,
                Duration::from_micros(50),
            ));
        }
    }

    fn array(&self) -> Res<&Arc<Raid1>> {
        self.array.as_ref().ok_or_else(|| "no array".to_string())
    }

    /// (slot, pool index) of every leg in the array.
    fn members(&self) -> Res<Vec<(usize, usize)>> {
        let r = self.array()?;
        Ok((0..r.slots())
            .filter_map(|i| {
                let d = r.leg_device(i)?;
                let k = self.legs.iter().position(|l| same_dev(&l.dev, &d))?;
                Some((i, k))
            })
            .collect())
    }

    /// The slots whose state `f` accepts (present slots only).
    fn slots_where(&self, f: impl Fn(raid1::LegStatus) -> bool) -> Res<Vec<usize>> {
        let r = self.array()?;
        Ok((0..r.slots())
            .filter(|&i| r.leg_status(i).is_some_and(|s| s.present && f(s)))
            .collect())
    }

    /// The present, in-sync, non-faulty legs (pool indices).
    fn healthy_legs(&self) -> Res<Vec<usize>> {
        let r = self.array()?;
        Ok(self
            .members()?
            .into_iter()
            .filter(|&(i, _)| {
                r.leg_status(i)
                    .is_some_and(|s| s.present && s.in_sync && !s.faulty)
            })
            .map(|(_, k)| k)
            .collect())
    }

    /// Leg I/Os failed so far over the pool, crashed ones included (any thread's).
    fn leg_failures(&self) -> u64 {
        self.legs
            .iter()
            .map(|l| {
                let c = l.h.counters();
                c.failed.iter().sum::<u64>() + c.crashed_io
            })
            .sum()
    }

    /// The slots for the log: `<leg><S|R|F>` (in sync, recovering, faulty) or `-` (empty).
    fn describe(&self) -> String {
        let Ok(r) = self.array() else {
            return "no array".into();
        };
        let members = self.members().unwrap_or_default();
        let mut out: Vec<String> = (0..r.slots())
            .map(|i| match r.leg_status(i) {
                Some(s) if s.present => {
                    let k = members
                        .iter()
                        .find(|&&(slot, _)| slot == i)
                        .map_or("?".to_string(), |&(_, k)| k.to_string());
                    let st = common::mirror::leg_state(&s);
                    format!("leg{k}:{st}")
                }
                _ => "-".into(),
            })
            .collect();
        if let Some(why) = r.failure() {
            out.push(format!("FAILED ({why})"));
        }
        format!("[{}]", out.join(" "))
    }

    /// What each leg of the array holds at `sector`, the bitmap's bit there and the legs'
    /// superblocks: to tell a bad read's source.
    fn explain(&self, sector: u64) -> String {
        let Ok(r) = self.array() else {
            return String::new();
        };
        let mut out = String::new();
        for (slot, k) in self.members().unwrap_or_default() {
            let dev = &self.legs[k].dev;
            let at = r.data_offset() + sector * SECTOR;
            let held = match testkit::io::read_at(dev.as_ref(), at, SECTOR as usize) {
                Ok(b) => match decode_sector(&b, sector) {
                    Ok(0) => "zeros".to_string(),
                    Ok(v) => format!("w{v}"),
                    Err(e) => e,
                },
                Err(e) => format!("unreadable: {e}"),
            };
            out.push_str(&format!(
                "\n  slot {slot} (leg {k}, {:?}) holds {held}",
                r.leg_status(slot)
            ));
        }
        if let Some(bm) = r.bitmap() {
            let chunk = sector * SECTOR / bm.chunk_size();
            out.push_str(&format!(
                "\n  bitmap chunk {chunk} dirty: {}, events_cleared {}",
                bm.is_dirty(chunk),
                bm.events_cleared()
            ));
        }
        let devs: Vec<Arc<dyn Device>> = self
            .members()
            .unwrap_or_default()
            .iter()
            .map(|&(_, k)| self.legs[k].dev.clone())
            .collect();
        out.push_str(&format!("\n  superblocks: {}", superblocks(&devs)));
        out
    }

    /// The array, once the server that held it is gone.
    fn take_array(&mut self) -> Res<Raid1> {
        let mut a = self.array.take().ok_or("no array")?;
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match Arc::try_unwrap(a) {
                Ok(r) => return Ok(r),
                Err(back) => {
                    if Instant::now() > deadline {
                        return Err(format!(
                            "the array is still referenced {} more time(s) 10 s after its \
                             server stopped",
                            Arc::strong_count(&back) - 1
                        ));
                    }
                    a = back;
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
        }
    }

    /// Assembles the array from pool legs `legs`, in a seeded order.
    fn assemble(&mut self, mut legs: Vec<usize>) -> Res<String> {
        for i in (1..legs.len()).rev() {
            let j = self.rng.below(i as u64 + 1) as usize;
            legs.swap(i, j);
        }
        let devs: Vec<Arc<dyn Device>> = legs.iter().map(|&k| self.legs[k].dev.clone()).collect();
        let r = Raid1::assemble(devs.clone(), self.cfg.clone()).map_err(|e| {
            format!(
                "assembling legs {legs:?}: {e}; their superblocks: {}",
                superblocks(&devs)
            )
        })?;
        r.set_speed_limits(1000.min(self.speed_max), self.speed_max);
        let warnings = r.assemble_warnings().to_vec();
        self.array = Some(Arc::new(r));
        self.resync_legs = self.healthy_legs()?;
        let mut said = format!("assembled from legs {legs:?}: {}", self.describe());
        if !warnings.is_empty() {
            said.push_str(&format!(", warnings {warnings:?}"));
        }
        Ok(said)
    }
}

/// The legs' superblocks, for a failed assembly's report.
fn superblocks(devs: &[Arc<dyn Device>]) -> String {
    let sbs: Vec<String> = devs
        .iter()
        .map(|d| {
            Raid1::read_superblock(d.as_ref()).map_or_else(|e| e.to_string(), |sb| sb.to_string())
        })
        .collect();
    format!("{sbs:#?}")
}

/// What the export is.
enum Backend {
    Fault {
        dev: Arc<dyn Device>,
        faults: FaultHandle,
    },
    Mirror(Mirror),
}

struct Sim<'a> {
    log: &'a Log,
    dir: tempfile::TempDir,
    backend: Backend,
    server: Option<Server>,
    clients: Vec<Option<Client>>,
    modes: Vec<usize>,
    oracle: Oracle,
    totals: Totals,
    step_no: u64,
    /// The export's size.
    sectors: u64,
}

type Res<T> = Result<T, String>;

impl Sim<'_> {
    fn sock(&self) -> std::path::PathBuf {
        self.dir.path().join("nbd.sock")
    }

    fn export_dev(&self) -> Res<Arc<dyn Device>> {
        match &self.backend {
            Backend::Fault { dev, .. } => Ok(dev.clone()),
            Backend::Mirror(m) => {
                let d: Arc<dyn Device> = m.array()?.clone();
                Ok(d)
            }
        }
    }

    /// The fault export's handle.
    fn faults(&self) -> Res<FaultHandle> {
        match &self.backend {
            Backend::Fault { faults, .. } => Ok(faults.clone()),
            Backend::Mirror(_) => Err("a raid1 export has no single fault device".into()),
        }
    }

    fn mirror(&self) -> Option<&Mirror> {
        match &self.backend {
            Backend::Mirror(m) => Some(m),
            Backend::Fault { .. } => None,
        }
    }

    fn mirror_mut(&mut self) -> Res<&mut Mirror> {
        match &mut self.backend {
            Backend::Mirror(m) => Ok(m),
            Backend::Fault { .. } => Err("not a raid1 export".into()),
        }
    }

    fn start_server(&mut self) -> Res<()> {
        let mut cfg = ServerConfig::new(vec![Export::new("", self.export_dev()?)]);
        cfg.unix = Some(self.sock());
        cfg.tuning.drain_timeout = Duration::from_secs(10);
        self.server = Some(Server::start(cfg).map_err(|e| format!("server start: {e}"))?);
        Ok(())
    }

    fn server(&self) -> Res<&Server> {
        self.server.as_ref().ok_or_else(|| "no server".to_string())
    }

    fn connect(&mut self, conn: usize) -> Res<()> {
        let ep = Endpoint::Unix(self.sock());
        let c = Client::connect(&ep, &options(self.modes[conn]))
            .map_err(|e| format!("connect c{conn} ({}): {e}", MODES[self.modes[conn]]))?;
        self.clients[conn] = Some(c);
        Ok(())
    }

    /// Waits until the server has closed every connection but the `live` ones.
    fn wait_connections(&self, live: usize) -> Res<()> {
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.server()?.connections() > live {
            if Instant::now() > deadline {
                return Err(format!(
                    "the server still has {} connections, {live} expected",
                    self.server()?.connections()
                ));
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        Ok(())
    }

    fn live(&self) -> usize {
        self.clients.iter().filter(|c| c.is_some()).count()
    }

    /// The server's flag agrees with the oracle's.
    fn check_sticky(&self) -> Res<()> {
        let server = self.server()?.export_failed("");
        if server != Some(self.oracle.sticky) {
            return Err(format!(
                "rule (b): the server says the export failed: {server:?}, the oracle: {}",
                self.oracle.sticky
            ));
        }
        Ok(())
    }

    /// Raid1: whether a leg in sync at the last assembly has been lost while a crash's
    /// sectors are not resynced yet (a double failure: what they read may change).
    fn resync_disturbed(&mut self) -> Res<bool> {
        if !self.oracle.has_crash_marks() {
            return Ok(false);
        }
        let Backend::Mirror(m) = &mut self.backend else {
            return Ok(false);
        };
        if !m.disturbed {
            let now = m.healthy_legs()?;
            m.disturbed = m.resync_legs.iter().any(|k| !now.contains(k));
        }
        Ok(m.disturbed)
    }

    /// Raid1: once the sync thread has run a pass to its end since the last assembly, the
    /// resync is over and the legs agree where the crash left them different.
    fn settle_resync(&mut self) -> Res<()> {
        if !self.oracle.has_crash_marks() {
            return Ok(());
        }
        let Backend::Mirror(m) = &mut self.backend else {
            return Ok(());
        };
        let p = m.array()?.sync_progress();
        if p.action == SyncAction::Idle && p.total_bytes > 0 && p.done_bytes >= p.total_bytes {
            self.oracle.settle_crash();
            m.disturbed = false;
        }
        Ok(())
    }

    /// Sends `io` on its connection and waits for its reply.
    fn exchange(&mut self, io: &Io) -> Res<Reply> {
        let conn = io.conn;
        let mode = self.modes[conn];
        let client = self.clients[conn]
            .as_mut()
            .ok_or_else(|| format!("c{conn} is not connected"))?;
        let req = io.request(client.mode());
        let payload = io.payload();
        let cookie = client
            .send(req, &payload)
            .map_err(|e| format!("{io:?}: send: {e}"))?;
        let reply = client
            .recv()
            .map_err(|e| format!("{io:?} ({}): no reply: {e}", MODES[mode]))?;
        if reply.cookie != cookie {
            return Err(format!("{io:?}: a reply to another request"));
        }
        Ok(reply)
    }

    /// What a request answered `err` did to the data, and rule (c) for a read. `unsettle`: a
    /// failed request may have left the mirror's legs disagreeing.
    fn record(&mut self, io: &Io, err: u32, reply: &Reply, unsettle: bool) -> Res<()> {
        match io.kind {
            Kind::Write { .. } | Kind::WriteZeroes { .. } => {
                self.totals.writes += 1;
                if err == 0 {
                    self.oracle
                        .written(io.sector, io.sectors, io.value(), io.fua);
                } else {
                    self.oracle.maybe_written(io.sector, io.sectors, io.value());
                }
            }
            Kind::Trim => self.oracle.maybe_written(io.sector, io.sectors, 0),
            Kind::Flush => {
                if err == 0 {
                    self.totals.flushes_ok += 1;
                    self.oracle.flushed();
                } else {
                    self.totals.flushes_failed += 1;
                }
            }
            Kind::Read { .. } => {
                self.totals.reads += 1;
                if err == 0 {
                    if reply.data.len() as u64 != io.sectors * SECTOR {
                        return Err(format!(
                            "{io:?}: {} bytes of data in the reply",
                            reply.data.len()
                        ));
                    }
                    let disturbed = self.resync_disturbed()?;
                    if let Err((s, e)) = self.oracle.check_read(io.sector, &reply.data, disturbed) {
                        let legs = self.mirror().map(|m| m.explain(s)).unwrap_or_default();
                        return Err(format!("{io:?}: {e}{legs}"));
                    }
                }
            }
        }
        if unsettle && err != 0 && io.modifies() {
            self.oracle.unsettle(io.sector, io.sectors);
        }
        Ok(())
    }

    /// Sends `io` to the fault export and checks its reply; returns the outcome for the log.
    fn run_io(&mut self, io: &Io, inject: Option<Inject>) -> Res<String> {
        let faults = self.faults()?;
        let rule = inject.map(|i| {
            let ops = [OpSet::READ, OpSet::WRITE, OpSet::FLUSH, OpSet::DISCARD][io.class()];
            let r = Rule::fail(ops).errno(i.errno);
            faults.add(if i.nth == 0 { r } else { r.nth(i.nth) })
        });
        let before = faults.counters();
        let reply = self.exchange(io)?;
        if let Some(id) = rule {
            faults.remove(id);
        }
        let after = faults.counters();
        let (failed, crashed) = counters_delta(&before, &after, io.class());
        let dev_failed = failed + crashed > 0;
        if inject.is_some() && failed > 0 {
            self.totals.injected += 1;
        }
        let err = reply.error;
        let sticky_before = self.oracle.sticky;
        // What the reply must say.
        if dev_failed {
            if err == 0 {
                return Err(format!(
                    "{io:?}: the device failed {failed} bio(s) ({crashed} crashed), and the \
                     reply says success"
                ));
            }
            if crashed == 0 {
                if let Some(i) = inject {
                    let want = match i.errno {
                        libc::ENOSPC => NBD_ENOSPC,
                        libc::ENOTSUP => NBD_ENOTSUP,
                        _ => NBD_EIO,
                    };
                    // A durable request of several bios may also get the EIO of the
                    // failed write-back its own failing bio just recorded.
                    if err != want && !(io.durable() && err == NBD_EIO) {
                        return Err(format!(
                            "{io:?}: the device failed with errno {}, the reply has NBD error \
                             {err}, expected {want}",
                            i.errno
                        ));
                    }
                }
            }
        } else if sticky_before && io.durable() {
            if err != NBD_EIO {
                return Err(format!(
                    "rule (b): {io:?} after a failed write-back got error {err}, expected EIO"
                ));
            }
        } else if err != 0 {
            return Err(format!(
                "{io:?}: error {err} although the device failed nothing and the export has \
                 not failed (sticky: {sticky_before})"
            ));
        }
        // A FAST_ZERO write-zeroes that the device refused (ENOTSUP, nothing crashed) is no
        // failed write-back: the specification makes it the expected answer of a device that
        // cannot zero fast.
        let refused_fast_zero = matches!(io.kind, Kind::WriteZeroes { fast: true, .. })
            && crashed == 0
            && inject.is_some_and(|i| i.errno == libc::ENOTSUP);
        if refused_fast_zero && failed > 0 {
            self.totals.fast_zero_refused += 1;
        }
        if dev_failed && io.writes_back() && !refused_fast_zero && !self.oracle.sticky {
            self.oracle.sticky = true;
            self.totals.sticky_episodes += 1;
        }
        self.record(io, err, &reply, false)?;
        self.check_sticky()
            .map_err(|e| format!("after {io:?}: {e}"))?;
        Ok(if err == 0 {
            "ok".to_string()
        } else {
            format!("error {err} (device failed {failed}, crashed {crashed})")
        })
    }

    /// Sends `io` to the raid1 export, with `fault` armed on one leg for its time, and checks
    /// the array's answer (`down`: every leg has crashed); returns the outcome for the log.
    fn run_io_mirror(&mut self, io: &Io, fault: Option<LegFault>, down: bool) -> Res<String> {
        let m = self.mirror().ok_or("not a raid1 export")?;
        let r = m.array()?.clone();
        let failed_before = r.failure().is_some();
        let healthy = m.slots_where(|s| s.in_sync && !s.faulty)?;
        // (slot, pool index, rule id) of the armed rule.
        let mut armed: Option<(usize, usize, u64)> = None;
        if let Some(f) = fault {
            let members = m.members()?;
            let live: Vec<(usize, usize)> = members
                .iter()
                .copied()
                .filter(|&(i, _)| r.leg_status(i).is_some_and(|s| !s.faulty))
                .collect();
            let cands = if live.is_empty() { members } else { live };
            if !cands.is_empty() {
                let (slot, k) = cands[(f.pick % cands.len() as u64) as usize];
                let ops = if f.all_ops {
                    OpSet::ALL
                } else {
                    [OpSet::READ, OpSet::WRITE, OpSet::FLUSH, OpSet::DISCARD][io.class()]
                };
                let mut rule = Rule::fail(ops).errno(f.errno);
                if f.in_range && io.sectors > 0 {
                    rule = rule.in_range(r.data_offset() + io.sector * SECTOR, io.sectors * SECTOR);
                }
                rule = match f.when {
                    LegWhen::Next(n) => rule.next(n),
                    LegWhen::Percent(p) => rule.prob(p as f64 / 100.0),
                };
                armed = Some((slot, k, m.legs[k].h.add(rule)));
            }
        }
        let before = m.leg_failures();
        let reply = self.exchange(io)?;
        let m = self.mirror().ok_or("not a raid1 export")?;
        if let Some((_, k, id)) = armed {
            m.legs[k].h.remove(id);
        }
        let leg_failed = m.leg_failures() - before;
        let failed_after = r.failure();
        let state = m.describe();
        self.totals.leg_ios_failed += leg_failed;
        if armed.is_some() {
            self.totals.leg_rules += 1;
        }
        let err = reply.error;
        if err != 0 {
            self.totals.array_errors += 1;
        }
        let sticky_before = self.oracle.sticky;
        let rule = match armed {
            Some((slot, k, _)) => format!("a rule on slot {slot} (leg {k})"),
            None => "no rule armed".into(),
        };
        let facts = format!(
            "{rule}, in-sync legs before {healthy:?}, {leg_failed} leg I/O(s) failed, the \
             array before: {}, now {state}",
            if failed_before { "failed" } else { "working" }
        );
        // Another present, in-sync, non-faulty leg than the one with the rule could serve it:
        // the array must answer as if nothing failed.
        let covered = armed.is_some_and(|(slot, _, _)| healthy.iter().any(|&i| i != slot));
        let excused = down || failed_before || (armed.is_some() && !covered);
        // What the reply must say.
        if sticky_before && io.durable() {
            if err == 0 {
                return Err(format!(
                    "rule (b): {io:?} after a failed write-back was acknowledged ({facts})"
                ));
            }
            if err != NBD_EIO && !(down || failed_before || armed.is_some()) {
                return Err(format!(
                    "rule (b): {io:?} after a failed write-back got error {err}, expected EIO \
                     ({facts})"
                ));
            }
        } else if err != 0 && !excused {
            return Err(format!(
                "rule (b): {io:?} failed with error {err} although the array could serve it \
                 ({facts})"
            ));
        }
        if covered && !down && !failed_before {
            if let Some(why) = failed_after {
                return Err(format!(
                    "{io:?}: the array failed ({why}) although only one leg had a rule and \
                     another in-sync leg could serve ({facts})"
                ));
            }
        }
        let refused_fast_zero =
            matches!(io.kind, Kind::WriteZeroes { fast: true, .. }) && err == NBD_ENOTSUP;
        if err != 0 && io.writes_back() && !refused_fast_zero && !self.oracle.sticky {
            self.oracle.sticky = true;
            self.totals.sticky_episodes += 1;
        }
        self.record(io, err, &reply, true)?;
        self.check_sticky()
            .map_err(|e| format!("after {io:?}: {e} ({facts})"))?;
        let mut out = if err == 0 {
            "ok".to_string()
        } else {
            format!("error {err}")
        };
        if armed.is_some() || leg_failed > 0 || err != 0 {
            out.push_str(&format!(" ({facts})"));
        }
        Ok(out)
    }

    fn vanish(&mut self, io: &Io, partial: Option<u64>) -> Res<String> {
        let conn = io.conn;
        let mut client = self.clients[conn]
            .take()
            .ok_or_else(|| format!("c{conn} is not connected"))?;
        let faults = self.faults().ok();
        let before = faults.as_ref().map(|f| f.counters());
        let array = match self.mirror() {
            Some(m) => Some(m.array()?.clone()),
            None => None,
        };
        let array_failed_before = array.as_ref().is_some_and(|r| r.failure().is_some());
        let mode = client.mode();
        let payload = io.payload();
        let sent = match partial {
            None => client.send(io.request(mode), &payload).map(drop),
            Some(n) => {
                let mut flags = if io.fua {
                    CmdFlags::FUA
                } else {
                    CmdFlags::empty()
                };
                if mode == TransmissionMode::Extended {
                    flags |= CmdFlags::PAYLOAD_LEN;
                }
                client
                    .send_raw_request(
                        1, // NBD_CMD_WRITE
                        flags,
                        io.sector * SECTOR,
                        io.sectors * SECTOR,
                    )
                    .and_then(|_| client.send_raw(&payload[..n as usize]))
            }
        };
        sent.map_err(|e| format!("{io:?}: send: {e}"))?;
        drop(client);
        self.wait_connections(self.live())?;
        // A failed array may have failed it (its outcome is unknown, the legs may disagree,
        // and the export may have failed); nothing else may.
        let array_failed =
            array_failed_before || array.as_ref().is_some_and(|r| r.failure().is_some());
        if let (Some(f), Some(before)) = (&faults, &before) {
            let after = f.counters();
            let (failed, crashed) = counters_delta(before, &after, io.class());
            if failed + crashed > 0 {
                return Err(format!(
                    "{io:?}: the device failed {failed} bio(s) with no fault injected"
                ));
            }
        }
        if io.modifies() {
            self.oracle.maybe_written(io.sector, io.sectors, io.value());
            if array_failed {
                self.oracle.unsettle(io.sector, io.sectors);
            }
        }
        if array_failed
            && io.writes_back()
            && !self.oracle.sticky
            && self.server()?.export_failed("") == Some(true)
        {
            self.oracle.sticky = true;
            self.totals.sticky_episodes += 1;
        }
        self.totals.vanished += 1;
        self.connect(conn)?;
        self.check_sticky()?;
        Ok("gone".into())
    }

    /// Drops every client and shuts the server down; returns the exports it reports failed.
    fn stop_server(&mut self, clean: bool) -> Res<Vec<String>> {
        for (i, c) in self.clients.iter_mut().enumerate() {
            if let Some(c) = c.take() {
                if clean && i % 2 == 0 {
                    c.disconnect()
                        .map_err(|e| format!("c{i}: disconnect: {e}"))?;
                }
            }
        }
        let server = self.server.take().ok_or("no server")?;
        Ok(server.shutdown().failed)
    }

    fn start_all(&mut self) -> Res<()> {
        self.start_server()?;
        for i in 0..self.clients.len() {
            self.connect(i)?;
        }
        self.check_sticky()
    }

    /// Reads the whole device back and checks it against the oracle (rule a).
    fn verify_after_crash(&mut self) -> Res<()> {
        let client = self.clients[0].as_mut().ok_or("c0 is not connected")?;
        let bytes = self.sectors * SECTOR;
        let chunk = 1u64 << 20;
        let mut all = Vec::with_capacity(bytes as usize);
        for off in (0..bytes).step_by(chunk as usize) {
            let data = client
                .read(off, chunk.min(bytes - off))
                .map_err(|e| format!("reading the device back at {off}: {e}"))?;
            all.extend_from_slice(&data);
        }
        let disturbed = self.resync_disturbed()?;
        self.oracle.check_after_crash(&all, disturbed)?;
        self.totals.sectors_verified += self.sectors;
        Ok(())
    }

    fn crash(&mut self, down: &[Io], power_cycle: bool) -> Res<String> {
        if self.mirror().is_some() {
            return self.crash_mirror(down);
        }
        let faults = self.faults()?;
        let report = faults
            .crash()
            .map_err(|e| format!("the fault device's crash failed: {e}"))?;
        self.totals.crashes += 1;
        self.oracle.crashed();
        let mut outcome = format!("{} writes lost", report.writes_lost);
        for io in down {
            let r = self.run_io(io, None)?;
            outcome.push_str(&format!("; while down {io:?} -> {r}"));
        }
        if power_cycle {
            self.totals.power_cycles += 1;
            let failed = self.stop_server(false)?;
            if failed != [String::new()] {
                return Err(format!(
                    "a shutdown whose final flush hit a crashed device reported {failed:?} \
                     failed, expected [\"\"]"
                ));
            }
            faults.restart();
            self.oracle.sticky = false;
            self.start_all()?;
            outcome.push_str("; power cycle");
        } else {
            faults.restart();
            outcome.push_str("; device back");
        }
        self.verify_after_crash()?;
        self.check_sticky()?;
        Ok(outcome)
    }

    /// A power cut under a raid1 export: every leg crashes at once (the pool's legs out of
    /// the array too), `down` is sent, the server stops, the array stops uncleanly, the legs
    /// restart and are assembled again in a seeded order under a new server, and the whole
    /// export is read back (rule a).
    fn crash_mirror(&mut self, down: &[Io]) -> Res<String> {
        let m = self.mirror().ok_or("not a raid1 export")?;
        let members: Vec<usize> = m.members()?.into_iter().map(|(_, k)| k).collect();
        let mut lost = 0;
        for (k, l) in m.legs.iter().enumerate() {
            lost +=
                l.h.crash()
                    .map_err(|e| format!("leg {k}: the fault device's crash failed: {e}"))?
                    .writes_lost;
        }
        self.totals.crashes += 1;
        self.totals.power_cycles += 1;
        self.oracle.crashed();
        let mut outcome = format!("{lost} leg writes lost");
        for io in down {
            let r = self.run_io_mirror(io, None, true)?;
            outcome.push_str(&format!("; while down {io:?} -> {r}"));
        }
        let failed = self.stop_server(false)?;
        if failed != [String::new()] {
            return Err(format!(
                "a shutdown whose final flush hit crashed legs reported {failed:?} failed, \
                 expected [\"\"]"
            ));
        }
        let m = self.mirror_mut()?;
        m.take_array()?.crash_for_test();
        for k in 0..m.legs.len() {
            m.legs[k].h.clear();
            m.legs[k].h.restart();
            m.arm_delay(k);
        }
        let said = m.assemble(members)?;
        outcome.push_str(&format!("; power cycle; {said}"));
        self.oracle.sticky = false;
        self.start_all()?;
        self.verify_after_crash()?;
        self.check_sticky()?;
        Ok(outcome)
    }

    fn restart(&mut self) -> Res<String> {
        let faults = self.faults().ok();
        let before = faults.as_ref().map(|f| f.counters());
        let array_failed = match self.mirror() {
            Some(m) => Some(m.array()?.failure().is_some()),
            None => None,
        };
        let failed = self.stop_server(true)?;
        // The final flush fails where the device fails it: a fault device's counters say so;
        // a raid1 array fails it once it has failed (no rule is armed between requests).
        let final_flush_failed = match (&faults, &before, array_failed) {
            (Some(f), Some(before), _) => {
                let (f, c) = counters_delta(before, &f.counters(), 2);
                f + c > 0
            }
            (_, _, Some(a)) => a,
            _ => false,
        };
        let expect_failed = self.oracle.sticky || final_flush_failed;
        let want: Vec<String> = if expect_failed {
            vec![String::new()]
        } else {
            Vec::new()
        };
        if failed != want {
            return Err(format!(
                "rule (b): a clean shutdown reported {failed:?} failed, expected {want:?} \
                 (sticky: {}, array failed: {array_failed:?})",
                self.oracle.sticky
            ));
        }
        if failed.is_empty() {
            self.oracle.flushed();
        }
        self.totals.restarts += 1;
        self.oracle.sticky = false;
        Ok(if failed.is_empty() {
            "clean".into()
        } else {
            "reported failed".into()
        })
    }

    /// A clean restart of the server on the same device.
    fn restart_server(&mut self) -> Res<String> {
        let said = self.restart()?;
        self.start_all()?;
        Ok(said)
    }

    /// Raid1: a clean restart of the server, with a clean stop of the array (its drop) and
    /// an assembly of its legs in a seeded order between the two.
    fn reassemble(&mut self) -> Res<String> {
        let mut said = self.restart()?;
        self.totals.reassemblies += 1;
        let m = self.mirror_mut()?;
        let members: Vec<usize> = m.members()?.into_iter().map(|(_, k)| k).collect();
        drop(m.take_array()?);
        said.push_str(&format!("; {}", m.assemble(members)?));
        self.start_all()?;
        Ok(said)
    }

    /// Raid1 leg management (`Step::Leg`).
    fn leg_change(&mut self, pick: u64) -> Res<String> {
        let m = self.mirror_mut()?;
        let r = m.array()?.clone();
        let inside: Vec<usize> = m.members()?.into_iter().map(|(_, k)| k).collect();
        let out: Vec<usize> = (0..m.legs.len()).filter(|k| !inside.contains(k)).collect();
        let free_slot = inside.len() < r.slots();
        let said = if !out.is_empty() && free_slot {
            // A leg is out: add it back (a re-add), or now and then a fresh one instead.
            let k = if pick.is_multiple_of(4) && m.legs.len() < MAX_POOL {
                m.new_leg()?
            } else {
                out[(pick / 4 % out.len() as u64) as usize]
            };
            m.legs[k].h.clear();
            m.arm_delay(k);
            match r.add_leg(m.legs[k].dev.clone()) {
                Ok(slot) => format!("add leg {k}: slot {slot}"),
                Err(e) if r.failure().is_some() => {
                    format!("add leg {k}: {e} (the array has failed)")
                }
                Err(e) => return Err(format!("add leg {k}: {e}, with no fault armed")),
            }
        } else {
            let faulty = m.slots_where(|s| s.faulty)?;
            let recovering = m.slots_where(|s| !s.faulty && !s.in_sync)?;
            let live = m.slots_where(|s| !s.faulty)?;
            if !faulty.is_empty() || (pick.is_multiple_of(3) && !recovering.is_empty()) {
                let from = if faulty.is_empty() {
                    &recovering
                } else {
                    &faulty
                };
                let i = from[(pick / 3 % from.len() as u64) as usize];
                match r.remove_leg(i) {
                    Ok(_) => format!("remove slot {i}"),
                    // Its recovery may have ended since; a failed array refuses changes.
                    Err(e) if faulty.is_empty() || r.failure().is_some() => {
                        format!("remove slot {i}: {e}")
                    }
                    Err(e) => return Err(format!("remove faulty slot {i}: {e}")),
                }
            } else if live.is_empty() {
                "no leg to fail".into()
            } else {
                let i = live[(pick / 3 % live.len() as u64) as usize];
                match r.fail_leg(i) {
                    Ok(()) => format!("fail slot {i}"),
                    Err(e) => format!("fail slot {i}: {e}"),
                }
            }
        };
        self.totals.leg_changes += 1;
        let m = self.mirror_mut()?;
        Ok(format!("{said}: {}", m.describe()))
    }

    fn step(&mut self, step: &Step) -> Res<()> {
        self.step_no += 1;
        let n = self.step_no;
        let what = format!("{step:?}");
        self.log.push(format!("{n:5} {what}"));
        let mirror = self.mirror().is_some();
        let outcome = match step {
            Step::Io(io, inject) if mirror => {
                if inject.is_some() {
                    return Err("a fault-device injection on a raid1 export".into());
                }
                self.run_io_mirror(io, None, false)?
            }
            Step::Io(io, inject) => self.run_io(io, *inject)?,
            Step::LegIo(io, fault) => self.run_io_mirror(io, Some(*fault), false)?,
            Step::Leg { pick } => self.leg_change(*pick)?,
            Step::Reassemble => self.reassemble()?,
            Step::Vanish { io, partial } => self.vanish(io, *partial)?,
            Step::Reconnect { conn, mode } => {
                let c = self.clients[*conn].take().ok_or("not connected")?;
                c.disconnect()
                    .map_err(|e| format!("c{conn}: disconnect: {e}"))?;
                self.modes[*conn] = *mode;
                self.connect(*conn)?;
                "ok".into()
            }
            Step::Crash { down, power_cycle } => self.crash(down, *power_cycle)?,
            // A failed array stays failed until it is stopped: restart it too.
            Step::Restart
                if self
                    .mirror()
                    .is_some_and(|m| m.array().is_ok_and(|r| r.failure().is_some())) =>
            {
                self.reassemble()?
            }
            Step::Restart => self.restart_server()?,
        };
        self.totals.ops += 1;
        if mirror {
            self.totals.mirror_ops += 1;
            self.settle_resync()?;
            self.totals.flips = self.oracle.flips;
        }
        if let Ok(mut l) = self.log.lines.lock() {
            if let Some(last) = l.last_mut() {
                last.push_str(" -> ");
                last.push_str(&outcome);
            }
        }
        Ok(())
    }
}

/// Runs seed `seed` to its end, exporting `kind`; returns what it did and, as `Err`, what
/// broke (the schedule is in `log`).
fn run_seed(seed: u64, kind: ExportKind, log: &Log) -> (Totals, Res<()>) {
    let mut totals = Totals {
        seeds: 1,
        mirror_seeds: u64::from(kind == ExportKind::Raid1),
        ..Totals::default()
    };
    let res = run_seed_into(seed, kind, log, &mut totals);
    (totals, res)
}

fn run_seed_into(seed: u64, kind: ExportKind, log: &Log, totals: &mut Totals) -> Res<()> {
    log.reset(seed);
    let mut rng = Rng(seed);
    let conns = 1 + rng.below(4) as usize;
    let max_io = ["", ",max_io=64K", ",max_io=16K"][rng.below(3) as usize];
    let delayed = rng.chance(1, 4);
    let steps = 150 + rng.below(450);
    let modes: Vec<usize> = (0..conns).map(|_| rng.below(3) as usize).collect();
    let fault_seed = rng.next();
    let (backend, sectors, what) = match kind {
        ExportKind::Fault => {
            let fault = FaultDevice::new(
                mem(&format!("mem:4M{max_io}"))?,
                FaultConfig {
                    seed: fault_seed,
                    volatile_cache: true,
                    ..FaultConfig::default()
                },
            );
            let faults = fault.handle();
            if delayed {
                faults.add(Rule::delay(
                    OpSet::ALL,
                    Duration::ZERO,
                    Duration::from_micros(50),
                ));
            }
            let backend = Backend::Fault {
                dev: Arc::new(fault),
                faults,
            };
            (backend, SECTORS, format!("mem:4M{max_io}"))
        }
        ExportKind::Raid1 => {
            let legs = 2 + rng.below(2) as usize;
            let bitmap_chunk = [0, 256 << 10, 1 << 20][rng.below(3) as usize];
            let barrier = if rng.chance(1, 2) {
                BarrierMode::Lockless
            } else {
                BarrierMode::Locked
            };
            let depth = if rng.chance(1, 4) { 16 } else { 256 };
            let speed_max = [2_000, 20_000, 200_000, FAST][rng.below(4) as usize];
            let cfg = Raid1Config {
                barrier,
                bitmap_chunk,
                bitmap_quiet: Duration::from_millis(10),
                tick: Duration::from_millis(20),
                depth,
                spare_slots: 1,
                ..Raid1Config::default()
            };
            let mut m = Mirror {
                array: None,
                legs: Vec::new(),
                leg_spec: format!("{LEG_SPEC}{max_io}"),
                cfg,
                speed_max,
                delayed,
                fault_seed,
                rng: Rng(fault_seed ^ KIND_SALT),
                resync_legs: Vec::new(),
                disturbed: false,
            };
            let mut devs = Vec::new();
            for _ in 0..legs {
                let k = m.new_leg()?;
                devs.push(m.legs[k].dev.clone());
            }
            let r = Raid1::create(devs, m.cfg.clone()).map_err(|e| format!("raid1: {e}"))?;
            r.set_speed_limits(1000.min(speed_max), speed_max);
            let cap = r.limits().capacity;
            m.array = Some(Arc::new(r));
            m.resync_legs = m.healthy_legs()?;
            let what = format!(
                "raid1 over {legs} legs {LEG_SPEC}{max_io} ({cap} bytes; bitmap chunk \
                 {bitmap_chunk}, {barrier:?} barriers, depth {depth}, sync_speed_max \
                 {speed_max} KiB/s)"
            );
            (Backend::Mirror(m), cap / SECTOR, what)
        }
    };
    log.push(format!(
        "seed {seed}: {conns} connection(s) {:?}, {what}, delayed completions: {delayed}, \
         {steps} steps",
        modes.iter().map(|&m| MODES[m]).collect::<Vec<_>>()
    ));
    let mut sim = Sim {
        log,
        dir: tempfile::tempdir().map_err(|e| e.to_string())?,
        backend,
        server: None,
        clients: (0..conns).map(|_| None).collect(),
        modes,
        oracle: Oracle::new(sectors, kind == ExportKind::Raid1),
        totals: *totals,
        step_no: 0,
        sectors,
    };
    let mut gen = Gen {
        rng,
        conns,
        next_id: 0,
        sectors,
        mirror: kind == ExportKind::Raid1,
    };
    let res = drive(&mut sim, &mut gen, steps);
    *totals = sim.totals;
    res
}

/// The schedule of a seed after its setup, and its end.
fn drive(sim: &mut Sim<'_>, gen: &mut Gen, steps: u64) -> Res<()> {
    sim.start_all()?;
    for _ in 0..steps {
        let step = gen.step();
        sim.step(&step)?;
    }
    // The end: a last flush where it can succeed, then a power cycle that reads it all back.
    let flush = Io {
        conn: 0,
        kind: Kind::Flush,
        sector: 0,
        sectors: 0,
        fua: false,
    };
    sim.step(&Step::Io(flush, None))?;
    sim.step(&Step::Crash {
        down: Vec::new(),
        power_cycle: true,
    })?;
    let failed = sim.stop_server(true)?;
    if !failed.is_empty() {
        return Err(format!("the final shutdown reported {failed:?} failed"));
    }
    Ok(())
}

/// Ends the process if a step hangs (a reply that never comes), printing the seed and the
/// schedule, since a hung test would print nothing.
struct Watchdog {
    stop: Arc<AtomicBool>,
}

impl Watchdog {
    fn start(log: Arc<Log>) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let limit = env_u64("SIM_STALL_SECS").map_or(STALL_LIMIT, Duration::from_secs);
        std::thread::spawn(move || {
            let mut seen = log.progress.load(Ordering::Relaxed);
            let mut since = Instant::now();
            while !s.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(200));
                let now = log.progress.load(Ordering::Relaxed);
                if now != seen {
                    seen = now;
                    since = Instant::now();
                } else if since.elapsed() > limit {
                    let seed = log.seed.load(Ordering::Relaxed);
                    eprintln!(
                        "sim_flush: seed {seed} made no progress for {limit:?}: hung.\n\
                         replay: SIM_SEEDS=1 SIM_SEED_BASE={seed} cargo test --release -p nbd \
                         --test sim_flush\nschedule:\n{}",
                        log.schedule()
                    );
                    std::process::exit(101);
                }
            }
        });
        Watchdog { stop }
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// Runs `count` seeds from `base`, each exporting `kind` or, when `None`, the seed's own
/// kind; panics with the seed, the error and the schedule at the first failure (with
/// `SIM_KEEP_GOING=1`, prints each failure with the end of its schedule, runs every seed, and
/// panics at the end naming the failed seeds).
fn run_seeds(base: u64, count: u64, kind: Option<ExportKind>) -> Totals {
    let log = Arc::new(Log::default());
    let _watchdog = Watchdog::start(log.clone());
    let mut totals = Totals::default();
    let started = Instant::now();
    let print_schedules = std::env::var_os("SIM_SCHEDULE").is_some();
    let keep_going = std::env::var_os("SIM_KEEP_GOING").is_some();
    let mut failed_seeds = Vec::new();
    for seed in base..base.saturating_add(count) {
        let kind = kind.unwrap_or_else(|| ExportKind::of_seed(seed));
        let res = catch_unwind(AssertUnwindSafe(|| run_seed(seed, kind, &log)));
        let err = match res {
            Ok((t, r)) => {
                totals.add(&t);
                if keep_going {
                    let outcome = if r.is_ok() { "ok" } else { "FAILED" };
                    eprintln!(
                        "sim_flush: seed {seed} ({}): {} ops, {outcome}",
                        kind.name(),
                        t.ops
                    );
                }
                match r {
                    Ok(()) => {
                        if print_schedules {
                            eprintln!("{}", log.schedule());
                        }
                        continue;
                    }
                    Err(e) => e,
                }
            }
            Err(p) => {
                let msg = p
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                format!("panicked: {msg}")
            }
        };
        if keep_going {
            let schedule = log.schedule();
            let lines: Vec<&str> = schedule.lines().collect();
            eprintln!(
                "sim_flush: seed {seed} ({} export) failed: {err}\nschedule (its start and its \
                 last 40 steps):\n{}\n...\n{}\n",
                kind.name(),
                lines.first().copied().unwrap_or_default(),
                lines[lines.len().saturating_sub(40)..].join("\n")
            );
            failed_seeds.push(seed);
            continue;
        }
        panic!(
            "sim_flush: seed {seed} ({} export) failed: {err}\n\
             replay: SIM_KIND={} SIM_SEEDS=1 SIM_SEED_BASE={seed} cargo test --release -p nbd \
             --test sim_flush\nschedule:\n{}",
            kind.name(),
            kind.name(),
            log.schedule()
        );
    }
    eprintln!(
        "sim_flush: {} seeds from {base}, {} ops in {:.1?}: {} writes, {} flushes ok, {} \
         failed, {} reads, {} injected failures ({} FAST_ZERO refusals), {} sticky episodes, {} vanished clients, {} \
         crashes ({} power cycles), {} clean restarts, {} sectors verified after crashes",
        totals.seeds,
        totals.ops,
        started.elapsed(),
        totals.writes,
        totals.flushes_ok,
        totals.flushes_failed,
        totals.reads,
        totals.injected,
        totals.fast_zero_refused,
        totals.sticky_episodes,
        totals.vanished,
        totals.crashes,
        totals.power_cycles,
        totals.restarts,
        totals.sectors_verified
    );
    eprintln!(
        "sim_flush: of which {} raid1 seeds, {} ops: {} leg rules armed, {} leg I/Os failed, \
         {} requests the array failed, {} leg changes, {} clean reassemblies, {} reads changed by \
         a double failure",
        totals.mirror_seeds,
        totals.mirror_ops,
        totals.leg_rules,
        totals.leg_ios_failed,
        totals.array_errors,
        totals.leg_changes,
        totals.reassemblies,
        totals.flips
    );
    assert!(
        failed_seeds.is_empty(),
        "sim_flush: {} seed(s) failed: {failed_seeds:?}",
        failed_seeds.len()
    );
    totals
}

fn env_u64(name: &str) -> Option<u64> {
    let v = std::env::var(name).ok()?;
    match v.trim().parse() {
        Ok(n) => Some(n),
        Err(e) => panic!("{name}={v:?}: {e}"),
    }
}

/// `SIM_KIND`: `fault` or `raid1` runs every seed as that kind; unset (or `mixed`), each
/// seed's own.
fn env_kind() -> Option<ExportKind> {
    match std::env::var("SIM_KIND").ok()?.trim() {
        "fault" => Some(ExportKind::Fault),
        "raid1" => Some(ExportKind::Raid1),
        "" | "mixed" => None,
        v => panic!("SIM_KIND={v:?}: fault, raid1 or mixed"),
    }
}

#[test]
fn durability_rules_hold_for_seeded_schedules() {
    let base = env_u64("SIM_SEED_BASE").unwrap_or(DEFAULT_SEED_BASE);
    let count = env_u64("SIM_SEEDS").unwrap_or(DEFAULT_SEEDS);
    let kind = env_kind();
    let t = run_seeds(base, count, kind);
    assert_eq!(t.seeds, count);
    if kind.is_none() && count >= 8 {
        assert!(
            t.mirror_seeds > 0 && t.mirror_seeds < t.seeds,
            "both kinds of export run"
        );
    }
}

/// Seed 13 found it: a `FAST_ZERO` write-zeroes that the device refused with `ENOTSUP` (it
/// cannot zero fast, so it wrote nothing, as the flag asks) marked the export failed, and
/// every later FLUSH and FUA write failed with EIO.
#[test]
fn seed_13_a_refused_fast_zero_is_no_failed_write_back() {
    run_seeds(13, 1, Some(ExportKind::Fault));
}
