"""Every `module.name` that fusedist's source reads of one of its own modules exists.

Many such reads sit on paths the CPU suite never takes (CUDA tensors, a kernel missing from
the build, a multi-GPU host): a helper deleted or renamed there fails only on the machine that
takes the path. This scan reads the source of the imported package: for each name bound by
`from fusedist... import module` (or `import fusedist.x as y`), every attribute read of it
(`_ext.warn_reference`, `tuning.knobs`, ...) must be an attribute of that module."""

from __future__ import annotations

import ast
import importlib
import inspect
import pathlib

import fusedist

PKG = pathlib.Path(fusedist.__file__).parent


def _module_name(path: pathlib.Path) -> tuple[str, str]:
    """(the module's dotted name, the package its relative imports start from)."""
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
        return ".".join(parts), ".".join(parts)
    return ".".join(parts), ".".join(parts[:-1])


def _module_aliases(tree: ast.AST, package: str) -> dict:
    """Names the file binds to fusedist modules: {alias: module}."""
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([node.module] if node.module else []))
            if base != "fusedist" and not base.startswith("fusedist."):
                continue
            for a in node.names:
                try:   # what the import binds: the package's attribute, else its submodule
                    m = getattr(importlib.import_module(base), a.name, None)
                    if m is None:
                        m = importlib.import_module(f"{base}.{a.name}")
                except ImportError:   # an optional dependency missing here
                    continue
                aliases[a.asname or a.name] = m
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.asname and (a.name == "fusedist" or a.name.startswith("fusedist.")):
                    try:
                        aliases[a.asname] = importlib.import_module(a.name)
                    except ImportError:
                        continue
    return {k: m for k, m in aliases.items() if inspect.ismodule(m)}


def _missing() -> list[str]:
    missing = []
    for path in sorted(PKG.rglob("*.py")):
        _, package = _module_name(path)
        tree = ast.parse(path.read_text(), str(path))
        aliases = _module_aliases(tree, package)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
                    node.value.id in aliases and not hasattr(aliases[node.value.id], node.attr):
                missing.append(f"{path.relative_to(PKG.parent)}:{node.lineno}: "
                               f"{node.value.id}.{node.attr} ({aliases[node.value.id].__name__} "
                               f"has no {node.attr!r})")
    return missing


def test_every_attribute_read_of_a_fusedist_module_exists():
    missing = _missing()
    assert not missing, "reads of names fusedist's modules do not have:\n" + "\n".join(missing)


def test_the_scan_sees_a_missing_helper(monkeypatch):
    """The scan fails when a helper the ops call on their CUDA paths is gone."""
    from fusedist import _ext
    monkeypatch.delattr(_ext, "warn_reference")
    missing = _missing()
    assert any("_ext.warn_reference" in m and "ops/_plan.py" in m for m in missing), missing
