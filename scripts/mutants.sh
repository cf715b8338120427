#!/usr/bin/env bash
# Measures the mirror's simulator: puts known bugs (scripts/mutants/*.patch, against
# crates/raid1/src) back into a copy of the tree one at a time, runs the simulator's seeds
# against each and prints how many seeds caught it ("caught K/N"). See docs/testing.md,
# "The simulators".
#
#   scripts/mutants.sh [NAME...]        every mutation, or those named (file names sans .patch)
#   SIM_SEEDS=300 SIM_SEED_BASE=1       seeds per mutation and the first seed (defaults)
#   MUTANTS_BASELINE=1                  also run the unmodified copy first (expect caught 0/N)
#   MUTANTS_TIMEOUT=1800                seconds per mutation before it counts as hung
#   MUTANTS_MIN=K                       exit 1 if a mutation is caught by fewer than K seeds
#   MUTANTS_FIRST=1                     stop each mutation at its first failing seed and print
#                                       "first at seed S (K of N)": is it caught within N seeds,
#                                       at a fraction of the cost (MUTANTS_MIN does not apply)
#   MUTANTS_TEST="nbd sim_remote"       the simulator to run: package and test target
#                                       (default "raid1 sim"; sim_remote for the r1-/r3- ones)
#
# The copy is the working tree's tracked and untracked (not ignored) files, under
# target/mutants/src; the working tree itself is never patched. Builds are release builds in
# target/mutants/target (started from a copy of target/release when there is one, so the
# dependencies are not built again), apart from the working tree's own builds.
set -euo pipefail

root=$(git rev-parse --show-toplevel)
seeds=${SIM_SEEDS:-300}
base=${SIM_SEED_BASE:-1}
limit=${MUTANTS_TIMEOUT:-1800}
min=${MUTANTS_MIN:-0}
read -r pkg test <<<"${MUTANTS_TEST:-raid1 sim}"
work=$root/target/mutants
src=$work/src
export CARGO_TARGET_DIR=$work/target
if [ ! -d "$CARGO_TARGET_DIR/release" ] && [ -d "$root/target/release" ]; then
    mkdir -p "$CARGO_TARGET_DIR"
    cp -a "$root/target/release" "$CARGO_TARGET_DIR/release"
fi

names=("$@")
if [ ${#names[@]} -eq 0 ]; then
    for p in "$root"/scripts/mutants/*.patch; do
        names+=("$(basename "$p" .patch)")
    done
fi
if [ "${MUTANTS_BASELINE:-0}" = 1 ]; then
    names=(none "${names[@]}")
fi

mkdir -p "$work"
# One run at a time: runs share the copy.
exec 9>"$work/lock"
if ! flock -n 9; then
    echo "mutants: another run holds $work/lock" >&2
    exit 2
fi
rm -rf "$src"
mkdir -p "$src"
(cd "$root" && git ls-files -z -co --exclude-standard | tar --null -T - -cf -) | tar -xf - -C "$src"

# Fresh mtimes on the mirror's sources, so cargo rebuilds it after every patch and unpatch.
touch_raid1() { find "$src/crates/raid1/src" "$src/crates/nbd/src" -name '*.rs' -exec touch {} +; }

echo "mutants: $pkg $test, $seeds seeds from $base per mutation, commit $(git -C "$root" rev-parse --short HEAD), $(date -u +%F)"
low=0
for name in "${names[@]}"; do
    patch=$root/scripts/mutants/$name.patch
    what=$(if [ "$name" = none ]; then echo "the unmodified mirror"; else head -1 "$patch"; fi)
    if [ "$name" != none ]; then
        if ! (cd "$src" && patch -p1 -s --dry-run <"$patch" >/dev/null); then
            printf '%-28s does not apply (%s)\n' "$name" "$what"
            low=1
            continue
        fi
        (cd "$src" && patch -p1 -s <"$patch")
    fi
    touch_raid1
    t0=$(date +%s)
    set +e
    keep=1
    if [ "${MUTANTS_FIRST:-0}" = 1 ]; then keep=0; fi
    out=$(cd "$src" && SIM_SEEDS=$seeds SIM_SEED_BASE=$base SIM_KEEP_GOING=$keep \
        timeout "$limit" cargo test --release -q -p "$pkg" --test "$test" -- --nocapture 2>&1)
    rc=$?
    set -e
    secs=$(( $(date +%s) - t0 ))
    if [ "$name" != none ]; then
        (cd "$src" && patch -p1 -s -R <"$patch")
    fi
    caught=$(grep -o 'caught [0-9]*/[0-9]*' <<<"$out" | tail -1 || true)
    if [ $keep = 0 ]; then
        first=$(grep -o 'seed [0-9]* FAILED' <<<"$out" | head -1 | grep -o '[0-9]*' || true)
        if [ -n "$first" ]; then
            caught="first at seed $first ($((first - base + 1)) of $seeds)"
            # What it failed on: the line after the seed's FAILED line (sim_remote), or the
            # panic's message printed before it (the mirror's sim: the line after the
            # schedule header would say nothing).
            why=$(grep -A1 "seed $first FAILED" <<<"$out" | sed -n 2p | cut -c1-160 || true)
            if [ -z "$why" ] || [[ $why == schedule* ]]; then
                why=$(grep -B40 "seed $first FAILED" <<<"$out" | grep -A1 'panicked at' \
                    | grep -v 'panicked at' | tail -1 | cut -c1-160 || true)
            fi
        elif [ $rc -eq 0 ]; then
            caught="caught 0/$seeds"
        fi
    fi
    if [ -z "$caught" ]; then
        if [ $rc -eq 124 ]; then
            caught="hung (no result in ${limit} s)"
        elif grep -q '^error' <<<"$out"; then
            caught="does not build"
            grep '^error' -A5 <<<"$out" | head -20 >&2
        else
            caught="no result (exit $rc)"
        fi
        low=1
    elif [ $keep = 1 ]; then
        k=${caught#caught }
        k=${k%/*}
        if [ "$name" != none ] && [ "$k" -lt "$min" ]; then
            low=1
        fi
    fi
    printf '%-28s %-24s %5d s  %s\n' "$name" "$caught" "$secs" "$what"
    if [ -n "${why:-}" ]; then
        printf '%-28s   failed on: %s\n' "" "$why"
    fi
    why=
done
touch_raid1
exit $low
