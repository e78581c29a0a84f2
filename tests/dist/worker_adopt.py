"""fusedist inside an engine that already owns torch.distributed (4 ranks, 2 emulated
nodes x 2, CPU/gloo): init() adopts the engine's process group and shutdown() leaves it
alone.

    CUDA_VISIBLE_DEVICES= torchrun --nproc-per-node 4 tests/dist/worker_adopt.py
    CUDA_VISIBLE_DEVICES= launchers/mpirun.sh -np 4 -- tests/dist/worker_adopt.py
"""

from __future__ import annotations

import os
import socket
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _runtime_util import (check_all_reduce, emulate_nodes, expected_groups,  # noqa: E402
                           gather_and_exit, seed, step)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import fusedist  # noqa: E402


def engine_init_process_group() -> None:
    """What an engine does before it ever hears of fusedist."""
    env = fusedist.detect_launch_env()
    if env.master_addr is not None:  # torchrun
        dist.init_process_group("gloo", init_method="env://")
        return
    # mpirun without MASTER_ADDR: rank 0 picks a port and MPI broadcasts it.
    from mpi4py import MPI

    port = None
    if MPI.COMM_WORLD.Get_rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = MPI.COMM_WORLD.bcast(port, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=env.rank,
                            world_size=env.world_size)


def main() -> None:
    rank = emulate_nodes()
    engine_init_process_group()
    engine_pg = dist.group.WORLD
    failures: list[str] = []
    run_seed = seed()

    def failed_init_keeps_engine_group():
        try:
            fusedist.init(tp_size=4)
        except ValueError as e:
            assert "tp_spans_nodes" in str(e), str(e)
        else:
            raise AssertionError("init(tp_size=4) over 2 nodes x 2 ranks did not raise")
        assert not fusedist.is_initialized()
        assert dist.is_initialized() and dist.group.WORLD is engine_pg, \
            "a failed init() destroyed the engine's process group"

    step(failures, rank, "failed_init_keeps_engine_group", failed_init_keeps_engine_group)

    for round_ in range(2):  # adopt, shut down, adopt again
        rt = fusedist.init()

        def adopts_engine_group():
            assert not rt.owns_process_group
            assert rt.backend == "gloo" and rt.device.type == "cpu"
            assert rt.world.pg is engine_pg
            assert rt.topology.node_ids == ("node0", "node0", "node1", "node1")
            for kind, ranks in expected_groups(rank, rt.world_size).items():
                assert getattr(rt, kind).ranks == ranks, (kind, getattr(rt, kind).ranks)
            try:
                fusedist.init()
            except RuntimeError as e:
                assert "already initialized" in str(e), str(e)
            else:
                raise AssertionError("a second init() did not raise")

        def all_reduce_on_adopted_group():
            check_all_reduce(rt, rt.tp, rt.tp.ranks, (run_seed, round_), "tp")
            check_all_reduce(rt, rt.world, rt.world.ranks, (run_seed, round_), "world")

        step(failures, rank, f"adopts_engine_group[{round_}]", adopts_engine_group)
        step(failures, rank, f"all_reduce_on_adopted_group[{round_}]",
             all_reduce_on_adopted_group)
        comm = fusedist.get_communicator()
        subgroups = list(rt.created_groups)
        fusedist.shutdown()

        def shutdown_keeps_engine_group():
            assert not fusedist.is_initialized()
            assert comm.closed
            live = set(dist.distributed_c10d._world.pg_map)
            leaked = [pg for pg in subgroups if pg in live]
            assert subgroups and not leaked, \
                f"shutdown() left {len(leaked)} of fusedist's {len(subgroups)} subgroups alive"
            assert dist.is_initialized(), "fusedist.shutdown() destroyed the engine's group"
            assert dist.group.WORLD is engine_pg
            t = torch.ones(3)
            dist.all_reduce(t)  # the engine's group still works
            assert torch.equal(t, torch.full((3,), float(dist.get_world_size())))

        step(failures, rank, f"shutdown_keeps_engine_group[{round_}]",
             shutdown_keeps_engine_group)

    gather_and_exit(rank, failures)  # the engine destroys its own group


if __name__ == "__main__":
    main()
