"""A tensor-parallel Llama-family decoder built from fusedist's layers and ops.

One model, two op sets (the `backend` argument):
  "fusedist": fusedist.nn.TPAttention over the paged KV cache, every GEMM through
      fusedist.gemm, the all-reduce after each row-parallel linear fused with the residual
      add and the next RMSNorm (fusedist.all_reduce_add_rmsnorm; at TP 1, with nothing to
      reduce, fusedist.add_rmsnorm), the SwiGLU activation as fusedist.silu_mul (on CUDA;
      CPU tensors run the torch ops below);
  "torch": the same weights and math in plain torch (F.linear, SDPA over a static cache,
      F.rms_norm, F.silu, torch.distributed all_reduce): the baseline printed beside it.

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
"""

from __future__ import annotations

from typing import Optional

import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ...communicator import get_communicator
from ...nn.linear import linear  # the GEMM dispatch shared with fusedist.nn.TPAttention
from ...ops.add_rmsnorm import MAX_HIDDEN, add_rmsnorm
from ...ops.add_rmsnorm import rmsnorm as fused_rmsnorm
from ...ops.silu_mul import silu_mul
from .config import LlamaConfig
from .weights import WeightSource, check_tp, kv_head_range, padded_vocab

BACKENDS = ("fusedist", "torch")
# torch >= 2.13 renames all_gather_into_tensor; the torch backend keeps the name every
# supported torch has.
warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*deprecated")


def _param(t: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(t, requires_grad=False)


def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), w, eps)


def _kernel_rows(t: torch.Tensor, width: int) -> bool:
    """fusedist's single-GPU kernels take rows of `width` elements of t: CUDA tensors, whole
    16-byte vectors (fusedist.add_rmsnorm also holds at most MAX_HIDDEN[dtype])."""
    return t.is_cuda and width % 8 == 0


class _Exchange:
    """The model's three tensor-parallel steps, per backend, and the first RMSNorm."""

    def __init__(self, comm, backend: str):
        self.comm, self.backend, self.tp = comm, backend, comm.group.size
        self.fused = backend == "fusedist"

    def add_rmsnorm(self, partial, residual, w, eps):
        """(rmsnorm(all_reduce(partial) + residual), the new residual). fusedist at TP 1 on
        CUDA: one kernel, residual updated in place."""
        if self.fused and self.tp > 1:
            from ...ops.allreduce_rmsnorm import all_reduce_add_rmsnorm
            return all_reduce_add_rmsnorm(partial, residual, w, eps, group=self.comm)
        if self._fused_norm(partial):
            return add_rmsnorm(partial, residual, w, eps)
        if self.tp > 1:
            dist.all_reduce(partial, group=self.comm.group.pg)
        h = partial + residual
        return rmsnorm(h, w, eps), h

    def rmsnorm(self, h, w, eps):
        """The first layer's input norm of the embeddings h (no exchange)."""
        if self._fused_norm(h):
            return fused_rmsnorm(h, w, eps)
        return rmsnorm(h, w, eps)

    def _fused_norm(self, h) -> bool:
        n = h.shape[-1]
        return self.fused and _kernel_rows(h, n) and n <= MAX_HIDDEN[h.dtype]

    def gather_columns(self, y):
        """[n, v/tp] on each rank -> [n, v], rank r's columns at block r."""
        if self.tp == 1:
            return y
        if self.backend == "fusedist":
            from ...nn.linear import _gather_columns
            return _gather_columns(self.comm, y)
        parts = torch.empty((self.tp * y.shape[0], y.shape[1]), dtype=y.dtype, device=y.device)
        dist.all_gather_into_tensor(parts, y.contiguous(), group=self.comm.group.pg)
        return parts.view(self.tp, y.shape[0], -1).permute(1, 0, 2).reshape(y.shape[0], -1)


class MLP(torch.nn.Module):
    def __init__(self, cfg: LlamaConfig, tp: int, dtype, device, fused: bool = False):
        super().__init__()
        self.inter = cfg.intermediate_size // tp
        self.fused = fused   # silu(gate) * up as one fusedist.silu_mul kernel on CUDA
        # [gate_r; up_r]: one column-parallel GEMM for both.
        self.gate_up = _param(torch.empty(2 * self.inter, cfg.hidden_size, dtype=dtype,
                                          device=device))
        self.down = _param(torch.empty(cfg.hidden_size, self.inter, dtype=dtype, device=device))

    def forward(self, x):
        if not self.fused:   # the torch backend: plain torch throughout
            gu = F.linear(x, self.gate_up)
            return F.linear(F.silu(gu[:, :self.inter]) * gu[:, self.inter:], self.down)
        gu = linear(x, self.gate_up)
        if _kernel_rows(gu, self.inter):
            return linear(silu_mul(gu), self.down)
        return linear(F.silu(gu[:, :self.inter]) * gu[:, self.inter:], self.down)


class Block(torch.nn.Module):
    def __init__(self, cfg: LlamaConfig, attn: torch.nn.Module, tp: int, dtype, device,
                 fused: bool = False):
        super().__init__()
        self.attn = attn
        self.mlp = MLP(cfg, tp, dtype, device, fused)
        self.input_norm = _param(torch.ones(cfg.hidden_size, dtype=dtype, device=device))
        self.post_norm = _param(torch.ones(cfg.hidden_size, dtype=dtype, device=device))


class Transformer(torch.nn.Module):
    """forward(tokens [T], positions [T], cache, meta, seq_rows=None, logits_rows=None) ->
    logits [n, vocab] (float of the model's dtype) for the rows logits_rows of the T tokens
    (all when None). meta is the step's fusedist.nn.AttentionMetadata; seq_rows [num_seqs]
    says which batch row of the cache each of meta's sequences is (the torch backend's static
    cache needs it; the paged cache reads block_table instead)."""

    def __init__(self, cfg: LlamaConfig, *, backend: str = "fusedist", group=None,
                 dtype: torch.dtype = torch.bfloat16, device=None, max_position: int = 0):
        super().__init__()
        if backend not in BACKENDS:
            raise ValueError(f"fusedist.models: backend must be one of {BACKENDS}, got {backend!r}")
        self.cfg, self.backend, self.dtype = cfg, backend, dtype
        self.comm = get_communicator(group)
        self.tp, self.rank = self.comm.group.size, self.comm.group.rank
        check_tp(cfg, self.tp)
        device = torch.device(device) if device is not None else self.comm.device
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        window = cfg.sliding_window or cfg.max_position
        self.max_position = max_position or min(cfg.max_position, window)
        if self.max_position > window:
            raise ValueError(f"fusedist.models: max_position={self.max_position} exceeds the "
                             f"sliding window ({window} tokens), which the model does not "
                             f"apply; keep prompt + new tokens <= {window}")
        self.ex = _Exchange(self.comm, backend)
        self.kv_first, self.local_kv_heads = kv_head_range(cfg.num_kv_heads, self.tp, self.rank)
        self.local_heads = cfg.num_heads // self.tp
        self.vocab_padded = padded_vocab(cfg, self.tp)
        self.vocab_shard = self.vocab_padded // self.tp
        self.embed = _param(torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype,
                                        device=device))
        self.layers = torch.nn.ModuleList(
            Block(cfg, self._attention(), self.tp, dtype, device, self.ex.fused)
            for _ in range(cfg.num_layers))
        self.norm = _param(torch.ones(cfg.hidden_size, dtype=dtype, device=device))
        self.lm_head = _param(torch.empty(self.vocab_shard, cfg.hidden_size, dtype=dtype,
                                          device=device))

    def _attention(self) -> torch.nn.Module:
        cfg = self.cfg
        if self.backend == "torch":
            from .torch_attention import TorchAttention
            return TorchAttention(cfg, self.tp, self.rank, self.max_position, self.dtype,
                                  self.device)
        from ...nn.attention import TPAttention
        return TPAttention(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                           qkv_bias=cfg.qkv_bias, rope_base=cfg.rope_theta,
                           rope_scaling=cfg.rope_scaling, max_position=self.max_position,
                           rope_style="neox", group=self.comm, dtype=self.dtype,
                           device=self.device)

    # ---- weights -------------------------------------------------------------------------
    @torch.no_grad()
    def load(self, src: WeightSource, progress=None) -> "Transformer":
        """Fill every parameter with this rank's slices of `src` (progress(i, n) per layer)."""
        cfg, dt, dev, r = self.cfg, self.dtype, self.device, self.rank

        def rd(name, dim=None, start=0, stop=None):
            return src.read(name, dim, start, stop, dtype=dt, device=dev)

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
        inter = cfg.intermediate_size // self.tp
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            q = dict(q_w=rd(a + "q_proj.weight", 0, r * qn, (r + 1) * qn),
                     k_w=rd(a + "k_proj.weight", 0, k0, k1), v_w=rd(a + "v_proj.weight", 0, k0, k1),
                     o_w=rd(a + "o_proj.weight", 1, r * qn, (r + 1) * qn))
            if cfg.qkv_bias:
                q.update(q_b=rd(a + "q_proj.bias", 0, r * qn, (r + 1) * qn),
                         k_b=rd(a + "k_proj.bias", 0, k0, k1), v_b=rd(a + "v_proj.bias", 0, k0, k1))
            load_attention_shard(layer.attn, **q)
            layer.input_norm.copy_(rd(p + "input_layernorm.weight"))
            layer.post_norm.copy_(rd(p + "post_attention_layernorm.weight"))
            m = p + "mlp."
            i0, i1 = r * inter, (r + 1) * inter
            layer.mlp.gate_up[:inter].copy_(rd(m + "gate_proj.weight", 0, i0, i1))
            layer.mlp.gate_up[inter:].copy_(rd(m + "up_proj.weight", 0, i0, i1))
            layer.mlp.down.copy_(rd(m + "down_proj.weight", 1, i0, i1))
            if progress is not None:
                progress(i + 1, cfg.num_layers)
        return self

    # ---- forward -------------------------------------------------------------------------
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache, meta,
                seq_rows: Optional[torch.Tensor] = None,
                logits_rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        eps, ex = self.cfg.rms_norm_eps, self.ex
        residual = F.embedding(tokens, self.embed)
        x = ex.rmsnorm(residual, self.layers[0].input_norm, eps)
        n = len(self.layers)
        for i, layer in enumerate(self.layers):
            a = self._attend(layer.attn, x, positions, cache, i, meta, seq_rows)
            x, residual = ex.add_rmsnorm(a, residual, layer.post_norm, eps)
            nxt = self.layers[i + 1].input_norm if i + 1 < n else self.norm
            x, residual = ex.add_rmsnorm(layer.mlp(x), residual, nxt, eps)
        if logits_rows is not None:
            x = x.index_select(0, logits_rows)
        head = linear if self.backend == "fusedist" else F.linear
        logits = ex.gather_columns(head(x, self.lm_head))
        return logits[:, :self.cfg.vocab_size]

    def _attend(self, attn, x, positions, cache, layer, meta, seq_rows):
        if self.backend == "torch":
            return attn(x, positions, cache, layer, meta, seq_rows)
        return attn(x, positions, cache, layer, meta, reduce=False)

    # ---- cache ---------------------------------------------------------------------------
    def kv_bytes_per_token(self) -> int:
        return 2 * self.cfg.num_layers * self.local_kv_heads * self.cfg.head_dim * \
            torch.tensor([], dtype=self.dtype).element_size()

    def new_cache(self, max_batch: int, max_seq_len: int, page_size: int, num_pages: int):
        """The KV cache this backend reads: fusedist's PagedKVCache of num_pages pages, or the
        torch backend's static [max_batch, kv heads, max_seq_len, head_dim] per layer."""
        if self.backend == "torch":
            from .torch_attention import StaticKVCache
            return StaticKVCache(self.cfg.num_layers, max_batch, self.local_kv_heads,
                                 max_seq_len, self.cfg.head_dim, self.dtype, self.device)
        from ...nn.kv_cache import PagedKVCache
        return PagedKVCache(self.cfg.num_layers, self.local_kv_heads, self.cfg.head_dim,
                            num_pages, page_size=page_size, dtype=self.dtype, device=self.device)

    def decode_plan(self, batch: int, page_size: int, max_seq_len: int):
        """The host-side plan of batch-`batch` decode attention (None for the torch backend)."""
        if self.backend == "torch":
            return None
        from ...ops.attention import decode_plan
        return decode_plan(batch, self.local_heads, self.local_kv_heads, self.cfg.head_dim,
                           page_size, max_seq_len, self.device, self.dtype)

    def flops_per_token(self, context: int) -> float:
        """Model FLOPs of one token at `context` cached tokens (2 per multiply-add; attention
        counted at its causal average when used for a prefill of `context` tokens)."""
        c = self.cfg
        return 2.0 * (c.num_params() - c.vocab_size * c.hidden_size) + \
            4.0 * c.num_layers * c.q_size * context


@torch.no_grad()
def load_attention_shard(attn, q_w, k_w, v_w, o_w, q_b=None, k_b=None, v_b=None):
    """Hand an attention module this rank's weight shards (q / k / v rows of its heads, o_proj
    columns). fusedist.nn.TPAttention takes full weights in load_full(); writing its
    documented [q_r | k_r | v_r] qkv_weight (and qkv_bias) and o_weight directly keeps the
    rule that a rank reads only its slices of the checkpoint."""
    if hasattr(attn, "load_shard"):
        return attn.load_shard(q_w, k_w, v_w, o_w, q_b, k_b, v_b)
    attn.qkv_weight.copy_(torch.cat((q_w, k_w, v_w)))
    if attn.qkv_bias is not None:
        attn.qkv_bias.copy_(torch.cat((q_b, k_b, v_b)))
    attn.o_weight.copy_(o_w)


def build_model(cfg: LlamaConfig, src: WeightSource, *, backend="fusedist", group=None,
                dtype=torch.bfloat16, device=None, max_position: int = 0, progress=None):
    m = Transformer(cfg, backend=backend, group=group, dtype=dtype, device=device,
                    max_position=max_position)
    return m.load(src, progress).eval()


__all__ = ["Transformer", "build_model", "linear", "rmsnorm", "BACKENDS"]
