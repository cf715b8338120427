#!/usr/bin/env python3
"""Writes the seed inputs of the `conn` fuzz target (corpus/conn/): what a client sends, built
from the NBD protocol (doc/proto.md): handshakes with and without options, every command, and
a few malformed variants. Re-run after changing it: python3 make_seeds.py"""
import os
import struct

IHAVEOPT = 0x49484156454F5054
REQ_MAGIC = 0x25609513
EXT_REQ_MAGIC = 0x21E41C71
OPT_EXPORT_NAME, OPT_ABORT, OPT_LIST, OPT_STARTTLS, OPT_INFO, OPT_GO = 1, 2, 3, 5, 6, 7
OPT_STRUCTURED_REPLY, OPT_LIST_META, OPT_SET_META, OPT_EXTENDED = 8, 9, 10, 11
READ, WRITE, DISC, FLUSH, TRIM, CACHE, WZ, BS = 0, 1, 2, 3, 4, 5, 6, 7
FUA, NO_HOLE, DF, REQ_ONE, FAST_ZERO = 1, 2, 4, 8, 16
CLIENT_FLAGS = struct.pack(">I", 3)  # fixed newstyle, no zeroes


def opt(code, data=b""):
    return struct.pack(">QII", IHAVEOPT, code, len(data)) + data


def name_info(name=b"", infos=()):
    return struct.pack(">I", len(name)) + name + struct.pack(">H", len(infos)) + b"".join(
        struct.pack(">H", i) for i in infos)


def meta(name=b"", queries=(b"base:allocation",)):
    return (struct.pack(">I", len(name)) + name + struct.pack(">I", len(queries))
            + b"".join(struct.pack(">I", len(q)) + q for q in queries))


def req(typ, off=0, length=0, flags=0, cookie=1, payload=b""):
    return struct.pack(">IHHQQI", REQ_MAGIC, flags, typ, cookie, off, length) + payload


def ext_req(typ, off=0, length=0, flags=0, cookie=1, payload=b""):
    return struct.pack(">IHHQQQ", EXT_REQ_MAGIC, flags, typ, cookie, off, length) + payload


go = CLIENT_FLAGS + opt(OPT_GO, name_info(b"", (0, 3)))
data = bytes(range(256)) * 2
io = (req(READ, 0, 4096, cookie=1) + req(WRITE, 4096, 512, cookie=2, payload=data)
      + req(WRITE, 8192, 512, FUA, cookie=3, payload=data) + req(FLUSH, cookie=4)
      + req(TRIM, 0, 65536, cookie=5) + req(WZ, 65536, 4096, NO_HOLE, cookie=6)
      + req(CACHE, 0, 4096, cookie=7) + req(READ, 4096, 512, cookie=8))
seeds = {
    "go_io_disc": go + io + req(DISC),
    "structured_meta_block_status": CLIENT_FLAGS + opt(OPT_STRUCTURED_REPLY)
    + opt(OPT_SET_META, meta()) + opt(OPT_GO, name_info())
    + req(READ, 0, 8192, DF, cookie=1) + req(BS, 0, 1 << 20, cookie=2)
    + req(BS, 0, 1 << 20, REQ_ONE, cookie=3) + req(DISC),
    "extended_headers": CLIENT_FLAGS + opt(OPT_EXTENDED) + opt(OPT_SET_META, meta())
    + opt(OPT_GO, name_info()) + ext_req(WRITE, 0, 512, cookie=1, payload=data)
    + ext_req(READ, 0, 512, cookie=2) + ext_req(BS, 0, 1 << 20, cookie=3) + ext_req(DISC),
    "export_name": CLIENT_FLAGS + opt(OPT_EXPORT_NAME, b"") + req(READ, 0, 512) + req(DISC),
    "list_info_list_meta_abort": CLIENT_FLAGS + opt(OPT_LIST) + opt(OPT_INFO, name_info())
    + opt(OPT_LIST_META, meta(b"", (b"base:",))) + opt(OPT_STARTTLS) + opt(OPT_ABORT),
    "unknown_export_then_go": CLIENT_FLAGS + opt(OPT_GO, name_info(b"nope"))
    + opt(OPT_GO, name_info()) + req(READ, 0, 512),
    "bad_requests": go + req(READ, 1, 512, cookie=1) + req(READ, 1 << 40, 512, cookie=2)
    + req(WRITE, 0, 64 << 20, cookie=3, payload=data) ,
    "bad_magic": CLIENT_FLAGS + struct.pack(">QII", 0x1234, OPT_GO, 4) + b"\0\0\0\0",
    "huge_option": CLIENT_FLAGS + struct.pack(">QII", IHAVEOPT, OPT_GO, 1 << 30) + b"\0" * 64,
    "bad_client_flags": struct.pack(">I", 0xFFFFFFFF) + opt(OPT_GO, name_info()),
    "unknown_command": go + req(99, 0, 512, cookie=1) + req(READ, 0, 512, 0x8000, cookie=2)
    + req(DISC),
    "empty": b"",
}
out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus", "conn")
os.makedirs(out, exist_ok=True)
for name, blob in seeds.items():
    with open(os.path.join(out, name), "wb") as f:
        f.write(blob)
print(f"{len(seeds)} seeds in {out}")
