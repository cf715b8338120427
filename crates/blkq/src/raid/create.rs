//! Owns the rules of creating an array, for `blkq raid create` and `blkq serve
//! --raid1-create` alike (mdadm's): a leg that holds data is refused unless forced (a raid1
//! superblock, a filesystem or partition signature, or a non-zero byte where the superblock
//! and bitmap go: [`super::content`]); legs of different sizes are refused unless the size to
//! use of each is given; and the new array resyncs from its first leg unless told the legs
//! are blank (`--assume-clean`).

use anyhow::{bail, Context, Result};
use blk::Device;
use blk_drivers::spec::QueueOverrides;
use blkq_sync::Arc;
use raid1::bitmap::DEFAULT_CHUNK_SIZE;
use raid1::superblock::layout;
use raid1::{Creation, Raid1, Raid1Config};

use super::content;
use super::legs::{probe, Probe};
use crate::open::open_leg;

/// How to create: the flags both commands take.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CreateRules {
    /// Take legs that hold data (any kind: a raid1 superblock, a signature, non-zero bytes).
    pub force: bool,
    /// No initial resync: the legs are blank.
    pub assume_clean: bool,
    /// Bytes of each leg to use (superblock, bitmap and data); `None`: all of it, the legs
    /// being of one size.
    pub size: Option<u64>,
}

/// The names of the flags in the command that creates, for its messages.
#[derive(Debug, Clone, Copy)]
pub struct Flags {
    /// Takes legs that hold data.
    pub force: &'static str,
    /// The size to use of each leg.
    pub size: &'static str,
    /// How to use the array already on the legs instead.
    pub keep: &'static str,
}

/// `blkq raid create`'s.
pub const CLI: Flags = Flags {
    force: "--force",
    size: "--size",
    keep: "use `blkq raid assemble` to look at that array",
};

/// `blkq serve --raid1-create`'s (`[[raid1]]`: `force`, `size`).
pub const SERVE: Flags = Flags {
    force: "--raid1-force",
    size: "--raid1-size",
    keep: "drop --raid1-create to serve that array",
};

/// `n` bytes, for a message: `64 MiB (67108864 bytes)`.
fn bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["bytes", "KiB", "MiB", "GiB", "TiB"];
    let mut u = 0;
    while u + 1 < UNITS.len() && n >> (10 * (u + 1)) > 0 && n.is_multiple_of(1 << (10 * (u + 1))) {
        u += 1;
    }
    if u == 0 {
        format!("{n} bytes")
    } else {
        format!("{} {} ({n} bytes)", n >> (10 * u), UNITS[u])
    }
}

/// The bytes of each leg to use: `rules.size`, or the legs' one size; legs of different sizes
/// without a size, or a size more than a leg holds, are refused naming the legs and sizes.
pub fn leg_size(specs: &[String], sizes: &[u64], rules: &CreateRules, f: Flags) -> Result<u64> {
    let (small, big) = match (
        sizes.iter().enumerate().min_by_key(|(_, s)| **s),
        sizes.iter().enumerate().max_by_key(|(_, s)| **s),
    ) {
        (Some(a), Some(b)) => (a, b),
        _ => bail!("no leg given"),
    };
    match rules.size {
        Some(n) if n > *small.1 => bail!(
            "{} {n}: more than leg {:?} holds ({}); give at most its size",
            f.size,
            specs[small.0],
            bytes(*small.1)
        ),
        Some(n) => Ok(n),
        None if small.1 != big.1 => bail!(
            "legs of different sizes: {:?} is {} and {:?} is {}: a mirror uses as much of each \
             leg, so {} of {:?} would go unused. Give {} {} (or less) to use that much of each \
             leg",
            specs[small.0],
            bytes(*small.1),
            specs[big.0],
            bytes(*big.1),
            bytes(big.1 - small.1),
            specs[big.0],
            f.size,
            small.1
        ),
        None => Ok(*small.1),
    }
}

/// Refuses (unless `rules.force`) a leg that holds data: a raid1 superblock, or a signature or
/// a non-zero byte in its first `probe_len` bytes (at least [`content::BLANK_PROBE`]).
fn check_blank(spec: &str, dev: &dyn Device, probe_len: u64, f: Flags) -> Result<()> {
    match probe(dev).with_context(|| format!("leg {spec:?}: reading it"))? {
        Probe::Member(sb) => bail!(
            "leg {spec:?} already carries a raid1 superblock (array {}, events {}): refusing to \
             overwrite it. To keep that array, {}; {} overwrites it",
            sb.array_uuid,
            sb.events,
            f.keep,
            f.force
        ),
        Probe::Corrupt(e) => bail!(
            "leg {spec:?} carries a damaged raid1 superblock ({e}): refusing to overwrite it \
             without {}",
            f.force
        ),
        Probe::Blank => {}
    }
    let (held, probed) =
        content::probe(dev, probe_len).with_context(|| format!("leg {spec:?}: reading it"))?;
    if let Some(what) = held.describe(probed) {
        bail!(
            "leg {spec:?} holds data: {what}. Creating the array would destroy it; {} \
             overwrites it",
            f.force
        );
    }
    Ok(())
}

/// Opens the legs and creates the array on them by the rules (see the module).
pub fn create_array(
    specs: &[String],
    overrides: &QueueOverrides,
    cfg: Raid1Config,
    rules: &CreateRules,
    f: Flags,
) -> Result<Raid1> {
    let devs = specs
        .iter()
        .map(|s| open_leg(s, overrides))
        .collect::<Result<Vec<Arc<dyn Device>>>>()?;
    let sizes: Vec<u64> = devs.iter().map(|d| d.limits().capacity).collect();
    let size = leg_size(specs, &sizes, rules, f)?;
    if !rules.force {
        // Where the superblock and bitmap go (the layout the array will have).
        let chunk = match cfg.bitmap_chunk {
            0 => DEFAULT_CHUNK_SIZE,
            c => c,
        };
        let meta_end = layout(size, chunk).map_or(0, |(bm, _, _)| bm.offset + bm.len);
        for (spec, dev) in specs.iter().zip(&devs) {
            check_blank(spec, dev.as_ref(), meta_end, f)?;
        }
    }
    let how = Creation {
        resync: !rules.assume_clean,
        leg_size: rules.size,
    };
    Ok(Raid1::create_with(devs, cfg, how)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn different_sizes_need_a_size() {
        let specs = ["mem:64M".to_string(), "mem:80M".to_string()];
        let sizes = [64 << 20, 80 << 20];
        let e = leg_size(&specs, &sizes, &CreateRules::default(), CLI)
            .unwrap_err()
            .to_string();
        assert!(e.contains("64 MiB (67108864 bytes)"), "{e}");
        assert!(e.contains("80 MiB (83886080 bytes)"), "{e}");
        assert!(e.contains("--size 67108864"), "{e}");
        let rules = |n| CreateRules {
            size: Some(n),
            ..CreateRules::default()
        };
        assert_eq!(
            leg_size(&specs, &sizes, &rules(64 << 20), CLI).unwrap(),
            64 << 20
        );
        assert_eq!(
            leg_size(&specs, &sizes, &rules(32 << 20), CLI).unwrap(),
            32 << 20
        );
        let e = leg_size(&specs, &sizes, &rules(65 << 20), SERVE)
            .unwrap_err()
            .to_string();
        assert!(e.contains("--raid1-size") && e.contains("mem:64M"), "{e}");
        assert_eq!(
            leg_size(&specs, &[5, 5], &CreateRules::default(), CLI).unwrap(),
            5
        );
        assert_eq!(bytes(1000), "1000 bytes");
        assert_eq!(bytes(3 << 30), "3 GiB (3221225472 bytes)");
    }
}
