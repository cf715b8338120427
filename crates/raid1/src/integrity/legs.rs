//! The checksum table on the legs: loading it at assembly, writing its dirty pages before a
//! flush epoch (`persist_sums`), and writing pages to a leg being recovered.

use blk::{submit_wait, Bio, Buffer, Device, Op, SECTOR_SHIFT};

use super::{Checksums, PAGE};
use crate::device::{Array, Placed};
use crate::superblock::Superblock;

/// Pages per I/O when the table is read or written in runs.
const RUN: usize = 256;

/// Loads the table from `legs` (in-sync legs, best first): each page from the first leg that
/// holds it whole. A page no leg holds whole stays unknown, named in the returned warnings.
fn load(t: &Checksums, legs: &[&dyn Device]) -> Vec<String> {
    let mut missing: Vec<usize> = (0..t.nr_pages()).collect();
    for dev in legs {
        if missing.is_empty() {
            break;
        }
        let mut still = Vec::new();
        for (first, n) in runs(&missing) {
            let b = Bio::with_buf(
                Op::Read,
                t.leg_offset(first) >> SECTOR_SHIFT,
                Buffer::new(n * PAGE),
            );
            let (back, r) = submit_wait(*dev, b);
            match (r, back.buf) {
                (Ok(()), Some(buf)) => {
                    for (j, page) in buf.as_slice().chunks_exact(PAGE).enumerate() {
                        if !t.decode_page(first + j, page) {
                            still.push(first + j);
                        }
                    }
                }
                _ => still.extend(first..first + n),
            }
        }
        missing = still;
    }
    missing
        .iter()
        .map(|p| {
            format!(
                "checksum page {p} (blocks {}..{}) is torn on every leg: those blocks are \
                 unchecked until written",
                p * super::PER_PAGE,
                (p + 1) * super::PER_PAGE
            )
        })
        .collect()
}

impl Array {
    /// Writes the table's dirty pages to every writable leg, in runs. Called before the
    /// legs are flushed for a bitmap flush epoch and at a clean stop (see the crash rule in
    /// the module docs). A leg whose write fails is failed, as for a bitmap write.
    pub(crate) fn persist_sums(&self) {
        let Some(t) = &self.sums else { return };
        let _g = self.persist.lock();
        for (first, n) in runs(&t.dirty_pages()) {
            let mut bytes = vec![0u8; n * PAGE];
            for (j, out) in bytes.chunks_exact_mut(PAGE).enumerate() {
                out.copy_from_slice(&t.encode_page(first + j, true));
            }
            for (i, l) in self.legs.iter().enumerate() {
                if !l.state.load().writable() {
                    continue;
                }
                let Some(dev) = l.dev() else { continue };
                if write_pages(dev.as_ref(), t.leg_offset(first), &bytes).is_err() {
                    self.leg_write_failed(
                        i,
                        "a checksum write failed",
                        "the last in-sync leg failed a checksum write",
                    );
                }
            }
        }
    }

    /// Writes the pages holding the sums of array bytes `off..off + len` to `dev` (a leg
    /// being recovered: its own pages are stale where its data is), as they are now.
    pub(crate) fn write_sums_to(
        &self,
        dev: &dyn Device,
        off: u64,
        len: u64,
    ) -> Result<(), blk::Error> {
        let Some(t) = &self.sums else { return Ok(()) };
        let pages = t.pages_of(off, len);
        if pages.is_empty() {
            return Ok(());
        }
        // Under `persist`: a page written here never lands after a newer copy of it.
        let _g = self.persist.lock();
        let mut bytes = vec![0u8; pages.len() * PAGE];
        for (j, out) in bytes.chunks_exact_mut(PAGE).enumerate() {
            out.copy_from_slice(&t.encode_page(pages.start + j, false));
        }
        write_pages(dev, t.leg_offset(pages.start), &bytes)
    }
}

/// Runs of consecutive pages among `pages` (sorted), at most [`RUN`] each: (first, count).
fn runs(pages: &[usize]) -> Vec<(usize, usize)> {
    let mut out: Vec<(usize, usize)> = Vec::new();
    for &p in pages {
        match out.last_mut() {
            Some((first, n)) if *first + *n == p && *n < RUN => *n += 1,
            _ => out.push((p, 1)),
        }
    }
    out
}

fn write_pages(dev: &dyn Device, at: u64, bytes: &[u8]) -> Result<(), blk::Error> {
    let mut buf = Buffer::new(bytes.len());
    buf.as_mut_slice().copy_from_slice(bytes);
    submit_wait(dev, Bio::with_buf(Op::Write, at >> SECTOR_SHIFT, buf)).1
}

/// Zeroes the checksum area of a new leg (every sum unknown).
pub(crate) fn zero_area(dev: &dyn Device, t: &Checksums) -> Result<(), blk::Error> {
    let len = (t.nr_pages() * PAGE) as u64;
    let mut at = t.area.offset;
    let end = at + len;
    while at < end {
        let n = (end - at).min((RUN * PAGE) as u64) as u32;
        let b = Bio::new(Op::WriteZeroes, at >> SECTOR_SHIFT, n);
        match submit_wait(dev, b).1 {
            Ok(()) => {}
            Err(blk::Error::NotSupported(_)) => write_pages(dev, at, &vec![0u8; n as usize])?,
            Err(e) => return Err(e),
        }
        at += u64::from(n);
    }
    Ok(())
}

/// The array's per-block checksums, if it keeps them, loaded from its in-sync legs (those not
/// write-mostly first); a page no leg holds whole is named in `warnings`.
pub(crate) fn load_sums(
    newest: &Superblock,
    placed: &[Placed],
    warnings: &mut Vec<String>,
) -> Option<Checksums> {
    let area = newest.integrity?;
    let t = Checksums::new(area, newest.data_size);
    let mut legs: Vec<&Placed> = placed.iter().filter(|p| p.state.is_member()).collect();
    legs.sort_by_key(|p| p.state.is_write_mostly());
    let devs: Vec<&dyn Device> = legs.iter().map(|p| p.dev.as_ref()).collect();
    for w in load(&t, &devs) {
        tracing::warn!("raid1: {w}");
        warnings.push(w);
    }
    Some(t)
}
