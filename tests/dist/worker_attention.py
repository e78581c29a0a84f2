"""TPAttention on every rank (CPU/gloo or one GPU per rank) against a float64 attention layer
with the full weights: a mixed prefill, a chunked-prefill step next to a sequence with no new
tokens, then decode steps, over a paged cache. run_scenario() is also used in-process at
TP 1 (tests/nn/test_attention.py)."""

from __future__ import annotations

import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _checks import check, fresh, main, rank_seed  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from fusedist.nn import AttentionMetadata, BlockTable, TPAttention  # noqa: E402
from fusedist.ops import decode_plan  # noqa: E402
from fusedist.ops.attention import rope_inv_freq  # noqa: E402
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


def reference_layer(x, w, cfg, heads=None, kv=None):
    """float64 attention layer with the full weights over one whole sequence x [N, hidden]:
    causal, GQA, RoPE at positions 0..N-1. Returns (out, k, v) with k (rotated) and v
    [N, kv heads, D]. heads=(q_first, q_count, kv_first, kv_count): only those heads and
    their o_proj columns (one rank's partial output); kv=(K, V) [N, kv_count, D]: attend to
    these instead of the projected K/V (an FP8 cache's dequantized contents)."""
    hidden, H, Hkv, D, bias, style, scaling, _ = cfg
    q0, hq, k0, hk = heads if heads is not None else (0, H, 0, Hkv)
    x = x.double()
    N = x.shape[0]
    qs, ks = slice(q0 * D, (q0 + hq) * D), slice(k0 * D, (k0 + hk) * D)
    q = x @ w["q_w"][qs].double().t() + (w["q_b"][qs].double() if bias else 0)
    k = x @ w["k_w"][ks].double().t() + (w["k_b"][ks].double() if bias else 0)
    v = x @ w["v_w"][ks].double().t() + (w["v_b"][ks].double() if bias else 0)
    q, k, v = q.view(N, hq, D), k.view(N, hk, D), v.view(N, hk, D)
    inv = rope_inv_freq(D, 10000.0, scaling).to(x.device)
    pos = torch.arange(N, device=x.device)
    q, k = _rope64(q, pos, inv, style), _rope64(k, pos, inv, style)
    ka, va = (k, v) if kv is None else (kv[0].double(), kv[1].double())
    ka = ka.repeat_interleave(hq // hk, 1)
    va = va.repeat_interleave(hq // hk, 1)
    s = torch.einsum("nhd,mhd->hnm", q, ka) / math.sqrt(D)
    s = s.masked_fill(~torch.ones(N, N, dtype=torch.bool, device=x.device).tril(), float("-inf"))
    o = torch.einsum("hnm,mhd->nhd", torch.softmax(s, -1), va).reshape(N, hq * D)
    return o @ w["o_w"][:, qs].double().t(), k, v


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
    output against reference_layer. reduce=False: partial outputs summed with partial_sum.
    FP8 caches (kv_dtype): each rank's partial output (reduce=False) against this rank's heads
    attending to the cache's dequantized K/V (e4m3 rounding is checked on the cache itself:
    check_fp8_cache), so the output check keeps the bf16 budget."""
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
    fp8 = kv_dtype is not None
    if fp8:
        reduce = False
    refs = [reference_layer(xs[b], w, cfg)[0] for b in range(B)] if not fp8 else None
    seq_slots = [[] for _ in range(B)]
    outs = []   # (step output rows of each sequence)
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
        spans = []
        for b, n in enumerate(news):
            new_slots = table.append(b, n)
            slots += new_slots
            seq_slots[b] += new_slots
            pos += list(range(done[b], done[b] + n))
            rows.append(xs[b][done[b]:done[b] + n])
            if not fp8:
                ref_rows.append(refs[b][done[b]:done[b] + n])
            spans.append((b, done[b], n))
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
        if fp8:
            outs.append((y, spans))
            continue
        if not reduce:
            y = partial_sum(y)
        worst = max(worst, gemm_rel_err(y, torch.cat(ref_rows)))
    assert bool((cache.k[0] == 0).all()) and bool((cache.v[0] == 0).all()), \
        "layer 0 of the cache was written"
    if fp8:   # the cache holds every token's K/V now, each written once
        heads = (attn.tp_rank * attn.q_heads, attn.q_heads, attn.kv_first, attn.kv_heads)
        refs = []
        for b in range(B):
            sl = torch.tensor(seq_slots[b], device=device)
            kv = [(c.view(-1, attn.kv_heads, D)[sl].double() *
                   sc.view(-1, attn.kv_heads)[sl].double()[..., None])
                  for c, sc in ((cache.k[1], cache.k_scale[1]), (cache.v[1], cache.v_scale[1]))]
            ref, k64, v64 = reference_layer(xs[b], w, cfg, heads, kv)
            check_fp8_cache(kv[0], k64, cache.k_scale[1].view(-1, attn.kv_heads)[sl], dtype)
            check_fp8_cache(kv[1], v64, cache.v_scale[1].view(-1, attn.kv_heads)[sl], dtype)
            refs.append(ref)
        for y, spans in outs:
            ref = torch.cat([refs[b][t0:t0 + n] for b, t0, n in spans])
            worst = max(worst, gemm_rel_err(y, ref))
    return worst


def check_fp8_cache(deq, exact, scale, dtype):
    """An e4m3 cache row (dequantized) against the float64 K or V of its (token, head): e4m3
    rounds each normal element within 2^-4 of the value it was given and each subnormal within
    2^-10 * scale, and that value (the layer's activation) is within GEMM_REL[dtype] of the
    float64 one, so ||deq - exact|| <= 2^-4 ||a|| + sqrt(D) 2^-10 scale + GEMM_REL ||exact||
    with ||a|| <= (1 + GEMM_REL) ||exact||."""
    g = GEMM_REL[dtype]
    n = exact.norm(dim=-1)
    bound = 2**-4 * (1 + g) * n + math.sqrt(exact.shape[-1]) * 2**-10 * scale.double() + g * n
    err = (deq - exact).norm(dim=-1)
    bad = int((~(err <= bound)).sum())
    assert bad == 0, f"fp8 cache: {bad} of {err.numel()} token-head rows off (worst " \
                     f"{float((err / n).max()):.3g} relative)"


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
