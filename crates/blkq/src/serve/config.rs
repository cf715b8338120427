//! `blkq serve`'s configuration as given: one [`Config`] for the command line
//! ([`Config::from_args`]) and for `--config FILE.toml` ([`Config::load`]), and the
//! [`Source`] that names where a bad value was given.
//!
//! The sections (`[server]`, `[limits]`, `[tls]`) are the flags' own structs (see
//! [`super::args`]); the exports are tables, `[[export]]` and `[[raid1]]`, which the command
//! line spells `--device`/`--export` and `--raid1`. Errors name where the bad value was given:
//! `blkq.toml:12: allow: ...` for the file (syntax errors, unknown keys and bad section values
//! come with their line from the parser; the exports' values through their `Spanned` fields),
//! `--allow: ...` for the command line.
//!
//! Relative paths in the file (`[server] socket`, `[tls] certificates`, `[[raid1]] control`,
//! and inside the device specs of `[[export]] device` and `[[raid1]] legs`: `bitmaps=` and the
//! paths each kind of device declares, such as `file:PATH`) are from the file's directory
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

use std::ops::Range;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde::Deserialize;
use toml::Spanned;

use super::args::{Bytes, ExportArgs, LimitArgs, ServeArgs, ServerArgs, TlsArgs};

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
    pub fn at<T>(&self, v: &Spanned<T>, key: &str, flag: &str) -> String {
        self.at_span(v.span(), key, flag)
    }

    /// [`Source::at`] for a span.
    pub fn at_span(&self, span: Range<usize>, key: &str, flag: &str) -> String {
        match self {
            Source::CommandLine => format!("--{flag}"),
            Source::File { path, text } => {
                format!("{}:{}: {key}", path.display(), line_of(text, span.start))
            }
        }
    }

    /// The start of an error about `key` of table `[section]` (flag `--flag`): the line of
    /// the key in a file (the section's header when the key is left out), or the flag.
    pub fn at_key(&self, section: &str, key: &str, flag: &str) -> String {
        match self {
            Source::CommandLine => format!("--{flag}"),
            Source::File { path, text } => match key_line(text, section, key) {
                Some(line) => format!("{}:{line}: {key}", path.display()),
                None => format!("{}: [{section}] {key}", path.display()),
            },
        }
    }

    /// Whether this is a file (errors say keys, not flags).
    pub fn is_file(&self) -> bool {
        matches!(self, Source::File { .. })
    }
}

/// The 1-based line of byte `at` of `text`.
fn line_of(text: &str, at: usize) -> usize {
    let end = at.min(text.len());
    text.as_bytes()[..end]
        .iter()
        .filter(|&&b| b == b'\n')
        .count()
        + 1
}

/// The 1-based line on which `key = ...` is written inside table `[section]` of a TOML text.
fn key_line(text: &str, section: &str, key: &str) -> Option<usize> {
    let mut current = String::new();
    for (i, line) in text.lines().enumerate() {
        let t = line.trim();
        if let Some(h) = t.strip_prefix('[').and_then(|h| h.split(']').next()) {
            current = h.trim_start_matches('[').trim().to_string();
            continue;
        }
        if current == section {
            if let Some((k, _)) = t.split_once('=') {
                if k.trim() == key {
                    return Some(i + 1);
                }
            }
        }
    }
    None
}

/// The key written on the line of `at`, or on the nearest line above it that sets one (an
/// element of a multi-line array sits below its key).
fn key_above(text: &str, at: usize) -> Option<&str> {
    let end = at.min(text.len());
    let line_end = text[end..].find('\n').map_or(text.len(), |i| end + i);
    for l in text[..line_end].lines().rev() {
        let t = l.trim();
        if t.starts_with('[') {
            return None;
        }
        if let Some((k, _)) = t.split_once('=') {
            let k = k.trim();
            if !k.is_empty() && k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
                return Some(k);
            }
        }
    }
    None
}

/// The whole configuration of `blkq serve`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Listeners, queues and server-wide options.
    #[serde(default)]
    pub server: ServerArgs,
    /// Resource limits.
    #[serde(default)]
    pub limits: LimitArgs,
    /// TLS settings.
    #[serde(default)]
    pub tls: TlsArgs,
    /// Plain devices, in order.
    #[serde(default, rename = "export")]
    pub exports: Vec<ExportDecl>,
    /// RAID1 arrays, exported after the plain devices.
    #[serde(default, rename = "raid1")]
    pub arrays: Vec<Raid1Decl>,
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
    /// Create the array on the legs first (`--raid1-create`).
    #[serde(default)]
    pub create: bool,
    /// With `create`: overwrite legs that hold data (`--raid1-force`).
    #[serde(default)]
    pub force: bool,
    /// With `create`: no initial resync, for blank legs (`--raid1-assume-clean`).
    #[serde(default)]
    pub assume_clean: bool,
    /// With `create`: bytes of each leg to use (`--raid1-size`).
    pub size: Option<Bytes>,
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

/// Spans of values that came from the command line (they point nowhere).
fn cli<T>(v: T) -> Spanned<T> {
    Spanned::new(0..0, v)
}

impl Config {
    /// Reads and parses a TOML file (syntax errors and bad values name the line), and makes
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
    /// certificates directory, control sockets, and the paths inside device specs
    /// ([`spec_from`]).
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
        if let Some(p) = &mut self.server.control {
            join(p);
        }
        if let Some(p) = &mut self.tls.tls_certificates {
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

    /// Parses TOML `text` read from `path`. An error names the line and, where the line sets
    /// one, the key: `blkq.toml:3: send_timeout: 0 is not a positive number of seconds`.
    pub fn parse(path: &Path, text: &str) -> Result<Config> {
        toml::from_str(text).map_err(|e| {
            let msg = e.message().trim_end().to_string();
            match e.span() {
                Some(s) => {
                    let line = line_of(text, s.start);
                    match key_above(text, s.start) {
                        Some(k) if !msg.contains(&format!("`{k}`")) => {
                            anyhow::anyhow!("{}:{line}: {k}: {msg}", path.display())
                        }
                        _ => anyhow::anyhow!("{}:{line}: {msg}", path.display()),
                    }
                }
                None => anyhow::anyhow!("{}: {msg}", path.display()),
            }
        })
    }

    /// The configuration the command line describes.
    pub fn from_args(a: &ServeArgs) -> Result<Config> {
        let e = &a.exports;
        let mut cfg = Config {
            server: a.server.clone(),
            limits: a.limits.clone(),
            tls: a.tls.clone(),
            exports: Vec::new(),
            arrays: Vec::new(),
        };
        if e.raid1.is_none() {
            // Without a mirror, --control is the server's socket (bitmaps only).
            cfg.server.control = e.control.clone();
        }
        let mut names = export_names(e)?.into_iter();
        let allow: Vec<Spanned<String>> = e.allow.iter().cloned().map(cli).collect();
        let allow_subjects: Vec<Spanned<String>> =
            e.allow_subjects.iter().cloned().map(cli).collect();
        let default_device = ["mem:1G".to_string()];
        let devices = if e.devices.is_empty() && e.raid1.is_none() {
            &default_device[..]
        } else {
            &e.devices[..]
        };
        for (spec, name) in devices.iter().zip(names.by_ref()) {
            cfg.exports.push(ExportDecl {
                name: Some(cli(name)),
                description: None,
                device: cli(spec.clone()),
                read_only: e.read_only,
                allow: allow.clone(),
                allow_subjects: allow_subjects.clone(),
            });
        }
        if let (Some(legs), Some(name)) = (&e.raid1, names.next()) {
            let legs = crate::raid::legs::split_legs(legs)?;
            cfg.arrays.push(Raid1Decl {
                name: Some(cli(name)),
                description: None,
                legs: cli(legs.into_iter().map(cli).collect()),
                create: e.raid1_create,
                force: e.raid1_force,
                assume_clean: e.raid1_assume_clean,
                size: e.raid1_size,
                options: e
                    .raid1_options
                    .iter()
                    .cloned()
                    .chain(e.raid1_degraded.then(|| "allow_degraded=true".to_string()))
                    .chain(e.raid1_integrity.as_ref().map(|a| format!("integrity={a}")))
                    .map(cli)
                    .collect(),
                control: e.control.clone(),
                read_only: e.read_only,
                allow,
                allow_subjects,
            });
        }
        Ok(cfg)
    }
}

/// The export name of each device (`--device`, then `--raid1`'s mirror, or the default
/// `mem:1G`): the `--export` names in order, or the default export `""` for a single one.
fn export_names(e: &ExportArgs) -> Result<Vec<String>> {
    let count = (e.devices.len() + usize::from(e.raid1.is_some())).max(1);
    if e.exports.is_empty() && count == 1 {
        return Ok(vec![String::new()]);
    }
    if e.exports.len() != count {
        bail!(
            "--export must be given once per --device ({count} devices, {} export names)",
            e.exports.len()
        );
    }
    Ok(e.exports.clone())
}

/// `spec` with every relative path in it joined to `dir` (the config file's directory), as
/// every other path of the file is: `bitmaps=` of any spec (the server's own option), and the
/// paths the spec's kind declares ([`crate::open::Spec::rebase`]).
fn spec_from(spec: &str, dir: &Path) -> Result<String> {
    let spec = bitmaps_from(spec, dir)?;
    crate::open::Spec::rebase(&spec, dir)
}

/// A device spec whose relative `bitmaps=PATH` is made relative to `dir` (`bitmaps=off` is no
/// path).
fn bitmaps_from(spec: &str, dir: &Path) -> Result<String> {
    let mut parts = Vec::new();
    for (i, part) in spec.split(',').enumerate() {
        let full = match part.split_once('=') {
            Some(("bitmaps", v)) if i > 0 && v != "off" => {
                blk_drivers::spec::join_path(part, v, dir)?.map(|f| format!("bitmaps={f}"))
            }
            _ => None,
        };
        parts.push(full.unwrap_or_else(|| part.to_string()));
    }
    Ok(parts.join(","))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_relative_bitmaps_sidecar_is_from_the_files_directory() {
        assert_specs_from_etc_blkq(&[
            (
                "file:vm.img,bitmaps=vm.bm,direct=1",
                "file:/etc/blkq/vm.img,bitmaps=/etc/blkq/vm.bm,direct=1",
            ),
            ("mem:1G,bitmaps=off", "mem:1G,bitmaps=off"),
            ("mem:1G,bitmaps=/abs.bm", "mem:1G,bitmaps=/abs.bm"),
        ]);
    }

    /// Each `(spec, want)`: `spec` in a file in /etc/blkq is `want`.
    fn assert_specs_from_etc_blkq(cases: &[(&str, &str)]) {
        for (spec, want) in cases {
            assert_eq!(
                spec_from(spec, Path::new("/etc/blkq")).unwrap(),
                *want,
                "{spec}"
            );
        }
    }

    #[test]
    fn relative_paths_inside_remote_and_rbd_specs_are_from_the_files_directory() {
        assert_specs_from_etc_blkq(&[
            (
                "nbd+unix:///exp?socket=s.sock,timeout=3",
                "nbd+unix:///exp?socket=/etc/blkq/s.sock,timeout=3",
            ),
            (
                "nbds://h/e?tls-certificates=pki&tls-hostname=x",
                "nbds://h/e?tls-certificates=/etc/blkq/pki&tls-hostname=x",
            ),
            (
                "nbds+unix:///?socket=/abs.sock&tls-certificates=pki",
                "nbds+unix:///?socket=/abs.sock&tls-certificates=/etc/blkq/pki",
            ),
            ("nbd://h:10809/e,timeout=3", "nbd://h:10809/e,timeout=3"),
            (
                "rbd:rbd/img,conf=ceph.conf,keyring=k,lock=on",
                "rbd:rbd/img,conf=/etc/blkq/ceph.conf,keyring=/etc/blkq/k,lock=on",
            ),
        ]);
        // A directory whose name a URI must escape: the spec parses back to the path.
        let odd = Path::new("/srv/a b&c%d,e");
        let spec = spec_from("nbd+unix:///x?socket=s%2Esock,depth=4", odd).unwrap();
        let r = nbd::remote::RemoteSpec::parse(&spec).unwrap();
        assert_eq!(
            r.addr,
            nbd::remote::RemoteAddr::Unix(odd.join("s.sock")),
            "{spec}"
        );
        assert_eq!(r.depth, 4, "{spec}");
    }

    fn args(devices: &[&str], exports: &[&str], raid1: Option<&str>) -> ExportArgs {
        ExportArgs {
            devices: devices.iter().map(|s| s.to_string()).collect(),
            exports: exports.iter().map(|s| s.to_string()).collect(),
            raid1: raid1.map(str::to_string),
            ..ExportArgs::default()
        }
    }

    #[test]
    fn devices_pair_with_export_names() {
        assert_eq!(export_names(&args(&[], &[], None)).unwrap(), [""]);
        assert_eq!(export_names(&args(&["null:1G"], &[], None)).unwrap(), [""]);
        assert_eq!(
            export_names(&args(&["mem:1M", "null:1G"], &["a", "b"], None)).unwrap(),
            ["a", "b"]
        );
        assert!(export_names(&args(&["mem:1M", "null:1G"], &["a"], None)).is_err());
        assert!(export_names(&args(&["mem:1M", "null:1G"], &[], None)).is_err());
        assert_eq!(
            export_names(&args(&[], &[], Some("file:/a,file:/b"))).unwrap(),
            [""]
        );
        assert_eq!(
            export_names(&args(
                &["mem:1M"],
                &["m", "mirror"],
                Some("file:/a,file:/b")
            ))
            .unwrap(),
            ["m", "mirror"]
        );
    }

    #[test]
    fn keys_are_found_by_line() {
        let text = "[server]\nlisten = \"x\"\n\n[tls]\nmode = \"on\"\nverify_peer = true\n";
        assert_eq!(key_line(text, "tls", "verify_peer"), Some(6));
        assert_eq!(key_line(text, "server", "verify_peer"), None);
        let at = text.find("\"on\"").unwrap();
        assert_eq!(key_above(text, at), Some("mode"));
        let arr = "[[export]]\nallow = [\n  \"a\",\n  \"b\",\n]\n";
        assert_eq!(key_above(arr, arr.find("\"b\"").unwrap()), Some("allow"));
    }
}
