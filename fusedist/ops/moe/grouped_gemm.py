"""Grouped GEMM over experts: each expert's rows of the permuted buffer times its weight.

    y = grouped_gemm(x_perm, w, layout)                       # x_perm [rows, K], w [E, N, K]
    y = grouped_gemm(xq, w8, layout, x_scale=sx, w_scale=sw)  # FP8: e4m3 operands + scales
    y = grouped_gemm(x, w, layout, gather=True)               # x [T, K] in token order

For every expert e, rows offsets[e] .. offsets[e] + counts[e] of the result are those rows of x
times w[e]^T (w[e] is an nn.Linear weight [N, K], K contiguous: Hugging Face's
`experts.{e}.*_proj.weight` stacked), accumulated in float32 and rounded once to bfloat16 (x's
dtype for a float16 / float32 x on the reference path). Rows that hold no (token, slot) pair
(the layout's padding) are not written. gather=True reads the rows of a token-order x instead
of a permuted one: row r of the product is x[src_index[r] // k] times its expert's weight (the
decode path: no permute pass).

FP8 (torch.float8_e4m3fn) weights carry w_scale, float32, that MULTIPLIES the e4m3 values, in
one of three layouts: [E] (per expert), [E, N] (per output channel), [E, ceil(N / 128),
ceil(K / 128)] (128 x 128 blocks: the FP8 Qwen3 / DeepSeek checkpoints). The activation is
bf16 (weight-only: the weight dequantized on the way) or e4m3 with x_scale float32 [rows] (per
row, as permute(quant="token") writes) or [rows, K / 128] (per 128 columns, quant="group";
block weights take this one). The error against float64 is the FP8 GEMMs' (fusedist.ops.
fp8_gemm's docstring): 2^-8 |ref| for the bf16 rounding plus (2^-13 + (K + 2) 2^-24) sum |x w|.

Nothing synchronizes with the host on the kernel paths: counts and offsets are read on the
device, so a captured graph replays with new routings.

Kernels (Hopper; docs/design/moe.md): the CUTLASS grouped GEMM (bf16 x bf16; e4m3 x per row
with e4m3 w per expert / channel; e4m3 x per 128 columns with 128 x 128 block w) for prefill,
and the grouped decode GEMV (bf16 x with bf16 or e4m3 w, any scale layout; gather=True reads
the token-order x directly), which streams only the routed experts' weights. plan() takes the
GEMV up to the tuning table's moe.gemv_max_pairs (token, slot) pairs and the GEMM above,
hands a call one kernel cannot take to the other, and the reference what neither takes. On the
kernel paths a new out's padding rows are left as allocated. Both kernels keep a workspace per
device and stream (workspace()): calls on one stream run in order; do not run calls on two
streams at once with one stream object's workspace.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch

from ... import _align, _dtypes, _ext, tuning
from .._rows import overlaps
from .gating import MoeLayout

W_DTYPES = (torch.bfloat16,) + ((_dtypes.FP8,) if _dtypes.FP8 is not None else ())
SCALE_LAYOUTS = ("none", "expert", "channel", "block")


def _fail(msg: str, exc=ValueError):
    raise exc(f"fusedist.ops.moe.grouped_gemm: {msg}")


def _is_fp8(t: torch.Tensor) -> bool:
    return _dtypes.FP8 is not None and t.dtype == _dtypes.FP8


def w_scale_layout(w: torch.Tensor, w_scale: Optional[torch.Tensor]) -> str:
    """Which of SCALE_LAYOUTS w_scale is for w [E, N, K] (ValueError naming the shapes)."""
    if w_scale is None:
        return "none"
    E, N, K = w.shape
    if not _is_fp8(w):
        _fail(f"w_scale goes with float8_e4m3fn weights; w is {w.dtype} (pass w_scale=None)")
    if not isinstance(w_scale, torch.Tensor) or w_scale.dtype != torch.float32 or \
            w_scale.device != w.device:
        _fail(f"w_scale must be a float32 tensor on {w.device}, got "
              f"{getattr(w_scale, 'dtype', type(w_scale).__name__)}")
    b = _dtypes.FP8_BLOCK
    shape = tuple(w_scale.shape)
    if shape == (E,):
        return "expert"
    if shape == (E, N):
        return "channel"
    if shape == (E, -(-N // b), -(-K // b)):
        return "block"
    _fail(f"w_scale has shape {list(shape)}; for w [{E}, {N}, {K}] pass [{E}] (per expert), "
          f"[{E}, {N}] (per output channel) or [{E}, {-(-N // b)}, {-(-K // b)}] (per 128 x 128 "
          "block)")


def dequantize_weights(w: torch.Tensor, w_scale: Optional[torch.Tensor]) -> torch.Tensor:
    """w [E, N, K] as float32 with its scales applied."""
    wf = w.float()
    mode = w_scale_layout(w, w_scale)
    E, N, K = w.shape
    if mode == "expert":
        return wf * w_scale.view(E, 1, 1)
    if mode == "channel":
        return wf * w_scale.view(E, N, 1)
    if mode == "block":
        return torch.stack([wf[e] * _dtypes.expand_block_scales(w_scale[e], N, K)
                            for e in range(E)])
    return wf


def _x_float(x: torch.Tensor, x_scale: Optional[torch.Tensor]) -> torch.Tensor:
    if x_scale is None:
        return x.float()
    if x_scale.dim() == 1:
        return x.float() * x_scale.view(-1, 1)
    return x.float() * _dtypes.expand_block_scales(x_scale, x.shape[0], x.shape[1], 1)


def grouped_gemm_reference(x: torch.Tensor, w: torch.Tensor, layout: MoeLayout, *,
                           w_scale: Optional[torch.Tensor] = None,
                           x_scale: Optional[torch.Tensor] = None, gather: bool = False,
                           out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Plain torch, float32 (module docstring). Reads the counts on the host: not for CUDA
    graphs."""
    out_dtype = torch.bfloat16 if (_is_fp8(x) or _is_fp8(w)) else x.dtype
    N = w.shape[1]
    if out is None:
        out = torch.zeros((layout.rows, N), dtype=out_dtype, device=x.device)
    xf = _x_float(x, x_scale)
    if gather:
        src = layout.src_index.long()
        xf = xf.index_select(0, src.clamp_min(0) // layout.top_k)
    wf = dequantize_weights(w, w_scale)
    counts = layout.counts.tolist()
    offsets = layout.offsets.tolist()
    for e, c in enumerate(counts):
        if c:
            o = offsets[e]
            out[o:o + c] = (xf[o:o + c] @ wf[e].t()).to(out.dtype)
    return out


# ---- checks ----------------------------------------------------------------------------------

def _check(x, w, layout, w_scale, x_scale, gather, out) -> str:
    """Every argument check, once; returns w_scale's layout."""
    if not isinstance(layout, MoeLayout):
        _fail(f"layout must be a fusedist.ops.moe.MoeLayout (sort_by_expert's), got "
              f"{type(layout).__name__}", TypeError)
    if not isinstance(w, torch.Tensor) or w.dim() != 3 or w.dtype not in W_DTYPES:
        _fail("w must be a 3-D [experts, N, K] bfloat16 or float8_e4m3fn tensor, got "
              f"{getattr(w, 'dtype', type(w).__name__)} {tuple(getattr(w, 'shape', ()))}")
    E, N, K = w.shape
    if E != layout.num_experts:
        _fail(f"w has {E} experts, the layout {layout.num_experts}")
    if w.stride(2) != 1:
        _fail(f"w must have K contiguous (stacked nn.Linear weights [E, N, K]); got strides "
              f"{tuple(w.stride())}: pass w.contiguous()")
    rows = layout.tokens if gather else layout.rows
    what = f"[{layout.tokens}, {K}] in token order (gather=True)" if gather else \
        f"[{layout.rows}, {K}] (the layout's permuted rows)"
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or tuple(x.shape) != (rows, K):
        _fail(f"x must be {what}, got {tuple(getattr(x, 'shape', ()))}")
    if x.device != w.device or x.device != layout.offsets.device:
        _fail(f"x, w and the layout must be on one device (x {x.device}, w {w.device}, layout "
              f"{layout.offsets.device})")
    mode = w_scale_layout(w, w_scale)
    if _is_fp8(w) and mode == "none":
        _fail("float8_e4m3fn weights need w_scale (float32 [E], [E, N] or 128 x 128 blocks)")
    if _is_fp8(x):
        if not _is_fp8(w):
            _fail("an e4m3 x takes float8_e4m3fn weights")
        kb = K // _dtypes.FP8_BLOCK
        ok = isinstance(x_scale, torch.Tensor) and x_scale.dtype == torch.float32 and \
            x_scale.device == x.device and (tuple(x_scale.shape) == (rows,) or
                                            (K % _dtypes.FP8_BLOCK == 0 and
                                             tuple(x_scale.shape) == (rows, kb)))
        if not ok:
            _fail(f"an e4m3 x needs x_scale float32 [{rows}] (per row) or [{rows}, K / 128] "
                  f"(per 128 columns, K % 128 == 0), got "
                  f"{getattr(x_scale, 'dtype', type(x_scale).__name__)} "
                  f"{tuple(getattr(x_scale, 'shape', ()))}")
        if mode == "block" and x_scale.dim() != 2:
            _fail("block-scaled weights take an x quantized per 128 columns "
                  "(permute(quant='group'): x_scale [rows, K / 128])")
    else:
        if x_scale is not None:
            _fail(f"x_scale goes with an e4m3 x; x is {x.dtype}: pass x_scale=None")
        if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            _fail(f"x must be bfloat16 (or e4m3 with x_scale), got {x.dtype}")
        if x.dtype != torch.bfloat16 and (w.dtype != x.dtype and not _is_fp8(w)):
            _fail(f"x is {x.dtype} but w is {w.dtype}: pass both in one dtype")
    if out is not None:
        od = torch.bfloat16 if (_is_fp8(x) or _is_fp8(w)) else x.dtype
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != (layout.rows, N) or \
                out.dtype != od or out.device != x.device or not out.is_contiguous():
            _fail(f"out must be a contiguous {od} [{layout.rows}, {N}] tensor on {x.device}, "
                  f"got {getattr(out, 'dtype', type(out).__name__)} "
                  f"{tuple(getattr(out, 'shape', ()))}")
    return mode


# ---- the op ----------------------------------------------------------------------------------

# Tuning: the grouped GEMV takes a call up to gemv_max_pairs (token, slot) pairs (T * top_k),
# the CUTLASS grouped GEMM above (fusedist/tuning_default.json, section "moe").
tuning.declare("moe", gemv_max_pairs=tuning.Knob(
    128, int, 0, 1 << 20,
    doc="(token, slot) pairs (tokens x top_k) up to which the grouped GEMV runs; the grouped "
        "GEMM above"))

PATHS = ("gemv", "gemm", "reference")
_KERNELS = {"gemm": "moe_grouped_gemm", "gemv": "moe_grouped_gemv"}
# fusedist._C.MOE_X_SCALE_MODES / MOE_W_SCALE_MODES (csrc/include/fusedist/moe/grouped_gemm_api.h)
X_SCALE_MODES = ("none", "row", "group")
W_SCALE_MODES = SCALE_LAYOUTS


def available(device) -> bool:
    """The grouped GEMM kernel runs on `device`."""
    return _ext.kernel_runs("moe_grouped_gemm", device)


@dataclass(frozen=True)
class GroupedGemmPlan:
    """Which kernel multiplies, and its launch parameters (plain data): path "gemm" (the
    CUTLASS grouped GEMM: workspace_bytes of per-expert arrays and TMA descriptors), "gemv"
    (the grouped decode GEMV: grid CTAs, partial_floats and counters of workspace, max_ctas
    as asked), or "reference" (why: the kernels' reasons)."""
    path: str
    why: str = ""
    x_scale_mode: int = 0          # X_SCALE_MODES index
    w_scale_mode: int = 0          # W_SCALE_MODES index
    workspace_bytes: int = 0       # gemm
    grid: int = 0                  # gemv
    partial_floats: int = 0        # gemv
    counters: int = 0              # gemv
    max_ctas: int = 0              # gemv: 0 = every resident CTA


def _modes(w, w_scale, x_scale) -> tuple[int, int]:
    xm = 0 if x_scale is None else (1 if x_scale.dim() == 1 else 2)
    return xm, W_SCALE_MODES.index(w_scale_layout(w, w_scale))


@functools.lru_cache(maxsize=1024)
def _shape_why_not(device: int, path: str, experts: int, n: int, k: int, rows: int,
                   x_rows: int, ldx: int, pairs: int, top_k: int, gather: bool, x_code: int,
                   w_code: int, xm: int, wm: int, max_ctas: int) -> tuple:
    """The kernel's answer for one call shape (aligned pointers assumed; the caller checks its
    own): (reason, and for a taken call its launch parameters: gemm (workspace bytes,), gemv
    (grid, partial floats, counters))."""
    C = _ext.load()
    a = C.MoeGroupedGemmArgs()
    a.x = a.w = a.out = a.x_scale = a.w_scale = a.counts = a.offsets = a.src_index = 256
    a.experts, a.n, a.k, a.rows, a.x_rows, a.ldx = experts, n, k, rows, x_rows, ldx
    a.pairs, a.top_k, a.gather, a.max_ctas = pairs, top_k, int(gather), max_ctas
    a.x_dtype, a.w_dtype, a.x_scale_mode, a.w_scale_mode = x_code, w_code, xm, wm
    with torch.cuda.device(device):
        if path == "gemm":
            why = C.moe_grouped_gemm_why_not(a)
            return (why, ()) if why else ("", (C.moe_grouped_gemm_workspace_size(a),))
        why = C.moe_grouped_gemv_why_not(a)
        if why:
            return why, ()
        p = C.moe_grouped_gemv_plan(a)
        return "", (p.grid, p.partial_floats, p.counters)


def _kernel_answer(x, w, layout, path, w_scale=None, x_scale=None, gather=False,
                   max_ctas=0) -> tuple:
    """(why not, launch parameters) of kernel `path` for this valid call."""
    why = _ext.why_not(_KERNELS[path], x.device)
    if why:
        return why, ()
    if x.dtype not in (torch.bfloat16,) + ((_dtypes.FP8,) if _dtypes.FP8 else ()):
        return f"the kernels take a bfloat16 or e4m3 x, got {x.dtype}", ()
    for name, t in (("counts", layout.counts), ("offsets", layout.offsets),
                    ("src_index", layout.src_index)):
        if t.dtype != torch.int32 or not t.is_contiguous():
            return f"layout.{name} must be a contiguous int32 tensor (sort_by_expert's)", ()
    if not w.is_contiguous():
        return f"w must be contiguous [E, N, K] (strides {tuple(w.stride())}): pass " \
               "w.contiguous() once, at load time", ()
    E, N, K = w.shape
    xm, wm = _modes(w, w_scale, x_scale)
    # The gemm path gathers a token-order x first: the kernel sees the layout's rows.
    gemm_gather = gather and path == "gemm"
    x_rows = layout.rows if gemm_gather else x.shape[0]
    ldx = K if (gemm_gather or not _rows_ok(x)) else x.stride(0)
    return _shape_why_not(x.device.index if x.device.index is not None else
                          torch.cuda.current_device(), path, E, N, K, layout.rows, x_rows, ldx,
                          layout.tokens * layout.top_k, layout.top_k,
                          bool(gather and path == "gemv"), _dtypes.code(x.dtype),
                          _dtypes.code(w.dtype), xm, wm, max_ctas)


def why_not(x: torch.Tensor, w: torch.Tensor, path: str = "gemm",
            layout: Optional[MoeLayout] = None, *, w_scale: Optional[torch.Tensor] = None,
            x_scale: Optional[torch.Tensor] = None, gather: bool = False) -> str:
    """Why kernel `path` ("gemm" or "gemv") does not take this (valid) call; "" when it does.
    Without a layout only the device and the build are asked. The kernels' limits: bf16 x
    with bf16 w, or e4m3 x / w (gemm: x per row with w per expert / channel, or x per 128 k
    with 128 x 128 block w; gemv: bf16 x with bf16 or e4m3 w under any scale layout); K a
    multiple of 16 bytes of w (and of x), N of 8 (gemm), K of 128 for block scales (gemm);
    at most 1024 experts (gemv); w contiguous."""
    if path not in _KERNELS:
        _fail(f"path must be 'gemm' or 'gemv', got {path!r}")
    if layout is None:
        return _ext.why_not(_KERNELS[path], x.device)
    return _kernel_answer(x, w, layout, path, w_scale, x_scale, gather)[0]


def preferred_path(device, pairs: int) -> str:
    """The kernel the tuning table picks for `pairs` (token, slot) pairs on `device` before the
    operands are known: "gemv" up to moe.gemv_max_pairs, "gemm" above (where it runs), else
    "reference". A layer with FP8 experts asks this to decide whether to quantize its
    activations for the GEMM (which takes e4m3 x only) or keep them bf16 for the GEMV."""
    device = torch.device(device)
    gemv = _ext.kernel_runs("moe_grouped_gemv", device)
    gemm = _ext.kernel_runs("moe_grouped_gemm", device)
    if gemv and (pairs <= tuning.knobs("moe", device)["gemv_max_pairs"] or not gemm):
        return "gemv"
    return "gemm" if gemm else "reference"


def plan(x: torch.Tensor, w: torch.Tensor, layout: MoeLayout, gather: bool = False, *,
         w_scale: Optional[torch.Tensor] = None, x_scale: Optional[torch.Tensor] = None,
         path: Optional[str] = None, max_ctas: int = 0) -> GroupedGemmPlan:
    """The path for this valid call and its launch parameters. The tuning table's "moe"
    section decides: the grouped GEMV up to gemv_max_pairs pairs (T * top_k), the grouped GEMM
    above; a kernel that cannot take the call hands it to the other, and the reference takes
    what neither does. path= forces "gemv", "gemm" or "reference" (ValueError with the reason
    when that kernel cannot take the call); max_ctas caps the GEMV's grid (tests)."""
    xm, wm = _modes(w, w_scale, x_scale)
    if path is not None and path not in PATHS:
        _fail(f"path must be one of {PATHS} or None, got {path!r}")
    if path == "reference":
        return GroupedGemmPlan("reference", "asked for", xm, wm)
    if path is None and x.device.type == "cuda":
        pairs = layout.tokens * layout.top_k
        first = "gemv" if pairs <= tuning.knobs("moe", x.device)["gemv_max_pairs"] else "gemm"
        order = (first, "gemm" if first == "gemv" else "gemv")
    else:
        order = (path,) if path is not None else ()
    whys = []
    for kernel in order:
        why, params = _kernel_answer(x, w, layout, kernel, w_scale, x_scale, gather, max_ctas)
        if not why:
            if kernel == "gemm":
                return GroupedGemmPlan("gemm", "", xm, wm, workspace_bytes=params[0])
            return GroupedGemmPlan("gemv", "", xm, wm, grid=params[0], partial_floats=params[1],
                                   counters=params[2], max_ctas=max_ctas)
        whys.append(f"{kernel}: {why}")
    if path is not None:
        _fail(f"the {path} kernel cannot take this call ({whys[0]})")
    return GroupedGemmPlan("reference", "; ".join(whys) or f"tensors on {x.device}", xm, wm)


# ---- the kernels' launches -------------------------------------------------------------------

def _rows_ok(t: torch.Tensor) -> bool:
    """t [R, K] has unit stride along K, a 16-byte aligned start and 16-byte rows."""
    return t.stride(1) == 1 and _align.is_aligned(t) and t.stride(0) >= t.shape[1] and \
        _align.whole_vectors(t.stride(0) * t.element_size())


class _Workspace:
    """The buffers of the grouped kernels on one (device, stream): the GEMM's per-expert arrays
    and TMA descriptors (bytes), the GEMV's partial sums (float32) and task counters (int32,
    zero between calls). Grown by replacement; a replaced buffer stays alive (a captured CUDA
    graph may still use it). Calls on one stream run in order; calls on two streams at once
    each need their own stream."""

    def __init__(self, device: torch.device):
        self.device = device
        self.gemm = torch.empty(0, dtype=torch.uint8, device=device)
        self.partial = torch.empty(0, dtype=torch.float32, device=device)
        self.counters = torch.zeros(0, dtype=torch.int32, device=device)
        self.retired: list = []

    def _grow(self, name: str, need: int, zero: bool = False, least: int = 0) -> torch.Tensor:
        t = getattr(self, name)
        if t.numel() < need:
            self.retired.append(t)
            size = max(need, 2 * t.numel(), least)
            t = (torch.zeros if zero else torch.empty)(size, dtype=t.dtype, device=self.device)
            setattr(self, name, t)
        return t


_WORKSPACES: dict = {}


def workspace(device: torch.device, stream: torch.cuda.Stream) -> _Workspace:
    """The grouped kernels' workspace on (device, stream)."""
    key = (device.index, stream.cuda_stream)
    ws = _WORKSPACES.get(key)
    if ws is None:
        ws = _WORKSPACES[key] = _Workspace(device)
    return ws


def _launch(p: GroupedGemmPlan, out, x, w, counts, offsets, src_index, w_scale, x_scale,
            top_k: int, tokens: int, gather: bool) -> None:
    """Kernel p.path on checked arguments, on the current stream (nothing decided here)."""
    C = _ext.load()
    dev = x.device
    rows, (E, N, K) = out.shape[0], w.shape
    if p.path == "gemm" and gather:   # the GEMM reads permuted rows: gather them first
        tok = src_index.long().clamp_min(0) // top_k
        x = x.index_select(0, tok)
        if x_scale is not None:
            x_scale = x_scale.index_select(0, tok)
        gather = False
    if not _rows_ok(x):   # an aligned copy (a view at an odd offset, padded rows)
        x = x.clone(memory_format=torch.contiguous_format)
    a = C.MoeGroupedGemmArgs()
    a.x, a.ldx, a.w = x.data_ptr(), x.stride(0), w.data_ptr()
    a.counts, a.offsets, a.src_index = counts.data_ptr(), offsets.data_ptr(), src_index.data_ptr()
    a.experts, a.n, a.k, a.rows, a.x_rows = E, N, K, rows, x.shape[0]
    a.top_k, a.gather, a.pairs, a.max_ctas = top_k, int(gather), tokens * top_k, p.max_ctas
    a.x_dtype, a.w_dtype = _dtypes.code(x.dtype), _dtypes.code(w.dtype)
    a.x_scale_mode, a.w_scale_mode = p.x_scale_mode, p.w_scale_mode
    keep = [x]
    if x_scale is not None:
        x_scale = x_scale.contiguous()
        keep.append(x_scale)
        a.x_scale = x_scale.data_ptr()
    if w_scale is not None:
        w_scale = w_scale.contiguous()
        keep.append(w_scale)
        a.w_scale = w_scale.data_ptr()
    # out must be 16-byte aligned: a view that is not runs into an aligned copy of itself (its
    # padding rows carried over) and is copied back.
    dst = out if _align.is_aligned(out) else out.clone()
    a.out = dst.data_ptr()
    stream = torch.cuda.current_stream(dev)
    ws = workspace(dev, stream)
    if p.path == "gemm":
        buf = ws._grow("gemm", p.workspace_bytes)
        a.workspace, a.workspace_bytes = buf.data_ptr(), buf.numel()
        fn = C.moe_grouped_gemm
    else:
        part = ws._grow("partial", p.partial_floats)
        cnt = ws._grow("counters", p.counters, zero=True, least=1024)
        a.partial, a.partial_floats = part.data_ptr(), part.numel()
        a.counters, a.counters_len = cnt.data_ptr(), cnt.numel()
        fn = C.moe_grouped_gemv
    if dev.index is not None and dev.index != torch.cuda.current_device():
        with torch.cuda.device(dev):
            fn(a, stream.cuda_stream)
    else:
        fn(a, stream.cuda_stream)
    if dst is not out:
        out.copy_(dst)


def _impl(out, x, w, counts, offsets, src_index, dest_index, w_scale, x_scale, top_k: int,
          align: int, gather: bool, path: str, xm: int, wm: int, workspace_bytes: int, grid: int,
          partial_floats: int, counters: int, max_ctas: int) -> None:
    layout = MoeLayout(counts, offsets, src_index, dest_index, top_k, align)
    if out.shape[0] == 0 or out.shape[1] == 0 or layout.tokens == 0:
        return
    if path == "auto":   # torch.compile's call: planned here, on the real tensors
        p = plan(x, w, layout, gather, w_scale=w_scale, x_scale=x_scale)
        if p.path == "reference" and x.is_cuda:
            _ext.warn_reference("moe.grouped_gemm", p.why)
    else:
        p = GroupedGemmPlan(path, "", xm, wm, workspace_bytes, grid, partial_floats, counters,
                            max_ctas)
    for name, t in (("x", x), ("w", w), ("w_scale", w_scale), ("x_scale", x_scale)):
        if t is not None and overlaps(out, t):
            _fail(f"out overlaps {name}; pass a separate out")
    if w.shape[2] == 0:   # every product is zero
        grouped_gemm_reference(x, w, layout, w_scale=w_scale, x_scale=x_scale, gather=gather,
                               out=out)
        return
    if p.path == "reference":
        grouped_gemm_reference(x, w, layout, w_scale=w_scale, x_scale=x_scale, gather=gather,
                               out=out)
        return
    _launch(p, out, x, w, counts, offsets, src_index, w_scale, x_scale, top_k, layout.tokens,
            gather)


def run(p: GroupedGemmPlan, x, w, layout, *, w_scale=None, x_scale=None, gather=False,
        out=None) -> torch.Tensor:
    """Execute plan p on checked arguments (nothing decided here). A new out is
    torch.empty on the kernel paths: its padding rows hold whatever the allocator gave (the
    reference path's are zeros); pass out to keep them."""
    if p.path == "reference" and x.is_cuda and p.why != "asked for":
        _ext.warn_reference("moe.grouped_gemm", p.why)
    if out is None:
        od = torch.bfloat16 if (_is_fp8(x) or _is_fp8(w)) else x.dtype
        make = torch.zeros if p.path == "reference" else torch.empty
        out = make((layout.rows, w.shape[1]), dtype=od, device=x.device)
    args = (out, x, w, layout.counts, layout.offsets, layout.src_index, layout.dest_index,
            w_scale, x_scale, layout.top_k, layout.align, bool(gather), p.path, p.x_scale_mode,
            p.w_scale_mode, p.workspace_bytes, p.grid, p.partial_floats, p.counters, p.max_ctas)
    if torch.compiler.is_compiling():
        torch.ops.fusedist.moe_grouped_gemm(*args)
    else:
        _impl(*args)
    return out


def grouped_gemm(x: torch.Tensor, w: torch.Tensor, layout: MoeLayout, *,
                 w_scale: Optional[torch.Tensor] = None, x_scale: Optional[torch.Tensor] = None,
                 gather: bool = False, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Each expert's rows of x times its weight (module docstring) -> [rows, N]. A new out's
    padding rows are left as allocated (zeros on the reference path). Also
    torch.ops.fusedist.moe_grouped_gemm (torch.compile(fullgraph=True): the path is planned
    inside the op)."""
    _check(x, w, layout, w_scale, x_scale, gather, out)
    if torch.compiler.is_compiling():
        if out is None:
            od = torch.bfloat16 if (_is_fp8(x) or _is_fp8(w)) else x.dtype
            out = torch.empty((layout.rows, w.shape[1]), dtype=od, device=x.device)
        torch.ops.fusedist.moe_grouped_gemm(
            out, x, w, layout.counts, layout.offsets, layout.src_index, layout.dest_index,
            w_scale, x_scale, layout.top_k, layout.align, bool(gather), "auto", 0, 0, 0, 0, 0, 0,
            0)
        return out
    p = plan(x, w, layout, gather, w_scale=w_scale, x_scale=x_scale)
    return run(p, x, w, layout, w_scale=w_scale, x_scale=x_scale, gather=gather, out=out)


# ---- torch.compile: torch.library registration --------------------------------------------
@torch.library.custom_op("fusedist::moe_grouped_gemm", mutates_args=("out",))
def _grouped_gemm_op(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor,
                     offsets: torch.Tensor, src_index: torch.Tensor, dest_index: torch.Tensor,
                     w_scale: Optional[torch.Tensor], x_scale: Optional[torch.Tensor],
                     top_k: int, align: int, gather: bool, path: str, xm: int, wm: int,
                     workspace_bytes: int, grid: int, partial_floats: int, counters: int,
                     max_ctas: int) -> None:
    _impl(out, x, w, counts, offsets, src_index, dest_index, w_scale, x_scale, top_k, align,
          gather, path, xm, wm, workspace_bytes, grid, partial_floats, counters, max_ctas)


@_grouped_gemm_op.register_fake
def _(out, x, w, counts, offsets, src_index, dest_index, w_scale, x_scale, top_k, align, gather,
      path, xm, wm, workspace_bytes, grid, partial_floats, counters, max_ctas):
    return None


__all__ = ["grouped_gemm", "grouped_gemm_reference", "dequantize_weights", "w_scale_layout",
           "GroupedGemmPlan", "SCALE_LAYOUTS", "PATHS", "available", "why_not", "plan", "run",
           "workspace"]


reference = grouped_gemm_reference   # the op's shape: available / why_not / plan / run above
