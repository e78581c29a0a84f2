"""NCCL through nccl4py: one communicator per fusedist Group, created collectively with a
unique id shared over the group's torch process group, always driven on torch's current
stream (never stream 0). FUSEDIST_NCCL=torch uses torch.distributed's NCCL instead."""

from __future__ import annotations


import torch
import torch.distributed as dist

from .. import envs
from ..distributed.groups import Group
from ..errors import CommunicatorClosedError, NcclUnavailableError


def backend_choice() -> str:
    return envs.get("FUSEDIST_NCCL")


def _import_nccl():
    try:
        import nccl.core as nc  # nccl4py
    except Exception as e:  # ImportError, or cuda-bindings missing underneath
        raise NcclUnavailableError(
            f"fusedist: nccl4py is not importable ({type(e).__name__}: {e}); "
            "`pip install nccl4py cuda-bindings`, or set FUSEDIST_NCCL=torch to use "
            "torch.distributed's NCCL") from e
    return nc


class NcclComm:
    """A group's NCCL communicator (nccl4py, or torch.distributed with FUSEDIST_NCCL=torch)."""

    def __init__(self, group: Group, max_ctas: int | None = None):
        self.group = group
        self.kind = backend_choice()
        self._comm = None
        self.aborted = False
        if self.kind == "torch" or group.size == 1:
            return
        nc = _import_nccl()
        # Every rank learns whether rank 0 could make an id, so all fail or none does.
        uid, err = None, None
        if group.rank == 0:
            try:
                uid = bytes(nc.get_unique_id())
            except Exception as e:  # DynamicLibNotFoundError when libnccl is missing
                err = f"{type(e).__name__}: {e}"
        uid, err = group.all_gather_object((uid, err))[0]
        if err is not None:
            raise NcclUnavailableError(
                f"fusedist: NCCL is unusable through nccl4py ({err}); install libnccl "
                "(e.g. `pip install nvidia-nccl-cu13`) or set FUSEDIST_NCCL=torch")
        self._nc = nc
        config = nc.NCCLConfig(max_ctas=max_ctas) if max_ctas else None
        self._comm = nc.Communicator.init(group.size, group.rank, nc.UniqueId.from_bytes(uid),
                                          config)

    def all_reduce(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        self._check_usable()
        if self.group.size == 1:
            if out.data_ptr() != x.data_ptr():
                out.copy_(x)
            return out
        stream = torch.cuda.current_stream(x.device)
        if self._comm is None:
            if out.data_ptr() != x.data_ptr():
                out.copy_(x)
            dist.all_reduce(out, group=self.group.pg)
            return out
        self._comm.allreduce(x, out, self._nc.SUM, stream=stream.cuda_stream)
        return out

    def all_gather(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out = concat over ranks of x (rank order), on torch's current stream."""
        self._check_usable()
        if self.group.size == 1:
            out.copy_(x.reshape(out.shape))
            return out
        if self._comm is None:
            dist.all_gather_into_tensor(out, x, group=self.group.pg)
            return out
        self._comm.allgather(x, out, stream=torch.cuda.current_stream(x.device).cuda_stream)
        return out

    def reduce_scatter(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out = block `rank` of the sum over ranks of x, on torch's current stream."""
        self._check_usable()
        if self.group.size == 1:
            out.copy_(x.reshape(out.shape))
            return out
        if self._comm is None:
            dist.reduce_scatter_tensor(out, x, group=self.group.pg)
            return out
        self._comm.reduce_scatter(x, out, self._nc.SUM,
                                  stream=torch.cuda.current_stream(x.device).cuda_stream)
        return out

    def _check_usable(self) -> None:
        if self.aborted:
            raise CommunicatorClosedError(
                f"fusedist: the NCCL communicator of group {self.group.name} was aborted after "
                "its Communicator failed (a call check or a symmetric kernel recorded a "
                "mismatch or a timeout); create a new Communicator")

    def abort(self) -> None:
        """ncclCommAbort (nccl4py): NCCL kernels still waiting for a peer exit, and the
        communicator is gone. torch.distributed's NCCL is the process group's: not aborted."""
        if self._comm is not None:
            self.aborted = True
            self._comm.abort()
            self._comm = None

    def close(self) -> None:
        if self._comm is not None:
            self._comm.destroy()
            self._comm = None
