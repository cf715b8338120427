//! Device specs, as given on the command line: `null:SIZE`, `mem:SIZE`, `file:PATH`, each
//! optionally followed by `,key=value` options, e.g.
//! `null:1G,completion=thread,completion_nsec=10000,hw_queue_depth=64`.
//!
//! Options of `file:` devices: `engine=auto|uring|pool|sync` (default `auto`: io_uring where it
//! works, else the thread pool), `direct=0|1` (`O_DIRECT` for 4096-aligned transfers),
//! `ro=0|1`, `lock=on|off` (default `on`: the file is locked with `flock` so that a second
//! user cannot open it meanwhile; see [`crate::backend::file`]), `workers=N` (pool threads, default
//! [`DEFAULT_WORKERS`](crate::file::DEFAULT_WORKERS)) and `entries=N` (io_uring
//! submission entries, default: the queue's tag count, so the ring never fills) and
//! `inline=0|1` (default 1: with `uring` and `pool`, requests that need not wait run on the
//! submitter's thread; see [`crate::file`], "Inline I/O").
//!
//! Options of `mem:` devices: `store=map|pages` (default `map`: one reserved anonymous
//! mapping, [`MapBackend`](crate::backend::MapBackend); `pages`: the sparse page table,
//! [`MemBackend`]) and, for `store=map`, `thp=0|1` (transparent huge pages, default 0).
//!
//! `splice=0|1` (`mem:` and `file:`, default 1): zero-copy reads where the store has them
//! (`store=map`'s `vmsplice`, a buffered file's `splice`; [`blk::Device::splice_read`]), which
//! the NBD server uses for large reads over plaintext connections, and writes received into
//! their home (`store=map`'s `recv` into the mapping; [`blk::Device::recv_home`]), which it
//! uses for large writes. `splice=0` turns both off.
//!
//! Options of every device: the queue's (`hw_queue_depth`, `submit_queues`, `shared_tags`,
//! `reserved_tags`, `wake`, `policy`, `block_size`, `max_io`) and its I/O scheduler:
//! `sched=none|mq-deadline` (default `none`), `sched_lock=locked|serialized` (default
//! `serialized`), and mq-deadline's tunables by their sysfs names, expiries in ms
//! (`read_expire`, `write_expire`, `writes_starved`, `fifo_batch`, `front_merges`,
//! `prio_aging_expire`, `async_depth`), e.g. `null:1G,sched=mq-deadline,fifo_batch=8`.
//!
//! Numeric options are checked when the device is built, and an error names the option:
//! `max_io` must fit in 32 bits (`max_io=4G` is refused, never truncated) and be at least the
//! block size; `block_size` must be a power of two from 512 to [`MAX_BLOCK_SIZE`] (what an
//! NBD export can advertise); `hw_queue_depth` and `submit_queues` are bounded by
//! [`MAX_QUEUE_DEPTH`] and [`MAX_HW_QUEUES`].
//!
//! Fault injection, as a wrapper option of every device: each `fault.`-prefixed option goes
//! (prefix stripped, in order) to [`FaultConfig::parse`], and
//! [`DeviceSpec::build_device`] wraps the built queue in a [`FaultDevice`], e.g.
//! `mem:1G,fault.seed=7,fault.fail_write_prob=0.01,fault.latency_us=100`. A spec with fault
//! options cannot be built as a bare [`Queue`] ([`DeviceSpec::build`] refuses it).

use std::path::Path;
use std::str::FromStr;

use blkq_sync::DynArc as Arc;
use sbitmap::WakeAlgo;

use blk::sched::{Deadline, DeadlineTunables, LockMode, SchedChoice};
use blk::{Device, Error, PoolPolicy, Queue, QueueConfig, Scheduler};

use crate::fault::{FaultConfig, FaultDevice};
pub use crate::kind_options::parse_size;
pub use crate::kind_options::Kind;
use crate::kind_options::{parse_bool, parse_num, KindOptions};

/// Every kind of device, one line each: each kind's file declares its [`Kind`] (name, form,
/// argument, options, paths), and everything about kinds (parsing, opening, `--raid1`'s leg
/// list, a config file's paths) is derived from this list. A new kind is one file and one
/// line here.
pub const KINDS: &[Kind] = &[
    crate::null::KIND,
    crate::mem::KIND,
    crate::file::KIND,
    crate::rbd::KIND,
];

impl Kind {
    /// The kind a spec names `name` ([`KINDS`]).
    pub fn named(name: &str) -> Option<&'static Kind> {
        KINDS.iter().find(|k| k.name == name)
    }

    /// The forms a spec takes, for messages: `null:SIZE, mem:SIZE, file:PATH or
    /// rbd:POOL/IMAGE`.
    pub fn forms() -> String {
        let mut out = String::new();
        for (i, k) in KINDS.iter().enumerate() {
            if i > 0 {
                out.push_str(if i + 1 == KINDS.len() { " or " } else { ", " });
            }
            out.push_str(k.form);
        }
        out
    }
}

/// The error of a spec that is none of the kinds' forms.
pub(crate) fn bad_spec(spec: &str) -> Error {
    Error::Config(format!(
        "bad device spec {spec:?}: expected {}",
        Kind::forms()
    ))
}

/// `path`, a path inside a device spec, joined to `dir` when it is relative; `None` when it
/// stays as it is (empty or absolute). `part` (the spec's part that holds it) names it in
/// the error: a joined path a spec cannot hold (a comma, which separates its options, or not
/// UTF-8) is refused.
pub fn join_path(part: &str, path: &str, dir: &Path) -> Result<Option<String>, Error> {
    if path.is_empty() || Path::new(path).is_absolute() {
        return Ok(None);
    }
    let full = dir.join(path);
    match full.to_str().filter(|f| !f.contains(',')) {
        Some(f) => Ok(Some(f.to_string())),
        None => Err(Error::Config(format!(
            "{part}: the path is relative to the directory {}, whose name a device spec cannot \
             hold (a comma, or not UTF-8): write the path absolute",
            dir.display()
        ))),
    }
}

/// A parsed device spec.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceSpec {
    /// The kind ([`KINDS`]).
    pub kind: &'static Kind,
    /// Its argument (after `NAME:`), which the kind parsed.
    pub arg: String,
    /// `key=value` options, in order.
    pub options: Vec<(String, String)>,
}

impl FromStr for DeviceSpec {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        let (head, rest) = match s.split_once(',') {
            Some((h, r)) => (h, Some(r)),
            None => (s, None),
        };
        let (name, arg) = head.split_once(':').ok_or_else(|| bad_spec(s))?;
        let kind = Kind::named(name)
            .filter(|k| !(k.arg_is_path && arg.is_empty()))
            .ok_or_else(|| bad_spec(s))?;
        // The kind's own errors, now rather than when the device is built.
        (kind.parse)(s, arg, false)?;
        let mut options = vec![];
        for kv in rest
            .into_iter()
            .flat_map(|r| r.split(','))
            .filter(|x| !x.is_empty())
        {
            let (k, v) = kv.split_once('=').ok_or_else(|| {
                Error::Config(format!("bad option {kv:?} in {s:?}: expected key=value"))
            })?;
            options.push((k.trim().to_string(), v.trim().to_string()));
        }
        Ok(Self {
            kind,
            arg: arg.to_string(),
            options,
        })
    }
}

/// The largest `block_size` a device may have: an NBD server advertises the device's logical
/// block size as the export's minimum block size, which the protocol caps at 64 KiB.
pub const MAX_BLOCK_SIZE: u32 = 64 << 10;
/// The most tags per hardware queue (`hw_queue_depth`, `--queue-depth`).
pub const MAX_QUEUE_DEPTH: u32 = 1 << 16;
/// The most hardware queues (`submit_queues`, `--hw-queues`).
pub const MAX_HW_QUEUES: u16 = 1024;

/// `max_io=SIZE`: a size that fits the queue's `u32` limit (never truncated).
fn parse_max_io(v: &str) -> Result<u32, Error> {
    let n = parse_size(v).map_err(|e| Error::Config(format!("option max_io: {e}")))?;
    u32::try_from(n).map_err(|_| {
        Error::Config(format!(
            "option max_io: {v:?} ({n} bytes) is too large (at most {} bytes, 4G - 1)",
            u32::MAX
        ))
    })
}

/// Checks the queue settings a spec (and the command line) gave, naming the option at fault:
/// nothing is silently truncated or left for a later panic, and the block size is one an NBD
/// export can advertise.
fn check_queue(cfg: &QueueConfig) -> Result<(), Error> {
    let lbs = cfg.limits.logical_block_size;
    if !lbs.is_power_of_two() || !(512..=MAX_BLOCK_SIZE).contains(&lbs) {
        return Err(Error::Config(format!(
            "option block_size: {lbs} is not a power of two from 512 to {MAX_BLOCK_SIZE} \
             (what an NBD export can advertise)"
        )));
    }
    let max_io = cfg.limits.max_io_bytes;
    if max_io < lbs {
        return Err(Error::Config(format!(
            "option max_io: {max_io} bytes is smaller than the block size ({lbs} bytes)"
        )));
    }
    if cfg.queue_depth == 0 || cfg.queue_depth > MAX_QUEUE_DEPTH {
        return Err(Error::Config(format!(
            "option hw_queue_depth (--queue-depth): {} is not in 1..={MAX_QUEUE_DEPTH}",
            cfg.queue_depth
        )));
    }
    if cfg.nr_hw_queues == 0 || cfg.nr_hw_queues > MAX_HW_QUEUES {
        return Err(Error::Config(format!(
            "option submit_queues (--hw-queues): {} is not in 1..={MAX_HW_QUEUES}",
            cfg.nr_hw_queues
        )));
    }
    if cfg.reserved_tags > MAX_QUEUE_DEPTH {
        return Err(Error::Config(format!(
            "option reserved_tags: {} is more than {MAX_QUEUE_DEPTH}",
            cfg.reserved_tags
        )));
    }
    Ok(())
}

/// Queue settings that a command line may force over a spec's own options.
#[derive(Debug, Clone, Default)]
pub struct QueueOverrides {
    /// `--hw-queues`.
    pub hw_queues: Option<u16>,
    /// `--queue-depth`.
    pub queue_depth: Option<u32>,
    /// `--shared-tags`.
    pub shared_tags: Option<bool>,
    /// `--wake`.
    pub wake: Option<WakeAlgo>,
    /// `--policy`.
    pub policy: Option<PoolPolicy>,
    /// `--read-only` (file devices open read-only).
    pub read_only: bool,
    /// `--sched`.
    pub sched: Option<SchedChoice>,
    /// `--sched-lock`.
    pub sched_lock: Option<LockMode>,
}

/// The prefix of fault-injection options in a device spec.
pub const FAULT_PREFIX: &str = "fault.";

impl DeviceSpec {
    /// Whether `s` starts with a kind's name and its colon ([`KINDS`]): where a
    /// comma-separated list of specs with their options (`--raid1`'s legs) begins the next
    /// spec.
    pub fn starts_a_spec(s: &str) -> bool {
        s.split_once(':')
            .is_some_and(|(k, _)| Kind::named(k).is_some())
    }

    /// `spec` with every relative path in it joined to `dir` (a config file's directory), as
    /// its kind declares them ([`Kind::arg_is_path`], [`Kind::path_options`]); the rest of the
    /// text as it is. A spec that names no kind is returned as is (its parser says what is
    /// wrong with it). Fails as [`join_path`] does.
    pub fn rebase(spec: &str, dir: &Path) -> Result<String, Error> {
        let (head, rest) = match spec.split_once(',') {
            Some((h, r)) => (h, Some(r)),
            None => (spec, None),
        };
        let Some(kind) = head.split_once(':').and_then(|(n, _)| Kind::named(n)) else {
            return Ok(spec.to_string());
        };
        let arg = &head[kind.name.len() + 1..];
        let mut out = format!("{}:", kind.name);
        match kind.arg_is_path.then(|| join_path(head, arg, dir)) {
            Some(Err(e)) => return Err(e),
            Some(Ok(Some(full))) => out.push_str(&full),
            _ => out.push_str(arg),
        }
        for part in rest.into_iter().flat_map(|r| r.split(',')) {
            out.push(',');
            let full = match part.split_once('=') {
                Some((k, v)) if kind.path_options.contains(&k) => {
                    join_path(part, v, dir)?.map(|full| format!("{k}={full}"))
                }
                _ => None,
            };
            out.push_str(full.as_deref().unwrap_or(part));
        }
        Ok(out)
    }

    /// The spec's argument as a path, when its kind's argument is one (`file:PATH`): where
    /// the device's data lives.
    pub fn path(&self) -> Option<&Path> {
        self.kind.arg_is_path.then(|| Path::new(&self.arg))
    }

    /// Whether the device is read-only: `--read-only` (`overrides.read_only`) or the spec's own
    /// `ro=1` / `read_only=1`. An export of it must advertise NBD_FLAG_READ_ONLY.
    pub fn is_read_only(&self, overrides: &QueueOverrides) -> bool {
        overrides.read_only
            || self.options.iter().any(|(k, v)| {
                (matches!(k.as_str(), "ro" | "read_only") && parse_bool(k, v).unwrap_or(false))
                    || self.kind.read_only_options.contains(&k.as_str())
            })
    }

    /// The spec's `fault.` options as a [`FaultConfig`], or `None` when it has none. Errors
    /// name the option (with its `fault.` prefix).
    pub fn fault_config(&self) -> Result<Option<FaultConfig>, Error> {
        let mut joined = String::new();
        let mut any = false;
        for (k, v) in &self.options {
            let Some(key) = k.strip_prefix(FAULT_PREFIX) else {
                continue;
            };
            // Check each option alone first, so that an error names the one at fault.
            let one = format!("{key}={v}");
            FaultConfig::parse(&one).map_err(|e| Error::Config(format!("option {k}={v}: {e}")))?;
            if any {
                joined.push(',');
            }
            joined.push_str(&one);
            any = true;
        }
        if !any {
            return Ok(None);
        }
        FaultConfig::parse(&joined)
            .map(Some)
            .map_err(|e| Error::Config(format!("fault options: {e}")))
    }

    /// Builds the device: its queue, wrapped in a [`FaultDevice`] when the spec has `fault.`
    /// options.
    pub fn build_device(&self, overrides: &QueueOverrides) -> Result<Arc<dyn Device>, Error> {
        let fault = self.fault_config()?;
        let q = self.build_queue(overrides)?;
        let q: Arc<dyn Device> = Arc::new(q);
        Ok(match fault {
            Some(cfg) => Arc::new(FaultDevice::new(q, cfg)),
            None => q,
        })
    }

    /// Builds the device's queue and driver. Refuses a spec with `fault.` options (a
    /// [`Queue`] cannot carry them: use [`build_device`](Self::build_device)).
    pub fn build(&self, overrides: &QueueOverrides) -> Result<Queue, Error> {
        if let Some((k, _)) = self
            .options
            .iter()
            .find(|(k, _)| k.starts_with(FAULT_PREFIX))
        {
            return Err(Error::Config(format!(
                "option {k}: fault options need a wrapped device (DeviceSpec::build_device), \
                 not a bare queue"
            )));
        }
        self.build_queue(overrides)
    }

    /// Builds the device's queue and driver from the spec's options, with `overrides` over
    /// them.
    fn build_queue(&self, overrides: &QueueOverrides) -> Result<Queue, Error> {
        let Options { mut queue, driver } = self.parse_options(overrides)?;
        queue.apply(overrides);
        check_queue(&queue.cfg)?;
        let sched = queue.sched.build()?;
        let driver = driver.open(&mut queue.cfg, queue.max_io_given)?;
        Queue::with_scheduler(queue.cfg, driver, sched)
    }

    /// Parses the spec's options (but its `fault.` ones, [`build_device`](Self::build_device)'s)
    /// into the queue's and the driver's settings. An option neither the queue nor this kind
    /// of device knows is refused by name.
    fn parse_options(&self, overrides: &QueueOverrides) -> Result<Options, Error> {
        let mut o = Options {
            queue: QueueOptions::default(),
            driver: (self.kind.parse)(
                &format!("{}:{}", self.kind.name, self.arg),
                &self.arg,
                overrides.read_only,
            )?,
        };
        for (k, v) in &self.options {
            let k = k.as_str();
            if k.starts_with(FAULT_PREFIX) {
                continue; // build_device's
            }
            if !o.queue.set(k, v)? && !o.driver.set(k, v)? {
                return Err(Error::Config(format!(
                    "unknown option {k:?} for a {} device",
                    self.kind.name
                )));
            }
        }
        Ok(o)
    }
}

/// A spec's options, parsed ([`DeviceSpec::parse_options`]).
struct Options {
    /// The queue's, for every kind of device.
    queue: QueueOptions,
    /// The driver's, declared by its kind.
    driver: Box<dyn KindOptions>,
}

/// The queue's options of a spec: its configuration and its scheduler.
struct QueueOptions {
    cfg: QueueConfig,
    /// Whether `max_io` was given (else rbd sets it from its object size).
    max_io_given: bool,
    sched: SchedOptions,
}

impl Default for QueueOptions {
    fn default() -> Self {
        Self {
            cfg: QueueConfig::new(0),
            max_io_given: false,
            sched: SchedOptions {
                choice: SchedChoice::None,
                lock: LockMode::default(),
                tunables: DeadlineTunables::default(),
                tuned: false,
            },
        }
    }
}

/// The scheduler options of a spec.
struct SchedOptions {
    choice: SchedChoice,
    lock: LockMode,
    tunables: DeadlineTunables,
    /// Whether any mq-deadline tunable was given.
    tuned: bool,
}

impl SchedOptions {
    /// The scheduler chosen, with its tunables; tunables without mq-deadline are refused.
    fn build(self) -> Result<Option<Box<dyn Scheduler>>, Error> {
        Ok(match self.choice {
            SchedChoice::None if self.tuned => {
                return Err(Error::Config(
                    "mq-deadline tunables given without sched=mq-deadline".into(),
                ))
            }
            SchedChoice::None => None,
            SchedChoice::MqDeadline => Some(Box::new(
                Deadline::new(self.lock).with_tunables(Arc::new(self.tunables)),
            )),
        })
    }
}

impl QueueOptions {
    /// Sets queue option `k` to `v`; `false` when `k` is not a queue option.
    fn set(&mut self, k: &str, v: &str) -> Result<bool, Error> {
        let cfg = &mut self.cfg;
        match k {
            "sched" | "scheduler" => self.sched.choice = v.parse()?,
            "sched_lock" => self.sched.lock = v.parse()?,
            k if DeadlineTunables::NAMES.contains(&k) => {
                self.sched.tunables.set(k, v)?;
                self.sched.tuned = true;
            }
            "hw_queue_depth" | "queue_depth" => cfg.queue_depth = parse_num(k, v)?,
            "submit_queues" | "hw_queues" => cfg.nr_hw_queues = parse_num(k, v)?,
            "shared_tags" => cfg.shared_tags = parse_bool(k, v)?,
            "reserved_tags" => cfg.reserved_tags = parse_num(k, v)?,
            "wake" => cfg.wake = v.parse()?,
            "policy" => cfg.policy = v.parse()?,
            "block_size" => cfg.limits.logical_block_size = parse_num(k, v)?,
            "max_io" => {
                cfg.limits.max_io_bytes = parse_max_io(v)?;
                self.max_io_given = true;
            }
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// Puts the command line's settings over the spec's.
    fn apply(&mut self, overrides: &QueueOverrides) {
        let cfg = &mut self.cfg;
        if let Some(h) = overrides.hw_queues {
            cfg.nr_hw_queues = h;
        }
        if let Some(d) = overrides.queue_depth {
            cfg.queue_depth = d;
        }
        if let Some(s) = overrides.shared_tags {
            cfg.shared_tags = s;
        }
        if let Some(w) = overrides.wake {
            cfg.wake = w;
        }
        if let Some(p) = overrides.policy {
            cfg.policy = p;
        }
        if let Some(s) = overrides.sched {
            self.sched.choice = s;
        }
        if let Some(l) = overrides.sched_lock {
            self.sched.lock = l;
        }
    }
}

#[cfg(all(test, not(blkq_loom)))]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("512M").unwrap(), 512 << 20);
        assert_eq!(parse_size("1G").unwrap(), 1 << 30);
        assert_eq!(parse_size("2GiB").unwrap(), 2 << 30);
        assert!(parse_size("G").is_err());
        assert!(parse_size("-1").is_err());
        assert!(parse_size("99999999999T").is_err());
    }

    #[test]
    fn decimal_units_and_zero_sizes_are_refused_naming_the_accepted_forms() {
        assert_eq!(parse_size("10G").unwrap(), 10 << 30);
        assert_eq!(parse_size("10GiB").unwrap(), 10 << 30);
        assert_eq!(parse_size("512").unwrap(), 512);
        for bad in ["10GB", "10gb", "512MB", "4KB", "1TB"] {
            let e = parse_size(bad).unwrap_err().to_string();
            assert!(e.contains("GiB") && e.contains("1024"), "{bad}: {e}");
        }
        for spec in ["mem:0", "null:0", "mem:0G"] {
            let e = spec.parse::<DeviceSpec>().unwrap_err().to_string();
            assert!(e.contains("zero-size"), "{spec}: {e}");
        }
    }

    #[test]
    fn a_bad_boolean_option_names_the_option_and_the_accepted_values() {
        let mut dir = std::env::temp_dir();
        dir.push(format!("blkq-spec-bool-{}", std::process::id()));
        std::fs::write(&dir, vec![0u8; 4096]).unwrap();
        for opt in ["direct", "lock", "ro", "inline", "splice"] {
            let spec: DeviceSpec = format!("file:{},{opt}=maybe", dir.display())
                .parse()
                .unwrap();
            let e = spec
                .build(&QueueOverrides::default())
                .unwrap_err()
                .to_string();
            assert!(
                e.contains(&format!("option {opt}")) && e.contains("0|1") && e.contains("on|off"),
                "{opt}: {e}"
            );
        }
        std::fs::remove_file(&dir).unwrap();
        let e = "mem:1M,thp=2"
            .parse::<DeviceSpec>()
            .unwrap()
            .build(&QueueOverrides::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("option thp") && e.contains("0|1"), "{e}");
    }

    #[test]
    fn specs() {
        let s: DeviceSpec = "null:1G,completion=thread,completion_nsec=10000,hw_queue_depth=64"
            .parse()
            .unwrap();
        assert_eq!((s.kind, s.arg.as_str()), (&crate::null::KIND, "1G"));
        assert_eq!(s.path(), None);
        assert_eq!(s.options.len(), 3);
        let f: DeviceSpec = "file:/tmp/x.img".parse().unwrap();
        assert_eq!(f.kind, &crate::file::KIND);
        assert_eq!(f.path(), Some(Path::new("/tmp/x.img")));
        assert!("disk:1G".parse::<DeviceSpec>().is_err());
        assert!("null:1G,bogus".parse::<DeviceSpec>().is_err());
        let bad: DeviceSpec = "mem:1M,completion=thread".parse().unwrap();
        assert!(bad.build(&QueueOverrides::default()).is_err());
    }

    /// [`KINDS`] is the one list the parser knows: each kind's name starts a spec and parses
    /// as that kind (or fails with the kind's own error, not as no kind at all), its form
    /// begins with its name and is in the message for a spec of no kind, and a name it does
    /// not hold is refused as no kind.
    #[test]
    fn the_kind_list_is_the_parsers() {
        let none = "disk:1G".parse::<DeviceSpec>().unwrap_err().to_string();
        for k in KINDS {
            let n = k.name;
            assert_eq!(Kind::named(n), Some(k), "{n}");
            assert!(k.form.starts_with(&format!("{n}:")), "{n}: {}", k.form);
            assert!(none.contains(k.form), "{n}: {none}");
            assert!(DeviceSpec::starts_a_spec(&format!("{n}:x")), "{n}");
            match format!("{n}:x").parse::<DeviceSpec>() {
                Ok(spec) => assert_eq!(spec.kind, k, "{n}"),
                Err(e) => assert!(!e.to_string().contains(&Kind::forms()), "{n}: {e}"),
            }
        }
        assert!(none.contains(&Kind::forms()), "{none}");
        assert!(none.ends_with("or rbd:POOL/IMAGE"), "{none}");
        // A kind whose argument is a path, with none: no spec of it, every form named.
        for k in KINDS.iter().filter(|k| k.arg_is_path) {
            let e = format!("{}:", k.name).parse::<DeviceSpec>().unwrap_err();
            assert!(e.to_string().contains(&Kind::forms()), "{}: {e}", k.name);
        }
        for not in ["disk:1G", "direct=1", "fault.x=mem:1M", "nbd://h/e", "mem"] {
            assert!(!DeviceSpec::starts_a_spec(not), "{not}");
        }
    }

    /// A config file's paths are the ones each kind declares: for every listed kind, a
    /// relative argument is joined to the directory exactly when the kind says its argument
    /// is a path, and so is each of its path options, and no other option.
    #[test]
    fn rebase_joins_the_paths_each_kind_declares() {
        let dir = Path::new("/etc/blkq");
        for k in KINDS {
            let mut spec = format!("{}:a/b,x=rel", k.name);
            let mut want = match k.arg_is_path {
                true => format!("{}:/etc/blkq/a/b,x=rel", k.name),
                false => spec.clone(),
            };
            for o in k.path_options {
                spec.push_str(&format!(",{o}=rel,{o}=/abs,{o}="));
                want.push_str(&format!(",{o}=/etc/blkq/rel,{o}=/abs,{o}="));
            }
            assert_eq!(DeviceSpec::rebase(&spec, dir).unwrap(), want, "{}", k.name);
            let abs = format!("{}:/a", k.name);
            assert_eq!(DeviceSpec::rebase(&abs, dir).unwrap(), abs);
        }
        assert!(KINDS.iter().any(|k| k.arg_is_path));
        assert!(KINDS.iter().any(|k| !k.path_options.is_empty()));
        for other in ["disk:x,conf=c", "nbd://h/e?socket=s", "file"] {
            assert_eq!(DeviceSpec::rebase(other, dir).unwrap(), other);
        }
        let e = DeviceSpec::rebase("file:x", Path::new("/a,b"))
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("file:x: ") && e.contains("comma"), "{e}");
    }

    #[test]
    fn scheduler_options() {
        let overrides = QueueOverrides::default();
        let q = "null:1M,sched=mq-deadline,sched_lock=locked,fifo_batch=4,read_expire=20"
            .parse::<DeviceSpec>()
            .unwrap()
            .build(&overrides)
            .unwrap();
        let s = q.scheduler().unwrap();
        assert_eq!(s.name(), "mq-deadline");
        let d = s.as_any().unwrap().downcast_ref::<Deadline>().unwrap();
        assert_eq!(d.lock_mode(), LockMode::Locked);
        assert_eq!(d.tunables().fifo_batch(), 4);
        assert_eq!(
            d.tunables().read_expire(),
            std::time::Duration::from_millis(20)
        );
        let q = "null:1M"
            .parse::<DeviceSpec>()
            .unwrap()
            .build(&overrides)
            .unwrap();
        assert!(q.scheduler().is_none());
        let ov2 = QueueOverrides {
            sched: Some(SchedChoice::MqDeadline),
            ..QueueOverrides::default()
        };
        let q = "null:1M"
            .parse::<DeviceSpec>()
            .unwrap()
            .build(&ov2)
            .unwrap();
        let d = q.scheduler().unwrap().as_any().unwrap();
        assert_eq!(
            d.downcast_ref::<Deadline>().unwrap().lock_mode(),
            LockMode::Serialized
        );
        for bad in [
            "null:1M,sched=cfq",
            "null:1M,sched=mq-deadline,sched_lock=spin",
            "null:1M,sched=mq-deadline,fifo_batch=x",
            "null:1M,fifo_batch=4",
        ] {
            let spec: DeviceSpec = bad.parse().unwrap();
            assert!(spec.build(&overrides).is_err(), "{bad}");
        }
    }
}
