#!/usr/bin/env bash
# A/B: two builds of blkq, measured interleaved in one run, on the figures a refactor must not
# move: the per-core ceiling (docs/bench.md section 5) and `blkq serve` over the Unix socket at
# iodepth 16 and 64 (section 8's unix rows), 4 KiB randread and randwrite, 1 and 2 connections.
#
#   bench/ab.sh OLD_BINARY NEW_BINARY
#
# Each round runs every cell on A then B (or B then A on odd rounds, so neither always goes
# first); prints per-cell medians, min..max over the rounds, and B/A.
#
# Environment: ROUNDS=3, R=5 (seconds per fio run), CORE_RUNTIME=3 (seconds per bench run),
# SIZE=1G, OUT=DIR (raw results; default a new /tmp/blkq-ab.XXXXXX); to re-run a subset:
# RWS="randread randwrite", CONNS="1 2", QDS="16 64", CORE=1 (0 skips the per-core cell).
set -euo pipefail
A=${1:?usage: bench/ab.sh OLD_BINARY NEW_BINARY}
B=${2:?usage: bench/ab.sh OLD_BINARY NEW_BINARY}
ROUNDS=${ROUNDS:-3}
R=${R:-5}
CORE_RUNTIME=${CORE_RUNTIME:-3}
SIZE=${SIZE:-1G}
RWS=${RWS:-"randread randwrite"}
CONNS=${CONNS:-"1 2"}
QDS=${QDS:-"16 64"}
CORE=${CORE:-1}
OUT=${OUT:-$(mktemp -d /tmp/blkq-ab.XXXXXX)}
mkdir -p "$OUT"
PY=/usr/bin/python3
for tool in fio taskset "$PY"; do
  command -v "$tool" >/dev/null || { echo "ab.sh: missing $tool" >&2; exit 1; }
done

results=$OUT/results.tsv
: >"$results"

core_cell() { # BIN LABEL ROUND
  local v
  v=$(taskset -c 1 "$1" bench --device null:1G --rw randread --iodepth 64 --jobs 1 \
    --runtime "$CORE_RUNTIME" --json | "$PY" -c 'import json,sys; print(json.loads(sys.stdin.read().strip().splitlines()[-1])["iops"])')
  printf 'core\t%s\t%s\t%s\n' "$2" "$3" "$v" >>"$results"
}

nbd_cells() { # BIN LABEL ROUND
  local bin=$1 label=$2 round=$3 sock=$OUT/ab.sock pid rw qd conns json
  rm -f "$sock"
  "$bin" serve --device "mem:$SIZE" --no-tcp --socket "$sock" >"$OUT/serve-$label.log" 2>&1 &
  pid=$!
  for _ in $(seq 100); do [[ -S $sock ]] && break; sleep 0.05; done
  local uri="nbd+unix:///?socket=$sock"
  fio --name=prefill --ioengine=nbd --uri="$uri" --rw=write --bs=1M --iodepth=16 \
    --size="$SIZE" --output-format=json --output=/dev/null >/dev/null 2>&1
  for rw in $RWS; do
    for conns in $CONNS; do
      for qd in $QDS; do
        json=$OUT/$label-r$round-$rw-c$conns-qd$qd.json
        fio --name=ab --ioengine=nbd --uri="$uri" --rw="$rw" --bs=4k --iodepth="$qd" \
          --numjobs="$conns" --group_reporting --time_based --runtime="$R" --norandommap \
          --randrepeat=0 --output-format=json --output="$json" >/dev/null 2>&1
        "$PY" - "$json" "$rw" "$conns" "$qd" "$label" "$round" >>"$results" <<'EOF'
import json, sys
path, rw, conns, qd, label, rnd = sys.argv[1:]
text = open(path).read()
j = json.loads(text[text.index("{"):])["jobs"][0]
side = j["read"] if rw == "randread" else j["write"]
print(f"unix {rw} c{conns} qd{qd}\t{label}\t{rnd}\t{side['iops']:.0f}")
EOF
      done
    done
  done
  kill -INT "$pid"
  wait "$pid" || true
}

for ((r = 0; r < ROUNDS; r++)); do
  if ((r % 2 == 0)); then order="A B"; else order="B A"; fi
  for side in $order; do
    bin=$A
    [[ $side == B ]] && bin=$B
    echo "round $r: $side" >&2
    if [[ $CORE == 1 ]]; then core_cell "$bin" "$side" "$r"; fi
    nbd_cells "$bin" "$side" "$r"
  done
done

"$PY" - "$results" <<'EOF'
import sys, statistics
rows = [l.rstrip("\n").split("\t") for l in open(sys.argv[1]) if l.strip()]
cells = []
data = {}
for cell, side, rnd, v in rows:
    if cell not in cells:
        cells.append(cell)
    data.setdefault((cell, side), []).append(float(v))
print("| cell | A median (min..max) | B median (min..max) | B/A |")
print("|---|--:|--:|--:|")
for c in cells:
    a, b = data.get((c, "A"), []), data.get((c, "B"), [])
    ma, mb = statistics.median(a), statistics.median(b)
    fmt = lambda m, xs: f"{m:,.0f} ({min(xs):,.0f}..{max(xs):,.0f})"
    name = "per-core null randread qd64 (IOPS)" if c == "core" else c + " (IOPS)"
    print(f"| {name} | {fmt(ma, a)} | {fmt(mb, b)} | {mb / ma:.2f} |")
EOF
echo "raw results: $OUT" >&2
