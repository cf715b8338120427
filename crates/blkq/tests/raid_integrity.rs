//! A mirror with per-block checksums through a real client: `blkq raid create --integrity
//! crc32c`, `blkq serve --raid1`, qemu-io writing and verifying patterns, and a bit flipped in
//! a leg's file behind the server's back. The flipped bit never reaches qemu-io, the leg is
//! healed (its file holds the good byte again), status names the leg; a block bad on both legs
//! fails its read and the connection keeps working. Skipped without qemu-io.

mod common;
use common::*;

use std::os::unix::fs::FileExt;
use std::path::Path;

const LEG_SIZE: u64 = 16 << 20;

/// Flips a bit of the file's byte at `at`.
fn flip_file(path: &Path, at: u64) {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, at).unwrap();
    b[0] ^= 0x04;
    f.write_all_at(&b, at).unwrap();
}

fn byte_at(path: &Path, at: u64) -> u8 {
    let mut b = [0u8; 1];
    std::fs::File::open(path)
        .unwrap()
        .read_exact_at(&mut b, at)
        .unwrap();
    b[0]
}

#[test]
fn a_flipped_bit_never_reaches_qemu_io_and_the_leg_is_healed() {
    if qemu_io("nbd+unix:///?socket=/nonexistent", "read 0 512").is_none() {
        eprintln!("skipped: qemu-io is not installed");
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let (pa, a) = leg_file(d.path(), "a.img", LEG_SIZE);
    let (pb, b) = leg_file(d.path(), "b.img", LEG_SIZE);
    // Blank sparse legs: no initial resync (a running resync settles blocks instead of
    // judging them; see `raid1::integrity`).
    let out = ok(&[
        "raid",
        "create",
        &a,
        &b,
        "--integrity",
        "crc32c",
        "--assume-clean",
    ]);
    assert!(out.contains("created raid1 array"), "{out}");
    let detail = ok(&["raid", "detail", &a, &b]);
    assert!(detail.contains("Integrity : crc32c"), "{detail}");
    let json: serde_json::Value =
        serde_json::from_str(&ok(&["raid", "status", "--json", &a, &b])).unwrap();
    let data_offset = json["data_offset"].as_u64().unwrap();

    let legs = format!("{a},{b}");
    let mut srv = Server::start(d.path(), &legs, &[]);
    let uri = format!(
        "nbd+unix:///?socket={}",
        d.path().join("nbd.sock").display()
    );
    let (w, out) = qemu_io(&uri, "write -P 0x5c 1M 64k").unwrap();
    assert!(w, "{out}");
    let (w, out) = qemu_io(&uri, "write -P 0x3a 4M 4k").unwrap();
    assert!(w, "{out}");
    assert!(srv.stop(), "a clean stop");

    // A bit of leg a's copy of array byte 1M + 8195, and both copies of 4M + 100.
    let at = data_offset + (1 << 20) + 8195;
    flip_file(&pa, at);
    flip_file(&pa, data_offset + (4 << 20) + 100);
    flip_file(&pb, data_offset + (4 << 20) + 101);
    let mut srv = Server::start(d.path(), &legs, &[]);
    // Whichever leg answers, qemu-io sees the pattern (it compares every byte).
    for _ in 0..3 {
        let (r, out) = qemu_io(&uri, "read -P 0x5c 1M 64k").unwrap();
        assert!(r, "{out}");
    }
    assert_eq!(byte_at(&pa, at), 0x5c, "the bad leg is healed in place");
    // Bad on both legs: the read fails, its neighbours and the connection do not.
    let (r, out) = qemu_io(&uri, "read 4M 4k").unwrap();
    assert!(!r, "a block bad on every leg must fail: {out}");
    let (r, out) = qemu_io(&uri, "read -P 0x5c 1M 4k").unwrap();
    assert!(r, "{out}");
    let v = srv.status_json();
    assert_eq!(v["integrity"]["algorithm"], "crc32c", "{v}");
    assert_eq!(v["integrity"]["healed"], 1, "{v}");
    assert!(
        v["integrity"]["unrecoverable"].as_u64().unwrap() >= 1,
        "{v}"
    );
    assert!(
        v["legs"][0]["checksum_errors"].as_u64().unwrap() >= 2,
        "{v}"
    );
    let status = srv.status();
    assert!(status.contains("integrity: crc32c, 1 healed"), "{status}");
    assert!(status.contains("leg 0: "), "{status}");
    // A rewrite of the lost block makes it whole; a check then finds nothing.
    let (w, out) = qemu_io(&uri, "write -P 0x11 4M 4k").unwrap();
    assert!(w, "{out}");
    ok(&["raid", "check", "--control", srv.ctl()]);
    let v = srv.wait_for(&|v| v["sync"]["action"] == "idle", "the check to finish");
    assert_eq!(v["sync"]["mismatch_cnt"], 0, "{v}");
    assert!(srv.stop(), "a clean stop");
    assert!(
        std::fs::read_to_string(d.path().join("serve.stderr"))
            .unwrap()
            .contains("did not match their checksums"),
        "the log names the bad blocks"
    );
}

#[test]
fn serve_creates_a_mirror_with_integrity_and_refuses_it_on_an_existing_one() {
    let d = tempfile::tempdir().unwrap();
    let (_, a) = leg_file(d.path(), "a.img", LEG_SIZE);
    let (_, b) = leg_file(d.path(), "b.img", LEG_SIZE);
    let legs = format!("{a},{b}");
    let mut srv = Server::start(
        d.path(),
        &legs,
        &["--raid1-create", "--raid1-integrity", "crc32c"],
    );
    let v = srv.wait_for(&|v| v["sync"]["action"] == "idle", "the initial resync");
    assert_eq!(v["integrity"]["algorithm"], "crc32c", "{v}");
    let c = srv.client();
    assert_eq!(
        c.details().block_size.map(|b| b.min),
        Some(4096),
        "clients are told the array's 4 KiB block"
    );
    drop(c);
    assert!(srv.stop(), "a clean stop");
    let e = fails(&[
        "serve",
        "--raid1",
        &legs,
        "--raid1-option",
        "integrity=crc32c",
        "--no-tcp",
        "--socket",
        d.path().join("x.sock").to_str().unwrap(),
    ]);
    assert!(e.contains("chosen when the array is created"), "{e}");
}
