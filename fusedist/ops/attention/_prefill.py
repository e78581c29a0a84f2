"""Chunked prefill over the paged cache: each sequence's new tokens attend causally to its
cached prefix and to themselves. On CUDA the paged prefill kernel
(csrc/include/fusedist/attention/prefill.cuh) reads K/V straight from the pages, every
sequence in one launch, lengths read on the device (CUDA-graph capturable); torch SDPA on the
K/V gathered from the pages (one call per run of equal sequences) is the other CUDA backend;
CPU tensors take the fp32 plain-torch path."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from . import sdpa
from ... import _dtypes, _ext, tuning
from .. import device_errors
from .paged import (_check_cache, _check_query, _check_tables, _fail, _gather_seqs, capability,
                    check_pages_device, check_pages_host, device_check_available, poison_rows)

PREFILL_BACKENDS = ("auto", "paged", "sdpa", "reference")
# auto on CUDA takes the paged kernel (it reads the pages in place; SDPA needs them gathered
# into contiguous K/V first, ~0.35 ms per call on H200) unless SDPA is measured faster. The
# crossovers are the tuning table's "prefill" knobs (measured on H200 with
# benchmarks/attention_prefill.py: benchmarks/NOTES.md, "Paged prefill"). With the wgmma
# mainloop (head_dim 128 on H100 / H200; H200, 32 / 8 heads, eager calls):
#  - a batch of fresh prompts (no cached prefix) of at least paged_fresh_max_tokens tokens
#    each whose new K/V the caller passes: SDPA (cuDNN) on those needs no gather; the kernel
#    took 203 us at 2048 tokens against SDPA's 243, and 604 against 307 at 4096 (a quadratic
#    and a near-flat fit cross near 2400);
#  - a step of more than paged_max_flops causal attention FLOPs (4 * q_heads * head_dim *
#    query-key pairs): 8 x 512 new tokens behind 4096 (2.6e11) cost both ~0.9 ms; smaller
#    steps (8 x 256 behind 4096, 4 x 512 behind 4096: 1.3e11) were 0.89-0.95x SDPA's time.
# Without wgmma (head_dim 64 / 256, other GPUs) the mma.sync kernel's ~160 TFLOP/s crosses
# earlier: fresh prompts of mma_fresh_max_tokens with their K/V passed (cuDNN 2.4x the kernel
# at 1024 tokens, a tie at 128), steps above mma_max_flops (8 x 256 new tokens behind 1792
# cost both ~0.38 ms); fresh prompts without their K/V take it at any length there. With
# wgmma they take SDPA from paged_fresh_max_tokens either way (gathered at 4096 tokens: SDPA
# 479 us against the kernel's 642).
# FP8 caches always take the kernel: SDPA would run on K/V dequantized to fp32 (fp32 GEMMs and
# a separate softmax: a 4096-token fresh prompt, 32 / 8 heads, ~10 ms a layer on H200 against
# the kernel's ~0.7 ms). Inside a CUDA-graph capture always the kernel (the SDPA path needs the
# lengths on the host). auto_paged false restores SDPA outside graphs (bf16 / fp16 caches).
# split_min_keys: the paged kernel splits a query tile's keys (plan_splits) only into runs of
# at least that many keys (8 key blocks of 64).
tuning.declare(
    "prefill",
    auto_paged=tuning.Knob(True, bool, doc="auto takes the paged kernel where it wins"),
    paged_fresh_max_tokens=tuning.Knob(2400, int, 0, 1 << 30,
                                       doc="wgmma: fresh prompts from this length take SDPA"),
    paged_max_flops=tuning.Knob(2.6e11, float, 0.0, None,
                                doc="wgmma: steps above this many FLOPs take SDPA"),
    mma_fresh_max_tokens=tuning.Knob(256, int, 0, 1 << 30,
                                     doc="mma.sync: fresh prompts from this length take SDPA"),
    mma_max_flops=tuning.Knob(8e10, float, 0.0, None,
                              doc="mma.sync: steps above this many FLOPs take SDPA"),
    split_min_keys=tuning.Knob(512, int, 64, 1 << 30, doc="keys per split, at least"),
)


def prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            block_table: torch.Tensor, seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor, *,
            scale: Optional[float] = None, out: Optional[torch.Tensor] = None,
            max_q_len: Optional[int] = None, k_scale: Optional[torch.Tensor] = None,
            v_scale: Optional[torch.Tensor] = None, backend: str = "auto",
            seq_lens_host: Optional[Sequence[int]] = None,
            cu_seqlens_q_host: Optional[Sequence[int]] = None,
            k_new: Optional[torch.Tensor] = None,
            v_new: Optional[torch.Tensor] = None,
            plan: Optional["PrefillPlan"] = None) -> torch.Tensor:
    """Chunked prefill: sequence b's n_b = cu_seqlens_q[b+1] - cu_seqlens_q[b] new tokens
    q[cu_seqlens_q[b]:cu_seqlens_q[b+1]] are the last n_b of its seq_lens[b] cached tokens;
    new token i attends to cached tokens [0, seq_lens[b] - n_b + i]. Returns out [T, Hq, D]
    (with out=None and one sequence, SDPA's own output, no copy).
    backend: "paged" (the paged prefill kernel, CUDA), "sdpa" (torch SDPA on the gathered KV),
    "reference" (fp32 plain torch), "auto" (CPU: reference; CUDA: the paged kernel, SDPA for
    long fresh prompts and large steps of bf16/fp16 caches; the PREFILL_BACKENDS comment).
    The paged kernel reads lengths and tables on the device (one CUDA graph replays with new
    ones): max_q_len (the longest new-token span; default the host lists' maximum, else every
    token) sizes its grid. The sdpa and reference paths need the lengths on the host: pass
    seq_lens_host / cu_seqlens_q_host (the runner has them) to skip reading the device
    tensors, which synchronizes with the GPU; with them the paged path also checks the
    metadata on the host before launching (without them the kernel checks it: bad rows are
    NaN and fusedist.check_device_errors() raises).
    k_new, v_new [T, Hkv, D] (optional, q's dtype): the keys and values rope_append just wrote
    for these tokens; a sequence whose cache holds only its new tokens (no prefix) then reads
    them instead of gathering its pages (bf16/fp16 caches, which hold the same values; FP8
    caches always read the cache).
    plan: the step's PrefillPlan (prefill_plan(), made once for all layers): the lengths, runs
    and page checks come from it instead of being redone per call."""
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
                         k_new, v_new, plan)


def _prefill_bounds(op, cu_seqlens_q, seq_lens, T, block_table, page_size, lens=None, cu=None):
    cu = cu_seqlens_q.tolist() if cu is None else [int(c) for c in cu]
    lens = seq_lens.tolist() if lens is None else [int(n) for n in lens]
    if len(cu) != len(lens) + 1:
        _fail(op, f"cu_seqlens_q_host has {len(cu)} entries for {len(lens)} sequences")
    if cu[0] != 0 or cu[-1] != T or any(b < a for a, b in zip(cu, cu[1:])):
        _fail(op, f"cu_seqlens_q must rise from 0 to the {T} query tokens, got {cu}")
    for b, (a, e) in enumerate(zip(cu, cu[1:])):
        if lens[b] < 0:
            _fail(op, f"seq_lens[{b}] = {lens[b]} is negative")
        if e - a > lens[b]:
            _fail(op, f"sequence {b} has {e - a} new tokens but seq_lens[{b}] = {lens[b]}; "
                      "seq_lens counts the cached tokens including the new ones (append first)")
        if -(-lens[b] // page_size) > block_table.shape[1]:
            _fail(op, f"seq_lens[{b}] = {lens[b]} needs more pages than block_table's "
                      f"{block_table.shape[1]} columns")
    return cu, lens


@dataclass
class PrefillPlan:
    """One prefill step's metadata, checked once and shared by every layer's prefill() call
    (prefill_plan() builds it; TPAttention takes it from AttentionMetadata.plan): the host
    lengths, the SDPA runs and their page indices, the rows whose metadata is bad (on CUDA a
    device mask from one check kernel: those rows come out NaN), the paged kernel's grid
    bounds and what auto's choice reads of the lengths (step_shape), so a layer's call does
    no pass over the sequences. Valid for the block_table tensor it was made for and that
    step's values."""
    tokens: int
    cu: list
    lens: list
    page_size: int
    num_pages: int
    block_table: torch.Tensor
    runs: list
    bad: Optional[torch.Tensor] = None
    max_q_len: int = 0
    max_keys: int = 0
    shape: Optional[tuple] = None   # step_shape(cu, lens): what auto's choice reads
    _pages: dict = field(default_factory=dict)

    def pages(self, i: int) -> torch.Tensor:
        """long [sequences of run i, pages of its length], clamped into the cache when a
        device check ran (never read outside it; bad rows are poisoned)."""
        got = self._pages.get(i)
        if got is None:
            f, l = self.runs[i]
            got = self.block_table[f:l, :-(-self.lens[f] // self.page_size)].long()
            if self.bad is not None:
                got.clamp_(0, self.num_pages - 1)
            self._pages[i] = got
        return got


def prefill_plan(block_table: torch.Tensor, seq_lens: torch.Tensor,
                 cu_seqlens_q: torch.Tensor, *, tokens: int, page_size: int, num_pages: int,
                 seq_lens_host: Optional[Sequence[int]] = None,
                 cu_seqlens_q_host: Optional[Sequence[int]] = None) -> PrefillPlan:
    """Check a prefill step's metadata once (the lengths on the host: pass them, or they are
    read from the device; the pages on the host for CPU tensors, else by one device check
    kernel that records and masks instead of synchronizing). Pass the plan to every layer's
    prefill(..., plan=) of that step."""
    op = "prefill"
    B = seq_lens.shape[0]
    if seq_lens_host is not None and len(seq_lens_host) != B:
        _fail(op, f"seq_lens_host has {len(seq_lens_host)} entries, seq_lens {B}")
    cu, lens = _prefill_bounds(op, cu_seqlens_q, seq_lens, tokens, block_table, page_size,
                               seq_lens_host, cu_seqlens_q_host)
    bad = None
    if block_table.device.type == "cpu" or not device_check_available():
        check_pages_host(op, block_table, lens, num_pages, page_size)
    else:
        device_errors.check_before_launch(block_table)
        bad = check_pages_device(op, block_table, seq_lens, num_pages, page_size)
    return PrefillPlan(tokens=tokens, cu=cu, lens=lens, page_size=page_size,
                       num_pages=num_pages, block_table=block_table, runs=prefill_runs(cu, lens),
                       bad=bad, max_q_len=max((b - a for a, b in zip(cu, cu[1:])), default=0),
                       max_keys=max(lens, default=0), shape=step_shape(cu, lens))


def _check_plan(plan: PrefillPlan, T, block_table, k_cache):
    if not isinstance(plan, PrefillPlan) or plan.tokens != T or \
            plan.block_table is not block_table or plan.page_size != k_cache.shape[1] or \
            plan.num_pages != k_cache.shape[0]:
        _fail("prefill", "plan was not made for this call (prefill_plan(block_table, ...) of "
                         "this step: the same block_table tensor, tokens, page size and pages)")


def _prefill_impl(out, q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, scale,
                  max_q_len, k_scale, v_scale, backend, lens=None, cu=None, k_new=None,
                  v_new=None, plan: Optional[PrefillPlan] = None) -> torch.Tensor:
    T = q.shape[0]
    if T == 0:
        return torch.empty_like(q) if out is None else out
    ps, P = k_cache.shape[1], k_cache.shape[0]
    if plan is not None:
        _check_plan(plan, T, block_table, k_cache)
        lens, cu = plan.lens, plan.cu
    if lens is not None and len(lens) != seq_lens.shape[0]:
        _fail("prefill", f"seq_lens_host has {len(lens)} entries, seq_lens {seq_lens.shape[0]}")
    if backend == "paged" and q.device.type != "cuda":
        _fail("prefill", f"backend='paged' is the CUDA kernel; q is on {q.device} (use 'auto' "
                         "or 'reference')")
    if backend in ("auto", "paged") and q.device.type == "cuda":
        why = paged_why_not(q, k_cache)
        if backend == "paged" and why:
            _fail("prefill", f"backend='paged' cannot take this call: {why}")
        if not why and (backend == "paged" or _auto_paged(
                T, lens, cu, k_new, q.shape[1] * q.shape[2], fp8=k_scale is not None,
                wgmma=q.shape[2] == 128 and capability(q.device) == (9, 0),
                knobs=tuning.knobs("prefill", q.device),
                shape=plan.shape if plan is not None else None)):
            if plan is None and lens is not None and cu is not None:
                cu, lens = _prefill_bounds("prefill", cu_seqlens_q, seq_lens, T, block_table,
                                           ps, lens, cu)
            if plan is not None:
                mq, max_keys = plan.max_q_len, plan.max_keys
            elif cu is not None:
                mq = max(b - a for a, b in zip(cu, cu[1:]))
                max_keys = max(lens, default=0)
            else:   # lengths only on the device: the grid covers every token
                mq, max_keys = T, block_table.shape[1] * ps
            device_errors.check_before_launch(q)
            return run_paged(out, q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q,
                             scale, mq if max_q_len < 0 else max_q_len, max_keys, k_scale,
                             v_scale)
    if plan is None:
        plan = prefill_plan(block_table, seq_lens, cu_seqlens_q, tokens=T, page_size=ps,
                            num_pages=P, seq_lens_host=lens, cu_seqlens_q_host=cu)
    elif q.device.type == "cuda":
        device_errors.check_before_launch(q)
    cu, lens, bad = plan.cu, plan.lens, plan.bad
    use_sdpa = backend == "sdpa" or (backend == "auto" and q.device.type == "cuda")
    # SDPA takes one dtype: q's for bf16/fp16 caches. FP8 caches dequantize to fp32 and SDPA
    # runs in fp32: rounding dequantized K/V to bf16 on top of the flash-style P rounding
    # costs up to ~0.8% relative per row, too close to the bf16 budget.
    fp8 = k_scale is not None
    kv_dtype = q.dtype if use_sdpa and not fp8 else torch.float32
    runs = plan.runs
    for i, (f, l) in enumerate(runs):
        B, n, L = l - f, cu[f + 1] - cu[f], lens[f]
        a, e = cu[f], cu[l]
        qb = q[a:e].unflatten(0, (B, n))                            # [B, n, Hq, D]
        if k_new is not None and n == L and not fp8:   # no prefix: the fresh K/V
            k, v = (t[a:e].unflatten(0, (B, n)).to(kv_dtype) for t in (k_new, v_new))
        else:
            pages = plan.pages(i)
            k = _gather_seqs(k_cache, pages, L, k_scale, kv_dtype)   # [B, L, Hkv, D]
            v = _gather_seqs(v_cache, pages, L, v_scale, kv_dtype)
        o = sdpa._sdpa_chunk(qb.to(kv_dtype), k, v, scale) if use_sdpa else \
            sdpa._reference_chunk(qb, k, v, scale)
        if out is None and len(runs) == 1 and o.dtype == q.dtype:
            res = o.reshape(q.shape)   # one call covered every sequence: SDPA's own output
            if bad is not None:
                poison_rows(res, bad[f:l], n)
            return res
        if out is None:
            out = torch.empty_like(q)
        out[a:e].unflatten(0, (B, n)).copy_(o)
        if bad is not None:   # the rows of the sequences the device check marked bad
            poison_rows(out[a:e], bad[f:l], n)
    return out


def paged_available(device=None) -> bool:
    """The extension has the paged prefill kernel (and, given a device, it runs there)."""
    if device is None:
        return _ext.capabilities().has("attention_prefill")
    return _ext.kernel_runs("attention_prefill", device)


def paged_why_not(q: torch.Tensor, k_cache: torch.Tensor) -> str:
    """Why the paged kernel cannot take a (valid) prefill call; "" when it can."""
    why = _ext.why_not("attention_prefill", q.device)
    if why:
        return why
    T, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"q is {q.dtype} (the kernel takes bfloat16 / float16)"
    if D not in (64, 128, 256):
        return f"head_dim {D} (the kernel takes 64, 128 or 256)"
    if Hq // Hkv > 64:
        return f"{Hq // Hkv} q heads per kv head (the kernel takes at most 64)"
    if q.stride(2) != 1 or q.stride(1) != D or q.stride(0) % 8 or q.data_ptr() % 16:
        return (f"q's strides {tuple(q.stride())} (the kernel takes [tokens, heads, head_dim] "
                "rows of contiguous heads, a token stride that is a multiple of 8, 16-byte "
                "alignment)")
    return ""


def step_shape(cu: Sequence[int], lens: Sequence[int]) -> tuple:
    """What auto's choice reads of a step's lengths, (query-key pairs of the causal attention,
    every sequence fresh (no cached prefix), the fewest new tokens of a sequence): a pass
    over the sequences, made once per step by prefill_plan (not per layer)."""
    ns = [b - a for a, b in zip(cu, cu[1:])]
    pairs = sum(n * (L - n) + n * (n + 1) // 2 for n, L in zip(ns, lens))
    return pairs, all(n == L for n, L in zip(ns, lens)), min(ns, default=0)


def _auto_paged(T, lens, cu, k_new, heads_x_dim: int = 0, fp8: bool = False,
                wgmma: bool = True, knobs: Optional[dict] = None,
                shape: Optional[tuple] = None) -> bool:
    """auto's choice on CUDA when the kernel can take the call (PREFILL_BACKENDS' comment);
    heads_x_dim = q_heads * head_dim prices the step's FLOPs; fp8: the cache is FP8; wgmma:
    the kernel runs its wgmma mainloop (else the mma.sync thresholds apply); knobs: the
    tuning table's "prefill" section (None: the shipped values); shape: step_shape(cu, lens)
    when the plan has it (else computed from lens and cu)."""
    kn = tuning.section_values({}, "prefill") if knobs is None else knobs
    if fp8 or torch.cuda.is_current_stream_capturing():
        return True
    if not kn["auto_paged"]:
        return False
    if shape is None:
        if lens is None or cu is None:
            return True
        shape = step_shape(cu, lens)
    pairs, fresh, min_new = shape
    if 4 * heads_x_dim * pairs > (kn["paged_max_flops"] if wgmma else kn["mma_max_flops"]):
        return False
    if k_new is None and not wgmma:
        return True
    return not (fresh and min_new >= (kn["paged_fresh_max_tokens"] if wgmma else
                                      kn["mma_fresh_max_tokens"]))


def plan_splits(q_tiles: int, kv_heads: int, batch: int, max_keys: int, sms: int,
                min_keys: Optional[int] = None) -> int:
    """Key splits per query tile of the paged kernel: enough CTAs for two per SM when the
    query tiles alone do not fill the GPU, at least min_keys keys per split (the "prefill"
    knob split_min_keys when None)."""
    if min_keys is None:
        min_keys = tuning.KNOBS["prefill"]["split_min_keys"].default
    ctas = max(1, q_tiles * kv_heads * batch)
    if ctas >= 2 * sms:
        return 1
    want = -(-2 * sms // ctas)
    by_keys = max(1, max_keys // min_keys)
    return max(1, min(want, by_keys, PREFILL_MAX_SPLITS))


PREFILL_MAX_SPLITS = 64   # csrc: kAttentionPrefillMaxSplits
_SMS: dict = {}


def run_paged(out, q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, scale,
              max_q_len, max_keys, k_scale=None, v_scale=None, num_splits=None,
              tile_rows: Optional[int] = None, tile_warps: Optional[int] = None,
              mainloop: Optional[str] = None):
    """Launch the paged prefill kernel on the current stream (arguments checked by prefill());
    max_q_len bounds every sequence's new tokens (the grid), max_keys their cached tokens
    (the split plan). tile_rows: query rows per CTA, 64 (4 warps of 16) or, at head_dim 128,
    128: tile_warps=8 (16 rows a warp) or 4 (32 rows a warp, flash-attention 2's shape: each
    K/V fragment feeds two m-tiles; 16-bit caches). Default (None): 128 rows of 8 warps at
    head_dim 128 (0.6-0.85x the 64-row tile's time on H200), else 64. mainloop: "mma"
    (mma.sync m16n8k16 per warp) or "wgmma" (Hopper's warpgroup MMA; head_dim 128, tiles of
    64 rows / 4 warps or 128 rows / 8 warps); default (None): "wgmma" where it applies on a
    compute capability 9.0 device (0.7-0.8x the mma.sync kernel's time on H200), else "mma".
    Returns out."""
    if tile_rows is None:
        tile_rows = 128 if q.shape[2] == 128 else 64
    if tile_warps is None:
        tile_warps = 8 if tile_rows == 128 else 4
    T, Hq, D = q.shape
    P, ps, Hkv, _ = k_cache.shape
    B = seq_lens.shape[0]
    dev = q.device
    if out is None:
        out = torch.empty(T, Hq, D, dtype=q.dtype, device=dev)
    elif not out.is_contiguous():
        _fail("prefill", f"out must be contiguous for the paged kernel (stride {out.stride()})")
    max_q_len = max(0, min(int(max_q_len), T))
    if B == 0 or max_q_len == 0:
        return out
    C = _ext.load()
    if tile_rows not in (64, 128) or (tile_rows == 128 and D != 128):
        _fail("prefill", f"tile_rows must be 64, or 128 at head_dim 128; got {tile_rows} at "
                         f"head_dim {D}")
    if (tile_rows, tile_warps) not in ((64, 4), (128, 4), (128, 8)) or \
            (tile_rows, tile_warps) == (128, 4) and k_cache.dtype not in (torch.bfloat16,
                                                                         torch.float16):
        _fail("prefill", f"tile_warps must be 4 (64 rows; 128 rows with a 16-bit cache) or 8 "
                         f"(128 rows); got {tile_warps} for {tile_rows} rows, a "
                         f"{k_cache.dtype} cache")
    if mainloop not in (None, "mma", "wgmma"):
        _fail("prefill", f"mainloop must be 'mma' or 'wgmma', got {mainloop!r}")
    if mainloop is None:
        mainloop = "wgmma" if D == 128 and (tile_rows, tile_warps) in ((64, 4), (128, 8)) and \
            capability(dev) == (9, 0) else "mma"
    wg = mainloop == "wgmma"
    if wg and (D != 128 or (tile_rows, tile_warps) not in ((64, 4), (128, 8))):
        _fail("prefill", f"mainloop='wgmma' is built for head_dim 128 with tiles of 64 rows / 4 "
                         f"warps or 128 rows / 8 warps; got head_dim {D}, {tile_rows} rows / "
                         f"{tile_warps} warps")
    tt = C.attention_prefill_tile_tokens(Hq // Hkv, tile_rows)
    q_tiles = -(-max_q_len // tt)
    if num_splits is None:
        idx = dev.index if dev.index is not None else torch.cuda.current_device()
        if idx not in _SMS:
            _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
        num_splits = plan_splits(q_tiles, Hkv, B, max_keys, _SMS[idx],
                                 tuning.knobs("prefill", dev)["split_min_keys"])
    bt = block_table if block_table.stride(1) == 1 else block_table.contiguous()
    sl = seq_lens.contiguous()
    cu = cu_seqlens_q if cu_seqlens_q.dtype == torch.int32 else cu_seqlens_q.to(torch.int32)
    cu = cu.contiguous()
    a = C.PrefillArgs()
    a.q, a.k_cache, a.v_cache = q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr()
    if k_scale is not None:
        a.k_scale, a.v_scale = k_scale.data_ptr(), v_scale.data_ptr()
    a.block_table, a.seq_lens, a.cu_seqlens_q = bt.data_ptr(), sl.data_ptr(), cu.data_ptr()
    a.out = out.data_ptr()
    if num_splits > 1:
        o_part = torch.empty(num_splits, T, Hq, D, dtype=torch.float32, device=dev)
        lse = torch.empty(num_splits, T, Hq, dtype=torch.float32, device=dev)
        a.o_partial, a.lse_partial = o_part.data_ptr(), lse.data_ptr()
    a.q_stride = q.stride(0)
    a.tokens, a.batch, a.q_heads, a.kv_heads, a.head_dim = T, B, Hq, Hkv, D
    a.page_size, a.bt_stride, a.bt_cols, a.num_pages = ps, bt.stride(0), bt.shape[1], P
    a.max_q_len, a.num_splits, a.tile_rows, a.tile_warps = max_q_len, num_splits, tile_rows, \
        tile_warps
    if wg:
        a.mainloop = 1
    a.err = device_errors.record_ptr(dev)
    a.scale = float(scale)
    a.q_dtype, a.kv_dtype = _dtypes.code(q.dtype), _dtypes.code(k_cache.dtype)
    C.attention_prefill(a, _ext.stream(dev))
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


# ---- the op's shape (paged prefill): available / why_not / plan / run / reference -----------
available = paged_available
why_not = paged_why_not
plan = prefill_plan
run = run_paged
reference = prefill_reference
