//! The array's side of its events: `Array::emit` and the [`Raid1`] methods that subscribe
//! and name legs (see `events.rs` for the hub they act on).

use super::{Event, Subscription, QUEUE_CAP};
use crate::device::{Array, Raid1};

impl Array {
    /// Logs `e` and tells the subscribers (see the module docs of `events`).
    pub(crate) fn emit(&self, e: Event) {
        self.events.emit(e);
    }
}

impl Raid1 {
    /// The array's events from now on, at most [`QUEUE_CAP`] queued (see the module docs of
    /// `events`).
    pub fn subscribe(&self) -> Subscription {
        self.inner.events.subscribe(QUEUE_CAP)
    }

    /// Names the leg in slot `i` (its device spec) in the events and log lines about it;
    /// `None` forgets it (the slot emptied).
    pub fn set_leg_name(&self, i: usize, name: Option<String>) {
        if let Some(n) = self.inner.events.names.lock().get_mut(i) {
            *n = name;
        }
    }
}
