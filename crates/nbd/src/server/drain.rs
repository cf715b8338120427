//! Steps 2 and 3 of the shutdown (the server's module docs), which removing an export runs
//! too, for that export alone: drain the connections, then flush the devices.

use std::net::Shutdown;
use std::time::{Duration, Instant};

// `std`'s `Arc`, not the facade's: `blk::Device` and `blk::EndIo` take `std::sync::Arc`.
use blkq_sync::DynArc as Arc;

use blk::{Bio, Op, PendingBio};
use tracing::warn;

use super::shared::{ExportState, ServerState};

/// After the drain timeout and the forced close of every connection's socket, how long a
/// connection thread gets to notice and end before its export is reported stuck.
pub const STUCK_GRACE: Duration = Duration::from_secs(1);

/// Step 2 of the shutdown (module docs), for every connection (`only` is `None`) or for the
/// connections attached to export `only` (its removal): lets them finish, forcing their
/// sockets closed after `timeout`. Returns the exports with a connection still open
/// [`STUCK_GRACE`] after that (their threads are left behind); at shutdown, not the exports
/// removed before (their removal reported them).
pub(super) fn drain(
    shared: &ServerState,
    only: Option<&Arc<ExportState>>,
    timeout: Duration,
) -> Vec<Arc<ExportState>> {
    // The connections drained: by id, `None` for all.
    let ids: Option<Vec<u64>> = only.map(|x| {
        shared
            .conns
            .lock()
            .on_export
            .iter()
            .filter(|(_, e)| Arc::ptr_eq(e, x))
            .map(|(id, _)| *id)
            .collect()
    });
    let chosen = |id: &u64| ids.as_ref().is_none_or(|v| v.contains(id));
    // Shut the read side: each reader sees end-of-file after what it already received,
    // answers it, waits for its in-flight requests and closes.
    let threads: Vec<std::thread::JoinHandle<()>> = {
        let mut r = shared.conns.lock();
        for (_, s) in r.live.iter().filter(|(id, _)| chosen(id)) {
            let _ = s.shutdown(Shutdown::Read);
        }
        let (taken, kept) = std::mem::take(&mut r.threads)
            .into_iter()
            .partition(|(id, _)| chosen(id));
        r.threads = kept;
        taken.into_iter().map(|(_, t)| t).collect()
    };
    let deadline = Instant::now() + timeout;
    let mut forced = false;
    while threads.iter().any(|t| !t.is_finished()) {
        let now = Instant::now();
        if !forced && now >= deadline {
            warn!("connections still busy after the drain timeout; closing their sockets");
            for (_, s) in shared.conns.lock().live.iter().filter(|(id, _)| chosen(id)) {
                let _ = s.shutdown(Shutdown::Both);
            }
            forced = true;
        }
        if forced && now >= deadline + STUCK_GRACE {
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let mut stuck: Vec<Arc<ExportState>> = Vec::new();
    for t in threads {
        if t.is_finished() {
            let _ = t.join();
        }
        // Else: dropping the handle detaches the thread, which ends if its device ever
        // completes the request.
    }
    let r = shared.conns.lock();
    for (id, _) in r.live.iter().filter(|(id, _)| chosen(id)) {
        match r.on_export.iter().find(|(c, _)| c == id) {
            Some((_, e)) if only.is_none() && e.is_removed() => {}
            Some((_, e)) if !stuck.iter().any(|s| Arc::ptr_eq(s, e)) => stuck.push(e.clone()),
            Some(_) => {}
            None => warn!(conn = id, "a connection still in its handshake did not end"),
        }
    }
    stuck
}

/// Step 3 of the shutdown (and of a removal): flushes the device of each of `exports` once
/// (all at once), waiting up to `timeout` for them. A failed flush marks every export of its
/// device failed (in `exports` and in the table). Returns the exports whose flush did not
/// complete in time.
pub(super) fn flush(
    shared: &ServerState,
    exports: &[Arc<ExportState>],
    timeout: Duration,
) -> Vec<Arc<ExportState>> {
    let mut pending: Vec<(usize, PendingBio)> = Vec::new();
    for (i, e) in exports.iter().enumerate() {
        let dev = &e.export.device;
        let seen = exports[..i]
            .iter()
            .any(|o| Arc::ptr_eq(&o.export.device, dev) && !o.export.read_only);
        if e.export.read_only || seen {
            continue;
        }
        pending.push((
            i,
            PendingBio::submit(dev.as_ref(), Bio::new(Op::Flush, 0, 0)),
        ));
    }
    let deadline = Instant::now() + timeout;
    let mut late = Vec::new();
    for (i, flush) in pending {
        let dev = &exports[i].export.device;
        let name = &exports[i].export.name;
        let res = if let Some((_, res)) = flush.wait_until(deadline) {
            res
        } else {
            warn!(
                export = %name,
                "export {name:?} is stuck: its final flush did not complete within {timeout:?}"
            );
            late.extend(
                exports
                    .iter()
                    .filter(|o| Arc::ptr_eq(&o.export.device, dev))
                    .cloned(),
            );
            continue;
        };
        if let Err(err) = res {
            warn!(export = %name, "final flush failed: {err}");
            // Every export on this device shares the failure.
            for o in exports.iter().chain(shared.exports().iter()) {
                if Arc::ptr_eq(&o.export.device, dev) {
                    o.failed.set();
                }
            }
        }
    }
    late
}
