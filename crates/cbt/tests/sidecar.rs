//! The sidecar through the public API: bits survive a reopen (with the writes that set them
//! made through `Tracked`), management errors are named, and a sidecar that is torn, from
//! another image or missing is refused with its path named, or with `reset` replaced by
//! all-dirty bitmaps that say so. A mirror's copies: the newest is taken in any order and the
//! stale one named and replaced; a copy from a history the array does not share is refused.

mod common;

use std::path::{Path, PathBuf};

use blk::{Device, DirtyBitmaps, DirtyExtent};
use cbt::{Bitmaps, Error, Image, Mode, Options, Store, Tracked};
use testkit::io::write_at;

const MIB: u64 = 1 << 20;
const SIZE: u64 = 64 * MIB;

fn image(dir: &Path) -> PathBuf {
    common::image(dir, SIZE)
}

fn tracked(img: &Path, reset: bool) -> Result<(Tracked, Vec<String>), Error> {
    common::tracked(img, SIZE, reset)
}

fn dirty_runs(t: &Tracked, name: &str) -> Vec<DirtyExtent> {
    common::dirty_runs(t, name, SIZE)
}

fn d(len: u64, dirty: bool) -> DirtyExtent {
    DirtyExtent { len, dirty }
}

#[test]
fn bits_written_through_the_device_survive_a_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path());
    {
        let (t, notes) = tracked(&img, false).unwrap();
        assert!(notes.is_empty(), "{notes:?}");
        assert!(
            !img.with_extension("bitmaps").exists(),
            "no sidecar before the first bitmap"
        );
        t.bitmaps().add("a", 64 << 10).unwrap();
        t.bitmaps().add("b", 1 << 20).unwrap();
        write_at(&t, 3 * MIB + 4096, &[7u8; 4096]).unwrap();
        let s0 = t.bitmaps().commit_stats();
        assert!(
            s0.batches >= 1,
            "the first write to a clean granule persisted"
        );
        write_at(&t, 3 * MIB + 8192, &[7u8; 4096]).unwrap();
        assert_eq!(
            t.bitmaps().commit_stats(),
            s0,
            "a second write to a durable granule persists nothing"
        );
        assert_eq!(
            dirty_runs(&t, "a"),
            [
                d(3 * MIB, false),
                d(64 << 10, true),
                d(SIZE - 3 * MIB - (64 << 10), false)
            ]
        );
        t.bitmaps().rotate("a", "a2").unwrap();
        write_at(&t, 10 * MIB, &[1u8; 512]).unwrap();
        // A process that dies here leaves the sidecar as it is: nothing more is written.
    }
    let (t, _) = tracked(&img, false).unwrap();
    let list = t.bitmaps().list();
    let names: Vec<_> = list
        .iter()
        .map(|i| (i.name.as_str(), i.granularity, i.recording, i.dirty_bytes))
        .collect();
    assert_eq!(
        names,
        [
            ("a", 64 << 10, false, 64 << 10),
            ("b", MIB, true, 2 * MIB),
            ("a2", 64 << 10, true, 64 << 10)
        ]
    );
    assert_eq!(t.dirty_bitmaps().unwrap().names(), ["a", "b", "a2"]);
    assert_eq!(
        dirty_runs(&t, "a2"),
        [
            d(10 * MIB, false),
            d(64 << 10, true),
            d(SIZE - 10 * MIB - (64 << 10), false)
        ]
    );
    // A reloaded bit is durable: writing there again persists nothing.
    write_at(&t, 10 * MIB + 512, &[1u8; 512]).unwrap();
    assert_eq!(t.bitmaps().commit_stats().batches, 0);
    // clear and remove are durable too.
    t.bitmaps().clear("b").unwrap();
    t.bitmaps().remove("a").unwrap();
    drop(t);
    let (t, _) = tracked(&img, false).unwrap();
    let list: Vec<_> = t
        .bitmaps()
        .list()
        .into_iter()
        .map(|i| (i.name, i.dirty_bytes))
        .collect();
    assert_eq!(list, [("b".to_string(), 0), ("a2".to_string(), 64 << 10)]);
}

#[test]
fn management_errors_name_what_is_wrong() {
    let (b, _) = Bitmaps::open(SIZE, &Options::memory()).unwrap();
    b.add("x", 65536).unwrap();
    let e = b.add("x", 65536).unwrap_err();
    assert!(matches!(e, Error::Exists(ref n) if n == "x"), "{e}");
    assert!(e.to_string().contains("\"x\" already exists"), "{e}");
    let e = b.remove("nope").unwrap_err();
    assert!(e.to_string().contains("no dirty bitmap \"nope\""), "{e}");
    assert!(matches!(b.clear("nope"), Err(Error::NotFound(_))));
    assert!(matches!(b.rotate("nope", "y"), Err(Error::NotFound(_))));
    for g in [1000, 2048, 3 << 20, 128 << 20] {
        let e = b.add("g", g).unwrap_err();
        assert!(
            e.to_string().contains(&format!("bad granularity {g}")),
            "{e}"
        );
    }
    for n in ["", "a b", "tab\t", &"n".repeat(96)] {
        assert!(matches!(b.add(n, 65536), Err(Error::BadName(_))), "{n:?}");
    }
    assert!(matches!(b.rotate("x", "x"), Err(Error::Exists(_))));
    b.rotate("x", "y").unwrap();
    assert!(matches!(b.rotate("x", "z"), Err(Error::Frozen(_))));
    let mut out = Vec::new();
    let e = b
        .dirty_extents_into("gone", 0, 4096, 4, &mut out)
        .unwrap_err();
    assert!(
        matches!(e, blk::Error::NotFound { kind: "dirty bitmap", ref name } if name == "gone"),
        "{e}"
    );
}

/// Flips one byte of the sidecar at `at`.
fn flip(path: &Path, at: u64) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    let mut b = [0u8];
    f.read_exact_at(&mut b, at).unwrap();
    f.write_all_at(&[b[0] ^ 0x40], at).unwrap();
}

fn with_one_bitmap(dir: &Path) -> PathBuf {
    let img = image(dir);
    let (t, _) = tracked(&img, false).unwrap();
    t.bitmaps().add("daily", 65536).unwrap();
    write_at(&t, 0, &[1u8; 4096]).unwrap();
    img
}

#[test]
fn a_torn_page_is_refused_naming_the_sidecar_and_reset_makes_it_all_dirty() {
    let dir = tempfile::tempdir().unwrap();
    let img = with_one_bitmap(dir.path());
    let side = img.with_extension("bitmaps");
    flip(&side, 2 * 4096 + 100); // inside the first region page
    let e = tracked(&img, false).err().expect("refused");
    let msg = e.to_string();
    assert!(matches!(e, Error::Torn(..)), "{msg}");
    assert!(
        msg.contains(&side.display().to_string()) && msg.contains("--bitmaps-reset"),
        "{msg}"
    );
    let (t, notes) = tracked(&img, true).unwrap();
    assert!(
        notes
            .iter()
            .any(|n| n.contains("--bitmaps-reset") && n.contains("daily")),
        "{notes:?}"
    );
    assert_eq!(dirty_runs(&t, "daily"), [d(SIZE, true)]);
    drop(t);
    // The replacement is itself a good sidecar.
    let (t, notes) = tracked(&img, false).unwrap();
    assert!(notes.is_empty());
    assert_eq!(dirty_runs(&t, "daily"), [d(SIZE, true)]);
}

#[test]
fn one_torn_header_copy_falls_back_to_the_other_and_two_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let img = with_one_bitmap(dir.path());
    let side = img.with_extension("bitmaps");
    // The newest header (seq 2: the add) is in page 0; tearing it leaves page 1 (seq 1, no
    // bitmap): the add had not returned, as far as the disk knows.
    flip(&side, 50);
    let (t, _) = tracked(&img, false).unwrap();
    assert!(t.bitmaps().list().is_empty());
    drop(t);
    flip(&side, 4096 + 50);
    let e = tracked(&img, false).err().expect("refused");
    assert!(
        matches!(e, Error::Torn(ref p, ref w) if *p == side && w.contains("no valid header")),
        "{e}"
    );
}

#[test]
fn a_sidecar_of_another_image_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let img = with_one_bitmap(dir.path());
    let side = img.with_extension("bitmaps");
    // Another image put in the first one's place, with the old sidecar beside it.
    let other = dir.path().join("other.img");
    std::fs::File::create(&other)
        .unwrap()
        .set_len(SIZE)
        .unwrap();
    std::fs::rename(&other, &img).unwrap();
    let e = tracked(&img, false).err().expect("refused");
    assert!(matches!(e, Error::Foreign(ref p, _) if *p == side), "{e}");
    assert!(e.to_string().contains("belongs to another image"), "{e}");
    let (t, notes) = tracked(&img, true).unwrap();
    assert!(notes.iter().any(|n| n.contains("refused")), "{notes:?}");
    assert_eq!(dirty_runs(&t, "daily"), [d(SIZE, true)]);
}

#[test]
fn a_missing_sidecar_of_an_image_that_had_bitmaps_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let img = with_one_bitmap(dir.path());
    let side = img.with_extension("bitmaps");
    if cbt::identity::of_file(&img, SIZE).unwrap().marked {
        std::fs::remove_file(&side).unwrap();
        let e = tracked(&img, false).err().expect("refused");
        assert!(matches!(e, Error::Missing(ref p) if *p == side), "{e}");
        assert!(e.to_string().contains("is missing"), "{e}");
        let (t, notes) = tracked(&img, true).unwrap();
        assert!(notes.iter().any(|n| n.contains("missing")), "{notes:?}");
        assert!(t.bitmaps().list().is_empty());
    }
}

/// The bitmaps of a mirror over copies at `kept` (reading `others` too), of generations `gens`
/// (current first); the notes.
fn mirror(kept: &[&Path], others: &[&Path], gens: &[u64]) -> (Bitmaps, Vec<String>) {
    let o = Options {
        store: Store::Mirror {
            sidecars: kept.iter().map(|p| p.to_path_buf()).collect(),
            others: others.iter().map(|p| p.to_path_buf()).collect(),
            ident: cbt::Identity {
                size: SIZE,
                uuid: [7; 16],
            },
            generations: gens.to_vec(),
        },
        reset: false,
        mode: Mode::LockFree,
    };
    Bitmaps::open(SIZE, &o).unwrap()
}

/// A write of 4 KiB at `at`, counted as the device wrapper counts it.
fn count(b: &Bitmaps, at: u64) {
    let (token, r) = b.start_write(at, 4096);
    r.unwrap();
    b.end_write(token);
}

#[test]
fn the_newest_copy_is_taken_whatever_the_order_and_the_others_replaced() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (dir.path().join("a.bitmaps"), dir.path().join("b.bitmaps"));
    {
        let (bm, notes) = mirror(&[&a, &b], &[], &[1]);
        assert!(notes.is_empty(), "{notes:?}");
        bm.add("b0", 64 << 10).unwrap();
        count(&bm, MIB);
    }
    assert!(a.exists() && b.exists(), "a copy beside each");
    {
        // A run without b: its copy misses this write.
        let (bm, notes) = mirror(&[&a], &[], &[2, 1]);
        assert!(notes.is_empty(), "{notes:?}");
        count(&bm, 8 * MIB);
    }
    for order in [[&b, &a], [&a, &b]] {
        let (bm, notes) = mirror(&[order[0], order[1]], &[], &[2, 1]);
        assert!(bm.is_dirty("b0", MIB).unwrap() && bm.is_dirty("b0", 8 * MIB).unwrap());
        assert!(!bm.is_dirty("b0", 20 * MIB).unwrap());
        if order[0] == &b {
            let stale = b.display().to_string();
            assert!(
                notes
                    .iter()
                    .any(|n| n.contains(&stale) && n.contains("stale")),
                "{notes:?}"
            );
        } else {
            assert!(notes.is_empty(), "b was replaced by the newest: {notes:?}");
        }
    }
    // b alone now holds everything.
    let (bm, notes) = mirror(&[&b], &[&a], &[2, 1]);
    assert!(notes.is_empty(), "{notes:?}");
    assert!(bm.is_dirty("b0", 8 * MIB).unwrap());
}

/// A copy from the other side of a split (its generation is not one of the array's) is
/// refused even with the higher `seq`: its bits describe another history.
#[test]
fn a_copy_from_a_history_the_array_does_not_share_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (dir.path().join("a.bitmaps"), dir.path().join("b.bitmaps"));
    {
        let (bm, _) = mirror(&[&a, &b], &[], &[1]);
        bm.add("b0", 64 << 10).unwrap();
        count(&bm, MIB);
    }
    {
        // b's side ran alone (generation 9, after 1): more writes and more headers.
        let (bm, _) = mirror(&[&b], &[], &[9, 1]);
        count(&bm, 8 * MIB);
        bm.add("theirs", 64 << 10).unwrap();
    }
    // The array kept a's side (generation 2, after 1).
    let (bm, notes) = mirror(&[&a, &b], &[], &[2, 1]);
    let named = b.display().to_string();
    assert!(notes.iter().any(|n| n.contains(&named)), "{notes:?}");
    assert!(bm.is_dirty("b0", MIB).unwrap());
    assert!(
        !bm.is_dirty("b0", 8 * MIB).unwrap(),
        "b's copy was not used"
    );
    assert_eq!(bm.list().len(), 1, "{:?}", bm.list());
}

/// A torn copy beside a good one is refused by name and replaced; when every copy is torn the
/// start is refused naming one, and `reset` starts all of them over with every bit dirty.
#[test]
fn a_torn_copy_is_replaced_by_a_good_one_and_all_torn_stop_the_start() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (dir.path().join("a.bitmaps"), dir.path().join("b.bitmaps"));
    {
        let (bm, _) = mirror(&[&a, &b], &[], &[1]);
        bm.add("b0", 64 << 10).unwrap();
        count(&bm, MIB);
    }
    flip(&b, 2 * 4096 + 8);
    {
        let (bm, notes) = mirror(&[&a, &b], &[], &[1]);
        let named = b.display().to_string();
        assert!(
            notes
                .iter()
                .any(|n| n.contains(&named) && n.contains("torn")),
            "{notes:?}"
        );
        assert!(bm.is_dirty("b0", MIB).unwrap());
    }
    flip(&a, 2 * 4096 + 8);
    flip(&b, 2 * 4096 + 8);
    let o = |reset| Options {
        store: Store::Mirror {
            sidecars: vec![a.clone(), b.clone()],
            others: Vec::new(),
            ident: cbt::Identity {
                size: SIZE,
                uuid: [7; 16],
            },
            generations: vec![1],
        },
        reset,
        mode: Mode::LockFree,
    };
    let e = Bitmaps::open(SIZE, &o(false)).err().expect("refused");
    assert!(matches!(e, Error::Torn(ref p, _) if *p == a), "{e}");
    let (bm, notes) = Bitmaps::open(SIZE, &o(true)).unwrap();
    assert!(
        notes.iter().any(|n| n.contains("--bitmaps-reset")),
        "{notes:?}"
    );
    assert!(bm.is_dirty("b0", 30 * MIB).unwrap(), "every bit dirty");
    drop(bm);
    let (_, notes) = mirror(&[&b, &a], &[], &[1]);
    assert!(notes.is_empty(), "both copies rewritten: {notes:?}");
}

/// A file another user's link may point at: what a root server must never write.
fn victim(dir: &Path) -> PathBuf {
    let v = dir.join("victim");
    std::fs::write(&v, b"secret").unwrap();
    v
}

#[test]
fn a_link_planted_at_the_old_temporary_name_is_not_written_through() {
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path());
    let v = victim(dir.path());
    let side = img.with_extension("bitmaps");
    let mut planted = side.as_os_str().to_owned();
    planted.push("-new");
    std::os::unix::fs::symlink(&v, &planted).unwrap();
    let (t, _) = tracked(&img, false).unwrap();
    t.bitmaps().add("daily", 65536).unwrap();
    write_at(&t, 0, &[1u8; 4096]).unwrap();
    assert_eq!(
        std::fs::read(&v).unwrap(),
        b"secret",
        "the link's target kept"
    );
    assert!(
        std::fs::symlink_metadata(&side)
            .unwrap()
            .file_type()
            .is_file(),
        "the sidecar is a file of its own"
    );
    // A mirror's copies are written the same way.
    let a = dir.path().join("a.bitmaps");
    let mut planted = a.as_os_str().to_owned();
    planted.push("-new");
    std::os::unix::fs::symlink(&v, &planted).unwrap();
    let (bm, _) = mirror(&[&a], &[], &[1]);
    bm.add("b0", 65536).unwrap();
    count(&bm, 0);
    assert_eq!(
        std::fs::read(&v).unwrap(),
        b"secret",
        "the link's target kept"
    );
}

#[test]
fn a_sidecar_that_is_a_link_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let img = with_one_bitmap(dir.path());
    let side = img.with_extension("bitmaps");
    // A good sidecar elsewhere, linked into its place.
    let elsewhere = dir.path().join("elsewhere");
    std::fs::rename(&side, &elsewhere).unwrap();
    std::os::unix::fs::symlink(&elsewhere, &side).unwrap();
    let e = tracked(&img, false).err().expect("refused");
    assert!(
        matches!(e, Error::Io { ref path, .. } if *path == side)
            && e.to_string().contains("symbolic link"),
        "{e}"
    );
    // A mirror's copy too.
    let a = dir.path().join("a.bitmaps");
    std::os::unix::fs::symlink(&elsewhere, &a).unwrap();
    let o = Options {
        store: Store::Mirror {
            sidecars: vec![a.clone()],
            others: Vec::new(),
            ident: cbt::Identity {
                size: SIZE,
                uuid: [7; 16],
            },
            generations: vec![1],
        },
        reset: true,
        mode: Mode::LockFree,
    };
    let e = Bitmaps::open(SIZE, &o).err().expect("refused");
    assert!(e.to_string().contains("symbolic link"), "{e}");
}

#[test]
fn a_sidecar_owned_by_another_user_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let img = with_one_bitmap(dir.path());
    let side = img.with_extension("bitmaps");
    // Only root can give a file away; as another user the check cannot be set up.
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("not root: skipped");
        return;
    }
    std::os::unix::fs::chown(&side, Some(65534), Some(65534)).unwrap();
    let e = tracked(&img, false).err().expect("refused");
    assert!(
        matches!(e, Error::Io { ref path, .. } if *path == side)
            && e.to_string().contains("owned by uid 65534"),
        "{e}"
    );
}

#[test]
fn a_bitmap_too_big_for_memory_is_refused_naming_its_size() {
    let o = Options {
        store: Store::Memory,
        reset: false,
        mode: Mode::LockFree,
    };
    // 2^62 bytes at 4 KiB: 2^50 bits, twice 2^47 bytes: more than any address space.
    let (b, _) = Bitmaps::open(1 << 62, &o).unwrap();
    let e = b.add("huge", 4096).unwrap_err();
    assert!(matches!(e, Error::NoMemory { .. }), "{e}");
    assert!(
        e.to_string().contains("281474976710656 bytes of memory"),
        "{e}"
    );
    assert_eq!(e.errno(), libc::ENOMEM);
    assert!(b.list().is_empty(), "nothing added");
}

#[test]
fn a_sidecar_naming_a_bitmap_too_big_for_memory_is_refused_naming_its_size() {
    use cbt::sidecar::{encode_header, region_pages, Entry, Header, PAGE};
    let dir = tempfile::tempdir().unwrap();
    let side = dir.path().join("huge.bitmaps");
    // A remote export of 2^62 bytes whose sidecar names one bitmap at 4 KiB (made where the
    // memory was there, or by hand): its region is far more than any address space.
    let ident = cbt::Identity {
        size: 1 << 62,
        uuid: [0; 16],
    };
    let h = Header {
        seq: 2,
        generation: 0,
        ident,
        entries: vec![Entry {
            name: "huge".into(),
            shift: 12,
            frozen: false,
            region: 2,
            pages: region_pages(1 << 50),
        }],
    };
    let mut b = vec![0u8; 2 * PAGE];
    b[..PAGE].copy_from_slice(&encode_header(&h));
    std::fs::write(&side, &b).unwrap();
    let o = Options {
        store: Store::File {
            path: side.clone(),
            image: Image::Fixed(ident),
        },
        reset: false,
        mode: Mode::LockFree,
    };
    let e = Bitmaps::open(1 << 62, &o).err().expect("refused");
    assert!(e.to_string().contains("bytes of memory"), "{e}");
    assert!(e.to_string().contains(&side.display().to_string()), "{e}");
}
