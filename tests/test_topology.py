"""Topology (fusedist/distributed/topology.py) and the group rank lists and tp_size checks of
fusedist/distributed/groups.py: pure functions of the gathered node ids, no process group needed."""

from __future__ import annotations

import pytest

from fusedist.distributed.groups import build_rank_lists, validate_tp_size
from fusedist.distributed.topology import Topology


def topo(node_ids, rank=0) -> Topology:
    return Topology(world_size=len(node_ids), rank=rank, node_ids=tuple(node_ids))


ONE_NODE_2 = ("a", "a")
TWO_NODES_4 = ("n0",) * 4 + ("n1",) * 4
# Uneven and interleaved: node "z" holds rank 0, so it is node 0 although it sorts last.
UNEVEN = ("z", "b", "b", "z", "z", "c")


# ------------------------------------------------------------------ Topology

def test_one_node_two_ranks():
    for r in range(2):
        t = topo(ONE_NODE_2, r)
        assert t.nodes == ("a",)
        assert t.num_nodes == 1
        assert t.node == 0 and t.node_of(r) == 0
        assert t.ranks_on_node(0) == (0, 1)
        assert t.local_ranks == (0, 1)
        assert t.local_rank == r
        assert t.ranks_per_node == 2
        assert t.uniform
        assert t.same_node([0, 1])


def test_two_nodes_four_ranks_each():
    for r in range(8):
        t = topo(TWO_NODES_4, r)
        assert t.nodes == ("n0", "n1")
        assert t.num_nodes == 2
        assert t.node == r // 4
        assert t.local_rank == r % 4
        assert t.local_ranks == tuple(range(4 * (r // 4), 4 * (r // 4) + 4))
    t = topo(TWO_NODES_4)
    assert [t.node_of(r) for r in range(8)] == [0] * 4 + [1] * 4
    assert t.ranks_on_node(0) == (0, 1, 2, 3)
    assert t.ranks_on_node(1) == (4, 5, 6, 7)
    assert t.ranks_per_node == 4
    assert t.uniform
    assert t.same_node([0, 1, 2, 3]) and t.same_node([5, 7]) and t.same_node([6])
    assert not t.same_node([3, 4])
    assert not t.same_node(range(8))


def test_nodes_in_order_of_lowest_rank_uneven():
    t = topo(UNEVEN, rank=4)
    assert t.nodes == ("z", "b", "c")
    assert t.num_nodes == 3
    assert [t.node_of(r) for r in range(6)] == [0, 1, 1, 0, 0, 2]
    assert t.ranks_on_node(0) == (0, 3, 4)
    assert t.ranks_on_node(1) == (1, 2)
    assert t.ranks_on_node(2) == (5,)
    assert t.node == 0
    assert t.local_ranks == (0, 3, 4)
    assert t.local_rank == 2  # rank 4 is the third rank of node "z"
    assert topo(UNEVEN, rank=2).local_rank == 1
    assert topo(UNEVEN, rank=5).local_rank == 0
    assert t.ranks_per_node == 1  # the smallest count when nodes differ
    assert not t.uniform
    assert t.same_node([0, 3, 4]) and t.same_node([1, 2])
    assert not t.same_node([0, 1])


def test_uneven_two_nodes():
    t = topo(("a", "a", "a", "b"), rank=3)
    assert t.ranks_per_node == 1
    assert not t.uniform
    assert t.node == 1 and t.local_rank == 0


# ------------------------------------------------------------------ rank lists

def test_rank_lists_world8_tp2_two_nodes():
    lists = build_rank_lists(8, 2, topo(TWO_NODES_4))
    assert lists == {
        "tp": [(0, 1), (2, 3), (4, 5), (6, 7)],
        "dp": [(0, 2, 4, 6), (1, 3, 5, 7)],
        "intra_node": [(0, 1, 2, 3), (4, 5, 6, 7)],
        "inter_node": [(0, 4), (1, 5), (2, 6), (3, 7)],
    }


def test_rank_lists_world8_tp4_two_nodes():
    lists = build_rank_lists(8, 4, topo(TWO_NODES_4))
    assert lists == {
        "tp": [(0, 1, 2, 3), (4, 5, 6, 7)],
        "dp": [(0, 4), (1, 5), (2, 6), (3, 7)],
        "intra_node": [(0, 1, 2, 3), (4, 5, 6, 7)],
        "inter_node": [(0, 4), (1, 5), (2, 6), (3, 7)],
    }


def test_rank_lists_every_rank_in_exactly_one_group_of_each_kind():
    for tp in (1, 2, 4, 8):
        lists = build_rank_lists(8, tp, topo(TWO_NODES_4))
        for kind, groups in lists.items():
            flat = sorted(r for g in groups for r in g)
            assert flat == list(range(8)), (tp, kind, groups)


def test_rank_lists_uneven_nodes_have_no_inter_node_groups():
    lists = build_rank_lists(6, 1, topo(UNEVEN))
    assert lists["intra_node"] == [(0, 3, 4), (1, 2), (5,)]
    assert lists["inter_node"] == []


# ------------------------------------------------------------------ validate_tp_size

@pytest.mark.parametrize("tp", [1, 2, 4])
def test_validate_tp_size_ok_within_a_node(tp):
    validate_tp_size(8, tp, topo(TWO_NODES_4), tp_spans_nodes=False)


def test_validate_tp_size_spanning_nodes_allowed_when_asked():
    validate_tp_size(8, 8, topo(TWO_NODES_4), tp_spans_nodes=True)


@pytest.mark.parametrize("tp", [3, 5, 6, 7, 16])
def test_validate_tp_size_must_divide_world(tp):
    with pytest.raises(ValueError) as e:
        validate_tp_size(8, tp, topo(TWO_NODES_4), tp_spans_nodes=True)
    msg = str(e.value)
    assert f"tp_size={tp}" in msg
    assert "world_size=8" in msg
    assert "[1, 2, 4, 8]" in msg  # the valid sizes


def test_validate_tp_size_spanning_nodes_needs_the_flag():
    with pytest.raises(ValueError) as e:
        validate_tp_size(8, 8, topo(TWO_NODES_4), tp_spans_nodes=False)
    msg = str(e.value)
    assert "spans nodes" in msg
    assert "tp_spans_nodes=True" in msg
    assert "tp_size <= 4" in msg


def test_validate_tp_size_spanning_uneven_nodes():
    # world 4 on nodes of 3 + 1: tp 2 puts ranks 2 and 3 on different nodes.
    with pytest.raises(ValueError, match="tp_spans_nodes=True"):
        validate_tp_size(4, 2, topo(("a", "a", "a", "b")), tp_spans_nodes=False)


@pytest.mark.parametrize("tp", [0, -2, 2.0, "2", None])
def test_validate_tp_size_must_be_positive_int(tp):
    with pytest.raises(ValueError, match="tp_size must be a positive int"):
        validate_tp_size(8, tp, topo(TWO_NODES_4), tp_spans_nodes=True)
