"""FP8 weights for the projections: e4m3 values and float32 scales, and the GEMM that reads them.

    w8 = quantize_fp8(w, "channel")        # w [N, K] bf16 / fp16 / fp32 -> FP8Weight
    y = fp8_linear(x, w8, bias)            # x [..., K] @ dequantize(w8)^T (+ bias), x's dtype
    y = fp8_linear(x_q, w8, x_scale=s)     # x_q e4m3 [..., K], s float32 [...]: bf16 output
    w8.dequantize()                        # float32 [N, K]: the values every path multiplies by

FP8Weight holds data [N, K] torch.float8_e4m3fn (an nn.Linear weight, K contiguous) and scale,
float32, that MULTIPLIES the e4m3 values (value = data * scale; Hugging Face's
`weight_scale_inv` and compressed-tensors' `weight_scale` both mean this), in one of three
layouts:

    "tensor"   scale [1]                              one scale for the whole weight
    "channel"  scale [N]                              one per output channel (row)
    "block"    scale [ceil(N/128), ceil(K/128)]       one per 128 x 128 block (DeepSeek-V3 /
                                                      Qwen3-FP8 style); the last block row /
                                                      column may be partial

quantize_fp8 makes scale = amax / 448 over the row (block, tensor), so the largest magnitude
maps to e4m3's largest finite value, and rounds w / scale to nearest (an all-zero row / block
gets scale 1). Per element |dequantize - w| <= 2^-4 |w| + 2^-10 scale (3 mantissa bits; the
second term is half the subnormal spacing, for values below 2^-6 scale).

Sharding (FP8Weight.narrow, the tensor-parallel rules): rows (column-parallel) take their
per-channel scales along; columns (row-parallel) keep them. Block scales are cut along the
split dimension and need the cut on a multiple of 128 (else ValueError: the block would be
shared between ranks). cat_rows stacks [q; k; v] or [gate; up]: per-tensor parts with
different scales become per-channel (exact: each row keeps its part's scale); block parts
need every part but the last to have a multiple of 128 rows.

fp8_linear, the dispatch (fusedist.nn.linear.linear calls it for FP8Weight; plan() makes the
choice, run() executes it; the crossovers are the tuning table's "fp8_linear" knobs):
  * CUDA, M <= 16 rows, bf16 x: fusedist.ops.gemv (the decode GEMV, all three layouts; x stays
    bf16, the weight is dequantized in the kernel) when that op is present in this build and
    its kernel runs on the device; except rowwise_min_m..16 rows of a wide, shallow
    per-tensor or per-channel projection (N >= rowwise_min_n, K <= rowwise_max_k; 9, 14336 and
    4096 on H200), where row-wise _scaled_mm measured faster;
  * CUDA, 17..w8a8_gemv_max_m rows of a per-tensor / per-channel projection with at most
    w8a8_gemv_max_n outputs (the tuning table's "fp8_linear" section), bf16 x, the GEMV there: x quantized per token (quantize_rows),
    then the W8A8 GEMV (gemv with x_scale=: e4m3 x into the FP8 MMA), where it measured
    faster than row-wise _scaled_mm (path "gemv_w8a8");
  * CUDA, else, per-tensor and per-channel weights with K, N multiples of 16: torch._scaled_mm
    with dynamic activation scales (x quantized to e4m3 at run time). Row-wise on sm_90+ for
    bf16 x: one scale per token (row of x) and the weight's scale of each output channel (a
    per-tensor scale broadcast to them), so a token's error depends on its own amax only and a
    NaN in one token stays in that token's row. Per-tensor weights with fp16 x, or on sm_89:
    one scale for all of x (a NaN anywhere in x makes the whole output NaN);
  * CUDA, block scales past 16 rows (or without the GEMV), bf16 x, K % 128 == 0, N % 8 == 0,
    on Hopper where fusedist.ops.fp8_gemm's kernel runs: x quantized per token and 128 k
    (quantize_groups, one pass), then fp8_gemm(..., block=True) (path "fp8_gemm");
  * CUDA, block scales past 16 rows where that kernel does not run, bf16 x, K % 512 == 0,
    N % 128 == 0, on sm_90 where torch's block-scaled scaled_mm runs (probed once per device against
    float64; why not, in BLOCKWISE_PROBE[device index]): that GEMM (cuBLASLt), x quantized
    per token and 128 k (1 x 128 scales, x's rows padded to a multiple of 4 for cuBLASLt)
    against the weight's 128 x 128 scales;
  * everything else (block scales elsewhere, fp16 / fp32 x, odd sizes, older GPUs): the
    weight dequantized to x's dtype and F.linear;
  * CPU: fp8_linear_reference: dequantize in fp32, fp32 matmul, rounded once to x's dtype.
So the GEMV and the reference multiply the exact dequantized weight by x (weight-only
quantization), and the _scaled_mm paths also round x to e4m3 (per element |x_q - x| <= 2^-4
|x| + 2^-10 s_x, s_x = amax(row) / 448).

An activation that is already e4m3 with one float32 scale per token (x_q ~= x / x_scale: the
FP8 output of fusedist.add_rmsnorm / rmsnorm / silu_mul, or quantize_rows') goes in as
fp8_linear(x_q, w, x_scale=s), s of x_q's leading shape ([...] or [..., 1]), or as
FP8Rows(x_q, s) to fusedist.nn.linear.linear and TPAttention; the output is bf16. On CUDA,
per-tensor and per-channel weights with K, N multiples of 16 on sm_90+ take row-wise
torch._scaled_mm on (x_q, s) as they are (the W8A8 GEMV where the bf16 x above would take
it): no quantization pass. Everything else (block scales, odd sizes, older GPUs) dequantizes
x_q * s to bf16 and takes the dequantize path; the CPU the reference on x_q * s in float32.
takes_fp8_rows(m, w, device) says whether a bf16 x of m rows would be quantized per token
(for row-wise _scaled_mm or the W8A8 GEMV), which is where a producer writing e4m3 itself
pays; at <= 16 rows the GEMV keeps bf16 x.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Optional, Sequence

import torch
import torch.nn.functional as F

from .. import _dtypes, _ext, tuning
from . import fp8_gemm as _fp8_gemm
from .gemv import MAX_M as GEMV_MAX_M   # the GEMV kernel's rows (a limit of the kernel)
from .gemv import gemv as _gemv
from .quantize_rows import quantize_groups as _quantize_groups
from .quantize_rows import quantize_rows, quantize_rows_reference, to_e4m3, unit_scale

FP8, FP8_MAX = _dtypes.FP8, _dtypes.FP8_MAX
BLOCK = _dtypes.FP8_BLOCK
LAYOUTS = ("tensor", "channel", "block")


def _fail(msg: str, exc=ValueError):
    raise exc(f"fusedist.nn.FP8Weight: {msg}")


def _blocks(n: int) -> int:
    return -(-n // BLOCK)


def scale_shape(layout: str, n: int, k: int) -> tuple:
    """The scale shape fusedist keeps for an [n, k] weight in `layout`."""
    if layout == "tensor":
        return (1,)
    if layout == "channel":
        return (n,)
    if layout == "block":
        return (_blocks(n), _blocks(k))
    _fail(f"layout must be one of {LAYOUTS}, got {layout!r}")


def scale_range(layout: str, dim: int, start: int, stop: int, full: int, what: str = "weight"
                ) -> Optional[tuple]:
    """The [first, last) range of the scale along `dim` that rows (dim 0) or columns (dim 1)
    [start, stop) of a weight of `full` rows / columns use; None when the scale is not cut
    along dim (per-tensor; per-channel cut by columns). Block scales need start, and stop
    unless it is the end, on a multiple of 128 (else a ValueError naming `what`)."""
    if layout == "tensor" or (layout == "channel" and dim == 1):
        return None
    if layout == "channel":
        return start, stop
    for edge in (start, stop):
        if edge % BLOCK and edge != full:
            side = ("rows", "columns")[dim]
            raise ValueError(
                f"fusedist.nn: {what}: {side} [{start}, {stop}) of {full} cut a 128 x 128 scale "
                f"block at {edge}; block-quantized FP8 weights split only on multiples of 128 "
                "(pick a tensor-parallel size whose shards are whole blocks)")
    return start // BLOCK, _blocks(stop)


@dataclass(eq=False)
class FP8Weight:
    """An FP8 projection weight (module docstring): data [N, K] float8_e4m3fn, scale float32 in
    `layout` ("tensor" [1], "channel" [N], "block" [ceil(N/128), ceil(K/128)])."""
    data: torch.Tensor
    scale: torch.Tensor
    layout: str
    # float32 [N]: the scale of each output channel ("tensor": scale broadcast, "channel": the
    # scale itself; None for "block"), the weight operand of row-wise torch._scaled_mm.
    channel_scale: Optional[torch.Tensor] = field(default=None, init=False, repr=False)

    def __post_init__(self):
        if FP8 is None:
            _fail("this torch has no torch.float8_e4m3fn", RuntimeError)
        d, s = self.data, self.scale
        if not isinstance(d, torch.Tensor) or d.dtype != FP8 or d.dim() != 2:
            _fail(f"data must be a 2-D [N, K] torch.float8_e4m3fn tensor, got "
                  f"{getattr(d, 'dtype', type(d).__name__)} {tuple(getattr(d, 'shape', ()))}")
        if self.layout not in LAYOUTS:
            _fail(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        want = scale_shape(self.layout, *d.shape)
        if not isinstance(s, torch.Tensor) or s.dtype != torch.float32 or \
                tuple(s.shape) != want:
            _fail(f"a {self.layout} scale of an {list(d.shape)} weight must be a float32 "
                  f"tensor of shape {list(want)}, got {getattr(s, 'dtype', type(s).__name__)} "
                  f"{list(getattr(s, 'shape', ()))}")
        if s.device != d.device:
            _fail(f"scale is on {s.device}, data on {d.device}")
        if not d.is_contiguous():
            self.data = d.contiguous()
        if self.layout == "tensor":
            self.channel_scale = s.expand(d.shape[0]).contiguous()
        elif self.layout == "channel":
            self.channel_scale = s

    # ---- what it is ---------------------------------------------------------------------
    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scale.numel() * 4

    def __repr__(self) -> str:
        return (f"FP8Weight({list(self.shape)}, {self.layout} scales {list(self.scale.shape)}, "
                f"{self.device})")

    @classmethod
    def empty(cls, n: int, k: int, layout: str, device=None) -> "FP8Weight":
        """Zeros of shape [n, k] with unit scales (a module's weight before loading)."""
        return cls(torch.zeros((n, k), dtype=FP8, device=device),
                   torch.ones(scale_shape(layout, n, k), dtype=torch.float32, device=device),
                   layout)

    def to(self, device) -> "FP8Weight":
        return FP8Weight(self.data.to(device), self.scale.to(device), self.layout)

    # ---- values -------------------------------------------------------------------------
    def scale_map(self, dtype=torch.float32) -> torch.Tensor:
        """The scale of every element that broadcasts against data: [1, 1], [N, 1], or [N, K]
        (block)."""
        n, k = self.shape
        s = self.scale.to(dtype)
        if self.layout == "tensor":
            return s.view(1, 1)
        if self.layout == "channel":
            return s.view(n, 1)
        return _dtypes.expand_block_scales(s, n, k)

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        """data * scale as `dtype` [N, K]: in float32 exact up to one rounding of each product;
        in bf16 / fp16 the product is rounded to that dtype."""
        w = self.data.to(dtype)
        n, k = self.shape
        s = self.scale.to(dtype)
        if self.layout == "tensor":
            return w.mul_(s)
        if self.layout == "channel":
            return w.mul_(s.view(n, 1))
        s = s.repeat_interleave(BLOCK, 0)[:n]                # [N, K blocks]: rows expanded only
        full, rem = divmod(k, BLOCK)
        if full:
            w[:, :full * BLOCK].unflatten(1, (full, BLOCK)).mul_(s[:, :full, None])
        if rem:
            w[:, full * BLOCK:].mul_(s[:, full:])
        return w

    # ---- sharding -----------------------------------------------------------------------
    def narrow(self, dim: int, start: int, stop: int, what: str = "weight") -> "FP8Weight":
        """Rows (dim 0) or columns (dim 1) [start, stop) with their scales (module docstring)."""
        if dim not in (0, 1):
            _fail(f"narrow: dim must be 0 (rows) or 1 (columns), got {dim}")
        full = self.shape[dim]
        if not 0 <= start <= stop <= full:
            _fail(f"narrow: {('rows', 'columns')[dim]} [{start}, {stop}) out of range for "
                  f"{list(self.shape)}")
        data = self.data.narrow(dim, start, stop - start)
        r = scale_range(self.layout, dim, start, stop, full, what)
        scale = self.scale if r is None else self.scale.narrow(dim, r[0], r[1] - r[0])
        return FP8Weight(data.contiguous(), scale.contiguous(), self.layout)

    def shard(self, dim: int, rank: int, world: int, what: str = "weight") -> "FP8Weight":
        """Rank `rank`'s equal share of rows (dim 0, column-parallel) or columns (dim 1,
        row-parallel) of `world`."""
        n = self.shape[dim]
        if n % world:
            _fail(f"{what}: {n} {('rows', 'columns')[dim]} do not split into {world} equal shards")
        per = n // world
        return self.narrow(dim, rank * per, (rank + 1) * per, what)

    @staticmethod
    def cat_rows(parts: Sequence["FP8Weight"], what: str = "weight") -> "FP8Weight":
        """[parts[0]; parts[1]; ...] along the rows (module docstring)."""
        parts = list(parts)
        if not parts or any(not isinstance(p, FP8Weight) for p in parts):
            _fail(f"cat_rows ({what}): pass FP8Weights")
        layouts = {p.layout for p in parts}
        if len(layouts) > 1:
            _fail(f"cat_rows ({what}): the parts have different scale layouts {sorted(layouts)}")
        if len({p.shape[1] for p in parts}) > 1:
            _fail(f"cat_rows ({what}): the parts have different columns "
                  f"{[p.shape[1] for p in parts]}")
        layout = parts[0].layout
        data = torch.cat([p.data for p in parts])
        if len(parts) == 1:
            return parts[0]
        if layout == "tensor":
            scales = torch.cat([p.scale for p in parts])
            if bool((scales == scales[0]).all()):
                return FP8Weight(data, parts[0].scale.clone(), "tensor")
            per_row = torch.cat([p.scale.expand(p.shape[0]) for p in parts])
            return FP8Weight(data, per_row.contiguous(), "channel")
        if layout == "block":
            for i, p in enumerate(parts[:-1]):
                if p.shape[0] % BLOCK:
                    raise ValueError(
                        f"fusedist.nn: {what}: part {i} has {p.shape[0]} rows, not a multiple of "
                        "128, so the stacked weight's 128 x 128 scale blocks would mix parts; "
                        "block-quantized FP8 weights need every stacked part (q / k / v heads "
                        "of a rank, gate / up rows of a rank) to be whole blocks")
        return FP8Weight(data, torch.cat([p.scale for p in parts]), layout)


class FP8Rows(NamedTuple):
    """An activation already in e4m3 with one float32 scale per token: data [..., K]
    float8_e4m3fn, scale float32 [...] (or [..., 1]), x ~= data * scale. What
    fusedist.add_rmsnorm / rmsnorm / all_reduce_add_rmsnorm write with out_dtype=FP8, handed to
    fusedist.nn.linear.linear and TPAttention in place of a bf16 x (fp8_linear's x_scale=)."""
    data: torch.Tensor
    scale: torch.Tensor


# ---- quantization -------------------------------------------------------------------------
# The smallest amax a scale is made from is MIN_AMAX (amax / 448 stays a normal float32); rows
# and blocks of zeros get scale 1 (fusedist.ops.quantize_rows.unit_scale).
_scale_of, _to_fp8 = unit_scale, to_e4m3


def quantize_fp8(w: torch.Tensor, layout: str = "channel", reduce_amax=None) -> FP8Weight:
    """An [N, K] floating weight as FP8Weight: scale = amax / 448 per tensor, output channel
    (row) or 128 x 128 block, data = w / scale rounded to nearest e4m3. Non-finite weights
    raise (they would poison a whole row or block). reduce_amax(amax) -> amax, when given,
    replaces the amax of w ([] per tensor, [N] per channel, blocks) before the scales are made:
    a shard of a weight takes the whole weight's amax that way (the max over the ranks)."""
    if FP8 is None:
        _fail("this torch has no torch.float8_e4m3fn", RuntimeError)
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or not w.is_floating_point() or \
            w.dtype == FP8:
        _fail(f"quantize_fp8: w must be a 2-D floating (bf16 / fp16 / fp32) [N, K] tensor, got "
              f"{getattr(w, 'dtype', type(w).__name__)} {tuple(getattr(w, 'shape', ()))}")
    wf = w.float()
    if not bool(torch.isfinite(wf).all()):
        _fail("quantize_fp8: w has NaN or inf values; an FP8 scale cannot represent them")
    n, k = w.shape
    red = reduce_amax if reduce_amax is not None else (lambda a: a)
    if layout == "tensor":
        s = _scale_of(red(wf.abs().amax() if wf.numel() else wf.new_zeros(()))).reshape(1)
        return FP8Weight(_to_fp8(wf / s), s, layout)
    if layout == "channel":
        amax = wf.abs().amax(dim=1) if k else wf.new_zeros(n)
        s = _scale_of(red(amax))
        return FP8Weight(_to_fp8(wf / s[:, None]), s, layout)
    if layout == "block":
        nb, kb = _blocks(n), _blocks(k)
        padded = F.pad(wf, (0, kb * BLOCK - k, 0, nb * BLOCK - n))
        amax = padded.view(nb, BLOCK, kb, BLOCK).abs().amax(dim=(1, 3))
        s = _scale_of(red(amax))
        return FP8Weight(_to_fp8(wf / _dtypes.expand_block_scales(s, n, k)), s, layout)
    _fail(f"quantize_fp8: layout must be one of {LAYOUTS}, got {layout!r}")


def quantize_tensor(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-tensor activation quantization: (e4m3 [M, K], float32 scale [])."""
    s = _scale_of(x.abs().amax())
    return _to_fp8(x.float() / s), s


def quantize_groups(x: torch.Tensor, group: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token, per-`group`-k activation quantization (the 1 x 128 form that pairs
    with 128 x 128 weight blocks): x [M, K] with K % group == 0 -> (e4m3 [M, K], float32
    scale [M, K / group]), x ~= x_q * scale of its group. A NaN stays in its group."""
    m, k = x.shape
    if k % group:
        _fail(f"quantize_groups: K = {k} must be a multiple of the group size {group}")
    return _quantize_groups(x, group)   # fusedist.ops.quantize_groups: one pass on CUDA


# ---- the GEMM ------------------------------------------------------------------------------
def fp8_linear_reference(x: torch.Tensor, w: FP8Weight, bias: Optional[torch.Tensor] = None
                         ) -> torch.Tensor:
    """x [M, K] @ dequantize(w)^T (+ bias) in float32, rounded once to x's dtype."""
    y = x.float() @ w.dequantize(torch.float32).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def scaled_mm_rowwise(x: torch.Tensor, data: torch.Tensor, channel_scale: torch.Tensor,
                      bias: Optional[torch.Tensor] = None, *,
                      x_scale: Optional[torch.Tensor] = None,
                      quantize=quantize_rows) -> torch.Tensor:
    """torch._scaled_mm with row-wise scales: x [M, K] bf16 quantized per token by `quantize`
    (fusedist's kernel; the torch baseline passes quantize_rows_reference) or, with x_scale
    float32 [M, 1], x already e4m3 with those per-token scales; data [N, K] e4m3 with
    channel_scale float32 [N]; bf16 [M, N] (+ bias, added after)."""
    xq, sx = quantize(x) if x_scale is None else (x, x_scale)
    y = torch._scaled_mm(xq, data.t(), scale_a=sx, scale_b=channel_scale.view(1, -1),
                         out_dtype=torch.bfloat16)
    return y if bias is None else y + bias


def scaled_mm_tensorwise(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor,
                         bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """torch._scaled_mm with per-tensor scales: x [M, K] quantized with one dynamic scale,
    data [N, K] e4m3 with its scale [1]; x's dtype [M, N] (+ bias, added after)."""
    xq, sx = quantize_tensor(x)
    y = torch._scaled_mm(xq, data.t(), scale_a=sx, scale_b=scale.reshape(()),
                         out_dtype=x.dtype)
    return y if bias is None else y + bias


def _blockwise_api():
    """torch's scaled_mm with block recipes (torch.nn.functional.scaled_mm, ScalingType
    BlockWise1x128 / BlockWise128x128), or None in a torch without them."""
    fn = getattr(F, "scaled_mm", None)
    types = getattr(F, "ScalingType", None)
    if fn is None or types is None or not hasattr(types, "BlockWise128x128") or \
            not hasattr(types, "BlockWise1x128"):
        return None
    return fn, types


def _blockwise_operands(xq: torch.Tensor, sx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The activation operand and its scales in the layout torch's block-scaled scaled_mm and
    cuBLASLt take: xq [M, K] e4m3 with sx [M, K / 128] -> (xq [Mp, K], sa [Mp, K / 128] with
    strides (1, Mp)), Mp = M rounded up to a multiple of 4. cuBLASLt's 1 x 128 scales are
    M-major with M a multiple of 4 (16-byte columns), and torch takes the scales' column stride
    only as mat_a's row count, so the rows themselves are padded: zero rows with scale 1,
    their output rows dropped by the caller."""
    m, k = xq.shape
    mp = -(-m // 4) * 4
    if mp != m:
        xp = xq.new_zeros(mp, k)
        xp[:m] = xq
        xq = xp
    sa = sx.new_ones(sx.shape[1], mp)     # one allocation of the padded size, M fastest
    sa[:, :m] = sx.t()
    return xq, sa.t()


def scaled_mm_blockwise(x: torch.Tensor, w: "FP8Weight",
                        bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """torch's block-scaled FP8 GEMM (cuBLASLt on sm_90): x [M, K] bf16 quantized per token
    and 128 k (quantize_groups), w a "block" FP8Weight (128 x 128 scales); bf16 [M, N] (+ bias,
    added after). Needs K % 512 == 0 and N % 128 == 0 (the weight's scales as they are: K / 128
    a multiple of 4, as cuBLASLt's 128 x 128 scales want); any M (padded to a multiple of 4
    inside, _blockwise_operands)."""
    api = _blockwise_api()
    if api is None:
        _fail("scaled_mm_blockwise: this torch has no block-scaled scaled_mm", RuntimeError)
    fn, types = api
    m = x.shape[0]
    xq, sa = _blockwise_operands(*quantize_groups(x))
    sb = w.scale.t()                      # [K / 128, N / 128], K / 128 fastest
    y = fn(xq, w.data.t(), sa, types.BlockWise1x128, sb, types.BlockWise128x128,
           output_dtype=torch.bfloat16)[:m]
    return y if bias is None else y + bias


def blockwise_shape_ok(n: int, k: int) -> bool:
    """The shapes scaled_mm_blockwise serves: K a multiple of 512, N of 128."""
    return k % (4 * BLOCK) == 0 and n % BLOCK == 0 and k > 0 and n > 0


# Per CUDA device index: why the block-scaled scaled_mm is not used there (the probe's
# exception, its error against float64, or the reason it was not tried); no entry where it is.
BLOCKWISE_PROBE: dict[int, str] = {}


def _probe_blockwise(idx: int) -> bool:
    """Whether the block-scaled scaled_mm runs on CUDA device idx and gives the float64 result
    (_blockwise_check): once per device, never inside a capture. A torch or cuBLAS without it
    answers False (the dequantized weight is used) and leaves the reason in
    BLOCKWISE_PROBE[idx]."""
    ok, why = _blockwise_check(torch.device("cuda", idx))
    if ok:
        BLOCKWISE_PROBE.pop(idx, None)
    else:
        BLOCKWISE_PROBE[idx] = why
    return ok


def _blockwise_check(dev: torch.device) -> tuple[bool, str]:
    """(scaled_mm_blockwise gives the float64 result on dev, why not): a 17 x 512 x 256 call
    (17 rows take the padding to 4) against the dequantized operands, within 2^-7 of the
    output's largest magnitude. The reason is the exception torch raised (its type and text)
    or the error found, with torch's version and CUDA build."""
    where = f"torch {torch.__version__}, CUDA {torch.version.cuda}"
    if _blockwise_api() is None:
        return False, (f"{where}: no torch.nn.functional.scaled_mm with "
                       "ScalingType.BlockWise1x128 / BlockWise128x128")
    try:
        g = torch.Generator().manual_seed(7)
        w = quantize_fp8(torch.randn(256, 512, generator=g) * 0.05, "block").to(dev)
        x = torch.randn(17, 512, generator=g).to(torch.bfloat16).to(dev)
        y = scaled_mm_blockwise(x, w).double()
        xq, sx = quantize_groups(x)
        xd = (xq.double().view(17, 4, BLOCK) * sx.double()[..., None]).view(17, 512)
        ref = xd @ w.dequantize(torch.float64).t()
        err = (y - ref).abs().max().item()
        tol = 2.0 ** -7 * ref.abs().max().item() + 1e-6
    except (RuntimeError, TypeError, ValueError, NotImplementedError) as e:
        return False, f"{where}: {type(e).__name__}: {e}"
    if err <= tol:          # a NaN error fails here too
        return True, ""
    return False, f"{where}: wrong result, max |y - ref| = {err:.4g} > {tol:.4g} (17 x 512 x 256)"


# Per CUDA device index: (compute capability, the gemv kernel runs there, the block-scaled
# scaled_mm runs there, fusedist.ops.fp8_gemm's kernel runs there), read once, so that a
# compiled or captured step (whose first call came after an eager one) only looks them up.
_DEVICE: dict = {}


def _device_facts(device: torch.device) -> tuple:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    facts = _DEVICE.get(idx)
    if facts is None:
        dev = torch.device("cuda", idx)
        cap = _ext.device_capability(dev)
        gemv = _ext.kernel_runs("gemv", dev)
        fp8_gemm = _fp8_gemm.kernel_available(dev)
        if torch.cuda.is_current_stream_capturing():
            return cap, gemv, False, fp8_gemm   # no probe inside a capture; looked up later
        if cap == (9, 0):
            blockwise = _probe_blockwise(idx)
        else:
            blockwise = False
            BLOCKWISE_PROBE[idx] = (f"compute capability {cap[0]}.{cap[1]}: cuBLASLt's 1 x 128 / "
                                    "128 x 128 scaling is sm_90 only")
        facts = _DEVICE[idx] = (cap, gemv, blockwise, fp8_gemm)
    return facts


def device_capability(device: torch.device) -> tuple:
    """The CUDA device's compute capability (read once per device)."""
    return _device_facts(device)[0]


# ---- the dispatch: measured crossovers in the tuning table's "fp8_linear" section -------------
# rowwise_*: where row-wise torch._scaled_mm beats the GEMV inside its rows (one H200,
#   benchmarks/gemv.py: 9-16 rows of a wide, shallow projection, the gate|up of Llama-3-8B at
#   TP 1 and 2, N >= 14336 at K = 4096: the GEMV 0.90-0.92x), where the GEMV's two MMAs per
#   k step meet a short K per strip; everywhere else in 1-16 rows the GEMV is 1.0-2.0x faster.
# w8a8_gemv_*: where the W8A8 GEMV (gemv with x_scale=: e4m3 x into the FP8 MMA, per-tensor /
#   per-channel weights) replaces row-wise _scaled_mm: 17..w8a8_gemv_max_m rows of a
#   projection with at most w8a8_gemv_max_n outputs (benchmarks/gemv.py --formats
#   w8a8_channel: Llama-3-8B o and down at 17 and 32 rows 1.06-1.19x; qkv (N = 6144)
#   0.89-1.00x and gate|up (N = 28672) 0.72-0.76x; every shape at 64 rows 0.30-0.62x: x's
#   fragments are reloaded for every 16 weight rows). w8a8_gemv_max_m = 0 turns it off.
tuning.declare(
    "fp8_linear",
    rowwise_min_m=tuning.Knob(9, int, 0, 1 << 20, doc="row-wise _scaled_mm from this many rows"),
    rowwise_max_k=tuning.Knob(4096, int, 0, 1 << 30, doc="... of a projection with K <= this"),
    rowwise_min_n=tuning.Knob(14336, int, 0, 1 << 30, doc="... and N >= this"),
    w8a8_gemv_max_m=tuning.Knob(32, int, 0, 64, doc="the W8A8 GEMV up to this many rows"),
    w8a8_gemv_max_n=tuning.Knob(4096, int, 0, 1 << 30, doc="... of at most this many outputs"),
)
PATHS = ("gemv", "gemv_w8a8", "fp8_gemm", "scaled_mm_tensor", "scaled_mm_rowwise",
         "scaled_mm_block", "dequantize", "reference")


@dataclass(frozen=True)
class Fp8LinearPlan:
    """fp8_linear's path for one call shape (plain data): one of PATHS, and the reason the
    faster paths before it were passed over (for `python -m fusedist.tuning --explain`)."""
    path: str
    why: str = ""


def _rowwise_wins(m: int, n: int, k: int, layout: str, capability: tuple, kn: dict) -> bool:
    return (m >= kn["rowwise_min_m"] and layout != "block" and k <= kn["rowwise_max_k"] and
            n >= kn["rowwise_min_n"] and n % 16 == 0 and k % 16 == 0 and capability >= (9, 0))


def _w8a8_gemv_wins(m: int, n: int, kn: dict) -> bool:
    return GEMV_MAX_M < m <= kn["w8a8_gemv_max_m"] and n <= kn["w8a8_gemv_max_n"]


def plan_shape(m: int, n: int, k: int, layout: str, x_dtype: torch.dtype,
               bias_dtype: Optional[torch.dtype], capability: tuple, gemv: bool,
               blockwise: bool = False, fp8_gemm: bool = False,
               knobs: Optional[dict] = None) -> Fp8LinearPlan:
    """fp8_linear's plan for a CUDA call of m rows (module docstring), a pure function of the
    shape, the device facts and the knobs (tuning.knobs("fp8_linear"); None: the shipped
    ones). x_dtype FP8: a pre-quantized x, "gemv" within w8a8_gemv_max_m rows,
    "scaled_mm_rowwise" or "dequantize". `gemv`: the GEMV op and its kernel run on the device;
    `blockwise`: torch's block-scaled scaled_mm runs there; `fp8_gemm`: fusedist.ops.fp8_gemm's
    kernel runs there; `capability`: the device's (major, minor)."""
    kn = tuning.section_values({}, "fp8_linear") if knobs is None else knobs
    if FP8 is not None and x_dtype == FP8:   # a pre-quantized x with per-token scales
        if gemv and _w8a8_gemv_wins(m, n, kn) and layout != "block" and k % 16 == 0 and \
                bias_dtype in (None, torch.bfloat16):
            return Fp8LinearPlan("gemv", "e4m3 x in the W8A8 GEMV's rows")
        rowwise = m > 0 and layout != "block" and n % 16 == 0 and k % 16 == 0 and \
            capability >= (9, 0)
        return Fp8LinearPlan("scaled_mm_rowwise") if rowwise else \
            Fp8LinearPlan("dequantize", "an e4m3 x that no FP8 GEMM here takes")
    if gemv and 0 < m <= GEMV_MAX_M and x_dtype == torch.bfloat16 and k % 16 == 0 and \
            bias_dtype in (None, x_dtype):
        if not _rowwise_wins(m, n, k, layout, capability, kn):
            return Fp8LinearPlan("gemv")
        rowwise_why = (f"{m} rows of a projection with K <= {kn['rowwise_max_k']} and N >= "
                       f"{kn['rowwise_min_n']}: row-wise _scaled_mm measured faster")
    else:
        rowwise_why = ""
    if gemv and _w8a8_gemv_wins(m, n, kn) and x_dtype == torch.bfloat16 and \
            layout != "block" and k % 16 == 0 and bias_dtype in (None, x_dtype):
        return Fp8LinearPlan("gemv_w8a8", f"{m} rows: past the GEMV's {GEMV_MAX_M}, within the "
                             f"W8A8 GEMV's {kn['w8a8_gemv_max_m']}")
    if fp8_gemm and m > 0 and layout == "block" and x_dtype == torch.bfloat16 and \
            k % BLOCK == 0 and n % 8 == 0 and bias_dtype in (None, x_dtype):
        return Fp8LinearPlan("fp8_gemm", "block scales past the GEMV's rows")
    if blockwise and m > 0 and layout == "block" and x_dtype == torch.bfloat16 and \
            blockwise_shape_ok(n, k) and bias_dtype in (None, x_dtype):
        return Fp8LinearPlan("scaled_mm_block", "block scales; fusedist's fp8_gemm does not run")
    if m > 0 and layout != "block" and n % 16 == 0 and k % 16 == 0 and \
            x_dtype in (torch.bfloat16, torch.float16):
        if x_dtype == torch.bfloat16 and capability >= (9, 0):
            return Fp8LinearPlan("scaled_mm_rowwise", rowwise_why or
                                 f"{m} rows: past the GEMV's rows")
        if layout == "tensor" and capability >= (8, 9):
            return Fp8LinearPlan("scaled_mm_tensor", "per-tensor weights, fp16 x or sm_89")
    return Fp8LinearPlan("dequantize", "no FP8 GEMM here takes this shape, dtype or device")


def choose_path(m: int, n: int, k: int, layout: str, x_dtype: torch.dtype,
                bias_dtype: Optional[torch.dtype], capability: tuple, gemv: bool,
                blockwise: bool = False, fp8_gemm: bool = False) -> str:
    """plan_shape's path with the shipped knobs: "gemv", "gemv_w8a8", "fp8_gemm",
    "scaled_mm_tensor", "scaled_mm_rowwise", "scaled_mm_block" or "dequantize"."""
    return plan_shape(m, n, k, layout, x_dtype, bias_dtype, capability, gemv, blockwise,
                      fp8_gemm).path


def available(device) -> bool:
    """Some FP8 kernel runs on `device` (fusedist's GEMV or FP8 GEMM); elsewhere FP8 weights
    are dequantized (CUDA) or take the reference (CPU)."""
    device = torch.device(device)
    return device.type == "cuda" and (_ext.kernel_runs("gemv", device) or
                                      _ext.kernel_runs("fp8_gemm", device))


def why_not(x: torch.Tensor, w: "FP8Weight", bias: Optional[torch.Tensor] = None) -> str:
    """Why this call takes neither a fusedist kernel nor torch's FP8 GEMMs ("" when one runs)."""
    p = plan(x, w, bias)
    return p.why if p.path in ("dequantize", "reference") else ""


def plan(x: torch.Tensor, w: "FP8Weight", bias: Optional[torch.Tensor] = None) -> Fp8LinearPlan:
    """The plan for x [M, K] (or [..., K]) times w: plan_shape on CUDA with the device's facts
    and its tuning knobs (memoized per shape: a layer and its GEMM asking for the same shape
    cost one dictionary lookup), the reference on the CPU."""
    if not x.is_cuda:
        return Fp8LinearPlan("reference", f"tensors on {x.device}")
    m = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return _device_plan(x.device, m, w.shape[0], w.shape[1], w.layout, x.dtype,
                        None if bias is None else bias.dtype)


def _device_plan(device: torch.device, m: int, n: int, k: int, layout: str,
                 x_dtype: torch.dtype, bias_dtype: Optional[torch.dtype]) -> Fp8LinearPlan:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    dev = torch.device("cuda", idx)
    facts = _device_facts(dev)
    kn = tuning.knobs("fp8_linear", dev)
    key = (facts, id(kn), m, n, k, layout, x_dtype, bias_dtype)
    hit = _PLANS.get(key)
    if hit is None or hit[0] is not kn:
        hit = (kn, plan_shape(m, n, k, layout, x_dtype, bias_dtype, *facts, knobs=kn))
        if idx in _DEVICE:         # facts complete (not read inside a capture): keep the plan
            _PLANS[key] = hit
    return hit[1]


# (device facts, knobs, m, n, k, layout, x dtype, bias dtype) -> (knobs, Fp8LinearPlan)
_PLANS: dict = {}


def fp8_path(x: torch.Tensor, w: FP8Weight, bias: Optional[torch.Tensor] = None) -> str:
    """Which path fp8_linear takes for x [M, K] (module docstring): choose_path's on CUDA,
    "reference" on the CPU."""
    return plan(x, w, bias).path


def takes_fp8_rows(m: int, w: FP8Weight, device: torch.device,
                   x_dtype: torch.dtype = torch.bfloat16,
                   bias: Optional[torch.Tensor] = None) -> bool:
    """Whether fp8_linear would quantize an [m, K] x_dtype x per token for row-wise
    torch._scaled_mm here: where a producer that writes e4m3 + per-token scales itself
    (fusedist.add_rmsnorm / rmsnorm / silu_mul out_dtype=FP8) saves that pass. False on the CPU,
    for a weight that is not an FP8Weight, at the GEMV's rows (it reads bf16 x), for block
    scales (their GEMM takes 1 x 128 activation scales) and wherever x stays in x_dtype."""
    if device.type != "cuda" or FP8 is None or not isinstance(w, FP8Weight):
        return False
    return _device_plan(device, m, w.shape[0], w.shape[1], w.layout, x_dtype,
                        None if bias is None else bias.dtype).path in \
        ("scaled_mm_rowwise", "gemv_w8a8")


def _check_x_scale(x: torch.Tensor, x_scale: Optional[torch.Tensor]) -> bool:
    """True for a pre-quantized x (e4m3 with x_scale); ValueErrors naming the fix."""
    fp8 = FP8 is not None and x.dtype == FP8
    if x_scale is None:
        if fp8:
            raise ValueError("fusedist.nn.fp8_linear: x is e4m3; pass its per-token scales as "
                             "x_scale= (float32 of x's leading shape)")
        return False
    if not fp8:
        raise ValueError(f"fusedist.nn.fp8_linear: x_scale goes with an e4m3 x (pre-quantized "
                         f"per token); x is {x.dtype}: pass x_scale=None")
    lead = tuple(x.shape[:-1])
    if not isinstance(x_scale, torch.Tensor) or x_scale.dtype != torch.float32 or \
            tuple(x_scale.shape) not in (lead, lead + (1,)) or x_scale.device != x.device:
        raise ValueError(f"fusedist.nn.fp8_linear: x_scale must be float32 {list(lead)} (or "
                         f"{list(lead + (1,))}) on {x.device}: one scale per token of x, got "
                         f"{getattr(x_scale, 'dtype', type(x_scale).__name__)} "
                         f"{list(getattr(x_scale, 'shape', ()))}")
    return True


reference = fp8_linear_reference


def fp8_linear(x: torch.Tensor, w: FP8Weight, bias: Optional[torch.Tensor] = None, *,
               x_scale: Optional[torch.Tensor] = None,
               path: Optional[str] = None) -> torch.Tensor:
    """x [..., K] @ dequantize(w)^T (+ bias [N]) -> [..., N] in x's dtype, by plan()'s
    choice (or `path`, for tests). x e4m3 with x_scale float32 [...] (per token): a
    pre-quantized activation, x * x_scale @ dequantize(w)^T -> bf16 (module docstring)."""
    if x.shape[-1] != w.shape[1]:
        raise ValueError(f"fusedist.nn.linear: x has {x.shape[-1]} features, the FP8 weight "
                         f"{list(w.shape)} takes {w.shape[1]}")
    if path is not None and path not in PATHS:
        raise ValueError(f"fusedist.nn.fp8_linear: unknown path {path!r}; one of {PATHS}")
    _check_x_scale(x, x_scale)
    p = Fp8LinearPlan(path) if path is not None else plan(x, w, bias)
    return run(p, x, w, bias, x_scale=x_scale)


def run(p: Fp8LinearPlan, x: torch.Tensor, w: FP8Weight, bias: Optional[torch.Tensor] = None,
        *, x_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Execute plan p on validated arguments (fp8_linear's body; decides nothing)."""
    pre = x_scale is not None
    path = p.path
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[0] == 0:
        return x.new_empty((*lead, w.shape[0]), dtype=torch.bfloat16 if pre else x.dtype)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    if pre:
        y = _fp8_linear_prequantized(x2, x_scale.reshape(-1, 1).contiguous(), w, bias, path)
        return y.reshape(*lead, y.shape[-1])
    if path == "gemv":
        y = _gemv(x2, w.data, scale=w.scale, bias=bias)
    elif path == "scaled_mm_rowwise":
        y = scaled_mm_rowwise(x2, w.data, w.channel_scale, bias)
    elif path == "gemv_w8a8":
        xq, sx = quantize_rows(x2)
        y = _fp8_linear_prequantized(xq, sx, w, bias, "gemv").to(x.dtype)
    elif path == "fp8_gemm" and w.layout == "block":   # x per token and 128 k, 128 x 128 w
        xq, sx = quantize_groups(x2)
        y = _fp8_gemm.fp8_gemm(xq, sx, w.data, w.scale, block=True,
                               bias=None if bias is None else bias.to(torch.bfloat16))
        y = y.to(x.dtype)
    elif path == "fp8_gemm":
        xq, sx = quantize_rows(x2)
        y = _fp8_gemm_call(xq, sx, w, bias).to(x.dtype)
    elif path == "scaled_mm_tensor":
        y = scaled_mm_tensorwise(x2, w.data, w.scale, bias)
    elif path == "scaled_mm_block":
        y = scaled_mm_blockwise(x2, w, bias)
    elif path == "dequantize":
        y = F.linear(x2, w.dequantize(x2.dtype), bias)
    elif path == "reference":
        y = fp8_linear_reference(x2, w, bias)
    else:
        raise ValueError(f"fusedist.nn.fp8_linear: unknown path {path!r}")
    return y.reshape(*lead, y.shape[-1])


def _fp8_linear_prequantized(xq: torch.Tensor, sx: torch.Tensor, w: FP8Weight,
                             bias: Optional[torch.Tensor], path: str) -> torch.Tensor:
    """xq [M, K] e4m3 with sx float32 [M, 1] -> bf16 [M, N] by `path`."""
    bf = torch.bfloat16
    if path == "fp8_gemm":
        return _fp8_gemm_call(xq, sx, w, bias)
    if path == "gemv":   # W8A8 GEMV (M <= 64 on the kernel), per-tensor / per-channel weights
        if w.channel_scale is None:
            raise ValueError("fusedist.nn.fp8_linear: path 'gemv' with a pre-quantized x takes "
                             "per-tensor or per-channel weights (and fusedist.ops.gemv)")
        return _gemv(xq, w.data, scale=w.channel_scale,
                     bias=None if bias is None else bias.to(bf), x_scale=sx.reshape(-1))
    if path == "scaled_mm_rowwise":
        if w.channel_scale is None:
            raise ValueError("fusedist.nn.fp8_linear: path 'scaled_mm_rowwise' takes per-tensor "
                             "or per-channel weights, not block scales")
        return scaled_mm_rowwise(xq, w.data, w.channel_scale,
                                 None if bias is None else bias.to(bf), x_scale=sx)
    x = xq.float() * sx
    if path == "dequantize":
        return F.linear(x.to(bf), w.dequantize(bf), None if bias is None else bias.to(bf))
    if path == "reference":
        return fp8_linear_reference(x, w, bias).to(bf)
    raise ValueError(f"fusedist.nn.fp8_linear: path {path!r} does not take a pre-quantized "
                     "(e4m3) x; 'scaled_mm_rowwise', 'fp8_gemm', 'gemv', 'dequantize' or "
                     "'reference' do")


def _fp8_gemm_call(xq, sx, w: FP8Weight, bias):
    """Path "fp8_gemm" (fusedist.ops.fp8_gemm: CUTLASS on Hopper, its fp32 reference
    elsewhere): per-token x scales x the weight's per-channel scales; bf16 out. Opt-in
    (path=): measured slower than row-wise _scaled_mm at most shapes (docs/design/fp8.md).
    Block weights take it from a bf16 x only (quantized per token and 128 k)."""
    if w.channel_scale is None:
        raise ValueError("fusedist.nn.fp8_linear: path 'fp8_gemm' with a pre-quantized x takes "
                         "per-tensor or per-channel weights; block weights take a bf16 x "
                         "(quantized per token and 128 k)")
    return _fp8_gemm.fp8_gemm(xq, sx, w.data, w.channel_scale,
                              bias=None if bias is None else bias.to(torch.bfloat16))


__all__ = ["FP8Weight", "FP8Rows", "quantize_fp8", "quantize_rows", "quantize_rows_reference",
           "quantize_tensor",
           "quantize_groups", "fp8_linear", "fp8_linear_reference", "fp8_path", "choose_path",
           "scaled_mm_rowwise", "takes_fp8_rows", "scaled_mm_tensorwise", "scaled_mm_blockwise",
           "blockwise_shape_ok", "BLOCKWISE_PROBE", "scale_range", "scale_shape",
           "device_capability", "LAYOUTS", "PATHS", "Fp8LinearPlan", "plan", "plan_shape", "run",
           "available", "why_not",
           "BLOCK", "FP8", "FP8_MAX"]
