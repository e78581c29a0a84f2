"""Argument checks shared by the collectives that run through torch.distributed
(hierarchical, fp8): one message per mistake, naming the argument and the fix."""

from __future__ import annotations

import torch

from .. import _dtypes


def check_input(where: str, x, device: torch.device) -> None:
    """x must be a contiguous tensor of a reducible dtype on the ranks' device type."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"fusedist.{where}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _dtypes.REDUCE_DTYPES:
        raise TypeError(f"fusedist.{where}: x has dtype {x.dtype}; supported: "
                        f"{', '.join(str(d) for d in _dtypes.REDUCE_DTYPES)}")
    if x.device.type != device.type:
        raise ValueError(f"fusedist.{where}: x is on {x.device} but the ranks run on "
                         f"{device.type}; move it with x.to('{device}')")
    if not x.is_contiguous():
        raise ValueError(f"fusedist.{where}: x is non-contiguous (stride {tuple(x.stride())}); "
                         "call .contiguous() first")
