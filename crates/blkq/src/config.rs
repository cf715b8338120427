//! `blkq serve`'s configuration: one [`Config`] for the command line and for
//! `--config FILE.toml`, one validation ([`Config::check`]) and one builder
//! ([`Checked::build`]) for both.
//!
//! The command line is turned into the same `Config` the TOML file deserializes into
//! ([`Config::from_args`]), so a flag and its key cannot drift apart: every key is its flag's
//! name with `-` as `_` (`--socket-mode` is `[server] socket_mode`). Errors name where the bad
//! value was given: `blkq.toml:12: allow: ...` for the file (TOML syntax errors and unknown
//! keys come with their line from the parser; semantic ones through the `Spanned` fields
//! below), `--allow: ...` for the command line.
//!
//! `--config` is given alone: every other `blkq serve` flag is refused next to it (clap's
//! conflict, see [`CONFLICTS_WITH_CONFIG`]), so what a service serves is all in its file.
//!
//! Relative paths in the file (`[server] socket`, `[tls] certificates`, `file:` device specs of
//! `[[export]] device` and `[[raid1]] legs`, `[[raid1]] control`) are from the file's directory
//! ([`Config::load`]), as whoever reads the file expects; on the command line they are from the
//! working directory, as usual. A key left out takes the flag's default as is (`./blkq.sock`).
//!
//! Layout (see docs/blkq.example.toml):
//! ```toml
//! [server]   # socket, socket_mode, listen, no_tcp, no_unix, queue_depth, hw_queues,
//!            # policy, sched, sched_lock, describe_paths, shutdown_timeout
//! [limits]   # max_connections, handshake_timeout, idle_timeout, send_timeout, memory_budget
//! [tls]      # mode = "off" | "on" | "require", certificates = DIR, verify_peer
//! [[export]] # name, description, device, read_only, allow = [CIDR...],
//!            # allow_subjects = [SUBJECT | "attr:TYPE=VALUE" ...] (nbd::server::access)
//! [[raid1]]  # name, description, legs = [SPEC...], create, options = ["k=v"...], control,
//!            # read_only, allow, allow_subjects
//! ```
//! Exports are served in the order of the `[[export]]` tables, then the `[[raid1]]` ones.

use std::net::SocketAddr;
use std::ops::Range;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use blk::{Device, PoolPolicy, Queue};
use blk_drivers::spec::{DeviceSpec, Kind, QueueOverrides};
use blkq_sync::DynArc as Arc;
use nbd::server::{parse_cidr, parse_subject_rule, Access, Export, ServerConfig};
use serde::Deserialize;
use toml::Spanned;

use crate::control::Control;
use crate::serve::{LimitArgs, ServeArgs};

/// The `blkq serve` flags that `--config` refuses next to it: all of them (clap argument ids).
/// A new flag must be added here or to [`ALLOWED_WITH_CONFIG`] (a test checks).
pub const CONFLICTS_WITH_CONFIG: &[&str] = &[
    "budget_impl",
    "tls",
    "tls_certificates",
    "tls_verify_peer",
    "devices",
    "exports",
    "socket",
    "socket_mode",
    "listen",
    "no_tcp",
    "no_unix",
    "read_only",
    "allow",
    "allow_subjects",
    "queue_depth",
    "hw_queues",
    "policy",
    "sched",
    "sched_lock",
    "raid1",
    "raid1_create",
    "raid1_options",
    "control",
    "describe_paths",
    "shutdown_timeout",
    "max_connections",
    "handshake_timeout",
    "idle_timeout",
    "send_timeout",
    "memory_budget",
];

/// `blkq serve` flags that may be given with `--config` (they do not describe what is
/// served). None yet.
#[allow(dead_code)] // read by the test that keeps the two lists and the flags in step
pub const ALLOWED_WITH_CONFIG: &[&str] = &[
    "config",
    // How the process reports, not what it serves: fine beside a file.
    "metrics",
    "metrics_addr_file",
    "log_format",
    "verbose",
];

/// Where a [`Config`] came from, to name the place of an error.
#[derive(Debug, Clone)]
pub enum Source {
    /// The command line: errors name the flag.
    CommandLine,
    /// A TOML file and its text: errors name the file and line.
    File {
        /// The path as given.
        path: PathBuf,
        /// Its contents (spans index into it).
        text: String,
    },
}

impl Source {
    /// The start of an error about the value of `key` (flag `--flag`) found at `span`:
    /// `FILE:LINE: key` or `--flag`.
    fn at<T>(&self, v: &Spanned<T>, key: &str, flag: &str) -> String {
        self.at_span(v.span(), key, flag)
    }

    fn at_span(&self, span: Range<usize>, key: &str, flag: &str) -> String {
        match self {
            Source::CommandLine => format!("--{flag}"),
            Source::File { path, text } => {
                let end = span.start.min(text.len());
                let line = text.as_bytes()[..end]
                    .iter()
                    .filter(|&&b| b == b'\n')
                    .count()
                    + 1;
                format!("{}:{line}: {key}", path.display())
            }
        }
    }
}

/// Spans of values that came from the command line (they point nowhere).
fn cli<T>(v: T) -> Spanned<T> {
    Spanned::new(0..0, v)
}

/// The whole configuration of `blkq serve`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Listeners, queues and server-wide options.
    #[serde(default)]
    pub server: ServerSection,
    /// Resource limits.
    #[serde(default)]
    pub limits: LimitsSection,
    /// TLS settings.
    #[serde(default)]
    pub tls: TlsSection,
    /// Plain devices, in order.
    #[serde(default, rename = "export")]
    pub exports: Vec<ExportDecl>,
    /// RAID1 arrays, exported after the plain devices.
    #[serde(default, rename = "raid1")]
    pub arrays: Vec<Raid1Decl>,
}

/// `[server]`: the flags of the same names.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ServerSection {
    /// `--socket` (left out: the flag's default, `./blkq.sock`).
    pub socket: Option<PathBuf>,
    /// `--socket-mode`: `0o660` (a TOML octal integer) or `"660"`.
    pub socket_mode: Spanned<Octal>,
    /// `--listen`.
    pub listen: Spanned<String>,
    /// `--no-tcp`.
    pub no_tcp: bool,
    /// `--no-unix`.
    pub no_unix: bool,
    /// `--queue-depth`.
    pub queue_depth: Option<u32>,
    /// `--hw-queues`.
    pub hw_queues: Option<u16>,
    /// `--policy`.
    pub policy: Option<Spanned<String>>,
    /// `--sched`.
    pub sched: Spanned<String>,
    /// `--sched-lock`.
    pub sched_lock: Option<Spanned<String>>,
    /// `--describe-paths`.
    pub describe_paths: bool,
    /// `--shutdown-timeout`, seconds.
    pub shutdown_timeout: Spanned<u64>,
}

impl Default for ServerSection {
    /// The command line's defaults (a test checks they agree).
    fn default() -> Self {
        Self {
            socket: None,
            socket_mode: cli(Octal::Int(i64::from(nbd::server::DEFAULT_UNIX_MODE))),
            listen: cli(nbd::server::DEFAULT_TCP_ADDR.into()),
            no_tcp: false,
            no_unix: false,
            queue_depth: None,
            hw_queues: None,
            policy: None,
            sched: cli("none".into()),
            sched_lock: None,
            describe_paths: false,
            shutdown_timeout: cli(30),
        }
    }
}

/// Permission bits: a TOML integer (`0o660`) or an octal string (`"660"`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
pub enum Octal {
    /// An integer: write it in octal (`0o660`).
    Int(i64),
    /// Octal digits.
    Str(String),
}

/// A byte count: an integer or a string with a K/M/G/T suffix (`"512M"`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
pub enum Size {
    /// Bytes.
    Int(i64),
    /// `"256M"`, `"2G"`, ...
    Str(String),
}

/// `[limits]`: the flags of the same names (see `LimitArgs`).
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LimitsSection {
    /// `--max-connections`.
    pub max_connections: Option<Spanned<i64>>,
    /// `--handshake-timeout`, seconds.
    pub handshake_timeout: Spanned<f64>,
    /// `--idle-timeout`, seconds.
    pub idle_timeout: Option<Spanned<f64>>,
    /// `--send-timeout`, seconds.
    pub send_timeout: Spanned<f64>,
    /// `--memory-budget`.
    pub memory_budget: Option<Spanned<Size>>,
}

impl Default for LimitsSection {
    fn default() -> Self {
        Self::from(&LimitArgs::default())
    }
}

impl From<&LimitArgs> for LimitsSection {
    fn from(l: &LimitArgs) -> Self {
        Self {
            max_connections: l.max_connections.map(|n| cli(n as i64)),
            handshake_timeout: cli(l.handshake_timeout),
            idle_timeout: l.idle_timeout.map(cli),
            send_timeout: cli(l.send_timeout),
            memory_budget: l.memory_budget.map(|b| cli(Size::Int(b as i64))),
        }
    }
}

/// `--tls` / `[tls] mode`, with nbdkit's meaning.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum TlsMode {
    /// No TLS.
    #[default]
    Off,
    /// TLS offered; clients may go on without it.
    On,
    /// Every option but STARTTLS and ABORT is refused before TLS.
    Require,
}

/// `[tls]`: `--tls`, `--tls-certificates`, `--tls-verify-peer`, one to one.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TlsSection {
    /// `--tls`.
    pub mode: Spanned<TlsMode>,
    /// `--tls-certificates DIR` (`ca-cert.pem`, `server-cert.pem`, `server-key.pem`).
    pub certificates: Option<PathBuf>,
    /// `--tls-verify-peer`: ask clients for a certificate signed by the CA and check it.
    pub verify_peer: Spanned<bool>,
}

impl Default for TlsSection {
    fn default() -> Self {
        Self {
            mode: cli(TlsMode::Off),
            certificates: None,
            verify_peer: cli(false),
        }
    }
}

/// `[[export]]`: one device (`--device SPEC --export NAME`).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExportDecl {
    /// The export name (default `""`, the default export).
    pub name: Option<Spanned<String>>,
    /// What clients are told (default: the kind of device and its size; see
    /// `describe_paths`).
    pub description: Option<String>,
    /// The device spec, as `--device` takes it.
    pub device: Spanned<String>,
    /// Export read-only (file devices are opened read-only).
    #[serde(default)]
    pub read_only: bool,
    /// Client addresses (CIDRs) allowed over TCP; empty: any.
    #[serde(default)]
    pub allow: Vec<Spanned<String>>,
    /// TLS certificate subjects allowed; empty: any (needs `[tls] verify_peer`).
    #[serde(default)]
    pub allow_subjects: Vec<Spanned<String>>,
}

/// `[[raid1]]`: a mirror (`--raid1 LEG,LEG --raid1-create --raid1-option K=V --control`).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Raid1Decl {
    /// The export name (default `""`).
    pub name: Option<Spanned<String>>,
    /// What clients are told.
    pub description: Option<String>,
    /// The legs' device specs, one per entry (options after each, as in `--raid1`).
    pub legs: Spanned<Vec<Spanned<String>>>,
    /// The legs are blank: create the array on them first.
    #[serde(default)]
    pub create: bool,
    /// Array options, `KEY=VALUE` as `--raid1-option` takes them.
    #[serde(default)]
    pub options: Vec<Spanned<String>>,
    /// A control socket for `blkq raid ... --control PATH`.
    pub control: Option<PathBuf>,
    /// Export read-only.
    #[serde(default)]
    pub read_only: bool,
    /// As in `[[export]]`.
    #[serde(default)]
    pub allow: Vec<Spanned<String>>,
    /// As in `[[export]]`.
    #[serde(default)]
    pub allow_subjects: Vec<Spanned<String>>,
}

/// A validated configuration: everything parsed, nothing opened yet.
#[derive(Debug, Clone)]
pub struct Checked {
    /// Queue settings every device gets (`read_only` is per export).
    pub ov: QueueOverrides,
    /// The TCP address (`None`: `no_tcp`).
    pub tcp: Option<SocketAddr>,
    /// The Unix socket and its mode (`None`: `no_unix`).
    pub unix: Option<(PathBuf, u32)>,
    /// Resource limits.
    pub limits: LimitArgs,
    /// Seconds of `--shutdown-timeout`.
    pub shutdown_timeout: u64,
    /// Send full descriptions.
    pub describe_paths: bool,
    /// TLS settings.
    pub tls: TlsSettings,
    /// The exports, in order.
    pub exports: Vec<CheckedExport>,
}

/// Validated TLS settings.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TlsSettings {
    /// Off, on or require.
    pub mode: TlsMode,
    /// The certificates directory.
    pub certificates: Option<PathBuf>,
    /// Verify client certificates.
    pub verify_peer: bool,
}

/// One validated export.
#[derive(Debug, Clone, PartialEq)]
pub struct CheckedExport {
    /// Its name.
    pub name: String,
    /// A description given in the file, sent as is.
    pub description: Option<String>,
    /// What it serves.
    pub what: What,
    /// Read-only.
    pub read_only: bool,
    /// Who may use it.
    pub access: Access,
}

/// What an export serves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum What {
    /// A device spec (validated).
    Device(String),
    /// A mirror.
    Raid1 {
        /// The legs' specs.
        legs: Vec<String>,
        /// Create it first.
        create: bool,
        /// `KEY=VALUE` options (validated).
        options: Vec<String>,
        /// Its control socket.
        control: Option<PathBuf>,
    },
}

/// What [`Checked::build`] made: the server's configuration and what to print.
pub struct Plan {
    /// Exports, listeners and tuning.
    pub server: ServerConfig,
    /// The full description of each export (printed locally).
    pub local: Vec<String>,
    /// Control sockets to start, one per mirror that asked for one.
    pub controls: Vec<(PathBuf, Arc<Control>)>,
    /// Every mirror, by export name (for metrics), with its control (shared with its socket).
    pub arrays: Vec<(String, Arc<Control>)>,
}

impl Config {
    /// Reads and parses a TOML file (syntax errors and unknown keys name the line), and makes
    /// the relative paths it gives relative to its directory ([`Config::paths_from`]).
    pub fn load(path: &Path) -> Result<(Config, Source)> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading --config {}", path.display()))?;
        let mut cfg = Self::parse(path, &text)?;
        let src = Source::File {
            path: path.to_path_buf(),
            text,
        };
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            cfg.paths_from(dir, &src)?;
        }
        Ok((cfg, src))
    }

    /// Joins `dir` (the file's directory) to every relative path of the file: the socket, the
    /// certificates directory, control sockets, and the paths of `file:` device specs.
    fn paths_from(&mut self, dir: &Path, src: &Source) -> Result<()> {
        let join = |p: &mut PathBuf| {
            if p.is_relative() {
                *p = dir.join(&*p);
            }
        };
        let spec = |v: &mut Spanned<String>, key: &str| -> Result<()> {
            let s = spec_from(v.get_ref(), dir)
                .with_context(|| format!("{} {:?}", src.at(v, key, key), v.get_ref()))?;
            *v.get_mut() = s;
            Ok(())
        };
        if let Some(p) = &mut self.server.socket {
            join(p);
        }
        if let Some(p) = &mut self.tls.certificates {
            join(p);
        }
        for e in &mut self.exports {
            spec(&mut e.device, "device")?;
        }
        for r in &mut self.arrays {
            if let Some(p) = &mut r.control {
                join(p);
            }
            for leg in r.legs.get_mut() {
                spec(leg, "legs")?;
            }
        }
        Ok(())
    }

    /// Parses TOML `text` read from `path`.
    pub fn parse(path: &Path, text: &str) -> Result<Config> {
        toml::from_str(text).map_err(|e| {
            let line = e.span().map(|s| {
                text.as_bytes()[..s.start.min(text.len())]
                    .iter()
                    .filter(|&&b| b == b'\n')
                    .count()
                    + 1
            });
            let msg = e.message().trim_end().to_string();
            match line {
                Some(l) => anyhow::anyhow!("{}:{l}: {msg}", path.display()),
                None => anyhow::anyhow!("{}: {msg}", path.display()),
            }
        })
    }

    /// The configuration the command line describes.
    pub fn from_args(a: &ServeArgs) -> Result<Config> {
        let allow: Vec<Spanned<String>> = a.allow.iter().cloned().map(cli).collect();
        let allow_subjects: Vec<Spanned<String>> =
            a.allow_subjects.iter().cloned().map(cli).collect();
        let mut cfg = Config {
            server: ServerSection {
                socket: Some(a.socket.clone()),
                socket_mode: cli(Octal::Int(i64::from(a.socket_mode))),
                listen: cli(a.listen.clone()),
                no_tcp: a.no_tcp,
                no_unix: a.no_unix,
                queue_depth: a.queue_depth,
                hw_queues: a.hw_queues,
                policy: a.policy.clone().map(cli),
                sched: cli(a.sched.clone()),
                sched_lock: a.sched_lock.clone().map(cli),
                describe_paths: a.describe_paths,
                shutdown_timeout: cli(a.shutdown_timeout),
            },
            limits: LimitsSection::from(&a.limits),
            // mode <- --tls, certificates <- --tls-certificates, verify_peer <- --tls-verify-peer.
            tls: TlsSection {
                mode: cli(a.tls.tls),
                certificates: a.tls.tls_certificates.clone(),
                verify_peer: cli(a.tls.tls_verify_peer),
            },
            exports: Vec::new(),
            arrays: Vec::new(),
        };
        if let Some(d) = a
            .devices
            .iter()
            .find(|d| d.starts_with(crate::serve::RAID1_DEVICE))
        {
            bail!("--device {d:?}: a mirror is given with --raid1 LEG,LEG[,...]");
        }
        for (name, spec) in crate::serve::pairs(a)? {
            if let Some(legs) = spec.strip_prefix(crate::serve::RAID1_DEVICE) {
                let legs = crate::raid::split_legs(legs)?;
                cfg.arrays.push(Raid1Decl {
                    name: Some(cli(name)),
                    description: None,
                    legs: cli(legs.into_iter().map(cli).collect()),
                    create: a.raid1_create,
                    options: a.raid1_options.iter().cloned().map(cli).collect(),
                    control: a.control.clone(),
                    read_only: a.read_only,
                    allow: allow.clone(),
                    allow_subjects: allow_subjects.clone(),
                });
            } else {
                cfg.exports.push(ExportDecl {
                    name: Some(cli(name)),
                    description: None,
                    device: cli(spec),
                    read_only: a.read_only,
                    allow: allow.clone(),
                    allow_subjects: allow_subjects.clone(),
                });
            }
        }
        Ok(cfg)
    }

    /// Validates everything that can be without opening a device.
    pub fn check(&self, src: &Source) -> Result<Checked> {
        let s = &self.server;
        let sched: blk::sched::SchedChoice = s
            .sched
            .get_ref()
            .parse()
            .with_context(|| src.at(&s.sched, "sched", "sched"))?;
        let sched_lock = match &s.sched_lock {
            Some(v) => Some(
                v.get_ref()
                    .parse::<blk::sched::LockMode>()
                    .with_context(|| src.at(v, "sched_lock", "sched-lock"))?,
            ),
            None => None,
        };
        let policy = match &s.policy {
            Some(v) => Some(
                v.get_ref()
                    .parse::<PoolPolicy>()
                    .with_context(|| src.at(v, "policy", "policy"))?,
            ),
            None => None,
        };
        if s.no_tcp && s.no_unix {
            bail!("no_tcp and no_unix together leave nothing to listen on");
        }
        let tcp = if s.no_tcp {
            None
        } else {
            Some(
                crate::serve::listen_addr(s.listen.get_ref())
                    .with_context(|| src.at(&s.listen, "listen", "listen"))?,
            )
        };
        let mode = match s.socket_mode.get_ref() {
            Octal::Int(m) if (0..=0o777).contains(m) => *m as u32,
            Octal::Str(t) => crate::serve::parse_octal_mode(t)
                .map_err(anyhow::Error::msg)
                .with_context(|| src.at(&s.socket_mode, "socket_mode", "socket-mode"))?,
            Octal::Int(m) => bail!(
                "{}: {m} is not permission bits: write them in octal, 0o660 or \"660\"",
                src.at(&s.socket_mode, "socket_mode", "socket-mode")
            ),
        };
        let socket = s
            .socket
            .clone()
            .unwrap_or_else(|| nbd::server::DEFAULT_UNIX_PATH.into());
        let unix = (!s.no_unix).then_some((socket, mode));
        if !(1..=86400).contains(s.shutdown_timeout.get_ref()) {
            bail!(
                "{}: must be between 1 and 86400 seconds",
                src.at(&s.shutdown_timeout, "shutdown_timeout", "shutdown-timeout")
            );
        }
        let limits = self.limits.check(src)?;
        let tls = TlsSettings {
            mode: *self.tls.mode.get_ref(),
            certificates: self.tls.certificates.clone(),
            verify_peer: *self.tls.verify_peer.get_ref(),
        };
        if tls.verify_peer && tls.mode == TlsMode::Off {
            bail!(
                "{}: verifying client certificates needs TLS (mode \"on\" or \"require\")",
                src.at(&self.tls.verify_peer, "verify_peer", "tls-verify-peer")
            );
        }
        let ov = QueueOverrides {
            hw_queues: s.hw_queues,
            queue_depth: s.queue_depth,
            policy,
            sched: Some(sched),
            sched_lock,
            ..QueueOverrides::default()
        };

        let mut exports: Vec<CheckedExport> = Vec::new();
        let mut names: Vec<(String, String)> = Vec::new(); // name, where
        let mut add_name = |name: &Option<Spanned<String>>, fallback: Range<usize>| {
            let (n, span) = match name {
                Some(n) => (n.get_ref().clone(), n.span()),
                None => (String::new(), fallback),
            };
            let at = src.at_span(span, "name", "export");
            if n.len() > 4096 || n.contains('\0') {
                bail!("{at}: {n:?} is not a valid export name (at most 4096 bytes, no NUL)");
            }
            if let Some((_, first)) = names.iter().find(|(m, _)| *m == n) {
                bail!("{at}: a second export named {n:?} (the first: {first})");
            }
            names.push((n.clone(), at));
            Ok(n)
        };
        for e in &self.exports {
            let name = add_name(&e.name, e.device.span())?;
            let spec = e.device.get_ref();
            let at = src.at(&e.device, "device", "device");
            if spec.starts_with(crate::serve::RAID1_DEVICE) {
                bail!("{at} {spec:?}: a mirror is a [[raid1]] table (--raid1 LEG,LEG on the command line)");
            }
            let parsed: DeviceSpec = spec.parse().with_context(|| format!("{at} {spec:?}"))?;
            parsed
                .fault_config()
                .with_context(|| format!("{at} {spec:?}"))?;
            exports.push(CheckedExport {
                name,
                description: e.description.clone(),
                what: What::Device(spec.clone()),
                read_only: e.read_only,
                access: access(src, &e.allow, &e.allow_subjects, &tls)?,
            });
        }
        for r in &self.arrays {
            let name = add_name(&r.name, r.legs.span())?;
            let at = src.at(&r.legs, "legs", "raid1");
            if r.legs.get_ref().len() < 2 {
                bail!("{at}: a mirror needs at least two legs");
            }
            for leg in r.legs.get_ref() {
                let spec = leg.get_ref();
                spec.parse::<DeviceSpec>()
                    .with_context(|| format!("{} {spec:?}", src.at(leg, "legs", "raid1")))?;
            }
            for o in &r.options {
                crate::raid::raid1_config(std::slice::from_ref(o.get_ref()))
                    .with_context(|| src.at(o, "options", "raid1-option"))?;
            }
            exports.push(CheckedExport {
                name,
                description: r.description.clone(),
                what: What::Raid1 {
                    legs: r
                        .legs
                        .get_ref()
                        .iter()
                        .map(|l| l.get_ref().clone())
                        .collect(),
                    create: r.create,
                    options: r.options.iter().map(|o| o.get_ref().clone()).collect(),
                    control: r.control.clone(),
                },
                read_only: r.read_only,
                access: access(src, &r.allow, &r.allow_subjects, &tls)?,
            });
        }
        if exports.is_empty() {
            bail!("nothing to serve: no [[export]] or [[raid1]] table");
        }
        Ok(Checked {
            ov,
            tcp,
            unix,
            limits,
            shutdown_timeout: *s.shutdown_timeout.get_ref(),
            describe_paths: s.describe_paths,
            tls,
            exports,
        })
    }
}

/// `spec` with the path of a `file:` spec joined to `dir` when it is relative; other specs as
/// they are.
fn spec_from(spec: &str, dir: &Path) -> Result<String> {
    let Some(rest) = spec.strip_prefix("file:") else {
        return Ok(spec.to_string());
    };
    let (path, opts) = match rest.split_once(',') {
        Some((p, o)) => (p, Some(o)),
        None => (rest, None),
    };
    if path.is_empty() || Path::new(path).is_absolute() {
        return Ok(spec.to_string());
    }
    let full = dir.join(path);
    let Some(full) = full.to_str().filter(|f| !f.contains(',')) else {
        bail!(
            "the path is relative to the config file's directory, {}, whose name a device spec \
             cannot hold (a comma, or not UTF-8): write the path absolute",
            dir.display()
        );
    };
    Ok(match opts {
        Some(o) => format!("file:{full},{o}"),
        None => format!("file:{full}"),
    })
}

/// An export's access rules, validated.
fn access(
    src: &Source,
    allow: &[Spanned<String>],
    subjects: &[Spanned<String>],
    tls: &TlsSettings,
) -> Result<Access> {
    let mut a = Access::default();
    for c in allow {
        let net = parse_cidr(c.get_ref()).with_context(|| src.at(c, "allow", "allow"))?;
        a.allow.push(net);
    }
    for s in subjects {
        let at = src.at(s, "allow_subjects", "allow-subject");
        // Checked here, kept as written: nbd::server::access matches it, exactly.
        if let Err(e) = parse_subject_rule(s.get_ref()) {
            bail!("{at}: {e}");
        }
        if !tls.verify_peer {
            bail!(
                "{at}: certificate subjects need verified client certificates ([tls] \
                 verify_peer = true, --tls-verify-peer): without them no client has a subject"
            );
        }
        a.allow_subjects.push(s.get_ref().clone());
    }
    Ok(a)
}

impl LimitsSection {
    /// The limits, validated as the command line's parsers do.
    fn check(&self, src: &Source) -> Result<LimitArgs> {
        let secs = |v: &Spanned<f64>, key: &str| -> Result<f64> {
            let x = *v.get_ref();
            if x > 0.0 && x.is_finite() && x <= 1e9 {
                Ok(x)
            } else {
                bail!(
                    "{}: {x} is not a positive number of seconds",
                    src.at(v, key, &key.replace('_', "-"))
                )
            }
        };
        let max_connections = match &self.max_connections {
            Some(n) if *n.get_ref() >= 1 => Some(*n.get_ref() as usize),
            Some(n) => bail!(
                "{}: must be at least 1",
                src.at(n, "max_connections", "max-connections")
            ),
            None => None,
        };
        let memory_budget = match &self.memory_budget {
            None => None,
            Some(v) => {
                let at = src.at(v, "memory_budget", "memory-budget");
                let b = match v.get_ref() {
                    Size::Int(n) if *n > 0 => *n as u64,
                    Size::Int(n) => bail!("{at}: {n} is not a positive byte count"),
                    Size::Str(s) => {
                        crate::serve::parse_bytes(s).map_err(|e| anyhow::anyhow!("{at}: {e}"))?
                    }
                };
                Some(b)
            }
        };
        Ok(LimitArgs {
            max_connections,
            handshake_timeout: secs(&self.handshake_timeout, "handshake_timeout")?,
            idle_timeout: match &self.idle_timeout {
                Some(v) => Some(secs(v, "idle_timeout")?),
                None => None,
            },
            send_timeout: secs(&self.send_timeout, "send_timeout")?,
            memory_budget,
            // A benchmark's switch, a command-line flag only (refused with --config).
            budget_impl: nbd::server::BudgetImpl::Atomic,
        })
    }
}

impl Checked {
    /// Opens the devices and assembles the mirrors: the server's configuration.
    pub fn build(&self) -> Result<Plan> {
        let mut exports = Vec::new();
        let mut local = Vec::new();
        let mut controls = Vec::new();
        let mut arrays = Vec::new();
        for e in &self.exports {
            let ov = QueueOverrides {
                read_only: e.read_only,
                ..self.ov.clone()
            };
            let (dev, full, kind, read_only): (Arc<dyn Device>, String, &str, bool) = match &e.what
            {
                What::Raid1 {
                    legs,
                    create,
                    options,
                    control,
                } => {
                    let leg_ov = QueueOverrides {
                        read_only: false,
                        ..self.ov.clone()
                    };
                    let (r, specs) = crate::serve::build_raid1(legs, *create, options, &leg_ov)?;
                    let uuid = r.superblock(0).map(|s| s.array_uuid.to_string());
                    let full = format!(
                        "raid1 {} (array {})",
                        legs.join(","),
                        uuid.unwrap_or_default()
                    );
                    let ctl = Arc::new(Control::new(r.clone(), specs, leg_ov));
                    if let Some(path) = control {
                        controls.push((path.clone(), ctl.clone()));
                    }
                    arrays.push((e.name.clone(), ctl));
                    let dev: Arc<dyn Device> = r;
                    (dev, full, "raid1", e.read_only)
                }
                What::Device(spec) => {
                    let name = &e.name;
                    let parsed: DeviceSpec = spec
                        .parse()
                        .with_context(|| format!("device spec {spec:?}"))?;
                    let fault = parsed
                        .fault_config()
                        .with_context(|| format!("device spec {spec:?}"))?;
                    let (dev, describe): (Arc<dyn Device>, String) = if fault.is_some() {
                        tracing::warn!(
                            export = %name,
                            "{spec}: fault injection is on: I/O fails or is delayed on purpose"
                        );
                        let dev = parsed
                            .build_device(&ov)
                            .with_context(|| format!("building device {spec:?}"))?;
                        (dev, "with fault injection".to_string())
                    } else {
                        let q: Queue = parsed
                            .build(&ov)
                            .with_context(|| format!("building device {spec:?}"))?;
                        let describe = q.describe();
                        (Arc::new(q), describe)
                    };
                    if spec.starts_with("mem:") {
                        tracing::warn!(
                            export = %name,
                            "{spec}: the data lives in memory and is lost when the server stops"
                        );
                    }
                    let kind = match parsed.kind {
                        Kind::Null(_) => "null",
                        Kind::Mem(_) => "mem",
                        Kind::File(_) => "file",
                    };
                    let ro = e.read_only || parsed.is_read_only(&ov);
                    (dev, format!("{spec} ({describe})"), kind, ro)
                }
            };
            let neutral = crate::serve::neutral_description(kind, dev.limits().capacity);
            let description = match &e.description {
                Some(d) => d.clone(),
                None if self.describe_paths => full.clone(),
                None => neutral,
            };
            exports.push(
                Export::new(e.name.clone(), dev)
                    .description(description)
                    .read_only(read_only)
                    .access(e.access.clone()),
            );
            local.push(full);
        }
        let mut cfg = ServerConfig::new(exports);
        cfg.tuning.drain_timeout = std::time::Duration::from_secs(self.shutdown_timeout);
        self.limits.apply(&mut cfg.tuning);
        cfg.tcp = self.tcp;
        if let Some((path, mode)) = &self.unix {
            cfg.unix = Some(path.clone());
            cfg.unix_mode = *mode;
        }
        Ok(Plan {
            server: cfg,
            local,
            controls,
            arrays,
        })
    }
}

/// The warning for a TCP listener others can reach, naming the risk; `None` on loopback or
/// with TLS required.
pub fn exposure_warning(addr: SocketAddr, tls: TlsMode, exports: &[Export]) -> Option<String> {
    if addr.ip().to_canonical().is_loopback() || tls == TlsMode::Require {
        return None;
    }
    let open: Vec<&str> = exports
        .iter()
        .filter(|e| e.access.allow.is_empty() && e.access.allow_subjects.is_empty())
        .map(|e| e.name.as_str())
        .collect();
    let clear = match tls {
        TlsMode::Off => {
            "without TLS: every block read and written crosses the network in clear \
                         (anyone on the path can read the data or change the writes)"
        }
        _ => {
            "with TLS optional (mode \"on\"): a client that does not ask for TLS sends and \
              receives every block in clear"
        }
    };
    let who = if open.is_empty() {
        "; every export has an allow-list, but a client address is no proof of identity on \
         its own"
            .to_string()
    } else {
        format!(
            "; anyone who can reach the port can read and write export(s) {open:?}, which have \
             no allow-list"
        )
    };
    Some(format!(
        "listening on {addr}, which is not a loopback address, {clear}{who}. Use TLS \
         (--tls=require) and allow-lists, or listen on 127.0.0.1 and tunnel"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{CommandFactory, Parser};

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        a: ServeArgs,
    }

    fn args(v: &[&str]) -> ServeArgs {
        Cli::try_parse_from(std::iter::once("serve").chain(v.iter().copied()))
            .unwrap()
            .a
    }

    fn file(text: &str) -> Result<Checked> {
        let path = Path::new("blkq.toml");
        let cfg = Config::parse(path, text)?;
        cfg.check(&Source::File {
            path: path.into(),
            text: text.into(),
        })
    }

    fn flags(v: &[&str]) -> Result<Checked> {
        Config::from_args(&args(v))?.check(&Source::CommandLine)
    }

    fn err(r: Result<Checked>) -> String {
        format!("{:#}", r.unwrap_err())
    }

    #[test]
    fn a_file_and_the_equivalent_flags_give_the_same_exports() {
        let text = r#"
[server]
socket = "/tmp/x.sock"
socket_mode = 0o660
listen = "0.0.0.0:10900"
sched = "mq-deadline"
queue_depth = 64
shutdown_timeout = 5

[limits]
max_connections = 7
idle_timeout = 2.5
memory_budget = "512M"

[[export]]
name = "a"
device = "mem:1M"
read_only = true
allow = ["10.0.0.0/8", "127.0.0.1"]

[[export]]
name = "b"
device = "null:1G"
read_only = true
allow = ["10.0.0.0/8", "127.0.0.1"]

[[raid1]]
name = "m"
legs = ["file:/a.img,direct=1", "file:/b.img"]
create = true
options = ["barrier=locked"]
control = "/tmp/ctl"
read_only = true
allow = ["10.0.0.0/8", "127.0.0.1"]
"#;
        let f = file(text).unwrap();
        let c = flags(&[
            "--socket",
            "/tmp/x.sock",
            "--socket-mode",
            "660",
            "--listen",
            "0.0.0.0:10900",
            "--sched",
            "mq-deadline",
            "--queue-depth",
            "64",
            "--shutdown-timeout",
            "5",
            "--max-connections",
            "7",
            "--idle-timeout",
            "2.5",
            "--memory-budget",
            "512M",
            "--device",
            "mem:1M",
            "--export",
            "a",
            "--device",
            "null:1G",
            "--export",
            "b",
            "--raid1",
            "file:/a.img,direct=1,file:/b.img",
            "--raid1-create",
            "--raid1-option",
            "barrier=locked",
            "--control",
            "/tmp/ctl",
            "--export",
            "m",
            "--read-only",
            "--allow",
            "10.0.0.0/8",
            "--allow",
            "127.0.0.1",
        ])
        .unwrap();
        assert_eq!(format!("{f:?}"), format!("{c:?}"));
        assert_eq!(f.exports.len(), 3);
        assert_eq!(f.exports[0].access.allow.len(), 2);
        assert_eq!(f.unix, Some(("/tmp/x.sock".into(), 0o660)));
        assert_eq!(f.limits.memory_budget, Some(512 << 20));
    }

    #[test]
    fn defaults_are_the_command_lines() {
        let f = file("[[export]]\ndevice = \"mem:1G\"\n").unwrap();
        let c = flags(&[]).unwrap();
        assert_eq!(format!("{f:?}"), format!("{c:?}"));
        assert_eq!(f.exports[0].name, "");
    }

    #[test]
    fn the_example_config_parses() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/blkq.example.toml");
        let (cfg, src) = Config::load(&path).unwrap();
        let c = cfg.check(&src).unwrap();
        let names: Vec<&str> = c.exports.iter().map(|e| e.name.as_str()).collect();
        assert_eq!(names, ["scratch", "images", "mirror"]);
        assert!(c.exports[1].read_only);
        assert_eq!(c.exports[1].access.allow.len(), 3);
    }

    #[test]
    fn errors_name_the_line() {
        // (file, what the error starts with, what else it says)
        let cases: &[(&str, &str, &str)] = &[
            (
                "[[export]]\nname = \"a\"\ndevice = \"mem:1M\"\nallow = [\n  \"10.0.0.0/8\",\n  \"10.0.0/8\",\n]\n",
                "blkq.toml:6: allow",
                "10.0.0/8",
            ),
            (
                "[server]\nlisten = \"127.0.0.1:1\"\nbogus = 1\n[[export]]\ndevice = \"mem:1M\"\n",
                "blkq.toml:3:",
                "bogus",
            ),
            (
                "[[export]]\ndevice = \"mem:1M\"\n\n[[export]]\nname = \"x\"\ndevice = \"floppy:1M\"\n",
                "blkq.toml:6: device \"floppy:1M\"",
                "",
            ),
            (
                "[[export]]\ndevice = \"mem:1M\"\nreadonly = true\n",
                "blkq.toml:3:",
                "readonly",
            ),
            (
                "[tls]\nmode = \"maybe\"\n[[export]]\ndevice = \"mem:1M\"\n",
                "blkq.toml:2:",
                "",
            ),
            (
                "[[export]]\nname = \"a\"\ndevice = \"mem:1M\"\n[[export]]\nname = \"a\"\ndevice = \"mem:1M\"\n",
                "blkq.toml:5: name",
                "second",
            ),
            (
                "[[export]]\ndevice = \"mem:1M\"\nallow_subjects = [\"CN=x\"]\n",
                "blkq.toml:3: allow_subjects",
                "verify_peer",
            ),
            (
                "[[export]]\ndevice = \"mem:1M\"\nallow_subjects = [\n\"foo:CN=y\",\n\"CN=x\"]\n",
                "blkq.toml:4: allow_subjects",
                "unknown prefix",
            ),
            (
                "[server]\nsocket_mode = 660\n[[export]]\ndevice = \"mem:1M\"\n",
                "blkq.toml:2: socket_mode",
                "0o660",
            ),
            (
                "[limits]\n\nsend_timeout = 0\n[[export]]\ndevice = \"mem:1M\"\n",
                "blkq.toml:3: send_timeout",
                "",
            ),
            (
                "[[raid1]]\nlegs = [\"file:/a\"]\n",
                "blkq.toml:2: legs",
                "two legs",
            ),
            (
                "[[raid1]]\nlegs = [\"file:/a\", \"file:/b\"]\noptions = [\n\"nonsense\"]\n",
                "blkq.toml:4: options",
                "",
            ),
            ("[server]\nno_tcp = true\n", "", "nothing to serve"),
            ("[server\n", "blkq.toml:1:", ""),
        ];
        for (text, starts, says) in cases {
            let e = err(file(text));
            assert!(e.starts_with(starts) && e.contains(says), "{text:?}: {e}");
        }
    }

    #[test]
    fn command_line_errors_name_the_flag() {
        let e = err(flags(&["--allow", "300.0.0.0/8"]));
        assert!(e.starts_with("--allow") && e.contains("300.0.0.0/8"), "{e}");
        let e = err(flags(&["--device", "floppy:1M"]));
        assert!(e.starts_with("--device \"floppy:1M\""), "{e}");
        let e = err(flags(&["--device", "raid1:file:/a,file:/b"]));
        assert!(e.contains("--raid1"), "{e}");
        let e = err(flags(&["--allow-subject", "CN=a"]));
        assert!(
            e.starts_with("--allow-subject") && e.contains("verify"),
            "{e}"
        );
        for (rule, says) in [
            ("CN=a, O=b", "space"),
            ("CN=client1 ", "whitespace"),
            ("CN=client1\t", "whitespace"),
            ("CN=client1\u{a0}", "whitespace"),
            ("CN=a\nb", "control"),
            ("", "empty"),
            ("exact:CN=a", "unknown prefix"),
            ("client1", "no '='"),
            ("attr:CN=a,O=b", "one TYPE=VALUE"),
        ] {
            let e = err(flags(&["--allow-subject", rule]));
            assert!(
                e.starts_with("--allow-subject") && e.contains(says),
                "{rule:?}: {e}"
            );
        }
        let e = err(flags(&["--sched", "cfq"]));
        assert!(e.starts_with("--sched"), "{e}");
    }

    #[test]
    fn config_is_given_alone() {
        // Every serve flag is either refused with --config or explicitly allowed with it.
        let cmd = Cli::command();
        for arg in cmd.get_arguments() {
            let id = arg.get_id().as_str();
            assert!(
                CONFLICTS_WITH_CONFIG.contains(&id) || ALLOWED_WITH_CONFIG.contains(&id),
                "serve flag {id:?}: add it to CONFLICTS_WITH_CONFIG or ALLOWED_WITH_CONFIG"
            );
        }
        for id in CONFLICTS_WITH_CONFIG {
            assert!(
                cmd.get_arguments().any(|a| a.get_id() == id),
                "{id:?} is no flag"
            );
        }
        let r = Cli::try_parse_from(["serve", "--config", "x.toml", "--device", "mem:1M"]);
        assert_eq!(
            r.err().map(|e| e.kind()),
            Some(clap::error::ErrorKind::ArgumentConflict)
        );
        let r = Cli::try_parse_from(["serve", "--config", "x.toml", "--no-tcp"]);
        assert!(r.is_err());
        // Defaults do not count as given.
        assert_eq!(
            Cli::try_parse_from(["serve", "--config", "x.toml"])
                .unwrap()
                .a
                .config,
            Some(PathBuf::from("x.toml"))
        );
    }

    fn export(name: &str, allow: &[&str]) -> Export {
        let dev: Arc<dyn Device> = Arc::new(
            "null:1M"
                .parse::<DeviceSpec>()
                .unwrap()
                .build(&QueueOverrides::default())
                .unwrap(),
        );
        Export::new(name, dev).access(Access {
            allow: allow.iter().map(|c| parse_cidr(c).unwrap()).collect(),
            ..Access::default()
        })
    }

    #[test]
    fn relative_paths_in_a_file_are_from_its_directory() {
        let d = tempfile::tempdir().unwrap();
        let etc = d.path().join("etc");
        std::fs::create_dir(&etc).unwrap();
        let f = etc.join("blkq.toml");
        std::fs::write(
            &f,
            r#"
[server]
socket = "run/blkq.sock"
[tls]
mode = "on"
certificates = "pki"
[[export]]
name = "rel"
device = "file:disk.img,ro=1"
[[export]]
name = "abs"
device = "file:/srv/abs.img"
[[export]]
name = "mem"
device = "mem:1M"
[[raid1]]
name = "m"
legs = ["file:a.img", "file:/srv/b.img,fault.seed=1", "file:../c.img"]
control = "ctl.sock"
"#,
        )
        .unwrap();
        let (cfg, src) = Config::load(&f).unwrap();
        let c = cfg.check(&src).unwrap();
        let at = |p: &str| etc.join(p);
        let spec = |p: &str| format!("file:{}", at(p).display());
        let mode = nbd::server::DEFAULT_UNIX_MODE;
        assert_eq!(c.unix, Some((at("run/blkq.sock"), mode)));
        assert_eq!(c.tls.certificates, Some(at("pki")));
        let what: Vec<&What> = c.exports.iter().map(|e| &e.what).collect();
        assert_eq!(
            what,
            [
                &What::Device(format!("{},ro=1", spec("disk.img"))),
                &What::Device("file:/srv/abs.img".into()),
                &What::Device("mem:1M".into()),
                &What::Raid1 {
                    legs: vec![
                        spec("a.img"),
                        "file:/srv/b.img,fault.seed=1".into(),
                        spec("../c.img"),
                    ],
                    create: false,
                    options: vec![],
                    control: Some(at("ctl.sock")),
                },
            ]
        );
        // Left out, the socket is the command line's default (from the working directory).
        std::fs::write(&f, "[[export]]\ndevice = \"mem:1M\"\n").unwrap();
        let (cfg, src) = Config::load(&f).unwrap();
        let c = cfg.check(&src).unwrap();
        assert_eq!(c.unix, Some((nbd::server::DEFAULT_UNIX_PATH.into(), mode)));
        // The command line's paths stay relative to the working directory.
        let c = flags(&["--socket", "s.sock", "--device", "file:d.img"]).unwrap();
        assert_eq!(c.unix, Some(("s.sock".into(), mode)));
        assert_eq!(c.exports[0].what, What::Device("file:d.img".into()));
        // A directory whose name a device spec cannot hold: said so, with the line.
        let odd = d.path().join("a,b");
        std::fs::create_dir(&odd).unwrap();
        let f = odd.join("blkq.toml");
        std::fs::write(&f, "[[export]]\ndevice = \"file:x.img\"\n").unwrap();
        let e = format!("{:#}", Config::load(&f).unwrap_err());
        assert!(
            e.contains("blkq.toml:2: device") && e.contains("comma"),
            "{e}"
        );
    }

    #[test]
    fn exposure_warnings() {
        let lo: SocketAddr = "127.0.0.1:10809".parse().unwrap();
        let any: SocketAddr = "0.0.0.0:10809".parse().unwrap();
        let ex = [export("a", &[]), export("b", &["10.0.0.0/8"])];
        assert_eq!(exposure_warning(lo, TlsMode::Off, &ex), None);
        assert_eq!(
            exposure_warning("[::1]:1".parse().unwrap(), TlsMode::Off, &ex),
            None
        );
        assert_eq!(exposure_warning(any, TlsMode::Require, &ex), None);
        let w = exposure_warning(any, TlsMode::Off, &ex).unwrap();
        assert!(w.contains("without TLS") && w.contains("in clear"), "{w}");
        assert!(
            w.contains("anyone who can reach the port") && w.contains("\"a\""),
            "{w}"
        );
        let w = exposure_warning(any, TlsMode::On, &ex[1..]).unwrap();
        assert!(w.contains("TLS optional") && w.contains("every export has an allow-list"));
    }
}
