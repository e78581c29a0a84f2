"""Row views shared by the single-GPU layer kernels (add_rmsnorm, silu_mul): the input check,
the [T, n] view a kernel can address, the overlap test for outputs, and the per-token FP8
output (fp8_rows, the references' form of the kernels' e4m3 + scale)."""

from __future__ import annotations

from typing import Optional

import torch

from .. import _align, _dtypes

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FP8_MIN_AMAX = 1e-12   # the smallest amax a scale is made from (layers/fp8_rows.cuh kFp8MinAmax)


def fp8_rows(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 y [..., n] -> (e4m3 [..., n], float32 scale [...]): per row (token)
    scale = max(amax |y|, 1e-12) / 448 and q = e4m3(y / scale), so y ~= q * scale. The fused
    all-reduce + RMSNorm's convention; a NaN in a row makes its scale and all of its q NaN."""
    scale = y.abs().amax(-1).clamp_min(FP8_MIN_AMAX) / _dtypes.FP8_MAX
    return (y / scale.unsqueeze(-1)).to(_dtypes.FP8), scale


def check_out_dtype(op: str, name: str, t: torch.Tensor, out_dtype) -> bool:
    """out_dtype of a layer op on input t: True for FP8 (e4m3 + per-token scales), False for
    None or t's dtype; else a ValueError naming op and the choices."""
    if out_dtype is None or out_dtype == t.dtype:
        return False
    if _dtypes.FP8 is not None and out_dtype == _dtypes.FP8:
        return True
    fp8 = " or torch.float8_e4m3fn" if _dtypes.FP8 is not None else \
        " (this torch has no torch.float8_e4m3fn)"
    raise ValueError(f"fusedist.{op}: out_dtype must be None, {t.dtype} ({name}'s dtype)"
                     f"{fp8}, got {out_dtype!r}")


def check_rows_input(op: str, name: str, t, layout: str) -> None:
    """t is a tensor `layout` ([..., n]) of float32 / float16 / bfloat16 (the layer kernels'
    inputs), else a ValueError naming op and argument."""
    if not isinstance(t, torch.Tensor) or t.dim() < 1:
        shape = f" {tuple(t.shape)}" if isinstance(t, torch.Tensor) else ""
        raise ValueError(f"fusedist.{op}: {name} must be a tensor {layout}, got "
                         f"{type(t).__name__}{shape}")
    if t.dtype not in DTYPES:
        raise ValueError(f"fusedist.{op}: {name} has dtype {t.dtype}; use float32, float16 or "
                         "bfloat16")


def _span(t: torch.Tensor) -> tuple[int, int]:
    """[first, last) byte addresses t's elements can occupy."""
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride())) if t.numel() else -1
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """a's and b's elements may share bytes (their address spans intersect)."""
    (a0, a1), (b0, b1) = _span(a), _span(b)
    return a0 < b1 and b0 < a1


def rows_view(t: torch.Tensor) -> Optional[torch.Tensor]:
    """t [..., n] as a [T, n] view the layer kernels can address (unit feature stride, rows
    that do not overlap, a 16-byte aligned start and row stride), or None."""
    n = t.shape[-1]
    v = t if t.dim() == 2 else (t.view(-1, n) if t.is_contiguous() else None)
    if v is not None and v.shape[0] == 1 and v.stride(0) != n:   # one row: its stride is moot
        v = v.as_strided((1, n), (n, 1))
    if v is None or v.stride(1) != 1 or v.stride(0) < n or not _align.is_aligned(v) or \
            not _align.whole_vectors(v.stride(0) * v.element_size()):
        return None
    return v


def packed_rows(t: torch.Tensor) -> torch.Tensor:
    """A fresh contiguous [T, n] copy of t [..., n] (fresh allocations are 16-byte aligned)."""
    return t.reshape(-1, t.shape[-1]).clone(memory_format=torch.contiguous_format)
