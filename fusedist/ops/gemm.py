"""fusedist's GEMMs without communication, and the launchers the GEMM + collective ops share.

    y = fusedist.gemm(x, w, bias=None, out=None, kernel="auto", accumulate=False)

x [M, K] @ w (+ bias [N]) with fp32 accumulation, bf16/fp16, on the current stream. w is
[K, N] row-major or the .t() of a row-major [N, K] nn.Linear weight. Kernels:
  * "decode" (M <= 128): the fused gemm_ar kernel with its exchange left out
    (csrc/include/fusedist/gemm/gemm_comm.cuh): weight streaming through a TMA ring, mma.sync.
  * "sm90" (Hopper): the persistent warp-specialized wgmma GEMM (CUTLASS collectives,
    csrc/include/fusedist/gemm/gemm_sm90.cuh), the kernel behind ag_gemm(engine="fused"), in
    128 x 64 tiles up to 64 rows (so N = 8192 spreads over 128 SMs), swap-AB tiles of 128
    weight columns x 64 tokens (1 x 2 clusters sharing the weight tile, one consumer
    warpgroup) to 128 rows, 128 x 128 up to 256 rows when x has whole tiles of rows to read,
    else 128 x 256. When x is the first rows of a larger buffer (as in CUDA-graph decode, where activations are slices of a max-batch
    buffer), the GEMM reads whole tiles of its rows: tile loads that run past a tensor's end
    are zero-filled by the TMA unit, and that costs up to 1.7x at M = 1 (docs/design/gemm.md).
    accumulate=True adds into out (out += x @ w: the epilogue reads out, one rounding).
  * "auto": auto_kernel() below: "decode" or "sm90" only in the regions of the tuning
    table's "gemm" rules (fusedist/tuning_default.json: M ranges spanning consecutive
    measured M where that kernel beat torch.matmul in every round of a same-run measurement,
    benchmarks/gemm.py --write-rules), torch.matmul everywhere else.
CPU tensors take reference() (plain torch, fp32 accumulation, rounded once); M = 0 returns the
empty output. These show what fusedist's GEMMs cost next to torch.matmul (benchmarks/gemm.py, and
benchmarks/gemm_comm.py at the GEMM + collective shapes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .. import _align, _dtypes, _ext, tuning

KERNELS = ("auto", "decode", "sm90")
FUSED_DTYPES = (torch.float16, torch.bfloat16)


def layout_name(w: torch.Tensor) -> str:
    """"kn" for a row-major [K, N] weight, "nk" for the .t() of a row-major [N, K] one."""
    return "nk" if weight_layout(w)[0] else "kn"


def auto_kernel(m: int, k: int, n: int, layout: str, dtype: torch.dtype, accumulate: bool,
                hopper: bool, table: Optional[dict] = None) -> str:
    """kernel="auto"'s choice: "decode" or "sm90" where the tuning table's "gemm" rules say
    that kernel beat torch.matmul at this shape (tuning.choose_gemm_kernel), else "torch".
    The decode kernel does not accumulate, and both need a Hopper GPU (sm_90)."""
    if not hopper or m == 0:
        return "torch"
    kern = tuning.choose_gemm_kernel(table if table is not None else {}, m, k, n, layout,
                                     str(dtype).replace("torch.", ""))
    return "torch" if kern == "decode" and accumulate else kern


def weight_layout(w: torch.Tensor) -> Optional[tuple[bool, int]]:
    """(w_nk, row stride) for fusedist's kernels: w [K, N] row-major, or the .t() of an [N, K]
    row-major weight; None for any other layout."""
    if w.stride(1) == 1 and w.stride(0) % 8 == 0 and w.stride(0) >= w.shape[1]:
        return False, w.stride(0)
    if w.stride(0) == 1 and w.stride(1) % 8 == 0 and w.stride(1) >= w.shape[0]:
        return True, w.stride(1)
    return None


aligned = _align.aligned_input


def aligned_weight(w: torch.Tensor, w_nk: bool) -> torch.Tensor:
    """w itself when 16-byte aligned, else a fresh (aligned) copy in the same layout: row-major
    [K, N], or the .t() of a row-major [N, K]. (.contiguous() would return a contiguous view
    unchanged, still misaligned.)"""
    if _align.is_aligned(w):
        return w
    if w_nk:
        return w.t().clone(memory_format=torch.contiguous_format).t()
    return w.clone(memory_format=torch.contiguous_format)


def _weight(w: torch.Tensor) -> tuple[torch.Tensor, bool, int]:
    w_nk, ldw = weight_layout(w)
    if not _align.is_aligned(w):
        w = aligned_weight(w, w_nk)
        w_nk, ldw = weight_layout(w)
    return w, w_nk, ldw


def readable_rows(t: torch.Tensor) -> int:
    """Rows of the 2-D row-major view t (row stride t.stride(0)) that lie wholly in its
    storage: t.shape[0], or more when t is the first rows of a larger buffer."""
    avail = t.untyped_storage().nbytes() // t.element_size() - t.storage_offset()
    return max(t.shape[0], (avail - t.shape[1]) // t.stride(0) + 1)


def launch_decode(comm, x: torch.Tensor, w: torch.Tensor, bias, out: torch.Tensor,
                  stream: torch.cuda.Stream) -> torch.Tensor:
    """The decode kernel (comm None: no exchange; else gemm_ar's fused all-reduce). Misaligned
    views go through aligned copies, so alignment never changes which engine runs."""
    C = _ext.load()
    xa = aligned(x)
    w, w_nk, ldw = _weight(w)
    dst = _align.aligned_output(out)
    b = 0 if bias is None else aligned(bias.contiguous()).data_ptr()
    C.gemm_ar_fused(None if comm is None else comm.symm.handle, xa.data_ptr(), xa.stride(0),
                    w.data_ptr(), ldw, w_nk, b, dst.data_ptr(), x.shape[0], w.shape[1],
                    x.shape[1], _dtypes.code(x.dtype), stream.cuda_stream)
    if comm is not None:
        comm.launched()
    if dst is not out:
        out.copy_(dst)
    return out


def launch_sm90(x: torch.Tensor, w: torch.Tensor, bias, out: torch.Tensor,
                stream: torch.cuda.Stream, accumulate: bool = False, comm=None,
                flags: Optional[torch.Tensor] = None, block_rows: int = 0,
                pieces: int = 1, wait_on_c: bool = False, wait_peer: int = -1,
                signal_row0: Optional[int] = None, signal_block_rows: int = 0,
                signal_pieces: int = 0, tile: int = 0, raster: int = 0) -> torch.Tensor:
    """The Hopper GEMM, in the tile configuration `tile` (0: the launcher picks, by M; else a
    value of fusedist._C.GEMM_SM90_TILES: "wide" 128 x 256; "narrow" 128 x 64, "mid"
    128 x 128, "swap" (64 tokens x 128 weight columns) and "swap_1wg" (the same, one consumer
    warpgroup, not persistent) for plain GEMMs; csrc/include/fusedist/common/layout.h, Sm90Tile), its tiles handed out in the order
    `raster` (0: by tile; else a value of fusedist._C.GEMM_SM90_RASTERS, "along_m" for plain
    GEMMs only; layout.h, Sm90Raster). A plain GEMM whose x is the first rows of a larger
    buffer reads whole tiles of its rows (the rows past M never reach out): tile loads that
    run past a tensor's end measured slow (docs/design/gemm.md). The fused engines' protocols (csrc/include/fusedist/gemm/gemm_sm90.cuh):
      flags (int32, zeroed for this call), wait_on_c False: x is an all-gathered input of
        world blocks whose row pieces the copy engine flags as they land (ag_gemm fused);
      flags, wait_on_c True (with accumulate): out's rows, one block, arrive in `pieces`
        flagged pieces from rank wait_peer before they are read as C (gemm_rs fused);
      signal_row0 (not None): x's rows are rows signal_row0.. of the block layout; each stored
        tile adds 1 on its owner's counters (gemm_rs fused; out in symmetric staging)."""
    C = _ext.load()
    xa = aligned(x)
    w, w_nk, ldw = _weight(w)
    dst = _align.aligned_output(out)
    if (flags is not None and wait_on_c or signal_row0 is not None) and dst is not out:
        raise ValueError("fusedist: a fused GEMM's out must be 16-byte aligned")
    if accumulate and dst is not out:
        dst.copy_(out)
    b = 0 if bias is None else aligned(bias.contiguous()).data_ptr()
    signal = signal_row0 is not None
    m_load = readable_rows(xa) if flags is None and not signal else 0
    C.gemm_sm90(None if comm is None else comm.symm.handle, xa.data_ptr(), xa.stride(0),
                w.data_ptr(), ldw, w_nk, b, dst.data_ptr() if accumulate else 0, dst.stride(0),
                1.0, dst.data_ptr(), dst.stride(0), x.shape[0], w.shape[1], x.shape[1],
                _dtypes.code(x.dtype), 0 if flags is None else flags.data_ptr(), block_rows,
                pieces, stream.cuda_stream, wait_on_c=wait_on_c, wait_peer=wait_peer,
                signal_offset=comm.symm.signal_offset if signal else 0,
                signal_row0=signal_row0 if signal else 0, signal_block_rows=signal_block_rows,
                signal_pieces=signal_pieces if signal else 0, tile=tile, raster=raster,
                m_load=m_load)
    if dst is not out:
        out.copy_(dst)
    return out


def sm90_available(device: torch.device) -> bool:
    """The Hopper GEMM (and the decode kernel) run on `device` (the capability table)."""
    return _ext.kernel_runs("gemm_sm90", device)


available = sm90_available


@dataclass(frozen=True)
class GemmPlan:
    """The kernel of a gemm call: "decode", "sm90", "torch" (cuBLAS through torch.matmul, where
    no fusedist kernel measured faster) or "reference" (CPU); why not a fusedist kernel."""
    kernel: str
    why: str = ""


def why_not(x: torch.Tensor, kernel: str = "sm90") -> str:
    """Why fusedist's GEMM kernels do not run for x ("" when they do)."""
    return _ext.why_not("gemm_sm90" if kernel == "sm90" else "gemm_ar_fused", x.device)


def plan(x: torch.Tensor, w: torch.Tensor, kernel: str = "auto",
         accumulate: bool = False) -> GemmPlan:
    """The kernel for x @ w (validated arguments): kernel="auto" reads the tuning table's
    "gemm" rules for the device (auto_kernel); an explicit kernel is checked."""
    if x.device.type == "cpu":
        return GemmPlan("reference", f"tensors on {x.device}")
    m, k = x.shape
    n = w.shape[1]
    if kernel != "auto":
        why = why_not(x, kernel)
        if why:
            raise ValueError(f"fusedist.gemm: kernel={kernel!r} cannot run here: {why}; use "
                             "kernel='auto'")
        return GemmPlan(kernel)
    why = why_not(x)
    if why or m == 0:
        return GemmPlan("torch", why or "no rows")
    kern = auto_kernel(m, k, n, layout_name(w), x.dtype, accumulate, True,
                       tuning.gpu_table(x.device))
    if kern == "decode" and m > _ext.load().GEMM_AR_FUSED_MAX_M:
        return GemmPlan("torch", f"{m} rows: a rule wider than this build's decode kernel")
    return GemmPlan(kern, "" if kern != "torch" else
                    "no tuning-table rule where a fusedist kernel beat torch.matmul")


def reference(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor],
              out: torch.Tensor, accumulate: bool) -> torch.Tensor:
    """What every kernel computes, in plain torch: out = x @ w (+ bias) (+ out when
    accumulate) with fp32 accumulation, rounded once into out's dtype. The CPU path and
    kernel="auto"'s fallback where no fusedist kernel wins (there with torch.matmul's own
    fp32 accumulation in the output dtype, as cuBLAS rounds once too)."""
    if x.device.type == "cpu":
        res = x.float() @ w.float()
        if bias is not None:
            res += bias.float()
        if accumulate:
            res += out.float()
        return out.copy_(res)
    if x.shape[0] == 0:
        return out
    if accumulate:
        if bias is None:
            return out.addmm_(x, w)  # beta = 1: cuBLAS's epilogue reads out, one rounding
        acc = out.float() + bias.float()
        return out.copy_(torch.addmm(acc, x.float(), w.float()))
    if bias is not None:
        return torch.addmm(bias, x, w, out=out)
    return torch.matmul(x, w, out=out)


def gemm(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
         out: Optional[torch.Tensor] = None, kernel: str = "auto",
         accumulate: bool = False) -> torch.Tensor:
    """x [M, K] @ w (+ bias) with one of fusedist's GEMM kernels (module docstring). CPU
    tensors take the plain-torch reference (fp32 accumulation, rounded once); M = 0 returns
    the empty [0, N] output (out unchanged)."""
    if hasattr(torch, "compiler") and torch.compiler.is_compiling():
        if accumulate:
            if out is None:
                raise ValueError("fusedist.gemm: accumulate=True adds into out; pass out=")
            torch.ops.fusedist.gemm_accumulate_(x, w, bias, out, kernel)
            return out
        y = torch.ops.fusedist.gemm(x, w, bias, kernel)
        return y if out is None else out.copy_(y)
    if kernel not in KERNELS:
        raise ValueError(f"fusedist.gemm: kernel must be one of {KERNELS}, got {kernel!r}")
    if not isinstance(x, torch.Tensor) or not isinstance(w, torch.Tensor):
        raise TypeError("fusedist.gemm: x and w must be torch.Tensors")
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[0]:
        raise ValueError(f"fusedist.gemm: expected x [M, K] and w [K, N], got {tuple(x.shape)} "
                         f"and {tuple(w.shape)}")
    if x.dtype not in FUSED_DTYPES or w.dtype != x.dtype or w.device != x.device:
        raise TypeError(f"fusedist.gemm: x and w must share a dtype in {FUSED_DTYPES} and a "
                        f"device, got {x.dtype} on {x.device} and {w.dtype} on {w.device}")
    if x.device.type not in ("cuda", "cpu"):
        raise TypeError(f"fusedist.gemm: x is on {x.device}; pass CUDA or CPU tensors")
    if not x.is_contiguous():
        raise ValueError(f"fusedist.gemm: x is non-contiguous (stride {tuple(x.stride())}); "
                         "call .contiguous() first")
    if weight_layout(w) is None:
        raise ValueError(f"fusedist.gemm: w has strides {tuple(w.stride())}; pass a row-major "
                         "[K, N] tensor or the .t() of a row-major [N, K] one")
    m, k = x.shape
    n = w.shape[1]
    if n % 8 or k % 8:
        raise ValueError(f"fusedist.gemm: N = {n} and K = {k} must be multiples of 8 (16-byte "
                         "TMA rows); pad the weight")
    if bias is not None and (not isinstance(bias, torch.Tensor) or bias.shape != (n,)
                             or bias.dtype != x.dtype or bias.device != x.device):
        raise ValueError(f"fusedist.gemm: bias must be a [{n}] tensor of {x.dtype} on {x.device}")
    if accumulate and out is None:
        raise ValueError("fusedist.gemm: accumulate=True adds into out; pass out=")
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    elif not isinstance(out, torch.Tensor) or tuple(out.shape) != (m, n) or \
            out.dtype != x.dtype or out.device != x.device or not out.is_contiguous():
        raise ValueError(f"fusedist.gemm: out must be a contiguous ({m}, {n}) tensor of "
                         f"{x.dtype} on {x.device}")
    if x.device.type == "cpu" and kernel != "auto":
        raise ValueError(f"fusedist.gemm: kernel={kernel!r} needs CUDA tensors; CPU tensors "
                         "take kernel='auto' (the plain-torch reference)")
    return run(plan(x, w, kernel, accumulate), x, w, bias, out, accumulate)


def run(p: GemmPlan, x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor],
        out: torch.Tensor, accumulate: bool = False) -> torch.Tensor:
    """Execute p on validated arguments (out allocated)."""
    m, k = x.shape
    if p.kernel in ("reference", "torch") or m == 0 or k == 0:
        if m == 0:
            return out  # nothing to compute: no kernel takes an empty grid
        return reference(x, w, bias, out, accumulate)   # k == 0: x @ w is all zeros
    stream = torch.cuda.current_stream(x.device)
    if p.kernel == "decode":
        if accumulate:
            raise ValueError("fusedist.gemm: kernel='decode' does not accumulate; use "
                             "kernel='sm90'")
        if m > _ext.load().GEMM_AR_FUSED_MAX_M:
            raise ValueError(f"fusedist.gemm: kernel='decode' takes M <= "
                             f"{_ext.load().GEMM_AR_FUSED_MAX_M} rows, got {m}; use kernel='auto'")
        return launch_decode(None, x, w, bias, out, stream)
    return launch_sm90(x, w, bias, out, stream, accumulate=accumulate)


# ---- torch.compile: torch.library registrations ------------------------------------------
@torch.library.custom_op("fusedist::gemm", mutates_args=())
def _gemm_op(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None,
             kernel: str = "auto") -> torch.Tensor:
    return gemm(x, w, bias, kernel=kernel)


@_gemm_op.register_fake
def _(x, w, bias=None, kernel="auto"):
    return x.new_empty((x.shape[0], w.shape[1]))


@torch.library.custom_op("fusedist::gemm_accumulate_", mutates_args=("out",))
def _gemm_accumulate_op(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor],
                        out: torch.Tensor, kernel: str = "auto") -> None:
    gemm(x, w, bias, out=out, kernel=kernel, accumulate=True)


@_gemm_accumulate_op.register_fake
def _(x, w, bias, out, kernel="auto"):
    return None
