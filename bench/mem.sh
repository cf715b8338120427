#!/usr/bin/env bash
# The mem stores, A/B: `mem:SIZE,store=map` (one reserved anonymous mapping, the default)
# against `store=pages` (the sparse page table), sequential read and write, 1 MiB and 4 KiB.
#
#   bench/mem.sh [BINARY]     (default target/release/blkq: cargo build --release -p blkq)
#
# 1. In process: `blkq bench --device mem:$SIZE,store=... --rw read|write --bs 1M|4K`. Each
#    `blkq bench` run builds a fresh device, so its writes include the first touch of every
#    page (page faults for map, allocations for pages) and its reads hit holes (both stores
#    answer zeros without copying); the NBD part below prefills.
# 2. Over NBD (fio's nbd engine, Unix socket; needs fio, NBD=0 skips): `blkq serve` on each
#    store, and `nbdkit memory $SIZE allocator=malloc` (bench/peers.sh's peer) where nbdkit is
#    installed, each prefilled with 1 MiB writes over the whole device first; 1 MiB and 4 KiB
#    sequential read and write at iodepth 16, one connection. Issue #12's target: map >= 1.3x
#    nbdkit at 1 MiB.
# 3. The striped region locks' own cost (LOCKCOST=0 skips): the `lock_cost` measurement of
#    crates/drivers/tests/backend_map.rs, in release (an uncontended lock next to the copies).
#
# Every cell runs REPEATS times, the stores interleaved (map first on even rounds, pages first
# on odd ones) so drift hits both; prints mean, spread (min..max) and the ratio map/pages (and
# map/nbdkit). Throughput in MiB/s. On a shared machine say so next to the figures.
#
# Environment: REPEATS=3, RUNTIME=3 (seconds per run), SIZE=1G, IODEPTH=32 (in process),
# JOBS=1, NBD=1, LOCKCOST=1, OUT=DIR (raw results; default a new /tmp/blkq-mem.XXXXXX).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${1:-target/release/blkq}
REPEATS=${REPEATS:-3}
RUNTIME=${RUNTIME:-3}
SIZE=${SIZE:-1G}
IODEPTH=${IODEPTH:-32}
JOBS=${JOBS:-1}
NBD=${NBD:-1}
LOCKCOST=${LOCKCOST:-1}
OUT=${OUT:-$(mktemp -d /tmp/blkq-mem.XXXXXX)}
PY=/usr/bin/python3
[[ -x $BIN ]] || { echo "mem.sh: no binary $BIN (cargo build --release -p blkq)" >&2; exit 1; }
command -v "$PY" >/dev/null || { echo "mem.sh: missing $PY" >&2; exit 1; }
mkdir -p "$OUT"
results=$OUT/results.tsv
: >"$results"

# --- 1. in process -------------------------------------------------------------------------
for ((r = 0; r < REPEATS; r++)); do
  if ((r % 2 == 0)); then order="map pages"; else order="pages map"; fi
  for rw in read write; do
    for bs in 1M 4K; do
      for store in $order; do
        echo "round $r: bench $rw $bs store=$store" >&2
        bw=$("$BIN" bench --device "mem:$SIZE,store=$store" --rw "$rw" --bs "$bs" \
          --iodepth "$IODEPTH" --jobs "$JOBS" --runtime "$RUNTIME" --json |
          "$PY" -c 'import json,sys; print(json.loads(sys.stdin.read().strip().splitlines()[-1])["bw_bytes"])')
        printf 'bench %s %s\t%s\t%s\t%s\n' "$rw" "$bs" "$store" "$r" "$bw" >>"$results"
      done
    done
  done
done

# --- 2. over NBD ---------------------------------------------------------------------------
serve() { # SIDE SOCK LOG: starts a server, prints its pid
  case $1 in
    nbdkit) nbdkit -f -U "$2" memory "$SIZE" allocator=malloc >"$3" 2>&1 & ;;
    *) "$BIN" serve --device "mem:$SIZE,store=$1" --no-tcp --socket "$2" >"$3" 2>&1 & ;;
  esac
  echo $!
}

if [[ $NBD == 1 ]] && command -v fio >/dev/null; then
  sides="map pages"
  command -v nbdkit >/dev/null && sides="$sides nbdkit"
  for ((r = 0; r < REPEATS; r++)); do
    if ((r % 2 == 0)); then order=$sides; else order=$(echo "$sides" | tr ' ' '\n' | tac | tr '\n' ' '); fi
    for side in $order; do
      sock=$OUT/mem.sock
      rm -f "$sock"
      pid=$(serve "$side" "$sock" "$OUT/serve-$side-r$r.log")
      for _ in $(seq 200); do [[ -S $sock ]] && break; sleep 0.05; done
      uri="nbd+unix:///?socket=$sock"
      fio --name=prefill --ioengine=nbd --uri="$uri" --rw=write --bs=1M --iodepth=16 \
        --size="$SIZE" --output-format=json --output=/dev/null >/dev/null 2>&1
      for rw in read write; do
        for bs in 1M 4K; do
          echo "round $r: nbd $rw $bs $side" >&2
          json=$OUT/nbd-$side-r$r-$rw-$bs.json
          fio --name=mem --ioengine=nbd --uri="$uri" --rw="$rw" --bs="$bs" --iodepth=16 \
            --size="$SIZE" --time_based --runtime="$RUNTIME" --output-format=json \
            --output="$json" >/dev/null 2>&1
          "$PY" - "$json" "$rw" "$bs" "$side" "$r" >>"$results" <<'EOF'
import json, sys
path, rw, bs, side, rnd = sys.argv[1:]
text = open(path).read()
j = json.loads(text[text.index("{"):])["jobs"][0]
print(f"nbd {rw} {bs}\t{side}\t{rnd}\t{j[rw]['bw_bytes']}")
EOF
        done
      done
      kill -INT "$pid" 2>/dev/null || true
      wait "$pid" 2>/dev/null || true
    done
  done
elif [[ $NBD == 1 ]]; then
  echo "mem.sh: no fio, the NBD part is skipped" >&2
fi

# --- the table -----------------------------------------------------------------------------
"$PY" - "$results" "$SIZE" "$REPEATS" <<'EOF'
import sys, statistics
path, size, repeats = sys.argv[1:]
rows = [l.rstrip("\n").split("\t") for l in open(path) if l.strip()]
cells, data = [], {}
for cell, side, rnd, v in rows:
    if cell not in cells:
        cells.append(cell)
    data.setdefault((cell, side), []).append(float(v) / (1 << 20))
def fmt(xs):
    if not xs:
        return "-"
    return f"{statistics.mean(xs):,.0f} ({min(xs):,.0f}..{max(xs):,.0f})"
def ratio(a, b):
    return f"{statistics.mean(a) / statistics.mean(b):.2f}" if a and b and statistics.mean(b) else "-"
print(f"mem:{size}, {repeats} runs per cell, MiB/s: mean (min..max)\n")
print("| cell | store=map | store=pages | nbdkit memory | map/pages | map/nbdkit |")
print("|---|--:|--:|--:|--:|--:|")
for c in cells:
    m, p, n = (data.get((c, s), []) for s in ("map", "pages", "nbdkit"))
    print(f"| {c} | {fmt(m)} | {fmt(p)} | {fmt(n)} | {ratio(m, p)} | {ratio(m, n)} |")
EOF

# --- 3. the locks' own cost ----------------------------------------------------------------
if [[ $LOCKCOST == 1 ]] && command -v cargo >/dev/null; then
  echo
  echo "striped-lock cost (release, uncontended; crates/drivers/tests/backend_map.rs lock_cost):"
  cargo test -q --release -p blk-drivers --test backend_map lock_cost -- --ignored --nocapture 2>/dev/null |
    grep -E 'RwLock|B:' || echo "(lock_cost did not run)"
fi
echo "raw results: $OUT" >&2
