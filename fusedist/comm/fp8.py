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

The collectives run on torch.distributed (CPU with gloo, CUDA with NCCL). The codec is plain
torch on CPUs and, on CUDA tensors, the kernels of csrc/include/fusedist/comm/fp8_codec.cuh
when the extension is built (the plain-torch path otherwise, with a warning): the same bytes
and sums, bit for bit.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .. import _dtypes, _ext
from ..distributed.groups import Group
from ..errors import CollectiveMismatchError  # noqa: F401  (raised by Group.check_same)
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
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"fusedist.{where}: block_size must be a positive int (elements per "
                         f"fp32 scale), got {block_size!r}; 128 is a common choice")
    return block_size


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
    _check_block("fp8.quantize", block_size)
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
    group.check_same({"numel": str(x.numel()), "dtype": str(x.dtype),
                      "block_size": str(block_size), "algo": algo, "fmt": fmt},
                     where=f"fusedist.{where}", what="calls",
                     fix="every rank must make the same call (same size, dtype, block_size, "
                         "algo, fmt)")


def _fp8_all_reduce(x: torch.Tensor, group: GroupLike = None, *, block_size: int = 128,
                    algo: str = "two_shot", fmt: str = "e3m4", check: bool = True
                    ) -> torch.Tensor:
    g = resolve_group(group)
    check_input("fp8_all_reduce", x, g.device)
    _check_block("fp8_all_reduce", block_size)
    _check_fmt("fp8_all_reduce", fmt)
    if algo not in ALGOS:
        raise ValueError(f"fusedist.fp8_all_reduce: algo must be one of {ALGOS}, got {algo!r}")
    if check:
        _check_same(g, "fp8_all_reduce", x, block_size, algo, fmt)
    n, p = x.numel(), g.size
    if p == 1:
        q, s = quantize(x, block_size, fmt=fmt)
        return decode_sum(q[None], s[None], n, block_size, fmt=fmt).to(x.dtype).view_as(x)
    if algo == "one_shot":
        q, s = quantize(x, block_size, fmt=fmt)
        qs, ss = _gather(q, g), _gather(s, g)
        # rank order: the same sum on every rank
        return decode_sum(qs, ss, n, block_size, fmt=fmt).to(x.dtype).view_as(x)
    # two_shot: shards of whole blocks, the same count for every rank (padded with zeros).
    nblocks = -(-n // block_size)
    per = -(-nblocks // p)
    padded = torch.zeros(p * per * block_size, dtype=x.dtype, device=x.device)
    padded[:n] = x.reshape(-1)
    q, s = quantize(padded, block_size, fmt=fmt)
    q_in, s_in = torch.empty_like(q), torch.empty_like(s)
    dist.all_to_all_single(q_in, q, group=g.pg)      # shard r of every rank's payload -> r
    dist.all_to_all_single(s_in, s, group=g.pg)
    acc = decode_sum(q_in.view(p, -1), s_in.view(p, -1), per * block_size, block_size, fmt=fmt)
    q_sum, s_sum = quantize(acc, block_size, fmt=fmt)  # the second (and last) quantization
    qs, ss = _gather(q_sum, g), _gather(s_sum, g)
    return decode_sum(qs.reshape(1, -1), ss.reshape(1, -1), n, block_size,
                      fmt=fmt).to(x.dtype).view_as(x)


def _fp8_all_gather(x: torch.Tensor, group: GroupLike = None, *, block_size: int = 128,
                    fmt: str = "e3m4", check: bool = True) -> torch.Tensor:
    g = resolve_group(group)
    check_input("fp8_all_gather", x, g.device)
    _check_block("fp8_all_gather", block_size)
    _check_fmt("fp8_all_gather", fmt)
    if check:
        _check_same(g, "fp8_all_gather", x, block_size, "all_gather", fmt)
    n = x.numel()
    q, s = quantize(x, block_size, fmt=fmt)
    qs, ss = _gather(q, g), _gather(s, g)
    return torch.cat([decode_sum(qs[r][None], ss[r][None], n, block_size, fmt=fmt)
                      for r in range(g.size)]).to(x.dtype)


def fp8_all_reduce(x: torch.Tensor, group: GroupLike = None, *, block_size: int = 128,
                   algo: str = "two_shot", fmt: str = "e3m4", check: bool = True
                   ) -> torch.Tensor:
    """The sum of x over `group` (tensor-parallel group when None) with an 8-bit payload in
    format `fmt` ("e3m4" or "e4m3"); x's shape and dtype. check=False skips the call check
    (one small all-gather). A lost peer raises PeerLostError."""
    g = resolve_group(group)
    with peers_guard("fusedist.fp8_all_reduce", g):
        return _fp8_all_reduce(x, g, block_size=block_size, algo=algo, fmt=fmt, check=check)


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
                 algo: str = "two_shot", fmt: str = "e3m4"):
        self.group = resolve_group(group)
        self.block_size = _check_block("Fp8Communicator", block_size)
        self.fmt = _check_fmt("Fp8Communicator", fmt)
        if algo not in ALGOS:
            raise ValueError(f"fusedist.Fp8Communicator: algo must be one of {ALGOS}, got "
                             f"{algo!r}")
        self.algo = algo
        self.group.check_same({"block_size": str(block_size), "algo": algo, "fmt": fmt},
                              where="fusedist.Fp8Communicator", what="settings",
                              fix="pass the same block_size, algo and fmt on every rank")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_all_reduce(x, self.group, block_size=self.block_size, algo=self.algo,
                              fmt=self.fmt)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_all_gather(x, self.group, block_size=self.block_size, fmt=self.fmt)
