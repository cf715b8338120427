#!/usr/bin/python3
"""Incremental backup over NBD: copy the extents a dirty bitmap marks from an export onto a
full copy, with libnbd (python3-libnbd).

    cbt-backup.py --bitmap NAME URI TARGET    copy NAME's dirty extents of URI onto TARGET
    cbt-backup.py --bitmap NAME --map URI     print NAME's dirty extents ("OFFSET LENGTH")

The bitmap is read as the metadata context `qemu:dirty-bitmap:NAME` (NBD_CMD_BLOCK_STATUS,
bit 0 = dirty), which `blkq serve` answers for a device that keeps bitmaps and
qemu-storage-daemon and qemu-nbd answer for qcow2 bitmaps. TARGET is a raw file, the full
copy taken earlier (e.g. with nbdcopy) of the same size as the export; each dirty extent is
read from the export and written at the same offset. Ends with one JSON line on stderr:
{"bytes": copied, "extents": dirty runs, "seconds": elapsed}. Take the copy from a bitmap that
no longer changes (`blkq bitmap rotate OLD NEW` first: OLD then holds every write up to the
rotation and no later one).
"""

import argparse
import collections
import json
import os
import sys
import time

import nbd

# Bytes asked per block status (32-bit requests), and per read (the server's maximum block
# size is 32 MiB; libnbd splits nothing).
STATUS_SPAN = 1 << 30
READ_SPAN = 8 << 20
# Reads kept in flight (each answered, in order, by a pwrite onto the target).
DEPTH = 16


def dirty_extents(h, context, size):
    """Yields (offset, length) of each dirty run, merged, in order."""
    offset = 0
    run = None
    while offset < size:
        span = min(STATUS_SPAN, size - offset)
        got = []

        def cb(meta, at, entries, err):
            if meta == context:
                got.extend(entries)
            return 0

        h.block_status(span, offset, cb)
        if not got:
            sys.exit(f"cbt-backup: no block status for {context} at {offset}")
        for i in range(0, len(got), 2):
            length, flags = got[i], got[i + 1]
            if length == 0:
                # An extent is never empty: asking again would get the same answer for ever.
                sys.exit(f"cbt-backup: the server answered a zero-length extent at {offset} "
                         f"for {context} (a protocol error)")
            length = min(length, size - offset)
            if length == 0:
                break
            if flags & 1:
                if run and run[0] + run[1] == offset:
                    run = (run[0], run[1] + length)
                else:
                    if run:
                        yield run
                    run = (offset, length)
            offset += length
    if run:
        yield run


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bitmap", required=True, help="the dirty bitmap's name")
    p.add_argument("--map", action="store_true", help="print the dirty extents, copy nothing")
    p.add_argument("uri", help="the export, e.g. nbd+unix:///?socket=./blkq.sock")
    p.add_argument("target", nargs="?", help="the full copy to bring up to date (raw file)")
    a = p.parse_args()
    if not a.map and not a.target:
        p.error("TARGET is needed unless --map")
    fd = None
    if not a.map:
        # The target first: a missing one is said before anything is read.
        try:
            fd = os.open(a.target, os.O_WRONLY)
        except OSError as e:
            sys.exit(f"cbt-backup: cannot open the target {a.target}: {e.strerror} "
                     "(it must be an existing full copy of the export)")
    context = "qemu:dirty-bitmap:" + a.bitmap
    h = nbd.NBD()
    h.add_meta_context(context)
    try:
        h.connect_uri(a.uri)
    except nbd.Error as e:
        sys.exit(f"cbt-backup: cannot connect to {a.uri}: {e}")
    if not h.can_meta_context(context):
        sys.exit(f"cbt-backup: the server has no {context} on this export")
    size = h.get_size()
    t0 = time.monotonic()
    copied = runs = 0
    if fd is not None:
        if os.fstat(fd).st_size != size:
            sys.exit(f"cbt-backup: {a.target} is not {size} bytes (the export's size)")
    pending = collections.deque()

    def drain(keep):
        # Waits for the oldest reads until at most `keep` are in flight, writing each out.
        while len(pending) > keep:
            cookie, buf, at = pending[0]
            while not h.aio_command_completed(cookie):  # raises if the read failed
                h.poll(-1)
            pending.popleft()
            view = memoryview(buf.to_buffer())  # the read's bytes, not a copy
            done = 0
            while done < len(view):
                done += os.pwrite(fd, view[done:], at + done)

    for offset, length in dirty_extents(h, context, size):
        runs += 1
        if a.map:
            print(offset, length)
            continue
        end = offset + length
        while offset < end:
            n = min(READ_SPAN, end - offset)
            buf = nbd.Buffer(n)
            pending.append((h.aio_pread(buf, offset), buf, offset))
            drain(DEPTH - 1)
            offset += n
            copied += n
    if fd is not None:
        drain(0)
        os.fsync(fd)
        os.close(fd)
    h.shutdown()
    stats = {"bytes": copied, "extents": runs, "seconds": round(time.monotonic() - t0, 3)}
    print(json.dumps(stats), file=sys.stderr)


if __name__ == "__main__":
    main()
