//! Loom models of the racy paths of changed-block tracking: a write against `rotate` (the
//! write is counted in exactly one of OLD and NEW, and if in OLD, it has ended when `rotate`
//! returns), and two first writes to one page against the group commit (each returns only
//! once a page holding its bit is on "disk", and the last page written holds both bits: a
//! later snapshot never lands before an earlier one). Runs once without loom.

use blkq_sync::atomic::{AtomicBool, Ordering};
use blkq_sync::{thread, Arc, DynArc, Mutex};
use cbt::bits::Bitmap;
use cbt::commit::Committer;
use cbt::sidecar::decode_words;
use cbt::sink::Sink;
use cbt::{Bitmaps, Mode, Options};

fn write_vs_rotate(mode: Mode) {
    let (b, _) = Bitmaps::open(
        8192,
        &Options {
            mode,
            ..Options::memory()
        },
    )
    .unwrap();
    b.add("old", 4096).unwrap();
    let b = Arc::new(b);
    let ended = Arc::new(AtomicBool::new(false));
    let w = {
        let (b, ended) = (b.clone(), ended.clone());
        thread::spawn(move || {
            let (g, r) = b.start_write(0, 4096);
            r.unwrap();
            // The device completes the write, then the completion ends its count.
            ended.store(true, Ordering::SeqCst);
            b.end_write(g);
        })
    };
    b.rotate("old", "new").unwrap();
    if b.is_dirty("old", 0).unwrap() {
        assert!(
            ended.load(Ordering::SeqCst),
            "counted in old, not ended when rotate returned"
        );
    }
    w.join().unwrap();
    let n = u8::from(b.is_dirty("old", 0).unwrap()) + u8::from(b.is_dirty("new", 0).unwrap());
    assert_eq!(n, 1, "counted in {n} bitmaps");
}

#[test]
fn loom_write_vs_rotate_lock_free() {
    blkq_sync::model_deep(|| write_vs_rotate(Mode::LockFree));
}

#[test]
fn loom_write_vs_rotate_locked() {
    blkq_sync::model_deep(|| write_vs_rotate(Mode::Locked));
}

/// Two writers counted in two shards against a publish: each reads exactly one set, and a
/// writer that read the old set has exited when `publish` returns.
fn two_shards_vs_publish() {
    use cbt::gate::Gate;
    let gate = Arc::new(Gate::new(Mode::LockFree, 1u32, 0u32));
    let ended: Vec<_> = (0..2).map(|_| Arc::new(AtomicBool::new(false))).collect();
    let saw: Vec<_> = (0..2)
        .map(|_| Arc::new(blkq_sync::atomic::AtomicU32::new(0)))
        .collect();
    let hs: Vec<_> = (0..2)
        .map(|i| {
            let (gate, ended, saw) = (gate.clone(), ended[i].clone(), saw[i].clone());
            thread::spawn(move || {
                let (t, set) = gate.enter_in(i, |s| *s);
                saw.store(set, Ordering::SeqCst);
                ended.store(true, Ordering::SeqCst);
                gate.exit(t);
            })
        })
        .collect();
    gate.publish(2);
    for i in 0..2 {
        if saw[i].load(Ordering::SeqCst) == 1 {
            assert!(
                ended[i].load(Ordering::SeqCst),
                "writer {i} read the old set, not ended"
            );
        }
    }
    for h in hs {
        h.join().unwrap();
    }
    for s in &saw {
        assert!(matches!(s.load(Ordering::SeqCst), 1 | 2));
    }
}

#[test]
fn loom_two_shards_vs_publish() {
    blkq_sync::model(two_shards_vs_publish);
}

/// A disk of one page: what was last written there.
struct Disk(Mutex<u64>);

impl Sink for Disk {
    fn write_pages(&self, _page: u64, data: &[u8]) -> std::io::Result<()> {
        *self.0.lock() = decode_words(data).next().unwrap();
        Ok(())
    }
    fn sync(&self) -> std::io::Result<()> {
        Ok(())
    }
    fn describe(&self) -> String {
        "disk".into()
    }
}

#[test]
fn loom_first_writes_vs_group_commit() {
    blkq_sync::model(|| {
        let disk = DynArc::new(Disk(Mutex::new(0)));
        let c = Arc::new(Committer::new(disk.clone()));
        let bm = Arc::new(Bitmap::new("a", 2 * 4096, 12, 0).unwrap());
        let hs: Vec<_> = [0u64, 4096]
            .into_iter()
            .map(|off| {
                let (c, bm, disk) = (c.clone(), bm.clone(), disk.clone());
                thread::spawn(move || {
                    if let Some(words) = bm.mark(off, 4096) {
                        c.persist(&bm, words, off, 4096).unwrap();
                    }
                    let bit = 1u64 << (off / 4096);
                    assert!(bm.is_durable(off, 4096));
                    assert_ne!(*disk.0.lock() & bit, 0, "acknowledged before on disk");
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
        assert_eq!(*disk.0.lock(), 0b11, "a later snapshot landed first");
    });
}
