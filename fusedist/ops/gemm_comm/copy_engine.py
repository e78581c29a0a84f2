"""The overlap engine with the copy-engine transport: the data moves with cudaMemcpyAsync
between the ranks' symmetric staging (Communicator(staging_bytes=...), NVLink peers), device
barriers on the communication stream, no SMs spent on the transfers.
  ag_gemm: stage the shard, pull the peers' shards while the own rows are multiplied.
  gemm_rs: per chunk, the partials for the other blocks go to staging, the owner pulls them
           into out and multiplies its own rows on top (addmm, beta = 1: no add kernel).
  gemm_ar: gemm_rs's pipeline over row sub-blocks, then every rank pulls the reduced
           sub-blocks (bitwise the same output everywhere)."""

from __future__ import annotations

from typing import Optional

import torch

from ... import _align, _ext
from ...comm.communicator import Communicator
from ...comm.streams import comm_stream
from .base import Call, Engine, call_desc, fork, mm, row_bounds, split, staging_need


class CopyEngine(Engine):
    name = "copy_engine"

    def why_not(self, call: Call) -> Optional[str]:
        comm = call.comm
        if comm.device.type != "cuda" or comm.group.size < 2:
            return "the copy engine moves data between GPUs"
        need = staging_need(call.op, call.x, call.n)
        have = 0 if comm.symm is None else comm.symm.staging_bytes
        if have < need:
            return (f"it needs {need} bytes of symmetric staging, the communicator has {have}; "
                    f"create fusedist.Communicator(staging_bytes>={need})")
        return None

    def run(self, call: Call) -> torch.Tensor:
        comm, x, w, bias, out = call.comm, call.x, call.w, call.bias, call.out
        M, n, k = call.rows, call.n, call.k
        W, r = comm.group.size, comm.group.rank
        if call.op == "ag_gemm":
            m = x.shape[0]
            gathered = torch.empty((M, k), dtype=x.dtype, device=x.device)
            main = comm.launch_stream()
            # The shard is staged on the caller's stream before forking: in a graph, a staging
            # copy on the comm stream ran as an SM kernel (memcpy128) that held the first GEMM
            # back by ~100 us; on the caller's stream it runs on the copy engine.
            _ag_stage(comm, x, main)
            cs = fork(main)
            ready = _ag_pull(comm, x, gathered, cs, stage=False)
            x.record_stream(cs)
            gathered.record_stream(cs)
            # Every rank multiplies every block with the same [m, K] x [K, N] shape, so cuBLAS
            # takes the same path everywhere and the output is bitwise identical across ranks.
            mm(x, w, out[r * m:(r + 1) * m], bias)
            for j, ev in ready:
                main.wait_event(ev)
                mm(gathered[j * m:(j + 1) * m], w, out[j * m:(j + 1) * m], bias)
            main.wait_stream(cs)  # the closing barrier: joined for graph capture and ordering
            return out
        if call.op == "gemm_rs":
            m = M // W
            # Each chunk is multiplied as pieces of [rows, N]: cut where they fill GEMM waves.
            bounds = row_bounds(call.op, call.chunks, comm, M, n, k, m, "M / world", wave_cols=n)
            _rs_copy_engine(comm, x, w, out, comm.launch_stream(), bounds)
            return out.add_(bias) if bias is not None else out
        bounds = row_bounds(call.op, call.chunks, comm, M, n, k, M, "M")
        # The closing kernel stores 16-byte vectors into out, and every rank must take the
        # same path: an out that is not 16-byte aligned on this rank (alignment can differ
        # between ranks) goes through an aligned buffer instead of changing the path.
        dst = _align.aligned_output(out)
        _ar_copy_engine(comm, x, w, dst, comm.launch_stream(), bounds)
        if dst is not out:
            out.copy_(dst)
        return out.add_(bias) if bias is not None else out


ENGINE = CopyEngine()


def _ag_stage(comm: Communicator, x_shard: torch.Tensor, stream: torch.cuda.Stream):
    """This rank's shard -> its symmetric staging, on `stream`."""
    _ext.load().memcpy_async(comm.symm.bases[comm.group.rank] + comm.symm.staging_offset,
                             x_shard.data_ptr(), x_shard.numel() * x_shard.element_size(),
                             stream.cuda_stream)


def _ag_pull(comm: Communicator, x_shard: torch.Tensor, gathered: torch.Tensor,
             cs: torch.cuda.Stream, stage: bool = True) -> list:
    """Copy-engine all-gather on `cs`: stage this rank's shard in its symmetric staging (unless
    `stage` is False: the caller did, on a stream `cs` follows), barrier, pull every peer's
    shard into `gathered` (one event per peer), barrier again so no rank overwrites its
    staging while a peer still reads it (also across CUDA-graph replays). The barriers are
    call checks carrying ag_gemm's descriptor (rows and K of the gathered input): a peer in
    another call fails the communicator at the first one, before any pull."""
    C = _ext.load()
    symm = comm.symm
    W, r = comm.group.size, comm.group.rank
    m, k = x_shard.shape
    desc = call_desc("ag_gemm", x_shard.dtype, "copy_engine", 0, W * m, 0, k)
    nbytes = x_shard.numel() * x_shard.element_size()
    events = []
    with torch.cuda.stream(cs):
        if stage:
            _ag_stage(comm, x_shard, cs)
        comm.device_barrier(desc)
        for d in range(1, W):
            j = (r + d) % W
            C.memcpy_async(gathered.data_ptr() + j * nbytes, symm.bases[j] + symm.staging_offset,
                           nbytes, cs.cuda_stream)
            ev = torch.cuda.Event()
            ev.record(cs)
            events.append((j, ev))
        comm.device_barrier(desc)
    return events


def _barrier_then(comm: Communicator, stream: torch.cuda.Stream, cs: torch.cuda.Stream,
                  desc: tuple):
    """A device barrier (a call check carrying `desc`) on `cs` after everything `stream` queued
    so far. All of a pipeline's barriers run on `cs`, one at a time as the sentinel protocol
    requires. (Between the GEMMs on the compute stream instead, they measured no faster:
    benchmarks/NOTES.md.)"""
    ev = torch.cuda.Event()
    ev.record(stream)
    cs.wait_event(ev)
    with torch.cuda.stream(cs):
        comm.device_barrier(desc)


def _barrier_pull(comm: Communicator, main: torch.cuda.Stream, cs: torch.cuda.Stream,
                  offset: int, dst: torch.Tensor, desc: tuple) -> torch.cuda.Event:
    """On `cs`, after what `main` queued so far (this rank's staging writes): a device barrier
    (every peer staged too), then dst = the sum of the peers' staging at `offset`. Returns the
    event main waits on before using dst."""
    _barrier_then(comm, main, cs, desc)
    _pull_sum(comm, offset, dst, cs)
    pulled = torch.cuda.Event()
    pulled.record(cs)
    return pulled


def _release_staging(comm: Communicator, main: torch.cuda.Stream, cs: torch.cuda.Stream,
                     desc: tuple):
    """A closing barrier on `cs` (no rank rewrites its staging, in a later call or graph
    replay, while a peer still reads it), then `main` follows `cs`."""
    with torch.cuda.stream(cs):
        comm.device_barrier(desc)
    main.wait_stream(cs)


def _pull_sum(comm: Communicator, offset: int, dst: torch.Tensor, cs: torch.cuda.Stream):
    """On `cs`: dst = the sum over peers p != rank of p's staging bytes at `offset`, as many
    bytes as `dst` has. Two ranks: one copy-engine pull straight into dst. More: pulls into a
    scratch stack, then one fp32-accumulated sum (SMs), in the order rank + 1, + 2, ..."""
    C = _ext.load()
    symm = comm.symm
    W, r = comm.group.size, comm.group.rank
    nbytes = dst.numel() * dst.element_size()
    if nbytes == 0:
        return
    base = symm.staging_offset
    if W == 2:
        p = 1 - r
        C.memcpy_async(dst.data_ptr(), symm.bases[p] + base + offset, nbytes,
                       cs.cuda_stream)
        return
    with torch.cuda.stream(cs):
        recv = torch.empty((W - 1,) + tuple(dst.shape), dtype=dst.dtype, device=dst.device)
        for d in range(1, W):
            p = (r + d) % W
            C.memcpy_async(recv[d - 1].data_ptr(), symm.bases[p] + base + offset, nbytes,
                           cs.cuda_stream)
        torch.sum(recv, dim=0, out=dst)


def _rs_copy_engine(comm: Communicator, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor,
                    main: torch.cuda.Stream, bounds: list) -> torch.Tensor:
    """gemm_rs with copy-engine transfers, pipelined over row slices of every block (`bounds`:
    rows of a block, from 0 to M / W; chunk c is rows bounds[c]..bounds[c + 1]).
    Staging chunk c of rank p holds p's partials of chunk c for the other ranks' blocks,
    [W, rows_c, N]; rank j pulls slice j between two device barriers. The reduction costs no
    kernel: the peers' partials land in out (summed first when W > 2) and the own block is
    multiplied last with beta = 1 (torch.addmm into out), so it rounds once.
      main: [G peers c0][G peers c1][G own c0 + pulled][G peers c2][G own c1 + pulled]...
      comm:        [barrier][pull c0]  [barrier][pull c1]   ...              [barrier]
    The barriers are call checks carrying gemm_rs's descriptor (M, N, the chunks): a peer in
    another call fails the communicator at the first one, before any pull."""
    W, r = comm.group.size, comm.group.rank
    M, k = x.shape
    m, n = M // W, w.shape[1]
    desc = call_desc("gemm_rs", x.dtype, "copy_engine", len(bounds) - 1, M, n, k)
    es = x.element_size()
    xv = x.view(W, m, k)
    chunks = len(bounds) - 1
    cs = fork(main)
    pulled = []

    def own(c):
        a, b = bounds[c], bounds[c + 1]
        main.wait_event(pulled[c])
        if b > a:
            out[a:b].addmm_(xv[r, a:b], w)  # beta = 1: the pulled sum is C

    for c in range(chunks):
        a, b = bounds[c], bounds[c + 1]
        off = W * a * n * es  # chunk c's region: [W, b - a, N]
        stage = comm.symm.staging(x.dtype, (W, b - a, n), off)
        for j in range(W):
            if j != r and b > a:
                torch.matmul(xv[j, a:b], w, out=stage[j])
        pulled.append(_barrier_pull(comm, main, cs, off + r * (b - a) * n * es, out[a:b],
                                    desc))
        if c:
            own(c - 1)
    own(chunks - 1)
    _release_staging(comm, main, cs, desc)
    return out


def _ar_copy_engine(comm: Communicator, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor,
                    main: torch.cuda.Stream, bounds: list) -> torch.Tensor:
    """gemm_ar with copy-engine transfers: a reduce-scatter then an all-gather per row chunk
    (chunk c: rows bounds[c]..bounds[c + 1] of M), pipelined. Chunk c's rows are split into W
    sub-blocks, rank j owning sub-block j. Rank r
    multiplies the other sub-blocks into its staging (same rows as in the output), pulls the
    peers' partials of sub-block r into its staging (summed when W > 2), multiplies its own
    rows with beta = 1 on top (the sum rounds once, on the owner), and after a second barrier
    every rank pulls every reduced sub-block into out, so out is bitwise the same everywhere.
      main: [G others c0][G others c1][G own c0 + pulled][G others c2][G own c1 + pulled]..
      comm:        [bar][pull c0]  [bar][pull c1]  [bar][gather c0]   [bar][pull c2] ..
      side:                                        [own rows c0 -> out]
    (Two variants measured slower at 4 chunks, benchmarks/NOTES.md: one barrier
    serving a pull and an older gather, and gathers on the side stream. The copy engine runs
    one peer copy at a time, so the order of the copies is what matters.)
    The last chunk is exchanged on main by SMs, idle by then (gemm_comm.cuh,
    staging_gather_kernel: each rank pushes its reduced rows into the peers' staging, one
    token per block) instead of barrier -> copy-engine pull -> barrier with their stream
    hops. Exposed after the last GEMM: that kernel. Rows that are not whole 16-byte vectors
    keep the copy-engine gather and a closing barrier. `out` must be 16-byte aligned.
    The barriers (and the closing kernel's block 0) are call checks carrying gemm_ar's
    descriptor (M, N, the chunks): a peer in another call fails the communicator at the first
    one, before any pull."""
    C = _ext.load()
    symm = comm.symm
    W, r = comm.group.size, comm.group.rank
    M, k = x.shape
    n = w.shape[1]
    es = x.element_size()
    row = n * es
    stage = symm.staging(x.dtype, (M, n))
    chunks = len(bounds) - 1
    desc = call_desc("gemm_ar", x.dtype, "copy_engine", chunks, M, n, k)
    subs = [[bounds[c] + s for s in split(bounds[c + 1] - bounds[c], W)] for c in range(chunks)]
    cs = fork(main)
    # The own rows' staging -> out copy runs on a second stream: on the comm stream it would
    # hold back the next barrier and pull (in a graph it is a kernel that waits for SMs).
    side = comm_stream(x.device, 1)
    pulled = []

    # From shapes only, so every rank takes the same path (gemm_ar passes an aligned out).
    sm_tail = _align.whole_vectors(row)

    def own(c):
        a, b = subs[c][r], subs[c][r + 1]
        main.wait_event(pulled[c])
        if b > a:
            stage[a:b].addmm_(x[a:b], w)  # beta = 1: the pulled sum is C
            if sm_tail and c == chunks - 1:
                return  # the closing kernel copies these rows too
            reduced = torch.cuda.Event()
            reduced.record(main)
            side.wait_event(reduced)
            C.memcpy_async(out[a:b].data_ptr(), stage[a:b].data_ptr(), (b - a) * row,
                           side.cuda_stream)

    def gather(c):  # right after own(c): the barrier follows it
        _barrier_then(comm, main, cs, desc)
        for d in range(1, W):
            p = (r + d) % W
            a, b = subs[c][p], subs[c][p + 1]
            if b > a:
                C.memcpy_async(out[a:b].data_ptr(), symm.bases[p] + symm.staging_offset + a * row,
                               (b - a) * row, cs.cuda_stream)

    for c in range(chunks):
        lo, hi = subs[c][r], subs[c][r + 1]
        if lo > bounds[c]:
            torch.matmul(x[bounds[c]:lo], w, out=stage[bounds[c]:lo])
        if bounds[c + 1] > hi:
            torch.matmul(x[hi:bounds[c + 1]], w, out=stage[hi:bounds[c + 1]])
        pulled.append(_barrier_pull(comm, main, cs, lo * row, stage[lo:hi], desc))
        if c:
            own(c - 1)
            gather(c - 1)
    own(chunks - 1)
    if sm_tail:
        # The kernel's tokens use the communicator's epoch and slots, like the barriers on cs:
        # it starts only after cs (and side) finished.
        main.wait_stream(cs)
        main.wait_stream(side)
        C.gemm_ar_staging_gather(symm.handle, symm.staging_offset, subs[chunks - 1], row,
                                 out.data_ptr(), desc, main.cuda_stream)
        return out
    gather(chunks - 1)
    _release_staging(comm, main, cs, desc)
    main.wait_stream(side)
    return out
