"""What the collectives that run through torch.distributed (hierarchical, fp8) share: the
argument checks (one message per mistake, naming the argument and the fix) and the guard that
turns a failed collective into PeerLostError naming the lost rank."""

from __future__ import annotations

import contextlib

import torch

from .. import _dtypes
from ..distributed.peers import is_peer_failure, peer_lost_error
from ..distributed.runtime import get_runtime
from ..errors import FusedistError


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


@contextlib.contextmanager
def peers_guard(where: str, group, peer_failures_only: bool = False):
    """Inside the block, a collective of `group` that fails (a peer's process exited, or it
    stopped answering within the group's timeout) raises PeerLostError naming the lost ranks
    it can check (those on this host) instead of the backend's error. peer_failures_only: only
    errors that say a peer broke away (distributed.peers.is_peer_failure) are converted."""
    try:
        yield
    except FusedistError:
        raise
    except RuntimeError as e:   # torch.distributed's DistBackendError and gloo's errors
        if peer_failures_only and not is_peer_failure(e):
            raise
        rt = get_runtime()
        raise peer_lost_error(where, group, rt.peers, rt.rank, e) from e
