//! Write-behind (`write_behind=N`): writes are acknowledged once the local leg has them,
//! never more than N behind; a FLUSH waits for the writes behind before it to reach the slow
//! leg, then flushes it; the local leg failing while writes are behind loses nothing
//! acknowledged, and a read served by the slow leg waits for them. The slow, write-mostly
//! leg is a `Forward` whose hook holds data writes behind a gate.
// A plain threaded test, never a loom model: it may use std::sync.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]
#![cfg(not(blkq_loom))]

mod common;
use common::*;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use blk::{Bio, BioFlags, Buffer, Device, EndIo, Error, Op, SECTOR_SHIFT};
use raid1::{Raid1, Raid1Config, SyncAction};
use testkit::{wait_until_within, Collect, Forward, Hook};

const SOON: Duration = Duration::from_secs(30);
const N: u32 = 4;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ev {
    WriteDone,
    Flush { writes_done: u64 },
}

/// Data writes (at or past `data_sector`) wait while the gate is closed; counts them and
/// records completions and flushes in order.
#[derive(Default)]
struct Gate {
    data_sector: AtomicU64,
    closed: AtomicBool,
    /// Holds, even while open, the data writes whose first byte is this (until `open`).
    hold_first: Mutex<Option<u8>>,
    held: Mutex<Vec<(Bio, Arc<dyn EndIo>)>>,
    writes_done: Arc<AtomicU64>,
    events: Arc<Mutex<Vec<Ev>>>,
    /// The local leg: fail every bio while set (only used on leg 0).
    fail: AtomicBool,
    /// Bios this leg completed or received (flushes included).
    seen_writes: AtomicU64,
    seen_flushes: AtomicU64,
}

struct Count {
    writes_done: Arc<AtomicU64>,
    events: Arc<Mutex<Vec<Ev>>>,
    end: Arc<dyn EndIo>,
}

impl EndIo for Count {
    fn end_io(&self, bio: Bio, res: Result<(), Error>) {
        self.writes_done.fetch_add(1, Ordering::SeqCst);
        self.events.lock().unwrap().push(Ev::WriteDone);
        self.end.end_io(bio, res)
    }
}

impl Hook for Gate {
    fn submit(&self, inner: &dyn Device, bio: Bio, end: &Arc<dyn EndIo>) {
        if self.fail.load(Ordering::SeqCst) {
            end.end_io(bio, Err(Error::Io(std::io::Error::other("local leg lost"))));
            return;
        }
        let data = bio.sector >= self.data_sector.load(Ordering::SeqCst);
        match bio.op {
            Op::Flush => {
                self.seen_flushes.fetch_add(1, Ordering::SeqCst);
                let writes_done = self.writes_done.load(Ordering::SeqCst);
                self.events.lock().unwrap().push(Ev::Flush { writes_done });
                inner.submit(bio, end)
            }
            Op::Write if data => {
                self.seen_writes.fetch_add(1, Ordering::SeqCst);
                let e: Arc<dyn EndIo> = Arc::new(Count {
                    writes_done: self.writes_done.clone(),
                    events: self.events.clone(),
                    end: end.clone(),
                });
                let first = bio.buf.as_ref().and_then(|b| b.as_slice().first().copied());
                let hold = self.closed.load(Ordering::SeqCst)
                    || first.is_some_and(|f| *self.hold_first.lock().unwrap() == Some(f));
                if hold {
                    self.held.lock().unwrap().push((bio, e));
                } else {
                    inner.submit(bio, &e)
                }
            }
            _ => inner.submit(bio, end),
        }
    }
}

impl Gate {
    fn open(&self, inner: &dyn Device) {
        self.closed.store(false, Ordering::SeqCst);
        *self.hold_first.lock().unwrap() = None;
        let held = std::mem::take(&mut *self.held.lock().unwrap());
        for (b, e) in held {
            inner.submit(b, &e);
        }
    }
}

struct Setup {
    r: Arc<Raid1>,
    local: Arc<Forward<Gate>>,
    slow: Arc<Forward<Gate>>,
    /// The slots of `local` and `slow`.
    local_slot: usize,
    slow_slot: usize,
}

impl Drop for Setup {
    /// A test that failed with writes held still stops the array (which waits for them).
    fn drop(&mut self) {
        for f in [&self.local, &self.slow] {
            f.hook().open(f.inner().as_ref());
        }
    }
}

/// Leg 0 local, leg 1 write-mostly and slow (gated); `write_behind=N`.
fn setup() -> Setup {
    // raid1d's tick (bitmap flush epochs, which flush the legs) never comes during a test:
    // the flushes a leg sees are the array's.
    let cfg = Raid1Config {
        write_behind: N,
        tick: Duration::from_secs(3600),
        ..cfg()
    };
    setup_with(mem("16M"), mem("16M"), false, cfg)
}

/// `local` and `slow`, each behind a gate, `slow` write-mostly; `slow` in slot 1, or in slot
/// 0 when `slow_first`.
fn setup_with(
    local: Arc<dyn Device>,
    slow: Arc<dyn Device>,
    slow_first: bool,
    cfg: Raid1Config,
) -> Setup {
    let local = Arc::new(Forward::with_hook(local, Gate::default()));
    let slow = Arc::new(Forward::with_hook(slow, Gate::default()));
    let (local_slot, slow_slot) = if slow_first { (1, 0) } else { (0, 1) };
    let mut legs = vec![
        local.clone() as Arc<dyn Device>,
        slow.clone() as Arc<dyn Device>,
    ];
    if slow_first {
        legs.reverse();
    }
    let r = Raid1::create(legs, cfg).unwrap();
    r.set_write_mostly(slow_slot, true).unwrap();
    let ds = r.data_offset() >> SECTOR_SHIFT;
    // Count from here: what creating the array wrote is not what a test is about.
    for g in [local.hook(), slow.hook()] {
        g.data_sector.store(ds, Ordering::SeqCst);
        g.seen_writes.store(0, Ordering::SeqCst);
        g.seen_flushes.store(0, Ordering::SeqCst);
        g.writes_done.store(0, Ordering::SeqCst);
        g.events.lock().unwrap().clear();
    }
    Setup {
        r: Arc::new(r),
        local,
        slow,
        local_slot,
        slow_slot,
    }
}

fn write_bio(off: u64, seed: u8, fua: bool) -> Bio {
    let mut b = Bio::with_buf(Op::Write, off >> SECTOR_SHIFT, Buffer::new(4096));
    b.buf
        .as_mut()
        .unwrap()
        .as_mut_slice()
        .copy_from_slice(&pattern(seed, 4096));
    if fua {
        b.flags = BioFlags::FUA;
    }
    b
}

/// A 4 KiB write at `off` of `byte` repeated (the gate tells writes apart by first byte).
fn fill_bio(off: u64, byte: u8, fua: bool) -> Bio {
    let mut b = Bio::with_buf(Op::Write, off >> SECTOR_SHIFT, Buffer::new(4096));
    b.buf.as_mut().unwrap().as_mut_slice().fill(byte);
    if fua {
        b.flags = BioFlags::FUA;
    }
    b
}

/// The bitmap's dirty chunks.
fn dirty_chunks(r: &Raid1) -> u64 {
    let bm = r.bitmap().unwrap();
    bm.dirty_chunks().iter().map(|c| c.end - c.first).sum()
}

fn submit(r: &Raid1, b: Bio, c: &Arc<Collect>) {
    let e: Arc<dyn EndIo> = c.clone();
    r.submit(b, &e);
}

#[test]
fn writes_are_acknowledged_before_the_slow_leg_never_more_than_n_behind() {
    let s = setup();
    s.slow.hook().closed.store(true, Ordering::SeqCst);
    let acked = Arc::new(Collect::default());
    let k = u64::from(N) + 3;
    for i in 0..k {
        submit(&s.r, write_bio(i * 65536, i as u8, false), &acked);
    }
    // Every write reached both legs; the local one completed them all.
    wait_until_within("the local leg has every write", SOON, || {
        s.local.hook().seen_writes.load(Ordering::SeqCst) == k
    });
    wait_until_within("the slow leg holds every write", SOON, || {
        s.slow.hook().held.lock().unwrap().len() as u64 == k
    });
    // N acknowledged before the slow leg completed any; the rest wait for it.
    wait_until_within("N acknowledged", SOON, || acked.len() == N as usize);
    assert_eq!(s.slow.hook().writes_done.load(Ordering::SeqCst), 0);
    assert_eq!(s.r.write_behind_outstanding(), N);
    assert_eq!(s.r.leg_status(1).unwrap().write_behind, N);
    assert_eq!(s.r.leg_status(0).unwrap().write_behind, 0);
    assert_eq!(acked.len(), N as usize, "never more than N behind");
    for (_, res) in acked.take_all() {
        res.unwrap();
    }
    s.slow.hook().open(s.slow.inner().as_ref());
    let rest = acked.wait_for((k - u64::from(N)) as usize);
    assert!(rest.iter().all(|(_, r)| r.is_ok()));
    wait_until_within("nothing behind", SOON, || {
        s.r.write_behind_outstanding() == 0
    });
    for i in 0..k {
        assert_eq!(read(s.r.as_ref(), i * 65536, 4096), pattern(i as u8, 4096));
    }
    assert_legs_equal(&s.r, s.local.inner().as_ref(), s.slow.inner().as_ref());
}

#[test]
fn fua_writes_wait_for_the_slow_leg() {
    let s = setup();
    s.slow.hook().closed.store(true, Ordering::SeqCst);
    let acked = Arc::new(Collect::default());
    submit(&s.r, write_bio(0, 1, true), &acked);
    wait_until_within("the local leg has it", SOON, || {
        s.local.hook().seen_writes.load(Ordering::SeqCst) == 1
    });
    wait_until_within("the slow leg holds it", SOON, || {
        s.slow.hook().held.lock().unwrap().len() == 1
    });
    assert_eq!(
        s.r.write_behind_outstanding(),
        0,
        "a FUA write is never behind"
    );
    assert!(acked.is_empty(), "a FUA write waits for every leg");
    s.slow.hook().open(s.slow.inner().as_ref());
    acked.take()[0].1.as_ref().unwrap();
}

#[test]
fn a_flush_waits_for_the_writes_behind_before_it_then_flushes_the_slow_leg() {
    let s = setup();
    s.slow.hook().closed.store(true, Ordering::SeqCst);
    let acked = Arc::new(Collect::default());
    for i in 0..u64::from(N) {
        submit(&s.r, write_bio(i * MB, i as u8, false), &acked);
    }
    let done = acked.wait_for(N as usize);
    assert!(done.iter().all(|(_, r)| r.is_ok()));
    let local_flushes0 = s.local.hook().seen_flushes.load(Ordering::SeqCst);
    let flushed = Arc::new(Collect::default());
    submit(&s.r, Bio::new(Op::Flush, 0, 0), &flushed);
    // The local leg is flushed at once; the slow leg's flush waits for the writes.
    wait_until_within("the local leg flushed", SOON, || {
        s.local.hook().seen_flushes.load(Ordering::SeqCst) > local_flushes0
    });
    assert!(flushed.is_empty(), "the flush waits for the writes behind");
    s.slow.hook().open(s.slow.inner().as_ref());
    flushed.take()[0].1.as_ref().unwrap();
    let ev = s.slow.hook().events.lock().unwrap().clone();
    let last_flush = ev
        .iter()
        .rev()
        .find_map(|e| match e {
            Ev::Flush { writes_done } => Some(*writes_done),
            _ => None,
        })
        .unwrap();
    assert_eq!(
        last_flush,
        u64::from(N),
        "the slow leg's flush came after every earlier write completed: {ev:?}"
    );
}

#[test]
fn the_local_leg_failing_while_writes_are_behind_loses_nothing_acknowledged() {
    let s = setup();
    s.slow.hook().closed.store(true, Ordering::SeqCst);
    let acked = Arc::new(Collect::default());
    // A: acknowledged with the local leg alone.
    submit(&s.r, write_bio(MB, 0xA, false), &acked);
    acked.take()[0].1.as_ref().unwrap();
    // The local leg is lost; B fails there, so it waits for the slow leg, which decides.
    s.local.hook().fail.store(true, Ordering::SeqCst);
    let b_done = Arc::new(Collect::default());
    submit(&s.r, write_bio(2 * MB, 0xB, false), &b_done);
    wait_until_within("the local leg failed", SOON, || {
        s.r.leg_status(0).unwrap().faulty
    });
    assert!(b_done.is_empty(), "B waits for the slow leg");
    // A read of A can only go to the slow leg, where A is behind: it waits for it.
    let reader = {
        let r = s.r.clone();
        std::thread::spawn(move || read(r.as_ref(), MB, 4096))
    };
    s.slow.hook().open(s.slow.inner().as_ref());
    assert_eq!(reader.join().unwrap(), pattern(0xA, 4096));
    b_done.take()[0].1.as_ref().unwrap();
    assert_eq!(read(s.r.as_ref(), 2 * MB, 4096), pattern(0xB, 4096));
    flush(s.r.as_ref());
    // And on the slow leg itself.
    let doff = s.r.data_offset();
    assert_eq!(
        read(s.slow.inner().as_ref(), doff + MB, 4096),
        pattern(0xA, 4096)
    );
    assert_eq!(
        read(s.slow.inner().as_ref(), doff + 2 * MB, 4096),
        pattern(0xB, 4096)
    );
}

#[test]
fn write_behind_needs_a_bitmap_and_parses() {
    let mut c = Raid1Config::default();
    c.set_option("write_behind", "16").unwrap();
    assert_eq!(c.write_behind, 16);
    assert!(c.set_option("write_behind", "x").is_err());
    let e = Raid1::create(
        vec![mem("8M"), mem("8M")],
        Raid1Config {
            bitmap_chunk: 0,
            write_behind: 4,
            ..cfg()
        },
    )
    .unwrap_err();
    assert!(e.to_string().contains("bitmap"), "{e}");
}

#[test]
fn a_chunks_bit_stays_set_until_the_slow_leg_has_the_write() {
    let local = Arc::new(Forward::with_hook(mem("16M"), Gate::default()));
    let slow = Arc::new(Forward::with_hook(mem("16M"), Gate::default()));
    // Bits clear 10 ms after their chunk's last write ends; raid1d looks every 20 ms, and
    // flushes every leg before each look.
    let r = Raid1::create(
        vec![
            local.clone() as Arc<dyn Device>,
            slow.clone() as Arc<dyn Device>,
        ],
        Raid1Config {
            write_behind: N,
            bitmap_quiet: Duration::from_millis(10),
            ..cfg()
        },
    )
    .unwrap();
    r.set_write_mostly(1, true).unwrap();
    slow.hook()
        .data_sector
        .store(r.data_offset() >> SECTOR_SHIFT, Ordering::SeqCst);
    slow.hook().closed.store(true, Ordering::SeqCst);
    let acked = Arc::new(Collect::default());
    submit(&r, write_bio(3 * MB, 3, false), &acked);
    acked.take()[0].1.as_ref().unwrap();
    // Several of raid1d's looks later (each flushes the slow leg first), still set.
    let f0 = slow.hook().seen_flushes.load(Ordering::SeqCst);
    wait_until_within("three more looks", SOON, || {
        slow.hook().seen_flushes.load(Ordering::SeqCst) >= f0 + 3
    });
    assert_eq!(
        dirty_chunks(&r),
        1,
        "the bit of a chunk with a write behind stays set"
    );
    slow.hook().open(slow.inner().as_ref());
    wait_until_within("the bit cleared once the slow leg has it", SOON, || {
        dirty_chunks(&r) == 0
    });
}

#[test]
fn leg_status_reports_each_legs_round_trip() {
    use blk_drivers::fault::{FaultConfig, FaultDevice, OpSet, Rule};
    let slow = FaultDevice::new(mem("16M"), FaultConfig::default());
    let h = slow.handle();
    let r = Raid1::create(vec![mem("16M"), Arc::new(slow) as Arc<dyn Device>], cfg()).unwrap();
    assert_eq!(r.leg_status(1).unwrap().rtt_ns, 0, "no sample yet");
    // Every data write to leg 1 takes 30 ms; leg 0 answers at once.
    h.add(Rule::delay(
        OpSet::WRITE,
        Duration::from_millis(30),
        Duration::ZERO,
    ));
    for i in 0..6u64 {
        write(&r, i * 65536, &pattern(i as u8, 4096));
    }
    let (fast, slow) = (r.leg_status(0).unwrap(), r.leg_status(1).unwrap());
    // The coarse clock is 1-4 ms: far below the 30 ms a round trip takes.
    assert!(slow.rtt_ns >= 20_000_000, "{slow:?}");
    assert!(
        fast.rtt_ns > 0 && fast.rtt_ns < slow.rtt_ns,
        "{fast:?} {slow:?}"
    );
}

/// Bits clear 10 ms after their chunk's last write ends; raid1d looks every 20 ms, and
/// flushes every leg before each look.
fn quiet_cfg() -> Raid1Config {
    Raid1Config {
        write_behind: N,
        bitmap_quiet: Duration::from_millis(10),
        ..cfg()
    }
}

/// Writes 0xa5 then 0xb6 at offset 0 while the write-mostly leg holds the 0xa5 copy back:
/// both are acknowledged by the other leg, the second goes to the write-mostly leg only
/// after the first completed there, so that leg ends with 0xb6 too; the chunk's bit stays
/// set until then, and the write-mostly leg alone serves 0xb6.
fn overlapping_writes_land_in_order(s: &Setup) {
    let (r, slow) = (s.r.as_ref(), s.slow.hook());
    *slow.hold_first.lock().unwrap() = Some(0xa5);
    let acked = Arc::new(Collect::default());
    submit(r, fill_bio(0, 0xa5, false), &acked);
    acked.take()[0].1.as_ref().unwrap();
    submit(r, fill_bio(0, 0xb6, false), &acked);
    acked.take()[0].1.as_ref().unwrap();
    // Both behind, the second not sent to the write-mostly leg yet (asserted at the end,
    // after what the order decides).
    let behind = r.write_behind_outstanding();
    let sent = slow.seen_writes.load(Ordering::SeqCst);
    let flushed = Arc::new(Collect::default());
    submit(r, Bio::new(Op::Flush, 0, 0), &flushed);
    // Several of raid1d's looks later (each flushes the legs first), the flush still waits
    // and the chunk's bit is still set.
    let f0 = slow.seen_flushes.load(Ordering::SeqCst);
    wait_until_within("three more looks", SOON, || {
        slow.seen_flushes.load(Ordering::SeqCst) >= f0 + 3
    });
    assert!(flushed.is_empty(), "the flush waits for the writes behind");
    assert_eq!(dirty_chunks(r), 1, "the chunk's bit stays set");
    assert_eq!(slow.held.lock().unwrap().len(), 1);
    slow.open(s.slow.inner().as_ref());
    flushed.take()[0].1.as_ref().unwrap();
    assert_eq!(r.write_behind_outstanding(), 0);
    r.set_sync_action(SyncAction::Check).unwrap();
    assert!(r.wait_sync_idle(SOON));
    assert_eq!(r.sync_progress().mismatch_cnt, 0, "the legs agree");
    let doff = r.data_offset();
    for (what, leg) in [("other", &s.local), ("write-mostly", &s.slow)] {
        assert!(
            read(leg.inner().as_ref(), doff, 4096) == vec![0xb6; 4096],
            "the {what} leg holds the second write"
        );
    }
    wait_until_within("the bit cleared", SOON, || dirty_chunks(r) == 0);
    r.fail_leg(s.local_slot).unwrap();
    assert!(
        read(r, 0, 4096) == vec![0xb6; 4096],
        "the write-mostly leg alone serves the second write"
    );
    assert_eq!(behind, 2, "both writes were behind");
    assert_eq!(
        sent, 1,
        "the second write waited for the first on the write-mostly leg"
    );
}

#[test]
fn overlapping_writes_reach_the_write_mostly_leg_in_order() {
    let s = setup_with(mem("16M"), mem("16M"), false, quiet_cfg());
    overlapping_writes_land_in_order(&s);
}

#[test]
fn overlapping_writes_reach_a_local_file_write_mostly_leg_in_order() {
    // A local file as the write-mostly leg, in the first slot, the other leg in memory.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("leg.img");
    std::fs::File::create(&path)
        .unwrap()
        .set_len(16 * MB)
        .unwrap();
    let file = spec(&format!("file:{}", path.display()));
    let s = setup_with(mem("16M"), file, true, quiet_cfg());
    assert_eq!(s.slow_slot, 0);
    overlapping_writes_land_in_order(&s);
}

#[test]
fn a_fua_write_over_a_write_behind_reaches_the_write_mostly_leg_after_it() {
    let s = setup();
    let slow = s.slow.hook();
    *slow.hold_first.lock().unwrap() = Some(0xa5);
    let acked = Arc::new(Collect::default());
    submit(&s.r, fill_bio(0, 0xa5, false), &acked);
    acked.take()[0].1.as_ref().unwrap();
    // A FUA write is never behind: it waits for the write-mostly leg, which gets it only
    // after the write behind it overlaps.
    let fua = Arc::new(Collect::default());
    submit(&s.r, fill_bio(0, 0xb6, true), &fua);
    assert_eq!(s.local.hook().seen_writes.load(Ordering::SeqCst), 2);
    assert_eq!(
        slow.seen_writes.load(Ordering::SeqCst),
        1,
        "the FUA write waits for the write behind on the write-mostly leg"
    );
    assert!(fua.is_empty());
    slow.open(s.slow.inner().as_ref());
    fua.take()[0].1.as_ref().unwrap();
    assert!(read(s.slow.inner().as_ref(), s.r.data_offset(), 4096) == vec![0xb6; 4096]);
    assert_legs_equal(&s.r, s.local.inner().as_ref(), s.slow.inner().as_ref());
}

#[test]
fn writes_that_do_not_overlap_a_write_behind_are_not_held_back_by_it() {
    let s = setup();
    let slow = s.slow.hook();
    *slow.hold_first.lock().unwrap() = Some(0xa5);
    let acked = Arc::new(Collect::default());
    submit(&s.r, fill_bio(0, 0xa5, false), &acked);
    acked.take()[0].1.as_ref().unwrap();
    // Right after it in the same chunk, and elsewhere (FUA: acknowledged only once the
    // write-mostly leg has it): both complete on the write-mostly leg while the first is
    // still held there.
    submit(&s.r, fill_bio(4096, 0xb6, false), &acked);
    submit(&s.r, fill_bio(3 * MB, 0xc7, true), &acked);
    let done = acked.wait_for(2);
    assert!(done.iter().all(|(_, r)| r.is_ok()));
    wait_until_within("both completed on the write-mostly leg", SOON, || {
        slow.writes_done.load(Ordering::SeqCst) == 2
    });
    assert_eq!(
        slow.held.lock().unwrap().len(),
        1,
        "the first is still held"
    );
    assert_eq!(s.r.write_behind_outstanding(), 1);
    slow.open(s.slow.inner().as_ref());
    wait_until_within("nothing behind", SOON, || {
        s.r.write_behind_outstanding() == 0
    });
    let doff = s.r.data_offset();
    for (off, byte) in [(0, 0xa5), (4096, 0xb6), (3 * MB, 0xc7)] {
        assert!(read(s.slow.inner().as_ref(), doff + off, 4096) == vec![byte; 4096]);
    }
    assert_legs_equal(&s.r, s.local.inner().as_ref(), s.slow.inner().as_ref());
}
