//! `blkq serve`: export block devices over NBD (a Unix socket and loopback TCP by default).
//!
//! Signals: SIGINT and SIGTERM are blocked in every thread (the mask is set before any thread
//! exists, and threads inherit it) and taken synchronously by one thread with `sigwait(2)`:
//! no signal handler runs, so nothing has to be async-signal-safe. The first signal starts a
//! graceful shutdown (see `nbd::server`: stop accepting without touching the socket path,
//! finish in-flight requests within `--shutdown-timeout`, flush the devices, remove the
//! socket); the exit status is 0 only if every export drained and every flush succeeded. An
//! export with a request stuck in its device (a hung disk) past the timeout is named on stderr
//! and the process exits 1 without waiting for it. A second signal exits at once with status
//! 130.

use blkq_sync::DynArc as Arc;
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use blk_drivers::spec::QueueOverrides;
use clap::Args;
use nbd::server::{Server, Stopper};
use raid1::Raid1;

use crate::control::ControlServer;

/// `blkq serve` options.
#[derive(Args, Debug, Clone)]
pub struct ServeArgs {
    /// Read everything to serve from a TOML file (listeners, limits, TLS, exports, RAID1
    /// arrays and their access rules; see docs/blkq.example.toml). No other serve flag may be
    /// given with it. Relative paths in the file are from the file's directory.
    #[arg(long, value_name = "FILE.toml", conflicts_with_all = crate::config::CONFLICTS_WITH_CONFIG)]
    pub config: Option<PathBuf>,
    /// Device to export (repeatable): null:SIZE, mem:SIZE or file:PATH, with ,key=value
    /// options. Default: mem:1G.
    #[arg(long = "device", value_name = "SPEC")]
    pub devices: Vec<String>,
    /// Export name of the --device in the same position (a single --device without --export
    /// is the default export "").
    #[arg(long = "export", value_name = "NAME")]
    pub exports: Vec<String>,
    /// Unix socket to listen on.
    #[arg(long, value_name = "PATH", default_value = nbd::server::DEFAULT_UNIX_PATH)]
    pub socket: PathBuf,
    /// Permission bits of the Unix socket, octal (default 600: only this user).
    #[arg(long, value_name = "OCTAL", default_value = "600", value_parser = parse_octal_mode)]
    pub socket_mode: u32,
    /// TCP address to listen on. Loopback by default; another address is used only when
    /// given here.
    #[arg(long, value_name = "ADDR:PORT", default_value = nbd::server::DEFAULT_TCP_ADDR)]
    pub listen: String,
    /// Do not listen on TCP.
    #[arg(long)]
    pub no_tcp: bool,
    /// Do not listen on a Unix socket.
    #[arg(long)]
    pub no_unix: bool,
    /// Export every device read-only.
    #[arg(long)]
    pub read_only: bool,
    /// Allow TCP clients from this address range only (CIDR such as 10.0.0.0/8, or an
    /// address; repeatable; every export). Others see no export. Unix-socket clients are
    /// governed by --socket-mode.
    #[arg(long = "allow", value_name = "CIDR")]
    pub allow: Vec<String>,
    /// Allow only clients whose verified TLS certificate has this subject (repeatable; every
    /// export; needs --tls-verify-peer). Exact: the whole subject, byte for byte, as RFC 4514
    /// writes it with the last RDN first and no spaces (CN=backup,O=Example); nothing is
    /// trimmed or case-folded. attr:TYPE=VALUE matches a subject with exactly one TYPE
    /// attribute, of exactly that value (attr:CN=backup).
    #[arg(long = "allow-subject", value_name = "SUBJECT")]
    pub allow_subjects: Vec<String>,
    /// Tags per hardware queue.
    #[arg(long)]
    pub queue_depth: Option<u32>,
    /// Hardware queues.
    #[arg(long)]
    pub hw_queues: Option<u16>,
    /// Pool-full policy: steal, fifo or batch.
    #[arg(long)]
    pub policy: Option<String>,
    /// I/O scheduler: none or mq-deadline.
    #[arg(long, default_value = "none")]
    pub sched: String,
    /// mq-deadline's locking: locked or serialized.
    #[arg(long)]
    pub sched_lock: Option<String>,
    /// Export a RAID1 mirror over these legs (device specs, comma-separated; a leg's own
    /// options follow it: file:/a.img,direct=1,file:/b.img). Legs with a superblock are
    /// assembled (by content, in any order); blank legs need --raid1-create. Exported after
    /// the --device ones (an --export name per device, the mirror's last).
    #[arg(long, value_name = "LEG,LEG[,...]")]
    pub raid1: Option<String>,
    /// With --raid1: the legs are blank; create the array on them first (refused if any
    /// leg already carries a raid1 superblock).
    #[arg(long, requires = "raid1")]
    pub raid1_create: bool,
    /// With --raid1: an array option, KEY=VALUE (barrier=locked, bitmap_chunk=64M,
    /// spare_slots=1, ...; repeatable).
    #[arg(long = "raid1-option", value_name = "KEY=VALUE", requires = "raid1")]
    pub raid1_options: Vec<String>,
    /// With --raid1: a control socket (mode 0600) for `blkq raid ... --control PATH`.
    #[arg(long, value_name = "PATH", requires = "raid1")]
    pub control: Option<PathBuf>,
    /// Send clients the full description of each export (its device spec, with file paths,
    /// and the driver's details) in NBD_INFO_DESCRIPTION and NBD_OPT_LIST. Default: only the
    /// kind of device and its size, so that no host path is disclosed.
    #[arg(long)]
    pub describe_paths: bool,
    /// At shutdown (SIGTERM, SIGINT), how long in-flight requests get to finish, and again
    /// how long the final flushes get; an export still busy after that is reported stuck and
    /// the exit status is non-zero.
    #[arg(long, value_name = "SECS", default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..=86400))]
    pub shutdown_timeout: u64,
    /// Resource limits against hostile or broken clients.
    #[command(flatten)]
    pub limits: LimitArgs,
    /// TLS.
    #[command(flatten)]
    pub tls: crate::tls::TlsArgs,
    /// Serve Prometheus metrics (OpenMetrics text) on http://ADDR:PORT/metrics (port 0: any
    /// free port; the bound address is printed, and written to --metrics-addr-file).
    #[arg(long, value_name = "ADDR:PORT")]
    pub metrics: Option<String>,
    /// With --metrics: write the bound ADDR:PORT to this file once the endpoint is up.
    #[arg(long, value_name = "PATH", requires = "metrics")]
    pub metrics_addr_file: Option<PathBuf>,
    /// Log format on stderr: text, or json (one object per line, for log shippers).
    #[arg(long, value_enum, default_value_t = crate::logs::LogFormat::Text)]
    pub log_format: crate::logs::LogFormat,
    /// More log detail: -v debug, -vv trace (RUST_LOG, when set, wins).
    #[arg(short, long, action = clap::ArgAction::Count)]
    pub verbose: u8,
}

/// `blkq serve` resource limits (see "Limits" in docs/design.md).
#[derive(Args, Debug, Clone)]
pub struct LimitArgs {
    /// Connections open at once. At the limit a new connection closes the oldest one still in
    /// its handshake (never one attached to an export), or is closed at once if there is none.
    /// Default: what the open-files limit allows (3 descriptors a connection), 16 to 1024.
    #[arg(long, value_name = "N")]
    pub max_connections: Option<usize>,
    /// Seconds a new connection has to finish the whole handshake (TLS included) before it
    /// is closed.
    #[arg(long, value_name = "SECS", default_value_t = 10.0, value_parser = parse_secs)]
    pub handshake_timeout: f64,
    /// Close a connection that has nothing in flight and sends nothing for this many seconds
    /// (default: never).
    #[arg(long, value_name = "SECS", value_parser = parse_secs)]
    pub idle_timeout: Option<f64>,
    /// Close a client that reads none of its replies for this many seconds, or that neither
    /// finishes a request it began nor sends 64 KiB more of it within them (a trickled
    /// request, a half-sent TLS record), freeing its buffers.
    #[arg(long, value_name = "SECS", default_value_t = 30.0, value_parser = parse_secs)]
    pub send_timeout: f64,
    /// Bytes of read and write payload buffers in flight across all connections (256M, 2G,
    /// ...); a connection that would go over waits. Default: 1/8 of RAM, 64 MiB to 4 GiB.
    #[arg(long, value_name = "BYTES", value_parser = parse_bytes)]
    pub memory_budget: Option<u64>,
    /// How the memory budget keeps its count: atomic (lock-free) or locked (the simple version
    /// it replaces, kept for comparison).
    #[arg(long, value_name = "IMPL", default_value = "atomic", hide = true)]
    pub budget_impl: nbd::server::BudgetImpl,
}

impl Default for LimitArgs {
    /// The command line's defaults.
    fn default() -> Self {
        Self {
            max_connections: None,
            handshake_timeout: 10.0,
            idle_timeout: None,
            send_timeout: 30.0,
            memory_budget: None,
            budget_impl: nbd::server::BudgetImpl::Atomic,
        }
    }
}

impl LimitArgs {
    /// Applies the limits to the server's tuning.
    pub(crate) fn apply(&self, t: &mut nbd::server::Tuning) {
        use std::time::Duration;
        if let Some(n) = self.max_connections {
            t.max_connections = n.max(1);
        }
        t.handshake_timeout = Duration::from_secs_f64(self.handshake_timeout);
        t.idle_timeout = self.idle_timeout.map(Duration::from_secs_f64);
        t.send_timeout = Duration::from_secs_f64(self.send_timeout);
        if let Some(b) = self.memory_budget {
            t.memory_budget = b;
        }
        t.budget_impl = self.budget_impl;
    }
}

/// A positive number of seconds (fractions allowed).
fn parse_secs(s: &str) -> std::result::Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v > 0.0 && v.is_finite() && v <= 1e9 => Ok(v),
        _ => Err(format!("{s:?} is not a positive number of seconds")),
    }
}

/// A byte count with an optional K/M/G/T suffix, not zero.
pub(crate) fn parse_bytes(s: &str) -> std::result::Result<u64, String> {
    match blk_drivers::spec::parse_size(s) {
        Ok(0) => Err("must not be zero".into()),
        Ok(v) => Ok(v),
        Err(e) => Err(e.to_string()),
    }
}

/// The device string that stands for the --raid1 array in [`pairs`].
pub(crate) const RAID1_DEVICE: &str = "raid1:";

/// Pairs devices with export names.
pub(crate) fn pairs(a: &ServeArgs) -> Result<Vec<(String, String)>> {
    let mut devices = a.devices.clone();
    if let Some(legs) = &a.raid1 {
        devices.push(format!("{RAID1_DEVICE}{legs}"));
    }
    if devices.is_empty() {
        devices.push("mem:1G".to_string());
    }
    let names = if a.exports.is_empty() && devices.len() == 1 {
        vec![String::new()]
    } else {
        a.exports.clone()
    };
    if names.len() != devices.len() {
        bail!(
            "--export must be given once per --device ({} devices, {} export names)",
            devices.len(),
            names.len()
        );
    }
    Ok(names.into_iter().zip(devices).collect())
}

pub(crate) fn listen_addr(s: &str) -> Result<SocketAddr> {
    s.to_socket_addrs()
        .with_context(|| format!("bad --listen address {s:?} (expected ADDR:PORT)"))?
        .next()
        .with_context(|| format!("--listen {s:?} resolves to no address"))
}

/// `nbd://` and `nbd+unix://` URIs of an export.
/// The URIs of an export; with TLS (`tls`: the certificates directory) `nbds` ones that
/// name it, as libnbd's tools take them.
fn uris(
    name: &str,
    tcp: Option<SocketAddr>,
    unix: Option<&std::path::Path>,
    tls: Option<&std::path::Path>,
) -> Vec<String> {
    let mut v = Vec::new();
    let (s, certs) = match tls {
        Some(d) => ("s", format!("tls-certificates={}", d.display())),
        None => ("", String::new()),
    };
    if let Some(p) = unix {
        let amp = if tls.is_some() { "&" } else { "" };
        v.push(format!(
            "nbd{s}+unix:///{name}?socket={}{amp}{certs}",
            p.display()
        ));
    }
    if let Some(a) = tcp {
        let a = match a {
            SocketAddr::V4(x) if x.ip().is_unspecified() => {
                SocketAddr::from(([127, 0, 0, 1], x.port()))
            }
            other => other,
        };
        let q = if tls.is_some() { "?" } else { "" };
        if name.is_empty() && tls.is_none() {
            v.push(format!("nbd://{a}"));
        } else {
            v.push(format!("nbd{s}://{a}/{name}{q}{certs}"));
        }
    }
    v
}

/// Opens the legs of a mirror and assembles (or, with `create`, creates) the array.
/// Returns it with the spec of the leg in each slot.
pub(crate) fn build_raid1(
    legs: &[String],
    create: bool,
    options: &[String],
    ov: &QueueOverrides,
) -> Result<(Arc<Raid1>, Vec<Option<String>>)> {
    let cfg = crate::raid::raid1_config(options)?;
    match crate::raid::plan(legs, ov)? {
        None if create => {
            let devs = legs
                .iter()
                .map(|l| crate::raid::open_leg(l, ov))
                .collect::<Result<Vec<_>>>()?;
            let r = Raid1::create(devs, cfg).context("--raid1-create: creating the array")?;
            tracing::info!("raid1: created a new array over {} legs", legs.len());
            Ok((Arc::new(r), legs.iter().cloned().map(Some).collect()))
        }
        None => bail!(
            "--raid1: no leg carries a raid1 superblock (blank legs). To make a new mirror on \
             them add --raid1-create (or run `blkq raid create {}` first)",
            legs.join(" ")
        ),
        Some(p) => {
            if create {
                bail!(
                    "--raid1-create: the legs already carry array {}: refusing to overwrite it. \
                     Drop --raid1-create to serve that array",
                    p.newest.array_uuid
                );
            }
            let rep = p.report()?;
            if !rep.legs.iter().any(|l| l.state == "in_sync") {
                bail!(
                    "--raid1: no in-sync leg among the given legs: the array cannot be assembled"
                );
            }
            for n in &rep.notes {
                tracing::warn!("raid1: {n}");
            }
            let specs = rep.legs.iter().map(|l| l.device.clone()).collect();
            let r = Raid1::assemble(crate::raid::plan_devices(&p), cfg)
                .context("--raid1: assembling the array")?;
            Ok((Arc::new(r), specs))
        }
    }
}

/// Blocks SIGINT and SIGTERM in the calling thread (and so in every thread it spawns later).
fn block_signals() -> Result<libc::sigset_t> {
    // SAFETY: an all-zero `sigset_t` is a valid (if unspecified) value; `sigemptyset`
    // initialises it properly before use.
    let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid, exclusively borrowed sigset_t for each call; the signal
    // numbers are valid; `pthread_sigmask` reads `set` and does not keep the pointer.
    let rc = unsafe {
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut())
    };
    if rc != 0 {
        bail!(
            "blocking SIGINT/SIGTERM: {}",
            std::io::Error::from_raw_os_error(rc)
        );
    }
    Ok(set)
}

/// Waits for SIGINT/SIGTERM on a thread of its own; the first stops the server.
fn watch_signals(set: libc::sigset_t, stopper: Stopper) {
    std::thread::spawn(move || {
        let mut first = true;
        loop {
            let mut sig: libc::c_int = 0;
            // SAFETY: `set` is an initialised sigset_t owned by this closure and `sig` a valid
            // out-pointer; both outlive the call.
            let rc = unsafe { libc::sigwait(&set, &mut sig) };
            if rc != 0 {
                continue;
            }
            if first {
                tracing::info!(
                    "signal {sig} received: finishing in-flight requests (again to force)"
                );
                stopper.stop();
                first = false;
            } else {
                tracing::warn!("second signal: exiting now");
                std::process::exit(130);
            }
        }
    });
}

/// Runs `blkq serve`.
pub fn run(a: ServeArgs) -> Result<()> {
    // Before any thread exists (see the module docs).
    let sigset = block_signals()?;
    crate::logs::init(a.log_format, a.verbose);
    let (config, source) = match &a.config {
        Some(path) => crate::config::Config::load(path)?,
        None => (
            crate::config::Config::from_args(&a)?,
            crate::config::Source::CommandLine,
        ),
    };
    let checked = config.check(&source)?;
    let tls_mode = checked.tls.mode;
    let tls_dir = checked
        .tls
        .certificates
        .clone()
        .filter(|_| tls_mode != crate::config::TlsMode::Off);
    let tls = crate::tls::load(&checked.tls, &source)?;
    let shutdown_timeout = checked.shutdown_timeout;
    let plan = checked.build()?;
    let exports = plan.server.exports.clone();
    let local = plan.local;
    let mut cfg = plan.server;
    cfg.tls = tls;
    if let Some(addr) = cfg.tcp {
        if let Some(w) = crate::config::exposure_warning(addr, tls_mode, &exports) {
            tracing::warn!("{w}");
        }
    }
    let server = Server::start(cfg)?;
    watch_signals(sigset, server.stopper());
    let _metrics = match &a.metrics {
        Some(m) => Some(crate::metrics::start_for_serve(
            listen_addr(m).context("--metrics")?,
            a.metrics_addr_file.as_deref(),
            server.metrics(),
            plan.arrays.clone(),
        )?),
        None => None,
    };
    let mut control_servers = Vec::new();
    for (path, ctl) in plan.controls {
        control_servers.push(ControlServer::start(&path, ctl)?);
        println!("raid1 control socket: {}", path.display());
    }

    println!("blkq serve: {} export(s)", exports.len());
    for (e, full) in exports.iter().zip(&local) {
        let lim = e.device.limits();
        println!(
            "  export {:?}: {} bytes{}, {}",
            e.name,
            lim.capacity,
            if e.read_only { ", read-only" } else { "" },
            full
        );
        for u in uris(
            &e.name,
            server.tcp_addr(),
            server.unix_path(),
            tls_dir.as_deref(),
        ) {
            println!("    {u}");
        }
    }
    let first = &exports[0].name;
    let example = uris(
        first,
        server.tcp_addr(),
        server.unix_path(),
        tls_dir.as_deref(),
    );
    if let Some(u) = example.last() {
        println!("try:");
        match &tls_dir {
            None => println!("  qemu-img info {u}"),
            Some(d) => println!(
                "  (qemu: --object tls-creds-x509,id=tls0,endpoint=client,dir={} and \
                 tls-creds=tls0 in its --image-opts)",
                d.display()
            ),
        }
        println!("  nbdinfo '{}'", example[0]);
    }
    println!("Ctrl-C stops the server (in-flight requests finish first).");
    let report = server.wait();
    for cs in control_servers {
        cs.shutdown();
    }
    if !report.stuck.is_empty() {
        // A device holds a request for ever: dropping the exports could wait on it (a
        // mirror drains on drop). Leave them to the exit.
        std::mem::forget(exports);
        anyhow::bail!(
            "shutdown timed out: export(s) {:?} stuck (a request or the final flush never \
             completed within --shutdown-timeout {}s); data on them may be lost",
            report.stuck,
            shutdown_timeout
        );
    }
    let failed = report.failed;
    // The last reference to a mirror goes here: it drains and marks its superblocks clean.
    drop(exports);
    if !failed.is_empty() {
        // Error stickiness: a write or flush failed; data a client was told is durable may
        // be lost.
        anyhow::bail!(
            "write error on export(s) {failed:?}: a write or flush failed, data may be lost"
        );
    }
    Ok(())
}

/// What clients are told about an export without --describe-paths: the kind of device and
/// its size, nothing of the host (no file path, no spec options).
pub(crate) fn neutral_description(kind: &str, capacity: u64) -> String {
    format!("blkq {kind} device, {capacity} bytes")
}

/// `--socket-mode`: octal permission bits (`600`, `0660`).
pub(crate) fn parse_octal_mode(s: &str) -> Result<u32, String> {
    match u32::from_str_radix(s.trim_start_matches("0o"), 8) {
        Ok(m) if m <= 0o777 => Ok(m),
        _ => Err(format!(
            "bad mode {s:?}: expected octal permission bits such as 600"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(devices: &[&str], exports: &[&str]) -> ServeArgs {
        ServeArgs {
            devices: devices.iter().map(|s| s.to_string()).collect(),
            exports: exports.iter().map(|s| s.to_string()).collect(),
            socket: "./blkq.sock".into(),
            socket_mode: 0o600,
            listen: "127.0.0.1:10809".into(),
            no_tcp: false,
            no_unix: false,
            read_only: false,
            queue_depth: None,
            hw_queues: None,
            policy: None,
            sched: "none".into(),
            sched_lock: None,
            config: None,
            allow: vec![],
            allow_subjects: vec![],
            raid1: None,
            raid1_create: false,
            raid1_options: vec![],
            control: None,
            describe_paths: false,
            shutdown_timeout: 30,
            limits: LimitArgs::default(),
            tls: Default::default(),
            metrics: None,
            metrics_addr_file: None,
            log_format: crate::logs::LogFormat::Text,
            verbose: 0,
        }
    }

    #[test]
    fn limit_defaults_match_the_command_line() {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            limits: LimitArgs,
        }
        let parsed = <Cli as clap::Parser>::parse_from(["blkq"]).limits;
        let d = LimitArgs::default();
        assert_eq!(
            (
                parsed.max_connections,
                parsed.handshake_timeout,
                parsed.idle_timeout,
                parsed.send_timeout,
                parsed.memory_budget
            ),
            (
                d.max_connections,
                d.handshake_timeout,
                d.idle_timeout,
                d.send_timeout,
                d.memory_budget
            )
        );
        let l = <Cli as clap::Parser>::parse_from([
            "blkq",
            "--memory-budget",
            "512M",
            "--idle-timeout",
            "2.5",
            "--max-connections",
            "7",
        ])
        .limits;
        let mut t = nbd::server::Tuning::default();
        l.apply(&mut t);
        assert_eq!(t.memory_budget, 512 << 20);
        assert_eq!(t.idle_timeout, Some(std::time::Duration::from_millis(2500)));
        assert_eq!(t.max_connections, 7);
        for bad in [
            ["--send-timeout", "0"],
            ["--handshake-timeout", "-1"],
            ["--memory-budget", "0"],
        ] {
            let args = ["blkq", bad[0], bad[1]];
            assert!(
                <Cli as clap::Parser>::try_parse_from(args).is_err(),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn devices_pair_with_exports() {
        assert_eq!(
            pairs(&args(&[], &[])).unwrap(),
            vec![(String::new(), "mem:1G".to_string())]
        );
        assert_eq!(
            pairs(&args(&["null:1G"], &[])).unwrap(),
            vec![(String::new(), "null:1G".to_string())]
        );
        assert_eq!(
            pairs(&args(&["mem:1M", "null:1G"], &["a", "b"])).unwrap(),
            vec![
                ("a".to_string(), "mem:1M".to_string()),
                ("b".to_string(), "null:1G".to_string())
            ]
        );
        assert!(pairs(&args(&["mem:1M", "null:1G"], &["a"])).is_err());
        let mut r = args(&[], &[]);
        r.raid1 = Some("file:/a,file:/b".into());
        assert_eq!(
            pairs(&r).unwrap(),
            vec![(String::new(), "raid1:file:/a,file:/b".to_string())]
        );
        let mut r = args(&["mem:1M"], &["m", "mirror"]);
        r.raid1 = Some("file:/a,file:/b".into());
        assert_eq!(pairs(&r).unwrap()[1].0, "mirror");
        assert!(pairs(&args(&["mem:1M", "null:1G"], &[])).is_err());
    }

    #[test]
    fn uris_look_right() {
        let tcp: SocketAddr = "127.0.0.1:10809".parse().unwrap();
        let u = uris(
            "",
            Some(tcp),
            Some(std::path::Path::new("./blkq.sock")),
            None,
        );
        assert_eq!(
            u,
            vec!["nbd+unix:///?socket=./blkq.sock", "nbd://127.0.0.1:10809"]
        );
        let u = uris("disk", Some(tcp), None, None);
        assert_eq!(u, vec!["nbd://127.0.0.1:10809/disk"]);
        let pki = std::path::Path::new("./pki");
        let u = uris("", Some(tcp), Some(std::path::Path::new("./s")), Some(pki));
        assert_eq!(
            u,
            vec![
                "nbds+unix:///?socket=./s&tls-certificates=./pki",
                "nbds://127.0.0.1:10809/?tls-certificates=./pki"
            ]
        );
        assert!(listen_addr("nonsense").is_err());
        assert_eq!(listen_addr("127.0.0.1:1").unwrap().port(), 1);
    }
}
