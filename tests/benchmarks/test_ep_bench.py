"""benchmarks/ep.py runs end to end on 2 CPU ranks (--cpu --quick: the gloo path and the
all-to-all baseline) and writes its table with the model's prediction on every row."""

from __future__ import annotations

import json

import pytest

from launch import torchrun


@pytest.mark.timeout(300)
def test_ep_benchmark_smoke(tmp_path):
    p = torchrun("../../benchmarks/ep.py", 2, {"CUDA_VISIBLE_DEVICES": "",
                                                "FUSEDIST_RESULTS_DIR": str(tmp_path)},
                 timeout=280, args=("--cpu", "--quick", "--reps", "2"))
    assert p.returncode == 0, p.stdout[-3000:]
    rows = json.loads((tmp_path / "cpu-w2" / "ep.json").read_text())["rows"]
    assert {r["routing"] for r in rows} == {"balanced", "skewed"}
    for r in rows:
        assert r["mode"] == "high_throughput" and r["model_dispatch_us"] > 0
        assert r["dispatch_us"] > 0 and r["a2a_us"] > 0
