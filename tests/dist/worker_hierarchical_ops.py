"""The fused ops' two-level forms on a tensor-parallel group that spans nodes: ranks emulating
nodes of 2 (FUSEDIST_NODE_ID and NCCL_HOSTID node<rank // 2>), fusedist.init(tp_size=
FUSEDIST_TEST_TP or the world, tp_spans_nodes=True); CPU ranks with gloo or GPUs with NCCL.
all_reduce_add_rmsnorm, gemm_ar, gemm_rs and ag_gemm: the group's own two-level communicator
(auto), and through a HierarchicalCommunicator passed as group=: two-level with 1 and 3 chunks,
and flat; against float64 references on fresh random inputs of odd shapes, bitwise identical
on every rank where the op promises it; the flat engine (engine="unfused") on the same inputs
within the same bounds; unsupported combinations named. Rank 0 ends with the worst relative
error against float64 of each op, form and dtype over the group's ranks (docs/scaling.md's
table: FUSEDIST_TEST_SEED=1, 4 CPU ranks)."""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _checks import (CPU_ONLY, assert_identical_across_ranks, check, expect_errors,  # noqa: E402
                     fresh, main, not_emulated, rank_seed, rmsnorm_reference, skip)
from _runtime_util import emulate_nodes  # noqa: E402

import torch  # noqa: E402

import fusedist  # noqa: E402
from fusedist.comm import hierarchical  # noqa: E402
from fusedist.comm.hierarchical import HierarchicalCommunicator  # noqa: E402
from tolerances import GEMM_REL, TOL_EPILOGUE, count_bad, gemm_err, gemm_rel_err  # noqa: E402

TWO_LEVEL = ("the two-level forms run on torch.distributed process groups (gloo / NCCL), which "
             "emulated ranks do not have")
EPS = 1e-6
# (tokens, hidden): odd, not multiples of the vector width or of the ranks per node
NORM_SHAPES = ((1, 64), (7, 100), (19, 1000), (5, 4099))
# (rows per rank m, K per rank, N): odd, not multiples of tiles or of the group size
GEMM_SHAPES = ((1, 72, 40), (37, 200, 136), (13, 100, 1001))


# (op, "two-level" | "flat", dtype) -> the worst relative Frobenius error seen on this rank
WORST: dict = {}


def record(op: str, variant: str, dtype, out: torch.Tensor, ref: torch.Tensor) -> None:
    key = (op, "flat" if variant in ("flat", "unfused") else "two-level", str(dtype))
    WORST[key] = max(WORST.get(key, 0.0), gemm_rel_err(out, ref))


def dtypes(rt):
    return (torch.bfloat16, torch.float16) if rt.device.type == "cuda" else (
        torch.float32, torch.bfloat16)


def variants(rt):
    """(name, group=) pairs: the group's own two-level communicator, and forced forms."""
    tp = rt.tp
    return (("auto", None),
            ("hierarchical/1", HierarchicalCommunicator(tp, algo="hierarchical", chunks=1)),
            ("hierarchical/3", HierarchicalCommunicator(tp, algo="hierarchical", chunks=3)),
            ("flat", HierarchicalCommunicator(tp, algo="flat")))


@check
@not_emulated(TWO_LEVEL)
def the_group_has_two_levels(rt, seed):
    tp = rt.tp
    hc = hierarchical.of_group(tp)
    assert hc is not None and hierarchical.of_group(tp) is hc, "no cached two-level form"
    assert (hc.nodes, hc.gpus) == (tp.size // 2, 2), (hc.nodes, hc.gpus)
    assert hc.rank_at == [(2 * j, 2 * j + 1) for j in range(hc.nodes)], hc.rank_at
    me = tp.ranks[tp.rank]
    assert hc.intra.ranks == (me // 2 * 2, me // 2 * 2 + 1), hc.intra.ranks
    base = tp.ranks[0]
    assert hc.inter.ranks == tuple(range(base + me % 2, base + tp.size, 2)), hc.inter.ranks
    assert hierarchical.of_group(rt.intra_node) is None
    assert "is on one node" in hierarchical.layout(rt.intra_node)[1]


def norm_reference(rt, tokens, hidden, dtype, seed):
    return rmsnorm_reference(rt.tp, tokens, hidden, dtype, rt.device, seed, EPS)


@check
@not_emulated(TWO_LEVEL)
def allreduce_rmsnorm_matches_float64(rt, seed):
    for name, group in variants(rt):
        for dtype in dtypes(rt) + (torch.float32,) * (rt.device.type == "cuda"):
            for tokens, hidden in NORM_SHAPES:
                what = f"{name} {dtype} {tokens}x{hidden}"
                x, res, w, h_ref, y_ref = norm_reference(rt, tokens, hidden, dtype,
                                                         (seed, name, str(dtype), tokens))
                x0, r0 = x.clone(), res.clone()
                # fused=False: on GPUs whose ranks are all NVLink peers (nodes emulated on one
                # host) the one-level fused kernel would take the call ("auto" then runs the
                # one-level all-reduce; the forced variants stay two-level)
                normed, new_res = fusedist.all_reduce_add_rmsnorm(x, res, w, EPS, group=group,
                                                                  fused=False)
                assert normed.shape == x.shape and normed.dtype == dtype, what
                assert torch.equal(x, x0) and torch.equal(res, r0), f"{what}: inputs modified"
                bad = count_bad(new_res, h_ref, dtype, TOL_EPILOGUE)
                assert bad == 0, f"{what}: residual has {bad} wrong elements"
                bad = count_bad(normed, y_ref, dtype, TOL_EPILOGUE)
                assert bad == 0, f"{what}: normed has {bad} wrong elements"
                record("all_reduce_add_rmsnorm, normed", name, dtype, normed, y_ref)
                record("all_reduce_add_rmsnorm, new residual", name, dtype, new_res, h_ref)
                assert_identical_across_ranks(rt, normed, what)
                assert_identical_across_ranks(rt, new_res, what)
    # a 3-D input, FP8 output, in three chunks
    hc = HierarchicalCommunicator(rt.tp, algo="hierarchical", chunks=3)
    fp8 = torch.float8_e4m3fn
    x, res, w, h_ref, y_ref = norm_reference(rt, 33, 256, torch.bfloat16, (seed, "fp8"))
    q, new_res, scale = fusedist.all_reduce_add_rmsnorm(x.view(3, 11, 256), res.view(3, 11, 256),
                                                        w, EPS, out_dtype=fp8, group=hc)
    assert q.shape == (3, 11, 256) and q.dtype == fp8 and scale.shape == (3, 11)
    q, new_res, scale = q.view(33, 256), new_res.view(33, 256), scale.view(33)
    assert torch.allclose(scale.double(), y_ref.abs().amax(-1) / 448.0, rtol=2e-2), "fp8 scales"
    deq = q.double() * scale.double().unsqueeze(-1)
    ok = (deq - y_ref).abs() <= 0.07 * y_ref.abs() + scale.double().unsqueeze(-1) * 2 ** -6
    assert bool(ok.all()), f"fp8: {int((~ok).sum())} bad elements"
    assert count_bad(new_res, h_ref, torch.bfloat16, TOL_EPILOGUE) == 0
    assert_identical_across_ranks(rt, q.view(torch.uint8), "fp8 out")


def gemm_cases(rt, seed, op):
    """(what, group=, engine=, this rank's x, w, bias or None, the float64 reference of the
    whole output) for every variant (and the flat engine), dtype, shape and bias. ag_gemm: x
    [m, K] per rank, w the same everywhere; gemm_ar / gemm_rs: x [W m, K] with the rank's K
    shard, w its [K, N] shard."""
    W, me = rt.tp.size, rt.tp.rank
    for name, group in variants(rt) + (("unfused", None),):
        engine = "unfused" if name == "unfused" else "auto" if group is None else "hierarchical"
        for dt in dtypes(rt):
            for m, k, n in GEMM_SHAPES:
                for with_bias in (False, True):
                    what = f"{op} {name} {dt} {m}x{k}x{n} bias={with_bias}"
                    s = (seed, what)
                    rows = m if op == "ag_gemm" else W * m
                    xs = [fresh((rows, k), dt, rt.device, rank_seed(s, "x", p)) for p in range(W)]
                    ws = [fresh((k, n), dt, rt.device,
                                rank_seed(s, "w", 0 if op == "ag_gemm" else p)) for p in range(W)]
                    bias = fresh((n,), dt, rt.device, rank_seed(s, "b")) if with_bias else None
                    ref = torch.cat([x.double() for x in xs]) @ ws[0].double() \
                        if op == "ag_gemm" else sum(x.double() @ w.double() for x, w in zip(xs, ws))
                    if with_bias:
                        ref = ref + bias.double()
                    yield what, group, engine, xs[me], ws[me], bias, ref


@check
@not_emulated(TWO_LEVEL)
def gemm_ops_match_float64(rt, seed):
    """gemm_ar, gemm_rs and ag_gemm into NaN-poisoned outputs; gemm_rs against this rank's
    block of the reference, the others also bitwise across ranks."""
    me = rt.tp.rank
    for op in ("gemm_ar", "gemm_rs", "ag_gemm"):
        for what, group, engine, x, w, bias, ref in gemm_cases(rt, seed, op):
            if op == "gemm_rs":
                m = x.shape[0] // rt.tp.size
                ref = ref[me * m:(me + 1) * m]
            out = torch.full(ref.shape, float("nan"), dtype=x.dtype, device=rt.device)
            y = getattr(fusedist, op)(x, w, bias, group=group, engine=engine, out=out)
            assert y is out, what
            err = gemm_err(y, ref)
            assert err <= GEMM_REL[x.dtype], f"{what}: rel err {err:.2e}"
            record(op, what.split()[1], x.dtype, y, ref)
            if op != "gemm_rs":
                assert_identical_across_ranks(rt, y, what)


@check
@not_emulated(TWO_LEVEL)
def unsupported_combinations_are_named(rt, seed):
    dev = rt.device
    hc = HierarchicalCommunicator(rt.tp, algo="hierarchical")
    one_level = HierarchicalCommunicator(rt.intra_node)
    x = torch.ones(rt.tp.size, 8, device=dev)     # rows: a multiple of the group for gemm_rs
    w = torch.ones(8, 8, device=dev)
    expect_errors((
        (lambda: fusedist.gemm_ar(x, w, group=rt.intra_node, engine="hierarchical"),
         "is on one node"),
        (lambda: fusedist.gemm_ar(x, w, chunks=[2, 2]), "chunks as a list of row counts"),
        (lambda: fusedist.gemm_rs(x, w, group=hc, chunks=[1]), "chunks as a list of row counts"),
        (lambda: fusedist.all_reduce_add_rmsnorm(x, x, w[0], 1e-6, group=hc, fused=True),
         "asks for the two-level form"),
        (lambda: HierarchicalCommunicator(rt.tp, algo="ring"), "algo must be one of"),
        (lambda: HierarchicalCommunicator(rt.tp, chunks=0), "chunks must be an int in 1..64"),
        (lambda: one_level.all_reduce_pipelined([torch.zeros(4, device=dev)]), "one level"),
    ))
    if dev.type == "cpu":
        expect_errors(((lambda: fusedist.all_reduce_add_rmsnorm(x, x, w[0], 1e-6, fused=True),
                        "spans nodes"),))


@check
@not_emulated(CPU_ONLY)
def mismatched_calls_are_named(rt, seed):
    if rt.device.type != "cpu":
        skip(CPU_ONLY)
    rows = 4 + (rt.tp.rank == 0)
    x = torch.ones(rows, 8)
    w = torch.ones(8, 8)
    expect_errors(((lambda: fusedist.gemm_ar(x, w, engine="hierarchical"),
                    "called different collectives"),
                   (lambda: fusedist.all_reduce_add_rmsnorm(x, x, w[0], 1e-6),
                    "called different collectives")), errors=fusedist.CollectiveMismatchError)


@check
@not_emulated(TWO_LEVEL)
def zz_report_the_errors(rt, seed):
    """The worst relative errors of the checks above, over the group's ranks (rank 0 prints)."""
    every = rt.tp.all_gather_object(WORST)
    if rt.tp.rank == 0 and rt.rank == 0:
        for key in sorted(every[0]):
            print(f"[errors] {' | '.join(key)} | {max(w[key] for w in every):.1e}", flush=True)


if __name__ == "__main__":
    emulate_nodes()
    # NCCL must see the emulated nodes as separate hosts too (its network path between them).
    os.environ.setdefault("NCCL_HOSTID", os.environ["FUSEDIST_NODE_ID"])
    world = fusedist.detect_launch_env().world_size
    main(tp_size=int(os.environ.get("FUSEDIST_TEST_TP", world)), tp_spans_nodes=True)
