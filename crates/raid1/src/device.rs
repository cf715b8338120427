//! The [`Raid1`] device: a `blk::Device` over two or more legs.
//!
//! See the crate docs for the design. `std::sync::Arc` appears here only at the `blk::Device`
//! boundary (legs are `Arc<dyn Device>` and completions `Arc<dyn EndIo>`, which blk types with
//! std's `Arc`; loom's `Arc` cannot hold unsized values). Everything else comes from the facade.

use std::collections::VecDeque;
use std::sync::{Arc as StdArc, Weak};
use std::time::{Duration, Instant};

use blk::backend::Extent;
use blk::{Bio, BioFlags, Buffer, BufferPool, Device, EndIo, Error, Limits, Op, SECTOR_SHIFT};
use blkq_sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use blkq_sync::{thread, Mutex};

use uuid::Uuid;
use waitq::{Completion, WaitQueue};

use crate::barrier::{BarrierMode, Barriers};
use crate::bitmap::{BitmapError, WriteIntentBitmap, DEFAULT_CHUNK_SIZE};
use crate::superblock::{
    ArrayState, LegInfo, Role, Superblock, SuperblockError, MAX_LEGS, SB_OFFSET,
};

/// Leg state bits.
pub(crate) const PRESENT: u32 = 1;
pub(crate) const IN_SYNC: u32 = 2;
pub(crate) const FAULTY: u32 = 4;
pub(crate) const WRITE_MOSTLY: u32 = 8;

/// Errors building or managing a [`Raid1`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Raid1Error {
    /// A leg's I/O failed.
    #[error("leg {leg}: {source}")]
    Leg {
        /// Slot.
        leg: usize,
        /// Why.
        source: Error,
    },
    /// Superblock problem.
    #[error(transparent)]
    Superblock(#[from] SuperblockError),
    /// Bitmap problem.
    #[error(transparent)]
    Bitmap(#[from] BitmapError),
    /// A bad configuration.
    #[error("{0}")]
    Config(String),
    /// No such slot, or the slot is in the wrong state for the operation.
    #[error("slot {0}: {1}")]
    Slot(usize, &'static str),
    /// The sync thread cannot take the request now.
    #[error("sync busy: {0}")]
    Busy(&'static str),
}

/// Configuration of a [`Raid1`].
#[derive(Debug, Clone)]
pub struct Raid1Config {
    /// Barrier implementation (`barrier=locked|lockless`).
    pub barrier: BarrierMode,
    /// Write-intent bitmap chunk size, bytes (0: no bitmap).
    pub bitmap_chunk: u64,
    /// Time a bitmap chunk must be quiet before its bit is cleared.
    pub bitmap_quiet: Duration,
    /// Period of the background thread's bitmap clearing.
    pub tick: Duration,
    /// Preallocated per-I/O states (the most regular I/Os in flight).
    pub depth: usize,
    /// Largest I/O, bytes (also the size of the copy buffers for extra legs).
    pub max_io_bytes: u32,
    /// Read errors (corrected) a leg may have before it is failed.
    pub read_error_limit: u32,
    /// Extra empty slots for legs added at run time.
    pub spare_slots: usize,
}

impl Default for Raid1Config {
    fn default() -> Self {
        Self {
            barrier: BarrierMode::Lockless,
            bitmap_chunk: DEFAULT_CHUNK_SIZE,
            bitmap_quiet: crate::bitmap::DEFAULT_QUIET,
            tick: Duration::from_secs(1),
            depth: 256,
            max_io_bytes: 1 << 20,
            read_error_limit: 20,
            spare_slots: 1,
        }
    }
}

fn parse_size(v: &str) -> Option<u64> {
    let v = v.trim();
    let (num, shift) = match v.chars().last()? {
        'k' | 'K' => (&v[..v.len() - 1], 10),
        'm' | 'M' => (&v[..v.len() - 1], 20),
        'g' | 'G' => (&v[..v.len() - 1], 30),
        _ => (v, 0),
    };
    num.parse::<u64>().ok()?.checked_mul(1 << shift)
}

impl Raid1Config {
    /// Applies one `key=value` spec option: `barrier=locked|lockless`, `bitmap_chunk=SIZE`
    /// (`0`/`none`: no bitmap), `bitmap_quiet_ms=N`, `depth=N`, `max_io=SIZE`,
    /// `read_errors=N`, `spare_slots=N`.
    pub fn set_option(&mut self, key: &str, value: &str) -> Result<(), Raid1Error> {
        let bad = || Raid1Error::Config(format!("raid1: bad value {value:?} for {key}"));
        match key {
            "barrier" => {
                self.barrier = value
                    .parse()
                    .map_err(|e: crate::barrier::BarrierError| Raid1Error::Config(e.to_string()))?
            }
            "bitmap_chunk" => {
                self.bitmap_chunk = if value == "none" {
                    0
                } else {
                    parse_size(value).ok_or_else(bad)?
                }
            }
            "bitmap_quiet_ms" => {
                self.bitmap_quiet = Duration::from_millis(value.parse().map_err(|_| bad())?)
            }
            "depth" => self.depth = value.parse().map_err(|_| bad())?,
            "max_io" => {
                self.max_io_bytes = parse_size(value)
                    .and_then(|v| u32::try_from(v).ok())
                    .ok_or_else(bad)?
            }
            "read_errors" => self.read_error_limit = value.parse().map_err(|_| bad())?,
            "spare_slots" => self.spare_slots = value.parse().map_err(|_| bad())?,
            _ => return Err(Raid1Error::Config(format!("raid1: unknown option {key}"))),
        }
        Ok(())
    }
}

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
}

pub(crate) struct Leg {
    pub(crate) dev: Mutex<Option<StdArc<dyn Device>>>,
    pub(crate) uuid: Mutex<Uuid>,
    pub(crate) state: AtomicU32,
    /// Requests in flight (read balancing hint).
    pub(crate) pending: AtomicUsize,
    /// End sector of the last read sent here (sequential-stream detection).
    pub(crate) head: AtomicU64,
    pub(crate) read_errors: AtomicU32,
    pub(crate) recovery_offset: AtomicU64,
    /// A recovering leg that returned (re-add): it needs only the bitmap's dirty chunks.
    pub(crate) bitmap_recovery: AtomicBool,
}

impl Leg {
    pub(crate) fn empty() -> Self {
        Self {
            dev: Mutex::new(None),
            uuid: Mutex::new(Uuid::nil()),
            state: AtomicU32::new(0),
            pending: AtomicUsize::new(0),
            head: AtomicU64::new(u64::MAX),
            read_errors: AtomicU32::new(0),
            recovery_offset: AtomicU64::new(0),
            bitmap_recovery: AtomicBool::new(false),
        }
    }

    pub(crate) fn dev(&self) -> Option<StdArc<dyn Device>> {
        self.dev.lock().clone()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) enum Kind {
    #[default]
    Free,
    Read,
    Write,
    Flush,
}

/// Per-I/O state, preallocated (md's r1bio).
#[derive(Default)]
pub(crate) struct Io {
    kind: Kind,
    orig: Option<Bio>,
    end: Option<StdArc<dyn EndIo>>,
    remaining: u32,
    ok: u32,
    err: Option<Error>,
    /// Legs a read was tried on.
    tried: u32,
    /// The leg whose bio carries the original buffer.
    primary: usize,
}

/// Completion of a leg bio: the bio's cookie names the `Io` slot.
struct LegEnd {
    inner: Weak<Inner>,
    leg: usize,
}

impl EndIo for LegEnd {
    fn end_io(&self, bio: Bio, res: Result<(), Error>) {
        if let Some(inner) = self.inner.upgrade() {
            inner.leg_done(self.leg, bio, res);
        }
    }
}

/// A leg placed in a slot at start-up.
pub(crate) struct Placed {
    slot: usize,
    dev: StdArc<dyn Device>,
    uuid: Uuid,
    state: u32,
    recovery_offset: u64,
    /// Its own superblock's `events` and in-sync flag (a stale leg that was in sync may get
    /// a bitmap recovery).
    sb_events: u64,
    was_in_sync: bool,
    readd: bool,
}

/// What `launch` needs.
pub(crate) struct Launch {
    nr_slots: usize,
    placed: Vec<Placed>,
    array_uuid: Uuid,
    events: u64,
    data_offset: u64,
    capacity: u64,
    lbs: u32,
    max_io: u32,
    bitmap: Option<WriteIntentBitmap>,
    cfg: Raid1Config,
    /// The array was not stopped cleanly: resync.
    resync: bool,
}

pub(crate) struct ArrayMeta {
    pub(crate) array_uuid: Uuid,
    pub(crate) events: u64,
    pub(crate) state: ArrayState,
}

pub(crate) struct Inner {
    pub(crate) cfg: Raid1Config,
    pub(crate) legs: Box<[Leg]>,
    pub(crate) ends: Box<[StdArc<dyn EndIo>]>,
    pub(crate) data_offset: u64,
    pub(crate) capacity: u64,
    pub(crate) logical_block_size: u32,
    pub(crate) max_io: u32,
    pub(crate) barriers: Barriers,
    pub(crate) bitmap: Option<WriteIntentBitmap>,
    /// Serialises bitmap writes so later snapshots land later (see `bitmap`).
    pub(crate) persist: Mutex<()>,
    pub(crate) ios: Box<[Mutex<Io>]>,
    pub(crate) free: Mutex<Vec<u32>>,
    pub(crate) free_wq: WaitQueue,
    pub(crate) retry: Mutex<VecDeque<u32>>,
    pub(crate) daemon_wq: WaitQueue,
    pub(crate) stop: AtomicBool,
    pub(crate) sb_dirty: AtomicBool,
    pub(crate) meta: Mutex<ArrayMeta>,
    pub(crate) fail_lock: Mutex<()>,
    /// Array byte offset up to which a running resync has made the legs agree (u64::MAX: no
    /// resync running).
    pub(crate) resync_point: AtomicU64,
    pub(crate) pool: BufferPool,
    pub(crate) origin: Instant,
    /// The sync thread's state (see `sync`).
    pub(crate) sync: crate::sync::SyncState,
}

/// A RAID1 array over two or more legs. See the crate docs.
pub struct Raid1 {
    pub(crate) inner: StdArc<Inner>,
    daemon: Option<thread::JoinHandle<()>>,
    pub(crate) syncer: Option<thread::JoinHandle<()>>,
    /// `crash_for_test`: stop without writing clean superblocks.
    crashed: bool,
}

impl std::fmt::Debug for Raid1 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Raid1")
            .field("legs", &self.inner.legs.len())
            .field("capacity", &self.inner.capacity)
            .finish()
    }
}

fn eio(what: &'static str) -> Error {
    Error::Io(std::io::Error::other(what))
}

/// Completion for synchronous (slow path) I/O.
struct SyncEnd {
    done: Completion,
    out: Mutex<Option<(Bio, Result<(), Error>)>>,
}

impl EndIo for SyncEnd {
    fn end_io(&self, bio: Bio, res: Result<(), Error>) {
        *self.out.lock() = Some((bio, res));
        self.done.complete();
    }
}

/// Submits `bio` to `dev` and waits for it (allocates: slow paths only).
pub(crate) fn sync_io(dev: &dyn Device, bio: Bio) -> (Option<Bio>, Result<(), Error>) {
    let se = StdArc::new(SyncEnd {
        done: Completion::new(),
        out: Mutex::new(None),
    });
    let end: StdArc<dyn EndIo> = se.clone();
    dev.submit(bio, &end);
    se.done.wait();
    let out = se.out.lock().take();
    match out {
        Some((b, r)) => (Some(b), r),
        None => (None, Err(eio("lost completion"))),
    }
}

impl Raid1 {
    /// Creates a new array over `legs` (at least 2): writes fresh superblocks and empty
    /// bitmaps to every leg and starts the array's background thread.
    pub fn create(legs: Vec<StdArc<dyn Device>>, cfg: Raid1Config) -> Result<Self, Raid1Error> {
        if legs.len() < 2 {
            return Err(Raid1Error::Config("raid1 needs at least 2 legs".into()));
        }
        let nr_slots = legs.len() + cfg.spare_slots;
        if nr_slots > MAX_LEGS {
            return Err(Raid1Error::Config(format!("at most {MAX_LEGS} slots")));
        }
        if cfg.depth == 0 || cfg.depth > u32::MAX as usize {
            return Err(Raid1Error::Config("depth".into()));
        }
        let lims: Vec<Limits> = legs.iter().map(|l| l.limits()).collect();
        let leg_size = lims.iter().map(|l| l.capacity).min().unwrap_or(0);
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
        let chunk = if cfg.bitmap_chunk == 0 {
            DEFAULT_CHUNK_SIZE
        } else {
            cfg.bitmap_chunk
        };
        let sbs = Superblock::new_array(nr_slots, leg_size, chunk)?;
        let sb0 = &sbs[0];
        let data_offset = sb0.data_offset;
        let capacity = sb0.data_size / u64::from(lbs) * u64::from(lbs);
        let bitmap = if cfg.bitmap_chunk == 0 {
            None
        } else {
            Some(WriteIntentBitmap::new(capacity, chunk)?.with_quiet_time(cfg.bitmap_quiet))
        };
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
            })
            .collect();
        Self::launch(Launch {
            nr_slots,
            placed,
            array_uuid: sb0.array_uuid,
            events: 1,
            data_offset,
            capacity,
            lbs,
            max_io,
            bitmap,
            cfg,
            resync: false,
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
        let mut found = Vec::with_capacity(legs.len());
        for (i, dev) in legs.into_iter().enumerate() {
            let b = Bio::with_buf(
                Op::Read,
                SB_OFFSET >> SECTOR_SHIFT,
                Buffer::new(crate::superblock::SB_SIZE),
            );
            let (back, r) = sync_io(dev.as_ref(), b);
            r.map_err(|e| Raid1Error::Leg { leg: i, source: e })?;
            let buf = back
                .and_then(|b| b.buf)
                .ok_or(Raid1Error::Slot(i, "no data"))?;
            let sb = Superblock::decode(buf.as_slice())?;
            found.push((dev, sb));
        }
        let newest = found
            .iter()
            .max_by_key(|(_, sb)| sb.events)
            .map(|(_, sb)| sb.clone())
            .ok_or(Raid1Error::Config("no legs".into()))?;
        let nr_slots = newest.legs.len();
        let lims: Vec<Limits> = found.iter().map(|(d, _)| d.limits()).collect();
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
        let mut placed: Vec<Placed> = Vec::new();
        for (i, (dev, sb)) in found.into_iter().enumerate() {
            if sb.array_uuid != newest.array_uuid {
                return Err(Raid1Error::Slot(i, "leg belongs to another array"));
            }
            if dev.limits().capacity < newest.data_offset.saturating_add(newest.data_size) {
                return Err(Raid1Error::Slot(i, "leg smaller than the array"));
            }
            let Role::Slot(n) = sb.role else {
                continue; // spares are added later with add_leg
            };
            let n = n as usize;
            let Some(info) = newest.legs.get(n).filter(|l| l.uuid == sb.leg_uuid) else {
                continue; // replaced in its slot since: not part of the array any more
            };
            if placed.iter().any(|p| p.slot == n) {
                return Err(Raid1Error::Slot(i, "two legs claim the same slot"));
            }
            let mut state = PRESENT;
            if info.faulty {
                state |= FAULTY;
            }
            if info.write_mostly {
                state |= WRITE_MOSTLY;
            }
            let current = sb.events == newest.events;
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
                was_in_sync: sb.legs.get(n).is_some_and(|l| l.in_sync && !l.faulty),
                readd: false,
            });
        }
        if !placed
            .iter()
            .any(|p| p.state & (IN_SYNC | FAULTY) == IN_SYNC)
        {
            return Err(Raid1Error::Config("no in-sync leg: cannot assemble".into()));
        }
        let capacity = newest.data_size;
        let bitmap = if newest.bitmap.chunk_size == 0 {
            None
        } else {
            let bm = WriteIntentBitmap::new(capacity, newest.bitmap.chunk_size)?
                .with_quiet_time(cfg.bitmap_quiet);
            let mut loaded = false;
            for p in placed.iter().filter(|p| p.state & FAULTY == 0) {
                let len = bm.disk_len();
                let b = Bio::with_buf(
                    Op::Read,
                    newest.bitmap.offset >> SECTOR_SHIFT,
                    Buffer::new(len),
                );
                let (back, r) = sync_io(p.dev.as_ref(), b);
                if let (Ok(()), Some(buf)) = (r, back.and_then(|b| b.buf)) {
                    loaded |= bm.load(buf.as_slice()).is_ok();
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
            // recovery (md's re-add); any other recovering leg recovers fully.
            let cleared = bm.events_cleared();
            for p in placed.iter_mut() {
                p.readd = loaded
                    && p.state & (IN_SYNC | FAULTY) == 0
                    && p.recovery_offset == 0
                    && p.was_in_sync
                    && p.sb_events >= cleared;
            }
            Some(bm)
        };
        Self::launch(Launch {
            nr_slots,
            placed,
            array_uuid: newest.array_uuid,
            events: newest.events,
            data_offset: newest.data_offset,
            capacity,
            lbs,
            max_io,
            bitmap,
            cfg,
            resync: newest.array_state != ArrayState::Clean,
        })
    }

    pub(crate) fn launch(a: Launch) -> Result<Self, Raid1Error> {
        let cfg = a.cfg;
        let pool = BufferPool::new(a.max_io as usize, 4, cfg.depth.min(64));
        let inner = StdArc::new_cyclic(|weak: &Weak<Inner>| Inner {
            legs: (0..a.nr_slots).map(|_| Leg::empty()).collect(),
            ends: (0..a.nr_slots)
                .map(|leg| {
                    StdArc::new(LegEnd {
                        inner: weak.clone(),
                        leg,
                    }) as StdArc<dyn EndIo>
                })
                .collect(),
            data_offset: a.data_offset,
            capacity: a.capacity,
            logical_block_size: a.lbs,
            max_io: a.max_io,
            barriers: Barriers::new(cfg.barrier),
            bitmap: a.bitmap,
            persist: Mutex::new(()),
            ios: (0..cfg.depth).map(|_| Mutex::new(Io::default())).collect(),
            free: Mutex::new((0..cfg.depth as u32).rev().collect()),
            free_wq: WaitQueue::new(),
            retry: Mutex::new(VecDeque::with_capacity(cfg.depth)),
            daemon_wq: WaitQueue::new(),
            stop: AtomicBool::new(false),
            sb_dirty: AtomicBool::new(false),
            meta: Mutex::new(ArrayMeta {
                array_uuid: a.array_uuid,
                events: a.events,
                state: ArrayState::Active,
            }),
            fail_lock: Mutex::new(()),
            resync_point: AtomicU64::new(u64::MAX),
            pool,
            origin: Instant::now(),
            sync: crate::sync::SyncState::new(),
            cfg,
        });
        for p in a.placed {
            let l = &inner.legs[p.slot];
            *l.dev.lock() = Some(p.dev);
            *l.uuid.lock() = p.uuid;
            l.recovery_offset
                .store(p.recovery_offset, Ordering::Release);
            l.bitmap_recovery.store(p.readd, Ordering::Release);
            l.state.store(p.state, Ordering::Release);
        }
        if let Some(bm) = &inner.bitmap {
            bm.set_degraded(inner.is_degraded());
        }
        inner.sync.ctl.lock().resync_needed = a.resync;
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
        })
    }

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

    /// The state of slot `i`.
    pub fn leg_status(&self, i: usize) -> Option<LegStatus> {
        let l = self.inner.legs.get(i)?;
        let st = l.state.load(Ordering::Acquire);
        Some(LegStatus {
            present: st & PRESENT != 0,
            in_sync: st & IN_SYNC != 0,
            faulty: st & FAULTY != 0,
            write_mostly: st & WRITE_MOSTLY != 0,
            recovery_offset: l.recovery_offset.load(Ordering::Acquire),
            read_errors: l.read_errors.load(Ordering::Relaxed),
        })
    }

    /// The device in slot `i` (for a resync thread's direct leg I/O; offsets on it are leg
    /// offsets: add [`Raid1::data_offset`]).
    pub fn leg_device(&self, i: usize) -> Option<StdArc<dyn Device>> {
        self.inner.legs.get(i)?.dev()
    }

    /// Whether the array runs with a slot faulty or not in sync.
    pub fn is_degraded(&self) -> bool {
        self.inner.is_degraded()
    }

    /// Marks slot `i` faulty (refused for the last in-sync leg).
    pub fn fail_leg(&self, i: usize) -> Result<(), Raid1Error> {
        if i >= self.inner.legs.len() {
            return Err(Raid1Error::Slot(i, "no such slot"));
        }
        if self.inner.fail_leg(i) {
            Ok(())
        } else {
            Err(Raid1Error::Slot(i, "last in-sync leg, or not present"))
        }
    }

    /// Takes a faulty (or not in sync) leg out of its slot, with the array frozen.
    pub fn remove_leg(&self, i: usize) -> Result<StdArc<dyn Device>, Raid1Error> {
        let l = self
            .inner
            .legs
            .get(i)
            .ok_or(Raid1Error::Slot(i, "no such slot"))?;
        self.inner.barriers.freeze_array(0);
        let st = l.state.load(Ordering::Acquire);
        let r = if st & PRESENT == 0 {
            Err(Raid1Error::Slot(i, "empty"))
        } else if st & IN_SYNC != 0 && st & FAULTY == 0 {
            Err(Raid1Error::Slot(i, "in sync: fail it first"))
        } else {
            l.state.store(0, Ordering::Release);
            Ok(l.dev.lock().take())
        };
        let _ = self.inner.barriers.unfreeze_array();
        let dev = r?.ok_or(Raid1Error::Slot(i, "empty"))?;
        self.inner.state_changed();
        Ok(dev)
    }

    /// Puts `dev` into an empty slot as a recovering leg (recovery offset 0: written, not
    /// read) and wakes the sync thread, which recovers it. Returns the slot. Writes its
    /// superblock and bitmap.
    ///
    /// A re-add (md's `--re-add`): when `dev`'s own superblock says it held slot `n` of this
    /// array, slot `n` is empty and still names it, it was in sync when it left, and the
    /// bitmap's `events_cleared` is not past its events, it goes back into slot `n` and
    /// recovers only the bitmap's dirty chunks. Any other leg gets a fresh UUID and a full
    /// recovery.
    pub fn add_leg(&self, dev: StdArc<dyn Device>) -> Result<usize, Raid1Error> {
        let inner = &self.inner;
        if dev.limits().capacity < inner.data_offset + inner.capacity {
            return Err(Raid1Error::Config("new leg is too small".into()));
        }
        let old_sb = {
            let b = Bio::with_buf(
                Op::Read,
                SB_OFFSET >> SECTOR_SHIFT,
                Buffer::new(crate::superblock::SB_SIZE),
            );
            match sync_io(dev.as_ref(), b) {
                (Some(back), Ok(())) => back
                    .buf
                    .and_then(|buf| Superblock::decode(buf.as_slice()).ok()),
                _ => None,
            }
        };
        let array_uuid = inner.meta.lock().array_uuid;
        let readd_slot = old_sb.as_ref().and_then(|sb| {
            let bm = inner.bitmap.as_ref()?;
            let Role::Slot(n) = sb.role else { return None };
            let n = n as usize;
            let l = inner.legs.get(n)?;
            let ok = sb.array_uuid == array_uuid
                && *l.uuid.lock() == sb.leg_uuid
                && sb.legs.get(n).is_some_and(|i| i.in_sync && !i.faulty)
                && sb.events >= bm.events_cleared();
            ok.then_some(n)
        });
        inner.barriers.freeze_array(0);
        let free = |i: usize| inner.legs[i].state.load(Ordering::Acquire) & PRESENT == 0;
        let (slot, readd) = match readd_slot.filter(|&n| free(n)) {
            Some(n) => (Some(n), true),
            None => ((0..inner.legs.len()).find(|&i| free(i)), false),
        };
        if let Some(i) = slot {
            let l = &inner.legs[i];
            *l.dev.lock() = Some(dev);
            if !readd {
                *l.uuid.lock() = Uuid::new_v4();
            }
            l.recovery_offset.store(0, Ordering::Release);
            l.bitmap_recovery.store(readd, Ordering::Release);
            l.read_errors.store(0, Ordering::Relaxed);
            l.head.store(u64::MAX, Ordering::Relaxed);
            l.state.store(PRESENT, Ordering::Release);
        }
        let _ = inner.barriers.unfreeze_array();
        let i = slot.ok_or(Raid1Error::Config("no free slot".into()))?;
        inner.sync.ctl.lock().recovery_blocked = false;
        inner.state_changed();
        inner.write_superblocks()?;
        inner.persist_bitmap()?;
        Ok(i)
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
        self.inner.sb_dirty.store(true, Ordering::Release);
        Ok(())
    }

    /// Marks a present, non-faulty leg in sync (recovery done).
    pub fn set_in_sync(&self, i: usize) -> Result<(), Raid1Error> {
        let l = self
            .inner
            .legs
            .get(i)
            .ok_or(Raid1Error::Slot(i, "no such slot"))?;
        let st = l.state.load(Ordering::Acquire);
        if st & PRESENT == 0 || st & FAULTY != 0 {
            return Err(Raid1Error::Slot(i, "not present or faulty"));
        }
        l.state.fetch_or(IN_SYNC, Ordering::AcqRel);
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
        if on {
            l.state.fetch_or(WRITE_MOSTLY, Ordering::AcqRel);
        } else {
            l.state.fetch_and(!WRITE_MOSTLY, Ordering::AcqRel);
        }
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
        let _ = self.inner.barriers.unfreeze_array();
        if !self.crashed {
            // md marks the array clean only when no resync is left to do.
            let resync_left = self.inner.sync.ctl.lock().resync_needed;
            let state = if resync_left {
                ArrayState::Active
            } else {
                ArrayState::Clean
            };
            let _ = self.inner.write_superblocks_state(state);
        }
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

    fn extents(&self, offset: u64, len: u64, max: usize) -> Result<Vec<Extent>, Error> {
        let inner = &self.inner;
        let leg = inner
            .choose_read_leg(offset >> SECTOR_SHIFT, offset.saturating_add(len), 0)
            .and_then(|i| inner.legs[i].dev())
            .ok_or_else(|| eio("raid1: no readable leg"))?;
        let mut v = leg.extents(offset + inner.data_offset, len, max)?;
        for e in &mut v {
            e.offset -= inner.data_offset;
        }
        Ok(v)
    }
}

impl Inner {
    pub(crate) fn is_degraded(&self) -> bool {
        self.legs.iter().any(|l| {
            let st = l.state.load(Ordering::Acquire);
            st & PRESENT != 0 && (st & FAULTY != 0 || st & IN_SYNC == 0)
        }) || self
            .legs
            .iter()
            .filter(|l| {
                l.state.load(Ordering::Acquire) & (PRESENT | IN_SYNC | FAULTY)
                    == (PRESENT | IN_SYNC)
            })
            .count()
            < 2
    }

    pub(crate) fn state_changed(&self) {
        let degraded = self.is_degraded();
        if let Some(bm) = &self.bitmap {
            bm.set_degraded(degraded);
        }
        self.sb_dirty.store(true, Ordering::Release);
        self.daemon_wq.wake_all();
        // A leg to recover, or a target gone.
        self.sync.wq.wake_all();
    }

    /// Marks leg `i` faulty unless it is the last in-sync leg. Returns whether it did.
    pub(crate) fn fail_leg(&self, i: usize) -> bool {
        // Serialised, so two legs failing at once cannot both see the other as the survivor.
        let _g = self.fail_lock.lock();
        let l = &self.legs[i];
        let others = self
            .legs
            .iter()
            .enumerate()
            .filter(|&(j, o)| {
                j != i
                    && o.state.load(Ordering::Acquire) & (PRESENT | IN_SYNC | FAULTY)
                        == (PRESENT | IN_SYNC)
            })
            .count();
        let st = l.state.load(Ordering::Acquire);
        if st & PRESENT == 0 || (st & IN_SYNC != 0 && others == 0) {
            return false;
        }
        l.state.fetch_or(FAULTY, Ordering::AcqRel);
        self.state_changed();
        true
    }

    pub(crate) fn writable(st: u32) -> bool {
        st & PRESENT != 0 && st & FAULTY == 0
    }

    /// md's read balance: a sequential stream stays on its leg; otherwise the leg with the
    /// fewest requests in flight; write-mostly legs only when nothing else can serve.
    pub(crate) fn choose_read_leg(&self, sector: u64, end_byte: u64, tried: u32) -> Option<usize> {
        // During a resync, a read at or past the resync point goes to the first usable leg
        // (the resync's source), as md's `choose_first`, so it reads what the resync copies.
        let choose_first = end_byte > self.resync_point.load(Ordering::Acquire);
        let mut best: Option<(usize, usize)> = None;
        let mut mostly = None;
        for (i, l) in self.legs.iter().enumerate() {
            let st = l.state.load(Ordering::Acquire);
            if !Self::writable(st) || tried & (1 << i) != 0 {
                continue;
            }
            if st & IN_SYNC == 0 && end_byte > l.recovery_offset.load(Ordering::Acquire) {
                continue;
            }
            if choose_first {
                return Some(i);
            }
            if st & WRITE_MOSTLY != 0 {
                mostly.get_or_insert(i);
                continue;
            }
            if l.head.load(Ordering::Relaxed) == sector {
                return Some(i);
            }
            let p = l.pending.load(Ordering::Relaxed);
            if best.is_none_or(|(_, bp)| p < bp) {
                best = Some((i, p));
            }
        }
        best.map(|(i, _)| i).or(mostly)
    }

    pub(crate) fn leg_bio(&self, orig: &Bio, buf: Option<Buffer>, slot: u32) -> Bio {
        let mut b = Bio::new(
            orig.op,
            orig.sector + (self.data_offset >> SECTOR_SHIFT),
            orig.len,
        );
        b.flags = orig.flags;
        b.prio = orig.prio;
        b.buf = buf;
        b.cookie = u64::from(slot);
        b
    }

    pub(crate) fn get_slot(&self) -> u32 {
        self.free_wq.wait_for(|| self.free.lock().pop())
    }

    pub(crate) fn put_slot(&self, id: u32) {
        self.free.lock().push(id);
        self.free_wq.wake_one();
    }

    pub(crate) fn submit(&self, bio: Bio, end: &StdArc<dyn EndIo>) {
        let lim = Limits {
            capacity: self.capacity,
            logical_block_size: self.logical_block_size,
            max_io_bytes: self.max_io,
        };
        let checked = lim.validate(&bio).and_then(|()| {
            if !bio.op.has_data() {
                return Ok(());
            }
            match &bio.buf {
                None => Err(Error::NoBuffer),
                Some(b) if (b.len() as u64) < u64::from(bio.len) => Err(Error::BufferTooSmall {
                    len: u64::from(bio.len),
                    buf: b.len() as u64,
                }),
                Some(_) => Ok(()),
            }
        });
        if let Err(e) = checked {
            end.end_io(bio, Err(e));
            return;
        }
        match bio.op {
            Op::Read => self.submit_read(bio, end),
            Op::Write | Op::Discard | Op::WriteZeroes => self.submit_write(bio, end),
            Op::Flush => self.submit_flush(bio, end),
        }
    }

    pub(crate) fn submit_read(&self, mut bio: Bio, end: &StdArc<dyn EndIo>) {
        let sector = bio.sector;
        self.barriers.wait_read_barrier(sector);
        let Some(leg) = self.choose_read_leg(sector, bio.offset() + u64::from(bio.len), 0) else {
            let _ = self.barriers.allow_barrier(sector);
            end.end_io(bio, Err(eio("raid1: no readable leg")));
            return;
        };
        let Some(dev) = self.legs[leg].dev() else {
            let _ = self.barriers.allow_barrier(sector);
            end.end_io(bio, Err(eio("raid1: leg vanished")));
            return;
        };
        let id = self.get_slot();
        let buf = bio.buf.take();
        let lb = self.leg_bio(&bio, buf, id);
        {
            let mut io = self.ios[id as usize].lock();
            *io = Io {
                kind: Kind::Read,
                orig: Some(bio),
                end: Some(end.clone()),
                remaining: 1,
                tried: 1 << leg,
                primary: leg,
                ..Io::default()
            };
        }
        let l = &self.legs[leg];
        l.head.store(
            lb.end_sector() - (self.data_offset >> SECTOR_SHIFT),
            Ordering::Relaxed,
        );
        l.pending.fetch_add(1, Ordering::Relaxed);
        dev.submit(lb, &self.ends[leg]);
    }

    pub(crate) fn submit_write(&self, mut bio: Bio, end: &StdArc<dyn EndIo>) {
        let sector = bio.sector;
        let (off, len) = (bio.offset(), u64::from(bio.len));
        self.barriers.wait_barrier(sector);
        if let Some(bm) = &self.bitmap {
            match bm.start_write(off, len) {
                Ok(None) => {}
                Ok(Some(set)) => {
                    // The bit must be on disk on every leg before the data write is issued.
                    if self.persist_bitmap().is_ok() {
                        bm.mark_durable(set);
                    }
                }
                Err(e) => {
                    let _ = self.barriers.allow_barrier(sector);
                    end.end_io(bio, Err(Error::Config(e.to_string())));
                    return;
                }
            }
        }
        // Legs to write: present and not faulty (recovering legs included).
        let mut mask = 0u32;
        let mut devs: [Option<StdArc<dyn Device>>; MAX_LEGS] = Default::default();
        for (i, l) in self.legs.iter().enumerate() {
            if Self::writable(l.state.load(Ordering::Acquire)) {
                if let Some(d) = l.dev() {
                    devs[i] = Some(d);
                    mask |= 1 << i;
                }
            }
        }
        if mask == 0 {
            self.write_finished(off, len, sector);
            end.end_io(bio, Err(eio("raid1: no writable leg")));
            return;
        }
        let primary = mask.trailing_zeros() as usize;
        let id = self.get_slot();
        // Copies for the extra legs first, then the original buffer goes to the primary.
        let mut bios: [Option<Bio>; MAX_LEGS] = Default::default();
        for (i, slot) in bios.iter_mut().enumerate().take(self.legs.len()) {
            if mask & (1 << i) == 0 || i == primary {
                continue;
            }
            let copy = match &bio.buf {
                Some(src) if bio.op == Op::Write => {
                    let mut c = self
                        .pool
                        .get(src.len())
                        .unwrap_or_else(|| Buffer::new(src.len()));
                    c.as_mut_slice().copy_from_slice(src.as_slice());
                    Some(c)
                }
                _ => None,
            };
            *slot = Some(self.leg_bio(&bio, copy, id));
        }
        let buf = bio.buf.take();
        bios[primary] = Some(self.leg_bio(&bio, buf, id));
        {
            let mut io = self.ios[id as usize].lock();
            *io = Io {
                kind: Kind::Write,
                orig: Some(bio),
                end: Some(end.clone()),
                remaining: mask.count_ones(),
                primary,
                ..Io::default()
            };
        }
        for i in 0..self.legs.len() {
            if let (Some(b), Some(d)) = (bios[i].take(), devs[i].take()) {
                self.legs[i].pending.fetch_add(1, Ordering::Relaxed);
                d.submit(b, &self.ends[i]);
            }
        }
    }

    pub(crate) fn submit_flush(&self, bio: Bio, end: &StdArc<dyn EndIo>) {
        let mut mask = 0u32;
        let mut devs: [Option<StdArc<dyn Device>>; MAX_LEGS] = Default::default();
        for (i, l) in self.legs.iter().enumerate() {
            if Self::writable(l.state.load(Ordering::Acquire)) {
                if let Some(d) = l.dev() {
                    devs[i] = Some(d);
                    mask |= 1 << i;
                }
            }
        }
        if mask == 0 {
            end.end_io(bio, Err(eio("raid1: no leg to flush")));
            return;
        }
        let id = self.get_slot();
        {
            let mut io = self.ios[id as usize].lock();
            *io = Io {
                kind: Kind::Flush,
                orig: Some(bio),
                end: Some(end.clone()),
                remaining: mask.count_ones(),
                primary: usize::MAX,
                ..Io::default()
            };
        }
        for (i, d) in devs.iter_mut().enumerate() {
            if let Some(d) = d.take() {
                let mut b = Bio::new(Op::Flush, 0, 0);
                b.cookie = u64::from(id);
                self.legs[i].pending.fetch_add(1, Ordering::Relaxed);
                d.submit(b, &self.ends[i]);
            }
        }
    }

    pub(crate) fn write_finished(&self, off: u64, len: u64, sector: u64) {
        if let Some(bm) = &self.bitmap {
            let _ = bm.end_write(off, len, self.origin.elapsed());
        }
        let _ = self.barriers.allow_barrier(sector);
    }

    /// A leg bio completed.
    pub(crate) fn leg_done(&self, leg: usize, mut bio: Bio, res: Result<(), Error>) {
        self.legs[leg].pending.fetch_sub(1, Ordering::Relaxed);
        let Some(slot) = self.ios.get(bio.cookie as usize) else {
            return; // not ours: cannot happen, and nothing to complete
        };
        let id = bio.cookie as u32;
        let mut io = slot.lock();
        match io.kind {
            Kind::Free => {}
            Kind::Read => {
                if let Some(o) = io.orig.as_mut() {
                    o.buf = bio.buf.take();
                }
                match res {
                    Ok(()) => {
                        let orig = io.orig.take();
                        let end = io.end.take();
                        *io = Io::default();
                        drop(io);
                        self.finish_regular(id, orig, end, Ok(()));
                    }
                    Err(e) => {
                        // Retry on another leg and repair, in raid1d, with the array frozen.
                        if io.err.is_none() {
                            io.err = Some(e);
                        }
                        let sector = io.orig.as_ref().map_or(0, |o| o.sector);
                        drop(io);
                        self.barriers.queue_io(sector);
                        self.retry.lock().push_back(id);
                        self.daemon_wq.wake_all();
                    }
                }
            }
            Kind::Write | Kind::Flush => {
                if leg == io.primary {
                    if let Some(o) = io.orig.as_mut() {
                        o.buf = bio.buf.take();
                    }
                }
                match res {
                    Ok(()) => io.ok += 1,
                    Err(e) => {
                        if io.err.is_none() {
                            io.err = Some(e);
                        }
                        // A failed write makes the leg stale: fail it (refused for the last
                        // in-sync leg, whose error then reaches the caller).
                        self.fail_leg(leg);
                    }
                }
                io.remaining -= 1;
                if io.remaining > 0 {
                    return;
                }
                let res = if io.ok > 0 {
                    Ok(())
                } else {
                    Err(io.err.take().unwrap_or_else(|| eio("raid1: write failed")))
                };
                let kind = io.kind;
                let orig = io.orig.take();
                let end = io.end.take();
                *io = Io::default();
                drop(io);
                if kind == Kind::Flush {
                    self.put_slot(id);
                    if let (Some(o), Some(e)) = (orig, end) {
                        e.end_io(o, res);
                    }
                } else {
                    self.finish_regular(id, orig, end, res);
                }
            }
        }
    }

    /// Ends a regular read or write: bitmap, barrier, slot, caller.
    pub(crate) fn finish_regular(
        &self,
        id: u32,
        orig: Option<Bio>,
        end: Option<StdArc<dyn EndIo>>,
        res: Result<(), Error>,
    ) {
        self.put_slot(id);
        let Some(o) = orig else { return };
        if o.op == Op::Read {
            let _ = self.barriers.allow_barrier(o.sector);
        } else {
            self.write_finished(o.offset(), u64::from(o.len), o.sector);
        }
        if let Some(e) = end {
            e.end_io(o, res);
        }
    }

    /// raid1d's handling of a failed read: with the array frozen, read the range from another
    /// leg, rewrite it on the legs that failed (failing a leg whose rewrite fails or whose
    /// error count passes the limit), and complete the read.
    pub(crate) fn fix_read(&self, id: u32) {
        let (mut orig, end, mut tried, err) = {
            let mut io = self.ios[id as usize].lock();
            let t = (io.orig.take(), io.end.take(), io.tried, io.err.take());
            *io = Io::default();
            t
        };
        self.put_slot(id);
        let Some(mut o) = orig.take() else { return };
        let sector = o.sector;
        let _ = self.barriers.unqueue_io(sector);
        self.barriers.freeze_array(1);
        let failed = tried;
        let end_byte = o.offset() + u64::from(o.len);
        let mut good = None;
        while let Some(leg) = self.choose_read_leg(sector, end_byte, tried) {
            tried |= 1 << leg;
            let Some(dev) = self.legs[leg].dev() else {
                continue;
            };
            let buf = o.buf.take().unwrap_or_else(|| Buffer::new(o.len as usize));
            let lb = self.leg_bio(&o, Some(buf), id);
            let (back, r) = sync_io(dev.as_ref(), lb);
            o.buf = back.and_then(|mut b| b.buf.take());
            if r.is_ok() {
                good = Some(leg);
                break;
            }
            self.note_read_error(leg);
        }
        if good.is_some() {
            for leg in 0..self.legs.len() {
                if failed & (1 << leg) == 0 {
                    continue;
                }
                self.note_read_error(leg);
                let st = self.legs[leg].state.load(Ordering::Acquire);
                let Some(dev) = self.legs[leg].dev().filter(|_| Self::writable(st)) else {
                    continue;
                };
                let Some(src) = o.buf.as_ref() else { break };
                let mut copy = Buffer::new(src.len());
                copy.as_mut_slice().copy_from_slice(src.as_slice());
                let mut wb = self.leg_bio(&o, Some(copy), id);
                wb.op = Op::Write;
                wb.flags = BioFlags::NONE;
                if sync_io(dev.as_ref(), wb).1.is_err() {
                    self.fail_leg(leg);
                }
            }
        }
        let _ = self.barriers.unfreeze_array();
        let _ = self.barriers.allow_barrier(sector);
        let res = match good {
            Some(_) => Ok(()),
            None => Err(err.unwrap_or_else(|| eio("raid1: no leg could read"))),
        };
        if let Some(e) = end {
            e.end_io(o, res);
        }
    }

    pub(crate) fn note_read_error(&self, leg: usize) {
        let n = self.legs[leg].read_errors.fetch_add(1, Ordering::AcqRel) + 1;
        if n > self.cfg.read_error_limit {
            self.fail_leg(leg);
        }
    }

    pub(crate) fn superblock_for(&self, i: usize) -> Superblock {
        let meta = self.meta.lock();
        let bitmap = crate::superblock::BitmapLocation {
            offset: crate::superblock::BITMAP_OFFSET,
            len: self.bitmap.as_ref().map_or(0, |b| b.disk_len() as u64),
            chunk_size: self.bitmap.as_ref().map_or(0, |b| b.chunk_size()),
        };
        let legs = self
            .legs
            .iter()
            .map(|l| {
                let st = l.state.load(Ordering::Acquire);
                let present = st & PRESENT != 0;
                LegInfo {
                    uuid: if present { *l.uuid.lock() } else { Uuid::nil() },
                    in_sync: st & IN_SYNC != 0,
                    faulty: st & FAULTY != 0,
                    write_mostly: st & WRITE_MOSTLY != 0,
                    recovery_offset: (present && st & IN_SYNC == 0 && st & FAULTY == 0)
                        .then(|| l.recovery_offset.load(Ordering::Acquire)),
                }
            })
            .collect();
        let state = if self.is_degraded() {
            ArrayState::Degraded
        } else if meta.state == ArrayState::Clean {
            ArrayState::Clean
        } else {
            ArrayState::Active
        };
        Superblock {
            array_uuid: meta.array_uuid,
            leg_uuid: *self.legs[i].uuid.lock(),
            role: Role::Slot(i as u32),
            array_state: state,
            data_offset: self.data_offset,
            data_size: self.capacity,
            events: meta.events,
            bitmap,
            legs,
        }
    }

    pub(crate) fn write_superblocks_state(&self, state: ArrayState) -> Result<(), Raid1Error> {
        self.meta.lock().state = state;
        self.write_superblocks()
    }

    /// Bumps `events` and writes every present, non-faulty leg's superblock, then flushes.
    pub(crate) fn write_superblocks(&self) -> Result<(), Raid1Error> {
        let _g = self.persist.lock();
        self.sb_dirty.store(false, Ordering::Release);
        self.meta.lock().events += 1;
        let mut first_err = None;
        for (i, l) in self.legs.iter().enumerate() {
            if !Self::writable(l.state.load(Ordering::Acquire)) {
                continue;
            }
            let Some(dev) = l.dev() else { continue };
            let sb = self.superblock_for(i);
            let mut buf = Buffer::new(crate::superblock::SB_SIZE);
            sb.encode_into(buf.as_mut_slice())?;
            let mut b = Bio::with_buf(Op::Write, SB_OFFSET >> SECTOR_SHIFT, buf);
            b.flags = BioFlags::FUA;
            if let Err(e) = sync_io(dev.as_ref(), b).1 {
                self.fail_leg(i);
                first_err.get_or_insert(Raid1Error::Leg { leg: i, source: e });
            }
        }
        match first_err {
            Some(e)
                if !self
                    .legs
                    .iter()
                    .any(|l| Self::writable(l.state.load(Ordering::Acquire))) =>
            {
                Err(e)
            }
            _ => Ok(()),
        }
    }

    /// Writes the bitmap to every writable leg and flushes them. Under `persist`, so a later
    /// snapshot always lands after an earlier one.
    pub(crate) fn persist_bitmap(&self) -> Result<(), Raid1Error> {
        let Some(bm) = &self.bitmap else {
            return Ok(());
        };
        let _g = self.persist.lock();
        let bytes = bm.encode();
        let mut ok = 0;
        let mut first_err = None;
        for (i, l) in self.legs.iter().enumerate() {
            if !Self::writable(l.state.load(Ordering::Acquire)) {
                continue;
            }
            let Some(dev) = l.dev() else { continue };
            let mut buf = Buffer::new(bytes.len());
            buf.as_mut_slice().copy_from_slice(&bytes);
            let b = Bio::with_buf(
                Op::Write,
                crate::superblock::BITMAP_OFFSET >> SECTOR_SHIFT,
                buf,
            );
            let r = sync_io(dev.as_ref(), b)
                .1
                .and_then(|()| sync_io(dev.as_ref(), Bio::new(Op::Flush, 0, 0)).1);
            match r {
                Ok(()) => ok += 1,
                Err(e) => {
                    self.fail_leg(i);
                    first_err.get_or_insert(Raid1Error::Leg { leg: i, source: e });
                }
            }
        }
        match first_err {
            Some(e) if ok == 0 => Err(e),
            _ => Ok(()),
        }
    }

    /// Flushes every writable leg (a bitmap flush epoch).
    pub(crate) fn flush_legs(&self) -> bool {
        let mut all = true;
        for l in self.legs.iter() {
            if !Self::writable(l.state.load(Ordering::Acquire)) {
                continue;
            }
            if let Some(dev) = l.dev() {
                all &= sync_io(dev.as_ref(), Bio::new(Op::Flush, 0, 0)).1.is_ok();
            }
        }
        all
    }

    /// The background thread (md's raid1d): read retries, superblock updates, lazy bitmap
    /// clearing.
    pub(crate) fn daemon(&self) {
        let mut next_tick = Instant::now() + self.cfg.tick;
        loop {
            let stop = self.stop.load(Ordering::Acquire);
            let next = self.retry.lock().pop_front();
            if let Some(id) = next {
                self.fix_read(id);
                continue;
            }
            if stop {
                return;
            }
            if self.sb_dirty.load(Ordering::Acquire) {
                let _ = self.write_superblocks();
            }
            if Instant::now() >= next_tick {
                next_tick = Instant::now() + self.cfg.tick;
                if let Some(bm) = &self.bitmap {
                    if !bm.dirty_chunks().is_empty() && !self.is_degraded() {
                        let e = bm.begin_flush();
                        if self.flush_legs() {
                            bm.flush_done(e);
                        }
                        if bm.clear_quiet(self.origin.elapsed()) > 0 {
                            bm.set_events_cleared(self.meta.lock().events);
                            let _ = self.persist_bitmap();
                        }
                    }
                }
            }
            let _ = self.daemon_wq.wait_for_until(
                || {
                    (self.stop.load(Ordering::Acquire)
                        || self.sb_dirty.load(Ordering::Acquire)
                        || !self.retry.lock().is_empty())
                    .then_some(())
                },
                next_tick,
            );
        }
    }
}
