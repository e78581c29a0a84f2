"""MoE: a tensor-parallel mixture-of-experts SwiGLU layer: its parameters and the calls of
fusedist.ops.moe (the ops decide which kernel runs).

    moe = MoE(hidden, num_experts, intermediate, RouterSpec(top_k=8, renormalize=True),
              shared_intermediate_size=0, group=tp, dtype=torch.bfloat16, device=dev)
    moe.load_router(w)                         # [E, hidden], every rank the same
    moe.load_expert(e, gate, up, down)         # this rank's rows of gate / up, columns of down
    moe.load_shared(gate, up, down, gate_w)    # Qwen2-MoE's shared expert
    part = moe(x)                              # [T, hidden]: this rank's partial, not reduced

One call, x [T, H] (the post-attention norm's output, the same on every rank):

    logits = x @ router^T                   float32 [T, E] (the router is kept in float32)
    ids, w = route(logits, spec)            [T, k] each: softmax top-k, renormalized or not
    layout = sort_by_expert(ids, E)         the T k (token, slot) pairs by expert, in a buffer
                                            of capacity(T, E, k) rows (a bound for any routing)
    xp = permute(x, layout)                 [rows, H]: skipped where the grouped GEMM's plan
                                            for x in token order (gather=True) is the decode
                                            GEMV over the routed experts
    h = grouped_gemm(xp, w13, layout)       [rows, 2 I/tp]: each expert's gate rows, then up
    a = silu_mul(h)                         [rows, I/tp]
    y = grouped_gemm(a, w2, layout)         [rows, H]
    s = sigmoid(x @ g^T) * shared(x)        the shared expert (Qwen2-MoE), a dense SwiGLU;
                                            on a second stream on CUDA, joined before:
    out = unpermute(y, layout, w, residual=s)   [T, H]: sum_j w[t, j] y[dest(t, j)] + s[t],
                                            float32 sums, one rounding to x's dtype

Tensor parallelism over the experts' intermediate dimension: rank r holds rows
[r I/tp, (r+1) I/tp) of every expert's gate and up projection (stacked [E, 2 I/tp, H], gate
rows then up rows, so silu_mul applies: ColumnParallelLinear's rows) and those columns of its
down projection ([E, H, I/tp]: RowParallelLinear's columns); the shared expert is split the
same way. The router, the routing and the layout are replicated (every rank computes the same
ids from the same x), so out is rank r's partial sum of every token's output, which the model
reduces together with the residual add and the next RMSNorm (all_reduce_add_rmsnorm), as it
does the dense MLP's down projection: one exchange per layer. The shared expert's gate is
replicated: sum_r sigmoid(g x) p_r = sigmoid(g x) sum_r p_r.

Expert parallelism (ep=True): the experts are sharded over the group instead, expert e on
rank e // (E / world) (fusedist.ep's balanced map; E % world == 0), each rank holding its
experts' whole intermediate (w13 [E/world, 2 I, H], w2 [E/world, H, I]); load_expert takes
this rank's experts only (self.experts). x is replicated, so every rank routes all T tokens
(the same logits and ids, to the bit, as one rank holding every expert) and takes a balanced
contiguous share of them (token_share: any T, shares may be empty). The share goes through a
fusedist.ep.Buffer (ExpertExchange: sized once from the runner's largest steps, shared by a
model's sparse layers): dispatch brings each rank the rows of its experts, grouped by local
expert, which the grouped GEMMs take as they are (a MoeLayout of the received segments:
per-local-expert counts and offsets, identity rows), and combine returns each token's
weighted sum in slot order, bitwise fusedist.ops.moe.unpermute's. The rows land in an
otherwise-zero partial [T, H] (plus the shared expert's tensor-parallel partial, which stays
split over its intermediate), so the model's all_reduce_add_rmsnorm adds exact zeros to one
nonzero partial per row. Every expert's received segment holds exactly that expert's rows of
the one-rank layout, in the same order, so without a shared expert the layer's output is
bitwise the output of the layer holding every expert wherever the experts' GEMMs give a
segment bits that depend on that segment alone: the per-expert reference matmul (float32 and
the CPU) and the grouped GEMM kernel do; the grouped GEMV splits K by every expert's count,
so decode-size bf16 steps agree within bf16 rounding.

CUDA graphs: the buffer's rows depend on T alone, the counts and offsets stay on the device,
and the shared expert's stream is forked from and joined to the caller's by events, so a
captured step replays with new routings. A path that reads the routing on the host (the
grouped GEMM's plain-torch reference, where its kernel does not run) refuses to be captured
with an error saying why. With ep a captured step uses the Buffer's low-latency kernels (no
host synchronization); where they cannot run, capture is refused by name.

FP8 (fp8_layout "tensor" | "channel" | "block"): every expert's weights are e4m3 with float32
scales that multiply, as fusedist.nn.quant.FP8Weight holds a dense weight, stacked by
FP8Experts ([E, N, K] data; scales [E], [E, N] or [E, ceil(N/128), ceil(K/128)]: the w_scale
layouts of fusedist.ops.moe.grouped_gemm). gate | up of "tensor" weights become per-channel
(each row keeps its projection's scale, exactly, as FP8Weight.cat_rows does). The grouped GEMM
gets x in the model dtype (weight-only), except where its plan runs the grouped GEMM kernel:
that kernel multiplies e4m3 operands, so permute quantizes x in the same pass (per token,
"token"; per 128 columns for block weights, "group") and silu_mul's output is quantized for the
down projection likewise. The shared expert's projections are FP8Weights through
fusedist.nn.linear.linear.

Weights in a dtype the grouped GEMM does not take (float32: the CPU reference model) go through
the op's plain-torch reference (fusedist.ops.moe.grouped_gemm_reference); every other step is
the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from .. import _dtypes
from ..comm.communicator import Communicator, GroupLike, resolve_group
from ..comm.streams import comm_stream
from ..distributed.runtime import is_initialized
from ..ep import Buffer
from ..ops.moe import (MoeLayout, RouterSpec, grouped_gemm, grouped_gemm_reference, permute,
                       route, sort_by_expert, unpermute)
from ..ops.moe.grouped_gemm import W_DTYPES as GEMM_W_DTYPES
from ..ops.moe.grouped_gemm import plan as gemm_plan
from ..ops.moe.grouped_gemm import preferred_path
from ..ops.moe.grouped_gemm import run as gemm_run
from ..ops.moe.grouped_gemm import why_not as gemm_why_not
from ..ops.quantize_rows import quantize_groups, quantize_rows
from ..ops.silu_mul import silu_mul
from .linear import linear
from .quant import FP8, LAYOUTS, FP8Rows, FP8Weight, scale_shape

BLOCK = _dtypes.FP8_BLOCK


def _fail(msg: str, exc=ValueError):
    raise exc(f"fusedist.nn.MoE: {msg}")


# ---- stacked FP8 expert weights --------------------------------------------------------------

@dataclass(eq=False)
class FP8Experts:
    """E experts' FP8 weights, stacked: data [E, N, K] float8_e4m3fn (each expert an nn.Linear
    weight, K contiguous), scale float32 that MULTIPLIES the e4m3 values, in FP8Weight's
    layouts with the expert first: "tensor" [E], "channel" [E, N], "block" [E, ceil(N/128),
    ceil(K/128)] (fusedist.ops.moe.grouped_gemm's w_scale)."""
    data: torch.Tensor
    scale: torch.Tensor
    layout: str

    def __post_init__(self):
        if FP8 is None:
            _fail("this torch has no torch.float8_e4m3fn", RuntimeError)
        d, s = self.data, self.scale
        if not isinstance(d, torch.Tensor) or d.dtype != FP8 or d.dim() != 3:
            _fail(f"FP8Experts data must be a 3-D [E, N, K] float8_e4m3fn tensor, got "
                  f"{getattr(d, 'dtype', type(d).__name__)} {tuple(getattr(d, 'shape', ()))}")
        if self.layout not in LAYOUTS:
            _fail(f"FP8Experts layout must be one of {LAYOUTS}, got {self.layout!r}")
        want = self.scale_shape(self.layout, *d.shape)
        if not isinstance(s, torch.Tensor) or s.dtype != torch.float32 or \
                tuple(s.shape) != want or s.device != d.device:
            _fail(f"FP8Experts: {self.layout} scales of [E, N, K] = {list(d.shape)} must be "
                  f"float32 {list(want)} on {d.device}, got "
                  f"{getattr(s, 'dtype', type(s).__name__)} {list(getattr(s, 'shape', ()))}")

    @staticmethod
    def scale_shape(layout: str, e: int, n: int, k: int) -> tuple:
        return (e,) if layout == "tensor" else (e,) + scale_shape(layout, n, k)

    @classmethod
    def empty(cls, e: int, n: int, k: int, layout: str, device=None) -> "FP8Experts":
        """Zeros with unit scales (before loading)."""
        return cls(torch.zeros((e, n, k), dtype=FP8, device=device),
                   torch.ones(cls.scale_shape(layout, e, n, k), dtype=torch.float32,
                              device=device), layout)

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    def nbytes(self) -> int:
        return self.data.numel() + 4 * self.scale.numel()

    def __repr__(self) -> str:
        return (f"FP8Experts({list(self.shape)}, {self.layout} scales "
                f"{list(self.scale.shape)}, {self.device})")

    @torch.no_grad()
    def set_expert(self, e: int, w: FP8Weight, what: str = "expert") -> None:
        """Expert e's weight w [N, K] (its scales in this layout; a per-tensor w into per-channel
        experts: its scale on every row)."""
        if tuple(w.shape) != tuple(self.shape[1:]):
            _fail(f"{what}: an FP8 weight of [{self.shape[1]}, {self.shape[2]}] expected, got "
                  f"{list(w.shape)}")
        scale = w.scale
        if w.layout == "tensor" and self.layout == "channel":
            scale = w.channel_scale
        elif w.layout != self.layout:
            _fail(f"{what}: {w.layout} scales; these experts hold {self.layout} scales")
        self.data[e].copy_(w.data)
        self.scale[e].copy_(scale.reshape(self.scale[e].shape))

    def expert(self, e: int) -> FP8Weight:
        """Expert e as an FP8Weight (views of the stacked tensors)."""
        s = self.scale[e]
        return FP8Weight(self.data[e], s.reshape(1) if self.layout == "tensor" else s,
                         self.layout)

    def dequantize(self, dtype=torch.float32, experts: Optional[torch.Tensor] = None
                   ) -> torch.Tensor:
        """data * scale in `dtype`: [E, N, K], or with experts (an index tensor of any shape)
        the weights of those experts [*experts.shape, N, K]."""
        if experts is None:
            data, scale = self.data, self.scale
        else:   # gathered as bytes: every torch indexes uint8 (not every one e4m3)
            data = self.data.view(torch.uint8)[experts].view(self.data.dtype)
            scale = self.scale[experts]
        w = data.to(dtype)
        n, k = self.shape[1], self.shape[2]
        if self.layout == "tensor":
            return w * scale.to(dtype)[..., None, None]
        if self.layout == "channel":
            return w * scale.to(dtype)[..., None]
        full = scale.to(dtype).repeat_interleave(BLOCK, -2)[..., :n, :] \
            .repeat_interleave(BLOCK, -1)[..., :k]
        return w * full


def _experts_of(w) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(w, w_scale) for fusedist.ops.moe.grouped_gemm."""
    return (w.data, w.scale) if isinstance(w, FP8Experts) else (w, None)


# ---- expert parallelism: the exchange -----------------------------------------------------

def token_share(tokens: int, world: int, rank: int) -> tuple[int, int]:
    """Rank `rank`'s balanced contiguous share [lo, hi) of `tokens` replicated tokens: the
    first tokens % world ranks take one more (shares may be empty: 1 token over 2 ranks)."""
    base, extra = divmod(tokens, world)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (1 if rank < extra else 0)


class ExpertExchange:
    """The fusedist.ep Buffers of expert-parallel MoE layers of one shape (group, hidden,
    experts, top-k, dtype), sized in model terms and shared by the layers (a model's sparse
    layers run one after another, so one exchange serves them all).

    reserve(max_tokens, graph_tokens) sizes them (collective over the group; the Runner
    calls it through the model with its largest step and its largest captured step):
      * on CUDA, for steps of up to graph_tokens tokens, a Buffer of graph_tokens / world
        tokens per rank with every mode the group can run (the low-latency kernels, which a
        CUDA graph captures, where they run), and for larger steps a high-throughput Buffer of
        max_tokens / world tokens per rank (a low-latency buffer of prefill size would take
        GBs), where the group runs that mode;
      * on CPUs one Buffer of max_tokens / world tokens per rank (all-to-all over gloo).
    A layer that steps before anything was reserved reserves its own step's tokens (every
    rank runs the same step, so the call is collective); a step with more tokens per rank
    than the largest Buffer holds runs in pieces of that many (the same number on every
    rank). reserve() with more tokens than the Buffers hold makes new ones; the old ones stay
    open (a graph captured on them may still replay) until close().

    step(T, capturing) -> (buffer, mode, tokens per rank a call takes): the smallest Buffer
    that holds the step's share, in the mode the cost model predicts faster at that share
    (from values every rank shares: ranks with one token more or less agree); a captured step
    takes the low-latency mode, which must run here."""

    def __init__(self, group, hidden: int, num_experts: int, top_k: int, dtype):
        self.group, self.hidden, self.num_experts, self.top_k, self.dtype = \
            group, hidden, num_experts, top_k, dtype
        self.buffers: list = []         # ascending tokens per rank
        self.retired: list = []
        self.why_no_large = ""
        self._modes: dict = {}

    @property
    def world(self) -> int:
        return self.group.size

    def _buffer(self, per_rank: int, mode: str) -> Buffer:
        return Buffer(self.group, self.hidden, per_rank, self.num_experts, self.top_k,
                      self.dtype, mode=mode)

    def covers(self, max_tokens: int, graph_tokens: int = 0) -> bool:
        """The Buffers hold steps of max_tokens in one piece, and captured steps of
        graph_tokens in a low-latency Buffer (where one exists)."""
        if not self.buffers:
            return False
        W = self.world
        top = self.buffers[-1].max_tokens_per_rank
        if top < -(-max_tokens // W) and not (self.why_no_large and len(self.buffers) == 1):
            return False
        ll = [b for b in self.buffers if not b.why_not["low_latency"]]
        return not graph_tokens or not ll or ll[0].max_tokens_per_rank >= -(-graph_tokens // W)

    def reserve(self, max_tokens: int, graph_tokens: int = 0) -> None:
        """Size the Buffers (class docstring). Collective over the group."""
        for name, v in (("max_tokens", max_tokens), ("graph_tokens", graph_tokens)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                _fail(f"reserve: {name} must be an int >= 0, got {v!r}")
        max_tokens = max(max_tokens, graph_tokens, 1)
        if self.covers(max_tokens, graph_tokens):
            return
        W = self.world
        cuda = self.group.device.type == "cuda"
        small = -(-max(graph_tokens, 1) // W) if cuda and graph_tokens else None
        large = -(-max_tokens // W)
        new, why_no_large = [], ""
        try:
            if small is not None:
                new.append(self._buffer(small, "auto"))
            if small is None or large > small:
                if not cuda:
                    new.append(self._buffer(large, "auto"))
                else:
                    try:
                        new.append(self._buffer(large, "high_throughput"))
                    except ValueError as e:   # every rank alike: the group cannot run it
                        why_no_large = str(e)
                        if not new:   # the low-latency mode at that size, or an error why not
                            new.append(self._buffer(large, "auto"))
        except BaseException:
            for b in new:
                b.close()
            raise
        self.retired += self.buffers
        self.buffers, self.why_no_large, self._modes = new, why_no_large, {}

    def step(self, tokens: int, capturing: bool) -> tuple:
        """(buffer, mode, tokens per rank one call takes) for a step of `tokens` tokens."""
        per_rank = -(-tokens // self.world)
        if not self.buffers:
            if capturing:
                _fail("the expert-parallel exchange has no Buffer yet, and a CUDA-graph capture "
                      "cannot make one (a collective allocation): call reserve(max_tokens, "
                      "graph_tokens) first (fusedist.models.Runner does, through the model)",
                      RuntimeError)
            self.reserve(tokens)
        if capturing:
            ll = [b for b in self.buffers if not b.why_not["low_latency"]]
            if not ll:
                _fail("a CUDA-graph capture of an expert-parallel step needs the Buffer's "
                      "low-latency mode, which cannot run here ("
                      f"{self.buffers[0].why_not['low_latency']}); run this step eagerly "
                      "(Runner(cuda_graphs=False), --no-graphs)", RuntimeError)
            return ll[0], "low_latency", ll[0].max_tokens_per_rank
        fits = [b for b in self.buffers if b.max_tokens_per_rank >= per_rank]
        buf = fits[0] if fits else self.buffers[-1]
        cap = buf.max_tokens_per_rank
        key = (id(buf), min(per_rank, cap))
        mode = self._modes.get(key)
        if mode is None:
            ok = [m for m in ("low_latency", "high_throughput") if not buf.why_not[m]]
            mode = min(ok, key=lambda m: sum(buf.predict(m, key[1])[f] for f in
                                             ("dispatch_us", "combine_us")))
            self._modes[key] = mode
        return buf, mode, cap

    def close(self) -> None:
        """Close every Buffer (collective)."""
        bufs, self.buffers, self.retired = self.retired + self.buffers, [], []
        for b in bufs:
            b.close()


# ---- the layer -------------------------------------------------------------------------------

def _param(t: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(t, requires_grad=False)


class MoE(torch.nn.Module):
    """A tensor-parallel mixture-of-experts SwiGLU MLP (module docstring)."""

    def __init__(self, hidden_size: int, num_experts: int, intermediate_size: int,
                 router: RouterSpec, *, shared_intermediate_size: int = 0,
                 group: GroupLike = None, dtype=None, device=None,
                 fp8_layout: Optional[str] = None, ep: bool = False):
        super().__init__()
        if group is not None or is_initialized():
            g = group.group if isinstance(group, Communicator) else resolve_group(group)
            self.tp_size, self.tp_rank, default_device = g.size, g.rank, g.device
        else:   # no fusedist.init(): a single-process layer
            g = None
            self.tp_size, self.tp_rank, default_device = 1, 0, torch.device("cpu")
        if not isinstance(ep, bool):
            _fail(f"ep must be True or False, got {ep!r}", TypeError)
        device = torch.device(device) if device is not None else default_device
        dtype = dtype if dtype is not None else torch.get_default_dtype()
        if dtype not in (torch.bfloat16, torch.float16, torch.float32):
            _fail(f"dtype must be torch.bfloat16, torch.float16 or torch.float32 (the "
                  f"activations' and bf16 experts' dtype; FP8 experts: fp8_layout=), got "
                  f"{dtype!r}", TypeError)
        for name, v, lo in (("hidden_size", hidden_size, 1), ("num_experts", num_experts, 1),
                            ("intermediate_size", intermediate_size, 1),
                            ("shared_intermediate_size", shared_intermediate_size, 0)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                _fail(f"{name} must be an int >= {lo}, got {v!r}")
        if not isinstance(router, RouterSpec):
            _fail(f"router must be a fusedist.ops.moe.RouterSpec, got {type(router).__name__}",
                  TypeError)
        router.check(num_experts)   # top-k, groups, scaling that fit num_experts
        # Expert parallelism shards the experts over the group (whole intermediates); without
        # it every expert's intermediate is split. The shared expert is split either way.
        self.ep_size = self.tp_size if ep else 1
        self.ep_rank = self.tp_rank if ep else 0
        if ep and num_experts % self.ep_size:
            _fail(f"ep=True shards the experts over the group: num_experts={num_experts} is not "
                  f"divisible by the group's size {self.ep_size}; use a group size among "
                  f"{[w for w in range(1, num_experts + 1) if num_experts % w == 0]}, or ep=False")
        expert_split = 1 if ep else self.tp_size
        for name, n, split in (("intermediate_size", intermediate_size, expert_split),
                               ("shared_intermediate_size", shared_intermediate_size,
                                self.tp_size)):
            if n % split:
                _fail(f"{name}={n} is not divisible by the tensor-parallel size {split}; "
                      "pick a size that divides it")
        if fp8_layout is not None:
            if fp8_layout not in LAYOUTS:
                _fail(f"fp8_layout must be None or one of {LAYOUTS}, got {fp8_layout!r}")
            if FP8 is None:
                _fail("fp8_layout needs a torch with float8_e4m3fn", RuntimeError)
            for name, n, split in (("intermediate_size", intermediate_size, expert_split),
                                   ("shared_intermediate_size", shared_intermediate_size,
                                    self.tp_size)):
                if fp8_layout == "block" and n and (n // split) % BLOCK:
                    what = f"{name} / tp = {n} / {split} = {n // split}" if split > 1 else \
                        f"{name} = {n} (whole experts: ep)"
                    _fail(f"block-scaled FP8 experts stack gate | up in whole 128-row blocks, "
                          f"and {what} is not a multiple of 128; pick a tp whose shards are "
                          "whole blocks, or per-channel scales")
        self.hidden_size, self.num_experts, self.spec = hidden_size, num_experts, router
        self.inter = intermediate_size // expert_split
        self.shared_inter = shared_intermediate_size // self.tp_size
        self.dtype, self.fp8_layout = dtype, fp8_layout
        # The experts this rank holds: global ids [expert_start, expert_start + local_experts),
        # local expert l at index l of w13 / w2 (fusedist.ep's balanced map).
        self.local_experts = num_experts // self.ep_size
        self.expert_start = self.ep_rank * self.local_experts
        self.group = g
        # The dispatch / combine Buffers (expert parallelism over more than one rank only);
        # layers of one shape may share one (the models' sparse layers do).
        self.exchange = ExpertExchange(g, hidden_size, num_experts, router.top_k, dtype) \
            if self.ep_size > 1 else None
        E, H, I = self.local_experts, hidden_size, self.inter   # E: the experts held here
        self.router = _param(torch.zeros(num_experts, H, dtype=torch.float32, device=device))
        if fp8_layout is None:
            self.w13 = _param(torch.zeros(E, 2 * I, H, dtype=dtype, device=device))
            self.w2 = _param(torch.zeros(E, H, I, dtype=dtype, device=device))
        else:
            # gate | up of per-tensor weights: one scale per row (gate's, then up's)
            self.w13 = FP8Experts.empty(E, 2 * I, H, "channel" if fp8_layout == "tensor"
                                        else fp8_layout, device)
            self.w2 = FP8Experts.empty(E, H, I, fp8_layout, device)
        self.shared_gate_up = self.shared_down = self.shared_gate = None
        if self.shared_inter:
            S = self.shared_inter
            if fp8_layout is None:
                self.shared_gate_up = _param(torch.zeros(2 * S, H, dtype=dtype, device=device))
                self.shared_down = _param(torch.zeros(H, S, dtype=dtype, device=device))
            else:
                self.shared_gate_up = FP8Weight.empty(2 * S, H, fp8_layout, device)
                self.shared_down = FP8Weight.empty(H, S, fp8_layout, device)
            self.shared_gate = _param(torch.zeros(1, H, dtype=torch.float32, device=device))

    @property
    def device(self) -> torch.device:
        return self.router.device

    @property
    def ep(self) -> bool:
        """The experts are sharded over the group (expert parallelism over > 1 rank)."""
        return self.ep_size > 1

    @property
    def experts(self) -> range:
        """The global ids of the experts this rank holds (all of them without ep)."""
        return range(self.expert_start, self.expert_start + self.local_experts)

    def reserve(self, max_tokens: int, graph_tokens: int = 0) -> None:
        """Size the expert-parallel exchange for steps of up to max_tokens tokens, of which
        those up to graph_tokens may be captured in CUDA graphs (ExpertExchange.reserve).
        Collective over the group: every rank calls it with the same values. Nothing without
        ep."""
        if self.exchange is not None:
            self.exchange.reserve(max_tokens, graph_tokens)

    def close(self) -> None:
        """Release the expert-parallel Buffers (collective; nothing without ep)."""
        if self.exchange is not None:
            self.exchange.close()

    # ---- weights ---------------------------------------------------------------------------
    def _check_kind(self, what: str, w, shape: tuple) -> None:
        fp8 = isinstance(w, FP8Weight)
        if fp8 != (self.fp8_layout is not None):
            _fail(f"{what} is {'an FP8Weight' if fp8 else 'a tensor'}; this layer was built "
                  f"with fp8_layout={self.fp8_layout!r} (FP8Weights exactly when it is set)")
        if not fp8 and not isinstance(w, torch.Tensor):
            _fail(f"{what} must be a tensor or an FP8Weight, got {type(w).__name__}", TypeError)
        if tuple(w.shape) != shape:
            _fail(f"{what} must be {list(shape)} (this rank's shard), got {list(w.shape)}")
        if fp8 and w.layout != self.fp8_layout:
            _fail(f"{what} has {w.layout} scales; this layer holds {self.fp8_layout} scales")

    @torch.no_grad()
    def load_router(self, w: torch.Tensor) -> "MoE":
        """The router's weight [E, hidden] (replicated; kept in float32)."""
        if not isinstance(w, torch.Tensor) or tuple(w.shape) != tuple(self.router.shape) or \
                not w.is_floating_point():
            _fail(f"the router weight must be a float tensor {list(self.router.shape)} "
                  f"(num_experts x hidden), got {getattr(w, 'dtype', type(w).__name__)} "
                  f"{list(getattr(w, 'shape', ()))}")
        self.router.copy_(w)
        return self

    @torch.no_grad()
    def load_expert(self, e: int, gate, up, down) -> "MoE":
        """Expert e's shard on this rank: gate and up rows [I/tp, hidden], down columns
        [hidden, I/tp]; tensors, or FP8Weights (of the layer's fp8_layout). With ep, e is one
        of this rank's experts (self.experts) and the shard is the whole expert: gate and up
        [I, hidden], down [hidden, I]."""
        if isinstance(e, bool) or not isinstance(e, int) or not 0 <= e < self.num_experts:
            _fail(f"expert index must be an int in [0, {self.num_experts}), got {e!r}")
        if e not in self.experts:
            _fail(f"expert {e} lives on rank {e // self.local_experts} of the expert-parallel "
                  f"group; this rank (rank {self.ep_rank}) holds experts "
                  f"[{self.experts.start}, {self.experts.stop}): load only those")
        H, I = self.hidden_size, self.inter
        for what, w, shape in (("gate", gate, (I, H)), ("up", up, (I, H)),
                               ("down", down, (H, I))):
            self._check_kind(f"expert {e} {what}", w, shape)
        l = e - self.expert_start   # noqa: E741 - the local expert's index
        if self.fp8_layout is None:
            self.w13[l, :I].copy_(gate)
            self.w13[l, I:].copy_(up)
            self.w2[l].copy_(down)
        else:
            what = f"expert {e} gate | up rows"
            self.w13.set_expert(l, FP8Weight.cat_rows([gate.to(self.device), up.to(self.device)],
                                                      what), what)
            self.w2.set_expert(l, down.to(self.device), f"expert {e} down")
        return self

    @torch.no_grad()
    def load_shared(self, gate, up, down, gate_weight: torch.Tensor) -> "MoE":
        """The shared expert's shard: gate / up rows [S/tp, hidden], down columns [hidden,
        S/tp] (tensors or FP8Weights), and its gate's weight [1, hidden] (replicated)."""
        if not self.shared_inter:
            _fail("this layer has no shared expert (shared_intermediate_size=0)")
        H, S = self.hidden_size, self.shared_inter
        for what, w, shape in (("shared gate", gate, (S, H)), ("shared up", up, (S, H)),
                               ("shared down", down, (H, S))):
            self._check_kind(what, w, shape)
        if not isinstance(gate_weight, torch.Tensor) or tuple(gate_weight.shape) != (1, H):
            _fail(f"the shared expert's gate weight must be [1, {H}], got "
                  f"{list(getattr(gate_weight, 'shape', ()))}")
        if self.fp8_layout is None:
            self.shared_gate_up[:S].copy_(gate)
            self.shared_gate_up[S:].copy_(up)
            self.shared_down.copy_(down)
        else:
            self.shared_gate_up = FP8Weight.cat_rows([gate, up], "shared expert gate | up "
                                                     "rows").to(self.device)
            self.shared_down = down.to(self.device)
        self.shared_gate.copy_(gate_weight)
        return self

    def takes_fp8_input(self, rows: int) -> bool:
        """The layer takes x in the model dtype (its first op permutes the rows)."""
        return False

    # ---- forward -----------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> this rank's partial [T, hidden] (module docstring)."""
        if isinstance(x, FP8Rows) or not isinstance(x, torch.Tensor) or x.dim() != 2 or \
                x.shape[1] != self.hidden_size or x.dtype != self.dtype:
            _fail(f"x must be a [tokens, {self.hidden_size}] {self.dtype} tensor, got "
                  f"{getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))}")
        if x.shape[0] == 0:
            return x.new_zeros(x.shape)
        if self.ep:
            return self._forward_ep(x)
        side = None
        if self.shared_inter and x.is_cuda:
            main = torch.cuda.current_stream(x.device)
            side = comm_stream(x.device, 1)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                shared = self._shared(x)
            x.record_stream(side)
        elif self.shared_inter:
            shared = self._shared(x)
        else:
            shared = None
        ids, weights = self.routing(x)
        layout = sort_by_expert(ids, self.num_experts)
        y = self._experts(x, layout)
        if y.dtype != x.dtype:   # FP8 GEMMs write bf16; a float32 model takes them as they are
            y = y.to(x.dtype)
        if side is not None:
            main.wait_stream(side)
            shared.record_stream(main)
        return unpermute(y, layout, weights, residual=shared)

    def _forward_ep(self, x: torch.Tensor) -> torch.Tensor:
        """Expert parallelism (module docstring): this rank's share of the tokens through the
        exchange, into an otherwise-zero partial (plus the shared expert's partial)."""
        if torch.compiler.is_compiling():
            _fail("expert parallelism (ep=True) does not run under torch.compile: its exchange "
                  "makes host-side calls; compile a model built with ep=False", RuntimeError)
        T = x.shape[0]
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        main = side = shared = None
        if self.shared_inter and x.is_cuda:
            main = torch.cuda.current_stream(x.device)
            side = comm_stream(x.device, 1)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                shared = self._shared(x)
            x.record_stream(side)
        elif self.shared_inter:
            shared = self._shared(x)
        # Every rank routes all T tokens (the same logits, to the bit, as one rank holding
        # every expert: a GEMM's rows can round differently at another row count), then
        # dispatches its share.
        ids, weights = self.routing(x)
        buf, mode, cap = self.exchange.step(T, capturing)
        lo, hi = token_share(T, self.ep_size, self.ep_rank)
        per_rank = -(-T // self.ep_size)
        out = torch.zeros_like(x)
        for p in range(-(-per_rank // cap)):   # the same count on every rank
            a = min(lo + p * cap, hi)
            b = min(a + cap, hi)
            recv_x, counts, handle = buf.dispatch(x[a:b], ids[a:b], weights[a:b], mode=mode)
            y = self._received_experts(recv_x, counts, handle, min(per_rank, cap))
            out[a:b] = buf.combine(y, handle)
        if side is not None:
            main.wait_stream(side)
            shared.record_stream(main)
        if shared is not None:
            out.add_(shared)
        return out

    def _received_experts(self, recv_x: torch.Tensor, counts: torch.Tensor, handle,
                          tokens: int) -> torch.Tensor:
        """This rank's experts over the rows a dispatch brought ([R, H], grouped by local
        expert, counts int32 [L]): the layout of the received segments (no permute: the rows
        are in expert order already), gate|up, silu_mul, down -> [R, H] in recv_x's dtype.
        tokens: tokens per rank of the step, whose (token, slot) pairs pick the kernel as a
        step of that many pairs on one rank would (the low-latency R is a capacity)."""
        R, H = recv_x.shape
        if R == 0:
            return recv_x.new_empty(0, H)
        dev = recv_x.device
        offsets = handle.recv_offsets
        if offsets is None:
            offsets = torch.zeros(self.local_experts + 1, dtype=torch.int32, device=dev)
            offsets[1:] = torch.cumsum(counts, 0)
        rows = torch.arange(R, dtype=torch.int32, device=dev)
        layout = MoeLayout(counts, offsets, rows, rows, 1, 1)
        y = self._experts(recv_x, layout, permuted=True, pairs=tokens * self.spec.top_k)
        return y if y.dtype == recv_x.dtype else y.to(recv_x.dtype)

    def routing(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids int32 [T, k], weights float32 [T, k]): the router's logits in float32 routed
        by the layer's RouterSpec."""
        return route(F.linear(x.float(), self.router), self.spec)

    def _shared(self, x: torch.Tensor) -> torch.Tensor:
        """sigmoid(x @ g^T) * shared_expert(x), this rank's partial, in x's dtype."""
        h = linear(x, self.shared_gate_up)
        y = linear(_silu_mul(h), self.shared_down)
        g = torch.sigmoid(F.linear(x.float(), self.shared_gate))
        return (g * y.float()).to(x.dtype)

    def _experts(self, x: torch.Tensor, layout: MoeLayout, permuted: bool = False,
                 pairs: Optional[int] = None) -> torch.Tensor:
        """The routed experts' outputs, [layout.rows, H] in the layout's (permuted) order.
        x: in token order, or (permuted) the layout's rows already (an expert-parallel
        dispatch's); pairs: the (token, slot) pairs that pick the kernel (default the
        layout's)."""
        w13, s13 = _experts_of(self.w13)
        w2, s2 = _experts_of(self.w2)
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        if w13.dtype not in GEMM_W_DTYPES:   # float32 / float16: the op's reference
            if capturing:
                _fail(f"a CUDA-graph capture needs the grouped GEMM kernel, which takes "
                      f"bfloat16 or FP8 experts; these are {w13.dtype} (the plain-torch "
                      "reference reads the routing on the host): run this step eagerly "
                      "(Runner(cuda_graphs=False))", RuntimeError)
            h = grouped_gemm_reference(x if permuted else permute(x, layout), w13, layout)
            return grouped_gemm_reference(_silu_mul(h), w2, layout)
        # The tuning table's choice for this many pairs decides the activations' form: bf16 x
        # read in token order by the grouped GEMV (gather), or permuted rows for the GEMM, in
        # e4m3 where the experts are FP8 (the GEMM multiplies e4m3 operands only).
        pairs = layout.tokens * layout.top_k if pairs is None else pairs
        want = preferred_path(x.device, pairs) if x.is_cuda else None
        if permuted:
            gather = False
            path = want if want is not None else gemm_plan(x, w13, layout).path
        elif want == "gemv" or (want is None and
                                gemm_plan(x, w13, layout, gather=True).path == "gemv"):
            path, gather = "gemv", True
        else:
            gather = False
            path = want if want is not None else gemm_plan(x, w13, layout).path
        if capturing and path == "reference":
            _fail("a CUDA-graph capture needs the grouped GEMM kernel: its plain-torch "
                  f"reference reads the routing on the host ({gemm_why_not(x, w13)}); "
                  "run this step eagerly (Runner(cuda_graphs=False))", RuntimeError)
        quant = self._x_quant(path)
        gemm = _grouped_gemm_on(path) if permuted else grouped_gemm
        if gather:
            h = grouped_gemm(x, w13, layout, w_scale=s13, gather=True)
        elif quant is None:
            h = gemm(x if permuted else permute(x, layout), w13, layout, w_scale=s13)
        else:
            if permuted:
                xq, sx = quantize_groups(x) if quant == "group" else _quantize_rows(x)
            else:
                xq, sx = permute(x, layout, quant=quant)
            h = gemm(xq, w13, layout, w_scale=s13, x_scale=sx)
        down_quant = self._x_quant(path)
        if down_quant is None:
            return gemm(_silu_mul(h), w2, layout, w_scale=s2)
        if down_quant == "token" and self.inter % 8 == 0:
            aq, sa = silu_mul(h, out_dtype=FP8)
        else:
            aq, sa = quantize_groups(_silu_mul(h)) if down_quant == "group" else \
                _quantize_rows(_silu_mul(h))
        return gemm(aq, w2, layout, w_scale=s2, x_scale=sa)

    def _x_quant(self, path: str) -> Optional[str]:
        """How the activations reach grouped-GEMM path `path`: None (the model dtype; the
        weight-only paths and bf16 weights), or e4m3 in permute's quant format where the FP8
        GEMM kernel multiplies e4m3 operands: "group" (1 x 128 scales) for block weights,
        "token" for per-tensor / per-channel ones."""
        if self.fp8_layout is None or path != "gemm":
            return None
        return "group" if self.fp8_layout == "block" else "token"

    def extra_repr(self) -> str:
        s = self.spec
        split = 1 if self.ep else self.tp_size
        return (f"hidden={self.hidden_size}, experts={self.num_experts}, top_k={s.top_k}, "
                f"intermediate={self.inter * split} (per rank {self.inter}), "
                f"tp={self.tp_size}"
                + (f", ep={self.ep_size} (experts {self.experts.start}..{self.experts.stop - 1}"
                   " here)" if self.ep else "")
                + (f", shared={self.shared_inter * self.tp_size}" if self.shared_inter else "")
                + (f", fp8 {self.fp8_layout} scales" if self.fp8_layout else ""))


def _grouped_gemm_on(path: str):
    """grouped_gemm with the kernel `path` ("gemv" / "gemm") where that kernel takes the call,
    as the op's plan would pick it for `pairs` pairs rather than for the layout's rows (an
    expert-parallel receive buffer's rows are its capacity); the op's own plan otherwise."""
    def call(x, w, layout, *, w_scale=None, x_scale=None):
        if path in ("gemv", "gemm") and x.is_cuda and \
                not gemm_why_not(x, w, path, layout, w_scale=w_scale, x_scale=x_scale):
            p = gemm_plan(x, w, layout, w_scale=w_scale, x_scale=x_scale, path=path)
            return gemm_run(p, x, w, layout, w_scale=w_scale, x_scale=x_scale)
        return grouped_gemm(x, w, layout, w_scale=w_scale, x_scale=x_scale)
    return call


def _silu_mul(h: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of h [rows, 2 I]: fusedist.silu_mul (its kernel on CUDA, its plain-torch
    reference elsewhere) where I is whole 16-byte vectors, the same math in torch ops else."""
    inter = h.shape[-1] // 2
    if inter % 8 == 0:
        return silu_mul(h)
    return (F.silu(h[:, :inter].float()) * h[:, inter:].float()).to(h.dtype)


def _quantize_rows(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 rows, float32 [rows] scales) of a, one scale per row."""
    q, s = quantize_rows(a)
    return q, s.reshape(-1)


__all__ = ["MoE", "FP8Experts", "RouterSpec", "ExpertExchange", "token_share"]
