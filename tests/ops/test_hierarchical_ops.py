"""The fused ops' two-level forms (all_reduce_add_rmsnorm, gemm_ar, gemm_rs, ag_gemm on a
tensor-parallel group that spans nodes; tests/dist/worker_hierarchical_ops.py): 4 CPU ranks as
2 emulated nodes x 2 (the group is the world), 8 as 4 x 2 with tensor-parallel groups of 4 (two
groups of 2 nodes x 2, their levels made by their own ranks); 4 GPUs as 2 x 2 over NCCL. Two
network namespaces as the nodes: tests/test_netns_nodes.py."""

from __future__ import annotations

import pytest

from launch import assert_passed, torchrun

CPU_ENV = {"CUDA_VISIBLE_DEVICES": "", "FUSEDIST_INIT_TIMEOUT_S": "60"}


@pytest.mark.timeout(300)
def test_two_level_ops_2_nodes_x_2():
    assert_passed(torchrun("worker_hierarchical_ops.py", 4, CPU_ENV, timeout=280), 4)


@pytest.mark.timeout(400)
def test_two_level_ops_tp_groups_of_2_nodes_x_2_in_8_ranks():
    assert_passed(torchrun("worker_hierarchical_ops.py", 8, {**CPU_ENV, "FUSEDIST_TEST_TP": "4"},
                           timeout=380), 8)


# 4 GPUs as 2 emulated nodes x 2 (NCCL_HOSTID per node, over loopback): the two-level forms on
# NCCL; the ranks are NVLink peers, so the checks force the two-level forms (fused=False, a
# HierarchicalCommunicator as group=, engine="hierarchical").
@pytest.mark.gpu4
@pytest.mark.timeout(600)
def test_two_level_ops_2_nodes_x_2_gpu4():
    assert_passed(torchrun("worker_hierarchical_ops.py", 4, {"NCCL_SOCKET_IFNAME": "lo"},
                           timeout=580), 4)
