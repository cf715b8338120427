//! The fault device's volatile write cache: the undo log's bookkeeping at each
//! acknowledgement (the log itself is `undo`'s), and the crash that rolls it back. Run by the submitters' threads (undo
//! reads), whichever thread delivers a completion (bookkeeping), and the thread that calls
//! `FaultHandle::crash` (roll back).
//!
//! # Waiting
//!
//! Two waits, both on `waitq` wait queues:
//! - a synchronous I/O on the inner device (`blk::submit_wait`: undo reads, roll back writes,
//!   the final flush) waits on its `blk::PendingBio`'s queue for the completion to be stored;
//!   the completion stores it under the mutex, drops the mutex, then wakes;
//! - a crash waits on `FaultState::idle_wq` until `State::in_flight` is 0 and takes the undo log
//!   in the same look (under the state lock), so no forwarded I/O can still acknowledge into
//!   it; `on_inner_done` wakes it after dropping the state lock. New I/Os cannot raise
//!   `in_flight` meanwhile: `crashed` is set first, and `prepare` checks it under the same
//!   lock before counting an I/O in flight.

use blk::error::with_context;
use blk::{submit_wait, Bio, BioFlags, Buffer, Device, EndIo, Error, Op, SECTOR_SHIFT};
use blkq_sync::DynArc as Arc;

use super::handle::FaultHandle;
use super::rules::{mix, Flip};
use super::shared::{bio_range, bump, errno_err, modifies, Ack, FaultState};
use super::undo::UndoEntry;

impl FaultState {
    /// Hands a completion to its submitter, after the crash-model bookkeeping.
    pub(super) fn deliver(
        &self,
        bio: Bio,
        mut res: Result<(), Error>,
        end: &Arc<dyn EndIo>,
        ack: Ack,
    ) {
        if self.volatile {
            let mut st = self.state.lock();
            if st.crashed || ack.epoch != st.epoch {
                if res.is_ok() {
                    bump(&self.counters.crashed_io);
                    res = Err(errno_err(libc::EIO));
                }
            } else {
                if res.is_ok() {
                    if bio.op == Op::Flush {
                        let mark = ack.flush_mark;
                        st.undo.retain(|e| !matches!(e.acked, Some(a) if a <= mark));
                    } else if modifies(bio.op) && bio.flags.contains(BioFlags::FUA) {
                        patch_undo(&mut st.undo, &bio, ack.flip);
                    }
                }
                if let Some(id) = ack.undo {
                    st.acks += 1;
                    let n = st.acks;
                    if let Some(e) = st.undo.iter_mut().find(|e| e.id == id) {
                        e.acked = Some(n);
                    }
                }
            }
        }
        end.end_io(bio, res);
    }

    /// Reads the current contents of a modifying bio's range from the inner device.
    pub(super) fn read_old(&self, inner: &dyn Device, bio: &Bio) -> Result<Vec<Buffer>, Error> {
        let (off, len) = bio_range(bio);
        let max = u64::from(inner.limits().max_io_bytes.clamp(4096, 1 << 20));
        let lbs = u64::from(inner.limits().logical_block_size.max(512));
        let max = (max / lbs * lbs).max(lbs);
        let mut chunks = Vec::new();
        let mut pos = 0;
        while pos < len {
            let n = (len - pos).min(max);
            bump(&self.counters.undo_reads);
            let rd = Bio::with_buf(
                Op::Read,
                (off + pos) >> SECTOR_SHIFT,
                Buffer::new(n as usize),
            );
            let (rd, res) = submit_wait(inner, rd);
            res?;
            chunks.push(rd.buf.ok_or(Error::NoBuffer)?);
            pos += n;
        }
        Ok(chunks)
    }
}

/// Patches the parts of undo entries that a durable (FUA) modifying bio overwrote, with what
/// it stored: its data with `flip`'s bit flipped (a flipped write's buffer is the
/// submitter's, unflipped, again by now), or zeros.
fn patch_undo(undo: &mut [UndoEntry], bio: &Bio, flip: Option<Flip>) {
    let (off, len) = bio_range(bio);
    let flipped = flip.map(|f| (off + u64::from(f.at), f.mask));
    let end = off.saturating_add(len);
    let data = match bio.op {
        Op::Write => bio.buf.as_ref().map(|b| b.as_slice()),
        _ => None,
    };
    for e in undo.iter_mut() {
        let mut c0 = e.offset;
        for c in &mut e.chunks {
            let c1 = c0 + c.len() as u64;
            let (s, t) = (c0.max(off), c1.min(end));
            if s < t {
                let dst = &mut c.as_mut_slice()[(s - c0) as usize..(t - c0) as usize];
                match data {
                    Some(d) if d.len() as u64 >= t - off => {
                        dst.copy_from_slice(&d[(s - off) as usize..(t - off) as usize]);
                        if let Some((at, mask)) = flipped.filter(|&(at, _)| s <= at && at < t) {
                            dst[(at - s) as usize] ^= mask;
                        }
                    }
                    _ => dst.fill(0),
                }
            }
            c0 = c1;
        }
    }
}

/// What a crash rolled back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CrashReport {
    /// Writes (and discards, write-zeroes) rolled back.
    pub writes_lost: u64,
    /// Bytes rewritten with their old contents.
    pub bytes_restored: u64,
    /// Stalled I/Os failed.
    pub stalled_failed: u64,
    /// Unflushed writes that reached the medium whole ([`FaultHandle::crash_partial`]).
    pub writes_kept: u64,
    /// Unflushed writes that reached it in part (torn), also counted in `writes_lost`.
    pub writes_torn: u64,
}

/// What a crash lets through of the unflushed writes ([`FaultHandle::crash_partial`]): a real
/// disk's volatile cache may have written any of them back before the power went, and a
/// write of several atomic units may land in part.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Partial {
    /// Seeds every choice: the same seed over the same undo log gives the same medium.
    pub seed: u64,
    /// Per mille of the unflushed writes that reach the medium whole.
    pub keep: u32,
    /// Per mille of the others that reach it in part: each of their `unit`s lands with
    /// probability one half.
    pub tear: u32,
    /// The atomic unit a torn write is cut in, in bytes (at least the inner device's logical
    /// block; units are aligned to it on the device).
    pub unit: u64,
}

/// Adds `[a, b)` minus the `holes` (sorted by start, may overlap) to `out`.
fn subtract(a: u64, b: u64, holes: &[(u64, u64)], out: &mut Vec<(u64, u64)>) {
    let mut at = a;
    for &(s, t) in holes {
        if t <= at || s >= b {
            continue;
        }
        if s > at {
            out.push((at, s));
        }
        at = at.max(t);
    }
    if at < b {
        out.push((at, b));
    }
}

impl FaultHandle {
    /// Writes (and discards, write-zeroes) in the undo log: not yet durable, lost by a crash
    /// now. Always 0 without the volatile cache.
    pub fn unflushed_writes(&self) -> usize {
        self.sh.state.lock().undo.len()
    }

    /// Whether the device is crashed.
    pub fn is_crashed(&self) -> bool {
        self.sh.state.lock().crashed
    }

    /// Crashes the device: every write not yet durable is rolled back on the inner device
    /// (module docs, "The crash model"), and every I/O fails with `EIO` until
    /// [`restart`](Self::restart). Waits for the I/Os in flight in the inner device (an inner
    /// device that never completes them hangs it). Needs [`FaultConfig::volatile_cache`](super::FaultConfig::volatile_cache);
    /// crashing a crashed device does nothing. If a roll back write fails, the first error is
    /// returned after every other entry has been tried. Once the device is dropped, fails
    /// with `ENODEV`.
    pub fn crash(&self) -> Result<CrashReport, Error> {
        self.crash_partial(Partial::default())
    }

    /// [`crash`](Self::crash), but a seeded part of the unflushed writes survives: `p.keep`
    /// per mille of them whole, `p.tear` per mille of the rest torn (a seeded half of their
    /// `p.unit`s). What a newer surviving write put on the medium is never rolled back by an
    /// older lost one, so every sector ends holding its last durable content or the data of
    /// one of the unflushed writes to it, no older than a surviving one. `Partial::default()`
    /// is `crash`.
    pub fn crash_partial(&self, p: Partial) -> Result<CrashReport, Error> {
        let sh = &self.sh;
        if !sh.volatile {
            return Err(Error::NotSupported(
                "crash needs a fault device with volatile_cache",
            ));
        }
        let Some(inner) = sh.inner.lock().clone() else {
            return Err(Error::Io(with_context(
                std::io::Error::from_raw_os_error(libc::ENODEV),
                "crash: the fault device was dropped",
            )));
        };
        let _crashing = sh.crash_lock.lock();
        {
            let mut st = sh.state.lock();
            if st.crashed {
                return Ok(CrashReport::default());
            }
            st.crashed = true;
            st.epoch += 1;
        }
        bump(&sh.counters.crashes);
        let mut report = CrashReport::default();
        let held = std::mem::take(&mut *sh.stalled.lock());
        for h in held {
            report.stalled_failed += 1;
            bump(&sh.counters.crashed_io);
            h.end.end_io(h.bio, Err(errno_err(libc::EIO)));
        }
        // Wait for the I/Os in flight in the inner device, taking the undo log once they are
        // all back (module docs above, "Waiting").
        let undo = sh.idle_wq.wait_for(|| {
            let mut st = sh.state.lock();
            (st.in_flight == 0).then(|| std::mem::take(&mut st.undo))
        });
        let lbs = u64::from(inner.limits().logical_block_size.max(512));
        let unit = (p.unit.max(lbs) / lbs * lbs).max(lbs);
        let mut first_err = None;
        // What newer writes left on the medium (sorted, disjoint byte ranges).
        let mut kept: Vec<(u64, u64)> = Vec::new();
        let mut restore = Vec::new();
        for e in undo.into_iter().rev() {
            let len: u64 = e.chunks.iter().map(|c| c.len() as u64).sum();
            let (a, b) = (e.offset, e.offset + len);
            let roll = mix(p.seed ^ mix(e.id));
            let mut landed: Vec<(u64, u64)> = Vec::new();
            if roll % 1000 < u64::from(p.keep) {
                report.writes_kept += 1;
                landed.push((a, b));
            } else {
                report.writes_lost += 1;
                bump(&sh.counters.writes_lost);
                if (roll >> 20) % 1000 < u64::from(p.tear) && b - a > lbs {
                    report.writes_torn += 1;
                    let mut u = a / unit * unit;
                    while u < b {
                        if mix(roll ^ u) & 1 == 1 {
                            landed.push((u.max(a), (u + unit).min(b)));
                        }
                        u += unit;
                    }
                }
            }
            // Roll back what neither this write's landed units nor a newer write cover.
            let mut holes: Vec<(u64, u64)> = kept.iter().chain(&landed).copied().collect();
            holes.sort_unstable();
            restore.clear();
            subtract(a, b, &holes, &mut restore);
            let mut c0 = a;
            for c in &e.chunks {
                let c1 = c0 + c.len() as u64;
                for &(s, t) in &restore {
                    let (s, t) = (s.max(c0), t.min(c1));
                    if s >= t {
                        continue;
                    }
                    let mut buf = Buffer::new((t - s) as usize);
                    buf.as_mut_slice()
                        .copy_from_slice(&c.as_slice()[(s - c0) as usize..(t - c0) as usize]);
                    let mut w = Bio::with_buf(Op::Write, s >> SECTOR_SHIFT, buf);
                    w.flags = BioFlags::FUA;
                    let (_, res) = submit_wait(&*inner, w);
                    match res {
                        Ok(()) => report.bytes_restored += t - s,
                        Err(err) => {
                            first_err.get_or_insert(err);
                        }
                    }
                }
                c0 = c1;
            }
            if !landed.is_empty() {
                kept.extend(landed);
                kept.sort_unstable();
                let mut merged: Vec<(u64, u64)> = Vec::with_capacity(kept.len());
                for (s, t) in kept.drain(..) {
                    match merged.last_mut() {
                        Some(m) if s <= m.1 => m.1 = m.1.max(t),
                        _ => merged.push((s, t)),
                    }
                }
                kept = merged;
            }
        }
        if let (_, Err(err)) = submit_wait(&*inner, Bio::new(Op::Flush, 0, 0)) {
            first_err.get_or_insert(err);
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(report),
        }
    }

    /// Ends a crash: I/O works again, against the rolled-back contents.
    pub fn restart(&self) {
        let _crashing = self.sh.crash_lock.lock();
        self.sh.state.lock().crashed = false;
    }
}
