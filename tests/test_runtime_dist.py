"""fusedist.init / shutdown on 4 CPU ranks emulating 2 nodes x 2 ranks, launched by torchrun
and by mpirun: tests/dist/worker_runtime.py (topology, groups, all-reduce over each group,
an engine's ProcessGroup; mode tp_spans: init errors and re-init in one process) and
tests/dist/worker_adopt.py (init() adopts an engine's process group, shutdown() keeps it)."""

from __future__ import annotations

import pytest

from launch import assert_passed, mpirun, mpirun_available, torchrun

NPROC = 4
# A hung rendezvous or collective fails within a minute instead of the default 300 s.
CPU_ENV = {"CUDA_VISIBLE_DEVICES": "", "FUSEDIST_INIT_TIMEOUT_S": "60"}
CASES = [
    pytest.param("worker_runtime.py", (), id="runtime"),
    pytest.param("worker_runtime.py", ("tp_spans",), id="tp_spans"),
    pytest.param("worker_adopt.py", (), id="adopt"),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("worker,args", CASES)
def test_runtime_cpu_torchrun(worker, args):
    assert_passed(torchrun(worker, NPROC, CPU_ENV, timeout=280, args=args), NPROC)


@pytest.mark.timeout(300)
@pytest.mark.skipif(not mpirun_available(), reason="mpirun not installed")
@pytest.mark.parametrize("worker,args", CASES)
def test_runtime_cpu_mpirun(worker, args):
    assert_passed(mpirun(worker, NPROC, CPU_ENV, timeout=280, args=args), NPROC)
