//! One buffer for every leg of a write (`share_writes=1`, see `raid1::lend`) against the
//! copying path (`share_writes=0`): both write the same bytes to every leg, with a leg that
//! reads its buffer late, a leg failing writes, and write-behind; the caller, which scribbles
//! over its buffer the moment it gets it back, never scribbles over what a leg still writes;
//! and the legs of a shared write read the caller's bytes (one payload), except a write-behind
//! leg, which writes a copy.
// A plain threaded test, never a loom model: it may use std::sync.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]
#![cfg(not(blkq_loom))]

mod common;
use common::*;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use blk::{Bio, Buffer, Device, EndIo, Error, Op, SECTOR_SHIFT};
use blk_drivers::fault::{FaultConfig, FaultDevice, OpSet, Rule};
use raid1::{Raid1, Raid1Config};
use testkit::{wait_until_within, Forward};

const SOON: Duration = Duration::from_secs(30);

/// A leg that reads a write's buffer late: the bio reaches `inner` from another thread, after
/// `delay`.
fn late(inner: Arc<dyn Device>, delay: Duration) -> Arc<dyn Device> {
    let to = inner.clone();
    Arc::new(Forward::on_submit(inner, move |_, bio, end| {
        if bio.op != Op::Write {
            return to.submit(bio, end);
        }
        let (to, end) = (to.clone(), end.clone());
        std::thread::spawn(move || {
            std::thread::sleep(delay);
            to.submit(bio, &end);
        });
    }))
}

/// The caller: reuses its buffer the moment it gets it back (fills it with 0xEE), and counts.
#[derive(Default)]
struct Scribble {
    ok: AtomicU64,
    failed: AtomicU64,
}

impl EndIo for Scribble {
    fn end_io(&self, mut bio: Bio, res: Result<(), Error>) {
        if let Some(b) = bio.buf.as_mut() {
            b.as_mut_slice().fill(0xEE);
        }
        match res {
            Ok(()) => self.ok.fetch_add(1, Ordering::SeqCst),
            Err(_) => self.failed.fetch_add(1, Ordering::SeqCst),
        };
    }
}

/// The writes of a load: (byte offset in the array, length, pattern seed), some overlapping
/// none, lengths 4 KiB to 64 KiB.
fn load() -> Vec<(u64, usize, u8)> {
    (0..48u64)
        .map(|i| ((i * 128) << 10, ((i % 16 + 1) * 4096) as usize, i as u8))
        .collect()
}

/// Submits every write of `load()` at once (as many in flight as the array's slots allow),
/// then waits for them all; every one must succeed.
fn write_load(r: &Raid1) {
    let s = Arc::new(Scribble::default());
    let end: Arc<dyn EndIo> = s.clone();
    let all = load();
    for &(off, len, seed) in &all {
        let mut buf = Buffer::new(len);
        buf.as_mut_slice().copy_from_slice(&pattern(seed, len));
        r.submit(Bio::with_buf(Op::Write, off >> SECTOR_SHIFT, buf), &end);
    }
    wait_until_within("every write completed", SOON, || {
        s.ok.load(Ordering::SeqCst) + s.failed.load(Ordering::SeqCst) == all.len() as u64
    });
    assert_eq!(s.failed.load(Ordering::SeqCst), 0, "a write failed");
}

/// The array and each of `legs` hold every write of `load()`.
fn check(r: &Raid1, legs: &[&dyn Device], what: &str) {
    for &(off, len, seed) in &load() {
        let want = pattern(seed, len);
        assert!(read(r, off, len) == want, "{what}: the array at {off}");
        for (i, leg) in legs.iter().enumerate() {
            assert!(
                read(*leg, r.data_offset() + off, len) == want,
                "{what}: leg {i} at {off} holds other bytes"
            );
        }
    }
}

fn config(share: bool) -> Raid1Config {
    Raid1Config {
        share_writes: share,
        ..cfg()
    }
}

#[test]
fn both_modes_write_the_same_bytes_to_every_leg() {
    for share in [true, false] {
        let legs = [
            mem("16M"),
            late(mem("16M"), Duration::from_millis(2)),
            mem("16M"),
        ];
        let r = Raid1::create(legs.to_vec(), config(share)).unwrap();
        write_load(&r);
        let l: Vec<&dyn Device> = legs.iter().map(|d| d.as_ref()).collect();
        check(&r, &l, &format!("share_writes={share}"));
        assert_legs_equal(&r, legs[0].as_ref(), legs[1].as_ref());
        assert_legs_equal(&r, legs[0].as_ref(), legs[2].as_ref());
    }
}

/// A leg failing every write is failed; the others, one of them late, hold every write, in
/// both modes (a failed leg's bio comes back too, and its alias with it).
#[test]
fn a_leg_failing_writes_leaves_the_others_identical_in_both_modes() {
    for share in [true, false] {
        let f = FaultDevice::new(mem("16M"), FaultConfig::default());
        let h = f.handle();
        let legs = [
            mem("16M"),
            late(mem("16M"), Duration::from_millis(2)),
            Arc::new(f) as Arc<dyn Device>,
        ];
        let r = Raid1::create(legs.to_vec(), config(share)).unwrap();
        h.add(Rule::fail(OpSet::of(Op::Write)).in_range(r.data_offset(), 64 << 20));
        write_load(&r);
        assert!(r.leg_status(2).unwrap().faulty, "share_writes={share}");
        check(
            &r,
            &[legs[0].as_ref(), legs[1].as_ref()],
            &format!("share_writes={share}, leg 2 failing writes"),
        );
        assert_legs_equal(&r, legs[0].as_ref(), legs[1].as_ref());
    }
}

/// Data writes held while the gate is closed, submitted to the inner device when it opens.
type Held = Arc<Mutex<Option<Vec<(Bio, Arc<dyn EndIo>)>>>>;

fn gated(inner: Arc<dyn Device>, from: u64) -> (Arc<dyn Device>, Held) {
    let held: Held = Arc::new(Mutex::new(Some(Vec::new())));
    let h = held.clone();
    let dev = Forward::on_submit(inner, move |inner, bio, end| {
        if bio.op == Op::Write && bio.sector >= from {
            if let Some(v) = h.lock().unwrap().as_mut() {
                v.push((bio, end.clone()));
                return;
            }
        }
        inner.submit(bio, end)
    });
    (Arc::new(dev), held)
}

/// Write-behind: every write is acknowledged, and the caller scribbles over its buffer,
/// while the write-mostly leg holds them unread; that leg writes copies, so once it reads
/// them it holds the data all the same.
#[test]
fn a_write_behind_leg_writes_a_copy_in_both_modes() {
    let writes = &load()[..8];
    for share in [true, false] {
        let from = 8 << 11; // 8 MiB: past the array's metadata
        let a = mem("16M");
        let (slow, held) = gated(mem("16M"), from);
        let r = Raid1::create(
            vec![a.clone(), slow.clone()],
            Raid1Config {
                write_behind: 16,
                tick: Duration::from_secs(3600),
                ..config(share)
            },
        )
        .unwrap();
        r.set_write_mostly(1, true).unwrap();
        let base = (from << SECTOR_SHIFT) - r.data_offset();
        let s = Arc::new(Scribble::default());
        let end: Arc<dyn EndIo> = s.clone();
        for &(off, len, seed) in writes {
            let mut buf = Buffer::new(len);
            buf.as_mut_slice().copy_from_slice(&pattern(seed, len));
            r.submit(
                Bio::with_buf(Op::Write, (base + off) >> SECTOR_SHIFT, buf),
                &end,
            );
        }
        wait_until_within("every write acknowledged", SOON, || {
            s.ok.load(Ordering::SeqCst) == writes.len() as u64
        });
        assert_eq!(r.write_behind_outstanding(), writes.len() as u32);
        let bios = held.lock().unwrap().take().unwrap();
        assert_eq!(bios.len(), writes.len());
        for (bio, end) in bios {
            slow.submit(bio, &end);
        }
        wait_until_within("the writes behind reached the slow leg", SOON, || {
            r.write_behind_outstanding() == 0
        });
        for &(off, len, seed) in writes {
            let at = r.data_offset() + base + off;
            let want = pattern(seed, len);
            assert!(
                read(a.as_ref(), at, len) == want,
                "share_writes={share}: leg 0 at {off}"
            );
            assert!(
                read(slow.as_ref(), at, len) == want,
                "share_writes={share}: leg 1 at {off}"
            );
        }
    }
}

/// What each leg's data writes carried: (buffer address, alias).
type Seen = Arc<Mutex<Vec<(usize, bool)>>>;

fn recording(inner: Arc<dyn Device>, from: u64) -> (Arc<dyn Device>, Seen) {
    let seen: Seen = Arc::default();
    let s = seen.clone();
    let dev = Forward::on_submit(inner, move |inner, bio, end| {
        if bio.op == Op::Write && bio.sector >= from {
            if let Some(b) = &bio.buf {
                s.lock()
                    .unwrap()
                    .push((b.as_slice().as_ptr() as usize, b.is_alias()));
            }
        }
        inner.submit(bio, end)
    });
    (Arc::new(dev), seen)
}

/// One write through a two-leg array; what each leg's bio carried, and the caller's buffer
/// address.
fn one_write(cfg: Raid1Config, write_mostly: bool) -> (usize, Vec<(usize, bool)>) {
    // Data writes only: the array's own (superblocks, bitmap) are below the first data sector,
    // which `create` decides; the legs record from a sector no metadata reaches (8 MiB).
    let from = 8 << 11;
    let (a, sa) = recording(mem("16M"), from);
    let (b, sb) = recording(mem("16M"), from);
    let r = Raid1::create(vec![a, b], cfg).unwrap();
    if write_mostly {
        r.set_write_mostly(1, true).unwrap();
    }
    let off = (from << SECTOR_SHIFT) - r.data_offset();
    let mut buf = Buffer::new(8192);
    buf.as_mut_slice().copy_from_slice(&pattern(9, 8192));
    let addr = buf.as_slice().as_ptr() as usize;
    let (bio, res) = blk::submit_wait(&r, Bio::with_buf(Op::Write, off >> SECTOR_SHIFT, buf));
    res.unwrap();
    assert_eq!(bio.buf.as_ref().unwrap().as_slice().as_ptr() as usize, addr);
    assert!(
        !bio.buf.as_ref().unwrap().is_alias(),
        "the caller got an alias back"
    );
    let (sa, sb) = (sa.lock().unwrap().clone(), sb.lock().unwrap().clone());
    assert_eq!((sa.len(), sb.len()), (1, 1), "one data write per leg");
    (addr, vec![sa[0], sb[0]])
}

#[test]
fn shared_legs_read_the_callers_bytes_copy_legs_do_not() {
    let (addr, legs) = one_write(config(true), false);
    assert_eq!(
        legs,
        vec![(addr, true), (addr, true)],
        "shared: one payload"
    );

    let (addr, legs) = one_write(config(false), false);
    assert_eq!(
        legs[0],
        (addr, false),
        "copy: the caller's buffer on the primary"
    );
    assert!(
        legs[1].0 != addr && !legs[1].1,
        "copy: leg 1 writes its own copy"
    );

    // Write-behind, shared: the local leg reads the caller's bytes, the write-mostly leg a
    // copy the array owns.
    let behind = Raid1Config {
        write_behind: 4,
        tick: Duration::from_secs(3600),
        ..config(true)
    };
    let (addr, legs) = one_write(behind, true);
    assert_eq!(legs[0], (addr, true));
    assert!(
        legs[1].0 != addr && !legs[1].1,
        "the behind leg writes a copy"
    );
}

#[test]
fn share_writes_parses() {
    let mut c = Raid1Config::default();
    assert!(c.share_writes, "shared by default");
    for (v, want) in [("0", false), ("1", true), ("false", false), ("true", true)] {
        c.set_option("share_writes", v).unwrap();
        assert_eq!(c.share_writes, want, "{v}");
    }
    assert!(c.set_option("share_writes", "2").is_err());
}
