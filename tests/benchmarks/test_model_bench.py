"""benchmarks/model.py on a synthetic fusedist.generate JSON: one row per backend with
fusedist's speedup over each baseline, the step and prefill tables, rows benchmarks/compare.py
pairs (--fusedist fusedist), and --merge of rows measured by separate commands."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


model = _load("fusedist_bench_model", ROOT / "benchmarks" / "model.py")
compare = _load("fusedist_bench_compare_m", ROOT / "benchmarks" / "compare.py")


def _backend(step, prefill):
    prof = {"gemm": 10.0, "attention": 5.0, "communication": 0.0, "other": 1.0, "total": 16.0,
            "top": [["k", 10.0]], "kernels": 3}
    return {"prefill_ms": prefill, "prefill_ms_reps": [prefill] * 3,
            "prefill_tflops_per_gpu": 1.0, "step_ms": step, "ms_per_token": step * 1.1,
            "tokens_per_s": 1.0, "profile_us": dict(prof),
            "prefill_profile_us": dict(prof, wall_us=20.0)}


def _out(fd=2.0, torch_=4.0, compiled=3.0):
    return {"timings": {"fusedist": _backend(fd, 10.0), "torch": _backend(torch_, 12.0),
                        "torch-compile": _backend(compiled, 12.0)}}


def test_rows_and_markdown():
    rows = model.rows_of((1, 16, 0, 8), "cmd", _out())
    assert [r["backend"] for r in rows] == ["fusedist", "torch", "torch-compile"]
    fd, t, c = rows
    assert fd["speedup_vs"] == {"torch": 2.0, "torch-compile": 1.5}
    assert fd["speedup_vs_torch"] == 2.0 and fd["target_step_ms"] == model.TARGETS[1]
    assert t["fusedist_speedup"] == 2.0 and c["fusedist_speedup"] == 1.5
    assert fd["time_us"] == 2000.0 and "top" not in fd["prefill_profile_us"]
    assert fd["prefill_top_kernels_us"] == [["k", 10.0]]
    md = model.markdown(rows, ["torch", "torch-compile"])
    assert "| fusedist vs torch | fusedist vs torch-compile |" in md
    assert "| 1 | 16+8 | fusedist | 10.0 | 1.0 | 2.0 | 2.2 | 1.0 | 2.0 | 1.5 | 3.7 |" in md
    assert "| 1 | 16+8 | torch-compile | 12.0 | 0.02 | 0.01 / 0.01 / 0.00 / 0.00 | 3 |" in md
    # compare.py pairs the rows by case and backend: the step's speedups (and the prefill's)
    doc = {"meta": {}, "rows": rows}
    ms = compare.metrics(doc)
    assert sorted(m["value"] for m in ms if not m["key"].endswith("prefill")) == [1.5, 2.0]
    assert all(m["better"] == "higher" for m in ms)
    assert {m["key"].split(": ")[1] for m in ms} >= {"fusedist vs torch",
                                                     "fusedist vs torch-compile"}


def test_fp8_rows_take_the_fp8_targets():
    """--quantize fp8: the fusedist rows' target is FP8_TARGETS' (batch 64: 10.0 ms)."""
    for quantize, want in (("fp8", 10.0), ("fp8-block", 10.0), ("none", 11.0)):
        rows = model.rows_of((64, 16, 4000, 8), "cmd", _out(), quantize)
        assert rows[0]["target_step_ms"] == model.targets(quantize)[64] == want
        assert rows[1]["target_step_ms"] is None


def test_failed_backend_row():
    out = _out()
    out["timings"]["torch-compile"] = {"error": "RuntimeError: compile"}
    rows = model.rows_of((64, 16, 4000, 8), "cmd", out)
    assert rows[2]["status"] == "failed" and rows[0]["speedup_vs"] == {"torch": 2.0}
    assert "failed: RuntimeError: compile" in model.markdown(rows, ["torch", "torch-compile"])


def test_report_of_a_failed_backend():
    """generate exits 1 when a backend failed, with the report on stdout: the rows keep it."""
    import subprocess

    out = _out()
    out["timings"]["torch-compile"] = {"error": "RuntimeError: compile"}
    done = subprocess.CompletedProcess(["x"], 1, stdout="progress\n" + json.dumps(out) + "\n",
                                       stderr="fusedist.generate: torch-compile failed: ...")
    assert model.report_of(["x"], done) == out
    for code, stdout in ((1, ""), (1, "not json\n"), (2, json.dumps(out)), (-9, "")):
        bad = subprocess.CompletedProcess(["x"], code, stdout=stdout, stderr="boom")
        with pytest.raises(RuntimeError, match=f"exit status {code}"):
            model.report_of(["x"], bad)


def test_merge(tmp_path, monkeypatch):
    monkeypatch.setenv("FUSEDIST_RESULTS_DIR", str(tmp_path))
    meta = {"commit": "abc", "world_size": 1, "command": "python3 model.py --rows 1:16:0:8"}
    first = model.rows_of((1, 16, 0, 8), "c1", _out())
    d = tmp_path / model.machine_dir(meta)
    d.mkdir()
    (d / "model.json").write_text(json.dumps({"meta": meta, "rows": first}))
    second = model.rows_of((64, 16, 4000, 8), "c2", _out())
    again = model.rows_of((1, 16, 0, 8), "c3", _out(fd=1.0))
    new_meta = {"commit": "abc", "world_size": 1, "command": "python3 model.py --rows 64"}
    rows = model.merged(second + again, new_meta)
    assert [(r["batch"], r["command"]) for r in rows] == [(64, "c2")] * 3 + [(1, "c3")] * 3
    assert new_meta["command"] == "python3 model.py --rows 1:16:0:8 && python3 model.py --rows 64"
    with pytest.raises(SystemExit, match="holds rows of commit abc"):
        model.merged(second, {"commit": "def", "world_size": 1, "command": "x"})


def test_ttft_table():
    rows = []
    for L, fill, fd, tq in ((128, 4000, 5.0, 20.0), (1, 0, 2.0, 3.0)):
        out = {"timings": {"fusedist": _backend(1.0, fd), "torch": _backend(2.0, tq)}}
        rows += model.rows_of((1, L, fill, 2), "cmd", out)
    for r in rows:
        if r["backend"] == "fusedist":
            r["prefill_graphs"] = 512
    md = model.ttft_markdown(rows)
    lines = md.splitlines()
    assert lines[0] == "| prompt tokens | cached | fusedist ms | torch ms | fusedist vs torch " \
                       "| prefill graphs |"
    # sorted by cached tokens, then prompt length
    assert lines[2] == "| 1 | 0 | 2.0 | 3.0 | 1.50x | 512 |"
    assert lines[3] == "| 128 | 4000 | 5.0 | 20.0 | 4.00x | 512 |"
    assert model.stem("none", ttft=True) == "model-ttft"
    assert model.stem("fp8", ttft=True) == "model-ttft-fp8"
    assert [tuple(map(int, s.split(":"))) for s in model.TTFT_ROWS][4] == (1, 128, 4000, 2)


def test_moe_rows_targets_and_stems():
    """The mixture-of-experts runs: each (config, weights) its own file and targets; the
    batch-1 fusedist row carries the 1.5x-torch.compile target; Llama's stay as they were."""
    assert model.stem("none", config="qwen3-30b-a3b") == "model-qwen3-30b-a3b"
    assert model.stem("fp8", config="mixtral-8x7b") == "model-mixtral-8x7b-fp8"
    assert model.stem("fp8") == "model-fp8" and model.stem() == "model"
    assert [(c, q) for c, q in model.MOE_RUNS] == [("qwen3-30b-a3b", "none"),
                                                  ("qwen3-30b-a3b", "fp8"),
                                                  ("mixtral-8x7b", "fp8")]
    for (config, quantize), b1, b64 in ((("qwen3-30b-a3b", "none"), 2.0, None),
                                        (("qwen3-30b-a3b", "fp8"), 1.4, 9.0),
                                        (("mixtral-8x7b", "fp8"), 3.4, None)):
        one = model.rows_of((1, 4096, 0, 64), "cmd", _out(), quantize, config)
        many = model.rows_of((64, 16, 4000, 32), "cmd", _out(), quantize, config)
        assert one[0]["target_step_ms"] == b1 and many[0]["target_step_ms"] == b64
        assert one[0]["target_vs_compile"] == model.MOE_VS_COMPILE == 1.5
        assert many[0]["target_vs_compile"] is None and one[2]["target_vs_compile"] is None
        assert "at batch 1 fusedist >= 1.5x torch.compile" in model.target_text(quantize, config)
    llama = model.rows_of((1, 16, 0, 8), "cmd", _out())
    assert llama[0]["target_vs_compile"] is None and llama[0]["target_step_ms"] == 3.7
    assert model.target_text("none", "llama-3-8b").startswith(
        "Targets: step ms at batch 1 <= 3.7, batch 64 <= 11.0; prefill of 4K tokens >= ")
    assert model.target_text("none", "tiny-moe") == "No targets for tiny-moe with these weights."
    assert model.rows_of((1, 16, 0, 8), "cmd", _out(), "none", "tiny-moe")[0][
        "target_vs_compile"] is None
