"""The overlap engine with the collective transport: the GEMM is cut into chunks on the
caller's stream while the chunks' collectives run on a high-priority communication stream,
ordered by events, no host sync, capturable in CUDA graphs, any world size, across nodes.
  ag_gemm: all-gather (NCCL) on the comm stream while the local shard's rows are multiplied;
           then the other ranks' rows, one GEMM per rank block.
  gemm_rs: GEMM chunk c (the same row slice of every rank's output block) -> NCCL
           reduce-scatter of chunk c on the comm stream while chunk c+1 is multiplied.
  gemm_ar: GEMM chunk c (rows, or columns when M is small) -> the communicator's all-reduce
           of chunk c on the comm stream while chunk c+1 is multiplied."""

from __future__ import annotations

from typing import Optional

import torch

from .base import Call, Engine, depth, fork, mm, split


class Overlap(Engine):
    name = "overlap"

    def why_not(self, call: Call) -> Optional[str]:
        if call.comm.device.type != "cuda" or call.comm.group.size < 2:
            return "the overlap engine needs CUDA tensors and a group of two or more"
        return None

    def run(self, call: Call) -> torch.Tensor:
        return {"ag_gemm": _ag, "gemm_rs": _rs, "gemm_ar": _ar}[call.op](call)


ENGINE = Overlap()


def _ag(call: Call) -> torch.Tensor:
    comm, x_shard, w, bias, out = call.comm, call.x, call.w, call.bias, call.out
    W, r = comm.group.size, comm.group.rank
    m, k = x_shard.shape
    gathered = torch.empty((W * m, k), dtype=x_shard.dtype, device=x_shard.device)
    main = torch.cuda.current_stream(x_shard.device)
    cs = fork(main)
    with torch.cuda.stream(cs):
        # beside the own rows' GEMM
        comm.check_nccl_call("all_gather", x_shard.dtype, x_shard.numel())
        comm.nccl_overlap.all_gather(x_shard, gathered)
        gathered_ev = torch.cuda.Event()
        gathered_ev.record(cs)
    x_shard.record_stream(cs)
    gathered.record_stream(cs)
    # Every rank multiplies every block with the same [m, K] x [K, N] shape, so cuBLAS takes
    # the same path everywhere and the output is bitwise identical across ranks.
    mm(x_shard, w, out[r * m:(r + 1) * m], bias)
    main.wait_event(gathered_ev)
    for d in range(1, W):
        j = (r + d) % W
        mm(gathered[j * m:(j + 1) * m], w, out[j * m:(j + 1) * m], bias)
    return out


def _rs(call: Call) -> torch.Tensor:
    comm, x, w_shard, bias, out = call.comm, call.x, call.w, call.bias, call.out
    W = comm.group.size
    M, k = x.shape
    n = w_shard.shape[1]
    m = M // W
    C = depth(call.op, call.chunks, comm, M, n, k, rows=m)
    bounds = split(m, C)
    xv = x.view(W, m, k)
    main = torch.cuda.current_stream(x.device)
    cs = fork(main)
    with torch.cuda.stream(cs):
        # One call check for the C reduce-scatters (the same sizes on every rank that agrees
        # on M, N and C), beside the first chunk's GEMM.
        comm.check_nccl_call("reduce_scatter", x.dtype, M * n, calls=C)
    for c in range(C):
        a, b = bounds[c], bounds[c + 1]
        # Rows a..b of every rank's block: one batched GEMM, [W, b-a, N] contiguous.
        part = torch.matmul(xv[:, a:b], w_shard)
        ev = torch.cuda.Event()
        ev.record(main)
        cs.wait_event(ev)
        with torch.cuda.stream(cs):
            comm.nccl_overlap.reduce_scatter(part.view(-1), out[a:b].view(-1))
        part.record_stream(cs)
    x.record_stream(cs)
    out.record_stream(cs)
    main.wait_stream(cs)
    return out.add_(bias) if bias is not None else out


def _ar(call: Call) -> torch.Tensor:
    comm, x, w_shard, bias, out = call.comm, call.x, call.w, call.bias, call.out
    M, k = x.shape
    n = w_shard.shape[1]
    C = depth(call.op, call.chunks, comm, M, n, k)
    main = torch.cuda.current_stream(x.device)
    cs = fork(main)
    by_rows = M >= 2 * C * 64
    if by_rows:
        C = max(1, min(C, M))
        bounds = split(M, C)
    else:  # decode-sized M: cut N into column blocks of whole 16-byte vectors
        C = max(1, min(C, n // 8))
        bounds = [(n * c // C) // 8 * 8 for c in range(C)] + [n]
    for c in range(C):
        a, b = bounds[c], bounds[c + 1]
        if by_rows:
            dst = out[a:b]
            torch.matmul(x[a:b], w_shard, out=dst)
        else:
            dst = torch.matmul(x, w_shard[:, a:b])  # [M, b-a] contiguous
        ev = torch.cuda.Event()
        ev.record(main)
        cs.wait_event(ev)
        with torch.cuda.stream(cs):
            comm.all_reduce(dst, out=dst)
            if not by_rows:
                out[:, a:b].copy_(dst)
        dst.record_stream(cs)
    out.record_stream(cs)
    x.record_stream(cs)
    main.wait_stream(cs)
    comm.clear_pending()  # the caller's stream now follows the comm stream
    return out.add_(bias) if bias is not None else out
