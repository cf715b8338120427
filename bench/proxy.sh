#!/usr/bin/env bash
# bench/proxy.sh: what an nbd:// device costs (docs/bench.md section 15). fio's nbd engine,
# 4 KiB randread and randwrite at queue depth 1 and 32, one connection, against `blkq serve
# --device mem:1G` on a Unix socket, directly and through a second blkq serve whose device is
# nbd+unix:// of the first (`proxy`: send=inline, the default), and through a third whose
# device is the same with send=thread (`thread`: every request through the connection's sender
# thread); interleaved, 3 rounds (ROUNDS=N for more; RWS="randwrite" QDS="32" pick cells). Prints: round rw qd which IOPS p99_us
# cpu_us_per_io (user+system time of the serving processes, the back alone for direct, back
# and proxy otherwise, from /proc/PID/stat, over the I/Os fio completed).
# B=PATH picks the binary (default target/release/blkq). BASE=PATH adds a third server, a
# proxy run by that binary (an earlier build), measured interleaved as `base`. CLIENT=blkq
# drives the exports with blkq's own NBD client (`blkq bench --as-leg` on the URI, one job)
# instead of fio, for a machine without fio; R=SECONDS per run (5).
set -euo pipefail
echo "# bench/proxy.sh: $(date -u +%FT%TZ), $(uname -n), $(nproc) CPUs, binary ${B:-target/release/blkq}${BASE:+, base $BASE}"
B=${B:-target/release/blkq}
D=$(mktemp -d /tmp/pb.XXXX)
$B serve --device mem:1G --socket $D/a.sock --no-tcp >/dev/null 2>&1 & P1=$!
sleep 1
$B serve --device "nbd+unix:///?socket=$D/a.sock" --socket $D/b.sock --no-tcp >/dev/null 2>&1 & P2=$!
$B serve --device "nbd+unix:///?socket=$D/a.sock,send=thread" --socket $D/t.sock --no-tcp >/dev/null 2>&1 & P4=$!
P3=
if [ -n "${BASE:-}" ]; then
  $BASE serve --device "nbd+unix:///?socket=$D/a.sock" --socket $D/c.sock --no-tcp >/dev/null 2>&1 & P3=$!
fi
sleep 1
if [ "${CLIENT:-fio}" = blkq ]; then
  $B bench --device "nbd+unix:///?socket=$D/a.sock" --as-leg --rw write --bs 1M --iodepth 8 --runtime 3 >/dev/null 2>&1 || true
else
  fio --name=prefill --ioengine=nbd --uri="nbd+unix:///?socket=$D/a.sock" --rw=write --bs=1M --size=1G --output-format=json >/dev/null 2>&1 || true
fi
TCK=$(getconf CLK_TCK)
ticks() { # PIDS...: user+system clock ticks of all of them
  local t=0 p; for p in "$@"; do t=$((t + $(awk '{print $14 + $15}' /proc/$p/stat))); done; echo $t
}
run() { # URI RW QD PIDS...
  local uri=$1 rw=$2 qd=$3; shift 3
  local c0; c0=$(ticks "$@")
  if [ "${CLIENT:-fio}" = blkq ]; then
    local json; json=$($B bench --device "$uri" --as-leg --rw $rw --bs 4K --iodepth $qd --jobs 1 --runtime ${R:-5} --json 2>/dev/null)
    local c1; c1=$(ticks "$@")
    local ios iops p99
    ios=$(grep -o '"ios":[0-9]*' <<<"$json" | head -1 | cut -d: -f2)
    iops=$(grep -o '"iops":[0-9.]*' <<<"$json" | head -1 | cut -d: -f2)
    p99=$(grep -o '"p99":[0-9]*' <<<"$json" | head -1 | cut -d: -f2)
    awk -v i="$iops" -v p="$p99" -v n="$ios" -v c=$((c1 - c0)) -v hz="$TCK" \
      'BEGIN { printf "%d %d %.1f\n", i, p / 1000, (n > 0 ? c / hz * 1e6 / n : 0) }'
    return
  fi
  fio --name=x --ioengine=nbd --uri="$uri" --rw=$rw --bs=4k --iodepth=$qd --numjobs=1 --size=1G \
    --norandommap --randrepeat=0 --time_based --runtime=${R:-5} --output-format=json 2>/dev/null \
  | sed -n '/^{/,$p' > $D/out.json
  local c1; c1=$(ticks "$@")
  /usr/bin/python3 -c '
import json,sys
j=json.load(open(sys.argv[1]))["jobs"][0]
k="read" if j["read"]["io_bytes"]>0 else "write"
ios=j[k]["total_ios"]
cpu_us=(int(sys.argv[3])-int(sys.argv[2]))/int(sys.argv[4])*1e6
print(int(j[k]["iops"]), int(j[k]["clat_ns"]["percentile"]["99.000000"]/1000), round(cpu_us/ios,1))' \
    $D/out.json $c0 $c1 $TCK
}
for r in $(seq 1 ${ROUNDS:-3}); do
  for rw in ${RWS:-randread randwrite}; do for qd in ${QDS:-1 32}; do
    for which in direct proxy thread ${BASE:+base}; do
      case $which in
        direct) echo "$r $rw $qd $which $(run "nbd+unix:///?socket=$D/a.sock" $rw $qd $P1)" ;;
        proxy) echo "$r $rw $qd $which $(run "nbd+unix:///?socket=$D/b.sock" $rw $qd $P1 $P2)" ;;
        thread) echo "$r $rw $qd $which $(run "nbd+unix:///?socket=$D/t.sock" $rw $qd $P1 $P4)" ;;
        base) echo "$r $rw $qd $which $(run "nbd+unix:///?socket=$D/c.sock" $rw $qd $P1 $P3)" ;;
      esac
    done
  done; done
done
kill -TERM $P2 $P4 $P1 $P3; wait
