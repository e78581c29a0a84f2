"""Mixture of experts on one GPU: gating, the token layout by expert, permute / unpermute and
the grouped GEMMs over experts (docs/design/moe.md).

    spec = RouterSpec(top_k=8, renormalize=True)
    ids, weights = route(logits, spec)                    # [T, k] each
    layout = sort_by_expert(ids, num_experts=E)           # counts, offsets, src / dest rows
    ids, weights, layout = route_and_sort(logits, spec)   # both (one launch at decode sizes)
    x_perm = permute(x, layout)                           # [rows, H], by expert
    h = grouped_gemm(x_perm, w_gate_up, layout)           # [rows, 2 I]
    y = grouped_gemm(silu_mul(h), w_down, layout)         # [rows, H]
    out = unpermute(y, layout, weights, residual=res)     # [T, H]

fusedist.nn.MoE strings these together (with tensor parallelism and the shared expert).
"""

from .gating import (MoeLayout, RouterSpec, capacity, route, route_and_sort, route_reference,
                     sort_by_expert, sort_by_expert_reference)
from .grouped_gemm import dequantize_weights, grouped_gemm, grouped_gemm_reference
from .permute import permute, permute_reference, unpermute, unpermute_reference

__all__ = ["RouterSpec", "MoeLayout", "route", "route_reference", "route_and_sort",
           "sort_by_expert", "sort_by_expert_reference", "capacity", "permute",
           "permute_reference", "unpermute", "unpermute_reference", "grouped_gemm",
           "grouped_gemm_reference", "dequantize_weights"]
