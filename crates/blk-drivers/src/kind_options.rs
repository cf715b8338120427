//! A kind of device as its own file declares it: its descriptor ([`Kind`]: name, form,
//! argument, path options), the trait its spec options implement ([`KindOptions`]), and the
//! parsers of option values, whose errors name the option.

use std::fmt;
use std::str::FromStr;

use blk::{Driver, Error, QueueConfig};

/// A kind of device (`null`, `mem`, `file`, `rbd`), declared once in its own file as a
/// `const KIND: Kind`, and listed on one line of [`crate::spec::KINDS`]: the spec parser,
/// `--raid1`'s leg list, the opener and a config file's path rebasing ask it, and none of
/// them names a kind.
pub struct Kind {
    /// The name a spec starts with (`NAME:ARG`).
    pub name: &'static str,
    /// The spec's form, for messages (`mem:SIZE`).
    pub form: &'static str,
    /// Parses the argument of spec `spec` (`arg`, after `NAME:`) into the kind's options at
    /// their defaults (`read_only`: the command line's `--read-only`), with the kind's own
    /// errors.
    pub(crate) parse: ParseArg,
    /// Whether the argument is a path (`file:PATH`): a config file makes it relative to its
    /// directory ([`crate::spec::DeviceSpec::rebase`]), and [`crate::spec::DeviceSpec::path`]
    /// gives it (a dirty-bitmap sidecar goes beside it).
    pub arg_is_path: bool,
    /// The `key=value` options whose values are paths (rbd's `conf`, `keyring`), which a
    /// config file makes relative to its directory as well.
    pub path_options: &'static [&'static str],
    /// Options that make the device read-only by being given, whatever their value (rbd's
    /// `snap`), beside every kind's `ro=1` / `read_only=1`.
    pub read_only_options: &'static [&'static str],
    /// What an operator is told when a device of this kind opens (`mem`'s data is lost when
    /// the server stops).
    pub warning: Option<&'static str>,
}

/// How a [`Kind`] parses its argument: `(spec, arg, read_only)` (the whole spec, for
/// messages; the argument; the command line's `--read-only`) to its options at their
/// defaults.
pub(crate) type ParseArg = fn(&str, &str, bool) -> Result<Box<dyn KindOptions>, Error>;

impl fmt::Debug for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name)
    }
}

/// Kinds are one by name (the name is what a spec gives).
impl PartialEq for Kind {
    fn eq(&self, other: &Self) -> bool {
        self.name == other.name
    }
}

impl Eq for Kind {}

/// A kind of device's own options, set one at a time from its spec, and the driver they
/// open: each kind declares them in its own file (`null.rs`, `mem.rs`, `file.rs`,
/// `rbd/mod.rs`), and the spec knows none of them.
pub(crate) trait KindOptions {
    /// Sets option `k` to `v`; `false` when this kind has no such option.
    fn set(&mut self, k: &str, v: &str) -> Result<bool, Error>;
    /// Opens the driver, and sets what it decides of the queue's limits in `cfg` (the
    /// capacity; rbd's largest I/O, one object, unless `max_io_given`).
    fn open(
        self: Box<Self>,
        cfg: &mut QueueConfig,
        max_io_given: bool,
    ) -> Result<Box<dyn Driver>, Error>;
}

/// A boolean option `k`: `1|0`, `true|false`, `yes|no` or `on|off`.
pub(crate) fn parse_bool(k: &str, v: &str) -> Result<bool, Error> {
    match v {
        "1" | "true" | "yes" | "on" => Ok(true),
        "0" | "false" | "no" | "off" => Ok(false),
        _ => Err(Error::Config(format!(
            "option {k}: bad boolean {v:?} (expected 0|1, on|off, yes|no or true|false)"
        ))),
    }
}

/// A numeric option `k`.
pub(crate) fn parse_num<T: FromStr>(k: &str, v: &str) -> Result<T, Error> {
    v.parse()
        .map_err(|_| Error::Config(format!("option {k}: bad number {v:?}")))
}

/// Parses a size: a number with an optional `K`, `M`, `G`, `T` suffix, powers of 1024 (`G` is
/// 2^30 bytes), optionally written `KiB`, `MiB`, `GiB`, `TiB`; a bare number may end in `B`.
/// `KB`, `MB`, `GB`, `TB` are refused, naming the accepted forms: their usual meaning is
/// decimal (10^9), and a size that silently meant something else would be worse than none.
pub fn parse_size(s: &str) -> Result<u64, Error> {
    let t = s.trim();
    let bad = || {
        Error::Config(format!(
            "bad size {s:?}: expected a number of bytes, or one with K, M, G or T \
             (also written KiB, MiB, GiB, TiB: powers of 1024), e.g. 512M, 4G"
        ))
    };
    let t = match t.strip_suffix("iB") {
        Some(u) if u.ends_with(|c: char| c.is_ascii_alphabetic()) => u,
        Some(_) => return Err(bad()),
        None => match t.strip_suffix(['B', 'b']) {
            // `GB` and its kind: decimal to most readers, so neither meaning is guessed.
            Some(u) if u.ends_with(|c: char| c.is_ascii_alphabetic()) => {
                return Err(Error::Config(format!(
                    "bad size {s:?}: {:?} is ambiguous (10^9 or 2^30?); sizes are binary: \
                     write {}G or {}GiB for powers of 1024 (K, M, G, T = KiB, MiB, GiB, TiB)",
                    &t[t.len() - 2..],
                    u.trim_end_matches(|c: char| c.is_ascii_alphabetic()),
                    u.trim_end_matches(|c: char| c.is_ascii_alphabetic()),
                )))
            }
            Some(u) => u,
            None => t,
        },
    };
    let (num, mult) = match t.chars().last() {
        Some(c @ ('k' | 'K' | 'm' | 'M' | 'g' | 'G' | 't' | 'T')) => {
            let shift = match c.to_ascii_uppercase() {
                'K' => 10,
                'M' => 20,
                'G' => 30,
                _ => 40,
            };
            (&t[..t.len() - 1], 1u64 << shift)
        }
        _ => (t, 1),
    };
    num.parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(mult))
        .ok_or_else(bad)
}

/// The size of a `null:` or `mem:` device: [`parse_size`], and not zero.
pub(crate) fn device_size(spec: &str, arg: &str) -> Result<u64, Error> {
    match parse_size(arg)? {
        0 => Err(Error::Config(format!(
            "bad device spec {spec:?}: a zero-size device (give a size, e.g. mem:64M)"
        ))),
        n => Ok(n),
    }
}
