#!/usr/bin/env bash
# fusedist's test suite from nothing: install the test dependencies, build fusedist._C where
# it serves, run every test. On a GPU host the gpu / gpu2 / gpu4 / gpu8 tiers run too (each
# skips itself when its GPUs are missing); on a CPU machine they skip.
#
#   bash tests/run.sh                        # the whole suite
#   bash tests/run.sh tests/ops -k rmsnorm   # arguments go to pytest (default: tests)
#
# FUSEDIST_BUILD: 1 compiles every CUDA source first (CI does; ~11 min on 2 cores), 0 never;
# unset: build on a GPU host, or when CI=true. Without a build the tests import fusedist from
# this checkout and whatever needs _C skips (FUSEDIST_REQUIRE_EXT=1 makes that a failure).
# Offline hosts install from ./.whl or $FUSEDIST_WHEELS (launchers/download-wheels.sh).
# FUSEDIST_TEST_JOBS: pytest-xdist processes (default: one per core for the whole suite on a
# host without GPUs, where a second test fills the time ranks spend waiting; 1 on GPU hosts,
# whose tests share the GPUs, and for a chosen subset). docs/testing.md has what it gains.
set -euo pipefail
cd "$(dirname "$0")/.."
source launchers/setup.sh
t_start=$SECONDS

fd_python
fd_gpus
[[ ${FUSEDIST_DEVICE:-} == cpu ]] && export CUDA_VISIBLE_DEVICES=""   # the GPU tiers skip
fd_torch
fd_install numpy pytest timeout xdist mpi hf lint serve openai
build=${FUSEDIST_BUILD:-}
if [[ -z $build || $build == auto ]]; then
  build=0
  (( NGPU > 0 )) && build=1
  [[ ${CI:-} == true || ${CI:-} == 1 ]] && build=1
fi
(( NGPU > 0 )) && fd_install_soft matplotlib
# nccl4py: on GPU hosts, and with every build (CI checks that it imports without libnccl).
if (( NGPU > 0 )) || [[ $build == 1 ]]; then fd_nccl4py; fi
if [[ $build == 1 ]]; then
  fd_build
  :                                      # the installed fusedist, with its _C
else
  echo "== not building fusedist._C ($( (( NGPU > 0 )) && echo "FUSEDIST_BUILD=0" || echo "no GPU")): tests import fusedist from this checkout; FUSEDIST_BUILD=1 compiles every CUDA source"
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
if [[ $(id -u) == 0 ]]; then             # Open MPI refuses root without these
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
export PYTHONUNBUFFERED=1
# pytest keeps its assertion-rewritten test modules in __pycache__ only where Python may write
# bytecode: without it every pytest worker rewrites and compiles every test file again.
unset PYTHONDONTWRITEBYTECODE
echo "   setup took $((SECONDS - t_start)) s"

jobs=${FUSEDIST_TEST_JOBS:-}
if [[ -z $jobs ]]; then
  jobs=1
  (( NGPU == 0 && $# == 0 )) && jobs=$(fd_cores)
fi
xdist=()
(( jobs > 1 )) && xdist=(-n "$jobs" --dist worksteal)
echo "== tests: $PY -P -m pytest -q ${xdist[*]} ${*:-tests}"
set +e
"$PY" -P -m pytest -q -p no:cacheprovider "${xdist[@]}" "${@:-tests}"
rc=$?
set -e
if [[ $rc -eq 5 ]]; then fd_die "pytest collected no tests"; fi
echo "== tests/run.sh done in $((SECONDS - t_start)) s (pytest exit $rc)"
exit $rc
