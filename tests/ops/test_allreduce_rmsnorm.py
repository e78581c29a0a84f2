"""all_reduce_add_rmsnorm: multi-process checks (tests/dist/worker_allreduce_rmsnorm.py)."""

from __future__ import annotations

import pytest

from launch import assert_passed, mpirun, mpirun_available, torchrun

CPU_ENV = {"CUDA_VISIBLE_DEVICES": ""}


@pytest.mark.timeout(600)
def test_allreduce_rmsnorm_cpu_torchrun():
    assert_passed(torchrun("worker_allreduce_rmsnorm.py", 2, CPU_ENV), 2)


@pytest.mark.timeout(600)
@pytest.mark.skipif(not mpirun_available(), reason="mpirun not installed")
def test_allreduce_rmsnorm_cpu_mpirun():
    assert_passed(mpirun("worker_allreduce_rmsnorm.py", 2, CPU_ENV), 2)


@pytest.mark.gpu2
@pytest.mark.timeout(900)
def test_allreduce_rmsnorm_gpu2():
    assert_passed(torchrun("worker_allreduce_rmsnorm.py", 2, timeout=850), 2)
