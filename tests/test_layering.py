"""The layering contract (pyproject.toml [tool.importlinter]): each layer of fusedist imports
only the layers below it (testing > generate > models > nn > ops > comm > distributed > core),
and no two modules or subpackages import each other. lint-imports reads the imports from the
source, so an import inside a function counts too. Also: the old module paths still resolve."""

import importlib
import os
import shutil
import subprocess
import sys
import textwrap
import warnings

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytest.importorskip("importlinter", reason="pip install import-linter (tests/run.sh does)")


def _lint(cwd, *args):
    exe = shutil.which("lint-imports") or os.path.join(os.path.dirname(sys.executable),
                                                       "lint-imports")
    env = dict(os.environ, PYTHONPATH=cwd)
    return subprocess.run([exe, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)


def test_fusedist_keeps_its_layering_contract():
    # The checkout's fusedist, not an installed copy (grimp follows the import path).
    p = _lint(ROOT, "--config", os.path.join(ROOT, "pyproject.toml"))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    assert "2 kept, 0 broken" in p.stdout


def test_the_contract_catches_circles_and_upward_imports(tmp_path):
    """The same two contract types break on a package with a circle and an upward import."""
    pkg = tmp_path / "pkg"
    (pkg / "low").mkdir(parents=True)
    (pkg / "high").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "low" / "__init__.py").write_text("")
    (pkg / "high" / "__init__.py").write_text("")
    (pkg / "low" / "a.py").write_text("from . import b\n")
    (pkg / "low" / "b.py").write_text("def f():\n    from . import a\n")   # inside a function
    (pkg / "high" / "c.py").write_text("from ..low import a\n")
    (pkg / "low" / "d.py").write_text("from ..high import c\n")            # upward
    cfg = tmp_path / "contracts.toml"
    cfg.write_text(textwrap.dedent("""
        [tool.importlinter]
        root_package = "pkg"
        [[tool.importlinter.contracts]]
        id = "layers"
        name = "layers"
        type = "layers"
        layers = ["pkg.high", "pkg.low"]
        [[tool.importlinter.contracts]]
        id = "acyclic"
        name = "acyclic"
        type = "acyclic_siblings"
        ancestors = ["pkg"]
    """))
    p = _lint(str(tmp_path), "--config", str(cfg))
    assert p.returncode != 0 and "0 kept, 2 broken" in p.stdout, p.stdout[-3000:]


@pytest.mark.parametrize("old, new", [
    ("fusedist.runtime", "fusedist.distributed.runtime"),
    ("fusedist.communicator", "fusedist.comm.communicator"),
    ("fusedist.streams", "fusedist.comm.streams"),
    ("fusedist.comm.engines", "fusedist.ops.gemm_comm"),
    ("fusedist.comm.engines.decode", "fusedist.ops.gemm_comm.fused_ar"),
    ("fusedist.comm.engines.fused", "fusedist.ops.gemm_comm.fused_sm90"),
    ("fusedist.ops._attention_decode", "fusedist.ops.attention._decode"),
    ("fusedist.models.llama.torch_attention", "fusedist.models.llama.baseline"),
])
def test_old_module_paths_resolve_to_the_new_ones(old, new):
    import fusedist  # noqa: F401 - installs the finder
    sys.modules.pop(old, None)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        mod = importlib.import_module(old)
    assert mod is importlib.import_module(new)
    assert mod.__name__ == new and mod.__spec__.name == new
    assert any(issubclass(x.category, DeprecationWarning) and new in str(x.message) for x in w)
