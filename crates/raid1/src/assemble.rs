//! Start-up: [`Raid1::create`] (format new legs), [`Raid1::assemble`] (restart from the legs'
//! superblocks: slot table from the newest, stale legs recovering, bitmap union, unclean stop
//! detection) and `launch` (build the shared state, start raid1d and the sync thread).
//!
//! What a set of superblocks decides (which array, whose superblock speaks for it, which leg
//! takes which slot) is [`Assembly::decide`] (`placement`), a pure function: `assemble` acts on
//! its answer.
//!
//! Runs on the caller's thread, before any other thread of the array exists.

use blkq_sync::DynArc as StdArc;
use std::sync::Weak;

use blk::{submit_wait, Bio, Buffer, BufferPool, Device, EndIo, Limits, Op, SECTOR_SHIFT};
use blkq_sync::atomic::{AtomicBool, AtomicU64, Ordering};
use blkq_sync::{thread, Mutex};
use waitq::WaitQueue;

use crate::barrier::{paired, Barriers};
use crate::bitmap::{WriteIntentBitmap, DEFAULT_CHUNK_SIZE};
use crate::config::{CompletionRef, Raid1Config};
use crate::device::{Array, ArrayMeta, Launch, Leg, LegEnd, Placed, Raid1};
use crate::error::Raid1Error;
use crate::legstate::LegState;
use crate::placement::{left_in_sync, readd_covers, Assembly};
use crate::superblock::{ArrayState, Role, Superblock, SuperblockError, MAX_LEGS, SB_OFFSET};
use uuid::Uuid;

/// How [`Raid1::create_with`] starts a new array.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Creation {
    /// The legs may differ: a full resync (md's initial resync, from 0) is due from the
    /// start, copying the first leg over the others; reads go to the first leg until it is
    /// done, and it is recorded (superblock not clean, every bitmap bit set), so a stop before
    /// it ends resumes it at the next assembly. `false`: the legs are taken to agree as they
    /// are (mdadm's `--assume-clean`, for blank legs only).
    pub resync: bool,
    /// Bytes of each leg the array uses (superblock, bitmap and data); `None`: the smallest
    /// leg's size. More than a leg holds is refused.
    pub leg_size: Option<u64>,
}

impl Raid1 {
    /// Creates a new array over `legs` (at least 2): writes fresh superblocks and empty
    /// bitmaps to every leg and starts the array's background thread. The legs are taken to
    /// agree as they are (blank legs; `create_with` resyncs legs that may differ).
    pub fn create(legs: Vec<StdArc<dyn Device>>, cfg: Raid1Config) -> Result<Self, Raid1Error> {
        Self::create_with(legs, cfg, Creation::default())
    }

    /// [`Raid1::create`], resyncing the legs from the first or using part of each as
    /// `how` says ([`Creation`]).
    pub fn create_with(
        legs: Vec<StdArc<dyn Device>>,
        cfg: Raid1Config,
        how: Creation,
    ) -> Result<Self, Raid1Error> {
        if legs.len() < 2 {
            return Err(Raid1Error::Config("raid1 needs at least 2 legs".into()));
        }
        let nr_legs = legs.len();
        let nr_slots = nr_legs + cfg.spare_slots;
        if nr_slots > MAX_LEGS {
            return Err(Raid1Error::Config(format!("at most {MAX_LEGS} slots")));
        }
        if cfg.depth == 0 || cfg.depth > u32::MAX as usize {
            return Err(Raid1Error::Config("depth".into()));
        }
        let lims: Vec<Limits> = legs.iter().map(|l| l.limits()).collect();
        let smallest = lims.iter().map(|l| l.capacity).min().unwrap_or(0);
        let leg_size = match how.leg_size {
            Some(n) if n > smallest => {
                return Err(Raid1Error::Config(format!(
                    "leg size {n} is more than the smallest leg holds ({smallest} bytes)"
                )))
            }
            Some(n) => n,
            None => smallest,
        };
        let (lbs, max_io) = common_limits(&lims, &cfg);
        let chunk = if cfg.bitmap_chunk == 0 {
            DEFAULT_CHUNK_SIZE
        } else {
            cfg.bitmap_chunk
        };
        let sbs = Superblock::new_array_with(nr_slots, leg_size, chunk, cfg.integrity)?;
        let sb0 = &sbs[0];
        // Sums are per 4 KiB block: the array's block is at least that.
        let lbs = if sb0.integrity.is_some() {
            lbs.max(crate::integrity::BLOCK as u32)
        } else {
            lbs
        };
        let data_offset = sb0.data_offset;
        let capacity = sb0.data_size / u64::from(lbs) * u64::from(lbs);
        let bitmap = if cfg.bitmap_chunk == 0 {
            None
        } else {
            let bm = WriteIntentBitmap::new(capacity, chunk)?
                .with_quiet_time(cfg.bitmap_quiet)
                .with_counts(cfg.bitmap_counts);
            if how.resync {
                // Everything may differ: the resync's set, kept until it completes.
                bm.set_dirty(crate::bitmap::ChunkSet {
                    first: 0,
                    end: bm.nr_chunks(),
                });
            }
            Some(bm)
        };
        let sums = sb0
            .integrity
            .map(|area| crate::integrity::Checksums::new(area, capacity));
        if let Some(t) = &sums {
            for (i, dev) in legs.iter().enumerate() {
                crate::integrity::legs::zero_area(dev.as_ref(), t)
                    .map_err(|source| Raid1Error::Leg { leg: i, source })?;
            }
        }
        let placed = legs
            .into_iter()
            .enumerate()
            .map(|(i, dev)| Placed {
                slot: i,
                dev,
                uuid: sbs[i].leg_uuid,
                state: LegState::MEMBER,
                recovery_offset: 0,
                sb_events: 1,
                was_in_sync: true,
                readd: false,
                generation: sbs[i].lineage.current.id,
            })
            .collect();
        Self::launch(Launch {
            nr_slots,
            placed,
            slot_uuids: Vec::new(),
            array_uuid: sb0.array_uuid,
            events: 1,
            lineage: sb0.lineage.clone(),
            members: (1u64 << nr_legs) - 1,
            data_offset,
            capacity,
            lbs,
            max_io,
            bitmap,
            sums,
            cfg,
            resync: how.resync,
        })
    }

    /// Assembles an existing array from its legs' superblocks (any order). The newest
    /// superblock (highest `events`) decides the slot table; a leg whose own superblock is
    /// older is put back as recovering (recovery offset 0): a resync must bring it up to date,
    /// copying the dirty chunks of the bitmap (loaded from every leg, as a union) or everything.
    /// Legs the newest superblock marks faulty come back faulty.
    pub fn assemble(legs: Vec<StdArc<dyn Device>>, cfg: Raid1Config) -> Result<Self, Raid1Error> {
        if legs.is_empty() {
            return Err(Raid1Error::Config("no legs".into()));
        }
        if cfg.depth == 0 || cfg.depth > u32::MAX as usize {
            return Err(Raid1Error::Config("depth".into()));
        }
        let nr_given = legs.len();
        let mut warnings = Vec::new();
        let LegsRead { found, unreadable } = read_superblocks(legs, &mut warnings)?;
        let mut given: Vec<Option<&Superblock>> = vec![None; nr_given];
        for (i, _, sb) in &found {
            given[*i] = Some(sb);
        }
        let assembly = Assembly::decide(&given)?;
        for w in &assembly.warnings {
            tracing::warn!("raid1: {w}");
        }
        warnings.extend(assembly.warnings);
        let newest = found
            .iter()
            .find(|(i, _, _)| *i == assembly.newest)
            .map(|(_, _, sb)| sb.clone())
            .expect("the newest superblock is one of those read");
        let lims: Vec<Limits> = found.iter().map(|(_, d, _)| d.limits()).collect();
        let (lbs, max_io) = common_limits(&lims, &cfg);
        let Placement {
            mut placed,
            left_out,
        } = place_legs(found, &assembly.slots, &newest)?;
        check_enough_in_sync(&newest, &placed, nr_given, &cfg)?;
        let bitmap = load_bitmap(&newest, &mut placed, &cfg)?;
        let sums = crate::integrity::legs::load_sums(&newest, &placed, &mut warnings);
        let lbs = if sums.is_some() {
            lbs.max(crate::integrity::BLOCK as u32)
        } else {
            lbs
        };
        let mut r = Self::launch(Launch {
            nr_slots: newest.legs.len(),
            placed,
            slot_uuids: newest.legs.iter().map(|l| l.uuid).collect(),
            array_uuid: newest.array_uuid,
            events: newest.events,
            lineage: newest.lineage.clone(),
            members: newest
                .legs
                .iter()
                .enumerate()
                .filter(|(_, l)| l.in_sync && !l.faulty)
                .fold(0, |m, (i, _)| m | 1 << i),
            data_offset: newest.data_offset,
            capacity: newest.data_size,
            lbs,
            max_io,
            bitmap,
            sums,
            cfg,
            resync: newest.array_state != ArrayState::Clean,
        })?;
        r.add_back(left_out, unreadable, &mut warnings);
        r.warnings = warnings;
        Ok(r)
    }

    /// The last step of [`Raid1::assemble`], on the running array: legs left out of the
    /// newest superblock's slot table come back through `add_leg` (a re-add when their
    /// history allows it), and legs whose superblock was unreadable as new legs, recovered in
    /// full. A leg that cannot come back is named in `warnings`; the array runs without it.
    fn add_back(
        &self,
        left_out: Vec<(usize, StdArc<dyn Device>)>,
        unreadable: Vec<(usize, StdArc<dyn Device>)>,
        warnings: &mut Vec<String>,
    ) {
        for (i, dev) in left_out {
            // A former leg of an emptied slot: a re-add when its history allows it.
            match self.add_leg(dev) {
                Ok(slot) => tracing::info!("raid1: leg {i}: back into slot {slot}, recovering"),
                Err(e) => {
                    let w = format!("leg {i}: left out ({e})");
                    tracing::warn!("raid1: {w}");
                    warnings.push(w);
                }
            }
        }
        for (i, dev) in unreadable {
            // A new leg to the array: fresh UUID, full recovery. One that cannot even take a
            // superblock stays out; the array runs without it.
            if let Err(e) = self.add_leg(dev) {
                let w = format!("leg {i}: could not be added back for recovery ({e}); left out");
                tracing::warn!("raid1: {w}");
                warnings.push(w);
            }
        }
    }

    /// Reads and decodes the superblock of a leg (any device; for tools and reports too).
    pub fn read_superblock(dev: &dyn Device) -> Result<Superblock, Raid1Error> {
        let b = Bio::with_buf(
            Op::Read,
            SB_OFFSET >> SECTOR_SHIFT,
            Buffer::new(crate::superblock::SB_SIZE),
        );
        let (back, r) = submit_wait(dev, b);
        r.map_err(|e| Raid1Error::Config(format!("superblock read error: {e}")))?;
        let buf = back.buf.ok_or(Raid1Error::Config(
            "superblock read returned no data".into(),
        ))?;
        Ok(Superblock::decode(buf.as_slice())?)
    }

    /// Builds the running array from what `create_with` or `assemble` decided: the shared
    /// state, the legs in their slots, the resync to come recorded, the superblocks and
    /// bitmap written, raid1d and the sync thread started.
    pub(crate) fn launch(mut a: Launch) -> Result<Self, Raid1Error> {
        if a.cfg.write_behind > 0 && a.bitmap.is_none() {
            return Err(Raid1Error::Config(
                "raid1: write_behind needs a write-intent bitmap".into(),
            ));
        }
        let placed = std::mem::take(&mut a.placed);
        let slot_uuids = std::mem::take(&mut a.slot_uuids);
        let resync = a.resync;
        let inner = shared_state(a)?;
        seat_legs(&inner, placed, &slot_uuids);
        record_resync(&inner, resync);
        inner.write_superblocks()?;
        inner.persist_bitmap()?;
        Ok(Self::start_threads(inner))
    }

    /// Starts raid1d and the sync thread on `inner`: the array runs.
    fn start_threads(inner: StdArc<Array>) -> Self {
        let daemon = {
            let inner = inner.clone();
            thread::spawn(move || inner.daemon())
        };
        let syncer = {
            let inner = inner.clone();
            thread::spawn(move || inner.sync_thread())
        };
        Self {
            inner,
            daemon: Some(daemon),
            syncer: Some(syncer),
            crashed: false,
            warnings: Vec::new(),
        }
    }
}

/// The array's shared state, every leg slot empty (`a.placed` and `a.slot_uuids` are left to
/// [`seat_legs`]).
fn shared_state(a: Launch) -> Result<StdArc<Array>, Raid1Error> {
    let cfg = a.cfg;
    let pool = BufferPool::new(a.max_io as usize, 4, cfg.depth.min(64));
    let slots = crate::slots::Slots::new(cfg.depth)
        .map_err(|e| Raid1Error::Config(format!("raid1: depth: {e}")))?;
    let inner = StdArc::new_cyclic(|weak: &Weak<Array>| Array {
        legs: (0..a.nr_slots).map(|_| Leg::empty()).collect(),
        ends: (0..blkq_sync::stat::shard_count())
            .map(|_| {
                (0..a.nr_slots)
                    .map(|leg| {
                        StdArc::new(LegEnd {
                            inner: weak.clone(),
                            leg,
                            counted: cfg.completion_ref == CompletionRef::Counted,
                        }) as StdArc<dyn EndIo>
                    })
                    .collect()
            })
            .collect(),
        data_offset: a.data_offset,
        capacity: a.capacity,
        logical_block_size: a.lbs,
        max_io: a.max_io,
        barriers: Barriers::new(cfg.barrier),
        bitmap: a.bitmap,
        sums: a.sums,
        persist: Mutex::new(()),
        slots,
        daemon_wq: WaitQueue::new(),
        stop: AtomicBool::new(false),
        meta: Mutex::new(ArrayMeta {
            array_uuid: a.array_uuid,
            events: a.events,
            state: ArrayState::Active,
            lineage: a.lineage,
            members: a.members,
        }),
        durable: crate::failure::durable::DurableState::new(cfg.depth),
        // Unclean: reads go to the resync's source from now on, not only once the sync
        // thread has started the pass (md's `recovery_cp` = 0 at assembly).
        resync_point: AtomicU64::new(if a.resync { 0 } else { u64::MAX }),
        pool,
        origin_ns: blk::stats::coarse_ns(),
        sync: crate::resync::SyncState::new(),
        readd: crate::readd::ReaddState::new(a.nr_slots),
        wb: crate::behind::WriteBehind::new(cfg.write_behind, cfg.depth, a.nr_slots),
        retirement: crate::retire::Retirement::new(blkq_sync::stat::shard_count()),
        events: crate::events::Hub::new(a.nr_slots),
        me: weak.clone(),
        cfg,
    });
    Ok(inner)
}

/// Puts each placed leg into its slot (under a freeze, the rule of `slot`), keeps the UUID
/// of each slot whose leg is missing, watches every leg's connections, and marks a leg
/// found faulty as failed by hand.
fn seat_legs(inner: &Array, placed: Vec<Placed>, slot_uuids: &[Uuid]) {
    // Slots whose leg is missing keep its UUID in memory (not on disk), so that leg can
    // come back with `add_leg` as a re-add.
    for (l, u) in inner.legs.iter().zip(slot_uuids.iter()) {
        *l.uuid.lock() = *u;
    }
    // Nothing submits yet; the freeze is the rule of `slot` all the same.
    inner.barriers.freeze_array(0);
    for p in placed {
        let l = &inner.legs[p.slot];
        // SAFETY: frozen just above.
        let _ = unsafe { l.set_dev_frozen(Some(p.dev)) };
        *l.uuid.lock() = p.uuid;
        l.recovery_offset
            .store(p.recovery_offset, Ordering::Release);
        l.bitmap_recovery.store(p.readd, Ordering::Release);
        l.state.place(p.state);
    }
    paired(inner.barriers.unfreeze_array());
    for i in 0..inner.legs.len() {
        inner.watch_connections(i);
    }
    // Found faulty: nobody knows why it failed, so it is never re-added by itself.
    for i in 0..inner.legs.len() {
        if inner.legs[i].state.load().is_faulty() {
            inner.mark_manual(i);
        }
    }
    if let Some(bm) = &inner.bitmap {
        bm.set_degraded(inner.is_degraded());
    }
}

/// Records that a resync is due (`resync`: the array was not stopped cleanly, or was created
/// to be resynced) and, with checksums, marks the table's pages of what it settles dirty.
fn record_resync(inner: &Array, resync: bool) {
    inner.sync.ctl.lock().resync_needed = resync;
    if let (true, Some(t)) = (resync, &inner.sums) {
        // The legs' pages of what the resync settles may differ (a crash kept a page
        // write on some legs only): the table loaded goes back to every leg before any of
        // those bits clears (see `integrity`).
        match &inner.bitmap {
            Some(bm) => {
                let c = bm.chunk_size();
                for set in bm.dirty_chunks() {
                    t.mark_dirty(set.first * c, (set.end - set.first) * c);
                }
            }
            None => t.mark_dirty(0, u64::MAX),
        }
    }
}

/// A leg given to [`Raid1::assemble`], by its position among the legs given.
type GivenLeg = (usize, StdArc<dyn Device>);

/// The legs given to [`Raid1::assemble`], sorted by what reading their superblock gave.
struct LegsRead {
    /// Legs with a readable superblock, with it.
    found: Vec<(usize, StdArc<dyn Device>, Superblock)>,
    /// Legs whose superblock is torn or unreadable: assembled without, then recovered.
    unreadable: Vec<GivenLeg>,
}

/// Reads every leg's superblock. A leg that carries something not ours (bad magic, a
/// version we do not know) fails the assembly: it is never overwritten. Any other read or
/// decode error leaves the leg to be recovered in full, named in `warnings`.
fn read_superblocks(
    legs: Vec<StdArc<dyn Device>>,
    warnings: &mut Vec<String>,
) -> Result<LegsRead, Raid1Error> {
    let mut found = Vec::with_capacity(legs.len());
    let mut unreadable = Vec::new();
    for (i, dev) in legs.into_iter().enumerate() {
        match Raid1::read_superblock(dev.as_ref()) {
            Ok(sb) => found.push((i, dev, sb)),
            // Not ours at all: never overwrite it.
            Err(
                e @ Raid1Error::Superblock(
                    SuperblockError::BadMagic | SuperblockError::UnsupportedVersion(_),
                ),
            ) => return Err(e),
            Err(e) => {
                let w = format!(
                    "leg {i}: superblock unreadable ({e}); assembled from the other legs, \
                     this one is recovered in full"
                );
                tracing::warn!("raid1: {w}");
                warnings.push(w);
                unreadable.push((i, dev));
            }
        }
    }
    Ok(LegsRead { found, unreadable })
}

/// The array's logical block size (the largest of its legs') and largest I/O (the smallest
/// of its legs' and the configured one).
fn common_limits(lims: &[Limits], cfg: &Raid1Config) -> (u32, u32) {
    let lbs = lims
        .iter()
        .map(|l| l.logical_block_size)
        .max()
        .unwrap_or(512);
    let max_io = lims
        .iter()
        .map(|l| l.max_io_bytes)
        .chain([cfg.max_io_bytes])
        .min()
        .unwrap_or(cfg.max_io_bytes);
    (lbs, max_io)
}

/// The legs with a readable superblock, as [`place_legs`] sorts them.
struct Placement {
    /// Legs that take a slot in the newest superblock's view, with their state in it.
    placed: Vec<Placed>,
    /// Former legs of a slot the newest superblock leaves empty: they may come back through
    /// `add_leg` once the array runs.
    left_out: Vec<GivenLeg>,
}

/// Puts each leg into the slot the assembly gave it (`slots`, by position given), with the
/// state the newest superblock records for that slot: in sync only if the leg's own
/// superblock is as current as the newest, else recovering from 0. A leg too small for the
/// array fails the assembly.
fn place_legs(
    found: Vec<(usize, StdArc<dyn Device>, Superblock)>,
    slots: &[Option<usize>],
    newest: &Superblock,
) -> Result<Placement, Raid1Error> {
    let mut placed: Vec<Placed> = Vec::new();
    let mut left_out = Vec::new();
    for (i, dev, sb) in found {
        if dev.limits().capacity < newest.data_offset.saturating_add(newest.data_size) {
            return Err(Raid1Error::Slot(i, "leg smaller than the array"));
        }
        // Spares (added later with add_leg) and legs replaced since take no slot. A leg
        // whose slot the newest superblock leaves empty (it ran without it) comes back
        // through add_leg, which lets it in only if its history allows.
        let Some(n) = slots[i] else {
            if let Role::Slot(n) = sb.role {
                if newest.legs.get(n as usize).is_some_and(|l| l.uuid.is_nil()) {
                    left_out.push((i, dev));
                }
            }
            continue;
        };
        let info = &newest.legs[n];
        let mut state = LegState::RECOVERING;
        if info.faulty {
            state = state.faulty();
        }
        if info.write_mostly {
            state = state.write_mostly();
        }
        let current =
            sb.events == newest.events && sb.lineage.current.id == newest.lineage.current.id;
        if info.in_sync && current {
            state = state.synced();
        }
        placed.push(Placed {
            slot: n,
            dev,
            uuid: sb.leg_uuid,
            state,
            recovery_offset: if current {
                info.recovery_offset.unwrap_or(0)
            } else {
                0
            },
            sb_events: sb.events,
            was_in_sync: left_in_sync(&sb, n),
            readd: false,
            generation: sb.lineage.current.id,
        });
    }
    Ok(Placement { placed, left_out })
}

/// Refuses an assembly that would fork the array's history without being asked to (fewer
/// legs given than the newest superblock records in sync, unless `allow_degraded`), and one
/// with no in-sync leg to read from.
fn check_enough_in_sync(
    newest: &Superblock,
    placed: &[Placed],
    nr_given: usize,
    cfg: &Raid1Config,
) -> Result<(), Raid1Error> {
    let in_sync_recorded = newest
        .legs
        .iter()
        .filter(|l| l.in_sync && !l.faulty)
        .count();
    if nr_given < in_sync_recorded && !cfg.allow_degraded {
        return Err(Raid1Error::Config(format!(
            "{in_sync_recorded} legs are in sync in this array but {nr_given} given: \
             starting without the others makes this side a new history, which they can \
             rejoin only by discarding their writes (a failover); set allow_degraded \
             (blkq serve --raid1-degraded) to do that"
        )));
    }
    if !placed.iter().any(|p| p.state.is_member()) {
        return Err(Raid1Error::Config("no in-sync leg: cannot assemble".into()));
    }
    Ok(())
}

/// The array's write-intent bitmap (none if the newest superblock records none): the union
/// of the bitmaps of the non-faulty placed legs, or all dirty when none is readable. Marks
/// each placed leg that may come back with a bitmap recovery (`Placed::readd`).
fn load_bitmap(
    newest: &Superblock,
    placed: &mut [Placed],
    cfg: &Raid1Config,
) -> Result<Option<WriteIntentBitmap>, Raid1Error> {
    if newest.bitmap.chunk_size == 0 {
        return Ok(None);
    }
    let bm = WriteIntentBitmap::new(newest.data_size, newest.bitmap.chunk_size)?
        .with_quiet_time(cfg.bitmap_quiet)
        .with_counts(cfg.bitmap_counts);
    let mut loaded = false;
    // Per placed leg: whether its own bitmap joined the array's.
    let mut own = vec![false; placed.len()];
    for (k, p) in placed.iter().enumerate() {
        if p.state.is_faulty() {
            continue;
        }
        let len = bm.disk_len();
        let b = Bio::with_buf(
            Op::Read,
            newest.bitmap.offset >> SECTOR_SHIFT,
            Buffer::new(len),
        );
        let (back, r) = submit_wait(p.dev.as_ref(), b);
        if let (Ok(()), Some(buf)) = (r, back.buf) {
            own[k] = bm.load(buf.as_slice()).is_ok();
            loaded |= own[k];
        }
    }
    if !loaded {
        // No readable bitmap: everything may differ.
        bm.set_dirty(crate::bitmap::ChunkSet {
            first: 0,
            end: bm.nr_chunks(),
        });
    }
    // A stale leg that was in sync and saw every cleared bit comes back with a bitmap
    // recovery (md's re-add, `readd_rule`); any other recovering leg recovers fully.
    let cleared = bm.events_cleared();
    for (p, &own) in placed.iter_mut().zip(&own) {
        // A leg of the newest generation: md's rule; of an earlier one: no bit cleared
        // since the array left it, and its own bitmap joined the array's (the writes
        // it took that the array may lack; unreadable, only a full recovery covers
        // them: see `Raid1::add_leg`).
        let covered = readd_covers(
            &newest.lineage,
            p.generation,
            p.was_in_sync,
            p.sb_events,
            cleared,
        ) && (own || p.generation == newest.lineage.current.id);
        p.readd = loaded && p.state.is_recovering() && p.recovery_offset == 0 && covered;
    }
    Ok(Some(bm))
}
