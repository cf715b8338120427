#!/usr/bin/env bash
# RAID1 write cost (docs/bench.md section 12, "One buffer for every leg"): 4K random writes
# over one null leg driven as the mirror drives a leg (`--as-leg`: bio-based, data buffers)
# against a mirror of two such legs with the write's buffer shared by both legs
# (share_writes=1) and with a copy for the second leg (share_writes=0; or, with VARIANT, the
# shared mirror with another option: VARIANT=bitmap_counts=locked compares the write-intent
# bitmap's sharded counts with its locked twin). The three variants are
# interleaved in every round, at each job count; prints every run's IOPS and CPU time per
# I/O (user + system, of the whole process: on a shared box the IOPS follow the CPU the host
# leaves us, the CPU per I/O much less), then per job count the median (min..max) of each
# variant and of the per-round ratios against one leg.
#   bench/raid1_share.sh [BLKQ_BINARY]          (default: target/release/blkq)
# Env: R (seconds per run, 2), ROUNDS (5), JOBS ("1 2 4"), LEG (null:1G), BS (4K),
#      IODEPTH (32), VARIANT (share_writes=0: the third column's --raid1-option).
# A smoke run: R=0.2 ROUNDS=1 JOBS=1 bench/raid1_share.sh target/debug/blkq
set -euo pipefail
BIN=${1:-target/release/blkq}
R=${R:-2}
ROUNDS=${ROUNDS:-5}
JOBS=${JOBS:-1 2 4}
LEG=${LEG:-null:1G}
BS=${BS:-4K}
IODEPTH=${IODEPTH:-32}
VARIANT=${VARIANT:-share_writes=0}

# run ARGS...: one `blkq bench` run; prints "IOPS NS_CPU_PER_IO".
run() {
  local t json
  t=$(mktemp)
  json=$( { TIMEFORMAT='%3U %3S'; time "$BIN" bench "$@" --rw randwrite --bs "$BS" \
    --iodepth "$IODEPTH" --runtime "$R" --json 2>/dev/null; } 2>"$t")
  read -r u s <"$t"
  rm -f "$t"
  local ios iops
  ios=$(grep -o '"ios":[0-9]*' <<<"$json" | head -1 | cut -d: -f2)
  iops=$(grep -o '"iops":[0-9.]*' <<<"$json" | head -1 | cut -d: -f2)
  awk -v i="$iops" -v n="$ios" -v u="$u" -v s="$s" 'BEGIN { printf "%.0f %.0f\n", i, (n > 0 ? (u + s) * 1e9 / n : 0) }'
}

echo "# blkq raid1 write cost, one buffer vs a copy per leg, $(date -u '+%F %H:%M UTC'), $(uname -m), $(nproc) CPUs:$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)"
echo "# $0 $BIN (R=$R ROUNDS=$ROUNDS JOBS=\"$JOBS\" LEG=$LEG BS=$BS IODEPTH=$IODEPTH VARIANT=$VARIANT), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
echo "# one:    $BIN bench --device $LEG --as-leg --rw randwrite --bs $BS --iodepth $IODEPTH --jobs J"
echo "# shared: $BIN bench --raid1 $LEG,$LEG --raid1-option share_writes=1 (same options)"
echo "# copy:   $BIN bench --raid1 $LEG,$LEG --raid1-option $VARIANT (same options; \"copy\" below)"
out=$(mktemp)
trap 'rm -f "$out"' EXIT
for round in $(seq "$ROUNDS"); do
  for j in $JOBS; do
    read -r one one_ns < <(run --device "$LEG" --as-leg --jobs "$j")
    read -r shared shared_ns < <(run --raid1 "$LEG,$LEG" --raid1-option share_writes=1 --jobs "$j")
    read -r copy copy_ns < <(run --raid1 "$LEG,$LEG" --raid1-option "$VARIANT" --jobs "$j")
    echo "round=$round jobs=$j one=$one shared=$shared copy=$copy one_ns=$one_ns shared_ns=$shared_ns copy_ns=$copy_ns" |
      tee -a "$out"
  done
done

. "$(dirname "$0")/med.sh"
# col KEY: the values of KEY in the rounds of $j jobs; ratio A B: A/B in each of those rounds.
col() { grep " jobs=$j " "$out" | sed -E "s/.* $1=([0-9.]+).*/\1/" | tr '\n' ' '; }
ratio() { grep " jobs=$j " "$out" | awk -v a="$1" -v b="$2" '
    { for (i = 1; i <= NF; i++) { split($i, kv, "="); x[kv[1]] = kv[2] }
      if (x[b] > 0) printf "%s ", x[a] / x[b] }'; }
echo
echo "| jobs | one leg (--as-leg) | two legs, shared | two legs, copy | shared/one | copy/one | shared/copy |"
echo "|---|---|---|---|---|---|---|"
for j in $JOBS; do
  one=$(col one); shared=$(col shared); copy=$(col copy)
  fmt_k() { tr ' ' '\n' <<<"$1" | grep . | awk '{ printf "%s ", $1 / 1000 }'; }
  printf '| %s | %s | %s | %s | %s | %s | %s |\n' "$j" \
    "$(med "$(fmt_k "$one")" '%.1fK')" "$(med "$(fmt_k "$shared")" '%.1fK')" \
    "$(med "$(fmt_k "$copy")" '%.1fK')" \
    "$(med "$(ratio shared one)" '%.2f')" "$(med "$(ratio copy one)" '%.2f')" \
    "$(med "$(ratio shared copy)" '%.2f')"
done
echo
echo "CPU time per I/O (ns, user + system of the process); ratios are one/mirror, so comparable to the IOPS ratios:"
echo
echo "| jobs | one leg | two legs, shared | two legs, copy | one/shared | one/copy | copy/shared |"
echo "|---|---|---|---|---|---|---|"
for j in $JOBS; do
  printf '| %s | %s | %s | %s | %s | %s | %s |\n' "$j" \
    "$(med "$(col one_ns)" '%.0f')" "$(med "$(col shared_ns)" '%.0f')" "$(med "$(col copy_ns)" '%.0f')" \
    "$(med "$(ratio one_ns shared_ns)" '%.2f')" "$(med "$(ratio one_ns copy_ns)" '%.2f')" \
    "$(med "$(ratio copy_ns shared_ns)" '%.2f')"
done
