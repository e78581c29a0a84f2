"""Where experts live and in which order tokens travel: the one definition both modes and the
references follow (docs/design/ep.md).

Placement: a balanced map, expert e on rank e // L with L = num_experts / world local
experts; local expert l of rank d is expert d * L + l.

Order. A rank's (token, slot) pairs are numbered q = t * k + j. The rows it sends to rank d
are its pairs routed to d's experts, by local expert, then by q (send_layout). Rank d receives
them grouped by local expert: expert l's segment holds the sources in rank order, each
source's rows in q order (receive_order). Every mode (low-latency kernels, all-to-all over
NCCL or gloo, two-level) produces exactly this order, so recv_x is the same everywhere, and
combine sums each token's k expert outputs in slot order j = 0..k-1 in float32, rounded once
(weighted_sum): the bits of fusedist.ops.moe.unpermute_reference on the same expert outputs.

Plain torch, no host synchronization (device tensors stay on the device).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Placement:
    """The balanced expert map of `num_experts` experts over `world` ranks."""
    num_experts: int
    world: int

    def __post_init__(self):
        for name, v in (("num_experts", self.num_experts), ("world", self.world)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"fusedist.ep: {name} must be a positive int, got {v!r}")
        if self.num_experts % self.world:
            raise ValueError(
                f"fusedist.ep: num_experts={self.num_experts} is not a multiple of the expert-"
                f"parallel world {self.world}: the balanced map puts num_experts / world experts "
                f"on every rank; use a world among "
                f"{[w for w in range(1, self.num_experts + 1) if self.num_experts % w == 0]}")

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.world

    def rank_of(self, expert: int) -> int:
        return expert // self.local_experts

    def experts_of(self, rank: int) -> range:
        """The global ids of rank `rank`'s experts, local expert l at index l."""
        L = self.local_experts
        return range(rank * L, (rank + 1) * L)


def max_rows_per_source(max_tokens: int, top_k: int, local_experts: int) -> int:
    """Rows one rank can route to one peer: each token reaches at most min(k, L) of the peer's
    L experts (its k ids are distinct), so max_tokens x min(k, L) never overflows."""
    return max_tokens * min(top_k, local_experts)


@dataclass
class SendLayout:
    """A rank's pairs in send order (module docstring). Device tensors:
    order  int64 [P]: the pairs q in send order, grouped by destination rank (so by expert);
    pos    int32 [P]: pair q's row among the rows for its destination rank;
    counts int64 [world, L]: pairs per (destination rank, local expert);
    per_rank int64 [world]: pairs per destination rank."""
    order: torch.Tensor
    pos: torch.Tensor
    counts: torch.Tensor
    per_rank: torch.Tensor


def send_layout(ids: torch.Tensor, placement: Placement) -> SendLayout:
    """The send layout of ids [T, k] (expert ids in range; module docstring)."""
    E, W, L = placement.num_experts, placement.world, placement.local_experts
    flat = ids.reshape(-1).long()
    P = flat.numel()
    counts = torch.zeros(E, dtype=torch.long, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    # Experts are numbered rank-major, so a stable sort by expert is the send order: by
    # destination rank, then local expert, then q.
    order = torch.sort(flat, stable=True)[1]
    per_rank = counts.view(W, L).sum(1)
    first = torch.cumsum(per_rank, 0) - per_rank
    pos = torch.empty(P, dtype=torch.long, device=ids.device)
    pos[order] = torch.arange(P, device=ids.device) - first[flat[order] // L]
    return SendLayout(order, pos.to(torch.int32), counts.view(W, L), per_rank)


def receive_order(counts_from: torch.Tensor) -> torch.Tensor:
    """The permutation that lays received rows out by local expert. counts_from int64
    [world, L]: rows from each source per local expert; the rows arrive source by source, each
    source's in (local expert, q) order. Returns perm (int64 [rows]): recv_x = arrived[perm] is
    grouped by local expert, sources in rank order within an expert."""
    W, L = counts_from.shape
    dev = counts_from.device
    flat = counts_from.reshape(-1)
    expert_of_row = torch.repeat_interleave(torch.arange(L, device=dev).repeat(W), flat)
    source_of_row = torch.repeat_interleave(torch.arange(W, device=dev), counts_from.sum(1))
    return torch.sort(expert_of_row * W + source_of_row, stable=True)[1]


def weighted_sum(rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """rows [T, k, H] (each token's expert outputs in slot order), weights float32 [T, k] ->
    [T, H] in rows' dtype: sum over j of w[t, j] * rows[t, j] in float32, in slot order, each
    product and sum rounded alone, rounded once at the end (the ops of
    fusedist.ops.moe.unpermute_reference, so the same bits)."""
    T, k = weights.shape
    g = rows.float()
    w = weights.float()
    if k == 0 or T == 0:
        return torch.zeros(T, rows.shape[-1], dtype=rows.dtype, device=rows.device)
    acc = w[:, 0, None] * g[:, 0]
    for j in range(1, k):
        acc = acc + w[:, j, None] * g[:, j]
    return acc.to(rows.dtype)


__all__ = ["Placement", "SendLayout", "send_layout", "receive_order", "weighted_sum",
           "max_rows_per_source"]
