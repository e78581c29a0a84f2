"""FP8 communication: all-reduce and all-gather whose payload travels as 8-bit floats with one
fp32 scale per block of `block_size` elements. Opt-in only: call these functions, or make an
:class:`Fp8Communicator` for a group; nothing else in fusedist sends FP8.

    y = fp8_all_reduce(x, block_size=128)           # this call only
    fc = Fp8Communicator(group, block_size=64)      # every call of this object
    y = fc.all_reduce(x); g = fc.all_gather(x)

Payload layout (what crosses the wire, per rank): the input flattened and zero-padded to a
multiple of block_size elements, then ``q``: one byte per element (sent as uint8), and
``scales``: one fp32 per block, scale = amax(|block|) x fp32(1 / max) (1 for an all-zero
block), q = the block / scale rounded to nearest even in the payload format. Decoding
multiplies back in fp32. Formats (``fmt=``), one sign bit each:
- "e3m4" (default): 3 exponent bits, 4 mantissa bits, max 31, normal down to 2^-2 (a 2^7
  range below the block's amax), subnormals below in steps of 2^-6; no infinities, the code
  0x80 (negative zero) is NaN. Twice e4m3's precision over the range Gaussian data spans in
  a block.
- "e4m3": torch.float8_e4m3fn (4 exponent, 3 mantissa bits, max 448, normal over 2^15 below
  the amax): half the precision, for blocks whose values span more than ~2^8 (channels a
  thousand times their block-mates).

all_reduce algorithms (both accumulate in fp32 and give bitwise identical results on every
rank, since every sum is formed from the same bytes in the same rank order):
- "two_shot" (default): each rank quantizes its input once; an all-to-all sends block-shard
  r of every rank's payload to rank r; rank r decodes and sums its shard in rank order and
  quantizes the sum once; an all-gather of the summed shards; every rank decodes. Two
  quantizations in all (the inputs, the sums), never one per hop; (p-1)/p of the payload
  each way, as a ring reduce-scatter + all-gather.
- "one_shot": an all-gather of every rank's payload; every rank decodes and sums all of them
  in rank order. One quantization (the inputs), p - 1 payloads received per rank.

Error model (docs/scaling.md, tests/comm/test_fp8.py): one quantization of Gaussian data has
a relative RMS error set by the mantissa bits, ~1.3% for e3m4 and ~2.6% for e4m3, nearly
independent of the block size (the per-block scale sets the exponent range, not the
precision) and of the world size (independent errors of p inputs grow as sqrt(p), as their
sum does); two_shot's second quantization multiplies it by ~sqrt(2): <= 2e-2 for e3m4, ~3.7%
for e4m3. The per-block scales keep outlier channels from flushing the rest of the data to
zero: without them (one scale per tensor) values far below the largest become subnormal or
zero.

Where the model ends (docs/scaling.md measures it): an outlier in a block sets its scale, and
the block's other elements then sit that far below the amax. Past e3m4's normal range (2^7
below the amax) they are rounded in steps of amax 2^-11: elements sharing a block with a 300x
outlier lose ~6%, with 1000x ~23%, from 10^4x nearly everything, whatever the block size.
And the error is relative to the inputs, not to their sum: partial sums that cancel to a
tenth of their size carry ten times the relative error (0.18 at e3m4 two_shot).

Error bound (max_error, default ERROR_BOUND = 2^-4): fp8_all_reduce holds the result's
relative RMS error, and that of the elements an outlier pushed below the format's normal range
(block_damage: the relative RMS error of a block's subnormal elements, judged where they are a
quarter or more of its nonzero ones), within max_error. Each rank measures its own
quantization (one decode of its payload) before the exchange; with the call check (check=True)
every rank's verdict rides on that all-gather and the ranks agree: the requested format, e4m3
where e3m4 loses an outlier block's body and e4m3 keeps it (e4m3's normal range is 2^15 below
the amax: outliers to ~10^4x), or the exact sum (an fp32 all-reduce) where neither does. The
squared errors of every quantization ride with the scales in the exchange, so every rank ends
with the same estimate of the result's error (the quantizations' errors added in quadrature,
against the sum's norm) and falls back to the exact sum, all alike, where it exceeds
max_error (partial sums that cancel). Gaussian data keeps its format and its bytes: the
checks cost a decode pass and a few reductions per call, and a few floats per message.
max_error=None: the FP8 path whatever its error. all_reduce_reference replays a call in one
process (the tests' reference).

The collectives run on torch.distributed (CPU with gloo, CUDA with NCCL). The codec is plain
torch on CPUs and, on CUDA tensors, the kernels of csrc/include/fusedist/comm/fp8_codec.cuh
when the extension is built (the plain-torch path otherwise, with a warning): the same bytes
and sums, bit for bit.
"""

from __future__ import annotations

import hashlib
import math
import struct
from typing import Optional

import torch
import torch.distributed as dist

from .. import _dtypes, _ext
from .._check import as_int
from ..distributed.groups import Group
from ..errors import CollectiveMismatchError
from ._args import check_input, peers_guard
from .communicator import GroupLike, resolve_group

# torch >= 2.13 names it all_gather_single (all_gather_into_tensor warns there).
_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
E4M3_MAX = 448.0
E3M4_MAX = 31.0
ALGOS = ("two_shot", "one_shot")
FORMATS = ("e3m4", "e4m3")
# The largest finite value of each payload format: a block's amax maps to it.
FMT_MAX = {"e3m4": E3M4_MAX, "e4m3": E4M3_MAX}
# fp32(1 / max), correctly rounded: scale = amax x this, one rounding, in the torch path and the
# kernel alike (torch divides a CUDA tensor by a scalar as such a multiply, a CPU tensor by a
# true division: the explicit multiply gives the same bytes on both).
_RECIP = {f: float(torch.ones(1) / torch.tensor(m)) for f, m in FMT_MAX.items()}
# The code of NaN in e3m4 (the negative zero's: zeros encode as 0x00).
E3M4_NAN = 0x80


def _check_block(where: str, block_size) -> int:
    return as_int(f"fusedist.{where}", "block_size", block_size, 1,
                  what="a positive int (elements per fp32 scale; 128 is a common choice)")


def _check_fmt(where: str, fmt) -> str:
    if fmt not in FORMATS:
        raise ValueError(f"fusedist.{where}: fmt must be one of {FORMATS}, got {fmt!r}")
    return fmt


def _codec(t: torch.Tensor, use_kernel: Optional[bool], fmt: str):
    """fusedist._C when the codec kernels should run on t (a CUDA tensor, the extension built
    with them for `fmt`; use_kernel=False forces the torch path), else None."""
    if use_kernel is False or t.device.type != "cuda":
        return None
    if not _ext.capabilities().has("fp8_codec"):
        if use_kernel:
            _ext.load()  # raises ExtensionMissingError with the build instructions
            raise RuntimeError(f"fusedist.fp8: this fusedist._C has no {fmt} codec; rebuild it")
        _ext.warn_reference("fp8", f"the extension with the FP8 {fmt} codec is not built")
        return None
    return _ext.load()


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """2.0 ** e as float32, built from its bits (exact), for int32 e in the normal range."""
    return ((e + 127) << 23).view(torch.float32)


def _e3m4_encode(v: torch.Tensor) -> torch.Tensor:
    """e3m4 codes (uint8) of fp32 values v, saturated at +-31, rounded to nearest even."""
    a = v.abs().clamp(max=E3M4_MAX)
    # floor(log2 a), at least the smallest normal exponent -2 (fp32 subnormals and 0 too)
    e = ((a.view(torch.int32) >> 23) - 127).clamp(min=-2)
    k = torch.round(a * _pow2(4 - e))            # a power-of-two scaling: exact
    code = k.nan_to_num(0).to(torch.int32) + (e + 2) * 16
    code = torch.where((v < 0) & (code != 0), code | 0x80, code)
    return torch.where(v.isnan(), E3M4_NAN, code).to(torch.uint8)


_E3M4_VALUES: dict = {}


def _e3m4_values(device: torch.device) -> torch.Tensor:
    """The 256 codes' fp32 values: magnitude (16 + m) 2^(e - 7) for exponent field e >= 1,
    m 2^-6 for e = 0 (m: the 4 mantissa bits), sign from bit 7; 0x80 is NaN."""
    lut = _E3M4_VALUES.get(device)
    if lut is None:
        c = torch.arange(256, dtype=torch.int32)
        e, m = (c & 0x7F) >> 4, c & 0xF
        mag = torch.where(e > 0, m + 16, m).to(torch.float32) * _pow2(e.clamp(min=1) - 7)
        lut = torch.where(c >= 0x80, -mag, mag)
        lut[E3M4_NAN] = float("nan")
        lut = _E3M4_VALUES[device] = lut.to(device)
    return lut


def _values(q: torch.Tensor, fmt: str) -> torch.Tensor:
    """The fp32 values of payload bytes q (unscaled)."""
    if fmt == "e4m3":
        return q.view(torch.float8_e4m3fn).to(torch.float32)
    return _e3m4_values(q.device)[q.long()]


def quantize(x: torch.Tensor, block_size: int = 128, *, fmt: str = "e3m4",
             use_kernel: Optional[bool] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scales): x flattened, zero-padded to whole blocks, as payload bytes (uint8, one per
    element, format `fmt`) and one fp32 scale per block. CUDA tensors run the codec kernel
    (csrc/include/fusedist/comm/fp8_codec.cuh) when it is built; its bytes are this torch
    code's, bit for bit."""
    block_size = _check_block("fp8.quantize", block_size)
    _check_fmt("fp8.quantize", fmt)
    numel = x.numel()
    nblocks = -(-numel // block_size)
    C = _codec(x, use_kernel, fmt)
    if C is not None and x.dtype in (torch.float32, torch.float16, torch.bfloat16):
        src = x.reshape(-1).contiguous()
        q = torch.empty(nblocks * block_size, dtype=torch.uint8, device=x.device)
        scales = torch.empty(nblocks, dtype=torch.float32, device=x.device)
        a = C.Fp8EncodeArgs()
        a.x, a.q, a.scales = src.data_ptr(), q.data_ptr(), scales.data_ptr()
        a.numel, a.block, a.dtype = numel, block_size, _dtypes.code(x.dtype)
        a.fmt = getattr(C, f"FP8_FORMAT_{fmt.upper()}")
        C.fp8_encode(a, torch.cuda.current_stream(x.device).cuda_stream)
        return q, scales
    flat = x.reshape(-1).to(torch.float32)
    padded = torch.zeros(nblocks * block_size, dtype=torch.float32, device=x.device)
    padded[:numel] = flat
    blocks = padded.view(nblocks, block_size)
    amax = blocks.abs().amax(dim=1)
    scales = torch.where(amax > 0, amax * _RECIP[fmt], torch.ones_like(amax))
    v = blocks / scales[:, None]
    if fmt == "e3m4":
        return _e3m4_encode(v).view(-1), scales
    q = v.clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.view(torch.uint8).view(-1), scales


def dequantize(q: torch.Tensor, scales: torch.Tensor, numel: Optional[int] = None,
               block_size: int = 128, *, fmt: str = "e3m4") -> torch.Tensor:
    """fp32 values of a payload (the first `numel` elements; all when None)."""
    v = (_values(q, fmt).view(-1, block_size) * scales[:, None]).view(-1)
    return v if numel is None else v[:numel]


def decode_sum(qs: torch.Tensor, ss: torch.Tensor, numel: int, block_size: int, *,
               fmt: str = "e3m4", use_kernel: Optional[bool] = None) -> torch.Tensor:
    """The fp32 sum, in row order, of the payloads qs[r] (bytes) / ss[r] (scales): the first
    row's values, then each later row's added (one rounding per product and per sum), the
    first `numel` elements. CUDA tensors run the decode kernel when it is built."""
    qs, ss = qs.reshape(qs.shape[0], -1), ss.reshape(ss.shape[0], -1)
    C = _codec(qs, use_kernel, fmt)
    if C is not None:
        out = torch.empty(numel, dtype=torch.float32, device=qs.device)
        qs, ss = qs.contiguous(), ss.contiguous()
        a = C.Fp8DecodeSumArgs()
        a.q, a.scales, a.out = qs.data_ptr(), ss.data_ptr(), out.data_ptr()
        a.numel, a.q_stride, a.scale_stride = numel, qs.shape[1], ss.shape[1]
        a.block, a.payloads = block_size, qs.shape[0]
        a.fmt = getattr(C, f"FP8_FORMAT_{fmt.upper()}")
        C.fp8_decode_sum(a, torch.cuda.current_stream(qs.device).cuda_stream)
        return out
    acc = dequantize(qs[0], ss[0], None, block_size, fmt=fmt)
    for r in range(1, qs.shape[0]):
        acc = acc + dequantize(qs[r], ss[r], None, block_size, fmt=fmt)
    return acc[:numel]


def _gather(t: torch.Tensor, group: Group) -> torch.Tensor:
    out = torch.empty(group.size * t.numel(), dtype=t.dtype, device=t.device)
    _gather_single(out, t, group=group.pg)
    return out.view(group.size, -1)


def _check_same(group: Group, where: str, x: torch.Tensor, block_size: int, algo: str,
                fmt: str) -> None:
    group.check_same(_call_fields(x, block_size, algo, fmt), where=f"fusedist.{where}",
                     what="calls", fix=_SAME_CALL)


_SAME_CALL = "every rank must make the same call (same size, dtype, block_size, algo, fmt)"


def _call_fields(x, block_size, algo, fmt) -> dict:
    return {"numel": str(x.numel()), "dtype": str(x.dtype), "block_size": str(block_size),
            "algo": algo, "fmt": fmt}


# ---- the error bound ---------------------------------------------------------------------------
# What fp8_all_reduce holds by default (max_error): the relative RMS error of the result, and
# of the elements its blocks round in absolute steps, at most 2^-4 (e4m3's rounding of
# Gaussian data is 2.65% per quantization; e3m4's 1.33%). Past it a call changes format or
# falls back to the exact sum (module docstring, "Error bound").
ERROR_BOUND = 2.0 ** -4
# The smallest normal value of each payload format: below amax x (this / max) a block's
# elements are subnormal, rounded in steps of the block's amax x 2^-11 (e3m4) / 2^-18 (e4m3).
_MIN_NORMAL = {"e3m4": 0.25, "e4m3": 2.0 ** -6}
# A block's body is judged when it holds this many nonzero elements, at least a quarter of
# them in the subnormal range (a few tiny elements beside Gaussian ones cost nothing).
_BODY_MIN = 16


def block_damage(blocks: torch.Tensor, q: torch.Tensor, scales: torch.Tensor,
                 fmt: str) -> tuple[torch.Tensor, float]:
    """How one quantization of `blocks` (fp32 [nblocks, block_size], as quantize() made q and
    scales) lost precision: (squared error per block, float64 [nblocks]; the worst relative
    RMS error of a block's subnormal elements, over the blocks whose body is subnormal: the
    elements an outlier in their block pushed below the format's normal range)."""
    nb, bs = blocks.shape
    err = (blocks - dequantize(q, scales, None, bs, fmt=fmt).view(nb, bs)).double()
    err2 = err.square().sum(1)
    if nb == 0:
        return err2, 0.0
    a = blocks.abs()
    nz = a > 0
    low = nz & (a < a.amax(1, keepdim=True) * (_MIN_NORMAL[fmt] / FMT_MAX[fmt]))
    n_nz, n_low = nz.sum(1), low.sum(1)
    body = (n_nz >= _BODY_MIN) & (4 * n_low >= n_nz)
    d = (err.square() * low).sum(1)
    m = (blocks.double().square() * low).sum(1)
    ratio = torch.where(body & (m > 0), (d / m.clamp_min(1e-300)).sqrt(), torch.zeros_like(d))
    worst = float(ratio.max())
    return err2, worst if math.isfinite(worst) else math.inf


def _encode(flat: torch.Tensor, block_size: int, fmt: str, max_error: Optional[float]):
    """One rank's payload of `flat` (a whole number of blocks) and what it lost: (q, scales,
    squared error per block, worst subnormal-body ratio, the format it needs: `fmt`, "e4m3"
    (e3m4 lost an outlier block's body, e4m3 keeps it) or "exact")."""
    q, s = quantize(flat, block_size, fmt=fmt)
    blocks = flat.to(torch.float32).view(-1, block_size)
    err2, ratio = block_damage(blocks, q, s, fmt)
    need = fmt
    if max_error is not None and ratio > max_error:
        need = "exact"
        if fmt == "e3m4":
            q4, s4 = quantize(flat, block_size, fmt="e4m3")
            if block_damage(blocks, q4, s4, "e4m3")[1] <= max_error:
                need = "e4m3"
    return q, s, err2, ratio, need


_NEEDS = ("e3m4", "e4m3", "exact")


def _agree(group: Group, fields: dict, need: str, check: bool, fmt: str = "e3m4") -> str:
    """The format every rank uses: the call's fields compared (check) and every rank's need
    combined (the strictest: e3m4 < e4m3 < exact), in one all-gather of [digest, need].
    Without the check (check=False) the ranks cannot agree before the exchange: every rank
    uses the requested `fmt` (an over-bound call falls back after the exchange)."""
    code = _NEEDS.index(need)
    if group.size == 1:
        return need
    if not check:
        return fmt
    blob = repr((sorted(fields.items()), None)).encode()
    words = list(struct.unpack("<2q", hashlib.blake2b(blob, digest_size=16).digest()))
    mine = torch.tensor(words + [code], dtype=torch.int64, device=group.device)
    every = _gather(mine, group)
    if not bool((every[:, :2] == every[0, :2]).all()):
        group.check_same(fields, where="fusedist.fp8_all_reduce", what="calls",
                         fix=_SAME_CALL)       # raises, naming each rank's call
    return _NEEDS[int(every[:, 2].max())]


def _exact(x: torch.Tensor, g: Group) -> torch.Tensor:
    """The exact sum (the fallback): fp32 accumulation, rounded once to x's dtype."""
    acc = x.reshape(-1).to(torch.float32, copy=True)
    if g.size > 1:
        dist.all_reduce(acc, group=g.pg)
    return acc.to(x.dtype).view_as(x)


def _within(err2_total: float, ref2_total: float, worst_ratio: float,
            max_error: Optional[float]) -> bool:
    """Whether a finished FP8 all-reduce holds the bound: its estimated relative error
    (the quantizations' squared errors added in quadrature, against the sum's norm) and every
    rank's worst subnormal-body ratio within max_error."""
    if max_error is None:
        return True
    if worst_ratio > max_error:
        return False
    if ref2_total <= 0:
        return err2_total <= 0
    return math.sqrt(max(err2_total, 0.0) / ref2_total) <= max_error


def _fp8_all_reduce(x: torch.Tensor, group: GroupLike = None, *, block_size: int = 128,
                    algo: str = "two_shot", fmt: str = "e3m4", check: bool = True,
                    max_error: Optional[float] = ERROR_BOUND, info: Optional[dict] = None
                    ) -> torch.Tensor:
    g = resolve_group(group)
    try:
        check_input("fp8_all_reduce", x, g.device)
        block_size = _check_block("fp8_all_reduce", block_size)
        _check_fmt("fp8_all_reduce", fmt)
        if algo not in ALGOS:
            raise ValueError(f"fusedist.fp8_all_reduce: algo must be one of {ALGOS}, got "
                             f"{algo!r}")
        max_error = _check_max_error("fp8_all_reduce", max_error)
    except (ValueError, TypeError) as e:
        if check and g.size > 1:   # the others are told (they would wait for this rank)
            try:
                _agree(g, {"call": f"invalid: {type(e).__name__}: {e}"}, "exact", True)
            except CollectiveMismatchError as told:
                raise e from told
        raise
    info = {} if info is None else info
    n, p = x.numel(), g.size
    # two_shot: shards of whole blocks, the same count for every rank (padded with zeros).
    nblocks = -(-n // block_size)
    per = -(-nblocks // p) if algo == "two_shot" and p > 1 else nblocks
    padded = torch.zeros(max(p * per if algo == "two_shot" and p > 1 else nblocks, 1)
                         * block_size, dtype=x.dtype, device=x.device)
    padded[:n] = x.reshape(-1)
    q, s, err2, ratio, need = _encode(padded, block_size, fmt, max_error)
    use = _agree(g, _call_fields(x, block_size, algo, fmt), need, check, fmt)
    if use == "exact":
        info.update(path="exact", reason="an outlier block's body")
        return _exact(x, g)
    if use != fmt:
        q, s, err2, ratio, _ = _encode(padded, block_size, use, None)
    y, est, worst = _fp8_sum(padded, q, s, err2, ratio, g, n, block_size, algo, use)
    if not _within(est[0], est[1], worst, max_error):
        info.update(path="exact", reason="the estimated error of the FP8 sum",
                    estimate=math.sqrt(est[0] / est[1]) if est[1] > 0 else math.inf)
        return _exact(x, g)
    info.update(path=use, estimate=math.sqrt(est[0] / est[1]) if est[1] > 0 else 0.0)
    return y.to(x.dtype).view_as(x)


def _fp8_sum(padded, q, s, err2, ratio, g: Group, n: int, block_size: int, algo: str,
             fmt: str):
    """The FP8 exchange of one rank's payload (q, s) with its error statistics riding along
    in the scales' messages: (the fp32 sum, (estimated squared error, squared norm of the
    sum), the worst subnormal-body ratio of any quantization), every statistic the same on
    every rank."""
    p, dev = g.size, padded.device
    stats = lambda *v: torch.tensor(v, dtype=torch.float32, device=dev)  # noqa: E731
    if p == 1:
        acc = decode_sum(q[None], s[None], n, block_size, fmt=fmt)
        return acc, (float(err2.sum()), float(acc.double().square().sum())), ratio
    if algo == "one_shot":
        qs = _gather(q, g)
        ss = _gather(torch.cat([s, stats(float(err2.sum()), ratio)]), g)
        nb = s.numel()
        acc = decode_sum(qs, ss[:, :nb], n, block_size, fmt=fmt)   # rank order, everywhere
        st = ss[:, nb:].double()
        return acc, (float(st[:, 0].sum()), float(acc.double().square().sum())), \
            float(st[:, 1].max())
    per = s.numel() // p
    # shard r of every rank's payload -> r; each shard's scales carry the sender's squared
    # error of that shard and its worst ratio
    mine = torch.cat([s.view(p, per), torch.stack(
        [err2.view(p, per).sum(1).float(), torch.full((p,), ratio, device=dev)], 1)], 1)
    q_in, s_in = torch.empty_like(q), torch.empty_like(mine)
    dist.all_to_all_single(q_in, q, group=g.pg)
    dist.all_to_all_single(s_in, mine, group=g.pg)
    acc = decode_sum(q_in.view(p, -1), s_in[:, :per], per * block_size, block_size, fmt=fmt)
    q_sum, s_sum = quantize(acc, block_size, fmt=fmt)  # the second (and last) quantization
    err2_sum, ratio_sum = block_damage(acc.view(-1, block_size), q_sum, s_sum, fmt)
    first = s_in[:, per].double()
    worst = max(float(s_in[:, per + 1].max()), ratio_sum)
    qs = _gather(q_sum, g)
    ss = _gather(torch.cat([s_sum, stats(float(first.sum() + err2_sum.sum()),
                                         float(acc.double().square().sum()), worst)]), g)
    y = decode_sum(qs.reshape(1, -1), ss[:, :per].reshape(1, -1), n, block_size, fmt=fmt)
    st = ss[:, per:].double()
    return y, (float(st[:, 0].sum()), float(st[:, 1].sum())), float(st[:, 2].max())


def _check_max_error(where: str, max_error) -> Optional[float]:
    if max_error is None:
        return None
    if isinstance(max_error, bool) or not isinstance(max_error, (int, float)) or \
            not math.isfinite(max_error) or max_error <= 0:
        raise ValueError(f"fusedist.{where}: max_error must be a finite number > 0 (the "
                         f"relative error allowed; default {ERROR_BOUND}) or None (no bound), "
                         f"got {max_error!r}")
    return float(max_error)


def all_reduce_reference(xs, *, block_size: int = 128, algo: str = "two_shot",
                         fmt: str = "e3m4", max_error: Optional[float] = ERROR_BOUND,
                         check: bool = True, info: Optional[dict] = None) -> torch.Tensor:
    """fp8_all_reduce of the inputs xs (one per rank, in rank order) replayed in one process:
    the same payloads, decisions and sums, so its result is the ranks' bit for bit where the
    FP8 path runs (the exact fallback here sums in fp32 in rank order; a backend may sum in
    another order)."""
    block_size = _check_block("fp8.all_reduce_reference", block_size)
    _check_fmt("fp8.all_reduce_reference", fmt)
    max_error = _check_max_error("fp8.all_reduce_reference", max_error)
    info = {} if info is None else info
    p, x0 = len(xs), xs[0]
    n = x0.numel()
    nblocks = -(-n // block_size)
    two = algo == "two_shot" and p > 1
    per = -(-nblocks // p) if two else nblocks
    pads = []
    for x in xs:
        t = torch.zeros(max(p * per if two else nblocks, 1) * block_size, dtype=x.dtype,
                        device=x.device)
        t[:n] = x.reshape(-1)
        pads.append(t)
    enc = [_encode(t, block_size, fmt, max_error) for t in pads]
    use = _NEEDS[max(_NEEDS.index(e[4]) for e in enc)] if check or p == 1 else fmt
    exact = lambda: sum(x.reshape(-1).to(torch.float32) for x in xs).to(  # noqa: E731
        x0.dtype).view_as(x0)
    if use == "exact":
        info.update(path="exact")
        return exact()
    if use != fmt:
        enc = [_encode(t, block_size, use, None) for t in pads]
    ratios = [e[3] for e in enc]
    if p == 1 or algo == "one_shot":
        acc = decode_sum(torch.stack([e[0] for e in enc]), torch.stack([e[1] for e in enc]),
                         n, block_size, fmt=use)
        est = (sum(float(e[2].sum()) for e in enc), float(acc.double().square().sum()))
        worst = max(ratios)
        y = acc
    else:
        outs, e_tot, a_tot, worst = [], 0.0, 0.0, max(ratios)
        for r in range(p):
            acc = decode_sum(torch.stack([e[0].view(p, -1)[r] for e in enc]),
                             torch.stack([e[1].view(p, per)[r] for e in enc]),
                             per * block_size, block_size, fmt=use)
            q_sum, s_sum = quantize(acc, block_size, fmt=use)
            err2_sum, ratio_sum = block_damage(acc.view(-1, block_size), q_sum, s_sum, use)
            first = sum(float(e[2].view(p, per)[r].sum()) for e in enc)
            e_tot += first + float(err2_sum.sum())
            a_tot += float(acc.double().square().sum())
            worst = max(worst, ratio_sum)
            outs.append((q_sum, s_sum))
        y = decode_sum(torch.cat([o[0] for o in outs]).reshape(1, -1),
                       torch.cat([o[1] for o in outs]).reshape(1, -1), n, block_size, fmt=use)
        est = (e_tot, a_tot)
    if not _within(est[0], est[1], worst, max_error):
        info.update(path="exact")
        return exact()
    info.update(path=use)
    return y.to(x0.dtype).view_as(x0)


def _fp8_all_gather(x: torch.Tensor, group: GroupLike = None, *, block_size: int = 128,
                    fmt: str = "e3m4", check: bool = True) -> torch.Tensor:
    g = resolve_group(group)
    try:
        check_input("fp8_all_gather", x, g.device)
        block_size = _check_block("fp8_all_gather", block_size)
        _check_fmt("fp8_all_gather", fmt)
        fields, bad = _call_fields(x, block_size, "all_gather", fmt), None
    except (ValueError, TypeError) as e:
        fields, bad = {"call": f"invalid: {type(e).__name__}: {e}"}, e
    if check and g.size > 1:
        try:
            g.check_same(fields, where="fusedist.fp8_all_gather", what="calls", fix=_SAME_CALL)
        except CollectiveMismatchError as told:
            if bad is not None:
                raise bad from told
            raise
    if bad is not None:
        raise bad
    n = x.numel()
    q, s = quantize(x, block_size, fmt=fmt)
    qs, ss = _gather(q, g), _gather(s, g)
    return torch.cat([decode_sum(qs[r][None], ss[r][None], n, block_size, fmt=fmt)
                      for r in range(g.size)]).to(x.dtype)


def fp8_all_reduce(x: torch.Tensor, group: GroupLike = None, *, block_size: int = 128,
                   algo: str = "two_shot", fmt: str = "e3m4", check: bool = True,
                   max_error: Optional[float] = ERROR_BOUND,
                   info: Optional[dict] = None) -> torch.Tensor:
    """The sum of x over `group` (tensor-parallel group when None) with an 8-bit payload in
    format `fmt` ("e3m4" or "e4m3"); x's shape and dtype. max_error (default ERROR_BOUND,
    2^-4): the relative error the call holds (module docstring, "Error bound"): where the
    format would lose an outlier block's body, e3m4 becomes e4m3 for the call (every rank
    agrees in the call check), and where neither format holds it (larger outliers, partial
    sums that cancel) the call returns the exact sum instead; None: the FP8 path whatever
    its error. check=False skips the call check (one small all-gather; the format is then
    not changed, an over-bound call falls back after the exchange). info: a dict that
    receives "path" ("e3m4", "e4m3" or "exact") and, for FP8, "estimate" (the estimated
    relative error). A lost peer raises PeerLostError."""
    g = resolve_group(group)
    with peers_guard("fusedist.fp8_all_reduce", g):
        return _fp8_all_reduce(x, g, block_size=block_size, algo=algo, fmt=fmt, check=check,
                               max_error=max_error, info=info)


def fp8_all_gather(x: torch.Tensor, group: GroupLike = None, *, block_size: int = 128,
                   fmt: str = "e3m4", check: bool = True) -> torch.Tensor:
    """Every rank's x, flattened and concatenated in group-rank order ((size * numel,), x's
    dtype), sent as an 8-bit payload in format `fmt`: each rank's values quantized once, by
    that rank. A lost peer raises PeerLostError."""
    g = resolve_group(group)
    with peers_guard("fusedist.fp8_all_gather", g):
        return _fp8_all_gather(x, g, block_size=block_size, fmt=fmt, check=check)


class Fp8Communicator:
    """A group's collectives with FP8 payloads: every all_reduce / all_gather of this object
    sends `fmt` bytes ("e3m4" or "e4m3") with per-block scales (block_size elements per
    scale). The group's ordinary Communicator stays exact; choose this object where FP8's
    error (module docstring) is acceptable."""

    def __init__(self, group: GroupLike = None, *, block_size: int = 128,
                 algo: str = "two_shot", fmt: str = "e3m4",
                 max_error: Optional[float] = ERROR_BOUND):
        self.group = resolve_group(group)
        self.max_error = _check_max_error("Fp8Communicator", max_error)
        self.last_path: Optional[str] = None     # the path of the last all_reduce
        self.block_size = _check_block("Fp8Communicator", block_size)
        self.fmt = _check_fmt("Fp8Communicator", fmt)
        if algo not in ALGOS:
            raise ValueError(f"fusedist.Fp8Communicator: algo must be one of {ALGOS}, got "
                             f"{algo!r}")
        self.algo = algo
        self.group.check_same({"block_size": str(self.block_size), "algo": algo, "fmt": fmt,
                               "max_error": repr(self.max_error)},
                              where="fusedist.Fp8Communicator", what="settings",
                              fix="pass the same block_size, algo, fmt and max_error on every "
                                  "rank")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        info: dict = {}
        y = fp8_all_reduce(x, self.group, block_size=self.block_size, algo=self.algo,
                           fmt=self.fmt, max_error=self.max_error, info=info)
        self.last_path = info.get("path")
        return y

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_all_gather(x, self.group, block_size=self.block_size, fmt=self.fmt)
