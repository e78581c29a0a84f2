"""benchmarks/serve.py's CPU smoke run (the tiny model): every workload writes its row through
the harness's writer, with the columns the design note quotes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from launch import python

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_serve_benchmark_smoke(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1",
               FUSEDIST_RESULTS_DIR=str(tmp_path))
    p = python(["-P", str(ROOT / "benchmarks" / "serve.py"), "--config", "tiny", "--rates", "8",
                "--num-requests", "4", "--prefixes", "1", "--workloads",
                "step,step_sampled,random,prefix,batch64,ttft"], env=env, timeout=280)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    data = json.loads((tmp_path / "cpu-w1" / "serve.json").read_text())
    rows = {r["workload"]: r for r in data["rows"]}
    steps = ("step", "step_overlap", "step_sampled", "step_sampled_overlap")
    assert set(rows) == {*steps, "random", "prefix", "batch64", "ttft"}
    for w in ("random", "prefix", "batch64"):
        r = rows[w]
        assert r["output_tokens"] > 0 and r["tok_s"] > 0
        assert r["itl_p99_ms"] >= r["itl_p50_ms"] > 0 and r["ttft_p99_ms"] >= r["ttft_p50_ms"]
    assert rows["prefix"]["hit_rate"] > 0 and rows["random"]["hit_rate"] == 0
    for w in steps:
        assert rows[w]["engine_step_ms"] > 0 and rows[w]["static_step_ms"] > 0
    assert rows["ttft"]["warm_ms"] > 0 and data["meta"]["command"]
    assert "Decode step at batch" in (tmp_path / "cpu-w1" / "serve.md").read_text()
