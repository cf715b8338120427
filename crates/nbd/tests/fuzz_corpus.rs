//! Replays the corpus of the whole-connection fuzz target (`crates/nbd/fuzz`, target `conn`)
//! under plain `cargo test`: every input on a fresh connection to one server with a `mem`
//! export; after each, the server must have closed the connection and still serve a normal
//! client (see `nbd::fuzzing`).
#![cfg(not(blkq_loom))]

use blk_drivers::spec::{DeviceSpec, QueueOverrides};
use nbd::fuzzing::ConnHarness;
use nbd::server::Export;

#[test]
fn conn_corpus_replays_cleanly() {
    let dev = "mem:64M"
        .parse::<DeviceSpec>()
        .unwrap()
        .build_device(&QueueOverrides::default())
        .unwrap();
    let h = ConnHarness::new(vec![Export::new("", dev)]).unwrap();
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/conn");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    assert!(files.len() >= 10, "corpus missing in {}", dir.display());
    for f in files {
        let input = std::fs::read(&f).unwrap();
        let got = h.run(&input);
        eprintln!("{}: sent {} bytes, got {got}", f.display(), input.len());
        let name = f.file_name().unwrap().to_string_lossy().into_owned();
        // The server's greeting at least; the full session's replies where the seed is a
        // well-formed session (two 4 KiB reads' data among them).
        assert!(got >= 18, "{name}: no greeting");
        if name == "go_io_disc" {
            assert!(got > 4096 + 512, "{name}: replies missing ({got} bytes)");
        }
    }
}
