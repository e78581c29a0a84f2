"""all_reduce: multi-process checks (tests/dist/worker_allreduce.py) on every tier."""

from __future__ import annotations

import pytest

from launch import assert_passed, mpirun, mpirun_available, torchrun

CPU_ENV = {"CUDA_VISIBLE_DEVICES": "", "FUSEDIST_TEST_COMPILE": "0"}


@pytest.mark.timeout(600)
def test_allreduce_cpu_torchrun():
    assert_passed(torchrun("worker_allreduce.py", 2, CPU_ENV), 2)


@pytest.mark.timeout(600)
def test_allreduce_cpu_torchrun_3_ranks():
    # An odd world size: chunking and rank-order reduction with 3 ranks.
    assert_passed(torchrun("worker_allreduce.py", 3, CPU_ENV), 3)


@pytest.mark.timeout(600)
@pytest.mark.skipif(not mpirun_available(), reason="mpirun not installed")
def test_allreduce_cpu_mpirun():
    assert_passed(mpirun("worker_allreduce.py", 2, CPU_ENV), 2)


@pytest.mark.gpu2
@pytest.mark.timeout(1800)
def test_allreduce_gpu2():
    assert_passed(torchrun("worker_allreduce.py", 2, timeout=1700), 2)


@pytest.mark.gpu2
@pytest.mark.timeout(900)
def test_call_mismatch_gpu2():
    """Only the checks of ranks calling differently (symmetric kernels, NCCL routes, the NCCL
    call-check setting): a quick run after a change to the call descriptors or checks."""
    assert_passed(torchrun("worker_allreduce.py", 2, {"FUSEDIST_TEST_ONLY": "mismatch"},
                           timeout=850), 2)
