#!/usr/bin/env bash
# Launch a fusedist program with torchrun (python3 -m torch.distributed.run).
#
#   launchers/torchrun.sh -- bench.py --size 4M               # one rank per local GPU (2 without GPUs)
#   launchers/torchrun.sh --nproc 4 -- bench.py
#   # two nodes, 8 GPUs each (run on both hosts; --node-rank 0 on node0, 1 on node1):
#   launchers/torchrun.sh --nproc 8 --nnodes 2 --node-rank 0 --master node0:29500 -- bench.py
#
# Extra torchrun flags can go in $TORCHRUN_ARGS; the interpreter in $PYTHON (default python3).
set -euo pipefail

usage() { sed -n '2,9p' "$0" >&2; exit 2; }
nproc="" nnodes=1 node_rank=0 master=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --nproc) nproc="$2"; shift 2 ;;
    --nnodes) nnodes="$2"; shift 2 ;;
    --node-rank) node_rank="$2"; shift 2 ;;
    --master) master="$2"; shift 2 ;;
    --) shift; break ;;
    -h|--help) usage ;;
    -*) echo "torchrun.sh: unknown option $1" >&2; usage ;;
    *) break ;;
  esac
done
[[ $# -ge 1 ]] || usage

if [[ -z "$nproc" ]]; then
  if [[ -n "${CUDA_VISIBLE_DEVICES:-}" ]]; then
    nproc=$(tr ',' '\n' <<<"$CUDA_VISIBLE_DEVICES" | grep -c .)
  else
    nproc=$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU' || true)
  fi
  [[ "$nproc" -gt 0 ]] || nproc=2
fi

# NVLink multicast off unless set (launchers/env.sh, docs/launchers.md).
source "${FUSEDIST_LAUNCHERS:-$(dirname "${BASH_SOURCE[0]}")}/env.sh"

args=(--nproc_per_node "$nproc" --nnodes "$nnodes" --node_rank "$node_rank")
if [[ -n "$master" ]]; then
  args+=(--master_addr "${master%:*}")
  [[ "$master" == *:* ]] && args+=(--master_port "${master##*:}")
elif [[ "$nnodes" == 1 ]]; then
  args+=(--standalone)
else
  echo "torchrun.sh: --nnodes $nnodes needs --master ADDR:PORT" >&2; exit 2
fi

# shellcheck disable=SC2086
exec "${PYTHON:-python3}" -m torch.distributed.run "${args[@]}" ${TORCHRUN_ARGS:-} "$@"
