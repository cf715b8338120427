//! `rotate` raced with writes: every write is counted in exactly one bitmap of the chain of
//! rotations (never none, never two), and when `rotate OLD NEW` returns, every write counted
//! in OLD has completed on the device (so a backup reading OLD's runs, then the data, misses
//! nothing). The device completes writes late, on a thread of its own, so that writes are in
//! flight across every rotation. Both gate modes.

use std::sync::mpsc;
use std::time::Duration;

use blk::{Bio, Device, EndIo, Error, Extent, Limits, Op};
use blkq_sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use blkq_sync::DynArc as Arc;
use blkq_sync::Mutex;
use cbt::{Bitmaps, Mode, Options, Tracked};
use testkit::io::write_at;

const BLOCK: u64 = 4096;
const BLOCKS: usize = 4096;

/// Completes bios late, on its own thread, after recording that their block is written.
struct Late {
    tx: Mutex<mpsc::Sender<(Bio, Arc<dyn EndIo>)>>,
}

fn late(written: Arc<Vec<AtomicBool>>) -> Late {
    let (tx, rx) = mpsc::channel::<(Bio, Arc<dyn EndIo>)>();
    std::thread::spawn(move || {
        let mut n = 0u32;
        for (bio, end) in rx {
            n = n.wrapping_add(1);
            if n.is_multiple_of(7) {
                std::thread::sleep(Duration::from_micros(200));
            }
            if bio.op == Op::Write {
                written[(bio.offset() / BLOCK) as usize].store(true, Ordering::SeqCst);
            }
            end.end_io(bio, Ok(()));
        }
    });
    Late { tx: Mutex::new(tx) }
}

impl Device for Late {
    fn submit(&self, bio: Bio, end: &Arc<dyn EndIo>) {
        self.tx.lock().send((bio, end.clone())).unwrap();
    }
    fn limits(&self) -> Limits {
        Limits {
            capacity: BLOCK * BLOCKS as u64,
            logical_block_size: 512,
            max_io_bytes: 1 << 20,
        }
    }
    fn extents_into(&self, _: u64, _: u64, _: usize, out: &mut Vec<Extent>) -> Result<(), Error> {
        out.clear();
        Ok(())
    }
}

fn race(mode: Mode) {
    let written: Arc<Vec<AtomicBool>> =
        Arc::new((0..BLOCKS).map(|_| AtomicBool::new(false)).collect());
    let (b, _) = Bitmaps::open(
        BLOCK * BLOCKS as u64,
        &Options {
            mode,
            ..Options::memory()
        },
    )
    .unwrap();
    b.add("r0", BLOCK).unwrap();
    let t = Arc::new(Tracked::new(Arc::new(late(written.clone())), b));
    let next = Arc::new(AtomicUsize::new(0));
    let writers: Vec<_> = (0..4)
        .map(|_| {
            let (t, next) = (t.clone(), next.clone());
            std::thread::spawn(move || loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= BLOCKS {
                    break;
                }
                // Some writes are discards or zeroes: they count the same.
                let op = [Op::Write, Op::Write, Op::Discard, Op::WriteZeroes][i % 4];
                if op == Op::Write {
                    write_at(t.as_ref(), i as u64 * BLOCK, &[1u8; 4096]).unwrap();
                } else {
                    let bio = Bio::new(op, i as u64 * BLOCK / 512, BLOCK as u32);
                    testkit::io::submit_wait(t.as_ref(), bio).1.unwrap();
                }
            })
        })
        .collect();
    // How many bitmaps of the chain count each block: each frozen one is read (as a backup
    // would) then removed.
    let mut counted = vec![0u32; BLOCKS];
    let mut r = 0;
    while next.load(Ordering::Relaxed) < BLOCKS || r < 3 {
        let (old, new) = (format!("r{r}"), format!("r{}", r + 1));
        t.bitmaps().rotate(&old, &new).unwrap();
        // Every write OLD counts has completed (the device recorded its block first). Writes
        // of discards/zeroes carry no flag: only writes are checked here.
        for (i, c) in counted.iter_mut().enumerate() {
            if t.bitmaps().is_dirty(&old, i as u64 * BLOCK).unwrap() {
                *c += 1;
                assert!(
                    !i.is_multiple_of(4) || written[i].load(Ordering::SeqCst),
                    "{mode:?}: block {i} counted in {old} but not complete when rotate returned"
                );
            }
        }
        t.bitmaps().remove(&old).unwrap();
        r += 1;
        std::thread::sleep(Duration::from_micros(300));
    }
    for w in writers {
        w.join().unwrap();
    }
    let last = format!("r{r}");
    for (i, c) in counted.iter().enumerate() {
        let n = c + u32::from(t.bitmaps().is_dirty(&last, i as u64 * BLOCK).unwrap());
        assert_eq!(
            n, 1,
            "{mode:?}: block {i} is counted in {n} bitmaps of r0..={last}"
        );
    }
    assert!(r >= 3, "{r} rotations");
}

#[test]
fn rotate_partitions_writes_lock_free() {
    race(Mode::LockFree);
}

#[test]
fn rotate_partitions_writes_locked() {
    race(Mode::Locked);
}
