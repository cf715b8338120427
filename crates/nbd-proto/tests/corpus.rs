//! The fuzz seed corpus (`fuzz/corpus/<target>/`): every file in it goes through the same
//! drivers as the fuzz targets ([`nbd_proto::harness`]), in a plain `cargo test`.
//!
//! Seeds are built here with the crate's own encoders. Files named `valid-*` must decode
//! cleanly and `bad-*` must not; any other file (a fuzzer adds its finds to the corpus) only
//! has to go through without a panic.
//!
//! To (re)write the seed files after changing [`seeds`]:
//! `NBD_WRITE_CORPUS=1 cargo test -p nbd-proto --test corpus`.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Once;

use nbd_proto::handshake::{
    encode_client_flags, encode_export_name_reply, encode_option_reply, encode_server_greeting,
    BlockSize, ClientOption, ExportInfo, ExportRequest, Info, MetaContextRequest, OptionHeader,
    OptionReply,
};
use nbd_proto::proto::{
    NBD_CLISERV_MAGIC, NBD_EINVAL, NBD_EIO, NBD_OPT_GO, NBD_OPT_INFO, NBD_OPT_LIST,
    NBD_OPT_SET_META_CONTEXT, NBD_REPLY_TYPE_BLOCK_STATUS, NBD_REPLY_TYPE_NONE, NBD_REP_ACK,
    NBD_STATE_HOLE, NBD_STATE_ZERO,
};
use nbd_proto::{
    harness, ChunkHeader, ClientFlags, CmdFlags, Command, Extent, ExtentExt, HandshakeFlags,
    InfoType, OptionError, ReplyChunk, ReplyFlags, ReplyTo, Request, SimpleReply,
    TransmissionFlags, TransmissionMode,
};

/// Selector bytes of the drivers (see `nbd_proto::harness`).
const HS_SERVER: u8 = 0;
const HS_CLIENT: u8 = 1;
const HS_EXPORT_NAME_ZEROES: u8 = 3;
const HS_EXPORT_NAME_NO_ZEROES: u8 = 5;
const RQ_REQUESTS_COMPACT: u8 = 0;
const RQ_REQUESTS_STRUCTURED: u8 = 2;
const RQ_REQUESTS_EXTENDED: u8 = 4;
const RQ_REPLIES_SIMPLE: u8 = 1;
const RQ_REPLIES_STRUCTURED: u8 = 3;
const RQ_REPLIES_EXTENDED: u8 = 5;

const TARGETS: [&str; 2] = ["handshake", "request"];

fn corpus_dir(target: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/corpus")
        .join(target)
}

fn run(target: &str, data: &[u8]) -> harness::Outcome {
    match target {
        "handshake" => harness::handshake(data),
        "request" => harness::request(data),
        _ => unreachable!("unknown target {target}"),
    }
}

fn opt(o: ClientOption<'_>, out: &mut Vec<u8>) {
    o.encode(out).unwrap();
}

fn raw_opt(option: u32, data: &[u8], out: &mut Vec<u8>) {
    OptionHeader {
        option,
        length: data.len() as u32,
    }
    .encode(out);
    out.extend_from_slice(data);
}

fn rep(option: u32, r: OptionReply<'_>, out: &mut Vec<u8>) {
    encode_option_reply(option, &r, out).unwrap();
}

fn req(mode: TransmissionMode, r: Request, out: &mut Vec<u8>) {
    r.encode(mode, out).unwrap();
    out.resize(out.len() + r.payload_len(mode) as usize, 0x5a);
}

fn chunk(mode: TransmissionMode, c: ReplyChunk<'_>, cookie: u64, done: bool, out: &mut Vec<u8>) {
    let flags = if done {
        ReplyFlags::DONE
    } else {
        ReplyFlags::empty()
    };
    c.encode(mode, ReplyTo { cookie, offset: 0 }, flags, out)
        .unwrap();
    if let ReplyChunk::OffsetData { data_len, .. } = c {
        out.resize(out.len() + data_len as usize, 0xa5);
    }
}

fn with(selector: u8, build: impl FnOnce(&mut Vec<u8>)) -> Vec<u8> {
    let mut v = vec![selector];
    build(&mut v);
    v
}

fn client_flags(v: &mut Vec<u8>) {
    encode_client_flags(ClientFlags::FIXED_NEWSTYLE | ClientFlags::NO_ZEROES, v);
}

fn greeting(v: &mut Vec<u8>) {
    encode_server_greeting(
        HandshakeFlags::FIXED_NEWSTYLE | HandshakeFlags::NO_ZEROES,
        v,
    );
}

/// The seed corpus: (target, file name, contents).
fn seeds() -> Vec<(&'static str, &'static str, Vec<u8>)> {
    let s = TransmissionMode::Simple;
    let st = TransmissionMode::Structured;
    let x = TransmissionMode::Extended;
    let extents = [
        Extent {
            length: 65536,
            flags: NBD_STATE_HOLE | NBD_STATE_ZERO,
        },
        Extent {
            length: 4096,
            flags: 0,
        },
    ];
    let ext_extents = [
        ExtentExt {
            length: 1 << 36,
            flags: u64::from(NBD_STATE_ZERO),
        },
        ExtentExt {
            length: 512,
            flags: 0,
        },
    ];
    let export = ExportInfo {
        size: 1 << 30,
        flags: TransmissionFlags::HAS_FLAGS
            | TransmissionFlags::SEND_FLUSH
            | TransmissionFlags::SEND_FUA
            | TransmissionFlags::SEND_TRIM,
    };
    vec![
        // ---- handshake, server side ----
        (
            "handshake",
            "valid-server-go",
            with(HS_SERVER, |v| {
                client_flags(v);
                opt(ClientOption::StructuredReply, v);
                opt(
                    ClientOption::SetMetaContext(MetaContextRequest {
                        name: "disk0",
                        queries: vec!["base:allocation"],
                    }),
                    v,
                );
                opt(
                    ClientOption::Go(ExportRequest::new(
                        "disk0",
                        &[InfoType::Name, InfoType::BlockSize],
                    )),
                    v,
                );
            }),
        ),
        (
            "handshake",
            "valid-server-export-name",
            with(HS_SERVER, |v| {
                client_flags(v);
                opt(ClientOption::ExportName("disk0"), v);
            }),
        ),
        (
            "handshake",
            "valid-server-list-abort",
            with(HS_SERVER, |v| {
                encode_client_flags(ClientFlags::FIXED_NEWSTYLE, v);
                opt(ClientOption::List, v);
                opt(ClientOption::Info(ExportRequest::new("", &[])), v);
                opt(ClientOption::Abort, v);
            }),
        ),
        (
            "handshake",
            "valid-server-extended",
            with(HS_SERVER, |v| {
                client_flags(v);
                opt(ClientOption::StartTls, v);
                opt(ClientOption::ExtendedHeaders, v);
                opt(
                    ClientOption::ListMetaContext(MetaContextRequest {
                        name: "",
                        queries: vec!["base:", "qemu:"],
                    }),
                    v,
                );
                opt(
                    ClientOption::Other {
                        option: 0x4242,
                        data: b"unknown option data",
                    },
                    v,
                );
                opt(
                    ClientOption::Go(ExportRequest::new("", &[InfoType::Export])),
                    v,
                );
            }),
        ),
        (
            "handshake",
            "bad-client-flags",
            with(HS_SERVER, |v| v.extend_from_slice(&[0, 0, 0x80, 1])),
        ),
        (
            "handshake",
            "bad-option-magic",
            with(HS_SERVER, |v| {
                client_flags(v);
                v.extend_from_slice(b"IHAVEOPX\0\0\0\x03\0\0\0\0");
            }),
        ),
        (
            "handshake",
            "bad-option-too-long",
            with(HS_SERVER, |v| {
                client_flags(v);
                OptionHeader {
                    option: NBD_OPT_GO,
                    length: 0x0100_0000,
                }
                .encode(v);
                v.extend_from_slice(&[0; 8]);
            }),
        ),
        (
            "handshake",
            "bad-info-name-longer-than-option",
            with(HS_SERVER, |v| {
                client_flags(v);
                raw_opt(NBD_OPT_INFO, &[0, 0, 0, 9, b'd', b'i', b's', b'k', 0, 0], v);
            }),
        ),
        (
            "handshake",
            "bad-info-count-mismatch",
            with(HS_SERVER, |v| {
                client_flags(v);
                raw_opt(NBD_OPT_GO, &[0, 0, 0, 1, b'd', 0, 2, 0, 3], v);
            }),
        ),
        (
            "handshake",
            "bad-meta-context-trailing",
            with(HS_SERVER, |v| {
                client_flags(v);
                raw_opt(
                    NBD_OPT_SET_META_CONTEXT,
                    &[0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 2, b'a', b':', 0xee],
                    v,
                );
            }),
        ),
        (
            "handshake",
            "bad-list-with-data",
            with(HS_SERVER, |v| {
                client_flags(v);
                raw_opt(NBD_OPT_LIST, b"x", v);
            }),
        ),
        (
            "handshake",
            "bad-truncated-go",
            with(HS_SERVER, |v| {
                client_flags(v);
                opt(ClientOption::Go(ExportRequest::new("disk0", &[])), v);
                v.truncate(v.len() - 3);
            }),
        ),
        // ---- handshake, client side ----
        (
            "handshake",
            "valid-client-replies",
            with(HS_CLIENT, |v| {
                greeting(v);
                rep(
                    NBD_OPT_LIST,
                    OptionReply::Server {
                        name: "disk0",
                        details: "scratch",
                    },
                    v,
                );
                rep(NBD_OPT_LIST, OptionReply::Ack, v);
                rep(
                    NBD_OPT_SET_META_CONTEXT,
                    OptionReply::MetaContext {
                        id: 1,
                        name: "base:allocation",
                    },
                    v,
                );
                rep(NBD_OPT_SET_META_CONTEXT, OptionReply::Ack, v);
                rep(NBD_OPT_GO, OptionReply::Info(Info::Export(export)), v);
                rep(NBD_OPT_GO, OptionReply::Info(Info::Name("disk0")), v);
                rep(
                    NBD_OPT_GO,
                    OptionReply::Info(Info::Description("a disk")),
                    v,
                );
                rep(
                    NBD_OPT_GO,
                    OptionReply::Info(Info::BlockSize(BlockSize {
                        min: 512,
                        preferred: 4096,
                        max: 32 << 20,
                    })),
                    v,
                );
                rep(NBD_OPT_GO, OptionReply::Ack, v);
            }),
        ),
        (
            "handshake",
            "valid-client-errors",
            with(HS_CLIENT, |v| {
                greeting(v);
                rep(
                    NBD_OPT_GO,
                    OptionReply::Error {
                        error: OptionError::Unknown,
                        message: "no such export",
                    },
                    v,
                );
                rep(
                    NBD_OPT_INFO,
                    OptionReply::Error {
                        error: OptionError::Unsup,
                        message: "",
                    },
                    v,
                );
                rep(
                    99,
                    OptionReply::Other {
                        reply_type: 0x8000_0020,
                        data: b"future error",
                    },
                    v,
                );
            }),
        ),
        (
            "handshake",
            "bad-client-oldstyle",
            with(HS_CLIENT, |v| {
                v.extend_from_slice(b"NBDMAGIC");
                v.extend_from_slice(&NBD_CLISERV_MAGIC.to_be_bytes());
                v.extend_from_slice(&(1u64 << 20).to_be_bytes());
                v.extend_from_slice(&[0; 4 + 124]);
            }),
        ),
        (
            "handshake",
            "bad-client-ack-with-data",
            with(HS_CLIENT, |v| {
                greeting(v);
                v.extend_from_slice(&nbd_proto::proto::NBD_REP_MAGIC.to_be_bytes());
                v.extend_from_slice(&NBD_OPT_GO.to_be_bytes());
                v.extend_from_slice(&NBD_REP_ACK.to_be_bytes());
                v.extend_from_slice(&[0, 0, 0, 1, 0]);
            }),
        ),
        (
            "handshake",
            "valid-export-name-reply",
            with(HS_EXPORT_NAME_ZEROES, |v| {
                encode_export_name_reply(export, false, v)
            }),
        ),
        (
            "handshake",
            "valid-export-name-reply-no-zeroes",
            with(HS_EXPORT_NAME_NO_ZEROES, |v| {
                encode_export_name_reply(export, true, v)
            }),
        ),
        // ---- transmission, requests ----
        (
            "request",
            "valid-compact-requests",
            with(RQ_REQUESTS_COMPACT, |v| {
                req(s, Request::new(Command::Read, 1, 0, 4096), v);
                req(
                    s,
                    Request::new(Command::Write, 2, 4096, 512).with_flags(CmdFlags::FUA),
                    v,
                );
                req(s, Request::new(Command::Flush, 3, 0, 0), v);
                req(s, Request::new(Command::Trim, 4, 8192, 1 << 20), v);
                req(
                    s,
                    Request::new(Command::WriteZeroes, 5, 0, 1 << 16).with_flags(CmdFlags::NO_HOLE),
                    v,
                );
                req(s, Request::new(Command::Cache, 6, 0, 4096), v);
                req(s, Request::new(Command::Disc, 7, 0, 0), v);
            }),
        ),
        (
            "request",
            "valid-structured-requests",
            with(RQ_REQUESTS_STRUCTURED, |v| {
                req(
                    st,
                    Request::new(Command::Read, 10, 0, 65536).with_flags(CmdFlags::DF),
                    v,
                );
                req(
                    st,
                    Request::new(Command::BlockStatus, 11, 0, 1 << 30)
                        .with_flags(CmdFlags::REQ_ONE),
                    v,
                );
                req(st, Request::new(Command::Write, 12, 512, 100), v);
            }),
        ),
        (
            "request",
            "valid-extended-requests",
            with(RQ_REQUESTS_EXTENDED, |v| {
                req(x, Request::new(Command::Read, 20, 1 << 40, 4096), v);
                req(
                    x,
                    Request::new(Command::Write, 21, 0, 300).with_flags(CmdFlags::PAYLOAD_LEN),
                    v,
                );
                req(x, Request::new(Command::Trim, 22, 0, 1 << 35), v);
                req(x, Request::new(Command::BlockStatus, 23, 0, 1 << 34), v);
                req(
                    x,
                    Request::new(Command::BlockStatus, 24, 0, 12).with_flags(CmdFlags::PAYLOAD_LEN),
                    v,
                );
                req(x, Request::new(Command::Disc, 25, 0, 0), v);
            }),
        ),
        (
            "request",
            "bad-compact-magic",
            with(RQ_REQUESTS_COMPACT, |v| {
                req(x, Request::new(Command::Read, 1, 0, 4096), v);
            }),
        ),
        (
            "request",
            "bad-unknown-command",
            with(RQ_REQUESTS_COMPACT, |v| {
                req(s, Request::new(Command::Read, 1, 0, 4096), v);
                let at = v.len();
                req(s, Request::new(Command::Read, 2, 0, 4096), v);
                v[at + 6..at + 8].copy_from_slice(&0x0042u16.to_be_bytes());
                req(s, Request::new(Command::Flush, 3, 0, 0), v);
            }),
        ),
        (
            "request",
            "bad-truncated-write",
            with(RQ_REQUESTS_COMPACT, |v| {
                req(s, Request::new(Command::Write, 1, 0, 100), v);
                v.truncate(v.len() - 90);
            }),
        ),
        // ---- transmission, replies ----
        (
            "request",
            "valid-simple-replies",
            with(RQ_REPLIES_SIMPLE, |v| {
                SimpleReply {
                    cookie: 1,
                    error: 0,
                }
                .encode(v);
                SimpleReply {
                    cookie: 2,
                    error: NBD_EIO,
                }
                .encode(v);
            }),
        ),
        (
            "request",
            "valid-structured-replies",
            with(RQ_REPLIES_STRUCTURED, |v| {
                SimpleReply {
                    cookie: 1,
                    error: 0,
                }
                .encode(v);
                chunk(
                    st,
                    ReplyChunk::OffsetData {
                        offset: 0,
                        data_len: 64,
                    },
                    2,
                    false,
                    v,
                );
                chunk(
                    st,
                    ReplyChunk::OffsetHole {
                        offset: 64,
                        size: 4032,
                    },
                    2,
                    false,
                    v,
                );
                chunk(st, ReplyChunk::None, 2, true, v);
                chunk(
                    st,
                    ReplyChunk::BlockStatus {
                        context_id: 1,
                        extents: &extents,
                    },
                    3,
                    true,
                    v,
                );
                chunk(
                    st,
                    ReplyChunk::ErrorOffset {
                        error: NBD_EIO,
                        message: "media error",
                        offset: 512,
                    },
                    4,
                    false,
                    v,
                );
                chunk(
                    st,
                    ReplyChunk::Error {
                        error: NBD_EINVAL,
                        message: "",
                    },
                    4,
                    true,
                    v,
                );
            }),
        ),
        (
            "request",
            "valid-extended-replies",
            with(RQ_REPLIES_EXTENDED, |v| {
                chunk(
                    x,
                    ReplyChunk::OffsetData {
                        offset: 1 << 40,
                        data_len: 32,
                    },
                    1,
                    true,
                    v,
                );
                chunk(
                    x,
                    ReplyChunk::BlockStatusExt {
                        context_id: 1,
                        extents: &ext_extents,
                    },
                    2,
                    false,
                    v,
                );
                chunk(
                    x,
                    ReplyChunk::BlockStatus {
                        context_id: 2,
                        extents: &extents,
                    },
                    2,
                    true,
                    v,
                );
                chunk(
                    x,
                    ReplyChunk::Error {
                        error: NBD_EIO,
                        message: "io",
                    },
                    3,
                    true,
                    v,
                );
                chunk(x, ReplyChunk::None, 4, true, v);
            }),
        ),
        (
            "request",
            "bad-none-without-done",
            with(RQ_REPLIES_STRUCTURED, |v| {
                ChunkHeader {
                    flags: ReplyFlags::empty(),
                    reply_type: NBD_REPLY_TYPE_NONE,
                    cookie: 1,
                    offset: 0,
                    length: 0,
                }
                .encode(st, v)
                .unwrap();
            }),
        ),
        (
            "request",
            "bad-unknown-reply-type",
            with(RQ_REPLIES_STRUCTURED, |v| {
                ChunkHeader {
                    flags: ReplyFlags::DONE,
                    reply_type: 0x0042,
                    cookie: 1,
                    offset: 0,
                    length: 2,
                }
                .encode(st, v)
                .unwrap();
                v.extend_from_slice(&[0, 0]);
            }),
        ),
        (
            "request",
            "bad-structured-chunk-in-extended-mode",
            with(RQ_REPLIES_EXTENDED, |v| {
                chunk(st, ReplyChunk::None, 1, true, v);
            }),
        ),
        (
            "request",
            "bad-block-status-misaligned",
            with(RQ_REPLIES_STRUCTURED, |v| {
                ChunkHeader {
                    flags: ReplyFlags::DONE,
                    reply_type: NBD_REPLY_TYPE_BLOCK_STATUS,
                    cookie: 1,
                    offset: 0,
                    length: 10,
                }
                .encode(st, v)
                .unwrap();
                v.extend_from_slice(&[0, 0, 0, 1, 0, 0, 16, 0, 0, 0]);
            }),
        ),
    ]
}

/// With `NBD_WRITE_CORPUS` set, writes the seed files (once per test run, before any test
/// reads the corpus directories).
fn write_seeds_if_asked() {
    static WRITE: Once = Once::new();
    WRITE.call_once(|| {
        if std::env::var_os("NBD_WRITE_CORPUS").is_none() {
            return;
        }
        for (target, name, bytes) in seeds() {
            let path = corpus_dir(target).join(name);
            fs::create_dir_all(path.parent().unwrap()).unwrap();
            fs::write(&path, &bytes).unwrap();
        }
    });
}

#[test]
fn seed_files_are_up_to_date() {
    write_seeds_if_asked();
    let mut stale = Vec::new();
    for (target, name, bytes) in seeds() {
        let path = corpus_dir(target).join(name);
        if fs::read(&path).ok().as_deref() != Some(&bytes[..]) {
            stale.push(path.display().to_string());
        }
    }
    assert!(
        stale.is_empty(),
        "seed corpus files missing or stale (run `NBD_WRITE_CORPUS=1 cargo test -p nbd-proto --test corpus`): {stale:?}"
    );
}

#[test]
fn seeds_decode_as_named() {
    let all = seeds();
    for target in TARGETS {
        let n = all.iter().filter(|(t, ..)| *t == target).count();
        assert!(n >= 12, "only {n} seeds for {target}");
    }
    for (target, name, bytes) in all {
        check(target, name, &bytes);
    }
}

fn check(target: &str, name: &str, bytes: &[u8]) {
    let out = run(target, bytes);
    assert!(out.consumed <= bytes.len(), "{target}/{name}: {out:?}");
    if name.starts_with("valid-") {
        assert!(out.is_clean(), "{target}/{name} did not decode: {out:?}");
        assert_eq!(out.consumed, bytes.len(), "{target}/{name}");
        assert!(out.messages > 0, "{target}/{name}: {out:?}");
    } else if name.starts_with("bad-") {
        assert!(!out.is_clean(), "{target}/{name} decoded cleanly: {out:?}");
    }
}

#[test]
fn every_corpus_file_decodes_without_panic() {
    write_seeds_if_asked();
    let mut seen = 0;
    for target in TARGETS {
        let dir = corpus_dir(target);
        let entries = fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        for entry in entries {
            let path = entry.unwrap().path();
            if !path.is_file() {
                continue;
            }
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            let bytes = fs::read(&path).unwrap();
            check(target, &name, &bytes);
            // The other target must cope with it too.
            for other in TARGETS {
                let _ = run(other, &bytes);
            }
            seen += 1;
        }
    }
    assert!(seen >= 24, "only {seen} corpus files");
}

#[test]
fn bad_seeds_fail_the_expected_way() {
    let by_name = |name: &str| {
        let (target, _, bytes) = seeds().into_iter().find(|(_, n, _)| *n == name).unwrap();
        run(target, &bytes)
    };
    assert!(matches!(
        by_name("bad-client-flags").fatal,
        Some(nbd_proto::Error::UnsupportedClientFlags { .. })
    ));
    assert!(matches!(
        by_name("bad-option-magic").fatal,
        Some(nbd_proto::Error::BadMagic { .. })
    ));
    let too_long = by_name("bad-option-too-long");
    assert!(too_long.incomplete && too_long.fatal.is_none());
    for name in [
        "bad-info-name-longer-than-option",
        "bad-info-count-mismatch",
        "bad-meta-context-trailing",
        "bad-list-with-data",
    ] {
        let out = by_name(name);
        assert_eq!(
            (out.rejected, out.fatal.clone()),
            (1, None),
            "{name}: {out:?}"
        );
    }
    assert!(by_name("bad-truncated-go").incomplete);
    assert_eq!(
        by_name("bad-client-oldstyle").fatal,
        Some(nbd_proto::Error::OldstyleNegotiation)
    );
    assert!(matches!(
        by_name("bad-client-ack-with-data").fatal,
        Some(nbd_proto::Error::MalformedReply { .. })
    ));
    assert!(matches!(
        by_name("bad-compact-magic").fatal,
        Some(nbd_proto::Error::BadMagic { .. })
    ));
    let unknown = by_name("bad-unknown-command");
    assert_eq!(
        (unknown.messages, unknown.rejected, unknown.fatal),
        (2, 1, None)
    );
    assert!(by_name("bad-truncated-write").incomplete);
    assert!(matches!(
        by_name("bad-none-without-done").fatal,
        Some(nbd_proto::Error::MalformedReply { .. })
    ));
    assert_eq!(
        by_name("bad-unknown-reply-type").fatal,
        Some(nbd_proto::Error::UnknownReplyType { reply_type: 0x42 })
    );
    assert!(matches!(
        by_name("bad-structured-chunk-in-extended-mode").fatal,
        Some(nbd_proto::Error::BadMagic { .. })
    ));
    assert!(matches!(
        by_name("bad-block-status-misaligned").fatal,
        Some(nbd_proto::Error::MalformedReply { .. })
    ));
}
