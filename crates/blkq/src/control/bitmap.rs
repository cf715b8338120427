//! The control socket's dirty-bitmap commands (changed-block tracking), both ends, and the
//! server's handler, which answers them for every export and hands any other line to the
//! mirror's [`Control`] when the server has one.
//!
//! | line | does |
//! |---|---|
//! | `bitmap add NAME [--export=E] [--granularity=SIZE]` | a new, clean, recording bitmap (default 64K) |
//! | `bitmap remove NAME [--export=E]` | deletes it |
//! | `bitmap clear NAME [--export=E]` | starts it afresh (durable before the reply) |
//! | `bitmap rotate OLD NEW [--export=E]` | freezes OLD and starts NEW at one instant; replies once every write counted in OLD is complete |
//! | `bitmap disable NAME [--export=E]` | stops counting writes in it, keeping its bits (replies once the writes it counted completed) |
//! | `bitmap enable NAME [--export=E]` | counts writes in it again |
//! | `bitmap merge TARGET SOURCE... [--export=E]` | sets in TARGET every granule dirty in a SOURCE (durable before the reply) |
//! | `bitmap list [--export=E]` | `{"ok":true,"bitmaps":[{"export","name","granularity","recording","dirty_bytes"}]}` (every export without `--export`) |
//!
//! `--export=` with nothing after it names the default export `""`; an export name with
//! whitespace cannot be named on this one-line protocol. Errors name what is wrong: a
//! duplicate name, an unknown bitmap or export, a bad granularity.

use std::fmt;

use anyhow::{anyhow, bail, Result};
use blkq_sync::Arc;
use cbt::Tracked;
use serde_json::json;

use super::exports::{ExportCmd, Served};
use super::server::{Control, Handle};

/// A `bitmap ...` command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BitmapCmd {
    /// Add a bitmap.
    Add {
        /// Its name.
        name: String,
        /// Bytes per bit (`None`: the default, 64 KiB).
        granularity: Option<u64>,
    },
    /// Remove a bitmap.
    Remove(String),
    /// Clear a bitmap.
    Clear(String),
    /// Freeze `old`, start `new`.
    Rotate {
        /// The bitmap frozen.
        old: String,
        /// The bitmap started.
        new: String,
    },
    /// Stop counting writes in a bitmap (`false`) or start again (`true`).
    Record {
        /// Its name.
        name: String,
        /// Enable (`true`) or disable.
        on: bool,
    },
    /// `target |= sources`.
    Merge {
        /// The bitmap that gains the bits.
        target: String,
        /// The bitmaps read.
        sources: Vec<String>,
    },
    /// List the bitmaps.
    List,
}

/// A `bitmap ...` line: the command and the export it is about (`None`: the default export,
/// or for `list` every export).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BitmapLine {
    /// What to do.
    pub cmd: BitmapCmd,
    /// On which export.
    pub export: Option<String>,
}

const USAGE: &str = "bitmap add NAME [--export=E] [--granularity=SIZE] | bitmap remove NAME \
                     [--export=E] | bitmap clear NAME [--export=E] | bitmap rotate OLD NEW \
                     [--export=E] | bitmap disable NAME [--export=E] | bitmap enable NAME \
                     [--export=E] | bitmap merge TARGET SOURCE... [--export=E] | bitmap list \
                     [--export=E]";

impl BitmapLine {
    /// Parses what follows `bitmap` on a line; `None` when the line is not a bitmap command.
    pub fn parse(line: &str) -> Option<Result<Self>> {
        let mut words = line.split_whitespace();
        if words.next() != Some("bitmap") {
            return None;
        }
        Some(Self::parse_words(words.collect()))
    }

    fn parse_words(words: Vec<&str>) -> Result<Self> {
        let mut export = None;
        let mut granularity = None;
        let mut args = Vec::new();
        for w in words {
            if let Some(e) = w.strip_prefix("--export=") {
                export = Some(e.to_string());
            } else if let Some(g) = w.strip_prefix("--granularity=") {
                let v = blk_drivers::spec::parse_size(g)
                    .map_err(|e| anyhow!("bad granularity {g:?}: {e}"))?;
                cbt::bits::check_granularity(v)?;
                granularity = Some(v);
            } else if w.starts_with("--") {
                bail!("unknown option {w:?}: {USAGE}");
            } else {
                args.push(w.to_string());
            }
        }
        let cmd = match (args.first().map(String::as_str), &args[1.min(args.len())..]) {
            (Some("add"), [name]) => BitmapCmd::Add {
                name: name.clone(),
                granularity,
            },
            (Some("remove"), [name]) => BitmapCmd::Remove(name.clone()),
            (Some("clear"), [name]) => BitmapCmd::Clear(name.clone()),
            (Some("rotate"), [old, new]) => BitmapCmd::Rotate {
                old: old.clone(),
                new: new.clone(),
            },
            (Some("disable"), [name]) => BitmapCmd::Record {
                name: name.clone(),
                on: false,
            },
            (Some("enable"), [name]) => BitmapCmd::Record {
                name: name.clone(),
                on: true,
            },
            (Some("merge"), [target, sources @ ..]) if !sources.is_empty() => BitmapCmd::Merge {
                target: target.clone(),
                sources: sources.to_vec(),
            },
            (Some("list"), []) => BitmapCmd::List,
            _ => bail!("usage: {USAGE}"),
        };
        if granularity.is_some() && !matches!(cmd, BitmapCmd::Add { .. }) {
            bail!("--granularity is for bitmap add only");
        }
        Ok(Self { cmd, export })
    }
}

impl fmt::Display for BitmapLine {
    /// The line, as [`BitmapLine::parse`] reads it.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.cmd {
            BitmapCmd::Add { name, granularity } => {
                write!(f, "bitmap add {name}")?;
                if let Some(g) = granularity {
                    write!(f, " --granularity={g}")?;
                }
            }
            BitmapCmd::Remove(n) => write!(f, "bitmap remove {n}")?,
            BitmapCmd::Clear(n) => write!(f, "bitmap clear {n}")?,
            BitmapCmd::Rotate { old, new } => write!(f, "bitmap rotate {old} {new}")?,
            BitmapCmd::Record { name, on } => {
                let what = if *on { "enable" } else { "disable" };
                write!(f, "bitmap {what} {name}")?
            }
            BitmapCmd::Merge { target, sources } => {
                write!(f, "bitmap merge {target} {}", sources.join(" "))?
            }
            BitmapCmd::List => f.write_str("bitmap list")?,
        }
        if let Some(e) = &self.export {
            write!(f, " --export={e}")?;
        }
        Ok(())
    }
}

/// The server's control handler: bitmap commands for every tracked export, export commands
/// (`super::exports`), anything else for the mirror (if this socket has one).
pub struct Handler {
    /// The mirror's control, for `status`, `fail`, ... .
    pub mirror: Option<Arc<Control>>,
    /// The exports (their table and their bitmaps), shared by every control socket.
    pub served: Arc<Served>,
}

impl Handler {
    fn export(&self, name: Option<&str>) -> Result<Arc<Tracked>> {
        let name = name.unwrap_or("");
        let tracked = self.served.devices.tracked();
        tracked
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, t)| t.clone())
            .ok_or_else(|| {
                let known: Vec<&str> = tracked.iter().map(|(n, _)| n.as_str()).collect();
                anyhow!("no export {name:?} with dirty bitmaps here (exports: {known:?})")
            })
    }

    fn run(&self, l: BitmapLine) -> Result<serde_json::Value> {
        let ex = l.export.as_deref();
        let on = |what: String| match ex {
            Some(e) if !e.is_empty() => format!("{what} on export {e:?}"),
            _ => what,
        };
        let ok = |m: String| Ok(json!({ "ok": true, "message": m }));
        match l.cmd {
            BitmapCmd::List => {
                let mut v = Vec::new();
                for (name, t) in &self.served.devices.tracked() {
                    if ex.is_some_and(|e| e != name) {
                        continue;
                    }
                    for i in t.bitmaps().list() {
                        v.push(json!({
                            "export": name,
                            "name": i.name,
                            "granularity": i.granularity,
                            "recording": i.recording,
                            "dirty_bytes": i.dirty_bytes,
                        }));
                    }
                }
                if let Some(e) = ex {
                    self.export(Some(e))?;
                }
                Ok(json!({ "ok": true, "bitmaps": v }))
            }
            BitmapCmd::Add { name, granularity } => {
                let g = granularity.unwrap_or(cbt::DEFAULT_GRANULARITY);
                self.export(ex)?.bitmaps().add(&name, g)?;
                ok(on(format!("dirty bitmap {name:?} added (granularity {g})")))
            }
            BitmapCmd::Remove(name) => {
                self.export(ex)?.bitmaps().remove(&name)?;
                ok(on(format!("dirty bitmap {name:?} removed")))
            }
            BitmapCmd::Clear(name) => {
                self.export(ex)?.bitmaps().clear(&name)?;
                ok(on(format!("dirty bitmap {name:?} cleared")))
            }
            BitmapCmd::Rotate { old, new } => {
                self.export(ex)?.bitmaps().rotate(&old, &new)?;
                ok(on(format!(
                    "dirty bitmap {old:?} frozen, {new:?} recording"
                )))
            }
            BitmapCmd::Record { name, on: rec } => {
                self.export(ex)?.bitmaps().set_recording(&name, rec)?;
                let state = if rec {
                    "recording"
                } else {
                    "disabled (frozen)"
                };
                ok(on(format!("dirty bitmap {name:?} {state}")))
            }
            BitmapCmd::Merge { target, sources } => {
                self.export(ex)?.bitmaps().merge(&target, &sources)?;
                ok(on(format!(
                    "dirty bitmap {target:?} merged with {sources:?}"
                )))
            }
        }
    }
}

impl Handle for Handler {
    fn handle(&self, line: &str) -> serde_json::Value {
        if let Some(cmd) = ExportCmd::parse(line) {
            let res = cmd.and_then(|c| self.served.run(c));
            return res.unwrap_or_else(|e| json!({ "ok": false, "error": format!("{e:#}") }));
        }
        let res = match (BitmapLine::parse(line), &self.mirror) {
            (Some(parsed), _) => parsed.and_then(|l| self.run(l)),
            (None, Some(m)) => return m.handle(line),
            (None, None) => Err(anyhow!(
                "this server has no mirror: only export and dirty-bitmap commands ({USAGE})"
            )),
        };
        res.unwrap_or_else(|e| json!({ "ok": false, "error": format!("{e:#}") }))
    }

    fn subscribe(&self) -> Option<(raid1::Subscription, serde_json::Value)> {
        self.mirror.as_ref()?.subscribe()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_round_trip_and_bad_ones_say_why() {
        let all = [
            BitmapLine {
                cmd: BitmapCmd::Add {
                    name: "daily".into(),
                    granularity: Some(1 << 20),
                },
                export: Some("".into()),
            },
            BitmapLine {
                cmd: BitmapCmd::Add {
                    name: "d".into(),
                    granularity: None,
                },
                export: None,
            },
            BitmapLine {
                cmd: BitmapCmd::Rotate {
                    old: "a".into(),
                    new: "b".into(),
                },
                export: Some("vm1".into()),
            },
            BitmapLine {
                cmd: BitmapCmd::Remove("a".into()),
                export: None,
            },
            BitmapLine {
                cmd: BitmapCmd::Clear("a".into()),
                export: None,
            },
            BitmapLine {
                cmd: BitmapCmd::Record {
                    name: "a".into(),
                    on: false,
                },
                export: Some("vm1".into()),
            },
            BitmapLine {
                cmd: BitmapCmd::Record {
                    name: "a".into(),
                    on: true,
                },
                export: None,
            },
            BitmapLine {
                cmd: BitmapCmd::Merge {
                    target: "t".into(),
                    sources: vec!["a".into(), "b".into()],
                },
                export: None,
            },
            BitmapLine {
                cmd: BitmapCmd::List,
                export: None,
            },
        ];
        for l in all {
            assert_eq!(
                BitmapLine::parse(&l.to_string()).unwrap().unwrap(),
                l,
                "{l}"
            );
        }
        assert!(BitmapLine::parse("status").is_none());
        for (line, says) in [
            ("bitmap", "usage"),
            ("bitmap add", "usage"),
            ("bitmap rotate a", "usage"),
            ("bitmap merge a", "usage"),
            ("bitmap disable", "usage"),
            ("bitmap add a --granularity=3000", "bad granularity 3000"),
            ("bitmap add a --granularity=x", "bad granularity \"x\""),
            ("bitmap add a --frob", "unknown option"),
            ("bitmap list --granularity=64K", "for bitmap add only"),
        ] {
            let e = format!("{:#}", BitmapLine::parse(line).unwrap().unwrap_err());
            assert!(e.contains(says), "{line:?}: {e}");
        }
    }
}
