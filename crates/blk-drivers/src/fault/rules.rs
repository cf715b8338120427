//! The fault device's rules: what they match, when they fire and what they do, their parsing
//! from a spec string, and the deterministic PRNG behind probabilities and jitter. Run by the
//! submitters' threads (`evaluate`, under the rule lock) and by callers of the handle.

use std::fmt;
use std::time::Duration;

use blk::{Error, Op};

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
    /// Hold the I/O before it reaches the inner device until [`FaultHandle::release`](super::FaultHandle::release).
    Stall,
    /// Silently corrupt the data: flip one bit, and complete the I/O as the inner device did.
    /// A read flips it in the data handed back to the submitter (the inner device's copy
    /// stays intact); a write stores it flipped on the inner device, through a private copy
    /// of the payload (the submitter's buffer is never written). The byte is the first one of
    /// the rule's range in the I/O, or, without a range, a seeded choice among the I/O's
    /// bytes; the bit is a seeded choice. Only reads and writes match a flip rule (one
    /// without a buffer completes unchanged). When several flip rules fire on one I/O, the
    /// first one flips.
    Flip,
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

    /// Flips one bit in the data of every read or write of `ops` (silent corruption, see
    /// [`Action::Flip`]); the rule keeps only the reads and writes of `ops`: flushes,
    /// discards and write-zeroes never flip.
    pub fn flip(ops: OpSet) -> Self {
        Self {
            action: Action::Flip,
            ..Self::fail(OpSet(ops.0 & (OpSet::READ | OpSet::WRITE).0))
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
        if self.action == Action::Flip && !matches!(op, Op::Read | Op::Write) {
            return false;
        }
        match self.range {
            None => true,
            Some(_) if op == Op::Flush => false,
            Some((r0, rlen)) => offset < r0.saturating_add(rlen) && r0 < offset.saturating_add(len),
        }
    }
}

/// The configuration of a [`FaultDevice`](super::FaultDevice); [`FaultConfig::parse`] reads it from a spec string.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct FaultConfig {
    /// Seed of probabilities and jitter.
    pub seed: u64,
    /// Rules, in order (a `Fail` of an earlier rule wins, and so does a `Flip`; delays add up).
    pub rules: Vec<Rule>,
    /// Model a volatile write cache (undo log; every write costs a read) so that
    /// [`FaultHandle::crash`](super::FaultHandle::crash) works.
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

/// `OP` and the optional selector of a `fail_OP[_SEL]` or `flip_OP[_SEL]` key.
fn split_selector(rest: &str) -> (&str, Option<&str>) {
    match rest.split_once('_') {
        Some((c, k)) => (c, Some(k)),
        None => (rest, None),
    }
}

/// Refines `r` by the selector `kind` of option `key` with value `v`: none (`v` is a RANGE),
/// `nth`, `next`, `after` or `prob`.
fn select(key: &str, kind: Option<&str>, v: &str, r: Rule) -> Result<Rule, Error> {
    Ok(match kind {
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
            let p: f64 = v
                .trim()
                .parse()
                .map_err(|_| opt_err(key, format!("expected a probability, got {v:?}")))?;
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
    /// - `flip_OP=RANGE`, `flip_OP_nth=N`, `flip_OP_next=K`, `flip_OP_after=N`,
    ///   `flip_OP_prob=P` (OP `read`, `write` or `any`): flip one bit of the data, silently
    ///   ([`Action::Flip`]); with a RANGE, of its first byte in the I/O;
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
                        let (class, kind) = split_selector(rest);
                        let r = Rule::fail(parse_class(key, class)?);
                        cfg.rules.push(select(key, kind, v, r)?);
                    } else if let Some(rest) = key.strip_prefix("flip_") {
                        let (class, kind) = split_selector(rest);
                        let r = Rule::flip(parse_class(key, class)?);
                        if r.ops == OpSet::default() {
                            return Err(opt_err(
                                key,
                                "only reads and writes flip (read, write, any)",
                            ));
                        }
                        cfg.rules.push(select(key, kind, v, r)?);
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
pub(super) fn mix(mut z: u64) -> u64 {
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

pub(super) struct RuleState {
    pub(super) id: u64,
    pub(super) rule: Rule,
    pub(super) matched: u64,
}

pub(super) struct Rules {
    pub(super) seed: u64,
    pub(super) next_id: u64,
    /// I/Os seen, the `seq` of the next one.
    pub(super) seq: u64,
    pub(super) list: Vec<RuleState>,
}

/// One bit to flip in an I/O's data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Flip {
    /// The byte, from the I/O's start (below its length).
    pub(super) at: u32,
    /// The bit, as a mask of one bit.
    pub(super) mask: u8,
}

impl Flip {
    /// Flips the bit in `data` (the I/O's data, from its start); returns whether it was
    /// there to flip.
    pub(super) fn apply(self, data: &mut [u8]) -> bool {
        match data.get_mut(self.at as usize) {
            Some(b) => {
                *b ^= self.mask;
                true
            }
            None => false,
        }
    }
}

/// What the rules decided for one I/O.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Verdict {
    pub(super) fail: Option<i32>,
    pub(super) delay: Duration,
    pub(super) stall: bool,
    pub(super) flip: Option<Flip>,
}

impl Rules {
    /// The verdict for the next I/O: an `op` over `len` bytes at byte `off`.
    pub(super) fn evaluate(&mut self, op: Op, off: u64, len: u64) -> Verdict {
        let mut v = Verdict::default();
        let r = self;
        let seq = r.seq;
        r.seq += 1;
        let seed = r.seed;
        for st in &mut r.list {
            if !st.rule.matches(op, off, len) {
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
                // `matches` lets only reads and writes through, whose length is the data's.
                Action::Flip if v.flip.is_none() && len > 0 => {
                    let at = match st.rule.range {
                        // The first byte of the overlap (the rule matched, so it is one).
                        Some((r0, _)) => r0.saturating_sub(off),
                        None => draw(seed, st.id, seq, 2) % len,
                    };
                    v.flip = Some(Flip {
                        at: u32::try_from(at.min(len - 1)).unwrap_or(0),
                        mask: 1 << (draw(seed, st.id, seq, 3) % 8),
                    });
                }
                Action::Flip => {}
            }
        }
        v
    }
}
