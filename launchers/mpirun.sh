#!/usr/bin/env bash
# Launch a fusedist program with mpirun (Open MPI, or MPICH/Intel MPI Hydra).
#
#   launchers/mpirun.sh -np 4 bench.py --size 4M             # default -np: local GPU count (2 without GPUs)
#   launchers/mpirun.sh -np 16 --hostfile hosts -- bench.py  # options before -- go to mpirun as-is
#
# Exported NCCL_*, NVSHMEM_*, TORCH_*, FUSEDIST_*, CUDA_*, MASTER_* and PATH, LD_LIBRARY_PATH,
# PYTHONPATH are forwarded to all ranks (-x for Open MPI, -genvlist for MPICH).
set -euo pipefail

usage() { sed -n '2,8p' "$0" >&2; exit 2; }
np="" extra=() has_dd=0
for a in "$@"; do [[ "$a" == "--" ]] && has_dd=1; done
while [[ $# -gt 0 ]]; do
  case "$1" in
    -np|-n) np="$2"; shift 2 ;;
    --) shift; break ;;
    -h|--help) usage ;;
    *) (( has_dd )) || break; extra+=("$1"); shift ;;
  esac
done
[[ $# -ge 1 ]] || usage
if [[ -z "$np" ]]; then
  if [[ -n "${CUDA_VISIBLE_DEVICES:-}" ]]; then
    np=$(tr ',' '\n' <<<"$CUDA_VISIBLE_DEVICES" | grep -c .)
  else
    np=$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU' || true)
  fi
  [[ "$np" -gt 0 ]] || np=2
fi

# NVLink multicast off unless set (launchers/env.sh, docs/launchers.md).
source "${FUSEDIST_LAUNCHERS:-$(dirname "${BASH_SOURCE[0]}")}/env.sh"
mapfile -t vars < <(compgen -e | grep -E '^(NCCL_|NVSHMEM_|TORCH_|FUSEDIST_|CUDA_|MASTER_)|^(PATH|LD_LIBRARY_PATH|PYTHONPATH)$')

version=$(mpirun --version 2>&1 || true)
if grep -qiE 'open mpi|openrte' <<<"$version"; then
  args=(-np "$np" --bind-to none)
  for v in "${vars[@]}"; do args+=(-x "$v"); done
  if [[ "$(id -u)" == 0 ]]; then
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
    args+=(--allow-run-as-root)
  fi
  (( np > $(nproc) )) && args+=(--oversubscribe)
elif grep -qiE 'hydra|mpich|intel' <<<"$version"; then
  args=(-np "$np" -bind-to none -genvlist "$(IFS=,; echo "${vars[*]}")")
else
  echo "mpirun.sh: cannot tell Open MPI from MPICH: 'mpirun --version' said: $version" >&2; exit 1
fi

exec mpirun "${args[@]}" "${extra[@]+"${extra[@]}"}" "${PYTHON:-python3}" "$@"
