#!/usr/bin/env bash
# Reproduces the blk-layer tables of docs/bench.md: counter vs legacy wake-ups (IOPS against
# hardware queue depth), the pool-full policies, the per-core ceiling, and
# mq-deadline (locked vs serialized lock, and its cost over none).
#   bench/tables.sh [BLKQ_BINARY]          (default: target/release/blkq)
# Env: JOBS (default "4"; e.g. "16 32" on a 16-core machine), REPEAT (5), RUNTIME (1),
#      SCHED_JOBS_EXTRA (e.g. ",16": more job counts for the mq-deadline lock sweep),
#      HWQ_SHARED (4: hardware queues sharing one bitmap in the second table).
set -euo pipefail
BIN=${1:-target/release/blkq}
JOBS=${JOBS:-4}
REPEAT=${REPEAT:-5}
RUNTIME=${RUNTIME:-1}
HWQ_SHARED=${HWQ_SHARED:-4}
echo "# $(date -u +%F) $(uname -m) $(nproc) CPUs: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)"
for j in $JOBS; do
  echo
  echo "## counter vs legacy wake-ups, one hardware queue, $j jobs, null completion=thread, randwrite iodepth 64"
  $BIN bench --device null:1G,completion=thread --rw randwrite --iodepth 64 --jobs "$j" \
    --runtime "$RUNTIME" --repeat "$REPEAT" --wake counter,legacy \
    --sweep queue-depth=2,4,8,16,32,64
  echo
  echo "## counter vs legacy wake-ups, $HWQ_SHARED hardware queues sharing one bitmap, $((j * 2)) jobs"
  $BIN bench --device null:1G,completion=thread --rw randwrite --iodepth 64 --jobs $((j * 2)) \
    --hw-queues "$HWQ_SHARED" --shared-tags --runtime "$RUNTIME" --repeat "$REPEAT" \
    --wake counter,legacy --sweep queue-depth=2,4,8,16,32,64
done
echo
echo "## pool-full policies (timer completions 50us, depth 32, soft limit 16)"
for p in steal fifo batch; do
  $BIN bench --device null:1G,completion=timer,completion_nsec=50000 --rw randrw \
    --iodepth 16 --jobs 8 --queue-depth 32 --max-in-flight 16 --policy $p \
    --runtime $((RUNTIME * 3)) --json
done
echo
echo "## per-core ceiling: null inline, 4K randread, iodepth 64, one job, pinned to one CPU"
taskset -c 0 $BIN bench --device null:1G --rw randread --iodepth 64 --jobs 1 \
  --runtime $((RUNTIME * 3)) --repeat "$REPEAT"
echo
echo "## mq-deadline, locked vs serialized (stand-by hand-off) vs serialized-leave scheduler lock (null inline, 4K randread, iodepth 32)"
$BIN bench --device null:1G --sched mq-deadline --sched-lock locked,serialized,serialized-leave \
  --sweep jobs=1,2,4,8${SCHED_JOBS_EXTRA:-} --repeat "$REPEAT" --runtime $((RUNTIME * 2))
echo
echo "## the cost of mq-deadline over none, one job"
$BIN bench --device null:1G --sched none,mq-deadline --sched-lock locked,serialized --jobs 1 \
  --repeat "$REPEAT" --runtime $((RUNTIME * 2))
echo
echo "## mq-deadline async_depth: read latency under a write flood, with and without the cap"
# Built by: cargo build --release -p blk --example async_depth_lat
ASYNC_LAT=${ASYNC_LAT:-$(dirname "$BIN")/examples/async_depth_lat}
if [ -x "$ASYNC_LAT" ]; then
  "$ASYNC_LAT" $((RUNTIME * 3)) 4 20 8
else
  echo "(skipped: $ASYNC_LAT not built; cargo build --release -p blk --example async_depth_lat)"
fi
