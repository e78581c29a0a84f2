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

from typing import Optional

import torch

from ..comm.communicator import GroupLike, communicator_by_name, get_communicator


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
