#!/bin/sh
# What per-block checksums cost a mirror (docs/bench.md "RAID1 integrity"): 4 KiB random
# writes and reads through `blkq bench --raid1 mem:..,mem:..` with and without
# `integrity=crc32c`, interleaved in each round so both see the same box; then a check pass
# with and without (crates/raid1/examples/check_speed.rs).
#   bench/raid1_integrity.sh [BLKQ]   (ROUNDS=5 SECS=2 JOBS="1 2" SIZE=1G LEGS=mem|file)
# LEGS=file: two sparse files of SIZE in $DIR (default /dev/shm: the page cache's cost of a
# read, without a disk's), as a mirror of files on a host runs.
set -eu
BLKQ=${1:-target/release/blkq}
ROUNDS=${ROUNDS:-5}
SECS=${SECS:-2}
JOBS=${JOBS:-"1 2"}
SIZE=${SIZE:-1G}
LEGS=${LEGS:-mem}
DIR=${DIR:-/dev/shm}
if [ "$LEGS" = file ]; then
    truncate -s "$SIZE" "$DIR/blkq-integ-a.img" "$DIR/blkq-integ-b.img"
    trap 'rm -f "$DIR/blkq-integ-a.img" "$DIR/blkq-integ-b.img"' EXIT
    SPEC="file:$DIR/blkq-integ-a.img,file:$DIR/blkq-integ-b.img"
else
    SPEC="mem:$SIZE,mem:$SIZE"
fi
iops() {
    # $1: rw, $2: jobs, $3..: extra options
    rw=$1 jobs=$2
    shift 2
    "$BLKQ" bench --raid1 "$SPEC" "$@" --rw "$rw" --bs 4K --iodepth 32 \
        --jobs "$jobs" --runtime "$SECS" --json 2>/dev/null |
        grep -o '"iops":[0-9.]*' | head -1 | cut -d: -f2 | cut -d. -f1
}
echo "legs $SPEC; commit $(git rev-parse --short HEAD 2>/dev/null || echo ?), $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) vCPUs, load $(cut -d' ' -f1-3 /proc/loadavg)"
echo "rw jobs round plain integrity ratio"
for rw in randwrite randread; do
    for j in $JOBS; do
        r=1
        while [ "$r" -le "$ROUNDS" ]; do
            p=$(iops "$rw" "$j")
            i=$(iops "$rw" "$j" --raid1-option integrity=crc32c)
            echo "$rw $j $r $p $i $(awk -v a="$p" -v b="$i" 'BEGIN { printf "%.2f", b / a }')"
            r=$((r + 1))
        done
    done
done
if [ -z "${NO_CHECK:-}" ]; then
    for k in 1 2 3; do
        cargo run --release -q -p raid1 --example check_speed -- 256 check
        cargo run --release -q -p raid1 --example check_speed -- 256 check crc32c
    done
fi
