"""Paged split-KV decode attention: the planner and the launcher behind fusedist's decode().

    plan = plan_decode(batch, q_heads, kv_heads, head_dim, page_size, max_seq_len, *,
                       device=None, num_sms=None, num_splits=None,
                       dtype=torch.bfloat16, kv_dtype=None) -> DecodeWorkPlan
    run_decode(plan, q, k_cache, v_cache, block_table, seq_lens, out, scale=None,
               k_scale=None, v_scale=None) -> out      (scale None: head_dim ** -0.5)
    available() -> bool        (fusedist._C is built with the decode kernel)

Layouts (csrc/include/fusedist/attention/decode.cuh): q, out [B, q_heads, head_dim] bf16/fp16
contiguous; k_cache, v_cache [num_pages, page_size, kv_heads, head_dim] of q's dtype or
float8_e4m3fn with float32 k_scale, v_scale [num_pages, page_size, kv_heads] (value = fp8 *
scale); block_table int32 [B, max_pages] (row stride may exceed max_pages; entries past
ceil(seq_lens[b] / page_size) are never read); seq_lens int32 [B] (a length <= 0 gives zeros).
page_size is a multiple of 16; head_dim 64, 128 or 256; q_heads a multiple of kv_heads.

plan_decode runs on the host, outside CUDA graphs: it fixes the grid (num_splits per
sequence: each sequence's slabs of 16 tokens are cut into num_splits equal runs at run time,
from its own length) and owns the workspace (fp32 partial O and LSE, the merge counters),
sized for `batch` sequences. run_decode launches on the current stream, captures into CUDA
graphs (lengths and block tables are read on the device: replays may change them), and takes
any batch <= plan.batch. One plan's workspace serves one call at a time (stream order).
Results are bitwise identical run to run and between eager and graph replay.

choose_num_splits(...) is the planner's rule, a pure function (tests run it on the CPU).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from .. import _dtypes, _ext

HEAD_DIMS = (64, 128, 256)
SLAB = 16          # tokens per slab (csrc: kDecodeSlab)
TILE_HEADS = 8     # query heads one CTA serves (csrc: kDecodeTileHeads)
MAX_SPLITS = 128   # csrc: kDecodeMaxSplits
# The rule's knobs: a split covers at least MIN_SLABS_PER_SPLIT slabs (fewer leaves the
# four warps of a CTA without a pipeline to fill), and at most MAX_MERGE_SPLITS splits are
# merged (the merge reads num_splits x heads x head_dim fp32 values in one CTA). Measured on
# one H200 (benchmarks/results/h200-w1/attention.md, "sweep" rows): one CTA per SM (132) is
# the best or within 3% of the best split count at 16/4 and 32/8 heads, batch 1-16; a second
# wave of CTAs per SM only adds merge work.
MIN_SLABS_PER_SPLIT = 8
MAX_MERGE_SPLITS = 32


def available() -> bool:
    """True when fusedist._C carries the decode kernel."""
    return _ext.available() and hasattr(_ext.load(), "attention_decode")


def choose_num_splits(batch: int, kv_heads: int, q_tiles: int, max_seq_len: int,
                      num_sms: int) -> int:
    """Splits per sequence: about one CTA per SM when batch x head tiles alone leaves SMs
    idle, never splits of fewer than MIN_SLABS_PER_SPLIT slabs, never more than
    MAX_MERGE_SPLITS. A batch that fills the SMs on its own takes 1 split (no merge)."""
    ctas = max(1, batch * kv_heads * q_tiles)
    slabs = max(1, math.ceil(max_seq_len / SLAB))
    by_wave = max(1, num_sms) // ctas
    by_len = slabs // MIN_SLABS_PER_SPLIT
    return max(1, min(by_wave, by_len, MAX_MERGE_SPLITS, MAX_SPLITS))


@dataclass
class DecodeWorkPlan:
    batch: int
    q_heads: int
    kv_heads: int
    head_dim: int
    page_size: int
    max_seq_len: int
    num_splits: int
    q_tiles: int
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    device: torch.device
    # Workspace (None when num_splits == 1): o_partial float32 [batch, q_heads, num_splits,
    # head_dim] and lse_partial float32 [batch, q_heads, num_splits], written by the split
    # CTAs and read by the merging CTA; counters int32 [batch, kv_heads * q_tiles], zero
    # between calls (the last CTA of each tile puts its counter back to zero).
    o_partial: Optional[torch.Tensor] = None
    lse_partial: Optional[torch.Tensor] = None
    counters: Optional[torch.Tensor] = None

    @property
    def grid(self) -> tuple[int, int, int]:
        return (self.num_splits, self.kv_heads * self.q_tiles, self.batch)


def _check_shape(batch, q_heads, kv_heads, head_dim, page_size, max_seq_len):
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"fusedist.decode: head_dim must be one of {HEAD_DIMS}, got {head_dim}")
    if kv_heads <= 0 or q_heads <= 0 or q_heads % kv_heads:
        raise ValueError(f"fusedist.decode: q_heads ({q_heads}) must be a positive multiple of "
                         f"kv_heads ({kv_heads})")
    if page_size <= 0 or page_size % SLAB:
        raise ValueError(f"fusedist.decode: page_size must be a positive multiple of {SLAB}, "
                         f"got {page_size}")
    if not 0 <= batch <= 65535:
        raise ValueError(f"fusedist.decode: batch must be in [0, 65535], got {batch}")
    if max_seq_len < 0:
        raise ValueError(f"fusedist.decode: max_seq_len must be >= 0, got {max_seq_len}")


def plan_decode(batch: int, q_heads: int, kv_heads: int, head_dim: int, page_size: int,
                max_seq_len: int, *, device=None, num_sms: Optional[int] = None,
                num_splits: Optional[int] = None,
                dtype: torch.dtype = torch.bfloat16,
                kv_dtype: Optional[torch.dtype] = None) -> DecodeWorkPlan:
    """The grid and workspace for decode calls of up to `batch` sequences (module docstring).
    num_sms defaults to the device's SM count; num_splits overrides the rule (benchmarks sweep it). dtype is q's and out's."""
    _check_shape(batch, q_heads, kv_heads, head_dim, page_size, max_seq_len)
    q_dtype = dtype
    kv_dtype = q_dtype if kv_dtype is None else kv_dtype
    if q_dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"fusedist.decode: q dtype must be bfloat16 or float16, got {q_dtype}")
    fp8 = getattr(torch, "float8_e4m3fn", None)
    if kv_dtype not in (q_dtype, fp8):
        raise TypeError(f"fusedist.decode: the KV cache dtype must be q's ({q_dtype}) or "
                        f"float8_e4m3fn, got {kv_dtype}")
    device = torch.device("cuda", torch.cuda.current_device()) if device is None \
        else torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    q_tiles = math.ceil(q_heads // kv_heads / TILE_HEADS)
    if num_splits is None:
        if num_sms is None:
            num_sms = torch.cuda.get_device_properties(device).multi_processor_count \
                if device.type == "cuda" else 132
        num_splits = choose_num_splits(batch, kv_heads, q_tiles, max_seq_len, num_sms)
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"fusedist.decode: num_splits must be in [1, {MAX_SPLITS}], got "
                         f"{num_splits}")
    plan = DecodeWorkPlan(batch, q_heads, kv_heads, head_dim, page_size, max_seq_len,
                          num_splits, q_tiles, q_dtype, kv_dtype, device)
    if num_splits > 1:
        plan.o_partial = torch.empty((batch, q_heads, num_splits, head_dim),
                                     dtype=torch.float32, device=device)
        plan.lse_partial = torch.empty((batch, q_heads, num_splits), dtype=torch.float32,
                                       device=device)
        plan.counters = torch.zeros((batch, kv_heads * q_tiles), dtype=torch.int32,
                                    device=device)
    return plan


def _need(cond: bool, msg: str):
    if not cond:
        raise ValueError("fusedist.decode: " + msg)


def run_decode(plan: DecodeWorkPlan, q: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
               out: torch.Tensor, scale: Optional[float] = None, k_scale: Optional[torch.Tensor] = None,
               v_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """out[b, h] = softmax(scale * q[b, h] . K[b]^T) V[b] over the seq_lens[b] cached tokens
    of sequence b (module docstring for the layouts); returns out."""
    B = q.shape[0] if q.dim() == 3 else -1
    _need(q.dim() == 3 and tuple(q.shape[1:]) == (plan.q_heads, plan.head_dim),
          f"q must be [batch, {plan.q_heads}, {plan.head_dim}], got {tuple(q.shape)}")
    _need(B <= plan.batch, f"q has batch {B} but the plan was made for {plan.batch}; plan "
          "for the largest batch")
    _need(q.dtype == plan.q_dtype, f"q is {q.dtype}, the plan expects {plan.q_dtype}")
    _need(q.is_cuda and q.device == plan.device, f"q must be on {plan.device}, got {q.device}")
    _need(q.is_contiguous(), f"q is non-contiguous (stride {tuple(q.stride())}); call "
          ".contiguous() first")
    _need(out.shape == q.shape and out.dtype == q.dtype and out.device == q.device
          and out.is_contiguous(), f"out must be a contiguous {tuple(q.shape)} tensor of "
          f"{q.dtype} on {q.device}")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        _need(c.dim() == 4 and c.shape[1] == plan.page_size and c.shape[2] == plan.kv_heads
              and c.shape[3] == plan.head_dim,
              f"{name} must be [num_pages, {plan.page_size}, {plan.kv_heads}, "
              f"{plan.head_dim}], got {tuple(c.shape)}")
        _need(c.dtype == plan.kv_dtype, f"{name} is {c.dtype}, the plan expects {plan.kv_dtype}")
        _need(c.is_contiguous() and c.device == q.device,
              f"{name} must be contiguous and on {q.device}")
    _need(k_cache.shape == v_cache.shape, "k_cache and v_cache must have one shape")
    fp8 = plan.kv_dtype != plan.q_dtype
    if fp8:
        want = tuple(k_cache.shape[:3])
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            _need(s is not None and tuple(s.shape) == want and s.dtype == torch.float32
                  and s.is_contiguous() and s.device == q.device,
                  f"an fp8 cache needs {name}: a contiguous float32 {want} tensor on {q.device}")
    _need(block_table.dim() == 2 and block_table.shape[0] >= B and block_table.dtype ==
          torch.int32 and block_table.stride(1) == 1 and block_table.device == q.device,
          f"block_table must be int32 [batch, max_pages] (unit column stride) on {q.device}, "
          f"got {block_table.dtype} {tuple(block_table.shape)}")
    _need(seq_lens.dim() == 1 and seq_lens.shape[0] >= B and seq_lens.dtype == torch.int32
          and seq_lens.is_contiguous() and seq_lens.device == q.device,
          f"seq_lens must be a contiguous int32 [batch] tensor on {q.device}, got "
          f"{seq_lens.dtype} {tuple(seq_lens.shape)}")
    C = _ext.load()
    a = C.DecodeArgs()
    a.q, a.k_cache, a.v_cache = q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr()
    if fp8:
        a.k_scale, a.v_scale = k_scale.data_ptr(), v_scale.data_ptr()
    a.block_table, a.seq_lens, a.out = block_table.data_ptr(), seq_lens.data_ptr(), out.data_ptr()
    if plan.num_splits > 1:
        a.o_partial = plan.o_partial.data_ptr()
        a.lse_partial = plan.lse_partial.data_ptr()
        a.counters = plan.counters.data_ptr()
    a.batch, a.q_heads, a.kv_heads, a.head_dim = B, plan.q_heads, plan.kv_heads, plan.head_dim
    a.page_size, a.bt_stride, a.num_splits = plan.page_size, block_table.stride(0), plan.num_splits
    a.scale = plan.head_dim ** -0.5 if scale is None else float(scale)
    a.q_dtype, a.kv_dtype = _dtypes.code(plan.q_dtype), _dtypes.code(plan.kv_dtype)
    C.attention_decode(a, torch.cuda.current_stream(q.device).cuda_stream)
    return out
