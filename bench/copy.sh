#!/usr/bin/env bash
# Whole-disk copies out of an NBD export by real clients, side by side: how long `qemu-img
# convert` and `nbdcopy` take to read a full export (written beforehand, so every byte is data)
# from `blkq serve` (zero-copy reads on, the default, and off: `splice=0`), `nbdkit` and
# `qemu-nbd`, and the server's CPU time per GiB. Both clients write to a null target, so the
# figure is the read side: the server, the transport and the client's receive.
#
#   qemu-img convert -n -f raw SRC --target-image-opts driver=null-co,size=SIZE
#                    (one connection, 8 coroutines, requests up to the export's maximum)
#   nbdcopy --request-size=1048576 SRC null:   (its defaults: 4 connections when the server
#                    allows multi-conn, 64 requests in flight)
#   nbdcopy1: nbdcopy --connections=1 --threads=1 --requests=8 --request-size=1048576 SRC null:
#                    (one receiving thread)
#   fio1: one fio process, fio --ioengine=nbd --rw=read --bs=1M --iodepth=8 --size=SIZE
#                    (one receiving thread, as in bench/peers.sh's 1 MiB read rows)
#
# Backends (as in bench/peers.sh): mem (blkq mem:SIZE, nbdkit memory allocator=malloc,
# qemu-nbd on a raw image in /dev/shm) and file-shm (a raw image in /dev/shm for each server:
# blkq file:IMG, nbdkit file, qemu-nbd --cache=writeback --aio=io_uring).
#
# blkq is served three ways: `blkq` (the default: per connection, the faster of zero-copy
# and copied large reads, `--splice-rule measure`), `blkq-always` (every large read spliced,
# `--splice-rule always`) and `blkq-copy` (`splice=0`: every read copied).
#
# Environment: SIZE=1G, ROUNDS=3 (servers alternated inside each cell, order rotated per
# round), BACKENDS="mem file-shm", TRANSPORTS="unix tcp", CLIENTS="qemu-img nbdcopy"
# (add nbdcopy1, fio1), SERVERS="blkq blkq-always blkq-copy nbdkit qemu-nbd" (blkq and
# blkq-copy must stay, and a peer),
# BLKQ=PATH (default target/release/blkq, built if missing), OUT=DIR (raw results).
# Prints one markdown table: per cell and server the median seconds (spread max-min over
# median) and server CPU ms per GiB; then blkq's speed over the best peer's (nbdkit or
# qemu-nbd) and over blkq with splice=0.
set -euo pipefail
cd "$(dirname "$0")/.."

SIZE=${SIZE:-1G}
ROUNDS=${ROUNDS:-3}
BACKENDS=${BACKENDS:-mem file-shm}
TRANSPORTS=${TRANSPORTS:-unix tcp}
CLIENTS=${CLIENTS:-qemu-img nbdcopy}
read -r -a SERVERS <<<"${SERVERS:-blkq blkq-always blkq-copy nbdkit qemu-nbd}"
OUT=${OUT:-$(mktemp -d /tmp/blkq-copy.XXXXXX)}
WORK=$(mktemp -d /tmp/blkq-copy-work.XXXXXX)
SHM=$(mktemp -d /dev/shm/blkq-copy.XXXXXX)
if [[ -z ${BLKQ:-} ]]; then
  cargo build --release -p blkq >&2
  BLKQ=target/release/blkq
fi
bytes=$(numfmt --from=iec "$SIZE")

die() { echo "copy.sh: $*" >&2; exit 1; }
for t in qemu-img nbdcopy nbdkit qemu-nbd fio; do
  command -v "$t" >/dev/null || die "needs $t (apt-get install qemu-utils libnbd-bin nbdkit fio)"
done

declare -A PIDS URIS
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$WORK" "$SHM"
}
trap cleanup EXIT

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

start() { # start SERVER TRANSPORT BACKEND
  local s=$1 tr=$2 be=$3 sock="$WORK/$1.sock" port img="$SHM/$1.img" pid uri
  rm -f "$sock"
  if [[ $tr == tcp ]]; then port=$(free_port); uri="nbd://127.0.0.1:$port/"; else uri="nbd+unix:///?socket=$sock"; fi
  if [[ $be == file-shm || $s == qemu-nbd ]]; then truncate -s "$SIZE" "$img"; fi
  local blkq_listen=(--no-tcp --socket "$sock") kit_listen=(-U "$sock") q_listen=(-k "$sock")
  if [[ $tr == tcp ]]; then
    blkq_listen=(--no-unix --listen "127.0.0.1:$port")
    kit_listen=(-i 127.0.0.1 -p "$port")
    q_listen=(-b 127.0.0.1 -p "$port")
  fi
  local dev="mem:$SIZE"
  [[ $be == file-shm ]] && dev="file:$img"
  case $s in
    blkq) "$BLKQ" serve --device "$dev" "${blkq_listen[@]}" >"$OUT/$s-$tr-$be.log" 2>&1 & pid=$! ;;
    blkq-always) "$BLKQ" serve --device "$dev" --splice-rule always "${blkq_listen[@]}" >"$OUT/$s-$tr-$be.log" 2>&1 & pid=$! ;;
    blkq-copy) "$BLKQ" serve --device "$dev,splice=0" "${blkq_listen[@]}" >"$OUT/$s-$tr-$be.log" 2>&1 & pid=$! ;;
    nbdkit)
      if [[ $be == mem ]]; then nbdkit -f "${kit_listen[@]}" memory "$SIZE" allocator=malloc >"$OUT/$s-$tr-$be.log" 2>&1 &
      else nbdkit -f "${kit_listen[@]}" file "$img" >"$OUT/$s-$tr-$be.log" 2>&1 & fi
      pid=$! ;;
    qemu-nbd) qemu-nbd -f raw -t -e 16 --cache=writeback --aio=io_uring "${q_listen[@]}" "$img" >"$OUT/$s-$tr-$be.log" 2>&1 & pid=$! ;;
  esac
  PIDS[$s]=$pid
  URIS[$s]=$uri
  for _ in $(seq 1 100); do
    nbdinfo --size "$uri" >/dev/null 2>&1 && break
    sleep 0.05
  done
  nbdinfo --size "$uri" >/dev/null 2>&1 || die "$s did not start: $(cat "$OUT/$s-$tr-$be.log")"
  # Every byte written: the copy reads data, not holes.
  fio --name=fill --ioengine=nbd --uri="$uri" --rw=write --bs=1M --iodepth=8 --size="$SIZE" >/dev/null 2>&1
}

stop_all() {
  for s in "${!PIDS[@]}"; do kill "${PIDS[$s]}" 2>/dev/null || true; wait "${PIDS[$s]}" 2>/dev/null || true; done
  PIDS=()
  rm -f "$SHM"/*.img
}

cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }

copy() { # copy CLIENT URI
  case $1 in
    qemu-img) qemu-img convert -n -f raw "$2" --target-image-opts "driver=null-co,size=$bytes" ;;
    nbdcopy) nbdcopy --request-size=1048576 "$2" null: ;;
    nbdcopy1) nbdcopy --connections=1 --threads=1 --requests=8 --request-size=1048576 "$2" null: ;;
    fio1) fio --name=fio1 --ioengine=nbd --uri="$2" --rw=read --bs=1M --iodepth=8 --size="$SIZE" \
      --output=/dev/null ;;
  esac
}

results="$OUT/results.tsv"
: >"$results"
hz=$(getconf CLK_TCK)
echo "copy.sh: $(date -u '+%F %T') UTC, $(nproc) vCPUs, $(uname -r); $($BLKQ --version 2>/dev/null | head -1); nbdkit $(nbdkit --version | awk '{print $2}'); $(qemu-img --version | head -1); $(nbdcopy --version | head -1); raw results in $OUT" >&2
for be in $BACKENDS; do
  for tr in $TRANSPORTS; do
    for s in "${SERVERS[@]}"; do start "$s" "$tr" "$be"; done
    for c in $CLIENTS; do
      for ((r = 0; r < ROUNDS; r++)); do
        n=${#SERVERS[@]}
        for ((k = 0; k < n; k++)); do
          s=${SERVERS[$(((k + r) % n))]}
          t0=$(cpu_ticks "${PIDS[$s]}")
          w0=$(date +%s.%N)
          copy "$c" "${URIS[$s]}"
          w1=$(date +%s.%N)
          t1=$(cpu_ticks "${PIDS[$s]}")
          printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$be" "$tr" "$c" "$s" \
            "$(python3 -c "print($w1 - $w0)")" "$(python3 -c "print(($t1 - $t0) / $hz)")" >>"$results"
        done
      done
    done
    stop_all
  done
done

python3 - "$results" "$bytes" "${SERVERS[*]}" <<'EOF'
import sys, statistics as st
from collections import defaultdict
rows = defaultdict(list)
for line in open(sys.argv[1]):
    be, tr, c, s, secs, cpu = line.split("\t")
    rows[(be, tr, c, s)].append((float(secs), float(cpu)))
gib = int(sys.argv[2]) / 2**30
servers = sys.argv[3].split()
always = "blkq-always" in servers
print("| backend | transport | client | " + " | ".join(f"{s} (s / CPU ms per GiB)" for s in servers)
      + " | blkq / best peer (speed) | blkq / blkq-copy (speed) |"
      + (" blkq-always / blkq-copy (speed) |" if always else ""))
print("|---|---|---|" + "--:|" * (len(servers) + 2 + always))
cells = sorted({k[:3] for k in rows}, key=lambda k: (k[0], k[1] != "unix", k[2]))
for cell in cells:
    med, out = {}, []
    for s in servers:
        v = rows.get(cell + (s,), [])
        if not v:
            out.append("-")
            continue
        secs = [x[0] for x in v]
        m = st.median(secs)
        med[s] = m
        spread = (max(secs) - min(secs)) / m * 100
        cpu = st.median([x[1] for x in v]) / gib * 1000
        out.append(f"{m:.2f} ±{spread:.0f}% / {cpu:,.0f}")
    best = min((med[p], p) for p in ("nbdkit", "qemu-nbd") if p in med)
    print(f"| {cell[0]} | {cell[1]} | {cell[2]} | " + " | ".join(out)
          + f" | {best[0] / med['blkq']:.2f} ({best[1]}) | {med['blkq-copy'] / med['blkq']:.2f} |"
          + (f" {med['blkq-copy'] / med['blkq-always']:.2f} |" if always and "blkq-always" in med else ""))
EOF
