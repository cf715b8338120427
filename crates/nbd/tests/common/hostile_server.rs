//! A scriptable hostile NBD server: it listens on a Unix socket and runs the test's script on
//! each connection, with a [`Peer`] that speaks the fixed newstyle handshake and structured
//! replies honestly when told to ([`Peer::negotiate`], [`Peer::serve`]) and sends whatever the
//! script writes otherwise: endless option replies, trickled bytes ([`Peer::trickle`]),
//! overlapping chunks, ... It is the other end of the `nbd:` device's tests against a server
//! it cannot trust. Bytes are built by hand (big-endian, as the protocol has them) so that a
//! script can send what no codec would encode.

use std::io::{self, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use nbd::codec::proto::*;
use nbd::remote::RemoteSpec;

/// The export's size the honest parts announce.
pub const SIZE: u64 = 32 << 20;
/// Transmission flags the honest parts announce (flush, FUA, trim, write zeroes).
pub const FLAGS: u16 = NBD_FLAG_HAS_FLAGS
    | NBD_FLAG_SEND_FLUSH
    | NBD_FLAG_SEND_FUA
    | NBD_FLAG_SEND_TRIM
    | NBD_FLAG_SEND_WRITE_ZEROES;
/// The `base:allocation` context id the honest handshake gives.
pub const META_ID: u32 = 1;

/// A script: run on connection number `k` (0 for the first); its error ends the connection
/// quietly (the client going away is an error here).
pub type Script = dyn Fn(usize, &mut Peer) -> io::Result<()> + Send + Sync;

/// The server: a Unix socket in a temporary folder; every connection runs the script on a
/// thread of its own.
pub struct HostileServer {
    path: PathBuf,
    _dir: tempfile::TempDir,
    stop: Arc<AtomicBool>,
    accepted: Arc<AtomicUsize>,
}

impl HostileServer {
    /// Listens, and runs `script` on every connection.
    pub fn start(
        script: impl Fn(usize, &mut Peer) -> io::Result<()> + Send + Sync + 'static,
    ) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("hostile.sock");
        let l = UnixListener::bind(&path).unwrap();
        l.set_nonblocking(true).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let accepted = Arc::new(AtomicUsize::new(0));
        let script: Arc<Script> = Arc::new(script);
        let (st, acc) = (stop.clone(), accepted.clone());
        thread::spawn(move || {
            while !st.load(Ordering::SeqCst) {
                match l.accept() {
                    Ok((s, _)) => {
                        let k = acc.fetch_add(1, Ordering::SeqCst);
                        let _ = s.set_nonblocking(false);
                        let (script, st) = (script.clone(), st.clone());
                        thread::spawn(move || {
                            let mut p = Peer {
                                s,
                                trickle: None,
                                sent: 0,
                                stop: st,
                            };
                            let _ = script(k, &mut p);
                        });
                    }
                    Err(_) => thread::sleep(Duration::from_millis(5)),
                }
            }
        });
        Self {
            path,
            _dir: dir,
            stop,
            accepted,
        }
    }

    /// The socket's path.
    pub fn path(&self) -> &std::path::Path {
        &self.path
    }

    /// The `nbd+unix:` URI of the default export, with the device's options `opts`.
    pub fn uri(&self, opts: &str) -> String {
        format!("nbd+unix:///?socket={}{opts}", self.path.display())
    }

    /// A spec with a request timeout and a reconnect deadline shorter than the URI's whole
    /// seconds allow (tests of deadlines run in a second or two).
    pub fn spec(&self, timeout: Duration, reconnect_deadline: Duration) -> RemoteSpec {
        let mut s = RemoteSpec::parse(&self.uri("")).unwrap();
        s.timeout = timeout;
        s.reconnect_deadline = reconnect_deadline;
        s
    }

    /// Connections accepted so far.
    pub fn accepted(&self) -> usize {
        self.accepted.load(Ordering::SeqCst)
    }
}

impl Drop for HostileServer {
    /// Stops accepting; scripts still running stop at their next send (trickling ones
    /// included) or when the client goes away.
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

/// One request the client sent.
#[derive(Debug, Clone)]
pub struct Req {
    pub flags: u16,
    pub cmd: u16,
    pub cookie: u64,
    pub offset: u64,
    pub len: u32,
    /// A write's data.
    pub data: Vec<u8>,
}

/// The server's end of one connection.
pub struct Peer {
    s: UnixStream,
    trickle: Option<Duration>,
    /// Bytes sent so far.
    pub sent: u64,
    stop: Arc<AtomicBool>,
}

impl Peer {
    /// From now on every send goes out one byte per `every` (`None`: at once).
    pub fn trickle(&mut self, every: Option<Duration>) {
        self.trickle = every;
    }

    /// Sends `b` (trickled if so told). Fails once the server is dropped.
    pub fn send(&mut self, b: &[u8]) -> io::Result<()> {
        if self.stop.load(Ordering::SeqCst) {
            return Err(io::ErrorKind::BrokenPipe.into());
        }
        match self.trickle {
            None => self.s.write_all(b)?,
            Some(every) => {
                for x in b {
                    if self.stop.load(Ordering::SeqCst) {
                        return Err(io::ErrorKind::BrokenPipe.into());
                    }
                    thread::sleep(every);
                    self.s.write_all(std::slice::from_ref(x))?;
                    self.sent += 1;
                }
                return Ok(());
            }
        }
        self.sent += b.len() as u64;
        Ok(())
    }

    fn read_n(&mut self, n: usize) -> io::Result<Vec<u8>> {
        let mut v = vec![0u8; n];
        self.s.read_exact(&mut v)?;
        Ok(v)
    }

    /// Sends the fixed newstyle greeting (no zeroes offered) and reads the client's flags.
    pub fn greet(&mut self) -> io::Result<()> {
        let mut g = Vec::new();
        g.extend_from_slice(&NBDMAGIC.to_be_bytes());
        g.extend_from_slice(&IHAVEOPT.to_be_bytes());
        g.extend_from_slice(&(NBD_FLAG_FIXED_NEWSTYLE | NBD_FLAG_NO_ZEROES).to_be_bytes());
        self.send(&g)?;
        self.read_n(4).map(drop)
    }

    /// Reads one option: (option, data).
    pub fn option(&mut self) -> io::Result<(u32, Vec<u8>)> {
        let h = self.read_n(16)?;
        let opt = u32::from_be_bytes(h[8..12].try_into().unwrap());
        let len = u32::from_be_bytes(h[12..16].try_into().unwrap());
        if len > 64 << 10 {
            return Err(io::Error::other("an option too long"));
        }
        Ok((opt, self.read_n(len as usize)?))
    }

    /// Sends an option reply.
    pub fn reply(&mut self, option: u32, reply_type: u32, data: &[u8]) -> io::Result<()> {
        let mut b = Vec::with_capacity(20 + data.len());
        b.extend_from_slice(&NBD_REP_MAGIC.to_be_bytes());
        b.extend_from_slice(&option.to_be_bytes());
        b.extend_from_slice(&reply_type.to_be_bytes());
        b.extend_from_slice(&(data.len() as u32).to_be_bytes());
        b.extend_from_slice(data);
        self.send(&b)
    }

    /// The `NBD_REP_INFO` data of `NBD_INFO_EXPORT`.
    pub fn info_export(size: u64, flags: u16) -> Vec<u8> {
        let mut d = NBD_INFO_EXPORT.to_be_bytes().to_vec();
        d.extend_from_slice(&size.to_be_bytes());
        d.extend_from_slice(&flags.to_be_bytes());
        d
    }

    /// Answers options honestly (structured replies, `base:allocation` as [`META_ID`], the
    /// export of [`SIZE`] bytes with [`FLAGS`]) until the client's `NBD_OPT_GO` is answered:
    /// the transmission phase begins, structured.
    pub fn negotiate(&mut self) -> io::Result<()> {
        self.negotiate_with(|p, opt| p.go_replies(opt))
    }

    /// As [`Peer::negotiate`], with `go` answering `NBD_OPT_GO` (another size, other block
    /// sizes, a flood of replies...).
    pub fn negotiate_with(
        &mut self,
        go: impl FnOnce(&mut Peer, u32) -> io::Result<()>,
    ) -> io::Result<()> {
        self.greet()?;
        loop {
            let (opt, data) = self.option()?;
            match opt {
                NBD_OPT_STRUCTURED_REPLY => self.reply(opt, NBD_REP_ACK, &[])?,
                NBD_OPT_SET_META_CONTEXT => {
                    if data.windows(15).any(|w| w == b"base:allocation") {
                        let mut d = META_ID.to_be_bytes().to_vec();
                        d.extend_from_slice(b"base:allocation");
                        self.reply(opt, NBD_REP_META_CONTEXT, &d)?;
                    }
                    self.reply(opt, NBD_REP_ACK, &[])?;
                }
                NBD_OPT_GO => return go(self, opt),
                NBD_OPT_ABORT => return Err(io::Error::other("the client aborted")),
                _ => self.reply(opt, NBD_REP_ERR_UNSUP, &[])?,
            }
        }
    }

    /// The honest answer to `NBD_OPT_GO` (or `INFO`): the export, block sizes, ACK.
    pub fn go_replies(&mut self, opt: u32) -> io::Result<()> {
        self.reply(opt, NBD_REP_INFO, &Self::info_export(SIZE, FLAGS))?;
        let mut bs = NBD_INFO_BLOCK_SIZE.to_be_bytes().to_vec();
        for v in [512u32, 4096, 32 << 20] {
            bs.extend_from_slice(&v.to_be_bytes());
        }
        self.reply(opt, NBD_REP_INFO, &bs)?;
        self.reply(opt, NBD_REP_ACK, &[])
    }

    /// Reads one request (compact header), with a write's data.
    pub fn request(&mut self) -> io::Result<Req> {
        let h = self.read_n(COMPACT_REQUEST_LEN)?;
        let magic = u32::from_be_bytes(h[0..4].try_into().unwrap());
        if magic != NBD_REQUEST_MAGIC {
            return Err(io::Error::other(format!("request magic {magic:#x}")));
        }
        let flags = u16::from_be_bytes(h[4..6].try_into().unwrap());
        let cmd = u16::from_be_bytes(h[6..8].try_into().unwrap());
        let cookie = u64::from_be_bytes(h[8..16].try_into().unwrap());
        let offset = u64::from_be_bytes(h[16..24].try_into().unwrap());
        let len = u32::from_be_bytes(h[24..28].try_into().unwrap());
        let data = if cmd == NBD_CMD_WRITE {
            self.read_n(len as usize)?
        } else {
            Vec::new()
        };
        Ok(Req {
            flags,
            cmd,
            cookie,
            offset,
            len,
            data,
        })
    }

    /// A structured reply chunk.
    pub fn chunk(&mut self, flags: u16, ty: u16, cookie: u64, payload: &[u8]) -> io::Result<()> {
        self.send(&Self::chunk_bytes(flags, ty, cookie, payload))
    }

    /// The bytes of a structured reply chunk.
    pub fn chunk_bytes(flags: u16, ty: u16, cookie: u64, payload: &[u8]) -> Vec<u8> {
        let mut b = Vec::with_capacity(20 + payload.len());
        b.extend_from_slice(&NBD_STRUCTURED_REPLY_MAGIC.to_be_bytes());
        b.extend_from_slice(&flags.to_be_bytes());
        b.extend_from_slice(&ty.to_be_bytes());
        b.extend_from_slice(&cookie.to_be_bytes());
        b.extend_from_slice(&(payload.len() as u32).to_be_bytes());
        b.extend_from_slice(payload);
        b
    }

    /// An `OFFSET_DATA` chunk (`done`: the reply's last).
    pub fn data(&mut self, cookie: u64, offset: u64, data: &[u8], done: bool) -> io::Result<()> {
        let mut p = offset.to_be_bytes().to_vec();
        p.extend_from_slice(data);
        let flags = if done { NBD_REPLY_FLAG_DONE } else { 0 };
        self.chunk(flags, NBD_REPLY_TYPE_OFFSET_DATA, cookie, &p)
    }

    /// A successful reply without data (the final `NONE` chunk).
    pub fn done(&mut self, cookie: u64) -> io::Result<()> {
        self.chunk(NBD_REPLY_FLAG_DONE, NBD_REPLY_TYPE_NONE, cookie, &[])
    }

    /// An error chunk (the reply's last) with `error` and `message`.
    pub fn error(&mut self, cookie: u64, error: u32, message: &[u8]) -> io::Result<()> {
        let mut p = error.to_be_bytes().to_vec();
        p.extend_from_slice(&(message.len() as u16).to_be_bytes());
        p.extend_from_slice(message);
        self.chunk(NBD_REPLY_FLAG_DONE, NBD_REPLY_TYPE_ERROR, cookie, &p)
    }

    /// Serves `disk` honestly until the client disconnects ([`Peer::answer`]).
    pub fn serve(&mut self, disk: &mut [u8]) -> io::Result<()> {
        loop {
            let r = self.request()?;
            if r.cmd == NBD_CMD_DISC {
                return Ok(());
            }
            self.answer(&r, disk)?;
        }
    }

    /// Answers `r` honestly on `disk`: a read (one data chunk), a write, a flush, a trim or
    /// zeroes; anything else `EINVAL`.
    pub fn answer(&mut self, r: &Req, disk: &mut [u8]) -> io::Result<()> {
        let range = r.offset as usize..r.offset as usize + r.len as usize;
        match r.cmd {
            NBD_CMD_READ => {
                let d = disk[range].to_vec();
                self.data(r.cookie, r.offset, &d, true)
            }
            NBD_CMD_WRITE => {
                disk[range].copy_from_slice(&r.data);
                self.done(r.cookie)
            }
            NBD_CMD_TRIM | NBD_CMD_WRITE_ZEROES => {
                disk[range].fill(0);
                self.done(r.cookie)
            }
            NBD_CMD_FLUSH => self.done(r.cookie),
            _ => self.error(r.cookie, NBD_EINVAL, &[]),
        }
    }

    /// Reads nothing more, ever: the client's sends fill the socket. Returns once the server
    /// is dropped.
    pub fn swallow_never(&mut self) -> io::Result<()> {
        while !self.stop.load(Ordering::SeqCst) {
            thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }

    /// Reads and drops everything until the client closes (a server that answers nothing).
    pub fn swallow(&mut self) -> io::Result<()> {
        let mut b = [0u8; 4096];
        while self.s.read(&mut b)? > 0 {}
        Ok(())
    }
}
