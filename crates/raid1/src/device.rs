//! The [`Raid1`] device: its types (config, errors, legs, per-I/O slots, the shared `Array`),
//! the public leg-management API (`fail_leg`, `remove_leg`, `add_leg` with re-add, ...),
//! `Drop` (stop the sync thread, drain, stop raid1d, mark clean) and the `blk::Device` impl.
//!
//! A mirror is a `Device` of its own, not a [`blk::Filter`]: it has no one device below to
//! forward to (reads go to the leg the balancing picks, writes to every leg, and the legs
//! come and go), so it answers every method itself: its limits and capabilities (no zero-copy
//! path, a costly allocation map where a leg's is), no queue or disk counters of its own (the
//! NBD server counts at its layer), and its legs' reconnection checks stay its own.
//!
//! Runs on the caller's thread; `Array::fail_leg`/`state_changed` are also called from
//! completion contexts, raid1d and the sync thread. The rest lives in `assemble.rs`
//! (start-up), `io.rs` (the I/O path), `daemon.rs` (raid1d) and `resync.rs` (the sync thread).
//!
//! See the crate docs for the design. `std::sync::Arc` appears here only at the `blk::Device`
//! boundary (legs are `Arc<dyn Device>` and completions `Arc<dyn EndIo>`, which blk types with
//! std's `Arc`; loom's `Arc` cannot hold unsized values). Everything else comes from the facade.

use blkq_sync::DynArc as StdArc;
use std::sync::Weak;

use blk::Extent;
use blk::{Bio, BufferPool, Caps, Device, EndIo, Error, Limits, SECTOR_SHIFT};
use blkq_sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use blkq_sync::stat::ShardedCounters;
use blkq_sync::{thread, CachePadded, Mutex};

use crate::slot::AdmittedCell;

use uuid::Uuid;
use waitq::WaitQueue;

use crate::barrier::{paired, Barriers};
use crate::bitmap::WriteIntentBitmap;
use crate::config::Raid1Config;
use crate::error::Raid1Error;
use crate::generation::Lineage;
use crate::legset::LegSet;
use crate::legstate::{LegState, LegStateCell};
use crate::superblock::{ArrayState, Superblock};

// Leg state: see `legstate` (its table, and the orderings of its loads and transitions).
// `pending` and `head` are Relaxed: read-balance hints that decide nothing else (any leg
// chosen from them is correct). `pending` is two sharded statistics counters (bios sent,
// bios returned; see `Leg::pending`): every write touches every leg, so one shared atomic
// per leg was a cache line that every submitter and completer of the array wrote.

/// One slot in this many is sampled for a leg's round-trip time (see `Leg::note_rtt`).
pub(crate) const RTT_SAMPLE: u32 = 8;

/// The run-time state of one slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LegStatus {
    /// A device is in the slot.
    pub present: bool,
    /// Holds all data.
    pub in_sync: bool,
    /// Failed: neither read nor written.
    pub faulty: bool,
    /// Read only when nothing else can serve.
    pub write_mostly: bool,
    /// For a present leg that is not in sync: array bytes below this are in sync.
    pub recovery_offset: u64,
    /// Corrected read errors so far.
    pub read_errors: u32,
    /// Round-trip time of the leg's reads and writes: an EWMA (weight 1/8) of their
    /// completion latency, in ns, on the coarse clock (`blk::stats::batch_ns`: 1-4 ms
    /// resolution, so it tells remote legs from local ones and slow links from fast ones,
    /// not a local disk's microseconds). 0 before the first sample.
    pub rtt_ns: u64,
    /// Writes acknowledged and still in flight to this leg (`write_behind=N`: a write-mostly
    /// leg; 0 for the others).
    pub write_behind: u32,
    /// Blocks read from this leg that did not match their checksums (integrity on).
    pub checksum_errors: u64,
}

pub(crate) struct Leg {
    /// The device, for slow paths (raid1d, sync thread, flushes, tools). Its lock also orders
    /// the writers of `admitted_dev`.
    pub(crate) dev: Mutex<Option<StdArc<dyn Device>>>,
    /// The same device as regular I/O reads it, under a barrier admission: read without a
    /// lock, replaced only with the array frozen and `dev` locked (see `slot`).
    pub(crate) admitted_dev: AdmittedCell<Option<StdArc<dyn Device>>>,
    pub(crate) uuid: Mutex<Uuid>,
    pub(crate) state: LegStateCell,
    /// Requests in flight (read balancing hint): counter 0 counts bios sent, counter 1 bios
    /// returned, each in the calling thread's shard ([`Leg::inc_pending`],
    /// [`Leg::dec_pending`], [`Leg::pending`]).
    pub(crate) pending: ShardedCounters<2>,
    /// End sector of the last read sent here (sequential-stream detection).
    pub(crate) head: AtomicU64,
    pub(crate) read_errors: AtomicU32,
    /// `LegStatus::checksum_errors` (a statistic: relaxed).
    pub(crate) checksum_errors: AtomicU64,
    /// `LegStatus::rtt_ns`. Relaxed load and store by the completions: a statistic, two
    /// completions at once may lose one sample, and it publishes nothing else.
    /// Sampled (see [`Leg::note_rtt`]) and on its own line, away from `state`, which every
    /// I/O reads.
    pub(crate) rtt_ns: CachePadded<AtomicU64>,
    pub(crate) recovery_offset: AtomicU64,
    /// A recovering leg that returned (re-add): it needs only the bitmap's dirty chunks.
    pub(crate) bitmap_recovery: AtomicBool,
    /// Bumped each time the slot's device is set or taken (with the array frozen): a
    /// recovery pass works for one placement of one leg (`resync::still_target`).
    pub(crate) gen: AtomicU64,
    /// The slot's device declares a costly allocation map ([`blk::Caps::slow_extents`]: a
    /// remote leg). Set with the device (`set_dev_frozen`); read by [`Raid1`]'s `caps`, per
    /// read of the NBD server (relaxed: a hint of cost, ordering nothing).
    pub(crate) slow_extents: AtomicBool,
    /// Placed (`place_frozen`) and not yet recorded by the superblocks: not recovered until
    /// it is (`Array::placement_recorded`), as md writes the superblocks before a spare's
    /// recovery starts. A leg is then never in sync, nor counted in sync by a superblock,
    /// before it carries a superblock of its own; and one whose record fails is still
    /// recovering, so taking it out again (`unplace`) leaves nothing of it. Ordering: set
    /// (Release) before the leg's state says it is present, cleared (Release) after the
    /// record, and read (Acquire) by the sync thread before it picks a leg to recover; a
    /// thread that sees the leg present sees the flag set, and the clear wakes the sync
    /// thread, which asks again (no other state hangs on it).
    pub(crate) unrecorded: AtomicBool,
}

impl Leg {
    pub(crate) fn empty() -> Self {
        Self {
            dev: Mutex::new(None),
            admitted_dev: AdmittedCell::new(None),
            uuid: Mutex::new(Uuid::nil()),
            state: LegStateCell::new(),
            pending: ShardedCounters::new(),
            head: AtomicU64::new(u64::MAX),
            read_errors: AtomicU32::new(0),
            checksum_errors: AtomicU64::new(0),
            rtt_ns: CachePadded(AtomicU64::new(0)),
            recovery_offset: AtomicU64::new(0),
            bitmap_recovery: AtomicBool::new(false),
            slow_extents: AtomicBool::new(false),
            gen: AtomicU64::new(0),
            unrecorded: AtomicBool::new(false),
        }
    }

    pub(crate) fn dev(&self) -> Option<StdArc<dyn Device>> {
        self.dev.lock().clone()
    }

    /// A bio was sent to the leg.
    #[inline]
    pub(crate) fn inc_pending(&self) {
        self.pending.add(0, 1);
    }

    /// A bio sent to the leg came back.
    #[inline]
    pub(crate) fn dec_pending(&self) {
        self.pending.add(1, 1);
    }

    /// Bios in flight on the leg (a snapshot of two sums taken one after the other: a hint).
    pub(crate) fn pending(&self) -> u64 {
        let returned = self.pending.sum(1);
        self.pending.sum(0).saturating_sub(returned)
    }

    /// One bio's round trip, from the I/O in slot `id`: `rtt += (sample - rtt) / 8` (the
    /// first sample is taken whole). Only the I/Os of one slot in [`RTT_SAMPLE`] are sampled
    /// after the first, so that the completions of the array do not all write one line.
    #[inline]
    pub(crate) fn note_rtt(&self, id: u32, sample_ns: u64) {
        // Relaxed: see `rtt_ns`.
        let old = self.rtt_ns.load(Ordering::Relaxed);
        if old != 0 && !id.is_multiple_of(RTT_SAMPLE) {
            return;
        }
        let new = if old == 0 {
            sample_ns.max(1)
        } else {
            (old - old / 8 + sample_ns / 8).max(1)
        };
        self.rtt_ns.store(new, Ordering::Relaxed);
    }

    /// Puts `dev` in the slot (or empties it), returning what was there.
    ///
    /// # Safety
    ///
    /// The caller has frozen the array with `freeze_array(0)` (the rule of `slot`).
    pub(crate) unsafe fn set_dev_frozen(
        &self,
        dev: Option<StdArc<dyn Device>>,
    ) -> Option<StdArc<dyn Device>> {
        let mut g = self.dev.lock();
        // Release, under the freeze: a pass that reads the same gen under a later freeze or
        // raised window reads it after this change.
        self.gen.fetch_add(1, Ordering::AcqRel);
        // SAFETY: frozen by the caller; `g` orders the writers.
        let _ = unsafe { self.admitted_dev.replace_frozen(dev.clone()) };
        let slow = dev.as_ref().is_some_and(|d| d.caps().slow_extents);
        self.slow_extents.store(slow, Ordering::Relaxed);
        std::mem::replace(&mut *g, dev)
    }

    /// Runs `f` with the device, without a lock.
    ///
    /// # Safety
    ///
    /// The caller holds an unqueued barrier admission for the whole call (the rule of `slot`).
    #[inline]
    pub(crate) unsafe fn with_dev<R>(&self, f: impl FnOnce(Option<&dyn Device>) -> R) -> R {
        // SAFETY: the caller's admission (see `slot`).
        unsafe { self.admitted_dev.with_admitted(|d| f(d.as_deref())) }
    }
}

/// One completion handle per leg slot (one such set per thread shard, `Array::ends`).
pub(crate) type LegEnds = Box<[StdArc<dyn EndIo>]>;

/// Completion of a leg bio: the bio's cookie names the `Io` slot.
pub(crate) struct LegEnd {
    pub(crate) inner: Weak<Array>,
    pub(crate) leg: usize,
    /// `completion_ref=counted`: upgrade `inner` per completion (the simple rule) instead of
    /// counting in on the array's `retirement` (see `retire`).
    pub(crate) counted: bool,
}

impl EndIo for LegEnd {
    #[inline]
    fn end_io(&self, bio: Bio, res: Result<(), Error>) {
        if self.counted {
            if let Some(inner) = self.inner.upgrade() {
                inner.leg_done(self.leg, bio, res);
            }
            return;
        }
        // SAFETY: the rule of `retire`. This bio was submitted by the array and is not yet
        // counted back, so its owner has not retired it (`Raid1`'s drop retires after its
        // drain, which waits for this bio's I/O): the array's value is alive now, and its
        // allocation lives while this handle's `Weak` does. From `enter` to `exit` the
        // owner's reference is held for us; after `exit` nothing of the array is touched.
        let array = unsafe { &*self.inner.as_ptr() };
        let inside = array.retirement.enter(blkq_sync::thread_slot());
        array.leg_done(self.leg, bio, res);
        // The last one out drops the owner's reference here (the array may go with it).
        drop(array.retirement.exit(inside));
    }
}

/// A leg placed in a slot at start-up.
pub(crate) struct Placed {
    pub(crate) slot: usize,
    pub(crate) dev: StdArc<dyn Device>,
    pub(crate) uuid: Uuid,
    pub(crate) state: LegState,
    pub(crate) recovery_offset: u64,
    /// Its own superblock's `events` and in-sync flag (a stale leg that was in sync may get
    /// a bitmap recovery).
    pub(crate) sb_events: u64,
    pub(crate) was_in_sync: bool,
    pub(crate) readd: bool,
    /// Its own superblock's generation.
    pub(crate) generation: u64,
}

/// What `launch` needs.
pub(crate) struct Launch {
    pub(crate) nr_slots: usize,
    pub(crate) placed: Vec<Placed>,
    /// The UUID each slot names in the newest superblock (empty for a new array).
    pub(crate) slot_uuids: Vec<Uuid>,
    pub(crate) array_uuid: Uuid,
    pub(crate) events: u64,
    /// The history the array continues (see `generation`).
    pub(crate) lineage: Lineage,
    /// The slots in sync in that generation (a bit per slot).
    pub(crate) members: u64,
    pub(crate) data_offset: u64,
    pub(crate) capacity: u64,
    pub(crate) lbs: u32,
    pub(crate) max_io: u32,
    pub(crate) bitmap: Option<WriteIntentBitmap>,
    /// Per-block checksums, loaded (see `integrity`).
    pub(crate) sums: Option<crate::integrity::Checksums>,
    pub(crate) cfg: Raid1Config,
    /// The array was not stopped cleanly: resync.
    pub(crate) resync: bool,
}

pub(crate) struct ArrayMeta {
    pub(crate) array_uuid: Uuid,
    pub(crate) events: u64,
    pub(crate) state: ArrayState,
    /// The array's generations (see `generation`): a new one starts when a slot leaves
    /// `members`.
    pub(crate) lineage: Lineage,
    /// The slots in sync in the current generation (a bit per slot), as of the last
    /// superblock write.
    pub(crate) members: u64,
}

/// The array's state, shared by the [`Raid1`] handle, the I/O path, raid1d, the sync thread
/// and the legs' completions.
pub(crate) struct Array {
    pub(crate) cfg: Raid1Config,
    pub(crate) legs: Box<[Leg]>,
    /// Each leg's completion handle, one set per thread shard (`ends[shard][leg]`, see
    /// `Array::leg_end`).
    pub(crate) ends: Box<[LegEnds]>,
    pub(crate) data_offset: u64,
    pub(crate) capacity: u64,
    pub(crate) logical_block_size: u32,
    pub(crate) max_io: u32,
    pub(crate) barriers: Barriers,
    pub(crate) bitmap: Option<WriteIntentBitmap>,
    /// Per-block checksums (see `integrity`).
    pub(crate) sums: Option<crate::integrity::Checksums>,
    /// Serialises bitmap writes so later snapshots land later (see `bitmap`).
    pub(crate) persist: Mutex<()>,
    /// The per-I/O slots and the failed reads' retry queue (see `slots`).
    pub(crate) slots: crate::slots::Slots,
    pub(crate) daemon_wq: WaitQueue,
    pub(crate) stop: AtomicBool,
    pub(crate) meta: Mutex<ArrayMeta>,
    /// Leg failures, their durability, the held writes, the failed array, the superblocks'
    /// dirty flag (see `failure::durable`).
    pub(crate) durable: crate::failure::durable::DurableState,
    /// Array byte offset up to which a running resync has made the legs agree (u64::MAX: no
    /// resync running).
    pub(crate) resync_point: AtomicU64,
    pub(crate) pool: BufferPool,
    /// The bitmap's clock origin, on the coarse clock (`blk::stats::coarse_ns`): see
    /// [`Array::bitmap_now`].
    pub(crate) origin_ns: u64,
    /// The sync thread's state (see `sync`).
    pub(crate) sync: crate::resync::SyncState,
    /// The automatic re-add's probes (see `readd`).
    pub(crate) readd: crate::readd::ReaddState,
    /// This array, for completions raid1d hands out (a probe's).
    pub(crate) me: Weak<Array>,
    /// Write-behind (see `behind`).
    pub(crate) wb: crate::behind::WriteBehind,
    /// The leg completions in progress, and the owner's reference once `Raid1` is dropped
    /// (see `retire`).
    pub(crate) retirement: crate::retire::Retirement<StdArc<Array>>,
    /// The state changes' log lines and subscribers (see `events`).
    pub(crate) events: crate::events::Hub,
}

/// A RAID1 array over two or more legs. See the crate docs.
pub struct Raid1 {
    pub(crate) inner: StdArc<Array>,
    pub(crate) daemon: Option<thread::JoinHandle<()>>,
    pub(crate) syncer: Option<thread::JoinHandle<()>>,
    /// `crash_for_test`: stop without writing clean superblocks.
    pub(crate) crashed: bool,
    /// What `assemble` found wrong and worked around (see [`Raid1::assemble_warnings`]).
    pub(crate) warnings: Vec<String>,
}

impl std::fmt::Debug for Raid1 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Raid1")
            .field("legs", &self.inner.legs.len())
            .field("capacity", &self.inner.capacity)
            .finish()
    }
}

pub(crate) fn eio(what: &'static str) -> Error {
    Error::Io(std::io::Error::other(what))
}

impl Raid1 {
    /// The barrier buckets (a resync thread raises/lowers windows here).
    pub fn barriers(&self) -> &Barriers {
        &self.inner.barriers
    }

    /// The write-intent bitmap, if any (`dirty_chunks` is what a resync copies).
    pub fn bitmap(&self) -> Option<&WriteIntentBitmap> {
        self.inner.bitmap.as_ref()
    }

    /// Where data starts on every leg, bytes.
    pub fn data_offset(&self) -> u64 {
        self.inner.data_offset
    }

    /// Number of slots (legs plus empty slots).
    pub fn slots(&self) -> usize {
        self.inner.legs.len()
    }

    /// The per-block checksums' algorithm and what they found, if the array keeps them.
    pub fn integrity(
        &self,
    ) -> Option<(
        crate::integrity::Algorithm,
        crate::integrity::IntegrityCounts,
    )> {
        let t = self.inner.sums.as_ref()?;
        Some((t.area.algorithm, t.counts()))
    }

    /// The state of slot `i`.
    pub fn leg_status(&self, i: usize) -> Option<LegStatus> {
        let l = self.inner.legs.get(i)?;
        let st = l.state.load();
        Some(LegStatus {
            present: st.is_present(),
            in_sync: st.in_sync(),
            faulty: st.is_faulty(),
            write_mostly: st.is_write_mostly(),
            recovery_offset: l.recovery_offset.load(Ordering::Acquire),
            read_errors: l.read_errors.load(Ordering::Relaxed),
            checksum_errors: l.checksum_errors.load(Ordering::Relaxed),
            rtt_ns: l.rtt_ns.load(Ordering::Relaxed),
            write_behind: if self.inner.wb.limit > 0 && st.is_write_mostly() {
                self.inner.wb.outstanding()
            } else {
                0
            },
        })
    }

    /// The device in slot `i` (for a resync thread's direct leg I/O; offsets on it are leg
    /// offsets: add [`Raid1::data_offset`]).
    pub fn leg_device(&self, i: usize) -> Option<StdArc<dyn Device>> {
        self.inner.legs.get(i)?.dev()
    }

    /// What [`Raid1::assemble`] found wrong and worked around (a leg whose superblock could
    /// not be read, superblocks that disagree at the same events), one sentence each; also
    /// logged as warnings. Empty for a healthy start.
    pub fn assemble_warnings(&self) -> &[String] {
        &self.warnings
    }

    /// Why the array failed (every write and flush fails; see [`Raid1::fail_leg`]'s rules in
    /// docs/design.md), or None while it works.
    pub fn failure(&self) -> Option<&'static str> {
        self.inner.durable.why()
    }

    /// Writes acknowledged and still in flight to the write-behind legs (`write_behind=N`:
    /// at most N).
    pub fn write_behind_outstanding(&self) -> u32 {
        self.inner.wb.outstanding()
    }

    /// Whether the array runs with a slot faulty or not in sync.
    pub fn is_degraded(&self) -> bool {
        self.inner.is_degraded()
    }

    /// Marks slot `i` faulty (refused for the last in-sync leg, and on a failed array).
    pub fn fail_leg(&self, i: usize) -> Result<(), Raid1Error> {
        self.fail_leg_for(i, "failed by the operator")
    }

    /// As [`Raid1::fail_leg`], telling `cause` (`events`).
    pub(crate) fn fail_leg_for(&self, i: usize, cause: &'static str) -> Result<(), Raid1Error> {
        if i >= self.inner.legs.len() {
            return Err(Raid1Error::Slot(i, "no such slot"));
        }
        self.inner.refuse_if_failed()?;
        // Before the bit: raid1d must never see it faulty and not failed by hand (it would
        // re-add it).
        let was = self.inner.mark_manual(i);
        if self.inner.fail_leg(i, cause) {
            Ok(())
        } else {
            self.inner.unmark_manual(i, was);
            Err(Raid1Error::Slot(i, "last in-sync leg, or not present"))
        }
    }

    /// Takes a faulty (or not in sync) leg out of its slot, with the array frozen, and writes
    /// the superblocks (an error if they cannot be written: the leg is out all the same).
    pub fn remove_leg(&self, i: usize) -> Result<StdArc<dyn Device>, Raid1Error> {
        let l = self
            .inner
            .legs
            .get(i)
            .ok_or(Raid1Error::Slot(i, "no such slot"))?;
        self.inner.barriers.freeze_array(0);
        let st = l.state.load();
        let r = if let Err(e) = self.inner.refuse_if_failed() {
            Err(e)
        } else if !st.is_present() {
            Err(Raid1Error::Slot(i, "empty"))
        } else if st.in_sync() && !st.is_faulty() {
            Err(Raid1Error::Slot(i, "in sync: fail it first"))
        } else {
            l.state.remove();
            // SAFETY: frozen above.
            Ok(unsafe { l.set_dev_frozen(None) })
        };
        paired(self.inner.barriers.unfreeze_array());
        let dev = r?.ok_or(Raid1Error::Slot(i, "empty"))?;
        // Not the array's leg any more: its connections are not judged by it.
        dev.check_connections(None);
        self.inner.state_changed();
        self.inner
            .emit(crate::events::Event::LegRemoved { slot: i });
        self.set_leg_name(i, None);
        // On disk before this returns (md updates the superblock on a hot remove): the leg
        // may be pulled at once, and assembly must then not need it.
        self.inner.write_superblocks()?;
        Ok(dev)
    }

    /// Records recovery progress of a recovering leg: array bytes below `offset` are in sync
    /// (reads below it may use the leg).
    pub fn set_recovery_offset(&self, i: usize, offset: u64) -> Result<(), Raid1Error> {
        let l = self
            .inner
            .legs
            .get(i)
            .ok_or(Raid1Error::Slot(i, "no such slot"))?;
        l.recovery_offset.store(offset, Ordering::Release);
        self.inner.durable.set_dirty();
        Ok(())
    }

    /// Marks a present, non-faulty leg in sync (recovery done).
    pub fn set_in_sync(&self, i: usize) -> Result<(), Raid1Error> {
        if i >= self.inner.legs.len() {
            return Err(Raid1Error::Slot(i, "no such slot"));
        }
        self.inner.refuse_if_failed()?;
        if !self.inner.mark_in_sync(i) {
            return Err(Raid1Error::Slot(i, "not present or faulty"));
        }
        self.inner.state_changed();
        Ok(())
    }

    /// For a resync thread: legs agree below array byte `offset`; reads reaching past it go to
    /// the first usable leg (the resync's source). `None` when the resync is done.
    pub fn set_resync_point(&self, offset: Option<u64>) {
        self.inner
            .resync_point
            .store(offset.unwrap_or(u64::MAX), Ordering::Release);
    }

    /// Sets or clears write-mostly on slot `i`.
    pub fn set_write_mostly(&self, i: usize, on: bool) -> Result<(), Raid1Error> {
        let l = self
            .inner
            .legs
            .get(i)
            .ok_or(Raid1Error::Slot(i, "no such slot"))?;
        // Frozen: no write is behind on the leg (a write behind holds its admission until
        // every leg has it) and no read is admitted, so a read that may now choose it finds
        // every write there (invariant 5 of `behind`).
        self.inner.barriers.freeze_array(0);
        l.state.set_write_mostly(on);
        paired(self.inner.barriers.unfreeze_array());
        self.inner.state_changed();
        Ok(())
    }

    /// The superblock slot `i` would carry now.
    pub fn superblock(&self, i: usize) -> Option<Superblock> {
        (i < self.inner.legs.len()).then(|| self.inner.superblock_for(i))
    }

    /// Writes the superblocks now (otherwise the background thread does after changes).
    pub fn sync_superblocks(&self) -> Result<(), Raid1Error> {
        self.inner.write_superblocks()
    }
}

impl Raid1 {
    /// For tests: stops the array like a crash (power cut after the last completed I/O):
    /// in-flight I/O drains and the threads stop, but the superblocks are not marked clean,
    /// so the next [`Raid1::assemble`] resyncs.
    pub fn crash_for_test(mut self) {
        self.crashed = true;
    }
}

impl Drop for Raid1 {
    fn drop(&mut self) {
        // The sync thread first: it may hold a raised window, which a freeze would wait for,
        // and it waits for the freeze to end before raising another.
        self.stop_sync_thread();
        // Drain: wait for in-flight I/O (queued retries are finished by raid1d on its way
        // out), then stop the thread.
        self.inner.barriers.freeze_array(0);
        self.inner.stop.store(true, Ordering::Release);
        self.inner.daemon_wq.wake_all();
        if let Some(t) = self.daemon.take() {
            let _ = t.join();
        }
        paired(self.inner.barriers.unfreeze_array());
        if !self.crashed {
            // The checksums' dirty pages reach the legs (and are flushed) before the
            // superblocks say clean (see `integrity`).
            if self.inner.sums.is_some() {
                self.inner.flush_legs();
            }
            // md marks the array clean only when no resync is left to do.
            let resync_left = self.inner.sync.ctl.lock().resync_needed;
            let state = if resync_left {
                ArrayState::Active
            } else {
                ArrayState::Clean
            };
            let _ = self.inner.write_superblocks_state(state);
        }
        // No check of a leg's connection runs once this returns (it would hold the array).
        for l in self.inner.legs.iter() {
            if let Some(dev) = l.dev() {
                dev.check_connections(None);
            }
        }
        // Drained: no leg completion comes in from now on, and those still inside (this
        // thread's own, when the array is dropped from a completion) keep the array alive
        // until the last is out (see `retire`).
        drop(self.inner.retirement.retire(self.inner.clone()));
    }
}

impl Device for Raid1 {
    fn submit(&self, bio: Bio, end: &StdArc<dyn EndIo>) {
        self.inner.submit(bio, end)
    }

    fn limits(&self) -> Limits {
        Limits {
            capacity: self.inner.capacity,
            logical_block_size: self.inner.logical_block_size,
            max_io_bytes: self.inner.max_io,
        }
    }

    /// No zero-copy path (a read or write has to reach the legs as bios); the allocation map
    /// is costly where a leg's is (extents are asked of a leg the read balancing picks).
    fn caps(&self) -> Caps {
        Caps {
            slow_extents: self
                .inner
                .legs
                .iter()
                .any(|l| l.slow_extents.load(Ordering::Relaxed)),
            ..Caps::default()
        }
    }

    fn extents_into(
        &self,
        offset: u64,
        len: u64,
        max: usize,
        out: &mut Vec<Extent>,
    ) -> Result<(), Error> {
        let inner = &self.inner;
        let leg = inner
            .choose_read_leg(
                offset >> SECTOR_SHIFT,
                offset.saturating_add(len),
                LegSet::EMPTY,
            )
            .and_then(|i| inner.legs[i].dev())
            .ok_or_else(|| eio("raid1: no readable leg"))?;
        leg.extents_into(offset + inner.data_offset, len, max, out)?;
        for e in out.iter_mut() {
            e.offset -= inner.data_offset;
        }
        Ok(())
    }
}

impl Array {
    /// Puts `dev` in slot `i` as a recovering leg (recovery offset 0, written and not read;
    /// only the bitmap's dirty chunks recovered if `bitmap`), write-mostly if `write_mostly`. The one placement of `add_leg` and the automatic re-add.
    ///
    /// # Safety
    ///
    /// The caller has frozen the array with `freeze_array(0)` (the rule of `slot`).
    pub(crate) unsafe fn place_frozen(
        &self,
        i: usize,
        dev: StdArc<dyn Device>,
        bitmap: bool,
        write_mostly: bool,
    ) {
        assert!(
            self.barriers.is_frozen(),
            "slot {i} placed without a freeze"
        );
        let l = &self.legs[i];
        // SAFETY: frozen, by the caller.
        let _ = unsafe { l.set_dev_frozen(Some(dev)) };
        l.recovery_offset.store(0, Ordering::Release);
        l.bitmap_recovery.store(bitmap, Ordering::Release);
        l.read_errors.store(0, Ordering::Relaxed);
        l.head.store(u64::MAX, Ordering::Relaxed);
        // Before the state: a sync thread that sees the leg recovering sees this too.
        l.unrecorded.store(true, Ordering::Release);
        l.state.place(if write_mostly {
            LegState::RECOVERING.write_mostly()
        } else {
            LegState::RECOVERING
        });
        self.watch_connections(i);
    }

    /// The bitmap's time (since `origin_ns`): the coarse clock, as the block layer's
    /// statistics read it ([`blk::stats::batch_ns`]: a write completing inline in a leg's
    /// dispatch shares that batch's one read, instead of a precise clock read per write). Its
    /// 1-4 ms resolution is far below the quiet period a chunk must stay clean before its bit
    /// is cleared (`bitmap_quiet`, 10 ms in the tests, seconds in use); the daemon reads the
    /// same clock, so the two never disagree by more than a tick.
    /// Leg `leg`'s completion handle for the current thread. The queue clones the handle's
    /// `Arc` into each request and drops it at completion; with one handle per leg every leg
    /// bio of every submitting thread wrote the same reference count twice, a line moving
    /// between cores on every write. One set per thread shard keeps a thread on its own.
    #[inline]
    pub(crate) fn leg_end(&self, leg: usize) -> &StdArc<dyn EndIo> {
        &self.ends[blkq_sync::thread_slot() & (self.ends.len() - 1)][leg]
    }

    pub(crate) fn bitmap_now(&self) -> std::time::Duration {
        std::time::Duration::from_nanos(blk::stats::batch_ns().saturating_sub(self.origin_ns))
    }

    pub(crate) fn is_degraded(&self) -> bool {
        self.legs.iter().any(|l| {
            let st = l.state.load();
            st.is_present() && (st.is_faulty() || !st.in_sync())
        }) || self
            .legs
            .iter()
            .filter(|l| l.state.load().is_member())
            .count()
            < 2
    }

    /// The superblocks recorded (or failed to record) the leg placed in slot `i`: its recovery
    /// may start (see `Leg::unrecorded`).
    pub(crate) fn placement_recorded(&self, i: usize) {
        self.legs[i].unrecorded.store(false, Ordering::Release);
        self.sync.wq.wake_all();
    }

    pub(crate) fn state_changed(&self) {
        if let Some(bm) = &self.bitmap {
            // Asked under the bitmap's lock, so racing state changes never leave it stale.
            bm.update_degraded(|| self.is_degraded());
        }
        self.durable.set_dirty();
        self.daemon_wq.wake_all();
        // A leg to recover, or a target gone.
        self.sync.wq.wake_all();
    }

    /// Makes leg `i` a full member (sets IN_SYNC) if it is present and not faulty; returns
    /// whether it did. A CAS, not a check then a `fetch_or`: the leg may be failed or removed
    /// between the look and the update (see `legstate`).
    pub(crate) fn mark_in_sync(&self, i: usize) -> bool {
        self.legs[i].state.finish_recovery()
    }
}
