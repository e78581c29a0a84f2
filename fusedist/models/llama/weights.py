"""Where a Llama-family model's weights come from, read one rank's slices at a time.

    src = SafetensorsWeights("/ckpt/dir")       # model.safetensors or a sharded index
    src = RandomWeights(cfg, seed=0)            # --random-weights
    w = src.read("model.layers.0.mlp.up_proj.weight", dim=0, start=r * n, stop=(r + 1) * n,
                 dtype=torch.bfloat16, device=dev)

A safetensors rank reads only the rows / columns it keeps (safe_open + get_slice), never a full
copy of the model. Random weights are defined per tensor by (seed, name) over the FULL tensor,
then sliced, so every tensor-parallel size sees the same model: replicated tensors are equal on
every rank, and rank r's shard is rows / columns of the full random tensor.

The sharding rules: Transformer.load (model.py) names which dimension of which tensor is split;
fusedist.nn.attention.kv_head_range says which kv heads a rank keeps (replicated when tp > kv
heads), for the model, TPAttention and the tests alike.
"""

from __future__ import annotations

import json
import os
import zlib
from typing import Optional

import torch

from ...nn.attention import kv_head_range
from .config import LlamaConfig


def hf_names(cfg: LlamaConfig) -> list[str]:
    """Every tensor a checkpoint of cfg must hold (HF names)."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not cfg.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        names += [p + f"self_attn.{x}_proj.weight" for x in "qkvo"]
        if cfg.qkv_bias:
            names += [p + f"self_attn.{x}_proj.bias" for x in "qkv"]
        names += [p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
    return names


def check_tp(cfg: LlamaConfig, tp: int) -> None:
    for what, n in (("num_heads", cfg.num_heads), ("intermediate_size", cfg.intermediate_size)):
        if n % tp:
            raise ValueError(f"fusedist.models: {what}={n} of {cfg.name or 'the model'} is not "
                             f"divisible by tp={tp}; pick a tp that divides it")
    kv_head_range(cfg.num_kv_heads, tp, 0)   # raises when the kv heads do not split evenly


def padded_vocab(cfg: LlamaConfig, tp: int) -> int:
    """Vocabulary rounded up so the LM head splits into tp equal shards of whole 8-row groups
    (16-byte GEMM rows); the padding rows are zero and their logits are cut off."""
    step = 8 * tp
    return (cfg.vocab_size + step - 1) // step * step


def _seed(seed: int, name: str) -> int:
    return (seed * 1000003 + zlib.crc32(name.encode())) & ((1 << 63) - 1)


class WeightSource:
    """read(name, dim, start, stop, dtype, device) -> the [start:stop] slice of tensor `name`
    along `dim` (the whole tensor when dim is None)."""

    def read(self, name: str, dim: Optional[int] = None, start: int = 0,
             stop: Optional[int] = None, *, dtype: torch.dtype,
             device: torch.device) -> torch.Tensor:
        raise NotImplementedError

    def shape(self, name: str) -> tuple:
        raise NotImplementedError


class SafetensorsWeights(WeightSource):
    def __init__(self, path: str):
        self.path = path
        index = os.path.join(path, "model.safetensors.index.json")
        single = os.path.join(path, "model.safetensors")
        if os.path.isfile(index):
            with open(index) as f:
                self.where = dict(json.load(f)["weight_map"])
            self.index = index
        elif os.path.isfile(single):
            self.where = None
            self.index = None
        else:
            raise FileNotFoundError(f"fusedist.models: {path!r} has neither model.safetensors nor "
                                    "model.safetensors.index.json; pass a Hugging Face "
                                    "safetensors checkpoint directory")
        self._files: dict = {}

    def _file(self, name: str):
        from safetensors import safe_open

        if self.where is None:
            fname = "model.safetensors"
        elif name in self.where:
            fname = self.where[name]
        else:
            raise KeyError(f"fusedist.models: tensor {name!r} is missing: not in the weight map of "
                           f"{self.index}")
        full = os.path.join(self.path, fname)
        if full not in self._files:
            if not os.path.isfile(full):
                raise FileNotFoundError(f"fusedist.models: {full} (listed for tensor {name!r}) "
                                        "does not exist")
            self._files[full] = safe_open(full, framework="pt", device="cpu")
        f = self._files[full]
        if name not in f.keys():
            raise KeyError(f"fusedist.models: tensor {name!r} is missing from {full}")
        return f

    def shape(self, name: str) -> tuple:
        return tuple(self._file(name).get_slice(name).get_shape())

    def read(self, name, dim=None, start=0, stop=None, *, dtype, device):
        sl = self._file(name).get_slice(name)
        if dim is None:
            t = sl[:]
        elif dim == 0:
            t = sl[start:stop]
        else:
            t = sl[:, start:stop]
        return t.to(device=device, dtype=dtype)

    def close(self):
        self._files.clear()


class RandomWeights(WeightSource):
    """A seeded random model: linear weights and embeddings N(0, std^2) (std 0.02, Hugging
    Face's initializer_range, which keeps the activations of a 32-layer random Llama finite),
    biases N(0, 0.02^2), norm weights 1."""

    def __init__(self, cfg: LlamaConfig, seed: int = 0, std: float = 0.02):
        self.cfg, self.seed, self.std = cfg, seed, std
        self._shapes = _full_shapes(cfg)

    def shape(self, name):
        if name not in self._shapes:
            raise KeyError(f"fusedist.models: tensor {name!r} is not part of the model")
        return self._shapes[name]

    def read(self, name, dim=None, start=0, stop=None, *, dtype, device):
        shape = self.shape(name)
        if name.endswith("norm.weight"):
            full = torch.ones(shape, dtype=torch.float32, device=device)
        else:
            g = torch.Generator(device=device)
            g.manual_seed(_seed(self.seed, name))
            full = torch.randn(shape, generator=g, dtype=torch.float32, device=device)
            full.mul_(self.std)
        if dim is not None:
            full = full.narrow(dim, start, (shape[dim] if stop is None else stop) - start)
        return full.to(dtype).contiguous()


def _full_shapes(cfg: LlamaConfig) -> dict:
    h, i, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    s = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        s["lm_head.weight"] = (v, h)
    for n in range(cfg.num_layers):
        p = f"model.layers.{n}."
        s[p + "input_layernorm.weight"] = (h,)
        s[p + "post_attention_layernorm.weight"] = (h,)
        s[p + "self_attn.q_proj.weight"] = (cfg.q_size, h)
        s[p + "self_attn.k_proj.weight"] = (cfg.kv_size, h)
        s[p + "self_attn.v_proj.weight"] = (cfg.kv_size, h)
        s[p + "self_attn.o_proj.weight"] = (h, cfg.q_size)
        if cfg.qkv_bias:
            s[p + "self_attn.q_proj.bias"] = (cfg.q_size,)
            s[p + "self_attn.k_proj.bias"] = (cfg.kv_size,)
            s[p + "self_attn.v_proj.bias"] = (cfg.kv_size,)
        s[p + "mlp.gate_proj.weight"] = (i, h)
        s[p + "mlp.up_proj.weight"] = (i, h)
        s[p + "mlp.down_proj.weight"] = (h, i)
    return s


def open_weights(path: Optional[str], cfg: LlamaConfig, random_seed: Optional[int]) -> WeightSource:
    if random_seed is not None:
        return RandomWeights(cfg, seed=random_seed)
    if path is None:
        raise ValueError("fusedist.models: pass a checkpoint directory or random weights")
    return SafetensorsWeights(path)
