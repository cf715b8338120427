//! The test scripts (no Ceph needed): `scripts/ceph-cluster.sh` trusts nothing another user
//! could plant (`stop` kills only the cluster's own daemons, whatever `DIR/pids` lists, and a
//! directory of another user is refused), and with `BLKQ_NO_INSTALL=1` neither it nor
//! `scripts/test-deps.sh` installs anything.

use std::path::Path;
use std::process::{Child, Command};
use std::time::Duration;

use testkit::ceph::script;

/// A process that is none of the cluster's.
fn bystander() -> Child {
    Command::new("sleep").arg("30").spawn().unwrap()
}

/// Whether `c` is still running, then ends it.
fn survived(mut c: Child) -> bool {
    std::thread::sleep(Duration::from_millis(300));
    let alive = c.try_wait().unwrap().is_none();
    let _ = c.kill();
    let _ = c.wait();
    alive
}

fn run(cmd: &str, dir: &Path) -> std::process::Output {
    Command::new("bash")
        .arg(script())
        .arg(cmd)
        .arg(dir)
        .output()
        .unwrap()
}

#[test]
fn stop_kills_only_the_clusters_own_daemons() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("pids")).unwrap();
    let b = bystander();
    std::fs::write(dir.path().join("pids/mon.a"), b.id().to_string()).unwrap();
    let out = run("stop", dir.path());
    assert!(
        survived(b),
        "stop killed a process that is not one of the cluster's: {out:?}"
    );
}

#[test]
fn a_directory_of_another_user_is_refused() {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("not root: cannot give a directory away, skipped");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let planted = dir.path().join("planted");
    std::fs::create_dir_all(planted.join("pids")).unwrap();
    let b = bystander();
    std::fs::write(planted.join("pids/mon.a"), b.id().to_string()).unwrap();
    for p in [&planted, &planted.join("pids"), &planted.join("pids/mon.a")] {
        std::os::unix::fs::chown(p, Some(65534), Some(65534)).unwrap();
    }
    let out = run("stop", &planted);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(survived(b), "stop obeyed another user's pid file: {err}");
    assert!(!out.status.success() && err.contains("owned by"), "{err}");
    // Nor is a cluster started there (refused before anything is installed or written).
    let out = run("start", &planted);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("owned by"), "{err}");
    assert!(!planted.join("ceph.conf").exists());
}

/// Runs `args` with `BLKQ_NO_INSTALL=1` and an `apt-get` first in `PATH` that records being
/// called; whether it was.
fn calls_apt_get(args: &[&Path]) -> (bool, std::process::Output) {
    let dir = tempfile::tempdir().unwrap();
    let bin = dir.path().join("bin");
    std::fs::create_dir(&bin).unwrap();
    let called = dir.path().join("called");
    let fake = bin.join("apt-get");
    std::fs::write(
        &fake,
        format!("#!/bin/sh\necho \"$@\" >> {}\nexit 1\n", called.display()),
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
    // Nothing else in PATH but what the scripts use besides the tools they look for: every
    // tool and package is missing, as on a fresh machine.
    for tool in ["bash", "id", "dirname", "cat", "sed"] {
        let real = ["/usr/bin", "/bin"]
            .iter()
            .map(|d| Path::new(d).join(tool))
            .find(|p| p.exists())
            .unwrap();
        std::os::unix::fs::symlink(real, bin.join(tool)).unwrap();
    }
    let path = bin.display().to_string();
    let out = Command::new("/bin/bash")
        .args(args)
        .env("PATH", path)
        .env("BLKQ_NO_INSTALL", "1")
        .output()
        .unwrap();
    (called.exists(), out)
}

#[test]
fn no_install_installs_nothing() {
    let (called, out) = calls_apt_get(&[&script(), Path::new("install")]);
    assert!(!called, "ceph-cluster.sh install ran apt-get: {out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("BLKQ_NO_INSTALL=1: not installing them"),
        "{err}"
    );
    let deps = script().with_file_name("test-deps.sh");
    let (called, out) = calls_apt_get(&[&deps]);
    assert!(!called, "test-deps.sh ran apt-get: {out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("BLKQ_NO_INSTALL=1: not installing qemu-utils")
            && err.contains("BLKQ_NO_INSTALL=1: not installing them"),
        "{err}"
    );
    assert_eq!(out.status.code(), Some(2), "{err}");
}
