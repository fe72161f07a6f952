#!/usr/bin/env bash
# The network of a NET=netns local cluster (slurm/dev/up.sh): one network namespace per emulated node, each with
# a veth whose host end sits on a bridge of the cluster's own, and a private /24 derived from the controller's
# port (10.<port/256>.<port%256>.0/24: clusters on different ports never overlap). The bridge holds .1 (where
# slurmctld is reached), node i holds .(i+1). No default route and no NAT anywhere: a node reaches the bridge's
# address and the other nodes of its cluster, nothing else.
#
#   net.sh DIR setup NODES PORT [fresh] create the bridge, the namespaces and their links (up.sh); fresh: first
#                                      remove whatever a cluster on PORT left (one not stopped by down.sh)
#   net.sh DIR teardown                remove every namespace, veth and bridge of the cluster (down.sh)
#   net.sh DIR addr NODE               the node's address
#   net.sh DIR exec NODE CMD [ARG...]  run CMD in the node's network namespace
#   net.sh DIR cut NODE                take the node's link down: nothing reaches it, it reaches nothing
#   net.sh DIR restore NODE            bring the link back up
#   net.sh DIR slow NODE [--delay 50ms] [--rate 10mbit] [--loss 1%]
#                                      shape the link in both directions: tc netem; on a kernel without sch_netem,
#                                      tbf for the rate and, for delay and loss, netdelay.py (user space, fed by
#                                      iptables NFQUEUE rules in the node's namespace)
#   net.sh DIR unslow NODE             remove the shaping
#   net.sh DIR second-if NODE          give the node a second interface, ib0, with an unroutable address
#                                      (198.18.255.x/24, reached by no one) ahead of eth0 in the interface list:
#                                      eth0 is plugged in again after it, so a choice of the first non-loopback
#                                      interface (or NCCL's preference for ib*) picks ib0
#   net.sh has-netem                   exit 0 if this kernel shapes with netem (delay, loss)
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
die() { echo "net.sh: $*" >&2; exit 1; }

netem_ok() {
  # Probed on a veth pair inside a throwaway namespace: nothing on the host is touched.
  local ns=hpkit-netem-probe-$$ ok=1
  ip netns add "$ns" || return 1
  if ip -n "$ns" link add p0 type veth peer name p1 &&
    tc -n "$ns" qdisc add dev p0 root netem delay 1ms 2>/dev/null; then
    ok=0
  fi
  ip netns del "$ns"
  return "$ok"
}

if [[ ${1:-} == has-netem ]]; then
  netem_ok
  exit
fi

(($# >= 2)) || die "usage: net.sh CLUSTER_DIR setup|teardown|addr|exec|cut|restore|slow|unslow|second-if [NODE] ..."
dir=$1
cmd=$2
shift 2
state=$dir/etc/net

# Names from the controller's port: 15 characters at most for a link (hpk65535n253), unique per cluster.
names() {
  bridge=hpk${port}b
  subnet=10.$((port / 256)).$((port % 256))
}
node_index() {
  [[ $1 =~ ^node([1-9][0-9]*)$ ]] || die "no node '$1' (node1, node2, ...)"
  local i=${BASH_REMATCH[1]}
  ((i <= nodes)) || die "no node '$1': the cluster has $nodes"
  echo "$i"
}
node_ns() { echo "hpkit-$port-node$1"; }
node_link() { echo "hpk${port}n$1"; }
node_addr() { echo "$subnet.$(($1 + 1))"; }

# Plug node i in: a veth with eth0 in its namespace and the host end on the bridge.
plug() {
  local i=$1 ns link
  ns=$(node_ns "$i")
  link=$(node_link "$i")
  ip link del "$link" 2>/dev/null || true
  ip link add "$link" type veth peer name eth0 netns "$ns"
  ip link set "$link" master "$bridge" up
  ip -n "$ns" addr add "$(node_addr "$i")/24" dev eth0
  ip -n "$ns" link set eth0 up
}

# netem's delay and loss without netem: every packet through the node's eth0, in or out, waits in NFQUEUE 0 for
# netdelay.py's verdict (--queue-bypass: packets pass if it is gone). Its pid is in <dir>/run.
user_space_delay() {
  local i=$1 delay=$2 loss=$3 ms pct ns pidfile
  case $delay in
    "") ms=0 ;;
    *ms) ms=${delay%ms} ;;
    *s) ms=$(awk -v s="${delay%s}" 'BEGIN { print s * 1000 }') ;;
    *) die "slow: --delay takes a time such as 50ms or 0.1s, not '$delay'" ;;
  esac
  pct=${loss%\%}
  [[ $ms =~ ^[0-9]+(\.[0-9]+)?$ ]] || die "slow: --delay takes a time such as 50ms or 0.1s, not '$delay'"
  [[ -z $pct || $pct =~ ^[0-9]+(\.[0-9]+)?$ ]] || die "slow: --loss takes a percentage such as 1%, not '$loss'"
  command -v iptables >/dev/null || die "slow: iptables not found (install iptables): this kernel has no sch_netem"
  ns=$(node_ns "$i")
  pidfile=$dir/run/netdelay-node$i.pid
  ip netns exec "$ns" iptables -w -A INPUT -i eth0 -j NFQUEUE --queue-num 0 --queue-bypass
  ip netns exec "$ns" iptables -w -A OUTPUT -o eth0 -j NFQUEUE --queue-num 0 --queue-bypass
  mkdir -p "$dir/run"
  setsid nsenter --net="/run/netns/$ns" -- python3 "$here/netdelay.py" 0 "$ms" "${pct:-0}" \
    >"$dir/log/netdelay-node$i.log" 2>&1 </dev/null &
  echo $! >"$pidfile"
  for _ in $(seq 1 50); do
    grep -q '^ready' "$dir/log/netdelay-node$i.log" 2>/dev/null && return 0
    kill -0 "$(cat "$pidfile")" 2>/dev/null || break
    sleep 0.1
  done
  die "slow: netdelay.py did not start: $(cat "$dir/log/netdelay-node$i.log" 2>/dev/null)"
}

stop_user_space_delay() {
  local pidfile=$dir/run/netdelay-node$1.pid pid
  [[ -s $pidfile ]] || return 0
  pid=$(cat "$pidfile")
  kill "$pid" 2>/dev/null || true
  for _ in $(seq 1 20); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  rm -f "$pidfile"
}

unslow() {
  local i=$1 ns
  ns=$(node_ns "$i")
  tc -n "$ns" qdisc del dev eth0 root 2>/dev/null || true
  tc qdisc del dev "$(node_link "$i")" root 2>/dev/null || true
  if [[ -s $dir/run/netdelay-node$i.pid ]]; then
    ip netns exec "$ns" iptables -w -D INPUT -i eth0 -j NFQUEUE --queue-num 0 --queue-bypass 2>/dev/null || true
    ip netns exec "$ns" iptables -w -D OUTPUT -o eth0 -j NFQUEUE --queue-num 0 --queue-bypass 2>/dev/null || true
    stop_user_space_delay "$i"
  fi
}

# Every link and namespace named for this cluster's port. Each host end takes its peer along; a namespace goes
# even if a stray process still holds it.
remove_port_objects() {
  local link ns
  for link in $(ip -o link show | sed -n "s/^[0-9]*: \(hpk${port}n[0-9]*\)@.*/\1/p"); do
    ip link del "$link" 2>/dev/null || true
  done
  ip link del "$bridge" 2>/dev/null || true
  for ns in $(ip netns list | awk -v p="hpkit-$port-node" 'index($1, p) == 1 {print $1}'); do
    ip netns del "$ns" 2>/dev/null || true
  done
}

if [[ $cmd == setup ]]; then
  (($# == 2 || $# == 3)) || die "usage: net.sh DIR setup NODES PORT [fresh]"
  nodes=$1 port=$2
  if ! [[ $nodes =~ ^[1-9][0-9]*$ ]] || ((nodes > 253)); then die "NET=netns holds 1 to 253 nodes, not '$nodes'"; fi
  [[ $port =~ ^[0-9]+$ ]] || die "bad port '$port'"
  for tool in ip tc nsenter; do
    command -v "$tool" >/dev/null || die "$tool not found: install iproute2 and util-linux (make system-deps)"
  done
  names
  if [[ ${3:-} == fresh ]]; then remove_port_objects; fi
  # Only a subnet no route of this host already covers (the default route aside): ours must not shadow one.
  if ! ip link show "$bridge" >/dev/null 2>&1; then
    clash=$(ip -4 route show match "$subnet.0/24" | grep -v '^default' || true)
    clash+=$(ip -4 route show root "$subnet.0/24")
    [[ -z $clash ]] || die "$subnet.0/24 (from port $port) is already routed on this host: $clash; pick another HPKIT_DEV_PORT"
    ip link add "$bridge" type bridge
    ip addr add "$subnet.1/24" dev "$bridge"
    ip link set "$bridge" up
  fi
  mkdir -p "$dir/etc"
  printf 'nodes=%s\nport=%s\n' "$nodes" "$port" >"$state"
  for ((i = 1; i <= nodes; i++)); do
    ns=$(node_ns "$i")
    if ! ip netns pids "$ns" >/dev/null 2>&1; then
      ip netns add "$ns"
      ip -n "$ns" link set lo up
    fi
    ip -n "$ns" addr show dev eth0 >/dev/null 2>&1 || plug "$i"
  done
  exit 0
fi

[[ -s $state ]] || die "$dir is not a NET=netns cluster (no $state)"
# shellcheck source=/dev/null
. "$state"
names

case $cmd in
  teardown)
    for ((i = 1; i <= nodes; i++)); do stop_user_space_delay "$i"; done
    remove_port_objects
    rm -f "$state"
    ;;
  addr)
    node_addr "$(node_index "${1:?NODE}")"
    ;;
  exec)
    i=$(node_index "${1:?NODE}")
    shift
    exec nsenter --net="/run/netns/$(node_ns "$i")" -- "$@"
    ;;
  cut)
    ip link set "$(node_link "$(node_index "${1:?NODE}")")" down
    ;;
  restore)
    ip link set "$(node_link "$(node_index "${1:?NODE}")")" up
    ;;
  slow)
    i=$(node_index "${1:?NODE}")
    shift
    delay="" rate="" loss=""
    while (($#)); do
      case $1 in
        --delay) delay=${2:?--delay TIME}; shift 2 ;;
        --rate) rate=${2:?--rate RATE}; shift 2 ;;
        --loss) loss=${2:?--loss PERCENT}; shift 2 ;;
        *) die "slow: unknown option '$1' (--delay, --rate, --loss)" ;;
      esac
    done
    [[ -n $delay$rate$loss ]] || die "slow: give --delay, --rate or --loss"
    unslow "$i"
    qdisc=()
    if netem_ok; then
      qdisc=(netem ${delay:+delay "$delay"} ${rate:+rate "$rate"} ${loss:+loss "$loss"})
    else
      [[ -z $rate ]] || qdisc=(tbf rate "$rate" burst 32kbit latency 400ms)
      [[ -z $delay$loss ]] || user_space_delay "$i" "$delay" "$loss"
    fi
    if ((${#qdisc[@]})); then
      # Both directions: the node's own eth0 sends, the host end sends toward the node.
      tc -n "$(node_ns "$i")" qdisc replace dev eth0 root "${qdisc[@]}"
      tc qdisc replace dev "$(node_link "$i")" root "${qdisc[@]}"
    fi
    ;;
  unslow)
    unslow "$(node_index "${1:?NODE}")"
    ;;
  second-if)
    i=$(node_index "${1:?NODE}")
    ns=$(node_ns "$i")
    if ! ip -n "$ns" link show ib0 >/dev/null 2>&1; then
      # A veth whose peer stays in the same namespace: up, addressed, and a dead end.
      ip -n "$ns" link add ib0peer type veth peer name ib0
      ip -n "$ns" addr add "198.18.255.$((i + 1))/24" dev ib0
      ip -n "$ns" link set ib0peer up
      ip -n "$ns" link set ib0 up
      plug "$i"
    fi
    ;;
  *)
    die "unknown command '$cmd'"
    ;;
esac
