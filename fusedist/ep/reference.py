"""Single-process references of dispatch and combine: every rank's tokens in one process, routed
by the balanced map, laid out in the order of fusedist.ep.layout. The tests compare each mode
against these (float64 or the call's dtype), and so can a user.

    received = dispatch_reference(xs, ids, num_experts)        # one entry per rank
    outs = combine_reference(ys, received, ids, weights, num_experts)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .layout import Placement, weighted_sum


@dataclass
class Received:
    """What rank d receives: recv_x [rows, H] by local expert (sources in rank order, q order
    within a source), counts [L], and each row's origin (source rank, token, slot)."""
    recv_x: torch.Tensor
    counts: torch.Tensor
    origin: list


def dispatch_reference(xs: Sequence[torch.Tensor], ids: Sequence[torch.Tensor],
                       num_experts: int) -> list[Received]:
    """xs[s] [T_s, H] and ids[s] [T_s, k] of every rank s -> what each rank receives."""
    W = len(xs)
    pl = Placement(num_experts, W)
    out = []
    for d in range(W):
        rows, counts, origin = [], [], []
        for e in pl.experts_of(d):
            n = 0
            for s in range(W):
                flat = ids[s].reshape(-1).long()
                k = ids[s].shape[1] if ids[s].dim() == 2 else 1
                for q in torch.nonzero(flat == e).flatten().tolist():
                    rows.append(xs[s][q // k])
                    origin.append((s, q // k, q % k))
                    n += 1
            counts.append(n)
        H = xs[0].shape[1]
        recv = torch.stack(rows) if rows else torch.empty(0, H, dtype=xs[0].dtype,
                                                           device=xs[0].device)
        out.append(Received(recv, torch.tensor(counts, dtype=torch.int32), origin))
    return out


def combine_reference(ys: Sequence[torch.Tensor], received: Sequence[Received],
                      ids: Sequence[torch.Tensor], weights: Sequence[torch.Tensor],
                      num_experts: int) -> list[torch.Tensor]:
    """ys[d] [rows_d, H]: rank d's expert outputs in its recv_x order -> each rank's [T, H]:
    every token's weighted sum of its k expert outputs in slot order (layout.weighted_sum, in
    ys' dtype; float64 inputs give the float64 reference)."""
    W = len(ys)
    H = ys[0].shape[1]
    back = [torch.empty(ids[s].shape[0], ids[s].shape[1], H, dtype=ys[0].dtype,
                        device=ys[0].device) for s in range(W)]
    for d in range(W):
        for r, (s, t, j) in enumerate(received[d].origin):
            back[s][t, j] = ys[d][r]
    outs = []
    for s in range(W):
        w = weights[s].to(torch.float64 if ys[0].dtype == torch.float64 else torch.float32)
        if ys[0].dtype == torch.float64:
            acc = torch.zeros(back[s].shape[0], H, dtype=torch.float64, device=ys[0].device)
            for j in range(back[s].shape[1]):
                acc = acc + w[:, j, None] * back[s][:, j]
            outs.append(acc)
        else:
            outs.append(weighted_sum(back[s], weights[s]))
    return outs


__all__ = ["Received", "dispatch_reference", "combine_reference"]
