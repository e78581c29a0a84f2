"""Two-level collectives over the nodes: inside each node, then across.

    hc = HierarchicalCommunicator()            # the world: intra-node x inter-node groups
    y = hc.all_reduce(x)                       # flat or two-level, chosen by the cost model
    y = hc.all_reduce(x, algo="hierarchical", chunks=4)
    g = hc.all_gather(x)                       # (size * x.numel(),) in group rank order
    r = hc.reduce_scatter(x)                   # this rank's x.numel() // size elements
    hc = HierarchicalCommunicator(tp_group, algo="hierarchical")  # a group's, calls' defaults

all_reduce, two-level: a reduce-scatter inside each node (each local rank owns 1/G of a
chunk), an all-reduce of that shard across the nodes (G inter-node groups at once, one per
local rank: each carries 1/G of the bytes over its own NIC), an all-gather inside the node.
The buffer is cut into `chunks` chunks and the levels are pipelined: chunk i's inter-node
all-reduce runs while chunk i+1's reduce-scatter does (the levels are different process
groups, so their collectives run concurrently: separate NCCL streams on GPUs, separate gloo
threads on CPUs). all_gather: across (each local rank with its counterparts on the other
nodes), then inside, then a permutation into group rank order. reduce_scatter: the input
permuted so each local rank's segments are contiguous, a reduce-scatter inside, then across.

The fused ops' two-level forms (fusedist.ops: all_reduce_add_rmsnorm, gemm_ar, gemm_rs,
ag_gemm) run on the same pipelines with hooks: all_reduce_pipelined (a producer fills chunk s,
a GEMM's rows, before its reduce-scatter; a consumer takes chunk s once gathered),
reduce_scatter_pipelined (a producer per chunk) and all_gather_stages (the pieces as each
level delivers them). of_group(group) is the two-level communicator the ops pick for a group
that spans nodes; resolve(group=) gives an op its communicator and that one.

Every collective runs through torch.distributed on intra-node and inter-node groups (NCCL on
GPUs, gloo on CPUs): the runtime's for the world, for another group the pieces of it on each
node and across (created on first use by the group's members, once per rank list). Sums
accumulate in ``accum_dtype`` (float32 by default) and are rounded once to the input dtype.
Every element's sum is formed on one rank (the owner of its shard) and then copied, so the
result is bitwise identical on every rank.

algo="auto" takes the faster of flat and two-level by fusedist.comm.cost_model for this size
and machine (the link file: `machine=`, default "h200" on GPUs and "cpu" on CPUs), with the
chunk count the model picks. The choice depends only on the size and the machine file,
which every rank must share (checked at construction).
"""

from __future__ import annotations

import datetime
import weakref
from typing import Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from ..distributed import runtime as _runtime
from ..distributed.groups import Group
from ..distributed.runtime import get_runtime
from . import cost_model
from .._check import as_int
from ..errors import CollectiveMismatchError
from ._args import check_input, peers_guard
from .communicator import Communicator, get_communicator, resolve_group

ALGOS = ("auto", "flat", "hierarchical")
# torch >= 2.13 names them reduce_scatter_single and all_gather_single (the *_tensor names warn
# there); older torch has only reduce_scatter_tensor / all_gather_into_tensor. Same arguments.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
MAX_CHUNKS = 64


def _pieces(group: Group, topo) -> list:
    """The group's ranks by node: group rank tuples, nodes in the order of their first group
    rank (one piece without a topology)."""
    if topo is None:
        return [tuple(range(group.size))]
    nodes: dict = {}
    for i, r in enumerate(group.ranks):
        nodes.setdefault(topo.node_ids[r], []).append(i)
    return [tuple(v) for v in nodes.values()]


def _order_why_not(group: Group, pieces: list) -> str:
    """Why the levels' process groups would not list the pieces in this order ("" when they
    do): torch orders a process group's ranks by global rank, so group ranks must rise with
    global rank and, for every local index, with the node."""
    if list(group.ranks) != sorted(group.ranks):
        return f"group {group.name}'s ranks {list(group.ranks)} are not in ascending order"
    for i in range(len(pieces[0])):
        across = [group.ranks[p[i]] for p in pieces]
        if across != sorted(across):
            return (f"group {group.name}'s nodes interleave their ranks ({across} for local "
                    f"index {i}); place each node's ranks in the same order")
    return ""


def layout(group: Group, topo=None) -> tuple[Optional[list], str]:
    """(rank_at, "") when `group` has two levels, else (None, why not). rank_at[j][i] is the
    group rank of local index i on node j, nodes in the order of their first group rank: two
    or more nodes, the same number (two or more) of the group's ranks on each. From the
    topology gathered at init (`topo`, default the group's): the same answer on every rank."""
    topo = topo or group.topology
    if topo is None:
        return None, f"group {group.name} has no topology (nodes unknown)"
    pieces = _pieces(group, topo)
    counts = [len(p) for p in pieces]
    if len(pieces) < 2:
        return None, f"group {group.name} is on one node"
    if len(set(counts)) > 1:
        return None, (f"the nodes hold different numbers of group {group.name}'s ranks "
                      f"{counts}")
    if counts[0] < 2:
        return None, f"group {group.name} has one rank per node"
    why = _order_why_not(group, pieces)
    return (None, why) if why else (pieces, "")


# Sub-groups made for groups other than the world, by global rank list (one process group per
# list and runtime: torch names groups made with local synchronization by their ranks).
_SUBGROUPS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # Runtime -> {ranks: Group}
_TWO_LEVEL: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # Group -> hc or False


def _release() -> None:
    """At shutdown: drop the sub-groups' process groups (the runtime destroys them) and the
    cached communicators, so torch frees them now (a gloo group joins its threads)."""
    for subs in list(_SUBGROUPS.values()):
        for g in subs.values():
            g.pg = None
    _SUBGROUPS.clear()
    _TWO_LEVEL.clear()


_runtime.on_shutdown(_release)


def _subgroup(rt, name: str, ranks: tuple, device: torch.device) -> Group:
    """The Group of global `ranks`, this rank among them: made on first use by its members
    alone (use_local_synchronization: the other ranks need not take part), then cached."""
    subs = _SUBGROUPS.setdefault(rt, {})
    g = subs.get(ranks)
    if g is None:
        timeout = datetime.timedelta(seconds=rt.timeout_s) if rt.timeout_s else None
        pg = dist.new_group(list(ranks), timeout=timeout, use_local_synchronization=True)
        rt.created_groups.append(pg)   # destroyed by shutdown() with the runtime's own
        g = subs[ranks] = Group(name, ranks, pg, device, rt.topology)
    return g


class HierarchicalCommunicator:
    """Flat and two-level all-reduce, all-gather and reduce-scatter over a group (every rank of
    the runtime by default), split into its intra-node and inter-node groups.

    Needs the same number of the group's ranks on every node (else ValueError). A collective
    whose peer is lost raises PeerLostError naming it (where it runs on this host). machine:
    a link file name or path for the cost model (see fusedist/comm/links/). accum_dtype: the
    dtype the sums are formed in (torch.float32; pass the input dtype to reduce in it). algo,
    chunks: what calls that do not pass their own take (and the fused ops, which take this
    object as group=). Collective over the group's ranks."""

    def __init__(self, group=None, *, machine: Optional[str] = None,
                 accum_dtype: torch.dtype = torch.float32, algo: str = "auto",
                 chunks: Optional[int] = None):
        rt = get_runtime()
        g = rt.world if group is None else resolve_group(group)
        if not g.is_member:
            raise ValueError(f"fusedist.HierarchicalCommunicator: this rank is not in group "
                             f"{g.name} {list(g.ranks)}")
        if g.pg is None and g.size > 1:
            raise ValueError(f"fusedist.HierarchicalCommunicator: group {g.name} has no "
                             "torch.distributed process group (emulated ranks, or after "
                             "fusedist.shutdown()); its collectives run on one")
        topo = g.topology or (rt.topology if set(g.ranks) <= set(range(rt.world_size))
                              else None)
        rank_at = _pieces(g, topo)
        counts = [len(p) for p in rank_at]
        if len(set(counts)) > 1:
            raise ValueError(f"fusedist.HierarchicalCommunicator: nodes hold different numbers "
                             f"of ranks {counts} of group {g.name}; launch the same number of "
                             "ranks per node")
        why = _order_why_not(g, rank_at) if len(rank_at) > 1 and counts[0] > 1 else ""
        if why:
            raise ValueError(f"fusedist.HierarchicalCommunicator: {why}")
        if accum_dtype not in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
            raise TypeError(f"fusedist.HierarchicalCommunicator: accum_dtype must be a float "
                            f"dtype, got {accum_dtype}")
        self.world: Group = g          # the group (the runtime's world by default)
        self.group: Group = g
        self.device = g.device
        self.nodes = len(rank_at)
        self.gpus = len(rank_at[0])
        self.accum_dtype = accum_dtype
        # rank_at[j][i]: the group rank of local index i on node j.
        self.rank_at = rank_at
        self.machine_name = machine or ("h200" if self.device.type == "cuda" else "cpu")
        self.machine = cost_model.Machine.load(self.machine_name)
        self.algo, self.chunks = self._check_choice("HierarchicalCommunicator", algo, chunks)
        self.intra, self.inter = self._levels(rt, g)
        self.world.check_same({"machine": self.machine_name, "accum": str(accum_dtype),
                               "algo": algo, "chunks": str(chunks)},
                              where="fusedist.HierarchicalCommunicator", what="settings",
                              fix="pass the same machine=, accum_dtype=, algo= and chunks= on "
                                  "every rank")

    def _levels(self, rt, g: Group) -> tuple[Group, Optional[Group]]:
        """(intra, inter): this rank's node piece of the group and its counterparts across."""
        if g.ranks == tuple(range(rt.world_size)):
            return rt.intra_node, rt.inter_node
        if not self.two_level:
            return g, None
        me = g.rank
        j, i = next((j, node.index(me)) for j, node in enumerate(self.rank_at) if me in node)
        intra = tuple(g.ranks[r] for r in self.rank_at[j])
        inter = tuple(g.ranks[node[i]] for node in self.rank_at)
        return (rt.intra_node if intra == rt.intra_node.ranks else
                _subgroup(rt, f"{g.name}.intra{j}", intra, g.device),
                rt.inter_node if rt.inter_node is not None and inter == rt.inter_node.ranks
                else _subgroup(rt, f"{g.name}.inter{i}", inter, g.device))

    # ---- the collectives -----------------------------------------------------------------
    # Every rank must make the same call. check compares the calls first (one all-gather of a
    # 16-byte digest, Group.check_same), so ranks that pass another size, dtype, collective,
    # algo or chunks all raise CollectiveMismatchError naming each rank's call, and a rank
    # whose own arguments are wrong raises its error while the others raise the mismatch
    # (gloo would abort the process on a size mismatch, and sum misread bytes on a dtype
    # mismatch). check=None (default): on CPU groups, where it is host work like the rest;
    # on GPUs it would synchronize each call (and cannot run in a CUDA-graph capture), so it
    # runs there with check=True. check=False skips it.
    def all_reduce(self, x: torch.Tensor, *, algo: Optional[str] = None,
                   chunks: Optional[int] = None, out: Optional[torch.Tensor] = None,
                   check: Optional[bool] = None) -> torch.Tensor:
        """The sum of x over every rank, in x's shape and dtype (out=x for in place)."""
        where = "fusedist.HierarchicalCommunicator.all_reduce"
        with peers_guard(where, self.world):
            self._check_call(check, "all_reduce", x, algo, chunks, out,
                             lambda: self._check("all_reduce", x, out, x.numel(), False))
            return self._all_reduce(x, algo=algo, chunks=chunks, out=out)

    def all_gather(self, x: torch.Tensor, *, algo: Optional[str] = None,
                   chunks: Optional[int] = None, out: Optional[torch.Tensor] = None,
                   check: Optional[bool] = None) -> torch.Tensor:
        """Every rank's x, flattened and concatenated in group rank order:
        (size * x.numel(),)."""
        where = "fusedist.HierarchicalCommunicator.all_gather"
        with peers_guard(where, self.world):
            self._check_call(check, "all_gather", x, algo, chunks, out,
                             lambda: self._check("all_gather", x, out,
                                                 self.world.size * x.numel(), False))
            return self._all_gather(x, algo=algo, chunks=chunks, out=out)

    def reduce_scatter(self, x: torch.Tensor, *, algo: Optional[str] = None,
                       chunks: Optional[int] = None, out: Optional[torch.Tensor] = None,
                       check: Optional[bool] = None) -> torch.Tensor:
        """The sum over every rank of segment `rank` of x (x.numel() a multiple of the group
        size): (x.numel() // size,) on each rank."""
        where = "fusedist.HierarchicalCommunicator.reduce_scatter"
        with peers_guard(where, self.world):
            self._check_call(check, "reduce_scatter", x, algo, chunks, out,
                             lambda: self._check_reduce_scatter(x, out))
            return self._reduce_scatter(x, algo=algo, chunks=chunks, out=out)

    def _check_call(self, check: Optional[bool], op: str, x, algo, chunks, out, local) -> None:
        """Every rank's call compared (check, above): local() runs this rank's argument checks
        first; a rank whose checks fail raises its own error, the others
        CollectiveMismatchError naming it."""
        if check is None:
            check = self.device.type == "cpu"
        if not check or self.world.size == 1:
            return
        try:
            local()
            self._check_choice(op, self.algo if algo is None else algo,
                               self.chunks if chunks is None else chunks)
            fields = {"call": op, "numel": str(x.numel()), "dtype": str(x.dtype),
                      "algo": repr(algo), "chunks": repr(chunks),
                      "out": "given" if out is not None else "none"}
            bad = None
        except (ValueError, TypeError) as e:
            bad, fields = e, {"call": f"{op} (invalid: {type(e).__name__}: {e})"}
        try:
            self.world.check_same(fields, where=f"fusedist.HierarchicalCommunicator.{op}",
                                  what="calls",
                                  fix="every rank must make the same call (same collective, "
                                      "size, dtype, algo and chunks)")
        except CollectiveMismatchError as e:
            if bad is not None:
                raise bad from e
            raise
        if bad is not None:
            raise bad

    def _check_reduce_scatter(self, x, out) -> None:
        world = self.world.size
        if isinstance(x, torch.Tensor) and x.numel() % world:
            raise ValueError(f"fusedist.reduce_scatter: x has {x.numel()} elements, not a "
                             f"multiple of the group size {world}; pad it to "
                             f"{-(-x.numel() // world) * world}")
        n = x.numel() // world if isinstance(x, torch.Tensor) else 0
        self._check("reduce_scatter", x, out, n, False)

    # ---- choice ----------------------------------------------------------------------------
    @staticmethod
    def _check_choice(op: str, algo, chunks) -> tuple:
        if algo not in ALGOS:
            raise ValueError(f"fusedist.{op}: algo must be one of {ALGOS}, got {algo!r}")
        if chunks is not None:
            chunks = as_int(f"fusedist.{op}", "chunks", chunks, 1, MAX_CHUNKS,
                            what=f"an int in 1..{MAX_CHUNKS}")
        return algo, chunks

    @property
    def two_level(self) -> bool:
        return self.nodes > 1 and self.gpus > 1

    def choose(self, op: str, nbytes: int, algo: Optional[str] = None,
               chunks: Optional[int] = None) -> tuple[str, int]:
        """(algorithm, chunks) this call runs: 'flat' or 'hierarchical'. algo and chunks
        default to the object's (construction) values."""
        algo = self.algo if algo is None else algo
        chunks = self.chunks if chunks is None else chunks
        self._check_choice(op, algo, chunks)
        if algo == "flat" or not self.two_level:
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
    def _check(self, op: str, x, out, out_numel: int, alloc: bool = True) -> torch.Tensor:
        check_input(op, x, self.device)
        if out is None:
            return torch.empty(out_numel, dtype=x.dtype, device=x.device) if alloc else None
        if not isinstance(out, torch.Tensor) or out.dtype != x.dtype or \
                out.numel() != out_numel or not out.is_contiguous() or out.device != x.device:
            raise ValueError(f"fusedist.{op}: out must be a contiguous {x.dtype} tensor of "
                             f"{out_numel} elements on {x.device}; allocate it with "
                             f"torch.empty({out_numel}, dtype={x.dtype})")
        return out

    # ---- all-reduce --------------------------------------------------------------------------
    def _all_reduce(self, x: torch.Tensor, *, algo: Optional[str] = None,
                    chunks: Optional[int] = None,
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
        self.all_reduce_pipelined([buf[i * c:(i + 1) * c] for i in range(k)])
        res.view(-1).copy_(buf[:n])
        return out if out is not None else res.view_as(x)

    def chunk_buffer(self, numel: int, device=None) -> torch.Tensor:
        """A zeroed accum_dtype buffer for `numel` elements of a chunk of
        all_reduce_pipelined, padded to a multiple of the ranks per node."""
        g = self.gpus
        return torch.zeros(-(-max(numel, 1) // g) * g, dtype=self.accum_dtype,
                           device=device or self.device)

    def all_reduce_pipelined(self, chunks: Sequence[torch.Tensor],
                             produce: Optional[Callable[[int], None]] = None,
                             consume: Optional[Callable[[int], None]] = None) -> None:
        """The two-level all-reduce of `chunks` in place: flat contiguous accum_dtype buffers,
        each a whole multiple of the ranks per node (chunk_buffer), the same sizes on every
        rank. A four-stage pipeline: at step s, produce(s) fills chunk s (a GEMM's rows) and
        it is reduce-scattered inside the node, chunk s - 1 is all-reduced across nodes,
        chunk s - 2 all-gathered inside, and chunk s - 3, complete, goes to consume(s - 3).
        So chunk s + 1 is produced while the collectives of the chunks before it run. Needs
        two levels (self.two_level)."""
        if not self.two_level:
            raise ValueError(f"fusedist.HierarchicalCommunicator: group {self.world.name} has "
                             f"one level ({self.nodes} nodes x {self.gpus} ranks)")
        k, g = len(chunks), self.gpus
        shards = [torch.empty(c.numel() // g, dtype=c.dtype, device=c.device) for c in chunks]
        rs, ar, ag = {}, {}, {}
        with peers_guard("fusedist.HierarchicalCommunicator.all_reduce", self.world):
            for s in range(k + 3):
                if s < k:
                    if produce is not None:
                        produce(s)
                    rs[s] = _reduce_scatter(shards[s], chunks[s], group=self.intra.pg,
                                            async_op=True)
                if 0 <= s - 1 < k:
                    rs.pop(s - 1).wait()
                    ar[s - 1] = dist.all_reduce(shards[s - 1], group=self.inter.pg,
                                                async_op=True)
                if 0 <= s - 2 < k:
                    ar.pop(s - 2).wait()
                    ag[s - 2] = _gather_single(chunks[s - 2], shards[s - 2],
                                                            group=self.intra.pg, async_op=True)
                if 0 <= s - 3 < k:
                    ag.pop(s - 3).wait()
                    if consume is not None:
                        consume(s - 3)

    # ---- all-gather --------------------------------------------------------------------------
    def _all_gather(self, x: torch.Tensor, *, algo: Optional[str] = None,
                    chunks: Optional[int] = None,
                    out: Optional[torch.Tensor] = None) -> torch.Tensor:
        n, world = x.numel(), self.world.size
        res = self._check("all_gather", x, out, world * n).view(-1)
        how, k = self.choose("all_gather", world * n * x.element_size(), algo, chunks)
        flat_x = x.reshape(-1)
        if how == "flat" or n == 0:
            _gather_single(res, flat_x, group=self.world.pg)
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
            across.append((b1, _gather_single(b1, flat_x[lo:hi].contiguous(),
                                                           group=self.inter.pg, async_op=True)))
        for i, (b1, w) in enumerate(across):
            w.wait()
            b2 = torch.empty(G * b1.numel(), dtype=x.dtype, device=x.device)
            inside.append((b2, _gather_single(b2, b1, group=self.intra.pg,
                                                           async_op=True)))
        index = self.local_major(x.device)
        for i, (b2, w) in enumerate(inside):
            w.wait()
            lo, hi = bounds[i], bounds[i + 1]
            # row l * N + j: local index l, node j -> group rank rank_at[j][l]
            res_v[:, lo:hi].index_copy_(0, index, b2.view(G * N, hi - lo))
        return res

    def local_major(self, device) -> torch.Tensor:
        """Group ranks local-index major: position l * N + j holds rank_at[j][l]."""
        return torch.tensor([self.rank_at[j][i] for i in range(self.gpus)
                             for j in range(self.nodes)], dtype=torch.long, device=device)

    def all_gather_stages(self, x: torch.Tensor) -> Iterator[tuple[list, torch.Tensor]]:
        """The all-gather of x (every rank the same shape) as a generator of (group ranks,
        their x's stacked: [len(ranks), *x.shape]), each yielded as soon as its level has
        delivered it while the next level's gather runs: this rank's own x first (the
        gather across nodes in flight), then its counterparts on the other nodes (the gather
        inside the node in flight), then the rest of the nodes' ranks. Flat (one level, or
        algo 'flat' by the object's choice for this size): own x, then every other rank's.
        Every rank's x appears once."""
        me, shape = self.world.rank, tuple(x.shape)
        flat_x = x.reshape(-1).contiguous()
        n = flat_x.numel()
        how, _ = self.choose("all_gather", self.world.size * n * x.element_size())
        with peers_guard("fusedist.HierarchicalCommunicator.all_gather", self.world):
            if how == "flat" or n == 0:
                every = torch.empty(self.world.size * n, dtype=x.dtype, device=x.device)
                w = _gather_single(every, flat_x, group=self.world.pg,
                                                async_op=True)
                yield [me], x[None]
                w.wait()
                rest = [r for r in range(self.world.size) if r != me]
                yield rest, every.view(self.world.size, *shape)[rest]
                return
            N, G = self.nodes, self.gpus
            j_me, l_me = next((j, node.index(me)) for j, node in enumerate(self.rank_at)
                              if me in node)
            b1 = torch.empty(N * n, dtype=x.dtype, device=x.device)
            w = _gather_single(b1, flat_x, group=self.inter.pg, async_op=True)
            yield [me], x[None]
            w.wait()
            b2 = torch.empty(G * N * n, dtype=x.dtype, device=x.device)
            w = _gather_single(b2, b1, group=self.intra.pg, async_op=True)
            others = [j for j in range(N) if j != j_me]
            yield [self.rank_at[j][l_me] for j in others], b1.view(N, *shape)[others]
            w.wait()
            b2 = b2.view(G, N, *shape)
            rest = [(lo, j) for lo in range(G) if lo != l_me for j in range(N)]
            yield [self.rank_at[j][lo] for lo, j in rest], \
                b2[[lo for lo, _ in rest], [j for _, j in rest]]

    # ---- reduce-scatter ----------------------------------------------------------------------
    def _reduce_scatter(self, x: torch.Tensor, *, algo: Optional[str] = None,
                        chunks: Optional[int] = None,
                        out: Optional[torch.Tensor] = None) -> torch.Tensor:
        world = self.world.size
        if isinstance(x, torch.Tensor) and x.numel() % world:
            raise ValueError(f"fusedist.reduce_scatter: x has {x.numel()} elements, not a "
                             f"multiple of the group size {world}; pad it to "
                             f"{-(-x.numel() // world) * world}")
        n = x.numel() // world if isinstance(x, torch.Tensor) else 0
        res = self._check("reduce_scatter", x, out, n)
        how, k = self.choose("reduce_scatter", x.numel() * x.element_size(), algo, chunks)
        acc = x.reshape(world, n).to(self.accum_dtype, copy=True)
        mine = torch.empty(n, dtype=self.accum_dtype, device=x.device)
        if how == "flat" or n == 0:
            _reduce_scatter(mine, acc.view(-1), group=self.world.pg)
            return res.copy_(mine)
        # Segments reordered local index major: [l][j] holds rank rank_at[j][l]'s segment, so
        # the inside reduce-scatter leaves local index l the node's sums of its N segments.
        pv = acc.index_select(0, self.local_major(x.device)).view(self.gpus, self.nodes, n)
        k = max(1, min(k, n))
        bounds = [n * i // k for i in range(k + 1)]
        self.reduce_scatter_pipelined(
            bounds, lambda i: pv[:, :, bounds[i]:bounds[i + 1]].contiguous(), mine)
        return res.copy_(mine)

    def reduce_scatter_pipelined(self, bounds: Sequence[int],
                                 produce: Callable[[int], torch.Tensor],
                                 mine: torch.Tensor) -> None:
        """The two-level reduce-scatter in chunks: chunk i is elements bounds[i]..bounds[i+1]
        of every rank's segment; produce(i) returns it as a contiguous accum_dtype tensor
        [G, N, bounds[i+1] - bounds[i]] local-index major (row [l, j]: the segment of group
        rank rank_at[j][l]). Chunk i is reduce-scattered inside the node while chunk i + 1 is
        produced, then across nodes into mine[bounds[i]:bounds[i+1]] (accum_dtype, this
        rank's segment) while chunk i + 1 is reduce-scattered inside. Needs two levels."""
        if not self.two_level:
            raise ValueError(f"fusedist.HierarchicalCommunicator: group {self.world.name} has "
                             f"one level ({self.nodes} nodes x {self.gpus} ranks)")
        k, N = len(bounds) - 1, self.nodes
        inside, across = {}, []
        with peers_guard("fusedist.HierarchicalCommunicator.reduce_scatter", self.world):
            for s in range(k + 1):
                if s < k:
                    lo, hi = bounds[s], bounds[s + 1]
                    src = produce(s).reshape(-1)
                    part = torch.empty(N * (hi - lo), dtype=src.dtype, device=src.device)
                    inside[s] = (part, _reduce_scatter(part, src, group=self.intra.pg,
                                                       async_op=True))
                if s >= 1:
                    lo, hi = bounds[s - 1], bounds[s]
                    part, w = inside.pop(s - 1)
                    w.wait()
                    across.append(_reduce_scatter(mine[lo:hi], part, group=self.inter.pg,
                                                  async_op=True))
            for w in across:
                w.wait()


def of_group(group: Group) -> Optional[HierarchicalCommunicator]:
    """The two-level communicator of `group` (algo "auto", the default machine file), made on
    first use and kept while the runtime lives, or None when the group has one level (layout:
    on one node, one rank per node, nodes holding different numbers of its ranks, or no
    process group): then its collectives stay flat. Collective over the group the first time
    (every rank of it calls its ops alike)."""
    hit = _TWO_LEVEL.get(group)
    if hit is None:
        hit = False
        if group.pg is not None and group.size > 1 and group.is_member and \
                layout(group)[0] is not None:
            hit = HierarchicalCommunicator(group)
        _TWO_LEVEL[group] = hit
    return hit or None


def resolve(group) -> tuple[Communicator, Optional[HierarchicalCommunicator]]:
    """An op's group= as (the group's Communicator, its two-level communicator or None): a
    HierarchicalCommunicator stands for itself (its algo and chunks), anything else
    (get_communicator's: a Group, a ProcessGroup, a Communicator, None for the tensor-parallel
    group) brings of_group of its group."""
    if isinstance(group, HierarchicalCommunicator):
        return get_communicator(group.group), group
    comm = get_communicator(group)
    return comm, of_group(comm.group)
