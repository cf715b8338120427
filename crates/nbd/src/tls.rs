//! TLS (`NBD_OPT_STARTTLS`) over a plain [`Socket`], with rustls (ring provider).
//!
//! # Who holds what
//!
//! After STARTTLS a connection's socket is a `Stream::Tls`: the plain socket plus an
//! `Arc<TlsSession>`, the one `rustls::Connection` of the connection under a short mutex.
//! The server's transmission phase splits the connection: the reader thread reads on one
//! handle, writers send on another (`conn/writer.rs`). Both handles share the session.
//!
//! - **Reader** ([`TlsStream`]'s `Read`): receives raw bytes from the socket into its own
//!   buffer *without holding any lock*, then takes the session lock to feed them to rustls
//!   (`read_tls`, `process_new_packets`) and to copy the decrypted bytes out, and drops it.
//!   It never sends: when decrypting queues TLS output (a KeyUpdate answer, an alert), it sets
//!   [`TlsSession::output_pending`] and the writer path sends it.
//! - **Writer** (whoever holds the writer token, `conn/writer.rs`): takes the session lock to
//!   encrypt a bounded batch of reply bytes and to move every queued TLS record (its own, and
//!   whatever the reader left: `output_pending`) into the writer's reusable ciphertext
//!   buffer, drops the lock, and sends that buffer with `sendmsg` outside it.
//!
//! # Invariants
//!
//! 1. Only the writer-token holder drains TLS output to the socket, so records leave in the
//!    order rustls made them (sequence numbers). The reader never sends in transmission.
//! 2. No thread ever blocks on the socket while holding the session lock: a blocked send would
//!    keep the reader from draining the client, whose own sends would then block: deadlock.
//!    The lock covers only memory work (decrypt, encrypt, copy).
//! 3. Ciphertext taken out of rustls belongs to the writer's output (`Output::tls_out`) until
//!    it is sent; a non-blocking writer that would block hands it to the flusher with the
//!    rest of the output, so nothing is lost or reordered.
//! 4. `output_pending` is set by the reader (under the session lock) after it queued output,
//!    and cleared by the writer under the session lock once it has drained everything; the
//!    writer looks at it under the connection lock before putting the token back, and the
//!    reader's next `commit` (after every receive) calls `ConnState::flush`, which counts the
//!    flag as work and takes the token if it is free: so either the reader writes, or the
//!    writer holding the token sees the flag before giving it back. Queued output never waits
//!    for a reply that may never come.
//!
//! Ordering of `output_pending`: it is only a hint to go and look; the TLS state it refers to
//! is under the session mutex, and the hand-over of the writer token is under the connection
//! mutex, so `Relaxed` loads and stores suffice (the mutexes order everything that matters).
//!
//! The handshake phase is one thread: `Write` on a `Stream::Tls` encrypts, drains and sends
//! in one go (the handshake and the blocking client use it); the server's transmission phase
//! never writes through it.
//!
//! # Allocation
//!
//! The reader's raw buffer and the writer's ciphertext buffer are reused. rustls's buffered
//! API itself allocates a vector per TLS record it seals (up to 16 KiB of payload each), one
//! per record it decrypts, and, for a vectored write, one small vector of slices per call
//! (per batch of replies, not per request): that is inside rustls. The writer packs replies
//! into full records by writing its segments vectored.
//!
//! The unbuffered API would not remove the send side: in rustls 0.23 every
//! `MessageEncrypter::encrypt` returns an owned record (a fresh `Vec`), which
//! `WriteTraffic::encrypt` then copies into the caller's buffer. rustls 0.24 (PR #3127, so
//! far only in a pre-release) encrypts into caller buffers; see docs/design.md, "TLS".
//!
//! # PSK
//!
//! rustls has no external pre-shared-key support (rustls issue #174 is open), so libnbd's
//! `tls-psk-file` is not offered: certificates only.

use std::fmt;
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use blkq_sync::atomic::{AtomicBool, Ordering};
use blkq_sync::{DynArc, Mutex};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::WebPkiClientVerifier;
use rustls::RootCertStore;
use x509_parser::asn1_rs::{Any, Oid, Tag, ToDer};
use x509_parser::prelude::{FromDer, X509Certificate};

use crate::socket::Socket;

/// Bytes of the reader's raw (ciphertext) receive buffer.
const RAW_BUF: usize = 64 << 10;
/// Plaintext bytes a writer encrypts per session-lock hold.
pub(crate) const ENCRYPT_BATCH: usize = 256 << 10;

/// When the server offers or requires TLS (nbdkit's `--tls`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TlsMode {
    /// No TLS: `NBD_OPT_STARTTLS` is refused.
    #[default]
    Off,
    /// TLS offered; plaintext clients are served too.
    On,
    /// TLS required: before STARTTLS every option but STARTTLS and ABORT answers
    /// `NBD_REP_ERR_TLS_REQD` (`NBD_OPT_EXPORT_NAME` closes the connection).
    Require,
}

impl std::str::FromStr for TlsMode {
    type Err = String;
    /// `off`, `on` or `require` (nbdkit's `--tls` words).
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "off" => Ok(Self::Off),
            "on" => Ok(Self::On),
            "require" => Ok(Self::Require),
            _ => Err(format!("unknown TLS mode {s:?} (off, on or require)")),
        }
    }
}

/// Errors of loading TLS credentials.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TlsError {
    /// A credential file could not be read or parsed.
    #[error("{path}: {why}")]
    File {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        why: String,
    },
    /// rustls refused the configuration.
    #[error("TLS configuration: {0}")]
    Config(String),
}

/// The server's TLS settings: the mode and the rustls configuration (certificates loaded).
#[derive(Debug, Clone)]
pub struct TlsSettings {
    /// Offer or require.
    pub mode: TlsMode,
    /// The rustls server configuration.
    pub config: DynArc<rustls::ServerConfig>,
}

fn provider() -> DynArc<rustls::crypto::CryptoProvider> {
    DynArc::new(rustls::crypto::ring::default_provider())
}

fn file_err(path: &Path, why: impl fmt::Display) -> TlsError {
    TlsError::File {
        path: path.to_path_buf(),
        why: why.to_string(),
    }
}

/// Reads every certificate of a PEM file (at least one).
pub fn load_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| file_err(path, e))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| file_err(path, e))?;
    if certs.is_empty() {
        return Err(file_err(path, "no certificate in the file"));
    }
    Ok(certs)
}

/// Reads a PEM private key (PKCS#8, PKCS#1 or SEC1).
pub fn load_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_file(path).map_err(|e| file_err(path, e))
}

/// A root store holding every certificate of `ca-cert.pem`.
pub fn load_roots(path: &Path) -> Result<RootCertStore, TlsError> {
    let mut roots = RootCertStore::empty();
    for c in load_certs(path)? {
        roots.add(c).map_err(|e| file_err(path, e))?;
    }
    Ok(roots)
}

impl TlsSettings {
    /// Loads `dir/server-cert.pem` and `dir/server-key.pem` (qemu's and nbdkit's layout);
    /// with `verify_peer`, clients must present a certificate signed by `dir/ca-cert.pem`.
    pub fn load(mode: TlsMode, dir: &Path, verify_peer: bool) -> Result<Self, TlsError> {
        let certs = load_certs(&dir.join("server-cert.pem"))?;
        let key = load_key(&dir.join("server-key.pem"))?;
        let builder = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| TlsError::Config(e.to_string()))?;
        let builder = if verify_peer {
            let roots = load_roots(&dir.join("ca-cert.pem"))?;
            let verifier =
                WebPkiClientVerifier::builder_with_provider(DynArc::new(roots), provider())
                    .build()
                    .map_err(|e| TlsError::Config(e.to_string()))?;
            builder.with_client_cert_verifier(verifier)
        } else {
            builder.with_no_client_auth()
        };
        let config = builder
            .with_single_cert(certs, key)
            .map_err(|e| TlsError::Config(format!("server certificate and key: {e}")))?;
        Ok(Self {
            mode,
            config: DynArc::new(config),
        })
    }
}

/// A client configuration trusting `dir/ca-cert.pem`, presenting `dir/client-cert.pem` and
/// `dir/client-key.pem` when both exist (for the blocking client and tests).
pub fn client_config(dir: &Path) -> Result<DynArc<rustls::ClientConfig>, TlsError> {
    let roots = load_roots(&dir.join("ca-cert.pem"))?;
    let builder = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Config(e.to_string()))?
        .with_root_certificates(roots);
    let (cert, key) = (dir.join("client-cert.pem"), dir.join("client-key.pem"));
    let config = if cert.exists() && key.exists() {
        builder
            .with_client_auth_cert(load_certs(&cert)?, load_key(&key)?)
            .map_err(|e| TlsError::Config(format!("client certificate and key: {e}")))?
    } else {
        builder.with_no_client_auth()
    };
    Ok(DynArc::new(config))
}

/// The TLS state a connection's handles share.
pub(crate) struct TlsSession {
    /// The rustls connection: held only for memory work, never across a socket call.
    pub(crate) conn: Mutex<rustls::Connection>,
    /// The reader queued TLS output (see the module docs, invariant 4). `Relaxed`: the
    /// mutexes order the state it points at.
    pub(crate) output_pending: AtomicBool,
    /// The verified client certificate's subject (server side, with a client certificate).
    subject: Option<String>,
}

impl TlsSession {
    /// Encrypts `plain` (as much as rustls takes) into the session's queue; the bytes taken.
    /// Call under [`TlsSession::conn`]'s lock, with [`drain`] after it.
    pub(crate) fn encrypt(conn: &mut rustls::Connection, plain: &[u8]) -> io::Result<usize> {
        conn.writer().write(plain)
    }

    /// Whether the reader left output for the writer.
    #[inline]
    pub(crate) fn pending(&self) -> bool {
        self.output_pending.load(Ordering::Relaxed)
    }
}

/// Moves every queued TLS record into `out` (appended); clears `output_pending`. Call under
/// the session lock.
pub(crate) fn drain(session: &TlsSession, conn: &mut rustls::Connection, out: &mut Vec<u8>) {
    while conn.wants_write() {
        // Writing into a Vec cannot fail.
        if conn.write_tls(out).is_err() {
            break;
        }
    }
    session.output_pending.store(false, Ordering::Relaxed);
}

/// One handle of a TLS connection: the plain socket and the shared session.
pub struct TlsStream {
    sock: Socket,
    session: DynArc<TlsSession>,
    /// Raw bytes received and not yet given to rustls: `raw[raw_pos..raw_len]`.
    raw: Vec<u8>,
    raw_pos: usize,
    raw_len: usize,
    /// Ciphertext to send (the `Write` path: handshake and client only).
    wbuf: Vec<u8>,
    /// Where the bytes received stand against TLS record boundaries.
    records: RecordEdge,
}

/// Where a stream of TLS records stands: at a boundary, or inside a record (since when).
///
/// The reader's timeouts ask "is the client in the middle of something?": on a plain socket
/// that is a partial request; under TLS a partial request may also hide in a partial record
/// that rustls holds and no plaintext shows. Walking the 5-byte record headers of what is
/// received answers it without asking rustls (which does not say).
#[derive(Debug, Default, Clone, Copy)]
struct RecordEdge {
    /// Header bytes seen of the next record (0 to 4; 5 completes it).
    header: [u8; 5],
    header_len: u8,
    /// Body bytes still to come of the current record.
    body_left: usize,
    /// When the current partial record's first byte came (`None`: at a boundary).
    since: Option<Instant>,
}

impl RecordEdge {
    /// Accounts `bytes` received now (the clock is read only when a record begins).
    fn feed(&mut self, mut bytes: &[u8]) {
        if !bytes.is_empty() && self.since.is_none() {
            self.since = Some(Instant::now());
        }
        while !bytes.is_empty() {
            if self.body_left > 0 {
                let k = self.body_left.min(bytes.len());
                self.body_left -= k;
                bytes = &bytes[k..];
            } else {
                self.header[self.header_len as usize] = bytes[0];
                self.header_len += 1;
                bytes = &bytes[1..];
                if self.header_len == 5 {
                    self.header_len = 0;
                    self.body_left =
                        usize::from(u16::from_be_bytes([self.header[3], self.header[4]]));
                }
            }
        }
        if self.header_len == 0 && self.body_left == 0 {
            self.since = None;
        }
    }
}

impl fmt::Debug for TlsStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TlsStream")
            .field("sock", &self.sock)
            .finish_non_exhaustive()
    }
}

impl TlsStream {
    fn new(sock: Socket, session: DynArc<TlsSession>) -> Self {
        Self {
            sock,
            session,
            raw: Vec::new(),
            raw_pos: 0,
            raw_len: 0,
            wbuf: Vec::new(),
            records: RecordEdge::default(),
        }
    }

    /// When the partial TLS record now received began (`None`: the bytes received end at a
    /// record boundary). A client in the middle of a record is in the middle of something.
    pub(crate) fn partial_record_since(&self) -> Option<Instant> {
        self.records.since
    }

    /// The plain socket underneath.
    pub(crate) fn sock(&self) -> &Socket {
        &self.sock
    }

    /// The shared session.
    pub(crate) fn session(&self) -> &DynArc<TlsSession> {
        &self.session
    }

    /// The verified client certificate's subject.
    pub(crate) fn subject(&self) -> Option<&str> {
        self.session.subject.as_deref()
    }

    pub(crate) fn try_clone(&self) -> io::Result<Self> {
        Ok(Self::new(self.sock.try_clone()?, self.session.clone()))
    }

    /// Queues a TLS 1.3 KeyUpdate (with update_requested).
    pub(crate) fn refresh_keys(&self) -> io::Result<()> {
        self.session
            .conn
            .lock()
            .refresh_traffic_keys()
            .map_err(tls_io_err)
    }

    /// Sends `close_notify` (best effort, blocking: only where no writer can be active).
    pub(crate) fn close_notify(&mut self) {
        let mut out = std::mem::take(&mut self.wbuf);
        out.clear();
        {
            let mut conn = self.session.conn.lock();
            conn.send_close_notify();
            drain(&self.session, &mut conn, &mut out);
        }
        let _ = self.sock.write_all(&out);
        self.wbuf = out;
    }
}

/// An `io::Error` for a rustls error.
fn tls_io_err(e: rustls::Error) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("TLS: {e}"))
}

impl Read for TlsStream {
    /// Plaintext, as soon as a whole record gives some. A socket read timeout
    /// (`SO_RCVTIMEO`) bounds the whole call, not each receive: when bytes keep coming but no
    /// record completes for that long (a client trickling a record), the call fails with
    /// `WouldBlock`, as a plain socket's read would, so the caller's deadlines and timeouts
    /// apply. What was received stays with rustls for the next call.
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        if self.raw.is_empty() {
            self.raw = vec![0; RAW_BUF];
        }
        // When this call must give up without plaintext: set on the first receive that gave
        // none (the usual call returns before it, and reads no clock), one socket timeout on.
        let mut give_up: Option<Option<Instant>> = None;
        loop {
            // Under the session lock: take out plaintext, feed what was received, decrypt.
            let mut got = 0;
            let mut end = false;
            let mut err = None;
            {
                let mut conn = self.session.conn.lock();
                loop {
                    match conn.reader().read(&mut buf[got..]) {
                        // A clean close_notify (the caller's buffer is not empty here).
                        Ok(0) => {
                            end = true;
                            break;
                        }
                        Ok(n) => got += n,
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                        // EOF without close_notify: the end of the stream all the same.
                        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
                            end = true;
                            break;
                        }
                        Err(e) => {
                            err = Some(e);
                            break;
                        }
                    }
                    if got == buf.len() || self.raw_pos == self.raw_len {
                        break;
                    }
                    let mut src = &self.raw[self.raw_pos..self.raw_len];
                    match conn.read_tls(&mut src) {
                        Ok(n) => self.raw_pos += n,
                        Err(e) => {
                            err = Some(e);
                            break;
                        }
                    }
                    if let Err(e) = conn.process_new_packets() {
                        // The alert rustls queued goes out through the writer path.
                        err = Some(tls_io_err(e));
                        break;
                    }
                }
                if conn.wants_write() {
                    self.session.output_pending.store(true, Ordering::Relaxed);
                }
            }
            if got > 0 {
                return Ok(got);
            }
            if end {
                return Ok(0);
            }
            if let Some(e) = err {
                return Err(e);
            }
            // Everything received went to rustls: receive more, outside any lock.
            if self.raw_len > 0 {
                let limit = *give_up.get_or_insert_with(|| {
                    let t = self.sock.read_timeout().ok().flatten();
                    t.map(|t| Instant::now() + t)
                });
                if limit.is_some_and(|at| Instant::now() >= at) {
                    self.raw_pos = 0;
                    self.raw_len = 0;
                    return Err(io::ErrorKind::WouldBlock.into());
                }
            }
            self.raw_pos = 0;
            self.raw_len = 0;
            let n = self.sock.read(&mut self.raw)?;
            if n == 0 {
                // Tell rustls about the EOF; the next pass reads the end of the stream.
                let _ = self.session.conn.lock().read_tls(&mut io::empty());
            }
            self.records.feed(&self.raw[..n]);
            self.raw_len = n;
        }
    }
}

impl Write for TlsStream {
    /// Encrypts `buf`, then sends every queued record (blocking). The handshake and the
    /// client write this way; the server's transmission phase sends through its writer.
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let mut out = std::mem::take(&mut self.wbuf);
        out.clear();
        let n = {
            let mut conn = self.session.conn.lock();
            let n = TlsSession::encrypt(&mut conn, buf);
            drain(&self.session, &mut conn, &mut out);
            n
        };
        let sent = self.sock.write_all(&out);
        self.wbuf = out;
        sent?;
        n
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Runs the TLS handshake of `conn` over `io` (a plain socket, under the caller's deadline),
/// then makes `sock`, a handle of the same socket, speak TLS.
pub(crate) fn handshake(
    io: impl Read + Write,
    sock: Socket,
    mut conn: rustls::Connection,
) -> io::Result<TlsStream> {
    let mut io = Timed {
        io,
        records: RecordEdge::default(),
    };
    while conn.is_handshaking() {
        while conn.wants_write() {
            conn.write_tls(&mut io)?;
        }
        if !conn.is_handshaking() {
            break;
        }
        if conn.read_tls(&mut io)? == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        conn.process_new_packets().map_err(|e| {
            // Tell the peer why (best effort), then fail.
            let _ = conn.write_tls(&mut io);
            tls_io_err(e)
        })?;
    }
    // Flush anything left (session tickets).
    while conn.wants_write() {
        conn.write_tls(&mut io)?;
    }
    let records = io.records;
    conn.set_buffer_limit(None);
    let subject = match &conn {
        rustls::Connection::Server(s) => s
            .peer_certificates()
            .and_then(|c| c.first())
            .and_then(|c| subject_of(c.as_ref())),
        rustls::Connection::Client(_) => None,
    };
    let session = DynArc::new(TlsSession {
        conn: Mutex::new(conn),
        output_pending: AtomicBool::new(false),
        subject,
    });
    let mut tls = TlsStream::new(sock, session);
    tls.records = records;
    Ok(tls)
}

/// The socket during a TLS handshake (under the caller's deadline: see [`handshake`]), what it
/// receives followed for record boundaries.
struct Timed<IO> {
    io: IO,
    /// Record boundaries of every byte received since TLS began: rustls may read past the
    /// handshake, and the stream's tracker must start where this one ends.
    records: RecordEdge,
}

impl<IO: Read> Read for Timed<IO> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.io.read(buf)?;
        self.records.feed(&buf[..n]);
        Ok(n)
    }
}

impl<IO: Write> Write for Timed<IO> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.io.write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// The server side of a TLS connection under `config`, before its handshake.
pub(crate) fn server_connection(
    config: &DynArc<rustls::ServerConfig>,
) -> io::Result<rustls::Connection> {
    let conn = rustls::ServerConnection::new(config.clone()).map_err(tls_io_err)?;
    Ok(rustls::Connection::Server(conn))
}

/// The client side of a TLS connection under `config` to `server_name`, before its
/// handshake.
pub(crate) fn client_connection(
    config: &DynArc<rustls::ClientConfig>,
    server_name: &str,
) -> io::Result<rustls::Connection> {
    let name = ServerName::try_from(server_name.to_string())
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    let conn = rustls::ClientConnection::new(config.clone(), name).map_err(tls_io_err)?;
    Ok(rustls::Connection::Client(conn))
}

// --- The subject of a certificate, RFC 4514 style ------------------------------------------

/// The RFC 4514 short name of an attribute type (its OID's DER contents), or its dotted form.
fn attr_name(oid: &Oid<'_>) -> String {
    let short = match oid.as_bytes() {
        [0x55, 0x04, 0x03] => "CN",
        [0x55, 0x04, 0x06] => "C",
        [0x55, 0x04, 0x07] => "L",
        [0x55, 0x04, 0x08] => "ST",
        [0x55, 0x04, 0x0a] => "O",
        [0x55, 0x04, 0x0b] => "OU",
        [0x55, 0x04, 0x09] => "STREET",
        [0x09, 0x92, 0x26, 0x89, 0x93, 0xf2, 0x2c, 0x64, 0x01, 0x19] => "DC",
        [0x09, 0x92, 0x26, 0x89, 0x93, 0xf2, 0x2c, 0x64, 0x01, 0x01] => "UID",
        _ => return oid.to_id_string(),
    };
    short.into()
}

/// An attribute value as RFC 4514 writes it: strings escaped, anything else `#` and the hex
/// of its DER encoding.
fn attr_value(value: &Any<'_>) -> Option<String> {
    let text = match value.tag() {
        // TeletexString is read as UTF-8 (in practice: ASCII), as the old hand walk did.
        Tag::Utf8String | Tag::PrintableString | Tag::Ia5String | Tag::T61String => {
            std::str::from_utf8(value.data).ok()
        }
        _ => None,
    };
    Some(match text {
        Some(s) => {
            let mut out = String::with_capacity(s.len());
            let last = s.chars().count().saturating_sub(1);
            for (i, c) in s.chars().enumerate() {
                let special = matches!(c, '"' | '+' | ',' | ';' | '<' | '>' | '\\')
                    || (i == 0 && matches!(c, ' ' | '#'))
                    || (i == last && c == ' ');
                if special {
                    out.push('\\');
                }
                out.push(c);
            }
            out
        }
        None => {
            let mut out = String::from("#");
            for b in value.to_der_vec().ok()? {
                out.push_str(&format!("{b:02x}"));
            }
            out
        }
    })
}

/// The subject distinguished name of a DER certificate, RFC 4514 style (`CN=client1`, last
/// RDN first, `,` between RDNs, `+` inside one); `None` if x509-parser cannot parse the
/// certificate.
///
/// x509-parser walks the DER; the text is made here because its `Display` of a name is not
/// RFC 4514 (first RDN first, `", "` between RDNs, values unescaped), and the access rules
/// (`allow_subjects`) are written in RFC 4514's form.
pub fn subject_of(cert: &[u8]) -> Option<String> {
    let (_, cert) = X509Certificate::from_der(cert).ok()?;
    let mut rdns = Vec::new();
    for rdn in cert.subject().iter_rdn() {
        let mut atvs = Vec::new();
        for atv in rdn.iter() {
            atvs.push(format!(
                "{}={}",
                attr_name(atv.attr_type()),
                attr_value(atv.attr_value())?
            ));
        }
        rdns.push(atvs.join("+"));
    }
    rdns.reverse();
    Some(rdns.join(","))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subject_of_an_rcgen_certificate() {
        let mut p = rcgen::CertificateParams::default();
        p.distinguished_name = rcgen::DistinguishedName::new();
        p.distinguished_name
            .push(rcgen::DnType::OrganizationName, "Example, Inc.");
        p.distinguished_name
            .push(rcgen::DnType::CommonName, "client1");
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = p.self_signed(&key).unwrap();
        assert_eq!(
            subject_of(cert.der()).as_deref(),
            Some("CN=client1,O=Example\\, Inc.")
        );
    }

    #[test]
    fn subject_of_garbage_is_none() {
        assert_eq!(subject_of(&[]), None);
        assert_eq!(subject_of(&[0x30, 0x82, 0xff]), None);
        assert_eq!(subject_of(&[0x30, 0x03, 0x30, 0x01, 0x02]), None);
    }

    #[test]
    fn attribute_names_short_or_dotted() {
        let oid = |b: &'static [u8]| Oid::new(b.into());
        assert_eq!(attr_name(&oid(&[0x55, 0x04, 0x2a])), "2.5.4.42");
        assert_eq!(attr_name(&oid(&[0x55, 0x04, 0x03])), "CN");
    }

    #[test]
    fn subject_with_several_rdns_and_special_characters() {
        let mut p = rcgen::CertificateParams::default();
        p.distinguished_name = rcgen::DistinguishedName::new();
        p.distinguished_name.push(rcgen::DnType::CountryName, "FR");
        p.distinguished_name
            .push(rcgen::DnType::OrganizationalUnitName, " ops+backup ");
        p.distinguished_name
            .push(rcgen::DnType::CommonName, "#host;1");
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = p.self_signed(&key).unwrap();
        assert_eq!(
            subject_of(cert.der()).as_deref(),
            Some("CN=\\#host\\;1,OU=\\ ops\\+backup\\ ,C=FR")
        );
    }

    proptest::proptest! {
        /// Any bytes: an answer or `None`, never a panic.
        #[test]
        fn subject_of_arbitrary_bytes_never_panics(
            bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..512)
        ) {
            let _ = subject_of(&bytes);
        }

        /// A real certificate with any one byte changed: never a panic.
        #[test]
        fn subject_of_a_damaged_certificate_never_panics(at in 0usize..4096, to in 0u8..=255) {
            let key = rcgen::KeyPair::generate().unwrap();
            let cert = rcgen::CertificateParams::new(vec!["x".into()])
                .unwrap()
                .self_signed(&key)
                .unwrap();
            let mut der = cert.der().to_vec();
            let at = at % der.len();
            der[at] = to;
            let _ = subject_of(&der);
        }
    }
}
