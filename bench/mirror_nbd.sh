#!/usr/bin/env bash
# A mirror through NBD, end to end (docs/bench.md section 12, "A mirror through NBD"): fio's
# nbd engine writes 4 KiB at random over CONNS connections (fio --numjobs: one process and one
# connection each) to `blkq serve --raid1 mem:$SIZE,mem:$SIZE` and to `blkq serve --device
# mem:$SIZE`, both on Unix sockets and running at once; the two alternate inside every round,
# their order swapped from round to round. Per run: IOPS and the server's CPU per write
# (utime + stime from /proc over the run, divided by its writes); then per server the median
# (min..max) and the per-round ratio mirror/one. Both exports are written through once first.
#   bench/mirror_nbd.sh [BLKQ_BINARY]     (default: target/release/blkq)
# Env: R (seconds per run, 5), ROUNDS (5), CONNS (2), IODEPTH (16, per connection), SIZE (1G),
#      OPTS (appended to every mem: spec, legs and the one-leg export alike: e.g. ",stream=0"
#      for ordinary copies into the store, ",thp=1" for huge pages; default none),
#      CLIENT (fio, or blkq: `blkq bench --as-leg` on the export's URI with conns=CONNS and
#      CONNS jobs, blkq's own NBD client, for a machine without fio; then the client shares
#      the process count below with nothing: its CPU is not in the server's).
# A smoke run: R=1 ROUNDS=1 bench/mirror_nbd.sh target/debug/blkq
set -euo pipefail
BIN=$(realpath "${1:-target/release/blkq}")
R=${R:-5}
ROUNDS=${ROUNDS:-5}
CONNS=${CONNS:-2}
IODEPTH=${IODEPTH:-16}
SIZE=${SIZE:-1G}
OPTS=${OPTS:-}
CLIENT=${CLIENT:-fio}
if [ "$CLIENT" = fio ]; then
  command -v fio >/dev/null || { echo "fio is needed (apt-get install fio), or CLIENT=blkq" >&2; exit 1; }
fi

dir=$(mktemp -d)
pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$dir"; }
trap cleanup EXIT

# serve NAME ARGS...: starts a server on $dir/NAME.sock; sets PID_<NAME>.
serve() {
  local name=$1; shift
  (cd "$dir" && exec "$BIN" serve "$@" --socket "$dir/$name.sock" --listen 127.0.0.1:0 \
    >"$dir/$name.log" 2>&1) &
  pids+=($!)
  printf -v "PID_$name" '%s' "$!"
  for _ in $(seq 100); do [ -S "$dir/$name.sock" ] && return; sleep 0.1; done
  cat "$dir/$name.log" >&2
  exit 1
}
serve one --device "mem:$SIZE$OPTS"
serve mirror --raid1 "mem:$SIZE$OPTS,mem:$SIZE$OPTS" --raid1-create --raid1-assume-clean

# Every byte written once first (1 MiB sequential writes), so the runs measure the steady
# state and not the first touch of the memory legs' pages (a mirror faults in two).
for name in one mirror; do
  if [ "$CLIENT" = fio ]; then
    fio --name=prefill --ioengine=nbd --uri="nbd+unix:///?socket=$dir/$name.sock" --rw=write \
      --bs=1M --iodepth=8 --size="$SIZE" >/dev/null 2>&1
  else
    "$BIN" bench --device "nbd+unix:///?socket=$dir/$name.sock,conns=$CONNS" --as-leg \
      --rw write --bs 1M --iodepth 8 --jobs "$CONNS" --runtime "$R" >/dev/null 2>&1
  fi
done

cpu_ticks() { awk '{ print $14 + $15 }' "/proc/$1/stat"; }
# run NAME: one fio run against server NAME; prints "IOPS NS_CPU_PER_WRITE".
run() {
  local name=$1 pidvar="PID_$1" t0 t1 json ios iops
  t0=$(cpu_ticks "${!pidvar}")
  if [ "$CLIENT" = fio ]; then
    json=$(fio --name=w --ioengine=nbd --uri="nbd+unix:///?socket=$dir/$name.sock" \
      --rw=randwrite --bs=4k --iodepth="$IODEPTH" --numjobs="$CONNS" --group_reporting \
      --time_based --runtime="$R" --size="$SIZE" --norandommap --randrepeat=0 \
      --output-format=json 2>/dev/null | sed -n '/^{/,$p')
    ios=$(grep -o '"total_ios" : [0-9]*' <<<"$json" | sed -n 2p | grep -o '[0-9]*$')
    iops=$(grep -o '"iops" : [0-9.]*' <<<"$json" | sed -n 2p | grep -o '[0-9.]*$')
  else
    json=$("$BIN" bench --device "nbd+unix:///?socket=$dir/$name.sock,conns=$CONNS" --as-leg \
      --rw randwrite --bs 4K --iodepth "$IODEPTH" --jobs "$CONNS" --runtime "$R" --json 2>/dev/null)
    ios=$(grep -o '"ios":[0-9]*' <<<"$json" | head -1 | cut -d: -f2)
    iops=$(grep -o '"iops":[0-9.]*' <<<"$json" | head -1 | cut -d: -f2)
  fi
  t1=$(cpu_ticks "${!pidvar}")
  awk -v i="$iops" -v n="$ios" -v c=$((t1 - t0)) -v hz="$(getconf CLK_TCK)" \
    'BEGIN { printf "%.0f %.0f\n", i, (n > 0 ? c / hz * 1e9 / n : 0) }'
}

echo "# bench/mirror_nbd.sh $BIN, $(date -u '+%F %H:%M UTC'), $(nproc) CPUs:$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
if [ "$CLIENT" = fio ]; then
  echo "# fio $(fio --version), --ioengine=nbd --rw=randwrite --bs=4k --iodepth=$IODEPTH --numjobs=$CONNS, ${R} s a run, $ROUNDS rounds"
else
  echo "# $BIN bench --device nbd+unix:///?socket=S,conns=$CONNS --as-leg --rw randwrite --bs 4K --iodepth $IODEPTH --jobs $CONNS, ${R} s a run, $ROUNDS rounds"
fi
echo "# one:    $BIN serve --device mem:$SIZE$OPTS"
echo "# mirror: $BIN serve --raid1 mem:$SIZE$OPTS,mem:$SIZE$OPTS --raid1-create --raid1-assume-clean"
out="$dir/rounds"
for round in $(seq "$ROUNDS"); do
  if ((round % 2)); then order="one mirror"; else order="mirror one"; fi
  declare -A got=()
  for s in $order; do got[$s]=$(run "$s"); done
  read -r one one_ns <<<"${got[one]}"
  read -r mirror mirror_ns <<<"${got[mirror]}"
  echo "round=$round one=$one mirror=$mirror one_ns=$one_ns mirror_ns=$mirror_ns" | tee -a "$out"
done

. "$(dirname "$0")/med.sh"
col() { sed -E "s/.* $1=([0-9.]+).*/\1/" "$out" | tr '\n' ' '; }
ratio() { awk -v a="$1" -v b="$2" '
    { for (i = 1; i <= NF; i++) { split($i, kv, "="); x[kv[1]] = kv[2] }
      if (x[b] > 0) printf "%s ", x[a] / x[b] }' "$out"; }
echo
echo "| connections x depth | one leg, IOPS | mirror, IOPS | mirror/one | CPU ns per write, one | mirror | one/mirror |"
echo "|---|--:|--:|--:|--:|--:|--:|"
printf '| %s x %s | %s | %s | %s | %s | %s | %s |\n' "$CONNS" "$IODEPTH" \
  "$(med "$(col one)" '%.0f')" "$(med "$(col mirror)" '%.0f')" "$(med "$(ratio mirror one)" '%.2f')" \
  "$(med "$(col one_ns)" '%.0f')" "$(med "$(col mirror_ns)" '%.0f')" "$(med "$(ratio one_ns mirror_ns)" '%.2f')"
