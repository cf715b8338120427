#!/usr/bin/env bash
# The whole test suite of blkq, as CI runs it (.ci/run calls exactly this).
# Installs what the tests need when missing (system packages, as root with apt-get: see
# scripts/test-deps.sh; BLKQ_NO_INSTALL=1 installs nothing and the tests that need them skip),
# then: fmt, clippy, unit + property + integration tests, real
# NBD clients (qemu-img, qemu-io, nbdinfo, nbdcopy, nbdsh, fio) against `blkq serve`, and the
# loom models (their own profile, `loom`) with bounded preemptions.
set -euo pipefail
cd "$(dirname "$0")/.."

# Each step says when it starts, in seconds since the run began (docs/testing.md: what each
# part costs).
step() { printf '\n==> [%ds] %s\n' "$SECONDS" "$*"; }

step "toolchain components"
rustup component add rustfmt clippy >/dev/null 2>&1 || true

step "test dependencies (scripts/test-deps.sh; BLKQ_NO_INSTALL=1 installs nothing)"
# The NBD clients and the Ceph packages, installed when missing where we can (root with
# apt-get): what CI needs. Once the Ceph packages are here, a test that cannot start the
# cluster fails rather than skipping (BLKQ_REQUIRE_CEPH=1).
if scripts/test-deps.sh; then
  export BLKQ_REQUIRE_CEPH=1
else
  echo "the rbd tests will skip: the Ceph packages are missing and were not installed" >&2
fi

step "cargo fmt --check"
cargo fmt --all -- --check

step "cargo clippy"
cargo clippy --workspace --all-targets -- -D warnings

step "unit, property and integration tests"
mkdir -p target
cargo test --workspace --no-run --message-format=json-render-diagnostics >target/test-artifacts.json
# The loom models build meanwhile, niced, in a separate target dir (the cfg changes every
# crate's build, and would otherwise evict the normal build from the cache), with their own
# profile (Cargo.toml: optimized, no LTO): the tests below mostly wait (timeouts, servers,
# simulators), and the build uses what they leave of the CPUs.
LOOM_ENV=(env RUSTFLAGS="--cfg blkq_loom" CARGO_TARGET_DIR=target/loom nice -n 10)
"${LOOM_ENV[@]}" cargo test --profile loom --workspace --test 'loom_*' --no-run \
  >target/loom-build.log 2>&1 &
LOOM_BUILD=$!
BACKGROUND=("$LOOM_BUILD")
trap 'kill "${BACKGROUND[@]}" 2>/dev/null || true' EXIT
# The test binaries in two streams at once (scripts/test-streams.sh), then the doc tests.
TESTS_OK=0
scripts/test-streams.sh target/test-artifacts.json target || TESTS_OK=$?
cargo test --workspace --doc || TESTS_OK=$?
if [ "$TESTS_OK" -ne 0 ]; then
  echo "the unit, property or integration tests failed (above)" >&2
  exit 1
fi

step "real NBD clients against blkq serve (scripts/client-tests.sh), the loom models beside them"
# The loom models (built by now) run niced beside the clients, which mostly wait on servers;
# their output follows once both are done.
if ! wait "$LOOM_BUILD"; then
  cat target/loom-build.log
  exit 1
fi
LOOM_MAX_PREEMPTIONS="${LOOM_MAX_PREEMPTIONS:-2}" \
  "${LOOM_ENV[@]}" cargo test --profile loom --workspace --test 'loom_*' >target/loom-run.log 2>&1 &
LOOM_RUN=$!
BACKGROUND+=("$LOOM_RUN")
# Against the debug binary the tests above built and used (`cargo build -p blkq` would build
# it again: cargo resolves features per selection); a release build (LTO, one codegen unit)
# would cost CI minutes and test the same code.
BLKQ_BIN=target/debug/blkq scripts/client-tests.sh

step "loom models (profile loom, LOOM_MAX_PREEMPTIONS=${LOOM_MAX_PREEMPTIONS:-2})"
LOOM_OK=0
wait "$LOOM_RUN" || LOOM_OK=$?
cat target/loom-run.log
if [ "$LOOM_OK" -ne 0 ]; then
  exit 1
fi

step "done"
