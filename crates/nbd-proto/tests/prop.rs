//! Property tests: encode -> decode round trips for random messages, and decoders fed random
//! bytes never panic.
// A plain threaded test or benchmark, never a loom model: its own harness (std locks, atomics,
// condition variables, baselines) is not what a model must explore, so it may use std::sync.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]
#![cfg(not(blkq_loom))]

use nbd_proto::handshake::{
    decode_client_flags, decode_export_name_reply, decode_option_header,
    decode_option_reply_header, decode_server_greeting, encode_export_name_reply,
    encode_option_reply, parse_option, parse_option_reply, BlockSize, ClientOption, ExportInfo,
    ExportRequest, Info, MetaContextRequest, OptionReply,
};
use nbd_proto::proto::{OPTION_HEADER_LEN, OPTION_REPLY_HEADER_LEN};
use nbd_proto::{
    decode_reply_header, decode_request, harness, parse_chunk, Chunk, ChunkHeader, CmdFlags,
    Command, Decoded, Error, Extent, ExtentExt, HandshakeFlags, OptionError, ReplyChunk,
    ReplyFlags, ReplyHeader, ReplyTo, Request, SimpleReply, TransmissionFlags, TransmissionMode,
};
use proptest::collection::vec;
use proptest::prelude::*;

fn mode() -> impl Strategy<Value = TransmissionMode> {
    prop_oneof![
        Just(TransmissionMode::Simple),
        Just(TransmissionMode::Structured),
        Just(TransmissionMode::Extended),
    ]
}

fn chunk_mode() -> impl Strategy<Value = TransmissionMode> {
    prop_oneof![
        Just(TransmissionMode::Structured),
        Just(TransmissionMode::Extended)
    ]
}

fn command() -> impl Strategy<Value = Command> {
    proptest::sample::select(Command::ALL)
}

/// A protocol string: any characters but NUL.
fn text(max: usize) -> impl Strategy<Value = String> {
    proptest::string::string_regex(&format!("[^\u{0}]{{0,{max}}}")).unwrap()
}

fn complete<T>(d: Decoded<T>) -> (T, usize) {
    match d {
        Decoded::Complete { value, consumed } => (value, consumed),
        Decoded::Incomplete(n) => panic!("incomplete, needs {n}"),
    }
}

#[derive(Debug, Clone)]
enum OwnedOption {
    ExportName(String),
    Abort,
    List,
    StartTls,
    Info(String, Vec<u16>),
    Go(String, Vec<u16>),
    StructuredReply,
    ListMeta(String, Vec<String>),
    SetMeta(String, Vec<String>),
    ExtendedHeaders,
    Other(u32, Vec<u8>),
}

impl OwnedOption {
    fn borrow(&self) -> ClientOption<'_> {
        match self {
            OwnedOption::ExportName(n) => ClientOption::ExportName(n),
            OwnedOption::Abort => ClientOption::Abort,
            OwnedOption::List => ClientOption::List,
            OwnedOption::StartTls => ClientOption::StartTls,
            OwnedOption::Info(n, i) => ClientOption::Info(ExportRequest {
                name: n,
                info: i.clone(),
            }),
            OwnedOption::Go(n, i) => ClientOption::Go(ExportRequest {
                name: n,
                info: i.clone(),
            }),
            OwnedOption::StructuredReply => ClientOption::StructuredReply,
            OwnedOption::ListMeta(n, q) => ClientOption::ListMetaContext(MetaContextRequest {
                name: n,
                queries: q.iter().map(String::as_str).collect(),
            }),
            OwnedOption::SetMeta(n, q) => ClientOption::SetMetaContext(MetaContextRequest {
                name: n,
                queries: q.iter().map(String::as_str).collect(),
            }),
            OwnedOption::ExtendedHeaders => ClientOption::ExtendedHeaders,
            OwnedOption::Other(o, d) => ClientOption::Other {
                option: *o,
                data: d,
            },
        }
    }
}

fn client_option() -> impl Strategy<Value = OwnedOption> {
    prop_oneof![
        text(64).prop_map(OwnedOption::ExportName),
        Just(OwnedOption::Abort),
        Just(OwnedOption::List),
        Just(OwnedOption::StartTls),
        (text(64), vec(any::<u16>(), 0..8)).prop_map(|(n, i)| OwnedOption::Info(n, i)),
        (text(64), vec(any::<u16>(), 0..8)).prop_map(|(n, i)| OwnedOption::Go(n, i)),
        Just(OwnedOption::StructuredReply),
        (text(32), vec(text(32), 0..5)).prop_map(|(n, q)| OwnedOption::ListMeta(n, q)),
        (text(32), vec(text(32), 0..5)).prop_map(|(n, q)| OwnedOption::SetMeta(n, q)),
        Just(OwnedOption::ExtendedHeaders),
        // Codes this crate does not parse.
        (prop_oneof![Just(4u32), 12u32..], vec(any::<u8>(), 0..64))
            .prop_map(|(o, d)| OwnedOption::Other(o, d)),
    ]
}

#[derive(Debug, Clone)]
enum OwnedReply {
    Ack,
    Server(String, String),
    Export(u64, u16),
    Name(String),
    Description(String),
    BlockSize(u32, u32, u32),
    InfoOther(u16, Vec<u8>),
    Meta(u32, String),
    Error(OptionError, String),
    Other(u32, Vec<u8>),
}

impl OwnedReply {
    fn borrow(&self) -> OptionReply<'_> {
        match self {
            OwnedReply::Ack => OptionReply::Ack,
            OwnedReply::Server(name, details) => OptionReply::Server { name, details },
            OwnedReply::Export(size, flags) => OptionReply::Info(Info::Export(ExportInfo {
                size: *size,
                flags: TransmissionFlags::from_bits(*flags),
            })),
            OwnedReply::Name(n) => OptionReply::Info(Info::Name(n)),
            OwnedReply::Description(d) => OptionReply::Info(Info::Description(d)),
            OwnedReply::BlockSize(min, preferred, max) => {
                OptionReply::Info(Info::BlockSize(BlockSize {
                    min: *min,
                    preferred: *preferred,
                    max: *max,
                }))
            }
            OwnedReply::InfoOther(t, d) => OptionReply::Info(Info::Other {
                info_type: *t,
                data: d,
            }),
            OwnedReply::Meta(id, name) => OptionReply::MetaContext { id: *id, name },
            OwnedReply::Error(error, message) => OptionReply::Error {
                error: *error,
                message,
            },
            OwnedReply::Other(t, d) => OptionReply::Other {
                reply_type: *t,
                data: d,
            },
        }
    }
}

fn option_reply() -> impl Strategy<Value = OwnedReply> {
    prop_oneof![
        Just(OwnedReply::Ack),
        (text(40), text(40)).prop_map(|(n, d)| OwnedReply::Server(n, d)),
        (any::<u64>(), any::<u16>()).prop_map(|(s, f)| OwnedReply::Export(s, f)),
        text(40).prop_map(OwnedReply::Name),
        text(40).prop_map(OwnedReply::Description),
        (any::<u32>(), any::<u32>(), any::<u32>())
            .prop_map(|(a, b, c)| OwnedReply::BlockSize(a, b, c)),
        (4u16.., vec(any::<u8>(), 0..32)).prop_map(|(t, d)| OwnedReply::InfoOther(t, d)),
        (any::<u32>(), text(40)).prop_map(|(i, n)| OwnedReply::Meta(i, n)),
        (proptest::sample::select(OptionError::ALL), text(40))
            .prop_map(|(e, m)| OwnedReply::Error(e, m)),
        // Unknown successful types and unknown error types.
        (
            prop_oneof![5u32..0x8000_0000, 0x8000_000bu32..],
            vec(any::<u8>(), 0..32)
        )
            .prop_map(|(t, d)| OwnedReply::Other(t, d)),
    ]
}

#[derive(Debug, Clone)]
enum OwnedChunk {
    None,
    OffsetData(u64, Vec<u8>),
    OffsetHole(u64, u32),
    BlockStatus(u32, Vec<Extent>),
    BlockStatusExt(u32, Vec<ExtentExt>),
    Error(u32, String),
    ErrorOffset(u32, String, u64),
}

impl OwnedChunk {
    fn borrow(&self) -> ReplyChunk<'_> {
        match self {
            OwnedChunk::None => ReplyChunk::None,
            OwnedChunk::OffsetData(offset, data) => ReplyChunk::OffsetData {
                offset: *offset,
                data_len: data.len() as u64,
            },
            OwnedChunk::OffsetHole(offset, size) => ReplyChunk::OffsetHole {
                offset: *offset,
                size: *size,
            },
            OwnedChunk::BlockStatus(context_id, extents) => ReplyChunk::BlockStatus {
                context_id: *context_id,
                extents,
            },
            OwnedChunk::BlockStatusExt(context_id, extents) => ReplyChunk::BlockStatusExt {
                context_id: *context_id,
                extents,
            },
            OwnedChunk::Error(error, message) => ReplyChunk::Error {
                error: *error,
                message,
            },
            OwnedChunk::ErrorOffset(error, message, offset) => ReplyChunk::ErrorOffset {
                error: *error,
                message,
                offset: *offset,
            },
        }
    }

    fn expected(&self) -> Chunk<'_> {
        match self {
            OwnedChunk::None => Chunk::None,
            OwnedChunk::OffsetData(offset, data) => Chunk::OffsetData {
                offset: *offset,
                data,
            },
            OwnedChunk::OffsetHole(offset, size) => Chunk::OffsetHole {
                offset: *offset,
                size: *size,
            },
            OwnedChunk::BlockStatus(context_id, extents) => Chunk::BlockStatus {
                context_id: *context_id,
                extents: extents.clone(),
            },
            OwnedChunk::BlockStatusExt(context_id, extents) => Chunk::BlockStatusExt {
                context_id: *context_id,
                extents: extents.clone(),
            },
            OwnedChunk::Error(error, message) => Chunk::Error {
                error: *error,
                message,
            },
            OwnedChunk::ErrorOffset(error, message, offset) => Chunk::ErrorOffset {
                error: *error,
                message,
                offset: *offset,
            },
        }
    }
}

fn reply_chunk(extended: bool) -> BoxedStrategy<OwnedChunk> {
    let extent = (1u32.., any::<u32>()).prop_map(|(length, flags)| Extent { length, flags });
    let ext_extent = (1u64.., any::<u64>()).prop_map(|(length, flags)| ExtentExt { length, flags });
    let common = prop_oneof![
        Just(OwnedChunk::None),
        (any::<u64>(), vec(any::<u8>(), 1..64)).prop_map(|(o, d)| OwnedChunk::OffsetData(o, d)),
        (any::<u64>(), 1u32..).prop_map(|(o, s)| OwnedChunk::OffsetHole(o, s)),
        (any::<u32>(), vec(extent, 1..16)).prop_map(|(c, e)| OwnedChunk::BlockStatus(c, e)),
        (1u32.., text(64)).prop_map(|(e, m)| OwnedChunk::Error(e, m)),
        (1u32.., text(64), any::<u64>()).prop_map(|(e, m, o)| OwnedChunk::ErrorOffset(e, m, o)),
    ];
    if extended {
        prop_oneof![
            common,
            (any::<u32>(), vec(ext_extent, 1..16))
                .prop_map(|(c, e)| OwnedChunk::BlockStatusExt(c, e)),
        ]
        .boxed()
    } else {
        common.boxed()
    }
}

fn chunk_in_mode() -> impl Strategy<Value = (TransmissionMode, OwnedChunk)> {
    chunk_mode().prop_flat_map(|m| (Just(m), reply_chunk(m.extended_headers())))
}

proptest! {
    #[test]
    fn request_round_trip(
        mode in mode(),
        kind in command(),
        flags in any::<u16>(),
        cookie in any::<u64>(),
        offset in any::<u64>(),
        length in any::<u64>(),
    ) {
        let length = if mode.extended_headers() { length } else { length & 0xffff_ffff };
        let req = Request { flags: CmdFlags::from_bits(flags), kind, cookie, offset, length };
        let mut buf = [0u8; 32];
        let n = req.encode_into(mode, &mut buf).unwrap();
        prop_assert_eq!(n, mode.request_header_len());
        let mut v = vec![];
        req.encode(mode, &mut v).unwrap();
        prop_assert_eq!(&v[..], &buf[..n]);
        let (back, used) = complete(decode_request(&v, mode).unwrap());
        prop_assert_eq!(back, req);
        prop_assert_eq!(used, n);
        // Every strict prefix is incomplete, and asks for the whole header.
        for cut in 0..n {
            prop_assert_eq!(decode_request(&v[..cut], mode), Ok(Decoded::Incomplete(n)));
        }
    }

    #[test]
    fn unknown_commands_are_not_fatal(
        mode in mode(),
        command in 9u16..,
        flags in any::<u16>(),
        length in any::<u32>(),
    ) {
        let mut v = vec![];
        Request::new(Command::Read, 1, 2, u64::from(length)).with_flags(CmdFlags::from_bits(flags))
            .encode(mode, &mut v).unwrap();
        v[6..8].copy_from_slice(&command.to_be_bytes());
        let Err(Error::UnknownCommand(u)) = decode_request(&v, mode) else {
            panic!("expected UnknownCommand");
        };
        prop_assert_eq!(u.command, command);
        prop_assert_eq!(u.header_len, v.len());
        let want = if mode.extended_headers() && CmdFlags::from_bits(flags).contains(CmdFlags::PAYLOAD_LEN) {
            u64::from(length)
        } else {
            0
        };
        prop_assert_eq!(u.payload_len, want);
    }

    #[test]
    fn simple_reply_round_trip(mode in prop_oneof![
        Just(TransmissionMode::Simple), Just(TransmissionMode::Structured)
    ], cookie in any::<u64>(), error in any::<u32>()) {
        let r = SimpleReply { cookie, error };
        let mut v = vec![];
        r.encode(&mut v);
        prop_assert_eq!(complete(decode_reply_header(&v, mode).unwrap()), (ReplyHeader::Simple(r), 16));
    }

    #[test]
    fn chunk_round_trip(
        (mode, chunk) in chunk_in_mode(),
        cookie in any::<u64>(),
        offset in any::<u64>(),
        done in any::<bool>(),
    ) {
        let to = ReplyTo { cookie, offset };
        let flags = if done { ReplyFlags::DONE } else { ReplyFlags::empty() };
        let mut v = vec![];
        chunk.borrow().encode(mode, to, flags, &mut v).unwrap();
        let mut buf = vec![0; v.len()];
        prop_assert_eq!(chunk.borrow().encode_into(mode, to, flags, &mut buf), Ok(v.len()));
        prop_assert_eq!(&buf, &v);
        if let OwnedChunk::OffsetData(_, data) = &chunk {
            v.extend_from_slice(data);
        }
        let (ReplyHeader::Chunk(h), used) = complete(decode_reply_header(&v, mode).unwrap()) else {
            panic!("not a chunk");
        };
        prop_assert_eq!(h.cookie, cookie);
        prop_assert_eq!(h.offset, if mode.extended_headers() { offset } else { 0 });
        prop_assert_eq!(h.length as usize, v.len() - used);
        prop_assert_eq!(h.is_done(), done || matches!(chunk, OwnedChunk::None));
        prop_assert_eq!(parse_chunk(&h, &v[used..]), Ok(chunk.expected()));
    }

    #[test]
    fn option_round_trip(opt in client_option()) {
        let opt = opt.borrow();
        let mut v = vec![];
        opt.encode(&mut v).unwrap();
        let (h, used) = complete(decode_option_header(&v, u32::MAX).unwrap());
        prop_assert_eq!(used, OPTION_HEADER_LEN);
        prop_assert_eq!(h.option, opt.option());
        prop_assert_eq!(h.length as usize, v.len() - used);
        prop_assert_eq!(parse_option(h.option, &v[used..]), Ok(opt));
    }

    #[test]
    fn option_reply_round_trip(option in any::<u32>(), reply in option_reply()) {
        let reply = reply.borrow();
        let mut v = vec![];
        encode_option_reply(option, &reply, &mut v).unwrap();
        let (h, used) = complete(decode_option_reply_header(&v, u32::MAX).unwrap());
        prop_assert_eq!(used, OPTION_REPLY_HEADER_LEN);
        prop_assert_eq!(h.option, option);
        prop_assert_eq!(h.reply_type, reply.reply_type());
        prop_assert_eq!(parse_option_reply(h.reply_type, &v[used..]), Ok(reply));
    }

    #[test]
    fn export_name_reply_round_trip(size in any::<u64>(), flags in any::<u16>(), no_zeroes in any::<bool>()) {
        let info = ExportInfo { size, flags: TransmissionFlags::from_bits(flags) };
        let mut v = vec![];
        encode_export_name_reply(info, no_zeroes, &mut v);
        prop_assert_eq!(complete(decode_export_name_reply(&v, no_zeroes).unwrap()), (info, v.len()));
    }

    #[test]
    fn option_length_limit(option in any::<u32>(), length in any::<u32>(), max in any::<u32>()) {
        let mut v = b"IHAVEOPT".to_vec();
        v.extend_from_slice(&option.to_be_bytes());
        v.extend_from_slice(&length.to_be_bytes());
        let r = decode_option_header(&v, max);
        if length > max {
            prop_assert_eq!(r, Err(Error::OptionTooLong { option, length, max }));
        } else {
            prop_assert!(r.unwrap().is_complete());
        }
    }

    #[test]
    fn random_bytes_never_panic(data in vec(any::<u8>(), 0..300), code in any::<u32>(), t16 in any::<u16>(), f16 in any::<u16>()) {
        let _ = decode_server_greeting(&data);
        let _ = decode_client_flags(&data, HandshakeFlags::KNOWN);
        let _ = decode_client_flags(&data, HandshakeFlags::empty());
        let _ = decode_option_header(&data, 1024);
        let _ = decode_option_reply_header(&data, 1024);
        let _ = decode_export_name_reply(&data, true);
        let _ = decode_export_name_reply(&data, false);
        let _ = parse_option(code, &data);
        let _ = parse_option(code % 16, &data);
        let _ = parse_option_reply(code, &data);
        let _ = parse_option_reply(code % 8, &data);
        let _ = parse_option_reply(code | 0x8000_0000, &data);
        for mode in [TransmissionMode::Simple, TransmissionMode::Structured, TransmissionMode::Extended] {
            if let Ok(Decoded::Incomplete(n)) = decode_request(&data, mode) {
                prop_assert!(n > data.len());
            }
            if let Ok(Decoded::Incomplete(n)) = decode_reply_header(&data, mode) {
                prop_assert!(n > data.len());
            }
        }
        for reply_type in [t16, t16 % 8, t16 | 0x8000] {
            let h = ChunkHeader {
                flags: ReplyFlags::from_bits(f16),
                reply_type,
                cookie: 0,
                offset: 0,
                length: data.len() as u64,
            };
            let _ = parse_chunk(&h, &data);
        }
        let _ = harness::handshake(&data);
        let _ = harness::request(&data);
    }

    #[test]
    fn harness_never_panics_on_selected_streams(selector in any::<u8>(), data in vec(any::<u8>(), 0..400)) {
        let mut input = vec![selector];
        input.extend_from_slice(&data);
        let h = harness::handshake(&input);
        prop_assert!(h.consumed <= input.len());
        let r = harness::request(&input);
        prop_assert!(r.consumed <= input.len());
    }

    #[test]
    fn harness_on_mutated_valid_streams(
        (mode, chunks) in chunk_mode().prop_flat_map(|m| (Just(m), vec(reply_chunk(m.extended_headers()), 1..6))),
        flip in any::<prop::sample::Index>(),
        xor in 1u8..,
    ) {
        let mut stream = vec![if mode.extended_headers() { 5 } else { 3 }];
        for (i, c) in chunks.iter().enumerate() {
            c.borrow().encode(mode, ReplyTo { cookie: i as u64, offset: 0 }, ReplyFlags::empty(), &mut stream).unwrap();
            if let OwnedChunk::OffsetData(_, data) = c {
                stream.extend_from_slice(data);
            }
        }
        let clean = harness::request(&stream);
        prop_assert!(clean.is_clean(), "{:?}", clean);
        prop_assert_eq!(clean.messages, chunks.len());
        let i = flip.index(stream.len() - 1) + 1;
        stream[i] ^= xor;
        let _ = harness::request(&stream);
    }
    #[test]
    fn harness_on_mutated_option_streams(
        opts in vec(client_option(), 1..6),
        flip in any::<prop::sample::Index>(),
        xor in 1u8..,
    ) {
        // Selector 0: server side; client flags FIXED_NEWSTYLE | NO_ZEROES.
        let mut stream = vec![0u8, 0, 0, 0, 3];
        for o in &opts {
            o.borrow().encode(&mut stream).unwrap();
        }
        let clean = harness::handshake(&stream);
        prop_assert!(clean.is_clean(), "{:?}", clean);
        prop_assert_eq!(clean.messages, opts.len() + 1);
        let i = flip.index(stream.len() - 1) + 1;
        stream[i] ^= xor;
        let _ = harness::handshake(&stream);
    }

    #[test]
    fn harness_on_mutated_option_reply_streams(
        replies in vec((any::<u32>(), option_reply()), 1..6),
        flip in any::<prop::sample::Index>(),
        xor in 1u8..,
    ) {
        // Selector 1: client side, a greeting then option replies.
        let mut stream = vec![1u8];
        nbd_proto::handshake::encode_server_greeting(HandshakeFlags::KNOWN, &mut stream);
        for (option, r) in &replies {
            encode_option_reply(*option, &r.borrow(), &mut stream).unwrap();
        }
        let clean = harness::handshake(&stream);
        prop_assert!(clean.is_clean(), "{:?}", clean);
        prop_assert_eq!(clean.messages, replies.len() + 1);
        let i = flip.index(stream.len() - 1) + 1;
        stream[i] ^= xor;
        let _ = harness::handshake(&stream);
    }

    #[test]
    fn harness_on_mutated_request_streams(
        mode in mode(),
        reqs in vec((command(), any::<u16>(), any::<u64>(), any::<u64>(), 0u64..2048), 1..8),
        flip in any::<prop::sample::Index>(),
        xor in 1u8..,
    ) {
        let selector = match mode {
            TransmissionMode::Simple => 0,
            TransmissionMode::Structured => 2,
            TransmissionMode::Extended => 4,
        };
        let mut stream = vec![selector];
        for &(kind, flags, cookie, offset, length) in &reqs {
            let r = Request { flags: CmdFlags::from_bits(flags), kind, cookie, offset, length };
            r.encode(mode, &mut stream).unwrap();
            stream.resize(stream.len() + r.payload_len(mode) as usize, 0x77);
        }
        let clean = harness::request(&stream);
        prop_assert!(clean.is_clean(), "{:?}", clean);
        prop_assert_eq!(clean.messages, reqs.len());
        let i = flip.index(stream.len() - 1) + 1;
        stream[i] ^= xor;
        let _ = harness::request(&stream);
    }
}
