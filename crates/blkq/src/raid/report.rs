//! Owns the report of `blkq raid status`/`detail`: the array, leg, bitmap and sync structs
//! (also the JSON of `--json` and of the control socket), built offline and online alike, and
//! their mdstat-like and detail text.

use raid1::{SyncProgress, WriteIntentBitmap};
use serde::{Deserialize, Serialize};

/// The state of one slot, as reported. `Default`: an empty slot with nothing known of it, no
/// state named.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct LegReport {
    /// Slot number.
    pub slot: usize,
    /// The leg's device spec, when known.
    pub device: Option<String>,
    /// `in_sync`, `recovering`, `faulty`, `stale`, `missing` or `empty`.
    pub state: String,
    /// The leg's UUID (nil for an empty slot).
    pub uuid: String,
    /// Read only when nothing else can serve.
    pub write_mostly: bool,
    /// For a recovering leg: array bytes below this are in sync.
    pub recovery_offset: Option<u64>,
    /// The events count of the leg's own superblock (offline), or the array's (online).
    pub events: Option<u64>,
    /// The generation of the leg's own superblock, in hex (offline): legs of one history
    /// share it; see `raid1::generation`.
    #[serde(default)]
    pub generation: Option<String>,
    /// Corrected read errors (online).
    pub read_errors: u32,
    /// A faulty leg the array probes to re-add it when it answers again (online,
    /// `readd=auto`).
    #[serde(default)]
    pub probing: bool,
    /// Why the last probe of a faulty leg found no answer (online).
    #[serde(default)]
    pub probe_error: Option<String>,
    /// Why a returning leg was refused (its superblock tells another history): it stays
    /// faulty and untouched until its superblock changes (online).
    #[serde(default)]
    pub refused: Option<String>,
    /// Automatic re-adds of this slot since the array started (online).
    #[serde(default)]
    pub readds: u64,
    /// Round-trip time of the leg's reads and writes, ns: an EWMA of their latency on the
    /// coarse clock (1-4 ms resolution); none before the first (online).
    #[serde(default)]
    pub rtt_ns: Option<u64>,
    /// Writes acknowledged and still in flight to this leg (`write_behind=N`) (online).
    #[serde(default)]
    pub write_behind: u32,
    /// Blocks read from this leg that did not match their checksums (online, integrity on).
    #[serde(default)]
    pub checksum_errors: u64,
}

/// The per-block checksums, as reported.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct IntegrityReport {
    /// `crc32c`.
    pub algorithm: String,
    /// Blocks healed from a leg that matched (online).
    pub healed: u64,
    /// Blocks no leg held with their checksum: their reads failed (online).
    pub unrecoverable: u64,
    /// Blocks a resync re-summed after a crash tore them (online).
    pub resummed: u64,
}

/// A round trip for people: `12.3ms`.
fn ms(ns: u64) -> String {
    format!("{:.1}ms", ns as f64 / 1e6)
}

/// The write-intent bitmap, as reported.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct BitmapReport {
    /// Bytes per bit.
    pub chunk_size: u64,
    /// Bits.
    pub chunks: u64,
    /// Dirty bits (what a returning leg must copy).
    pub dirty: u64,
}

/// A resync/recovery/check in progress, as reported.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct SyncReport {
    /// md's name: `resync`, `recover`, `check`, `repair`, `idle`, `frozen`.
    pub action: String,
    /// Bytes done.
    pub done_bytes: u64,
    /// Bytes to do.
    pub total_bytes: u64,
    /// Current speed.
    pub speed_kib_s: u64,
    /// Estimated seconds left.
    pub eta_secs: Option<u64>,
    /// Mismatches found by check/repair.
    pub mismatch_cnt: u64,
    /// Bitmap chunks (or windows without a bitmap) copied by resync and recovery since the
    /// array started: what a bitmap-driven resync or re-add actually had to copy.
    #[serde(default)]
    pub chunks_copied: u64,
    /// Pauses the sync thread gave to regular I/O (above `sync_speed_min`, array busy).
    #[serde(default)]
    pub yields: u64,
}

impl SyncReport {
    /// md's progress line: `[=====>...............]  recovery = 27.3% (x/y) finish=1.2min
    /// speed=10240K/sec`.
    pub fn progress_line(&self) -> String {
        let s = self;
        const WIDTH: u64 = 20;
        let per_mille = (s.done_bytes.min(s.total_bytes) as u128 * 1000)
            .checked_div(s.total_bytes as u128)
            .unwrap_or(0) as u64;
        let filled = per_mille * WIDTH / 1000;
        let mut bar = String::with_capacity(WIDTH as usize + 2);
        bar.push('[');
        for i in 0..WIDTH {
            bar.push(if i < filled {
                '='
            } else if i == filled {
                '>'
            } else {
                '.'
            });
        }
        bar.push(']');
        let finish = s
            .eta_secs
            .map_or("?".to_string(), |e| format!("{:.1}min", e as f64 / 60.0));
        format!(
            "{bar}  {} = {}.{}% ({}/{}) finish={finish} speed={}K/sec",
            s.action,
            per_mille / 10,
            per_mille % 10,
            s.done_bytes / 1024,
            s.total_bytes / 1024,
            s.speed_kib_s
        )
    }
}

/// The whole array, as reported.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ArrayReport {
    /// Array UUID.
    pub array_uuid: String,
    /// `clean`, `active`, `degraded` or `failed` (see `raid1::Raid1::failure`).
    pub state: String,
    /// Events of the newest superblock.
    pub events: u64,
    /// The array's generation, in hex (a new one starts whenever a leg in sync leaves; see
    /// `raid1::generation`).
    #[serde(default)]
    pub generation: String,
    /// Array bytes.
    pub capacity: u64,
    /// Where data starts on every leg.
    pub data_offset: u64,
    /// Member slots (md's raid_disks): what `[UU]` has one character for.
    pub raid_disks: usize,
    /// Every slot (members first, then spare slots).
    pub legs: Vec<LegReport>,
    /// The bitmap, if the array has one.
    pub bitmap: Option<BitmapReport>,
    /// Per-block checksums, if the array keeps them.
    #[serde(default)]
    pub integrity: Option<IntegrityReport>,
    /// A sync action in progress (online only).
    pub sync: Option<SyncReport>,
    /// Notes for the user (stale legs, legs left out, ...).
    pub notes: Vec<String>,
}

impl From<&WriteIntentBitmap> for BitmapReport {
    fn from(b: &WriteIntentBitmap) -> Self {
        BitmapReport {
            chunk_size: b.chunk_size(),
            chunks: b.nr_chunks(),
            dirty: b.dirty_chunks().iter().map(|c| c.end - c.first).sum(),
        }
    }
}

impl From<SyncProgress> for SyncReport {
    fn from(p: SyncProgress) -> Self {
        SyncReport {
            action: p.action.to_string(),
            done_bytes: p.done_bytes,
            total_bytes: p.total_bytes,
            speed_kib_s: p.speed_kib_s,
            eta_secs: p.eta_secs,
            mismatch_cnt: p.mismatch_cnt,
            chunks_copied: p.chunks_copied,
            yields: p.yields,
        }
    }
}

impl ArrayReport {
    /// md's `[UU_]` string: one character per leg in a slot, in slot order (`U` in sync,
    /// `_` otherwise), then `_` for each member missing (up to `raid_disks`).
    pub fn mdstat_legs(&self) -> String {
        let mut s: String = self
            .legs
            .iter()
            .filter(|l| l.state != "empty")
            .map(|l| if l.state == "in_sync" { 'U' } else { '_' })
            .collect();
        while s.len() < self.raid_disks {
            s.push('_');
        }
        format!("[{s}]")
    }

    /// Legs in sync.
    pub fn in_sync(&self) -> usize {
        self.legs.iter().filter(|l| l.state == "in_sync").count()
    }

    /// The mdstat-like text of `blkq raid status`.
    pub fn render_status(&self) -> String {
        let mut o = String::new();
        let members: Vec<String> = self
            .legs
            .iter()
            .filter(|l| l.state != "empty")
            .map(|l| {
                let mut s = format!("{}[{}]", l.device.as_deref().unwrap_or("?"), l.slot);
                if l.write_mostly {
                    s.push_str("(W)");
                }
                match l.state.as_str() {
                    "faulty" => s.push_str("(F)"),
                    "stale" => s.push_str("(S)"),
                    "missing" => s.push_str("(M)"),
                    _ => {}
                }
                s
            })
            .collect();
        o.push_str(&format!(
            "raid1 : {} raid1 {}\n",
            if self.state == "degraded" {
                "active (degraded)"
            } else {
                "active"
            },
            members.join(" ")
        ));
        o.push_str(&format!(
            "      {} blocks [{}/{}] {}\n",
            self.capacity / 1024,
            self.raid_disks,
            self.in_sync(),
            self.mdstat_legs()
        ));
        if let Some(s) = &self.sync {
            if s.action != "idle" && s.total_bytes > 0 {
                o.push_str(&format!("      {}\n", s.progress_line()));
            }
        }
        match &self.bitmap {
            Some(b) => o.push_str(&format!(
                "      bitmap: {}/{} chunks dirty, {}KB chunk\n",
                b.dirty,
                b.chunks,
                b.chunk_size / 1024
            )),
            None => o.push_str("      bitmap: none\n"),
        }
        if let Some(i) = &self.integrity {
            o.push_str(&format!(
                "      integrity: {}, {} healed, {} unrecoverable\n",
                i.algorithm, i.healed, i.unrecoverable
            ));
        }
        o.push_str(&format!("      uuid: {}\n", self.array_uuid));
        let rtts: Vec<String> = self
            .legs
            .iter()
            .filter_map(|l| {
                let rtt = l.rtt_ns?;
                let mut s = format!("[{}] {}", l.slot, ms(rtt));
                if l.write_behind > 0 {
                    s.push_str(&format!(" ({} behind)", l.write_behind));
                }
                Some(s)
            })
            .collect();
        if !rtts.is_empty() {
            o.push_str(&format!("      rtt: {}\n", rtts.join(" ")));
        }
        for l in &self.legs {
            if l.checksum_errors > 0 {
                o.push_str(&format!(
                    "      leg {}: {} block(s) failed their checksums\n",
                    l.slot, l.checksum_errors
                ));
            }
            if let Some(why) = &l.refused {
                o.push_str(&format!("      leg {} refused: {why}\n", l.slot));
            } else if let Some(e) = &l.probe_error {
                o.push_str(&format!("      leg {} unreachable: {e}\n", l.slot));
            }
        }
        for n in &self.notes {
            o.push_str(&format!("      note: {n}\n"));
        }
        o
    }

    /// The text of `blkq raid detail`.
    pub fn render_detail(&self) -> String {
        let mut o = String::new();
        o.push_str(&format!("        Array UUID : {}\n", self.array_uuid));
        o.push_str(&format!("             State : {}\n", self.state));
        o.push_str(&format!("            Events : {}\n", self.events));
        o.push_str(&format!("        Generation : {}\n", self.generation));
        o.push_str(&format!(
            "        Array Size : {} bytes ({} MiB)\n",
            self.capacity,
            self.capacity >> 20
        ));
        o.push_str(&format!(
            "       Data Offset : {} bytes\n",
            self.data_offset
        ));
        o.push_str(&format!(
            "      Raid Devices : {} ({} in sync)\n",
            self.raid_disks,
            self.in_sync()
        ));
        match &self.bitmap {
            Some(b) => o.push_str(&format!(
                "            Bitmap : {} KiB chunks, {} of {} dirty\n",
                b.chunk_size / 1024,
                b.dirty,
                b.chunks
            )),
            None => o.push_str("            Bitmap : none\n"),
        }
        match &self.integrity {
            Some(i) => o.push_str(&format!(
                "         Integrity : {} per 4 KiB block, {} healed, {} unrecoverable, {} re-summed after a crash\n",
                i.algorithm, i.healed, i.unrecoverable, i.resummed
            )),
            None => o.push_str("         Integrity : none\n"),
        }
        if let Some(s) = &self.sync {
            o.push_str(&format!("       Sync Action : {}\n", s.action));
            if s.action != "idle" && s.total_bytes > 0 {
                o.push_str(&format!("     Sync Progress : {}\n", s.progress_line()));
            }
            o.push_str(&format!("      Mismatch Cnt : {}\n", s.mismatch_cnt));
        }
        o.push_str(
            "\n    Slot  State           Events  WM  Leg UUID                              Device\n",
        );
        for l in &self.legs {
            let mut state = l.state.clone();
            if let Some(r) = l.recovery_offset {
                if l.state == "recovering" {
                    state = format!("recovering@{}", r);
                }
            }
            o.push_str(&format!(
                "    {:>4}  {:<14}  {:>6}  {:<2}  {:<36}  {}\n",
                l.slot,
                state,
                l.events.map_or("-".to_string(), |e| e.to_string()),
                if l.write_mostly { "W" } else { "-" },
                l.uuid,
                l.device.as_deref().unwrap_or("-")
            ));
            if let Some(rtt) = l.rtt_ns {
                o.push_str(&format!(
                    "       round trip : {}, write-behind : {}\n",
                    ms(rtt),
                    l.write_behind
                ));
            }
            if let Some(g) = l.generation.as_ref().filter(|g| **g != self.generation) {
                o.push_str(&format!("       generation : {g} (not the array's)\n"));
            }
            if let Some(why) = &l.refused {
                o.push_str(&format!("          refused : {why}\n"));
            }
            if let Some(e) = &l.probe_error {
                o.push_str(&format!("       last probe : {e}\n"));
            }
            if l.probing || l.readds > 0 {
                o.push_str(&format!(
                    "           re-add : {}, {} automatic re-adds\n",
                    if l.probing { "probing" } else { "-" },
                    l.readds
                ));
            }
        }
        for n in &self.notes {
            o.push_str(&format!("    note: {n}\n"));
        }
        o
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn leg(slot: usize, state: &str) -> LegReport {
        LegReport {
            slot,
            state: state.into(),
            ..LegReport::default()
        }
    }

    #[test]
    fn mdstat_legs_one_char_per_member() {
        let mut r = ArrayReport {
            array_uuid: String::new(),
            state: "active".into(),
            events: 1,
            generation: String::new(),
            capacity: 0,
            data_offset: 0,
            raid_disks: 2,
            legs: vec![leg(0, "in_sync"), leg(1, "in_sync"), leg(2, "empty")],
            bitmap: None,
            integrity: None,
            sync: None,
            notes: vec![],
        };
        assert_eq!(r.mdstat_legs(), "[UU]");
        r.legs[1].state = "faulty".into();
        assert_eq!(r.mdstat_legs(), "[U_]");
        r.legs[1].state = "empty".into();
        assert_eq!(r.mdstat_legs(), "[U_]");
        r.legs[2].state = "in_sync".into();
        assert_eq!(r.mdstat_legs(), "[UU]");
        r.legs[0].state = "recovering".into();
        assert_eq!(r.mdstat_legs(), "[_U]");
    }

    #[test]
    fn progress_line_looks_like_md() {
        let s = SyncReport {
            action: "recover".into(),
            done_bytes: 50 << 20,
            total_bytes: 100 << 20,
            speed_kib_s: 1024,
            eta_secs: Some(90),
            mismatch_cnt: 0,
            chunks_copied: 0,
            yields: 0,
        };
        let l = s.progress_line();
        assert!(
            l.starts_with("[==========>.........]  recover = 50.0%"),
            "{l}"
        );
        assert!(l.contains("finish=1.5min speed=1024K/sec"), "{l}");
    }
}
