//! A parallel, verified load on a device: `threads` threads each submit `per` writes of
//! `len` bytes at once (distinct offsets, a pattern per write), wait for them, then optionally
//! flush, then read everything back the same way and check it.

use blk::{Bio, Buffer, Device, Op, PendingBio, SECTOR_SHIFT};
use testkit::{fill_pattern, pattern};

/// Runs the load on `dev` (see the module docs); `flush` between the writes and the reads.
pub fn parallel_writes_then_reads(
    dev: &(dyn Device + Sync),
    threads: u64,
    per: u64,
    len: usize,
    flush: bool,
) {
    let run = |write: bool| {
        std::thread::scope(|s| {
            for t in 0..threads {
                s.spawn(move || {
                    let pending: Vec<_> = (0..per)
                        .map(|k| {
                            let n = t * per + k;
                            let sector = (n * len as u64) >> SECTOR_SHIFT;
                            let mut buf = Buffer::new(len);
                            let op = if write {
                                fill_pattern(n, buf.as_mut_slice());
                                Op::Write
                            } else {
                                Op::Read
                            };
                            (n, PendingBio::submit(dev, Bio::with_buf(op, sector, buf)))
                        })
                        .collect();
                    for (n, p) in pending {
                        let (bio, r) = p.wait();
                        r.unwrap();
                        if !write {
                            assert!(
                                bio.buf.unwrap().as_slice() == &pattern(n, len)[..],
                                "write {n} does not read back"
                            );
                        }
                    }
                });
            }
        });
    };
    run(true);
    if flush {
        testkit::io::flush(dev).unwrap();
    }
    run(false);
}
