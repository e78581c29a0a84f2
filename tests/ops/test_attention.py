"""fusedist.ops.attention: rope_cos_sin / rope_append / decode / prefill against float64
references built from the unpaged K/V (so page indexing is tested too), over shuffled page
tables whose unused pages, unused slots and unused table entries are NaN-poisoned. CPU cases run
everywhere; the same cases run on CUDA under the gpu marker (the kernels, or the torch paths
where no kernel applies)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tolerances import GEMM_REL, TOL, count_bad, rare_count_bound  # noqa: E402

import fusedist  # noqa: E402
from fusedist.ops import attention as A  # noqa: E402

FP8 = getattr(torch, "float8_e4m3fn", None)
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _gen(device) -> torch.Generator:
    """A generator with a fresh seed: new inputs on every run (the seed is in failures)."""
    g = torch.Generator(device=device)
    g.manual_seed(int(torch.randint(1 << 30, ())))
    return g


def _randn(shape, dtype, device, gen, scale=1.0):
    return (torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * scale).to(dtype)


# ------------------------------------------------------------------------------------------------
# paged caches from contiguous per-sequence K/V
# ------------------------------------------------------------------------------------------------

def _quant(x):
    """float64 -> (e4m3, float32 scale) per token-head; returns also the dequantized float64."""
    q, s = A.quantize_fp8_reference(x)
    return q, s, q.double() * s.double()[..., None]


def build_paged(ks, vs, page_size, cache_dtype, device, gen, spare_pages=3, width_extra=2):
    """Scatter sequences' K/V ([L, H, D] float tensors) into shuffled pages of a NaN-poisoned
    cache. Returns (k_cache, v_cache, k_scale, v_scale, block_table, seq_lens, k_ref, v_ref):
    k_ref/v_ref are float64 per sequence, the values the cache represents (dequantized for
    FP8). The table's entries past each sequence's pages point at random (poisoned) pages."""
    H, D = ks[0].shape[1], ks[0].shape[2]
    need = [-(-k.shape[0] // page_size) for k in ks]
    total = sum(need) + spare_pages
    perm = torch.randperm(total, generator=torch.Generator().manual_seed(
        int(torch.randint(1 << 30, ()))))
    fp8 = FP8 is not None and cache_dtype == FP8
    kc = torch.full((total, page_size, H, D), float("nan"), device=device).to(cache_dtype)
    vc = torch.full_like(kc, float("nan"))
    ksc = torch.full((total, page_size, H), float("nan"), device=device) if fp8 else None
    vsc = torch.full_like(ksc, float("nan")) if fp8 else None
    width = max(need) + width_extra
    bt = torch.randint(0, total, (len(ks), width), generator=torch.Generator().manual_seed(7),
                       dtype=torch.int32)
    k_ref, v_ref = [], []
    at = 0
    for b, (k, v) in enumerate(zip(ks, vs)):
        L = k.shape[0]
        pages = perm[at:at + need[b]]
        at += need[b]
        bt[b, :need[b]] = pages.to(torch.int32)
        slots = (pages.repeat_interleave(page_size) * page_size +
                 torch.arange(page_size).repeat(need[b]))[:L].to(device)
        refs = []
        for src, cache, sc in ((k, kc, ksc), (v, vc, vsc)):
            if fp8:
                qv, s, deq = _quant(src.to(device))
                cache.view(-1, H, D)[slots] = qv
                sc.view(-1, H)[slots] = s
                refs.append(deq)
            else:
                cache.view(-1, H, D)[slots] = src.to(device).to(cache_dtype)
                refs.append(src.to(device).to(cache_dtype).double())
        k_ref.append(refs[0])
        v_ref.append(refs[1])
    seq_lens = torch.tensor([k.shape[0] for k in ks], dtype=torch.int32, device=device)
    return kc, vc, ksc, vsc, bt.to(device), seq_lens, k_ref, v_ref


def bad_rows(out, ref, dtype) -> int:
    """Head vectors [.., D] of out whose relative L2 error exceeds GEMM_REL[dtype] (or that hold
    a non-finite value). For paths that round the softmax probabilities to the input dtype
    before P @ V (flash-style kernels, SDPA), whose error is relative to a row's magnitude, not
    to each element (as in a GEMM's sums of products)."""
    o, r = out.double().flatten(0, -2), ref.double().flatten(0, -2)
    err = (o - r).norm(dim=-1) / r.norm(dim=-1).clamp_min(1e-30)
    ok = (err <= GEMM_REL[dtype]) & torch.isfinite(o).all(-1)
    return int((~ok).sum())


def count_wrong(out, ref, dtype, exact_path: bool) -> int:
    """fp32-accumulating reference paths: elementwise TOL (one rounding of the output);
    kernels and SDPA: bad_rows."""
    return count_bad(out, ref, dtype) if exact_path else bad_rows(out, ref, dtype)


def naive_attention(q, k, v, scale, offset):
    """float64: q [n, Hq, D], k/v [L, Hkv, D]; query i sees keys [0, offset + i]."""
    n, Hq, D = q.shape
    L, Hkv, _ = k.shape
    if L == 0:
        return torch.zeros(n, Hq, D, dtype=torch.float64, device=q.device)
    rep = Hq // Hkv
    kk = k.double().repeat_interleave(rep, dim=1)
    vv = v.double().repeat_interleave(rep, dim=1)
    s = torch.einsum("nhd,lhd->hnl", q.double(), kk) * scale
    allowed = torch.arange(L, device=q.device)[None, :] <= \
        (offset + torch.arange(n, device=q.device))[:, None]
    s = s.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", torch.softmax(s, -1), vv)


# ------------------------------------------------------------------------------------------------
# RoPE
# ------------------------------------------------------------------------------------------------

def test_rope_inv_freq_matches_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    for base, D, scaling in ((500000.0, 128, LLAMA3), (10000.0, 64, dict(LLAMA3, factor=32.0,
                                                                      high_freq_factor=2.0)),
                             (10000.0, 128, {"rope_type": "linear", "factor": 4.0})):
        cfg = LlamaConfig(hidden_size=D * 4, num_attention_heads=4, head_dim=D,
                          rope_theta=base, rope_scaling=dict(scaling),
                          max_position_embeddings=131072)
        hf, _ = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](cfg, "cpu")
        ours = A.rope_inv_freq(D, base, scaling)
        assert torch.allclose(ours, hf.double(), rtol=1e-6, atol=0), (scaling, ours - hf)


def _rope64(x, pos, inv, style):
    """float64 rotation as complex multiplication, independent of the op's formulation."""
    x = x.double()
    D = x.shape[-1]
    rd = 2 * inv.numel()
    ang = pos.double()[:, None] * inv.double()[None, :]           # [T, rd/2]
    rot = torch.polar(torch.ones_like(ang), ang)[:, None, :]
    r = x[..., :rd]
    if style == "neox":
        z = torch.complex(r[..., :rd // 2], r[..., rd // 2:]) * rot
        out = torch.cat([z.real, z.imag], -1)
    else:
        z = torch.complex(r[..., 0::2], r[..., 1::2]) * rot
        out = torch.stack([z.real, z.imag], -1).flatten(-2)
    return torch.cat([out, x[..., rd:]], -1) if rd < D else out


def test_rope_cos_sin_layout():
    cs = A.rope_cos_sin(64, 1000, 10000.0, LLAMA3)
    inv = A.rope_inv_freq(64, 10000.0, LLAMA3)
    assert cs.shape == (1000, 64) and cs.dtype == torch.float32
    ang = torch.arange(1000, dtype=torch.float64)[:, None] * inv
    assert torch.allclose(cs[:, :32].double(), ang.cos(), atol=1e-7)
    assert torch.allclose(cs[:, 32:].double(), ang.sin(), atol=1e-7)


def _fused_qkv(T, Hq, Hkv, D, dtype, device, gen, scale=1.0):
    """q, k, v as slices of one fused [T, (Hq + 2 Hkv) D] projection output."""
    qkv = _randn((T, (Hq + 2 * Hkv) * D), dtype, device, gen, scale)
    return (qkv[:, :Hq * D].view(T, Hq, D), qkv[:, Hq * D:(Hq + Hkv) * D].view(T, Hkv, D),
            qkv[:, (Hq + Hkv) * D:].view(T, Hkv, D))


def _poisoned_cache(pages, page_size, Hkv, D, cache_dtype, device):
    """NaN-filled k / v caches (and, for FP8, NaN scales: else None)."""
    kc = torch.full((pages, page_size, Hkv, D), float("nan"), device=device).to(cache_dtype)
    vc = torch.full_like(kc, float("nan"))
    fp8 = FP8 is not None and cache_dtype == FP8
    ksc = torch.full((pages, page_size, Hkv), float("nan"), device=device) if fp8 else None
    vsc = torch.full_like(ksc, float("nan")) if fp8 else None
    return kc, vc, ksc, vsc


def _rope_case(device, T, Hq, Hkv, D, style, scaling, dtype, cache_dtype, page_size, gen,
               rotary_dim=None, positions_dtype=torch.int64, pad_tokens=0, strided=False):
    max_pos = 9000
    cs = A.rope_cos_sin(D, max_pos, 500000.0, scaling, device=device, rotary_dim=rotary_dim)
    inv = A.rope_inv_freq(rotary_dim or D, 500000.0, scaling)
    if strided:
        q, k, v = _fused_qkv(T, Hq, Hkv, D, dtype, device, gen)
    else:
        q = _randn((T, Hq, D), dtype, device, gen)
        k = _randn((T, Hkv, D), dtype, device, gen)
        v = _randn((T, Hkv, D), dtype, device, gen)
    pos = torch.randint(0, max_pos, (T,), generator=gen, device=device).to(positions_dtype)
    num_pages = -(-T // page_size) + 2
    perm = torch.randperm(num_pages * page_size, generator=gen, device=device)
    slots = perm[:T].clone()
    if pad_tokens:
        slots[-pad_tokens:] = -1
    kc, vc, ksc, vsc = _poisoned_cache(num_pages, page_size, Hkv, D, cache_dtype, device)
    fp8 = ksc is not None
    q0, k0, v0 = q.clone(), k.clone(), v.clone()
    A.rope_append(q, k, v, pos, cs, kc, vc, slots, style=style, k_scale=ksc, v_scale=vsc)
    what = f"T={T} {Hq}/{Hkv}x{D} {style} {scaling and scaling['rope_type']} {dtype} {cache_dtype}"
    q_ref = _rope64(q0.cpu(), pos.cpu(), inv, style).to(device)
    k_ref = _rope64(k0.cpu(), pos.cpu(), inv, style).to(device)
    assert count_bad(q, q_ref, dtype) == 0, f"{what}: q has {count_bad(q, q_ref, dtype)} bad"
    assert count_bad(k, k_ref, dtype) == 0, f"{what}: k has {count_bad(k, k_ref, dtype)} bad"
    assert torch.equal(v, v0), f"{what}: v changed"
    live = slots >= 0
    written = torch.zeros(num_pages * page_size, dtype=torch.bool, device=device)
    written[slots[live]] = True
    fk, fv = kc.view(-1, Hkv, D), vc.view(-1, Hkv, D)
    untouched = fk[~written].float()
    assert bool(untouched.isnan().all()) and bool(fv[~written].float().isnan().all()), \
        f"{what}: slots outside slot_mapping were written"
    if fp8:
        assert bool(ksc.view(-1, Hkv)[~written].isnan().all()), f"{what}: stray scale writes"
        for cache, sc, src in ((fk, ksc, k), (fv, vsc, v)):
            ref = src[live].double()
            s = sc.view(-1, Hkv)[slots[live]]
            exp = ref.abs().amax(-1) / 448.0
            assert torch.allclose(s.double(), exp, rtol=1e-6, atol=0), f"{what}: fp8 scales"
            deq = cache[slots[live]].double() * s.double()[..., None]
            # e4m3 keeps 3 mantissa bits: half a step is 2^-4 relative; subnormals step
            # 2^-9 * 448 * scale / 448 absolute.
            ok = (deq - ref).abs() <= 0.0625 * ref.abs() + s.double()[..., None] * 2**-6
            assert bool(ok.all()), f"{what}: {int((~ok).sum())} fp8 cache elements off"
    else:
        assert torch.equal(fk[slots[live]], k[live]), f"{what}: k cache != rotated k"
        assert torch.equal(fv[slots[live]], v[live]), f"{what}: v cache != v"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("style", ["neox", "gptj"])
@pytest.mark.parametrize("scaling", [None, LLAMA3], ids=["plain", "llama3"])
def test_rope_append(device, style, scaling):
    gen = _gen(device)
    dtypes = (torch.bfloat16, torch.float16) + ((torch.float32,) if device == "cpu" else ())
    for dtype in dtypes:
        for T, Hq, Hkv, D, ps in ((1, 32, 8, 128, 16), (19, 28, 4, 64, 64), (99, 8, 8, 256, 16),
                                  (7, 14, 2, 128, 256)):
            _rope_case(device, T, Hq, Hkv, D, style, scaling, dtype, dtype, ps, gen)
    # partial rotary, int32 positions, padding tokens (slot -1), a strided fused-QKV input
    _rope_case(device, 33, 8, 2, 128, style, scaling, torch.bfloat16, torch.bfloat16, 16, gen,
               rotary_dim=64, positions_dtype=torch.int32, pad_tokens=5)
    _rope_case(device, 17, 16, 4, 128, style, scaling, torch.bfloat16, torch.bfloat16, 16, gen,
               strided=True)


@pytest.mark.skipif(FP8 is None, reason="torch without float8_e4m3fn")
@pytest.mark.parametrize("device", DEVICES)
def test_rope_append_fp8(device):
    gen = _gen(device)
    for style in ("neox", "gptj"):
        for dtype in (torch.bfloat16, torch.float16):
            for T, Hq, Hkv, D, ps in ((1, 32, 8, 128, 16), (37, 8, 1, 64, 64),
                                      (5, 16, 8, 256, 16)):
                _rope_case(device, T, Hq, Hkv, D, style, LLAMA3, dtype, FP8, ps, gen,
                           pad_tokens=1 if T > 1 else 0)


# Head norms (Qwen3's q_norm / k_norm) fused into rope_append. The op rounds the normalized
# head to q's dtype before rotating it; the float64 reference does the same rounding, so the
# two agree to TOL except where the op's float32 norm (sum of squares, rsqrt: ~2^-22 relative)
# and the float64 one straddle a rounding boundary of the intermediate, which then differs by
# one ulp (<= 2^-7 |n| in bf16, 2^-10 in fp16, 2^-23 in fp32). Such a flip moves a rotated
# element by at most ulp(n_i) + ulp(n_partner) <= 2 ulp_rel max|n| over the head: every
# element stays within TOL plus that, and flips are rare (probability ~ 2^-22 / ulp_rel per
# element, below 1e-3): the count of elements leaving TOL alone is at most a Binomial(n, 1e-3)
# draw, held to its 1e-6 tail (tolerances.rare_count_bound: 7 of 512 at T = 1, 65 of 33792).
ULP_REL = {torch.bfloat16: 2**-7, torch.float16: 2**-10, torch.float32: 2**-23}


def _norm64(x, w, eps, dtype):
    x = x.double()
    n = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()
    return n.to(dtype)


def _check_normed(got, ref, n, dtype, what):
    rtol, atol = TOL[dtype]
    g, r = got.double(), ref.double()
    err = (g - r).abs()
    strict = err <= atol + rtol * r.abs()
    flip = 2 * ULP_REL[dtype] * n.double().abs().amax(-1, keepdim=True)
    loose = err <= atol + rtol * r.abs() + flip
    assert bool(torch.isfinite(g).all()), f"{what}: non-finite values"
    assert bool(loose.all()), f"{what}: {int((~loose).sum())} elements past TOL + a flip"
    assert int((~strict).sum()) <= rare_count_bound(got.numel(), 1e-3), \
        f"{what}: {int((~strict).sum())} of {got.numel()} elements outside TOL"


@pytest.mark.parametrize("device", DEVICES)
def test_rope_append_head_norm(device):
    """rope_append with q_norm / k_norm against float64 (normalize, round, rotate): strided
    q / k / v of one fused QKV output as the attention module passes them, float32 and
    model-dtype weights, partial rotary (the unrotated tail is normalized too), bf16 and FP8
    caches holding the normalized, rotated keys."""
    gen = _gen(device)
    dtypes = (torch.bfloat16, torch.float16) + ((torch.float32,) if device == "cpu" else ())
    cases = ((1, 32, 4, 128, None), (19, 8, 2, 64, None), (7, 16, 8, 256, None),
             (33, 8, 2, 128, 64))
    caches = [None] + ([FP8] if FP8 is not None else [])
    for dtype in dtypes:
        for (T, Hq, Hkv, D, rd), cache_dtype, w_dtype in zip(
                cases, caches * 2, (torch.float32, dtype, torch.float32, dtype)):
            if cache_dtype is not None and dtype == torch.float32:
                cache_dtype = None
            cache_dtype = cache_dtype or dtype
            eps = 1e-6
            cs = A.rope_cos_sin(D, 4096, 1e6, None, device=device, rotary_dim=rd)
            inv = A.rope_inv_freq(rd or D, 1e6, None)
            q, k, v = _fused_qkv(T, Hq, Hkv, D, dtype, device, gen, scale=3.0)
            qw = (torch.rand(D, generator=gen, device=device) + 0.5).to(w_dtype)
            kw = (torch.rand(D, generator=gen, device=device) + 0.5).to(w_dtype)
            pos = torch.randint(0, 4096, (T,), generator=gen, device=device)
            ps = 16
            pages = -(-T // ps) + 1
            slots = torch.randperm(pages * ps, generator=gen, device=device)[:T].clone()
            kc, vc, ksc, vsc = _poisoned_cache(pages, ps, Hkv, D, cache_dtype, device)
            fp8 = ksc is not None
            q0, k0, v0 = q.clone(), k.clone(), v.clone()
            A.rope_append(q, k, v, pos, cs, kc, vc, slots, k_scale=ksc, v_scale=vsc,
                          q_norm=qw, k_norm=kw, norm_eps=eps)
            what = f"T={T} {Hq}/{Hkv}x{D} rot {rd or D} {dtype} w {w_dtype} cache {cache_dtype}"
            for name, x0, w, got in (("q", q0, qw, q), ("k", k0, kw, k)):
                n = _norm64(x0.cpu(), w.cpu(), eps, dtype)
                ref = _rope64(n, pos.cpu(), inv, "neox")
                _check_normed(got.cpu(), ref, n, dtype, f"{what} {name}")
            assert torch.equal(v, v0), f"{what}: v changed"
            fk = kc.view(-1, Hkv, D)[slots]
            if fp8:
                deq = fk.double() * ksc.view(-1, Hkv)[slots].double()[..., None]
                ok = (deq - k.double()).abs() <= 0.0625 * k.double().abs() + 1e-3
                assert bool(ok.all()), f"{what}: fp8 k cache != the normalized, rotated k"
            else:
                assert torch.equal(fk, k), f"{what}: k cache != the normalized, rotated k"


def test_rope_append_head_norm_bad_inputs():
    q, k = torch.zeros(3, 4, 64), torch.zeros(3, 2, 64)
    cs = A.rope_cos_sin(64, 100)
    kc = torch.zeros(4, 16, 2, 64)
    pos = slots = torch.zeros(3, dtype=torch.int64)
    w = torch.ones(64)
    cases = ((dict(q_norm=w), "both head-norm weights or neither"),
             (dict(q_norm=w, k_norm=torch.ones(32)), r"k_norm must be a \[64\]"),
             (dict(q_norm=w, k_norm=w.double()), "float32 or q's dtype"),
             (dict(q_norm=w, k_norm=w, norm_eps=0.0), "norm_eps must be a finite number > 0"),
             (dict(q_norm=w, k_norm=w, norm_eps=float("nan")), "norm_eps"))
    for kw, match in cases:
        with pytest.raises(ValueError, match=match):
            A.rope_append(q, k, k.clone(), pos, cs, kc, kc.clone(), slots, **kw)


def test_rope_append_bad_inputs():
    q = torch.zeros(3, 4, 64)
    k = torch.zeros(3, 2, 64)
    cs = A.rope_cos_sin(64, 100)
    kc = torch.zeros(4, 16, 2, 64)
    pos = torch.zeros(3, dtype=torch.int64)
    slots = torch.zeros(3, dtype=torch.int64)
    cases = (
        (dict(style="rotate"), "style must be"),
        (dict(slot_mapping=slots.int()), "slot_mapping must be int64"),
        (dict(positions=pos[:2]), "positions must be"),
        (dict(cos_sin=cs.double()), "cos_sin must be"),
        (dict(k_cache=torch.zeros(4, 16, 3, 64)), "v_cache"),
        (dict(k_cache=torch.zeros(4, 16, 3, 64), v_cache=torch.zeros(4, 16, 3, 64)),
         "does not fit the cache"),
    )
    for kw, match in cases:
        args = dict(q=q, k=k, v=k.clone(), positions=pos, cos_sin=cs, k_cache=kc,
                    v_cache=kc.clone(), slot_mapping=slots)
        style = kw.pop("style", "neox")
        args.update(kw)
        with pytest.raises(ValueError, match=match):
            A.rope_append(**args, style=style)


# ------------------------------------------------------------------------------------------------
# decode
# ------------------------------------------------------------------------------------------------

def _decode_case(device, lens, Hq, Hkv, D, ps, dtype, cache_dtype, gen, plan=True):
    ks = [_randn((L, Hkv, D), torch.float32, device, gen) for L in lens]
    vs = [_randn((L, Hkv, D), torch.float32, device, gen) for L in lens]
    kc, vc, ksc, vsc, bt, sl, k_ref, v_ref = build_paged(ks, vs, ps, cache_dtype, device, gen)
    B = len(lens)
    q = _randn((B, Hq, D), dtype, device, gen)
    out = torch.full_like(q, float("nan"))
    p = A.decode_plan(B, Hq, Hkv, D, ps, max(lens), device, dtype, cache_dtype) if plan else None
    scale = 1 / math.sqrt(D)
    got = A.decode(q, kc, vc, bt, sl, p, out=out, k_scale=ksc, v_scale=vsc)
    assert got is out
    ref = torch.stack([naive_attention(q[b:b + 1], k_ref[b], v_ref[b], scale, lens[b] - 1)[0]
                       for b in range(B)])
    bad = count_wrong(out, ref, dtype, p is None and device == "cpu" or
                      (p is not None and p.backend == "reference"))
    assert bad == 0, (f"decode lens={lens} {Hq}/{Hkv}x{D} ps={ps} {dtype}/{cache_dtype}: "
                      f"{bad} of {out.numel()} wrong (backend {p.backend if p else 'none'})")
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("page_size", [16, 64, 256])
def test_decode_page_sizes_mixed_lengths(device, page_size):
    gen = _gen(device)
    for dtype in (torch.bfloat16, torch.float16):
        _decode_case(device, [1, 17, 300, 4097, 255, 256, 257], 32, 8, 128, page_size, dtype,
                     dtype, gen)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("gqa", [1, 4, 7, 8])
def test_decode_head_dims_gqa(device, head_dim, gqa):
    gen = _gen(device)
    Hkv = 2
    _decode_case(device, [33, 1, 129, 1000], gqa * Hkv, Hkv, head_dim, 16, torch.bfloat16,
                 torch.bfloat16, gen)


@pytest.mark.parametrize("device", DEVICES)
def test_decode_long_contexts(device):
    gen = _gen(device)
    _decode_case(device, [4095, 32769, 1], 4, 1, 64, 64, torch.bfloat16, torch.bfloat16, gen)


@pytest.mark.skipif(FP8 is None, reason="torch without float8_e4m3fn")
@pytest.mark.parametrize("device", DEVICES)
def test_decode_fp8(device):
    gen = _gen(device)
    for dtype in (torch.bfloat16, torch.float16):
        for Hq, Hkv, D, ps in ((32, 8, 128, 16), (28, 4, 64, 64), (8, 1, 256, 256)):
            _decode_case(device, [1, 17, 700, 2049], Hq, Hkv, D, ps, dtype, FP8, gen)


@pytest.mark.parametrize("device", DEVICES)
def test_decode_zero_length_and_no_plan(device):
    gen = _gen(device)
    ks = [_randn((L, 2, 64), torch.float32, device, gen) for L in (0, 5)]
    vs = [_randn((L, 2, 64), torch.float32, device, gen) for L in (0, 5)]
    kc, vc, _, _, bt, sl, k_ref, v_ref = build_paged(ks, vs, 16, torch.bfloat16, device, gen)
    q = _randn((2, 8, 64), torch.bfloat16, device, gen)
    out = A.decode(q, kc, vc, bt, sl)
    assert bool((out[0] == 0).all()), "a sequence of length 0 must give zeros"
    ref = naive_attention(q[1:], k_ref[1], v_ref[1], 1 / 8, 4)
    assert count_wrong(out[1:], ref, torch.bfloat16, device == "cpu") == 0


def test_closed_plan_is_refused():
    """A closed plan releases its workspace and is refused, eager and under torch.compile,
    instead of planning anew or reading freed memory."""
    kc = torch.randn(4, 16, 2, 64).to(torch.bfloat16)
    q = torch.randn(3, 8, 64).to(torch.bfloat16)
    bt = torch.zeros(3, 2, dtype=torch.int32)
    sl = torch.ones(3, dtype=torch.int32)
    plan = A.decode_plan(3, 8, 2, 64, 16, 32)
    out = A.decode(q, kc, kc, bt, sl, plan)
    assert not plan.closed and bool(torch.isfinite(out).all())
    plan.close()
    assert plan.closed and plan.o_partial is None and plan.num_splits == 0
    with pytest.raises(ValueError, match="plan was closed"):
        A.decode(q, kc, kc, bt, sl, plan)
    f = torch.compile(lambda q: A.decode(q, kc, kc, bt, sl, plan), fullgraph=True)
    with pytest.raises(Exception, match="plan was closed"):
        f(q)


def test_decode_bad_inputs():
    kc = torch.zeros(4, 16, 2, 64, dtype=torch.bfloat16)
    q = torch.zeros(3, 8, 64, dtype=torch.bfloat16)
    bt = torch.zeros(3, 2, dtype=torch.int32)
    sl = torch.ones(3, dtype=torch.int32)
    with pytest.raises(ValueError, match="block_table must be int32"):
        A.decode(q, kc, kc, bt.long(), sl)
    with pytest.raises(ValueError, match="seq_lens must be int32"):
        A.decode(q, kc, kc, bt, sl[:2])
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        A.decode(torch.zeros(3, 7, 64, dtype=torch.bfloat16), kc, kc, bt, sl)
    with pytest.raises(ValueError, match="q's dtype"):
        A.decode(q.half(), kc, kc, bt, sl)
    with pytest.raises(ValueError, match="does not fit this call"):
        A.decode(q, kc, kc, bt, sl, A.decode_plan(3, 8, 2, 128, 16, 64))
    if FP8 is not None:
        with pytest.raises(ValueError, match="needs k_scale"):
            A.decode(q, kc.to(FP8), kc.to(FP8), bt, sl)


# ------------------------------------------------------------------------------------------------
# prefill
# ------------------------------------------------------------------------------------------------

def _prefill_case(device, chunks, Hq, Hkv, D, ps, dtype, cache_dtype, backend, gen,
                  host=False):
    """chunks: (new tokens n, cached tokens L incl. the new ones) per sequence."""
    ks = [_randn((L, Hkv, D), torch.float32, device, gen) for _, L in chunks]
    vs = [_randn((L, Hkv, D), torch.float32, device, gen) for _, L in chunks]
    kc, vc, ksc, vsc, bt, sl, k_ref, v_ref = build_paged(ks, vs, ps, cache_dtype, device, gen)
    ns = [n for n, _ in chunks]
    cu = torch.tensor([0] + list(torch.tensor(ns).cumsum(0)), dtype=torch.int32, device=device)
    T = sum(ns)
    q = _randn((T, Hq, D), dtype, device, gen)
    out = torch.full_like(q, float("nan"))
    A.prefill(q, kc, vc, bt, sl, cu, out=out, max_q_len=max(ns), k_scale=ksc, v_scale=vsc,
              backend=backend)
    if len(chunks) == 1 or host:   # out=None (one sequence: SDPA's own output), host lengths
        got = A.prefill(q, kc, vc, bt, sl, cu, k_scale=ksc, v_scale=vsc, backend=backend,
                        seq_lens_host=sl.tolist() if host else None,
                        cu_seqlens_q_host=cu.tolist() if host else None)
        assert torch.equal(got, out), "out=None / host lengths changed the result"
    if not (FP8 is not None and cache_dtype == FP8):
        # k_new / v_new: sequences without a prefix read them instead of their pages; here the
        # same values, so the same result
        kn = torch.full((T, Hkv, D), float("nan"), device=device, dtype=dtype)
        vn = torch.full_like(kn, float("nan"))
        for b, (n, L) in enumerate(chunks):
            if n == L and n:
                kn[int(cu[b]):int(cu[b + 1])] = k_ref[b].to(dtype)
                vn[int(cu[b]):int(cu[b + 1])] = v_ref[b].to(dtype)
        got = A.prefill(q, kc, vc, bt, sl, cu, backend=backend, k_new=kn, v_new=vn)
        assert torch.equal(got, out), "k_new / v_new changed the result"
    scale = 1 / math.sqrt(D)
    refs = [naive_attention(q[int(cu[b]):int(cu[b + 1])], k_ref[b], v_ref[b], scale, L - n)
            for b, (n, L) in enumerate(chunks)]
    ref = torch.cat(refs)
    exact = backend == "reference" or (backend == "auto" and device == "cpu")
    bad = count_wrong(out, ref, dtype, exact)
    assert bad == 0, (f"prefill {chunks} {Hq}/{Hkv}x{D} ps={ps} {dtype}/{cache_dtype} "
                      f"{backend}: {bad} of {out.numel()} wrong")


MIXED = [(37, 37), (5, 300), (1, 17), (0, 20), (64, 164), (129, 129)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["reference", "sdpa"])
def test_prefill_mixed_chunks(device, backend):
    gen = _gen(device)
    for dtype in (torch.bfloat16, torch.float16):
        for Hq, Hkv, D, ps in ((32, 8, 128, 16), (7, 1, 64, 64), (8, 8, 256, 256)):
            _prefill_case(device, MIXED, Hq, Hkv, D, ps, dtype, dtype, backend, gen,
                          host=Hq == 7)
        _prefill_case(device, [(200, 333)], 16, 4, 128, 16, dtype, dtype, backend, gen)


# Runs of adjacent sequences with equal (new, cached) tokens: one SDPA call each.
RUNS = [(16, 40)] * 3 + [(16, 41), (5, 5), (5, 5), (0, 9), (5, 5), (3, 70), (3, 70)]


def test_prefill_runs():
    cu, lens = [0], []
    for n, L in RUNS:
        cu.append(cu[-1] + n)
        lens.append(L)
    assert A.prefill_runs(cu, lens) == [(0, 3), (3, 4), (4, 6), (7, 8), (8, 10)]
    # A cap of cached tokens per call splits a run (one sequence at least per call).
    assert A.prefill_runs(cu, lens, max_tokens=80) == \
        [(0, 2), (2, 3), (3, 4), (4, 6), (7, 8), (8, 9), (9, 10)]
    assert A.prefill_runs(cu, lens, max_tokens=1) == [(b, b + 1) for b in range(10) if b != 6]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["reference", "sdpa"])
def test_prefill_batched_runs(device, backend, monkeypatch):
    calls = []
    real = A.sdpa._sdpa_chunk if backend == "sdpa" else A.sdpa._reference_chunk
    name = "_sdpa_chunk" if backend == "sdpa" else "_reference_chunk"
    monkeypatch.setattr(A.sdpa, name, lambda q, *a: calls.append(q.shape[0]) or real(q, *a))
    gen = _gen(device)
    for dtype in (torch.bfloat16, torch.float16):
        calls.clear()
        _prefill_case(device, RUNS, 8, 2, 64, 16, dtype, dtype, backend, gen)
        # _prefill_case prefills twice here (out=, then k_new / v_new): one call per run
        # each time, as many sequences as the run has
        assert calls == [3, 1, 2, 1, 2] * 2, calls


@pytest.mark.parametrize("device", DEVICES)
def test_prefill_long_odd(device):
    gen = _gen(device)
    _prefill_case(device, [(4097, 4097), (100, 4095)], 4, 1, 64, 16, torch.bfloat16,
                  torch.bfloat16, "auto", gen)


@pytest.mark.skipif(FP8 is None, reason="torch without float8_e4m3fn")
@pytest.mark.parametrize("device", DEVICES)
def test_prefill_fp8(device):
    gen = _gen(device)
    for backend in ("reference", "sdpa"):
        _prefill_case(device, MIXED, 16, 4, 128, 16, torch.bfloat16, FP8, backend, gen)


@pytest.mark.parametrize("device", DEVICES)
def test_prefill_plan_shared_by_calls(device):
    """A step's PrefillPlan, made once, gives every call the result of an unplanned call; a plan
    of another table or token count is refused."""
    gen = _gen(device)
    chunks = MIXED
    Hq, Hkv, D, ps = 8, 2, 64, 16
    ks = [_randn((L, Hkv, D), torch.float32, device, gen) for _, L in chunks]
    vs = [_randn((L, Hkv, D), torch.float32, device, gen) for _, L in chunks]
    kc, vc, _, _, bt, sl, _, _ = build_paged(ks, vs, ps, torch.bfloat16, device, gen)
    ns = [n for n, _ in chunks]
    cu = torch.tensor([0] + list(torch.tensor(ns).cumsum(0)), dtype=torch.int32, device=device)
    T = sum(ns)
    plan = A.prefill_plan(bt, sl, cu, tokens=T, page_size=ps, num_pages=kc.shape[0],
                          seq_lens_host=sl.tolist(), cu_seqlens_q_host=cu.tolist())
    assert plan.runs == A.prefill_runs(cu.tolist(), sl.tolist())
    for _ in range(2):   # as two layers of one step
        q = _randn((T, Hq, D), torch.bfloat16, device, gen)
        want = A.prefill(q, kc, vc, bt, sl, cu)
        assert torch.equal(A.prefill(q, kc, vc, bt, sl, cu, plan=plan), want)
    with pytest.raises(ValueError, match="plan was not made for this call"):
        A.prefill(q, kc, vc, bt.clone(), sl, cu, plan=plan)
    with pytest.raises(ValueError, match="plan was not made for this call"):
        A.prefill(q[:-1], kc, vc, bt, sl, cu, plan=plan)


# ---- the paged prefill kernel (CUDA) ----------------------------------------------------------
PAGED_SHAPES = [(32, 8, 128, 16), (7, 1, 64, 64), (8, 8, 256, 256), (28, 4, 128, 5),
                (64, 1, 128, 32), (16, 16, 64, 48)]


def _paged_kernel():
    """The paged prefill kernel must run on this GPU (tests/conftest.py's rule)."""
    from conftest import require_kernel
    require_kernel("attention_prefill")
    assert A._prefill.paged_available(), "the capability table has the paged prefill kernel " \
        "but fusedist.ops.attention does not take it"


@pytest.mark.gpu
def test_prefill_paged_kernel_mixed_chunks():
    """Every GQA group (1, 4, 7, 64), head_dim, page size (odd ones too), bf16/fp16."""
    _paged_kernel()
    gen = _gen("cuda")
    for dtype in (torch.bfloat16, torch.float16):
        for Hq, Hkv, D, ps in PAGED_SHAPES:
            _prefill_case("cuda", MIXED, Hq, Hkv, D, ps, dtype, dtype, "paged", gen,
                          host=Hq == 7)
        _prefill_case("cuda", [(4097, 4097), (100, 4095)], 4, 1, 64, 16, dtype, dtype,
                      "paged", gen)


@pytest.mark.skipif(FP8 is None, reason="torch without float8_e4m3fn")
@pytest.mark.gpu
def test_prefill_paged_kernel_fp8():
    _paged_kernel()
    gen = _gen("cuda")
    for dtype in (torch.bfloat16, torch.float16):
        for Hq, Hkv, D, ps in PAGED_SHAPES[:4]:
            _prefill_case("cuda", MIXED, Hq, Hkv, D, ps, dtype, FP8, "paged", gen)


def _paged_inputs(chunks, Hq, Hkv, D, ps, dtype, gen, cache_dtype=None, width_extra=2):
    ks = [_randn((L, Hkv, D), torch.float32, "cuda", gen) for _, L in chunks]
    vs = [_randn((L, Hkv, D), torch.float32, "cuda", gen) for _, L in chunks]
    kc, vc, ksc, vsc, bt, sl, k_ref, v_ref = build_paged(ks, vs, ps, cache_dtype or dtype,
                                                         "cuda", gen, width_extra=width_extra)
    ns = [n for n, _ in chunks]
    cu = torch.tensor([0] + list(torch.tensor(ns).cumsum(0)), dtype=torch.int32, device="cuda")
    q = _randn((sum(ns), Hq, D), dtype, "cuda", gen)
    ref = torch.cat([naive_attention(q[int(cu[b]):int(cu[b + 1])], k_ref[b], v_ref[b],
                                     1 / math.sqrt(D), L - n) for b, (n, L) in enumerate(chunks)])
    return q, kc, vc, ksc, vsc, bt, sl, cu, ref


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 2, 3, 7, 64])
def test_prefill_paged_kernel_key_splits(splits):
    """Any split count gives the reference's result, bitwise the same on every run; a split
    with no keys (64 splits of a short sequence) contributes nothing."""
    _paged_kernel()
    gen = _gen("cuda")
    chunks = [(128, 4000), (1, 1), (33, 700)]
    q, kc, vc, _, _, bt, sl, cu, ref = _paged_inputs(chunks, 32, 8, 128, 16, torch.bfloat16, gen)
    outs = []
    for _ in range(2):
        out = torch.full_like(q, float("nan"))
        A._prefill.run_paged(out, q, kc, vc, bt, sl, cu, 1 / math.sqrt(128), 128, 4000,
                             num_splits=splits)
        outs.append(out)
    assert torch.equal(outs[0], outs[1]), "not reproducible"
    assert bad_rows(outs[0], ref, torch.bfloat16) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("kv, rows, warps", [("bf16", 128, 8), ("fp8", 128, 8), ("bf16", 128, 4),
                                            ("bf16", 64, 4), ("fp8", 64, 4)])
def test_prefill_paged_kernel_tiles(kv, rows, warps):
    """Every mma.sync tile of head_dim 128: 128 rows of 8 warps x 16 or 4 warps of two m16
    tiles, and 64 rows of 4 warps; the reference's result for GQA groups 1, 4, 7 and 16, with
    and without key splits."""
    _paged_kernel()
    if kv == "fp8" and FP8 is None:
        pytest.skip("torch without float8_e4m3fn")
    gen = _gen("cuda")
    chunks = [(300, 1000), (1, 1), (130, 130), (0, 40), (77, 2100)]
    for Hq, Hkv in ((8, 8), (16, 4), (14, 2), (32, 2)):
        q, kc, vc, ksc, vsc, bt, sl, cu, ref = _paged_inputs(
            chunks, Hq, Hkv, 128, 16, torch.bfloat16, gen, cache_dtype=FP8 if kv == "fp8" else None)
        for splits in (1, 3):
            out = torch.full_like(q, float("nan"))
            A._prefill.run_paged(out, q, kc, vc, bt, sl, cu, 1 / math.sqrt(128), 300, 2100,
                                 ksc, vsc, num_splits=splits, tile_rows=rows, tile_warps=warps,
                                 mainloop="mma")
            assert bad_rows(out, ref, torch.bfloat16) == 0, f"{Hq}/{Hkv} splits {splits}"
    if rows == 64:
        return
    with pytest.raises(ValueError, match="tile_rows must be 64, or 128 at head_dim 128"):
        q64 = torch.zeros(4, 8, 64, dtype=torch.bfloat16, device="cuda")
        A._prefill.run_paged(None, q64, kc[..., :64].contiguous(), vc[..., :64].contiguous(),
                             bt, sl, cu, 1.0, 4, 64, tile_rows=128)


@pytest.mark.gpu
@pytest.mark.parametrize("kv, rows, warps", [("bf16", 64, 4), ("bf16", 128, 8), ("fp8", 64, 4),
                                            ("fp8", 128, 8), ("fp16", 128, 8)])
def test_prefill_paged_kernel_wgmma(kv, rows, warps):
    """The wgmma mainloop (Hopper's warpgroup MMA on 128-byte-swizzled tiles) gives the
    reference's result for GQA groups 1, 4, 7 and 16, with and without key splits, bf16 / fp16
    queries and 16-bit or FP8 caches, bitwise the same on a second run."""
    _paged_kernel()
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the wgmma mainloop is sm_90a")
    if kv == "fp8" and FP8 is None:
        pytest.skip("torch without float8_e4m3fn")
    gen = _gen("cuda")
    dtype = torch.float16 if kv == "fp16" else torch.bfloat16
    chunks = [(300, 1000), (1, 1), (130, 130), (0, 40), (77, 2100)]
    for Hq, Hkv in ((8, 8), (16, 4), (14, 2), (32, 2)):
        q, kc, vc, ksc, vsc, bt, sl, cu, ref = _paged_inputs(
            chunks, Hq, Hkv, 128, 16, dtype, gen, cache_dtype=FP8 if kv == "fp8" else None)
        for splits in (1, 3):
            outs = []
            for _ in range(2):
                out = torch.full_like(q, float("nan"))
                A._prefill.run_paged(out, q, kc, vc, bt, sl, cu, 1 / math.sqrt(128), 300, 2100,
                                     ksc, vsc, num_splits=splits, tile_rows=rows,
                                     tile_warps=warps, mainloop="wgmma")
                outs.append(out)
            assert bad_rows(outs[0], ref, dtype) == 0, f"{Hq}/{Hkv} splits {splits}"
            assert torch.equal(outs[0], outs[1]), "not reproducible"
    with pytest.raises(ValueError, match="mainloop='wgmma' is built for head_dim 128"):
        A._prefill.run_paged(None, q[..., :64].contiguous(), kc[..., :64].contiguous(),
                             vc[..., :64].contiguous(), bt, sl, cu, 1.0, 4, 64, tile_rows=64,
                             tile_warps=4, mainloop="wgmma")


@pytest.mark.gpu
def test_prefill_paged_kernel_strided_q():
    """q as TPAttention passes it: the q columns of a fused [T, q | k | v] projection."""
    _paged_kernel()
    gen = _gen("cuda")
    chunks = [(19, 80), (5, 5)]
    q, kc, vc, _, _, bt, sl, cu, ref = _paged_inputs(chunks, 16, 4, 128, 16, torch.bfloat16, gen)
    T = q.shape[0]
    qkv = torch.full((T, (16 + 8) * 128), float("nan"), dtype=q.dtype, device="cuda")
    qkv[:, :16 * 128] = q.flatten(1)
    qv = qkv[:, :16 * 128].view(T, 16, 128)
    out = A.prefill(qv, kc, vc, bt, sl, cu, backend="paged")
    assert torch.equal(out, A.prefill(q, kc, vc, bt, sl, cu, backend="paged"))
    assert bad_rows(out, ref, torch.bfloat16) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 4])
def test_prefill_paged_kernel_graph_replay_new_lengths(splits):
    """One capture over a padded token bucket replays with new lengths, tables and queries:
    equal to eager bitwise, to the reference, and the bucket's padding rows are zeros."""
    _paged_kernel()
    gen = _gen("cuda")
    Hq, Hkv, D, ps, T = 16, 4, 128, 16, 96
    cols = 40
    kc = _randn((64, ps, Hkv, D), torch.bfloat16, "cuda", gen)
    vc = _randn((64, ps, Hkv, D), torch.bfloat16, "cuda", gen)
    q = torch.zeros(T, Hq, D, dtype=torch.bfloat16, device="cuda")
    bt = torch.zeros(2, cols, dtype=torch.int32, device="cuda")
    sl = torch.ones(2, dtype=torch.int32, device="cuda")
    cu = torch.tensor([0, 1, 2], dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    scale = 1 / math.sqrt(D)
    run = lambda: A._prefill.run_paged(out, q, kc, vc, bt, sl, cu, scale, T, cols * ps,  # noqa
                                       num_splits=splits)
    run()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run()
    for chunks in ([(40, 300), (50, 50)], [(1, 600), (77, 90)], [(3, 3), (0, 10)]):
        ns = [n for n, _ in chunks]
        cu.copy_(torch.tensor([0, ns[0], sum(ns)], dtype=torch.int32))
        sl.copy_(torch.tensor([L for _, L in chunks], dtype=torch.int32))
        bt.copy_(torch.randint(0, 64, (2, cols), generator=torch.Generator().manual_seed(ns[0]),
                               dtype=torch.int32))
        q.copy_(_randn(q.shape, q.dtype, "cuda", gen))
        out.fill_(float("nan"))
        g.replay()
        got = out.clone()
        eager = A._prefill.run_paged(None, q[:sum(ns)], kc, vc, bt, sl, cu, scale, sum(ns),
                                     cols * ps, num_splits=splits)
        assert torch.equal(got[:sum(ns)], eager), f"graph != eager at {chunks}"
        assert torch.equal(got[sum(ns):], torch.zeros_like(got[sum(ns):])), "padding rows"
        for b, (n, L) in enumerate(chunks):
            pages = bt[b, :-(-L // ps)].long()
            kk = kc[pages].reshape(-1, Hkv, D)[:L]
            vv = vc[pages].reshape(-1, Hkv, D)[:L]
            a = int(cu[b])
            ref = naive_attention(q[a:a + n], kk, vv, scale, L - n)
            assert bad_rows(got[a:a + n], ref, torch.bfloat16) == 0, f"{chunks} seq {b}"


def test_prefill_paged_backend_needs_cuda():
    kc = torch.zeros(4, 16, 2, 64, dtype=torch.bfloat16)
    q = torch.zeros(5, 8, 64, dtype=torch.bfloat16)
    bt = torch.zeros(1, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="backend='paged' is the CUDA kernel"):
        A.prefill(q, kc, kc, bt, torch.tensor([5], dtype=torch.int32),
                  torch.tensor([0, 5], dtype=torch.int32), backend="paged")


def test_prefill_auto_rule(monkeypatch):
    """auto's CUDA choice: the paged kernel, except fresh prompts of paged_fresh_max_tokens
    tokens or more whose new K/V are passed, and steps of more than paged_max_flops (SDPA):
    the tuning table's "prefill" knobs."""
    from fusedist import tuning
    P = A._prefill
    kn = tuning.section_values({}, "prefill")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    rule, big, new, hd = P._auto_paged, kn["paged_fresh_max_tokens"], object(), 32 * 128
    assert not rule(2 * big, [big, big], [0, big, 2 * big], new, hd)      # fresh, long: SDPA
    assert not rule(2 * big, [big, big], [0, big, 2 * big], None, hd)     # gathered, too
    assert rule(2 * big - 2, [big - 1] * 2, [0, big - 1, 2 * big - 2], new, hd)  # shorter
    assert rule(big + 1, [big, 1], [0, big, big + 1], new, hd)            # one short prompt
    assert rule(big, [big + 4000], [0, big], new, hd)                     # a cached prefix
    assert rule(big, None, None, new, hd)                                 # lengths on device
    assert rule(512, [4096], [0, 512], None, hd)                          # 3.2e10 FLOPs
    assert rule(8 * 256, [4096] * 8, list(range(0, 2049, 256)), None, hd)  # 1.3e11
    assert not rule(4096, [8096], [0, 4096], None, hd)                    # 4.1e11 FLOPs
    assert not rule(4096, [4096], [0, 4096], None, hd)                    # fresh, 1.4e11
    assert rule(4096, [4096], [0, 4096], new, hd, fp8=True)              # FP8 cache: kernel
    assert rule(4096, [8096], [0, 4096], None, hd, fp8=True)
    # the mma.sync kernel (no wgmma: head_dim 64 / 256, other GPUs) crosses earlier
    small = kn["mma_fresh_max_tokens"]
    assert not rule(2 * small, [small] * 2, [0, small, 2 * small], new, hd, wgmma=False)
    assert rule(2 * small, [small] * 2, [0, small, 2 * small], None, hd, wgmma=False)
    assert not rule(8 * 256, [4096] * 8, list(range(0, 2049, 256)), None, hd, wgmma=False)
    off = dict(kn, auto_paged=False)
    assert not rule(big, [big + 4000], [0, big], new, hd, knobs=off)
    assert rule(big, [big + 4000], [0, big], new, hd, fp8=True, knobs=off)
    # a table's section moves the crossover
    near = dict(kn, paged_fresh_max_tokens=big - 1)
    assert not rule(2 * big - 2, [big - 1] * 2, [0, big - 1, 2 * big - 2], new, hd, knobs=near)
    # the plan's step_shape, made once per step, gives every layer the same choice
    for T, lens, cu, kv, w in [(2 * big, [big, big], [0, big, 2 * big], new, True),
                               (2 * big - 2, [big - 1] * 2, [0, big - 1, 2 * big - 2], new, True),
                               (big + 1, [big, 1], [0, big, big + 1], new, True),
                               (4096, [8096], [0, 4096], None, True),
                               (8 * 256, [4096] * 8, list(range(0, 2049, 256)), None, False),
                               (2 * small, [small] * 2, [0, small, 2 * small], new, False)]:
        shape = P.step_shape(cu, lens)
        assert rule(T, None, None, kv, hd, wgmma=w, shape=shape) == rule(T, lens, cu, kv, hd,
                                                                          wgmma=w)
    assert P.step_shape([0, 3, 10], [3, 12]) == (3 * 4 // 2 + 7 * 5 + 7 * 8 // 2, False, 3)
    assert P.step_shape([0, 4, 8], [4, 4]) == (20, True, 4)
    pl = A.prefill_plan(torch.zeros(2, 1, dtype=torch.int32), torch.tensor([3, 12]),
                        torch.tensor([0, 3, 10]), tokens=10, page_size=16, num_pages=1,
                        seq_lens_host=[3, 12], cu_seqlens_q_host=[0, 3, 10])
    assert pl.shape == P.step_shape([0, 3, 10], [3, 12])
    assert (pl.max_q_len, pl.max_keys) == (7, 12)


def test_prefill_split_plan():
    plan = A._prefill.plan_splits
    assert plan(1000, 8, 1, 4096, 132) == 1              # the tiles fill the GPU
    assert plan(8, 8, 1, 4096, 132) == 5                 # 64 CTAs -> 320 >= 2 per SM
    assert plan(8, 8, 1, 700, 132) == 1                  # too few keys to split
    assert plan(1, 1, 1, 1 << 20, 132) == A._prefill.PREFILL_MAX_SPLITS


def test_prefill_bad_inputs():
    kc = torch.zeros(4, 16, 2, 64, dtype=torch.bfloat16)
    q = torch.zeros(5, 8, 64, dtype=torch.bfloat16)
    bt = torch.zeros(2, 4, dtype=torch.int32)
    sl = torch.tensor([3, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens_q must be"):
        A.prefill(q, kc, kc, bt, sl, torch.tensor([0, 5], dtype=torch.int32))
    with pytest.raises(ValueError, match="rise from 0"):
        A.prefill(q, kc, kc, bt, sl, torch.tensor([0, 3, 4], dtype=torch.int32))
    with pytest.raises(ValueError, match="append first"):
        A.prefill(q, kc, kc, bt, sl, torch.tensor([0, 4, 5], dtype=torch.int32))
    with pytest.raises(ValueError, match="cu_seqlens_q_host has"):
        A.prefill(q, kc, kc, bt, sl, torch.tensor([0, 2, 5], dtype=torch.int32),
                  seq_lens_host=[3, 4], cu_seqlens_q_host=[0, 5])
    with pytest.raises(ValueError, match="k_new and v_new together"):
        A.prefill(q, kc, kc, bt, sl, torch.tensor([0, 2, 5], dtype=torch.int32),
                  k_new=torch.zeros(5, 2, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="k_new must be"):
        A.prefill(q, kc, kc, bt, sl, torch.tensor([0, 2, 5], dtype=torch.int32),
                  k_new=torch.zeros(5, 2, 64), v_new=torch.zeros(5, 2, 64))
    with pytest.raises(ValueError, match="backend must be"):
        A.prefill(q, kc, kc, bt, sl, torch.tensor([0, 2, 5], dtype=torch.int32), backend="x")


# ------------------------------------------------------------------------------------------------
# the torch.library ops under torch.compile and CUDA graphs
# ------------------------------------------------------------------------------------------------

def _step_inputs(device, gen, dtype=torch.bfloat16):
    B, Hq, Hkv, D, ps = 3, 8, 2, 64, 16
    lens = [5, 40, 17]
    num_pages = 16
    kc = _randn((num_pages, ps, Hkv, D), dtype, device, gen)
    vc = _randn((num_pages, ps, Hkv, D), dtype, device, gen)
    perm = torch.randperm(num_pages, generator=torch.Generator().manual_seed(3))
    bt = perm[:B * 4].view(B, 4).to(torch.int32).to(device)
    sl = torch.tensor(lens, dtype=torch.int32, device=device)
    pos = (sl - 1).long()
    slots = bt.long()[torch.arange(B, device=device), pos // ps] * ps + pos % ps
    q = _randn((B, Hq, D), dtype, device, gen)
    k = _randn((B, Hkv, D), dtype, device, gen)
    v = _randn((B, Hkv, D), dtype, device, gen)
    cs = A.rope_cos_sin(D, 128, device=device)
    return q, k, v, pos, cs, kc, vc, slots, bt, sl


def _step(q, k, v, pos, cs, kc, vc, slots, bt, sl, plan):
    A.rope_append(q, k, v, pos, cs, kc, vc, slots)
    return A.decode(q, kc, vc, bt, sl, plan)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_ops_under_torch_compile(backend):
    gen = _gen("cpu")
    args = _step_inputs("cpu", gen)
    plan = A.decode_plan(3, 8, 2, 64, 16, 64)
    eager_args = [a.clone() for a in args]
    want = _step(*eager_args, plan)
    torch._dynamo.reset()
    fn = torch.compile(_step, backend=backend, fullgraph=True)
    got = fn(*args, plan)
    assert torch.equal(got, want)
    for a, b in zip(args, eager_args):
        assert torch.equal(a, b), "in-place effects differ under torch.compile"
    # prefill through the compiled op as well
    q, k, v, pos, cs, kc, vc, slots, bt, sl = args
    cu = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    pf = torch.compile(lambda *a: A.prefill(*a), backend=backend, fullgraph=True)
    assert torch.equal(pf(q, kc, vc, bt, sl, cu), A.prefill(q, kc, vc, bt, sl, cu))


def test_ops_registered():
    for name in ("rope_append", "attention_decode", "attention_prefill"):
        assert hasattr(torch.ops.fusedist, name), name


@pytest.mark.gpu
def test_decode_cuda_graph_replay_new_lengths():
    """One capture, replays with new lengths and block tables; equals eager bitwise."""
    gen = _gen("cuda")
    q, k, v, pos, cs, kc, vc, slots, bt, sl = _step_inputs("cuda", gen)
    from conftest import require_kernel
    require_kernel("attention_decode")
    plan = A.decode_plan(3, 8, 2, 64, 16, 64, "cuda", torch.bfloat16)
    assert plan.backend == "kernel", "decode_plan did not take the split-KV kernel"
    out = torch.empty_like(q)
    A.decode(q, kc, vc, bt, sl, plan, out=out)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        A.decode(q, kc, vc, bt, sl, plan, out=out)
    for lens in ([1, 64, 33], [64, 2, 9], [17, 17, 17]):
        sl.copy_(torch.tensor(lens, dtype=torch.int32))
        bt.copy_(torch.randperm(16, generator=torch.Generator().manual_seed(lens[0]))[:12]
                 .view(3, 4).to(torch.int32))
        q.copy_(_randn(q.shape, q.dtype, "cuda", gen))
        out.fill_(float("nan"))
        g.replay()
        eager = A.decode(q, kc, vc, bt, sl, plan)
        assert torch.equal(out, eager), f"graph != eager at lens {lens}"


@pytest.mark.gpu
def test_rope_append_cuda_graph():
    """rope_append captured once, replayed with new queries, keys and positions: q and k
    rotated as the reference rotates them, and the KV cache the replay wrote (the rotated k and
    v at each row's slot, every other entry untouched) equal to the reference's cache."""
    gen = _gen("cuda")
    q, k, v, pos, cs, kc, vc, slots, bt, sl = _step_inputs("cuda", gen)
    sq, sk, sv = q.clone(), k.clone(), v.clone()
    g = torch.cuda.CUDAGraph()
    A.rope_append(sq.clone(), sk.clone(), sv, pos, cs, kc.clone(), vc.clone(), slots)
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        A.rope_append(sq, sk, sv, pos, cs, kc, vc, slots)
    for _ in range(2):
        q0 = _randn(q.shape, q.dtype, "cuda", gen)
        k0 = _randn(k.shape, k.dtype, "cuda", gen)
        sq.copy_(q0)
        sk.copy_(k0)
        pos.copy_(torch.randint(0, 128, pos.shape, generator=gen, device="cuda"))
        kc2, vc2 = kc.clone(), vc.clone()            # the cache before this replay
        g.replay()
        eq, ek = q0.clone(), k0.clone()
        A.rope_append_reference(eq, ek, sv, pos, cs, kc2, vc2, slots)
        assert count_bad(sq, eq.float(), torch.bfloat16) == 0
        assert count_bad(sk, ek.float(), torch.bfloat16) == 0
        assert count_bad(kc, kc2.float(), torch.bfloat16) == 0, "K cache of the replay"
        assert count_bad(vc, vc2.float(), torch.bfloat16) == 0, "V cache of the replay"


# ------------------------------------------------------------------------------------------------
# SDPA backend priority
# ------------------------------------------------------------------------------------------------

_PRIORITY = r"""
import json, sys, torch
import torch.nn.functional as F
q = torch.randn(1, 8, 64, 128, device="cuda", dtype=torch.bfloat16)
if sys.argv[1] == "fusedist":    # the process's first SDPA call inside fusedist's priority
    from fusedist.ops import attention as A
    A.sdpa._sdpa_chunk(*(q.transpose(1, 2),) * 3, 0.1)
else:                            # a plain SDPA call first
    F.scaled_dot_product_attention(q, q, q, is_causal=True)
# what a masked GQA-as-rows decode call (the torch baseline's) gets afterwards
qd = torch.randn(1, 8, 4, 128, device="cuda", dtype=torch.bfloat16)
kd = torch.randn(1, 8, 4144, 128, device="cuda", dtype=torch.bfloat16)
mask = torch.arange(4144, device="cuda")[None, None, None, :] < 4000
print(json.dumps([list(torch._C._get_sdp_priority_order()),
                  int(torch._fused_sdp_choice(qd, kd, kd, attn_mask=mask))]))
"""


@pytest.mark.gpu
def test_sdpa_priority_leaves_torch_default():
    import json
    import subprocess

    got = {}
    for first in ("fusedist", "plain"):
        p = subprocess.run([sys.executable, "-P", "-c", _PRIORITY, first], capture_output=True,
                           text=True, timeout=240)
        assert p.returncode == 0, p.stderr[-3000:]
        got[first] = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["fusedist"] == got["plain"], \
        f"after fusedist's prefill SDPA: {got['fusedist']}; after a plain call: {got['plain']}"


def test_sdpa_priority_is_null_when_torch_already_has_that_order(monkeypatch):
    """sdpa_priority(cuda, order) enters no context when the four CUDA backends are enabled
    and already in that order (the prefill's order is torch's default on Hopper), and sets
    and restores the order otherwise (flags are global: checked on a CPU host too)."""
    import contextlib
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from fusedist.ops.attention import sdpa as S
    monkeypatch.setattr(S, "_sdpa_default_set", True)   # no probe kernel on this host
    if not hasattr(torch._C, "_get_sdp_priority_order"):
        pytest.skip("torch without SDPA priorities")
    want = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
            SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    before = list(torch._C._get_sdp_priority_order())
    with sdpa_kernel(want, set_priority=True):
        assert S._state_is(want)
        assert isinstance(A.sdpa_priority("cuda"), contextlib.nullcontext)
        assert not S._state_is(want[1:] + want[:1])
        assert not isinstance(A.sdpa_priority("cuda", ("flash", "cudnn")),
                              contextlib.nullcontext)
    with sdpa_kernel(want[:2], set_priority=True):   # efficient and math disabled
        assert not S._state_is(want)
        with A.sdpa_priority("cuda"):
            assert S._state_is(want)
        assert not torch._C._get_mem_efficient_sdp_enabled()
    assert list(torch._C._get_sdp_priority_order()) == before


def test_sdpa_priority_validates_and_is_null_off_cuda():
    with A.sdpa_priority("cpu"):
        pass
    with pytest.raises(ValueError, match="unknown SDPA backends"):
        A.sdpa_priority("cuda", ("cudnn", "fast"))
