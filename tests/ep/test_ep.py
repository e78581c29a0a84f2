"""fusedist.ep.Buffer on several processes: tests/dist/worker_ep.py on 2, 3 and 4 CPU ranks over
gloo (the high-throughput path, flat and two-level on 2 emulated nodes x 2), a lost peer
(tests/dist/worker_ep_lost.py), and on 2 GPUs over NCCL and symmetric memory (gpu2)."""

from __future__ import annotations

import pytest

from launch import assert_passed, torchrun

CPU_ENV = {"CUDA_VISIBLE_DEVICES": "", "FUSEDIST_INIT_TIMEOUT_S": "60"}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_ep_cpu(world):
    assert_passed(torchrun("worker_ep.py", world, CPU_ENV, timeout=380), world)


@pytest.mark.timeout(400)
def test_ep_cpu_two_nodes_of_two():
    """Two emulated nodes (FUSEDIST_NODE_ID node<rank // 2>): the two-level exchange."""
    assert_passed(torchrun("worker_ep.py", 4, {**CPU_ENV, "EP_TEST_NODES": "2"}, timeout=380), 4)


@pytest.mark.timeout(200)
def test_a_lost_peer_ends_the_others_with_peer_lost_error():
    """The last of 3 ranks exits mid-run: the others' dispatch ends with PeerLostError naming
    it, within the buffer's timeout."""
    p = torchrun("worker_ep_lost.py", 3, CPU_ENV, timeout=180)
    assert_passed(p, 2)
    assert p.stdout.count("[lost] rank") == 2 and "rank 2 of group world is lost" in p.stdout, \
        p.stdout[-3000:]


@pytest.mark.gpu2
@pytest.mark.timeout(900)
def test_ep_gpu2():
    """Both modes on 2 GPUs: NCCL all-to-all and the symmetric-memory kernels over NVLink."""
    assert_passed(torchrun("worker_ep.py", 2, timeout=880), 2)
