//! A `file:` device is locked (flock) while served: a second `blkq serve` on the same file, or
//! `blkq raid assemble` on the legs of a mirror being served, is refused with an error naming
//! the file and the process that holds it; read-only servers share a file.

mod common;

use std::time::Duration;

use common::{fails, leg_file, ok, serve_fails, Server, Serving};

const EXIT_LIMIT: Duration = Duration::from_secs(120);

#[test]
fn a_second_server_on_the_same_file_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (path, spec) = leg_file(dir.path(), "disk.img", 4 << 20);
    let mut first = Serving::start(dir.path(), "first", &["--device", &spec]);
    let other = dir.path().join("second.sock");
    let err = serve_fails(&spec, &other, EXIT_LIMIT);
    assert!(err.contains(&path.display().to_string()), "{err}");
    assert!(err.contains("lock"), "{err}");
    assert!(
        err.contains(&format!("pid {}", first.id())) || err.contains("not shown"),
        "the holder is named (or said unknown): {err}"
    );
    // Read-only is no way around a writer.
    let err = serve_fails(&format!("{spec},ro=1"), &other, EXIT_LIMIT);
    assert!(err.contains("lock"), "{err}");
    first.signal(libc::SIGTERM);
    assert!(first.wait_exit(EXIT_LIMIT).success());

    // Two read-only servers share the file.
    let ro = format!("{spec},ro=1");
    let mut a = Serving::start(dir.path(), "ro-a", &["--device", &ro]);
    let mut b = Serving::start(dir.path(), "ro-b", &["--device", &ro]);
    assert_eq!(b.client().read(0, 512).unwrap(), vec![0u8; 512]);
    for s in [&mut a, &mut b] {
        s.signal(libc::SIGTERM);
        assert!(s.wait_exit(EXIT_LIMIT).success());
    }
}

#[test]
fn legs_of_a_served_mirror_cannot_be_assembled_elsewhere() {
    let dir = tempfile::tempdir().unwrap();
    let (pa, a) = leg_file(dir.path(), "a.img", 8 << 20);
    let (_, b) = leg_file(dir.path(), "b.img", 8 << 20);
    ok(&["raid", "create", &a, &b, "--bitmap-chunk", "64K"]);
    let mut s = Server::start(dir.path(), &format!("{a},{b}"), &[]);
    let err = fails(&["raid", "assemble", &a, &b]);
    assert!(
        err.contains(&pa.display().to_string()) && err.contains("lock"),
        "{err}"
    );
    // Offline status cannot read a served leg: it says to ask the server (--control).
    let o = common::blkq(&["raid", "status", &a, &b]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(4), "{err}");
    assert!(
        err.contains("lock") && err.contains("--control") && err.contains("control socket"),
        "{err}"
    );
    // A plain --device on a leg of the served mirror is refused too.
    let other = dir.path().join("x.sock");
    let err = serve_fails(&a, &other, EXIT_LIMIT);
    assert!(err.contains("lock"), "{err}");
    assert!(s.stop(), "serve did not exit cleanly");
    // Once the server is gone, the legs are free again.
    ok(&["raid", "assemble", &a, &b]);
}
