//! Owns the legs as read from disk: `--raid1` leg lists, opening legs, reading their
//! superblocks and bitmaps, and assembling a set of legs by content into a [`Plan`] and its
//! offline [`ArrayReport`].

use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use blk::{Bio, Buffer, Device, Op, SECTOR_SHIFT};
use blk_drivers::spec::QueueOverrides;
use blkq_sync::Arc;
use raid1::superblock::{ArrayState, Superblock, SuperblockError, SB_OFFSET, SB_SIZE};
use raid1::{Assembly, AssemblyError, WriteIntentBitmap};

use crate::open::{open_leg, Spec};

use super::report::{ArrayReport, BitmapReport, IntegrityReport, LegReport};

/// Splits `--raid1`'s `LEG,LEG[,...]`: a part that starts a device spec
/// ([`Spec::starts_a_spec`]) begins a leg; any other part (`key=value`) is an option of the
/// leg before.
pub fn split_legs(s: &str) -> Result<Vec<String>> {
    let mut legs: Vec<String> = Vec::new();
    for part in s.split(',').filter(|p| !p.is_empty()) {
        if Spec::starts_a_spec(part) {
            legs.push(part.to_string());
        } else if let Some(last) = legs.last_mut() {
            last.push(',');
            last.push_str(part);
        } else {
            bail!(
                "--raid1 {s:?}: {part:?} is not a device spec (expected {}, or nbd://HOST/EXPORT)",
                blk_drivers::spec::Kind::forms()
            );
        }
    }
    if legs.is_empty() {
        bail!("--raid1 {s:?}: no leg given (legs are comma-separated device specs, e.g. file:/srv/a.img,file:/srv/b.img)");
    }
    Ok(legs)
}

/// The array configuration of `--raid1-option KEY=VALUE`s (`blkq serve` and `blkq bench`),
/// through `Raid1Config::set_option`, in order.
///
/// Served arrays re-add returning legs by themselves (`readd=auto`) unless told `readd=off`.
pub fn raid1_config(options: &[String]) -> Result<raid1::Raid1Config> {
    let mut cfg = raid1::Raid1Config {
        readd_interval: Some(raid1::DEFAULT_READD_INTERVAL),
        ..raid1::Raid1Config::default()
    };
    for o in options {
        let (k, v) = o
            .split_once('=')
            .with_context(|| format!("--raid1-option {o:?}: expected KEY=VALUE"))?;
        cfg.set_option(k.trim(), v.trim())
            .with_context(|| format!("--raid1-option {o:?}"))?;
    }
    Ok(cfg)
}

/// Reads `len` bytes at byte `offset` of `dev` (a slow path: allocates).
pub fn read_at(dev: &dyn Device, offset: u64, len: usize) -> Result<Vec<u8>> {
    let Some((bio, res)) = blk::submit_wait_until(
        dev,
        Bio::with_buf(Op::Read, offset >> SECTOR_SHIFT, Buffer::new(len)),
        Instant::now() + Duration::from_secs(30),
    ) else {
        bail!("read of {len} bytes at {offset} timed out");
    };
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
    /// The slot it takes ([`raid1::Assembly::slots`]): `None` for a spare or a leg replaced
    /// since.
    pub slot: Option<usize>,
}

/// The result of checking a set of legs: they form one array (errors otherwise).
pub struct Plan {
    /// The legs, in the order given.
    pub legs: Vec<Found>,
    /// The newest superblock ([`raid1::Assembly::newest`]).
    pub newest: Superblock,
}

/// Opens and probes `specs`. `Ok(None)`: every leg is blank (a new array).
pub fn plan(specs: &[String], overrides: &QueueOverrides) -> Result<Option<Plan>> {
    let mut opened = Vec::new();
    for spec in specs {
        opened.push((spec.clone(), open_leg(spec, overrides)?));
    }
    plan_opened(opened)
}

/// As [`plan`], over legs already opened (spec and device each).
pub fn plan_opened(legs: Vec<(String, Arc<dyn Device>)>) -> Result<Option<Plan>> {
    let mut opened = Vec::new();
    for (spec, dev) in legs {
        let p =
            probe(dev.as_ref()).with_context(|| format!("leg {spec:?}: reading its superblock"))?;
        opened.push((spec, dev, p));
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
                slot: None,
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
    // Which array, whose superblock speaks for it, which leg takes which slot: raid1's
    // answer, the one `Raid1::assemble` acts on.
    let sbs: Vec<Option<&Superblock>> = legs.iter().map(|f| Some(&f.sb)).collect();
    let assembly = match Assembly::decide(&sbs) {
        Ok(a) => a,
        Err(AssemblyError::ForeignLeg {
            leg,
            its,
            members,
            array,
        }) => {
            let ours: Vec<&str> = members.iter().map(|&i| legs[i].spec.as_str()).collect();
            bail!(
                "leg {:?} belongs to another array (array UUID {its}) than {} (array UUID \
                 {array}): refusing a mixed set. Give only the legs of one array",
                legs[leg].spec,
                ours.join(", "),
            );
        }
        Err(AssemblyError::DuplicateLeg {
            first,
            second,
            leg_uuid,
        }) => bail!(
            "legs {:?} and {:?} are the same leg (leg UUID {leg_uuid}): give each leg once",
            legs[first].spec,
            legs[second].spec,
        ),
        Err(AssemblyError::SplitBrain { legs: top, events }) => {
            let named: Vec<&str> = top.iter().map(|&i| legs[i].spec.as_str()).collect();
            bail!(
                "legs {} have the same events ({events}) and each records another as failed \
                 (split brain): refusing to assemble; assemble from the legs you trust",
                named.join(", ")
            );
        }
        Err(e) => bail!("{e}"),
    };
    for (f, slot) in legs.iter_mut().zip(&assembly.slots) {
        f.slot = *slot;
    }
    let newest = legs[assembly.newest].sb.clone();
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
    /// The offline report: what assembling these legs gives.
    pub fn report(&self) -> Result<ArrayReport> {
        let nb = &self.newest;
        let mut notes = Vec::new();
        let mut legs = Vec::new();
        for (n, info) in nb.legs.iter().enumerate() {
            let here = self.legs.iter().find(|f| f.slot == Some(n));
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
                    "slot {n} (leg UUID {}) is missing from the given legs: the array runs \
                     degraded; and the given legs may be stale (a leg failed or cut off while \
                     the array went on is not told, so its own superblock still reads in \
                     sync): give every leg, or ask the running server with --control",
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
                generation: here.map(|f| format!("{:016x}", f.sb.lineage.current.id)),
                // What only a running array knows (offline: none).
                ..LegReport::default()
            });
        }
        for f in &self.legs {
            if f.slot.is_none() {
                notes.push(format!(
                    "leg {:?} holds no slot of this array any more (a spare, or replaced since): it is ignored",
                    f.spec
                ));
            }
        }
        if nb.array_state != ArrayState::Clean {
            notes.push(
                "a resync is due: the superblock is not marked clean (the array is running, \
                 was not stopped cleanly, or is new and its initial resync has not finished); \
                 assembling it copies the first in-sync leg to the others"
                    .to_string(),
            );
        }
        let raid_disks = nb.legs.iter().filter(|l| !l.uuid.is_nil()).count();
        let bitmap = if nb.bitmap.chunk_size == 0 {
            None
        } else {
            let bm = WriteIntentBitmap::new(nb.data_size, nb.bitmap.chunk_size)
                .map_err(|e| anyhow!("bitmap: {e}"))?;
            // The union of the bitmaps of the legs that are in use.
            for f in &self.legs {
                if f.slot.is_some() {
                    if let Ok(b) = read_at(f.dev.as_ref(), nb.bitmap.offset, bm.disk_len()) {
                        let _ = bm.load(&b);
                    }
                }
            }
            Some(BitmapReport::from(&bm))
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
            generation: format!("{:016x}", nb.lineage.current.id),
            capacity: nb.data_size,
            data_offset: nb.data_offset,
            raid_disks,
            legs,
            bitmap,
            integrity: nb.integrity.map(|a| IntegrityReport {
                algorithm: a.algorithm.to_string(),
                healed: 0,
                unrecoverable: 0,
                resummed: 0,
            }),
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
pub(super) fn offline_plan(specs: &[String]) -> Result<Plan> {
    plan(specs, &QueueOverrides::default())?.ok_or_else(|| {
        anyhow!(
            "no leg carries a raid1 superblock: create the array first with `blkq raid create {}`",
            specs.join(" ")
        )
    })
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
        assert_eq!(
            split_legs("file:/a.img,nbd://h:1/leg,timeout=5,nbd+unix:///?socket=/s").unwrap(),
            [
                "file:/a.img",
                "nbd://h:1/leg,timeout=5",
                "nbd+unix:///?socket=/s"
            ]
        );
        assert_eq!(
            split_legs("file:/a.img,rbd:rbd/img,conf=/c.conf,lock=on").unwrap(),
            ["file:/a.img", "rbd:rbd/img,conf=/c.conf,lock=on"]
        );
        assert_eq!(split_legs("file:/a.img").unwrap().len(), 1);
        assert!(split_legs("").is_err());
        assert!(split_legs("direct=1,file:/a.img,file:/b").is_err());
    }
}
