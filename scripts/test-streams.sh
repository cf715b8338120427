#!/usr/bin/env bash
# Runs the workspace's test binaries, already built by `cargo test --workspace --no-run
# --message-format=json` into ARTIFACTS, in two streams at once, since most suites wait rather
# than compute: the `blkq` binary's suites with blk-drivers' (each of the two starts a Ceph
# cluster, so they run one after the other), and every other crate's. Each binary runs as
# `cargo test` runs it (from its package's directory); a failure does not stop the others.
# Running the built binaries rather than two `cargo test -p ...` keeps the one build: cargo
# resolves features per selection, so a `-p` subset would build the dependencies again.
#
#   scripts/test-streams.sh ARTIFACTS LOGDIR
#
# Prints the second stream as it runs, then the first's log; exits 1 when any binary failed.
set -uo pipefail
ARTIFACTS=${1:?usage: scripts/test-streams.sh ARTIFACTS LOGDIR}
LOGDIR=${2:?usage: scripts/test-streams.sh ARTIFACTS LOGDIR}
mkdir -p "$LOGDIR"

# "MANIFEST_DIR EXECUTABLE" for every test artifact: cargo's JSON messages, one object per line,
# manifest_path before executable; a test harness's profile ends `"test":true}` before
# "features" (the `blkq` binary the integration tests spawn is built with `"test":false`).
binaries() {
  grep '"reason":"compiler-artifact"' "$ARTIFACTS" | grep -F ',"test":true},"features"' |
    grep -v '"executable":null' |
    sed -nE 's/.*"manifest_path":"([^"]*)\/Cargo\.toml".*"executable":"([^"]*)".*/\1 \2/p'
}

# Runs each "DIR EXE" line of standard input; prints the failures' names at the end.
stream() {
  local dir exe failed=()
  while read -r dir exe; do
    printf '     Running %s\n' "${exe#"$PWD"/}"
    (cd "$dir" && "$exe") || failed+=("${exe##*/}")
  done
  if [ "${#failed[@]}" -ne 0 ]; then
    printf 'failed: %s\n' "${failed[@]}"
    return 1
  fi
}

servers='/crates/(blkq|blk-drivers) '
all=$(binaries)
if [ -z "$all" ]; then
  echo "test-streams: no test binaries in $ARTIFACTS" >&2
  exit 1
fi
grep -E "$servers" <<<"$all" | stream >"$LOGDIR/tests-blkq.log" 2>&1 &
first=$!
trap 'kill "$first" 2>/dev/null || true' EXIT
ok=0
grep -vE "$servers" <<<"$all" | stream || ok=1
wait "$first" || ok=1
cat "$LOGDIR/tests-blkq.log"
exit "$ok"
