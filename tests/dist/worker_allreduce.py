"""all_reduce checks, run on every rank (CPU/gloo or one GPU per rank).

    torchrun --nproc-per-node 2 tests/dist/worker_allreduce.py
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _checks import (CPU_ONLY, NEEDS_COMPILE, NEEDS_GRAPHS, NEEDS_NCCL,  # noqa: E402
                     assert_identical_across_ranks, captured, check, emulated, expect_mismatch,
                     expect_timeout, fresh, is_emulated, main, not_emulated, rank_seed, skip)

import torch  # noqa: E402

import fusedist  # noqa: E402
from fusedist.errors import CollectiveMismatchError  # noqa: E402
from tolerances import TOL_EPILOGUE, count_bad  # noqa: E402

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SIZES = tuple(n for n in (1, 7, 1023, 65537, 2**20 + 3)
              if n <= int(os.environ.get("FUSEDIST_TEST_MAX_N", str(1 << 30))))


def algos(rt):
    if rt.device.type != "cuda":
        return ("auto",)
    # Emulated ranks have no NCCL ("auto" stays on the symmetric kernels within capacity).
    return ("one_shot", "two_shot", "auto") if is_emulated(rt) else \
        ("one_shot", "two_shot", "nccl", "auto")


def inputs_and_ref(rt, n, dtype, seed):
    """This rank's input and the float64 sum of every rank's input (recomputed locally)."""
    W, me = rt.tp.size, rt.tp.rank
    xs = [fresh((n,), dtype, rt.device, rank_seed(seed, p)) for p in range(W)]
    ref = torch.zeros(n, dtype=torch.float64, device=rt.device)
    for x in xs:
        ref += x.double()
    return xs[me], ref


@check
@emulated
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
@emulated
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
@emulated
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
@emulated
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
@emulated
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
@not_emulated(NEEDS_GRAPHS)
def cuda_graph_fresh_inputs(rt, seed):
    if rt.device.type != "cuda":
        skip("CUDA graphs need a GPU")
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
@not_emulated(NEEDS_GRAPHS)
def cuda_graph_stress(rt, seed):
    """Many replays of a graph of 10 all-reduces on 10 different inputs, mismatches counted
    on the device inside the graph (no host sync per replay)."""
    if rt.device.type != "cuda":
        skip("CUDA graphs need a GPU")
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
@not_emulated(NEEDS_GRAPHS)
def cuda_graph_replays_changing_inputs(rt, seed):
    """100,000 replays of one captured all-reduce whose input changes inside the graph every
    replay. Inputs are small integers (exact in bf16 and in their sums); every rank holds all
    ranks' inputs, advances them with the same rule, and counts mismatches on the device."""
    if rt.device.type != "cuda":
        skip("CUDA graphs need a GPU")
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
@not_emulated(NEEDS_COMPILE)
def torch_compile_fullgraph(rt, seed):
    if rt.device.type != "cuda":
        skip("torch.compile of the GPU path needs a GPU")
    if os.environ.get("FUSEDIST_TEST_COMPILE", "1") == "0":
        skip("FUSEDIST_TEST_COMPILE=0")
    def f(x):
        return fusedist.all_reduce(x * 2) + 1
    cf = torch.compile(f, fullgraph=True)
    x, ref = inputs_and_ref(rt, 1000, torch.float32, (seed, "compile"))
    y = cf(x)
    assert count_bad(y, ref * 2 + 1, torch.float32) == 0


@check
@not_emulated(NEEDS_COMPILE)
def torch_compile_as_the_groups_first_use(rt, seed):
    """A compiled fusedist.all_reduce / all_reduce_add_rmsnorm that is the first use of its
    group: the communicator is made when the call is traced (it used to fail with "no open
    communicator named ..." when the graph ran). A fresh group per op, so no call made it
    before."""
    import torch.distributed as dist

    if os.environ.get("FUSEDIST_TEST_COMPILE", "1") == "0":
        skip("FUSEDIST_TEST_COMPILE=0")
    dev = rt.device
    backend = "eager" if dev.type == "cpu" else "inductor"
    g1 = fusedist.Group.from_process_group(dist.new_group(list(range(rt.world_size))))
    assert g1._communicator is None
    x, ref = inputs_and_ref(rt, 999, torch.float32, (seed, "compile-first"))
    y = torch.compile(lambda t: fusedist.all_reduce(t, group=g1) * 3, fullgraph=True,
                      backend=backend)(x)
    assert count_bad(y, ref * 3, torch.float32) == 0
    assert g1._communicator is not None and not g1._communicator.closed
    g2 = fusedist.Group.from_process_group(dist.new_group(list(range(rt.world_size))))
    h = 64
    a = fresh((5, h), torch.float32, dev, rank_seed(seed, "cf-a", rt.rank))
    res = fresh((5, h), torch.float32, dev, rank_seed(seed, "cf-res"))
    w = fresh((h,), torch.float32, dev, rank_seed(seed, "cf-w"))
    normed, new_res = torch.compile(
        lambda p, r, ww: fusedist.all_reduce_add_rmsnorm(p, r, ww, 1e-6, group=g2),
        fullgraph=True, backend=backend)(a, res, w)
    s_ = sum(fresh((5, h), torch.float32, dev, rank_seed(seed, "cf-a", r)).double()
             for r in range(rt.world_size))
    hh = s_ + res.double()
    want = hh * torch.rsqrt(hh.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    assert count_bad(new_res, hh, torch.float32, TOL_EPILOGUE) == 0
    assert count_bad(normed, want, torch.float32, TOL_EPILOGUE) == 0


def symmetric_or_skip(rt):
    if rt.device.type != "cuda":
        skip("symmetric memory needs GPUs")
    if rt.tp.size < 2:
        skip("symmetric memory needs 2 or more ranks")


def expect_raises(exc, fn, *matches):
    try:
        fn()
    except exc as e:
        for m in matches:
            assert m in str(e), f"message {str(e)!r} lacks {m!r}"
        return e
    raise AssertionError(f"expected {exc.__name__}")


@check
@not_emulated(CPU_ONLY)
def mismatched_calls_raise(rt, seed):
    """Ranks calling all_reduce with different sizes or dtypes get CollectiveMismatchError on
    every rank, naming every rank's call, before gloo sees the call (gloo aborts the process
    on a size mismatch). The communicator stays usable."""
    if rt.device.type != "cpu":
        skip("the CPU path's check (the GPU kernels' check: symmetric_call_mismatch)")
    me, ranks = rt.tp.rank, rt.tp.ranks
    expect_raises(CollectiveMismatchError, lambda: fusedist.all_reduce(torch.ones(100 + me)),
                  "called different collectives",
                  *(f"rank {r} called all_reduce of {100 + p} float32 elements"
                    for p, r in enumerate(ranks)))
    dt = torch.float32 if me == 0 else torch.bfloat16
    expect_raises(CollectiveMismatchError,
                  lambda: fusedist.all_reduce(torch.ones(64, dtype=dt)),
                  f"rank {ranks[0]} called all_reduce of 64 float32 elements",
                  f"rank {ranks[-1]} called all_reduce of 64 bfloat16 elements")
    x, ref = inputs_and_ref(rt, 100, torch.float32, (seed, "after-mismatch"))
    assert count_bad(fusedist.all_reduce(x), ref, torch.float32) == 0, "after a mismatch"


@check
@emulated
def symmetric_call_mismatch(rt, seed):
    """The symmetric kernels exchange call descriptors: a rank that calls with another size,
    dtype or op makes every rank's communicator fail with CollectiveMismatchError naming both
    calls, before any wait times out, and later calls raise (sticky)."""
    symmetric_or_skip(rt)
    me, dev, timeout = rt.tp.rank, rt.device, 20.0
    n = 4096

    def size_case(comm):
        x = torch.ones(n + 8 * me, device=dev)
        y = comm.all_reduce(x, algo="one_shot")
        return y, f"one_shot all_reduce of {n + 8 * me} float32 elements"

    def dtype_case(comm):
        dt = torch.float32 if me == 0 else torch.bfloat16
        x = torch.ones(n if me == 0 else 2 * n, dtype=dt, device=dev)  # same bytes
        return comm.all_reduce(x, algo="one_shot"), \
            f"one_shot all_reduce of {x.numel()} {str(dt).split('.')[-1]} elements"

    def op_case(comm):
        algo = "one_shot" if me == 0 else "two_shot"
        return comm.all_reduce(torch.ones(n, device=dev), algo=algo), \
            f"{algo} all_reduce of {n} float32 elements"

    def rmsnorm_case(comm):
        x = torch.ones(4, 1024, device=dev)
        if me == 0:
            normed, _ = fusedist.all_reduce_add_rmsnorm(x, torch.zeros_like(x),
                                                        torch.ones(1024, device=dev), 1e-6,
                                                        group=comm, fused=True)
            return normed, "all_reduce_add_rmsnorm of 4096 float32 elements (rows of 1024)"
        return comm.all_reduce(x, algo="one_shot"), "one_shot all_reduce of 4096 float32 elements"

    for case in (size_case, dtype_case, op_case, rmsnorm_case):
        comm = fusedist.Communicator(rt.tp, max_bytes=1 << 20, timeout_s=timeout)
        t0 = time.time()
        y, mine = case(comm)
        torch.cuda.synchronize()
        waited = time.time() - t0
        e = expect_raises(CollectiveMismatchError, comm.check, "called different collectives",
                          f"rank {rt.tp.ranks[me]} called {mine}")
        assert waited < timeout, f"{case.__name__}: {waited:.1f}s: the mismatch waited out the " \
                                 f"timeout instead of being detected ({e})"
        if case is size_case and me == rt.tp.size - 1:
            # The largest call's last vectors never arrive from the smaller peers: poisoned.
            assert torch.isnan(y[n + 8 * (me - 1):]).all(), "tail of the larger call"
        expect_raises(CollectiveMismatchError, lambda: comm.all_reduce(
            torch.ones(n, device=dev), algo="one_shot"), "called different collectives")
        comm.close()
    # A fresh communicator of the same group works.
    comm = fusedist.Communicator(rt.tp, max_bytes=1 << 20, timeout_s=timeout)
    x, ref = inputs_and_ref(rt, n, torch.float32, (seed, "after-gpu-mismatch"))
    assert count_bad(comm.all_reduce(x, algo="one_shot"), ref, torch.float32) == 0
    comm.close()


@check
@not_emulated(NEEDS_NCCL)
def nccl_call_mismatch(rt, seed):
    """All-reduces routed to NCCL carry a call check first: ranks calling NCCL with different
    sizes, or NCCL against a one-shot kernel, get CollectiveMismatchError naming both calls in
    bounded time instead of a hang; the check()'s abort of the NCCL communicator releases the
    NCCL kernel left waiting (the GPU drains); later calls are refused; a fresh communicator
    works."""
    symmetric_or_skip(rt)
    me, dev, timeout = rt.tp.rank, rt.device, 20.0
    probe = fusedist.Communicator(rt.tp, max_bytes=1 << 20)
    kind, checked, symm = probe.nccl.kind, probe.nccl_call_check, probe.symm is not None
    probe.close()
    if not symm:
        skip("no symmetric memory here (peer access): the call check needs its descriptor slots")
    if kind != "nccl4py":
        skip("needs nccl4py: torch.distributed's NCCL (FUSEDIST_NCCL=torch) is not aborted by "
             "fusedist, so a mismatched NCCL kernel would hang this worker")
    assert checked, "the call check before NCCL is on by default"
    big = (1 << 19) + 8  # 2 MB of float32: past the 1 MiB communicator's capacities

    def sizes(comm):
        x = torch.ones(big + 8 * me, device=dev)
        assert comm.choose_algo(x.numel() * 4, x.dtype) == "nccl"
        return (lambda: comm.all_reduce(x),
                f"all_reduce through NCCL of {big + 8 * me} float32 elements")

    def nccl_against_one_shot(comm):
        x = torch.ones(4096, device=dev)
        if me == 0:
            return (lambda: comm.all_reduce(x, algo="nccl"),
                    "all_reduce through NCCL of 4096 float32 elements")
        return (lambda: comm.all_reduce(x, algo="one_shot"),
                "one_shot all_reduce of 4096 float32 elements")

    for case in (sizes, nccl_against_one_shot):
        comm = fusedist.Communicator(rt.tp, max_bytes=1 << 20, timeout_s=timeout)
        call, mine = case(comm)
        expect_mismatch(comm, call, timeout, f"rank {rt.tp.ranks[me]} called {mine}")
        expect_raises(CollectiveMismatchError, lambda: comm.all_reduce(
            torch.ones(8, device=dev), algo="nccl"), "called different collectives")
        comm.close()
    comm = fusedist.Communicator(rt.tp, max_bytes=1 << 20, timeout_s=timeout)
    x, ref = inputs_and_ref(rt, big, torch.float32, (seed, "after-nccl-mismatch"))
    assert count_bad(comm.all_reduce(x), ref, torch.float32) == 0, "a fresh communicator"
    comm.close()


@check
@not_emulated(NEEDS_NCCL)
def nccl_call_check_setting_is_rank_0s(rt, seed):
    """FUSEDIST_NCCL_CALL_CHECK is read at creation and rank 0's value applies on every rank
    (ranks that disagreed would issue different device barriers); NCCL calls are exact either
    way."""
    symmetric_or_skip(rt)
    me = rt.tp.rank
    old = os.environ.get("FUSEDIST_NCCL_CALL_CHECK")
    try:
        for rank0, others, want in (("0", "1", False), ("1", "0", True)):
            os.environ["FUSEDIST_NCCL_CALL_CHECK"] = rank0 if me == 0 else others
            comm = fusedist.Communicator(rt.tp, max_bytes=1 << 20)
            if comm.symm is None:
                comm.close()
                skip("no symmetric memory here (peer access): no call check to configure")
            assert comm.nccl_call_check is want, (rank0, others, comm.nccl_call_check)
            x, ref = inputs_and_ref(rt, 4099, torch.float32, (seed, "nccl-check", rank0))
            assert count_bad(comm.all_reduce(x, algo="nccl"), ref, torch.float32) == 0
            comm.close()
    finally:
        if old is None:
            os.environ.pop("FUSEDIST_NCCL_CALL_CHECK", None)
        else:
            os.environ["FUSEDIST_NCCL_CALL_CHECK"] = old


@check
@emulated
def symmetric_sizes_checked_at_creation(rt, seed):
    """Ranks creating a communicator with different sizes or timeouts get
    CollectiveMismatchError on every rank, naming each rank's value, before anything is
    allocated (kernels would address peers' buffers at the wrong offsets)."""
    symmetric_or_skip(rt)
    me, ranks = rt.tp.rank, rt.tp.ranks
    for kwargs, key in ((dict(max_bytes=(1 << 20) * (1 + me)), "max_bytes"),
                        (dict(max_bytes=1 << 20, one_shot_max_bytes=(1 << 16) * (1 + me)),
                         "one_shot_max_bytes"),
                        (dict(max_bytes=1 << 20, staging_bytes=4096 * me), "staging_bytes"),
                        (dict(max_bytes=1 << 20, timeout_s=5.0 + me), "timeout_s")):
        expect_raises(CollectiveMismatchError, lambda: fusedist.Communicator(rt.tp, **kwargs),
                      f"{key} (rank {ranks[0]}: ", f"rank {ranks[-1]}: ")
    comm = fusedist.Communicator(rt.tp, max_bytes=1 << 20)
    x, ref = inputs_and_ref(rt, 1000, torch.float32, (seed, "after-size-mismatch"))
    assert count_bad(comm.all_reduce(x, algo="one_shot"), ref, torch.float32) == 0
    comm.close()


@check
@emulated
def epoch_wraps_onto_the_next_generation(rt, seed):
    """The epoch started just below its wrap: every call across the wrap is exact (fresh
    inputs, NaN-poisoned outputs, back to back without a host sync, one-shot and two-shot
    alternating), and the epoch wraps at EPOCH_PERIOD (a multiple of the generation count),
    not at 2^32 where two consecutive calls would share a generation."""
    symmetric_or_skip(rt)
    from fusedist.comm import symmetric

    comm = fusedist.Communicator(rt.tp, max_bytes=1 << 20)
    period, start, calls = symmetric.EPOCH_PERIOD, symmetric.EPOCH_PERIOD - 3, 6
    assert period % symmetric.GENERATIONS == 0
    for rep in range(20):
        comm.symm.set_epoch(start)
        outs, refs = [], []
        for k in range(calls):
            n = 4093 + 11 * k
            x, ref = inputs_and_ref(rt, n, torch.float32, (seed, "wrap", rep, k))
            out = torch.full_like(x, float("nan"))
            comm.all_reduce(x, algo=("one_shot", "two_shot")[k % 2], out=out)
            outs.append(out)
            refs.append(ref)
        torch.cuda.synchronize()
        comm.check()
        for k, (out, ref) in enumerate(zip(outs, refs)):
            assert count_bad(out, ref, torch.float32) == 0, f"rep {rep} call {k} across the wrap"
        got = comm.symm.epoch()
        assert got == (start + calls) % period, f"epoch {got}, expected {(start + calls) % period}"
    comm.close()


@check
@emulated
def zz_peer_skips_call_times_out(rt, seed):
    """Rank 0 skips the collective; every other rank must get an error in bounded time."""
    symmetric_or_skip(rt)
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
