"""Expert parallelism: dispatch each token to the ranks holding its top-k experts and combine
the experts' outputs back, weighted, in the token's order (docs/design/ep.md).

    buf = fusedist.ep.Buffer(group, hidden, max_tokens_per_rank, num_experts, top_k, dtype)
    recv_x, recv_counts, handle = buf.dispatch(x, topk_ids, topk_weights)
    out = buf.combine(experts(recv_x, recv_counts), handle)

Two modes: low-latency kernels over NVLink symmetric memory for decode (CUDA-graph
replayable, optional FP8 payload), all-to-all-v over NCCL (gloo on CPUs) for prefill, two-level
across nodes; the cost model chooses between them. fusedist.ep sits beside fusedist.ops, above
fusedist.comm.
"""

from .buffer import MODES, Buffer, DispatchHandle, EventOverlap
from .layout import Placement, max_rows_per_source, receive_order, send_layout, weighted_sum
from .low_latency import EpCapacityError, EpRoutingError
from .reference import combine_reference, dispatch_reference

__all__ = ["Buffer", "DispatchHandle", "EventOverlap", "MODES", "Placement", "send_layout",
           "receive_order", "weighted_sum", "max_rows_per_source", "EpCapacityError",
           "EpRoutingError", "dispatch_reference", "combine_reference"]
