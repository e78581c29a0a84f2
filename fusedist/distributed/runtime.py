"""fusedist.init / fusedist.shutdown: one runtime per process (and one per emulated rank, a
thread of fusedist.testing's that runs under its own: set_thread_runtime).

init() detects the launcher (launch_env.py), picks the local GPU before anything touches
CUDA, starts torch.distributed (nccl on GPU, gloo on CPU; under mpirun without MASTER_ADDR the
address is bootstrapped through mpi4py), gathers the topology and creates the world,
tensor-parallel, data-parallel, intra-node and inter-node groups. An engine that already
initialized torch.distributed keeps its process group: init() adopts it.

shutdown() destroys the process groups init() created and drops fusedist's references to them,
so torch frees them there and then: a gloo group's destructor joins its worker threads. Left
for the interpreter's exit, a worker thread could still hold the last collective's work and
need the GIL to free its tensors while the interpreter finalizes, which ends the process with
"terminate called without an active exception" (SIGABRT). A gloo runtime still initialized
at exit is shut down by an atexit hook for the same reason.
"""

from __future__ import annotations

import atexit
import datetime
import math
import operator
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from .. import envs
from ..errors import CollectiveMismatchError, NotInitializedError, RendezvousError
from .groups import Group, backend_device, build_rank_lists, new_groups, validate_tp_size
from .launch_env import LaunchEnv, detect_launch_env, host_address
from .peers import process_identity
from .topology import Topology

# NVLink multicast (NVLS) stays off for NCCL, torch symmetric memory and NVSHMEM: fusedist
# never uses multicast objects, and on hosts whose fabric manager does not provide multicast a
# library that tries it can hang or fault. init() sets these unless the user already did
# (setdefault: an explicit value is never overwritten); the tests apply the same values.
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1"}


@dataclass(eq=False)
class Runtime:
    env: LaunchEnv
    topology: Topology
    device: torch.device
    backend: str
    world: Group
    tp: Group
    dp: Group
    intra_node: Group
    inter_node: Optional[Group]
    owns_process_group: bool
    communicators: list = field(default_factory=list)
    adopted_groups: dict = field(default_factory=dict)  # torch ProcessGroup -> Group
    created_groups: list = field(default_factory=list)  # subgroups init() made (not WORLD)
    # every rank's process identity (peers.process_identity()), by global rank
    peers: tuple = ()
    # timeout of the groups init() created (all of them when it owns the process group), s
    timeout_s: Optional[float] = None

    @property
    def rank(self) -> int:
        return self.topology.rank

    @property
    def world_size(self) -> int:
        return self.topology.world_size


_runtime: Optional[Runtime] = None
# A thread may run under a runtime of its own instead of the process's (set_thread_runtime):
# fusedist.testing runs each emulated rank as a thread of one process this way.
_thread = threading.local()
# Called by shutdown() after the communicators are closed: the layers above (comm) register
# their per-runtime state here, so this bootstrap layer never imports them.
_shutdown_hooks: list = []


def on_shutdown(fn) -> None:
    """Register fn() to run at every shutdown(), once the communicators are closed."""
    if fn not in _shutdown_hooks:
        _shutdown_hooks.append(fn)
_generation = 0  # process groups init() created in this process; names their store keys
_atexit_registered = False


def thread_runtime() -> Optional[Runtime]:
    """The runtime the calling thread runs under instead of the process's, or None."""
    return getattr(_thread, "runtime", None)


def set_thread_runtime(rt: Optional[Runtime]) -> None:
    """Run the calling thread under `rt` instead of the process's runtime (None: back to the
    process's). fusedist.testing's emulated ranks are threads of one process, each one rank:
    get_runtime() in such a thread is its rank's (its groups, its communicators), and init()
    and shutdown() there are errors: the emulation makes and ends the rank's runtime."""
    if rt is not None and not isinstance(rt, Runtime):
        raise TypeError(f"fusedist: a thread's runtime must be a fusedist.Runtime, got "
                        f"{type(rt).__name__}")
    _thread.runtime = rt


def is_initialized() -> bool:
    return thread_runtime() is not None or _runtime is not None


def get_runtime() -> Runtime:
    rt = thread_runtime()
    if rt is not None:
        return rt
    if _runtime is None:
        raise NotInitializedError(
            "fusedist: not initialized; call fusedist.init() first (after fusedist.shutdown(), "
            "call init() again before using fusedist)")
    return _runtime


def _not_in_a_rank_thread(where: str) -> None:
    if thread_runtime() is not None:
        raise RuntimeError(f"{where}: this thread runs under a runtime of its own (an emulated "
                           "rank of fusedist.testing.run_ranks, which made that runtime and "
                           "ends it); call it outside the rank threads")


def _timeout_s(explicit: Optional[float]) -> float:
    if explicit is not None:
        return check_timeout_s("fusedist.init", explicit)
    return envs.get("FUSEDIST_INIT_TIMEOUT_S")


def check_timeout_s(where: str, value) -> float:
    """`value` as a timeout in seconds: a finite number > 0, else a ValueError naming `where`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not math.isfinite(value) or value <= 0:
        raise ValueError(f"{where}: timeout_s must be a finite number of seconds > 0, got "
                         f"{value!r}; omit it for the default")
    return float(value)


def _mpi_bootstrap_address(env: LaunchEnv) -> tuple[str, int]:
    """Under mpirun without MASTER_ADDR: rank 0 picks its host and a free port, MPI broadcasts."""
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise ValueError(
            "fusedist.init: launched by MPI without MASTER_ADDR/MASTER_PORT and mpi4py is not "
            "installed; `pip install mpi4py` or export MASTER_ADDR and MASTER_PORT") from e
    addr = port = None
    if MPI.COMM_WORLD.Get_rank() == 0:
        if env.world_size > env.local_world_size:
            # Other nodes must reach it: not the loopback address many hosts map their
            # hostname to.
            addr, how = host_address()
            if addr is None:
                port = (f"fusedist.init: launched by MPI across nodes without MASTER_ADDR, and "
                        f"rank 0's host has no address other nodes could reach ({how}); "
                        "export MASTER_ADDR=<an address of rank 0's host that every node "
                        "reaches> (and MASTER_PORT), or GLOO_SOCKET_IFNAME=<its interface>")
        else:
            addr = "127.0.0.1"
        if addr is not None:
            with socket.socket() as s:
                s.bind(("", 0))
                port = s.getsockname()[1]
    addr, port = MPI.COMM_WORLD.bcast((addr, port), root=0)
    if addr is None:              # every rank stops with rank 0's reason
        raise RendezvousError(port)
    return addr, port


def _rendezvous(addr: str, port: int, env: LaunchEnv, timeout: datetime.timedelta):
    """The TCP store of the rendezvous at addr:port, or RendezvousError within about the
    timeout (torch's own errors carry C++ frames and name no fix)."""
    try:
        store, _, _ = next(dist.rendezvous(f"tcp://{addr}:{port}", rank=env.rank,
                                           world_size=env.world_size, timeout=timeout))
        return store
    except (RuntimeError, OSError, TimeoutError) as e:  # DistError is a RuntimeError
        cause = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        role = ("listened for the other ranks" if env.rank == 0 else
                "tried to reach rank 0's rendezvous")
        raise RendezvousError(
            f"fusedist.init: rank {env.rank} of {env.world_size} {role} at {addr}:{port} for "
            f"{timeout.total_seconds():g} s and gave up ({type(e).__name__}: {cause}). Check "
            "that MASTER_ADDR / MASTER_PORT name rank 0's host and a free port reachable from "
            "every node (firewall, network interface), that every rank was started with the "
            "same world size, and raise FUSEDIST_INIT_TIMEOUT_S (or init(timeout_s=)) if "
            "nodes start slowly") from None


def _pick_device(env: LaunchEnv, backend: str, device) -> torch.device:
    if backend == "gloo" and device is None:
        return torch.device("cpu")
    if device is not None:
        dev = torch.device(device)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        return dev
    n = torch.cuda.device_count()
    if env.local_rank >= n:
        raise ValueError(
            f"fusedist.init: local rank {env.local_rank} has no GPU (this node shows {n}); "
            f"start at most {n} ranks per node or pass device=")
    dev = torch.device("cuda", env.local_rank)
    torch.cuda.set_device(dev)
    return dev


def init(*, tp_size: Optional[int] = None, tp_spans_nodes: bool = False,
         backend: Optional[str] = None, device=None, timeout_s: Optional[float] = None,
         rank: Optional[int] = None, world_size: Optional[int] = None,
         local_rank: Optional[int] = None, local_world_size: Optional[int] = None,
         master_addr: Optional[str] = None, master_port: Optional[int] = None,
         node_id: Optional[str] = None, rank_error: Optional[str] = None) -> Runtime:
    """Start fusedist in this process and return its :class:`Runtime`.

    tp_size: tensor-parallel size (default: ranks per node). backend: "nccl" or "gloo"
    (default: nccl when a GPU is visible). timeout_s bounds every bootstrap step and collective
    of the process groups (default FUSEDIST_INIT_TIMEOUT_S or 300 s). The launch arguments
    (rank=, world_size=, ...) override what the launcher's environment says. The subgroups
    init() creates (tp, dp, intra- and inter-node) take the same timeout, also with an adopted
    process group.

    Every rank must pass the same tp_size and tp_spans_nodes (else CollectiveMismatchError on
    every rank, naming each rank's values). rank_error: this rank's own reason to stop (an
    argument it refused before it could start, as a message): init still meets the other ranks
    at the rendezvous, before any process group is made, tells them, and raises
    CollectiveMismatchError on every rank naming the ranks that stopped and why, instead of
    leaving the others to wait for a rank that never comes.
    """
    global _runtime, _generation, _atexit_registered
    _not_in_a_rank_thread("fusedist.init")
    if _runtime is not None:
        raise RuntimeError("fusedist.init: already initialized; call fusedist.shutdown() first")
    if rank_error is not None and not isinstance(rank_error, str):
        raise TypeError(f"fusedist.init: rank_error must be a message (str) or None, got "
                        f"{type(rank_error).__name__}")
    envs.check_all()
    for k, v in SAFE_ENV.items():
        os.environ.setdefault(k, v)

    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"fusedist.init: backend must be 'nccl' or 'gloo', got {backend!r}")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("fusedist.init: backend='nccl' needs a CUDA GPU and none is visible; "
                         "use backend='gloo' for the CPU reference path")
    timeout = datetime.timedelta(seconds=_timeout_s(timeout_s))

    owns = not dist.is_initialized()
    if owns:
        env = detect_launch_env(rank=rank, world_size=world_size, local_rank=local_rank,
                                local_world_size=local_world_size, master_addr=master_addr,
                                master_port=master_port, node_id=node_id)
        if env.world_size == 1:
            _stop_if_any(env.world_size, [rank_error or ""])
            dev = _pick_device(env, backend, device)
            store = dist.HashStore()
            dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
        else:
            addr, port = env.master_addr, env.master_port
            if addr is None:
                addr, port = _mpi_bootstrap_address(env)
            store = _rendezvous(addr, port, env, timeout)
            store.set_timeout(timeout)
            # torchrun's agent store outlives our process group: after shutdown(), a second
            # init() would read the first group's keys (stale peer addresses) without a fresh
            # prefix. Every rank calls init() the same number of times, so prefixes agree.
            store = dist.PrefixStore(f"fusedist/{_generation}", store)
            _generation += 1
            _exchange_rank_errors(store, env, rank_error, timeout)
            dev = _pick_device(env, backend, device)
            kwargs = {}
            if backend == "nccl":
                kwargs["device_id"] = dev
            dist.init_process_group(backend, store=store, rank=env.rank,
                                    world_size=env.world_size, timeout=timeout, **kwargs)
    else:
        # Adopt the engine's process group; the launch environment only supplies node identity.
        backend = dist.get_backend()
        env = detect_launch_env(rank=dist.get_rank(), world_size=dist.get_world_size(),
                                local_rank=local_rank, local_world_size=local_world_size,
                                node_id=node_id)
        dev = backend_device(backend) if device is None else torch.device(device)

    try:
        world = dist.get_world_size()
        me = dist.get_rank()
        world_group = Group("world", tuple(range(world)), dist.group.WORLD, dev)
        facts = world_group.all_gather_object(
            (env.node_id, process_identity(), (tp_size, bool(tp_spans_nodes)),
             "" if owns else (rank_error or "")))
        _stop_if_any(world, [f[3] for f in facts])     # an adopted group's ranks: here
        node_ids = tuple(f[0] for f in facts)
        topo = Topology(world_size=world, rank=me, node_ids=node_ids)
        world_group.topology = topo

        def resolved(req):
            size, spans = req
            if size is not None and not isinstance(size, bool):
                try:
                    size = operator.index(size)     # numpy ints too; the rest: validate_tp_size
                except TypeError:
                    pass
            tp = topo.ranks_per_node if size is None else size
            return (1 if size is None and world % tp else tp), spans

        asked = [resolved(f[2]) for f in facts]
        if any(a != asked[0] for a in asked):
            from .groups import describe_differences
            raise CollectiveMismatchError(
                "fusedist.init: ranks were given different tensor-parallel settings: "
                + describe_differences(range(world), [
                    {"tp_size": str(a[0]) + (" (default: ranks per node)" if f[2][0] is None
                                             else ""), "tp_spans_nodes": str(a[1])}
                    for a, f in zip(asked, facts)])
                + ". Pass the same tp_size (and tp_spans_nodes) to fusedist.init on every rank")
        tp, _ = asked[me]
        validate_tp_size(world, tp, topo, tp_spans_nodes)
        lists = build_rank_lists(world, tp, topo)
        created: list = []
        groups = {k: new_groups(k, v, world, dev, topo, created, timeout)
                  for k, v in lists.items()}
    except BaseException:
        # Leave no half-initialized state: a process group created here would otherwise be
        # adopted (and never destroyed) by the next init().
        if owns and dist.is_initialized():
            dist.destroy_process_group()
        raise
    _runtime = Runtime(env=env, topology=topo, device=dev, backend=backend, world=world_group,
                       tp=groups["tp"], dp=groups["dp"], intra_node=groups["intra_node"],
                       inter_node=groups["inter_node"], owns_process_group=owns,
                       created_groups=created, peers=tuple(f[1] for f in facts),
                       timeout_s=timeout.total_seconds())
    if not _atexit_registered:
        atexit.register(_shutdown_at_exit)
        _atexit_registered = True
    return _runtime


def _stop_if_any(world: int, errors: list) -> None:
    """CollectiveMismatchError on every rank when some rank stopped (errors[r]: rank r's
    reason, "" when it had none)."""
    bad = [(r, e) for r, e in enumerate(errors) if e]
    if not bad:
        return
    who = "; ".join(f"rank {r}: {e}" for r, e in bad)
    ranks = ", ".join(str(r) for r, _ in bad)
    raise CollectiveMismatchError(
        f"fusedist.init: rank{'s' if len(bad) > 1 else ''} {ranks} of {world} stopped before "
        f"starting ({who}). Every rank stops here; fix that and start the job again")


def _exchange_rank_errors(store, env: LaunchEnv, rank_error: Optional[str],
                          timeout: datetime.timedelta) -> None:
    """Before the process group exists: every rank posts its own reason to stop ("" for none)
    in the rendezvous store and reads every other rank's; when any rank has one, every rank
    raises (_stop_if_any). Rank 0's store serves the others (unless torchrun's agent holds it),
    so rank 0 leaves only once every rank has read the reasons (bounded by the timeout)."""
    world = env.world_size
    store.set(f"stop/{env.rank}", rank_error or "")
    keys = [f"stop/{r}" for r in range(world)]
    try:
        store.wait(keys, timeout)
        errors = [store.get(k).decode(errors="replace") for k in keys]
    except (RuntimeError, OSError) as e:   # a peer's store went away, or one never came
        if rank_error:
            raise CollectiveMismatchError(
                f"fusedist.init: rank {env.rank} of {world} stopped before starting "
                f"({rank_error}); the other ranks could not be told ({type(e).__name__})")
        raise RendezvousError(
            f"fusedist.init: rank {env.rank} of {world} could not read the other ranks' "
            f"start-up verdicts within {timeout.total_seconds():g} s ({type(e).__name__}: "
            f"{str(e).strip()[:200]}); a rank did not reach fusedist.init") from None
    if not any(errors):
        return
    store.add("stop/read", 1)
    if env.rank == 0:
        deadline = time.monotonic() + min(timeout.total_seconds(), 30.0)
        while store.add("stop/read", 0) < world and time.monotonic() < deadline:
            time.sleep(0.01)
    _stop_if_any(world, errors)


def _shutdown_at_exit() -> None:
    """atexit: shut down a gloo runtime the program left initialized, while the interpreter is
    whole (see the module docstring). With NCCL, closing communicators is collective, so an
    exit that skipped shutdown() is left as it is."""
    rt = _runtime
    if rt is None or rt.backend != "gloo":
        return
    try:
        shutdown()
    except Exception as e:  # noqa: BLE001 - an exit hook reports, never raises
        import sys
        print(f"fusedist: shutdown at exit failed: {type(e).__name__}: {e}", file=sys.stderr,
              flush=True)


def _release_groups(rt: Runtime, destroyed) -> None:
    """Drop fusedist's references to the destroyed process groups (`destroyed`: all of them,
    or a set of torch ProcessGroups), so torch frees them now, not at interpreter exit."""
    groups = [rt.world, rt.tp, rt.dp, rt.intra_node, rt.inter_node,
              *rt.adopted_groups.values()]
    for g in groups:
        if g is not None and g.pg is not None and (destroyed is all or g.pg in destroyed):
            g.pg = None
    rt.created_groups.clear()


def shutdown() -> None:
    """Free every communicator (symmetric buffers, IPC mappings, NCCL comms) and, if init()
    created it, destroy the process group (with an adopted one, the subgroups init() made).
    The destroyed groups are released: their fusedist Groups' pg becomes None, and torch frees
    them (a gloo group joins its threads) before this returns unless the program holds them.
    Safe to call twice."""
    global _runtime
    _not_in_a_rank_thread("fusedist.shutdown")
    rt = _runtime
    if rt is None:
        return
    try:
        for comm in reversed(list(rt.communicators)):
            comm.close()
        rt.communicators.clear()
    finally:
        _runtime = None
        for hook in _shutdown_hooks:
            hook()
        if rt.owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
            _release_groups(rt, all)
        elif dist.is_initialized():
            # Adopted an engine's process group: leave it, but remove the subgroups fusedist
            # made, so repeated init()/shutdown() cycles do not pile them up in the engine.
            made = set(rt.created_groups)
            for pg in rt.created_groups:
                dist.destroy_process_group(pg)
            _release_groups(rt, made)
