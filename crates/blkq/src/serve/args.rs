//! `blkq serve`'s arguments: every clap struct and every value type.
//!
//! Each section of the configuration is one struct that derives both `clap::Args` (its flags)
//! and `serde::Deserialize` (its table in `--config FILE.toml`), so a flag and its key are one
//! field: the key is the flag's name with `-` as `_` (`--socket-mode` is `[server]
//! socket_mode`; the `[tls]` keys drop the `tls_` prefix). A field has one default, the one
//! clap shows in `--help` (`Default` reads it back from clap, [`flag_defaults`]), and one
//! validation, its type's: the same parser reads the flag's text and the file's value
//! ([`Spelling`]).
//!
//! `--config` is given alone: clap refuses it next to any flag of a section that describes
//! what is served ([`SERVED`]: each `Args` struct is a clap group of its own flags), so a
//! new flag in a section is covered without being listed anywhere. [`ReportArgs`] (how the
//! process reports, not what it serves) may be given with it.

use std::fmt;
use std::net::{SocketAddr, ToSocketAddrs};
use std::num::NonZeroUsize;
use std::path::PathBuf;
use std::str::FromStr;

use anyhow::{Context, Result};
use blk::sched::{LockMode, SchedChoice};
use blk::PoolPolicy;
use clap::{Args, FromArgMatches};
use nbd::server::{BudgetImpl, SpliceRule};
use nbd::tls::TlsMode;
use serde::{Deserialize, Deserializer};

use crate::logs::LogFormat;

/// The clap groups (one per section struct) that `--config` refuses next to it.
pub const SERVED: [&str; 4] = ["ExportArgs", "ServerArgs", "LimitArgs", "TlsArgs"];

/// `blkq serve` options.
#[derive(Args, Debug, Clone)]
pub struct ServeArgs {
    /// Read everything to serve from a TOML file (listeners, limits, TLS, exports, RAID1
    /// arrays and their access rules; see docs/blkq.example.toml). No other serve flag may be
    /// given with it, but for the reporting ones (--metrics, --log-format, -v). Relative
    /// paths in the file are from the file's directory.
    #[arg(long, value_name = "FILE.toml", conflicts_with_all = SERVED)]
    pub config: Option<PathBuf>,
    /// What is exported (the command line's spelling of `[[export]]` and `[[raid1]]`).
    #[command(flatten)]
    pub exports: ExportArgs,
    /// Listeners, queues, descriptions, shutdown (`[server]`).
    #[command(flatten)]
    pub server: ServerArgs,
    /// Resource limits against hostile or broken clients (`[limits]`).
    #[command(flatten)]
    pub limits: LimitArgs,
    /// TLS (`[tls]`).
    #[command(flatten)]
    pub tls: TlsArgs,
    /// Metrics and logs.
    #[command(flatten)]
    pub report: ReportArgs,
}

/// The exports, as the command line gives them (a file gives `[[export]]` and `[[raid1]]`
/// tables instead).
#[derive(Args, Debug, Clone, Default)]
pub struct ExportArgs {
    /// Device to export (repeatable): null:SIZE, mem:SIZE, file:PATH or rbd:POOL/IMAGE, with
    /// ,key=value options, or nbd://HOST/EXPORT. Default: mem:1G.
    #[arg(long = "device", value_name = "SPEC")]
    pub devices: Vec<String>,
    /// Export name of the --device in the same position (a single --device without --export
    /// is the default export "").
    #[arg(long = "export", value_name = "NAME")]
    pub exports: Vec<String>,
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
    /// Export a RAID1 mirror over these legs (device specs, comma-separated; a leg's own
    /// options follow it: file:/a.img,direct=1,file:/b.img). Legs with a superblock are
    /// assembled (by content, in any order); blank legs need --raid1-create. Exported after
    /// the --device ones (an --export name per device, the mirror's last).
    #[arg(long, value_name = "LEG,LEG[,...]")]
    pub raid1: Option<String>,
    /// With --raid1: create the array on the legs first, then resync it from the first leg
    /// while serving. Refused if a leg holds data (a raid1 superblock, a filesystem or
    /// partition signature, non-zero bytes where the superblock and bitmap go) unless
    /// --raid1-force, or if the legs differ in size unless --raid1-size.
    #[arg(long, requires = "raid1")]
    pub raid1_create: bool,
    /// With --raid1-create: overwrite legs that hold data (what they held is lost).
    #[arg(long, requires = "raid1_create")]
    pub raid1_force: bool,
    /// With --raid1-create: no initial resync, the legs are taken to agree as they are. For
    /// blank legs only (zeros throughout, such as new sparse files).
    #[arg(long, requires = "raid1_create")]
    pub raid1_assume_clean: bool,
    /// With --raid1-create: use this much of each leg (superblock, bitmap and data): at most
    /// the smallest leg; needed for legs of different sizes.
    #[arg(long, value_name = "SIZE", requires = "raid1_create")]
    pub raid1_size: Option<Bytes>,
    /// With --raid1-create: keep a checksum per 4 KiB block on every leg (crc32c; as
    /// `blkq raid create --integrity`). Same as --raid1-option integrity=ALGORITHM.
    #[arg(long, value_name = "ALGORITHM", requires = "raid1_create")]
    pub raid1_integrity: Option<String>,
    /// With --raid1: start even though legs the array has in sync are missing (a failover:
    /// serve the legs at hand alone). This side becomes a new generation; a missing leg that
    /// later ran on its own is then refused until one side is discarded (`blkq raid add
    /// --discard`). Same as --raid1-option allow_degraded=true.
    #[arg(long, requires = "raid1", conflicts_with = "raid1_create")]
    pub raid1_degraded: bool,
    /// With --raid1: an array option, KEY=VALUE (barrier=locked, bitmap_chunk=64M,
    /// spare_slots=1, ...; repeatable).
    #[arg(long = "raid1-option", value_name = "KEY=VALUE", requires = "raid1")]
    pub raid1_options: Vec<String>,
    /// A control socket (mode 0600) for `blkq bitmap ... --control PATH` (every export's
    /// dirty bitmaps), `blkq export ... --control PATH` (exports added and removed while
    /// serving) and, with --raid1, `blkq raid ... --control PATH`.
    #[arg(long, value_name = "PATH")]
    pub control: Option<PathBuf>,
}

/// `[server]`: listeners, queues, descriptions, shutdown.
#[derive(Args, Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ServerArgs {
    /// Unix socket to listen on (default ./blkq.sock, from the working directory even in a
    /// --config file that leaves it out).
    #[arg(long, value_name = "PATH")]
    pub socket: Option<PathBuf>,
    /// Permission bits of the Unix socket, octal (600: only this user).
    #[arg(long, value_name = "OCTAL", default_value = "600")]
    pub socket_mode: OctalMode,
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
    /// Tags per hardware queue.
    #[arg(long)]
    pub queue_depth: Option<u32>,
    /// Hardware queues.
    #[arg(long)]
    pub hw_queues: Option<u16>,
    /// Pool-full policy: steal, fifo or batch.
    #[arg(long)]
    #[serde(deserialize_with = "parsed_option")]
    pub policy: Option<PoolPolicy>,
    /// I/O scheduler of every device: none or mq-deadline (default: each device's own
    /// sched= option, none when it gives none).
    #[arg(long)]
    #[serde(deserialize_with = "parsed_option")]
    pub sched: Option<SchedChoice>,
    /// mq-deadline's locking: locked or serialized.
    #[arg(long)]
    #[serde(deserialize_with = "parsed_option")]
    pub sched_lock: Option<LockMode>,
    /// Send clients the full description of each export (its device spec, with file paths,
    /// and the driver's details) in NBD_INFO_DESCRIPTION and NBD_OPT_LIST. Default: only the
    /// kind of device and its size, so that no host path is disclosed.
    #[arg(long)]
    pub describe_paths: bool,
    /// At shutdown (SIGTERM, SIGINT), how long in-flight requests get to finish, and again
    /// how long the final flushes get; an export still busy after that is reported stuck and
    /// the exit status is non-zero. Whole seconds, 1 to 86400.
    #[arg(long, value_name = "SECS", default_value = "30")]
    pub shutdown_timeout: ShutdownTimeout,
    /// What to log: a level (error, warn, info, debug, trace) or per-module directives
    /// (`info,nbd=debug`). In a --config file, SIGHUP applies a changed value. Default: info
    /// (or -v's); RUST_LOG, when set, wins over both.
    #[arg(long, value_name = "FILTER")]
    pub log_level: Option<String>,
    /// The server's control socket (`[server] control`; on the command line `--control`).
    #[arg(skip)]
    pub control: Option<PathBuf>,
    /// Start even when an export's dirty-bitmap sidecar is missing, torn or from another
    /// image: a torn or foreign one is replaced by bitmaps of the same names with every bit
    /// dirty, a missing one by none (the next backups are full ones; the log says which).
    #[arg(long)]
    pub bitmaps_reset: bool,
    /// How writes find the bitmaps they count in: lockfree, or locked (its simple twin, to
    /// compare with). A benchmark's switch: no key in a file.
    #[arg(long, value_name = "IMPL", default_value = "lockfree", hide = true)]
    #[serde(skip)]
    pub bitmaps_gate: BitmapsGate,
}

/// `--bitmaps-gate`: [`cbt::Mode`] as a flag value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BitmapsGate(pub cbt::Mode);

impl FromStr for BitmapsGate {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        s.parse().map(Self)
    }
}

/// `[limits]`: resource limits against hostile or broken clients (see "Limits" in
/// docs/design.md).
#[derive(Args, Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LimitArgs {
    /// Connections open at once. At the limit a new connection closes the oldest one still in
    /// its handshake (never one attached to an export), or is closed at once if there is none.
    /// Default: what the open-files limit allows (five descriptors a connection, 64 kept for
    /// the rest), 16 to 1024.
    #[arg(long, value_name = "N")]
    pub max_connections: Option<NonZeroUsize>,
    /// Seconds a new connection has to finish the whole handshake (TLS included) before it
    /// is closed.
    #[arg(long, value_name = "SECS", default_value = "10")]
    pub handshake_timeout: Seconds,
    /// Close a connection that has nothing in flight and sends nothing for this many seconds
    /// (default: never).
    #[arg(long, value_name = "SECS")]
    pub idle_timeout: Option<Seconds>,
    /// Close a client that reads none of its replies for this many seconds, or that neither
    /// finishes a request it began nor sends 64 KiB more of it within them (a trickled
    /// request, a half-sent TLS record), freeing its buffers.
    #[arg(long, value_name = "SECS", default_value = "30")]
    pub send_timeout: Seconds,
    /// Bytes of read and write payload buffers in flight across all connections (256M, 2G,
    /// ...); a connection that would go over waits. Default: 1/8 of RAM, 64 MiB to 4 GiB.
    #[arg(long, value_name = "BYTES")]
    pub memory_budget: Option<Bytes>,
    /// How the memory budget keeps its count: atomic (lock-free) or locked (its simple twin, to
    /// compare with). A benchmark's switch: no key in a file.
    #[arg(long, value_name = "IMPL", default_value = "atomic", hide = true)]
    #[serde(skip)]
    pub budget_impl: BudgetImpl,
    /// Which large reads are spliced where the device can: measure (per connection, the way
    /// the client takes faster) or always (every one). A benchmark's switch: no key in a file.
    #[arg(long, value_name = "RULE", default_value = "measure", hide = true)]
    #[serde(skip)]
    pub splice_rule: SpliceRule,
}

/// `[tls]`: TLS, with nbdkit's meaning of the modes.
#[derive(Args, Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TlsArgs {
    /// TLS: off, on (offered) or require (no option but STARTTLS and ABORT before it).
    #[arg(long, value_name = "off|on|require", default_value = "off")]
    #[serde(rename = "mode", deserialize_with = "parsed")]
    pub tls: TlsMode,
    /// Directory holding ca-cert.pem, server-cert.pem and server-key.pem (qemu's and
    /// nbdkit's layout; `blkq certs DIR` makes one).
    #[arg(long, value_name = "DIR")]
    #[serde(rename = "certificates")]
    pub tls_certificates: Option<PathBuf>,
    /// Require a client certificate signed by the directory's ca-cert.pem.
    #[arg(long)]
    #[serde(rename = "verify_peer")]
    pub tls_verify_peer: bool,
}

/// How the process reports: fine beside `--config`.
#[derive(Args, Debug, Clone)]
pub struct ReportArgs {
    /// Serve Prometheus metrics (OpenMetrics text) on http://ADDR:PORT/metrics (port 0: any
    /// free port; the bound address is printed, and written to --metrics-addr-file).
    #[arg(long, value_name = "ADDR:PORT")]
    pub metrics: Option<String>,
    /// With --metrics: write the bound ADDR:PORT to this file once the endpoint is up.
    #[arg(long, value_name = "PATH", requires = "metrics")]
    pub metrics_addr_file: Option<PathBuf>,
    /// Log format on stderr: text, or json (one object per line, for log shippers).
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    /// More log detail: -v debug, -vv trace (RUST_LOG, when set, wins).
    #[arg(short, long, action = clap::ArgAction::Count)]
    pub verbose: u8,
    /// Write "READY=1" and a newline to this open file descriptor, then close it, once every
    /// listener (NBD sockets, control sockets, metrics) is bound: a script that waits for it
    /// can connect at once. (With NOTIFY_SOCKET set, systemd is told READY=1 too.)
    #[arg(long, value_name = "FD")]
    pub ready_fd: Option<i32>,
}

/// A section's values when none of its flags is given: clap's defaults, the only ones
/// written down (the sections' `Default` and so a file's left-out keys read them here).
fn flag_defaults<T: Args + FromArgMatches>() -> T {
    let cmd = T::augment_args(clap::Command::new("defaults").no_binary_name(true));
    let m = cmd
        .try_get_matches_from(std::iter::empty::<&str>())
        .expect("a section's flags parse with none given: every default is valid");
    T::from_arg_matches(&m).expect("a section's defaults fill its struct")
}

impl Default for ServerArgs {
    fn default() -> Self {
        flag_defaults()
    }
}

impl Default for LimitArgs {
    fn default() -> Self {
        flag_defaults()
    }
}

impl Default for TlsArgs {
    fn default() -> Self {
        flag_defaults()
    }
}

impl LimitArgs {
    /// Applies the limits to the server's tuning.
    pub fn apply(&self, t: &mut nbd::server::Tuning) {
        if let Some(n) = self.max_connections {
            t.max_connections = n.get();
        }
        t.handshake_timeout = self.handshake_timeout.duration();
        t.idle_timeout = self.idle_timeout.map(Seconds::duration);
        t.send_timeout = self.send_timeout.duration();
        if let Some(b) = self.memory_budget {
            t.memory_budget = b.0;
        }
        t.budget_impl = self.budget_impl;
        t.splice_rule = self.splice_rule;
    }
}

/// A value as a TOML file may spell it: a number, or the flag's text.
#[derive(Deserialize)]
#[serde(untagged)]
pub enum Spelling {
    /// An integer (`0o660`, `30`).
    Int(i64),
    /// A float (`2.5`).
    Float(f64),
    /// The flag's text (`"660"`, `"512M"`).
    Text(String),
}

/// Deserializes a value from the flag's text, with its `FromStr` (one validation for both).
fn parsed<'de, D, T>(d: D) -> std::result::Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: FromStr,
    T::Err: fmt::Display,
{
    let s = String::deserialize(d)?;
    s.parse().map_err(serde::de::Error::custom)
}

/// [`parsed`], for an optional value.
fn parsed_option<'de, D, T>(d: D) -> std::result::Result<Option<T>, D::Error>
where
    D: Deserializer<'de>,
    T: FromStr,
    T::Err: fmt::Display,
{
    parsed(d).map(Some)
}

/// A positive number of seconds (fractions allowed), at most 10^9.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(try_from = "Spelling")]
pub struct Seconds(f64);

impl Seconds {
    /// Checks `v`.
    pub fn new(v: f64) -> std::result::Result<Self, String> {
        if v > 0.0 && v.is_finite() && v <= 1e9 {
            Ok(Self(v))
        } else {
            Err(format!("{v} is not a positive number of seconds"))
        }
    }

    /// As a duration.
    pub fn duration(self) -> std::time::Duration {
        std::time::Duration::from_secs_f64(self.0)
    }
}

impl FromStr for Seconds {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let v = s
            .parse::<f64>()
            .map_err(|_| format!("{s:?} is not a positive number of seconds"))?;
        Self::new(v)
    }
}

impl TryFrom<Spelling> for Seconds {
    type Error = String;
    fn try_from(v: Spelling) -> std::result::Result<Self, String> {
        match v {
            Spelling::Int(n) => Self::new(n as f64),
            Spelling::Float(f) => Self::new(f),
            Spelling::Text(s) => s.parse(),
        }
    }
}

/// `--shutdown-timeout`: whole seconds, 1 to 86400.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(try_from = "Spelling")]
pub struct ShutdownTimeout(pub u64);

impl ShutdownTimeout {
    const RANGE: std::ops::RangeInclusive<u64> = 1..=86400;

    fn new(v: i128) -> std::result::Result<Self, String> {
        match u64::try_from(v) {
            Ok(s) if Self::RANGE.contains(&s) => Ok(Self(s)),
            _ => Err(format!("{v} must be between 1 and 86400 seconds")),
        }
    }
}

impl FromStr for ShutdownTimeout {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let v = s
            .parse::<i128>()
            .map_err(|_| format!("{s:?} is not a whole number of seconds"))?;
        Self::new(v)
    }
}

impl TryFrom<Spelling> for ShutdownTimeout {
    type Error = String;
    fn try_from(v: Spelling) -> std::result::Result<Self, String> {
        match v {
            Spelling::Int(n) => Self::new(n.into()),
            Spelling::Float(f) => Err(format!("{f} is not a whole number of seconds")),
            Spelling::Text(s) => s.parse(),
        }
    }
}

/// A byte count, not zero: an integer, or text with a K/M/G/T suffix (`512M`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(try_from = "Spelling")]
pub struct Bytes(pub u64);

impl FromStr for Bytes {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match blk_drivers::spec::parse_size(s) {
            Ok(0) => Err("must not be zero".into()),
            Ok(v) => Ok(Self(v)),
            Err(e) => Err(e.to_string()),
        }
    }
}

impl TryFrom<Spelling> for Bytes {
    type Error = String;
    fn try_from(v: Spelling) -> std::result::Result<Self, String> {
        match v {
            Spelling::Int(n) if n > 0 => Ok(Self(n as u64)),
            Spelling::Int(n) => Err(format!("{n} is not a positive byte count")),
            Spelling::Float(f) => Err(format!("{f} is not a whole number of bytes")),
            Spelling::Text(s) => s.parse(),
        }
    }
}

/// Permission bits: octal text (`600`, `0660`), or in a file an integer written in octal
/// (`0o660`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(try_from = "Spelling")]
pub struct OctalMode(pub u32);

impl FromStr for OctalMode {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match u32::from_str_radix(s.trim_start_matches("0o"), 8) {
            Ok(m) if m <= 0o777 => Ok(Self(m)),
            _ => Err(format!(
                "bad mode {s:?}: expected octal permission bits such as 600"
            )),
        }
    }
}

impl TryFrom<Spelling> for OctalMode {
    type Error = String;
    fn try_from(v: Spelling) -> std::result::Result<Self, String> {
        match v {
            Spelling::Int(m) if (0..=0o777).contains(&m) => Ok(Self(m as u32)),
            Spelling::Int(m) => Err(format!(
                "{m} is not permission bits: write them in octal, 0o660 or \"660\""
            )),
            Spelling::Float(f) => Err(format!("{f} is not permission bits")),
            Spelling::Text(s) => s.parse(),
        }
    }
}

/// Resolves `ADDR:PORT` (`--listen`, `--metrics`).
pub fn listen_addr(s: &str) -> Result<SocketAddr> {
    s.to_socket_addrs()
        .with_context(|| format!("bad address {s:?} (expected ADDR:PORT)"))?
        .next()
        .with_context(|| format!("{s:?} resolves to no address"))
}

/// `blkq serve` as its own command, for tests.
#[cfg(test)]
#[derive(clap::Parser)]
pub struct ServeCommand {
    #[command(flatten)]
    args: ServeArgs,
}

/// Parses `blkq serve`'s flags (`v` without the program's name), for tests.
#[cfg(test)]
pub fn parse_serve_flags(v: &[&str]) -> std::result::Result<ServeArgs, clap::Error> {
    use clap::Parser;
    ServeCommand::try_parse_from(std::iter::once("serve").chain(v.iter().copied())).map(|c| c.args)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    fn parse(v: &[&str]) -> std::result::Result<ServeArgs, clap::Error> {
        parse_serve_flags(v)
    }

    #[test]
    fn defaults_are_the_flags_and_parse() {
        let a = parse(&[]).unwrap();
        assert_eq!(
            format!("{:?}", a.server),
            format!("{:?}", ServerArgs::default())
        );
        assert_eq!(
            format!("{:?}", a.limits),
            format!("{:?}", LimitArgs::default())
        );
        assert_eq!(format!("{:?}", a.tls), format!("{:?}", TlsArgs::default()));
        assert_eq!(a.server.socket_mode, OctalMode(0o600));
        assert_eq!(a.server.shutdown_timeout, ShutdownTimeout(30));
        assert_eq!(a.limits.send_timeout, Seconds(30.0));
        assert_eq!(a.tls.tls, TlsMode::Off);
    }

    #[test]
    fn limits_parse_and_apply() {
        let l = parse(&[
            "--memory-budget",
            "512M",
            "--idle-timeout",
            "2.5",
            "--max-connections",
            "7",
        ])
        .unwrap()
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
            ["--max-connections", "0"],
            ["--shutdown-timeout", "0"],
            ["--shutdown-timeout", "86401"],
            ["--socket-mode", "800"],
            ["--tls", "maybe"],
            ["--sched", "cfq"],
        ] {
            assert!(parse(&bad).is_err(), "{bad:?}");
        }
    }

    /// Every flag but `--config` and the reporting ones belongs to a section `--config`
    /// refuses; the reporting ones are allowed with it.
    #[test]
    fn config_is_given_alone() {
        let cmd = ServeCommand::command();
        let report: Vec<String> = ReportArgs::augment_args(clap::Command::new("r"))
            .get_arguments()
            .map(|a| a.get_id().to_string())
            .collect();
        for arg in cmd.get_arguments() {
            let id = arg.get_id().as_str();
            let Some(long) = arg.get_long() else { continue };
            if matches!(id, "config" | "help") {
                continue;
            }
            // A valid value: the default, or one each parser takes.
            let sample = arg
                .get_default_values()
                .first()
                .map(|v| v.to_string_lossy().into_owned())
                .unwrap_or_else(|| match id {
                    "policy" => "fifo".into(),
                    "sched" => "none".into(),
                    "sched_lock" => "locked".into(),
                    _ => "1".into(),
                });
            let flag = format!("--{long}");
            let mut v = vec!["--config", "c.toml", flag.as_str()];
            if arg.get_action().takes_values() {
                v.push(&sample);
            }
            if report.iter().any(|r| r == id) {
                if let Err(e) = parse(&v) {
                    assert_ne!(
                        e.kind(),
                        clap::error::ErrorKind::ArgumentConflict,
                        "{flag} is refused with --config: {e}"
                    );
                }
            } else {
                let e = parse(&v).err().map(|e| e.kind());
                assert_eq!(
                    e,
                    Some(clap::error::ErrorKind::ArgumentConflict),
                    "{flag} is not refused with --config"
                );
            }
        }
    }

    #[test]
    fn listen_addresses() {
        assert!(listen_addr("nonsense").is_err());
        assert_eq!(listen_addr("127.0.0.1:1").unwrap().port(), 1);
    }
}
