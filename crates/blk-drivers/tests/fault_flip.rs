//! The fault device's flip rules over a `mem` device: silent corruption of one bit, in the
//! data a read returns (the stored data intact) or in the data a write stores (the
//! submitter's buffer intact), aimed at a byte by the rule's range or chosen from the seed;
//! by count and probability; never on flushes, discards or write-zeroes; with the volatile
//! cache like any other write; and their spec options.
// A plain threaded test, never a loom model: its own harness may use std::sync.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]
#![cfg(not(blkq_loom))]

use std::sync::Arc;

use blk::{Bio, BioFlags, Buffer, Device, Error, Op};
use blk_drivers::fault::{Action, FaultConfig, FaultDevice, FaultHandle, OpSet, Rule, When};
use blk_drivers::spec::{DeviceSpec, QueueOverrides};
use testkit::io::{flush, read_at, submit_wait, write_at};
use testkit::pattern;

const K4: u64 = 4096;

fn mem(size: &str) -> Arc<dyn Device> {
    format!("mem:{size}")
        .parse::<DeviceSpec>()
        .unwrap()
        .build_device(&QueueOverrides::default())
        .unwrap()
}

/// The fault device, the `mem` device under it, and its handle.
fn fault(cfg: FaultConfig) -> (Arc<dyn Device>, Arc<dyn Device>, FaultHandle) {
    let inner = mem("4M");
    let f = FaultDevice::new(inner.clone(), cfg);
    let h = f.handle();
    (Arc::new(f), inner, h)
}

fn cfg(s: &str) -> FaultConfig {
    s.parse().unwrap()
}

/// The bytes where `a` and `b` differ, with the bits that differ there.
fn diff(a: &[u8], b: &[u8]) -> Vec<(usize, u8)> {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .enumerate()
        .filter(|(_, (x, y))| x != y)
        .map(|(i, (x, y))| (i, x ^ y))
        .collect()
}

/// The byte of the one bit where `a` and `b` differ; fails unless exactly one bit does.
fn one_bit(a: &[u8], b: &[u8]) -> usize {
    let d = diff(a, b);
    assert_eq!(d.len(), 1, "differing bytes (index, xor): {d:?}");
    assert_eq!(
        d[0].1.count_ones(),
        1,
        "more than one bit at byte {}",
        d[0].0
    );
    d[0].0
}

fn flipped(h: &FaultHandle) -> (u64, u64) {
    let c = h.counters();
    (c.flipped[0], c.flipped[1])
}

#[test]
fn a_flipped_read_returns_one_bit_off_at_the_aimed_byte_and_the_stored_data_stays() {
    let (dev, inner, h) = fault(FaultConfig::default());
    let data = pattern(1, 4 * K4 as usize);
    write_at(&*inner, 8 * K4, &data).unwrap();
    let id = h.add(Rule::flip(OpSet::READ).in_range(8 * K4 + 1234, 1));

    let got = read_at(&*dev, 8 * K4, data.len()).unwrap();
    assert_eq!(one_bit(&got, &data), 1234);
    // A read the range does not reach is untouched.
    assert_eq!(
        read_at(&*dev, 0, K4 as usize).unwrap(),
        vec![0; K4 as usize]
    );
    // A read that starts inside the range: its first byte.
    assert_eq!(
        one_bit(
            &read_at(&*dev, 8 * K4 + 1024, 512).unwrap(),
            &data[1024..1536]
        ),
        1234 - 1024
    );
    // Nothing was written: the stored data is intact, underneath and through the device.
    assert_eq!(read_at(&*inner, 8 * K4, data.len()).unwrap(), data);
    assert!(h.remove(id));
    assert_eq!(read_at(&*dev, 8 * K4, data.len()).unwrap(), data);
    assert_eq!(flipped(&h), (2, 0));
    // A range that begins before the I/O flips the I/O's first byte.
    h.add(Rule::flip(OpSet::READ).in_range(7 * K4, K4 + 10));
    assert_eq!(
        one_bit(
            &read_at(&*dev, 8 * K4, K4 as usize).unwrap(),
            &data[..K4 as usize]
        ),
        0
    );
    // Writes pass a read flip rule unchanged.
    write_at(&*dev, 8 * K4, &data).unwrap();
    assert_eq!(read_at(&*inner, 8 * K4, data.len()).unwrap(), data);
    assert_eq!(flipped(&h), (3, 0));
}

#[test]
fn a_flipped_write_stores_one_bit_off_and_leaves_the_submitters_buffer() {
    let (dev, inner, h) = fault(FaultConfig::default());
    h.add(Rule::flip(OpSet::WRITE).in_range(2 * K4 + 77, 1));
    let data = pattern(2, 2 * K4 as usize);
    let mut buf = Buffer::new(data.len());
    buf.as_mut_slice().copy_from_slice(&data);
    let ptr = buf.as_slice().as_ptr();
    let (bio, res) = submit_wait(&*dev, Bio::with_buf(Op::Write, (2 * K4) >> 9, buf));
    res.unwrap();
    // The submitter gets its own buffer back, unchanged.
    let back = bio.buf.expect("the write's buffer");
    assert_eq!(back.as_slice().as_ptr(), ptr, "not the submitter's buffer");
    assert_eq!(back.as_slice(), &data[..]);
    // The medium holds the data with one bit flipped, at the aimed byte.
    let stored = read_at(&*inner, 2 * K4, data.len()).unwrap();
    assert_eq!(one_bit(&stored, &data), 77);
    assert_eq!(read_at(&*dev, 2 * K4, data.len()).unwrap(), stored);
    assert_eq!(flipped(&h), (0, 1));
    // A write the range does not reach is stored as it is.
    write_at(&*dev, 0, &data).unwrap();
    assert_eq!(read_at(&*inner, 0, data.len()).unwrap(), data);
    assert_eq!(flipped(&h), (0, 1));
}

/// The byte (in the I/O) and bit of the flip in each of a series of reads of zeros, through a
/// device seeded `seed` that flips every read at random.
fn random_flips(seed: u64) -> Vec<(usize, u8)> {
    let (dev, _, h) = fault(cfg(&format!("seed={seed},flip_read=all")));
    let mut out = Vec::new();
    for i in 0..24u64 {
        let len = 512 * (1 + (i % 8) as u32);
        // A buffer longer than the I/O: the flip stays inside the I/O's `len` bytes.
        let mut b = Bio::with_buf(Op::Read, i * 16, Buffer::new(2 * len as usize));
        b.len = len;
        let (b, r) = submit_wait(&*dev, b);
        r.unwrap();
        let got = b.buf.unwrap();
        let d = diff(got.as_slice(), &vec![0; got.len()]);
        assert_eq!(d.len(), 1, "read {i}: {d:?}");
        assert_eq!(d[0].1.count_ones(), 1, "read {i}: {d:?}");
        assert!(d[0].0 < len as usize, "read {i}: byte {} of {len}", d[0].0);
        out.push(d[0]);
    }
    assert_eq!(flipped(&h), (24, 0));
    out
}

#[test]
fn random_flips_replay_from_the_seed_and_stay_in_the_io() {
    let a = random_flips(11);
    assert_eq!(random_flips(11), a, "same seed, same flips");
    assert_ne!(random_flips(12), a, "another seed, other flips");
    // Spread over bytes and bits, not one fixed place.
    let bytes: std::collections::BTreeSet<_> = a.iter().map(|f| f.0).collect();
    let bits: std::collections::BTreeSet<_> = a.iter().map(|f| f.1).collect();
    assert!(bytes.len() > 12, "bytes {bytes:?}");
    assert!(bits.len() > 4, "bits {bits:?}");
}

#[test]
fn flips_by_count_and_probability() {
    let (dev, inner, h) = fault(FaultConfig::default());
    let data = pattern(3, K4 as usize);
    // Only the 3rd write.
    h.add(Rule::flip(OpSet::WRITE).nth(3));
    for i in 0..5 {
        write_at(&*dev, i * K4, &data).unwrap();
    }
    for i in 0..5 {
        let stored = read_at(&*inner, i * K4, data.len()).unwrap();
        if i == 2 {
            one_bit(&stored, &data);
        } else {
            assert_eq!(stored, data, "write {}", i + 1);
        }
    }
    h.clear();
    // Reads after the first 2, for the next... : `after` and `next`.
    h.add(Rule::flip(OpSet::READ).after(2));
    let flips: Vec<bool> = (0..5)
        .map(|_| read_at(&*dev, 0, data.len()).unwrap() != data)
        .collect();
    assert_eq!(flips, [false, false, true, true, true]);
    h.clear();
    h.add(Rule::flip(OpSet::READ).next(2));
    let flips: Vec<bool> = (0..4)
        .map(|_| read_at(&*dev, 0, data.len()).unwrap() != data)
        .collect();
    assert_eq!(flips, [true, true, false, false]);
    assert_eq!(flipped(&h), (5, 1));
    h.clear();

    // About half of the reads with p = 0.5, the same ones for the same seed.
    let run = |seed: u64| -> Vec<bool> {
        let (dev, inner, h) = fault(cfg(&format!("seed={seed},flip_read_prob=0.5")));
        write_at(&*inner, 0, &data).unwrap();
        let v: Vec<bool> = (0..200)
            .map(|_| read_at(&*dev, 0, data.len()).unwrap() != data)
            .collect();
        let n = v.iter().filter(|&&f| f).count() as u64;
        assert_eq!(flipped(&h), (n, 0));
        v
    };
    let a = run(5);
    let n = a.iter().filter(|&&f| f).count();
    assert!((60..=140).contains(&n), "{n} of 200 flipped");
    assert_eq!(run(5), a);
    assert_ne!(run(6), a);
}

#[test]
fn flushes_discards_and_write_zeroes_never_flip_nor_count() {
    let (dev, inner, h) = fault(FaultConfig::default());
    let data = pattern(4, K4 as usize);
    write_at(&*inner, 0, &data).unwrap();
    let r = Rule::flip(OpSet::ALL).nth(1);
    assert_eq!(r.ops, OpSet::READ | OpSet::WRITE);
    // A rule built by hand with every op: flushes and discards still do not match.
    h.add(Rule {
        ops: OpSet::ALL,
        ..r
    });
    flush(&*dev).unwrap();
    submit_wait(&*dev, Bio::new(Op::WriteZeroes, 8, 4096))
        .1
        .unwrap();
    submit_wait(&*dev, Bio::new(Op::Discard, 16, 4096))
        .1
        .unwrap();
    assert_eq!(
        read_at(&*inner, K4, 2 * K4 as usize).unwrap(),
        vec![0; 2 * K4 as usize]
    );
    assert_eq!(flipped(&h), (0, 0));
    // The first read is the rule's first match.
    one_bit(&read_at(&*dev, 0, data.len()).unwrap(), &data);
    assert_eq!(read_at(&*dev, 0, data.len()).unwrap(), data);
    assert_eq!(flipped(&h), (1, 0));
}

#[test]
fn a_failing_rule_wins_and_a_failed_read_is_not_flipped() {
    let (dev, inner, h) = fault(FaultConfig::default());
    let data = pattern(5, K4 as usize);
    write_at(&*inner, 0, &data).unwrap();
    h.add(Rule::fail(OpSet::ALL).nth(1));
    h.add(Rule::flip(OpSet::ALL));
    // Neither forwarded nor counted as flipped.
    let r: Result<(), Error> = write_at(&*dev, 0, &pattern(6, K4 as usize));
    assert_eq!(r.expect_err("failed by the rule").errno(), libc::EIO);
    assert_eq!(read_at(&*inner, 0, data.len()).unwrap(), data);
    assert_eq!(flipped(&h), (0, 0));
    one_bit(&read_at(&*dev, 0, data.len()).unwrap(), &data);
    assert_eq!(flipped(&h), (1, 0));
}

#[test]
fn a_flipped_write_is_rolled_back_by_a_crash_and_a_durable_one_stays_flipped() {
    let (dev, inner, h) = fault(cfg("volatile_cache=on"));
    let d = &*dev;
    let base = pattern(7, 8 * K4 as usize);
    write_at(d, 0, &base).unwrap();
    flush(d).unwrap();
    // An unflushed flipped write: stored flipped, rolled back by the crash.
    let a = pattern(8, K4 as usize);
    let id = h.add(Rule::flip(OpSet::WRITE).in_range(100, 1));
    write_at(d, 0, &a).unwrap();
    assert_eq!(one_bit(&read_at(&*inner, 0, a.len()).unwrap(), &a), 100);
    assert_eq!(h.unflushed_writes(), 1);
    h.remove(id);
    // An unflushed plain write, then a FUA flipped write over part of it: the FUA write is
    // durable as stored, its flipped bit included.
    let b = pattern(9, 4 * K4 as usize);
    write_at(d, 4 * K4, &b).unwrap();
    h.add(Rule::flip(OpSet::WRITE).in_range(5 * K4 + 9, 1));
    let c = pattern(10, K4 as usize);
    let mut buf = Buffer::new(c.len());
    buf.as_mut_slice().copy_from_slice(&c);
    let mut w = Bio::with_buf(Op::Write, (5 * K4) >> 9, buf);
    w.flags = BioFlags::FUA;
    submit_wait(d, w).1.unwrap();
    let fua = read_at(&*inner, 5 * K4, c.len()).unwrap();
    assert_eq!(one_bit(&fua, &c), 9);
    assert_eq!(flipped(&h), (0, 2));

    let rep = h.crash().unwrap();
    assert_eq!(rep.writes_lost, 2);
    h.restart();
    let after = read_at(&*inner, 0, base.len()).unwrap();
    let k = K4 as usize;
    let mut want = base.clone();
    want[5 * k..6 * k].copy_from_slice(&fua);
    // Rolled back to the flushed data, but the durable write as it was stored.
    assert_eq!(diff(&after, &want), [], "bytes that differ (index, xor)");
}

#[test]
fn flip_options_parse_and_errors_name_the_option() {
    let c = cfg("seed=3,flip_read=4K+1,flip_write_prob=0.25,flip_any_nth=2,flip_write_next=3,flip_read_after=4");
    assert_eq!(c.seed, 3);
    assert_eq!(c.rules.len(), 5);
    assert!(c.rules.iter().all(|r| r.action == Action::Flip));
    assert_eq!(c.rules[0].ops, OpSet::READ);
    assert_eq!(c.rules[0].range, Some((4096, 1)));
    assert_eq!(c.rules[0].when, When::Always);
    assert_eq!(c.rules[1].ops, OpSet::WRITE);
    assert_eq!(c.rules[1].when, When::Prob(0.25));
    assert_eq!(c.rules[2].ops, OpSet::READ | OpSet::WRITE);
    assert_eq!(c.rules[2], Rule::flip(OpSet::ALL).nth(2));
    assert_eq!(c.rules[3], Rule::flip(OpSet::WRITE).next(3));
    assert_eq!(c.rules[4], Rule::flip(OpSet::READ).after(4));
    assert_eq!(cfg("flip_write=all").rules, [Rule::flip(OpSet::WRITE)]);
    for (s, key) in [
        ("flip_flush=all", "flip_flush"),
        ("flip_discard_nth=1", "flip_discard_nth"),
        ("flip_bogus=all", "flip_bogus"),
        ("flip_read=12", "flip_read"),
        ("flip_write=1Q+4K", "flip_write"),
        ("flip_read_prob=2", "flip_read_prob"),
        ("flip_write_prob=x", "flip_write_prob"),
        ("flip_read_nth=0", "flip_read_nth"),
        ("flip_write_often=3", "flip_write_often"),
    ] {
        let e = FaultConfig::parse(s).expect_err(s).to_string();
        assert!(e.contains(&format!("{key:?}")), "{s}: {e}");
    }
}

/// `fault.flip_*` options of a device spec flip.
#[test]
fn spec_flip_options_flip() {
    let spec: DeviceSpec = "mem:1M,fault.seed=1,fault.flip_read=4K+1".parse().unwrap();
    let dev = spec.build_device(&QueueOverrides::default()).unwrap();
    let data = pattern(11, 2 * K4 as usize);
    write_at(&*dev, 0, &data).unwrap();
    assert_eq!(
        one_bit(&read_at(&*dev, 0, data.len()).unwrap(), &data),
        4096
    );
}
