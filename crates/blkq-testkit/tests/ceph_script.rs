//! `scripts/ceph-cluster.sh` trusts nothing another user could plant (no Ceph needed): `stop`
//! kills only the cluster's own daemons, whatever `DIR/pids` lists, and a directory of another
//! user is refused.

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
