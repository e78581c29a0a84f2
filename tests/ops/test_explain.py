"""One place decides which kernel runs: every op module has the same shape, and
`python -m fusedist.tuning --explain` prints the ops' own plans."""

from __future__ import annotations

import importlib

import pytest
import torch

from fusedist import tuning
from launch import python
from fusedist.ops import explain as E

# Every op module of fusedist.ops: available / why_not / plan / run / reference.
OP_MODULES = [
    "fusedist.ops.add_rmsnorm", "fusedist.ops.silu_mul", "fusedist.ops.quantize_rows",
    "fusedist.ops.gemv", "fusedist.ops.gemm", "fusedist.ops.fp8_gemm", "fusedist.ops.fp8_linear",
    "fusedist.ops.allreduce", "fusedist.ops.allreduce_rmsnorm",
    "fusedist.ops.attention._prefill", "fusedist.ops.attention._decode",
    "fusedist.ops.attention.rope", "fusedist.ops.moe.gating", "fusedist.ops.moe.permute",
    "fusedist.ops.moe.grouped_gemm",
]


@pytest.mark.parametrize("name", OP_MODULES)
def test_every_op_has_the_same_shape(name):
    mod = importlib.import_module(name)
    missing = [f for f in ("available", "why_not", "plan", "run", "reference")
               if not callable(getattr(mod, f, None))]
    assert not missing, f"{name} lacks {missing}"
    assert mod.available(torch.device("cpu")) is False   # kernels are CUDA


def test_cpu_plans_say_why():
    F = importlib.import_module("fusedist.ops.fp8_linear")
    w = F.quantize_fp8(torch.randn(32, 64), "channel")
    p = F.plan(torch.randn(3, 64), w)
    assert p.path == "reference" and "cpu" in p.why
    G = importlib.import_module("fusedist.ops.gemv")
    p = G.plan(torch.randn(2, 64, dtype=torch.bfloat16), torch.randn(8, 64, dtype=torch.bfloat16))
    assert p.path == "reference" and p.why.startswith("tensors on cpu")


@pytest.mark.parametrize("shape, want", [
    ("fp8_linear m=16 n=28672 k=4096", "path: scaled_mm_rowwise"),
    ("fp8_linear m=1 n=4096 k=4096", "path: gemv"),
    ("fp8_linear m=24 n=4096 k=14336", "path: gemv_w8a8"),
    ("fp8_linear m=512 n=4096 k=4096 layout=block", "path: fp8_gemm"),
    ("gemm m=1 k=4096 n=8192 layout=kn", "kernel: decode"),
    ("gemm m=3000 k=4096 n=8192", "kernel: torch"),
    ("decode batch=1 heads=32/8 context=32768", "32 split(s)"),
    ("decode batch=64 heads=32/8 context=8192", "1 split(s)"),
    ("prefill new=128 context=4128", "path: paged kernel"),
    ("prefill new=4096 heads=32/8", "path: sdpa"),
    ("allreduce bytes=65536 world=2", "algorithm: one_shot"),
    ("moe tokens=1 top_k=8", "path: grouped GEMV"),
    ("moe tokens=4096 top_k=8", "path: grouped GEMM"),
    ("allreduce bytes=67108864 world=2", "algorithm: two_shot"),
])
def test_explain_names_the_shipped_choice(shape, want):
    t = E.target("NVIDIA H200", (9, 0))
    text = E.explain(shape, t)
    assert want in text, text


def test_explain_follows_a_tuning_file(monkeypatch, tmp_path):
    f = tmp_path / "t.json"
    f.write_text('{"fp8_linear": {"rowwise_min_m": 17}}')
    monkeypatch.setenv("FUSEDIST_TUNING_FILE", str(f))
    tuning.clear_cache()
    try:
        assert "path: gemv\n" in E.explain("fp8_linear m=16 n=28672 k=4096",
                                           E.target("NVIDIA H200", (9, 0)))
    finally:
        tuning.clear_cache()


@pytest.mark.parametrize("shape, match", [
    ("nope m=1", "start with one of"), ("gemm m=1 k=8", "give n=N"),
    ("gemm m=x n=8 k=8", "m must be a number"), ("fp8_linear m=1 n=8 k=16 layout=row",
                                                 "layout must be one of"),
    ("decode heads=32", "heads must be Q/KV"), ("gemm m=1 n", "is not key=value"),
])
def test_explain_rejects_bad_shapes(shape, match):
    with pytest.raises(ValueError, match=match):
        E.explain(shape, E.target("NVIDIA H200", (9, 0)))


def test_the_command_line():
    r = python(["-m", "fusedist.tuning", "--explain", "fp8_linear m=1 n=4096 k=4096", "--caps"],
               timeout=120)
    assert r.returncode == 0, r.stderr
    assert "path: gemv" in r.stdout and "fusedist._C" in r.stdout
    r = python(["-m", "fusedist.tuning", "--explain", "bad"], timeout=120)
    assert r.returncode == 2 and "start with one of" in r.stdout
