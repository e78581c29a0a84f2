"""benchmarks/scaling.py on CPU ranks (gloo): 4 ranks as 2 emulated nodes x 2 and 2 ranks on
one node, tiny sizes; every row has nccl-tests' columns, no wrong element, results identical
across ranks where they must be, and the cost model's prediction beside the measurement."""

from __future__ import annotations

import json
import sys

import pytest

from launch import ROOT, _env, _run, free_port

COLUMNS = ("size", "count", "type", "redop", "placement", "time_us", "algbw_GBps",
           "busbw_GBps", "wrong", "model_us", "model_err")


def _scaling(tmp_path, nproc, args):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           str(ROOT / "benchmarks" / "scaling.py"), "--sizes", "1K,5000", "--reps", "1",
           "--ops", "1", *args]
    p = _run(cmd, _env({"CUDA_VISIBLE_DEVICES": "", "FUSEDIST_RESULTS_DIR": str(tmp_path),
                        "FUSEDIST_INIT_TIMEOUT_S": "60"}), 400)
    assert p.returncode == 0, p.stdout[-4000:]
    out = tmp_path / f"cpu-w{nproc}"
    return json.loads((out / "scaling.json").read_text()), (out / "scaling.md").read_text()


@pytest.mark.timeout(450)
def test_scaling_two_emulated_nodes(tmp_path):
    d, md = _scaling(tmp_path, 4, ["--emulate-nodes", "2"])
    rows = d["rows"]
    assert d["meta"]["nodes"] == 2 and d["meta"]["ranks_per_node"] == 2
    seen = {(r["group"], r["op"], r["algo"], r["placement"]) for r in rows}
    for algo in ("flat", "hierarchical", "auto"):
        for op in ("all_reduce", "all_gather", "reduce_scatter"):
            assert ("world", op, algo, "out-of-place") in seen, (op, algo)
        assert ("world", "all_reduce", algo, "in-place") in seen
    for extra in (("world", "all_reduce_fp8", "two_shot"), ("world", "all_reduce_fp8", "one_shot"),
                  ("world", "all_gather_fp8", "fp8"), ("intra", "all_reduce", "flat"),
                  ("inter", "all_reduce", "flat")):
        assert extra + ("out-of-place",) in seen, extra
    for r in rows:
        assert all(c in r for c in COLUMNS), r
        assert r["wrong"] == 0 and r["identical"], r
        assert r["time_us"] > 0 and r["model_us"] > 0, r
    assert {r["size"] for r in rows} == {1024, 4992}   # 5000 bytes -> a multiple of the world
    assert "| group | op | algo (chosen) | size | count | type | redop | placement |" in md


@pytest.mark.timeout(450)
def test_scaling_one_node(tmp_path):
    d, _ = _scaling(tmp_path, 2, ["--no-fp8"])
    rows = d["rows"]
    assert d["meta"]["nodes"] == 1
    assert {r["algo"] for r in rows if r["group"] == "world"} == {"flat"}
    assert all(r["wrong"] == 0 for r in rows)
