"""fusedist as a torch.distributed backend: unmodified torch code gets fusedist's all-reduce.

    import fusedist                                   # registers the backend "fusedist"
    dist.init_process_group("fusedist")               # or "cpu:gloo,cuda:fusedist"
    dist.all_reduce(x)                                # fusedist's dispatch for this call

What goes where:

- ``all_reduce`` (``dist.all_reduce``, ``torch.distributed._functional_collectives``, hence
  DTensor and ``torch.distributed.tensor.parallel``) of one contiguous float32 / float16 /
  bfloat16 tensor with ``ReduceOp.SUM`` runs ``Communicator.all_reduce`` in place: on CUDA the
  symmetric-memory kernels where the dispatch table picks them and NCCL otherwise; on the CPU
  the reference path (the call check that turns mismatched calls into
  ``CollectiveMismatchError``, a float32 sum over gloo, rounded once; float32 results are
  therefore gloo's, bit for bit).
- Everything else (other reduce ops, integer dtypes, coalesced lists, all_gather,
  reduce_scatter, broadcast, barrier, send / recv, ...) goes to gloo for CPU tensors and to
  NCCL for CUDA tensors, created over the group's store under their own prefixes. fusedist has
  no stand-alone all-gather or reduce-scatter kernels; its GEMM + collective ops are called
  directly.

torch's Python API for backends replaces the whole process group with the object the backend
returns, so ``"cpu:gloo,cuda:fusedist"`` behaves like ``"fusedist"``: CPU all-reduces take
fusedist's CPU path too.

Ranks that call differently are told, on every rank, instead of hanging in (or being aborted
by) gloo: before each collective on CPU tensors every rank all-gathers a small descriptor of its
call (the collective, the reduce op, the element count, the dtype, the root, and whether it
routes through fusedist) over the group's gloo backend, and all raise CollectiveMismatchError
naming each rank's call when they differ. CUDA tensors' collectives go to NCCL as they are (a
routed all-reduce has the device call check of its communicator; NCCL bounds the rest with
torch's watchdog); point-to-point send / recv are not compared (ranks call them differently
by design).

fusedist needs its runtime for the routed calls. If ``fusedist.init()`` has not been called,
the first routed all-reduce on the default (world) group calls it, adopting that group (every
rank makes that call, so the collective setup is safe); a subgroup's all-reduce before then
goes to gloo / NCCL, with a warning. Call ``fusedist.init()`` right after
``init_process_group`` to route subgroups from the start. A group's communicator is created
on its first routed call, collectively: make that call (a warm-up) before CUDA-graph capture.
"""

from __future__ import annotations

import datetime
import threading
import warnings
from typing import Optional

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (AllgatherOptions, PrefixStore, ProcessGroupGloo,
                                       _create_work_from_future)

from .. import _dtypes
from ..distributed import runtime
from ..distributed.groups import Group
from ..errors import CollectiveMismatchError
from .communicator import Communicator, get_communicator

BACKEND = "fusedist"

# Depth of routed calls on this thread: fusedist's CPU path all-reduces over the same process
# group (the group it adopted), and that inner call must reach gloo, not come back here.
_routing = threading.local()


def _depth() -> int:
    return getattr(_routing, "depth", 0)


def _first_tensor(obj) -> Optional[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, (list, tuple)):
        for o in obj:
            t = _first_tensor(o)
            if t is not None:
                return t
    return None


# The collectives a call descriptor names, and the reduce ops (torch's RedOpType order).
_CALLS = ("all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor",
          "all_gather_coalesced", "all_gather_into_tensor_coalesced", "reduce_scatter",
          "reduce_scatter_tensor", "reduce_scatter_tensor_coalesced", "broadcast", "reduce",
          "gather", "scatter", "all_to_all", "all_to_all_single", "barrier")
_OPS = ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM")
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
           torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64,
           torch.complex128)


def _dtype_code(dtype) -> int:
    return _DTYPES.index(dtype) if dtype in _DTYPES else len(_DTYPES)


def _dtype_name(code: int) -> str:
    return str(_DTYPES[code]).replace("torch.", "") if 0 <= code < len(_DTYPES) else "other"


def _op_code(op) -> int:
    for i, name in enumerate(_OPS):
        try:
            if op == getattr(dist.ReduceOp, name):
                return i
        except (TypeError, RuntimeError):
            continue
    return len(_OPS)


def _tensors(obj) -> list:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    return []


def _say(desc: list) -> str:
    call, op, numel, dtype, root, routed = desc
    what = _CALLS[call] if 0 <= call < len(_CALLS) else f"call {call}"
    if call == _CALLS.index("barrier"):
        return what
    out = what
    if op >= 0:
        out += f" ({_OPS[op] if op < len(_OPS) else 'a custom op'})"
    out += f" of {numel} {_dtype_name(dtype) + ' ' if dtype >= 0 else ''}elements"
    if root >= 0:
        out += f" from root {root}"
    return out + (" through fusedist" if routed else "")


def _done(result) -> "dist.Work":
    fut = torch.futures.Future()
    fut.set_result(result)
    return _create_work_from_future(fut)


class FusedistProcessGroup(dist.ProcessGroup):
    """The process group that ``init_process_group("fusedist")`` and ``new_group`` return.
    ``routed`` counts the all-reduces fusedist ran (the rest went to gloo / NCCL)."""

    def __init__(self, store, rank: int, size: int, timeout: datetime.timedelta,
                 group_name: str):
        super().__init__(rank, size)
        self._name = group_name
        self._store = store
        self._timeout = timeout
        self._gloo = ProcessGroupGloo(PrefixStore("gloo/", store), rank, size, timeout)
        self._nccl = None
        # Registered per device, so that the collectives this class does not override reach
        # gloo / NCCL through torch's own dispatch. NCCL connects on its first collective.
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO,
                               self._gloo)
        if torch.cuda.is_available() and dist.is_nccl_available():
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self._nccl = dist.ProcessGroupNCCL(PrefixStore("nccl/", store), rank, size, opts)
            self._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.NCCL,
                                   self._nccl)
        self._groups: dict = {}      # device type -> fusedist Group over this process group
        self._warned = False
        self.routed = 0

    # ---- identity (torch reads these of a Python process group) -----------------------
    def getBackendName(self) -> str:
        return BACKEND

    @property
    def group_name(self) -> str:
        return self._name

    @property
    def pg_name(self) -> str:
        return self._name

    # ---- where a call goes --------------------------------------------------------------
    def _backend_for(self, *args):
        t = _first_tensor(args)
        if t is not None and t.is_cuda:
            if self._nccl is None:
                raise RuntimeError("fusedist backend: a CUDA tensor reached a process group "
                                   "created without CUDA or NCCL; create the group on a host "
                                   "where torch.cuda.is_available()")
            return self._nccl
        return self._gloo

    def _communicator(self, device: torch.device) -> Optional[Communicator]:
        if not runtime.is_initialized():
            self._groups.clear()         # of an earlier runtime (fusedist.shutdown() since)
        g = self._groups.get(device.type)
        if g is None:
            if not runtime.is_initialized():
                if not (dist.is_initialized() and self is dist.group.WORLD):
                    if not self._warned:
                        self._warned = True
                        warnings.warn(
                            f"fusedist backend: all_reduce on group {self._name} goes to "
                            f"{'NCCL' if device.type == 'cuda' else 'gloo'}: fusedist is not "
                            "initialized; call fusedist.init() right after "
                            "init_process_group to route subgroups through fusedist",
                            RuntimeWarning, stacklevel=4)
                    return None
                runtime.init(device=device)  # adopts this (the world) process group
            rt = runtime.get_runtime()
            g = Group.from_process_group(self, name=f"c10d:{self._name}:{device.type}",
                                         device=device, topology=rt.topology)
            self._groups[device.type] = g
        return get_communicator(g)

    def _check_call(self, call: str, tensors, op=None, root: int = -1,
                    routed: bool = False) -> None:
        """Before a collective on CPU tensors: every rank's call descriptor all-gathered over
        gloo; CollectiveMismatchError on every rank, naming each rank's call, when they
        differ (gloo would hang, abort the process on a size mismatch, or mix reduce ops).
        fusedist's own inner calls (a routed all-reduce's reference path) are not checked
        again."""
        ts = _tensors(tensors)
        if _depth() or self.size() == 1 or any(t.is_cuda for t in ts):
            return
        desc = [_CALLS.index(call), -1 if op is None else _op_code(op),
                sum(t.numel() for t in ts), _dtype_code(ts[0].dtype) if ts else -1,
                root, int(routed)]
        mine = torch.tensor(desc, dtype=torch.int64)
        every = torch.empty(self.size() * len(desc), dtype=torch.int64)
        self._gloo._allgather_base(every, mine, AllgatherOptions()).wait()
        rows = every.view(self.size(), len(desc)).tolist()
        if all(r == rows[0] for r in rows):
            return
        raise CollectiveMismatchError(
            f"fusedist backend: ranks of process group {self._name} called different "
            "collectives: " + "; ".join(f"rank {i} called {_say(r)}" for i, r in
                                        enumerate(rows))
            + ". Every rank must make the same call (same collective, reduce op, size, dtype "
            "and root)")

    def _routes(self, tensors, opts) -> bool:
        """Whether this call goes through fusedist (without creating anything yet)."""
        t = self._routable(tensors, opts)
        if t is None:
            return False
        if runtime.is_initialized():
            return True
        return dist.is_initialized() and self is dist.group.WORLD

    def _routable(self, tensors, opts) -> Optional[torch.Tensor]:
        if _depth() or len(tensors) != 1:
            return None
        t = tensors[0]
        if (opts.reduceOp != dist.ReduceOp.SUM or t.dtype not in _dtypes.REDUCE_DTYPES
                or not t.is_contiguous() or t.numel() == 0):
            return None
        return t

    def allreduce(self, tensors, opts=None):
        opts = dist.AllreduceOptions() if opts is None else opts
        self._check_call("all_reduce", tensors, opts.reduceOp,
                         routed=self._routes(tensors, opts))
        t = self._routable(tensors, opts)
        comm = self._communicator(t.device) if t is not None else None
        if comm is None:
            return self._backend_for(tensors).allreduce(tensors, opts)
        _routing.depth = _depth() + 1
        try:
            comm.all_reduce(t, out=t)
        finally:
            _routing.depth -= 1
        self.routed += 1
        return _done(list(tensors))

    # ---- everything else: gloo for CPU tensors, NCCL for CUDA tensors -------------------
    def allreduce_coalesced(self, tensors, opts):
        self._check_call("all_reduce_coalesced", tensors, opts.reduceOp)
        return self._backend_for(tensors).allreduce_coalesced(tensors, opts)

    def allgather(self, output_tensors, input_tensors, opts):
        self._check_call("all_gather", input_tensors)
        return self._backend_for(input_tensors).allgather(output_tensors, input_tensors, opts)

    def _allgather_base(self, output, input, opts):
        self._check_call("all_gather_into_tensor", input)
        return self._backend_for(input)._allgather_base(output, input, opts)

    def allgather_coalesced(self, output_lists, input_list, opts):
        self._check_call("all_gather_coalesced", input_list)
        return self._backend_for(input_list).allgather_coalesced(output_lists, input_list, opts)

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts):
        self._check_call("all_gather_into_tensor_coalesced", inputs)
        return self._backend_for(inputs).allgather_into_tensor_coalesced(outputs, inputs, opts)

    def reduce_scatter(self, output_tensors, input_lists, opts):
        self._check_call("reduce_scatter", input_lists, opts.reduceOp)
        return self._backend_for(output_tensors).reduce_scatter(output_tensors, input_lists,
                                                                opts)

    def _reduce_scatter_base(self, output, input, opts):
        self._check_call("reduce_scatter_tensor", input, opts.reduceOp)
        return self._backend_for(input)._reduce_scatter_base(output, input, opts)

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts):
        self._check_call("reduce_scatter_tensor_coalesced", inputs, opts.reduceOp)
        return self._backend_for(inputs).reduce_scatter_tensor_coalesced(outputs, inputs, opts)

    def broadcast(self, tensors, opts):
        self._check_call("broadcast", tensors, root=opts.rootRank)
        return self._backend_for(tensors).broadcast(tensors, opts)

    def reduce(self, tensors, opts):
        self._check_call("reduce", tensors, opts.reduceOp, root=opts.rootRank)
        return self._backend_for(tensors).reduce(tensors, opts)

    def gather(self, output_lists, input_tensors, opts):
        self._check_call("gather", input_tensors, root=opts.rootRank)
        return self._backend_for(input_tensors).gather(output_lists, input_tensors, opts)

    def scatter(self, output_tensors, input_lists, opts):
        self._check_call("scatter", output_tensors, root=opts.rootRank)
        return self._backend_for(output_tensors).scatter(output_tensors, input_lists, opts)

    def alltoall(self, output_tensors, input_tensors, opts):
        self._check_call("all_to_all", input_tensors)
        return self._backend_for(input_tensors).alltoall(output_tensors, input_tensors, opts)

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts):
        self._check_call("all_to_all_single", input)
        return self._backend_for(input).alltoall_base(output, input, output_split_sizes,
                                                      input_split_sizes, opts)

    def send(self, tensors, dst, tag):
        return self._backend_for(tensors).send(tensors, dst, tag)

    def recv(self, tensors, src, tag):
        return self._backend_for(tensors).recv(tensors, src, tag)

    def recv_anysource(self, tensors, tag):
        return self._backend_for(tensors).recv_anysource(tensors, tag)

    def barrier(self, opts=None):
        self._check_call("barrier", [])
        return self._gloo.barrier(dist.BarrierOptions() if opts is None else opts)


def _create(backend_opts, pg_opts=None) -> FusedistProcessGroup:
    return FusedistProcessGroup(backend_opts.store, backend_opts.group_rank,
                                backend_opts.group_size, backend_opts.timeout,
                                backend_opts.group_id)


def register() -> None:
    """Register the backend "fusedist" with torch.distributed (done on `import fusedist`;
    safe to call again). It does not become any device's default backend."""
    if BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True,
                                      devices=["cpu", "cuda"])


register()
