"""all_reduce checks, run on every rank (CPU/gloo or one GPU per rank).

    torchrun --nproc-per-node 2 tests/dist/worker_allreduce.py
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import (assert_identical_across_ranks, captured, check, expect_timeout,  # noqa: E402
                      fresh, main, rank_seed)

import torch  # noqa: E402

import fusedist  # noqa: E402
from tolerances import count_bad  # noqa: E402

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SIZES = tuple(n for n in (1, 7, 1023, 65537, 2**20 + 3)
              if n <= int(os.environ.get("FUSEDIST_TEST_MAX_N", str(1 << 30))))


def algos(rt):
    return ("one_shot", "two_shot", "nccl", "auto") if rt.device.type == "cuda" else ("auto",)


def inputs_and_ref(rt, n, dtype, seed):
    """This rank's input and the float64 sum of every rank's input (recomputed locally)."""
    W, me = rt.tp.size, rt.tp.rank
    xs = [fresh((n,), dtype, rt.device, rank_seed(seed, p)) for p in range(W)]
    ref = torch.zeros(n, dtype=torch.float64, device=rt.device)
    for x in xs:
        ref += x.double()
    return xs[me], ref


@check
def eager_all_algos_dtypes_sizes(rt, seed):
    comm = fusedist.get_communicator()
    for algo in algos(rt):
        for dtype in DTYPES:
            for n in SIZES:
                x, ref = inputs_and_ref(rt, n, dtype, (seed, algo, str(dtype), n))
                x_copy = x.clone()
                out = torch.full_like(x, float("nan"))
                y = fusedist.all_reduce(x, algo=algo, out=out)
                assert y is out
                bad = count_bad(y, ref, dtype)
                assert bad == 0, f"{algo} {dtype} n={n}: {bad} wrong elements"
                assert torch.equal(x, x_copy), f"{algo} {dtype} n={n}: input was modified"
                if algo != "nccl":
                    assert_identical_across_ranks(rt, y, f"{algo} {dtype} n={n}")
    comm.check()


@check
def in_place_and_misaligned(rt, seed):
    for algo in algos(rt):
        for dtype in DTYPES:
            n = 4099
            x, ref = inputs_and_ref(rt, n, dtype, (seed, "inplace", algo, str(dtype)))
            y = fusedist.all_reduce_(x, algo=algo)
            assert y.data_ptr() == x.data_ptr()
            assert count_bad(x, ref, dtype) == 0, f"in-place {algo} {dtype}"
            # A view 1 element into a buffer is not 16-byte aligned.
            base, ref2 = inputs_and_ref(rt, n + 1, dtype, (seed, "mis", algo, str(dtype)))
            view = base[1:]
            out = torch.full_like(view, float("nan"))
            fusedist.all_reduce(view, algo=algo, out=out)
            assert count_bad(out, ref2[1:], dtype) == 0, f"misaligned {algo} {dtype}"


@check
def async_handle(rt, seed):
    for dtype in DTYPES:
        x, ref = inputs_and_ref(rt, 70001, dtype, (seed, "async", str(dtype)))
        h = fusedist.all_reduce(x, async_op=True)
        y = h.wait()
        assert count_bad(y, ref, dtype) == 0, f"async {dtype}"
        # A synchronous call right after an async one must be ordered after it.
        x2, ref2 = inputs_and_ref(rt, 513, dtype, (seed, "async2", str(dtype)))
        h = fusedist.all_reduce(x, async_op=True)
        y2 = fusedist.all_reduce(x2)
        h.wait()
        assert count_bad(y2, ref2, dtype) == 0, f"sync after async {dtype}"


@check
def torch_ops_name_the_communicator(rt, seed):
    """torch.ops.fusedist.* find the communicator by its name, also with several per group."""
    default = fusedist.get_communicator()
    extra = fusedist.Communicator(rt.tp, max_bytes=1 << 20)
    assert extra.name != default.name
    for comm in (extra, default):
        x, ref = inputs_and_ref(rt, 999, torch.float32, (seed, "ops", comm.name))
        y = torch.ops.fusedist.all_reduce(x, comm.name, "auto")
        assert count_bad(y, ref, torch.float32) == 0, comm.name
    extra.close()
    x, ref = inputs_and_ref(rt, 17, torch.float32, (seed, "ops-after-close"))
    assert count_bad(torch.ops.fusedist.all_reduce(x, default.name, "auto"), ref,
                     torch.float32) == 0, "default communicator lost after closing another"
    try:
        torch.ops.fusedist.all_reduce(x, extra.name, "auto")
    except RuntimeError as e:
        assert "no open communicator named" in str(e), str(e)
    else:
        raise AssertionError("a closed communicator's name still resolved")


@check
def bad_input_errors(rt, seed):
    def expect(exc, match, fn):
        try:
            fn()
        except exc as e:
            assert match in str(e), f"message {str(e)!r} lacks {match!r}"
            return
        raise AssertionError(f"expected {exc.__name__} containing {match!r}")

    dev = rt.device
    expect(ValueError, "non-contiguous", lambda: fusedist.all_reduce(
        torch.zeros(8, 8, device=dev).t()))
    expect(TypeError, "dtype torch.int32", lambda: fusedist.all_reduce(
        torch.zeros(8, dtype=torch.int32, device=dev)))
    expect(ValueError, "must match", lambda: fusedist.all_reduce(
        torch.zeros(8, device=dev), out=torch.zeros(9, device=dev)))
    expect(ValueError, "algo must be", lambda: fusedist.all_reduce(
        torch.zeros(8, device=dev), algo="three_shot"))
    expect(TypeError, "torch.Tensor", lambda: fusedist.all_reduce([1.0, 2.0]))
    if dev.type == "cuda":
        expect(ValueError, "is on cpu", lambda: fusedist.all_reduce(torch.zeros(8)))
        other = (dev.index + 1) % torch.cuda.device_count()
        if other != dev.index:
            expect(ValueError, "this rank's device", lambda: fusedist.all_reduce(
                torch.zeros(8, device=f"cuda:{other}")))
        comm = fusedist.get_communicator()
        if comm.symm is not None:
            too_big = comm.capacity("one_shot", torch.float32) // 4 + 4
            expect(ValueError, "max_bytes", lambda: fusedist.all_reduce(
                torch.zeros(too_big, device=dev), algo="one_shot"))


@check
def cuda_graph_fresh_inputs(rt, seed):
    if rt.device.type != "cuda":
        return
    replays = int(os.environ.get("FUSEDIST_TEST_REPLAYS", "1000"))
    for algo in ("one_shot", "two_shot"):
        for dtype in DTYPES:
            n = 8191
            static_x = torch.zeros(n, dtype=dtype, device=rt.device)
            static_y = torch.zeros(n, dtype=dtype, device=rt.device)
            fusedist.all_reduce(static_x, algo=algo, out=static_y)  # warm-up outside capture
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fusedist.all_reduce(static_x, algo=algo, out=static_y)
            bad_total = 0
            for i in range(replays):
                x, ref = inputs_and_ref(rt, n, dtype, (seed, "graph", algo, str(dtype), i))
                static_x.copy_(x)
                static_y.fill_(float("nan"))
                g.replay()
                bad_total += count_bad(static_y, ref, dtype)
            assert bad_total == 0, f"graph {algo} {dtype}: {bad_total} wrong elements over " \
                                   f"{replays} replays"
            assert_identical_across_ranks(rt, static_y, f"graph {algo} {dtype}")
            del g
    fusedist.get_communicator().check()


@check
def cuda_graph_stress(rt, seed):
    """Many replays of a graph of 10 all-reduces on 10 different inputs, mismatches counted
    on the device inside the graph (no host sync per replay)."""
    if rt.device.type != "cuda":
        return
    calls = int(os.environ.get("FUSEDIST_TEST_STRESS_CALLS", "100000"))
    per = 10
    for algo in ("one_shot", "two_shot"):
        dtype, n = torch.bfloat16, 3001
        xs, exp = [], []
        for k in range(per):
            x, ref = inputs_and_ref(rt, n, dtype, (seed, "stress", algo, k))
            xs.append(x)
            exp.append(ref.to(dtype))
        ys = [torch.empty_like(x) for x in xs]
        mism = torch.zeros((), dtype=torch.int64, device=rt.device)
        for x, y in zip(xs, ys):
            fusedist.all_reduce(x, algo=algo, out=y)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for x, y, e in zip(xs, ys, exp):
                fusedist.all_reduce(x, algo=algo, out=y)
                mism.add_((y.view(torch.int16) != e.view(torch.int16)).sum())
        t0 = time.time()
        for _ in range(calls // per):
            g.replay()
        torch.cuda.synchronize()
        dt = time.time() - t0
        fusedist.get_communicator().check()
        assert int(mism) == 0, f"stress {algo}: {int(mism)} mismatches over {calls} calls"
        if rt.rank == 0:
            print(f"    stress {algo}: {calls} calls, 0 mismatches, {dt:.1f}s", flush=True)
        del g


@check
def cuda_graph_replays_changing_inputs(rt, seed):
    """100,000 replays of one captured all-reduce whose input changes inside the graph every
    replay. Inputs are small integers (exact in bf16 and in their sums); every rank holds all
    ranks' inputs, advances them with the same rule, and counts mismatches on the device."""
    if rt.device.type != "cuda":
        return
    replays = int(os.environ.get("FUSEDIST_TEST_GRAPH_REPLAYS", "100000"))
    W, me, dev, dt, n = rt.tp.size, rt.tp.rank, rt.device, torch.bfloat16, 2053
    for algo in ("one_shot", "two_shot"):
        base = []
        for p in range(W):
            g = torch.Generator(device=dev)
            g.manual_seed(rank_seed(seed, "replays", algo, p))
            base.append(torch.randint(0, 8, (n,), generator=g, device=dev).to(dt))
        allx = torch.stack(base)  # [W, n]: every rank's input, on every rank
        x, y = torch.empty(n, dtype=dt, device=dev), torch.empty(n, dtype=dt, device=dev)
        mism = torch.zeros((), dtype=torch.int64, device=dev)

        def body():
            allx.add_(1).remainder_(8)  # this replay's inputs (exact small integers)
            x.copy_(allx[me])
            fusedist.all_reduce(x, algo=algo, out=y)
            mism.add_((y != allx.float().sum(0).to(dt)).sum())

        g = captured(body)
        t0 = time.time()
        for _ in range(replays):
            g.replay()
        torch.cuda.synchronize()
        fusedist.get_communicator().check()
        assert int(mism) == 0, f"{algo}: {int(mism)} mismatches over {replays + 1} calls"
        if rt.rank == 0:
            print(f"    replays {algo}: {replays} replays with new inputs, 0 mismatches, "
                  f"{time.time() - t0:.1f}s", flush=True)
        del g


@check
def torch_compile_fullgraph(rt, seed):
    if rt.device.type != "cuda" or os.environ.get("FUSEDIST_TEST_COMPILE", "1") == "0":
        return
    def f(x):
        return fusedist.all_reduce(x * 2) + 1
    cf = torch.compile(f, fullgraph=True)
    x, ref = inputs_and_ref(rt, 1000, torch.float32, (seed, "compile"))
    y = cf(x)
    assert count_bad(y, ref * 2 + 1, torch.float32) == 0


@check
def zz_peer_skips_call_times_out(rt, seed):
    """Rank 0 skips the collective; every other rank must get an error in bounded time."""
    if rt.device.type != "cuda" or rt.tp.size < 2:
        return
    comm = fusedist.Communicator(rt.tp, max_bytes=1 << 20, timeout_s=2.0)
    x = torch.ones(4096, device=rt.device)
    if rt.tp.rank != 0:
        y = expect_timeout(comm, lambda: comm.all_reduce(x, algo="one_shot"), 2.0)
        assert torch.isnan(y).all(), "outputs of a timed-out call must be NaN"
        try:
            comm.all_reduce(x, algo="one_shot")
        except fusedist.CommunicatorTimeoutError:
            pass
        else:
            raise AssertionError("a broken communicator accepted another call")
    comm.close()


if __name__ == "__main__":
    main()
