"""Attention over a paged KV cache: RoPE + cache append, decode, chunked prefill.

    cos_sin = rope_cos_sin(head_dim, max_position, base, scaling)       # once per model
    rope_append(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping)  # after QKV
    plan = decode_plan(batch, q_heads, kv_heads, head_dim, page_size, max_seq_len, device, dtype)
    out = decode(q, k_cache, v_cache, block_table, seq_lens, plan)      # one token per sequence
    out = prefill(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q)

Layout (docs/design/attention.md):
  k_cache, v_cache  [num_pages, page_size, kv_heads, head_dim], bf16/fp16, or float8_e4m3fn
                    with k_scale, v_scale float32 [num_pages, page_size, kv_heads]
                    (one scale per token-head; value = fp8 * scale; scale = amax / 448).
  block_table       int32 [batch, max_pages_per_seq]; only the first ceil(seq_len/page_size)
                    entries of a row are read.
  seq_lens          int32 [batch], tokens in the cache INCLUDING this step's.
  slot_mapping      int64 [num_tokens] = page * page_size + offset; a negative slot is skipped
                    (padding tokens of a CUDA-graph batch).
  cos_sin           float32 [max_position, rotary_dim]: cos of the rotary_dim/2 frequencies,
                    then their sin (any rope scaling baked in).

Every function has a plain-torch path (fp32 accumulation): CPU tensors always take it. On CUDA,
decode runs the split-KV kernel (fusedist.ops._attention_decode) when the extension has it,
rope_append its fused kernel (csrc/ops/attention/rope_append.cu), and prefill runs torch SDPA
on the KV gathered from the pages (cuDNN / flash backends; lower-right causal alignment for a
chunk behind a cached prefix). The functions are also torch.ops.fusedist.rope_append /
attention_decode / attention_prefill (torch.compile(fullgraph=True) and CUDA graphs: plans and
cos_sin are built outside the graph; the ops read lengths and tables from device tensors).
"""

from __future__ import annotations

import importlib
import itertools
import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F

from .. import _align, _ext

FP8 = getattr(torch, "float8_e4m3fn", None)
FP8_MAX = 448.0
KV_DTYPES = (torch.bfloat16, torch.float16, torch.float32) + ((FP8,) if FP8 is not None else ())
ROPE_STYLES = ("neox", "gptj")
PREFILL_BACKENDS = ("auto", "sdpa", "reference")


# ----------------------------------------------------------------------------------------------
# RoPE tables
# ----------------------------------------------------------------------------------------------

def rope_inv_freq(rotary_dim: int, base: float = 10000.0,
                  scaling: Optional[dict] = None) -> torch.Tensor:
    """float64 [rotary_dim / 2] inverse frequencies, with the HF rope scaling applied:
    None / "default", "linear" (positions divided by factor) and "llama3" (Llama-3.1: long
    wavelengths divided by factor, a smooth blend between low_freq and high_freq)."""
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"fusedist.rope_cos_sin: rotary_dim must be a positive even number, got "
                         f"{rotary_dim}")
    inv = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    kind = _rope_type(scaling)
    if kind == "default":
        return inv
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv / factor
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling.get("original_max_position_embeddings", 8192))
    if high <= low:
        raise ValueError(f"fusedist.rope_cos_sin: llama3 scaling needs high_freq_factor > "
                         f"low_freq_factor, got {high} <= {low}")
    wavelen = 2 * math.pi / inv
    low_wavelen, high_wavelen = old_len / low, old_len / high
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


def _rope_type(scaling: Optional[dict]) -> str:
    if not scaling:
        return "default"
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ("default", "linear", "llama3"):
        raise ValueError(f"fusedist.rope_cos_sin: rope scaling type {kind!r} is not supported; "
                         "use None, 'linear' or 'llama3'")
    if kind != "default" and "factor" not in scaling:
        raise ValueError(f"fusedist.rope_cos_sin: {kind} scaling needs a 'factor'")
    return kind


def rope_cos_sin(head_dim: int, max_position: int, base: float = 10000.0,
                 scaling: Optional[dict] = None, *, device=None, dtype=torch.float32,
                 rotary_dim: Optional[int] = None) -> torch.Tensor:
    """[max_position, rotary_dim] table: cos(pos * f_i) for the rotary_dim/2 frequencies, then
    sin(pos * f_i); computed in float64, stored as `dtype` (float32). rotary_dim defaults to
    head_dim (partial rotary: the first rotary_dim features of a head rotate)."""
    rd = head_dim if rotary_dim is None else rotary_dim
    if rd > head_dim:
        raise ValueError(f"fusedist.rope_cos_sin: rotary_dim {rd} exceeds head_dim {head_dim}")
    if max_position <= 0:
        raise ValueError(f"fusedist.rope_cos_sin: max_position must be > 0, got {max_position}")
    inv = rope_inv_freq(rd, base, scaling)
    ang = torch.arange(max_position, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cat([ang.cos(), ang.sin()], dim=-1).to(dtype=dtype, device=device).contiguous()


# ----------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------

def _fail(op: str, msg: str):
    raise ValueError(f"fusedist.{op}: {msg}")


def _check_cache(op, k_cache, v_cache, k_scale, v_scale):
    if k_cache.dim() != 4:
        _fail(op, f"k_cache must be [num_pages, page_size, kv_heads, head_dim], got "
                  f"{tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        _fail(op, f"v_cache {tuple(v_cache.shape)} {v_cache.dtype} must match k_cache "
                  f"{tuple(k_cache.shape)} {k_cache.dtype}")
    if k_cache.dtype not in KV_DTYPES:
        _fail(op, f"cache dtype {k_cache.dtype} is not supported; use one of {KV_DTYPES}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not t.is_contiguous():
            _fail(op, f"{name} must be contiguous (stride {t.stride()}); allocate it with "
                      "PagedKVCache")
    fp8 = FP8 is not None and k_cache.dtype == FP8
    if fp8:
        want = tuple(k_cache.shape[:3])
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            if s is None:
                _fail(op, f"an FP8 cache needs {name} (float32 {list(want)}); pass the cache's "
                          "scales")
            if tuple(s.shape) != want or s.dtype != torch.float32 or not s.is_contiguous():
                _fail(op, f"{name} must be contiguous float32 {list(want)}, got "
                          f"{tuple(s.shape)} {s.dtype}")
    elif k_scale is not None or v_scale is not None:
        _fail(op, f"k_scale/v_scale are only for float8_e4m3fn caches (cache is {k_cache.dtype})")
    return fp8


def _check_tables(op, block_table, seq_lens, batch, device):
    if block_table.dim() != 2 or block_table.dtype != torch.int32 or block_table.shape[0] != batch:
        _fail(op, f"block_table must be int32 [batch={batch}, max_pages], got "
                  f"{tuple(block_table.shape)} {block_table.dtype}")
    if seq_lens.shape != (batch,) or seq_lens.dtype != torch.int32:
        _fail(op, f"seq_lens must be int32 [{batch}], got {tuple(seq_lens.shape)} "
                  f"{seq_lens.dtype}")
    for name, t in (("block_table", block_table), ("seq_lens", seq_lens)):
        if t.device != device:
            _fail(op, f"{name} is on {t.device}; it must be on {device} with the cache")


# ----------------------------------------------------------------------------------------------
# rope_append
# ----------------------------------------------------------------------------------------------

def rope_append(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                slot_mapping: torch.Tensor, *, style: str = "neox",
                k_scale: Optional[torch.Tensor] = None,
                v_scale: Optional[torch.Tensor] = None) -> None:
    """Rotates q [T, Hq, D] and k [T, Hkv, D] in place (first cos_sin.shape[1] features of each
    head) and writes the rotated k and v into the cache at slot_mapping [T] (negative: skipped).
    FP8 caches get per token-head scales amax / 448 of the rotated (rounded) k and of v."""
    _validate_rope(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, style,
                   k_scale, v_scale)
    if torch.compiler.is_compiling():
        torch.ops.fusedist.rope_append(q, k, v, positions, cos_sin, k_cache, v_cache,
                                       slot_mapping, style, k_scale, v_scale)
    else:
        _rope_append_impl(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, style,
                          k_scale, v_scale)


def _validate_rope(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, style,
                   k_scale, v_scale):
    op = "rope_append"
    if style not in ROPE_STYLES:
        _fail(op, f"style must be one of {ROPE_STYLES}, got {style!r}")
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape:
        _fail(op, f"q must be [T, Hq, D], k and v [T, Hkv, D]; got {tuple(q.shape)}, "
                  f"{tuple(k.shape)}, {tuple(v.shape)}")
    T, _, D = q.shape
    if k.shape[0] != T or k.shape[2] != D:
        _fail(op, f"k {tuple(k.shape)} must have q's tokens and head_dim ({T}, {D})")
    if k.dtype != q.dtype or v.dtype != q.dtype or q.dtype not in (torch.float32, torch.float16,
                                                                   torch.bfloat16):
        _fail(op, f"q, k, v must share one dtype of float32/float16/bfloat16, got {q.dtype}, "
                  f"{k.dtype}, {v.dtype}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            _fail(op, f"{name} needs unit stride in head_dim (stride {t.stride()})")
    if positions.shape != (T,) or positions.dtype not in (torch.int32, torch.int64):
        _fail(op, f"positions must be int32/int64 [{T}], got {tuple(positions.shape)} "
                  f"{positions.dtype}")
    if slot_mapping.shape != (T,) or slot_mapping.dtype != torch.int64:
        _fail(op, f"slot_mapping must be int64 [{T}], got {tuple(slot_mapping.shape)} "
                  f"{slot_mapping.dtype}")
    if cos_sin.dim() != 2 or cos_sin.dtype != torch.float32 or cos_sin.shape[1] % 2 or \
            cos_sin.shape[1] > D or not cos_sin.is_contiguous():
        _fail(op, f"cos_sin must be contiguous float32 [max_position, rotary_dim <= {D}] from "
                  f"rope_cos_sin, got {tuple(cos_sin.shape)} {cos_sin.dtype}")
    _check_cache(op, k_cache, v_cache, k_scale, v_scale)
    if tuple(k_cache.shape[2:]) != tuple(k.shape[1:]):
        _fail(op, f"k [T, {k.shape[1]}, {D}] does not fit the cache's [kv_heads, head_dim] = "
                  f"{list(k_cache.shape[2:])}")
    if FP8 is None or k_cache.dtype != FP8:
        if k_cache.dtype != k.dtype:
            _fail(op, f"cache dtype {k_cache.dtype} must be k's dtype {k.dtype} (or float8_e4m3fn)")
    for name, t in (("q", q), ("k", k), ("v", v), ("positions", positions), ("cos_sin", cos_sin),
                    ("slot_mapping", slot_mapping)):
        if t.device != k_cache.device:
            _fail(op, f"{name} is on {t.device}; it must be on the cache's device "
                      f"{k_cache.device}")


_warned: set = set()


def _warn_reference(op: str, why: str) -> None:
    """Once per process and reason: CUDA tensors are taking the plain-torch reference path
    (correct, but far slower than the kernel)."""
    if (op, why) in _warned:
        return
    _warned.add((op, why))
    warnings.warn(f"fusedist.{op}: CUDA tensors run the plain-torch reference path ({why})",
                  RuntimeWarning, stacklevel=4)


def _rope_kernel_ok(q, k, v, positions, cos_sin, k_cache, slot_mapping) -> bool:
    """The shapes csrc/ops/attention/rope_append.cu serves; others take the plain-torch path."""
    if q.device.type != "cuda" or not _ext.available() or not hasattr(_ext.load(),
                                                                      "rope_append"):
        return False
    D = q.shape[-1]
    return (q.dtype in (torch.float16, torch.bfloat16) and D % 8 == 0 and D <= 256
            and cos_sin.shape[1] % 16 == 0 and _align.is_aligned(cos_sin)
            and _align.is_aligned(k_cache) and all(_rows_ok(t) for t in (q, k, v))
            and positions.is_contiguous() and slot_mapping.is_contiguous())


def _rows_ok(t: torch.Tensor) -> bool:
    """[T, H, D] with contiguous heads at a 16-byte aligned token stride (a contiguous tensor
    or a slice of a fused QKV output)."""
    return (t.stride(2) == 1 and (t.shape[1] == 1 or t.stride(1) == t.shape[2])
            and _align.whole_vectors(t.stride(0) * t.element_size()) and _align.is_aligned(t))


def _rope_append_impl(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, style,
                      k_scale, v_scale) -> None:
    if q.shape[0] == 0:
        return
    if _rope_kernel_ok(q, k, v, positions, cos_sin, k_cache, slot_mapping):
        from .. import _dtypes
        C = _ext.load()
        a = C.RopeAppendArgs()
        a.q, a.k, a.v = q.data_ptr(), k.data_ptr(), v.data_ptr()
        a.positions, a.cos_sin = positions.data_ptr(), cos_sin.data_ptr()
        a.k_cache, a.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
        if k_scale is not None:
            a.k_scale, a.v_scale = k_scale.data_ptr(), v_scale.data_ptr()
        a.slot_mapping = slot_mapping.data_ptr()
        a.tokens, a.q_heads, a.kv_heads, a.head_dim = q.shape[0], q.shape[1], k.shape[1], \
            q.shape[2]
        a.rot, a.max_position = cos_sin.shape[1], cos_sin.shape[0]
        a.q_stride, a.k_stride, a.v_stride = q.stride(0), k.stride(0), v.stride(0)
        a.positions_int64 = positions.dtype == torch.int64
        a.style = ROPE_STYLES.index(style)
        a.dtype, a.cache_dtype = _dtypes.code(q.dtype), _dtypes.code(k_cache.dtype)
        C.rope_append(a, torch.cuda.current_stream(q.device).cuda_stream)
        return
    if q.device.type == "cuda":
        _warn_reference("rope_append", "fusedist._C without the rope_append kernel"
                        if not _ext.available() or not hasattr(_ext.load(), "rope_append") else
                        "a dtype, head_dim, layout or alignment the kernel does not serve")
    rope_append_reference(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping,
                          style=style, k_scale=k_scale, v_scale=v_scale)


def apply_rope_reference(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                         style: str = "neox") -> torch.Tensor:
    """Rotated copy of x [T, H, D] in fp32 (first cos_sin.shape[1] features of each head)."""
    half = cos_sin.shape[1] // 2
    cs = cos_sin[positions.long()].float()
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    xf = x.float()
    r = xf[..., :2 * half]
    if style == "neox":
        x1, x2 = r[..., :half], r[..., half:]
        rot = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    else:
        x1, x2 = r[..., 0::2], r[..., 1::2]
        rot = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
    return torch.cat([rot, xf[..., 2 * half:]], dim=-1)


def quantize_fp8_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (e4m3 [..., D], float32 scale [...]) with scale = amax / 448 over D;
    an all-zero row gets scale 0 and zeros."""
    xf = x.float()
    scale = xf.abs().amax(-1) / FP8_MAX
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    return (xf * inv[..., None]).to(FP8), scale


def rope_append_reference(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, *,
                          style="neox", k_scale=None, v_scale=None) -> None:
    """Plain-torch rope_append (fp32 rotation, one rounding to q's dtype)."""
    q.copy_(apply_rope_reference(q, positions, cos_sin, style).to(q.dtype))
    k.copy_(apply_rope_reference(k, positions, cos_sin, style).to(k.dtype))
    slots = slot_mapping
    kk, vv = k, v
    keep = slots >= 0
    if not bool(keep.all()):
        slots, kk, vv = slots[keep], kk[keep], vv[keep]
    H, D = k_cache.shape[2], k_cache.shape[3]
    fk, fv = k_cache.view(-1, H, D), v_cache.view(-1, H, D)
    if FP8 is not None and k_cache.dtype == FP8:
        for src, dst, sc in ((kk, fk, k_scale), (vv, fv, v_scale)):
            qv, s = quantize_fp8_reference(src)
            dst[slots] = qv
            sc.view(-1, H)[slots] = s
    else:
        fk[slots] = kk.to(k_cache.dtype)
        fv[slots] = vv.to(v_cache.dtype)


@torch.library.custom_op("fusedist::rope_append",
                         mutates_args=("q", "k", "k_cache", "v_cache", "k_scale", "v_scale"))
def _rope_append_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                    cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, style: str, k_scale: Optional[torch.Tensor],
                    v_scale: Optional[torch.Tensor]) -> None:
    _rope_append_impl(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, style,
                      k_scale, v_scale)


@_rope_append_op.register_fake
def _(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, style, k_scale, v_scale):
    return None


# ----------------------------------------------------------------------------------------------
# KV gathering (reference paths and the prefill SDPA path)
# ----------------------------------------------------------------------------------------------

def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, num_pages: int,
              scale: Optional[torch.Tensor] = None, dtype=torch.float32) -> torch.Tensor:
    """[B, num_pages * page_size, H, D] of `dtype`: each row's first num_pages pages laid end to
    end (entries clamped into range; the caller masks tokens past seq_len), FP8 dequantized."""
    P, ps, H, D = cache.shape
    bt = block_table[:, :num_pages].long().clamp(0, P - 1)
    g = cache[bt]                                            # [B, n, ps, H, D]
    if scale is not None:   # dequantize in fp32, round once
        g = g.float() * scale[bt][..., None]
    out = g.to(dtype)
    return out.reshape(bt.shape[0], num_pages * ps, H, D)


def _gather_seqs(cache, pages, length, scale, dtype):
    """[B, length, H, D] of B sequences from their page lists (long [B, pages])."""
    P, ps, H, D = cache.shape
    g = cache[pages]                                         # [B, pages, ps, H, D]
    if scale is not None:   # dequantize in fp32, round once
        g = (g.float() * scale[pages][..., None]).to(dtype)
    return g.to(dtype).reshape(pages.shape[0], -1, H, D)[:, :length]


# ----------------------------------------------------------------------------------------------
# decode
# ----------------------------------------------------------------------------------------------

_plan_ids = itertools.count()
_plans: dict[int, "DecodePlan"] = {}


@dataclass
class DecodePlan:
    """Host-side decode plan made OUTSIDE CUDA graphs: a fixed grid and split count for
    (batch, heads, head_dim, page_size, max_seq_len), and the workspace the kernel's partial
    results live in. Reuse it for every step (and every layer) of that shape; a captured graph
    replays with new seq_lens / block_table values under the same plan."""
    batch: int
    q_heads: int
    kv_heads: int
    head_dim: int
    page_size: int
    max_seq_len: int
    device: torch.device
    dtype: torch.dtype
    kv_dtype: torch.dtype
    impl: Any = None            # the kernel's plan (fusedist.ops._attention_decode), or None
    plan_id: int = field(default=-1)

    def close(self) -> None:
        """Release the workspace: the plan leaves the registry torch.ops.fusedist calls find it
        in (plans are kept until closed). Never close a plan a captured graph still replays."""
        _plans.pop(self.plan_id, None)
        self.impl = None

    @property
    def closed(self) -> bool:
        return self.plan_id < 0 or self.plan_id not in _plans

    @property
    def max_pages(self) -> int:
        return -(-self.max_seq_len // self.page_size)

    @property
    def backend(self) -> str:
        return "kernel" if self.impl is not None else "reference"


def _decode_module():
    """fusedist.ops._attention_decode when it and the extension's decode kernel are present."""
    try:
        mod = importlib.import_module("fusedist.ops._attention_decode")
    except ImportError:
        return None
    if not _ext.available():
        return None
    avail = getattr(mod, "available", None)
    try:
        return mod if avail is None or avail() else None
    except Exception:  # noqa: BLE001 - an unusable kernel falls back to the reference path
        return None


def _decode_kernel_fits(head_dim, page_size, dtype, kv_dtype) -> bool:
    """The shapes the decode kernel serves (fusedist/ops/_attention_decode.py); others take the
    plain-torch path."""
    return (head_dim in (64, 128, 256) and page_size % 16 == 0
            and dtype in (torch.bfloat16, torch.float16) and kv_dtype in (dtype, FP8))


def decode_plan(batch: int, q_heads: int, kv_heads: int, head_dim: int, page_size: int,
                max_seq_len: int, device=None, dtype=torch.bfloat16,
                kv_dtype: Optional[torch.dtype] = None) -> DecodePlan:
    """Plan decode for up to `batch` sequences of up to max_seq_len tokens (host side, outside
    graphs). kv_dtype defaults to dtype; float8_e4m3fn for FP8 caches."""
    op = "decode_plan"
    for name, val in (("batch", batch), ("q_heads", q_heads), ("kv_heads", kv_heads),
                      ("head_dim", head_dim), ("page_size", page_size),
                      ("max_seq_len", max_seq_len)):
        if not isinstance(val, int) or val <= 0:
            _fail(op, f"{name} must be a positive int, got {val!r}")
    if q_heads % kv_heads:
        _fail(op, f"q_heads={q_heads} must be a multiple of kv_heads={kv_heads}")
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    if kv_dtype not in KV_DTYPES:
        _fail(op, f"kv_dtype {kv_dtype} is not supported; use one of {KV_DTYPES}")
    plan = DecodePlan(batch, q_heads, kv_heads, head_dim, page_size, max_seq_len, device,
                      dtype, kv_dtype)
    if device.type == "cuda" and _decode_kernel_fits(head_dim, page_size, dtype, kv_dtype):
        mod = _decode_module()
        if mod is not None:
            plan.impl = mod.plan_decode(batch=batch, q_heads=q_heads, kv_heads=kv_heads,
                                        head_dim=head_dim, page_size=page_size,
                                        max_seq_len=max_seq_len, device=device, dtype=dtype,
                                        kv_dtype=kv_dtype)
    plan.plan_id = next(_plan_ids)
    _plans[plan.plan_id] = plan
    return plan


def _check_query(op, q, k_cache, fp8, rows):
    """q [rows, q_heads, head_dim] against a cache [pages, page_size, kv_heads, head_dim]: its
    dtype, shape, GQA ratio and device (decode: rows = "batch", prefill: "tokens")."""
    if q.dim() != 3 or q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        _fail(op, f"q must be [{rows}, q_heads, head_dim] of float32/float16/bfloat16, got "
                  f"{tuple(q.shape)} {q.dtype}")
    _, Hq, D = q.shape
    Hkv, Dc = k_cache.shape[2], k_cache.shape[3]
    if Dc != D or Hq % Hkv:
        _fail(op, f"q [{rows}, {Hq}, {D}] does not fit the cache's [kv_heads, head_dim] = "
                  f"[{Hkv}, {Dc}] (q_heads must be a multiple of kv_heads)")
    if not fp8 and k_cache.dtype != q.dtype:
        _fail(op, f"cache dtype {k_cache.dtype} must be q's dtype {q.dtype} (or float8_e4m3fn)")
    if q.device != k_cache.device:
        _fail(op, f"q is on {q.device}; it must be on the cache's device {k_cache.device}")


def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           block_table: torch.Tensor, seq_lens: torch.Tensor, plan: Optional[DecodePlan] = None,
           *, scale: Optional[float] = None, out: Optional[torch.Tensor] = None,
           k_scale: Optional[torch.Tensor] = None,
           v_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """out [B, Hq, D] = softmax(q k^T * scale) v over each sequence's seq_lens[b] cached tokens
    (q head h reads kv head h // (Hq / Hkv)); a sequence with seq_len 0 gets zeros. plan=None on
    CUDA plans on the spot (not inside a graph: make the plan first)."""
    op = "decode"
    fp8 = _check_cache(op, k_cache, v_cache, k_scale, v_scale)
    _check_query(op, q, k_cache, fp8, "batch")
    B, Hq, D = q.shape
    _, ps, Hkv, _ = k_cache.shape
    _check_tables(op, block_table, seq_lens, B, k_cache.device)
    if not q.is_contiguous():
        q = q.contiguous()
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous():
        _fail(op, f"out must be contiguous {tuple(q.shape)} {q.dtype}, got {tuple(out.shape)} "
                  f"{out.dtype}")
    if plan is not None:
        if (plan.q_heads, plan.kv_heads, plan.head_dim, plan.page_size) != (Hq, Hkv, D, ps) or \
                plan.batch < B or plan.kv_dtype != k_cache.dtype or plan.dtype != q.dtype:
            _fail(op, f"plan (batch<={plan.batch}, heads {plan.q_heads}/{plan.kv_heads}, "
                      f"head_dim {plan.head_dim}, page_size {plan.page_size}, {plan.dtype}/"
                      f"{plan.kv_dtype}) does not fit this call (batch {B}, heads {Hq}/{Hkv}, "
                      f"head_dim {D}, page_size {ps}, {q.dtype}/{k_cache.dtype}); make a plan "
                      "for this shape")
    if plan is not None and plan.closed:
        _fail(op, "plan was closed (DecodePlan.close()); make a new one with decode_plan()")
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    pid = -1 if plan is None else plan.plan_id
    if torch.compiler.is_compiling():
        torch.ops.fusedist.attention_decode(out, q, k_cache, v_cache, block_table, seq_lens,
                                            scale, k_scale, v_scale, pid)
    else:
        _decode_impl(out, q, k_cache, v_cache, block_table, seq_lens, scale, k_scale, v_scale,
                     plan)
    return out


def _decode_impl(out, q, k_cache, v_cache, block_table, seq_lens, scale, k_scale, v_scale,
                 plan: Optional[DecodePlan]) -> None:
    if q.shape[0] == 0:
        return
    if q.device.type == "cuda":
        if plan is None:
            B, Hq, D = q.shape
            plan = decode_plan(B, Hq, k_cache.shape[2], D, k_cache.shape[1],
                               block_table.shape[1] * k_cache.shape[1], q.device, q.dtype,
                               k_cache.dtype)
        if plan.impl is not None:
            _decode_module().run_decode(plan.impl, q, k_cache, v_cache, block_table, seq_lens,
                                        out=out, scale=scale, k_scale=k_scale, v_scale=v_scale)
            return
        _warn_reference("decode", "fusedist._C without the decode kernel"
                        if _decode_module() is None else
                        "a head_dim, page size or dtype the decode kernel does not serve")
    decode_reference(q, k_cache, v_cache, block_table, seq_lens, scale=scale, out=out,
                     k_scale=k_scale, v_scale=v_scale)


def decode_reference(q, k_cache, v_cache, block_table, seq_lens, *, scale=None, out=None,
                     k_scale=None, v_scale=None, num_pages: Optional[int] = None):
    """Plain-torch decode, fp32 accumulation, no host synchronization on CUDA (so it can be
    captured): reads num_pages pages per row (default: all of block_table's columns on CUDA,
    as many as the longest sequence needs on CPU) and masks tokens past seq_len (NaN in
    pages or slots it must not read does not leak)."""
    B, Hq, D = q.shape
    P, ps, Hkv, _ = k_cache.shape
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    if num_pages is None:
        if q.device.type == "cpu":
            longest = int(seq_lens.max()) if B else 0
            num_pages = max(1, min(block_table.shape[1], -(-longest // ps)))
        else:
            num_pages = block_table.shape[1]
    k = gather_kv(k_cache, block_table, num_pages, k_scale)     # [B, S, Hkv, D]
    v = gather_kv(v_cache, block_table, num_pages, v_scale)
    S = k.shape[1]
    valid = torch.arange(S, device=q.device)[None, :] < seq_lens[:, None].long()   # [B, S]
    vmask = valid[:, :, None, None]
    k = torch.where(vmask, k, 0.0)
    v = torch.where(vmask, v, 0.0)
    qf = q.float().view(B, Hkv, Hq // Hkv, D)
    s = torch.einsum("bhgd,bshd->bhgs", qf, k) * scale
    s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1)
    p = torch.where(valid[:, None, None, :], p, 0.0)           # seq_len 0: zeros, not NaN
    o = torch.einsum("bhgs,bshd->bhgd", p, v).reshape(B, Hq, D)
    if out is None:
        return o.to(q.dtype)
    out.copy_(o)
    return out


@torch.library.custom_op("fusedist::attention_decode", mutates_args=("out",))
def _decode_op(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
               k_scale: Optional[torch.Tensor], v_scale: Optional[torch.Tensor],
               plan_id: int) -> None:
    plan = _plans.get(plan_id) if plan_id >= 0 else None
    if plan_id >= 0 and plan is None:
        _fail("decode", f"plan {plan_id} was closed (DecodePlan.close()); make a new one with "
              "decode_plan()")
    _decode_impl(out, q, k_cache, v_cache, block_table, seq_lens, scale, k_scale, v_scale, plan)


@_decode_op.register_fake
def _(out, q, k_cache, v_cache, block_table, seq_lens, scale, k_scale, v_scale, plan_id):
    return None


# ----------------------------------------------------------------------------------------------
# prefill
# ----------------------------------------------------------------------------------------------

def prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            block_table: torch.Tensor, seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor, *,
            scale: Optional[float] = None, out: Optional[torch.Tensor] = None,
            max_q_len: Optional[int] = None, k_scale: Optional[torch.Tensor] = None,
            v_scale: Optional[torch.Tensor] = None, backend: str = "auto",
            seq_lens_host: Optional[Sequence[int]] = None,
            cu_seqlens_q_host: Optional[Sequence[int]] = None,
            k_new: Optional[torch.Tensor] = None,
            v_new: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Chunked prefill: sequence b's n_b = cu_seqlens_q[b+1] - cu_seqlens_q[b] new tokens
    q[cu_seqlens_q[b]:cu_seqlens_q[b+1]] are the last n_b of its seq_lens[b] cached tokens;
    new token i attends to cached tokens [0, seq_lens[b] - n_b + i]. Returns out [T, Hq, D]
    (with out=None and one sequence, SDPA's own output, no copy).
    backend: "sdpa" (torch SDPA on the gathered KV), "reference" (fp32 plain torch), "auto"
    (sdpa on CUDA, reference on CPU). The lengths are needed on the host: pass
    seq_lens_host / cu_seqlens_q_host (the runner has them) to skip reading the device
    tensors, which synchronizes with the GPU (prefill is not graph-captured).
    k_new, v_new [T, Hkv, D] (optional, q's dtype): the keys and values rope_append just wrote
    for these tokens; a sequence whose cache holds only its new tokens (no prefix) then reads
    them instead of gathering its pages (bf16/fp16 caches, which hold the same values; FP8
    caches always read the cache)."""
    op = "prefill"
    if backend not in PREFILL_BACKENDS:
        _fail(op, f"backend must be one of {PREFILL_BACKENDS}, got {backend!r}")
    fp8 = _check_cache(op, k_cache, v_cache, k_scale, v_scale)
    _check_query(op, q, k_cache, fp8, "tokens")
    T, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    B = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    if cu_seqlens_q.shape != (B + 1,) or cu_seqlens_q.dtype not in (torch.int32, torch.int64):
        _fail(op, f"cu_seqlens_q must be int32/int64 [batch + 1 = {B + 1}], got "
                  f"{tuple(cu_seqlens_q.shape)} {cu_seqlens_q.dtype}")
    _check_tables(op, block_table, seq_lens, B, k_cache.device)
    if (k_new is None) != (v_new is None):
        _fail(op, "pass k_new and v_new together (or neither)")
    if k_new is not None:
        for name, t in (("k_new", k_new), ("v_new", v_new)):
            if tuple(t.shape) != (T, Hkv, D) or t.dtype != q.dtype or t.device != q.device:
                _fail(op, f"{name} must be [{T}, {Hkv}, {D}] {q.dtype} on {q.device}, got "
                          f"{tuple(t.shape)} {t.dtype} on {t.device}")
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype):
        _fail(op, f"out must be {tuple(q.shape)} {q.dtype}, got {tuple(out.shape)} {out.dtype}")
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    mq = -1 if max_q_len is None else int(max_q_len)
    if torch.compiler.is_compiling():
        out = torch.empty_like(q) if out is None else out
        torch.ops.fusedist.attention_prefill(out, q, k_cache, v_cache, block_table, seq_lens,
                                             cu_seqlens_q, scale, mq, k_scale, v_scale, backend)
        return out
    return _prefill_impl(out, q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, scale,
                         mq, k_scale, v_scale, backend, seq_lens_host, cu_seqlens_q_host,
                         k_new, v_new)


def _prefill_bounds(op, cu_seqlens_q, seq_lens, T, block_table, page_size, lens=None, cu=None):
    cu = cu_seqlens_q.tolist() if cu is None else [int(c) for c in cu]
    lens = seq_lens.tolist() if lens is None else [int(n) for n in lens]
    if len(cu) != len(lens) + 1:
        _fail(op, f"cu_seqlens_q_host has {len(cu)} entries for {len(lens)} sequences")
    if cu[0] != 0 or cu[-1] != T or any(b < a for a, b in zip(cu, cu[1:])):
        _fail(op, f"cu_seqlens_q must rise from 0 to the {T} query tokens, got {cu}")
    for b, (a, e) in enumerate(zip(cu, cu[1:])):
        if e - a > lens[b]:
            _fail(op, f"sequence {b} has {e - a} new tokens but seq_lens[{b}] = {lens[b]}; "
                      "seq_lens counts the cached tokens including the new ones (append first)")
        if -(-lens[b] // page_size) > block_table.shape[1]:
            _fail(op, f"seq_lens[{b}] = {lens[b]} needs more pages than block_table's "
                      f"{block_table.shape[1]} columns")
    return cu, lens


def _prefill_impl(out, q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, scale,
                  max_q_len, k_scale, v_scale, backend, lens=None, cu=None, k_new=None,
                  v_new=None) -> torch.Tensor:
    T = q.shape[0]
    if T == 0:
        return torch.empty_like(q) if out is None else out
    ps = k_cache.shape[1]
    if lens is not None and len(lens) != seq_lens.shape[0]:
        _fail("prefill", f"seq_lens_host has {len(lens)} entries, seq_lens {seq_lens.shape[0]}")
    cu, lens = _prefill_bounds("prefill", cu_seqlens_q, seq_lens, T, block_table, ps, lens, cu)
    use_sdpa = backend == "sdpa" or (backend == "auto" and q.device.type == "cuda")
    # SDPA takes one dtype: q's for bf16/fp16 caches. FP8 caches dequantize to fp32 and SDPA
    # runs in fp32: rounding dequantized K/V to bf16 on top of the flash-style P rounding
    # costs up to ~0.8% relative per row, too close to the bf16 budget.
    fp8 = k_scale is not None
    kv_dtype = q.dtype if use_sdpa and not fp8 else torch.float32
    runs = prefill_runs(cu, lens)
    for f, l in runs:
        B, n, L = l - f, cu[f + 1] - cu[f], lens[f]
        a, e = cu[f], cu[l]
        qb = q[a:e].unflatten(0, (B, n))                            # [B, n, Hq, D]
        if k_new is not None and n == L and not fp8:   # no prefix: the fresh K/V
            k, v = (t[a:e].unflatten(0, (B, n)).to(kv_dtype) for t in (k_new, v_new))
        else:
            pages = block_table[f:l, :-(-L // ps)].long()
            k = _gather_seqs(k_cache, pages, L, k_scale, kv_dtype)   # [B, L, Hkv, D]
            v = _gather_seqs(v_cache, pages, L, v_scale, kv_dtype)
        o = _sdpa_chunk(qb.to(kv_dtype), k, v, scale) if use_sdpa else \
            _reference_chunk(qb, k, v, scale)
        if out is None and len(runs) == 1 and o.dtype == q.dtype:
            return o.reshape(q.shape)   # one call covered every sequence: one copy
        if out is None:
            out = torch.empty_like(q)
        out[a:e].unflatten(0, (B, n)).copy_(o)
    return out


# Sequences one prefill SDPA call takes: adjacent sequences with the same new-token count and
# cache length (a batch of equal prompts, or of equal chunks behind equal prefixes), up to
# PREFILL_GATHER_TOKENS cached tokens per call (a call gathers that many K and V rows).
PREFILL_GATHER_TOKENS = 1 << 19


def prefill_runs(cu: Sequence[int], lens: Sequence[int],
                 max_tokens: int = PREFILL_GATHER_TOKENS) -> list[tuple[int, int]]:
    """[first, last) ranges of adjacent sequences with equal (new tokens, cached tokens),
    at most max_tokens cached tokens per range (at least one sequence); sequences without
    new tokens are in no range."""
    runs: list[tuple[int, int]] = []
    for b in range(len(lens)):
        n = cu[b + 1] - cu[b]
        if n == 0:
            continue
        if runs:
            f, l = runs[-1]
            if l == b and cu[f + 1] - cu[f] == n and lens[f] == lens[b] and \
                    (b + 1 - f) * lens[b] <= max_tokens:
                runs[-1] = (f, b + 1)
                continue
        runs.append((b, b + 1))
    return runs


# Prefill on CUDA: torch SDPA backends in this order of preference (the first that takes the
# inputs runs), and whether GQA heads are expanded (repeat_interleave) so backends without
# native GQA (cuDNN on some torch builds) can take the call. benchmarks/attention_prefill.py
# measures the alternatives; docs/design/attention.md records the choice.
PREFILL_SDPA_BACKENDS = ("cudnn", "flash", "efficient", "math")
PREFILL_EXPAND_GQA = False


SDPA_NAMES = ("cudnn", "flash", "efficient", "math")
_sdpa_default_set = False


def _init_sdpa_default(device) -> None:
    """Make torch settle its own default SDPA priority before fusedist first changes it.
    torch sets that default (cuDNN first on Hopper / Blackwell with a recent cuDNN) once per
    process, at its first backend selection; `sdpa_kernel(..., set_priority=True)` restores
    on exit the order it found on entry. A process whose first SDPA call ran inside such a
    context therefore kept the pre-default order (flash > efficient > math > cuDNN) for good:
    every later plain SDPA call, a torch baseline's included, took the memory-efficient kernel
    for a masked call cuDNN would have run. One backend selection (no kernel) settles it."""
    global _sdpa_default_set
    if _sdpa_default_set:
        return
    _sdpa_default_set = True
    choose = getattr(torch, "_fused_sdp_choice", None)
    if choose is None:
        return
    try:
        t = torch.empty((1, 1, 2, 8), device=device, dtype=torch.float16)
        choose(t, t, t)
    except Exception:  # noqa: BLE001 - a torch without the private op keeps its behavior
        pass


def sdpa_priority(device, order: Sequence[str] = SDPA_NAMES):
    """A context in which SDPA calls on `device` try the backends `order` (names of
    SDPA_NAMES) first, in that order, then the others in torch's order (CUDA; a null context
    on other devices or inside torch.compile, where the caller sets it around the compiled
    call). Leaving it restores torch's own default order (_init_sdpa_default)."""
    import contextlib
    device = torch.device(device)
    if device.type != "cuda" or torch.compiler.is_compiling():
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    names = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
             "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
    bad = [n for n in order if n not in names]
    if bad:
        _fail("sdpa_priority", f"unknown SDPA backends {bad}; use names of {SDPA_NAMES}")
    _init_sdpa_default(device)
    backends = [names[n] for n in order] + [b for n, b in names.items() if n not in order]
    try:
        return sdpa_kernel(backends, set_priority=True)
    except TypeError:   # torch without set_priority: the allowed set only
        return sdpa_kernel([names[n] for n in order])


def _sdpa_context(device):
    return sdpa_priority(device, PREFILL_SDPA_BACKENDS)


def _sdpa_chunk(q, k, v, scale):
    """q [B, n, Hq, D] against k, v [B, L, Hkv, D]; token i sees keys [0, L - n + i]."""
    from torch.nn.attention.bias import causal_lower_right
    n, L = q.shape[1], k.shape[1]
    rep = q.shape[2] // k.shape[2]
    if rep > 1 and PREFILL_EXPAND_GQA:
        k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))   # [B, H, len, D]
    gqa = qh.shape[1] != kh.shape[1]
    with _sdpa_context(q.device):
        if n == L:
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale,
                                               enable_gqa=gqa)
        else:
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=causal_lower_right(n, L),
                                               scale=scale, enable_gqa=gqa)
    return o.transpose(1, 2)


def _reference_chunk(q, k, v, scale):
    B, n, Hq, D = q.shape
    L, Hkv = k.shape[1], k.shape[2]
    qf = q.float().unflatten(2, (Hkv, Hq // Hkv))
    s = torch.einsum("bnhgd,blhd->bhgnl", qf, k.float()) * scale
    allowed = torch.arange(L, device=q.device)[None, :] <= \
        (L - n + torch.arange(n, device=q.device))[:, None]
    s = s.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.einsum("bhgnl,blhd->bnhgd", p, v.float()).reshape(B, n, Hq, D)


def prefill_reference(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, *, scale=None,
                      k_scale=None, v_scale=None):
    """The fp32 plain-torch prefill (prefill(..., backend="reference"))."""
    return prefill(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, scale=scale,
                   k_scale=k_scale, v_scale=v_scale, backend="reference")


@torch.library.custom_op("fusedist::attention_prefill", mutates_args=("out",))
def _prefill_op(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                cu_seqlens_q: torch.Tensor, scale: float, max_q_len: int,
                k_scale: Optional[torch.Tensor], v_scale: Optional[torch.Tensor],
                backend: str) -> None:
    _prefill_impl(out, q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, scale,
                  max_q_len, k_scale, v_scale, backend)


@_prefill_op.register_fake
def _(out, q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, scale, max_q_len, k_scale,
      v_scale, backend):
    return None
