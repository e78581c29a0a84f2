"""silu_mul: the SwiGLU activation on a fused gate|up GEMM output, one single-GPU kernel.

    y = fusedist.silu_mul(gate_up)             # gate_up [..., 2 I] -> y [..., I]
    fusedist.silu_mul(gate_up, out=y)

y = silu(gate_up[..., :I]) * gate_up[..., I:] with silu(g) = g / (1 + exp(-g)), in fp32,
rounded once to gate_up's dtype (the torch composite F.silu(g) * u rounds silu(g) first; the
two agree to about one ulp). float32 / float16 / bfloat16, I a multiple of 8 (16-byte
vectors). CPU tensors take the plain-torch reference; CUDA tensors the kernel of
csrc/ops/layers/silu_mul.cu (no host sync: CUDA graphs capture it). Also
torch.ops.fusedist.silu_mul (torch.compile(fullgraph=True)).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .. import _dtypes, _ext
from ._rows import check_rows_input, overlaps, packed_rows, rows_view


def _fail(msg: str):
    raise ValueError(f"fusedist.silu_mul: {msg}")


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """Plain torch: fp32 silu(g) * u, rounded once to gate_up's dtype."""
    inter = gate_up.shape[-1] // 2
    g, u = gate_up[..., :inter].float(), gate_up[..., inter:].float()
    return (F.silu(g) * u).to(gate_up.dtype)


def _validate(gate_up, out) -> None:
    check_rows_input("silu_mul", "gate_up", gate_up, "[..., 2 * intermediate]")
    n = gate_up.shape[-1]
    if n <= 0 or n % 16:
        _fail(f"gate_up's last dimension must be 2 * intermediate with intermediate a positive "
              f"multiple of 8 (16-byte vectors), got {n}")
    want = (*gate_up.shape[:-1], n // 2)
    if out is not None and (tuple(out.shape) != want or out.dtype != gate_up.dtype or
                            out.device != gate_up.device):
        _fail(f"out must be {want} {gate_up.dtype} on {gate_up.device}, got "
              f"{tuple(out.shape)} {out.dtype} on {out.device}")


def silu_mul(gate_up: torch.Tensor, *, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """silu(gate_up[..., :I]) * gate_up[..., I:] (see the module docstring)."""
    _validate(gate_up, out)
    if out is None:
        out = torch.empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2), dtype=gate_up.dtype,
                          device=gate_up.device)
    if torch.compiler.is_compiling():
        torch.ops.fusedist.silu_mul(out, gate_up)
    else:
        _silu_mul_impl(out, gate_up)
    return out


def _kernel_ok(t: torch.Tensor) -> bool:
    return t.device.type == "cuda" and _ext.available() and hasattr(_ext.load(), "silu_mul")


def _silu_mul_impl(out: torch.Tensor, gate_up: torch.Tensor) -> None:
    if out.numel() == 0:
        return
    if overlaps(out, gate_up):
        _fail("out overlaps gate_up; pass a separate out")
    if not _kernel_ok(gate_up):
        if gate_up.device.type == "cuda":
            _ext.warn_reference("silu_mul", "fusedist._C without the silu_mul kernel")
        out.copy_(silu_mul_reference(gate_up))
        return
    n = gate_up.shape[-1]
    g2 = rows_view(gate_up)
    if g2 is None:   # an input: a fresh contiguous (aligned) copy
        g2 = packed_rows(gate_up)
    o2 = rows_view(out)
    o_copy = o2 is None
    if o_copy:
        o2 = torch.empty((g2.shape[0], n // 2), dtype=out.dtype, device=out.device)
    C = _ext.load()
    a = C.SiluMulArgs()
    a.gate_up, a.out = g2.data_ptr(), o2.data_ptr()
    a.tokens, a.inter = g2.shape[0], n // 2
    a.in_stride, a.out_stride = g2.stride(0), o2.stride(0)
    a.dtype = _dtypes.code(gate_up.dtype)
    C.silu_mul(a, torch.cuda.current_stream(gate_up.device).cuda_stream)
    if o_copy:
        out.copy_(o2.view(out.shape))


@torch.library.custom_op("fusedist::silu_mul", mutates_args=("out",))
def _silu_mul_op(out: torch.Tensor, gate_up: torch.Tensor) -> None:
    _silu_mul_impl(out, gate_up)


@_silu_mul_op.register_fake
def _(out, gate_up):
    return None
