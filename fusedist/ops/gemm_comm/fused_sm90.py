"""The fused engines of ag_gemm and gemm_rs on the Hopper GEMM (csrc/include/fusedist/
gemm/gemm_sm90.cuh): one persistent wgmma GEMM whose tiles wait for (ag_gemm) or signal (gemm_rs)
per-piece flags while the copy engine moves the rows between the ranks' symmetric staging.
  ag_gemm: the GEMM runs over the gathered input in staging (staging_bytes >= world x shard)
           while the copy engine pulls the peers' blocks; each tile waits for the flags of the
           rows it reads (chunks= copy pieces per block).
  gemm_rs: the same GEMM over the other ranks' blocks into staging (staging_bytes >= M x N),
           each stored tile counted on its owner; the owner's comm stream pulls finished pieces
           (chunks= pieces per block) and its own block's GEMM takes them as C, waiting per
           tile in the C-load warp."""

from __future__ import annotations

from typing import Optional

import torch

from ... import _align, _ext
from ...comm.communicator import Communicator
from ..gemm import launch_sm90, sm90_available
from .base import Call, Engine, call_desc, depth, fork, fused_common_why_not


class FusedSm90(Engine):
    name = "fused_sm90"

    def why_not(self, call: Call) -> Optional[str]:
        if call.op == "ag_gemm":
            return _fused_ag_why_not(call.comm, call.x, call.w)
        if call.op == "gemm_rs":
            return _fused_rs_why_not(call.comm, call.x, call.w)
        return f"{call.op} has no fused prefill engine"

    def run(self, call: Call) -> torch.Tensor:
        comm, x, w, out = call.comm, call.x, call.w, call.out
        M, n, k = call.rows, call.n, call.k
        if call.op == "ag_gemm":
            m = x.shape[0]
            # One piece per block by default: a peer block (m x K) is pulled several times
            # faster than the GEMM multiplies the block before it (traced at 4096 x 8192 x 8192:
            # 94 us against ~350 us), so cutting it finer only adds copies and flags.
            pieces = depth(call.op, 1 if call.chunks is None else call.chunks, comm, M, n, k,
                           rows=m)
            return _ag_fused(comm, x, w, call.bias, out, pieces)
        m = M // comm.group.size
        C = depth(call.op, _rs_fused_pieces(m) if call.chunks is None else call.chunks, comm, M,
                  n, k, rows=m)
        return _rs_fused(comm, x, w, call.bias, out, min(C, _ext.load().MAX_SIGNAL_PIECES))


ENGINE = FusedSm90()


def _fused_sm90_why_not(comm: Communicator, x: torch.Tensor, w: torch.Tensor) -> Optional[str]:
    """What the fused engines on the Hopper GEMM (ag_gemm, gemm_rs) need beyond the common."""
    why = fused_common_why_not(comm, x, w)
    if why is not None:
        return why
    if not sm90_available(comm.device):
        return f"{comm.device} is not a Hopper (sm_90) GPU"
    return None


def _fused_ag_why_not(comm: Communicator, x_shard: torch.Tensor, w: torch.Tensor) -> Optional[str]:
    """None when ag_gemm's fused engine takes (x_shard, w) on this communicator, else why not
    (shapes, dtypes, strides and sizes only: the same answer on every rank)."""
    why = _fused_sm90_why_not(comm, x_shard, w)
    if why is not None:
        return why
    need = comm.group.size * x_shard.numel() * x_shard.element_size()
    if comm.symm.staging_bytes < need:
        return (f"it gathers the input ({need} bytes: world x shard) in symmetric staging and "
                f"the communicator has {comm.symm.staging_bytes} bytes; create "
                f"fusedist.Communicator(staging_bytes>={need})")
    return None


def _ag_fused(comm: Communicator, x_shard: torch.Tensor, w: torch.Tensor, bias,
              out: torch.Tensor, pieces: int) -> torch.Tensor:
    """One persistent GEMM over the gathered rows while the copy engine pulls the peers' rows.
    The gathered input lives in this rank's symmetric staging, [world * m, K], every rank's
    block at the same rows everywhere, so a peer pulls this rank's block straight from where
    this rank's GEMM reads it. Streams (docs/design/gemm_comm.md has the timeline):
      main: flags zeroed and this rank's pieces flagged, own shard -> its rows of the staging,
            then (after cs's first barrier) the GEMM. Its tiles walk this rank's block first
            and each waits for the flags of its rows (gemm_sm90.cuh); it leaves a few SMs free
            so the closing barrier need not wait for it.
      cs:   barrier (every rank staged its block), each peer's block pulled piece by piece
            from the peer's staging into the same rows here (cudaMemcpyAsync peer -> device:
            the copy engine), a flag after each piece (cuStreamWriteValue32: no SM), closing
            barrier (no rank restages while a peer still pulls).
    The GEMM is launched only after the first barrier, so once it holds the SMs its progress
    needs only the copy engine and stream memory operations: no SM kernel of this call (or of
    another stream) can be starved behind it. Flags are zeroed on main each call, so a graph
    replay never sees the last one's. Both barriers are call checks carrying ag_gemm's
    descriptor (rows, K, the pieces): a peer in another call fails the communicator at the
    first, before any pull."""
    C = _ext.load()
    symm = comm.symm
    W, r = comm.group.size, comm.group.rank
    m, k = x_shard.shape
    desc = call_desc("ag_gemm", x_shard.dtype, "fused", pieces, W * m, 0, k)
    row_bytes = k * x_shard.element_size()
    main = comm.launch_stream()
    gathered = symm.staging(x_shard.dtype, (W * m, k))
    flags = torch.zeros(W * pieces, dtype=torch.int32, device=x_shard.device)
    flags[r * pieces:(r + 1) * pieces] = 1
    gathered[r * m:(r + 1) * m].copy_(x_shard)
    piece_rows = -(-m // pieces)  # the kernel's piece size: ceil, the last piece shorter
    bounds = [min(i * piece_rows, m) for i in range(pieces + 1)]
    cs = fork(main)
    with torch.cuda.stream(cs):
        comm.device_barrier(desc)
        staged = torch.cuda.Event()
        staged.record(cs)
        for d in range(1, W):
            j = (r + d) % W
            for p in range(pieces):
                a, b = bounds[p], bounds[p + 1]
                offset = symm.staging_offset + (j * m + a) * row_bytes
                C.memcpy_async(symm.bases[r] + offset, symm.bases[j] + offset,
                               (b - a) * row_bytes, cs.cuda_stream)
                C.stream_write_u32(flags.data_ptr() + 4 * (j * pieces + p), 1, cs.cuda_stream)
        comm.device_barrier(desc)
    flags.record_stream(cs)
    main.wait_event(staged)
    launch_sm90(gathered, w, bias, out, main, comm=comm, flags=flags, block_rows=m,
                pieces=pieces)
    main.wait_stream(cs)  # the closing barrier: joined for graph capture and ordering
    return out


def _rs_fused_pieces(m: int) -> int:
    """Default pieces per block of the fused gemm_rs: one per 2048 rows, the rows a wave of
    the GEMM (swizzle 8 x 2-CTA clusters x 128 rows) finishes together, 1 to 8."""
    return max(1, min(8, round(m / 2048)))


def _fused_rs_why_not(comm: Communicator, x: torch.Tensor, w: torch.Tensor) -> Optional[str]:
    """None when gemm_rs's fused engine takes (x, w) on this communicator, else why not
    (shapes, dtypes, strides and sizes only: the same answer on every rank)."""
    why = _fused_sm90_why_not(comm, x, w)
    if why is not None:
        return why
    M, N = x.shape[0], w.shape[1]
    need = M * N * x.element_size()
    if comm.symm.staging_bytes < need:
        return (f"the partial products ({need} bytes: M x N) live in symmetric staging and the "
                f"communicator has {comm.symm.staging_bytes} bytes; create "
                f"fusedist.Communicator(staging_bytes>={need})")
    return None


def _rs_signal_expected(C, r: int, s: int, m: int, M: int, n: int, lo: int, hi: int) -> int:
    """Tiles rank s's peer-block GEMMs (_rs_fused) signal for rows [lo, hi) of rank r's block
    (the row ranges [(s+1)m, M) then [0, sm), tiled from their first row by BLOCK_M rows, every
    N tile of a row block signalling once)."""
    bm = C.GEMM_SM90_BLOCK_M
    tiles = 0
    for a, b in (((s + 1) * m, M), (0, s * m)):
        l, h = max(lo, a), min(hi, b)
        if h > l:
            tiles += (h - 1 - a) // bm - (l - a) // bm + 1
    return tiles * -(-n // C.GEMM_SM90_BLOCK_N)


def _rs_fused(comm: Communicator, x: torch.Tensor, w: torch.Tensor, bias, out: torch.Tensor,
              pieces: int) -> torch.Tensor:
    """Persistent GEMMs whose tiles signal the rows' owner as they land; the owner pulls each
    finished piece with the copy engine, and its own block's GEMM takes the pulled partials as
    C (docs/design/gemm_comm.md has the timeline). Block b = rows [b m, (b+1) m) of x, whose
    reduced sum rank b keeps. This rank's staging holds its partials at the same rows, [M, N].
      main: the other ranks' blocks, starting with block rank + 1, as at most two contiguous
            row ranges (one GEMM each) into staging. Each stored tile adds 1 (release, system
            scope) on its owner's counter of every piece it wrote (gemm_sm90.cuh). Then this
            rank's block: out = x_own @ w + C + bias with C = the pulled partials in out; with
            two ranks the GEMM starts at once and its C-load warp waits per tile for the
            pieces' flags, with more the pulled partials are summed into out first.
      cs:   for each peer s, nearest first (s = rank - 1 computes this block first), each
            piece: a one-thread kernel waits (bounded) until s's count is complete and clears
            it; the copy engine pulls the piece from s's staging into out (or a scratch slot);
            cuStreamWriteValue32 sets its flag. A closing barrier: no rank restages while a
            peer still pulls, and no GEMM adds to a counter before its owner cleared it.
            Before the waits, an opening call check (beside the GEMMs, on the SMs they leave
            free): a peer in another call fails the communicator with a mismatch there, not
            with a counter wait's timeout.
    The counters live in the communicator's signal region and are zero between calls; flags
    are zeroed on main each call, so graph replays never see the last call's. Both barriers
    carry gemm_rs's descriptor (M, N, the pieces)."""
    C = _ext.load()
    symm = comm.symm
    W, r = comm.group.size, comm.group.rank
    M, k = x.shape
    n = w.shape[1]
    m = M // W
    desc = call_desc("gemm_rs", x.dtype, "fused", pieces, M, n, k)
    row = n * x.element_size()
    main = comm.launch_stream()
    stage = symm.staging(x.dtype, (M, n))
    piece_rows = -(-m // pieces)  # the kernels' piece size: ceil, the last piece shorter
    bounds = [min(i * piece_rows, m) for i in range(pieces + 1)]
    dst = _align.aligned_output(out)
    flags = torch.zeros(pieces, dtype=torch.int32, device=x.device) if W == 2 else None
    recv = None if W == 2 else torch.empty((W - 1, m, n), dtype=x.dtype, device=x.device)
    cs = fork(main)
    for a, b in (((r + 1) * m, M), (0, r * m)):
        if b > a:
            launch_sm90(x[a:b], w, None, stage[a:b], main, comm=comm, signal_row0=a,
                        signal_block_rows=m, signal_pieces=pieces)
    with torch.cuda.stream(cs):
        comm.device_barrier(desc)
        for d in range(1, W):
            src = (r - d) % W
            into = dst if W == 2 else recv[d - 1]
            for p in range(pieces):
                a, b = bounds[p], bounds[p + 1]
                if b <= a:
                    continue
                C.gemm_rs_counter_wait(symm.handle, symm.signal_offset, src, p,
                                       _rs_signal_expected(C, r, src, m, M, n, r * m + a, r * m + b),
                                       cs.cuda_stream)
                C.memcpy_async(into[a:b].data_ptr(),
                               symm.bases[src] + symm.staging_offset + (r * m + a) * row,
                               (b - a) * row, cs.cuda_stream)
                if W == 2:
                    C.stream_write_u32(flags.data_ptr() + 4 * p, 1, cs.cuda_stream)
        pulled = torch.cuda.Event()
        pulled.record(cs)
        comm.device_barrier(desc)
    own = x[r * m:(r + 1) * m]
    if W == 2:
        flags.record_stream(cs)
        launch_sm90(own, w, bias, dst, main, accumulate=True, comm=comm, flags=flags,
                    block_rows=m, pieces=pieces, wait_on_c=True, wait_peer=1 - r)
    else:
        recv.record_stream(cs)
        main.wait_event(pulled)
        torch.sum(recv, dim=0, out=dst)
        launch_sm90(own, w, bias, dst, main, accumulate=True)
    main.wait_stream(cs)  # the closing barrier: joined for graph capture and ordering
    if dst is not out:
        out.copy_(dst)
    return out
