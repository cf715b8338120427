//! Legs a served mirror started without because they could not be opened then (`blkq serve
//! --raid1-degraded`, a remote leg whose server was down: a power cut on the front's side,
//! the back not up yet). Each is named in its slot (`raid status` shows it missing, with its
//! spec and why it is not back), and, unless `readd=off`, opened again every
//! `readd_interval` on a thread of its own; once it opens, the array judges its superblock
//! as a returning leg's ([`raid1::Raid1::readd_absent`]: this array, this slot, a history the
//! array's contains) and takes it back into the slot its superblock names, recovering what it
//! missed, or refuses it, untouched, and the refusal shows in `status` (it is tried again, in
//! case its server comes back with the right leg). The thread ends once the leg is back (by
//! itself or by `blkq raid add`), or the array is gone.

use std::sync::Weak;
use std::time::Duration;

use blk_drivers::spec::QueueOverrides;
use blkq_sync::{Arc, Mutex};
use raid1::{AbsentError, Raid1};

use crate::open::open_leg;

/// Told, once a leg is back, the slot it was shown in, the slot it went back into and its
/// spec (the control layer names it there).
pub type OnBack = Box<dyn Fn(usize, usize, &str) + Send>;

/// A leg the mirror started without, and what is known of it since.
pub struct Away {
    /// Its device spec.
    pub spec: String,
    /// The slot it is shown in until it is back: one the array misses (the array's missing
    /// slots, then its empty ones, in the order the unreachable legs were given). Where it
    /// goes back is its superblock's to say.
    pub slot: usize,
    /// How often it is tried again (`readd_interval`; none with `readd=off`).
    pub every: Option<Duration>,
    state: Mutex<AwayState>,
}

/// What the last attempt found ([`Away::state`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AwayState {
    /// Why it could not be opened or read the last time.
    pub last_error: Option<String>,
    /// Why its superblock was refused (it opens, but is another history).
    pub refused: Option<String>,
    /// Back in the array (or in it by other means): nothing more to show.
    pub done: bool,
}

impl Away {
    /// A leg `spec` shown in `slot`, which could not be opened (`error`), tried again
    /// `every` interval.
    pub fn new(spec: String, slot: usize, every: Option<Duration>, error: String) -> Self {
        Self {
            spec,
            slot,
            every,
            state: Mutex::new(AwayState {
                last_error: Some(error),
                ..AwayState::default()
            }),
        }
    }

    /// What the last attempt found.
    pub fn state(&self) -> AwayState {
        self.state.lock().clone()
    }

    /// Starts trying it every [`Away::every`] (a thread of its own, ending with the leg's
    /// return or the array's end); once it is back, `on_back` is told where.
    pub fn watch(self: &Arc<Self>, on_back: OnBack, raid: &Arc<Raid1>, ov: QueueOverrides) {
        let Some(every) = self.every else { return };
        let me = self.clone();
        let raid = Arc::downgrade(raid);
        let spawned = std::thread::Builder::new()
            .name("raid1-away".into())
            .spawn(move || me.run(&raid, &on_back, every, &ov));
        if let Err(e) = spawned {
            tracing::warn!(
                "raid1: leg {:?}: cannot start the thread that tries it again ({e}): add it \
                 with `blkq raid add` once it answers",
                self.spec
            );
        }
    }

    fn run(&self, raid: &Weak<Raid1>, on_back: &OnBack, every: Duration, ov: &QueueOverrides) {
        loop {
            std::thread::sleep(every);
            if raid.strong_count() == 0 {
                return;
            }
            // Opened without holding the array: a connection attempt may take its timeout.
            let opened = open_leg(&self.spec, ov);
            let dev = match opened {
                Ok(dev) => dev,
                Err(e) => {
                    tracing::debug!("raid1: leg {:?} still unreachable: {e:#}", self.spec);
                    self.state.lock().last_error = Some(format!("{e:#}"));
                    continue;
                }
            };
            let Some(r) = raid.upgrade() else { return };
            match r.readd_absent(dev) {
                Ok((slot, bitmap)) => {
                    tracing::info!(
                        "raid1: leg {:?} answers: back into slot {slot}, recovering {}",
                        self.spec,
                        if bitmap {
                            "the chunks written while it was away"
                        } else {
                            "in full"
                        }
                    );
                    on_back(self.slot, slot, &self.spec);
                    *self.state.lock() = AwayState {
                        done: true,
                        ..AwayState::default()
                    };
                    return;
                }
                Err(AbsentError::Refused(why)) => {
                    let mut st = self.state.lock();
                    if st.refused.as_deref() != Some(why.as_str()) {
                        tracing::warn!(
                            "raid1: leg {:?} answers but is refused, left out and untouched: \
                             {why}",
                            self.spec
                        );
                    }
                    st.last_error = None;
                    st.refused = Some(why);
                }
                Err(AbsentError::Gone(why)) => {
                    tracing::info!("raid1: leg {:?}: no longer tried: {why}", self.spec);
                    self.state.lock().done = true;
                    return;
                }
                Err(e) => {
                    tracing::debug!("raid1: leg {:?} not back yet: {e}", self.spec);
                    self.state.lock().last_error = Some(e.to_string());
                }
            }
        }
    }
}
