"""The torch.distributed backend "fusedist" (fusedist/comm/c10d.py) under unmodified torch code:
tests/dist/worker_c10d.py checks every call against the same call on a gloo (CPU) or NCCL
(GPU) group of the same ranks, bitwise where fusedist's algorithm promises it."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import fusedist
from fusedist.comm import c10d
from launch import assert_passed, torchrun

CPU_ENV = {"CUDA_VISIBLE_DEVICES": "", "FUSEDIST_INIT_TIMEOUT_S": "60"}


def test_registered_on_import_without_becoming_a_default():
    assert fusedist.comm.c10d.BACKEND in dist.Backend.backend_list
    c10d.register()  # idempotent
    assert dist.Backend.backend_list.count("fusedist") == 1
    assert dist.Backend.default_device_backend_map["cpu"] == "gloo"
    assert dist.Backend.default_device_backend_map.get("cuda", "nccl") == "nccl"


def test_backend_device_without_a_gpu(monkeypatch):
    from fusedist.distributed.groups import backend_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for b in ("gloo", "nccl", "fusedist", "cpu:gloo,cuda:fusedist"):
        assert backend_device(b) == torch.device("cpu"), b


@pytest.mark.timeout(300)
@pytest.mark.parametrize("nproc,backend", [(2, "fusedist"), (3, "fusedist"),
                                           (2, "cpu:gloo,cuda:fusedist")])
def test_backend_cpu(nproc, backend):
    assert_passed(torchrun("worker_c10d.py", nproc, CPU_ENV, timeout=280, args=(backend,)), nproc)


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_backend_gpu_world1():
    assert torch.cuda.device_count() >= 1
    assert_passed(torchrun("worker_c10d.py", 1, {"FUSEDIST_INIT_TIMEOUT_S": "60"}, timeout=280,
                           args=("cpu:gloo,cuda:fusedist",)), 1)


@pytest.mark.gpu2
@pytest.mark.timeout(300)
def test_backend_gpu_world2():
    assert_passed(torchrun("worker_c10d.py", 2, {"FUSEDIST_INIT_TIMEOUT_S": "60"}, timeout=280,
                           args=("cpu:gloo,cuda:fusedist",)), 2)
