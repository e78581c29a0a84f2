"""ag_gemm / gemm_rs / gemm_ar and the tensor-parallel linears, on every rank (CPU/gloo or one
GPU per rank). Every rank rebuilds every rank's inputs from seeds for the float64 reference."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _checks import (CPU_ONLY, NEEDS_COMPILE, NEEDS_GRAPHS, NEEDS_NCCL,  # noqa: E402
                     PERSISTENT_HOPPER, assert_identical_across_ranks, captured, check, emulated,
                     expect_mismatch, expect_timeout, fresh, main, not_emulated, rank_seed, skip)

import torch  # noqa: E402

import fusedist  # noqa: E402
from fusedist.nn import ColumnParallelLinear, RowParallelLinear  # noqa: E402
from fusedist.ops.gemm import gemm as fd_gemm  # noqa: E402
from tolerances import GEMM_REL, gemm_err  # noqa: E402


def engines(rt):
    return ("unfused", "overlap", "auto") if rt.device.type == "cuda" else ("auto",)


def dtypes(rt):
    return (torch.bfloat16, torch.float16) if rt.device.type == "cuda" else (torch.float32,
                                                                               torch.bfloat16)


# (rows per rank m, K, N): odd, not multiples of tiles or of the world size; one large enough
# that the overlap engine's chunks are real GEMMs.
SHAPES = ((1, 72, 40), (37, 200, 136), (129, 1000, 776))


def hopper_peers(rt) -> bool:
    """The fused engines on the Hopper GEMM run here: NVLink peers on sm_90 GPUs."""
    return rt.device.type == "cuda" and rt.tp.size >= 2 and \
        torch.cuda.get_device_capability(rt.device)[0] == 9


def poison(t):
    return t.fill_(float("nan"))


def check_mixed_graph(rt, seed, what, m, k, n, dt, replays, ag, rs, ar=None, ag_b=None):
    """A CUDA graph of ag(x) -> rs(rx) [-> ar(rx)] -> ag_b(x2) (ag_b defaults to ag), all on one
    communicator, replayed with fresh inputs and outputs poisoned before each replay. Every
    output is checked against float64; the ag_gemm and gemm_ar outputs also for bitwise
    identity across ranks."""
    W, me, dev = rt.tp.size, rt.tp.rank, rt.device
    ag_b = ag_b or ag
    sx = torch.zeros((m, k), dtype=dt, device=dev)
    sx2 = torch.zeros((m, k), dtype=dt, device=dev)
    sw = torch.zeros((k, n), dtype=dt, device=dev)
    srx = torch.zeros((W * m, k), dtype=dt, device=dev)
    got = {}

    def body():
        got["a"] = ag(sx, sw)
        got["rs"] = rs(srx, sw)
        if ar is not None:
            got["ar"] = ar(srx, sw)
        got["b"] = ag_b(sx2, sw)

    g = captured(body)
    for i in range(replays):
        s = (seed, what, i)
        xs = [fresh((m, k), dt, dev, rank_seed(s, "x", p)) for p in range(W)]
        x2s = [fresh((m, k), dt, dev, rank_seed(s, "x2", p)) for p in range(W)]
        rxs = [fresh((W * m, k), dt, dev, rank_seed(s, "rx", p)) for p in range(W)]
        w = fresh((k, n), dt, dev, rank_seed(s, "w"))
        sx.copy_(xs[me])
        sx2.copy_(x2s[me])
        srx.copy_(rxs[me])
        sw.copy_(w)
        for o in got.values():
            o.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        for key, parts in (("a", xs), ("b", x2s)):
            assert gemm_err(got[key], torch.cat(parts).double() @ w.double()) < \
                GEMM_REL[dt], f"{what}: ag_gemm {key}, replay {i}"
            assert_identical_across_ranks(rt, got[key], f"{what}: ag_gemm {key}, replay {i}")
        full = sum(x.double() for x in rxs) @ w.double()
        assert gemm_err(got["rs"], full[me * m:(me + 1) * m]) < GEMM_REL[dt], \
            f"{what}: gemm_rs, replay {i}"
        if ar is not None:
            assert gemm_err(got["ar"], full) < GEMM_REL[dt], f"{what}: gemm_ar, replay {i}"
            assert_identical_across_ranks(rt, got["ar"], f"{what}: gemm_ar, replay {i}")
    del g


def check_rs_blocks(rt, y, full, what):
    """gemm_rs across ranks: rank r's output is block r of the one reduced matrix. Every rank
    checks every rank's block (all-gathered), so a block that landed on the wrong rank, or a
    rank whose sum differs, fails on all of them."""
    dt = y.dtype
    blocks = rt.tp.all_gather_object(y.cpu())
    got = torch.cat(blocks)
    err = gemm_err(got, full.cpu())
    assert got.shape == full.shape and err < GEMM_REL[dt], \
        f"{what}: the ranks' blocks together: rel err {err:.3g}"


def check_rs_copy_engine(rt, comm, s, m, k, n, dt, chunks, with_bias):
    """gemm_rs on the copy-engine overlap of `comm` against float64, output poisoned first."""
    W, me, dev = rt.tp.size, rt.tp.rank, rt.device
    M = W * m
    s = (*s, str(dt), m, k, n, str(chunks))
    xs = [fresh((M, k), dt, dev, rank_seed(s, "x", p)) for p in range(W)]
    ws = [fresh((k, n), dt, dev, rank_seed(s, "w", p)) for p in range(W)]
    b = fresh((n,), dt, dev, rank_seed(s, "b")) if with_bias else None
    full = sum(x.double() @ w.double() for x, w in zip(xs, ws))
    if b is not None:
        full += b.double()
    out = poison(torch.empty((m, n), dtype=dt, device=dev))
    y = fusedist.gemm_rs(xs[me], ws[me], b, group=comm, engine="overlap",
                         transport="copy_engine", chunks=chunks, out=out)
    err = gemm_err(y, full[me * m:(me + 1) * m])
    assert y is out and err < GEMM_REL[dt], \
        f"gemm_rs copy_engine {dt} {m} {k} {n} chunks={chunks}: rel err {err:.3g}"
    check_rs_blocks(rt, y, full, f"gemm_rs copy_engine {dt} {m} {k} {n} chunks={chunks}")


@check
@not_emulated(NEEDS_NCCL)
def ag_gemm_matches_reference(rt, seed):
    W, me, dev = rt.tp.size, rt.tp.rank, rt.device
    for eng in engines(rt):
        for dt in dtypes(rt):
            for m, k, n in SHAPES:
                for with_bias in (False, True):
                    s = (seed, "ag", eng, str(dt), m, k, n, with_bias)
                    xs = [fresh((m, k), dt, dev, rank_seed(s, p)) for p in range(W)]
                    w = fresh((k, n), dt, dev, rank_seed(s, "w"))
                    b = fresh((n,), dt, dev, rank_seed(s, "b")) if with_bias else None
                    ref = torch.cat(xs).double() @ w.double()
                    if b is not None:
                        ref += b.double()
                    out = poison(torch.empty((W * m, n), dtype=dt, device=dev))
                    y = fusedist.ag_gemm(xs[me], w, b, engine=eng, out=out)
                    what = f"ag_gemm {eng} {dt} m={m} K={k} N={n} bias={with_bias}"
                    err = gemm_err(y, ref)
                    assert y is out and err < GEMM_REL[dt], f"{what}: rel err {err:.3g}"
                    assert_identical_across_ranks(rt, y, what)


@check
@not_emulated(NEEDS_GRAPHS)
def copy_engine_transport_matches_reference(rt, seed):
    """Overlap engine with copy-engine transfers (symmetric staging, device barriers): ag_gemm's
    all-gather, gemm_rs's reduce-scatter and gemm_ar's reduce-scatter + all-gather."""
    if rt.device.type != "cuda" or rt.tp.size < 2:
        skip("needs CUDA tensors on 2 or more ranks")
    W, me, dev = rt.tp.size, rt.tp.rank, rt.device
    ce = fusedist.Communicator(rt.tp, max_bytes=1 << 20, staging_bytes=1 << 20)
    for dt in (torch.bfloat16, torch.float16):
        for m, k, n in SHAPES + ((0, 64, 40),):
            for with_bias in (False, True):
                s = (seed, "ag-ce", str(dt), m, k, n, with_bias)
                xs = [fresh((m, k), dt, dev, rank_seed(s, p)) for p in range(W)]
                w = fresh((k, n), dt, dev, rank_seed(s, "w"))
                b = fresh((n,), dt, dev, rank_seed(s, "b")) if with_bias else None
                ref = torch.cat(xs).double() @ w.double()
                if b is not None:
                    ref += b.double()
                out = poison(torch.empty((W * m, n), dtype=dt, device=dev))
                y = fusedist.ag_gemm(xs[me], w, b, group=ce, engine="overlap",
                                     transport="copy_engine", out=out)
                what = f"ag_gemm copy_engine {dt} m={m} K={k} N={n} bias={with_bias}"
                if m:
                    err = gemm_err(y, ref)
                    assert err < GEMM_REL[dt], f"{what}: rel err {err:.3g}"
                assert_identical_across_ranks(rt, y, what)
    # gemm_rs with the copy engine: partials staged per chunk, pulled by their owner, the own
    # block multiplied on top (beta = 1). chunks beyond the rows per block are clamped.
    for dt in (torch.bfloat16, torch.float16):
        for m, k, n in SHAPES:
            for chunks in (None, 1, 2, 3):
                check_rs_copy_engine(rt, ce, (seed, "rs-ce"), m, k, n, dt, chunks, chunks != 2)
    # gemm_ar with the copy engine: per chunk a reduce-scatter into the owners' staging, the
    # owner's GEMM on top, then every rank pulls every reduced sub-block: bitwise the same
    # output everywhere. Odd M (sub-blocks of unequal and of zero rows), chunks > rows. The
    # last chunk is exchanged by staging_gather_kernel; rows of 88 bytes (N = 44) take the
    # copy-engine gather instead. An out 2 bytes off 16-byte alignment, on every rank
    # (chunks=2) or on rank 0 only (chunks=3: the ranks must still take the same path), goes
    # through an aligned buffer.
    for dt in (torch.bfloat16, torch.float16):
        for M, k, n in ((1, 72, 40), (3, 64, 40), (5, 200, 136), (W * 300 + 1, 264, 520),
                        (W * 50 + 3, 96, 44)):
            for chunks in (None, 1, 2, 3, 7):
                s = (seed, "ar-ce", str(dt), M, k, n, chunks)
                xs = [fresh((M, k), dt, dev, rank_seed(s, "x", p)) for p in range(W)]
                ws = [fresh((k, n), dt, dev, rank_seed(s, "w", p)) for p in range(W)]
                b = fresh((n,), dt, dev, rank_seed(s, "b")) if chunks in (None, 3) else None
                ref = sum(x.double() @ w.double() for x, w in zip(xs, ws))
                if b is not None:
                    ref += b.double()
                if chunks == 2 or (chunks == 3 and me == 0):  # contiguous, 2 bytes off
                    out = poison(torch.empty(M * n + 8, dtype=dt, device=dev))[1:M * n + 1]
                    out = out.view(M, n)
                else:
                    out = poison(torch.empty((M, n), dtype=dt, device=dev))
                y = fusedist.gemm_ar(xs[me], ws[me], b, group=ce, engine="overlap",
                                     transport="copy_engine", chunks=chunks, out=out)
                what = f"gemm_ar copy_engine {dt} M={M} K={k} N={n} chunks={chunks}"
                err = gemm_err(y, ref)
                assert y is out and err < GEMM_REL[dt], f"{what}: rel err {err:.3g}"
                assert_identical_across_ranks(rt, y, what)
    # Back-to-back calls reuse the staging: 20 calls with fresh inputs, checked after all ran.
    m, k, n, dt = 37, 200, 136, torch.bfloat16
    outs, refs = [], []
    for i in range(20):
        s = (seed, "ag-ce-loop", i)
        xs = [fresh((m, k), dt, dev, rank_seed(s, p)) for p in range(W)]
        w = fresh((k, n), dt, dev, rank_seed(s, "w"))
        outs.append(fusedist.ag_gemm(xs[me], w, group=ce, engine="overlap",
                                     transport="copy_engine"))
        refs.append(torch.cat(xs).double() @ w.double())
    for i, (y, ref) in enumerate(zip(outs, refs)):
        assert gemm_err(y, ref) < GEMM_REL[dt], f"copy-engine ag_gemm call {i}"
    # A CUDA graph with two copy-engine ag_gemm calls, replayed with fresh inputs.
    ce_kw = {"group": ce, "engine": "overlap", "transport": "copy_engine"}
    check_mixed_graph(rt, seed, "ag-ce-graph", m, k, n, dt, 10,
                      ag=lambda x, w: fusedist.ag_gemm(x, w, **ce_kw),
                      rs=lambda x, w: fusedist.gemm_rs(x, w, chunks=3, **ce_kw),
                      ar=lambda x, w: fusedist.gemm_ar(x, w, chunks=3, **ce_kw))
    # The shard must fit the staging; the error names the fix.
    try:
        fusedist.ag_gemm(torch.ones(1024, 1024, device=dev, dtype=dt), torch.ones(1024, 8,
                         device=dev, dtype=dt), group=ce, engine="overlap",
                         transport="copy_engine")
    except ValueError as e:
        assert "staging_bytes>=" in str(e), str(e)
    else:
        raise AssertionError("no ValueError for a shard larger than the staging")
    ce.close()


@check
@not_emulated(NEEDS_GRAPHS)
def wave_cut_pieces_match_reference(rt, seed):
    """The copy-engine overlaps with chunks cut by a wave model (tuning.wave_row_bounds) or
    given as row counts: a toy model (16 x 64 tiles, 7 SMs) that makes gemm_rs's 129-row
    blocks split unevenly, and gemm_ar with uneven row counts. Bias, float64 reference,
    outputs poisoned, bitwise identity for gemm_ar, eager and in a CUDA graph with fresh
    inputs."""
    if rt.device.type != "cuda" or rt.tp.size < 2:
        skip("needs CUDA tensors on 2 or more ranks")
    W, me, dev = rt.tp.size, rt.tp.rank, rt.device
    m, k, n = 129, 1000, 776
    model = {"tile_m": 16, "tile_n": 64, "sms": 7}
    ce = fusedist.Communicator(rt.tp, max_bytes=1 << 20, staging_bytes=1 << 21)
    ce.table = {**ce.table, "gemm_comm": {**ce.table.get("gemm_comm", {}), "waves": model}}
    rs_bounds = fusedist.tuning.wave_row_bounds(m, n, 2, model)
    assert rs_bounds != [0, m // 2, m], rs_bounds  # the model does cut
    M = W * m
    for dt in (torch.bfloat16, torch.float16):
        for chunks in (2, [100, 29], [1, 64, 64]):  # 2: the model's bounds, rs_bounds
            check_rs_copy_engine(rt, ce, (seed, "rs-wave"), m, k, n, dt, chunks, True)
        for chunks in ([M - 40, 40], [3, M - 100, 97]):
            s = (seed, "ar-rows", str(dt), str(chunks))
            xs = [fresh((M, k), dt, dev, rank_seed(s, "x", p)) for p in range(W)]
            ws = [fresh((k, n), dt, dev, rank_seed(s, "w", p)) for p in range(W)]
            ref = sum(x.double() @ w.double() for x, w in zip(xs, ws))
            out = poison(torch.empty((M, n), dtype=dt, device=dev))
            y = fusedist.gemm_ar(xs[me], ws[me], group=ce, engine="overlap",
                                 transport="copy_engine", chunks=chunks, out=out)
            what = f"gemm_ar copy_engine {dt} chunks={chunks}"
            err = gemm_err(y, ref)
            assert y is out and err < GEMM_REL[dt], f"{what}: rel err {err:.3g}"
            assert_identical_across_ranks(rt, y, what)
    # Row counts that do not add up name the sum.
    try:
        fusedist.gemm_rs(torch.ones(M, k, device=dev, dtype=torch.bfloat16),
                         torch.ones(k, n, device=dev, dtype=torch.bfloat16), group=ce,
                         engine="overlap", transport="copy_engine", chunks=[m, 1])
    except ValueError as e:
        assert f"sum to M / world ({m})" in str(e), str(e)
    else:
        raise AssertionError("no ValueError for row counts that do not sum to M / world")
    kw = {"group": ce, "engine": "overlap", "transport": "copy_engine"}
    check_mixed_graph(rt, seed, "wave-graph", m, k, n, torch.bfloat16, 6,
                      ag=lambda x, w: fusedist.ag_gemm(x, w, **kw),
                      rs=lambda x, w: fusedist.gemm_rs(x, w, chunks=2, **kw),
                      ar=lambda x, w: fusedist.gemm_ar(x, w, chunks=[M - 50, 50], **kw))
    ce.close()


@check
@not_emulated(NEEDS_NCCL)
def gemm_rs_matches_reference(rt, seed):
    W, me, dev = rt.tp.size, rt.tp.rank, rt.device
    for eng in engines(rt):
        for dt in dtypes(rt):
            for m, k, n in SHAPES:
                M = W * m
                s = (seed, "rs", eng, str(dt), m, k, n)
                xs = [fresh((M, k), dt, dev, rank_seed(s, "x", p)) for p in range(W)]
                ws = [fresh((k, n), dt, dev, rank_seed(s, "w", p)) for p in range(W)]
                b = fresh((n,), dt, dev, rank_seed(s, "b"))
                full = sum(x.double() @ w.double() for x, w in zip(xs, ws)) + b.double()
                ref = full[me * m:(me + 1) * m]
                for chunks in ((None, 3) if eng == "overlap" else (None,)):
                    out = poison(torch.empty((m, n), dtype=dt, device=dev))
                    y = fusedist.gemm_rs(xs[me], ws[me], b, engine=eng, chunks=chunks, out=out)
                    err = gemm_err(y, ref)
                    assert err < GEMM_REL[dt], f"gemm_rs {eng} {dt} {m} {k} {n} chunks={chunks}: " \
                                               f"rel err {err:.3g}"
                    check_rs_blocks(rt, y, full, f"gemm_rs {eng} {dt} {m} {k} {n} chunks={chunks}")


@check
@not_emulated(NEEDS_NCCL)
def gemm_ar_matches_reference(rt, seed):
    W, me, dev = rt.tp.size, rt.tp.rank, rt.device
    for eng in engines(rt):
        for dt in dtypes(rt):
            # decode-sized M (column chunks) and prefill-sized M (row chunks)
            for M, k, n in ((1, 72, 40), (5, 200, 136), (W * 300 + 1, 264, 520)):
                s = (seed, "ar", eng, str(dt), M, k, n)
                xs = [fresh((M, k), dt, dev, rank_seed(s, "x", p)) for p in range(W)]
                ws = [fresh((k, n), dt, dev, rank_seed(s, "w", p)) for p in range(W)]
                ref = sum(x.double() @ w.double() for x, w in zip(xs, ws))
                for chunks in ((None, 3) if eng == "overlap" else (None,)):
                    out = poison(torch.empty((M, n), dtype=dt, device=dev))
                    y = fusedist.gemm_ar(xs[me], ws[me], engine=eng, chunks=chunks, out=out)
                    what = f"gemm_ar {eng} {dt} M={M} K={k} N={n} chunks={chunks}"
                    err = gemm_err(y, ref)
                    assert err < GEMM_REL[dt], f"{what}: rel err {err:.3g}"
                    assert_identical_across_ranks(rt, y, what)


@check
@not_emulated(NEEDS_NCCL)
def overlap_in_cuda_graph_fresh_inputs(rt, seed):
    if rt.device.type != "cuda":
        skip("needs CUDA tensors")
    W, me, dev, dt = rt.tp.size, rt.tp.rank, rt.device, torch.bfloat16
    m, k, n = 129, 1000, 776
    sx = torch.zeros((m, k), dtype=dt, device=dev)
    sw = torch.zeros((k, n), dtype=dt, device=dev)
    rx = torch.zeros((W * m, k), dtype=dt, device=dev)
    outs = {}

    def body():
        outs["ag"] = fusedist.ag_gemm(sx, sw, engine="overlap")
        outs["rs"] = fusedist.gemm_rs(rx, sw, engine="overlap", chunks=3)
        outs["ar"] = fusedist.gemm_ar(rx, sw, engine="overlap", chunks=3)

    g = captured(body)
    for i in range(5):
        s = (seed, "graph", i)
        xs = [fresh((m, k), dt, dev, rank_seed(s, "x", p)) for p in range(W)]
        rxs = [fresh((W * m, k), dt, dev, rank_seed(s, "rx", p)) for p in range(W)]
        w = fresh((k, n), dt, dev, rank_seed(s, "w"))
        sx.copy_(xs[me])
        rx.copy_(rxs[me])
        sw.copy_(w)
        for o in outs.values():
            o.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        ref_ag = torch.cat(xs).double() @ w.double()
        ref_ar = sum(x.double() for x in rxs) @ w.double()
        assert gemm_err(outs["ag"], ref_ag) < GEMM_REL[dt], f"graph ag replay {i}"
        assert gemm_err(outs["ar"], ref_ar) < GEMM_REL[dt], f"graph ar replay {i}"
        assert gemm_err(outs["rs"], ref_ar[me * m:(me + 1) * m]) < GEMM_REL[dt], \
            f"graph rs replay {i}"
    del g


@check
@not_emulated(NEEDS_NCCL)
def parallel_linears_match_full_layer(rt, seed):
    W, dev = rt.tp.size, rt.device
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    fin, fout, M = 96 * W, 40 * W, 2 * W + 2
    s = (seed, "linear")
    w1 = fresh((fout, fin), dt, dev, rank_seed(s, "w1"))
    b1 = fresh((fout,), dt, dev, rank_seed(s, "b1"))
    w2 = fresh((fin, fout), dt, dev, rank_seed(s, "w2"))
    b2 = fresh((fin,), dt, dev, rank_seed(s, "b2"))
    x = fresh((M, fin), dt, dev, rank_seed(s, "x"))  # replicated input
    col = ColumnParallelLinear.from_full(w1, b1)
    row = RowParallelLinear.from_full(w2, b2, input_is_parallel=True)
    h_ref = x.double() @ w1.double().t() + b1.double()
    y_ref = h_ref @ w2.double().t() + b2.double()
    y = row(col(x))  # the Megatron MLP pattern: column -> row, one all-reduce
    err = gemm_err(y, y_ref)
    assert err < 2 * GEMM_REL[dt], f"column->row linear: rel err {err:.3g}"
    full = ColumnParallelLinear.from_full(w1, b1, gather_output=True)
    err = gemm_err(full(x), h_ref)
    assert err < GEMM_REL[dt], f"column gather_output: rel err {err:.3g}"
    # Sequence parallel: column takes this rank's row shard, row reduce-scatters the output.
    m = M // W
    me = rt.tp.rank
    sp_col = ColumnParallelLinear.from_full(w1, b1, sequence_parallel=True)
    sp_row = RowParallelLinear.from_full(w2, b2, sequence_parallel=True)
    y_sp = sp_row(sp_col(x[me * m:(me + 1) * m].contiguous()))
    err = gemm_err(y_sp, y_ref[me * m:(me + 1) * m])
    assert err < 2 * GEMM_REL[dt], f"sequence-parallel linears: rel err {err:.3g}"


# ---- gemm_ar engine='fused' (GPU): the one-kernel decode GEMM + all-reduce ------------------
# M across the four tile configurations and their edges; K not a multiple of the 64-wide stage,
# N not a multiple of the 64-column strip; both weight layouts ([K, N], and the .t() of an
# nn.Linear [N, K] weight).
# ag_gemm engine="fused" (gemm_sm90.cuh): rows per rank m, K, N. Odd m (tiles straddle the
# rank blocks and the copy pieces), K and N not multiples of the 128 x 256 x 64 tile; the last
# one has 512 tiles over the persistent CTAs, so tiles wait on pieces mid-run.
AG_FUSED_SHAPES = tuple(sh for sh in ((1, 72, 40), (37, 200, 136), (129, 1000, 776),
                                      (1031, 264, 1032), (4096, 1024, 2048))
                        if sh[0] <= int(os.environ.get("FUSEDIST_TEST_MAX_ROWS", 1 << 30)))


def _back_to_back(dt, what, step, calls=10):
    """step(i) -> (output, float64 reference) for call i; all calls are issued before any
    output is checked, so nothing waits between them."""
    pairs = [step(i) for i in range(calls)]
    for i, (y, ref) in enumerate(pairs):
        assert gemm_err(y, ref) < GEMM_REL[dt], f"{what} back-to-back call {i}"


def _needs_staging(rt, what, call):
    """call(small) on a communicator with 1 KB of staging must raise a ValueError naming
    staging_bytes (the fix); `what` is the failure message if it runs instead."""
    small = fusedist.Communicator(rt.tp, max_bytes=1 << 20, staging_bytes=1024)
    try:
        call(small)
    except ValueError as e:
        assert "staging_bytes" in str(e), str(e)
    else:
        raise AssertionError(what)
    finally:
        small.close()


@check
@not_emulated(PERSISTENT_HOPPER)
def ag_gemm_fused_matches_reference(rt, seed):
    """One persistent wgmma GEMM over the gathered rows, each tile waiting for the copy-engine
    flags of its rows: every chunking, both weight layouts, bias, eager, back to back and in a
    CUDA graph replayed with fresh inputs. Output bitwise the same on every rank."""
    if not hopper_peers(rt):
        skip("needs Hopper GPUs with peer access")
    W, me, dev = rt.tp.size, rt.tp.rank, rt.device
    ce = fusedist.Communicator(rt.tp, max_bytes=1 << 20, staging_bytes=16 << 20)
    for dt in (torch.bfloat16, torch.float16):
        for m, k, n in AG_FUSED_SHAPES:
            for chunks in (None, 1, 2, 3):
                layout = "nk" if chunks == 2 else "kn"
                with_bias = chunks != 1
                s = (seed, "ag-fused", str(dt), m, k, n, chunks)
                xs = [fresh((m, k), dt, dev, rank_seed(s, p)) for p in range(W)]
                w = _weights((k, n), layout, dt, dev, rank_seed(s, "w"))
                b = fresh((n,), dt, dev, rank_seed(s, "b")) if with_bias else None
                ref = torch.cat(xs).double() @ w.double()
                if b is not None:
                    ref += b.double()
                out = poison(torch.empty((W * m, n), dtype=dt, device=dev))
                y = fusedist.ag_gemm(xs[me], w, b, group=ce, engine="fused", chunks=chunks,
                                     out=out)
                what = (f"ag_gemm fused {dt} m={m} K={k} N={n} chunks={chunks} w={layout} "
                        f"bias={with_bias}")
                err = gemm_err(y, ref)
                assert y is out and err < GEMM_REL[dt], f"{what}: rel err {err:.3g}"
                assert_identical_across_ranks(rt, y, what)
    # Back to back: 10 calls with fresh inputs, nothing waited for between them.
    m, k, n, dt = 300, 520, 264, torch.bfloat16

    def step(i):
        s = (seed, "ag-fused-loop", i)
        xs = [fresh((m, k), dt, dev, rank_seed(s, p)) for p in range(W)]
        w = fresh((k, n), dt, dev, rank_seed(s, "w"))
        return (fusedist.ag_gemm(xs[me], w, group=ce, engine="fused", chunks=1 + i % 3),
                torch.cat(xs).double() @ w.double())
    _back_to_back(dt, "fused ag_gemm", step)
    # A CUDA graph: two fused ag_gemm calls around a copy-engine gemm_rs, fresh inputs per
    # replay (the flags are zeroed inside the graph, so a replay never sees the last one's).
    check_mixed_graph(rt, seed, "ag-fused-graph", m, k, n, dt, 8,
                      ag=lambda x, w: fusedist.ag_gemm(x, w, group=ce, engine="fused", chunks=2),
                      ag_b=lambda x, w: fusedist.ag_gemm(x, w, group=ce, engine="fused"),
                      rs=lambda x, w: fusedist.gemm_rs(x, w, group=ce, engine="overlap",
                                                       transport="copy_engine", chunks=2))
    # Without staging for the shard the fused engine says why, naming the fix.
    _needs_staging(rt, "ag_gemm(engine='fused') ran without staging for the shard",
                   lambda small: fusedist.ag_gemm(
                       torch.zeros((m, k), dtype=dt, device=dev),
                       torch.zeros((k, n), dtype=dt, device=dev), group=small, engine="fused"))
    ce.close()


@check
@not_emulated(PERSISTENT_HOPPER)
def gemm_rs_fused_matches_reference(rt, seed):
    """The peers' blocks multiplied into staging, every tile counted on its owner as it lands,
    the owner pulling finished pieces and multiplying its own block on top: every chunking
    (pieces), both weight layouts, bias, odd M (tiles straddle blocks and pieces), eager,
    back to back with changing pieces (the counters are cleared after each call), in a CUDA
    graph with fresh inputs, and the staging error."""
    if not hopper_peers(rt):
        skip("needs Hopper GPUs with peer access")
    W, me, dev = rt.tp.size, rt.tp.rank, rt.device
    ce = fusedist.Communicator(rt.tp, max_bytes=1 << 20, staging_bytes=40 << 20)
    for dt in (torch.bfloat16, torch.float16):
        for m, k, n in AG_FUSED_SHAPES:
            M = W * m
            for chunks in (None, 1, 2, 3):
                layout = "nk" if chunks == 2 else "kn"
                with_bias = chunks != 1
                s = (seed, "rs-fused", str(dt), m, k, n, chunks)
                xs = [fresh((M, k), dt, dev, rank_seed(s, "x", p)) for p in range(W)]
                ws = [_weights((k, n), layout, dt, dev, rank_seed(s, "w", p)) for p in range(W)]
                b = fresh((n,), dt, dev, rank_seed(s, "b")) if with_bias else None
                full = sum(x.double() @ w.double() for x, w in zip(xs, ws))
                ref = full[me * m:(me + 1) * m]
                if b is not None:
                    ref = ref + b.double()
                out = poison(torch.empty((m, n), dtype=dt, device=dev))
                y = fusedist.gemm_rs(xs[me], ws[me], b, group=ce, engine="fused", chunks=chunks,
                                     out=out)
                what = (f"gemm_rs fused {dt} m={m} K={k} N={n} chunks={chunks} w={layout} "
                        f"bias={with_bias}")
                err = gemm_err(y, ref)
                assert y is out and err < GEMM_REL[dt], f"{what}: rel err {err:.3g}"
    # Back to back: 10 calls, fresh inputs, pieces 1..3, nothing waited for between them.
    m, k, n, dt = 300, 520, 264, torch.bfloat16

    def step(i):
        s = (seed, "rs-fused-loop", i)
        xs = [fresh((W * m, k), dt, dev, rank_seed(s, "x", p)) for p in range(W)]
        ws = [fresh((k, n), dt, dev, rank_seed(s, "w", p)) for p in range(W)]
        return (fusedist.gemm_rs(xs[me], ws[me], group=ce, engine="fused", chunks=1 + i % 3),
                sum(x.double() @ w.double() for x, w in zip(xs, ws))[me * m:(me + 1) * m])
    _back_to_back(dt, "fused gemm_rs", step)
    # A CUDA graph: fused ag_gemm -> fused gemm_rs -> copy-engine ag_gemm, fresh inputs per
    # replay, outputs poisoned (the counters must be zero again at the end of every replay).
    check_mixed_graph(rt, seed, "rs-fused-graph", m, k, n, dt, 8,
                      ag=lambda x, w: fusedist.ag_gemm(x, w, group=ce, engine="fused"),
                      rs=lambda x, w: fusedist.gemm_rs(x, w, group=ce, engine="fused", chunks=2),
                      ag_b=lambda x, w: fusedist.ag_gemm(x, w, group=ce, engine="overlap",
                                                         transport="copy_engine"))
    # Without staging for the partials the fused engine says why, naming the fix.
    _needs_staging(rt, "gemm_rs(engine='fused') ran without staging for the partials",
                   lambda small: fusedist.gemm_rs(
                       torch.zeros((W * m, k), dtype=dt, device=dev),
                       torch.zeros((k, n), dtype=dt, device=dev), group=small, engine="fused"))
    ce.close()


FUSED_MS = (1, 7, 16, 17, 33, 64, 65, 128)
FUSED_KN = ((72, 40), (808, 296), (4104, 520))


def _weights(shape_kn, layout, dt, dev, seed):
    k, n = shape_kn
    if layout == "kn":
        return fresh((k, n), dt, dev, seed)
    return fresh((n, k), dt, dev, seed).t()  # an nn.Linear weight, used as weight.t()


@check
@emulated
def gemm_ar_fused_matches_reference(rt, seed):
    if rt.device.type != "cuda":
        skip("needs CUDA tensors")
    W, me, dev = rt.tp.size, rt.tp.rank, rt.device
    for dt in (torch.bfloat16, torch.float16):
        for M in FUSED_MS:
            for k, n in FUSED_KN:
                for layout in ("kn", "nk"):
                    with_bias = (M + k) % 2 == 1
                    s = (seed, "fused", str(dt), M, k, n, layout)
                    xs = [fresh((M, k), dt, dev, rank_seed(s, "x", p)) for p in range(W)]
                    ws = [_weights((k, n), layout, dt, dev, rank_seed(s, "w", p))
                          for p in range(W)]
                    b = fresh((n,), dt, dev, rank_seed(s, "b")) if with_bias else None
                    ref = sum(x.double() @ w.double() for x, w in zip(xs, ws))
                    if b is not None:
                        ref += b.double()
                    out = poison(torch.empty((M, n), dtype=dt, device=dev))
                    y = fusedist.gemm_ar(xs[me], ws[me], b, engine="fused", out=out)
                    what = f"gemm_ar fused {dt} M={M} K={k} N={n} w={layout} bias={with_bias}"
                    err = gemm_err(y, ref)
                    assert y is out and err < GEMM_REL[dt], f"{what}: rel err {err:.3g}"
                    assert_identical_across_ranks(rt, y, what)


@check
@emulated
def gemm_no_comm_matches_reference(rt, seed):
    """fusedist.gemm(kernel="decode"): the fused kernel without the exchange."""
    if rt.device.type != "cuda":
        skip("needs CUDA tensors")
    dev = rt.device
    for dt in (torch.bfloat16, torch.float16):
        for M in FUSED_MS:
            for k, n in FUSED_KN:
                for layout in ("kn", "nk"):
                    s = (seed, "gemm", str(dt), M, k, n, layout, rt.tp.rank)
                    x = fresh((M, k), dt, dev, rank_seed(s, "x"))
                    w = _weights((k, n), layout, dt, dev, rank_seed(s, "w"))
                    b = fresh((n,), dt, dev, rank_seed(s, "b"))
                    out = poison(torch.empty((M, n), dtype=dt, device=dev))
                    y = fd_gemm(x, w, b, out=out, kernel="decode")
                    err = gemm_err(y, x.double() @ w.double() + b.double())
                    assert err < GEMM_REL[dt], f"gemm {dt} M={M} K={k} N={n} w={layout}: " \
                                               f"rel err {err:.3g}"


@check
@emulated
def gemm_ar_fused_misaligned_views(rt, seed):
    """Views that start off a 16-byte boundary run through aligned copies, same result."""
    if rt.device.type != "cuda":
        skip("needs CUDA tensors")
    W, me, dev, dt = rt.tp.size, rt.tp.rank, rt.device, torch.bfloat16
    M, k, n = 5, 200, 136
    s = (seed, "fused-misaligned")
    xs = [fresh((M * k + 1,), dt, dev, rank_seed(s, "x", p))[1:].view(M, k) for p in range(W)]
    ws = [fresh((k, n), dt, dev, rank_seed(s, "w", p)) for p in range(W)]
    ref = sum(x.double() @ w.double() for x, w in zip(xs, ws))
    out_base = poison(torch.empty((M * n + 1,), dtype=dt, device=dev))
    out = out_base[1:].view(M, n)
    y = fusedist.gemm_ar(xs[me], ws[me], engine="fused", out=out)
    assert gemm_err(y, ref) < GEMM_REL[dt], "misaligned fused gemm_ar"
    assert_identical_across_ranks(rt, y, "misaligned fused gemm_ar")


@check
@not_emulated(NEEDS_GRAPHS)
def gemm_ar_fused_in_cuda_graph_fresh_inputs(rt, seed):
    """Graph: fused gemm_ar -> one-shot all-reduce -> fused gemm_ar (nn.Linear layout, bias) on
    one communicator, so the kernels share and rotate its buffers; 30 replays, fresh inputs."""
    if rt.device.type != "cuda":
        skip("needs CUDA tensors")
    W, me, dev, dt = rt.tp.size, rt.tp.rank, rt.device, torch.bfloat16
    M, k, n = 9, 808, 296
    comm = fusedist.get_communicator()
    sx = torch.zeros((M, k), dtype=dt, device=dev)
    sw1 = torch.zeros((k, n), dtype=dt, device=dev)
    sw2t = torch.zeros((n, k), dtype=dt, device=dev)
    sb = torch.zeros((n,), dtype=dt, device=dev)
    outs = {}

    def body():
        outs["a"] = fusedist.gemm_ar(sx, sw1, engine="fused")
        outs["r"] = comm.all_reduce(outs["a"], algo="one_shot")
        outs["b"] = fusedist.gemm_ar(sx, sw2t.t(), sb, engine="fused")

    g = captured(body)
    for i in range(30):
        s = (seed, "fused-graph", i)
        xs = [fresh((M, k), dt, dev, rank_seed(s, "x", p)) for p in range(W)]
        w1s = [fresh((k, n), dt, dev, rank_seed(s, "w1", p)) for p in range(W)]
        w2s = [fresh((n, k), dt, dev, rank_seed(s, "w2", p)) for p in range(W)]
        b = fresh((n,), dt, dev, rank_seed(s, "b"))
        sx.copy_(xs[me])
        sw1.copy_(w1s[me])
        sw2t.copy_(w2s[me])
        sb.copy_(b)
        for o in outs.values():
            o.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        ref_a = sum(x.double() @ w.double() for x, w in zip(xs, w1s))
        ref_b = sum(x.double() @ w.double().t() for x, w in zip(xs, w2s)) + b.double()
        assert gemm_err(outs["a"], ref_a) < GEMM_REL[dt], f"graph fused a, replay {i}"
        assert gemm_err(outs["r"], W * ref_a) < GEMM_REL[dt], f"graph all_reduce, replay {i}"
        assert gemm_err(outs["b"], ref_b) < GEMM_REL[dt], f"graph fused b, replay {i}"
        assert_identical_across_ranks(rt, outs["b"], f"graph fused b, replay {i}")
    del g


@check
@emulated
def gemm_ar_fused_bad_inputs(rt, seed):
    if rt.device.type != "cuda" or rt.tp.size < 2:
        skip("needs CUDA tensors on 2 or more ranks")
    dev = rt.device
    bf = torch.bfloat16
    x = torch.ones(4, 64, device=dev, dtype=bf)
    w = torch.ones(64, 32, device=dev, dtype=bf)
    cases = [
        (lambda: fusedist.gemm_ar(torch.ones(129, 64, device=dev, dtype=bf), w, engine="fused"),
         "at most 128"),
        (lambda: fusedist.gemm_ar(x.float(), w.float(), engine="fused"), "bfloat16 or float16"),
        (lambda: fusedist.gemm_ar(torch.ones(4, 60, device=dev, dtype=bf),
                                  torch.ones(60, 32, device=dev, dtype=bf), engine="fused"),
         "multiples of 8"),
        (lambda: fusedist.gemm_ar(x, torch.ones(64, 64, device=dev, dtype=bf)[:, ::2],
                                  engine="fused"), "strides"),
        (lambda: fusedist.ag_gemm(x, w, engine="fused"), "staging_bytes"),
        # The default communicator has no staging for the partials.
        (lambda: fusedist.gemm_rs(torch.ones(2 * rt.tp.size, 64, device=dev, dtype=bf), w,
                                  engine="fused"), "staging_bytes"),
    ]
    for fn, match in cases:
        try:
            fn()
        except ValueError as e:
            assert match in str(e), (match, str(e))
        else:
            raise AssertionError(f"no ValueError for {match!r}")
    # Too large for a small communicator's one-shot slot: named, with the fix.
    small = fusedist.Communicator(rt.tp, max_bytes=4096)
    try:
        fusedist.gemm_ar(torch.ones(64, 64, device=dev, dtype=bf),
                         torch.ones(64, 512, device=dev, dtype=bf), group=small, engine="fused")
    except ValueError as e:
        assert "one-shot slot" in str(e), str(e)
    else:
        raise AssertionError("no ValueError for an output larger than the slot")
    small.close()


MISMATCH_TIMEOUT_S = 20.0


def _run_mismatches(rt, cases, **comm_kwargs):
    """Each case(comm) -> (call, this rank's call in the message's words, a later call, a
    check of call()'s output or None) runs on a fresh communicator: every rank must get
    CollectiveMismatchError naming its own call before the timeout, the GPU must drain, and
    the later call must be refused (the communicator failed for good)."""
    me, ranks = rt.tp.rank, rt.tp.ranks
    for name, case in cases:
        comm = fusedist.Communicator(rt.tp, timeout_s=MISMATCH_TIMEOUT_S, **comm_kwargs)
        call, mine, again, post = case(comm)
        y, _ = expect_mismatch(comm, call, MISMATCH_TIMEOUT_S, f"rank {ranks[me]} called {mine}")
        if post is not None and y is not None:
            post(y)
        try:
            again()
        except fusedist.CollectiveMismatchError:
            pass
        else:
            raise AssertionError(f"{name}: a failed communicator accepted another call")
        comm.close()


@check
@emulated
def gemm_ar_fused_call_mismatch(rt, seed):
    """Ranks calling the fused decode gemm_ar with another N, M or dtype, or a one-shot
    all_reduce against it: the kernel's call descriptors make every rank raise
    CollectiveMismatchError naming its call, in bounded time; vectors the smaller call never
    sent are NaN; the communicator refuses later calls; a fresh one works."""
    if rt.device.type != "cuda" or rt.tp.size < 2:
        skip("needs CUDA tensors on 2 or more ranks")
    W, me, dev, bf = rt.tp.size, rt.tp.rank, rt.device, torch.bfloat16
    K = 256

    def gemm_ar(M, N, dt=bf):
        def case(comm):
            x = fresh((M, K), dt, dev, rank_seed(seed, "mm-x", me, M))
            w = fresh((K, N), dt, dev, rank_seed(seed, "mm-w", me, N))
            out = poison(torch.empty((M, N), dtype=dt, device=dev))
            dname = str(dt).split(".")[-1]
            return (lambda: fusedist.gemm_ar(x, w, group=comm, engine="fused", out=out),
                    f"gemm_ar (the fused kernel) with M = {M}, N = {N}, {dname}",
                    lambda: fusedist.gemm_ar(x, w, group=comm, engine="fused"), None)
        return case

    def another_n(comm):
        call, mine, again, _ = gemm_ar(4, 512 + 64 * me)(comm)

        def post(y):  # rank 0 pushed 4 x 512 elements: the rest never arrived here
            assert torch.isnan(y.view(-1)[4 * 512:]).all(), "vectors rank 0 never sent"
        return call, mine, again, post

    def against_one_shot(comm):
        if me == 0:
            return gemm_ar(4, 512)(comm)
        x = torch.ones(4 * 512, dtype=bf, device=dev)
        return (lambda: comm.all_reduce(x, algo="one_shot"),
                "one_shot all_reduce of 2048 bfloat16 elements",
                lambda: comm.all_reduce(x, algo="one_shot"), None)

    _run_mismatches(rt, [
        ("another N", another_n),
        ("another M (another tile configuration)", lambda c: gemm_ar(4 + 16 * me, 512)(c)),
        ("another dtype", lambda c: gemm_ar(4, 512, bf if me == 0 else torch.float16)(c)),
        ("gemm_ar against a one-shot all_reduce", against_one_shot),
    ], max_bytes=1 << 20)
    comm = fusedist.Communicator(rt.tp, max_bytes=1 << 20)
    xs = [fresh((4, K), bf, dev, rank_seed(seed, "mm-after", p)) for p in range(W)]
    ws = [fresh((K, 512), bf, dev, rank_seed(seed, "mm-after-w", p)) for p in range(W)]
    y = fusedist.gemm_ar(xs[me], ws[me], group=comm, engine="fused")
    ref = sum(x.double() @ w.double() for x, w in zip(xs, ws))
    assert gemm_err(y, ref) < GEMM_REL[bf], "a fresh communicator after a mismatch"
    comm.close()


@check
@emulated
def copy_engine_call_mismatch(rt, seed):
    """Ranks in different copy-engine calls (ag_gemm against gemm_rs, another M, N or shard):
    the pipelines' device barriers are call checks carrying the op's descriptor, so every rank
    raises CollectiveMismatchError naming its call, in bounded time, and later calls are
    refused."""
    if rt.device.type != "cuda" or rt.tp.size < 2:
        skip("needs CUDA tensors on 2 or more ranks")
    W, me, dev, bf = rt.tp.size, rt.tp.rank, rt.device, torch.bfloat16
    K, N = 256, 512
    ce = dict(engine="overlap", transport="copy_engine")

    def ag(m):
        def case(comm):
            x = fresh((m, K), bf, dev, rank_seed(seed, "ce-ag", me, m))
            w = fresh((K, N), bf, dev, rank_seed(seed, "ce-w", me))
            return (lambda: fusedist.ag_gemm(x, w, group=comm, **ce),
                    f"ag_gemm (the copy-engine overlap) with M = {W * m}, K = {K}, bfloat16",
                    lambda: fusedist.ag_gemm(x, w, group=comm, **ce), None)
        return case

    def rs(m):
        def case(comm):
            x = fresh((W * m, K), bf, dev, rank_seed(seed, "ce-rs", me, m))
            w = fresh((K, N), bf, dev, rank_seed(seed, "ce-w", me))
            return (lambda: fusedist.gemm_rs(x, w, group=comm, chunks=1, **ce),
                    f"gemm_rs (the copy-engine overlap, 1 chunk) with M = {W * m}, N = {N}, "
                    "bfloat16", lambda: fusedist.gemm_rs(x, w, group=comm, chunks=1, **ce), None)
        return case

    def ar(n):
        def case(comm):
            M = 16 * W
            x = fresh((M, K), bf, dev, rank_seed(seed, "ce-ar", me))
            w = fresh((K, n), bf, dev, rank_seed(seed, "ce-ar-w", me, n))
            return (lambda: fusedist.gemm_ar(x, w, group=comm, chunks=1, **ce),
                    f"gemm_ar (the copy-engine overlap, 1 chunk) with M = {M}, N = {n}, "
                    "bfloat16", lambda: fusedist.gemm_ar(x, w, group=comm, chunks=1, **ce), None)
        return case

    _run_mismatches(rt, [
        ("ag_gemm against gemm_rs", lambda c: (ag(64) if me == 0 else rs(64))(c)),
        ("gemm_rs, another M", lambda c: rs(32 + 8 * me)(c)),
        ("gemm_ar, another N", lambda c: ar(N + 64 * me)(c)),
        ("ag_gemm, another shard", lambda c: ag(64 + 8 * me)(c)),
    ], max_bytes=1 << 20, staging_bytes=1 << 20)


@check
@not_emulated(PERSISTENT_HOPPER)
def fused_hopper_call_mismatch(rt, seed):
    """The fused Hopper engines: ag_gemm against gemm_rs, and gemm_rs with another M; their
    call checks (ag_gemm's first barrier, gemm_rs's opening one) make every rank raise
    CollectiveMismatchError naming its call, in bounded time."""
    if not hopper_peers(rt):
        skip("needs Hopper GPUs with peer access")
    W, me, dev, bf = rt.tp.size, rt.tp.rank, rt.device, torch.bfloat16
    K, N = 256, 512

    def ag(m):
        def case(comm):
            x = fresh((m, K), bf, dev, rank_seed(seed, "fz-ag", me, m))
            w = fresh((K, N), bf, dev, rank_seed(seed, "fz-w", me))
            return (lambda: fusedist.ag_gemm(x, w, group=comm, engine="fused"),
                    f"ag_gemm (the fused kernel, 1 piece) with M = {W * m}, K = {K}, bfloat16",
                    lambda: fusedist.ag_gemm(x, w, group=comm, engine="fused"), None)
        return case

    def rs(m):
        def case(comm):
            x = fresh((W * m, K), bf, dev, rank_seed(seed, "fz-rs", me, m))
            w = fresh((K, N), bf, dev, rank_seed(seed, "fz-w", me))
            return (lambda: fusedist.gemm_rs(x, w, group=comm, engine="fused", chunks=1),
                    f"gemm_rs (the fused kernel, 1 piece) with M = {W * m}, N = {N}, bfloat16",
                    lambda: fusedist.gemm_rs(x, w, group=comm, engine="fused", chunks=1), None)
        return case

    _run_mismatches(rt, [
        ("fused ag_gemm against fused gemm_rs", lambda c: (ag(64) if me == 0 else rs(64))(c)),
        ("fused gemm_rs, another M", lambda c: rs(64 + 128 * me)(c)),
    ], max_bytes=1 << 20, staging_bytes=4 << 20)


@check
@emulated
def uneven_k_shards_are_not_a_mismatch(rt, seed):
    """Row-parallel shards of different K on different ranks are legal (the sum over ranks of
    x_r @ w_r is what gemm_ar / gemm_rs compute, and K sets no peer offset), so the call
    descriptors leave K out: the fused decode gemm_ar and the copy-engine gemm_ar / gemm_rs
    match the float64 reference with K = 256 + 64 x rank, gemm_ar bitwise the same on every
    rank."""
    if rt.device.type != "cuda" or rt.tp.size < 2:
        skip("needs CUDA tensors on 2 or more ranks")
    W, me, dev, bf = rt.tp.size, rt.tp.rank, rt.device, torch.bfloat16
    comm = fusedist.Communicator(rt.tp, max_bytes=1 << 20, staging_bytes=1 << 20)
    ks = [256 + 64 * p for p in range(W)]
    for what, M, run in (
            ("gemm_ar fused", 4, lambda x, w: fusedist.gemm_ar(x, w, group=comm, engine="fused")),
            ("gemm_ar copy_engine", 16 * W, lambda x, w: fusedist.gemm_ar(
                x, w, group=comm, engine="overlap", transport="copy_engine", chunks=2)),
            ("gemm_rs copy_engine", 16 * W, lambda x, w: fusedist.gemm_rs(
                x, w, group=comm, engine="overlap", transport="copy_engine", chunks=2))):
        xs = [fresh((M, ks[p]), bf, dev, rank_seed(seed, what, "x", p)) for p in range(W)]
        ws = [fresh((ks[p], 520), bf, dev, rank_seed(seed, what, "w", p)) for p in range(W)]
        ref = sum(x.double() @ w.double() for x, w in zip(xs, ws))
        y = run(xs[me], ws[me])
        if what.startswith("gemm_rs"):
            m = M // W
            ref = ref[me * m:(me + 1) * m]
        err = gemm_err(y, ref)
        assert err < GEMM_REL[bf], f"{what} with K = {ks}: rel err {err:.3g}"
        if what.startswith("gemm_ar"):
            assert_identical_across_ranks(rt, y, what)
    comm.check()
    comm.close()


@check
@emulated
def zz_gemm_ar_fused_peer_skips_call_times_out(rt, seed):
    """Rank 0 skips the fused call: the others get CommunicatorTimeoutError in bounded time and
    NaN outputs, never a hang."""
    if rt.device.type != "cuda" or rt.tp.size < 2:
        skip("needs CUDA tensors on 2 or more ranks")
    comm = fusedist.Communicator(rt.tp, max_bytes=1 << 20, timeout_s=2.0)
    x = torch.ones(4, 256, device=rt.device, dtype=torch.bfloat16)
    w = torch.ones(256, 512, device=rt.device, dtype=torch.bfloat16)
    if rt.tp.rank != 0:
        y = expect_timeout(comm, lambda: fusedist.gemm_ar(x, w, group=comm, engine="fused"), 2.0,
                           "gemm_ar (fused)")
        assert torch.isnan(y).all(), "outputs of a timed-out call must be NaN"
    comm.close()


@check
@not_emulated(PERSISTENT_HOPPER)
def zz_ag_gemm_fused_peer_skips_call_times_out(rt, seed):
    """Rank 0 skips a fused ag_gemm: the others' first barrier times out, their GEMM still
    finishes (its peer rows are pulled from stale staging, so the output is undefined), and
    the communicator reports CommunicatorTimeoutError in bounded time, never a hang."""
    if not hopper_peers(rt):
        skip("needs Hopper GPUs with peer access")
    comm = fusedist.Communicator(rt.tp, max_bytes=1 << 20, staging_bytes=1 << 20,
                                 timeout_s=2.0)
    x = torch.ones(64, 256, device=rt.device, dtype=torch.bfloat16)
    w = torch.ones(256, 512, device=rt.device, dtype=torch.bfloat16)
    if rt.tp.rank != 0:
        expect_timeout(comm, lambda: fusedist.ag_gemm(x, w, group=comm, engine="fused"), 2.0)
    comm.close()


@check
@not_emulated(PERSISTENT_HOPPER)
def zz_gemm_rs_fused_peer_skips_call_times_out(rt, seed):
    """Rank 0 skips a fused gemm_rs: the others' opening call check times out (rank 0 never
    comes; the counter waits behind it give up at once), their GEMMs finish on whatever the
    rows hold (undefined output), and the communicator reports CommunicatorTimeoutError in
    bounded time, never a hang."""
    if not hopper_peers(rt):
        skip("needs Hopper GPUs with peer access")
    W = rt.tp.size
    comm = fusedist.Communicator(rt.tp, max_bytes=1 << 20, staging_bytes=1 << 20,
                                 timeout_s=2.0)
    x = torch.ones(64 * W, 256, device=rt.device, dtype=torch.bfloat16)
    w = torch.ones(256, 512, device=rt.device, dtype=torch.bfloat16)
    if rt.tp.rank != 0:
        expect_timeout(comm, lambda: fusedist.gemm_rs(x, w, group=comm, engine="fused"), 2.0,
                       "call check")
    comm.close()


@check
@emulated
def zz_gemm_ar_copy_engine_peer_skips_call_times_out(rt, seed):
    """Rank 0 skips a copy-engine gemm_ar: the others' first barrier times out, so does the
    closing gather's handshake (at once: the communicator already failed), which sets rank 0's
    rows to NaN. CommunicatorTimeoutError in bounded time, never a hang."""
    if rt.device.type != "cuda" or rt.tp.size < 2:
        skip("needs CUDA tensors on 2 or more ranks")
    W = rt.tp.size
    comm = fusedist.Communicator(rt.tp, max_bytes=1 << 20, staging_bytes=1 << 20,
                                 timeout_s=2.0)
    M = 16 * W
    x = torch.ones(M, 256, device=rt.device, dtype=torch.bfloat16)
    w = torch.ones(256, 512, device=rt.device, dtype=torch.bfloat16)
    if rt.tp.rank != 0:
        y = expect_timeout(comm, lambda: fusedist.gemm_ar(x, w, group=comm, engine="overlap",
                                                          transport="copy_engine", chunks=1),
                           2.0)
        assert torch.isnan(y[:M // W]).all(), "rank 0's rows of a timed-out gather must be NaN"
    comm.close()


@check
@not_emulated(NEEDS_NCCL)
def empty_batch_on_every_op(rt, seed):
    """M = 0 on every rank (a batch with no tokens): every op and engine returns an empty,
    correctly shaped output without a collective, and the next call on the same communicator
    (with tokens) still matches the reference, so no rank was left waiting in one."""
    W, me, dev = rt.tp.size, rt.tp.rank, rt.device
    dt = torch.bfloat16
    k, n = 64, 48
    w = fresh((k, n), dt, dev, rank_seed(seed, "empty-w", me))
    b = fresh((n,), dt, dev, rank_seed(seed, "empty-b"))
    x0 = torch.empty((0, k), dtype=dt, device=dev)
    engs = engines(rt) + (("fused",) if hopper_peers(rt) else ())
    for eng in engs:
        for bias in (None, b):
            assert fusedist.gemm_ar(x0, w, bias, engine=eng).shape == (0, n), eng
            assert fusedist.gemm_rs(x0, w, bias, engine=eng).shape == (0, n), eng
            assert fusedist.ag_gemm(x0, w, bias, engine=eng).shape == (0, n), eng
            out = torch.empty((0, n), dtype=dt, device=dev)
            assert fusedist.gemm_ar(x0, w, bias, engine=eng, out=out) is out
    assert fd_gemm(x0, w, b).shape == (0, n)
    # The linears with no tokens, 2-D and 3-D.
    fin, fout = 16 * W, 8 * W
    w1 = fresh((fout, fin), dt, dev, rank_seed(seed, "empty-w1"))
    w2 = fresh((fin, fout), dt, dev, rank_seed(seed, "empty-w2"))
    col = ColumnParallelLinear.from_full(w1)
    colg = ColumnParallelLinear.from_full(w1, gather_output=True)
    row = RowParallelLinear.from_full(w2)
    rowx = RowParallelLinear.from_full(w2, input_is_parallel=False)
    sp_col = ColumnParallelLinear.from_full(w1, sequence_parallel=True)
    sp_row = RowParallelLinear.from_full(w2, sequence_parallel=True)
    for lead in ((0,), (2, 0)):
        x = torch.empty(lead + (fin,), dtype=dt, device=dev)
        assert col(x).shape == lead + (fout // W,)
        assert colg(x).shape == lead + (fout,)
        assert row(col(x)).shape == lead + (fin,)
        assert rowx(torch.empty(lead + (fout,), dtype=dt, device=dev)).shape == lead + (fin,)
    assert sp_col(torch.empty((0, fin), dtype=dt, device=dev)).shape == (0, fout // W)
    assert sp_row(torch.empty((0, fout // W), dtype=dt, device=dev)).shape == (0, fin)
    # The collectives are still matched: a call with tokens on the same communicator.
    M = 3
    xs = [fresh((M, k), dt, dev, rank_seed(seed, "empty-x", p)) for p in range(W)]
    ws = [fresh((k, n), dt, dev, rank_seed(seed, "empty-w", p)) for p in range(W)]
    ref = sum(x.double() @ v.double() for x, v in zip(xs, ws))
    assert gemm_err(fusedist.gemm_ar(xs[me], w), ref) < GEMM_REL[dt], "gemm_ar after M = 0"


def _compiled(fn):
    # aot_eager traces the graph (fake kernels, functionalisation) without Inductor's codegen.
    return torch.compile(fn, fullgraph=True, backend="aot_eager")


@check
@not_emulated(NEEDS_COMPILE)
def every_op_under_torch_compile(rt, seed):
    """Every public op inside torch.compile(fullgraph=True) reaches torch.ops.fusedist, and
    gives what the eager call gives (out= written and returned; async_op=True refused)."""
    torch._dynamo.reset()
    W, me, dev = rt.tp.size, rt.tp.rank, rt.device
    dt = torch.bfloat16
    m, k, n = 5, 64, 40
    s = (seed, "compile")
    x = fresh((W * m, k), dt, dev, rank_seed(s, "x", me))
    xs = fresh((m, k), dt, dev, rank_seed(s, "xs", me))
    w = fresh((k, n), dt, dev, rank_seed(s, "w", me))
    b = fresh((n,), dt, dev, rank_seed(s, "b"))
    cases = {
        "ag_gemm": lambda: fusedist.ag_gemm(xs, w, b),
        "gemm_rs": lambda: fusedist.gemm_rs(x, w, b),
        "gemm_ar": lambda: fusedist.gemm_ar(x, w, b),
        "gemm_ar chunks": lambda: fusedist.gemm_ar(x, w, chunks=2, engine="unfused"),
        "gemm": lambda: fd_gemm(x, w, b),
        "all_reduce": lambda: fusedist.all_reduce(x),
    }
    for name, fn in cases.items():
        want = fn()
        got = _compiled(fn)()
        assert torch.equal(got, want), f"{name} under torch.compile differs from eager"
    # out= is written and returned.
    for name, fn in {
            "gemm_ar": lambda o: fusedist.gemm_ar(x, w, b, out=o),
            "gemm_rs": lambda o: fusedist.gemm_rs(x, w, b, out=o),
            "ag_gemm": lambda o: fusedist.ag_gemm(xs, w, b, out=o),
            "gemm": lambda o: fd_gemm(x, w, b, out=o),
            "all_reduce": lambda o: fusedist.all_reduce(x, out=o)}.items():
        want = fn(None)
        out = poison(torch.empty_like(want))
        got = _compiled(lambda o: fn(o))(out)
        assert torch.equal(out, want), f"{name}(out=) under torch.compile did not write out"
        assert torch.equal(got, want)
    acc = fresh((W * m, n), dt, dev, rank_seed(s, "acc"))
    want = acc.clone()
    fd_gemm(x, w, b, out=want, accumulate=True)
    got = acc.clone()
    _compiled(lambda o: fd_gemm(x, w, b, out=o, accumulate=True))(got)
    assert torch.equal(got, want), "gemm(accumulate=True) under torch.compile"
    y = x.clone()
    fusedist.all_reduce_(y)
    y2 = x.clone()
    _compiled(lambda t: fusedist.all_reduce_(t))(y2)
    assert torch.equal(y2, y), "all_reduce_ under torch.compile"
    # all_reduce_add_rmsnorm, bf16 and FP8 output.
    h = fresh((m, 64), dt, dev, rank_seed(s, "h", me))
    res = fresh((m, 64), dt, dev, rank_seed(s, "res"))
    g = fresh((64,), dt, dev, rank_seed(s, "g"))
    want = fusedist.all_reduce_add_rmsnorm(h, res, g, 1e-6)
    got = _compiled(lambda: fusedist.all_reduce_add_rmsnorm(h, res, g, 1e-6))()
    assert all(torch.equal(a, c) for a, c in zip(got, want)), "all_reduce_add_rmsnorm compiled"
    fp8 = fusedist.ops.allreduce_rmsnorm.FP8
    want = fusedist.all_reduce_add_rmsnorm(h, res, g, 1e-6, out_dtype=fp8)
    got = _compiled(lambda: fusedist.all_reduce_add_rmsnorm(h, res, g, 1e-6, out_dtype=fp8))()
    assert len(got) == 3 and got[0].dtype == fp8, "FP8 all_reduce_add_rmsnorm compiled"
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    # async_op=True cannot return its handle from a graph: a clear error.
    try:
        _compiled(lambda: fusedist.all_reduce(x, async_op=True))()
    except Exception as e:  # dynamo wraps the ValueError
        assert "async_op=True is not supported under torch.compile" in str(e), str(e)
    else:
        raise AssertionError("all_reduce(async_op=True) under torch.compile did not raise")
    torch._dynamo.reset()


@check
@emulated
def bad_inputs(rt, seed):
    dev = rt.device
    dt = torch.float32
    x = torch.ones(6, 8, device=dev, dtype=dt)
    cases = [
        (lambda: fusedist.ag_gemm(x, torch.ones(9, 4, device=dev)), ValueError, "[K, N]"),
        (lambda: fusedist.ag_gemm(x, torch.ones(8, 4, device=dev, dtype=torch.float16)),
         ValueError, "must match"),
        (lambda: fusedist.gemm_ar(x, torch.ones(8, 4, device=dev), engine="magic"), ValueError,
         "engine must be"),
        (lambda: fusedist.ag_gemm(x, torch.ones(8, 4, device=dev), transport="carrier pigeon"),
         ValueError, "transport must be"),
        (lambda: fusedist.gemm_rs(x, torch.ones(8, 4, device=dev), transport="nvlink please"),
         ValueError, "transport must be"),
        (lambda: fusedist.gemm_ar(x, torch.ones(8, 4, device=dev), torch.ones(5, device=dev)),
         ValueError, "bias must be"),
        (lambda: fusedist.gemm_ar(x.t(), torch.ones(6, 4, device=dev)), ValueError,
         "non-contiguous"),
    ]
    if rt.tp.size > 1:
        cases.append((lambda: fusedist.gemm_rs(torch.ones(rt.tp.size + 1, 8, device=dev),
                                               torch.ones(8, 4, device=dev)), ValueError,
                      "multiple of the world size"))
    for fn, exc, match in cases:
        try:
            fn()
        except exc as e:
            assert match in str(e), (match, str(e))
        else:
            raise AssertionError(f"no {exc.__name__} for {match!r}")


@check
@not_emulated(CPU_ONLY)
def cpu_mismatched_shards_raise(rt, seed):
    """CPU path: ranks calling ag_gemm / gemm_rs with shards of different sizes get
    CollectiveMismatchError on every rank, naming every rank's call, before gloo sees the call
    (gloo aborts the process on a size mismatch); the communicator stays usable."""
    if rt.device.type != "cpu" or rt.tp.size < 2:
        skip("the CPU path's check, on 2 or more ranks")
    me, W = rt.tp.rank, rt.tp.size
    w = torch.randn(8, 4)
    for op, fn, what in (
            ("ag_gemm", lambda: fusedist.ag_gemm(torch.randn(2 + me, 8), w), "all_gather"),
            ("gemm_rs", lambda: fusedist.gemm_rs(torch.randn(W * (1 + me), 8), w),
             "reduce_scatter")):
        try:
            fn()
        except fusedist.CollectiveMismatchError as e:
            assert f"called {what} of" in str(e), (op, str(e))
        else:
            raise AssertionError(f"{op}: no CollectiveMismatchError for shards of different sizes")
    x = torch.randn(W * 2, 8, generator=torch.Generator().manual_seed(seed))
    out = fusedist.gemm_rs(x, w)
    assert out.shape == (2, 4), f"after a mismatch: gemm_rs gave {tuple(out.shape)}"


if __name__ == "__main__":
    main()
