"""quantize_rows: dynamic per-token FP8 quantization of an activation, one single-GPU kernel.

    q, scale = fusedist.ops.quantize_rows(x)     # x [..., K] -> e4m3 [..., K], float32 [..., 1]
    q, scale = fusedist.ops.quantize_groups(x)   # one scale per 128 k: float32 [..., K / 128]

Per row (token): scale = max(amax |x|, 1e-30) / 448 (1 for a row of zeros), q = e4m3(x / scale)
in fp32 (IEEE division, round to nearest even, +-448 saturated), so x ~= q * scale. A NaN in a
row makes its scale and all of its q NaN; an infinite x makes its row's scale infinite (that
element NaN, the others 0). This is the activation side of the row-wise FP8 GEMMs
(fusedist.nn.quant: fp8_linear, scaled_mm_rowwise, fusedist.ops.fp8_gemm).

CUDA tensors of float32 / float16 / bfloat16 with K a multiple of the 16-byte vector (4 or 8
elements) take the kernel of csrc/ops/layers/quantize_rows.cu (one pass over x, one block per
row, no host sync: CUDA graphs capture it); everything else, and the CPU, the plain-torch
quantize_rows_reference. The kernel's bits are the reference's on the CPU (torch's ops on CUDA
divide by the scalar 448 as a multiply by its reciprocal: their scales can differ in the last
bit). Also torch.ops.fusedist.quantize_rows
(torch.compile(fullgraph=True)).
"""

from __future__ import annotations

import torch

from .. import _dtypes, _ext
from ._plan import KernelPlan, kernel_plan
from ._rows import check_rows_input, packed_rows, rows_view

MIN_AMAX = 1e-30   # the smallest amax a scale is made from (amax / 448 stays a normal float32)


def unit_scale(amax: torch.Tensor) -> torch.Tensor:
    """amax / 448 in float32, amax floored at MIN_AMAX; 1 where amax is 0 (a row or block of
    zeros); NaN stays NaN."""
    s = amax.float().clamp_min(MIN_AMAX) / _dtypes.FP8_MAX
    return torch.where(amax == 0, torch.ones_like(s), s)


def to_e4m3(v: torch.Tensor) -> torch.Tensor:
    """v (already divided by its scale) rounded to nearest e4m3, clamped to +-448 first (torch's
    conversion does not saturate); NaN stays NaN."""
    return v.clamp(-_dtypes.FP8_MAX, _dtypes.FP8_MAX).to(_dtypes.FP8)


def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch: (e4m3 [..., K], float32 scale [..., 1]) (module docstring)."""
    s = unit_scale(x.abs().amax(dim=-1, keepdim=True))
    return to_e4m3(x.float() / s), s


def quantize_groups_reference(x: torch.Tensor, group: int = 128
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch: quantize_rows_reference on each `group` consecutive elements of a row:
    (e4m3 [..., K], float32 scale [..., K / group])."""
    q, s = quantize_rows_reference(x.unflatten(-1, (x.shape[-1] // group, group)))
    return q.flatten(-2), s.squeeze(-1)


def _check(x) -> None:
    check_rows_input("quantize_rows", "x", x, "[..., K]")
    if _dtypes.FP8 is None:
        raise RuntimeError("fusedist.quantize_rows: this torch has no torch.float8_e4m3fn")
    if x.shape[-1] == 0:
        raise ValueError("fusedist.quantize_rows: x's last dimension (K) must be positive")


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale) = x per token as e4m3 with one float32 scale per row (module docstring)."""
    _check(x)
    if torch.compiler.is_compiling():
        return torch.ops.fusedist.quantize_rows(x)
    return _quantize_rows_impl(x)


def quantize_groups(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale) = x as e4m3 with one float32 scale per `group` consecutive elements of each
    row (the 1 x 128 activation form of block-scaled FP8 GEMMs): q [..., K], scale
    [..., K / group], each group quantized as quantize_rows quantizes a row. K % group == 0.
    CUDA: one pass of the group kernel where a group is 8, 16 or 32 16-byte vectors of x
    (128 elements of bf16 / fp16 / fp32), else quantize_rows on the groups as rows."""
    _check(x)
    k = x.shape[-1]
    if not isinstance(group, int) or group <= 0 or k % group:
        raise ValueError(f"fusedist.quantize_groups: group must be a positive divisor of K = "
                         f"{k}, got {group!r}")
    if torch.compiler.is_compiling():
        return torch.ops.fusedist.quantize_groups(x, group)
    return _quantize_groups_impl(x, group)


def _group_vectors_ok(x: torch.Tensor, group: int) -> bool:
    per = 16 // x.element_size()
    return group % per == 0 and group // per in (8, 16, 32)


def _quantize_groups_impl(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    return run(plan(x, group), x, group)


# ---- the op's shape: available / why_not / plan / run / reference ----------------------------
reference = quantize_rows_reference


def available(device) -> bool:
    """The quantize_rows kernel runs on `device`."""
    return _ext.kernel_runs("quantize_rows", device)


def why_not(x: torch.Tensor, group: int = 0) -> str:
    """Why the kernel cannot take x (a valid input) with one scale per row (group 0) or per
    `group` elements; "" when it can."""
    why = kernel_why_not(x)
    if not why and group and not _group_vectors_ok(x, group):
        why = (f"group {group} is not 8, 16 or 32 16-byte vectors of {x.dtype} (the group "
               "kernel's widths): groups run as rows")
    return why


def plan(x: torch.Tensor, group: int = 0) -> KernelPlan:
    return kernel_plan("quantize_rows", why_not(x, group))


def run(p: KernelPlan, x: torch.Tensor, group: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Execute p: (q, scale) of x per row (group 0) or per `group` elements."""
    if group:
        if x.numel() == 0 or not p.kernel:
            q, s = _quantize_rows_impl(x.unflatten(-1, (x.shape[-1] // group, group)))
            return q.flatten(-2), s.squeeze(-1)
        return _launch(x, group)
    if x.numel() == 0 or not p.kernel:
        return quantize_rows_reference(x)
    return _launch(x, 0)


def kernel_why_not(x: torch.Tensor) -> str:
    """Why the kernel cannot take x (a valid input) with one scale per row; "" when it can."""
    why = _ext.why_not("quantize_rows", x.device)
    if why:
        return why
    per = 16 // x.element_size()
    if x.shape[-1] % per:
        return f"K = {x.shape[-1]} is not a multiple of {per} (16-byte vectors of {x.dtype})"
    return ""


def _quantize_rows_impl(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return run(plan(x), x)


def _launch(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel on x [..., K]: one scale per row (group 0) or per group of K."""
    k = x.shape[-1]
    x2 = rows_view(x)
    if x2 is None:   # rows the kernel cannot address: a fresh contiguous (aligned) copy
        x2 = packed_rows(x)
    q = torch.empty(x.shape, dtype=_dtypes.FP8, device=x.device)
    scale = torch.empty((*x.shape[:-1], k // group if group else 1), dtype=torch.float32,
                        device=x.device)
    C = _ext.load()
    a = C.QuantizeRowsArgs()
    a.x, a.out, a.scale = x2.data_ptr(), q.data_ptr(), scale.data_ptr()
    a.tokens, a.k = x2.shape[0], k
    a.in_stride, a.out_stride = x2.stride(0), k
    a.dtype = _dtypes.code(x.dtype)
    a.group = group
    C.quantize_rows(a, _ext.stream(x.device))
    return q, scale


@torch.library.custom_op("fusedist::quantize_rows", mutates_args=())
def _quantize_rows_op(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _quantize_rows_impl(x)


@_quantize_rows_op.register_fake
def _(x):
    return (torch.empty(x.shape, dtype=_dtypes.FP8, device=x.device),
            torch.empty((*x.shape[:-1], 1), dtype=torch.float32, device=x.device))


@torch.library.custom_op("fusedist::quantize_groups", mutates_args=())
def _quantize_groups_op(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _quantize_groups_impl(x, group)


@_quantize_groups_op.register_fake
def _(x, group):
    return (torch.empty(x.shape, dtype=_dtypes.FP8, device=x.device),
            torch.empty((*x.shape[:-1], x.shape[-1] // group), dtype=torch.float32,
                        device=x.device))


__all__ = ["quantize_rows", "quantize_rows_reference", "quantize_groups",
           "quantize_groups_reference", "kernel_why_not", "unit_scale", "to_e4m3", "MIN_AMAX",
           "available", "why_not", "plan", "run", "reference"]
