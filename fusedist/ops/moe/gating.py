"""MoE gating: router logits -> each token's top-k experts and weights, and the token order
sorted by expert.

    spec = RouterSpec(top_k=8, scoring="softmax", renormalize=True)          # Qwen3-MoE
    ids, weights = route(logits, spec)                  # logits [T, E] -> int32 / float32 [T, k]
    layout = sort_by_expert(ids, num_experts=E, align=1)  # counts, offsets, src / dest rows

Routing schemes (RouterSpec), with the models that use them:
  * softmax then top-k, weights = the top-k probabilities (Qwen2-MoE, `norm_topk_prob: false`),
    renormalized to sum to 1 with renormalize=True (Mixtral; Qwen3-MoE `norm_topk_prob: true`);
  * sigmoid scores, experts chosen by score + `bias` (a per-expert selection bias, DeepSeek-V3's
    `e_score_correction_bias`), weights = the unbiased scores of the chosen experts; with
    num_groups > 1 only the topk_groups groups of experts whose two best biased scores sum highest
    are eligible (group-limited routing); renormalize divides by the weights' sum; every weight
    is multiplied by routed_scaling (DeepSeek-V3: 2.5).
All of it in float32, whatever the logits' dtype. Ties are broken by the lower expert index (and
groups by the lower group index), so the kernel and the reference choose the same experts;
the k ids of a token come in descending order of the score they were chosen by.

sort_by_expert lays the T x k (token, slot) pairs out by expert for the grouped GEMMs: expert e's
pairs occupy rows offsets[e] .. offsets[e] + counts[e] of the permuted buffer, in ascending
(token, slot) order (a stable sort: the same layout on every run and every rank), each expert's
segment padded to a multiple of `align` rows (the grouped GEMM's row tile where it needs one).
src_index[r] is the pair (t * k + slot) row r holds (-1: padding), dest_index[t * k + slot] its
row. The buffer has capacity(T, E, k, align) rows, a bound that holds for any routing, so the
layout of a CUDA graph's fixed token count never overflows. Nothing here synchronizes with the
host on CUDA (captured decode steps replay with new routings).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ... import _ext

SCORINGS = ("softmax", "sigmoid")


def _fail(msg: str, exc=ValueError):
    raise exc(f"fusedist.ops.moe: {msg}")


@dataclass(frozen=True)
class RouterSpec:
    """How a model routes (module docstring). Plain data: the same spec on every rank."""
    top_k: int
    scoring: str = "softmax"
    renormalize: bool = False
    num_groups: int = 1             # experts split into this many equal groups
    topk_groups: int = 1            # groups a token may route into (num_groups > 1)
    routed_scaling: float = 1.0     # every weight multiplied by it

    def check(self, num_experts: int) -> None:
        """ValueError naming the field unless the spec fits `num_experts` experts."""
        k = self.top_k
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= num_experts:
            _fail(f"top_k must be an int in [1, num_experts={num_experts}], got {k!r}")
        if self.scoring not in SCORINGS:
            _fail(f"scoring must be one of {SCORINGS}, got {self.scoring!r}")
        g, tg = self.num_groups, self.topk_groups
        if not isinstance(g, int) or g < 1 or num_experts % g:
            _fail(f"num_groups must be a positive divisor of num_experts={num_experts}, "
                  f"got {g!r}")
        if g > 1:
            if not isinstance(tg, int) or not 1 <= tg <= g:
                _fail(f"topk_groups must be an int in [1, num_groups={g}], got {tg!r}")
            if k > tg * (num_experts // g):
                _fail(f"top_k={k} exceeds the {tg} x {num_experts // g} experts of the "
                      f"topk_groups={tg} groups a token may use")
            if self.scoring == "sigmoid" and num_experts // g < 2:
                _fail("group-limited sigmoid routing ranks groups by their two best scores: "
                      "each group needs >= 2 experts")
        s = self.routed_scaling
        if not isinstance(s, (int, float)) or isinstance(s, bool) or not s > 0 or \
                s == float("inf"):
            _fail(f"routed_scaling must be a positive finite number, got {s!r}")


def capacity(tokens: int, num_experts: int, top_k: int, align: int = 1) -> int:
    """Rows of the permuted buffer that any routing of `tokens` tokens fits in: the T x k pairs
    plus, per non-empty expert (at most min(E, T k) of them), align - 1 rows of padding."""
    pairs = tokens * top_k
    return pairs + min(num_experts, pairs) * (align - 1)


@dataclass
class MoeLayout:
    """The (token, slot) pairs laid out by expert (module docstring). Device tensors:
    counts int32 [E], offsets int32 [E + 1] (offsets[E]: rows in use), src_index int32 [rows]
    (-1: padding), dest_index int32 [T * k]; top_k, align and rows (the capacity) are ints."""
    counts: torch.Tensor
    offsets: torch.Tensor
    src_index: torch.Tensor
    dest_index: torch.Tensor
    top_k: int
    align: int

    @property
    def num_experts(self) -> int:
        return self.counts.shape[0]

    @property
    def rows(self) -> int:
        return self.src_index.shape[0]

    @property
    def tokens(self) -> int:
        return self.dest_index.shape[0] // self.top_k


# ---- references ------------------------------------------------------------------------------

def _topk_desc(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the k largest per row, descending, ties to the lower index."""
    v, i = torch.sort(scores, dim=-1, descending=True, stable=True)
    return v[..., :k], i[..., :k]


def route_reference(logits: torch.Tensor, spec: RouterSpec,
                    bias: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch in float32 (module docstring): (ids int32 [T, k], weights float32 [T, k])."""
    T, E = logits.shape
    x = logits.float()
    if spec.scoring == "softmax":
        scores = torch.softmax(x, dim=-1)
    else:
        scores = torch.sigmoid(x)
    choice = scores if bias is None else scores + bias.float()
    if spec.num_groups > 1:
        g = spec.num_groups
        grouped = choice.view(T, g, E // g)
        if spec.scoring == "sigmoid":
            gscore = _topk_desc(grouped, 2)[0].sum(-1)
        else:
            gscore = grouped.amax(-1)
        _, keep = _topk_desc(gscore, spec.topk_groups)
        allowed = torch.zeros(T, g, dtype=torch.bool, device=x.device)
        allowed.scatter_(1, keep, True)
        choice = choice.masked_fill(~allowed.repeat_interleave(E // g, 1), float("-inf"))
    _, ids = _topk_desc(choice, spec.top_k)
    w = scores.gather(1, ids)
    if spec.renormalize:
        w = w / w.sum(-1, keepdim=True)
    if spec.routed_scaling != 1.0:
        w = w * float(spec.routed_scaling)
    return ids.to(torch.int32), w


def sort_by_expert_reference(ids: torch.Tensor, num_experts: int, align: int = 1,
                             rows: Optional[int] = None) -> MoeLayout:
    """Plain torch, no host synchronization (module docstring)."""
    T, k = ids.shape
    dev = ids.device
    flat = ids.reshape(-1).long()
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + (align - 1)) // align * align
    offsets = torch.zeros(num_experts + 1, dtype=torch.long, device=dev)
    offsets[1:] = torch.cumsum(padded, 0)
    first = torch.cumsum(counts, 0) - counts          # each expert's first place in sort order
    order = torch.sort(flat, stable=True)[1]           # pairs by expert, then (token, slot)
    se = flat[order]
    pos = torch.arange(T * k, device=dev)
    row = offsets[se] + pos - first[se]
    dest = torch.empty(T * k, dtype=torch.long, device=dev)
    dest[order] = row
    rows = capacity(T, num_experts, k, align) if rows is None else rows
    src = torch.full((rows,), -1, dtype=torch.long, device=dev)
    src[row] = order
    return MoeLayout(counts.to(torch.int32), offsets.to(torch.int32), src.to(torch.int32),
                     dest.to(torch.int32), k, align)


# ---- the op ----------------------------------------------------------------------------------

def available(device) -> bool:
    """The gating kernel runs on `device`."""
    return _ext.kernel_runs("moe_gating", device)


def why_not(logits: torch.Tensor, spec: RouterSpec) -> str:
    """Why the kernel does not take this (valid) call; "" when it does."""
    why = _ext.why_not("moe_gating", logits.device)
    if why:
        return why
    return _ext.load().moe_gating_why_not(logits.shape[1], spec.top_k, spec.num_groups)


@dataclass(frozen=True)
class GatingPlan:
    """Which path routes (plain data): "kernel" or "reference", and why not the kernel."""
    path: str
    why: str = ""


def plan(logits: torch.Tensor, spec: RouterSpec) -> GatingPlan:
    why = why_not(logits, spec)
    return GatingPlan("reference" if why else "kernel", why)


def _check_logits(logits, spec: RouterSpec, bias) -> None:
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or \
            logits.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        _fail("logits must be a 2-D [tokens, num_experts] float32 / float16 / bfloat16 tensor, "
              f"got {getattr(logits, 'dtype', type(logits).__name__)} "
              f"{tuple(getattr(logits, 'shape', ()))}")
    E = logits.shape[1]
    if E < 1:
        _fail("logits has no experts (its last dimension is 0)")
    if not isinstance(spec, RouterSpec):
        _fail(f"spec must be a fusedist.ops.moe.RouterSpec, got {type(spec).__name__}", TypeError)
    spec.check(E)
    if bias is not None:
        if spec.scoring != "sigmoid":
            _fail("bias (a selection bias) goes with scoring='sigmoid' (DeepSeek-V3 routing)")
        if not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (E,) or \
                bias.device != logits.device or not bias.is_floating_point():
            _fail(f"bias must be a float tensor [{E}] on {logits.device}, got "
                  f"{getattr(bias, 'dtype', type(bias).__name__)} "
                  f"{tuple(getattr(bias, 'shape', ()))}")


def run(p: GatingPlan, logits: torch.Tensor, spec: RouterSpec,
        bias: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    if p.path == "reference" or logits.shape[0] == 0:
        if logits.is_cuda and p.why:
            _ext.warn_reference("moe.route", p.why)
        return route_reference(logits, spec, bias)
    return _route_kernel(logits, spec, bias)


def route(logits: torch.Tensor, spec: RouterSpec, bias: Optional[torch.Tensor] = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids int32 [T, k], weights float32 [T, k]) of each token's experts (module docstring)."""
    _check_logits(logits, spec, bias)
    return run(plan(logits, spec), logits, spec, bias)


def _route_kernel(logits, spec, bias):  # pragma: no cover - needs the kernel
    raise NotImplementedError("fusedist.ops.moe: the gating kernel is not wired yet")


def _check_ids(ids, num_experts: int, align: int, rows: Optional[int]) -> None:
    if not isinstance(num_experts, int) or isinstance(num_experts, bool) or num_experts < 1:
        _fail(f"num_experts must be a positive int, got {num_experts!r}")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or \
            ids.dtype not in (torch.int32, torch.int64):
        _fail("ids must be a 2-D [tokens, top_k] int32 / int64 tensor (route's ids), got "
              f"{getattr(ids, 'dtype', type(ids).__name__)} {tuple(getattr(ids, 'shape', ()))}")
    if ids.shape[1] < 1:
        _fail("ids has top_k = 0 columns")
    if not isinstance(align, int) or isinstance(align, bool) or align < 1:
        _fail(f"align must be a positive int (the grouped GEMM's row tile), got {align!r}")
    need = capacity(ids.shape[0], num_experts, ids.shape[1], align)
    if rows is not None and (not isinstance(rows, int) or rows < need):
        _fail(f"rows={rows!r} cannot hold every routing of {ids.shape[0]} tokens x top_k "
              f"{ids.shape[1]} over {num_experts} experts at align {align}: pass rows >= {need} "
              "(fusedist.ops.moe.capacity)")
    if ids.numel() and not (ids.is_cuda and torch.cuda.is_current_stream_capturing()):
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= num_experts:
            _fail(f"ids must be expert indices in [0, {num_experts}), got values in "
                  f"[{lo}, {hi}]")


def sort_by_expert(ids: torch.Tensor, num_experts: int, align: int = 1,
                   rows: Optional[int] = None) -> MoeLayout:
    """The pairs of `ids` [T, k] laid out by expert (module docstring); rows: the buffer's
    capacity (default capacity(T, E, k, align))."""
    _check_ids(ids, num_experts, align, rows)
    # The kernel path lands with the gating kernel; the reference is sync-free on CUDA.
    return sort_by_expert_reference(ids, num_experts, align, rows)


__all__ = ["RouterSpec", "MoeLayout", "GatingPlan", "SCORINGS", "route", "route_reference",
           "sort_by_expert", "sort_by_expert_reference", "capacity", "available", "why_not",
           "plan", "run"]
