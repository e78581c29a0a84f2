"""fusedist.init on 4 ranks emulating 2 nodes x 2 ranks (CPU/gloo): topology, the groups
init() builds, all-reduce over each of them, and embedding an engine's own ProcessGroup.

    CUDA_VISIBLE_DEVICES= torchrun --nproc-per-node 4 tests/dist/worker_runtime.py
    CUDA_VISIBLE_DEVICES= launchers/mpirun.sh -np 4 -- tests/dist/worker_runtime.py [tp_spans]

Mode tp_spans: init(tp_size=4) must fail with a hint at tp_spans_nodes on every rank and
leave nothing initialized, as must init with a rank_error on one rank and init with different
tp_size on one rank (CollectiveMismatchError on every rank, naming it); init(tp_size=4,
tp_spans_nodes=True) in the same process must then work.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _checks import check, fresh, main, rank_seed  # noqa: E402
from _runtime_util import (DTYPES, check_all_reduce, emulate_nodes, expected_groups,  # noqa: E402
                           gather_and_exit, seed, step)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import fusedist  # noqa: E402
from tolerances import count_bad  # noqa: E402


@check
def topology_two_nodes(rt, seed):
    t = rt.topology
    assert rt.world_size == 4, f"run with 4 ranks, got {rt.world_size}"
    assert t.node_ids == ("node0", "node0", "node1", "node1"), t.node_ids
    assert t.nodes == ("node0", "node1")
    assert t.num_nodes == 2 and t.ranks_per_node == 2 and t.uniform
    assert t.node == rt.rank // 2 and t.local_rank == rt.rank % 2
    assert rt.env.node_id == f"node{rt.rank // 2}"
    assert rt.backend == "gloo" and rt.device.type == "cpu"
    assert rt.owns_process_group


@check
def groups_have_the_right_ranks(rt, seed):
    want = expected_groups(rt.rank, rt.world_size)
    for kind, ranks in want.items():
        g = getattr(rt, kind)
        assert g is not None, f"{kind} group missing"
        assert g.ranks == ranks, f"{kind}: {g.ranks} != {ranks}"
        assert g.rank == ranks.index(rt.rank) and g.is_member, kind
        assert g.size == len(ranks)
        assert g.single_node == (kind in ("tp", "intra_node")), kind
    # Default tensor-parallel group = the ranks on my node.
    assert rt.tp.ranks == rt.topology.local_ranks
    # Names are identical on every member (they key torch.library ops).
    names = rt.world.all_gather_object({k: getattr(rt, k).name for k in want})
    for kind, ranks in want.items():
        assert len({names[r][kind] for r in ranks}) == 1, f"{kind}: {names}"


@check
def all_reduce_over_every_group(rt, seed):
    for kind, ranks in expected_groups(rt.rank, rt.world_size).items():
        check_all_reduce(rt, getattr(rt, kind), ranks, seed, kind)
    # group=None is the tensor-parallel group.
    check_all_reduce(rt, None, rt.tp.ranks, seed, "default")


@check
def communicator_on_engine_process_group(rt, seed):
    # An engine's own group (every rank creates it, as torch requires).
    pg = dist.new_group(list(range(rt.world_size)))
    comm = fusedist.Communicator(group=pg)
    assert comm.group.pg is pg
    assert comm.group.ranks == tuple(range(rt.world_size))
    assert comm.group.rank == rt.rank
    check_all_reduce(rt, comm, comm.group.ranks, seed, "engine pg communicator")
    for dtype in DTYPES:
        n = 513
        xs = [fresh((n,), dtype, rt.device, rank_seed(seed, "pg", str(dtype), r))
              for r in range(rt.world_size)]
        ref = sum(x.double() for x in xs)
        y = comm.all_reduce(xs[rt.rank])
        assert count_bad(y, ref, dtype) == 0, f"Communicator(pg).all_reduce {dtype}"
        # group= a raw torch ProcessGroup through the functional API.
        y = fusedist.all_reduce(xs[rt.rank], pg)
        assert count_bad(y, ref, dtype) == 0, f"all_reduce(group=pg) {dtype}"
    comm.close()
    assert comm.closed and comm not in rt.communicators
    dist.destroy_process_group(pg)


@check
def async_op_on_cpu_is_complete(rt, seed):
    for group in (rt.tp, rt.world):
        for dtype in DTYPES:
            n = 1001
            xs = [fresh((n,), dtype, rt.device, rank_seed(seed, "async", group.name, str(dtype),
                                                          r)) for r in group.ranks]
            ref = sum(x.double() for x in xs)
            h = fusedist.all_reduce(xs[group.rank], group, async_op=True)
            assert isinstance(h, fusedist.AsyncHandle)
            assert h.is_completed(), "a CPU op's handle must be complete when returned"
            y = h.wait()
            assert count_bad(y, ref, dtype) == 0, f"async {group.name} {dtype}"
            assert h.synchronize() is y


def main_tp_spans(rank: int) -> None:
    failures: list[str] = []

    def tp_across_nodes_needs_the_flag():
        try:
            fusedist.init(tp_size=4)
        except ValueError as e:
            assert "tp_spans_nodes" in str(e), f"message lacks tp_spans_nodes: {e}"
            assert "tp_size <= 2" in str(e), f"message lacks the per-node limit: {e}"
        else:
            raise AssertionError("init(tp_size=4) over 2 nodes x 2 ranks did not raise")
        finally:
            leaked = fusedist.is_initialized() or dist.is_initialized()
            fusedist.shutdown()
            if dist.is_initialized():
                dist.destroy_process_group()
        assert not leaked, "a failed init() left fusedist or torch.distributed initialized"

    step(failures, rank, "tp_across_nodes_needs_the_flag", tp_across_nodes_needs_the_flag)

    def expect_stop(what, match, **kw):
        """init(**kw) raises CollectiveMismatchError naming `match` on every rank, promptly,
        and leaves nothing initialized."""
        t0 = time.time()
        try:
            fusedist.init(**kw)
        except fusedist.CollectiveMismatchError as e:
            assert match in str(e), f"{what}: message lacks {match!r}: {e}"
        else:
            raise AssertionError(f"{what}: init raised nothing")
        finally:
            leaked = fusedist.is_initialized() or dist.is_initialized()
            fusedist.shutdown()
            if dist.is_initialized():
                dist.destroy_process_group()
        assert not leaked, f"{what}: a failed init() left something initialized"
        assert time.time() - t0 < 30, f"{what}: took {time.time() - t0:.0f} s"

    # Rank 2 stopped before it could start (its own arguments): every rank hears why at the
    # rendezvous instead of waiting for it.
    step(failures, rank, "a_rank_that_stops_stops_every_rank", lambda: expect_stop(
        "rank_error", "rank 2 of 4 stopped before starting (rank 2: bad --page-size 0)",
        rank_error="bad --page-size 0" if rank == 2 else None))
    step(failures, rank, "different_tp_sizes_stop_every_rank", lambda: expect_stop(
        "tp_size", "tp_size: ranks 0, 1, 2: 2; rank 3: 1", tp_size=1 if rank == 3 else 2))

    # Must succeed on every rank, else there is no group to report failures over.
    rt = fusedist.init(tp_size=4, tp_spans_nodes=True)

    def tp_spanning_nodes_works():
        assert rt.owns_process_group
        assert rt.topology.num_nodes == 2
        assert rt.tp.ranks == (0, 1, 2, 3) and not rt.tp.single_node
        assert rt.dp.ranks == (rank,)
        assert rt.intra_node.ranks == rt.topology.local_ranks
        check_all_reduce(rt, None, rt.tp.ranks, seed(), "tp spanning nodes")

    step(failures, rank, "tp_spanning_nodes_works", tp_spanning_nodes_works)
    gather_and_exit(rank, failures)


if __name__ == "__main__":
    my_rank = emulate_nodes()
    mode = sys.argv[1] if len(sys.argv) > 1 else "checks"
    if mode == "checks":
        main()
    elif mode == "tp_spans":
        main_tp_spans(my_rank)
    else:
        sys.exit(f"worker_runtime.py: unknown mode {mode!r} (checks, tp_spans)")
