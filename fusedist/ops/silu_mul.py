"""silu_mul: the SwiGLU activation on a fused gate|up GEMM output, one single-GPU kernel.

    y = fusedist.silu_mul(gate_up)             # gate_up [..., 2 I] -> y [..., I]
    fusedist.silu_mul(gate_up, out=y)
    q, scale = fusedist.silu_mul(gate_up, out_dtype=torch.float8_e4m3fn)

y = silu(gate_up[..., :I]) * gate_up[..., I:] with silu(g) = g / (1 + exp(-g)), in fp32,
rounded once to gate_up's dtype (the torch composite F.silu(g) * u rounds silu(g) first; the
two agree to about one ulp). float32 / float16 / bfloat16, I a multiple of 8 (16-byte
vectors). CPU tensors take the plain-torch reference; CUDA tensors the kernel of
csrc/ops/layers/silu_mul.cu (no host sync: CUDA graphs capture it). Also
torch.ops.fusedist.silu_mul (torch.compile(fullgraph=True)).

out_dtype=torch.float8_e4m3fn: y as e4m3 with one float32 scale per token (row), the
convention of fusedist.add_rmsnorm's FP8 output: y = the fp32 values (not rounded to
gate_up's dtype), scale = max(amax |y|, 1e-12) / 448 ([...], gate_up's leading shape),
q = e4m3(y / scale); a NaN in a row makes its scale and all of its q NaN. New tensors (out
must be None); on CUDA one block per row. The down projection's row-wise torch._scaled_mm
takes (q, scale) as they are (fusedist.nn.quant.fp8_linear's x_scale=).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .. import _dtypes, _ext
from ._plan import KernelPlan, kernel_plan
from ._rows import check_out_dtype, check_rows_input, fp8_rows, overlaps, packed_rows, rows_view


def _fail(msg: str):
    raise ValueError(f"fusedist.silu_mul: {msg}")


def silu_mul_reference(gate_up: torch.Tensor, out_dtype: Optional[torch.dtype] = None):
    """Plain torch: fp32 silu(g) * u, rounded once to gate_up's dtype; for out_dtype FP8
    (q, scale) of the fp32 values (module docstring)."""
    inter = gate_up.shape[-1] // 2
    g, u = gate_up[..., :inter].float(), gate_up[..., inter:].float()
    y = F.silu(g) * u
    if out_dtype is not None and out_dtype == _dtypes.FP8:
        return fp8_rows(y)
    return y.to(gate_up.dtype)


def _validate(gate_up, out, out_dtype=None) -> bool:
    """Checks the arguments; True when the output is FP8."""
    check_rows_input("silu_mul", "gate_up", gate_up, "[..., 2 * intermediate]")
    fp8 = check_out_dtype("silu_mul", "gate_up", gate_up, out_dtype)
    n = gate_up.shape[-1]
    if n <= 0 or n % 16:
        _fail(f"gate_up's last dimension must be 2 * intermediate with intermediate a positive "
              f"multiple of 8 (16-byte vectors), got {n}")
    want = (*gate_up.shape[:-1], n // 2)
    if fp8 and out is not None:
        _fail("out_dtype=torch.float8_e4m3fn returns new tensors (the e4m3 rows and their "
              "scales); pass out=None")
    if out is not None and (tuple(out.shape) != want or out.dtype != gate_up.dtype or
                            out.device != gate_up.device):
        _fail(f"out must be {want} {gate_up.dtype} on {gate_up.device}, got "
              f"{tuple(out.shape)} {out.dtype} on {out.device}")
    return fp8


def silu_mul(gate_up: torch.Tensor, *, out: Optional[torch.Tensor] = None,
             out_dtype: Optional[torch.dtype] = None):
    """silu(gate_up[..., :I]) * gate_up[..., I:] (see the module docstring); with
    out_dtype=torch.float8_e4m3fn (q, scale)."""
    if _validate(gate_up, out, out_dtype):
        if torch.compiler.is_compiling():
            return torch.ops.fusedist.silu_mul_fp8(gate_up)
        return _silu_mul_fp8(gate_up)
    if out is None:
        out = torch.empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2), dtype=gate_up.dtype,
                          device=gate_up.device)
    if torch.compiler.is_compiling():
        torch.ops.fusedist.silu_mul(out, gate_up)
    else:
        _silu_mul_impl(out, gate_up)
    return out


# ---- the op's shape: available / why_not / plan / run / reference ----------------------------
reference = silu_mul_reference


def available(device) -> bool:
    """The silu_mul kernel runs on `device`."""
    return _ext.kernel_runs("silu_mul", device)


def why_not(gate_up: torch.Tensor) -> str:
    """Why the kernel does not take a (valid) call on gate_up; "" when it does."""
    return _ext.why_not("silu_mul", gate_up.device)


def plan(gate_up: torch.Tensor) -> KernelPlan:
    return kernel_plan("silu_mul", why_not(gate_up))


def _silu_mul_fp8(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale): new e4m3 [..., I] and float32 [...] tensors."""
    q = torch.empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2), dtype=_dtypes.FP8,
                    device=gate_up.device)
    scale = torch.empty(gate_up.shape[:-1], dtype=torch.float32, device=gate_up.device)
    _silu_mul_impl(q, gate_up, scale)
    return q, scale


def _silu_mul_impl(out: torch.Tensor, gate_up: torch.Tensor,
                   scale: Optional[torch.Tensor] = None) -> None:
    run(plan(gate_up), out, gate_up, scale)


def run(p: KernelPlan, out: torch.Tensor, gate_up: torch.Tensor,
        scale: Optional[torch.Tensor] = None) -> None:
    """Execute p on validated arguments: out (gate_up's dtype), or with scale (float32 [...])
    out e4m3, a fresh contiguous tensor."""
    if out.numel() == 0:
        return
    fp8 = scale is not None
    if overlaps(out, gate_up):
        _fail("out overlaps gate_up; pass a separate out")
    if not p.kernel:
        p.warn_if_reference(gate_up.device)
        if fp8:
            q, s = silu_mul_reference(gate_up, out.dtype)
            out.copy_(q)
            scale.copy_(s)
        else:
            out.copy_(silu_mul_reference(gate_up))
        return
    n = gate_up.shape[-1]
    g2 = rows_view(gate_up)
    if g2 is None:   # an input: a fresh contiguous (aligned) copy
        g2 = packed_rows(gate_up)
    # An FP8 out is fresh and contiguous: rows of I bytes (whole vectors of gate_up's
    # elements, which is what the kernel's e4m3 stores need).
    o2 = out.view(-1, n // 2) if fp8 else rows_view(out)
    o_copy = o2 is None
    if o_copy:
        o2 = torch.empty((g2.shape[0], n // 2), dtype=out.dtype, device=out.device)
    C = _ext.load()
    a = C.SiluMulArgs()
    a.gate_up, a.out = g2.data_ptr(), o2.data_ptr()
    a.tokens, a.inter = g2.shape[0], n // 2
    a.in_stride, a.out_stride = g2.stride(0), o2.stride(0)
    a.dtype = _dtypes.code(gate_up.dtype)
    if fp8:
        a.fp8_out, a.scale = True, scale.data_ptr()
    C.silu_mul(a, _ext.stream(gate_up.device))
    if o_copy:
        out.copy_(o2.view(out.shape))


@torch.library.custom_op("fusedist::silu_mul", mutates_args=("out",))
def _silu_mul_op(out: torch.Tensor, gate_up: torch.Tensor) -> None:
    _silu_mul_impl(out, gate_up)


@_silu_mul_op.register_fake
def _(out, gate_up):
    return None


@torch.library.custom_op("fusedist::silu_mul_fp8", mutates_args=())
def _silu_mul_fp8_op(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _silu_mul_fp8(gate_up)


@_silu_mul_fp8_op.register_fake
def _(gate_up):
    return (torch.empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2), dtype=_dtypes.FP8,
                        device=gate_up.device),
            torch.empty(gate_up.shape[:-1], dtype=torch.float32, device=gate_up.device))
