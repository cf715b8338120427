//! The `null` driver reads zeroes (as block status claims), whatever the buffer held before.
#![cfg(not(blkq_loom))]

use blk::{Bio, Buffer, Op};
use blk_drivers::spec::{DeviceSpec, QueueOverrides};

fn read_dirty(spec: &str) -> Vec<u8> {
    let s: DeviceSpec = spec.parse().unwrap();
    let q = s.build(&QueueOverrides::default()).unwrap();
    let mut buf = Buffer::new(8192);
    buf.as_mut_slice().fill(0xAA);
    let (mut bio, res) = testkit::io::submit_wait(&q, Bio::with_buf(Op::Read, 8, buf));
    res.unwrap();
    bio.buf.take().unwrap().as_slice().to_vec()
}

#[test]
fn null_reads_return_zeroes_not_the_old_buffer() {
    for spec in [
        "null:16M",
        "null:16M,completion=thread",
        "null:16M,memory_backed=1",
    ] {
        let got = read_dirty(spec);
        assert!(
            got.iter().all(|&b| b == 0),
            "{spec}: read returned stale bytes"
        );
    }
}

#[test]
fn ro_in_the_spec_makes_the_device_read_only() {
    let overrides = QueueOverrides::default();
    let ro: DeviceSpec = "file:/tmp/x,ro=1".parse().unwrap();
    assert!(ro.is_read_only(&overrides));
    let ro: DeviceSpec = "file:/tmp/x,read_only=yes".parse().unwrap();
    assert!(ro.is_read_only(&overrides));
    let rw: DeviceSpec = "file:/tmp/x,ro=0".parse().unwrap();
    assert!(!rw.is_read_only(&overrides));
    let rw: DeviceSpec = "mem:1M".parse().unwrap();
    assert!(!rw.is_read_only(&overrides));
    let forced = QueueOverrides {
        read_only: true,
        ..QueueOverrides::default()
    };
    assert!(rw.is_read_only(&forced));
}
