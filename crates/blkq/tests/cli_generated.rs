//! What users expect of a CLI, generated from the clap definitions: `blkq completions SHELL`,
//! `blkq man DIR`, and `blkq --version` naming the built-in features.

mod common;

use std::process::Command;

#[test]
fn version_says_whether_rbd_is_built_in() {
    let v = common::ok(&["--version"]);
    let want = if blk_drivers::rbd::AVAILABLE {
        "+rbd"
    } else {
        "-rbd"
    };
    assert!(
        v.starts_with("blkq ") && v.contains(want),
        "`blkq --version` does not say {want}: {v:?}"
    );
}

#[test]
fn bash_completions_cover_the_subcommands_and_parse() {
    let script = common::ok(&["completions", "bash"]);
    for word in ["serve", "raid", "bitmap", "--raid1-create", "--ready-fd"] {
        assert!(script.contains(word), "bash completions lack {word}");
    }
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("blkq.bash");
    std::fs::write(&f, &script).unwrap();
    let out = Command::new("bash").arg("-n").arg(&f).output().unwrap();
    assert!(
        out.status.success(),
        "bash -n: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    for shell in ["zsh", "fish"] {
        let s = common::ok(&["completions", shell]);
        assert!(s.contains("serve"), "{shell} completions lack serve");
    }
    let e = common::fails(&["completions", "tcsh"]);
    assert!(e.contains("bash"), "{e}");
}

#[test]
fn man_writes_a_page_per_command() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    common::ok(&["man", d]);
    for (page, word) in [
        ("blkq.1", "serve"),
        ("blkq-serve.1", "raid1\\-create"),
        ("blkq-raid-status.1", "control"),
        ("blkq-bitmap-add.1", "granularity"),
    ] {
        let text = std::fs::read_to_string(dir.path().join(page))
            .unwrap_or_else(|e| panic!("{page}: {e}"));
        assert!(
            text.starts_with(".ie") || text.contains(".TH"),
            "{page}: {text}"
        );
        assert!(text.contains(word), "{page} lacks {word}");
    }
}
