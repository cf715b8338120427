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
#    crates/blk-drivers/tests/backend_map.rs, in release (an uncontended lock next to the copies).
#
# Every cell runs REPEATS times, the stores interleaved (in order on even rounds, reversed on
# odd ones) so drift hits all; prints mean, spread (min..max) and the first store's mean over
# each other's (map/pages, map/nbdkit). Throughput in MiB/s. On a shared machine say so next to
# the figures.
#
# Environment: REPEATS=3, RUNTIME=3 (seconds per run), SIZE=1G, IODEPTH=32 (in process),
# JOBS=1, RWS="read write" and BSS="1M 4K" (the in-process cells: any `blkq bench --rw` and
# `--bs`, e.g. RWS="randwrite randrw"), STORES="map pages" (what follows `store=` in the spec;
# e.g. STORES="map map,thp=1 pages" adds the mapping with transparent huge pages,
# STORES="map map,stream=0" compares streamed writes with ordinary copies), NBD=1, LOCKCOST=1,
# OUT=DIR (raw results; default a new /tmp/blkq-mem.XXXXXX).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${1:-target/release/blkq}
REPEATS=${REPEATS:-3}
RUNTIME=${RUNTIME:-3}
SIZE=${SIZE:-1G}
IODEPTH=${IODEPTH:-32}
RWS=${RWS:-"read write"}
BSS=${BSS:-"1M 4K"}
JOBS=${JOBS:-1}
STORES=${STORES:-"map pages"}
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
reverse() { echo "$@" | tr ' ' '\n' | tac | tr '\n' ' '; }
for ((r = 0; r < REPEATS; r++)); do
  if ((r % 2 == 0)); then order=$STORES; else order=$(reverse $STORES); fi
  for rw in $RWS; do
    for bs in $BSS; do
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
  sides=$STORES
  command -v nbdkit >/dev/null && sides="$sides nbdkit"
  for ((r = 0; r < REPEATS; r++)); do
    if ((r % 2 == 0)); then order=$sides; else order=$(reverse $sides); fi
    for side in $order; do
      sock=$OUT/mem.sock
      rm -f "$sock"
      pid=$(serve "$side" "$sock" "$OUT/serve-${side//[,=]/_}-r$r.log")
      for _ in $(seq 200); do [[ -S $sock ]] && break; sleep 0.05; done
      uri="nbd+unix:///?socket=$sock"
      fio --name=prefill --ioengine=nbd --uri="$uri" --rw=write --bs=1M --iodepth=16 \
        --size="$SIZE" --output-format=json --output=/dev/null >/dev/null 2>&1
      for rw in read write; do
        for bs in 1M 4K; do
          echo "round $r: nbd $rw $bs $side" >&2
          json=$OUT/nbd-${side//[,=]/_}-r$r-$rw-$bs.json
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
"$PY" - "$results" "$SIZE" "$REPEATS" $STORES nbdkit <<'EOF'
import sys, statistics
path, size, repeats, *sides = sys.argv[1:]
rows = [l.rstrip("\n").split("\t") for l in open(path) if l.strip()]
cells, data = [], {}
for cell, side, rnd, v in rows:
    if cell not in cells:
        cells.append(cell)
    data.setdefault((cell, side), []).append(float(v) / (1 << 20))
sides = [s for s in sides if any(k[1] == s for k in data)]
def fmt(xs):
    return f"{statistics.mean(xs):,.0f} ({min(xs):,.0f}..{max(xs):,.0f})" if xs else "-"
def ratio(a, b):
    return f"{statistics.mean(a) / statistics.mean(b):.2f}" if a and b and statistics.mean(b) else "-"
name = lambda s: "nbdkit memory" if s == "nbdkit" else f"store={s}"
first, others = sides[0], sides[1:]
print(f"mem:{size}, {repeats} runs per cell, MiB/s: mean (min..max)\n")
print("| cell | " + " | ".join(name(s) for s in sides) + " | "
      + " | ".join(f"{first}/{o}" for o in others) + " |")
print("|---|" + "--:|" * (len(sides) + len(others)))
for c in cells:
    xs = [data.get((c, s), []) for s in sides]
    print(f"| {c} | " + " | ".join(fmt(x) for x in xs) + " | "
          + " | ".join(ratio(xs[0], x) for x in xs[1:]) + " |")
EOF

# --- 3. the locks' own cost ----------------------------------------------------------------
if [[ $LOCKCOST == 1 ]] && command -v cargo >/dev/null; then
  echo
  echo "striped-lock cost (release, uncontended; crates/blk-drivers/tests/backend_map.rs lock_cost):"
  cargo test -q --release -p blk-drivers --test backend_map lock_cost -- --ignored --nocapture 2>/dev/null |
    grep -E 'RwLock|B:' || echo "(lock_cost did not run)"
fi
echo "raw results: $OUT" >&2
