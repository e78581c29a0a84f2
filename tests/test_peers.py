"""fusedist.distributed.peers in one process: process identity and state (running, zombie,
exited, a reused pid), which errors count as a lost peer, the PeerLostError's message, and
collective_timeout leaving groups it cannot bound alone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

import fusedist
from fusedist.distributed import peers

LINUX = os.path.isdir("/proc/self/task")


@pytest.mark.skipif(not LINUX, reason="reads /proc")
def test_process_state():
    host, pid, start = peers.process_identity()
    assert pid == os.getpid() and start is not None and host.count("/") == 2
    assert peers.process_state(pid, start) == "running"
    assert peers.process_state(pid, start + 1) == "exited"          # the pid is another's now
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        start_p = None
        for _ in range(100):
            start_p = peers._start_time(p.pid)
            if start_p is not None:
                break
            time.sleep(0.01)
        assert peers.process_state(p.pid, start_p) == "running"
        p.send_signal(signal.SIGKILL)
        deadline = time.time() + 10
        while peers.process_state(p.pid, start_p) != "zombie" and time.time() < deadline:
            time.sleep(0.01)
        assert peers.process_state(p.pid, start_p) == "zombie"      # not reaped yet
    finally:
        p.kill()
        p.wait()
    assert peers.process_state(p.pid, start_p) == "exited"


def test_is_peer_failure():
    gloo = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
                        "[127.0.0.1]:3279: Connection reset by peer")
    assert peers.is_peer_failure(gloo)
    assert peers.is_peer_failure(__import__("torch").distributed.DistBackendError("x"))
    assert not peers.is_peer_failure(RuntimeError("CUDA out of memory"))
    assert not peers.is_peer_failure(fusedist.CollectiveMismatchError("gloo would abort"))
    assert not peers.is_peer_failure(ValueError("gloo"))


@pytest.mark.skipif(not LINUX, reason="reads /proc")
def test_peer_lost_error_message():
    me = peers.process_identity()
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    gone = (me[0], p.pid, 12345)
    other_host = ("elsewhere/boot/1", 1, 1)
    group = SimpleNamespace(name="tp0", ranks=(0, 1, 2))
    err = RuntimeError("gloo: Connection closed by peer " + "x" * 400)
    e = peers.peer_lost_error("Runner.generate", group, [me, gone, other_host], 0, err)
    assert isinstance(e, fusedist.PeerLostError) and isinstance(e, fusedist.FusedistError)
    msg = str(e)
    assert msg.startswith(f"Runner.generate: rank 1 of group tp0 is lost: its process (pid "
                          f"{p.pid} on this host) has exited (ranks [2] on other hosts were "
                          "not checked)"), msg
    assert "Connection closed by peer" in msg and msg.endswith("...)") and len(msg) < 700
    alive = (me[0], os.getpid(), me[2])
    t0 = time.time()
    msg = str(peers.peer_lost_error("Runner.generate", SimpleNamespace(name="tp0", ranks=(0, 1)),
                                    [me, alive], 0, err))
    assert "stopped answering: every rank of it is still running on this host" in msg, msg
    assert time.time() - t0 < 10
    msg = str(peers.peer_lost_error("Runner.generate", group, None, 0, err))
    assert "a peer of group tp0 (ranks [0, 1, 2]) was lost or stopped answering" in msg, msg


def test_collective_timeout_leaves_what_it_cannot_bound():
    calls = []
    pg = SimpleNamespace(set_timeout=calls.append)
    one = SimpleNamespace(pg=pg, size=1, backend="gloo")
    nccl = SimpleNamespace(pg=pg, size=2, backend="nccl")
    gloo = SimpleNamespace(pg=pg, size=2, backend="gloo")
    for g, s, r in ((one, 3, 300), (nccl, 3, 300), (gloo, 3, None), (gloo, None, 300),
                    (None, 3, 300)):
        with peers.collective_timeout(g, s, r):
            pass
    assert calls == []
    with peers.collective_timeout(gloo, 3, 300):
        assert [c.total_seconds() for c in calls] == [3]
    assert [c.total_seconds() for c in calls] == [3, 300]
