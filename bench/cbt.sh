#!/usr/bin/env bash
# What a dirty bitmap costs (docs/bench.md section 21), against `blkq serve` over its Unix
# socket with fio's nbd engine and libnbd, one binary:
#
#   bench/cbt.sh BLKQ_BINARY [steady|core|first|sizes|all]
#
# steady: 4 KiB randwrite (iodepth 16) and 1 MiB sequential write (iodepth 4) on mem:$SIZE
#   with no wrapper (bitmaps=off), the wrapper and no bitmap (zero), one 64 KiB bitmap whose
#   granules are all durable (one: the steady state, prefilled first), and the same with the
#   locked gate (locked). Variants interleaved in every round, their order rotated.
# first: the first write to a clean granule against a write to a durable one: 4 KiB random
#   writes to distinct 4 KiB blocks (granularity 4K, fio's random map) at iodepth 1 and 16 on
#   one connection and iodepth 4 on each of 4 connections (a quarter of the device each), a
#   fresh bitmap (pass "first") then the same offsets again (pass "again"); the image and its
#   sidecar in OUT.
# core: the wrapper's cost per I/O without NBD or fio (`blkq bench`, in-process, 4 KiB
#   randwrite at iodepth 32 on null:1G per job): the queue driven as a bio-based device (bare)
#   against the wrapper with 0 and 1 bitmaps (steady state) and 1 with the locked gate, for
#   each of $JOBS jobs; variants interleaved per round. Runs where fio is missing (only
#   BLKQ_BINARY is needed): `bench/cbt.sh BLKQ_BINARY core` with JOBS="1 4 16" on many cores.
# sizes: the sidecar of one bitmap over null:1T at 4K, 64K, 1M and 64M against the format's
#   formula, and the memory per TiB.
# (An incremental backup through the dirty-bitmap context: bench/cbt_backup.sh.)
#
# Environment: ROUNDS=3, R=5 (seconds per fio run), SIZE=1G, FIRST_IOS=4000,
# OUT=DIR (raw results; default a new /tmp/blkq-cbt.XXXXXX).
set -euo pipefail
BIN=${1:?usage: bench/cbt.sh BLKQ_BINARY [steady|core|first|sizes|all]}
WHAT=${2:-all}
ROUNDS=${ROUNDS:-3}
R=${R:-5}
SIZE=${SIZE:-1G}
FIRST_IOS=${FIRST_IOS:-4000}
JOBS=${JOBS:-"1 2"}
OUT=${OUT:-$(mktemp -d /tmp/blkq-cbt.XXXXXX)}
mkdir -p "$OUT"
PY=/usr/bin/python3
for tool in "$PY" $([[ $WHAT == core ]] || echo fio nbdcopy); do
  command -v "$tool" >/dev/null || { echo "cbt.sh: missing $tool" >&2; exit 1; }
done
SOCK=$OUT/cbt.sock
CTL=$OUT/cbt.ctl
URI="nbd+unix:///?socket=$SOCK"
PID=
results=$OUT/results.tsv
: >"$results"

start() { # SPEC [serve flags...]
  rm -f "$SOCK" "$CTL"
  "$BIN" serve --device "$1" --no-tcp --socket "$SOCK" --control "$CTL" "${@:2}" \
    >>"$OUT/serve.log" 2>&1 &
  PID=$!
  for _ in $(seq 200); do [[ -S $SOCK && -S $CTL ]] && break; sleep 0.05; done
}
stop() { kill -INT "$PID"; wait "$PID" || true; }
bm() { "$BIN" bitmap "$@" --control "$CTL" >/dev/null; }

fio_json() { # OUT.json fio-args...
  local json=$1
  shift
  fio --name=cbt --ioengine=nbd --uri="$URI" --output-format=json --output="$json" "$@" \
    >/dev/null 2>&1
}

field() { # JSON EXPR(j: the job)
  "$PY" - "$1" "$2" <<'EOF2'
import json, sys
t = open(sys.argv[1]).read()
j = json.loads(t[t.index("{"):])["jobs"][0]
print(eval(sys.argv[2]))
EOF2
}

steady() {
  local variants=(off zero one locked)
  for ((r = 0; r < ROUNDS; r++)); do
    local n=${#variants[@]}
    for ((k = 0; k < n; k++)); do
      local v=${variants[$(((k + r) % n))]} spec="mem:$SIZE" extra=()
      [[ $v == off ]] && spec="mem:$SIZE,bitmaps=off"
      [[ $v == locked ]] && extra=(--bitmaps-gate locked)
      echo "steady round $r: $v" >&2
      start "$spec" "${extra[@]}"
      [[ $v == one || $v == locked ]] && bm add b
      fio_json "$OUT/prefill.json" --rw=write --bs=1M --iodepth=16 --size="$SIZE"
      local j=$OUT/steady-$v-r$r-rand.json
      fio_json "$j" --rw=randwrite --bs=4k --iodepth=16 --time_based --runtime="$R" \
        --norandommap --randrepeat=0
      printf 'steady\t4k randwrite qd16 (IOPS)\t%s\t%s\t%s\n' "$v" "$r" \
        "$(field "$j" 'j["write"]["iops"]')" >>"$results"
      j=$OUT/steady-$v-r$r-seq.json
      fio_json "$j" --rw=write --bs=1M --iodepth=4 --time_based --runtime="$R" --size="$SIZE"
      printf 'steady\t1M write qd4 (MiB/s)\t%s\t%s\t%s\n' "$v" "$r" \
        "$(field "$j" 'j["write"]["bw"] / 1024')" >>"$results"
      stop
    done
  done
}

first() {
  local img=$OUT/first.img
  truncate -s "$SIZE" "$img"
  start "file:$img"
  for ((r = 0; r < ROUNDS; r++)); do
    local quarter
    quarter=$(($(numfmt --from=iec "$SIZE") / 4))
    for cell in "1 1" "16 1" "4 4"; do
      local qd=${cell% *} jobs=${cell#* }
      bm add f --granularity 4K
      for pass in first again; do
        echo "first round $r qd$qd x$jobs: $pass" >&2
        local j=$OUT/first-r$r-qd$qd-j$jobs-$pass.json
        # Each job (connection) its own quarter of the device: distinct blocks throughout.
        fio_json "$j" --rw=randwrite --bs=4k --iodepth="$qd" --numjobs="$jobs" \
          --group_reporting --size="$quarter" --offset_increment="$quarter" \
          --number_ios=$((FIRST_IOS / jobs)) --randrepeat=1 --randseed=$((r * 100 + qd))
        printf 'first\t4k randwrite qd%s x%s conns mean latency (us)\t%s\t%s\t%s\n' "$qd" "$jobs" \
          "$pass" "$r" "$(field "$j" 'j["write"]["lat_ns"]["mean"] / 1000')" >>"$results"
        printf 'first\t4k randwrite qd%s x%s conns (IOPS)\t%s\t%s\t%s\n' "$qd" "$jobs" "$pass" "$r" \
          "$(field "$j" 'j["write"]["iops"]')" >>"$results"
      done
      bm remove f
    done
  done
  stop
  rm -f "$img" "$img.bitmaps"
}

core() {
  local variants=("bare" "0" "1" "1 locked")
  for ((r = 0; r < ROUNDS; r++)); do
    for jobs in $JOBS; do
      local n=${#variants[@]}
      for ((k = 0; k < n; k++)); do
        local v=${variants[$(((k + r) % n))]}
        local b=${v% *} gate=lockfree
        [[ $v == *locked ]] && gate=locked
        echo "core round $r jobs $jobs: $v" >&2
        local iops
        iops=$("$BIN" bench --device null:1G --rw randwrite --iodepth 32 --jobs "$jobs" \
          --runtime "$R" --dirty-bitmaps "$b" --dirty-bitmaps-gate "$gate" --json |
          "$PY" -c 'import json,sys; print(json.loads(sys.stdin.read().strip().splitlines()[-1])["iops"])')
        printf 'core\tnull 4k randwrite qd32 x%s jobs (IOPS)\t%s\t%s\t%s\n' "$jobs" \
          "${v/ /-}" "$r" "$iops" >>"$results"
      done
    done
  done
}

sizes() {
  local side=$OUT/sizes.bitmaps
  for g in 4K 64K 1M 64M; do
    rm -f "$side"
    start "null:1T,bitmaps=$side"
    bm add s --granularity "$g"
    local real
    real=$(stat -c %s "$side")
    stop
    "$PY" - "$g" "$real" >>"$OUT/sizes.txt" <<'EOF2'
import sys
g, real = sys.argv[1], int(sys.argv[2])
gran = {"4K": 4096, "64K": 65536, "1M": 1 << 20, "64M": 64 << 20}[g]
tib = 1 << 40
bits = tib // gran
pages = -(-bits // 32704)
formula = (2 + pages) * 4096
mem = 2 * (-(-bits // 64)) * 8
print(f"| {g} | {bits:,} | {mem / 1024:,.0f} KiB | {pages * 4096 / 1024:,.0f} KiB | {formula:,} | {real:,} |")
EOF2
  done
  echo "| granularity | bits per TiB | memory per TiB (dirty + durable) | sidecar per TiB (bit pages) | sidecar file, formula (1 TiB, one bitmap) | sidecar file, measured |" 
  echo "|---|--:|--:|--:|--:|--:|"
  cat "$OUT/sizes.txt"
}

case $WHAT in
  steady) steady ;;
  core) core ;;
  first) first ;;
  sizes) sizes ;;
  all) sizes; core; steady; first ;;
  *) echo "cbt.sh: unknown part $WHAT" >&2; exit 2 ;;
esac

"$PY" - "$results" <<'EOF'
import sys, statistics
rows = [l.rstrip("\n").split("\t") for l in open(sys.argv[1]) if l.strip()]
cells, data, variants = [], {}, {}
for part, cell, v, rnd, x in rows:
    key = (part, cell)
    if key not in cells:
        cells.append(key)
    variants.setdefault(key, [])
    if v not in variants[key]:
        variants[key].append(v)
    data.setdefault((key, v), []).append(float(x))
for key in cells:
    vs = variants[key]
    base = statistics.median(data[(key, vs[0])])
    parts = []
    for v in vs:
        xs = data[(key, v)]
        m = statistics.median(xs)
        parts.append(f"{v} {m:,.1f} ({min(xs):,.1f}..{max(xs):,.1f}) x{m / base:.3f}")
    print(f"| {key[0]} | {key[1]} | " + " | ".join(parts) + " |")
EOF
echo "raw results: $OUT" >&2
