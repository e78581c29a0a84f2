"""FP8 communication: all-reduce and all-gather whose payload travels as e4m3 with one fp32
scale per block of `block_size` elements. Opt-in only: call these functions, or make an
:class:`Fp8Communicator` for a group; nothing else in fusedist sends FP8.

    y = fp8_all_reduce(x, block_size=128)           # this call only
    fc = Fp8Communicator(group, block_size=64)      # every call of this object
    y = fc.all_reduce(x); g = fc.all_gather(x)

Payload layout (what crosses the wire, per rank): the input flattened and zero-padded to a
multiple of block_size elements, then ``q``: one e4m3 byte per element (sent as uint8), and
``scales``: one fp32 per block, scale = amax(|block|) / 448 (1 for an all-zero block), q =
round-to-nearest-even(x / scale) in e4m3. Decoding multiplies back in fp32.

all_reduce algorithms (both accumulate in fp32 and give bitwise identical results on every
rank, since every sum is formed from the same bytes in the same rank order):
- "two_shot" (default): each rank quantizes its input once; an all-to-all sends block-shard
  r of every rank's payload to rank r; rank r decodes and sums its shard in rank order and
  quantizes the sum once; an all-gather of the summed shards; every rank decodes. Two
  quantizations in all (the inputs, the sums), never one per hop; (p-1)/p of the payload
  each way, as a ring reduce-scatter + all-gather.
- "one_shot": an all-gather of every rank's payload; every rank decodes and sums all of them
  in rank order. One quantization (the inputs), p - 1 payloads received per rank.

Error model (docs/scaling.md, tests/comm/test_fp8.py): e4m3 keeps 3 mantissa bits, so one
quantization of Gaussian data has a relative RMS error of ~2.6%, independent of the block
size (the per-block scale sets the exponent range, not the precision) and of the world
size (independent errors of p inputs grow as sqrt(p), as their sum does); two_shot's second
quantization brings it to ~3.7%. The per-block scales keep outlier channels (100x) from
flushing the rest of the data to zero: without them (one scale per tensor) values 2^17
below the largest become subnormal or zero.

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

E4M3_MAX = 448.0
ALGOS = ("two_shot", "one_shot")


def _check_block(where: str, block_size) -> int:
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"fusedist.{where}: block_size must be a positive int (elements per "
                         f"fp32 scale), got {block_size!r}; 128 is a common choice")
    return block_size


def _codec(t: torch.Tensor, use_kernel: Optional[bool]):
    """fusedist._C when the codec kernels should run on t (a CUDA tensor, the extension built
    with them; use_kernel=False forces the torch path), else None."""
    if use_kernel is False or t.device.type != "cuda":
        return None
    if not _ext.available() or not hasattr(_ext.load(), "fp8_encode"):
        if use_kernel:
            _ext.load()  # raises ExtensionMissingError with the build instructions
            raise RuntimeError("fusedist.fp8: this fusedist._C has no fp8_encode; rebuild it")
        _ext.warn_reference("fp8", "the extension with the FP8 codec is not built")
        return None
    return _ext.load()


def quantize(x: torch.Tensor, block_size: int = 128, *, use_kernel: Optional[bool] = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scales): x flattened, zero-padded to whole blocks, as e4m3 bytes (uint8, one per
    element) and one fp32 scale per block. CUDA tensors run the codec kernel
    (csrc/include/fusedist/comm/fp8_codec.cuh) when it is built; its bytes are this torch
    code's, bit for bit."""
    _check_block("fp8.quantize", block_size)
    numel = x.numel()
    nblocks = -(-numel // block_size)
    C = _codec(x, use_kernel)
    if C is not None and x.dtype in (torch.float32, torch.float16, torch.bfloat16):
        src = x.reshape(-1).contiguous()
        q = torch.empty(nblocks * block_size, dtype=torch.uint8, device=x.device)
        scales = torch.empty(nblocks, dtype=torch.float32, device=x.device)
        a = C.Fp8EncodeArgs()
        a.x, a.q, a.scales = src.data_ptr(), q.data_ptr(), scales.data_ptr()
        a.numel, a.block, a.dtype = numel, block_size, _dtypes.code(x.dtype)
        C.fp8_encode(a, torch.cuda.current_stream(x.device).cuda_stream)
        return q, scales
    flat = x.reshape(-1).to(torch.float32)
    padded = torch.zeros(nblocks * block_size, dtype=torch.float32, device=x.device)
    padded[:numel] = flat
    blocks = padded.view(nblocks, block_size)
    amax = blocks.abs().amax(dim=1)
    scales = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (blocks / scales[:, None]).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.view(torch.uint8).view(-1), scales


def dequantize(q: torch.Tensor, scales: torch.Tensor, numel: Optional[int] = None,
               block_size: int = 128) -> torch.Tensor:
    """fp32 values of a payload (the first `numel` elements; all when None)."""
    v = q.view(torch.float8_e4m3fn).to(torch.float32).view(-1, block_size) * scales[:, None]
    v = v.view(-1)
    return v if numel is None else v[:numel]


def decode_sum(qs: torch.Tensor, ss: torch.Tensor, numel: int, block_size: int, *,
               use_kernel: Optional[bool] = None) -> torch.Tensor:
    """The fp32 sum, in row order, of the payloads qs[r] (bytes) / ss[r] (scales): the first
    row's values, then each later row's added (one rounding per product and per sum), the
    first `numel` elements. CUDA tensors run the decode kernel when it is built."""
    qs, ss = qs.reshape(qs.shape[0], -1), ss.reshape(ss.shape[0], -1)
    C = _codec(qs, use_kernel)
    if C is not None:
        out = torch.empty(numel, dtype=torch.float32, device=qs.device)
        qs, ss = qs.contiguous(), ss.contiguous()
        a = C.Fp8DecodeSumArgs()
        a.q, a.scales, a.out = qs.data_ptr(), ss.data_ptr(), out.data_ptr()
        a.numel, a.q_stride, a.scale_stride = numel, qs.shape[1], ss.shape[1]
        a.block, a.payloads = block_size, qs.shape[0]
        C.fp8_decode_sum(a, torch.cuda.current_stream(qs.device).cuda_stream)
        return out
    acc = dequantize(qs[0], ss[0], None, block_size)
    for r in range(1, qs.shape[0]):
        acc = acc + dequantize(qs[r], ss[r], None, block_size)
    return acc[:numel]


def _gather(t: torch.Tensor, group: Group) -> torch.Tensor:
    out = torch.empty(group.size * t.numel(), dtype=t.dtype, device=t.device)
    dist.all_gather_into_tensor(out, t, group=group.pg)
    return out.view(group.size, -1)


def _check_same(group: Group, where: str, x: torch.Tensor, block_size: int, algo: str) -> None:
    group.check_same({"numel": str(x.numel()), "dtype": str(x.dtype),
                      "block_size": str(block_size), "algo": algo},
                     where=f"fusedist.{where}", what="calls",
                     fix="every rank must make the same call (same size, dtype, block_size, "
                         "algo)")


def _fp8_all_reduce(x: torch.Tensor, group: GroupLike = None, *, block_size: int = 128,
                    algo: str = "two_shot", check: bool = True) -> torch.Tensor:
    g = resolve_group(group)
    check_input("fp8_all_reduce", x, g.device)
    _check_block("fp8_all_reduce", block_size)
    if algo not in ALGOS:
        raise ValueError(f"fusedist.fp8_all_reduce: algo must be one of {ALGOS}, got {algo!r}")
    if check:
        _check_same(g, "fp8_all_reduce", x, block_size, algo)
    n, p = x.numel(), g.size
    if p == 1:
        q, s = quantize(x, block_size)
        return decode_sum(q[None], s[None], n, block_size).to(x.dtype).view_as(x)
    if algo == "one_shot":
        q, s = quantize(x, block_size)
        qs, ss = _gather(q, g), _gather(s, g)
        # rank order: the same sum on every rank
        return decode_sum(qs, ss, n, block_size).to(x.dtype).view_as(x)
    # two_shot: shards of whole blocks, the same count for every rank (padded with zeros).
    nblocks = -(-n // block_size)
    per = -(-nblocks // p)
    padded = torch.zeros(p * per * block_size, dtype=x.dtype, device=x.device)
    padded[:n] = x.reshape(-1)
    q, s = quantize(padded, block_size)
    q_in, s_in = torch.empty_like(q), torch.empty_like(s)
    dist.all_to_all_single(q_in, q, group=g.pg)      # shard r of every rank's payload -> r
    dist.all_to_all_single(s_in, s, group=g.pg)
    acc = decode_sum(q_in.view(p, -1), s_in.view(p, -1), per * block_size, block_size)
    q_sum, s_sum = quantize(acc, block_size)         # the second (and last) quantization
    qs, ss = _gather(q_sum, g), _gather(s_sum, g)
    return decode_sum(qs.reshape(1, -1), ss.reshape(1, -1), n, block_size).to(x.dtype).view_as(x)


def _fp8_all_gather(x: torch.Tensor, group: GroupLike = None, *, block_size: int = 128,
                    check: bool = True) -> torch.Tensor:
    g = resolve_group(group)
    check_input("fp8_all_gather", x, g.device)
    _check_block("fp8_all_gather", block_size)
    if check:
        _check_same(g, "fp8_all_gather", x, block_size, "all_gather")
    n = x.numel()
    q, s = quantize(x, block_size)
    qs, ss = _gather(q, g), _gather(s, g)
    return torch.cat([decode_sum(qs[r][None], ss[r][None], n, block_size)
                      for r in range(g.size)]).to(x.dtype)


def fp8_all_reduce(x: torch.Tensor, group: GroupLike = None, *, block_size: int = 128,
                   algo: str = "two_shot", check: bool = True) -> torch.Tensor:
    """The sum of x over `group` (tensor-parallel group when None) with an e4m3 payload;
    x's shape and dtype. check=False skips the call check (one small all-gather). A lost
    peer raises PeerLostError."""
    g = resolve_group(group)
    with peers_guard("fusedist.fp8_all_reduce", g):
        return _fp8_all_reduce(x, g, block_size=block_size, algo=algo, check=check)


def fp8_all_gather(x: torch.Tensor, group: GroupLike = None, *, block_size: int = 128,
                   check: bool = True) -> torch.Tensor:
    """Every rank's x, flattened and concatenated in group-rank order ((size * numel,), x's
    dtype), sent as an e4m3 payload: each rank's values quantized once, by that rank. A lost
    peer raises PeerLostError."""
    g = resolve_group(group)
    with peers_guard("fusedist.fp8_all_gather", g):
        return _fp8_all_gather(x, g, block_size=block_size, check=check)


class Fp8Communicator:
    """A group's collectives with FP8 payloads: every all_reduce / all_gather of this object
    sends e4m3 with per-block scales (block_size elements per scale). The group's ordinary
    Communicator stays exact; choose this object where FP8's error (module docstring) is
    acceptable."""

    def __init__(self, group: GroupLike = None, *, block_size: int = 128,
                 algo: str = "two_shot"):
        self.group = resolve_group(group)
        self.block_size = _check_block("Fp8Communicator", block_size)
        if algo not in ALGOS:
            raise ValueError(f"fusedist.Fp8Communicator: algo must be one of {ALGOS}, got "
                             f"{algo!r}")
        self.algo = algo
        self.group.check_same({"block_size": str(block_size), "algo": algo},
                              where="fusedist.Fp8Communicator", what="settings",
                              fix="pass the same block_size and algo on every rank")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_all_reduce(x, self.group, block_size=self.block_size, algo=self.algo)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_all_gather(x, self.group, block_size=self.block_size)
