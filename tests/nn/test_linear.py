"""fusedist.nn.linear.linear, the GEMM dispatch of the model layers: F.linear on CPU and for
shapes fusedist.gemm takes no call of; fusedist.gemm (kernel="auto") for CUDA bf16/fp16 with
in / out multiples of 8 (gpu tier, against a float64 reference); TPAttention's qkv and o
projections go through it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tolerances import GEMM_REL, gemm_err  # noqa: E402

import fusedist.nn.attention as nn_attention  # noqa: E402
import fusedist.nn.linear as nn_linear  # noqa: E402
from fusedist.nn import AttentionMetadata, PagedKVCache, TPAttention  # noqa: E402
from fusedist.nn.linear import linear  # noqa: E402


def _gen(device="cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(int(torch.randint(1 << 30, ())))
    return g


def _randn(shape, dtype, device, g):
    return torch.randn(shape, generator=g, device=device, dtype=torch.float32).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_is_f_linear(dtype):
    g = _gen()
    for lead, k, n in (((5,), 24, 40), ((2, 3), 24, 40), ((1,), 7, 13), ((0,), 16, 8)):
        x, w, b = (_randn(lead + (k,), dtype, "cpu", g), _randn((n, k), dtype, "cpu", g),
                   _randn((n,), dtype, "cpu", g))
        for bias in (None, b):
            got = linear(x, w, bias)
            assert got.shape == lead + (n,)
            assert torch.equal(got, F.linear(x, w, bias))


def _attention_step(attn, T, dtype, g):
    cache = attn.make_cache(1, num_pages=8, page_size=16)
    x = _randn((T, attn.hidden_size), dtype, "cpu", g)
    pos = torch.arange(T) + 3
    meta = AttentionMetadata("decode", block_table=torch.arange(T * 2, dtype=torch.int32)
                             .view(T, 2), seq_lens=(pos + 1).to(torch.int32),
                             slot_mapping=torch.arange(T) * 32 + pos)
    return attn, x, pos, cache, meta


@pytest.mark.parametrize("bias", [False, True])
def test_tpattention_projections_use_linear(monkeypatch, bias):
    g = _gen()
    attn = TPAttention(64, 4, 2, 16, qkv_bias=bias, max_position=64, dtype=torch.float32)
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(_randn(p.shape, torch.float32, "cpu", g) * 0.3)
    attn, x, pos, cache, meta = _attention_step(attn, 3, torch.float32, g)
    assert isinstance(cache, PagedKVCache)
    want = attn(x, pos, cache, 0, meta)
    calls = []

    def spy(x_, w_, b_=None):
        calls.append((w_, b_))
        return nn_linear.linear(x_, w_, b_)

    monkeypatch.setattr(nn_attention, "linear", spy)
    got = attn(x, pos, attn.make_cache(1, num_pages=8, page_size=16), 0, meta)
    assert torch.equal(got, want)
    assert [w for w, _ in calls] == [attn.qkv_weight, attn.o_weight]
    assert calls[0][1] is attn.qkv_bias and calls[1][1] is None


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_dispatch(monkeypatch, dtype):
    g = _gen("cuda")
    used = []
    real = nn_linear.gemm
    monkeypatch.setattr(nn_linear, "gemm", lambda *a, **kw: used.append(1) or real(*a, **kw))
    for lead, k, n, fused in (((1,), 4096, 6144, True), ((7,), 256, 520, True),
                              ((3, 65), 512, 1024, True), ((4,), 96, 100, False),
                              ((5,), 100, 64, False)):
        x = _randn(lead + (k,), dtype, "cuda", g)
        w = _randn((n, k), dtype, "cuda", g) * k ** -0.5
        b = _randn((n,), dtype, "cuda", g)
        for bias in (None, b):
            used.clear()
            got = linear(x, w, bias)
            ref = x.double() @ w.double().t() + (0 if bias is None else bias.double())
            assert got.shape == ref.shape and got.dtype == dtype
            assert bool(used) == fused, f"{lead} {k}x{n}: fusedist.gemm used: {bool(used)}"
            err = gemm_err(got, ref)
            assert err <= GEMM_REL[dtype], f"{lead} {k}x{n} bias={bias is not None}: {err:.2e}"


def test_modules_name_a_dtype_mismatch():
    """x in another dtype than the module's weights: one TypeError naming both and the fix
    (it used to surface as torch's "expected m1 and m2 to have the same dtype")."""
    import fusedist
    from fusedist.nn import ColumnParallelLinear, RowParallelLinear

    if not fusedist.is_initialized():
        fusedist.init(backend="gloo", rank=0, world_size=1, local_rank=0, local_world_size=1)
    try:
        col = ColumnParallelLinear.from_full(torch.randn(16, 8))
        row = RowParallelLinear.from_full(torch.randn(16, 8))
        for m, x in ((col, torch.randn(3, 8, dtype=torch.float64)),
                     (row, torch.randn(3, 8, dtype=torch.bfloat16))):
            with pytest.raises(TypeError, match=f"{type(m).__name__}: x is {x.dtype}, this "
                                                "module's weights are torch.float32; pass "
                                                r"x.to\(torch.float32\)"):
                m(x)
        a = TPAttention(64, 4, 2, max_position=16, dtype=torch.float32)
        cache = a.make_cache(1, 4, page_size=4)
        meta = AttentionMetadata("prefill", torch.arange(2, dtype=torch.int32)[None],
                                 torch.tensor([5], dtype=torch.int32), torch.arange(5),
                                 cu_seqlens_q=torch.tensor([0, 5], dtype=torch.int32))
        with pytest.raises(TypeError, match="TPAttention: x is torch.bfloat16"):
            a(torch.randn(5, 64, dtype=torch.bfloat16), torch.arange(5), cache, 0, meta)
        with pytest.raises(ValueError, match=r"seq_lens_host \[7\] disagrees with seq_lens "
                                             r"\[5\]"):
            AttentionMetadata("prefill", torch.arange(2, dtype=torch.int32)[None],
                              torch.tensor([5], dtype=torch.int32), torch.arange(5),
                              cu_seqlens_q=torch.tensor([0, 5], dtype=torch.int32),
                              seq_lens_host=[7])
        for scaling in ({"rope_type": "linear", "factor": 0.0},
                        {"rope_type": "llama3", "factor": -2.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8}):
            with pytest.raises(ValueError, match="TPAttention: rope_scaling factor must be a "
                                                 "finite number > 0"):
                TPAttention(64, 4, 2, max_position=16, rope_scaling=scaling)
    finally:
        fusedist.shutdown()
