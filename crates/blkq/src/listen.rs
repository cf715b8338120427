//! One request per connection, served concurrently within bounds: the shape the control
//! socket ([`crate::control`]) and the metrics endpoint ([`crate::metrics`]) share.
//!
//! Bounds, per listener ([`Limits`]):
//! - **Slots.** At most `slots` connections are served at once, a thread each (so threads and
//!   buffers are bounded too); further connections wait in the listen backlog.
//! - **Deadline.** A connection has `deadline` from its accept to send its whole request: not
//!   per read, so a client trickling a byte at a time is cut when the deadline passes. Its
//!   reply must be taken by the same deadline, or within [`REPLY_GRACE`] of being ready when
//!   that is later (the time the command itself runs is ours, not the client's). Then a
//!   bounded drain ([`DRAIN_MAX`] bytes, at most [`REPLY_GRACE`]) so that closing with unread
//!   bytes does not reset the connection and lose the reply.
//! - **Full: evict, not refuse.** When every slot is taken, the new connection evicts the
//!   oldest one that is waiting on its client (for its request, or to take its reply): its
//!   socket is shut down and its thread ends at once. Refusing would let anyone who can
//!   connect keep a legitimate command out by holding the slots, reconnecting as each is cut at
//!   its deadline; with eviction, holding a slot means sending a request faster than other
//!   clients connect. A legitimate client sends its line (or GET) as soon as it connects and
//!   waits only on us after that, so it is the newest of those waiting on their clients, the
//!   last to be evicted, and is past that phase within microseconds. A connection whose
//!   request is running ([`Session::work`]: a command, a scrape's encoding) is never evicted,
//!   so nothing is cut halfway; when all slots run requests, the new connection waits for one
//!   to end (those end by themselves).
//!
//! An evicted connection gets no reply and never runs its request, even if part of it arrived
//! (a control line cut by the eviction is not a shorter command).
//!
//! **Held connections.** A request that answers for as long as its client listens (the control
//! socket's `monitor`) holds its connection ([`Session::hold`]): it keeps its slot, is never
//! evicted, and has no deadline for its replies, only [`HELD_WRITE_TIMEOUT`] for each write; at
//! most a given number at once (so the others' slots stay free for commands). It ends when its
//! client goes away ([`Session::client_gone`]) or the server stops ([`Session::stopping`];
//! the stop shuts its socket down too).

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use blkq_sync::atomic::{AtomicBool, Ordering};
use blkq_sync::{thread, Arc, Mutex};

/// How long a reply may take to be read when it is ready after the deadline, and the longest
/// drain after it.
pub const REPLY_GRACE: Duration = Duration::from_secs(1);
/// Most bytes read (and dropped) after the reply before closing.
pub const DRAIN_MAX: usize = 64 << 10;
/// How long the acceptor sleeps between looks while every slot runs a request.
const FULL_RETRY: Duration = Duration::from_millis(50);
/// How long one write of a held connection may wait for its client to read.
pub const HELD_WRITE_TIMEOUT: Duration = Duration::from_secs(5);

/// A stream socket a session can be served on.
pub trait Conn: Read + Write + Send + Sized + 'static {
    /// A second handle on the same socket (to shut it down from the acceptor).
    fn handle(&self) -> io::Result<Self>;
    /// `SO_RCVTIMEO`.
    fn read_timeout(&self, d: Duration) -> io::Result<()>;
    /// `SO_SNDTIMEO`.
    fn write_timeout(&self, d: Duration) -> io::Result<()>;
    /// `shutdown(2)`.
    fn shut(&self, how: Shutdown) -> io::Result<()>;
    /// Whether the peer closed its end or the connection broke (a look without waiting;
    /// bytes it sent meanwhile are read and dropped).
    fn peer_gone(&mut self) -> bool;
}

macro_rules! conn_impl {
    ($t:ty) => {
        impl Conn for $t {
            fn handle(&self) -> io::Result<Self> {
                self.try_clone()
            }
            fn read_timeout(&self, d: Duration) -> io::Result<()> {
                self.set_read_timeout(Some(d))
            }
            fn write_timeout(&self, d: Duration) -> io::Result<()> {
                self.set_write_timeout(Some(d))
            }
            fn shut(&self, how: Shutdown) -> io::Result<()> {
                self.shutdown(how)
            }
            fn peer_gone(&mut self) -> bool {
                if self.set_nonblocking(true).is_err() {
                    return true;
                }
                let mut sink = [0u8; 512];
                let gone = loop {
                    match self.read(&mut sink) {
                        Ok(0) => break true,
                        Ok(_) => continue,
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => break false,
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                        Err(_) => break true,
                    }
                };
                self.set_nonblocking(false).is_err() || gone
            }
        }
    };
}
conn_impl!(UnixStream);
conn_impl!(TcpStream);

/// A listener's bounds.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Connections served at once.
    pub slots: usize,
    /// From accept to the whole request received (and the reply taken, see the module docs).
    pub deadline: Duration,
}

/// One connection being served, as the acceptor sees it.
struct Entry {
    id: u64,
    /// Waiting on its client (reading the request, writing the reply, draining): evictable.
    on_client: bool,
    /// Evicted: its socket was shut down; it must not run its request.
    evicted: bool,
    /// Held ([`Session::hold`]): never evicted, shut down when the server stops.
    held: bool,
    /// Shuts its socket down (a handle of its own).
    kill: Box<dyn Fn() + Send>,
}

struct Table {
    entries: Vec<Entry>,
    next_id: u64,
    /// The acceptor, when it waits for a slot.
    acceptor: Option<thread::Thread>,
}

struct Pool {
    table: Mutex<Table>,
    /// The server stops: held connections end.
    stopping: AtomicBool,
}

impl Pool {
    /// Sets `on_client` of entry `id`; `false` if it was evicted.
    fn set_on_client(&self, id: u64, on_client: bool) -> bool {
        let mut t = self.table.lock();
        match t.entries.iter_mut().find(|e| e.id == id) {
            Some(e) if !e.evicted => {
                e.on_client = on_client;
                true
            }
            _ => false,
        }
    }

    fn evicted(&self, id: u64) -> bool {
        let t = self.table.lock();
        t.entries
            .iter()
            .find(|e| e.id == id)
            .is_none_or(|e| e.evicted)
    }

    /// Evicts the oldest connection waiting on its client (entries are in accept order).
    /// Returns whether there was one.
    fn evict_oldest(t: &mut Table) -> bool {
        match t.entries.iter_mut().find(|e| e.on_client && !e.evicted) {
            Some(e) => {
                // Marked before the shutdown, under the lock: the session's read that the
                // shutdown ends sees the mark (it looks under the same lock).
                e.evicted = true;
                (e.kill)();
                true
            }
            None => false,
        }
    }
}

/// A connection being served: its socket behind a deadline. Reads and writes past the
/// deadline fail with `TimedOut`; after an eviction, with `ConnectionAborted`.
pub struct Session<C: Conn> {
    conn: C,
    id: u64,
    pool: Arc<Pool>,
    deadline: Instant,
    /// Set at the first write: the deadline, or [`REPLY_GRACE`] from then if that is later.
    write_deadline: Option<Instant>,
    limits: Limits,
    /// Held ([`Session::hold`]): no deadline, [`HELD_WRITE_TIMEOUT`] per write.
    held: bool,
}

fn aborted() -> io::Error {
    io::Error::new(
        io::ErrorKind::ConnectionAborted,
        "evicted: every slot was taken and this connection was the oldest waiting on its client",
    )
}

impl<C: Conn> Session<C> {
    /// Runs the request (`f`): the connection cannot be evicted meanwhile. `Err` if it was
    /// evicted before (then `f` does not run).
    pub fn work<R>(&mut self, f: impl FnOnce() -> R) -> io::Result<R> {
        if !self.pool.set_on_client(self.id, false) {
            return Err(aborted());
        }
        let r = f();
        if !self.pool.set_on_client(self.id, true) {
            return Err(aborted());
        }
        Ok(r)
    }

    /// Holds the connection for a request that answers as long as its client listens (see the
    /// module docs), if fewer than `max` connections of this listener are held: `Ok(false)`
    /// when `max` are. `Err` if it was evicted before.
    pub fn hold(&mut self, max: usize) -> io::Result<bool> {
        let mut t = self.pool.table.lock();
        let held = t.entries.iter().filter(|e| e.held).count();
        let Some(e) = t.entries.iter_mut().find(|e| e.id == self.id) else {
            return Err(aborted());
        };
        if e.evicted {
            return Err(aborted());
        }
        if held >= max {
            return Ok(false);
        }
        e.held = true;
        e.on_client = false;
        drop(t);
        self.held = true;
        Ok(true)
    }

    /// Whether the server stops (a held connection then ends).
    pub fn stopping(&self) -> bool {
        // Acquire: pairs with the Release store in `serve` (only a flag).
        self.pool.stopping.load(Ordering::Acquire) || self.pool.evicted(self.id)
    }

    /// Whether the client closed its end or the connection broke (see [`Conn::peer_gone`]).
    pub fn client_gone(&mut self) -> bool {
        self.conn.peer_gone()
    }

    /// Ends the reply (`shutdown(Write)`) and drains what the client still sends, bounded
    /// ([`DRAIN_MAX`] bytes, [`REPLY_GRACE`]), so that the close does not reset the connection
    /// before the client has read the reply.
    pub fn finish(&mut self) {
        let _ = self.conn.shut(Shutdown::Write);
        let until = Instant::now() + REPLY_GRACE;
        let mut sink = [0u8; 4096];
        let mut drained = 0;
        while drained < DRAIN_MAX && !self.pool.evicted(self.id) {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() || self.conn.read_timeout(left).is_err() {
                break;
            }
            match self.conn.read(&mut sink) {
                Ok(0) | Err(_) => break,
                Ok(n) => drained += n,
            }
        }
    }

    fn timed_out(&self, what: &str) -> io::Error {
        io::Error::new(
            io::ErrorKind::TimedOut,
            format!(
                "{what} not done within {} s of connecting: closed",
                self.limits.deadline.as_secs_f64()
            ),
        )
    }
}

impl<C: Conn> Read for Session<C> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.pool.evicted(self.id) {
            return Err(aborted());
        }
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(self.timed_out("request"));
        }
        self.conn.read_timeout(left)?;
        let r = self.conn.read(buf);
        // An eviction shuts the socket down, which ends this read with 0 bytes: not an EOF.
        if self.pool.evicted(self.id) {
            return Err(aborted());
        }
        match r {
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                Err(self.timed_out("request"))
            }
            r => r,
        }
    }
}

impl<C: Conn> Write for Session<C> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if self.pool.evicted(self.id) {
            return Err(aborted());
        }
        if self.held {
            self.conn.write_timeout(HELD_WRITE_TIMEOUT)?;
            return self.conn.write(buf);
        }
        let until = *self
            .write_deadline
            .get_or_insert_with(|| self.deadline.max(Instant::now() + REPLY_GRACE));
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(self.timed_out("reply"));
        }
        self.conn.write_timeout(left)?;
        match self.conn.write(buf) {
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                Err(self.timed_out("reply"))
            }
            r => r,
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        self.conn.flush()
    }
}

impl<C: Conn> Drop for Session<C> {
    fn drop(&mut self) {
        let mut t = self.pool.table.lock();
        t.entries.retain(|e| e.id != self.id);
        let a = t.acceptor.take();
        drop(t);
        if let Some(a) = a {
            a.unpark();
        }
    }
}

/// Serves the connections `accept` returns, each on a thread of its own running `handler`,
/// within `limits`, until `stop` is set (looked at after each accept: the caller wakes the
/// accept, e.g. with a connection of its own). Then evicts whoever waits on a client, waits
/// for every session to end, and returns. `name` names the threads and the log lines.
pub fn serve<C, H>(
    name: &'static str,
    limits: Limits,
    mut accept: impl FnMut() -> io::Result<C>,
    stop: &AtomicBool,
    handler: Arc<H>,
) where
    C: Conn,
    H: Fn(&mut Session<C>) + Send + Sync + 'static,
{
    let pool = Arc::new(Pool {
        table: Mutex::new(Table {
            entries: Vec::new(),
            next_id: 0,
            acceptor: None,
        }),
        stopping: AtomicBool::new(false),
    });
    let slots = limits.slots.max(1);
    loop {
        let conn = match accept() {
            Ok(c) => c,
            Err(e) => {
                // E.g. out of file descriptors: back off instead of spinning.
                tracing::warn!("{name}: accept: {e}");
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        // Acquire: pairs with the caller's Release store (only a flag).
        if stop.load(Ordering::Acquire) {
            break;
        }
        let deadline = Instant::now() + limits.deadline;
        let kill = match conn.handle() {
            Ok(h) => Box::new(move || {
                let _ = h.shut(Shutdown::Both);
            }) as Box<dyn Fn() + Send>,
            Err(e) => {
                tracing::warn!("{name}: cannot serve a connection: {e}");
                continue;
            }
        };
        // A slot: free, freed by evicting the oldest connection waiting on its client, or
        // (every slot runs a request) the next to end.
        let mut kill = Some(kill);
        let id = loop {
            let mut t = pool.table.lock();
            if t.entries.len() < slots {
                let id = t.next_id;
                t.next_id += 1;
                t.entries.push(Entry {
                    id,
                    on_client: true,
                    evicted: false,
                    held: false,
                    kill: kill.take().expect("set until admitted"),
                });
                break Some(id);
            }
            if Pool::evict_oldest(&mut t) {
                tracing::debug!("{name}: every slot taken: evicted the oldest waiting client");
            }
            t.acceptor = Some(thread::current());
            drop(t);
            blkq_sync::park_until(Instant::now() + FULL_RETRY);
            if stop.load(Ordering::Acquire) {
                break None;
            }
        };
        let Some(id) = id else { break };
        let mut s = Session {
            conn,
            id,
            pool: pool.clone(),
            deadline,
            write_deadline: None,
            limits,
            held: false,
        };
        let h = handler.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("{name}-conn"))
            .spawn(move || {
                h(&mut s);
                // The handler's references (e.g. to the array) go before the slot does:
                // when the pool is empty, nothing of the handler is left on these threads.
                drop(h);
                drop(s);
            });
        if let Err(e) = spawned {
            // The session was dropped with the closure: its slot is free again.
            tracing::warn!("{name}: cannot start a thread for a connection: {e}");
        }
    }
    // Stop: cut whoever waits on a client, and the held connections; requests running
    // finish. Bounded: an evicted session ends at once, a held one at its next look at
    // `stopping` (or write), a running request by itself.
    pool.stopping.store(true, Ordering::Release);
    loop {
        let mut t = pool.table.lock();
        if t.entries.is_empty() {
            break;
        }
        while Pool::evict_oldest(&mut t) {}
        for e in t.entries.iter_mut().filter(|e| e.held && !e.evicted) {
            e.evicted = true;
            (e.kill)();
        }
        t.acceptor = Some(thread::current());
        drop(t);
        blkq_sync::park_until(Instant::now() + FULL_RETRY);
    }
}
