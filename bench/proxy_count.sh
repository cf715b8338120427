#!/usr/bin/env bash
# bench/proxy_count.sh BIN RW QD (docs/bench.md section 15): system calls and context switches
# per request of a proxy (`blkq serve --device nbd+unix://` of a `blkq serve --device mem:1G`),
# counted by `perf stat -p` on the proxy alone over 4 s of a 5 s fio run (fio's nbd engine,
# one connection, BS=4k by default). A count, not a speed: the tracepoints tax every system
# call, so the IOPS it prints are not comparable with bench/proxy.sh's.
set -euo pipefail
B=$1; RW=$2; QD=$3; BS=${BS:-4k}
D=$(mktemp -d)
$B serve --device mem:1G --socket $D/a.sock --no-tcp >/dev/null 2>&1 & P1=$!
sleep 0.5
$B serve --device "nbd+unix:///?socket=$D/a.sock" --socket $D/b.sock --no-tcp >/dev/null 2>&1 & P2=$!
sleep 0.5
fio --name=prefill --ioengine=nbd --uri="nbd+unix:///?socket=$D/a.sock" --rw=write --bs=1M --size=1G --output-format=json >/dev/null 2>&1
EV=raw_syscalls:sys_enter,context-switches,syscalls:sys_enter_recvfrom,syscalls:sys_enter_sendmsg,syscalls:sys_enter_read,syscalls:sys_enter_futex,syscalls:sys_enter_sendto,syscalls:sys_enter_recvmsg,syscalls:sys_enter_write,syscalls:sys_enter_readv,syscalls:sys_enter_writev
perf stat -e $EV -p $P2 -o $D/perf.txt -- sleep 4 &
PS=$!
fio --name=x --ioengine=nbd --uri="nbd+unix:///?socket=$D/b.sock" --rw=$RW --bs=$BS --iodepth=$QD --numjobs=1 --size=1G --norandommap --randrepeat=0 --time_based --runtime=5 --output-format=json 2>/dev/null | sed -n '/^{/,$p' > $D/out.json
wait $PS || true
IOPS=$(/usr/bin/python3 -c 'import json,sys; j=json.load(open(sys.argv[1]))["jobs"][0]; k="read" if j["read"]["io_bytes"]>0 else "write"; print(int(j[k]["iops"]))' $D/out.json)
echo "$RW $BS qd$QD IOPS $IOPS"
awk -v i=$IOPS '/[0-9]/ && $2 ~ /:|context/ { gsub(",","",$1); if ($1+0>0) printf "  %-40s %8.3f per IO\n", $2, $1/(i*4) }' $D/perf.txt
kill $P2 $P1; wait 2>/dev/null || true; rm -rf $D
