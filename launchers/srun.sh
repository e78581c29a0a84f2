#!/usr/bin/env bash
# Interactive srun wrapper (inside salloc, or standalone): options before -- go to srun.
#
#   salloc -N2 --ntasks-per-node=8 --gpus-per-node=8
#   launchers/srun.sh bench.py --size 4M                         # uses the allocation's tasks
#   launchers/srun.sh -N1 --ntasks-per-node=4 --gpus-per-node=4 -- bench.py
set -euo pipefail

srun_args=()
for a in "$@"; do
  if [[ "$a" == "--" ]]; then
    while [[ "$1" != "--" ]]; do srun_args+=("$1"); shift; done
    shift; break
  fi
done
[[ $# -ge 1 ]] || { sed -n '2,7p' "$0" >&2; exit 2; }

# NVLink multicast off unless set (launchers/env.sh, docs/launchers.md).
source "${FUSEDIST_LAUNCHERS:-$(dirname "${BASH_SOURCE[0]}")}/env.sh"

exec srun --kill-on-bad-exit=1 --cpu-bind=none "${srun_args[@]+"${srun_args[@]}"}" "${PYTHON:-python3}" "$@"
