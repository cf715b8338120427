//! The sender thread of a [`super::RemoteDevice`]: sends what no submitter is there to send:
//! every request waiting when a connection comes back, the flush of an emulated FUA write
//! once its write is answered (when the receiver could not send it at once), a request whose submitter found the send side busy or the
//! socket full (or every request, with `send=thread` or TLS), and the rest of a request an
//! inline send wrote in part (see "Sending inline" in `send`).
//!
//! Why a thread of its own rather than the receiver: the receiver must never wait for the
//! writer lock or the socket's send buffer. A server that cannot send its replies (its send
//! buffer full because nobody reads) stops reading requests; a receiver blocked on sending to
//! it would never read again. The sender may block on the socket: the receiver keeps reading
//! meanwhile, and a send that fails shuts the socket down for the receiver to handle.
//! One thread per device, never one per request; it sleeps on a wait queue until
//! `Table::send_needed` is raised.

use blk::Bio;
use blkq_sync::DynArc;

use super::table::LinkState;
use nbd_proto::proto::Command;

pub(super) fn run(sh: DynArc<LinkState>) {
    loop {
        let go = sh.sender_wq.wait_for(|| {
            if sh.is_closing() {
                return Some(false);
            }
            let mut t = sh.table.lock();
            std::mem::take(&mut t.send_needed).then_some(true)
        });
        if !go {
            return;
        }
        send_due(&sh);
    }
}

/// Sends every due slot. A write's bio is taken out of its slot while its payload is sent
/// (the sender is then its holder); a write whose bio is away is its holder's, who raises
/// `send_needed` again when it puts the bio back. One look at the table finds the next due
/// slot, so a wake-up for one flush costs one pass, not a lock per slot.
fn send_due(sh: &LinkState) {
    // First the rest of a request a submitter wrote in part: nothing else may go before it.
    let (r, back) = sh.finish_partial(&mut sh.writer.lock());
    if let Some((i, b)) = back {
        sh.put_back(i, b);
    }
    if let Err(e) = r {
        tracing::debug!(uri = %sh.uri, "sending the rest of a request: {e}");
        return;
    }
    let mut from = 0;
    loop {
        let next = {
            let mut t = sh.table.lock();
            let found = (from..t.slots.len()).find(|&j| {
                t.due(j) && (t.slots[j].cmd != Command::Write || t.slots[j].bio.is_some())
            });
            found.map(|i| {
                let s = &mut t.slots[i];
                let bio: Option<Bio> = if s.cmd == Command::Write {
                    s.bio.take()
                } else {
                    None
                };
                (i, bio, s.len as usize)
            })
        };
        let Some((i, bio, len)) = next else {
            return;
        };
        from = i + 1;
        let payload = bio
            .as_ref()
            .and_then(|b| b.buf.as_ref())
            .and_then(|b| b.as_slice().get(..len))
            .unwrap_or(&[]);
        let r = sh.send_slot(i, payload);
        if let Some(b) = bio {
            sh.put_back(i, b);
        }
        if let Err(e) = r {
            tracing::debug!(uri = %sh.uri, "re-sending: {e}");
            return;
        }
    }
}
