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

use std::path::PathBuf;

use blkq_sync::{Arc, DynArc, Mutex};

use crate::bits::{check_granularity, Bitmap};
use crate::commit::{CommitStats, Committer, NoSink, Sink};
use crate::gate::{Gate, Mode};
use crate::identity::{self, ImageId};
use crate::sidecar::{
    self, alloc_region, region_pages, Entry, FileSink, Header, Identity, Refusal, Sidecars,
};
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
    /// refused, are replaced by it and said in the notes (see [`open_copies`]).
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
    /// Opens the bitmaps of a device of `capacity` bytes; returns them and notes for the log
    /// (a reset said so).
    pub fn open(capacity: u64, opts: &Options) -> Result<(Self, Vec<String>), Error> {
        let mut notes = Vec::new();
        let (sink, ctl, slots): (DynArc<dyn Sink>, Ctl, Vec<Slot>) = match &opts.store {
            Store::Memory => (
                DynArc::new(NoSink),
                Ctl {
                    header: None,
                    file: None,
                    image: None,
                    ident: Identity {
                        size: capacity,
                        uuid: [0; 16],
                    },
                    generation: 0,
                },
                Vec::new(),
            ),
            Store::Mirror {
                sidecars,
                others,
                ident,
                generations,
            } => {
                let (file, header, slots) = open_copies(
                    sidecars,
                    others,
                    *ident,
                    generations,
                    opts.reset,
                    &mut notes,
                )?;
                let sink: DynArc<dyn Sink> = file.clone();
                (
                    sink,
                    Ctl {
                        header,
                        file: Some(file),
                        image: None,
                        ident: *ident,
                        generation: generations.first().copied().unwrap_or(0),
                    },
                    slots,
                )
            }
            Store::File { path, image } => {
                let (id, image) = match image {
                    Image::File(p) => {
                        let id = identity::of_file(p, capacity).map_err(|e| Error::Io {
                            path: p.clone(),
                            source: e,
                        })?;
                        if !id.in_xattr {
                            notes.push(format!(
                                "{}: no extended attributes here; the sidecar {} is matched to \
                                 the image by device and inode numbers",
                                p.display(),
                                path.display()
                            ));
                        }
                        (id, Some((p.clone(), id)))
                    }
                    Image::Fixed(ident) => (
                        ImageId {
                            ident: *ident,
                            marked: false,
                            in_xattr: false,
                        },
                        None,
                    ),
                };
                let (file, header, slots) = open_file(path, id, capacity, opts.reset, &mut notes)?;
                let file = DynArc::new(Sidecars::new(vec![file], header.clone()));
                if header.is_some() {
                    if let Some((p, id)) = &image {
                        identity::mark(p, id).map_err(|e| Error::Io {
                            path: p.clone(),
                            source: e,
                        })?;
                    }
                }
                let sink: DynArc<dyn Sink> = file.clone();
                (
                    sink,
                    Ctl {
                        header,
                        file: Some(file),
                        image,
                        ident: id.ident,
                        generation: 0,
                    },
                    slots,
                )
            }
        };
        let recording: Vec<Arc<Bitmap>> = slots
            .iter()
            .filter(|s| !s.frozen)
            .map(|s| s.bm.clone())
            .collect();
        Ok((
            Self {
                capacity,
                gate: Gate::new(opts.mode, recording, Vec::new()),
                committer: Committer::new(sink),
                ctl: Mutex::new(ctl),
                view: Mutex::new(slots),
            },
            notes,
        ))
    }

    /// Bitmaps kept in memory whose pages go to `sink` as a sidecar's would (no header: what
    /// fault-injection tests and benchmarks of the persist path use).
    pub fn with_sink(capacity: u64, mode: Mode, sink: DynArc<dyn Sink>) -> Self {
        Self {
            capacity,
            gate: Gate::new(mode, Vec::new(), Vec::new()),
            committer: Committer::new(sink),
            ctl: Mutex::new(Ctl {
                header: None,
                file: None,
                image: None,
                ident: Identity {
                    size: capacity,
                    uuid: [0; 16],
                },
                generation: 0,
            }),
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

/// What [`open_file`] found: the sidecar, its header (`None`: not created yet), the bitmaps.
type Opened = (FileSink, Option<Header>, Vec<Slot>);

/// Opens (or prepares to create) the sidecar at `path`; see [`Bitmaps::open`].
fn open_file(
    path: &std::path::Path,
    id: ImageId,
    capacity: u64,
    reset: bool,
    notes: &mut Vec<String>,
) -> Result<Opened, Error> {
    let io = |e| Error::Io {
        path: path.to_path_buf(),
        source: e,
    };
    let f = match blk::files::open_owned(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            if id.marked {
                if !reset {
                    return Err(Error::Missing(path.to_path_buf()));
                }
                notes.push(format!(
                    "--bitmaps-reset: the bitmap sidecar {} is missing although the image had \
                     bitmaps: starting with none (every backup tool must take a full backup)",
                    path.display()
                ));
            }
            return Ok((FileSink::new(path.to_path_buf(), None), None, Vec::new()));
        }
        Err(e) => return Err(io(e)),
    };
    let file = FileSink::new(path.to_path_buf(), Some(f));
    match sidecar::load(&file, id.ident)? {
        Ok((h, words)) => {
            let slots = h
                .entries
                .iter()
                .zip(words)
                .map(|(e, ws)| {
                    let bm = Bitmap::new(&e.name, capacity, e.shift, e.region)?;
                    for (w, v) in ws.into_iter().enumerate() {
                        bm.load_word(w, v);
                    }
                    Ok(Slot {
                        bm: Arc::new(bm),
                        frozen: e.frozen,
                    })
                })
                .collect::<Result<_, Error>>()?;
            Ok((file, Some(h), slots))
        }
        Err((refusal, known)) => {
            let (err, why) = match refusal {
                Refusal::Torn(w) => (Error::Torn(path.to_path_buf(), w.clone()), w),
                Refusal::Foreign(w) => (Error::Foreign(path.to_path_buf(), w.clone()), w),
            };
            if !reset {
                return Err(err);
            }
            let mut h = file.create(id.ident, 0)?;
            let mut slots = Vec::new();
            let mut entries: Vec<Entry> = Vec::new();
            for e in known.map(|k| k.entries).unwrap_or_default() {
                let nbits = capacity.div_ceil(1 << e.shift.clamp(12, 26));
                let pages = region_pages(nbits);
                let region = alloc_region(&entries, pages);
                let bm = Bitmap::new(&e.name, capacity, e.shift.clamp(12, 26), region)?;
                bm.set_all();
                file.init_region(&bm)?;
                for w in 0..bm.nwords() {
                    bm.set_durable(w, bm.dirty_word(w));
                }
                entries.push(Entry {
                    region,
                    pages,
                    shift: bm.shift(),
                    ..e
                });
                slots.push(Slot {
                    bm: Arc::new(bm),
                    frozen: entries.last().is_some_and(|e| e.frozen),
                });
            }
            h.seq += 1;
            h.entries = entries;
            file.write_header(&h)?;
            let names: Vec<&str> = slots.iter().map(|s| s.bm.name()).collect();
            notes.push(format!(
                "--bitmaps-reset: the bitmap sidecar {} was refused ({why}); replaced with \
                 every bit dirty in bitmaps {names:?}: the next backup from each is a full one",
                path.display()
            ));
            Ok((file, Some(h), slots))
        }
    }
}

/// What [`open_copies`] found: the copies kept, their header (`None`: not created yet), the
/// bitmaps.
type OpenedCopies = (DynArc<Sidecars>, Option<Header>, Vec<Slot>);

/// One copy of a mirror's sidecar read at start.
struct Copy {
    path: PathBuf,
    header: Header,
    words: Vec<Vec<u64>>,
}

/// Opens the copies of a mirror's sidecar at `paths`, reading those at `others` too (see
/// [`Store::Mirror`]).
///
/// Every copy that exists is read and checked against the array (`ident`). Of those that
/// pass, the newest is taken: a generation of the array's (`generations`) before one it does
/// not know (a copy from a history that went apart from the array's), then the highest `seq`
/// (every copy kept up to date has the same; one the array went on without is behind), then
/// the newer generation. Copies equal to it (same `seq`, generation and bitmaps) are merged
/// into it, bit by bit: they may differ only by pages written for writes that had not gone
/// down yet (a crash between two copies' syncs), and the union is a superset of every one.
/// Every other copy (stale, torn, of another array) is refused, named in the notes, and like
/// every missing one replaced by the one taken, with the next `seq` and the array's current
/// generation, before anything is served. A torn or foreign copy with no good one beside it
/// stops the start as a plain sidecar would (or, with `reset`, all copies start over with
/// every bit dirty).
fn open_copies(
    paths: &[PathBuf],
    others: &[PathBuf],
    ident: Identity,
    generations: &[u64],
    reset: bool,
    notes: &mut Vec<String>,
) -> Result<OpenedCopies, Error> {
    let capacity = ident.size;
    let (good, mut refused) = read_copies(paths, others, ident)?;
    let best = good
        .iter()
        .enumerate()
        .max_by(|(i, a), (j, b)| {
            rank(generations, a)
                .cmp(&rank(generations, b))
                .then(j.cmp(i))
        })
        .map(|(i, _)| i);
    let (entries, slots) = match best {
        Some(b) => {
            let (entries, slots) = take_best(&good, b, &refused, generations, capacity, notes)?;
            (Some(entries), slots)
        }
        None if refused.is_empty() => (None, Vec::new()),
        None => {
            if !reset {
                return Err(refused.swap_remove(0).2);
            }
            let (entries, slots) = reset_refused(&refused, capacity, notes)?;
            (Some(entries), slots)
        }
    };
    drop(good);
    let current = generations.first().copied().unwrap_or(0);
    write_copies(paths, entries, ident, current, slots, notes)
}

/// The bitmaps [`open_copies`] takes: the `seq` to follow and the entries of the copy
/// taken, and the bitmaps.
type Taken = ((u64, Vec<Entry>), Vec<Slot>);

/// A copy of a mirror's sidecar refused at start: its path, why, the error a start without
/// a good copy gives, and the newest valid header it has.
type Refused = (PathBuf, String, Error, Option<Header>);

/// Reads every copy of a mirror's sidecar that exists among `paths` and `others` (each path
/// once): those that pass the checks against the array (`ident`), and those refused.
fn read_copies(
    paths: &[PathBuf],
    others: &[PathBuf],
    ident: Identity,
) -> Result<(Vec<Copy>, Vec<Refused>), Error> {
    let mut good: Vec<Copy> = Vec::new();
    let mut refused: Vec<Refused> = Vec::new();
    let mut all: Vec<&PathBuf> = paths.iter().chain(others).collect();
    all.sort();
    all.dedup();
    for path in all {
        let f = match blk::files::open_owned(path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => {
                return Err(Error::Io {
                    path: path.clone(),
                    source: e,
                })
            }
        };
        let sink = FileSink::new(path.clone(), Some(f));
        match sidecar::load(&sink, ident)? {
            Ok((header, words)) => good.push(Copy {
                path: path.clone(),
                header,
                words,
            }),
            Err((Refusal::Torn(w), h)) => refused.push((
                path.clone(),
                format!("is torn: {w}"),
                Error::Torn(path.clone(), w),
                h,
            )),
            Err((Refusal::Foreign(w), h)) => refused.push((
                path.clone(),
                format!("belongs to another array: {w}"),
                Error::Foreign(path.clone(), w),
                h,
            )),
        }
    }
    Ok((good, refused))
}

/// How recent generation `g` is among the array's (`generations`, the current one first): 0
/// the current one; `None` when unknown.
fn age(generations: &[u64], g: u64) -> Option<usize> {
    generations
        .iter()
        .position(|&x| x == g)
        .or((g == 0).then_some(generations.len()))
}

/// How a copy ranks (highest wins): a generation of the array's before one it does not know,
/// then the highest `seq`, then the newer generation.
fn rank(generations: &[u64], c: &Copy) -> (bool, u64, std::cmp::Reverse<Option<usize>>) {
    let a = age(generations, c.header.generation);
    (a.is_some(), c.header.seq, std::cmp::Reverse(a))
}

/// The bitmaps of the copy taken (`good[b]`), merged with the copies equal to it; every
/// other copy, and every refused one, is named in the notes. Returns the taken copy's `seq`
/// and entries, and the bitmaps.
fn take_best(
    good: &[Copy],
    b: usize,
    refused: &[Refused],
    generations: &[u64],
    capacity: u64,
    notes: &mut Vec<String>,
) -> Result<Taken, Error> {
    let best = &good[b];
    let k = rank(generations, best);
    if !k.0 {
        notes.push(format!(
            "dirty bitmap sidecar {}: generation {:016x} is not one of the array's \
             (a history that went apart from it); used, as no copy of the array's own \
             is left",
            best.path.display(),
            best.header.generation
        ));
    }
    let slots: Vec<Slot> = best
        .header
        .entries
        .iter()
        .map(|e| {
            Ok(Slot {
                bm: Arc::new(Bitmap::new(&e.name, capacity, e.shift, e.region)?),
                frozen: e.frozen,
            })
        })
        .collect::<Result<_, Error>>()?;
    for c in good {
        let same = rank(generations, c) == k && c.header.entries == best.header.entries;
        if same {
            for (s, ws) in slots.iter().zip(&c.words) {
                for (w, &v) in ws.iter().enumerate() {
                    s.bm.load_word(w, v);
                }
            }
        } else {
            let what = if age(generations, c.header.generation).is_none() {
                "is from a history the array does not share (the other side of a split)"
            } else {
                "is stale (the array went on without it)"
            };
            notes.push(format!(
                "dirty bitmap sidecar {} {what}: seq {}, generation {:016x}, where {} \
                 has seq {}, generation {:016x}: refused, the bitmaps are taken from \
                 the latter",
                c.path.display(),
                c.header.seq,
                c.header.generation,
                best.path.display(),
                best.header.seq,
                best.header.generation
            ));
        }
    }
    for (p, why, _, _) in refused {
        notes.push(format!(
            "dirty bitmap sidecar {} {why}: refused, the bitmaps are taken from {}",
            p.display(),
            best.path.display()
        ));
    }
    Ok(((best.header.seq, best.header.entries.clone()), slots))
}

/// With `--bitmaps-reset` and no good copy: the bitmaps of the newest refused copy's header
/// start over with every bit dirty, each refused copy named in the notes. Returns the `seq`
/// to follow and the entries, and the bitmaps.
fn reset_refused(
    refused: &[Refused],
    capacity: u64,
    notes: &mut Vec<String>,
) -> Result<Taken, Error> {
    let newest = refused
        .iter()
        .filter_map(|(_, _, _, h)| h.as_ref())
        .max_by_key(|h| h.seq)
        .cloned();
    let (entries, slots) = all_dirty(newest.as_ref(), capacity)?;
    let names: Vec<&str> = slots.iter().map(|s| s.bm.name()).collect();
    for (p, why, _, _) in refused {
        notes.push(format!(
            "--bitmaps-reset: the bitmap sidecar {} {why}; replaced with every bit \
             dirty in bitmaps {names:?}: the next backup from each is a full one",
            p.display()
        ));
    }
    Ok(((newest.map_or(0, |h| h.seq), entries), slots))
}

/// Writes the bitmaps taken to every copy at `paths`, with the next `seq` after the one
/// taken and the array's `current` generation (with no copy anywhere, `entries` is `None`:
/// nothing is written, the sidecar is created with the first bitmap). A copy that cannot be
/// written is named in the notes and not kept; none written is an error.
fn write_copies(
    paths: &[PathBuf],
    entries: Option<(u64, Vec<Entry>)>,
    ident: Identity,
    current: u64,
    slots: Vec<Slot>,
    notes: &mut Vec<String>,
) -> Result<OpenedCopies, Error> {
    let sinks: Vec<FileSink> = paths
        .iter()
        .map(|p| FileSink::new(p.clone(), None))
        .collect();
    let Some((seq, entries)) = entries else {
        // No copy anywhere: created with the first bitmap.
        return Ok((DynArc::new(Sidecars::new(sinks, None)), None, slots));
    };
    let header = Header {
        seq: seq + 1,
        generation: current,
        ident,
        entries,
    };
    let bms: Vec<&Bitmap> = slots.iter().map(|s| &*s.bm).collect();
    let mut written = 0;
    let mut first_err = None;
    for s in &sinks {
        match s.write_whole(&header, &bms) {
            Ok(()) => written += 1,
            Err(e) => {
                notes.push(format!(
                    "dirty bitmap sidecar {}: {e}: this copy is not kept",
                    s.path().display()
                ));
                first_err.get_or_insert(Error::Io {
                    path: s.path().to_path_buf(),
                    source: e,
                });
            }
        }
    }
    if written == 0 {
        if let Some(e) = first_err {
            return Err(e);
        }
    }
    let sinks: Vec<FileSink> = sinks.into_iter().filter(|s| s.is_open()).collect();
    Ok((
        DynArc::new(Sidecars::new(sinks, Some(header.clone()))),
        Some(header),
        slots,
    ))
}

/// Bitmaps named as in `known` (its granularities and frozen flags), regions laid out afresh,
/// every bit dirty and, once the caller has written them, durable: what a reset starts from.
fn all_dirty(known: Option<&Header>, capacity: u64) -> Result<(Vec<Entry>, Vec<Slot>), Error> {
    let mut slots = Vec::new();
    let mut entries: Vec<Entry> = Vec::new();
    for e in known.map(|k| k.entries.clone()).unwrap_or_default() {
        let shift = e.shift.clamp(12, 26);
        let pages = region_pages(capacity.div_ceil(1 << shift));
        let region = alloc_region(&entries, pages);
        let bm = Bitmap::new(&e.name, capacity, shift, region)?;
        bm.set_all();
        for w in 0..bm.nwords() {
            bm.set_durable(w, bm.dirty_word(w));
        }
        slots.push(Slot {
            bm: Arc::new(bm),
            frozen: e.frozen,
        });
        entries.push(Entry {
            region,
            pages,
            shift,
            ..e
        });
    }
    Ok((entries, slots))
}

/// Where bitmap `name` is among `slots`.
fn position(slots: &[Slot], name: &str) -> Result<usize, Error> {
    slots
        .iter()
        .position(|s| s.bm.name() == name)
        .ok_or_else(|| Error::NotFound(name.to_string()))
}
