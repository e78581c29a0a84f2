"""What the GEMM + collective engines share: the call they take, the engine interface, the
transport choice and the pipeline's chunking. Everything here depends only on shapes, dtypes,
sizes and rank 0's tuning table, which SPMD code keeps identical on every rank, so every rank
picks the same engine, transport and chunks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ... import _dtypes, tuning
from ...comm import symmetric
from ...comm.communicator import Communicator
from ...comm.hierarchical import HierarchicalCommunicator
from ...comm.streams import comm_stream
from ..gemm import FUSED_DTYPES, weight_layout

# The transports of the overlap engine, the same names for every op: "collective" (the op's
# collective on the communicator: NCCL's all-gather / reduce-scatter, the communicator's
# all-reduce) or "copy_engine" (cudaMemcpyAsync between the ranks' symmetric staging: no SMs).
TRANSPORTS = ("auto", "collective", "copy_engine")
# ag_gemm's and gemm_rs's collective is NCCL's: "nccl" names it too.
TRANSPORT_ALIASES = {"nccl": "collective"}


@dataclass
class Call:
    """One call of a GEMM + collective op, validated. x is ag_gemm's shard [m, K] or the
    [M, K] input of gemm_rs / gemm_ar; out is allocated and non-empty."""
    op: str
    comm: Communicator
    x: torch.Tensor
    w: torch.Tensor
    bias: Optional[torch.Tensor]
    out: torch.Tensor
    chunks: object = None      # as the caller passed it: None, an int or row counts
    transport: str = "auto"    # the resolved transport: "collective" or "copy_engine"
    # The group's two-level communicator (fusedist.comm.hierarchical) when it spans nodes (or
    # the caller's, passed as group=), else None.
    hier: Optional[HierarchicalCommunicator] = None

    @property
    def world(self) -> int:
        return self.comm.group.size

    @property
    def rows(self) -> int:
        """M: the rows of the whole GEMM (ag_gemm: world x the shard's)."""
        return self.x.shape[0] * (self.world if self.op == "ag_gemm" else 1)

    @property
    def n(self) -> int:
        return self.w.shape[1]

    @property
    def k(self) -> int:
        return self.x.shape[1]


class Engine:
    """An engine: why_not(call) is None when it can take the call, else the reason (the same
    on every rank); run(call) computes call.out and returns it."""
    name = ""

    def why_not(self, call: Call) -> Optional[str]:
        return None

    def run(self, call: Call) -> torch.Tensor:
        raise NotImplementedError


_DESC_ENGINES = {"copy_engine": symmetric.DESC_ENGINE_COPY_ENGINE,
                 "fused": symmetric.DESC_ENGINE_FUSED}


def call_desc(op: str, dtype: torch.dtype, engine: str, chunks: int, m: int, n: int,
              k: int) -> tuple:
    """The call descriptor the call checks of a GEMM + collective call carry
    (symmetric.gemm_desc: what every rank must agree on). engine: "copy_engine" or "fused";
    chunks: the pipeline's chunks or pieces; m: the GEMM's rows (ag_gemm: world x shard)."""
    return symmetric.gemm_desc(op, _dtypes.code(dtype), _DESC_ENGINES[engine], chunks, m, n, k)


def staging_need(op: str, x: torch.Tensor, n: int) -> int:
    """Bytes of symmetric staging the copy-engine transport needs: ag_gemm's shard, gemm_rs's
    and gemm_ar's [M, N] partials."""
    if op == "ag_gemm":
        return x.numel() * x.element_size()
    return x.shape[0] * n * x.element_size()


def resolve_transport(op: str, comm: Communicator, need: int, transport: str) -> str:
    """How the overlap engine moves data: "copy_engine" when asked or (auto) when the
    communicator has `need` bytes of staging, else "collective"."""
    transport = TRANSPORT_ALIASES.get(transport, transport)
    fits = comm.symm is not None and comm.symm.staging_bytes >= need
    if transport == "copy_engine" and not fits:
        have = 0 if comm.symm is None else comm.symm.staging_bytes
        raise ValueError(f"fusedist.{op}: transport='copy_engine' needs {need} bytes of "
                         f"symmetric staging, the communicator has {have}; create "
                         f"fusedist.Communicator(staging_bytes>={need}) (NVLink peers only) or "
                         "use transport='auto'")
    if transport == "auto":
        return "copy_engine" if fits else "collective"
    return transport


def fused_common_why_not(comm: Communicator, x: torch.Tensor, w: torch.Tensor) -> Optional[str]:
    """What every fused kernel needs: symmetric memory, bf16/fp16, N and K multiples of 8, a
    [K, N] or nn.Linear-.t() weight, a non-empty problem."""
    if comm.device.type != "cuda" or comm.symm is None:
        return (f"group {comm.group.name} has no symmetric memory (CPU, size 1, no peer "
                "access, or symmetric=False)")
    if x.dtype not in FUSED_DTYPES:
        return f"dtype {x.dtype} (the fused kernels take bfloat16 or float16)"
    K, N = w.shape
    if N % 8 or K % 8:
        return f"N = {N} and K = {K} must be multiples of 8"
    if x.shape[0] == 0 or K == 0 or N == 0:
        return f"an empty problem (x {tuple(x.shape)}, w {tuple(w.shape)})"
    if weight_layout(w) is None:
        return (f"w has strides {tuple(w.stride())}; it must be a row-major [K, N] tensor or the "
                ".t() of a row-major [N, K] one (call .contiguous())")
    return None


split = tuning.even_bounds


def depth(op: str, chunks, comm: Communicator, m: int, n: int, k: int,
            copy_engine: bool = False, rows: Optional[int] = None) -> int:
    """The pipeline depth: `chunks`, or the tuning table's; at most `rows` (the rows a chunk
    cuts) when given, at least 1."""
    if chunks is None:
        chunks = tuning.gemm_chunks(comm.table, op, m, n, k, comm.group.size, copy_engine)
    elif isinstance(chunks, (list, tuple)):
        raise ValueError(f"fusedist.{op}: chunks as a list of row counts applies to the "
                         "copy-engine overlap only (engine='overlap', transport='copy_engine'); "
                         f"pass a positive int here, got {chunks!r}")
    elif not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
        raise ValueError(f"fusedist.{op}: chunks must be a positive int, got {chunks!r}")
    return chunks if rows is None else max(1, min(chunks, rows))


def row_bounds(op: str, chunks, comm: Communicator, m: int, n: int, k: int, rows: int,
               what: str, wave_cols: Optional[int] = None) -> list:
    """Row bounds of a copy-engine pipeline's chunks over `rows` rows (`what` names them for
    errors). chunks: a list of row counts summing to `rows`, taken as given; else the depth
    from `depth`, cut evenly, or (wave_cols: the columns of every piece's output) by the
    table's wave model (tuning.wave_row_bounds). Shapes and rank 0's table only: the same
    bounds on every rank, as the exchange needs."""
    if isinstance(chunks, (list, tuple)):
        sizes = list(chunks)
        if not sizes or sum(sizes) != rows or any(
                not isinstance(s, int) or isinstance(s, bool) or s < 1 for s in sizes):
            raise ValueError(f"fusedist.{op}: chunks as row counts must be positive ints that "
                             f"sum to {what} ({rows}), got {chunks!r}")
        return [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    C = depth(op, chunks, comm, m, n, k, copy_engine=True, rows=rows)
    if wave_cols is None:
        return split(rows, C)
    return tuning.wave_row_bounds(rows, wave_cols, C, tuning.gemm_waves(comm.table))


def mm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, bias=None) -> torch.Tensor:
    if bias is None:
        return torch.matmul(a, b, out=out)
    return torch.addmm(bias, a, b, out=out)


def fork(stream: torch.cuda.Stream) -> torch.cuda.Stream:
    """The pool's communication stream, ordered after everything queued on `stream`."""
    cs = comm_stream(stream.device)
    cs.wait_stream(stream)
    return cs
