"""TPAttention: one tensor-parallel attention layer over a paged KV cache.

    attn = TPAttention(hidden, num_heads, num_kv_heads, rope_scaling=cfg.rope_scaling)
    attn.load_full(q_w, k_w, v_w, o_w)               # full HF-layout weights
    y = attn(x, positions, cache, layer, meta)        # [T, hidden], all-reduced
    part = attn(x, positions, cache, layer, meta, reduce=False)  # this rank's partial o_proj

Sharding over the tensor-parallel group of size W (Megatron / vLLM):
  q heads      rank r owns heads [r H/W, (r+1) H/W) (H % W == 0).
  kv heads     Hkv >= W: rank r owns [r Hkv/W, (r+1) Hkv/W) (Hkv % W == 0); Hkv < W: each kv head
               is replicated on W / Hkv consecutive ranks (W % Hkv == 0), rank r holds kv head
               r // (W / Hkv), the one its q heads read.
  qkv          one column-parallel [q_r | k_r | v_r] weight [(H/W + 2 Hkv_r) D, hidden] (and
               bias): x is replicated, the GEMM needs no communication. It and the unreduced
               o_proj go through fusedist.nn.linear.linear (fusedist.gemm's `auto` rules on
               CUDA bf16/fp16), as the model's MLP and LM head do.
  o_proj       row-parallel [hidden, H/W D] (columns of this rank's q heads): reduce=True
               all-reduces through fusedist.gemm_ar; reduce=False returns the partial product so
               the caller fuses the all-reduce with residual + RMSNorm. At W = 1 there is no
               communication at all. o_bias=True (Llama's attention_bias): a replicated [hidden]
               bias, added once: after the all-reduce, or with reduce=False to rank 0's
               partial only, so that the sum of the partials holds it once.
The cache passed in holds this rank's kv heads (Hkv_r of them).

FP8 weights: TPAttention(..., fp8_layout="channel" | "tensor" | "block") keeps qkv_weight and
o_weight as fusedist.nn.quant.FP8Weight (e4m3 + float32 scales; the activations, bias, cache
and output stay `dtype`). load_full takes full FP8Weights and shards them (FP8Weight.narrow:
per-channel scales follow the rows, block scales need the shard on multiples of 128);
load_shard takes this rank's q / k / v / o shards, bf16 or FP8. The [q_r | k_r | v_r] stack of
per-tensor parts with different scales becomes per-channel (FP8Weight.cat_rows). x may come
as fusedist.nn.quant.FP8Rows (e4m3 rows + per-token scales, from a norm's FP8 output) for a bf16
module: the qkv GEMM takes it as it is. takes_fp8_input(rows) says where that pays: where the
qkv GEMM would quantize a bf16 x per token itself (row-wise torch._scaled_mm: per-tensor or
per-channel scales, past the GEMV's rows, sm_90+).

qk_norm=True (Qwen3): each head of q and of k is RMS-normalized over head_dim with a learned
[head_dim] weight (q_norm, k_norm: replicated, load_qk_norm) after the qkv GEMM and before RoPE,
in float32 and rounded once to the module's dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

from ..comm.communicator import Communicator, GroupLike, get_communicator, resolve_group
from ..ops.attention import DecodePlan, PrefillPlan, decode, prefill, rope_append, rope_cos_sin
from ..ops.allreduce import all_reduce
from ..ops.gemm_comm import gemm_ar
from ..distributed.runtime import is_initialized
from .._check import as_int
from .kv_cache import PagedKVCache
from .linear import linear
from .quant import LAYOUTS, FP8Rows, FP8Weight, takes_fp8_rows

MODES = ("decode", "prefill")


@dataclass
class AttentionMetadata:
    """Per-step inputs shared by every layer, built by the runner outside CUDA graphs; the
    tensors are static buffers so a captured graph replays with new values.
    decode:  one token per sequence (T == batch), plan from fusedist.ops.decode_plan.
    prefill: cu_seqlens_q int32/int64 [batch + 1] splits the T tokens into sequences; plan
             (optional) from fusedist.ops.attention.prefill_plan, checked once for every
             layer of the step."""
    mode: str
    block_table: torch.Tensor               # int32 [batch, max_pages]
    seq_lens: torch.Tensor                  # int32 [batch], including this step's tokens
    slot_mapping: torch.Tensor              # int64 [T]
    cu_seqlens_q: Optional[torch.Tensor] = None
    max_q_len: Optional[int] = None
    plan: Optional[Union[DecodePlan, PrefillPlan]] = None
    # prefill: the same lengths as host lists (the runner has them); without them prefill
    # reads seq_lens / cu_seqlens_q from the device, a synchronization per layer.
    seq_lens_host: Optional[Sequence[int]] = None
    cu_seqlens_q_host: Optional[Sequence[int]] = None
    # prefill: fusedist.ops.attention.prefill's backend ("paged" for a step whose lengths live
    # on the device only, e.g. a CUDA-graph bucket padded past cu_seqlens_q[-1]).
    prefill_backend: str = "auto"

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"AttentionMetadata: mode must be one of {MODES}, got {self.mode!r}")
        if self.mode == "prefill" and self.cu_seqlens_q is None:
            raise ValueError("AttentionMetadata: prefill needs cu_seqlens_q (int [batch + 1])")
        # The host lists must say what the tensors hold: prefill plans from the lists and the
        # attention reads the tensors. Compared where it costs no synchronization (the tensor
        # on the CPU); on a GPU the caller vouches for them (the Runner builds both from one
        # list).
        for name, host, t in (("seq_lens_host", self.seq_lens_host, self.seq_lens),
                              ("cu_seqlens_q_host", self.cu_seqlens_q_host, self.cu_seqlens_q)):
            if host is None or not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                continue
            if [int(v) for v in host] != t.tolist():
                tname = name.removesuffix("_host")
                raise ValueError(f"AttentionMetadata: {name} {list(host)[:16]} disagrees with "
                                 f"{tname} {t.tolist()[:16]}; pass the same lengths in both "
                                 f"(or leave {name} out: prefill then reads {tname})")


def check_rope_scaling(where: str, scaling: Optional[dict]) -> None:
    """A RoPE scaling dict whose factors make a finite table: every factor present a finite
    number > 0 (a factor <= 0 divides the frequencies into NaN or negative ones), llama3's
    high_freq_factor > low_freq_factor. None, {} and type "default" have none."""
    if not scaling:
        return
    if not isinstance(scaling, dict):
        raise TypeError(f"{where}: rope_scaling must be a dict or None, got "
                        f"{type(scaling).__name__}")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return
    keys = ("factor",) + (("low_freq_factor", "high_freq_factor",
                           "original_max_position_embeddings") if kind == "llama3" else ())
    for k in keys:
        v = scaling.get(k, 1.0 if k != "factor" else None)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                or v <= 0:
            raise ValueError(f"{where}: rope_scaling {k} must be a finite number > 0, got "
                             f"{v!r} (a {kind} RoPE table would hold NaN or reversed "
                             "frequencies)")


def kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    if num_kv_heads >= tp_size:
        if num_kv_heads % tp_size:
            raise ValueError(f"TPAttention: num_kv_heads={num_kv_heads} is not divisible by the "
                             f"tensor-parallel size {tp_size}")
        return num_kv_heads // tp_size
    if tp_size % num_kv_heads:
        raise ValueError(f"TPAttention: tensor-parallel size {tp_size} is not a multiple of "
                         f"num_kv_heads={num_kv_heads}; kv heads cannot be replicated evenly")
    return 1


def kv_head_range(num_kv_heads: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """[first, last) of the kv heads rank tp_rank holds."""
    n = kv_heads_per_rank(num_kv_heads, tp_size)
    first = tp_rank * n if num_kv_heads >= tp_size else tp_rank // (tp_size // num_kv_heads)
    return first, first + n


class TPAttention(torch.nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int,
                 head_dim: Optional[int] = None, *, qkv_bias: bool = False,
                 rope_base: float = 10000.0, rope_scaling: Optional[dict] = None,
                 max_position: int = 8192, rope_style: str = "neox", group: GroupLike = None,
                 dtype=None, device=None, rotary_dim: Optional[int] = None,
                 softmax_scale: Optional[float] = None, fp8_layout: Optional[str] = None,
                 qk_norm: bool = False, qk_norm_eps: float = 1e-6, o_bias: bool = False):
        super().__init__()
        hidden_size, num_heads, num_kv_heads, max_position = (
            as_int("TPAttention", n, v, 1) for n, v in (
                ("hidden_size", hidden_size), ("num_heads", num_heads),
                ("num_kv_heads", num_kv_heads), ("max_position", max_position)))
        if head_dim is not None:
            head_dim = as_int("TPAttention", "head_dim", head_dim, 1)
        check_rope_scaling("TPAttention", rope_scaling)
        self.comm = None
        if group is not None or is_initialized():
            g = group.group if isinstance(group, Communicator) else resolve_group(group)
            self.tp_size, self.tp_rank = g.size, g.rank
            if self.tp_size > 1:
                self.comm = get_communicator(group)
            default_device = g.device
        else:   # no fusedist.init(): a single-process layer
            self.tp_size, self.tp_rank, default_device = 1, 0, torch.device("cpu")
        device = torch.device(device) if device is not None else default_device
        head_dim = hidden_size // num_heads if head_dim is None else head_dim
        if num_heads % self.tp_size:
            raise ValueError(f"TPAttention: num_heads={num_heads} is not divisible by the "
                             f"tensor-parallel size {self.tp_size}")
        if num_heads % num_kv_heads:
            raise ValueError(f"TPAttention: num_heads={num_heads} must be a multiple of "
                             f"num_kv_heads={num_kv_heads}")
        if rope_style not in ("neox", "gptj"):
            raise ValueError(f"TPAttention: rope_style must be 'neox' or 'gptj', got "
                             f"{rope_style!r}")
        self.hidden_size, self.num_heads, self.num_kv_heads = hidden_size, num_heads, num_kv_heads
        self.head_dim, self.rope_style = head_dim, rope_style
        self.q_heads = num_heads // self.tp_size                 # per rank
        self.kv_heads = kv_heads_per_rank(num_kv_heads, self.tp_size)
        self.kv_first = kv_head_range(num_kv_heads, self.tp_size, self.tp_rank)[0]
        self.scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
        dtype = dtype if dtype is not None else torch.get_default_dtype()
        if fp8_layout is not None and fp8_layout not in LAYOUTS:
            raise ValueError(f"TPAttention: fp8_layout must be None or one of {LAYOUTS}, got "
                             f"{fp8_layout!r}")
        self.dtype, self.fp8_layout = dtype, fp8_layout
        rows = (self.q_heads + 2 * self.kv_heads) * head_dim
        p = lambda *s: torch.nn.Parameter(torch.zeros(*s, dtype=dtype, device=device),  # noqa
                                          requires_grad=False)
        if fp8_layout is None:
            self.qkv_weight = p(rows, hidden_size)
            self.o_weight = p(hidden_size, self.q_heads * head_dim)
        else:
            self.qkv_weight = FP8Weight.empty(rows, hidden_size, fp8_layout, device)
            self.o_weight = FP8Weight.empty(hidden_size, self.q_heads * head_dim, fp8_layout,
                                            device)
        self.qkv_bias = p(rows) if qkv_bias else None
        if qk_norm and not (isinstance(qk_norm_eps, float) and qk_norm_eps > 0):
            raise ValueError(f"TPAttention: qk_norm_eps must be a float > 0, got {qk_norm_eps!r}")
        self.qk_norm_eps = qk_norm_eps
        ones = lambda: torch.nn.Parameter(torch.ones(head_dim, dtype=dtype, device=device),  # noqa
                                          requires_grad=False)
        self.q_norm = ones() if qk_norm else None
        self.k_norm = ones() if qk_norm else None
        self.o_bias = p(hidden_size) if o_bias else None
        self.register_buffer("cos_sin", rope_cos_sin(head_dim, max_position, rope_base,
                                                     rope_scaling, device=device,
                                                     rotary_dim=rotary_dim), persistent=False)

    @torch.no_grad()
    def load_full(self, q_w, k_w, v_w, o_w, q_b=None, k_b=None, v_b=None, o_b=None):
        """Full HF-layout weights: q_w [H D, hidden], k_w / v_w [Hkv D, hidden], o_w
        [hidden, H D] (tensors, or FP8Weights for an fp8_layout module), biases q_b / k_b / v_b
        (qkv_bias) and o_b [hidden] (o_bias); takes this rank's shard."""
        D, hid = self.head_dim, self.hidden_size
        for name, w, want in (("q_w", q_w, (self.num_heads * D, hid)),
                              ("k_w", k_w, (self.num_kv_heads * D, hid)),
                              ("v_w", v_w, (self.num_kv_heads * D, hid)),
                              ("o_w", o_w, (hid, self.num_heads * D))):
            if tuple(w.shape) != want:
                raise ValueError(f"TPAttention.load_full: {name} must be {list(want)}, got "
                                 f"{list(w.shape)}")
        if (self.qkv_bias is not None) != (q_b is not None):
            raise ValueError("TPAttention.load_full: pass q_b, k_b, v_b exactly when the module "
                             "was built with qkv_bias=True")
        qs = slice(self.tp_rank * self.q_heads * D, (self.tp_rank + 1) * self.q_heads * D)
        ks = slice(self.kv_first * D, (self.kv_first + self.kv_heads) * D)
        self._check_kinds("load_full", q_w=q_w, k_w=k_w, v_w=v_w, o_w=o_w)
        biases = (q_b[qs], k_b[ks], v_b[ks]) if q_b is not None else (None, None, None)
        if self.fp8_layout is not None:
            cut = lambda w, dim, s, name: w.narrow(dim, s.start, s.stop,  # noqa: E731
                                                   f"TPAttention.load_full {name}")
            return self.load_shard(cut(q_w, 0, qs, "q_w"), cut(k_w, 0, ks, "k_w"),
                                   cut(v_w, 0, ks, "v_w"), cut(o_w, 1, qs, "o_w"), *biases,
                                   o_b=o_b)
        return self.load_shard(q_w[qs], k_w[ks], v_w[ks], o_w[:, qs], *biases, o_b=o_b)

    @torch.no_grad()
    def load_shard(self, q_w, k_w, v_w, o_w, q_b=None, k_b=None, v_b=None, o_b=None):
        """This rank's shards: q_w [H/W D, hidden] (its q heads), k_w / v_w [Hkv_r D, hidden]
        (its kv heads), o_w [hidden, H/W D] (their o_proj columns), biases likewise (o_b: the
        whole [hidden] o_proj bias, replicated); tensors, or
        FP8Weights for an fp8_layout module (stacked by FP8Weight.cat_rows, so a per-tensor
        checkpoint's q / k / v scales become per-channel when they differ)."""
        D, hid = self.head_dim, self.hidden_size
        for name, w, want in (("q_w", q_w, (self.q_heads * D, hid)),
                              ("k_w", k_w, (self.kv_heads * D, hid)),
                              ("v_w", v_w, (self.kv_heads * D, hid)),
                              ("o_w", o_w, (hid, self.q_heads * D))):
            if tuple(w.shape) != want:
                raise ValueError(f"TPAttention.load_shard: {name} must be {list(want)}, got "
                                 f"{list(w.shape)}")
        self._check_kinds("load_shard", q_w=q_w, k_w=k_w, v_w=v_w, o_w=o_w)
        if (self.qkv_bias is not None) != (q_b is not None):
            raise ValueError("TPAttention.load_shard: pass q_b, k_b, v_b exactly when the module "
                             "was built with qkv_bias=True")
        if (self.o_bias is not None) != (o_b is not None):
            raise ValueError("TPAttention.load_shard: pass o_b exactly when the module was built "
                             "with o_bias=True")
        if o_b is not None and tuple(o_b.shape) != (hid,):
            raise ValueError(f"TPAttention.load_shard: o_b must be [{hid}] (the whole o_proj "
                             f"bias), got {list(o_b.shape)}")
        if self.fp8_layout is not None:
            dev = self.cos_sin.device
            self.qkv_weight = FP8Weight.cat_rows([q_w, k_w, v_w],
                                                 "TPAttention qkv (q | k | v rows)").to(dev)
            self.o_weight = o_w.to(dev)
        else:
            self.qkv_weight.copy_(torch.cat([q_w, k_w, v_w]))
            self.o_weight.copy_(o_w)
        if self.qkv_bias is not None:
            self.qkv_bias.copy_(torch.cat([q_b, k_b, v_b]))
        if self.o_bias is not None:
            self.o_bias.copy_(o_b)
        return self

    @torch.no_grad()
    def load_qk_norm(self, q_norm: torch.Tensor, k_norm: torch.Tensor):
        """The [head_dim] weights of the q and k head norms (qk_norm=True modules)."""
        if self.q_norm is None:
            raise ValueError("TPAttention.load_qk_norm: this module was built with "
                             "qk_norm=False")
        for name, w in (("q_norm", q_norm), ("k_norm", k_norm)):
            if tuple(w.shape) != (self.head_dim,):
                raise ValueError(f"TPAttention.load_qk_norm: {name} must be [{self.head_dim}], "
                                 f"got {list(w.shape)}")
        self.q_norm.copy_(q_norm)
        self.k_norm.copy_(k_norm)
        return self

    def _check_kinds(self, op: str, **weights) -> None:
        """FP8Weights (of the module's scale layout) exactly when fp8_layout is set."""
        for name, w in weights.items():
            if isinstance(w, FP8Weight) != (self.fp8_layout is not None):
                raise ValueError(f"TPAttention.{op}: {name} is "
                                 f"{'an FP8Weight' if isinstance(w, FP8Weight) else 'a tensor'}"
                                 f"; this module was built with fp8_layout={self.fp8_layout!r} "
                                 "(FP8Weights exactly when fp8_layout is set)")
            if isinstance(w, FP8Weight) and w.layout != self.fp8_layout:
                raise ValueError(f"TPAttention.{op}: {name} has {w.layout} scales; this "
                                 f"module was built with fp8_layout={self.fp8_layout!r}")

    def takes_fp8_input(self, rows: int) -> bool:
        """Whether an x of `rows` tokens pays to come as FP8Rows: the qkv GEMM would quantize a
        bf16 x per token for row-wise torch._scaled_mm (fusedist.nn.quant.takes_fp8_rows; False
        for bf16 weights, block scales, the GEMV's rows, the CPU)."""
        return takes_fp8_rows(rows, self.qkv_weight, self.cos_sin.device, self.dtype,
                              self.qkv_bias)

    def _check_fp8_input(self) -> None:
        if not isinstance(self.qkv_weight, FP8Weight):
            raise ValueError("TPAttention: x is FP8Rows (e4m3 + per-token scales), which the qkv "
                             "GEMM takes with FP8 weights only; this module holds "
                             f"{self.dtype} weights (fp8_layout=None): pass x in {self.dtype}")
        if self.dtype != torch.bfloat16:
            raise ValueError("TPAttention: x is FP8Rows, whose qkv GEMM writes bfloat16 q / k / "
                             f"v; this module's dtype is {self.dtype}: pass x in {self.dtype}")

    def make_cache(self, num_layers: int, num_pages: int, page_size: int = 16,
                   kv_dtype: Optional[torch.dtype] = None) -> PagedKVCache:
        """A cache for this rank's kv heads."""
        return PagedKVCache(num_layers, self.kv_heads, self.head_dim, num_pages, page_size,
                            self.dtype, self.cos_sin.device, kv_dtype)

    def forward(self, x, positions: torch.Tensor, cache: PagedKVCache, layer: int,
                meta: AttentionMetadata, *, reduce: bool = True) -> torch.Tensor:
        """x: [tokens, hidden] of the module's dtype, or FP8Rows (module docstring)."""
        rows = x.data if isinstance(x, FP8Rows) else x
        T = rows.shape[0]
        if rows.dim() != 2 or rows.shape[1] != self.hidden_size:
            raise ValueError(f"TPAttention: x must be [tokens, {self.hidden_size}], got "
                             f"{tuple(rows.shape)}")
        if rows is not x:
            self._check_fp8_input()
        elif rows.dtype != self.dtype:
            raise TypeError(f"TPAttention: x is {rows.dtype}, this module's weights and cache "
                            f"are {self.dtype}; pass x.to({self.dtype}) (or build the module "
                            f"with dtype={rows.dtype})")
        if cache.kv_heads != self.kv_heads or cache.head_dim != self.head_dim:
            raise ValueError(f"TPAttention: the cache holds {cache.kv_heads} kv heads of "
                             f"{cache.head_dim}; this rank needs {self.kv_heads} of "
                             f"{self.head_dim} (TPAttention.make_cache builds one)")
        D, hq, hk = self.head_dim, self.q_heads, self.kv_heads
        qkv = linear(x, self.qkv_weight, self.qkv_bias)
        q = qkv[:, :hq * D].view(T, hq, D)
        k = qkv[:, hq * D:(hq + hk) * D].view(T, hk, D)
        v = qkv[:, (hq + hk) * D:].view(T, hk, D)
        k_cache, v_cache, k_scale, v_scale = cache.layer(layer)
        # q / k head norms (qk_norm) in rope_append's kernel: normalized, rounded, rotated in
        # place in qkv's q and k
        rope_append(q, k, v, positions, self.cos_sin, k_cache, v_cache, meta.slot_mapping,
                    style=self.rope_style, k_scale=k_scale, v_scale=v_scale,
                    q_norm=self.q_norm, k_norm=self.k_norm, norm_eps=self.qk_norm_eps)
        if meta.mode == "decode":
            o = decode(q, k_cache, v_cache, meta.block_table, meta.seq_lens, meta.plan,
                       scale=self.scale, k_scale=k_scale, v_scale=v_scale)
        else:
            o = prefill(q, k_cache, v_cache, meta.block_table, meta.seq_lens, meta.cu_seqlens_q,
                        scale=self.scale, max_q_len=meta.max_q_len, k_scale=k_scale,
                        v_scale=v_scale, seq_lens_host=meta.seq_lens_host,
                        cu_seqlens_q_host=meta.cu_seqlens_q_host, k_new=k, v_new=v,
                        plan=meta.plan if isinstance(meta.plan, PrefillPlan) else None,
                        backend=meta.prefill_backend)
        o = o.reshape(T, hq * D)
        if self.tp_size == 1 or not reduce or T == 0:
            # T == 0 on every rank alike: nothing to reduce. An unreduced partial carries the
            # o_proj bias on rank 0 only: the sum over the ranks holds it once.
            return linear(o, self.o_weight, self.o_bias if self.tp_rank == 0 else None)
        if isinstance(self.o_weight, FP8Weight):
            y = all_reduce(linear(o, self.o_weight), group=self.comm)
            return y if self.o_bias is None else y + self.o_bias
        return gemm_ar(o, self.o_weight.t(), self.o_bias, group=self.comm)

    def extra_repr(self) -> str:
        return (f"hidden={self.hidden_size}, heads={self.num_heads}/{self.num_kv_heads} "
                f"(per rank {self.q_heads}/{self.kv_heads}), head_dim={self.head_dim}, "
                f"tp={self.tp_size}, rope={self.rope_style}"
                + (f", fp8 {self.fp8_layout} scales" if self.fp8_layout else "")
                + (", q/k norm" if self.q_norm is not None else ""))
