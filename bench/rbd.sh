#!/usr/bin/env bash
# bench/rbd.sh: blkq in front of Ceph (docs/bench.md section 18). A single-node cluster from
# scripts/ceph-cluster.sh (one bluestore OSD on a sparse file), two 512 MiB images of the same
# pool, each prefilled: one served by `blkq serve --device rbd:rbd/b`, the other by qemu's rbd
# driver exported over NBD: qemu-storage-daemon, or qemu-nbd (QEMU_NBD) where this qemu has no
# rbd module (librbd under both, same ceph.conf, librbd cache off). fio's nbd engine, one connection, untraced: 4 KiB randread and randwrite at
# queue depth 1, 16 and 64, 1 MiB sequential read and write at queue depth 4; interleaved
# (blkq, then qemu-storage-daemon, per cell), ROUNDS rounds (default 2), 5 s each. Then reads
# of a mirror (a local file leg + a write-mostly rbd: leg) against the rbd: device alone.
# Prints: round rw bs qd which IOPS p99_us cpu_us_per_io (user+system time of the serving
# process from /proc/PID/stat, over the I/Os fio completed; the OSD's time is not in it).
# `bench/rbd.sh completion` instead compares the rbd: device's completion modes
# (completion=poll against completion=callback, each serving its own image): 4 KiB randwrite
# at queue depth 16 and 64, interleaved per cell (which goes first alternates by round), same
# columns (section 18b).
# B=PATH picks the binary (default target/release/blkq).
set -euo pipefail
cd "$(dirname "$0")/.."
B=${B:-target/release/blkq}
ROUNDS=${ROUNDS:-2}
echo "# bench/rbd.sh: $(date -u +%FT%TZ), $(uname -n), $(nproc) CPUs, binary $B, commit $(git rev-parse --short HEAD)"
D=$(mktemp -d /tmp/rbdb.XXXX)
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  sleep 1
  for p in "${PIDS[@]}"; do kill -KILL "$p" 2>/dev/null || true; done
  scripts/ceph-cluster.sh stop "$D/ceph" || true
  rm -rf "$D"
}
trap cleanup EXIT
scripts/ceph-cluster.sh start "$D/ceph" >/dev/null
CONF=$D/ceph/ceph.conf
waitsock() { for _ in $(seq 300); do [[ -S $1 ]] && return; sleep 0.1; done; echo "no $1" >&2; exit 1; }
TCK=$(getconf CLK_TCK)
ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
run() { # URI RW BS QD PID
  local uri=$1 rw=$2 bs=$3 qd=$4 pid=$5 c0 c1
  c0=$(ticks "$pid")
  fio --name=x --ioengine=nbd --uri="$uri" --rw="$rw" --bs="$bs" --iodepth="$qd" --size=512M \
    --norandommap --randrepeat=0 --time_based --runtime=5 --output-format=json 2>/dev/null \
    | sed -n '/^{/,$p' >"$D/out.json"
  c1=$(ticks "$pid")
  /usr/bin/python3 -c '
import json,sys
j=json.load(open(sys.argv[1]))["jobs"][0]
k="read" if j["read"]["io_bytes"]>0 else "write"
ios=max(j[k]["total_ios"],1)
cpu_us=(int(sys.argv[3])-int(sys.argv[2]))/int(sys.argv[4])*1e6
print(int(j[k]["iops"]), int(j[k]["clat_ns"]["percentile"]["99.000000"]/1000), round(cpu_us/ios,1))' \
    "$D/out.json" "$c0" "$c1" "$TCK"
}
if [[ ${1:-} == completion ]]; then
  # The rbd: device's two completion modes against each other, each on its own image:
  # 4 KiB randwrite at queue depth 16 and 64, interleaved per cell.
  for m in poll callback; do
    rbd -c "$CONF" create "rbd/$m" --size 512M
    $B serve --device "rbd:rbd/$m,conf=$CONF,completion=$m" --socket "$D/$m.sock" --no-tcp \
      >"$D/$m.log" 2>&1 &
    PIDS+=($!)
    eval "P_$m=$!"
    waitsock "$D/$m.sock"
    fio --name=prefill --ioengine=nbd --uri="nbd+unix:///?socket=$D/$m.sock" --rw=write \
      --bs=1M --iodepth=8 --size=512M --output-format=json >/dev/null
  done
  for r in $(seq "$ROUNDS"); do
    # Which mode goes first alternates from round to round.
    order="poll callback"
    ((r % 2)) || order="callback poll"
    for qd in 16 64; do
      for m in $order; do
        pid=P_$m
        echo "$r randwrite 4k $qd $m $(run "nbd+unix:///?socket=$D/$m.sock" randwrite 4k "$qd" "${!pid}")"
      done
    done
  done
  exit 0
fi
for i in b q m; do rbd -c "$CONF" create "rbd/$i" --size 512M; done
$B serve --device "rbd:rbd/b,conf=$CONF" --socket "$D/b.sock" --no-tcp >"$D/b.log" 2>&1 &
PB=$!; PIDS+=($PB)
qemu-storage-daemon --blockdev "driver=rbd,node-name=disk,pool=rbd,image=q,conf=$CONF,cache.direct=on" \
  --nbd-server "addr.type=unix,addr.path=$D/q.sock" \
  --export "type=nbd,id=e,node-name=disk,name=,writable=on" >"$D/q.log" 2>&1 &
PQ=$!
PEER=qemu-storage-daemon
sleep 2
if ! kill -0 $PQ 2>/dev/null; then
  # This qemu has no rbd module (Debian's is in qemu-block-extra, which must match qemu-utils'
  # version): qemu-nbd with a module that loads, e.g. bookworm's 7.2 unpacked with
  # `apt-get download qemu-utils qemu-block-extra` and `dpkg -x`, given as QEMU_NBD and
  # QEMU_MODULE_DIR.
  echo "# qemu-storage-daemon: $(tail -1 "$D/q.log"); peer: ${QEMU_NBD:-qemu-nbd}"
  "${QEMU_NBD:-qemu-nbd}" -k "$D/q.sock" -t -e 4 -f raw --cache=none "rbd:rbd/q:conf=$CONF" \
    >"$D/q.log" 2>&1 &
  PQ=$!
  PEER="qemu-nbd $("${QEMU_NBD:-qemu-nbd}" --version | head -1 | awk '{print $2}')"
fi
PIDS+=($PQ)
echo "# peer: $PEER (qemu's rbd driver, librbd $(dpkg-query -W -f '${Version}' librbd1 2>/dev/null))"
waitsock "$D/b.sock"; waitsock "$D/q.sock"
for s in b q; do
  fio --name=prefill --ioengine=nbd --uri="nbd+unix:///?socket=$D/$s.sock" --rw=write --bs=1M \
    --iodepth=8 --size=512M --output-format=json >/dev/null
done
CELLS=("randread 4k 1" "randread 4k 16" "randread 4k 64" "randwrite 4k 1" "randwrite 4k 16"
  "randwrite 4k 64" "read 1M 4" "write 1M 4")
for r in $(seq "$ROUNDS"); do
  for cell in "${CELLS[@]}"; do
    read -r rw bs qd <<<"$cell"
    echo "$r $rw $bs $qd blkq $(run "nbd+unix:///?socket=$D/b.sock" "$rw" "$bs" "$qd" "$PB")"
    echo "$r $rw $bs $qd qemu $(run "nbd+unix:///?socket=$D/q.sock" "$rw" "$bs" "$qd" "$PQ")"
  done
done
# The mirror: a local file leg + a write-mostly rbd: leg, against the rbd: device alone (b).
# Both legs are new (a sparse file, a new image): no initial resync under the runs.
truncate -s 512M "$D/local.img"
$B raid create "file:$D/local.img" "rbd:rbd/m,conf=$CONF" --write-mostly 1 --assume-clean >/dev/null
$B serve --raid1 "file:$D/local.img,rbd:rbd/m,conf=$CONF" --socket "$D/m.sock" --no-tcp \
  >"$D/m.log" 2>&1 &
PM=$!; PIDS+=($PM)
waitsock "$D/m.sock"
fio --name=prefill --ioengine=nbd --uri="nbd+unix:///?socket=$D/m.sock" --rw=write --bs=1M \
  --iodepth=8 --size=500M --output-format=json >/dev/null
for r in $(seq "$ROUNDS"); do
  for qd in 1 16; do
    echo "$r randread 4k $qd mirror $(run "nbd+unix:///?socket=$D/m.sock" randread 4k "$qd" "$PM")"
    echo "$r randread 4k $qd rbd $(run "nbd+unix:///?socket=$D/b.sock" randread 4k "$qd" "$PB")"
  done
done
