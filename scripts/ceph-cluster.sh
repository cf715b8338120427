#!/usr/bin/env bash
# A single-node Ceph cluster for blkq's rbd tests and benchmarks: one monitor, one manager and
# one OSD (bluestore on a sparse file), no cephx, everything on 127.0.0.1, all state in DIR.
#
#   scripts/ceph-cluster.sh start DIR [--owner PID]
#       Installs the Ceph packages when missing (root with apt-get only), creates the cluster
#       in DIR (absent: created mode 0700; present: it must be empty, a directory of this user
#       that nobody else can write, else refused before anything is done), starts the daemons (in the foreground of
#       background processes, PIDs in DIR/pids), waits until the OSD is up, the manager is
#       available and the health is HEALTH_OK, then creates the pool `rbd` (`rbd pool init`).
#       Prints `CEPH_CONF=DIR/ceph.conf` on its last line of stdout, and writes the same to
#       DIR/env. With --owner PID, a watcher stops the cluster once PID has exited (what the
#       tests use, so that no daemon outlives a test binary however it ends), and then removes
#       DIR (kept with BLKQ_KEEP_CEPH=1, for its logs).
#       Fails (exit 2) with the reason on stderr when the packages are missing and cannot be
#       installed; exit 1 when the cluster does not come up (the daemons' logs are in DIR/log,
#       and the daemons are stopped).
#   scripts/ceph-cluster.sh stop DIR
#       Stops every daemon of DIR by PID (SIGTERM, then SIGKILL after 2 s), whatever state
#       they are in. Leaves DIR (logs) for the caller to remove. Only processes of this user
#       whose command line names DIR (or this script: the watcher) are signalled, and only
#       from pid files of this user in a DIR of this user: nothing planted is obeyed.
#   scripts/ceph-cluster.sh kill-osd DIR / start-osd DIR
#       SIGKILLs the OSD / starts it again (the fault tests).
#   scripts/ceph-cluster.sh install
#       Only installs the packages when missing (exit 2 with the reason when it cannot).
#
# Environment: CEPH_MON_PORT (default: a free port from 3300 up; the monitor speaks msgr2
# only), CEPH_OSD_SIZE (default 4G), CEPH_WAIT_SECS (default 120), BLKQ_NO_INSTALL=1 (install
# nothing: missing packages are an exit 2).
set -euo pipefail

PACKAGES=(ceph-mon ceph-mgr ceph-osd ceph-common librbd-dev)

die() { echo "ceph-cluster: $*" >&2; exit 1; }
log() { echo "ceph-cluster: $*" >&2; }

have_packages() {
  command -v ceph-mon >/dev/null && command -v ceph-mgr >/dev/null &&
    command -v ceph-osd >/dev/null && command -v ceph >/dev/null && command -v rbd >/dev/null &&
    [[ -e /usr/include/rbd/librbd.h ]]
}

install_packages() {
  have_packages && return 0
  if [[ ${BLKQ_NO_INSTALL:-0} == 1 ]]; then
    echo "ceph-cluster: the Ceph packages (${PACKAGES[*]}) are missing and BLKQ_NO_INSTALL=1: not installing them" >&2
    exit 2
  fi
  if [[ $(id -u) != 0 ]]; then
    echo "ceph-cluster: the Ceph packages (${PACKAGES[*]}) are missing and this is not root, so they cannot be installed: install them with apt-get" >&2
    exit 2
  fi
  if ! command -v apt-get >/dev/null; then
    echo "ceph-cluster: the Ceph packages (${PACKAGES[*]}) are missing and there is no apt-get to install them" >&2
    exit 2
  fi
  log "installing ${PACKAGES[*]}"
  export DEBIAN_FRONTEND=noninteractive
  if ! apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}" >/dev/null 2>&1; then
    apt-get update -qq >/dev/null 2>&1 || true
    if ! apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}" >/dev/null; then
      echo "ceph-cluster: apt-get install ${PACKAGES[*]} failed (see its output above)" >&2
      exit 2
    fi
  fi
  have_packages || { echo "ceph-cluster: installed, but ceph-mon/ceph-mgr/ceph-osd/ceph/rbd or /usr/include/rbd/librbd.h still missing" >&2; exit 2; }
}

port_free() { ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

free_port() {
  local p
  for ((p = 3300; p < 3400; p++)); do
    port_free "$p" && { echo "$p"; return; }
  done
  die "no free port in 3300..3399 for the monitor"
}

# Starts a daemon in the foreground of a background process, stdio to its log, PID recorded.
spawn() {
  local name=$1
  shift
  setsid "$@" -f </dev/null >>"$DIR/log/$name.out" 2>&1 &
  echo $! >"$DIR/pids/$name"
}

# DIR must be this user's own: a directory (not a link), owned by this user, that nobody else
# can write. Another user could have made it first at a name they guessed, with pid files and
# a configuration of their own in it.
check_dir() {
  local d=$1 owner mode
  [[ ! -L $d ]] || die "$d is a symbolic link: refused"
  [[ -d $d ]] || die "$d is not a directory"
  owner=$(stat -c %u -- "$d")
  mode=$(stat -c %a -- "$d")
  [[ $owner == "$(id -u)" ]] || die "$d is owned by uid $owner, not by this user ($(id -u)): refused"
  (((8#$mode & 8#022) == 0)) || die "$d is writable by group or others (mode $mode): refused"
}

# The PID a pid file of DIR names, printed only if it is one of this cluster's processes: the
# file is ours, and so is the process, whose command line names DIR (a daemon's `-c
# DIR/ceph.conf`) or this script (the watcher). Anything else (a stale file whose PID was
# reused, a file planted there) is never signalled.
cluster_pid() {
  local f=$1 pid cmdline
  [[ -f $f && ! -L $f && $(stat -c %u -- "$f") == "$(id -u)" ]] || return 1
  pid=$(cat -- "$f" 2>/dev/null) || return 1
  [[ $pid =~ ^[0-9]+$ ]] || return 1
  [[ $(stat -c %u "/proc/$pid" 2>/dev/null) == "$(id -u)" ]] || return 1
  cmdline=$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null) || return 1
  [[ $cmdline == *"$DIR/"* || $cmdline == *ceph-cluster.sh* ]] || return 1
  echo "$pid"
}

stop_one() {
  local f=$1 pid
  pid=$(cluster_pid "$f") || { rm -f "$f"; return 0; }
  rm -f "$f"
  kill -TERM "$pid" 2>/dev/null || return 0
  for _ in $(seq 20); do
    kill -0 "$pid" 2>/dev/null || return 0
    sleep 0.1
  done
  kill -KILL "$pid" 2>/dev/null || true
}

stop_cluster() {
  [[ -d $DIR/pids ]] || return 0
  check_dir "$DIR/pids"
  # The watcher first (it would call stop again), then the OSD, the manager, the monitor:
  # each is stopped on its own, in parallel with the others.
  [[ -f $DIR/pids/watcher ]] && stop_one "$DIR/pids/watcher"
  local f
  for f in "$DIR"/pids/*; do
    [[ -e $f ]] && stop_one "$f" &
  done
  wait
}

ceph_() { timeout 20 ceph -c "$DIR/ceph.conf" --connect-timeout 10 "$@"; }

wait_for() {
  local what=$1 deadline=$2
  shift 2
  until "$@" >/dev/null 2>&1; do
    if ((SECONDS > deadline)); then
      log "timed out waiting for $what; daemons' logs in $DIR/log"
      tail -n 5 "$DIR"/log/*.out >&2 2>/dev/null || true
      ceph_ -s >&2 2>&1 || true
      return 1
    fi
    for f in "$DIR"/pids/{mon.a,mgr.x,osd.0}; do
      [[ -f $f ]] && ! kill -0 "$(cat "$f")" 2>/dev/null && {
        log "$(basename "$f") exited while waiting for $what; its log:"
        tail -n 20 "$DIR/log/$(basename "$f").out" "$DIR/log/$(basename "$f").log" >&2 2>/dev/null || true
        return 1
      }
    done
    sleep 0.2
  done
}

osd_up() { [[ $(ceph_ osd stat -f json 2>/dev/null) =~ \"num_up_osds\":1 ]]; }
mgr_available() { [[ $(ceph_ mgr stat 2>/dev/null) =~ \"available\":\ *true ]]; }
health_ok() { [[ $(ceph_ health 2>/dev/null) == HEALTH_OK* ]]; }

start_osd() {
  spawn osd.0 ceph-osd -c "$DIR/ceph.conf" -i 0
}

start_cluster() {
  # A private directory (mode 0700, created here or already this user's), checked before
  # anything is installed or written.
  if [[ ! -e $DIR && ! -L $DIR ]]; then
    mkdir -p -- "$(dirname -- "$DIR")"
    mkdir -m 700 -- "$DIR" || die "cannot create $DIR"
  fi
  check_dir "$DIR"
  if [[ -n $(ls -A "$DIR" 2>/dev/null) ]]; then
    die "$DIR is not empty"
  fi
  install_packages
  mkdir -p "$DIR"/{log,run,pids,mon.a,mgr.x,osd.0}
  DIR=$(cd "$DIR" && pwd)
  # Whatever fails from here on, nothing is left running.
  trap 'rc=$?; if ((rc != 0)); then stop_cluster; fi' EXIT
  local port fsid osd_uuid
  port=${CEPH_MON_PORT:-$(free_port)}
  fsid=$(cat /proc/sys/kernel/random/uuid)
  cat >"$DIR/ceph.conf" <<EOF
[global]
fsid = $fsid
mon host = [v2:127.0.0.1:$port]
mon initial members = a
public network = 127.0.0.0/8
ms bind msgr1 = false
auth cluster required = none
auth service required = none
auth client required = none
log file = $DIR/log/\$name.log
run dir = $DIR/run
admin socket = $DIR/run/\$name.asok
osd pool default size = 1
osd pool default min size = 1
osd pool default pg autoscale mode = off
osd crush chooseleaf type = 0
mon allow pool size one = true
mon allow pool delete = true
mon warn on pool no redundancy = false
mon data avail warn = 2
mon data avail crit = 1
mon warn on insecure global id reclaim allowed = false
rbd default features = 61
rbd cache = false
[mon]
mon data = $DIR/mon.\$id
mon cluster log file = $DIR/log/cluster.log
[mgr]
mgr data = $DIR/mgr.\$id
mgr initial modules = iostat
[osd]
osd data = $DIR/osd.\$id
osd objectstore = bluestore
bluestore block create = true
bluestore block size = ${CEPH_OSD_SIZE_BYTES}
bluestore fsck on mount = false
osd memory target = 1073741824
osd heartbeat grace = 20
osd op num shards = 2
osd op num threads per shard = 1
EOF
  # rbd default features 61 = layering, exclusive-lock, object-map, fast-diff, deep-flatten.
  ceph-authtool --create-keyring "$DIR/mon.keyring" --gen-key -n mon. --cap mon 'allow *' >/dev/null
  monmaptool --create --fsid "$fsid" --addv a "[v2:127.0.0.1:$port]" "$DIR/monmap" >/dev/null
  ceph-mon -c "$DIR/ceph.conf" --mkfs -i a --monmap "$DIR/monmap" --keyring "$DIR/mon.keyring" \
    >>"$DIR/log/mkfs.out" 2>&1 || { tail "$DIR/log/mkfs.out" >&2; die "ceph-mon --mkfs failed"; }
  spawn mon.a ceph-mon -c "$DIR/ceph.conf" -i a
  spawn mgr.x ceph-mgr -c "$DIR/ceph.conf" -i x
  local deadline=$((SECONDS + ${CEPH_WAIT_SECS:-120}))
  osd_uuid=$(cat /proc/sys/kernel/random/uuid)
  wait_for "the monitor" "$deadline" ceph_ mon stat
  local id
  id=$(ceph_ osd new "$osd_uuid") || die "ceph osd new failed"
  [[ $id == 0 ]] || die "ceph osd new gave id $id, not 0"
  ceph-osd -c "$DIR/ceph.conf" -i 0 --mkfs --osd-uuid "$osd_uuid" >>"$DIR/log/mkfs.out" 2>&1 ||
    { tail "$DIR/log/mkfs.out" >&2; die "ceph-osd --mkfs failed"; }
  start_osd
  wait_for "the OSD to be up" "$deadline" osd_up
  ceph_ osd pool create rbd 8 8 >/dev/null 2>&1 || die "ceph osd pool create rbd failed"
  ceph_ osd pool set rbd size 1 --yes-i-really-mean-it >/dev/null 2>&1 || true
  timeout 60 rbd -c "$DIR/ceph.conf" pool init rbd
  wait_for "the manager to be available" "$deadline" mgr_available
  wait_for "HEALTH_OK" "$deadline" health_ok
  echo "CEPH_CONF=$DIR/ceph.conf" >"$DIR/env"
  if [[ -n ${OWNER:-} ]]; then
    # Stops the cluster once the owner has exited. Its own stdio closed, so that a caller
    # reading this script's output sees it end.
    (
      trap - EXIT
      while kill -0 "$OWNER" 2>/dev/null; do sleep 1; done
      rm -f "$DIR/pids/watcher"
      stop_cluster
      [[ ${BLKQ_KEEP_CEPH:-0} == 1 ]] || rm -rf "$DIR"
    ) </dev/null >/dev/null 2>&1 &
    echo $! >"$DIR/pids/watcher"
  fi
  trap - EXIT
  echo "CEPH_CONF=$DIR/ceph.conf"
}

cmd=${1:-}
DIR=${2:-}
[[ -n $cmd && ( -n $DIR || $cmd == install ) ]] || { sed -n '2,30p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 64; }
OWNER=
if [[ ${3:-} == --owner ]]; then
  OWNER=${4:?--owner needs a PID}
fi
size=${CEPH_OSD_SIZE:-4G}
case $size in
  *G) CEPH_OSD_SIZE_BYTES=$((${size%G} << 30)) ;;
  *M) CEPH_OSD_SIZE_BYTES=$((${size%M} << 20)) ;;
  *) CEPH_OSD_SIZE_BYTES=$size ;;
esac

case $cmd in
  start) start_cluster ;;
  stop)
    [[ -e $DIR || -L $DIR ]] || exit 0
    check_dir "$DIR"
    DIR=$(cd "$DIR" && pwd)
    stop_cluster
    ;;
  kill-osd)
    check_dir "$DIR"
    DIR=$(cd "$DIR" && pwd)
    pid=$(cluster_pid "$DIR/pids/osd.0") || die "no OSD of this cluster running in $DIR"
    kill -KILL "$pid"
    # Gone (or a zombie) before the OSD is started again on the same store.
    for _ in $(seq 100); do
      state=$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null) || break
      [[ $state == Z ]] && break
      sleep 0.05
    done
    ;;
  start-osd)
    check_dir "$DIR"
    DIR=$(cd "$DIR" && pwd)
    start_osd
    ;;
  install) install_packages ;;
  *) die "unknown command $cmd (start, stop, kill-osd, start-osd, install)" ;;
esac
