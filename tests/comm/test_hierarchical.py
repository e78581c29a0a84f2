"""Multi-process CPU tests of fusedist.comm.hierarchical and fusedist.comm.fp8 (gloo):
tests/dist/worker_hierarchical.py on 4 ranks as 2 emulated nodes x 2 (torchrun and mpirun),
tests/dist/worker_fp8_comm.py on 2, 3 and 4 ranks."""

from __future__ import annotations

import pytest

from launch import assert_passed, mpirun, mpirun_available, torchrun

CPU_ENV = {"CUDA_VISIBLE_DEVICES": "", "FUSEDIST_INIT_TIMEOUT_S": "60"}


@pytest.mark.timeout(300)
def test_hierarchical_2_nodes_x_2_torchrun():
    assert_passed(torchrun("worker_hierarchical.py", 4, CPU_ENV, timeout=280), 4)


@pytest.mark.timeout(300)
@pytest.mark.skipif(not mpirun_available(), reason="mpirun not installed")
def test_hierarchical_2_nodes_x_2_mpirun():
    assert_passed(mpirun("worker_hierarchical.py", 4, CPU_ENV, timeout=280), 4)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_fp8_collectives(world):
    assert_passed(torchrun("worker_fp8_comm.py", world, CPU_ENV, timeout=280), world)


# GPU tiers: the same workers over NCCL. 2 GPUs: one node of 2 (the flat paths, FP8 at world
# 2); 4 GPUs: 2 emulated nodes x 2 (NCCL_HOSTID per node, over loopback).
@pytest.mark.gpu2
@pytest.mark.timeout(600)
def test_hierarchical_gpu2():
    assert_passed(torchrun("worker_hierarchical.py", 2, timeout=580), 2)


@pytest.mark.gpu2
@pytest.mark.timeout(600)
def test_fp8_collectives_gpu2():
    assert_passed(torchrun("worker_fp8_comm.py", 2, timeout=580), 2)


@pytest.mark.gpu4
@pytest.mark.timeout(600)
def test_hierarchical_2_nodes_x_2_gpu4():
    assert_passed(torchrun("worker_hierarchical.py", 4, {"NCCL_SOCKET_IFNAME": "lo"},
                           timeout=580), 4)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("what", ["hierarchical", "fp8", "all_reduce"])
def test_a_lost_node_ends_the_others_with_peer_lost_error(what):
    """Rank 3 (of 2 emulated nodes x 2) leaves mid-run: the 3 others end with PeerLostError
    naming it, within the groups' timeout (tests/dist/worker_node_lost.py); all_reduce: rank 3
    shuts fusedist down and exits cleanly, the others' plain fusedist.all_reduce (which gloo
    failed with "Connection reset by peer") names it too."""
    p = torchrun("worker_node_lost.py", 4, {**CPU_ENV, "FUSEDIST_INIT_TIMEOUT_S": "20"},
                 timeout=180, args=(what,))
    assert_passed(p, 3)
    assert p.stdout.count("[lost] rank") == 3 and "rank 3 of group world is lost" in p.stdout, \
        p.stdout[-3000:]


# ---- which groups have two levels (pure: the topology gathered at init) ----------------------
import torch  # noqa: E402

from fusedist.comm.hierarchical import layout  # noqa: E402
from fusedist.distributed.groups import Group  # noqa: E402
from fusedist.distributed.topology import Topology  # noqa: E402


def _group(node_ids, ranks=None):
    ranks = tuple(range(len(node_ids))) if ranks is None else tuple(ranks)
    topo = Topology(world_size=len(node_ids), rank=0, node_ids=tuple(node_ids))
    return Group("g", ranks, None, torch.device("cpu"), topo)


@pytest.mark.parametrize("node_ids,ranks,rank_at", [
    ("aabb", None, [(0, 1), (2, 3)]),
    ("aabbcc", None, [(0, 1), (2, 3), (4, 5)]),
    ("abab", None, [(0, 2), (1, 3)]),                   # ranks placed round-robin
    ("aabbccdd", (4, 5, 6, 7), [(0, 1), (2, 3)]),       # a group of two of four nodes
])
def test_layout_of_groups_that_span_nodes(node_ids, ranks, rank_at):
    assert layout(_group(node_ids, ranks)) == (rank_at, "")


@pytest.mark.parametrize("node_ids,ranks,why", [
    ("aaaa", None, "is on one node"),
    ("abcd", None, "one rank per node"),
    ("aaab", None, "different numbers of group g's ranks [3, 1]"),
    ("abba", None, "nodes interleave their ranks ([3, 2] for local index 1)"),
    ("aabb", (2, 3, 0, 1), "are not in ascending order"),
])
def test_layout_names_why_a_group_has_one_level(node_ids, ranks, why):
    rank_at, reason = layout(_group(node_ids, ranks))
    assert rank_at is None and why in reason, reason


def test_layout_without_a_topology():
    g = Group("g", (0, 1), None, torch.device("cpu"), None)
    assert layout(g) == (None, "group g has no topology (nodes unknown)")
