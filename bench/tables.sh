#!/usr/bin/env bash
# Reproduces the blk-layer tables of docs/bench.md: counter vs legacy wake-ups (IOPS against
# hardware queue depth), the pool-full policies, the per-core ceiling, and
# mq-deadline (locked vs serialized lock, and its cost over none).
#   bench/tables.sh [BLKQ_BINARY]          (default: target/release/blkq)
# Env: JOBS (default "4"; e.g. "16 32" on a 16-core machine), REPEAT (5), RUNTIME (1),
#      SCHED_JOBS_EXTRA (e.g. ",16": more job counts for the mq-deadline lock sweep),
#      HWQ_SHARED (4: hardware queues sharing one bitmap in the second table),
#      PLOTS=1: also draw sections 3, 4 and 7 as SVGs under PLOT_DIR (default docs/plots):
#      IOPS against the swept parameter, one line per variant, error bars from the smallest
#      to the largest of the repeats (`blkq bench --plot`, `blkq bench plot`).
set -euo pipefail
BIN=${1:-target/release/blkq}
JOBS=${JOBS:-4}
REPEAT=${REPEAT:-5}
RUNTIME=${RUNTIME:-1}
HWQ_SHARED=${HWQ_SHARED:-4}
PLOTS=${PLOTS:-}
PLOT_DIR=${PLOT_DIR:-docs/plots}
# plot_args NAME TITLE: sets P to the `blkq bench` options that draw the run into
# PLOT_DIR/NAME.svg (no options without PLOTS). Use as ${P[@]+"${P[@]}"}.
plot_args() {
  P=()
  if [ -n "$PLOTS" ]; then
    P=(--plot "$PLOT_DIR/$1.svg" --plot-title "$2")
  fi
}
if [ -n "$PLOTS" ]; then
  mkdir -p "$PLOT_DIR"
fi
echo "# $(date -u +%F) $(uname -m) $(nproc) CPUs: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)"
for j in $JOBS; do
  echo
  echo "## counter vs legacy vs chain wake-ups, one hardware queue, $j jobs, null completion=thread, randwrite iodepth 64"
  plot_args "wake-1hwq-${j}jobs" "counter vs legacy vs chain wake-ups: 1 hw queue, $j jobs, randwrite iodepth 64"
  $BIN bench --device null:1G,completion=thread --rw randwrite --iodepth 64 --jobs "$j" \
    --runtime "$RUNTIME" --repeat "$REPEAT" --wake counter,legacy,chain \
    --sweep queue-depth=2,4,8,16,32,64 ${P[@]+"${P[@]}"}
  echo
  echo "## counter vs legacy vs chain wake-ups, $HWQ_SHARED hardware queues sharing one bitmap, $((j * 2)) jobs"
  plot_args "wake-${HWQ_SHARED}hwq-shared-$((j * 2))jobs" \
    "counter vs legacy vs chain wake-ups: $HWQ_SHARED hw queues sharing one bitmap, $((j * 2)) jobs"
  $BIN bench --device null:1G,completion=thread --rw randwrite --iodepth 64 --jobs $((j * 2)) \
    --hw-queues "$HWQ_SHARED" --shared-tags --runtime "$RUNTIME" --repeat "$REPEAT" \
    --wake counter,legacy,chain --sweep queue-depth=2,4,8,16,32,64 ${P[@]+"${P[@]}"}
done
echo
echo "## pool-full policies (timer completions 50us, depth 32, soft limit 16)"
policy_runs=$(mktemp)
trap 'rm -f "$policy_runs"' EXIT
for p in steal fifo batch; do
  $BIN bench --device null:1G,completion=timer,completion_nsec=50000 --rw randrw \
    --iodepth 16 --jobs 8 --queue-depth 32 --max-in-flight 16 --policy $p \
    --runtime $((RUNTIME * 3)) --json | tee -a "$policy_runs"
done
if [ -n "$PLOTS" ]; then
  # One run per policy (no repeats): the policies side by side, throughput and tails.
  for y in iops lat_ns.p99 lat_ns.p999 tag_wait.max_ns; do
    $BIN bench plot --x policy --y "$y" --out "$PLOT_DIR/policy-${y//./-}.svg" \
      --title "pool-full policies: $y (timer 50us, 32 tags, soft limit 16, 8 jobs)" \
      "$policy_runs"
  done
fi
echo
echo "## per-core ceiling: null inline, 4K randread, iodepth 64, one job, pinned to one CPU"
taskset -c 0 $BIN bench --device null:1G --rw randread --iodepth 64 --jobs 1 \
  --runtime $((RUNTIME * 3)) --repeat "$REPEAT"
echo
echo "## mq-deadline, locked vs serialized (stand-by hand-off) vs serialized-leave scheduler lock (null inline, 4K randread, iodepth 32)"
plot_args mq-deadline-locks "mq-deadline: locked vs serialized vs serialized-leave scheduler lock, 4K randread iodepth 32"
$BIN bench --device null:1G --sched mq-deadline --sched-lock locked,serialized,serialized-leave \
  --sweep jobs=1,2,4,8${SCHED_JOBS_EXTRA:-} --repeat "$REPEAT" --runtime $((RUNTIME * 2)) \
  ${P[@]+"${P[@]}"}
echo
echo "## the cost of mq-deadline over none, one job"
plot_args mq-deadline-cost "the cost of mq-deadline over none, one job, 4K randread iodepth 32"
$BIN bench --device null:1G --sched none,mq-deadline --sched-lock locked,serialized --jobs 1 \
  --repeat "$REPEAT" --runtime $((RUNTIME * 2)) ${P[@]+"${P[@]}"}
echo
echo "## mq-deadline async_depth: read latency under a write flood, with and without the cap"
# Built by: cargo build --release -p blk --example async_depth_lat
ASYNC_LAT=${ASYNC_LAT:-$(dirname "$BIN")/examples/async_depth_lat}
if [ -x "$ASYNC_LAT" ]; then
  "$ASYNC_LAT" $((RUNTIME * 3)) 4 20 8
else
  echo "(skipped: $ASYNC_LAT not built; cargo build --release -p blk --example async_depth_lat)"
fi
