"""The capability table (fusedist._ext): what a build of _C holds, whether a kernel runs on a
device and why not, and the version / ABI check that turns a stale extension into one error.
A stand-in module plays _C, so these run without a build; the last test checks the real one
where it is built (CI builds it)."""

from __future__ import annotations

import ast
import pathlib
import types

import pytest
import torch

import fusedist
from fusedist import _ext
from fusedist.errors import ExtensionMismatchError

PKG = pathlib.Path(fusedist.__file__).parent
REPO = pathlib.Path(__file__).resolve().parents[1]   # the checkout (fusedist may be installed)


def _fake_c(**attrs):
    m = types.ModuleType("fusedist._C")
    m.VERSION, m.ABI_VERSION, m.CUDA_ARCHS, m.CUDA_RUNTIME = \
        fusedist.__version__, _ext.ABI_VERSION, "90a", 13000
    for name, value in attrs.items():
        setattr(m, name, value)
    return m


@pytest.fixture
def fake_build(monkeypatch):
    """Install a stand-in _C (its kernels: the symbols passed) and clear the caches."""
    def install(*symbols, **attrs):
        c = _fake_c(**{s: object() for s in symbols}, **attrs)
        _ext.load.cache_clear()
        _ext.capabilities.cache_clear()
        monkeypatch.setattr(_ext.importlib, "import_module",
                            lambda name: c if name == "fusedist._C" else None)
        return c
    yield install
    _ext.load.cache_clear()
    _ext.capabilities.cache_clear()


def test_capabilities_list_the_built_kernels(fake_build):
    fake_build("gemv", "silu_mul", "ATTENTION_DECODE_MAX_CLUSTER_SPLITS")
    caps = _ext.capabilities()
    assert caps.built and caps.version == fusedist.__version__ and caps.cuda_archs == ("90a",)
    assert caps.has("gemv") and caps.has("silu_mul") and caps.has("attention_decode_cluster")
    assert not caps.has("fp8_gemm") and not caps.has("moe_grouped_gemm")
    with pytest.raises(KeyError, match="unknown kernel 'gemvv'"):
        caps.has("gemvv")
    text = caps.table()
    assert "yes gemv" in text and "no  fp8_gemm" in text


def test_why_not_names_the_reason(fake_build, monkeypatch):
    fake_build("gemv", "silu_mul")
    monkeypatch.setattr(_ext, "device_capability", lambda d: (9, 0))
    assert _ext.why_not("gemv", "cpu").startswith("tensors on cpu")
    assert _ext.why_not("gemv", "cuda:0") == "" and _ext.kernel_runs("gemv", "cuda:0")
    assert "built without the fp8_gemm kernel" in _ext.why_not("fp8_gemm", "cuda:0")
    monkeypatch.setattr(_ext, "device_capability", lambda d: (8, 0))
    # sm_90a code does not run on an A100; the message says how to build for it
    why = _ext.why_not("silu_mul", "cuda:0")
    assert "built for 90a" in why and "FUSEDIST_CUDA_ARCHS=80" in why
    assert "needs compute capability >= 9.0" in _ext.why_not("gemv", "cuda:0")


def test_why_not_answers_follow_the_capability_table(fake_build, monkeypatch):
    """why_not remembers its answer per kernel and device: a new capability table (another
    build) or another device must not get the old answer."""
    monkeypatch.setattr(_ext, "device_capability", lambda d: (9, 0))
    fake_build("gemv", "silu_mul")
    assert _ext.why_not("silu_mul", "cuda:0") == ""
    fake_build("gemv", "silu_mul", CUDA_ARCHS="80")   # another build of the same kernels
    assert "built for 80" in _ext.why_not("silu_mul", "cuda:0")
    fake_build("gemv", "silu_mul")
    assert _ext.why_not("silu_mul", "cuda:0") == ""
    monkeypatch.setattr(_ext, "device_capability", lambda d: (8, 0))   # another device
    assert "built for 90a" in _ext.why_not("silu_mul", "cuda:0")
    assert "cuda:1" in _ext.why_not("silu_mul", "cuda:1")


def test_stream_reads_the_raw_handle_of_the_device(monkeypatch):
    """_ext.stream reads the raw handle for CUDA devices (the current device's for "cuda"); any
    other device goes through torch.cuda.current_stream, which the tests' stand-ins replace."""
    import types
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda device=None: types.SimpleNamespace(cuda_stream=1234))
    assert _ext.stream(torch.device("cpu")) == 1234
    # a CUDA device: torch's raw handle of that device's current stream, no Stream object
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 1000 + index,
                        raising=False)
    assert _ext.stream(torch.device("cuda", 3)) == 1003
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    assert _ext.stream(torch.device("cuda")) == 1002


def test_reference_fallback_warns_once_per_op_and_reason(monkeypatch):
    """The ops on CUDA tensors that fall back to the plain-torch path say so, once per op and
    reason (the GPU tests reach it only when a kernel is missing from the build)."""
    monkeypatch.setattr(_ext, "_warned", set())
    with pytest.warns(RuntimeWarning, match=r"fusedist.gemv: CUDA tensors run the plain-torch "
                                            r"reference path \(no kernel\)"):
        _ext.warn_reference("gemv", "no kernel")
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _ext.warn_reference("gemv", "no kernel")          # said once already
    with pytest.warns(RuntimeWarning, match="fusedist.gemv.*other reason"):
        _ext.warn_reference("gemv", "other reason")


def test_arch_strings():
    caps = _ext.Capabilities(built=True, cuda_archs=("90a", "100a", "80"))
    assert caps.runs_on((9, 0)) and caps.runs_on((10, 0)) and caps.runs_on((8, 6))
    assert not caps.runs_on((9, 1)) and not caps.runs_on((7, 5)) and not caps.runs_on((12, 0))


@pytest.mark.parametrize("version, abi, what", [
    ("0.0.1", None, "version 0.0.1"),
    (None, None, "unversioned build"),
    (fusedist.__version__, -1, "ABI -1"),
])
def test_a_stale_extension_is_one_clear_error(fake_build, version, abi, what):
    c = fake_build("gemv")
    c.VERSION, c.ABI_VERSION = version, abi
    if version is None:
        del c.VERSION
    with pytest.raises(ExtensionMismatchError) as e:
        _ext.load()
    msg = str(e.value)
    assert what in msg and fusedist.__version__ in msg and "pip install" in msg
    # never swallowed as "not built": the table raises too, and kernel_runs does
    with pytest.raises(ExtensionMismatchError):
        _ext.capabilities()
    with pytest.raises(ExtensionMismatchError):
        _ext.kernel_runs("gemv", "cuda:0")


def test_every_kernel_symbol_is_a_binding_name():
    """KERNELS names _C symbols that the bindings define (m.def / m.attr), so a renamed
    binding cannot silently turn a kernel off."""
    sources = sorted((REPO / "csrc" / "bindings").glob("*.cpp"))
    assert sources, f"no binding sources under {REPO / 'csrc' / 'bindings'}"
    text = "\n".join(p.read_text() for p in sources)
    for name, k in _ext.KERNELS.items():
        if name.startswith(("moe_", "ep_")) and f'"{k.symbol}"' not in text:
            continue   # kernel families whose bindings a build may not have yet
        assert f'"{k.symbol}"' in text, f"{name}: _C symbol {k.symbol!r} is bound nowhere"


def _probes(path: pathlib.Path) -> list:
    """hasattr calls, and getattr calls with a default, whose object is _C (`_ext.load()`,
    `C`, `_C`) in one file: a probe for whether the build has something."""
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                (node.func.id == "hasattr" or
                 (node.func.id == "getattr" and len(node.args) == 3)):
            src = ast.unparse(node.args[0])
            if src in ("C", "_C") or "_ext.load()" in src or src.startswith(("C.", "_C.")):
                found.append(f"{path.relative_to(PKG.parent)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_probes_of_C_outside_the_capability_table():
    found = [f for p in PKG.rglob("*.py") if p.name != "_ext.py" for f in _probes(p)]
    assert not found, "probe _C through fusedist._ext (kernel_runs / why_not), not:\n" + \
        "\n".join(found)


def test_the_scan_finds_a_probe(tmp_path):
    p = PKG / "_probe_example.py"
    try:
        p.write_text("from . import _ext\nok = hasattr(_ext.load(), 'gemv')\n")
        assert _probes(p)
    finally:
        p.unlink()


def test_the_real_build_matches_the_package():
    if not _ext.available():
        pytest.skip("fusedist._C not built here")
    C = _ext.load()
    assert C.VERSION == fusedist.__version__ and C.ABI_VERSION == _ext.ABI_VERSION
    caps = _ext.capabilities()
    assert caps.cuda_archs and caps.cuda_runtime >= 12040
    for name in ("allreduce", "gemv", "attention_decode", "add_rmsnorm", "fp8_gemm"):
        assert caps.has(name), name
