//! [`Raid1Config`]: the array's options, and their `key=value` spelling (`set_option`, the
//! spec options of `blkq serve --raid1-option` and `blkq bench`).

use std::time::Duration;

use crate::barrier::BarrierMode;
use crate::bitmap::{BitmapCounts, DEFAULT_CHUNK_SIZE};
use crate::error::Raid1Error;

/// `readd=auto`'s probe period unless `readd_interval_ms` says otherwise.
pub const DEFAULT_READD_INTERVAL: Duration = Duration::from_secs(5);

/// Configuration of a [`Raid1`](crate::Raid1).
#[derive(Debug, Clone)]
pub struct Raid1Config {
    /// Barrier implementation (`barrier=locked|lockless`).
    pub barrier: BarrierMode,
    /// Write-intent bitmap chunk size, bytes (0: no bitmap).
    pub bitmap_chunk: u64,
    /// Time a bitmap chunk must be quiet before its bit is cleared.
    pub bitmap_quiet: Duration,
    /// How writes are counted in their bitmap chunks (`bitmap_counts=sharded|locked`).
    pub bitmap_counts: BitmapCounts,
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
    /// [`crate::Raid1::assemble`] may start without legs the newest superblock records in
    /// sync (`allow_degraded=true`; `blkq serve --raid1-degraded`): this side then runs as a
    /// new generation, and the legs left out are refused later unless their side is
    /// discarded (see `generation`).
    pub allow_degraded: bool,
    /// Automatic re-add of a leg that failed on an I/O error and answers again
    /// (`readd=auto|off`, `readd_interval_ms=N`): the period of its probe, or None (off).
    /// See `readd`.
    pub readd_interval: Option<Duration>,
    /// Write-behind (`write_behind=N`, md's `--write-behind`; needs a bitmap): writes still
    /// in flight to write-mostly legs after their acknowledgement, at most (0: off). See
    /// `behind`.
    pub write_behind: u32,
    /// Every leg of a write reads the caller's buffer (`share_writes=1`, the default): one
    /// payload per write in flight, no copy. `share_writes=0`: each extra leg writes a pooled
    /// copy (the simple version, to compare against). Writes behind copy for their
    /// write-behind legs either way. See `lend`.
    pub share_writes: bool,
    /// Per-block checksums for a new array (`integrity=crc32c|none`; see `integrity`). Read
    /// by [`crate::Raid1::create`] only: an assembled array keeps what its superblock says.
    pub integrity: Option<crate::integrity::Algorithm>,
    /// How a leg's completion keeps the array alive (`completion_ref=sharded|counted`): see
    /// `retire`.
    pub completion_ref: CompletionRef,
}

/// How a leg's completion keeps the array alive while it runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CompletionRef {
    /// Counted in and out on its thread shard; the owner's drop hands its reference to the
    /// last completion out (`retire`): no line shared by every completing core.
    Sharded,
    /// The simple rule: each completion upgrades a `Weak` to the array (two writes of the
    /// array's one reference count per leg bio).
    Counted,
}

impl Default for Raid1Config {
    fn default() -> Self {
        Self {
            barrier: BarrierMode::Lockless,
            bitmap_chunk: DEFAULT_CHUNK_SIZE,
            bitmap_quiet: crate::bitmap::DEFAULT_QUIET,
            bitmap_counts: BitmapCounts::Sharded,
            tick: Duration::from_secs(1),
            depth: 256,
            max_io_bytes: 1 << 20,
            read_error_limit: 20,
            spare_slots: 1,
            allow_degraded: false,
            readd_interval: None,
            write_behind: 0,
            share_writes: true,
            integrity: None,
            completion_ref: CompletionRef::Sharded,
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
    /// (`0`/`none`: no bitmap), `bitmap_quiet_ms=N`, `bitmap_counts=sharded|locked`, `depth=N`, `max_io=SIZE`,
    /// `read_errors=N`, `spare_slots=N`, `allow_degraded=true|false`, `readd=auto|off`,
    /// `readd_interval_ms=N` (also turns it on), `write_behind=N`, `share_writes=0|1`,
    /// `integrity=crc32c|none` (at creation), `completion_ref=sharded|counted`.
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
            "bitmap_counts" => {
                self.bitmap_counts = value
                    .parse()
                    .map_err(|e: crate::bitmap::BitmapError| Raid1Error::Config(e.to_string()))?
            }
            "depth" => self.depth = value.parse().map_err(|_| bad())?,
            "max_io" => {
                self.max_io_bytes = parse_size(value)
                    .and_then(|v| u32::try_from(v).ok())
                    .ok_or_else(bad)?
            }
            "read_errors" => self.read_error_limit = value.parse().map_err(|_| bad())?,
            "spare_slots" => self.spare_slots = value.parse().map_err(|_| bad())?,
            "allow_degraded" => self.allow_degraded = value.parse().map_err(|_| bad())?,
            "readd" => {
                self.readd_interval = match value {
                    "auto" => self.readd_interval.or(Some(DEFAULT_READD_INTERVAL)),
                    "off" => None,
                    _ => return Err(bad()),
                }
            }
            "write_behind" => self.write_behind = value.parse().map_err(|_| bad())?,
            "share_writes" => {
                self.share_writes = match value {
                    "1" | "true" => true,
                    "0" | "false" => false,
                    _ => return Err(bad()),
                }
            }
            "integrity" => {
                self.integrity = match value {
                    "none" | "off" => None,
                    v => Some(v.parse().map_err(Raid1Error::Config)?),
                }
            }
            "completion_ref" => {
                self.completion_ref = match value {
                    "sharded" => CompletionRef::Sharded,
                    "counted" => CompletionRef::Counted,
                    _ => return Err(bad()),
                }
            }
            "readd_interval_ms" => {
                let ms: u64 = value.parse().map_err(|_| bad())?;
                if ms == 0 {
                    return Err(bad());
                }
                self.readd_interval = Some(Duration::from_millis(ms));
            }
            _ => return Err(Raid1Error::Config(format!("raid1: unknown option {key}"))),
        }
        Ok(())
    }
}
