"""Helpers shared by worker_runtime.py and worker_adopt.py: emulated nodes, an all-reduce
check against a float64 reference, and failure gathering for workers that init() and
shutdown() more than once (so they cannot use _checks.main)."""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _checks import fresh, rank_seed, record_failure  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import fusedist  # noqa: E402
from tolerances import count_bad  # noqa: E402

RANKS_PER_NODE = 2
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SIZES = (1, 7, 1023)


def emulate_nodes() -> int:
    """Node identity from the rank, node<rank // 2> (torchrun cannot set per-rank environment);
    must run before fusedist.init(). Returns this process's rank."""
    rank = fusedist.detect_launch_env().rank
    os.environ["FUSEDIST_NODE_ID"] = f"node{rank // RANKS_PER_NODE}"
    return rank


def expected_groups(rank: int, world: int) -> dict[str, tuple[int, ...]]:
    """The groups init() must build by default on nodes of RANKS_PER_NODE consecutive ranks."""
    node, local = divmod(rank, RANKS_PER_NODE)
    mine = tuple(range(node * RANKS_PER_NODE, (node + 1) * RANKS_PER_NODE))
    across = tuple(range(local, world, RANKS_PER_NODE))
    return {"world": tuple(range(world)), "tp": mine, "dp": across, "intra_node": mine,
            "inter_node": across}


def check_all_reduce(rt, group, ranks, seed, what) -> None:
    """all_reduce over `group` (anything group= accepts) against the float64 sum of the inputs
    of `ranks` (every rank recomputes every member's input from its seed)."""
    for dtype in DTYPES:
        for n in SIZES:
            s = (seed, what, str(dtype), n)
            xs = {r: fresh((n,), dtype, rt.device, rank_seed(s, r)) for r in ranks}
            ref = sum(x.double() for x in xs.values())
            x = xs[rt.rank]
            x_copy = x.clone()
            out = torch.full_like(x, float("nan"))
            y = fusedist.all_reduce(x, group, out=out)
            assert y is out
            bad = count_bad(y, ref, dtype)
            assert bad == 0, f"{what} {dtype} n={n}: {bad} wrong elements"
            assert torch.equal(x, x_copy), f"{what} {dtype} n={n}: input was modified"
            fusedist.all_reduce_(x, group)
            bad = count_bad(x, ref, dtype)
            assert bad == 0, f"{what} in place {dtype} n={n}: {bad} wrong elements"


def step(failures: list, rank: int, name: str, fn) -> None:
    """Run one check; record its failure instead of raising (gathered later, and printed at
    once: _checks.record_failure)."""
    t0 = time.time()
    try:
        fn()
        status = "ok"
    except Exception as e:  # noqa: BLE001 - reported, then gathered
        status = "FAIL"
        record_failure(failures, rank, name, e)
    if rank == 0:
        print(f"[{status}] {name} ({time.time() - t0:.2f}s)", flush=True)


def gather_and_exit(rank: int, failures: list) -> None:
    """Gather every rank's failures over torch.distributed's default group (which must be
    initialized), destroy it, and exit non-zero if any rank failed."""
    all_failures: list = [None] * dist.get_world_size()
    dist.all_gather_object(all_failures, failures)
    fusedist.shutdown()
    if dist.is_initialized():
        dist.destroy_process_group()
    flat = [f for fs in all_failures for f in fs]
    if flat:
        if rank == 0:
            print("\n".join(flat), flush=True)
        sys.exit(1)
    print(f"rank {rank}: all checks passed", flush=True)


def seed() -> int:
    return int(os.environ.get("FUSEDIST_TEST_SEED", str(int(time.time()))))
