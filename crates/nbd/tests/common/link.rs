//! A network link between an NBD client and a server on another host, as a Unix-socket proxy
//! the test controls: it forwards bytes both ways (and each side's half-close), and can be
//! **partitioned** (nothing crosses, in either direction, for a while; connections made
//! meanwhile are held too, as a dial across a cut link is) and **reset** (every connection
//! across it ends at once, as when the far host goes down).
//!
//! A partition loses no byte: what was sent waits in the sockets' buffers and crosses when
//! the link heals, so a request the server had not received runs after the heal, and a reply
//! the client had not received arrives late, as TCP does across a partition shorter than its
//! retransmission limit. With a **user timeout** set ([`Link::set_user_timeout`], the client's
//! `TCP_USER_TIMEOUT`), a partition longer than it ends the connections it held once it has
//! lasted that long: their held bytes never cross (the client's kernel stopped retransmitting
//! them and gave the connection up; the server learns it at the heal).

use std::io::{ErrorKind, Read, Write};
use std::net::Shutdown;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

/// How often a pump looks at the link's state while it has nothing to forward.
const POLL: Duration = Duration::from_millis(2);

struct State {
    /// Until when nothing crosses (`None`: the link is up).
    cut_until: Mutex<Option<Instant>>,
    /// Every connection's two sockets (client side, server side) and its end flag, to reset
    /// them.
    conns: Mutex<Vec<Conn>>,
    /// The client's `TCP_USER_TIMEOUT`, if the link models one.
    user_timeout: Mutex<Option<Duration>>,
    /// Set when the link is dropped: every thread leaves.
    stop: AtomicBool,
    /// Connections made across the link.
    accepted: AtomicU64,
}

/// One connection across the link: its two sockets and whether it was ended (nothing more
/// crosses).
struct Conn {
    client: UnixStream,
    server: UnixStream,
    ended: Arc<AtomicBool>,
}

impl Conn {
    fn end(&self) {
        self.ended.store(true, Ordering::SeqCst);
        let _ = self.client.shutdown(Shutdown::Both);
        let _ = self.server.shutdown(Shutdown::Both);
    }
}

impl State {
    fn cut(&self) -> bool {
        let mut c = self.cut_until.lock().unwrap();
        match *c {
            Some(t) if Instant::now() < t => true,
            Some(_) => {
                *c = None;
                false
            }
            None => false,
        }
    }
}

/// The proxy: clients connect to [`Link::front`], which leads to the server's socket `back`.
pub struct Link {
    front: PathBuf,
    state: Arc<State>,
}

impl Link {
    /// Listens on `front` and forwards every connection to `back` (dialled when the client
    /// connects; a server that is not there closes the client's connection).
    pub fn start(front: &Path, back: &Path) -> Link {
        let _ = std::fs::remove_file(front);
        let l = UnixListener::bind(front).unwrap();
        l.set_nonblocking(true).unwrap();
        let state = Arc::new(State {
            cut_until: Mutex::new(None),
            conns: Mutex::new(Vec::new()),
            user_timeout: Mutex::new(None),
            stop: AtomicBool::new(false),
            accepted: AtomicU64::new(0),
        });
        let (st, back) = (state.clone(), back.to_path_buf());
        thread::spawn(move || {
            while !st.stop.load(Ordering::SeqCst) {
                match l.accept() {
                    Ok((client, _)) => {
                        st.accepted.fetch_add(1, Ordering::SeqCst);
                        let Ok(server) = UnixStream::connect(&back) else {
                            continue;
                        };
                        let _ = client.set_nonblocking(false);
                        let ended = Arc::new(AtomicBool::new(false));
                        st.conns.lock().unwrap().push(Conn {
                            client: client.try_clone().unwrap(),
                            server: server.try_clone().unwrap(),
                            ended: ended.clone(),
                        });
                        pump(
                            &st,
                            client.try_clone().unwrap(),
                            server.try_clone().unwrap(),
                            ended.clone(),
                        );
                        pump(&st, server, client, ended);
                    }
                    Err(e) if e.kind() == ErrorKind::WouldBlock => thread::sleep(POLL),
                    Err(_) => thread::sleep(POLL),
                }
            }
        });
        Link {
            front: front.to_path_buf(),
            state,
        }
    }

    /// Where clients connect.
    pub fn front(&self) -> &Path {
        &self.front
    }

    /// Nothing crosses for `d` from now (a partition that heals by itself). Longer than the
    /// user timeout, it ends the connections open now once it has lasted that long.
    pub fn partition(&self, d: Duration) {
        *self.state.cut_until.lock().unwrap() = Some(Instant::now() + d);
        let Some(ut) = *self.state.user_timeout.lock().unwrap() else {
            return;
        };
        if d <= ut {
            return;
        }
        let held: Vec<Arc<AtomicBool>> = self
            .state
            .conns
            .lock()
            .unwrap()
            .iter()
            .map(|c| c.ended.clone())
            .collect();
        let st = self.state.clone();
        thread::spawn(move || {
            thread::sleep(ut);
            let mut conns = st.conns.lock().unwrap();
            conns.retain(|c| {
                let gone = held.iter().any(|h| Arc::ptr_eq(h, &c.ended));
                if gone {
                    c.end();
                }
                !gone
            });
        });
    }

    /// The client's `TCP_USER_TIMEOUT` (see the module docs).
    pub fn set_user_timeout(&self, d: Duration) {
        *self.state.user_timeout.lock().unwrap() = Some(d);
    }

    /// Whether the link is partitioned now.
    pub fn is_cut(&self) -> bool {
        self.state.cut()
    }

    /// Every connection across the link ends now, both ways (the far host went down).
    pub fn reset(&self) {
        for c in self.state.conns.lock().unwrap().drain(..) {
            c.end();
        }
    }

    /// Connections made across the link so far.
    pub fn accepted(&self) -> u64 {
        self.state.accepted.load(Ordering::SeqCst)
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        self.state.stop.store(true, Ordering::SeqCst);
        self.reset();
        let _ = std::fs::remove_file(&self.front);
    }
}

/// Copies `from` to `to` while the link is up; the end of `from` half-closes `to`, an error
/// closes both; a connection `ended` forwards nothing more.
fn pump(st: &Arc<State>, mut from: UnixStream, mut to: UnixStream, ended: Arc<AtomicBool>) {
    let st = st.clone();
    let _ = from.set_read_timeout(Some(POLL));
    thread::spawn(move || {
        let mut buf = vec![0u8; 64 << 10];
        while !st.stop.load(Ordering::SeqCst) {
            if ended.load(Ordering::SeqCst) {
                return;
            }
            if st.cut() {
                thread::sleep(POLL);
                continue;
            }
            match from.read(&mut buf) {
                Ok(0) => {
                    let _ = to.shutdown(Shutdown::Write);
                    return;
                }
                Ok(n) => {
                    if ended.load(Ordering::SeqCst) || to.write_all(&buf[..n]).is_err() {
                        let _ = from.shutdown(Shutdown::Both);
                        return;
                    }
                }
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
                Err(_) => {
                    let _ = to.shutdown(Shutdown::Both);
                    return;
                }
            }
        }
    });
}
