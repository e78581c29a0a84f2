"""Two nodes on one host through the real launcher: launchers/netns_nodes.sh puts 2 ranks in
each of two network namespaces joined by a tc-shaped veth, one `torchrun --nnodes 2` agent per
namespace; the checks of the two-level and FP8 collectives' workers and of the fused ops'
two-level forms (tests/dist/worker_two_level.py: the three workers in one job) pass there
against float64 references.
Needs root, `ip` and `tc` (skipped otherwise)."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys

import pytest

from launch import DIST, ROOT, _env, _run, assert_passed, free_port


def _netns_usable() -> str:
    if os.geteuid() != 0:
        return "needs root"
    if not shutil.which("ip") or not shutil.which("tc"):
        return "needs iproute2 (ip, tc)"
    name = f"fdprobe{os.getpid() % 100000}"
    ok = subprocess.run(["ip", "netns", "add", name], capture_output=True).returncode == 0
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return "" if ok else "ip netns add failed (no network-namespace support here)"


WHY_NOT = _netns_usable()


def _checks_of(worker: str) -> list:
    """The names of a worker's @check functions, read from its source."""
    tree = ast.parse((DIST / worker).read_text())
    return [f.name for f in tree.body if isinstance(f, ast.FunctionDef)
            and any(isinstance(d, ast.Name) and d.id == "check" for d in f.decorator_list)]


WORKERS = ("worker_hierarchical.py", "worker_fp8_comm.py", "worker_hierarchical_ops.py")


@pytest.mark.timeout(600)
@pytest.mark.skipif(bool(WHY_NOT), reason=WHY_NOT or "netns")
def test_two_nodes_in_network_namespaces():
    prefix = f"fdt{os.getpid() % 10000}"
    cmd = ["bash", str(ROOT / "launchers" / "netns_nodes.sh"), "--nproc", "2", "--rate",
           "400mbit", "--port", str(free_port()), "--prefix", prefix, "--timeout", "500", "--",
           str(DIST / "worker_two_level.py")]
    # PYTHON: the launcher runs this interpreter (the one running the tests), not python3
    # from PATH, which may be another Python without fusedist's dependencies.
    p = _run(cmd, _env({"CUDA_VISIBLE_DEVICES": "", "FUSEDIST_INIT_TIMEOUT_S": "60",
                        "PYTHONPATH": str(ROOT), "PYTHON": sys.executable}), 560)
    assert_passed(p, 4)
    # every check of the three workers ran, and passed (rank 0's summary line)
    summary = dict(re.findall(r"(\w+)=(\w+)", next(
        line for line in p.stdout.splitlines() if line.startswith("summary: "))))
    for worker in WORKERS:
        for name in _checks_of(worker):
            assert summary.get(name) == "ok", f"{worker}: {name} {summary.get(name, 'not run')}"
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert prefix not in listed, f"namespaces left behind: {listed}"
