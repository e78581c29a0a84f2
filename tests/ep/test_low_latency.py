"""The low-latency kernels of fusedist.ep on ONE GPU: ranks emulated as threads of one process
(fusedist.testing) at world 2, 4 and 8, each check of tests/dist/worker_ep.py marked @emulated:
dispatch bitwise against the reference (bf16, and the FP8 payload against the plain-torch
quantize / dequantize and within the e4m3 bound), combine bitwise against
fusedist.ops.moe.unpermute_reference, graph replays with new routings, overflow and id errors
named, mismatched calls and a peer that skips a call ended in bounded time. Correctness only:
emulated ranks share the GPU, so nothing here times anything (benchmarks/ep.py measures the
per-rank work)."""

from __future__ import annotations

import importlib
import sys

import pytest

from launch import DIST, assert_passed, emulate

# The checks that must run on emulated ranks.
MUST_EMULATE = {"low_latency_matches_references", "low_latency_async_overlap",
                "low_latency_graph_replays_new_routings",
                "low_latency_overflow_names_expert_and_count",
                "low_latency_call_mismatch_named", "zz_low_latency_peer_skips_call_times_out",
                "buffer_sizes_checked_across_ranks", "bad_arguments_are_named",
                "auto_follows_the_cost_model"}


def _module(stem: str):
    if str(DIST) not in sys.path:
        sys.path.insert(0, str(DIST))
    return importlib.import_module(stem)


def test_every_check_says_whether_it_runs_on_emulated_ranks():
    mod = _module("worker_ep")
    checks = _module("_checks")
    names = {fn.__name__ for fn in checks.CHECKS if fn.__module__ == mod.__name__}
    unmarked = sorted(n for n in names if n not in checks.EMULATION)
    assert not unmarked, f"worker_ep.py: mark these @emulated or @not_emulated(why): {unmarked}"
    not_run = sorted(n for n in MUST_EMULATE if checks.EMULATION.get(n, "?") is not None)
    assert not not_run, f"worker_ep.py: these must run on emulated ranks: {not_run}"


@pytest.mark.gpu
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("world", (2, 4, 8))
def test_low_latency_on_emulated_ranks(world):
    assert_passed(emulate("worker_ep.py", world, timeout=1400), world)
