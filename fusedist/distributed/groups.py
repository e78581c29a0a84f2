"""Process groups fusedist works on: world, tensor-parallel, data-parallel, intra-node and
inter-node. A :class:`Group` wraps a torch ProcessGroup with the facts ops need (global
ranks, this rank's index, device, whether all members share a node). Users may wrap an
existing torch ProcessGroup with :meth:`Group.from_process_group` to embed fusedist in an
inference engine that already owns its groups."""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from .._check import as_int
from ..errors import CollectiveMismatchError, NotInitializedError
from .topology import Topology


@dataclass(eq=False)
class Group:
    name: str                       # identical on every member; keys torch.library ops
    ranks: tuple[int, ...]          # global ranks, in group-rank order
    pg: Optional[dist.ProcessGroup]  # None on ranks outside the group, and once shutdown()
    #                                  destroyed and released it
    device: torch.device
    topology: Optional[Topology] = None
    _communicator: Any = field(default=None, repr=False)
    # How the members reach each other, when not as separate processes with a GPU each: a
    # Group subclass whose members live otherwise names its own transports here, classes
    # called as the defaults are (None: comm.symmetric.SymmetricMemory, peers' buffers mapped
    # through CUDA IPC; comm.nccl.NcclComm). fusedist.testing's emulated groups, threads of one
    # process on one GPU, do.
    symmetric_memory_class: ClassVar[Optional[Callable]] = None
    nccl_class: ClassVar[Optional[Callable]] = None

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def rank(self) -> int:
        """This process's index in the group (-1 if it is not a member)."""
        me = dist.get_rank() if dist.is_initialized() else 0
        return self.ranks.index(me) if me in self.ranks else -1

    @property
    def is_member(self) -> bool:
        return self.rank >= 0

    @property
    def backend(self) -> str:
        return dist.get_backend(self.pg) if self.pg is not None else "none"

    @property
    def single_node(self) -> bool:
        return self.topology is None or self.topology.same_node(self.ranks)

    def _live_pg(self, where: str) -> dist.ProcessGroup:
        if self.pg is None:
            raise NotInitializedError(
                f"fusedist: {where}: group {self.name} has no process group (fusedist.shutdown() "
                "released it); after fusedist.init(), build what used it again")
        return self.pg

    def all_gather_object(self, obj) -> list:
        """Gather a picklable object from every member (host-side control plane)."""
        if self.size == 1:
            return [obj]
        out: list = [None] * self.size
        dist.all_gather_object(out, obj, group=self._live_pg("all_gather_object"))
        return out

    def barrier(self) -> None:
        if self.size > 1:
            self.all_gather_object(None)

    def check_same(self, fields: Mapping[str, str], *, where: str, what: str, fix: str,
                   exact=None, error: type = CollectiveMismatchError) -> None:
        """Collective: raise `error` on every member unless every member passed equal `fields`
        (field name -> the value as shown in the message) and `exact` (any repr-able value the
        fields abbreviate, e.g. long id lists). One all-gather of a 16-byte digest (on the
        group's device, so it runs on gloo and NCCL); the fields are gathered only when the
        digests differ. The message names each differing field and every rank's value."""
        if self.size == 1:
            return
        blob = repr((sorted(fields.items()), exact)).encode()
        words = struct.unpack("<2q", hashlib.blake2b(blob, digest_size=16).digest())
        mine = torch.tensor(words, dtype=torch.int64, device=self.device)
        every = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(every, mine, group=self._live_pg(where))
        if all(torch.equal(d, every[0]) for d in every):
            return
        raise error(f"{where}: ranks of group {self.name} were given different {what}: "
                    f"{describe_differences(self.ranks, self.all_gather_object(dict(fields)))}"
                    f". {fix}")

    @classmethod
    def from_process_group(cls, pg: dist.ProcessGroup, name: Optional[str] = None,
                           device: Optional[torch.device] = None,
                           topology: Optional[Topology] = None) -> "Group":
        if not isinstance(pg, dist.ProcessGroup):
            raise TypeError(f"fusedist.Group.from_process_group: pg must be a torch.distributed "
                            f"ProcessGroup, got {type(pg).__name__}")
        ranks = tuple(dist.get_process_group_ranks(pg))
        if device is None:
            device = backend_device(dist.get_backend(pg))
        gname = name or f"pg:{getattr(pg, 'group_name', None) or ','.join(map(str, ranks))}"
        return cls(gname, ranks, pg, device, topology)


def backend_device(backend: str) -> torch.device:
    """The device a process group of torch backend string `backend` works on: this rank's
    GPU for "nccl", for "fusedist" (fusedist/comm/c10d.py) and for any "cuda:..." mapping
    when a GPU is visible; the CPU otherwise."""
    cuda = backend in ("nccl", "fusedist") or "cuda:" in backend
    if cuda and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def describe_differences(ranks: Sequence[int], fields: Sequence[Mapping[str, str]]) -> str:
    """The fields whose values differ between ranks (fields[i] is global rank ranks[i]'s), each
    as "name: rank 0: a; rank 1: b" (ranks with equal values listed together). Fields that only
    some ranks have are named only when no common field differs."""
    common = [k for k in fields[0] if all(k in f for f in fields)]
    keys = [k for k in common if len({f[k] for f in fields}) > 1]
    if not keys:
        seen: dict = {}
        for f in fields:
            seen.update(dict.fromkeys(k for k in f if k not in common))
        keys = list(seen)
    if not keys:
        return "(the fields agree; what they abbreviate differs)"
    out = []
    for k in keys:
        by: dict = {}
        for r, f in zip(ranks, fields):
            by.setdefault(f.get(k, "(absent)"), []).append(r)
        out.append(f"{k}: " + "; ".join(
            f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {v}"
            for v, rs in by.items()))
    return " | ".join(out)


def build_rank_lists(world_size: int, tp_size: int, topology: Topology
                     ) -> dict[str, list[tuple[int, ...]]]:
    """Rank lists of every group kind, identical on every rank (pure; unit-tested)."""
    tp = [tuple(range(i * tp_size, (i + 1) * tp_size)) for i in range(world_size // tp_size)]
    dp = [tuple(range(j, world_size, tp_size)) for j in range(tp_size)]
    intra = [topology.ranks_on_node(n) for n in range(topology.num_nodes)]
    inter: list[tuple[int, ...]] = []
    if topology.uniform:
        for local in range(topology.ranks_per_node):
            inter.append(tuple(topology.ranks_on_node(n)[local] for n in range(topology.num_nodes)))
    return {"tp": tp, "dp": dp, "intra_node": intra, "inter_node": inter}


def validate_tp_size(world_size: int, tp_size: int, topology: Topology,
                     tp_spans_nodes: bool) -> None:
    tp_size = as_int("fusedist.init", "tp_size", tp_size, 1, what="a positive int")
    if world_size % tp_size:
        raise ValueError(
            f"fusedist.init: tp_size={tp_size} does not divide world_size={world_size}; "
            f"pick a tp_size among {[d for d in range(1, world_size + 1) if world_size % d == 0]}")
    if not tp_spans_nodes:
        for i in range(world_size // tp_size):
            ranks = range(i * tp_size, (i + 1) * tp_size)
            if not topology.same_node(ranks):
                raise ValueError(
                    f"fusedist.init: tensor-parallel group {list(ranks)} spans nodes "
                    f"{sorted({topology.node_ids[r] for r in ranks})}; tensor-parallel groups "
                    f"are consecutive ranks, so use tp_size <= {topology.ranks_per_node} (ranks "
                    "per node) with consecutive ranks on one node (mpirun --map-by slot, not "
                    "--map-by node), or pass tp_spans_nodes=True")


def new_groups(kind: str, rank_lists: Sequence[tuple[int, ...]], world_size: int,
               device: torch.device, topology: Topology,
               created: Optional[list] = None, timeout=None) -> Optional[Group]:
    """Create one torch group per rank list (every rank calls new_group for every list, in the
    same order, as torch requires) and return the one this rank belongs to. New groups are
    appended to `created` (so shutdown() can destroy them). `timeout` (a timedelta) bounds
    their collectives; None leaves torch's default (30 minutes for gloo)."""
    me = dist.get_rank()
    mine = None
    for i, ranks in enumerate(rank_lists):
        if len(ranks) == world_size:
            pg = dist.group.WORLD
        else:
            pg = dist.new_group(list(ranks), timeout=timeout)
            if created is not None:
                created.append(pg)
        if me in ranks:
            mine = Group(f"{kind}{i}", tuple(ranks), pg, device, topology)
    return mine
