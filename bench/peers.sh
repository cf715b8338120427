#!/usr/bin/env bash
# Peers, side by side: the same fio nbd-engine load against `blkq serve` and the other NBD
# servers, over a Unix socket and over TCP loopback, on three kinds of backend:
#
#   mem        blkq serve --device mem:$SIZE
#              nbdkit memory $SIZE allocator=malloc   (one flat allocation; nbdkit's default
#                          allocator=sparse was slower on 4k random reads here)
#              qemu-nbd -f raw --cache=writeback --aio=io_uring -e 16 on a raw image in
#                          /dev/shm (qemu has no memory block driver that keeps data; aio=io_uring
#                          beat aio=threads here)
#              nbd-server (config file, max_threads 4, splice off) on a file in /dev/shm
#   file-shm   a raw image in /dev/shm (tmpfs), served by
#              blkq serve --device file:IMG                (engine=auto: io_uring)
#              qemu-nbd -f raw --cache=writeback --aio=io_uring -e 16 IMG
#              nbdkit file IMG
#   file-disk  the same on a real file system: a raw image in $DISK_DIR (default /var/tmp; the
#              header of the output names the file system). Each server is prefilled, so the
#              image is in the page cache: the VM-disk-with-writeback-cache case.
#
# Every server gets its own image of the same size (they lock their files), all servers of a
# backend run at once (idle ones cost nothing) and each cell is measured ROUNDS times, the
# servers alternated inside the cell and their order rotated from round to round, so drift on
# the machine hits all of them alike. Per cell and server: the median IOPS and its spread
# (max-min over median), the median p99 completion latency, the server's CPU time per I/O
# (utime+stime of the server process over the run, from /proc, divided by the run's I/Os) and,
# where perf can count the syscall tracepoints, the server's syscalls and context switches per
# I/O. Those counts come from one more run per cell and server, after the measured rounds, with
# perf stat -p attached to the server: the measured runs are never traced (a syscall
# tracepoint taxes every system call, so tracing would move the ratio against the server that
# makes more of them). Then blkq's IOPS over the best peer's, and blkq's CPU per I/O over that
# peer's.
#
# Workloads (fio --ioengine=nbd, time-based, R seconds):
#   4k randread and randwrite, 1 connection, iodepth 1, 16 and 64 (every backend)
#   4k randread and randwrite, MULTI fio processes (fio --numjobs=MULTI: one process and one
#      connection each; fio forks jobs unless --thread), iodepth 16 (mem only): a load
#      generator that is not the bottleneck, as one fio process is at one connection
#   1 MiB sequential read and write, 1 connection, iodepth QD_1M (every backend)
#
# Then (STRACE=1, mem over the Unix socket) syscalls per I/O of blkq and the best peer on 4k
# randread iodepth 64 under strace -c -f and perf stat, server and fio.
#
# Needs (as root: apt-get install -y fio nbdkit qemu-utils nbd-server strace libnbd-bin):
# fio with the nbd engine, nbdkit, qemu-nbd, nbd-server, strace, nbdinfo, /usr/bin/python3;
# perf (optional).
#
# Environment:
#   R=3           seconds per run (RUNTIME is read too, as in bench/tables.sh)
#   ROUNDS=2      measurements per cell and server, interleaved
#   SIZE=1G       backend size (all servers)
#   BACKENDS="mem file-shm file-disk"
#   DISK_DIR=/var/tmp   where the file-disk images go (a real file system, not tmpfs)
#   BLKQ=PATH     blkq binary (default: cargo build --release -p blkq, target/release/blkq)
#   SERVERS="blkq nbdkit qemu-nbd"   subset / order (blkq must stay for the ratio); add
#                 nbd-server for the mem backend (it serves no file backend here), at the cost
#                 of a quarter more mem runs; blkq-copy is blkq with splice=0 (every payload
#                 copied through the server's buffers), never counted as a peer
#   Duration: R=3 ROUNDS=2 with the defaults is 312 runs, about 22 minutes on the 2-vCPU box
#   (a run costs R plus about a second: fio start, bookkeeping), plus one counted run per cell
#   and server with PERF=1
#   TRANSPORTS="unix tcp"
#   MULTI=4       fio processes of the multi-process rows (0 leaves them out)
#   QD_1M=8       iodepth of the 1 MiB rows
#   WORKLOADS=REGEX   only the rows whose label matches (labels: 4k_randread, 4k_randwrite,
#                 1M_read, 1M_write), e.g. WORKLOADS='1M_.*' (default: all)
#   TCP_QD16=1    0 drops iodepth 16 over TCP (to shorten the run)
#   QDS="1 16 64" iodepths of the 4k one-connection rows
#   PERF=1        0: no counted runs (no syscall and context-switch columns); 1: one more run
#                 per cell and server under perf stat, for those columns only
#   PREFILL=1     0: the servers are not prefilled (a fresh, sparse device: reads of holes,
#                 writes that touch pages first; write rows come after the read rows, so they
#                 fill it as they go)
#   STRACE=1      0 skips the strace/perf syscall section at the end
#   QUICK=1       a smoke run: R=1, ROUNDS=1, SIZE=256M, 4k qd1 and qd64, 1 MiB read and write,
#                 MULTI rows with 2 processes, RETRIES=0, STRACE=0 (each overridable)
#   OTHER_MAX=0.25, RETRIES=1, RETRY_SLEEP=5: a run during which other processes (not the
#                 server, not fio) used more than OTHER_MAX cores is run again, up to RETRIES
#                 times, RETRY_SLEEP seconds later, RETRY_BUDGET retries in all; a cell still
#                 disturbed gets a * in the table
#   OUT=DIR       where the raw results (fio JSON, perf/strace summaries, results.tsv) are kept
#                 (default: a new /tmp/blkq-peers.XXXXXX)
set -euo pipefail
cd "$(dirname "$0")/.."

QUICK=${QUICK:-0}
WORKLOADS=${WORKLOADS:-.*}
if [[ $QUICK == 1 ]]; then
  R=${R:-${RUNTIME:-1}}
  ROUNDS=${ROUNDS:-1}
  SIZE=${SIZE:-256M}
  MULTI=${MULTI:-2}
  RETRIES=${RETRIES:-0}
  STRACE=${STRACE:-0}
fi
R=${R:-${RUNTIME:-3}}
ROUNDS=${ROUNDS:-2}
SIZE=${SIZE:-1G}
BACKENDS=${BACKENDS:-"mem file-shm file-disk"}
DISK_DIR=${DISK_DIR:-/var/tmp}
SERVERS=${SERVERS:-"blkq nbdkit qemu-nbd"}
TRANSPORTS=${TRANSPORTS:-"unix tcp"}
MULTI=${MULTI:-4}
QD_1M=${QD_1M:-8}
TCP_QD16=${TCP_QD16:-1}
PERF=${PERF:-1}
PREFILL=${PREFILL:-1}
STRACE=${STRACE:-1}
OTHER_MAX=${OTHER_MAX:-0.25}
RETRIES=${RETRIES:-1}
RETRY_SLEEP=${RETRY_SLEEP:-5}
RETRY_BUDGET=${RETRY_BUDGET:-20}
PY=/usr/bin/python3
HZ=$(getconf CLK_TCK)

die() {
  echo "peers.sh: $*" >&2
  exit 1
}

tools=(fio strace nbdinfo truncate "$PY")
for s in $SERVERS; do
  [[ $s == blkq* ]] || tools+=("$s")
done
for tool in "${tools[@]}"; do
  command -v "$tool" >/dev/null ||
    die "missing $tool (apt-get install -y fio nbdkit qemu-utils nbd-server strace libnbd-bin)"
done
fio --enghelp=nbd >/dev/null 2>&1 || die "this fio has no nbd engine"
[[ -d /dev/shm && -w /dev/shm ]] || die "/dev/shm (tmpfs) is needed for the image files"
[[ " $SERVERS " == *" blkq "* ]] || die "SERVERS must include blkq (the ratios are blkq's)"
if [[ " $BACKENDS " == *" file-disk "* ]]; then
  [[ -d $DISK_DIR && -w $DISK_DIR ]] || die "DISK_DIR=$DISK_DIR is not a writable directory"
  DISK_FS=$(findmnt -n -o FSTYPE --target "$DISK_DIR" 2>/dev/null || stat -f -c %T "$DISK_DIR")
  [[ $DISK_FS != tmpfs ]] || die "DISK_DIR=$DISK_DIR is on tmpfs; file-disk needs a real file system"
fi

if [[ -z ${BLKQ:-} ]]; then
  cargo build --release -p blkq >&2
  BLKQ=$PWD/target/release/blkq
  BLKQ_FROM="commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet HEAD 2>/dev/null || echo ' + local changes')"
else
  BLKQ_FROM="BLKQ=$BLKQ"
fi
[[ -x $BLKQ ]] || die "no blkq binary at $BLKQ"

# Sockets, config files and the tmpfs images: under WORK; the file-disk images: under DWORK.
WORK=$(mktemp -d /dev/shm/blkq-peers.XXXXXX)
DWORK=""
if [[ " $BACKENDS " == *" file-disk "* ]]; then
  DWORK=$(mktemp -d "$DISK_DIR/blkq-peers.XXXXXX")
fi
OUT=${OUT:-$(mktemp -d /tmp/blkq-peers.XXXXXX)}
mkdir -p "$OUT"
TSV=$OUT/results.tsv
: >"$TSV"

PERF_OK=0
if [[ $PERF == 1 ]] && command -v perf >/dev/null &&
  perf stat -x, -e raw_syscalls:sys_enter,context-switches -o /dev/null true 2>/dev/null; then
  PERF_OK=1
fi

# Every process this script starts (servers, daemonized servers, perf, strace), killed on exit.
PIDS=()
cleanup() {
  local rc=$? pid
  trap - EXIT INT TERM
  for pid in "${PIDS[@]}"; do
    pkill -TERM -P "$pid" 2>/dev/null || true # nbd-server's per-connection children
    kill -TERM "$pid" 2>/dev/null || true
  done
  sleep 0.2
  for pid in "${PIDS[@]}"; do
    pkill -KILL -P "$pid" 2>/dev/null || true
    kill -KILL "$pid" 2>/dev/null || true
  done
  rm -rf "$WORK"
  [[ -n $DWORK ]] && rm -rf "$DWORK"
  if [[ $rc -ne 0 ]]; then
    echo "peers.sh: failed (exit $rc); logs and raw results in $OUT" >&2
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

free_port() {
  "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# alive PID: the process exists and is not a zombie.
alive() {
  [[ -r /proc/$1/stat ]] || return 1
  local state
  state=$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null) || return 1
  [[ $state != Z && $state != X ]]
}

# servers_for BACKEND: the servers of $SERVERS that serve BACKEND, in $SERVERS order.
servers_for() {
  local s out=()
  for s in $SERVERS; do
    case $1:$s in
      mem:blkq | mem:blkq-copy | mem:nbdkit | mem:qemu-nbd | mem:nbd-server) out+=("$s") ;;
      file-*:blkq | file-*:blkq-copy | file-*:nbdkit | file-*:qemu-nbd) out+=("$s") ;;
    esac
  done
  echo "${out[@]}"
}

# image BACKEND NAME: a fresh sparse image of $SIZE for server NAME; prints its path.
image() {
  local dir=$WORK
  [[ $1 == file-disk ]] && dir=$DWORK
  rm -f "$dir/$2.img"
  truncate -s "$SIZE" "$dir/$2.img"
  echo "$dir/$2.img"
}

# start_server NAME TRANSPORT BACKEND: starts NAME serving on TRANSPORT (unix|tcp); sets
# SPIDS[NAME] (the process serving) and URIS[NAME]; returns once an NBD client completes a
# handshake.
declare -A SPIDS URIS
start_server() {
  local name=$1 tr=$2 be=$3 port="" sock="$WORK/$1.sock" log="$OUT/$1-$2-$3.log" img="" spid
  local export=""
  rm -f "$sock"
  [[ $tr == tcp ]] && port=$(free_port)
  local listen_blkq=(--no-tcp --socket "$sock") listen_nbdkit=(-U "$sock")
  local listen_qemu=(-k "$sock")
  if [[ $tr == tcp ]]; then
    listen_blkq=(--no-unix --listen "127.0.0.1:$port")
    listen_nbdkit=(-i 127.0.0.1 -p "$port")
    listen_qemu=(-b 127.0.0.1 -p "$port")
  fi
  case $name in
    blkq | blkq-copy)
      # blkq-copy: every zero-copy path off (splice=0), payloads copied through buffers.
      local dev="mem:$SIZE" opt=""
      [[ $name == blkq-copy ]] && opt=",splice=0"
      if [[ $be != mem ]]; then
        img=$(image "$be" "$name")
        dev="file:$img"
      fi
      dev+=$opt
      "$BLKQ" serve --device "$dev" "${listen_blkq[@]}" >"$log" 2>&1 &
      spid=$!
      ;;
    nbdkit)
      if [[ $be == mem ]]; then
        nbdkit -f "${listen_nbdkit[@]}" memory "$SIZE" allocator=malloc >"$log" 2>&1 &
      else
        img=$(image "$be" nbdkit)
        nbdkit -f "${listen_nbdkit[@]}" file "$img" >"$log" 2>&1 &
      fi
      spid=$!
      ;;
    qemu-nbd)
      img=$(image "$be" qemu-nbd)
      qemu-nbd -f raw -t -e 16 --cache=writeback --aio=io_uring "${listen_qemu[@]}" "$img" >"$log" 2>&1 &
      spid=$!
      ;;
    nbd-server)
      img=$(image "$be" nbd-server)
      rm -f "$WORK/nbd-server.pid"
      {
        echo "[generic]"
        if [[ $tr == unix ]]; then
          echo "    unixsock = $sock"
        else
          echo "    listenaddr = 127.0.0.1"
          echo "    port = $port"
        fi
        echo "    max_threads = 4"
        echo "[disk]"
        echo "    exportname = $img"
      } >"$WORK/nbd-server.conf"
      # It daemonizes: the pid that serves is the one in the pid file.
      nbd-server -C "$WORK/nbd-server.conf" -p "$WORK/nbd-server.pid" >"$log" 2>&1 ||
        die "nbd-server did not start: $(cat "$log")"
      for _ in $(seq 1 100); do
        [[ -s $WORK/nbd-server.pid ]] && break
        sleep 0.05
      done
      [[ -s $WORK/nbd-server.pid ]] || die "nbd-server wrote no pid file"
      spid=$(cat "$WORK/nbd-server.pid")
      export="disk"
      ;;
    *) die "unknown server $name" ;;
  esac
  PIDS+=("$spid")
  SPIDS[$name]=$spid
  if [[ $tr == unix ]]; then
    URIS[$name]="nbd+unix:///$export?socket=$sock"
  else
    URIS[$name]="nbd://127.0.0.1:$port/$export"
  fi
  for _ in $(seq 1 200); do
    if nbdinfo --size "${URIS[$name]}" >/dev/null 2>&1; then
      return 0
    fi
    alive "$spid" || die "$name ($tr, $be) exited at start: $(tail -n 20 "$log")"
    sleep 0.05
  done
  die "$name ($tr, $be) did not accept connections on ${URIS[$name]} in 10 s"
}

stop_server() {
  local spid=${SPIDS[$1]}
  pkill -TERM -P "$spid" 2>/dev/null || true
  kill -TERM "$spid" 2>/dev/null || true
  for _ in $(seq 1 50); do
    alive "$spid" || break
    sleep 0.1
  done
  if alive "$spid"; then
    pkill -KILL -P "$spid" 2>/dev/null || true
    kill -KILL "$spid" 2>/dev/null || true
  fi
  wait "$spid" 2>/dev/null || true
}

prefill() {
  fio --name=prefill --ioengine=nbd --uri="$1" --rw=write --bs=1M --iodepth=16 \
    --output="$OUT/prefill.txt" >/dev/null || die "prefill of $1 failed: $(cat "$OUT/prefill.txt")"
}

# "BUSY TASK TOTAL" jiffies of the whole machine (/proc/stat): BUSY is all but idle, iowait
# and steal; TASK is user+nice+system, the part that is charged to processes.
cpu_jiffies() {
  awk '/^cpu /{task=$2+$3+$4; busy=task+$7+$8; print busy, task, busy+$5+$6+$9; exit}' /proc/stat
}

# CPU ticks (utime+stime, and those of reaped children) of the server SPID and of its live
# child processes (nbd-server forks one per connection). Threads that ended (blkq's connection
# threads end with the connection) stay counted in the process's utime+stime.
server_ticks() {
  local p
  for p in "$SPID" $(pgrep -P "$SPID" 2>/dev/null); do
    sed 's/.*) //' "/proc/$p/stat" 2>/dev/null || true
  done | awk '{s += $12 + $13 + $14 + $15} END {print s + 0}'
}

# child_ms VAR: sets VAR to the CPU milliseconds of this shell's reaped children (fio and what
# it forks), from `times`, which must run in this shell.
child_ms() {
  times >"$WORK/times"
  read -r "$1" < <(awk 'NR == 2 {split($1, u, /[ms]/); split($2, k, /[ms]/)
    printf "%d\n", (u[1] * 60 + u[2] + k[1] * 60 + k[2]) * 1000}' "$WORK/times")
}

# fio_run JSON RW BS QD JOBS [extra args]: one time-based run against $URI.
fio_run() {
  local json=$1 rw=$2 bs=$3 qd=$4 jobs=$5
  shift 5
  fio --name=peer --ioengine=nbd --uri="$URI" --rw="$rw" --bs="$bs" --iodepth="$qd" \
    --numjobs="$jobs" --group_reporting --time_based --runtime="$R" --norandommap \
    --randrepeat=0 --output-format=json --output="$json" "$@" >/dev/null 2>"$json.err"
}

# measure JSON RW BS QD JOBS: one run (fio_run) against $URI served by $SPID, with perf stat
# on the server when COUNT=1 (the counted run; never on a measured one); sets BUSY (all cores
# busy), SRV (the server), FIOC (fio, all its
# processes) and OTHER (the rest of what processes used), in cores; STICKS (server CPU ticks);
# NSYS and NCTX (server syscalls and context switches, NA without perf).
measure() {
  local b0 k0 t0 b1 k1 t1 s0 s1 f0 f1 ppid="" pf="$1.perf"
  if [[ ${COUNT:-0} == 1 ]]; then
    perf stat -x, -e raw_syscalls:sys_enter,context-switches -p "$SPID" -o "$pf" 2>/dev/null &
    ppid=$!
    sleep 0.2 # perf attaches
  fi
  read -r b0 k0 t0 < <(cpu_jiffies)
  s0=$(server_ticks)
  child_ms f0
  local ok=1
  fio_run "$@" || ok=0
  child_ms f1
  sleep 0.05 # nbd-server reaps its connection's process
  s1=$(server_ticks)
  read -r b1 k1 t1 < <(cpu_jiffies)
  NSYS=NA NCTX=NA
  if [[ -n $ppid ]]; then
    kill -INT "$ppid" 2>/dev/null || true
    wait "$ppid" 2>/dev/null || true
    read -r NSYS NCTX < <(awk -F, '$3 == "raw_syscalls:sys_enter" {s = $1}
      $3 == "context-switches" {c = $1} END {print (s == "" ? "NA" : s), (c == "" ? "NA" : c)}' "$pf")
  fi
  STICKS=$((s1 - s0))
  read -r BUSY SRV FIOC OTHER < <(awk -v b=$((b1 - b0)) -v k=$((k1 - k0)) -v t=$((t1 - t0)) \
    -v s=$((s1 - s0)) -v f=$((f1 - f0)) -v n="$(nproc)" -v hz="$HZ" 'BEGIN {
      w = t / n; if (w <= 0) w = 1
      f = f * hz / 1000
      o = k / w - s / w - f / w; if (o < 0) o = 0
      printf "%.2f %.2f %.2f %.2f\n", b / w, s / w, f / w, o }')
  [[ $ok == 1 ]]
}

# fio_stats JSON: "IOPS P99_US TOTAL_IOS FIO_CORES" of the run (reads plus writes; FIO_CORES:
# fio's usr+sys CPU per job, in cores).
fio_stats() {
  "$PY" - "$1" <<'EOF'
import json, sys
j = json.load(open(sys.argv[1]))["jobs"][0]
iops = ios = 0.0
p99 = 0.0
for op in ("read", "write"):
    d = j[op]
    if d["total_ios"] > 0:
        iops += d["iops"]
        ios += d["total_ios"]
        p99 = max(p99, d["clat_ns"]["percentile"]["99.000000"] / 1000.0)
print(f"{iops:.0f} {p99:.1f} {ios:.0f} {(j['usr_cpu'] + j['sys_cpu']) / 100:.2f}")
EOF
}

# workloads BACKEND: "label rw bs qd conns" lines (those whose label matches $WORKLOADS).
workloads() {
  all_workloads "$@" | grep -E "^(${WORKLOADS}) "
}

all_workloads() {
  local rw qd
  local qds=${QDS:-"1 16 64"}
  [[ $QUICK == 1 ]] && qds=${QDS:-"1 64"}
  for rw in randread randwrite; do
    for qd in $qds; do
      echo "4k_$rw $rw 4k $qd 1"
    done
    if [[ $1 == mem && $MULTI -gt 0 ]]; then
      echo "4k_$rw $rw 4k 16 $MULTI"
    fi
  done
  echo "1M_read read 1M $QD_1M 1"
  echo "1M_write write 1M $QD_1M 1"
}

# Estimated duration.
nruns=0
for be in $BACKENDS; do
  nsrv=$(wc -w <<<"$(servers_for "$be")")
  for tr in $TRANSPORTS; do
    while read -r _ _ _ qd _; do
      [[ $tr == tcp && $TCP_QD16 == 0 && $qd == 16 ]] && continue
      nruns=$((nruns + nsrv * (ROUNDS + PERF)))
    done < <(workloads "$be")
  done
done
echo "peers.sh: $nruns runs of ${R}s ($ROUNDS rounds; about $((nruns * (R + 1) / 60 + 1)) min plus prefills); raw results in $OUT" >&2

for be in $BACKENDS; do
  read -r -a srvs <<<"$(servers_for "$be")"
  for tr in $TRANSPORTS; do
    for s in "${srvs[@]}"; do
      start_server "$s" "$tr" "$be"
      [[ $PREFILL == 0 ]] || prefill "${URIS[$s]}"
    done
    mapfile -t wls < <(workloads "$be")
    for w in "${wls[@]}"; do
      read -r label rw bs qd conns <<<"$w"
      [[ $tr == tcp && $TCP_QD16 == 0 && $qd == 16 ]] && continue
      rounds=$(seq 1 "$ROUNDS")
      [[ $PERF_OK == 1 ]] && rounds+=" count"
      for round in $rounds; do
        # Servers alternated inside the cell, their order rotated each round. The last round,
        # "count", is traced (perf stat on the server) and gives only the syscall and
        # context-switch columns.
        COUNT=0 rot=$round
        [[ $round == count ]] && COUNT=1 rot=1
        n=${#srvs[@]}
        for i in $(seq 0 $((n - 1))); do
          s=${srvs[$(((i + rot - 1) % n))]}
          SPID=${SPIDS[$s]} URI=${URIS[$s]}
          json="$OUT/$be-$s-$tr-$label-c$conns-qd$qd-r$round.json"
          try=0
          while :; do
            if COUNT=$COUNT measure "$json" "$rw" "$bs" "$qd" "$conns"; then
              read -r iops p99 ios fcpu < <(fio_stats "$json")
            else
              echo "peers.sh: fio failed against $s ($be, $tr, $label c$conns qd$qd): $(tail -n 3 "$json.err")" >&2
              iops=NA p99=NA ios=NA fcpu=NA BUSY=NA SRV=NA FIOC=NA OTHER=0
            fi
            cpu_io=NA sys_io=NA ctx_io=NA
            if [[ $ios != NA && $ios != 0 ]]; then
              cpu_io=$(awk -v t="$STICKS" -v hz="$HZ" -v n="$ios" 'BEGIN {printf "%.2f", t * 1e6 / hz / n}')
              [[ $NSYS != NA ]] && sys_io=$(awk -v c="$NSYS" -v n="$ios" 'BEGIN {printf "%.2f", c / n}')
              [[ $NCTX != NA ]] && ctx_io=$(awk -v c="$NCTX" -v n="$ios" 'BEGIN {printf "%.2f", c / n}')
            fi
            printf '  %-9s %-10s %-4s %-13s c%s qd%-2s r%s %8s IOPS  p99 %8s us  server %s us/IO, %s syscalls/IO, %s ctxsw/IO; cores: busy %s, server %s, fio %s, other %s\n' \
              "$be" "$s" "$tr" "$label" "$conns" "$qd" "$round" "$iops" "$p99" "$cpu_io" "$sys_io" "$ctx_io" "$BUSY" "$SRV" "$FIOC" "$OTHER" >&2
            [[ $COUNT == 0 ]] || break
            awk -v o="$OTHER" -v m="$OTHER_MAX" 'BEGIN {exit !(o > m)}' || break
            try=$((try + 1))
            [[ $try -le $RETRIES && $RETRY_BUDGET -gt 0 ]] || break
            RETRY_BUDGET=$((RETRY_BUDGET - 1))
            echo "  (something else used $OTHER cores: again in ${RETRY_SLEEP}s)" >&2
            sleep "$RETRY_SLEEP"
          done
          printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' \
            "$be" "$label" "$tr" "$conns" "$qd" "$s" "$round" "$iops" "$p99" "$ios" "$BUSY" \
            "$fcpu" "$SRV" "$OTHER" "$FIOC" "$cpu_io" "$sys_io" "$ctx_io" >>"$TSV"
        done
      done
    done
    for s in "${srvs[@]}"; do
      stop_server "$s"
    done
    rm -f "$WORK"/*.img
    [[ -n $DWORK ]] && rm -f "$DWORK"/*.img
  done
done

echo
echo "## blkq serve and its peers, side by side"
echo
echo "- date: $(date -u '+%Y-%m-%d %H:%M:%S UTC'); nproc: $(nproc); kernel $(uname -r);" \
  "CPU: $(awk -F': ' '/^model name/{print $2; exit}' /proc/cpuinfo)"
echo "- fio and the servers share the same $(nproc) vCPU(s), unpinned."
versions="$(fio --version); $("$BLKQ" --version) ($BLKQ_FROM)"
for s in $SERVERS; do
  case $s in
    nbdkit) versions+="; $(nbdkit --version | head -n 1)" ;;
    qemu-nbd) versions+="; $(qemu-nbd --version | head -n 1)" ;;
    nbd-server) versions+="; nbd-server $(nbd-server -V 2>&1 | awk '/version/{print $NF; exit}')" ;;
  esac
done
echo "- $versions"
if [[ $PREFILL == 0 ]]; then
  echo "- backends, $SIZE each, fresh: not prefilled (reads of holes until a write row fills them):"
else
  echo "- backends, $SIZE each, every server prefilled (1 MiB writes over the whole device):"
fi
for be in $BACKENDS; do
  case $be in
    mem) echo "  - mem: blkq mem:$SIZE; nbdkit memory allocator=malloc; qemu-nbd raw image in" \
      "/dev/shm (--aio=io_uring --cache=writeback); nbd-server file in /dev/shm" ;;
    file-shm) echo "  - file-shm: a raw image in /dev/shm (tmpfs) per server: blkq file:IMG;" \
      "qemu-nbd --aio=io_uring --cache=writeback; nbdkit file" ;;
    file-disk) echo "  - file-disk: a raw image per server in $DISK_DIR ($DISK_FS), in the page cache" \
      "after the prefill: blkq file:IMG; qemu-nbd --aio=io_uring --cache=writeback; nbdkit file" ;;
  esac
done
echo "- each cell: $ROUNDS round(s) of ${R}s per server, servers alternated within the cell" \
  "(order rotated per round); fio --ioengine=nbd --numjobs=conns (one process and one" \
  "connection per job) --group_reporting --norandommap"
echo "- per server: median IOPS (spread: max-min over the median) / median p99 completion" \
  "latency (clat) in us / server CPU us per I/O (utime+stime over the run)$([[ $PERF_OK == 1 ]] && echo " / server syscalls per I/O (perf stat, in one separate counted run per cell and server; the measured runs are untraced)")"
echo "- last columns: blkq's median IOPS over the best peer's, and blkq's CPU per I/O over" \
  "that peer's (below 1: blkq spends less)"
echo "- \\* : other processes (not the server, not fio) used more than $OTHER_MAX cores during" \
  "a run of that cell, even after retrying"
[[ $TCP_QD16 == 0 ]] && echo "- iodepth 16 over TCP was left out (TCP_QD16=0)"
echo

"$PY" - "$TSV" "$SERVERS" "$OTHER_MAX" "$PERF_OK" <<'EOF'
import statistics, sys
rows, order = {}, []
servers = sys.argv[2].split()
other_max = float(sys.argv[3])
perf = sys.argv[4] == "1"
for line in open(sys.argv[1]):
    (be, label, tr, conns, qd, srv, rnd, iops, p99, ios, busy, fcpu, scpu, other, fioc,
     cpu_io, sys_io, ctx_io) = line.rstrip("\n").split("\t")
    key = (be, label, tr, conns, qd)
    if key not in rows:
        rows[key] = {}
        order.append(key)
    r = rows[key].setdefault(srv, {"iops": [], "p99": [], "cpu": [], "sys": [], "dirty": False})
    if rnd == "count":
        # The traced run: its syscall count only; its IOPS, latency and CPU are taxed by perf.
        if sys_io != "NA":
            r["sys"].append(float(sys_io))
        continue
    for k, v in (("iops", iops), ("p99", p99), ("cpu", cpu_io)):
        if v != "NA":
            r[k].append(float(v))
    r["dirty"] |= float(other) > other_max

def med(v):
    return statistics.median(v) if v else None

def cell(r):
    if r is None or not r["iops"]:
        return "NA"
    m = med(r["iops"])
    spread = (max(r["iops"]) - min(r["iops"])) / m * 100 if m > 0 and len(r["iops"]) > 1 else 0
    s = f"{m:,.0f}" + (f" ±{spread / 2:.0f}%" if len(r["iops"]) > 1 else "")
    s += "*" if r["dirty"] else ""
    s += f" / {med(r['p99']):,.0f}" if r["p99"] else " / NA"
    s += f" / {med(r['cpu']):.1f}" if r["cpu"] else " / NA"
    if perf:
        s += f" / {med(r['sys']):.2f}" if r["sys"] else " / NA"
    return s

backends = []
for key in order:
    if key[0] not in backends:
        backends.append(key[0])
for be in backends:
    present = [s for s in servers if any(s in rows[k] for k in order if k[0] == be)]
    print(f"### backend {be}")
    print()
    unit = "IOPS / p99 us / CPU us per I/O" + (" / syscalls per I/O" if perf else "")
    head = ["workload", "transport", "conns", "iodepth"] + [f"{s} ({unit})" for s in present]
    head += ["blkq / best peer IOPS", "blkq / that peer CPU per I/O"]
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join(["---"] * 4 + ["--:"] * (len(head) - 4)) + "|")
    for key in order:
        if key[0] != be:
            continue
        _, label, tr, conns, qd = key
        r = rows[key]
        cells = [label.replace("_", " "), tr, conns, qd] + [cell(r.get(s)) for s in present]
        peers = [(med(r[s]["iops"]), s) for s in present if not s.startswith("blkq") and s in r and r[s]["iops"]]
        b = r.get("blkq")
        if peers and b and b["iops"]:
            best, who = max(peers)
            cells.append(f"{med(b['iops']) / best:.2f} ({who})" if best > 0 else "NA")
            pc, bc = med(r[who]["cpu"]), med(b["cpu"])
            cells.append(f"{bc / pc:.2f}" if pc and bc is not None else "NA")
        else:
            cells += ["NA", "NA"]
        print("| " + " | ".join(cells) + " |")
    print()
EOF

[[ $STRACE == 1 ]] || exit 0
[[ " $TRANSPORTS " == *" unix "* && " $BACKENDS " == *" mem "* ]] || exit 0

# Syscalls per I/O on one representative workload, under strace as well.
best=$("$PY" - "$TSV" <<'EOF'
import statistics, sys
v = {}
for line in open(sys.argv[1]):
    be, label, tr, conns, qd, srv, rnd, iops, *_ = line.rstrip("\n").split("\t")
    if (be, label, tr, conns, qd) == ("mem", "4k_randread", "unix", "1", "64") and not srv.startswith("blkq") and iops != "NA" and rnd != "count":
        v.setdefault(srv, []).append(float(iops))
print(max(((statistics.median(x), s) for s, x in v.items()), default=(0, ""))[1])
EOF
)

# syscall_summary strace|perf FILE IOS: syscalls per I/O from an `strace -c` summary or from
# `perf stat -x,` tracepoint counts.
syscall_summary() {
  "$PY" - "$1" "$2" "$3" <<'EOF'
import sys
src, ios = sys.argv[1], float(sys.argv[3])
calls, total = {}, 0
for line in open(sys.argv[2]):
    if src == "strace":
        t = line.split()
        if len(t) < 5 or t[0].startswith(("%", "-")):
            continue
        try:
            n = int(t[3])
        except ValueError:
            continue
        if t[-1] == "total":
            total = n
        else:
            calls[t[-1]] = n
    else:
        t = line.strip().split(",")
        if len(t) < 3 or not t[0].isdigit():
            continue
        n, ev = int(t[0]), t[2]
        if ev == "raw_syscalls:sys_enter":
            total = n
        elif ev.startswith("syscalls:sys_enter_"):
            calls[ev[len("syscalls:sys_enter_"):]] = n
top = sorted(calls.items(), key=lambda kv: -kv[1])
parts = [f"{k} {v / ios:.3f}" for k, v in top if v / ios >= 0.01]
print(f"{total / ios:.2f} syscalls per I/O ({' + '.join(parts)}); {total} calls over {ios:.0f} I/Os")
EOF
}

PERF_EVENTS=""
if [[ $PERF_OK == 1 ]]; then
  PERF_EVENTS=raw_syscalls:sys_enter
  for sc in recvfrom recvmsg read readv sendmsg sendto write writev futex poll ppoll epoll_wait \
    epoll_pwait io_uring_enter pread64 preadv2 pwrite64 splice sched_yield; do
    PERF_EVENTS+=",syscalls:sys_enter_$sc"
  done
fi

echo
echo "### Syscalls per I/O: mem, 4k randread, iodepth 64, 1 connection, Unix socket"
echo
echo "strace -c -f slows every syscall: the IOPS of the straced runs are not the table's."
[[ -n $PERF_EVENTS ]] && echo "perf stat counts syscall tracepoints (server and fio in the same run) at a small cost."
echo
for s in blkq $best; do
  [[ -n $s ]] || continue
  start_server "$s" unix mem
  SPID=${SPIDS[$s]} URI=${URIS[$s]}
  prefill "$URI"
  if [[ -n $PERF_EVENTS ]]; then
    perf stat -x, -e "$PERF_EVENTS" -p "$SPID" -o "$OUT/perf-server-$s.txt" 2>"$OUT/perf-server-$s.err" &
    STPID=$!
    PIDS+=("$STPID")
    sleep 0.5
    perf stat -x, -e "$PERF_EVENTS" -o "$OUT/perf-client-$s.txt" \
      fio --name=peer --ioengine=nbd --uri="$URI" --rw=randread --bs=4k --iodepth=64 \
      --numjobs=1 --group_reporting --time_based --runtime="$R" --norandommap --randrepeat=0 \
      --output-format=json --output="$OUT/perf-$s.json" >/dev/null 2>&1 || die "fio under perf failed"
    kill -INT "$STPID"
    wait "$STPID" || true
    read -r iops _ ios _ < <(fio_stats "$OUT/perf-$s.json")
    echo "- $s server, perf: $(syscall_summary perf "$OUT/perf-server-$s.txt" "$ios") (run at $iops IOPS)"
    echo "- fio against $s, perf, same run: $(syscall_summary perf "$OUT/perf-client-$s.txt" "$ios")"
  fi
  strace -c -f -p "$SPID" -o "$OUT/strace-server-$s.txt" 2>"$OUT/strace-server-$s.err" &
  STPID=$!
  PIDS+=("$STPID")
  for _ in $(seq 1 100); do
    grep -q attached "$OUT/strace-server-$s.err" 2>/dev/null && break
    sleep 0.05
  done
  sleep 0.3
  fio_run "$OUT/strace-server-$s.json" randread 4k 64 1 || die "fio under strace failed"
  kill -INT "$STPID"
  wait "$STPID" || true
  read -r iops _ ios _ < <(fio_stats "$OUT/strace-server-$s.json")
  echo "- $s server, strace: $(syscall_summary strace "$OUT/strace-server-$s.txt" "$ios") (run at $iops IOPS under strace)"
  strace -c -f -o "$OUT/strace-client-$s.txt" \
    fio --name=peer --ioengine=nbd --uri="$URI" --rw=randread --bs=4k --iodepth=64 \
    --numjobs=1 --group_reporting --time_based --runtime="$R" --norandommap --randrepeat=0 \
    --output-format=json --output="$OUT/strace-client-$s.json" >/dev/null 2>&1 ||
    die "fio under strace failed"
  read -r iops _ ios _ < <(fio_stats "$OUT/strace-client-$s.json")
  echo "- fio against $s, strace: $(syscall_summary strace "$OUT/strace-client-$s.txt" "$ios") (run at $iops IOPS under strace)"
  stop_server "$s"
  rm -f "$WORK"/*.img
done
echo
echo "Raw results (fio JSON, perf and strace summaries; results.tsv: backend workload transport"
echo "conns iodepth server round IOPS p99_us ios busy_cores fio_job_cores server_cores"
echo "other_cores fio_cores server_us_per_io server_syscalls_per_io server_ctxsw_per_io): $OUT"
