//! The control socket's protocol, both ends: one connection carries one command, a line of
//! text of at most [`MAX_LINE`] bytes ([`Command`]: the server parses it, the client writes
//! it), answered by one line of JSON, `{"ok":true,...}` or `{"ok":false,"error":"..."}`, of at
//! most [`MAX_REPLY`] bytes, after which the server closes the connection.
//!
//! | command            | does                                                        |
//! |--------------------|-------------------------------------------------------------|
//! | `status`, `detail` | `{"ok":true,"report":{...}}` (see `raid::report::ArrayReport`) |
//! | `fail LEG`         | marks the leg faulty                                        |
//! | `remove LEG`       | takes the faulty or recovering leg out of its slot          |
//! | `add [--force] SPEC` | opens the device spec and adds it (recovery starts)       |
//! | `replace [--force] LEG SPEC` | adds SPEC, recovers it, then fails and removes LEG (in the background) |
//! | `check`, `repair`, `idle` | md's `sync_action`                                   |
//! | `speed-limit MIN MAX` | KiB/s (0 keeps a value)                                  |
//! | `monitor`          | keeps the connection: `{"ok":true,"event":"monitoring",...}`, then one JSON line per event of the array (`raid1::Event`) until the client goes |
//!
//! A LEG is a slot number (`blkq raid detail` lists them) or the leg's device spec, as it was
//! given or naming the same file (mdadm's habit: `mdadm --fail /dev/md0 /dev/sdb1`).
//!
//! The same socket takes `bitmap ...` lines (every export's dirty bitmaps, see
//! [`super::bitmap`]) and `export add|remove|list` lines (exports added and removed while
//! serving, see [`super::exports`]), with or without a mirror.

use std::fmt;
use std::str::FromStr;

use anyhow::{bail, Context, Result};

/// Longest accepted command line, bytes (newline included).
pub const MAX_LINE: usize = 4096;
/// Longest reply a client accepts, bytes.
pub const MAX_REPLY: u64 = 1 << 20;

/// A leg of the array, as a command names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Leg {
    /// Its slot number.
    Slot(usize),
    /// Its device spec.
    Spec(String),
}

impl From<&str> for Leg {
    /// Digits are a slot; anything else is a device spec (a spec starts with its kind).
    fn from(s: &str) -> Self {
        match s.parse::<usize>() {
            Ok(n) => Leg::Slot(n),
            Err(_) => Leg::Spec(s.to_string()),
        }
    }
}

impl FromStr for Leg {
    type Err = std::convert::Infallible;
    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        Ok(Leg::from(s))
    }
}

impl fmt::Display for Leg {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Leg::Slot(n) => write!(f, "{n}"),
            Leg::Spec(s) => f.write_str(s),
        }
    }
}

/// One command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Command {
    /// The summary report.
    Status,
    /// The per-leg report.
    Detail,
    /// Mark a leg faulty.
    Fail(Leg),
    /// Take a faulty or recovering leg out.
    Remove(Leg),
    /// Add a new leg.
    Add {
        /// Take a leg with data or a damaged superblock.
        force: bool,
        /// Take a former leg whose history diverged, discarding its writes.
        discard: bool,
        /// Its device spec (the rest of the line: it may hold spaces).
        spec: String,
    },
    /// Replace a leg by a new one, copied while the old one serves.
    Replace {
        /// As for `Add`.
        force: bool,
        /// The leg replaced.
        leg: Leg,
        /// The new leg's device spec (no spaces).
        spec: String,
    },
    /// md's `check`.
    Check,
    /// md's `repair`.
    Repair,
    /// md's `idle`.
    Idle,
    /// The array's events, one line each, for as long as the client listens.
    Monitor,
    /// Resync speed limits, KiB/s (0 keeps a value).
    SpeedLimit {
        /// md's sync_speed_min.
        min: u64,
        /// md's sync_speed_max.
        max: u64,
    },
}

const COMMANDS: &str = "status, detail, fail LEG, remove LEG, add [--force] [--discard] SPEC, \
                        replace [--force] LEG SPEC, check, repair, idle, speed-limit MIN MAX, monitor \
                        (LEG: a slot number or the leg's device spec)";

impl Command {
    /// Parses a command line (surrounding whitespace ignored).
    pub fn parse(line: &str) -> Result<Self> {
        let line = line.trim();
        let (cmd, rest) = match line.split_once(char::is_whitespace) {
            Some((c, r)) => (c, r.trim()),
            None => (line, ""),
        };
        // Leading flags: --force (add, replace) and --discard (add), in any order.
        let (mut force, mut discard, mut rest) = (false, false, rest);
        loop {
            let flag = |f: &str| {
                rest.strip_prefix(f)
                    .filter(|r| r.is_empty() || r.starts_with(char::is_whitespace))
                    .map(str::trim)
            };
            match (flag("--force"), flag("--discard")) {
                (Some(r), _) if matches!(cmd, "add" | "replace") && !force => {
                    force = true;
                    rest = r;
                }
                (_, Some(r)) if cmd == "add" && !discard => {
                    discard = true;
                    rest = r;
                }
                _ => break,
            }
        }
        let leg = |usage: &str| -> Result<Leg> {
            match rest {
                "" => bail!("usage: {usage}"),
                r => Ok(Leg::from(r)),
            }
        };
        let words: Vec<&str> = rest.split_whitespace().collect();
        Ok(match cmd {
            "status" => Command::Status,
            "detail" => Command::Detail,
            "fail" => Command::Fail(leg("fail LEG (a slot number or the leg's device spec)")?),
            "remove" => {
                Command::Remove(leg("remove LEG (a slot number or the leg's device spec)")?)
            }
            "add" if rest.is_empty() => {
                bail!("usage: add [--force] [--discard] SPEC (e.g. add file:/srv/c.img)")
            }
            "add" => Command::Add {
                force,
                discard,
                spec: rest.to_string(),
            },
            "replace" => match words[..] {
                [leg, spec] => Command::Replace {
                    force,
                    leg: Leg::from(leg),
                    spec: spec.to_string(),
                },
                _ => bail!("usage: replace [--force] LEG SPEC (the spec has no spaces)"),
            },
            "check" => Command::Check,
            "repair" => Command::Repair,
            "idle" => Command::Idle,
            "monitor" => Command::Monitor,
            "speed-limit" => match words[..] {
                [min, max] => Command::SpeedLimit {
                    min: min.parse().context("speed-limit: MIN is not a number")?,
                    max: max.parse().context("speed-limit: MAX is not a number")?,
                },
                _ => bail!("usage: speed-limit MIN MAX (KiB/s; 0 keeps a value)"),
            },
            "" => bail!("empty command"),
            other => bail!("unknown command {other:?}: {COMMANDS}"),
        })
    }

    /// Whether it changes the array (such commands run one at a time; the reports never wait
    /// for them).
    pub fn changes_array(&self) -> bool {
        !matches!(self, Command::Status | Command::Detail | Command::Monitor)
    }
}

impl fmt::Display for Command {
    /// The command line (without its newline), as [`Command::parse`] reads it.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let force = |b: bool| if b { "--force " } else { "" };
        match self {
            Command::Status => f.write_str("status"),
            Command::Detail => f.write_str("detail"),
            Command::Fail(l) => write!(f, "fail {l}"),
            Command::Remove(l) => write!(f, "remove {l}"),
            Command::Add {
                force: x,
                discard,
                spec,
            } => {
                let discard = if *discard { "--discard " } else { "" };
                write!(f, "add {}{discard}{spec}", force(*x))
            }
            Command::Replace {
                force: x,
                leg,
                spec,
            } => write!(f, "replace {}{leg} {spec}", force(*x)),
            Command::Check => f.write_str("check"),
            Command::Repair => f.write_str("repair"),
            Command::Idle => f.write_str("idle"),
            Command::Monitor => f.write_str("monitor"),
            Command::SpeedLimit { min, max } => write!(f, "speed-limit {min} {max}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_round_trip() {
        let all = [
            Command::Status,
            Command::Detail,
            Command::Fail(Leg::Slot(1)),
            Command::Remove(Leg::Spec("file:/srv/b.img".into())),
            Command::Add {
                force: true,
                discard: false,
                spec: "file:/srv/my disk.img".into(),
            },
            Command::Add {
                force: false,
                discard: false,
                spec: "file:/c".into(),
            },
            Command::Add {
                force: true,
                discard: true,
                spec: "nbd://b:10809/leg".into(),
            },
            Command::Add {
                force: false,
                discard: true,
                spec: "file:/c".into(),
            },
            Command::Replace {
                force: false,
                leg: Leg::Spec("file:/a,direct=1".into()),
                spec: "file:/d".into(),
            },
            Command::Replace {
                force: true,
                leg: Leg::Slot(0),
                spec: "file:/d".into(),
            },
            Command::Check,
            Command::Repair,
            Command::Idle,
            Command::Monitor,
            Command::SpeedLimit { min: 0, max: 9 },
        ];
        for c in all {
            assert_eq!(Command::parse(&c.to_string()).unwrap(), c, "{c}");
        }
    }

    #[test]
    fn bad_lines_say_why() {
        for (line, says) in [
            ("", "empty command"),
            ("frobnicate", "unknown command"),
            ("fail", "usage: fail LEG"),
            ("add", "usage: add"),
            ("add --force", "usage: add"),
            ("replace 1", "usage: replace"),
            ("speed-limit 1", "usage: speed-limit"),
            ("speed-limit x 1", "MIN is not a number"),
        ] {
            let e = format!("{:#}", Command::parse(line).unwrap_err());
            assert!(e.contains(says), "{line:?}: {e}");
        }
        assert!(!Command::Status.changes_array());
        assert!(Command::Idle.changes_array());
    }
}
