//! [`Bitmaps`]: an export's named dirty bitmaps, what the write path marks and what management
//! (`add`, `remove`, `clear`, `rotate`, `list`) changes, with the store they persist to.
//!
//! # Every operation is durable before it returns, and a crash leaves a superset
//!
//! Management is serialized by one lock (`ctl`); the write path never takes it. Each
//! operation writes the sidecar's header (double-buffered) and switches the gate's recording
//! set in the order that keeps the on-disk bitmaps a superset of the writes after a crash at
//! any point:
//!
//! - `add NAME`: a zeroed region, then the header naming it, then the gate (NAME recording).
//!   A crash before the header: no NAME (the add did not return).
//! - `remove NAME`: the header without NAME, then the gate. A crash between: NAME is gone.
//!   Writes still counted in NAME persist into its unnamed region, reused only after the gate
//!   drained them.
//! - `rotate OLD NEW`: a zeroed region for NEW, then the header (OLD frozen, NEW recording),
//!   then the gate switches OLD for NEW in one publish and waits for the writes counted in OLD
//!   to complete. In memory every write is counted in exactly one of them. A crash between the
//!   header and the gate: writes counted in OLD reached OLD's region, so the frozen OLD holds
//!   them (the rotate did not return: the backup tool reads OLD, as it would have).
//! - `clear NAME` (recording): a zeroed region for the fresh NAME, then the gate counts writes
//!   in both the old and the fresh one (drained), then the header names the fresh one, then
//!   the gate drops the old one (drained). Whichever header survives a crash, it names a
//!   region holding every write since the clear began. A frozen NAME is just re-pointed.
//!
//! - `disable NAME` / `enable NAME`: the header with NAME frozen (or recording), then the gate.
//!   Disabling returns once the writes counted in NAME completed; a crash before the header
//!   leaves it as it was (the command did not return). An enabled NAME counts the writes that
//!   start after the gate switched (qemu's `block-dirty-bitmap-enable`); those in between are
//!   in no bitmap the command promised anything of.
//! - `merge TARGET SOURCE...`: every bit dirty in a source (at its granularity, rounded out
//!   to the target's) is set in TARGET and persisted (the write path's own persist) before it
//!   returns; TARGET never loses a bit, so a crash at any point leaves it a superset of what
//!   it held and, once the command returned, of each source as it was when read.
//!
//! With `--bitmaps-reset`, a sidecar that is torn or from another image is rebuilt with the
//! same names, every bit set (the next backup from each is a full one); a missing one starts
//! empty. Both are said in the notes [`Bitmaps::open`] returns.

mod open;

use std::path::PathBuf;

use blkq_sync::{Arc, DynArc, Mutex};

use crate::bits::{check_granularity, Bitmap};
use crate::commit::{CommitStats, Committer};
use crate::gate::{Gate, Mode};
use crate::identity::{self, ImageId};
use crate::sidecar::{self, alloc_region, region_pages, Entry, Header, Identity, Sidecars};
use crate::sink::Sink;
use crate::Error;

/// Where an export's bitmaps are kept.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Store {
    /// In memory only (lost when the server stops).
    Memory,
    /// In a sidecar file.
    File {
        /// The sidecar's path.
        path: PathBuf,
        /// Whose sidecar it is.
        image: Image,
    },
    /// A mirror's: a copy of the sidecar at each path (one beside each file leg), all kept up
    /// to date; at start the newest copy of this array is taken and the others, stale or
    /// refused, are replaced by it and said in the notes (see `open_copies` in `open`).
    Mirror {
        /// The copies' paths.
        sidecars: Vec<PathBuf>,
        /// More copies to read, never written (beside a leg named but not in the array now):
        /// one may be the newest.
        others: Vec<PathBuf>,
        /// The array's capacity and UUID.
        ident: Identity,
        /// The array's generations, current first then earlier ones, newest first (a copy
        /// from a generation not among them belongs to a history the array does not share).
        generations: Vec<u64>,
    },
}

/// The image a sidecar belongs to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Image {
    /// A `file:` image: its identity is its size and the UUID in its attribute
    /// (see [`crate::identity`]).
    File(PathBuf),
    /// A fixed identity (a mirror's array UUID; a memory device's size with a nil UUID).
    Fixed(Identity),
}

/// How to open an export's bitmaps.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Options {
    /// Where.
    pub store: Store,
    /// Replace a missing, torn or foreign sidecar instead of refusing it.
    pub reset: bool,
    /// The gate's mode (the locked twin for comparisons).
    pub mode: Mode,
}

impl Options {
    /// Bitmaps in memory only, lock-free gate.
    pub fn memory() -> Self {
        Self {
            store: Store::Memory,
            reset: false,
            mode: Mode::LockFree,
        }
    }
}

/// One bitmap as `list` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Info {
    /// Name.
    pub name: String,
    /// Bytes per bit.
    pub granularity: u64,
    /// `false` once frozen by `rotate`.
    pub recording: bool,
    /// Bytes marked dirty.
    pub dirty_bytes: u64,
}

#[derive(Clone)]
struct Slot {
    bm: Arc<Bitmap>,
    frozen: bool,
}

struct Ctl {
    /// The sidecar's header as last written (`None`: memory, or not created yet).
    header: Option<Header>,
    file: Option<DynArc<Sidecars>>,
    image: Option<(PathBuf, ImageId)>,
    ident: Identity,
    /// What a created sidecar records as its generation (a mirror's current one; 0).
    generation: u64,
}

impl Ctl {
    /// Bitmaps kept in memory only, of a device of `capacity` bytes: no sidecar.
    fn memory(capacity: u64) -> Self {
        Ctl {
            header: None,
            file: None,
            image: None,
            ident: Identity {
                size: capacity,
                uuid: [0; 16],
            },
            generation: 0,
        }
    }
}

/// An export's named dirty bitmaps. See the module docs.
pub struct Bitmaps {
    capacity: u64,
    gate: Gate<Vec<Arc<Bitmap>>>,
    committer: Committer,
    ctl: Mutex<Ctl>,
    /// What readers see: every bitmap, in creation order. Replaced under `ctl`, read briefly.
    view: Mutex<Vec<Slot>>,
}

/// Checks a bitmap name: 1 to [`sidecar::MAX_NAME`] bytes, no whitespace or control
/// characters ([`Error::BadName`] says so).
pub fn check_name(name: &str) -> Result<(), Error> {
    if name.is_empty()
        || name.len() > sidecar::MAX_NAME
        || name.chars().any(|c| c.is_control() || c.is_whitespace())
    {
        return Err(Error::BadName(name.to_string()));
    }
    Ok(())
}

impl Bitmaps {
    /// Bitmaps kept in memory whose pages go to `sink` as a sidecar's would (no header: what
    /// fault-injection tests and benchmarks of the persist path use).
    pub fn with_sink(capacity: u64, mode: Mode, sink: DynArc<dyn Sink>) -> Self {
        Self {
            capacity,
            gate: Gate::new(mode, Vec::new(), Vec::new()),
            committer: Committer::new(sink),
            ctl: Mutex::new(Ctl::memory(capacity)),
            view: Mutex::new(Vec::new()),
        }
    }

    /// The device's size.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// The gate's mode.
    pub fn mode(&self) -> Mode {
        self.gate.mode()
    }

    /// The write path: counts a write of `[offset, offset + len)` in every recording bitmap,
    /// persisting bits that were clean, and returns the gate's token to pass to
    /// [`Bitmaps::end_write`] once the device completed the write. `Err`: a persist failed;
    /// the write must not go down (end it with the error, after `end_write`).
    pub fn start_write(&self, offset: u64, len: u64) -> (u64, Result<(), blk::Error>) {
        self.gate.enter(|set| {
            for bm in set {
                if let Some(words) = bm.mark(offset, len) {
                    self.committer
                        .persist(bm, words, offset, len)
                        .map_err(|m| blk::Error::Io(std::io::Error::other(m)))?;
                }
            }
            Ok(())
        })
    }

    /// Ends a write started with [`Bitmaps::start_write`].
    pub fn end_write(&self, token: u64) {
        self.gate.exit(token)
    }

    /// What the committer did (persists, pages).
    pub fn commit_stats(&self) -> CommitStats {
        self.committer.stats()
    }

    /// The bitmaps, in creation order.
    pub fn list(&self) -> Vec<Info> {
        self.view
            .lock()
            .iter()
            .map(|s| Info {
                name: s.bm.name().to_string(),
                granularity: s.bm.granularity(),
                recording: !s.frozen,
                dirty_bytes: s.bm.dirty_bytes(),
            })
            .collect()
    }

    /// The sidecar's path, when the bitmaps persist to one (a mirror's first copy still
    /// written).
    pub fn sidecar_path(&self) -> Option<PathBuf> {
        self.sidecar_paths().into_iter().next()
    }

    /// The paths of every copy of the sidecar still written (one, but a mirror's).
    pub fn sidecar_paths(&self) -> Vec<PathBuf> {
        self.ctl
            .lock()
            .file
            .as_ref()
            .map(|f| f.paths())
            .unwrap_or_default()
    }

    fn find(&self, name: &str) -> Option<Arc<Bitmap>> {
        self.view
            .lock()
            .iter()
            .find(|s| s.bm.name() == name)
            .map(|s| s.bm.clone())
    }

    /// The dirty runs of bitmap `name` over `[offset, offset + len)` (see
    /// [`blk::DirtyBitmaps::dirty_extents_into`]). Takes the readers' lock only to find the
    /// bitmap; the bits are read with loads, never blocking a writer.
    pub fn extents_into(
        &self,
        name: &str,
        offset: u64,
        len: u64,
        max: usize,
        out: &mut Vec<blk::DirtyExtent>,
    ) -> Result<(), Error> {
        let bm = self
            .find(name)
            .ok_or_else(|| Error::NotFound(name.to_string()))?;
        bm.extents_into(offset, len, max, out);
        Ok(())
    }

    /// Whether bitmap `name` marks byte `offset` dirty (tests, tools).
    pub fn is_dirty(&self, name: &str, offset: u64) -> Result<bool, Error> {
        let bm = self
            .find(name)
            .ok_or_else(|| Error::NotFound(name.to_string()))?;
        Ok(bm.is_dirty(offset >> bm.shift()))
    }

    /// Adds a clean, recording bitmap `name` with `granularity` bytes per bit.
    pub fn add(&self, name: &str, granularity: u64) -> Result<(), Error> {
        check_name(name)?;
        let shift = check_granularity(granularity)?;
        let mut ctl = self.ctl.lock();
        let mut slots = self.view.lock().clone();
        if slots.iter().any(|s| s.bm.name() == name) {
            return Err(Error::Exists(name.to_string()));
        }
        if slots.len() >= sidecar::MAX_BITMAPS {
            return Err(Error::TooMany(sidecar::MAX_BITMAPS));
        }
        let bm = self.new_bitmap(&mut ctl, name, shift, &[])?;
        slots.push(Slot { bm, frozen: false });
        self.write_header(&mut ctl, &slots)?;
        self.switch(&slots, None);
        Ok(())
    }

    /// Removes bitmap `name`.
    pub fn remove(&self, name: &str) -> Result<(), Error> {
        let mut ctl = self.ctl.lock();
        let mut slots = self.view.lock().clone();
        let i = position(&slots, name)?;
        slots.remove(i);
        self.write_header(&mut ctl, &slots)?;
        self.switch(&slots, None);
        Ok(())
    }

    /// Clears bitmap `name` (durably: see the module docs).
    pub fn clear(&self, name: &str) -> Result<(), Error> {
        let mut ctl = self.ctl.lock();
        let mut slots = self.view.lock().clone();
        let i = position(&slots, name)?;
        let old = slots[i].bm.clone();
        let fresh = self.new_bitmap(&mut ctl, name, old.shift(), &[&old])?;
        if !slots[i].frozen {
            // Writes count in both while the header moves (module docs).
            self.switch(&slots, Some(fresh.clone()));
        }
        slots[i].bm = fresh;
        self.write_header(&mut ctl, &slots)?;
        self.switch(&slots, None);
        Ok(())
    }

    /// Freezes `old` and starts `new` (same granularity) at one instant: every write is
    /// counted in exactly one of them, and when this returns every write counted in `old`
    /// has completed.
    pub fn rotate(&self, old: &str, new: &str) -> Result<(), Error> {
        check_name(new)?;
        let mut ctl = self.ctl.lock();
        let mut slots = self.view.lock().clone();
        let i = position(&slots, old)?;
        if slots[i].frozen {
            return Err(Error::Frozen(old.to_string()));
        }
        if slots.iter().any(|s| s.bm.name() == new) {
            return Err(Error::Exists(new.to_string()));
        }
        if slots.len() >= sidecar::MAX_BITMAPS {
            return Err(Error::TooMany(sidecar::MAX_BITMAPS));
        }
        let bm = self.new_bitmap(&mut ctl, new, slots[i].bm.shift(), &[])?;
        slots[i].frozen = true;
        slots.push(Slot { bm, frozen: false });
        self.write_header(&mut ctl, &slots)?;
        self.switch(&slots, None);
        Ok(())
    }

    /// Stops (`recording` false) or starts counting writes in bitmap `name`, keeping its
    /// bits (qemu's `block-dirty-bitmap-disable` / `-enable`). Asking for the state it is in
    /// changes nothing. Disabling returns once every write counted in it has completed.
    pub fn set_recording(&self, name: &str, recording: bool) -> Result<(), Error> {
        let mut ctl = self.ctl.lock();
        let mut slots = self.view.lock().clone();
        let i = position(&slots, name)?;
        if slots[i].frozen != recording {
            return Ok(());
        }
        slots[i].frozen = !recording;
        self.write_header(&mut ctl, &slots)?;
        self.switch(&slots, None);
        Ok(())
    }

    /// Sets in bitmap `target` every granule dirty in each of `sources` (the union, qemu's
    /// `block-dirty-bitmap-merge`), durably before it returns. The bitmaps may differ in
    /// granularity (a source's dirty run is rounded out to the target's) and in state
    /// (recording or frozen). The sources are unchanged.
    pub fn merge(&self, target: &str, sources: &[String]) -> Result<(), Error> {
        let _ctl = self.ctl.lock();
        let (dst, srcs) = {
            let view = self.view.lock();
            let find = |n: &str| {
                view.iter()
                    .find(|s| s.bm.name() == n)
                    .map(|s| s.bm.clone())
                    .ok_or_else(|| Error::NotFound(n.to_string()))
            };
            let dst = find(target)?;
            let mut srcs = Vec::with_capacity(sources.len());
            for n in sources {
                if n == target {
                    return Err(Error::SelfMerge(n.clone()));
                }
                srcs.push(find(n)?);
            }
            (dst, srcs)
        };
        let mut runs = Vec::with_capacity(MERGE_RUNS);
        for src in srcs {
            let mut pos = 0;
            while pos < self.capacity {
                src.extents_into(pos, self.capacity - pos, MERGE_RUNS, &mut runs);
                if runs.is_empty() {
                    break;
                }
                for r in &runs {
                    if r.dirty {
                        if let Some(words) = dst.mark(pos, r.len) {
                            self.committer
                                .persist(&dst, words, pos, r.len)
                                .map_err(Error::Persist)?;
                        }
                    }
                    pos += r.len;
                }
            }
        }
        Ok(())
    }

    /// Publishes `slots` to readers and their recording bitmaps (plus `extra`) to the gate;
    /// returns once the writes counted in the previous set have completed.
    fn switch(&self, slots: &[Slot], extra: Option<Arc<Bitmap>>) {
        let mut set: Vec<Arc<Bitmap>> = slots
            .iter()
            .filter(|s| !s.frozen)
            .map(|s| s.bm.clone())
            .collect();
        set.extend(extra);
        *self.view.lock() = slots.to_vec();
        self.gate.publish(set);
    }

    /// A clean bitmap with a zeroed region in the sidecar (created first if need be), not
    /// overlapping the regions of the header or of `busy`.
    fn new_bitmap(
        &self,
        ctl: &mut Ctl,
        name: &str,
        shift: u32,
        busy: &[&Arc<Bitmap>],
    ) -> Result<Arc<Bitmap>, Error> {
        let Some(file) = ctl.file.clone() else {
            return Ok(Arc::new(Bitmap::new(name, self.capacity, shift, 0)?));
        };
        if ctl.header.is_none() {
            ctl.header = Some(file.create(ctl.ident, ctl.generation)?);
            if let Some((p, id)) = &ctl.image {
                identity::mark(p, id).map_err(|e| Error::Io {
                    path: p.clone(),
                    source: e,
                })?;
            }
        }
        let h = ctl.header.as_ref().expect("created above");
        let nbits = self.capacity.div_ceil(1 << shift);
        let pages = region_pages(nbits);
        let mut used = h.entries.clone();
        used.extend(busy.iter().map(|b| Entry {
            name: String::new(),
            shift: b.shift(),
            frozen: false,
            region: b.region(),
            pages: region_pages(b.nbits()),
        }));
        let region = alloc_region(&used, pages);
        let bm = Arc::new(Bitmap::new(name, self.capacity, shift, region)?);
        file.init_region(&bm)?;
        Ok(bm)
    }

    fn write_header(&self, ctl: &mut Ctl, slots: &[Slot]) -> Result<(), Error> {
        let (Some(file), Some(h)) = (ctl.file.clone(), ctl.header.as_mut()) else {
            return Ok(());
        };
        let mut next = Header {
            seq: 0,
            generation: h.generation,
            ident: h.ident,
            entries: slots
                .iter()
                .map(|s| Entry {
                    name: s.bm.name().to_string(),
                    shift: s.bm.shift(),
                    frozen: s.frozen,
                    region: s.bm.region(),
                    pages: region_pages(s.bm.nbits()),
                })
                .collect(),
        };
        file.write_header(&mut next)?;
        *h = next;
        Ok(())
    }
}

/// Dirty runs a merge reads from a source at a time.
const MERGE_RUNS: usize = 1024;

/// Where bitmap `name` is among `slots`.
fn position(slots: &[Slot], name: &str) -> Result<usize, Error> {
    slots
        .iter()
        .position(|s| s.bm.name() == name)
        .ok_or_else(|| Error::NotFound(name.to_string()))
}
