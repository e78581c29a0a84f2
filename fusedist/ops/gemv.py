"""gemv: the decode GEMM at GEMV scale, one kernel that streams the weight at the memory's rate.

    y = gemv(x, w)                          # x [M, K] bf16, w [N, K] bf16 (an nn.Linear weight)
    y = gemv(x, w8, scale=s)                # w8 [N, K] torch.float8_e4m3fn
    gemv(x, w, bias=b, out=y)
    y = gemv(xq, w8, scale=s, x_scale=sx)   # W8A8: xq [M, K] e4m3, sx float32 [M] per row

y[M, N] = x @ dequantize(w, scale).t() (+ bias), accumulated in fp32 and rounded once to
bf16. w is an nn.Linear weight: [N, K] row-major (K contiguous), bf16 or float8_e4m3fn.
FP8 scales are float32 and multiply the weights: per-tensor (shape [] or [1]), per output
channel ([N] or [N, 1]) or per 128 x 128 block ([ceil(N / 128), ceil(K / 128)], the
`weight_scale_inv` of HF `quant_method: fp8` / DeepSeek checkpoints); scale=None reads the
e4m3 values as they are. bf16 weights take no scale.

CUDA tensors with 1 <= M <= 16 on a Hopper GPU run the kernel of
csrc/include/fusedist/gemm/gemv.cuh (docs/design/gemv.md): every resident CTA streams an equal
share of w, partial sums of split strips are added in a fixed order by the last CTA to finish
(results are bitwise reproducible), no host sync (CUDA graphs capture it). Other shapes (M > 16)
and CPU tensors take gemv_reference: plain torch, dequantized in fp32, fp32 matmul, rounded
once (on CUDA, bf16 weights go through torch.matmul, which accumulates in fp32 and rounds
once too). K must be a multiple of 8 (bf16 w) or 16 (fp8 w): 16-byte rows.

W8A8 (x_scale given): x is e4m3 quantized per row (fusedist.ops.quantize_rows, or a layer
op's FP8 output) with x_scale float32 [M] (or [M, 1]) multiplying row m, w e4m3 with a
per-tensor or per-channel scale (or none); y = x_scale[m] * scale[n] * (xq @ wq^T) (+ bias)
in bf16. The kernel takes 1 <= M <= 64 (MAX_M_FP8_X): e4m3 x and weights go into the FP8
tensor-core MMA as they are, each 128 k's partial sums added into fp32 registers.

Contract of the kernel: w is not written by the kernel launched just before this call on the
stream (weights are read before the wait on the previous kernel, which overlaps its tail);
the model's weights never are. gemv calls that split strips share a small workspace per
device and stream (fusedist.ops.gemv.workspace): calls on one stream run in order; do not run
two such calls on different streams at the same time with the same stream object's
workspace. Also torch.ops.fusedist.gemv (torch.compile(fullgraph=True)).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch

from .. import _align, _dtypes, _ext
from ._rows import overlaps

MAX_M = 16          # the kernel's rows (fusedist._C.GEMV_MAX_M)
MAX_M_FP8_X = 64    # ... with an e4m3 x (fusedist._C.GEMV_MAX_M_FP8_X)
STAGES_AUTO = -1    # launch(stages=): the default weight pipeline (registers)
MAX_STAGES = 6      # the deepest ring (fusedist._C.GEMV_MAX_STAGES)
SCALE_BLOCK = _dtypes.FP8_BLOCK   # block scales cover 128 x 128 weights
SCALE_MODES = ("none", "tensor", "channel", "block")


def _fail(msg: str, exc=ValueError):
    raise exc(f"fusedist.gemv: {msg}")


def _is_fp8(t: torch.Tensor) -> bool:
    return _dtypes.FP8 is not None and t.dtype == _dtypes.FP8


def k_multiple(w_dtype: torch.dtype) -> int:
    """K must be a multiple of this (16-byte weight rows): 8 for bf16, 16 for fp8."""
    return 16 // w_dtype.itemsize


def scale_mode(w: torch.Tensor, scale: Optional[torch.Tensor]) -> str:
    """Which scaling `scale` is for the weight w [N, K] (one of SCALE_MODES), or a ValueError
    naming scale and the accepted shapes."""
    if scale is None:
        return "none"
    n, k = w.shape
    if not _is_fp8(w):
        _fail(f"scale is for float8_e4m3fn weights; w is {w.dtype} (pass scale=None)")
    if not isinstance(scale, torch.Tensor):
        _fail(f"scale must be a float32 tensor, got {type(scale).__name__}", TypeError)
    if scale.dtype != torch.float32:
        _fail(f"scale must be float32, got {scale.dtype}; pass scale.float()")
    if scale.device != w.device:
        _fail(f"scale is on {scale.device}, w on {w.device}; move scale to {w.device}")
    blocks = (-(-n // SCALE_BLOCK), -(-k // SCALE_BLOCK))
    shape = tuple(scale.shape)
    if shape == blocks and scale.dim() == 2:
        return "block"
    if shape in ((), (1,)):
        return "tensor"
    if shape in ((n,), (n, 1)):
        return "channel"
    _fail(f"scale has shape {shape}; for w [{n}, {k}] pass [] or [1] (per tensor), [{n}] or "
          f"[{n}, 1] (per output channel) or {list(blocks)} (per 128 x 128 block)")


def dequantize(w: torch.Tensor, scale: Optional[torch.Tensor]) -> torch.Tensor:
    """w [N, K] as float32 with its scale applied (the values the kernel multiplies by)."""
    wf = w.float()
    mode = scale_mode(w, scale)
    if mode == "tensor":
        return wf * scale.reshape(())
    if mode == "channel":
        return wf * scale.reshape(-1, 1)
    if mode == "block":
        return wf * _dtypes.expand_block_scales(scale, *w.shape)
    return wf


def gemv_reference(x: torch.Tensor, w: torch.Tensor, scale: Optional[torch.Tensor] = None,
                   bias: Optional[torch.Tensor] = None,
                   x_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Plain torch: x @ dequantize(w, scale).t() (+ bias) in fp32, rounded once to x's dtype
    (W8A8: (x * x_scale) @ ..., rounded to bf16)."""
    if x_scale is not None:
        xf = x.float() * x_scale.float().reshape(-1, 1)
        res = xf @ dequantize(w, scale).t()
        if bias is not None:
            res += bias.float()
        return res.to(torch.bfloat16)
    if x.device.type == "cuda" and not _is_fp8(w):
        # cuBLAS accumulates in fp32 and rounds once, as the fp32 path below.
        return torch.nn.functional.linear(x, w, bias)
    res = x.float() @ dequantize(w, scale).t()
    if bias is not None:
        res += bias.float()
    return res.to(x.dtype)


def _validate(x, w, scale, bias, out, x_scale=None) -> str:
    """Every argument check, once (on real or fake tensors); returns the scale mode."""
    if not isinstance(x, torch.Tensor) or not isinstance(w, torch.Tensor):
        _fail("x and w must be torch.Tensors", TypeError)
    if x_scale is not None:
        if x.dim() != 2 or not _is_fp8(x):
            _fail(f"x_scale= goes with an e4m3 x [M, K] (W8A8); x is {tuple(x.shape)} {x.dtype}")
        m = x.shape[0]
        if not isinstance(x_scale, torch.Tensor) or x_scale.dtype != torch.float32 or \
                tuple(x_scale.shape) not in ((m,), (m, 1)) or x_scale.device != x.device:
            got = f"{tuple(x_scale.shape)} {x_scale.dtype} on {x_scale.device}" \
                if isinstance(x_scale, torch.Tensor) else type(x_scale).__name__
            _fail(f"x_scale must be float32 [{m}] (or [{m}, 1]) on {x.device}, got {got}")
        if not _is_fp8(w):
            _fail("an e4m3 x (x_scale=) takes float8_e4m3fn weights with a per-tensor or "
                  "per-channel scale (or none); dequantize x for bf16 or block-scaled weights")
    elif x.dim() != 2 or x.dtype != torch.bfloat16:
        _fail(f"x must be a 2-D [M, K] bfloat16 tensor (or e4m3 with x_scale=), got "
              f"{tuple(x.shape)} {x.dtype}")
    if x.device.type not in ("cuda", "cpu"):
        _fail(f"x is on {x.device}; pass CUDA or CPU tensors", TypeError)
    if w.dim() != 2 or w.shape[1] != x.shape[1]:
        _fail(f"w must be [N, K] with K = x.shape[1] = {x.shape[1]} (an nn.Linear weight), got "
              f"{tuple(w.shape)}")
    if w.dtype != torch.bfloat16 and not _is_fp8(w):
        _fail(f"w must be bfloat16 or float8_e4m3fn, got {w.dtype}")
    if w.device != x.device:
        _fail(f"w is on {w.device}, x on {x.device}; put both on one device")
    if w.shape[0] > 0 and w.shape[1] > 1 and w.stride(1) != 1:
        _fail(f"w must be [N, K] with K contiguous (an nn.Linear weight, not its .t()); got "
              f"strides {tuple(w.stride())}; pass w.contiguous()")
    n, k = w.shape
    per = k_multiple(w.dtype)
    if k % per:
        _fail(f"K = {k} must be a multiple of {per} for {w.dtype} weights (16-byte rows); pad x "
              f"and w along K with zeros")
    mode = scale_mode(w, scale)
    if x_scale is not None and mode == "block":
        _fail("an e4m3 x (x_scale=) takes a per-tensor or per-channel weight scale, not block "
              "scales; dequantize x for block-scaled weights")
    dt = torch.bfloat16
    if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (n,) or
                             bias.dtype != dt or bias.device != x.device):
        got = f"{tuple(bias.shape)} {bias.dtype} on {bias.device}" \
            if isinstance(bias, torch.Tensor) else type(bias).__name__
        _fail(f"bias must be a [{n}] {dt} tensor on {x.device}, got {got}")
    if out is not None and (not isinstance(out, torch.Tensor) or
                            tuple(out.shape) != (x.shape[0], n) or out.dtype != dt or
                            out.device != x.device or not out.is_contiguous()):
        got = f"{tuple(out.shape)} {out.dtype} on {out.device}" \
            if isinstance(out, torch.Tensor) else type(out).__name__
        _fail(f"out must be a contiguous ({x.shape[0]}, {n}) {dt} tensor on {x.device}, "
              f"got {got}")
    return mode


def gemv(x: torch.Tensor, w: torch.Tensor, *, scale: Optional[torch.Tensor] = None,
         bias: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None,
         x_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [M, K] @ w[N, K].t() (* scale) (+ bias) -> [M, N] bf16 (the module docstring);
    x_scale=: x is e4m3 quantized per row (W8A8)."""
    _validate(x, w, scale, bias, out, x_scale)
    if out is None:
        out = torch.empty((x.shape[0], w.shape[0]), dtype=torch.bfloat16, device=x.device)
    if torch.compiler.is_compiling():
        torch.ops.fusedist.gemv(out, x, w, scale, bias, x_scale)
    else:
        _gemv_impl(out, x, w, scale, bias, x_scale)
    return out


# ---- the kernel ---------------------------------------------------------------------------
def kernel_available(device: torch.device) -> bool:
    """The gemv kernel runs on `device` (the capability table: CUDA, a build with it, an
    architecture of the build that runs there)."""
    return _ext.kernel_runs("gemv", device)


available = kernel_available
reference = gemv_reference


def why_not(x: torch.Tensor, w: torch.Tensor, x_scale: Optional[torch.Tensor] = None) -> str:
    """Why the kernel does not take this (valid) call; "" when it does: a device or build
    without it, or more rows than it takes (MAX_M; MAX_M_FP8_X with an e4m3 x)."""
    why = _ext.why_not("gemv", x.device)
    if why:
        return why
    if x_scale is not None:
        why = _ext.why_not("gemv_w8a8", x.device)
        if why:
            return why
    most = MAX_M if x_scale is None else MAX_M_FP8_X
    if x.shape[0] > most:
        return f"{x.shape[0]} rows: the kernel takes at most {most}"
    return ""


@dataclass(frozen=True)
class GemvPlan:
    """path "kernel" or "reference" and why not the kernel; for the kernel, what the launcher
    will do (C.gemv_plan): the grid cap asked for (max_ctas, 0: one wave of resident CTAs) and
    the weight pipeline asked for (stages_asked, STAGES_AUTO: the default), and what they give:
    grid, workspace_floats, counters, strip_rows, ctas_per_sm, stages (0: registers; else the
    shared-memory ring's depth), smem_bytes."""
    path: str
    why: str = ""
    max_ctas: int = 0
    stages_asked: int = STAGES_AUTO
    grid: int = 0
    workspace_floats: int = 0
    counters: int = 0
    strip_rows: int = 0
    ctas_per_sm: int = 0
    stages: int = 0
    smem_bytes: int = 0


def plan(x: torch.Tensor, w: torch.Tensor, scale: Optional[torch.Tensor] = None,
         max_ctas: int = 0, stages: int = STAGES_AUTO,
         x_scale: Optional[torch.Tensor] = None) -> GemvPlan:
    """The plan of a gemv call on these (valid) arguments: the path, and for the kernel its
    launch (a property of the build and the GPU, computed once per shape)."""
    why = why_not(x, w, x_scale)
    if why:
        return GemvPlan("reference", why, max_ctas, stages)
    mode = SCALE_MODES.index(scale_mode(w, scale))
    g, f, c, rows, occ, st, smem = _plan(x.device.index or 0, x.shape[0], w.shape[0],
                                         w.shape[1], _dtypes.code(w.dtype), mode, max_ctas,
                                         stages, _dtypes.code(x.dtype))
    return GemvPlan("kernel", "", max_ctas, stages, g, f, c, rows, occ, st, smem)


def _why_not_kernel(device: torch.device) -> Optional[str]:
    return _ext.why_not("gemv", device) or None


@functools.lru_cache(maxsize=4096)
def _plan(device: int, m: int, n: int, k: int, w_code: int, mode: int, max_ctas: int,
          stages: int = STAGES_AUTO, x_code: int = _dtypes.BFLOAT16):
    """gemv_plan (grid, workspace floats, counters, strip rows, CTAs per SM, ring stages,
    shared memory bytes) of one call shape: a property of the build and the GPU, computed
    once."""
    C = _ext.load()
    a = C.GemvArgs()
    a.m, a.n, a.k = m, n, k
    a.dtype, a.w_dtype, a.x_dtype = _dtypes.BFLOAT16, w_code, x_code
    a.scale_mode, a.max_ctas, a.stages = mode, max_ctas, stages
    with torch.cuda.device(device):
        p = C.gemv_plan(a)
    return (p.grid, p.workspace_floats, p.counters, p.strip_rows, p.ctas_per_sm, p.stages,
            p.smem_bytes)


class _Workspace:
    """Partial sums (float32) and strip counters (int32, zero between calls) of the gemv calls
    on one (device, stream). Grown by replacement; a replaced buffer stays alive (a captured
    CUDA graph may still use it)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.partial = torch.empty(0, dtype=torch.float32, device=device)
        self.counters = torch.zeros(0, dtype=torch.int32, device=device)
        self.retired: list = []

    def get(self, floats: int, counters: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.partial.numel() < floats:
            self.retired.append(self.partial)
            self.partial = torch.empty(max(floats, 2 * self.partial.numel()),
                                       dtype=torch.float32, device=self.device)
        if self.counters.numel() < counters:
            self.retired.append(self.counters)
            self.counters = torch.zeros(max(counters, 2 * self.counters.numel(), 1024),
                                        dtype=torch.int32, device=self.device)
        return self.partial, self.counters


_WORKSPACES: dict = {}


def workspace(device: torch.device, stream: torch.cuda.Stream) -> _Workspace:
    """The workspace of gemv calls on (device, stream)."""
    key = (device.index, stream.cuda_stream)
    ws = _WORKSPACES.get(key)
    if ws is None:
        ws = _WORKSPACES[key] = _Workspace(device)
    return ws


def _rows16(t: torch.Tensor) -> torch.Tensor:
    """t [R, K] with unit stride along K, a 16-byte aligned start and row stride: t itself or
    a fresh contiguous copy."""
    if t.stride(1) == 1 and _align.is_aligned(t) and \
            _align.whole_vectors(t.stride(0) * t.element_size()) and t.stride(0) >= t.shape[1]:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def launch(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, scale: Optional[torch.Tensor],
           bias: Optional[torch.Tensor], max_ctas: int = 0, stages: int = STAGES_AUTO, *,
           x_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The kernel on validated arguments (1 <= M <= 16, or <= 64 for an e4m3 x with x_scale;
    a Hopper GPU), on the current stream;
    max_ctas > 0 caps the grid (tests force split strips with it; benchmarks sweep it);
    stages picks the weight pipeline (STAGES_AUTO: the default ring; 0: registers; 1 ..
    MAX_STAGES: a shared-memory ring of that many units)."""
    C = _ext.load()
    dev = x.device
    m, k = x.shape
    n = w.shape[0]
    mode = scale_mode(w, scale)
    xa, wa = _rows16(x), _rows16(w)
    a = C.GemvArgs()
    a.x, a.ldx = xa.data_ptr(), xa.stride(0)
    a.w, a.ldw = wa.data_ptr(), wa.stride(0)
    a.out, a.ldo = out.data_ptr(), out.stride(0)
    a.m, a.n, a.k = m, n, k
    a.dtype, a.w_dtype = _dtypes.BFLOAT16, _dtypes.code(w.dtype)
    a.scale_mode = SCALE_MODES.index(mode)
    keep = [xa, wa]
    if x_scale is not None:
        sx = x_scale.reshape(-1).contiguous()
        keep.append(sx)
        a.x_dtype, a.x_scale = _dtypes.code(x.dtype), sx.data_ptr()
    if mode != "none":
        s = scale.contiguous()
        keep.append(s)
        a.scale = s.data_ptr()
        a.scale_ld = s.stride(0) if mode == "block" else 0
    if bias is not None:
        b = bias.contiguous()
        keep.append(b)
        a.bias = b.data_ptr()
    a.max_ctas, a.stages = max_ctas, stages
    _, floats, counters, _, _, _, _ = _plan(dev.index or 0, m, n, k, a.w_dtype, a.scale_mode,
                                            max_ctas, stages, a.x_dtype)
    stream = torch.cuda.current_stream(dev)
    if floats:
        partial, cnt = workspace(dev, stream).get(floats, counters)
        a.workspace, a.workspace_floats = partial.data_ptr(), partial.numel()
        a.counters, a.counters_len = cnt.data_ptr(), cnt.numel()
    if dev.index is not None and dev.index != torch.cuda.current_device():
        with torch.cuda.device(dev):
            C.gemv(a, stream.cuda_stream)
    else:
        C.gemv(a, stream.cuda_stream)
    return out


def _gemv_impl(out, x, w, scale, bias, x_scale=None) -> None:
    m, k = x.shape
    if m == 0 or w.shape[0] == 0:
        return
    if k == 0:  # x @ w.t() is all zeros
        out.copy_(bias.expand_as(out) if bias is not None else torch.zeros_like(out))
        return
    for name, t in (("x", x), ("w", w), ("scale", scale), ("bias", bias), ("x_scale", x_scale)):
        if t is not None and overlaps(out, t):
            _fail(f"out overlaps {name}; pass a separate out")
    run(plan(x, w, scale, x_scale=x_scale), out, x, w, scale, bias, x_scale)


def run(p: GemvPlan, out, x, w, scale, bias, x_scale=None) -> None:
    """Execute p on validated, non-empty arguments."""
    if p.path == "kernel":
        launch(out, x, w, scale, bias, p.max_ctas, p.stages_asked, x_scale=x_scale)
        return
    if x.device.type == "cuda" and not p.why.startswith(f"{x.shape[0]} rows"):
        _ext.warn_reference("gemv", p.why)
    out.copy_(gemv_reference(x, w, scale, bias, x_scale))


# ---- torch.compile: torch.library registration --------------------------------------------
@torch.library.custom_op("fusedist::gemv", mutates_args=("out",))
def _gemv_op(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
             scale: Optional[torch.Tensor], bias: Optional[torch.Tensor],
             x_scale: Optional[torch.Tensor] = None) -> None:
    _gemv_impl(out, x, w, scale, bias, x_scale)


@_gemv_op.register_fake
def _(out, x, w, scale, bias, x_scale=None):
    return None
