"""Process groups fusedist works on: world, tensor-parallel, data-parallel, intra-node and
inter-node. A :class:`Group` wraps a torch ProcessGroup with the facts ops need (global
ranks, this rank's index, device, whether all members share a node). Users may wrap an
existing torch ProcessGroup with :meth:`Group.from_process_group` to embed fusedist in an
inference engine that already owns its groups."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Optional, Sequence

import torch
import torch.distributed as dist

from .topology import Topology


@dataclass(eq=False)
class Group:
    name: str                       # identical on every member; keys torch.library ops
    ranks: tuple[int, ...]          # global ranks, in group-rank order
    pg: Optional[dist.ProcessGroup]  # None on ranks outside the group
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

    def all_gather_object(self, obj) -> list:
        """Gather a picklable object from every member (host-side control plane)."""
        if self.size == 1:
            return [obj]
        out: list = [None] * self.size
        dist.all_gather_object(out, obj, group=self.pg)
        return out

    def barrier(self) -> None:
        if self.size > 1:
            self.all_gather_object(None)

    @classmethod
    def from_process_group(cls, pg: dist.ProcessGroup, name: Optional[str] = None,
                           device: Optional[torch.device] = None,
                           topology: Optional[Topology] = None) -> "Group":
        if not isinstance(pg, dist.ProcessGroup):
            raise TypeError(f"fusedist.Group.from_process_group: pg must be a torch.distributed "
                            f"ProcessGroup, got {type(pg).__name__}")
        ranks = tuple(dist.get_process_group_ranks(pg))
        if device is None:
            device = (torch.device("cuda", torch.cuda.current_device())
                      if dist.get_backend(pg) == "nccl" else torch.device("cpu"))
        gname = name or f"pg:{getattr(pg, 'group_name', None) or ','.join(map(str, ranks))}"
        return cls(gname, ranks, pg, device, topology)


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
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"fusedist.init: tp_size must be a positive int, got {tp_size!r}")
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
               created: Optional[list] = None) -> Optional[Group]:
    """Create one torch group per rank list (every rank calls new_group for every list, in the
    same order, as torch requires) and return the one this rank belongs to. New groups are
    appended to `created` (so shutdown() can destroy them)."""
    me = dist.get_rank()
    mine = None
    for i, ranks in enumerate(rank_lists):
        if len(ranks) == world_size:
            pg = dist.group.WORLD
        else:
            pg = dist.new_group(list(ranks))
            if created is not None:
                created.append(pg)
        if me in ranks:
            mine = Group(f"{kind}{i}", tuple(ranks), pg, device, topology)
    return mine
