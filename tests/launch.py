"""Start multi-process test workers with torchrun or mpirun and return their output; a
worker that hangs is killed at the timeout (the test fails, the suite goes on)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DIST = Path(__file__).resolve().parent / "dist"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(extra: dict | None) -> dict:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update({k: str(v) for k, v in (extra or {}).items()})
    return env


def _run(cmd, env, timeout) -> subprocess.CompletedProcess:
    """Run cmd, its output captured through a file: a temporary one, or with
    FUSEDIST_WORKER_LOG_DIR set one kept there, written as the workers print, so a run killed
    from outside (a CI stage's timeout) still leaves their per-check lines behind."""
    log_dir = os.environ.get("FUSEDIST_WORKER_LOG_DIR")
    if log_dir:
        os.makedirs(log_dir, exist_ok=True)
        name = next((Path(c).stem for c in map(str, cmd) if c.endswith(".py")), "worker")
        path = Path(log_dir) / f"{name}-{os.getpid()}-{time.monotonic_ns()}.log"
        log = open(path, "w+")
    else:
        path, log = None, tempfile.TemporaryFile("w+")
    with log:
        try:
            p = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True,
                               timeout=timeout, cwd=ROOT)
        except subprocess.TimeoutExpired:
            log.seek(0)
            where = f" (log: {path})" if path else ""
            raise AssertionError(f"{' '.join(map(str, cmd))} timed out after {timeout}s{where}\n"
                                 f"{log.read()}")
        log.seek(0)
        p.stdout = log.read()
    return p


def torchrun(worker: str, nproc: int, env: dict | None = None, timeout: int = 600,
             args=()) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           str(DIST / worker), *args]
    return _run(cmd, _env(env), timeout)


def emulate(worker: str, world: int, env: dict | None = None,
            timeout: int = 600) -> subprocess.CompletedProcess:
    """The worker's checks marked @emulated on `world` ranks emulated on one GPU, in one
    process (tests/dist/emulate.py)."""
    cmd = [sys.executable, str(DIST / "emulate.py"), worker, "--world", str(world)]
    return _run(cmd, _env(env), timeout)


def mpirun_available() -> bool:
    return shutil.which("mpirun") is not None


def mpirun(worker: str, nproc: int, env: dict | None = None, timeout: int = 600,
           args=()) -> subprocess.CompletedProcess:
    e = _env(env)
    e.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    e.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    e.setdefault("OMPI_MCA_rmaps_base_oversubscribe", "1")
    # No MASTER_ADDR: fusedist bootstraps the rendezvous address through mpi4py.
    e.pop("MASTER_ADDR", None)
    e.pop("MASTER_PORT", None)
    e["PYTHON"] = sys.executable  # launchers/mpirun.sh runs "$PYTHON script args"
    cmd = ["bash", str(ROOT / "launchers" / "mpirun.sh"), "-np", str(nproc), "--",
           str(DIST / worker), *args]
    return _run(cmd, e, timeout)


def assert_passed(p: subprocess.CompletedProcess, nproc: int) -> None:
    passed = p.stdout.count("all checks passed")
    assert p.returncode == 0 and passed == nproc, \
        f"exit {p.returncode}, {passed}/{nproc} ranks passed\n{p.stdout[-6000:]}"
    # Checks that could not run on this tier (tests/dist/_checks.py prints "[skip] name
    # (time): reason"): reported in pytest's warnings summary, never counted as passed.
    skipped = [line[len("[skip] "):] for line in p.stdout.splitlines()
               if line.startswith("[skip] ")]
    if skipped:
        warnings.warn(f"{len(skipped)} worker check(s) skipped: " + "; ".join(skipped),
                      SkippedChecks, stacklevel=2)


class SkippedChecks(UserWarning):
    """Worker checks that were skipped (not passed) in a multi-process test."""
