"""The mixture-of-experts decoders (Mixtral, Qwen2-MoE, Qwen3-MoE: cfg.moe) on the Llama
skeleton: the same Transformer (attention, norms, the fused all-reduce + residual + RMSNorm
after each half of a layer, the LM head, the paged cache), with the MLP of each sparse layer a
fusedist.nn.MoE and its loader reading the router, the experts and the shared expert
(weights.moe_names). Layers the config leaves dense (Qwen's mlp_only_layers,
decoder_sparse_step) keep the dense MLP of intermediate_size.

ep=True (expert parallelism, the fusedist model only): each sparse layer's experts are
sharded over the tensor-parallel group (num_experts / tp whole experts a rank, each rank
reading only its experts' tensors), attention stays tensor-parallel, and the sparse layers
share one fusedist.nn.moe.ExpertExchange, sized by reserve_tokens() (the Runner calls it) and
released by close().

    MoeTransformer       fusedist's model (fusedist.nn.MoE: the fusedist.ops.moe ops)
    TorchMoeTransformer  the plain-torch baseline on the same config and weights (TorchMoE)

TorchMoE, the baseline's layer, routes in torch ops (softmax over the float32 logits, topk,
renormalization) and runs the experts in one of three plain-torch forms, the strongest each
step can take:
  "grouped_mm"  the (token, slot) pairs sorted by expert (argsort, a scatter-add of counts, a
                cumsum: no host synchronization) and torch._grouped_mm for gate|up and down,
                where this torch has it and it gives the float64 result on the device (checked
                once per device and shape outside capture; FP8 experts are dequantized to the
                model dtype for it); FP8 experts take it only when a step routes at least as many
                pairs as there are experts (below that, "gather" reads fewer weight bytes);
  "loop"        Hugging Face's expert loop: for each expert with tokens, its rows selected by
                index (the hit experts read on the host: eager only);
  "gather"      gpt-fast's form for steps that are captured or compiled: each (token, slot)'s
                expert weights gathered by id and multiplied by batched matmuls (reads T k
                experts' weights; no host synchronization).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...nn.moe import FP8Experts, MoE
from ...ops.moe import RouterSpec
from .baseline import TorchTransformer, torch_linear
from .model import Transformer
from .weights import moe_names


class MoeLayers:
    """What the MoE decoders change in Transformer / TorchTransformer: each sparse layer's MLP
    (_moe_class(), built by _mlp) and its loading (_load_mlp)."""

    _moe_class = MoE

    def _mlp(self, layer: int) -> torch.nn.Module:
        cfg = self.cfg
        if not cfg.sparse(layer):
            return super()._mlp(layer)
        m = cfg.moe
        mlp = self._moe_class(cfg.hidden_size, m.num_experts, m.intermediate_size,
                              RouterSpec(top_k=m.top_k, renormalize=m.renormalize),
                              shared_intermediate_size=m.shared_intermediate_size,
                              group=self.comm, dtype=self.dtype, device=self.device,
                              fp8_layout=self.fp8_layout, ep=self.ep)
        if mlp.exchange is not None:
            # One exchange (its Buffers) for every sparse layer: they run one after another.
            first = getattr(self, "_ep_exchange", None)
            if first is None:
                self._ep_exchange = mlp.exchange
            else:
                mlp.exchange = first
        return mlp

    def _sparse_mlps(self) -> list:
        return [layer.mlp for i, layer in enumerate(self.layers) if self.cfg.sparse(i)]

    def reserve_tokens(self, max_tokens: int, graph_tokens: int = 0) -> None:
        """Size the expert-parallel exchange for steps of up to max_tokens tokens, those up to
        graph_tokens captured in CUDA graphs (fusedist.nn.moe.ExpertExchange.reserve; the
        Runner calls it). Collective over the group; nothing without ep."""
        exchange = getattr(self, "_ep_exchange", None)
        if exchange is not None:
            exchange.reserve(max_tokens, graph_tokens)

    def close(self) -> None:
        """Release the expert-parallel Buffers (collective; nothing without ep)."""
        exchange = getattr(self, "_ep_exchange", None)
        if exchange is not None:
            exchange.close()

    @torch.no_grad()
    def _load_mlp(self, i: int, mlp, src, rd, proj) -> None:
        cfg = self.cfg
        if not cfg.sparse(i):
            return super()._load_mlp(i, mlp, src, rd, proj)
        names, r = moe_names(cfg, i), self.rank
        mlp.load_router(rd(names.router))
        if mlp.ep:   # this rank's experts, whole
            for e in mlp.experts:
                gate, up, down = names.experts[e]
                mlp.load_expert(e, proj(gate, None, 0, None), proj(up, None, 0, None),
                                proj(down, None, 0, None))
        else:
            inter = cfg.moe.intermediate_size // self.tp
            i0, i1 = r * inter, (r + 1) * inter
            for e, (gate, up, down) in enumerate(names.experts):
                mlp.load_expert(e, proj(gate, 0, i0, i1), proj(up, 0, i0, i1),
                                proj(down, 1, i0, i1))
        if names.shared:
            s = cfg.moe.shared_intermediate_size // self.tp
            gate, up, down = names.shared
            mlp.load_shared(proj(gate, 0, r * s, (r + 1) * s), proj(up, 0, r * s, (r + 1) * s),
                            proj(down, 1, r * s, (r + 1) * s), rd(names.shared_gate))

    def _takes_fp8(self, module, rows: int) -> bool:
        # The norm before every layer's MLP writes one format (layer 0's MLP answers for all):
        # FP8Rows only where every MLP takes them, and a MoE layer takes the model dtype.
        mlps = [layer.mlp for layer in self.layers]
        if module is mlps[0]:
            return super()._takes_fp8(module, rows) and \
                all(m.takes_fp8_input(rows) for m in mlps)
        return super()._takes_fp8(module, rows)


class MoeTransformer(MoeLayers, Transformer):
    """fusedist's Transformer with fusedist.nn.MoE in its sparse layers (module docstring)."""


# ---- the plain-torch baseline -------------------------------------------------------------------

FORMS = ("grouped_mm", "loop", "gather")
# (device index, N, K, weight dtype) -> whether torch._grouped_mm gave the float64 result there
# (checked once, outside capture and compilation).
_grouped_mm_ok: dict = {}


def _weights(w, dtype, experts=None) -> torch.Tensor:
    """Expert weights in `dtype`: all [E, N, K], or those of the index tensor experts."""
    if isinstance(w, FP8Experts):
        return w.dequantize(dtype, experts)
    w = w if experts is None else w[experts]
    return w if w.dtype == dtype else w.to(dtype)


def _grouped_mm_works(x: torch.Tensor, n: int, k: int) -> bool:
    """torch._grouped_mm runs for [*, k] x [E, k, n] on x's device and gives the float64
    result (within bf16 rounding); checked once per (device, n, k), never while capturing or
    compiling (then False until an eager call has checked)."""
    if not x.is_cuda or x.dtype != torch.bfloat16 or not hasattr(torch, "_grouped_mm"):
        return False
    key = (x.device.index, n, k)
    if key in _grouped_mm_ok:
        return _grouped_mm_ok[key]
    if torch.cuda.is_current_stream_capturing() or torch.compiler.is_compiling():
        return False
    try:
        g = torch.Generator(device=x.device).manual_seed(0)
        a = torch.randn(40, k, generator=g, device=x.device).to(torch.bfloat16)
        b = torch.randn(3, n, k, generator=g, device=x.device).to(torch.bfloat16)
        offs = torch.tensor([7, 7, 40], dtype=torch.int32, device=x.device)
        y = torch._grouped_mm(a, b.transpose(1, 2), offs=offs).double()
        ref = torch.cat([a[:7].double() @ b[0].double().t(), a[7:].double() @ b[2].double().t()])
        ok = bool(((y - ref).norm() / ref.norm()).item() <= 2.0 ** -7)
    except (RuntimeError, TypeError, ValueError, NotImplementedError):
        ok = False
    _grouped_mm_ok[key] = ok
    return ok


class TorchMoE(MoE):
    """The MoE layer's parameters (same load_*) in plain torch (module docstring); experts
    tensor-parallel only (no ep)."""

    def __init__(self, *args, ep: bool = False, **kw):
        if ep:
            raise ValueError("fusedist.models: the plain-torch baseline shards every expert's "
                             "intermediate (tensor parallelism); expert parallelism (ep=True) "
                             "runs on the fusedist backend")
        super().__init__(*args, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T, k = x.shape[0], self.spec.top_k
        probs = torch.softmax(F.linear(x.float(), self.router), dim=-1)
        w, ids = torch.topk(probs, k, dim=-1)
        if self.spec.renormalize:
            w = w / w.sum(dim=-1, keepdim=True)
        form = self.form(x)
        if form == "grouped_mm":
            out = self._grouped_mm(x, ids, w)
        elif form == "loop":
            out = self._loop(x, ids, w)
        else:
            out = self._gather(x, ids, w)
        if self.shared_inter:
            h = torch_linear(x, self.shared_gate_up)
            s = torch_linear(F.silu(h[:, :self.shared_inter]) * h[:, self.shared_inter:],
                             self.shared_down)
            out = out + torch.sigmoid(F.linear(x.float(), self.shared_gate)) * s.float()
        return out.to(x.dtype)

    def form(self, x: torch.Tensor) -> str:
        """The experts' form for this step (module docstring)."""
        static = torch.compiler.is_compiling() or \
            (x.is_cuda and torch.cuda.is_current_stream_capturing())
        fp8 = isinstance(self.w13, FP8Experts)
        if _grouped_mm_works(x, 2 * self.inter, self.hidden_size) and \
                _grouped_mm_works(x, self.hidden_size, self.inter) and \
                (not fp8 or x.shape[0] * self.spec.top_k >= self.num_experts):
            return "grouped_mm"
        return "gather" if static else "loop"

    def _loop(self, x, ids, w) -> torch.Tensor:
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        I = self.inter
        for e in torch.unique(ids).tolist():
            t, j = torch.where(ids == e)
            w13, w2 = _weights(self.w13, x.dtype, e), _weights(self.w2, x.dtype, e)
            h = F.linear(x[t], w13)
            y = F.linear(F.silu(h[:, :I]) * h[:, I:], w2)
            out.index_add_(0, t, y.float() * w[t, j, None])
        return out

    def _gather(self, x, ids, w) -> torch.Tensor:
        I = self.inter
        w13 = _weights(self.w13, x.dtype, ids)                     # [T, k, 2I, H]
        h = torch.einsum("th,tknh->tkn", x, w13)
        a = F.silu(h[..., :I]) * h[..., I:]
        y = torch.einsum("tki,tkhi->tkh", a, _weights(self.w2, x.dtype, ids))
        return (y.float() * w[..., None]).sum(dim=1)

    def _grouped_mm(self, x, ids, w) -> torch.Tensor:
        T, k = ids.shape
        E, I = self.num_experts, self.inter
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)                     # pairs by expert
        counts = torch.zeros(E, dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, flat.long(), torch.ones_like(flat, dtype=torch.int32))
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        tok = order // k
        xs = x.index_select(0, tok)
        h = torch._grouped_mm(xs, _weights(self.w13, x.dtype).transpose(1, 2), offs=offs)
        a = F.silu(h[:, :I]) * h[:, I:]
        y = torch._grouped_mm(a, _weights(self.w2, x.dtype).transpose(1, 2), offs=offs)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        return out.index_add_(0, tok, y.float() * w.reshape(-1)[order, None])


class TorchMoeTransformer(MoeLayers, TorchTransformer):
    """The plain-torch baseline of the MoE decoders (TorchMoE in the sparse layers)."""
    _moe_class = TorchMoE


__all__ = ["MoeTransformer", "TorchMoeTransformer", "TorchMoE", "FORMS"]
