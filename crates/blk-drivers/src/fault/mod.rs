//! `fault`: a fault-injection device; this file owns the device itself (admission, the stall
//! list, the completion handler it gives the inner device), run by the submitters' threads
//! and the inner device's completion threads.
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
//! - this file: the device (admission, stall list, its completion handler, drop);
//! - `shared.rs`: the state the device's threads and handles share, and a forwarded I/O's slot;
//! - `forward.rs`: forwarding to the inner device (slot table, undo read, flipped copy) and the
//!   completion on the way back;
//! - `handle.rs`: the handle (rules, release, counters);
//! - `rules.rs`: rules, their parsing and matching, the PRNG;
//! - `undo.rs`: the crash model's state, the undo log;
//! - `cache.rs`: the volatile cache's bookkeeping at each acknowledgement, and the crash;
//! - `timer.rs`: the timer thread that delivers delayed completions.

mod cache;
mod forward;
mod handle;
mod rules;
mod shared;
mod timer;
mod undo;

pub use cache::{CrashReport, Partial};
pub use handle::{FaultCounters, FaultHandle};
pub use rules::{parse_errno, Action, FaultConfig, OpSet, Rule, When};

use blkq_sync::DynArc as Arc;
use std::fmt;

use blkq_sync::Mutex;
use waitq::WaitQueue;

use rules::{Rules, Verdict};
use shared::{bio_range, bump, class_index, errno_err, Counters, FaultState, Held, Slots};
use timer::Timer;
use undo::State;

use blk::{Bio, Caps, Device, EndIo, Error, Filter};

/// The device's own completion handler, registered once.
struct Completer(Arc<FaultState>);

impl EndIo for Completer {
    fn end_io(&self, bio: Bio, res: Result<(), Error>) {
        self.0.on_inner_done(bio, res);
    }
}

/// A device that injects faults into the I/O of another (module docs).
pub struct FaultDevice {
    handle: FaultHandle,
    /// The inner device, as the submitters reach it (`FaultState::inner` is the handles').
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
        let sh = Arc::new(FaultState {
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
