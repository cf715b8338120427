//! The array behind a control socket: [`Control`] (the array, with what the server knows of
//! its legs) runs [`Command`]s and reports the array's state; [`Handle`] is what answers a
//! socket's lines (`super::socket` listens and serves them).
//!
//! A new leg must be blank (no superblock, and zeros where other formats keep theirs) or a
//! former leg of this array; `--force` takes a leg with data or a damaged superblock (never
//! one of another array: zero its superblock first). Commands that change the array run one at
//! a time; `status` and `detail` never wait for them.

use anyhow::{bail, Context, Result};
use blk_drivers::spec::QueueOverrides;
use blkq_sync::{thread, Arc, Mutex};
use raid1::{Raid1, SyncAction};
use serde_json::json;

use super::protocol::{Command, Leg};
use crate::raid::away::Away;
use crate::raid::content;
use crate::raid::legs::{self, Probe};
use crate::raid::report::{ArrayReport, BitmapReport, IntegrityReport, LegReport, SyncReport};

/// The array behind the socket, with what the server knows about its legs.
pub struct Control {
    raid: Arc<Raid1>,
    /// The device spec in each slot, when known (shared with `replace` threads).
    specs: Arc<Mutex<Vec<Option<String>>>>,
    /// Member legs (md's raid_disks), as assembled.
    raid_disks: usize,
    /// How new legs are opened.
    overrides: QueueOverrides,
    /// Held by the commands that change the array (one at a time, as when the socket served
    /// one connection at a time); `status` and `detail` do not take it.
    changing: Mutex<()>,
    /// Legs the array started without because they could not be opened (shown missing in
    /// their slots until they are back).
    away: Vec<Arc<Away>>,
}

/// A new leg, opened and read: the device, and the leg UUID its superblock gives it.
type NewLeg = (Arc<dyn blk::Device>, Option<[u8; 16]>);

/// Whether two device specs name the same file (specs of a kind whose argument is a path,
/// `file:`, whose paths are one inode).
fn same_file(a: &str, b: &str) -> bool {
    use std::os::unix::fs::MetadataExt;
    let id = |s: &str| {
        let spec = s.parse::<blk_drivers::spec::DeviceSpec>().ok()?;
        let m = std::fs::metadata(spec.path()?).ok()?;
        Some((m.dev(), m.ino()))
    };
    matches!((id(a), id(b)), (Some(x), Some(y)) if x == y)
}

impl Control {
    /// `specs[i]`: the spec of the leg in slot `i`.
    pub fn new(raid: Arc<Raid1>, specs: Vec<Option<String>>, overrides: QueueOverrides) -> Self {
        let n = raid.slots();
        let mut specs = specs;
        specs.resize(n, None);
        // The events and log lines about a leg name it by its spec too.
        for (i, s) in specs.iter().enumerate() {
            raid.set_leg_name(i, s.clone());
        }
        let raid_disks = (0..n)
            .filter(|&i| raid.leg_status(i).is_some_and(|s| s.present))
            .count()
            .max(2);
        Self {
            raid,
            specs: Arc::new(Mutex::new(specs)),
            raid_disks,
            overrides,
            changing: Mutex::new(()),
            away: Vec::new(),
        }
    }

    /// With the legs the array started without ([`Away`]): `status` shows each in its slot,
    /// missing, with its spec and why it is not back.
    pub fn with_away(mut self, away: Vec<Arc<Away>>) -> Self {
        self.away = away;
        self
    }

    /// A leg the array started without, shown in slot `shown`, is back in slot `slot`.
    pub fn leg_back(&self, shown: usize, slot: usize, spec: &str) {
        let mut specs = self.specs.lock();
        if shown != slot && specs.get(shown).and_then(|s| s.as_deref()) == Some(spec) {
            specs[shown] = None;
        }
        if let Some(s) = specs.get_mut(slot) {
            *s = Some(spec.to_string());
        }
    }

    /// The online report.
    pub fn report(&self) -> ArrayReport {
        let r = &self.raid;
        let specs = self.specs.lock().clone();
        let sb0 = r.superblock(0);
        let events = sb0.as_ref().map_or(0, |s| s.events);
        let legs: Vec<LegReport> = (0..r.slots())
            .filter_map(|i| {
                let spec = specs.get(i).cloned().flatten();
                self.leg_report(i, spec, sb0.as_ref(), events)
            })
            .collect();
        let present = legs
            .iter()
            .filter(|l| l.state != "empty" && l.state != "missing")
            .count();
        // A leg the array started without is a member all the same.
        let away = legs.iter().filter(|l| l.state == "missing").count();
        let raid_disks = self.raid_disks.max(present + away);
        let in_sync = legs.iter().filter(|l| l.state == "in_sync").count();
        let bitmap = r.bitmap().map(BitmapReport::from);
        let sync = Some(SyncReport::from(r.sync_progress()));
        let lim = blk::Device::limits(r.as_ref());
        ArrayReport {
            array_uuid: sb0
                .as_ref()
                .map_or(String::new(), |s| s.array_uuid.to_string()),
            state: if r.failure().is_some() {
                "failed"
            } else if in_sync < raid_disks || r.is_degraded() {
                "degraded"
            } else {
                "active"
            }
            .to_string(),
            events,
            generation: sb0
                .as_ref()
                .map_or(String::new(), |s| format!("{:016x}", s.lineage.current.id)),
            capacity: lim.capacity,
            data_offset: r.data_offset(),
            raid_disks,
            legs,
            bitmap,
            integrity: r.integrity().map(|(a, c)| IntegrityReport {
                algorithm: a.to_string(),
                healed: c.healed,
                unrecoverable: c.unrecoverable,
                resummed: c.resummed,
            }),
            sync,
            notes: self.notes(),
        }
    }

    /// Slot `i`'s line of the online report (`None`: no such slot), with the spec the server
    /// knows for it and the array's superblock as slot 0 sees it: its state, or `missing`
    /// with its spec and why it is not back for a leg the array started without.
    fn leg_report(
        &self,
        i: usize,
        spec: Option<String>,
        sb0: Option<&raid1::superblock::Superblock>,
        events: u64,
    ) -> Option<LegReport> {
        let r = &self.raid;
        let st = r.leg_status(i)?;
        let state = if !st.present {
            "empty"
        } else if st.faulty {
            "faulty"
        } else if st.in_sync {
            "in_sync"
        } else {
            "recovering"
        };
        let uuid = sb0
            .and_then(|s| s.legs.get(i))
            .map_or(String::new(), |l| l.uuid.to_string());
        let mut ra = r.readd_status(i).unwrap_or_default();
        // A leg the array started without, not back yet: missing, with its spec.
        let away = (!st.present)
            .then(|| self.away.iter().find(|a| a.slot == i))
            .flatten()
            .map(|a| (a, a.state()))
            .filter(|(_, s)| !s.done);
        if let Some((a, s)) = &away {
            ra.probing = a.every.is_some();
            ra.last_error = s.last_error.clone();
            ra.refused = s.refused.clone();
        }
        Some(LegReport {
            slot: i,
            device: if st.present || away.is_some() {
                spec
            } else {
                None
            },
            state: if away.is_some() { "missing" } else { state }.to_string(),
            uuid,
            write_mostly: st.write_mostly,
            recovery_offset: (st.present && !st.in_sync && !st.faulty)
                .then_some(st.recovery_offset),
            events: st.present.then_some(events),
            generation: None,
            read_errors: st.read_errors,
            probing: ra.probing,
            probe_error: ra.last_error,
            refused: ra.refused,
            readds: ra.readds,
            rtt_ns: (st.present && st.rtt_ns > 0).then_some(st.rtt_ns),
            write_behind: st.write_behind,
            checksum_errors: st.checksum_errors,
        })
    }

    /// The online report's notes: what assembly worked around, the legs the array started
    /// without that are not back and whose slot took another leg meanwhile, and why the array
    /// failed (writes and flushes fail until it is stopped).
    fn notes(&self) -> Vec<String> {
        let r = &self.raid;
        r.assemble_warnings()
            .iter()
            .cloned()
            .chain(self.away.iter().filter_map(|a| {
                let s = a.state();
                let shown = r.leg_status(a.slot).is_some_and(|st| !st.present);
                (!s.done && !shown).then(|| {
                    format!(
                        "leg {:?}, which the array started without, is not back: {}",
                        a.spec,
                        s.refused
                            .map(|w| format!("refused: {w}"))
                            .or(s.last_error)
                            .unwrap_or_default()
                    )
                })
            }))
            .chain(r.failure().map(|why| {
                format!("array failed: {why}; writes and flushes fail until it is stopped")
            }))
            .collect()
    }

    /// Runs one command line; returns the JSON reply.
    pub fn handle(&self, line: &str) -> serde_json::Value {
        match self.dispatch(line.trim()) {
            Ok(v) => v,
            Err(e) => json!({ "ok": false, "error": format!("{e:#}") }),
        }
    }

    /// The slot of `leg`: a slot number of the array, or the slot whose leg was given by
    /// that spec or names the same file.
    fn slot(&self, leg: &Leg, cmd: &str) -> Result<usize> {
        match leg {
            Leg::Slot(n) if *n < self.raid.slots() => Ok(*n),
            Leg::Slot(n) => bail!(
                "{cmd} {n}: no such slot (the array has slots 0 to {})",
                self.raid.slots().saturating_sub(1)
            ),
            Leg::Spec(spec) => {
                let specs = self.specs.lock();
                let found = specs
                    .iter()
                    .position(|s| s.as_deref() == Some(spec.as_str()))
                    .or_else(|| {
                        specs
                            .iter()
                            .position(|s| s.as_deref().is_some_and(|s| same_file(s, spec)))
                    });
                match found {
                    Some(n) => Ok(n),
                    None => {
                        let known: Vec<String> = specs
                            .iter()
                            .enumerate()
                            .filter_map(|(i, s)| s.as_ref().map(|s| format!("{i}: {s}")))
                            .collect();
                        bail!(
                            "{cmd} {spec}: no leg of the array is that device (slots: {})",
                            known.join(", ")
                        )
                    }
                }
            }
        }
    }

    fn spec_name(&self, n: usize) -> String {
        match self.specs.lock().get(n).cloned().flatten() {
            Some(s) => format!("slot {n} ({s})"),
            None => format!("slot {n}"),
        }
    }

    /// The slot of a present leg that is `spec`'s device (by spec or same file), or whose UUID
    /// is `leg_uuid` (the superblock the new leg carries): a leg already in the array.
    fn already_in(&self, spec: &str, leg_uuid: Option<[u8; 16]>) -> Option<usize> {
        let present = |i: usize| self.raid.leg_status(i).is_some_and(|st| st.present);
        let by_spec = (0..self.raid.slots()).find(|&i| {
            present(i)
                && self
                    .specs
                    .lock()
                    .get(i)
                    .cloned()
                    .flatten()
                    .is_some_and(|s| s == spec || same_file(&s, spec))
        });
        by_spec.or_else(|| {
            let ours = self.raid.superblock(0)?;
            let leg = leg_uuid?;
            (0..self.raid.slots()).find(|&i| {
                present(i) && ours.legs.get(i).is_some_and(|l| *l.uuid.as_bytes() == leg)
            })
        })
    }

    /// Opens a new leg, refusing one that belongs to another array, and (unless `force`) one
    /// that is not blank: what `blkq raid create` refuses without `--force` (a damaged
    /// superblock), and a leg without a superblock that holds data where other formats keep
    /// theirs ([`content::probe`]: a signature, or a non-zero byte in its first
    /// [`content::BLANK_PROBE`] bytes). Runs without the `changing` lock: connecting to a
    /// remote leg and reading it may take up to its timeout, and no other leg change waits
    /// for that. Returns the device and the UUID its superblock gives it (for
    /// [`Control::check_still_new`] under the lock).
    fn open_new_leg(&self, spec: &str, force: bool) -> Result<NewLeg> {
        // A file already in the array is locked by its leg (flock): say what it is rather
        // than that some lock is held.
        self.check_still_new(spec, None)?;
        let dev = crate::open::open_leg(spec, &self.overrides)?;
        let mut leg_uuid = None;
        match legs::probe(dev.as_ref()).with_context(|| format!("leg {spec:?}: reading it"))? {
            Probe::Member(sb) => {
                self.check_still_new(spec, Some(*sb.leg_uuid.as_bytes()))?;
                let ours = self.raid.superblock(0);
                if Some(sb.array_uuid) != ours.map(|o| o.array_uuid) {
                    bail!(
                        "leg {spec:?} carries the superblock of another array ({}): refusing to overwrite it. \
                         If it is really free, zero its first 8 KiB (superblock) first",
                        sb.array_uuid
                    );
                }
                leg_uuid = Some(*sb.leg_uuid.as_bytes());
            }
            Probe::Corrupt(e) if !force => bail!(
                "leg {spec:?} carries a damaged raid1 superblock ({e}): refusing to overwrite it \
                 without --force"
            ),
            Probe::Blank if !force => {
                let (held, probed) = content::probe(dev.as_ref(), content::BLANK_PROBE)
                    .with_context(|| format!("leg {spec:?}: reading it"))?;
                if let Some(what) = held.describe(probed) {
                    bail!(
                        "leg {spec:?} has no raid1 superblock but holds data: {what}. \
                         Refusing to overwrite it without --force"
                    );
                }
            }
            Probe::Corrupt(_) | Probe::Blank => {}
        }
        Ok((dev, leg_uuid))
    }

    /// `fail LEG`.
    fn fail(&self, leg: &Leg) -> Result<serde_json::Value> {
        let n = self.slot(leg, "fail")?;
        self.raid.fail_leg(n).with_context(|| {
            format!(
                "cannot fail {}: it is the last in-sync leg or the slot is empty",
                self.spec_name(n)
            )
        })?;
        Ok(json!({ "ok": true, "message": format!("{} marked faulty", self.spec_name(n)) }))
    }

    /// Refuses a new leg that is already in the array (checked again under the `changing`
    /// lock: another command may have added it while this one opened it).
    fn check_still_new(&self, spec: &str, leg_uuid: Option<[u8; 16]>) -> Result<()> {
        match self.already_in(spec, leg_uuid) {
            Some(slot) => bail!(
                "leg {spec:?} is already in the array ({}): give a different device",
                self.spec_name(slot)
            ),
            None => Ok(()),
        }
    }

    fn dispatch(&self, line: &str) -> Result<serde_json::Value> {
        let cmd = Command::parse(line)?;
        if cmd == Command::Monitor {
            // Served by the connection itself (`serve_one`), which keeps it open.
            bail!("monitor: only over the control socket, which streams the events");
        }
        if !cmd.changes_array() {
            return Ok(json!({ "ok": true, "report": self.report() }));
        }
        // Failing a leg takes no lock of the control plane: an operator fails a leg during an
        // incident whatever another command waits for (an add writing its superblock to a
        // slow remote leg held `fail` for the two writes' whole time). The array serialises
        // failures itself, as it does a leg that fails on its own meanwhile.
        if let Command::Fail(leg) = &cmd {
            return self.fail(leg);
        }
        // A new leg is opened and checked before the lock is taken: a leg change waits for
        // nothing remote (a silent server held `raid fail` behind a pending `raid add`).
        let new_leg = match &cmd {
            Command::Add { force, spec, .. } | Command::Replace { force, spec, .. } => {
                Some(self.open_new_leg(spec, *force)?)
            }
            _ => None,
        };
        let _changing = self.changing.lock();
        let new_leg = |spec: &str| -> Result<Arc<dyn blk::Device>> {
            let Some((dev, leg_uuid)) = new_leg.clone() else {
                bail!("leg {spec:?}: not opened");
            };
            self.check_still_new(spec, leg_uuid)?;
            Ok(dev)
        };
        let ok = |m: String| Ok(json!({ "ok": true, "message": m }));
        let r = &self.raid;
        match cmd {
            Command::Status | Command::Detail | Command::Monitor => {
                Ok(json!({ "ok": true, "report": self.report() }))
            }
            Command::Fail(leg) => self.fail(&leg),
            Command::Remove(leg) => ok(self.remove(&leg)?),
            Command::Add {
                force: _,
                discard,
                spec,
            } => {
                let dev = new_leg(&spec)?;
                ok(self.add(dev, discard, spec)?)
            }
            Command::Replace {
                force: _,
                leg,
                spec,
            } => {
                let n = self.slot(&leg, "replace")?;
                let dev = new_leg(&spec)?;
                ok(self.replace(n, dev, spec))
            }
            Command::Check | Command::Repair | Command::Idle => {
                let (a, word) = match cmd {
                    Command::Check => (SyncAction::Check, "check"),
                    Command::Repair => (SyncAction::Repair, "repair"),
                    _ => (SyncAction::Idle, "idle"),
                };
                r.set_sync_action(a).with_context(|| {
                    format!("{word} refused (a resync or recovery runs or is needed?)")
                })?;
                ok(format!("sync_action {word}"))
            }
            Command::SpeedLimit { min, max } => {
                r.set_speed_limits(min, max);
                let (a, b) = r.speed_limits();
                Ok(
                    json!({ "ok": true, "message": format!("speed limits {a}..{b} KiB/s"), "min": a, "max": b }),
                )
            }
        }
    }

    /// `remove N`: takes a faulty or recovering leg out of its slot.
    fn remove(&self, leg: &Leg) -> Result<String> {
        let n = self.slot(leg, "remove")?;
        let name = self.spec_name(n);
        self.raid.remove_leg(n).with_context(|| {
            format!("cannot remove {name}: only a faulty or recovering leg can be removed (`fail {n}` first)")
        })?;
        if let Some(s) = self.specs.lock().get_mut(n) {
            *s = None;
        }
        Ok(format!("{name} removed"))
    }

    /// `add SPEC`: puts the opened leg `dev` into an empty slot, recovering.
    fn add(&self, dev: Arc<dyn blk::Device>, discard: bool, spec: String) -> Result<String> {
        let r = &self.raid;
        let added = r.add_named_leg(dev, discard, Some(spec.clone()));
        let n = match added {
            Ok(n) => n,
            // Says itself what to do.
            Err(e @ raid1::Raid1Error::Diverged { .. }) => {
                return Err(anyhow::Error::new(e).context(format!("cannot add {spec:?}")))
            }
            Err(e) => return Err(anyhow::Error::new(e).context(format!(
                "cannot add {spec:?}: is there an empty slot (`remove N` a failed leg first) and is it big enough?"
            ))),
        };
        if let Some(s) = self.specs.lock().get_mut(n) {
            *s = Some(spec.clone());
        }
        // The array starts recovery itself; asking again is harmless.
        let _ = r.set_sync_action(SyncAction::Recover);
        Ok(format!("{spec} added in slot {n}: recovering"))
    }

    /// `replace N SPEC`: copies slot `n`'s leg to the opened leg `dev`, on a thread of its
    /// own (it blocks until the copy is done), which takes over from it.
    fn replace(&self, n: usize, dev: Arc<dyn blk::Device>, spec: String) -> String {
        let raid = self.raid.clone();
        let specs = self.specs.clone();
        let name = self.spec_name(n);
        let message = format!("replacing {name} by {spec}: watch `blkq raid status`");
        // Blocks until the copy is done: run it on a thread of its own.
        thread::spawn(
            move || match raid.replace_named_leg(n, dev, Some(spec.clone())) {
                Ok(new) => {
                    let mut sp = specs.lock();
                    if let Some(x) = sp.get_mut(n) {
                        *x = None;
                    }
                    if let Some(x) = sp.get_mut(new) {
                        *x = Some(spec.clone());
                    }
                    drop(sp);
                    tracing::info!("replace: {spec} took over from slot {n} (slot {new})")
                }
                Err(e) => tracing::warn!("replace of slot {n} by {spec} failed: {e}"),
            },
        );
        message
    }
}

/// What answers a control socket's lines: a mirror's [`Control`], or the server's handler
/// (`super::bitmap::Handler`: bitmap commands, and a mirror's when it has one).
pub trait Handle: Send + Sync {
    /// Runs one command line; returns the JSON reply.
    fn handle(&self, line: &str) -> serde_json::Value;

    /// The mirror's events from now on, with the first line of a `monitor` reply; `None`
    /// when there is no mirror.
    fn subscribe(&self) -> Option<(raid1::Subscription, serde_json::Value)> {
        None
    }
}

impl Handle for Control {
    fn handle(&self, line: &str) -> serde_json::Value {
        Control::handle(self, line)
    }

    fn subscribe(&self) -> Option<(raid1::Subscription, serde_json::Value)> {
        // Subscribed first: what the first line reports is never newer than the events.
        let sub = self.raid.subscribe();
        let rep = self.report();
        let first = json!({
            "ok": true,
            "event": "monitoring",
            "array": rep.array_uuid,
            "state": rep.state,
            "legs": rep.mdstat_legs(),
        });
        Some((sub, first))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use blkq_sync::atomic::{AtomicBool, Ordering};
    use std::path::Path;
    use std::time::Duration;

    /// A mirror over two file legs in `dir`, behind a [`Control`].
    fn mirror(dir: &Path) -> (Control, Vec<String>) {
        mirror_of(dir, &["a.img", "b.img"])
    }

    /// A mirror over file legs `files` in `dir`, behind a [`Control`].
    fn mirror_of(dir: &Path, files: &[&str]) -> (Control, Vec<String>) {
        let specs: Vec<String> = files
            .iter()
            .map(|f| {
                let p = dir.join(f);
                std::fs::File::create(&p)
                    .unwrap()
                    .set_len(16 << 20)
                    .unwrap();
                format!("file:{}", p.display())
            })
            .collect();
        let overrides = QueueOverrides::default();
        let devs = specs
            .iter()
            .map(|s| crate::open::open_leg(s, &overrides).unwrap())
            .collect();
        let raid = Arc::new(Raid1::create(devs, raid1::Raid1Config::default()).unwrap());
        let ctl = Control::new(raid, specs.iter().cloned().map(Some).collect(), overrides);
        (ctl, specs)
    }

    /// A leg the array started without (its server down) is shown in its slot, missing,
    /// with its spec and why, and counts as a member: a 3-leg array is `[UU_]`.
    #[test]
    fn a_leg_the_array_started_without_is_shown_missing_in_its_slot() {
        let overrides = QueueOverrides::default();
        let devs: Vec<Arc<dyn blk::Device>> = (0..3)
            .map(|_| crate::open::open_leg("mem:16M", &overrides).unwrap())
            .collect();
        drop(Raid1::create(devs.clone(), raid1::Raid1Config::default()).unwrap());
        let cfg = raid1::Raid1Config {
            allow_degraded: true,
            ..raid1::Raid1Config::default()
        };
        let raid = Arc::new(Raid1::assemble(devs[..2].to_vec(), cfg).unwrap());
        let spec = "nbd+unix:///?socket=/nonexistent.sock".to_string();
        let away = Arc::new(Away::new(
            spec.clone(),
            2,
            None,
            "cannot open it: no such file".into(),
        ));
        let specs = vec![
            Some("mem:a".into()),
            Some("mem:b".into()),
            Some(spec.clone()),
        ];
        let ctl = Control::new(raid, specs, overrides).with_away(vec![away]);
        let rep = ctl.report();
        assert_eq!(rep.raid_disks, 3);
        let l = &rep.legs[2];
        assert_eq!(l.state, "missing");
        assert_eq!(l.device.as_deref(), Some(spec.as_str()));
        assert_eq!(
            l.probe_error.as_deref(),
            Some("cannot open it: no such file")
        );
        assert!(!l.probing, "readd=off: not tried again");
        let text = rep.render_status();
        assert!(text.contains("[UU_]"), "{text}");
    }

    fn ok(ctl: &Control, line: &str) -> String {
        let v = ctl.handle(line);
        assert_eq!(v["ok"], true, "{line}: {v}");
        v["message"].as_str().unwrap_or_default().to_string()
    }

    fn err(ctl: &Control, line: &str) -> String {
        let v = ctl.handle(line);
        assert_eq!(v["ok"], false, "{line}: {v}");
        v["error"].as_str().unwrap().to_string()
    }

    #[test]
    fn a_leg_is_named_by_its_slot_or_its_spec() {
        let d = tempfile::tempdir().unwrap();
        let (ctl, specs) = mirror(d.path());
        // The spec as given.
        let m = ok(&ctl, &format!("fail {}", specs[1]));
        assert!(m.contains("slot 1") && m.contains("faulty"), "{m}");
        // Another spelling of the same file (mdadm names the device, however reached).
        let other = format!("file:{}/./b.img", d.path().display());
        let m = ok(&ctl, &format!("remove {other}"));
        assert!(m.contains("slot 1") && m.contains("removed"), "{m}");
        // A device that is no leg, and a slot that does not exist: said so.
        let e = err(&ctl, &format!("fail file:{}/c.img", d.path().display()));
        assert!(e.contains("no leg of the array is that device"), "{e}");
        assert!(e.contains(&specs[0]), "{e}");
        let e = err(&ctl, "fail 9");
        assert!(e.contains("no such slot"), "{e}");
        // The last in-sync leg, by spec, is refused like by slot.
        let e = err(&ctl, &format!("fail {}", specs[0]));
        assert!(e.contains("last in-sync leg"), "{e}");
    }

    /// A new leg behind a server that accepts and never answers: `add` waits for it (up to
    /// the leg's timeout), and meanwhile another leg change is answered at once.
    #[test]
    fn a_leg_change_is_answered_while_an_add_waits_for_a_silent_server() {
        let d = tempfile::tempdir().unwrap();
        let (ctl, _) = mirror(d.path());
        let ctl = Arc::new(ctl);
        let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = silent.local_addr().unwrap().port();
        // Accepts, holds the connections, says nothing.
        let held = thread::spawn(move || {
            let mut conns = Vec::new();
            silent.set_nonblocking(true).unwrap();
            let until = std::time::Instant::now() + Duration::from_secs(6);
            while std::time::Instant::now() < until {
                match silent.accept() {
                    Ok((c, _)) => conns.push(c),
                    Err(_) => std::thread::sleep(Duration::from_millis(20)),
                }
            }
        });
        let adding = {
            let ctl = ctl.clone();
            thread::spawn(move || {
                ctl.handle(&format!(
                    "add nbd://127.0.0.1:{port}/x,timeout=3,reconnect_deadline=0"
                ))
            })
        };
        // Let the add connect and wait for its greeting.
        std::thread::sleep(Duration::from_millis(300));
        let t = std::time::Instant::now();
        let m = ok(&ctl, "fail 1");
        assert!(m.contains("faulty"), "{m}");
        assert!(
            t.elapsed() < Duration::from_secs(1),
            "fail answered after {:?}, behind the pending add",
            t.elapsed()
        );
        assert!(!adding.is_finished(), "the add was still waiting");
        let v = adding.join().unwrap();
        assert_eq!(v["ok"], false, "{v}");
        held.join().unwrap();
    }

    /// A new leg whose server answers its probe but is slow to write: the add waits for its
    /// superblock write, and meanwhile `fail` is answered at once (an operator fails a leg
    /// during an incident whatever a remote server does).
    #[test]
    fn a_fail_is_answered_while_an_add_writes_to_a_slow_server() {
        let d = tempfile::tempdir().unwrap();
        let ctl = Arc::new(mirror_of(d.path(), &["a.img", "b.img", "c.img"]).0);
        ok(&ctl, "fail 2");
        ok(&ctl, "remove 2");
        // Host b: reads at once, every write held 3 s.
        let writing = Arc::new(AtomicBool::new(false));
        let w = writing.clone();
        let disk = crate::open::open_leg("mem:16M", &QueueOverrides::default()).unwrap();
        let d2 = disk.clone();
        let slow: Arc<dyn blk::Device> =
            Arc::new(testkit::Forward::on_submit(disk, move |inner, bio, end| {
                if bio.op != blk::Op::Write {
                    return inner.submit(bio, end);
                }
                w.store(true, Ordering::SeqCst);
                let (disk, end) = (d2.clone(), end.clone());
                thread::spawn(move || {
                    std::thread::sleep(Duration::from_secs(3));
                    disk.submit(bio, &end);
                });
            }));
        let sock = d.path().join("b.sock");
        let mut cfg = nbd::server::ServerConfig::new(vec![nbd::server::Export::new("", slow)]);
        cfg.unix = Some(sock.clone());
        let server = nbd::server::Server::start(cfg).unwrap();
        let adding = {
            let ctl = ctl.clone();
            let line = format!("add nbd+unix:///?socket={},timeout=10", sock.display());
            thread::spawn(move || ctl.handle(&line))
        };
        let t = std::time::Instant::now();
        while !writing.load(Ordering::SeqCst) {
            assert!(t.elapsed() < Duration::from_secs(10), "the add never wrote");
            std::thread::sleep(Duration::from_millis(10));
        }
        let t = std::time::Instant::now();
        let m = ok(&ctl, "fail 1");
        assert!(m.contains("faulty"), "{m}");
        assert!(
            t.elapsed() < Duration::from_secs(1),
            "fail answered after {:?}, behind the add's write to the slow server",
            t.elapsed()
        );
        let v = adding.join().unwrap();
        assert_eq!(v["ok"], true, "{v}");
        server.shutdown();
    }
}
