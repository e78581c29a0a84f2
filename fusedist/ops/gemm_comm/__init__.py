"""GEMM + collective for tensor-parallel linears.

    y = fusedist.ag_gemm(x_shard, w)     # all_gather(x_shard, rows) @ w     column-parallel,
                                         #                                   sequence-parallel in
    y = fusedist.gemm_rs(x, w_shard)     # reduce_scatter(x @ w_shard, rows) row-parallel, SP out
    y = fusedist.gemm_ar(x, w_shard)     # all_reduce(x @ w_shard)           row-parallel

w is [K, N] (pass linear.weight.t() for a [N, K] nn.Linear weight); bias [N] is added once,
after the collective. Engines (engine=):
  * "unfused": the collective and one cuBLAS GEMM (torch.matmul), back to back.
  * "overlap": the stream-overlapped decomposition: the GEMM is cut into chunks on the
    caller's stream while the chunks' collectives run on a high-priority communication stream,
    ordered by events, no host sync, capturable in CUDA graphs, any world size, across nodes.
      ag_gemm: all-gather on the comm stream while the local shard's rows are multiplied; then
               the other ranks' rows, one GEMM per rank block.
      gemm_rs: GEMM chunk c (the same row slice of every rank's output block) -> reduce-scatter
               of chunk c on the comm stream while chunk c+1 is multiplied.
      gemm_ar: GEMM chunk c (rows, or columns when M is small) -> fusedist all_reduce of chunk c
               on the comm stream while chunk c+1 is multiplied.
    With Communicator(staging_bytes=...) large enough, transport="copy_engine" (auto picks it)
    moves the data with cudaMemcpyAsync between the ranks' symmetric staging (no SMs), device
    barriers on the comm stream:
      ag_gemm: stage the shard, pull the peers' shards while the own rows are multiplied.
      gemm_rs: per chunk, the partials for the other blocks go to staging, the owner pulls them
               into out and multiplies its own rows on top (addmm, beta = 1: no add kernel).
      gemm_ar: gemm_rs's pipeline over row sub-blocks, then every rank pulls the reduced
               sub-blocks (bitwise the same output everywhere).
  * "fused" (gemm_ar, M <= 128): one CUDA kernel (csrc/include/fusedist/gemm/gemm_comm.cuh) streams
    the weight through a TMA ring into tensor-core MMAs, 64 output columns per block, and
    each block exchanges its finished strip with the peers through the communicator's symmetric
    buffers (one-shot protocol) while other blocks still stream weights. bf16/fp16, N and K
    multiples of 8, w as [K, N] or as the .t() of an [N, K] nn.Linear weight; NVLink peers only.
  * "fused" (ag_gemm, Hopper): one persistent wgmma GEMM (csrc/include/fusedist/gemm/gemm_sm90.cuh)
    over the gathered input in symmetric staging (staging_bytes >= world x shard) while the
    copy engine pulls the peers' blocks; each tile waits for the flags of the rows it reads
    (chunks= copy pieces per block). Level with the overlap engines on 2x H200, so "auto"
    does not pick it.
  * "fused" (gemm_rs, Hopper): the same GEMM over the other ranks' blocks into symmetric
    staging (staging_bytes >= M x N), each stored tile counted on its owner; the owner's comm
    stream pulls finished pieces (chunks= pieces per block) and its own block's GEMM takes them
    as C, waiting per tile in the C-load warp. 0.81-0.99x of the copy-engine overlap on
    2x H200, so "auto" does not pick it.
  * "hierarchical": the two-level form, for groups that span nodes (the same number, two or
    more, of their ranks on each; fusedist.comm.hierarchical), on torch.distributed:
      gemm_ar: the GEMM in row chunks; chunk c's all-reduce (reduce-scatter inside the node,
               all-reduce across, all-gather inside) runs while chunk c+1 is multiplied.
      gemm_rs: the GEMM in row chunks of every block, in the two-level order; chunk c is
               reduce-scattered inside the node, then across, while chunk c+1 is multiplied.
      ag_gemm: the shard gathered across nodes while the own rows are multiplied, then inside
               the node while the counterparts' rows are; then the rest.
    chunks= the row chunks (default: the cost model's for the collective, or the
    HierarchicalCommunicator's when group= is one); flat vs two-level by the cost model.
  * "auto": the table in tuning.py (FUSEDIST_GEMM_ENGINE overrides; "fused" there applies where
    the fused kernel takes the call and falls back to the table elsewhere); on a group that
    spans nodes the hierarchical engine, unless every rank is an NVLink peer (symmetric
    memory over the group: nodes emulated on one host), where the one-level table decides.
Each engine is one unit in fusedist/ops/gemm_comm/ (a gate, why_not(call), and a run path);
fusedist.ops.gemm_comm.dispatch.choose is the dispatcher. This module holds the public functions
(validation, the empty batch, torch.compile) and their torch.library registrations.
Transports (transport=, the same names for every op): "collective" (the op's collective on the
communicator; "nccl" names it for ag_gemm and gemm_rs, whose collective is NCCL's),
"copy_engine", or "auto" (the copy engine when the staging fits).
An empty batch (M = 0, so on every rank: the ops need the same shapes on every rank) returns
the empty output without a collective on every rank alike.
Prefill gemm_ar has no fused engine; docs/design/gemm_comm.md has the engines and what is
measured.
CPU tensors (gloo) take the plain-torch reference path (the hierarchical engine on groups that
span nodes, unless engine="unfused").
group= also takes a fusedist.HierarchicalCommunicator: the hierarchical engine with its algo and
chunks.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from ... import tuning
from ...comm.hierarchical import HierarchicalCommunicator
from ...comm.hierarchical import resolve as resolve_two_level
from ...comm.communicator import Communicator, GroupLike, communicator_by_name, get_communicator
from ...comm.streams import nvtx_range
from . import dispatch
from .dispatch import ENGINES, UNITS, choose, fused_unit, pick  # noqa: F401 (the dispatcher)
from .base import (TRANSPORT_ALIASES, TRANSPORTS, Call, resolve_transport,
                                 staging_need)

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# ag_gemm's and gemm_rs's collective is NCCL's, so "nccl" names it there too.
_COLLECTIVE_NAMES = {"ag_gemm": TRANSPORTS + tuple(TRANSPORT_ALIASES), "gemm_rs":
                     TRANSPORTS + tuple(TRANSPORT_ALIASES), "gemm_ar": TRANSPORTS}


def _validate(op: str, comm: Communicator, x, w, bias, x_name: str, w_name: str):
    comm.check_open()
    comm.check_tensor(op, x_name, x, DTYPES)
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"fusedist.{op}: {w_name} must be a torch.Tensor, got {type(w).__name__}")
    if w.device != x.device or w.dtype != x.dtype:
        raise ValueError(f"fusedist.{op}: {w_name} is {w.dtype} on {w.device}, {x_name} is "
                         f"{x.dtype} on {x.device}; they must match")
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[0]:
        raise ValueError(f"fusedist.{op}: expected {x_name} [M, K] and {w_name} [K, N], got "
                         f"{tuple(x.shape)} and {tuple(w.shape)} (for an nn.Linear weight [N, K] "
                         "pass weight.t())")
    if bias is not None and (not isinstance(bias, torch.Tensor) or bias.shape != (w.shape[1],)
                             or bias.dtype != x.dtype or bias.device != x.device):
        raise ValueError(f"fusedist.{op}: bias must be a [{w.shape[1]}] tensor of {x.dtype} on "
                         f"{x.device}, got {getattr(bias, 'shape', type(bias).__name__)}")


def _out(op, out, shape, like):
    if out is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(shape) or \
            out.dtype != like.dtype or out.device != like.device or not out.is_contiguous():
        raise ValueError(f"fusedist.{op}: out must be a contiguous {tuple(shape)} tensor of "
                         f"{like.dtype} on {like.device}")
    return out


def _run(op: str, comm: Communicator, x, w, bias, out, engine: str, transport: str,
         chunks, hier=None) -> torch.Tensor:
    """Validated arguments -> the dispatcher's unit runs the call."""
    if engine not in ("auto",) + ENGINES:
        raise ValueError(f"fusedist.{op}: engine must be 'auto' or one of {ENGINES}, got "
                         f"{engine!r}")
    how = "collective"
    if comm.device.type == "cuda" and comm.group.size > 1:
        how = resolve_transport(op, comm, staging_need(op, x, w.shape[1]), transport)
    call = Call(op, comm, x, w, bias, out, chunks, how, hier)
    unit = dispatch.choose(call, engine)
    with nvtx_range(f"fusedist.{op}.{unit.name}"):
        return unit.run(call)


def _resolve(op: str, group):
    """(communicator, two-level communicator or None) of an op's group=."""
    return resolve_two_level(group)


def _compile_comm(op: str, group) -> Communicator:
    """The communicator an op carries by name under torch.compile: a HierarchicalCommunicator
    cannot pass (the op resolves the group's own two-level one when it runs)."""
    if isinstance(group, HierarchicalCommunicator):
        raise ValueError(f"fusedist.{op}: group= a HierarchicalCommunicator does not pass "
                         "through torch.compile (ops carry a communicator's name); pass its "
                         "group: a group that spans nodes takes the hierarchical engine by itself")
    return get_communicator(group)


def _check_transport(op: str, transport: str) -> None:
    if transport not in _COLLECTIVE_NAMES[op]:
        raise ValueError(f"fusedist.{op}: transport must be one of {_COLLECTIVE_NAMES[op]}, got "
                         f"{transport!r}")


def ag_gemm(x_shard: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
            group: GroupLike = None, engine: str = "auto", out: Optional[torch.Tensor] = None,
            transport: str = "auto", chunks: Optional[int] = None) -> torch.Tensor:
    """all_gather(x_shard over the group, along rows) @ w (+ bias). x_shard [m, K] on every rank
    (the same m everywhere), w [K, N]; returns [world * m, N], bitwise the same on every rank.
    transport (overlap engine): "auto" (copy engine when the communicator has staging_bytes
    for the shard, else NCCL), "collective" (= "nccl") or "copy_engine". chunks (fused
    engine): copy pieces per rank block, each flagged as it lands (default 1)."""
    if _compiling():
        return _compiled(torch.ops.fusedist.ag_gemm, x_shard, w, bias,
                         _compile_comm("ag_gemm", group), engine, transport, chunks, out)
    op = "ag_gemm"
    _check_transport(op, transport)
    comm, hier = _resolve(op, group)
    _validate(op, comm, x_shard, w, bias, "x_shard", "w")
    out = _out(op, out, (comm.group.size * x_shard.shape[0], w.shape[1]), x_shard)
    if out.numel() == 0:
        return out  # every rank's shard has the same shape: every rank skips the collective
    return _run(op, comm, x_shard, w, bias, out, engine, transport, chunks, hier)


def gemm_rs(x: torch.Tensor, w_shard: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
            group: GroupLike = None, engine: str = "auto",
            chunks: Union[int, Sequence[int], None] = None,
            out: Optional[torch.Tensor] = None, transport: str = "auto") -> torch.Tensor:
    """reduce_scatter(x @ w_shard, rows) (+ bias): x [M, K_local], w_shard [K_local, N], M a
    multiple of the world size (the same M on every rank); returns this rank's [M / world, N]
    block of the sum. transport (overlap engine): "auto" (copy engine when the communicator
    has staging_bytes >= M * N * itemsize, else NCCL), "collective" (= "nccl") or
    "copy_engine". chunks: pipeline depth of the overlap engine (default from the tuning
    table: "chunks" for NCCL, "ce_chunks" for the copy engine, whose chunks the table's wave
    model may cut unevenly), or pieces per block of the fused engine (default one per 2048
    rows, at most MAX_SIGNAL_PIECES). The copy-engine overlap also takes a list of row counts
    summing to M / world: the chunks' rows, as given."""
    if _compiling():
        return _compiled(torch.ops.fusedist.gemm_rs, x, w_shard, bias,
                         _compile_comm("gemm_rs", group), engine, transport, chunks, out)
    op = "gemm_rs"
    _check_transport(op, transport)
    comm, hier = _resolve(op, group)
    _validate(op, comm, x, w_shard, bias, "x", "w_shard")
    W = comm.group.size
    M = x.shape[0]
    if M % W:
        raise ValueError(f"fusedist.gemm_rs: x has {M} rows, not a multiple of the world size "
                         f"{W}; pad M to a multiple of {W}")
    out = _out(op, out, (M // W, w_shard.shape[1]), x)
    if out.numel() == 0:
        return out  # M (and N) are the same on every rank: every rank skips the collective
    return _run(op, comm, x, w_shard, bias, out, engine, transport, chunks, hier)


def gemm_ar(x: torch.Tensor, w_shard: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
            group: GroupLike = None, engine: str = "auto",
            chunks: Union[int, Sequence[int], None] = None,
            out: Optional[torch.Tensor] = None, transport: str = "auto") -> torch.Tensor:
    """all_reduce(x @ w_shard) (+ bias): x [M, K_local] (the same M on every rank), w_shard
    [K_local, N]; returns [M, N], bitwise the same on every rank. transport (overlap engine):
    "collective" (each chunk all-reduced by the communicator: fusedist's symmetric kernels or
    NCCL by size), "copy_engine" (per chunk a copy-engine reduce-scatter, the reduction folded
    into the own rows' GEMM, and a copy-engine all-gather; needs staging_bytes >= M * N *
    itemsize), or "auto" (the copy engine when the staging fits). chunks: pipeline depth
    (default from the tuning table); the copy-engine transport also takes a list of row counts
    summing to M."""
    if _compiling():
        return _compiled(torch.ops.fusedist.gemm_ar, x, w_shard, bias,
                         _compile_comm("gemm_ar", group), engine, transport, chunks, out)
    op = "gemm_ar"
    _check_transport(op, transport)
    comm, hier = _resolve(op, group)
    _validate(op, comm, x, w_shard, bias, "x", "w_shard")
    out = _out(op, out, (x.shape[0], w_shard.shape[1]), x)
    if out.numel() == 0:
        return out  # M (and N) are the same on every rank: every rank skips the collective
    return _run(op, comm, x, w_shard, bias, out, engine, transport, chunks, hier)


# ---- torch.compile: torch.library registrations ------------------------------------------
# Under torch.compile the public functions call these ops (dynamo cannot trace a
# Communicator): the communicator travels by name, chunks as a depth (0: the table's) or a
# list of row counts, out= by a copy into it (the op itself is functional).
def _compiling() -> bool:
    return hasattr(torch, "compiler") and torch.compiler.is_compiling()


def _chunks_args(chunks) -> tuple:
    if chunks is None:
        return 0, None
    if isinstance(chunks, (list, tuple)):
        return 0, [int(c) for c in chunks]
    return int(chunks), None


def _chunks_of(chunks: int, chunk_rows: Optional[list]):
    return list(chunk_rows) if chunk_rows is not None else (chunks or None)


def _compiled(op, x, w, bias, comm, engine, transport, chunks, out):
    depth, rows = _chunks_args(chunks)
    y = op(x, w, comm.name, engine, bias, transport, depth, rows)
    return y if out is None else out.copy_(y)


@torch.library.custom_op("fusedist::ag_gemm", mutates_args=())
def _ag_gemm_op(x_shard: torch.Tensor, w: torch.Tensor, comm_name: str, engine: str = "auto",
                bias: Optional[torch.Tensor] = None, transport: str = "auto", chunks: int = 0,
                chunk_rows: Optional[list[int]] = None) -> torch.Tensor:
    return ag_gemm(x_shard, w, bias, group=communicator_by_name(comm_name), engine=engine,
                   transport=transport, chunks=_chunks_of(chunks, chunk_rows))


@_ag_gemm_op.register_fake
def _(x_shard, w, comm_name, engine="auto", bias=None, transport="auto", chunks=0,
      chunk_rows=None):
    W = communicator_by_name(comm_name).group.size
    return x_shard.new_empty((W * x_shard.shape[0], w.shape[1]))


@torch.library.custom_op("fusedist::gemm_rs", mutates_args=())
def _gemm_rs_op(x: torch.Tensor, w_shard: torch.Tensor, comm_name: str, engine: str = "auto",
                bias: Optional[torch.Tensor] = None, transport: str = "auto", chunks: int = 0,
                chunk_rows: Optional[list[int]] = None) -> torch.Tensor:
    return gemm_rs(x, w_shard, bias, group=communicator_by_name(comm_name), engine=engine,
                   transport=transport, chunks=_chunks_of(chunks, chunk_rows))


@_gemm_rs_op.register_fake
def _(x, w_shard, comm_name, engine="auto", bias=None, transport="auto", chunks=0,
      chunk_rows=None):
    W = communicator_by_name(comm_name).group.size
    return x.new_empty((x.shape[0] // W, w_shard.shape[1]))


@torch.library.custom_op("fusedist::gemm_ar", mutates_args=())
def _gemm_ar_op(x: torch.Tensor, w_shard: torch.Tensor, comm_name: str, engine: str = "auto",
                bias: Optional[torch.Tensor] = None, transport: str = "auto", chunks: int = 0,
                chunk_rows: Optional[list[int]] = None) -> torch.Tensor:
    return gemm_ar(x, w_shard, bias, group=communicator_by_name(comm_name), engine=engine,
                   transport=transport, chunks=_chunks_of(chunks, chunk_rows))


@_gemm_ar_op.register_fake
def _(x, w_shard, comm_name, engine="auto", bias=None, transport="auto", chunks=0,
      chunk_rows=None):
    return x.new_empty((x.shape[0], w_shard.shape[1]))
