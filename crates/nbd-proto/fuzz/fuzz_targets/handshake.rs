//! Feeds arbitrary bytes to the handshake decoders (client flags, options and their data,
//! greeting, option replies, the `NBD_OPT_EXPORT_NAME` reply), through the same driver as
//! `tests/corpus.rs`. The first byte selects the side; see `nbd_proto::harness::handshake`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = nbd_proto::harness::handshake(data);
});
