"""benchmarks/moe.py's CPU-checkable parts: the flags (--quick --what gating,permute, unknown
parts refused) and its torch baselines, which must compute what fusedist's ops compute (the
Hugging Face routing with torch.topk, index_select permute with per-row / per-128 FP8,
index_add_ unpermute) so the timings compare the same work."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


bench = _load("fusedist_bench_moe", ROOT / "benchmarks" / "moe.py")
from fusedist.ops import moe  # noqa: E402


def test_flags():
    a = bench.parse(["--quick", "--what", "gating,permute"])
    assert a.what == ["gating", "permute"] and a.tokens == [1, 16, 4096]
    assert a.routing == ["balanced"] and a.models == list(bench.QUICK_MODELS)
    a = bench.parse(["--models", "mixtral-8x7b", "--tokens", "3,5", "--routing", "skewed"])
    assert a.models == ["mixtral-8x7b"] and a.tokens == [3, 5] and a.routing == ["skewed"]
    for bad in (["--what", "gemm,nope"], ["--models", "llama"], ["--routing", "even"],
                ["--tokens", "0"], ["--align", "0"]):
        with pytest.raises(SystemExit):
            bench.parse(bad)


@pytest.mark.parametrize("model", list(bench.MODELS))
def test_torch_baselines_compute_the_same(model):
    E, k, _, kw, has_bias = bench.MODELS[model]
    spec = moe.RouterSpec(k, **kw)
    T, Hd = 37, 256
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    # continuous values: torch.topk breaks exact ties its own way, the scores are the same
    x = torch.randn(T, E, generator=g) * 2
    bias = torch.randn(E, generator=g) * 0.25 if has_bias else None
    ids, w = bench.torch_route(x, spec, bias)
    r_ids, r_w = moe.route_reference(x, spec, bias)
    assert torch.equal(ids.int(), r_ids)
    assert torch.allclose(w, r_w, rtol=1e-6, atol=0)
    ids2, w2, src, dest = bench.torch_route_sort(x, spec, bias, 8)
    lay = moe.sort_by_expert(r_ids, E, 8)
    assert torch.equal(src.int(), lay.src_index) and torch.equal(dest.int(), lay.dest_index)
    h = torch.randn(T, Hd, generator=g).to(torch.bfloat16)
    assert torch.equal(bench.torch_permute(h, lay.src_index, k), moe.permute(h, lay))
    if hasattr(torch, "float8_e4m3fn"):
        for quant in ("token", "group"):
            q, s = bench.torch_permute_fp8(h, lay.src_index, k, quant == "group")
            q2, s2 = moe.permute(h, lay, quant=quant)
            assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s, s2)
    y = torch.randn(lay.rows, Hd, generator=g)
    r = torch.randn(T, Hd, generator=g)
    r0 = r.clone()
    got = bench.torch_unpermute(y, lay.dest_index, r_w, r)
    assert torch.equal(r, r0)                                  # the residual is not written
    assert torch.allclose(got, moe.unpermute(y, lay, r_w, residual=r), rtol=1e-5, atol=1e-5)
