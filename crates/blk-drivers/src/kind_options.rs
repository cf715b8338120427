//! The options a device spec gives a kind of device: the trait each kind implements to take
//! its own, and the parsers of option values, whose errors name the option.

use std::str::FromStr;

use blk::{Driver, Error, QueueConfig};

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
