//! `blkq raid`: create, inspect and drive RAID1 arrays (crate `raid1`).
//!
//! Offline, the commands take the legs (device specs such as `file:/srv/a.img`) and read
//! their superblocks and bitmaps directly: `status`, `detail` and `assemble` never write.
//! Online (`--control PATH`), they send one line to the control socket of a running
//! `blkq serve --raid1 ... --control PATH` (see [`crate::control`]) and render its JSON reply.
//!
//! Legs are matched to slots by their superblocks (array UUID, leg UUID, role), never by the
//! order they are given in.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use blk::{Bio, Buffer, Device, EndIo, Op, SECTOR_SHIFT};
use blk_drivers::spec::{parse_size, DeviceSpec, QueueOverrides};
use blkq_sync::{Arc, Mutex};
use clap::{Args, Subcommand};
use raid1::superblock::{ArrayState, Role, Superblock, SuperblockError, SB_OFFSET, SB_SIZE};
use raid1::{Raid1, Raid1Config, WriteIntentBitmap};
use serde::{Deserialize, Serialize};
use waitq::Completion;

/// `blkq raid` options.
#[derive(Args, Debug)]
pub struct RaidArgs {
    #[command(subcommand)]
    cmd: RaidCmd,
}

#[derive(Subcommand, Debug)]
enum RaidCmd {
    /// Create an array: write superblocks and an empty bitmap on every leg (legs must be
    /// blank, i.e. carry no raid1 superblock, unless --force).
    Create(CreateArgs),
    /// Check that legs form one array and report what `serve --raid1` would serve
    /// (array UUID, legs by role, stale or foreign legs). Writes nothing.
    Assemble(LegArgs),
    /// mdstat-like summary: [UU] / [U_], bitmap, resync progress.
    Status(QueryArgs),
    /// Per-leg state, events, UUIDs, roles, write-mostly.
    Detail(QueryArgs),
    /// Read every leg and count mismatches (md's `check`).
    Check(QueryArgs),
    /// Like check, and rewrite the other legs from the first in-sync leg (md's `repair`).
    Repair(QueryArgs),
    /// Online: mark slot N faulty.
    Fail(SlotArgs),
    /// Online: take a faulty or recovering leg out of slot N.
    Remove(SlotArgs),
    /// Online: add a leg (device spec) into an empty slot; recovery copies the data to it.
    Add(AddArgs),
    /// Online: replace the leg in slot N by a new one (copied while N still serves).
    Replace(ReplaceArgs),
    /// Online: stop a running check/repair and unfreeze (md's `idle`).
    Idle(ControlArg),
    /// Online: resync speed limits in KiB/s (md's sync_speed_min/max).
    SpeedLimit(SpeedArgs),
}

#[derive(Args, Debug)]
struct CreateArgs {
    /// Legs: device specs (file:PATH, mem:SIZE, ...), at least two.
    #[arg(required = true, num_args = 2..)]
    legs: Vec<String>,
    /// Write-intent bitmap chunk size (e.g. 64M; `none`: no bitmap).
    #[arg(long, value_name = "SIZE")]
    bitmap_chunk: Option<String>,
    /// Mark this leg (its spec as given, or its position from 0) write-mostly (repeatable).
    #[arg(long, value_name = "LEG")]
    write_mostly: Vec<String>,
    /// Barrier implementation for this run: locked or lockless (a run-time choice; serve
    /// takes it as `--raid1-option barrier=...`).
    #[arg(long)]
    barrier: Option<String>,
    /// Overwrite legs that already carry a raid1 superblock.
    #[arg(long)]
    force: bool,
}

#[derive(Args, Debug)]
struct LegArgs {
    /// Legs: device specs, in any order.
    #[arg(required = true)]
    legs: Vec<String>,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Args, Debug)]
struct QueryArgs {
    /// Legs (offline); or use --control.
    legs: Vec<String>,
    /// Control socket of a running `blkq serve --raid1`.
    #[arg(long, value_name = "PATH")]
    control: Option<PathBuf>,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Args, Debug)]
struct ControlArg {
    /// Control socket of a running `blkq serve --raid1`.
    #[arg(long, value_name = "PATH", required = true)]
    control: PathBuf,
}

#[derive(Args, Debug)]
struct SlotArgs {
    /// Slot number (see `blkq raid detail`).
    slot: usize,
    /// Control socket of a running `blkq serve --raid1`.
    #[arg(long, value_name = "PATH", required = true)]
    control: PathBuf,
}

#[derive(Args, Debug)]
struct AddArgs {
    /// The new leg: a device spec.
    spec: String,
    /// Control socket of a running `blkq serve --raid1`.
    #[arg(long, value_name = "PATH", required = true)]
    control: PathBuf,
}

#[derive(Args, Debug)]
struct ReplaceArgs {
    /// Slot of the leg to replace.
    slot: usize,
    /// The new leg: a device spec.
    spec: String,
    /// Control socket of a running `blkq serve --raid1`.
    #[arg(long, value_name = "PATH", required = true)]
    control: PathBuf,
}

#[derive(Args, Debug)]
struct SpeedArgs {
    /// Minimum, KiB/s.
    min: u64,
    /// Maximum, KiB/s.
    max: u64,
    /// Control socket of a running `blkq serve --raid1`.
    #[arg(long, value_name = "PATH", required = true)]
    control: PathBuf,
}

// ---------------------------------------------------------------------------------------
// The report: what `status`/`detail` print, offline and online alike (also the JSON).

/// The state of one slot, as reported.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct LegReport {
    /// Slot number.
    pub slot: usize,
    /// The leg's device spec, when known.
    pub device: Option<String>,
    /// `in_sync`, `recovering`, `faulty`, `stale`, `missing` or `empty`.
    pub state: String,
    /// The leg's UUID (nil for an empty slot).
    pub uuid: String,
    /// Read only when nothing else can serve.
    pub write_mostly: bool,
    /// For a recovering leg: array bytes below this are in sync.
    pub recovery_offset: Option<u64>,
    /// The events count of the leg's own superblock (offline), or the array's (online).
    pub events: Option<u64>,
    /// Corrected read errors (online).
    pub read_errors: u32,
}

/// The write-intent bitmap, as reported.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct BitmapReport {
    /// Bytes per bit.
    pub chunk_size: u64,
    /// Bits.
    pub chunks: u64,
    /// Dirty bits (what a returning leg must copy).
    pub dirty: u64,
}

/// A resync/recovery/check in progress, as reported.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct SyncReport {
    /// md's name: `resync`, `recover`, `check`, `repair`, `idle`, `frozen`.
    pub action: String,
    /// Bytes done.
    pub done_bytes: u64,
    /// Bytes to do.
    pub total_bytes: u64,
    /// Current speed.
    pub speed_kib_s: u64,
    /// Estimated seconds left.
    pub eta_secs: Option<u64>,
    /// Mismatches found by check/repair.
    pub mismatch_cnt: u64,
}

/// The whole array, as reported.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ArrayReport {
    /// Array UUID.
    pub array_uuid: String,
    /// `clean`, `active` or `degraded`.
    pub state: String,
    /// Events of the newest superblock.
    pub events: u64,
    /// Array bytes.
    pub capacity: u64,
    /// Where data starts on every leg.
    pub data_offset: u64,
    /// Member slots (md's raid_disks): what `[UU]` has one character for.
    pub raid_disks: usize,
    /// Every slot (members first, then spare slots).
    pub legs: Vec<LegReport>,
    /// The bitmap, if the array has one.
    pub bitmap: Option<BitmapReport>,
    /// A sync action in progress (online only).
    pub sync: Option<SyncReport>,
    /// Notes for the user (stale legs, legs left out, ...).
    pub notes: Vec<String>,
}

impl ArrayReport {
    /// md's `[UU_]` string: one character per leg in a slot, in slot order (`U` in sync,
    /// `_` otherwise), then `_` for each member missing (up to `raid_disks`).
    pub fn mdstat_legs(&self) -> String {
        let mut s: String = self
            .legs
            .iter()
            .filter(|l| l.state != "empty")
            .map(|l| if l.state == "in_sync" { 'U' } else { '_' })
            .collect();
        while s.len() < self.raid_disks {
            s.push('_');
        }
        format!("[{s}]")
    }

    fn in_sync(&self) -> usize {
        self.legs.iter().filter(|l| l.state == "in_sync").count()
    }

    /// The mdstat-like text of `blkq raid status`.
    pub fn render_status(&self) -> String {
        let mut o = String::new();
        let members: Vec<String> = self
            .legs
            .iter()
            .filter(|l| l.state != "empty")
            .map(|l| {
                let mut s = format!("{}[{}]", l.device.as_deref().unwrap_or("?"), l.slot);
                if l.write_mostly {
                    s.push_str("(W)");
                }
                match l.state.as_str() {
                    "faulty" => s.push_str("(F)"),
                    "stale" => s.push_str("(S)"),
                    "missing" => s.push_str("(M)"),
                    _ => {}
                }
                s
            })
            .collect();
        o.push_str(&format!(
            "raid1 : {} raid1 {}\n",
            if self.state == "degraded" {
                "active (degraded)"
            } else {
                "active"
            },
            members.join(" ")
        ));
        o.push_str(&format!(
            "      {} blocks [{}/{}] {}\n",
            self.capacity / 1024,
            self.raid_disks,
            self.in_sync(),
            self.mdstat_legs()
        ));
        if let Some(s) = &self.sync {
            if s.action != "idle" && s.total_bytes > 0 {
                o.push_str(&format!("      {}\n", progress_line(s)));
            }
        }
        match &self.bitmap {
            Some(b) => o.push_str(&format!(
                "      bitmap: {}/{} chunks dirty, {}KB chunk\n",
                b.dirty,
                b.chunks,
                b.chunk_size / 1024
            )),
            None => o.push_str("      bitmap: none\n"),
        }
        o.push_str(&format!("      uuid: {}\n", self.array_uuid));
        for n in &self.notes {
            o.push_str(&format!("      note: {n}\n"));
        }
        o
    }

    /// The text of `blkq raid detail`.
    pub fn render_detail(&self) -> String {
        let mut o = String::new();
        o.push_str(&format!("        Array UUID : {}\n", self.array_uuid));
        o.push_str(&format!("             State : {}\n", self.state));
        o.push_str(&format!("            Events : {}\n", self.events));
        o.push_str(&format!(
            "        Array Size : {} bytes ({} MiB)\n",
            self.capacity,
            self.capacity >> 20
        ));
        o.push_str(&format!(
            "       Data Offset : {} bytes\n",
            self.data_offset
        ));
        o.push_str(&format!(
            "      Raid Devices : {} ({} in sync)\n",
            self.raid_disks,
            self.in_sync()
        ));
        match &self.bitmap {
            Some(b) => o.push_str(&format!(
                "            Bitmap : {} KiB chunks, {} of {} dirty\n",
                b.chunk_size / 1024,
                b.dirty,
                b.chunks
            )),
            None => o.push_str("            Bitmap : none\n"),
        }
        if let Some(s) = &self.sync {
            o.push_str(&format!("       Sync Action : {}\n", s.action));
            if s.action != "idle" && s.total_bytes > 0 {
                o.push_str(&format!("     Sync Progress : {}\n", progress_line(s)));
            }
            o.push_str(&format!("      Mismatch Cnt : {}\n", s.mismatch_cnt));
        }
        o.push_str(
            "\n    Slot  State           Events  WM  Leg UUID                              Device\n",
        );
        for l in &self.legs {
            let mut state = l.state.clone();
            if let Some(r) = l.recovery_offset {
                if l.state == "recovering" {
                    state = format!("recovering@{}", r);
                }
            }
            o.push_str(&format!(
                "    {:>4}  {:<14}  {:>6}  {:<2}  {:<36}  {}\n",
                l.slot,
                state,
                l.events.map_or("-".to_string(), |e| e.to_string()),
                if l.write_mostly { "W" } else { "-" },
                l.uuid,
                l.device.as_deref().unwrap_or("-")
            ));
        }
        for n in &self.notes {
            o.push_str(&format!("    note: {n}\n"));
        }
        o
    }
}

/// md's progress line: `[=====>...............]  recovery = 27.3% (x/y) finish=1.2min
/// speed=10240K/sec`.
pub fn progress_line(s: &SyncReport) -> String {
    const WIDTH: u64 = 20;
    let per_mille = (s.done_bytes.min(s.total_bytes) as u128 * 1000)
        .checked_div(s.total_bytes as u128)
        .unwrap_or(0) as u64;
    let filled = per_mille * WIDTH / 1000;
    let mut bar = String::with_capacity(WIDTH as usize + 2);
    bar.push('[');
    for i in 0..WIDTH {
        bar.push(if i < filled {
            '='
        } else if i == filled {
            '>'
        } else {
            '.'
        });
    }
    bar.push(']');
    let finish = s
        .eta_secs
        .map_or("?".to_string(), |e| format!("{:.1}min", e as f64 / 60.0));
    format!(
        "{bar}  {} = {}.{}% ({}/{}) finish={finish} speed={}K/sec",
        s.action,
        per_mille / 10,
        per_mille % 10,
        s.done_bytes / 1024,
        s.total_bytes / 1024,
        s.speed_kib_s
    )
}

// ---------------------------------------------------------------------------------------
// Legs and their superblocks.

/// Splits `--raid1`'s `LEG,LEG[,...]`: a part that starts with a device kind (`file:`,
/// `mem:`, `null:`) begins a leg; any other part (`key=value`) is an option of the leg before.
pub fn split_legs(s: &str) -> Result<Vec<String>> {
    let mut legs: Vec<String> = Vec::new();
    for part in s.split(',').filter(|p| !p.is_empty()) {
        let starts_leg = ["file:", "mem:", "null:"]
            .iter()
            .any(|k| part.starts_with(k));
        if starts_leg {
            legs.push(part.to_string());
        } else if let Some(last) = legs.last_mut() {
            last.push(',');
            last.push_str(part);
        } else {
            bail!("--raid1 {s:?}: {part:?} is not a device spec (expected file:PATH, mem:SIZE or null:SIZE)");
        }
    }
    if legs.len() < 2 {
        bail!("--raid1 {s:?}: a mirror needs at least two legs, comma-separated (e.g. file:/srv/a.img,file:/srv/b.img)");
    }
    Ok(legs)
}

/// Opens a leg from its device spec.
pub fn open_leg(spec: &str, ov: &QueueOverrides) -> Result<Arc<dyn Device>> {
    let parsed: DeviceSpec = spec
        .parse()
        .with_context(|| format!("leg {spec:?}: bad device spec"))?;
    let q = parsed
        .build(ov)
        .with_context(|| format!("leg {spec:?}: cannot open it"))?;
    Ok(Arc::new(q))
}

/// Completion of one synchronous read.
struct ReadEnd {
    done: Completion,
    out: Mutex<Option<(Bio, Result<(), blk::Error>)>>,
}

impl EndIo for ReadEnd {
    fn end_io(&self, bio: Bio, res: Result<(), blk::Error>) {
        *self.out.lock() = Some((bio, res));
        self.done.complete();
    }
}

/// Reads `len` bytes at byte `offset` of `dev` (a slow path: allocates).
pub fn read_at(dev: &dyn Device, offset: u64, len: usize) -> Result<Vec<u8>> {
    let end = Arc::new(ReadEnd {
        done: Completion::new(),
        out: Mutex::new(None),
    });
    let e: Arc<dyn EndIo> = end.clone();
    dev.submit(
        Bio::with_buf(Op::Read, offset >> SECTOR_SHIFT, Buffer::new(len)),
        &e,
    );
    if !end.done.wait_timeout(Duration::from_secs(30)) {
        bail!("read of {len} bytes at {offset} timed out");
    }
    let (bio, res) = end
        .out
        .lock()
        .take()
        .ok_or_else(|| anyhow!("read completed without a result"))?;
    res.map_err(|e| anyhow!("read of {len} bytes at {offset}: {e}"))?;
    let buf = bio.buf.ok_or_else(|| anyhow!("read returned no data"))?;
    Ok(buf.as_slice().to_vec())
}

/// What a leg carries at its superblock's place.
#[derive(Debug)]
pub enum Probe {
    /// A valid raid1 superblock.
    Member(Box<Superblock>),
    /// No superblock: never formatted (or not a blkq raid1 leg).
    Blank,
    /// A superblock that does not decode (corrupt, or a newer format).
    Corrupt(SuperblockError),
}

/// Reads and decodes a leg's superblock.
pub fn probe(dev: &dyn Device) -> Result<Probe> {
    let b = read_at(dev, SB_OFFSET, SB_SIZE)?;
    Ok(match Superblock::decode(&b) {
        Ok(sb) => Probe::Member(Box::new(sb)),
        Err(SuperblockError::BadMagic) => Probe::Blank,
        Err(e) => Probe::Corrupt(e),
    })
}

/// One leg as given and what it holds.
pub struct Found {
    /// Its spec.
    pub spec: String,
    /// Its device.
    pub dev: Arc<dyn Device>,
    /// Its superblock.
    pub sb: Superblock,
}

/// The result of checking a set of legs: they form one array (errors otherwise).
pub struct Plan {
    /// The legs, in the order given.
    pub legs: Vec<Found>,
    /// The newest superblock.
    pub newest: Superblock,
}

/// Opens and probes `specs`. `Ok(None)`: every leg is blank (a new array).
pub fn plan(specs: &[String], ov: &QueueOverrides) -> Result<Option<Plan>> {
    let mut opened = Vec::new();
    for spec in specs {
        let dev = open_leg(spec, ov)?;
        let p =
            probe(dev.as_ref()).with_context(|| format!("leg {spec:?}: reading its superblock"))?;
        opened.push((spec.clone(), dev, p));
    }
    if opened.iter().all(|(_, _, p)| matches!(p, Probe::Blank)) {
        return Ok(None);
    }
    let mut legs = Vec::new();
    for (spec, dev, p) in opened {
        match p {
            Probe::Member(sb) => legs.push(Found {
                spec,
                dev,
                sb: *sb,
            }),
            Probe::Blank => bail!(
                "leg {spec:?} carries no raid1 superblock while the other legs do: it is blank or not a blkq raid1 leg. \
                 Leave it out to assemble the array, then add it with `blkq raid add --control PATH {spec}`"
            ),
            Probe::Corrupt(e) => bail!(
                "leg {spec:?}: its raid1 superblock is unreadable ({e}). Leave it out to assemble from the others, \
                 then add it back with `blkq raid add`"
            ),
        }
    }
    let newest = legs
        .iter()
        .max_by_key(|f| f.sb.events)
        .map(|f| f.sb.clone())
        .ok_or_else(|| anyhow!("no legs"))?;
    // The array is the one most legs belong to (ties: the newest superblock's).
    let count = |u: &raid1::superblock::Superblock| {
        legs.iter()
            .filter(|f| f.sb.array_uuid == u.array_uuid)
            .count()
    };
    let main = legs
        .iter()
        .map(|f| &f.sb)
        .max_by_key(|sb| (count(sb), sb.array_uuid == newest.array_uuid))
        .cloned()
        .ok_or_else(|| anyhow!("no legs"))?;
    let newest = legs
        .iter()
        .filter(|f| f.sb.array_uuid == main.array_uuid)
        .max_by_key(|f| f.sb.events)
        .map(|f| f.sb.clone())
        .unwrap_or(main);
    if let Some(f) = legs.iter().find(|f| f.sb.array_uuid != newest.array_uuid) {
        let ours: Vec<&str> = legs
            .iter()
            .filter(|g| g.sb.array_uuid == newest.array_uuid)
            .map(|g| g.spec.as_str())
            .collect();
        bail!(
            "leg {:?} belongs to another array (array UUID {}) than {} (array UUID {}): \
             refusing a mixed set. Give only the legs of one array",
            f.spec,
            f.sb.array_uuid,
            ours.join(", "),
            newest.array_uuid
        );
    }
    for (i, a) in legs.iter().enumerate() {
        for b in &legs[i + 1..] {
            if a.sb.leg_uuid == b.sb.leg_uuid {
                bail!(
                    "legs {:?} and {:?} are the same leg (leg UUID {}): give each leg once",
                    a.spec,
                    b.spec,
                    a.sb.leg_uuid
                );
            }
        }
    }
    Ok(Some(Plan { legs, newest }))
}

fn array_state_name(s: ArrayState) -> &'static str {
    match s {
        ArrayState::Clean => "clean",
        ArrayState::Active => "active",
        ArrayState::Degraded => "degraded",
    }
}

impl Plan {
    /// The slot a leg takes, if any (its superblock's role, confirmed by the newest
    /// superblock's slot table).
    fn slot_of(&self, f: &Found) -> Option<usize> {
        let Role::Slot(n) = f.sb.role else {
            return None;
        };
        let n = n as usize;
        self.newest
            .legs
            .get(n)
            .filter(|l| l.uuid == f.sb.leg_uuid)
            .map(|_| n)
    }

    /// The offline report: what assembling these legs gives.
    pub fn report(&self) -> Result<ArrayReport> {
        let nb = &self.newest;
        let mut notes = Vec::new();
        let mut legs = Vec::new();
        for (n, info) in nb.legs.iter().enumerate() {
            let here = self.legs.iter().find(|f| self.slot_of(f) == Some(n));
            let state = match here {
                _ if info.uuid.is_nil() => "empty",
                None => "missing",
                Some(_) if info.faulty => "faulty",
                Some(f) if f.sb.events < nb.events => "stale",
                Some(_) if info.in_sync => "in_sync",
                Some(_) => "recovering",
            };
            if let Some(f) = here {
                if f.sb.events < nb.events {
                    notes.push(format!(
                        "leg {:?} (slot {n}) is stale: events {} < {} of the newest superblock; \
                         it comes back recovering and is copied from the others",
                        f.spec, f.sb.events, nb.events
                    ));
                }
                if info.faulty {
                    notes.push(format!(
                        "leg {:?} (slot {n}) is marked faulty: it is not used; `blkq raid remove` then `add` to rebuild it",
                        f.spec
                    ));
                }
            } else if !info.uuid.is_nil() {
                notes.push(format!(
                    "slot {n} (leg UUID {}) is missing from the given legs: the array runs degraded",
                    info.uuid
                ));
            }
            legs.push(LegReport {
                slot: n,
                device: here.map(|f| f.spec.clone()),
                state: state.to_string(),
                uuid: info.uuid.to_string(),
                write_mostly: info.write_mostly,
                recovery_offset: info.recovery_offset,
                events: here.map(|f| f.sb.events),
                read_errors: 0,
            });
        }
        for f in &self.legs {
            if self.slot_of(f).is_none() {
                notes.push(format!(
                    "leg {:?} holds no slot of this array any more (a spare, or replaced since): it is ignored",
                    f.spec
                ));
            }
        }
        let raid_disks = nb.legs.iter().filter(|l| !l.uuid.is_nil()).count();
        let bitmap = if nb.bitmap.chunk_size == 0 {
            None
        } else {
            let bm = WriteIntentBitmap::new(nb.data_size, nb.bitmap.chunk_size)
                .map_err(|e| anyhow!("bitmap: {e}"))?;
            // The union of the bitmaps of the legs that are in use.
            for f in &self.legs {
                if self.slot_of(f).is_some() {
                    if let Ok(b) = read_at(f.dev.as_ref(), nb.bitmap.offset, bm.disk_len()) {
                        let _ = bm.load(&b);
                    }
                }
            }
            let dirty = bm.dirty_chunks().iter().map(|c| c.end - c.first).sum();
            Some(BitmapReport {
                chunk_size: bm.chunk_size(),
                chunks: bm.nr_chunks(),
                dirty,
            })
        };
        let in_sync = legs.iter().filter(|l| l.state == "in_sync").count();
        let state = if in_sync < raid_disks {
            "degraded"
        } else {
            array_state_name(nb.array_state)
        };
        Ok(ArrayReport {
            array_uuid: nb.array_uuid.to_string(),
            state: state.to_string(),
            events: nb.events,
            capacity: nb.data_size,
            data_offset: nb.data_offset,
            raid_disks,
            legs,
            bitmap,
            sync: None,
            notes,
        })
    }
}

/// The devices of a plan, for [`Raid1::assemble`].
pub fn plan_devices(p: &Plan) -> Vec<Arc<dyn Device>> {
    p.legs.iter().map(|f| f.dev.clone()).collect()
}

/// Opens `specs` and plans: an error (anyhow, naming the leg) unless they form one array.
fn offline_plan(specs: &[String]) -> Result<Plan> {
    plan(specs, &QueueOverrides::default())?.ok_or_else(|| {
        anyhow!(
            "no leg carries a raid1 superblock: create the array first with `blkq raid create {}`",
            specs.join(" ")
        )
    })
}

/// Parses `--bitmap-chunk`.
fn bitmap_chunk(s: &str) -> Result<u64> {
    if s == "none" || s == "0" {
        return Ok(0);
    }
    parse_size(s).with_context(|| format!("--bitmap-chunk {s:?}"))
}

fn create(a: CreateArgs) -> Result<()> {
    let ov = QueueOverrides::default();
    let mut devs = Vec::new();
    for spec in &a.legs {
        let dev = open_leg(spec, &ov)?;
        match probe(dev.as_ref()).with_context(|| format!("leg {spec:?}: reading it"))? {
            Probe::Blank => {}
            Probe::Member(sb) if !a.force => bail!(
                "leg {spec:?} already carries a raid1 superblock (array {}, events {}): \
                 use `blkq raid assemble` to use that array, or --force to overwrite it",
                sb.array_uuid,
                sb.events
            ),
            Probe::Corrupt(e) if !a.force => bail!(
                "leg {spec:?} carries a damaged raid1 superblock ({e}): --force to overwrite it"
            ),
            _ => {}
        }
        devs.push(dev);
    }
    let mut cfg = Raid1Config::default();
    if let Some(c) = &a.bitmap_chunk {
        cfg.bitmap_chunk = bitmap_chunk(c)?;
    }
    if let Some(b) = &a.barrier {
        cfg.set_option("barrier", b).context("--barrier")?;
    }
    let mut wm = Vec::new();
    for w in &a.write_mostly {
        let i = match a.legs.iter().position(|l| l == w) {
            Some(i) => i,
            None => w.parse::<usize>().ok().filter(|&i| i < a.legs.len()).ok_or_else(|| {
                anyhow!("--write-mostly {w:?}: not one of the legs (give its spec as in the leg list, or its position from 0)")
            })?,
        };
        wm.push(i);
    }
    let r = Raid1::create(devs, cfg).context("creating the array")?;
    for i in wm {
        r.set_write_mostly(i, true)
            .with_context(|| format!("--write-mostly: slot {i}"))?;
    }
    r.sync_superblocks().context("writing the superblocks")?;
    drop(r);
    let p = offline_plan(&a.legs)?;
    let rep = p.report()?;
    println!(
        "created raid1 array {} over {} legs: {} bytes",
        rep.array_uuid,
        a.legs.len(),
        rep.capacity
    );
    print!("{}", rep.render_detail());
    println!("serve it with: blkq serve --raid1 {}", a.legs.join(","));
    Ok(())
}

fn assemble(a: LegArgs) -> Result<()> {
    let p = offline_plan(&a.legs)?;
    let rep = p.report()?;
    if !rep.legs.iter().any(|l| l.state == "in_sync") {
        bail!("no in-sync leg among the given legs: the array cannot be assembled");
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&rep)?);
        return Ok(());
    }
    println!(
        "array {}: would serve {} bytes from {} of {} legs ({})",
        rep.array_uuid,
        rep.capacity,
        rep.in_sync(),
        rep.raid_disks,
        rep.mdstat_legs()
    );
    for l in &rep.legs {
        if l.state == "empty" {
            continue;
        }
        println!(
            "  slot {}: {:<10} {}",
            l.slot,
            l.state,
            l.device.as_deref().unwrap_or("(not given)")
        );
    }
    for n in &rep.notes {
        println!("  note: {n}");
    }
    Ok(())
}

/// Sends one command line to a control socket; returns the JSON reply's body, or the error
/// the server reported.
pub fn control_request(path: &Path, line: &str) -> Result<serde_json::Value> {
    let reply = crate::control::request(path, line).with_context(|| {
        format!(
            "control socket {}: is `blkq serve --raid1 ... --control {}` running?",
            path.display(),
            path.display()
        )
    })?;
    let v: serde_json::Value = serde_json::from_str(reply.trim())
        .with_context(|| format!("control socket {}: bad reply {reply:?}", path.display()))?;
    if v.get("ok").and_then(|o| o.as_bool()) != Some(true) {
        let e = v
            .get("error")
            .and_then(|e| e.as_str())
            .unwrap_or("unknown error");
        bail!("{e}");
    }
    Ok(v)
}

fn online_report(path: &Path, cmd: &str) -> Result<ArrayReport> {
    let v = control_request(path, cmd)?;
    let r = v
        .get("report")
        .cloned()
        .ok_or_else(|| anyhow!("control reply without a report"))?;
    Ok(serde_json::from_value(r)?)
}

fn query(q: QueryArgs, detail: bool) -> Result<()> {
    let rep = match (&q.control, q.legs.is_empty()) {
        (Some(p), true) => online_report(p, if detail { "detail" } else { "status" })?,
        (None, false) => offline_plan(&q.legs)?.report()?,
        (Some(_), false) => {
            bail!("give either --control PATH (a running server) or the legs, not both")
        }
        (None, true) => {
            bail!("give the legs (e.g. file:/srv/a.img file:/srv/b.img) or --control PATH")
        }
    };
    if q.json {
        println!("{}", serde_json::to_string_pretty(&rep)?);
    } else if detail {
        print!("{}", rep.render_detail());
    } else {
        print!("{}", rep.render_status());
    }
    Ok(())
}

fn simple(path: &Path, line: &str) -> Result<()> {
    let v = control_request(path, line)?;
    if let Some(m) = v.get("message").and_then(|m| m.as_str()) {
        println!("{m}");
    }
    Ok(())
}

/// Runs `blkq raid`.
pub fn run(a: RaidArgs) -> Result<()> {
    match a.cmd {
        RaidCmd::Create(c) => create(c),
        RaidCmd::Assemble(l) => assemble(l),
        RaidCmd::Status(q) => query(q, false),
        RaidCmd::Detail(q) => query(q, true),
        RaidCmd::Check(q) => sync_action(q, "check"),
        RaidCmd::Repair(q) => sync_action(q, "repair"),
        RaidCmd::Fail(s) => simple(&s.control, &format!("fail {}", s.slot)),
        RaidCmd::Remove(s) => simple(&s.control, &format!("remove {}", s.slot)),
        RaidCmd::Add(s) => simple(&s.control, &format!("add {}", s.spec)),
        RaidCmd::Replace(s) => simple(&s.control, &format!("replace {} {}", s.slot, s.spec)),
        RaidCmd::Idle(c) => simple(&c.control, "idle"),
        RaidCmd::SpeedLimit(s) => simple(&s.control, &format!("speed-limit {} {}", s.min, s.max)),
    }
}

fn sync_action(q: QueryArgs, action: &str) -> Result<()> {
    match (&q.control, q.legs.is_empty()) {
        (Some(p), true) => simple(p, action),
        (None, false) => offline_sync(&q.legs, action, q.json),
        (Some(_), false) => {
            bail!("give either --control PATH (a running server) or the legs, not both")
        }
        (None, true) => {
            bail!("give the legs (e.g. file:/srv/a.img file:/srv/b.img) or --control PATH")
        }
    }
}

fn offline_sync(legs: &[String], action: &str, json: bool) -> Result<()> {
    let p = offline_plan(legs)?;
    let a: raid1::SyncAction = action.parse().map_err(|e| anyhow!("{e}"))?;
    let r = Raid1::assemble(plan_devices(&p), Raid1Config::default())
        .context("assembling the array")?;
    // A needed resync/recovery runs first (check is refused meanwhile): wait for it.
    let mut started = false;
    for _ in 0..600 {
        match r.set_sync_action(a) {
            Ok(()) => {
                started = true;
                break;
            }
            Err(_) => {
                r.wait_sync_idle(Duration::from_millis(500));
            }
        }
    }
    if !started {
        bail!("{action} refused: a resync or recovery is still running; try again later");
    }
    let tty = std::io::IsTerminal::is_terminal(&std::io::stderr());
    loop {
        if r.wait_sync_idle(Duration::from_millis(500)) {
            break;
        }
        if tty {
            let pr = r.sync_progress();
            eprint!(
                "\r{}",
                progress_line(&SyncReport {
                    action: pr.action.to_string(),
                    done_bytes: pr.done_bytes,
                    total_bytes: pr.total_bytes,
                    speed_kib_s: pr.speed_kib_s,
                    eta_secs: pr.eta_secs,
                    mismatch_cnt: pr.mismatch_cnt,
                })
            );
        }
    }
    if tty {
        eprintln!();
    }
    let pr = r.sync_progress();
    if json {
        println!(
            "{}",
            serde_json::json!({ "action": action, "mismatch_cnt": pr.mismatch_cnt, "bytes": pr.total_bytes })
        );
    } else {
        println!("{action}: done, mismatch_cnt = {}", pr.mismatch_cnt);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn legs_split_with_their_options() {
        assert_eq!(
            split_legs("file:/a.img,direct=1,file:/b.img").unwrap(),
            vec!["file:/a.img,direct=1", "file:/b.img"]
        );
        assert_eq!(split_legs("mem:64M,mem:64M,mem:64M").unwrap().len(), 3);
        assert!(split_legs("file:/a.img").is_err());
        assert!(split_legs("direct=1,file:/a.img,file:/b").is_err());
    }

    fn leg(slot: usize, state: &str) -> LegReport {
        LegReport {
            slot,
            device: None,
            state: state.into(),
            uuid: String::new(),
            write_mostly: false,
            recovery_offset: None,
            events: None,
            read_errors: 0,
        }
    }

    #[test]
    fn mdstat_legs_one_char_per_member() {
        let mut r = ArrayReport {
            array_uuid: String::new(),
            state: "active".into(),
            events: 1,
            capacity: 0,
            data_offset: 0,
            raid_disks: 2,
            legs: vec![leg(0, "in_sync"), leg(1, "in_sync"), leg(2, "empty")],
            bitmap: None,
            sync: None,
            notes: vec![],
        };
        assert_eq!(r.mdstat_legs(), "[UU]");
        r.legs[1].state = "faulty".into();
        assert_eq!(r.mdstat_legs(), "[U_]");
        r.legs[1].state = "empty".into();
        assert_eq!(r.mdstat_legs(), "[U_]");
        r.legs[2].state = "in_sync".into();
        assert_eq!(r.mdstat_legs(), "[UU]");
        r.legs[0].state = "recovering".into();
        assert_eq!(r.mdstat_legs(), "[_U]");
    }

    #[test]
    fn progress_line_looks_like_md() {
        let s = SyncReport {
            action: "recover".into(),
            done_bytes: 50 << 20,
            total_bytes: 100 << 20,
            speed_kib_s: 1024,
            eta_secs: Some(90),
            mismatch_cnt: 0,
        };
        let l = progress_line(&s);
        assert!(
            l.starts_with("[==========>.........]  recover = 50.0%"),
            "{l}"
        );
        assert!(l.contains("finish=1.5min speed=1024K/sec"), "{l}");
    }
}
