//! `fault`: a fault-injection device; this file owns the device itself (admission, stall list,
//! slot table, forwarding) and its handle, run by the submitters' threads and the inner
//! device's completion threads.
//!
//! A [`FaultDevice`] wraps any other [`Device`] and is
//! itself a bio-based `Device`, a [`blk::Filter`] over it: it sees every bio on `submit`/`submit_batch`, decides what to
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
//! - **flip** a bit of a read's or a write's data, silently: the I/O succeeds, a read hands
//!   back data that differs from what is stored in that bit, a write stores data that
//!   differs from the submitter's in it (through a copy: the submitter's buffer is never
//!   written). The byte is the first of the rule's range in the I/O (aim with
//!   `in_range(X, 1)`), or a seeded choice without a range; the bit is seeded
//!   ([`Rule::flip`], "Silent corruption" below).
//! - **crash** ([`FaultHandle::crash`]): with [`FaultConfig::volatile_cache`] on, the device
//!   models a volatile write cache and a crash rolls the inner device back so that every write
//!   not made durable (by a completed FLUSH, or FUA) is lost; see "The crash model".
//! - counters of what it saw and did ([`FaultHandle::counters`]).
//!
//! ```
//! use blkq_sync::DynArc as Arc;
//! use blk_drivers::fault::{FaultConfig, FaultDevice, OpSet, Rule};
//! use blk_drivers::spec::{DeviceSpec, QueueOverrides};
//! use blk::Device;
//! let inner = "mem:4M".parse::<DeviceSpec>().unwrap().build_device(&QueueOverrides::default()).unwrap();
//! let cfg: FaultConfig = "seed=7,fail_write=0+1M,volatile_cache=on".parse().unwrap();
//! let dev = FaultDevice::new(inner, cfg);
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
//! # Silent corruption
//!
//! A flip rule's verdict names one byte and one bit of the I/O. A read is forwarded as it
//! is; when the inner device completes it successfully, the bit is flipped in the bio's
//! buffer before the completion goes on. A write's buffer may be shared (a mirror lends one
//! payload to every leg, [`blk::Buffer::alias`]), so it is never written: the write is
//! forwarded with a private copy of the payload, bit flipped, and the submitter's buffer
//! waits in the I/O's slot until the completion puts it back in the bio. That copy is the
//! only allocation, and only for a write a flip rule fired on. With the volatile cache a
//! flipped write is like any other (its undo entry holds the old contents; a crash rolls it
//! back), and a FUA one patches older undo entries with the data it stored, bit flipped.
//! [`FaultCounters::flipped`] counts the flipped I/Os that the inner device completed
//! successfully.
//!
//! # Completions without allocation
//!
//! The device registers one `EndIo` of its own (`Completer`) when it is built, and passes it to
//! the inner device for every forwarded bio. The submitter's `Arc<dyn EndIo>` (one `Arc`
//! clone per I/O, as every `Device` does), the submitter's `cookie` and what the completion
//! still needs (its delay, its flush mark, its undo entry) are kept in a slot of a slot
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
//!   to the last durable content;
//! - [`FaultHandle::crash_partial`] lets a seeded part of them through, as a real cache that
//!   wrote some back before the power went: some writes whole, some torn (a seeded half of
//!   their atomic units), the rest rolled back, never over what a newer surviving write put
//!   there. Several devices crashed with different seeds (the legs of a mirror) then
//!   disagree where their unflushed writes did.
//!
//! Overlapping writes in flight at the same time have no defined order (as on a real disk);
//! the model is exact when each write's overlapping predecessors completed before it was
//! submitted. Writes the inner device failed keep their entry (their outcome is undefined, and
//! the roll back restores the old data). A discard is modelled as zeroing for FUA patches.
//!
//! # Waiting
//!
//! Nothing here parks a thread by hand: every wait goes through the `waitq` crate. The timer
//! thread sleeps on its [`waitq::WaitQueue`] (`Timer::wq`) until its earliest deadline or a new
//! delayed completion; a crash waits on `idle_wq` for the I/Os in flight to drain; a
//! synchronous I/O of the crash model (undo read, roll back write) waits on a wait queue of its
//! own. Wakers always wake after dropping the lock that guards the condition.
//!
//! # Drop
//!
//! Dropping the device releases everything it holds before the drop returns, so that what it
//! wraps can be opened again at once (a `file:` device's lock: a RAID leg is opened, formatted,
//! dropped and reopened): stalled I/Os fail with `ECANCELED`, completions are delivered at
//! once from then on, the timer thread delivers what it holds and is joined, and both
//! references to the inner device (the device's and the handles') are dropped. The drop
//! therefore waits for the delayed completions' end-ios to return; one must not wait for the
//! thread that drops the device. When the drop runs on the timer thread itself (a completion
//! it delivered dropped the last reference), it cannot join it: the thread then exits as soon
//! as that completion returns, holding nothing of the inner device meanwhile.
//!
//! # Files
//!
//! - this file: the device (admission, stall list, slot table, forwarding) and its handle;
//! - `rules.rs`: rules, their parsing and matching, the PRNG;
//! - `cache.rs`: the volatile-cache undo log and the crash;
//! - `timer.rs`: the timer thread that delivers delayed completions.

mod cache;
mod rules;
mod timer;

pub use cache::{CrashReport, Partial};
pub use rules::{parse_errno, Action, FaultConfig, OpSet, Rule, When};

use blkq_sync::DynArc as Arc;
use std::fmt;
use std::time::{Duration, Instant};

use blkq_sync::stat::{Ordering, StatU64};
use blkq_sync::{thread, Mutex};
use waitq::WaitQueue;

use cache::{State, UndoEntry};
use rules::{Flip, RuleState, Rules, Verdict};
use timer::Timer;

use blk::{Bio, BioFlags, Buffer, Caps, Device, EndIo, Error, Filter, Op, SECTOR_SHIFT};

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
    /// I/Os with a bit flipped by a rule that the inner device completed successfully (reads:
    /// flipped in the data returned; writes: in the data stored), by class (only reads and
    /// writes flip).
    pub flipped: [u64; 4],
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
    flipped: [StatU64; 4],
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
    /// The bit a flip rule flips: in a read's data at completion, or, for a write, the one
    /// flipped in the copy forwarded (`None` when there was no data to flip).
    flip: Option<Flip>,
}

struct Slot {
    end: Option<Arc<dyn EndIo>>,
    cookie: u64,
    ack: Ack,
    /// A flipped write's own buffer, while the inner device has the flipped copy.
    orig: Option<Buffer>,
}

#[derive(Default)]
struct Slots {
    v: Vec<Slot>,
    free: Vec<u32>,
}

/// A completion the timer thread delivers once its delay has passed.
struct Late {
    bio: Bio,
    res: Result<(), Error>,
    end: Arc<dyn EndIo>,
    ack: Ack,
}

struct Held {
    bio: Bio,
    end: Arc<dyn EndIo>,
    v: Verdict,
}

struct Shared {
    /// The inner device, for the handles' `release` and `crash` (the device submits through
    /// its own reference, without this lock). Taken by the device's drop: a handle that
    /// outlives the device keeps its rules and counters, not the inner device.
    inner: Mutex<Option<Arc<dyn Device>>>,
    volatile: bool,
    rules: Mutex<Rules>,
    slots: Mutex<Slots>,
    state: Mutex<State>,
    stalled: Mutex<Vec<Held>>,
    /// An empty list with the stall list's capacity (see `release`).
    stalled_spare: Mutex<Vec<Held>>,
    /// Delayed completions and the timer thread that delivers them (`timer`'s docs).
    timer: Timer<Late>,
    /// Held by `crash` from start to end, and by `restart`: a restart never ends a crash
    /// whose roll back is still running.
    crash_lock: Mutex<()>,
    /// A crash waits here for `State::in_flight` to reach 0; woken by `on_inner_done` when the
    /// last forwarded I/O comes back.
    idle_wq: WaitQueue,
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

/// A copy of a write's payload with `f`'s bit flipped; `None` when it has no byte there.
fn flipped_copy(bio: &Bio, f: Flip) -> Option<Buffer> {
    let src = bio.buf.as_ref()?;
    if f.at as usize >= src.len() {
        return None;
    }
    let mut copy = Buffer::new(src.len());
    copy.as_mut_slice().copy_from_slice(src.as_slice());
    f.apply(copy.as_mut_slice()).then_some(copy)
}

impl Shared {
    /// Fails (after its delay) or forwards to `inner` an I/O the rules let through the stall
    /// stage.
    fn dispatch(
        self: &Arc<Self>,
        inner: &dyn Device,
        bio: Bio,
        end: &Arc<dyn EndIo>,
        v: Verdict,
        completer: &Arc<dyn EndIo>,
    ) {
        if let Some(bio) = self.prepare(inner, bio, end, v) {
            inner.submit(bio, completer);
        }
    }

    /// Everything before forwarding to `inner`: fails, undo read, slot. `None`: completed
    /// already.
    fn prepare(
        self: &Arc<Self>,
        inner: &dyn Device,
        mut bio: Bio,
        end: &Arc<dyn EndIo>,
        v: Verdict,
    ) -> Option<Bio> {
        let mut ack = Ack {
            delay: v.delay,
            flip: v.flip,
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
            if let Err(e) = inner.limits().validate(&bio) {
                self.complete(bio, Err(e), end.clone(), ack);
                return None;
            }
            match self.read_old(inner, &bio) {
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
        // A flipped write forwards a copy and keeps the submitter's buffer in its slot.
        let mut orig = None;
        if let Some(f) = ack.flip.filter(|_| bio.op == Op::Write) {
            match flipped_copy(&bio, f) {
                Some(copy) => orig = bio.buf.replace(copy),
                None => ack.flip = None,
            }
        }
        let mut slots = self.slots.lock();
        let slot = Slot {
            end: Some(end.clone()),
            cookie: bio.cookie,
            ack,
            orig,
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
                    let orig = s.orig.take();
                    slots.free.push(idx as u32);
                    end.map(|e| (e, ack, orig))
                }
                _ => None,
            }
        };
        // A cookie that is not ours would be an inner device's bug; the bio cannot be routed.
        let Some((end, mut ack, orig)) = taken else {
            return;
        };
        if let Some(f) = ack.flip {
            // A write forwarded the flipped copy; a read that succeeded flips its data now.
            let flipped = orig.is_some()
                || (bio.op == Op::Read
                    && res.is_ok()
                    && bio.buf.as_mut().is_some_and(|b| f.apply(b.as_mut_slice())));
            if flipped && res.is_ok() {
                bump(&self.counters.flipped[class_index(bio.op)]);
            } else if !flipped {
                ack.flip = None;
            }
        }
        if let Some(o) = orig {
            // The submitter's own buffer back; the flipped copy goes.
            bio.buf = Some(o);
        }
        let idle = {
            let mut st = self.state.lock();
            st.in_flight = st.in_flight.saturating_sub(1);
            st.in_flight == 0
        };
        if idle {
            // Outside the state lock; with nobody waiting this is a fence and a load.
            self.idle_wq.wake_all();
        }
        self.complete(bio, res, end, ack);
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
        let late = Late { bio, res, end, ack };
        let spawn = || {
            let sh = self.clone();
            thread::spawn(move || sh.timer.run(|l| sh.deliver(l.bio, l.res, &l.end, l.ack)))
        };
        if let Err(l) = self.timer.push(due, late, spawn) {
            // The device is being dropped: delivered at once.
            self.deliver(l.bio, l.res, &l.end, l.ack);
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

/// A handle to a fault device's rules, stall list, crash model and counters (cheap to clone;
/// keeps the device's state alive, not the device, nor the device under it: once the device
/// is dropped, [`release`](Self::release) has nothing to forward and
/// [`crash`](FaultHandle::crash) fails with `ENODEV`).
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
        let inner = self.sh.inner.lock().clone();
        // The stall list and a spare of the same capacity swap places, so stalling and
        // releasing stay allocation-free after warm-up.
        let mut held = std::mem::take(&mut *self.sh.stalled_spare.lock());
        std::mem::swap(&mut *self.sh.stalled.lock(), &mut held);
        let n = held.len();
        for h in held.drain(..) {
            match &inner {
                Some(inner) => self
                    .sh
                    .dispatch(&**inner, h.bio, &h.end, h.v, &self.completer),
                // The device was dropped (which failed what was stalled then): nothing to
                // forward to.
                None => h.end.end_io(h.bio, Err(errno_err(libc::ECANCELED))),
            }
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
            flipped: std::array::from_fn(|i| l(&c.flipped[i])),
            crashed_io: l(&c.crashed_io),
            undo_reads: l(&c.undo_reads),
            crashes: l(&c.crashes),
            writes_lost: l(&c.writes_lost),
        }
    }
}

/// A device that injects faults into the I/O of another (module docs).
pub struct FaultDevice {
    handle: FaultHandle,
    /// The inner device, as the submitters reach it (`Shared::inner` is the handles').
    inner: Arc<dyn Device>,
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
            inner: Mutex::new(Some(inner.clone())),
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
            timer: Timer::with_capacity(256),
            crash_lock: Mutex::new(()),
            idle_wq: WaitQueue::new(),
            counters: Counters::default(),
        });
        let completer: Arc<dyn EndIo> = Arc::new(Completer(sh.clone()));
        let handle = FaultHandle { sh, completer };
        for r in cfg.rules {
            handle.add(r);
        }
        Self { handle, inner }
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
        let (off, len) = bio_range(&bio);
        let v = sh.rules.lock().evaluate(bio.op, off, len);
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
    /// Releases everything the device holds before it returns (module docs, "Drop"): a
    /// `file:` device under it has closed its file, and given up its lock, by then.
    fn drop(&mut self) {
        let sh = &self.handle.sh;
        // Stalled I/Os must still complete exactly once.
        let held = std::mem::take(&mut *sh.stalled.lock());
        for h in held {
            h.end.end_io(h.bio, Err(errno_err(libc::ECANCELED)));
        }
        // From here on completions are delivered at once; the timer thread delivers what it
        // holds, then exits.
        let timer = sh.timer.stop();
        // The handles' reference to the inner device; ours goes with the field, after this.
        drop(sh.inner.lock().take());
        if let Some(t) = timer {
            timer::join(t);
        }
    }
}

/// Only the bio path is the fault device's; the rest is the inner device's ([`Filter`]'s
/// defaults: limits, extents, counters (what reached the inner device: injected failures
/// count there only if it saw them), a reconnecting device's checks).
impl Filter for FaultDevice {
    fn lower(&self) -> &dyn Device {
        &*self.inner
    }

    fn submit(&self, bio: Bio, end: &Arc<dyn EndIo>) {
        if let Some((bio, v)) = self.admit(bio, end) {
            self.handle
                .sh
                .dispatch(&*self.inner, bio, end, v, &self.handle.completer);
        }
    }

    fn submit_batch(&self, bios: &mut dyn Iterator<Item = Bio>, end: &Arc<dyn EndIo>) {
        let sh = &self.handle.sh;
        if sh.volatile {
            // Undo reads must not pass writes of the same batch still plugged in the inner
            // device: one at a time.
            for b in bios {
                Filter::submit(self, b, end);
            }
            return;
        }
        let mut it = bios.filter_map(|b| {
            let (b, v) = self.admit(b, end)?;
            sh.prepare(&*self.inner, b, end, v)
        });
        self.inner.submit_batch(&mut it, &self.handle.completer);
    }

    /// The inner device's, less the zero-copy paths: they carry no bio, so they would pass
    /// the rules by.
    fn caps(&self) -> Caps {
        self.inner.caps().bios_only()
    }
}
