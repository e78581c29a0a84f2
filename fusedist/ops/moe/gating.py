"""MoE gating: router logits -> each token's top-k experts and weights, and the token order
sorted by expert.

    spec = RouterSpec(top_k=8, scoring="softmax", renormalize=True)          # Qwen3-MoE
    ids, weights = route(logits, spec)                  # logits [T, E] -> int32 / float32 [T, k]
    layout = sort_by_expert(ids, num_experts=E, align=1)  # counts, offsets, src / dest rows
    ids, weights, layout = route_and_sort(logits, spec, align=1)  # both (one launch in decode)

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

CUDA tensors take the kernels of csrc/ops/moe/gating.cu (docs/design/moe.md, "Gating"): one warp
a token for the routing (up to 1024 experts, top_k <= 32, num_groups <= 32; why_not() says
when a call is outside), a stable counting sort for the layout (one CTA for decode sizes,
chunks for prefill; route_and_sort routes and sorts in one launch for decode). The ids equal
route_reference's, the weights agree to fp32 rounding (the bound is in the design note). On
the kernel path sort_by_expert checks the ids' range on the device: an id outside
[0, num_experts) is recorded (MetadataError at the next check: fusedist.check_device_errors()
or the next MoE op's launch), its pair left out of the layout (dest_index -1) and its token's
unpermute output NaN; the reference path raises ValueError before anything runs. The
torch.library ops fusedist::moe_route, moe_sort_by_expert and moe_route_sort (with fakes)
carry the three under torch.compile(fullgraph=True).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ... import _dtypes, _ext, tuning
from .. import device_errors

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

# The layout kernels' choices (docs/design/moe.md, "Gating"): route_and_sort routes and sorts in
# one CTA up to fused_max_tokens tokens; sort_by_expert sorts in one CTA up to
# sort_one_cta_max_pairs (token, slot) pairs, in chunks of sort_chunk_pairs pairs above.
tuning.declare(
    "moe_gating",
    fused_max_tokens=tuning.Knob(64, int, 0, 8192,
                                 doc="route_and_sort: one fused CTA up to this many tokens"),
    sort_one_cta_max_pairs=tuning.Knob(2048, int, 0, 8192,
                                       doc="sort_by_expert: one CTA up to this many pairs"),
    sort_chunk_pairs=tuning.Knob(1024, int, 512, 16384,
                                 doc="sort_by_expert above one CTA: pairs a chunk (x 512)"))


def _knobs(device) -> dict:
    return tuning.knobs("moe_gating", device)


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


@dataclass(frozen=True)
class SortPlan:
    """How sort_by_expert runs (plain data): "kernel" or "reference" (why: the reason), and the
    kernel's chunk_pairs (0: one CTA)."""
    path: str
    chunk_pairs: int = 0
    why: str = ""


def sort_plan(ids: torch.Tensor, num_experts: int, chunk_pairs: Optional[int] = None
              ) -> SortPlan:
    """The layout kernel's plan for ids [T, k] (chunk_pairs: force one, 0 = one CTA; the
    benchmark's variants), or the reference with the reason."""
    why = _ext.why_not("moe_gating", ids.device)
    if not why and num_experts > _ext.load().MOE_MAX_EXPERTS:
        why = (f"the layout kernel takes up to {_ext.load().MOE_MAX_EXPERTS} experts, got "
               f"{num_experts}")
    if why:
        return SortPlan("reference", 0, why)
    C = _ext.load()
    pairs = ids.shape[0] * ids.shape[1]
    if chunk_pairs is None:
        kn = _knobs(ids.device)
        one_cta = min(kn["sort_one_cta_max_pairs"], C.MOE_SORT_SMALL_MAX_PAIRS)
        q = C.MOE_SORT_CHUNK_QUANTUM
        chunk_pairs = 0 if pairs <= one_cta else max(q, kn["sort_chunk_pairs"] // q * q)
    return SortPlan("kernel", int(chunk_pairs))


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
    if torch.compiler.is_compiling():
        return torch.ops.fusedist.moe_route(logits, bias, *_spec_args(spec))
    return run(plan(logits, spec), logits, spec, bias)


def _spec_args(spec: RouterSpec) -> tuple:
    return (spec.top_k, spec.scoring, bool(spec.renormalize), spec.num_groups, spec.topk_groups,
            float(spec.routed_scaling))


def _spec_of(top_k, scoring, renormalize, num_groups, topk_groups, routed_scaling) -> RouterSpec:
    return RouterSpec(top_k, scoring, renormalize, num_groups, topk_groups, routed_scaling)


def _logits_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits as rows the kernel can address (unit column stride, element-aligned rows)."""
    if logits.stride(1) == 1 and logits.stride(0) >= logits.shape[1]:
        return logits
    return logits.contiguous()


def _gating_args(C, logits, spec, bias, ids, weights):
    x = _logits_rows(logits)
    b = None if bias is None else bias.to(torch.float32).contiguous()
    a = C.MoeGatingArgs()
    a.logits, a.logit_stride = x.data_ptr(), max(x.stride(0), x.shape[1])
    a.dtype = _dtypes.code(x.dtype)
    a.bias = 0 if b is None else b.data_ptr()
    a.ids, a.weights = ids.data_ptr(), weights.data_ptr()
    a.tokens, a.experts, a.top_k = x.shape[0], x.shape[1], spec.top_k
    a.scoring = SCORINGS.index(spec.scoring)
    a.renormalize = bool(spec.renormalize)
    a.num_groups, a.topk_groups = spec.num_groups, spec.topk_groups
    a.routed_scaling = float(spec.routed_scaling)
    return a, (x, b)   # the tensors the call reads: alive until the launch is queued


def _route_kernel(logits, spec, bias, out=None):
    """The gating kernel; out: (ids, weights) to write (tests poison them), else fresh."""
    T, k = logits.shape[0], spec.top_k
    ids, weights = out if out is not None else (
        torch.empty(T, k, dtype=torch.int32, device=logits.device),
        torch.empty(T, k, dtype=torch.float32, device=logits.device))
    C = _ext.load()
    a, _keep = _gating_args(C, logits, spec, bias, ids, weights)
    C.moe_gating(a, _ext.stream(logits.device))
    return ids, weights


def _check_ids(ids, num_experts: int, align: int, rows: Optional[int]) -> None:
    """The arguments of sort_by_expert (the ids' values: check_id_values, or on the device)."""
    if not isinstance(num_experts, int) or isinstance(num_experts, bool) or num_experts < 1:
        _fail(f"num_experts must be a positive int, got {num_experts!r}")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or \
            ids.dtype not in (torch.int32, torch.int64):
        _fail("ids must be a 2-D [tokens, top_k] int32 / int64 tensor (route's ids), got "
              f"{getattr(ids, 'dtype', type(ids).__name__)} {tuple(getattr(ids, 'shape', ()))}")
    if ids.shape[1] < 1:
        _fail("ids has top_k = 0 columns")
    _check_layout_args(ids.shape[0], ids.shape[1], num_experts, align, rows)


def _check_layout_args(tokens, top_k, num_experts, align, rows) -> None:
    if not isinstance(align, int) or isinstance(align, bool) or align < 1:
        _fail(f"align must be a positive int (the grouped GEMM's row tile), got {align!r}")
    need = capacity(tokens, num_experts, top_k, align)
    if rows is not None and (not isinstance(rows, int) or isinstance(rows, bool) or
                             rows < need):
        _fail(f"rows={rows!r} cannot hold every routing of {tokens} tokens x top_k "
              f"{top_k} over {num_experts} experts at align {align}: pass rows >= {need} "
              "(fusedist.ops.moe.capacity)")
    if (need if rows is None else rows) >= 2 ** 31:
        _fail(f"the layout would have {need if rows is None else rows} rows; at most 2^31 - 1 "
              "(fewer tokens a call)")


def check_id_values(ids: torch.Tensor, num_experts: int) -> None:
    """Host check of the ids' range (the reference path: it would index out of range). Reads
    the ids (a synchronization on CUDA); skipped while a CUDA graph is being captured."""
    if ids.numel() and not (ids.is_cuda and torch.cuda.is_current_stream_capturing()):
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= num_experts:
            _fail(f"ids must be expert indices in [0, {num_experts}), got values in "
                  f"[{lo}, {hi}]")


def sort_by_expert(ids: torch.Tensor, num_experts: int, align: int = 1,
                   rows: Optional[int] = None) -> MoeLayout:
    """The pairs of `ids` [T, k] laid out by expert (module docstring); rows: the buffer's
    capacity (default capacity(T, E, k, align)). On the kernel path the ids' range is checked
    on the device: an id outside [0, num_experts) is left out of the layout (dest_index -1,
    its token's unpermute output NaN) and raises MetadataError at the next check
    (fusedist.check_device_errors(), or the next MoE op's launch)."""
    _check_ids(ids, num_experts, align, rows)
    T, k = ids.shape
    rows = capacity(T, num_experts, k, align) if rows is None else rows
    if torch.compiler.is_compiling():
        t = torch.ops.fusedist.moe_sort_by_expert(ids, num_experts, align, rows)
    else:
        t = _sort_impl(ids, num_experts, align, rows)
    return MoeLayout(*t, k, align)


def _sort_impl(ids, num_experts, align, rows, p: Optional[SortPlan] = None, out=None):
    """(counts, offsets, src_index, dest_index) of sort_by_expert."""
    p = sort_plan(ids, num_experts) if p is None else p
    if p.path == "reference":
        if ids.is_cuda:
            _ext.warn_reference("moe.sort_by_expert", p.why)
        check_id_values(ids, num_experts)
        lay = sort_by_expert_reference(ids, num_experts, align, rows)
        return lay.counts, lay.offsets, lay.src_index, lay.dest_index
    return _sort_kernel(ids, num_experts, align, rows, p.chunk_pairs, out)


def _layout_out(T, k, E, rows, device):
    return (torch.empty(E, dtype=torch.int32, device=device),
            torch.empty(E + 1, dtype=torch.int32, device=device),
            torch.empty(rows, dtype=torch.int32, device=device),
            torch.empty(T * k, dtype=torch.int32, device=device))


def _sort_args(C, T, k, E, align, rows, lay, device):
    a = C.MoeSortArgs()
    a.counts, a.offsets, a.src_index, a.dest_index = (t.data_ptr() for t in lay)
    a.tokens, a.rows, a.top_k, a.experts, a.align = T, rows, k, E, align
    a.err = device_errors.record_ptr(device)
    return a


def _sort_kernel(ids, num_experts, align, rows, chunk_pairs, out=None):
    T, k = ids.shape
    dev = ids.device
    lay = out if out is not None else _layout_out(T, k, num_experts, rows, dev)
    C = _ext.load()
    device_errors.check_before_launch(ids)
    a = _sort_args(C, T, k, num_experts, align, rows, lay, dev)
    idc = ids.contiguous()
    a.ids, a.ids_int64 = idc.data_ptr(), idc.dtype == torch.int64
    ws = None
    if chunk_pairs:
        ws = torch.empty(C.moe_sort_workspace_ints(T * k, num_experts, chunk_pairs),
                         dtype=torch.int32, device=dev)
        a.workspace, a.chunk_pairs = ws.data_ptr(), chunk_pairs
    C.moe_sort(a, _ext.stream(dev))
    return lay


def route_and_sort(logits: torch.Tensor, spec: RouterSpec, bias: Optional[torch.Tensor] = None,
                   *, align: int = 1, rows: Optional[int] = None
                   ) -> tuple[torch.Tensor, torch.Tensor, MoeLayout]:
    """route(logits, spec, bias) and sort_by_expert(ids, E, align, rows) of its ids in one
    call: (ids, weights, layout). Up to the tuning table's moe_gating.fused_max_tokens tokens
    the kernel does both in one launch (decode); above, the routing and the sort kernels run one
    after the other. The results are those of the two calls."""
    _check_logits(logits, spec, bias)
    T, E = logits.shape
    _check_layout_args(T, spec.top_k, E, align, rows)
    rows = capacity(T, E, spec.top_k, align) if rows is None else rows
    if torch.compiler.is_compiling():
        t = torch.ops.fusedist.moe_route_sort(logits, bias, *_spec_args(spec), align, rows)
    else:
        t = _route_sort_impl(logits, spec, bias, align, rows)
    return t[0], t[1], MoeLayout(*t[2:], spec.top_k, align)


def fused_ok(logits: torch.Tensor, spec: RouterSpec) -> bool:
    """route_and_sort takes the one-launch kernel for this (kernel-path) call."""
    T = logits.shape[0]
    return T <= _knobs(logits.device)["fused_max_tokens"] and \
        T * spec.top_k <= _ext.load().MOE_SORT_SMALL_MAX_PAIRS


def _route_sort_impl(logits, spec, bias, align, rows, fused: Optional[bool] = None, out=None):
    """(ids, weights, counts, offsets, src_index, dest_index); fused: force the one-launch
    kernel (True) or route then sort (False) on the kernel path (the benchmark's variants);
    out: the six tensors to write (tests poison them)."""
    p = plan(logits, spec)
    T, E = logits.shape
    k = spec.top_k
    if p.path == "reference" or not (fused if fused is not None else fused_ok(logits, spec)):
        if out is not None and p.path == "kernel":   # tests: the two kernels into out
            ids, w = _route_kernel(logits, spec, bias, out[:2])
        else:
            ids, w = run(p, logits, spec, bias)
        lay = _sort_impl(ids, E, align, rows, None, None if out is None else out[2:])
        return (ids, w, *lay)
    dev = logits.device
    ids, w, *lay = out if out is not None else (
        torch.empty(T, k, dtype=torch.int32, device=dev),
        torch.empty(T, k, dtype=torch.float32, device=dev), *_layout_out(T, k, E, rows, dev))
    C = _ext.load()
    device_errors.check_before_launch(logits)
    g, _keep = _gating_args(C, logits, spec, bias, ids, w)
    a = _sort_args(C, T, k, E, align, rows, lay, dev)
    C.moe_route_sort(g, a, _ext.stream(dev))
    return (ids, w, *lay)


# ---- torch.library registrations (torch.compile(fullgraph=True)) -----------------------------

@torch.library.custom_op("fusedist::moe_route", mutates_args=())
def _route_op(logits: torch.Tensor, bias: Optional[torch.Tensor], top_k: int, scoring: str,
              renormalize: bool, num_groups: int, topk_groups: int, routed_scaling: float
              ) -> tuple[torch.Tensor, torch.Tensor]:
    spec = _spec_of(top_k, scoring, renormalize, num_groups, topk_groups, routed_scaling)
    return run(plan(logits, spec), logits, spec, bias)


@_route_op.register_fake
def _(logits, bias, top_k, scoring, renormalize, num_groups, topk_groups, routed_scaling):
    T = logits.shape[0]
    return (logits.new_empty((T, top_k), dtype=torch.int32),
            logits.new_empty((T, top_k), dtype=torch.float32))


@torch.library.custom_op("fusedist::moe_sort_by_expert", mutates_args=())
def _sort_op(ids: torch.Tensor, num_experts: int, align: int, rows: int
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple(_sort_impl(ids, num_experts, align, rows))


def _fake_layout(like: torch.Tensor, pairs, num_experts, rows):
    i32 = torch.int32
    return (like.new_empty((num_experts,), dtype=i32),
            like.new_empty((num_experts + 1,), dtype=i32),
            like.new_empty((rows,), dtype=i32), like.new_empty((pairs,), dtype=i32))


@_sort_op.register_fake
def _(ids, num_experts, align, rows):
    return _fake_layout(ids, ids.shape[0] * ids.shape[1], num_experts, rows)


@torch.library.custom_op("fusedist::moe_route_sort", mutates_args=())
def _route_sort_op(logits: torch.Tensor, bias: Optional[torch.Tensor], top_k: int, scoring: str,
                   renormalize: bool, num_groups: int, topk_groups: int, routed_scaling: float,
                   align: int, rows: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                              torch.Tensor, torch.Tensor]:
    spec = _spec_of(top_k, scoring, renormalize, num_groups, topk_groups, routed_scaling)
    return tuple(_route_sort_impl(logits, spec, bias, align, rows))


@_route_sort_op.register_fake
def _(logits, bias, top_k, scoring, renormalize, num_groups, topk_groups, routed_scaling, align,
      rows):
    T, E = logits.shape
    return (logits.new_empty((T, top_k), dtype=torch.int32),
            logits.new_empty((T, top_k), dtype=torch.float32),
            *_fake_layout(logits, T * top_k, E, rows))


__all__ = ["RouterSpec", "MoeLayout", "GatingPlan", "SortPlan", "SCORINGS", "route",
           "route_reference", "sort_by_expert", "sort_by_expert_reference", "route_and_sort",
           "capacity", "available", "why_not", "plan", "run", "sort_plan", "fused_ok",
           "check_id_values"]


reference = route_reference   # the op's shape: available / why_not / plan / run above
