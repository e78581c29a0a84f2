"""Test tiers: no marker = CPU (runs everywhere); gpu = one GPU; gpu2/gpu4/gpu8 = that many
GPUs on one host, launched as one process per GPU. Missing GPUs skip. A host whose driver
lists GPUs (nvidia-smi) while CUDA cannot initialize fails the GPU tier instead: a broken GPU
host must not pass as a CPU-only one."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import zlib
from typing import Optional

import pytest

# The fusedist under test (the installed one under `python -P`, which keeps the source tree
# and its unbuilt package off sys.path) defines the multicast settings once.
from fusedist.distributed.runtime import SAFE_ENV

for _k, _v in SAFE_ENV.items():
    os.environ.setdefault(_k, _v)

_NEEDED = {"gpu": 1, "gpu2": 2, "gpu4": 4, "gpu8": 8}


# ---- seeds ----------------------------------------------------------------------------------
def _session_seed() -> int:
    """FUSEDIST_TEST_SEED, or a fresh seed for this run."""
    from fusedist import envs

    seed = envs.get("FUSEDIST_TEST_SEED")
    return seed if seed is not None else int.from_bytes(os.urandom(4), "little")


SESSION_SEED = _session_seed()
# pytest-xdist's workers (started after this module loads in the controller) and every other
# child process read the same session seed: the one the header prints.
os.environ["FUSEDIST_TEST_SEED"] = str(SESSION_SEED)


def _share_cores() -> None:
    """pytest-xdist's workers share the machine's cores: each computes on its share of them.
    torch's default, an intra-op thread per core in every worker, oversubscribes the cores
    (on 2 cores, 2 workers ran 4 OpenMP threads that spun waiting on each other)."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if workers.isdigit() and int(workers) > 1:
        import torch

        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // int(workers)))


_share_cores()


def test_seed(nodeid: str) -> int:
    """The seed of one test: from the session's and the test's name, so a test reruns with
    the same inputs alone or in any order."""
    return zlib.crc32(f"{SESSION_SEED}:{nodeid}".encode())


test_seed.__test__ = False      # not a test itself


def rerun_hint(nodeid: str) -> str:
    return (f"FUSEDIST_TEST_SEED={SESSION_SEED} (this test's generators: "
            f"torch.manual_seed({test_seed(nodeid)})); rerun: FUSEDIST_TEST_SEED={SESSION_SEED} "
            f"python3 -P -m pytest '{nodeid}'")


@pytest.fixture(autouse=True)
def _seeded(request):
    """Every test starts with torch's, random's and numpy's global generators seeded from
    test_seed (fresh inputs each run, reproducible with FUSEDIST_TEST_SEED)."""
    import torch

    seed = test_seed(request.node.nodeid)
    torch.manual_seed(seed)
    random.seed(seed)
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed(seed)
    yield


def pytest_report_header(config):
    return f"fusedist: FUSEDIST_TEST_SEED={SESSION_SEED}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if rep.failed:
        rep.sections.append(("seed", rerun_hint(item.nodeid)))


def listed_gpus() -> int:
    """GPUs the driver lists (nvidia-smi -L), 0 without nvidia-smi."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return 0
    try:
        out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def gpu_tier(listed: int, visible: Optional[str], cuda_build: bool, count: int,
             error: Optional[str]) -> tuple[int, Optional[str]]:
    """(GPUs the GPU tier may use, why the GPU tier must fail or None). `listed`: GPUs the
    driver lists; `visible`: CUDA_VISIBLE_DEVICES (None: unset); `cuda_build`: torch was built
    with CUDA; `count`, `error`: what torch.cuda reported (error: its exception, if any)."""
    if error is None and count > 0:
        return count, None
    hidden = visible is not None and visible.strip() in ("", "-1")
    if listed and not hidden:
        why = error or ("torch.cuda.is_available() is False" if cuda_build else
                        "this torch was built without CUDA")
        return 0, (f"nvidia-smi lists {listed} GPU(s) but CUDA does not initialize ({why}); "
                   "fix the driver / CUDA setup, or set CUDA_VISIBLE_DEVICES= to run the CPU "
                   "tier only")
    return 0, None


def _probe() -> tuple[int, Optional[str]]:
    try:
        import torch

        cuda_build = torch.version.cuda is not None
        count, error = (torch.cuda.device_count() if torch.cuda.is_available() else 0), None
    except Exception as e:  # noqa: BLE001 - any init failure is reported, not swallowed
        cuda_build, count, error = True, 0, f"{type(e).__name__}: {e}"
    return gpu_tier(listed_gpus(), os.environ.get("CUDA_VISIBLE_DEVICES"), cuda_build, count,
                    error)


_STATE: Optional[tuple[int, Optional[str]]] = None


def _state() -> tuple[int, Optional[str]]:
    global _STATE
    if _STATE is None:
        _STATE = _probe()
    return _STATE


def pytest_collection_modifyitems(config, items):
    if not any(m in item.keywords for item in items for m in _NEEDED):
        return
    have, broken = _state()
    for item in items:
        for mark, need in _NEEDED.items():
            if mark in item.keywords and have < need and broken is None:
                item.add_marker(pytest.mark.skip(reason=f"needs {need} GPU(s), found {have}"))


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "kernel(name, ...): the test needs these kernels of fusedist._C "
        "(fusedist._ext.KERNELS names); on its GPU a missing one fails it (require_kernel)")


def pytest_runtest_setup(item):
    if any(m in item.keywords for m in _NEEDED):
        broken = _state()[1]
        if broken is not None:
            pytest.fail(broken, pytrace=False)
    for mark in item.iter_markers("kernel"):
        for name in mark.args:
            require_kernel(name)


# ---- kernels the build must carry ------------------------------------------------------------
def kernel_problem(kernel: str, device="cuda") -> tuple[str, str]:
    """("fail" | "skip" | "", why) for a test that needs `kernel` (a fusedist._ext.KERNELS
    name) on `device`, asking fusedist._ext's capability table. On a CUDA device: a build
    without the kernel, without _C, or for architectures that do not run on the device
    fails (a GPU host whose build lacks a kernel must not pass as if the kernel were not
    needed); only a device older than the kernel needs skips. On the CPU (checks of _C's
    bindings without a GPU): no _C skips (FUSEDIST_REQUIRE_EXT=1: fails), a _C without the
    kernel fails."""
    import torch

    from fusedist import _ext

    if kernel not in _ext.KERNELS:
        raise KeyError(f"require_kernel: unknown kernel {kernel!r}; known: "
                       f"{sorted(_ext.KERNELS)}")
    dev = torch.device(device)
    caps = _ext.capabilities()
    if dev.type != "cuda":
        if not caps.built:
            why = f"fusedist._C is not built ({caps.why_missing})"
            return ("fail" if os.environ.get("FUSEDIST_REQUIRE_EXT") == "1" else "skip"), why
        if not caps.has(kernel):
            return "fail", f"fusedist._C was built without the {kernel} kernel: rebuild fusedist"
        return "", ""
    why = _ext.why_not(kernel, dev)
    if not why:
        return "", ""
    need = _ext.KERNELS[kernel].min_cc
    if caps.built and caps.has(kernel) and _ext.device_capability(dev) < need:
        return "skip", why
    return "fail", f"the {kernel} kernel does not run on {dev}: {why}; rebuild fusedist"


def require_kernel(kernel: str, device="cuda") -> None:
    """Fail (or, for a device older than the kernel needs, skip) the running test unless
    `kernel` runs on `device`: kernel_problem's rule, the one every test that needs a kernel
    of fusedist._C follows (or @pytest.mark.kernel(name) on a gpu test)."""
    verdict, why = kernel_problem(kernel, device)
    if verdict == "fail":
        pytest.fail(why, pytrace=False)
    if verdict == "skip":
        pytest.skip(why)


def pytest_sessionfinish(session, exitstatus):
    launch = sys.modules.get("launch")
    if launch is not None:
        launch.shutdown_pool()


def pytest_terminal_summary(terminalreporter):
    """The session's CPU time, this process's and its children's (workers, pooled processes,
    subprocesses; the pool's forkserver is waited for at the end): what the suite costs on a
    machine whose cores other work shares, where wall time says little."""
    import resource

    me, kids = (resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    terminalreporter.write_line(
        f"fusedist: CPU time {me.ru_utime + me.ru_stime:.0f} s in pytest, "
        f"{kids.ru_utime + kids.ru_stime:.0f} s in its child processes")
