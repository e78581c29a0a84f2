"""Lazy loader for the CUDA extension: `import fusedist` works without it (CPU machines, docs
builds); GPU ops load it on first use and say how to build it when it is missing."""

from __future__ import annotations

import functools
import importlib
import warnings

from .errors import ExtensionMissingError


@functools.lru_cache(maxsize=1)
def load():
    try:
        # By name: _C is a compiled module, and a `from . import _C` would read (to import
        # linters) as this core module importing the whole package.
        _C = importlib.import_module("fusedist._C")
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ExtensionMissingError(
            "fusedist: the CUDA extension fusedist._C is not available "
            f"({e}). Build it with `pip install --no-build-isolation .` on a machine with nvcc "
            "(CUDA >= 12.4), or use CPU tensors for the reference path."
        ) from e
    return _C


def available() -> bool:
    try:
        load()
        return True
    except ExtensionMissingError:
        return False


_warned: set = set()


def warn_reference(op: str, why: str) -> None:
    """Once per process and reason: CUDA tensors are taking the plain-torch reference path
    (correct, but far slower than the kernel)."""
    if (op, why) in _warned:
        return
    _warned.add((op, why))
    warnings.warn(f"fusedist.{op}: CUDA tensors run the plain-torch reference path ({why})",
                  RuntimeWarning, stacklevel=4)
