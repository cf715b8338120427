#!/usr/bin/env bash
# An incremental backup against a full copy, through real clients (docs/bench.md section
# "21b. Incremental backup"). For each change rate and bitmap granularity, in each round: a
# `file:` export of SIZE (every byte data) served by `blkq serve --control`, a bitmap added,
#
#   full:         nbdcopy URI COPY                                  (timed; SIZE bytes)
#   writes:       fio, nbd engine, RATE% of the 4 KiB blocks, random, each once
#   rotate:       blkq bitmap rotate b0 b1
#   incremental:  scripts/cbt-backup.py --bitmap b0 URI COPY        (timed; its bytes)
#   check:        qemu-img compare COPY URI                         (must be equal)
#
# Images and copies in /dev/shm, so the figure is the NBD path and the clients, not a disk.
# Environment: SIZE=1G, ROUNDS=3, RATES="1 10" (percent), GRANS="64K 4K", BLKQ=PATH (default
# target/release/blkq, built if missing). Prints one markdown table: per cell, the medians
# (min..max) of the full and the incremental copy's seconds, the incremental's bytes, and the
# ratios incremental/full of time and bytes.
set -euo pipefail
cd "$(dirname "$0")/.."

SIZE=${SIZE:-1G}
ROUNDS=${ROUNDS:-3}
RATES=${RATES:-1 10}
GRANS=${GRANS:-64K 4K}
PY=/usr/bin/python3
SCRIPT=$PWD/scripts/cbt-backup.py
if [[ -z ${BLKQ:-} ]]; then
  cargo build --release -p blkq >&2
  BLKQ=target/release/blkq
fi
bytes=$(numfmt --from=iec "$SIZE")

die() { echo "cbt_backup.sh: $*" >&2; exit 1; }
for t in nbdcopy qemu-img fio; do
  command -v "$t" >/dev/null || die "needs $t (apt-get install qemu-utils libnbd-bin fio)"
done
"$PY" -c 'import nbd' || die "needs python3-libnbd"

SHM=$(mktemp -d /dev/shm/blkq-cbt.XXXXXX)
PID=
cleanup() {
  [[ -n $PID ]] && kill "$PID" 2>/dev/null || true
  wait 2>/dev/null || true
  rm -rf "$SHM"
}
trap cleanup EXIT

# The source image, data everywhere (copied for each cell).
head -c "$bytes" /dev/urandom >"$SHM/base.img"

now() { date +%s.%N; }

cell() { # cell RATE GRAN ROUND: prints "full_s incr_s incr_bytes"
  local rate=$1 gran=$2 round=$3 img="$SHM/disk.img" copy="$SHM/copy.img"
  local sock="$SHM/nbd.sock" ctl="$SHM/ctl.sock" uri t0 t1 t2 out
  # A new image each time: the old one carries the identity of its (removed) sidecar.
  rm -f "$sock" "$ctl" "$copy" "$img" "$img".*
  cp "$SHM/base.img" "$img"
  "$BLKQ" serve --device "file:$img" --no-tcp --socket "$sock" --control "$ctl" \
    >"$SHM/serve.log" 2>&1 &
  PID=$!
  for _ in $(seq 200); do [[ -S $sock && -S $ctl ]] && break; sleep 0.05; done
  [[ -S $sock ]] || die "the server did not start: $(grep -v "^ " "$SHM/serve.log" | tail -5)"
  uri="nbd+unix:///?socket=$sock"
  "$BLKQ" bitmap add b0 --granularity "$gran" --control "$ctl" >/dev/null
  t0=$(now)
  nbdcopy "$uri" "$copy"
  t1=$(now)
  fio --name=w --ioengine=nbd --uri="$uri" --rw=randwrite --bs=4k --size="$bytes" \
    --io_size=$((bytes * rate / 100)) --randseed="$round" --iodepth=16 >/dev/null
  "$BLKQ" bitmap rotate b0 b1 --control "$ctl" >/dev/null
  t2=$(now)
  out=$("$SCRIPT" --bitmap b0 "$uri" "$copy" 2>&1 >/dev/null)
  local t3
  t3=$(now)
  qemu-img compare -q -f raw -F raw "$copy" "$uri" || die "the copy differs from the export"
  kill "$PID"
  wait "$PID" 2>/dev/null || true
  PID=
  local copied
  copied=$("$PY" -c 'import json,sys; print(json.loads(sys.argv[1])["bytes"])' "$out")
  echo "$(echo "$t1 - $t0" | bc) $(echo "$t3 - $t2" | bc) $copied"
}

declare -A FULL INCR BYTES
for round in $(seq "$ROUNDS"); do
  for rate in $RATES; do
    for gran in $GRANS; do
      read -r f i b < <(cell "$rate" "$gran" "$round")
      FULL[$rate,$gran]+="$f "
      INCR[$rate,$gran]+="$i "
      BYTES[$rate,$gran]+="$b "
      echo "round $round rate $rate% gran $gran: full ${f}s, incremental ${i}s, ${b} bytes" >&2
    done
  done
done

stats() { # stats VALUES...: "median (min..max)"
  printf '%s\n' "$@" | sort -g | awk '{v[NR]=$1} END {m=(NR%2)?v[(NR+1)/2]:(v[NR/2]+v[NR/2+1])/2; printf "%.3g (%.3g..%.3g)", m, v[1], v[NR]}'
}
median() { printf '%s\n' "$@" | sort -g | awk '{v[NR]=$1} END {print (NR%2)?v[(NR+1)/2]:(v[NR/2]+v[NR/2+1])/2}'; }

echo "| change (4 KiB random writes) | granularity | full copy s | incremental s | incremental bytes | time incr/full | bytes incr/full |"
echo "|---|---|---|---|---|---|---|"
for rate in $RATES; do
  for gran in $GRANS; do
    read -ra f <<<"${FULL[$rate,$gran]}"
    read -ra i <<<"${INCR[$rate,$gran]}"
    read -ra b <<<"${BYTES[$rate,$gran]}"
    fm=$(median "${f[@]}")
    im=$(median "${i[@]}")
    bm=$(median "${b[@]}")
    printf '| %s%% | %s | %s | %s | %s MiB | %.3f | %.3f |\n' "$rate" "$gran" "$(stats "${f[@]}")" \
      "$(stats "${i[@]}")" "$(echo "$bm / 1048576" | bc -l | xargs printf "%.1f")" \
      "$(echo "$im / $fm" | bc -l)" "$(echo "$bm / $bytes" | bc -l)"
  done
done
