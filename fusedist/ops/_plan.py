"""The plan of a single-kernel op: plain data saying which path runs and why not the kernel.

Every op of fusedist.ops has the same shape (CONTRIBUTING.md, "Adding an op"): available(device)
(its kernel runs there), why_not(...) (the reason a call takes another path, "" when the kernel
takes it), plan(...) (plain data: this KernelPlan, or the op's own frozen dataclass when it has
launch parameters to fix), run(plan, ...) (executes; decides nothing) and reference(...) (plain
torch: the CPU path and the tests' oracle)."""

from __future__ import annotations

from dataclasses import dataclass

from .. import _ext


@dataclass(frozen=True)
class KernelPlan:
    """path "kernel" (the op's kernel runs) or "reference" (plain torch), and why not the
    kernel ("" when it runs)."""
    op: str
    path: str
    why: str = ""

    @property
    def kernel(self) -> bool:
        return self.path == "kernel"

    def warn_if_reference(self, device) -> None:
        """Once per reason: CUDA tensors that take the reference are worth a warning."""
        if not self.kernel and getattr(device, "type", device) == "cuda":
            _ext.warn_reference(self.op, self.why)


def kernel_plan(op: str, why: str) -> KernelPlan:
    """The plan of `op` given the reason its kernel does not take the call ("" when it does)."""
    return KernelPlan(op, "reference" if why else "kernel", why)
