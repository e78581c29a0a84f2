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
import math
import os
from dataclasses import dataclass, field
from typing import Optional

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                "qwen2": "Qwen2ForCausalLM"}
# config.json keys without a default (Hugging Face's names).
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor",
                "original_max_position_embeddings")


def _check_llama3_rope(scaling: dict, key: str, fail) -> dict:
    """scaling with its llama3 factors checked: each present, a finite number > 0, and
    high_freq_factor > low_freq_factor (else the RoPE table has NaN or inf entries)."""
    for k in _LLAMA3_KEYS:
        if k not in scaling:
            fail(f"{key} has no {k!r}; llama3 RoPE scaling needs {', '.join(_LLAMA3_KEYS)}")
        v = scaling[k]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or \
                v <= 0:
            fail(f"{key} {k} must be a finite number > 0, got {v!r}")
    if scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        fail(f"{key} high_freq_factor must be > low_freq_factor, got "
             f"{scaling['high_freq_factor']!r} <= {scaling['low_freq_factor']!r}")
    return dict(scaling)


def load_json(path: str, fix: str):
    """The JSON document in `path`; a ValueError naming the file and `fix` when it is not JSON."""
    with open(path) as fh:
        try:
            return json.load(fh)
        except ValueError as e:   # json.JSONDecodeError, UnicodeDecodeError
            raise ValueError(f"fusedist.models: {path} is not valid JSON ({e}); {fix}") from None


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

    def position_limit(self) -> tuple:
        """(the most positions a sequence may use, what sets that limit): max_position_embeddings,
        or the sliding window when it is shorter (fusedist does not apply a sliding window)."""
        if self.sliding_window is not None and self.sliding_window < self.max_position:
            return (self.sliding_window, f"the sliding window ({self.sliding_window} tokens), "
                    "which the model does not apply")
        return self.max_position, f"max_position_embeddings ({self.max_position})"

    @classmethod
    def from_hf_config(cls, d: dict, name: str = "", *, source: str = "") -> "LlamaConfig":
        """The config of a Hugging Face config.json's dict; `source` (the file) is named in the
        errors. Every value fusedist reads is checked here: a missing key, a non-positive size
        or head count, kv heads that do not divide the heads, RoPE factors that would give a
        NaN table raise a ValueError naming the key."""
        where = f"config.json ({source})" if source else "the config"

        def fail(msg: str):
            raise ValueError(f"fusedist.models: {where}: {msg}")

        if not isinstance(d, dict):
            fail(f"must be a JSON object, got {type(d).__name__}")
        archs = d.get("architectures") or [_MODEL_TYPES.get(d.get("model_type", ""), "")]
        arch = archs[0] if isinstance(archs, list) and archs else ""
        if arch not in SUPPORTED_ARCHITECTURES:
            fail(f"architecture {arch or d.get('model_type')!r} is not supported; supported: "
                 f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        if d.get("mlp_bias"):
            fail("mlp_bias=True is not supported (no Llama-family checkpoint fusedist knows "
                 "uses it)")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            fail(f"hidden_act {act!r} is not supported; only 'silu'")

        def size(key, required=True, default=None):
            """A positive int (None when absent and not required)."""
            if key not in d or (d[key] is None and not required):
                if required:
                    fail(f"has no {key!r}; a Llama-family config.json needs "
                         f"{', '.join(_REQUIRED)}")
                return default
            v = d[key]
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                fail(f"{key} must be a positive int, got {v!r}")
            return v

        def number(key, default):
            v = d.get(key)
            if v is None:
                return default
            if isinstance(v, bool) or not isinstance(v, (int, float)) or \
                    not math.isfinite(v) or v <= 0:
                fail(f"{key} must be a finite number > 0, got {v!r}")
            return float(v)

        vocab, hidden, inter, layers, heads = (size(k) for k in _REQUIRED)
        kv_heads = size("num_key_value_heads", required=False, default=heads)
        if heads % kv_heads:
            fail(f"num_key_value_heads={kv_heads} must divide num_attention_heads={heads}")
        head_dim = size("head_dim", required=False)
        if head_dim is None:
            if hidden % heads:
                fail(f"hidden_size={hidden} is not a multiple of num_attention_heads={heads}; "
                     "give head_dim")
            head_dim = hidden // heads
        max_position = size("max_position_embeddings", required=False, default=8192)
        window = size("sliding_window", required=False) if d.get("use_sliding_window", True) \
            else None
        rope_theta = number("rope_theta", 10000.0)
        scaling, scaling_key = d.get("rope_scaling"), "rope_scaling"
        if scaling is None and d.get("rope_parameters") is not None:
            # transformers >= 5 writes rope_theta and the scaling into rope_parameters.
            scaling_key = "rope_parameters"
            if not isinstance(d["rope_parameters"], dict):
                fail(f"rope_parameters must be a JSON object, got {d['rope_parameters']!r}")
            rp = dict(d["rope_parameters"])
            theta = rp.pop("rope_theta", None)
            if rp.get("rope_type", rp.get("type", "default")) != "default":
                scaling = rp
            if theta is not None:
                d = {**d, "rope_theta": theta}
                rope_theta = number("rope_theta", 10000.0)
        if scaling is not None:
            if not isinstance(scaling, dict):
                fail(f"{scaling_key} must be a JSON object or null, got {scaling!r}")
            kind = scaling.get("rope_type", scaling.get("type", "default"))
            if kind == "default":
                scaling = None
            elif kind != "llama3":
                fail(f"rope_scaling type {kind!r} is not supported; supported: 'llama3' "
                     "(Llama 3.1 / 3.2) or none")
            else:
                scaling = _check_llama3_rope(scaling, scaling_key, fail)
        eos = d.get("eos_token_id")
        eos = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        qkv_bias = arch == "Qwen2ForCausalLM" or bool(d.get("attention_bias", False))
        return cls(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                   num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                   rms_norm_eps=number("rms_norm_eps", 1e-6), rope_theta=rope_theta,
                   rope_scaling=scaling, max_position=max_position,
                   qkv_bias=qkv_bias, tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                   architecture=arch, bos_token_id=d.get("bos_token_id"), eos_token_ids=eos,
                   sliding_window=window, name=name, extra=dict(d))

    @classmethod
    def from_dir(cls, path: str) -> "LlamaConfig":
        f = os.path.join(path, "config.json")
        if not os.path.isfile(f):
            raise FileNotFoundError(f"fusedist.models: no config.json in {path!r}; pass the "
                                    "directory of a Hugging Face checkpoint")
        d = load_json(f, "fix or re-download the checkpoint's config.json")
        return cls.from_hf_config(d, name=os.path.basename(path.rstrip("/")), source=f)

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
