//! A RAID1 array's families: node_exporter's `node_md_*` shape (`device` = the export name)
//! and what only blkq knows per leg (`blkq_raid1_*`), from the array's report at scrape time.

use prometheus_client::encoding::DescriptorEncoder;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Unit;

use super::family::{counter, family, gauge};
use crate::control::server::Control;
use crate::raid::report::{ArrayReport, LegReport};

/// node_exporter's `node_md_*` shape for a RAID1 array, and blkq's per-leg families.
pub(super) fn md_families(
    enc: &mut DescriptorEncoder,
    name: &str,
    ctl: &Control,
) -> Result<(), std::fmt::Error> {
    let rep = ctl.report();
    md_disk_families(enc, name, &rep)?;
    md_state_families(enc, name, &rep)?;
    md_leg_families(enc, name, &rep)
}

/// The labels of an array's sample: its device name, and an extra label when given.
fn md_labels(name: &str, extra: Option<(&'static str, &str)>) -> Vec<(&'static str, String)> {
    let mut v = vec![("device", name.to_string())];
    if let Some((k, val)) = extra {
        v.push((k, val.to_string()));
    }
    v
}

/// An array's legs by state and its member count (node_exporter's `node_md_disks*`).
fn md_disk_families(
    enc: &mut DescriptorEncoder,
    name: &str,
    rep: &ArrayReport,
) -> Result<(), std::fmt::Error> {
    let dev = |extra| md_labels(name, extra);
    let members = rep.legs.iter().take(rep.raid_disks);
    let count = |state: &str| rep.legs.iter().filter(|l| l.state == state).count() as u64;
    let present_members = members.filter(|l| l.state != "empty").count() as u64;
    // node_exporter's states: active (in sync), failed, spare (a leg outside the member
    // slots, or one being rebuilt: md's `S`/recovering), down (member slots with no leg).
    let spares = rep
        .legs
        .iter()
        .skip(rep.raid_disks)
        .filter(|l| l.state != "empty" && l.state != "faulty")
        .count() as u64;
    let disks = [
        ("active", count("in_sync")),
        ("failed", count("faulty")),
        ("recovering", count("recovering")),
        ("spare", spares),
        (
            "down",
            (rep.raid_disks as u64).saturating_sub(present_members),
        ),
    ];
    family(
        enc,
        "node_md_disks",
        "Legs of the array by state (node_exporter's shape).",
        None,
        disks
            .iter()
            .map(|(s, n)| (dev(Some(("state", s))), gauge(*n))),
    )?;
    family(
        enc,
        "node_md_disks_required",
        "Member legs of the array (md's raid_disks).",
        None,
        [(dev(None), gauge(rep.raid_disks as u64))],
    )
}

/// An array's state, its degraded slots and how far its resync, recovery or check has gone
/// (node_exporter's `node_md_state`, `node_md_degraded` and `node_md_blocks*`).
fn md_state_families(
    enc: &mut DescriptorEncoder,
    name: &str,
    rep: &ArrayReport,
) -> Result<(), std::fmt::Error> {
    let dev = |extra| md_labels(name, extra);
    let action = rep.sync.as_ref().map_or("idle", |s| s.action.as_str());
    let now = match action {
        "resync" => "resync",
        "recover" => "recovering",
        "check" | "repair" => "check",
        _ => "active",
    };
    family(
        enc,
        "node_md_state",
        "The array's state: 1 for the current one (node_exporter's shape).",
        None,
        ["active", "inactive", "recovering", "resync", "check"]
            .iter()
            .map(|s| (dev(Some(("state", s))), gauge(u64::from(*s == now)))),
    )?;
    let in_sync = rep.legs.iter().filter(|l| l.state == "in_sync").count() as u64;
    family(
        enc,
        "node_md_degraded",
        "Member slots without an in-sync leg.",
        None,
        [(
            dev(None),
            gauge((rep.raid_disks as u64).saturating_sub(in_sync)),
        )],
    )?;
    let blocks = rep.capacity / 1024;
    let synced = match rep.sync.as_ref() {
        Some(s) if now != "active" && s.total_bytes > 0 => {
            blocks.saturating_mul(s.done_bytes.min(s.total_bytes)) / s.total_bytes
        }
        _ => blocks,
    };
    family(
        enc,
        "node_md_blocks",
        "Size of the array in 1 KiB blocks.",
        None,
        [(dev(None), gauge(blocks))],
    )?;
    family(
        enc,
        "node_md_blocks_synced",
        "1 KiB blocks synced by the running resync/recovery/check (all of them when idle).",
        None,
        [(dev(None), gauge(synced))],
    )
}

/// Per leg (what only blkq knows), labelled by slot: round-trip time, write-behind writes in
/// flight, automatic re-adds.
fn md_leg_families(
    enc: &mut DescriptorEncoder,
    name: &str,
    rep: &ArrayReport,
) -> Result<(), std::fmt::Error> {
    let slot = |l: &LegReport| vec![("device", name.to_string()), ("slot", l.slot.to_string())];
    let present = || rep.legs.iter().filter(|l| l.state != "empty");
    family(
        enc,
        "blkq_raid1_leg_rtt",
        "A leg's round-trip time: an EWMA of its reads' and writes' latency (coarse clock, \
         1-4 ms resolution).",
        Some(&Unit::Seconds),
        present().filter_map(|l| {
            let ns = l.rtt_ns?;
            Some((slot(l), ConstGauge::new(ns as f64 / 1e9)))
        }),
    )?;
    family(
        enc,
        "blkq_raid1_leg_write_behind",
        "Writes acknowledged and still in flight to a write-mostly leg (write_behind=N).",
        None,
        present().map(|l| (slot(l), gauge(u64::from(l.write_behind)))),
    )?;
    family(
        enc,
        "blkq_raid1_leg_readds",
        "Automatic re-adds of a leg that failed and answered again (readd=auto).",
        None,
        present().map(|l| (slot(l), counter(l.readds))),
    )?;
    if let Some(i) = &rep.integrity {
        family(
            enc,
            "blkq_raid1_leg_checksum_errors",
            "Blocks read from a leg that did not match their checksums (integrity on).",
            None,
            present().map(|l| (slot(l), counter(l.checksum_errors))),
        )?;
        let dev = || vec![("device", name.to_string())];
        family(
            enc,
            "blkq_raid1_blocks_healed",
            "Blocks that failed their checksum on a leg and were rewritten from one that matched.",
            None,
            [(dev(), counter(i.healed))],
        )?;
        family(
            enc,
            "blkq_raid1_blocks_unrecoverable",
            "Blocks no leg held with their checksum: their reads failed with EIO.",
            None,
            [(dev(), counter(i.unrecoverable))],
        )?;
    }
    Ok(())
}
