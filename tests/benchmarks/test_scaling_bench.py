"""benchmarks/scaling.py on CPU ranks (gloo): 4 ranks as 2 emulated nodes x 2 and 2 ranks on
one node, tiny sizes; every row has nccl-tests' columns, no wrong element, results identical
across ranks where they must be, and the cost model's prediction beside the measurement. The
TP-linear and decode-step rows (tiny config): every TP size, module, scaling and token count,
no wrong element, finite model errors wherever the model predicts."""

from __future__ import annotations

import json
import math
import sys

import pytest

from launch import ROOT, _env, _run

COLUMNS = ("size", "count", "type", "redop", "placement", "time_us", "algbw_GBps",
           "busbw_GBps", "wrong", "model_us", "model_err")


def _scaling(tmp_path, nproc, args):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(nproc),
           str(ROOT / "benchmarks" / "scaling.py"), "--sizes", "1K,5000", "--reps", "1",
           "--ops", "1", "--tokens", "3,8", "--batches", "1,2", "--context", "16", *args]
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
    check_model_rows(d, md, ranks=(1, 2, 4), nodes={1: 1, 2: 1, 4: 2})


@pytest.mark.timeout(450)
def test_scaling_one_node(tmp_path):
    d, md = _scaling(tmp_path, 2, ["--no-fp8"])
    rows = d["rows"]
    assert d["meta"]["nodes"] == 1
    assert {r["algo"] for r in rows if r["group"] == "world"} == {"flat"}
    assert all(r["wrong"] == 0 for r in rows)
    check_model_rows(d, md, ranks=(1, 2), nodes={1: 1, 2: 1})


def check_model_rows(d, md, ranks, nodes):
    """The TP-linear and decode-step rows of a run with --tokens 3,8 --batches 1,2 of the tiny
    config (hidden 256, intermediate 688, 2 layers)."""
    W = max(ranks)
    lin = d["linear_rows"]
    assert {(r["module"], r["scaling"], r["ranks"], r["tokens"]) for r in lin} == {
        (m, s, p, t) for m in ("column", "row") for s in ("strong", "weak") for p in ranks
        for t in (3, 8)}
    assert len(lin) == 2 * 2 * len(ranks) * 2
    for r in lin:
        p, col = r["ranks"], r["module"] == "column"
        split = 2 * 688 if col else 688
        want = split if r["scaling"] == "strong" else split // W * p
        assert (r["out_features"] if col else r["in_features"]) == want, r
        assert (r["in_features"] if col else r["out_features"]) == 256, r
        assert r["nodes"] == nodes[p], r
        assert r["wrong"] == 0 and r["identical"], r
        assert r["time_us"] > 0 and r["gemm_us"] > 0 and r["efficiency"] > 0, r
        if p == 1:
            assert r["collective"] == "none" and r["model_us"] is None, r
            assert r["efficiency"] == 1.0, r
            continue
        assert r["collective"] == ("all_gather" if col else "all_reduce"), r
        assert r["comm_bytes"] == r["tokens"] * r["out_features"] * 4, r
        assert r["comm_us"] > 0 and r["model_us"] > 0, r
        assert math.isfinite(r["model_err"]) and math.isfinite(r["model_call_err"]), r
        if col or r["nodes"] > 1:
            assert r["model_algo"] == "flat", r
    dec = d["decode_rows"]
    assert {(r["ranks"], r["batch"]) for r in dec} == {(p, b) for p in ranks for b in (1, 2)}
    for r in dec:
        assert r["config"] == "tiny" and r["context"] == 16, r
        assert r["wrong"] == 0 and r["step_ms"] > 0, r
        if r["ranks"] == 1:
            assert r["model_us"] is None and r["efficiency"] == 1.0, r
            continue
        assert r["model_us"] > 0 and math.isfinite(r["model_err"]), r
        assert r["model_compute_us"] > 0 and r["model_comm_us"] > 0, r
        assert 0 <= r["logits_rel_err"] < 1e-3, r
    assert "| module | scaling | ranks | nodes | tokens |" in md
    assert "| config | ranks | nodes | batch | context |" in md
