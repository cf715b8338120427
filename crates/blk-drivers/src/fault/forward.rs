//! Forwarding an I/O the rules let through to the inner device, and its completion on the way
//! back: failing it instead, the undo read of the crash model, the slot that carries what its
//! completion needs (module docs, "Completions without allocation"), the flipped copy of a
//! write, and the delay on the timer thread.

use std::time::{Duration, Instant};

use blk::{Bio, BioFlags, Buffer, Device, EndIo, Error, Op};
use blkq_sync::thread;
use blkq_sync::DynArc as Arc;

use super::rules::{Flip, Verdict};
use super::shared::{
    bio_range, bump, class_index, errno_err, modifies, Ack, FaultState, Late, Slot,
};
use super::undo::UndoEntry;

/// A copy of a write's payload with `f`'s bit flipped; `None` when it has no byte there.
fn flipped_copy(bio: &Bio, f: Flip) -> Option<Buffer> {
    let src = bio.buf.as_ref()?;
    if f.at as usize >= src.len() {
        return None;
    }
    let mut copy = Buffer::new(src.len());
    copy.as_mut_slice().copy_from_slice(src.as_slice());
    f.apply(copy.as_mut_slice()).then_some(copy)
}

impl FaultState {
    /// Fails (after its delay) or forwards to `inner` an I/O the rules let through the stall
    /// stage.
    pub(super) fn dispatch(
        self: &Arc<Self>,
        inner: &dyn Device,
        bio: Bio,
        end: &Arc<dyn EndIo>,
        v: Verdict,
        completer: &Arc<dyn EndIo>,
    ) {
        if let Some(bio) = self.prepare(inner, bio, end, v) {
            inner.submit(bio, completer);
        }
    }

    /// Everything before forwarding to `inner`: fails, undo read, slot. `None`: completed
    /// already.
    pub(super) fn prepare(
        self: &Arc<Self>,
        inner: &dyn Device,
        mut bio: Bio,
        end: &Arc<dyn EndIo>,
        v: Verdict,
    ) -> Option<Bio> {
        let mut ack = Ack {
            delay: v.delay,
            flip: v.flip,
            ..Ack::default()
        };
        if let Some(errno) = v.fail {
            bump(&self.counters.failed[class_index(bio.op)]);
            self.complete(bio, Err(errno_err(errno)), end.clone(), ack);
            return None;
        }
        let undo = if self.volatile && modifies(bio.op) && !bio.flags.contains(BioFlags::FUA) {
            // A bio the inner device will refuse needs no undo read (and a huge bad one must
            // not make us read gigabytes): it fails with the inner device's own error.
            if let Err(e) = inner.limits().validate(&bio) {
                self.complete(bio, Err(e), end.clone(), ack);
                return None;
            }
            match self.read_old(inner, &bio) {
                Ok(chunks) => Some(chunks),
                Err(e) => {
                    self.complete(bio, Err(e), end.clone(), ack);
                    return None;
                }
            }
        } else {
            None
        };
        {
            let mut st = self.state.lock();
            if st.crashed {
                drop(st);
                bump(&self.counters.crashed_io);
                self.complete(bio, Err(errno_err(libc::EIO)), end.clone(), Ack::default());
                return None;
            }
            ack.epoch = st.epoch;
            ack.flush_mark = st.acks;
            if let Some(chunks) = undo {
                let id = st.next_undo;
                st.next_undo += 1;
                st.undo.push(UndoEntry {
                    id,
                    offset: bio_range(&bio).0,
                    chunks,
                    acked: None,
                });
                ack.undo = Some(id);
            }
            st.in_flight += 1;
        }
        // A flipped write forwards a copy and keeps the submitter's buffer in its slot.
        let mut orig = None;
        if let Some(f) = ack.flip.filter(|_| bio.op == Op::Write) {
            match flipped_copy(&bio, f) {
                Some(copy) => orig = bio.buf.replace(copy),
                None => ack.flip = None,
            }
        }
        let mut slots = self.slots.lock();
        let slot = Slot {
            end: Some(end.clone()),
            cookie: bio.cookie,
            ack,
            orig,
        };
        let idx = match slots.free.pop() {
            Some(i) => {
                slots.v[i as usize] = slot;
                i
            }
            None => {
                slots.v.push(slot);
                (slots.v.len() - 1) as u32
            }
        };
        bio.cookie = u64::from(idx);
        Some(bio)
    }

    /// A forwarded I/O came back from the inner device.
    pub(super) fn on_inner_done(self: &Arc<Self>, mut bio: Bio, res: Result<(), Error>) {
        let taken = {
            let mut slots = self.slots.lock();
            let idx = bio.cookie;
            match slots.v.get_mut(idx as usize) {
                Some(s) if s.end.is_some() => {
                    let end = s.end.take();
                    bio.cookie = s.cookie;
                    let ack = s.ack;
                    let orig = s.orig.take();
                    slots.free.push(idx as u32);
                    end.map(|e| (e, ack, orig))
                }
                _ => None,
            }
        };
        // A cookie that is not ours would be an inner device's bug; the bio cannot be routed.
        let Some((end, mut ack, orig)) = taken else {
            return;
        };
        if let Some(f) = ack.flip {
            // A write forwarded the flipped copy; a read that succeeded flips its data now.
            let flipped = orig.is_some()
                || (bio.op == Op::Read
                    && res.is_ok()
                    && bio.buf.as_mut().is_some_and(|b| f.apply(b.as_mut_slice())));
            if flipped && res.is_ok() {
                bump(&self.counters.flipped[class_index(bio.op)]);
            } else if !flipped {
                ack.flip = None;
            }
        }
        if let Some(o) = orig {
            // The submitter's own buffer back; the flipped copy goes.
            bio.buf = Some(o);
        }
        let idle = {
            let mut st = self.state.lock();
            st.in_flight = st.in_flight.saturating_sub(1);
            st.in_flight == 0
        };
        if idle {
            // Outside the state lock; with nobody waiting this is a fence and a load.
            self.idle_wq.wake_all();
        }
        self.complete(bio, res, end, ack);
    }

    /// Delivers now, or after `ack.delay` on the timer thread.
    pub(super) fn complete(
        self: &Arc<Self>,
        bio: Bio,
        res: Result<(), Error>,
        end: Arc<dyn EndIo>,
        ack: Ack,
    ) {
        if ack.delay.is_zero() {
            self.deliver(bio, res, &end, ack);
            return;
        }
        bump(&self.counters.delayed);
        // Absurd delays (a `Duration::MAX` rule) are clamped, never a panic.
        let now = Instant::now();
        let due = now
            .checked_add(ack.delay)
            .or_else(|| now.checked_add(Duration::from_secs(1 << 32)))
            .unwrap_or(now);
        let late = Late { bio, res, end, ack };
        let spawn = || {
            let sh = self.clone();
            thread::spawn(move || sh.timer.run(|l| sh.deliver(l.bio, l.res, &l.end, l.ack)))
        };
        if let Err(l) = self.timer.push(due, late, spawn) {
            // The device is being dropped: delivered at once.
            self.deliver(l.bio, l.res, &l.end, l.ack);
        }
    }
}
