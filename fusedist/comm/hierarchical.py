"""Two-level collectives over the nodes: inside each node, then across.

    hc = HierarchicalCommunicator()            # the world: intra-node x inter-node groups
    y = hc.all_reduce(x)                       # flat or two-level, chosen by the cost model
    y = hc.all_reduce(x, algo="hierarchical", chunks=4)
    g = hc.all_gather(x)                       # (world * x.numel(),) in global rank order
    r = hc.reduce_scatter(x)                   # this rank's x.numel() // world elements

all_reduce, two-level: a reduce-scatter inside each node (each local rank owns 1/G of a
chunk), an all-reduce of that shard across the nodes (G inter-node groups at once, one per
local rank: each carries 1/G of the bytes over its own NIC), an all-gather inside the node.
The buffer is cut into `chunks` chunks and the levels are pipelined: chunk i's inter-node
all-reduce runs while chunk i+1's reduce-scatter does (the levels are different process
groups, so their collectives run concurrently: separate NCCL streams on GPUs, separate gloo
threads on CPUs). all_gather: across (each local rank with its counterparts on the other
nodes), then inside, then a permutation into global rank order. reduce_scatter: the input permuted so each local
rank's segments are contiguous, a reduce-scatter inside, then across.

Every collective runs through torch.distributed on the runtime's intra_node and inter_node
groups (NCCL on GPUs, gloo on CPUs). Sums accumulate in ``accum_dtype`` (float32 by default)
and are rounded once to the input dtype. Every element's sum is formed on one rank (the
owner of its shard) and then copied, so the result is bitwise identical on every rank.

algo="auto" takes the faster of flat and two-level by fusedist.comm.cost_model for this size
and machine (the link file: `machine=`, default "h200" on GPUs and "cpu" on CPUs), with the
chunk count the model picks. The choice depends only on the size and the machine file,
which every rank must share (checked at construction).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ..distributed.groups import Group
from ..distributed.runtime import get_runtime
from . import cost_model
from ._args import check_input, peers_guard

ALGOS = ("auto", "flat", "hierarchical")
# torch >= 2.13 names it reduce_scatter_single (reduce_scatter_tensor warns there); older
# torch has only reduce_scatter_tensor. Same arguments.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
MAX_CHUNKS = 64


class HierarchicalCommunicator:
    """Flat and two-level all-reduce, all-gather and reduce-scatter over every rank of the
    runtime (the world), split into its intra-node and inter-node groups.

    Needs the same number of ranks on every node (else ValueError). A collective whose peer
    is lost raises PeerLostError naming it (where it runs on this host). machine: a link file
    name or path for the cost model (see fusedist/comm/links/). accum_dtype: the dtype the
    sums are formed in (torch.float32; pass the input dtype to reduce in it)."""

    def __init__(self, *, machine: Optional[str] = None,
                 accum_dtype: torch.dtype = torch.float32):
        rt = get_runtime()
        topo = rt.topology
        if not topo.uniform:
            counts = [len(topo.ranks_on_node(n)) for n in range(topo.num_nodes)]
            raise ValueError(f"fusedist.HierarchicalCommunicator: nodes hold different numbers "
                             f"of ranks {counts}; launch the same number of ranks per node")
        if accum_dtype not in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
            raise TypeError(f"fusedist.HierarchicalCommunicator: accum_dtype must be a float "
                            f"dtype, got {accum_dtype}")
        self.world: Group = rt.world
        self.intra: Group = rt.intra_node
        self.inter: Optional[Group] = rt.inter_node
        self.device = rt.device
        self.nodes = topo.num_nodes
        self.gpus = topo.ranks_per_node
        self.accum_dtype = accum_dtype
        self.machine_name = machine or ("h200" if self.device.type == "cuda" else "cpu")
        self.machine = cost_model.Machine.load(self.machine_name)
        # rank_at[j][i]: the global rank of local index i on node j. The inter-node group of
        # local index i lists node 0's rank first (groups.build_rank_lists).
        self.rank_at = [topo.ranks_on_node(j) for j in range(self.nodes)]
        self.world.check_same({"machine": self.machine_name, "accum": str(accum_dtype)},
                              where="fusedist.HierarchicalCommunicator", what="settings",
                              fix="pass the same machine= and accum_dtype= on every rank")

    # ---- the collectives -----------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor, *, algo: str = "auto", chunks: Optional[int] = None,
                   out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The sum of x over every rank, in x's shape and dtype (out=x for in place)."""
        with peers_guard("fusedist.HierarchicalCommunicator.all_reduce", self.world):
            return self._all_reduce(x, algo=algo, chunks=chunks, out=out)

    def all_gather(self, x: torch.Tensor, *, algo: str = "auto", chunks: Optional[int] = None,
                   out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Every rank's x, flattened and concatenated in global rank order:
        (world * x.numel(),)."""
        with peers_guard("fusedist.HierarchicalCommunicator.all_gather", self.world):
            return self._all_gather(x, algo=algo, chunks=chunks, out=out)

    def reduce_scatter(self, x: torch.Tensor, *, algo: str = "auto",
                       chunks: Optional[int] = None,
                       out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The sum over every rank of segment `rank` of x (x.numel() a multiple of the world
        size): (x.numel() // world,) on each rank."""
        with peers_guard("fusedist.HierarchicalCommunicator.reduce_scatter", self.world):
            return self._reduce_scatter(x, algo=algo, chunks=chunks, out=out)

    # ---- choice ----------------------------------------------------------------------------
    def choose(self, op: str, nbytes: int, algo: str = "auto",
               chunks: Optional[int] = None) -> tuple[str, int]:
        """(algorithm, chunks) this call runs: 'flat' or 'hierarchical'."""
        if algo not in ALGOS:
            raise ValueError(f"fusedist.{op}: algo must be one of {ALGOS}, got {algo!r}")
        if chunks is not None and (not isinstance(chunks, int) or isinstance(chunks, bool)
                                   or not 1 <= chunks <= MAX_CHUNKS):
            raise ValueError(f"fusedist.{op}: chunks must be an int in 1..{MAX_CHUNKS}, got "
                             f"{chunks!r}")
        two_level = self.nodes > 1 and self.gpus > 1
        if algo == "flat" or not two_level:
            return "flat", 1
        if algo == "hierarchical":
            if chunks is None:
                chunks = cost_model.best_hierarchical(self.machine, op, self.nodes, self.gpus,
                                                      nbytes)[1]
            return "hierarchical", chunks
        t_flat = cost_model.flat(self.machine, op, self.nodes, self.gpus, nbytes)
        if chunks is None:
            t_h, chunks = cost_model.best_hierarchical(self.machine, op, self.nodes, self.gpus,
                                                       nbytes)
        else:
            t_h = cost_model.hierarchical(self.machine, op, self.nodes, self.gpus, nbytes, chunks)
        return ("hierarchical", chunks) if t_h < t_flat else ("flat", 1)

    # ---- validation --------------------------------------------------------------------------
    def _check(self, op: str, x, out, out_numel: int) -> torch.Tensor:
        check_input(op, x, self.device)
        if out is None:
            return torch.empty(out_numel, dtype=x.dtype, device=x.device)
        if not isinstance(out, torch.Tensor) or out.dtype != x.dtype or \
                out.numel() != out_numel or not out.is_contiguous() or out.device != x.device:
            raise ValueError(f"fusedist.{op}: out must be a contiguous {x.dtype} tensor of "
                             f"{out_numel} elements on {x.device}; allocate it with "
                             f"torch.empty({out_numel}, dtype={x.dtype})")
        return out

    # ---- all-reduce --------------------------------------------------------------------------
    def _all_reduce(self, x: torch.Tensor, *, algo: str = "auto", chunks: Optional[int] = None,
                    out: Optional[torch.Tensor] = None) -> torch.Tensor:
        res = self._check("all_reduce", x, out, x.numel())
        how, k = self.choose("all_reduce", x.numel() * x.element_size(), algo, chunks)
        acc = x.reshape(-1).to(self.accum_dtype, copy=True)
        if how == "flat":
            if self.world.size > 1:
                dist.all_reduce(acc, group=self.world.pg)
            res.view(-1).copy_(acc)
            return out if out is not None else res.view_as(x)
        n, g = acc.numel(), self.gpus
        c = -(-max(-(-n // k), 1) // g) * g          # chunk elements: a multiple of G
        k = -(-n // c)
        buf = torch.zeros(k * c, dtype=self.accum_dtype, device=acc.device)
        buf[:n] = acc
        shards = torch.empty(k, c // g, dtype=self.accum_dtype, device=acc.device)
        chunk = [buf[i * c:(i + 1) * c] for i in range(k)]
        rs, ar, ag = {}, {}, []
        # A three-stage pipeline: at step s chunk s is reduce-scattered inside the node, chunk
        # s - 1 all-reduced across nodes, chunk s - 2 all-gathered inside.
        for s in range(k + 2):
            if s < k:
                rs[s] = _reduce_scatter(shards[s], chunk[s], group=self.intra.pg,
                                                   async_op=True)
            if 0 <= s - 1 < k:
                rs.pop(s - 1).wait()
                ar[s - 1] = dist.all_reduce(shards[s - 1], group=self.inter.pg, async_op=True)
            if 0 <= s - 2 < k:
                ar.pop(s - 2).wait()
                ag.append(dist.all_gather_into_tensor(chunk[s - 2], shards[s - 2],
                                                      group=self.intra.pg, async_op=True))
        for w in ag:
            w.wait()
        res.view(-1).copy_(buf[:n])
        return out if out is not None else res.view_as(x)

    # ---- all-gather --------------------------------------------------------------------------
    def _all_gather(self, x: torch.Tensor, *, algo: str = "auto", chunks: Optional[int] = None,
                    out: Optional[torch.Tensor] = None) -> torch.Tensor:
        n, world = x.numel(), self.world.size
        res = self._check("all_gather", x, out, world * n).view(-1)
        how, k = self.choose("all_gather", world * n * x.element_size(), algo, chunks)
        flat_x = x.reshape(-1)
        if how == "flat" or n == 0:
            dist.all_gather_into_tensor(res, flat_x, group=self.world.pg)
            return res
        N, G = self.nodes, self.gpus
        k = max(1, min(k, n))
        bounds = [n * i // k for i in range(k + 1)]
        across, inside = [], []
        res_v = res.view(world, n)
        # Across first: each local rank gathers its counterparts' pieces (every byte crosses
        # the network once: N - 1 pieces per rank, the G inter-node groups at once), then
        # inside the node. Gathering inside first would send each node's block over every
        # local rank's link: G times the bytes.
        for i in range(k):
            lo, hi = bounds[i], bounds[i + 1]
            b1 = torch.empty(N * (hi - lo), dtype=x.dtype, device=x.device)
            across.append((b1, dist.all_gather_into_tensor(b1, flat_x[lo:hi].contiguous(),
                                                           group=self.inter.pg, async_op=True)))
        for i, (b1, w) in enumerate(across):
            w.wait()
            b2 = torch.empty(G * b1.numel(), dtype=x.dtype, device=x.device)
            inside.append((b2, dist.all_gather_into_tensor(b2, b1, group=self.intra.pg,
                                                           async_op=True)))
        index = self._rank_index(x.device).view(N, G).t().reshape(-1)
        for i, (b2, w) in enumerate(inside):
            w.wait()
            lo, hi = bounds[i], bounds[i + 1]
            # row l * N + j: local index l, node j -> global rank rank_at[j][l]
            res_v[:, lo:hi].index_copy_(0, index, b2.view(G * N, hi - lo))
        return res

    def _rank_index(self, device) -> torch.Tensor:
        return torch.tensor([self.rank_at[j][i] for j in range(self.nodes)
                             for i in range(self.gpus)], dtype=torch.long, device=device)

    # ---- reduce-scatter ----------------------------------------------------------------------
    def _reduce_scatter(self, x: torch.Tensor, *, algo: str = "auto",
                        chunks: Optional[int] = None,
                        out: Optional[torch.Tensor] = None) -> torch.Tensor:
        world = self.world.size
        if isinstance(x, torch.Tensor) and x.numel() % world:
            raise ValueError(f"fusedist.reduce_scatter: x has {x.numel()} elements, not a "
                             f"multiple of the world size {world}; pad it to "
                             f"{-(-x.numel() // world) * world}")
        n = x.numel() // world if isinstance(x, torch.Tensor) else 0
        res = self._check("reduce_scatter", x, out, n)
        how, k = self.choose("reduce_scatter", x.numel() * x.element_size(), algo, chunks)
        acc = x.reshape(world, n).to(self.accum_dtype, copy=True)
        mine = torch.empty(n, dtype=self.accum_dtype, device=x.device)
        if how == "flat" or n == 0:
            _reduce_scatter(mine, acc.view(-1), group=self.world.pg)
            return res.copy_(mine)
        N, G = self.nodes, self.gpus
        # Segments reordered local index major: [l][j] holds rank rank_at[j][l]'s segment, so
        # the inside reduce-scatter leaves local index l the node's sums of its N segments.
        perm = acc.index_select(0, self._rank_index(x.device).view(N, G).t().reshape(-1))
        k = max(1, min(k, n))
        bounds = [n * i // k for i in range(k + 1)]
        inside, across = [], []
        pv = perm.view(G, N, n)
        for i in range(k):
            lo, hi = bounds[i], bounds[i + 1]
            src = pv[:, :, lo:hi].contiguous().view(-1)
            part = torch.empty(N * (hi - lo), dtype=self.accum_dtype, device=x.device)
            inside.append((part, _reduce_scatter(part, src, group=self.intra.pg,
                                                            async_op=True)))
        for i, (part, w) in enumerate(inside):
            w.wait()
            lo, hi = bounds[i], bounds[i + 1]
            across.append(_reduce_scatter(mine[lo:hi], part, group=self.inter.pg,
                                                     async_op=True))
        for w in across:
            w.wait()
        return res.copy_(mine)
