//! The automatic re-add's work (see `readd.rs` for the rules and the state it keeps): raid1d's
//! probes, the judgement of a leg's superblock, the check installed on a leg's reconnections,
//! and [`Raid1::readd_status`].

use std::sync::Weak;
use std::time::Instant;

use blk::{Bio, Buffer, Device, EndIo, Error, Op, SECTOR_SHIFT};
use blkq_sync::atomic::Ordering;
use blkq_sync::DynArc as StdArc;
use blkq_sync::Mutex;

use crate::barrier::paired;
use crate::device::{Array, Raid1};
use crate::error::Raid1Error;
use crate::events::Event;
use crate::generation::Kinship;
use crate::placement::{left_in_sync, readd_covers, Assembly, AssemblyError};

use super::{InFlight, Probe, ProbeEnd, ReaddStatus};
use crate::superblock::{Role, Superblock, SB_OFFSET, SB_SIZE};

/// The check a mirror installs on a leg's device that reconnects by itself (a remote leg,
/// [`blk::Device::check_connections`]): every new connection reads the leg's superblock
/// before anything is sent on it, and [`Array::identify`] judges it as the re-add does. A leg
/// refused is failed, the refusal named in the log and in [`Raid1::readd_status`], and the
/// device fails every request from then on: nothing the array writes (its superblocks above
/// all) reaches the leg. It stays so until the operator removes it and adds it again.
struct LegConnections {
    inner: Weak<Array>,
    slot: usize,
    /// The placement (`Leg::gen`) it was installed for: another one is not judged.
    gen: u64,
}

impl blk::ConnectCheck for LegConnections {
    fn range(&self) -> (u64, usize) {
        (SB_OFFSET, SB_SIZE)
    }

    fn check(&self, bytes: &[u8]) -> Result<(), String> {
        match self.inner.upgrade() {
            Some(inner) => inner.judge_connection(self.slot, self.gen, bytes),
            None => Ok(()),
        }
    }

    fn lost_writes(&self) -> bool {
        self.inner
            .upgrade()
            .is_some_and(|inner| inner.leg_lost_writes(self.slot, self.gen))
    }
}

/// What a probe's answer decides.
enum Verdict {
    Down(String),
    Unchanged,
    Refuse(Vec<u8>, String),
    Readd { bitmap: bool },
}

impl Array {
    /// Leg `i` (placement `gen`) is failed by hand (or found faulty at assembly): never
    /// probed. Returns what it was, for [`Array::unmark_manual`].
    pub(crate) fn mark_manual(&self, i: usize) -> bool {
        let gen = self.legs[i].gen.load(Ordering::Acquire);
        let mut p = self.readd.probes[i].lock();
        if p.gen != gen {
            *p = Probe {
                gen,
                ..Probe::default()
            };
        }
        std::mem::replace(&mut p.manual, true)
    }

    pub(crate) fn unmark_manual(&self, i: usize, was: bool) {
        self.readd.probes[i].lock().manual = was;
    }

    /// Counts a re-add of slot `i` by [`Raid1::readd_absent`], for the slot's new placement.
    pub(crate) fn count_readd(&self, i: usize) {
        let gen = self.legs[i].gen.load(Ordering::Acquire);
        let mut p = self.readd.probes[i].lock();
        let (readds, backoff) = (p.readds + 1, p.backoff + 1);
        *p = Probe {
            gen,
            readds,
            backoff,
            ..Probe::default()
        };
    }

    /// raid1d, every tick and when a probe completes: sends the probes that are due, and
    /// acts on the answers (see the module docs).
    pub(crate) fn probe_legs(&self) {
        let Some(interval) = self.cfg.readd_interval else {
            return;
        };
        // Acquire: pairs with `ProbeEnd::end_io`'s Release.
        self.readd.done.swap(false, Ordering::Acquire);
        if self.durable.is_failed() {
            return;
        }
        let now = Instant::now();
        for i in 0..self.legs.len() {
            let l = &self.legs[i];
            let st = l.state.load();
            let gen = l.gen.load(Ordering::Acquire);
            let Some(dev) = l.dev() else { continue };
            let verdict = {
                let mut p = self.readd.probes[i].lock();
                p.renew(gen);
                if st.is_member() {
                    p.backoff = 0; // back in sync: the next failure is probed at once again
                }
                if !st.is_failed() || p.manual {
                    p.in_flight = None;
                    p.next = None;
                    continue;
                }
                match p.in_flight.as_mut() {
                    Some(f) => {
                        let out = f.end.out.lock().take();
                        let Some((bio, res)) = out else {
                            if !f.timed_out && now.duration_since(f.since) >= interval {
                                f.timed_out = true;
                                p.last_error = Some(format!(
                                    "no answer to a superblock read within {} ms",
                                    interval.as_millis()
                                ));
                            }
                            continue;
                        };
                        p.in_flight = None;
                        p.next = Some(now + interval);
                        self.judge(i, res.map(|()| bio.buf), p.refused.as_ref())
                    }
                    None => {
                        let Some(next) = p.next else {
                            // Just failed: the first probe after an interval, longer each
                            // time a re-added leg failed again before it was back in sync
                            // (a local disk with a bad sector in a dirty chunk), up to 64.
                            p.next = Some(now + interval * (1u32 << p.backoff.min(6)));
                            continue;
                        };
                        if now < next {
                            continue;
                        }
                        let me = self.me.clone();
                        let end = StdArc::new(ProbeEnd {
                            out: Mutex::new(None),
                            notify: Box::new(move || {
                                if let Some(inner) = me.upgrade() {
                                    // Release: see `ProbeEnd::notify`.
                                    inner.readd.done.store(true, Ordering::Release);
                                    inner.daemon_wq.wake_all();
                                }
                            }),
                        });
                        p.in_flight = Some(InFlight {
                            end: end.clone(),
                            since: now,
                            timed_out: false,
                        });
                        p.next = Some(now + interval);
                        drop(p);
                        let b = Bio::with_buf(
                            Op::Read,
                            SB_OFFSET >> SECTOR_SHIFT,
                            Buffer::new(SB_SIZE),
                        );
                        let e: StdArc<dyn EndIo> = end;
                        // Not under the probe's lock (a device may take its time to take a
                        // bio; `status` reads that lock). May complete inline: `end_io`
                        // takes only `out`'s lock.
                        dev.submit(b, &e);
                        continue;
                    }
                }
            };
            self.act(i, gen, &dev, verdict);
        }
    }

    /// Judges a probe's answer for slot `i` (see the module docs).
    fn judge(
        &self,
        i: usize,
        res: Result<Option<Buffer>, Error>,
        refused: Option<&(Vec<u8>, String)>,
    ) -> Verdict {
        let buf = match res {
            Err(e) => return Verdict::Down(format!("superblock read: {e}")),
            Ok(None) => return Verdict::Down("superblock read returned no data".into()),
            Ok(Some(b)) => b,
        };
        let bytes = buf.as_slice();
        if refused.is_some_and(|(r, _)| r.as_slice() == bytes) {
            return Verdict::Unchanged;
        }
        let Some(other) = self.in_sync_other(i) else {
            return Verdict::Down("no in-sync leg to compare its superblock with".into());
        };
        match self.identify(i, other, bytes) {
            Ok(bitmap) => Verdict::Readd { bitmap },
            Err(why) => Verdict::Refuse(bytes.to_vec(), why),
        }
    }

    /// An in-sync leg other than `i`, if any.
    fn in_sync_other(&self, i: usize) -> Option<usize> {
        (0..self.legs.len()).find(|&j| j != i && self.legs[j].state.load().is_member())
    }

    /// Whether `bytes`, read at a leg's superblock place, make it slot `i`'s leg of this
    /// array at a point of the array's history: the rules of assembly ([`Assembly::decide`])
    /// applied to its superblock and the array's view as slot `other` carries it (assembly
    /// sees the two side by side; the slot's own view would share the leg's UUID). `Ok`
    /// says whether the bitmap's dirty chunks cover what it missed (the re-add rule,
    /// [`readd_covers`]); `Err` why it is another history: no superblock, another array,
    /// another leg of this slot or another slot, events past the array's, or a history that
    /// diverged. The one judge of a returning leg: the automatic re-add's probe and every
    /// reconnection of a leg ([`LegConnections`]).
    fn identify(&self, i: usize, other: usize, bytes: &[u8]) -> Result<bool, String> {
        let sb = Superblock::decode(bytes)
            .map_err(|e| format!("it carries no superblock of this array ({e})"))?;
        let ours = self.superblock_for(other);
        let slot = |sb: &Superblock| match sb.role {
            Role::Slot(n) => format!("slot {n}"),
            Role::Spare => "a spare".to_string(),
        };
        match Assembly::decide(&[Some(&ours), Some(&sb)]) {
            Err(AssemblyError::ForeignLeg { .. }) => Err(format!(
                "its superblock belongs to array {}, not {}",
                sb.array_uuid, ours.array_uuid
            )),
            Err(AssemblyError::DuplicateLeg { .. }) => Err(format!(
                "its superblock names leg {}, which is slot {other}'s",
                sb.leg_uuid
            )),
            Err(e) => Err(e.to_string()),
            Ok(a) if a.newest != 0 => Err(
                if ours.lineage.kinship(&sb.lineage) == Kinship::Descendant {
                    format!(
                        "its history went on without this array: its {} follows the array's \
                         {} (it ran, and was written, without this array)",
                        sb.lineage, ours.lineage
                    )
                } else {
                    format!(
                        "its events ({}) are past the array's ({}): it was written without \
                         this array",
                        sb.events, ours.events
                    )
                },
            ),
            Ok(a) if a.slots[1] != Some(i) => Err(format!(
                "its superblock is {} (leg {}), not slot {i}'s leg ({})",
                slot(&sb),
                sb.leg_uuid,
                ours.legs.get(i).map_or(uuid::Uuid::nil(), |l| l.uuid)
            )),
            Ok(_) => Ok(self.bitmap.as_ref().is_some_and(|bm| {
                readd_covers(
                    &ours.lineage,
                    sb.lineage.current.id,
                    left_in_sync(&sb, i),
                    sb.events,
                    bm.events_cleared(),
                )
            })),
        }
    }

    /// Has every later connection of slot `i`'s device judged by [`Array::identify`]
    /// (`LegConnections`), for a device that reconnects by itself (a remote leg). Called
    /// when a device is placed in the slot (assembly, creation, `add_leg`, the re-add).
    pub(crate) fn watch_connections(&self, i: usize) {
        let l = &self.legs[i];
        let Some(dev) = l.dev() else { return };
        let check = LegConnections {
            inner: self.me.clone(),
            slot: i,
            gen: l.gen.load(Ordering::Acquire),
        };
        dev.check_connections(Some(StdArc::new(check)));
    }

    /// Whether `bytes` are a superblock this array wrote to slot `i`'s leg while it was in
    /// the array: this array and this slot's leg, the array's history, the array's events.
    /// Such a leg of a live array (present, not failed) is taken back on its reconnection
    /// whatever view it holds: the array wrote every superblock the leg carries, so a view
    /// that differs is one the array has since changed in memory (a change whose superblock
    /// write had not reached the leg). Assembly's tie-break between two views at equal events
    /// (the one recording a failure is newer) is for legs read side by side after a stop, not
    /// for a live array judging its own leg. A leg that ran without the array carries
    /// another generation ([`Array::identify`] refuses it).
    fn left_as_written(&self, i: usize, other: usize, bytes: &[u8]) -> bool {
        let Ok(sb) = Superblock::decode(bytes) else {
            return false;
        };
        let ours = self.superblock_for(other);
        sb.array_uuid == ours.array_uuid
            && ours.legs.get(i).is_some_and(|l| l.uuid == sb.leg_uuid)
            && sb.role == Role::Slot(i as u32)
            && sb.lineage == ours.lineage
            && sb.events == ours.events
    }

    /// Leg `i`'s connection broke with writes its server acknowledged and never flushed: the
    /// server may have lost them (a restart that emptied its cache), so the leg may now hold
    /// older data than the array acknowledged. It fails before anything more is read from it
    /// (the device fails what waits instead of serving it); the writes' bits stay set, as
    /// for any failed leg, so its return copies them back. Whether this array took it over
    /// (false: not this array's leg any more).
    fn leg_lost_writes(&self, i: usize, gen: u64) -> bool {
        let l = &self.legs[i];
        if l.gen.load(Ordering::Acquire) != gen || !l.state.load().is_present() {
            return false;
        }
        if !l.state.load().is_faulty() {
            self.fail_leg(
                i,
                "its connection broke with writes its server acknowledged and never flushed; \
                 the server may have lost them (its dirty chunks are copied back when it \
                 returns)",
            );
        }
        true
    }

    /// A new connection of slot `i`'s device (placement `gen`) answered with `bytes` at its
    /// superblock's place: refused unless it is this slot's leg of this array (see
    /// `LegConnections`).
    fn judge_connection(&self, i: usize, gen: u64, bytes: &[u8]) -> Result<(), String> {
        let l = &self.legs[i];
        if l.gen.load(Ordering::Acquire) != gen || !l.state.load().is_present() {
            return Ok(()); // not this array's leg any more
        }
        // The array's view: an in-sync leg's, else another slot's (the array's own, as
        // `superblock_for` builds it for any slot): a mirror has at least two slots.
        let Some(other) = self
            .in_sync_other(i)
            .or_else(|| (0..self.legs.len()).find(|&j| j != i))
        else {
            return Ok(());
        };
        if !l.state.load().is_faulty() && self.left_as_written(i, other, bytes) {
            return Ok(());
        }
        let Err(why) = self.identify(i, other, bytes) else {
            return Ok(());
        };
        self.emit(Event::ReaddRefused {
            slot: i,
            why: format!("on reconnection, failed and nothing sent to it: {why}"),
        });
        {
            let mut p = self.readd.probes[i].lock();
            p.renew(gen);
            p.last_error = None;
            p.refused = Some((bytes.to_vec(), format!("on reconnection: {why}")));
        }
        // Not in sync any more, whatever it held: the device fails every request from now
        // on (the last in-sync leg is not failed: the array fails on its errors instead).
        self.fail_leg(i, "refused on reconnection");
        Err(why)
    }

    fn act(&self, i: usize, gen: u64, dev: &StdArc<dyn Device>, verdict: Verdict) {
        let probes = &self.readd.probes[i];
        match verdict {
            Verdict::Down(why) => {
                tracing::debug!("raid1: leg {i} still down: {why}");
                probes.lock().last_error = Some(why);
            }
            Verdict::Unchanged => {}
            Verdict::Refuse(bytes, why) => {
                self.emit(Event::ReaddRefused {
                    slot: i,
                    why: format!("it answers again, left faulty and untouched: {why}"),
                });
                let mut p = probes.lock();
                p.last_error = None;
                p.refused = Some((bytes, why));
            }
            Verdict::Readd { bitmap } => match self.readd_in_place(i, dev, gen, bitmap) {
                Ok(true) => {
                    self.emit(Event::LegAdded {
                        slot: i,
                        readd: true,
                    });
                    let dirty = self.bitmap.as_ref().map_or(0, |b| {
                        b.dirty_chunks().iter().map(|c| c.end - c.first).sum()
                    });
                    if bitmap {
                        tracing::info!(
                            "raid1: leg {i} answers again: re-added, recovering the \
                                 bitmap's {dirty} dirty chunks"
                        );
                    } else {
                        tracing::info!(
                            "raid1: leg {i} answers again: re-added, recovering in full \
                                 (it was not in sync when it left, or is behind the bitmap)"
                        );
                    }
                }
                Ok(false) => {}
                Err(e) => {
                    tracing::warn!("raid1: leg {i}: re-add failed: {e}");
                    probes.lock().last_error = Some(format!("re-add failed: {e}"));
                }
            },
        }
    }

    /// Puts faulty leg `i` back as a recovering leg, as `add_leg` re-adds, if the slot still
    /// holds `dev` in placement `gen` and it is still faulty. Returns whether it did.
    fn readd_in_place(
        &self,
        i: usize,
        dev: &StdArc<dyn Device>,
        gen: u64,
        bitmap: bool,
    ) -> Result<bool, Raid1Error> {
        let l = &self.legs[i];
        self.barriers.freeze_array(0);
        let st = l.state.load();
        let ours = !self.durable.is_failed()
            && st.is_failed()
            && l.gen.load(Ordering::Acquire) == gen
            && l.dev().is_some_and(|d| StdArc::ptr_eq(&d, dev));
        if ours {
            // SAFETY: frozen above.
            unsafe { self.place_frozen(i, dev.clone(), bitmap, st.is_write_mostly()) };
            // The new placement keeps its history (manual stays off); recorded while frozen,
            // before the sync thread can recover it, so a status that shows it back shows
            // the re-add too.
            let mut p = self.readd.probes[i].lock();
            p.gen = l.gen.load(Ordering::Acquire);
            p.readds += 1;
            p.backoff += 1;
            p.last_error = None;
            p.refused = None;
        }
        paired(self.barriers.unfreeze_array());
        if !ours {
            return Ok(false);
        }
        self.sync.ctl.lock().recovery_blocked = false;
        self.state_changed();
        let recorded = self
            .write_superblocks()
            .and_then(|()| self.persist_bitmap());
        self.placement_recorded(i);
        recorded?;
        Ok(true)
    }
}

impl Raid1 {
    /// What the automatic re-add knows of slot `i` (see `readd=`), or None for no such slot.
    pub fn readd_status(&self, i: usize) -> Option<ReaddStatus> {
        let inner = &self.inner;
        let l = inner.legs.get(i)?;
        let st = l.state.load();
        let gen = l.gen.load(Ordering::Acquire);
        let p = inner.readd.probes[i].lock();
        let current = p.gen == gen;
        Some(ReaddStatus {
            probing: inner.cfg.readd_interval.is_some() && st.is_failed() && !(current && p.manual),
            last_error: p.last_error.clone().filter(|_| current),
            refused: p
                .refused
                .as_ref()
                .filter(|_| current)
                .map(|(_, w)| w.clone()),
            readds: p.readds,
            backoff: p.backoff,
        })
    }
}
