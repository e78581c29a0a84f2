"""add_rmsnorm: a transformer block's residual add and RMSNorm in one single-GPU kernel.

    normed, residual = fusedist.add_rmsnorm(x, residual, weight, eps)   # residual <- x + residual
    normed, x = fusedist.add_rmsnorm(x, None, weight, eps)              # plain RMSNorm (h = x)
    normed = fusedist.rmsnorm(x, weight, eps)                           # the same, normed only
    q, residual, scale = fusedist.add_rmsnorm(x, residual, weight, eps,
                                              out_dtype=torch.float8_e4m3fn)
    q, scale = fusedist.rmsnorm(x, weight, eps, out_dtype=torch.float8_e4m3fn)

h = x + residual is computed in x's dtype (an fp32 add rounded once: what `x + residual` gives
in torch) and written into `residual` IN PLACE; the second result is that same tensor (as
vLLM's fused_add_rms_norm, this saves an allocation and a write). normed = h * rsqrt(mean(h^2)
+ eps) * weight in fp32, rounded once (F.rms_norm's result on h), into `out` (a new tensor when
None; out may be x itself, never residual). Without a residual, h = x: nothing but normed is
written, and the second result is x, the residual stream the block starts from.

out_dtype=torch.float8_e4m3fn: normed as e4m3 with one float32 scale per token (row), the
fused all-reduce + RMSNorm's convention (fusedist.all_reduce_add_rmsnorm): y = the fp32 normed
row (not rounded to x's dtype), scale = max(amax |y|, 1e-12) / 448, q = e4m3(y / scale), so
y ~= q * scale; scale has x's leading shape ([...]); a NaN in a row makes its scale and all of
its q NaN. The residual is still written in x's dtype. The results are new tensors (out must
be None). This is the operand row-wise torch._scaled_mm takes (fusedist.nn.quant.fp8_linear's
x_scale=), so an FP8 GEMM after the norm needs no quantization pass of its own.

x, residual: [..., hidden] of float32 / float16 / bfloat16, hidden a multiple of 8 (16-byte
vectors) up to MAX_HIDDEN[dtype]; weight: [hidden] of x's dtype. CPU tensors take the
plain-torch reference (fp32 math, the same roundings); CUDA tensors the kernel of
csrc/ops/layers/add_rmsnorm.cu (one block per row, the row in registers, no host sync: CUDA
graphs capture it). Also torch.ops.fusedist.add_rmsnorm (torch.compile(fullgraph=True)).
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import _align, _dtypes, _ext
from ._plan import KernelPlan, kernel_plan
from ._rows import (DTYPES, check_out_dtype, check_rows_input, fp8_rows, overlaps, packed_rows,
                    rows_view)

# The widest row the kernel holds in registers: 4096 16-byte vectors (csrc/include/fusedist/
# layers/api.h kAddRmsNormMaxVectors, exported as fusedist._C.ADD_RMSNORM_MAX_VECTORS).
MAX_VECTORS = 4096
MAX_HIDDEN = {dt: MAX_VECTORS * 16 // dt.itemsize for dt in DTYPES}


def _fail(msg: str):
    raise ValueError(f"fusedist.add_rmsnorm: {msg}")


def rmsnorm_reference(h: torch.Tensor, weight: torch.Tensor, eps: float,
                      out_dtype: Optional[torch.dtype] = None):
    """Plain-torch epilogue on the already-added residual h (fp32 math)."""
    hf = h.float()
    y = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    if out_dtype is not None and out_dtype == _dtypes.FP8:
        return fp8_rows(y)   # (e4m3, scale [...]): see the module docstring
    return y.to(h.dtype), None


def add_rmsnorm_reference(x: torch.Tensor, residual: Optional[torch.Tensor],
                          weight: torch.Tensor, eps: float,
                          out_dtype: Optional[torch.dtype] = None) -> tuple:
    """Plain torch, new tensors: (normed, h) with h = x + residual in x's dtype (x itself
    without a residual) and normed = rmsnorm(h) in fp32, rounded once; for out_dtype FP8
    (q, h, scale) with q, scale from the fp32 normed rows (module docstring)."""
    h = x if residual is None else x + residual
    normed, scale = rmsnorm_reference(h, weight, eps, out_dtype)
    return (normed, h) if scale is None else (normed, h, scale)


def _validate(x, residual, weight, eps, out, out_dtype=None) -> bool:
    """Checks the arguments; True when the output is FP8."""
    check_rows_input("add_rmsnorm", "x", x, "[..., hidden]")
    fp8 = check_out_dtype("add_rmsnorm", "x", x, out_dtype)
    hidden = x.shape[-1]
    if hidden <= 0 or hidden % 8:
        _fail(f"hidden (x's last dimension) must be a positive multiple of 8 (16-byte vectors), "
              f"got {hidden}; pad the feature dimension")
    if hidden > MAX_HIDDEN[x.dtype]:
        _fail(f"hidden {hidden} exceeds {MAX_HIDDEN[x.dtype]}, the widest {x.dtype} row the "
              "kernel holds in registers; use torch (F.rms_norm) for wider rows")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype or
                                 residual.device != x.device):
        _fail(f"residual is {tuple(residual.shape)} {residual.dtype} on {residual.device}; it "
              f"must match x ({tuple(x.shape)} {x.dtype} on {x.device})")
    if weight.shape != (hidden,) or weight.dtype != x.dtype or weight.device != x.device:
        _fail(f"weight must be [{hidden}] {x.dtype} on {x.device}, got {tuple(weight.shape)} "
              f"{weight.dtype} on {weight.device}")
    if not isinstance(eps, float) or not eps > 0 or eps == float("inf"):
        _fail(f"eps must be a positive finite float, got {eps!r}")
    if fp8 and out is not None:
        _fail("out_dtype=torch.float8_e4m3fn returns new tensors (the e4m3 rows and their "
              "scales); pass out=None")
    if out is not None and (out.shape != x.shape or out.dtype != x.dtype or
                            out.device != x.device):
        _fail(f"out must be {tuple(x.shape)} {x.dtype} on {x.device}, got {tuple(out.shape)} "
              f"{out.dtype} on {out.device}")
    return fp8


def add_rmsnorm(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
                eps: float = 1e-6, *, out: Optional[torch.Tensor] = None,
                out_dtype: Optional[torch.dtype] = None) -> tuple:
    """(normed, new residual): residual updated in place to x + residual (and returned), or
    (normed, x) when residual is None; with out_dtype=torch.float8_e4m3fn (q, new residual,
    scale). See the module docstring."""
    if _validate(x, residual, weight, eps, out, out_dtype):
        if torch.compiler.is_compiling():
            q, scale = torch.ops.fusedist.add_rmsnorm_fp8(x, residual, weight, eps)
        else:
            q, scale = _add_rmsnorm_fp8(x, residual, weight, eps)
        return q, (x if residual is None else residual), scale
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if torch.compiler.is_compiling():
        torch.ops.fusedist.add_rmsnorm(out, x, residual, weight, eps)
    else:
        _add_rmsnorm_impl(out, x, residual, weight, eps)
    return out, (x if residual is None else residual)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *,
            out: Optional[torch.Tensor] = None, out_dtype: Optional[torch.dtype] = None):
    """rmsnorm(x) * weight (fp32 math, one rounding): add_rmsnorm without a residual; with
    out_dtype=torch.float8_e4m3fn (q, scale)."""
    r = add_rmsnorm(x, None, weight, eps, out=out, out_dtype=out_dtype)
    return r[0] if len(r) == 2 else (r[0], r[2])


def _add_rmsnorm_fp8(x, residual, weight, eps) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale): new e4m3 [..., hidden] and float32 [...] tensors; residual in place."""
    q = torch.empty(x.shape, dtype=_dtypes.FP8, device=x.device)
    scale = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    _add_rmsnorm_impl(q, x, residual, weight, eps, scale=scale)
    return q, scale


def _check_aliases(out, x, residual) -> None:
    same_as_x = out.data_ptr() == x.data_ptr() and out.stride() == x.stride()
    if residual is not None and overlaps(out, residual):
        _fail("out overlaps residual (both are written); pass another out")
    if overlaps(out, x) and (residual is None or not same_as_x):
        _fail("out overlaps x: out may be x itself only when a residual is given (without one, "
              "x is the returned residual stream); pass another out")
    if residual is not None and overlaps(residual, x) and not (
            residual.data_ptr() == x.data_ptr() and residual.stride() == x.stride()):
        _fail("residual partially overlaps x; pass separate tensors")


# ---- the op's shape: available / why_not / plan / run / reference ----------------------------
reference = add_rmsnorm_reference


def available(device) -> bool:
    """The add_rmsnorm kernel runs on `device`."""
    return _ext.kernel_runs("add_rmsnorm", device)


def why_not(x: torch.Tensor) -> str:
    """Why the kernel does not take a (valid) call on x; "" when it does."""
    return _ext.why_not("add_rmsnorm", x.device)


def plan(x: torch.Tensor) -> KernelPlan:
    return kernel_plan("add_rmsnorm", why_not(x))


def run(p: KernelPlan, out, x, residual, weight, eps, vectors_per_thread: int = 0,
        scale: Optional[torch.Tensor] = None) -> None:
    """Execute p on validated arguments: out (x's dtype), or with scale (float32 [...]) out
    e4m3, a fresh contiguous tensor; residual updated in place."""
    if x.numel() == 0:
        return
    fp8 = scale is not None
    _check_aliases(out, x, residual)
    if not p.kernel:
        p.warn_if_reference(x.device)
        r = add_rmsnorm_reference(x, residual, weight, eps, out.dtype if fp8 else None)
        if residual is not None:
            residual.copy_(r[1])
        out.copy_(r[0])
        if fp8:
            scale.copy_(r[2])
        return
    hidden = x.shape[-1]
    xs = rows_view(x)
    if xs is None:   # an input: an aligned contiguous copy
        xs = packed_rows(x)
    rs = None if residual is None else rows_view(residual)
    r_copy = residual is not None and rs is None
    if r_copy:       # written in place: work on a copy, then copy back
        rs = packed_rows(residual)
    # An FP8 out is fresh and contiguous: rows of hidden bytes (whole vectors of x's elements,
    # which is what the kernel's e4m3 stores need; not always whole 16-byte vectors).
    o2 = out.view(-1, hidden) if fp8 else rows_view(out)
    o_copy = o2 is None
    if o_copy:
        o2 = torch.empty((xs.shape[0], hidden), dtype=x.dtype, device=x.device)
    w = weight if weight.is_contiguous() and _align.is_aligned(weight) else \
        packed_rows(weight)[0]
    C = _ext.load()
    a = C.AddRmsNormArgs()
    a.x, a.weight, a.out = xs.data_ptr(), w.data_ptr(), o2.data_ptr()
    a.x_stride, a.out_stride = xs.stride(0), o2.stride(0)
    if rs is not None:
        a.residual, a.residual_stride = rs.data_ptr(), rs.stride(0)
    a.tokens, a.hidden, a.eps = xs.shape[0], hidden, eps
    a.dtype = _dtypes.code(x.dtype)
    a.vectors_per_thread = vectors_per_thread
    if fp8:
        a.fp8_out, a.scale = True, scale.data_ptr()
    C.add_rmsnorm(a, _ext.stream(x.device))
    if r_copy:
        residual.copy_(rs.view(residual.shape))
    if o_copy:
        out.copy_(o2.view(out.shape))


def _add_rmsnorm_impl(out, x, residual, weight, eps, vectors_per_thread: int = 0,
                      scale: Optional[torch.Tensor] = None) -> None:
    run(plan(x), out, x, residual, weight, eps, vectors_per_thread, scale)


@torch.library.custom_op("fusedist::add_rmsnorm", mutates_args=("out", "residual"))
def _add_rmsnorm_op(out: torch.Tensor, x: torch.Tensor, residual: Optional[torch.Tensor],
                    weight: torch.Tensor, eps: float) -> None:
    _add_rmsnorm_impl(out, x, residual, weight, eps)


@_add_rmsnorm_op.register_fake
def _(out, x, residual, weight, eps):
    return None


@torch.library.custom_op("fusedist::add_rmsnorm_fp8", mutates_args=("residual",))
def _add_rmsnorm_fp8_op(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _add_rmsnorm_fp8(x, residual, weight, eps)


@_add_rmsnorm_fp8_op.register_fake
def _(x, residual, weight, eps):
    return (torch.empty(x.shape, dtype=_dtypes.FP8, device=x.device),
            torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device))
