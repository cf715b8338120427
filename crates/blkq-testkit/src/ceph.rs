//! A single-node Ceph cluster for the rbd tests: [`Cluster::shared`] starts one per test
//! binary with `scripts/ceph-cluster.sh` (which installs the packages when it can), and the
//! script's watcher stops it when the test binary exits, however it exits.
//!
//! Where the cluster cannot be had (the packages are missing and cannot be installed, or the
//! cluster does not come up), `shared` returns the reason, and a test skips saying it; with
//! `BLKQ_REQUIRE_CEPH=1` in the environment (what `scripts/test.sh` sets once it has the
//! packages) it fails instead, so that CI never silently skips.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// The script that runs the cluster.
pub fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/ceph-cluster.sh")
}

/// A running cluster (see the module docs).
#[derive(Debug)]
pub struct Cluster {
    dir: PathBuf,
    conf: PathBuf,
}

static CLUSTER: OnceLock<Result<Cluster, String>> = OnceLock::new();

impl Cluster {
    /// The test binary's cluster, started on first use; `Err(why)` where there is none.
    pub fn shared() -> Result<&'static Cluster, String> {
        let r = CLUSTER
            .get_or_init(Self::start)
            .as_ref()
            .map_err(Clone::clone);
        if let Err(why) = &r {
            assert!(
                std::env::var("BLKQ_REQUIRE_CEPH").map_or(true, |v| v != "1"),
                "BLKQ_REQUIRE_CEPH=1 and no Ceph cluster: {why}"
            );
        }
        r
    }

    /// [`Cluster::shared`], or `None` after printing why the calling test skips.
    pub fn or_skip(test: &str) -> Option<&'static Cluster> {
        match Self::shared() {
            Ok(c) => Some(c),
            Err(why) => {
                eprintln!("SKIPPED {test}: no Ceph cluster: {why}");
                None
            }
        }
    }

    fn start() -> Result<Cluster, String> {
        // A private directory of an unpredictable name (mode 0700): a name another user could
        // guess (`blkq-ceph-PID`) could be made first, with pid files the script would obey.
        let made = Command::new("mktemp")
            .arg("-d")
            .arg(std::env::temp_dir().join("blkq-ceph-XXXXXXXXXX"))
            .output()
            .map_err(|e| format!("mktemp -d: {e}"))?;
        if !made.status.success() {
            return Err(format!(
                "mktemp -d: {}",
                String::from_utf8_lossy(&made.stderr).trim()
            ));
        }
        let dir = PathBuf::from(String::from_utf8_lossy(&made.stdout).trim_end());
        let out = Command::new("bash")
            .arg(script())
            .arg("start")
            .arg(&dir)
            .arg("--owner")
            .arg(std::process::id().to_string())
            .output()
            .map_err(|e| format!("cannot run {}: {e}", script().display()))?;
        if !out.status.success() {
            return Err(format!(
                "{} start failed ({}): {}",
                script().display(),
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        let conf = dir.join("ceph.conf");
        Ok(Cluster { dir, conf })
    }

    /// The cluster's `ceph.conf`.
    pub fn conf(&self) -> &Path {
        &self.conf
    }

    /// The cluster's directory (logs in `log/`).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Runs `rbd ARGS` against the cluster; its stdout, or the failure.
    pub fn rbd(&self, args: &[&str]) -> Result<String, String> {
        let out = Command::new("rbd")
            .arg("-c")
            .arg(&self.conf)
            .args(args)
            .output()
            .map_err(|e| format!("rbd: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "rbd {args:?}: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Creates image `rbd/NAME` of `size` (e.g. `"64M"`), removing an older one of that name.
    pub fn create_image(&self, name: &str, size: &str) {
        let _ = self.rbd(&["rm", "--no-progress", &format!("rbd/{name}")]);
        self.rbd(&["create", &format!("rbd/{name}"), "--size", size])
            .unwrap_or_else(|e| panic!("{e}"));
    }

    fn script_cmd(&self, cmd: &str) {
        let st = Command::new("bash")
            .arg(script())
            .arg(cmd)
            .arg(&self.dir)
            .status()
            .unwrap_or_else(|e| panic!("ceph-cluster.sh {cmd}: {e}"));
        assert!(st.success(), "ceph-cluster.sh {cmd} failed: {st}");
    }

    /// SIGKILLs the OSD.
    pub fn kill_osd(&self) {
        self.script_cmd("kill-osd");
    }

    /// Starts the OSD again (after [`Cluster::kill_osd`]).
    pub fn start_osd(&self) {
        self.script_cmd("start-osd");
    }

    /// A device spec for image `name` of this cluster, with `extra` options (`",lock=off"`).
    pub fn spec(&self, name: &str, extra: &str) -> String {
        format!("rbd:rbd/{name},conf={}{extra}", self.conf.display())
    }
}
