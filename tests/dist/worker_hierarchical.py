"""fusedist.comm.hierarchical on ranks emulating nodes of 2 (FUSEDIST_NODE_ID and NCCL_HOSTID
node<rank // 2>; CPU ranks with gloo, or GPUs with NCCL): all-reduce, all-gather and reduce-scatter, flat and two-level (chunked
and not), against float64 references on fresh random inputs of odd sizes; results bitwise
identical on every rank; bad arguments named."""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _checks import check, expect_errors, fresh, main, rank_seed  # noqa: E402
from _runtime_util import emulate_nodes  # noqa: E402

import torch  # noqa: E402

from fusedist.comm.hierarchical import HierarchicalCommunicator  # noqa: E402
from tolerances import count_bad  # noqa: E402

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SIZES = (1, 7, 1023, 4099)
VARIANTS = (("flat", None), ("hierarchical", 1), ("hierarchical", 3), ("hierarchical", None),
            ("auto", None))


def identical_on_every_rank(rt, y: torch.Tensor, what: str) -> None:
    bits = y.reshape(-1).contiguous().view(torch.uint8).cpu()
    digest = (bits.numel(), int(bits.long().sum()),
              int((bits.long() * torch.arange(bits.numel()) % 1000003).sum()))
    got = rt.world.all_gather_object(digest)
    assert all(d == got[0] for d in got), f"{what}: results differ across ranks: {got}"


def inputs(rt, seed, what, n, dtype):
    return {r: fresh((n,), dtype, rt.device, rank_seed(seed, what, n, str(dtype), r))
            for r in range(rt.world_size)}


@check
def topology_is_nodes_of_two(rt, seed):
    hc = HierarchicalCommunicator()
    assert (hc.nodes, hc.gpus) == (rt.world_size // 2, 2), (hc.nodes, hc.gpus)
    assert hc.rank_at == [tuple(range(j * 2, j * 2 + 2)) for j in range(hc.nodes)]


@check
def all_reduce_matches_float64(rt, seed):
    hc = HierarchicalCommunicator()
    for dtype in DTYPES:
        for n in SIZES:
            xs = inputs(rt, seed, "ar", n, dtype)
            ref = sum(x.double() for x in xs.values())
            for algo, chunks in VARIANTS:
                what = f"all_reduce {algo}/{chunks} {dtype} n={n}"
                y = hc.all_reduce(xs[rt.rank].clone(), algo=algo, chunks=chunks)
                assert y.shape == (n,) and y.dtype == dtype, what
                bad = count_bad(y, ref, dtype)
                assert bad == 0, f"{what}: {bad} wrong elements"
                identical_on_every_rank(rt, y, what)
    # out=, in place, a 2-D input
    x = fresh((5, 33), torch.float32, rt.device, rank_seed(seed, "2d", rt.rank))
    ref = sum(fresh((5, 33), torch.float32, rt.device, rank_seed(seed, "2d", r)).double()
              for r in range(rt.world_size))
    y = hc.all_reduce(x, algo="hierarchical", chunks=2, out=x)
    assert y is x and count_bad(x, ref, torch.float32) == 0


@check
def all_gather_is_exact(rt, seed):
    hc = HierarchicalCommunicator()
    for dtype in DTYPES:
        for n in SIZES:
            xs = inputs(rt, seed, "ag", n, dtype)
            ref = torch.cat([xs[r] for r in range(rt.world_size)])
            for algo, chunks in VARIANTS:
                y = hc.all_gather(xs[rt.rank], algo=algo, chunks=chunks)
                assert torch.equal(y, ref), f"all_gather {algo}/{chunks} {dtype} n={n}"


@check
def reduce_scatter_matches_float64(rt, seed):
    hc = HierarchicalCommunicator()
    W = rt.world_size
    for dtype in DTYPES:
        for n in SIZES:
            xs = inputs(rt, seed, "rs", n * W, dtype)
            ref = sum(x.double() for x in xs.values()).view(W, n)[rt.rank]
            for algo, chunks in VARIANTS:
                what = f"reduce_scatter {algo}/{chunks} {dtype} n={n}"
                y = hc.reduce_scatter(xs[rt.rank], algo=algo, chunks=chunks)
                assert y.shape == (n,), what
                bad = count_bad(y, ref, dtype)
                assert bad == 0, f"{what}: {bad} wrong elements"
                # every rank's segment, gathered, is the reference's: each was formed once
                full = hc.all_gather(y, algo="flat")
                identical_on_every_rank(rt, full, what)


@check
def bad_arguments_are_named(rt, seed):
    hc = HierarchicalCommunicator()
    dev = rt.device
    x = torch.ones(10, device=dev)
    expect_errors((
            (lambda: hc.all_reduce(x, algo="ring"), "algo must be one of"),
            (lambda: hc.all_reduce(x, chunks=0), "chunks must be an int in 1..64"),
            (lambda: hc.all_reduce(torch.ones(4, 4, device=dev).t()), "non-contiguous"),
            (lambda: hc.all_reduce(torch.ones(3, dtype=torch.int32, device=dev)),
             "dtype torch.int32"),
            (lambda: hc.all_reduce(x, out=torch.empty(3, device=dev)), "out must be a contiguous"),
            (lambda: hc.reduce_scatter(torch.ones(rt.world_size * 3 + 1, device=dev)),
             "not a multiple of the group size")))


@check
def ranks_calling_differently_raise_on_every_rank(rt, seed):
    """Another size, dtype, collective or algo on one rank: every rank raises
    CollectiveMismatchError naming the difference (gloo aborted the process on a size
    mismatch and summed misread bytes on a dtype mismatch); a rank whose own arguments are
    wrong raises its error and the others name it; the communicator works afterwards. (check
    defaults to on for CPU groups; GPU groups run it with check=True.)"""
    import time

    import fusedist

    hc = HierarchicalCommunicator()
    dev, last = rt.device, rt.world_size - 1
    mine = rt.rank == last
    cases = (
        ("size", lambda: hc.all_reduce(torch.ones(10 + mine, device=dev), check=True),
         f"numel: ranks {', '.join(map(str, range(last)))}: 10; rank {last}: 11"),
        ("dtype", lambda: hc.all_reduce(torch.ones(10, device=dev, dtype=torch.bfloat16 if mine
                                                   else torch.float32), check=True),
         "dtype: "),
        ("all_gather size", lambda: hc.all_gather(torch.ones(4 + 2 * mine, device=dev), check=True),
         "numel: "),
        ("reduce_scatter size", lambda: hc.reduce_scatter(
            torch.ones(rt.world_size * (3 + mine), device=dev), check=True), "numel: "),
        ("collective", lambda: (hc.all_gather if mine else hc.all_reduce)(
            torch.ones(8, device=dev), check=True), "call: "),
        ("algo", lambda: hc.all_reduce(torch.ones(8, device=dev),
                                       algo="flat" if mine else "hierarchical", check=True),
         "algo: "))
    for what, call, needle in cases:
        t0 = time.time()
        try:
            call()
        except fusedist.CollectiveMismatchError as e:
            assert needle in str(e) and "were given different calls" in str(e), \
                f"{what}: {str(e)!r} lacks {needle!r}"
        else:
            raise AssertionError(f"{what}: no CollectiveMismatchError")
        assert time.time() - t0 < 20, f"{what}: took {time.time() - t0:.1f} s"
    # A rank's own bad argument: its ValueError there, the mismatch naming it elsewhere.
    try:
        hc.all_reduce(torch.ones(10, device=dev), chunks=0 if mine else None, check=True)
    except ValueError as e:
        assert mine and "chunks must be" in str(e), str(e)
    except fusedist.CollectiveMismatchError as e:
        assert not mine and "chunks must be" in str(e), str(e)
    else:
        raise AssertionError("a rank's bad chunks raised nothing")
    y = hc.all_reduce(torch.ones(10, device=dev) * (rt.rank + 1))
    assert y.tolist() == [float(sum(range(1, rt.world_size + 1)))] * 10


@check
def auto_follows_the_cost_model(rt, seed):
    from fusedist.comm import cost_model

    hc = HierarchicalCommunicator()
    for nbytes in (4, 4 << 10, 1 << 20, 64 << 20):
        algo, k = hc.choose("all_reduce", nbytes)
        t_flat = cost_model.flat(hc.machine, "all_reduce", hc.nodes, hc.gpus, nbytes)
        t_h = cost_model.best_hierarchical(hc.machine, "all_reduce", hc.nodes, hc.gpus,
                                           nbytes)[0]
        assert algo == ("hierarchical" if t_h < t_flat else "flat"), (nbytes, algo, t_h, t_flat)


if __name__ == "__main__":
    emulate_nodes()
    # NCCL must see the emulated nodes as separate hosts too (its network path between them).
    os.environ.setdefault("NCCL_HOSTID", os.environ["FUSEDIST_NODE_ID"])
    main()
