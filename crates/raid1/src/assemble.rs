//! Start-up: [`Raid1::create`] (format new legs), [`Raid1::assemble`] (restart from the legs'
//! superblocks: slot table from the newest, stale legs recovering, bitmap union, unclean stop
//! detection) and `launch` (build the shared state, start raid1d and the sync thread).
//!
//! What a set of superblocks decides (which array, whose superblock speaks for it, which leg
//! takes which slot) is [`Assembly::decide`], a pure function: `assemble` acts on its answer,
//! and a tool that only reports on legs at rest asks it the same question.
//!
//! Runs on the caller's thread, before any other thread of the array exists.

use blkq_sync::DynArc as StdArc;
use std::sync::Weak;

use blk::{submit_wait, Bio, Buffer, BufferPool, Device, EndIo, Limits, Op, SECTOR_SHIFT};
use blkq_sync::atomic::{AtomicBool, AtomicU64, Ordering};
use blkq_sync::{thread, CachePadded, Mutex};
use sbitmap::Sbitmap;
use std::collections::VecDeque;
use waitq::WaitQueue;

use crate::barrier::{paired, Barriers};
use crate::bitmap::{WriteIntentBitmap, DEFAULT_CHUNK_SIZE};
use crate::config::Raid1Config;
use crate::device::{
    ArrayMeta, Inner, Io, Launch, Leg, LegEnd, Placed, Raid1, Raid1Error, FAULTY, IN_SYNC, PRESENT,
    WRITE_MOSTLY,
};
use crate::generation::{Kinship, Lineage};
use crate::superblock::{ArrayState, Role, Superblock, SuperblockError, MAX_LEGS, SB_OFFSET};
use uuid::Uuid;

/// What the superblocks of a set of legs decide about the array they form, before anything
/// starts ([`Assembly::decide`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Assembly {
    /// The position, among the legs given, of the superblock whose view of the array wins:
    /// the slot table, events, layout and state come from it.
    pub newest: usize,
    /// For each leg given, the slot it takes in that view: `None` for a leg without a
    /// readable superblock, a spare, or a leg replaced in its slot since.
    pub slots: Vec<Option<usize>>,
    /// Disagreements worked around (equal events, different views), naming legs by position.
    pub warnings: Vec<String>,
}

/// Why the legs given do not form one array ([`Assembly::decide`]). Legs are named by their
/// position among the legs given.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AssemblyError {
    /// No leg has a readable superblock.
    #[error("no leg with a readable superblock")]
    NoSuperblock,
    /// A leg carries another array's superblock than the array most legs belong to.
    #[error(
        "leg {leg} belongs to another array (array UUID {its}) than legs {} (array UUID \
         {array})",
        join(.members)
    )]
    ForeignLeg {
        /// The first such leg.
        leg: usize,
        /// Its array's UUID.
        its: Uuid,
        /// The legs of the array.
        members: Vec<usize>,
        /// The array's UUID.
        array: Uuid,
    },
    /// Two legs carry the same leg UUID: the same leg given twice (or a copy of it).
    #[error("legs {first} and {second} are the same leg (leg UUID {leg_uuid})")]
    DuplicateLeg {
        /// The first of them.
        first: usize,
        /// The second.
        second: usize,
        /// The leg UUID they share.
        leg_uuid: Uuid,
    },
    /// The newest superblocks (same events) each record another's leg as failed: each leg
    /// may hold writes the others lack.
    #[error(
        "legs {} have the same events ({events}) and each records another as failed (split \
         brain): refusing to assemble; assemble from the legs you trust",
        join(.legs)
    )]
    SplitBrain {
        /// The legs with those events.
        legs: Vec<usize>,
        /// Their events.
        events: u64,
    },
    /// The legs carry histories that went apart (see [`crate::generation`]): each side ran
    /// without the other and holds writes the other lacks, whatever their events say.
    #[error(
        "the legs' histories diverged: {}: each side ran without the other and holds writes \
         the other lacks; refusing to pick a side: assemble from the side to keep (allowing a \
         degraded start), then add the other with --discard (only the chunks either side \
         changed are copied)",
        name_sides(.sides)
    )]
    Diverged {
        /// Each side: its legs (positions among the legs given) and its generation.
        sides: Vec<(Vec<usize>, u64)>,
    },
}

fn name_sides(sides: &[(Vec<usize>, u64)]) -> String {
    sides
        .iter()
        .map(|(legs, g)| {
            let which = if legs.len() == 1 { "leg" } else { "legs" };
            format!("{which} {} at generation {g:016x}", join(legs))
        })
        .collect::<Vec<_>>()
        .join(" and ")
}

fn join(legs: &[usize]) -> String {
    legs.iter()
        .map(usize::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

impl Assembly {
    /// Decides from the superblocks of the legs given, in order (`None`: a leg whose
    /// superblock could not be read, left out of the decision):
    /// 1. the array: the array UUID most legs carry (a tie goes to the array with the highest
    ///    events, then to the earlier leg's); a leg of another array is refused
    ///    ([`AssemblyError::ForeignLeg`]), and so is a leg given twice
    ///    ([`AssemblyError::DuplicateLeg`]);
    /// 2. the newest history: legs whose generation is an earlier point of another leg's
    ///    history are stale whatever their events; two legs whose histories went apart are
    ///    refused ([`AssemblyError::Diverged`]: each side ran without the other);
    /// 3. the newest superblock among the legs at that point (md compares events first): the
    ///    highest
    ///    `events`; among superblocks with those events that disagree (a leg failed while they
    ///    were being written), never one whose own leg another records as failed (that leg
    ///    missed writes the other saw), then the one recording the most failed legs, then the
    ///    lowest slot: the same choice in any order. Two legs that each record the other as
    ///    failed (split brain: each may hold writes the other lacks) are refused
    ///    ([`AssemblyError::SplitBrain`]);
    /// 4. each leg's slot: its superblock's role, where the newest superblock's slot table
    ///    still holds that leg.
    pub fn decide(sbs: &[Option<&Superblock>]) -> Result<Assembly, AssemblyError> {
        let given: Vec<(usize, &Superblock)> = sbs
            .iter()
            .enumerate()
            .filter_map(|(i, sb)| sb.map(|sb| (i, sb)))
            .collect();
        // How strongly the legs speak for an array: how many carry it, then its newest events.
        let weight = |u: Uuid| {
            let of = || given.iter().filter(move |(_, sb)| sb.array_uuid == u);
            (of().count(), of().map(|(_, sb)| sb.events).max())
        };
        // Ties keep the earlier leg's array.
        let array = given
            .iter()
            .map(|(_, sb)| sb.array_uuid)
            .fold(None::<Uuid>, |best, u| match best {
                Some(b) if weight(b) >= weight(u) => Some(b),
                _ => Some(u),
            })
            .ok_or(AssemblyError::NoSuperblock)?;
        if let Some((leg, sb)) = given.iter().find(|(_, sb)| sb.array_uuid != array) {
            return Err(AssemblyError::ForeignLeg {
                leg: *leg,
                its: sb.array_uuid,
                members: given
                    .iter()
                    .filter(|(_, sb)| sb.array_uuid == array)
                    .map(|(i, _)| *i)
                    .collect(),
                array,
            });
        }
        for (k, (first, a)) in given.iter().enumerate() {
            if let Some((second, _)) = given[k + 1..]
                .iter()
                .find(|(_, b)| b.leg_uuid == a.leg_uuid)
            {
                return Err(AssemblyError::DuplicateLeg {
                    first: *first,
                    second: *second,
                    leg_uuid: a.leg_uuid,
                });
            }
        }
        // Only the legs at the newest point of the history speak for the array; legs at an
        // earlier point are stale, whatever their events; two newest points are refused.
        let heads = newest_generation(&given)?;
        let at_head: Vec<(usize, &Superblock)> = given
            .iter()
            .filter(|(_, sb)| sb.lineage.current.id == heads)
            .copied()
            .collect();
        let mut warnings = Vec::new();
        let newest = choose_newest(&at_head, &mut warnings)?;
        let nb = sbs[newest].expect("the newest superblock is one of those given");
        let slots = sbs
            .iter()
            .map(|sb| {
                let sb = (*sb)?;
                let Role::Slot(n) = sb.role else {
                    return None; // a spare
                };
                let n = n as usize;
                // Else replaced in its slot since: not part of the array any more.
                nb.legs.get(n).filter(|l| l.uuid == sb.leg_uuid).map(|_| n)
            })
            .collect();
        Ok(Assembly {
            newest,
            slots,
            warnings,
        })
    }
}

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
                crate::integrity::zero_area(dev.as_ref(), t)
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
                state: PRESENT | IN_SYNC,
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
        let sums = crate::integrity::load_sums(&newest, &placed, &mut warnings);
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

    pub(crate) fn launch(a: Launch) -> Result<Self, Raid1Error> {
        let cfg = a.cfg;
        if cfg.write_behind > 0 && a.bitmap.is_none() {
            return Err(Raid1Error::Config(
                "raid1: write_behind needs a write-intent bitmap".into(),
            ));
        }
        let pool = BufferPool::new(a.max_io as usize, 4, cfg.depth.min(64));
        let free = Sbitmap::new(cfg.depth as u32, None, false)
            .map_err(|e| Raid1Error::Config(format!("raid1: depth: {e}")))?;
        let inner = StdArc::new_cyclic(|weak: &Weak<Inner>| Inner {
            legs: (0..a.nr_slots).map(|_| Leg::empty()).collect(),
            ends: (0..blkq_sync::stat::shard_count())
                .map(|_| {
                    (0..a.nr_slots)
                        .map(|leg| {
                            StdArc::new(LegEnd {
                                inner: weak.clone(),
                                leg,
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
            ios: (0..cfg.depth)
                .map(|_| CachePadded(Mutex::new(Io::default())))
                .collect(),
            free,
            free_wq: WaitQueue::new(),
            retry: Mutex::new(VecDeque::with_capacity(cfg.depth)),
            daemon_wq: WaitQueue::new(),
            stop: AtomicBool::new(false),
            sb_dirty: AtomicBool::new(false),
            meta: Mutex::new(ArrayMeta {
                array_uuid: a.array_uuid,
                events: a.events,
                state: ArrayState::Active,
                lineage: a.lineage,
                members: a.members,
            }),
            fail_lock: Mutex::new(()),
            fail_gen: AtomicU64::new(0),
            durable_gen: AtomicU64::new(0),
            held: Mutex::new(VecDeque::with_capacity(cfg.depth)),
            failed: AtomicBool::new(false),
            failed_why: Mutex::new(None),
            // Unclean: reads go to the resync's source from now on, not only once the sync
            // thread has started the pass (md's `recovery_cp` = 0 at assembly).
            resync_point: AtomicU64::new(if a.resync { 0 } else { u64::MAX }),
            pool,
            origin_ns: blk::stats::coarse_ns(),
            sync: crate::sync::SyncState::new(),
            readd: crate::readd::ReaddState::new(a.nr_slots),
            wb: crate::behind::WriteBehind::new(cfg.write_behind, cfg.depth, a.nr_slots),
            events: crate::events::Hub::new(a.nr_slots),
            me: weak.clone(),
            cfg,
        });
        // Slots whose leg is missing keep its UUID in memory (not on disk), so that leg can
        // come back with `add_leg` as a re-add.
        for (l, u) in inner.legs.iter().zip(a.slot_uuids.iter()) {
            *l.uuid.lock() = *u;
        }
        // Nothing submits yet; the freeze is the rule of `slot` all the same.
        inner.barriers.freeze_array(0);
        for p in a.placed {
            let l = &inner.legs[p.slot];
            // SAFETY: frozen just above.
            let _ = unsafe { l.set_dev_frozen(Some(p.dev)) };
            *l.uuid.lock() = p.uuid;
            l.recovery_offset
                .store(p.recovery_offset, Ordering::Release);
            l.bitmap_recovery.store(p.readd, Ordering::Release);
            l.state.store(p.state, Ordering::Release);
        }
        paired(inner.barriers.unfreeze_array());
        for i in 0..a.nr_slots {
            inner.watch_connections(i);
        }
        // Found faulty: nobody knows why it failed, so it is never re-added by itself.
        for i in 0..a.nr_slots {
            if inner.legs[i].state.load(Ordering::Acquire) & FAULTY != 0 {
                inner.mark_manual(i);
            }
        }
        if let Some(bm) = &inner.bitmap {
            bm.set_degraded(inner.is_degraded());
        }
        inner.sync.ctl.lock().resync_needed = a.resync;
        if let (true, Some(t)) = (a.resync, &inner.sums) {
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
        inner.write_superblocks()?;
        inner.persist_bitmap()?;
        let daemon = {
            let inner = inner.clone();
            thread::spawn(move || inner.daemon())
        };
        let syncer = {
            let inner = inner.clone();
            thread::spawn(move || inner.sync_thread())
        };
        Ok(Self {
            inner,
            daemon: Some(daemon),
            syncer: Some(syncer),
            crashed: false,
            warnings: Vec::new(),
        })
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
        let mut state = PRESENT;
        if info.faulty {
            state |= FAULTY;
        }
        if info.write_mostly {
            state |= WRITE_MOSTLY;
        }
        let current =
            sb.events == newest.events && sb.lineage.current.id == newest.lineage.current.id;
        if info.in_sync && current {
            state |= IN_SYNC;
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
    if !placed
        .iter()
        .any(|p| p.state & (IN_SYNC | FAULTY) == IN_SYNC)
    {
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
        if p.state & FAULTY != 0 {
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
        p.readd = loaded && p.state & (IN_SYNC | FAULTY) == 0 && p.recovery_offset == 0 && covered;
    }
    Ok(Some(bm))
}

/// The generation of the newest history among `found` (one array's legs): the one no other
/// leg's history has gone past. Step 2 of [`Assembly::decide`].
fn newest_generation(found: &[(usize, &Superblock)]) -> Result<u64, AssemblyError> {
    let mut heads: Vec<(Vec<usize>, u64)> = Vec::new();
    for (i, sb) in found {
        let passed = found
            .iter()
            .any(|(_, o)| o.lineage.kinship(&sb.lineage) == Kinship::Ancestor);
        if passed {
            continue;
        }
        let g = sb.lineage.current.id;
        match heads.iter_mut().find(|(_, h)| *h == g) {
            Some((legs, _)) => legs.push(*i),
            None => heads.push((vec![*i], g)),
        }
    }
    match heads.len() {
        0 => Err(AssemblyError::NoSuperblock),
        1 => Ok(heads[0].1),
        _ => Err(AssemblyError::Diverged { sides: heads }),
    }
}

/// Whether a leg whose own superblock is `sb` left slot `n` in sync (its last superblock,
/// written while it was a member, records it in sync and not failed).
pub(crate) fn left_in_sync(sb: &Superblock, n: usize) -> bool {
    sb.legs.get(n).is_some_and(|l| l.in_sync && !l.faulty)
}

/// md's re-add rule: a returning leg of this array's slot needs only the bitmap's dirty
/// chunks if it left in sync ([`left_in_sync`]) and its events (`events`, its own
/// superblock's) are not behind the bitmap's `events_cleared` (no bit it would need was
/// cleared since it left). Assembly, `add_leg` and the automatic re-add all ask this.
pub(crate) fn readd_rule(left_in_sync: bool, events: u64, events_cleared: u64) -> bool {
    left_in_sync && events >= events_cleared
}

/// The re-add rule across generations (see `generation`): a returning leg at `generation`
/// (its own superblock's, with its `events` and whether it left in sync) of an array whose
/// history is `lineage` needs only the bitmap's dirty chunks when it is of the array's
/// generation and md's rule holds ([`readd_rule`]), or of an earlier one that it left in sync
/// and no bit was cleared since the array left that generation. Assembly, `add_leg` and the
/// automatic re-add all ask this.
pub(crate) fn readd_covers(
    lineage: &Lineage,
    generation: u64,
    left_in_sync: bool,
    events: u64,
    events_cleared: u64,
) -> bool {
    if generation == lineage.current.id {
        readd_rule(left_in_sync, events, events_cleared)
    } else {
        // Strictly before: a clear at the new generation's first events came after it.
        left_in_sync
            && lineage
                .left_at(generation)
                .is_some_and(|left| events_cleared < left)
    }
}

/// Whether `sb` records slot `n` as failed or not in sync.
fn records_failed(sb: &Superblock, n: usize) -> bool {
    sb.legs.get(n).is_some_and(|l| l.faulty || !l.in_sync)
}

/// The position of the superblock whose view wins, among `found` (one array's legs, with
/// their positions among the legs given): step 2 of [`Assembly::decide`].
fn choose_newest(
    found: &[(usize, &Superblock)],
    warnings: &mut Vec<String>,
) -> Result<usize, AssemblyError> {
    let max = found
        .iter()
        .map(|(_, sb)| sb.events)
        .max()
        .ok_or(AssemblyError::NoSuperblock)?;
    let top: Vec<&(usize, &Superblock)> = found.iter().filter(|(_, sb)| sb.events == max).collect();
    let slot = |sb: &Superblock| match sb.role {
        Role::Slot(n) => n as usize,
        Role::Spare => usize::MAX,
    };
    if top.iter().all(|(_, sb)| sb.legs == top[0].1.legs) {
        return Ok(top[0].0);
    }
    let refuted = |sb: &Superblock| {
        top.iter()
            .any(|(_, other)| other.leg_uuid != sb.leg_uuid && records_failed(other, slot(sb)))
    };
    let best = top
        .iter()
        .filter(|(_, sb)| !refuted(sb))
        .min_by_key(|(_, sb)| {
            let failed = (0..sb.legs.len())
                .filter(|&n| records_failed(sb, n))
                .count();
            (std::cmp::Reverse(failed), slot(sb))
        });
    let legs: Vec<usize> = top.iter().map(|(i, _)| *i).collect();
    let Some((i, _)) = best else {
        return Err(AssemblyError::SplitBrain { legs, events: max });
    };
    warnings.push(format!(
        "legs {} have the same events ({max}) but disagree on the array's state (a leg \
         failed while the superblocks were written); using leg {i}'s, which records the failure",
        join(&legs)
    ));
    Ok(*i)
}
