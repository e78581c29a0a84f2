"""Lazy loader for the CUDA extension: `import fusedist` works without it (CPU machines, docs
builds); GPU ops load it on first use and say how to build it when it is missing."""

from __future__ import annotations

import functools

from .errors import ExtensionMissingError


@functools.lru_cache(maxsize=1)
def load():
    try:
        from . import _C  # type: ignore[attr-defined]
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
