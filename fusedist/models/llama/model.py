"""A tensor-parallel Llama-family decoder built from fusedist's layers and ops.

fusedist.nn.TPAttention over the paged KV cache, every GEMM through fusedist.gemm, the
all-reduce after each row-parallel linear fused with the residual add and the next RMSNorm
(fusedist.all_reduce_add_rmsnorm; at TP 1, with nothing to reduce, fusedist.add_rmsnorm), the
SwiGLU activation as fusedist.silu_mul (on CUDA; CPU tensors run the same math in torch ops).
The plain-torch baseline printed beside it (baseline.py) is a subclass that swaps these ops
for torch's, on the same config and weights.

Per layer (x: the layer's normed input, residual: the residual stream, both [T, hidden]):

    a = attention(x)                                   # qkv column-parallel, o row-parallel,
                                                       # returned before its all-reduce
    x, residual = all_reduce_add_rmsnorm(a, residual, post_attention_norm)
    m = down(silu(gate(x)) * up(x))                    # gate|up column-parallel (one GEMM),
                                                       # down row-parallel, before its all-reduce
    x, residual = all_reduce_add_rmsnorm(m, residual, next layer's input norm | final norm)

so a layer makes exactly two exchanges. The embedding is replicated (a lookup of T rows costs
no exchange and reads T rows; a vocab-parallel one would add an all-reduce per step for the
1 GB it saves per rank on Llama-3); the LM head is column-parallel over the (padded)
vocabulary, and its logits are all-gathered. At TP 1 there is no exchange at all: the
residual add and RMSNorm are one fusedist.add_rmsnorm kernel, which updates the residual
stream in place.

FP8 weights (quant=, a config.WeightQuant; build_model's quantize= or an FP8 checkpoint): q/k/v,
o, gate|up and down are fusedist.nn.quant.FP8Weight, their GEMMs fusedist.nn.linear.linear's
FP8 paths; embeddings, norms, the LM head, activations and the KV cache stay in the model
dtype (the cache is float8_e4m3fn when the runner asks for it: new_cache(kv_dtype=)), except where a projection's GEMM is row-wise torch._scaled_mm on an x it would quantize
per token itself (per-tensor / per-channel scales past the GEMV's rows on sm_90+:
fusedist.nn.quant.takes_fp8_rows). There the op before it writes e4m3 + per-token scales and
the GEMM takes them as they are: the norm before q/k/v (the previous layer's
all_reduce_add_rmsnorm / add_rmsnorm, or the first layer's rmsnorm) and the one before gate|up
hand them over as FP8Rows, silu_mul before down_proj as (q, scale). The residual stream stays
in the model dtype, and so does the final norm's output (the LM head is not FP8). Block scales
keep bf16 activations (their GEMM quantizes x per 1 x 128 group, not per token).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ...comm.communicator import get_communicator
from ...nn.attention import TPAttention, kv_head_range
from ...nn.kv_cache import PagedKVCache
from ...nn.linear import _gather_columns
from ...nn.linear import linear  # the GEMM dispatch shared with fusedist.nn.TPAttention
from ...nn.quant import FP8, FP8Rows, FP8Weight, takes_fp8_rows
from ...ops.add_rmsnorm import MAX_HIDDEN, add_rmsnorm
from ...ops.add_rmsnorm import rmsnorm as fused_rmsnorm
from ...ops.allreduce_rmsnorm import all_reduce_add_rmsnorm
from ...ops.attention import decode_plan
from ...ops.silu_mul import silu_mul
from .config import LlamaConfig, WeightQuant
from .weights import WeightSource, check_tp, check_weights, padded_vocab, read_projection


def _param(t: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(t, requires_grad=False)


def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), w, eps)


def _kernel_rows(t: torch.Tensor, width: int) -> bool:
    """fusedist's single-GPU kernels take rows of `width` elements of t: CUDA tensors, whole
    16-byte vectors (fusedist.add_rmsnorm also holds at most MAX_HIDDEN[dtype])."""
    return t.is_cuda and width % 8 == 0


def _normed(r: tuple) -> tuple:
    """(normed, residual) of a norm op's result; its FP8 form (q, residual, scale) as
    (FP8Rows(q, scale), residual)."""
    return r if len(r) == 2 else (FP8Rows(r[0], r[2]), r[1])


class MLP(torch.nn.Module):
    """SwiGLU, gate|up column-parallel (one GEMM for both), down row-parallel; returned before
    the down projection's all-reduce."""

    def __init__(self, cfg: LlamaConfig, tp: int, dtype, device, fp8_layout=None):
        super().__init__()
        self.inter = cfg.intermediate_size // tp
        self.dtype, self.fp8_layout = dtype, fp8_layout
        h = cfg.hidden_size
        if fp8_layout is None:
            # [gate_r; up_r]: one column-parallel GEMM for both.
            self.gate_up = _param(torch.empty(2 * self.inter, h, dtype=dtype, device=device))
            self.down = _param(torch.empty(h, self.inter, dtype=dtype, device=device))
        else:
            self.gate_up = FP8Weight.empty(2 * self.inter, h, fp8_layout, device)
            self.down = FP8Weight.empty(h, self.inter, fp8_layout, device)

    @torch.no_grad()
    def load_shard(self, gate, up, down):
        """This rank's gate / up rows and down_proj columns: tensors, or FP8Weights (gate|up
        stacked by FP8Weight.cat_rows)."""
        if self.fp8_layout is None:
            self.gate_up[:self.inter].copy_(gate)
            self.gate_up[self.inter:].copy_(up)
            self.down.copy_(down)
        else:
            self.gate_up = FP8Weight.cat_rows([gate, up], "MLP gate | up rows")
            self.down = down

    def takes_fp8_input(self, rows: int) -> bool:
        """Whether an x of `rows` tokens pays to come as FP8Rows: the gate|up GEMM would
        quantize a bf16 x per token for row-wise torch._scaled_mm (takes_fp8_rows)."""
        return takes_fp8_rows(rows, self.gate_up, self.gate_up.device, self.dtype)

    def forward(self, x):
        """x: [tokens, hidden] of the model's dtype, or FP8Rows for the gate|up GEMM."""
        gu = linear(x, self.gate_up)
        if _kernel_rows(gu, self.inter):
            if isinstance(self.down, FP8Weight) and \
                    takes_fp8_rows(gu.numel() // gu.shape[-1], self.down, gu.device, gu.dtype):
                # down's row-wise _scaled_mm takes silu_mul's e4m3 rows + per-token scales as
                # they are (no quantization pass of its own)
                q, s = silu_mul(gu, out_dtype=FP8)
                return linear(q, self.down, x_scale=s)
            return linear(silu_mul(gu), self.down)
        return linear(F.silu(gu[:, :self.inter]) * gu[:, self.inter:], self.down)


class Block(torch.nn.Module):
    def __init__(self, attn: torch.nn.Module, mlp: torch.nn.Module, hidden: int, dtype, device):
        super().__init__()
        self.attn = attn
        self.mlp = mlp
        self.input_norm = _param(torch.ones(hidden, dtype=dtype, device=device))
        self.post_norm = _param(torch.ones(hidden, dtype=dtype, device=device))


class Transformer(torch.nn.Module):
    """forward(tokens [T], positions [T], cache, meta, seq_rows=None, logits_rows=None) ->
    logits [n, vocab] (float of the model's dtype) for the rows logits_rows of the T tokens
    (all when None). meta is the step's fusedist.nn.AttentionMetadata; seq_rows [num_seqs]
    says which batch row of the cache each of meta's sequences is (the torch baseline's static
    cache needs it; the paged cache reads block_table instead).

    The ops a step runs are the methods below the weights (attention / mlp / norms / head /
    cache); the torch baseline (baseline.py) overrides exactly those."""
    backend = "fusedist"

    def __init__(self, cfg: LlamaConfig, *, group=None, dtype: torch.dtype = torch.bfloat16,
                 device=None, max_position: int = 0, quant: Optional[WeightQuant] = None,
                 ep: bool = False):
        super().__init__()
        self.cfg, self.dtype, self.quant = cfg, dtype, quant
        self.fp8_layout = quant.layout if quant is not None else None
        self.comm = get_communicator(group)
        self.tp, self.rank = self.comm.group.size, self.comm.group.rank
        check_tp(cfg, self.tp, quant, ep=ep)
        self.ep = ep    # a mixture of experts' experts sharded over the group (moe.py)
        device = torch.device(device) if device is not None else self.comm.device
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        limit, what = cfg.position_limit()
        self.max_position = max_position or limit
        if self.max_position > limit:
            raise ValueError(f"fusedist.models: max_position={self.max_position} exceeds {what} "
                             f"of {cfg.name or 'the model'}; keep context + prompt + new tokens "
                             f"<= {limit}")
        self.kv_first, kv_last = kv_head_range(cfg.num_kv_heads, self.tp, self.rank)
        self.local_kv_heads = kv_last - self.kv_first
        self.local_heads = cfg.num_heads // self.tp
        self.vocab_padded = padded_vocab(cfg, self.tp)
        self.vocab_shard = self.vocab_padded // self.tp
        self.embed = _param(torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype,
                                        device=device))
        self.layers = torch.nn.ModuleList(
            Block(self._attention(), self._mlp(i), cfg.hidden_size, dtype, device)
            for i in range(cfg.num_layers))
        self.norm = _param(torch.ones(cfg.hidden_size, dtype=dtype, device=device))
        self.lm_head = _param(torch.empty(self.vocab_shard, cfg.hidden_size, dtype=dtype,
                                          device=device))

    def _attention(self) -> torch.nn.Module:
        cfg = self.cfg
        return TPAttention(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                           qkv_bias=cfg.qkv_bias, o_bias=cfg.o_bias, rope_base=cfg.rope_theta,
                           rope_scaling=cfg.rope_scaling, max_position=self.max_position,
                           rope_style="neox", group=self.comm, dtype=self.dtype,
                           device=self.device, fp8_layout=self.fp8_layout,
                           qk_norm=cfg.qk_norm, qk_norm_eps=cfg.rms_norm_eps)

    # ---- weights -------------------------------------------------------------------------
    @torch.no_grad()
    def load(self, src: WeightSource, progress=None) -> "Transformer":
        """Fill every parameter with this rank's slices of `src` (progress(i, n) per layer),
        after checking every tensor's full shape and dtype against the config
        (weights.check_weights). Projections are read as self.quant says (FP8 from the
        checkpoint, quantized at load, or the model dtype)."""
        cfg, dt, dev, r = self.cfg, self.dtype, self.device, self.rank
        check_weights(src, cfg, self.quant)

        def rd(name, dim=None, start=0, stop=None):
            return src.read(name, dim, start, stop, dtype=dt, device=dev)

        def proj(name, dim, start, stop):
            return read_projection(src, name, self.quant, dim, start, stop, dtype=dt,
                                   device=dev, reduce_amax=self._max_over_ranks)

        self.embed.copy_(rd("model.embed_tokens.weight"))
        self.norm.copy_(rd("model.norm.weight"))
        v0 = r * self.vocab_shard
        v1 = min(v0 + self.vocab_shard, cfg.vocab_size)
        self.lm_head.zero_()
        if v1 > v0:
            if cfg.tie_word_embeddings:
                self.lm_head[:v1 - v0].copy_(self.embed[v0:v1])
            else:
                self.lm_head[:v1 - v0].copy_(rd("lm_head.weight", 0, v0, v1))
        hd, qn = cfg.head_dim, self.local_heads * cfg.head_dim
        k0, k1 = self.kv_first * hd, (self.kv_first + self.local_kv_heads) * hd
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            q = dict(q_w=proj(a + "q_proj", 0, r * qn, (r + 1) * qn),
                     k_w=proj(a + "k_proj", 0, k0, k1), v_w=proj(a + "v_proj", 0, k0, k1),
                     o_w=proj(a + "o_proj", 1, r * qn, (r + 1) * qn))
            if cfg.qkv_bias:
                q.update(q_b=rd(a + "q_proj.bias", 0, r * qn, (r + 1) * qn),
                         k_b=rd(a + "k_proj.bias", 0, k0, k1), v_b=rd(a + "v_proj.bias", 0, k0, k1))
            if cfg.o_bias:
                q.update(o_b=rd(a + "o_proj.bias"))      # replicated: added once (TPAttention)
            load_attention_shard(layer.attn, **q)
            if cfg.qk_norm:
                layer.attn.load_qk_norm(rd(a + "q_norm.weight"), rd(a + "k_norm.weight"))
            layer.input_norm.copy_(rd(p + "input_layernorm.weight"))
            layer.post_norm.copy_(rd(p + "post_attention_layernorm.weight"))
            self._load_mlp(i, layer.mlp, src, rd, proj)
            if progress is not None:
                progress(i + 1, cfg.num_layers)
        return self

    def _load_mlp(self, i: int, mlp, src: WeightSource, rd, proj) -> None:
        """Layer i's MLP from src: rd(name, dim, start, stop) reads a tensor in the model
        dtype, proj(name, dim, start, stop) a projection as self.quant holds it (the MoE
        decoders override this)."""
        m, r = f"model.layers.{i}.mlp.", self.rank
        inter = self.cfg.intermediate_size // self.tp
        i0, i1 = r * inter, (r + 1) * inter
        mlp.load_shard(proj(m + "gate_proj", 0, i0, i1), proj(m + "up_proj", 0, i0, i1),
                       proj(m + "down_proj", 1, i0, i1))

    def _max_over_ranks(self, t: torch.Tensor) -> torch.Tensor:
        """t's elementwise max over the tensor-parallel group (weights quantized at load take
        the whole weight's amax this way)."""
        if self.tp > 1:
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX,
                                         group=self.comm.group.pg)
        return t

    # ---- forward -------------------------------------------------------------------------
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache, meta,
                seq_rows: Optional[torch.Tensor] = None,
                logits_rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        eps = self.cfg.rms_norm_eps
        # Whether the norms before q/k/v and before gate|up write FP8Rows: every layer has the
        # same shapes, scale layout and dtype, so layer 0 answers for all.
        first, rows = self.layers[0], tokens.shape[0]
        attn_fp8, mlp_fp8 = self._takes_fp8(first.attn, rows), self._takes_fp8(first.mlp, rows)
        residual = F.embedding(tokens, self.embed)
        x = self._rmsnorm(residual, first.input_norm, eps, attn_fp8)
        n = len(self.layers)
        for i, layer in enumerate(self.layers):
            a = self._attend(layer.attn, x, positions, cache, i, meta, seq_rows)
            x, residual = self._add_rmsnorm(a, residual, layer.post_norm, eps, mlp_fp8)
            last = i + 1 == n   # the final norm feeds the LM head, in the model dtype
            nxt = self.norm if last else self.layers[i + 1].input_norm
            x, residual = self._add_rmsnorm(layer.mlp(x), residual, nxt, eps,
                                            attn_fp8 and not last)
        if logits_rows is not None:
            x = x.index_select(0, logits_rows)
        logits = self._gather_columns(self._head(x))
        return logits[:, :self.cfg.vocab_size]

    # ---- the ops of a step (the torch baseline overrides these) ---------------------------
    def _mlp(self, layer: int) -> torch.nn.Module:
        """Layer `layer`'s MLP module."""
        return MLP(self.cfg, self.tp, self.dtype, self.device, self.fp8_layout)

    def _attend(self, attn, x, positions, cache, layer, meta, seq_rows):
        return attn(x, positions, cache, layer, meta, reduce=False)

    def _takes_fp8(self, module, rows: int) -> bool:
        """Whether the norm before `module` (the attention: its q/k/v GEMM; the MLP: gate|up)
        writes e4m3 + per-token scales for a step of `rows` tokens: where that GEMM would
        quantize a bf16 x per token itself (module.takes_fp8_input: takes_fp8_rows)."""
        return module.takes_fp8_input(rows)

    def _add_rmsnorm(self, partial, residual, w, eps, fp8: bool = False):
        """(rmsnorm(all_reduce(partial) + residual), the new residual): one fused exchange at
        TP > 1; at TP 1 on CUDA one add_rmsnorm kernel, the residual updated in place. fp8: the
        normed rows as FP8Rows (e4m3 + per-token scales, written by the same kernel) where the
        norm is a kernel (at TP 1 on CUDA; every path of all_reduce_add_rmsnorm); the residual
        stays in the model dtype."""
        od = FP8 if fp8 else None
        if self.tp > 1:
            return _normed(all_reduce_add_rmsnorm(partial, residual, w, eps, out_dtype=od,
                                                  group=self.comm))
        if self._kernel_norm(partial):
            return _normed(add_rmsnorm(partial, residual, w, eps, out_dtype=od))
        h = partial + residual
        return rmsnorm(h, w, eps), h

    def _rmsnorm(self, h, w, eps, fp8: bool = False):
        """The first layer's input norm of the embeddings h (no exchange); fp8 as in
        _add_rmsnorm."""
        if not self._kernel_norm(h):
            return rmsnorm(h, w, eps)
        return FP8Rows(*fused_rmsnorm(h, w, eps, out_dtype=FP8)) if fp8 else \
            fused_rmsnorm(h, w, eps)

    @staticmethod
    def _kernel_norm(h) -> bool:
        n = h.shape[-1]
        return _kernel_rows(h, n) and n <= MAX_HIDDEN[h.dtype]

    def _head(self, x):
        return linear(x, self.lm_head)

    def _gather_columns(self, y):
        """[n, v/tp] on each rank -> [n, v], rank r's columns at block r."""
        return y if self.tp == 1 else _gather_columns(self.comm, y)

    # ---- cache ---------------------------------------------------------------------------
    def kv_bytes_per_token(self, kv_dtype: Optional[torch.dtype] = None) -> int:
        """Cache bytes per token on this rank: K and V of every layer in kv_dtype (default the
        model's dtype); float8_e4m3fn adds a float32 scale per token and kv head."""
        return PagedKVCache.bytes_per_page(self.cfg.num_layers, self.local_kv_heads,
                                           self.cfg.head_dim, 1,
                                           self.dtype if kv_dtype is None else kv_dtype)

    def new_cache(self, max_batch: int, max_seq_len: int, page_size: int, num_pages: int,
                  kv_dtype: Optional[torch.dtype] = None):
        """The KV cache the model reads: a PagedKVCache of num_pages pages in kv_dtype (default
        the model's dtype; float8_e4m3fn with per-token-head scales). max_batch and
        max_seq_len size the torch baseline's static cache."""
        return PagedKVCache(self.cfg.num_layers, self.local_kv_heads, self.cfg.head_dim,
                            num_pages, page_size=page_size, dtype=self.dtype, device=self.device,
                            kv_dtype=kv_dtype)

    def decode_plan(self, batch: int, page_size: int, max_seq_len: int,
                    kv_dtype: Optional[torch.dtype] = None):
        """The host-side plan of batch-`batch` decode attention over a kv_dtype cache (None for
        the torch baseline)."""
        return decode_plan(batch, self.local_heads, self.local_kv_heads, self.cfg.head_dim,
                           page_size, max_seq_len, self.device, self.dtype, kv_dtype)

    def flops_per_token(self, context: int) -> float:
        """Model FLOPs of one token at `context` cached tokens (2 per multiply-add; attention
        counted at its causal average when used for a prefill of `context` tokens)."""
        c = self.cfg
        return 2.0 * (c.active_params() - c.vocab_size * c.hidden_size) + \
            4.0 * c.num_layers * c.q_size * context


@torch.no_grad()
def load_attention_shard(attn, q_w, k_w, v_w, o_w, q_b=None, k_b=None, v_b=None, o_b=None):
    """Hand an attention module this rank's weight shards (q / k / v rows of its heads, o_proj
    columns; o_b, the o_proj bias, whole). fusedist.nn.TPAttention takes full weights in
    load_full(); writing its documented [q_r | k_r | v_r] qkv_weight (and qkv_bias) and
    o_weight directly keeps the rule that a rank reads only its slices of the checkpoint."""
    if hasattr(attn, "load_shard"):
        return attn.load_shard(q_w, k_w, v_w, o_w, q_b, k_b, v_b, o_b=o_b)
    if any(isinstance(w, FP8Weight) for w in (q_w, k_w, v_w, o_w)):
        raise TypeError(f"load_attention_shard: {type(attn).__name__} has no load_shard to take "
                        "FP8 weights")
    attn.qkv_weight.copy_(torch.cat((q_w, k_w, v_w)))
    if attn.qkv_bias is not None:
        attn.qkv_bias.copy_(torch.cat((q_b, k_b, v_b)))
    attn.o_weight.copy_(o_w)
    if o_b is not None:
        attn.o_bias.copy_(o_b)


__all__ = ["Transformer", "load_attention_shard", "rmsnorm"]
