#!/usr/bin/env bash
# The mirror's write and read paths on many cores (docs/bench.md section 12, "Write cost on 16
# cores"): one release binary, no fio, so it runs on a machine that has nothing but the binary.
#   1. 4K random writes, inline null legs: one leg, the shared mirror, and the shared mirror with
#      the counted completion (`completion_ref=counted`, the simple twin of `retire`);
#   2. the same with legs that complete on their own threads (`null:1G,completion=thread`);
#   3. the write-intent bitmap's sharded counts against their locked twin (inline legs);
#   4. 4K random reads over two latency-bound legs against one (the read balance).
# Each part is bench/raid1_share.sh (its tables: medians, min..max, per-round ratios).
#   bench/raid1_cores.sh [BLKQ_BINARY]     (default: target/release/blkq)
# Env: R (seconds per run, 1), ROUNDS (3), JOBS ("1 4 8 16"), READ_JOBS ("2 4 8 16").
# A smoke run: R=0.1 ROUNDS=1 JOBS=1 READ_JOBS=1 bench/raid1_cores.sh target/debug/blkq
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${1:-target/release/blkq}
export R=${R:-1} ROUNDS=${ROUNDS:-3}
JOBS=${JOBS:-1 4 8 16}
READ_JOBS=${READ_JOBS:-2 4 8 16}

echo "# bench/raid1_cores.sh $BIN, $(date -u '+%F %H:%M UTC'), $(nproc) CPUs:$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)"
echo "## 1. inline legs: the third column is completion_ref=counted"
JOBS="$JOBS" VARIANT=completion_ref=counted bench/raid1_share.sh "$BIN"
echo "## 2. thread-completing legs: the third column is completion_ref=counted"
JOBS="$JOBS" LEG=null:1G,completion=thread VARIANT=completion_ref=counted bench/raid1_share.sh "$BIN"
echo "## 3. inline legs: the third column is bitmap_counts=locked"
JOBS="$JOBS" VARIANT=bitmap_counts=locked bench/raid1_share.sh "$BIN"

echo "## 4. 4K random reads, two latency-bound legs against one (iodepth 32)"
T=completion=timer,completion_nsec=50000,hw_queue_depth=8
iops() { "$BIN" bench "$@" --rw randread --bs 4K --iodepth 32 --runtime "$R" --json 2>/dev/null |
  grep -o '"iops":[0-9.]*' | head -1 | cut -d: -f2; }
echo "| jobs | one leg (IOPS per round) | two legs | two/one per round |"
echo "|--:|---|---|---|"
for j in $READ_JOBS; do
  ones="" twos="" ratios=""
  for _ in $(seq "$ROUNDS"); do
    one=$(iops --device "null:1G,$T" --jobs "$j")
    two=$(iops --raid1 "null:1G,$T,null:1G,$T" --jobs "$j")
    ones+="$(awk -v v="$one" 'BEGIN { printf "%.1fK ", v / 1000 }')"
    twos+="$(awk -v v="$two" 'BEGIN { printf "%.1fK ", v / 1000 }')"
    ratios+="$(awk -v a="$two" -v b="$one" 'BEGIN { printf "%.2f ", a / b }')"
  done
  echo "| $j | $ones| $twos| $ratios|"
done
