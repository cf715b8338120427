#!/usr/bin/env bash
# bench/proxy.sh: what an nbd:// device costs (docs/bench.md section 15). fio's nbd engine,
# one connection, against `blkq serve --device mem:1G` on a Unix socket (`direct`), and in
# front of that same back server:
#   proxy   a second blkq serve whose device is nbd+unix:// of the first (send=inline, the
#           default)
#   thread  the same with send=thread (every request through the connection's sender thread)
#   base    a proxy run by BASE=PATH (an earlier build)
#   nbdkit  nbdkit's nbd plugin (`nbdkit nbd socket=...`), the peer proxy
#   relay   socat (apt-get install socat) copying bytes between the two sockets (no NBD at all): what any proxy that
#           sleeps between events costs at least (two more processes' wake-ups per request)
# WHICH="direct proxy thread" picks them (base is added when BASE is set), all interleaved in
# every round, ROUNDS=3 rounds. Cells: CELLS="rw:bs:qd ..." (default: randread and randwrite,
# 4k, at queue depths QDS="1 32"), e.g. CELLS="randread:4k:1 randwrite:4k:16 read:1M:8".
# Prints per run: round rw bs qd which IOPS p99_us cpu_us_per_io (user+system time of the
# serving processes, the back alone for direct, back and proxy otherwise, from /proc/PID/stat
# with its waited-for children, over the I/Os the client completed); then per cell and server
# the median IOPS (min..max) and the median of the per-round ratios to direct.
# B=PATH picks the binary (default target/release/blkq). CLIENT=blkq drives the exports with
# blkq's own NBD client (`blkq bench --as-leg` on the URI, one job) instead of fio, for a
# machine without fio; R=SECONDS per run (5).
set -euo pipefail
echo "# bench/proxy.sh: $(date -u +%FT%TZ), $(uname -n), $(nproc) CPUs, binary ${B:-target/release/blkq}${BASE:+, base $BASE}"
B=${B:-target/release/blkq}
HERE=$(dirname "$0")
source "$HERE/med.sh"
WHICH="${WHICH:-direct proxy thread}${BASE:+ base}"
if [ -z "${CELLS:-}" ]; then
  CELLS=
  for rw in ${RWS:-randread randwrite}; do for qd in ${QDS:-1 32}; do CELLS+=" $rw:4k:$qd"; done; done
fi
D=$(mktemp -d /tmp/pb.XXXX)
PIDS=()
$B serve --device mem:1G --socket $D/a.sock --no-tcp >/dev/null 2>&1 & P1=$!; PIDS+=($P1)
sleep 1
declare -A PID SOCK
SOCK[direct]=$D/a.sock
for w in $WHICH; do
  case $w in
    direct) continue ;;
    proxy) $B serve --device "nbd+unix:///?socket=$D/a.sock" --socket $D/$w.sock --no-tcp >/dev/null 2>&1 & ;;
    thread) $B serve --device "nbd+unix:///?socket=$D/a.sock,send=thread" --socket $D/$w.sock --no-tcp >/dev/null 2>&1 & ;;
    base) $BASE serve --device "nbd+unix:///?socket=$D/a.sock" --socket $D/$w.sock --no-tcp >/dev/null 2>&1 & ;;
    nbdkit) nbdkit -f --unix $D/$w.sock nbd socket=$D/a.sock >/dev/null 2>&1 & ;;
    relay) socat -b 131072 UNIX-LISTEN:$D/$w.sock,fork UNIX-CONNECT:$D/a.sock >/dev/null 2>&1 & ;;
    *) echo "unknown server $w" >&2; exit 2 ;;
  esac
  PID[$w]=$!; PIDS+=($!); SOCK[$w]=$D/$w.sock
done
trap 'kill -TERM ${PIDS[*]} 2>/dev/null; wait; rm -rf $D' EXIT
sleep 1
if [ "${CLIENT:-fio}" = blkq ]; then
  $B bench --device "nbd+unix:///?socket=$D/a.sock" --as-leg --rw write --bs 1M --iodepth 8 --runtime 3 >/dev/null 2>&1 || true
else
  fio --name=prefill --ioengine=nbd --uri="nbd+unix:///?socket=$D/a.sock" --rw=write --bs=1M --size=1G --output-format=json >/dev/null 2>&1 || true
fi
TCK=$(getconf CLK_TCK)
ticks() { # PIDS...: user+system clock ticks of all of them and of their waited-for children
  local t=0 p; for p in "$@"; do t=$((t + $(awk '{print $14 + $15 + $16 + $17}' /proc/$p/stat))); done; echo $t
}
run() { # URI RW BS QD PIDS...
  local uri=$1 rw=$2 bs=$3 qd=$4; shift 4
  local c0; c0=$(ticks "$@")
  if [ "${CLIENT:-fio}" = blkq ]; then
    local json; json=$($B bench --device "$uri" --as-leg --rw $rw --bs $bs --iodepth $qd --jobs 1 --runtime ${R:-5} --json 2>/dev/null)
    local c1; c1=$(ticks "$@")
    local ios iops p99
    ios=$(grep -o '"ios":[0-9]*' <<<"$json" | head -1 | cut -d: -f2)
    iops=$(grep -o '"iops":[0-9.]*' <<<"$json" | head -1 | cut -d: -f2)
    p99=$(grep -o '"p99":[0-9]*' <<<"$json" | head -1 | cut -d: -f2)
    awk -v i="$iops" -v p="$p99" -v n="$ios" -v c=$((c1 - c0)) -v hz="$TCK" \
      'BEGIN { printf "%d %d %.1f\n", i, p / 1000, (n > 0 ? c / hz * 1e6 / n : 0) }'
    return
  fi
  fio --name=x --ioengine=nbd --uri="$uri" --rw=$rw --bs=$bs --iodepth=$qd --numjobs=1 --size=1G \
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
LOG=$D/runs
for r in $(seq 1 ${ROUNDS:-3}); do
  for cell in $CELLS; do
    IFS=: read -r rw bs qd <<<"$cell"
    for w in $WHICH; do
      if [ $w = direct ]; then pids=$P1; else pids="$P1 ${PID[$w]}"; fi
      # shellcheck disable=SC2086
      echo "$r $rw $bs $qd $w $(run "nbd+unix:///?socket=${SOCK[$w]}" $rw $bs $qd $pids)" | tee -a $LOG
    done
  done
done
echo "# per cell: median IOPS (min..max), median CPU us/IO, median of the per-round ratios to direct (min..max)"
for cell in $CELLS; do
  IFS=: read -r rw bs qd <<<"$cell"
  for w in $WHICH; do
    iops=$(awk -v a=$rw -v b=$bs -v q=$qd -v w=$w '$2==a && $3==b && $4==q && $5==w {print $6}' $LOG | tr '\n' ' ')
    cpu=$(awk -v a=$rw -v b=$bs -v q=$qd -v w=$w '$2==a && $3==b && $4==q && $5==w {print $8}' $LOG | tr '\n' ' ')
    ratio=$(awk -v a=$rw -v b=$bs -v q=$qd -v w=$w '$2==a && $3==b && $4==q && $5=="direct" {d[$1]=$6}
      $2==a && $3==b && $4==q && $5==w {v[$1]=$6} END {for (r in v) if (d[r] > 0) print v[r]/d[r]}' $LOG | tr '\n' ' ')
    echo "$rw $bs qd$qd $w: $(med "$iops" %.0f) cpu $(med "$cpu" %.1f | cut -d' ' -f1) ratio $(med "$ratio" %.2f)"
  done
done
