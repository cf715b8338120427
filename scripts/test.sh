#!/usr/bin/env bash
# The whole test suite of blkq, as CI runs it (.ci/run calls exactly this).
# Installs what the tests need, then: fmt, clippy, unit + property + integration tests, real
# NBD clients (qemu-img, qemu-io, nbdinfo, nbdcopy, nbdsh, fio) against `blkq serve`, and the
# loom models in release with bounded preemptions.
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n==> %s\n' "$*"; }

step "toolchain components"
rustup component add rustfmt clippy >/dev/null 2>&1 || true

step "NBD client tools for scripts/client-tests.sh"
# qemu-img/qemu-io, nbdinfo/nbdcopy/nbdsh (+ libnbd's Python binding), fio, nbdkit, curl. Installed
# only when missing, and only where we can (root with apt-get).
need_tools=0
for tool in qemu-img qemu-io nbdinfo nbdcopy nbdsh fio nbdkit curl; do
  command -v "$tool" >/dev/null 2>&1 || need_tools=1
done
/usr/bin/python3 -c 'import nbd' >/dev/null 2>&1 || need_tools=1
if [[ $need_tools == 1 ]]; then
  if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends \
      qemu-utils libnbd-bin python3-libnbd fio nbdkit curl >/dev/null
  else
    echo "missing NBD client tools and cannot install them (need root and apt-get)" >&2
  fi
fi

step "Ceph packages for the rbd tests (scripts/ceph-cluster.sh)"
# ceph-mon, ceph-mgr, ceph-osd, ceph-common, librbd-dev: the rbd: device is built where librbd
# is installed, and its tests run a single-node cluster. Installed only when missing, and only
# where we can; once they are here, a test that cannot start the cluster fails rather than
# skipping (BLKQ_REQUIRE_CEPH=1).
if scripts/ceph-cluster.sh install; then
  export BLKQ_REQUIRE_CEPH=1
else
  echo "the rbd tests will skip: the Ceph packages are missing and cannot be installed" >&2
fi

step "cargo fmt --check"
cargo fmt --all -- --check

step "cargo clippy"
cargo clippy --workspace --all-targets -- -D warnings

step "unit, property and integration tests"
cargo test --workspace --no-fail-fast

step "real NBD clients against blkq serve (scripts/client-tests.sh)"
# Against the debug binary the tests above built and used: a release build (LTO, one codegen
# unit) would cost CI minutes and test the same code.
cargo build -p blkq
BLKQ_BIN=target/debug/blkq scripts/client-tests.sh

step "loom models (release, LOOM_MAX_PREEMPTIONS=${LOOM_MAX_PREEMPTIONS:-2})"
# A separate target dir: the cfg changes every crate's build, and would otherwise evict the
# normal build from the cache. Optimised (the models explore many interleavings) but without
# the release profile's LTO, single codegen unit and debug info: each of the ~40 model
# binaries would otherwise take its own LTO link.
RUSTFLAGS="--cfg blkq_loom" LOOM_MAX_PREEMPTIONS="${LOOM_MAX_PREEMPTIONS:-2}" \
  CARGO_PROFILE_RELEASE_LTO=false CARGO_PROFILE_RELEASE_CODEGEN_UNITS=16 \
  CARGO_PROFILE_RELEASE_DEBUG=0 \
  CARGO_TARGET_DIR=target/loom cargo test --release --workspace --test 'loom_*'
