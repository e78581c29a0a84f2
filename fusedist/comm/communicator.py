"""Communicator: owns a group's symmetric buffers, its NCCL communicator and the tuned
all-reduce table, and runs the collectives. Construct it once per group (before CUDA-graph
capture), call it many times. ``fusedist.all_reduce`` & co. use the group's default
communicator (get_communicator)."""

from __future__ import annotations

import sys
import warnings
import weakref
from typing import Optional, Union

import torch
import torch.distributed as dist

from .. import _align, _dtypes, _ext, envs, tuning
from .._check import as_int
from ..distributed import runtime as _runtime
from ..distributed.groups import Group
from ..distributed.runtime import check_timeout_s, get_runtime
from ..errors import CollectiveMismatchError, CommunicatorClosedError, PeerAccessError
from . import symmetric
from ._args import peers_guard
from .streams import AsyncHandle, nvtx_range, run_on_comm_stream
from .symmetric import SymmetricMemory

GroupLike = Union[Group, dist.ProcessGroup, "Communicator", None]

DEFAULT_MAX_BYTES = 32 << 20
DEFAULT_ONE_SHOT_MAX_BYTES = 8 << 20
_ALGO_CODE = {"one_shot": 0, "two_shot": 1}
_by_name: dict[str, "Communicator"] = {}   # Communicator.name -> open communicator
_created_per_group: dict[str, int] = {}
_runtime.on_shutdown(_created_per_group.clear)
# The same two for each thread that runs under a runtime of its own (an emulated rank of
# fusedist.testing): its names are its rank's, the same as its peers' as on real ranks.
_names_of_thread_runtimes: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _names() -> tuple[dict, dict]:
    """(Communicator.name -> open communicator, communicators created per group name) of the
    calling thread's runtime."""
    rt = _runtime.thread_runtime()
    if rt is None:
        return _by_name, _created_per_group
    names = _names_of_thread_runtimes.get(rt)
    if names is None:
        names = _names_of_thread_runtimes[rt] = ({}, {})
    return names


# Op codes of the CPU path's call descriptors (check_same_call).
_CPU_CALLS = ("all_reduce", "all_gather", "reduce_scatter")
_DTYPE_OF_CODE = {c: str(d).replace("torch.", "") for d, c in _dtypes._CODES.items()}


def check_calls(group_name: str, ranks, calls) -> None:
    """Raise CollectiveMismatchError unless every rank made the same call. `calls[i]` is global
    rank `ranks[i]`'s (op code, element count, dtype code); the message names every rank's
    call, so each rank can tell what its peers did."""
    calls = [tuple(int(v) for v in c) for c in calls]
    if all(c == calls[0] for c in calls):
        return

    def say(c):
        op = _CPU_CALLS[c[0]] if 0 <= c[0] < len(_CPU_CALLS) else f"op {c[0]}"
        return f"{op} of {c[1]} {_DTYPE_OF_CODE.get(c[2], f'dtype {c[2]}')} elements"

    what = "; ".join(f"rank {r} called {say(c)}" for r, c in zip(ranks, calls))
    raise CollectiveMismatchError(
        f"fusedist: ranks of group {group_name} called different collectives: {what}. Every "
        "rank must make the same call (same op, dtype and size)")


def resolve_group(group: GroupLike) -> Group:
    if isinstance(group, Group):
        return group
    rt = get_runtime()
    if group is None:
        return rt.tp
    if isinstance(group, dist.ProcessGroup):
        # One Group (hence one default Communicator) per engine process group, not per call.
        g = rt.adopted_groups.get(group)
        if g is None:
            g = Group.from_process_group(group, device=rt.device, topology=rt.topology)
            rt.adopted_groups[group] = g
        return g
    raise TypeError(f"fusedist: group must be a fusedist.Group, a torch ProcessGroup or None, "
                    f"got {type(group).__name__}")


def _eager_under_compile(fn):
    """Under torch.compile, run fn when tracing and take its result as a constant of the
    graph (torch._dynamo.assume_constant_result) instead of tracing into it: get_communicator
    called in a compiled function then makes and registers the communicator for real, so the
    op it feeds (torch.ops.fusedist.*, which take the communicator's name) finds it when the
    graph runs, also when the compiled call is the group's first use. Eager calls are fn's.

    torch._dynamo is not imported for it: that import costs ~2 s of CPU, more than fusedist's
    own, in every process that never compiles (torch imports it lazily on first use). Until
    then fn gets the mark assume_constant_result sets (tests/comm/test_compile.py checks that
    the two agree)."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:
        return dynamo.assume_constant_result(fn)
    fn._dynamo_marked_constant = True
    return fn


@_eager_under_compile
def get_communicator(group: GroupLike = None) -> "Communicator":
    """The default communicator of `group` (tensor-parallel group when None), created on
    first use. Create it before CUDA-graph capture (a compiled call may create it: it is made
    when the call is traced)."""
    if isinstance(group, Communicator):
        return group
    g = resolve_group(group)
    if g._communicator is None or g._communicator.closed:
        g._communicator = Communicator(g)
    return g._communicator


def communicator_by_name(name: str) -> "Communicator":
    """The open Communicator called `name` (Communicator.name); torch.ops.fusedist.* take it."""
    comm = _names()[0].get(name)
    if comm is None or comm.closed:
        raise RuntimeError(f"fusedist: no open communicator named {name!r} (closed, or created "
                           "in another fusedist.init() lifetime); pass communicator.name of an "
                           "open one")
    return comm


class Communicator:
    """Collectives over one group.

    max_bytes: largest all-reduce served by symmetric memory (two-shot); larger ones use NCCL.
    one_shot_max_bytes: one-shot capacity (per-rank slot size). timeout_s: bounded wait for a
    peer inside symmetric kernels (default FUSEDIST_TIMEOUT_S or 30 s). symmetric=False skips
    symmetric memory (NCCL only). staging_bytes: symmetric staging space for the overlap
    engine's copy-engine transport (0: none). A call uses it when its data fits: ag_gemm needs
    x_shard's bytes, gemm_rs and gemm_ar need M * N * itemsize (the partial products).
    Every rank must pass the same sizes and timeout (checked at creation:
    CollectiveMismatchError names the ranks and their values).

    Every rank must make the same calls, with the same op, size and dtype. A call that
    differs raises CollectiveMismatchError naming each rank's call: on the CPU path at the
    call; on GPUs from check() (and every later call: the communicator is failed for good, as
    after a timeout), detected by the symmetric kernels' call descriptors and, for the paths
    whose data does not pass through them (NCCL calls, the GEMM + collective ops' copy-engine
    and fused engines), by a call check: a device barrier that carries the descriptor. The
    check before NCCL calls needs symmetric memory (NCCL calls of a communicator without it
    are not checked) and can be turned off (FUSEDIST_NCCL_CALL_CHECK=0). A check cannot stop
    the NCCL call queued behind it, which may then wait for a peer that called it differently:
    the first check() that finds the mismatch aborts the communicator's NCCL communicator, so
    that kernel exits (check() reads host memory only, so it works while the GPU is stuck; a
    thread blocked in a synchronize cannot call it).
    """

    # Where this communicator's name resolves (communicator_by_name): its runtime's names.
    _registry: dict = _by_name

    def __init__(self, group: GroupLike = None, *, max_bytes: int = DEFAULT_MAX_BYTES,
                 one_shot_max_bytes: int = DEFAULT_ONE_SHOT_MAX_BYTES,
                 timeout_s: Optional[float] = None, symmetric: bool = True,
                 staging_bytes: int = 0):
        rt = get_runtime()
        self.group = resolve_group(group)
        if not self.group.is_member:
            raise ValueError(f"fusedist.Communicator: this rank is not in group "
                             f"{self.group.name} {list(self.group.ranks)}")
        max_bytes, one_shot_max_bytes = (
            as_int("fusedist.Communicator", name, v, 1, what="a positive int") for name, v in
            (("max_bytes", max_bytes), ("one_shot_max_bytes", one_shot_max_bytes)))
        staging_bytes = as_int("fusedist.Communicator", "staging_bytes", staging_bytes, 0)
        if timeout_s is not None:
            timeout_s = check_timeout_s("fusedist.Communicator", timeout_s)
        self.device = self.group.device
        self.closed = False
        self.symm: Optional[SymmetricMemory] = None
        self.nccl = None
        self.nccl_overlap = None
        self._pending_async: Optional[AsyncHandle] = None  # set_pending
        self._nccl_aborted = False
        # A call check before every NCCL call (check_nccl_call); rank 0's setting everywhere,
        # so every rank issues the same device barriers.
        self.nccl_call_check = False
        self.table = {"allreduce": {}, "source": "cpu"}
        if self.device.type == "cpu" and self.group.size > 1 and self.group.pg is None:
            raise ValueError(f"fusedist.Communicator: group {self.group.name} has no "
                             "torch.distributed process group, which the CPU path's collectives "
                             "(gloo) run on; groups of emulated ranks (fusedist.testing) run on a "
                             "GPU only")
        if self.device.type == "cuda":
            _ext.load()
            from .nccl import NcclComm

            # The group's own transports where it has them (Group.symmetric_memory_class).
            symm_class = self.group.symmetric_memory_class or SymmetricMemory
            nccl_class = self.group.nccl_class or NcclComm
            if symmetric and self.group.size > 1:
                try:
                    self.symm = symm_class(self.group, max_bytes, min(one_shot_max_bytes,
                                           max_bytes), timeout_s, staging_bytes)
                except PeerAccessError as e:
                    warnings.warn(f"{e}", RuntimeWarning, stacklevel=2)
            try:
                self.nccl = nccl_class(self.group)
            except BaseException:
                # NcclComm fails on every rank alike (rank 0's verdict is gathered), so the
                # collective close of the symmetric buffers cannot hang.
                if self.symm is not None:
                    self.symm.close()
                raise
            # The GEMM + collective overlap engine runs NCCL beside a GEMM. A second
            # communicator limited to FUSEDIST_OVERLAP_NCCL_CTAS CTAs leaves more SMs to the
            # GEMM; on 2x H200 8 CTAs measured slower than NCCL's default (benchmarks/NOTES.md),
            # so by default the overlap engine shares the main communicator.
            ctas = envs.get("FUSEDIST_OVERLAP_NCCL_CTAS")
            self.nccl_overlap = nccl_class(self.group, max_ctas=ctas) \
                if ctas > 0 and self.group.size > 1 and self.nccl.kind == "nccl4py" else self.nccl
            name = torch.cuda.get_device_name(self.device)
            # Rank 0's table, forced algorithm and call-check setting for everyone: one choice
            # on all ranks.
            table = tuning.load_table(name, self.group.size)
            table["forced"] = tuning.forced_algo()
            self.table, check = self.group.all_gather_object(
                (table, envs.get("FUSEDIST_NCCL_CALL_CHECK")))[0]
            self.nccl_call_check = bool(check) and self.symm is not None
        rt.communicators.append(self)
        # Communicators of a group are created collectively, in the same order on every rank,
        # so "<group>/<n>" names the same communicator everywhere (torch.ops take the name).
        self._registry, created = _names()
        n = created.get(self.group.name, 0)
        created[self.group.name] = n + 1
        self.name = f"{self.group.name}/{n}"
        self._registry[self.name] = self

    # ---- validation ------------------------------------------------------------------
    def check_tensor(self, op: str, arg: str, t, dtypes=_dtypes.REDUCE_DTYPES) -> None:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"fusedist.{op}: {arg} must be a torch.Tensor, got {type(t).__name__}")
        if t.device.type != self.device.type:
            if self.device.type == "cuda":
                fix = f"move it with {arg}.to('{self.device}')"
            else:
                fix = (f"move it with {arg}.cpu(), or run fusedist.init(backend='nccl') for GPU "
                       "tensors")
            raise ValueError(f"fusedist.{op}: {arg} is on {t.device} but group "
                             f"{self.group.name} runs on {self.device.type}; {fix}")
        if self.device.type == "cuda" and t.device.index != self.device.index:
            raise ValueError(f"fusedist.{op}: {arg} is on {t.device} but this rank's device is "
                             f"{self.device}; allocate it on {self.device}")
        if not t.is_contiguous():
            raise ValueError(f"fusedist.{op}: {arg} is non-contiguous (stride {tuple(t.stride())}"
                             f"); call .contiguous() first")
        if t.dtype not in dtypes:
            raise TypeError(f"fusedist.{op}: {arg} has dtype {t.dtype}; supported: "
                            f"{', '.join(str(d) for d in dtypes)}")

    def check_open(self) -> None:
        if self.closed:
            raise CommunicatorClosedError(
                f"fusedist: the communicator of group {self.group.name} is closed (after "
                "fusedist.shutdown() or close()); create a new one after fusedist.init()")
        if self.symm is not None:
            try:
                self.symm.check()
            except CollectiveMismatchError:
                self.abort_nccl()
                raise

    def abort_nccl(self) -> None:
        """Abort this communicator's NCCL communicators (once), after a recorded mismatch: the
        NCCL call queued behind a failed call check may wait forever for a peer that called it
        differently, and an aborted NCCL communicator makes its kernels exit. The communicator
        is unusable by then anyway. Only on a mismatch, which every rank of the exchange
        records, so every rank aborts rather than destroys (destroying is an intra-node
        collective); a timeout (a peer that never came) leaves NCCL as it is.
        torch.distributed's NCCL (FUSEDIST_NCCL=torch) belongs to the process group and is left
        to torch's watchdog."""
        if self._nccl_aborted:
            return
        self._nccl_aborted = True
        for nc in {id(c): c for c in (self.nccl, self.nccl_overlap) if c is not None}.values():
            try:
                nc.abort()
            except Exception as e:  # noqa: BLE001 - the mismatch is the error to report
                warnings.warn(f"fusedist: aborting the NCCL communicator of group "
                              f"{self.group.name} failed: {e}", RuntimeWarning, stacklevel=2)

    def check(self) -> None:
        """Raise if a symmetric kernel recorded a timeout or a mismatched call (cheap host read;
        call after a sync or between graph replays to surface a dead peer or a desynchronised
        rank)."""
        self.check_open()

    # ---- all-reduce ------------------------------------------------------------------
    def choose_algo(self, nbytes: int, dtype: torch.dtype, algo: str = "auto") -> str:
        if algo == "auto":
            algo = self.table.get("forced") or tuning.choose(self.table, nbytes, self.group.size)
            if algo != "nccl" and self.symm is None:
                return "nccl"
            # Past an algorithm's capacity: two-shot if the message fits there, else NCCL.
            if algo == "one_shot" and nbytes > self.capacity("one_shot", dtype):
                algo = "two_shot"
            if algo == "two_shot" and nbytes > self.capacity("two_shot", dtype):
                algo = "nccl"
        return algo

    def capacity(self, algo: str, dtype: torch.dtype) -> int:
        C = _ext.load()
        return C.allreduce_max_numel(self.symm.handle, _dtypes.code(dtype),
                                     _ALGO_CODE[algo]) * dtype.itemsize

    def all_reduce(self, x: torch.Tensor, *, algo: str = "auto", out: Optional[torch.Tensor] = None,
                   async_op: bool = False):
        """Sum `x` over the group. Returns `out` (a new tensor when None; pass out=x for in
        place), or an AsyncHandle when async_op=True."""
        op = "all_reduce"
        self.check_open()
        self.check_tensor(op, "x", x)
        if out is None:
            out = torch.empty_like(x)
        else:
            self.check_tensor(op, "out", out)
            if out.shape != x.shape or out.dtype != x.dtype:
                raise ValueError(f"fusedist.all_reduce: out has shape {tuple(out.shape)} and dtype "
                                 f"{out.dtype}, x has {tuple(x.shape)} and {x.dtype}; they must match")
        if algo not in ("auto",) + tuning.ALGOS:
            raise ValueError(f"fusedist.all_reduce: algo must be 'auto' or one of "
                             f"{tuning.ALGOS}, got {algo!r}")
        if self.device.type == "cpu":
            result = self._all_reduce_cpu(x, out)
            return AsyncHandle(result) if async_op else result
        nbytes = x.numel() * x.element_size()
        chosen = self.choose_algo(nbytes, x.dtype, algo)
        if chosen != "nccl":
            if self.symm is None:
                raise PeerAccessError(
                    f"fusedist.all_reduce: algo={algo!r} needs symmetric memory, which group "
                    f"{self.group.name} does not have (peer access unavailable, size 1, or "
                    "symmetric=False); use algo='nccl' or 'auto'")
            cap = self.capacity(chosen, x.dtype)
            if nbytes > cap:
                raise ValueError(
                    f"fusedist.all_reduce: x has {nbytes} bytes, more than the {cap} bytes "
                    f"{chosen} holds on this communicator; create fusedist.Communicator("
                    f"max_bytes>={nbytes}) or use algo='nccl' or 'auto'")
        if async_op:
            handle = run_on_comm_stream(lambda s: self._launch(x, out, chosen), (x, out),
                                        self.device)
            self.set_pending(handle)
            return handle
        return self._launch(x, out, chosen)

    def set_pending(self, handle: AsyncHandle) -> None:
        """Record `handle` (an async call of this communicator on the comm stream) as pending:
        the next call must not overlap it (the symmetric kernels of one communicator run one
        at a time), so launch_stream() orders that call's stream after it, unless
        handle.wait() already did."""
        self._pending_async = handle

    def launch_stream(self) -> torch.cuda.Stream:
        """The caller's stream, ordered after this communicator's pending async call (its
        symmetric kernels run one at a time). Ops launch their kernels on it; every kernel
        that waits for the peers is launched after a call of this (SymmetricMemory.
        before_launch: emulated ranks launch in step there)."""
        stream = torch.cuda.current_stream(self.device)
        self.order_after_pending(stream)
        if self.symm is not None:
            self.symm.before_launch()
        return stream

    def launched(self) -> None:
        """After the kernel launch_stream() was called for (SymmetricMemory.after_launch:
        emulated ranks go on when every peer has launched too)."""
        if self.symm is not None:
            self.symm.after_launch()

    def order_after_pending(self, stream: torch.cuda.Stream) -> None:
        """Make `stream` wait for this communicator's pending async call, if any.

        Not when handle.wait() already ordered this same stream after it, and only within the
        world the call was made in: a stream being captured cannot wait on an event recorded
        outside the capture (cudaErrorStreamCaptureIsolation), and an eager stream cannot
        wait on one recorded inside a capture. Across that boundary no wait is needed:
        torch.cuda.graph synchronizes the device before capture begins (so an eager call has
        completed), and a captured async call must be joined back into its capture before
        the capture ends (CUDA ends a capture only when every fork is joined)."""
        pending = self._pending_async
        if pending is None:
            return
        self._pending_async = None
        if pending.captured != torch.cuda.is_current_stream_capturing():
            return
        if pending.joined_on is not None and pending.joined_on == stream:
            return
        stream.wait_event(pending._event)

    def clear_pending(self) -> None:
        """Forget the pending async call: the caller's stream already follows it."""
        self._pending_async = None

    def device_barrier(self, desc: tuple) -> None:
        """Barrier on the current stream, on the device, that checks the call: the call check
        (csrc/include/fusedist/comm/call_check.cuh) exchanges `desc`, this rank's call descriptor
        (symmetric.gemm_desc / nccl_desc), with every peer, and completes on a rank only after
        every peer's check ran, i.e. after everything queued before it on the peers' streams.
        A peer with another descriptor fails the communicator (CollectiveMismatchError from
        check()), one that never comes too (CommunicatorTimeoutError), in bounded time."""
        self.check_open()
        stream = self.launch_stream()
        _ext.load().call_check(self.symm.handle, tuple(desc), stream.cuda_stream)
        self.launched()

    def check_nccl_call(self, collective: str, dtype: torch.dtype, numel: int,
                        calls: int = 1) -> None:
        """Before an NCCL call (on that call's stream): a call check carrying what NCCL is
        about to be asked (`collective` of `numel` input elements of `dtype`, in `calls` NCCL
        calls), when the communicator has symmetric memory and FUSEDIST_NCCL_CALL_CHECK is on
        (rank 0's setting). NCCL itself does not compare sizes: ranks that call it differently
        hang or sum misread bytes."""
        if self.nccl_call_check and self.group.size > 1:
            self.device_barrier(symmetric.nccl_desc(collective, _dtypes.code(dtype), numel, calls))

    def _launch(self, x: torch.Tensor, out: torch.Tensor, algo: str) -> torch.Tensor:
        stream = self.launch_stream()
        with nvtx_range(f"fusedist.all_reduce.{algo}"):
            if algo == "nccl" or self.group.size == 1:
                self.check_nccl_call("all_reduce", x.dtype, x.numel())
                return self.nccl.all_reduce(x, out)
            C = _ext.load()
            src, dst = _align.aligned_input(x), _align.aligned_output(out)
            C.allreduce(self.symm.handle, src.data_ptr(), dst.data_ptr(), x.numel(),
                        _dtypes.code(x.dtype), _ALGO_CODE[algo], stream.cuda_stream)
            self.launched()
            if dst is not out:
                out.copy_(dst)
            return out

    def check_same_call(self, op: str, x: torch.Tensor) -> None:
        """CPU path, before a gloo collective: gather every rank's (op, numel, dtype) and raise
        CollectiveMismatchError on every rank if they differ. gloo itself aborts the process
        on a size mismatch (gloo::EnforceNotMet) and sums misread bytes on a dtype mismatch.
        One small all-gather per call: the CPU path is the reference path, not a fast one."""
        if self.group.size == 1:
            return
        mine = torch.tensor([_CPU_CALLS.index(op), x.numel(), _dtypes.code(x.dtype)],
                            dtype=torch.int64)
        calls = [torch.empty_like(mine) for _ in range(self.group.size)]
        dist.all_gather(calls, mine, group=self.group.pg)
        check_calls(self.group.name, self.group.ranks, [c.tolist() for c in calls])

    def _all_reduce_cpu(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Reference path: fp32 accumulation over gloo, rounded once to x.dtype. A peer that is
        gone (its process exited, cleanly or not) raises PeerLostError naming it, not gloo's
        connection error."""
        with peers_guard("fusedist.all_reduce", self.group, peer_failures_only=True):
            self.check_same_call("all_reduce", x)
            acc = x.to(torch.float32, copy=True)
            if self.group.size > 1:
                dist.all_reduce(acc, group=self.group.pg)
        out.copy_(acc)
        return out

    # ---- teardown --------------------------------------------------------------------
    def close(self) -> None:
        """Collective: release symmetric buffers and the NCCL communicator."""
        if self.closed:
            return
        self.closed = True
        try:
            if self.symm is not None:
                if self.symm.error_code() == symmetric.ERR_MISMATCH:
                    self.abort_nccl()  # an NCCL kernel may wait forever: close() synchronizes
                self.symm.close()
            if self.nccl_overlap is not None and self.nccl_overlap is not self.nccl:
                self.nccl_overlap.close()
            if self.nccl is not None:
                self.nccl.close()
        finally:
            if self._registry.get(self.name) is self:
                del self._registry[self.name]
            if self.group._communicator is self:
                self.group._communicator = None
            try:
                get_runtime().communicators.remove(self)
            except (ValueError, Exception):
                pass
