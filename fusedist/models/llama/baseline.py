"""The plain-torch baseline of the Llama model, on the same config and weights: what
`--baseline torch` measures (and, under torch.compile, `--baseline torch-compile`), and the
oracle the model tests hold fusedist's path against. TorchTransformer is fusedist's
Transformer with its step ops swapped for torch's: F.linear, F.rms_norm, F.silu,
torch.distributed all_reduce / all_gather, and TorchAttention, the same tensor-parallel
attention as fusedist.nn.TPAttention in plain torch (RoPE in torch, SDPA over a static
[batch, kv heads, S, head_dim] cache per layer), as gpt-fast runs it. Its SDPA calls run under
an explicit backend priority (SDPA_BACKENDS: cuDNN first), so the kernel they get does not
depend on what else ran in the process. Decode on CUDA takes whichever of two plain-torch
forms is faster at the step's (batch, cache length), timed once outside graph capture
(DECODE_PATHS).

With FP8 weights (the same FP8Weights fusedist's model holds) its projections are
torch_linear's plain-torch FP8 GEMM: torch._scaled_mm with row-wise scales on CUDA (each token
of x quantized to e4m3 with its own scale by torch ops, the weight's per-channel scales; a per-tensor scale
broadcast to the channels), the weight dequantized to x's dtype and F.linear elsewhere (CPU,
128 x 128 block scales, fp16 / fp32, sizes not multiples of 16); its norms write the model
dtype (fusedist's hand e4m3 rows to the GEMMs that take them)."""

from __future__ import annotations

import math
import warnings
from typing import Optional


import torch
import torch.distributed as dist
import torch.nn.functional as F

from ...nn.attention import kv_head_range
from ...nn.quant import FP8Weight, device_capability, quantize_rows_reference, scaled_mm_rowwise
from ...ops.attention import prefill_runs, sdpa_priority
from .config import LlamaConfig
from .model import MLP, Transformer, rmsnorm

# torch >= 2.13 renames all_gather_into_tensor; the baseline keeps the name every supported
# torch has.
warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*deprecated")

# SDPA backends the baseline's attention tries first, in this order (then torch's others): the
# fastest torch has for its decode and prefill calls on Hopper (cuDNN takes the masked decode
# call; flash takes no mask).
SDPA_BACKENDS = ("cudnn", "flash", "efficient", "math")

# The baseline's decode attention, in two plain-torch forms:
#   "sdpa":   one masked SDPA call (cuDNN). Its 64-row query tiles hold G = 4 rows at
#             Llama-3-8B, and batch 1 is 8 CTAs: ~89 us a layer over a 4K cache on an H200.
#   "matmul": Hugging Face's eager attention (scores = q K^T in the model dtype, a masked fp32
#             softmax, P V): batched matmuls that read K and V once each at full width.
# The first eager CUDA call of each (batch, cache length, heads, dtype) times both (in a CUDA
# graph, as the runner decodes) and keeps the faster (decode_path_choices); graph capture and
# torch.compile reuse that choice ("sdpa" when none was made), so the baseline is the faster
# plain torch at every batch.
DECODE_PATHS = ("sdpa", "matmul")
decode_path_choices: dict = {}


def _decode_sdpa(q4, kc, vc, mask):
    return F.scaled_dot_product_attention(q4, kc, vc, attn_mask=mask)


def _decode_matmul(q4, kc, vc, mask):
    s = torch.matmul(q4, kc.transpose(-1, -2)).float() * (q4.shape[-1] ** -0.5)
    p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1).to(q4.dtype)
    return torch.matmul(p, vc)


_DECODE_FNS = {"sdpa": _decode_sdpa, "matmul": _decode_matmul}


def _pick_decode_path(key, args) -> str:
    """The faster decode form for key, timed now when the call is eager, else the recorded
    choice ("sdpa" when there is none). Each form is timed as the runner decodes, in a CUDA
    graph (5 calls, after one warm-up call): timed eagerly, the matmul form's nine small
    launches cost more on the host than on the GPU (an H200 at batch 1 over a 4K cache: 23.5 us
    a call in a graph, against SDPA's 94)."""
    if key in decode_path_choices:
        return decode_path_choices[key]
    if torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing():
        return "sdpa"
    times = {}
    for name in DECODE_PATHS:
        fn = _DECODE_FNS[name]
        fn(*args)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(5):
                fn(*args)
        g.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times[name] = start.elapsed_time(end)
        del g
    decode_path_choices[key] = min(times, key=times.get)
    return decode_path_choices[key]


def torch_linear(x: torch.Tensor, w, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """F.linear, or for an FP8Weight the plain-torch FP8 GEMM (module docstring)."""
    if not isinstance(w, FP8Weight):
        return F.linear(x, w, bias)
    n, k = w.shape
    x2 = x.reshape(-1, k)
    if x2.is_cuda and x2.shape[0] and w.layout != "block" and x2.dtype == torch.bfloat16 and \
            n % 16 == 0 and k % 16 == 0 and device_capability(x2.device) >= (9, 0):
        y = scaled_mm_rowwise(x2.contiguous(), w.data, w.channel_scale, bias,
                              quantize=quantize_rows_reference)
    else:
        y = F.linear(x2, w.dequantize(x2.dtype), bias)
    return y.reshape(*x.shape[:-1], n)


def rope_inv_freq(head_dim: int, base: float, scaling: Optional[dict]) -> torch.Tensor:
    """Inverse frequencies in fp32, computed as Hugging Face computes them (llama3 scaling
    included), so fp32 logits agree with HF's to rounding."""
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling:
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old = scaling["original_max_position_embeddings"]
        low_wl, high_wl = old / low, old / high
        wl = 2 * math.pi / inv
        out = torch.where(wl > low_wl, inv / factor, inv)
        smooth = (old / wl - low) / (high - low)
        smoothed = (1 - smooth) * out / factor + smooth * out
        medium = ~(wl < high_wl) & ~(wl > low_wl)
        inv = torch.where(medium, smoothed, out)
    return inv


def rope_tables(head_dim: int, max_position: int, base: float, scaling: Optional[dict],
                device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_position, head_dim] (neox layout: both halves equal), in `dtype`."""
    inv = rope_inv_freq(head_dim, base, scaling)
    freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(device=device, dtype=dtype), emb.sin().to(device=device, dtype=dtype)


def _rotate(x, cos, sin):
    h = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., h:], x[..., :h]), dim=-1) * sin


class StaticKVCache:
    """k[layer], v[layer]: [max_batch, kv_heads, max_seq_len, head_dim]; batch row b holds
    sequence b's tokens at their positions."""

    def __init__(self, num_layers, max_batch, kv_heads, max_seq_len, head_dim, dtype, device):
        shape = (max_batch, kv_heads, max_seq_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.max_seq_len = max_seq_len


class TorchAttention(torch.nn.Module):
    def __init__(self, cfg: LlamaConfig, tp: int, rank: int, max_position: int, dtype, device,
                 fp8_layout: Optional[str] = None):
        super().__init__()
        self.heads = cfg.num_heads // tp
        first, last = kv_head_range(cfg.num_kv_heads, tp, rank)
        self.kv_heads = last - first
        self.head_dim = hd = cfg.head_dim
        n = (self.heads + 2 * self.kv_heads) * hd
        p = lambda *s: torch.nn.Parameter(torch.zeros(*s, dtype=dtype, device=device),  # noqa
                                          requires_grad=False)
        self.fp8_layout = fp8_layout
        if fp8_layout is None:
            self.wqkv = p(n, cfg.hidden_size)
            self.wo = p(cfg.hidden_size, self.heads * hd)
        else:
            self.wqkv = FP8Weight.empty(n, cfg.hidden_size, fp8_layout, device)
            self.wo = FP8Weight.empty(cfg.hidden_size, self.heads * hd, fp8_layout, device)
        self.bqkv = p(n) if cfg.qkv_bias else None
        self.norm_eps = cfg.rms_norm_eps
        self.q_norm = torch.nn.Parameter(torch.ones(hd, dtype=dtype, device=device),
                                         requires_grad=False) if cfg.qk_norm else None
        self.k_norm = torch.nn.Parameter(torch.ones(hd, dtype=dtype, device=device),
                                         requires_grad=False) if cfg.qk_norm else None
        # o_proj's bias (Llama's attention_bias) on rank 0's partial: the all-reduce adds it once
        self.bo = p(cfg.hidden_size) if cfg.o_bias else None
        self.rank = rank
        cos, sin = rope_tables(hd, max_position, cfg.rope_theta, cfg.rope_scaling, device, dtype)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    @torch.no_grad()
    def load_shard(self, q_w, k_w, v_w, o_w, q_b=None, k_b=None, v_b=None, o_b=None):
        if self.bo is not None:
            self.bo.copy_(o_b)
        if self.fp8_layout is not None:
            self.wqkv = FP8Weight.cat_rows([q_w, k_w, v_w], "TorchAttention qkv")
            self.wo = o_w
        else:
            self.wqkv.copy_(torch.cat((q_w, k_w, v_w)))
            self.wo.copy_(o_w)
        if self.bqkv is not None:
            self.bqkv.copy_(torch.cat((q_b, k_b, v_b)))

    @torch.no_grad()
    def load_qk_norm(self, q_norm, k_norm):
        self.q_norm.copy_(q_norm)
        self.k_norm.copy_(k_norm)

    def forward(self, x, positions, cache: StaticKVCache, layer: int, meta, seq_rows=None):
        T, H, KH, D = x.shape[0], self.heads, self.kv_heads, self.head_dim
        qkv = torch_linear(x, self.wqkv, self.bqkv)
        q, k, v = qkv.split((H * D, KH * D, KH * D), dim=-1)
        q, k = q.view(T, H, D), k.view(T, KH, D)
        if self.q_norm is not None:   # Qwen3: RMSNorm of each head, in fp32
            q = F.rms_norm(q.float(), (D,), self.q_norm.float(), self.norm_eps).to(q.dtype)
            k = F.rms_norm(k.float(), (D,), self.k_norm.float(), self.norm_eps).to(k.dtype)
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]
        q = _rotate(q, cos, sin)
        k = _rotate(k, cos, sin)
        v = v.view(T, KH, D)
        kc, vc = cache.k[layer], cache.v[layer]
        with sdpa_priority(x.device, SDPA_BACKENDS):
            if meta.mode == "decode":
                o = self._decode(q, k, v, kc, vc, positions, meta.seq_lens)
            else:
                o = self._prefill(q, k, v, kc, vc, meta, seq_rows)
        return torch_linear(o.reshape(T, H * D), self.wo, self.bo if self.rank == 0 else None)

    def _decode(self, q, k, v, kc, vc, positions, seq_lens):
        # Decode rows are the cache's batch rows 0..T-1 (the runner's static buffers).
        T, KH, D = k.shape
        rows = torch.arange(T, device=q.device)
        kc[rows, :, positions] = k
        vc[rows, :, positions] = v
        S = kc.shape[2]
        mask = torch.arange(S, device=q.device)[None, :] < seq_lens[:, None].long()
        # The G = H / KH query heads of a kv head as G query rows against its cache: SDPA then
        # reads each K/V row once (enable_gqa with a mask would copy the cache on the math
        # path). cuDNN takes this masked call; flash takes no mask.
        G = self.heads // KH
        args = (q.view(T, KH, G, D), kc[:T], vc[:T], mask[:, None, None, :])
        if not q.is_cuda:
            return _decode_sdpa(*args)
        return _DECODE_FNS[_pick_decode_path((T, S, KH, G, D, q.dtype), args)](*args)

    def _prefill(self, q, k, v, kc, vc, meta, seq_rows):
        from torch.nn.attention.bias import causal_lower_right
        T, H, D = q.shape
        o = torch.empty_like(q)
        cu = getattr(meta, "cu_seqlens_q_host", None) or meta.cu_seqlens_q.tolist()
        lens = getattr(meta, "seq_lens_host", None) or meta.seq_lens.tolist()
        rows = list(range(len(lens))) if seq_rows is None else \
            (seq_rows.tolist() if isinstance(seq_rows, torch.Tensor) else list(seq_rows))
        gqa = H != self.kv_heads
        # One SDPA call per run of adjacent sequences with equal (new tokens, cached tokens)
        # in consecutive cache rows: a batch of equal prompts is one call per layer.
        for f, l in _row_runs(prefill_runs(cu, lens), rows):
            B, n, L = l - f, cu[f + 1] - cu[f], lens[f]
            s, e, r0, p0 = cu[f], cu[l], rows[f], lens[f] - (cu[f + 1] - cu[f])
            kc[r0:r0 + B, :, p0:L] = k[s:e].unflatten(0, (B, n)).transpose(1, 2)
            vc[r0:r0 + B, :, p0:L] = v[s:e].unflatten(0, (B, n)).transpose(1, 2)
            qq = q[s:e].unflatten(0, (B, n)).transpose(1, 2)              # [B, H, n, D]
            kk, vv = kc[r0:r0 + B, :, :L], vc[r0:r0 + B, :, :L]
            if p0 == 0:     # no cached prefix: plain causal (SDPA's flash / cuDNN paths)
                oj = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=gqa)
            else:           # behind a prefix: token i sees keys [0, p0 + i]
                oj = F.scaled_dot_product_attention(qq, kk, vv, enable_gqa=gqa,
                                                    attn_mask=causal_lower_right(n, L))
            o[s:e].unflatten(0, (B, n)).copy_(oj.transpose(1, 2))
        return o


def _row_runs(runs, rows):
    """runs ([first, last) sequence ranges) split where the sequences' cache rows are not
    consecutive."""
    out = []
    for f, l in runs:
        start = f
        for b in range(f + 1, l):
            if rows[b] != rows[b - 1] + 1:
                out.append((start, b))
                start = b
        out.append((start, l))
    return out


class TorchMLP(MLP):
    """The model's MLP (same weights, same load_shard) in plain torch: F.linear (torch_linear
    for FP8 weights), F.silu."""

    def forward(self, x):
        gu = torch_linear(x, self.gate_up)
        return torch_linear(F.silu(gu[:, :self.inter]) * gu[:, self.inter:], self.down)


class TorchTransformer(Transformer):
    """fusedist's Transformer with plain-torch ops (module docstring); same parameters, same
    load(), same forward()."""
    backend = "torch"

    def _attention(self) -> torch.nn.Module:
        return TorchAttention(self.cfg, self.tp, self.rank, self.max_position, self.dtype,
                              self.device, self.fp8_layout)

    def _mlp(self, layer: int) -> torch.nn.Module:
        return TorchMLP(self.cfg, self.tp, self.dtype, self.device, self.fp8_layout)

    def _attend(self, attn, x, positions, cache, layer, meta, seq_rows):
        return attn(x, positions, cache, layer, meta, seq_rows)

    def _takes_fp8(self, module, rows):
        return False   # torch_linear quantizes x itself: the norms write the model dtype

    def _add_rmsnorm(self, partial, residual, w, eps, fp8=False):
        if self.tp > 1:
            dist.all_reduce(partial, group=self.comm.group.pg)
        h = partial + residual
        return rmsnorm(h, w, eps), h

    def _rmsnorm(self, h, w, eps, fp8=False):
        return rmsnorm(h, w, eps)

    def _head(self, x):
        return F.linear(x, self.lm_head)

    def _gather_columns(self, y):
        if self.tp == 1:
            return y
        parts = torch.empty((self.tp * y.shape[0], y.shape[1]), dtype=y.dtype, device=y.device)
        dist.all_gather_into_tensor(parts, y.contiguous(), group=self.comm.group.pg)
        return parts.view(self.tp, y.shape[0], -1).permute(1, 0, 2).reshape(y.shape[0], -1)

    def new_cache(self, max_batch: int, max_seq_len: int, page_size: int, num_pages: int,
                  kv_dtype: Optional[torch.dtype] = None):
        """A static [max_batch, kv heads, max_seq_len, head_dim] cache per layer, in the
        model's dtype (the baseline has no FP8 cache)."""
        if kv_dtype is not None and kv_dtype != self.dtype:
            raise ValueError(f"fusedist.models: the torch baseline keeps its KV cache in the "
                             f"model's dtype ({self.dtype}); kv_dtype={kv_dtype} is fusedist's "
                             "(drop it for the baseline)")
        return StaticKVCache(self.cfg.num_layers, max_batch, self.local_kv_heads, max_seq_len,
                             self.cfg.head_dim, self.dtype, self.device)

    def decode_plan(self, batch: int, page_size: int, max_seq_len: int,
                    kv_dtype: Optional[torch.dtype] = None):
        return None
