//! Device spec options are validated when the device is built, with errors that name the
//! option: nothing is silently truncated (`max_io=4G` used to become 0), and a block size an
//! NBD export cannot advertise is refused.
#![cfg(not(blkq_loom))]

use blk_drivers::spec::{DeviceSpec, QueueOverrides};

fn build_err(spec: &str) -> String {
    let s: DeviceSpec = match spec.parse() {
        Ok(s) => s,
        Err(e) => return e.to_string(),
    };
    match s.build_device(&QueueOverrides::default()) {
        Ok(_) => panic!("{spec}: built, expected an error"),
        Err(e) => e.to_string(),
    }
}

fn limits(spec: &str) -> blk::Limits {
    spec.parse::<DeviceSpec>()
        .unwrap()
        .build_device(&QueueOverrides::default())
        .unwrap_or_else(|e| panic!("{spec}: {e}"))
        .limits()
}

#[test]
fn max_io_over_u32_is_refused_not_truncated() {
    for spec in [
        "null:1M,max_io=4G",
        "mem:1M,max_io=8G",
        "null:1M,max_io=4294967296",
    ] {
        let e = build_err(spec);
        assert!(e.contains("max_io"), "{spec}: {e}");
    }
    let e = build_err("null:1M,max_io=huge");
    assert!(e.contains("max_io"), "{e}");
    assert_eq!(
        limits("null:1M,max_io=4294967295").max_io_bytes,
        u32::MAX,
        "the largest u32 still fits"
    );
    assert_eq!(limits("null:1M,max_io=64K").max_io_bytes, 64 << 10);
}

#[test]
fn block_sizes_an_export_cannot_advertise_are_refused() {
    for bs in ["0", "256", "1000", "3072", "131072", "1048576", "-1", "x"] {
        let spec = format!("null:1M,block_size={bs}");
        let e = build_err(&spec);
        assert!(e.contains("block_size"), "{spec}: {e}");
    }
    for bs in [512u32, 4096, 65536] {
        let spec = format!("mem:1M,block_size={bs},max_io=1M");
        assert_eq!(limits(&spec).logical_block_size, bs, "{spec}");
    }
    // A block size over max_io cannot be transferred at all.
    let e = build_err("null:1M,block_size=8192,max_io=4K");
    assert!(e.contains("max_io"), "{e}");
    let e = build_err("null:1M,max_io=0");
    assert!(e.contains("max_io"), "{e}");
}

#[test]
fn queue_shape_options_are_bounded() {
    for (spec, opt) in [
        ("null:1M,hw_queue_depth=0", "hw_queue_depth"),
        ("null:1M,hw_queue_depth=16777216", "hw_queue_depth"),
        ("null:1M,hw_queue_depth=99999999999", "hw_queue_depth"),
        ("null:1M,submit_queues=0", "submit_queues"),
        ("null:1M,submit_queues=65535", "submit_queues"),
        ("null:1M,submit_queues=70000", "submit_queues"),
        ("null:1M,reserved_tags=4000000000", "reserved_tags"),
        ("null:1M,completion_nsec=-5", "completion_nsec"),
    ] {
        let e = build_err(spec);
        assert!(e.contains(opt), "{spec}: {e}");
    }
    let overrides = QueueOverrides {
        queue_depth: Some(1 << 20),
        ..QueueOverrides::default()
    };
    let e = "null:1M"
        .parse::<DeviceSpec>()
        .unwrap()
        .build_device(&overrides)
        .err()
        .expect("--queue-depth 1M refused")
        .to_string();
    assert!(e.contains("queue-depth"), "{e}");
}

#[test]
fn fault_options_name_the_option() {
    for (spec, opt) in [
        ("null:1M,fault.seed=-1", "fault.seed"),
        (
            "null:1M,fault.latency_us=99999999999999999999",
            "fault.latency_us",
        ),
        (
            "null:1M,fault.fail_write=0+99999999999T",
            "fault.fail_write",
        ),
        ("null:1M,fault.fail_read_prob=2", "fault.fail_read_prob"),
        ("null:1M,fault.fail_read_nth=0", "fault.fail_read_nth"),
    ] {
        let e = build_err(spec);
        assert!(e.contains(opt), "{spec}: {e}");
    }
}

/// In a build without librbd an `rbd:` spec parses, and building it says so and how to get it.
#[cfg(not(blkq_rbd))]
#[test]
fn an_rbd_spec_says_the_build_has_no_librbd_and_how_to_get_it() {
    let spec: DeviceSpec = "rbd:rbd/img,conf=/etc/ceph/ceph.conf".parse().unwrap();
    let e = spec
        .build(&QueueOverrides::default())
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(e.contains("rbd:rbd/img"), "{e}");
    assert!(
        e.contains("without librbd") && e.contains("librbd-dev"),
        "{e}"
    );
}
