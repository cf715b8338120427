//! Option haggling, server side: fixed newstyle with `NO_ZEROES`.
//!
//! Blocking and simple: one option is read whole (header, then its data), answered with one
//! `write_all`, and the next is read. The client must wait for the final reply of each option,
//! so nothing is ever read past the option that ends the handshake.
//!
//! Bounds (see `Tuning`): the whole handshake must end before a deadline (every read and write
//! gets what is left of it as its socket timeout, so a silent client and one that drips a byte
//! at a time both run out of time); a client may send at most `max_options` options and
//! `max_option_bytes` bytes of option data (skipped over-long options included); each option's
//! data is at most [`DEFAULT_MAX_OPTION_LEN`] bytes (longer ones, up to
//! [`MAX_SKIPPED_OPTION`], are skipped with `NBD_REP_ERR_TOO_BIG`).

use std::io::{self, Read, Write};
use std::time::{Duration, Instant};

use tracing::{debug, warn};

use blkq_sync::DynArc as Arc;

use super::access::{Identity, Refusal};
use super::shared::{ExportState, ServerState};
use crate::stream::Stream;
use crate::tls::TlsMode;
use nbd_proto::handshake::{
    decode_client_flags, decode_option_header, encode_export_name_reply, encode_option_reply,
    encode_server_greeting, parse_option, BlockSize, ClientOption, ExportInfo, ExportRequest, Info,
    MetaContextRequest, OptionReply, DEFAULT_MAX_OPTION_LEN,
};
use nbd_proto::proto::{
    ClientFlags, HandshakeFlags, InfoType, OptionCode, OptionError, TransmissionFlags,
    TransmissionMode, OPTION_HEADER_LEN,
};
use nbd_proto::{Decoded, Error};

/// The id of `base:allocation`.
pub(crate) const BASE_ALLOCATION_ID: u32 = 1;
/// Its name.
pub(crate) const BASE_ALLOCATION: &str = "base:allocation";
/// The id of the first dirty bitmap selected; the `i`-th (in the order of the SET's
/// queries) is `FIRST_BITMAP_ID + i`, so ids are distinct on a connection.
pub(crate) const FIRST_BITMAP_ID: u32 = 2;
/// The prefix of a dirty bitmap's context (qemu's `docs/interop/nbd.txt`): the bitmap's name
/// follows. Alone, as a LIST query, it lists every bitmap; so does `qemu:`.
pub(crate) const DIRTY_BITMAP: &str = "qemu:dirty-bitmap:";
/// The longest context name the protocol allows.
const MAX_CONTEXT_NAME: usize = 4096;
/// An option announcing more data than this is not skipped: the connection is closed.
const MAX_SKIPPED_OPTION: u32 = 16 << 20;

/// The metadata contexts a `NBD_OPT_SET_META_CONTEXT` selected.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Selection {
    /// `base:allocation`.
    pub(crate) base_allocation: bool,
    /// Dirty bitmaps by name (the context `qemu:dirty-bitmap:NAME` has id
    /// [`FIRST_BITMAP_ID`] + its index).
    pub(crate) bitmaps: Vec<String>,
}

impl Selection {
    /// Whether any context was selected (`NBD_CMD_BLOCK_STATUS` allowed).
    pub(crate) fn any(&self) -> bool {
        self.base_allocation || !self.bitmaps.is_empty()
    }
}

/// What the handshake agreed on.
#[derive(Debug, Clone)]
pub(crate) struct Negotiated {
    /// The export (held for the connection's life: the table may lose it meanwhile).
    pub(crate) export: Arc<ExportState>,
    /// Simple, structured or extended.
    pub(crate) mode: TransmissionMode,
    /// The metadata contexts selected for this export (`NBD_CMD_BLOCK_STATUS` is allowed
    /// when any is).
    pub(crate) contexts: Selection,
    /// The option that entered transmission: `"go"` or `"export-name"`.
    pub(crate) via: &'static str,
}

/// Why a handshake ended without entering transmission.
#[derive(Debug)]
pub(crate) enum Ended {
    /// The client aborted (`NBD_OPT_ABORT`) or hung up between options.
    Client(&'static str),
    /// The handshake deadline passed.
    Timeout,
    /// The client went over a handshake bound (options, option bytes): closed, reason logged.
    Limit(String),
    /// The client asked for an export with `NBD_OPT_EXPORT_NAME` that its access rules refuse
    /// it (that option cannot answer an error): closed; the handshake has logged the rule.
    Refused {
        /// The export asked for.
        export: String,
        /// The rule that refused it.
        refusal: Refusal,
    },
    /// The client broke the protocol: the connection is closed, and the reason logged.
    Protocol(String),
    /// The socket failed.
    Io(io::Error),
}

impl From<io::Error> for Ended {
    fn from(e: io::Error) -> Self {
        match e.kind() {
            io::ErrorKind::UnexpectedEof => Ended::Client("hung up during the handshake"),
            io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock => Ended::Timeout,
            _ => Ended::Io(e),
        }
    }
}

/// The transmission flags of export `state` in `mode`.
pub(crate) fn transmission_flags(state: &ExportState, mode: TransmissionMode) -> TransmissionFlags {
    let mut flags = TransmissionFlags::HAS_FLAGS
        | TransmissionFlags::SEND_FLUSH
        | TransmissionFlags::SEND_FUA
        | TransmissionFlags::SEND_TRIM
        | TransmissionFlags::SEND_WRITE_ZEROES
        | TransmissionFlags::SEND_FAST_ZERO
        | TransmissionFlags::SEND_CACHE
        | TransmissionFlags::CAN_MULTI_CONN;
    if mode.chunked_replies() {
        // DF only means something with chunked replies, and must be clear without them.
        flags |= TransmissionFlags::SEND_DF;
    }
    if state.export.read_only {
        flags |= TransmissionFlags::READ_ONLY;
    }
    flags
}

/// The block size constraints advertised for export `state`.
pub(crate) fn block_size(state: &ExportState, max_block: u32) -> BlockSize {
    let min = state.min_block;
    BlockSize {
        min,
        preferred: min.max(4096),
        max: max_block / min * min,
    }
}

/// The socket during the handshake, with its deadline: each read and write first sets what is
/// left of it as the socket's timeout (`SO_RCVTIMEO` / `SO_SNDTIMEO`); a timeout comes back
/// as `ErrorKind::TimedOut`.
pub(crate) struct Deadlined<'a> {
    stream: &'a mut Stream,
    deadline: Instant,
}

impl<'a> Deadlined<'a> {
    /// `stream`, which must finish the handshake before `deadline`.
    pub(crate) fn new(stream: &'a mut Stream, deadline: Instant) -> Self {
        Self { stream, deadline }
    }

    /// Whether the stream already speaks TLS.
    fn is_tls(&self) -> bool {
        self.stream.is_tls()
    }

    /// The server side of STARTTLS (the ACK already sent), within the deadline.
    fn start_tls(&mut self, config: &blkq_sync::DynArc<rustls::ServerConfig>) -> io::Result<()> {
        self.left()?;
        self.stream.accept_tls(config, self.deadline)
    }

    /// What is left of the deadline, or `TimedOut`.
    fn left(&self) -> io::Result<Duration> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::ErrorKind::TimedOut.into());
        }
        Ok(left)
    }
}

/// A socket timeout reads as `WouldBlock` (`EAGAIN`): call it what it is.
fn timed_out(e: io::Error) -> io::Error {
    if e.kind() == io::ErrorKind::WouldBlock {
        io::ErrorKind::TimedOut.into()
    } else {
        e
    }
}

impl Read for Deadlined<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.stream.set_read_timeout(Some(self.left()?))?;
        self.stream.read(buf).map_err(timed_out)
    }
}

impl Write for Deadlined<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.stream.set_write_timeout(Some(self.left()?))?;
        self.stream.write(buf).map_err(timed_out)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

struct Haggler<'a, 'b> {
    stream: &'a mut Deadlined<'b>,
    shared: &'a ServerState,
    /// The connection's id in the server's registry.
    conn: u64,
    mode: TransmissionMode,
    /// The export named by the last `NBD_OPT_SET_META_CONTEXT`, and what it selected.
    meta: Option<(String, Selection)>,
    no_zeroes: bool,
    out: Vec<u8>,
    data: Vec<u8>,
    /// Options received so far, and their data bytes (bounded by `Tuning::max_options` and
    /// `Tuning::max_option_bytes`).
    options: u32,
    option_bytes: u64,
    /// An option was refused with `NBD_REP_ERR_TLS_REQD` (logged and counted once).
    tls_refused: bool,
}

/// Runs the handshake on fresh connection `conn`. An export chosen is recorded in the
/// registry ([`ServerState::attach`]) before the final reply leaves: from the moment the client may
/// believe it is attached, the acceptor never evicts it as a handshake.
pub(crate) fn negotiate(
    stream: &mut Deadlined<'_>,
    shared: &ServerState,
    conn: u64,
) -> Result<Negotiated, Ended> {
    let offered = HandshakeFlags::FIXED_NEWSTYLE | HandshakeFlags::NO_ZEROES;
    let mut out = Vec::with_capacity(256);
    encode_server_greeting(offered, &mut out);
    stream.write_all(&out)?;
    let mut flags = [0u8; 4];
    stream.read_exact(&mut flags)?;
    let client = match decode_client_flags(&flags, offered) {
        Ok(Decoded::Complete { value, .. }) => value,
        Ok(Decoded::Incomplete(_)) => return Err(Ended::Protocol("short client flags".into())),
        Err(e) => return Err(Ended::Protocol(format!("client flags: {e}"))),
    };
    let mut haggler = Haggler {
        stream,
        shared,
        conn,
        mode: TransmissionMode::Simple,
        meta: None,
        no_zeroes: client.contains(ClientFlags::NO_ZEROES),
        out,
        data: Vec::new(),
        options: 0,
        option_bytes: 0,
        tls_refused: false,
    };
    loop {
        if let Some(negotiated) = haggler.option()? {
            return Ok(negotiated);
        }
    }
}

impl Haggler<'_, '_> {
    /// Counts one more option of `length` data bytes against the handshake's bounds.
    fn count_option(&mut self, length: u32) -> Result<(), Ended> {
        let tuning = &self.shared.tuning;
        self.options += 1;
        self.option_bytes += u64::from(length);
        if self.options > tuning.max_options {
            return Err(Ended::Limit(format!(
                "more than {} options in one handshake",
                tuning.max_options
            )));
        }
        if self.option_bytes > tuning.max_option_bytes {
            return Err(Ended::Limit(format!(
                "more than {} bytes of option data in one handshake",
                tuning.max_option_bytes
            )));
        }
        Ok(())
    }

    /// Reads and answers one option; `Some` when it entered transmission.
    fn option(&mut self) -> Result<Option<Negotiated>, Ended> {
        let mut hdr = [0u8; OPTION_HEADER_LEN];
        if let Err(e) = self.stream.read_exact(&mut hdr) {
            return Err(if e.kind() == io::ErrorKind::UnexpectedEof {
                Ended::Client("hung up during option haggling")
            } else {
                Ended::from(e)
            });
        }
        // The announced length, whatever the header's other faults: it counts against the
        // bounds before any of it is read.
        let announced = u32::from_be_bytes([hdr[12], hdr[13], hdr[14], hdr[15]]);
        self.count_option(announced)?;
        let header = match decode_option_header(&hdr, DEFAULT_MAX_OPTION_LEN) {
            Ok(Decoded::Complete { value, .. }) => value,
            Ok(Decoded::Incomplete(_)) => return Err(Ended::Protocol("short option".into())),
            Err(Error::OptionTooLong { option, length, .. }) if length <= MAX_SKIPPED_OPTION => {
                io::copy(
                    &mut (&mut *self.stream).take(u64::from(length)),
                    &mut io::sink(),
                )?;
                self.reply(
                    option,
                    &OptionReply::Error {
                        error: OptionError::TooBig,
                        message: "option data too long",
                    },
                )?;
                return Ok(None);
            }
            Err(e) => return Err(Ended::Protocol(format!("option header: {e}"))),
        };
        self.data.clear();
        self.data.resize(header.length as usize, 0);
        self.stream.read_exact(&mut self.data)?;
        let data = std::mem::take(&mut self.data);
        let res = self.answer(header.option, &data);
        self.data = data;
        res
    }

    fn answer(&mut self, option: u32, data: &[u8]) -> Result<Option<Negotiated>, Ended> {
        let parsed = match parse_option(option, data) {
            Ok(p) => p,
            Err(e) => {
                if OptionCode::from_u32(option) == Some(OptionCode::ExportName) {
                    // NBD_OPT_EXPORT_NAME cannot be answered with an error.
                    return Err(Ended::Protocol(format!("NBD_OPT_EXPORT_NAME: {e}")));
                }
                let error = e.option_error().unwrap_or(OptionError::Invalid);
                let msg = e.to_string();
                self.reply(
                    option,
                    &OptionReply::Error {
                        error,
                        message: &msg,
                    },
                )?;
                return Ok(None);
            }
        };
        if self.tls_required() && !matches!(parsed, ClientOption::StartTls | ClientOption::Abort) {
            return self.refuse_before_tls(option, matches!(parsed, ClientOption::ExportName(_)));
        }
        if self.shared.stopping() && !matches!(parsed, ClientOption::Abort) {
            if matches!(parsed, ClientOption::ExportName(_)) {
                return Err(Ended::Client("server shutting down"));
            }
            self.reply(
                option,
                &OptionReply::Error {
                    error: OptionError::Shutdown,
                    message: "server shutting down",
                },
            )?;
            return Ok(None);
        }
        match parsed {
            ClientOption::ExportName(name) => self.export_name(name).map(Some),
            ClientOption::Abort => {
                // The client may already have closed: a failed ACK is not an error.
                let _ = self.reply(option, &OptionReply::Ack);
                Err(Ended::Client("aborted the handshake"))
            }
            ClientOption::List => {
                self.list(option)?;
                Ok(None)
            }
            ClientOption::StartTls => {
                self.start_tls(option)?;
                Ok(None)
            }
            ClientOption::Info(req) => {
                self.info(option, &req)?;
                Ok(None)
            }
            ClientOption::Go(req) => match self.info(option, &req)? {
                Some(export) => Ok(Some(self.enter(export, req.name, "go"))),
                None => Ok(None),
            },
            ClientOption::StructuredReply => {
                let r = if self.mode == TransmissionMode::Extended {
                    OptionReply::Error {
                        error: OptionError::ExtHeaderReqd,
                        message: "extended headers already negotiated",
                    }
                } else {
                    self.mode = TransmissionMode::Structured;
                    OptionReply::Ack
                };
                self.reply(option, &r)?;
                Ok(None)
            }
            ClientOption::ExtendedHeaders => {
                self.mode = TransmissionMode::Extended;
                self.reply(option, &OptionReply::Ack)?;
                Ok(None)
            }
            ClientOption::ListMetaContext(req) => {
                self.meta_context(option, &req, false)?;
                Ok(None)
            }
            ClientOption::SetMetaContext(req) => {
                self.meta_context(option, &req, true)?;
                Ok(None)
            }
            other => {
                let msg = format!("option {} is not supported", other.option());
                self.reply(
                    option,
                    &OptionReply::Error {
                        error: OptionError::Unsup,
                        message: &msg,
                    },
                )?;
                Ok(None)
            }
        }
    }

    /// Refuses an option sent before NBD_OPT_STARTTLS while TLS is required (`export_name`:
    /// it is NBD_OPT_EXPORT_NAME, which cannot be answered with an error: the connection
    /// ends). The first refusal of a connection is logged and counted.
    fn refuse_before_tls(
        &mut self,
        option: u32,
        export_name: bool,
    ) -> Result<Option<Negotiated>, Ended> {
        if export_name {
            // NBD_OPT_EXPORT_NAME cannot be answered with an error.
            return Err(Ended::Protocol(
                "NBD_OPT_EXPORT_NAME before NBD_OPT_STARTTLS (--tls=require)".into(),
            ));
        }
        if !std::mem::replace(&mut self.tls_refused, true) {
            // Once per connection: a client may go on sending options.
            warn!(
                peer = %self.stream.stream.peer(),
                reason = "policy",
                "refused {} (option {option}) before NBD_OPT_STARTTLS: TLS is required \
                 (--tls require); the client has not started it",
                nbd_proto::proto::option_name(option)
            );
            self.shared
                .counters
                .handshake_failed(super::stats::HandshakeFailure::Policy);
        }
        self.reply(
            option,
            &OptionReply::Error {
                error: OptionError::TlsReqd,
                message: "TLS is required: send NBD_OPT_STARTTLS first",
            },
        )?;
        Ok(None)
    }

    /// Answers NBD_OPT_LIST: every export the client may see, then the ACK.
    fn list(&mut self, option: u32) -> Result<(), Ended> {
        self.out.clear();
        let who = self.identity();
        for e in self.shared.exports().iter() {
            if let Err(r) = e.access.read().check(&who) {
                debug!(export = %e.export.name, "hidden from NBD_OPT_LIST: {r}");
                continue;
            }
            let r = OptionReply::Server {
                name: &e.export.name,
                details: &e.export.description,
            };
            encode(option, &r, &mut self.out)?;
        }
        encode(option, &OptionReply::Ack, &mut self.out)?;
        self.stream.write_all(&self.out)?;
        Ok(())
    }

    /// `--tls=require` and the stream is still plaintext.
    fn tls_required(&self) -> bool {
        matches!(&self.shared.tls, Some(t) if t.mode == TlsMode::Require) && !self.stream.is_tls()
    }

    /// `NBD_OPT_STARTTLS` (its data already checked empty by the codec): ACK, then the TLS
    /// handshake; what was negotiated in plaintext is forgotten.
    fn start_tls(&mut self, option: u32) -> Result<(), Ended> {
        let Some(config) = self.shared.tls_config.read().clone() else {
            return self.reply(
                option,
                &OptionReply::Error {
                    error: OptionError::Policy,
                    message: "TLS is not enabled on this server (--tls)",
                },
            );
        };
        if self.stream.is_tls() {
            return self.reply(
                option,
                &OptionReply::Error {
                    error: OptionError::Invalid,
                    message: "TLS is already negotiated",
                },
            );
        }
        self.reply(option, &OptionReply::Ack)?;
        self.stream.start_tls(&config).map_err(|e| match e.kind() {
            io::ErrorKind::InvalidData => Ended::Protocol(format!("TLS handshake failed: {e}")),
            _ => Ended::from(e),
        })?;
        self.mode = TransmissionMode::Simple;
        self.meta = None;
        debug!(subject = ?self.stream.stream.tls_subject(), "TLS started");
        Ok(())
    }

    fn export_name(&mut self, name: &str) -> Result<Negotiated, Ended> {
        if self.mode == TransmissionMode::Extended {
            return Err(Ended::Protocol(
                "NBD_OPT_EXPORT_NAME after extended headers were negotiated".into(),
            ));
        }
        let unknown =
            || Ended::Protocol(format!("NBD_OPT_EXPORT_NAME for unknown export {name:?}"));
        let Some(state) = self.shared.find(name) else {
            return Err(unknown());
        };
        if let Err(refusal) = self.allowed(&state, "NBD_OPT_EXPORT_NAME") {
            return Err(Ended::Refused {
                export: name.to_string(),
                refusal,
            });
        }
        let info = ExportInfo {
            size: state.size,
            flags: transmission_flags(&state, self.mode),
        };
        self.out.clear();
        encode_export_name_reply(info, self.no_zeroes, &mut self.out);
        if !self.shared.attach(self.conn, &state) {
            // Removed since it was found.
            return Err(unknown());
        }
        self.stream.write_all(&self.out)?;
        Ok(self.enter(state, name, "export-name"))
    }

    fn enter(&mut self, export: Arc<ExportState>, name: &str, via: &'static str) -> Negotiated {
        let contexts = match self.meta.take() {
            Some((n, selection)) if n == name => selection,
            _ => Selection::default(),
        };
        Negotiated {
            export,
            mode: self.mode,
            contexts,
            via,
        }
    }

    /// Answers `NBD_OPT_INFO` / `NBD_OPT_GO`; `Some(export)` on success.
    fn info(
        &mut self,
        option: u32,
        req: &ExportRequest<'_>,
    ) -> Result<Option<Arc<ExportState>>, Ended> {
        let Some(state) = self.shared.find(req.name) else {
            self.unknown(option, req.name)?;
            return Ok(None);
        };
        let what = if OptionCode::from_u32(option) == Some(OptionCode::Go) {
            "NBD_OPT_GO"
        } else {
            "NBD_OPT_INFO"
        };
        if self.allowed(&state, what).is_err() {
            self.refuse(option, req.name)?;
            return Ok(None);
        }
        self.out.clear();
        let export = Info::Export(ExportInfo {
            size: state.size,
            flags: transmission_flags(&state, self.mode),
        });
        encode(option, &OptionReply::Info(export), &mut self.out)?;
        if req.requests(InfoType::Name) {
            encode(
                option,
                &OptionReply::Info(Info::Name(&state.export.name)),
                &mut self.out,
            )?;
        }
        if req.requests(InfoType::Description) && !state.export.description.is_empty() {
            let description = Info::Description(&state.export.description);
            encode(option, &OptionReply::Info(description), &mut self.out)?;
        }
        // Always sent: the constraints are not the defaults (minimum 512, not 1).
        let block_size_info = Info::BlockSize(block_size(&state, self.shared.tuning.max_block));
        encode(option, &OptionReply::Info(block_size_info), &mut self.out)?;
        encode(option, &OptionReply::Ack, &mut self.out)?;
        if what == "NBD_OPT_GO" && !self.shared.attach(self.conn, &state) {
            // Removed since it was found: as for an unknown export.
            self.unknown(option, req.name)?;
            return Ok(None);
        }
        self.stream.write_all(&self.out)?;
        Ok(Some(state))
    }

    fn meta_context(
        &mut self,
        option: u32,
        req: &MetaContextRequest<'_>,
        set: bool,
    ) -> Result<(), Ended> {
        if set {
            // A SET replaces the previous selection, even when it fails.
            self.meta = None;
            if !self.mode.chunked_replies() {
                self.reply(
                    option,
                    &OptionReply::Error {
                        error: OptionError::Invalid,
                        message: "negotiate structured replies or extended headers first",
                    },
                )?;
                return Ok(());
            }
        }
        let Some(state) = self.shared.find(req.name) else {
            return self.unknown(option, req.name);
        };
        if self.allowed(&state, "a meta context option").is_err() {
            return self.refuse(option, req.name);
        }
        // The export's bitmaps now (a snapshot: one removed later fails the requests that
        // name it, `conn/reader.rs`).
        let bitmaps = state
            .export
            .device
            .dirty_bitmaps()
            .map(|b| b.names())
            .unwrap_or_default();
        let selection = if set {
            select(&req.queries, &bitmaps)
        } else {
            list(&req.queries, &bitmaps)
        };
        self.out.clear();
        let mut name = String::new();
        if selection.base_allocation {
            let id = if set { BASE_ALLOCATION_ID } else { 0 };
            let r = OptionReply::MetaContext {
                id,
                name: BASE_ALLOCATION,
            };
            encode(option, &r, &mut self.out)?;
        }
        for (i, bitmap) in selection.bitmaps.iter().enumerate() {
            let id = if set { FIRST_BITMAP_ID + i as u32 } else { 0 };
            name.clear();
            name.push_str(DIRTY_BITMAP);
            name.push_str(bitmap);
            encode(
                option,
                &OptionReply::MetaContext { id, name: &name },
                &mut self.out,
            )?;
        }
        encode(option, &OptionReply::Ack, &mut self.out)?;
        self.stream.write_all(&self.out)?;
        debug!(set, contexts = ?selection, export = req.name, "meta context");
        if set {
            self.meta = Some((req.name.to_string(), selection));
        }
        Ok(())
    }

    /// Who the client is now (read again at each use: STARTTLS may have changed it).
    fn identity(&self) -> Identity {
        (self.shared.tuning.identify)(self.stream.stream)
    }

    /// Whether the client may use export `state` (named by option `what`); a refusal is
    /// logged with the rule that made it.
    fn allowed(&self, state: &ExportState, what: &str) -> Result<(), Refusal> {
        let export = &state.export;
        let res = state.access.read().check(&self.identity());
        if let Err(r) = &res {
            warn!(
                peer = %self.stream.stream.peer(),
                export = %export.name,
                reason = r.reason(),
                "refused {what}: {r}"
            );
        }
        res
    }

    /// Answers an option naming an export that does not exist. To a client that some
    /// export's rules refuse, exactly as [`Haggler::refuse`] answers for an existing one
    /// (`NBD_REP_ERR_POLICY`, same message): otherwise the difference would tell it which
    /// names exist behind the rules. To a client every export admits, `NBD_REP_ERR_UNKNOWN`.
    fn unknown(&mut self, option: u32, name: &str) -> Result<(), Ended> {
        let who = self.identity();
        if self
            .shared
            .exports()
            .iter()
            .any(|e| e.access.read().check(&who).is_err())
        {
            debug!(export = name, "no such export (answered as a refusal)");
            return self.refuse(option, name);
        }
        let msg = no_such_export(name);
        self.reply(
            option,
            &OptionReply::Error {
                error: OptionError::Unknown,
                message: &msg,
            },
        )
    }

    /// Answers an option naming an export the client may not use: `NBD_REP_ERR_POLICY`
    /// (counted as a `policy` handshake failure: the client may go on with another option).
    fn refuse(&mut self, option: u32, name: &str) -> Result<(), Ended> {
        self.shared
            .counters
            .handshake_failed(super::stats::HandshakeFailure::Policy);
        let mut end = name.len().min(256);
        while !name.is_char_boundary(end) {
            end -= 1;
        }
        let msg = format!(
            "access to export {:?} is not allowed from this client",
            &name[..end]
        );
        self.reply(
            option,
            &OptionReply::Error {
                error: OptionError::Policy,
                message: &msg,
            },
        )
    }

    fn reply(&mut self, option: u32, r: &OptionReply<'_>) -> Result<(), Ended> {
        self.out.clear();
        encode(option, r, &mut self.out)?;
        self.stream.write_all(&self.out)?;
        Ok(())
    }
}

/// The contexts `NBD_OPT_SET_META_CONTEXT` with `queries` selects, given the export's
/// `bitmaps`: only whole names (`base:` and `qemu:dirty-bitmap:` alone select nothing, nor
/// does an unknown namespace or an unknown bitmap), each once, in the order of the queries.
pub(crate) fn select(queries: &[&str], bitmaps: &[String]) -> Selection {
    let mut s = Selection::default();
    for q in queries {
        if *q == BASE_ALLOCATION {
            s.base_allocation = true;
        } else if let Some(leaf) = q.strip_prefix(DIRTY_BITMAP) {
            if bitmaps.iter().any(|b| b == leaf) && !s.bitmaps.iter().any(|b| b == leaf) {
                s.bitmaps.push(leaf.to_string());
            }
        }
    }
    s
}

/// The contexts `NBD_OPT_LIST_META_CONTEXT` with `queries` lists, given the export's
/// `bitmaps`: all of them for no query; `base:allocation` for itself or `base:`; every
/// bitmap for `qemu:` or `qemu:dirty-bitmap:`, one for its whole name. Bitmaps in the
/// export's order, each once; a name too long for a context name is never listed.
pub(crate) fn list(queries: &[&str], bitmaps: &[String]) -> Selection {
    let all = queries.is_empty();
    let base_allocation = all
        || queries
            .iter()
            .any(|q| *q == BASE_ALLOCATION || *q == "base:");
    let bitmaps = bitmaps
        .iter()
        .filter(|b| DIRTY_BITMAP.len() + b.len() <= MAX_CONTEXT_NAME)
        .filter(|b| {
            all || queries.iter().any(|q| match q.strip_prefix(DIRTY_BITMAP) {
                Some(leaf) => leaf.is_empty() || leaf == b.as_str(),
                None => *q == "qemu:",
            })
        })
        .cloned()
        .collect();
    Selection {
        base_allocation,
        bitmaps,
    }
}

/// "no export named ..." for an error message, short enough for the protocol's 4096 bytes.
fn no_such_export(name: &str) -> String {
    let mut end = name.len().min(256);
    while !name.is_char_boundary(end) {
        end -= 1;
    }
    format!("no export named {:?}", &name[..end])
}

fn encode(option: u32, r: &OptionReply<'_>, out: &mut Vec<u8>) -> Result<(), Ended> {
    encode_option_reply(option, r, out)
        .map_err(|e| Ended::Protocol(format!("encoding a reply to option {option}: {e}")))
}
