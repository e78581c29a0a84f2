"""TPAttention on every rank (CPU/gloo or one GPU per rank) against a float64 attention layer
with the full weights: a mixed prefill, a chunked-prefill step next to a sequence with no new
tokens, then decode steps, over a paged cache. run_scenario() is also used in-process at
TP 1 (tests/nn/test_attention.py)."""

from __future__ import annotations

import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import check, fresh, main, rank_seed  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from fusedist.nn import AttentionMetadata, BlockTable, TPAttention  # noqa: E402
from fusedist.ops import decode_plan  # noqa: E402
from fusedist.ops.attention import quantize_fp8_reference, rope_inv_freq  # noqa: E402
from tolerances import GEMM_REL, gemm_rel_err  # noqa: E402

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
# (hidden, heads, kv_heads, head_dim, qkv_bias, style, scaling, page_size)
CONFIGS = (
    (128, 8, 2, 16, False, "neox", None, 16),
    (64, 4, 1, 32, True, "gptj", LLAMA3, 16),      # kv head replicated when tp > 1
    (96, 4, 4, 24, True, "neox", LLAMA3, 64),      # MHA, head_dim not a multiple of 16
    (256, 16, 8, 64, False, "neox", None, 16),     # Llama-like 128-wide heads per 2 ranks
)
# Steps: per sequence the number of new tokens (0 = not in this step's work).
STEPS = (("prefill", (5, 17, 1)), ("prefill", (3, 20, 0)), ("decode", (1, 1, 1)),
         ("decode", (1, 1, 1)), ("decode", (1, 1, 1)))


def _rope64(x, pos, inv, style):
    ang = pos.double()[:, None] * inv[None, :]
    rot = torch.polar(torch.ones_like(ang), ang)[:, None, :]
    h = x.shape[-1] // 2
    if style == "neox":
        z = torch.complex(x[..., :h], x[..., h:]) * rot
        return torch.cat([z.real, z.imag], -1)
    z = torch.complex(x[..., 0::2], x[..., 1::2]) * rot
    return torch.stack([z.real, z.imag], -1).flatten(-2)


def _fp8_round(t):
    """Per token-head e4m3 quantize-dequantize (scale = amax / 448), the FP8 cache's rounding."""
    q, s = quantize_fp8_reference(t)
    return q.double() * s.double()[..., None]


def reference_layer(x, w, cfg, fp8_kv=None):
    """float64 attention layer with the full weights over one whole sequence x [N, hidden]:
    causal, GQA, RoPE at positions 0..N-1. fp8_kv=dtype: K and V pass through the FP8
    cache's per token-head e4m3 rounding, applied (as in the layer) to K and V rounded to
    the activation dtype after the projection and after RoPE; without those roundings, values
    near an e4m3 rounding boundary land a whole e4m3 step apart."""
    hidden, H, Hkv, D, bias, style, scaling, _ = cfg
    x = x.double()
    N = x.shape[0]
    q = x @ w["q_w"].double().t() + (w["q_b"].double() if bias else 0)
    k = x @ w["k_w"].double().t() + (w["k_b"].double() if bias else 0)
    v = x @ w["v_w"].double().t() + (w["v_b"].double() if bias else 0)
    q, k, v = q.view(N, H, D), k.view(N, Hkv, D), v.view(N, Hkv, D)
    inv = rope_inv_freq(D, 10000.0, scaling).to(x.device)
    pos = torch.arange(N, device=x.device)
    if fp8_kv is not None:
        k, v = k.to(fp8_kv).double(), v.to(fp8_kv).double()
    q, k = _rope64(q, pos, inv, style), _rope64(k, pos, inv, style)
    if fp8_kv is not None:
        k, v = _fp8_round(k.to(fp8_kv)), _fp8_round(v)
    k = k.repeat_interleave(H // Hkv, 1)
    v = v.repeat_interleave(H // Hkv, 1)
    s = torch.einsum("nhd,mhd->hnm", q, k) / math.sqrt(D)
    s = s.masked_fill(~torch.ones(N, N, dtype=torch.bool, device=x.device).tril(), float("-inf"))
    o = torch.einsum("hnm,mhd->nhd", torch.softmax(s, -1), v).reshape(N, H * D)
    return o @ w["o_w"].double().t()


def full_weights(cfg, dtype, device, seed):
    hidden, H, Hkv, D, bias, *_ = cfg
    sc = 1 / math.sqrt(hidden)
    w = {"q_w": fresh((H * D, hidden), torch.float32, device, rank_seed(seed, "q")) * sc,
         "k_w": fresh((Hkv * D, hidden), torch.float32, device, rank_seed(seed, "k")) * sc,
         "v_w": fresh((Hkv * D, hidden), torch.float32, device, rank_seed(seed, "v")) * sc,
         "o_w": fresh((hidden, H * D), torch.float32, device, rank_seed(seed, "o")) /
         math.sqrt(H * D)}
    if bias:
        for n, rows in (("q_b", H * D), ("k_b", Hkv * D), ("v_b", Hkv * D)):
            w[n] = fresh((rows,), torch.float32, device, rank_seed(seed, n)) * 0.1
    return {n: t.to(dtype) for n, t in w.items()}


def run_scenario(cfg, dtype, device, seed, group=None, reduce=True, kv_dtype=None,
                 partial_sum=None):
    """Runs STEPS through a TPAttention and returns the worst relative error of any step's
    output against reference_layer. reduce=False: partial outputs summed with partial_sum."""
    hidden, H, Hkv, D, bias, style, scaling, ps = cfg
    w = full_weights(cfg, dtype, device, seed)
    attn = TPAttention(hidden, H, Hkv, D, qkv_bias=bias, rope_style=style, rope_scaling=scaling,
                       max_position=256, group=group, dtype=dtype, device=device)
    attn.load_full(w["q_w"], w["k_w"], w["v_w"], w["o_w"], w.get("q_b"), w.get("k_b"),
                   w.get("v_b"))
    B = 3
    totals = [sum(n[b] for _, n in STEPS) for b in range(B)]
    xs = [fresh((N, hidden), dtype, device, rank_seed(seed, "x", b)) for b, N in
          enumerate(totals)]
    refs = [reference_layer(xs[b], w, cfg, fp8_kv=dtype if kv_dtype is not None else None) for b in range(B)]
    layers = 2   # write layer 1: layer 0 must stay untouched
    cache = attn.make_cache(layers, num_pages=16, page_size=ps, kv_dtype=kv_dtype)
    table = BlockTable(cache.allocator, ps, max_batch=B, max_pages_per_seq=8)
    for b in range(B):
        table.add(b)
    cache.allocator.allocate(3)   # pages 0-2 held elsewhere: the sequences' ids start at 3
    plan = decode_plan(B, attn.q_heads, attn.kv_heads, D, ps, 64, device, dtype,
                       cache.kv_dtype)
    done = [0] * B
    worst = 0.0
    for step, (mode, news) in enumerate(STEPS):
        slots, pos, rows, ref_rows = [], [], [], []
        for b, n in enumerate(news):
            slots += table.append(b, n)
            pos += list(range(done[b], done[b] + n))
            rows.append(xs[b][done[b]:done[b] + n])
            ref_rows.append(refs[b][done[b]:done[b] + n])
            done[b] += n
        x = torch.cat(rows)
        cu = torch.tensor([0] + list(torch.tensor(news).cumsum(0)), dtype=torch.int32,
                          device=device)
        meta = AttentionMetadata(mode, table.tensor(device), table.seq_lens(device),
                                 torch.tensor(slots, dtype=torch.int64, device=device),
                                 cu_seqlens_q=cu if mode == "prefill" else None,
                                 max_q_len=max(news), plan=plan if mode == "decode" else None)
        if step % 2:   # odd steps hand prefill the lengths on the host as well
            meta.seq_lens_host = table.seq_lens().tolist()
            meta.cu_seqlens_q_host = cu.tolist()
        y = attn(x, torch.tensor(pos, dtype=torch.int64, device=device), cache, 1, meta,
                 reduce=reduce)
        assert y.shape == (x.shape[0], hidden) and y.dtype == dtype, (y.shape, y.dtype)
        if not reduce:
            y = partial_sum(y)
        worst = max(worst, gemm_rel_err(y, torch.cat(ref_rows)))
    assert bool((cache.k[0] == 0).all()) and bool((cache.v[0] == 0).all()), \
        "layer 0 of the cache was written"
    return worst


def _partial_sum_dist(y):
    s = y.double()
    dist.all_reduce(s)
    return s


@check
def tp_attention_matches_full_layer(rt, seed):
    dtypes = (torch.float32, torch.bfloat16) if rt.device.type == "cpu" else (torch.bfloat16,)
    for cfg in CONFIGS:
        for dtype in dtypes:
            for reduce in (True, False):
                err = run_scenario(cfg, dtype, rt.device, (seed, str(cfg), str(dtype)),
                                   reduce=reduce, partial_sum=_partial_sum_dist)
                assert err <= GEMM_REL[dtype], \
                    f"cfg {cfg} {dtype} reduce={reduce}: relative error {err:.3g}"


@check
def tp_attention_fp8_cache(rt, seed):
    fp8 = getattr(torch, "float8_e4m3fn", None)
    if fp8 is None:
        return
    for cfg in CONFIGS:
        err = run_scenario(cfg, torch.bfloat16, rt.device, (seed, "fp8", str(cfg)), kv_dtype=fp8)
        assert err <= GEMM_REL[torch.bfloat16], f"fp8 cache {cfg}: relative error {err:.3g}"


if __name__ == "__main__":
    main()
