#!/usr/bin/env bash
# What scripts/test.sh needs besides Rust, installed when missing (as root with apt-get only):
#   - the NBD clients of scripts/client-tests.sh and the backup tests: qemu-utils (qemu-img,
#     qemu-io), libnbd-bin (nbdinfo, nbdcopy, nbdsh), python3-libnbd, fio, nbdkit, curl;
#   - the Ceph packages of the rbd tests: ceph-mon ceph-mgr ceph-osd ceph-common librbd-dev
#     (scripts/ceph-cluster.sh install).
# BLKQ_NO_INSTALL=1 installs nothing and says what is missing (the tests that need it skip,
# saying so). Exit 0 when the Ceph packages are there at the end, 2 when not.
set -euo pipefail
cd "$(dirname "$0")/.."

nbd_packages=(qemu-utils libnbd-bin python3-libnbd fio nbdkit curl)
missing=()
for tool in qemu-img qemu-io nbdinfo nbdcopy nbdsh fio nbdkit curl; do
  command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
done
/usr/bin/python3 -c 'import nbd' >/dev/null 2>&1 || missing+=("python3-libnbd")
if ((${#missing[@]} > 0)); then
  if [[ ${BLKQ_NO_INSTALL:-0} == 1 ]]; then
    echo "test-deps: missing ${missing[*]}; BLKQ_NO_INSTALL=1: not installing ${nbd_packages[*]}" >&2
  elif [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${nbd_packages[@]}" >/dev/null
  else
    echo "test-deps: missing ${missing[*]} and cannot install them (need root and apt-get)" >&2
  fi
fi

scripts/ceph-cluster.sh install
