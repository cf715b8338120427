#!/usr/bin/env bash
# Peers, side by side: the same fio nbd-engine load against `blkq serve` and three other NBD
# servers, all memory-backed and of the same size, over a Unix socket and over TCP loopback.
#
#   blkq        blkq serve --device mem:$SIZE
#   nbdkit      nbdkit memory $SIZE allocator=malloc   (one flat allocation; blkq's mem: is a
#               sparse page table, closer to nbdkit's default allocator=sparse, but that one
#               was slower on 4k random reads here, 86k against 130k IOPS, so the faster one
#               is the peer)
#   qemu-nbd    qemu-nbd -f raw --cache=writeback --aio=io_uring -e 16 on a raw image in
#               /dev/shm (qemu has no memory-backed block driver that keeps data: null-co
#               discards writes and reads zeroes, so it would not do the work ours does;
#               qemu-storage-daemon would run the same block layer on the same file;
#               aio=io_uring beat the default aio=threads here)
#   nbd-server  nbd-server (config file, max_threads 4, splice off: both the defaults; splice
#               on was slower here) on a file in /dev/shm
#
# Workloads: 4 KiB randread and randwrite at iodepth 1, 16 and 64 with 1 and 2 connections
# (fio --numjobs=N: one connection per job), 1 MiB sequential read and write at iodepth 16 with
# 1 connection; each R seconds, time-based. Every server instance is prefilled (1 MiB
# sequential writes over the whole device) before its runs, so reads never hit unwritten
# (sparse) space. Prints one markdown table (IOPS and p99 completion latency per server, and
# blkq's IOPS over the best peer's), then syscalls per I/O for blkq and the best peer on 4K
# randread, iodepth 64, 1 connection, Unix socket: strace -c -f on the server for a run, and on
# fio itself in another, and (where perf can read the syscall tracepoints) perf stat on both in
# a third, since strace slows the traced process enough to change its batching. IOPS in the
# table come from runs with no tracing. Where the machine's CPU went during each run (server,
# fio, anything else) is kept in results.tsv; runs disturbed by other work are run again.
#
# Needs (as root: apt-get install -y fio nbdkit qemu-utils nbd-server strace libnbd-bin):
# fio with the nbd engine, nbdkit, qemu-nbd, nbd-server, strace, nbdinfo, /usr/bin/python3.
#
# Environment:
#   R=5           seconds per run (RUNTIME is read too, as in bench/tables.sh)
#   SIZE=1G       backend size (all servers)
#   BLKQ=PATH     blkq binary (default: cargo build --release -p blkq, target/release/blkq)
#   SERVERS="blkq nbdkit qemu-nbd nbd-server"   subset / order (blkq must stay for the ratio)
#   TRANSPORTS="unix tcp"
#   TCP_QD16=1    0 drops iodepth 16 over TCP (to shorten the run)
#   STRACE=1      0 skips the syscall measurement
#   OTHER_MAX=0.25, RETRIES=2, RETRY_SLEEP=10: a run during which other processes (not the
#                 server, not fio) used more than OTHER_MAX cores is run again, up to RETRIES
#                 times, RETRY_SLEEP seconds later, RETRY_BUDGET retries in all; a cell still
#                 disturbed gets a * in the table
#   OUT=DIR       where the raw results (fio JSON, strace/perf summaries, results.tsv) are kept
#                 (default: a new /tmp/blkq-peers.XXXXXX)
set -euo pipefail
cd "$(dirname "$0")/.."

R=${R:-${RUNTIME:-5}}
SIZE=${SIZE:-1G}
SERVERS=${SERVERS:-"blkq nbdkit qemu-nbd nbd-server"}
TRANSPORTS=${TRANSPORTS:-"unix tcp"}
TCP_QD16=${TCP_QD16:-1}
STRACE=${STRACE:-1}
OTHER_MAX=${OTHER_MAX:-0.25}
RETRIES=${RETRIES:-2}
RETRY_SLEEP=${RETRY_SLEEP:-10}
RETRY_BUDGET=${RETRY_BUDGET:-20}
PY=/usr/bin/python3
HZ=$(getconf CLK_TCK)

die() {
  echo "peers.sh: $*" >&2
  exit 1
}

for tool in fio nbdkit qemu-nbd nbd-server strace nbdinfo truncate "$PY"; do
  command -v "$tool" >/dev/null ||
    die "missing $tool (apt-get install -y fio nbdkit qemu-utils nbd-server strace libnbd-bin)"
done
fio --enghelp=nbd >/dev/null 2>&1 || die "this fio has no nbd engine"
[[ -d /dev/shm && -w /dev/shm ]] || die "/dev/shm (tmpfs) is needed for the image files"

if [[ -z ${BLKQ:-} ]]; then
  cargo build --release -p blkq >&2
  BLKQ=$PWD/target/release/blkq
  BLKQ_FROM="commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet HEAD 2>/dev/null || echo ' + local changes')"
else
  BLKQ_FROM="BLKQ=$BLKQ"
fi
[[ -x $BLKQ ]] || die "no blkq binary at $BLKQ"

# Sockets, config files and image files: on tmpfs.
WORK=$(mktemp -d /dev/shm/blkq-peers.XXXXXX)
OUT=${OUT:-$(mktemp -d /tmp/blkq-peers.XXXXXX)}
mkdir -p "$OUT"
TSV=$OUT/results.tsv
: >"$TSV"

# Every process this script starts (servers, daemonized servers, strace), killed on exit.
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

# alive PID: the process exists and is not a zombie (a daemon reparented to a PID 1 that does
# not reap stays a zombie).
alive() {
  [[ -r /proc/$1/stat ]] || return 1
  local state
  state=$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null) || return 1
  [[ $state != Z && $state != X ]]
}

# start_server NAME TRANSPORT: starts NAME serving $SIZE on TRANSPORT (unix|tcp); sets SPID
# (the process serving) and URI; returns once an NBD client completes a handshake.
start_server() {
  local name=$1 tr=$2 port="" sock="$WORK/$1.sock" log="$OUT/$1-$2.log"
  rm -f "$sock"
  [[ $tr == tcp ]] && port=$(free_port)
  case $name in
    blkq)
      if [[ $tr == unix ]]; then
        "$BLKQ" serve --device "mem:$SIZE" --no-tcp --socket "$sock" >"$log" 2>&1 &
      else
        "$BLKQ" serve --device "mem:$SIZE" --no-unix --listen "127.0.0.1:$port" >"$log" 2>&1 &
      fi
      SPID=$!
      EXPORT=""
      ;;
    nbdkit)
      if [[ $tr == unix ]]; then
        nbdkit -f -U "$sock" memory "$SIZE" allocator=malloc >"$log" 2>&1 &
      else
        nbdkit -f -i 127.0.0.1 -p "$port" memory "$SIZE" allocator=malloc >"$log" 2>&1 &
      fi
      SPID=$!
      EXPORT=""
      ;;
    qemu-nbd)
      rm -f "$WORK/qemu.img"
      truncate -s "$SIZE" "$WORK/qemu.img"
      local qargs=(-f raw -t -e 16 --cache=writeback --aio=io_uring)
      if [[ $tr == unix ]]; then
        qemu-nbd "${qargs[@]}" -k "$sock" "$WORK/qemu.img" >"$log" 2>&1 &
      else
        qemu-nbd "${qargs[@]}" -b 127.0.0.1 -p "$port" "$WORK/qemu.img" >"$log" 2>&1 &
      fi
      SPID=$!
      EXPORT=""
      ;;
    nbd-server)
      rm -f "$WORK/nbd-server.img" "$WORK/nbd-server.pid"
      truncate -s "$SIZE" "$WORK/nbd-server.img"
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
        echo "    exportname = $WORK/nbd-server.img"
      } >"$WORK/nbd-server.conf"
      # It daemonizes: the pid that serves is the one in the pid file.
      nbd-server -C "$WORK/nbd-server.conf" -p "$WORK/nbd-server.pid" >"$log" 2>&1 ||
        die "nbd-server did not start: $(cat "$log")"
      for _ in $(seq 1 100); do
        [[ -s $WORK/nbd-server.pid ]] && break
        sleep 0.05
      done
      [[ -s $WORK/nbd-server.pid ]] || die "nbd-server wrote no pid file"
      SPID=$(cat "$WORK/nbd-server.pid")
      EXPORT="disk"
      ;;
    *) die "unknown server $name" ;;
  esac
  PIDS+=("$SPID")
  if [[ $tr == unix ]]; then
    URI="nbd+unix:///$EXPORT?socket=$sock"
  else
    URI="nbd://127.0.0.1:$port/$EXPORT"
  fi
  for _ in $(seq 1 200); do
    if nbdinfo --size "$URI" >/dev/null 2>&1; then
      return 0
    fi
    alive "$SPID" || die "$name ($tr) exited at start: $(tail -n 20 "$log")"
    sleep 0.05
  done
  die "$name ($tr) did not accept connections on $URI in 10 s"
}

stop_server() {
  pkill -TERM -P "$SPID" 2>/dev/null || true
  kill -TERM "$SPID" 2>/dev/null || true
  for _ in $(seq 1 50); do
    alive "$SPID" || break
    sleep 0.1
  done
  if alive "$SPID"; then
    pkill -KILL -P "$SPID" 2>/dev/null || true
    kill -KILL "$SPID" 2>/dev/null || true
  fi
  wait "$SPID" 2>/dev/null || true
  rm -f "$WORK/qemu.img" "$WORK/nbd-server.img"
}

prefill() {
  fio --name=prefill --ioengine=nbd --uri="$URI" --rw=write --bs=1M --iodepth=16 \
    --output="$OUT/prefill.txt" >/dev/null || die "prefill of $URI failed: $(cat "$OUT/prefill.txt")"
}

# "BUSY TASK TOTAL" jiffies of the whole machine (/proc/stat): BUSY is all but idle, iowait
# and steal; TASK is user+nice+system, the part that is charged to processes.
cpu_jiffies() {
  awk '/^cpu /{task=$2+$3+$4; busy=task+$7+$8; print busy, task, busy+$5+$6+$9; exit}' /proc/stat
}

# CPU ticks (utime+stime, and those of reaped children) of the server and of its live child
# processes (nbd-server forks one per connection).
server_ticks() {
  local p
  for p in "$SPID" $(pgrep -P "$SPID" 2>/dev/null); do
    sed 's/.*) //' "/proc/$p/stat" 2>/dev/null || true
  done | awk '{s += $12 + $13 + $14 + $15} END {print s + 0}'
}

# child_ms VAR: sets VAR to the CPU milliseconds of this shell's reaped children (fio and what
# it forks), from `times`, which must run in this shell: in a pipe or $(...) it would run in a
# fresh subshell, which has no children.
child_ms() {
  times >"$WORK/times"
  read -r "$1" < <(awk 'NR == 2 {split($1, u, /[ms]/); split($2, k, /[ms]/)
    printf "%d\n", (u[1] * 60 + u[2] + k[1] * 60 + k[2]) * 1000}' "$WORK/times")
}

# fio_run JSON RW BS QD JOBS [extra args]: one time-based run.
fio_run() {
  local json=$1 rw=$2 bs=$3 qd=$4 jobs=$5
  shift 5
  fio --name=peer --ioengine=nbd --uri="$URI" --rw="$rw" --bs="$bs" --iodepth="$qd" \
    --numjobs="$jobs" --group_reporting --time_based --runtime="$R" --norandommap \
    --randrepeat=0 --output-format=json --output="$json" "$@" >/dev/null 2>"$json.err"
}

# measure JSON RW BS QD JOBS: one run (fio_run), and where the machine's CPU went during it;
# sets BUSY (all cores busy), SRV (the server), FIOC (fio, all its processes) and OTHER (the
# rest of what processes used: anything else running on the machine), in cores.
measure() {
  local b0 k0 t0 b1 k1 t1 s0 s1 f0 f1
  read -r b0 k0 t0 < <(cpu_jiffies)
  s0=$(server_ticks)
  child_ms f0
  fio_run "$@" || return 1
  child_ms f1
  sleep 0.05 # nbd-server reaps its connection's process
  s1=$(server_ticks)
  read -r b1 k1 t1 < <(cpu_jiffies)
  read -r BUSY SRV FIOC OTHER < <(awk -v b=$((b1 - b0)) -v k=$((k1 - k0)) -v t=$((t1 - t0)) \
    -v s=$((s1 - s0)) -v f=$((f1 - f0)) -v n="$(nproc)" -v hz="$HZ" 'BEGIN {
      w = t / n; if (w <= 0) w = 1
      f = f * hz / 1000
      o = k / w - s / w - f / w; if (o < 0) o = 0
      printf "%.2f %.2f %.2f %.2f\n", b / w, s / w, f / w, o }')
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

WORKLOADS=() # "label rw bs qd conns"
for rw in randread randwrite; do
  for conns in 1 2; do
    for qd in 1 16 64; do
      WORKLOADS+=("4k_$rw $rw 4k $qd $conns")
    done
  done
done
WORKLOADS+=("1M_read read 1M 16 1" "1M_write write 1M 16 1")

nruns=0
for tr in $TRANSPORTS; do
  for w in "${WORKLOADS[@]}"; do
    read -r _ _ _ qd _ <<<"$w"
    [[ $tr == tcp && $TCP_QD16 == 0 && $qd == 16 ]] && continue
    nruns=$((nruns + 1))
  done
done
nservers=$(wc -w <<<"$SERVERS")
echo "peers.sh: $((nruns * nservers)) runs of ${R}s (about $((nruns * nservers * (R + 1) / 60 + 1)) min); raw results in $OUT" >&2

for tr in $TRANSPORTS; do
  for s in $SERVERS; do
    start_server "$s" "$tr"
    prefill
    for w in "${WORKLOADS[@]}"; do
      read -r label rw bs qd conns <<<"$w"
      [[ $tr == tcp && $TCP_QD16 == 0 && $qd == 16 ]] && continue
      json="$OUT/$s-$tr-$label-c$conns-qd$qd.json"
      # A run during which something else took more than OTHER_MAX cores (a build, say) is
      # run again, up to RETRIES times; a cell still disturbed is starred in the table.
      try=0
      while :; do
        if measure "$json" "$rw" "$bs" "$qd" "$conns"; then
          read -r iops p99 ios fcpu < <(fio_stats "$json")
        else
          echo "peers.sh: fio failed against $s ($tr, $label c$conns qd$qd): $(tail -n 3 "$json.err")" >&2
          iops=NA p99=NA ios=NA fcpu=NA BUSY=NA SRV=NA FIOC=NA OTHER=0
        fi
        printf '  %-10s %-4s %-13s c%s qd%-2s %8s IOPS  p99 %8s us  cores: busy %s, server %s, fio %s (%s/job), other %s\n' \
          "$s" "$tr" "$label" "$conns" "$qd" "$iops" "$p99" "$BUSY" "$SRV" "$FIOC" "$fcpu" "$OTHER" >&2
        awk -v o="$OTHER" -v m="$OTHER_MAX" 'BEGIN {exit !(o > m)}' || break
        try=$((try + 1))
        [[ $try -le $RETRIES && $RETRY_BUDGET -gt 0 ]] || break
        RETRY_BUDGET=$((RETRY_BUDGET - 1))
        echo "  (something else used $OTHER cores: again in ${RETRY_SLEEP}s)" >&2
        sleep "$RETRY_SLEEP"
      done
      printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$label" "$tr" "$conns" \
        "$qd" "$s" "$iops" "$p99" "$ios" "$BUSY" "$fcpu" "$SRV" "$OTHER" "$FIOC" >>"$TSV"
    done
    stop_server
  done
done

echo
echo "## blkq serve and its peers, side by side"
echo
echo "- date: $(date -u '+%Y-%m-%d %H:%M:%S UTC'); nproc: $(nproc); kernel $(uname -r);" \
  "CPU: $(awk -F': ' '/^model name/{print $2; exit}' /proc/cpuinfo)"
echo "- fio and the server share the same $(nproc) vCPU(s), unpinned: with 2 connections fio" \
  "runs 2 job processes, which compete with the server's threads for the cores."
echo "- $(fio --version); $("$BLKQ" --version) ($BLKQ_FROM);" \
  "$(nbdkit --version | head -n 1); $(qemu-nbd --version | head -n 1);" \
  "nbd-server $(nbd-server -V 2>&1 | awk '/version/{print $NF; exit}')"
echo "- backend: $SIZE, memory-backed: blkq mem:$SIZE; nbdkit memory allocator=malloc;" \
  "qemu-nbd raw image in /dev/shm (--aio=io_uring --cache=writeback); nbd-server file in /dev/shm;" \
  "each prefilled before its runs"
echo "- each cell: one time-based run of ${R}s; fio --ioengine=nbd --numjobs=conns" \
  "--group_reporting --norandommap; IOPS, and p99 completion latency (clat) in us"
echo "- \\* : other processes (not the server, not fio) used more than $OTHER_MAX cores during" \
  "that run, even after retrying (up to $RETRIES times)"
[[ $TCP_QD16 == 0 ]] && echo "- iodepth 16 over TCP was left out (TCP_QD16=0)"
echo

"$PY" - "$TSV" "$SERVERS" "$OTHER_MAX" <<'EOF'
import sys
rows, order = {}, []
servers = sys.argv[2].split()
for line in open(sys.argv[1]):
    label, tr, conns, qd, srv, iops, p99, ios, busy, fcpu, scpu, other, fioc = line.rstrip("\n").split("\t")
    key = (label, tr, conns, qd)
    if key not in rows:
        rows[key] = {}
        order.append(key)
    rows[key][srv] = (iops, p99, float(other) > float(sys.argv[3]))

def fmt_iops(v):
    return v if v == "NA" else f"{float(v):,.0f}"

def fmt_p99(v):
    return v if v == "NA" else f"{float(v):,.0f}"

head = ["workload", "transport", "conns", "iodepth"]
for s in servers:
    head += [f"{s} IOPS", f"{s} p99 us"]
head.append("blkq / best peer")
print("| " + " | ".join(head) + " |")
print("|" + "|".join(["---"] * 4 + ["--:"] * (len(head) - 4)) + "|")
for key in order:
    label, tr, conns, qd = key
    r = rows[key]
    cells = [label.replace("_", " "), tr, conns, qd]
    for s in servers:
        iops, p99, dirty = r.get(s, ("NA", "NA", False))
        cells += [fmt_iops(iops) + ("*" if dirty else ""), fmt_p99(p99)]
    peers = [(float(r[s][0]), s) for s in servers if s != "blkq" and s in r and r[s][0] != "NA"]
    if peers and "blkq" in r and r["blkq"][0] != "NA":
        best, who = max(peers)
        cells.append(f"{float(r['blkq'][0]) / best:.2f} ({who})" if best > 0 else "NA")
    else:
        cells.append("NA")
    print("| " + " | ".join(cells) + " |")
EOF

[[ $STRACE == 1 ]] || exit 0
[[ " $TRANSPORTS " == *" unix "* ]] || exit 0

# Syscalls per I/O on one representative workload.
best=$("$PY" - "$TSV" <<'EOF'
import sys
best = (-1.0, "")
for line in open(sys.argv[1]):
    label, tr, conns, qd, srv, iops, *_ = line.rstrip("\n").split("\t")
    if (label, tr, conns, qd) == ("4k_randread", "unix", "1", "64") and srv != "blkq" and iops != "NA":
        best = max(best, (float(iops), srv))
print(best[1])
EOF
)

# strace_summary FILE IOS: syscalls per I/O from an `strace -c` summary.
strace_summary() {
  "$PY" - "$1" "$2" <<'EOF'
import sys
ios = float(sys.argv[2])
calls, total = {}, 0
for line in open(sys.argv[1]):
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
top = sorted(calls.items(), key=lambda kv: -kv[1])
parts = [f"{k} {v / ios:.3f}" for k, v in top if v / ios >= 0.01]
print(f"{total / ios:.2f} syscalls per I/O ({' + '.join(parts)}); {total} calls over {ios:.0f} I/Os")
EOF
}

# perf_summary FILE IOS: syscalls per I/O from `perf stat -x,` tracepoint counts.
perf_summary() {
  "$PY" - "$1" "$2" <<'EOF'
import sys
ios = float(sys.argv[2])
calls, total = {}, 0
for line in open(sys.argv[1]):
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

# perf stat on tracepoints costs far less than strace (which stops the tracee at every
# syscall, so a traced server runs slower, gets bigger batches per recv and looks better per
# I/O than it is): used as well when perf can read the syscall tracepoints.
PERF_EVENTS=""
if command -v perf >/dev/null && perf stat -e raw_syscalls:sys_enter -o /dev/null true 2>/dev/null; then
  PERF_EVENTS=raw_syscalls:sys_enter
  for sc in recvfrom recvmsg read readv sendmsg sendto write writev futex poll ppoll epoll_wait \
    epoll_pwait io_uring_enter pread64 pwrite64 splice sched_yield; do
    PERF_EVENTS+=",syscalls:sys_enter_$sc"
  done
fi

echo
echo "### Syscalls per I/O: 4k randread, iodepth 64, 1 connection, Unix socket"
echo
echo "strace -c -f slows every syscall: the IOPS of the straced runs are not the table's."
[[ -n $PERF_EVENTS ]] && echo "perf stat counts syscall tracepoints (server and fio in the same run) at a small cost."
echo
for s in blkq $best; do
  [[ -n $s ]] || continue
  start_server "$s" unix
  prefill
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
    echo "- $s server, perf: $(perf_summary "$OUT/perf-server-$s.txt" "$ios") (run at $iops IOPS)"
    echo "- fio against $s, perf, same run: $(perf_summary "$OUT/perf-client-$s.txt" "$ios")"
  fi
  # Server side: strace attached to the server (all its threads, and with -f the threads and
  # processes it starts for the connection) for the whole fio run.
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
  echo "- $s server, strace: $(strace_summary "$OUT/strace-server-$s.txt" "$ios") (run at $iops IOPS under strace)"
  # Client side: fio itself under strace (server not traced).
  strace -c -f -o "$OUT/strace-client-$s.txt" \
    fio --name=peer --ioengine=nbd --uri="$URI" --rw=randread --bs=4k --iodepth=64 \
    --numjobs=1 --group_reporting --time_based --runtime="$R" --norandommap --randrepeat=0 \
    --output-format=json --output="$OUT/strace-client-$s.json" >/dev/null 2>&1 ||
    die "fio under strace failed"
  read -r iops _ ios _ < <(fio_stats "$OUT/strace-client-$s.json")
  echo "- fio against $s, strace: $(strace_summary "$OUT/strace-client-$s.txt" "$ios") (run at $iops IOPS under strace)"
  awk -F'\t' -v s="$s" -v n="$(nproc)" '$1 == "4k_randread" && $2 == "unix" && $3 == 1 && $4 == 64 && $5 == s {
    printf "- %s, the table'"'"'s run (no tracing): %s IOPS; busy %s of %s cores: server %s, fio %s (its job process %s)\n", s, $6, $9, n, $11, $13, $10 }' "$TSV"
  stop_server
done
echo
echo "Raw results (fio JSON, strace and perf summaries; results.tsv: workload transport conns"
echo "iodepth server IOPS p99_us ios busy_cores fio_job_cores server_cores other_cores fio_cores): $OUT"
