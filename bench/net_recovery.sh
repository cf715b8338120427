#!/usr/bin/env bash
# bench/net_recovery.sh: what a lost link costs a mirror with a remote leg (docs/bench.md
# section 16). Two network namespaces joined by a veth pair (run as root): the back serves a
# 1 GiB file as the export `leg`, the front serves `--raid1 file:LOCAL,nbd://BACK/leg` with a
# 1 MiB bitmap chunk. Per case: the link is cut, fio writes 4 KiB random blocks at a fixed
# rate through the front for SECS seconds, the link is restored and the leg re-added; the
# time until both legs are in sync and the chunks copied are read from `blkq raid status`.
# Then the same leg added blank (a full recovery) for comparison. Prints:
#   case cut_s rate_iops chunks_copied MiB_copied recovery_s
# B=PATH picks the binary (default target/release/blkq).
set -euo pipefail
B=$(readlink -f "${B:-target/release/blkq}")
echo "# bench/net_recovery.sh: $(date -u +%FT%TZ), $(uname -n), $(nproc) CPUs, binary $B ($(git rev-parse --short HEAD 2>/dev/null || echo ?))"
. "$(dirname "$0")/two_hosts.sh"

truncate -s 1G "$D/local.img" "$D/leg.img"
ip netns exec $K "$B" serve --device "file:$D/leg.img" --export leg --listen 10.0.0.2:10809 \
  --no-unix >/dev/null 2>"$D/leg.err" &
PIDS="$PIDS $!"
disown
sleep 1
# A lost link fails the leg at the first request unanswered for 2 s (no reconnection wait).
LEG="nbd://10.0.0.2:10809/leg,timeout=2,reconnect_deadline=0"
ip netns exec $F "$B" serve --raid1 "file:$D/local.img,$LEG" --raid1-create --raid1-assume-clean \
  --raid1-option bitmap_chunk=1M --raid1-option bitmap_quiet_ms=500 --raid1-option readd=off \
  --control "$D/ctl.sock" --socket "$D/nbd.sock" --no-tcp >/dev/null 2>"$D/front.err" &
PIDS="$PIDS $!"
disown
while [ ! -S "$D/ctl.sock" ]; do sleep 0.1; done
ctl() { "$B" raid "$@" --control "$D/ctl.sock"; }
field() { ctl status --json | /usr/bin/python3 -c "import json,sys; v=json.load(sys.stdin); print($1)"; }
wait_for() { while [ "$(field "$1")" != True ]; do sleep 0.05; done; }
synced='v["legs"][1]["state"]=="in_sync" and v["sync"]["action"]=="idle"'

# Fill once, so the full recovery copies real data.
fio --name=fill --ioengine=nbd --uri="nbd+unix:///?socket=$D/nbd.sock" --rw=write --bs=1M \
  --size=1000M >/dev/null 2>&1
wait_for "$synced and v[\"bitmap\"][\"dirty\"]==0"

t0() { date +%s.%N; }
recover() { # SPEC: re-add the leg (slot 1) and time until in sync
  ctl remove 1 >/dev/null
  local before; before=$(field 'v["sync"]["chunks_copied"]')  # a running total
  local s; s=$(t0)
  ctl add "$1" >/dev/null
  wait_for "$synced"
  local e; e=$(t0)
  local c; c=$(( $(field 'v["sync"]["chunks_copied"]') - before ))
  # A chunk is 1 MiB: chunks copied = MiB copied.
  echo "$c $c $(/usr/bin/python3 -c "print(round($e-$s,2))")"
}
for case in "5 20" "5 200" "20 200"; do
  set -- $case
  link down
  fio --name=w --ioengine=nbd --uri="nbd+unix:///?socket=$D/nbd.sock" --rw=randwrite --bs=4k \
    --rate_iops=$2 --time_based --runtime=$1 --size=1000M >/dev/null 2>&1
  wait_for 'v["legs"][1]["state"]=="faulty"'
  link up
  read -r chunks mib secs < <(recover "$LEG")
  echo "bitmap $1 $2 $chunks $mib $secs"
  wait_for '
v["bitmap"]["dirty"]==0'
done
# The same leg blank: everything is copied.
ctl fail 1 >/dev/null
ctl remove 1 >/dev/null
ip netns exec $K dd if=/dev/zero of="$D/leg.img" bs=1M count=2 conv=notrunc status=none
s=$(t0)
ctl add "$LEG" >/dev/null
wait_for "$synced"
e=$(t0)
echo "full - - - $(field 'v["sync"]["done_bytes"]//1048576') $(/usr/bin/python3 -c "print(round($e-$s,2))")"
