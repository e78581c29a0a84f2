"""tests/conftest.py's tier decision (CPU tier): missing GPUs skip the GPU tier, a GPU host
whose CUDA does not initialize fails it."""

from __future__ import annotations

import conftest


def test_gpus_present_run():
    assert conftest.gpu_tier(2, None, True, 2, None) == (2, None)


def test_no_gpus_listed_skips():
    assert conftest.gpu_tier(0, None, True, 0, "RuntimeError: no driver") == (0, None)
    assert conftest.gpu_tier(0, None, False, 0, None) == (0, None)


def test_listed_gpus_with_a_cuda_init_failure_fail():
    have, broken = conftest.gpu_tier(8, None, True, 0, "RuntimeError: CUDA driver too old")
    assert have == 0 and "nvidia-smi lists 8 GPU(s)" in broken and "driver too old" in broken
    have, broken = conftest.gpu_tier(1, "0", True, 0, None)
    assert "is_available() is False" in broken


def test_listed_gpus_with_a_cpu_only_torch_fail():
    have, broken = conftest.gpu_tier(1, None, False, 0, None)
    assert have == 0 and "built without CUDA" in broken


def test_gpus_hidden_on_purpose_skip():
    assert conftest.gpu_tier(8, "", True, 0, None) == (0, None)
    assert conftest.gpu_tier(8, "-1", False, 0, None) == (0, None)
