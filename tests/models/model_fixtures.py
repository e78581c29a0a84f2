"""Fixtures the model tests share (imported by name into each test module; a second
conftest.py would shadow tests/conftest.py, which tests import as `conftest`)."""

from __future__ import annotations

import pytest

import fusedist


@pytest.fixture(scope="module")
def rt():
    """A one-process fusedist runtime over gloo (CPU tier), shut down after the module."""
    if fusedist.is_initialized():
        fusedist.shutdown()
    r = fusedist.init(backend="gloo", rank=0, world_size=1, local_rank=0, local_world_size=1)
    yield r
    fusedist.shutdown()
