//! The oracle: what a block device promises, per 512-byte sector, as sets of write ids.
//!
//! Every write stamps each of its sectors with (write id, sector number), so a read tells
//! which write a sector holds, and bytes of another offset or torn sectors are caught. Id 0 is
//! zeros (never written, TRIM, WRITE_ZEROES).
//!
//! Per sector the model keeps two sets:
//! - `cur`: what a read may return now: the last acknowledged write, plus any write to the
//!   sector that failed or is in flight (its data may or may not have landed);
//! - `dur`: what a read may return after a crash: what `cur` was at the last successful
//!   FLUSH (or the last acknowledged FUA write), plus every write since.
//!
//! An acknowledged write makes `cur` exactly that write; a FUA one makes `dur` that write too;
//! a successful FLUSH makes `dur` = `cur` for every sector; a crash makes `cur` = `dur`.

use blk::SECTOR_SIZE;

/// Bytes per sector.
pub const SECTOR: usize = SECTOR_SIZE as usize;
/// Sectors per MiB.
const MIB_SECTORS: usize = (1 << 20) / SECTOR;

/// A small set of write ids; past its room it widens to "any write of this sector".
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Set {
    n: u8,
    v: [u32; 6],
    any: bool,
}

impl Set {
    pub fn one(w: u32) -> Self {
        let mut s = Self::default();
        s.add(w);
        s
    }

    pub fn add(&mut self, w: u32) {
        if self.any || self.v[..self.n as usize].contains(&w) {
            return;
        }
        if (self.n as usize) < self.v.len() {
            self.v[self.n as usize] = w;
            self.n += 1;
        } else {
            self.any = true;
        }
    }

    pub fn contains(&self, w: u32) -> bool {
        self.any || self.v[..self.n as usize].contains(&w)
    }
}

impl std::fmt::Display for Set {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}", &self.v[..self.n as usize])?;
        if self.any {
            write!(f, "+any")?;
        }
        Ok(())
    }
}

/// The stamp of write `w` on sector `s` (id 0: zeros).
pub fn stamp(w: u32, s: u64, out: &mut [u8]) {
    if w == 0 {
        out.fill(0);
        return;
    }
    let mut h = [0u8; 16];
    h[0..4].copy_from_slice(&w.to_le_bytes());
    h[4..12].copy_from_slice(&s.to_le_bytes());
    let c = (u64::from(w) ^ s.rotate_left(17)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    h[12..16].copy_from_slice(&((c >> 32) as u32 | 1).to_le_bytes());
    for chunk in out.chunks_mut(16) {
        chunk.copy_from_slice(&h[..chunk.len()]);
    }
}

/// Which write a sector's bytes are, if they are a whole stamp of sector `s` (or zeros).
pub fn decode(s: u64, b: &[u8]) -> Option<u32> {
    let w = u32::from_le_bytes(b[0..4].try_into().ok()?);
    let mut want = [0u8; SECTOR];
    stamp(w, s, &mut want);
    (b == want).then_some(w)
}

/// The per-sector model of one array.
pub struct Model {
    cur: Vec<Set>,
    dur: Vec<Set>,
    /// Sectors whose `dur` may differ from `cur` (made equal by a FLUSH).
    touched: Vec<u64>,
    /// Per MiB of the array: ever written (a quick verification reads only these).
    written: Vec<bool>,
}

impl Model {
    pub fn new(sectors: u64) -> Self {
        Self {
            cur: vec![Set::one(0); sectors as usize],
            dur: vec![Set::one(0); sectors as usize],
            touched: Vec::new(),
            written: vec![false; (sectors as usize).div_ceil(MIB_SECTORS) + 1],
        }
    }

    /// Whether anything was ever written in MiB `m` of the array.
    pub fn written(&self, m: u64) -> bool {
        self.written.get(m as usize).copied().unwrap_or(false)
    }

    fn mark(&mut self, first: u64, n: u64) {
        let (a, b) = (
            first as usize / MIB_SECTORS,
            (first + n) as usize / MIB_SECTORS,
        );
        for m in a..=b.min(self.written.len() - 1) {
            self.written[m] = true;
        }
    }

    pub fn sectors(&self) -> u64 {
        self.cur.len() as u64
    }

    /// Write `w` to `sectors` was acknowledged (`fua`: durable at once).
    pub fn acked(&mut self, first: u64, n: u64, w: u32, fua: bool) {
        self.mark(first, n);
        for s in first..first + n {
            let i = s as usize;
            self.cur[i] = Set::one(w);
            if fua {
                self.dur[i] = Set::one(w);
            } else {
                self.dur[i].add(w);
                self.touched.push(s);
            }
        }
    }

    /// Write `w` failed or its outcome is unknown (in flight at a crash): it may be there.
    pub fn maybe(&mut self, first: u64, n: u64, w: u32) {
        self.mark(first, n);
        for s in first..first + n {
            let i = s as usize;
            self.cur[i].add(w);
            self.dur[i].add(w);
            self.touched.push(s);
        }
    }

    /// A FLUSH succeeded: everything acknowledged before it is durable.
    pub fn flushed(&mut self) {
        for s in self.touched.drain(..) {
            let i = s as usize;
            self.dur[i] = self.cur[i].clone();
        }
    }

    /// A crash: what is left is what was durable.
    pub fn crashed(&mut self) {
        for s in self.touched.drain(..) {
            let i = s as usize;
            self.cur[i] = self.dur[i].clone();
        }
    }

    /// Checks `data` read at sector `first`; the first bad sector's description on failure.
    pub fn check(&self, first: u64, data: &[u8]) -> Result<(), String> {
        for (k, b) in data.chunks(SECTOR).enumerate() {
            let s = first + k as u64;
            let allowed = &self.cur[s as usize];
            match decode(s, b) {
                Some(w) if allowed.contains(w) => {}
                Some(w) => {
                    return Err(format!(
                        "sector {s} (byte {}) holds write {w}, allowed {allowed}",
                        s * SECTOR_SIZE
                    ))
                }
                None => {
                    return Err(format!(
                        "sector {s} (byte {}) holds bytes that are no write of this sector \
                         (first 16: {:02x?}), allowed {allowed}",
                        s * SECTOR_SIZE,
                        &b[..16]
                    ))
                }
            }
        }
        Ok(())
    }
}
