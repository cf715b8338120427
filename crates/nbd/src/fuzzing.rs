//! A whole-connection harness for fuzzing (`crates/nbd/fuzz`, target `conn`) and for replaying
//! its corpus under plain `cargo test` (`tests/fuzz_corpus.rs`). Not a public API.
//!
//! One server (a Unix socket in a private temporary directory) serves the given exports for
//! the harness's lifetime. [`ConnHarness::run`] connects, sends the input as a client would
//! (handshake and transmission bytes alike), half-closes, and reads whatever the server
//! answers until it closes the connection; then it checks that the server still serves a
//! well-behaved client and that no connection is left open. A panic in the server, a hang, a
//! leaked connection or a server that no longer answers fails the run.

use std::io::{Read, Write};
use std::net::Shutdown;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::client::{Client, ClientOptions, Endpoint};
use crate::server::{Export, Server, ServerConfig};

/// How long one input may keep the server busy.
const RUN_DEADLINE: Duration = Duration::from_secs(10);

/// A server and the means to throw connections at it.
pub struct ConnHarness {
    server: Option<Server>,
    dir: PathBuf,
    path: PathBuf,
}

impl ConnHarness {
    /// Starts a server for `exports` (the first one should be the default export, `""`).
    pub fn new(exports: Vec<Export>) -> std::io::Result<Self> {
        // Unique per harness: the process id and the clock (harnesses are created rarely).
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let dir = std::env::temp_dir().join(format!("blkq-fuzz-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let path = dir.join("s.sock");
        let mut cfg = ServerConfig::new(exports);
        cfg.unix = Some(path.clone());
        let server = Server::start(cfg).map_err(std::io::Error::other)?;
        Ok(Self {
            server: Some(server),
            dir,
            path,
        })
    }

    /// Sends `input` on a fresh connection and reads until the server closes it; then checks
    /// the server. Panics (the fuzzer's failure) if the server misbehaves. Returns how many
    /// bytes the server sent on the connection.
    pub fn run(&self, input: &[u8]) -> usize {
        let mut s = UnixStream::connect(&self.path).expect("connect");
        s.set_read_timeout(Some(Duration::from_millis(200))).ok();
        s.set_write_timeout(Some(RUN_DEADLINE)).ok();
        // The server may stop reading (it closed after an error): a write error is an answer.
        let writer = {
            let mut w = s.try_clone().expect("clone");
            let input = input.to_vec();
            std::thread::spawn(move || {
                let _ = w.write_all(&input);
                let _ = w.shutdown(Shutdown::Write);
            })
        };
        let start = Instant::now();
        let mut buf = vec![0u8; 1 << 20];
        let mut got = 0;
        loop {
            match s.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => got += n,
                Err(e)
                    if e.kind() == std::io::ErrorKind::WouldBlock
                        || e.kind() == std::io::ErrorKind::TimedOut =>
                {
                    // A half-closed client with nothing in flight must be let go, and one
                    // with requests in flight answered: neither takes long.
                    assert!(
                        start.elapsed() < RUN_DEADLINE,
                        "the server kept a half-closed connection open for {RUN_DEADLINE:?}"
                    );
                }
                Err(_) => break, // reset: closed
            }
        }
        let _ = writer.join();
        drop(s);
        self.check();
        got
    }

    /// The server still serves a normal client, and every fuzz connection is gone.
    pub fn check(&self) {
        let ep = Endpoint::Unix(self.path.clone());
        let mut c = Client::connect(&ep, &ClientOptions::default()).expect("server answers");
        let n = c.size().min(4096);
        c.read(0, n).expect("server reads");
        drop(c);
        let server = self.server.as_ref().expect("running");
        let start = Instant::now();
        while server.connections() != 0 {
            assert!(
                start.elapsed() < RUN_DEADLINE,
                "{} connection(s) still open after the client left",
                server.connections()
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

impl Drop for ConnHarness {
    fn drop(&mut self) {
        if let Some(s) = self.server.take() {
            s.shutdown();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
