"""A rank killed (SIGKILL) during Runner.generate at TP 2 and TP 3 over gloo on CPU, 10 times
each, a different victim in turn: every survivor exits on its own with a non-zero status
(a Python error, not a signal) and a fusedist.PeerLostError that names the lost rank, within
FUSEDIST_TIMEOUT_S (10 s here) plus 15 s to exit of the kill. The ranks are started directly
(not by torchrun, whose agent would end the survivors itself), so nothing but fusedist ends
them."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))
from launch import DIST, RendezvousStore, spawn  # noqa: E402

# The bound on a survivor: a collective whose peer is gone either fails at once (the peer's
# connection resets) or when FUSEDIST_TIMEOUT_S runs out (a send to a rank that itself is
# leaving); then the error is raised and the interpreter exits, which on a loaded 2-core
# machine takes a few seconds more.
TIMEOUT_S = 10.0        # FUSEDIST_TIMEOUT_S of the ranks
EXIT_S = 15.0           # raising, unwinding and exiting after it
BOUND_S = TIMEOUT_S + EXIT_S   # survivors must be gone this long after the kill
START_S = 120.0         # every rank up and generating


def _start(world: int, logs: list, store: RendezvousStore,
           extra: dict | None = None) -> list:
    """The ranks, each a process of its own (forked from the test pool's pre-imported server
    on CPU), joining `store`: a rendezvous on a port this process holds, which no rank owns
    (a killed rank 0 takes no store with it, as with torchrun's agent store)."""
    procs = []
    for r in range(world):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r),
                   LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                   CUDA_VISIBLE_DEVICES="", FUSEDIST_TIMEOUT_S=f"{TIMEOUT_S:g}",
                   **store.env())
        env.update(extra or {})
        for k in ("TORCHELASTIC_RUN_ID", "GROUP_RANK", "FUSEDIST_NODE_ID"):
            env.pop(k, None)
        procs.append(spawn([str(DIST / "worker_runner_kill.py")], env, logs[r]))
    return procs


def _read(f) -> str:
    f.flush()
    f.seek(0)
    return f.read()


def _wait_generating(procs, logs) -> list:
    t0 = time.time()
    while not all(f"rank {r} generating" in _read(logs[r]) for r in range(len(procs))):
        dead = [r for r, p in enumerate(procs) if p.poll() is not None]
        if dead or time.time() - t0 > START_S:
            return [f"ranks did not start (exited: {dead}):\n" +
                    "\n".join(_read(f)[-1500:] for f in logs)]
        time.sleep(0.05)
    return []


def _one_run(world: int, victim: int, rng: random.Random, sig=signal.SIGKILL,
             extra: dict | None = None, want: str | None = None) -> list:
    """Start `world` ranks, send `sig` to `victim` during generate; return the problems found
    (`want`: the text every survivor's error must hold; default: the victim named as lost)."""
    want = want or f"rank {victim} of group"
    logs = [tempfile.NamedTemporaryFile("w+") for _ in range(world)]
    store = RendezvousStore()
    procs = _start(world, logs, store, extra)
    problems = []
    try:
        problems = _wait_generating(procs, logs)
        if problems:
            return problems
        time.sleep(rng.uniform(0.3, 1.0))               # somewhere inside a generate call
        procs[victim].send_signal(sig)
        killed = time.time()
        for r, p in enumerate(procs):
            if r == victim:               # a stopped victim is killed at the end
                if sig == signal.SIGKILL:
                    p.wait()
                continue
            left = BOUND_S - (time.time() - killed)
            try:
                rc = p.wait(timeout=max(left, 0.1))
            except subprocess.TimeoutExpired:
                problems.append(f"rank {r} still running {BOUND_S:g} s after rank {victim} was "
                                f"killed:\n{_read(logs[r])[-2000:]}")
                continue
            out = _read(logs[r])
            if rc <= 0:
                problems.append(f"rank {r} exited with {rc} (want a Python error exit, > 0):\n"
                                f"{out[-2000:]}")
            elif "PeerLostError" not in out or want not in out:
                problems.append(f"rank {r} exited {rc} without a PeerLostError saying {want!r}"
                                f":\n{out[-2000:]}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in logs:
            f.close()
        store.close()
    return problems


def _kill_runs(world: int, runs: int = 10) -> None:
    rng = random.Random(world)
    problems = []
    for i in range(runs):
        victim = i % world
        problems += [f"run {i} (world {world}, victim {victim}): {p}"
                     for p in _one_run(world, victim, rng)]
    assert not problems, f"{len(problems)} problem(s):\n" + "\n\n".join(problems)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_killed_rank_tp2_cpu():
    _kill_runs(2)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_killed_rank_tp3_cpu():
    _kill_runs(3)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_stopped_rank_fails_within_the_peer_timeout():
    """A rank stopped (SIGSTOP) during generate at TP 2: the other fails with PeerLostError
    (the peer is still running but does not answer) within FUSEDIST_TIMEOUT_S (4 s here) of
    the collective it waits in, not after the process group's 300 s."""
    problems = _one_run(2, 1, random.Random(0), signal.SIGSTOP, {"FUSEDIST_TIMEOUT_S": "4"},
                        "stopped answering: every rank of it is still running on this host")
    assert not problems, "\n\n".join(problems)
