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

CUDA graphs: the buffer's rows depend on T alone, the counts and offsets stay on the device,
and the shared expert's stream is forked from and joined to the caller's by events, so a
captured step replays with new routings. A path that reads the routing on the host (the
grouped GEMM's plain-torch reference, where its kernel does not run) refuses to be captured
with an error saying why.

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
from ..ops.moe import (MoeLayout, RouterSpec, grouped_gemm, grouped_gemm_reference, permute,
                       route, sort_by_expert, unpermute)
from ..ops.moe.grouped_gemm import W_DTYPES as GEMM_W_DTYPES
from ..ops.moe.grouped_gemm import plan as gemm_plan
from ..ops.moe.grouped_gemm import preferred_path
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


# ---- the layer -------------------------------------------------------------------------------

def _param(t: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(t, requires_grad=False)


class MoE(torch.nn.Module):
    """A tensor-parallel mixture-of-experts SwiGLU MLP (module docstring)."""

    def __init__(self, hidden_size: int, num_experts: int, intermediate_size: int,
                 router: RouterSpec, *, shared_intermediate_size: int = 0,
                 group: GroupLike = None, dtype=None, device=None,
                 fp8_layout: Optional[str] = None):
        super().__init__()
        if group is not None or is_initialized():
            g = group.group if isinstance(group, Communicator) else resolve_group(group)
            self.tp_size, self.tp_rank, default_device = g.size, g.rank, g.device
        else:   # no fusedist.init(): a single-process layer
            self.tp_size, self.tp_rank, default_device = 1, 0, torch.device("cpu")
        device = torch.device(device) if device is not None else default_device
        dtype = dtype if dtype is not None else torch.get_default_dtype()
        for name, v, lo in (("hidden_size", hidden_size, 1), ("num_experts", num_experts, 1),
                            ("intermediate_size", intermediate_size, 1),
                            ("shared_intermediate_size", shared_intermediate_size, 0)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                _fail(f"{name} must be an int >= {lo}, got {v!r}")
        if not isinstance(router, RouterSpec):
            _fail(f"router must be a fusedist.ops.moe.RouterSpec, got {type(router).__name__}",
                  TypeError)
        router.check(num_experts)   # top-k, groups, scaling that fit num_experts
        for name, n in (("intermediate_size", intermediate_size),
                        ("shared_intermediate_size", shared_intermediate_size)):
            if n % self.tp_size:
                _fail(f"{name}={n} is not divisible by the tensor-parallel size {self.tp_size}; "
                      "pick a size that divides it")
        if fp8_layout is not None:
            if fp8_layout not in LAYOUTS:
                _fail(f"fp8_layout must be None or one of {LAYOUTS}, got {fp8_layout!r}")
            if FP8 is None:
                _fail("fp8_layout needs a torch with float8_e4m3fn", RuntimeError)
            for name, n in (("intermediate_size", intermediate_size),
                            ("shared_intermediate_size", shared_intermediate_size)):
                if fp8_layout == "block" and n and (n // self.tp_size) % BLOCK:
                    _fail(f"block-scaled FP8 experts stack gate | up in whole 128-row blocks, "
                          f"and {name} / tp = {n} / {self.tp_size} = {n // self.tp_size} is "
                          "not a multiple of 128; pick a tp whose shards are whole blocks, or "
                          "per-channel scales")
        self.hidden_size, self.num_experts, self.spec = hidden_size, num_experts, router
        self.inter = intermediate_size // self.tp_size
        self.shared_inter = shared_intermediate_size // self.tp_size
        self.dtype, self.fp8_layout = dtype, fp8_layout
        E, H, I = num_experts, hidden_size, self.inter
        self.router = _param(torch.zeros(E, H, dtype=torch.float32, device=device))
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
        [hidden, I/tp]; tensors, or FP8Weights (of the layer's fp8_layout)."""
        if isinstance(e, bool) or not isinstance(e, int) or not 0 <= e < self.num_experts:
            _fail(f"expert index must be an int in [0, {self.num_experts}), got {e!r}")
        H, I = self.hidden_size, self.inter
        for what, w, shape in (("gate", gate, (I, H)), ("up", up, (I, H)),
                               ("down", down, (H, I))):
            self._check_kind(f"expert {e} {what}", w, shape)
        if self.fp8_layout is None:
            self.w13[e, :I].copy_(gate)
            self.w13[e, I:].copy_(up)
            self.w2[e].copy_(down)
        else:
            what = f"expert {e} gate | up rows"
            self.w13.set_expert(e, FP8Weight.cat_rows([gate.to(self.device), up.to(self.device)],
                                                      what), what)
            self.w2.set_expert(e, down.to(self.device), f"expert {e} down")
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

    def _experts(self, x: torch.Tensor, layout: MoeLayout) -> torch.Tensor:
        """The routed experts' outputs, [layout.rows, H] in the layout's (permuted) order."""
        w13, s13 = _experts_of(self.w13)
        w2, s2 = _experts_of(self.w2)
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        if w13.dtype not in GEMM_W_DTYPES:   # float32 / float16: the op's reference
            if capturing:
                _fail(f"a CUDA-graph capture needs the grouped GEMM kernel, which takes "
                      f"bfloat16 or FP8 experts; these are {w13.dtype} (the plain-torch "
                      "reference reads the routing on the host): run this step eagerly "
                      "(Runner(cuda_graphs=False))", RuntimeError)
            h = grouped_gemm_reference(permute(x, layout), w13, layout)
            return grouped_gemm_reference(_silu_mul(h), w2, layout)
        # The tuning table's choice for this many pairs decides the activations' form: bf16 x
        # read in token order by the grouped GEMV (gather), or permuted rows for the GEMM, in
        # e4m3 where the experts are FP8 (the GEMM multiplies e4m3 operands only).
        want = preferred_path(x.device, layout.tokens * layout.top_k) if x.is_cuda else None
        if want == "gemv" or (want is None and
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
        if gather:
            h = grouped_gemm(x, w13, layout, w_scale=s13, gather=True)
        elif quant is None:
            h = grouped_gemm(permute(x, layout), w13, layout, w_scale=s13)
        else:
            xq, sx = permute(x, layout, quant=quant)
            h = grouped_gemm(xq, w13, layout, w_scale=s13, x_scale=sx)
        down_quant = self._x_quant(path)
        if down_quant is None:
            return grouped_gemm(_silu_mul(h), w2, layout, w_scale=s2)
        if down_quant == "token" and self.inter % 8 == 0:
            aq, sa = silu_mul(h, out_dtype=FP8)
        else:
            aq, sa = quantize_groups(_silu_mul(h)) if down_quant == "group" else \
                _quantize_rows(_silu_mul(h))
        return grouped_gemm(aq, w2, layout, w_scale=s2, x_scale=sa)

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
        return (f"hidden={self.hidden_size}, experts={self.num_experts}, top_k={s.top_k}, "
                f"intermediate={self.inter * self.tp_size} (per rank {self.inter}), "
                f"tp={self.tp_size}" + (f", shared={self.shared_inter * self.tp_size}"
                                        if self.shared_inter else "")
                + (f", fp8 {self.fp8_layout} scales" if self.fp8_layout else ""))


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


__all__ = ["MoE", "FP8Experts", "RouterSpec"]
