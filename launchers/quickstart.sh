#!/usr/bin/env bash
# fusedist from nothing: install what is missing, build fusedist._C where it serves, run the
# main job on whatever this machine has.
#
#   bash launchers/quickstart.sh           # install + build (GPU hosts) + main job
#   FUSEDIST_DEVICE=cpu bash launchers/quickstart.sh   # the CPU reference path on a GPU host
#   FUSEDIST_BUILD=0 bash launchers/quickstart.sh      # GPU host: use the fusedist installed
#
# GPU host (NVIDIA driver, nvcc >= 12.4): installs nccl4py and the CUTLASS headers, builds
# fusedist._C with every core (~130 s on 16 cores), then shows fusedist's kernels beside their
# torch / NCCL baselines, measured in the same run. CPU-only machine: nothing is compiled (the
# CPU path imports without _C); two gloo processes check every op against float64 in seconds.
# Offline hosts install from ./.whl or $FUSEDIST_WHEELS (launchers/download-wheels.sh makes it).
# Results of the benchmarks go to $FUSEDIST_RESULTS_DIR (default _out/quickstart), never over
# the committed benchmarks/results.
set -euo pipefail
cd "$(dirname "$0")/.."
source launchers/setup.sh
t_start=$SECONDS

fd_python
fd_gpus
fd_torch
fd_install numpy
if (( NGPU > 0 )) && [[ -z ${FUSEDIST_CUDA_ARCHS:-} ]]; then
  cc=$("$PY" -c "import torch; print('%d%d' % torch.cuda.get_device_capability(0))")
  if [[ $cc != 90 ]]; then              # _C is built for sm_90a unless told otherwise
    echo "== this GPU is sm_$cc; fusedist's kernels are built for Hopper (sm_90a, FUSEDIST_CUDA_ARCHS adds others): running the CPU reference path"
    NGPU=0
  fi
fi
if (( NGPU > 0 )); then
  fd_install_soft matplotlib
  fd_nccl4py
  [[ ${FUSEDIST_BUILD:-1} == 0 ]] || fd_build
  RUN=("$PY" -P)                        # the installed fusedist, with its _C
  export PYTHONSAFEPATH=1               # torchrun's `-m` workers too (not ./fusedist)
else
  echo "== CPU reference path: not building fusedist._C (it imports without it)"
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} CUDA_VISIBLE_DEVICES=""
  RUN=("$PY" -P)                        # fusedist from this checkout, on the CPU
fi
export FUSEDIST_RESULTS_DIR=${FUSEDIST_RESULTS_DIR:-$PWD/_out/quickstart}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
NPROC=$(( NGPU > 0 ? NGPU : 2 ))
ranks() { "${RUN[@]}" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" "$@"; }
echo "   setup took $((SECONDS - t_start)) s"

gpu_kernels() {  # what this host's GPUs can show, each beside its baselines in the same run
  local quick=(--ms 1,32,128,512)
  "${RUN[@]}" benchmarks/gemm.py --help 2>/dev/null | grep -q -- "--quick" && quick=(--quick)
  echo "== fusedist.gemm vs torch.matmul (one GPU; weights streamed from HBM)"
  "${RUN[@]}" benchmarks/gemm.py "${quick[@]}"
  if [[ -f benchmarks/attention.py ]]; then
    echo "== decode attention vs torch SDPA (one GPU)"
    local out=()
    "${RUN[@]}" benchmarks/attention.py --help 2>/dev/null | grep -q -- "--out" \
      && out=(--out "$FUSEDIST_RESULTS_DIR/attention")
    "${RUN[@]}" benchmarks/attention.py --quick "${out[@]}"
  fi
  if (( NGPU >= 2 )); then
    echo "== all-reduce and fused all-reduce + RMSNorm vs NCCL and torch symmetric memory ($NGPU GPUs)"
    ranks benchmarks/allreduce.py --quick --fused "$@"
  else
    echo "== collectives (all_reduce, gemm_ar, ag_gemm, gemm_rs) need two or more GPUs on one host; this host has 1"
  fi
}

cpu_reference() {  # correctness of every op on the CPU path, 2 gloo processes
  ranks launchers/reference_check.py "$@"
}

model_decode() {  # the main job: tensor-parallel decode of a Llama-family model beside plain torch
  # GPU host: the Llama-3-8B shape with random weights, TP = the GPUs present. CPU machine: the
  # tiny configuration at TP 2 over gloo (the reference path: correctness, not speed).
  if (( NGPU > 0 )); then
    echo "== Llama-3-8B shape (random weights), TP $NPROC, decode beside plain torch + NCCL"
    ranks -m fusedist.generate --config llama-3-8b --random-weights --baseline torch \
      --context-fill 4000 --profile "$@"
  else
    echo "== tiny Llama (random weights), TP 2 over gloo: fusedist's CPU reference path beside torch"
    ranks -m fusedist.generate --device cpu "$@"
  fi
}

# MAIN_JOB: the one line to change when the main job changes. ranks = torchrun over $NPROC
# processes (the GPUs present, or 2 gloo processes on CPU); quickstart's arguments follow it.
# `FUSEDIST_QUICKSTART=kernels` runs the single-GPU kernels beside their baselines instead
# (CPU: `reference` checks every op against float64).
case ${FUSEDIST_QUICKSTART:-model} in
  kernels) MAIN_JOB=(gpu_kernels) ;;
  reference) MAIN_JOB=(cpu_reference) ;;
  *) MAIN_JOB=(model_decode) ;;
esac
"${MAIN_JOB[@]}" "$@"
echo "== quickstart done in $((SECONDS - t_start)) s (benchmark results, if any: $FUSEDIST_RESULTS_DIR)"
