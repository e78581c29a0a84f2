"""Grouped GEMM over experts: each expert's rows of the permuted buffer times its weight.

    y = grouped_gemm(x_perm, w, layout)                       # x_perm [rows, K], w [E, N, K]
    y = grouped_gemm(xq, w8, layout, x_scale=sx, w_scale=sw)  # FP8: e4m3 operands + scales
    y = grouped_gemm(x, w, layout, gather=True)               # x [T, K] in token order

For every expert e, rows offsets[e] .. offsets[e] + counts[e] of the result are those rows of x
times w[e]^T (w[e] is an nn.Linear weight [N, K], K contiguous: Hugging Face's
`experts.{e}.*_proj.weight` stacked), accumulated in float32 and rounded once to bfloat16 (x's
dtype for a float16 / float32 x on the reference path). Rows that hold no (token, slot) pair
(the layout's padding) are not written. gather=True reads the rows of a token-order x instead
of a permuted one: row r of the product is x[src_index[r] // k] times its expert's weight (the
decode path: no permute pass).

FP8 (torch.float8_e4m3fn) weights carry w_scale, float32, that MULTIPLIES the e4m3 values, in
one of three layouts: [E] (per expert), [E, N] (per output channel), [E, ceil(N / 128),
ceil(K / 128)] (128 x 128 blocks: the FP8 Qwen3 / DeepSeek checkpoints). The activation is
bf16 (weight-only: the weight dequantized on the way) or e4m3 with x_scale float32 [rows] (per
row, as permute(quant="token") writes) or [rows, K / 128] (per 128 columns, quant="group";
block weights take this one). The error against float64 is the FP8 GEMMs' (fusedist.ops.
fp8_gemm's docstring): 2^-8 |ref| for the bf16 rounding plus (2^-13 + (K + 2) 2^-24) sum |x w|.

Nothing synchronizes with the host on the kernel paths: counts and offsets are read on the
device, so a captured graph replays with new routings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ... import _dtypes, _ext
from .gating import MoeLayout

W_DTYPES = (torch.bfloat16,) + ((_dtypes.FP8,) if _dtypes.FP8 is not None else ())
SCALE_LAYOUTS = ("none", "expert", "channel", "block")


def _fail(msg: str, exc=ValueError):
    raise exc(f"fusedist.ops.moe.grouped_gemm: {msg}")


def _is_fp8(t: torch.Tensor) -> bool:
    return _dtypes.FP8 is not None and t.dtype == _dtypes.FP8


def w_scale_layout(w: torch.Tensor, w_scale: Optional[torch.Tensor]) -> str:
    """Which of SCALE_LAYOUTS w_scale is for w [E, N, K] (ValueError naming the shapes)."""
    if w_scale is None:
        return "none"
    E, N, K = w.shape
    if not _is_fp8(w):
        _fail(f"w_scale goes with float8_e4m3fn weights; w is {w.dtype} (pass w_scale=None)")
    if not isinstance(w_scale, torch.Tensor) or w_scale.dtype != torch.float32 or \
            w_scale.device != w.device:
        _fail(f"w_scale must be a float32 tensor on {w.device}, got "
              f"{getattr(w_scale, 'dtype', type(w_scale).__name__)}")
    b = _dtypes.FP8_BLOCK
    shape = tuple(w_scale.shape)
    if shape == (E,):
        return "expert"
    if shape == (E, N):
        return "channel"
    if shape == (E, -(-N // b), -(-K // b)):
        return "block"
    _fail(f"w_scale has shape {list(shape)}; for w [{E}, {N}, {K}] pass [{E}] (per expert), "
          f"[{E}, {N}] (per output channel) or [{E}, {-(-N // b)}, {-(-K // b)}] (per 128 x 128 "
          "block)")


def dequantize_weights(w: torch.Tensor, w_scale: Optional[torch.Tensor]) -> torch.Tensor:
    """w [E, N, K] as float32 with its scales applied."""
    wf = w.float()
    mode = w_scale_layout(w, w_scale)
    E, N, K = w.shape
    if mode == "expert":
        return wf * w_scale.view(E, 1, 1)
    if mode == "channel":
        return wf * w_scale.view(E, N, 1)
    if mode == "block":
        return torch.stack([wf[e] * _dtypes.expand_block_scales(w_scale[e], N, K)
                            for e in range(E)])
    return wf


def _x_float(x: torch.Tensor, x_scale: Optional[torch.Tensor]) -> torch.Tensor:
    if x_scale is None:
        return x.float()
    if x_scale.dim() == 1:
        return x.float() * x_scale.view(-1, 1)
    return x.float() * _dtypes.expand_block_scales(x_scale, x.shape[0], x.shape[1], 1)


def grouped_gemm_reference(x: torch.Tensor, w: torch.Tensor, layout: MoeLayout, *,
                           w_scale: Optional[torch.Tensor] = None,
                           x_scale: Optional[torch.Tensor] = None, gather: bool = False,
                           out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Plain torch, float32 (module docstring). Reads the counts on the host: not for CUDA
    graphs."""
    out_dtype = torch.bfloat16 if (_is_fp8(x) or _is_fp8(w)) else x.dtype
    N = w.shape[1]
    if out is None:
        out = torch.zeros((layout.rows, N), dtype=out_dtype, device=x.device)
    xf = _x_float(x, x_scale)
    if gather:
        src = layout.src_index.long()
        xf = xf.index_select(0, src.clamp_min(0) // layout.top_k)
    wf = dequantize_weights(w, w_scale)
    counts = layout.counts.tolist()
    offsets = layout.offsets.tolist()
    for e, c in enumerate(counts):
        if c:
            o = offsets[e]
            out[o:o + c] = (xf[o:o + c] @ wf[e].t()).to(out.dtype)
    return out


# ---- checks ----------------------------------------------------------------------------------

def _check(x, w, layout, w_scale, x_scale, gather, out) -> str:
    """Every argument check, once; returns w_scale's layout."""
    if not isinstance(layout, MoeLayout):
        _fail(f"layout must be a fusedist.ops.moe.MoeLayout (sort_by_expert's), got "
              f"{type(layout).__name__}", TypeError)
    if not isinstance(w, torch.Tensor) or w.dim() != 3 or w.dtype not in W_DTYPES:
        _fail("w must be a 3-D [experts, N, K] bfloat16 or float8_e4m3fn tensor, got "
              f"{getattr(w, 'dtype', type(w).__name__)} {tuple(getattr(w, 'shape', ()))}")
    E, N, K = w.shape
    if E != layout.num_experts:
        _fail(f"w has {E} experts, the layout {layout.num_experts}")
    if w.stride(2) != 1:
        _fail(f"w must have K contiguous (stacked nn.Linear weights [E, N, K]); got strides "
              f"{tuple(w.stride())}: pass w.contiguous()")
    rows = layout.tokens if gather else layout.rows
    what = f"[{layout.tokens}, {K}] in token order (gather=True)" if gather else \
        f"[{layout.rows}, {K}] (the layout's permuted rows)"
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or tuple(x.shape) != (rows, K):
        _fail(f"x must be {what}, got {tuple(getattr(x, 'shape', ()))}")
    if x.device != w.device or x.device != layout.offsets.device:
        _fail(f"x, w and the layout must be on one device (x {x.device}, w {w.device}, layout "
              f"{layout.offsets.device})")
    mode = w_scale_layout(w, w_scale)
    if _is_fp8(w) and mode == "none":
        _fail("float8_e4m3fn weights need w_scale (float32 [E], [E, N] or 128 x 128 blocks)")
    if _is_fp8(x):
        if not _is_fp8(w):
            _fail("an e4m3 x takes float8_e4m3fn weights")
        kb = K // _dtypes.FP8_BLOCK
        ok = isinstance(x_scale, torch.Tensor) and x_scale.dtype == torch.float32 and \
            x_scale.device == x.device and (tuple(x_scale.shape) == (rows,) or
                                            (K % _dtypes.FP8_BLOCK == 0 and
                                             tuple(x_scale.shape) == (rows, kb)))
        if not ok:
            _fail(f"an e4m3 x needs x_scale float32 [{rows}] (per row) or [{rows}, K / 128] "
                  f"(per 128 columns, K % 128 == 0), got "
                  f"{getattr(x_scale, 'dtype', type(x_scale).__name__)} "
                  f"{tuple(getattr(x_scale, 'shape', ()))}")
        if mode == "block" and x_scale.dim() != 2:
            _fail("block-scaled weights take an x quantized per 128 columns "
                  "(permute(quant='group'): x_scale [rows, K / 128])")
    else:
        if x_scale is not None:
            _fail(f"x_scale goes with an e4m3 x; x is {x.dtype}: pass x_scale=None")
        if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            _fail(f"x must be bfloat16 (or e4m3 with x_scale), got {x.dtype}")
        if x.dtype != torch.bfloat16 and (w.dtype != x.dtype and not _is_fp8(w)):
            _fail(f"x is {x.dtype} but w is {w.dtype}: pass both in one dtype")
    if out is not None:
        od = torch.bfloat16 if (_is_fp8(x) or _is_fp8(w)) else x.dtype
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != (layout.rows, N) or \
                out.dtype != od or out.device != x.device or not out.is_contiguous():
            _fail(f"out must be a contiguous {od} [{layout.rows}, {N}] tensor on {x.device}, "
                  f"got {getattr(out, 'dtype', type(out).__name__)} "
                  f"{tuple(getattr(out, 'shape', ()))}")
    return mode


# ---- the op ----------------------------------------------------------------------------------

def available(device) -> bool:
    """The grouped GEMM kernel runs on `device`."""
    return _ext.kernel_runs("moe_grouped_gemm", device)


@dataclass(frozen=True)
class GroupedGemmPlan:
    """Which kernel multiplies (plain data): "gemm" (the CUTLASS grouped GEMM), "gemv" (the
    grouped decode GEMV over the routed experts), or "reference"; why not a kernel."""
    path: str
    why: str = ""


def why_not(x: torch.Tensor, w: torch.Tensor, path: str = "gemm") -> str:
    """Why kernel `path` ("gemm" or "gemv") does not take this (valid) call; "" when it does."""
    kernel = {"gemm": "moe_grouped_gemm", "gemv": "moe_grouped_gemv"}[path]
    return _ext.why_not(kernel, x.device)


def plan(x: torch.Tensor, w: torch.Tensor, layout: MoeLayout, gather: bool = False
         ) -> GroupedGemmPlan:
    """The path for this call (the tuning table's "moe" section decides between the kernels)."""
    why = why_not(x, w, "gemm")
    if why:
        return GroupedGemmPlan("reference", why)
    return GroupedGemmPlan("gemm")


def run(p: GroupedGemmPlan, x, w, layout, *, w_scale=None, x_scale=None, gather=False,
        out=None) -> torch.Tensor:
    if p.path == "reference":
        if x.is_cuda:
            _ext.warn_reference("moe.grouped_gemm", p.why)
        return grouped_gemm_reference(x, w, layout, w_scale=w_scale, x_scale=x_scale,
                                      gather=gather, out=out)
    raise NotImplementedError(f"fusedist.ops.moe.grouped_gemm: path {p.path!r} is not wired yet")


def grouped_gemm(x: torch.Tensor, w: torch.Tensor, layout: MoeLayout, *,
                 w_scale: Optional[torch.Tensor] = None, x_scale: Optional[torch.Tensor] = None,
                 gather: bool = False, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Each expert's rows of x times its weight (module docstring) -> [rows, N]."""
    _check(x, w, layout, w_scale, x_scale, gather, out)
    return run(plan(x, w, layout, gather), x, w, layout, w_scale=w_scale, x_scale=x_scale,
               gather=gather, out=out)


__all__ = ["grouped_gemm", "grouped_gemm_reference", "dequantize_weights", "w_scale_layout",
           "GroupedGemmPlan", "SCALE_LAYOUTS", "available", "why_not", "plan", "run"]
