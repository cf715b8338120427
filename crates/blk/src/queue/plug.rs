//! The plug: requests a submitter collects before they reach the driver as one batch, and
//! the per-thread plug behind [`crate::Device::submit_batch`].

use crate::bio::Op;

use super::request::RequestToken;

#[cfg(not(blkq_loom))]
std::thread_local! {
    /// Each thread's plug for [`crate::Device::submit_batch`] (`None` until its first batch). Empty
    /// between batches: a batch flushes it before it gives it back.
    static THREAD_PLUG: std::cell::RefCell<Option<Plug>> = const { std::cell::RefCell::new(None) };
}

/// Runs `f` with the calling thread's plug (one per thread, created on the thread's first
/// batch with room for `cap` requests, then reused by every batch of every queue: a plug is
/// empty between batches, so it does not matter which queue used it last). `f` must leave it
/// flushed.
///
/// Why a thread-local and not a plug owned by each caller: [`crate::Device::submit_batch`] is the
/// stacking interface (NBD, RAID1 and the fault injector call it on whatever device they
/// hold), and a plug is a `Queue`'s type; a thread-local keeps the trait as it is and still
/// allocates once per thread. A nested batch on the same thread (an `end_io` that submits a
/// batch from inside a completion of this one) finds the plug in use and takes a fresh one,
/// which allocates: the only case that does. Under loom each call takes a fresh plug (loom's
/// threads are not OS threads, and a model need not exercise the reuse).
pub(super) fn with_thread_plug(cap: usize, f: impl FnOnce(&mut Plug)) {
    #[cfg(not(blkq_loom))]
    {
        let mut f = Some(f);
        let reused = THREAD_PLUG.try_with(|cell| {
            let Ok(mut slot) = cell.try_borrow_mut() else {
                return false;
            };
            let plug = slot.get_or_insert_with(|| Plug::new(cap));
            if let Some(f) = f.take() {
                // A panic in the middle of a batch (a driver's) may leave requests in the
                // plug: they belong to that queue and must never be flushed into the next
                // batch's, so the plug is dropped from the thread (its requests leaked, as a
                // local plug's were) before the panic goes on. Zero cost unless it unwinds.
                let res = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(plug)));
                if let Err(panic) = res {
                    if let Some(stale) = slot.take() {
                        std::mem::forget(stale);
                    }
                    std::panic::resume_unwind(panic);
                }
            }
            true
        });
        if reused == Ok(true) {
            return;
        }
        // Nested in a batch of this thread, or the thread is exiting.
        if let Some(f) = f {
            f(&mut Plug::new(cap));
        }
    }
    #[cfg(blkq_loom)]
    f(&mut Plug::new(cap));
}

/// A per-submitter plug: requests collected before they reach the driver as one batch.
/// Keep one per submitter and reuse it: its vector is allocated once.
///
/// A plug also carries its batch's time: the first request of a batch reads the coarse clock
/// and every request of the batch takes that time as its start ([`crate::stats`]); flushing
/// the plug ends the batch.
#[derive(Debug)]
pub struct Plug {
    pub(super) rqs: Vec<RequestToken>,
    /// The merge chain ending the last plugged request, for back merges (no scheduler).
    pub(super) tail: Option<PlugTail>,
    /// The batch's start time (coarse clock), read by its first request.
    pub(super) now_ns: Option<u64>,
}

/// What a plug knows of its last request's merge chain.
#[derive(Debug, Clone, Copy)]
pub(super) struct PlugTail {
    pub(super) op: Op,
    pub(super) flags: crate::BioFlags,
    pub(super) prio: crate::IoPrio,
    pub(super) end_sector: u64,
    pub(super) bytes: u64,
    pub(super) bios: u32,
}

impl Plug {
    /// A plug holding up to `cap` requests without reallocating.
    pub fn new(cap: usize) -> Self {
        Self {
            rqs: Vec::with_capacity(cap),
            tail: None,
            now_ns: None,
        }
    }

    /// Requests waiting in the plug.
    pub fn len(&self) -> usize {
        self.rqs.len()
    }

    /// Whether the plug is empty.
    pub fn is_empty(&self) -> bool {
        self.rqs.is_empty()
    }
}

impl Drop for Plug {
    fn drop(&mut self) {
        // A plug must be flushed before it is dropped; requests left in it would hold their
        // tags forever. We cannot reach the queue from here, so this is a caller bug.
        debug_assert!(self.rqs.is_empty(), "plug dropped with requests in it");
    }
}
