#!/usr/bin/env bash
# RAID1 tables (issue #10 item 5): prints markdown tables, each row the mean IOPS of REPEATS
# runs, their spread (sd as % of the mean) and the ratio against the baseline row measured
# in the same run.
#   bench/raid1.sh [BLKQ_BINARY]          (default: target/release/blkq)
# Env: R (seconds per run, 2), REPEATS (3), JOBS ("1 2 4"; e.g. "1 2 4 8 16" on a bigger
#      machine), CHECK_MIB (256: array size of the check pass), PROFILE (release: the cargo
#      profile of the check example; "dev" for a quick smoke run).
# A smoke run: R=1 REPEATS=1 PROFILE=dev bench/raid1.sh target/debug/blkq
set -euo pipefail
BIN=${1:-target/release/blkq}
R=${R:-2}
REPEATS=${REPEATS:-3}
JOBS=${JOBS:-1 2 4}
CHECK_MIB=${CHECK_MIB:-256}
PROFILE=${PROFILE:-release}
NULL2=null:1G,null:1G
TIMER="completion=timer,completion_nsec=50000,hw_queue_depth=8"

# measure ARGS...: runs `blkq bench ARGS --json` REPEATS times; sets MEAN and SD (IOPS).
measure() {
  local out
  out=$("$BIN" bench "$@" --runtime "$R" --repeat "$REPEATS" --json 2>/dev/null)
  read -r MEAN SD < <(grep -o '"iops":[0-9.]*' <<<"$out" | cut -d: -f2 | awk '
    { s += $1; q += $1 * $1; n++ }
    END { m = s / n; v = q / n - m * m; if (v < 0) v = 0; printf "%.0f %.0f\n", m, sqrt(v) }')
}
# row NAME BASE: one table row from MEAN/SD against the baseline mean BASE.
row() {
  awk -v n="$1" -v m="$MEAN" -v s="$SD" -v b="$2" 'BEGIN {
    printf "| %s | %.1fK | %.1f%% | %.2fx |\n", n, m / 1000, (m > 0 ? 100 * s / m : 0), (b > 0 ? m / b : 0) }'
}
# leg_vs_mirror LEG LEGS ARGS...: two rows, one leg alone (`--device LEG`, the baseline) and
# the mirror of LEGS, each measured with ARGS.
leg_vs_mirror() {
  local leg=$1 legs=$2 base
  shift 2
  measure --device "$leg" "$@"
  base=$MEAN
  row "one leg (--device)" "$base"
  measure --raid1 "$legs" "$@"
  row "raid1, two legs" "$base"
}
header() {
  echo
  echo "## $1"
  echo
  echo "\`$2\`"
  echo
  echo "| run | IOPS (mean) | spread (sd) | ratio |"
  echo "|---|---|---|---|"
}

echo "# blkq raid1 tables, $(date -u '+%F %H:%M UTC'), $(uname -m), $(nproc) CPUs:$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)"
echo "runs of ${R}s, ${REPEATS} repeats; command: $0 $BIN (R=$R REPEATS=$REPEATS JOBS=\"$JOBS\")"

# (a) barrier: lockless vs locked (baseline: locked), two inline null legs.
for w in "randread 4K" "read 64K"; do
  set -- $w
  header "(a) barrier lockless vs locked: $1 bs=$2 over two null legs (inline completion), iodepth 32" \
    "$BIN bench --raid1 $NULL2 --raid1-option barrier=locked|lockless --rw $1 --bs $2 --jobs J"
  for j in $JOBS; do
    measure --raid1 "$NULL2" --raid1-option barrier=locked --rw "$1" --bs "$2" --jobs "$j"
    base=$MEAN
    row "jobs=$j locked" "$base"
    measure --raid1 "$NULL2" --raid1-option barrier=lockless --rw "$1" --bs "$2" --jobs "$j"
    row "jobs=$j lockless" "$base"
  done
done

# (b) read balancing: two slow legs vs one such leg alone (baseline: one leg).
header "(b) 4K randread over two timer legs (50 us, hw_queue_depth 8) vs one leg alone (target >= 1.9x)" \
  "$BIN bench --device null:1G,$TIMER | --raid1 null:1G,$TIMER,null:1G,$TIMER --rw randread --jobs 4 --iodepth 32"
leg_vs_mirror "null:1G,$TIMER" "null:1G,$TIMER,null:1G,$TIMER" --rw randread --jobs 4 --iodepth 32

# (c) write cost: every write goes to both legs (baseline: one leg alone). The one-leg run
# drives a queue (plugged, no data buffers on null); the mirror runs are bio-based with
# buffers (raid1 needs them), so the ratio includes that path difference, not only the copy.
header "(c) write cost: 4K randwrite over two null legs vs one leg alone" \
  "$BIN bench --device null:1G | --raid1 $NULL2 --rw randwrite --jobs 2 --iodepth 32"
leg_vs_mirror null:1G "$NULL2" --rw randwrite --jobs 2 --iodepth 32

# (e) the write-intent bitmap on a 4K random-write load (baseline: no bitmap).
header "(e) write-intent bitmap cost: 4K randwrite over two mem legs, bitmap on vs bitmap_chunk=none" \
  "$BIN bench --raid1 mem:256M,mem:256M [--raid1-option bitmap_chunk=none] --rw randwrite --jobs 2 --iodepth 32"
measure --raid1 mem:256M,mem:256M --raid1-option bitmap_chunk=none --rw randwrite --jobs 2 --iodepth 32
base=$MEAN
row "bitmap_chunk=none" "$base"
measure --raid1 mem:256M,mem:256M --rw randwrite --jobs 2 --iodepth 32
row "bitmap on (default chunk)" "$base"

# (d) check speed, through the raid1 crate (an example: no CLI knob lifts the speed limit
# offline). One figure per repeat: MiB of array per second.
echo
echo "## (d) check pass over two mem legs (${CHECK_MIB} MiB written first, speed limit lifted)"
echo
echo "\`cargo run --profile $PROFILE -q -p raid1 --example check_speed -- $CHECK_MIB check\`"
echo
cargo build --profile "$PROFILE" -q -p raid1 --example check_speed
for i in $(seq "$REPEATS"); do
  echo "- $(cargo run --profile "$PROFILE" -q -p raid1 --example check_speed -- "$CHECK_MIB" check)"
done
