"""LlamaConfig: the shape of a Llama-family decoder, read from a Hugging Face config.json.

    cfg = LlamaConfig.from_dir("/ckpt/Meta-Llama-3-8B")      # config.json in a checkpoint dir
    cfg = LlamaConfig.from_hf_config(json.load(open(path)))  # the parsed dict
    cfg = LlamaConfig.named("llama-3-8b")                    # shipped shapes (no network)

Covers LlamaForCausalLM (Llama 2, 3, 3.1, 3.2: RoPE scaling "llama3"), MistralForCausalLM and
Qwen2ForCausalLM (Qwen2 / 2.5: biases on q, k, v). Anything else raises with the list.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Optional

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                "qwen2": "Qwen2ForCausalLM"}


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int = 0                  # 0: hidden_size // num_heads
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None  # HF's dict, e.g. {"rope_type": "llama3", "factor": 8, ...}
    max_position: int = 8192
    qkv_bias: bool = False
    tie_word_embeddings: bool = False
    architecture: str = "LlamaForCausalLM"
    bos_token_id: Optional[int] = None
    eos_token_ids: tuple = ()
    sliding_window: Optional[int] = None  # Mistral: sequences stay within it (not applied)
    name: str = ""
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        for k in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                  "num_kv_heads", "head_dim"):
            v = getattr(self, k)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"LlamaConfig: {k} must be a positive int, got {v!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"LlamaConfig: num_heads={self.num_heads} must be a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_params(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        layer = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 3 * h * i + 2 * h
        head = 0 if self.tie_word_embeddings else v * h
        return self.num_layers * layer + v * h + head + h

    def replace(self, **kw) -> "LlamaConfig":
        return dataclasses.replace(self, **kw)

    @classmethod
    def from_hf_config(cls, d: dict, name: str = "") -> "LlamaConfig":
        archs = d.get("architectures") or [_MODEL_TYPES.get(d.get("model_type", ""), "")]
        arch = archs[0] if archs else ""
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"fusedist.models: architecture {arch or d.get('model_type')!r} is "
                             f"not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        if d.get("mlp_bias"):
            raise ValueError("fusedist.models: mlp_bias=True is not supported (no Llama-family "
                             "checkpoint fusedist knows uses it)")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"fusedist.models: hidden_act {act!r} is not supported; only 'silu'")
        scaling = d.get("rope_scaling")
        if scaling is None and isinstance(d.get("rope_parameters"), dict):
            # transformers >= 5 writes rope_theta and the scaling into rope_parameters.
            rp = dict(d["rope_parameters"])
            theta = rp.pop("rope_theta", None)
            if rp.get("rope_type", rp.get("type", "default")) != "default":
                scaling = rp
            if theta is not None:
                d = {**d, "rope_theta": theta}
        if scaling is not None:
            kind = scaling.get("rope_type", scaling.get("type", "default"))
            if kind == "default":
                scaling = None
            elif kind != "llama3":
                raise ValueError(f"fusedist.models: rope_scaling type {kind!r} is not supported; "
                                 "supported: 'llama3' (Llama 3.1 / 3.2) or none")
        eos = d.get("eos_token_id")
        eos = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        window = d.get("sliding_window") if d.get("use_sliding_window", True) else None
        heads = d["num_attention_heads"]
        qkv_bias = arch == "Qwen2ForCausalLM" or bool(d.get("attention_bias", False))
        return cls(vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
                   intermediate_size=d["intermediate_size"],
                   num_layers=d["num_hidden_layers"], num_heads=heads,
                   num_kv_heads=d.get("num_key_value_heads") or heads,
                   head_dim=d.get("head_dim") or d["hidden_size"] // heads,
                   rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                   rope_theta=float(d.get("rope_theta", 10000.0)),
                   rope_scaling=dict(scaling) if scaling else None,
                   max_position=int(d.get("max_position_embeddings", 8192)),
                   qkv_bias=qkv_bias, tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                   architecture=arch, bos_token_id=d.get("bos_token_id"), eos_token_ids=eos,
                   sliding_window=window, name=name, extra=dict(d))

    @classmethod
    def from_dir(cls, path: str) -> "LlamaConfig":
        f = os.path.join(path, "config.json")
        if not os.path.isfile(f):
            raise FileNotFoundError(f"fusedist.models: no config.json in {path!r}; pass the "
                                    "directory of a Hugging Face checkpoint")
        with open(f) as fh:
            return cls.from_hf_config(json.load(fh), name=os.path.basename(path.rstrip("/")))

    @classmethod
    def named(cls, name: str) -> "LlamaConfig":
        if name not in NAMED:
            raise ValueError(f"fusedist.models: unknown config {name!r}; named configs: "
                             f"{', '.join(NAMED)}")
        return NAMED[name]


_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

# Shapes shipped with fusedist (no network access assumed): Meta's published configs.
NAMED = {
    "llama-3-8b": LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                              num_layers=32, num_heads=32, num_kv_heads=8, rms_norm_eps=1e-5,
                              rope_theta=500000.0, max_position=8192, eos_token_ids=(128001,),
                              bos_token_id=128000, name="llama-3-8b"),
    "llama-3.1-8b": LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                num_layers=32, num_heads=32, num_kv_heads=8, rms_norm_eps=1e-5,
                                rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE,
                                max_position=131072, eos_token_ids=(128001, 128008, 128009),
                                bos_token_id=128000, name="llama-3.1-8b"),
    "llama-3-70b": LlamaConfig(vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                               num_layers=80, num_heads=64, num_kv_heads=8, rms_norm_eps=1e-5,
                               rope_theta=500000.0, max_position=8192, eos_token_ids=(128001,),
                               bos_token_id=128000, name="llama-3-70b"),
    # Small enough for a CPU to generate tokens in seconds at TP 2 over gloo.
    "tiny": LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=688, num_layers=2,
                        num_heads=4, num_kv_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0,
                        max_position=2048, name="tiny"),
}
