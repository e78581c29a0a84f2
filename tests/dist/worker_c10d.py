"""Unmodified torch.distributed code on the "fusedist" backend (fusedist/comm/c10d.py), checked
against the same calls on a gloo (CPU) or NCCL (CUDA) group of the same ranks.

    torchrun --nproc-per-node 2 tests/dist/worker_c10d.py [BACKEND]   # default "fusedist"

Every rank runs every check; failures are gathered over the reference group, so one failing
rank fails all of them; "rank r: all checks passed" per rank at the end.
"""

from __future__ import annotations

import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _checks import fresh, rank_seed  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed._functional_collectives as funcol  # noqa: E402

import fusedist  # noqa: E402  (registers the backend)

CHECKS = []


class Skip(Exception):
    """This check cannot run here (reported as [skip] with the reason, never as passed)."""


def check(fn):
    CHECKS.append(fn)
    return fn


class Ctx:
    def __init__(self, backend: str):
        self.backend = backend
        self.cuda = torch.cuda.is_available()
        if self.cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.cuda \
            else torch.device("cpu")
        dist.init_process_group(backend)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        # The reference: the same ranks over torch's own backend for this device.
        self.ref = dist.new_group(backend="nccl" if self.cuda else "gloo")
        self.gloo = self.ref if not self.cuda else dist.new_group(backend="gloo")

    def inputs(self, seed, n, dtype):
        return [fresh((n,), dtype, self.device, rank_seed(seed, r)) for r in range(self.world)]


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().reshape(-1).cpu()
    return t.view({8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[
        t.element_size()])


def assert_bitwise(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, \
        f"{what}: {got.dtype} {tuple(got.shape)} vs {want.dtype} {tuple(want.shape)}"
    bad = int((bits(got) != bits(want)).sum())
    assert bad == 0, f"{what}: {bad} of {got.numel()} elements differ from the reference"


@check
def world_group_is_fusedist(c: Ctx, seed):
    assert dist.get_backend() == c.backend, dist.get_backend()
    assert type(dist.group.WORLD).__name__ == "FusedistProcessGroup"


@check
def all_reduce_fp32_is_glooes_bitwise(c: Ctx, seed):
    for n in (1, 7, 1023, 65537):
        x = c.inputs((seed, n), n, torch.float32)[c.rank]
        before = dist.group.WORLD.routed
        y = x.clone()
        dist.all_reduce(y)
        assert dist.group.WORLD.routed == before + 1, "all_reduce did not go through fusedist"
        want = x.clone()
        dist.all_reduce(want, group=c.ref)
        assert_bitwise(y, want, f"all_reduce fp32 n={n}")
    assert fusedist.is_initialized(), "the first routed all_reduce initializes fusedist"


@check
def all_reduce_half_sums_in_fp32_rounded_once(c: Ctx, seed):
    for dtype in (torch.bfloat16, torch.float16):
        n = 1023
        xs = c.inputs((seed, dtype), n, dtype)
        y = xs[c.rank].clone()
        dist.all_reduce(y)
        acc = xs[c.rank].float()
        dist.all_reduce(acc, group=c.ref)
        # On CUDA the symmetric kernels also sum in fp32; NCCL sums in the input dtype, so the
        # promise is checked where the CPU path or a symmetric kernel ran.
        if c.device.type == "cpu":
            assert_bitwise(y, acc.to(dtype), f"all_reduce {dtype}")
        else:
            ref = torch.stack([x.double() for x in xs]).sum(0)
            err = (y.double() - ref).abs().max().item()
            assert err <= 0.02 * ref.abs().max().item(), f"all_reduce {dtype}: error {err}"


@check
def async_all_reduce_and_functional_collectives(c: Ctx, seed):
    x = c.inputs((seed, "async"), 4099, torch.float32)[c.rank]
    want = x.clone()
    dist.all_reduce(want, group=c.ref)
    y = x.clone()
    work = dist.all_reduce(y, async_op=True)
    work.wait()
    assert_bitwise(y, want, "all_reduce(async_op=True)")
    before = dist.group.WORLD.routed
    z = funcol.all_reduce(x, "sum", dist.group.WORLD)
    z = funcol.wait_tensor(z) if hasattr(funcol, "wait_tensor") else z
    assert dist.group.WORLD.routed == before + 1, "functional all_reduce did not go through fusedist"
    assert_bitwise(z, want, "functional all_reduce")


@check
def other_collectives_are_delegated(c: Ctx, seed):
    before = dist.group.WORLD.routed
    x = c.inputs((seed, "max"), 37, torch.float32)[c.rank]
    for op in (dist.ReduceOp.MAX, dist.ReduceOp.MIN, dist.ReduceOp.PRODUCT):
        y, want = x.clone(), x.clone()
        dist.all_reduce(y, op=op)
        dist.all_reduce(want, op=op, group=c.ref)
        assert_bitwise(y, want, f"all_reduce {op}")
    i = torch.arange(11, device=c.device, dtype=torch.int64) * (c.rank + 1)
    want = i.clone()
    dist.all_reduce(i)
    dist.all_reduce(want, group=c.ref)
    assert_bitwise(i, want, "all_reduce int64")
    assert dist.group.WORLD.routed == before, "non-sum / integer all_reduce must be delegated"

    outs = [torch.empty_like(x) for _ in range(c.world)]
    dist.all_gather(outs, x)
    for r, o in enumerate(outs):
        assert_bitwise(o, c.inputs((seed, "max"), 37, torch.float32)[r], f"all_gather[{r}]")
    flat = torch.empty(c.world * 37, device=c.device)
    dist.all_gather_into_tensor(flat, x)
    assert_bitwise(flat, torch.cat(outs), "all_gather_into_tensor")
    b = x.clone()
    dist.broadcast(b, src=c.world - 1)
    assert_bitwise(b, outs[-1], "broadcast")
    objs = [None] * c.world
    dist.all_gather_object(objs, {"rank": c.rank})
    assert objs == [{"rank": r} for r in range(c.world)], objs
    dist.barrier()
    if c.cuda:  # gloo has no reduce_scatter
        rs, want = torch.empty(37, device=c.device), torch.empty(37, device=c.device)
        inp = c.inputs((seed, "rs"), 37 * c.world, torch.float32)[c.rank]
        dist.reduce_scatter_tensor(rs, inp)
        dist.reduce_scatter_tensor(want, inp, group=c.ref)
        assert_bitwise(rs, want, "reduce_scatter_tensor")


@check
def mismatched_all_reduce_raises_on_every_rank(c: Ctx, seed):
    if c.cuda:
        raise Skip("the CUDA path's call checks are tests/dist/worker_allreduce.py's")
    x = torch.ones(5 + c.rank)
    try:
        dist.all_reduce(x)
    except fusedist.CollectiveMismatchError as e:
        assert "all_reduce" in str(e), str(e)
    else:
        raise AssertionError("all_reduce of different sizes did not raise CollectiveMismatchError")


def _expect_mismatch(what, call, *needles):
    t0 = time.time()
    try:
        call()
    except fusedist.CollectiveMismatchError as e:
        for n in ("called different collectives",) + needles:
            assert n in str(e), f"{what}: {str(e)!r} lacks {n!r}"
    else:
        raise AssertionError(f"{what}: no CollectiveMismatchError")
    assert time.time() - t0 < 20, f"{what}: took {time.time() - t0:.1f} s"


@check
def ranks_calling_differently_raise_on_every_rank(c: Ctx, seed):
    """Another reduce op, another collective, another root or dtype on one rank: every rank
    raises naming each rank's call (gloo would hang, mix the ops or abort the process); the
    group stays usable after."""
    if c.cuda:
        raise Skip("CPU tensors' calls are compared; CUDA ones go to NCCL as they are")
    last = c.world - 1
    mine = c.rank == last
    x = torch.ones(6) * (c.rank + 1)
    _expect_mismatch("reduce op", lambda: dist.all_reduce(
        x, op=dist.ReduceOp.MAX if mine else dist.ReduceOp.SUM),
        "all_reduce (SUM) of 6 float32 elements through fusedist", f"rank {last} called "
        "all_reduce (MAX) of 6 float32 elements")
    _expect_mismatch("collective", lambda: dist.broadcast(x, src=0) if mine else
                     dist.all_reduce(x), f"rank {last} called broadcast of 6 float32 elements "
                     "from root 0")
    _expect_mismatch("root", lambda: dist.broadcast(x, src=last if mine else 0),
                     f"from root {last}")
    _expect_mismatch("dtype", lambda: dist.all_gather(
        [torch.empty(6, dtype=torch.float64 if mine else torch.float32)
         for _ in range(c.world)], x.double() if mine else x), "float64")
    _expect_mismatch("barrier", lambda: dist.barrier() if mine else dist.all_reduce(x),
                     f"rank {last} called barrier")
    y = torch.ones(6) * (c.rank + 1)                      # the group still works
    dist.all_reduce(y, op=dist.ReduceOp.MAX)
    assert y.tolist() == [float(c.world)] * 6, y


@check
def subgroup_all_reduce(c: Ctx, seed):
    ranks = list(range(c.world - 1, -1, -1))  # all ranks, a new group
    g = dist.new_group(ranks)
    ref = dist.new_group(ranks, backend="nccl" if c.cuda else "gloo")
    x = c.inputs((seed, "sub"), 513, torch.float32)[c.rank]
    y, want = x.clone(), x.clone()
    dist.all_reduce(y, group=g)
    dist.all_reduce(want, group=ref)
    assert g.routed == 1, "a subgroup's all_reduce (fusedist initialized) goes through fusedist"
    assert_bitwise(y, want, "subgroup all_reduce")


@check
def tensor_parallel_mlp_unmodified(c: Ctx, seed):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    def mlp():
        torch.manual_seed(seed % (1 << 31))
        return torch.nn.Sequential(torch.nn.Linear(24, 48), torch.nn.GELU(),
                                   torch.nn.Linear(48, 24)).to(c.device)

    plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    x = fresh((5, 24), torch.float32, c.device, rank_seed(seed, "mlp"))  # same on every rank
    full = mlp()(x)
    mesh = DeviceMesh(c.device.type, list(range(c.world)))
    before = dist.group.WORLD.routed
    y = parallelize_module(mlp(), mesh, plan)(x)
    if c.world > 1:   # one rank: DTensor has nothing to reduce and issues no all_reduce
        assert dist.group.WORLD.routed > before, \
            "the row-parallel all_reduce did not go through fusedist"
    ref_mesh = DeviceMesh.from_group(c.ref, c.device.type)
    want = parallelize_module(mlp(), ref_mesh, plan)(x)
    y = y.full_tensor() if hasattr(y, "full_tensor") else y
    want = want.full_tensor() if hasattr(want, "full_tensor") else want
    assert_bitwise(y, want, "tensor-parallel MLP")
    err = (y.double() - full.double()).abs().max().item()
    assert err < 1e-4, f"tensor-parallel MLP differs from the unsharded one by {err}"


@check
def all_reduce_after_fusedist_shutdown(c: Ctx, seed):
    fusedist.shutdown()              # e.g. the program's own; the backend starts it again
    x = c.inputs((seed, "again"), 77, torch.float32)[c.rank]
    y, want = x.clone(), x.clone()
    before = dist.group.WORLD.routed
    dist.all_reduce(y)
    dist.all_reduce(want, group=c.ref)
    assert dist.group.WORLD.routed == before + 1 and fusedist.is_initialized()
    assert_bitwise(y, want, "all_reduce after fusedist.shutdown()")


@check
def cuda_graph_capture(c: Ctx, seed):
    if not c.cuda:
        raise Skip("CUDA graphs need a GPU")
    x = c.inputs((seed, "graph"), 8191, torch.bfloat16)[c.rank]
    y = x.clone()
    dist.all_reduce(y)  # warm-up: the communicator exists before capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y.copy_(x)
        dist.all_reduce(y)
    for i in range(3):
        x.copy_(c.inputs((seed, "graph", i), 8191, torch.bfloat16)[c.rank])
        g.replay()
        eager = x.clone()
        dist.all_reduce(eager)
        torch.cuda.synchronize()
        assert_bitwise(y, eager, f"captured all_reduce, replay {i}")


def main() -> None:
    backend = sys.argv[1] if len(sys.argv) > 1 else "fusedist"
    c = Ctx(backend)
    seed = [int(os.environ.get("FUSEDIST_TEST_SEED", str(int(time.time()))))]
    dist.broadcast_object_list(seed, src=0, group=c.gloo)
    failures = []
    for fn in CHECKS:
        t0 = time.time()
        reason = ""
        try:
            fn(c, seed[0])
            status = "ok"
        except Skip as e:
            status, reason = "skip", f": {e}"
        except Exception as e:  # noqa: BLE001 - every failure is reported, then gathered
            status = "FAIL"
            failures.append(f"rank {c.rank} {fn.__name__}: {type(e).__name__}: {e}\n"
                            + traceback.format_exc(limit=4))
            print(f"[FAIL] rank {c.rank} {fn.__name__}: {e}", flush=True)
        if c.rank == 0:
            print(f"[{status}] {fn.__name__} ({time.time() - t0:.2f}s){reason}", flush=True)
    gathered = [None] * c.world
    dist.all_gather_object(gathered, failures, group=c.gloo)
    flat = [f for fs in gathered for f in fs]
    fusedist.shutdown()
    dist.destroy_process_group()
    if flat:
        if c.rank == 0:
            print("\n".join(flat), flush=True)
        sys.exit(1)
    print(f"rank {c.rank}: all checks passed (seed {seed[0]})", flush=True)


if __name__ == "__main__":
    main()
