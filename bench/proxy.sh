#!/usr/bin/env bash
# bench/proxy.sh: what an nbd:// device costs (docs/bench.md section 15). fio's nbd engine,
# 4 KiB randread and randwrite at queue depth 1 and 32, one connection, against `blkq serve
# --device mem:1G` on a Unix socket, directly and through a second blkq serve whose device is
# nbd+unix:// of the first; interleaved, 3 rounds. Prints: round rw qd which IOPS p99_us.
# B=PATH picks the binary (default target/release/blkq). BASE=PATH adds a third server, a
# proxy run by that binary (an earlier build), measured interleaved as `base`.
set -euo pipefail
echo "# bench/proxy.sh: $(date -u +%FT%TZ), $(uname -n), $(nproc) CPUs, binary ${B:-target/release/blkq}${BASE:+, base $BASE}"
B=${B:-target/release/blkq}
D=$(mktemp -d /tmp/pb.XXXX)
$B serve --device mem:1G --socket $D/a.sock --no-tcp >/dev/null 2>&1 & P1=$!
sleep 1
$B serve --device "nbd+unix:///?socket=$D/a.sock" --socket $D/b.sock --no-tcp >/dev/null 2>&1 & P2=$!
P3=
if [ -n "${BASE:-}" ]; then
  $BASE serve --device "nbd+unix:///?socket=$D/a.sock" --socket $D/c.sock --no-tcp >/dev/null 2>&1 & P3=$!
fi
sleep 1
fio --name=prefill --ioengine=nbd --uri="nbd+unix:///?socket=$D/a.sock" --rw=write --bs=1M --size=1G --output-format=json >/dev/null 2>&1 || true
run() { # URI RW QD
  fio --name=x --ioengine=nbd --uri="$1" --rw=$2 --bs=4k --iodepth=$3 --numjobs=1 --size=1G \
    --norandommap --randrepeat=0 --time_based --runtime=5 --output-format=json 2>/dev/null \
  | sed -n '/^{/,$p' | /usr/bin/python3 -c '
import json,sys
j=json.load(sys.stdin)["jobs"][0]
k="read" if j["read"]["io_bytes"]>0 else "write"
print(int(j[k]["iops"]), int(j[k]["clat_ns"]["percentile"]["99.000000"]/1000))'
}
for r in 1 2 3; do
  for rw in randread randwrite; do for qd in 1 32; do
    for which in direct proxy ${BASE:+base}; do
      case $which in
        direct) u="nbd+unix:///?socket=$D/a.sock" ;;
        proxy) u="nbd+unix:///?socket=$D/b.sock" ;;
        base) u="nbd+unix:///?socket=$D/c.sock" ;;
      esac
      echo "$r $rw $qd $which $(run $u $rw $qd)"
    done
  done; done
done
kill -TERM $P2 $P1 $P3; wait
