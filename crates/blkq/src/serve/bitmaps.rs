//! Changed-block tracking on `blkq serve`'s exports: the `bitmaps=` device option, where each
//! export keeps its dirty bitmaps, and the [`cbt::Tracked`] wrapper every export gets (so
//! that `blkq bitmap add` works on any export without a restart).
//!
//! | export | bitmaps kept in |
//! |---|---|
//! | `file:PATH` | the sidecar `PATH.bitmaps`, or `bitmaps=SIDECAR` |
//! | `mem:`, `null:`, `rbd:`, `nbd://` | memory only, or the sidecar `bitmaps=SIDECAR` |
//! | `--raid1` | a copy of the sidecar, `LEG.bitmaps`, beside each `file:` leg present and not faulty (matched to the array's UUID and generations: the newest copy is taken, the others refused by name and replaced; see [`cbt::Store::Mirror`]); memory only when no leg is a file |
//!
//! `bitmaps=off` serves the device without the wrapper (no bitmaps can be added).

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use blk::Device;
use blk_drivers::spec::DeviceSpec;
use blkq_sync::DynArc as Arc;
use cbt::{Bitmaps, Identity, Image, Mode, Options, Store, Tracked};
use raid1::Raid1;

/// What a spec's `bitmaps=` option says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BitmapsOpt {
    /// Not given: the default place for the kind of device.
    Default,
    /// `bitmaps=off`: no tracking.
    Off,
    /// `bitmaps=PATH`: the sidecar there.
    Sidecar(PathBuf),
}

/// Takes the `bitmaps=` option out of a device spec (the drivers do not know it); returns the
/// spec without it, and the option.
pub fn split_spec(spec: &str) -> Result<(String, BitmapsOpt)> {
    let mut opt = BitmapsOpt::Default;
    let mut kept: Vec<&str> = Vec::new();
    for (i, part) in spec.split(',').enumerate() {
        match part.trim().strip_prefix("bitmaps=") {
            Some(v) if i > 0 => {
                if opt != BitmapsOpt::Default {
                    bail!("bitmaps= given twice in {spec:?}");
                }
                opt = match v.trim() {
                    "" => bail!("bitmaps= needs a path or off, in {spec:?}"),
                    "off" => BitmapsOpt::Off,
                    p => BitmapsOpt::Sidecar(PathBuf::from(p)),
                };
            }
            _ => kept.push(part),
        }
    }
    Ok((kept.join(","), opt))
}

/// `PATH` with `.bitmaps` appended to its file name.
pub fn default_sidecar(path: &Path) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(".bitmaps");
    PathBuf::from(s)
}

/// Where a plain device's bitmaps go.
pub fn store_for(parsed: Option<&DeviceSpec>, opt: &BitmapsOpt, capacity: u64) -> Store {
    let fixed = Image::Fixed(Identity {
        size: capacity,
        uuid: [0; 16],
    });
    match (parsed.and_then(DeviceSpec::path), opt) {
        (Some(p), BitmapsOpt::Default) => Store::File {
            path: default_sidecar(p),
            image: Image::File(p.to_path_buf()),
        },
        (Some(p), BitmapsOpt::Sidecar(s)) => Store::File {
            path: s.clone(),
            image: Image::File(p.to_path_buf()),
        },
        (_, BitmapsOpt::Sidecar(s)) => Store::File {
            path: s.clone(),
            image: fixed,
        },
        _ => Store::Memory,
    }
}

/// Where a mirror's bitmaps go: a copy beside each of its `file:` legs that is present and
/// not faulty (`specs`: the spec of the leg in each slot), whatever the order the legs were
/// named in, matched to the array's UUID and generations; the copies beside the other `file:`
/// legs named (`legs`) are read too. The bitmaps belong to the array, not to one leg: the
/// newest copy is taken at start and the others brought up to date. Memory only when no leg
/// in the array is a file.
pub fn store_for_mirror(r: &Raid1, specs: &[Option<String>], legs: &[String]) -> Store {
    let Some(sb) = r.superblock(0) else {
        return Store::Memory;
    };
    let sidecar = |spec: &str| Some(default_sidecar(spec.parse::<DeviceSpec>().ok()?.path()?));
    let mut sidecars: Vec<PathBuf> = specs
        .iter()
        .enumerate()
        .filter(|(i, _)| r.leg_status(*i).is_some_and(|st| st.present && !st.faulty))
        .filter_map(|(_, spec)| sidecar(spec.as_deref()?))
        .collect();
    // One order whatever the command line's.
    sidecars.sort();
    sidecars.dedup();
    if sidecars.is_empty() {
        return Store::Memory;
    }
    let others = legs
        .iter()
        .filter_map(|l| sidecar(l))
        .filter(|p| !sidecars.contains(p))
        .collect();
    let lineage = &sb.lineage;
    Store::Mirror {
        sidecars,
        others,
        ident: Identity {
            size: r.limits().capacity,
            uuid: *sb.array_uuid.as_bytes(),
        },
        generations: std::iter::once(lineage.current.id)
            .chain(lineage.history.iter().map(|g| g.id))
            .collect(),
    }
}

/// Wraps `dev` (export `name`) in a [`Tracked`] over its bitmaps in `store`; logs what a
/// reset did.
pub fn track(
    name: &str,
    dev: Arc<dyn Device>,
    store: Store,
    reset: bool,
    mode: Mode,
) -> Result<Arc<Tracked>> {
    let capacity = dev.limits().capacity;
    let (b, notes) = Bitmaps::open(capacity, &Options { store, reset, mode })
        .with_context(|| format!("export {name:?}: dirty bitmaps"))?;
    for n in notes {
        tracing::warn!(export = %name, "{n}");
    }
    for i in b.list() {
        tracing::info!(
            export = %name,
            "dirty bitmap {:?}: granularity {}, {}, {} bytes dirty",
            i.name,
            i.granularity,
            if i.recording { "recording" } else { "frozen" },
            i.dirty_bytes
        );
    }
    Ok(Arc::new(Tracked::new(dev, b)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_option_comes_out_of_the_spec() {
        let s = |x: &str| split_spec(x).unwrap();
        assert_eq!(s("mem:1G"), ("mem:1G".into(), BitmapsOpt::Default));
        assert_eq!(
            s("file:/a.img,direct=1,bitmaps=/b/c.bm"),
            (
                "file:/a.img,direct=1".into(),
                BitmapsOpt::Sidecar("/b/c.bm".into())
            )
        );
        assert_eq!(s("file:/a,bitmaps=off").1, BitmapsOpt::Off);
        assert!(split_spec("mem:1G,bitmaps=").is_err());
        assert!(split_spec("mem:1G,bitmaps=a,bitmaps=b").is_err());
        assert_eq!(
            default_sidecar(Path::new("/x/disk.img")),
            PathBuf::from("/x/disk.img.bitmaps")
        );
    }
}
