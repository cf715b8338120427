//! Large writes received into their home, driven by clients nobody here wrote: nbdcopy copies
//! 24 MiB of random bytes in with 1 MiB requests, 8 in flight, and back out; qemu-io writes
//! and verifies patterns. Into `mem:` (received into the mapping), a buffered `file:` (spliced
//! into the page cache) and `mem:` with `splice=0` (copied), all reading back what was written.
//! The built binary.

mod common;

use std::path::Path;
use std::process::Command;

use common::Serving;

const MIB: usize = 1 << 20;

fn have(tool: &str) -> bool {
    Command::new(tool).arg("--version").output().is_ok()
}

fn uri(sock: &Path) -> String {
    format!("nbd+unix:///?socket={}", sock.display())
}

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{cmd:?}: {text}");
    text
}

/// Random bytes (xorshift), no zero runs for a client to turn into write-zeroes.
fn random(len: usize, mut x: u64) -> Vec<u8> {
    let mut v = Vec::with_capacity(len);
    while v.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.extend_from_slice(&(x | 0x0101_0101_0101_0101).to_le_bytes());
    }
    v.truncate(len);
    v
}

#[test]
fn nbdcopy_and_qemu_io_write_through_every_path() {
    if !have("nbdcopy") || !have("qemu-io") {
        eprintln!("nbdcopy or qemu-io is not on PATH: skipped");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("disk.img");
    std::fs::File::create(&img)
        .unwrap()
        .set_len(64 << 20)
        .unwrap();
    let file_spec = format!("file:{}", img.display());
    for (name, spec) in [
        ("mem", "mem:64M"),
        ("file", file_spec.as_str()),
        ("copy", "mem:64M,splice=0"),
    ] {
        let s = Serving::start(dir.path(), name, &["--device", spec]);
        // nbdcopy in and out.
        let src = dir.path().join(format!("{name}.in"));
        let back = dir.path().join(format!("{name}.out"));
        let data = random(24 * MIB, 0x9e37_79b9_7f4a_7c15 ^ name.len() as u64);
        std::fs::write(&src, &data).unwrap();
        run(Command::new("nbdcopy")
            .args(["--request-size=1M", "--requests=8", "--connections=1"])
            .arg(&src)
            .arg(uri(&s.sock)));
        std::fs::File::create(&back).unwrap();
        run(Command::new("qemu-img")
            .args(["convert", "-f", "raw", "-O", "raw"])
            .arg(uri(&s.sock))
            .arg(&back));
        let got = std::fs::read(&back).unwrap();
        assert_eq!(got.len(), 64 << 20, "{name}");
        assert!(
            got[..data.len()] == data[..],
            "{name}: nbdcopy's bytes read back different"
        );
        assert!(got[data.len()..].iter().all(|&b| b == 0), "{name}");
        // qemu-io: large writes, unaligned to the MiB, one with FUA, each read back verified.
        let text = run(Command::new("qemu-io")
            .args(["-f", "raw"])
            .arg(uri(&s.sock))
            .args([
                "-c",
                "write -P 0xcd 30M 4M",
                "-c",
                "write -P 0x5e 26255360 1536k",
                "-c",
                "write -P 0x77 -f 50M 2M",
                "-c",
                "read -P 0xcd 30M 4M",
                "-c",
                "read -P 0x5e 26255360 1536k",
                "-c",
                "read -P 0x77 50M 2M",
            ]));
        assert!(!text.contains("verification failed"), "{name}: {text}");
        assert_eq!(text.matches("read ").count(), 3, "{name}: {text}");
        if name == "file" {
            // On the file itself, past the server.
            drop(s);
            let f = std::fs::read(&img).unwrap();
            assert!(
                f[..data.len()] == data[..],
                "the file differs from nbdcopy's bytes"
            );
            assert!(f[30 * MIB..34 * MIB].iter().all(|&b| b == 0xcd));
        }
    }
}
