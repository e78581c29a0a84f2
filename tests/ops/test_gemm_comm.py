"""ag_gemm / gemm_rs / gemm_ar and fusedist.nn linears (tests/dist/worker_gemm_comm.py)."""

from __future__ import annotations

import pytest

from launch import assert_passed, mpirun, mpirun_available, torchrun

CPU_ENV = {"CUDA_VISIBLE_DEVICES": ""}


@pytest.mark.timeout(600)
def test_gemm_comm_cpu_torchrun():
    assert_passed(torchrun("worker_gemm_comm.py", 2, CPU_ENV), 2)


@pytest.mark.timeout(600)
@pytest.mark.skipif(not mpirun_available(), reason="mpirun not installed")
def test_gemm_comm_cpu_mpirun_3_ranks():
    assert_passed(mpirun("worker_gemm_comm.py", 3, CPU_ENV), 3)


@pytest.mark.gpu2
@pytest.mark.timeout(900)
def test_gemm_comm_gpu2():
    assert_passed(torchrun("worker_gemm_comm.py", 2, timeout=850), 2)
