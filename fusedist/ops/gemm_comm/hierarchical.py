"""The hierarchical engine: the GEMM + collective ops on a group that spans nodes, through its
two-level communicator (fusedist.comm.hierarchical, on torch.distributed: NCCL on GPUs, gloo
on CPUs), the collective's levels pipelined with the GEMM's chunks:
  gemm_ar: the GEMM in row chunks into fp32 buffers; chunk c is reduce-scattered inside the
           node, all-reduced across and all-gathered inside while chunk c+1 is multiplied
           (HierarchicalCommunicator.all_reduce_pipelined); each chunk is rounded into out
           once gathered. Bitwise the same on every rank.
  gemm_rs: the GEMM in row chunks of every rank's block, the blocks in the two-level order
           (local index major); chunk c is reduce-scattered inside the node while chunk c+1 is
           multiplied, then across (reduce_scatter_pipelined).
  ag_gemm: the shard gathered across nodes while the own rows are multiplied, then inside the
           node while the counterparts' rows from the other nodes are, then the rest
           (all_gather_stages). Every rank multiplies every block with the same [m, K] x
           [K, N] shape: bitwise the same on every rank.
Chunks: call.chunks, else the communicator's, else the cost model's for the collective (the
model does not price the GEMM). Where the model (or the communicator's algo) finds the flat
collective faster for the size: the GEMM, then the flat collective over the group. CPU tensors
multiply in fp32 (the reference path's arithmetic), CUDA tensors in their dtype; the sums
accumulate in the communicator's accum_dtype and round once."""

from __future__ import annotations

from typing import Optional

import torch

from ... import tuning
from ...comm.hierarchical import layout
from .base import Call, Engine, mm


class Hierarchical(Engine):
    name = "hierarchical"

    def why_not(self, call: Call) -> Optional[str]:
        if call.hier is None:
            return f"it runs on groups that span nodes, and {layout(call.comm.group)[1]}"
        if isinstance(call.chunks, (list, tuple)):
            return ("chunks as a list of row counts applies to the copy-engine overlap only; "
                    "pass the number of row chunks")
        if call.transport == "copy_engine":
            return ("transport='copy_engine' moves data between NVLink peers' staging; the "
                    "two-level collectives run on torch.distributed (transport='auto')")
        return None

    def run(self, call: Call) -> torch.Tensor:
        if call.comm.device.type == "cpu":
            # gloo aborts the process on a size mismatch: name the ranks' calls first, as the
            # CPU path's collectives do (Communicator.check_same_call).
            what = {"ag_gemm": ("all_gather", call.x), "gemm_rs": ("reduce_scatter", call.out),
                    "gemm_ar": ("all_reduce", call.out)}[call.op]
            call.comm.check_same_call(*what)
        out = {"ag_gemm": _ag, "gemm_rs": _rs, "gemm_ar": _ar}[call.op](call)
        if call.bias is not None and call.op != "ag_gemm":
            out.add_(call.bias)
        return out


ENGINE = Hierarchical()


def _partial(a: torch.Tensor, w: torch.Tensor, dst: torch.Tensor) -> None:
    """dst (an accumulation buffer's view) = a @ w: fp32 operands on CPUs, the input dtype on
    GPUs (cuBLAS accumulates in fp32 and rounds once)."""
    if a.device.type == "cpu":
        dst.copy_(torch.matmul(a.float(), w.float()))
    else:
        dst.copy_(torch.matmul(a, w))


def _depth(call: Call, op: str, nbytes: int) -> tuple[str, int]:
    """(flat or hierarchical, chunks) for the call's collective."""
    return call.hier.choose(op, nbytes, None, call.chunks)


def _ar(call: Call) -> torch.Tensor:
    hc, x, w, out = call.hier, call.x, call.w, call.out
    M, N = out.shape
    how, k = _depth(call, "all_reduce", M * N * out.element_size())
    if how == "flat":
        acc = torch.empty((M, N), dtype=hc.accum_dtype, device=x.device)
        _partial(x, w, acc)
        return out.copy_(hc.all_reduce(acc, algo="flat", out=acc))
    bounds = tuning.even_bounds(M, max(1, min(k, M)))
    chunks = [hc.chunk_buffer((bounds[c + 1] - bounds[c]) * N, x.device)
              for c in range(len(bounds) - 1)]

    def rows(c):
        a, b = bounds[c], bounds[c + 1]
        return a, b, chunks[c][:(b - a) * N].view(b - a, N)

    def produce(c):
        a, b, buf = rows(c)
        _partial(x[a:b], w, buf)

    def consume(c):
        a, b, buf = rows(c)
        out[a:b].copy_(buf)

    hc.all_reduce_pipelined(chunks, produce, consume)
    return out


def _rs(call: Call) -> torch.Tensor:
    hc, x, w, out = call.hier, call.x, call.w, call.out
    W = call.world
    M, K = x.shape
    m, N = out.shape
    how, k = _depth(call, "reduce_scatter", M * N * out.element_size())
    xv = x.view(W, m, K)
    mine = torch.empty(m * N, dtype=hc.accum_dtype, device=x.device)
    if how == "flat":
        part = torch.empty((M, N), dtype=hc.accum_dtype, device=x.device)
        _partial(x, w, part)
        hc.reduce_scatter(part.view(-1), algo="flat", out=mine)
        return out.copy_(mine.view(m, N))
    G, Nn = hc.gpus, hc.nodes
    order = hc.local_major(x.device)          # block of group rank rank_at[j][l] at l * N + j
    bounds = tuning.even_bounds(m, max(1, min(k, m)))

    def produce(c):
        a, b = bounds[c], bounds[c + 1]
        part = torch.empty((W, b - a, N), dtype=hc.accum_dtype, device=x.device)
        _partial(xv[order, a:b], w, part)     # one batched GEMM over the W blocks' rows
        return part.view(G, Nn, (b - a) * N)

    hc.reduce_scatter_pipelined([r * N for r in bounds], produce, mine)
    return out.copy_(mine.view(m, N))


def _ag(call: Call) -> torch.Tensor:
    hc, x, w, bias, out = call.hier, call.x, call.w, call.bias, call.out
    m = x.shape[0]
    for ranks, blocks in hc.all_gather_stages(x):
        for r, blk in zip(ranks, blocks):
            dst = out[r * m:(r + 1) * m]
            if x.device.type == "cpu":
                y = torch.matmul(blk.float(), w.float())
                dst.copy_(y if bias is None else y + bias.float())
            else:
                mm(blk, w, dst, bias)
    return out
