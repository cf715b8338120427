//! The control socket's export commands (qemu-storage-daemon's `block-export-add` and
//! `block-export-del`), both ends, and what the server keeps beside its export table
//! ([`Served`]): each export's full description, its dirty bitmaps and its remote device.
//!
//! | line | does |
//! |---|---|
//! | `export add {TABLE}` | opens the device and serves it: TABLE is an `[[export]]` table of the configuration file written inline (`{name = "vm1", device = "file:/srv/vm1.img", read_only = true, description = "...", allow = ["10.0.0.0/8"], allow_subjects = [...]}`) |
//! | `export remove [--timeout=SECONDS] --export=NAME` | the name goes at once; its clients' in-flight requests are answered, then they are closed; the device is flushed (default timeout: the server's `--shutdown-timeout`) |
//! | `export list` | `{"ok":true,"exports":[{"name","size","read_only","description","device","connections","failed","bitmaps","mirror"}]}` |
//!
//! An added export takes the server's queue settings (`--queue-depth`, `--sched`, ...),
//! `--describe-paths` and bitmap options (`bitmaps=` in its spec, `--bitmaps-reset`,
//! `--bitmaps-gate`) as one given at start; its dirty bitmaps are served by `bitmap ...` and
//! counted by the metrics. A mirror is neither added nor removed while serving (its legs,
//! its control socket and its superblocks need a start and a clean stop): that needs a
//! restart. The last export may be removed: the server then lists none and answers every
//! name as unknown until one is added.

use std::fmt;
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use blkq_sync::Arc;
use serde_json::json;

use crate::serve::config::{ExportDecl, Source};
use crate::serve::devices::Devices;
use crate::serve::plan::open_export;
use crate::serve::settings::{check_export, Backing, ExportSettings, Settings};

/// An `export ...` command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExportCmd {
    /// Add an export: an `[[export]]` table written inline (TOML).
    Add(String),
    /// Remove an export.
    Remove {
        /// Its name.
        name: String,
        /// Seconds its connections get to drain, and its flush (`None`: the server's
        /// `--shutdown-timeout`).
        timeout: Option<u64>,
    },
    /// List the exports.
    List,
}

const USAGE: &str = "export add {name = \"N\", device = \"SPEC\", ...} | export remove \
                     [--timeout=SECONDS] --export=NAME | export list";

impl ExportCmd {
    /// Parses an `export ...` line; `None` when the line is not an export command.
    pub fn parse(line: &str) -> Option<Result<Self>> {
        let line = line.trim();
        let rest = line.strip_prefix("export")?;
        if !(rest.is_empty() || rest.starts_with(char::is_whitespace)) {
            return None;
        }
        Some(Self::parse_rest(rest.trim()))
    }

    fn parse_rest(rest: &str) -> Result<Self> {
        let (sub, args) = match rest.split_once(char::is_whitespace) {
            Some((s, a)) => (s, a.trim()),
            None => (rest, ""),
        };
        match sub {
            "add" if args.starts_with('{') => Ok(ExportCmd::Add(args.to_string())),
            "list" if args.is_empty() => Ok(ExportCmd::List),
            "remove" => {
                let mut name = None;
                let mut timeout = None;
                for w in args.split_whitespace() {
                    if let Some(n) = w.strip_prefix("--export=") {
                        name = Some(n.to_string());
                    } else if let Some(t) = w.strip_prefix("--timeout=") {
                        let secs: u64 = t
                            .parse()
                            .ok()
                            .filter(|s| (1..=86400).contains(s))
                            .ok_or_else(|| {
                                anyhow!("bad timeout {t:?}: whole seconds from 1 to 86400")
                            })?;
                        timeout = Some(secs);
                    } else {
                        bail!("unexpected {w:?}: {USAGE}");
                    }
                }
                match name {
                    Some(name) => Ok(ExportCmd::Remove { name, timeout }),
                    None => bail!("usage: {USAGE}"),
                }
            }
            _ => bail!("usage: {USAGE}"),
        }
    }
}

impl fmt::Display for ExportCmd {
    /// The line, as [`ExportCmd::parse`] reads it.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ExportCmd::Add(table) => write!(f, "export add {table}"),
            ExportCmd::Remove { name, timeout } => {
                f.write_str("export remove ")?;
                if let Some(t) = timeout {
                    write!(f, "--timeout={t} ")?;
                }
                write!(f, "--export={name}")
            }
            ExportCmd::List => f.write_str("export list"),
        }
    }
}

/// The inline TOML table of an `[[export]]` with these values (what `blkq export add`
/// sends).
pub fn add_table(
    name: &str,
    device: &str,
    read_only: bool,
    description: Option<&str>,
    allow: &[String],
    allow_subjects: &[String],
) -> String {
    let mut t = toml::Table::new();
    t.insert("name".into(), name.into());
    t.insert("device".into(), device.into());
    if read_only {
        t.insert("read_only".into(), true.into());
    }
    if let Some(d) = description {
        t.insert("description".into(), d.into());
    }
    if !allow.is_empty() {
        t.insert("allow".into(), allow.to_vec().into());
    }
    if !allow_subjects.is_empty() {
        t.insert("allow_subjects".into(), allow_subjects.to_vec().into());
    }
    toml::Value::Table(t).to_string()
}

/// What `export` commands act on: the NBD server's table and the devices beside it.
pub struct Served {
    /// The NBD server's export table.
    pub server: nbd::server::Exports,
    /// The settings the server started with (queue settings, bitmap options, TLS).
    pub settings: Settings,
    /// The exports' devices (shared with the metrics and the bitmap commands).
    pub devices: Arc<Devices>,
}

impl Served {
    /// Runs an `export ...` command; the JSON reply.
    pub fn run(&self, cmd: ExportCmd) -> Result<serde_json::Value> {
        match cmd {
            ExportCmd::Add(table) => self.add(&table),
            ExportCmd::Remove { name, timeout } => {
                let secs = timeout.unwrap_or(self.settings.shutdown_timeout);
                self.remove(&name, Duration::from_secs(secs))
            }
            ExportCmd::List => self.list(),
        }
    }

    fn add(&self, table: &str) -> Result<serde_json::Value> {
        #[derive(serde::Deserialize)]
        struct Line {
            export: ExportDecl,
        }
        let line: Line = toml::from_str(&format!("export = {table}"))
            .map_err(|e| anyhow!("{}", e.message()))
            .context("export add: not an [[export]] table")?;
        let decl = line.export;
        let spec = decl.device.get_ref();
        if spec.starts_with("raid1:") {
            bail!(
                "export add: a mirror cannot be added while serving (its legs, control socket \
                 and superblocks need a start and a clean stop): give it to `blkq serve` \
                 (--raid1 or a [[raid1]] table) and restart"
            );
        }
        let name = decl.name.as_ref().map_or("", |n| n.get_ref()).to_string();
        if name.len() > 4096 || name.contains('\0') {
            bail!("{name:?} is not a valid export name (at most 4096 bytes, no NUL)");
        }
        self.refuse_served(&name)?;
        // Checked and opened as a `--device`/`[[export]]` given at start (errors name the
        // flags of `blkq export add`).
        let settings = check_export(
            &decl,
            name.clone(),
            &Source::CommandLine,
            &self.settings.tls,
        )
        .with_context(|| format!("export add {name:?}"))?;
        let message = self.add_checked(&settings)?;
        Ok(json!({ "ok": true, "message": message }))
    }

    /// Whether an export named `name` is served now.
    pub fn is_served(&self, name: &str) -> bool {
        self.server
            .list()
            .is_ok_and(|l| l.iter().any(|e| e.name == name))
    }

    fn refuse_served(&self, name: &str) -> Result<()> {
        if self.server.list()?.iter().any(|e| e.name == name) {
            bail!("an export named {name:?} is served already");
        }
        Ok(())
    }

    /// Opens and serves an export whose settings were checked (a `blkq export add`, or one
    /// a reloaded configuration file gained); what it serves, said in one line. A mirror is
    /// refused (see the module docs).
    pub fn add_checked(&self, settings: &ExportSettings) -> Result<String> {
        let name = settings.name.clone();
        if matches!(settings.backing, Backing::Mirror { .. }) {
            bail!(
                "export add {name:?}: a mirror cannot be added while serving (its legs, control \
                 socket and superblocks need a start and a clean stop): restart the server"
            );
        }
        self.refuse_served(&name)?;
        let what = || format!("export add {name:?}");
        let opened = open_export(&self.settings, settings, false).with_context(what)?;
        let size = blk::Device::limits(opened.export.device.as_ref()).capacity;
        let read_only = opened.export.read_only;
        let device = opened.description.clone();
        let export = opened.export.clone();
        self.server.add(export)?;
        // Clients read its bitmaps from the device itself; the bitmap commands and the
        // metrics find them here from now on.
        self.devices.insert(opened.entry());
        if let Some(addr) = self.settings.tcp {
            let tls = self.settings.tls.tls;
            let this = [(name.as_str(), &settings.access)];
            if let Some(w) = crate::serve::plan::exposure_warning(addr, tls, this) {
                tracing::warn!("{w}");
            }
        }
        let ro = if read_only { ", read-only" } else { "" };
        Ok(format!("export {name:?} added: {size} bytes{ro}, {device}"))
    }

    fn remove(&self, name: &str, timeout: Duration) -> Result<serde_json::Value> {
        let r = self.remove_export(name, timeout)?;
        Ok(json!({ "ok": true, "message": r.to_string(), "connections": r.connections }))
    }

    /// Stops serving export `name` (a `blkq export remove`, or one a reloaded configuration
    /// file lost): its clients drained within `timeout`, its device flushed. A mirror is
    /// refused (see the module docs).
    pub fn remove_export(
        &self,
        name: &str,
        timeout: Duration,
    ) -> Result<nbd::server::RemoveReport> {
        if self.devices.is_mirror(name) {
            bail!(
                "export {name:?} is a mirror: it is not removed while serving (its control \
                 socket and superblocks need a clean stop): stop the server instead"
            );
        }
        let res = self.server.remove(name, timeout);
        if !matches!(
            res,
            Err(nbd::server::ServerError::UnknownExport(_))
                | Err(nbd::server::ServerError::Stopping)
        ) {
            // Gone from the table either way: nothing here keeps its device open.
            self.devices.remove(name);
        }
        Ok(res?)
    }

    fn list(&self) -> Result<serde_json::Value> {
        let v: Vec<serde_json::Value> = self
            .server
            .list()?
            .into_iter()
            .map(|e| {
                let d = self.devices.view(&e.name);
                json!({
                    "name": e.name,
                    "size": e.size,
                    "read_only": e.read_only,
                    "description": e.description,
                    "device": d.as_ref().map(|d| d.device.clone()),
                    "connections": e.connections,
                    "failed": e.failed,
                    "bitmaps": d.as_ref().and_then(|d| d.bitmaps),
                    "mirror": d.is_some_and(|d| d.mirror),
                })
            })
            .collect();
        Ok(json!({ "ok": true, "exports": v }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_round_trip_and_bad_ones_say_why() {
        let table = add_table(
            "vm 1",
            "file:/srv/my disk.img",
            true,
            Some("a \"quoted\" description"),
            &["10.0.0.0/8".into()],
            &[],
        );
        for c in [
            ExportCmd::Add(table.clone()),
            ExportCmd::Remove {
                name: "vm1".into(),
                timeout: Some(30),
            },
            ExportCmd::Remove {
                name: String::new(),
                timeout: None,
            },
            ExportCmd::List,
        ] {
            assert_eq!(ExportCmd::parse(&c.to_string()).unwrap().unwrap(), c, "{c}");
        }
        // The table is an [[export]] of the configuration file.
        #[derive(serde::Deserialize)]
        struct Line {
            export: ExportDecl,
        }
        let l: Line = toml::from_str(&format!("export = {table}")).unwrap();
        assert_eq!(l.export.name.unwrap().into_inner(), "vm 1");
        assert_eq!(l.export.device.into_inner(), "file:/srv/my disk.img");
        assert!(l.export.read_only);
        assert_eq!(
            l.export.description.as_deref(),
            Some("a \"quoted\" description")
        );
        assert!(ExportCmd::parse("exports").is_none());
        assert!(ExportCmd::parse("bitmap list").is_none());
        for (line, says) in [
            ("export", "usage"),
            ("export add", "usage"),
            ("export add vm1 mem:1M", "usage"),
            ("export remove", "usage"),
            ("export remove --export=a --timeout=0", "bad timeout"),
            ("export remove --export=a b", "unexpected \"b\""),
            ("export list x", "usage"),
        ] {
            let e = format!("{:#}", ExportCmd::parse(line).unwrap().unwrap_err());
            assert!(e.contains(says), "{line:?}: {e}");
        }
    }
}
