//! Adding a leg to a running array: where it goes (a re-add into its old slot with a bitmap
//! recovery, or a fresh leg with a full one), which history it may come from (see
//! `generation`: a leg that diverged is refused unless its side is discarded, and then the two
//! sides' bitmaps are joined), and taking it back out when its addition cannot be recorded.

use blk::{Bio, Device, SECTOR_SHIFT};
use blkq_sync::DynArc as StdArc;
use uuid::Uuid;

use crate::barrier::paired;
use crate::bitmap::WriteIntentBitmap;
use crate::device::Raid1;
use crate::error::Raid1Error;
use crate::generation::Kinship;
use crate::readd::AbsentError;
use crate::superblock::{Role, Superblock};

impl Raid1 {
    /// Puts `dev` into an empty slot as a recovering leg (recovery offset 0: written, not
    /// read) and wakes the sync thread, which recovers it. Returns the slot. Writes its
    /// superblock and bitmap.
    ///
    /// A re-add (md's `--re-add`): when `dev`'s own superblock says it held slot `n` of this
    /// array, slot `n` is empty and still names it, it was in sync when it left, and no bit
    /// of the bitmap was cleared since (its generation is this array's and the bitmap's
    /// `events_cleared` is not past its events, or its generation is an earlier one of this
    /// array's and no bit was cleared since the array left it), it goes back into slot `n`
    /// (write-mostly if its superblock says so) and
    /// recovers only the bitmap's dirty chunks (of an earlier generation, its own bitmap's
    /// too, and then only if that bitmap can be read). Any other leg gets a fresh UUID and a
    /// full recovery.
    ///
    /// A leg of this array whose history went on without it (see [`crate::generation`]) is
    /// refused ([`Raid1Error::Diverged`]): it holds writes the array lacks.
    pub fn add_leg(&self, dev: StdArc<dyn Device>) -> Result<usize, Raid1Error> {
        self.add_leg_with(dev, false)
    }

    /// As [`Raid1::add_leg`], and a leg whose history diverged from the array's is taken
    /// too, its writes discarded (the operator's choice of side, `blkq raid add --discard`):
    /// the array's bitmap takes the union of both sides' dirty chunks, and recovery copies
    /// those, so both legs end equal to the array. When either side cleared bits since they
    /// parted, the union may miss a change, and the leg is recovered in full instead.
    pub fn add_leg_discarding(&self, dev: StdArc<dyn Device>) -> Result<usize, Raid1Error> {
        self.add_leg_with(dev, true)
    }

    /// [`Raid1::add_leg`] (or, with `discard`, [`Raid1::add_leg_discarding`]), naming the leg
    /// `name` (its device spec: [`Raid1::set_leg_name`]) from its first event on.
    pub fn add_named_leg(
        &self,
        dev: StdArc<dyn Device>,
        discard: bool,
        name: Option<String>,
    ) -> Result<usize, Raid1Error> {
        self.add_leg_named(dev, discard, name)
    }

    fn add_leg_with(&self, dev: StdArc<dyn Device>, discard: bool) -> Result<usize, Raid1Error> {
        self.add_leg_named(dev, discard, None)
    }

    fn add_leg_named(
        &self,
        dev: StdArc<dyn Device>,
        discard: bool,
        name: Option<String>,
    ) -> Result<usize, Raid1Error> {
        let inner = &self.inner;
        inner.refuse_if_failed()?;
        let (have, need) = (dev.limits().capacity, inner.data_offset + inner.capacity);
        if have < need {
            return Err(Raid1Error::Config(format!(
                "new leg is too small: {have} bytes, the array needs {need} ({} of data \
                 after a {}-byte superblock and bitmap area)",
                inner.capacity, inner.data_offset
            )));
        }
        let old_sb = Self::read_superblock(dev.as_ref()).ok();
        let readd_slot = match &old_sb {
            Some(sb) => self.readd_slot(dev.as_ref(), sb, discard)?,
            None => None,
        };
        inner.barriers.freeze_array(0);
        let free = |i: usize| !inner.legs[i].state.load().is_present();
        let (slot, readd) = match readd_slot.filter(|&n| free(n)) {
            Some(n) => (Some(n), true),
            None => ((0..inner.legs.len()).find(|&i| free(i)), false),
        };
        let mut old_uuid = Uuid::nil();
        if let Some(i) = slot {
            let l = &inner.legs[i];
            old_uuid = *l.uuid.lock();
            *l.uuid.lock() = match (&old_sb, readd) {
                // A re-add into a slot that may name no leg any more: its own UUID.
                (Some(sb), true) => sb.leg_uuid,
                _ => Uuid::new_v4(),
            };
            // A re-add keeps the leg's write-mostly flag, as its own superblock records it (a
            // remote leg stays one when it comes back).
            let write_mostly = match (&old_sb, readd) {
                (Some(sb), true) => sb.legs.get(i).is_some_and(|l| l.write_mostly),
                _ => false,
            };
            // SAFETY: frozen above.
            unsafe { inner.place_frozen(i, dev, readd, write_mostly) };
        }
        paired(inner.barriers.unfreeze_array());
        let i = slot.ok_or(Raid1Error::Config("no free slot".into()))?;
        // Named and told before its recovery can start (`state_changed` wakes the sync thread).
        if name.is_some() {
            self.set_leg_name(i, name);
        }
        inner.emit(crate::events::Event::LegAdded { slot: i, readd });
        inner.sync.ctl.lock().recovery_blocked = false;
        inner.state_changed();
        let recorded = inner
            .write_superblocks()
            .and_then(|()| inner.persist_bitmap());
        if recorded.is_err() {
            // Not recorded: the leg is not part of the array (a crash now would find it with
            // no superblock, and assembly refuses such a device). Still recovering (not
            // recovered before its record: `Leg::unrecorded`), so it goes.
            self.unplace(i, old_uuid);
        }
        inner.placement_recorded(i);
        if let Err(e) = recorded {
            inner.emit(crate::events::Event::LegRemoved { slot: i });
            self.set_leg_name(i, None);
            return Err(e);
        }
        Ok(i)
    }

    /// Takes back a leg the array started without because its device could not be opened
    /// then (`blkq serve --raid1-degraded` with a remote leg whose server was down) and that
    /// opens now: `dev`. Judged by its superblock as a returning leg is, never taken blindly:
    /// it must carry this array's superblock for an empty slot (the slot its superblock names,
    /// which names that leg, or was emptied since by a run without it), from a history the
    /// array's contains (the same generation at no more events, or an earlier one of the
    /// array's); anything else is [`AbsentError::Refused`] and `dev` is not written. Taken,
    /// it goes back in place as [`Raid1::add_leg`] re-adds (recovering; only the bitmap's
    /// dirty chunks when the re-add rule holds, in full otherwise; its write-mostly flag
    /// kept) and counts as an automatic re-add ([`Raid1::readd_status`]). Returns its slot
    /// and whether the recovery is the bitmap's; [`AbsentError::Gone`] when its slot holds a
    /// leg again (the operator added one) or the array failed.
    pub fn readd_absent(&self, dev: StdArc<dyn Device>) -> Result<(usize, bool), AbsentError> {
        let inner = &self.inner;
        let gone = |why: String| Err(AbsentError::Gone(why));
        if let Err(e) = inner.refuse_if_failed() {
            return gone(e.to_string());
        }
        let refuse = |why: String| Err(AbsentError::Refused(why));
        let (have, need) = (dev.limits().capacity, inner.data_offset + inner.capacity);
        if have < need {
            return refuse(format!(
                "it is smaller than the array: {have} bytes, the array needs {need}"
            ));
        }
        let sb = match Self::read_superblock(dev.as_ref()) {
            Ok(sb) => sb,
            Err(Raid1Error::Superblock(e)) => {
                return refuse(format!("it carries no superblock of this array ({e})"))
            }
            Err(e) => return Err(AbsentError::Down(e.to_string())),
        };
        let (array_uuid, lineage, events) = {
            let m = inner.meta.lock();
            (m.array_uuid, m.lineage.clone(), m.events)
        };
        if sb.array_uuid != array_uuid {
            return refuse(format!(
                "its superblock belongs to array {}, not {array_uuid}",
                sb.array_uuid
            ));
        }
        let Role::Slot(slot) = sb.role else {
            return refuse(format!(
                "its superblock is a spare's (leg {}), not a slot's",
                sb.leg_uuid
            ));
        };
        let slot = slot as usize;
        let Some(l) = inner.legs.get(slot) else {
            return refuse(format!(
                "its superblock is slot {slot}'s, and the array has {} slots",
                inner.legs.len()
            ));
        };
        let named = *l.uuid.lock();
        if l.state.load().is_present() {
            if named == sb.leg_uuid {
                return gone(format!("it is back in slot {slot} already"));
            }
            return refuse(format!(
                "its superblock is slot {slot}'s leg {}, and the slot holds another leg \
                 ({named})",
                sb.leg_uuid
            ));
        }
        if !(named == sb.leg_uuid || named.is_nil()) {
            return refuse(format!(
                "its superblock is slot {slot}'s leg {}, and the slot names leg {named}",
                sb.leg_uuid
            ));
        }
        if lineage.kinship(&sb.lineage) == Kinship::Same && sb.events > events {
            return refuse(format!(
                "its events ({}) are past the array's ({events}): it was written without this \
                 array",
                sb.events
            ));
        }
        // The history rules and the recovery's kind, as `add_leg` has them; a leg that
        // diverged (or went on without the array) is refused, never discarded here.
        let bitmap = match self.readd_slot(dev.as_ref(), &sb, false) {
            Ok(n) => n == Some(slot),
            Err(e @ Raid1Error::Diverged { .. }) => return refuse(e.to_string()),
            Err(e) => return Err(AbsentError::Down(e.to_string())),
        };
        let write_mostly = sb.legs.get(slot).is_some_and(|i| i.write_mostly);
        inner.barriers.freeze_array(0);
        let free = !l.state.load().is_present() && !inner.durable.is_failed();
        let old_uuid = *l.uuid.lock();
        if free {
            *l.uuid.lock() = sb.leg_uuid;
            // SAFETY: frozen above.
            unsafe { inner.place_frozen(slot, dev, bitmap, write_mostly) };
            inner.count_readd(slot);
        }
        paired(inner.barriers.unfreeze_array());
        if !free {
            // Another leg, or a failure, came first: the next attempt says which.
            return Err(AbsentError::Down(format!(
                "slot {slot} changed meanwhile (a leg added, or the array failed)"
            )));
        }
        inner.sync.ctl.lock().recovery_blocked = false;
        inner.state_changed();
        let recorded = inner
            .write_superblocks()
            .and_then(|()| inner.persist_bitmap());
        if recorded.is_err() {
            self.unplace(slot, old_uuid);
        }
        inner.placement_recorded(slot);
        if let Err(e) = recorded {
            return Err(AbsentError::Down(format!("recording its return: {e}")));
        }
        Ok((slot, bitmap))
    }

    /// The slot `dev` (whose superblock is `sb`) goes back into with a bitmap recovery, if
    /// any (see [`Raid1::add_leg`] and [`Raid1::add_leg_discarding`]); a diverged leg is an
    /// error unless `discard`, and then its bitmap's bits join the array's.
    fn readd_slot(
        &self,
        dev: &dyn Device,
        sb: &Superblock,
        discard: bool,
    ) -> Result<Option<usize>, Raid1Error> {
        let inner = &self.inner;
        let (array_uuid, lineage) = {
            let m = inner.meta.lock();
            (m.array_uuid, m.lineage.clone())
        };
        if sb.array_uuid != array_uuid {
            return Ok(None);
        }
        let kin = lineage.kinship(&sb.lineage);
        if !discard && matches!(kin, Kinship::Diverged | Kinship::Descendant) {
            return Err(Raid1Error::Diverged {
                leg: sb.lineage.current.id,
                array: lineage.current.id,
                newer: kin == Kinship::Descendant,
            });
        }
        let Some(bm) = inner.bitmap.as_ref() else {
            return Ok(None);
        };
        let Role::Slot(n) = sb.role else {
            return Ok(None);
        };
        let n = n as usize;
        let Some(l) = inner.legs.get(n) else {
            return Ok(None);
        };
        // The slot still names the leg, or names none (a slot emptied by a restart without
        // its leg: the generations below tell whether the leg may come back).
        let named = *l.uuid.lock();
        if !(named == sb.leg_uuid || named.is_nil())
            || !sb.legs.get(n).is_some_and(|i| i.in_sync && !i.faulty)
        {
            return Ok(None);
        }
        // No bit is cleared from here until the leg is placed (its recovery's state then keeps
        // the array degraded) or turned away (`state_changed` below).
        let cleared = bm.hold_clears();
        let ok = match kin {
            Kinship::Same => crate::placement::readd_rule(true, sb.events, cleared),
            Kinship::Ancestor => {
                // Its own dirty bits join: writes it took that the array may lack (it
                // stopped with them in flight). When its bitmap cannot be read, the array's
                // alone may miss a chunk it changed: a full recovery, as for a diverged side.
                crate::placement::readd_covers(
                    &lineage,
                    sb.lineage.current.id,
                    true,
                    sb.events,
                    cleared,
                ) && match self.leg_bitmap(dev, sb)? {
                    Some((bits, _)) => {
                        bm.load(bits.as_slice())?;
                        true
                    }
                    None => {
                        tracing::warn!(
                            "raid1: slot {n}: the returning leg's own bitmap cannot be read, \
                             so the chunks it changed are unknown: full recovery"
                        );
                        false
                    }
                }
            }
            Kinship::Diverged | Kinship::Descendant => {
                let common = lineage.common(&sb.lineage);
                let theirs = self.leg_bitmap(dev, sb)?.filter(|(_, t)| {
                    crate::placement::parted_covers(
                        &lineage,
                        cleared,
                        &sb.lineage,
                        t.events_cleared(),
                    )
                });
                match theirs {
                    Some((bits, _)) => {
                        bm.load(bits.as_slice())?;
                        tracing::info!(
                            "raid1: slot {n}: discarding the leg's writes since generation \
                             {common:016x}: the chunks either side changed are recovered"
                        );
                        true
                    }
                    _ => {
                        tracing::warn!(
                            "raid1: slot {n}: discarding the leg's writes, but a side's \
                             bitmap cannot show every chunk changed since they parted: full \
                             recovery"
                        );
                        false
                    }
                }
            }
        };
        if !ok {
            // No bitmap recovery: the leg goes in for a full one (placed, it keeps the array
            // degraded), or not at all; clears go on as the array's state says.
            bm.update_degraded(|| inner.is_degraded());
        }
        Ok(ok.then_some(n))
    }

    /// The write-intent bitmap on leg `dev` (superblock `sb`) of this array, as bytes and
    /// loaded; None when it cannot be read or is damaged.
    fn leg_bitmap(
        &self,
        dev: &dyn Device,
        sb: &Superblock,
    ) -> Result<Option<(blk::Buffer, WriteIntentBitmap)>, Raid1Error> {
        let Some(bm) = self.inner.bitmap.as_ref() else {
            return Ok(None);
        };
        let theirs = WriteIntentBitmap::new(self.inner.capacity, bm.chunk_size())?;
        let b = Bio::with_buf(
            blk::Op::Read,
            sb.bitmap.offset >> SECTOR_SHIFT,
            blk::Buffer::new(theirs.disk_len()),
        );
        let (back, r) = blk::submit_wait(dev, b);
        Ok(r.ok()
            .and(back.buf)
            .filter(|bits| theirs.load(bits.as_slice()).is_ok())
            .map(|bits| (bits, theirs)))
    }

    /// Takes the leg just put into slot `i` back out (its addition failed).
    fn unplace(&self, i: usize, old_uuid: Uuid) {
        let inner = &self.inner;
        let l = &inner.legs[i];
        inner.barriers.freeze_array(0);
        if !l.state.load().in_sync() {
            l.state.remove();
            // SAFETY: frozen above.
            let _ = unsafe { l.set_dev_frozen(None) };
            *l.uuid.lock() = old_uuid;
        }
        paired(inner.barriers.unfreeze_array());
        inner.state_changed();
    }
}
