# bench/two_hosts.sh: sourced by the bench/net_*.sh scripts (root). Makes two network
# namespaces, $F (the front, 10.0.0.1) and $K (the back, 10.0.0.2), joined by a veth pair
# named veth0 at both ends, and a temporary directory $D; on exit kills $PIDS and removes
# both namespaces and $D. `link up|down` cuts or restores the pair.
D=$(mktemp -d /tmp/bq.XXXX)
F=blkq-$$-front
K=blkq-$$-back
PIDS=""
two_hosts_cleanup() {
  kill -KILL $PIDS 2>/dev/null || true
  ip netns del $F 2>/dev/null || true
  ip netns del $K 2>/dev/null || true
  rm -rf "$D"
}
trap two_hosts_cleanup EXIT
trap "exit 143" TERM INT
ip netns add $F
ip netns add $K
ip link add name veth0 netns $F type veth peer name veth0 netns $K
ip -n $F addr add 10.0.0.1/24 dev veth0
ip -n $K addr add 10.0.0.2/24 dev veth0
for ns in $F $K; do ip -n $ns link set dev veth0 up; ip -n $ns link set dev lo up; done
link() { for ns in $F $K; do ip -n $ns link set dev veth0 "$1"; done; }
