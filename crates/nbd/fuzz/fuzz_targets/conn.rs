//! Fuzzes a whole server connection: the input is everything a client sends (handshake,
//! options, requests, payloads), on a fresh connection to one long-lived server with a `mem`
//! export. The harness (`nbd::fuzzing`) fails on a server panic, a hang, a connection left
//! open, or a server that no longer serves a normal client afterwards.
#![no_main]

use std::sync::OnceLock;

use blk_drivers::spec::{DeviceSpec, QueueOverrides};
use libfuzzer_sys::fuzz_target;
use nbd::fuzzing::ConnHarness;
use nbd::server::Export;

fn harness() -> &'static ConnHarness {
    static H: OnceLock<ConnHarness> = OnceLock::new();
    H.get_or_init(|| {
        let dev = "mem:64M"
            .parse::<DeviceSpec>()
            .unwrap()
            .build_device(&QueueOverrides::default())
            .unwrap();
        ConnHarness::new(vec![Export::new("", dev)]).unwrap()
    })
}

fuzz_target!(|data: &[u8]| {
    harness().run(data);
});
