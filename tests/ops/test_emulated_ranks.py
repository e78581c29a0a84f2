"""The multi-rank checks of the symmetric kernels and of the GEMM + collective engines' call
checks on ONE GPU: 2 and 3 ranks emulated as threads of one process (fusedist.testing), each
worker's checks marked @emulated run by tests/dist/emulate.py. Correctness only: emulated
ranks share the GPU, so nothing here times anything. The same checks run on real ranks in the
gpu2 tier (test_allreduce.py, test_allreduce_rmsnorm.py, test_gemm_comm.py)."""

from __future__ import annotations

import importlib
import sys

import pytest

from launch import DIST, assert_passed, emulate

WORKERS = ("worker_allreduce.py", "worker_allreduce_rmsnorm.py", "worker_gemm_comm.py")

# The checks that must run on emulated ranks: the symmetric kernels' correctness checks and the
# call checks of the engines that can be emulated (fusedist/testing/emulated.py says which).
MUST_EMULATE = {
    "worker_allreduce.py": {
        "eager_all_algos_dtypes_sizes",          # exact sums, bitwise the same on every rank
        "symmetric_call_mismatch",               # sizes, dtypes, one-shot vs two-shot, RMSNorm
        "symmetric_sizes_checked_at_creation",
        "epoch_wraps_onto_the_next_generation",
        "zz_peer_skips_call_times_out",          # timeout, communicator unusable afterwards
    },
    "worker_allreduce_rmsnorm.py": {"fused_matches_reference"},  # forced fused, vs reference
    "worker_gemm_comm.py": {
        "gemm_ar_fused_matches_reference",
        "gemm_ar_fused_call_mismatch",           # another N / M / dtype, against a one-shot
        "copy_engine_call_mismatch",
        "zz_gemm_ar_fused_peer_skips_call_times_out",
    },
}


def _module(stem: str):
    """A module of tests/dist, imported as its workers import each other."""
    if str(DIST) not in sys.path:
        sys.path.insert(0, str(DIST))
    return importlib.import_module(stem)


@pytest.mark.parametrize("worker", WORKERS)
def test_every_check_says_whether_it_runs_on_emulated_ranks(worker):
    """No check of these workers drops out of the emulated runs unnoticed: each is marked
    @emulated or @not_emulated(why), and the symmetric-kernel and call checks run there."""
    mod = _module(worker[:-len(".py")])
    checks = _module("_checks")
    names = {fn.__name__ for fn in checks.CHECKS if fn.__module__ == mod.__name__}
    unmarked = sorted(n for n in names if n not in checks.EMULATION)
    assert not unmarked, f"{worker}: mark these @emulated or @not_emulated(why): {unmarked}"
    not_run = sorted(n for n in MUST_EMULATE[worker] if checks.EMULATION.get(n, "?") is not None)
    assert not not_run, f"{worker}: these must run on emulated ranks: {not_run}"
    assert all(checks.EMULATION[n] is None or checks.EMULATION[n].strip() for n in names)


@pytest.mark.gpu
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("world", (2, 3))
@pytest.mark.parametrize("worker", WORKERS)
def test_checks_on_emulated_ranks(worker, world):
    assert_passed(emulate(worker, world, timeout=1100), world)
