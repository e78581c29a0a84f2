"""Several ranks of one group emulated on one GPU: threads of this process, each one rank with
its own CUDA stream, its own runtime (groups, communicators, comm streams) and its own
symmetric buffers. The peers' buffers are plain device pointers (one process, one device:
every allocation is addressable, no CUDA IPC), so the symmetric kernels, their call
descriptors and the call checks run as they do between GPUs.

    from fusedist.testing import run_ranks

    def body(rt):                    # once per rank, in that rank's thread: rt is its runtime
        comm = fusedist.Communicator(rt.tp, max_bytes=1 << 20)
        return comm.all_reduce(torch.ones(8, device=rt.device), algo="one_shot").tolist()

    results = run_ranks(2, body)     # [rank 0's, rank 1's]; a rank's failure is re-raised

Inside a rank's thread fusedist.get_runtime() is that rank's runtime, so the default group
(fusedist.all_reduce(x), get_communicator()) is the rank's too. Correctness only: the ranks
share one GPU's SMs and memory bandwidth, so their timings mean nothing.

What runs, and what cannot (docs/design/allreduce.md, "Emulated ranks"):
* runs: the one-shot, two-shot and fused RMSNorm all-reduces, the fused decode gemm_ar, the
  copy-engine GEMM + collective pipelines and every call check, async calls (each rank has
  its own comm-stream pool), torch.ops.fusedist by communicator name;
* refused (NcclUnavailableError): whatever is routed to NCCL, which runs one rank per GPU and
  process (EmulatedNccl);
* cannot run: kernels that hold the GPU while they wait for a peer. The fused Hopper ag_gemm
  and gemm_rs are persistent GEMMs with a CTA on every SM whose tiles wait for the peers'
  rows: one rank's GEMM holds every SM, so the peer's work it waits for never starts, and the
  wait times out. CUDA-graph capture through torch.cuda.graph in its default global mode:
  the other rank threads' CUDA calls invalidate the capture, and its entry synchronizes the
  device, which a peer's ongoing capture refuses; capture_graph captures each rank's graph
  in thread-local mode without that synchronize.

Co-residency: a kernel that waits for its peers progresses only while the peers' kernels run
beside it, on the same GPU here, and nothing between GPUs prepares for that. So:
* grids for a share of the SMs: the emulated symmetric memory sets max_blocks = SMs //
  (2 x world), so the world's waiting kernels together take at most half of the GPU and
  leave the rest to the ranks' other kernels;
* no programmatic dependent launch (FUSEDIST_PDL=0 before fusedist launches anything): a
  kernel's successor, scheduled early, holds its SMs while it waits for the kernel, and a
  large one (add_rmsnorm after an all-reduce: a row per block) leaves a peer's kernel no room;
* the ranks launch in step: before launching a waiting kernel (Communicator.launch_stream) a
  rank waits, a few seconds at most, until its peers have come as far, and after launching
  it (Communicator.launched, the expert-parallel kernels) until they have launched too.
  Otherwise one rank's kernel waits while a peer does something that waits for the whole GPU
  context, and both wait until the kernel times out: on an H200, a rank's cuBLAS GEMM (the
  copy-engine pipelines' first GEMM of a shape) stalled so beside a peer's waiting call
  check, and at 8 ranks the expert-parallel kernels timed out waiting for a peer's launch
  (docs/design/allreduce.md, "Emulated ranks");
* CUDA_MODULE_LOADING=EAGER, set before CUDA initializes: with lazy loading every kernel's
  first launch may wait for the context (CUDA's lazy-loading guide);
* no cudaFree while the ranks run (it waits for the whole GPU): the emulated buffers are freed
  when run_ranks ends; and a rank synchronizes its own streams (current stream, comm pool),
  never the whole device.
run_ranks warns when CUDA_MODULE_LOADING or FUSEDIST_PDL says otherwise; tests/dist/emulate.py
sets both.
"""

from __future__ import annotations

import os
import pickle
import sys
import threading
import time
import traceback
import warnings
from typing import Callable, Optional, Sequence, TypeVar

import torch

from .. import _ext, envs
from ..comm import streams
from ..comm.symmetric import SymmetricMemory
from ..distributed import runtime
from ..distributed.groups import Group
from ..distributed.launch_env import LaunchEnv
from ..distributed.runtime import Runtime
from ..distributed.topology import Topology
from ..errors import FusedistError, NcclUnavailableError

T = TypeVar("T")
NODE = "emulated"  # the one node every emulated rank is on


class EmulationError(FusedistError):
    """The emulation itself failed (rather than the code the ranks ran)."""


class EmulationTimeoutError(EmulationError):
    """Emulated ranks ran past run_ranks' timeout: waiting in a host-side exchange for a rank
    that never came, or not finished."""


class RankError(EmulationError):
    """An emulated rank raised: `.rank` names it, `.error` (also the __cause__) is what it
    raised."""

    def __init__(self, rank: int, world: int, error: BaseException):
        super().__init__(f"emulated rank {rank} of {world} failed: {type(error).__name__}: "
                         f"{error}")
        self.rank = rank
        self.error = error


class _PeerFailed(EmulationError):
    """A rank's host-side exchange gave up because another rank failed first."""


# ---- the control plane -----------------------------------------------------------------------

class _Exchange:
    """all_gather_object among the threads of an emulated group: every member posts a pickled
    object and receives its own unpickled copies of all of them (as torch.distributed's gives
    each process), in member order. A wait ends at the run's deadline (EmulationTimeoutError
    naming the members that never came) or when a member failed (abort: _PeerFailed). After
    end() (every member thread is gone) it answers at once: run_ranks closes what the ranks
    left open from one thread, and a closing barrier then has nobody to wait for."""

    def __init__(self, size: int, name: str, deadline: float):
        self.size, self.name, self.deadline = size, name, deadline
        self._cond = threading.Condition()
        self._round = 0
        self._posted: dict[int, bytes] = {}
        self._done: dict[int, list] = {}      # round -> [payloads, readers still to read]
        self._broken: Optional[EmulationError] = None
        self._ended = False
        self._launches = [0] * size       # launches each member has come to
        self._launched = [0] * size       # launches each member has made

    def all_gather(self, index: int, obj) -> list:
        payload = pickle.dumps(obj)  # an object torch.distributed could not send fails here too
        with self._cond:
            if self._ended:
                return [pickle.loads(payload) for _ in range(self.size)]
            if self._broken is not None:
                raise type(self._broken)(str(self._broken))
            if index in self._posted:
                raise EmulationError(f"fusedist.testing: member {index} of emulated group "
                                     f"{self.name} entered an exchange twice at once")
            rnd = self._round
            self._posted[index] = payload
            if len(self._posted) == self.size:
                self._done[rnd] = [[self._posted[i] for i in range(self.size)], self.size]
                self._posted = {}
                self._round += 1
                self._cond.notify_all()
            else:
                while self._round == rnd and self._broken is None and not self._ended:
                    left = self.deadline - time.monotonic()
                    if left <= 0:
                        self._expire_locked()
                        break
                    self._cond.wait(left)
                if self._round == rnd:
                    if self._ended:
                        return [pickle.loads(payload) for _ in range(self.size)]
                    raise type(self._broken)(str(self._broken))
            entry = self._done[rnd]
            entry[1] -= 1
            if entry[1] == 0:
                del self._done[rnd]
            payloads = entry[0]
        return [pickle.loads(p) for p in payloads]

    def meet(self, index: int, patience: float, launched: bool = False) -> None:
        """Member `index` is about to launch a kernel that waits for its peers (launched: has
        just launched it): wait until every member has come as far (its as many launches),
        for at most `patience` seconds, then go on regardless (ranks that call differently
        launch different numbers of kernels, and the kernels themselves report that)."""
        counts = self._launched if launched else self._launches
        with self._cond:
            counts[index] += 1
            k = counts[index]
            self._cond.notify_all()
            end = time.monotonic() + patience
            while min(counts) < k and self._broken is None and not self._ended:
                left = end - time.monotonic()
                if left <= 0:
                    return
                self._cond.wait(left)

    def _expire_locked(self) -> None:
        came = sorted(self._posted)
        missing = [i for i in range(self.size) if i not in self._posted]
        self._broken = EmulationTimeoutError(
            f"fusedist.testing: members {came} of emulated group {self.name} waited in "
            f"all_gather_object past run_ranks' deadline for members {missing}, which never "
            "came (they skipped the exchange, are stuck, or ran out of time)")
        self._cond.notify_all()

    def expire(self, why: str) -> None:
        """The run's deadline passed: members waiting now raise EmulationTimeoutError naming
        the members they wait for; with none waiting, later arrivals raise _PeerFailed(why)."""
        with self._cond:
            if self._broken is None:
                if self._posted:
                    self._expire_locked()
                else:
                    self._broken = _PeerFailed(f"fusedist.testing: emulated group {self.name} "
                                               f"gave up: {why}")
            self._cond.notify_all()

    def abort(self, why: str) -> None:
        """Every member waiting now, or arriving later, raises _PeerFailed(`why`)."""
        with self._cond:
            if self._broken is None:
                self._broken = _PeerFailed(f"fusedist.testing: emulated group {self.name} gave "
                                           f"up: {why}")
            self._cond.notify_all()

    def end(self) -> None:
        with self._cond:
            self._ended = True
            self._cond.notify_all()


# ---- the group, its symmetric memory and its (absent) NCCL --------------------------------

class EmulatedSymmetricMemory(SymmetricMemory):
    """SymmetricMemory of an emulated group: the same layout and kernels; the peers' buffers
    are plain device pointers (gathered, not IPC-mapped), grids take SMs // (2 x world) SMs,
    the ranks launch in step, a rank synchronizes its own streams, and the buffers are freed
    when run_ranks ends (cudaFree would wait for the peers' kernels). The module docstring
    says why."""

    def _map_peers(self) -> list:
        return self.group.all_gather_object(self._base)

    def _max_blocks(self, sms: int) -> int:
        return max(1, sms // (2 * self.group.size))

    def _synchronize(self) -> None:
        synchronize_rank(self._device)

    def before_launch(self) -> None:
        # The ranks launch in step: a rank's waiting kernel is in flight only while its peers
        # are on their way to the same launch, not while one of them does a first use that
        # synchronizes the GPU context (cuBLAS loads a kernel at its first use, for one) and
        # so would wait for that kernel until it times out.
        self.group._exchange.meet(self.group.rank, min(5.0, self.timeout_s / 2))

    def after_launch(self) -> None:
        # ... and go on only when every peer has launched too: a rank that went ahead could
        # otherwise reach a call that waits for the whole GPU context while a peer, not yet
        # launched, waits for it to launch (its launch needs that context), and the kernels
        # waiting for that peer hold the GPU until they time out.
        self.group._exchange.meet(self.group.rank, min(5.0, self.timeout_s / 2), launched=True)

    def _free(self) -> None:
        self._staging_u8 = None
        ptrs = (getattr(self, "_base", None), getattr(self, "_control", None),
                getattr(self, "_err_host", None))
        self._base = self._control = self._err_host = None
        if any(ptrs):
            self.group._world.free_later(*ptrs)


class EmulatedNccl:
    """NCCL's place in an emulated group's communicator: NCCL runs one rank per GPU and
    process, so every call raises NcclUnavailableError naming the symmetric paths."""

    kind = "emulated"

    def __init__(self, group: Group, max_ctas: Optional[int] = None):
        self.group = group
        self.aborted = False

    def _refuse(self, collective: str):
        raise NcclUnavailableError(
            f"fusedist: {collective} through NCCL on group {self.group.name}: emulated ranks "
            "(fusedist.testing) have no NCCL, which runs one rank per GPU and process; use a "
            "symmetric path (all_reduce algo='one_shot' or 'two_shot', gemm_ar engine='fused', "
            "transport='copy_engine') or ranks on GPUs of their own")

    def all_reduce(self, x, out):
        self._refuse("all_reduce")

    def all_gather(self, x, out):
        self._refuse("all_gather")

    def reduce_scatter(self, x, out):
        self._refuse("reduce_scatter")

    def abort(self) -> None:
        self.aborted = True

    def close(self) -> None:
        pass


class EmulatedGroup(Group):
    """A group of emulated ranks as one of them sees it: `rank` is that member's index, the
    control plane (all_gather_object, barrier) an exchange among the member threads, no torch
    process group (pg is None), and the transports EmulatedSymmetricMemory and EmulatedNccl.
    Each member holds its own EmulatedGroup object, named "<world>.<kind>" on every member as
    on real ranks (a communicator's name, which torch.ops.fusedist look up, derives from it;
    each rank thread resolves names among its own runtime's communicators)."""

    symmetric_memory_class = EmulatedSymmetricMemory
    nccl_class = EmulatedNccl

    def __init__(self, world: "_World", name: str, ranks: Sequence[int], index: int,
                 exchange: Optional[_Exchange], topology: Topology):
        super().__init__(name, tuple(ranks), None, world.device, topology)
        self._world = world
        self._index = index
        self._exchange = exchange

    @property
    def rank(self) -> int:
        return self._index

    @property
    def backend(self) -> str:
        return "emulated"

    def all_gather_object(self, obj) -> list:
        if self.size == 1:
            return [obj]
        return self._exchange.all_gather(self._index, obj)


def synchronize_rank(device: torch.device) -> None:
    """Wait for the calling rank's work: its current stream and its comm-stream pool (not the
    device, where a peer's kernel may wait for this rank's next launch)."""
    torch.cuda.current_stream(device).synchronize()
    for i in range(streams.POOL_SIZE):
        streams.comm_stream(device, i).synchronize()


def capture_graph(graph: "torch.cuda.CUDAGraph", body: Callable[[], None],
                  device: torch.device) -> None:
    """Capture body() into graph on a side stream of the calling rank, in thread-local mode,
    without what torch.cuda.graph does on entry (a device-wide synchronize and empty_cache):
    those are not permitted while a peer rank's thread is capturing, and the ranks capture
    together (a kernel's launch meets its peers' launches, EmulatedSymmetricMemory)."""
    caller = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(caller)
    with torch.cuda.stream(side):
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            body()
        finally:
            graph.capture_end()
    caller.wait_stream(side)


class _World:
    """One run of run_ranks: its ranks' runtimes and groups, and the buffers to free at its
    end."""

    def __init__(self, size: int, device: torch.device, name: str, deadline: float):
        self.size, self.device, self.name = size, device, name
        self.exchange = _Exchange(size, name, deadline)
        self._garbage: list[tuple] = []
        self._lock = threading.Lock()
        self.runtimes = [self._runtime(r) for r in range(size)]

    def _runtime(self, r: int) -> Runtime:
        W = self.size
        topo = Topology(world_size=W, rank=r, node_ids=(NODE,) * W)

        def group(kind, ranks, index, exchange):
            return EmulatedGroup(self, f"{self.name}.{kind}", ranks, index, exchange, topo)

        # The groups init() makes on one node with tp_size = world: world, tp and intra_node
        # span every rank (one exchange, as their torch groups share WORLD), dp and inter_node
        # are this rank alone.
        everyone = range(W)
        env = LaunchEnv(launcher="emulated", rank=r, world_size=W, local_rank=r,
                        local_world_size=W, node_id=NODE, master_addr=None, master_port=None)
        return Runtime(env=env, topology=topo, device=self.device, backend="emulated",
                       world=group("world", everyone, r, self.exchange),
                       tp=group("tp", everyone, r, self.exchange),
                       dp=group("dp", (r,), 0, None),
                       intra_node=group("intra_node", everyone, r, self.exchange),
                       inter_node=group("inter_node", (r,), 0, None),
                       owns_process_group=False)

    def free_later(self, *ptrs) -> None:
        with self._lock:
            self._garbage.append(ptrs)

    def release(self) -> None:
        """Free the symmetric buffers of the run (every rank gone, the device idle)."""
        C = _ext.load()
        with self._lock:
            garbage, self._garbage = self._garbage, []
        for base, control, err_host in garbage:
            if base:
                C.device_free(base)
            if control:
                C.device_free(control)
            if err_host:
                C.host_mapped_free(err_host)


# ---- running the ranks ------------------------------------------------------------------

def _device(device) -> torch.device:
    if device is None:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if dev.type not in ("cuda", "cpu"):
        raise ValueError(f"fusedist.testing.run_ranks: device must be a CUDA device (or 'cpu' "
                         f"for the host-side pieces alone), got {dev}")
    return dev


def _check_environment() -> None:
    """Warn where the process is set up so that a rank may wait for a peer's waiting kernel
    (the module docstring says why; both are read once, before they could be changed here)."""
    if os.environ.get("CUDA_MODULE_LOADING", "").upper() != "EAGER":
        warnings.warn(
            "fusedist.testing.run_ranks: CUDA_MODULE_LOADING is not EAGER: with lazy loading "
            "the first launch of a kernel may wait for the kernels running on the GPU, a peer "
            "rank's kernel waiting for this one among them, until its timeout. Set "
            "CUDA_MODULE_LOADING=EAGER in the environment before CUDA initializes (as "
            "tests/dist/emulate.py does)", RuntimeWarning, stacklevel=3)
    if envs.get("FUSEDIST_PDL"):
        warnings.warn(
            "fusedist.testing.run_ranks: programmatic dependent launch is on: a kernel's "
            "successor, scheduled early, holds SMs that a peer rank's kernel may need, until "
            "its timeout. Set FUSEDIST_PDL=0 before fusedist launches a kernel (as "
            "tests/dist/emulate.py does)", RuntimeWarning, stacklevel=3)


def _where(thread: threading.Thread, frames: int = 3) -> str:
    """The innermost `frames` frames of `thread`, innermost first."""
    frame = sys._current_frames().get(thread.ident)
    if frame is None:
        return "?"
    stack = traceback.extract_stack(frame)[-frames:]
    return " < ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}: {f.line}"
                      for f in reversed(stack))


def run_ranks(world: int, fn: Callable[[Runtime], T], *, device=None,
              timeout_s: float = 600.0, grace_s: float = 60.0,
              name: str = "emulated") -> list[T]:
    """Run fn(rt) once per rank of `world` emulated ranks: one thread each, rt that rank's
    runtime (rt.tp, rt.world: its groups; rt.rank; rt.device), the thread under it
    (fusedist.get_runtime() there is rt) with a CUDA stream of its own as the current stream.
    Returns fn's results in rank order.

    A rank that raises aborts the host-side exchanges its peers wait in, and run_ranks raises
    RankError naming the first rank that failed (its exception as the cause; a BaseException
    that is not an Exception, such as pytest.skip's, is re-raised as it is). Ranks still
    running after timeout_s get grace_s more (kernels that wait for a peer give up within the
    communicators' timeout) and then EmulationTimeoutError names them and where they are; their
    buffers are then left allocated, since their kernels may still use them. Communicators the
    ranks left open are closed, and the emulated buffers freed, after every rank ended.

    device: the GPU the ranks share (default: the current one), or "cpu" for the host-side
    pieces alone (the exchange, the runtimes; communicators need a GPU)."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"fusedist.testing.run_ranks: world must be a positive int, got "
                         f"{world!r}")
    timeout_s = runtime.check_timeout_s("fusedist.testing.run_ranks", timeout_s)
    if isinstance(grace_s, bool) or not isinstance(grace_s, (int, float)) or grace_s < 0:
        raise ValueError(f"fusedist.testing.run_ranks: grace_s must be a number >= 0, got "
                         f"{grace_s!r}")
    if runtime.thread_runtime() is not None:
        raise RuntimeError("fusedist.testing.run_ranks: called from an emulated rank; emulated "
                           "worlds do not nest")
    dev = _device(device)
    if dev.type == "cuda":
        _ext.load()
        torch.cuda.set_device(dev)
        _check_environment()
    deadline = time.monotonic() + timeout_s
    w = _World(world, dev, name, deadline)
    results: list = [None] * world
    failures: list = []  # (when, rank, exception)
    lock = threading.Lock()

    def rank_main(r: int) -> None:
        runtime.set_thread_runtime(w.runtimes[r])
        try:
            if dev.type == "cuda":
                torch.cuda.set_device(dev)
                with torch.cuda.stream(torch.cuda.Stream(dev)):
                    results[r] = fn(w.runtimes[r])
            else:
                results[r] = fn(w.runtimes[r])
        except BaseException as e:  # noqa: BLE001 - reported by run_ranks, in rank order of time
            with lock:
                failures.append((time.monotonic(), r, e))
            if not isinstance(e, _PeerFailed):
                w.exchange.abort(f"rank {r} failed ({type(e).__name__}: {e})")
        finally:
            runtime.set_thread_runtime(None)

    threads = [threading.Thread(target=rank_main, args=(r,), name=f"fusedist-{name}-rank{r}",
                                daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    late = [r for r, t in enumerate(threads) if t.is_alive()]
    if late:
        w.exchange.expire(f"ranks {late} still ran at run_ranks' timeout of {timeout_s:g} s")
        end = time.monotonic() + grace_s
        for r in late:
            threads[r].join(max(0.0, end - time.monotonic()))
        stuck = [r for r in late if threads[r].is_alive()]
        if stuck:
            where = "; ".join(f"rank {r} at {_where(threads[r])}" for r in stuck)
            raise EmulationTimeoutError(
                f"fusedist.testing.run_ranks: emulated ranks {stuck} of {world} still run "
                f"{timeout_s + grace_s:g} s after the start ({where}); their threads are left "
                "running and their buffers allocated")
    closing = _teardown(w)
    primary = [f for f in failures if not isinstance(f[2], _PeerFailed)]
    if primary or (failures and not late):
        _, r, e = min(primary or failures, key=lambda f: f[0])
        if not isinstance(e, Exception):
            raise e
        raise RankError(r, world, e) from e
    if late:
        raise EmulationTimeoutError(f"fusedist.testing.run_ranks: emulated ranks {late} of "
                                    f"{world} ran past the timeout of {timeout_s:g} s")
    if closing:
        raise EmulationError("fusedist.testing.run_ranks: closing what the ranks left open "
                             "failed: " + "; ".join(closing))
    return results


def _teardown(w: _World) -> list:
    """After every rank ended: wait for the GPU, close the communicators the ranks left open
    (from this thread: their closing barriers have nobody to wait for), free the buffers.
    Returns what failed, as text."""
    failed = []
    if w.device.type == "cuda":
        try:
            torch.cuda.synchronize(w.device)
        except RuntimeError as e:  # a sticky CUDA error: the buffers cannot be freed either
            return [f"waiting for the GPU: {e}"]
    w.exchange.end()
    for rt in w.runtimes:
        for comm in reversed(list(rt.communicators)):
            try:
                comm.close()
            except Exception as e:  # noqa: BLE001 - reported after the ranks' own failures
                failed.append(f"{comm.name}: {type(e).__name__}: {e}")
        rt.communicators.clear()
    if w.device.type == "cuda":
        w.release()
    return failed
