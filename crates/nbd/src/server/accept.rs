//! Listeners and their acceptor threads: binding leaves a stale socket alone unless nothing
//! answers on it; an acceptor enforces the connection limit, logs floods at a bounded rate,
//! backs off when descriptors run out, and hands each socket to a connection thread.

use std::io;
use std::net::TcpListener;
use std::os::fd::OwnedFd;
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::time::Duration;

// `std`'s `Arc`, not the facade's (as in the parent module).
use blkq_sync::DynArc as Arc;
use blkq_sync::MutexGuard;
use tracing::{debug, warn};

use super::limits::RateLimited;
use super::shared::{Registry, ServerState};
use crate::stream::Stream;

pub(super) enum Listener {
    Tcp(TcpListener),
    Unix(UnixListener),
}

impl Listener {
    /// A second descriptor of the listening socket, for `sys::shutdown_listener` at stop.
    pub(super) fn waker(&self) -> io::Result<OwnedFd> {
        Ok(match self {
            Listener::Tcp(l) => OwnedFd::from(l.try_clone()?),
            Listener::Unix(l) => OwnedFd::from(l.try_clone()?),
        })
    }

    pub(super) fn accept(&self) -> io::Result<Stream> {
        match self {
            Listener::Tcp(l) => l.accept().map(|(s, _)| Stream::from(s)),
            Listener::Unix(l) => l.accept().map(|(s, _)| Stream::from(s)),
        }
    }
}

/// Removes a socket file left by a server that is gone; refuses to touch anything else, and a
/// socket some live server still answers on.
pub(super) fn remove_stale_socket(path: &Path) -> io::Result<()> {
    let meta = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    if !meta.file_type().is_socket() {
        return Err(io::Error::new(
            io::ErrorKind::AlreadyExists,
            "the path exists and is not a socket (not replacing it)",
        ));
    }
    // Stale only if nothing answers: ECONNREFUSED. Any other outcome leaves the file alone.
    match UnixStream::connect(path) {
        Ok(_) => {
            return Err(io::Error::new(
                io::ErrorKind::AddrInUse,
                "another server is listening on this socket",
            ))
        }
        Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {}
        Err(e) => {
            return Err(io::Error::new(
                e.kind(),
                format!("cannot tell whether the socket is stale ({e}); not replacing it"),
            ))
        }
    }
    debug!(path = %path.display(), "removing stale socket");
    std::fs::remove_file(path)
}

pub(super) fn accept_loop(l: Listener, shared: Arc<ServerState>) {
    let mut accept_failed = RateLimited::default();
    let mut over_limit = RateLimited::default();
    let mut refused_address = RateLimited::default();
    let mut evicting = RateLimited::default();
    loop {
        let res = l.accept();
        if shared.stopping() {
            return;
        }
        let stream = match res {
            Ok(s) => s,
            Err(e) => {
                // EMFILE, ENFILE, ENOBUFS: the pending connection stays in the backlog and
                // the existing ones go on; back off briefly instead of spinning.
                if let Some(left_out) = accept_failed.allow() {
                    warn!(left_out, "accept failed (retrying shortly): {e}");
                }
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
        };
        let handle = match stream.try_clone() {
            Ok(h) => h,
            Err(e) => {
                if let Some(left_out) = accept_failed.allow() {
                    warn!(left_out, "dropping a connection: {e}");
                }
                continue;
            }
        };
        // Address rules at the door: a TCP client that no export's `allow` admits would
        // only be refused later, and would hold a slot meanwhile.
        let who = (shared.tuning.identify)(&stream);
        let admitted = shared
            .exports()
            .iter()
            .map(|e| e.access.read().check_address(&who))
            .reduce(|a, b| a.or(b));
        if let Some(Err(refusal)) = admitted {
            let peer = stream.peer();
            drop((stream, handle));
            shared
                .counters
                .handshake_failed(super::stats::HandshakeFailure::Policy);
            if let Some(left_out) = refused_address.allow() {
                warn!(
                    %peer,
                    left_out,
                    reason = "policy",
                    rule = refusal.reason(),
                    "refused a connection at accept: no export allows it ({refusal})"
                );
            }
            continue;
        }
        let mut r = shared.conns.lock();
        let limit = shared.tuning.max_connections;
        if r.live.len() - r.evicted.len() >= limit {
            match evict_oldest_handshake(&mut r, limit) {
                Some((id, peer)) => {
                    if let Some(left_out) = evicting.allow() {
                        warn!(
                            conn = id,
                            %peer,
                            left_out,
                            reason = "evicted",
                            "closed the oldest connection still in its handshake to make room \
                             for a new one: {limit} connections are open (--max-connections)"
                        );
                    }
                }
                None => {
                    drop(r);
                    let peer = stream.peer();
                    // Closed at once: the client sees end-of-file before the greeting.
                    drop((stream, handle));
                    shared.counters.refused_limit();
                    if let Some(left_out) = over_limit.allow() {
                        warn!(
                            %peer,
                            left_out,
                            reason = "limit",
                            "refused a connection: {limit} connections are open \
                             (--max-connections), none of them in its handshake"
                        );
                    }
                    continue;
                }
            }
        }
        spawn_conn(&shared, r, stream, handle, &mut accept_failed);
    }
}

/// Registers an accepted connection (`r`: the registry, locked; `handle`: a clone of its
/// socket, to shut it down) and starts its thread; a thread that cannot be spawned drops the
/// connection, logged through `accept_failed`.
fn spawn_conn(
    shared: &Arc<ServerState>,
    mut r: MutexGuard<'_, Registry>,
    stream: Stream,
    handle: Stream,
    accept_failed: &mut RateLimited,
) {
    r.threads.retain(|(_, t)| !t.is_finished());
    let id = r.next_id;
    r.next_id += 1;
    r.live.push((id, handle));
    let sh = shared.clone();
    let spawned = std::thread::Builder::new()
        .name(format!("nbd-conn-{id}"))
        .spawn(move || super::conn::serve(stream, sh, id));
    match spawned {
        Ok(t) => {
            r.threads.push((id, t));
            shared.counters.accepted();
        }
        Err(e) => {
            // The closure, and the socket in it, are dropped with the error; the
            // registry's handle goes here: nothing is left open.
            if let Some(i) = r.live.iter().position(|(c, _)| *c == id) {
                r.live.swap_remove(i);
            }
            drop(r);
            if let Some(left_out) = accept_failed.allow() {
                warn!(
                    left_out,
                    "dropping a connection: cannot spawn its thread: {e}"
                );
            }
        }
    }
}

/// At the connection limit, makes room for a new connection: shuts down the socket of the
/// oldest connection still in its handshake (the lowest id neither attached to an export nor
/// already evicted), whose thread then ends and leaves the registry. `None` when every open
/// connection is attached to an export, or when evicted ones still winding down already
/// number `limit` (the hard bound: never more than twice the limit of sockets and threads).
///
/// Why evict rather than reserve: before its handshake ends nothing tells a legitimate client
/// from a hostile one, so a reserve would fill the same way. A legitimate handshake takes
/// milliseconds; a connection that is still haggling when the server is full is the one most
/// likely to be a slow or hostile client, and evicting the oldest means a flood must outpace
/// a real client's whole handshake to keep it out. Clients in transmission passed the access
/// rules and are never evicted.
fn evict_oldest_handshake(r: &mut Registry, limit: usize) -> Option<(u64, String)> {
    if r.evicted.len() >= limit {
        return None;
    }
    let (id, sock) = r
        .live
        .iter()
        .filter(|(id, _)| !r.on_export.iter().any(|(c, _)| c == id) && !r.evicted.contains(id))
        .min_by_key(|(id, _)| *id)?;
    let id = *id;
    let peer = sock.peer();
    let _ = sock.shutdown(std::net::Shutdown::Both);
    r.evicted.push(id);
    Some((id, peer))
}
