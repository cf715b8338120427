//! Owns the `blkq raid` command line and its dispatch: create, inspect and drive RAID1
//! arrays (crate `raid1`).
//!
//! Offline, the commands take the legs (device specs such as `file:/srv/a.img`) and read
//! their superblocks and bitmaps directly: `status`, `detail` and `assemble` never write.
//! Online (`--control PATH`), they send one line to the control socket of a running
//! `blkq serve --raid1 ... --control PATH` (see [`crate::control`]) and render its JSON reply.
//!
//! Legs are matched to slots by their superblocks (array UUID, leg UUID, role), never by the
//! order they are given in. [`legs`] owns the legs read from disk, [`report`] the
//! status/detail report (and md's progress line), [`away`] the legs a served mirror started
//! without because they could not be opened.

pub mod away;
pub mod content;
pub mod create;
pub mod legs;
pub mod monitor;
pub mod report;

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use blk_drivers::spec::{parse_size, QueueOverrides};
use clap::{Args, Subcommand};
use raid1::{Raid1, Raid1Config};

use crate::control::client;
use crate::control::protocol::{Command, Leg};
use create::CreateRules;
use legs::{offline_plan, plan_devices};
use report::SyncReport;

/// `blkq raid` options.
#[derive(Args, Debug)]
pub struct RaidArgs {
    #[command(subcommand)]
    cmd: RaidCmd,
}

#[derive(Subcommand, Debug)]
enum RaidCmd {
    /// Create an array: write superblocks and a bitmap on every leg (legs must be blank: no
    /// raid1 superblock, no filesystem or partition signature, zeros where the superblock
    /// and bitmap go; unless --force) and mark a full resync from the first leg due (unless
    /// --assume-clean); it runs when the array is first assembled.
    Create(CreateArgs),
    /// Check that legs form one array and report what `serve --raid1` would serve
    /// (array UUID, legs by role, stale or foreign legs). Writes nothing.
    Assemble(LegArgs),
    /// mdstat-like summary: [UU] / [U_], bitmap, resync progress. Exits as `mdadm --detail
    /// --test`: 0 every leg in sync, 1 degraded, 2 failed, 4 no answer (no server, unreadable legs).
    Status(QueryArgs),
    /// Per-leg state, events, UUIDs, roles, write-mostly.
    Detail(QueryArgs),
    /// Read every leg and count mismatches (md's `check`).
    Check(QueryArgs),
    /// Like check, and rewrite the other legs from the first in-sync leg that is not
    /// write-mostly (md's `repair`).
    Repair(QueryArgs),
    /// Online: mark a leg faulty (by slot number or device spec).
    Fail(LegTarget),
    /// Online: take a faulty or recovering leg out of its slot (by slot number or device spec).
    Remove(LegTarget),
    /// Online: add a leg (device spec) into an empty slot; recovery copies the data to it.
    Add(AddCmd),
    /// Online: replace a leg (by slot number or device spec) by a new one (copied while the
    /// old one still serves).
    Replace(ReplaceArgs),
    /// Online: stop a running check/repair and unfreeze (md's `idle`).
    Idle(ControlArg),
    /// Online: resync speed limits in KiB/s (md's sync_speed_min/max).
    SpeedLimit(SpeedArgs),
    /// Online: print the array's events as they happen, a JSON line each (mdadm's
    /// --monitor): a leg failed, removed, added; recovery, resync and check progress; a
    /// refused re-add; the array failed. --program runs a program per event.
    Monitor(monitor::MonitorArgs),
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
    /// Overwrite legs that hold data: a raid1 superblock (another array's, or damaged), a
    /// filesystem or partition signature, or non-zero bytes where the superblock and bitmap
    /// go. What they held is lost.
    #[arg(long)]
    force: bool,
    /// Skip the initial resync: the legs are taken to agree as they are. For blank legs only
    /// (zeros throughout, such as new sparse files); on legs that differ, reads depend on
    /// which leg answers until a `repair`.
    #[arg(long)]
    assume_clean: bool,
    /// Use this much of each leg (superblock, bitmap and data; e.g. 10G): at most the
    /// smallest leg. Needed for legs of different sizes; the rest of a larger leg is unused.
    #[arg(long, value_name = "SIZE")]
    size: Option<String>,
    /// Keep a checksum per 4 KiB block on every leg (crc32c): reads are verified, a block
    /// that fails is read from another leg and rewritten, and `check` names the bad leg. The
    /// array's block size becomes 4096.
    #[arg(long, value_name = "ALGORITHM")]
    integrity: Option<String>,
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
    /// With --control: wait up to SECONDS for the control socket to exist and accept (a
    /// server started a moment ago) before sending.
    #[arg(long, value_name = "SECONDS", requires = "control")]
    wait: Option<u64>,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

/// Where a query goes: a running server, or the legs read offline.
enum Target<'a> {
    /// The control socket of a running `blkq serve --raid1`.
    Online(&'a Path),
    /// The legs' device specs.
    Offline(&'a [String]),
}

impl QueryArgs {
    /// `--control PATH` or the legs, exactly one of them.
    fn target(&self) -> Result<Target<'_>> {
        match (&self.control, self.legs.is_empty()) {
            (Some(p), true) => Ok(Target::Online(p)),
            (None, false) => Ok(Target::Offline(&self.legs)),
            (Some(_), false) => {
                bail!("give either --control PATH (a running server) or the legs, not both")
            }
            (None, true) => {
                bail!("give the legs (e.g. file:/srv/a.img file:/srv/b.img) or --control PATH")
            }
        }
    }
}

#[derive(Args, Debug)]
struct ControlArg {
    /// Control socket of a running `blkq serve --raid1`.
    #[arg(long, value_name = "PATH", required = true)]
    control: PathBuf,
    /// Wait up to SECONDS for the control socket to exist and accept (a server started a
    /// moment ago) before sending.
    #[arg(long, value_name = "SECONDS")]
    wait: Option<u64>,
}

#[derive(Args, Debug)]
struct LegTarget {
    /// The leg: its slot number (see `blkq raid detail`) or its device spec
    /// (file:/srv/b.img, as given or naming the same file).
    leg: Leg,
    #[command(flatten)]
    ctl: ControlArg,
}

#[derive(Args, Debug)]
struct AddArgs {
    /// The new leg: a device spec. It must be blank (no raid1 superblock, and zeros in its
    /// first 128 KiB, where filesystems and partition tables keep their signatures) or a
    /// former leg of this array, unless --force.
    spec: String,
    /// Overwrite a leg that holds data or a damaged raid1 superblock (never one of another
    /// array: zero its superblock first).
    #[arg(long)]
    force: bool,
    #[command(flatten)]
    ctl: ControlArg,
}

#[derive(Args, Debug)]
struct AddCmd {
    #[command(flatten)]
    new: AddArgs,
    /// Take a former leg of this array that ran without it (after a failover: its history
    /// diverged), discarding its writes since they parted: only the chunks either side
    /// changed are copied to it (the union of both sides' bitmaps).
    #[arg(long)]
    discard: bool,
}

#[derive(Args, Debug)]
struct ReplaceArgs {
    /// The leg to replace: its slot number or its device spec.
    leg: Leg,
    /// The new leg, as `add` takes it.
    #[command(flatten)]
    new: AddArgs,
}

#[derive(Args, Debug)]
struct SpeedArgs {
    /// Minimum, KiB/s.
    min: u64,
    /// Maximum, KiB/s.
    max: u64,
    #[command(flatten)]
    ctl: ControlArg,
}

/// Parses `--bitmap-chunk`.
fn bitmap_chunk(s: &str) -> Result<u64> {
    if s == "none" || s == "0" {
        return Ok(0);
    }
    parse_size(s).with_context(|| format!("--bitmap-chunk {s:?}"))
}

fn create(a: CreateArgs) -> Result<()> {
    let rules = CreateRules {
        force: a.force,
        assume_clean: a.assume_clean,
        size: match &a.size {
            Some(s) => Some(parse_size(s).with_context(|| format!("--size {s:?}"))?),
            None => None,
        },
    };
    let mut cfg = Raid1Config::default();
    if let Some(c) = &a.bitmap_chunk {
        cfg.bitmap_chunk = bitmap_chunk(c)?;
    }
    if let Some(b) = &a.barrier {
        cfg.set_option("barrier", b).context("--barrier")?;
    }
    if let Some(i) = &a.integrity {
        cfg.set_option("integrity", i).context("--integrity")?;
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
    let r = create::create_array(
        &a.legs,
        &QueueOverrides::default(),
        cfg,
        &rules,
        create::CLI,
    )
    .context("creating the array")?;
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

/// `blkq raid status`'s exit status when it cannot answer (mdadm's `--detail --test`: "error
/// while trying to get information"): the control socket unreachable, or the legs unreadable.
pub const STATUS_NO_ANSWER: i32 = 4;

/// `blkq raid status`'s exit status for a report, as `mdadm --detail --test` gives it: 0 every
/// member in sync, 1 degraded (a member missing, faulty or recovering), 2 failed (the array
/// failed, or no leg is in sync: nothing can serve it).
pub fn status_exit(rep: &report::ArrayReport) -> i32 {
    if rep.state == "failed" || rep.in_sync() == 0 {
        2
    } else if rep.state == "degraded" || rep.in_sync() < rep.raid_disks {
        1
    } else {
        0
    }
}

/// An offline query that found a leg locked (flock, `EWOULDBLOCK`) by a running server: says
/// to ask that server instead, through its control socket.
fn held_by_a_server(e: anyhow::Error) -> anyhow::Error {
    let locked = e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::WouldBlock)
    });
    if locked {
        e.context(
            "a leg is locked, most likely by a running `blkq serve`: ask that server instead, \
             with --control and its control socket (`blkq raid status --control PATH`)",
        )
    } else {
        e
    }
}

fn query(q: QueryArgs, detail: bool) -> Result<()> {
    let rep = match q.target().and_then(|t| match t {
        Target::Online(p) => client::report(p, detail),
        Target::Offline(legs) => offline_plan(legs).map_err(held_by_a_server)?.report(),
    }) {
        Ok(rep) => rep,
        // `status` says it could not answer by its exit status too, apart from degraded (1)
        // and failed (2).
        Err(e) if !detail => {
            eprintln!("Error: {e:?}");
            std::process::exit(STATUS_NO_ANSWER);
        }
        Err(e) => return Err(e),
    };
    if q.json {
        println!("{}", serde_json::to_string_pretty(&rep)?);
    } else if detail {
        print!("{}", rep.render_detail());
    } else {
        print!("{}", rep.render_status());
    }
    if !detail {
        use std::io::Write;
        std::io::stdout().flush()?;
        match status_exit(&rep) {
            0 => {}
            code => std::process::exit(code),
        }
    }
    Ok(())
}

/// The control socket a command sends to, and its `--wait` (`None`: offline, or monitor).
fn control_of(cmd: &RaidCmd) -> Option<(&Path, Option<u64>)> {
    let c = match cmd {
        RaidCmd::Status(q) | RaidCmd::Detail(q) | RaidCmd::Check(q) | RaidCmd::Repair(q) => {
            return q.control.as_deref().map(|p| (p, q.wait))
        }
        RaidCmd::Fail(t) | RaidCmd::Remove(t) => &t.ctl,
        RaidCmd::Add(a) => &a.new.ctl,
        RaidCmd::Replace(r) => &r.new.ctl,
        RaidCmd::Idle(c) => c,
        RaidCmd::SpeedLimit(s) => &s.ctl,
        _ => return None,
    };
    Some((&c.control, c.wait))
}

/// Runs `blkq raid`.
pub fn run(a: RaidArgs) -> Result<()> {
    if let Some((path, wait)) = control_of(&a.cmd) {
        client::wait_ready(path, wait)?;
    }
    match a.cmd {
        RaidCmd::Create(c) => create(c),
        RaidCmd::Assemble(l) => assemble(l),
        RaidCmd::Status(q) => query(q, false),
        RaidCmd::Detail(q) => query(q, true),
        RaidCmd::Check(q) => sync_action(q, "check"),
        RaidCmd::Repair(q) => sync_action(q, "repair"),
        RaidCmd::Fail(t) => client::run(&t.ctl.control, &Command::Fail(t.leg)),
        RaidCmd::Remove(t) => client::run(&t.ctl.control, &Command::Remove(t.leg)),
        RaidCmd::Add(a) => client::run(
            &a.new.ctl.control,
            &Command::Add {
                force: a.new.force,
                discard: a.discard,
                spec: a.new.spec,
            },
        ),
        RaidCmd::Replace(r) => client::run(
            &r.new.ctl.control,
            &Command::Replace {
                force: r.new.force,
                leg: r.leg,
                spec: r.new.spec,
            },
        ),
        RaidCmd::Idle(c) => client::run(&c.control, &Command::Idle),
        RaidCmd::Monitor(m) => monitor::run(m),
        RaidCmd::SpeedLimit(s) => client::run(
            &s.ctl.control,
            &Command::SpeedLimit {
                min: s.min,
                max: s.max,
            },
        ),
    }
}

fn sync_action(q: QueryArgs, action: &str) -> Result<()> {
    match q.target()? {
        Target::Online(p) => client::run(p, &Command::parse(action)?),
        Target::Offline(legs) => offline_sync(legs, action, q.json),
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
            eprint!("\r{}", SyncReport::from(r.sync_progress()).progress_line());
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
