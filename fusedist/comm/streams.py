"""Streams, events and the async-handle contract shared by every collective.

* Ops run on ``torch.cuda.current_stream()`` (never stream 0).
* ``async_op=True`` runs the op on a high-priority communication stream of the pool, after an
  event recorded on the caller's stream, and returns an :class:`AsyncHandle`; its ``wait()``
  makes the caller's current stream wait for the op (no host synchronization). Tensors that
  cross streams are ``record_stream``-ed so the caching allocator does not reuse them early.
* Every public op is wrapped in an NVTX range (``FUSEDIST_NVTX=0`` turns them off).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterable, Optional

import torch

from .. import envs
from ..distributed import runtime as _runtime

_NVTX = envs.get("FUSEDIST_NVTX")
_pools: dict[int, list[torch.cuda.Stream]] = {}
_thread = threading.local()
POOL_SIZE = envs.get("FUSEDIST_COMM_STREAMS")


def _device_index(device) -> int:
    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, int):
        return device
    d = torch.device(device)
    return d.index if d.index is not None else torch.cuda.current_device()


def _pools_here() -> dict[int, list[torch.cuda.Stream]]:
    """The pools of the calling thread: the process's, or, in a thread running under a runtime
    of its own (an emulated rank of fusedist.testing), the thread's: ranks that share a GPU
    must not queue their kernels on one stream, where a kernel waiting for a peer would hold
    back that peer's kernel behind it."""
    if _runtime.thread_runtime() is None:
        return _pools
    pools = getattr(_thread, "pools", None)
    if pools is None:
        pools = _thread.pools = {}
    return pools


def comm_stream(device: torch.device | int | None = None, index: int = 0) -> torch.cuda.Stream:
    """High-priority communication stream `index` of the pool for `device` (created once)."""
    dev = _device_index(device)
    pools = _pools_here()
    pool = pools.get(dev)
    if pool is None:
        lo, hi = torch.cuda.Stream.priority_range() if hasattr(torch.cuda.Stream, "priority_range") \
            else (0, -1)
        prio = min(lo, hi)  # numerically lowest = highest priority
        with torch.cuda.device(dev):
            pool = [torch.cuda.Stream(device=dev, priority=prio) for _ in range(max(1, POOL_SIZE))]
        pools[dev] = pool
    return pool[index % len(pool)]


def reset_pools() -> None:
    _pools.clear()


_runtime.on_shutdown(reset_pools)   # streams belong to one runtime's devices


@contextlib.contextmanager
def nvtx_range(name: str):
    if _NVTX and torch.cuda.is_available():
        torch.cuda.nvtx.range_push(name)
        try:
            yield
        finally:
            torch.cuda.nvtx.range_pop()
    else:
        yield


class AsyncHandle:
    """Completion handle of an ``async_op=True`` call.

    ``wait()`` orders the caller's current stream after the op (a stream wait, no host sync)
    and returns the op's result. ``is_completed()`` polls; ``synchronize()`` blocks the host.
    CPU ops complete before the handle is returned.
    """

    def __init__(self, result, event: Optional[torch.cuda.Event] = None):
        self._result = result
        self._event = event
        # Whether the op was launched inside a CUDA-graph capture (its event belongs to it).
        self.captured = bool(event is not None and torch.cuda.is_current_stream_capturing())
        # The stream wait() ordered after the op (None: not waited yet).
        self.joined_on = None

    def wait(self):
        if self._event is not None:
            stream = torch.cuda.current_stream()
            stream.wait_event(self._event)
            self.joined_on = stream
        return self._result

    def is_completed(self) -> bool:
        return self._event is None or self._event.query()

    def synchronize(self):
        if self._event is not None:
            self._event.synchronize()
        return self._result

    @property
    def result(self):
        return self._result


def run_on_comm_stream(fn: Callable[[torch.cuda.Stream], object], tensors: Iterable[torch.Tensor],
                       device: torch.device, previous_event: Optional[torch.cuda.Event] = None
                       ) -> AsyncHandle:
    """Run ``fn(stream)`` on the pool's stream after the caller's current stream (or after
    ``previous_event``), and return a handle whose ``wait()`` joins it back."""
    caller = torch.cuda.current_stream(device)
    stream = comm_stream(device)
    if previous_event is None:
        previous_event = torch.cuda.Event()
        previous_event.record(caller)
    stream.wait_event(previous_event)
    with torch.cuda.stream(stream):
        result = fn(stream)
        done = torch.cuda.Event()
        done.record(stream)
    for t in tensors:
        if t is not None and t.is_cuda:
            t.record_stream(stream)
    return AsyncHandle(result, done)
