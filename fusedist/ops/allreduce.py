"""all_reduce: sum a tensor over a group.

    y = fusedist.all_reduce(x)                 # tensor-parallel group, algorithm from the table
    fusedist.all_reduce_(x)                    # in place
    h = fusedist.all_reduce(x, async_op=True)  # on a comm stream; h.wait() joins it back
    torch.ops.fusedist.all_reduce(x, comm.name, "auto")  # what torch.compile sees

Algorithms: one_shot and two_shot (barrier-free, symmetric memory, NVLink peers) and nccl.
All reduce in fp32 in rank order, so every rank holds bitwise the same result.
CPU tensors (after fusedist.init(backend='gloo')) take the plain-torch reference path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .. import _ext
from ..comm.communicator import GroupLike, communicator_by_name, get_communicator


# ---- the op's shape: available / why_not / plan / run / reference ----------------------------
# The algorithm (one_shot / two_shot over symmetric memory, or NCCL) is the communicator's
# choice from the tuning table's "allreduce" rules (Communicator.choose_algo): plan() asks it.

def available(device) -> bool:
    """The symmetric-memory all-reduce kernels run on `device`."""
    return _ext.kernel_runs("allreduce", device)


def why_not(x: torch.Tensor, group: GroupLike = None) -> str:
    """Why the call goes to NCCL (or the CPU reference) instead of fusedist's kernels ("" when
    a kernel takes it)."""
    comm = get_communicator(group)
    if x.device.type != "cuda":
        return f"tensors on {x.device}: the plain-torch reference over gloo"
    why = _ext.why_not("allreduce", x.device)
    if why:
        return why
    if comm.symm is None:
        return f"group {comm.group.name} has no symmetric memory (its ranks are not NVLink peers)"
    algo = comm.choose_algo(x.numel() * x.element_size(), x.dtype)
    return "" if algo != "nccl" else "the tuning table (or the buffers' capacity) picks NCCL"


@dataclass(frozen=True)
class AllReducePlan:
    """The algorithm of one call: "one_shot", "two_shot", "nccl" or "reference" (CPU)."""
    algo: str
    group: str


def plan(x: torch.Tensor, group: GroupLike = None, algo: str = "auto") -> AllReducePlan:
    comm = get_communicator(group)
    if x.device.type != "cuda":
        return AllReducePlan("reference", comm.name)
    return AllReducePlan(comm.choose_algo(x.numel() * x.element_size(), x.dtype, algo),
                         comm.name)


def run(p: AllReducePlan, x: torch.Tensor, out: Optional[torch.Tensor] = None,
        async_op: bool = False):
    """Execute p: the all-reduce of x over p's communicator."""
    comm = communicator_by_name(p.group)
    return comm.all_reduce(x, algo="auto" if p.algo == "reference" else p.algo, out=out,
                           async_op=async_op)


def reference(xs: list) -> torch.Tensor:
    """What every algorithm computes, given every rank's x: the sum in float32 in rank order,
    rounded once to x's dtype (so every rank holds bitwise the same result)."""
    acc = xs[0].float()
    for t in xs[1:]:
        acc = acc + t.float()
    return acc.to(xs[0].dtype)


def _compiling() -> bool:
    return hasattr(torch, "compiler") and torch.compiler.is_compiling()


def _no_async_under_compile(op: str, async_op: bool) -> None:
    if async_op:
        raise ValueError(f"fusedist.{op}: async_op=True is not supported under torch.compile (a "
                         "compiled graph cannot return the handle); pass async_op=False there, "
                         "or call it outside the compiled function")


def all_reduce(x: torch.Tensor, group: GroupLike = None, *, algo: str = "auto",
               out: Optional[torch.Tensor] = None, async_op: bool = False):
    """Out-of-place all-reduce (sum). Returns the result, or an AsyncHandle if async_op."""
    comm = get_communicator(group)
    if _compiling():
        _no_async_under_compile("all_reduce", async_op)
        y = torch.ops.fusedist.all_reduce(x, comm.name, algo)
        return y if out is None else out.copy_(y)
    return comm.all_reduce(x, algo=algo, out=out, async_op=async_op)


def all_reduce_(x: torch.Tensor, group: GroupLike = None, *, algo: str = "auto",
                async_op: bool = False):
    """In-place all-reduce (sum) of `x`."""
    comm = get_communicator(group)
    if _compiling():
        _no_async_under_compile("all_reduce_", async_op)
        torch.ops.fusedist.all_reduce_(x, comm.name, algo)
        return x
    return comm.all_reduce(x, algo=algo, out=x, async_op=async_op)


@torch.library.custom_op("fusedist::all_reduce", mutates_args=())
def _all_reduce_op(x: torch.Tensor, comm_name: str, algo: str) -> torch.Tensor:
    return communicator_by_name(comm_name).all_reduce(x, algo=algo)


@_all_reduce_op.register_fake
def _(x, comm_name, algo):
    return torch.empty_like(x)


@torch.library.custom_op("fusedist::all_reduce_", mutates_args=("x",))
def _all_reduce_inplace_op(x: torch.Tensor, comm_name: str, algo: str) -> None:
    communicator_by_name(comm_name).all_reduce(x, algo=algo, out=x)
