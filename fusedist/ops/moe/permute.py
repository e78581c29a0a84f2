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

CUDA tensors whose hidden size is whole 16-byte vectors take the kernels of
csrc/ops/moe/permute.cu (docs/design/moe.md, "Permute / unpermute"), with the references' bits:
permute one pass (the FP8 forms quantize in it), unpermute one pass with the products and sums
rounded as the reference rounds them. No host synchronization: CUDA graphs capture both. The
kernels check the layout they follow: a src_index outside [-1, T k) makes its row NaN (scale
NaN), a dest_index outside [0, rows) its token's output NaN, and the first is recorded
(fusedist.check_device_errors() raises MetadataError); an id that sort_by_expert left out
(dest_index -1) poisons its token the same way. Also torch.ops.fusedist.moe_permute,
moe_permute_fp8 and moe_unpermute (torch.compile(fullgraph=True)).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ... import _dtypes, _ext
from .. import device_errors
from .._rows import overlaps, packed_rows, rows_view
from ..quantize_rows import quantize_groups_reference, quantize_rows_reference
from .gating import MoeLayout

QUANTS = (None, "token", "group")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _fail(msg: str, exc=ValueError):
    raise exc(f"fusedist.ops.moe: {msg}")


# ---- references ------------------------------------------------------------------------------

def permute_reference(x: torch.Tensor, layout: MoeLayout, quant: Optional[str] = None):
    """Plain torch, no host synchronization (module docstring)."""
    return _permute_ref(x, layout.src_index, layout.top_k, quant)


def _permute_ref(x, src_index, top_k, quant):
    src = src_index.long()
    valid = (src >= 0)[:, None]
    rows = x.index_select(0, src.clamp_min(0) // top_k)
    xp = torch.where(valid, rows, torch.zeros((), dtype=x.dtype, device=x.device))
    if quant is None:
        return xp
    q, s = quantize_rows_reference(xp) if quant == "token" else quantize_groups_reference(xp)
    return q, (s.squeeze(-1) if quant == "token" else s)


def unpermute_reference(y_perm: torch.Tensor, layout: MoeLayout, weights: torch.Tensor,
                        residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Plain torch (module docstring)."""
    return _unpermute_ref(y_perm, layout.dest_index, weights, residual)


def _unpermute_ref(y_perm, dest_index, weights, residual):
    T, k = weights.shape
    g = y_perm.index_select(0, dest_index.long()).view(T, k, -1).float()
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
    if torch.compiler.is_compiling():
        if quant is None:
            return torch.ops.fusedist.moe_permute(x, layout.src_index, layout.top_k)
        return torch.ops.fusedist.moe_permute_fp8(x, layout.src_index, layout.top_k,
                                                  quant == "group")
    return _permute_impl(x, layout.src_index, layout.top_k, quant)


def unpermute(y_perm: torch.Tensor, layout: MoeLayout, weights: torch.Tensor, *,
              residual: Optional[torch.Tensor] = None,
              out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Each token's weighted sum of its experts' rows (+ residual) (module docstring)."""
    _check_unpermute(y_perm, layout, weights, residual, out)
    if torch.compiler.is_compiling():
        y = torch.ops.fusedist.moe_unpermute(y_perm, layout.dest_index, weights, residual)
    else:
        y = _unpermute_impl(y_perm, layout.dest_index, weights, residual, out)
    if out is not None and y is not out:
        out.copy_(y)
        return out
    return y


def _permute_impl(x, src_index, top_k, quant, p: Optional[PermutePlan] = None, out=None):
    """permute on x's rows; out: the output (and scale) to write (tests poison them)."""
    p = plan(x) if p is None else p
    if p.path == "reference":
        if x.is_cuda:
            _ext.warn_reference("moe.permute", p.why)
        return _permute_ref(x, src_index, top_k, quant)
    rows, H = src_index.shape[0], x.shape[1]
    dev = x.device
    if out is None:
        if quant is None:
            out = torch.empty(rows, H, dtype=x.dtype, device=dev)
        else:
            out = (torch.empty(rows, H, dtype=_dtypes.FP8, device=dev),
                   torch.empty((rows,) if quant == "token" else (rows, H // _dtypes.FP8_BLOCK),
                               dtype=torch.float32, device=dev))
    q, scale = (out, None) if quant is None else out
    x2 = _rows(x)
    C = _ext.load()
    device_errors.check_before_launch(x)
    a = C.MoePermuteArgs()
    a.x, a.x_stride = x2.data_ptr(), x2.stride(0) if x2.shape[0] > 1 else H  # 1 row: moot
    a.src_index, a.out = src_index.data_ptr(), q.data_ptr()
    a.scale = 0 if scale is None else scale.data_ptr()
    a.out_stride = H
    a.tokens, a.rows, a.top_k, a.hidden = x.shape[0], rows, top_k, H
    a.quant = QUANTS.index(quant)
    a.dtype = _dtypes.code(x.dtype)
    a.err = device_errors.record_ptr(dev)
    C.moe_permute(a, _ext.stream(dev))
    return out


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t [n, H] as rows the kernels address (16-byte aligned start and row stride), or a fresh
    contiguous copy."""
    v = rows_view(t) if t.shape[0] else t
    return v if v is not None else packed_rows(t)


def _unpermute_impl(y_perm, dest_index, weights, residual, out=None,
                    p: Optional[PermutePlan] = None):
    p = plan(y_perm) if p is None else p
    if p.path == "reference":
        if y_perm.is_cuda:
            _ext.warn_reference("moe.unpermute", p.why)
        return _unpermute_ref(y_perm, dest_index, weights, residual)
    T, k = weights.shape
    H = y_perm.shape[1]
    dev = y_perm.device
    # out itself where the kernel can write it (in place over the residual is fine: each thread
    # reads its residual vector before it writes that vector of out), else a fresh tensor
    ov = rows_view(out) if out is not None and T and not overlaps(out, y_perm) else None
    o = ov if ov is not None else torch.empty(T, H, dtype=y_perm.dtype, device=dev)
    y2 = _rows(y_perm)
    r2 = None if residual is None else _rows(residual)
    w = weights.contiguous()
    d = dest_index.contiguous()
    C = _ext.load()
    device_errors.check_before_launch(y_perm)
    a = C.MoeUnpermuteArgs()
    a.y, a.y_stride = y2.data_ptr(), y2.stride(0) if y2.shape[0] > 1 else H  # 1 row: moot
    a.dest_index, a.weights, a.out = d.data_ptr(), w.data_ptr(), o.data_ptr()
    a.out_stride = o.stride(0) if T > 1 else H
    if r2 is not None:
        a.residual, a.res_stride = r2.data_ptr(), r2.stride(0) if r2.shape[0] > 1 else H
    a.tokens, a.rows, a.top_k, a.hidden = T, y_perm.shape[0], k, H
    a.dtype = _dtypes.code(y_perm.dtype)
    a.err = device_errors.record_ptr(dev)
    C.moe_unpermute(a, _ext.stream(dev))
    return out if ov is not None else o


# ---- torch.library registrations (torch.compile(fullgraph=True)) -----------------------------

@torch.library.custom_op("fusedist::moe_permute", mutates_args=())
def _permute_op(x: torch.Tensor, src_index: torch.Tensor, top_k: int) -> torch.Tensor:
    return _permute_impl(x, src_index, top_k, None)


@_permute_op.register_fake
def _(x, src_index, top_k):
    return x.new_empty((src_index.shape[0], x.shape[1]))


@torch.library.custom_op("fusedist::moe_permute_fp8", mutates_args=())
def _permute_fp8_op(x: torch.Tensor, src_index: torch.Tensor, top_k: int, group: bool
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple(_permute_impl(x, src_index, top_k, "group" if group else "token"))


@_permute_fp8_op.register_fake
def _(x, src_index, top_k, group):
    rows, H = src_index.shape[0], x.shape[1]
    return (x.new_empty((rows, H), dtype=_dtypes.FP8),
            x.new_empty((rows, H // _dtypes.FP8_BLOCK) if group else (rows,),
                        dtype=torch.float32))


@torch.library.custom_op("fusedist::moe_unpermute", mutates_args=())
def _unpermute_op(y_perm: torch.Tensor, dest_index: torch.Tensor, weights: torch.Tensor,
                  residual: Optional[torch.Tensor]) -> torch.Tensor:
    return _unpermute_impl(y_perm, dest_index, weights, residual)


@_unpermute_op.register_fake
def _(y_perm, dest_index, weights, residual):
    return y_perm.new_empty((weights.shape[0], y_perm.shape[1]))


__all__ = ["permute", "unpermute", "permute_reference", "unpermute_reference", "PermutePlan",
           "QUANTS", "available", "why_not", "plan"]


# ---- the op's shape: available / why_not / plan (above) / run / reference --------------------
reference = permute_reference


def run(p: PermutePlan, x: torch.Tensor, layout: MoeLayout, quant: Optional[str] = None):
    """Execute p: permute x by the layout (validated arguments); unpermute's is
    _unpermute_impl(y_perm, layout.dest_index, weights, residual, out, p)."""
    return _permute_impl(x, layout.src_index, layout.top_k, quant, p)
