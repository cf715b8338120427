//! A TCP proxy between a test's client and the server that can slow the client's bytes down to
//! one per interval at a moment the test chooses: a trickling client built from a real one
//! (its TLS records, its requests), without re-implementing the client.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

/// One proxied connection (the proxy accepts exactly one).
pub struct Trickle {
    /// Where the client connects.
    pub addr: SocketAddr,
    /// From now on, client bytes go to the server one per `interval`.
    slow: Arc<AtomicBool>,
    /// When the server closed its side (end of file or an error on a read from it).
    server_closed: Arc<Mutex<Option<Instant>>>,
}

impl Trickle {
    /// A proxy to `server`, forwarding at full speed until [`Trickle::slow_down`].
    pub fn to(server: SocketAddr, interval: Duration) -> Self {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let slow = Arc::new(AtomicBool::new(false));
        let server_closed = Arc::new(Mutex::new(None));
        let (slow2, closed2) = (slow.clone(), server_closed.clone());
        thread::spawn(move || {
            let (client, _) = l.accept().unwrap();
            let upstream = TcpStream::connect(server).unwrap();
            let _ = upstream.set_nodelay(true);
            // Server to client: copied; the end of it is the moment the server gave up.
            let (mut from_server, mut to_client) =
                (upstream.try_clone().unwrap(), client.try_clone().unwrap());
            thread::spawn(move || {
                let mut buf = vec![0u8; 64 << 10];
                loop {
                    match from_server.read(&mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => {
                            if to_client.write_all(&buf[..n]).is_err() {
                                break;
                            }
                        }
                    }
                }
                *closed2.lock().unwrap() = Some(Instant::now());
                let _ = to_client.shutdown(Shutdown::Both);
            });
            // Client to server: whole reads, or one byte at a time once slowed down.
            let (mut from_client, mut to_server) = (client, upstream);
            let mut buf = vec![0u8; 64 << 10];
            loop {
                let n = match from_client.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => n,
                };
                let mut sent = 0;
                while sent < n {
                    let step = if slow2.load(Ordering::Relaxed) {
                        thread::sleep(interval);
                        1
                    } else {
                        n - sent
                    };
                    if to_server.write_all(&buf[sent..sent + step]).is_err() {
                        return;
                    }
                    sent += step;
                }
            }
            let _ = to_server.shutdown(Shutdown::Write);
        });
        Self {
            addr,
            slow,
            server_closed,
        }
    }

    /// Slows the client's bytes down from now on.
    pub fn slow_down(&self) {
        self.slow.store(true, Ordering::Relaxed);
    }

    /// Waits up to `limit` for the server to close the connection; when it did.
    pub fn server_closed_within(&self, limit: Duration) -> Option<Instant> {
        let end = Instant::now() + limit;
        loop {
            if let Some(t) = *self.server_closed.lock().unwrap() {
                return Some(t);
            }
            if Instant::now() >= end {
                return None;
            }
            thread::sleep(Duration::from_millis(20));
        }
    }
}
