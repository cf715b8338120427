//! How an export's [`Bitmaps`] are opened: in memory, from a sidecar file (loaded, or reset
//! when refused), or from a mirror's copies of its sidecar (the newest taken, the others
//! replaced by it).

use std::path::PathBuf;

use blkq_sync::{Arc, DynArc, Mutex};

use crate::bits::Bitmap;
use crate::commit::Committer;
use crate::gate::Gate;
use crate::identity::{self, ImageId};
use crate::sidecar::{
    self, alloc_region, region_pages, Entry, FileSink, Header, Identity, Refusal, Sidecars,
};
use crate::sink::{NoSink, Sink};
use crate::Error;

use super::{Bitmaps, Ctl, Image, Options, Slot, Store};

impl Bitmaps {
    /// Opens the bitmaps of a device of `capacity` bytes; returns them and notes for the log
    /// (a reset said so).
    pub fn open(capacity: u64, opts: &Options) -> Result<(Self, Vec<String>), Error> {
        let mut notes = Vec::new();
        let (sink, ctl, slots): (DynArc<dyn Sink>, Ctl, Vec<Slot>) = match &opts.store {
            Store::Memory => (DynArc::new(NoSink), Ctl::memory(capacity), Vec::new()),
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
}

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
