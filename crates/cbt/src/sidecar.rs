//! The sidecar: where an export's dirty bitmaps live on disk, and its format.
//!
//! # Format (little endian, 4 KiB pages)
//!
//! - **Pages 0 and 1: two copies of the header** (double-buffered: an update writes the copy
//!   not holding the newest header, then syncs; a torn update leaves the other copy, which
//!   describes the state before the operation that was cut off). A copy is valid when its
//!   magic, version and checksum are; the valid copy with the highest `seq` is the header.
//!
//!   | bytes | field |
//!   |---|---|
//!   | 0..8 | magic `BLKQCBT1` |
//!   | 8..12 | version (1) |
//!   | 16..24 | `seq`, one more at every header update |
//!   | 24..32 | the image's size in bytes |
//!   | 32..48 | the image's UUID (see `identity.rs`) |
//!   | 48..52 | number of bitmaps (at most [`MAX_BITMAPS`]) |
//!   | 56..64 | a mirror's generation when this copy was last brought up to date (0: not a mirror's, or written before generations were recorded; see [`Sidecars`]) |
//!   | 64.. | one 128-byte entry per bitmap, in creation order |
//!   | 4092..4096 | crc32c of bytes 0..4092 |
//!
//!   An entry: byte 0 the name's length (1..=[`MAX_NAME`]), bytes 1..96 the name (UTF-8),
//!   byte 96 log2 of the granularity, byte 97 flags (bit 0: frozen by `rotate`), bytes
//!   104..112 the first page of its region, 112..120 the region's length in pages.
//!
//! - **Regions**: each bitmap's bits, in pages of [`WORDS_PER_PAGE`] 64-bit words (bytes
//!   0..4088, bit `i` of the bitmap in word `i / 64`, bit `i % 64`), then the page's number in
//!   the file (u32, 4088..4092) and a crc32c of bytes 0..4092 (4092..4096). A page is written
//!   whole by one `pwrite`; a torn page fails its checksum, and a page written to the wrong
//!   place fails its number. A region is written whole (zeros, or all ones for a reset) and
//!   synced before a header names it, and is reused only once no header names it and no write
//!   can still be persisting into it.
//!
//! Cost: `ceil(bits / 32704)` pages per bitmap, so 1 TiB at 64 KiB is 2 MiB of sidecar
//! (and 2 MiB of memory for `dirty` plus 2 MiB for `durable`).

use std::fs::File;
use std::io::ErrorKind;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use blkq_sync::Mutex;

use crate::bits::Bitmap;
use crate::sink::Sink;
use crate::Error;

/// Page size of the sidecar.
pub const PAGE: usize = 4096;
/// 64-bit words of bits per page.
pub const WORDS_PER_PAGE: usize = 511;
/// Bits per page.
pub const BITS_PER_PAGE: u64 = WORDS_PER_PAGE as u64 * 64;
/// The header's magic.
pub const MAGIC: [u8; 8] = *b"BLKQCBT1";
/// Format version.
pub const VERSION: u32 = 1;
/// Most bitmaps per export.
pub const MAX_BITMAPS: usize = 31;
/// Longest name, bytes.
pub const MAX_NAME: usize = 95;
const ENTRIES_AT: usize = 64;
const ENTRY: usize = 128;
/// First page of the regions.
pub const FIRST_REGION_PAGE: u64 = 2;

/// Which image a sidecar belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Identity {
    /// Size in bytes.
    pub size: u64,
    /// A UUID the image carries (see `identity.rs`).
    pub uuid: [u8; 16],
}

/// One bitmap as the header records it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// Name.
    pub name: String,
    /// log2 of the granularity.
    pub shift: u32,
    /// Frozen by `rotate` (no longer recording).
    pub frozen: bool,
    /// First page of its region.
    pub region: u64,
    /// Pages of its region.
    pub pages: u64,
}

/// A decoded header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    /// Update counter.
    pub seq: u64,
    /// The mirror's generation when this copy was last brought up to date (0: none).
    pub generation: u64,
    /// The image it belongs to.
    pub ident: Identity,
    /// The bitmaps.
    pub entries: Vec<Entry>,
}

/// Pages of the region of a bitmap with `nbits` bits.
pub fn region_pages(nbits: u64) -> u64 {
    nbits.div_ceil(BITS_PER_PAGE).max(1)
}

/// Bytes of sidecar for bitmaps over `capacity` bytes at `1 << shift` bytes per bit.
pub fn sidecar_bytes(capacity: u64, shifts: &[u32]) -> u64 {
    let regions: u64 = shifts
        .iter()
        .map(|s| region_pages(capacity.div_ceil(1 << s)))
        .sum();
    (FIRST_REGION_PAGE + regions) * PAGE as u64
}

fn crc_put(page: &mut [u8]) {
    let c = crc32c::crc32c(&page[..PAGE - 4]);
    page[PAGE - 4..PAGE].copy_from_slice(&c.to_le_bytes());
}

fn crc_ok(page: &[u8]) -> bool {
    page.len() == PAGE && crc32c::crc32c(&page[..PAGE - 4]).to_le_bytes() == page[PAGE - 4..PAGE]
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

/// Encodes a header page.
pub fn encode_header(h: &Header) -> Vec<u8> {
    let mut b = vec![0u8; PAGE];
    b[0..8].copy_from_slice(&MAGIC);
    b[8..12].copy_from_slice(&VERSION.to_le_bytes());
    b[16..24].copy_from_slice(&h.seq.to_le_bytes());
    b[24..32].copy_from_slice(&h.ident.size.to_le_bytes());
    b[32..48].copy_from_slice(&h.ident.uuid);
    b[48..52].copy_from_slice(&(h.entries.len() as u32).to_le_bytes());
    b[56..64].copy_from_slice(&h.generation.to_le_bytes());
    for (i, e) in h.entries.iter().enumerate() {
        let at = ENTRIES_AT + i * ENTRY;
        let name = e.name.as_bytes();
        b[at] = name.len() as u8;
        b[at + 1..at + 1 + name.len()].copy_from_slice(name);
        b[at + 96] = e.shift as u8;
        b[at + 97] = u8::from(e.frozen);
        b[at + 104..at + 112].copy_from_slice(&e.region.to_le_bytes());
        b[at + 112..at + 120].copy_from_slice(&e.pages.to_le_bytes());
    }
    crc_put(&mut b);
    b
}

/// Decodes a header page; `Err` says what is wrong with it.
pub fn decode_header(b: &[u8]) -> Result<Header, &'static str> {
    if b.len() < PAGE {
        return Err("short header");
    }
    if b[0..8] != MAGIC {
        return Err("bad magic");
    }
    if !crc_ok(&b[..PAGE]) {
        return Err("header checksum mismatch");
    }
    if u32::from_le_bytes([b[8], b[9], b[10], b[11]]) != VERSION {
        return Err("unknown version");
    }
    let n = u32::from_le_bytes([b[48], b[49], b[50], b[51]]) as usize;
    if n > MAX_BITMAPS {
        return Err("too many bitmaps");
    }
    let mut uuid = [0u8; 16];
    uuid.copy_from_slice(&b[32..48]);
    let mut entries = Vec::with_capacity(n);
    for i in 0..n {
        let at = ENTRIES_AT + i * ENTRY;
        let len = b[at] as usize;
        if len == 0 || len > MAX_NAME {
            return Err("bad name length");
        }
        let name = std::str::from_utf8(&b[at + 1..at + 1 + len]).map_err(|_| "name not UTF-8")?;
        entries.push(Entry {
            name: name.to_string(),
            shift: u32::from(b[at + 96]),
            frozen: b[at + 97] & 1 != 0,
            region: u64_at(b, at + 104),
            pages: u64_at(b, at + 112),
        });
    }
    Ok(Header {
        seq: u64_at(b, 16),
        generation: u64_at(b, 56),
        ident: Identity {
            size: u64_at(b, 24),
            uuid,
        },
        entries,
    })
}

/// Encodes page `p` of `bm`'s region (a snapshot of its dirty words) into `out` (one page).
pub fn encode_page(bm: &Bitmap, p: u64, out: &mut [u8]) {
    let first = p as usize * WORDS_PER_PAGE;
    for j in 0..WORDS_PER_PAGE {
        let v = if first + j < bm.nwords() {
            bm.dirty_word(first + j)
        } else {
            0
        };
        out[j * 8..j * 8 + 8].copy_from_slice(&v.to_le_bytes());
    }
    let no = (bm.region() + p) as u32;
    out[WORDS_PER_PAGE * 8..WORDS_PER_PAGE * 8 + 4].copy_from_slice(&no.to_le_bytes());
    crc_put(out);
}

/// The words of an encoded page.
pub fn decode_words(page: &[u8]) -> impl Iterator<Item = u64> + '_ {
    (0..WORDS_PER_PAGE).map(move |j| u64_at(page, j * 8))
}

/// Checks a region page read back from file page `no`.
pub fn check_page(page: &[u8], no: u64) -> bool {
    crc_ok(page)
        && u32::from_le_bytes([page[4088], page[4089], page[4090], page[4091]]) == no as u32
}

/// An empty vector with room for `n` elements, allocated fallibly: `OutOfMemory`, naming the
/// bytes, when they cannot be had.
fn try_with_capacity<T>(n: u64) -> std::io::Result<Vec<T>> {
    let bytes = n.saturating_mul(std::mem::size_of::<T>() as u64);
    let no = || {
        std::io::Error::new(
            ErrorKind::OutOfMemory,
            format!("{bytes} bytes of memory cannot be allocated"),
        )
    };
    let n = usize::try_from(n).map_err(|_| no())?;
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| no())?;
    Ok(v)
}

/// The sidecar file as a [`Sink`]; the file is created on the first bitmap (`None` before).
pub struct FileSink {
    path: PathBuf,
    file: Mutex<Option<File>>,
}

impl FileSink {
    /// A sink for the sidecar at `path` (opened later, or now with `file`).
    pub fn new(path: PathBuf, file: Option<File>) -> Self {
        Self {
            path,
            file: Mutex::new(file),
        }
    }
    /// The sidecar's path.
    pub fn path(&self) -> &Path {
        &self.path
    }
    /// Whether the file exists (was created or opened).
    pub fn is_open(&self) -> bool {
        self.file.lock().is_some()
    }
    fn io(&self, e: std::io::Error) -> Error {
        Error::Io {
            path: self.path.clone(),
            source: e,
        }
    }

    /// Creates an empty sidecar (a header with no bitmap) for `ident`, replacing any file
    /// there: written beside it, synced, renamed over it, the directory synced.
    pub fn create(&self, ident: Identity, generation: u64) -> Result<Header, Error> {
        let h = Header {
            seq: 1,
            generation,
            ident,
            entries: Vec::new(),
        };
        self.write_whole(&h, &[]).map_err(|e| self.io(e))?;
        Ok(h)
    }

    /// Replaces the file with one holding header `h` (in the copy `h.seq` chooses) and the
    /// regions of `bitmaps` (their current bits, each at its region): written beside it under
    /// an unpredictable name created `O_EXCL|O_NOFOLLOW`, synced, renamed over it, the
    /// directory synced ([`blk::files::replace`]); then open here.
    pub fn write_whole(&self, h: &Header, bitmaps: &[&Bitmap]) -> std::io::Result<()> {
        // Never through a name another user could have planted (see `blk::files`).
        let f = blk::files::replace(&self.path, 0o644, |f| {
            let mut b = vec![0u8; 2 * PAGE];
            let at = (h.seq & 1) as usize * PAGE;
            b[at..at + PAGE].copy_from_slice(&encode_header(h));
            f.write_all_at(&b, 0)?;
            let mut page = vec![0u8; PAGE];
            for bm in bitmaps {
                for p in 0..region_pages(bm.nbits()) {
                    encode_page(bm, p, &mut page);
                    f.write_all_at(&page, (bm.region() + p) * PAGE as u64)?;
                }
            }
            Ok(())
        })?;
        *self.file.lock() = Some(f);
        Ok(())
    }

    /// Writes `h` into the header copy that does not hold the newest one (`h.seq` chooses),
    /// and syncs.
    pub fn write_header(&self, h: &Header) -> Result<(), Error> {
        let page = encode_header(h);
        self.write_pages(h.seq & 1, &page)
            .and_then(|()| self.sync())
            .map_err(|e| self.io(e))
    }

    /// Writes whole region pages of `bm` (its current bits) and syncs: a region is ready
    /// before a header names it.
    pub fn init_region(&self, bm: &Bitmap) -> Result<(), Error> {
        self.init_region_io(bm).map_err(|e| self.io(e))
    }

    fn init_region_io(&self, bm: &Bitmap) -> std::io::Result<()> {
        let pages = region_pages(bm.nbits());
        let mut buf = vec![0u8; PAGE * 64];
        let mut p = 0;
        while p < pages {
            let n = (pages - p).min(64);
            for i in 0..n {
                encode_page(
                    bm,
                    p + i,
                    &mut buf[i as usize * PAGE..(i as usize + 1) * PAGE],
                );
            }
            self.write_pages(bm.region() + p, &buf[..n as usize * PAGE])?;
            p += n;
        }
        self.sync()
    }

    /// Reads page range `[page, page + n)`.
    /// The buffer is allocated fallibly (`OutOfMemory`, naming the bytes: a region named by
    /// a sidecar may be larger than this machine's memory).
    pub fn read_pages(&self, page: u64, n: u64) -> std::io::Result<Vec<u8>> {
        let len = n.saturating_mul(PAGE as u64);
        let mut b = try_with_capacity::<u8>(len)?;
        b.resize(len as usize, 0);
        let g = self.file.lock();
        let f = g.as_ref().ok_or(ErrorKind::NotFound)?;
        f.read_exact_at(&mut b, page * PAGE as u64)?;
        Ok(b)
    }
}

impl Sink for FileSink {
    fn write_pages(&self, page: u64, data: &[u8]) -> std::io::Result<()> {
        let g = self.file.lock();
        let f = g.as_ref().ok_or(ErrorKind::NotFound)?;
        f.write_all_at(data, page * PAGE as u64)
    }
    fn sync(&self) -> std::io::Result<()> {
        // The file is cloned out of the lock so that a long fdatasync holds no lock.
        let f = {
            let g = self.file.lock();
            g.as_ref().ok_or(ErrorKind::NotFound)?.try_clone()?
        };
        f.sync_data()
    }
    fn describe(&self) -> String {
        self.path.display().to_string()
    }
}

/// The copies of an export's sidecar that are kept up to date: one for a plain export, one
/// beside each file leg of a mirror (whose bitmaps belong to the array, not to one leg). Every
/// page and header goes to every copy and is synced there before the write it covers goes
/// down, so each copy is a superset of the changes, as one sidecar is.
///
/// A copy that fails (its leg's disk died) is dropped, said in the log, while another copy
/// took the same pages: the writes go on with the rest. The survivors' header is then written
/// again with the next `seq`, so the dropped copy, which lacks what comes next, is older than
/// they are and is refused as stale at the next start. When every copy fails, the error is
/// returned (and the write it was for fails, as with one sidecar).
pub struct Sidecars {
    members: Vec<Member>,
    /// The header every live copy holds (`None`: not created yet). Serializes header writes.
    last: Mutex<Option<Header>>,
}

struct Member {
    sink: FileSink,
    /// Cleared once the copy failed: no longer written. Release on clearing, Acquire on
    /// reading: it publishes no data (each copy's bytes are written and synced by the caller
    /// that writes them), so the pair only makes a writer that sees it cleared skip the copy
    /// from then on; a writer that still read it set writes to a copy already given up, and
    /// that copy is refused as stale at the next start whatever it holds.
    alive: blkq_sync::atomic::AtomicBool,
}

impl Sidecars {
    /// The copies in `sinks` (open, or created later by [`Sidecars::create`]), holding
    /// `header` (`None`: not created yet).
    pub fn new(sinks: Vec<FileSink>, header: Option<Header>) -> Self {
        Self {
            members: sinks
                .into_iter()
                .map(|sink| Member {
                    sink,
                    alive: blkq_sync::atomic::AtomicBool::new(true),
                })
                .collect(),
            last: Mutex::new(header),
        }
    }

    fn alive(&self) -> impl Iterator<Item = &Member> {
        self.members
            .iter()
            .filter(|m| m.alive.load(blkq_sync::atomic::Ordering::Acquire))
    }

    /// The paths of the copies still written.
    pub fn paths(&self) -> Vec<PathBuf> {
        self.alive().map(|m| m.sink.path().to_path_buf()).collect()
    }

    /// Runs `f` on every live copy. A copy that fails is dropped when another one succeeded
    /// (true is returned: the caller bumps the survivors' header, unless it wrote one); when
    /// none succeeded, the first error, naming its copy.
    fn each(&self, f: impl Fn(&FileSink) -> std::io::Result<()>) -> Result<bool, Error> {
        let mut failed: Vec<(&Member, std::io::Error)> = Vec::new();
        let mut ok = 0;
        for m in self.alive() {
            match f(&m.sink) {
                Ok(()) => ok += 1,
                Err(e) => failed.push((m, e)),
            }
        }
        if failed.is_empty() {
            return Ok(false);
        }
        if ok == 0 {
            let (m, e) = failed.swap_remove(0);
            return Err(m.sink.io(e));
        }
        for (m, e) in failed {
            m.alive.store(false, blkq_sync::atomic::Ordering::Release);
            tracing::warn!(
                "dirty bitmap sidecar {}: {e}: this copy is no longer written and will be \
                 refused as stale at the next start; the bitmaps go on in {:?}",
                m.sink.path().display(),
                self.paths()
            );
        }
        Ok(true)
    }

    /// Writes the header again with the next `seq` to every live copy (after a copy was
    /// dropped: it is then older than they are).
    fn bump(&self) -> Result<(), Error> {
        let mut last = self.last.lock();
        let Some(h) = last.as_mut() else {
            return Ok(());
        };
        let mut next = h.clone();
        loop {
            next.seq += 1;
            let page = encode_header(&next);
            let seq = next.seq;
            // A copy failing here is dropped too: the survivors get one more.
            let dropped = self.each(|m| {
                m.write_pages(seq & 1, &page)?;
                m.sync()
            })?;
            *h = next.clone();
            if !dropped {
                return Ok(());
            }
        }
    }

    /// Creates every copy empty (a header with no bitmap) for `ident` and `generation`.
    pub fn create(&self, ident: Identity, generation: u64) -> Result<Header, Error> {
        let mut last = self.last.lock();
        let h = Header {
            seq: 1,
            generation,
            ident,
            entries: Vec::new(),
        };
        let dropped = self.each(|m| m.write_whole(&h, &[]))?;
        *last = Some(h.clone());
        drop(last);
        if dropped {
            self.bump()?;
        }
        Ok(h)
    }

    /// Writes `h` to every copy, its `seq` set to the next one (see [`FileSink::write_header`]).
    pub fn write_header(&self, h: &mut Header) -> Result<(), Error> {
        let mut last = self.last.lock();
        h.seq = last.as_ref().map_or(1, |l| l.seq + 1);
        let page = encode_header(h);
        let dropped = self.each(|m| {
            m.write_pages(h.seq & 1, &page)?;
            m.sync()
        })?;
        *last = Some(h.clone());
        drop(last);
        // A copy dropped here may hold this header without its sync: one more puts the
        // survivors past it.
        if dropped {
            self.bump()?;
        }
        Ok(())
    }

    /// Writes the region of `bm` to every copy ([`FileSink::init_region`]).
    pub fn init_region(&self, bm: &Bitmap) -> Result<(), Error> {
        if self.each(|m| m.init_region_io(bm))? {
            self.bump()?;
        }
        Ok(())
    }
}

impl Sink for Sidecars {
    fn write_pages(&self, page: u64, data: &[u8]) -> std::io::Result<()> {
        match self.each(|m| m.write_pages(page, data)) {
            Ok(false) => Ok(()),
            Ok(true) => self.bump().map_err(std::io::Error::other),
            Err(e) => Err(std::io::Error::other(e)),
        }
    }
    fn sync(&self) -> std::io::Result<()> {
        match self.each(|m| m.sync()) {
            Ok(false) => Ok(()),
            Ok(true) => self.bump().map_err(std::io::Error::other),
            Err(e) => Err(std::io::Error::other(e)),
        }
    }
    fn describe(&self) -> String {
        let p: Vec<String> = self
            .alive()
            .map(|m| m.sink.path().display().to_string())
            .collect();
        p.join(", ")
    }
}

/// Why an existing sidecar cannot be used as it is.
#[derive(Debug)]
pub enum Refusal {
    /// No valid header, or a torn page: what is wrong.
    Torn(String),
    /// The header describes another image.
    Foreign(String),
}

/// A sidecar read back: its header and each bitmap's words, or why it is refused (with the
/// newest valid header, if any, so a reset keeps the bitmaps' names).
pub type Loaded = Result<(Header, Vec<Vec<u64>>), (Refusal, Option<Header>)>;

/// Reads and checks the sidecar open in `sink` against `ident` (the image's identity now).
pub fn load(sink: &FileSink, ident: Identity) -> Result<Loaded, Error> {
    let io = |e| sink.io(e);
    let heads = match sink.read_pages(0, 2) {
        Ok(b) => b,
        Err(e) if e.kind() == ErrorKind::UnexpectedEof => {
            return Ok(Err((Refusal::Torn("shorter than its header".into()), None)))
        }
        Err(e) => return Err(io(e)),
    };
    let best = [decode_header(&heads[..PAGE]), decode_header(&heads[PAGE..])]
        .into_iter()
        .filter_map(Result::ok)
        .max_by_key(|h| h.seq);
    let Some(h) = best else {
        let why = decode_header(&heads[PAGE..])
            .err()
            .unwrap_or("no valid header");
        return Ok(Err((
            Refusal::Torn(format!("no valid header ({why})")),
            None,
        )));
    };
    if h.ident.size != ident.size {
        let why = format!(
            "made for an image of {} bytes, this one has {}",
            h.ident.size, ident.size
        );
        return Ok(Err((Refusal::Foreign(why), Some(h))));
    }
    if h.ident.uuid != ident.uuid {
        let why = format!(
            "made for image {}, this one is {}",
            uuid::Uuid::from_bytes(h.ident.uuid),
            uuid::Uuid::from_bytes(ident.uuid)
        );
        return Ok(Err((Refusal::Foreign(why), Some(h))));
    }
    let mut all = Vec::with_capacity(h.entries.len());
    for e in &h.entries {
        let bad = |what: String| Ok(Err((Refusal::Torn(what), Some(h.clone()))));
        let nbits = ident.size.div_ceil(1u64 << e.shift);
        if e.shift < 12 || e.shift > 26 || e.pages != region_pages(nbits) {
            return bad(format!("bitmap {:?}: bad geometry", e.name));
        }
        let in_bitmap = |err: std::io::Error| {
            io(std::io::Error::new(
                err.kind(),
                format!("dirty bitmap {:?}: {err}", e.name),
            ))
        };
        let b = match sink.read_pages(e.region, e.pages) {
            Ok(b) => b,
            Err(err) if err.kind() == ErrorKind::UnexpectedEof => {
                return bad(format!("bitmap {:?}: region cut short", e.name))
            }
            Err(err) => return Err(in_bitmap(err)),
        };
        // Room for every word of every page (the last page's tail is cut below).
        let mut words = try_with_capacity::<u64>(e.pages.saturating_mul(WORDS_PER_PAGE as u64))
            .map_err(in_bitmap)?;
        let nwords = nbits.div_ceil(64) as usize;
        for (i, page) in b.chunks(PAGE).enumerate() {
            if !check_page(page, e.region + i as u64) {
                return bad(format!(
                    "bitmap {:?}: page {} fails its checksum (a torn write)",
                    e.name,
                    e.region + i as u64
                ));
            }
            words.extend(decode_words(page));
        }
        words.truncate(nwords);
        all.push(words);
    }
    Ok(Ok((h, all)))
}

/// The first page where a region of `pages` fits between the regions of `entries`.
pub fn alloc_region(entries: &[Entry], pages: u64) -> u64 {
    let mut used: Vec<(u64, u64)> = entries.iter().map(|e| (e.region, e.pages)).collect();
    used.sort_unstable();
    let mut at = FIRST_REGION_PAGE;
    for (r, n) in used {
        if r >= at + pages {
            break;
        }
        at = at.max(r + n);
    }
    at
}

#[cfg(all(test, not(blkq_loom)))]
mod tests {
    use super::*;

    fn header() -> Header {
        Header {
            seq: 7,
            generation: 0x1234_5678_9abc_def1,
            ident: Identity {
                size: 1 << 30,
                uuid: [9; 16],
            },
            entries: vec![
                Entry {
                    name: "a".into(),
                    shift: 16,
                    frozen: false,
                    region: 2,
                    pages: 1,
                },
                Entry {
                    name: "x".repeat(MAX_NAME),
                    shift: 12,
                    frozen: true,
                    region: 3,
                    pages: 9,
                },
            ],
        }
    }

    #[test]
    fn header_round_trips_and_a_flipped_bit_is_caught() {
        let h = header();
        let b = encode_header(&h);
        assert_eq!(decode_header(&b).unwrap(), h);
        for at in [0, 20, 70, 4000, 4093] {
            let mut bad = b.clone();
            bad[at] ^= 1;
            assert!(decode_header(&bad).is_err(), "flip at {at}");
        }
    }

    #[test]
    fn pages_round_trip_and_carry_their_number() {
        let bm = Bitmap::new("a", 1 << 40, 16, 5).unwrap();
        bm.mark(0, 1 << 16);
        bm.mark((BITS_PER_PAGE + 3) << 16, 1);
        let mut p = vec![0u8; PAGE];
        encode_page(&bm, 1, &mut p);
        assert!(check_page(&p, 6));
        assert!(!check_page(&p, 5), "a page in the wrong place");
        assert_eq!(decode_words(&p).next(), Some(1 << 3));
        p[100] ^= 4;
        assert!(!check_page(&p, 6), "a torn page");
    }

    #[test]
    fn regions_fill_gaps_first() {
        let e = |region, pages| Entry {
            name: "n".into(),
            shift: 16,
            frozen: false,
            region,
            pages,
        };
        assert_eq!(alloc_region(&[], 3), 2);
        assert_eq!(alloc_region(&[e(2, 3), e(9, 1)], 4), 5);
        assert_eq!(alloc_region(&[e(2, 3), e(9, 1)], 5), 10);
        assert_eq!(alloc_region(&[e(9, 1), e(2, 3)], 1), 5);
    }

    /// A copy that cannot be written is dropped while another took the pages, and the
    /// survivors' header moves on (so the dropped copy is older at the next start); when
    /// every copy fails, the error is returned.
    #[test]
    fn a_copy_that_fails_is_dropped_and_left_behind() {
        let dir = tempfile::tempdir().unwrap();
        let good = FileSink::new(dir.path().join("good.bitmaps"), None);
        let mut h = header();
        h.entries.clear();
        good.write_whole(&h, &[]).unwrap();
        let full = || {
            let f = std::fs::OpenOptions::new()
                .write(true)
                .open("/dev/full")
                .unwrap();
            FileSink::new(PathBuf::from("/dev/full"), Some(f))
        };
        let set = Sidecars::new(vec![full(), good], Some(h.clone()));
        set.write_pages(2, &[1u8; PAGE]).unwrap();
        set.sync().unwrap();
        assert_eq!(set.paths(), [dir.path().join("good.bitmaps")]);
        let back = FileSink::new(
            dir.path().join("good.bitmaps"),
            Some(File::open(dir.path().join("good.bitmaps")).unwrap()),
        );
        let heads = back.read_pages(0, 2).unwrap();
        let newest = [decode_header(&heads[..PAGE]), decode_header(&heads[PAGE..])]
            .into_iter()
            .filter_map(Result::ok)
            .max_by_key(|h| h.seq)
            .unwrap();
        assert_eq!(newest.seq, h.seq + 1, "the survivor's header moved on");
        let alone = Sidecars::new(vec![full()], Some(h));
        assert!(alone.write_pages(2, &[1u8; PAGE]).is_err());
        assert_eq!(
            alone.paths(),
            [PathBuf::from("/dev/full")],
            "the last is kept"
        );
    }

    #[test]
    fn sizes_per_tib() {
        // 1 TiB at 64 KiB: 16 Mi bits, 514 pages of 32704 bits: about 2 MiB.
        let tib = 1u64 << 40;
        assert_eq!(region_pages(tib >> 16), 514);
        assert_eq!(sidecar_bytes(tib, &[16]), (2 + 514) * 4096);
    }
}
