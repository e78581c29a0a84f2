"""The setup steps behind the README's two commands (launchers/setup.sh), and the CPU main job
(launchers/reference_check.py): each missing piece stops with one line that says what is
missing and how to get it, and the reference check passes over gloo."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from launch import python

ROOT = Path(__file__).resolve().parents[1]


def fake_tool(tmp_path: Path, name: str, script: str) -> Path:
    d = tmp_path / f"bin-{name}"
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_text("#!/bin/sh\n" + script)
    (d / name).chmod(0o755)
    return d


def setup_sh(snippet: str, path_dirs=(), drop_nvcc=False, **env) -> subprocess.CompletedProcess:
    """Run `source launchers/setup.sh; <snippet>` in bash from the repository root."""
    e = dict(os.environ)
    paths = e.get("PATH", "").split(":")
    if drop_nvcc:
        paths = [p for p in paths if not (Path(p) / "nvcc").exists()]
    e["PATH"] = ":".join([str(p) for p in path_dirs] + paths)
    for k, v in env.items():
        if v is None:
            e.pop(k, None)
        else:
            e[k] = v
    return subprocess.run(["bash", "-c", f"source launchers/setup.sh; {snippet}"], cwd=ROOT,
                          env=e, capture_output=True, text=True, timeout=120)


def one_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.startswith("fusedist: ")]
    assert len(lines) == 1, stderr
    return lines[0]


def test_a_broken_driver_stops_with_the_fix(tmp_path):
    bin_dir = fake_tool(tmp_path, "nvidia-smi", "echo 'NVIDIA-SMI has failed because it "
                        "could not communicate with the NVIDIA driver.' >&2\nexit 9\n")
    r = setup_sh("fd_gpus; echo NGPU=$NGPU", [bin_dir])
    assert r.returncode == 1 and "NGPU=" not in r.stdout
    line = one_line(r.stderr)
    assert "nvidia-smi is installed but fails" in line and "could not communicate" in line
    assert "FUSEDIST_DEVICE=cpu" in line
    # FUSEDIST_DEVICE=cpu is the way past it.
    r = setup_sh("fd_gpus; echo NGPU=$NGPU", [bin_dir], FUSEDIST_DEVICE="cpu")
    assert r.returncode == 0 and "NGPU=0" in r.stdout


def test_gpus_counted_and_limited_by_cuda_visible_devices(tmp_path):
    bin_dir = fake_tool(tmp_path, "nvidia-smi", "echo 'GPU 0: NVIDIA H200 (UUID: GPU-a)'\n"
                        "echo 'GPU 1: NVIDIA H200 (UUID: GPU-b)'\n")
    count = lambda **env: setup_sh("fd_gpus; echo NGPU=$NGPU", [bin_dir], **env)  # noqa: E731
    assert "NGPU=2" in count(CUDA_VISIBLE_DEVICES=None).stdout
    assert "NGPU=1" in count(CUDA_VISIBLE_DEVICES="1").stdout
    assert "NGPU=0" in count(CUDA_VISIBLE_DEVICES="").stdout


def test_gpus_but_a_cpu_torch_stops(tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this torch can use a GPU")
    bin_dir = fake_tool(tmp_path, "nvidia-smi", "echo 'GPU 0: NVIDIA H200 (UUID: GPU-a)'\n")
    r = setup_sh("fd_gpus; fd_torch; echo reached", [bin_dir], CUDA_VISIBLE_DEVICES=None,
                 PYTHON=sys.executable)
    assert r.returncode == 1 and "reached" not in r.stdout
    assert "cannot use them" in one_line(r.stderr)


def test_no_nvcc_and_an_old_nvcc_stop(tmp_path):
    r = setup_sh("fd_nvcc; echo found $CUDACXX", drop_nvcc=True, CUDACXX=None,
                 CUDA_HOME=str(tmp_path / "no-cuda"))
    assert r.returncode == 1 and "found" not in r.stdout
    line = one_line(r.stderr)
    assert "needs nvcc (CUDA >= 12.4)" in line and "CUDACXX" in line
    old = fake_tool(tmp_path, "nvcc", "echo 'Cuda compilation tools, release 12.1, V12.1.105'\n")
    r = setup_sh("fd_nvcc; echo found", CUDACXX=str(old / "nvcc"))
    assert r.returncode == 1 and "is CUDA 12.1" in one_line(r.stderr)
    new = fake_tool(tmp_path / "new", "nvcc", "echo 'Cuda compilation tools, release 13.0, V13.0.48'\n")
    r = setup_sh("fd_nvcc; echo found $CUDACXX", CUDACXX=str(new / "nvcc"))
    assert r.returncode == 0 and f"found {new / 'nvcc'}" in r.stdout


def test_build_jobs_ignore_the_workers_thread_limit():
    """fd_build compiles with every core the memory allows, also under OMP_NUM_THREADS=1 (set
    by torchrun and by tests/gpu/run.sh for their workers), which `nproc` alone obeys: sized
    by it, tests/gpu/run.sh's build stage compiles one file at a time on a 16-core host."""
    r = setup_sh("fd_build_jobs; OMP_NUM_THREADS=1 OMP_THREAD_LIMIT=1 fd_build_jobs",
                 OMP_NUM_THREADS=None, OMP_THREAD_LIMIT=None)
    assert r.returncode == 0, r.stderr
    free, limited = (int(x) for x in r.stdout.split())
    assert limited == free, (limited, free)
    cores = len(os.sched_getaffinity(0))
    mem_gb = int(next(ln.split()[1] for ln in Path("/proc/meminfo").read_text().splitlines()
                      if ln.startswith("MemAvailable:"))) // 1048576
    # One job per 4 GB of free memory at most (a CUTLASS instantiation peaks ~3.4 GB); with
    # two cores and 8 GB free there are at least two.
    assert 1 <= free <= cores
    if cores >= 2 and mem_gb >= 9:
        assert free >= 2


def test_an_uninstallable_package_names_itself_and_the_wheel_directory(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    # No index reachable (a closed local port), no pip configuration, an empty wheel dir.
    r = setup_sh("fd_pip --no-deps fusedist-absent-test-package==0.0.1", PYTHON=sys.executable,
                 PIP_CONFIG_FILE="/dev/null", PIP_INDEX_URL="http://127.0.0.1:9/simple",
                 PIP_FIND_LINKS=None, PIP_EXTRA_INDEX_URL=None, PIP_RETRIES="0",
                 FUSEDIST_WHEELS=str(wheels))
    assert r.returncode == 1
    line = one_line(r.stderr)
    assert "could not install fusedist-absent-test-package==0.0.1" in line
    assert str(wheels) in line and "launchers/download-wheels.sh" in line
    assert "--no-deps" not in line
    r = setup_sh("true", FUSEDIST_WHEELS=str(tmp_path / "nowhere"), PYTHON=sys.executable)
    assert r.returncode == 0  # checked by fd_python, not at source time
    r = setup_sh("fd_python", FUSEDIST_WHEELS=str(tmp_path / "nowhere"), PYTHON=sys.executable)
    assert r.returncode == 1 and "is not a directory" in one_line(r.stderr)


def test_the_cpu_reference_check_passes_over_gloo():
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    r = python(["-P", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                str(ROOT / "launchers" / "reference_check.py")], env=env, timeout=240, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = [ln for ln in r.stdout.splitlines() if ln.startswith("| ") and "---" not in ln][1:]
    assert len(rows) >= 10, r.stdout
    assert not [ln for ln in rows if "FAILED" in ln], r.stdout
    assert sum("checked ok" in ln for ln in rows) >= 10
    assert "Correctness, not speed" in r.stdout
