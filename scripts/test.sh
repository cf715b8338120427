#!/usr/bin/env bash
# The whole test suite of blkq, as CI runs it (.ci/run calls exactly this).
# Installs what the tests need, then: fmt, clippy, unit + property + integration tests,
# and the loom models in release with bounded preemptions.
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n==> %s\n' "$*"; }

step "toolchain components"
rustup component add rustfmt clippy >/dev/null 2>&1 || true

step "cargo fmt --check"
cargo fmt --all -- --check

step "cargo clippy"
cargo clippy --workspace --all-targets -- -D warnings

step "unit, property and integration tests"
cargo test --workspace

step "loom models (release, LOOM_MAX_PREEMPTIONS=${LOOM_MAX_PREEMPTIONS:-2})"
# A separate target dir: the cfg changes every crate's build, and would otherwise evict the
# normal build from the cache.
RUSTFLAGS="--cfg blkq_loom" LOOM_MAX_PREEMPTIONS="${LOOM_MAX_PREEMPTIONS:-2}" \
  CARGO_TARGET_DIR=target/loom cargo test --release --workspace --test 'loom_*'
