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
  * "fused" (gemm_ar, M <= 128): one CUDA kernel (csrc/include/fusedist/gemm_comm.cuh) streams
    the weight through a TMA ring into tensor-core MMAs, 64 output columns per block, and
    each block exchanges its finished strip with the peers through the communicator's symmetric
    buffers (one-shot protocol) while other blocks still stream weights. bf16/fp16, N and K
    multiples of 8, w as [K, N] or as the .t() of an [N, K] nn.Linear weight; NVLink peers only.
  * "fused" (ag_gemm, Hopper): one persistent wgmma GEMM (csrc/include/fusedist/gemm_sm90.cuh)
    over the gathered input in symmetric staging (staging_bytes >= world x shard) while the
    copy engine pulls the peers' blocks; each tile waits for the flags of the rows it reads
    (chunks= copy pieces per block). Level with the overlap engines on 2x H200, so "auto"
    does not pick it.
  * "fused" (gemm_rs, Hopper): the same GEMM over the other ranks' blocks into symmetric
    staging (staging_bytes >= M x N), each stored tile counted on its owner; the owner's comm
    stream pulls finished pieces (chunks= pieces per block) and its own block's GEMM takes them
    as C, waiting per tile in the C-load warp. 0.81-0.99x of the copy-engine overlap on
    2x H200, so "auto" does not pick it.
  * "auto": the table in tuning.py (FUSEDIST_GEMM_ENGINE overrides; "fused" there applies where
    the fused kernel takes the call and falls back to the table elsewhere).
Prefill gemm_ar has no fused engine; docs/design/gemm_comm.md has the engines and what is
measured.
CPU tensors (gloo) take the plain-torch reference path.
"""

from __future__ import annotations

import os
from typing import Optional, Sequence, Union

import torch

from .. import _align, _dtypes, _ext, tuning
from ..communicator import Communicator, GroupLike, communicator_by_name, get_communicator
from ..streams import comm_stream, nvtx_range
from .gemm import FUSED_DTYPES, launch_decode, launch_sm90, sm90_available, weight_layout

ENGINES = ("unfused", "overlap", "fused")
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _engine(op: str, engine: str, m: int, n: int, k: int, comm: Communicator,
            fused_why_not: Optional[str], copy_engine_ok: bool = False) -> str:
    """The engine for this call. `fused_why_not` is None when the fused kernel takes the call,
    else the reason it does not (it depends only on shapes, dtypes and strides, which SPMD code
    keeps identical on every rank, so every rank picks the same engine)."""
    if engine not in ("auto",) + ENGINES:
        raise ValueError(f"fusedist.{op}: engine must be 'auto' or one of {ENGINES}, got "
                         f"{engine!r}")
    if comm.device.type == "cpu" or comm.group.size == 1:
        return "unfused"
    if engine == "fused" and fused_why_not is not None:
        raise ValueError(f"fusedist.{op}: engine='fused' does not take this call: "
                         f"{fused_why_not}; use engine='auto', 'overlap' or 'unfused'")
    if engine == "auto":
        forced = os.environ.get("FUSEDIST_GEMM_ENGINE", "auto")
        if forced not in ("auto",) + ENGINES:
            raise ValueError(f"fusedist: FUSEDIST_GEMM_ENGINE must be auto or one of "
                             f"{ENGINES}, got {forced!r}")
        if forced == "fused" and fused_why_not is None:
            return "fused"
        if forced in ("unfused", "overlap"):
            return forced
        measured = comm.table.get("gemm_comm", {}).get("measured_worlds")
        if measured and comm.group.size not in measured:
            tuning.warn_once(comm, "gemm_comm_untuned_world",
                             f"the GEMM + collective engine rules were measured at world size"
                             f" {', '.join(map(str, measured))}, not {comm.group.size}; "
                             "engine='auto' applies them as they are (the engines may cross over "
                             "elsewhere at this size): measure with benchmarks/gemm_comm.py")
        return tuning.choose_gemm(comm.table, op, m, n, k, comm.group.size,
                                  fused_ok=fused_why_not is None, copy_engine_ok=copy_engine_ok)
    return engine


def _fused_common_why_not(comm: Communicator, x: torch.Tensor, w: torch.Tensor) -> Optional[str]:
    """What every fused kernel needs: symmetric memory, bf16/fp16, N and K multiples of 8, a
    [K, N] or nn.Linear-.t() weight."""
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


def _fused_sm90_why_not(comm: Communicator, x: torch.Tensor, w: torch.Tensor) -> Optional[str]:
    """What the fused engines on the Hopper GEMM (ag_gemm, gemm_rs) need beyond the common."""
    why = _fused_common_why_not(comm, x, w)
    if why is not None:
        return why
    if not sm90_available(comm.device):
        return f"{comm.device} is not a Hopper (sm_90) GPU"
    return None


def _fused_ar_why_not(comm: Communicator, x: torch.Tensor, w: torch.Tensor) -> Optional[str]:
    """None when gemm_ar's fused kernel takes (x, w) on this communicator, else why not."""
    why = _fused_common_why_not(comm, x, w)
    if why is not None:
        return why
    C = _ext.load()
    M, K = x.shape
    N = w.shape[1]
    if M > C.GEMM_AR_FUSED_MAX_M:
        return f"M = {M} rows (the fused kernel takes at most {C.GEMM_AR_FUSED_MAX_M})"
    cap = C.allreduce_max_numel(comm.symm.handle, _dtypes.code(x.dtype), C.ALGO_ONE_SHOT)
    if M * N > cap:
        return (f"the [M, N] output has {M * N} elements, more than the communicator's one-shot "
                f"slot ({cap}); create fusedist.Communicator(max_bytes=...) larger")
    return None


def _chunks(op: str, chunks, comm: Communicator, m: int, n: int, k: int,
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


def _ce_bounds(op: str, chunks, comm: Communicator, m: int, n: int, k: int, rows: int,
               what: str, wave_cols: Optional[int] = None) -> list:
    """Row bounds of a copy-engine pipeline's chunks over `rows` rows (`what` names them for
    errors). chunks: a list of row counts summing to `rows`, taken as given; else the depth
    from `_chunks`, cut evenly, or (wave_cols: the columns of every piece's output) by the
    table's wave model (tuning.wave_row_bounds). Shapes and rank 0's table only: the same
    bounds on every rank, as the exchange needs."""
    if isinstance(chunks, (list, tuple)):
        sizes = list(chunks)
        if not sizes or sum(sizes) != rows or any(
                not isinstance(s, int) or isinstance(s, bool) or s < 1 for s in sizes):
            raise ValueError(f"fusedist.{op}: chunks as row counts must be positive ints that "
                             f"sum to {what} ({rows}), got {chunks!r}")
        return [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    C = _chunks(op, chunks, comm, m, n, k, copy_engine=True, rows=rows)
    if wave_cols is None:
        return _split(rows, C)
    return tuning.wave_row_bounds(rows, wave_cols, C, tuning.gemm_waves(comm.table))


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


def _mm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, bias=None) -> torch.Tensor:
    if bias is None:
        return torch.matmul(a, b, out=out)
    return torch.addmm(bias, a, b, out=out)


def _fork(stream: torch.cuda.Stream) -> torch.cuda.Stream:
    """The pool's communication stream, ordered after everything queued on `stream`."""
    cs = comm_stream(stream.device)
    cs.wait_stream(stream)
    return cs


# ---- ag_gemm ------------------------------------------------------------------------------
TRANSPORTS = ("auto", "nccl", "copy_engine")


def _transport(op: str, comm: Communicator, need: int, transport: str,
               otherwise: str = "nccl") -> str:
    """How the overlap engine moves data: "copy_engine" (cudaMemcpyAsync from the peers'
    symmetric staging: no SMs) when the communicator has `need` bytes of staging, else
    `otherwise` (the op's collective transport). Depends only on sizes, identical on every
    rank."""
    fits = comm.symm is not None and comm.symm.staging_bytes >= need
    if transport == "copy_engine" and not fits:
        have = 0 if comm.symm is None else comm.symm.staging_bytes
        raise ValueError(f"fusedist.{op}: transport='copy_engine' needs {need} bytes of "
                         f"symmetric staging, the communicator has {have}; create "
                         f"fusedist.Communicator(staging_bytes>={need}) (NVLink peers only) or "
                         "use transport='auto'")
    if transport == "auto":
        return "copy_engine" if fits else otherwise
    return transport


def _ag_transport(comm: Communicator, x_shard: torch.Tensor, transport: str) -> str:
    return _transport("ag_gemm", comm, x_shard.numel() * x_shard.element_size(), transport)


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
    staging while a peer still reads it (also across CUDA-graph replays)."""
    C = _ext.load()
    symm = comm.symm
    W, r = comm.group.size, comm.group.rank
    nbytes = x_shard.numel() * x_shard.element_size()
    events = []
    with torch.cuda.stream(cs):
        if stage:
            _ag_stage(comm, x_shard, cs)
        comm.device_barrier()
        for d in range(1, W):
            j = (r + d) % W
            C.memcpy_async(gathered.data_ptr() + j * nbytes, symm.bases[j] + symm.staging_offset,
                           nbytes, cs.cuda_stream)
            ev = torch.cuda.Event()
            ev.record(cs)
            events.append((j, ev))
        comm.device_barrier()
    return events


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
    replay never sees the last one's."""
    C = _ext.load()
    symm = comm.symm
    W, r = comm.group.size, comm.group.rank
    m, k = x_shard.shape
    row_bytes = k * x_shard.element_size()
    main = comm.launch_stream()
    gathered = symm.staging(x_shard.dtype, (W * m, k))
    flags = torch.zeros(W * pieces, dtype=torch.int32, device=x_shard.device)
    flags[r * pieces:(r + 1) * pieces] = 1
    gathered[r * m:(r + 1) * m].copy_(x_shard)
    piece_rows = -(-m // pieces)  # the kernel's piece size: ceil, the last piece shorter
    bounds = [min(i * piece_rows, m) for i in range(pieces + 1)]
    cs = _fork(main)
    with torch.cuda.stream(cs):
        comm.device_barrier()
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
        comm.device_barrier()
    flags.record_stream(cs)
    main.wait_event(staged)
    launch_sm90(gathered, w, bias, out, main, comm=comm, flags=flags, block_rows=m,
                pieces=pieces)
    main.wait_stream(cs)  # the closing barrier: joined for graph capture and ordering
    return out


def ag_gemm(x_shard: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
            group: GroupLike = None, engine: str = "auto", out: Optional[torch.Tensor] = None,
            transport: str = "auto", chunks: Optional[int] = None) -> torch.Tensor:
    """all_gather(x_shard over the group, along rows) @ w (+ bias). x_shard [m, K] on every rank,
    w [K, N]; returns [world * m, N], bitwise the same on every rank. transport (overlap
    engine): "auto" (copy engine when the communicator has staging_bytes for the shard, else
    NCCL), "nccl" or "copy_engine". chunks (fused engine): copy pieces per rank block, each
    flagged as it lands (default 1)."""
    if _compiling():
        return _compiled(torch.ops.fusedist.ag_gemm, x_shard, w, bias, get_communicator(group),
                         engine, transport, chunks, out)
    op = "ag_gemm"
    if transport not in TRANSPORTS:
        raise ValueError(f"fusedist.ag_gemm: transport must be one of {TRANSPORTS}, got "
                         f"{transport!r}")
    comm = get_communicator(group)
    _validate(op, comm, x_shard, w, bias, "x_shard", "w")
    W, r = comm.group.size, comm.group.rank
    m, k = x_shard.shape
    n = w.shape[1]
    out = _out(op, out, (W * m, n), x_shard)
    if out.numel() == 0:
        return out  # every rank's shard has the same shape: every rank skips the collective
    how = _ag_transport(comm, x_shard, transport) if comm.device.type == "cuda" else "nccl"
    fused_why_not = _fused_ag_why_not(comm, x_shard, w) if comm.device.type == "cuda" else \
        "CPU tensors"
    eng = _engine(op, engine, W * m, n, k, comm, fused_why_not=fused_why_not,
                  copy_engine_ok=how == "copy_engine")
    with nvtx_range(f"fusedist.ag_gemm.{eng}"):
        if comm.device.type == "cpu":
            parts = [torch.empty_like(x_shard, dtype=torch.float32) for _ in range(W)]
            torch.distributed.all_gather(parts, x_shard.float(), group=comm.group.pg)
            ref = torch.cat(parts) @ w.float()
            if bias is not None:
                ref += bias.float()
            return out.copy_(ref)
        if eng == "fused":
            # One piece per block by default: a peer block (m x K) is pulled several times
            # faster than the GEMM multiplies the block before it (traced at 4096 x 8192 x 8192:
            # 94 us against ~350 us), so cutting it finer only adds copies and flags.
            pieces = _chunks(op, 1 if chunks is None else chunks, comm, W * m, n, k, rows=m)
            return _ag_fused(comm, x_shard, w, bias, out, pieces)
        gathered = torch.empty((W * m, k), dtype=x_shard.dtype, device=x_shard.device)
        if eng == "unfused":
            comm.nccl.all_gather(x_shard, gathered)
            return _mm(gathered, w, out, bias)
        main = comm.launch_stream() if how == "copy_engine" else \
            torch.cuda.current_stream(x_shard.device)
        # The copy-engine overlap stages the shard on the caller's stream before forking: in a
        # graph, a staging copy on the comm stream ran as an SM kernel (memcpy128) that held
        # the first GEMM back by ~100 us, on the caller's stream it runs on the copy engine.
        if how == "copy_engine":
            _ag_stage(comm, x_shard, main)
        cs = _fork(main)
        if how == "copy_engine":
            ready = _ag_pull(comm, x_shard, gathered, cs, stage=False)
        else:
            with torch.cuda.stream(cs):
                comm.nccl_overlap.all_gather(x_shard, gathered)
                gathered_ev = torch.cuda.Event()
                gathered_ev.record(cs)
            ready = [((r + d) % W, gathered_ev) for d in range(1, W)]
        x_shard.record_stream(cs)
        gathered.record_stream(cs)
        # Every rank multiplies every block with the same [m, K] x [K, N] shape, so cuBLAS
        # takes the same path everywhere and the output is bitwise identical across ranks.
        _mm(x_shard, w, out[r * m:(r + 1) * m], bias)
        for j, ev in ready:
            main.wait_event(ev)
            _mm(gathered[j * m:(j + 1) * m], w, out[j * m:(j + 1) * m], bias)
        if how == "copy_engine":
            main.wait_stream(cs)  # the closing barrier: joined for graph capture and ordering
        return out


# ---- gemm_rs ------------------------------------------------------------------------------
_split = tuning.even_bounds


def _barrier_then(comm: Communicator, stream: torch.cuda.Stream, cs: torch.cuda.Stream):
    """A device barrier on `cs` after everything `stream` queued so far. All of a pipeline's
    barriers run on `cs`, one at a time as the one-shot protocol requires. (Between the GEMMs
    on the compute stream instead, they measured no faster: benchmarks/NOTES.md.)"""
    ev = torch.cuda.Event()
    ev.record(stream)
    cs.wait_event(ev)
    with torch.cuda.stream(cs):
        comm.device_barrier()


def _barrier_pull(comm: Communicator, main: torch.cuda.Stream, cs: torch.cuda.Stream,
                  offset: int, dst: torch.Tensor) -> torch.cuda.Event:
    """On `cs`, after what `main` queued so far (this rank's staging writes): a device barrier
    (every peer staged too), then dst = the sum of the peers' staging at `offset`. Returns the
    event main waits on before using dst."""
    _barrier_then(comm, main, cs)
    _pull_sum(comm, offset, dst, cs)
    pulled = torch.cuda.Event()
    pulled.record(cs)
    return pulled


def _release_staging(comm: Communicator, main: torch.cuda.Stream, cs: torch.cuda.Stream):
    """A closing barrier on `cs` (no rank rewrites its staging, in a later call or graph
    replay, while a peer still reads it), then `main` follows `cs`."""
    with torch.cuda.stream(cs):
        comm.device_barrier()
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
      comm:        [barrier][pull c0]  [barrier][pull c1]   ...              [barrier]"""
    W, r = comm.group.size, comm.group.rank
    M, k = x.shape
    m, n = M // W, w.shape[1]
    es = x.element_size()
    xv = x.view(W, m, k)
    chunks = len(bounds) - 1
    cs = _fork(main)
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
        pulled.append(_barrier_pull(comm, main, cs, off + r * (b - a) * n * es, out[a:b]))
        if c:
            own(c - 1)
    own(chunks - 1)
    _release_staging(comm, main, cs)
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
    keep the copy-engine gather and a closing barrier. `out` must be 16-byte aligned."""
    C = _ext.load()
    symm = comm.symm
    W, r = comm.group.size, comm.group.rank
    M, k = x.shape
    n = w.shape[1]
    es = x.element_size()
    row = n * es
    stage = symm.staging(x.dtype, (M, n))
    chunks = len(bounds) - 1
    subs = [[bounds[c] + s for s in _split(bounds[c + 1] - bounds[c], W)] for c in range(chunks)]
    cs = _fork(main)
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
        _barrier_then(comm, main, cs)
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
        pulled.append(_barrier_pull(comm, main, cs, lo * row, stage[lo:hi]))
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
                                 out.data_ptr(), main.cuda_stream)
        return out
    gather(chunks - 1)
    _release_staging(comm, main, cs)
    main.wait_stream(side)
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
    The counters live in the communicator's signal region and are zero between calls; flags
    are zeroed on main each call, so graph replays never see the last call's."""
    C = _ext.load()
    symm = comm.symm
    W, r = comm.group.size, comm.group.rank
    M, k = x.shape
    n = w.shape[1]
    m = M // W
    row = n * x.element_size()
    main = comm.launch_stream()
    stage = symm.staging(x.dtype, (M, n))
    piece_rows = -(-m // pieces)  # the kernels' piece size: ceil, the last piece shorter
    bounds = [min(i * piece_rows, m) for i in range(pieces + 1)]
    dst = _align.aligned_output(out)
    flags = torch.zeros(pieces, dtype=torch.int32, device=x.device) if W == 2 else None
    recv = None if W == 2 else torch.empty((W - 1, m, n), dtype=x.dtype, device=x.device)
    cs = _fork(main)
    for a, b in (((r + 1) * m, M), (0, r * m)):
        if b > a:
            launch_sm90(x[a:b], w, None, stage[a:b], main, comm=comm, signal_row0=a,
                        signal_block_rows=m, signal_pieces=pieces)
    with torch.cuda.stream(cs):
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
        comm.device_barrier()
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


def gemm_rs(x: torch.Tensor, w_shard: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
            group: GroupLike = None, engine: str = "auto",
            chunks: Union[int, Sequence[int], None] = None,
            out: Optional[torch.Tensor] = None, transport: str = "auto") -> torch.Tensor:
    """reduce_scatter(x @ w_shard, rows) (+ bias): x [M, K_local], w_shard [K_local, N], M a
    multiple of the world size; returns this rank's [M / world, N] block of the sum.
    transport (overlap engine): "auto" (copy engine when the communicator has staging_bytes
    >= M * N * itemsize, else NCCL), "nccl" or "copy_engine". chunks: pipeline depth of the
    overlap engine (default from the tuning table: "chunks" for NCCL, "ce_chunks" for the copy
    engine, whose chunks the table's wave model may cut unevenly), or pieces per block of the
    fused engine (default one per 2048 rows, at most MAX_SIGNAL_PIECES). The copy-engine
    overlap also takes a list of row counts summing to M / world: the chunks' rows, as given."""
    if _compiling():
        return _compiled(torch.ops.fusedist.gemm_rs, x, w_shard, bias, get_communicator(group),
                         engine, transport, chunks, out)
    op = "gemm_rs"
    if transport not in TRANSPORTS:
        raise ValueError(f"fusedist.gemm_rs: transport must be one of {TRANSPORTS}, got "
                         f"{transport!r}")
    comm = get_communicator(group)
    _validate(op, comm, x, w_shard, bias, "x", "w_shard")
    W = comm.group.size
    M, k = x.shape
    n = w_shard.shape[1]
    if M % W:
        raise ValueError(f"fusedist.gemm_rs: x has {M} rows, not a multiple of the world size "
                         f"{W}; pad M to a multiple of {W}")
    m = M // W
    out = _out(op, out, (m, n), x)
    if out.numel() == 0:
        return out  # M (and N) are the same on every rank: every rank skips the collective
    how = _transport(op, comm, M * n * x.element_size(), transport) \
        if comm.device.type == "cuda" else "nccl"
    fused_why_not = _fused_rs_why_not(comm, x, w_shard) if comm.device.type == "cuda" else \
        "CPU tensors"
    eng = _engine(op, engine, M, n, k, comm, fused_why_not=fused_why_not,
                  copy_engine_ok=how == "copy_engine")
    with nvtx_range(f"fusedist.gemm_rs.{eng}"):
        if comm.device.type == "cpu":
            part = x.float() @ w_shard.float()
            res = torch.empty((m, n), dtype=torch.float32)
            _cpu_reduce_scatter(comm, part, res)
            if bias is not None:
                res += bias.float()
            return out.copy_(res)
        if eng == "fused":
            C = _chunks(op, _rs_fused_pieces(m) if chunks is None else chunks, comm, M, n, k,
                        rows=m)
            return _rs_fused(comm, x, w_shard, bias, out, min(C, _ext.load().MAX_SIGNAL_PIECES))
        if eng == "unfused":
            part = torch.matmul(x, w_shard)
            comm.nccl.reduce_scatter(part, out)
            return out.add_(bias) if bias is not None else out
        if how == "copy_engine":
            # Each chunk is multiplied as pieces of [rows, N]: cut where they fill GEMM waves.
            bounds = _ce_bounds(op, chunks, comm, M, n, k, m, "M / world", wave_cols=n)
            _rs_copy_engine(comm, x, w_shard, out, comm.launch_stream(), bounds)
            return out.add_(bias) if bias is not None else out
        C = _chunks(op, chunks, comm, M, n, k, rows=m)
        bounds = _split(m, C)
        xv = x.view(W, m, k)
        main = torch.cuda.current_stream(x.device)
        cs = _fork(main)
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


def _cpu_reduce_scatter(comm, part, res):
    """gloo lacks reduce_scatter: all_reduce then take this rank's block (reference path)."""
    torch.distributed.all_reduce(part, group=comm.group.pg)
    m = res.shape[0]
    r = comm.group.rank
    res.copy_(part[r * m:(r + 1) * m])
    return res


# ---- gemm_ar ------------------------------------------------------------------------------
AR_TRANSPORTS = ("auto", "collective", "copy_engine")


def gemm_ar(x: torch.Tensor, w_shard: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
            group: GroupLike = None, engine: str = "auto",
            chunks: Union[int, Sequence[int], None] = None,
            out: Optional[torch.Tensor] = None, transport: str = "auto") -> torch.Tensor:
    """all_reduce(x @ w_shard) (+ bias): x [M, K_local], w_shard [K_local, N]; returns [M, N],
    bitwise the same on every rank. transport (overlap engine): "collective" (each chunk
    all-reduced by the communicator: fusedist's symmetric kernels or NCCL by size),
    "copy_engine" (per chunk a copy-engine reduce-scatter, the reduction folded into the own
    rows' GEMM, and a copy-engine all-gather; needs staging_bytes >= M * N * itemsize), or
    "auto" (the copy engine when the staging fits). chunks: pipeline depth (default from the
    tuning table); the copy-engine transport also takes a list of row counts summing to M."""
    if _compiling():
        return _compiled(torch.ops.fusedist.gemm_ar, x, w_shard, bias, get_communicator(group),
                         engine, transport, chunks, out)
    op = "gemm_ar"
    if transport not in AR_TRANSPORTS:
        raise ValueError(f"fusedist.gemm_ar: transport must be one of {AR_TRANSPORTS}, got "
                         f"{transport!r}")
    comm = get_communicator(group)
    _validate(op, comm, x, w_shard, bias, "x", "w_shard")
    M, k = x.shape
    n = w_shard.shape[1]
    out = _out(op, out, (M, n), x)
    if out.numel() == 0:
        return out  # M (and N) are the same on every rank: every rank skips the collective
    how = "collective"
    if comm.device.type == "cuda" and comm.group.size > 1:
        how = _transport(op, comm, M * n * x.element_size(), transport, "collective")
    eng = _engine(op, engine, M, n, k, comm, _fused_ar_why_not(comm, x, w_shard),
                  copy_engine_ok=how == "copy_engine")
    with nvtx_range(f"fusedist.gemm_ar.{eng}"):
        if eng == "fused":
            return launch_decode(comm, x, w_shard, bias, out, comm.launch_stream())
        if comm.device.type == "cpu" or eng == "unfused":
            torch.matmul(x, w_shard, out=out)
            comm.all_reduce(out, out=out)
            return out.add_(bias) if bias is not None else out
        if how == "copy_engine":
            bounds = _ce_bounds(op, chunks, comm, M, n, k, M, "M")
            # The closing kernel stores 16-byte vectors into out, and every rank must take the
            # same path: an out that is not 16-byte aligned on this rank (alignment can differ
            # between ranks) goes through an aligned buffer instead of changing the path.
            dst = _align.aligned_output(out)
            _ar_copy_engine(comm, x, w_shard, dst, comm.launch_stream(), bounds)
            if dst is not out:
                out.copy_(dst)
            return out.add_(bias) if bias is not None else out
        C = _chunks(op, chunks, comm, M, n, k)
        main = torch.cuda.current_stream(x.device)
        cs = _fork(main)
        by_rows = M >= 2 * C * 64
        if by_rows:
            C = max(1, min(C, M))
            bounds = _split(M, C)
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
