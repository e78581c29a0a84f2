"""get_communicator under torch.compile without importing torch._dynamo at import time."""

from __future__ import annotations

import subprocess
import sys

import torch

from fusedist.comm import communicator


def test_importing_fusedist_leaves_torch_dynamo_unimported():
    """A process that never compiles does not pay torch._dynamo's import (~2 s of CPU, more
    than the rest of fusedist's): a fresh interpreter that imports every fusedist package
    has not imported it."""
    code = ("import sys, fusedist, fusedist.models, fusedist.nn, fusedist.ops, fusedist.ep, "
            "fusedist.generate, fusedist.testing; "
            "print(sorted(m for m in sys.modules if m.startswith('torch._dynamo'))[:4])")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip() == "[]", f"imported by fusedist: {p.stdout.strip()}"


def test_the_mark_made_without_dynamo_is_assume_constant_result(monkeypatch):
    """Before torch._dynamo is imported, _eager_under_compile marks fn as
    torch._dynamo.assume_constant_result would; compiled, a marked function runs once when
    traced and its result is a constant of the graph (an unmarked one is traced into, its
    side effect replayed on every call)."""
    import torch._dynamo as dynamo

    monkeypatch.delitem(sys.modules, "torch._dynamo")
    calls = []

    def count():
        calls.append(1)
        return 3

    def reference():
        return 3

    marked = communicator._eager_under_compile(count)
    monkeypatch.undo()
    assert "torch._dynamo" in sys.modules
    assert vars(marked) == vars(dynamo.assume_constant_result(reference))

    dynamo.reset()
    f = torch.compile(lambda x: x * marked(), backend="eager", fullgraph=True)
    for _ in range(3):
        assert torch.equal(f(torch.ones(2)), torch.full((2,), 3.0))
    assert len(calls) == 1, f"the marked function ran {len(calls)} times in 3 compiled calls"
    dynamo.reset()
