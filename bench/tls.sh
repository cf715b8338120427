#!/usr/bin/env bash
# The cost of TLS: `blkq serve` over its Unix socket, one connection, mem:1G, fio's nbd engine,
# with and without TLS in the same run, interleaved (plain then TLS on even rounds, TLS then
# plain on odd ones): 4 KiB randread at iodepth 64 and 1 MiB sequential read at iodepth 8.
#
#   bench/tls.sh [BINARY]        (default target/release/blkq)
#
# Prints a markdown table: per cell the median and min..max over the rounds, for plain and
# TLS, and TLS/plain. Certificates are made in the output directory by `blkq certs`; fio's
# engine cannot take tls-certificates= in its URI (libnbd forbids local files there), so it
# reads them from libnbd's default directory, $HOME/.pki/libnbd, with HOME pointed there.
#
# Environment: ROUNDS=3, R=10 (seconds per fio run), SIZE=1G, OUT=DIR (raw results; default a
# new /tmp/blkq-tls.XXXXXX).
set -euo pipefail
BIN=${1:-target/release/blkq}
ROUNDS=${ROUNDS:-3}
R=${R:-10}
SIZE=${SIZE:-1G}
OUT=${OUT:-$(mktemp -d /tmp/blkq-tls.XXXXXX)}
mkdir -p "$OUT"
PY=/usr/bin/python3
for tool in fio "$PY" "$BIN"; do
  command -v "$tool" >/dev/null || { echo "tls.sh: missing $tool" >&2; exit 1; }
done

"$BIN" certs "$OUT/home/.pki/libnbd" >/dev/null
PKI=$OUT/home/.pki/libnbd
results=$OUT/results.tsv
: >"$results"

# cells LABEL ROUND: one server (plain or TLS), both cells against it.
cells() {
  local label=$1 round=$2 sock=$OUT/tls.sock pid uri json tls=()
  rm -f "$sock"
  if [[ $label == tls ]]; then
    tls=(--tls require --tls-certificates "$PKI")
    uri="nbds+unix:///?socket=$sock"
  else
    uri="nbd+unix:///?socket=$sock"
  fi
  "$BIN" serve --device "mem:$SIZE" --no-tcp --socket "$sock" "${tls[@]}" >"$OUT/serve-$label.log" 2>&1 &
  pid=$!
  for _ in $(seq 100); do [[ -S $sock ]] && break; sleep 0.05; done
  HOME=$OUT/home fio --name=prefill --ioengine=nbd --uri="$uri" --rw=write --bs=1M --iodepth=8 \
    --size="$SIZE" --output-format=json --output=/dev/null >/dev/null 2>&1
  for cell in "randread 4k 64" "read 1m 8"; do
    set -- $cell
    json=$OUT/$label-r$round-$1-$2.json
    HOME=$OUT/home fio --name=tls --ioengine=nbd --uri="$uri" --rw="$1" --bs="$2" --iodepth="$3" \
      --numjobs=1 --time_based --runtime="$R" --norandommap --randrepeat=0 \
      --output-format=json --output="$json" >/dev/null 2>&1 || {
      echo "tls.sh: fio failed ($label $cell), see $json" >&2
      exit 1
    }
    "$PY" - "$json" "$1 $2 qd$3" "$label" "$round" >>"$results" <<'EOF'
import json, sys
path, cell, label, rnd = sys.argv[1:]
text = open(path).read()
j = json.loads(text[text.index("{"):])["jobs"][0]["read"]
print(f"{cell}\t{label}\t{rnd}\t{j['iops']:.1f}\t{j['bw_bytes'] / 2**20:.1f}")
EOF
  done
  kill -INT "$pid"
  wait "$pid" || true
}

for ((r = 0; r < ROUNDS; r++)); do
  if ((r % 2 == 0)); then order="plain tls"; else order="tls plain"; fi
  for label in $order; do
    echo "round $r: $label" >&2
    cells "$label" "$r"
  done
done

"$PY" - "$results" <<'EOF'
import sys, statistics
rows = [l.rstrip("\n").split("\t") for l in open(sys.argv[1]) if l.strip()]
cells, data = [], {}
for cell, label, rnd, iops, mib in rows:
    if cell not in cells:
        cells.append(cell)
    data.setdefault((cell, label), []).append((float(iops), float(mib)))
print("| cell (1 connection, unix, mem) | plain IOPS median (min..max) | TLS IOPS median (min..max) | plain MiB/s | TLS MiB/s | TLS/plain |")
print("|---|--:|--:|--:|--:|--:|")
for c in cells:
    p, t = data.get((c, "plain"), []), data.get((c, "tls"), [])
    pi, ti = [x[0] for x in p], [x[0] for x in t]
    mp, mt = statistics.median(pi), statistics.median(ti)
    fmt = lambda m, xs: f"{m:,.0f} ({min(xs):,.0f}..{max(xs):,.0f})"
    bw = lambda xs: statistics.median([x[1] for x in xs])
    print(f"| {c} | {fmt(mp, pi)} | {fmt(mt, ti)} | {bw(p):,.0f} | {bw(t):,.0f} | {mt / mp:.2f} |")
EOF
echo "raw results: $OUT" >&2
