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
//!
//! Reads pin: a read that finds one of several allowed writes in a sector pins the sector to
//! it, and every later read must find the same until the next write to the sector (or a
//! crash, which unpins every sector). So a sector whose legs differ (after a crash, a failed
//! write) reads the same before, during and after the resync that makes them agree. A pin
//! narrows what a read may return, never what a crash may leave (`dur`). What the legs hold
//! where they may differ is the resync source's (the first in-sync leg) until the resync
//! copies it: when that leg changes (failed, removed) or a read error may be corrected from
//! another leg (a read fault armed), the world unpins everything (`unpin_all`).
//!
//! With per-block checksums (an `integrity` seed) the legs may hold, or hand back, data with
//! one bit flipped (the fault device's flip rules). Such data reaches a client only where
//! the array has no sum to catch it (`flip_ok`, per sector, see [`Unsummed`]): a block never
//! written or trimmed since creation, or one the crash rule may have re-summed (in a chunk
//! dirty at a crash, or anywhere without a bitmap, until it is written again). Anywhere else
//! a read that finds a stamp with one bit flipped fails the seed, like any other bytes.

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
    /// Per sector, the write a read found while several were allowed (`NO_PIN`: none).
    pin: Vec<u32>,
    /// Sectors pinned since the last crash.
    pinned: Vec<u64>,
    /// Reads that pinned a sector, and reads that found a pinned one.
    pub pins: u64,
    pub pin_hits: u64,
    /// Per sector, whether a flipped bit may reach a client there (`Unsummed` as u8; all
    /// `Summed` without integrity, where no flip rule is armed).
    flip_ok: Vec<u8>,
    /// Refuse a flipped bit the crash rule allows (`SIM_SUMS_STRICT=1`: to find where it
    /// happens).
    pub strict: bool,
    /// Sectors read with one bit flipped, by `Unsummed` reason.
    pub flips_read: [u64; 5],
}

const NO_PIN: u32 = u32::MAX;

/// Why a block may be handed to a client with a bit flipped (integrity seeds): the array
/// has no sum that could catch it. `Summed`: it does, a flipped bit never reaches a client.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Unsummed {
    Summed = 0,
    /// Never written since creation, or trimmed: its sum is unknown.
    NoSum = 1,
    /// In a chunk dirty at a crash of a whole array (or without a bitmap): its sum on the
    /// legs may be older than its data, and the resync (or a read) re-sums what the source
    /// holds, flipped or not (the crash rule).
    Crash = 2,
    /// The same, at a crash of a degraded array (whose sums reach the legs only at a clean
    /// stop).
    CrashDegraded = 3,
    /// Written since a crash, in a chunk still waiting for its resync: a block no leg holds
    /// with its sum there is re-summed as the source has it (the crash rule), though this
    /// sum is the write's own.
    Pending = 4,
}

/// One bit of `b` differs from write `w`'s stamp of sector `s`: which write, if so.
pub fn decode_flipped(s: u64, b: &[u8]) -> Option<u32> {
    // One bit flips at most one of the first two 16-byte copies of the stamp's header.
    for c in [0usize, 16] {
        let w = u32::from_le_bytes(b.get(c..c + 4)?.try_into().ok()?);
        let mut want = [0u8; SECTOR];
        stamp(w, s, &mut want);
        let bits: u32 = want.iter().zip(b).map(|(x, y)| (x ^ y).count_ones()).sum();
        if bits == 1 {
            return Some(w);
        }
    }
    None
}

impl Model {
    /// The model of an array of `sectors` (`integrity`: every block starts without a sum).
    pub fn new(sectors: u64, integrity: bool) -> Self {
        let why = if integrity {
            Unsummed::NoSum
        } else {
            Unsummed::Summed
        };
        Self {
            flip_ok: vec![why as u8; sectors as usize],
            strict: false,
            flips_read: [0; 5],
            cur: vec![Set::one(0); sectors as usize],
            dur: vec![Set::one(0); sectors as usize],
            touched: Vec::new(),
            written: vec![false; (sectors as usize).div_ceil(MIB_SECTORS) + 1],
            pin: vec![NO_PIN; sectors as usize],
            pinned: Vec::new(),
            pins: 0,
            pin_hits: 0,
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

    /// What a read may return in sector `s` now.
    pub fn allowed(&self, s: u64) -> String {
        self.cur
            .get(s as usize)
            .map_or("-".into(), |c| c.to_string())
    }

    /// Whether the crash rule may have re-summed sector `s` (and nothing was written since).
    pub fn crash_marked(&self, s: u64) -> bool {
        self.flip_ok
            .get(s as usize)
            .is_some_and(|&f| f >= Unsummed::Crash as u8)
    }

    /// Whether a flipped bit may reach a client in sector `s` (its sum unknown or re-summed).
    pub fn unsummed(&self, s: u64) -> bool {
        self.flip_ok
            .get(s as usize)
            .is_some_and(|&f| f != Unsummed::Summed as u8)
    }

    /// Sets why a flipped bit may reach a client in `n` sectors from `first` (integrity
    /// seeds). `Summed` (a write recorded its sums) and `NoSum` (a discard forgot them)
    /// always apply; a crash's reason applies only where the sums were known.
    pub fn set_unsummed(&mut self, first: u64, n: u64, why: Unsummed) {
        let end = (first + n).min(self.sectors());
        for f in &mut self.flip_ok[first.min(end) as usize..end as usize] {
            if matches!(why, Unsummed::Summed | Unsummed::NoSum) || *f == Unsummed::Summed as u8 {
                *f = why as u8;
            }
        }
    }

    /// Write `w` to `sectors` was acknowledged (`fua`: durable at once).
    pub fn acked(&mut self, first: u64, n: u64, w: u32, fua: bool) {
        self.mark(first, n);
        for s in first..first + n {
            let i = s as usize;
            self.pin[i] = NO_PIN;
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
            self.pin[i] = NO_PIN;
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
        for s in self.pinned.drain(..) {
            self.pin[s as usize] = NO_PIN;
        }
        for s in self.touched.drain(..) {
            let i = s as usize;
            self.cur[i] = self.dur[i].clone();
        }
    }

    /// Unpins every sector: what reads return may change now (the leg they come from changed,
    /// or a read error may have been corrected from another leg).
    pub fn unpin_all(&mut self) {
        for s in self.pinned.drain(..) {
            self.pin[s as usize] = NO_PIN;
        }
    }

    /// Pins sector `s` to write `w` if `w` is allowed there (what the array's source leg
    /// holds: reads must find it until the next write); whether it did.
    pub fn pin_to(&mut self, s: u64, w: u32) -> bool {
        let i = s as usize;
        if !self.cur[i].contains(w) {
            return false;
        }
        if self.pin[i] == NO_PIN {
            self.pinned.push(s);
        }
        self.pin[i] = w;
        true
    }

    /// Checks `data` read at sector `first`, and pins each sector that was allowed several
    /// writes to the one it holds; the first bad sector's description on failure.
    pub fn check(&mut self, first: u64, data: &[u8]) -> Result<(), String> {
        for (k, b) in data.chunks(SECTOR).enumerate() {
            let s = first + k as u64;
            let i = s as usize;
            let allowed = &self.cur[i];
            let pin = self.pin[i];
            let mut got = decode(s, b);
            if got.is_none() {
                // A stamp with one bit flipped: allowed only where no sum could catch it.
                if let Some(w) = decode_flipped(s, b) {
                    let why = self.flip_ok[i];
                    let ok = why == Unsummed::NoSum as u8
                        || why != Unsummed::Summed as u8 && !self.strict;
                    if !ok {
                        return Err(format!(
                            "sector {s} (byte {}) holds write {w} with one bit flipped: a \
                             flipped bit reached the client where the array has its sum \
                             (why {why}: 0 summed, 2-4 crash rule refused by \
                             SIM_SUMS_STRICT), allowed {allowed}",
                            s * SECTOR_SIZE
                        ));
                    }
                    self.flips_read[why as usize] += 1;
                    got = Some(w);
                }
            }
            match got {
                Some(w) if pin != NO_PIN && w != pin => {
                    return Err(format!(
                        "sector {s} (byte {}) holds write {w}, but an earlier read found write \
                         {pin} there (allowed {allowed}) and nothing was written since",
                        s * SECTOR_SIZE
                    ))
                }
                Some(w) if allowed.contains(w) => {
                    if pin != NO_PIN {
                        self.pin_hits += 1;
                    } else if allowed.any || allowed.n > 1 {
                        self.pin[i] = w;
                        self.pinned.push(s);
                        self.pins += 1;
                    }
                }
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
