"""fusedist.envs: the one registry of FUSEDIST_* variables (CPU tier)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fusedist import envs
from launch import python

ROOT = Path(__file__).resolve().parent.parent


def _read_by_library() -> set[str]:
    """FUSEDIST_* names the library reads: string literals in its Python and C++ sources
    (os.environ.get("..."), envs.get("..."), getenv("...")) and $ENV{...} in CMakeLists.txt."""
    names: set[str] = set()
    for f in list((ROOT / "fusedist").rglob("*.py")) + list((ROOT / "csrc").rglob("*")):
        if f.suffix in (".py", ".cu", ".cuh", ".h", ".cpp"):
            names |= set(re.findall(r"[\"'](FUSEDIST_[A-Z0-9_]+)[\"']", f.read_text()))
    cmake = (ROOT / "CMakeLists.txt").read_text()
    names |= set(re.findall(r"\$ENV\{(FUSEDIST_[A-Z0-9_]+)\}", cmake))
    return names


def test_every_variable_the_library_reads_is_registered():
    assert {"FUSEDIST_TIMEOUT_S", "FUSEDIST_PDL", "FUSEDIST_CUTLASS_INCLUDE"} <= _read_by_library()
    missing = _read_by_library() - set(envs.VARS)
    assert not missing, f"read by the library but not in fusedist/envs/: {sorted(missing)}"


@pytest.mark.parametrize("name", sorted(envs.VARS))
def test_registered_variable_is_documented_with_a_valid_default(name):
    v = envs.VARS[name]
    assert v.name == name and name.startswith("FUSEDIST_")
    assert v.doc.strip() and v.read.strip(), f"{name}: doc and read must be filled"
    assert v.type in ("str", "choice", "int", "float", "bool", "path")
    assert envs.get(name, {}) == v.default  # unset -> the default
    if v.default is None:   # unset means "not given": the table says what happens then
        assert v.type in ("str", "path", "int") and v.default_doc, \
            f"{name}: say what unset means"
        if v.type == "int":
            assert envs.get(name, {name: "7"}) == 7
        return
    raw = {"bool": lambda d: "1" if d else "0"}.get(v.type, str)(v.default)
    assert envs.get(name, {name: raw}) == v.default, f"{name}: the default does not parse"
    if v.type == "choice":
        assert v.default in v.choices


@pytest.mark.parametrize("name,raw", [
    ("FUSEDIST_TIMEOUT_S", "abc"), ("FUSEDIST_TIMEOUT_S", "0"), ("FUSEDIST_TIMEOUT_S", "-1"),
    ("FUSEDIST_TIMEOUT_S", "nan"), ("FUSEDIST_TIMEOUT_S", "inf"),
    ("FUSEDIST_INIT_TIMEOUT_S", "0"), ("FUSEDIST_COMM_STREAMS", "0"),
    ("FUSEDIST_COMM_STREAMS", "1.5"), ("FUSEDIST_OVERLAP_NCCL_CTAS", "-2"),
    ("FUSEDIST_NCCL", "mpi"), ("FUSEDIST_ALLREDUCE_ALGO", "three_shot"),
    ("FUSEDIST_GEMM_ENGINE", "fast"), ("FUSEDIST_NVTX", "maybe"), ("FUSEDIST_PDL", "2"),
])
def test_malformed_value_raises_naming_the_variable(name, raw):
    with pytest.raises(ValueError, match=name):
        envs.get(name, {name: raw})


def test_values_parse():
    assert envs.get("FUSEDIST_TIMEOUT_S", {"FUSEDIST_TIMEOUT_S": " 2.5 "}) == 2.5
    assert envs.get("FUSEDIST_COMM_STREAMS", {"FUSEDIST_COMM_STREAMS": "4"}) == 4
    assert envs.get("FUSEDIST_NVTX", {"FUSEDIST_NVTX": "0"}) is False
    assert envs.get("FUSEDIST_NCCL", {"FUSEDIST_NCCL": "torch"}) == "torch"
    assert envs.get("FUSEDIST_NODE_ID", {"FUSEDIST_NODE_ID": "  "}) is None  # blank = unset
    assert envs.get("FUSEDIST_NODE_ID", {"FUSEDIST_NODE_ID": " n1 "}) == "n1"
    assert envs.is_set("FUSEDIST_NODE_ID", {"FUSEDIST_NODE_ID": "n1"})
    assert not envs.is_set("FUSEDIST_NODE_ID", {})


def test_unregistered_name_raises():
    with pytest.raises(KeyError, match="FUSEDIST_NOPE"):
        envs.get("FUSEDIST_NOPE")


def test_markdown_table_has_every_variable():
    run = python(["-m", "fusedist.envs", "--markdown"])   # from the test pool: `python -m`
    assert run.returncode == 0, run.stderr
    assert "Warning" not in run.stderr, run.stderr   # runpy's re-execution warning, for one
    out = run.stdout
    lines = out.strip().splitlines()
    assert lines[0].startswith("| variable |") and lines[1].startswith("|---")
    assert [ln.split("`")[1] for ln in lines[2:]] == list(envs.VARS)
    assert "| `FUSEDIST_TIMEOUT_S` |" in out and "| `30` |" in out


def test_safe_env_defined_once_and_used_by_the_tests():
    from fusedist.distributed.runtime import SAFE_ENV

    assert SAFE_ENV == {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                        "NVSHMEM_DISABLE_NVLS": "1"}
    conftest = (ROOT / "tests" / "conftest.py").read_text()
    assert "from fusedist.distributed.runtime import SAFE_ENV" in conftest
    assert "NCCL_NVLS_ENABLE" not in conftest, "conftest keeps its own copy of the defaults"


def test_check_all_names_every_malformed_variable():
    envs.check_all({"FUSEDIST_ALLREDUCE_ALGO": "one_shot", "FUSEDIST_TIMEOUT_S": "5"})
    with pytest.raises(ValueError) as e:
        envs.check_all({"FUSEDIST_ALLREDUCE_ALGO": "bogus", "FUSEDIST_TIMEOUT_S": "-1"})
    msg = str(e.value)
    assert "FUSEDIST_ALLREDUCE_ALGO must be one of auto, one_shot, two_shot, nccl, got 'bogus'" \
        in msg
    assert "FUSEDIST_TIMEOUT_S='-1' must be > 0" in msg


@pytest.mark.parametrize("name,value", [("FUSEDIST_ALLREDUCE_ALGO", "bogus"),
                                        ("FUSEDIST_TIMEOUT_S", "-1")])
def test_init_on_cpu_refuses_a_malformed_variable(monkeypatch, name, value):
    import fusedist

    if fusedist.is_initialized():
        pytest.skip("a runtime of another test module is alive in this process")
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name):
        fusedist.init(backend="gloo", rank=0, world_size=1, local_rank=0, local_world_size=1)
    assert not fusedist.is_initialized()
