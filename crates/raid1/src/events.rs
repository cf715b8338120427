//! The array's state changes, told as they happen (md's `mdadm --monitor` events, DRBD's
//! `events2`): each is logged once, naming the leg (its slot, and its name when the owner gave
//! one with [`Raid1::set_leg_name`](crate::Raid1::set_leg_name)), at WARN or ERROR when an operator must act and INFO
//! otherwise, and handed to every [`Subscription`] ([`Raid1::subscribe`](crate::Raid1::subscribe)).
//!
//! A subscription sees the events from the moment it was taken, in the order they were
//! emitted. Its queue is bounded ([`QUEUE_CAP`] entries): a subscriber that falls behind
//! loses the newest events, not memory, and is told so by an [`Event::Dropped`] in their
//! place (lossless, or says so). Emitting never blocks: it takes the subscription's lock
//! for a push and wakes the subscriber (called from completion contexts, raid1d and the
//! sync thread alike).

use std::collections::VecDeque;
use std::fmt;
use std::time::Instant;

use blkq_sync::atomic::{AtomicU64, Ordering};
use blkq_sync::{Arc, Mutex};
use waitq::WaitQueue;

mod array;

use crate::resync::SyncAction;

/// Entries a subscription holds before it drops events (the marker included).
pub const QUEUE_CAP: usize = 256;

/// One state change of the array.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Event {
    /// A leg failed: it is neither read nor written until removed or re-added.
    LegFailed {
        /// Its slot.
        slot: usize,
        /// Why (an I/O error, too many read errors, the operator, ...).
        cause: &'static str,
    },
    /// A leg was taken out of its slot.
    LegRemoved {
        /// Its slot.
        slot: usize,
    },
    /// A leg was put into a slot (recovery copies to it).
    LegAdded {
        /// Its slot.
        slot: usize,
        /// A former leg of the slot taken back (only what it missed is copied).
        readd: bool,
    },
    /// A returning leg was refused: it stays faulty and untouched.
    ReaddRefused {
        /// Its slot.
        slot: usize,
        /// Why (its superblock tells another history).
        why: String,
    },
    /// A resync, recovery, check or repair pass started.
    SyncStarted {
        /// What runs.
        action: SyncAction,
        /// The leg recovered (a recovery).
        slot: Option<usize>,
    },
    /// A resync, recovery, check or repair passed another tenth of the array.
    SyncProgress {
        /// What runs.
        action: SyncAction,
        /// The leg recovered.
        slot: Option<usize>,
        /// Done, percent (10, 20, ... 90).
        percent: u8,
    },
    /// A pass ended.
    SyncFinished {
        /// What ran.
        action: SyncAction,
        /// The leg recovered (a recovery).
        slot: Option<usize>,
        /// `done`, `interrupted` or `failed`.
        end: &'static str,
        /// A check or repair: the mismatching sectors found (md's `mismatch_cnt`).
        mismatches: Option<u64>,
    },
    /// A leg in sync left the array's history: a new generation started.
    GenerationChanged {
        /// The new generation.
        generation: u64,
        /// The one before.
        previous: u64,
        /// The slots in sync now (a bit each).
        in_sync: u64,
    },
    /// Blocks read from a leg did not match their checksums (see `integrity`).
    Corrupt {
        /// The leg.
        slot: usize,
        /// Array byte offset of the first bad block.
        offset: u64,
        /// Bad blocks found in this read or pass window.
        blocks: u64,
        /// Rewritten from a leg that matched (false: no leg did; the read failed).
        healed: bool,
    },
    /// The array failed: every write and flush fails until it is stopped.
    ArrayFailed {
        /// Why.
        why: &'static str,
    },
    /// This subscription fell behind and lost this many events here.
    Dropped {
        /// How many.
        count: u64,
    },
}

impl Event {
    /// A short name (`leg_failed`, `recovery_finished`, ...): what a monitor's program is told.
    pub fn name(&self) -> &'static str {
        let sync = |a: &SyncAction, recovery: &'static str, resync: &'static str, other| match a {
            SyncAction::Recover => recovery,
            SyncAction::Resync => resync,
            _ => other,
        };
        match self {
            Event::LegFailed { .. } => "leg_failed",
            Event::LegRemoved { .. } => "leg_removed",
            Event::LegAdded { .. } => "leg_added",
            Event::ReaddRefused { .. } => "readd_refused",
            Event::SyncStarted { action, .. } => sync(
                action,
                "recovery_started",
                "resync_started",
                "check_started",
            ),
            Event::SyncProgress { action, .. } => sync(
                action,
                "recovery_progress",
                "resync_progress",
                "check_progress",
            ),
            Event::SyncFinished { action, .. } => sync(
                action,
                "recovery_finished",
                "resync_finished",
                "check_finished",
            ),
            Event::GenerationChanged { .. } => "generation_changed",
            Event::Corrupt { .. } => "corrupt_block",
            Event::ArrayFailed { .. } => "array_failed",
            Event::Dropped { .. } => "dropped",
        }
    }

    /// The slot it is about, if one.
    pub fn slot(&self) -> Option<usize> {
        match self {
            Event::LegFailed { slot, .. }
            | Event::LegRemoved { slot }
            | Event::LegAdded { slot, .. }
            | Event::ReaddRefused { slot, .. }
            | Event::Corrupt { slot, .. } => Some(*slot),
            Event::SyncStarted { slot, .. }
            | Event::SyncProgress { slot, .. }
            | Event::SyncFinished { slot, .. } => *slot,
            _ => None,
        }
    }

    /// Whether an operator must act (logged at WARN, or ERROR for the array).
    pub fn needs_action(&self) -> bool {
        matches!(
            self,
            Event::LegFailed { .. }
                | Event::ReaddRefused { .. }
                | Event::ArrayFailed { .. }
                | Event::Dropped { .. }
                | Event::Corrupt { .. }
        ) || matches!(self, Event::SyncFinished { end: "failed", .. })
            || matches!(self, Event::SyncFinished { mismatches: Some(n), .. } if *n > 0)
    }
}

impl fmt::Display for Event {
    /// What happened, in words (the leg by its slot; [`Record`] adds its name).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let what = |a: &SyncAction| match a {
            SyncAction::Recover => "recovery",
            SyncAction::Resync => "resync",
            a => a.as_str(),
        };
        let of = |s: &Option<usize>| s.map(|s| format!(" of slot {s}")).unwrap_or_default();
        match self {
            Event::LegFailed { slot, cause } => write!(f, "leg in slot {slot} failed: {cause}"),
            Event::LegRemoved { slot } => write!(f, "leg in slot {slot} removed"),
            Event::LegAdded { slot, readd } => write!(
                f,
                "leg {} slot {slot}: recovering",
                if *readd {
                    "re-added into"
                } else {
                    "added into"
                }
            ),
            Event::ReaddRefused { slot, why } => {
                write!(f, "leg in slot {slot} refused on its return: {why}")
            }
            Event::SyncStarted { action, slot } => {
                write!(f, "{}{} started", what(action), of(slot))
            }
            Event::SyncProgress {
                action,
                slot,
                percent,
            } => write!(f, "{}{} at {percent}%", what(action), of(slot)),
            Event::SyncFinished {
                action,
                slot,
                end,
                mismatches,
            } => {
                write!(f, "{}{} {end}", what(action), of(slot))?;
                match mismatches {
                    Some(n) => write!(f, ": mismatch_cnt = {n}"),
                    None => Ok(()),
                }
            }
            Event::GenerationChanged {
                generation,
                previous,
                in_sync,
            } => write!(
                f,
                "new generation {generation:016x} after {previous:016x}: slots {in_sync:#b} in sync"
            ),
            Event::Corrupt {
                slot,
                offset,
                blocks,
                healed,
            } => write!(
                f,
                "leg in slot {slot}: {blocks} block(s) from array offset {offset} did not match \
                 their checksums; {}",
                if *healed {
                    "rewritten from a leg that matched"
                } else {
                    "no leg matched: the read failed with EIO"
                }
            ),
            Event::ArrayFailed { why } => {
                write!(f, "array failed: {why}; writes and flushes now fail")
            }
            Event::Dropped { count } => {
                write!(f, "{count} events dropped: the subscriber fell behind")
            }
        }
    }
}

/// An event as a subscriber gets it: with the leg's name and a sequence number.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// The array's count of events emitted, from 1 (a gap is what [`Event::Dropped`] says;
    /// the marker itself has 0).
    pub seq: u64,
    /// What happened.
    pub event: Event,
    /// The name of the leg it is about, when known ([`Raid1::set_leg_name`](crate::Raid1::set_leg_name)).
    pub leg: Option<String>,
}

impl fmt::Display for Record {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.event)?;
        match &self.leg {
            Some(l) => write!(f, " ({l})"),
            None => Ok(()),
        }
    }
}

/// One subscriber's queue.
struct Queue {
    state: Mutex<QueueState>,
    wq: WaitQueue,
}

struct QueueState {
    items: VecDeque<Record>,
    /// Events lost since the last entry queued (told by a marker before the next one).
    dropped: u64,
    /// The subscription was dropped: the hub forgets the queue.
    closed: bool,
    cap: usize,
}

impl QueueState {
    /// Queues `r`, or counts it dropped. At most `cap` entries: a marker goes in before the
    /// first event after a loss, so the order says where events were lost.
    fn push(&mut self, r: &Record) {
        if self.dropped > 0 {
            if self.items.len() + 2 > self.cap {
                self.dropped += 1;
                return;
            }
            let count = std::mem::take(&mut self.dropped);
            self.items.push_back(Record {
                seq: 0,
                event: Event::Dropped { count },
                leg: None,
            });
        } else if self.items.len() >= self.cap {
            self.dropped = 1;
            return;
        }
        self.items.push_back(r.clone());
    }

    fn pop(&mut self) -> Option<Record> {
        self.items.pop_front().or_else(|| {
            (self.dropped > 0).then(|| Record {
                seq: 0,
                event: Event::Dropped {
                    count: std::mem::take(&mut self.dropped),
                },
                leg: None,
            })
        })
    }
}

/// The subscriptions of one array, and the leg names.
pub(crate) struct Hub {
    subs: Mutex<Vec<Arc<Queue>>>,
    names: Mutex<Vec<Option<String>>>,
    seq: AtomicU64,
}

impl Hub {
    pub(crate) fn new(slots: usize) -> Self {
        Self {
            subs: Mutex::new(Vec::new()),
            names: Mutex::new(vec![None; slots]),
            seq: AtomicU64::new(0),
        }
    }

    fn subscribe(&self, cap: usize) -> Subscription {
        let q = Arc::new(Queue {
            state: Mutex::new(QueueState {
                items: VecDeque::new(),
                dropped: 0,
                closed: false,
                cap: cap.max(2),
            }),
            wq: WaitQueue::new(),
        });
        let mut subs = self.subs.lock();
        subs.retain(|q| !q.state.lock().closed);
        subs.push(q.clone());
        Subscription { q }
    }

    /// Logs `e` and hands it to every subscription.
    pub(crate) fn emit(&self, e: Event) {
        let leg = e
            .slot()
            .and_then(|s| self.names.lock().get(s).cloned().flatten());
        let seq = self.seq.fetch_add(1, Ordering::Relaxed) + 1;
        let r = Record { seq, event: e, leg };
        match &r.event {
            Event::ArrayFailed { .. } => tracing::error!(event = r.event.name(), "raid1: {r}"),
            e if e.needs_action() => tracing::warn!(event = e.name(), "raid1: {r}"),
            e => tracing::info!(event = e.name(), "raid1: {r}"),
        }
        let mut subs = self.subs.lock();
        subs.retain(|q| {
            let mut st = q.state.lock();
            if st.closed {
                return false;
            }
            st.push(&r);
            drop(st);
            q.wq.wake_all();
            true
        });
    }
}

/// The events of one array from the moment of [`Raid1::subscribe`](crate::Raid1::subscribe). Bounded: see the module
/// docs. Dropping it ends the subscription.
pub struct Subscription {
    q: Arc<Queue>,
}

impl Subscription {
    /// The next event, waiting for it until `deadline`; `None` if none came by then.
    pub fn next_until(&self, deadline: Instant) -> Option<Record> {
        self.q
            .wq
            .wait_for_until(|| self.q.state.lock().pop(), deadline)
    }

    /// The next event if one is queued.
    pub fn try_next(&self) -> Option<Record> {
        self.q.state.lock().pop()
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        self.q.state.lock().closed = true;
    }
}

#[cfg(all(test, not(blkq_loom)))]
mod tests {
    use super::*;
    use std::time::Duration;

    fn failed(slot: usize) -> Event {
        Event::LegFailed {
            slot,
            cause: "a write failed",
        }
    }

    /// Events come in the order emitted, from the subscription on, with the leg's name; a
    /// subscriber that falls behind keeps at most the bound and is told how many it lost,
    /// where it lost them; a dropped subscription is forgotten.
    #[test]
    fn a_subscription_is_ordered_bounded_and_says_what_it_dropped() {
        let hub = Hub::new(4);
        hub.emit(failed(0)); // before the subscription: not seen
        *hub.names.lock().get_mut(1).unwrap() = Some("file:/b.img".into());
        let s = hub.subscribe(4);
        let soon = || Instant::now() + Duration::from_millis(100);
        hub.emit(failed(1));
        hub.emit(Event::LegRemoved { slot: 1 });
        let r = s.next_until(soon()).unwrap();
        assert_eq!(r.event, failed(1));
        assert_eq!(r.leg.as_deref(), Some("file:/b.img"));
        assert_eq!(r.seq, 2);
        assert!(r.to_string().contains("slot 1") && r.to_string().contains("b.img"));
        assert_eq!(s.try_next().unwrap().event, Event::LegRemoved { slot: 1 });
        assert!(s.next_until(soon()).is_none(), "nothing more");
        // Ten events into a queue of four: four kept, then the marker for the other six.
        for slot in 0..10 {
            hub.emit(Event::LegAdded { slot, readd: false });
        }
        let got: Vec<Event> = std::iter::from_fn(|| s.try_next())
            .map(|r| r.event)
            .collect();
        let added = |slot| Event::LegAdded { slot, readd: false };
        assert_eq!(
            got,
            vec![
                added(0),
                added(1),
                added(2),
                added(3),
                Event::Dropped { count: 6 }
            ]
        );
        // Lost while behind, then room again: the marker comes before the later events.
        for slot in 0..6 {
            hub.emit(added(slot));
        }
        assert_eq!(s.try_next().unwrap().event, added(0));
        assert_eq!(s.try_next().unwrap().event, added(1));
        hub.emit(added(7));
        let got: Vec<Event> = std::iter::from_fn(|| s.try_next())
            .map(|r| r.event)
            .collect();
        assert_eq!(
            got,
            vec![added(2), added(3), Event::Dropped { count: 2 }, added(7)]
        );
        // A waiting subscriber is woken by the next event.
        let hub = Arc::new(hub);
        let h = hub.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            h.emit(failed(2));
        });
        let r = s.next_until(Instant::now() + Duration::from_secs(10));
        assert_eq!(r.map(|r| r.event), Some(failed(2)));
        t.join().unwrap();
        drop(s);
        hub.emit(failed(3));
        assert!(
            hub.subs.lock().is_empty(),
            "a dropped subscription is forgotten"
        );
    }
}
