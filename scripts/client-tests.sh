#!/usr/bin/env bash
# Real-client tests of `blkq serve`: clients nobody here wrote (qemu-img, qemu-io, nbdinfo,
# nbdcopy, nbdsh / libnbd's Python binding, fio's nbd engine) against the release binary (or
# BLKQ_BIN),
# in plaintext and again over TLS (certificates made by `blkq certs`, never committed).
#
# Needs: qemu-utils libnbd-bin python3-libnbd fio curl (scripts/test.sh installs them as root).
# Each step prints what it checks; the first failure exits non-zero; the servers are always
# killed on exit.
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n--> %s\n' "$*"; }
ok() { printf '    ok: %s\n' "$*"; }
fail() {
  printf '    FAILED: %s\n' "$*" >&2
  exit 1
}

# libnbd's Python binding is installed for the system interpreter, not for whatever python3
# comes first on PATH.
PY=/usr/bin/python3
for tool in qemu-img qemu-io nbdinfo nbdcopy nbdsh fio sha256sum curl "$PY"; do
  command -v "$tool" >/dev/null || fail "missing $tool (apt-get install qemu-utils libnbd-bin python3-libnbd fio)"
done
"$PY" -c 'import nbd' || fail "python3-libnbd is not installed for $PY"

# BLKQ_BIN=PATH: test that binary instead of building the release one (scripts/test.sh passes
# the debug build its own tests just made: the same code, without a second, LTO build).
if [[ -n ${BLKQ_BIN:-} ]]; then
  BIN=$(realpath "$BLKQ_BIN")
  [[ -x $BIN ]] || fail "BLKQ_BIN=$BLKQ_BIN is not an executable"
  step "the binary under test: $BIN"
else
  step "build the release binary"
  cargo build --release -p blkq
  BIN=$PWD/target/release/blkq
fi

TMP=$(mktemp -d)
PIDS=()
cleanup() {
  local rc=$?
  for pid in "${PIDS[@]}"; do
    kill -KILL "$pid" 2>/dev/null || true
  done
  if [[ $rc -ne 0 ]]; then
    for log in "$TMP"/*.log; do
      [[ -f $log ]] || continue
      echo "=== $log (last 30 lines)" >&2
      tail -n 30 "$log" >&2
    done
  fi
  rm -rf "$TMP"
  exit $rc
}
trap cleanup EXIT

free_port() {
  "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# stop PID NAME: SIGINT to the server PID, which must exit 0 ("NAME exited with N" if not).
stop() {
  kill -INT "$1"
  local rc=0
  wait "$1" || rc=$?
  ((rc == 0)) || fail "$2 exited with $rc"
}

# copy_in_out NAME TO FROM WHAT: a 64 MiB file (48 MiB of random data, then a hole) copied
# by nbdcopy into the URI TO and out of the URI FROM (4 connections, 64 requests each); the
# two files' sha256 must agree ("WHAT <sha256>" is the ok line). Files: $TMP/NAME.{bin,out}.
copy_in_out() {
  local name=$1 to=$2 from=$3 what=$4 a b
  head -c 48M /dev/urandom >"$TMP/$name.bin"
  truncate -s 64M "$TMP/$name.bin"
  nbdcopy --connections 4 --requests 64 "$TMP/$name.bin" "$to"
  nbdcopy --connections 4 --requests 64 "$from" "$TMP/$name.out"
  a=$(sha256sum <"$TMP/$name.bin" | cut -d' ' -f1)
  b=$(sha256sum <"$TMP/$name.out" | cut -d' ' -f1)
  [[ $a == "$b" ]] || fail "$what: $a != $b"
  ok "$what $a"
}

# start_server NAME SOCKET PORT ARGS...: starts `blkq serve` (its pid in SERVER_PID; not run
# in a subshell, so that the server is this shell's child), waits until both listeners answer.
# PROBE (default nbd://127.0.0.1:PORT) is the URI that must answer; a --config file as the
# first argument names the socket and the address itself (--config takes no other flag).
start_server() {
  local name=$1 sock=$2 port=$3
  shift 3
  local probe=${PROBE:-"nbd://127.0.0.1:$port"}
  local where=(--socket "$sock" --listen "127.0.0.1:$port")
  [[ ${1:-} == --config ]] && where=()
  "$BIN" serve "${where[@]}" "$@" \
    >"$TMP/$name.out" 2>"$TMP/$name.log" &
  local pid=$!
  PIDS+=("$pid")
  for _ in $(seq 1 100); do
    if [[ -S $sock ]] && nbdinfo --size "$probe" >/dev/null 2>&1; then
      SERVER_PID=$pid
      return 0
    fi
    kill -0 "$pid" 2>/dev/null || fail "server $name exited at start: $(cat "$TMP/$name.log")"
    sleep 0.1
  done
  fail "server $name did not start"
}

SOCK=$TMP/blkq.sock
PORT=$(free_port)
start_server main "$SOCK" "$PORT" \
  --device mem:256M --export "" \
  --device mem:64M --export img \
  --device mem:64M --export copy
PID=$SERVER_PID
TCP="nbd://127.0.0.1:$PORT"
UNIX="nbd+unix:///?socket=$SOCK"
echo "server pid $PID on $UNIX and $TCP"

step "blkq serve printed its URIs and an example command"
grep -q "nbd+unix:///?socket=$SOCK" "$TMP/main.out" || fail "no unix URI in: $(cat "$TMP/main.out")"
grep -q "nbd://127.0.0.1:$PORT" "$TMP/main.out" || fail "no TCP URI"
grep -q "qemu-img info nbd://127.0.0.1:$PORT" "$TMP/main.out" || fail "no example command"
ok "URIs and example printed"

step "qemu-img info: size of the default export over TCP and Unix"
qemu-img info "$TCP" | tee "$TMP/info.txt" | grep -q "virtual size: 256 MiB" || fail "$(cat "$TMP/info.txt")"
qemu-img info "$UNIX" | grep -q "virtual size: 256 MiB" || fail "unix info"
qemu-img info "$TCP/img" | grep -q "virtual size: 64 MiB" || fail "img info"
ok "256 MiB and 64 MiB"

step "qemu-img convert a generated raw image into the export and back, qemu-img compare"
SRC=$TMP/src.img
# 64 MiB: random data with zero runs in between (sparse source regions exercise zeroing).
truncate -s 64M "$SRC"
for off in 0 5 9 20 33 40 63; do
  head -c 1M /dev/urandom | dd of="$SRC" bs=1M seek=$off conv=notrunc status=none
done
qemu-img convert -n -f raw -O raw "$SRC" "$TCP/img"
qemu-img convert -f raw -O raw "$TCP/img" "$TMP/back.img"
cmp "$SRC" "$TMP/back.img" || fail "converted image differs"
qemu-img compare -f raw -F raw "$SRC" "$TCP/img" || fail "qemu-img compare"
ok "round trip identical"

step "qemu-io: write -P 0xab / read -P 0xab, aio_write at many offsets"
qemu-io -f raw -c 'write -P 0xab 1M 64k' "$UNIX" | grep -q "wrote 65536/65536" || fail "write"
qemu-io -f raw -c 'read -P 0xab 1M 64k' "$UNIX" | grep -q "read 65536/65536" || fail "read -P 0xab"
qemu-io -f raw -c 'read -P 0xcd 1M 64k' "$UNIX" >"$TMP/wrong.txt" 2>&1 || true
if grep -q "Pattern verification failed" "$TMP/wrong.txt"; then
  ok "a wrong pattern is detected"
else
  fail "read -P 0xcd should have failed"
fi
AIO=()
for i in $(seq 0 63); do AIO+=(-c "aio_write -P 0x5a $((i * 3))M 4k"); done
qemu-io -f raw "${AIO[@]}" -c aio_flush "$TCP" >/dev/null
READS=()
for i in $(seq 0 63); do READS+=(-c "read -P 0x5a $((i * 3))M 4k"); done
qemu-io -f raw "${READS[@]}" "$TCP" >"$TMP/qemu-io.txt"
[[ $(grep -c "read 4096/4096" "$TMP/qemu-io.txt") == 64 ]] || fail "aio reads: $(head "$TMP/qemu-io.txt")"
! grep -q "Pattern verification failed" "$TMP/qemu-io.txt" || fail "aio pattern"
ok "64 aio writes read back"

step "nbdinfo --list and --map"
nbdinfo --list "$TCP" >"$TMP/list.txt"
for e in 'export=""' 'export="img"' 'export="copy"'; do
  grep -qF "$e" "$TMP/list.txt" || fail "$e missing from: $(cat "$TMP/list.txt")"
done
ok "three exports listed"
# Trim the zero runs of the image export so the map has holes, then check it has both.
"$PY" - "$SOCK" <<'EOF'
import nbd, sys
h = nbd.NBD()
h.set_export_name("img")
h.connect_unix(sys.argv[1])
h.trim(4 << 20, 1 << 20)
h.flush()
h.shutdown()
EOF
nbdinfo --map "nbd+unix:///img?socket=$SOCK" >"$TMP/map.txt"
grep -q "data" "$TMP/map.txt" || fail "no data extent: $(cat "$TMP/map.txt")"
grep -q "hole" "$TMP/map.txt" || fail "no hole extent: $(cat "$TMP/map.txt")"
ok "map: $(wc -l <"$TMP/map.txt") extents, data and holes"

step "nbdcopy --connections 4 --requests 64: a file in and out, compared by sha256sum"
copy_in_out copy "nbd+unix:///copy?socket=$SOCK" "nbd://127.0.0.1:$PORT/copy" "sha256"

step "nbdsh / libnbd: error replies, each followed by a successful request; multi-conn"
"$PY" - "$UNIX" "$TCP" <<'EOF'
import errno, sys
import nbd

unix, tcp = sys.argv[1], sys.argv[2]

def conn(uri):
    h = nbd.NBD()
    # Send what a careful client would refuse to, so that the server is the one checking.
    h.set_strict_mode(0)
    h.add_meta_context(nbd.CONTEXT_BASE_ALLOCATION)
    h.connect_uri(uri)
    return h

def expect(what, want, fn):
    try:
        fn()
    except nbd.Error as e:
        # The binding gives the errno as its symbolic name ("EINVAL").
        got = getattr(errno, e.errno, e.errno) if isinstance(e.errno, str) else e.errno
        if got != want:
            sys.exit(f"    FAILED: {what}: errno {e.errno} ({e.string}), wanted {want}")
        print(f"    ok: {what} -> {errno.errorcode[want]}")
        return
    sys.exit(f"    FAILED: {what}: no error")

h = conn(unix)
size = h.get_size()
def works():
    h.pwrite(b"\x42" * 4096, 8192)
    assert h.pread(4096, 8192) == b"\x42" * 4096

expect("read past the end", errno.EINVAL, lambda: h.pread(4096, size))
works()
expect("read across the end", errno.EINVAL, lambda: h.pread(8192, size - 4096))
works()
expect("misaligned read", errno.EINVAL, lambda: h.pread(512, 100))
works()
expect("write past the end", errno.ENOSPC, lambda: h.pwrite(b"x" * 4096, size))
works()
expect("zeroes past the end", errno.ENOSPC, lambda: h.zero(4096, size))
works()
expect("trim past the end", errno.EINVAL, lambda: h.trim(4096, size))
works()
expect("read over the 32 MiB maximum", errno.EINVAL, lambda: h.pread((32 << 20) + 512, 0))
works()
# The error reply comes only after the server has read (and dropped) the whole payload: sent
# earlier, libnbd (still sending) fails with "no matching cookie found for server reply".
expect("write over the 32 MiB maximum", errno.EINVAL,
       lambda: h.pwrite(b"w" * ((32 << 20) + 512), 0))
works()
# ENOTSUP for a fast zero needs a backend that cannot zero fast; mem (the only backend here)
# always can, so it must succeed. The ENOTSUP reply itself is covered by the Rust tests
# (crates/nbd/tests/server.rs, a device that refuses fast zeroes).
assert h.can_fast_zero()
h.zero(65536, 0, nbd.CMD_FLAG_FAST_ZERO)
assert h.pread(65536, 0) == bytes(65536)
print("    ok: fast zero on mem succeeds (ENOTSUP case: see the comment)")
works()
# Block status through libnbd.
seen = []
h.block_status(1 << 20, 0, lambda meta, off, ents, err: seen.append((meta, ents)))
assert seen and seen[0][0] == nbd.CONTEXT_BASE_ALLOCATION, seen
print(f"    ok: block status {seen[0][1][:4]}...")

# Multi-conn: write on one connection (TCP), flush, read on another (Unix).
a = conn(tcp)
assert a.can_multi_conn()
data = bytes(range(256)) * 256
a.pwrite(data, 100 << 20)
a.flush()
assert h.pread(len(data), 100 << 20) == data
print("    ok: multi-conn: a write flushed on one connection is read on another")
a.shutdown()
h.shutdown()
EOF

step "a --read-only server: reads work, writes/trims/zeroes get EPERM"
ROSOCK=$TMP/ro.sock
ROPORT=$(free_port)
start_server ro "$ROSOCK" "$ROPORT" --read-only --device mem:16M
ROPID=$SERVER_PID
"$PY" - "nbd+unix:///?socket=$ROSOCK" <<'EOF'
import errno, sys
import nbd
h = nbd.NBD()
h.set_strict_mode(0)
h.connect_uri(sys.argv[1])
assert h.is_read_only()
for what, fn in [("write", lambda: h.pwrite(b"x" * 512, 0)),
                 ("trim", lambda: h.trim(4096, 0)),
                 ("zero", lambda: h.zero(4096, 0))]:
    try:
        fn()
        sys.exit(f"    FAILED: read-only {what} succeeded")
    except nbd.Error as e:
        got = getattr(errno, e.errno, e.errno) if isinstance(e.errno, str) else e.errno
        assert got == errno.EPERM, (what, e.errno)
        print(f"    ok: read-only {what} -> EPERM")
    assert h.pread(512, 0) == bytes(512)
h.shutdown()
EOF
stop "$ROPID" "read-only server"
ok "read-only server stopped cleanly"

step "fio --ioengine=nbd: random writes with crc32c verification"
# In $TMP, and without a verify state file: fio must leave nothing in the work tree.
(cd "$TMP" && fio --name=blkq-verify --ioengine=nbd --uri="$UNIX" --rw=randwrite --bs=4k \
  --iodepth=32 --size=32m --verify=crc32c --do_verify=1 --verify_state_save=0 \
  --output="$TMP/fio.txt") || fail "fio: $(cat "$TMP/fio.txt")"
grep -q "err= 0" "$TMP/fio.txt" || fail "fio reported errors: $(cat "$TMP/fio.txt")"
ok "fio verified 32 MiB of random writes"

step "RAID1: blkq serve --raid1 on two file legs: convert, compare, qemu-io, nbdcopy, raid check"
RA=$TMP/raid-a.img
RB=$TMP/raid-b.img
truncate -s 64M "$RA" "$RB"
RSOCK=$TMP/raid.sock
RPORT=$(free_port)
start_server raid "$RSOCK" "$RPORT" --raid1 "file:$RA,file:$RB" --raid1-create
RPID=$SERVER_PID
RUNIX="nbd+unix:///?socket=$RSOCK"
RSRC=$TMP/raid-src.img
head -c 32M /dev/urandom >"$RSRC"
qemu-img convert -n -f raw -O raw "$RSRC" "$RUNIX"
qemu-img compare -f raw -F raw "$RSRC" "$RUNIX" >/dev/null || fail "raid1: qemu-img compare"
ok "raid1: qemu-img convert in, compare identical"
qemu-io -f raw -c 'write -P 0xab 40M 64k' -c 'read -P 0xab 40M 64k' "$RUNIX" >"$TMP/raid-io.txt"
grep -q "read 65536/65536" "$TMP/raid-io.txt" || fail "raid1 qemu-io: $(cat "$TMP/raid-io.txt")"
! grep -q "Pattern verification failed" "$TMP/raid-io.txt" || fail "raid1 qemu-io pattern"
ok "raid1: qemu-io write -P 0xab / read -P 0xab"
nbdcopy "$RUNIX" "$TMP/raid-out.img"
A=$(sha256sum <"$RSRC" | cut -d' ' -f1)
B=$(head -c 32M "$TMP/raid-out.img" | sha256sum | cut -d' ' -f1)
[[ $A == "$B" ]] || fail "raid1 nbdcopy: sha256 $A != $B"
ok "raid1: nbdcopy out, sha256 $A"
stop "$RPID" "raid1 server"
"$BIN" raid check "file:$RA" "file:$RB" >"$TMP/raid-check.txt" || fail "raid check: $(cat "$TMP/raid-check.txt")"
grep -q "mismatch_cnt = 0" "$TMP/raid-check.txt" || fail "raid check: $(cat "$TMP/raid-check.txt")"
ok "raid1: stopped cleanly, raid check: mismatch_cnt 0"

step "ro=1 on a file device is advertised read-only (nbdinfo)"
RO1SOCK=$TMP/ro1.sock
truncate -s 16M "$TMP/ro1.img"
start_server ro1 "$RO1SOCK" "$(free_port)" --device "file:$TMP/ro1.img,ro=1"
RO1PID=$SERVER_PID
nbdinfo --json "nbd+unix:///?socket=$RO1SOCK" >"$TMP/ro1.json"
"$PY" -c 'import json,sys; d=json.load(open(sys.argv[1])); e=d["exports"][0]; assert e["is_read_only"] is True, e' \
  "$TMP/ro1.json" || fail "ro=1 not advertised: $(cat "$TMP/ro1.json")"
stop "$RO1PID" "ro=1 server"
ok "nbdinfo shows is_read_only for a ro=1 file device"

step "soak: 16 verified fio connections while other clients are killed mid-I/O; fds and RSS flat"
# Verified jobs own 8 MiB each of [0, 128M); the victims write [128M, 192M). The whole device
# is written once first, so the memory disk's own pages are resident before the baseline.
SSOCK=$TMP/soak.sock
start_server soak "$SSOCK" "$(free_port)" --device mem:192M
SPID=$SERVER_PID
SUNIX="nbd+unix:///?socket=$SSOCK"
(cd "$TMP" && fio --name=fill --ioengine=nbd --uri="$SUNIX" --rw=write --bs=1m --iodepth=8 \
  --size=192m --output="$TMP/soak-fill.txt") || fail "soak fill: $(cat "$TMP/soak-fill.txt")"
soak_fds() { ls "/proc/$SPID/fd" | wc -l; }
soak_rss() { awk '/^VmRSS/ {print $2}' "/proc/$SPID/status"; }
sleep 0.5
FD0=$(soak_fds)
RSS0=$(soak_rss)
SOAK_SECS=${SOAK_SECS:-20}
(cd "$TMP" && fio --name=soak --ioengine=nbd --uri="$SUNIX" --numjobs=16 --size=8m \
  --offset_increment=8m --rw=randwrite --bsrange=4k-64k --iodepth=8 --time_based \
  --runtime="$SOAK_SECS" --verify=crc32c --verify_backlog=32 --do_verify=1 \
  --verify_state_save=0 --group_reporting --output="$TMP/soak.txt") &
SOAK_FIO=$!
KILLS=0
end=$((SECONDS + SOAK_SECS - 2))
while ((SECONDS < end)); do
  # --thread: the job runs in the process killed below (without it, fio forks the job into
  # a child that outlives its parent and runs its 30 s: no client was killed mid-I/O, and
  # under load their connections were still open when the descriptors were counted).
  (cd "$TMP" && exec fio --thread --name=victim --ioengine=nbd --uri="$SUNIX" --offset=128m \
    --size=64m --rw=randrw --bs=64k --iodepth=32 --time_based --runtime=30 \
    --output=/dev/null) &
  victim=$!
  sleep 0.7
  kill -KILL "$victim" 2>/dev/null || true
  wait "$victim" 2>/dev/null || true
  KILLS=$((KILLS + 1))
done
wait "$SOAK_FIO" || fail "soak fio: $(cat "$TMP/soak.txt")"
grep -q "err= 0" "$TMP/soak.txt" || fail "soak: fio reported errors: $(cat "$TMP/soak.txt")"
! grep -qi "verify.*fail\|bad magic\|crc32c.*wanted" "$TMP/soak.txt" || fail "soak: verify errors"
# The killed clients' connections close; descriptors return to the baseline.
for _ in $(seq 1 100); do
  (($(soak_fds) <= FD0)) && break
  sleep 0.1
done
FD1=$(soak_fds)
RSS1=$(soak_rss)
((FD1 <= FD0)) || fail "soak: descriptors grew from $FD0 to $FD1"
# Allowance for per-connection buffer pools and allocator caches, not for leaks per request.
((RSS1 - RSS0 < 131072)) || fail "soak: RSS grew from ${RSS0} KiB to ${RSS1} KiB"
stop "$SPID" "soak server"
ok "soak: ${SOAK_SECS}s, 16 verified connections, $KILLS clients killed; fds $FD0 -> $FD1, RSS ${RSS0} -> ${RSS1} KiB"

step "TLS: blkq certs, then --tls=require over Unix and TCP (nbdinfo, qemu-img, qemu-io, nbdcopy, fio)"
PKI=$TMP/pki
"$BIN" certs "$PKI" --client client1 >/dev/null
[[ $(stat -c %a "$PKI/server-key.pem") == 600 ]] || fail "server-key.pem is not mode 0600"
[[ $(stat -c %a "$PKI/client-key.pem") == 600 ]] || fail "client-key.pem is not mode 0600"
[[ ! -e "$PKI/ca-key.pem" && $(stat -c %a "$PKI-ca/ca-key.pem") == 600 ]] \
  || fail "the CA key is not in $PKI-ca (mode 0600) only"
# A client directory without a client certificate, and one whose client certificate comes from
# another CA (qemu and libnbd read client-cert.pem / client-key.pem from the same directory).
NOCERT=$TMP/pki-nocert
mkdir -p "$NOCERT" && cp "$PKI/ca-cert.pem" "$NOCERT/"
"$BIN" certs "$TMP/pki-other" --client mallory >/dev/null
OTHER=$TMP/pki-othercert
mkdir -p "$OTHER" && cp "$PKI/ca-cert.pem" "$OTHER/"
cp "$TMP/pki-other/client-cert.pem" "$TMP/pki-other/client-key.pem" "$OTHER/"
ok "certificates made, keys 0600, the CA key outside $PKI"

# start_tls_server NAME SOCKET PORT ARGS...: like start_server, ready when nbdinfo gets in
# over TLS with the full directory (ARGS may be `--config FILE` naming SOCKET and PORT).
start_tls_server() {
  PROBE="nbds://127.0.0.1:$3/?tls-certificates=$PKI" start_server "$@"
}

TSOCK=$TMP/tls.sock
TPORT=$(free_port)
start_tls_server tls "$TSOCK" "$TPORT" --tls require --tls-certificates "$PKI" \
  --device mem:128M --export "" --device mem:64M --export copy
TPID=$SERVER_PID
TUNIX="nbds+unix:///?socket=$TSOCK&tls-certificates=$PKI"
TTCP="nbds://localhost:$TPORT/?tls-certificates=$PKI"
nbdinfo "$TUNIX" >"$TMP/tls-info.txt" || fail "nbdinfo over TLS: $(cat "$TMP/tls-info.txt")"
grep -q "with TLS" "$TMP/tls-info.txt" || fail "nbdinfo did not use TLS: $(head -3 "$TMP/tls-info.txt")"
nbdinfo --size "$TTCP" | grep -qx 134217728 || fail "nbdinfo over TLS/TCP"
ok "nbdinfo over TLS on Unix and TCP"
if nbdinfo --size "nbd+unix:///?socket=$TSOCK" >"$TMP/tls-plain.txt" 2>&1; then
  fail "a plaintext client got in under --tls=require"
fi
ok "plaintext nbdinfo refused: $(head -1 "$TMP/tls-plain.txt")"

QOBJ=(--object "tls-creds-x509,id=tls0,endpoint=client,dir=$PKI")
QUNIX="driver=nbd,path=$TSOCK,tls-creds=tls0,tls-hostname=localhost"
QTCP="driver=nbd,server.type=inet,server.host=localhost,server.port=$TPORT,tls-creds=tls0"
qemu-img info "${QOBJ[@]}" --image-opts "$QUNIX" | grep -q "virtual size: 128 MiB" || fail "qemu-img info over TLS (unix)"
qemu-img info "${QOBJ[@]}" --image-opts "$QTCP" | grep -q "virtual size: 128 MiB" || fail "qemu-img info over TLS (tcp)"
ok "qemu-img info with tls-creds-x509 on Unix and TCP"
qemu-io "${QOBJ[@]}" --image-opts "$QTCP" -c 'write -P 0xab 1M 64k' -c 'write -P 0xcd 8M 4M' \
  -c 'read -P 0xab 1M 64k' -c 'read -P 0xcd 8M 4M' >"$TMP/tls-io.txt"
[[ $(grep -c "^read " "$TMP/tls-io.txt") == 2 ]] || fail "qemu-io over TLS: $(cat "$TMP/tls-io.txt")"
! grep -q "Pattern verification failed" "$TMP/tls-io.txt" || fail "qemu-io over TLS: pattern"
ok "qemu-io write -P / read -P over TLS"
copy_in_out tls-copy "nbds+unix:///copy?socket=$TSOCK&tls-certificates=$PKI" \
  "nbds://localhost:$TPORT/copy?tls-certificates=$PKI" "nbdcopy in and out over TLS, sha256"
# fio's engine calls nbd_connect_uri without allowing local files, so a tls-certificates=
# parameter is refused; libnbd's default directory ($HOME/.pki/libnbd) is used instead.
FIOHOME=$TMP/fio-home
mkdir -p "$FIOHOME/.pki" && cp -r "$PKI" "$FIOHOME/.pki/libnbd"
(cd "$TMP" && HOME=$FIOHOME fio --name=blkq-tls-verify --ioengine=nbd --uri="nbds+unix:///?socket=$TSOCK" --rw=randwrite --bs=4k \
  --iodepth=32 --size=32m --verify=crc32c --do_verify=1 --verify_state_save=0 \
  --output="$TMP/fio-tls.txt") || fail "fio over TLS: $(cat "$TMP/fio-tls.txt")"
grep -q "err= 0" "$TMP/fio-tls.txt" || fail "fio over TLS reported errors: $(cat "$TMP/fio-tls.txt")"
ok "fio --ioengine=nbd over nbds+unix (certificates from \$HOME/.pki/libnbd) verified 32 MiB of random writes"
stop "$TPID" "TLS server"
ok "TLS server stopped cleanly"

step "TLS --tls-verify-peer: a client certificate from the CA gets in; none, or another CA's, does not"
VSOCK=$TMP/tlsv.sock
VPORT=$(free_port)
start_tls_server tlsv "$VSOCK" "$VPORT" --tls require --tls-certificates "$PKI" --tls-verify-peer \
  --device mem:16M
VPID=$SERVER_PID
qemu-img info "${QOBJ[@]}" --image-opts "driver=nbd,path=$VSOCK,tls-creds=tls0,tls-hostname=localhost" \
  | grep -q "virtual size: 16 MiB" || fail "qemu-img with a client certificate"
qemu-io "${QOBJ[@]}" --image-opts "driver=nbd,path=$VSOCK,tls-creds=tls0,tls-hostname=localhost" \
  -c 'write -P 0x11 0 64k' -c 'read -P 0x11 0 64k' >"$TMP/tlsv-io.txt"
grep -q "read 65536/65536" "$TMP/tlsv-io.txt" || fail "qemu-io with a client certificate: $(cat "$TMP/tlsv-io.txt")"
ok "qemu-img and qemu-io with client-cert.pem in the creds dir"
for dir in "$NOCERT" "$OTHER"; do
  if nbdinfo --size "nbds+unix:///?socket=$VSOCK&tls-certificates=$dir" >"$TMP/tlsv-refused.txt" 2>&1; then
    fail "verify-peer let in a client with $dir"
  fi
  if qemu-img info --object "tls-creds-x509,id=tls1,endpoint=client,dir=$dir" \
    --image-opts "driver=nbd,path=$VSOCK,tls-creds=tls1,tls-hostname=localhost" >/dev/null 2>&1; then
    fail "verify-peer let qemu-img in with $dir"
  fi
done
ok "no client certificate, and another CA's: refused (nbdinfo and qemu-img)"
stop "$VPID" "verify-peer server"
ok "verify-peer server stopped cleanly"

step "TLS subject rules from a --config file: client1 sees only the export allowed to CN=client1"
SSOCK=$TMP/tlss.sock
SPORT=$(free_port)
cat >"$TMP/subjects.toml" <<EOF
[server]
socket = "$SSOCK"
listen = "127.0.0.1:$SPORT"

[tls]
mode = "require"
certificates = "$PKI"
verify_peer = true

[[export]]
name = ""
device = "mem:16M"
allow_subjects = ["CN=client1"]

[[export]]
name = "theirs"
device = "mem:16M"
allow_subjects = ["CN=someone-else"]
EOF
start_tls_server tlss "$SSOCK" "$SPORT" --config "$TMP/subjects.toml"
SSPID=$SERVER_PID
nbdinfo --list "nbds+unix:///?socket=$SSOCK&tls-certificates=$PKI" >"$TMP/tlss-list.txt" 2>&1 \
  || fail "nbdinfo --list with subject rules: $(cat "$TMP/tlss-list.txt")"
grep -q 'export=""' "$TMP/tlss-list.txt" || fail "the CN=client1 export is not listed: $(cat "$TMP/tlss-list.txt")"
! grep -q 'theirs' "$TMP/tlss-list.txt" || fail "the CN=someone-else export is listed: $(cat "$TMP/tlss-list.txt")"
if nbdinfo --size "nbds+unix:///theirs?socket=$SSOCK&tls-certificates=$PKI" >/dev/null 2>&1; then
  fail "client1 opened the export allowed only to CN=someone-else"
fi
ok "nbdinfo --list shows only the CN=client1 export; the other is refused"
stop "$SSPID" "subject-rules server"

step "metrics: blkq serve --metrics, qemu-io I/O, curl /metrics: the disk counters moved by that much"
MSOCK=$TMP/metrics.sock
MPORT=$(free_port)
MMPORT=$(free_port)
start_server metrics "$MSOCK" "$MPORT" --device mem:64M --metrics "127.0.0.1:$MMPORT" --log-format json
MPID=$SERVER_PID
grep -q "metrics: http://127.0.0.1:$MMPORT/metrics" "$TMP/metrics.out" || fail "no metrics address printed"
metric() {
  curl -fsS "http://127.0.0.1:$MMPORT/metrics" | awk -v k="$1" '$1 == k { print $2 }'
}
disk() { metric "blkq_disk_$1{export=\"\"}"; }
R0=$(disk reads_completed_total)
W0=$(disk writes_completed_total)
F0=$(disk flush_requests_total)
RB0=$(disk read_bytes_total)
WB0=$(disk written_bytes_total)
# Written first: a read of a hole is answered without reading the device.
MIO=(-c 'write -P 0x5a 0 64k' -c 'write -P 0x5a 64k 64k' -c 'write -P 0x5a 128k 64k' -c flush)
for i in $(seq 0 9); do MIO+=(-c "read -P 0x5a $((i * 4))k 4k"); done
qemu-io -f raw "${MIO[@]}" "nbd+unix:///?socket=$MSOCK" >"$TMP/metrics-io.txt"
[[ $(grep -c "read 4096/4096" "$TMP/metrics-io.txt") == 10 ]] || fail "qemu-io: $(cat "$TMP/metrics-io.txt")"
[[ $(($(disk reads_completed_total) - R0)) == 10 ]] || fail "reads_completed moved by $(($(disk reads_completed_total) - R0)), not 10"
[[ $(($(disk read_bytes_total) - RB0)) == 40960 ]] || fail "read_bytes moved by $(($(disk read_bytes_total) - RB0))"
[[ $(($(disk writes_completed_total) - W0)) == 3 ]] || fail "writes_completed moved by $(($(disk writes_completed_total) - W0)), not 3"
[[ $(($(disk written_bytes_total) - WB0)) == 196608 ]] || fail "written_bytes moved by $(($(disk written_bytes_total) - WB0))"
# qemu may flush again when it closes the image: at least the one asked for.
(($(disk flush_requests_total) - F0 >= 1)) || fail "flush_requests did not move"
[[ $(disk io_now) == 0 ]] || fail "io_now is $(disk io_now) after the client left"
curl -fsS "http://127.0.0.1:$MMPORT/metrics" | grep -q '^blkq_nbd_connections_accepted_total ' || fail "no connection counter"
[[ $(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$MMPORT/other") == 404 ]] || fail "not 404 off /metrics"
# The log: JSON lines; the qemu-io connection's close line carries its bytes.
for _ in $(seq 1 100); do
  grep -q '"bytes_written":196608' "$TMP/metrics.log" && break
  sleep 0.1
done
"$PY" - "$TMP/metrics.log" <<'PYEOF' || fail "log: $(tail -5 "$TMP/metrics.log")"
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
close = [l for l in lines if l.get("message", "").startswith("connection closed:") and l.get("bytes_written") == 196608]
assert close and close[0]["bytes_read"] == 40960 and close[0]["requests"] >= 14, close
PYEOF
stop "$MPID" "metrics server"
ok "10 reads, 3 writes of 64 KiB, a flush: counted exactly; 404 elsewhere; JSON close line with bytes"

step "SIGINT: the server finishes, exits 0 and removes its socket"
stop "$PID" "server"
[[ ! -e $SOCK ]] || fail "socket file left behind"
grep -q "server stopped" "$TMP/main.log" || fail "no shutdown log line"
ok "clean exit"

printf '\nclient tests: all passed\n'
