#!/usr/bin/env bash
# bench/net_mirror.sh: mirror writes with a remote leg (docs/bench.md section 17). Two network
# namespaces joined by a veth pair (run as root). The front serves a new `--raid1` array and
# fio (`--ioengine=nbd`, 4 KiB random writes, queue depth 1, one job, 5 s) writes through its
# Unix socket. Cases, interleaved, ROUNDS rounds (default 3):
#   local       both legs are local files
#   remote      a local file and the back's export (blkq serve --device file:) over the veth
#   far         as remote, every I/O of the back's device 2 ms late (fault.latency_us=2000: a
#               far host; this kernel has no netem to delay the link itself)
#   far-wb      as far, the remote leg write-mostly with write_behind=256
# Prints: round case IOPS p50_us p99_us.
# B=PATH picks the binary (default target/release/blkq).
set -euo pipefail
B=$(readlink -f "${B:-target/release/blkq}")
ROUNDS=${ROUNDS:-3}
echo "# bench/net_mirror.sh: $(date -u +%FT%TZ), $(uname -n), $(nproc) CPUs, binary $B ($(git rev-parse --short HEAD 2>/dev/null || echo ?))"
. "$(dirname "$0")/two_hosts.sh"
stop_all() { # newest first: the front before its leg's server (else its clean stop waits
  # for the vanished leg until reconnect_deadline)
  local p n order=""
  for p in $PIDS; do order="$p $order"; done
  for p in $order; do
    kill -TERM $p 2>/dev/null || true
    n=0
    while kill -0 $p 2>/dev/null; do
      sleep 0.05; n=$((n + 1))
      if [ $n = 200 ]; then echo "# pid $p ($(tr '\0' ' ' </proc/$p/cmdline | cut -c1-120)) still running 10 s after SIGTERM" >&2; fi
    done
  done
  PIDS=""
}
LEG="nbd://10.0.0.2:10809/leg"

one() { # CASE
  rm -f "$D"/*.img "$D"/*.sock
  truncate -s 1G "$D/a.img" "$D/b.img"
  local legs opts=()
  case $1 in
    local) legs="file:$D/a.img,file:$D/b.img" ;;
    *)
      local dev="file:$D/b.img"
      case $1 in far*) dev="$dev,fault.latency_us=2000" ;; esac
      ip netns exec $K "$B" serve --device "$dev" --export leg \
        --listen 10.0.0.2:10809 --no-unix >/dev/null 2>&1 &
      PIDS="$PIDS $!"
      while ! ip netns exec $F bash -c "exec 3<>/dev/tcp/10.0.0.2/10809" 2>/dev/null; do sleep 0.05; done
      legs="file:$D/a.img,$LEG"
      ;;
  esac
  if [ "$1" = far-wb ]; then
    ip netns exec $F "$B" raid create "file:$D/a.img" "$LEG" --write-mostly 1 --assume-clean >/dev/null
    opts=(--raid1-option write_behind=256)
  else
    opts=(--raid1-create --raid1-assume-clean) # new sparse legs: no initial resync under the load
  fi
  ip netns exec $F "$B" serve --raid1 "$legs" "${opts[@]}" --socket "$D/f.sock" --no-tcp \
    >/dev/null 2>&1 &
  disown
  PIDS="$PIDS $!"
  while [ ! -S "$D/f.sock" ]; do sleep 0.05; done
  fio --name=w --ioengine=nbd --uri="nbd+unix:///?socket=$D/f.sock" --rw=randwrite --bs=4k \
    --iodepth=1 --size=1000M --time_based --runtime=5 --output-format=json \
    2>/dev/null | sed -n '/^{/,$p' | /usr/bin/python3 -c '
import json,sys
w=json.load(sys.stdin)["jobs"][0]["write"]
p=w["clat_ns"]["percentile"]
print(int(w["iops"]), int(p["50.000000"]/1000), int(p["99.000000"]/1000))'
  stop_all
}
for r in $(seq "$ROUNDS"); do
  for c in local remote far far-wb; do echo "$r $c $(one $c)"; done
done
