"""python -m fusedist.generate: --baseline lists (torch, torch-compile, none), the JSON's
per-backend timings (prefill_ms the median of the warm prefills), speedups over each baseline,
the profile of a decode step and of a prefill, and the text report. CPU tier, the tiny config
(torch-compile through the aot_eager backend: inductor would compile C++ for ~20 s)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from statistics import median

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fusedist.generate import _defaults, parse_args, parse_baselines, speedups  # noqa: E402
from launch import ROOT  # noqa: E402

CPU_ENV = {"CUDA_VISIBLE_DEVICES": ""}


def test_parse_baselines():
    assert parse_baselines("torch") == ["torch"]
    assert parse_baselines("torch,torch-compile") == ["torch", "torch-compile"]
    assert parse_baselines(" torch-compile , torch ") == ["torch-compile", "torch"]
    assert parse_baselines("none") == []
    for bad in ("cuda", "torch,torch", "none,torch", "", ",", "torch-compiled"):
        with pytest.raises(SystemExit, match="--baseline takes 'none' or a comma-separated"):
            parse_baselines(bad)


def test_defaults_pick_baselines():
    a = _defaults(parse_args([]), cuda=False)                  # the embedded default
    assert a.config == "tiny" and a.baselines == ["torch"]
    a = _defaults(parse_args(["--config", "tiny", "--random-weights"]), cuda=False)
    assert a.baselines == []
    a = _defaults(parse_args(["--baseline", "torch-compile,torch"]), cuda=False)
    assert a.baselines == ["torch-compile", "torch"]
    with pytest.raises(SystemExit, match="--prefill-reps must be >= 1"):
        _defaults(parse_args(["--prefill-reps", "0"]), cuda=False)


def test_speedups():
    res = {"fusedist": {"ms_per_token": 2.0, "step_ms": 1.0, "prefill_ms": 10.0},
           "torch": {"ms_per_token": 5.0, "step_ms": 3.0, "prefill_ms": 12.0},
           "torch-compile": {"error": "RuntimeError: x"}}
    assert speedups(res) == {"torch": {"per_token": 2.5, "per_step": 3.0, "prefill": 1.2}}
    assert speedups({"fusedist": {"error": "x"}, "torch": res["torch"]}) == {}


def _cli(args, json_out=True, timeout=240):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **CPU_ENV)
    p = subprocess.run([sys.executable, "-P", "-m", "fusedist.generate", *args, "--quiet",
                        "--device", "cpu"] + (["--json"] if json_out else []), env=env,
                       capture_output=True, text=True, timeout=timeout, cwd=ROOT)
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
