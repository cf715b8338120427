//! Two hosts on one machine for tests across a network: a "front" and a "back" network
//! namespace, made by the test and joined by a veth pair (`10.0.0.1` front, `10.0.0.2` back),
//! removed on drop. Each pair of namespaces is private to its test (names carry the process
//! id and a counter), so tests may run in parallel with the same addresses.
//!
//! Processes are put into a namespace with [`super::Launch::in_netns`]; the test itself stays
//! in its own namespace and reaches them through Unix sockets (a socket path is a file, not a
//! network address, so it crosses namespaces). The link is cut with `ip link set down` and
//! shaped with `tc ... tbf`, the tools this kernel has.

use std::path::PathBuf;
use std::process::Command;

use blkq_sync::atomic::{AtomicUsize, Ordering};

/// The front's address on the link.
pub const FRONT_IP: &str = "10.0.0.1";
/// The back's address on the link.
pub const BACK_IP: &str = "10.0.0.2";

/// Numbers the pairs a test process makes. Relaxed: only uniqueness matters.
static NEXT: AtomicUsize = AtomicUsize::new(0);

/// Two network namespaces joined by a veth pair (see the module docs).
pub struct Hosts {
    front: String,
    back: String,
}

/// Runs `ip ARGS`; the error names the command and what it printed.
fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("cannot run ip(8) from iproute2: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "`ip {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

impl Hosts {
    /// Makes the two namespaces and the link, both ends up. `Err` says exactly why they
    /// cannot be made here (not root, no iproute2, no veth support), for the test's skip
    /// message.
    pub fn new() -> Result<Self, String> {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let tag = format!("blkq-{}-{n}", std::process::id());
        let h = Self {
            front: format!("{tag}-front"),
            back: format!("{tag}-back"),
        };
        ip(&["netns", "add", &h.front])?;
        // From here on, drop removes whatever was made.
        ip(&["netns", "add", &h.back])?;
        ip(&[
            "link", "add", "name", "veth0", "netns", &h.front, "type", "veth", "peer", "name",
            "veth0", "netns", &h.back,
        ])?;
        for (ns, addr) in [(&h.front, FRONT_IP), (&h.back, BACK_IP)] {
            ip(&[
                "-n",
                ns,
                "addr",
                "add",
                &format!("{addr}/24"),
                "dev",
                "veth0",
            ])?;
            ip(&["-n", ns, "link", "set", "dev", "veth0", "up"])?;
            ip(&["-n", ns, "link", "set", "dev", "lo", "up"])?;
        }
        Ok(h)
    }

    /// The front namespace, for [`super::Launch::in_netns`].
    pub fn front(&self) -> PathBuf {
        PathBuf::from("/run/netns").join(&self.front)
    }

    /// The back namespace, for [`super::Launch::in_netns`].
    pub fn back(&self) -> PathBuf {
        PathBuf::from("/run/netns").join(&self.back)
    }

    /// Cuts the link (`ip link set down` on both ends: packets in either direction are lost,
    /// connections stay open and time out, as when a cable is pulled).
    pub fn cut(&self) {
        for ns in [&self.front, &self.back] {
            ip(&["-n", ns, "link", "set", "dev", "veth0", "down"]).unwrap();
        }
    }

    /// Brings the link back up.
    pub fn restore(&self) {
        for ns in [&self.front, &self.back] {
            ip(&["-n", ns, "link", "set", "dev", "veth0", "up"]).unwrap();
        }
    }

    /// Limits the front's sending rate with a token bucket (`tc qdisc ... tbf`), e.g.
    /// `rate = "20mbit"`: a slow link to the back.
    pub fn limit_rate(&self, rate: &str) {
        let out = Command::new("ip")
            .args([
                "netns",
                "exec",
                &self.front,
                "tc",
                "qdisc",
                "replace",
                "dev",
                "veth0",
            ])
            .args([
                "root", "tbf", "rate", rate, "burst", "64kb", "latency", "1s",
            ])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "tc tbf: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        // Deleting a namespace deletes its end of the veth pair, and with it the other end.
        let _ = ip(&["netns", "del", &self.front]);
        let _ = ip(&["netns", "del", &self.back]);
    }
}

/// Makes [`Hosts`], or prints why the test is skipped and returns `None`.
pub fn hosts_or_skip(test: &str) -> Option<Hosts> {
    match Hosts::new() {
        Ok(h) => Some(h),
        Err(why) => {
            eprintln!("SKIPPED {test}: network namespaces cannot be made here: {why}");
            None
        }
    }
}
