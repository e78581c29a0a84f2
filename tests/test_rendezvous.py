"""A rendezvous that cannot complete ends in fusedist.RendezvousError within a bounded time:
rank 0 whose peers never come, a rank whose rendezvous host does not answer or does not
resolve; and torchrun's own rendezvous of a node whose peer node never starts ends too, with
the timeouts docs/launchers.md gives."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from launch import ROOT, _env, free_port

INIT = """
import sys, time, fusedist
t = time.time()
try:
    fusedist.init(rank={rank}, world_size=2, master_addr={addr!r}, master_port={port},
                  timeout_s=2, backend="gloo")
except fusedist.RendezvousError as e:
    print(f"RendezvousError after {{time.time() - t:.1f}}s: {{e}}")
    sys.exit(3)
print("init returned")
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("rank,addr,role", [
    (0, "127.0.0.1", "listened for the other ranks"),
    (1, "127.0.0.1", "tried to reach rank 0's rendezvous"),
    (1, "no-such-host.invalid", "tried to reach rank 0's rendezvous"),
])
def test_unreachable_rendezvous_is_a_clear_error(rank, addr, role):
    port = free_port()
    t0 = time.time()
    p = subprocess.run([sys.executable, "-c", INIT.format(rank=rank, addr=addr, port=port)],
                       env=_env({"CUDA_VISIBLE_DEVICES": ""}), capture_output=True, text=True,
                       timeout=100, cwd=ROOT)
    took = time.time() - t0
    assert p.returncode == 3, p.stdout[-2000:] + p.stderr[-2000:]
    msg = p.stdout
    assert f"rank {rank} of 2 {role} at {addr}:{port} for 2 s" in msg, msg
    assert "MASTER_ADDR" in msg and "FUSEDIST_INIT_TIMEOUT_S" in msg, msg
    assert took < 60, f"took {took:.0f}s to give up"


@pytest.mark.timeout(120)
def test_torchrun_static_rendezvous_of_a_missing_node_ends():
    """Node 1 of 2 whose node 0 never starts: torchrun's static rendezvous gives up after its
    --rdzv-conf timeout (without one it waits 15 minutes)."""
    port = free_port()
    t0 = time.time()
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                        "--node-rank", "1", "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
                        "--master-port", str(port), "--rdzv-conf", "timeout=5", "--no-python", "true"],
                       env=_env({"CUDA_VISIBLE_DEVICES": ""}), capture_output=True, text=True,
                       timeout=100, cwd=ROOT)
    assert p.returncode != 0
    assert "timed out" in (p.stdout + p.stderr)
    assert time.time() - t0 < 90
