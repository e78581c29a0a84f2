"""Test tiers: no marker = CPU (runs everywhere); gpu = one GPU; gpu2/gpu4/gpu8 = that many
GPUs on one host, launched as one process per GPU. Missing GPUs skip, never fail."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

_NEEDED = {"gpu": 1, "gpu2": 2, "gpu4": 4, "gpu8": 8}


def _gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


def pytest_collection_modifyitems(config, items):
    have = _gpus()
    for item in items:
        for mark, need in _NEEDED.items():
            if mark in item.keywords and have < need:
                item.add_marker(pytest.mark.skip(reason=f"needs {need} GPU(s), found {have}"))
