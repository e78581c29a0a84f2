#!/usr/bin/env bash
# Run a program as 2 nodes on one Linux host: two network namespaces joined by a veth pair
# whose both directions are shaped with tc (a set rate: tbf; a one-way delay too with --delay,
# which needs the netem qdisc: not every kernel has it), one torchrun agent
# per namespace (--nnodes 2), FUSEDIST_NODE_ID node0 / node1. Traffic between the ranks of one
# namespace stays on its loopback (unshaped); traffic between the namespaces crosses the
# shaped link, so the network's alpha and beta are known. Needs root, iproute2 and tc.
#
#   sudo launchers/netns_nodes.sh --nproc 2 --rate 200mbit -- benchmarks/scaling.py
#   sudo launchers/netns_nodes.sh --nproc 2 -- tests/dist/worker_hierarchical.py
#
# Exit status: the first non-zero status of the two agents, else 0. The namespaces are
# removed on exit (also on error or interrupt).
set -euo pipefail

usage() { sed -n '2,13p' "$0" >&2; exit 2; }
nproc=2 rate=200mbit delay="" port=29533 prefix=fdnet timeout=600
while [[ $# -gt 0 ]]; do
  case "$1" in
    --nproc) nproc="$2"; shift 2 ;;
    --rate) rate="$2"; shift 2 ;;
    --delay) delay="$2"; shift 2 ;;
    --port) port="$2"; shift 2 ;;
    --prefix) prefix="$2"; shift 2 ;;
    --timeout) timeout="$2"; shift 2 ;;
    --) shift; break ;;
    -h|--help) usage ;;
    *) echo "netns_nodes.sh: unknown option $1" >&2; usage ;;
  esac
done
[[ $# -ge 1 ]] || usage
[[ $(id -u) -eq 0 ]] || { echo "netns_nodes.sh: needs root (ip netns, tc)" >&2; exit 2; }

here=$(cd "$(dirname "$0")" && pwd)
source "$here/env.sh"   # NVLink multicast off unless set
ns0="${prefix}0" ns1="${prefix}1"
cleanup() { ip netns del "$ns0" 2>/dev/null || true; ip netns del "$ns1" 2>/dev/null || true; }
trap cleanup EXIT INT TERM
cleanup
ip netns add "$ns0"
ip netns add "$ns1"
ip link add "${prefix}v0" netns "$ns0" type veth peer name "${prefix}v1" netns "$ns1"
for i in 0 1; do
  ns="${prefix}$i"
  ip -n "$ns" link set lo up
  ip -n "$ns" addr add "10.77.0.$((i + 1))/24" dev "${prefix}v$i"
  ip -n "$ns" link set "${prefix}v$i" up
  # Egress of each end (so both directions): netem's delay and rate, or tbf's rate alone.
  if [[ -n "$delay" ]]; then
    ip netns exec "$ns" tc qdisc add dev "${prefix}v$i" root netem delay "$delay" \
      rate "$rate" limit 100000 || { echo "netns_nodes.sh: --delay needs the netem qdisc," \
      "which this kernel lacks; drop --delay to shape the rate alone (tbf)" >&2; exit 2; }
  else
    ip netns exec "$ns" tc qdisc add dev "${prefix}v$i" root tbf rate "$rate" burst 64kb \
      latency 100ms
  fi
done

pids=()
for i in 0 1; do
  ip netns exec "${prefix}$i" env FUSEDIST_NODE_ID="node$i" GLOO_SOCKET_IFNAME="${prefix}v$i" \
    NCCL_SOCKET_IFNAME="${prefix}v$i" NCCL_HOSTID="node$i" \
    FUSEDIST_NETNS_LINK="rate=$rate delay=${delay:-0}" \
    timeout "$timeout" "${PYTHON:-python3}" -m torch.distributed.run --nnodes 2 --node-rank "$i" \
    --nproc-per-node "$nproc" --master-addr 10.77.0.1 --master-port "$port" \
    --rdzv-conf timeout=60 "$@" &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do
  wait "$p" || { s=$?; [[ $rc -ne 0 ]] || rc=$s; }
done
exit "$rc"
