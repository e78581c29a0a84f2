"""MoE permute / unpermute: tokens into per-expert segments and the experts' outputs back.

    x_perm = permute(x, layout)                          # [rows, H]: row r = x[src_index[r] // k]
    xq, sx = permute(x, layout, quant="token")           # e4m3 + one float32 scale per row
    xq, sx = permute(x, layout, quant="group")           # e4m3 + one scale per 128 columns
    y = unpermute(y_perm, layout, weights)               # [T, H] = sum_j w[t, j] y_perm[dest[t k + j]]
    y = unpermute(y_perm, layout, weights, residual=r)   # ... + r

layout is fusedist.ops.moe.sort_by_expert's MoeLayout. permute writes every row of the buffer:
padding rows (src_index -1) are zeros (scale 1 when quantized), so the grouped GEMMs may read
whole tiles. quant="token" quantizes each row as fusedist.ops.quantize_rows does, "group" each
128 columns as quantize_groups does (H % 128 == 0): the activation operands of the FP8 grouped
GEMMs, in the same pass as the gather.

unpermute adds each token's k expert outputs in slot order j = 0 .. k-1 in float32, weighted by
weights [T, k] (float32), adds the residual (if any) in float32 and rounds once to y_perm's
dtype: the same bits on every run, and the same on every rank. Rows of y_perm that hold no pair
(padding) are never read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ... import _dtypes, _ext
from ..quantize_rows import quantize_groups_reference, quantize_rows_reference
from .gating import MoeLayout

QUANTS = (None, "token", "group")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _fail(msg: str, exc=ValueError):
    raise exc(f"fusedist.ops.moe: {msg}")


# ---- references ------------------------------------------------------------------------------

def permute_reference(x: torch.Tensor, layout: MoeLayout, quant: Optional[str] = None):
    """Plain torch, no host synchronization (module docstring)."""
    src = layout.src_index.long()
    valid = (src >= 0)[:, None]
    rows = x.index_select(0, src.clamp_min(0) // layout.top_k)
    xp = torch.where(valid, rows, torch.zeros((), dtype=x.dtype, device=x.device))
    if quant is None:
        return xp
    q, s = quantize_rows_reference(xp) if quant == "token" else quantize_groups_reference(xp)
    return q, (s.squeeze(-1) if quant == "token" else s)


def unpermute_reference(y_perm: torch.Tensor, layout: MoeLayout, weights: torch.Tensor,
                        residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Plain torch (module docstring)."""
    T, k = weights.shape
    g = y_perm.index_select(0, layout.dest_index.long()).view(T, k, -1).float()
    w = weights.float()
    acc = w[:, 0, None] * g[:, 0]
    for j in range(1, k):
        acc = acc + w[:, j, None] * g[:, j]
    if residual is not None:
        acc = acc + residual.float()
    return acc.to(y_perm.dtype)


# ---- checks ----------------------------------------------------------------------------------

def _check_layout(layout, tokens: Optional[int] = None) -> None:
    if not isinstance(layout, MoeLayout):
        _fail(f"layout must be a fusedist.ops.moe.MoeLayout (sort_by_expert's), got "
              f"{type(layout).__name__}", TypeError)
    if tokens is not None and layout.tokens != tokens:
        _fail(f"layout was made for {layout.tokens} tokens, the call has {tokens}")


def _check_permute(x, layout, quant) -> None:
    _check_layout(layout)
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype not in DTYPES:
        _fail("x must be a 2-D [tokens, hidden] float32 / float16 / bfloat16 tensor, got "
              f"{getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))}")
    if x.shape[0] != layout.tokens:
        _fail(f"x has {x.shape[0]} tokens, the layout {layout.tokens}")
    if x.device != layout.src_index.device:
        _fail(f"x is on {x.device}, the layout on {layout.src_index.device}")
    if quant not in QUANTS:
        _fail(f"quant must be one of {QUANTS}, got {quant!r}")
    if quant is not None and _dtypes.FP8 is None:
        _fail("quant needs torch.float8_e4m3fn (this torch has none)", RuntimeError)
    if quant == "group" and x.shape[1] % _dtypes.FP8_BLOCK:
        _fail(f"quant='group' takes hidden a multiple of {_dtypes.FP8_BLOCK}, got {x.shape[1]}")


def _check_unpermute(y_perm, layout, weights, residual, out) -> None:
    _check_layout(layout)
    if not isinstance(y_perm, torch.Tensor) or y_perm.dim() != 2 or y_perm.dtype not in DTYPES:
        _fail("y_perm must be a 2-D [rows, hidden] float32 / float16 / bfloat16 tensor, got "
              f"{getattr(y_perm, 'dtype', type(y_perm).__name__)} "
              f"{tuple(getattr(y_perm, 'shape', ()))}")
    if y_perm.shape[0] != layout.rows:
        _fail(f"y_perm has {y_perm.shape[0]} rows, the layout {layout.rows}")
    T, k = layout.tokens, layout.top_k
    if not isinstance(weights, torch.Tensor) or tuple(weights.shape) != (T, k) or \
            weights.dtype != torch.float32 or weights.device != y_perm.device:
        _fail(f"weights must be float32 [{T}, {k}] on {y_perm.device} (route's weights), got "
              f"{getattr(weights, 'dtype', type(weights).__name__)} "
              f"{tuple(getattr(weights, 'shape', ()))}")
    want = (T, y_perm.shape[1])
    for name, t in (("residual", residual), ("out", out)):
        if t is not None and (not isinstance(t, torch.Tensor) or tuple(t.shape) != want or
                              t.dtype != y_perm.dtype or t.device != y_perm.device):
            _fail(f"{name} must be {y_perm.dtype} {list(want)} on {y_perm.device}, got "
                  f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")


# ---- the op ----------------------------------------------------------------------------------

def available(device) -> bool:
    """The permute / unpermute kernels run on `device`."""
    return _ext.kernel_runs("moe_permute", device)


def why_not(x: torch.Tensor) -> str:
    """Why the kernels do not take rows like x's; "" when they do."""
    why = _ext.why_not("moe_permute", x.device)
    if why:
        return why
    per = 16 // x.element_size()
    if x.shape[-1] % per:
        return f"hidden {x.shape[-1]} is not a multiple of {per} (16-byte vectors of {x.dtype})"
    return ""


@dataclass(frozen=True)
class PermutePlan:
    """Which path runs (plain data): "kernel" or "reference", and why not the kernel."""
    path: str
    why: str = ""


def plan(x: torch.Tensor) -> PermutePlan:
    why = why_not(x)
    return PermutePlan("reference" if why else "kernel", why)


def permute(x: torch.Tensor, layout: MoeLayout, *, quant: Optional[str] = None):
    """x's rows in the layout's permuted order (module docstring); with quant, (e4m3, scale)."""
    _check_permute(x, layout, quant)
    p = plan(x)
    if p.path == "reference":
        if x.is_cuda:
            _ext.warn_reference("moe.permute", p.why)
        return permute_reference(x, layout, quant)
    return _permute_kernel(x, layout, quant)


def unpermute(y_perm: torch.Tensor, layout: MoeLayout, weights: torch.Tensor, *,
              residual: Optional[torch.Tensor] = None,
              out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Each token's weighted sum of its experts' rows (+ residual) (module docstring)."""
    _check_unpermute(y_perm, layout, weights, residual, out)
    p = plan(y_perm)
    if p.path == "reference":
        if y_perm.is_cuda:
            _ext.warn_reference("moe.unpermute", p.why)
        y = unpermute_reference(y_perm, layout, weights, residual)
    else:
        y = _unpermute_kernel(y_perm, layout, weights, residual, out)
    if out is not None and y is not out:
        out.copy_(y)
        return out
    return y


def _permute_kernel(x, layout, quant):  # pragma: no cover - needs the kernel
    raise NotImplementedError("fusedist.ops.moe: the permute kernel is not wired yet")


def _unpermute_kernel(y_perm, layout, weights, residual, out):  # pragma: no cover
    raise NotImplementedError("fusedist.ops.moe: the unpermute kernel is not wired yet")


__all__ = ["permute", "unpermute", "permute_reference", "unpermute_reference", "PermutePlan",
           "QUANTS", "available", "why_not", "plan"]
