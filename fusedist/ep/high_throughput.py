"""High-throughput dispatch / combine (prefill): all-to-all-v of the token rows.

Flat (one node, or a group without two levels):
  1. every rank exchanges one small all-to-all: to each peer its call descriptor and the rows
     it will send per local expert of that peer (counts [world, L]); every rank compares the
     descriptors (CollectiveMismatchError naming the ranks and fields that differ) and the host
     learns the sizes (a host synchronization: the payload's sizes come from it);
  2. the rows, in send order (fusedist.ep.layout), as one all-to-all-v: nccl4py's grouped
     send / recv in chunks of `chunk_rows` rows per peer on GPUs (FUSEDIST_NCCL=torch:
     torch.distributed.all_to_all_single over NCCL), torch.distributed.all_to_all_single over
     gloo on CPUs (the reference path);
  3. the arrived rows are laid out by local expert (layout.receive_order).
  Combine runs the same exchange backwards and sums in slot order (layout.weighted_sum).

Two-level (several nodes, the same number of ranks on each, two or more): route by node, then
within it. Stage 1 crosses the network between counterparts (the same local index on every
node): each token goes once to every node holding one of its experts, with its k ids masked to
that node's experts and its token index. Stage 2 stays inside the node: the counterpart
forwards each (token, slot) pair to the local rank of its expert, with (local expert, source
rank, pair index) so the receiver sorts them into the flat order. A token bound for several
experts of one node crosses the network once. Combine returns every expert output the same
way back (no partial sums on the way: the source sums the k outputs in slot order, so the
result is bitwise the flat path's and the single-GPU reference's).

Every collective is bounded: over gloo by the buffer's timeout (a lost peer raises
PeerLostError naming it where it can tell), on GPUs by polling the exchange against the same
timeout and, where the buffer has symmetric memory, by a call check before the first NCCL call
(it meets a peer's low-latency kernel or another call's check: CollectiveMismatchError on both
sides instead of an NCCL call that never returns).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from ..comm.nccl import NcclComm
from ..distributed.groups import Group
from ..distributed.peers import collective_timeout, is_peer_failure, peer_lost_error
from ..distributed.runtime import get_runtime
from ..errors import CollectiveMismatchError, FusedistError
from .layout import Placement, receive_order, send_layout, weighted_sum

# A call's descriptor, as exchanged by step 1: what every rank must agree on.
DESC_FIELDS = ("op", "hidden", "num_experts", "top_k", "dtype", "fp8", "rows_per_source",
               "max_tokens_per_rank")
OPS = {1: "high-throughput dispatch", 2: "high-throughput combine"}
OP_DISPATCH, OP_COMBINE = 1, 2


class EpNccl(NcclComm):
    """A group's nccl4py communicator with the grouped point-to-point calls all-to-all-v is
    made of (FUSEDIST_NCCL=torch: torch.distributed.all_to_all_single on the group)."""

    def send_recv(self, sends: list, recvs: list, stream) -> None:
        """One NCCL group of sends [(peer, tensor)] and receives [(peer, tensor)] on
        `stream`; every tensor contiguous, on this rank's GPU."""
        self._check_usable()
        nc = self._nc
        nc.group_start()
        try:
            for p, t in sends:
                self._comm.send(t, p, stream=stream)
            for p, t in recvs:
                self._comm.recv(t, p, stream=stream)
        finally:
            nc.group_end()


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """t [N, ...] as bytes [N, row bytes] (all-to-all moves bytes: gloo and NCCL take uint8)."""
    n = 1
    for d in t.shape[1:]:
        n *= int(d)
    return t.reshape(t.shape[0], n).view(torch.uint8)


class Level:
    """all-to-all-v over one group: gloo or torch's NCCL (dist.all_to_all_single), or
    nccl4py's grouped send / recv in chunks of `chunk_rows` rows per peer."""

    def __init__(self, group: Group, chunk_rows: int, nccl: Optional[EpNccl]):
        self.group = group
        self.chunk_rows = chunk_rows
        self.nccl = nccl if nccl is not None and nccl._comm is not None else None

    @property
    def size(self) -> int:
        return self.group.size

    def rows(self, send: torch.Tensor, send_splits: list, recv_splits: list) -> torch.Tensor:
        """send [sum(send_splits), ...] -> [sum(recv_splits), ...]: rows send_splits[p] go to
        group rank p, recv_splits[p] arrive from it, in rank order."""
        out = torch.empty((sum(recv_splits),) + tuple(send.shape[1:]), dtype=send.dtype,
                          device=send.device)
        if self.size == 1:
            out.copy_(send)
            return out
        if self.nccl is None:
            dist.all_to_all_single(_as_rows(out), _as_rows(send), list(recv_splits),
                                   list(send_splits), group=self.group.pg)
            return out
        src, dst = _as_rows(send), _as_rows(out)
        so = [sum(send_splits[:p]) for p in range(self.size)]
        ro = [sum(recv_splits[:p]) for p in range(self.size)]
        me = self.group.rank
        n = send_splits[me]
        if n:
            dst[ro[me]:ro[me] + n].copy_(src[so[me]:so[me] + n])
        stream = torch.cuda.current_stream(send.device).cuda_stream
        c = self.chunk_rows
        rounds = max([-(-send_splits[p] // c) for p in range(self.size) if p != me] +
                     [-(-recv_splits[p] // c) for p in range(self.size) if p != me] + [0])
        # Round r carries chunk r of every peer's rows, each pair of ranks posting the same
        # number of chunks (ceil(rows / chunk_rows)) in the same rounds, so the sends and
        # receives of a round match and no round waits on a later one.
        for r in range(rounds):
            sends, recvs = [], []
            for p in range(self.size):
                if p == me:
                    continue
                lo = r * c
                if lo < send_splits[p]:
                    sends.append((p, src[so[p] + lo:so[p] + min(send_splits[p], lo + c)]))
                if lo < recv_splits[p]:
                    recvs.append((p, dst[ro[p] + lo:ro[p] + min(recv_splits[p], lo + c)]))
            self.nccl.send_recv(sends, recvs, stream)
        return out

    def blocks(self, send: torch.Tensor) -> torch.Tensor:
        """send [size, n] -> [size, n]: row p goes to group rank p, row p of the result came
        from it (the small exchange of counts and descriptors)."""
        return self.rows(send.contiguous(), [1] * self.size, [1] * self.size)


@dataclass
class HtHandle:
    """What a high-throughput combine needs from its dispatch (host lists, device tensors)."""
    send_order: torch.Tensor          # int64 [P]: pairs in send order
    send_splits: list                 # rows to each peer (flat) / counterpart (two-level)
    recv_splits: list
    perm: torch.Tensor                # int64 [rows]: recv_x = arrived[perm]
    # two-level only
    two_level: bool = False
    node_q: list = field(default_factory=list)        # per node: int64 q of its pairs
    fwd_order: Optional[torch.Tensor] = None           # forwarder's pairs in intra send order
    fwd_pairs_per_source: list = field(default_factory=list)
    fwd_send_splits: list = field(default_factory=list)
    fwd_recv_splits: list = field(default_factory=list)
    fwd_pairs: int = 0


class HighThroughput:
    """The high-throughput path of one Buffer (module docstring)."""

    def __init__(self, buf, levels: dict):
        self.buf = buf
        self.flat: Level = levels["flat"]
        self.intra: Optional[Level] = levels.get("intra")
        self.inter: Optional[Level] = levels.get("inter")
        self.rank_at = levels.get("rank_at")       # two-level: global ranks [node][local]

    @property
    def two_level(self) -> bool:
        return self.inter is not None

    # ---- bounded collectives ----------------------------------------------------------------
    def _guard(self, where: str):
        return _Guard(self.buf, where)

    def _host(self, t: torch.Tensor, where: str) -> torch.Tensor:
        """t on the host. On GPUs the copy is polled against the buffer's timeout and its call
        checks' record, so a mismatched or lost peer ends in an error, not a hang."""
        if not t.is_cuda:
            return t
        host = t.to("cpu", non_blocking=True)
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(t.device))
        deadline = time.monotonic() + self.buf.timeout_s
        while not ev.query():
            self.buf.check_protocol(abort=True)
            if time.monotonic() > deadline:
                self.buf.abort_nccl()
                rt = get_runtime()
                raise peer_lost_error(where, self.buf.group, rt.peers, rt.rank, TimeoutError(
                    f"the exchange did not complete within {self.buf.timeout_s:g} s"))
            time.sleep(50e-6)
        return host

    def _descriptors(self, level: Level, op: int, counts: torch.Tensor, where: str
                     ) -> torch.Tensor:
        """Step 1 over `level`: my descriptor and counts[p] to each rank p; returns what each
        rank sent me (host int64 [size, n]) after comparing the descriptors."""
        b = self.buf
        desc = torch.tensor([op, b.hidden, b.num_experts, b.top_k, b.dtype_code, int(b.fp8),
                             b.rows_per_source, b.max_tokens_per_rank], dtype=torch.long)
        body = counts.reshape(level.size, -1).to(device=b.device, dtype=torch.long)
        send = torch.cat([desc.to(b.device).expand(level.size, -1), body], 1)
        got = self._host(level.blocks(send), where)
        theirs = got[:, :len(DESC_FIELDS)]
        if not bool((theirs == desc).all()):
            ranks = [level.group.ranks[p] for p in range(level.size)]
            parts = []
            for f, name in enumerate(DESC_FIELDS):
                vals = theirs[:, f].tolist()
                if len(set(vals)) > 1:
                    show = (lambda v: OPS.get(v, f"op {v}")) if name == "op" else str
                    parts.append(f"{name}: " + ", ".join(f"rank {r}: {show(v)}"
                                                         for r, v in zip(ranks, vals)))
            raise CollectiveMismatchError(
                f"{where}: ranks of group {level.group.name} made different calls: "
                f"{'; '.join(parts)}. Every rank must call dispatch and combine in the same "
                "order on Buffers created with the same arguments")
        return got[:, len(DESC_FIELDS):]

    def _no_counts(self) -> torch.Tensor:
        """The body of a descriptor exchange that carries no counts: the same shape as the flat
        dispatch's (every call's first exchange has one size, so calls that differ meet)."""
        pl = self.buf.placement
        return torch.zeros(pl.world, pl.local_experts, dtype=torch.long)

    # ---- dispatch ---------------------------------------------------------------------------
    def dispatch(self, x: torch.Tensor, ids: torch.Tensor):
        where = "fusedist.ep.Buffer.dispatch (high-throughput)"
        with self._guard(where):
            self.buf.call_check(OP_DISPATCH)
            if self.two_level:
                return self._dispatch_two_level(x, ids, where)
            return self._dispatch_flat(x, ids, where)

    def _dispatch_flat(self, x, ids, where):
        b = self.buf
        pl: Placement = b.placement
        W, L = pl.world, pl.local_experts
        lay = send_layout(ids, pl)
        counts_from = self._descriptors(self.flat, OP_DISPATCH, lay.counts, where)  # [W, L]
        send_splits = lay.per_rank.tolist() if not lay.per_rank.is_cuda else \
            self._host(lay.per_rank, where).tolist()
        recv_splits = counts_from.sum(1).tolist()
        rows = x.index_select(0, lay.order // b.top_k)
        arrived = self.flat.rows(rows, send_splits, recv_splits)
        perm = receive_order(counts_from.to(x.device))
        recv_x = arrived.index_select(0, perm)
        recv_counts = counts_from.sum(0).to(torch.int32).to(x.device)
        return recv_x, recv_counts, HtHandle(lay.order, send_splits, recv_splits, perm)

    def _dispatch_two_level(self, x, ids, where):
        b = self.buf
        pl: Placement = b.placement
        W, L, K = pl.world, pl.local_experts, b.top_k
        N, G = len(self.rank_at), len(self.rank_at[0])
        dev = x.device
        node_of = b.node_of_rank.to(dev)       # [W]
        local_of = b.local_of_rank.to(dev)     # [W]
        me_node, me_local = b.node, b.local
        T = ids.shape[0]
        ids64 = ids.long()
        enode = node_of[ids64 // L]            # [T, k]: each pair's node
        # the world's descriptor check first (every rank, one small exchange)
        self._descriptors(self.flat, OP_DISPATCH, self._no_counts(), where)
        # ---- stage 1: each token once to every node holding one of its experts
        toks, metas, node_q, per_node = [], [], [], []
        t_idx = torch.arange(T, device=dev)
        q_all = torch.arange(T * K, device=dev)
        for n in range(N):
            on = enode == n                                # [T, k]
            u = t_idx[on.any(1)]                           # tokens bound for node n
            masked = torch.where(on, ids64, torch.full_like(ids64, -1)).index_select(0, u)
            toks.append(x.index_select(0, u))
            metas.append(torch.cat([masked, u[:, None]], 1))
            node_q.append(q_all[on.reshape(-1)])
            per_node.append(u.numel())
        send1 = torch.cat(toks) if toks else x[:0]
        meta1 = torch.cat(metas)
        n_from = self._host(self.inter.blocks(torch.tensor(per_node, dtype=torch.long,
                                                           device=dev)[:, None]), where)
        recv1 = n_from[:, 0].tolist()
        x1 = self.inter.rows(send1, per_node, recv1)
        m1 = self.inter.rows(meta1, per_node, recv1)          # [U, k + 1]
        # ---- stage 2: the forwarder's pairs to the local ranks of their experts
        src_node = torch.repeat_interleave(torch.arange(N, device=dev),
                                           torch.tensor(recv1, device=dev))
        src_rank = torch.tensor([self.rank_at[n][me_local] for n in range(N)],
                                device=dev)[src_node]         # [U] global source rank
        ids1 = m1[:, :K]
        valid = ids1 >= 0
        uu, jj = torch.nonzero(valid, as_tuple=True)          # (u, j) ascending
        e = ids1[uu, jj]
        dest_local = local_of[e // L]
        fwd_order = torch.sort(dest_local, stable=True)[1]
        fwd_send = torch.bincount(dest_local, minlength=G)
        fwd_send_h = self._host(fwd_send, where).tolist()
        meta2 = torch.stack([e % L, src_rank[uu], m1[uu, K] * K + jj], 1)[fwd_order]
        rows2 = x1.index_select(0, uu[fwd_order])
        fwd_recv = self._host(self.intra.blocks(fwd_send[:, None]), where)[:, 0].tolist()
        x2 = self.intra.rows(rows2, fwd_send_h, fwd_recv)
        m2 = self.intra.rows(meta2.contiguous(), fwd_send_h, fwd_recv)
        # ---- the flat order: (local expert, source rank, pair index)
        key = (m2[:, 0] * W + m2[:, 1]) * (b.max_tokens_per_rank * K) + m2[:, 2]
        perm = torch.sort(key)[1]
        recv_x = x2.index_select(0, perm)
        recv_counts = torch.bincount(m2[:, 0], minlength=L).to(torch.int32)
        pairs_per_source = torch.bincount(src_node[uu], minlength=N)
        h = HtHandle(torch.empty(0, dtype=torch.long, device=dev), per_node, recv1, perm,
                     two_level=True, node_q=node_q, fwd_order=fwd_order,
                     fwd_pairs_per_source=self._host(pairs_per_source, where).tolist(),
                     fwd_send_splits=fwd_send_h, fwd_recv_splits=fwd_recv,
                     fwd_pairs=int(uu.numel()))
        return recv_x, recv_counts, h

    # ---- combine ----------------------------------------------------------------------------
    def combine(self, y: torch.Tensor, handle, weights: torch.Tensor) -> torch.Tensor:
        where = "fusedist.ep.Buffer.combine (high-throughput)"
        h: HtHandle = handle.ht
        b = self.buf
        T, K, H = weights.shape[0], b.top_k, y.shape[1]
        with self._guard(where):
            b.call_check(OP_COMBINE)
            self._descriptors(self.flat, OP_COMBINE, self._no_counts(), where)
            arrived = torch.empty_like(y)
            arrived.index_copy_(0, h.perm, y)                # back to arrival order
            pairs = torch.empty(T * K, H, dtype=y.dtype, device=y.device)
            if not h.two_level:
                back = self.flat.rows(arrived, h.recv_splits, h.send_splits)
                pairs.index_copy_(0, h.send_order, back)
            else:
                # stage 2 back: the forwarder's pairs, in its intra send order
                fwd = self.intra.rows(arrived, h.fwd_recv_splits, h.fwd_send_splits)
                in_pair_order = torch.empty_like(fwd)
                in_pair_order.index_copy_(0, h.fwd_order, fwd)  # (u, j) order: by source
                back = self.inter.rows(in_pair_order, h.fwd_pairs_per_source,
                                       [int(q.numel()) for q in h.node_q])
                pairs.index_copy_(0, torch.cat(h.node_q), back)
        return weighted_sum(pairs.view(T, K, H), weights)


class _Guard:
    """Inside: the buffer's collectives are bounded by its timeout (gloo), and a failed one
    raises PeerLostError naming the lost rank where it can tell."""

    def __init__(self, buf, where: str):
        self.buf, self.where = buf, where
        self._timeout = None

    def __enter__(self):
        rt = get_runtime()
        self._timeout = collective_timeout(self.buf.group, self.buf.timeout_s, rt.timeout_s)
        self._timeout.__enter__()
        return self

    def __exit__(self, et, e, tb):
        self._timeout.__exit__(et, e, tb)
        if e is None or isinstance(e, (FusedistError, ValueError, TypeError)):
            return False
        if is_peer_failure(e):
            rt = get_runtime()
            raise peer_lost_error(self.where, self.buf.group, rt.peers, rt.rank, e) from e
        return False


__all__ = ["HighThroughput", "HtHandle", "Level", "EpNccl", "DESC_FIELDS"]
