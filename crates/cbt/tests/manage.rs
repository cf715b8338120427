//! `disable`, `enable` and `merge` (qemu's `block-dirty-bitmap-disable/-enable/-merge`)
//! through the public API, with the writes made through `Tracked` on a file image: a disabled
//! bitmap keeps its bits and counts nothing, an enabled one counts again, a merge is the
//! union at the target's granularity, and all of it survives a reopen of the sidecar.

mod common;

use std::path::Path;

use cbt::{Error, Tracked};
use testkit::io::write_at;

const MIB: u64 = 1 << 20;
const SIZE: u64 = 16 * MIB;

fn image(dir: &Path) -> std::path::PathBuf {
    common::image(dir, SIZE)
}

/// The tracked image, opened without a note.
fn tracked(img: &Path) -> Tracked {
    let (t, notes) = common::tracked(img, SIZE, false).unwrap();
    assert!(notes.is_empty(), "{notes:?}");
    t
}

/// The dirty runs of bitmap `name` over the whole device.
fn runs(t: &Tracked, name: &str) -> Vec<(u64, bool)> {
    common::dirty_runs(t, name, SIZE)
        .iter()
        .map(|e| (e.len, e.dirty))
        .collect()
}

fn recording(t: &Tracked, name: &str) -> bool {
    let l = t.bitmaps().list();
    l.iter().find(|i| i.name == name).unwrap().recording
}

#[test]
fn a_disabled_bitmap_keeps_its_bits_and_counts_nothing_until_enabled() {
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path());
    {
        let t = tracked(&img);
        t.bitmaps().add("a", MIB).unwrap();
        write_at(&t, 0, &[1u8; 4096]).unwrap();
        t.bitmaps().set_recording("a", false).unwrap();
        assert!(!recording(&t, "a"));
        // Disabling twice changes nothing.
        t.bitmaps().set_recording("a", false).unwrap();
        write_at(&t, 4 * MIB, &[2u8; 4096]).unwrap();
        assert_eq!(
            runs(&t, "a"),
            vec![(MIB, true), (SIZE - MIB, false)],
            "a write while disabled is not counted; the bit before it is kept"
        );
        t.bitmaps().set_recording("a", true).unwrap();
        assert!(recording(&t, "a"));
        write_at(&t, 8 * MIB, &[3u8; 4096]).unwrap();
        assert_eq!(
            runs(&t, "a"),
            vec![
                (MIB, true),
                (7 * MIB, false),
                (MIB, true),
                (SIZE - 9 * MIB, false)
            ]
        );
        t.bitmaps().set_recording("a", false).unwrap();
        assert!(matches!(
            t.bitmaps().set_recording("nope", true),
            Err(Error::NotFound(_))
        ));
    }
    // The state and the bits are on disk.
    let t = tracked(&img);
    assert!(!recording(&t, "a"), "disabled survives a reopen");
    assert_eq!(runs(&t, "a").iter().filter(|r| r.1).count(), 2);
    write_at(&t, 12 * MIB, &[4u8; 4096]).unwrap();
    assert_eq!(runs(&t, "a").iter().filter(|r| r.1).count(), 2);
}

#[test]
fn a_merge_is_the_union_at_the_targets_granularity_and_survives_a_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path());
    {
        let t = tracked(&img);
        t.bitmaps().add("fine", 64 << 10).unwrap();
        t.bitmaps().add("other", 64 << 10).unwrap();
        write_at(&t, 3 * MIB + 64 * 1024, &[1u8; 4096]).unwrap();
        t.bitmaps().remove("other").unwrap();
        t.bitmaps().add("other", 64 << 10).unwrap();
        write_at(&t, 10 * MIB, &[1u8; 4096]).unwrap();
        // "fine": 3M+64K and 10M; "other": 10M only. The target is coarse and disabled
        // (merging into a frozen bitmap, as a backup tool does, is allowed).
        t.bitmaps().add("coarse", 2 * MIB).unwrap();
        t.bitmaps().set_recording("coarse", false).unwrap();
        t.bitmaps()
            .merge("coarse", &["fine".to_string(), "other".to_string()])
            .unwrap();
        assert_eq!(
            runs(&t, "coarse"),
            vec![
                (2 * MIB, false),
                (2 * MIB, true),
                (6 * MIB, false),
                (2 * MIB, true),
                (4 * MIB, false)
            ],
            "each source's dirty granule rounds out to the target's 2 MiB"
        );
        // The sources are unchanged.
        assert_eq!(runs(&t, "other").iter().filter(|r| r.1).count(), 1);
        assert_eq!(runs(&t, "fine").iter().filter(|r| r.1).count(), 2);
        for (target, sources, what) in [
            ("coarse", vec!["coarse".to_string()], "into itself"),
            ("coarse", vec!["nope".to_string()], "no dirty bitmap"),
            ("nope", vec!["fine".to_string()], "no dirty bitmap"),
        ] {
            let e = t.bitmaps().merge(target, &sources).unwrap_err().to_string();
            assert!(e.contains(what), "{target} <- {sources:?}: {e}");
        }
    }
    let t = tracked(&img);
    assert_eq!(
        runs(&t, "coarse").iter().filter(|r| r.1).count(),
        2,
        "the merged bits were persisted"
    );
}
