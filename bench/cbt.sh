#!/usr/bin/env bash
# What a dirty bitmap costs (docs/bench.md section 21), against `blkq serve` over its Unix
# socket with fio's nbd engine and libnbd, one binary:
#
#   bench/cbt.sh BLKQ_BINARY [steady|first|sizes|backup|all]
#
# steady: 4 KiB randwrite (iodepth 16) and 1 MiB sequential write (iodepth 4) on mem:$SIZE
#   with no wrapper (bitmaps=off), the wrapper and no bitmap (zero), one 64 KiB bitmap whose
#   granules are all durable (one: the steady state, prefilled first), and the same with the
#   locked gate (locked). Variants interleaved in every round, their order rotated.
# first: the first write to a clean granule against a write to a durable one: 4 KiB random
#   writes at iodepth 1 and 16 to distinct 4 KiB blocks (granularity 4K, fio's random map), a
#   fresh bitmap (pass "first") then the same offsets again (pass "again"); the sidecar on the
#   file system of $DIR (default: beside OUT).
# sizes: the sidecar of one bitmap over null:1T at 4K, 64K, 1M and 64M against the format's
#   formula, and the memory per TiB.
# backup: a full copy of mem:$SIZE (nbdcopy) against an incremental one after $CHANGE% of it
#   was rewritten in 64 KiB writes: rotate, then copy the runs the frozen bitmap marks (read
#   from its sidecar; libnbd pread), bytes and seconds.
#
# Environment: ROUNDS=3, R=5 (seconds per fio run), SIZE=1G, CHANGE=5, FIRST_IOS=4000,
# OUT=DIR (raw results; default a new /tmp/blkq-cbt.XXXXXX).
set -euo pipefail
BIN=${1:?usage: bench/cbt.sh BLKQ_BINARY [steady|first|sizes|backup|all]}
WHAT=${2:-all}
ROUNDS=${ROUNDS:-3}
R=${R:-5}
SIZE=${SIZE:-1G}
CHANGE=${CHANGE:-5}
FIRST_IOS=${FIRST_IOS:-4000}
OUT=${OUT:-$(mktemp -d /tmp/blkq-cbt.XXXXXX)}
mkdir -p "$OUT"
PY=/usr/bin/python3
for tool in fio nbdcopy "$PY"; do
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
    for qd in 1 16; do
      bm add f --granularity 4K
      for pass in first again; do
        echo "first round $r qd$qd: $pass" >&2
        local j=$OUT/first-r$r-qd$qd-$pass.json
        fio_json "$j" --rw=randwrite --bs=4k --iodepth="$qd" --size="$SIZE" \
          --number_ios="$FIRST_IOS" --randrepeat=1 --randseed=$((r * 100 + qd))
        printf 'first\t4k randwrite qd%s mean latency (us)\t%s\t%s\t%s\n' "$qd" "$pass" "$r" \
          "$(field "$j" 'j["write"]["lat_ns"]["mean"] / 1000')" >>"$results"
        printf 'first\t4k randwrite qd%s (IOPS)\t%s\t%s\t%s\n' "$qd" "$pass" "$r" \
          "$(field "$j" 'j["write"]["iops"]')" >>"$results"
      done
      bm remove f
    done
  done
  stop
  rm -f "$img" "$img.bitmaps"
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

backup() {
  local side=$OUT/backup.bitmaps
  for ((r = 0; r < ROUNDS; r++)); do
    rm -f "$side"
    echo "backup round $r" >&2
    start "mem:$SIZE,bitmaps=$side"
    fio_json "$OUT/fill.json" --rw=write --bs=1M --iodepth=16 --size="$SIZE"
    bm add b0
    local t0 t1
    t0=$(date +%s.%N)
    nbdcopy "$URI" "$OUT/full.img"
    t1=$(date +%s.%N)
    printf 'backup\tfull copy (s)\tnbdcopy\t%s\t%s\n' "$r" "$(echo "$t1 - $t0" | bc)" >>"$results"
    printf 'backup\tfull copy (MiB)\tnbdcopy\t%s\t%s\n' "$r" "$(($(stat -c %s "$OUT/full.img") >> 20))" >>"$results"
    local change_ios
    change_ios=$("$PY" -c "print(int($(numfmt --from=iec "$SIZE") * $CHANGE / 100 / 65536))")
    fio_json "$OUT/change.json" --rw=randwrite --bs=64k --iodepth=16 --size="$SIZE" \
      --number_ios="$change_ios" --randrepeat=0
    bm rotate b0 b1
    "$PY" - "$side" "$SOCK" "$OUT/full.img" "$r" >>"$results" <<'EOF2'
import nbd, struct, sys, time
side, sock, backup, rnd = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
b = open(side, "rb").read()
heads = [b[0:4096], b[4096:8192]]
best = max((h for h in heads if h[:8] == b"BLKQCBT1"), key=lambda h: struct.unpack_from("<Q", h, 16)[0])
size = struct.unpack_from("<Q", best, 24)[0]
n = struct.unpack_from("<I", best, 48)[0]
for i in range(n):
    at = 64 + i * 128
    name = best[at + 1: at + 1 + best[at]].decode()
    if name == "b0":
        shift, region, pages = best[at + 96], *struct.unpack_from("<QQ", best, at + 104)
words = []
for p in range(pages):
    page = b[(region + p) * 4096:(region + p + 1) * 4096]
    words += struct.unpack_from("<511Q", page, 0)
runs, g, nbits = [], 1 << shift, -(-size >> shift)
i = 0
while i < nbits:
    if words[i // 64] >> (i % 64) & 1:
        j = i
        while j < nbits and words[j // 64] >> (j % 64) & 1:
            j += 1
        runs.append((i * g, min(j * g, size) - i * g))
        i = j
    else:
        i += 1
h = nbd.NBD()
h.connect_uri(f"nbd+unix:///?socket={sock}")
t0 = time.monotonic()
copied = 0
with open(backup, "r+b") as f:
    for off, ln in runs:
        for o in range(off, off + ln, 1 << 20):
            m = min(1 << 20, off + ln - o)
            f.seek(o)
            f.write(h.pread(m, o))
            copied += m
t = time.monotonic() - t0
h.shutdown()
print(f"backup\tincremental copy (s)\tbitmap\t{rnd}\t{t:.3f}")
print(f"backup\tincremental copy (MiB)\tbitmap\t{rnd}\t{copied / 2**20:.1f}")
EOF2
    stop
    rm -f "$OUT/full.img"
  done
}

case $WHAT in
  steady) steady ;;
  first) first ;;
  sizes) sizes ;;
  backup) backup ;;
  all) sizes; steady; first; backup ;;
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
