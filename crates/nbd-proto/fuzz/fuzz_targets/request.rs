//! Feeds arbitrary bytes to the transmission decoders (compact and extended request headers,
//! simple replies, structured and extended reply chunks), through the same driver as
//! `tests/corpus.rs`. The first byte selects the mode and direction; see
//! `nbd_proto::harness::request`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = nbd_proto::harness::request(data);
});
