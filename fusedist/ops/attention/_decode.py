"""Paged decode attention: one query token per sequence over its cached tokens.

    plan = decode_plan(batch, q_heads, kv_heads, head_dim, page_size, max_seq_len, device, dtype)
    out = decode(q, k_cache, v_cache, block_table, seq_lens, plan)

On CUDA the split-KV kernel (csrc/include/fusedist/attention/decode.cuh) runs when the build
has it and the shape fits: q, out [B, q_heads, head_dim] bf16/fp16 contiguous; k_cache, v_cache
[num_pages, page_size, kv_heads, head_dim] of q's dtype or float8_e4m3fn with float32 k_scale,
v_scale [num_pages, page_size, kv_heads] (value = fp8 * scale); block_table int32 [B, max_pages]
(row stride may exceed max_pages; entries past ceil(seq_lens[b] / page_size) are never read);
seq_lens int32 [B] (a length <= 0 gives zeros). page_size a multiple of 16; head_dim 64, 128 or
256; q_heads a multiple of kv_heads. Other shapes, and CPU tensors, take decode_reference.

The plan is made on the host, outside CUDA graphs (plan_kernel): it fixes the grid (num_splits
per sequence: each sequence's slabs of 16 tokens are cut into num_splits equal runs at run time,
from its own length) and owns the workspace (fp32 partial O and LSE, the merge counters), sized
for `batch` sequences. run_kernel launches on the current stream, captures into CUDA graphs
(lengths and block tables are read on the device: replays may change them), and takes any batch
<= plan.batch. One plan's workspace serves one call at a time (stream order). Results are
bitwise identical run to run and between eager and graph replay. choose_num_splits(...) is the
planner's rule, a pure function (tests run it on the CPU).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch

from ... import _dtypes, _ext, tuning
from .. import device_errors
from .paged import (FP8, KV_DTYPES, _check_cache, _check_query, _check_tables, _fail,
                    capability, check_pages_device, check_pages_host, device_check_available,
                    gather_kv)

HEAD_DIMS = (64, 128, 256)
SLAB = 16          # tokens per slab (csrc: kDecodeSlab)
TILE_HEADS = 8     # query heads one CTA serves (csrc: kDecodeTileHeads)
MAX_SPLITS = 128   # csrc: kDecodeMaxSplits
# The planner's rule (choose_num_splits, plan_kernel's merge) reads the tuning table's "decode"
# knobs (fusedist/tuning_default.json; FUSEDIST_TUNING_FILE overrides them; declared in
# fusedist.tuning with the shipped values, which CPU plans use). A split covers at least
# min_slabs_per_split slabs (fewer leaves the four warps of a CTA without a pipeline to fill),
# and at most max_merge_splits splits are merged (the merge reads num_splits x heads x
# head_dim fp32 values in one CTA). Two CTAs per SM (the kernel fits two at head_dim 128) pay
# when each split keeps long_split_slabs slabs: on H200 4 splits of 16 x 4K (16/4 heads) took
# 37.8 us against 41.5 at 2, 8 of 8 x 4K 22.1 against 24.1, 8 of 4 x 16K (32/8) 68.1 against
# 75.8; at batch 1 x 4K (128-256-token splits) one CTA per SM stays (32/8: 16 splits 9.8 us,
# 32 splits 10.8).
# The cluster merge (decode.cuh): the splits of a (sequence, head tile) run as one thread-block
# cluster and merge through each other's shared memory, without the workspace round trip
# (partials to global memory, a fence, a counter, the last CTA reading them back). A cluster
# holds at most MAX_CLUSTER_SPLITS CTAs (Hopper's non-portable size). Measured on H200
# (benchmarks/NOTES.md, "Decode attention"): 1.03-1.08x the workspace merge at 2 splits
# (16/4 heads, 16 x 4K), 0.76-0.98x at 16 splits (batch 1: a cluster's CTAs must share a GPC,
# and with two CTAs per SM they land two to an SM while other SMs idle). So a plan takes it
# for 2 to cluster_merge_max_splits splits (0 keeps the workspace merge everywhere);
# plan_kernel(merge="cluster") asks for it at any 2 to 16 splits.
MAX_CLUSTER_SPLITS = 16
MERGES = ("cluster", "workspace")



def available(device=None) -> bool:
    """fusedist._C carries the decode kernel (and, given a device, it runs there)."""
    if device is None:
        return _ext.capabilities().has("attention_decode")
    return _ext.kernel_runs("attention_decode", device)


def why_not(device, head_dim: int, page_size: int, dtype: torch.dtype,
            kv_dtype: torch.dtype) -> str:
    """Why the decode kernel does not serve this shape on `device` ("" when it does)."""
    why = _ext.why_not("attention_decode", device)
    if why:
        return why
    if not _decode_kernel_fits(head_dim, page_size, dtype, kv_dtype):
        return (f"head_dim {head_dim}, page size {page_size}, {dtype} / {kv_dtype}: the kernel "
                f"takes head_dim {HEAD_DIMS}, pages of a multiple of {SLAB} tokens, bf16 / "
                "fp16 queries over a cache of their dtype or e4m3")
    return ""


def choose_num_splits(batch: int, kv_heads: int, q_tiles: int, max_seq_len: int,
                      num_sms: int, rule: Optional[dict] = None) -> int:
    """Splits per sequence: about two CTAs per SM when batch x head tiles alone leaves SMs
    idle and each split keeps at least long_split_slabs slabs, else about one; never splits
    of fewer than min_slabs_per_split slabs, never more than max_merge_splits. A batch that
    fills the SMs on its own takes 1 split (no merge). rule: the knobs
    (tuning.knobs("decode"); None: the shipped values)."""
    r = tuning.DECODE_DEFAULT if rule is None else rule
    ctas = max(1, batch * kv_heads * q_tiles)
    slabs = max(1, math.ceil(max_seq_len / SLAB))
    by_len = slabs // r["min_slabs_per_split"]
    cap = min(by_len, r["max_merge_splits"], MAX_SPLITS)
    two = min(2 * max(1, num_sms) // ctas, cap)
    if two > 1 and slabs >= two * r["long_split_slabs"]:
        return two
    return max(1, min(max(1, num_sms) // ctas, cap))


def cluster_merge_available(device: torch.device) -> bool:
    """Whether plans for `device` may merge in clusters: a CUDA device of compute capability
    9.0 or newer and a build with the cluster merge (the capability table's
    attention_decode_cluster)."""
    if device.type != "cuda":
        return False
    return capability(device) >= (9, 0) and _ext.kernel_runs("attention_decode_cluster", device)


@dataclass
class DecodePlan:
    """Host-side decode plan made OUTSIDE CUDA graphs: a fixed grid and split count for
    (batch, heads, head_dim, page_size, max_seq_len), and the workspace the kernel's partial
    results live in. Reuse it for every step (and every layer) of that shape; a captured graph
    replays with new seq_lens / block_table values under the same plan. num_splits 0: no
    kernel serves the shape (or the build), and calls take the plain-torch path."""
    batch: int
    q_heads: int
    kv_heads: int
    head_dim: int
    page_size: int
    max_seq_len: int
    device: torch.device
    dtype: torch.dtype          # q's and out's
    kv_dtype: torch.dtype
    num_splits: int = 0         # splits per sequence (the kernel's grid.x); 0: reference path
    q_tiles: int = 0            # TILE_HEADS-wide query-head tiles per kv head
    stages: int = 0             # the kernel's cp.async ring per warp: 0 default, 2 (FP8 caches)
    fp8_direct: bool = False    # FP8 caches: fragments converted in registers (decode.cuh)
    merge: str = "none"         # how splits merge: "none" (1 split), "cluster", "workspace"
    # Workspace (the "workspace" merge only, else None): o_partial float32 [batch, q_heads,
    # num_splits, head_dim] and lse_partial float32 [batch, q_heads, num_splits], written by
    # the split CTAs and read by the merging CTA; counters int32 [batch, kv_heads * q_tiles],
    # zero between calls (the last CTA of each tile puts its counter back to zero).
    o_partial: Optional[torch.Tensor] = None
    lse_partial: Optional[torch.Tensor] = None
    counters: Optional[torch.Tensor] = None
    closed: bool = field(default=False)

    def close(self) -> None:
        """Release the workspace; the plan is refused afterwards. Never close a plan a
        captured graph still replays."""
        self.o_partial = self.lse_partial = self.counters = None
        self.num_splits = 0
        self.closed = True

    @property
    def max_pages(self) -> int:
        return -(-self.max_seq_len // self.page_size)

    @property
    def backend(self) -> str:
        return "kernel" if self.num_splits > 0 else "reference"

    @property
    def grid(self) -> tuple[int, int, int]:
        return (self.num_splits, self.kv_heads * self.q_tiles, self.batch)


def _decode_kernel_fits(head_dim, page_size, dtype, kv_dtype) -> bool:
    """The shapes the decode kernel serves; others take the plain-torch path."""
    return (head_dim in (64, 128, 256) and page_size % 16 == 0
            and dtype in (torch.bfloat16, torch.float16) and kv_dtype in (dtype, FP8))


def decode_plan(batch: int, q_heads: int, kv_heads: int, head_dim: int, page_size: int,
                max_seq_len: int, device=None, dtype=torch.bfloat16,
                kv_dtype: Optional[torch.dtype] = None) -> DecodePlan:
    """Plan decode for up to `batch` sequences of up to max_seq_len tokens (host side, outside
    graphs). dtype is q's (bfloat16 unless given: pass the model's dtype); kv_dtype defaults to
    dtype, float8_e4m3fn for FP8 caches."""
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
    if device.type == "cuda" and not why_not(device, head_dim, page_size, dtype, kv_dtype):
        plan = plan_kernel(batch, q_heads, kv_heads, head_dim, page_size, max_seq_len,
                           device=device, dtype=dtype, kv_dtype=kv_dtype)
    if device.type == "cuda":
        device_errors.record_ptr(device)   # made here, outside any graph the plan is used in
    return plan


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
                      f"for this call: decode_plan({B}, {Hq}, {Hkv}, {D}, {ps}, max_seq_len, "
                      f"device, dtype={q.dtype}, kv_dtype={k_cache.dtype})")
    if plan is not None and plan.closed:
        _fail(op, "plan was closed (DecodePlan.close()); make a new one with decode_plan()")
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    if torch.compiler.is_compiling():
        # The plan travels as its plain fields (and its workspace tensors): no registry.
        torch.ops.fusedist.attention_decode(out, q, k_cache, v_cache, block_table, seq_lens,
                                            scale, k_scale, v_scale, *_plan_fields(plan))
    else:
        device_errors.check_before_launch(q)   # an error an earlier kernel recorded
        _decode_impl(out, q, k_cache, v_cache, block_table, seq_lens, scale, k_scale, v_scale,
                     plan)
    return out


def _decode_impl(out, q, k_cache, v_cache, block_table, seq_lens, scale, k_scale, v_scale,
                 plan: Optional[DecodePlan]) -> None:
    if q.shape[0] == 0:
        return
    P, ps = k_cache.shape[0], k_cache.shape[1]
    if q.device.type == "cuda":
        if plan is None:
            B, Hq, D = q.shape
            plan = decode_plan(B, Hq, k_cache.shape[2], D, k_cache.shape[1],
                               block_table.shape[1] * k_cache.shape[1], q.device, q.dtype,
                               k_cache.dtype)
        if plan.num_splits > 0:
            run_kernel(plan, q, k_cache, v_cache, block_table, seq_lens, out=out, scale=scale,
                       k_scale=k_scale, v_scale=v_scale)
            return
        _ext.warn_reference("decode", "fusedist._C without the decode kernel"
                            if not available() else
                            "a head_dim, page size or dtype the decode kernel does not serve")
        if torch.cuda.is_current_stream_capturing():
            # No host check inside a graph: the device check records and poisons instead
            # (decode_reference reads pages clamped into range).
            bad = check_pages_device("decode", block_table, seq_lens, P, ps) \
                if device_check_available() else None
            decode_reference(q, k_cache, v_cache, block_table, seq_lens, scale=scale, out=out,
                             k_scale=k_scale, v_scale=v_scale)
            if bad is not None:
                out.masked_fill_(bad[:, None, None], float("nan"))
            return
    check_pages_host("decode", block_table, seq_lens, P, ps)
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


def _plan_fields(plan: Optional[DecodePlan]) -> tuple:
    """A plan as the custom op's arguments: (batch, max_seq_len, num_splits, q_tiles, stages,
    fp8_direct, merge, o_partial, lse_partial, counters); batch -1: no plan."""
    if plan is None:
        return (-1, 0, 0, 0, 0, False, "none", None, None, None)
    return (plan.batch, plan.max_seq_len, plan.num_splits, plan.q_tiles, plan.stages,
            plan.fp8_direct, plan.merge, plan.o_partial, plan.lse_partial, plan.counters)


@torch.library.custom_op("fusedist::attention_decode", mutates_args=("out",))
def _decode_op(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
               k_scale: Optional[torch.Tensor], v_scale: Optional[torch.Tensor],
               batch: int, max_seq_len: int, num_splits: int, q_tiles: int, stages: int,
               fp8_direct: bool, merge: str, o_partial: Optional[torch.Tensor],
               lse_partial: Optional[torch.Tensor], counters: Optional[torch.Tensor]) -> None:
    plan = None
    if batch >= 0:
        plan = DecodePlan(batch, q.shape[1], k_cache.shape[2], q.shape[2], k_cache.shape[1],
                          max_seq_len, q.device, q.dtype, k_cache.dtype, num_splits=num_splits,
                          q_tiles=q_tiles, stages=stages, fp8_direct=fp8_direct, merge=merge,
                          o_partial=o_partial, lse_partial=lse_partial, counters=counters)
    _decode_impl(out, q, k_cache, v_cache, block_table, seq_lens, scale, k_scale, v_scale, plan)


@_decode_op.register_fake
def _(out, q, k_cache, v_cache, block_table, seq_lens, scale, k_scale, v_scale, *plan_fields):
    return None


# ---- the kernel: planner and launcher ---------------------------------------------------

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


def plan_kernel(batch: int, q_heads: int, kv_heads: int, head_dim: int, page_size: int,
                max_seq_len: int, *, device=None, num_sms: Optional[int] = None,
                num_splits: Optional[int] = None,
                dtype: torch.dtype = torch.bfloat16,
                kv_dtype: Optional[torch.dtype] = None, stages: int = 0,
                fp8_direct: Optional[bool] = None, merge: Optional[str] = None) -> DecodePlan:
    """The kernel's plan: grid and workspace for decode calls of up to `batch` sequences (module
    docstring). Not registered for torch.ops (decode_plan() does that). num_sms defaults to the
    device's SM count; num_splits overrides the rule (benchmarks sweep it). dtype is q's and
    out's. stages: the per-warp cp.async ring, 0 (the default depth) or 2, an FP8-cache variant
    with 3 CTAs per SM instead of 2 at head_dim 128. fp8_direct (FP8 caches, stages 0; the
    default for them, None): the MMA fragments are loaded from the e4m3 stage and converted
    in registers, no fp16 copy of the slab in shared memory (51 KB per CTA at head_dim 128: 4
    CTAs per SM; 1.5-1.7x the fp16-slab path's speed on H200, the same output bitwise);
    fp8_direct=False keeps the fp16 slab. benchmarks/attention.py times the other two
    variants beside every FP8 row. merge: how the splits of a sequence are combined,
    "cluster" (2 to MAX_CLUSTER_SPLITS splits, one thread-block cluster, no workspace),
    "workspace" (any count: partials in global memory, the last CTA merges) or None: cluster
    for 2 to the "decode" knob cluster_merge_max_splits splits where
    cluster_merge_available(device), else workspace."""
    _check_shape(batch, q_heads, kv_heads, head_dim, page_size, max_seq_len)
    q_dtype = dtype
    kv_dtype = q_dtype if kv_dtype is None else kv_dtype
    if q_dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"fusedist.decode: q dtype must be bfloat16 or float16, got {q_dtype}")
    if kv_dtype not in (q_dtype, FP8):
        raise TypeError(f"fusedist.decode: the KV cache dtype must be q's ({q_dtype}) or "
                        f"float8_e4m3fn, got {kv_dtype}")
    device = torch.device("cuda", torch.cuda.current_device()) if device is None \
        else torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    q_tiles = math.ceil(q_heads // kv_heads / TILE_HEADS)
    rule = tuning.knobs("decode", device) if device.type == "cuda" else None
    if merge not in (None,) + MERGES:
        raise ValueError(f"fusedist.decode: merge must be one of {MERGES} or None, got "
                         f"{merge!r}")
    if merge == "cluster" and not cluster_merge_available(device):
        raise ValueError(f"fusedist.decode: merge='cluster' needs a CUDA device of compute "
                         f"capability >= 9.0 and a build with the cluster merge (device "
                         f"{device}); pass merge='workspace'")
    if num_splits is None:
        if num_sms is None:
            num_sms = torch.cuda.get_device_properties(device).multi_processor_count \
                if device.type == "cuda" else 132
        num_splits = choose_num_splits(batch, kv_heads, q_tiles, max_seq_len, num_sms, rule)
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"fusedist.decode: num_splits must be in [1, {MAX_SPLITS}], got "
                         f"{num_splits}")
    if merge == "cluster" and not 2 <= num_splits <= MAX_CLUSTER_SPLITS:
        raise ValueError(f"fusedist.decode: merge='cluster' takes 2 to {MAX_CLUSTER_SPLITS} "
                         f"splits, got num_splits={num_splits}; pass merge='workspace'")
    if merge is None:
        most = (tuning.DECODE_DEFAULT if rule is None else rule)["cluster_merge_max_splits"]
        merge = "cluster" if num_splits <= most and \
            cluster_merge_available(device) else "workspace"
    merge = "none" if num_splits == 1 else merge
    if stages not in (0, 2) or (stages == 2 and kv_dtype != FP8):
        raise ValueError(f"fusedist.decode: stages must be 0 (the default ring) or 2 (FP8 "
                         f"caches only), got {stages!r} for a {kv_dtype} cache")
    if fp8_direct is None:
        fp8_direct = kv_dtype == FP8 and stages == 0
    if fp8_direct and (kv_dtype != FP8 or stages != 0):
        raise ValueError("fusedist.decode: fp8_direct is a variant of the default ring "
                         f"(stages 0) for FP8 caches; got a {kv_dtype} cache, stages {stages}")
    plan = DecodePlan(batch, q_heads, kv_heads, head_dim, page_size, max_seq_len, device,
                      q_dtype, kv_dtype, num_splits=num_splits, q_tiles=q_tiles, stages=stages,
                      fp8_direct=bool(fp8_direct), merge=merge)
    if merge == "workspace":
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


def run_kernel(plan: DecodePlan, q: torch.Tensor, k_cache: torch.Tensor,
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
    _need(q.dtype == plan.dtype, f"q is {q.dtype}, the plan expects {plan.dtype}")
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
    fp8 = plan.kv_dtype != plan.dtype
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
    if plan.merge == "cluster":
        a.cluster = 1
    elif plan.num_splits > 1:
        a.o_partial = plan.o_partial.data_ptr()
        a.lse_partial = plan.lse_partial.data_ptr()
        a.counters = plan.counters.data_ptr()
    a.batch, a.q_heads, a.kv_heads, a.head_dim = B, plan.q_heads, plan.kv_heads, plan.head_dim
    a.page_size, a.bt_stride, a.num_splits = plan.page_size, block_table.stride(0), plan.num_splits
    a.stages, a.fp8_direct = plan.stages, int(plan.fp8_direct)
    a.bt_cols, a.num_pages = block_table.shape[1], k_cache.shape[0]
    a.err = device_errors.record_ptr(q.device)
    a.scale = plan.head_dim ** -0.5 if scale is None else float(scale)
    a.q_dtype, a.kv_dtype = _dtypes.code(plan.dtype), _dtypes.code(plan.kv_dtype)
    C.attention_decode(a, _ext.stream(q.device))
    return out


# ---- the op's shape: available / why_not (above) / plan / run / reference -------------------
plan = decode_plan
run = run_kernel
reference = decode_reference
