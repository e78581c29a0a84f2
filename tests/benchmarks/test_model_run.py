"""benchmarks/_model_run.py, the model benchmark's harness, run as `python -m fusedist.generate`
hands a benchmark run to it: --baseline lists (torch, torch-compile), the JSON's per-backend
timings (prefill_ms the median of the warm prefills), speedups over each baseline, the profile
of a decode step and of a prefill, the text report, a backend's failure. CPU tier, the tiny
config (torch-compile through the aot_eager backend: inductor would compile C++ for ~20 s)."""

from __future__ import annotations

import importlib.util
import json
import os
from statistics import median

import pytest
import torch

from launch import python

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CPU_ENV = {"CUDA_VISIBLE_DEVICES": ""}


def _harness():
    spec = importlib.util.spec_from_file_location(
        "model_run", os.path.join(ROOT, "benchmarks", "_model_run.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_speedups():
    speedups = _harness().speedups
    res = {"fusedist": {"ms_per_token": 2.0, "step_ms": 1.0, "prefill_ms": 10.0},
           "torch": {"ms_per_token": 5.0, "step_ms": 3.0, "prefill_ms": 12.0},
           "torch-compile": {"error": "RuntimeError: x"}}
    assert _harness().speedups(res) == {"torch": {"per_token": 2.5, "per_step": 3.0, "prefill": 1.2}}
    assert _harness().speedups({"fusedist": {"error": "x"}, "torch": res["torch"]}) == {}


def _cli(args, json_out=True, timeout=240):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", **CPU_ENV)
    p = python(["-P", "-m", "fusedist.generate", *args, "--quiet", "--device", "cpu"]
               + (["--json"] if json_out else []), env=env, timeout=timeout, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(p.stdout.strip().splitlines()[-1]) if json_out else p.stdout


ARGS = ["--config", "tiny", "--random-weights", "--batch", "2", "--prompt-len", "9",
        "--max-new-tokens", "7", "--compile-backend", "aot_eager", "--prefill-reps", "2"]


def test_cli_json_every_baseline():
    out = _cli(ARGS + ["--baseline", "torch,torch-compile", "--profile"])
    t = out["timings"]
    assert list(t) == ["fusedist", "torch", "torch-compile"]
    assert out["baselines"] == ["torch", "torch-compile"]
    for name, r in t.items():
        assert "error" not in r, (name, r)
        assert len(r["prefill_ms_reps"]) == 2 and all(x > 0 for x in r["prefill_ms_reps"])
        assert r["prefill_ms"] == pytest.approx(median(r["prefill_ms_reps"]), abs=1e-3)
        assert r["generate_prefill_ms"] > 0 and r["step_ms"] > 0 and r["decode_steps"] == 6
        assert r["prefill"] == "eager"
        for key in ("profile_us", "prefill_profile_us"):
            p = r[key]
            assert p["kernels"] > 0 and p["gemm"] > 0 and p["total"] > 0, (name, key, p)
            assert len(p["top"]) >= 1
        assert "wall_us" in r["prefill_profile_us"]
    assert t["torch-compile"]["decode"] == "torch.compile" and t["torch"]["decode"] == "eager ops"
    assert t["torch-compile"]["compile_backend"] == "aot_eager"
    assert t["torch-compile"]["compile_s"] > 0 and "compile_s" not in t["torch"]
    # fp32 on the CPU, no random context: every backend generates fusedist's ids
    assert out["ids_match"] == {"torch": True, "torch-compile": True}
    for name in ("torch", "torch-compile"):
        s = out["speedups"][name]
        assert s["per_step"] == pytest.approx(t[name]["step_ms"] / t["fusedist"]["step_ms"],
                                              rel=1e-2)
        assert s["prefill"] == pytest.approx(t[name]["prefill_ms"] / t["fusedist"]["prefill_ms"],
                                             rel=1e-2)
        assert set(s) == {"per_token", "per_step", "prefill"}
    # the plain-torch figures under their earlier names
    assert out["speedup"] == out["speedups"]["torch"]["per_token"]
    assert out["step_speedup"] == out["speedups"]["torch"]["per_step"]
    assert out["torch_ids_match"] is True


def test_cli_compile_baseline_alone_and_text():
    # (random context: each backend's cache layout draws its own, so ids may differ)
    out = _cli(ARGS + ["--baseline", "torch-compile", "--context-fill", "6"])
    assert list(out["timings"]) == ["fusedist", "torch-compile"]
    assert "speedup" not in out and set(out["speedups"]) == {"torch-compile"}
    assert "profile_us" not in out["timings"]["fusedist"]
    assert out["context_fill"] == 6 and out["timings"]["torch-compile"]["prefill_ms"] > 0
    text = _cli(ARGS + ["--baseline", "torch,torch-compile"], json_out=False)
    rows = [line.split()[0] for line in text.splitlines()
            if line.split() and line.split()[0] in ("fusedist", "torch", "torch-compile")]
    assert rows == ["fusedist", "torch", "torch-compile"], text
    assert "prefill ms: the median of 2 warm prefills" in text
    assert "torch-compile: decode step under torch.compile (aot_eager" in text
    assert "prefill eager" in text


def _run(args, code=None, timeout=240):
    """The CLI in a subprocess (or `python -c code` with these arguments), its address space
    capped at 8 GiB so that a run that would allocate too much fails instead of swapping."""
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", **CPU_ENV)
    head = ["-c", code] if code is not None else ["-m", "fusedist.generate"]
    return python(["-P", *head, *args, "--quiet", "--device", "cpu"], env=env, timeout=timeout,
                  cwd=ROOT, rlimit_as=8 << 30)


FAIL_FUSEDIST = """
import sys
import importlib.util
spec = importlib.util.spec_from_file_location("model_run", "benchmarks/_model_run.py")
g = importlib.util.module_from_spec(spec)
spec.loader.exec_module(g)
run = g._run_backend
def failing(backend, *args):
    if backend == "fusedist":
        raise RuntimeError("injected failure")
    return run(backend, *args)
g._run_backend = failing
sys.exit(g.main(sys.argv[1:]))
"""


def test_cli_failure_exits_nonzero():
    """A one-process run whose fusedist backend fails: the baseline still runs and the report
    is printed, the error goes to stderr and the exit status is 1."""
    p = _run(["--config", "tiny", "--random-weights", "--prompt-len", "5",
              "--max-new-tokens", "3", "--baseline", "torch", "--prefill-reps", "1", "--json"],
             code=FAIL_FUSEDIST)
    assert p.returncode == 1, (p.returncode, p.stderr[-4000:])
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["timings"]["fusedist"]["error"] == "RuntimeError: injected failure"
    assert "error" not in out["timings"]["torch"] and out["timings"]["torch"]["step_ms"] > 0
    assert "fusedist.generate: fusedist failed: RuntimeError: injected failure" in p.stderr


def test_failures_lists_every_recorded_error():
    failures = _harness().failures

    assert failures({"fusedist": {"ms_per_token": 1.0}, "torch": {"step_ms": 2.0}}) == []
    res = {"fusedist": {"error": "RuntimeError: a", "eager_error": "b"},
           "torch": {"graph_error": "RuntimeError: c", "step_ms": 1.0},
           "torch-compile": {"step_ms": 1.0, "prefill_profile_error": "RuntimeError: d"}}
    assert failures(res) == [
        "fusedist failed: RuntimeError: a (eager retry: b)",
        "torch: CUDA-graph decode failed, ran eagerly instead: RuntimeError: c",
        "torch-compile: --profile failed (prefill_profile_error): RuntimeError: d"]


def test_cli_request_filling_the_cache_runs():
    """prompt 15 + 1 new token = one 16-token page: the warm-up fits the timed request."""
    out = _cli(["--config", "tiny", "--random-weights", "--prompt-len", "15",
                "--max-new-tokens", "1", "--baseline", "torch", "--prefill-reps", "1"])
    for name, r in out["timings"].items():
        assert "error" not in r, (name, r)
        assert r["decode_steps"] == 0
    assert [len(ids) for ids in out["ids"]] == [1] and out["ids_match"] == {"torch": True}
