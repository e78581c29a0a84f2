"""fp8_gemm: the W8A8 GEMM of prefill sizes, per-token activation scales x per-channel weight
scales, fp32 accumulation with promotion.

    xq, sx = fusedist.nn.quant.quantize_rows(x)     # e4m3 [M, K], float32 [M, 1]
    y = fp8_gemm(xq, sx, wq, sw)                    # wq e4m3 [N, K] (an nn.Linear weight), sw [N]
    y = fp8_gemm(xq, sx, wq, sw, bias=b, out=y)
    xq, sx = fusedist.nn.quant.quantize_groups(x)   # e4m3 [M, K], float32 [M, K / 128]
    y = fp8_gemm(xq, sx, wq, sw, block=True)        # sw [ceil(N / 128), ceil(K / 128)]

y[M, N] = bf16(sx[m] * sw[n] * sum_k xq[m, k] wq[n, k] + bias[n]): the dequantized product,
rounded once. block=True is the 128 x 128 block-scaled form (Hugging Face `quant_method: fp8`
weights): sx float32 [M, ceil(K / 128)] scales each token's 128-k groups, sw float32
[ceil(N / 128), ceil(K / 128)] each 128 x 128 weight block, and each 128-k block's sum is
multiplied by its two scales and added into fp32. Error against float64, per element: 2^-8 |ref| (the bf16 rounding) + (2^-13 +
(K + 2) 2^-24) sum_k |x_k w_k|; the 2^-13 term is Hopper's FP8 wgmma, which keeps ~14
significant bits inside each 512-k interval before the sum is promoted to fp32 (the same
error as torch._scaled_mm's on H200; tests/ops/test_fp8_gemm.py).

On CUDA with a Hopper GPU it runs the CUTLASS kernel of
csrc/include/fusedist/gemm/fp8_gemm_sm90.cuh (TMA, FP8 wgmma whose partial sums are added into
fp32 every 4 k-blocks of 128, the scales and the bias in the epilogue; no host sync, CUDA graphs
capture it). Other devices, and shapes the kernel cannot take (K not a multiple of 16, N not a
multiple of 8, strides that are not 16-byte rows), run fp8_gemm_reference: plain torch in fp32.
The kernel's persistent CTAs follow CUTLASS's stream-K scheduler: where the output tiles do
not fill the SMs (decode-sized M, narrow N) the k-blocks of a tile are split over several
CTAs and their partial tiles added in a fixed order (results are the same run to run) through
a workspace per device and stream: calls on one stream run in order; do not run fp8_gemm
calls on two streams at once that share one. torch._scaled_mm with row-wise scales computes
the same product; fusedist.nn.quant's dispatch takes _scaled_mm, measured faster at the
projections it serves (docs/design/fp8.md), and fp8_gemm only when asked (path="fp8_gemm").
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import _dtypes, _ext
from ._plan import KernelPlan, kernel_plan
from ._rows import overlaps


def _fail(msg: str, exc=ValueError):
    raise exc(f"fusedist.fp8_gemm: {msg}")


def fp8_gemm_reference(xq: torch.Tensor, sx: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor,
                       bias: Optional[torch.Tensor] = None,
                       out_dtype: torch.dtype = torch.bfloat16, block: bool = False
                       ) -> torch.Tensor:
    """Plain torch: the dequantized operands in fp32 (exact: e4m3 x an fp32 scale), an fp32
    matmul, the bias, one rounding to out_dtype."""
    if block:
        (m, k), n = xq.shape, wq.shape[0]
        x = xq.float() * _dtypes.expand_block_scales(sx, m, k, 1)
        w = wq.float() * _dtypes.expand_block_scales(sw, n, k)
    else:
        x = xq.float() * sx.float().reshape(-1, 1)
        w = wq.float() * sw.float().reshape(-1, 1)
    y = x @ w.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def _validate(xq, sx, wq, sw, bias, out, block=False) -> None:
    fp8 = _dtypes.FP8
    if fp8 is None:
        _fail("this torch has no float8_e4m3fn", TypeError)
    for name, t in (("xq", xq), ("wq", wq)):
        if t.dim() != 2 or t.dtype != fp8:
            _fail(f"{name} must be a 2-d float8_e4m3fn tensor, got {tuple(t.shape)} {t.dtype}",
                  TypeError if t.dtype != fp8 else ValueError)
    M, K = xq.shape
    N = wq.shape[0]
    if wq.shape[1] != K:
        _fail(f"xq is [M={M}, K={K}] but wq is {tuple(wq.shape)}; wq must be [N, K={K}] (an "
              "nn.Linear weight, not its transpose)")
    kb = -(-K // 128)
    if block:
        for name, t, want in (("sx", sx, (M, kb)), ("sw", sw, (-(-N // 128), kb))):
            if t.dtype != torch.float32 or tuple(t.shape) != want:
                _fail(f"{name} must be float32 {list(want)} (block=True: per token x 128 k, "
                      f"per 128 x 128 weight block), got {tuple(t.shape)} {t.dtype}")
    for name, t, n in (() if block else (("sx", sx, M), ("sw", sw, N))):
        if t.dtype != torch.float32 or t.numel() != n or t.dim() > 2 or \
                (t.dim() == 2 and t.shape[1] != 1):
            _fail(f"{name} must be float32 [{n}] (or [{n}, 1]), got {tuple(t.shape)} {t.dtype}")
    if bias is not None and (tuple(bias.shape) != (N,) or bias.dtype != torch.bfloat16):
        _fail(f"bias must be bfloat16 [{N}], got {tuple(bias.shape)} {bias.dtype}")
    if out is not None and (tuple(out.shape) != (M, N) or out.dtype != torch.bfloat16):
        _fail(f"out must be bfloat16 [{M}, {N}], got {tuple(out.shape)} {out.dtype}")
    dev = xq.device
    for name, t in (("sx", sx), ("wq", wq), ("sw", sw), ("bias", bias), ("out", out)):
        if t is not None and t.device != dev:
            _fail(f"{name} is on {t.device}; every tensor must be on xq's device {dev}")


def _args(xq, sx, wq, sw, bias, out, block=False):
    C = _ext.load()
    a = C.Fp8GemmArgs()
    M, K = xq.shape
    a.m, a.n, a.k = M, wq.shape[0], K
    a.ldx, a.ldw = xq.stride(0), wq.stride(0)
    a.ldo = out.stride(0) if out is not None else wq.shape[0]
    a.xq, a.wq = xq.data_ptr(), wq.data_ptr()
    a.sx = sx.data_ptr() if sx is not None else 0
    a.sw = sw.data_ptr() if sw is not None else 0
    a.bias = bias.data_ptr() if bias is not None else 0
    a.out = out.data_ptr() if out is not None else 0
    a.out_dtype = _dtypes.code(torch.bfloat16)
    a.block = int(block)
    return a


def _host_why_not(xq, wq, out) -> str:
    """The device, build and layout reasons the kernel cannot run ("" when none)."""
    why = _ext.why_not("fp8_gemm", xq.device)
    if why:
        return why
    for name, t in (("xq", xq), ("wq", wq), ("out", out)):
        if t is not None and t.stride(1) != 1:
            return f"{name}'s rows are not contiguous (stride {tuple(t.stride())})"
    return ""


def kernel_available(device) -> bool:
    """Whether the CUTLASS kernel runs on this CUDA device (the capability table)."""
    return _ext.kernel_runs("fp8_gemm", device)


def kernel_why_not(xq: torch.Tensor, wq: torch.Tensor, out: Optional[torch.Tensor] = None,
                   sx: Optional[torch.Tensor] = None, sw: Optional[torch.Tensor] = None,
                   bias: Optional[torch.Tensor] = None, block: bool = False) -> str:
    """Why the CUTLASS kernel cannot take this (valid) call; "" when it can."""
    return _host_why_not(xq, wq, out) or \
        _ext.load().fp8_gemm_why_not(_args(xq, sx, wq, sw, bias, out, block))


# ---- the op's shape: available / why_not / plan / run / reference ----------------------------
available = kernel_available
why_not = kernel_why_not
reference = fp8_gemm_reference


def plan(xq, sx, wq, sw, bias=None, out=None, block: bool = False) -> KernelPlan:
    """"kernel" (the CUTLASS GEMM) or "reference", on prepared arguments (run's)."""
    return kernel_plan("fp8_gemm", kernel_why_not(xq, wq, out, sx, sw, bias, block))


def fp8_gemm(xq: torch.Tensor, sx: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor, *,
             bias: Optional[torch.Tensor] = None,
             out: Optional[torch.Tensor] = None, block: bool = False) -> torch.Tensor:
    """y [M, N] bf16 = sx[m] sw[n] (xq @ wq.t()) + bias, or with block=True the 128 x 128
    block-scaled product (the module docstring). Also torch.ops.fusedist.fp8_gemm
    (torch.compile(fullgraph=True))."""
    _validate(xq, sx, wq, sw, bias, out, block)
    if out is None:
        out = torch.empty(xq.shape[0], wq.shape[0], dtype=torch.bfloat16, device=xq.device)
    if torch.compiler.is_compiling():
        torch.ops.fusedist.fp8_gemm(out, xq, sx, wq, sw, bias, block)
    else:
        _fp8_gemm_impl(out, xq, sx, wq, sw, bias, block)
    return out


def _fp8_gemm_impl(out, xq, sx, wq, sw, bias, block=False) -> None:
    if xq.shape[0] == 0:
        return
    for name, t in (("xq", xq), ("sx", sx), ("wq", wq), ("sw", sw), ("bias", bias)):
        if t is not None and overlaps(out, t):
            _fail(f"out overlaps {name}; pass a separate out")
    if block:   # the kernel reads both scale tables as contiguous rows
        sx, sw = sx.contiguous(), sw.contiguous()
    else:
        sx, sw = sx.reshape(-1).contiguous(), sw.reshape(-1).contiguous()
    bias = None if bias is None else bias.contiguous()
    run(plan(xq, sx, wq, sw, bias, out, block), out, xq, sx, wq, sw, bias, block)


def run(p: KernelPlan, out, xq, sx, wq, sw, bias=None, block: bool = False) -> None:
    """Execute p on prepared arguments (scales contiguous as the kernel reads them)."""
    if not p.kernel:
        p.warn_if_reference(xq.device)
        out.copy_(fp8_gemm_reference(xq, sx, wq, sw, bias, block=block))
        return
    args = _args(xq, sx, wq, sw, bias, out, block)
    C = _ext.load()
    stream = torch.cuda.current_stream(xq.device)
    need = C.fp8_gemm_workspace_size(args)
    if need:
        ws = _workspace(xq.device, stream, need)
        args.workspace, args.workspace_bytes = ws.data_ptr(), ws.numel()
    C.fp8_gemm(args, stream.cuda_stream)


# Stream-K workspaces, one per (device, stream), grown by replacement; a replaced buffer stays
# alive (a captured CUDA graph may still use it).
_WORKSPACES: dict = {}
_RETIRED: list = []


def _workspace(device: torch.device, stream: torch.cuda.Stream, nbytes: int) -> torch.Tensor:
    key = (device.index, stream.cuda_stream)
    ws = _WORKSPACES.get(key)
    if ws is None or ws.numel() < nbytes:
        if ws is not None:
            _RETIRED.append(ws)
        size = max(nbytes, 2 * ws.numel() if ws is not None else 0)
        ws = _WORKSPACES[key] = torch.empty(size, dtype=torch.uint8, device=device)
    return ws


# ---- torch.compile: torch.library registration --------------------------------------------
@torch.library.custom_op("fusedist::fp8_gemm", mutates_args=("out",))
def _fp8_gemm_op(out: torch.Tensor, xq: torch.Tensor, sx: torch.Tensor, wq: torch.Tensor,
                 sw: torch.Tensor, bias: Optional[torch.Tensor], block: bool = False) -> None:
    _fp8_gemm_impl(out, xq, sx, wq, sw, bias, block)


@_fp8_gemm_op.register_fake
def _(out, xq, sx, wq, sw, bias, block=False):
    return None
