"""The torch backend's attention: the same tensor-parallel attention as fusedist.nn.TPAttention
in plain torch (F.linear, RoPE in torch, SDPA over a static [batch, kv heads, S, head_dim]
cache per layer), as gpt-fast runs it. It is the baseline `--baseline torch` measures, and the
oracle the model tests hold fusedist's attention path against."""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from .config import LlamaConfig
from .weights import kv_head_range


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
    def __init__(self, cfg: LlamaConfig, tp: int, rank: int, max_position: int, dtype, device):
        super().__init__()
        self.heads = cfg.num_heads // tp
        _, self.kv_heads = kv_head_range(cfg.num_kv_heads, tp, rank)
        self.head_dim = hd = cfg.head_dim
        n = (self.heads + 2 * self.kv_heads) * hd
        p = lambda *s: torch.nn.Parameter(torch.zeros(*s, dtype=dtype, device=device),  # noqa
                                          requires_grad=False)
        self.wqkv = p(n, cfg.hidden_size)
        self.bqkv = p(n) if cfg.qkv_bias else None
        self.wo = p(cfg.hidden_size, self.heads * hd)
        cos, sin = rope_tables(hd, max_position, cfg.rope_theta, cfg.rope_scaling, device, dtype)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    @torch.no_grad()
    def load_shard(self, q_w, k_w, v_w, o_w, q_b=None, k_b=None, v_b=None):
        self.wqkv.copy_(torch.cat((q_w, k_w, v_w)))
        if self.bqkv is not None:
            self.bqkv.copy_(torch.cat((q_b, k_b, v_b)))
        self.wo.copy_(o_w)

    def forward(self, x, positions, cache: StaticKVCache, layer: int, meta, seq_rows=None):
        T, H, KH, D = x.shape[0], self.heads, self.kv_heads, self.head_dim
        qkv = F.linear(x, self.wqkv, self.bqkv)
        q, k, v = qkv.split((H * D, KH * D, KH * D), dim=-1)
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]
        q = _rotate(q.view(T, H, D), cos, sin)
        k = _rotate(k.view(T, KH, D), cos, sin)
        v = v.view(T, KH, D)
        kc, vc = cache.k[layer], cache.v[layer]
        if meta.mode == "decode":
            # Decode rows are the cache's batch rows 0..T-1 (the runner's static buffers).
            rows = torch.arange(T, device=x.device)
            kc[rows, :, positions] = k
            vc[rows, :, positions] = v
            S = kc.shape[2]
            mask = torch.arange(S, device=x.device)[None, :] < meta.seq_lens[:, None].long()
            # The G = H / KH query heads of a kv head as G query rows against its cache: SDPA
            # then reads each K/V row once (enable_gqa with a mask would copy the cache).
            G = H // KH
            o = F.scaled_dot_product_attention(q.view(T, KH, G, D), kc[:T], vc[:T],
                                               attn_mask=mask[:, None, None, :])
            o = o.reshape(T, H * D)
        else:
            o = torch.empty(T, H, D, dtype=x.dtype, device=x.device)
            cu = getattr(meta, "cu_seqlens_q_host", None) or meta.cu_seqlens_q.tolist()
            lens = getattr(meta, "seq_lens_host", None) or meta.seq_lens.tolist()
            rows = list(range(len(lens))) if seq_rows is None else seq_rows.tolist()
            for j, row in enumerate(rows):
                s, e, L = cu[j], cu[j + 1], lens[j]
                p0 = L - (e - s)
                kc[row, :, p0:L] = k[s:e].transpose(0, 1)
                vc[row, :, p0:L] = v[s:e].transpose(0, 1)
                G = H // KH
                kk = kc[row, :, :L].repeat_interleave(G, dim=0)[None]
                vv = vc[row, :, :L].repeat_interleave(G, dim=0)[None]
                qq = q[s:e].transpose(0, 1)[None]
                if p0 == 0:     # no cached prefix: plain causal (SDPA's flash / cuDNN paths)
                    oj = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True)
                else:
                    i = torch.arange(e - s, device=x.device)[:, None]
                    mask = torch.arange(L, device=x.device)[None, :] <= p0 + i
                    oj = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask[None, None])
                o[s:e] = oj[0].transpose(0, 1)
            o = o.reshape(T, H * D)
        return F.linear(o, self.wo)
