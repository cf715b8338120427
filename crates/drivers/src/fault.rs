//! `fault`: a fault-injection device. A [`FaultDevice`] wraps any other [`Device`] and is
//! itself a bio-based `Device`: it sees every bio on `submit`/`submit_batch`, decides what to
//! do with it from its [`Rule`]s, forwards it to the inner device, and sees the completion on
//! its own [`EndIo`] before handing it back to the submitter.
//!
//! What it can do (any combination, configured at construction with a [`FaultConfig`] and
//! changed at run time through a [`FaultHandle`]):
//! - **fail** reads, writes, flushes, discards/write-zeroes, chosen by byte range (any
//!   overlap), by count (the Nth matching I/O, the next K, every one after N) or by seeded
//!   probability, with a chosen errno (default `EIO`). A failed I/O is never forwarded.
//! - **delay** completions by a fixed latency plus seeded jitter, on the device's timer thread
//!   (never by sleeping in the submitter).
//! - **stall** matching I/Os before they reach the inner device, until
//!   [`FaultHandle::release`] forwards them (hung-disk tests).
//! - **crash** ([`FaultHandle::crash`]): with [`FaultConfig::volatile_cache`] on, the device
//!   models a volatile write cache and a crash rolls the inner device back so that every write
//!   not made durable (by a completed FLUSH, or FUA) is lost; see "The crash model".
//! - counters of what it saw and did ([`FaultHandle::counters`]).
//!
//! ```no_run
//! use blkq_sync::DynArc as Arc;
//! use blk_drivers::fault::{FaultConfig, FaultDevice, OpSet, Rule};
//! use blk::Device;
//! # fn inner() -> Arc<dyn Device> { unimplemented!() }
//! let cfg: FaultConfig = "seed=7,fail_write=0+1M,volatile_cache=on".parse().unwrap();
//! let dev = FaultDevice::new(inner(), cfg);
//! let faults = dev.handle();
//! let dev: Arc<dyn Device> = Arc::new(dev);
//! faults.add(Rule::fail(OpSet::READ).nth(3).errno(libc::ENOSPC));
//! // ... I/O through `dev` ...
//! faults.crash().unwrap(); // the unflushed writes are gone from the inner device
//! faults.restart();
//! ```
//!
//! # Determinism
//!
//! Every I/O submitted gets a sequence number (`seq`, in submission order, counted under the
//! rule lock; I/Os refused because the device is crashed get none). Probabilities and jitter are a pure hash (SplitMix64) of `(seed, rule id, seq)`,
//! so the same seed, the same rules and the same sequence of I/Os give the same faults, and a
//! failing test replays from its seed. Rule ids are given in the order rules are added.
//!
//! # Completions without allocation
//!
//! The device registers one `EndIo` of its own (`Completer`) when it is built, and passes it to
//! the inner device for every forwarded bio. The submitter's `Arc<dyn EndIo>` (one `Arc`
//! clone per I/O, as every `Device` does), the submitter's `cookie` and what the completion
//! still needs (its delay, its flush mark, its undo entry) are parked in a slot of a slot
//! table, and the bio's `cookie` carries the slot's index to the inner device and back (blk
//! never reads cookies). On completion the slot is emptied, the cookie restored and the slot
//! index pushed on a free list. The table and free list grow only when more I/Os are in
//! flight than ever before, so in the steady state no I/O allocates. (A per-submitter cache
//! of ends was the alternative: it saves the `Arc` clone, but needs a way to name submitters
//! and still per-I/O room for the cookie, the delay and the crash bookkeeping, which the
//! table gives in one place.) Slots, the stall list and
//! the timer queue are plain vectors under locks of the facade: this is a test device, and
//! exactness matters more here than the last nanosecond.
//!
//! # The crash model
//!
//! With `volatile_cache` on, the device keeps an undo log. Before a write, discard or
//! write-zeroes without FUA is forwarded, the old contents of its range are read from the inner
//! device (synchronously, on the submitter's thread) into an undo entry. So **every write costs
//! a read: crash mode is for tests**. Then:
//! - when an I/O is acknowledged to its submitter, its entry is stamped with the
//!   acknowledgement number;
//! - a FLUSH remembers, when it is forwarded, how many acknowledgements there were; when it is
//!   acknowledged successfully, the entries acknowledged before it was submitted are dropped
//!   (those writes are now durable);
//! - a successful FUA write (discard, write-zeroes: zeros) is durable at once: it has no entry,
//!   and the parts of older entries that it overwrote are patched with its data, so a roll
//!   back cannot bring back what the FUA write replaced;
//! - [`FaultHandle::crash`] marks the device crashed (every I/O fails with `EIO` from then on,
//!   completions not yet acknowledged included, until [`FaultHandle::restart`]), fails the
//!   stalled I/Os, waits for the I/Os in flight in the inner device, then writes the undo
//!   entries back newest first (FUA) and flushes. Overlapping unflushed writes thus roll back
//!   to the last durable content.
//!
//! Overlapping writes in flight at the same time have no defined order (as on a real disk);
//! the model is exact when each write's overlapping predecessors completed before it was
//! submitted. Writes the inner device failed keep their entry (their outcome is undefined, and
//! the roll back restores the old data). A discard is modelled as zeroing for FUA patches.

use blkq_sync::DynArc as Arc;
use std::fmt;
use std::time::{Duration, Instant};

use blkq_sync::stat::{Ordering, StatU64};
use blkq_sync::thread::{self, Thread};
use blkq_sync::Mutex;

use blk::{Bio, BioFlags, Buffer, Device, EndIo, Error, Extent, Limits, Op, SECTOR_SHIFT};

/// A set of operations a rule applies to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct OpSet(pub u8);

impl OpSet {
    /// Reads.
    pub const READ: Self = Self(1);
    /// Writes.
    pub const WRITE: Self = Self(2);
    /// Flushes.
    pub const FLUSH: Self = Self(4);
    /// Discards and write-zeroes.
    pub const DISCARD: Self = Self(8);
    /// Every operation.
    pub const ALL: Self = Self(15);

    /// Whether `op` is in the set.
    #[inline]
    pub fn contains(self, op: Op) -> bool {
        self.0 & Self::of(op).0 != 0
    }

    /// The set holding just `op`'s class.
    #[inline]
    pub fn of(op: Op) -> Self {
        match op {
            Op::Read => Self::READ,
            Op::Write => Self::WRITE,
            Op::Flush => Self::FLUSH,
            Op::Discard | Op::WriteZeroes => Self::DISCARD,
        }
    }
}

impl std::ops::BitOr for OpSet {
    type Output = Self;
    fn bitor(self, rhs: Self) -> Self {
        Self(self.0 | rhs.0)
    }
}

/// When a rule fires, among the I/Os it matches (by op and range).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum When {
    /// Every matching I/O.
    Always,
    /// Matching I/Os number `skip + 1 ..= skip + count` (1-based, counted from when the rule
    /// was added); `count: None` means every one after the first `skip`.
    Count {
        /// Matching I/Os let through first.
        skip: u64,
        /// How many fire after those (`None`: all).
        count: Option<u64>,
    },
    /// Each matching I/O with this probability (0..=1), drawn from the device's seed.
    Prob(f64),
}

/// What a rule does to the I/Os it fires on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Complete with this errno without forwarding.
    Fail {
        /// The errno (e.g. `libc::EIO`).
        errno: i32,
    },
    /// Delay the completion by `base` plus a seeded uniform jitter in `0..=jitter`.
    Delay {
        /// Fixed latency.
        base: Duration,
        /// Largest extra latency.
        jitter: Duration,
    },
    /// Hold the I/O before it reaches the inner device until [`FaultHandle::release`].
    Stall,
}

/// One fault rule: which I/Os (ops, optional byte range), when, and what.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rule {
    /// Operations matched.
    pub ops: OpSet,
    /// Byte range `(offset, len)`: an I/O matches if it overlaps it. Flushes have no range and
    /// never match a rule with one. `None`: any I/O.
    pub range: Option<(u64, u64)>,
    /// When the rule fires.
    pub when: When,
    /// What it does.
    pub action: Action,
}

impl Rule {
    /// Fails every I/O of `ops` with `EIO` (refine with the builder methods).
    pub fn fail(ops: OpSet) -> Self {
        Self {
            ops,
            range: None,
            when: When::Always,
            action: Action::Fail { errno: libc::EIO },
        }
    }

    /// Delays the completions of `ops` by `base` plus up to `jitter`.
    pub fn delay(ops: OpSet, base: Duration, jitter: Duration) -> Self {
        Self {
            action: Action::Delay { base, jitter },
            ..Self::fail(ops)
        }
    }

    /// Stalls the I/Os of `ops` until released.
    pub fn stall(ops: OpSet) -> Self {
        Self {
            action: Action::Stall,
            ..Self::fail(ops)
        }
    }

    /// Only I/Os overlapping `offset..offset + len` (bytes).
    pub fn in_range(mut self, offset: u64, len: u64) -> Self {
        self.range = Some((offset, len));
        self
    }

    /// Only the `n`th matching I/O (1-based).
    pub fn nth(mut self, n: u64) -> Self {
        self.when = When::Count {
            skip: n.saturating_sub(1),
            count: Some(u64::from(n > 0)),
        };
        self
    }

    /// Only the next `k` matching I/Os.
    pub fn next(mut self, k: u64) -> Self {
        self.when = When::Count {
            skip: 0,
            count: Some(k),
        };
        self
    }

    /// Every matching I/O after the first `n`.
    pub fn after(mut self, n: u64) -> Self {
        self.when = When::Count {
            skip: n,
            count: None,
        };
        self
    }

    /// Each matching I/O with probability `p` (clamped to 0..=1; NaN is 0).
    pub fn prob(mut self, p: f64) -> Self {
        self.when = When::Prob(if p.is_nan() { 0.0 } else { p.clamp(0.0, 1.0) });
        self
    }

    /// The errno of a `Fail` rule.
    pub fn errno(mut self, errno: i32) -> Self {
        if let Action::Fail { errno: e } = &mut self.action {
            *e = errno;
        }
        self
    }

    fn matches(&self, op: Op, offset: u64, len: u64) -> bool {
        if !self.ops.contains(op) {
            return false;
        }
        match self.range {
            None => true,
            Some(_) if op == Op::Flush => false,
            Some((r0, rlen)) => offset < r0.saturating_add(rlen) && r0 < offset.saturating_add(len),
        }
    }
}

/// The configuration of a [`FaultDevice`]; [`FaultConfig::parse`] reads it from a spec string.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct FaultConfig {
    /// Seed of probabilities and jitter.
    pub seed: u64,
    /// Rules, in order (a `Fail` of an earlier rule wins; delays add up).
    pub rules: Vec<Rule>,
    /// Model a volatile write cache (undo log; every write costs a read) so that
    /// [`FaultHandle::crash`] works.
    pub volatile_cache: bool,
}

impl std::str::FromStr for FaultConfig {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        Self::parse(s)
    }
}

fn opt_err(key: &str, why: impl fmt::Display) -> Error {
    Error::Config(format!("fault option {key:?}: {why}"))
}

/// A size: digits with an optional binary suffix `K`, `M`, `G`, `T` (an optional `B`/`iB`).
fn parse_bytes(key: &str, s: &str) -> Result<u64, Error> {
    let t = s.trim();
    let t = t
        .strip_suffix("iB")
        .or_else(|| t.strip_suffix('B'))
        .unwrap_or(t);
    let (num, shift) = match t.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let shift = match c.to_ascii_uppercase() {
                'K' => 10,
                'M' => 20,
                'G' => 30,
                'T' => 40,
                _ => return Err(opt_err(key, format!("bad size {s:?}"))),
            };
            (&t[..i], shift)
        }
        _ => (t, 0),
    };
    let n: u64 = num
        .parse()
        .map_err(|_| opt_err(key, format!("bad size {s:?}")))?;
    n.checked_mul(1u64 << shift)
        .ok_or_else(|| opt_err(key, format!("size {s:?} overflows")))
}

fn parse_u64(key: &str, v: &str) -> Result<u64, Error> {
    v.trim()
        .parse()
        .map_err(|_| opt_err(key, format!("expected a whole number, got {v:?}")))
}

/// `OFF+LEN` (sizes) or `all`/`*` (every I/O).
fn parse_range(key: &str, v: &str) -> Result<Option<(u64, u64)>, Error> {
    let v = v.trim();
    if v.is_empty() || v == "all" || v == "*" {
        return Ok(None);
    }
    let Some((off, len)) = v.split_once('+') else {
        return Err(opt_err(
            key,
            format!("expected OFFSET+LEN or all, got {v:?}"),
        ));
    };
    Ok(Some((parse_bytes(key, off)?, parse_bytes(key, len)?)))
}

fn parse_bool(key: &str, v: &str) -> Result<bool, Error> {
    match v.trim() {
        "" | "1" | "on" | "true" | "yes" => Ok(true),
        "0" | "off" | "false" | "no" => Ok(false),
        _ => Err(opt_err(key, format!("expected on or off, got {v:?}"))),
    }
}

/// An errno by name (`EIO`, `ENOSPC`, ...) or number (1..4096).
pub fn parse_errno(s: &str) -> Option<i32> {
    let t = s.trim();
    if let Ok(n) = t.parse::<i32>() {
        return (1..4096).contains(&n).then_some(n);
    }
    Some(match t.to_ascii_uppercase().as_str() {
        "EIO" => libc::EIO,
        "ENOSPC" => libc::ENOSPC,
        "EROFS" => libc::EROFS,
        "EPERM" => libc::EPERM,
        "EACCES" => libc::EACCES,
        "EINVAL" => libc::EINVAL,
        "ENOMEM" => libc::ENOMEM,
        "ENXIO" => libc::ENXIO,
        "ENODEV" => libc::ENODEV,
        "EAGAIN" => libc::EAGAIN,
        "EBUSY" => libc::EBUSY,
        "ETIMEDOUT" => libc::ETIMEDOUT,
        "ECANCELED" => libc::ECANCELED,
        "EOVERFLOW" => libc::EOVERFLOW,
        "EFBIG" => libc::EFBIG,
        "EDQUOT" => libc::EDQUOT,
        "ENOTSUP" | "EOPNOTSUPP" => libc::ENOTSUP,
        "ESHUTDOWN" => libc::ESHUTDOWN,
        _ => return None,
    })
}

fn parse_class(key: &str, class: &str) -> Result<OpSet, Error> {
    Ok(match class {
        "read" => OpSet::READ,
        "write" => OpSet::WRITE,
        "flush" => OpSet::FLUSH,
        "discard" | "zero" | "trim" => OpSet::DISCARD,
        "any" | "io" | "all" => OpSet::ALL,
        _ => {
            return Err(opt_err(
                key,
                format!("unknown operation {class:?} (read, write, flush, discard, any)"),
            ))
        }
    })
}

impl FaultConfig {
    /// Parses a comma-separated option list, e.g.
    /// `seed=7,fail_write=0+1M,fail_read_prob=0.01,latency_us=100,errno=EIO`.
    ///
    /// Options (OP is `read`, `write`, `flush`, `discard` (discards and write-zeroes) or
    /// `any`; RANGE is `OFFSET+LEN` with sizes like `4K`, `1M`, or `all`):
    /// - `seed=N`; `errno=NAME|N` (of every fail rule of the string; default `EIO`);
    /// - `fail_OP=RANGE`, `fail_OP_nth=N`, `fail_OP_next=K`, `fail_OP_after=N`,
    ///   `fail_OP_prob=P`;
    /// - `latency_us=N`, `jitter_us=N` (every operation);
    /// - `stall_OP=RANGE`;
    /// - `volatile_cache=on|off` (alias `crash`).
    ///
    /// Errors name the option.
    pub fn parse(s: &str) -> Result<Self, Error> {
        let mut cfg = FaultConfig::default();
        let mut errno = libc::EIO;
        let (mut latency, mut jitter) = (None::<u64>, None::<u64>);
        for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            let (key, v) = item.split_once('=').unwrap_or((item, ""));
            let key = key.trim();
            match key {
                "seed" => cfg.seed = parse_u64(key, v)?,
                "errno" => {
                    errno = parse_errno(v)
                        .ok_or_else(|| opt_err(key, format!("unknown errno {v:?}")))?
                }
                "volatile_cache" | "crash" => cfg.volatile_cache = parse_bool(key, v)?,
                "latency_us" => latency = Some(parse_u64(key, v)?),
                "jitter_us" => jitter = Some(parse_u64(key, v)?),
                _ => {
                    if let Some(rest) = key.strip_prefix("fail_") {
                        let (class, kind) = match rest.split_once('_') {
                            Some((c, k)) => (c, Some(k)),
                            None => (rest, None),
                        };
                        let r = Rule::fail(parse_class(key, class)?);
                        let r = match kind {
                            None => match parse_range(key, v)? {
                                Some((o, l)) => r.in_range(o, l),
                                None => r,
                            },
                            Some("nth") => {
                                let n = parse_u64(key, v)?;
                                if n == 0 {
                                    return Err(opt_err(key, "counts from 1"));
                                }
                                r.nth(n)
                            }
                            Some("next") => r.next(parse_u64(key, v)?),
                            Some("after") => r.after(parse_u64(key, v)?),
                            Some("prob") => {
                                let p: f64 = v.trim().parse().map_err(|_| {
                                    opt_err(key, format!("expected a probability, got {v:?}"))
                                })?;
                                if !(0.0..=1.0).contains(&p) {
                                    return Err(opt_err(key, "probability must be in 0..=1"));
                                }
                                r.prob(p)
                            }
                            Some(k) => {
                                return Err(opt_err(
                                    key,
                                    format!("unknown selector {k:?} (nth, next, after, prob)"),
                                ))
                            }
                        };
                        cfg.rules.push(r);
                    } else if let Some(class) = key.strip_prefix("stall_") {
                        let r = Rule::stall(parse_class(key, class)?);
                        cfg.rules.push(match parse_range(key, v)? {
                            Some((o, l)) => r.in_range(o, l),
                            None => r,
                        });
                    } else {
                        return Err(opt_err(key, "unknown option"));
                    }
                }
            }
        }
        for r in &mut cfg.rules {
            *r = r.errno(errno);
        }
        if latency.is_some() || jitter.is_some() {
            cfg.rules.push(Rule::delay(
                OpSet::ALL,
                Duration::from_micros(latency.unwrap_or(0)),
                Duration::from_micros(jitter.unwrap_or(0)),
            ));
        }
        Ok(cfg)
    }
}

/// SplitMix64's finaliser: a good 64-bit mix, the whole PRNG the device needs.
#[inline]
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The deterministic draw for `(seed, rule, seq, salt)`.
#[inline]
fn draw(seed: u64, rule: u64, seq: u64, salt: u64) -> u64 {
    mix(mix(mix(seed ^ salt).wrapping_add(rule)).wrapping_add(seq))
}

/// A snapshot of a fault device's counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FaultCounters {
    /// I/Os submitted, by class: read, write, flush, discard/write-zeroes.
    pub seen: [u64; 4],
    /// I/Os failed by a rule, by class.
    pub failed: [u64; 4],
    /// I/Os whose completion was delayed.
    pub delayed: u64,
    /// I/Os stalled.
    pub stalled: u64,
    /// I/Os failed because the device was crashed.
    pub crashed_io: u64,
    /// Undo reads made (volatile cache).
    pub undo_reads: u64,
    /// Crashes.
    pub crashes: u64,
    /// Writes rolled back by crashes.
    pub writes_lost: u64,
}

#[derive(Debug, Default)]
struct Counters {
    seen: [StatU64; 4],
    failed: [StatU64; 4],
    delayed: StatU64,
    stalled: StatU64,
    crashed_io: StatU64,
    undo_reads: StatU64,
    crashes: StatU64,
    writes_lost: StatU64,
}

fn class_index(op: Op) -> usize {
    match op {
        Op::Read => 0,
        Op::Write => 1,
        Op::Flush => 2,
        Op::Discard | Op::WriteZeroes => 3,
    }
}

// Counters are statistics only: nothing decides anything on them, so Relaxed everywhere.
#[inline]
fn bump(c: &StatU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

struct RuleState {
    id: u64,
    rule: Rule,
    matched: u64,
}

struct Rules {
    seed: u64,
    next_id: u64,
    /// I/Os seen, the `seq` of the next one.
    seq: u64,
    list: Vec<RuleState>,
}

/// What the rules decided for one I/O.
#[derive(Debug, Clone, Copy, Default)]
struct Verdict {
    fail: Option<i32>,
    delay: Duration,
    stall: bool,
}

/// What a completion still needs, kept in a slot while the I/O is in the inner device.
#[derive(Debug, Clone, Copy, Default)]
struct Ack {
    delay: Duration,
    /// Acknowledgements before a FLUSH was forwarded.
    flush_mark: u64,
    /// The I/O's undo entry.
    undo: Option<u64>,
    /// The crash epoch when forwarded: a completion of an older epoch fails.
    epoch: u64,
}

struct Slot {
    end: Option<Arc<dyn EndIo>>,
    cookie: u64,
    ack: Ack,
}

#[derive(Default)]
struct Slots {
    v: Vec<Slot>,
    free: Vec<u32>,
}

struct UndoEntry {
    id: u64,
    offset: u64,
    /// The old contents, in chunks of at most the inner device's max I/O.
    chunks: Vec<Buffer>,
    /// Acknowledgement number, once acknowledged.
    acked: Option<u64>,
}

#[derive(Default)]
struct State {
    crashed: bool,
    epoch: u64,
    /// I/Os forwarded to the inner device and not completed.
    in_flight: u64,
    /// Acknowledgements of entries so far.
    acks: u64,
    next_undo: u64,
    undo: Vec<UndoEntry>,
    crash_waiter: Option<Thread>,
}

struct Held {
    bio: Bio,
    end: Arc<dyn EndIo>,
    v: Verdict,
}

struct Delayed {
    due: Instant,
    n: u64,
    bio: Bio,
    res: Result<(), Error>,
    end: Arc<dyn EndIo>,
    ack: Ack,
}

#[derive(Default)]
struct TimerQ {
    items: Vec<Delayed>,
    n: u64,
    stop: bool,
    thread: Option<Thread>,
}

struct Shared {
    inner: Arc<dyn Device>,
    volatile: bool,
    rules: Mutex<Rules>,
    slots: Mutex<Slots>,
    state: Mutex<State>,
    stalled: Mutex<Vec<Held>>,
    /// An empty list with the stall list's capacity (see `release`).
    stalled_spare: Mutex<Vec<Held>>,
    timer: Mutex<TimerQ>,
    /// Held by `crash` from start to end, and by `restart`: a restart never ends a crash
    /// whose roll back is still running.
    crash_lock: Mutex<()>,
    counters: Counters,
}

fn errno_err(errno: i32) -> Error {
    Error::Io(std::io::Error::from_raw_os_error(errno))
}

fn bio_range(bio: &Bio) -> (u64, u64) {
    (
        bio.sector.saturating_mul(1 << SECTOR_SHIFT),
        u64::from(bio.len),
    )
}

fn modifies(op: Op) -> bool {
    matches!(op, Op::Write | Op::Discard | Op::WriteZeroes)
}

/// Waits for one I/O on the inner device (undo reads, roll back).
struct Waiter {
    done: Mutex<Option<(Bio, Result<(), Error>)>>,
    thread: Thread,
}

impl EndIo for Waiter {
    fn end_io(&self, bio: Bio, res: Result<(), Error>) {
        *self.done.lock() = Some((bio, res));
        self.thread.unpark();
    }
}

fn sync_io(dev: &dyn Device, bio: Bio) -> (Bio, Result<(), Error>) {
    let w = Arc::new(Waiter {
        done: Mutex::new(None),
        thread: thread::current(),
    });
    let end: Arc<dyn EndIo> = w.clone();
    dev.submit(bio, &end);
    loop {
        if let Some(r) = w.done.lock().take() {
            return r;
        }
        thread::park();
    }
}

impl Shared {
    fn evaluate(&self, bio: &Bio) -> Verdict {
        let (off, len) = bio_range(bio);
        let mut v = Verdict::default();
        let mut r = self.rules.lock();
        let seq = r.seq;
        r.seq += 1;
        let seed = r.seed;
        for st in &mut r.list {
            if !st.rule.matches(bio.op, off, len) {
                continue;
            }
            st.matched += 1;
            let n = st.matched;
            let fire = match st.rule.when {
                When::Always => true,
                When::Count { skip, count } => {
                    n > skip && !matches!(count, Some(c) if n - skip > c)
                }
                When::Prob(p) => {
                    // 53 random bits as a float in [0, 1).
                    let x = (draw(seed, st.id, seq, 0) >> 11) as f64 / (1u64 << 53) as f64;
                    x < p
                }
            };
            if !fire {
                continue;
            }
            match st.rule.action {
                Action::Fail { errno } => {
                    v.fail.get_or_insert(errno);
                }
                Action::Delay { base, jitter } => {
                    let j = u64::try_from(jitter.as_nanos()).unwrap_or(u64::MAX);
                    let extra = match j {
                        0 => 0,
                        u64::MAX => draw(seed, st.id, seq, 1),
                        j => draw(seed, st.id, seq, 1) % (j + 1),
                    };
                    v.delay = v
                        .delay
                        .saturating_add(base)
                        .saturating_add(Duration::from_nanos(extra));
                }
                Action::Stall => v.stall = true,
            }
        }
        v
    }

    /// Hands a completion to its submitter, after the crash-model bookkeeping.
    fn deliver(&self, bio: Bio, mut res: Result<(), Error>, end: &Arc<dyn EndIo>, ack: Ack) {
        if self.volatile {
            let mut st = self.state.lock();
            if st.crashed || ack.epoch != st.epoch {
                if res.is_ok() {
                    bump(&self.counters.crashed_io);
                    res = Err(errno_err(libc::EIO));
                }
            } else {
                if res.is_ok() {
                    if bio.op == Op::Flush {
                        let mark = ack.flush_mark;
                        st.undo.retain(|e| !matches!(e.acked, Some(a) if a <= mark));
                    } else if modifies(bio.op) && bio.flags.contains(BioFlags::FUA) {
                        patch_undo(&mut st.undo, &bio);
                    }
                }
                if let Some(id) = ack.undo {
                    st.acks += 1;
                    let n = st.acks;
                    if let Some(e) = st.undo.iter_mut().find(|e| e.id == id) {
                        e.acked = Some(n);
                    }
                }
            }
        }
        end.end_io(bio, res);
    }

    /// Delivers now, or after `ack.delay` on the timer thread.
    fn complete(self: &Arc<Self>, bio: Bio, res: Result<(), Error>, end: Arc<dyn EndIo>, ack: Ack) {
        if ack.delay.is_zero() {
            self.deliver(bio, res, &end, ack);
            return;
        }
        bump(&self.counters.delayed);
        // Absurd delays (a `Duration::MAX` rule) are clamped, never a panic.
        let now = Instant::now();
        let due = now
            .checked_add(ack.delay)
            .or_else(|| now.checked_add(Duration::from_secs(1 << 32)))
            .unwrap_or(now);
        let mut q = self.timer.lock();
        if q.stop {
            drop(q);
            self.deliver(bio, res, &end, ack);
            return;
        }
        let n = q.n;
        q.n += 1;
        q.items.push(Delayed {
            due,
            n,
            bio,
            res,
            end,
            ack,
        });
        match &q.thread {
            Some(t) => t.unpark(),
            None => {
                let sh = self.clone();
                let h = thread::spawn(move || sh.run_timer());
                q.thread = Some(h.thread().clone());
            }
        }
    }

    fn run_timer(&self) {
        loop {
            let next = {
                let mut q = self.timer.lock();
                let now = Instant::now();
                let min = q
                    .items
                    .iter()
                    .enumerate()
                    .min_by_key(|(_, d)| (d.due, d.n))
                    .map(|(i, d)| (i, d.due));
                match min {
                    None if q.stop => return,
                    None => None,
                    Some((i, due)) if due <= now || q.stop => Some(Ok(q.items.swap_remove(i))),
                    Some((_, due)) => Some(Err(due)),
                }
            };
            match next {
                None => thread::park(),
                Some(Ok(d)) => self.deliver(d.bio, d.res, &d.end, d.ack),
                Some(Err(due)) => {
                    blkq_sync::park_until(due);
                }
            }
        }
    }

    /// Fails (after its delay) or forwards an I/O the rules let through the stall stage.
    fn dispatch(
        self: &Arc<Self>,
        bio: Bio,
        end: &Arc<dyn EndIo>,
        v: Verdict,
        completer: &Arc<dyn EndIo>,
    ) {
        if let Some(bio) = self.prepare(bio, end, v) {
            self.inner.submit(bio, completer);
        }
    }

    /// Everything before forwarding: fails, undo read, slot. `None`: completed already.
    fn prepare(self: &Arc<Self>, mut bio: Bio, end: &Arc<dyn EndIo>, v: Verdict) -> Option<Bio> {
        let mut ack = Ack {
            delay: v.delay,
            ..Ack::default()
        };
        if let Some(errno) = v.fail {
            bump(&self.counters.failed[class_index(bio.op)]);
            self.complete(bio, Err(errno_err(errno)), end.clone(), ack);
            return None;
        }
        let undo = if self.volatile && modifies(bio.op) && !bio.flags.contains(BioFlags::FUA) {
            // A bio the inner device will refuse needs no undo read (and a huge bad one must
            // not make us read gigabytes): it fails with the inner device's own error.
            if let Err(e) = self.inner.limits().validate(&bio) {
                self.complete(bio, Err(e), end.clone(), ack);
                return None;
            }
            match self.read_old(&bio) {
                Ok(chunks) => Some(chunks),
                Err(e) => {
                    self.complete(bio, Err(e), end.clone(), ack);
                    return None;
                }
            }
        } else {
            None
        };
        {
            let mut st = self.state.lock();
            if st.crashed {
                drop(st);
                bump(&self.counters.crashed_io);
                self.complete(bio, Err(errno_err(libc::EIO)), end.clone(), Ack::default());
                return None;
            }
            ack.epoch = st.epoch;
            ack.flush_mark = st.acks;
            if let Some(chunks) = undo {
                let id = st.next_undo;
                st.next_undo += 1;
                st.undo.push(UndoEntry {
                    id,
                    offset: bio_range(&bio).0,
                    chunks,
                    acked: None,
                });
                ack.undo = Some(id);
            }
            st.in_flight += 1;
        }
        let mut slots = self.slots.lock();
        let slot = Slot {
            end: Some(end.clone()),
            cookie: bio.cookie,
            ack,
        };
        let idx = match slots.free.pop() {
            Some(i) => {
                slots.v[i as usize] = slot;
                i
            }
            None => {
                slots.v.push(slot);
                (slots.v.len() - 1) as u32
            }
        };
        bio.cookie = u64::from(idx);
        Some(bio)
    }

    /// Reads the current contents of a modifying bio's range from the inner device.
    fn read_old(&self, bio: &Bio) -> Result<Vec<Buffer>, Error> {
        let (off, len) = bio_range(bio);
        let max = u64::from(self.inner.limits().max_io_bytes.clamp(4096, 1 << 20));
        let lbs = u64::from(self.inner.limits().logical_block_size.max(512));
        let max = (max / lbs * lbs).max(lbs);
        let mut chunks = Vec::new();
        let mut pos = 0;
        while pos < len {
            let n = (len - pos).min(max);
            bump(&self.counters.undo_reads);
            let rd = Bio::with_buf(
                Op::Read,
                (off + pos) >> SECTOR_SHIFT,
                Buffer::new(n as usize),
            );
            let (rd, res) = sync_io(self.inner.as_ref(), rd);
            res?;
            chunks.push(rd.buf.ok_or(Error::NoBuffer)?);
            pos += n;
        }
        Ok(chunks)
    }

    /// A forwarded I/O came back from the inner device.
    fn on_inner_done(self: &Arc<Self>, mut bio: Bio, res: Result<(), Error>) {
        let taken = {
            let mut slots = self.slots.lock();
            let idx = bio.cookie;
            match slots.v.get_mut(idx as usize) {
                Some(s) if s.end.is_some() => {
                    let end = s.end.take();
                    bio.cookie = s.cookie;
                    let ack = s.ack;
                    slots.free.push(idx as u32);
                    end.map(|e| (e, ack))
                }
                _ => None,
            }
        };
        // A cookie that is not ours would be an inner device's bug; the bio cannot be routed.
        let Some((end, ack)) = taken else { return };
        {
            let mut st = self.state.lock();
            st.in_flight = st.in_flight.saturating_sub(1);
            if st.in_flight == 0 {
                if let Some(t) = &st.crash_waiter {
                    t.unpark();
                }
            }
        }
        self.complete(bio, res, end, ack);
    }
}

/// Patches the parts of undo entries that a durable (FUA) modifying bio overwrote.
fn patch_undo(undo: &mut [UndoEntry], bio: &Bio) {
    let (off, len) = bio_range(bio);
    let end = off.saturating_add(len);
    let data = match bio.op {
        Op::Write => bio.buf.as_ref().map(|b| b.as_slice()),
        _ => None,
    };
    for e in undo.iter_mut() {
        let mut c0 = e.offset;
        for c in &mut e.chunks {
            let c1 = c0 + c.len() as u64;
            let (s, t) = (c0.max(off), c1.min(end));
            if s < t {
                let dst = &mut c.as_mut_slice()[(s - c0) as usize..(t - c0) as usize];
                match data {
                    Some(d) if d.len() as u64 >= t - off => {
                        dst.copy_from_slice(&d[(s - off) as usize..(t - off) as usize]);
                    }
                    _ => dst.fill(0),
                }
            }
            c0 = c1;
        }
    }
}

/// The device's own completion handler, registered once.
struct Completer(Arc<Shared>);

impl EndIo for Completer {
    fn end_io(&self, bio: Bio, res: Result<(), Error>) {
        self.0.on_inner_done(bio, res);
    }
}

/// What a crash rolled back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CrashReport {
    /// Writes (and discards, write-zeroes) rolled back.
    pub writes_lost: u64,
    /// Bytes rewritten with their old contents.
    pub bytes_restored: u64,
    /// Stalled I/Os failed.
    pub stalled_failed: u64,
}

/// A handle to a fault device's rules, stall list, crash model and counters (cheap to clone;
/// keeps the device's state alive, not the device).
#[derive(Clone)]
pub struct FaultHandle {
    sh: Arc<Shared>,
    completer: Arc<dyn EndIo>,
}

impl fmt::Debug for FaultHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FaultHandle")
            .field("counters", &self.counters())
            .finish()
    }
}

impl FaultHandle {
    /// Adds a rule (after the others); returns its id.
    pub fn add(&self, rule: Rule) -> u64 {
        let mut r = self.sh.rules.lock();
        let id = r.next_id;
        r.next_id += 1;
        r.list.push(RuleState {
            id,
            rule,
            matched: 0,
        });
        id
    }

    /// Removes the rule `id`; returns whether it was there.
    pub fn remove(&self, id: u64) -> bool {
        let mut r = self.sh.rules.lock();
        let n = r.list.len();
        r.list.retain(|s| s.id != id);
        r.list.len() != n
    }

    /// Removes every rule (stalled I/Os stay stalled until [`release`](Self::release)).
    pub fn clear(&self) {
        self.sh.rules.lock().list.clear();
    }

    /// The rules now, in order.
    pub fn list(&self) -> Vec<Rule> {
        self.sh.rules.lock().list.iter().map(|s| s.rule).collect()
    }

    /// Sets the seed of probabilities and jitter.
    pub fn set_seed(&self, seed: u64) {
        self.sh.rules.lock().seed = seed;
    }

    /// I/Os stalled now.
    pub fn stalled(&self) -> usize {
        self.sh.stalled.lock().len()
    }

    /// Forwards every stalled I/O (in submission order), on this thread; returns how many.
    pub fn release(&self) -> usize {
        // The stall list and a spare of the same capacity swap places, so stalling and
        // releasing stay allocation-free after warm-up.
        let mut held = std::mem::take(&mut *self.sh.stalled_spare.lock());
        std::mem::swap(&mut *self.sh.stalled.lock(), &mut held);
        let n = held.len();
        for h in held.drain(..) {
            self.sh.dispatch(h.bio, &h.end, h.v, &self.completer);
        }
        *self.sh.stalled_spare.lock() = held;
        n
    }

    /// A snapshot of the counters.
    pub fn counters(&self) -> FaultCounters {
        let c = &self.sh.counters;
        let l = |x: &StatU64| x.load(Ordering::Relaxed);
        FaultCounters {
            seen: std::array::from_fn(|i| l(&c.seen[i])),
            failed: std::array::from_fn(|i| l(&c.failed[i])),
            delayed: l(&c.delayed),
            stalled: l(&c.stalled),
            crashed_io: l(&c.crashed_io),
            undo_reads: l(&c.undo_reads),
            crashes: l(&c.crashes),
            writes_lost: l(&c.writes_lost),
        }
    }

    /// Writes (and discards, write-zeroes) in the undo log: not yet durable, lost by a crash
    /// now. Always 0 without the volatile cache.
    pub fn unflushed_writes(&self) -> usize {
        self.sh.state.lock().undo.len()
    }

    /// Whether the device is crashed.
    pub fn is_crashed(&self) -> bool {
        self.sh.state.lock().crashed
    }

    /// Crashes the device: every write not yet durable is rolled back on the inner device
    /// (module docs, "The crash model"), and every I/O fails with `EIO` until
    /// [`restart`](Self::restart). Waits for the I/Os in flight in the inner device (an inner
    /// device that never completes them hangs it). Needs [`FaultConfig::volatile_cache`];
    /// crashing a crashed device does nothing. If a roll back write fails, the first error is
    /// returned after every other entry has been tried.
    pub fn crash(&self) -> Result<CrashReport, Error> {
        let sh = &self.sh;
        if !sh.volatile {
            return Err(Error::NotSupported(
                "crash needs a fault device with volatile_cache",
            ));
        }
        let _crashing = sh.crash_lock.lock();
        {
            let mut st = sh.state.lock();
            if st.crashed {
                return Ok(CrashReport::default());
            }
            st.crashed = true;
            st.epoch += 1;
            st.crash_waiter = Some(thread::current());
        }
        bump(&sh.counters.crashes);
        let mut report = CrashReport::default();
        let held = std::mem::take(&mut *sh.stalled.lock());
        for h in held {
            report.stalled_failed += 1;
            bump(&sh.counters.crashed_io);
            h.end.end_io(h.bio, Err(errno_err(libc::EIO)));
        }
        let undo = loop {
            {
                let mut st = sh.state.lock();
                if st.in_flight == 0 {
                    st.crash_waiter = None;
                    break std::mem::take(&mut st.undo);
                }
            }
            thread::park();
        };
        let mut first_err = None;
        for e in undo.into_iter().rev() {
            report.writes_lost += 1;
            bump(&sh.counters.writes_lost);
            let mut off = e.offset;
            for c in e.chunks {
                let n = c.len() as u64;
                let mut w = Bio::with_buf(Op::Write, off >> SECTOR_SHIFT, c);
                w.flags = BioFlags::FUA;
                let (_, res) = sync_io(sh.inner.as_ref(), w);
                match res {
                    Ok(()) => report.bytes_restored += n,
                    Err(err) => {
                        first_err.get_or_insert(err);
                    }
                }
                off += n;
            }
        }
        if let (_, Err(err)) = sync_io(sh.inner.as_ref(), Bio::new(Op::Flush, 0, 0)) {
            first_err.get_or_insert(err);
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(report),
        }
    }

    /// Ends a crash: I/O works again, against the rolled-back contents.
    pub fn restart(&self) {
        let _crashing = self.sh.crash_lock.lock();
        self.sh.state.lock().crashed = false;
    }
}

/// A device that injects faults into the I/O of another (module docs).
pub struct FaultDevice {
    handle: FaultHandle,
}

impl fmt::Debug for FaultDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FaultDevice")
            .field("handle", &self.handle)
            .finish()
    }
}

impl FaultDevice {
    /// Wraps `inner` with the faults of `cfg`.
    pub fn new(inner: Arc<dyn Device>, cfg: FaultConfig) -> Self {
        let sh = Arc::new(Shared {
            inner,
            volatile: cfg.volatile_cache,
            rules: Mutex::new(Rules {
                seed: cfg.seed,
                next_id: 0,
                seq: 0,
                list: Vec::with_capacity(cfg.rules.len().max(8)),
            }),
            slots: Mutex::new(Slots {
                v: Vec::with_capacity(256),
                free: Vec::with_capacity(256),
            }),
            state: Mutex::new(State::default()),
            stalled: Mutex::new(Vec::with_capacity(64)),
            stalled_spare: Mutex::new(Vec::with_capacity(64)),
            timer: Mutex::new(TimerQ {
                items: Vec::with_capacity(256),
                ..TimerQ::default()
            }),
            crash_lock: Mutex::new(()),
            counters: Counters::default(),
        });
        let completer: Arc<dyn EndIo> = Arc::new(Completer(sh.clone()));
        let handle = FaultHandle { sh, completer };
        for r in cfg.rules {
            handle.add(r);
        }
        Self { handle }
    }

    /// The handle: rules (`add`, `clear`), `release`, `crash`, `restart`, counters.
    pub fn handle(&self) -> FaultHandle {
        self.handle.clone()
    }

    /// The rules' handle (the same as [`handle`](Self::handle)).
    pub fn rules(&self) -> &FaultHandle {
        &self.handle
    }

    /// Admission: counts, crash check, rules, stall. `None`: taken care of.
    fn admit(&self, bio: Bio, end: &Arc<dyn EndIo>) -> Option<(Bio, Verdict)> {
        let sh = &self.handle.sh;
        bump(&sh.counters.seen[class_index(bio.op)]);
        if sh.volatile && sh.state.lock().crashed {
            bump(&sh.counters.crashed_io);
            end.end_io(bio, Err(errno_err(libc::EIO)));
            return None;
        }
        let v = sh.evaluate(&bio);
        if v.stall {
            bump(&sh.counters.stalled);
            sh.stalled.lock().push(Held {
                bio,
                end: end.clone(),
                v,
            });
            return None;
        }
        Some((bio, v))
    }
}

impl Drop for FaultDevice {
    fn drop(&mut self) {
        // Stalled I/Os must still complete exactly once.
        let held = std::mem::take(&mut *self.handle.sh.stalled.lock());
        for h in held {
            h.end.end_io(h.bio, Err(errno_err(libc::ECANCELED)));
        }
        // The timer thread delivers what it holds, then exits.
        let mut q = self.handle.sh.timer.lock();
        q.stop = true;
        if let Some(t) = &q.thread {
            t.unpark();
        }
    }
}

impl Device for FaultDevice {
    fn submit(&self, bio: Bio, end: &Arc<dyn EndIo>) {
        if let Some((bio, v)) = self.admit(bio, end) {
            self.handle.sh.dispatch(bio, end, v, &self.handle.completer);
        }
    }

    fn submit_batch(&self, bios: &mut dyn Iterator<Item = Bio>, end: &Arc<dyn EndIo>) {
        let sh = &self.handle.sh;
        if sh.volatile {
            // Undo reads must not pass writes of the same batch still plugged in the inner
            // device: one at a time.
            for b in bios {
                self.submit(b, end);
            }
            return;
        }
        let mut it = bios.filter_map(|b| {
            let (b, v) = self.admit(b, end)?;
            sh.prepare(b, end, v)
        });
        sh.inner.submit_batch(&mut it, &self.handle.completer);
    }

    fn limits(&self) -> Limits {
        self.handle.sh.inner.limits()
    }

    fn extents(&self, offset: u64, len: u64, max: usize) -> Result<Vec<Extent>, Error> {
        self.handle.sh.inner.extents(offset, len, max)
    }
}
