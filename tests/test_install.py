"""`pip install .` on a machine that cannot build fusedist._C: with FUSEDIST_BUILD=0 (no CMake
at all), or with nvcc / the CUTLASS headers missing (CMake configures, warns and installs
nothing), the pure-Python package installs and runs the CPU path; FUSEDIST_BUILD=1 turns a
missing piece into an error. The CMake checks run `cmake` configure only: nothing compiles."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _env(**kv) -> dict:
    e = dict(os.environ)
    for k in ("FUSEDIST_BUILD", "FUSEDIST_CUTLASS_INCLUDE", "CUDACXX"):
        e.pop(k, None)
    e.update(kv)
    return e


@pytest.mark.skipif(importlib.util.find_spec("scikit_build_core") is None,
                    reason="scikit-build-core is not installed (pip install scikit-build-core)")
@pytest.mark.slow
def test_pip_install_without_build(tmp_path):
    target = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                        "--no-build-isolation", "--no-cache-dir", "--target", str(target), "."],
                       cwd=ROOT, env=_env(FUSEDIST_BUILD="0", PIP_DISABLE_PIP_VERSION_CHECK="1"),
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    assert not list((target / "fusedist").glob("_C*")), "FUSEDIST_BUILD=0 must not build _C"
    code = ("import fusedist, fusedist._ext as e, torch; print(fusedist.__file__); "
            "print(e.available()); rt = fusedist.init(backend='gloo'); "
            "print(fusedist.all_reduce(torch.arange(3.0)).tolist()); fusedist.shutdown()")
    r = subprocess.run([sys.executable, "-P", "-c", code], cwd=tmp_path,
                       env=_env(PYTHONPATH=str(target), CUDA_VISIBLE_DEVICES=""),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    where, available, reduced = r.stdout.strip().splitlines()[-3:]
    assert Path(where).resolve().is_relative_to(target.resolve())
    assert available == "False"
    assert reduced == "[0.0, 1.0, 2.0]"
    assert (target / "fusedist" / "tuning_default.json").is_file()


def _configure(tmp_path: Path, **env) -> subprocess.CompletedProcess:
    build = tmp_path / "build"
    shutil.rmtree(build, ignore_errors=True)
    return subprocess.run(["cmake", "-S", str(ROOT), "-B", str(build),
                           f"-DPython_EXECUTABLE={sys.executable}"],
                          env=_env(**env), capture_output=True, text=True, timeout=180)


@pytest.fixture
def fake_cutlass(tmp_path) -> str:
    inc = tmp_path / "cutlass-include"
    (inc / "cutlass").mkdir(parents=True)
    (inc / "cutlass" / "cutlass.h").write_text("// stands in for the CUTLASS headers\n")
    return str(inc)


needs_cmake = pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake is not installed")


@needs_cmake
def test_cmake_without_cutlass_installs_python_only(tmp_path):
    r = _configure(tmp_path, FUSEDIST_CUTLASS_INCLUDE=str(tmp_path / "missing"))
    assert r.returncode == 0, r.stderr
    assert "fusedist._C not built (the CUTLASS headers were not found" in r.stderr
    # Configuration stopped before the extension: neither CUDA nor pybind11 was looked for.
    cache = (tmp_path / "build" / "CMakeCache.txt").read_text()
    assert "pybind11_DIR" not in cache and "CMAKE_CUDA_COMPILER:" not in cache


@needs_cmake
def test_cmake_without_nvcc_installs_python_only(tmp_path, fake_cutlass):
    r = _configure(tmp_path, FUSEDIST_CUTLASS_INCLUDE=fake_cutlass,
                   CUDACXX=str(tmp_path / "no-such-nvcc"))
    assert r.returncode == 0, r.stderr
    assert "fusedist._C not built (nvcc was not found" in r.stderr


@needs_cmake
@pytest.mark.parametrize("missing", ["cutlass", "nvcc"])
def test_cmake_build_1_makes_missing_pieces_errors(tmp_path, fake_cutlass, missing):
    env = {"FUSEDIST_BUILD": "1", "CUDACXX": str(tmp_path / "no-such-nvcc"),
           "FUSEDIST_CUTLASS_INCLUDE": fake_cutlass if missing == "nvcc" else str(tmp_path)}
    r = _configure(tmp_path, **env)
    assert r.returncode != 0
    assert "FUSEDIST_BUILD=1 but" in r.stderr
    assert ("nvcc was not found" if missing == "nvcc" else "CUTLASS headers were not found") \
        in r.stderr


@needs_cmake
def test_cmake_rejects_bad_fusedist_build(tmp_path):
    r = _configure(tmp_path, FUSEDIST_BUILD="yes")
    assert r.returncode != 0
    assert "FUSEDIST_BUILD must be 1" in r.stderr and "'yes'" in r.stderr
