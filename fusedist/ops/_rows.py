"""Row views shared by the single-GPU layer kernels (add_rmsnorm, silu_mul): the input check,
the [T, n] view a kernel can address, and the overlap test for outputs."""

from __future__ import annotations

from typing import Optional

import torch

from .. import _align

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


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
