#!/usr/bin/env bash
# Set up fusedist from this checkout and run the main job: the all-reduce benchmark over
# whatever is present -- one process per GPU on a GPU host, two gloo processes on a CPU-only
# machine -- printing an nccl-tests style table with the baselines beside fusedist.
#
#   bash launchers/quickstart.sh            # install (if needed) + benchmark
#   bash launchers/quickstart.sh --fused    # extra args go to benchmarks/allreduce.py
set -euo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}"
export TORCH_SYMM_MEM_DISABLE_MULTICAST="${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}"
export NVSHMEM_DISABLE_NVLS="${NVSHMEM_DISABLE_NVLS:-1}"
if ! python3 -c "import torch" 2>/dev/null; then
  python3 -m pip install -q torch==2.13.0   # CPU build; GPU hosts bring their own torch
fi
if ! (cd /tmp && python3 -c "import fusedist._C" 2>/dev/null); then
  python3 -m pip install -q pybind11 "scikit-build-core>=0.10" ninja 2>/dev/null || true
  python3 -m pip install -q --no-build-isolation --no-deps . 
fi
ngpu=$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU' || true)
if [[ $ngpu -gt 0 ]] && ! python3 -c "import nccl.core" 2>/dev/null; then
  python3 -m pip install -q nccl4py 2>/dev/null || true
  if ! python3 -c "import nccl.core" 2>/dev/null; then
    echo "quickstart: nccl4py unavailable; using torch.distributed's NCCL (FUSEDIST_NCCL=torch)" >&2
    export FUSEDIST_NCCL=torch
  fi
fi
nproc=$(( ngpu > 0 ? ngpu : 2 ))
exec python3 -P -m torch.distributed.run --standalone --nproc-per-node "$nproc" \
  benchmarks/allreduce.py --quick "$@"
